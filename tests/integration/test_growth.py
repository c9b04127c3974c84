"""Error growth: batched runs at any layout, states are the batched gradient path's, runs resume bitwise; CLI."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from simdist.cli import main
from simdist.gradpath.batched import BatchedPath
from simdist.gradpath.path import PathConfig
from simdist.numerics.floats import bits, ulp_distance
from simdist.policies.catalogue import get_policy
from simdist.reduce.gloo import Gloo
from simdist.sources.synthetic import DEFAULT_PARAMS, InitialWeights
from simdist.studies.growth import (
    COLUMNS,
    FILES,
    MOE_COLUMNS,
    BatchedGradients,
    GrowthConfig,
    Reference,
    divergence,
    read_metrics,
    run_growth,
)
from simdist.studies.growth.run import _Interrupted
from simdist.world.spec import ParallelSpec

SPEC = ParallelSpec(4, tp=2, ep=2)


@pytest.mark.parametrize("world", [ParallelSpec(8, tp=2, ep=2), ParallelSpec(8, tp=4, ep=2)])
def test_growth_runs_at_world_8(tmp_path, world):
    """DP4 (TP2 on 8 ranks) and TP4 on 8: groups of four ranks, summed in gloo's order."""
    config = GrowthConfig(steps=6, seeds=2, spec=world)
    summary = run_growth(config, tmp_path, progress=False, plot=False)
    assert summary["policies"]["fp32_staging"]["bitwise_equal_to_oracle"] is True
    _, metrics = read_metrics(tmp_path / FILES["metrics"])
    assert metrics.shape == (6, 3, 2, len(COLUMNS))
    assert (metrics[-1, 0, :, COLUMNS.index("master_rel")] > 0).all()


def test_growth_states_are_the_batched_paths_states(tmp_path):
    """The checkpointed masters are `BatchedPath`'s (which `tests/unit/gradpath/test_batched.py` ties to train_rank)."""
    config = GrowthConfig(policies=("bf16_writeback",), steps=4, seeds=2, checkpoint_every=4)
    run_growth(config, tmp_path, progress=False, plot=False)
    saved = load_file(str(tmp_path / FILES["checkpoint"]))
    stream = BatchedGradients(SPEC, DEFAULT_PARAMS, [0, 1])
    initial = [InitialWeights(SPEC, s) for s in (0, 1)]
    path = BatchedPath(
        SPEC, DEFAULT_PARAMS, get_policy("bf16_writeback"), PathConfig(steps=4), initial, [0, 1], reduction=Gloo()
    )
    path.run(stream.draw)
    for key, value in path.state().items():
        assert torch.equal(bits(saved[f"run1.{key}"]), bits(value)), key


def test_dense_gradients_are_identical_on_tp_peers_and_seeds_differ():
    stream = BatchedGradients(SPEC, DEFAULT_PARAMS, [0, 1])
    g = stream.draw(0, 0)
    assert torch.equal(g["dense.weight"][:, 0], g["dense.weight"][:, 1])
    assert not torch.equal(g["dense.weight"][:, 0], g["dense.weight"][:, 2])
    assert not torch.equal(g["router.weight"][:, 0], g["router.weight"][:, 1])
    assert not torch.equal(g["router.weight"][0], g["router.weight"][1])
    assert g["router.weight"].dtype == torch.bfloat16


def test_divergence_matches_the_library_ulp_distance():
    gen = torch.Generator().manual_seed(0)
    e = torch.randn(3, 4, 50, generator=gen)
    a = e.clone()
    a[0, 0, :5] = torch.nextafter(a[0, 0, :5], torch.full((5,), float("inf")))
    a[1, 2, 7] = -a[1, 2, 7]
    a[2, 1, 3] = 0.0
    e[2, 1, 3] = -0.0  # +0 and -0 are 0 ulps apart: seed 2 has no differing element
    got = divergence(a, Reference(e))
    ulps = ulp_distance(a, e).reshape(3, -1).double()
    assert torch.equal(got[:, 2], ulps.amax(dim=1))
    for seed in range(3):
        differing = ulps[seed][ulps[seed] != 0]
        expected = torch.exp2(differing.log2().mean()) if len(differing) else torch.tensor(0.0, dtype=torch.float64)
        torch.testing.assert_close(got[seed, 1], expected, rtol=1e-6, atol=0)  # logs in fp32 (docstring)
        assert got[seed, 3] == len(differing) / ulps.shape[1]
    rel = (a.double() - e.double()).flatten(1).norm(dim=1) / e.double().flatten(1).norm(dim=1)
    torch.testing.assert_close(got[:, 0], rel, rtol=1e-12, atol=0)
    nan = a.clone()
    nan[0, 0, 0] = float("nan")
    assert got[0, 2] < divergence(nan, Reference(e))[0, 2] == float("inf")


