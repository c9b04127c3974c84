"""Ordinary training idioms as plain torch.distributed rank programs, for tests/integration/test_isolation.py.

Nothing here knows simdist: each function is ``fn(rank)`` and the same code runs
on `simdist.run` (threads), on `simdist.run(..., where="processes")` (process
mode) and on `simdist.run(..., where="gloo")` (real gloo). They use torch's
global generator, default dtype and DTensor's tables as a real program does, so
on threads they give a real job's bits only if every rank thread has its own.
"""

from __future__ import annotations

import random

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


def seed_per_rank(rank: int) -> dict:
    """``manual_seed(base + rank)``, a collective, then ``randn``/``rand``: each rank's own stream."""
    torch.manual_seed(1000 + rank)
    first = torch.randn(5)
    total = first.clone()
    dist.all_reduce(total)
    after = torch.randn(7)
    dist.barrier()
    return {"first": first, "sum": total, "after": after, "rand": torch.rand(3), "seed": torch.initial_seed()}


def same_seed_init(rank: int) -> dict:
    """``manual_seed(0)`` on every rank, then ``nn.Linear``/``kaiming_uniform_``: identical weights on every rank."""
    torch.manual_seed(0)
    layer = nn.Linear(16, 8)
    dist.barrier()
    extra = torch.empty(6, 6)
    nn.init.kaiming_uniform_(extra, a=5**0.5)
    return {"weight": layer.weight.detach(), "bias": layer.bias.detach(), "extra": extra}


def settings(rank: int) -> dict:
    """Rank 1 changes process-global settings; every rank's dtype and flags are its own (as in processes)."""
    if rank == 1:
        torch.set_default_dtype(torch.float64)
        torch.use_deterministic_algorithms(True)
    dist.barrier()
    made = torch.ones(2) / 3
    dist.barrier()
    out = {"made": made, "dtype": str(torch.get_default_dtype()), "det": torch.are_deterministic_algorithms_enabled()}
    torch.set_default_dtype(torch.float32)
    torch.use_deterministic_algorithms(False)
    return out


def broadcast_params(rank: int) -> dict:
    """Sync initial weights with ``dist.broadcast(param, 0)``; the version counter is not bumped (as gloo)."""
    torch.manual_seed(50 + rank)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    versions = []
    for p in model.parameters():
        before = p._version
        dist.broadcast(p, 0)
        versions.append(p._version - before)
    x = torch.randn(4, 6)
    hidden = x.exp()
    dist.all_reduce(x)  # x is saved by exp's backward only through `hidden`: the write is not recorded
    loss = model(x).sum() + hidden.sum()
    loss.backward()
    return {
        "params": [p.detach() for p in model.parameters()],
        "grads": [p.grad for p in model.parameters()],
        "versions": versions,
        "requires_grad": [p.requires_grad and p.grad_fn is None for p in model.parameters()],
    }


