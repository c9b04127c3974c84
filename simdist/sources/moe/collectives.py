"""The folded block's collectives as autograd functions (Megatron's f and g, the uneven all-to-all, the
TP restore gather), each a few lines over a `Comm`, so that backward runs the collectives real folding runs."""

from __future__ import annotations

import torch

from simdist.reduce import ReduceOp
from simdist.world.groups import Comm, Group


class AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with uneven splits; backward sends the gradients back the way they came."""

    @staticmethod
    def forward(ctx, x, comm: Comm, group: Group, out_splits: list[int], in_splits: list[int]):
        ctx.comm, ctx.group, ctx.splits = comm, group, (out_splits, in_splits)
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        comm.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        ctx.comm.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None, None


class RestoreGather(torch.autograd.Function):
    """restore_combined: all-gather the TP peers' variable-row slices into the full, replicated view.

    Forward pads each slice to the largest and all-gathers over TP, then drops
    the padding (peer order). Backward all-reduces (SUM) the replicated
    ``grad_output`` over TP and keeps this peer's rows: each peer's slice
    gradient comes back ``tp x`` too large, the factor the folding correction
    divides out.
    """

    @staticmethod
    def forward(ctx, local, comm: Comm, group: Group, rows: list[int], me: int):
        ctx.comm, ctx.group, ctx.rows, ctx.me = comm, group, rows, me
        width = max(rows)
        padded = local.new_zeros((width, *local.shape[1:]))
        padded[: local.shape[0]] = local
        gathered = local.new_empty((width * len(rows), *local.shape[1:]))
        comm.all_gather_into_tensor(gathered, padded, group=group)
        return torch.cat([gathered[p * width : p * width + n] for p, n in enumerate(rows)])

    @staticmethod
    def backward(ctx, grad):
        total = grad.contiguous().clone()
        ctx.comm.all_reduce(total, op=ReduceOp.SUM, group=ctx.group)
        start = sum(ctx.rows[: ctx.me])
        return total[start : start + ctx.rows[ctx.me]], None, None, None, None


class CopyToTP(torch.autograd.Function):
    """Megatron's f: identity forward, all_reduce (SUM) of the gradient over TP."""

    @staticmethod
    def forward(ctx, x, comm: Comm, group: Group):
        ctx.comm, ctx.group = comm, group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        ctx.comm.all_reduce(grad, op=ReduceOp.SUM, group=ctx.group)
        return grad, None, None


class ReduceFromTP(torch.autograd.Function):
    """Megatron's g: all_reduce (SUM) of the partial outputs over TP, identity backward."""

    @staticmethod
    def forward(ctx, x, comm: Comm, group: Group):
        out = x.contiguous().clone()
        comm.all_reduce(out, op=ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None
