"""Reproduce DeepSpeed #8913 in the simulator: each policy against the FP32 oracle, tensor by tensor.

TP4/EP2/ETP1 on 8 simulated ranks by default (`REPRO_SPEC`: TP4 x DP2, EP2 x EDP4,
so every group kind differs and a group mix-up or a BF16 TP sum changes bits), 3 BF16
updates, seeded local gradients from the ``rounding`` distribution
(`simdist.models.synthetic.Inputs`: sums round, so order, group and dtype show) that
differ between TP peers for the router (identical peers hide the defect), every
parameter family present. For every tensor of every rank
-- local gradient, corrected gradient, high-precision gradient, FP32 master,
Adam m and v, over all steps -- the report says whether it is bitwise equal to
the oracle, the largest ulp difference and the fraction of differing elements;
then each policy's chains, the first divergent stage per parameter, and a
verdict computed from those comparisons, with the power checks (`simdist.studies.power`)
that prove the inputs and layout could see a wrong order, group or dtype.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace

import torch

from simdist.errors import UsageError
from simdist.gradpath.families import Family
from simdist.gradpath.kernel import Marker, UpdatePath, coerce
from simdist.gradpath.path import PathConfig, train_rank
from simdist.gradpath.policy import Policy
from simdist.gradpath.probes import Capture, Divergence, Trace, first_divergence, path_order
from simdist.gradpath.reference import Control, oracle_traces
from simdist.models import GradientModel
from simdist.models.synthetic import DEFAULT_PARAMS, InitialWeights, Inputs, describe_inputs, synthetic_gradients
from simdist.numerics.compare import Comparison, Pair, compare
from simdist.numerics.floats import ulp_distance
from simdist.policies.catalogue import get_policy
from simdist.reduce import Reduction, ReductionModel, make_model
from simdist.studies.power import PowerCheck, power_checks, shows_power
from simdist.world.options import DEFAULT_REDUCTION
from simdist.world.simworld import SimWorld
from simdist.world.spec import ParallelSpec

COMPARED: tuple[Capture, ...] = (
    Capture.LOCAL,
    Capture.CORRECTED,
    Capture.HP,
    Capture.MASTER,
    Capture.ADAM_M,
    Capture.ADAM_V,
)
"""The captures the report compares with the oracle, in path order (a `Row`'s ``kind`` is the capture's label)."""


ORACLE_SUMMARY = (
    "independent FP32 TP-then-DP per-parameter reducer (simdist.gradpath.reference), every group summed in the "
    "chosen reduction model's order (default: gloo's, as found by experiment and pinned to real gloo), TP "
    "correction on every micro-step, torch.optim.AdamW on FP32 masters"
)
"""How the report names its oracle."""

REPRO_SPEC = ParallelSpec(8, tp=4, ep=2)
"""The repro's default layout: TP4/DP2/EP2/ETP1/EDP4 on 8 ranks, where the TP, DP, EP and EDP groups all differ
(on `DEFAULT_SPEC` the DP and EDP groups coincide, so experts reduced over DP could not show)."""

EXPECTATIONS = ("reproduced", "fixed")
"""``--expect`` values: ``reproduced`` -- the #8913 writeback finding shows; ``fixed`` -- every policy run is
bitwise equal to the oracle in every compared tensor. Either also needs every applicable power check to show."""


class Code(enum.StrEnum):
    """Which code runs the policies' gradient path (``simdist repro --code``)."""

    TRANSCRIBED = "transcribed"
    """simdist's transcription of it (`simdist.gradpath`)."""
    DEEPSPEED = "deepspeed"
    """DeepSpeed's real BF16_Optimizer (`simdist.cases.deepspeed_8913.repro_traces`; local and hp gradients only)."""


