"""Fingerprint real NCCL against the `nccl` reduction, per case, element by element.

On one node with 2 or more GPUs and a CUDA build of torch::

    python experiments/nccl_fingerprint.py --out runs/nccl-fp                  # every knob set, n = 2..#GPUs
    python experiments/nccl_fingerprint.py --out runs/nccl-fp --world-sizes 4,8 --knobs ring-simple-c2
    python experiments/nccl_fingerprint.py --dry-run                           # CPU self-check, no GPU

For each world size and knob set the driver launches one torchrun job
(``python -m torch.distributed.run --standalone``) with the NCCL environment
pinned (below). Every rank builds the same inputs on CPU (seeded, exact
power-of-two scaling only, so the bits do not depend on thread counts), runs
the collective on its GPU, and rank 0 gathers what every rank holds, reads
the rings and trees NCCL logged at init (``NCCL_DEBUG=INFO``: ``Channel xx/yy :
0 ...`` and ``Trees [c] d0/d1/d2->r->up``), builds `simdist.reduce.nccl.reduction.Nccl`
with them and compares bit for bit. It also reads the channel range NCCL logs
for each call (``channel{Lo..Hi}``) and reports it next to the model's split.
Results go to ``OUT/n{n}-{knobs}.json``; the driver prints one line per case,
``model == real`` or ``MISMATCH`` with the count and first positions, and
exits 1 on any mismatch.

AVG cases that do not match are compared again with the model's fused
premultiply (``premul_fma=True``: the compiler may fuse NCCL's premultiply
with the first add into one FMA); a match is reported as such, and tells
which of the two the installed NCCL build does.

Inputs per case: ``fingerprint`` -- at every element one rank holds 1.0 and
two others half an ulp of 1.0, the rest 0, cycling over every (big, small,
small) choice of ranks (the result is ``1 + ulp`` exactly when the two halves
meet before the 1.0, so the order shows in the bits); ``random`` -- normal
values times ``2**k``, ``k`` uniform in a dtype-dependent range.

Environment pinned per knob set (the model's parameters follow them):
``NCCL_ALGO=allreduce:<ring|tree>``, ``NCCL_PROTO=<Simple|LL|LL128>``,
``NCCL_MIN_NCHANNELS = NCCL_MAX_NCHANNELS = NCCL_MIN_CTAS = NCCL_MAX_CTAS = c``,
``NCCL_BUFFSIZE`` when the knob set names one, ``NCCL_NVLS_ENABLE=0``,
``NCCL_COLLNET_ENABLE=0``, ``NCCL_PAT_ENABLE=0``, ``NCCL_WIN_ENABLE=0`` (no
symmetric-memory kernels), ``NCCL_TUNER_PLUGIN=none``, ``NCCL_DEBUG=INFO``
with ``NCCL_DEBUG_SUBSYS=INIT,GRAPH,TUNING,ENV`` into ``OUT/logs-.../``.

``--dry-run`` runs the same cases, bookkeeping, log parsing and report on CPU
with a stand-in for NCCL: `simdist.testing._internal.nccl_sim`, a step-by-step
simulation of NCCL's kernels, on non-trivial rings and trees, whose init log
is written in NCCL's format and parsed back. It checks this script and the
model against the simulation; it says nothing about hardware.

The model follows NCCL v2.30.7 (same ordering code back to 2.26; the channel
split differs before 2.29); the driver prints the NCCL version torch was
built with (``torch.cuda.nccl.version()``) and sets the model's
``nccl_version`` from it.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from simdist.numerics.floats import bits
from simdist.reduce.base import ReduceOp
from simdist.reduce.nccl import Nccl
from simdist.reduce.nccl.arith import premul_scale
from simdist.reduce.nccl.schedule import NCCL_VERSION, VERSIONS, TreeDown, chain_tree, double_binary_trees
from simdist.testing._internal.nccl_sim import (
    simulate_ring_allreduce,
    simulate_ring_reduce,
    simulate_ring_reduce_scatter,
    simulate_tree_allreduce,
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
HALF_ULP = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
SPREAD = {torch.float32: 20, torch.bfloat16: 8, torch.float16: 4}
LENGTHS = (1, 7, 100, 4097, 65537, (1 << 20) + 5, (3 << 20) + 11)
QUICK_LENGTHS = (1, 7, 4097, 65537)
PROTO_ENV = {"simple": "Simple", "ll": "LL", "ll128": "LL128"}


@dataclass(frozen=True)
class Knobs:
    """One pinned NCCL configuration (one torchrun job per world size)."""

    name: str
    algorithm: str
    protocol: str
    channels: int
    buffsize: int | None = None

    def env(self, log_dir: Path) -> dict[str, str]:
        c = str(self.channels)
        env = {
            "NCCL_ALGO": f"allreduce:{self.algorithm}",
            "NCCL_PROTO": PROTO_ENV[self.protocol],
            "NCCL_MIN_NCHANNELS": c,
            "NCCL_MAX_NCHANNELS": c,
            "NCCL_MIN_CTAS": c,
            "NCCL_MAX_CTAS": c,
            "NCCL_NVLS_ENABLE": "0",
            "NCCL_COLLNET_ENABLE": "0",
            "NCCL_PAT_ENABLE": "0",
            "NCCL_WIN_ENABLE": "0",
            "NCCL_TUNER_PLUGIN": "none",
            "NCCL_DEBUG": "INFO",
            "NCCL_DEBUG_SUBSYS": "INIT,GRAPH,TUNING,ENV",
            "NCCL_DEBUG_FILE": str(log_dir / "nccl.%h.%p.log"),
        }
        if self.buffsize is not None:
            env["NCCL_BUFFSIZE"] = str(self.buffsize)
        return env

    def reduction(self, rings=None, trees=None, nccl_version: tuple[int, int] = (2, 30)) -> Nccl:
        extra = {} if self.buffsize is None else {"buffsize": self.buffsize}
        return Nccl(self.algorithm, self.protocol, self.channels, rings=rings, trees=trees,
                    nccl_version=nccl_version, **extra)  # fmt: skip


KNOBS = (
    Knobs("ring-simple-c1", "ring", "simple", 1),
    Knobs("ring-simple-c2", "ring", "simple", 2),
    Knobs("ring-simple-c4-buf64k", "ring", "simple", 4, buffsize=65536),
    Knobs("ring-ll-c2", "ring", "ll", 2),
    Knobs("ring-ll128-c2", "ring", "ll128", 2),
    Knobs("tree-simple-c2", "tree", "simple", 2),
    Knobs("tree-ll-c2", "tree", "ll", 2),
    Knobs("tree-ll128-c2", "tree", "ll128", 2),
)
QUICK_KNOBS = ("ring-simple-c2", "ring-simple-c4-buf64k", "ring-ll-c2", "tree-simple-c2")


@dataclass(frozen=True)
class Case:
    """One collective call: function, op, dtype, input kind and length."""

    fn: str  # all_reduce | reduce_scatter | reduce
    op: str  # sum | avg
    dtype: str
    kind: str  # fingerprint | random
    length: int
    seed: int

    @property
    def label(self) -> str:
        return f"{self.fn:<14} {self.op:<3} {self.dtype:<8} {self.kind:<11} N={self.length}"


def cases(n: int, knobs: Knobs, quick: bool) -> list[Case]:
    """The cases of one job: all-reduce SUM/AVG everywhere, reduce-scatter and reduce on ring jobs."""
    lengths = QUICK_LENGTHS if quick else LENGTHS
    out = []
    for seed, (dtype, kind, length) in enumerate(itertools.product(DTYPES, ("fingerprint", "random"), lengths)):
        out.append(Case("all_reduce", "sum", dtype, kind, length, seed))
        if kind == "random":
            out.append(Case("all_reduce", "avg", dtype, kind, length, seed))
        if knobs.algorithm == "ring" and kind == "random" and dtype != "float16":
            out.append(Case("reduce_scatter", "sum", dtype, kind, max(n, length - length % n), seed))
            out.append(Case("reduce", "sum", dtype, kind, length, seed))
    return out


def build_inputs(case: Case, n: int) -> torch.Tensor:
    """``[n, length]`` per-rank inputs of ``case``, identical on every process (no exp2/pow)."""
    dtype = DTYPES[case.dtype]
    if case.kind == "fingerprint" and n >= 3:
        triples = [(b, s, t) for b in range(n) for s, t in itertools.combinations(range(n), 2) if b not in (s, t)]
        which = torch.arange(case.length) % len(triples)
        table = torch.tensor(triples)
        x = torch.zeros(n, case.length, dtype=torch.float64)
        cols = torch.arange(case.length)
        x[table[which, 0], cols] = 1.0
        x[table[which, 1], cols] = HALF_ULP[dtype]
        x[table[which, 2], cols] = HALF_ULP[dtype]
        return x.to(dtype)
    g = torch.Generator().manual_seed(1000 * case.seed + n)
    spread = SPREAD[dtype]
    x = torch.randn(n, case.length, generator=g, dtype=torch.float64)
    k = torch.randint(0, 2 * spread + 1, (n, case.length), generator=g)
    scale = torch.tensor([2.0 ** (i - spread) for i in range(2 * spread + 1)], dtype=torch.float64)
    return (x * scale[k]).to(dtype)


def predict(reduction: Nccl, case: Case, x: torch.Tensor, root: int) -> torch.Tensor:
    """What the model says rank 0 (all-reduce), every rank (reduce-scatter, stacked) or the root holds."""
    op = ReduceOp.AVG if case.op == "avg" else ReduceOp.SUM
    if case.fn == "all_reduce":
        return reduction.reduce(x, op)
    if case.fn == "reduce_scatter":
        return reduction.reduce_scatter(x, op)
    return reduction.reduce_to(x, op, root)


# -- NCCL logs -------------------------------------------------------------------------------

_RING = re.compile(r"Channel (\d+)/(\d+) :((?: +\d+)+)\s*$")
_TREES = re.compile(r"\[(\d+)\] (-?\d+)/(-?\d+)/(-?\d+)->(\d+)->(-?\d+)")
_TUNING = re.compile(r"(\w+): (\d+) Bytes -> Algo (\w+) proto (\w+) channel\{Lo\.\.Hi\}=\{(\d+)\.\.(\d+)\}")


def parse_rings(lines: list[str]) -> tuple[tuple[int, ...], ...] | None:
    """Rings from rank 0's ``Channel xx/yy : 0 a b ...`` lines, one per channel in channel order."""
    rings: dict[int, tuple[int, ...]] = {}
    for line in lines:
        m = _RING.search(line)
        if m:
            rings[int(m.group(1))] = tuple(int(v) for v in m.group(3).split())
    return tuple(rings[c] for c in sorted(rings)) or None


