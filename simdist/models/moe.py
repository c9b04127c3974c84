"""A tiny MoE transformer block in BF16, laid out as DeepSpeed's AutoEP+AutoTP folding lays it out.

One block, every folding family present (``MoEConfig`` sizes; defaults are
small for fast CPU runs)::

    a = LN1(x);  h = x + W2 silu(W1 a)                 dense MLP            DENSE (replicated)
    b = LN2(h);  gate, experts = top_k(softmax(R b))   router               ROUTER_GATE_REPLICATED
    y = sum_k gate_k * Expert_e(b)                     routed experts       EXPERT (E/ep per EP rank)
    m = h + y;   c = LN3(m)                            post-MoE LayerNorm   DENSE
    out = m + g(V2_i silu(V1_i f(c)))                  TP-sharded MLP       MODEL_PARALLEL
    loss = mean((out - target)^2) / gas

Folded semantics (modelled on ``deepspeed/moe/ep_tp_dispatch.py`` and
``deepspeed/module_inject/auto_ep_folding.py``; no code copied):

* route-full: every TP peer holds the same tokens and runs LN1, the dense MLP,
  LN2 and the router redundantly, so all peers see identical routing;
* partition-dispatch: the routed (token, expert) assignments are split across
  TP peers by their stable ordinal within each expert (``ordinal % tp``); each
  peer dispatches only its slice over the EP group with ``all_to_all_single``
  (uneven splits, no token dropping; split sizes are exchanged first with an
  ``all_to_all_single`` of counts), the owning EP rank runs its ``E/ep``
  experts, and a second ``all_to_all_single`` returns the outputs;
* restore_combined: a custom autograd function all-gathers the peers'
  combined slices (expert output and gate weight) into the full, replicated
  view; its backward all-reduces (SUM) the replicated ``grad_output`` over TP
  and keeps this peer's rows, so each peer's slice gradient is ``tp x`` the
  true one.

That last factor is what the folding correction removes: the router (and
every parameter upstream of the MoE) holds ``tp x`` the gradient of its own
slice, so ``all_reduce[tp] / tp`` (AVERAGE) gives the full gradient; experts
hold ``tp x`` their true gradient and are not TP-replicated, so a plain
``/tp`` (EXPERT_TP_CANCEL) is right. Note a consequence the synthetic
gradients do not show: DENSE parameters *upstream* of the MoE (LN1, the dense
MLP, LN2) also hold *different* local gradients on TP peers (the residual
path's gradient is replicated, the MoE path's is partitioned), so AVERAGE is
not a no-op for them; only the post-MoE LayerNorm gets identical peer
gradients. The TP-sharded MLP sits after the restore, where ``grad_output`` is
replicated, with Megatron's f (identity / all_reduce) and g (all_reduce /
identity), so its shards get exact gradients and SKIP is right for them.
(Upstream of the MoE it would not be: a column shard there sees ``tp x`` a
slice of the gradient, which no family's correction repairs.)

`MoEGradients` is the `simdist.gradpath.path.GradientSource` that runs this model
inside `train_rank`; `reference_gradients` is the unsharded FP64 reference.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from simdist.gradpath.families import Family, ParamSpec
from simdist.reduce import ReduceOp
from simdist.world.groups import Comm, Group
from simdist.world.spec import ParallelSpec

LN_EPS = 1e-5


@dataclass(frozen=True)
class MoEConfig:
    """Sizes of the block. ``tokens`` is per rank and micro-step (TP peers share them)."""

    hidden: int = 16
    experts: int = 4
    top_k: int = 2
    expert_hidden: int = 32
    dense_hidden: int = 32
    tp_hidden: int = 16
    tokens: int = 8

    def validate(self, spec: ParallelSpec) -> None:
        """``ValueError`` naming the broken constraint when this block cannot be laid out on ``spec``."""
        if spec.pp != 1 or spec.etp != 1:
            raise ValueError(f"the MoE block needs pp=1 and etp=1, got {spec.describe()}")
        if self.experts % spec.ep:
            valid = [d for d in range(1, self.experts + 1) if self.experts % d == 0]
            raise ValueError(f"ep={spec.ep} must divide experts={self.experts}; valid ep values: {valid}")
        if self.tp_hidden % spec.tp:
            raise ValueError(f"tp={spec.tp} must divide tp_hidden={self.tp_hidden}")
        if not 1 <= self.top_k <= self.experts:
            raise ValueError(f"top_k={self.top_k} must be in 1..experts={self.experts}")


def moe_params(spec: ParallelSpec, cfg: MoEConfig = MoEConfig()) -> list[ParamSpec]:
    """Every parameter as a rank holds it (local shapes), in forward order."""
    cfg.validate(spec)
    h, local_e, ft = cfg.hidden, cfg.experts // spec.ep, cfg.tp_hidden // spec.tp
    dense, mp = Family.DENSE, Family.MODEL_PARALLEL
    return [
        ParamSpec("ln1.weight", dense, (h,)),
        ParamSpec("ln1.bias", dense, (h,)),
        ParamSpec("mlp.w1", dense, (cfg.dense_hidden, h)),
        ParamSpec("mlp.w2", dense, (h, cfg.dense_hidden)),
        ParamSpec("ln2.weight", dense, (h,)),
        ParamSpec("ln2.bias", dense, (h,)),
        ParamSpec("router.weight", Family.ROUTER_GATE_REPLICATED, (cfg.experts, h)),
        ParamSpec("experts.w1", Family.EXPERT, (local_e, cfg.expert_hidden, h)),
        ParamSpec("experts.w2", Family.EXPERT, (local_e, h, cfg.expert_hidden)),
        ParamSpec("ln3.weight", dense, (h,)),
        ParamSpec("ln3.bias", dense, (h,)),
        ParamSpec("tp_mlp.w1", mp, (ft, h)),
        ParamSpec("tp_mlp.w2", mp, (h, ft)),
    ]


def _seed(*parts: object) -> int:
    return zlib.crc32(repr(parts).encode())


def _randn(shape, seed: int) -> torch.Tensor:
    return torch.randn(tuple(shape), generator=torch.Generator().manual_seed(seed), device="cpu")


# Which dimension a sharded parameter is split on, and over which group's ranks.
_SHARDS = {"tp_mlp.w1": ("tp", 0), "tp_mlp.w2": ("tp", 1), "experts.w1": ("ep", 0), "experts.w2": ("ep", 0)}


class MoEInitialWeights:
    """``(rank, param) -> BF16 initial weight``: the full weight is seeded once and sharded by the layout.

    Replicated parameters are identical on every rank; a TP-sharded weight is
    the ``tp_rank``-th slice of its full weight, an expert weight the
    ``ep_rank``-th block of experts. A class so that it pickles into real
    torch.distributed processes; ``device`` is where the tensors are put.
    """

    def __init__(self, spec: ParallelSpec, cfg: MoEConfig = MoEConfig(), seed: int = 0, device: str = "cpu"):
        cfg.validate(spec)
        self.spec, self.cfg, self.seed, self.device = spec, cfg, seed, device

    def full(self, name: str) -> torch.Tensor:
        """The unsharded BF16 initial weight (on CPU)."""
        cfg, h = self.cfg, self.cfg.hidden
        shapes = {
            "mlp.w1": (cfg.dense_hidden, h), "mlp.w2": (h, cfg.dense_hidden), "router.weight": (cfg.experts, h),
            "experts.w1": (cfg.experts, cfg.expert_hidden, h), "experts.w2": (cfg.experts, h, cfg.expert_hidden),
            "tp_mlp.w1": (cfg.tp_hidden, h), "tp_mlp.w2": (h, cfg.tp_hidden),
        }
        seed = _seed("moe-init", self.seed, name)
        if name.startswith("ln"):
            noise = _randn((h,), seed) * 0.1
            return (1.0 + noise if name.endswith("weight") else noise).to(torch.bfloat16)
        shape = shapes[name]
        return (_randn(shape, seed) / shape[-1] ** 0.5).to(torch.bfloat16)

    def __call__(self, rank: int, param: ParamSpec) -> torch.Tensor:
        return shard(self.spec, rank, param.name, self.full(param.name)).to(self.device)


def shard(spec: ParallelSpec, rank: int, name: str, full: torch.Tensor) -> torch.Tensor:
    """The slice of the unsharded ``full`` weight that ``rank`` holds (itself for replicated parameters)."""
    if name not in _SHARDS:
        return full
    kind, dim = _SHARDS[name]
    group = spec.group_of(kind, rank)
    return full.chunk(len(group), dim=dim)[group.index(rank)].clone()


def unshard(spec: ParallelSpec, name: str, local: Callable[[int], torch.Tensor]) -> torch.Tensor:
    """The full weight assembled from the shards ``local(rank)`` of rank 0's TP or EP group."""
    if name not in _SHARDS:
        return local(0)
    kind, dim = _SHARDS[name]
    return torch.cat([local(r) for r in spec.group_of(kind, 0)], dim=dim)


