"""Which elements NCCL reads, in which order: torch's NCCL backend hands NCCL the storage of a tensor that is
contiguous in its suggested memory format (row-major, or channels-last for 4-d/5-d tensors), so chunks and
channels are cut in memory order; anything else it refuses (``Tensors must be contiguous``), and so does
`storage_flat`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from simdist.errors import UsageError
from simdist.reduce.base import Tensors, as_stacked

_CHANNELS_LAST = {4: (torch.channels_last, (0, 2, 3, 1)), 5: (torch.channels_last_3d, (0, 2, 3, 4, 1))}


def _memory_order(t: torch.Tensor) -> tuple[int, ...] | None:
    """The dims of ``t`` in memory order when torch's NCCL backend accepts it; None for row-major."""
    if t.is_contiguous():
        return None
    fmt, perm = _CHANNELS_LAST.get(t.dim(), (None, None))
    if fmt is not None and t.is_contiguous(memory_format=fmt):
        return perm
    raise UsageError(
        f"Tensors must be contiguous: torch's NCCL backend refuses a tensor of shape {tuple(t.shape)} and "
        f"strides {t.stride()} (only row-major and channels-last tensors reach NCCL)"
    )


def storage_flat(tensors: Tensors) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    """``[n, N]``: each rank's elements in memory order (what NCCL reads), and the map of a flat result back.

    torch's NCCL backend hands NCCL the storage of a tensor that is contiguous in
    its suggested memory format (row-major, or channels-last for 4-d/5-d
    tensors), so chunks and channels are cut in memory order; it refuses
    anything else with ``ValueError("Tensors must be contiguous")``, and so does this.
    """
    per_rank = list(tensors.unbind(0)) if isinstance(tensors, torch.Tensor) else list(tensors)
    if not per_rank:
        raise UsageError("a reduction needs the tensors of at least one rank")
    orders = {_memory_order(t) for t in per_rank}
    if len(orders) > 1:
        raise UsageError("Tensors must be contiguous: the ranks' tensors have different memory formats")
    perm = orders.pop()
    n = len(per_rank)
    if perm is None:
        stacked = as_stacked(tensors)
        shape = stacked.shape[1:]
        return stacked.reshape(n, -1), lambda out: out.reshape(shape)
    stacked = torch.stack([t.permute(perm) for t in per_rank])
    shape = stacked.shape[1:]
    inverse = tuple(sorted(range(len(perm)), key=perm.__getitem__))
    return stacked.reshape(n, -1), lambda out: out.reshape(shape).permute(inverse)
