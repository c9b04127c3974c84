"""``simdist growth --metrics-dense N --metrics-every K``: the schedule reaches the run and its CSV, bad values are
one-line errors, and `GrowthConfig` checks the schedule."""

from __future__ import annotations

import json

import pytest

from simdist.cli import main
from simdist.studies.growth import FILES, GrowthConfig, read_metrics
from simdist.studies.growth import run as growth_run

ARGS = ["growth", "--policies", "bf16_writeback", "--steps", "14", "--seeds", "1", "--no-progress"]


def test_the_flags_set_the_recorded_steps(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(growth_run, "plot_growth", lambda *args: None)  # the plot is not what is tested (seconds)
    out = tmp_path / "run"
    assert main([*ARGS, "--metrics-dense", "5", "--metrics-every", "4", "--out", str(out)]) == 0
    lines = (out / FILES["metrics"]).read_text().splitlines()
    assert (
        lines[0] == "# metrics at every step up to 5, then every 4th step and the last (the training runs every step)"
    )
    assert [int(line.split(",")[0]) for line in lines[2:]] == [1, 2, 3, 4, 5, 8, 12, 14]
    assert read_metrics(out / FILES["metrics"])[1].shape[0] == 8
    config = json.loads((out / FILES["config"]).read_text())
    assert (config["metrics_dense"], config["metrics_every"]) == (5, 4)
    assert main([*ARGS, "--metrics-dense", "0", "--metrics-every", "7", "--out", str(tmp_path / "sparse")]) == 0
    steps = [int(line.split(",")[0]) for line in (tmp_path / "sparse" / FILES["metrics"]).read_text().splitlines()[2:]]
    assert steps == [7, 14]


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--metrics-every", "0"], "--metrics-every: expected a positive integer, got 0"),
        (["--metrics-dense", "-1"], "--metrics-dense: expected a non-negative integer, got -1"),
        (["--metrics-every", "ten"], "--metrics-every: expected a positive integer, got 'ten'"),
    ],
)
def test_bad_values_are_one_line_errors(tmp_path, capsys, argv, needle):
    assert main([*ARGS, "--out", str(tmp_path), *argv]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1
    assert not any(tmp_path.iterdir())


def test_the_config_checks_the_schedule():
    """The flags' defaults are `GrowthConfig`'s by construction (``tests/unit/cli/test_options.py``)."""
    with pytest.raises(ValueError, match="metrics_dense must be >= 0"):
        GrowthConfig(metrics_dense=-1).validate()
