"""FSDP2 ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``.

Modelled on torch 2.4-2.6 ``torch.distributed._composable.fsdp``
(``_fsdp_collectives.foreach_reduce``): every micro-step the BF16 unsharded
gradient is cast to the FP32 reduce dtype, divided by a pre-divide factor,
reduced over the data-parallel group in FP32 and divided by the post-divide
factor (``_get_gradient_divide_factors``: ``f`` doubles from 1 while ``dp`` is
divisible by it and ``dp / f > f``; pre-divide by ``f``, post-divide by
``dp / f``), then accumulated into the FP32 sharded gradient. The folding TP correction runs on the FP32 copy first.
torch 2.13 instead reduce-scatters with ``ReduceOp.AVG`` (on gloo too) and no
factors when the reduce dtype is fp32 or bf16.

Confirmed bitwise against torch 2.13.0's real ``fully_shard`` by the case
``fsdp2-reduce-dtype``: DP4, GAS 2, TP 1, the sharded FP32 gradients after
every micro-step, for ``reduce_dtype=fp32`` and (with ``dp_reduce=bf16``)
``reduce_dtype=bf16``, on gloo's summation order. For a power-of-two DP size
the pre/post factors and AVG are the same exact scaling; other DP sizes, the
folding TP correction (TP > 1) and the optimizer step are not confirmed.
"""

import torch

from simdist.gradpath.policy import Policy, register

POLICY = register(
    Policy(
        name="fsdp2_reduce_dtype",
        summary="FSDP2 reduce_dtype=fp32: FP32 cast, TP correction, pre/post-divided FP32 DP reduce every micro-step",
        staging=torch.float32,
        writeback=None,
        expert_in_grad_dtype=False,
        dp_scale="pre_post_divide",
        dp_at="micro_step",
    )
)
