"""The folded forward of the block: route-full (every TP peer), partition-dispatch over EP, the experts,
restore_combined over TP, then the TP-sharded MLP. See `simdist.sources.moe` for the semantics."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from simdist.sources.moe.collectives import AllToAll, CopyToTP, ReduceFromTP, RestoreGather
from simdist.sources.moe.layout import MoEConfig
from simdist.world.groups import Comm

LN_EPS = 1e-5


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


def folded_loss(
    comm: Comm, w: dict[str, torch.Tensor], x: torch.Tensor, target: torch.Tensor, cfg: MoEConfig, scale: float = 1.0
) -> torch.Tensor:
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
    recv = AllToAll.apply(send, comm, ep_group, out_splits, in_splits)

    # this EP rank's experts on the rows it received (every expert runs, also on zero rows)
    owner = torch.arange(local_e, device=counts.device).repeat(ep).repeat_interleave(received.reshape(-1))
    grouped = torch.sort(owner, stable=True).indices
    per_expert = torch.bincount(owner, minlength=local_e).tolist()
    rows = recv.index_select(0, grouped).split(per_expert)
    w1, w2 = w["experts.w1"], w["experts.w2"]
    outs = [F.linear(F.silu(F.linear(r, w1[e])), w2[e]) for e, r in enumerate(rows)]
    done = torch.cat(outs).index_select(0, _inverse(grouped))
    back = AllToAll.apply(done, comm, ep_group, in_splits, out_splits)
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
        c = CopyToTP.apply(c, comm, tp_group)
    v = F.linear(F.silu(F.linear(c, w["tp_mlp.w1"])), w["tp_mlp.w2"])
    if tp > 1:
        v = ReduceFromTP.apply(v, comm, tp_group)
    out = m + v
    return ((out.float() - target.float()) ** 2).mean() * scale
