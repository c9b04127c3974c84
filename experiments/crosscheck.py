"""Cross-check: the folded MoE block trained in SimWorld and on real process groups, dumped per rank.

The same rank program (`simdist.studies.crosscheck.train_and_dump`) runs in every world
and writes ``OUT/<policy>/rank{r}.safetensors``; compare two dumps with
``simdist compare DUMP_A DUMP_B``::

    python experiments/crosscheck.py --where sim --out dumps/sim                   # SimWorld, gloo order
    python experiments/crosscheck.py --where gloo --out dumps/gloo                 # 4 local gloo processes
    torchrun --nproc-per-node 4 experiments/crosscheck.py --where torch --backend gloo --out dumps/gloo
    torchrun --nproc-per-node 4 experiments/crosscheck.py --where torch --backend nccl --device cuda --out dumps/nccl
    python experiments/crosscheck.py --where sim --device cuda --reduction sequential --out dumps/sim-cuda
    simdist compare dumps/sim/bf16_writeback dumps/gloo/bf16_writeback
"""

from __future__ import annotations

import argparse
import os
import sys

import simdist
from simdist.gradpath.kernel import Marker, UpdatePath
from simdist.reduce import REDUCTION_NAMES
from simdist.sources.moe import MoEConfig
from simdist.studies.crosscheck import CrossCheck, train_and_dump
from simdist.world.spec import EP_LAYOUTS, ParallelSpec


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="experiments/crosscheck.py", description=__doc__.splitlines()[0])
    p.add_argument(
        "--where",
        choices=("sim", "gloo", "torch"),
        default="sim",
        help="sim: SimWorld; gloo: spawn 4 local gloo processes; torch: this process is a torchrun rank",
    )
    p.add_argument("--backend", choices=("gloo", "nccl"), default=None, help="torchrun backend (default: gloo)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--reduction", default="gloo", choices=REDUCTION_NAMES, help="SimWorld reduction")
    p.add_argument("--out", required=True, help="directory for OUT/<policy>/rank{r}.safetensors")
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--ep", type=int, default=2)
    p.add_argument("--ep-layout", choices=EP_LAYOUTS, default="contiguous")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--gas", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--policies", default="bf16_writeback,fp32_staging")
    p.add_argument("--marker", choices=[m.value for m in Marker], default=Marker.DEEPSPEED.value)
    p.add_argument("--update-path", choices=[u.value for u in UpdatePath], default=UpdatePath.EPILOGUE.value)
    p.add_argument("--tokens", type=int, default=MoEConfig.tokens, help="tokens per rank and micro-step")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    ns = parse(argv)
    if ns.device == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS, before CUDA starts
        import torch

        torch.use_deterministic_algorithms(True, warn_only=True)
    world_size = int(os.environ.get("WORLD_SIZE", ns.world_size)) if ns.where == "torch" else ns.world_size
    check = CrossCheck(
        spec=ParallelSpec(world_size, tp=ns.tp, ep=ns.ep, ep_layout=ns.ep_layout),
        steps=ns.steps,
        gas=ns.gas,
        seed=ns.seed,
        policies=tuple(n.strip() for n in ns.policies.split(",") if n.strip()),
        marker=ns.marker,
        update_path=ns.update_path,
        device=ns.device,
        model=MoEConfig(tokens=ns.tokens),
    )
    spec = check.spec
    if ns.where == "sim":
        from simdist.reduce import make_reduction
        from simdist.world.simworld import SimWorld

        reduction = make_reduction(ns.reduction)
        where = {"world": "sim", "backend": "simworld", "reduction": reduction.name}
        written = SimWorld(spec, reduction=reduction).run(train_and_dump, check, ns.out, where)[0]
    elif ns.where == "gloo":
        where = {"world": "gloo", "backend": "gloo", "reduction": "gloo"}
        written = simdist.run(
            train_and_dump, spec, api="comm", where="gloo", args=(check, ns.out, where), timeout_s=600
        )[0]
    else:
        from simdist.world.launch import run_torchrun

        backend = ns.backend or "gloo"
        where = {"world": "torch", "backend": backend, "reduction": backend}
        written = run_torchrun(train_and_dump, spec, check, ns.out, where, backend=backend)
        if int(os.environ.get("RANK", "0")) != 0:
            return 0
    for path in written:
        print(
            f"wrote {os.path.dirname(path)}/rank*.safetensors ({spec.describe()}, {check.steps} steps x GAS "
            f"{check.gas})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
