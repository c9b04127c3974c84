"""The resumable run: configuration, checkpoints, files. See `simdist.studies.growth`."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import torch

from simdist.errors import SimdistError, UsageError
from simdist.gradpath.batched import BatchedPath, initial_buffer
from simdist.gradpath.kernel import Marker
from simdist.gradpath.oracle import Oracle
from simdist.gradpath.path import PathConfig
from simdist.numerics.compare import Difference
from simdist.policies.catalogue import get_policy
from simdist.reduce import make_reduction
from simdist.sources import GradientSource
from simdist.sources.synthetic import DEFAULT_PARAMS, InitialWeights
from simdist.studies.growth.config import GrowthConfig
from simdist.studies.growth.files import atomic_write, write_text
from simdist.studies.growth.metrics import (
    COLUMNS,
    MOE_COLUMNS,
    Reference,
    divergence_each,
    metric_steps,
    summarise,
    write_metrics,
)
from simdist.studies.growth.plot import plot_growth
from simdist.studies.growth.stream import BatchedGradients

FILES = {
    "config": "config.json",
    "checkpoint": "checkpoint.safetensors",
    "metrics": "metrics.csv",
    "plot": "growth.png",
    "summary": "summary.json",
}


def _hash(identity: dict) -> str:
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]


class _Interrupted(SimdistError):
    """Raised by the ``stop_after`` test hook to simulate a kill."""


def run_growth(
    config: GrowthConfig,
    out: str | Path,
    *,
    force: bool = False,
    progress: bool = True,
    plot: bool = True,
    stop_after: int | None = None,
) -> dict:
    """Run (or resume, or reuse) a growth study in ``out``; returns the summary.

    ``out`` holds ``config.json``, ``checkpoint.safetensors`` (every
    ``checkpoint_every`` steps: states of every run, metrics so far, the step
    counter), and when finished ``metrics.csv``, ``growth.png`` and
    ``summary.json``; each written to a temporary file and renamed. A finished
    run with the same configuration is returned as is unless ``force``.
    ``stop_after`` (tests) raises after that many steps of this call, as a kill would
    (``source="moe"``: after that many finished (policy, seed) runs; its
    checkpoint is written after each such run and holds only their rows).
    """
    config.validate()
    out = Path(out)
    identity = config.identity()
    key = _hash(identity)
    if force and out.exists():
        for name in FILES.values():
            (out / name).unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    summary_path = out / FILES["summary"]
    config_path = out / FILES["config"]
    if config_path.exists():
        previous = json.loads(config_path.read_text())
        if previous != identity:
            raise UsageError(f"{out} holds a different run ({config_path}); use --force or another --out")
        if summary_path.exists():
            return json.loads(summary_path.read_text())
    write_text(config_path, json.dumps(identity, indent=2, sort_keys=True))

    ckpt = out / FILES["checkpoint"]
    if config.source == GradientSource.MOE:
        metrics = _run_moe(config, ckpt, key, progress, stop_after)
    else:
        metrics = _run_synthetic(config, ckpt, key, progress, stop_after)
    write_metrics(out / FILES["metrics"], config, metrics)
    summary = summarise(config, metrics)
    if plot:
        plot_growth(config, metrics, out / FILES["plot"])
    write_text(summary_path, json.dumps(summary, indent=2, sort_keys=True))
    return summary


def _run_synthetic(config: GrowthConfig, ckpt: Path, key: str, progress: bool, stop_after: int | None) -> np.ndarray:
    """The batched synthetic run, checkpointed every ``checkpoint_every`` steps; ``metrics[row, policy, seed]``, one
    row per step of `metric_steps`."""
    seeds = [config.seed + i for i in range(config.seeds)]
    stream = BatchedGradients(config.spec, DEFAULT_PARAMS, seeds)
    oracle_run, paths = _synthetic_runs(config, seeds)
    runs: list[_OracleRun | BatchedPath] = [oracle_run, *paths]
    recorded = metric_steps(config)  # the 1-based steps whose metrics are recorded, one row each
    row_of = {int(t): i for i, t in enumerate(recorded)}
    metrics = np.zeros((len(recorded), len(paths), config.seeds, len(COLUMNS)), dtype=np.float64)
    start = _resume_synthetic(ckpt, key, runs, recorded, metrics)
    bar = _bar(progress, config.steps, start, "growth")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small tensors: threading costs more than it saves

    def record(row: int) -> None:
        """Row ``row``: per tensor kind, every policy's state [P, S, R, N] against the oracle's [S, R, N]."""
        oracle = oracle_run.oracle
        per_kind = [
            divergence_each(torch.stack([getattr(path.path, kind) for path in paths]), Reference(oracle.flat(kind)))
            for kind in KINDS
        ]
        metrics[row] = torch.cat(per_kind, dim=-1).numpy()

    try:
        for step in range(start, config.steps):
            drawn = [stream.draw(step, micro) for micro in range(config.gas)]  # read-only, shared by every run

            def grads(_step: int, micro: int, drawn=drawn) -> dict[str, torch.Tensor]:
                return drawn[micro]

            for run in runs:
                run.run_step(grads)
            row = row_of.get(step + 1)
            if row is not None:
                record(row)
            if bar is not None:
                bar.update(1)
            done = step + 1
            if done % config.checkpoint_every == 0 or done == config.steps:
                _save_synthetic(ckpt, key, done, runs, metrics[: int(np.searchsorted(recorded, done, side="right"))])
            if stop_after is not None and done - start >= stop_after and done < config.steps:
                raise _Interrupted(f"stopped after step {done}")
    finally:
        torch.set_num_threads(threads)
        if bar is not None:
            bar.close()

    return metrics


def _synthetic_runs(config: GrowthConfig, seeds: list[int]) -> tuple[_OracleRun, list[BatchedPath]]:
    """The oracle and one batched gradient path per policy, batched over ``seeds``, all in ``config``'s reduction."""
    spec, params = config.spec, DEFAULT_PARAMS
    initial = [InitialWeights(spec, seed) for seed in seeds]
    reduction = make_reduction(config.reduction)
    buffers: dict[torch.dtype, torch.Tensor] = {}  # one initial buffer per dtype, not per policy (slow at world 512)

    def batched(policy, marker: Marker) -> BatchedPath:
        path = PathConfig(steps=config.steps, gas=config.gas, marker=marker)
        if policy.grad_dtype not in buffers:
            buffers[policy.grad_dtype] = initial_buffer(spec, params, initial, policy.grad_dtype)
        return BatchedPath(spec, params, policy, path, buffers[policy.grad_dtype], seeds, reduction=reduction)

    policies = [get_policy(n) for n in config.policies]
    oracle_run = _OracleRun(spec, params, initial, len(seeds), config.gas, reduction)
    return oracle_run, [batched(p, config.marker) for p in policies]


