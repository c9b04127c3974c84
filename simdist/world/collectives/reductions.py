"""The reductions, each written once for both front ends: its checks at the call and its completion.

all_reduce (one tensor on the hot path, `all_reduce_one`; several; coalesced;
sparse), reduce, and the reduce_scatters (of tensors, of lists). Each function
takes the group (`simdist.world.rendezvous.calls.Members`), the calling rank's global rank
and frame, the tensors and the op, runs the checks a real backend makes at the
call (raising on the calling rank), and returns the rank's `Call` and a
``complete(calls, targets)`` (`simdist.world.rendezvous.calls.Complete`). The sums are
`simdist.world.collectives.reduce_ops`'; where the reduction has ``gloo_rules`` the checks are
`simdist.world.collectives.gloo_rules`'.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from simdist.world.collectives.gloo_rules import refuse_entry_shapes, refuse_gloo_dtypes, write_bytes
from simdist.world.collectives.reduce_ops import Op, check_op, reduce_all, reduce_blocks, reduce_list, reduce_root
from simdist.world.rendezvous.calls import Call, Members, Prepared, meta


def all_reduce(m: Members, rank: int, frame: Any, tensors: Sequence[torch.Tensor], op: Op) -> Prepared:
    """Reduce each of ``tensors`` across the group in place (the hot path of every training step)."""
    reduction, label = m.reduction, m.label
    if op.reduce_op is None:
        check_op(reduction, op, tensors)
    if m.gloo_rules:
        refuse_gloo_dtypes("all_reduce", label, tensors)
    count = len(tensors)

    into = getattr(reduction, "reduce_into", None) if op.reduce_op is not None else None

    def complete(calls: list[Call], targets: Sequence[int]) -> None:
        for k in range(count):
            members = [c.inputs[k] for c in calls]
            if into is not None and into(members, op.reduce_op, [members[i] for i in targets]):
                continue  # one pass: each member read once, each target written once (the reduction's bits)
            # written as gloo writes from C++: through `.data` aliases (no autograd record, no version bump), as
            # `all_reduce_one` may pass a tensor itself (the kernel above writes through its data pointer)
            members = [t.data for t in members]
            try:
                result = reduce_all(reduction, members, op)
            except RuntimeError as exc:  # gloo's integer AVG: the SUM is written, then div_ raises
                written = getattr(exc, "written", None)
                if written is not None:
                    for i in targets:
                        write_bytes(members[i], written)
                raise
            for i in targets:
                write_bytes(members[i], result)

    call = Call(rank, ("all_reduce", label, op.shown, *meta(tensors)), frame, tuple(tensors))
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
    reduction, label = m.reduction, m.label
    check_op(reduction, op, tensors)
    if m.gloo_rules:
        refuse_gloo_dtypes("all_reduce_coalesced", label, tensors)
    if len({t.dtype for t in tensors}) > 1:
        raise RuntimeError(f"all_reduce_coalesced on {label}: the tensors must share one dtype")
    sizes = [t.numel() for t in tensors]

    def complete(calls: list[Call], targets: Sequence[int]) -> None:
        flat = [torch.cat([t.reshape(-1) for t in c.inputs]) for c in calls]
        pieces = reduce_all(reduction, flat, op).split(sizes)
        for i in targets:
            for t, piece in zip(calls[i].inputs, pieces, strict=True):
                t.copy_(piece.view(t.shape))

    call = Call(rank, ("all_reduce_coalesced", label, op.shown, *meta(tensors)), frame, tuple(tensors))
    return call, complete


def reduce(m: Members, rank: int, frame: Any, tensors: Sequence[torch.Tensor], op: Op, root: int) -> Prepared:
    """Reduce each of ``tensors`` to group rank ``root`` in place.

    Where the reduction says what every member's tensor holds afterwards
    (``reduce_buffers``, gloo's non-root partial sums) every target gets it;
    otherwise only the root's tensor is written.
    """
    reduction, label = m.reduction, m.label
    check_op(reduction, op, tensors)
    if m.gloo_rules:
        refuse_gloo_dtypes("reduce", label, tensors)
    buffers = getattr(reduction, "reduce_buffers", None) if op.reduce_op is not None else None
    count = len(tensors)

    def complete(calls: list[Call], targets: Sequence[int]) -> None:
        for k in range(count):
            members = [c.inputs[k] for c in calls]
            if buffers is not None:  # the reduction says what every member's tensor holds afterwards
                results = buffers(members, op.reduce_op, root)
                for i in targets:
                    write_bytes(calls[i].inputs[k], results[i])
                continue
            # computed for non-root targets too (process mode), so a reduction's refusal reaches every rank
            result = reduce_root(reduction, members, op, root)
            if root in targets:
                write_bytes(calls[root].inputs[k], result)

    signature = ("reduce", label, op.shown, f"dst={m.ranks[root]}", *meta(tensors))
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
    reduction, label, n = m.reduction, m.label, len(m.ranks)
    check_op(reduction, op, inputs)
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
            blocks = reduce_blocks(reduction, [c.inputs[k] for c in calls], op)  # as laid out: gloo reads memory
            for i in targets:
                out = calls[i].outputs[k]
                out.copy_(blocks[i].view(out.shape))

    call = Call(rank, (name, label, op.shown, *meta(inputs)), frame, tuple(inputs), tuple(outputs))
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
    reduction, label, gloo_rules, n = m.reduction, m.label, m.gloo_rules, len(m.ranks)
    flat = [t for lst in input_lists for t in lst]
    check_op(reduction, op, flat)
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
            blocks = reduce_list(reduction, [c.inputs[k] for c in calls], op)
            for i in targets:
                write_bytes(calls[i].outputs[k], blocks[i])

    inputs = tuple(list(lst) for lst in input_lists)
    extra = tuple(tuple(t.shape) for t in outputs)  # each member's output shapes, for the peers' checks
    call = Call(rank, ("reduce_scatter", label, op.shown, *meta(flat)), frame, inputs, tuple(outputs), extra)
    return call, complete


def all_reduce_sparse(m: Members, rank: int, frame: Any, tensor: torch.Tensor, op: Op) -> Prepared:
    """A sparse COO ``all_reduce`` as torch's gloo backend computes it (read in ProcessGroupGloo.cpp, checked
    bitwise against real gloo): each member coalesces its tensor; the members' coalesced tensors are summed
    as sparse tensors in group-rank order, ``((s0 + s1) + s2) + ...``, and the sum is coalesced; every member's
    tensor is replaced by the result (coalesced, indices sorted). Only ``SUM`` (gloo's ``RuntimeError``
    otherwise), and only under a reduction with gloo's rules: no other backend's sparse path is modelled."""
    label = m.label
    if op.name != "SUM":
        raise RuntimeError(
            "ProcessGroupGloo::allreduce: unsupported reduction operation (allreduce of sparse tensors only "
            f"works with ReduceOp.SUM); got {op.shown} on {label}"
        )
    if not m.gloo_rules:
        raise RuntimeError(
            f"sparse all_reduce on {label}: simdist models gloo's sparse all_reduce only; this group's reduction is "
            f"{m.reduction.name} (use the gloo reduction, or a dense tensor)"
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
