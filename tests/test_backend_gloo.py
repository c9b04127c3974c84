"""Unmodified torch.distributed programs: simdist threads == simdist processes == real gloo, bit for bit.

The programs (tests/backend_programs.py) know nothing of simdist. The TP-MLP
check runs in the default suite (it is the one real-gloo check kept there);
DTensor and FSDP2 against real gloo are marked slow (``pytest --run-slow``).
"""

from __future__ import annotations

import pytest
import torch
from backend_programs import dtensor_2x2, fsdp2_steps, tp_mlp

import simdist
from simdist.world.launch import RankFailure, spawn_procs

pytestmark = pytest.mark.gloo

N = 4


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous()
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _assert_same(a: list[dict], b: list[dict], what: str) -> None:
    assert len(a) == len(b)
    for rank, (x, y) in enumerate(zip(a, b, strict=True)):
        assert x.keys() == y.keys()
        for key in x:
            assert x[key].dtype == y[key].dtype and x[key].shape == y[key].shape, (what, rank, key)
            assert torch.equal(_bits(x[key]), _bits(y[key])), f"{what}: rank {rank} {key} differs"


def test_tp_mlp_threads_processes_and_real_gloo_agree_bitwise():
    threads = simdist.spawn(tp_mlp, N)
    processes = spawn_procs(tp_mlp, N, backend="simdist")
    gloo = spawn_procs(tp_mlp, N, backend="gloo")
    _assert_same(threads, processes, "simdist process mode")
    _assert_same(threads, gloo, "real gloo")


def _mismatch(rank):
    import torch.distributed as dist

    t = torch.ones(2 + (rank == 1))
    dist.all_reduce(t)


@pytest.mark.slow
def test_process_mode_reports_a_mismatch_with_every_site():
    with pytest.raises(RankFailure, match=r"rank 1: all_reduce\(.*shape=\(3,\)"):
        spawn_procs(_mismatch, 2, backend="simdist", timeout_s=60)


@pytest.mark.slow
def test_dtensor_on_a_2x2_mesh_equals_real_gloo():
    _assert_same(simdist.spawn(dtensor_2x2, N), spawn_procs(dtensor_2x2, N, backend="gloo"), "DTensor vs gloo")


@pytest.mark.slow
def test_fsdp2_mixed_precision_three_steps_equal_real_gloo():
    _assert_same(simdist.spawn(fsdp2_steps, N), spawn_procs(fsdp2_steps, N, backend="gloo"), "FSDP2 vs gloo")
