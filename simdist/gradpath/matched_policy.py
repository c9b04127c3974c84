"""The oracle's precision as a `Policy` run by the gradient path (the #8913 report's "matched FP32 policy") -- a
test of the gradient path, not the oracle.

The oracle that judges the gradient path is `simdist.gradpath.oracle` (explicit TP-then-DP reduction in plain
loops and a real ``torch.optim.AdamW``; it shares no code with the gradient path). What is here keeps the run's
topology, correction rule, local gradients and DP normalisation, changes only precision -- the BF16 local
gradient staged into ``dtype``, every later stage in ``dtype``, the TP correction on every micro-step -- and runs
through the same `GradPath` as every policy. Gradient-path tests use it (rank-batched == per-rank, the MoE study's
FP64 ground truth, the training study's comparison run), and ``tests/unit/gradpath/oracle/test_step.py`` checks that
`MATCHED_FP32` gives the independent oracle's bits.
"""

from __future__ import annotations

import torch

from simdist.gradpath.policy import Policy, dtype_name


def matched_policy(dtype: torch.dtype = torch.float32) -> Policy:
    """Every stage after the BF16 local gradient in ``dtype``; run it with ``marker="per_micro_step"``."""
    return Policy(
        name=f"matched_{str(dtype).removeprefix('torch.')}",
        summary=f"{dtype_name(dtype)} TP-then-DP per-parameter reducer",
        staging=dtype,
        writeback=None,
        expert_in_grad_dtype=False,
        accumulate=dtype,
        dp_reduce=dtype,
        master=dtype,
        moments=dtype,
    )


MATCHED_FP32 = matched_policy(torch.float32)
MATCHED_FP64 = matched_policy(torch.float64)
