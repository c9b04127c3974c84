"""DeepSpeed's BF16_Optimizer under AutoEP+AutoTP folding, as shipped (fc7bc301 / 0.19.8).

``_update_hp_grad`` hands ``lp.grad`` to the folding helper, which promotes it
to FP32, all-reduces over TP in FP32, divides by ``tp`` in FP32 (AVERAGE) and
copies the result back into the BF16 ``lp.grad`` (round to nearest even);
the wrapper then adds ``lp.grad.float()`` to the FP32 buffer. Routed experts
are divided by ``tp`` in place in BF16. The DP reduction of the FP32 buffers
is modelled with ``communication_data_type: fp32`` (see
``bf16_writeback_bf16_comm`` for DeepSpeed's default BF16 communication).
This is the #8913 boundary: FP32 reduction -> BF16 writeback -> FP32 accumulation.

Confirmed bitwise against DeepSpeed 0.19.8's real ``BF16_Optimizer`` by the case
``deepspeed-8913`` (high-precision gradients after every micro-step, epilogue
and immediate paths, GAS 1 and 3, TP2/EP2/ETP1, on gloo and on the simdist
backend in process mode) and ``deepspeed-gas-marker`` (GAS 4). Not confirmed:
the DP reduction and the optimizer step (the cases stop at the hp gradient),
and ``bf16_writeback_bf16_comm``.
"""

import torch

from simdist.gradpath.policy import Policy, register

POLICY = register(
    Policy(
        name="bf16_writeback",
        summary="DeepSpeed fc7bc301: FP32 TP reduction, BF16 writeback, FP32 accumulation",
        staging=torch.float32,
        writeback=torch.bfloat16,
        expert_in_grad_dtype=True,
    )
)

BF16_COMM = register(
    Policy(
        name="bf16_writeback_bf16_comm",
        summary="bf16_writeback with DeepSpeed's default communication_data_type (BF16 DP all-reduce)",
        staging=torch.float32,
        writeback=torch.bfloat16,
        expert_in_grad_dtype=True,
        dp_reduce=torch.bfloat16,
    )
)
