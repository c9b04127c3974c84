"""The collectives that move data, each written once for both front ends: its checks at the call and its completion.

broadcast, the all_gathers (lists, coalesced, into one tensor), gather,
scatter, the all_to_alls (lists, single with split sizes, bytes) and barrier.
Each function takes the group (`simdist.world.rendezvous.calls.Members`), the calling
rank's global rank and frame and the tensors, runs the checks a real backend
makes at the call, and returns the rank's `Call` and a ``complete(calls,
targets)`` that writes the members' outputs (exact copies: no arithmetic).
Where the reduction has ``gloo_rules`` the checks and the memory gloo reads are
`simdist.world.collectives.gloo_rules`'.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from simdist.world.collectives.gloo_rules import memory_order, refuse_gloo_dtypes, refuse_layouts, refuse_scatter_shapes
from simdist.world.errors import CollectiveMismatchError
from simdist.world.rendezvous.calls import Call, Members, Prepared, meta


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

    call = Call(rank, ("broadcast", label, f"src={m.ranks[root]}", *meta(tensors)), frame, tuple(tensors))
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
    return Call(rank, ("all_gather", label, *meta(inputs)), frame, tuple(inputs), outputs), complete


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
    return Call(rank, ("all_gather_coalesced", label, *meta(inputs)), frame, tuple(inputs), outputs), complete


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

    return Call(rank, (name, label, *meta(inputs)), frame, tuple(inputs), tuple(outputs)), complete


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
    signature = ("gather", m.label, f"dst={m.ranks[root]}", *meta(inputs))
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
    signature = ("scatter", label, f"src={m.ranks[root]}", *meta(outputs))
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
