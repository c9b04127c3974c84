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

Confirmed bitwise against torch 2.13.0's real ``fully_shard`` by two cases, the
sharded FP32 gradients after every micro-step (GAS 2), for ``reduce_dtype=fp32``
and (with ``dp_reduce=bf16``) ``reduce_dtype=bf16``, on gloo's summation order:

* ``fsdp2-reduce-dtype``: DP4, TP 1. For a power-of-two DP size the pre/post
  factors and AVG are the same exact scaling;
* ``fsdp2-reduce-dtype-tp``: ``fully_shard`` over the dp dim of a 2x2 mesh with
  ``ColwiseParallel``/``RowwiseParallel`` (and a ``SequenceParallel`` norm), for
  every gradient that reaches FSDP2 as a TP ``Shard`` (family
  ``model_parallel``), ``Replicate`` or plain tensor (``dense``: TP peers hold
  bitwise identical gradients, so the chain's FP32 TP average is exact).

Not what torch does, measured by ``fsdp2-reduce-dtype-tp``: a ``Partial(sum)``
gradient (the ``SequenceParallel`` norm) is summed over TP by DTensor in BF16
*before* FSDP2 casts it to the reduce dtype, whereas this chain sums after its
FP32 staging cast; with ``reduce_dtype=fp32`` 72% of those elements differ (max
error / sum|terms| 1.9e-3). The chain with ``staging=None`` is bitwise what torch
computes there. Not confirmed: other DP sizes, the folding TP correction of
routers and experts (torch has no such step) and the optimizer step.
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
