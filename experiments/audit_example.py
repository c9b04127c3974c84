"""Audit one optimizer step of the #8913 gradient path: where does it narrow precision?

    python experiments/audit_example.py [--policy bf16_writeback] [--compare fp32_staging] [--json]

Runs one step of `simdist.gradpath.path.train_rank` on 4 simulated ranks (TP2/EP2,
gloo's reduction order, the default synthetic parameters) with every rank
under its own `simdist.audit` (``audited``), merges the per-rank reports and
prints every site that narrows a floating dtype, and every collective with its
dtype. Then it lists the narrowing sites that only one of ``--policy`` and
``--compare`` has: for bf16_writeback against fp32_staging, that is the #8913
BF16 writeback. The same report, from outside: ``simdist audit`` on any script.
"""

from __future__ import annotations

import argparse
import sys

from simdist.audit import AuditReport, audited
from simdist.gradpath.path import PathConfig, train_rank
from simdist.policies.catalogue import get_policy
from simdist.reduce.gloo import Gloo
from simdist.sources.synthetic import DEFAULT_PARAMS, InitialWeights, SyntheticGradients
from simdist.world.simworld import SimWorld
from simdist.world.spec import ParallelSpec

SPEC = ParallelSpec(4, tp=2, ep=2)


def audit_one_step(policy: str) -> AuditReport:
    """The merged report of every rank for one optimizer step under ``policy``."""
    world = SimWorld(SPEC, reduction=Gloo())
    ranks = world.run(
        audited(train_rank),
        list(DEFAULT_PARAMS),
        InitialWeights(SPEC),
        SyntheticGradients(SPEC),
        get_policy(policy),
        PathConfig(steps=1),
    )
    return AuditReport.merge(report for _, report in ranks)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", default="bf16_writeback")
    parser.add_argument("--compare", default="fp32_staging", help="a second policy ('' for none)")
    parser.add_argument("--json", action="store_true", help="print the --policy report as JSON")
    ns = parser.parse_args(argv)
    report = audit_one_step(ns.policy)
    if ns.json:
        print(report.to_json())
        return 0
    print(f"simdist audit of one gradient-path step: {ns.policy}, {SPEC.describe()}, {len(DEFAULT_PARAMS)} params")
    print(report.format())
    if ns.compare:
        other = audit_one_step(ns.compare)
        mine, theirs = report.keys(), other.keys()
        print(f"\nnarrowing sites only under {ns.policy} (absent under {ns.compare}):")
        for where, kind, dtypes in sorted(mine - theirs) or [("none", "", "")]:
            print(f"  {where} {kind} {dtypes}")
        print(f"narrowing sites only under {ns.compare}:")
        for where, kind, dtypes in sorted(theirs - mine) or [("none", "", "")]:
            print(f"  {where} {kind} {dtypes}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
