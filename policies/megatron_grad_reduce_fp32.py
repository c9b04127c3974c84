"""Megatron-Core ``DistributedDataParallelConfig(grad_reduce_in_fp32=True)``.

Modelled on Megatron-Core 0.8-0.12 (``distributed_data_parallel.py``,
``param_and_grad_buffer.py``, ``finalize_model_grads.py``): each micro-step's
BF16 gradient is added into the FP32 ``main_grad`` buffer; at the
accumulation boundary the TP corrections of replicated parameters run once on
that FP32 buffer (as ``finalize_model_grads`` all-reduces replicated
gradients), then the buffer is scaled by ``1/dp`` before an FP32 all-reduce
(``gradient_scaling_factor``, i.e. ``average_in_collective=False``).
Simplification: Megatron's bucketing and distributed optimizer sharding do
not change the per-element arithmetic and are not modelled.

Not confirmed by a case: megatron-core 0.16.1 installs and imports on CPU
without Transformer Engine, but no case drives its DDP yet.
"""

import torch

from simdist.gradpath.policy import Policy, register

POLICY = register(
    Policy(
        name="megatron_grad_reduce_fp32",
        summary="Megatron-Core grad_reduce_in_fp32: FP32 main_grad, TP correction and 1/dp pre-scaling at the boundary",
        staging=torch.float32,
        writeback=None,
        expert_in_grad_dtype=False,
        correct_at="boundary",
        dp_scale="prescale",
    )
)
