"""Case ``deepspeed-8913``: does simdist's ``bf16_writeback`` compute what DeepSpeed's BF16_Optimizer computes?

Question: under AutoEP+AutoTP folding (TP2/EP2/ETP1 on 4 ranks), are the
high-precision gradients of DeepSpeed 0.19.8's real ``BF16_Optimizer`` after
every micro-step bitwise equal to simdist's ``bf16_writeback`` transcription
fed the same BF16 local gradients -- on the epilogue path (DeepSpeed's
default, ``update_hp_grads``) and the immediate path (``immediate_grad_update``,
``accumulate_hp_grads_and_remove_lp``), at GAS 1 and GAS 3? With the #8913
fix patched into the real optimizer (FP32 staging), does it equal simdist's
``fp32_staging``? And how far is DeepSpeed as shipped from the fixed code?

Real code: ``BF16_Optimizer`` (``configure_autoep_folding_tp_gradient_reduction``,
``backward_prologue``/``backward_epilogue``/``update_hp_grads``,
``accumulate_hp_grads_and_remove_lp`` through its own gradient hooks),
``auto_ep_folding`` (family strategies, correction marker, TP all-reduce)
and the engine's boundary folding pass, driven by
`simdist.cases.deepspeed.harness` on real gloo processes.

Compared with: the ``bf16_writeback`` and ``fp32_staging`` policies run by
simdist's gradient path (`simdist.gradpath.path.train_rank`) on SimWorld,
with ``marker="deepspeed"`` and the same update path.

`run` also runs a TP4 layout (`TP4_SPEC`, TP4/EP2/ETP1 on 4 ranks; epilogue path,
GAS 1, one step): with two TP peers an FP32 TP sum and a BF16 TP sum give the
same bits (the sum of two BF16 values is rounded once either way, and ``/2`` is
exact), so at TP2 the case cannot tell a transcription that sums TP in BF16
from the real code; with four peers the BF16 sum rounds three times and the
case fails such a transcription (``tests/integration/test_cases_deepspeed.py``).

Inputs: the ``rounding`` distribution by default (`simdist.sources.synthetic.Inputs`: 31 binades, per-rank
magnitudes, so FP32 and BF16 sums round); ``inputs="narrow"`` is the old one. The verdict names it.

Power checks (`CONTROLS`, run in every `judge` on the transcription side, no extra real launch): each
control is a transcription with one deliberate error, compared with the real captures it would stand for;
it must differ from them, or the case could not see that error and ``ok`` is false. The TP/DP order and
the expert group are not controls here: the case captures the hp gradient before the DP reduction (the
``repro 8913`` power checks cover them).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import cast

import torch

from simdist.cases.base import Case
from simdist.cases.compare import Figures, Match, figures, match_traces
from simdist.cases.deepspeed.harness import CORRECTED, DsRun, Fix, RankCapture, deepspeed_rank
from simdist.cases.ranks import DEEPSPEED_MODULES, CaseWhere, run_ranks
from simdist.errors import UsageError, coerce
from simdist.gradpath.kernel import Marker, UpdatePath
from simdist.gradpath.path import PathConfig, train_rank
from simdist.gradpath.policy import Policy
from simdist.gradpath.probes import Trace
from simdist.numerics.floats import unit_roundoff
from simdist.policies.catalogue import get_policy
from simdist.reduce import make_reduction
from simdist.sources.synthetic import DEFAULT_PARAMS, InitialWeights, Inputs, describe_inputs, synthetic_gradients
from simdist.studies.power import PowerCheck, shows_power
from simdist.world.simworld import SimWorld
from simdist.world.spec import DEFAULT_SPEC, ParallelSpec

NAME = "deepspeed-8913"

TP4_SPEC = ParallelSpec(4, tp=4, ep=2)
"""The TP4 layout `run` adds, where an FP32 and a BF16 TP sum differ."""

FIXES: tuple[Fix, ...] = ("none", "fp32_staging")
"""DeepSpeed as shipped and with the #8913 fix (FP32 staging)."""