def test_a_seed_gives_the_same_bits_alone_and_in_an_ensemble(tmp_path):
    """Batching over seeds changes nothing: seed 1 of a 3-seed ensemble equals seed 1 run alone."""
    together = run_growth(GrowthConfig(steps=12, seeds=3, seed=0), tmp_path / "a", progress=False, plot=False)
    alone = run_growth(GrowthConfig(steps=12, seeds=1, seed=1), tmp_path / "b", progress=False, plot=False)
    assert together and alone
    _, m3 = read_metrics(tmp_path / "a" / FILES["metrics"])
    _, m1 = read_metrics(tmp_path / "b" / FILES["metrics"])
    np.testing.assert_array_equal(m3[:, :, 1], m1[:, :, 0])


def _outputs(out: Path, names: tuple[str, ...] = ("metrics", "summary", "plot")) -> dict[str, bytes]:
    return {name: (out / FILES[name]).read_bytes() for name in names}


def test_an_interrupted_run_resumes_bitwise(tmp_path):
    """No plot (about 1 s each; `plot_growth` draws the config and the metrics compared here): the same metrics
    draw the same bytes in test_a_finished_run_is_reused_unless_forced, a rerun that finishes a run draws its
    plot in test_a_run_that_crashed_while_plotting_finishes_on_rerun, the whole of it in the SIGKILL test (slow)."""
    config = GrowthConfig(steps=50, seeds=2, checkpoint_every=5)
    run_growth(config, tmp_path / "straight", progress=False, plot=False)
    killed = tmp_path / "killed"
    with pytest.raises(_Interrupted):
        run_growth(config, killed, progress=False, plot=False, stop_after=17)  # last checkpoint at step 15
    assert not (killed / FILES["summary"]).exists()
    assert int(load_file(str(killed / FILES["checkpoint"]))["step"]) == 15
    with pytest.raises(_Interrupted):
        run_growth(config, killed, progress=False, plot=False, stop_after=21)  # resumes at 15, dies at 36
    run_growth(config, killed, progress=False, plot=False)
    assert not (killed / FILES["plot"]).exists()
    assert _outputs(killed, ("metrics", "summary")) == _outputs(tmp_path / "straight", ("metrics", "summary"))
    a = load_file(str(killed / FILES["checkpoint"]))
    b = load_file(str(tmp_path / "straight" / FILES["checkpoint"]))
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(bits(a[k]), bits(b[k])), k
    assert not list(killed.glob(".*.tmp"))


@pytest.mark.slow
def test_a_killed_process_resumes_bitwise(tmp_path):
    """SIGKILL a real `simdist growth` process mid-run, rerun the same command: same files as a clean run."""
    args = ["growth", "--steps", "400", "--seeds", "2", "--checkpoint-every", "10", "--no-progress"]
    assert main([*args, "--out", str(tmp_path / "straight")]) == 0
    killed = tmp_path / "killed"
    cmd = [sys.executable, "-m", "simdist.cli", *args, "--out", str(killed)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not (killed / FILES["checkpoint"]).exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.02)
    time.sleep(0.1)
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL, "the run finished before it could be killed"
    assert (killed / FILES["checkpoint"]).exists() and not (killed / FILES["summary"]).exists()
    assert main([*args, "--out", str(killed)]) == 0
    assert _outputs(killed) == _outputs(tmp_path / "straight")


def test_a_finished_run_is_reused_unless_forced(tmp_path, capsys):
    config = GrowthConfig(steps=8, seeds=1)
    first = run_growth(config, tmp_path, progress=False)
    stamp = (tmp_path / FILES["metrics"]).stat().st_mtime_ns
    png = (tmp_path / FILES["plot"]).read_bytes()
    assert run_growth(config, tmp_path, progress=False) == first
    assert (tmp_path / FILES["metrics"]).stat().st_mtime_ns == stamp
    time.sleep(0.01)
    assert run_growth(config, tmp_path, progress=False, force=True) == first
    assert (tmp_path / FILES["metrics"]).stat().st_mtime_ns != stamp
    assert (tmp_path / FILES["plot"]).read_bytes() == png  # the same metrics draw the same bytes
    with pytest.raises(ValueError, match="different run"):
        run_growth(GrowthConfig(steps=9, seeds=1), tmp_path, progress=False)


