"""The repro's report: the text ``simdist repro`` prints (`format_report`) and its JSON (`to_json`)."""

from __future__ import annotations

from dataclasses import asdict

from simdist.studies.repro.config import ORACLE_SUMMARY, Code, PolicyReport, ReproConfig
from simdist.studies.repro.verdict import Verdict


def format_report(config: ReproConfig, reports: list[PolicyReport], verdict: Verdict, diff_only: bool = True) -> str:
    """The human-readable report: config, per-policy chains, table and divergences, then the verdict.

    With ``diff_only`` (the default) the table lists only the tensors that differ from the oracle, plus one
    line counting those that match bitwise; ``diff_only=False`` lists every tensor.
    """
    spec = config.spec
    out = [
        f"simdist repro 8913: {spec.describe()}, {config.steps} steps x GAS {config.gas}, seed {config.seed}, "
        f"reduction {config.reduction}, correction marker {config.marker}, update path {config.update_path}, "
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
