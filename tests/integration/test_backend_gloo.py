"""Unmodified torch.distributed programs: simdist threads == real gloo processes, bit for bit.

The programs (tests/backend_programs.py) know nothing of simdist. ONE spawn of
4 real gloo processes runs all of them (`suite`: the TP-MLP, DTensor on a 2x2
mesh, FSDP2 mixed precision, the coverage program with every op) and ONE
`simdist.run` runs the same on threads; each test compares one program's
results. Process start-up dominates a real-gloo run, so sharing it keeps these
checks in the default suite. Process mode (the simdist backend in real
processes) runs the TP-MLP by default and the whole suite when slow tests run.
"""

from __future__ import annotations

import pytest
import torch
from backend_programs import suite, tp_mlp

import simdist
from simdist.numerics.floats import bits
from simdist.world.processes.supervise import RankFailure

pytestmark = pytest.mark.gloo

N = 4


def _leaves(value) -> list:
    if isinstance(value, (list, tuple)):
        return [leaf for item in value for leaf in _leaves(item)]
    return [value]


def _assert_same(a: list[dict], b: list[dict], what: str) -> None:
    """Per rank: the same keys; tensors with the same dtype, shape and bits; other values (error types) equal."""
    assert len(a) == len(b) == N
    for rank, (x, y) in enumerate(zip(a, b, strict=True)):
        assert x.keys() == y.keys(), (what, rank, set(x) ^ set(y))
        for key in x:
            left, right = _leaves(x[key]), _leaves(y[key])
            assert len(left) == len(right), (what, rank, key)
            for p, q in zip(left, right, strict=True):
                kinds = [v if isinstance(v, str) else type(v).__name__ for v in (p, q)]
                assert isinstance(p, torch.Tensor) == isinstance(q, torch.Tensor), f"{what}: rank {rank} {key}: {kinds}"
                if isinstance(p, torch.Tensor):
                    assert p.dtype == q.dtype and p.shape == q.shape, (what, rank, key, p, q)
                    assert torch.equal(bits(p), bits(q)), f"{what}: rank {rank} {key} differs"
                else:
                    assert p == q, f"{what}: rank {rank} {key}: {p!r} != {q!r}"


@pytest.fixture(scope="module")
def real_gloo() -> list[dict]:
    return simdist.run(suite, N, where="gloo", timeout_s=300)


@pytest.fixture(scope="module")
def threads() -> list[dict]:
    return simdist.run(suite, N, timeout_s=300)


def _program(results: list[dict], name: str) -> list[dict]:
    return [r[name] for r in results]


def test_tp_mlp_threads_processes_and_real_gloo_agree_bitwise(real_gloo, threads):
    processes = simdist.run(tp_mlp, N, where="processes")
    _assert_same(_program(threads, "tp_mlp"), processes, "simdist process mode")
    _assert_same(_program(threads, "tp_mlp"), _program(real_gloo, "tp_mlp"), "real gloo")


def test_dtensor_partial_and_shard_to_replicate_on_a_2x2_mesh_equal_real_gloo(real_gloo, threads):
    _assert_same(_program(threads, "dtensor"), _program(real_gloo, "dtensor"), "DTensor vs gloo")


def test_fsdp2_mixed_precision_three_steps_equal_real_gloo(real_gloo, threads):
    _assert_same(_program(threads, "fsdp2"), _program(real_gloo, "fsdp2"), "FSDP2 vs gloo")


def test_every_op_and_every_refusal_equal_real_gloo(real_gloo, threads):
    gloo, mine = _program(real_gloo, "coverage"), _program(threads, "coverage")
    refused = {k: v for k, v in gloo[0].items() if isinstance(v, str) and v.startswith("raises")}
    assert "all_reduce torch.float32 PREMUL_SUM" in refused and "all_reduce torch.float32 SUM" not in refused
    _assert_same(mine, gloo, "coverage vs gloo")


def test_seed_per_rank_same_seed_init_settings_and_broadcast_equal_real_gloo(real_gloo, threads):
    """Rank threads behave like processes (test_isolation.py runs these again for identical reruns)."""
    for name in ("seed_per_rank", "same_seed_init", "settings", "broadcast_params"):
        program = f"isolation_{name}"
        _assert_same(_program(threads, program), _program(real_gloo, program), f"{name} vs gloo")


@pytest.mark.slow
def test_process_mode_runs_every_program_with_the_threads_bits(threads):
    processes = simdist.run(suite, N, where="processes", timeout_s=300)
    for name in threads[0]:
        _assert_same(_program(processes, name), _program(threads, name), f"{name}: process mode vs threads")


def _mismatch(rank):
    import torch.distributed as dist

    t = torch.ones(2 + (rank == 1))
    dist.all_reduce(t)


@pytest.mark.slow
def test_process_mode_reports_a_mismatch_with_every_site():
    with pytest.raises(RankFailure, match=r"rank 1: all_reduce\(.*shape=\(3,\)"):
        simdist.run(_mismatch, 2, where="processes", timeout_s=60)
