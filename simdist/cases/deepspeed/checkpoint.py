"""Case ``deepspeed-checkpoint``: does a checkpoint cross the #8913 fix on the real DeepSpeed engine?

Question: with ``BF16_Optimizer`` (bf16, ZeRO stage 1 + ``grad_accum_dtype: fp32``, the set-up of the
``deepspeed-wrappers`` case: AutoEP+AutoTP folding, TP2/DP2/EP2 on 4 processes), can a checkpoint written by
the shipped code (``engine.save_checkpoint``) be loaded with the FP32-staging fix patched in
(``engine.load_checkpoint``) and training continued -- and the reverse? What changes, what stays bit-identical?

Scenarios (``N`` steps, save, a fresh engine loads and trains ``M`` more; gradients of step ``k`` are the same
seeded synthetic gradients in every scenario):

* ``shipped N+M`` / ``fixed N+M``: uninterrupted references;
* ``shipped -> shipped``, ``fixed -> fixed``: the controls; equal to their uninterrupted reference bit for bit
  unless the checkpoint is lossy;
* ``shipped -> fixed``, ``fixed -> shipped``: across the fix.

State compared, read directly from the optimizer (no ``safe_get_full_*``: see ``fragment_probe``): the BF16
model parameters, ``BF16_Optimizer.fp32_groups_flat_partition`` (FP32 masters) and the base optimizer's state
(``exp_avg``, ``exp_avg_sq``, ``step``) of each flat partition, on every rank.

The checkpoint files of the shipped and the fixed run are compared by key path, dtype and shape (the format)
and by value. ``fragment_probe`` checks DeepSpeed's own accessor state after ``load_checkpoint``: whether each
parameter's ``_hp_mapping.optim_fragment`` is linked (``safe_get_full_optimizer_state`` reads it).
"""

from __future__ import annotations

import os
import tempfile
import time
import types
from dataclasses import dataclass, field
from typing import Any

import torch

from simdist.cases.base import Case
from simdist.cases.ranks import DEEPSPEED_MODULES, CaseWhere, run_ranks
from simdist.errors import UsageError
from simdist.numerics.floats import bits
from simdist.sources.synthetic import Inputs, describe_inputs
from simdist.studies.power import PowerCheck, shows_power
from simdist.world.spec import ParallelSpec

NAME = "deepspeed-checkpoint"
GROUPS = ("bf16 params", "fp32 master", "exp_avg", "exp_avg_sq", "step")
MUTATIONS = ("", "skip-optimizer-load", "skip-fp32-load")
"""Deliberate breakages for the tests: don't load the optimizer state / the FP32 masters (must flip a control)."""

COMPARISONS = (
    ("load restores (shipped)", "shipped -> shipped at load", "shipped at save"),
    ("load restores (fixed)", "fixed -> fixed at load", "fixed at save"),
    ("load restores (across)", "shipped -> fixed at load", "shipped at save"),
    ("load restores (across)", "fixed -> shipped at load", "fixed at save"),
    ("control shipped", "shipped -> shipped", "shipped N+M"),
    ("control fixed", "fixed -> fixed", "fixed N+M"),
    ("shipped ckpt, fixed after", "shipped -> fixed", "fixed N+M"),
    ("shipped ckpt, fixed after", "shipped -> fixed", "shipped N+M"),
    ("fixed ckpt, shipped after", "fixed -> shipped", "shipped N+M"),
    ("fixed ckpt, shipped after", "fixed -> shipped", "fixed N+M"),
    ("fix effect (no checkpoint)", "fixed N+M", "shipped N+M"),
)


CLIP = 0.05
"""As in ``deepspeed-wrappers``: below the synthetic gradients' norm, so clipping is active."""


def _run(fixed: bool, steps: int):
    """The engine configuration: ``communication_data_type: fp32`` (with the default bf16 DP all-reduce the
    fix changes no bit of the state at GAS 1: both paths round the router's TP average to BF16 once)."""
    from simdist.cases.deepspeed.engine import EngineRun

    return EngineRun(
        "bf16_optimizer",
        gas=1,
        steps=steps,
        fix="fp32_staging" if fixed else "none",
        comm_dtype="fp32",
        clip=CLIP,
        audit=False,
    )


