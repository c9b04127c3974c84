"""#8913 at production shapes on DeepSpeed's real ``BF16_Optimizer``: shipped vs fixed vs an FP32 oracle, trained.

    python bench/production_engine.py [--models NAME,...] [--tp 2] [--world-size 4] [--gas 1] [--steps 3]
                                      [--tokens 4096] [--expert-rows 2] [--port 29531] [--json FILE]

What runs (one launch of ``--world-size`` gloo processes on 127.0.0.1 per model; AutoEP+AutoTP folding with
DeepSpeed's own ``build_folding_spec`` and group constructors, ``ep = 2``, ``etp = 1``): one MoE layer of a
catalogue model (`simdist.sources.production`) -- the router ``[experts, hidden]`` (and GPT-OSS's router bias)
and every RMSNorm weight of the layer **at full size**, and this rank's routed experts **sliced** to
``--expert-rows`` rows of their FFN (gate/up ``[rows, hidden]`` and down ``[rows, hidden]`` per expert; the
experts of the other EP ranks are frozen stand-ins of the same shape, so every router row gets a gradient).
Three copies of it train side by side for ``--steps`` optimizer steps of ``--gas`` micro-batches each:

* ``shipped``: DeepSpeed 0.19.8's ``BF16_Optimizer`` (wrapping ``torch.optim.AdamW``) driven micro-step by
  micro-step as the engine drives it -- ``backward_prologue``, a real autograd backward, ``backward_epilogue``
  (``update_hp_grads``, where the folding correction runs), at the boundary the engine's own folding pass
  (``DeepSpeedEngine._reduce_autoep_folding_tp_replicated_gradients``) and its DP reduction
  (``DeepSpeedEngine.buffered_allreduce_fallback``), both called on a stand-in engine, then ``step()``;
* ``fixed``: the same with the #8913 fix bound in (`simdist.cases.deepspeed.harness._staged_update_hp_grad`,
  the code of the exported ``fix.diff``);
* ``oracle``: no DeepSpeed code: FP32 masters, the same forward/backward on their BF16 copies, each local
  gradient widened to FP32, TP-corrected per family in FP32 on its own gloo groups (router and norms: FP32
  TP all-reduce then ``/tp``; experts ``/tp``), accumulated in FP32 over the micro-batches, then the FP32 DP
  average (all-reduce then ``* 1/dp``), then ``torch.optim.AdamW`` (``foreach=False``, the same settings).

Forward/backward per rank and micro-batch (the statistics of the inputs): ``--tokens`` tokens per DP rank
(identical on TP peers) of a residual stream ``x ~ N(0, 1) * s_c`` with a fixed per-channel scale
``s_c = exp(N(0, 0.5^2))`` (a few channels several times larger than the rest, as in trained residual
streams), BF16. ``h = RMSNorm(x) * input_layernorm``; every other norm of the layer normalises the first
``len`` channels of ``h`` (QK / low-rank norms); ``u = RMSNorm(h) * post_attention_layernorm`` is the MoE
input. The dense loss (a fixed random probe of every norm's output, summed over all tokens) is identical on TP
peers, as under folding; the MoE sees this TP peer's slice of the tokens (``u[tp_rank::tp]``, detached: under
folding the MoE input's gradient is gathered back before the norms, which this layer does not model), routes
each to its top-k experts (softmax in FP32, top-k weights renormalised), and its loss is a fixed random probe
of the combined expert output. The loss is divided by ``--gas`` as the engine does.

Reported per model and family, on rank 0's FP32 masters after every step (routers and norms are replicated,
so every rank holds the same): elements where shipped / fixed differ from the oracle, max and median
element-wise relative error ``|m - o| / |o|`` over the family, and the first step where some master is more
than one BF16 ulp (of the oracle's value) away; a table on stdout, the full record with ``--json``.
Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import types

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from simdist.sources.production import CATALOGUE, MoEShape, get_shape
from simdist.world.spec import ParallelSpec

VARIANTS = ("shipped", "fixed", "oracle")
EP = 2
ADAM = {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
"""AdamW settings of all three copies."""


def _family(name: str) -> str:
    """The row a parameter is reported under."""
    if name.startswith(("router", "attn")):
        return name
    return "experts" if name.startswith("experts") else "norm " + name.removesuffix(".weight")


def _family_of(name: str):
    """simdist's folding family of a parameter of `Layer` (`simdist.gradpath.families.Family`)."""
    from simdist.gradpath.families import Family

    if name.startswith("router"):
        return Family.ROUTER_GATE_REPLICATED
    if name.startswith("attn"):
        return Family.MODEL_PARALLEL
    return Family.EXPERT if name.startswith("experts") else Family.DENSE