def parse_trees(lines: list[str], n: int) -> tuple[TreeDown, ...] | None:
    """Per-channel ``down`` tables from every rank's ``Trees [c] d0/d1/d2->rank->up`` line."""
    down: dict[int, dict[int, tuple[int, ...]]] = {}
    for line in lines:
        if "Trees" not in line:
            continue
        for m in _TREES.finditer(line):
            c, d0, d1, d2, rank, _ = (int(v) for v in m.groups())
            down.setdefault(c, {})[rank] = tuple(d for d in (d0, d1, d2) if d >= 0)
    if not down or any(len(table) != n for table in down.values()):
        return None
    return tuple(tuple(down[c][r] for r in range(n)) for c in sorted(down))


def format_init_log(reduction: Nccl, n: int) -> list[str]:
    """The init lines NCCL would log for ``model``'s rings and trees (for the dry run)."""
    lines = []
    for c in range(reduction.channels):
        ring = reduction.ring_of(c, n)
        lines.append(f"host:1:1 [0] NCCL INFO Channel {c:02d}/{reduction.channels:02d} : " + " ".join(map(str, ring)))
    for r in range(n):
        parts = []
        for c in range(reduction.channels):
            down = reduction.tree_of(c, n)
            up = next((p for p in range(n) if r in down[p]), -1)
            d = [*down[r], -1, -1, -1][:3]
            parts.append(f"[{c}] {d[0]}/{d[1]}/{d[2]}->{r}->{up}")
        lines.append(f"host:1:1 [{r}] NCCL INFO Trees " + " ".join(parts))
    return lines