def _engine(comm, fixed: bool, seed: int):
    """A fresh real engine (the ``deepspeed-wrappers`` set-up), the fix patched in when ``fixed``."""
    import deepspeed

    from simdist.cases.deepspeed import engine as de
    from simdist.sources.synthetic import InitialWeights

    spec, rank = comm.spec, comm.get_rank()
    de.init_comm()
    de.reset_groups()
    run = _run(fixed, 1)
    module = de.SyntheticModule(run.params(), InitialWeights(spec, seed), rank)
    groups = de.mark_families(module, run.params(), spec.ep)
    optimizer = torch.optim.AdamW(groups, lr=de.LR, betas=de.BETAS, eps=de.EPS, weight_decay=de.WEIGHT_DECAY)
    with de.no_model_injection():
        engine, *_ = deepspeed.initialize(model=module, optimizer=optimizer, config=run.config(spec))
    if fixed:
        engine.optimizer._update_hp_grad = types.MethodType(de.staged_update_hp_grad, engine.optimizer)
    return engine


def _train(comm, engine, steps: range, seed: int, inputs: str) -> None:
    from simdist.sources.synthetic import synthetic_gradients

    source, rank = synthetic_gradients(comm.spec, seed, inputs), comm.get_rank()
    params = _run(False, 1).params()
    for step in steps:
        engine.module.grads = {p.name: source(step, 0, rank, p) for p in params}
        loss = engine(torch.tensor([step, 0]))
        engine.backward(loss)
        engine.step()


def snapshot(engine) -> dict[str, dict[str, torch.Tensor]]:
    """The training state, read directly: BF16 params, FP32 flat partitions, base optimizer state per group."""
    opt = engine.optimizer
    out: dict[str, dict[str, torch.Tensor]] = {g: {} for g in GROUPS}
    for name, p in engine.module.named_parameters():
        out["bf16 params"][name] = p.detach().clone()
    for i, flat in enumerate(opt.fp32_groups_flat_partition):
        out["fp32 master"][f"group {i}"] = flat.detach().clone()
        state = opt.optimizer.state.get(flat, {})
        for key in ("exp_avg", "exp_avg_sq", "step"):
            if key in state:
                out[key][f"group {i}"] = torch.as_tensor(state[key]).detach().clone()
    return out


def fragment_probe(engine) -> dict[str, int]:
    """How many parameters' ``_hp_mapping`` have an unlinked optimizer fragment (``optim_fragment is None``).

    ``safe_get_full_optimizer_state`` calls ``get_optim_state_fragment`` (``key in self.optim_fragment``): a
    ``TypeError`` on such a rank, while ranks holding no fragment of that parameter wait in its all-reduce.
    The probe calls the same local method, no collective.
    """
    counts = {"mapped": 0, "unlinked (TypeError)": 0}
    for _, p in engine.module.named_parameters():
        mapping = getattr(p, "_hp_mapping", None)
        if mapping is None:
            continue
        counts["mapped"] += 1
        try:
            mapping.get_optim_state_fragment("exp_avg")
        except TypeError:
            counts["unlinked (TypeError)"] += 1
    return counts


def _flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    """Key path -> leaf of a checkpoint object (dicts, lists, tuples; tensors and other leaves)."""
    if isinstance(obj, dict):
        out: dict[str, Any] = {}
        for k, v in obj.items():
            out.update(_flatten(v, f"{prefix}/{k}"))
        return out
    if isinstance(obj, (list, tuple)) and any(isinstance(v, (dict, list, tuple, torch.Tensor)) for v in obj):
        out = {}
        for i, v in enumerate(obj):
            out.update(_flatten(v, f"{prefix}[{i}]"))
        return out
    return {prefix: obj}


def describe_dir(path: str) -> dict[str, dict[str, Any]]:
    """``file -> key path -> leaf`` of every ``.pt`` file under a checkpoint directory."""
    out = {}
    for root, _, files in os.walk(path):
        for f in sorted(files):
            if f.endswith(".pt"):
                rel = os.path.relpath(os.path.join(root, f), path).split(os.sep, 1)[-1]  # without the tag folder
                out[rel] = _flatten(torch.load(os.path.join(root, f), map_location="cpu", weights_only=False))
    return out