@dataclass(frozen=True)
class ReproConfig:
    """What to run: layout, steps, GAS, seed, policies, marker semantics, reduction, gradient source and code.

    The configuration tree of ``simdist repro``: each field's ``metadata`` is its option's help, and the command
    line's options and defaults are generated from these fields (`simdist.cli.options`). The choices accept
    their enum members or their string values; an unknown value raises ``ValueError``.
    """

    spec: ParallelSpec = field(default=REPRO_SPEC, metadata={"etp": True})
    steps: int = field(default=3, metadata={"help": "optimizer steps", "minimum": 1})
    gas: int = field(default=1, metadata={"help": "gradient-accumulation micro-steps per step", "minimum": 1})
    seed: int = field(default=0, metadata={"help": "seed of the local gradients and the initial weights"})
    policies: tuple[str, ...] = field(
        default=("bf16_writeback", "fp32_staging"), metadata={"help": "comma-separated policy names"}
    )
    marker: Marker = field(
        default=Marker.DEEPSPEED,
        metadata={
            "help": "when the correction-once marker is cleared: as DeepSpeed 0.19.8 does on the chosen update "
            "path, or every micro-step"
        },
    )
    reduction: Reduction = field(
        default=DEFAULT_REDUCTION,
        metadata={"help": "reduction of every group (the launchers' one default: gloo's order)", "skip": ("upcast",)},
    )
    update_path: UpdatePath = field(
        default=UpdatePath.EPILOGUE,
        metadata={"help": "when _update_hp_grad runs: after backward or from gradient hooks (immediate_grad_update)"},
    )
    source: GradientModel = field(
        default=GradientModel.SYNTHETIC,
        metadata={"help": "where the local gradients come from: seeded synthetic ones or the folded MoE block"},
    )
    code: Code = field(
        default=Code.TRANSCRIBED,
        metadata={
            "help": "which code runs the gradient path: simdist's transcription, or DeepSpeed's real BF16_Optimizer "
            "on 4 gloo processes (bf16_writeback = as shipped, fp32_staging = with the #8913 fix; gradients only)"
        },
    )
    inputs: Inputs = field(
        default=Inputs.ROUNDING,
        metadata={
            "help": "distribution of the synthetic local gradients: rounding (31 binades, per-rank magnitudes: sums "
            "round, so order, group and dtype show) or narrow (the old 7 binades, whose sums are mostly exact)"
        },
    )
    """The synthetic gradients' distribution (`Inputs`; ``narrow`` is the old one, whose sums are mostly exact)."""

    def __post_init__(self) -> None:
        for name, kind in (
            ("inputs", Inputs),
            ("marker", Marker),
            ("reduction", Reduction),
            ("update_path", UpdatePath),
            ("source", GradientModel),
            ("code", Code),
        ):
            object.__setattr__(self, name, coerce(kind, getattr(self, name), name.replace("_", " ")))
        object.__setattr__(self, "policies", tuple(self.policies))


@dataclass
class Row:
    """One tensor of one rank compared with the oracle, pooled over every step (and micro-step).

    ``term_relative`` is ``max |policy - oracle| / sum|terms|`` for the gradient tensors (the terms are the
    local gradients that the oracle's reduction adds; see `simdist.numerics.compare`), ``None`` for masters
    and moments, which are not sums.
    """

    rank: int
    param: str
    kind: str
    bitwise_equal: bool
    max_ulp: int
    fraction_differing: float
    norm_relative: float
    term_relative: float | None

    @classmethod
    def of(cls, rank: int, param: str, kind: str, comparison: Comparison) -> Row:
        """The row of one rank's tensor: a view of its `Comparison` (fields kept: ``--json`` prints them)."""
        diff = comparison.difference
        return cls(
            rank,
            param,
            kind,
            diff.bitwise_equal,
            diff.max_ulp,
            diff.fraction_differing,
            diff.norm_relative,
            diff.max_term_relative,
        )


@dataclass(frozen=True)
class Finding:
    """One defect the run looks for, judged from the comparisons: its key, whether it shows, and why.

    ``applies`` is false when the configuration cannot exercise it (the correction-once marker needs GAS >= 2
    on DeepSpeed's epilogue update path with ``--marker deepspeed``); then ``shown`` is false too.
    """

    key: str
    shown: bool
    line: str
    applies: bool = True


WRITEBACK, CORRECTION_MARKER = "writeback_8913", "correction_marker"
"""The keys of the two findings (`Verdict.findings`, and the fields under ``"findings"`` in ``--json``)."""


