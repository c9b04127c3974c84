"""The fix proposed in #8913: stage in FP32 and add the FP32 result directly.

``_update_hp_grad`` copies ``lp.grad`` into an FP32 staging tensor, applies
the existing folding correction to the staging tensor (TP all-reduce and
``/tp`` for AVERAGE, ``/tp`` for routed experts) and adds it to the FP32
buffer with no BF16 conversion in between. Readiness flags, the
correction-once marker and the clearing of ``lp.grad`` are kept as they are.

Confirmed bitwise against DeepSpeed 0.19.8 with this fix patched into the real
``BF16_Optimizer._update_hp_grad`` by the case ``deepspeed-8913`` (hp gradients
after every micro-step, both update paths, GAS 1 and 3); the DP reduction and
the step are not confirmed.
"""

import torch

from simdist.gradpath.policy import Policy, register

POLICY = register(
    Policy(
        name="fp32_staging",
        summary="#8913 fix: FP32 staging, correction on the staging tensor, added directly to the FP32 buffer",
        staging=torch.float32,
        writeback=None,
        expert_in_grad_dtype=False,
    )
)
