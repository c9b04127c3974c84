"""Which of torch's CPU kernels run here, as far as the bits they produce are concerned.

torch picks its CPU kernels by the CPU (or by ``ATEN_CPU_CAPABILITY``). Measured on torch 2.13.0 (x86-64):

* ``AVX2`` and ``AVX512`` give the same bits for every elementwise op simdist and the frameworks use: both
  fuse multiply-adds (``lerp``, ``addcmul``, ``add(alpha=)``, hence ``torch.optim.AdamW``) and share
  ``randn``'s vectorised Box-Muller path;
* ``DEFAULT`` (no vector unit) rounds the product before the add and draws ``randn`` with the scalar path, so
  its bits differ from theirs.

Reductions (``sum``, ``vector_norm``) and some vectorised functions (``exp2``) can also depend on the vector
width and on the tensor's shape; simdist's own figures avoid them (`simdist.studies.growth.metrics`). BLAS
(matmuls) follows its own CPU dispatch, which ``ATEN_CPU_CAPABILITY`` does not change.
"""

from __future__ import annotations

import torch

_FAMILIES = {"AVX2": "x86-fma", "AVX512": "x86-fma", "DEFAULT": "default"}


def kernel_family() -> str:
    """``"x86-fma"`` (AVX2 or AVX-512 kernels: the same bits), ``"default"``, or torch's own name for any other
    capability (not measured by this project, so not merged with either)."""
    capability = torch.backends.cpu.get_cpu_capability()
    return _FAMILIES.get(capability, capability.lower())