@dataclass(frozen=True)
class ExactDistance:
    """Step 0's DP-reduced gradient of one run against the exact one rounded to FP32, every rank and parameter.

    The exact reference is the oracle in FP64. On the default run its step-0 DP-reduced gradients are the
    correctly rounded sums of the BF16 terms (tested against ``math.fsum`` for the router and the experts);
    that is a measurement of these inputs, not a bound: a far wider spread could make an FP64 sum round.
    The step-0 gradient does not depend on earlier updates, so every run is compared on the same terms.
    """

    name: str
    max_ulp: int
    """The largest distance, in FP32 ulps, from the exact value rounded to FP32 (nearest even)."""
    differing: int
    compared: int

    @property
    def line(self) -> str:
        if not self.differing:
            return f"{self.name}: exact (0 ulp) in all {self.compared} elements"
        return f"{self.name}: within {self.max_ulp} fp32 ulp of exact ({self.differing}/{self.compared} elements off)"


@dataclass(frozen=True)
class Verdict:
    """The #8913 verdict, computed from the comparisons: each finding separately, and the lines that say so.

    ``reproduced`` is the #8913 writeback finding; ``marker_defect`` is DeepSpeed's correction-once marker
    (GAS >= 2 on the epilogue path skips the TP correction of micro-steps 1..GAS-1). Either can show
    without the other. ``line`` is every applicable finding's line, one per line.
    """

    reproduced: bool
    line: str
    marker_defect: bool = False
    findings: tuple[Finding, ...] = ()
    inputs: str = ""
    """The input distribution, as `describe_inputs` names it."""
    power: tuple[PowerCheck, ...] = ()
    """The power checks (`simdist.studies.power`): each control and whether it changed the compared bits."""
    power_shown: bool = False
    """Every applicable power check changed the compared bits: the verdict could see what it asserts."""
    power_line: str = ""
    """One line: every power check's outcome (`format_report` prints it before the findings)."""
    exact: tuple[ExactDistance, ...] = ()
    """How far the oracle and each policy are from the exact reduction (`exact_distances`)."""

    def __str__(self) -> str:
        return self.line


@dataclass
class PolicyReport:
    name: str
    summary: str
    chains: dict[str, str]
    rows: list[Row]
    first_divergence: dict[str, str | None]
    departs: list[str] = field(default_factory=list)
    divergences: dict[str, Divergence | None] = field(default_factory=dict, repr=False)


def workload(
    name: GradientModel | str, spec: ParallelSpec, seed: int, gas: int, inputs: Inputs | str = Inputs.ROUNDING
):
    """``(params, initial, gradients)`` of the training model ``name`` (synthetic gradients drawn from ``inputs``)."""
    if coerce(GradientModel, name, "model") == GradientModel.SYNTHETIC:
        return DEFAULT_PARAMS, InitialWeights(spec, seed), synthetic_gradients(spec, seed, inputs)
    from simdist.models.moe import MoEGradients

    source = MoEGradients(spec, seed=seed, gas=gas)
    return tuple(source.params), source.initial, source


def run(
    spec: ParallelSpec,
    policy: Policy,
    config: PathConfig,
    model: ReductionModel,
    training_model: GradientModel | str = GradientModel.SYNTHETIC,
    inputs: Inputs | str = Inputs.ROUNDING,
) -> list[Trace]:
    """Every rank's trace of ``policy`` on ``spec`` in a SimWorld whose groups all use ``model``.

    ``training_model`` picks where the local gradients come from (`GradientModel`), ``inputs`` their distribution.
    """
    params, initial, grads = workload(training_model, spec, config.seed, config.gas, inputs)
    world = SimWorld(spec, reduction=model, timeout_s=None)  # a long study has no deadline
    return world.run(train_rank, list(params), initial, grads, policy, config)


def run_oracle(
    config: ReproConfig,
    model: ReductionModel,
    magnitudes: bool = False,
    control: Control | None = None,
    dtype: torch.dtype = torch.float32,
) -> list[Trace]:
    """The independent FP32 oracle (`simdist.gradpath.reference`) on the run's workload: every group sums in
    ``model``'s order, the TP correction runs on every micro-step, the step is ``torch.optim.AdamW``'s.

    ``magnitudes`` runs it on ``|local gradients|`` (synthetic model only), which gives ``sum|terms|``;
    ``control`` runs it with one deliberate error (a power check); ``dtype`` is its staging, accumulation,
    reduction and master dtype (``float64``: the exact reference of `exact_distances`).
    """
    params, initial, grads = workload(config.source, config.spec, config.seed, config.gas, config.inputs)
    return oracle_traces(
        config.spec,
        list(params),
        initial,
        _Magnitudes(grads) if magnitudes else grads,
        steps=config.steps,
        gas=config.gas,
        tp_model=model,
        dp_model=model,
        control=control,
        dtype=dtype,
    )


