"""The #8913 verdict, computed from the comparisons with the oracle (never assumed): the findings (the
``bf16_writeback`` finding, DeepSpeed's correction-once marker), the power checks that prove the run could see
them (`simdist.studies.power`), the distance of each run from the exact reduction, and ``--expect``'s `meets`."""

from __future__ import annotations

from dataclasses import dataclass

from simdist.errors import UsageError
from simdist.gradpath.families import Family
from simdist.gradpath.kernel import Marker, UpdatePath
from simdist.gradpath.probes import Capture, Divergence, Trace
from simdist.numerics.floats import ulp_distance
from simdist.sources import GradientSource
from simdist.sources.synthetic import describe_inputs
from simdist.studies.power import PowerCheck, shows_power
from simdist.studies.repro.config import EXPECTATIONS, PolicyReport, ReproConfig


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


POWER_STAGES = frozenset({Capture.MASTER, Capture.ADAM_M, Capture.ADAM_V})
"""The captures a power check compares: the optimizer's outcome (masters and moments), where every control's
error must arrive; the intermediate gradient captures would differ by construction (a control that corrects
at the boundary leaves the micro-steps' hp buffers uncorrected) and show power that is not there."""


def exact_distances(exact: list[Trace], runs: dict[str, list[Trace]]) -> tuple[ExactDistance, ...]:
    """Each run's step-0 DP-reduced gradient against ``exact`` (the FP64 oracle's, rounded to FP32), in FP32 ulps;
    runs that did not capture it (DeepSpeed's real code, ``--code deepspeed``) are left out."""
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


def with_power(config: ReproConfig, verdict: Verdict, power: tuple[PowerCheck, ...]) -> Verdict:
    """``verdict`` with its input distribution and power checks, one line each after the findings."""
    shown = shows_power(power)
    if config.source != GradientSource.SYNTHETIC:
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
    captured = {r.kind for r in writeback.rows}  # ``--code deepspeed`` captures gradients only
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
        writeback = writeback_beside_marker(reports, families, config.source != GradientSource.SYNTHETIC)
    else:
        alone = (
            verdict(reports, families)
            if config.source == GradientSource.SYNTHETIC
            else model_verdict(reports, families)
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
