"""The exact result of every reducing collective of the ``simdist`` backend, computed in the same run.

`install` subscribes an observer to the observer list (`simdist.world.rendezvous.observers.Observers.subscribed`, which
every collective of both front ends passes; the audit's `simdist.audit.world_hooks` subscribes there too). For a
collective of the backend the observer replaces the event's ``complete`` with one that, before the group's
reduction runs, sums the members' input tensors in FP64 (and their absolute values: ``sum |terms|``), lets
the reduction compute the result as usual, and then compares every member's output with the exact value
(`simdist.attribution.measure.errors`). The reference shares no code with the reductions it judges: it is
``torch.stack(inputs).double().sum(0)``.

A promoted site gets the exact result instead, rounded once to the tensor's dtype.

Measured: all_reduce, all_reduce_coalesced, reduce (the root's result), reduce_scatter_tensor (and its
coalesced form), list reduce_scatter, under SUM and AVG on floating tensors. Other ops (PRODUCT, MIN, MAX,
PREMUL_SUM) and data movement (broadcast, all_gather, all_to_all: exact by construction) pass unmeasured.
In process mode (`simdist.world.processes.transport`) the transport gathers every member's inputs before ``complete``
runs for
this process's own rank, so the same observer measures each process's own outputs against the same FP64 sum
(`simdist.attribution.processes` merges the processes' records).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence

import torch

from simdist.attribution.measure import errors

_local = threading.local()


def busy() -> bool:
    """Whether the calling thread is inside a measured collective (its casts are the simulator's, not the user's)."""
    return getattr(_local, "busy", False)


def _exact(tensors: Sequence[torch.Tensor], avg: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(exact, sum|terms|, low)``: the members' sum as an unevaluated FP64 pair ``exact + low``.

    A plain FP64 sum is exact only while the terms span at most 53 bits; FP32 terms 30 binades apart do not
    (64 + 64 + (2**-23 + 2**-46) rounds in FP64), and the figures are then measured against a rounded value.
    Knuth's TwoSum collects each addition's rounding error into ``low`` (its own rounding is below 2**-53 of
    ``low``), so ``exact + low`` is the sum to about 106 bits."""
    stacked = [t.detach().reshape(-1).double() for t in tensors]
    high, low = stacked[0].clone(), torch.zeros_like(stacked[0])
    for x in stacked[1:]:
        total = high + x
        virtual = total - high
        low += (high - (total - virtual)) + (x - virtual)
        high = total
    low = torch.where(torch.isfinite(low), low, 0.0)  # an overflowing or NaN sum: the figures skip the element
    terms = torch.stack(stacked).abs().sum(0)
    if avg:
        high, low, terms = high / len(tensors), low / len(tensors), terms / len(tensors)
    return high, terms, low


Output = tuple[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # member, output, exact, sum|terms|, low


def _all_reduce(calls, targets, avg: bool) -> Callable[[], Iterator[Output]]:
    sums = [_exact([c.inputs[k] for c in calls], avg) for k in range(len(calls[0].inputs))]

    def outputs() -> Iterator[Output]:
        for i in targets:
            for k, (exact, terms, low) in enumerate(sums):
                yield i, calls[i].inputs[k], exact, terms, low

    return outputs


def _reduce(calls, targets, avg: bool) -> Callable[[], Iterator[Output]]:
    dst = next(d for d in calls[0].signature if isinstance(d, str) and d.startswith("dst="))
    root = [c.rank for c in calls].index(int(dst.removeprefix("dst=")))
    return _all_reduce(calls, [root] if root in targets else [], avg)


def _reduce_scatter_tensor(calls, targets, avg: bool) -> Callable[[], Iterator[Output]]:
    n = len(calls)
    sums = [_exact([c.inputs[k] for c in calls], avg) for k in range(len(calls[0].inputs))]

    def outputs() -> Iterator[Output]:
        for i in targets:
            for k, (exact, terms, low) in enumerate(sums):
                yield i, calls[i].outputs[k], exact.view(n, -1)[i], terms.view(n, -1)[i], low.view(n, -1)[i]

    return outputs


def _reduce_scatter_list(calls, targets, avg: bool) -> Callable[[], Iterator[Output]]:
    n = len(calls)
    sums = [[_exact([c.inputs[k][i] for c in calls], avg) for i in range(n)] for k in range(len(calls[0].inputs))]

    def outputs() -> Iterator[Output]:
        for i in targets:
            for k, per_member in enumerate(sums):
                exact, terms, low = per_member[i]
                yield i, calls[i].outputs[k], exact, terms, low

    return outputs


_MEASURED = {
    "all_reduce": _all_reduce,
    "all_reduce_coalesced": _all_reduce,
    "reduce": _reduce,
    "reduce_scatter_tensor": _reduce_scatter_tensor,
    "reduce_scatter_tensor_coalesced": _reduce_scatter_tensor,
    "reduce_scatter": _reduce_scatter_list,
}


def _first_tensor(values) -> torch.Tensor | None:
    for value in values:
        if isinstance(value, torch.Tensor):
            return value
        if isinstance(value, (list, tuple)):
            found = _first_tensor(value)
            if found is not None:
                return found
    return None


def _measured(complete, recorder):
    def measured(calls, targets) -> None:
        name, label, *details = calls[0].signature
        op = next((d.removeprefix("op=") for d in details if isinstance(d, str) and d.startswith("op=")), None)
        first = _first_tensor(calls[0].inputs)
        plan = _MEASURED.get(name)
        if plan is None or op not in ("SUM", "AVG") or first is None or not first.is_floating_point():
            complete(calls, targets)
            return
        _local.busy = True
        try:
            outputs = plan(calls, targets, op == "AVG")
            complete(calls, targets)
            group = label.split("#", 1)[0]
            for i, out, exact, terms, low in outputs():
                site = recorder.site_of(calls[i].frame)
                promoted = recorder.promotes(site, "collective", name, out.dtype)
                if promoted:
                    out.copy_(exact.to(out.dtype).view(out.shape))
                found = errors(out, exact, terms, low)
                recorder.record(site, "collective", name, out.dtype, calls[i].rank, found, group, promoted)
        finally:
            _local.busy = False

    return measured


_lock = threading.Lock()


def install(recorder) -> Callable[[], None]:
    """Measure (and promote) the backend's collectives for ``recorder``; returns the function that undoes it."""
    from simdist.world.rendezvous.observers import CollectiveEvent, Observers

    def observe(event: CollectiveEvent) -> None:
        if event.front == "dist":  # the torch.distributed backend's collectives (SimComm's are not measured)
            event.complete = _measured(event.complete, recorder)

    with _lock:
        Observers.subscribe(observe)

    def uninstall() -> None:
        with _lock:
            if observe in Observers.subscribed:
                Observers.unsubscribe(observe)

    return uninstall
