"""gloo's ring schedule, integers only: how the all-reduce and ``reduce`` cut a buffer into chunks and segments,
where each chunk's walk starts, and the walk as a `FoldPlan` (`ring_plan`).

The formulas and their evidence are in `simdist.reduce.gloo.reduction` (the reduction `Gloo`, which reads its order from
here).
"""

from __future__ import annotations

import functools

from simdist.reduce.plan import PLAN_CACHE_SIZE, FoldPlan

GLOO_MAX_SEGMENT_BYTES = 1 << 20
"""gloo's ``AllreduceOptions::kMaxSegmentSize``."""


def chunk_length(numel: int, n: int, element_size: int, max_segment_bytes: int = GLOO_MAX_SEGMENT_BYTES) -> int:
    """Elements per ring chunk of gloo's all-reduce (``L`` in the module docstring)."""
    m = max(1, max_segment_bytes // element_size)
    segments = max(-(-numel // m), 2 * n)
    segments = -(-segments // n) * n
    return (segments // n) * -(-numel // segments)


def reduce_chunk_length(numel: int, n: int, element_size: int, max_segment_bytes: int = GLOO_MAX_SEGMENT_BYTES) -> int:
    """Elements per ring chunk of gloo's ``reduce`` (``gloo/reduce.cc``), which sizes segments its own way.

    ``reduce`` takes the segment as ``ceil(T / 2n)`` bytes (``T`` = the whole
    buffer), capped at ``max_segment_bytes`` and rounded up to whole elements,
    and only then counts segments; all-reduce first counts segments and then
    spreads the elements evenly over them. Both agree up to ``2n`` full
    segments (``2 * n * 1 MiB``); above it a reduce chunk is whole 1 MiB
    segments and the last chunks are short or empty (n=3, 1,572,865 fp32:
    chunks of 786,432, 786,432 and 1 element, where all-reduce cuts 524,289).
    """
    segment = reduce_segment_length(numel, n, element_size, max_segment_bytes)
    if segment == 0:
        return 0
    segments = max(-(-numel // segment), 2 * n)
    segments = -(-segments // n) * n
    return (segments // n) * segment


def reduce_segment_length(
    numel: int, n: int, element_size: int, max_segment_bytes: int = GLOO_MAX_SEGMENT_BYTES
) -> int:
    """Elements per segment of gloo's ``reduce``: ``ceil(T / 2n)`` bytes, at most ``max_segment_bytes``,
    rounded up to whole elements (``T`` = the buffer's bytes)."""
    cap = element_size * (max_segment_bytes // element_size)
    return -(-min(-(-numel * element_size // (2 * n)), cap) // element_size)


def chunk_start_ranks(
    numel: int, n: int, element_size: int, max_segment_bytes: int = GLOO_MAX_SEGMENT_BYTES
) -> list[int]:
    """For each non-empty chunk ``c``, the rank whose value the fold starts with (``c - 1 mod n``)."""
    length = chunk_length(numel, n, element_size, max_segment_bytes)
    return [(c - 1) % n for c in range(-(-numel // length))] if numel else []


@functools.lru_cache(maxsize=PLAN_CACHE_SIZE)
def ring_plan(n: int, numel: int, element_size: int, max_segment_bytes: int, for_reduce: bool = False) -> FoldPlan:
    """gloo's walk as a `FoldPlan`: chunk ``c`` (of `chunk_length` elements; `reduce_chunk_length` with
    ``for_reduce``) adds rank ``(c - 1 - j) mod n`` at hop ``j``, i.e. rows ``t mod n`` read from
    ``h = n - 1`` down to ``0`` at window offset ``c``. One chunk: ``x[n-1] + ... + x[0]`` at every element."""
    chunking = reduce_chunk_length if for_reduce else chunk_length
    length = max(1, chunking(numel, n, element_size, max_segment_bytes))
    chunks = max(1, -(-numel // length))
    return FoldPlan(n, numel, length, chunks, tuple(t % n for t in range(n + chunks - 1)), descending=True)
