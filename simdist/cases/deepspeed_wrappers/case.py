"""Case ``deepspeed-wrappers``: the #8913 audit on the real DeepSpeed engine, every optimizer wrapper, end to end.

Question: under AutoEP+AutoTP folding, where does each DeepSpeed 0.19.8 wrapper -- ``BF16_Optimizer``
(epilogue and ``immediate_grad_update``), ZeRO-1, ZeRO-2 (``overlap_comm`` on/off, ``contiguous_gradients``,
small ``reduce_bucket_size``), ZeRO-3 -- round the router's TP-corrected FP32 gradient into BF16, and how far
do the DP-reduced gradient, the global norm, the FP32 master and both Adam moments land from an FP32 oracle?
``communication_data_type`` bf16 (the default) and fp32, GAS 1 and 4, TP2 and TP4, clipping on. With the
#8913 FP32-staging fix patched in, which boundaries disappear and which remain?

Real code: ``deepspeed.initialize`` + ``engine.backward`` + ``engine.step`` on real gloo processes (or simdist's
process mode), driven by `simdist.cases.deepspeed.engine` (which says what is done by hand and why).

Compared with: `simdist.cases.deepspeed_wrappers.oracle.oracle`, written for this case and sharing no code with
DeepSpeed or simdist's gradient path (the intended FP32 computation; its TP sums in gloo's order, the real
engine's). Its inputs are the same seeded BF16 local gradients (`simdist.sources.synthetic`, the ``rounding``
distribution by default), which the case checks bitwise against the engine's. The default run asserts the
case's findings and runs its power checks (`simdist.cases.deepspeed_wrappers.checks`): ``ok`` is false when a
finding fails or a control shows no power.

The verdict table: for every run and boundary (capture), how many elements differ from the oracle, the
largest error over the sum of the absolute terms that element sums (gradient stages), and an effect class:
``bitwise``, ``fp32-order`` (below 2^-16 of sum|terms|: summation order, FP32 rounding) or ``bf16``
(a BF16 rounding on the path); FP32 masters only ``bitwise`` or ``differs`` (error in units of ``lr x steps``).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

from simdist.cases.base import Case
from simdist.cases.deepspeed.engine import (
    EngineRun,
    Wrapper,
    engine_rank,
)
from simdist.cases.deepspeed_wrappers import checks
from simdist.cases.deepspeed_wrappers.oracle import (
    Row,
    RunResult,
    _sites,
    judge_run,
    oracle,
)
from simdist.cases.ranks import DEEPSPEED_MODULES, CaseWhere, run_ranks
from simdist.sources.synthetic import Inputs, describe_inputs
from simdist.studies.power import PowerCheck, shows_power
from simdist.world.spec import ParallelSpec

NAME = "deepspeed-wrappers"
CLIP = 0.05
"""Below the synthetic gradients' global norm (about 0.07 at TP2), so clipping is active."""


def audit_runs(tp: int = 2) -> tuple[EngineRun, ...]:
    """The full audit at one TP size: every wrapper and switch the issue names."""
    b: Wrapper = "bf16_optimizer"
    z1: Wrapper = "zero1"
    z2: Wrapper = "zero2"
    return (
        EngineRun(b, gas=1, clip=CLIP),
        EngineRun(b, gas=4, clip=CLIP),
        EngineRun(b, immediate=True, gas=4, clip=CLIP),
        EngineRun(b, gas=1, comm_dtype="fp32", clip=CLIP),
        EngineRun(b, gas=1, clip=CLIP, fix="fp32_staging"),
        EngineRun(b, gas=1, comm_dtype="fp32", clip=CLIP, fix="fp32_staging"),
        EngineRun(b, immediate=True, gas=4, comm_dtype="fp32", clip=CLIP, fix="fp32_staging"),
        EngineRun(z1, gas=1, clip=CLIP),
        EngineRun(z1, gas=4, clip=CLIP),
        EngineRun(z1, overlap_comm=True, gas=4, clip=CLIP),
        EngineRun(z1, gas=4, comm_dtype="fp32", clip=CLIP),
        EngineRun(z2, gas=1, clip=CLIP),
        EngineRun(z2, overlap_comm=True, reduce_bucket_size=200, gas=4, clip=CLIP),
        EngineRun(z2, overlap_comm=False, contiguous_gradients=False, reduce_bucket_size=200, gas=4, clip=CLIP),
        EngineRun(z2, overlap_comm=True, gas=4, comm_dtype="fp32", clip=CLIP),
        EngineRun(z2, overlap_comm=True, gas=4, accum_fp32=True, clip=CLIP),
        EngineRun("zero3", gas=1, clip=CLIP),
        EngineRun("zero3", gas=1, clip=CLIP, experts=False),
    )


