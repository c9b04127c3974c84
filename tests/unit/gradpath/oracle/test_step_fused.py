"""The oracle's fused step (every parameter's two-member group sums at once, `oracle_sums.FusedPairs`) gives
the bits of its per-parameter step: masters, moments and BF16 parameters, every reduction, NaN payloads,
infinities, signed zeros and subnormals included, and the fused stages are really taken where they can be."""

from __future__ import annotations

import pytest
import torch

from simdist.gradpath.families import Family, ParamSpec
from simdist.gradpath.oracle import Oracle
from simdist.gradpath.oracle.step import FusedPairs
from simdist.numerics.floats import bitwise_equal
from simdist.reduce import REDUCTION_NAMES, make_reduction
from simdist.sources.synthetic import DEFAULT_PARAMS
from simdist.world.spec import ParallelSpec

SEEDS = 3
FROZEN = ParamSpec("frozen.weight", Family.DENSE, (4,), frozen=True)


def _grads(spec: ParallelSpec, params, step: int, micro: int, special: bool) -> dict[str, torch.Tensor]:
    """BF16 local gradients ``{name: [seed, rank, *shape]}``, with adversarial values where ``special``."""
    gen = torch.Generator().manual_seed(1000 * step + micro)
    out = {}
    for p in params:
        if p.frozen:
            continue
        shape = (SEEDS, spec.world_size, *p.shape)
        value = torch.randn(shape, generator=gen) * 2.0 ** torch.randint(-12, 12, shape, generator=gen)
        value = value.to(torch.bfloat16)
        if special:
            flat = value.view(SEEDS, spec.world_size, -1)
            raw = flat.view(torch.int16)
            for r in range(spec.world_size):  # seed 1: a NaN with its own payload on every rank, at both ends
                raw[1, r, :3] = 0x7FC1 + r
                raw[1, r, -2:] = -0x7F + r  # 0xFF81.. : negative NaNs with payloads
            flat[2, :, 0] = float("inf")  # seed 2: inf on every rank (inf + inf), -inf against inf elsewhere
            flat[2, 0, 1], flat[2, 1, 1] = float("inf"), float("-inf")
            flat[0, :, 2] = -0.0  # seed 0: signed zeros, subnormals, and a tie of the FP32 sum's rounding
            flat[0, 0, 3], flat[0, 1, 3] = 0.0, -0.0
            raw[0, :, 4] = 0x0001  # the smallest BF16 subnormal
            flat[0, 0, 5], flat[0, 1, 5] = 1.0, 2.0**-24
        out[p.name] = value
    return out


def _run(spec, params, reduction, fused: bool, gas: int, special_steps: set[int], steps: int = 3) -> Oracle:
    initial = {
        (r, p.name): torch.full((SEEDS, *p.shape), 0.5 + 0.01 * r, dtype=torch.bfloat16)
        for r in range(spec.world_size)
        for p in params
    }
    oracle = Oracle(spec, params, initial, tp_reduction=reduction, dp_reduction=reduction, fused=fused)
    for step in range(steps):
        oracle.step(step, gas, lambda micro, lp, step=step: _grads(spec, params, step, micro, step in special_steps))
    return oracle


@pytest.mark.parametrize("name", REDUCTION_NAMES)
@pytest.mark.parametrize(
    ("spec", "gas"),
    [(ParallelSpec(4, tp=2, ep=2), 2), (ParallelSpec(8, tp=2, ep=2), 1), (ParallelSpec(8, tp=4, ep=4), 1)],
    ids=["tp2-ep2-gas2", "tp2-dp4", "tp4-dp2"],
)
def test_the_fused_step_gives_the_bits_of_the_per_parameter_step(name, spec, gas, monkeypatch):
    """Step 1 carries NaNs (the fused sums find them and hand the stage to the per-parameter path); steps 0 and 2
    do not, and are fused wherever the groups have two members (counted)."""
    taken = {"micro": 0, "boundary": 0}
    micro_step, boundary = FusedPairs.micro_step, FusedPairs.boundary

    def counted_micro(self, *args):
        done = micro_step(self, *args)
        taken["micro"] += done
        return done

    def counted_boundary(self, *args):
        out = boundary(self, *args)
        taken["boundary"] += out is not None
        return out

    monkeypatch.setattr(FusedPairs, "micro_step", counted_micro)
    monkeypatch.setattr(FusedPairs, "boundary", counted_boundary)
    reduction = make_reduction(name)
    params = (*DEFAULT_PARAMS, FROZEN)
    fused = _run(spec, params, reduction, True, gas, {1})
    plain = _run(spec, params, reduction, False, gas, {1})
    for which in ("master", "m", "v", "lp"):
        assert bitwise_equal(fused.flat(which), plain.flat(which)), (name, which)
    tp_pairs = all(len(g) == 2 for g in spec.groups("tp"))
    dp_pairs = all(len(g) == 2 for g in spec.groups("dp"))
    assert taken == {"micro": 2 * gas if tp_pairs else 0, "boundary": 2 if dp_pairs else 0}


def test_a_run_with_nans_in_every_step_falls_back_without_a_change():
    """Every step with NaNs: nothing is fused, and the bits are those of the per-parameter step."""
    spec, reduction = ParallelSpec(4, tp=2, ep=2), make_reduction("gloo")
    fused = _run(spec, DEFAULT_PARAMS, reduction, True, 1, {0, 1})
    plain = _run(spec, DEFAULT_PARAMS, reduction, False, 1, {0, 1})
    for which in ("master", "m", "v", "lp"):
        assert bitwise_equal(fused.flat(which), plain.flat(which)), which