def _init(shape: MoEShape, rank_experts: range, rows: int, seed: int, tp_rank: int = 0) -> dict[str, torch.Tensor]:
    """BF16 initial weights, the same on every rank for replicated parameters (seeded by name); this TP rank's
    shard of the attention projection slice."""

    def draw(tag: int, size: tuple[int, ...], std: float, mean: float = 0.0) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed * 1_000_003 + tag)
        return (torch.randn(size, generator=g) * std + mean).to(torch.bfloat16)

    hidden, experts = shape.hidden.value, shape.experts.value
    out = {"router.weight": draw(1, (experts, hidden), 0.02)}
    if shape.router_bias:
        out["router.bias"] = draw(2, (experts,), 0.02)
    for i, (name, f) in enumerate(shape.norms):
        out[f"{name}.weight"] = draw(10 + i, (f.value,), 0.02, 1.0)
    out["attn.q_proj.weight"] = draw(100 + tp_rank, (rows, hidden), hidden**-0.5)
    local = list(rank_experts)
    out["experts.w_in"] = torch.stack([draw(1000 + e, (rows, hidden), hidden**-0.5) for e in local])
    out["experts.w_out"] = torch.stack([draw(500_000 + e, (rows, hidden), rows**-0.5) for e in local])
    return out


def _stand_ins(shape: MoEShape, rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every expert's initial slice (frozen stand-ins for the experts other EP ranks hold)."""
    every = _init(shape, range(shape.experts.value), rows, seed)
    return every["experts.w_in"], every["experts.w_out"]


def _rmsnorm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """RMSNorm as Hugging Face's Llama-family layers compute it (FP32 statistics, BF16 weight product)."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)
    return weight * x32.to(weight.dtype)


class Layer:
    """One rank's MoE layer over a dict of BF16 parameters (``params``) and the frozen expert stand-ins."""

    def __init__(self, shape: MoEShape, params: dict[str, torch.Tensor], stand_ins, local: range, top_k: int):
        self.shape, self.params, self.local, self.top_k = shape, params, local, top_k
        self.stand_in_in, self.stand_in_out = stand_ins

    def loss(self, x: torch.Tensor, probes: dict[str, torch.Tensor], tp_rank: int, tp: int) -> torch.Tensor:
        p = self.params
        h = _rmsnorm(x, p["input_layernorm.weight"])
        dense = (h.float() * probes["input_layernorm"]).sum()
        for name, f in self.shape.norms:
            if name in ("input_layernorm", "post_attention_layernorm"):
                continue
            z = _rmsnorm(h[:, : f.value], p[f"{name}.weight"])
            dense = dense + (z.float() * probes[name]).sum()
        dense = dense + ((h.detach() @ p["attn.q_proj.weight"].t()).float() * probes["q_proj"]).sum()
        u = _rmsnorm(h, p["post_attention_layernorm.weight"])
        dense = dense + (u.float() * probes["post_attention_layernorm"]).sum()
        mine = u[tp_rank::tp].detach()
        logits = mine @ p["router.weight"].t()
        if "router.bias" in p:
            logits = logits + p["router.bias"]
        weights, chosen = torch.softmax(logits.float(), dim=-1).topk(self.top_k, dim=-1)
        weights = (weights / weights.sum(-1, keepdim=True)).to(torch.bfloat16)
        out = torch.zeros_like(mine)
        for e in chosen.unique().tolist():
            token, slot = (chosen == e).nonzero(as_tuple=True)
            if e in self.local:
                w_in, w_out = p["experts.w_in"][e - self.local.start], p["experts.w_out"][e - self.local.start]
            else:
                w_in, w_out = self.stand_in_in[e], self.stand_in_out[e]
            y = torch.nn.functional.silu(mine[token] @ w_in.t()) @ w_out
            out = out.index_add(0, token, y * weights[token, slot].unsqueeze(-1))
        moe = (out.float() * probes["moe"][tp_rank::tp]).sum()
        return (dense + moe) / x.shape[0]


def _tokens(shape: MoEShape, tokens: int, seed: int, step: int, micro: int, dp_rank: int) -> torch.Tensor:
    hidden = shape.hidden.value
    scale = torch.exp(torch.randn(hidden, generator=torch.Generator().manual_seed(seed + 7)) * 0.5)
    g = torch.Generator().manual_seed(((seed * 1009 + step) * 1009 + micro) * 1009 + dp_rank)
    return (torch.randn((tokens, hidden), generator=g) * scale).to(torch.bfloat16)


def _probes(shape: MoEShape, tokens: int, seed: int, rows: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed + 11)
    hidden = shape.hidden.value
    out = {name: torch.randn((tokens, f.value), generator=g) for name, f in shape.norms}
    out["moe"] = torch.randn((tokens, hidden), generator=g)
    out["q_proj"] = torch.randn((tokens, rows), generator=g)
    return out


def _bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    _, exponent = torch.frexp(x)
    return torch.ldexp(torch.ones_like(x), (exponent - 8).to(torch.int32)).where(x != 0, torch.tensor(2.0**-133))


def _compare(masters: dict[str, torch.Tensor], oracle: dict[str, torch.Tensor]) -> dict[str, dict]:
    """Per family: elements differing from the oracle (raw bits), max/median relative error, > 1 BF16 ulp."""
    by_family: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for name, m in masters.items():
        by_family.setdefault(_family(name), []).append((m.flatten(), oracle[name].flatten()))
    out = {}
    for family, pairs in by_family.items():
        m = torch.cat([a for a, _ in pairs])
        o = torch.cat([b for _, b in pairs])
        differ = m.view(torch.int32) != o.view(torch.int32)
        error = (m.double() - o.double()).abs()
        relative = error / o.double().abs().clamp_min(2.0**-126)
        out[family] = {
            "elements": m.numel(),
            "differing": int(differ.sum()),
            "max_rel": float(relative.max()),
            "median_rel": float(relative.median()),
            "over_1_ulp": int((error > _bf16_ulp(o).double()).sum()),
        }
    return out


def setup_ranks(rank: int, spec: ParallelSpec, shape: MoEShape) -> types.SimpleNamespace:
    """DeepSpeed's comm layer and folding groups on this rank (checked against ``spec``), the oracles' own gloo
    groups, this rank's coordinates and routed experts."""
    import importlib
    import logging

    from deepspeed import comm as ds_comm
    from deepspeed.module_inject.auto_ep_folding import build_folding_spec, local_folding_ranks
    from deepspeed.utils import groups, logger

    logger.setLevel(logging.ERROR)
    vars(importlib.import_module("deepspeed.comm.torch"))["build_shm_op"] = lambda: None
    ds_comm.init_distributed(dist_backend="gloo", dist_init_required=False, verbose=False)
    world, tp = spec.world_size, spec.tp
    folding = build_folding_spec(world_size=world, pp_size=1, tp_size=tp, ep_size=EP, etp_size=1, mp_mode="tp")
    groups._init_tp_groups_with_new_group(tp)
    groups._create_expert_and_data_parallel(EP, mp_size=tp, pp_size=1, mp_mode="tp", folding_spec=folding)
    groups.mpu = groups  # what the engine's AutoTP set-up does (``self.mpu = groups``, then ``groups.mpu = self.mpu``)
    theirs = local_folding_ranks(rank, folding)
    for kind, mine in {"tp": "tp", "dense_dp": "dp", "ep": "ep", "edp": "edp"}.items():
        if tuple(sorted(theirs[kind])) != spec.group_of(mine, rank):
            raise RuntimeError(f"DeepSpeed's {kind} group {theirs[kind]} != simdist's {spec.group_of(mine, rank)}")
    if dist.get_world_size(groups._get_sequence_data_parallel_group()) != spec.dp:
        raise RuntimeError("DeepSpeed's DP reduction group is not the dense DP group")
    # the oracles' own groups (every rank creates every group, in the same order)
    own = {kind: {g: dist.new_group(list(g)) for g in spec.groups(kind)} for kind in ("tp", "dp", "edp")}
    per_ep = shape.experts.value // EP
    ep_rank = spec.group_of("ep", rank).index(rank)
    return types.SimpleNamespace(
        rank=rank,
        spec=spec,
        folding=folding,
        tp_group=own["tp"][spec.group_of("tp", rank)],
        dp_group=own["dp"][spec.group_of("dp", rank)],
        edp_group=own["edp"][spec.group_of("edp", rank)],
        tp_rank=spec.group_of("tp", rank).index(rank),
        dp_rank=spec.group_of("dp", rank).index(rank),
        local=range(ep_rank * per_ep, (ep_rank + 1) * per_ep),
    )


def deepspeed_copies(setup, shape: MoEShape, args) -> dict[str, dict]:
    """``{"shipped": ..., "fixed": ...}``: each a real ``BF16_Optimizer`` (wrapping ``torch.optim.AdamW``) over
    its own copy of the layer's BF16 parameters, with a stand-in engine whose folding pass and DP reduction are
    DeepSpeedEngine's own methods; ``fixed`` has the #8913 fix bound in."""
    init = _init(shape, setup.local, args.expert_rows, args.seed, setup.tp_rank)
    families = {name: _family_of(name) for name in init}
    return {variant: _deepspeed_copy(variant, init, families, setup) for variant in ("shipped", "fixed")}


def _deepspeed_copy(variant: str, init: dict[str, torch.Tensor], families: dict, setup) -> dict:
    """One copy of `deepspeed_copies`: its parameters, its ``BF16_Optimizer`` and its stand-in engine."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config
    from deepspeed.utils import groups

    from simdist.cases.deepspeed.harness import _staged_update_hp_grad, mark_family
    from simdist.gradpath.families import Family

    params = {n: torch.nn.Parameter(t.clone()) for n, t in init.items()}
    for n, p in params.items():
        mark_family(p, families[n], EP)
    dense = [p for n, p in params.items() if families[n] is not Family.EXPERT]
    experts = [p for n, p in params.items() if families[n] is Family.EXPERT]
    optimizer = BF16_Optimizer(
        torch.optim.AdamW(
            [{"params": dense}, {"params": experts, "moe": True, "name": f"ep_size_{EP}"}], foreach=False, **ADAM
        ),
        {p: n for n, p in params.items()},
        DeepSpeedBF16Config(enabled=True),
        dp_process_group=groups.get_data_parallel_group(),
        grad_acc_dtype=torch.float32,
        has_moe_layers=True,
        mpu=groups,
    )
    optimizer.configure_autoep_folding_tp_gradient_reduction(setup.folding)
    if variant == "fixed":
        optimizer._update_hp_grad = types.MethodType(_staged_update_hp_grad, optimizer)
    return {"params": params, "optimizer": optimizer, "engine": _stand_in_engine(setup, optimizer, params)}


def _stand_in_engine(setup, optimizer, params: dict[str, torch.nn.Parameter]) -> types.SimpleNamespace:
    """The attributes DeepSpeedEngine's folding pass and DP reduction read, with those methods bound to it."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    engine = types.SimpleNamespace(
        _autoep_folding_spec=setup.folding,
        optimizer=optimizer,
        module=_module(params),
        zero_optimization_partition_weights=lambda: False,
        has_moe_layers=True,
        pipeline_parallelism=False,
        sequence_parallel_size=1,
        communication_data_type=torch.float32,
        gradient_average=True,
        postscale_gradients=lambda: True,
        gradient_predivide_factor=lambda: 1.0,
    )
    engine.flatten, engine.unflatten = _flatten_dense_tensors, _unflatten_dense_tensors
    for method in (
        "allreduce_bucket",
        "allreduce_and_copy",
        "allreduce_no_retain",
        "_reduce_non_expert_gradients",
        "_reduce_expert_gradients",
        "buffered_allreduce_fallback",
        "_reduce_autoep_folding_tp_replicated_gradients",
    ):
        setattr(engine, method, types.MethodType(getattr(DeepSpeedEngine, method), engine))
    return engine


