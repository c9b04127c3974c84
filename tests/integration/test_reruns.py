"""Reruns are identical: the same command gives the same bits every time, on rank threads and in processes.

simdist promises "the same bits as the real run"; a result that changes from one run to the next cannot keep
that promise, and a rerun that differs is the cheapest symptom of shared state between rank threads (torch's
global RNG, DTensor caches) or of an order that depends on thread scheduling. Each check fingerprints every
tensor of a run (dtype, shape and raw bytes, NaN payloads included) and every other value it returns, and
compares the fingerprints of several reruns in one process (on rank threads: `SimWorld` and `simdist.run`
run their ranks as threads). 20 reruns and the process world are slow tests.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import warnings
from contextlib import redirect_stdout

import pytest
import torch

from simdist.cases import case_names, run_case
from simdist.cases.fsdp2 import reduce_dtype as fsdp2_reduce_dtype
from simdist.cases.fsdp2 import tp_mesh as fsdp2_tp_mesh
from simdist.cli import main as cli_main
from simdist.gradpath.matched_policy import MATCHED_FP32
from simdist.gradpath.path import PathConfig
from simdist.policies.catalogue import get_policy
from simdist.reduce import make_reduction
from simdist.studies.growth.run import GrowthConfig, run_growth
from simdist.studies.repro import ReproConfig, run

THREAD_CASES = ("fsdp2-reduce-dtype-tp",)
"""The cases whose framework allows rank threads (`simdist case run NAME --where threads`)."""


def fingerprint(obj: object, h: hashlib._Hash | None = None) -> str:
    """sha256 over a fixed walk of ``obj``: each tensor's dtype, shape and raw bytes; dataclass fields, dict
    items (sorted by key), sequence items; the ``repr`` of every other value (floats in full precision)."""
    top = h is None
    h = h if h is not None else hashlib.sha256()
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        h.update(f"tensor {t.dtype} {tuple(t.shape)}:".encode())
        h.update(t.view(torch.uint8).numpy().tobytes())
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        h.update(f"{type(obj).__name__}(".encode())
        for f in dataclasses.fields(obj):
            h.update(f"{f.name}=".encode())
            fingerprint(getattr(obj, f.name), h)
    elif isinstance(obj, dict):
        h.update(f"dict {len(obj)}:".encode())
        for key in sorted(obj, key=repr):
            h.update(repr(key).encode())
            fingerprint(obj[key], h)
    elif isinstance(obj, list | tuple):
        h.update(f"seq {len(obj)}:".encode())
        for item in obj:
            fingerprint(item, h)
    else:
        h.update(f"{type(obj).__name__} {obj!r};".encode())
    return h.hexdigest() if top else ""


def test_the_fingerprint_sees_every_bit():
    """A NaN payload, a signed zero, a dtype, a dict value, a float's last bit: each changes the fingerprint."""
    base = {"a": torch.tensor([0.0, float("nan")]), "b": [1.0, (2, "x")]}
    assert fingerprint(base) == fingerprint({"b": [1.0, (2, "x")], "a": torch.tensor([0.0, float("nan")])})
    payload = torch.tensor([0.0, float("nan")])
    payload.view(torch.int32)[1] |= 1
    variants = [
        {"a": torch.tensor([-0.0, float("nan")]), "b": [1.0, (2, "x")]},
        {"a": payload, "b": [1.0, (2, "x")]},
        {"a": torch.tensor([0.0, float("nan")], dtype=torch.float64), "b": [1.0, (2, "x")]},
        {"a": torch.tensor([0.0, float("nan")]), "b": [1.0 + 2**-52, (2, "x")]},
        {"a": torch.tensor([0.0, float("nan")]), "b": [1.0, (2, "y")]},
    ]
    assert len({fingerprint(v) for v in [base, *variants]}) == len(variants) + 1