@dataclass(frozen=True)
class Config:
    """Layout, steps and the update paths and GAS values to run."""

    spec: ParallelSpec = DEFAULT_SPEC
    steps: int = 2
    seed: int = 0
    gas: tuple[int, ...] = (1, 3)
    update_paths: tuple[UpdatePath, ...] = (UpdatePath.EPILOGUE, UpdatePath.HOOKS)
    marker: Marker = Marker.DEEPSPEED
    tp4: bool = True
    """`run` also runs `tp4_config` when ``spec`` has fewer than four TP ranks."""
    inputs: Inputs = Inputs.ROUNDING
    """The synthetic gradients' distribution (`Inputs`)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "inputs", coerce(Inputs, self.inputs, "inputs"))
        paths = tuple(coerce(UpdatePath, path, "update path") for path in self.update_paths)
        object.__setattr__(self, "update_paths", paths)
        object.__setattr__(self, "marker", coerce(Marker, self.marker, "marker"))

    def runs(self) -> tuple[DsRun, ...]:
        return tuple(
            DsRun(path, gas, self.steps, fix) for path in self.update_paths for gas in self.gas for fix in FIXES
        )


def tp4_config(config: Config) -> Config:
    """The TP4 run `run` adds to ``config``: `TP4_SPEC`, epilogue path, GAS 1, one step, same seed and marker."""
    return Config(
        spec=TP4_SPEC,
        steps=1,
        seed=config.seed,
        gas=(1,),
        update_paths=(UpdatePath.EPILOGUE,),
        marker=config.marker,
        tp4=False,
        inputs=config.inputs,
    )


@dataclass
class PathResult:
    """One update path at one GAS: real vs transcription, patched vs fix, shipped vs FP32 staging."""

    update_path: str
    gas: int
    real_vs_bf16_writeback: Match
    patched_vs_fp32_staging: Match
    shipped_vs_fp32_staging: Figures
    skipped_corrections: list[str]
    """``step s micro-step m: params`` where the real helper skipped the TP correction (marker set)."""


@dataclass
class Verdict8913:
    ok: bool
    summary: str
    deepspeed_version: str
    where: str
    layout: str
    strategies: dict[str, str]
    strategies_agree: bool
    paths: list[PathResult] = field(default_factory=list)
    bf16_unit_roundoff: float = unit_roundoff(torch.bfloat16)
    tp4: Verdict8913 | None = None
    """The verdict of the TP4 run (`tp4_config`), when `run` made one; ``ok`` includes it."""
    inputs: str = ""
    """The input distribution (`describe_inputs`)."""
    power_checks: list[PowerCheck] = field(default_factory=list)
    """The controls (`CONTROLS`) and whether each changed the compared bits; ``ok`` needs every applicable one."""
    findings_hold: bool = False
    """The findings alone (strategies agree, real == transcription bitwise on every path), before the power checks."""


def run_real(config: Config, where: CaseWhere = "gloo") -> dict[DsRun, list[RankCapture]]:
    """Every run of ``config`` on real DeepSpeed, in one launch of ``world_size`` ranks."""
    runs = config.runs()
    per_rank = run_ranks(
        deepspeed_rank, config.spec, runs, config.seed, config.inputs.value, where=where, preload=DEEPSPEED_MODULES
    )
    return {run: [captures[i] for captures in per_rank] for i, run in enumerate(runs)}


def transcription(
    config: Config, policy: Policy, update_path: UpdatePath, gas: int, marker: Marker | None = None
) -> list[Trace]:
    """simdist's traces of ``policy`` on SimWorld for the same inputs (gloo's reduction order): the synthetic
    workload `simdist.studies.repro.run` trains (written here so that this module does not import the study
    that loads it for ``--code deepspeed``)."""
    path = PathConfig(
        steps=config.steps,
        gas=gas,
        seed=config.seed,
        marker=marker or config.marker,
        update_path=update_path,
    )
    spec, seed = config.spec, config.seed
    world = SimWorld(spec, reduction=make_reduction("gloo"))
    grads = synthetic_gradients(spec, seed, config.inputs)
    return world.run(train_rank, list(DEFAULT_PARAMS), InitialWeights(spec, seed), grads, policy, path)


CONTROLS: dict[str, str] = {
    "bf16_tp_sum": "fp32_staging with its TP sum (and /tp) in BF16, against patched DeepSpeed",
    "writeback_bf16_tp_sum": "bf16_writeback with its TP sum in BF16, against DeepSpeed as shipped (at TP2 a "
    "two-member sum rounds once either way: applies from TP 3)",
    "staging_rounded_to_bf16": "fp32_staging with its corrected gradient rounded to BF16, against patched DeepSpeed",
    "marker_never_set": "bf16_writeback correcting every micro-step (marker never set), against DeepSpeed as shipped "
    "on the epilogue path at GAS >= 2",
}
"""The case's controls: ``name -> what``."""


