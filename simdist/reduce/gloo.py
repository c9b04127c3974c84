"""`Gloo`: the summation order of torch.distributed's gloo backend on CPU, bit for bit.

What gloo does (torch 2.13, ``ProcessGroupGloo`` -> ``gloo::allreduce``, ring
algorithm, ``gloo/allreduce.cc``), for ``n`` ranks, ``N`` elements of ``e``
bytes each:

1. The flat buffer is cut into ``S`` segments, a multiple of ``n`` and at
   least ``2n``, each at most ``max_segment_bytes`` (1 MiB, gloo's
   ``kMaxSegmentSize``; torch does not change it)::

       m   = max(1, max_segment_bytes // e)          # elements per segment, at most
       S   = roundup(max(ceil(N / m), 2 * n), n)
       seg = ceil(N / S)                             # elements per segment
       L   = (S // n) * seg                          # elements per chunk

   Chunk ``c`` (``c = 0 .. n-1``) is elements ``[c*L, (c+1)*L)`` clipped to
   ``N``; the last chunks may be short or empty. For ``N <= 2n*m`` this is
   ``L = 2 * ceil(N / (2n))``.
2. Ring reduce-scatter: rank ``r`` sends to ``r-1`` and receives from
   ``r+1``. Chunk ``c`` starts at rank ``c-1`` and walks down the ring, each
   hop adding the local value and rounding to the dtype, so element ``k`` in
   chunk ``c`` is the left fold::

       ((x[c-1] + x[c-2]) + x[c-3]) + ... + x[c]          (rank indices mod n)

   and ends on rank ``c``, which owns it; a ring all-gather then copies it out
   unchanged. Each add is ``gloo::sum<T>``: one IEEE fp32 add, or for bf16 a
   float add rounded to nearest-even, which is what torch's bf16 add does.
3. ``reduce_scatter_tensor`` on gloo clones the input, runs this same
   all-reduce on the whole ``N = n * block`` buffer and keeps block ``i`` on
   rank ``i``, so the inherited `ReductionModel.reduce_scatter` (the matching
   slices of `reduce` on the flat tensor) is already exact.

Consequences: with 2 ranks every order is the same single add. Chunks are cut
by length, not by ``n``-way splitting of the tensor, so for ``N <= 2`` every
element is in chunk 0 and the order is the descending fold
``x[n-1] + ... + x[0]``; e.g. ``n=4, N=1024``: ``L=256``, chunks 0..3 start at
ranks 3, 0, 1, 2. ``AVG`` (which gloo lacks) is the SUM divided by ``n``
(``postdiv``), which is what `simdist.world.torch_comm.TorchComm` does on gloo.

Evidence (torch 2.13.0+cpu, real gloo processes on 127.0.0.1, spawned with
`simdist.world.launch.spawn_gloo`):

* fingerprints for n = 3..8: at every element one rank holds 1.0 and two others
  hold the half-ulp (bf16 ``2**-8``, fp32 ``2**-24``), the rest 0, cycling over
  every (big, small, small) triple; the result is ``1 + ulp`` exactly when both
  small values meet before the 1.0. All elements matched this model for 20
  lengths from 1 to ``m * (2n+1) + 7`` (past the segment cap, so ``S > 2n``),
  in fp32 and bf16; rank-order folds differed at about 45 % of them.
* random data for n = 2..8: normal values and ``normal * 2**k``, ``k`` uniform
  in ``[-60, 60]``, 20 lengths each (1 .. 100000 and random up to 200000),
  fp32 and bf16: all-reduce and reduce_scatter_tensor equal to this model bit
  for bit (``tests/test_gloo_model.py`` repeats this for 2, 3 and 4 ranks).
  fp16 (``k`` in ``[-8, 8]``) and fp64 matched too, for n = 3, 4, 5, 8.
* inputs for such checks must be built without ``exp2``/``pow``: their
  vectorised and scalar paths differ in the last bit, so a tensor computed with
  another thread count is not the same tensor (an early "mismatch" was that).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from simdist.reduce.base import AvgMode, ReductionModel, Tensors, as_stacked, fold

GLOO_MAX_SEGMENT_BYTES = 1 << 20
"""gloo's ``AllreduceOptions::kMaxSegmentSize``."""


