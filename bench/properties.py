"""Examples per second of property (a): fp32_staging is bitwise equal to the FP32 oracle.

    python bench/properties.py [--examples 200] [--profile]

Runs the body of ``tests/test_gradpath_properties.py::test_fp32_staging_is_bitwise_equal_to_the_fp32_oracle``
(same strategy, same check) under the ci profile's settings (derandomized, no deadline) with ``--examples``
examples, and prints examples per second, split into the time Hypothesis spends generating the gradient
streams and the time the two SimWorld runs (fp32_staging and oracle) take. The target is 500 examples/s.

``--profile`` adds two cProfile reports: the main thread (Hypothesis generation, waiting on the rank threads)
and the rank threads (``train_rank`` and the collectives), merged over every run.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import threading
import time
from pathlib import Path

from hypothesis import HealthCheck, given, settings

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tests.test_gradpath_properties as properties

TARGET = 500.0


def ci_settings(examples: int) -> settings:
    """The ci profile of tests/conftest.py with ``examples`` examples and no example database."""
    return settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


def measure(examples: int) -> dict[str, float]:
    """Run property (a) for ``examples`` examples; seconds in total and in the body, and the example count."""
    body_seconds = [0.0]
    count = [0]

    @ci_settings(examples)
    @given(properties.oracle_cases())
    def prop(case):
        start = time.perf_counter()
        properties.check_fp32_staging_matches_oracle(*case)
        body_seconds[0] += time.perf_counter() - start
        count[0] += 1

    start = time.perf_counter()
    prop()
    total = time.perf_counter() - start
    return {"examples": count[0], "total": total, "body": body_seconds[0]}


def _profiled_rank_program(profiles: list[cProfile.Profile], lock: threading.Lock):
    original = properties.train_rank

    def train_rank(comm, *args, **kwargs):
        profile = cProfile.Profile()
        profile.enable()
        try:
            return original(comm, *args, **kwargs)
        finally:
            profile.disable()
            with lock:
                profiles.append(profile)

    return original, train_rank


def _top(stats: pstats.Stats, key: str, lines: int) -> str:
    out = io.StringIO()
    stats.stream = out
    stats.sort_stats(key).print_stats(lines)
    return out.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=200)
    parser.add_argument("--profile", action="store_true", help="print cProfile reports of both sides")
    parser.add_argument("--lines", type=int, default=20, help="rows per profile report")
    args = parser.parse_args()

    measure(5)  # warm-up: imports, strategy caches, torch kernels
    result = measure(args.examples)
    rate = result["examples"] / result["total"]
    body = result["body"] / result["total"]
    print(
        f"property (a), ci settings: {result['examples']} examples in {result['total']:.2f} s = {rate:.1f} examples/s "
        f"(target {TARGET:.0f}/s: {'met' if rate >= TARGET else f'{TARGET / rate:.0f}x short'})"
    )
    print(
        f"  two SimWorld runs per example: {100 * body:.0f}% of the time, "
        f"{1000 * result['body'] / result['examples']:.1f} ms/example"
    )
    print(
        f"  Hypothesis generation and engine: {100 * (1 - body):.0f}%, "
        f"{1000 * (result['total'] - result['body']) / result['examples']:.1f} ms/example"
    )

    if args.profile:
        profiles: list[cProfile.Profile] = []
        original, wrapped = _profiled_rank_program(profiles, threading.Lock())
        properties.train_rank = wrapped
        main_thread = cProfile.Profile()
        try:
            main_thread.enable()
            measure(args.examples)
            main_thread.disable()
        finally:
            properties.train_rank = original
        print("\n== main thread (Hypothesis generation; waits on rank threads), by cumulative time")
        print(_top(pstats.Stats(main_thread), "cumulative", args.lines))
        ranks = pstats.Stats(profiles[0])
        for profile in profiles[1:]:
            ranks.add(profile)
        print(f"== rank threads ({len(profiles)} rank programs), by internal time")
        print(_top(ranks, "tottime", args.lines))


if __name__ == "__main__":
    main()
