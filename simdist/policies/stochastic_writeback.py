"""DeepSpeed's BF16 writeback with seeded stochastic rounding instead of round-to-nearest.

The FP32 TP result is rounded to BF16 up or down with probability
proportional to its distance from each neighbour (unbiased in expectation),
using a generator seeded per step, micro-step, rank and parameter, so runs
are reproducible bit for bit.

Not a DeepSpeed behaviour (0.19.8 rounds to nearest even, see the case
``deepspeed-8913``); no case confirms it against real code.
"""

import torch

from simdist.gradpath.policy import Policy, register

POLICY = register(
    Policy(
        name="stochastic_writeback",
        summary="bf16_writeback with seeded stochastic rounding at the BF16 writeback",
        staging=torch.float32,
        writeback=torch.bfloat16,
        rounding="stochastic",
        expert_in_grad_dtype=True,
    )
)
