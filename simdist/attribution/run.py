"""One blamed run: the recorder, the hooks it installs for the run's duration, and the final state it reads.

`Recorder` collects, per site, the errors of the collectives (`simdist.attribution.collectives`) and of the
narrowing casts (an `simdist.audit.Audit` following every thread, with a ``cast_hook``), the optimizer step
each rank is at (a global optimizer step post-hook: the step of an event is the number of ``optimizer.step()``
calls its rank had finished), the loss of each rank (every ``torch.autograd.backward`` root, also reached by
``loss.backward()``; where a ``torch.amp.GradScaler`` scaled the root, the loss is what it was given,
unscaled, and the root is kept as the "scaled loss") and the optimizers each rank stepped (their parameters
and state are the run's final state). `execute` runs a callable under all of that and returns the recorder.

Promotion: a site in ``promote`` is computed without its rounding -- a collective gets its exact FP64
result rounded once to its dtype, an out-of-place cast returns its wide input unchanged (the program then
goes on in the wide dtype from there). An in-place cast (``copy_`` into a narrow tensor: the
destination's dtype is fixed) and a cast inside autograd's backward (autograd checks every gradient's
dtype) cannot be promoted: they are listed in ``unpromotable`` and computed as usual.

A promoted out-of-place cast's wide value that the program then copies into a narrow buffer
(``grad.copy_(reduced.to(grad.dtype))``, DeepSpeed's #8913 writeback) travels with the buffer: the recorder keeps
the wide value as the buffer's *shadow*, and the next widening cast of that buffer (``grad.float()``,
``grad.to(torch.float32)``) returns the shadow instead of the widened narrow bits, provided the buffer still holds
the bits written (same storage, shape and strides, same raw bits; otherwise the shadow is stale and dropped).
The promoted program therefore computes what a program that never narrowed there computes (checked against
the #8913 fix, bit for bit: ``tests/integration/test_blame_processes.py``, ``test_blame_deepspeed.py``).
Same-dtype copies of the buffer and reads other than a widening cast see its narrow bits.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch

from simdist.attribution import arithmetic, collectives
from simdist.attribution.measure import Errors, SiteErrors, errors
from simdist.audit import Audit, dtype_name
from simdist.callsite import site_of

SiteKey = tuple  # (file, line, function, kind, op, dtypes)


def local(t: torch.Tensor) -> torch.Tensor:
    """A detached copy of ``t``; of a DTensor, of this rank's local shard (its mesh is the run's own: a promoted
    rerun's DTensors live on another mesh, and comparing the two would need the collectives of a finished run).
    Each rank's shard is named by its rank, so the shards of all ranks together cover the full tensor."""
    to_local = getattr(t, "to_local", None)
    if to_local is not None and type(t).__name__ == "DTensor":
        t = to_local()
    return t.detach().clone()


