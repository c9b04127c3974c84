"""Cases per second of property (a): fp32_staging is bitwise equal to the FP32 oracle.

    python bench/properties.py [--examples 400] [--cases 8] [--layout tp2-ep2 | any] [--profile]

Runs property (a) as ``tests/unit/gradpath/test_path_properties.py`` runs it (the same strategy and check, from
`simdist.testing._internal.case_batches` and `simdist.testing._internal.compact`, on the rank-batched gradient path
against the independent oracle) under the ci profile's settings (derandomized, no deadline) with ``--examples``
Hypothesis examples.
Each example holds ``--cases`` independent cases (fewer where the layout is large: `cases_per_example`), run as
one batch through the engine and the oracle and each judged bit for bit; ``--cases 1`` is one case per example,
as before. Prints both rates: cases of property (a) checked per second (the issue's figure: each case is one
layout, GAS, step count and gradient set judged by the oracle) and Hypothesis examples per second, split into
the time Hypothesis spends drawing an example (the layout, GAS, steps and the gradient bytes, and decoding them)
and the time the two runs (fp32_staging and the oracle) and their comparison take. ``--layout tp2-ep2``
(default) fixes the layout to TP2/EP2 on 4 ranks, as the issue's target states it; ``any`` draws layouts as the
test does (up to 8 ranks). Goal: >= 500 cases/s. With ``--cases`` > 1 the same run then measures one case per
example too and prints the ratio (``--no-baseline`` skips it). ``--profile`` adds a cProfile report by internal
time.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time
from pathlib import Path

from hypothesis import given, settings

from simdist.testing._internal.case_batches import oracle_case_batches
from simdist.testing._internal.compact import cases_depart_from_oracle, staging_departs_from_oracle
from simdist.testing.strategies import oracle_cases
from simdist.world.spec import DEFAULT_SPEC

sys.path.append(str(Path(__file__).resolve().parent))  # bench/report.py, also when loaded by path
from report import Table, machine, write

GOAL = 500.0  # cases of property (a) per second, issue 22


def ci_settings(examples: int) -> settings:
    """The ci profile of tests/conftest.py with ``examples`` examples and no example database."""
    return settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        database=None,
    )


def measure(examples: int, layout: str, cases: int) -> dict[str, float]:
    """Run property (a) for ``examples`` examples of up to ``cases`` cases each; seconds in total and in the body,
    and the example and case counts."""
    body_seconds = [0.0]
    count = [0, 0]
    cpu = time.process_time()
    spec = DEFAULT_SPEC if layout == "tp2-ep2" else None
    strategy = oracle_cases(spec) if cases == 1 else oracle_case_batches(spec, cases=cases)
    check = staging_departs_from_oracle if cases == 1 else cases_depart_from_oracle

    @ci_settings(examples)
    @given(strategy)
    def prop(case):
        start = time.perf_counter()
        departure = check(*case)
        if departure is not None:
            raise AssertionError(f"fp32_staging departs from the oracle at {departure}")
        body_seconds[0] += time.perf_counter() - start
        count[0] += 1
        count[1] += 1 if cases == 1 else case[3].cases

    start = time.perf_counter()
    prop()
    total = time.perf_counter() - start
    return {
        "examples": count[0],
        "cases": count[1],
        "total": total,
        "body": body_seconds[0],
        "cpu": time.process_time() - cpu,
    }


def report(result: dict[str, float], layout: str, cases: int) -> None:
    """Print one `measure` result: cases and examples per second, and the split into drawing and running."""
    n, k, total = result["examples"], result["cases"], result["total"]
    rate = k / total
    draw = total - result["body"]
    verdict = "met" if rate >= GOAL else f"{GOAL / rate:.1f}x short"
    print(
        f"property (a), {layout}, ci settings, up to {cases} cases per example: {k} cases in {n} "
        f"examples in {total:.2f} s = {rate:.0f} cases/s, each judged by the oracle (goal {GOAL:.0f}/s: {verdict}); "
        f"{n / total:.0f} Hypothesis examples/s [load average {os.getloadavg()[0]:.1f}; CPU time "
        f"{result['cpu']:.2f} s = {k / result['cpu']:.0f} cases per CPU second]"
    )
    print(
        f"  drawing (Hypothesis + decoding the gradient bytes): {100 * draw / total:.0f}%, "
        f"{1000 * draw / n:.2f} ms/example, {1000 * draw / k:.2f} ms/case"
    )
    print(
        f"  running (fp32_staging and oracle, rank-batched, and the comparison): {100 * result['body'] / total:.0f}%, "
        f"{1000 * result['body'] / n:.2f} ms/example, {1000 * result['body'] / k:.2f} ms/case"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=400)
    parser.add_argument("--cases", type=int, default=8, help="cases per example (1: one per example, as before)")
    parser.add_argument("--layout", choices=("tp2-ep2", "any"), default="tp2-ep2")
    parser.add_argument("--profile", action="store_true", help="print a cProfile report")
    parser.add_argument("--lines", type=int, default=25, help="rows of the profile report")
    parser.add_argument(
        "--no-baseline",
        dest="baseline",
        action="store_false",
        help="skip the run with one case per example (the ratio to it)",
    )
    parser.add_argument("--json", metavar="PATH", help="also write the table as bench/report.py's schema")
    args = parser.parse_args()
    started_on = machine()
    table = Table(
        f"Property (a), fp32_staging bitwise equal to the FP32 oracle, layout {args.layout}, ci settings",
        ["cases per example", "examples", "cases", "seconds", "cases/s", "examples/s", "drawing %", "running %"],
        notes="Each case is one layout, GAS, step count and gradient set, run through the rank-batched gradient path "
        "and the independent oracle and judged bit for bit. *Drawing*: Hypothesis and decoding the gradient bytes; "
        f"*running*: the two runs and the comparison. Goal: >= {GOAL:.0f} cases/s.",
    )

    def row(result: dict[str, float], cases: int) -> None:
        total = result["total"]
        body = 100 * result["body"] / total
        table.add(
            cases,
            result["examples"],
            result["cases"],
            total,
            result["cases"] / total,
            result["examples"] / total,
            100 - body,
            body,
        )

    measure(5, args.layout, args.cases)  # warm-up: imports, strategy caches, torch kernels
    result = measure(args.examples, args.layout, args.cases)
    report(result, args.layout, args.cases)
    row(result, args.cases)
    if args.cases > 1 and args.baseline:
        measure(5, args.layout, 1)
        single = measure(args.examples, args.layout, 1)
        report(single, args.layout, 1)
        row(single, 1)
        ratio = (result["cases"] / result["total"]) / (single["cases"] / single["total"])
        print(f"{args.cases} cases per example check {ratio:.1f}x the cases per second of one case per example")
    if args.json:
        write(args.json, [table], machine_text=started_on)

    if args.profile:
        profile = cProfile.Profile()
        profile.enable()
        measure(args.examples, args.layout, args.cases)
        profile.disable()
        out = io.StringIO()
        pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(args.lines)
        print(out.getvalue())


if __name__ == "__main__":
    main()
