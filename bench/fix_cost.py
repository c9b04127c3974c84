"""What the #8913 fix costs: DeepSpeed's real ``BF16_Optimizer._update_hp_grad`` shipped vs with FP32 staging.

    python bench/fix_cost.py [--device cpu|cuda] [--models Mixtral-8x7B,...] [--repeats 5]

Four processes (TP2/EP2/ETP1, DeepSpeed's own folding spec and groups; gloo, which also all-reduces CUDA
tensors, so one GPU serves all four ranks with ``--device cuda``). For each catalogue model
(`simdist.sources.production`) and each family on the #8913 path -- the router weight ``[experts, hidden]``
(with GPT-OSS's router bias) and the layer's RMSNorm weights -- every rank builds a real ``BF16_Optimizer``
holding that one parameter at full size, sets a BF16 local gradient and times ``update_hp_grads()`` (the
epilogue path: ``_update_hp_grad`` with the folding correction and its TP all-reduce), shipped and with the
fix bound in (`simdist.cases.deepspeed.harness`'s FP32 staging, the same code as the exported ``fix.diff``).
The median over ``--repeats`` of the slowest rank is printed. Peak memory: measured
(``torch.cuda.max_memory_allocated`` above the resident tensors) with ``--device cuda``; on CPU the transient
bytes of each path, counted from the code (shipped: the helper's FP32 copy 4N plus its BF16 write-back copy 2N,
then the FP32 cast 4N once those are freed: peak 6N; fixed: the FP32 staging copy 4N, corrected in place: 4N).

Then the whole-model FP32 staging bytes from the catalogue: 4 bytes per element on the #8913 path over every
MoE layer (what staging every such gradient at once would hold; the fix holds one parameter's at a time).

The boundary pass (``_reduce_autoep_folding_tp_replicated_gradients``) is not timed separately: on the
epilogue path it finds the marker set and skips, in both variants.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from simdist.sources.production import CATALOGUE, get_shape


def _families(name: str) -> list[tuple[str, tuple[int, ...]]]:
    shape = get_shape(name)
    out = [("router weight", (shape.experts.value, shape.hidden.value))]
    if shape.router_bias:
        out.append(("router bias", (shape.experts.value,)))
    out += [(f"norm {n}", (f.value,)) for n, f in shape.norms]
    return out


def _rank(rank: int, world: int, port: int, device: str, models: list[str], repeats: int, results) -> None:
    """One rank: every model's families timed, shipped and fixed; rank 0 appends the slowest rank's medians."""
    import types

    folding = _deepspeed_groups(rank, world, port)  # DeepSpeed is imported once the process group exists
    from deepspeed.module_inject.auto_ep_folding import mark_autoep_folding_router_parameter

    from simdist.cases.deepspeed.harness import _staged_update_hp_grad

    for model in models:
        for family, shape in _families(model):
            param = torch.nn.Parameter(torch.zeros(shape, dtype=torch.bfloat16, device=device))
            mark_autoep_folding_router_parameter(param)  # correction AVERAGE (norms: the same correction)
            optimizer = _optimizer(param, folding)
            shipped = optimizer._update_hp_grad
            generator = torch.Generator().manual_seed(rank)
            local = (torch.randn(shape, generator=generator) * 1e-3).to(torch.bfloat16).to(device)
            for variant in ("shipped", "fixed"):
                optimizer._update_hp_grad = (
                    shipped if variant == "shipped" else types.MethodType(_staged_update_hp_grad, optimizer)
                )
                slowest, peak = _time_update(optimizer, param, local, repeats, device == "cuda")
                if rank == 0:
                    results.append((model, family, shape, variant, slowest, peak))
            del optimizer, param
    dist.barrier()
    dist.destroy_process_group()


def _deepspeed_groups(rank: int, world: int, port: int):
    """This rank's gloo process group, DeepSpeed's communication and its TP2/EP2/ETP1 folding groups; the
    folding spec."""
    import importlib
    import logging

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    from deepspeed import comm as ds_comm
    from deepspeed.module_inject.auto_ep_folding import build_folding_spec
    from deepspeed.utils import groups, logger

    logger.setLevel(logging.ERROR)
    vars(importlib.import_module("deepspeed.comm.torch"))["build_shm_op"] = lambda: None
    ds_comm.init_distributed(dist_backend="gloo", dist_init_required=False, verbose=False)
    folding = build_folding_spec(world_size=world, pp_size=1, tp_size=2, ep_size=2, etp_size=1, mp_mode="tp")
    groups._init_tp_groups_with_new_group(2)
    groups._create_expert_and_data_parallel(2, mp_size=2, pp_size=1, mp_mode="tp", folding_spec=folding)
    return folding


def _optimizer(param: torch.nn.Parameter, folding):
    """A real ``BF16_Optimizer`` over ``param`` alone (FP32 accumulation), its folding correction configured."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config
    from deepspeed.utils import groups

    optimizer = BF16_Optimizer(
        torch.optim.SGD([param], lr=0.0),
        {param: "p"},
        DeepSpeedBF16Config(enabled=True),
        dp_process_group=groups.get_data_parallel_group(),
        grad_acc_dtype=torch.float32,
    )
    optimizer.configure_autoep_folding_tp_gradient_reduction(folding)
    return optimizer