GRADIENT_STAGES = frozenset({Capture.LOCAL, Capture.CORRECTED, Capture.HP})
"""Captures that are sums of local gradients, so a per-element ``sum|terms|`` exists for them."""


def compare_with_oracle(traces: list[Trace], oracle: list[Trace], magnitudes: list[Trace] | None = None) -> list[Row]:
    """One `Row` per rank, parameter and tensor kind, pooled over steps and micro-steps.

    ``magnitudes`` are the oracle's traces on ``|local gradients|``: the oracle's gradient stages are linear
    in the local gradients (casts, sums, ``/tp``, ``+=``), so there they hold ``sum|terms|`` per element.
    """
    rows = []
    for index, (trace, reference) in enumerate(zip(traces, oracle, strict=True)):
        scale = magnitudes[index].values if magnitudes is not None else {}
        for param in trace.params():
            for stage in COMPARED:
                keys = [k for k in trace.values if k[2] == param and k[3] == stage and k in reference.values]
                if not keys:
                    continue
                sums = scale if stage in GRADIENT_STAGES else {}
                pairs: list[Pair] = [
                    (param, path_order(k), trace.values[k], reference.values[k], sums.get(k)) for k in keys
                ]
                rows.append(Row.of(trace.rank, param, stage.label, compare(pairs)))
    return rows


class _Magnitudes:
    """Local gradients as their absolute values: the oracle run on these gives ``sum|terms|``."""

    def __init__(self, grads) -> None:
        self.grads = grads

    def __call__(self, step: int, micro: int, rank: int, param) -> torch.Tensor:
        return self.grads(step, micro, rank, param).abs()


def reproduce(config: ReproConfig, progress: Callable[[str], None] | None = None) -> tuple[list[PolicyReport], Verdict]:
    """Run the oracle and every policy; return the per-policy reports and the verdict.

    ``progress`` (the CLI's bar) is called with a label after each run: the oracle, the |terms| run (synthetic
    model only) and each policy -- `run_count` calls in all.
    """
    done = progress or (lambda label: None)
    spec = config.spec
    policies = [get_policy(name) for name in config.policies]
    model = make_model(config.reduction)
    path = PathConfig(
        steps=config.steps, gas=config.gas, seed=config.seed, marker=config.marker, update_path=config.update_path
    )
    oracle = run_oracle(config, model)
    done("oracle")
    magnitudes = None
    if config.source == GradientModel.SYNTHETIC:  # a model's gradients depend on its weights: no |terms| run for it
        magnitudes = run_oracle(config, model, magnitudes=True)
        done("|terms|")
    families = {p.name: p.family for p in workload(config.source, spec, config.seed, config.gas, config.inputs)[0]}
    reports = []
    kept: dict[str, list[Trace]] = {}
    real = _real_traces(config)
    for policy in policies:
        traces = (
            real[policy.name]
            if real
            else run(spec, policy, path, model, training_model=config.source, inputs=config.inputs)
        )
        kept[policy.name] = traces
        rows = compare_with_oracle(traces, oracle, magnitudes)
        divergence = first_divergence(traces, oracle)
        done(policy.name)
        reports.append(
            PolicyReport(
                policy.name,
                policy.summary,
                {name: policy.chain(family, spec.tp) for name, family in families.items()},
                rows,
                {p: (str(d) if d else None) for p, d in divergence.items()},
                sorted({r.param for r in rows if not r.bitwise_equal}),
                divergence,
            )
        )
    verdict = findings(config, reports, families)
    power: tuple[PowerCheck, ...] = ()
    exact: tuple[ExactDistance, ...] = ()
    if config.source == GradientModel.SYNTHETIC:
        power = power_checks(spec, oracle, lambda control: run_oracle(config, model, control=control), POWER_STAGES)
        exact = exact_distances(run_oracle(config, model, dtype=torch.float64), {"oracle": oracle, **kept})
        done("power checks")
    return reports, replace(with_power(config, verdict, power), exact=exact)