def chunk_length(numel: int, n: int, element_size: int, max_segment_bytes: int = GLOO_MAX_SEGMENT_BYTES) -> int:
    """Elements per ring chunk of gloo's all-reduce (``L`` in the module docstring)."""
    m = max(1, max_segment_bytes // element_size)
    segments = max(-(-numel // m), 2 * n)
    segments = -(-segments // n) * n
    return (segments // n) * -(-numel // segments)


def chunk_start_ranks(
    numel: int, n: int, element_size: int, max_segment_bytes: int = GLOO_MAX_SEGMENT_BYTES
) -> list[int]:
    """For each non-empty chunk ``c``, the rank whose value the fold starts with (``c - 1 mod n``)."""
    length = chunk_length(numel, n, element_size, max_segment_bytes)
    return [(c - 1) % n for c in range(-(-numel // length))] if numel else []


_PLAN_CACHE: dict[tuple, tuple[int, int, torch.Tensor | None]] = {}
_PAD_CACHE: dict[tuple, torch.Tensor] = {}


def _plan(n: int, numel: int, element_size: int, max_segment_bytes: int, device: torch.device):
    """``(chunk length, chunk count, row index)``; the row index puts ``x.view(n * chunks, L)`` in fold order.

    Row ``j * chunks + c`` of the ordered tensor is hop ``j`` of chunk ``c``:
    rank ``(c - 1 - j) mod n``. ``None`` when there is a single chunk.
    """
    key = (n, numel, element_size, max_segment_bytes, device)
    plan = _PLAN_CACHE.get(key)
    if plan is None:
        length = chunk_length(numel, n, element_size, max_segment_bytes)
        chunks = -(-numel // length)
        index = None
        if chunks > 1:
            hop = torch.arange(n).unsqueeze(1)
            chunk = torch.arange(chunks).unsqueeze(0)
            index = (((chunk - 1 - hop) % n) * chunks + chunk).reshape(-1).to(device)
        if len(_PLAN_CACHE) > 1024:
            _PLAN_CACHE.clear()
        plan = _PLAN_CACHE[key] = (length, chunks, index)
    return plan


def _zeros(n: int, width: int, like: torch.Tensor) -> torch.Tensor:
    key = (n, width, like.dtype, like.device)
    pad = _PAD_CACHE.get(key)
    if pad is None:
        if len(_PAD_CACHE) > 256:
            _PAD_CACHE.clear()
        pad = _PAD_CACHE[key] = torch.zeros(n, width, dtype=like.dtype, device=like.device)
    return pad


@dataclass(frozen=True, repr=False)
class Gloo(ReductionModel):
    """gloo's ring all-reduce order: per chunk, a fold that starts at rank ``c-1`` and walks down.

    See the module docstring for the chunk formula and the evidence.
    ``max_segment_bytes`` is gloo's segment cap (only change it to model a
    gloo built or configured differently).
    """

    max_segment_bytes: int = GLOO_MAX_SEGMENT_BYTES
    avg: AvgMode = "postdiv"

    def __post_init__(self) -> None:
        if self.max_segment_bytes < 1:
            raise ValueError(f"max_segment_bytes must be >= 1, got {self.max_segment_bytes}")

    @property
    def name(self) -> str:
        if self.max_segment_bytes == GLOO_MAX_SEGMENT_BYTES:
            return "gloo"
        return f"gloo(max_segment_bytes={self.max_segment_bytes})"

    def sum(self, tensors: Tensors) -> torch.Tensor:
        n = len(tensors)
        if n <= 2:  # one add at most: commutative, so every order agrees
            return fold(tensors)
        stacked = as_stacked(tensors)
        numel = stacked.numel() // n
        if numel == 0:
            return stacked[0].clone()
        length, chunks, index = _plan(n, numel, stacked.element_size(), self.max_segment_bytes, stacked.device)
        if index is None:  # a single chunk: x[n-1] + x[n-2] + ... + x[0]
            return fold(stacked.unbind(0)[::-1])
        padded = chunks * length
        if padded == numel:
            rows = stacked.contiguous().view(n * chunks, length)
        else:
            flat = torch.cat([stacked.reshape(n, numel), _zeros(n, padded - numel, stacked)], dim=1)
            rows = flat.view(n * chunks, length)
        out = fold(rows.index_select(0, index).view(n, padded).unbind(0))
        return (out if padded == numel else out[:numel]).view(stacked.shape[1:])
