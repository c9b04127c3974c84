"""The #8913 report's validation, replicated: three BF16 updates on four ranks TP2/EP2/ETP1, every per-rank tensor.

    python bench/report_validation.py [--model OLMoE-1B-7B] [--tokens 256] [--steps 3] [--port 29571]

The report validated its fix by "three BF16 updates on four ranks for TP2/EP2/ETP1, comparing 66 tensors per
rank, including router/expert gradients, FP32 masters and Adam moments", against "native Megatron
model/optimizer code with a harness's explicit FP32 TP-then-DP/per-parameter reducer". Its harness is not
public; this script rebuilds that validation on four gloo processes with one MoE layer of a catalogue model
(`bench/production_engine.py`'s `Layer`: the router and the norms at full size, the attention projection and
this rank's experts sliced to ``--expert-rows`` rows). Four implementations train it side by side on every
rank, from the same BF16 initial weights and the same tokens:

* **DeepSpeed shipped** and **DeepSpeed fixed**: DeepSpeed 0.19.8's ``BF16_Optimizer`` driven as its engine
  drives it (`production_engine`'s copies: folding correction, the engine's folding pass and DP reduction);
* **Megatron oracle**: Megatron-Core's native mixed-precision optimizer
  (``megatron.core.optimizer.Float16OptimizerWithFloat16Params``: FP32 main parameters, the gradient taken
  from ``param.main_grad``, ``torch.optim.AdamW`` inside, main -> model BF16 copy), fed by an explicit FP32
  TP-then-DP per-parameter reducer written here (router and norms: FP32 TP all-reduce then ``/tp``; experts
  ``/tp``; then the FP32 DP all-reduce of each parameter on its own and ``* 1/dp``);
* **simdist oracle**: `simdist.gradpath.oracle.Oracle` (its own FP32 TP-then-DP reducer over simulated
  groups in gloo's order, ``torch.optim.AdamW`` over one flat master), fed every rank's local gradients from
  the same forward on its own BF16 weights.

Not the report's harness: the layer is `Layer` (simdist-written, the same forward for all four), not
Megatron's MoE modules; Megatron's optimizer needs CUDA parameters and is given CPU ones that answer
``type()`` as CUDA tensors (`_CudaTyped`), and its unity loss scale, allocated with ``device='cuda'``, is made
on the CPU while it is constructed (its arithmetic is untouched).

Compared per rank, after each update, per parameter: the reduced FP32 gradient the optimizer consumed, the FP32
master, Adam's ``exp_avg`` and ``exp_avg_sq`` -- ``4 x params x steps`` tensors per rank, listed on stdout --
bit for bit: DeepSpeed fixed vs Megatron oracle, DeepSpeed shipped vs Megatron oracle, Megatron oracle vs
simdist oracle.
"""

from __future__ import annotations

import argparse
import os
import sys
import types
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import production_engine as pe

from simdist.sources.production import MoEShape, get_shape
from simdist.world.spec import ParallelSpec

KINDS = ("grad", "master", "exp_avg", "exp_avg_sq")
IMPLEMENTATIONS = ("shipped", "fixed", "megatron", "simdist")


class _CudaTyped(torch.nn.Parameter):
    """A CPU parameter whose ``type()`` names the CUDA type: Megatron's mixed-precision optimizer accepts only
    CUDA parameters by that string; nothing else about the tensor changes."""

    def type(self, dtype=None, non_blocking=False, **kwargs):  # type: ignore[override]
        if dtype is None:
            return super().type().replace("torch.", "torch.cuda.", 1)
        return super().type(dtype, non_blocking, **kwargs)


def _megatron_optimizer(params: dict[str, torch.nn.Parameter]):
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    inner = torch.optim.AdamW(list(params.values()), foreach=False, **pe.ADAM)
    config = OptimizerConfig(
        optimizer="adam",
        lr=pe.ADAM["lr"],
        weight_decay=pe.ADAM["weight_decay"],
        adam_beta1=pe.ADAM["betas"][0],
        adam_beta2=pe.ADAM["betas"][1],
        adam_eps=pe.ADAM["eps"],
        bf16=True,
        clip_grad=0.0,
    )
    real_tensor = torch.tensor

    def on_cpu(*args, device=None, **kwargs):  # the unity loss scale it allocates with device='cuda'
        return real_tensor(*args, device="cpu" if device == "cuda" else device, **kwargs)

    torch.tensor = on_cpu  # type: ignore[assignment]
    try:
        return Float16OptimizerWithFloat16Params(inner, config, None, lambda *args, **kwargs: None)
    finally:
        torch.tensor = real_tensor  # type: ignore[assignment]