def exact_distances(exact: list[Trace], runs: dict[str, list[Trace]]) -> tuple[ExactDistance, ...]:
    """Each run's step-0 DP-reduced gradient against ``exact`` (the FP64 oracle's, rounded to FP32), in FP32 ulps;
    runs that did not capture it (the real engines) are left out."""
    out = []
    for name, traces in runs.items():
        worst = differing = compared = 0
        for ours, reference in zip(traces, exact, strict=True):
            for key, value in reference.values.items():
                if key[0] != 0 or key[3] != Capture.DP_REDUCED or key not in ours.values:
                    continue
                distance = ulp_distance(ours.values[key].float(), value.float())
                worst = max(worst, int(distance.max()))
                differing += int((distance > 0).sum())
                compared += distance.numel()
        if compared:
            out.append(ExactDistance(name, worst, differing, compared))
    return tuple(out)


POWER_STAGES = frozenset({Capture.MASTER, Capture.ADAM_M, Capture.ADAM_V})
"""The captures a power check compares: the optimizer's outcome (masters and moments), where every control's
error must arrive; the intermediate gradient captures would differ by construction (a control that corrects
at the boundary leaves the micro-steps' hp buffers uncorrected) and show power that is not there."""


def with_power(config: ReproConfig, verdict: Verdict, power: tuple[PowerCheck, ...]) -> Verdict:
    """``verdict`` with its input distribution and power checks, one line each after the findings."""
    shown = shows_power(power)
    if config.source != GradientModel.SYNTHETIC:
        inputs = f"the {config.source} model's own gradients"
        lines = ["power checks: not run (they need the synthetic workload)"]
    else:
        inputs = describe_inputs(config.inputs)
        head = "power checks: every applicable control flips compared bits" if shown else "power checks FAILED"
        lines = [head + " (" + "; ".join(c.line for c in power) + ")"]
    return Verdict(
        verdict.reproduced, verdict.line, verdict.marker_defect, verdict.findings, inputs, power, shown, lines[0]
    )


def meets(expect: str, reports: list[PolicyReport], verdict: Verdict) -> bool:
    """Whether the run's outcome is ``expect`` (`EXPECTATIONS`): what ``simdist repro --expect`` gates on."""
    if expect not in EXPECTATIONS:
        raise UsageError(f"--expect {expect}: expected one of {', '.join(EXPECTATIONS)}")
    if expect == "reproduced":
        return verdict.reproduced and verdict.power_shown
    return all(r.bitwise_equal for report in reports for r in report.rows) and verdict.power_shown


def _real_traces(config: ReproConfig) -> dict[str, list[Trace]]:
    """The policies' traces from a real framework (``{}`` for the transcribed code)."""
    if config.code == Code.TRANSCRIBED:
        return {}
    from simdist.cases.deepspeed_8913 import repro_traces

    return repro_traces(config)


def run_count(config: ReproConfig) -> int:
    """How many runs `reproduce` makes (its ``progress`` calls): the oracle, the |terms| run, the policies, the
    power checks (one call for all)."""
    return 1 + 2 * (config.source == GradientModel.SYNTHETIC) + len(config.policies)


def verdict(reports: list[PolicyReport], families: dict[str, Family]) -> Verdict:
    """The #8913 verdict, computed from the comparisons (never assumed)."""
    by_name = {r.name: r for r in reports}
    routers = {n for n, f in families.items() if f in (Family.ROUTER_GATE_REPLICATED, Family.ROUTER_GATE_PARTIAL)}
    lines = []
    for report in reports:
        n = len(report.rows)
        bad = [r for r in report.rows if not r.bitwise_equal]
        lines.append(f"{report.name}: {n - len(bad)}/{n} tensors bitwise equal to the FP32 oracle")
    writeback, staging = by_name.get("bf16_writeback"), by_name.get("fp32_staging")
    if writeback is None or staging is None:
        return Verdict(False, "; ".join(lines))
    differing = {(r.param, r.kind) for r in writeback.rows if not r.bitwise_equal}
    router_kinds = {k for p, k in differing if p in routers}
    others = {p for p, _ in differing if p not in routers}
    captured = {r.kind for r in writeback.rows}  # the real engines capture gradients only
    reproduced = (
        "hp grad" in captured
        and {"hp grad", "fp32 master", "adam m", "adam v"} & captured <= router_kinds
        and not others
        and all(r.bitwise_equal for r in staging.rows)
    )
    if reproduced:
        return Verdict(
            True,
            (
                "#8913 REPRODUCED: bf16_writeback departs from the FP32 oracle at the BF16 writeback (router "
                + ("hp grad, FP32 master, Adam m and v" if "fp32 master" in captured else "hp grad")
                + " differ; "
                "expert and dense tensors match); fp32_staging matches bitwise in all "
                f"{len(staging.rows)} compared tensors"
            ),
        )
    return Verdict(False, "#8913 NOT reproduced as described: " + "; ".join(lines))