def power_checks(
    config: Config, real: dict[DsRun, list[RankCapture]], writeback: Policy, staging: Policy
) -> list[PowerCheck]:
    """Run every control of `CONTROLS` that applies to ``config`` (transcriptions only) and compare it with the
    real run it stands for."""
    first_path, first_gas = config.update_paths[0], config.gas[0]
    marker_gas = [g for g in config.gas if g > 1]
    epilogue = UpdatePath.EPILOGUE in config.update_paths
    variants: dict[str, tuple[bool, Policy, UpdatePath, int, Fix, Marker | None]] = {
        "bf16_tp_sum": (
            config.spec.tp > 1,
            replace(staging, name="control_bf16_tp_sum", staging=None),
            first_path,
            first_gas,
            "fp32_staging",
            None,
        ),
        "writeback_bf16_tp_sum": (
            config.spec.tp > 2,
            replace(writeback, name="control_writeback_bf16_tp_sum", staging=None),
            first_path,
            first_gas,
            "none",
            None,
        ),
        "staging_rounded_to_bf16": (
            config.spec.tp > 1,
            replace(staging, name="control_staging_rounded", writeback=torch.bfloat16),
            first_path,
            first_gas,
            "fp32_staging",
            None,
        ),
        "marker_never_set": (
            config.spec.tp > 1 and epilogue and bool(marker_gas) and config.marker == Marker.DEEPSPEED,
            writeback,
            UpdatePath.EPILOGUE,
            marker_gas[0] if marker_gas else 0,
            "none",
            Marker.PER_MICRO_STEP,
        ),
    }
    checks = []
    for name, (applies, policy, path, gas, fix, marker) in variants.items():
        against = f"{path} GAS {gas} {'as shipped' if fix == 'none' else 'patched'}"
        if not applies:
            checks.append(PowerCheck(name, CONTROLS[name], applies=False))
            continue
        real_traces = [c.trace for c in real[DsRun(path, gas, config.steps, fix)]]
        match = match_traces(real_traces, transcription(config, policy, path, gas, marker))
        changed = match.compared - match.equal
        checks.append(
            PowerCheck(name, CONTROLS[name], True, changed > 0, changed, match.compared, against, unit="captures")
        )
    return checks


def sum_of_terms(spec: ParallelSpec, captures: list[RankCapture]) -> dict:
    """``(rank, hp key) -> sum |terms|``: what each hp element sums, as the real run corrected it."""
    families = {p.name: p.family for p in DEFAULT_PARAMS}
    out = {}
    for capture in captures:
        rank, trace = capture.trace.rank, capture.trace
        running: dict[tuple[int, str], torch.Tensor] = {}
        for key in sorted(k for k in trace.values if k[3] == "hp"):
            step, micro, param, _ = key
            correction = families[param].correction(spec.tp)
            local = trace.values[(step, micro, param, "local")].double().abs()
            if capture.actions.get((step, micro, param)) == CORRECTED and correction.reduces:
                peers = spec.group_of("tp", rank)
                # sum() starts from the int 0; a TP group is never empty, so the result is a tensor
                local = cast(
                    torch.Tensor,
                    sum(captures[p].trace.values[(step, micro, param, "local")].double().abs() for p in peers),
                )
            if capture.actions.get((step, micro, param)) == CORRECTED and correction.divides:
                local = local / spec.tp
            prior = running.get((step, param))
            total = local if prior is None else prior + local
            running[(step, param)] = total
            out[(rank, key)] = total
    return out


