"""The growth run's oracle steps and metrics on a worker thread (``overlap=True``, `run._Beside`): the files are
those of running every job in the loop (the default), a checkpoint holds the oracle and every row up to its step
even when the worker lags, and a worker's error surfaces."""

from __future__ import annotations

import time

import pytest

from simdist.studies.growth import FILES, GrowthConfig, run_growth
from simdist.studies.growth import run as growth_run
from simdist.studies.growth.run import _Interrupted

CONFIG = GrowthConfig(policies=("bf16_writeback", "fp32_staging"), steps=24, seeds=2, checkpoint_every=8)


def _files(out) -> dict[str, bytes]:
    return {name: (out / FILES[name]).read_bytes() for name in ("metrics", "summary")}


def _slow_metrics(monkeypatch) -> None:
    """The worker lags several steps behind the loop."""
    real = growth_run.divergence_each

    def slow(*args):
        time.sleep(0.01)
        return real(*args)

    monkeypatch.setattr(growth_run, "divergence_each", slow)


def test_jobs_on_the_worker_give_the_files_of_jobs_run_in_the_loop(tmp_path):
    run_growth(CONFIG, tmp_path / "worker", progress=False, plot=False, overlap=True)
    run_growth(CONFIG, tmp_path / "loop", progress=False, plot=False)
    assert _files(tmp_path / "worker") == _files(tmp_path / "loop")


def test_a_checkpoint_holds_every_row_even_when_the_worker_lags(tmp_path, monkeypatch):
    run_growth(CONFIG, tmp_path / "straight", progress=False, plot=False)
    _slow_metrics(monkeypatch)
    with pytest.raises(_Interrupted):
        run_growth(CONFIG, tmp_path / "killed", progress=False, plot=False, stop_after=10, overlap=True)  # ckpt: step 8
    monkeypatch.undo()
    run_growth(CONFIG, tmp_path / "killed", progress=False, plot=False)  # resumes from step 8's rows
    assert _files(tmp_path / "killed") == _files(tmp_path / "straight")


def test_an_error_on_the_worker_stops_the_run(tmp_path, monkeypatch):
    def broken(*args):
        raise RuntimeError("metrics broke")

    monkeypatch.setattr(growth_run, "divergence_each", broken)
    with pytest.raises(RuntimeError, match="metrics broke"):
        run_growth(CONFIG, tmp_path, progress=False, plot=False, overlap=True)
    assert not (tmp_path / FILES["summary"]).exists()