def batch(cfg: MoEConfig, seed: int, step: int, micro: int, replica: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic BF16 tokens and targets of one DP replica (all its TP peers) for ``(step, micro)``."""
    g = torch.Generator().manual_seed(_seed("moe-batch", seed, step, micro, replica))
    x = torch.randn(cfg.tokens, cfg.hidden, generator=g, device="cpu")
    target = torch.randn(cfg.tokens, cfg.hidden, generator=g, device="cpu") * 0.5
    return x.to(torch.bfloat16), target.to(torch.bfloat16)


def replica_of(spec: ParallelSpec, rank: int) -> int:
    """The dense data-parallel replica (index of the TP group) that ``rank`` belongs to."""
    return spec.groups("tp").index(spec.group_of("tp", rank))


# -- the route-full part: identical on every TP peer --------------------------------------------------------


def route(w: dict[str, torch.Tensor], x: torch.Tensor, cfg: MoEConfig):
    """LN1, dense MLP, LN2 and the router: ``(h, b, gate [T, k], experts [T, k])``, in the weights' dtype."""
    h_dim = cfg.hidden
    a = F.layer_norm(x, (h_dim,), w["ln1.weight"], w["ln1.bias"], LN_EPS)
    h = x + F.linear(F.silu(F.linear(a, w["mlp.w1"])), w["mlp.w2"])
    b = F.layer_norm(h, (h_dim,), w["ln2.weight"], w["ln2.bias"], LN_EPS)
    probs = F.linear(b, w["router.weight"]).softmax(dim=-1)
    top, chosen = probs.topk(cfg.top_k, dim=-1)
    return h, b, top / top.sum(dim=-1, keepdim=True), chosen


def partition(experts: torch.Tensor, tp: int) -> list[torch.Tensor]:
    """Assignment ids (flat ``token * k + j``) each TP peer dispatches: stable per-expert ordinal mod ``tp``."""
    flat = experts.reshape(-1)
    order = torch.sort(flat, stable=True).indices
    ranked = flat[order]
    ordinal = torch.empty_like(order)
    ordinal[order] = torch.arange(flat.numel(), device=flat.device) - torch.searchsorted(ranked, ranked)
    return [torch.nonzero(ordinal % tp == peer).flatten() for peer in range(tp)]


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return inv


# -- collectives as autograd functions ---------------------------------------------------------------------


class _AllToAll(torch.autograd.Function):
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


class _CopyToTP(torch.autograd.Function):
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


class _ReduceFromTP(torch.autograd.Function):
    """Megatron's g: all_reduce (SUM) of the partial outputs over TP, identity backward."""

    @staticmethod
    def forward(ctx, x, comm: Comm, group: Group):
        out = x.contiguous().clone()
        comm.all_reduce(out, op=ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


# -- the folded forward --------------------------------------------------------------------------------------


def folded_loss(comm: Comm, w: dict[str, torch.Tensor], x: torch.Tensor, target: torch.Tensor,
                cfg: MoEConfig, scale: float = 1.0) -> torch.Tensor:
    """This rank's FP32 loss of the folded block (collectives inside); ``scale`` is DeepSpeed's ``1/gas``."""
    rank = comm.get_rank()
    tp_group, ep_group = comm.group("tp"), comm.group("ep")
    tp, tp_rank = tp_group.size, tp_group.rank_of(rank)
    ep = ep_group.size
    k, local_e = cfg.top_k, cfg.experts // ep
    h, b, gate, chosen = route(w, x, cfg)

    # partition-dispatch: this peer's slice of the (token, expert) assignments
    parts = partition(chosen, tp)
    mine = parts[tp_rank]
    experts = chosen.reshape(-1)[mine]
    send_order = torch.sort(experts, stable=True).indices  # by destination, then local expert
    counts = torch.bincount(experts, minlength=cfg.experts).view(ep, local_e)
    received = torch.empty_like(counts)
    comm.all_to_all_single(received, counts, group=ep_group)  # split sizes first
    in_splits, out_splits = counts.sum(1).tolist(), received.sum(1).tolist()
    send = b.index_select(0, (mine // k)[send_order])
    recv = _AllToAll.apply(send, comm, ep_group, out_splits, in_splits)

    # this EP rank's experts on the rows it received (every expert runs, also on zero rows)
    owner = torch.arange(local_e, device=counts.device).repeat(ep).repeat_interleave(received.reshape(-1))
    grouped = torch.sort(owner, stable=True).indices
    per_expert = torch.bincount(owner, minlength=local_e).tolist()
    rows = recv.index_select(0, grouped).split(per_expert)
    w1, w2 = w["experts.w1"], w["experts.w2"]
    outs = [F.linear(F.silu(F.linear(r, w1[e])), w2[e]) for e, r in enumerate(rows)]
    done = torch.cat(outs).index_select(0, _inverse(grouped))
    back = _AllToAll.apply(done, comm, ep_group, in_splits, out_splits)
    local_out = back.index_select(0, _inverse(send_order))  # in `mine` order

    # restore_combined: gather (expert output, gate weight) of every peer, combine by token
    payload = torch.cat([local_out, gate.reshape(-1)[mine].unsqueeze(1)], dim=1)
    if tp > 1:
        payload = RestoreGather.apply(payload, comm, tp_group, [int(p.numel()) for p in parts], tp_rank)
    full = payload.index_select(0, _inverse(torch.cat(parts)))  # assignment order
    y = (full[:, : cfg.hidden] * full[:, cfg.hidden :]).view(cfg.tokens, k, cfg.hidden).sum(dim=1)
    m = h + y

    # post-MoE LayerNorm and the TP-sharded MLP (Megatron f / g)
    c = F.layer_norm(m, (cfg.hidden,), w["ln3.weight"], w["ln3.bias"], LN_EPS)
    if tp > 1:
        c = _CopyToTP.apply(c, comm, tp_group)
    v = F.linear(F.silu(F.linear(c, w["tp_mlp.w1"])), w["tp_mlp.w2"])
    if tp > 1:
        v = _ReduceFromTP.apply(v, comm, tp_group)
    out = m + v
    return ((out.float() - target.float()) ** 2).mean() * scale


class MoEGradients:
    """`GradientSource`: BF16 local gradients of the folded MoE block, one forward/backward per micro-step.

    ``backward`` builds the block from the current low-precision weights
    ``lp``, runs the folded forward and backward (the dispatch and combine
    all-to-alls, the restore all-gather and its all-reduce backward, the TP
    MLP's all-reduces) and delivers each parameter's BF16 ``.grad``: from a
    ``register_post_accumulate_grad_hook`` during backward when ``hooks``,
    else after backward in parameter order. It returns this rank's loss (a
    float; `train_rank` ignores it). The loss is scaled by ``1/gas`` as
    DeepSpeed's engine does, and DP normalisation (``1/dp``) is the gradient
    path's, so the reduced gradient is that of the mean over DP replicas and
    micro-steps of the per-replica loss.

    A plain class: it pickles into `spawn_gloo` and torchrun processes.
    ``params`` and ``initial`` are what `train_rank` needs.
    """

    def __init__(self, spec: ParallelSpec, cfg: MoEConfig = MoEConfig(), seed: int = 0, gas: int = 1,
                 device: str = "cpu") -> None:
        cfg.validate(spec)
        self.spec, self.cfg, self.seed, self.gas, self.device = spec, cfg, seed, gas, device
        self.params = moe_params(spec, cfg)
        self.initial = MoEInitialWeights(spec, cfg, seed, device)

    @property
    def families(self) -> dict[str, Family]:
        return {p.name: p.family for p in self.params}

    def backward(self, comm, step, micro, lp, deliver, hooks) -> float:
        leaves = {p.name: lp[p.name].detach().requires_grad_(True) for p in self.params}
        if hooks:
            for name, leaf in leaves.items():
                leaf.register_post_accumulate_grad_hook(lambda p, name=name: deliver(name, p.grad))
        x, target = batch(self.cfg, self.seed, step, micro, replica_of(self.spec, comm.get_rank()))
        device = next(iter(lp.values())).device
        loss = folded_loss(comm, leaves, x.to(device), target.to(device), self.cfg, 1.0 / self.gas)
        loss.backward()
        if not hooks:
            for name, leaf in leaves.items():
                deliver(name, leaf.grad)
        return float(loss.item()) * self.gas


# -- the unsharded reference -------------------------------------------------------------------------------


def reference_gradients(
    spec: ParallelSpec,
    cfg: MoEConfig,
    weights: Callable[[int, str], torch.Tensor],
    seed: int,
    step: int,
    gas: int,
    dtype: torch.dtype = torch.float64,
) -> dict[tuple[int, str], torch.Tensor]:
    """``{(rank, param): gradient}`` of the unsharded block, as the DP-reduced gradient each rank should hold.

    The full-batch equivalent of the folded run: the gradient of
    ``(1/dp) sum_replicas (1/gas) sum_micro loss(replica, micro)`` where
    ``loss`` is one replica's mean squared error on its ``tokens`` tokens
    (the tokens every TP peer of the replica shares). Weights are
    ``weights(rank, name)`` (BF16, as the ranks hold them) assembled into full
    tensors; everything is computed in ``dtype`` with plain dense code: every
    expert on every token, no collectives. The routing decisions (which
    experts each token goes to) are taken from the BF16 `route`, the same
    computation every folded rank runs, because top-k is discontinuous: a
    re-derived FP64 routing could pick another expert on a near tie. Returned
    per rank: the full gradient for replicated parameters, the rank's TP shard
    or expert block for sharded ones.
    """
    names = [p.name for p in moe_params(spec, cfg)]
    bf16 = {n: unshard(spec, n, lambda r, n=n: weights(r, n).cpu()) for n in names}
    full = {n: t.to(dtype).requires_grad_(True) for n, t in bf16.items()}
    total = torch.zeros((), dtype=dtype)
    for micro in range(gas):
        for replica in range(spec.dp):
            x, target = batch(cfg, seed, step, micro, replica)
            with torch.no_grad():
                chosen = route(bf16, x, cfg)[3]
            total = total + _reference_loss(full, x.to(dtype), target.to(dtype), chosen, cfg) / (gas * spec.dp)
    total.backward()
    return {(r, n): shard(spec, r, n, full[n].grad) for r in range(spec.world_size) for n in names}


def _reference_loss(w, x, target, chosen, cfg: MoEConfig) -> torch.Tensor:
    hd = cfg.hidden
    a = F.layer_norm(x, (hd,), w["ln1.weight"], w["ln1.bias"], LN_EPS)
    h = x + F.linear(F.silu(F.linear(a, w["mlp.w1"])), w["mlp.w2"])
    b = F.layer_norm(h, (hd,), w["ln2.weight"], w["ln2.bias"], LN_EPS)
    probs = F.linear(b, w["router.weight"]).softmax(dim=-1)
    top = probs.gather(1, chosen)
    gate = top / top.sum(dim=-1, keepdim=True)
    every = torch.stack([F.linear(F.silu(F.linear(b, w["experts.w1"][e])), w["experts.w2"][e])
                         for e in range(cfg.experts)])  # [E, T, H]
    picked = every[chosen, torch.arange(cfg.tokens).unsqueeze(1)]  # [T, k, H]
    m = h + (gate.unsqueeze(-1) * picked).sum(dim=1)
    c = F.layer_norm(m, (hd,), w["ln3.weight"], w["ln3.bias"], LN_EPS)
    out = m + F.linear(F.silu(F.linear(c, w["tp_mlp.w1"])), w["tp_mlp.w2"])
    return ((out - target) ** 2).mean()


def gradient_errors(traces, spec: ParallelSpec, cfg: MoEConfig, seed: int, gas: int, initial,
                    stage: str = "dp_reduced") -> dict[str, float]:
    """Per parameter, the largest normwise relative error ``|g - ref| / |ref|`` over ranks and steps.

    ``traces`` are `train_rank` traces that captured ``stage`` (and ``param``
    for every step but the last); step ``s`` is checked against the reference
    at the weights the ranks held then (``initial`` for step 0).
    """
    from simdist.gradpath.probes import BOUNDARY

    steps = sorted({k[0] for k in traces[0].values if k[3] == stage})
    errors: dict[str, float] = {}
    params = {p.name: p for p in moe_params(spec, cfg)}
    for step in steps:
        if step == 0:
            def weights(r, n):
                return initial(r, params[n])
        else:
            def weights(r, n, step=step):
                return traces[r].get(step - 1, BOUNDARY, n, "param")
        ref = reference_gradients(spec, cfg, weights, seed, step, gas)
        for (rank, name), expected in ref.items():
            got = traces[rank].get(step, BOUNDARY, name, stage).double()
            err = float((got - expected).norm() / expected.norm())
            errors[name] = max(errors.get(name, 0.0), err)
    return errors
