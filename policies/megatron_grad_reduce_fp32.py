"""Megatron-Core ``DistributedDataParallelConfig(grad_reduce_in_fp32=True)``.

Modelled on Megatron-Core 0.8-0.12 (``distributed_data_parallel.py``,
``param_and_grad_buffer.py``, ``finalize_model_grads.py``): each micro-step's
BF16 gradient is added into the FP32 ``main_grad`` buffer; at the
accumulation boundary the TP corrections of replicated parameters run once on
that FP32 buffer, then the buffer is scaled by ``1/dp`` before an FP32
all-reduce (``gradient_scaling_factor``, i.e. ``average_in_collective=False``).
Bucketing and distributed-optimizer sharding are not modelled.

Confirmed bitwise against megatron-core 0.16.1's real ``DistributedDataParallel``
and ``finalize_model_grads`` by the case ``megatron-grad-reduce-fp32`` (GAS 2, the
``main_grad`` after every micro-step and after the boundary, gloo and the
simdist backend in process mode), for ``grad_reduce_in_fp32=True`` and -- with
``accumulate=dp_reduce=bf16`` -- ``False``: every parameter on DP2, on
TP2 x DP2 every parameter without a TP reduction, and the micro-step
accumulation everywhere. Not what Megatron 0.16.1
does: ``finalize_model_grads`` runs the TP reduction (SUM for
``sequence_parallel`` parameters, AVG for ``average_gradients_across_tp_domain``)
*after* the DP all-reduce, this chain before it; the four-term sums then round
in another order (gradients over 25 binades: FP32 buffer 17% of those elements
differ, max error / sum|terms| 1.1e-7; BF16 buffer 22%, 7.4e-3). The same
stages in Megatron's order are bitwise what it computes. On DP4 the boundary
differs too: Megatron all-reduces a bucket as one flat buffer (parameters in
reverse order) and gloo orders an element's sum by its offset, while this
chain reduces each parameter alone (FP32 10% of elements differ, 1.2e-7; BF16
14%, 7.4e-3); the chain's DP stages on the flat bucket are bitwise what
Megatron computes. Not confirmed: expert
parameters, the distributed optimizer and the optimizer step.
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