def _repro_fingerprint(gas: int) -> str:
    """Everything ``simdist repro 8913 [--gas 2]`` computes: the JSON it prints, and every captured tensor of
    every rank of the matched policy and of each policy."""
    argv = ["repro", "8913", "--json", "--no-progress"] + (["--gas", str(gas)] if gas != 1 else [])
    out = io.StringIO()
    with redirect_stdout(out):
        assert cli_main(argv) == 0
    config = ReproConfig(gas=gas)
    path = PathConfig(steps=config.steps, gas=gas, seed=config.seed, marker=config.marker)
    matched_path = PathConfig(steps=config.steps, gas=gas, seed=config.seed, marker="per_micro_step")
    reduction = make_reduction(config.reduction)
    traces = {"matched": run(config.spec, MATCHED_FP32, matched_path, reduction)}
    for name in config.policies:
        traces[name] = run(config.spec, get_policy(name), path, reduction)
    return fingerprint([out.getvalue(), traces])


@pytest.mark.parametrize("gas", [1, pytest.param(2, marks=pytest.mark.slow)])  # GAS 2 by default: test_cli.py
def test_repro_8913_reruns_are_bit_identical(gas):
    """``simdist repro 8913`` (and ``--gas 2``): three runs in one process, one fingerprint."""
    prints = {_repro_fingerprint(gas) for _ in range(3)}
    assert len(prints) == 1


def _growth_csv(tmp_path, tag: str, config: GrowthConfig) -> bytes:
    out = tmp_path / tag
    run_growth(config, out, progress=False, plot=False)
    return (out / "metrics.csv").read_bytes()


def test_growth_csv_reruns_are_byte_identical(tmp_path):
    """The growth figure's data (``metrics.csv``): three fresh runs, the same bytes."""
    config = GrowthConfig(steps=8, seeds=2)
    first = _growth_csv(tmp_path, "0", config)
    assert first.count(b"\n") > 8
    assert all(_growth_csv(tmp_path, str(i), config) == first for i in (1, 2))


def _tp_case_fingerprint() -> str:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        real = fsdp2_tp_mesh.run_real(fsdp2_tp_mesh.Config(), "threads")
    return fingerprint([real, fsdp2_tp_mesh.judge(fsdp2_tp_mesh.Config(), real)])


def test_only_the_listed_cases_allow_the_threads_world():
    """Every case not in THREAD_CASES refuses ``--where threads`` before running anything."""
    for name in case_names():
        if name in THREAD_CASES:
            continue
        with pytest.raises(ValueError, match="thread"):
            run_case(name, where="threads")


@pytest.mark.slow
def test_repro_and_growth_20_reruns_are_identical(tmp_path):
    """The issue's bar: 20 reruns of each ``repro`` and of the growth CSV, bit for bit."""
    for gas in (1, 2):
        assert len({_repro_fingerprint(gas) for _ in range(20)}) == 1, gas
    config = GrowthConfig(steps=8, seeds=2)
    first = _growth_csv(tmp_path, "0", config)
    assert all(_growth_csv(tmp_path, str(i), config) == first for i in range(1, 20))


@pytest.mark.slow
def test_threads_case_20_reruns_are_identical():
    """``simdist case run fsdp2-reduce-dtype-tp --where threads``: every recorded arrival and gradient of every
    rank and the verdict, 20 runs (before rank threads had their own RNG, about 1 run in 6 differed). Slow: the
    default suite reruns repro and growth; tests/integration/test_isolation.py reruns the RNG idioms themselves."""
    assert len({_tp_case_fingerprint() for _ in range(20)}) == 1


@pytest.mark.slow
@pytest.mark.gloo
def test_process_world_case_reruns_are_bit_identical():
    """``simdist case run fsdp2-reduce-dtype --where processes`` (process mode) three times: the same bits."""
    config = fsdp2_reduce_dtype.Config()
    prints = set()
    for _ in range(3):
        real = fsdp2_reduce_dtype.run_real(config, "processes")
        prints.add(fingerprint([real, fsdp2_reduce_dtype.judge(config, real, where="processes")]))
    assert len(prints) == 1