def read_logs(log_dir: Path) -> list[str]:
    lines: list[str] = []
    for path in sorted(log_dir.glob("nccl.*.log")):
        lines.extend(path.read_text(errors="replace").splitlines())
    return lines


# -- comparing -------------------------------------------------------------------------------


def compare(real: torch.Tensor, expected: torch.Tensor) -> dict:
    differ = (bits(real) != bits(expected)).flatten().nonzero().flatten()
    return {"elements": int(real.numel()), "mismatches": int(differ.numel()), "first": differ[:8].tolist()}


def judge(reduction: Nccl, case: Case, x: torch.Tensor, root: int, real: torch.Tensor) -> dict:
    """Compare with the model; for AVG also with the fused-premultiply variant and say which one matched."""
    result = {**compare(real, predict(reduction, case, x, root)), "variant": "plain"}
    if case.op == "avg" and result["mismatches"] and x.dtype != torch.float64:
        fused = dataclasses.replace(reduction, premul_fma=True)
        other = compare(real, predict(fused, case, x, root))
        if other["mismatches"] == 0:
            result = {**other, "variant": "fused premultiply (premul_fma=True)"}
    return result


def record(case: Case, result: dict, agree: bool, model_channels: int, logged: str | None) -> dict:
    return {**asdict(case), **result, "ranks_agree": agree, "model_channels": model_channels, "logged": logged}


