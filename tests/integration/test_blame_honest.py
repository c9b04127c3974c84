"""simdist.blame's sites and figures stay honest: the user's line past torch's deprecation wrappers, overflow in
the table and ranked first, the loss unscaled under a GradScaler, bad input refused before the run, a figure
whose every panel has tick labels."""

from __future__ import annotations

import inspect
import json
import math

import pytest
import torch
import torch.distributed as dist

from simdist.attribution import blame
from simdist.attribution.api import SiteNotFound
from simdist.attribution.measure import Errors, SiteErrors, errors
from simdist.attribution.report import BlameReport
from simdist.cli import main
from simdist.numerics.floats import bits
from simdist.world.errors import CollectiveMismatchError


def _line(fn, marker: str) -> int:
    lines, start = inspect.getsourcelines(fn)
    return start + next(i for i, text in enumerate(lines) if marker in text)


# -- call sites past typing_extensions.deprecated -------------------------------------------------------


def _deprecated_wrappers(rank: int) -> None:
    x = torch.tensor([1.0, 2.0**-24, 3.0, 2.0**-24]) * (1 + rank)
    dist.reduce_scatter_tensor(torch.empty(2), x)  # LINE_RS
    dist.all_reduce_coalesced([torch.tensor([1.0, 2.0**-24 * rank])])  # LINE_COALESCED


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_calls_through_a_deprecation_wrapper_are_sited_at_the_users_line():
    """torch 2.13 wraps all_reduce_coalesced in typing_extensions.deprecated: two sites, each at its own line."""
    report = blame(_deprecated_wrappers, 2, reduction="sequential")
    found = {(s.op, s.file, s.line, s.function) for s in report.sites}
    assert found == {
        ("reduce_scatter_tensor", __file__, _line(_deprecated_wrappers, "LINE_RS"), "_deprecated_wrappers"),
        ("all_reduce_coalesced", __file__, _line(_deprecated_wrappers, "LINE_COALESCED"), "_deprecated_wrappers"),
    }


def _mismatched_coalesced(rank: int) -> None:
    dist.all_reduce_coalesced([torch.zeros(2 + rank)])  # LINE_MISMATCH


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_a_mismatch_through_a_deprecation_wrapper_names_the_users_line():
    import simdist

    with pytest.raises(CollectiveMismatchError) as raised:
        simdist.run(_mismatched_coalesced, 2)
    assert f"{__file__}:{_line(_mismatched_coalesced, 'LINE_MISMATCH')}" in str(raised.value)
    assert "typing_extensions" not in str(raised.value)


# -- non-finite results -------------------------------------------------------------------------------


def test_errors_count_overflow_apart_from_non_finite_inputs():
    """An infinite result of a finite exact value is an overflow; an infinite exact value is not the site's."""
    result = torch.tensor([-math.inf, math.inf, 1.0], dtype=torch.float16)
    exact = torch.tensor([-120000.0, math.inf, 1.0], dtype=torch.float64)
    found = errors(result, exact, exact.abs())
    assert (found.elements, found.nonfinite, found.overflow, found.mass) == (3, 2, 1, 0.0)


def _pre_and_post_division(rank: int) -> None:
    x = torch.tensor([-60000.0, 1.0 if rank == 0 else 3 * 2.0**-11], dtype=torch.float16)
    many = torch.full((64,), 1.0 if rank == 0 else 3 * 2.0**-11, dtype=torch.float16)
    pre = torch.cat([x / 2, many])
    dist.all_reduce(pre)  # LINE_PRE: rounds in 65 elements, no overflow
    post = x.clone()
    dist.all_reduce(post)  # LINE_POST: -120000 overflows fp16 (max 65504)


def test_overflow_is_in_the_table_and_ranked_before_a_larger_error_mass():
    report = blame(_pre_and_post_division, 2, reduction="sequential")
    post, pre = report.sites
    assert post.line == _line(_pre_and_post_division, "LINE_POST")
    assert (post.errors.nonfinite, post.errors.overflow, pre.errors.nonfinite) == (2, 2, 0)
    assert pre.errors.mass > post.errors.mass > 0  # ranked by mass alone, the overflowing site would come second
    table = report.format().splitlines()
    assert "inf/nan" in table[2] and "overflow: 1 site(s)" in table[1]
    assert table[3].split()[10] == "2!" and table[4].split()[10] == "0"
    assert report.to_dict()["sites"][0]["overflow"] == 2


def test_a_table_without_non_finite_results_has_no_inf_nan_column():
    report = blame(_one_rounding, 2)
    assert "inf/nan" not in report.format()


# -- the loss under a GradScaler -----------------------------------------------------------------------