SMALL_RUNS = (
    EngineRun("bf16_optimizer", gas=1, clip=CLIP),
    EngineRun("bf16_optimizer", gas=1, comm_dtype="fp32", clip=CLIP, fix="fp32_staging"),
)
"""The small run (`run_small`): BF16_Optimizer as shipped, and with the fix and FP32 comm (the power checks'
target), one step each."""


@dataclass
class WrappersVerdict:
    ok: bool
    summary: str
    deepspeed_version: str
    where: str
    layouts: list[str]
    seconds: float
    runs: list[RunResult] = field(default_factory=list)
    narrowing_sites: dict[str, list[str]] = field(default_factory=dict)
    """Per wrapper, every site ``simdist.audit`` found inside the rank processes (rank 0, all runs): narrowing
    casts/accumulations/stores of floats and the floating collectives with their dtype, with DeepSpeed's
    ``file:line``."""
    inputs: str = ""
    """The synthetic gradients' distribution (`simdist.sources.synthetic.describe_inputs`)."""
    findings: list = field(default_factory=list)
    """The case's claims (`simdist.cases.deepspeed_wrappers.checks.findings`) and whether each held."""
    power_checks: list[PowerCheck] = field(default_factory=list)
    """The controls (`simdist.cases.deepspeed_wrappers.checks.CONTROLS`) against each layout's fixed run."""
    findings_hold: bool = False
    """Every applicable finding held (``ok`` also needs every applicable power check to show power)."""
    explanations: dict[str, str] = field(default_factory=dict)
    """What a finding's remaining differences come from (``fixed_run_masters``: which operation, which order)."""


# -- running ---------------------------------------------------------------------------------------------------


def run_real(
    spec: ParallelSpec,
    runs: tuple[EngineRun, ...],
    where: CaseWhere = "gloo",
    seed: int = 0,
    inputs: Inputs | str = Inputs.ROUNDING,
):
    """Every run on the real engine in one launch of ``spec.world_size`` ranks; ``{run: per-rank captures}``."""
    per_rank = run_ranks(
        engine_rank, spec, runs, seed, Inputs(inputs).value, where=where, timeout_s=1800.0, preload=DEEPSPEED_MODULES
    )
    return {run: [captures[i] for captures in per_rank] for i, run in enumerate(runs)}


EXPECTED_UNSUPPORTED = (
    "MoE not supported with Stage 3",
    "Contiguous Gradients in ZeRO Stage 2 must be set to True for MoE",
)
"""Refusals the engine gives on this setup (named in the table, not a failure of the case)."""


def run(
    where: CaseWhere = "gloo",
    tps: tuple[int, ...] = (2, 4),
    runs: tuple[EngineRun, ...] | None = None,
    world_size: int = 4,
    inputs: Inputs | str = Inputs.ROUNDING,
) -> WrappersVerdict:
    """The whole audit: every run at each TP size (``world_size`` ranks, EP2) on ``where``, one launch per TP size;
    the findings and power checks (`simdist.cases.deepspeed_wrappers.checks`), the verdict and its table.

    ``ok`` is true only when every applicable finding holds and every applicable power check shows power."""
    import deepspeed

    start = time.perf_counter()
    inputs = Inputs(inputs)
    results, layouts, judged, power = [], [], [], []
    sites: dict[str, list[str]] = {}
    for tp in tps:
        spec = ParallelSpec(world_size, tp=tp, ep=2)
        layouts.append(spec.describe())
        chosen = runs if runs is not None else audit_runs(tp)
        real = run_real(spec, chosen, where, inputs=inputs)
        for r in chosen:
            result = judge_run(spec, r, real[r], inputs=inputs)
            again = judge_run(spec, r, real[r], inputs=inputs, engine_norm=True) if checks.fixed_run(r) else None
            results.append(result)
            judged.append((spec, r, result, again))
            found = sites.setdefault(r.wrapper, [])
            found += [s for s in _sites(real[r][0]) if s not in found]
        target = next((r for r in chosen if checks.fixed_run(r) and not real[r][0].error), None)
        if target is not None:
            power += checks.power_checks(spec, target, real[target], inputs=inputs)
    found_claims = checks.findings(judged, EXPECTED_UNSUPPORTED)
    holds = all(f.holds for f in found_claims if f.applies)
    ok = holds and shows_power(power)
    verdict = WrappersVerdict(ok, "", deepspeed.__version__, where, layouts, time.perf_counter() - start, results)
    verdict.narrowing_sites = sites
    verdict.inputs, verdict.findings, verdict.power_checks = describe_inputs(inputs), found_claims, power
    verdict.findings_hold = holds
    verdict.explanations = {"fixed_run_masters": checks.EPILOGUE_MASTERS}
    verdict.summary = summarize(verdict)
    return verdict


COLUMNS = (
    ("FP32 TP-corrected", "FP32 TP value"),
    ("corrected gradient after", "after write-back"),
    ("FP32 accumulated", "FP32 accumulated"),
    ("DP-reduced", "DP-reduced"),
    ("global grad norm", "norm"),
    ("FP32 master", "master"),
    ("Adam exp_avg:", "exp_avg"),
    ("Adam exp_avg_sq", "exp_avg_sq"),
)