def checkpoint_rank(comm, n: int, m: int, root: str, seed: int, mutation: str, inputs: str = "rounding") -> dict:
    """Rank program: the six scenarios on fresh engines; snapshots, probes and (rank 0) the files' description."""
    from simdist.cases.stdout import stdout_to_stderr

    out: dict[str, Any] = {"snap": {}, "probe": {}, "errors": []}
    with stdout_to_stderr():
        for fixed in (False, True):
            tag = "fixed" if fixed else "shipped"
            engine = _engine(comm, fixed, seed)
            out["optimizer_class"] = type(engine.optimizer).__name__
            _train(comm, engine, range(n + m), seed, inputs)
            out["snap"][f"{tag} N+M"] = snapshot(engine)
            engine.destroy()
            engine = _engine(comm, fixed, seed)
            _train(comm, engine, range(n), seed, inputs)
            engine.save_checkpoint(os.path.join(root, tag), tag="ckpt")
            out["snap"][f"{tag} at save"] = snapshot(engine)
            # the same engine loads its own checkpoint after stepping: are the accessor fragments relinked?
            engine.load_checkpoint(os.path.join(root, tag), tag="ckpt")
            out["probe"][f"{tag}: stepped engine, after load"] = fragment_probe(engine)
            _train(comm, engine, range(n, n + 1), seed, inputs)
            out["probe"][f"{tag}: stepped engine, after load + 1 step"] = fragment_probe(engine)
            engine.destroy()
        for saved in ("shipped", "fixed"):
            for after in ("shipped", "fixed"):
                engine = _engine(comm, after == "fixed", seed)
                out["probe"][f"{saved} -> {after}: fresh engine, before load"] = fragment_probe(engine)
                engine.load_checkpoint(
                    os.path.join(root, saved),
                    tag="ckpt",
                    load_optimizer_states=mutation != "skip-optimizer-load",
                )
                if mutation == "skip-fp32-load":
                    engine.optimizer.refresh_fp32_params()  # masters from the BF16 weights, not the saved FP32
                out["probe"][f"{saved} -> {after}: fresh engine, after load"] = fragment_probe(engine)
                out["snap"][f"{saved} -> {after} at load"] = snapshot(engine)
                _train(comm, engine, range(n, n + m), seed, inputs)
                out["probe"][f"{saved} -> {after}: fresh engine, after load + {m} step"] = fragment_probe(engine)
                out["snap"][f"{saved} -> {after}"] = snapshot(engine)
                engine.destroy()
    comm.barrier()
    if comm.get_rank() == 0:
        out["files"] = {tag: describe_dir(os.path.join(root, tag)) for tag in ("shipped", "fixed")}
    return out


# -- judging ------------------------------------------------------------------------------------------------------


@dataclass
class Cell:
    """One comparison x tensor group, over all ranks."""

    comparison: str
    got: str
    want: str
    group: str
    compared: int
    differing: int
    max_abs: float

    @property
    def verdict(self) -> str:
        return "bitwise" if not self.differing else f"differs {self.differing}/{self.compared}, max {self.max_abs:.1e}"


@dataclass
class CheckpointVerdict:
    ok: bool
    summary: str
    deepspeed_version: str
    where: str
    layout: str
    optimizer_class: str
    steps: tuple[int, int]
    mutation: str
    seconds: float
    cells: list[Cell] = field(default_factory=list)
    files: list[str] = field(default_factory=list)
    """Every checkpoint file, with its FP32/BF16 tensors counted."""
    contents: dict[str, str] = field(default_factory=dict)
    """``file -> what it holds`` (dtypes of the FP32 partitions, optimizer state, module weights)."""
    format_identical: bool = False
    """Same files, key paths, dtypes and shapes in the shipped and the fixed checkpoint."""
    format_differences: list[str] = field(default_factory=list)
    value_differences: list[str] = field(default_factory=list)
    """Tensor leaves (per file kind, summed over the ranks' files) whose values differ between the shipped and the
    fixed checkpoint: ``differing/compared`` elements."""
    probes: dict[str, str] = field(default_factory=dict)
    """``scenario -> ranks: mapped params, unlinked fragments`` (`fragment_probe`)."""
    inputs: str = ""
    """The synthetic gradients' distribution (`simdist.sources.synthetic.describe_inputs`)."""
    power_checks: list[PowerCheck] = field(default_factory=list)
    """`fix_changes_state`; ``ok`` needs every one."""


