"""Every collective once: its checks at the call and its completion over all members' calls.

Both front ends -- `simdist.world.simworld.SimComm` (rank programs on a
`Comm`) and `simdist.world.backend.SimProcessGroup` (unmodified
``torch.distributed`` code) -- describe a collective with the functions below
and differ only in how they name the group and how the calls meet (the
rendezvous `simdist.world.engine.Engine`, or process mode's inner gloo group).

Each collective function takes the group (`Members`: its label, reduction
model, whether gloo's rules apply, its global ranks), the calling rank's global
rank and frame, the tensors and options, runs the checks a real backend makes
at the call (raising on the calling rank), and returns ``(call, complete)``:
the rank's `simdist.world.engine.Call` and a ``complete(calls, targets)``
function that computes the result from every member's call (group-rank order)
and writes the outputs of the members in ``targets``. The engine runs
``complete`` once for all members; process mode runs it on each rank for
itself. Same ``complete``, same inputs: same bits in every front end.

Sums are the group's `ReductionModel` (the members' tensors are handed to it as
they are): all_reduce is ``model.reduce``, reduce_scatter_tensor
``model.reduce_scatter``, reduce ``model.reduce_to`` (if the model has it;
``model.reduce_buffers`` instead, where a model also says what the other
members' tensors hold), list reduce_scatter ``model.reduce_scatter_list`` (if
it has it). Ops: SUM, AVG, PRODUCT, MIN, MAX by the model (it refuses what it
does not model); BAND/BOR/BXOR element-wise on integer and bool tensors (exact,
order free); PREMUL_SUM (models without gloo's rules) as a multiplication of
every input by the factor in the tensor dtype, then the model's SUM.

Where the model has ``gloo_rules`` (`simdist.reduce.Gloo`), the checks are
torch's gloo backend's, found by experiment against real gloo (torch 2.13):
its dtypes (`GLOO_DTYPES`), its shape rules per collective, ``PREMUL_SUM``
refused, and one layout rule for what gloo reads from memory: the reduction
model's own `simdist.reduce.gloo.memory_rows` (a tensor's ``numel`` elements
from its data pointer; views with gaps, or ranks with different layouts,
refused).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from simdist.reduce import ReduceOp, ReductionModel
from simdist.reduce.gloo import memory_rows
from simdist.world.engine import Call
from simdist.world.errors import CollectiveMismatchError

Complete = Callable[[list[Call], Sequence[int]], None]
"""``complete(calls, targets)``: compute from every member's call, write the outputs of the members ``targets``."""

Prepared = tuple[Call, Complete]

_BITWISE = {"BAND": torch.bitwise_and, "BOR": torch.bitwise_or, "BXOR": torch.bitwise_xor}


class Members(Protocol):
    """What a collective needs to know of its group (a `SimProcessGroup`, or SimComm's view of a `Group`)."""

    label: str  # the group in error messages and call signatures
    model: ReductionModel
    gloo_rules: bool  # refuse what torch's gloo backend refuses (the model's ``gloo_rules``)
    ranks: tuple[int, ...]  # global ranks in group-rank order
    checked: dict  # `all_reduce_one`'s cache: checks passed, signature and completion per (op, shape, dtype)


# -- reduce ops --------------------------------------------------------------------


class Op:
    """A reduce op resolved once per call: its name, how errors show it, simdist's `ReduceOp`."""

    __slots__ = ("factor", "name", "reduce_op", "shown")

    def __init__(self, name: str, factor: Any = None) -> None:
        self.name = name
        self.factor = factor
        self.shown = f"op=PREMUL_SUM({factor})" if name == "PREMUL_SUM" else f"op={name}"
        self.reduce_op = ReduceOp[name] if name in ReduceOp.__members__ else None


_OPS: dict[int, Op] = {}
_NAMED: dict[str, Op] = {}


