"""BF16 end to end: TP reduction and accumulation in BF16, as an explicit contract.

The TP all-reduce, the ``/tp`` and the gradient accumulation all run in BF16,
and so does the DP all-reduce; only the optimizer keeps FP32 masters and
moments. This is the cheap policy some stacks choose on purpose; simdist keeps
it explicit instead of letting a policy silently turn into it.
"""

import torch

from simdist.gradpath.policy import Policy, register

POLICY = register(
    Policy(
        name="bf16_only",
        summary="TP reduction, accumulation and DP reduction all in BF16; FP32 masters and moments",
        staging=None,
        writeback=None,
        accumulate=torch.bfloat16,
        dp_reduce=torch.bfloat16,
    )
)
