"""Case ``deepspeed-gas-marker``: which micro-steps does DeepSpeed's correction-once marker leave uncorrected?

Question: with gradient accumulation (GAS >= 2), on which micro-steps does
DeepSpeed 0.19.8's real ``BF16_Optimizer`` skip the AutoEP+AutoTP folding
correction, on the epilogue path (the default, ``immediate_grad_update:
false``) and on the immediate (hooks) path; does simdist's
``marker="deepspeed"`` transcription skip the same ones, bit for bit; and how
far is the shipped accumulation from the per-micro-step semantics (every
micro-step corrected) that the oracles use?

Real code: ``BF16_Optimizer._update_hp_grad`` ->
``auto_ep_folding.apply_folding_correction_to_grad_buffer`` (sets the marker),
``accumulate_hp_grads_and_remove_lp`` (clears it per hook), the engine's
boundary pass (clears it at the boundary), on real gloo processes
(`simdist.cases.deepspeed.harness`).

Compared with: ``bf16_writeback`` on simdist's gradient path with
``marker="deepspeed"`` (must equal) and ``marker="per_micro_step"`` (the
intended semantics; the error figures).

The standalone reproducer (torch + deepspeed only, for DeepSpeed's
maintainers) is `REPRODUCER`; `write_reproducer` copies it out.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from simdist.cases.base import Case
from simdist.cases.compare import Match, match_traces
from simdist.cases.deepspeed.harness import DsRun, RankCapture, deepspeed_rank
from simdist.cases.deepspeed.issue_8913 import Config as Config8913
from simdist.cases.deepspeed.issue_8913 import transcription
from simdist.cases.ranks import DEEPSPEED_MODULES, CaseWhere, run_ranks
from simdist.gradpath.kernel import Marker, UpdatePath
from simdist.gradpath.policy import Policy
from simdist.gradpath.probes import Trace
from simdist.policies.catalogue import get_policy
from simdist.sources.synthetic import Inputs, describe_inputs
from simdist.studies.power import PowerCheck, shows_power
from simdist.world.spec import DEFAULT_SPEC, ParallelSpec

NAME = "deepspeed-gas-marker"
REPRODUCER = resources.files("simdist.cases") / "reproducers" / "deepspeed_gas_marker.py"
"""The standalone script, package data of `simdist.cases` (not a module)."""


@dataclass(frozen=True)
class Config:
    spec: ParallelSpec = DEFAULT_SPEC
    gas: int = 4
    steps: int = 1
    seed: int = 0
    inputs: Inputs = Inputs.ROUNDING
    """The synthetic gradients' distribution (`Inputs`; ``narrow``, the old one, as a named variant)."""

    def base(self, marker: Marker) -> Config8913:
        return Config8913(self.spec, self.steps, self.seed, (self.gas,), marker=marker, inputs=Inputs(self.inputs))

    def runs(self) -> tuple[DsRun, ...]:
        return tuple(DsRun(path, self.gas, self.steps) for path in (UpdatePath.EPILOGUE, UpdatePath.HOOKS))


@dataclass
class ParamError:
    """One parameter's accumulated gradient at the boundary against the per-micro-step semantics."""

    param: str
    relative_error: float
    """``||shipped - intended|| / ||intended||`` over every rank and step (FP32 hp gradients)."""
    max_abs_error: float


@dataclass
class PathFinding:
    update_path: str
    skipped_micro_steps: dict[str, list[int]]
    """Per parameter, the micro-steps (of step 0) where the real helper skipped the correction (marker set)."""
    real_vs_transcription: Match
    real_vs_per_micro_step: Match
    errors: list[ParamError] = field(default_factory=list)


@dataclass
class MarkerVerdict:
    ok: bool
    summary: str
    gas: int
    deepspeed_version: str
    paths: list[PathFinding]
    reproducer: str
    inputs: str = ""
    """The input distribution (`describe_inputs`)."""
    power_checks: list[PowerCheck] = field(default_factory=list)
    """``marker_never_set`` (the per-micro-step transcription must differ from DeepSpeed on the epilogue path:
    else the case could not see the marker) and ``writeback_removed`` (``bf16_writeback`` without its BF16
    write-back must differ from DeepSpeed on both paths). ``ok`` needs both."""


def _norm_error(a: list[Trace], b: list[Trace], gas: int) -> list[ParamError]:
    found: dict[str, list[float]] = {}
    for ta, tb in zip(a, b, strict=True):
        for key, value in ta.values.items():
            if key[3] != "hp" or key[1] != gas - 1:
                continue
            diff = value.double() - tb.values[key].double()
            acc = found.setdefault(key[2], [0.0, 0.0, 0.0])
            acc[0] += float((diff**2).sum())
            acc[1] += float((tb.values[key].double() ** 2).sum())
            acc[2] = max(acc[2], float(diff.abs().max()))
    return [ParamError(p, (e / n) ** 0.5 if n else 0.0, m) for p, (e, n, m) in sorted(found.items())]


def judge(config: Config, real: dict[DsRun, list[RankCapture]], policy: Policy | None = None) -> MarkerVerdict:
    """The verdict from the real captures and simdist's transcription of ``policy`` (default bf16_writeback)."""
    policy = policy or get_policy("bf16_writeback")
    paths = [_path_finding(config, run, real[run], policy) for run in config.runs()]
    version = real[config.runs()[-1]][0].deepspeed_version  # the last run's, as each run's is the same
    epilogue, hooks = paths
    later = list(range(1, config.gas))
    power = _power_checks(config, real, policy, epilogue)
    ok = (
        all(p.real_vs_transcription.bitwise_equal for p in paths)
        and epilogue.skipped_micro_steps.get("router.weight") == later
        and not hooks.skipped_micro_steps
        and hooks.real_vs_per_micro_step.bitwise_equal
        and shows_power(power)
    )
    verdict = MarkerVerdict(ok, "", config.gas, version, paths, str(REPRODUCER), describe_inputs(config.inputs), power)
    verdict.summary = summarize(verdict)
    return verdict


