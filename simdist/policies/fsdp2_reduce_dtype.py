"""FSDP2 ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``.

Modelled on torch 2.4-2.6 ``torch.distributed._composable.fsdp``
(``_fsdp_collectives.foreach_reduce``; read from their source, not run here): every micro-step the BF16 unsharded
gradient is cast to the FP32 reduce dtype, divided by a pre-divide factor,
reduced over the data-parallel group in FP32 and divided by the post-divide
factor (``_get_gradient_divide_factors``: ``f`` doubles from 1 while ``dp`` is
divisible by it and ``dp / f > f``; pre-divide by ``f``, post-divide by
``dp / f``), then accumulated into the FP32 sharded gradient. A TP reduction
(DTensor's redistribute of a ``Partial`` gradient, or the folding TP
correction) runs before that cast, in the gradient's own dtype, BF16
(``staging=None``). torch 2.13 reduce-scatters with ``ReduceOp.AVG`` (on gloo
too) and no factors when the reduce dtype is fp32 or bf16.

Confirmed bitwise against torch 2.13.0's real ``fully_shard`` by two cases, the
sharded FP32 gradients after every micro-step (GAS 2), for ``reduce_dtype=fp32``
and (with ``dp_reduce=bf16``) ``reduce_dtype=bf16``, on gloo's summation order:

* ``fsdp2-reduce-dtype``: DP4, TP 1. For a power-of-two DP size the pre/post
  factors and AVG are the same exact scaling;
* ``fsdp2-reduce-dtype-tp``: ``fully_shard`` over the dp dim of a 2x2 mesh with
  ``ColwiseParallel``/``RowwiseParallel`` (and a ``SequenceParallel`` norm), for
  every gradient: TP ``Shard`` (family ``model_parallel``), ``Replicate`` or
  plain tensor (``dense``: TP peers hold bitwise identical gradients, so the TP
  average is exact) and ``Partial(sum)`` (``router_gate_partial``: summed over
  TP in BF16 before the cast to the reduce dtype). An FP32 staging cast before
  that TP sum -- this chain until the case found the order -- differs on 72% of
  those elements with ``reduce_dtype=fp32`` (max error / sum|terms| 1.9e-3).

Not confirmed: other DP sizes, the folding TP correction of routers and experts
(torch has no such step) and the optimizer step.
"""

from simdist.gradpath.policy import Policy, register

POLICY = register(
    Policy(
        name="fsdp2_reduce_dtype",
        summary="FSDP2 reduce_dtype=fp32: BF16 TP correction, FP32 cast and pre/post-divided DP reduce per micro-step",
        staging=None,
        writeback=None,
        expert_in_grad_dtype=False,
        dp_scale="pre_post_divide",
        dp_at="micro_step",
    )
)
