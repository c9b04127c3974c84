"""The ``simdist`` backend of ``torch.distributed``: unmodified code, collectives computed by reduction models.

`SimProcessGroup` is a ``torch.distributed.ProcessGroup`` written in Python.
``torch.distributed`` (``dist.all_reduce``, ``new_group``, DeviceMesh),
the functional collectives (``_functional_collectives``, the ``_c10d_functional``
ops that DTensor uses) and FSDP2 all reach it through c10d's ordinary group
machinery; the backend is registered under the name ``simdist`` by
`register` (done on import of ``simdist.world``).

Every collective is one `simdist.world.engine.Call` per member plus a
``complete(calls, targets)`` function that computes the result from all
members' calls (in group-rank order) and writes the outputs of the members in
``targets``. A *transport* brings the calls together:

* in-process (`simdist.world.inproc.spawn`): one thread per rank, the
  rendezvous `simdist.world.engine.Engine`; the last member to arrive runs
  ``complete`` for every member;
* process mode (`simdist.world.process`): real processes; each rank gathers
  the members' calls over an inner gloo group and runs ``complete`` for itself.

Both run the same ``complete`` on the same inputs, so both give the same bits.
Sums are the group's `ReductionModel` (the members' tensors are handed to it as
they are): all_reduce is ``model.reduce``, reduce_scatter_tensor
``model.reduce_scatter``, ``dist.reduce`` ``model.reduce_to`` (if the model has
it; ``model.reduce_buffers`` instead, where a model also says what the other
members' tensors hold), list reduce_scatter ``model.reduce_scatter_list`` (if it has it).
What gloo's dispatch does around the model, found by experiment against real
gloo (torch 2.13, 4 processes):

* ``all_reduce_coalesced`` (and the functional ``all_reduce_coalesced``) is
  ONE all-reduce of the concatenation of the flat tensors;
* the functional ``reduce_scatter_tensor`` (gloo's
  ``reduce_scatter_tensor_coalesced``) equals ``reduce_scatter_tensor`` per
  tensor;
* ``PREMUL_SUM`` raises ``RuntimeError`` on gloo; ``BAND``/``BOR``/``BXOR``
  on a floating tensor raise ``RuntimeError`` (at the call, on every rank).

Ops: SUM, AVG, PRODUCT, MIN, MAX by the model (it refuses what it does not
model); BAND/BOR/BXOR element-wise on integer and bool tensors (exact, order
free); PREMUL_SUM (non-gloo models) as a multiplication of every input by the
factor in the tensor dtype, then the model's SUM.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import GroupName

from simdist.reduce import Gloo, ReduceOp, ReductionModel
from simdist.world.engine import Call
from simdist.world.errors import CollectiveMismatchError

BACKEND_NAME = "simdist"

Complete = Callable[[list[Call], Sequence[int]], None]

_BITWISE = {"BAND": torch.bitwise_and, "BOR": torch.bitwise_or, "BXOR": torch.bitwise_xor}


class Transport(Protocol):
    """How the members' calls of one group meet (threads of one process, or real processes)."""

    def collective(self, pg: SimProcessGroup, call: Call, complete: Complete) -> None: ...

    def send(self, pg: SimProcessGroup, call: Call, tensor: torch.Tensor, dst: int, tag: int) -> dist.Work: ...

    def recv(self, pg: SimProcessGroup, call: Call, tensor: torch.Tensor, src: int, tag: int) -> dist.Work: ...


class DoneWork(dist.Work):
    """A finished collective's ``Work``: ``wait()`` returns at once; the future holds the outputs."""

    def __init__(self, result: list[torch.Tensor] | None = None) -> None:
        super().__init__()
        self._result = result or []

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def exception(self):
        return None

    def result(self) -> list[torch.Tensor]:
        return self._result

    def get_future(self) -> torch.futures.Future:
        future: torch.futures.Future = torch.futures.Future()
        future.set_result(self._result)
        return future


# -- reduce ops --------------------------------------------------------------------


class Op:
    """A ``dist.ReduceOp`` resolved once per call: its name, how errors show it, simdist's `ReduceOp`."""

    __slots__ = ("factor", "name", "reduce_op", "shown")

    def __init__(self, name: str, factor: Any = None) -> None:
        self.name = name
        self.factor = factor
        self.shown = f"op=PREMUL_SUM({factor})" if name == "PREMUL_SUM" else f"op={name}"
        self.reduce_op = ReduceOp[name] if name in ReduceOp.__members__ else None


