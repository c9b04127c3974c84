"""The oracle's precision as a `Policy` run by the engine -- a test of the engine, not the oracle.

The oracle that judges the engine is `simdist.gradpath.reference` (explicit
TP-then-DP reduction in plain loops and a real ``torch.optim.AdamW``; it shares
no code with the engine). What is here keeps the run's topology, correction
rule, local gradients and DP normalisation, changes only precision -- the BF16
local gradient staged into ``dtype``, every later stage in ``dtype``, the TP
correction on every micro-step -- and runs through the same `GradPath` as every
policy. Engine tests use it (rank-batched == per-rank, the MoE study's FP64
ground truth), and ``tests/unit/test_oracle.py`` checks that its FP32 form gives the
independent oracle's bits.

`reference_reduced_gradients` computes the data-parallel-reduced gradients
directly, with explicit loops over groups and no rank program.
"""

from __future__ import annotations

import torch

from simdist.gradpath.families import Family, ParamSpec
from simdist.gradpath.policy import Policy, dtype_name
from simdist.reduce import ReductionModel
from simdist.world.spec import ParallelSpec


def oracle_policy(dtype: torch.dtype = torch.float32) -> Policy:
    """Every stage after the BF16 local gradient in ``dtype``; run it with ``marker="per_micro_step"``."""
    return Policy(
        name=f"oracle_{str(dtype).removeprefix('torch.')}",
        summary=f"{dtype_name(dtype)} TP-then-DP per-parameter reducer",
        staging=dtype,
        writeback=None,
        expert_in_grad_dtype=False,
        accumulate=dtype,
        dp_reduce=dtype,
        master=dtype,
        moments=dtype,
    )


FP32_ORACLE = oracle_policy(torch.float32)
FP64_ORACLE = oracle_policy(torch.float64)


def reference_reduced_gradients(
    spec: ParallelSpec,
    params: list[ParamSpec],
    local_grads,
    step: int,
    gas: int,
    *,
    dtype: torch.dtype,
    tp_model: ReductionModel,
    dp_model: ReductionModel,
) -> dict[tuple[int, str], torch.Tensor]:
    """``{(rank, param): DP-reduced gradient}`` for one step, by explicit TP-then-DP reduction in ``dtype``."""
    tp = spec.tp
    result = {}
    for p in params:
        correction = p.family.correction(tp)
        hp = {r: torch.zeros(p.shape, dtype=dtype) for r in range(spec.world_size)}
        for micro in range(gas):
            staged = {r: local_grads(step, micro, r, p).to(dtype) for r in range(spec.world_size)}
            for group in spec.groups("tp"):
                if correction.reduces:
                    total = tp_model.reduce([staged[r] for r in group])
                    corrected = {r: total for r in group}
                else:
                    corrected = {r: staged[r] for r in group}
                for r in group:
                    value = corrected[r] / tp if correction.divides else corrected[r]
                    hp[r] += value
        kind = "edp" if p.family is Family.EXPERT else "dp"
        for group in spec.groups(kind):
            reduced = dp_model.reduce([hp[r] for r in group]) * (1.0 / spec.dp)
            for r in group:
                result[(r, p.name)] = reduced
    return result
