"""One stage interpreter (`kernel.apply_stage`) and one statement of the boundary order (`Policy.boundary_segments`).

A recording `Ops` stands in for the other ranks: it returns its input and notes which group each all-reduce
met, so the order the kernel runs the boundary in is observed, not re-derived.
"""

import dataclasses
import math

import pytest
import torch

from simdist.gradpath.kernel import GradPath, apply_stage
from simdist.gradpath.path import PathConfig
from simdist.gradpath.policy import Stage
from simdist.gradpath.probes import BOUNDARY
from simdist.policies.catalogue import get_policy, policy_names
from simdist.reduce import make_reduction
from simdist.sources.synthetic import DEFAULT_PARAMS


class Recording:
    """Ops of one rank whose group sums are the identity; ``reduced`` lists ``(group, model)`` in call order."""

    batch = ()

    def __init__(self) -> None:
        self.reduced: list[tuple[str, object]] = []

    def all_reduce(self, value, kind, model=None):
        self.reduced.append((kind, model))
        return value.clone()

    def stochastic_cast(self, value, dtype, key):
        self.reduced.append(("stochastic", key))
        return value.to(dtype)

    def on_tp_root(self, value):
        return value

    def grad_norm(self, total):
        return float(total.sum()) ** 0.5


def test_apply_stage_runs_each_kind_and_asks_the_ranks_only_for_a_reduction():
    x = torch.tensor([1.0, 3.0, -0.0], dtype=torch.float32)
    assert apply_stage(Stage("cast", dtype=torch.bfloat16), x).dtype == torch.bfloat16
    assert torch.equal(apply_stage(Stage("divide", divisor=3), x), x / 3)
    assert torch.equal(apply_stage(Stage("scale", divisor=3), x), x * (1.0 / 3))  # not x / 3: a rounded factor
    five = torch.tensor([5.0])
    assert not torch.equal(apply_stage(Stage("scale", divisor=3), five), five / 3)
    with pytest.raises(ValueError, match="needs their ops"):
        apply_stage(Stage("all_reduce", group="dp"), x)
    ops, tree = Recording(), make_reduction("tree")
    apply_stage(Stage("all_reduce", group="tp"), x, ops, tp_reduction=tree)
    apply_stage(Stage("all_reduce", group="edp"), x, ops, tp_reduction=tree)
    apply_stage(Stage("cast", dtype=torch.bfloat16, rounding="stochastic"), x, ops, key=(1, 2, 3))
    assert ops.reduced == [("tp", tree), ("edp", None), ("stochastic", (1, 2, 3))]
    with pytest.raises(ValueError, match="unknown stage kind"):
        apply_stage(Stage("accumulate"), x)


def _policies():
    for name in policy_names():
        policy = get_policy(name)
        for correct_at in ("micro_step", "boundary", "after_dp"):
            yield dataclasses.replace(policy, correct_at=correct_at, tp_reduction=None)


@pytest.mark.parametrize("policy", list(_policies()), ids=lambda p: f"{p.name}-{p.correct_at}")
def test_the_kernel_runs_the_boundary_in_the_order_the_policy_states(policy):
    """Every group the boundary reduces over, parameter by parameter, is the policy's `boundary_stages` order;
    the captures are `boundary_segments`' (``boundary_corrected`` even for a family with no correction)."""
    tp, dp = 2, 2
    params = [p for p in DEFAULT_PARAMS if not p.frozen]
    ops = Recording()
    captured: list[tuple[str, str]] = []

    def capture(step, micro, name, stage, value):
        if micro == BOUNDARY and stage in ("boundary_corrected", "dp_reduced"):
            captured.append((name, stage))

    lp = torch.zeros(sum(math.prod(p.shape) for p in params), dtype=policy.grad_dtype)
    path = GradPath(ops, params, policy, PathConfig(steps=1), lp, tp=tp, dp=dp, capture=capture, norm=False)
    path.boundary(0)
    groups = [kind for kind, _ in ops.reduced]
    expected = [s.group for p in params for s in policy.boundary_stages(p.family, tp, dp) if s.kind == "all_reduce"]
    assert groups == expected
    segments = [(p.name, c) for p in params for _, c in policy.boundary_segments(p.family, tp, dp)]
    assert captured == segments
    order = {"micro_step": ["dp_reduced"], "boundary": ["boundary_corrected", "dp_reduced"]}
    assert [c for n, c in captured if n == params[0].name] == order.get(policy.correct_at, ["dp_reduced"])
    router = next(p for p in params if p.name == "router.weight")  # TP-averaged: reduced over TP at the boundary
    dp_groups = ["dp"] if policy.dp_at == "boundary" else []
    tp_groups = [] if policy.correct_at == "micro_step" else ["tp"]
    stated = dp_groups + tp_groups if policy.correct_at == "after_dp" else tp_groups + dp_groups  # Megatron: DP first
    assert [s.group for s in policy.boundary_stages(router.family, tp, dp) if s.kind == "all_reduce"] == stated
