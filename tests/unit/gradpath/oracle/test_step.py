"""The independent oracle (`simdist.gradpath.oracle`) and the gradient path's AdamW against the real optimizer.

The oracle shares no code with the gradient path it judges, so breaking the gradient path must change the #8913 verdict;
the gradient path's AdamW must be torch.optim.AdamW bit for bit.
"""

import dataclasses
import zlib

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from simdist.gradpath import kernel
from simdist.gradpath.families import _CORRECTIONS, Correction, Family
from simdist.gradpath.oracle import CORRECTIONS, Oracle, correction, dp_kind
from simdist.gradpath.path import AdamW
from simdist.gradpath.probes import BOUNDARY
from simdist.numerics.floats import bitwise_equal
from simdist.reduce import Sequential
from simdist.reduce.gloo import Gloo
from simdist.sources.synthetic import DEFAULT_PARAMS
from simdist.studies.repro import ReproConfig, reproduce
from simdist.testing._internal.compact import PARAMS, run_oracle
from simdist.testing.strategies import float_values
from simdist.world.spec import ParallelSpec

FAST = ReproConfig(steps=2)


@pytest.mark.slow  # in the default suite property (a) and the repro tests compare the path's masters with the real one
@given(
    st.sampled_from([1e-3, 3e-2]),
    st.sampled_from([(0.9, 0.999), (0.8, 0.95)]),
    st.sampled_from([1e-8, 1e-6]),
    st.sampled_from([0.0, 0.01, 0.1]),
    st.lists(float_values(torch.float32, min_exponent=-20, max_exponent=2), min_size=12, max_size=12),
)
def test_engine_adamw_is_torch_optim_adamw_bit_for_bit(lr, betas, eps, weight_decay, values):
    """The engine's one pass over a flat ``[rank, N]`` buffer equals torch.optim.AdamW on each parameter's own
    tensor, for three steps: masters and both moments."""
    h = AdamW(lr=lr, beta1=betas[0], beta2=betas[1], eps=eps, weight_decay=weight_decay)
    grads = torch.tensor(values).reshape(2, 6)
    flat = torch.linspace(-1, 1, 12).reshape(2, 6)
    m, v = torch.zeros_like(flat), torch.zeros_like(flat)
    pieces = [torch.nn.Parameter(flat[r, a:b].clone()) for r in range(2) for a, b in ((0, 2), (2, 6))]
    real = torch.optim.AdamW(pieces, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    for step in range(1, 4):
        g = grads * step
        kernel.adamw_step(flat, g, m, v, step, h)
        for piece, (r, a, b) in zip(pieces, [(r, a, b) for r in range(2) for a, b in ((0, 2), (2, 6))], strict=True):
            piece.grad = g[r, a:b].clone()
        real.step()
    for piece, (r, a, b) in zip(pieces, [(r, a, b) for r in range(2) for a, b in ((0, 2), (2, 6))], strict=True):
        state = real.state[piece]
        assert bitwise_equal(piece.detach(), flat[r, a:b])
        assert bitwise_equal(state["exp_avg"], m[r, a:b]) and bitwise_equal(state["exp_avg_sq"], v[r, a:b])


def test_the_oracle_restates_the_folding_rule_and_agrees_with_the_family_table():
    """Two independent statements of DeepSpeed's rule (the engine's `Family.correction`, the oracle's table)."""
    for family in Family:
        engine = _CORRECTIONS[family]
        assert CORRECTIONS[family] == (engine.reduces, engine.divides), family
        assert correction(family, 1) == (False, False) and family.correction(1) is Correction.SKIP
        assert dp_kind(family) == family.dp_group


def test_the_unperturbed_engine_reproduces_8913_against_the_independent_oracle():
    reports, verdict = reproduce(FAST)
    assert verdict.reproduced, verdict.line
    staging = next(r for r in reports if r.name == "fp32_staging")
    kinds = {r.kind for r in staging.rows}
    assert {"fp32 master", "adam m", "adam v", "hp grad"} <= kinds and all(r.bitwise_equal for r in staging.rows)


def _eps_doubled(p, g, m, v, step, h, real=kernel.adamw_step):
    real(p, g, m, v, step, dataclasses.replace(h, eps=h.eps * 2))


def test_a_perturbed_engine_adamw_epsilon_changes_the_8913_verdict(monkeypatch):
    """The oracle's step is torch.optim.AdamW, not the gradient path's: doubling the gradient path's epsilon is seen."""
    monkeypatch.setattr(kernel, "adamw_step", _eps_doubled)
    reports, verdict = reproduce(FAST)
    assert not verdict.reproduced
    staging = next(r for r in reports if r.name == "fp32_staging")
    differing = {r.kind for r in staging.rows if not r.bitwise_equal}
    assert differing == {"fp32 master"}  # the moments do not depend on epsilon; the gradients are untouched


def _no_weight_decay(p, g, m, v, step, h, real=kernel.adamw_step):
    real(p, g, m, v, step, dataclasses.replace(h, weight_decay=0.0))


@pytest.mark.slow
@pytest.mark.parametrize("mutation", ["weight decay", "family table", "accumulate", "bf16 tp sum", "bf16 tp sum tp4"])
def test_other_engine_perturbations_change_the_8913_verdict(monkeypatch, mutation):
    config = FAST
    if mutation.startswith("bf16 tp sum"):  # the gradient path sums TP in BF16 (and casts back): seen at TP2 and TP4

        def all_reduce(value, kind, reduction=None, real=None, ops=None):
            summed = real(value.to(torch.bfloat16) if kind == "tp" else value, kind, reduction)
            return summed.to(value.dtype)

        original = kernel.GradPath.apply

        def apply(self, stage, value, key):
            if stage.kind == "all_reduce" and stage.group == "tp":
                return all_reduce(value, "tp", self.policy.tp_reduction, real=self.ops.all_reduce)
            return original(self, stage, value, key)

        monkeypatch.setattr(kernel.GradPath, "apply", apply)
        if mutation.endswith("tp4"):
            config = dataclasses.replace(FAST, spec=ParallelSpec(4, tp=4, ep=2))
    elif mutation == "weight decay":
        monkeypatch.setattr(kernel, "adamw_step", _no_weight_decay)
    elif mutation == "family table":  # the gradient path reads the table; the oracle restates the rule
        monkeypatch.setitem(_CORRECTIONS, Family.ROUTER_GATE_PARTIAL, Correction.AVERAGE)
    else:  # the gradient path drops its TP correction result and accumulates the staged local gradient

        def apply(self, stage, value, key, real=kernel.GradPath.apply):
            out = real(self, stage, value, key)
            return value if stage.kind == "divide" else out

        monkeypatch.setattr(kernel.GradPath, "apply", apply)
    _, verdict = reproduce(config)
    assert not verdict.reproduced


def test_the_oracle_refuses_to_clip():
    with pytest.raises(ValueError, match="does not clip"):
        Oracle(ParallelSpec(2, tp=2, ep=1), [], {}, tp_reduction=Sequential(), dp_reduction=Sequential(), max_norm=1.0)


def test_a_batch_item_gets_the_bits_it_gets_alone():
    """Seeds ride along as a leading dimension; gloo's order depends on the tensor size, so the oracle reduces each
    item on its own (reducing the batched tensor at once changes bits: the mutation this test kills)."""
    spec = ParallelSpec(8, tp=2, ep=2)
    reduction = Gloo()
    gen = torch.Generator().manual_seed(3)
    grads = {
        (s, r, p.name): (
            torch.randn(p.shape, generator=gen) * 2.0 ** torch.randint(-12, 12, p.shape, generator=gen)
        ).to(torch.bfloat16)
        for s in range(3)
        for r in range(8)
        for p in DEFAULT_PARAMS
    }
    initial = {(r, p.name): torch.zeros(p.shape, dtype=torch.bfloat16) for r in range(8) for p in DEFAULT_PARAMS}

    def run(seeds: list[int]) -> Oracle:
        start = {k: torch.stack([v] * len(seeds)) for k, v in initial.items()}
        oracle = Oracle(spec, DEFAULT_PARAMS, start, tp_reduction=reduction, dp_reduction=reduction)
        for step in range(2):
            oracle.step(
                step,
                1,
                lambda micro, lp, step=step: {
                    (r, p.name): torch.stack([grads[(s, r, p.name)] * (step + 1) for s in seeds])
                    for r in range(8)
                    for p in DEFAULT_PARAMS
                },
            )
        return oracle

    together, alone = run([0, 1, 2]), run([1])
    for kind in ("master", "m", "v", "lp"):
        assert bitwise_equal(together.flat(kind)[1], alone.flat(kind)[0]), kind


def test_the_compact_oracle_sees_a_tp4_sum_rounded_to_bf16():
    """At TP4 the FP32 TP sum of four BF16 terms differs from a BF16 sum: the oracle keeps the FP32 one."""
    spec = ParallelSpec(4, tp=4, ep=1)
    terms = [1.0, 2.0**-8, 2.0**-8, 2.0**-8]  # in BF16, 1 + 2**-8 is a tie that rounds back to 1

    def local(step, micro, rank, param):
        return torch.full(param.shape, terms[rank], dtype=torch.bfloat16)

    traces = run_oracle(spec, local, 1, 1, params=PARAMS[:1], keep=frozenset({"tp_reduced"}))
    value = traces[0].get(0, 0, PARAMS[0].name, "tp_reduced")
    assert value.dtype == torch.float32 and bool((value == 1.0 + 3 * 2.0**-8).all())


def test_the_matched_policy_on_the_gradient_path_gives_the_independent_oracles_bits():
    """`MATCHED_FP32` (a Policy the gradient path runs, for gradient-path tests) agrees with the independent oracle."""
    from simdist.gradpath.matched_policy import MATCHED_FP32
    from simdist.gradpath.path import PathConfig
    from simdist.testing._internal.compact import OPTIMIZER_STAGES, run_batched

    spec = ParallelSpec(4, tp=2, ep=2)

    def local(step, micro, rank, param):
        gen = torch.Generator().manual_seed(zlib.crc32(repr((step, micro, rank, param.name)).encode()))
        return (torch.randn(param.shape, generator=gen) * 2.0 ** torch.randint(-9, 9, param.shape, generator=gen)).to(
            torch.bfloat16
        )

    config = PathConfig(steps=2, gas=2, marker="per_micro_step")
    engine = run_batched(spec, MATCHED_FP32, local, config, keep=OPTIMIZER_STAGES, norm=False).rank_traces(0)
    oracle = run_oracle(spec, local, 2, 2, keep=OPTIMIZER_STAGES)
    for trace, reference in zip(engine, oracle, strict=True):
        assert trace.values.keys() == reference.values.keys()
        assert all(bitwise_equal(v, reference.values[k]) for k, v in trace.values.items())


def test_the_fp64_oracle_reduces_exactly_where_fp64_holds_every_sum():
    """FP64 ground truth: with BF16 terms of a few binades, every TP and DP sum is exact in fp64, so the oracle's
    DP-reduced gradient is the exact rational value of the TP-then-DP rule, computed here with Fractions."""
    from fractions import Fraction

    spec = ParallelSpec(8, tp=2, ep=2)  # TP2, DP4, EDP4
    gas, tp, dp = 2, spec.tp, spec.dp

    def value(step, micro, rank, param):
        return torch.tensor(
            [(1 + (rank * 7 + i * 3 + micro * 5) % 17) * 2.0 ** (-((rank + i) % 9)) for i in range(2)],
            dtype=torch.bfloat16,
        ).reshape(param.shape)

    params = tuple(p for p in PARAMS if p.shape == (2,))
    traces = run_oracle(spec, value, 1, gas, params=params, keep=frozenset({"dp_reduced"}), dtype=torch.float64)
    for p in params:
        reduces, divides = CORRECTIONS[p.family]
        hp = {}
        for r in range(spec.world_size):
            group = spec.group_of("tp", r)
            total = [Fraction(0)] * 2
            for micro in range(gas):
                terms = [[Fraction(float(x)) for x in value(0, micro, q, p)] for q in (group if reduces else [r])]
                summed = [sum(t[i] for t in terms) for i in range(2)]
                total = [t + (s / tp if divides else s) for t, s in zip(total, summed, strict=True)]
            hp[r] = total
        for r in range(spec.world_size):
            members = spec.group_of(dp_kind(p.family), r)
            exact = [sum(hp[q][i] for q in members) / dp for i in range(2)]
            got = traces[r].get(0, BOUNDARY, p.name, "dp_reduced")
            assert got.dtype == torch.float64 and [Fraction(float(x)) for x in got] == exact, (r, p.name)