_OPS: dict[int, Op] = {}


def resolve_op(op: Any) -> Op:
    """The `Op` of a ``dist.ReduceOp`` (or its ``RedOpType``)."""
    kind = getattr(op, "op", op)
    key = int(kind)  # hashing the enum itself costs several times more, on every collective
    found = _OPS.get(key)
    if found is not None:
        return found
    name = getattr(kind, "name", None) or str(kind).rsplit(".", 1)[-1]
    if name == "PREMUL_SUM":
        return Op(name, getattr(op, "factor", None))
    found = _OPS[key] = Op(name)
    return found


def check_op(model: ReductionModel, op: Op, tensors: Sequence[torch.Tensor]) -> None:
    """Refuse, at the call and with gloo's error type, what real gloo refuses before communicating."""
    if op.reduce_op is not None:
        return
    if op.name in _BITWISE:
        for t in tensors:
            if t.is_floating_point() or t.is_complex():
                raise RuntimeError(f"Cannot use ReduceOp.{op.name} with non-integral dtype")
    elif op.name == "PREMUL_SUM" and isinstance(model, Gloo):
        raise RuntimeError("Cannot use ReduceOp.PREMUL_SUM with Gloo")


def _model_op(op: Op) -> ReduceOp:
    """simdist's `ReduceOp` for ``op``; the model refuses the ops it does not model (``ValueError``)."""
    return op.reduce_op if op.reduce_op is not None else ReduceOp.coerce(op.name)


def _premul(tensors: Sequence[torch.Tensor], op: Op) -> list[torch.Tensor]:
    return [t * torch.as_tensor(op.factor, dtype=t.dtype, device=t.device) for t in tensors]


def reduce_all(model: ReductionModel, tensors: Sequence[torch.Tensor], op: Op) -> torch.Tensor:
    """The all-reduce of the members' ``tensors`` under ``op``."""
    if op.reduce_op is not None:
        return model.reduce(tensors, op.reduce_op)
    if op.name in _BITWISE:
        return functools.reduce(_BITWISE[op.name], tensors).clone()
    if op.name == "PREMUL_SUM":
        return model.reduce(_premul(tensors, op), ReduceOp.SUM)
    return model.reduce(tensors, _model_op(op))


def reduce_root(model: ReductionModel, tensors: Sequence[torch.Tensor], op: Op, root: int) -> torch.Tensor:
    """What ``dist.reduce`` leaves on group rank ``root``."""
    reduce_to = getattr(model, "reduce_to", None)
    if op.name in _BITWISE or op.name == "PREMUL_SUM" or reduce_to is None:
        return reduce_all(model, tensors, op)
    return reduce_to(tensors, _model_op(op), root)


def reduce_blocks(model: ReductionModel, tensors: Sequence[torch.Tensor], op: Op) -> torch.Tensor:
    """reduce_scatter_tensor: ``[n, numel / n]`` blocks, block ``i`` for group rank ``i``."""
    n = len(tensors)
    if op.name in _BITWISE:
        return reduce_all(model, [t.reshape(-1) for t in tensors], op).reshape(n, -1)
    if op.name == "PREMUL_SUM":
        return model.reduce_scatter(_premul(tensors, op), ReduceOp.SUM)
    return model.reduce_scatter(tensors, _model_op(op))


def reduce_list(model: ReductionModel, lists: Sequence[Sequence[torch.Tensor]], op: Op) -> list[torch.Tensor]:
    """List reduce_scatter: entry ``i`` of every member's list reduced, for group rank ``i``."""
    method = getattr(model, "reduce_scatter_list", None)
    if method is not None and op.name not in _BITWISE and op.name != "PREMUL_SUM":
        return list(method(lists, _model_op(op)))
    n = len(lists)
    return [reduce_all(model, [lst[i] for lst in lists], op) for i in range(n)]


# -- the process group -----------------------------------------------------------------