def _scaled_training(rank: int) -> torch.Tensor:
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(8))
    opt = torch.optim.SGD([w], lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    x = torch.randn(8)
    losses = []
    for _ in range(2):
        opt.zero_grad()
        loss = (w.to(torch.float16).float() * x).sum() ** 2
        losses.append(loss.detach().clone())
        scaler.scale(loss).backward()
        dist.all_reduce(w.grad)
        scaler.step(opt)
        scaler.update()
    return losses[-1]


def test_the_loss_is_the_unscaled_one_and_the_scaled_root_is_labelled_apart():
    report = blame(_scaled_training, 2)
    for rank, loss in enumerate(report.results):
        assert torch.equal(bits(report.state["loss"][f"rank {rank} final"]), bits(loss))
        assert torch.equal(bits(report.state["scaled loss"][f"rank {rank} final"]), bits(loss * 1024.0))


def test_without_a_scaler_the_loss_is_the_backward_root_and_no_scaled_loss_is_kept():
    def plain(rank: int) -> torch.Tensor:
        w = torch.nn.Parameter(torch.ones(3))
        loss = (w * 3.0).sum()
        loss.backward()
        return loss.detach()

    report = blame(plain, 2)
    assert report.state["scaled loss"] == {}
    assert [float(v) for v in report.state["loss"].values()] == [9.0, 9.0]


# -- bad input, before the run -------------------------------------------------------------------------


def _one_rounding(rank: int) -> torch.Tensor:
    value = torch.tensor([1.0 if rank == 0 else 2.0**-24])
    dist.all_reduce(value)
    return value


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"promote_top": "a"}, "promote_top must be a non-negative integer, got 'a'"),
        ({"promote_top": -1}, "promote_top must be a non-negative integer, got -1"),
        ({"promote": [-1]}, "site ids start at 1"),
        ({"promote": ["0"]}, "site ids start at 1"),
        ({"promote": ["a"]}, "a site is an id"),
        ({"promote": [1.5]}, "not a float"),
        ({"promote": [True]}, "not a bool"),
    ],
)
def test_bad_promote_options_are_refused_before_the_run(options, message):
    ran = []

    def fn(rank: int) -> None:
        ran.append(rank)

    with pytest.raises(ValueError, match=message):
        blame(fn, 2, **options)
    assert ran == []


def _arguments(rank: int, label: str, *, scale: float) -> tuple:
    """A rank function with a positional and a keyword-only argument of its own."""
    return rank, label, scale, dist.get_world_size()


def test_fns_arguments_travel_in_args_and_kwargs_apart_from_blames_keywords():
    """As `simdist.run`: ``fn``'s arguments in ``args=``/``kwargs=``, the world a size or a `ParallelSpec`; a loose
    keyword is blame's own or a ``TypeError`` (``model=`` was the reduction's spelling once), never ``fn``'s."""
    from simdist.world.spec import ParallelSpec

    report = blame(_arguments, 2, args=("x",), kwargs={"scale": 0.5})
    assert report.results == [(0, "x", 0.5, 2), (1, "x", 0.5, 2)]
    assert blame(_arguments, ParallelSpec(4, tp=2), args=("y",), kwargs={"scale": 1.0}).results[3] == (3, "y", 1.0, 4)
    for loose in ({"scale": 0.5}, {"model": "ring"}, {"spec": ParallelSpec(2)}):
        with pytest.raises(TypeError, match=f"unexpected keyword argument '{next(iter(loose))}'"):
            blame(_arguments, 2, args=("x",), **loose)


def test_the_launchers_keywords_reach_simdist_run(monkeypatch):
    """Every launcher keyword blame takes is handed to `simdist.run` as given (a dropped one would run on the
    default silently), and its defaults are the launcher's."""
    import simdist.world.runner as runner

    seen: list[dict] = []
    real = runner.run

    def recording_run(fn, world, **kwargs):
        seen.append({"world": world, **kwargs})
        return real(fn, world, **kwargs)

    monkeypatch.setattr(runner, "run", recording_run)
    given = {"reduction": "ring", "timeout_s": 60.0, "one_cpu": False, "intra_op_threads": 2}
    blame(_arguments, 2, args=("x",), kwargs={"scale": 1.0}, **given)
    blame(_arguments, 2, args=("x",), kwargs={"scale": 1.0})
    assert seen[0] == {"world": 2, "args": ("x",), "kwargs": {"scale": 1.0}, **given}
    defaults = {k: p.default for k, p in inspect.signature(real).parameters.items() if k in given}
    assert seen[1] == {"world": 2, "args": ("x",), "kwargs": {"scale": 1.0}, **defaults}


def test_promoting_in_a_run_without_sites_says_so():
    with pytest.raises(SiteNotFound, match="this run has no sites") as raised:
        blame(lambda rank: None, 2, promote=[1])
    assert "1-0" not in str(raised.value)


