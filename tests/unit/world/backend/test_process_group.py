"""The ``simdist`` torch.distributed backend on `simdist.run` (threads): coverage, bits, failures.

Bits are compared on raw integer views. The real-gloo and process-mode
comparisons live in tests/integration/test_backend_gloo.py.
"""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from backend_programs import data, dtensor_2x2, fsdp2_steps, tp_mlp

import simdist
from simdist.numerics.compare import same_bits
from simdist.reduce import Gloo, ReduceOp, Sequential, Tree
from simdist.world.errors import CollectiveDeadlockError, CollectiveMismatchError, SimTimeoutError
from simdist.world.spec import ParallelSpec

N = 4
XS = [data(r, (1024,)) for r in range(N)]


def _reductions(rank: int) -> dict:
    x = XS[rank]
    out = {}
    t = x.clone()
    dist.all_reduce(t)
    out["all_reduce"] = t
    t = x.clone()
    work = dist.all_reduce(t, op=dist.ReduceOp.AVG, async_op=True)
    work.wait()
    out["avg"] = t
    block = torch.empty(1024 // N)
    dist.reduce_scatter_tensor(block, x.clone())
    out["reduce_scatter_tensor"] = block
    out["funcol_all_reduce"] = funcol.all_reduce(x.clone(), "sum", dist.group.WORLD) + 0
    out["funcol_reduce_scatter"] = funcol.reduce_scatter_tensor(x.clone(), "sum", 0, dist.group.WORLD) + 0
    pair = [x.clone(), x[:37].clone()]
    dist.all_reduce_coalesced(pair)
    out["coalesced"] = pair
    t = x.clone()
    dist.reduce(t, dst=2)
    out["reduce"] = t
    group = dist.new_group([3, 1])  # torch sorts: group rank 0 is global rank 1
    if rank in (1, 3):
        t = x.clone()
        dist.all_reduce(t, group=group)
        out["pair"] = (dist.get_rank(group), dist.get_world_size(group), t)
    return out


def test_reductions_are_the_models_bits():
    res = simdist.run(_reductions, N)
    m = Gloo()
    full = m.reduce(XS)
    blocks = m.reduce_scatter(XS)
    for r in range(N):
        assert same_bits(res[r]["all_reduce"], full)
        assert same_bits(res[r]["funcol_all_reduce"], full)
        assert same_bits(res[r]["avg"], m.reduce(XS, ReduceOp.AVG))
        assert same_bits(res[r]["reduce_scatter_tensor"], blocks[r])
        assert same_bits(res[r]["funcol_reduce_scatter"], blocks[r])
        cat = m.reduce([torch.cat([x, x[:37]]) for x in XS])  # gloo coalesces into one all-reduce
        assert same_bits(res[r]["coalesced"][0], cat[:1024]) and same_bits(res[r]["coalesced"][1], cat[1024:])
    assert same_bits(res[2]["reduce"], m.reduce_to(XS, ReduceOp.SUM, 2) if hasattr(m, "reduce_to") else full)
    assert res[1]["pair"][:2] == (0, 2) and res[3]["pair"][:2] == (1, 2)
    assert same_bits(res[1]["pair"][2], m.reduce([XS[1], XS[3]]))


def test_model_per_group_kind_and_by_name():
    spec = ParallelSpec(4, tp=2, ep=1)

    def prog(rank):
        tp = dist.new_group([0, 1]), dist.new_group([2, 3])
        mine = tp[rank // 2]
        t, w = XS[rank].clone(), XS[rank].clone()
        dist.all_reduce(t, group=mine)
        dist.all_reduce(w)
        return t, w

    res = simdist.run(prog, spec, reduction={"tp": "sequential", "world": Tree()})
    assert same_bits(res[0][0], Sequential().reduce(XS[:2]))
    assert same_bits(res[3][1], Tree().reduce(XS))


def _movement(rank: int) -> dict:
    n = dist.get_world_size()
    out: dict = {"rank": dist.get_rank(), "world": n}
    lst = [torch.empty(3) for _ in range(n)]
    dist.all_gather(lst, torch.full((3,), float(rank)))
    out["all_gather"] = torch.stack(lst)
    flat = torch.empty(3 * n)
    dist.all_gather_into_tensor(flat, torch.full((3,), float(rank)))
    out["all_gather_into_tensor"] = flat
    b = torch.full((2,), float(rank))
    dist.broadcast(b, src=3)
    out["broadcast"] = b
    got = torch.empty(sum(range(1, n + 1)))
    dist.all_to_all_single(got, torch.full(((rank + 1) * n,), float(rank)), list(range(1, n + 1)), [rank + 1] * n)
    out["all_to_all_single"] = got
    outs = [torch.empty(2) for _ in range(n)]
    dist.all_to_all(outs, [torch.full((2,), 10.0 * rank + j) for j in range(n)])
    out["all_to_all"] = torch.stack(outs)
    scattered = torch.empty(2)
    dist.scatter(scattered, [torch.full((2,), float(i)) for i in range(n)] if rank == 0 else None, src=0)
    out["scatter"] = scattered
    gathered = [torch.empty(2) for _ in range(n)] if rank == 2 else None
    dist.gather(torch.full((2,), float(rank)), gathered, dst=2)
    out["gather"] = gathered
    objs = [None] * n
    dist.all_gather_object(objs, {"rank": rank})
    out["objects"] = objs
    box = [f"from {rank}"]
    dist.broadcast_object_list(box, src=1)
    out["broadcast_object"] = box[0]
    if rank == 0:
        dist.send(torch.arange(3.0), 1)
    elif rank == 1:
        r = torch.empty(3)
        dist.recv(r, 0)
        out["recv"] = r
    into = torch.empty(2)
    ops = [
        dist.P2POp(dist.isend, torch.full((2,), float(rank)), (rank + 1) % n),
        dist.P2POp(dist.irecv, into, (rank - 1) % n),
    ]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    out["ring"] = into
    sub, _ = dist.new_subgroups(2)
    t = torch.full((1,), float(rank))
    dist.all_reduce(t, group=sub)
    out["subgroup"] = (dist.get_rank(sub), t.item())
    parts = [torch.full((2,), float(rank * 10 + j)) for j in range(n)]
    mine = torch.empty(2)
    dist.reduce_scatter(mine, parts)
    out["reduce_scatter_list"] = mine
    i = torch.tensor([rank + 1, 6, 3], dtype=torch.int64)
    dist.all_reduce(i, op=dist.ReduceOp.BAND)
    out["band"] = i
    dist.barrier()
    return out


def test_data_movement_point_to_point_objects_and_subgroups():
    res = simdist.run(_movement, N)
    for r, out in enumerate(res):
        assert (out["rank"], out["world"]) == (r, N)
        assert out["all_gather"][:, 0].tolist() == [0.0, 1.0, 2.0, 3.0]
        assert out["all_gather_into_tensor"].tolist() == [float(j) for j in range(N) for _ in range(3)]
        assert out["broadcast"].tolist() == [3.0, 3.0]
        assert out["all_to_all_single"].tolist() == [float(j) for j in range(N) for _ in range(j + 1)]
        assert out["all_to_all"][:, 0].tolist() == [10.0 * j + r for j in range(N)]
        assert out["scatter"].tolist() == [float(r)] * 2
        assert out["objects"] == [{"rank": j} for j in range(N)]
        assert out["broadcast_object"] == "from 1"
        assert out["ring"].tolist() == [float((r - 1) % N)] * 2
        assert out["subgroup"] == (r % 2, float(sum(j for j in range(N) if j // 2 == r // 2)))
        assert out["reduce_scatter_list"].tolist() == [float(sum(j * 10 + r for j in range(N)))] * 2
        assert out["band"].tolist() == [0, 6 & 6 & 6 & 6, 3]
    assert [t.tolist() for t in res[2]["gather"]] == [[float(j)] * 2 for j in range(N)]
    assert res[1]["recv"].tolist() == [0.0, 1.0, 2.0]


def test_device_mesh_dtensor_and_fsdp2_run_in_threads():
    out = simdist.run(dtensor_2x2, N)
    assert out[0]["shard_float32"].shape == (16, 12)
    assert all(same_bits(o["partial_bfloat16"], out[0]["partial_bfloat16"]) for o in out)
    shards = simdist.run(fsdp2_steps, N, args=(1,))
    assert set(shards[0]) == {"0.weight", "0.bias", "2.weight", "2.bias"}


def test_unsupported_ops_raise_what_gloo_raises():
    def prog(rank):
        caught = []
        for op, t in ((dist.ReduceOp.BAND, torch.ones(2)), (dist._make_nccl_premul_sum(0.5), torch.ones(2))):
            try:
                dist.all_reduce(t, op=op)
            except RuntimeError as exc:
                caught.append(str(exc))
        return caught

    assert simdist.run(prog, 2)[0] == [
        "Cannot use ReduceOp.BAND with non-integral dtype",
        "Cannot use ReduceOp.PREMUL_SUM with Gloo",
    ]

    def premul(rank):
        t = torch.full((3,), float(rank + 1))
        dist.all_reduce(t, op=dist._make_nccl_premul_sum(0.5))
        return t

    assert simdist.run(premul, 2, reduction="sequential")[0].tolist() == [1.5] * 3


def _skips(rank):
    t = torch.ones(2)
    if rank != 3:
        dist.all_reduce(t)  # SKIPPED_BY_RANK_3
    dist.barrier()  # RANK_3_GOES_ON
    return t


def _skips_on_a_subgroup(rank):
    pair = dist.new_group([0, 1])
    if rank == 0:
        dist.all_reduce(torch.ones(2), group=pair)  # RANK_1_NEVER_COMES
    dist.barrier()  # RANK_1_WAITS_HERE


def _line(fn, marker: str) -> int:
    lines, first = inspect.getsourcelines(fn)
    return first + next(i for i, text in enumerate(lines) if marker in text)


# A hang is found by the rendezvous, not by a clock: it fails a run when a call cannot
# match (mismatch) or when every live rank waits (deadlock). The run is given a
# 2 s bound that the rendezvous enforces (SimTimeoutError); a hang detected only by
# that bound would fail these tests on the exception type. No time is measured.
HANG_BOUND_S = 2.0


def test_a_rank_that_skips_a_collective_fails_at_once_naming_both_sites():
    with pytest.raises(CollectiveMismatchError) as info:
        simdist.run(_skips, N, timeout_s=HANG_BOUND_S)
    message = str(info.value)
    assert f"world/backend/test_process_group.py:{_line(_skips, 'SKIPPED_BY_RANK_3')}" in message
    assert f"world/backend/test_process_group.py:{_line(_skips, 'RANK_3_GOES_ON')}" in message
    assert "rank 3: barrier" in message


def test_a_skip_on_a_subgroup_is_a_deadlock_naming_both_sites():
    with pytest.raises(CollectiveDeadlockError) as info:
        simdist.run(_skips_on_a_subgroup, N, timeout_s=HANG_BOUND_S)
    message = str(info.value)
    assert f"world/backend/test_process_group.py:{_line(_skips_on_a_subgroup, 'RANK_1_NEVER_COMES')}" in message
    assert f"world/backend/test_process_group.py:{_line(_skips_on_a_subgroup, 'RANK_1_WAITS_HERE')}" in message
    assert "rank 0: all_reduce" in message and "rank 1: barrier" in message


def test_a_rank_that_returns_while_peers_wait_is_a_deadlock():
    def prog(rank):
        if rank != 2:
            dist.all_reduce(torch.ones(2))

    with pytest.raises(CollectiveDeadlockError, match=r"rank\(s\) \[2\] returned while world\{0,1,2,3\} waits"):
        simdist.run(prog, N, timeout_s=HANG_BOUND_S)


def test_spawns_bound_is_enforced_for_a_rank_stuck_outside_collectives():
    import time

    def prog(rank):
        if rank == 1:
            time.sleep(0.6)  # not a collective: only the bound can report it
        dist.barrier()

    with pytest.raises(SimTimeoutError, match=r"did not finish within 0.2 s(.|\n)*rank 1"):
        simdist.run(prog, 2, timeout_s=0.2)


def test_receives_that_can_never_complete_are_a_deadlock():
    def prog(rank):
        t = torch.empty(1)
        dist.recv(t, 1 - rank)

    with pytest.raises(CollectiveDeadlockError, match="waiting for a message from rank"):
        simdist.run(prog, 2, timeout_s=30)


def test_an_exception_on_one_rank_stops_all_and_names_the_rank():
    def prog(rank):
        if rank == 2:
            raise ValueError("boom")
        dist.all_reduce(torch.ones(1))

    with pytest.raises(ValueError, match="boom") as info:
        simdist.run(prog, N, timeout_s=30)
    assert "raised on rank 2 of a simdist.run run" in info.value.__notes__


def test_the_tp_mlp_program_runs_and_the_world_is_restored():
    res = simdist.run(tp_mlp, N)
    assert all(same_bits(r["y1"], res[0]["y1"]) for r in res)
    assert not dist.is_initialized()
    import torch.distributed.distributed_c10d as c10d

    assert type(c10d._world) is c10d._World


def test_the_readme_example_runs():
    import pathlib
    import re

    readme = (pathlib.Path(__file__).parents[4] / "docs" / "howto" / "run-your-code.md").read_text()
    section = readme.split("## Run your own distributed code", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    namespace: dict = {}
    exec(compile(code, "docs/howto/run-your-code.md", "exec"), namespace)
    assert len(namespace["grads"]) == 4


def test_views_that_gloo_would_move_by_memory_are_refused_on_the_gloo_model_only():
    def prog(rank):
        base = torch.arange(12.0).view(3, 4) + 100 * rank
        dist.broadcast(base[:, 1:3], src=1)  # a view with gaps: gloo would overwrite other elements
        return base

    with pytest.raises(ValueError, match=r"broadcast on world.*memory order"):
        simdist.run(prog, 2)
    out = simdist.run(prog, 2, reduction="sequential")  # no transport to mimic: element-wise copy
    assert out[0][:, 1:3].tolist() == out[1][:, 1:3].tolist() and out[0][0, 0].item() == 0.0

    def transposed(rank):
        t = (torch.arange(6.0).view(2, 3) + 10 * rank).t()  # dense: every rank the same layout
        dist.broadcast(t, src=1)
        return t

    assert simdist.run(transposed, 2)[0].tolist() == (torch.arange(6.0).view(2, 3) + 10).t().tolist()


def _cached_then_mismatched(rank: int, change: str) -> None:
    t = torch.zeros(4)
    for _ in range(3):
        dist.all_reduce(t)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    dist.all_reduce(t.double())
    dist.all_reduce(torch.zeros(5))
    if rank != 1:
        dist.all_reduce(t)
    elif change == "shape":
        dist.all_reduce(torch.zeros(5))
    elif change == "dtype":
        dist.all_reduce(t.double())
    else:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)


@pytest.mark.parametrize("change", ["shape", "dtype", "op"])
def test_a_mismatch_after_cached_all_reduces_is_still_caught(change):
    """The backend's all_reduce caches its checks and signature per (op, shape, dtype) on each group
    (collectives.all_reduce_one): once matching calls have filled the cache, a rank calling with another shape,
    dtype or op must still be a mismatch naming the collective."""
    with pytest.raises(CollectiveMismatchError, match="collective #6 on world"):
        simdist.run(_cached_then_mismatched, N, args=(change,), timeout_s=HANG_BOUND_S)


def _works(rank: int) -> tuple:
    a, b = torch.full((4,), 1.0), torch.full((4,), 2.0)
    first = dist.all_reduce(a, async_op=True)
    second = dist.all_reduce(b, async_op=True)
    synchronous = dist.all_reduce(torch.zeros(4))
    third = dist.all_reduce(torch.zeros(4), async_op=True)
    fourth = dist.all_reduce(torch.zeros(4), async_op=True)
    barriers = dist.barrier(async_op=True), dist.barrier(), dist.barrier(async_op=True)
    return (
        first.wait() and first.result()[0] is a and first.get_future().wait()[0] is a,
        second.wait() and second.result()[0] is b,
        synchronous,
        third is not fourth,
        barriers[0] is not barriers[2] and barriers[1] is None and barriers[0].wait() and barriers[0].result() == [],
    )


def test_async_all_reduces_each_get_their_own_work():
    """The backend serves c10d's synchronous all_reduce and barrier from one finished Work per group (it is
    waited on and dropped); an async one's Work must still be its own, an all_reduce's holding its own tensor."""
    assert simdist.run(_works, 2) == [(True, True, None, True, True)] * 2


def test_a_thread_deadline_names_the_ranks_own_line_and_where_it_waits():
    """A rank stuck in library code (here ``threading.Event.wait``) is reported at its own line, with the frame
    it waits in beside it; the innermost frame alone would name only threading.py."""
    import threading

    stuck = threading.Event()

    def prog(rank):
        if rank == 1:
            stuck.wait(0.6)  # the rank's own line
        dist.barrier()

    with pytest.raises(SimTimeoutError) as caught:
        simdist.run(prog, 2, timeout_s=0.2)
    line = next(text for text in str(caught.value).splitlines() if text.strip().startswith("rank 1:"))
    assert "world/backend/test_process_group.py:" in line, line
    assert "in prog, waiting in " in line and "threading.py:" in line, line
