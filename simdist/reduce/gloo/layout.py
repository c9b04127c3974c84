"""How gloo reads the ranks' tensors: a tensor's ``numel`` elements from its data pointer, in memory order
(`memory_rows`, which refuses the views real gloo would silently mis-reduce), and the dtype view its kernels use
(`ring_view`: complex as real pairs, bool as bytes).

Found against real gloo (torch 2.13); the evidence is in `simdist.reduce.gloo.reduction`. The simdist backend applies
the
same memory-order rule to every reduction (`simdist.world.collectives`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from simdist.errors import UsageError
from simdist.reduce.base import ReduceOp, Tensors

Rows = torch.Tensor | list[torch.Tensor]
"""The ranks' flat elements in gloo's reading order: an ``[n, N]`` tensor, or ``n`` 1-d tensors (no copy)."""


def memory_rows(tensors: Tensors) -> tuple[Rows, Callable[[torch.Tensor], torch.Tensor]]:
    """Each rank's elements in the order gloo reads them, and the map of a flat result back.

    torch's gloo backend hands gloo ``numel`` elements from the tensor's data
    pointer, whatever its strides. For a dense tensor (contiguous, or a
    permutation of a contiguous one, e.g. ``x.t()``) that is its storage in
    memory order, so chunks are cut in memory order; that is modelled, and the
    result comes back with the tensor's strides. A stacked ``[n, *shape]``
    tensor is the reduction's own packing: its rows are read in row-major order.

    Refused with ``ValueError`` (real gloo does not refuse them, it computes
    something else): a view with gaps or overlaps (``x[:, ::2]``), for which
    gloo reduces memory outside the view and leaves part of the view alone;
    and ranks whose dense tensors have different memory layouts, which gloo
    would add element by element in memory, not by index.
    """
    if isinstance(tensors, torch.Tensor):
        shape = tensors.shape[1:]
        return tensors.reshape(tensors.shape[0], -1), lambda out: out.view(shape)
    per_rank = list(tensors)
    if all(t.is_contiguous() for t in per_rank):
        shape = per_rank[0].shape
        if len(shape) == 1:
            return per_rank, same
        return [t.view(-1) for t in per_rank], lambda out: out.view(shape)
    for t in per_rank:
        if not dense(t):
            raise ValueError(
                f"gloo reduces a tensor's numel ({t.numel()}) elements from its data pointer in memory order; "
                f"this view (shape {tuple(t.shape)}, strides {t.stride()}) has gaps or overlaps, so real gloo "
                "would reduce memory outside the view and leave part of the view unreduced. Pass a contiguous "
                "tensor (x.contiguous()) and copy the result back."
            )
    layouts = {tuple(st for st, size in zip(t.stride(), t.shape, strict=True) if size > 1) for t in per_rank}
    if len(layouts) > 1:
        raise UsageError(
            "gloo adds the ranks' tensors element by element in memory order, and these ranks' tensors have "
            f"different memory layouts (strides {[t.stride() for t in per_rank]}), so gloo would add "
            "different elements together. Give every rank the same layout."
        )
    like = per_rank[0]

    def back(out: torch.Tensor) -> torch.Tensor:
        result = torch.empty_strided(like.shape, like.stride(), dtype=out.dtype, device=out.device)
        result.as_strided((like.numel(),), (1,), 0).copy_(out)
        return result

    return [t.as_strided((t.numel(),), (1,)) for t in per_rank], back


def dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill ``numel`` consecutive memory slots (a permutation of a contiguous tensor)."""
    dims = sorted((stride, size) for stride, size in zip(t.stride(), t.shape, strict=True) if size > 1)
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


def ring_view(tensors: Tensors, op: ReduceOp, what: str) -> tuple[Tensors, Callable[[torch.Tensor], torch.Tensor]]:
    """The ranks' tensors as gloo's kernels see them, and the map of a result back to the callers' dtype.

    Found against real gloo (torch 2.13):

    * complex: torch's gloo backend reduces ``view_as_real`` (so chunks are cut
      on the real view, ``2 * numel`` reals) for ``SUM`` and ``AVG``; other ops
      raise ``RuntimeError`` ("reduce/all_reduce does not support ... on complex
      tensors"), raised here with that type;
    * bool: gloo adds, multiplies and compares the bytes (``uint8``), so a SUM
      of three ``True`` leaves byte 3 in the bool tensor (``torch.equal`` hides it).
    """
    first = tensors[0]
    if first.is_complex():
        if op not in (ReduceOp.SUM, ReduceOp.AVG):
            raise RuntimeError(
                f"{what} does not support {op.name} on complex tensors (torch's gloo backend raises RuntimeError)"
            )
        if isinstance(tensors, torch.Tensor):
            return torch.view_as_real(tensors), torch.view_as_complex
        return [torch.view_as_real(t) for t in tensors], torch.view_as_complex
    if first.dtype == torch.bool:
        if isinstance(tensors, torch.Tensor):
            return tensors.view(torch.uint8), as_bool
        return [t.view(torch.uint8) for t in tensors], as_bool
    return tensors, same


def as_bool(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.bool)


def same(t: torch.Tensor) -> torch.Tensor:
    return t