def compare(per_rank: list[dict], got: str, want: str, group: str, comparison: str) -> Cell:
    """Bitwise comparison of one tensor group of two scenarios over every rank."""
    compared = differing = 0
    max_abs = 0.0
    for r in per_rank:
        a, b = r["snap"][got][group], r["snap"][want][group]
        for key in sorted(set(a) | set(b)):
            x, y = a.get(key), b.get(key)
            if x is None or y is None or x.shape != y.shape or x.dtype != y.dtype:
                n = max(x.numel() if x is not None else 0, y.numel() if y is not None else 0)
                compared, differing, max_abs = compared + n, differing + n, float("inf")
                continue
            diff = bits(x) != bits(y)
            compared += x.numel()
            k = int(diff.sum())
            if k:
                differing += k
                max_abs = max(max_abs, float((x.double() - y.double()).abs()[diff].max()))
    return Cell(comparison, got, want, group, compared, differing, max_abs)


def _leaf_sig(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        return f"tensor {str(v.dtype).replace('torch.', '')} {tuple(v.shape)}"
    return type(v).__name__


def _files(files: dict) -> tuple[bool, list[str], list[str], list[str], dict[str, str]]:
    shipped, fixed = files["shipped"], files["fixed"]
    fmt: list[str] = []
    values: list[str] = []
    listing: list[str] = []
    contents: dict[str, str] = {}
    per_key: dict[str, list[int]] = {}
    for f in sorted(set(shipped) | set(fixed)):
        if f not in shipped or f not in fixed:
            fmt.append(f"{f}: only in {'fixed' if f in fixed else 'shipped'}")
            continue
        a, b = shipped[f], fixed[f]
        for key in sorted(set(a) | set(b)):
            if key not in a or key not in b:
                fmt.append(f"{f}{key}: only in {'fixed' if key in b else 'shipped'}")
            elif _leaf_sig(a[key]) != _leaf_sig(b[key]):
                fmt.append(f"{f}{key}: {_leaf_sig(a[key])} vs {_leaf_sig(b[key])}")
            elif isinstance(a[key], torch.Tensor):
                k = int((bits(a[key]) != bits(b[key])).sum())
                path = key.rsplit("/", 3)[-1] if "/state/" in key else key.rsplit("/", 1)[-1]
                total = per_key.setdefault(f"{f.split('_rank')[0]}: {path}", [0, 0])
                total[0], total[1] = total[0] + k, total[1] + a[key].numel()
        tensors = {k: v for k, v in a.items() if isinstance(v, torch.Tensor)}
        by_dtype: dict[str, int] = {}
        for v in tensors.values():
            d = str(v.dtype).replace("torch.", "")
            by_dtype[d] = by_dtype.get(d, 0) + v.numel()
        listing.append(f"{f}: {len(tensors)} tensors, " + ", ".join(f"{n} {d}" for d, n in sorted(by_dtype.items())))
        contents[f] = "; ".join(f"{k} {_leaf_sig(v)}" for k, v in sorted(tensors.items()) if v.numel() > 1)
    values = [f"{k} {d}/{n}" for k, (d, n) in per_key.items() if d]
    return not fmt, fmt, values, listing, contents


def run(
    where: CaseWhere = "gloo",
    n: int = 1,
    m: int = 1,
    mutation: str = "",
    seed: int = 0,
    timeout_s: float = 900.0,
    inputs: str = "rounding",
) -> CheckpointVerdict:
    """The six scenarios on 4 ranks (TP2/DP2/EP2), judged; ``mutation`` breaks the load on purpose (tests);
    ``inputs`` names the synthetic gradients' distribution (`simdist.sources.synthetic.Inputs`)."""
    import deepspeed

    if mutation not in MUTATIONS:
        raise UsageError(f"unknown mutation {mutation!r}; valid: {MUTATIONS}")
    spec = ParallelSpec(4, tp=2, ep=2)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="simdist-ckpt-") as root:
        args = (n, m, root, seed, mutation, Inputs(inputs).value)
        per_rank = run_ranks(checkpoint_rank, spec, *args, where=where, timeout_s=timeout_s, preload=DEEPSPEED_MODULES)
    cells = [
        compare(per_rank, got, want, group, comparison) for comparison, got, want in COMPARISONS for group in GROUPS
    ]
    same, fmt, values, listing, contents = _files(per_rank[0]["files"])
    probes = {}
    for key in per_rank[0]["probe"]:
        probes[key] = "; ".join(
            f"r{i}: {p['probe'][key]['unlinked (TypeError)']}/{p['probe'][key]['mapped']}"
            for i, p in enumerate(per_rank)
        )
    verdict = CheckpointVerdict(
        ok=False,
        summary="",
        deepspeed_version=deepspeed.__version__,
        where=where,
        layout=spec.describe(),
        optimizer_class=", ".join(sorted({r["optimizer_class"] for r in per_rank})),
        steps=(n, m),
        mutation=mutation,
        seconds=time.perf_counter() - start,
        cells=cells,
        files=listing,
        contents=contents,
        format_identical=same,
        format_differences=fmt,
        value_differences=values,
        probes=probes,
        inputs=describe_inputs(inputs),
    )
    verdict.power_checks = [fix_changes_state(verdict)]
    verdict.ok = controls_bitwise(verdict) and same and shows_power(verdict.power_checks)
    verdict.summary = summarize(verdict)
    return verdict


