"""Every stage in FP32: FP32 staging, reduction, accumulation, DP reduction, masters and moments.

Only the local gradient (and the parameter the model computes with) is BF16.
Field for field this is ``fp32_staging``; it is kept as a test of the engine (and a
name for the MoE studies), not as a reference: the FP32 oracle is
`simdist.gradpath.reference`, which shares no code with the engine.
"""

import torch

from simdist.gradpath.policy import Policy, register

POLICY = register(
    Policy(
        name="fp32_reference",
        summary="every stage in FP32 after the BF16 local gradient",
        staging=torch.float32,
        writeback=None,
        expert_in_grad_dtype=False,
    )
)
