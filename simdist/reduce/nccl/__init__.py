"""NCCL's all-reduce order, rebuilt from NCCL's source (not yet confirmed on hardware: see `reduction`).

`reduction` holds the reduction `Nccl` and the source it follows; `schedule` its channels, chunks, rings and trees
(integers only); `arith` one step's combine, AVG's premultiply and its fused form; `layout` which elements NCCL
reads, in memory order. Its step-by-step reference is `simdist.testing._internal.nccl_sim`.
"""

from simdist.reduce.nccl.reduction import Nccl

__all__ = ["Nccl"]
