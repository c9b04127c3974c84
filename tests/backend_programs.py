"""Plain torch.distributed rank programs for tests/test_backend*.py.

Nothing here knows simdist: each function is ``fn(rank, *args)`` and calls only
``torch.distributed`` (and DTensor/FSDP2), so the same function runs on
`simdist.spawn` (threads), on `spawn_procs(..., backend="simdist")` (process
mode) and on `spawn_procs(..., backend="gloo")` (real gloo). Importable by
spawned children because pytest puts tests/ on ``sys.path``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


def data(seed: int, shape, dtype=torch.float32) -> torch.Tensor:
    """Normal values scaled by powers of two in [-12, 12] (built without exp2/pow: see simdist.reduce.gloo)."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.tensor([2.0**k for k in range(-12, 13)])[torch.randint(0, 25, shape, generator=g)]
    return (torch.randn(shape, generator=g) * scale).to(dtype)


# -- (a) Megatron-style tensor-parallel MLP + an FSDP-style reduce_scatter -------------------


class _ReduceForward(torch.autograd.Function):
    """Megatron's g: all-reduce in forward, identity in backward."""

    @staticmethod
    def forward(ctx, x):
        x = x.clone()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad


class _ReduceBackward(torch.autograd.Function):
    """Megatron's f: identity in forward, all-reduce of the gradient in backward."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


def tp_mlp(rank: int, steps: int = 2) -> dict[str, torch.Tensor]:
    """Column-parallel then row-parallel linear layers, SGD steps, then a reduce_scatter of the flat grads."""
    world = dist.get_world_size()
    d, h = 24, 64
    shard = h // world
    w1_full, w2_full = data(1, (h, d)), data(2, (d, h))
    w1 = w1_full[rank * shard : (rank + 1) * shard].clone().requires_grad_()
    w2 = w2_full[:, rank * shard : (rank + 1) * shard].clone().requires_grad_()
    out: dict[str, torch.Tensor] = {}
    for step in range(steps):
        x = data(10 + step, (16, d))
        hidden = torch.relu(_ReduceBackward.apply(x) @ w1.t())
        y = _ReduceForward.apply(hidden @ w2.t())
        loss = y.square().mean()
        loss.backward()
        with torch.no_grad():
            w1 -= 0.01 * w1.grad
            w2 -= 0.01 * w2.grad
        flat = torch.cat([w1.grad.reshape(-1), w2.grad.reshape(-1)])
        block = torch.empty(flat.numel() // world)
        dist.reduce_scatter_tensor(block, flat)
        out[f"y{step}"] = y.detach()
        out[f"rs{step}"] = block
        w1.grad = None
        w2.grad = None
    bf = data(100 + rank, (1000,), torch.bfloat16)
    dist.all_reduce(bf)
    out["bf16"] = bf
    out["w1"], out["w2"] = w1.detach(), w2.detach()
    return out


# -- (b) DTensor on a 2x2 mesh ----------------------------------------------------------------


def dtensor_2x2(rank: int) -> dict[str, torch.Tensor]:
    """Partial -> Replicate and Shard -> Replicate on a 2x2 DeviceMesh, fp32 and bf16."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        x = data(200 + rank, (8, 6), dtype)
        partial = DTensor.from_local(x, mesh, [Partial(), Partial()])
        out[f"partial_{name}"] = partial.redistribute(mesh, [Replicate(), Replicate()]).to_local()
        sharded = DTensor.from_local(x, mesh, [Shard(0), Shard(1)])
        out[f"shard_{name}"] = sharded.redistribute(mesh, [Replicate(), Replicate()]).to_local()
    return out


# -- (c) FSDP2 with mixed precision -------------------------------------------------------------


def fsdp2_steps(rank: int, steps: int = 3) -> dict[str, torch.Tensor]:
    """fully_shard with bf16 params and fp32 reduce, AdamW; the local shards after ``steps`` steps."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    for step in range(steps):
        x = data(300 + 10 * rank + step, (4, 16))
        loss = model(x).float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    return {name: p.to_local().detach().clone() for name, p in model.named_parameters()}
