"""Megatron-Core ``DistributedDataParallelConfig(grad_reduce_in_fp32=True)``.

Modelled on Megatron-Core (``distributed_data_parallel.py``, ``param_and_grad_buffer.py``,
``finalize_model_grads.py``): each micro-step's BF16 gradient is added into the FP32 ``main_grad``
buffer; at the accumulation boundary the buffer is scaled by ``1/dp`` and all-reduced in FP32
(``gradient_scaling_factor``, i.e. ``average_in_collective=False``), and *then* ``finalize_model_grads``
runs the TP reductions of replicated parameters (``correct_at="after_dp"``). Distributed-optimizer
sharding is not modelled.

Confirmed bitwise against megatron-core 0.16.1's real ``DistributedDataParallel`` and
``finalize_model_grads`` by the case ``megatron-grad-reduce-fp32`` (GAS 2, the ``main_grad`` after every
micro-step and after the boundary, gloo and the simdist backend in process mode), for
``grad_reduce_in_fp32=True`` and -- with ``accumulate=dp_reduce=bf16`` -- ``False``: every parameter on DP2
and on TP2 x DP2. The order matters: the TP correction before the DP reduction (this chain until that case
found the order) rounds the four-term sums differently (gradients over 25 binades: FP32 buffer 17% of the
TP-reduced elements differ, max error / sum|terms| 1.1e-7; BF16 buffer 22%, 7.4e-3). Not claimed on DP4:
Megatron all-reduces a bucket as one flat buffer (parameters in reverse order) and gloo orders an element's
sum by its offset, while this chain reduces each parameter alone (FP32 10% of elements differ, 1.2e-7;
BF16 14%, 7.4e-3); the chain's DP stages on the flat bucket are bitwise what Megatron computes. Not
confirmed: expert parameters, the distributed optimizer and the optimizer step.
"""

import torch

from simdist.gradpath.policy import Policy, register

POLICY = register(
    Policy(
        name="megatron_grad_reduce_fp32",
        summary="Megatron-Core grad_reduce_in_fp32: FP32 main_grad; 1/dp-prescaled DP all-reduce, then TP correction",
        staging=torch.float32,
        writeback=None,
        expert_in_grad_dtype=False,
        correct_at="after_dp",
        dp_scale="prescale",
    )
)