def judge(
    config: Config,
    real: dict[DsRun, list[RankCapture]],
    writeback: Policy | None = None,
    staging: Policy | None = None,
    where: str = "gloo",
) -> Verdict8913:
    """The verdict from real captures and the transcription (``writeback``/``staging`` default to the catalogue's)."""
    writeback = writeback or get_policy("bf16_writeback")
    staging = staging or get_policy("fp32_staging")
    spec = config.spec
    first = next(iter(real.values()))[0]
    expected = {p.name: p.family.correction(spec.tp).value for p in DEFAULT_PARAMS}
    results = []
    for path in config.update_paths:
        for gas in config.gas:
            shipped = real[DsRun(path, gas, config.steps, "none")]
            patched = real[DsRun(path, gas, config.steps, "fp32_staging")]
            shipped_traces = [c.trace for c in shipped]
            patched_traces = [c.trace for c in patched]
            skipped = sorted({k for k, v in shipped[0].actions.items() if v.startswith("skipped")})
            by_micro: dict[tuple[int, int], list[str]] = {}
            for step, micro, param in skipped:
                by_micro.setdefault((step, micro), []).append(param)
            results.append(
                PathResult(
                    path,
                    gas,
                    match_traces(
                        shipped_traces, transcription(config, writeback, path, gas), names=("DeepSpeed", writeback.name)
                    ),
                    match_traces(
                        patched_traces,
                        transcription(config, staging, path, gas),
                        names=("patched DeepSpeed", staging.name),
                    ),
                    figures(shipped_traces, patched_traces, sum_of_terms(spec, shipped)),
                    [f"step {s} micro-step {m}: {', '.join(ps)}" for (s, m), ps in sorted(by_micro.items())],
                )
            )
    agree = first.strategies == expected
    holds = agree and all(
        r.real_vs_bf16_writeback.bitwise_equal and r.patched_vs_fp32_staging.bitwise_equal for r in results
    )
    checks = power_checks(config, real, writeback, staging)
    ok = holds and shows_power(checks)
    verdict = Verdict8913(ok, "", first.deepspeed_version, where, spec.describe(), first.strategies, agree, results)
    verdict.inputs, verdict.power_checks, verdict.findings_hold = describe_inputs(config.inputs), checks, holds
    verdict.summary = summarize(verdict, writeback.name, staging.name)
    return verdict


def summarize(v: Verdict8913, writeback: str, staging: str) -> str:
    """One paragraph computed from the verdict's fields."""
    lines = [f"real DeepSpeed {v.deepspeed_version} BF16_Optimizer on {v.layout} ({v.where} processes):"]
    if not v.strategies_agree:
        lines.append(f"  family strategies DIFFER from simdist's corrections: {v.strategies}")
    for r in v.paths:
        label = f"{r.update_path} GAS {r.gas}"
        a, b = r.real_vs_bf16_writeback, r.patched_vs_fp32_staging
        same = "==" if a.bitwise_equal else "!="
        lines.append(
            f"  {label}: DeepSpeed {same} {writeback} ({a.equal}/{a.compared} captures bitwise)"
            + ("" if a.bitwise_equal else f"; first: {a.first_difference}")
        )
        same = "==" if b.bitwise_equal else "!="
        lines.append(
            f"  {label}: DeepSpeed + FP32-staging patch {same} {staging} ({b.equal}/{b.compared})"
            + ("" if b.bitwise_equal else f"; first: {b.first_difference}")
        )
        f = r.shipped_vs_fp32_staging
        lines.append(
            f"  {label}: as shipped vs FP32 staging: {f.tensors_differing}/{f.tensors} hp grads differ "
            f"({', '.join(f.params_differing) or 'none'}), {100 * f.fraction_differing:.1f}% of elements, "
            f"max {f.max_ulp} fp32 ulp, max error / sum|terms| {f.max_error_over_terms:.2e} "
            f"(BF16 u = {v.bf16_unit_roundoff:.2e})"
        )
        if r.skipped_corrections:
            lines.append(f"  {label}: TP correction skipped (marker set): {'; '.join(r.skipped_corrections)}")
    lines.append(f"  inputs: {v.inputs}")
    lines += [f"  power check {c.line}" for c in v.power_checks]
    if v.ok:
        lines.append("verdict: real == transcription bitwise on every path; every applicable power check shows power")
    elif v.findings_hold:
        lines.append("verdict: NOT OK: real == transcription, but a power check shows no power (see above)")
    else:
        lines.append("verdict: MISMATCH (see above)")
    return "\n".join(lines)