def _splits(t: torch.Tensor, sizes: Sequence[int] | None, n: int, what: str) -> tuple[int, ...]:
    rows = t.shape[0] if t.dim() else 1
    if sizes is None or len(sizes) == 0:
        if rows % n:
            raise ValueError(f"all_to_all_single: {what} dim 0 ({rows}) is not divisible by the group size {n}")
        return (rows // n,) * n
    sizes = tuple(int(s) for s in sizes)
    if len(sizes) != n or sum(sizes) != rows or min(sizes) < 0:
        raise ValueError(
            f"all_to_all_single: {what}_split_sizes {list(sizes)} must be {n} sizes >= 0 summing to {rows}"
        )
    return sizes


def exchange_plan(
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes: Sequence[int] | None,
    input_split_sizes: Sequence[int] | None,
    n: int,
    label: str,
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """One member's side of all_to_all_single checked: (input splits, output splits, trailing dims).

    Shared by the backend and `simdist.world.simworld.SimComm` (one implementation of the semantics).
    """
    in_splits = _splits(input, input_split_sizes, n, "input")
    out_splits = _splits(output, output_split_sizes, n, "output")
    trailing = tuple(input.shape[1:])
    if tuple(output.shape[1:]) != trailing or output.dtype != input.dtype:
        raise ValueError(
            f"all_to_all_single on {label}: output {tuple(output.shape)} {output.dtype} and input "
            f"{tuple(input.shape)} {input.dtype} must share dtype and trailing dims"
        )
    return in_splits, out_splits, trailing


def exchange_rows(calls: list[Call], targets: Sequence[int], label: str) -> None:
    """Complete an all_to_all_single: check every pair's split sizes agree, then fill the ``targets``' outputs.

    Each call carries ``extra = (input splits, output splits)`` from `exchange_plan`.
    """
    n = len(calls)
    sent = [c.extra[0] for c in calls]
    received = [c.extra[1] for c in calls]
    wrong = [
        f"rank {calls[j].rank} sends {sent[j][i]} rows to rank {calls[i].rank}, which expects {received[i][j]}"
        for i in range(n)
        for j in range(n)
        if sent[j][i] != received[i][j]
    ]
    if wrong:
        raise CollectiveMismatchError(
            f"all_to_all_single on {label}: split sizes do not match:\n  "
            + "\n  ".join(wrong)
            + "\n  calls:\n  "
            + "\n  ".join(c.describe() for c in calls)
        )
    pieces = [c.inputs[0].split(list(c.extra[0])) for c in calls]
    for i in targets:
        out = calls[i].outputs[0]
        if out.numel():
            out.copy_(torch.cat([pieces[j][i] for j in range(n)]).view(out.shape))


def _meta(tensors: Sequence[torch.Tensor]) -> tuple:
    """Shapes and dtypes of ``tensors`` as signature details."""
    if len(tensors) == 1:
        t = tensors[0]
        return (t.shape, t.dtype)
    out: list = []
    for t in tensors:
        out += [t.shape, t.dtype]
    return tuple(out)


def _layouts_agree(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether the members' tensors are contiguous, or dense views with one common memory layout.

    torch's gloo backend moves a tensor's ``numel`` elements from its data
    pointer in memory order; for such tensors that is the same as copying
    element by index, so the backend's copy gives gloo's bits.
    """
    if all(t.is_contiguous() for t in tensors):
        return True
    first = tensors[0]
    return all(_dense(t) and t.stride() == first.stride() for t in tensors)


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill ``numel`` consecutive memory slots (a permutation of a contiguous tensor)."""
    expected = 1
    for stride, size in sorted((st, sz) for st, sz in zip(t.stride(), t.shape, strict=True) if sz > 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _refuse_layouts(name: str, label: str, tensors: Sequence[torch.Tensor]) -> None:
    """Raise for views whose memory gloo would move differently from their elements (it does not refuse them)."""
    if not _layouts_agree(tensors):
        raise ValueError(
            f"{name} on {label}: gloo moves a tensor's numel elements from its data pointer in memory order; "
            f"these views (shapes {[tuple(t.shape) for t in tensors]}, strides {[t.stride() for t in tensors]}) "
            "have gaps or differ in memory layout between ranks, so real gloo would move other elements than the "
            "view's. Pass contiguous tensors."
        )


GLOO_DTYPES = frozenset(
    {torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int32, torch.int64}
    | {torch.bool}
)
"""The dtypes torch's gloo backend has collective kernels for (found by experiment, torch 2.13); others raise
``RuntimeError("Invalid scalar type")`` at the call. Complex tensors reach it as ``view_as_real`` where torch's
Python layer converts them (all_reduce, broadcast, all_gather, scatter, all_to_all); ``reduce`` and the
reduce_scatters take complex SUM/AVG themselves (the model reduces the real view); ``gather`` refuses complex."""


def refuse_gloo_dtypes(name: str, label: str, tensors: Sequence[torch.Tensor], complex_ok: bool = True) -> None:
    """Raise gloo's ``RuntimeError("Invalid scalar type")`` for a dtype it has no kernel for (send/recv excepted)."""
    for t in tensors:
        if t.dtype not in GLOO_DTYPES and not (complex_ok and t.is_complex()):
            raise RuntimeError(
                f"Invalid scalar type: {name} on {label}: torch's gloo backend has no kernel for {t.dtype} "
                "(it raises this RuntimeError at the call; send/recv move any dtype)"
            )


def write_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)``, but a bool result keeps its bytes: gloo leaves e.g. byte 3 after a SUM of three
    ``True`` (``copy_`` would write 1)."""
    if dst.dtype == torch.bool and src.dtype == torch.bool:
        dst.view(torch.uint8).copy_(src.view(torch.uint8))
    else:
        dst.copy_(src)


def memory_order(t: torch.Tensor) -> torch.Tensor:
    """``t``'s ``numel`` elements as torch's gloo backend sends a scatter entry (found by experiment): the
    ``numel`` consecutive elements from its data pointer, whatever its strides. A transposed entry arrives in
    storage order; a view with gaps sends the memory between its elements too (the memory is read as real
    gloo reads it). A view whose elements overlap (``expand()``) is refused with ``ValueError``: gloo would
    read past the memory the view spans."""
    if t.is_contiguous():
        return t.reshape(-1)
    span = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
    if t.numel() and span < t.numel():
        raise ValueError(
            f"scatter: gloo sends a tensor's numel ({t.numel()}) elements from its data pointer; this view (shape "
            f"{tuple(t.shape)}, strides {t.stride()}) spans only {span} elements, so real gloo would read memory "
            "past it. Pass a contiguous tensor."
        )
    return t.as_strided((t.numel(),), (1,))


def reduce_complete(model: ReductionModel, op: Op, root: int, count: int) -> Complete:
    """The ``complete`` of ``dist.reduce`` of ``count`` tensors per member to group rank ``root``.

    Shared by the backend and `simdist.world.simworld.SimComm.reduce`. Where
    the model says what every member's tensor holds afterwards
    (``reduce_buffers``, gloo's non-root partial sums) every target gets it;
    otherwise only the root's tensor is written.
    """
    buffers = getattr(model, "reduce_buffers", None) if op.reduce_op is not None else None

    def complete(calls: list[Call], targets: Sequence[int]) -> None:
        for k in range(count):
            members = [c.inputs[k] for c in calls]
            if buffers is not None:  # the model says what every member's tensor holds afterwards
                results = buffers(members, op.reduce_op, root)
                for i in targets:
                    write_bytes(calls[i].inputs[k], results[i])
                continue
            # computed for non-root targets too (process mode), so a model's refusal reaches every rank
            result = reduce_root(model, members, op, root)
            if root in targets:
                write_bytes(calls[root].inputs[k], result)

    return complete


def reduce_scatter_list_complete(model: ReductionModel, op: Op, count: int, gloo_rules: bool, label: str) -> Complete:
    """The ``complete`` of list ``reduce_scatter`` (``count`` outputs per member): entry ``i`` of every member's
    list reduced, for group rank ``i``. Shared by the backend and `simdist.world.simworld.SimComm.reduce_scatter`;
    ``gloo_rules`` refuses the entry shapes gloo refuses (`refuse_entry_shapes`)."""

    def complete(calls: list[Call], targets: Sequence[int]) -> None:
        for k in range(count):
            if gloo_rules:
                refuse_entry_shapes(calls, k, label)
            blocks = reduce_list(model, [c.inputs[k] for c in calls], op)
            for i in targets:
                write_bytes(calls[i].outputs[k], blocks[i])

    return complete


def refuse_entry_shapes(calls: list[Call], k: int, label: str) -> None:
    """List reduce_scatter: every entry of every member's list must have the output's shape, or refuse.

    On gloo (torch 2.13) the rank whose own entry differs from its output
    raises ``RuntimeError`` at the call ("Check failed: outputs[0].sizes()
    == inputs[0][i].sizes()") while the others enter the collective and hang;
    simdist refuses on every member instead of answering.
    """
    for c in calls:
        out = c.extra[k]  # each member's output shapes travel in ``extra`` (process mode has no peer outputs)
        wrong = [j for j, t in enumerate(c.inputs[k]) if tuple(t.shape) != out]
        if wrong:
            raise RuntimeError(
                f"reduce_scatter on {label}: rank {c.rank}'s input entries {wrong} have shapes "
                f"{[tuple(c.inputs[k][j].shape) for j in wrong]}, its output {out}; gloo needs them "
                "equal (on gloo the rank whose own entry differs raises this RuntimeError at the call and its peers "
                "hang in the collective)"
            )


def refuse_scatter_shapes(calls: list[Call], k: int, root: int, label: str) -> None:
    """scatter: entry ``i`` of the root's list must have rank ``i``'s output shape and dtype, or refuse
    (on gloo a wrong-shape scatter list leaves the peers hanging)."""
    sources = calls[root].inputs[k]
    for i, c in enumerate(calls):
        (shape, dtype), src = c.extra[k], sources[i]  # each member's output shape travels in ``extra``
        if tuple(src.shape) != shape or src.dtype != dtype:
            raise RuntimeError(
                f"scatter on {label}: the root's entry {i} is {tuple(src.shape)} {src.dtype}, rank {c.rank}'s "
                f"output {shape} {dtype}; gloo needs them equal (on gloo this hangs the peers)"
            )


def _untracked(tree):
    """A call's tensors as ``.data`` aliases: written as gloo writes from C++ (no autograd record, no version bump).

    So ``dist.broadcast(param, 0)`` on an ``nn.Parameter`` works, and a tensor
    saved for backward can be overwritten as on gloo (found by experiment).
    """
    if isinstance(tree, torch.Tensor):
        return tree.data
    return type(tree)(_untracked(item) for item in tree)


class SimProcessGroup(dist.ProcessGroup):
    """One rank's handle on one simulated group; collectives go through a `Transport` to the group's model.

    ``ranks`` are the group's global ranks in group-rank order (torch sorts
    them); ``label`` names the group in error messages.
    """

    def __init__(
        self,
        rank: int,
        size: int,
        ranks: tuple[int, ...],
        name: str,
        label: str,
        model: ReductionModel,
        transport: Transport,
    ) -> None:
        # torch's stub lists only (store, rank, size); the binding also takes (rank, size), as the backend API uses
        super().__init__(rank, size)  # type: ignore[call-arg]
        self._group_rank = rank
        self._group_size = size
        self.ranks = ranks
        self._name = name
        self.label = label
        self.model = model
        self.transport = transport
        self.key = (name, ranks)  # the group's call sequence in the engine
        self.global_rank = ranks[rank]
        self.gloo_rules = isinstance(model, Gloo)  # refuse what torch's gloo backend refuses (shape rules)

    # -- identity ---------------------------------------------------------------

    def size(self) -> int:
        return self._group_size

    def rank(self) -> int:
        return self._group_rank

    def getBackendName(self) -> str:
        return BACKEND_NAME

    @property
    def group_name(self) -> GroupName:
        return GroupName(self._name)

    @property
    def pg_name(self) -> str:
        return self._name

    def __repr__(self) -> str:
        return f"SimProcessGroup({self.label}, rank {self._group_rank} of {self._group_size}, model={self.model.name})"

    # -- plumbing ---------------------------------------------------------------

    def _call(self, op: str, details: tuple, inputs=(), outputs=(), extra=None) -> Call:
        frame = sys._getframe(2)
        return Call(self.global_rank, (op, self.label, *details), frame, inputs, outputs, extra)

    def _run(self, call: Call, complete: Complete, result: list[torch.Tensor]) -> DoneWork:
        call.inputs, call.outputs = _untracked(call.inputs), _untracked(call.outputs)
        self.transport.collective(self, call, complete)
        return DoneWork(result)

    # -- reductions -------------------------------------------------------------

    def allreduce(self, tensors, opts=None):
        op = resolve_op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        if op.reduce_op is None:
            check_op(self.model, op, tensors)
        if self.gloo_rules:
            refuse_gloo_dtypes("all_reduce", self.label, tensors)
        model = self.model

        def complete(calls: list[Call], targets: Sequence[int]) -> None:
            for k in range(len(tensors)):
                try:
                    result = reduce_all(model, [c.inputs[k] for c in calls], op)
                except RuntimeError as exc:  # gloo's integer AVG: the SUM is written, then div_ raises
                    written = getattr(exc, "written", None)
                    if written is not None:
                        for i in targets:
                            write_bytes(calls[i].inputs[k], written)
                    raise
                for i in targets:
                    write_bytes(calls[i].inputs[k], result)

        # the hot path of every training step: the Call is built here, not through _call
        signature = ("all_reduce", self.label, op.shown, *_meta(tensors))
        call = Call(self.global_rank, signature, sys._getframe(1), tuple(tensors))
        return self._run(call, complete, tensors)  # every collective passes _run (simdist.audit hooks it)

    def allreduce_coalesced(self, tensors, opts=None):
        op = resolve_op((opts or dist.AllreduceCoalescedOptions()).reduceOp)
        check_op(self.model, op, tensors)
        if self.gloo_rules:
            refuse_gloo_dtypes("all_reduce_coalesced", self.label, tensors)
        if len({t.dtype for t in tensors}) > 1:
            raise RuntimeError(f"all_reduce_coalesced on {self.label}: the tensors must share one dtype")
        model = self.model
        sizes = [t.numel() for t in tensors]

        def complete(calls: list[Call], targets: Sequence[int]) -> None:
            flat = [torch.cat([t.reshape(-1) for t in c.inputs]) for c in calls]
            pieces = reduce_all(model, flat, op).split(sizes)
            for i in targets:
                for t, piece in zip(calls[i].inputs, pieces, strict=True):
                    t.copy_(piece.view(t.shape))

        call = self._call("all_reduce_coalesced", (op.shown, *_meta(tensors)), tuple(tensors))
        return self._run(call, complete, list(tensors))

    def reduce(self, tensors, opts=None):
        opts = opts or dist.ReduceOptions()
        op, root = resolve_op(opts.reduceOp), opts.rootRank
        check_op(self.model, op, tensors)
        if self.gloo_rules:
            refuse_gloo_dtypes("reduce", self.label, tensors)
        complete = reduce_complete(self.model, op, root, len(tensors))
        call = self._call("reduce", (op.shown, f"dst={self.ranks[root]}", *_meta(tensors)), tuple(tensors))
        return self._run(call, complete, list(tensors))

    def reduce_scatter_single(self, output, input, opts=None):
        return self._reduce_scatter_tensors([output], [input], opts, "reduce_scatter_tensor")

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        return self._reduce_scatter_tensors(list(outputs), list(inputs), opts, "reduce_scatter_tensor_coalesced")

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    def _reduce_scatter_tensors(self, outputs, inputs, opts, name):
        op = resolve_op((opts or dist.ReduceScatterOptions()).reduceOp)
        check_op(self.model, op, inputs)
        n, model = self._group_size, self.model
        if self.gloo_rules:
            refuse_gloo_dtypes(name, self.label, inputs)
            if any(out.dim() == 0 for out in outputs):
                raise RuntimeError(
                    f"{name} on {self.label}: a 0-dim output; torch's gloo backend crashes the process "
                    "(segmentation fault) on this. Give the output a dim 0 (e.g. shape (1,))."
                )
        for out, inp in zip(outputs, inputs, strict=True):
            if inp.numel() != out.numel() * n or inp.dtype != out.dtype:
                raise ValueError(
                    f"{name} on {self.label}: input has {inp.numel()} {inp.dtype} elements, output {out.numel()} "
                    f"{out.dtype}; need input numel = {n} x output numel, same dtype"
                )
            if self.gloo_rules and out.dim() and inp.dim() and out.shape[0] * n != inp.shape[0]:
                raise RuntimeError(
                    f"{name} on {self.label}: output dim 0 ({out.shape[0]}) x {n} != input dim 0 "
                    f"({inp.shape[0]}); torch's gloo backend raises this RuntimeError too (Check failed: "
                    "outputShape[0] * worldSize == inputShape[0])"
                )

        def complete(calls: list[Call], targets: Sequence[int]) -> None:
            for k in range(len(inputs)):
                blocks = reduce_blocks(model, [c.inputs[k] for c in calls], op)
                for i in targets:
                    out = calls[i].outputs[k]
                    out.copy_(blocks[i].view(out.shape))

        call = self._call(name, (op.shown, *_meta(inputs)), tuple(inputs), tuple(outputs))
        return self._run(call, complete, list(outputs))

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        op = resolve_op((opts or dist.ReduceScatterOptions()).reduceOp)
        check_op(self.model, op, [t for lst in input_tensors for t in lst])
        if self.gloo_rules:
            refuse_gloo_dtypes("reduce_scatter", self.label, [t for lst in input_tensors for t in lst])
        complete = reduce_scatter_list_complete(self.model, op, len(output_tensors), self.gloo_rules, self.label)
        inputs = tuple(list(lst) for lst in input_tensors)
        details = (op.shown, *_meta([t for lst in input_tensors for t in lst]))
        extra = tuple(tuple(t.shape) for t in output_tensors)
        call = self._call("reduce_scatter", details, inputs, tuple(output_tensors), extra)
        return self._run(call, complete, list(output_tensors))

    # -- data movement ------------------------------------------------------------

    def broadcast(self, tensors, opts=None):
        root = (opts or dist.BroadcastOptions()).rootRank
        gloo_rules, label = self.gloo_rules, self.label
        if gloo_rules:
            refuse_gloo_dtypes("broadcast", label, tensors)

        def complete(calls: list[Call], targets: Sequence[int]) -> None:
            for k in range(len(tensors)):
                if gloo_rules:
                    _refuse_layouts("broadcast", label, [c.inputs[k] for c in calls])
                for i in targets:
                    if i != root:
                        calls[i].inputs[k].copy_(calls[root].inputs[k])

        call = self._call("broadcast", (f"src={self.ranks[root]}", *_meta(tensors)), tuple(tensors))
        return self._run(call, complete, list(tensors))

    def allgather(self, output_tensors, input_tensors, opts=None):
        n = self._group_size
        if self.gloo_rules:
            refuse_gloo_dtypes("all_gather", self.label, input_tensors)
        for outs, inp in zip(output_tensors, input_tensors, strict=True):
            if len(outs) != n:
                raise ValueError(f"all_gather on {self.label}: the output list needs {n} tensors, got {len(outs)}")
            wrong = [i for i, o in enumerate(outs) if o.shape != inp.shape]
            if self.gloo_rules and wrong:
                raise RuntimeError(
                    f"all_gather on {self.label}: output {wrong[0]} has shape {tuple(outs[wrong[0]].shape)}, "
                    f"the input {tuple(inp.shape)}; gloo needs them equal"
                )

        def complete(calls: list[Call], targets: Sequence[int]) -> None:
            for k in range(len(input_tensors)):
                for i in targets:
                    for j, out in enumerate(calls[i].outputs[k]):
                        out.copy_(calls[j].inputs[k].view(out.shape))

        call = self._call(
            "all_gather", _meta(input_tensors), tuple(input_tensors), tuple(list(o) for o in output_tensors)
        )
        return self._run(call, complete, [t for o in output_tensors for t in o])

    def allgather_coalesced(self, output_lists, input_list, opts=None):
        return self.allgather(output_lists, input_list, opts)

    def all_gather_single(self, output, input, opts=None):
        return self._all_gather_tensors([output], [input], "all_gather_into_tensor")

    _allgather_base = all_gather_single

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        return self._all_gather_tensors(list(outputs), list(inputs), "all_gather_into_tensor_coalesced")

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def _all_gather_tensors(self, outputs, inputs, name):
        n = self._group_size
        if self.gloo_rules:
            refuse_gloo_dtypes(name, self.label, inputs)
        for out, inp in zip(outputs, inputs, strict=True):
            piece = (out.shape[0] // n, *out.shape[1:]) if out.dim() and out.shape[0] % n == 0 else None
            if self.gloo_rules and out.dim() and piece != tuple(inp.shape):
                raise RuntimeError(
                    f"{name} on {self.label}: gloo cuts the output {tuple(out.shape)} into {n} pieces along dim 0, "
                    f"each of the input's shape {tuple(inp.shape)}"
                )
            if out.numel() != inp.numel() * n or inp.dtype != out.dtype:
                raise ValueError(
                    f"{name} on {self.label}: input has {inp.numel()} {inp.dtype} elements, output {out.numel()} "
                    f"{out.dtype}; need output numel = {n} x input numel, same dtype"
                )

        def complete(calls: list[Call], targets: Sequence[int]) -> None:
            for k in range(len(inputs)):
                gathered = torch.cat([c.inputs[k].reshape(-1) for c in calls])
                for i in targets:
                    out = calls[i].outputs[k]
                    out.copy_(gathered.view(out.shape))

        call = self._call(name, _meta(inputs), tuple(inputs), tuple(outputs))
        return self._run(call, complete, list(outputs))

    def gather(self, output_tensors, input_tensors, opts=None):
        root = (opts or dist.GatherOptions()).rootRank
        if self.gloo_rules:
            refuse_gloo_dtypes("gather", self.label, input_tensors, complex_ok=False)

        def complete(calls: list[Call], targets: Sequence[int]) -> None:
            if root in targets:
                for k in range(len(input_tensors)):
                    for j, out in enumerate(calls[root].outputs[k]):
                        out.copy_(calls[j].inputs[k])

        outputs = tuple(list(o) for o in output_tensors)
        call = self._call("gather", (f"dst={self.ranks[root]}", *_meta(input_tensors)), tuple(input_tensors), outputs)
        return self._run(call, complete, [t for o in output_tensors for t in o])

    def scatter(self, output_tensors, input_tensors, opts=None):
        root = (opts or dist.ScatterOptions()).rootRank
        if self.gloo_rules and not all(t.is_contiguous() for t in output_tensors):
            raise ValueError(
                f"scatter on {self.label}: the output must be contiguous (gloo writes a strided output's memory "
                "in order, not its elements)"
            )

        if self.gloo_rules:
            refuse_gloo_dtypes("scatter", self.label, output_tensors)
        gloo_rules, label = self.gloo_rules, self.label

        def complete(calls: list[Call], targets: Sequence[int]) -> None:
            for k in range(len(output_tensors)):
                sources = calls[root].inputs[k]
                if not gloo_rules:
                    for i in targets:
                        calls[i].outputs[k].copy_(sources[i])
                    continue
                refuse_scatter_shapes(calls, k, root, label)
                for i in targets:  # gloo sends each entry's memory as it lies (a transposed entry: storage order)
                    out = calls[i].outputs[k]
                    out.copy_(memory_order(sources[i]).view(out.shape))

        inputs = tuple(list(lst) for lst in input_tensors)
        extra = tuple((tuple(t.shape), t.dtype) for t in output_tensors)
        details = (f"src={self.ranks[root]}", *_meta(output_tensors))
        call = self._call("scatter", details, inputs, tuple(output_tensors), extra)
        return self._run(call, complete, list(output_tensors))

    def alltoall(self, output_tensors, input_tensors, opts=None):
        if self.gloo_rules:
            refuse_gloo_dtypes("all_to_all", self.label, input_tensors)
            shapes = {tuple(t.shape) for t in [*input_tensors, *output_tensors]}
            if len(shapes) > 1:
                raise RuntimeError(
                    f"all_to_all on {self.label}: gloo needs every input and output tensor of one shape, "
                    f"got {sorted(shapes)}"
                )

        def complete(calls: list[Call], targets: Sequence[int]) -> None:
            for i in targets:
                for j, out in enumerate(calls[i].outputs):
                    out.copy_(calls[j].inputs[i])

        dtype = input_tensors[0].dtype if input_tensors else None
        call = self._call("all_to_all", (dtype,), tuple(input_tensors), tuple(output_tensors))
        return self._run(call, complete, list(output_tensors))

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        n = self._group_size
        if self.gloo_rules:
            refuse_gloo_dtypes("all_to_all_single", self.label, [input])
        if self.gloo_rules and not (input.is_contiguous() and output.is_contiguous()):
            which = "input" if not input.is_contiguous() else "output"
            raise ValueError(
                f"all_to_all_single on {self.label}: the {which} must be contiguous (gloo refuses a strided input "
                "and moves a strided output's memory, not its elements)"
            )
        in_splits, out_splits, trailing = exchange_plan(
            output, input, output_split_sizes, input_split_sizes, n, self.label
        )
        label = self.label

        def complete(calls: list[Call], targets: Sequence[int]) -> None:
            exchange_rows(calls, targets, label)

        details = (input.dtype, f"trailing dims={trailing}")
        call = self._call("all_to_all_single", details, (input,), (output,), (in_splits, out_splits))
        return self._run(call, complete, [output])

    alltoall_base = all_to_all_single

    def barrier(self, opts=None):
        call = self._call("barrier", ())
        return self._run(call, lambda calls, targets: None, [])

    # -- point to point -------------------------------------------------------------

    def send(self, tensors, dst_rank, tag=0):
        (tensor,) = tensors
        if self.gloo_rules and not tensor.is_contiguous():
            raise RuntimeError(
                f"send on {self.label}: input tensor has to be contiguous (as on gloo, which raises this)"
            )
        call = self._call("send", (f"dst={self.ranks[dst_rank]}", f"tag={tag}", tensor.shape, tensor.dtype))
        return self.transport.send(self, call, tensor, dst_rank, tag)

    def recv(self, tensors, src_rank, tag=0):
        (tensor,) = tensors
        if self.gloo_rules and not tensor.is_contiguous():
            raise RuntimeError(f"recv on {self.label}: the receive buffer must be contiguous (as on gloo)")
        call = self._call("recv", (f"src={self.ranks[src_rank]}", f"tag={tag}", tensor.shape, tensor.dtype))
        return self.transport.recv(self, call, tensor, src_rank, tag)

    def recv_anysource(self, tensors, tag=0):
        raise RuntimeError("the simdist backend does not support recv from any source (pass src)")
