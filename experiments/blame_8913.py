"""The #8913 gradient path written as an ordinary torch.distributed program, for ``simdist blame``.

Nothing here knows DeepSpeed or simdist's policies: a BF16 router weight on TP2 x DP2 (4 ranks), each rank
routing its own tokens, its BF16 local gradient staged in FP32, all-reduced over TP, averaged, written back
into BF16 (the #8913 boundary), added to an FP32 buffer, all-reduced over DP, then AdamW on an FP32 master
copied back into the BF16 weight.

    simdist blame --promote-top 5 experiments/blame_8913.py            # rank the sites, promote the top 5
    simdist blame experiments/blame_8913.py --no-writeback             # the fix: FP32 added directly

`train` is the rank function (`simdist.blame(train, 4)` in Python); run as a script it spawns 4 ranks itself.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

TP, DP = 2, 2


def train(rank: int, steps: int = 3, writeback: bool = True) -> torch.Tensor:
    """One rank of the program; returns its last loss."""
    tp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    tp, dp = tp_groups[rank // TP], dp_groups[rank % TP]
    master = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))  # FP32 master, same on every rank
    weight = torch.empty(8, 16, dtype=torch.bfloat16)
    with torch.no_grad():
        weight.copy_(master)
    weight.requires_grad_()
    optimizer = torch.optim.AdamW([master], lr=1e-2)
    hp_grad = torch.zeros_like(master)
    tokens = torch.Generator().manual_seed(100 + rank)  # each rank routes its own tokens
    loss = torch.zeros(())
    for _ in range(steps):
        x = torch.randn(32, 16, generator=tokens, dtype=torch.bfloat16)
        loss = (x @ weight.t()).float().logsumexp(-1).mean()
        loss.backward()
        staged = weight.grad.float()  # BF16 local router gradient -> FP32
        dist.all_reduce(staged, group=tp)  # TP reduction in FP32
        staged /= TP  # the router is replicated over TP: average
        if writeback:
            low = staged.to(torch.bfloat16)  # the BF16 writeback
            hp_grad += low.float()
        else:
            hp_grad += staged  # the fix: FP32 straight into the FP32 buffer
        dist.all_reduce(hp_grad, group=dp)  # DP reduction in FP32
        master.grad = hp_grad / DP
        optimizer.step()
        optimizer.zero_grad()
        hp_grad.zero_()
        weight.grad = None
        with torch.no_grad():
            weight.copy_(master)  # new BF16 weight from the FP32 master
    return loss.detach()


if __name__ == "__main__":
    import simdist

    losses = simdist.run(train, TP * DP, kwargs={"writeback": "--no-writeback" not in sys.argv[1:]})
    print("final losses:", [f"{float(v):.6f}" for v in losses])