def run(where: CaseWhere = "gloo", **options) -> Verdict8913:
    """Run the case: real DeepSpeed on ``where``, then judge against the catalogue's policies."""
    config = Config(**options)
    verdict = judge(config, run_real(config, where), where=where)
    if config.tp4 and config.spec.tp < 4:
        extra = tp4_config(config)
        verdict.tp4 = judge(extra, run_real(extra, where), where=where)
        verdict.ok = verdict.ok and verdict.tp4.ok
        verdict.summary += "\n" + verdict.tp4.summary
    return verdict


CASE = Case(
    name=NAME,
    question="Is simdist's bf16_writeback bitwise what DeepSpeed's BF16_Optimizer folding path computes, "
    "per micro-step, on both update paths at GAS 1 and 3, and fp32_staging what the #8913 fix computes?",
    real_code="deepspeed.runtime.bf16_optimizer.BF16_Optimizer + module_inject.auto_ep_folding + the engine's "
    "boundary folding pass, TP2/EP2/ETP1 and TP4/EP2/ETP1 on 4 gloo processes",
    policies=("bf16_writeback", "fp32_staging"),
    requires=("deepspeed",),
    run=run,
)


ENGINE_POLICIES: dict[str, Fix] = {"bf16_writeback": "none", "fp32_staging": "fp32_staging"}
"""What ``simdist repro 8913 --code deepspeed`` runs for each policy: DeepSpeed as shipped, or with the fix."""


def repro_traces(config, where: CaseWhere = "gloo") -> dict[str, list[Trace]]:
    """Real DeepSpeed's traces (``local`` and ``hp`` per micro-step) for a `simdist.studies.repro.ReproConfig`.

    One launch runs every requested policy: ``bf16_writeback`` is DeepSpeed as
    shipped, ``fp32_staging`` is DeepSpeed with the #8913 fix patched in.
    """
    unknown = [name for name in config.policies if name not in ENGINE_POLICIES]
    if unknown:
        raise UsageError(
            f"--code deepspeed runs only {', '.join(ENGINE_POLICIES)} (DeepSpeed as shipped and "
            f"patched), not {', '.join(unknown)}"
        )
    fixed = {
        "marker": (config.marker, "deepspeed", "the real optimizer clears its marker as it ships"),
        "source": (config.source, "synthetic", "the real optimizer is fed the synthetic local gradients"),
        "reduction": (config.reduction, "gloo", "the real run reduces on real gloo processes"),
        "etp": (config.spec.etp, 1, "DeepSpeed needs ETP 1"),
    }
    for option, (got, value, why) in fixed.items():
        if got != value:
            raise UsageError(f"--code deepspeed needs --{option} {value} ({why}), got {str(got)!r}")
    runs = tuple(DsRun(config.update_path, config.gas, config.steps, ENGINE_POLICIES[name]) for name in config.policies)
    per_rank = run_ranks(
        deepspeed_rank, config.spec, runs, config.seed, str(config.inputs), where=where, preload=DEEPSPEED_MODULES
    )
    return {name: [captures[i].trace for captures in per_rank] for i, name in enumerate(config.policies)}