SCRIPT = """
import torch, torch.distributed as dist
dist.init_process_group("gloo")
print("ran")
dist.all_reduce(torch.tensor([1.0 if dist.get_rank() == 0 else 2.0**-24]))
"""


@pytest.mark.parametrize(
    ("figure", "message"),
    [
        ("{tmp}/missing/f.png", "no such directory"),
        ("{tmp}/f.nosuchformat", "matplotlib writes no .nosuchformat files"),
        ("{tmp}", "is a directory"),
    ],
)
def test_an_unusable_figure_path_is_refused_before_the_run(tmp_path, capsys, figure, message):
    script = tmp_path / "s.py"
    script.write_text(SCRIPT)
    assert main(["blame", "--nproc", "2", "--figure", figure.format(tmp=tmp_path), str(script)]) == 2
    out, err = capsys.readouterr()
    assert message in err and "ran" not in out


def test_a_torchrun_style_script_without_nproc_gets_a_one_line_hint(tmp_path, capsys):
    script = tmp_path / "s.py"
    script.write_text(SCRIPT)
    assert main(["blame", str(script)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "torchrun-style script; run it with --nproc N" in err[0]
    assert main(["blame", "--json", "--nproc", "2", str(script)]) == 0  # the same script with --nproc runs
    assert len(json.loads(capsys.readouterr().out)["sites"]) == 1


# -- the figure ----------------------------------------------------------------------------------------


def _tick_labels(fig) -> list[list[str]]:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig).draw()
    shown = []
    for ax in fig.axes:
        for axis, (lo, hi) in ((ax.xaxis, ax.get_xlim()), (ax.yaxis, ax.get_ylim())):
            lo, hi = min(lo, hi), max(lo, hi)
            ticks = zip(axis.get_majorticklocs(), axis.get_ticklabels(), strict=True)
            shown.append([label.get_text() for loc, label in ticks if lo <= loc <= hi and label.get_text()])
    return shown


def _exact_sum(rank: int) -> None:
    dist.all_reduce(torch.tensor([1.0, 2.0]))


@pytest.mark.parametrize("fn", [_one_rounding, _exact_sum])
def test_every_panel_has_tick_labels_when_errors_stay_within_a_decade(fn):
    """One rounding per step (errors within a decade; or zero) gave an error-vs-step panel without y labels."""
    labels = _tick_labels(blame(fn, 2, reduction="sequential").figure())
    assert len(labels) == 4 and all(labels), labels


def test_errors_within_a_decade_over_steps_get_labelled_ticks():
    site = SiteErrors("/x/train.py", 3, "train", "cast", "to", "fp32->bf16")
    for step, value in enumerate([3e-4, 6e-4, 4.5e-4]):
        site.add(0, step, Errors(elements=1, max_term_relative=value, mass=value))
    labels = _tick_labels(BlameReport([site], {}).figure())
    assert labels[3] == ["0.0003", "0.000424", "0.0006"]


def test_the_error_axis_labels_zero_and_positive_errors():
    from matplotlib.figure import Figure

    from simdist.attribution.report import _error_axis

    fig = Figure()
    ax = fig.subplots()
    ax.plot([0, 1, 2], [0.0, 3e-4, 6e-4])
    _error_axis(ax, [0.0, 3e-4, 6e-4])
    (_, y_labels) = _tick_labels(fig)
    assert y_labels[0] == "0" and "0.0006" in y_labels


def test_non_finite_figures_are_strings_in_the_json_and_finite_ones_numbers():
    """JSON has no inf or nan: a site whose figures are non-finite (e.g. an error relative to an exact 0) writes them
    as ``"inf"`` (``"nan"``), so ``to_json`` is strict JSON that any parser reads; finite figures stay numbers."""
    import json

    from simdist.attribution.measure import Errors, SiteErrors
    from simdist.attribution.report import BlameReport

    site = SiteErrors("f.py", 1, "g", "cast", "aten._to_copy", "fp32->bf16")
    site.add(0, 0, Errors(elements=2, max_ulp=math.inf, max_term_relative=math.inf, max_relative=0.5, mass=0.25))
    data = json.loads(BlameReport([site], {}).to_json(), parse_constant=lambda c: pytest.fail(f"bare {c} in JSON"))
    figures = data["sites"][0]
    assert (figures["max_ulp"], figures["max_err_over_sum_abs_terms"]) == ("inf", "inf")
    assert (figures["max_rel_err"], figures["error_mass"], figures["share"]) == (0.5, 0.25, 1.0)
    assert figures["by_rank"]["0"]["max_ulp"] == "inf" and figures["steps"]["0"]["error_mass"] == 0.25