# -- the torchrun worker ---------------------------------------------------------------------


def worker(out: Path, knobs: Knobs, quick: bool) -> None:
    """One torchrun rank: run every case on the GPU; rank 0 compares with the reduction and writes JSON."""
    import torch.distributed as dist

    rank, n, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    warm = torch.ones(1, device=device)
    dist.all_reduce(warm)
    torch.cuda.synchronize()
    dist.barrier()
    log_dir = Path(os.environ["NCCL_DEBUG_FILE"]).parent
    lines = read_logs(log_dir) if rank == 0 else []
    rings, trees = parse_rings(lines), parse_trees(lines, n)
    reduction = knobs.reduction(
        rings=rings, trees=trees if knobs.algorithm == "tree" else None, nccl_version=model_version()
    )
    rows = []
    for case in cases(n, knobs, quick):
        x = build_inputs(case, n)
        gathered = _run_case(case, x, rank, n, device)
        if rank == 0:
            rows.append(_judge_case(case, x, gathered, reduction, n, log_dir))
    if rank == 0:
        meta = {
            "n": n,
            "knobs": asdict(knobs),
            "reduction": reduction.name,
            "nccl": _nccl_version(),
            "reduction_follows": NCCL_VERSION,
            "rings": rings,
            "trees": trees,
        }
        (out / f"n{n}-{knobs.name}.json").write_text(json.dumps({"meta": meta, "cases": rows}, indent=1))
    dist.destroy_process_group()