def resolve_op(op: Any) -> Op:
    """The `Op` of a ``dist.ReduceOp`` (or its ``RedOpType``).

    The hot path is one ``hash``: c10d's ``ReduceOp`` and ``RedOpType`` hash to the op type's number (torch's
    bindings; reading ``op.op`` and converting it costs three times more, on every collective). An op is filed
    under its hash only where that equals its type's number, and ``PREMUL_SUM`` (a factor per call) never is.
    """
    found = _OPS.get(hash(op))
    if found is not None:
        return found
    kind = getattr(op, "op", op)
    key = int(kind)
    name = getattr(kind, "name", None) or str(kind).rsplit(".", 1)[-1]
    if name == "PREMUL_SUM":
        return Op(name, getattr(op, "factor", None))
    found = Op(name)
    if hash(op) == key:
        _OPS[key] = found
    return found


_MEMBER_OPS: dict[int, Op] = {}  # id of a `ReduceOp` member -> its Op (members live as long as the enum)


def named_op(op: ReduceOp | str) -> Op:
    """The `Op` of simdist's `ReduceOp` (or its name), as a `Comm` passes it."""
    found = _MEMBER_OPS.get(id(op))  # an enum's .name and hash are Python code: this runs on every collective
    if found is not None:
        return found
    if isinstance(op, ReduceOp):
        found = _MEMBER_OPS[id(op)] = named_op(op.name)
        return found
    name = ReduceOp.coerce(op).name
    found = _NAMED.get(name)
    if found is None:
        found = _NAMED[name] = Op(name)
    return found


def check_op(model: ReductionModel, op: Op, tensors: Sequence[torch.Tensor]) -> None:
    """Refuse, at the call and with gloo's error type, what real gloo refuses before communicating."""
    if op.reduce_op is not None:
        return
    if op.name in _BITWISE:
        for t in tensors:
            if t.is_floating_point() or t.is_complex():
                raise RuntimeError(f"Cannot use ReduceOp.{op.name} with non-integral dtype")
    elif op.name == "PREMUL_SUM" and model.gloo_rules:
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
    """What ``reduce`` leaves on group rank ``root``."""
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


# -- checks ------------------------------------------------------------------------


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


def _meta(tensors: Sequence[torch.Tensor]) -> tuple:
    """Shapes and dtypes of ``tensors`` as signature details."""
    if len(tensors) == 1:
        t = tensors[0]
        return (t.shape, t.dtype)
    out: list = []
    for t in tensors:
        out += [t.shape, t.dtype]
    return tuple(out)


def refuse_layouts(name: str, label: str, tensors: Sequence[torch.Tensor]) -> None:
    """Raise for views whose memory gloo would move differently from their elements (it does not refuse them).

    The rule is the reduction model's (`simdist.reduce.gloo.memory_rows`): gloo
    moves a tensor's ``numel`` elements from its data pointer in memory order,
    which is copying element by element only for dense tensors of one layout.
    """
    if all(t.is_contiguous() for t in tensors):
        return
    try:
        memory_rows(tensors)
    except ValueError as exc:
        raise ValueError(
            f"{name} on {label}: gloo moves a tensor's numel elements from its data pointer in memory order; "
            f"these views (shapes {[tuple(t.shape) for t in tensors]}, strides {[t.stride() for t in tensors]}) "
            "have gaps or differ in memory layout between ranks, so real gloo would move other elements than the "
            "view's. Pass contiguous tensors."
        ) from exc


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


