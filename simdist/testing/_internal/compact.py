"""A compact workload: one small parameter of every folding family, run rank-batched on drawn gradients.

What the gradient-path properties (``tests/unit/gradpath/test_path_properties.py``) and
their benchmark (``bench/properties.py``) share: the parameters, replicated
initial weights, a rank-batched run of a policy (`simdist.gradpath.batched`),
the independent FP32 oracle on the same workload (`run_oracle`, `simdist.gradpath.oracle`), and property
(a) -- ``fp32_staging`` equals the FP32 oracle bit for bit -- as a function that returns where the two first
differ (``None`` when they do not). Its Hypothesis strategy is
`simdist.testing.strategies.oracle_cases`.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch

from simdist.gradpath.batched import BatchedPath, BatchedTrace, initial_buffer
from simdist.gradpath.families import Family, ParamSpec
from simdist.gradpath.kernel import Marker
from simdist.gradpath.oracle import oracle_traces, oracle_values
from simdist.gradpath.path import PathConfig
from simdist.gradpath.policy import Policy
from simdist.gradpath.probes import Capture, Trace
from simdist.numerics.floats import bitwise_equal
from simdist.policies.catalogue import get_policy
from simdist.reduce import Reduction, Sequential
from simdist.world.options import DEFAULT_REDUCTION, as_reduction
from simdist.world.spec import ParallelSpec

ROUTER = ParamSpec("router", Family.ROUTER_GATE_REPLICATED, (3,))
PARTIAL = ParamSpec("router_partial", Family.ROUTER_GATE_PARTIAL, (2,))
DENSE = ParamSpec("dense", Family.DENSE, (2,))
SHARD = ParamSpec("attn_tp", Family.MODEL_PARALLEL, (2,))
EXPERT = ParamSpec("expert", Family.EXPERT, (2,))
PARAMS: tuple[ParamSpec, ...] = (ROUTER, PARTIAL, DENSE, SHARD, EXPERT)
"""One compact parameter of every folding family."""

OPTIMIZER_STAGES = frozenset({Capture.HP, Capture.DP_REDUCED, Capture.MASTER, Capture.ADAM_M, Capture.ADAM_V})
"""What property (a) compares: hp buffers after every micro-step, DP-reduced gradients, masters and moments."""

Gradients = Any
"""A drawn `simdist.testing.strategies.GradientBatch` (anything with ``batch(step, micro) -> {name: [1, rank, ...]}``),
or a ``(step, micro, rank, param) -> BF16 tensor`` function."""


@functools.lru_cache(maxsize=64)
def _initial(shape: tuple[int, ...]) -> torch.Tensor:
    return torch.linspace(-0.5, 0.5, math.prod(shape)).reshape(shape).to(torch.bfloat16)


def initial(rank: int, param: ParamSpec) -> torch.Tensor:
    """Replicated, small, non-trivial BF16 initial weights (-0.5 .. 0.5); a fresh copy (the engine writes to it)."""
    return _initial(tuple(param.shape)).clone()


@functools.lru_cache(maxsize=64)
def _initial_buffer(spec: ParallelSpec, params: tuple[ParamSpec, ...]) -> torch.Tensor:
    return initial_buffer(spec, params, [initial], torch.bfloat16)


def _one_reduction(reduction: Reduction | None) -> Reduction:
    """``reduction``, or `DEFAULT_REDUCTION` if none was given."""
    return reduction if reduction is not None else as_reduction(DEFAULT_REDUCTION)


def run_batched(
    spec: ParallelSpec,
    policy: Policy,
    grads: Gradients,
    config: PathConfig,
    *,
    keep: frozenset[str] | None = None,
    reduction: Reduction | None = None,
    params: tuple[ParamSpec, ...] = PARAMS,
    norm: bool = True,
    cases: int = 1,
) -> BatchedTrace:
    """``policy`` on ``spec``, every rank in one batch item, every group reducing with ``reduction`` (default
    `DEFAULT_REDUCTION`). ``cases`` > 1 runs that many independent cases
    as batch items (``grads.batch`` then gives ``[cases, rank, ...]``, as a
    `simdist.testing._internal.case_batches.CaseBatch` does), every one from the same initial weights."""
    reduction = _one_reduction(reduction)
    params = tuple(params)
    batch = getattr(grads, "batch", None)
    if batch is None:

        def batch(step: int, micro: int) -> dict[str, torch.Tensor]:
            return {
                p.name: torch.stack([grads(step, micro, r, p) for r in range(spec.world_size)]).unsqueeze(0)
                for p in params
            }

    path = BatchedPath(
        spec,
        params,
        policy,
        config,
        _initial_buffer(spec, params).repeat(cases, 1, 1),
        reduction=reduction,
        keep=keep,
        norm=norm,
    )
    return path.run(batch)


def _oracle_source(grads: Gradients):
    """What `simdist.gradpath.oracle` takes: the drawn batch itself (``stacked``: every rank at once), or the
    ``(step, micro, rank, param)`` function."""
    if getattr(grads, "stacked", None) is not None:
        return grads
    batch = getattr(grads, "batch", None)
    if batch is None:
        return grads

    one_batch = batch

    class Stacked:
        def stacked(self, step: int, micro: int) -> dict[str, torch.Tensor]:
            return {name: value[0] for name, value in one_batch(step, micro).items()}

    return Stacked()


def run_oracle(
    spec: ParallelSpec,
    grads: Gradients,
    steps: int,
    gas: int,
    *,
    keep: frozenset[str] | None = None,
    reduction: Reduction | None = None,
    params: tuple[ParamSpec, ...] = PARAMS,
    dtype: torch.dtype = torch.float32,
) -> list[Trace]:
    """Every rank's `Trace` of the independent oracle (`simdist.gradpath.oracle`) on the compact workload,
    every group reducing with ``reduction`` (default `DEFAULT_REDUCTION`)."""
    reduction = _one_reduction(reduction)
    return oracle_traces(
        spec,
        list(params),
        initial,
        _oracle_source(grads),
        steps=steps,
        gas=gas,
        tp_reduction=reduction,
        dp_reduction=reduction,
        dtype=dtype,
        keep=keep,
    )


def staging_departs_from_oracle(spec: ParallelSpec, gas: int, steps: int, grads: Gradients) -> str | None:
    """Property (a): where ``fp32_staging`` first differs from the independent FP32 oracle (`run_oracle`), or
    ``None`` if it never does.

    The engine corrects every micro-step (``per_micro_step``), as the oracle does; both capture
    `OPTIMIZER_STAGES` (hp buffers after every micro-step, DP-reduced gradients, masters, Adam moments), and
    every capture of every rank is compared bit for bit (`first_departure`).
    """
    config = PathConfig(steps=steps, gas=gas, marker=Marker.PER_MICRO_STEP)
    sequential = Sequential()
    staging = run_batched(
        spec, get_policy("fp32_staging"), grads, config, keep=OPTIMIZER_STAGES, norm=False, reduction=sequential
    )
    oracle = oracle_values(
        spec,
        list(PARAMS),
        initial,
        _oracle_source(grads),
        steps=steps,
        gas=gas,
        tp_reduction=sequential,
        dp_reduction=sequential,
        keep=OPTIMIZER_STAGES,
    )
    return first_departure(staging.values, {key: value.unsqueeze(0) for key, value in oracle.items()}, one_case=True)


def first_departure(engine: dict, oracle: dict, one_case: bool = False) -> str | None:
    """Where the ``engine`` captures first differ from the ``oracle``'s, or None if they are the same bits: both
    ``{(step, micro, param, stage): [case, rank, *shape]}``. All at once first (one comparison of the concatenated
    raw bytes, after checking every capture's dtype and shape), then capture by capture, case by case, rank by
    rank, to name the first difference: with its case, and a capture of another dtype or shape by that; with
    ``one_case`` (`staging_departs_from_oracle`'s form) every difference by its rank and capture alone."""
    if not engine:
        return "nothing was captured"
    if engine.keys() != oracle.keys():
        return f"different captures: {sorted(engine.keys() ^ oracle.keys())[:3]}"
    ours, theirs = [], []
    for key, value in engine.items():
        other = oracle[key]
        if value.dtype != other.dtype or value.shape != other.shape:
            if one_case:
                break  # named by its position below (`bitwise_equal` differs on another dtype or shape)
            return f"capture {key}: {value.dtype} {tuple(value.shape)}, the oracle's {other.dtype} {tuple(other.shape)}"
        ours.append(value.reshape(-1).view(torch.uint8))
        theirs.append(other.reshape(-1).view(torch.uint8))
    else:
        if torch.equal(torch.cat(ours), torch.cat(theirs)):
            return None
    first = next(iter(engine.values()))
    for case in range(first.shape[0]):
        for rank in range(first.shape[1]):
            for key, value in engine.items():
                if not bitwise_equal(value[case, rank], oracle[key][case, rank]):
                    where = f"(rank, step, micro, param, stage) = {(rank, *key)}"
                    return where if one_case else f"case {case}: {where}"
    return "the raw bytes differ, yet no capture does"  # never hide a difference the byte comparison saw


def run_cases(spec: ParallelSpec, gas: int, steps: int, grads) -> tuple[dict, dict]:
    """Property (a)'s two runs of every case of ``grads`` (a `simdist.testing._internal.case_batches.CaseBatch`): the
    captures (`OPTIMIZER_STAGES`) of ``fp32_staging`` on the rank-batched gradient path, the cases as its batch items,
    and of the independent oracle (`simdist.gradpath.oracle.oracle_values`), the cases as its leading batch
    dimension; both ``{(step, micro, param, stage): [case, rank, *shape]}``, every case from the compact
    workload's initial weights, the correction every micro-step, every group summing in rank order."""
    cases = grads.cases
    config = PathConfig(steps=steps, gas=gas, marker=Marker.PER_MICRO_STEP)
    sequential = Sequential()
    staging = run_batched(
        spec,
        get_policy("fp32_staging"),
        grads,
        config,
        keep=OPTIMIZER_STAGES,
        norm=False,
        reduction=sequential,
        cases=cases,
    )
    oracle = oracle_values(
        spec,
        list(PARAMS),
        lambda rank, param: initial(rank, param).expand(cases, *param.shape),
        grads,
        steps=steps,
        gas=gas,
        tp_reduction=sequential,
        dp_reduction=sequential,
        keep=OPTIMIZER_STAGES,
    )
    return staging.values, oracle


def cases_depart_from_oracle(spec: ParallelSpec, gas: int, steps: int, grads) -> str | None:
    """Property (a) for several cases at once: where ``fp32_staging`` first differs from the independent FP32
    oracle in any case of ``grads`` (a `simdist.testing._internal.case_batches.CaseBatch`), or ``None`` if it
    never does.

    What `staging_departs_from_oracle` checks for one case, for every case (`run_cases`, `first_departure`).
    """
    return first_departure(*run_cases(spec, gas, steps, grads))
