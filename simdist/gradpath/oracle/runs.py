"""The oracle over several optimizer steps, unbatched: every stage's capture (`oracle_values`), or one `Trace` per
rank (`oracle_traces`), from local gradients given as a function, as every rank's at once, or by a gradient source
that runs forward/backward on the oracle's own parameters.

Part of the independent oracle (`simdist.gradpath.oracle`); it shares no code with the gradient path.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from simdist.gradpath.families import ParamSpec
from simdist.gradpath.oracle.rules import Control
from simdist.gradpath.oracle.step import Key, Oracle
from simdist.gradpath.probes import Trace
from simdist.reduce import Reduction
from simdist.world.spec import ParallelSpec

Values = dict[tuple[int, int, str, str], torch.Tensor]
"""``values[(step, micro, param, stage)]``: every rank's capture, ``[rank, *shape]``."""


def oracle_values(
    spec: ParallelSpec,
    params: Sequence[ParamSpec],
    initial: Callable[[int, ParamSpec], torch.Tensor],
    local_grads,
    *,
    steps: int,
    gas: int,
    tp_reduction: Reduction,
    dp_reduction: Reduction,
    dtype: torch.dtype = torch.float32,
    adam=None,
    keep: frozenset[str] | None = None,
    world_reduction: Reduction | None = None,
    control: Control | None = None,
) -> Values:
    """The oracle's captures over ``steps`` optimizer steps (unbatched), every rank's in one ``[rank, *shape]``
    copy per ``(step, micro, param, stage)``; ``keep`` selects stages (default all).

    ``local_grads`` is a ``(step, micro, rank, param) -> BF16 gradient`` function; or an object whose
    ``stacked(step, micro)`` gives ``{name: [rank, *shape]}`` (every rank's gradients at once); or a gradient
    source with ``backward(comm, step, micro, lp, deliver, hooks)`` (a model: its gradients depend on the
    oracle's own parameters), which then runs on a `SimWorld` whose groups use ``world_reduction`` (default
    ``dp_reduction``).
    """
    values: Values = {}
    oracle = Oracle(
        spec,
        params,
        {(r, p.name): initial(r, p).to(torch.bfloat16) for r in range(spec.world_size) for p in params},
        dtype=dtype,
        tp_reduction=tp_reduction,
        dp_reduction=dp_reduction,
        adam=adam,
        control=control,
    )
    trained = [p for p in params if not p.frozen]

    def capture(step: int, micro: int, param: str, stage: str, value: torch.Tensor) -> None:
        if keep is None or stage in keep:
            values[(step, micro, param, stage)] = value.detach().clone()

    source: Callable[[int, Mapping[Key, torch.Tensor]], Mapping]
    for step in range(steps):
        if hasattr(local_grads, "backward"):
            source = _SourceGrads(spec, params, local_grads, step, world_reduction or dp_reduction)
        elif hasattr(local_grads, "stacked"):

            def source(micro, lp, step=step):
                return local_grads.stacked(step, micro)

        else:

            def source(micro, lp, step=step):
                return {(r, p.name): local_grads(step, micro, r, p) for r in range(spec.world_size) for p in trained}

        oracle.step(step, gas, source, capture)
    return values


def oracle_traces(
    spec: ParallelSpec,
    params: Sequence[ParamSpec],
    initial: Callable[[int, ParamSpec], torch.Tensor],
    local_grads,
    *,
    keep: frozenset[str] | None = None,
    **options: Any,
) -> list[Trace]:
    """Every rank's `Trace` of the oracle over ``steps`` optimizer steps (unbatched): `oracle_values` (which
    takes the same arguments: ``steps``, ``gas``, ``tp_reduction``, ``dp_reduction``, ...), split by rank."""
    values = oracle_values(spec, params, initial, local_grads, keep=keep, **options)
    traces = [Trace(r, keep) for r in range(spec.world_size)]
    for key, value in values.items():
        for r, trace in enumerate(traces):
            trace.values[key] = value[r]
    return traces


class _SourceGrads:
    """Local gradients of a model for one step: its forward/backward on every rank of a `SimWorld`, with the
    oracle's BF16 parameters."""

    def __init__(self, spec, params, source, step: int, reduction: Reduction) -> None:
        self.spec, self.params, self.source, self.step, self.reduction = spec, params, source, step, reduction

    def __call__(self, micro: int, lp: Mapping[Key, torch.Tensor]) -> dict[Key, torch.Tensor]:
        from simdist.world.simworld import SimWorld

        def rank(comm) -> dict[str, torch.Tensor]:
            r = comm.get_rank()
            got: dict[str, torch.Tensor] = {}
            weights = {p.name: lp[(r, p.name)] for p in self.params}
            self.source.backward(comm, self.step, micro, weights, lambda n, g: got.__setitem__(n, g.detach()), False)
            return got

        results = SimWorld(self.spec, reduction=self.reduction, timeout_s=None).run(rank)
        return {(r, name): g for r, got in enumerate(results) for name, g in got.items()}