def deepspeed_micro_step(c: dict, shape: MoEShape, stand_ins, setup, x, probes, gas: int, boundary: bool) -> None:
    """One micro-step as DeepSpeed's engine runs it: prologue, backward, epilogue; at the boundary the engine's
    folding pass and DP reduction (the optimizer step is the caller's)."""
    layer = Layer(shape, dict(c["params"]), stand_ins, setup.local, shape.top_k.value)
    c["optimizer"].backward_prologue()
    (layer.loss(x, probes, setup.tp_rank, setup.spec.tp) / gas).backward()
    c["optimizer"].backward_epilogue()
    if boundary:
        c["engine"]._reduce_autoep_folding_tp_replicated_gradients()
        c["engine"].buffered_allreduce_fallback()


def _rank(rank: int, args, model: str, results) -> None:
    """One rank: the three copies of ``model``'s layer trained side by side; rank 0 appends the record."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    dist.init_process_group("gloo", rank=rank, world_size=args.world_size)
    torch.set_num_threads(1)
    spec = ParallelSpec(args.world_size, tp=args.tp, ep=EP)
    shape = get_shape(model)
    setup = setup_ranks(rank, spec, shape)
    init = _init(shape, setup.local, args.expert_rows, args.seed, setup.tp_rank)
    stand_ins = _stand_ins(shape, args.expert_rows, args.seed)
    probes = _probes(shape, args.tokens, args.seed, args.expert_rows)
    families = {name: _family_of(name) for name in init}
    copies = deepspeed_copies(setup, shape, args)
    masters = {n: torch.nn.Parameter(t.float()) for n, t in init.items()}
    oracle_adam = torch.optim.AdamW(list(masters.values()), foreach=False, **ADAM)

    record: list[dict] = []
    stats: dict[str, float] = {}
    for step in range(args.steps):
        started = time.perf_counter()
        accumulated = {n: torch.zeros_like(m) for n, m in masters.items()}
        for micro in range(args.gas):
            x = _tokens(shape, args.tokens, args.seed, step, micro, setup.dp_rank)
            if step == 0 and micro == 0:
                stats = {"x_rms": float(x.float().pow(2).mean().sqrt()), "x_absmax": float(x.float().abs().max())}
            for c in copies.values():
                deepspeed_micro_step(c, shape, stand_ins, setup, x, probes, args.gas, micro == args.gas - 1)
            low = {n: m.detach().to(torch.bfloat16).requires_grad_() for n, m in masters.items()}
            layer = Layer(shape, low, stand_ins, setup.local, shape.top_k.value)
            (layer.loss(x, probes, setup.tp_rank, args.tp) / args.gas).backward()
            _oracle_accumulate(accumulated, low, families, setup, args, micro)
        _oracle_update(masters, accumulated, families, setup, oracle_adam)
        entry = _deepspeed_update(copies, masters, step)
        record.append(entry)
        if rank == 0:
            router = entry["shipped"]["router.weight"]  # type: ignore[index]
            print(
                f"[{model} TP{args.tp} GAS{args.gas}] step {step + 1}/{args.steps} "
                f"({time.perf_counter() - started:.1f} s): shipped router masters differing {router['differing']}",
                file=sys.stderr,
                flush=True,
            )
    if rank == 0:
        results.append(
            {
                "model": model,
                "tp": args.tp,
                "world": args.world_size,
                "gas": args.gas,
                "steps": args.steps,
                "tokens": args.tokens,
                "expert_rows": args.expert_rows,
                "stats": stats,
                "record": record,
            }
        )
    for c in copies.values():
        c["optimizer"].destroy()
    dist.barrier()
    dist.destroy_process_group()


def _oracle_accumulate(accumulated: dict, low: dict, families: dict, setup, args, micro: int) -> None:
    """The oracle's micro-step: each BF16 local gradient widened to FP32, TP-corrected per family in FP32 (under
    ``--marker deepspeed`` only at micro-step 0), added to ``accumulated``."""
    from simdist.gradpath.families import Family

    for n, lp in low.items():
        grad = lp.grad.float()
        corrected = args.marker == "per_micro_step" or micro == 0  # ``--marker deepspeed``: micro-step 0
        if families[n] is Family.EXPERT and corrected:
            grad = grad / args.tp
        elif families[n] is not Family.MODEL_PARALLEL and corrected:
            # router and norms: FP32 TP all-reduce, then /tp
            dist.all_reduce(grad, group=setup.tp_group)
            grad = grad / args.tp
        accumulated[n] += grad


def _oracle_update(masters: dict, accumulated: dict, families: dict, setup, oracle_adam) -> None:
    """The oracle's boundary: the FP32 DP average of ``accumulated`` (all-reduce, then ``* 1/dp``), AdamW's step."""
    from simdist.gradpath.families import Family

    for n, grad in accumulated.items():
        dist.all_reduce(grad, group=setup.edp_group if families[n] is Family.EXPERT else setup.dp_group)
        masters[n].grad = grad * (1.0 / setup.spec.dp)
    oracle_adam.step()
    oracle_adam.zero_grad(set_to_none=True)


def _deepspeed_update(copies: dict[str, dict], masters: dict, step: int) -> dict[str, object]:
    """Each DeepSpeed copy's optimizer step; the step's record entry: its FP32 masters against the oracle's."""
    from deepspeed.utils import safe_get_full_fp32_param

    entry: dict[str, object] = {"step": step + 1}
    oracle_now = {n: m.detach().clone() for n, m in masters.items()}
    for variant in ("shipped", "fixed"):
        c = copies[variant]
        c["optimizer"].step()
        c["optimizer"].clear_lp_grads()
        full = {}
        for n, p in c["params"].items():
            value = safe_get_full_fp32_param(p)
            full[n] = value.detach().clone()
        entry[variant] = _compare(full, oracle_now)
    return entry


