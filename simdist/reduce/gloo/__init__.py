"""gloo's all-reduce order, found by experiment against torch 2.13's gloo backend.

`reduction` holds the reduction `Gloo` and its evidence (the module docstring states the order step by step and how
it was found); `schedule` its chunks, segments and the walk's `FoldPlan` (integers only); `arith` one hop's
element-wise functions, NaN bits included; `layout` which elements gloo reads, in memory order, and the views it
refuses. The cross-check against real gloo lives in `simdist.testing._internal.gloo_probe`.
"""

from simdist.reduce.gloo.reduction import (
    GLOO_MAX_SEGMENT_BYTES,
    Gloo,
    Rows,
    chunk_length,
    chunk_start_ranks,
    memory_rows,
    reduce_chunk_length,
    reduce_segment_length,
    ring_plan,
)

__all__ = [
    "GLOO_MAX_SEGMENT_BYTES",
    "Gloo",
    "Rows",
    "chunk_length",
    "chunk_start_ranks",
    "memory_rows",
    "reduce_chunk_length",
    "reduce_segment_length",
    "ring_plan",
]