def _path_finding(config: Config, run: DsRun, captures: list[RankCapture], policy: Policy) -> PathFinding:
    """One update path's real captures against simdist's transcription, with the shipped marker and with the
    intended one (the correction every micro-step), and the micro-steps where DeepSpeed skipped the correction."""
    traces = [c.trace for c in captures]
    skipped: dict[str, list[int]] = {}
    for (step, micro, param), action in sorted(captures[0].actions.items()):
        if step == 0 and action.startswith("skipped"):
            skipped.setdefault(param, []).append(micro)
    shipped = transcription(config.base(Marker.DEEPSPEED), policy, run.update_path, config.gas)
    intended = transcription(config.base(Marker.PER_MICRO_STEP), policy, run.update_path, config.gas)
    return PathFinding(
        run.update_path,
        skipped,
        match_traces(traces, shipped, names=("DeepSpeed", f"{policy.name} marker=deepspeed")),
        match_traces(traces, intended, names=("DeepSpeed", f"{policy.name} marker=per_micro_step")),
        [e for e in _norm_error(traces, intended, config.gas) if e.relative_error > 0],
    )


def _power_checks(
    config: Config, real: dict[DsRun, list[RankCapture]], policy: Policy, epilogue: PathFinding
) -> list[PowerCheck]:
    """The two controls: a marker never set, and the policy without its write-back, must each differ from the
    real captures (else the verdict could not see that error)."""
    no_writeback = dataclasses.replace(policy, name="control_no_writeback", writeback=None)
    removed = [
        match_traces(
            [c.trace for c in real[run]],
            transcription(config.base(Marker.DEEPSPEED), no_writeback, run.update_path, config.gas),
        )
        for run in config.runs()
    ]
    marker = epilogue.real_vs_per_micro_step
    return [
        PowerCheck(
            "marker_never_set",
            "the transcription corrects every micro-step (the marker never set)",
            True,
            not marker.bitwise_equal,
            marker.compared - marker.equal,
            marker.compared,
            f"DeepSpeed on the {epilogue.update_path} path",
            unit="captures",
        ),
        PowerCheck(
            "writeback_removed",
            "bf16_writeback without its BF16 write-back",
            True,
            all(not m.bitwise_equal for m in removed),
            sum(m.compared - m.equal for m in removed),
            sum(m.compared for m in removed),
            "DeepSpeed on both paths",
            unit="captures",
        ),
    ]


def summarize(v: MarkerVerdict) -> str:
    lines = [f"real DeepSpeed {v.deepspeed_version}, GAS {v.gas}, correction-once marker:"]
    for p in v.paths:
        same = "==" if p.real_vs_transcription.bitwise_equal else "!="
        lines.append(
            f"  {p.update_path}: DeepSpeed {same} simdist marker=deepspeed "
            f"({p.real_vs_transcription.equal}/{p.real_vs_transcription.compared} captures bitwise)"
        )
        if p.skipped_micro_steps:
            skipped = "; ".join(f"{param} {steps}" for param, steps in p.skipped_micro_steps.items())
            lines.append(f"  {p.update_path}: TP correction SKIPPED on micro-steps: {skipped}")
        else:
            lines.append(f"  {p.update_path}: every micro-step corrected")
        if p.errors:
            errors = ", ".join(f"{e.param} {e.relative_error:.3f}" for e in p.errors)
            lines.append(
                f"  {p.update_path}: accumulated hp grad vs per-micro-step semantics, relative error: {errors}"
            )
        elif p.real_vs_per_micro_step.bitwise_equal:
            lines.append(f"  {p.update_path}: bitwise equal to the per-micro-step semantics")
    lines.append(f"  inputs: {v.inputs}")
    lines += [f"  power check {c.line}" for c in v.power_checks]
    lines.append(f"standalone reproducer (torchrun --standalone --nproc-per-node 4): {v.reproducer}")
    lines.append(
        "verdict: "
        + ("the transcription reproduces DeepSpeed's marker on both paths" if v.ok else "MISMATCH (see above)")
    )
    return "\n".join(lines)


def write_reproducer(path: str | Path) -> Path:
    """Copy the standalone reproducer script to ``path`` (a file or a directory); return the file."""
    target = Path(path)
    if target.is_dir():
        target = target / REPRODUCER.name
    target.write_bytes(REPRODUCER.read_bytes())
    return target


def run_real(config: Config, where: CaseWhere = "gloo") -> dict[DsRun, list[RankCapture]]:
    runs = config.runs()
    per_rank = run_ranks(
        deepspeed_rank,
        config.spec,
        runs,
        config.seed,
        Inputs(config.inputs).value,
        where=where,
        preload=DEEPSPEED_MODULES,
    )
    return {run: [captures[i] for captures in per_rank] for i, run in enumerate(runs)}


def run(where: CaseWhere = "gloo", **options) -> MarkerVerdict:
    config = dataclasses.replace(Config(), **options)
    return judge(config, run_real(config, where))


CASE = Case(
    name=NAME,
    question="With GAS >= 2, which micro-steps does DeepSpeed's correction-once marker leave uncorrected on each "
    "update path, does simdist's marker=deepspeed skip the same ones, and how large is the error?",
    real_code="BF16_Optimizer._update_hp_grad / accumulate_hp_grads_and_remove_lp + auto_ep_folding marker + the "
    "engine's boundary pass, GAS 4, 4 gloo processes; plus a standalone torchrun reproducer",
    policies=("bf16_writeback",),
    requires=("deepspeed",),
    run=run,
)