@dataclass
class _Workload:
    """What the four implementations on one rank share: the layer, the layout, the tokens' settings."""

    args: argparse.Namespace
    shape: MoEShape
    spec: ParallelSpec
    setup: types.SimpleNamespace
    stand_ins: dict
    probes: dict

    def local_of(self, r: int) -> range:
        """The experts rank ``r`` holds."""
        per_ep = self.shape.experts.value // pe.EP
        ep_rank = self.spec.group_of("ep", r).index(r)
        return range(ep_rank * per_ep, (ep_rank + 1) * per_ep)

    def init_of(self, r: int) -> dict[str, torch.Tensor]:
        """Rank ``r``'s BF16 initial weights."""
        a = self.args
        return pe._init(self.shape, self.local_of(r), a.expert_rows, a.seed, self.spec.group_of("tp", r).index(r))

    def tokens(self, step: int, dp_rank: int) -> torch.Tensor:
        return pe._tokens(self.shape, self.args.tokens, self.args.seed, step, 0, dp_rank)

    def layer(self, weights: dict, local: range) -> pe.Layer:
        return pe.Layer(self.shape, weights, self.stand_ins, local, self.shape.top_k.value)


def _rank(rank: int, args, results) -> None:
    """One rank: the four implementations trained side by side; its rows (one per Megatron tensor) appended."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    dist.init_process_group("gloo", rank=rank, world_size=4)
    torch.set_num_threads(1)
    shape = get_shape(args.model)
    spec = ParallelSpec(4, tp=2, ep=pe.EP)
    setup = pe.setup_ranks(rank, spec, shape)
    copies = pe.deepspeed_copies(setup, shape, args)
    probes = pe._probes(shape, args.tokens, args.seed, args.expert_rows)
    stand_ins = pe._stand_ins(shape, args.expert_rows, args.seed)
    work = _Workload(args, shape, spec, setup, stand_ins, probes)
    init = work.init_of(rank)
    families = {n: pe._family_of(n) for n in init}
    megatron_params = {n: _CudaTyped(t.clone()) for n, t in init.items()}
    megatron = _megatron_optimizer(megatron_params)
    oracle, specs = _simdist_oracle(work, init, families)

    captured: dict[tuple[int, str, str, str], torch.Tensor] = {}
    for step in range(args.steps):
        x = work.tokens(step, setup.dp_rank)
        _deepspeed_update(captured, step, copies, work, x)
        _megatron_update(captured, step, megatron, megatron_params, families, work, x)
        _simdist_update(captured, step, oracle, specs, work, init, rank)
        if rank == 0:
            print(f"[validation] update {step + 1}/{args.steps} done", file=sys.stderr, flush=True)
    results.extend(_rows(captured, rank))
    for c in copies.values():
        c["optimizer"].destroy()
    dist.barrier()
    dist.destroy_process_group()


def _simdist_oracle(work: _Workload, init: dict[str, torch.Tensor], families: dict):
    """The simdist oracle over every rank, simulated in this process (this rank's slice is compared), and its
    parameters' specs."""
    from simdist.gradpath.families import ParamSpec
    from simdist.gradpath.oracle import AdamWSettings, Oracle
    from simdist.reduce import make_reduction

    specs = [ParamSpec(n, families[n], tuple(t.shape)) for n, t in init.items()]
    initial = {(r, n): t for r in range(4) for n, t in work.init_of(r).items()}
    adam = AdamWSettings(
        lr=pe.ADAM["lr"],
        beta1=pe.ADAM["betas"][0],
        beta2=pe.ADAM["betas"][1],
        eps=pe.ADAM["eps"],
        weight_decay=pe.ADAM["weight_decay"],
    )
    oracle = Oracle(
        work.spec, specs, initial, tp_reduction=make_reduction("gloo"), dp_reduction=make_reduction("gloo"), adam=adam
    )
    return oracle, specs


def _deepspeed_update(captured: dict, step: int, copies: dict[str, dict], work: _Workload, x) -> None:
    """Each DeepSpeed copy's micro-step and update; its reduced gradients, masters and moments captured."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad, safe_get_full_optimizer_state

    for variant, c in copies.items():
        pe.deepspeed_micro_step(c, work.shape, work.stand_ins, work.setup, x, work.probes, gas=1, boundary=True)
        for n, p in c["params"].items():
            captured[(step, variant, n, "grad")] = safe_get_full_grad(p).detach().clone()
        c["optimizer"].step()
        c["optimizer"].clear_lp_grads()
        for n, p in c["params"].items():
            captured[(step, variant, n, "master")] = safe_get_full_fp32_param(p).detach().clone()
            for kind in ("exp_avg", "exp_avg_sq"):
                captured[(step, variant, n, kind)] = safe_get_full_optimizer_state(p, kind).detach().clone()


def _megatron_update(captured: dict, step: int, megatron, params: dict, families: dict, work: _Workload, x) -> None:
    """The Megatron oracle: the same forward, the explicit FP32 TP-then-DP per-parameter reducer, its optimizer."""
    from simdist.gradpath.families import Family

    spec, setup = work.spec, work.setup
    work.layer(dict(params), setup.local).loss(x, work.probes, setup.tp_rank, spec.tp).backward()
    for n, p in params.items():
        grad = p.grad.float()
        if families[n] is Family.EXPERT:
            grad = grad / spec.tp
        elif families[n] is not Family.MODEL_PARALLEL:
            dist.all_reduce(grad, group=setup.tp_group)
            grad = grad / spec.tp
        dist.all_reduce(grad, group=setup.edp_group if families[n] is Family.EXPERT else setup.dp_group)
        p.main_grad = grad * (1.0 / spec.dp)
        captured[(step, "megatron", n, "grad")] = p.main_grad.clone()
    megatron.step()
    for n, p in params.items():
        main = p.main_param
        state = megatron.optimizer.state[main]
        captured[(step, "megatron", n, "master")] = main.detach().clone()
        captured[(step, "megatron", n, "exp_avg")] = state["exp_avg"].clone()
        captured[(step, "megatron", n, "exp_avg_sq")] = state["exp_avg_sq"].clone()
        p.grad = None
        del p.main_grad


def _simdist_update(captured: dict, step: int, oracle, specs: list, work: _Workload, init: dict, rank: int) -> None:
    """The simdist oracle's step, fed every rank's local gradients; this rank's slice captured."""
    from simdist.gradpath.probes import Capture

    spec = work.spec

    def local_grads(_micro, lp):
        out = {}
        for r in range(4):
            dp_r, tp_r = spec.group_of("dp", r).index(r), spec.group_of("tp", r).index(r)
            xr = work.tokens(step, dp_r)
            weights = {n: lp[(r, n)].detach().clone().requires_grad_() for n in init}
            work.layer(weights, work.local_of(r)).loss(xr, work.probes, tp_r, 2).backward()
            out.update({(r, n): w.grad for n, w in weights.items()})
        return out

    def capture(s, micro, name, stage, value):
        if stage == Capture.DP_REDUCED:
            captured[(step, "simdist", name, "grad")] = value[..., rank, *([slice(None)] * (value.dim() - 1))]

    oracle.step(step, 1, local_grads, capture)
    master = oracle.master[0].detach()
    state = oracle.optimizer.state[oracle.master[0]]
    for p in specs:
        captured[(step, "simdist", p.name, "master")] = oracle.part(master, p)[rank].clone()
        captured[(step, "simdist", p.name, "exp_avg")] = oracle.part(state["exp_avg"], p)[rank].clone()
        captured[(step, "simdist", p.name, "exp_avg_sq")] = oracle.part(state["exp_avg_sq"], p)[rank].clone()


def _rows(captured: dict, rank: int) -> list[dict]:
    """One row per Megatron tensor: how many elements of each other implementation's differ from it, bit for bit."""
    rows = []
    for (step, impl, name, kind), value in captured.items():
        if impl != "megatron":
            continue
        row = {"rank": rank, "step": step + 1, "param": name, "kind": kind, "elements": value.numel()}
        for other in ("fixed", "shipped", "simdist"):
            theirs = captured[(step, other, name, kind)].reshape(value.shape)
            row[other] = int((theirs.float().view(torch.int32) != value.float().view(torch.int32)).sum())
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="OLMoE-1B-7B")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--expert-rows", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--port", type=int, default=29571)
    args = parser.parse_args(argv)
    get_shape(args.model)
    args.tp, args.world, args.gas, args.marker = 2, 4, 1, "per_micro_step"
    results = mp.Manager().list()
    mp.spawn(_rank, args=(args, results), nprocs=4)
    rows = sorted(results, key=lambda r: (r["rank"], r["step"], r["param"], KINDS.index(r["kind"])))
    per_rank = len([r for r in rows if r["rank"] == 0])
    print(
        f"# #8913 report validation replicated: {args.model} layer, TP2/EP2/ETP1 on 4 gloo processes, "
        f"{args.steps} BF16 updates, {args.tokens} tokens per DP rank; {per_rank} tensors per rank "
        f"({len({r['param'] for r in rows})} parameters x {len(KINDS)} kinds x {args.steps} updates)"
    )
    print(
        "| rank | update | parameter | tensor | elements | fixed != Megatron | shipped != Megatron "
        "| simdist oracle != Megatron |"
    )
    print("|---:|---:|---|---|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['rank']} | {r['step']} | {r['param']} | {r['kind']} | {r['elements']} | {r['fixed']} "
            f"| {r['shipped']} | {r['simdist']} |"
        )
    tensors = len(rows)
    summary = {o: sum(1 for r in rows if r[o]) for o in ("fixed", "shipped", "simdist")}
    print(
        f"\n# {tensors} tensors over 4 ranks: DeepSpeed fixed differs from the Megatron oracle in {summary['fixed']}, "
        f"DeepSpeed shipped in {summary['shipped']}, the simdist oracle in {summary['simdist']}"
    )
    return 0 if summary["fixed"] == 0 and summary["simdist"] == 0 and summary["shipped"] > 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
