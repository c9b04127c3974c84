"""Growth metrics recorded every step up to ``metrics_dense``, then every ``metrics_every``-th step (and the last):
the recorded rows are the every-step rows of those steps, the CSV says so, and a resumed run gives the same files."""

from __future__ import annotations

import numpy as np
import pytest

from simdist.studies.growth import FILES, GrowthConfig, read_metrics, run_growth
from simdist.studies.growth.metrics import metric_steps
from simdist.studies.growth.run import _Interrupted

SPARSE = GrowthConfig(policies=("bf16_writeback", "fp32_staging"), steps=14, seeds=2, metrics_dense=5, metrics_every=4)


def test_the_schedule_is_dense_then_every_kth_step_and_the_last():
    assert metric_steps(SPARSE).tolist() == [1, 2, 3, 4, 5, 8, 12, 14]
    assert metric_steps(GrowthConfig(steps=1200)).tolist() == [*range(1, 1001), *range(1010, 1201, 10)]
    with pytest.raises(ValueError, match="metrics_every"):
        GrowthConfig(steps=3, metrics_every=0).validate()


def test_sparse_rows_are_the_dense_rows_of_those_steps(tmp_path):
    dense = GrowthConfig(policies=SPARSE.policies, steps=SPARSE.steps, seeds=2, metrics_every=1)
    run_growth(dense, tmp_path / "dense", progress=False, plot=False)
    run_growth(SPARSE, tmp_path / "sparse", progress=False, plot=False)
    _, every = read_metrics(tmp_path / "dense" / FILES["metrics"])
    _, some = read_metrics(tmp_path / "sparse" / FILES["metrics"])
    assert every.shape[0] == 14 and some.shape[0] == 8
    np.testing.assert_array_equal(some, every[metric_steps(SPARSE) - 1])
    assert (some[:, 0, :, 0] > 0).all()  # bf16_writeback's master error is recorded on every row, the last too
    lines = (tmp_path / "sparse" / FILES["metrics"]).read_text().splitlines()
    assert (
        lines[0] == "# metrics at every step up to 5, then every 4th step and the last (the training runs every step)"
    )
    assert [int(line.split(",")[0]) for line in lines[2::4]] == metric_steps(SPARSE).tolist()
    assert (tmp_path / "dense" / FILES["metrics"]).read_text().startswith("# metrics at every step\n")


def test_a_sparse_run_resumes_with_the_same_files(tmp_path):
    config = GrowthConfig(
        policies=SPARSE.policies, steps=14, seeds=2, metrics_dense=5, metrics_every=4, checkpoint_every=4
    )
    run_growth(config, tmp_path / "straight", progress=False, plot=False)
    with pytest.raises(_Interrupted):
        run_growth(
            config, tmp_path / "killed", progress=False, plot=False, stop_after=10
        )  # checkpoint at step 8, a recorded step
    run_growth(config, tmp_path / "killed", progress=False, plot=False)
    for name in ("metrics", "summary"):
        assert (tmp_path / "killed" / FILES[name]).read_bytes() == (tmp_path / "straight" / FILES[name]).read_bytes()