def _splits(t: torch.Tensor, sizes: Sequence[int] | None, n: int, what: str) -> tuple[int, ...]:
    """A rank's split sizes, checked at the call; ``RuntimeError`` as torch raises it on gloo (its messages:
    "Number of tensor splits not equal to group size", "Split sizes doesn't match total dim 0 size", gloo's
    enforce on an indivisible dim 0)."""
    rows = t.shape[0] if t.dim() else 1
    if sizes is None or len(sizes) == 0:
        if rows % n:
            raise RuntimeError(f"all_to_all_single: {what} dim 0 ({rows}) is not divisible by the group size {n}")
        return (rows // n,) * n
    sizes = tuple(int(s) for s in sizes)
    if len(sizes) != n:
        raise RuntimeError(
            f"all_to_all_single: {len(sizes)} {what}_split_sizes, the group has {n} (Number of tensor splits not "
            "equal to group size)"
        )
    if sum(sizes) != rows or min(sizes) < 0:
        raise RuntimeError(
            f"all_to_all_single: {what}_split_sizes {list(sizes)} must be {n} sizes >= 0 summing to {rows} "
            "(Split sizes doesn't match total dim 0 size)"
        )
    return sizes


def exchange_rows(calls: list[Call], targets: Sequence[int], label: str) -> None:
    """Complete an all_to_all_single: check every pair's split sizes agree, then fill the ``targets``' outputs.

    Each call carries ``extra = (input splits, output splits)``.
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


# -- reductions --------------------------------------------------------------------


def all_reduce(m: Members, rank: int, frame: Any, tensors: Sequence[torch.Tensor], op: Op) -> Prepared:
    """Reduce each of ``tensors`` across the group in place (the hot path of every training step)."""
    model, label = m.model, m.label
    if op.reduce_op is None:
        check_op(model, op, tensors)
    if m.gloo_rules:
        refuse_gloo_dtypes("all_reduce", label, tensors)
    count = len(tensors)

    into = getattr(model, "reduce_into", None) if op.reduce_op is not None else None

    def complete(calls: list[Call], targets: Sequence[int]) -> None:
        for k in range(count):
            members = [c.inputs[k] for c in calls]
            if into is not None and into(members, op.reduce_op, [members[i] for i in targets]):
                continue  # one pass: each member read once, each target written once (the model's bits)
            try:
                result = reduce_all(model, members, op)
            except RuntimeError as exc:  # gloo's integer AVG: the SUM is written, then div_ raises
                written = getattr(exc, "written", None)
                if written is not None:
                    for i in targets:
                        write_bytes(calls[i].inputs[k], written)
                raise
            for i in targets:
                write_bytes(calls[i].inputs[k], result)

    call = Call(rank, ("all_reduce", label, op.shown, *_meta(tensors)), frame, tuple(tensors))
    return call, complete


CHECKED_LIMIT = 256
"""The most (op, shape, dtype) entries `all_reduce_one` keeps per group (then it starts afresh)."""


def all_reduce_one(m: Members, rank: int, frame: Any, tensor: torch.Tensor, op: Op) -> Prepared:
    """`all_reduce` of one tensor, its checks run once per (op, shape, dtype) on the group (the hot path).

    The checks of `all_reduce` depend on the op and the dtype only, its
    signature on the op, shape and dtype, its completion on the op: the first
    call with a key runs `all_reduce` and keeps what it made in ``m.checked``;
    later calls with the same key reuse the signature and completion (a
    mismatch between ranks still shows: a rank calling with another shape or
    dtype has another key, so another signature). ``PREMUL_SUM`` (its factor is
    per call) is never cached.
    """
    key = (op, tensor.shape, tensor.dtype)
    checked = m.checked
    found = checked.get(key)
    if found is not None:
        return Call(rank, found[0], frame, (tensor,)), found[1]
    call, complete = all_reduce(m, rank, frame, (tensor,), op)
    if op.name != "PREMUL_SUM":
        if len(checked) >= CHECKED_LIMIT:
            checked.clear()
        checked[key] = (call.signature, complete)
    return call, complete


def all_reduce_coalesced(m: Members, rank: int, frame: Any, tensors: Sequence[torch.Tensor], op: Op) -> Prepared:
    """ONE all-reduce of the concatenation of the flat tensors (gloo's ``all_reduce_coalesced``, by experiment)."""
    model, label = m.model, m.label
    check_op(model, op, tensors)
    if m.gloo_rules:
        refuse_gloo_dtypes("all_reduce_coalesced", label, tensors)
    if len({t.dtype for t in tensors}) > 1:
        raise RuntimeError(f"all_reduce_coalesced on {label}: the tensors must share one dtype")
    sizes = [t.numel() for t in tensors]

    def complete(calls: list[Call], targets: Sequence[int]) -> None:
        flat = [torch.cat([t.reshape(-1) for t in c.inputs]) for c in calls]
        pieces = reduce_all(model, flat, op).split(sizes)
        for i in targets:
            for t, piece in zip(calls[i].inputs, pieces, strict=True):
                t.copy_(piece.view(t.shape))

    call = Call(rank, ("all_reduce_coalesced", label, op.shown, *_meta(tensors)), frame, tuple(tensors))
    return call, complete


def reduce(m: Members, rank: int, frame: Any, tensors: Sequence[torch.Tensor], op: Op, root: int) -> Prepared:
    """Reduce each of ``tensors`` to group rank ``root`` in place.

    Where the model says what every member's tensor holds afterwards
    (``reduce_buffers``, gloo's non-root partial sums) every target gets it;
    otherwise only the root's tensor is written.
    """
    model, label = m.model, m.label
    check_op(model, op, tensors)
    if m.gloo_rules:
        refuse_gloo_dtypes("reduce", label, tensors)
    buffers = getattr(model, "reduce_buffers", None) if op.reduce_op is not None else None
    count = len(tensors)

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

    signature = ("reduce", label, op.shown, f"dst={m.ranks[root]}", *_meta(tensors))
    return Call(rank, signature, frame, tuple(tensors)), complete


def reduce_scatter_tensors(
    m: Members,
    rank: int,
    frame: Any,
    outputs: Sequence[torch.Tensor],
    inputs: Sequence[torch.Tensor],
    op: Op,
    name: str = "reduce_scatter_tensor",
) -> Prepared:
    """reduce_scatter_tensor (and its coalesced form, one per pair): group rank ``i`` gets block ``i`` of the
    flat result of each input."""
    model, label, n = m.model, m.label, len(m.ranks)
    check_op(model, op, inputs)
    if m.gloo_rules:
        refuse_gloo_dtypes(name, label, inputs)
        if any(out.dim() == 0 for out in outputs):
            raise RuntimeError(
                f"{name} on {label}: a 0-dim output; torch's gloo backend crashes the process "
                "(segmentation fault) on this. Give the output a dim 0 (e.g. shape (1,))."
            )
    for out, inp in zip(outputs, inputs, strict=True):
        if inp.numel() != out.numel() * n or inp.dtype != out.dtype:
            raise ValueError(
                f"{name} on {label}: input has {inp.numel()} {inp.dtype} elements, output {out.numel()} "
                f"{out.dtype}; need input numel = {n} x output numel, same dtype"
            )
        if m.gloo_rules and out.dim() and inp.dim() and out.shape[0] * n != inp.shape[0]:
            raise RuntimeError(
                f"{name} on {label}: output dim 0 ({out.shape[0]}) x {n} != input dim 0 "
                f"({inp.shape[0]}); torch's gloo backend raises this RuntimeError too (Check failed: "
                "outputShape[0] * worldSize == inputShape[0])"
            )
    count = len(inputs)

    def complete(calls: list[Call], targets: Sequence[int]) -> None:
        for k in range(count):
            blocks = reduce_blocks(model, [c.inputs[k] for c in calls], op)  # as laid out: gloo reads memory
            for i in targets:
                out = calls[i].outputs[k]
                out.copy_(blocks[i].view(out.shape))

    call = Call(rank, (name, label, op.shown, *_meta(inputs)), frame, tuple(inputs), tuple(outputs))
    return call, complete


def reduce_scatter_list(
    m: Members,
    rank: int,
    frame: Any,
    outputs: Sequence[torch.Tensor],
    input_lists: Sequence[Sequence[torch.Tensor]],
    op: Op,
) -> Prepared:
    """List reduce_scatter: entry ``i`` of every member's list ``k`` reduced into group rank ``i``'s
    ``outputs[k]``; with gloo's rules every entry must have the output's shape (`refuse_entry_shapes`)."""
    model, label, gloo_rules, n = m.model, m.label, m.gloo_rules, len(m.ranks)
    flat = [t for lst in input_lists for t in lst]
    check_op(model, op, flat)
    for lst in input_lists:
        if len(lst) != n:
            raise ValueError(f"reduce_scatter on {label}: need {n} input tensors, got {len(lst)}")
    if gloo_rules:
        refuse_gloo_dtypes("reduce_scatter", label, flat)
    count = len(outputs)

    def complete(calls: list[Call], targets: Sequence[int]) -> None:
        for k in range(count):
            if gloo_rules:
                refuse_entry_shapes(calls, k, label)
            blocks = reduce_list(model, [c.inputs[k] for c in calls], op)
            for i in targets:
                write_bytes(calls[i].outputs[k], blocks[i])

    inputs = tuple(list(lst) for lst in input_lists)
    extra = tuple(tuple(t.shape) for t in outputs)  # each member's output shapes, for the peers' checks
    call = Call(rank, ("reduce_scatter", label, op.shown, *_meta(flat)), frame, inputs, tuple(outputs), extra)
    return call, complete


# -- data movement -----------------------------------------------------------------


def broadcast(m: Members, rank: int, frame: Any, tensors: Sequence[torch.Tensor], root: int) -> Prepared:
    """Copy group rank ``root``'s tensors into every member's."""
    gloo_rules, label = m.gloo_rules, m.label
    if gloo_rules:
        refuse_gloo_dtypes("broadcast", label, tensors)
    count = len(tensors)

    def complete(calls: list[Call], targets: Sequence[int]) -> None:
        for k in range(count):
            if gloo_rules:
                refuse_layouts("broadcast", label, [c.inputs[k] for c in calls])
            for i in targets:
                if i != root:
                    calls[i].inputs[k].copy_(calls[root].inputs[k])

    call = Call(rank, ("broadcast", label, f"src={m.ranks[root]}", *_meta(tensors)), frame, tuple(tensors))
    return call, complete


def all_gather(
    m: Members, rank: int, frame: Any, output_lists: Sequence[Sequence[torch.Tensor]], inputs: Sequence[torch.Tensor]
) -> Prepared:
    """List all_gather: entry ``j`` of every member's output list ``k`` gets group rank ``j``'s ``inputs[k]``."""
    label, n = m.label, len(m.ranks)
    if m.gloo_rules:
        refuse_gloo_dtypes("all_gather", label, inputs)
    for outs, inp in zip(output_lists, inputs, strict=True):
        if len(outs) != n:
            raise ValueError(f"all_gather on {label}: the output list needs {n} tensors, got {len(outs)}")
        wrong = [i for i, o in enumerate(outs) if o.shape != inp.shape]
        if m.gloo_rules and wrong:
            raise RuntimeError(
                f"all_gather on {label}: output {wrong[0]} has shape {tuple(outs[wrong[0]].shape)}, "
                f"the input {tuple(inp.shape)}; gloo needs them equal"
            )
    count = len(inputs)

    def complete(calls: list[Call], targets: Sequence[int]) -> None:
        for k in range(count):
            for i in targets:
                for j, out in enumerate(calls[i].outputs[k]):
                    out.copy_(calls[j].inputs[k].view(out.shape))

    outputs = tuple(list(o) for o in output_lists)
    return Call(rank, ("all_gather", label, *_meta(inputs)), frame, tuple(inputs), outputs), complete


ALLGATHER_COALESCED = "ProcessGroupGloo::allgather_coalesced"


def all_gather_coalesced(
    m: Members, rank: int, frame: Any, output_lists: Sequence[Sequence[torch.Tensor]], inputs: Sequence[torch.Tensor]
) -> Prepared:
    """``all_gather_coalesced``: ``output_lists[j][k]`` gets group rank ``j``'s ``inputs[k]`` (gloo's layout,
    found by experiment: one list per member, each as long as the inputs; not `all_gather`'s ``[k][j]``).

    Refused at the call with gloo's ``RuntimeError`` (torch 2.13): a number of lists other than the group
    size, a list whose length is not the number of inputs, an output whose shape or dtype is not its input's
    (a reshape of the same numel included)."""
    label, n = m.label, len(m.ranks)
    if m.gloo_rules:
        refuse_gloo_dtypes("all_gather_coalesced", label, inputs)
    if len(output_lists) != n:
        raise RuntimeError(
            f"{ALLGATHER_COALESCED}: output lists should be equal to world size (all_gather_coalesced on {label}: "
            f"{len(output_lists)} output lists, {n} members; output_lists[j][k] receives member j's input k)"
        )
    for j, outs in enumerate(output_lists):
        if len(outs) != len(inputs):
            raise RuntimeError(
                f"{ALLGATHER_COALESCED}: invalid output tensor list at index {j} (expected length "
                f"{len(inputs)}, got {len(outs)})"
            )
        for k, (out, inp) in enumerate(zip(outs, inputs, strict=True)):
            if out.shape != inp.shape or out.dtype != inp.dtype:
                raise RuntimeError(
                    f"{ALLGATHER_COALESCED}: invalid size of output tensor at index {k} (expected "
                    f"{tuple(inp.shape)} {inp.dtype}, got {tuple(out.shape)} {out.dtype})"
                )

    def complete(calls: list[Call], targets: Sequence[int]) -> None:
        for i in targets:
            for j, outs in enumerate(calls[i].outputs):
                for out, inp in zip(outs, calls[j].inputs, strict=True):
                    out.copy_(inp)

    outputs = tuple(list(o) for o in output_lists)
    return Call(rank, ("all_gather_coalesced", label, *_meta(inputs)), frame, tuple(inputs), outputs), complete


def all_reduce_sparse(m: Members, rank: int, frame: Any, tensor: torch.Tensor, op: Op) -> Prepared:
    """A sparse COO ``all_reduce`` as torch's gloo backend computes it (read in ProcessGroupGloo.cpp, checked
    bitwise against real gloo): each member coalesces its tensor; the members' coalesced tensors are summed
    as sparse tensors in group-rank order, ``((s0 + s1) + s2) + ...``, and the sum is coalesced; every member's
    tensor is replaced by the result (coalesced, indices sorted). Only ``SUM`` (gloo's ``RuntimeError``
    otherwise), and only under a model with gloo's rules: no other backend's sparse path is modelled."""
    label = m.label
    if op.name != "SUM":
        raise RuntimeError(
            "ProcessGroupGloo::allreduce: unsupported reduction operation (allreduce of sparse tensors only "
            f"works with ReduceOp.SUM); got {op.shown} on {label}"
        )
    if not m.gloo_rules:
        raise RuntimeError(
            f"sparse all_reduce on {label}: simdist models gloo's sparse all_reduce only; this group's model is "
            f"{m.model.name} (use the gloo model, or a dense tensor)"
        )
    local = tensor.detach().coalesce()
    size = tuple(tensor.shape)

    def complete(calls: list[Call], targets: Sequence[int]) -> None:
        total = None
        for c in calls:
            indices, values = c.inputs
            term = torch.sparse_coo_tensor(indices, values, size, check_invariants=False)  # gloo's: unchecked
            total = term if total is None else total + term
        assert total is not None
        result = total.coalesce()
        for i in targets:
            with torch.no_grad():
                calls[i].outputs[0].copy_(result)

    signature = ("all_reduce_sparse", label, op.shown, tensor.shape, tensor.dtype, tensor.sparse_dim())
    inputs = (local._indices(), local._values())
    return Call(rank, signature, frame, inputs, (tensor,)), complete


def all_gather_tensors(
    m: Members,
    rank: int,
    frame: Any,
    outputs: Sequence[torch.Tensor],
    inputs: Sequence[torch.Tensor],
    name: str = "all_gather_into_tensor",
) -> Prepared:
    """all_gather_into_tensor (and its coalesced form): every member's input, flat, in group-rank order."""
    label, n = m.label, len(m.ranks)
    if m.gloo_rules:
        refuse_gloo_dtypes(name, label, inputs)
    for out, inp in zip(outputs, inputs, strict=True):
        piece = (out.shape[0] // n, *out.shape[1:]) if out.dim() and out.shape[0] % n == 0 else None
        if m.gloo_rules and out.dim() and piece != tuple(inp.shape):
            raise RuntimeError(
                f"{name} on {label}: gloo cuts the output {tuple(out.shape)} into {n} pieces along dim 0, "
                f"each of the input's shape {tuple(inp.shape)}"
            )
        if out.numel() != inp.numel() * n or inp.dtype != out.dtype:
            raise ValueError(
                f"{name} on {label}: input has {inp.numel()} {inp.dtype} elements, output {out.numel()} "
                f"{out.dtype}; need output numel = {n} x input numel, same dtype"
            )
    count = len(inputs)

    def complete(calls: list[Call], targets: Sequence[int]) -> None:
        for k in range(count):
            gathered = torch.cat([c.inputs[k].reshape(-1) for c in calls])
            for i in targets:
                out = calls[i].outputs[k]
                out.copy_(gathered.view(out.shape))

    return Call(rank, (name, label, *_meta(inputs)), frame, tuple(inputs), tuple(outputs)), complete


def gather(
    m: Members,
    rank: int,
    frame: Any,
    output_lists: Sequence[Sequence[torch.Tensor]],
    inputs: Sequence[torch.Tensor],
    root: int,
) -> Prepared:
    """gather: entry ``j`` of group rank ``root``'s output list ``k`` gets group rank ``j``'s ``inputs[k]``."""
    if m.gloo_rules:
        refuse_gloo_dtypes("gather", m.label, inputs, complex_ok=False)
    count = len(inputs)

    def complete(calls: list[Call], targets: Sequence[int]) -> None:
        if root in targets:
            for k in range(count):
                for j, out in enumerate(calls[root].outputs[k]):
                    out.copy_(calls[j].inputs[k])

    outputs = tuple(list(o) for o in output_lists)
    signature = ("gather", m.label, f"dst={m.ranks[root]}", *_meta(inputs))
    return Call(rank, signature, frame, tuple(inputs), outputs), complete


def scatter(
    m: Members,
    rank: int,
    frame: Any,
    outputs: Sequence[torch.Tensor],
    input_lists: Sequence[Sequence[torch.Tensor]],
    root: int,
) -> Prepared:
    """scatter: group rank ``i``'s ``outputs[k]`` gets entry ``i`` of group rank ``root``'s list ``k``."""
    gloo_rules, label = m.gloo_rules, m.label
    if gloo_rules and not all(t.is_contiguous() for t in outputs):
        raise ValueError(
            f"scatter on {label}: the output must be contiguous (gloo writes a strided output's memory "
            "in order, not its elements)"
        )
    if gloo_rules:
        refuse_gloo_dtypes("scatter", label, outputs)
    n = len(m.ranks)
    for lst in input_lists:  # the root's lists (the others pass none)
        if len(lst) != n:
            raise RuntimeError(
                f"ProcessGroupGloo::scatter: Incorrect input list size {len(lst)}. Input list size should be {n}, "
                f"same as size of the process group ({label}; on gloo the root raises this RuntimeError and its "
                "peers hang)"
            )
    count = len(outputs)

    def complete(calls: list[Call], targets: Sequence[int]) -> None:
        for k in range(count):
            sources = calls[root].inputs[k]
            if not gloo_rules:
                for i in targets:
                    calls[i].outputs[k].copy_(sources[i])
                continue
            refuse_scatter_shapes(calls, k, root, label)
            for i in targets:  # gloo sends each entry's memory as it lies (a transposed entry: storage order)
                out = calls[i].outputs[k]
                out.copy_(memory_order(sources[i]).view(out.shape))

    inputs = tuple(list(lst) for lst in input_lists)
    extra = tuple((tuple(t.shape), t.dtype) for t in outputs)
    signature = ("scatter", label, f"src={m.ranks[root]}", *_meta(outputs))
    return Call(rank, signature, frame, inputs, tuple(outputs), extra), complete


def all_to_all(
    m: Members, rank: int, frame: Any, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]
) -> Prepared:
    """List all_to_all: group rank ``i``'s ``outputs[j]`` gets group rank ``j``'s ``inputs[i]``."""
    label = m.label
    if m.gloo_rules:
        refuse_gloo_dtypes("all_to_all", label, inputs)
        shapes = {tuple(t.shape) for t in [*inputs, *outputs]}
        if len(shapes) > 1:
            raise RuntimeError(
                f"all_to_all on {label}: gloo needs every input and output tensor of one shape, got {sorted(shapes)}"
            )

    def complete(calls: list[Call], targets: Sequence[int]) -> None:
        for i in targets:
            for j, out in enumerate(calls[i].outputs):
                out.copy_(calls[j].inputs[i])

    dtype = inputs[0].dtype if inputs else None
    return Call(rank, ("all_to_all", label, dtype), frame, tuple(inputs), tuple(outputs)), complete


def all_to_all_single(
    m: Members,
    rank: int,
    frame: Any,
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes: Sequence[int] | None,
    input_split_sizes: Sequence[int] | None,
) -> Prepared:
    """Exchange dim-0 slices: this rank's ``input`` slice ``j`` goes to group rank ``j``.

    Without split sizes dim 0 is cut evenly (with gloo's rules: the bytes, `all_to_all_bytes`). Split sizes
    may be uneven; each member's input split for ``j`` must equal ``j``'s output split for it (checked when
    every member has arrived: `exchange_rows`).
    """
    label, n = m.label, len(m.ranks)
    if m.gloo_rules:
        refuse_gloo_dtypes("all_to_all_single", label, [input])
        if not (input.is_contiguous() and output.is_contiguous()):
            which = "input" if not input.is_contiguous() else "output"
            raise ValueError(
                f"all_to_all_single on {label}: the {which} must be contiguous (gloo refuses a strided input "
                "and moves a strided output's memory, not its elements)"
            )
        if not input_split_sizes and not output_split_sizes:
            return all_to_all_bytes(m, rank, frame, output, input)
    in_splits = _splits(input, input_split_sizes, n, "input")
    out_splits = _splits(output, output_split_sizes, n, "output")
    trailing = tuple(input.shape[1:])
    if tuple(output.shape[1:]) != trailing or output.dtype != input.dtype:
        raise ValueError(
            f"all_to_all_single on {label}: output {tuple(output.shape)} {output.dtype} and input "
            f"{tuple(input.shape)} {input.dtype} must share dtype and trailing dims"
        )

    def complete(calls: list[Call], targets: Sequence[int]) -> None:
        exchange_rows(calls, targets, label)

    signature = ("all_to_all_single", label, input.dtype, f"trailing dims={trailing}")
    return Call(rank, signature, frame, (input,), (output,), (in_splits, out_splits)), complete


def all_to_all_bytes(m: Members, rank: int, frame: Any, output: torch.Tensor, input: torch.Tensor) -> Prepared:
    """gloo's ``all_to_all_single`` without split sizes (found by experiment, torch 2.13): the input's BYTES are
    cut into group-size equal pieces, whatever its rows, and piece ``i`` of member ``j`` lands in piece ``j`` of
    member ``i``'s output. A dim 0 the group size does not divide therefore splits rows (at P = 2 a (3, 2) fp32
    input sends one and a half rows to each peer) -- gloo does that silently, and so does simdist, byte for
    byte. ``RuntimeError`` at the call, as gloo's enforces raise it, when the bytes do not divide or the output's
    bytes differ from the input's."""
    label, n = m.label, len(m.ranks)
    nbytes = input.numel() * input.element_size()
    if nbytes % n:
        raise RuntimeError(
            f"all_to_all_single on {label}: gloo cuts the input's {nbytes} bytes into {n} equal pieces "
            "(enforce in->size % context->size == 0 fails)"
        )
    if output.numel() * output.element_size() != nbytes or output.dtype != input.dtype:
        raise RuntimeError(
            f"all_to_all_single on {label}: output {tuple(output.shape)} {output.dtype} and input "
            f"{tuple(input.shape)} {input.dtype} must have the same bytes (enforce in->size == out->size fails)"
        )
    piece = nbytes // n

    def complete(calls: list[Call], targets: Sequence[int]) -> None:
        sizes = {c.extra for c in calls}
        if len(sizes) > 1:
            raise CollectiveMismatchError(
                f"all_to_all_single on {label}: the members' inputs differ in bytes ({sorted(sizes)}); gloo needs "
                "them equal:\n  " + "\n  ".join(c.describe() for c in calls)
            )
        sources = [c.inputs[0].reshape(-1).view(torch.uint8) for c in calls]
        for i in targets:
            out = calls[i].outputs[0].view(-1).view(torch.uint8)
            for j, src in enumerate(sources):
                out[j * piece : (j + 1) * piece].copy_(src[i * piece : (i + 1) * piece])

    signature = ("all_to_all_single", label, input.dtype, "even byte pieces")
    return Call(rank, signature, frame, (input,), (output,), nbytes), complete


def _nothing(calls: list[Call], targets: Sequence[int]) -> None:
    """A barrier's completion: every member has arrived, nothing to compute."""


def barrier(m: Members, rank: int, frame: Any) -> Prepared:
    """Wait until every member has arrived."""
    return Call(rank, ("barrier", m.label), frame), _nothing
