"""Plain torch.distributed rank programs for tests/unit/world/backend/test_process_group.py and
tests/integration/test_backend_gloo.py.

Nothing here knows simdist: each function is ``fn(rank, *args)`` and calls only
``torch.distributed`` (and DTensor/FSDP2), so the same function runs on
`simdist.run` (threads), on `simdist.run(..., where="processes")` (process
mode) and on `simdist.run(..., where="gloo")` (real gloo). Importable by
spawned children because pytest puts tests/ on ``sys.path`` (tests/conftest.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from isolation_programs import quick as isolation_quick
from torch import nn


def data(seed: int, shape, dtype=torch.float32) -> torch.Tensor:
    """Normal values scaled by powers of two in [-12, 12] (built without exp2/pow: see
    simdist.reduce.gloo.reduction)."""
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


# -- (d) every collective once: the coverage program ------------------------------------------

REDUCE_OPS = ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "PREMUL_SUM", "BAND", "BOR", "BXOR")
DTYPES = (
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float64,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
)


def values(seed: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """``numel`` values of ``dtype``: `data` for floating types, 0..6 for integers, a coin flip for bool."""
    if dtype.is_floating_point:
        return data(seed, (numel,), dtype)
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(numel, generator=g) > 0.5
    return torch.randint(0, 7, (numel,), generator=g).to(dtype)


def reduce_op(name: str):
    """``dist.ReduceOp.<name>``; PREMUL_SUM with factor 0.5."""
    return dist._make_nccl_premul_sum(0.5) if name == "PREMUL_SUM" else getattr(dist.ReduceOp, name)


def _record(out: dict, key: str, fn) -> None:
    """``out[key]`` = what ``fn()`` returns, or ``"raises <type>"`` (the type is what backends must agree on)."""
    try:
        out[key] = fn()
    except Exception as exc:
        out[key] = f"raises {type(exc).__name__}"


def _reductions(rank: int, out: dict) -> None:
    """all_reduce for every dtype and op; reduce, reduce_scatter (tensor and list), coalesced for the rest."""
    n = dist.get_world_size()
    for dtype in DTYPES:
        for name in REDUCE_OPS:

            def all_reduce(dtype=dtype, name=name):
                t = values(rank, 37, dtype)
                dist.all_reduce(t, op=reduce_op(name))
                return t

            _record(out, f"all_reduce {dtype} {name}", all_reduce)
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        for name in ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "PREMUL_SUM"):

            def reduce(dtype=dtype, name=name):
                t = values(rank, 40, dtype)
                dist.reduce(t, dst=1, op=reduce_op(name))
                return t  # every rank: the root holds the result, the others what gloo leaves there

            def reduce_scatter_tensor(dtype=dtype, name=name):
                block = torch.empty(10, dtype=dtype)
                dist.reduce_scatter_tensor(block, values(rank, 40, dtype), op=reduce_op(name))
                return block

            def reduce_scatter_list(dtype=dtype, name=name):
                block = torch.empty(10, dtype=dtype)
                dist.reduce_scatter(block, list(values(rank, 40, dtype).chunk(n)), op=reduce_op(name))
                return block

            def coalesced(dtype=dtype, name=name):
                pair = [values(rank, 40, dtype), values(rank + 9, 7, dtype)]
                dist.all_reduce_coalesced(pair, op=reduce_op(name))
                return torch.cat(pair)

            for fn in (reduce, reduce_scatter_tensor, reduce_scatter_list, coalesced):
                _record(out, f"{fn.__name__} {dtype} {name}", fn)


def _functional(rank: int, out: dict) -> None:
    """The functional collectives (``_c10d_functional`` ops) DTensor and FSDP2 call, and c10d's coalescing."""
    import torch.distributed._functional_collectives as funcol

    world = dist.group.WORLD
    x, y = values(rank, 40, torch.float32), values(rank + 5, 12, torch.bfloat16)
    for name in ("sum", "avg", "product", "min", "max"):
        _record(out, f"funcol all_reduce {name}", lambda name=name: funcol.all_reduce(x, name, world) + 0)
        _record(
            out, f"funcol reduce_scatter {name}", lambda name=name: funcol.reduce_scatter_tensor(x, name, 0, world) + 0
        )
    out["funcol all_gather"] = funcol.all_gather_tensor(y, 0, world) + 0
    out["funcol all_to_all_single"] = funcol.all_to_all_single(x, None, None, world) + 0
    out["funcol all_to_all_single uneven"] = (
        funcol.all_to_all_single(values(rank, 4 * (rank + 1), torch.float32), [1, 2, 3, 4], [rank + 1] * 4, world) + 0
    )
    out["funcol broadcast"] = funcol.broadcast(x, 2, world) + 0
    out["funcol all_reduce_coalesced"] = torch.cat(
        [t + 0 for t in funcol.all_reduce_coalesced([x, x[:7]], "sum", world)]
    )
    pair = [x, values(rank + 5, 12, torch.float32)]
    out["funcol all_gather_coalesced"] = [t + 0 for t in funcol.all_gather_into_tensor_coalesced(pair, world)]
    out["funcol reduce_scatter_coalesced"] = [
        t + 0 for t in funcol.reduce_scatter_tensor_coalesced(pair, "sum", [0, 0], world)
    ]
    mixed = [x, y]
    _record(
        out,
        "funcol all_gather_coalesced, two dtypes",
        lambda: [t + 0 for t in funcol.all_gather_into_tensor_coalesced(mixed, world)],
    )
    _record(
        out,
        "funcol reduce_scatter_coalesced, two dtypes",
        lambda: [t + 0 for t in funcol.reduce_scatter_tensor_coalesced(mixed, "sum", [0, 0], world)],
    )
    for what, second in (("", x[:9]), (", two dtypes", y)):

        def coalescing(second=second):
            a, b = x.clone(), second.clone()
            with dist._coalescing_manager():
                dist.all_reduce(a)
                dist.all_reduce(b)
            return a, b

        _record(out, f"coalescing_manager all_reduce{what}", coalescing)
    gathered, scattered = torch.empty(160), torch.empty(10)
    with dist._coalescing_manager():
        dist.all_gather_into_tensor(gathered, x)
    with dist._coalescing_manager():
        dist.reduce_scatter_tensor(scattered, x)
    out["coalescing_manager all_gather, reduce_scatter"] = (gathered, scattered)