def _thread_rank() -> int | None:
    from simdist.world.threads.spawn import current

    ctx = current()
    return None if ctx is None else ctx.rank


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s raw bits as integers (NaN payloads and signed zeros compare exactly)."""
    return t.detach().view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _buffer(t: torch.Tensor) -> tuple:
    """Where a tensor's elements live: the key of a narrow buffer's shadow (`Recorder.shadows`)."""
    return (t.device, t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride()))


class Recorder:
    """Per-site errors, steps, losses and optimizers of one run; ``promote`` holds the site keys to promote."""

    def __init__(self, promote: Iterable[SiteKey] = (), ops: frozenset[str] = frozenset()) -> None:
        self.lock = threading.Lock()
        self.sites: dict[SiteKey, SiteErrors] = {}
        self.steps: dict[int | None, int] = {}
        self.optimizers: dict[int | None, list] = {}
        self.losses: dict[int | None, list[torch.Tensor]] = {}
        self.unscaled: dict[int | None, list[torch.Tensor]] = {}  # what a GradScaler scaled, per rank
        self.promote = set(promote)
        self.sharded = False  # a DTensor's local shard stood in for it in the final state
        self.ops = ops  # aten op names measured as arithmetic sites (`simdist.attribution.arithmetic`)
        self.promoted: dict[SiteKey, int] = {}  # key -> number of promoted events
        self.unpromotable: dict[SiteKey, str] = {}  # key -> why it cannot be promoted
        self.rank: int | None = None  # this process's rank in process mode (threads name their own)
        self._promoted_values: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
        self.shadows: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # buffer -> (its bits, the wide value)

    def _rank(self) -> int | None:
        rank = _thread_rank()
        return self.rank if rank is None else rank

    # -- sites -------------------------------------------------------------------------

    def site_of(self, frame) -> tuple[str, int, str]:
        """The user's call site from ``frame`` outwards, by the one rule (`simdist.callsite`: the first frame outside
        torch, simdist's world layer, the audit and blame): the site the audit names for the same call."""
        return site_of(frame)

    @staticmethod
    def key(site: tuple[str, int, str], kind: str, op: str, dtypes: str) -> SiteKey:
        return (*site, kind, op, dtypes)

    def promotes(self, site, kind: str, op: str, dtype: torch.dtype) -> bool:
        return bool(self.promote) and self.key(site, kind, op, dtype_name(dtype)) in self.promote

    def record(
        self, site, kind: str, op: str, dtypes, rank, found: Errors, group: str | None = None, promoted: bool = False
    ) -> None:
        if not isinstance(dtypes, str):
            dtypes = dtype_name(dtypes)
        key = self.key(site, kind, op, dtypes)
        with self.lock:
            entry = self.sites.get(key)
            if entry is None:
                entry = self.sites[key] = SiteErrors(*key)
            entry.add(rank, self.steps.get(rank, 0), found, group)
            if promoted:
                self.promoted[key] = self.promoted.get(key, 0) + 1

    # -- hooks ---------------------------------------------------------------------------

    def cast_hook(self, site, rank, source: torch.Tensor, result: torch.Tensor, in_place: bool, op: str | None = None):
        """A narrowing cast (`simdist.audit.Audit`'s hook): measured, and promoted where asked. An in-place cast
        is named by the op called (``copy_``, ``_foreach_copy_``: FSDP2's parameter casts); an out-of-place one
        is ``to`` (``.to``, ``.bfloat16()``, ``_to_copy``)."""
        if collectives.busy():
            return None
        if rank is None:
            rank = self._rank()
        op = (op or "aten.copy_").removeprefix("aten.") if in_place else "to"
        dtypes = f"{dtype_name(source.dtype)}->{dtype_name(result.dtype)}"
        key = self.key(site, "cast", op, dtypes)
        wide = source.detach().double()
        if wide.shape != result.shape:  # copy_ broadcasting its source
            wide = wide.expand(result.shape)
        replaced = None
        if key in self.promote:
            # in place: the destination's dtype is fixed; in backward: autograd checks each gradient's dtype
            node = torch._C._current_autograd_node()
            if in_place or node is not None:
                why = "an in-place copy into a narrow tensor" if in_place else f"a cast in backward ({node.name()})"
                with self.lock:
                    self.unpromotable[key] = why
            else:
                replaced = source.detach().clone()
                self._promoted_values[id(replaced)] = replaced
        elif in_place and self._promoted_values.get(id(source)) is source:
            # a promoted cast's wide value written into a narrow buffer: the buffer keeps it as its shadow
            with self.lock:
                self.shadows[_buffer(result)] = (_bits(result).clone(), source.detach().clone())
        measured = replaced if replaced is not None else result
        self.record(site, "cast", op, dtypes, rank, errors(measured, wide, wide.abs()), promoted=replaced is not None)
        return replaced

    def widen_hook(self, source: torch.Tensor, result: torch.Tensor) -> torch.Tensor | None:
        """A widening cast of a narrow buffer that holds a promoted value, unchanged since (same bits): the
        wide value, in the cast's dtype, instead of the widened narrow one (see `execute`)."""
        if not self.shadows:
            return None
        key = _buffer(source)
        with self.lock:
            found = self.shadows.get(key)
        if found is None:
            return None
        narrow, wide = found
        if not torch.equal(narrow, _bits(source)):  # written since: the shadow is stale
            with self.lock:
                self.shadows.pop(key, None)
            return None
        return wide.to(result.dtype).view(result.shape).clone()

    def op_hook(self, site, rank, name: str, call, written: tuple, args: tuple, kwargs: dict):
        if rank is None:
            rank = self._rank()
        return arithmetic.measure_op(self, site, rank, name, call, written, args, kwargs)

    def step_hook(self, optimizer, args, kwargs) -> None:
        rank = self._rank()
        with self.lock:
            self.steps[rank] = self.steps.get(rank, 0) + 1
            known = self.optimizers.setdefault(rank, [])
            if not any(o is optimizer for o in known):
                known.append(optimizer)

    def loss(self, tensors) -> None:
        first = tensors if isinstance(tensors, torch.Tensor) else next(iter(tensors), None)
        if isinstance(first, torch.Tensor):
            rank = self._rank()
            value = local(first)
            with self.lock:
                self.losses.setdefault(rank, []).append(value)

    def scaled(self, outputs, result) -> None:
        """A ``GradScaler.scale(outputs)`` call: ``outputs`` is the loss the script means (the root is scaled)."""
        if result is not outputs and isinstance(outputs, torch.Tensor) and outputs.is_floating_point():
            rank = self._rank()
            value = local(outputs)
            with self.lock:
                self.unscaled.setdefault(rank, []).append(value)

    # -- the final state ------------------------------------------------------------------

    def final_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """``{"parameters": {...}, "optimizer state": {...}, "loss": {...}}``, tensors named by rank."""
        params: dict[str, torch.Tensor] = {}
        state: dict[str, torch.Tensor] = {}
        for rank in sorted(self.optimizers, key=lambda r: -1 if r is None else r):
            for oi, opt in enumerate(self.optimizers[rank]):
                ps = [p for group in opt.param_groups for p in group["params"]]
                for pi, p in enumerate(ps):
                    name = f"rank {rank} optimizer {oi} param {pi}"
                    self.sharded = self.sharded or type(p).__name__ == "DTensor"
                    params[name] = local(p)
                    for k, v in sorted(opt.state.get(p, {}).items()):
                        if isinstance(v, torch.Tensor) and v.is_floating_point() and k != "step":
                            state[f"{name} {k}"] = local(v)
        roots = {f"rank {r} final": v[-1] for r, v in self.losses.items() if v}
        unscaled = {f"rank {r} final": v[-1] for r, v in self.unscaled.items() if v}
        if unscaled:  # a loss scaler: "loss" is the script's loss, the backward() root is the scaled one
            return {"parameters": params, "optimizer state": state, "loss": unscaled, "scaled loss": roots}
        return {"parameters": params, "optimizer state": state, "loss": roots, "scaled loss": {}}


def execute(target: Callable[[], Any], recorder: Recorder) -> Any:
    """Run ``target()`` with ``recorder``'s hooks installed (removed again afterwards, also on error)."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    uninstall = collectives.install(recorder)
    handle = register_optimizer_step_post_hook(recorder.step_hook)
    original_backward = torch.autograd.backward

    def backward(tensors, *args, **kwargs):
        recorder.loss(tensors)
        return original_backward(tensors, *args, **kwargs)

    from torch.amp.grad_scaler import GradScaler

    original_scale = GradScaler.scale

    def scale(self, outputs):
        result = original_scale(self, outputs)
        recorder.scaled(outputs, result)
        return result

    torch.autograd.backward = backward
    GradScaler.scale = scale  # type: ignore[method-assign]
    try:
        audit = Audit(
            cast_hook=recorder.cast_hook,
            op_hook=recorder.op_hook if recorder.ops else None,
            op_names=recorder.ops,
            widen_hook=recorder.widen_hook if recorder.promote else None,
            errors=False,
            collectives=False,
            threads=True,
            max_records=0,
        )
        with audit:
            return target()
    finally:
        torch.autograd.backward = original_backward
        GradScaler.scale = original_scale  # type: ignore[method-assign]
        handle.remove()
        uninstall()