def model_verdict(reports: list[PolicyReport], families: dict[str, Family]) -> Verdict:
    """The #8913 verdict on a model that computes its gradients from the weights (``--source moe``).

    There a difference in one weight changes every later gradient, so the
    synthetic criterion (only router tensors differ) cannot hold past the
    first update. What is checked instead, from the first divergences: every
    parameter where bf16_writeback first departs from the oracle *at a
    gradient-path stage* (not at ``local``) departs at ``hp`` right after its
    BF16 ``written_back`` on step 0; the router is among them; every other
    parameter first differs only at ``local`` on a later step (its gradient
    changed because the weights did); and fp32_staging is bitwise equal to
    the oracle everywhere.
    """
    by_name = {r.name: r for r in reports}
    writeback, staging = by_name.get("bf16_writeback"), by_name.get("fp32_staging")
    if writeback is None or staging is None:
        return verdict(reports, families)
    routers = {n for n, f in families.items() if f in (Family.ROUTER_GATE_REPLICATED, Family.ROUTER_GATE_PARTIAL)}
    found = {p: d for p, d in writeback.divergences.items() if d is not None}
    at_writeback = sorted(
        p for p, d in found.items() if d.stage == "hp" and "written_back" in d.after and d.step == 0 and d.micro == 0
    )
    propagated = sorted(p for p, d in found.items() if d.stage == "local" and (d.step, d.micro) > (0, 0))
    unexplained = sorted(set(found) - set(at_writeback) - set(propagated))
    staging_equal = all(r.bitwise_equal for r in staging.rows)
    n = len(staging.rows)
    if routers & set(at_writeback) and not unexplained and staging_equal:
        others = [p for p in at_writeback if p not in routers]
        widened = (
            (
                f"; on this model the writeback also rounds {', '.join(others)} ({len(others)} DENSE parameters "
                "upstream of the MoE, whose TP peers hold different local gradients)"
            )
            if others
            else ""
        )
        rest = (
            f"{len(propagated)} other parameters ({', '.join(propagated)}) first differ only in later local "
            "gradients, through the updated weights"
            if propagated
            else "every local gradient and every expert and post-MoE tensor matches (the BF16 weights stayed equal)"
        )
        return Verdict(
            True,
            (
                f"#8913 REPRODUCED on the MoE model: bf16_writeback first departs from the FP32 oracle at the BF16 "
                f"writeback on step 0 for {', '.join(p for p in at_writeback if p in routers)}{widened}; {rest}; "
                f"fp32_staging matches bitwise in all {n} compared tensors"
            ),
        )
    details = [str(found[p]) for p in unexplained]
    return Verdict(
        False,
        "#8913 NOT reproduced as described on the MoE model: "
        + ("; ".join(details) if details else "")
        + ("" if staging_equal else f"{'; ' if details else ''}fp32_staging differs from the oracle"),
    )


def findings(config: ReproConfig, reports: list[PolicyReport], families: dict[str, Family]) -> Verdict:
    """Both findings, each judged on its own: the #8913 writeback and DeepSpeed's correction-once marker.

    Where the marker shows, ``fp32_staging`` departs from the oracle too, so the writeback is judged by
    `writeback_beside_marker` (where the departures happen) instead of by `verdict`/`model_verdict`
    (which require ``fp32_staging`` to match everywhere).
    """
    marker = marker_finding(config, reports)
    if marker.shown:
        writeback = writeback_beside_marker(reports, families, config.source != GradientModel.SYNTHETIC)
    else:
        alone = (
            verdict(reports, families) if config.source == GradientModel.SYNTHETIC else model_verdict(reports, families)
        )
        writeback = Finding(WRITEBACK, alone.reproduced, alone.line)
    shown = (writeback, marker) if marker.applies else (writeback,)
    return Verdict(
        writeback.shown, "\n".join(f.line for f in shown), marker_defect=marker.shown, findings=(writeback, marker)
    )