def _cell(row: Row | None) -> str:
    if row is None:
        return "-"
    if row.effect == "bitwise":
        return f"= ({row.compared})"
    return f"{row.effect} {row.differing}/{row.compared}, {row.max_error_over_terms:.1e}"


def table(v: WrappersVerdict) -> str:
    """The wrapper x boundary x effect table (markdown): per boundary ``effect differing/compared, max error``.

    ``= (n)``: all n elements bitwise equal to the oracle. Max error is over sum|terms| for gradients and
    moments, over ``lr x steps`` for masters, over the value for the norm.
    """
    head = "| run | wrapper, correction site, buffer | " + " | ".join(name for _, name in COLUMNS) + " |"
    lines = [head, "|" + "---|" * (len(COLUMNS) + 2)]
    for r in v.runs:
        if r.error:
            lines.append(f"| {r.label} | not run: {r.error} |" + " |" * len(COLUMNS))
            continue
        rows = {
            prefix: next((x for x in r.rows if x.boundary.startswith(prefix.rstrip(":"))), None)
            for prefix, _ in COLUMNS
        }
        rows["Adam exp_avg:"] = next((x for x in r.rows if x.boundary == "Adam exp_avg"), None)
        dtypes = ", ".join(d.replace("torch.", "") for d in r.buffer_dtypes)
        cell = f"{r.optimizer_class}, {', '.join(r.correction_sites)}, {dtypes}"
        lines.append(f"| {r.label} | {cell} | " + " | ".join(_cell(rows[p]) for p, _ in COLUMNS) + " |")
    return "\n".join(lines)


def summarize(v: WrappersVerdict) -> str:
    lines = [f"real DeepSpeed {v.deepspeed_version} engine, {', '.join(v.layouts)} ({v.where} processes):"]
    for r in v.runs:
        if r.error:
            lines.append(f"  {r.label}: NOT RUN: {r.error}")
            continue
        lines.append(
            f"  {r.label} [{r.optimizer_class}; TP correction in {', '.join(r.correction_sites) or 'nowhere'}"
            f" on {', '.join(r.buffer_dtypes) or '-'}]"
            + (f"; marker skipped {'; '.join(r.skipped_corrections)}" if r.skipped_corrections else "")
        )
        for row in r.rows:
            if row.boundary.startswith("BF16 local") and row.effect == "bitwise":
                continue
            lines.append(
                f"    {row.boundary}: {row.differing}/{row.compared} differ, max {row.max_error_over_terms:.2e} "
                f"({row.note}) -> {row.effect}" + (f" [{', '.join(row.params_differing)}]" if row.differing else "")
            )
    for wrapper, found in v.narrowing_sites.items():
        lines.append(f"  narrowing sites and collectives found by simdist.audit in the {wrapper} rank processes:")
        lines += [f"    {site}" for site in found]
    lines.append(f"inputs: {v.inputs}")
    for f in v.findings:
        state = "holds" if f.holds else "FAILS"
        lines.append(f"finding {f.name}: {state if f.applies else 'not applicable'} ({f.detail})")
    for key, text in v.explanations.items():
        lines.append(f"explanation {key}: {text}")
    lines += [f"power check {c.line}" for c in v.power_checks]
    lines.append(f"audit time: {v.seconds:.0f} s")
    if v.ok:
        lines.append("verdict: every finding holds; every applicable power check shows power")
    elif v.findings_hold:
        lines.append("verdict: NOT OK: the findings hold, but a power check shows no power (see above)")
    else:
        lines.append("verdict: NOT OK: a finding fails (see above)")
    return "\n".join(lines)


def run_small(where: CaseWhere = "gloo") -> WrappersVerdict:
    """A small case (slow tests): `SMALL_RUNS`, TP2/EP2 on 2 ranks (the fewest processes); ok as the full run's."""
    return run(where, tps=(2,), runs=SMALL_RUNS, world_size=2)


CASE = Case(
    name=NAME,
    question="Where does each DeepSpeed wrapper (BF16_Optimizer, ZeRO-1/2/3) round the folding-corrected FP32 "
    "gradient into BF16 on the real engine, how far are the DP-reduced gradient, norm, master and Adam moments "
    "from an FP32 oracle, and what does the FP32-staging fix remove?",
    real_code="deepspeed.initialize + engine.backward/step with bf16, ZeRO 1/2/3, AutoTP+AutoEP folding "
    "(TP2 and TP4, EP2 on 4 processes); MoE detection and TP sharding by hand (no transformers)",
    policies=("oracle in simdist.cases.deepspeed_wrappers.case",),
    requires=("deepspeed",),
    run=run,
)

__all__ = ["CASE", "audit_runs", "dataclasses", "judge_run", "oracle", "run", "run_small", "table"]
