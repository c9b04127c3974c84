"""gloo's all-reduce order, found by experiment against torch 2.13's gloo backend.

`reduction` holds the reduction `Gloo` and its evidence (the module docstring states the order step by step and how
it was found); `schedule` its chunks, segments and the walk's `FoldPlan` (integers only); `arith` one hop's
element-wise functions, NaN bits included; `layout` which elements gloo reads, in memory order, and the views it
refuses. The cross-check against real gloo lives in `simdist.testing._internal.gloo_probe`.
"""

from simdist.reduce.gloo.reduction import *  # noqa: F403  (the face is exactly reduction's public names)
from simdist.reduce.gloo.reduction import __all__ as __all__