def fix_changes_state(v: CheckpointVerdict) -> PowerCheck:
    """Power check: the fix changes some compared state bit (``fix effect``), so the comparisons can see a change of
    the gradient path at all; inputs on which it changed nothing could not tell a lossy load from a good one."""
    cells = [c for c in v.cells if c.comparison.startswith("fix effect")]
    differing = sum(c.differing for c in cells)
    return PowerCheck(
        "fix_changes_state",
        "the FP32-staging fix applied (no checkpoint)",
        True,
        differing > 0,
        differing,
        sum(c.compared for c in cells),
        "the shipped run",
        unit="elements",
    )


def controls_bitwise(v: CheckpointVerdict) -> bool:
    """Both controls (save and load with the same code) equal the uninterrupted run in every tensor group."""
    return all(c.differing == 0 for c in v.cells if c.comparison.startswith("control"))


def table(v: CheckpointVerdict) -> str:
    """Markdown: one row per comparison, one column per tensor group."""
    lines = ["| comparison | got | want | " + " | ".join(GROUPS) + " |", "|" + "---|" * (len(GROUPS) + 3)]
    rows: dict[tuple[str, str, str], dict[str, Cell]] = {}
    for c in v.cells:
        rows.setdefault((c.comparison, c.got, c.want), {})[c.group] = c
    for (comparison, got, want), cells in rows.items():
        lines.append(
            f"| {comparison} | {got} | {want} | "
            + " | ".join(
                ("= (" + str(cells[g].compared) + ")" if not cells[g].differing else cells[g].verdict)
                if g in cells
                else "-"
                for g in GROUPS
            )
            + " |"
        )
    return "\n".join(lines)


def summarize(v: CheckpointVerdict) -> str:
    n, m = v.steps
    lines = [
        f"real DeepSpeed {v.deepspeed_version} engine, {v.optimizer_class}, {v.layout} ({v.where} processes): "
        f"{n} step(s), save_checkpoint, a fresh engine load_checkpoint, {m} step(s)"
        + (f" [MUTATION: {v.mutation}]" if v.mutation else ""),
        table(v),
        f"inputs: {v.inputs}; " + "; ".join(f"power check {c.line}" for c in v.power_checks),
        "checkpoint files (shipped; the fixed run's have the same keys/dtypes/shapes: "
        + ("yes" if v.format_identical else "NO: " + "; ".join(v.format_differences[:10]))
        + "):",
    ]
    lines += [f"  {f}" for f in v.files]
    lines.append(
        "values differing between the shipped and the fixed checkpoint: "
        + ("; ".join(v.value_differences) if v.value_differences else "none")
    )
    lines.append("accessor probe (per rank: params with an unlinked optimizer fragment / params with a fragment):")
    lines += [f"  {k}: {p}" for k, p in v.probes.items()]
    lines.append(f"time: {v.seconds:.0f} s")
    lines.append(
        "verdict: "
        + (
            "controls bitwise, format identical across the fix"
            if v.ok
            else "FAILED: " + ("a control differs (the checkpoint is lossy)" if not controls_bitwise(v) else "format")
        )
    )
    return "\n".join(lines)


CASE = Case(
    name=NAME,
    question="Does a DeepSpeed BF16_Optimizer checkpoint cross the #8913 FP32-staging fix (save shipped, load fixed, "
    "and back), and is a save/load itself bit-exact?",
    real_code="deepspeed.initialize + engine.backward/step + engine.save_checkpoint/load_checkpoint, bf16 "
    "BF16_Optimizer, AutoTP+AutoEP folding TP2/DP2/EP2 on 4 processes",
    policies=("the uninterrupted run of the same code (controls)",),
    requires=("deepspeed",),
    run=run,
)

__all__ = ["CASE", "compare", "fragment_probe", "run", "snapshot", "table"]