def _marker_explained(d: Divergence) -> bool:
    """A departure the correction-once marker causes: at ``hp`` on micro-step >= 1, after no writeback."""
    return d.stage == Capture.HP and d.micro >= 1 and Capture.WRITTEN_BACK not in d.after


def marker_finding(config: ReproConfig, reports: list[PolicyReport]) -> Finding:
    """DeepSpeed's correction-once marker: shown when some policy first departs at ``hp`` on a micro-step >= 1.

    Only GAS >= 2 with ``--marker deepspeed`` on the epilogue update path exercises it (elsewhere the finding
    does not apply). Micro-step 0 is always corrected, so a departure there is never the marker's.
    """
    if not (config.gas > 1 and config.marker == Marker.DEEPSPEED and config.update_path == UpdatePath.EPILOGUE):
        why = (
            "GAS 1"
            if config.gas == 1
            else f"--marker {config.marker}"
            if config.marker != Marker.DEEPSPEED
            else "the hooks update path"
        )
        return Finding(CORRECTION_MARKER, False, f"correction-once marker defect: not exercised ({why})", False)
    skipped = {
        report.name: sorted(p for p, d in report.divergences.items() if d is not None and _marker_explained(d))
        for report in reports
    }
    named = [f"{name} at 'hp' on micro-step >= 1 for {', '.join(ps)}" for name, ps in skipped.items() if ps]
    where = (
        f"on the epilogue update path (DeepSpeed's default, immediate_grad_update=False) with GAS {config.gas}, "
        "DeepSpeed's correction-once marker (set on micro-step 0, cleared only at the boundary) "
    )
    if not named:
        return Finding(
            CORRECTION_MARKER, False, "correction-once marker defect NOT shown: " + where + "left no departure here"
        )
    return Finding(
        CORRECTION_MARKER,
        True,
        "correction-once marker defect SHOWN: "
        + where
        + "leaves micro-steps 1..GAS-1 uncorrected; first departures: "
        + "; ".join(named)
        + " (--marker per_micro_step or --update-path hooks isolates the #8913 writeback)",
    )


def writeback_beside_marker(reports: list[PolicyReport], families: dict[str, Family], propagates: bool) -> Finding:
    """The #8913 writeback where the correction-once marker also departs from the oracle.

    The marker leaves micro-step 0 corrected, so it cannot explain a departure there. The writeback shows
    when ``bf16_writeback`` first departs at ``hp`` on micro-step 0 for a router, while ``fp32_staging`` (the
    same path without the writeback) departs only where the marker explains it, and every other departure
    of ``bf16_writeback`` is the marker's too (or, on a model whose gradients follow the weights
    (``propagates``), a later local gradient).
    """
    by_name = {r.name: r for r in reports}
    writeback, staging = by_name.get("bf16_writeback"), by_name.get("fp32_staging")
    if writeback is None or staging is None:
        return Finding(WRITEBACK, False, "#8913 NOT judged: it needs both bf16_writeback and fp32_staging")
    routers = {n for n, f in families.items() if f in (Family.ROUTER_GATE_REPLICATED, Family.ROUTER_GATE_PARTIAL)}

    def explained(d: Divergence) -> bool:
        return _marker_explained(d) or (propagates and d.stage == Capture.LOCAL and (d.step, d.micro) > (0, 0))

    found = {p: d for p, d in writeback.divergences.items() if d is not None}
    at_micro_0 = sorted(p for p, d in found.items() if d.stage == Capture.HP and d.micro == 0)
    unexplained = [str(d) for p, d in found.items() if p not in at_micro_0 and not explained(d)]
    unexplained += [f"fp32_staging {d}" for d in staging.divergences.values() if d is not None and not explained(d)]
    if routers & set(at_micro_0) and not unexplained:
        after = " after the BF16 writeback" if all(Capture.WRITTEN_BACK in found[p].after for p in at_micro_0) else ""
        return Finding(
            WRITEBACK,
            True,
            f"#8913 REPRODUCED: bf16_writeback first departs from the FP32 oracle at 'hp'{after} on micro-step 0 "
            f"(which the correction-once marker leaves corrected) for {', '.join(at_micro_0)}; fp32_staging, the "
            "same path without the writeback, departs only where the marker explains it",
        )
    return Finding(
        WRITEBACK,
        False,
        "#8913 NOT reproduced as described: "
        + ("; ".join(unexplained) if unexplained else "bf16_writeback departs at 'hp' on micro-step 0 for no router"),
    )


