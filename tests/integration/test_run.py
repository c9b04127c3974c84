"""`simdist.run`, the one launcher: the same bits in every ``where`` and as `SimWorld.run`, one default reduction
(gloo's order, not the rank-order fold), ``fn``'s arguments apart from the launcher's, and one-line errors.

The data make the orders tell apart: float32 values of mixed magnitude on 4 ranks, whose rank-order fold, ring
and gloo sums differ (checked here, so a launcher that dropped ``reduction=`` cannot pass). The reference for
the rank-order fold is a left fold written in this file.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

import simdist
from simdist.errors import UsageError
from simdist.reduce import Gloo, ReductionName, Ring, Sequential
from simdist.world.options import DEFAULT_REDUCTION, DEFAULT_TIMEOUT_S, Api, Where
from simdist.world.processes.supervise import RankFailure
from simdist.world.simworld import SimWorld
from simdist.world.spec import GROUP_KINDS, GroupKind, ParallelSpec

N = 4
SPEC = ParallelSpec(N, tp=2, ep=2)


def values(rank: int, numel: int = 64) -> torch.Tensor:
    g = torch.Generator().manual_seed(1234 + rank)
    scale = torch.tensor([10.0 ** (k % 9 - 4) for k in range(numel)])
    return (torch.randn(numel, generator=g) * scale).float()


def dist_sum(rank: int, numel: int, *, scale: float = 1.0) -> torch.Tensor:
    t = values(rank, numel) * scale
    dist.all_reduce(t)
    return t


def summed_on(rank: int, numel: int) -> tuple[str, torch.Tensor]:
    return dist.get_backend(), dist_sum(rank, numel)


def comm_sums(comm, numel: int, *, scale: float = 1.0) -> list[torch.Tensor]:
    out = []
    for kind in (None, "tp", GroupKind.DP):
        t = values(comm.get_rank(), numel) * scale
        comm.all_reduce(t, group=None if kind is None else comm.group(kind))
        out.append(t)
    return out


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def same_bits(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(bits(a), bits(b))
    return len(a) == len(b) and all(same_bits(x, y) for x, y in zip(a, b, strict=True))


def left_fold(numel: int, ranks=range(N), scale: float = 1.0) -> torch.Tensor:
    acc = values(ranks[0], numel) * scale
    for r in ranks[1:]:
        acc = acc + values(r, numel) * scale
    return acc


def test_the_data_tell_the_orders_apart():
    """Guards the rest: on these values the rank-order fold, ring and gloo give different bits."""
    seq = simdist.run(dist_sum, N, args=(64,), reduction="sequential")[0]
    ring = simdist.run(dist_sum, N, args=(64,), reduction="ring")[0]
    gloo = simdist.run(dist_sum, N, args=(64,))[0]
    assert not same_bits(seq, gloo) and not same_bits(seq, ring) and not same_bits(ring, gloo)
    assert same_bits(seq, left_fold(64))  # the fold written above, not simdist's


def test_threads_dist_with_args_kwargs_and_every_reduction_spelling():
    ran = simdist.run(dist_sum, N, args=(64,), kwargs={"scale": 0.5})
    assert len(ran) == N
    assert same_bits(ran, [Gloo().reduce([values(r) * 0.5 for r in range(N)])] * N)  # default: gloo's order
    ring = [simdist.run(dist_sum, N, args=[64], reduction=choice) for choice in ("ring", ReductionName.RING, Ring())]
    assert all(same_bits(r, simdist.run(dist_sum, N, args=(64,), reduction="ring")) for r in ring)
    seq = simdist.run(dist_sum, SPEC, args=(64,), reduction={"world": "sequential", "default": "gloo"})
    assert same_bits(seq, [left_fold(64)] * N)


def test_threads_comm_is_simworld_bit_for_bit_and_simworld_now_defaults_to_gloo():
    ran = simdist.run(comm_sums, SPEC, api="comm", args=(64,), kwargs={"scale": 2.0})
    assert same_bits(ran, SimWorld(SPEC, reduction=Gloo()).run(comm_sums, 64, scale=2.0))
    assert same_bits(ran, SimWorld(SPEC).run(comm_sums, 64, scale=2.0))  # one default everywhere
    seq = simdist.run(comm_sums, SPEC, api="comm", args=(64,), kwargs={"scale": 2.0}, reduction="sequential")
    assert same_bits(seq, SimWorld(SPEC, reduction=Sequential()).run(comm_sums, 64, scale=2.0))
    assert same_bits([r[0] for r in seq], [left_fold(64, scale=2.0)] * N)
    tp4 = ParallelSpec(N, tp=N)  # a tp group of 4 members: its order shows (a 2-member sum has only one)
    mixed = simdist.run(comm_sums, tp4, api="comm", args=(64,), reduction={"tp": "sequential", "default": "ring"})
    world = SimWorld(tp4, reduction={"tp": Sequential(), "default": Ring()})
    assert same_bits(mixed, world.run(comm_sums, 64))
    assert same_bits([r[1] for r in mixed], [left_fold(64)] * N)  # tp: the fold
    assert same_bits([r[0] for r in mixed], simdist.run(dist_sum, N, args=(64,), reduction="ring"))  # world: ring
    flat = simdist.run(comm_sums, N, api="comm", args=(8,))  # a size is a flat spec: tp = dp = ... = 1
    assert flat[0][1].equal(values(0, 8)) and flat[0][2].equal(flat[0][0])


def test_one_default_reduction_and_timeout_across_the_launchers():
    import inspect

    assert DEFAULT_REDUCTION == "gloo" and DEFAULT_TIMEOUT_S == 300.0
    assert SimWorld(SPEC).timeout_s == DEFAULT_TIMEOUT_S
    assert isinstance(SimWorld(SPEC).default_reduction, Gloo)
    assert inspect.signature(simdist.run).parameters["timeout_s"].default == DEFAULT_TIMEOUT_S


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"where": "thread"}, ValueError, r"unknown where 'thread'; valid: threads, processes, gloo"),
        ({"api": "torch"}, ValueError, r"unknown api 'torch'; valid: dist, comm"),
        ({"reduction": "rign"}, ValueError, r"unknown reduction 'rign'; valid: sequential"),
        ({"reduction": 3}, TypeError, r"reduction must be a reduction name"),
        ({"reduction": "ring", "where": "gloo"}, ValueError, r"real gloo sums in its own order"),
        ({"reduction": {"tp": "ring"}, "where": "processes"}, TypeError, r"per-kind tables and callables need"),
        ({"reduction": {"tpp": "ring"}, "api": "comm"}, ValueError, r"unknown group kind 'tpp'"),
        ({"timeout_s": 0}, ValueError, r"timeout_s must be a positive, finite number of seconds, got 0"),
        ({"timeout_s": -1.0}, ValueError, r"positive, finite"),
        ({"timeout_s": math.nan}, ValueError, r"positive, finite"),
        ({"timeout_s": math.inf, "where": "processes"}, ValueError, r"positive, finite"),
        ({"timeout_s": "60"}, TypeError, r"timeout_s must be a number of seconds or None, got str '60'"),
        ({"timeout_s": True}, TypeError, r"got bool"),
        ({"timeout_s": None, "where": "gloo"}, ValueError, r"timeout_s=None \(no deadline\) is for threads only"),
        ({"args": "abc"}, TypeError, r"args must be a tuple or list of fn's positional arguments, got str"),
        ({"args": {"numel": 4}}, TypeError, r"args must be a tuple or list"),
        ({"kwargs": [("scale", 1.0)]}, TypeError, r"kwargs must be a mapping of fn's keyword arguments, got list"),
        ({"preload": ("json",)}, ValueError, r"preload= and timings= are for process launches"),
    ],
)
def test_bad_launch_arguments_are_one_line_errors_before_any_rank_starts(kwargs, error, match):
    def never(*_a, **_k):  # a local function: a process launch could not even pickle it
        raise AssertionError("a rank started")

    with pytest.raises(error, match=match):
        simdist.run(never, N, **kwargs)


@pytest.mark.parametrize(
    ("world", "error", "match"),
    [(0, ValueError, "at least 1 rank"), (2.0, TypeError, "got float 2.0"), (True, TypeError, "got bool")],
)
def test_a_bad_world_is_an_error(world, error, match):
    with pytest.raises(error, match=match):
        simdist.run(dist_sum, world, args=(4,))


def test_reduction_is_the_one_spelling_the_removed_ones_are_unknown_keywords(monkeypatch):
    from simdist.world.processes.transport import process_reduction

    with pytest.raises(TypeError, match="unexpected keyword argument 'default_model'"):
        SimWorld(SPEC, default_model=Ring())
    with pytest.raises(TypeError, match="unexpected keyword argument 'models'"):
        SimWorld(SPEC, models={"tp": Ring()})
    with pytest.raises(TypeError):  # reduction is keyword-only: a positional table is not read as one
        SimWorld(SPEC, {"tp": Ring()})
    with pytest.raises(TypeError, match="unexpected keyword argument 'model'"):
        simdist.run(dist_sum, N, where="processes", args=(4,), model="ring")
    with pytest.raises(TypeError, match="unexpected keyword argument 'model'"):
        simdist.run(dist_sum, N, args=(4,), model="ring")
    with pytest.raises(TypeError, match=r"dist_sum\(\) got an unexpected keyword argument 'model'"):  # fn's keyword
        simdist.run(dist_sum, N, args=(4,), kwargs={"model": "ring"})
    monkeypatch.setenv("SIMDIST_MODEL", "ring")
    with pytest.raises(UsageError, match="SIMDIST_MODEL was renamed SIMDIST_REDUCTION"):
        process_reduction()
    with pytest.raises(TypeError, match=r"reduction must be a reduction name"):
        SimWorld(SPEC, reduction=lambda ranks: Ring())


def test_group_kinds_are_a_str_enum_that_equals_the_strings():
    assert [str(k) for k in GROUP_KINDS] == ["tp", "dp", "ep", "etp", "edp", "pp"]
    assert GroupKind.TP == "tp" and hash(GroupKind.EDP) == hash("edp") and f"{GroupKind.WORLD}" == "world"
    assert SPEC.groups(GroupKind.EDP) == SPEC.groups("edp")
    groups = simdist.run(lambda comm: (comm.group("tp"), comm.group(GroupKind.TP)), SPEC, api="comm")
    assert all(a == b and str(a) == str(b) for a, b in groups)


def test_the_package_exports_its_public_names():
    assert set(simdist.__all__) >= {"run", "SimWorld", "ParallelSpec", "GroupKind", "ReductionName", "blame"}
    assert sorted(simdist.__all__) == sorted(["DISTRIBUTION", *simdist._LAZY])
    for name in simdist.__all__:
        assert getattr(simdist, name) is not None
    assert simdist.run.__module__ == "simdist.world.runner" and simdist.Where is Where and simdist.Api is Api
    with pytest.raises(AttributeError, match="no attribute 'spawn'"):  # the one launcher is simdist.run
        simdist.spawn  # noqa: B018 (retired)


# -- processes: one launch costs seconds (torch in a forkserver), so these are slow ---------------------------


@pytest.mark.slow
@pytest.mark.gloo
def test_processes_and_gloo_match_threads_bit_for_bit_and_report_timings():
    timings: list = []
    processes = simdist.run(dist_sum, N, where="processes", args=(64,), kwargs={"scale": 0.5}, timings=timings)
    assert same_bits(
        processes, simdist.run(dist_sum, N, args=(64,), kwargs={"scale": 0.5})
    )  # process mode = threads, bitwise
    assert same_bits(processes, [Gloo().reduce([values(r) * 0.5 for r in range(N)])] * N)
    ring = simdist.run(dist_sum, N, where="processes", args=(64,), reduction=Ring(), preload=("json",))
    named = simdist.run(dist_sum, N, where="processes", args=(64,), reduction="ring")
    assert same_bits(ring, named)
    assert same_bits(ring, simdist.run(dist_sum, N, args=(64,), reduction="ring"))
    real = simdist.run(summed_on, N, where="gloo", args=(64,))
    assert {name for name, _ in real} == {"gloo"}  # real gloo, not the gloo reduction (which gives the same bits)
    assert same_bits([t for _, t in real], simdist.run(dist_sum, N, where="gloo", args=(64,)))
    assert {name for name, _ in simdist.run(summed_on, 2, where="processes", args=(4,))} == {"simdist"}
    comm = simdist.run(comm_sums, SPEC, api="comm", where="processes", args=(64,), timings=timings)
    assert same_bits(comm, simdist.run(comm_sums, SPEC, api="comm", where="processes", args=(64,)))
    assert same_bits(comm, simdist.run(comm_sums, SPEC, api="comm", args=(64,)))
    assert len(timings) == 2 and all(t.world_size == N and t.total > 0 for t in timings)
    assert all(min(t.server, t.start, t.imports, t.rendezvous, t.work, t.finish) >= 0 for t in timings)


def preload_probe(rank: int) -> tuple[bool, bool, bool]:
    """(the probe was imported by another process, the forkserver froze, this rank's gc has frozen objects)."""
    import gc
    import os

    import launch_probe

    from simdist.world.processes import forkserver_freeze

    return os.getpid() != launch_probe.IMPORTED_IN, forkserver_freeze.FROZE, gc.get_freeze_count() > 0


@pytest.mark.slow
@pytest.mark.gloo
def test_preloaded_modules_are_imported_once_in_the_forkserver_which_freezes_its_objects(monkeypatch):
    """The start-up cut of issue 22 item 5, checked by where imports happen (never by a clock). Python 3.11's
    forkserver imports its preload list on the environment's path (PYTHONPATH), not on this process's
    ``sys.path``: the probe's folder goes there (the server restarts for the new module and inherits it)."""
    import os
    from pathlib import Path

    here = str(Path(__file__).resolve().parent)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")])))
    results = simdist.run(preload_probe, 2, where="gloo", preload=("launch_probe",))
    assert results == [(True, True, True)] * 2


def _locks_then_hangs(rank: int, lock: str, marker: str) -> None:
    """What torch's C++-extension build does while it compiles (DeepSpeed's CPU ops build on first use): the
    lock file first (FileBaton), then a child process (ninja) that the deadline interrupts."""
    if rank == 1:
        import os
        import subprocess
        import sys

        os.makedirs(os.path.dirname(lock), exist_ok=True)
        os.close(os.open(lock, os.O_CREAT | os.O_EXCL))
        subprocess.run([sys.executable, "-c", "import time; time.sleep(60)", marker], check=False)
    dist.barrier()


def _processes_with(marker: str) -> list[str]:
    """The pids of the processes whose command line holds ``marker`` (read from /proc)."""
    from pathlib import Path

    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if marker.encode() in cmdline.read_bytes():
                found.append(cmdline.parent.name)
        except OSError:
            continue
    return found


@pytest.mark.slow  # seconds of the default suite; CI runs it with the slow tests
def test_a_process_deadline_names_each_ranks_line_and_leaves_no_lock_or_child(tmp_path, monkeypatch, capfd):
    """At the deadline the launcher asks each pending rank for its Python stack (faulthandler on SIGUSR1): the
    message holds the rank's own line, not only the frame it waits in (``subprocess.py``, or a collective). A
    rank killed while it 'compiles' leaves neither torch's build lock (which would block every later build of
    that op, real gloo runs included) nor its child process; an older lock is kept."""
    import os

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    old = tmp_path / "other_op" / "lock"
    old.parent.mkdir()
    old.touch()
    os.utime(old, (1.0, 1.0))  # from another time: not this launch's
    lock = tmp_path / "shm_comm" / "lock"
    marker = f"simdist-test-child-{os.getpid()}-{tmp_path.name}"
    with pytest.raises(TimeoutError) as caught:
        simdist.run(_locks_then_hangs, 2, api="dist", where="processes", timeout_s=4, args=(str(lock), marker))
    message = str(caught.value)
    assert "ranks [0, 1] of 2 did not finish within 4 s; all ranks killed" in message
    rank1 = message.split("--- rank 1 (most recent call first) ---")[1]
    assert "test_run.py" in rank1 and "_locks_then_hangs" in rank1 and "subprocess.py" in rank1
    rank0 = message.split("--- rank 0 (most recent call first) ---")[1].split("--- rank 1")[0]
    assert "_locks_then_hangs" in rank0 and "barrier" in rank0
    assert not lock.exists() and old.exists()
    assert f"simdist: removed {lock}" in capfd.readouterr().err
    assert not _processes_with(marker), "the rank's child process outlived it"


def _uneven(rank: int) -> torch.Tensor:
    """all_to_all_single with uneven splits: each member sends a different number of bytes."""
    world = dist.get_world_size()
    send = [(rank + dst) % 3 + 1 for dst in range(world)]
    recv = [(src + rank) % 3 + 1 for src in range(world)]
    data = (torch.arange(sum(send), dtype=torch.float32) * (rank + 1) / 7).to(torch.bfloat16)
    out = torch.empty(sum(recv), dtype=torch.bfloat16)
    dist.all_to_all_single(out, data, recv, send)
    return out


def test_process_mode_gathers_members_of_different_lengths_bitwise():
    """Members' payloads of different lengths are padded to one width (equal ones are sent as they are, into a
    buffer the group keeps): the bits are the threads'."""
    threads = simdist.run(_uneven, 4, api="dist", where="threads")
    processes = simdist.run(_uneven, 4, api="dist", where="processes")
    for a, b in zip(threads, processes, strict=True):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))