def _run_case(case: Case, x: torch.Tensor, rank: int, n: int, device: torch.device) -> list[torch.Tensor]:
    """Run ``case``'s collective on NCCL with this rank's row of ``x``; every rank's result, gathered here."""
    import torch.distributed as dist

    mine = x[rank].to(device)
    op = dist.ReduceOp.AVG if case.op == "avg" else dist.ReduceOp.SUM
    if case.fn == "all_reduce":
        dist.all_reduce(mine, op=op)
        held = mine
    elif case.fn == "reduce_scatter":
        held = torch.empty(case.length // n, dtype=mine.dtype, device=device)
        dist.reduce_scatter_tensor(held, mine, op=op)
    else:
        dist.reduce(mine, dst=n - 1, op=op)
        held = mine
    gathered = [torch.empty_like(held) for _ in range(n)]
    dist.all_gather(gathered, held)
    torch.cuda.synchronize()
    return gathered


def _judge_case(
    case: Case, x: torch.Tensor, gathered: list[torch.Tensor], reduction: Nccl, n: int, log_dir: Path
) -> dict:
    """Rank 0's record of one case: NCCL's result judged against ``reduction``, whether the ranks agreed, and
    the algorithm NCCL's log says it tuned for the call."""
    every = torch.stack([g.cpu() for g in gathered])
    root = n - 1
    tuning = [m for line in read_logs(log_dir) for m in [_TUNING.search(line)] if m]
    call = {"all_reduce": "AllReduce", "reduce_scatter": "ReduceScatter", "reduce": "Reduce"}[case.fn]
    logged = next((m.group(0) for m in reversed(tuning) if m.group(1) == call), None)
    if case.fn == "all_reduce":
        real, agree = every[0], bool(all(torch.equal(bits(every[0]), bits(r)) for r in every))
    elif case.fn == "reduce_scatter":
        real, agree = every, True
    else:
        real, agree = every[root], True
    count = case.length // n if case.fn == "reduce_scatter" else case.length
    parts = reduction.parts(count, x.element_size(), n, **_traffic(case, n, x.element_size()))
    return record(case, judge(reduction, case, x, root, real), agree, len(parts), logged)


def _traffic(case: Case, n: int, e: int) -> dict:
    if case.fn == "reduce_scatter":
        return {"traffic_per_byte": n, "nbytes": case.length * e}
    return {"traffic_per_byte": 1} if case.fn == "reduce" else {}


def model_version() -> tuple[int, int]:
    """The model's ``nccl_version`` for torch's NCCL: itself when read, else the nearest release read."""
    try:
        major, minor = torch.cuda.nccl.version()[:2]
    except Exception:  # no CUDA build
        return VERSIONS[-1]
    return min(VERSIONS, key=lambda v: abs((v[0] - major) * 100 + v[1] - minor))


def _nccl_version() -> str:
    try:
        return ".".join(map(str, torch.cuda.nccl.version()))
    except Exception as exc:  # no CUDA build
        return f"unknown ({type(exc).__name__})"


# -- the dry run -----------------------------------------------------------------------------


def dry_run_job(n: int, knobs: Knobs, quick: bool, log_dir: Path) -> dict:
    """The worker's bookkeeping on CPU, with the step-by-step simulation standing in for NCCL."""
    perms = itertools.islice(itertools.permutations(range(1, n)), 1, 3)
    rings = tuple(tuple([0, *perm]) for perm in perms) or (tuple(range(n)),)
    trees = double_binary_trees([[0, 1], list(range(2, n))]) if n >= 4 else (chain_tree(range(n - 1, -1, -1)),)
    truth = knobs.reduction(rings=rings, trees=trees)
    log_dir.mkdir(parents=True, exist_ok=True)
    (log_dir / "nccl.host.0.log").write_text("\n".join(format_init_log(truth, n)) + "\n")
    lines = read_logs(log_dir)
    reduction = knobs.reduction(
        rings=parse_rings(lines), trees=parse_trees(lines, n) if knobs.algorithm == "tree" else None
    )
    rows = []
    for case in cases(n, knobs, quick):
        if case.length > 70000:
            continue  # the simulation is slow; the GPU run covers the long cases
        x = build_inputs(case, n)
        pre = x * premul_scale(n, x.dtype) if case.op == "avg" else x
        root = n - 1
        if case.fn == "all_reduce":
            sim = simulate_ring_allreduce if knobs.algorithm == "ring" else simulate_tree_allreduce
            every = torch.stack(sim(pre, truth))
            real, agree = every[0], bool(all(torch.equal(bits(every[0]), bits(r)) for r in every))
        elif case.fn == "reduce_scatter":
            real, agree = simulate_ring_reduce_scatter(pre, truth), True
        else:
            real, agree = simulate_ring_reduce(pre, truth, root), True
        count = case.length // n if case.fn == "reduce_scatter" else case.length
        parts = reduction.parts(count, x.element_size(), n, **_traffic(case, n, x.element_size()))
        rows.append(record(case, judge(reduction, case, x, root, real), agree, len(parts), None))
    meta = {
        "n": n,
        "knobs": asdict(knobs),
        "reduction": reduction.name,
        "nccl": "simulation",
        "reduction_follows": NCCL_VERSION,
    }
    return {"meta": meta, "cases": rows}


# -- the driver ------------------------------------------------------------------------------


def report(job: dict) -> int:
    """Print one line per case; return the number of mismatching cases."""
    meta = job["meta"]
    print(
        f"# n={meta['n']} {meta['knobs']['name']}: {meta['reduction']} (NCCL {meta['nccl']}, the reduction follows "
        f"{meta['reduction_follows']})"
    )
    bad = 0
    for row in job["cases"]:
        case = Case(**{k: row[k] for k in ("fn", "op", "dtype", "kind", "length", "seed")})
        ok = row["mismatches"] == 0 and row["ranks_agree"]
        bad += not ok
        verdict = "model == real" if ok else f"MISMATCH {row['mismatches']}/{row['elements']} first {row['first']}"
        if ok and row.get("variant", "plain") != "plain":
            verdict += f" with {row['variant']}"
        if not row["ranks_agree"]:
            verdict += " (ranks disagree)"
        chans = f"channels model {row['model_channels']}"
        if row["logged"]:
            lo, hi = (int(v) for v in re.findall(r"\{(\d+)\.\.(\d+)\}", row["logged"])[0])
            chans += f", NCCL {hi - lo + 1}" + ("" if hi - lo + 1 == row["model_channels"] else " (CHANNELS DIFFER)")
        print(f"  {case.label:<62} {verdict}  [{chans}]")
    return bad


def launch(out: Path, n: int, knobs: Knobs, quick: bool, timeout_s: float) -> dict:
    log_dir = out / f"logs-n{n}-{knobs.name}"
    log_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **knobs.env(log_dir)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}", __file__,
           "--worker", "--out", str(out), "--knobs", knobs.name] + (["--quick"] if quick else [])  # fmt: skip
    done = subprocess.run(cmd, env=env, timeout=timeout_s, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"torchrun n={n} {knobs.name} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads((out / f"n{n}-{knobs.name}.json").read_text())


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="experiments/nccl_fingerprint.py", description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/nccl-fingerprint", help="directory for JSON results and NCCL logs")
    p.add_argument("--world-sizes", default=None, help="comma list (default 2..#GPUs; dry run 3,4)")
    p.add_argument("--knobs", default=None, help=f"comma list of knob sets (default all): {[k.name for k in KNOBS]}")
    p.add_argument("--quick", action="store_true", help="fewer lengths and knob sets")
    p.add_argument("--dry-run", action="store_true", help="CPU self-check against the step-by-step simulation")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per torchrun job")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    ns = parse(argv)
    out = Path(ns.out)
    by_name = {k.name: k for k in KNOBS}
    default = QUICK_KNOBS if ns.quick else tuple(by_name)
    names = ns.knobs.split(",") if ns.knobs else default
    unknown = sorted(set(names) - set(by_name))
    if unknown:
        raise SystemExit(f"unknown knob sets {unknown}; valid: {', '.join(by_name)}")
    if ns.worker:
        worker(out, by_name[names[0]], ns.quick)
        return 0
    if ns.dry_run:
        sizes = [int(s) for s in (ns.world_sizes or "3,4").split(",")]
    else:
        gpus = torch.cuda.device_count()
        if gpus < 2:
            raise SystemExit(f"needs 2 or more GPUs (found {gpus}); use --dry-run for the CPU self-check")
        sizes = [int(s) for s in ns.world_sizes.split(",")] if ns.world_sizes else list(range(2, gpus + 1))
        print(f"torch {torch.__version__}, NCCL {_nccl_version()}; the model follows {NCCL_VERSION}, "
              f"with the channel split of {'.'.join(map(str, model_version()))}")  # fmt: skip
        if model_version() != tuple(torch.cuda.nccl.version()[:2]):
            print(f"WARNING: NCCL {_nccl_version()} is outside the releases the model was read from")
    out.mkdir(parents=True, exist_ok=True)
    bad = total = 0
    started = time.perf_counter()
    for n, name in itertools.product(sizes, names):
        if ns.dry_run:
            job = dry_run_job(n, by_name[name], ns.quick, out / f"dry-logs-n{n}-{name}")
        else:
            job = launch(out, n, by_name[name], ns.quick, ns.timeout)
        bad += report(job)
        total += len(job["cases"])
    mode = "dry run against the step-by-step simulation" if ns.dry_run else "real NCCL"
    print(f"{mode}: model == real in {total - bad}/{total} cases ({time.perf_counter() - started:.0f} s)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