def _movement(rank: int, out: dict) -> None:
    """Broadcast, gathers, scatters, all-to-alls, their shape rules, point to point, objects."""
    n = dist.get_world_size()
    x = values(rank, 24, torch.float32)
    t = x.clone()
    dist.broadcast(t, src=2)
    out["broadcast"] = t
    t = x.view(4, 6).t()  # dense, not contiguous
    dist.broadcast(t, src=1)
    out["broadcast transposed"] = t.contiguous()
    lst = [torch.empty(2, 3) for _ in range(n)]
    dist.all_gather(lst, x[:6].view(2, 3))
    out["all_gather list"] = torch.stack(lst)

    def all_gather_wrong_shape():
        dist.all_gather([torch.empty(6) for _ in range(n)], x[:6].view(2, 3))

    _record(out, "all_gather list of another shape", all_gather_wrong_shape)
    for outshape, inshape in (((96,), (24,)), ((16, 6), (4, 6)), ((96,), (4, 6)), ((4, 24), (24,)), ((10,), (2,))):

        def into_tensor(outshape=outshape, inshape=inshape):
            o = torch.empty(outshape)
            dist.all_gather_into_tensor(o, x[: inshape[0] * (inshape[1] if len(inshape) > 1 else 1)].view(inshape))
            return o

        _record(out, f"all_gather_into_tensor {outshape} <- {inshape}", into_tensor)
    t = torch.empty(8, 3)
    dist.all_gather_into_tensor(t, x[:6].view(3, 2).t())
    out["all_gather_into_tensor transposed input"] = t
    for outshape, inshape in (((6,), (24,)), ((1, 6), (4, 6)), ((2, 3), (8, 3))):

        def rs_shape(outshape=outshape, inshape=inshape):
            o = torch.empty(outshape)
            dist.reduce_scatter_tensor(o, x.view(inshape))
            return o

        _record(out, f"reduce_scatter_tensor {outshape} <- {inshape}", rs_shape)
    got = [torch.empty(3) for _ in range(n)] if rank == 2 else None
    dist.gather(x[:3].clone(), got, dst=2)
    out["gather"] = torch.stack(got) if got else torch.zeros(0)
    t = torch.empty(4)
    dist.scatter(t, list(x[:16].view(4, 4).clone().unbind()) if rank == 3 else None, src=3)
    out["scatter"] = t
    outs = [torch.empty(2) for _ in range(n)]
    dist.all_to_all(outs, list(x[:8].view(4, 2).clone().unbind()))
    out["all_to_all"] = torch.stack(outs)

    def all_to_all_uneven():
        dist.all_to_all([torch.empty(j + 1) for j in range(n)], [torch.empty(j + 1) for j in range(n)])

    _record(out, "all_to_all uneven list", all_to_all_uneven)
    t = torch.empty(8, 3)
    dist.all_to_all_single(t, x.view(8, 3))
    out["all_to_all_single"] = t
    t = torch.empty(sum(range(1, n + 1)), 2)
    dist.all_to_all_single(
        t, values(rank, (rank + 1) * n * 2, torch.float32).view(-1, 2), list(range(1, n + 1)), [rank + 1] * n
    )
    out["all_to_all_single uneven"] = t

    def all_to_all_single_strided():
        dist.all_to_all_single(torch.empty(8, 3), x.view(3, 8).t())

    _record(out, "all_to_all_single strided input", all_to_all_single_strided)
    if rank == 0:
        dist.send(x[:5].clone(), 1, tag=3)
    elif rank == 1:
        t = torch.empty(5)
        dist.recv(t, 0, tag=3)
        out["send/recv"] = t
    into = torch.empty(4)
    if rank % 2 == 0:
        dist.isend(x[:4].clone(), rank + 1).wait()
        dist.irecv(into, rank + 1).wait()
    else:
        dist.irecv(into, rank - 1).wait()
        dist.isend(x[:4].clone(), rank - 1).wait()
    out["isend/irecv"] = into
    into = torch.empty(4)
    ops = [dist.P2POp(dist.isend, x[4:8].clone(), (rank + 1) % n), dist.P2POp(dist.irecv, into, (rank - 1) % n)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    out["batch_isend_irecv"] = into
    dist.barrier()
    objects = [None] * n
    dist.all_gather_object(objects, {"rank": rank, "x": x[:2].tolist()})
    gathered = [None] * n if rank == 0 else None
    dist.gather_object(("from", rank), gathered, dst=0)
    box = [f"rank {rank}"]
    dist.broadcast_object_list(box, src=2)
    scattered = [None]
    dist.scatter_object_list(scattered, [{"to": i} for i in range(n)] if rank == 3 else None, src=3)
    received = [None]
    if rank == 0:
        dist.send_object_list([{"k": 1.5}], dst=1)
    elif rank == 1:
        dist.recv_object_list(received, src=0)
    out["objects"] = repr((objects, gathered, box, scattered, received))


def _groups_and_async(rank: int, out: dict) -> None:
    """new_group with unsorted ranks, new_subgroups(_by_enumeration), async_op works and futures."""
    x = values(rank, 12, torch.float32)
    group = dist.new_group([3, 0, 2])  # every rank calls new_group; torch sorts the ranks
    if rank in (0, 2, 3):
        t = x.clone()
        dist.all_reduce(t, group=group)
        block = torch.empty(4)
        dist.reduce_scatter_tensor(block, x.clone(), group=group)
        out["new_group"] = (dist.get_rank(group), dist.get_world_size(group), t, block)
    sub, _ = dist.new_subgroups(2)
    t = x.clone()
    dist.all_reduce(t, group=sub)
    out["new_subgroups"] = (dist.get_rank(sub), t)
    enum, _ = dist.new_subgroups_by_enumeration([[0, 3], [2, 1]])
    t = x.clone()
    dist.all_reduce(t, group=enum)
    out["new_subgroups_by_enumeration"] = (dist.get_rank(enum), t)
    a, gathered, b = x.clone(), torch.empty(48), torch.full((3,), float(rank))
    works = [
        dist.all_reduce(a, async_op=True),
        dist.all_gather_into_tensor(gathered, x, async_op=True),
        dist.broadcast(b, 3, async_op=True),
    ]
    for work in works:
        work.wait()
    out["async_op"] = (a, gathered, b)
    c = x.clone()
    future = dist.all_reduce(c, op=dist.ReduceOp.MAX, async_op=True).get_future()
    out["async_op future"] = future.wait()[0]


def coverage(rank: int) -> dict:
    """Every collective of the issue once, on plain inputs; failures recorded as ``"raises <type>"``."""
    out: dict = {}
    _reductions(rank, out)
    _functional(rank, out)
    _movement(rank, out)
    _groups_and_async(rank, out)
    return out


def suite(rank: int) -> dict:
    """All programs in one run (one real-gloo spawn serves every comparison of test_backend_gloo.py)."""
    return {
        "tp_mlp": tp_mlp(rank),
        "dtensor": dtensor_2x2(rank),
        "fsdp2": fsdp2_steps(rank),
        "coverage": coverage(rank),
        # last: they seed torch's global generator (tests/integration/test_isolation.py)
        **{f"isolation_{name}": result for name, result in isolation_quick(rank).items()},
    }
