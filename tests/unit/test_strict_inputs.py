"""Bad arguments raise clear errors instead of running as something else (issue [fidelity] point 2).

Each case names what was wrong, what was expected and what was got: a typo in
an enum-valued option, a gradient of the wrong dtype or shape, a source that
delivers nothing (or delivers twice, or for a frozen or unknown parameter).
"""

from __future__ import annotations

import pytest
import torch

from simdist.gradpath.families import Family, ParamSpec
from simdist.gradpath.path import PathConfig, train_rank
from simdist.policies.catalogue import get_policy
from simdist.reduce import make_reduction
from simdist.studies.crosscheck import CrossCheck
from simdist.studies.growth import GrowthConfig
from simdist.studies.repro import ReproConfig
from simdist.world.simworld import SimWorld
from simdist.world.spec import ParallelSpec

SPEC = ParallelSpec(2, tp=2, ep=1)
ROUTER = ParamSpec("router", Family.ROUTER_GATE_REPLICATED, (3,))
FROZEN = ParamSpec("embedding", Family.DENSE, (2,), frozen=True)


def initial(rank: int, param: ParamSpec) -> torch.Tensor:
    return torch.full(param.shape, 0.25, dtype=torch.bfloat16)


def run(grads, params=(ROUTER,), config: PathConfig | None = None):
    """``grads(step, micro, rank, param)`` through `train_rank` on 2 SimWorld ranks (TP2), bf16_writeback."""
    config = config or PathConfig(steps=1, gas=2)
    return SimWorld(SPEC).run(train_rank, list(params), initial, grads, get_policy("bf16_writeback"), config)


def good(step: int, micro: int, rank: int, param: ParamSpec) -> torch.Tensor:
    return torch.full(param.shape, 0.5 + rank, dtype=torch.bfloat16)


@pytest.mark.parametrize(
    "build, message",
    [
        (
            lambda: PathConfig(marker="per-micro-step"),
            "unknown marker 'per-micro-step'; valid: deepspeed, per_micro_step",
        ),
        (lambda: PathConfig(update_path="immediate"), "unknown update_path 'immediate'; valid: epilogue, hooks"),
        (lambda: ReproConfig(marker="per-micro-step"), "unknown marker 'per-micro-step'"),
        (lambda: ReproConfig(update_path="immediate"), "unknown update path 'immediate'"),
        (lambda: ReproConfig(reduction="glooo"), "unknown reduction 'glooo'; valid: sequential, ring"),
        (lambda: ReproConfig(source="moe2"), "unknown source 'moe2'; valid: synthetic, moe"),
        (lambda: ReproConfig(code="real"), "unknown code 'real'; valid: transcribed, deepspeed"),
        (lambda: GrowthConfig(marker="deepspeed "), "unknown marker 'deepspeed '"),
        (lambda: CrossCheck(update_path="hook"), "unknown update path 'hook'"),
        (lambda: make_reduction("glooo"), "unknown reduction 'glooo'; valid: sequential, ring"),
    ],
)
def test_a_typo_in_an_option_raises_and_lists_the_valid_values(build, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        build()


def test_options_accept_their_enum_members_and_string_values_alike():
    assert ReproConfig(marker="per_micro_step", update_path="hooks") == ReproConfig(
        marker=PathConfig(marker="per_micro_step").marker, update_path=PathConfig(update_path="hooks").update_path
    )


def test_a_gradient_of_the_wrong_dtype_names_parameter_expected_and_got():
    def fp32(step, micro, rank, param):
        return good(step, micro, rank, param).float()

    with pytest.raises(
        ValueError,
        match=r"gradient of 'router': expected dtype bfloat16 and shape \[3\], "
        r"got dtype float32 and shape \[3\]",
    ):
        run(fp32)


def test_a_gradient_of_the_wrong_shape_does_not_broadcast_into_the_buffer():
    def scalar(step, micro, rank, param):
        return torch.tensor(0.5, dtype=torch.bfloat16)

    with pytest.raises(ValueError, match=r"expected dtype bfloat16 and shape \[3\], got dtype bfloat16 and shape \[\]"):
        run(scalar)


class Source:
    """A `GradientSource` that delivers what it is told to, per micro-step."""

    def __init__(self, deliveries) -> None:
        self.deliveries = deliveries

    def backward(self, comm, step, micro, lp, deliver, hooks) -> None:
        for name in self.deliveries(micro):
            deliver(name, torch.full((3,), 0.5, dtype=torch.bfloat16))


def test_a_source_that_delivers_nothing_is_an_error_naming_the_parameter_and_micro_step():
    with pytest.raises(ValueError, match=r"no gradient was delivered on step 0, micro-step 0 for 'router'"):
        run(Source(lambda micro: []))


def test_a_source_that_skips_one_micro_step_is_an_error():
    with pytest.raises(ValueError, match=r"step 0, micro-step 1 for 'router'"):
        run(Source(lambda micro: ["router"] if micro == 0 else []))


@pytest.mark.parametrize(
    "names, message",
    [
        (["router", "router"], "the gradient of 'router' was delivered twice on step 0, micro-step 0"),
        (["router", "embedding"], "a gradient was delivered for 'embedding', which is declared frozen"),
        (["router", "bias"], "a gradient was delivered for 'bias', which is not a parameter of this run"),
    ],
)
def test_deliveries_are_once_per_micro_step_and_only_for_trained_parameters(names, message):
    with pytest.raises(ValueError, match=message):
        run(Source(lambda micro: names), params=(ROUTER, FROZEN))


def test_a_frozen_parameter_needs_no_gradient_and_keeps_its_weights():
    seen = []

    class Recording(Source):
        def backward(self, comm, step, micro, lp, deliver, hooks) -> None:
            seen.append(lp["embedding"].clone())
            super().backward(comm, step, micro, lp, deliver, hooks)

    traces = run(Recording(lambda micro: ["router"]), params=(ROUTER, FROZEN), config=PathConfig(steps=2))
    for trace in traces:
        assert {key[2] for key in trace.values} == {"router"}  # nothing captured for the frozen parameter
        assert not torch.equal(trace.get(1, -1, "router", "param"), initial(0, ROUTER))  # the router did train
    assert len(seen) == 4  # 2 ranks x 2 steps
    assert all(torch.equal(weights, initial(0, FROZEN)) for weights in seen)
