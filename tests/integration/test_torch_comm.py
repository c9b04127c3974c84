"""`TorchComm` and ``simdist.run(api="comm", where="gloo")`` on 4 real gloo processes (TP2/EP2 on 4 ranks).

Each rank program runs every collective once and returns what it saw; the
parent checks the values against what the group tables of the spec predict:

    tp  {0,1} {2,3}    dp  {0,2} {1,3}    ep  {0,1} {2,3}    edp {0,2} {1,3}
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

import simdist
from simdist.reduce import ReduceOp
from simdist.world.groups import Comm, Group
from simdist.world.processes.supervise import RankFailure
from simdist.world.spec import ParallelSpec

pytestmark = pytest.mark.gloo

SPEC = ParallelSpec(4, tp=2, ep=2)


def _value(rank: int) -> torch.Tensor:
    return torch.tensor([rank + 1.0, 2.0**rank, -float(rank)])


def collectives_rank(comm) -> dict:
    """Every collective of the `Comm` protocol once; returns the results keyed by name."""
    rank = comm.get_rank()
    out: dict = {"is_comm": isinstance(comm, Comm), "rank": rank, "world": comm.get_world_size()}
    for kind in ("tp", "dp", "ep", "edp", "etp", "world"):
        group = comm.group(kind)
        out[f"group_{kind}"] = group.ranks
        t = _value(rank)
        comm.all_reduce(t, group=group)
        out[f"sum_{kind}"] = t
    for op in ("avg", ReduceOp.MAX, dist.ReduceOp.MIN):
        t = _value(rank)
        comm.all_reduce(t, op, group=comm.group("dp"))
        out[f"{ReduceOp.coerce(op).value}_dp"] = t
    half = torch.tensor([1.0, 3.0], dtype=torch.bfloat16) * (rank + 1)
    comm.all_reduce(half, ReduceOp.AVG, group=comm.group("tp"))
    out["avg_tp_bf16"] = half

    scatter_in = torch.arange(4.0) * (rank + 1)
    block = torch.empty(2)
    comm.reduce_scatter_tensor(block, scatter_in, group=comm.group("dp"))
    out["reduce_scatter_dp"] = block
    block = torch.empty(1)
    comm.reduce_scatter_tensor(block, scatter_in, ReduceOp.MAX)
    out["reduce_scatter_max_world"] = block
    block = torch.empty(1)
    comm.reduce_scatter_tensor(block, scatter_in, ReduceOp.AVG)
    out["reduce_scatter_avg_world"] = block

    gathered = torch.empty(4)
    comm.all_gather_into_tensor(gathered, torch.tensor([rank, 10.0 * rank]), group=comm.group("tp"))
    out["all_gather_tp"] = gathered

    send_sizes = [(rank + dst) % 3 + 1 for dst in range(4)]  # uneven: 1..3 elements per peer
    recv_sizes = [(src + rank) % 3 + 1 for src in range(4)]
    send = torch.cat([torch.full((k,), 100.0 * rank + dst) for dst, k in enumerate(send_sizes)])
    recv = torch.empty(sum(recv_sizes))
    comm.all_to_all_single(recv, send, recv_sizes, send_sizes)
    out["all_to_all"] = recv

    dp = comm.group("dp")
    src = dp.ranks[1]  # a non-zero global rank
    t = torch.full((3,), float(rank))
    comm.broadcast(t, src, group=dp)
    out["broadcast_dp"] = t
    comm.barrier(group=comm.group("tp"))
    comm.barrier()
    try:
        comm.all_reduce(torch.zeros(1), group=Group("tp", (9, 10)))
    except ValueError as err:
        out["bad_group"] = str(err)
    return out


def failing_rank(comm) -> None:
    if comm.get_rank() == 2:
        raise RuntimeError("deliberate failure on rank 2")
    comm.barrier()  # the others wait here until they are killed


def hanging_rank(comm) -> None:
    if comm.get_rank() == 1:
        time.sleep(60)
    comm.barrier()


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return simdist.run(collectives_rank, SPEC, api="comm", where="gloo", timeout_s=120)


def _sum(ranks) -> torch.Tensor:
    return sum((_value(r) for r in ranks), torch.zeros(3))


def test_topology(results):
    for rank, res in enumerate(results):
        assert res["is_comm"] and res["rank"] == rank and res["world"] == 4
        assert res["group_tp"] == SPEC.group_of("tp", rank)
        assert res["group_edp"] == SPEC.group_of("edp", rank)
        assert "not a member" in res["bad_group"]


@pytest.mark.parametrize("kind", ["tp", "dp", "ep", "edp", "etp", "world"])
def test_all_reduce_sum_per_group(results, kind):
    for rank, res in enumerate(results):
        ranks = range(4) if kind == "world" else SPEC.group_of(kind, rank)
        assert torch.equal(res[f"sum_{kind}"], _sum(ranks)), (kind, rank)


def test_all_reduce_avg_max_min(results):
    for rank, res in enumerate(results):
        stacked = torch.stack([_value(r) for r in SPEC.group_of("dp", rank)])
        assert torch.equal(res["avg_dp"], stacked.sum(0) / 2)
        assert torch.equal(res["max_dp"], stacked.amax(0))
        assert torch.equal(res["min_dp"], stacked.amin(0))
        assert res["avg_tp_bf16"].dtype == torch.bfloat16
        tp = SPEC.group_of("tp", rank)
        assert res["avg_tp_bf16"].tolist() == [sum(r + 1 for r in tp) / 2, 3.0 * sum(r + 1 for r in tp) / 2]


def test_reduce_scatter(results):
    for rank, res in enumerate(results):
        dp = SPEC.group_of("dp", rank)
        full = sum(torch.arange(4.0) * (r + 1) for r in dp)
        assert torch.equal(res["reduce_scatter_dp"], full.chunk(2)[dp.index(rank)])
        assert res["reduce_scatter_max_world"].item() == rank * 4
        assert res["reduce_scatter_avg_world"].item() == rank * 10 / 4


def test_all_gather(results):
    for rank, res in enumerate(results):
        tp = SPEC.group_of("tp", rank)
        assert res["all_gather_tp"].tolist() == [float(v) for r in tp for v in (r, 10 * r)]


def test_all_to_all_uneven(results):
    for rank, res in enumerate(results):
        expected = [100.0 * src + rank for src in range(4) for _ in range((src + rank) % 3 + 1)]
        assert res["all_to_all"].tolist() == expected


def test_broadcast_from_nonzero_global_rank(results):
    for rank, res in enumerate(results):
        src = SPEC.group_of("dp", rank)[1]
        assert res["broadcast_dp"].tolist() == [float(src)] * 3


def test_failing_rank_is_reraised_naming_the_rank():
    with pytest.raises(RankFailure, match=r"rank 2 of 4 failed") as info:
        simdist.run(failing_rank, SPEC, api="comm", where="gloo", timeout_s=60)
    assert info.value.rank == 2
    assert "deliberate failure on rank 2" in info.value.remote_traceback


@pytest.mark.slow  # seconds of the default suite; CI runs it with the slow tests
def test_hanging_rank_times_out_instead_of_hanging():
    """The launch's own timeout ends a hung world with TimeoutError (a hang would instead hit pytest-timeout)."""
    with pytest.raises(TimeoutError, match=r"did not finish"):
        simdist.run(
            hanging_rank, SPEC, api="comm", where="gloo", timeout_s=1
        )  # the test waits this long: keep it short
