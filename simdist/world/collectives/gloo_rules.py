"""torch's gloo backend's rules, found by experiment against real gloo (torch 2.13).

On groups whose reduction has ``gloo_rules``: what gloo refuses at the call
(`GLOO_DTYPES`, layouts, the list reduce_scatter's and scatter's shapes) and
how it sends a scatter entry, its ``numel`` elements from its data pointer
(`memory_order`; the reduction's own `simdist.reduce.gloo.reduction.memory_rows` is
the rule `refuse_layouts` applies). On every group: a bool result keeps its
bytes, as gloo writes it (`write_bytes`, the reductions' one write).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from simdist.reduce.gloo import memory_rows
from simdist.world.rendezvous.calls import Call

GLOO_DTYPES = frozenset(
    {torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int32, torch.int64}
    | {torch.bool}
)
"""The dtypes torch's gloo backend has collective kernels for (found by experiment, torch 2.13); others raise
``RuntimeError("Invalid scalar type")`` at the call. Complex tensors reach it as ``view_as_real`` where torch's
Python layer converts them (all_reduce, broadcast, all_gather, scatter, all_to_all); ``reduce`` and the
reduce_scatters take complex SUM/AVG themselves (the reduction works on the real view); ``gather`` refuses complex."""


def refuse_gloo_dtypes(name: str, label: str, tensors: Sequence[torch.Tensor], complex_ok: bool = True) -> None:
    """Raise gloo's ``RuntimeError("Invalid scalar type")`` for a dtype it has no kernel for (send/recv excepted)."""
    for t in tensors:
        if t.dtype not in GLOO_DTYPES and not (complex_ok and t.is_complex()):
            raise RuntimeError(
                f"Invalid scalar type: {name} on {label}: torch's gloo backend has no kernel for {t.dtype} "
                "(it raises this RuntimeError at the call; send/recv move any dtype)"
            )


def refuse_layouts(name: str, label: str, tensors: Sequence[torch.Tensor]) -> None:
    """Raise for views whose memory gloo would move differently from their elements (it does not refuse them).

    The rule is the reduction's (`simdist.reduce.gloo.reduction.memory_rows`): gloo
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