def _rooted(rank: int) -> tuple:
    world = dist.get_world_size()
    objects = [{"to": i, "blob": bytes([i]) * (1000 + i)} for i in range(world)] if rank == 2 else None
    got = [None]
    dist.scatter_object_list(got, objects, src=2)
    box = [("from", 3, torch.arange(5.0) / 3)] if rank == 3 else [None]
    dist.broadcast_object_list(box, src=3)
    t = (torch.arange(6, dtype=torch.float32).view(2, 3) / (rank + 3)).t()  # dense, same layout everywhere
    dist.broadcast(t, src=1)
    return got[0], box[0], t


def test_rooted_collectives_send_the_roots_tensors_only_and_match_gloo():
    """broadcast and scatter read only the root's tensors: process mode sends those alone (the other members'
    are layouts, enough for gloo's checks), with real gloo's results; an uneven view is still refused."""
    gloo = simdist.run(_rooted, 4, api="dist", where="gloo")
    processes = simdist.run(_rooted, 4, api="dist", where="processes")
    for (g_obj, g_box, g_t), (p_obj, p_box, p_t) in zip(gloo, processes, strict=True):
        assert g_obj == p_obj and g_box[:2] == p_box[:2] and torch.equal(g_box[2], p_box[2])
        assert g_t.stride() == p_t.stride() and torch.equal(
            g_t.contiguous().view(torch.int32), p_t.contiguous().view(torch.int32)
        )
    with pytest.raises(RankFailure, match=r"broadcast on world.*memory order"):
        simdist.run(_gappy_broadcast, 2, api="dist", where="processes")


def _gappy_broadcast(rank: int) -> None:
    base = torch.arange(12.0).view(3, 4) + 100 * rank
    dist.broadcast(base[:, 1:3], src=1)  # a view with gaps: gloo would overwrite other elements