def _time_update(optimizer, param, local: torch.Tensor, repeats: int, cuda: bool) -> tuple[float, int]:
    """``update_hp_grads()`` timed ``repeats`` times after a warm-up: the slowest rank's median seconds and this
    rank's peak extra bytes (``-1`` off CUDA)."""
    from deepspeed.module_inject.auto_ep_folding import clear_autoep_folding_gradient_corrected

    times, peaks = [], []
    for _ in range(repeats + 1):  # the first is a warm-up
        param.grad = local.clone()
        clear_autoep_folding_gradient_corrected(param)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() if cuda else 0
        dist.barrier()
        start = time.perf_counter()
        optimizer.update_hp_grads()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        peaks.append(torch.cuda.max_memory_allocated() - base if cuda else -1)
    slowest = torch.tensor([statistics.median(times[1:])])
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return float(slowest), max(peaks[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--models", default=",".join(CATALOGUE), help="comma-separated catalogue names")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--port", type=int, default=29517)
    args = parser.parse_args()
    models = [m for m in args.models.split(",") if m]
    for m in models:
        get_shape(m)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here")
    results = mp.Manager().list()
    mp.spawn(_rank, args=(4, args.port, args.device, models, args.repeats, results), nprocs=4)

    print(f"# _update_hp_grad (epilogue), TP2/EP2/ETP1 on 4 gloo processes, device {args.device}")
    print("| model | family | shape | shipped ms | fixed ms | fixed/shipped | peak extra bytes shipped | fixed |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    by_key = {(m, f, v): (t, p, s) for m, f, s, v, t, p in results}
    for m, f, s, v, _t, _p in results:
        if v != "shipped":
            continue
        t0, p0, _ = by_key[(m, f, "shipped")]
        t1, p1, _ = by_key[(m, f, "fixed")]
        n = 1
        for d in s:
            n *= d
        peak0, peak1 = (p0, p1) if args.device == "cuda" else (6 * n, 4 * n)
        label = "" if args.device == "cuda" else " (counted)"
        print(
            f"| {m} | {f} | {'x'.join(map(str, s))} | {t0 * 1e3:.3f} | {t1 * 1e3:.3f} | {t1 / t0:.2f} "
            f"| {peak0}{label} | {peak1}{label} |"
        )
    print("\n# whole-model FP32 staging of the #8913 path (4 bytes per element, all MoE layers)")
    print("| model | MoE layers | router elements | norm elements | FP32 staging MiB | largest single staging KiB |")
    print("|---|---:|---:|---:|---:|---:|")
    for m in models:
        shape = get_shape(m)
        folded = list(shape.folded_elements().values())
        largest = max(n for _, s in _families(m) for n in [torch.Size(s).numel()])
        print(
            f"| {m} | {shape.moe_layers.value} | {folded[0]} | {folded[1]} | {4 * sum(folded) / 2**20:.1f} "
            f"| {4 * largest / 2**10:.0f} |"
        )


if __name__ == "__main__":
    main()