def format_report(config: ReproConfig, reports: list[PolicyReport], verdict: Verdict, diff_only: bool = True) -> str:
    """The human-readable report: config, per-policy chains, table and divergences, then the verdict.

    With ``diff_only`` (the default) the table lists only the tensors that differ from the oracle, plus one
    line counting those that match bitwise; ``diff_only=False`` lists every tensor.
    """
    spec = config.spec
    out = [
        f"simdist repro 8913: {spec.describe()}, {config.steps} steps x GAS {config.gas}, seed {config.seed}, "
        f"reduction model {config.reduction}, correction marker {config.marker}, update path {config.update_path}, "
        f"inputs {config.inputs}"
        + ("" if config.code == Code.TRANSCRIBED else f", code {config.code} (real code, gradients only)"),
        f"oracle: {ORACLE_SUMMARY}",
    ]
    for report in reports:
        out += ["", f"== {report.name}: {report.summary}"]
        for param, chain in report.chains.items():
            out.append(f"   {param:<24} {chain}")
        shown = [r for r in report.rows if not (diff_only and r.bitwise_equal)]
        if shown:
            out.append(
                f"   {'rank':>4}  {'parameter':<24} {'tensor':<15} {'bitwise':<8} {'max ulp':>10} "
                f"{'err/sum|t|':>10} {'norm rel':>9} {'differ':>7}"
            )
        for r in shown:
            terms = "-" if r.term_relative is None else f"{r.term_relative:.2e}"
            out.append(
                f"   {r.rank:>4}  {r.param:<24} {r.kind:<15} {'yes' if r.bitwise_equal else 'NO':<8} "
                f"{r.max_ulp:>10} {terms:>10} {r.norm_relative:>9.2e} {100 * r.fraction_differing:>6.1f}%"
            )
        equal = sum(r.bitwise_equal for r in report.rows)
        if diff_only:
            out.append(f"   {equal} of {len(report.rows)} tensors bitwise equal to the oracle (not listed)")
        for where in report.first_divergence.values():
            if where:
                out.append(f"   first divergence: {where}")
        if not report.departs:
            out.append("   no divergence: every captured stage is bitwise equal to the oracle")
    out += [
        "",
        "max ulp counts values of the oracle's dtype between the two; err/sum|t| is |error| / sum|terms| of the "
        "oracle's reduction (stays comparable to the unit roundoff where a sum cancels); norm rel is "
        "||error|| / ||oracle||.",
    ]
    if verdict.inputs:
        out.append(f"inputs: {verdict.inputs}")
    if verdict.power_line:
        out.append(verdict.power_line)
    if verdict.exact:
        out.append(
            "step 0 DP-reduced gradient vs the exact (FP64) reduction rounded to FP32: "
            + "; ".join(e.line for e in verdict.exact)
        )
    out += [f"verdict: {line}" for line in verdict.line.splitlines()]
    return "\n".join(out)


def to_json(config: ReproConfig, reports: list[PolicyReport], verdict: Verdict) -> dict:
    """The report as plain data (for ``--json``): every tensor, the verdict lines, and one field per finding.

    ``reproduced`` and ``marker_defect`` are the two findings' flags; ``findings`` holds each finding's
    ``shown``, ``applies`` and line under its key (`WRITEBACK`, `CORRECTION_MARKER`).
    """
    policies = []
    for report in reports:
        data = asdict(report)
        data.pop("divergences")
        policies.append(data)
    return {
        "config": asdict(config),
        "policies": policies,
        "verdict": verdict.line,
        "reproduced": verdict.reproduced,
        "marker_defect": verdict.marker_defect,
        "findings": {f.key: {"shown": f.shown, "applies": f.applies, "line": f.line} for f in verdict.findings},
        "inputs": verdict.inputs,
        "power_checks": [asdict(c) | {"line": c.line} for c in verdict.power],
        "power_shown": verdict.power_shown,
        "power_line": verdict.power_line,
        "exact": [asdict(e) | {"line": e.line} for e in verdict.exact],
    }
