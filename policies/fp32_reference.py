"""Every stage in FP32: FP32 staging, reduction, accumulation, DP reduction, masters and moments.

Only the local gradient (and the parameter the model computes with) is BF16.
This is the policy the FP32 oracle describes, run through the same engine.
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