def _resume_synthetic(ckpt: Path, key: str, runs: list, recorded: np.ndarray, metrics: np.ndarray) -> int:
    """Load ``ckpt`` into ``runs`` and ``metrics`` when it belongs to this run (``key``); the step it resumes at
    (0: from the start)."""
    from safetensors.torch import load_file

    if not ckpt.exists():
        return 0
    loaded = load_file(str(ckpt))
    if loaded["key"].numpy().tobytes().decode() != key:
        return 0
    start = int(loaded["step"].item())
    for i, run in enumerate(runs):
        run.load({k: loaded[f"run{i}.{k}"] for k in ("master", "adam_m", "adam_v", "lp")}, start)
    rows = int(np.searchsorted(recorded, start, side="right"))
    metrics[:rows] = loaded["metrics"].numpy()[:rows]
    return start


def _save_synthetic(ckpt: Path, key: str, step: int, runs: list, metrics: np.ndarray) -> None:
    """The checkpoint after ``step``: every run's state and the metrics rows recorded so far."""
    from safetensors.torch import save_file

    tensors = {
        "step": torch.tensor(step, dtype=torch.int64),
        "key": torch.frombuffer(bytearray(key.encode()), dtype=torch.uint8),
        "metrics": torch.from_numpy(metrics.copy()),
    }
    for i, run in enumerate(runs):
        for k, t in run.state().items():
            tensors[f"run{i}.{k}"] = t.contiguous()
    atomic_write(ckpt, lambda tmp: save_file(tensors, str(tmp)))


def _bar(progress: bool, total: int, initial: int, desc: str):
    """A tqdm bar in steps, or None without ``progress``."""
    if not progress:
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc=desc, unit="step")


KINDS = ("master", "m", "v")
"""The state tensors whose divergence from the oracle the metrics record (`COLUMNS`' master, adam_m, adam_v)."""