def test_cli_growth_writes_metrics_plot_and_summary(tmp_path, capsys):
    out = tmp_path / "run"
    code = main(
        [
            "growth",
            "--policies",
            "bf16_writeback,fp32_staging,bf16_only",
            "--steps",
            "50",
            "--seeds",
            "3",
            "--out",
            str(out),
            "--no-progress",
        ]
    )
    assert code == 0
    text = capsys.readouterr().out
    assert "fp32_staging: bitwise equal to the oracle" in text
    policies, metrics = read_metrics(out / FILES["metrics"])
    assert policies == ["bf16_writeback", "fp32_staging", "bf16_only"]
    assert metrics.shape == (50, 3, 3, len(COLUMNS))
    assert (metrics[:, 1] == 0).all()
    assert (metrics[-1, 0, :, COLUMNS.index("master_rel")] > 0).all()
    # bf16_only rounds more boundaries than bf16_writeback: larger master error at the end, in every seed
    master = COLUMNS.index("master_rel")
    assert (metrics[-1, 2, :, master] > metrics[-1, 0, :, master]).all()
    assert (out / FILES["plot"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads((out / FILES["summary"]).read_text())
    assert summary["policies"]["fp32_staging"]["bitwise_equal_to_oracle"] is True


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--policies", "nope"], "unknown policy"),
        (["--tp", "3"], "tp=3 must divide"),
    ],
)
def test_cli_growth_bad_input_is_one_line(tmp_path, capsys, argv, needle):
    assert main(["growth", "--steps", "2", "--out", str(tmp_path), "--no-progress", *argv]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1


MOE_ARGS = [
    "growth",
    "--source",
    "moe",
    "--policies",
    "bf16_writeback,fp32_staging",
    "--steps",
    "5",
    "--seeds",
    "2",
    "--no-progress",
]


def test_cli_growth_moe_writes_loss_difference_metrics_and_plot(tmp_path, capsys):
    """The MoE block next to the matched FP32 policy: fp32_staging's loss is the matched run's, bf16_writeback's is
    not."""
    out = tmp_path / "moe"
    assert main([*MOE_ARGS, "--out", str(out)]) == 0
    assert "fp32_staging: bitwise equal to the matched FP32 policy" in capsys.readouterr().out
    policies, metrics = read_metrics(out / FILES["metrics"])
    assert policies == ["bf16_writeback", "fp32_staging"]
    assert metrics.shape == (5, 2, 2, len(MOE_COLUMNS))
    loss_diff = MOE_COLUMNS.index("loss_diff")
    assert (metrics[:, 1, :, loss_diff] == 0).all()
    assert (metrics[:, 0, :, loss_diff] > 0).any()
    np.testing.assert_array_equal(
        metrics[:, :, :, loss_diff],
        np.abs(metrics[:, :, :, MOE_COLUMNS.index("loss")] - metrics[:, :, :, MOE_COLUMNS.index("matched_loss")]),
    )
    assert (metrics[:, 0, :, MOE_COLUMNS.index("param_rel")] > 0).all()  # every step's update differs
    assert (metrics[:, 1, :, MOE_COLUMNS.index("param_rel") :] == 0).all()
    loss = MOE_COLUMNS.index("loss")
    assert not (metrics[:, :, 0, loss] == metrics[:, :, 1, loss]).all()  # seeds differ
    assert (out / FILES["plot"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads((out / FILES["summary"]).read_text())
    assert summary["policies"]["fp32_staging"]["bitwise_equal_to_oracle"] is True
    assert summary["policies"]["bf16_writeback"]["max_loss_diff"] > 0
    stamp = (out / FILES["metrics"]).stat().st_mtime_ns
    assert main([*MOE_ARGS, "--out", str(out)]) == 0  # finished: reused, not recomputed
    assert (out / FILES["metrics"]).stat().st_mtime_ns == stamp
    assert not list(out.glob(".*.tmp"))


@pytest.mark.slow  # by default: test_an_interrupted_run_resumes_bitwise and the MoE growth CLI test
def test_an_interrupted_moe_run_resumes_per_policy_and_seed(tmp_path):
    """A MoE growth run stopped between (policy, seed) runs keeps the finished ones and ends with the same files."""
    config = GrowthConfig(policies=("bf16_writeback", "fp32_staging"), steps=3, seeds=2, source="moe")
    run_growth(config, tmp_path / "straight", progress=False)
    killed = tmp_path / "killed"
    with pytest.raises(_Interrupted):
        run_growth(config, killed, progress=False, stop_after=3)
    assert not (killed / FILES["summary"]).exists()
    assert int(load_file(str(killed / FILES["checkpoint"]))["done"].sum()) == 3
    run_growth(config, killed, progress=False)
    assert _outputs(killed) == _outputs(tmp_path / "straight")


# -- exact-zero errors, reruns, the band label (plotting) --------------------------------------------------------


def test_zero_error_policies_are_drawn_summarised_and_rerun_says_reused(tmp_path, capsys):
    """Every policy bitwise equal to the oracle (the best news) plots, summarises and reruns without a crash."""
    out = tmp_path / "zero"
    args = ["growth", "--policies", "fp32_staging", "--steps", "12", "--seeds", "2", "--out", str(out), "--no-progress"]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "fp32_staging: bitwise equal to the oracle (error exactly 0 at every step and seed)" in text
    assert f"wrote {out}/{FILES['metrics']}" in text
    assert (out / FILES["plot"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads((out / FILES["summary"]).read_text())
    assert summary["policies"]["fp32_staging"]["bitwise_equal_to_oracle"] is True
    assert summary["policies"]["fp32_staging"]["master_rel_growth_exponent"] is None
    stamp = (out / FILES["plot"]).stat().st_mtime_ns
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "reused: the run in" in text and "already complete" in text and "wrote" not in text
    assert (out / FILES["plot"]).stat().st_mtime_ns == stamp


def test_a_run_that_crashed_while_plotting_finishes_on_rerun(tmp_path, capsys, monkeypatch):
    import simdist.studies.growth.run as run_module

    def broken(*args, **kwargs):
        raise RuntimeError("plotting failed")

    out = tmp_path / "crashed"
    args = [
        "growth",
        "--policies",
        "bf16_writeback,fp32_staging",
        "--steps",
        "6",
        "--seeds",
        "1",
        "--out",
        str(out),
        "--no-progress",
    ]
    monkeypatch.setattr(run_module, "plot_growth", broken)
    assert main(args) == 3  # an unexpected exception: a bug, with its traceback, not "bad input"
    assert "plotting failed" in capsys.readouterr().err
    assert (out / FILES["checkpoint"]).exists() and not (out / FILES["summary"]).exists()
    monkeypatch.undo()
    assert main(args) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    assert (out / FILES["plot"]).exists() and (out / FILES["summary"]).exists()


def test_zero_and_nonzero_errors_share_a_symlog_axis_and_the_band_says_what_it_is():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from simdist.studies.growth.plot import _draw_band, _error_axis, band

    steps = np.arange(1, 21)
    errors = np.outer(np.sqrt(steps), [1e-6, 2e-6, 3e-6])
    fig, ax = plt.subplots()
    assert _draw_band(ax, steps, np.zeros((20, 3)), "C1", "equal", walk=True) is True
    assert _draw_band(ax, steps, errors, "C0", "rounds", walk=True) is False
    _error_axis(ax, np.stack([np.zeros((20, 3)), errors], axis=1), any_zero_policy=True)
    assert ax.get_yscale() == "symlog"
    low, high = ax.get_ylim()
    assert low < 0 < 1e-6 < errors.max() < high  # the line at 0 and every error are inside the axis
    labels = [line.get_label() for line in ax.get_lines()]
    assert "equal: bitwise equal to the oracle (error exactly 0 at every step and seed)" in labels
    assert "rounds median, min–max band, 3 seeds" in labels
    zero_line = ax.get_lines()[
        labels.index("equal: bitwise equal to the oracle (error exactly 0 at every step and seed)")
    ]
    assert set(zero_line.get_ydata()) == {0.0}
    plt.close(fig)
    lo, hi, what = band(errors)
    assert what == "min–max band, 3 seeds" and (lo == errors.min(axis=1)).all() and (hi == errors.max(axis=1)).all()
    many = np.outer(steps, np.arange(1, 11, dtype=float))
    lo, hi, what = band(many)
    assert what == "10–90% band"
    np.testing.assert_array_equal(lo, np.percentile(many, 10, axis=1))


def test_no_y_label_reaches_into_the_panel_to_its_left():
    """The explorer notebook's figure: every panel's y label and tick labels stay clear of its left neighbour."""
    import matplotlib.pyplot as plt

    from simdist.studies.growth.plot import growth_figure, label_overlaps

    rng = np.random.default_rng(0)
    for model, columns in (("synthetic", COLUMNS), ("moe", MOE_COLUMNS)):
        config = GrowthConfig(policies=("bf16_writeback", "fp32_staging"), steps=30, seeds=2, source=model)
        metrics = 10.0 ** rng.uniform(-12, 6, size=(30, 2, 2, len(columns)))
        metrics[:, 1] = 0.0
        fig = growth_figure(config, metrics)
        panels = np.array(fig.axes).reshape(2, -1)
        assert label_overlaps(fig, panels) == []
        plt.close(fig)


def test_every_panel_spans_every_step_even_when_all_errors_are_zero():
    """A panel that holds only the line at 0 has no data to autoscale its x axis from: it must still reach the
    last step (it once stopped at 10 for a 50-step run)."""
    import matplotlib.pyplot as plt

    from simdist.studies.growth.plot import growth_figure

    config = GrowthConfig(policies=("fp32_staging",), steps=50, seeds=2)
    fig = growth_figure(config, np.zeros((50, 1, 2, len(COLUMNS))))
    for ax in fig.axes:
        if ax.get_xscale() == "log":
            low, high = ax.get_xlim()
            assert low <= 1 and high >= 50
    plt.close(fig)