def _module(params: dict[str, torch.nn.Parameter]) -> torch.nn.Module:
    """A module whose ``named_parameters()`` are ``params`` under their dotted names (the engine's pass walks it)."""
    root = torch.nn.Module()
    for name, param in params.items():
        *path, leaf = name.split(".")
        owner = root
        for part in path:
            if not hasattr(owner, part):
                owner.add_module(part, torch.nn.Module())
            owner = getattr(owner, part)
        owner.register_parameter(leaf, param)
    return root


def summary(result: dict) -> list[dict]:
    """One row per family: last step's figures and the first step more than one BF16 ulp off, per variant."""
    rows = []
    last = result["record"][-1]
    for family in last["shipped"]:
        row = {
            "model": result["model"],
            "layout": f"TP{result['tp']}/EP{EP} on {result['world']}",
            "gas": result["gas"],
            "steps": result["steps"],
            "family": family,
            "elements": last["shipped"][family]["elements"],
        }
        for variant in ("shipped", "fixed"):
            figures = last[variant][family]
            first = next((e["step"] for e in result["record"] if e[variant][family]["over_1_ulp"]), None)
            row[variant] = {**figures, "first_step_over_1_ulp": first}
        rows.append(row)
    return rows


def table(results: list[dict]) -> str:
    lines = [
        "| model | layout | GAS | steps | family | elements | shipped differing | shipped max rel | shipped median rel "
        "| shipped > 1 BF16 ulp | first step > 1 ulp (shipped) | fixed differing | fixed max rel "
        "| first step > 1 ulp (fixed) |",
        "|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for result in results:
        for r in summary(result):
            s, f = r["shipped"], r["fixed"]
            lines.append(
                f"| {r['model']} | {r['layout']} | {r['gas']} | {r['steps']} | {r['family']} | {r['elements']} "
                f"| {s['differing']} | {s['max_rel']:.3g} | {s['median_rel']:.3g} | {s['over_1_ulp']} "
                f"| {s['first_step_over_1_ulp'] or '-'} | {f['differing']} | {f['max_rel']:.3g} "
                f"| {f['first_step_over_1_ulp'] or '-'} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(CATALOGUE), help="comma-separated catalogue names")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--gas", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per DP rank per micro-batch")
    parser.add_argument("--expert-rows", type=int, default=2, help="rows of each expert's FFN held")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--port", type=int, default=29531)
    parser.add_argument(
        "--marker",
        choices=("per_micro_step", "deepspeed"),
        default="per_micro_step",
        help="the oracle's TP correction: every micro-step (intended), or only micro-step 0 as DeepSpeed 0.19.8's "
        "correction-once marker does on the epilogue path at GAS >= 2 (isolates #8913 from that defect)",
    )
    parser.add_argument("--json", help="also write the full per-step record here")
    args = parser.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    for m in models:
        get_shape(m)
    ParallelSpec(args.world_size, tp=args.tp, ep=EP)  # a clear error for a layout that does not fit
    if args.tokens % args.tp:
        parser.error(f"--tokens {args.tokens} must split evenly over --tp {args.tp}")
    results = mp.Manager().list()
    for i, model in enumerate(models):
        print(f"[{model}] launching {args.world_size} gloo processes", file=sys.stderr, flush=True)
        run = argparse.Namespace(**{**vars(args), "port": args.port + i})
        mp.spawn(_rank, args=(run, model, results), nprocs=args.world_size)
    results = list(results)
    print(
        f"# #8913 on DeepSpeed's real BF16_Optimizer: TP{args.tp}/EP{EP}/ETP1 on {args.world_size} gloo processes, "
        f"GAS {args.gas}, {args.steps} steps, {args.tokens} tokens per DP rank per micro-batch, experts sliced to "
        f"{args.expert_rows} FFN rows; oracle TP correction: {args.marker}"
    )
    for r in results:
        print(f"# {r['model']}: x rms {r['stats']['x_rms']:.3f}, max |x| {r['stats']['x_absmax']:.2f}")
    print(table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
