"""simdist.blame: per-site errors against exact values worked out by hand, promotion, the CLI and the #8913 demo."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

from simdist.attribution import blame
from simdist.cli import main
from simdist.numerics.floats import bits
from simdist.testing.strategies import float_values, rank_tensors

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "experiments"))

from blame_8913 import train  # noqa: E402


def _one_plus_tiny(rank: int) -> torch.Tensor:
    value = torch.tensor([1.0 if rank == 0 else 2.0**-24])
    dist.all_reduce(value)  # LINE_ALL_REDUCE
    return value


def _line(fn, marker: str) -> int:
    import inspect

    lines, start = inspect.getsourcelines(fn)
    return start + next(i for i, text in enumerate(lines) if marker in text)


def test_collective_error_is_measured_against_the_exact_sum():
    """1 + 3 x 2**-24 folded left in fp32 gives 1.0: error 3 x 2**-24, 1.5 ulp; every figure worked out by hand."""
    report = blame(_one_plus_tiny, 4, reduction="sequential")
    assert [float(t) for t in report.results] == [1.0] * 4
    (site,) = report.sites
    assert (site.kind, site.op, site.dtypes, site.function) == ("collective", "all_reduce", "fp32", "_one_plus_tiny")
    assert (site.file, site.line) == (__file__, _line(_one_plus_tiny, "LINE_ALL_REDUCE"))
    exact = 1 + 3 * 2.0**-24
    error = 3 * 2.0**-24
    e = site.errors
    assert (site.calls, e.elements, e.nonfinite) == (4, 4, 0)
    assert e.max_ulp == error / 2.0**-23 == 1.5
    assert e.max_term_relative == error / exact
    assert e.max_relative == error / exact
    assert e.mass == pytest.approx(4 * error / exact, rel=1e-15)
    assert report.share(site) == 1.0


def test_promoting_a_collective_gives_its_exact_sum_rounded_once():
    """Exact 1 + 1.5 ulp rounds (ties to even) to 1 + 2 ulp: what every rank holds in the promoted rerun."""
    import simdist
    from simdist.attribution.run import Recorder, execute

    def target():
        return simdist.run(_one_plus_tiny, 4, reduction="sequential")

    report = blame(_one_plus_tiny, 4, reduction="sequential", promote=[1])
    (promotion,) = report.promotions
    assert promotion.events == 4 and promotion.failed is None
    moved = promotion.movement["results"]  # fn's returned tensors: 1.0 in the base run, 1 + 2**-22 promoted
    assert (moved.tensors, moved.differing, moved.max_ulp, moved.max_abs) == (4, 4, 2, 2.0**-22)
    assert "results" in report.format() and promotion.movement["parameters"].tensors == 0
    recorder = Recorder(promote={report.sites[0].key})
    assert [float(t) for t in execute(target, recorder)] == [1 + 2.0**-22] * 4
    assert recorder.sites[report.sites[0].key].errors.max_ulp == 0.5  # 1 + 2**-22 is half an ulp from the exact sum


def _cast(rank: int) -> torch.Tensor:
    wide = torch.tensor([1 + 2.0**-8, 3.0, -(1 + 2.0**-8)])
    return wide.to(torch.bfloat16)  # LINE_CAST


def test_cast_error_is_measured_against_the_wide_input():
    """1 + 2**-8 is halfway between bf16 neighbours 1 and 1 + 2**-7: ties to even gives 1, half an ulp off."""
    report = blame(_cast, 2)
    (site,) = report.sites
    assert (site.kind, site.op, site.dtypes, site.line) == ("cast", "to", "fp32->bf16", _line(_cast, "LINE_CAST"))
    assert site.ranks == {0, 1} and site.calls == 2
    e = site.errors
    assert e.elements == 6 and e.max_ulp == 0.5
    assert e.max_relative == e.max_term_relative == 2.0**-8 / (1 + 2.0**-8)
    assert e.mass == pytest.approx(4 * 2.0**-8 / (1 + 2.0**-8), rel=1e-15)
    promoted = blame(_cast, 2, promote=[f"{Path(__file__).name}:{site.line}"])
    assert promoted.promotions[0].events == 2


@pytest.mark.slow
def test_a_rerun_without_promotion_is_bitwise_the_base_run():
    """Promotion compares with the base run: that is sound only because two runs give the same bits."""
    a, b = blame(train, 4, kwargs={"steps": 2}), blame(train, 4, kwargs={"steps": 2})
    for category in a.state:
        assert a.state[category].keys() == b.state[category].keys()
        for name, t in a.state[category].items():
            assert torch.equal(bits(t), bits(b.state[category][name])), (category, name)
    assert [s.key for s in a.sites] == [s.key for s in b.sites]


def _writeback_site(report):
    line = next(
        i
        for i, text in enumerate((ROOT / "experiments/blame_8913.py").read_text().splitlines(), 1)
        if "the BF16 writeback" in text
    )
    return next(i for i, s in enumerate(report.sites, 1) if s.line == line and s.kind == "cast")


def test_8913_written_as_a_script_blames_the_writeback_by_end_to_end_effect():
    """No knowledge of DeepSpeed: promoting each site in turn, only the writeback moves the final state."""
    report = blame(train, 4, kwargs={"steps": 3}, promote_top=len(blame(train, 4, kwargs={"steps": 1}).sites))
    writeback = _writeback_site(report)
    ranked = report.ranked_promotions()
    assert ranked[0].sites == [writeback]
    top = ranked[0].movement
    assert top["parameters"].differing == 4 and top["optimizer state"].differing > 0 and top["loss"].differing > 0
    for p in ranked[1:]:  # the collectives are exact here (sums of two BF16-valued terms); the rest not promotable
        assert p.failed is None
        assert all(m.differing == 0 for m in p.movement.values()), p.label
    _check_readme_block(report)


def _check_readme_block(report):
    """Every row README shows of this run (columns trimmed there) is a row of the real table, token for token."""
    readme = (ROOT / "docs" / "howto" / "audit-and-blame.md").read_text()
    start = readme.index("$ simdist blame --promote-top 6 experiments/blame_8913.py")
    shown = readme[start : readme.index("```", start)].splitlines()[1:]
    actual = [line.split("  [")[0].split() for line in report.format(base=str(ROOT)).splitlines()]
    rows = [line.split() for line in shown if line.strip() and line.strip() != "..."]
    assert len(rows) >= 12
    for row in rows:
        assert row in actual or any(a[: len(row)] == row for a in actual), row


@pytest.mark.slow
def test_8913_without_the_writeback_nothing_is_left_to_blame_on_the_gradient_path():
    """The mutation: drop the writeback and its site leaves the table; no promotion moves the final state."""
    report = blame(train, 4, kwargs={"steps": 2, "writeback": False}, promote_top=6)
    line = next(
        i
        for i, text in enumerate((ROOT / "experiments/blame_8913.py").read_text().splitlines(), 1)
        if "the BF16 writeback" in text
    )
    assert all(s.line != line for s in report.sites)
    assert all(m.differing == 0 for p in report.promotions for m in p.movement.values())


def test_cli_json_is_pure_json_and_bad_promote_is_bad_input(capsys):
    script = str(ROOT / "experiments/blame_8913.py")
    assert main(["blame", "--json", script]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [s["id"] for s in data["sites"]] == list(range(1, len(data["sites"]) + 1))
    assert math.isclose(sum(s["share"] for s in data["sites"]), 1.0)
    assert main(["blame", "--promote", "nowhere.py:3", script]) == 2
    assert "names no site" in capsys.readouterr().err


TORCHRUN_SCRIPT = """
import torch, torch.distributed as dist
dist.init_process_group("gloo")
values = [1.0, 2.0**-8] if dist.get_rank() == 0 else [2.0**-8, 1.0]
dist.all_reduce(x := torch.tensor(values, dtype=torch.bfloat16))
dist.destroy_process_group()
"""


def test_cli_runs_a_torchrun_style_script_on_rank_threads(tmp_path, capsys):
    """1 + 2**-8 in bf16 (8 bits) is a tie: rounds to 1, half an ulp (2**-8 / (1 + 2**-8) relative)."""
    script = tmp_path / "tr.py"
    script.write_text(TORCHRUN_SCRIPT)
    assert main(["blame", "--json", "--nproc", "2", str(script)]) == 0
    (site,) = json.loads(capsys.readouterr().out)["sites"]
    assert (site["line"], site["op"], site["dtypes"], site["calls"]) == (5, "all_reduce", "bf16", 2)
    assert site["max_ulp"] == 0.5 and site["max_rel_err"] == 2.0**-8 / (1 + 2.0**-8)


def test_simdist_blame_stays_the_function_once_its_package_is_imported():
    """Importing a submodule binds it on its parent: the package behind ``simdist.blame`` must not be named so."""
    import simdist
    import simdist.attribution.run

    assert simdist.blame is blame and callable(simdist.blame)


def _reduce_and_return(rank, values):
    tensor = values[rank].clone()
    dist.all_reduce(tensor)
    return tensor


@pytest.mark.slow
@given(n=st.integers(2, 4), data=st.data())
def test_collective_figures_equal_an_exact_rational_reference(n, data):
    """Per element, |result - exact| / |exact| and / sum|terms| from Fractions (not FP64) match blame's figures."""
    from fractions import Fraction

    values = data.draw(
        rank_tensors(n, 3, torch.float32, float_values(torch.float32, min_exponent=-30, max_exponent=30))
    )
    report = blame(_reduce_and_return, n, args=(values,), reduction="gloo")
    (site,) = report.sites
    rel, scaled = 0.0, 0.0
    for result in report.results:
        for i, r in enumerate(result.tolist()):
            terms = [Fraction(v[i].item()) for v in values]
            exact, magnitude = sum(terms), sum(abs(t) for t in terms)
            error = abs(Fraction(r) - exact)
            if exact:
                rel = max(rel, float(error / abs(exact)))
            if magnitude:
                scaled = max(scaled, float(error / magnitude))
    assert site.errors.max_relative == pytest.approx(rel, rel=1e-9, abs=0)
    assert site.errors.max_term_relative == pytest.approx(scaled, rel=1e-9, abs=0)