class _OracleRun:
    """The independent FP32 oracle (`simdist.gradpath.oracle.Oracle`) batched over seeds, stepped like a
    `BatchedPath`: ``run_step(draw)``, ``state()``, ``load(state, step)``."""

    def __init__(self, spec, params, initial, seeds: int, gas: int, reduction) -> None:
        stacked = {
            (r, p.name): torch.stack([init(r, p).to(torch.bfloat16) for init in initial])
            for r in range(spec.world_size)
            for p in params
        }
        self.oracle = Oracle(spec, params, stacked, tp_reduction=reduction, dp_reduction=reduction)
        self.spec, self.params, self.gas, self.step = spec, params, gas, 0

    def run_step(self, draw) -> None:
        def local(micro: int, lp) -> dict:
            return draw(self.step, micro)  # {name: [seed, rank, *shape]}: every rank's gradients at once

        self.oracle.step(self.step, self.gas, local)
        self.step += 1

    def state(self) -> dict[str, torch.Tensor]:
        return self.oracle.state()

    def load(self, state: dict[str, torch.Tensor], step: int) -> None:
        self.oracle.load(state, step)
        self.step = step


def _moe_rows(records, steps: int) -> np.ndarray:
    """``[step, MOE_COLUMNS]`` from `simdist.studies.training.StepRecord`s: losses, norms, pooled divergences."""
    rows = np.zeros((steps, len(MOE_COLUMNS)), dtype=np.float64)
    for record in records:
        row = {
            "loss": record.loss,
            "matched_loss": record.matched_loss,
            "loss_diff": abs(record.loss - record.matched_loss),
            "grad_norm": record.grad_norm,
            "matched_grad_norm": record.matched_grad_norm,
        }
        for kind, prefix in (("param", "param"), ("local grad", "grad")):
            pooled = Difference.pool(d for (_, k), d in record.tensors.items() if k == kind)
            row[f"{prefix}_rel"] = pooled.norm_relative
            row[f"{prefix}_ulp_max"] = pooled.max_ulp
            row[f"{prefix}_differ"] = pooled.fraction_differing
        rows[record.step] = [row[c] for c in MOE_COLUMNS]
    return rows


def _run_moe(config: GrowthConfig, ckpt: Path, key: str, progress: bool, stop_after: int | None) -> np.ndarray:
    """Each (policy, seed) run of the MoE block next to the matched FP32 policy
    (`simdist.studies.training.train`), in turn.

    The checkpoint holds the rows of the finished runs (``done[policy, seed]``)
    and is rewritten after each; an unfinished run restarts from step 0.
    """
    from simdist.sources.moe import MoEConfig
    from simdist.studies.training import train

    metrics = np.zeros((config.steps, len(config.policies), config.seeds, len(MOE_COLUMNS)), dtype=np.float64)
    done = np.zeros((len(config.policies), config.seeds), dtype=np.uint8)
    _resume_moe(ckpt, key, done, metrics)
    bar = _bar(progress, done.size * config.steps, int(done.sum()) * config.steps, "growth moe")
    finished = 0
    try:
        for s in range(config.seeds):
            for j, name in enumerate(config.policies):
                if done[j, s]:
                    continue
                records = train(
                    config.spec,
                    name,
                    steps=config.steps,
                    gas=config.gas,
                    seed=config.seed + s,
                    marker=config.marker,
                    model=MoEConfig(),
                )
                metrics[:, j, s] = _moe_rows(records, config.steps)
                done[j, s] = 1
                _save_moe(ckpt, key, done, metrics)
                if bar is not None:
                    bar.update(config.steps)
                finished += 1
                if stop_after is not None and finished >= stop_after and not done.all():
                    raise _Interrupted(f"stopped after {finished} runs")
    finally:
        if bar is not None:
            bar.close()
    return metrics


def _resume_moe(ckpt: Path, key: str, done: np.ndarray, metrics: np.ndarray) -> None:
    """Load ``ckpt``'s finished runs into ``done`` and ``metrics`` when it belongs to this run (``key``)."""
    from safetensors.torch import load_file

    if ckpt.exists():
        loaded = load_file(str(ckpt))
        if loaded["key"].numpy().tobytes().decode() == key and "done" in loaded:
            done[:] = loaded["done"].numpy()
            metrics[:] = loaded["metrics"].numpy()


def _save_moe(ckpt: Path, key: str, done: np.ndarray, metrics: np.ndarray) -> None:
    """The checkpoint after a finished (policy, seed) run: which runs are done and every row."""
    from safetensors.torch import save_file

    tensors = {
        "key": torch.frombuffer(bytearray(key.encode()), dtype=torch.uint8),
        "done": torch.from_numpy(done.copy()),
        "metrics": torch.from_numpy(metrics.copy()),
    }
    atomic_write(ckpt, lambda tmp: save_file(tensors, str(tmp)))


def clean(out: str | Path) -> None:
    """Remove a growth run directory."""
    shutil.rmtree(out, ignore_errors=True)
