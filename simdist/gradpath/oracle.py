"""Oracles for the gradient path: the FP32 TP-then-DP reducer of the #8913 report, and FP64 ground truth.

The oracle keeps the run's topology, correction rule, local gradients and DP
normalisation, and changes only precision: the BF16 local gradient is staged
into ``dtype`` and every later stage (TP correction, accumulation, DP
reduction, masters, Adam moments) stays in ``dtype``, with the TP correction
applied on every micro-step. With ``dtype=float32`` this is the accepted
numerical reference of the report; with ``float64`` it is ground truth for
measuring how far each FP32 policy is from the exact answer.

`reference_reduced_gradients` computes the same data-parallel-reduced
gradients directly, with explicit loops over groups and no rank program, so
tests can check the engine against an independent transcription.
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