def ddp_dropout(rank: int, steps: int = 3) -> dict:
    """DDP with dropout: same-seed init, per-rank data and dropout masks from the global generator."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 24), nn.ReLU(), nn.Dropout(0.3), nn.Linear(24, 4))
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    torch.manual_seed(100 + rank)
    losses = []
    for _ in range(steps):
        x = torch.randn(8, 12)
        loss = ddp(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return {"params": [p.detach() for p in model.parameters()], "losses": losses}


def tp_fsdp2_uneven(rank: int) -> dict:
    """ColwiseParallel over tp then fully_shard over dp on a 2x2 mesh, 37 rows; full_tensor() on every rank."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 37))
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel()})  # local output: 19 or 18 columns
    fully_shard(model, mesh=mesh["dp"])
    full = {name: p.full_tensor().detach() for name, p in model.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(10 + mesh.get_coordinate()[0])  # data per dp rank
    x = torch.randn(4, 10)
    model(x).square().sum().backward()
    opt.step()
    after = {name: p.full_tensor().detach() for name, p in model.named_parameters()}
    return {"full": full, "after": after}


def loss_parallel_tp(rank: int) -> dict:
    """Vocabulary-parallel cross entropy under ``loss_parallel()`` on a 1-D tp mesh, forward and backward."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, loss_parallel, parallelize_module

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    head = nn.Linear(8, 20, bias=False)
    parallelize_module(head, mesh, ColwiseParallel(output_layouts=Shard(-1), use_local_output=False))
    x = torch.randn(6, 8)
    target = torch.randint(0, 20, (6,))
    with loss_parallel():
        logits = head(x)
        loss = F.cross_entropy(logits, target)
        loss.backward()
    return {"loss": loss.full_tensor().detach(), "grad": head.weight.grad.full_tensor()}


class _Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x):
        return torch.tanh(self.lin(x))


def pipeline(rank: int) -> dict:
    """torch.distributed.pipelining: one stage per rank, GPipe then 1F1B, 4 micro-batches each."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    world = dist.get_world_size()
    out: dict = {}
    for name, schedule in (("gpipe", ScheduleGPipe), ("1f1b", Schedule1F1B)):
        torch.manual_seed(7 + rank)
        block = _Block(6)
        stage = PipelineStage(block, rank, world, torch.device("cpu"))
        sched = schedule(stage, n_microbatches=4, loss_fn=lambda y, t: (y - t).square().mean())
        torch.manual_seed(99)  # the same batch on every rank; only the first and last stage use it
        x, target = torch.randn(8, 6), torch.randn(8, 6)
        losses: list = []
        if rank == 0:
            sched.step(x)
        elif rank == world - 1:
            sched.step(target=target, losses=losses)
        else:
            sched.step()
        out[name] = {"grad": [p.grad for p in block.parameters()], "losses": losses}
    return out


def monitored(rank: int) -> dict:
    """``dist.monitored_barrier`` (gloo implements it) between two collectives."""
    t = torch.full((2,), float(rank))
    dist.all_reduce(t)
    dist.monitored_barrier()
    dist.monitored_barrier(wait_all_ranks=True)
    return {"t": t}


def zero_overlap(rank: int) -> dict:
    """ZeroRedundancyOptimizer(overlap_with_ddp=True) with its DDP hook: torch refuses it on gloo."""
    from torch.distributed.algorithms.ddp_comm_hooks.ddp_zero_hook import hook_with_zero_step
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    ddp = DDP(nn.Linear(4, 4))
    zero = ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.SGD, overlap_with_ddp=True, lr=0.1)
    try:
        ddp.register_comm_hook(None, hook_with_zero_step(lambda state, bucket: None, ddp, zero))
    except RuntimeError as exc:
        return {"refused": f"RuntimeError: {exc}"}
    return {"refused": "no"}


def seeded_data(rank: int, *, collectives: bool = True) -> dict:
    """``random.seed(rank); np.random.seed(rank); torch.manual_seed(rank)``, then shuffles and draws from all three
    global generators with collectives in between (so rank threads interleave their draws); the numbers summed by
    an all_reduce. ``collectives=False`` runs the same draws with no collective (one process's sequence alone)."""

    def sync() -> None:
        if collectives:
            dist.barrier()

    random.seed(rank)
    np.random.seed(rank)
    torch.manual_seed(rank)
    sync()
    order = list(range(24))
    random.shuffle(order)
    picks = [*random.sample(range(1000), 5), random.randint(0, 10**9), random.getrandbits(40)]
    sync()
    normal = np.random.randn(6)  # legacy Gaussian pairs: a cached second value crosses the barrier below
    sync()
    normal2 = np.random.standard_normal(3)
    perm = np.random.permutation(12)
    ints = np.random.randint(0, 2**31 - 1, size=4)
    np.random.shuffle(perm)
    floats = [random.random(), random.gauss(0.0, 1.0), np.random.ranf()]
    values = torch.tensor(floats + normal.tolist() + normal2.tolist(), dtype=torch.float64) * torch.randn(12).double()
    total = values.clone()
    if collectives:
        dist.all_reduce(total)
    return {
        "order": torch.tensor(order),
        "picks": torch.tensor(picks),
        "perm": torch.from_numpy(perm.copy()),
        "ints": torch.from_numpy(ints.astype(np.int64)),
        "values": values,
        "total": total,
    }


QUICK = ("seed_per_rank", "same_seed_init", "settings", "broadcast_params")
PROGRAMS = {
    "seed_per_rank": seed_per_rank,
    "same_seed_init": same_seed_init,
    "settings": settings,
    "broadcast_params": broadcast_params,
    "ddp_dropout": ddp_dropout,
    "tp_fsdp2_uneven": tp_fsdp2_uneven,
    "loss_parallel": loss_parallel_tp,
    "pipeline": pipeline,
    "monitored": monitored,
    "zero_overlap": zero_overlap,
}


def quick(rank: int) -> dict:
    """The cheap programs in one run (the default suite's one real-gloo spawn)."""
    return {name: PROGRAMS[name](rank) for name in QUICK}


def suite(rank: int) -> dict:
    """Every program in one run (one real-gloo spawn, one process-mode spawn)."""
    return {name: fn(rank) for name, fn in PROGRAMS.items()}
