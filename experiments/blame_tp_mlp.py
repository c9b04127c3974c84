"""A small TP4 x DP2 MLP (8 ranks) trained in BF16 with FP32 masters: an ordinary torch.distributed program to blame.

Megatron-style tensor parallelism written out (picotron's way): the first layer is column-parallel, the
second row-parallel, its partial outputs summed over TP in BF16 by `_ReduceFromTP` (identity backward).
Gradients are averaged over DP in BF16, added into FP32 masters, stepped with AdamW and copied back.
Nothing in here knows simdist: `simdist.blame(train, 8)` (or ``simdist blame experiments/blame_tp_mlp.py``)
finds where it rounds.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

TP, DP, HIDDEN, WIDTH = 4, 2, 16, 32


class _ReduceFromTP(torch.autograd.Function):
    """Forward: sum the TP partial outputs; backward: the gradient passes unchanged (Megatron's ``g``)."""

    @staticmethod
    def forward(ctx, x, group):
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def train(rank: int, steps: int = 3) -> torch.Tensor:
    """One rank: the same full weights on every rank (seed 0), each TP rank keeps its shard; returns its last loss."""
    tp_groups = [dist.new_group(list(range(d * TP, (d + 1) * TP))) for d in range(DP)]
    dp_groups = [dist.new_group(list(range(t, TP * DP, TP))) for t in range(TP)]
    tp, dp = tp_groups[rank // TP], dp_groups[rank % TP]
    tp_rank = rank % TP
    init = torch.Generator().manual_seed(0)
    w1 = torch.randn(WIDTH, HIDDEN, generator=init) / HIDDEN**0.5
    w2 = torch.randn(HIDDEN, WIDTH, generator=init) / WIDTH**0.5
    shard = WIDTH // TP
    masters = [
        w1[tp_rank * shard : (tp_rank + 1) * shard].clone(),
        w2[:, tp_rank * shard : (tp_rank + 1) * shard].clone(),
    ]
    params = [torch.empty_like(m, dtype=torch.bfloat16) for m in masters]
    with torch.no_grad():
        for p, m in zip(params, masters, strict=True):
            p.copy_(m)
            p.requires_grad_()
    optimizer = torch.optim.AdamW(masters, lr=1e-2)
    data = torch.Generator().manual_seed(1000 + rank // TP)  # TP peers see the same batch, DP ranks their own
    loss = torch.zeros(())
    for _ in range(steps):
        x = torch.randn(64, HIDDEN, generator=data, dtype=torch.bfloat16)
        target = torch.randn(64, HIDDEN, generator=data, dtype=torch.bfloat16)
        hidden = torch.nn.functional.gelu(x @ params[0].t())  # column-parallel
        out = _ReduceFromTP.apply(hidden @ params[1].t(), tp)  # row-parallel: BF16 sum over TP
        loss = (out.float() - target.float()).pow(2).mean()
        loss.backward()
        for p, m in zip(params, masters, strict=True):
            dist.all_reduce(p.grad, op=dist.ReduceOp.AVG, group=dp)  # BF16 gradient average over DP
            m.grad = p.grad.float()
        optimizer.step()
        optimizer.zero_grad()
        with torch.no_grad():
            for p, m in zip(params, masters, strict=True):
                p.grad = None
                p.copy_(m)
    return loss.detach()


if __name__ == "__main__":
    import simdist

    print("final losses:", [f"{float(v):.6f}" for v in simdist.run(train, TP * DP)])
