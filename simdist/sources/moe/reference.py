"""The unsharded FP64 reference of the block, and the error of a folded run's gradients against it."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from simdist.gradpath.probes import BOUNDARY
from simdist.sources.moe.block import LN_EPS, route
from simdist.sources.moe.layout import MoEConfig, batch, moe_params, shard, unshard
from simdist.world.spec import ParallelSpec


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

    def on_cpu(name: str) -> Callable[[int], torch.Tensor]:
        return lambda r: weights(r, name).cpu()

    bf16 = {n: unshard(spec, n, on_cpu(n), cfg) for n in names}
    full = {n: t.to(dtype).requires_grad_(True) for n, t in bf16.items()}
    total = torch.zeros((), dtype=dtype)
    for micro in range(gas):
        for replica in range(spec.dp):
            x, target = batch(cfg, seed, step, micro, replica)
            with torch.no_grad():
                chosen = route(bf16, x, cfg)[3]
            total = total + _reference_loss(full, x.to(dtype), target.to(dtype), chosen, cfg) / (gas * spec.dp)
    total.backward()
    return {(r, n): shard(spec, r, n, _grad(full[n]), cfg) for r in range(spec.world_size) for n in names}


def _grad(t: torch.Tensor) -> torch.Tensor:
    """``t.grad`` after the reference backward (every parameter takes part in the loss)."""
    assert t.grad is not None, "a parameter took no part in the reference loss"
    return t.grad


def _reference_loss(w, x, target, chosen, cfg: MoEConfig) -> torch.Tensor:
    hd = cfg.hidden
    a = F.layer_norm(x, (hd,), w["ln1.weight"], w["ln1.bias"], LN_EPS)
    h = x + F.linear(F.silu(F.linear(a, w["mlp.w1"])), w["mlp.w2"])
    b = F.layer_norm(h, (hd,), w["ln2.weight"], w["ln2.bias"], LN_EPS)
    probs = F.linear(b, w["router.weight"]).softmax(dim=-1)
    top = probs.gather(1, chosen)
    gate = top / top.sum(dim=-1, keepdim=True)
    every = torch.stack(
        [F.linear(F.silu(F.linear(b, w["experts.w1"][e])), w["experts.w2"][e]) for e in range(cfg.experts)]
    )  # [E, T, H]
    picked = every[chosen, torch.arange(cfg.tokens).unsqueeze(1)]  # [T, k, H]
    m = h + (gate.unsqueeze(-1) * picked).sum(dim=1)
    c = F.layer_norm(m, (hd,), w["ln3.weight"], w["ln3.bias"], LN_EPS)
    out = m + F.linear(F.silu(F.linear(c, w["tp_mlp.w1"])), w["tp_mlp.w2"])
    return ((out - target) ** 2).mean()


def gradient_errors(
    traces, spec: ParallelSpec, cfg: MoEConfig, seed: int, gas: int, initial, stage: str = "dp_reduced"
) -> dict[str, float]:
    """Per parameter, the largest normwise relative error ``|g - ref| / |ref|`` over ranks and steps.

    ``traces`` are `train_rank` traces that captured ``stage`` (and ``param``
    for every step but the last); step ``s`` is checked against the reference
    at the weights the ranks held then (``initial`` for step 0).
    """
    steps = sorted({k[0] for k in traces[0].values if k[3] == stage})
    errors: dict[str, float] = {}
    params = {p.name: p for p in moe_params(spec, cfg)}
    for step in steps:

        def weights(r, n, step=step):
            if step == 0:
                return initial(r, params[n])
            return traces[r].get(step - 1, BOUNDARY, n, "param")

        ref = reference_gradients(spec, cfg, weights, seed, step, gas)
        for (rank, name), expected in ref.items():
            got = traces[rank].get(step, BOUNDARY, name, stage).double()
            err = float((got - expected).norm() / expected.norm())
            errors[name] = max(errors.get(name, 0.0), err)
    return errors
