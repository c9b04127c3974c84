"""Rank threads behave like processes: ordinary training idioms give real gloo's bits on `simdist.run`'s threads.

The programs (tests/isolation_programs.py) use torch's global generator,
default dtype, DTensor's tables, ``broadcast`` into parameters and pipelining
as real programs do. The default suite runs the cheap ones three times on
threads (reruns identical) and compares them with real gloo in
tests/integration/test_backend_gloo.py, whose one real-gloo spawn runs them too; the slow
suite runs every program on real gloo, on process mode and three times on threads.
The rest checks what a thread launch does around the run: state refused by
name, the caller's state given back, ``sys.exit`` and bad world sizes.
"""

from __future__ import annotations

import gc
import json
import random
import subprocess
import sys
import threading

import isolation_programs as programs
import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

import simdist
from simdist.numerics.floats import bits
from simdist.world.threads import spawn as inproc
from simdist.world.threads.isolation import SETTINGS, SharedGlobalStateError, read_settings

N = 4
RERUNS = 3


def _leaves(value, path: str = ""):
    if isinstance(value, dict):
        for key in value:
            yield from _leaves(value[key], f"{path}/{key}")
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _leaves(item, f"{path}[{i}]")
    else:
        yield path, value


def _assert_same(a: list, b: list, what: str) -> int:
    """Every rank's leaves equal: tensors by dtype, shape and raw bits, other values by ==; returns the count."""
    assert len(a) == len(b) == N
    count = 0
    for rank, (x, y) in enumerate(zip(a, b, strict=True)):
        left, right = dict(_leaves(x)), dict(_leaves(y))
        assert left.keys() == right.keys(), (what, rank, set(left) ^ set(right))
        for key, p in left.items():
            q = right[key]
            assert isinstance(p, torch.Tensor) == isinstance(q, torch.Tensor), (what, rank, key)
            if isinstance(p, torch.Tensor):
                assert p.dtype == q.dtype and p.shape == q.shape, (what, rank, key, p, q)
                assert torch.equal(bits(p), bits(q)), f"{what}: rank {rank} {key} differs:\n{p}\n{q}"
            else:
                assert p == q, f"{what}: rank {rank} {key}: {p!r} != {q!r}"
            count += 1
    return count


def _threads_reruns(fn) -> list:
    first = simdist.run(fn, N, timeout_s=300)
    for _ in range(RERUNS - 1):
        _assert_same(first, simdist.run(fn, N, timeout_s=300), "threads rerun")
    return first


def test_seed_per_rank_same_seed_init_settings_and_broadcast_are_identical_in_every_rerun():
    """Against real gloo in the default suite: test_backend_gloo.py (its one shared gloo spawn runs `quick`)."""
    threads = _threads_reruns(programs.quick)
    # the idioms mean what they say: per-rank streams differ, same-seed weights agree, versions are not bumped
    assert not torch.equal(threads[0]["seed_per_rank"]["after"], threads[1]["seed_per_rank"]["after"])
    assert all(torch.equal(t["same_seed_init"]["weight"], threads[0]["same_seed_init"]["weight"]) for t in threads)
    dtypes = [t["settings"]["dtype"] for t in threads]
    assert dtypes == ["torch.float32", "torch.float64", "torch.float32", "torch.float32"]  # only rank 1 set float64
    assert threads[2]["broadcast_params"]["versions"] == [0, 0, 0, 0]


@pytest.mark.slow
@pytest.mark.gloo
def test_every_idiom_threads_process_mode_and_real_gloo_agree_bitwise():
    """Seeds, init, DDP+dropout, TP+FSDP2 on 37 rows, loss_parallel, broadcast, pipelining, monitored_barrier, ZeRO."""
    gloo = simdist.run(programs.suite, N, where="gloo", timeout_s=600)
    processes = simdist.run(programs.suite, N, where="processes", timeout_s=600)
    threads = _threads_reruns(programs.suite)
    assert _assert_same(processes, gloo, "process mode vs real gloo") >= 180
    assert _assert_same(threads, gloo, "threads vs real gloo") >= 180
    assert gloo[0]["zero_overlap"]["refused"].startswith("RuntimeError")


def test_the_callers_generator_and_settings_are_untouched_and_ranks_start_fresh():
    torch.manual_seed(123)
    expected = torch.Generator().manual_seed(123)

    def rank(r: int):
        start = torch.initial_seed()
        torch.manual_seed(r)
        torch.set_default_dtype(torch.float64)
        dist.barrier()
        return start, torch.randn(2).dtype

    seen = simdist.run(rank, N)
    assert torch.equal(torch.randn(4), torch.randn(4, generator=expected))
    assert torch.initial_seed() == 123 and torch.get_default_dtype() == torch.float32
    starts = [s for s, _ in seen]
    assert len(set(starts)) == N and 123 not in starts  # each rank's generator is seeded from entropy, as a process
    assert all(dtype == torch.float64 for _, dtype in seen)

    def failing(r: int):
        torch.manual_seed(r)
        torch.set_default_dtype(torch.float64)
        raise KeyError(r)

    state = torch.default_generator.get_state()
    with pytest.raises(KeyError):
        simdist.run(failing, 2)
    assert torch.equal(torch.default_generator.get_state(), state) and torch.get_default_dtype() == torch.float32


def test_python_and_numpy_module_generators_are_per_rank_not_refused():
    """Per rank by dispatch (tests/integration/test_rank_rngs.py checks the bits and the refusals)."""
    random.seed(5)
    np.random.seed(5)
    before = (random.random(), np.random.rand())
    random.seed(5)
    np.random.seed(5)
    seen = simdist.run(lambda r: (random.random(), np.random.rand()), 2)
    assert seen[0] != seen[1] and before not in seen
    assert (random.random(), np.random.rand()) == before  # the caller's streams are untouched


def _other(name: str, original):
    """A value of setting ``name`` different from ``original``."""
    if name == "default_dtype":
        other = torch.float64 if original != torch.float64 else torch.float32
    elif name == "float32_matmul_precision":
        other = "medium" if original != "medium" else "highest"
    elif isinstance(original, tuple):
        other = (not original[0], original[1])
    elif isinstance(original, list):
        other = original[::-1]
    else:
        other = not original
    return other


def test_settings_are_process_global_by_experiment():
    """Each entry of SETTINGS really is one per process (a thread's change is seen by another thread)."""
    for name, (get, set_, _) in SETTINGS.items():
        original = get()
        other = _other(name, original)
        t = threading.Thread(target=set_, args=(other,))
        t.start()
        t.join()
        try:
            assert get() == other, name
        finally:
            set_(original)


def test_read_settings_reads_each_setting_of_the_table():
    """`read_settings` (the handoff's written-out reader) returns what `SETTINGS`' getters return, in its order,
    with each setting changed alone: a slot that reads another setting, or none, shows here."""
    for position, (name, (get, set_, _)) in enumerate(SETTINGS.items()):
        before = read_settings()
        original = get()
        set_(_other(name, original))
        try:
            after = read_settings()
            assert after == tuple(g() for g, _, _ in SETTINGS.values()), name
            assert [i for i in range(len(after)) if after[i] != before[i]] == [position], name
        finally:
            set_(original)


def test_every_setting_is_per_rank_on_threads():
    """Rank 1 changes every setting; ranks 0, 2, 3 keep a fresh process's values; the caller keeps its own."""
    caller = {name: get() for name, (get, _, _) in SETTINGS.items()}

    def rank(r: int) -> dict:
        if r == 1:
            for name, (get, set_, _) in SETTINGS.items():
                set_(_other(name, get()))
        dist.barrier()
        return {name: get() for name, (get, _, _) in SETTINGS.items()}

    seen = simdist.run(rank, N)
    fresh = {name: value for name, (_, _, value) in SETTINGS.items()}
    assert seen[0] == seen[2] == seen[3] == fresh
    assert all(seen[1][name] == _other(name, fresh[name]) for name in SETTINGS)
    assert {name: get() for name, (get, _, _) in SETTINGS.items()} == caller


@pytest.mark.slow
def test_fresh_values_are_a_new_interpreters():
    code = (
        "import json, torch\nfrom simdist.world.threads.isolation import SETTINGS\n"
        "print(json.dumps({n: str(g()) for n, (g, s, f) in SETTINGS.items()}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert json.loads(out.splitlines()[-1]) == {n: str(f) for n, (g, s, f) in SETTINGS.items()}


def test_spawn_restores_excepthook_c10d_globals_and_dtensor_tables():
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor

    hook, backend, init, mesh_init = sys.excepthook, c10d._backend, c10d._default_pg_init_method, DeviceMesh.__init__
    dispatcher_class = type(DTensor._op_dispatcher)

    def meshes() -> int:
        gc.collect()
        return sum(isinstance(o, DeviceMesh) for o in gc.get_objects())

    def rank(r: int):
        from torch.distributed.tensor import Replicate, Shard

        mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (2,))
        DTensor.from_local(torch.ones(3, 2), mesh, [Shard(0)]).redistribute(mesh, [Replicate()])  # fills caches
        return mesh._thread_id

    before = meshes()
    tokens = simdist.run(rank, 2)
    assert len(set(tokens)) == 2 and None not in tokens
    assert meshes() <= before  # torch's mesh-keyed caches hold no rank's mesh after the spawn
    assert sys.excepthook is hook and c10d._backend == backend and c10d._default_pg_init_method is init
    assert DeviceMesh.__init__ is mesh_init and type(DTensor._op_dispatcher) is dispatcher_class
    assert isinstance(DTensor._op_dispatcher.__dict__["_custom_op_handlers"], dict)


@pytest.mark.slow
def test_500_spawns_leave_no_rank_prefix_and_flat_memory(capsys):
    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    for i in range(500):
        simdist.run(lambda r: None, 2)
        if i == 99:
            at_100 = rss()
    assert rss() - at_100 < 16 * 2**20
    try:
        raise ValueError("after 500 spawns")
    except ValueError:
        sys.excepthook(*sys.exc_info())
    err = capsys.readouterr().err
    assert "after 500 spawns" in err and "[rank" not in err


def test_a_ranks_sys_exit_is_an_error_naming_the_rank():
    with pytest.raises(inproc.RankExitError, match=r"rank 1 called sys.exit\(3\)"):
        simdist.run(lambda r: sys.exit(3) if r == 1 else dist.barrier(), 2)


@pytest.mark.parametrize("bad", [4.0, "4", True, None])
def test_world_size_of_the_wrong_type_is_one_type_error(bad):
    with pytest.raises(TypeError, match="world must be a world size"):
        simdist.run(lambda r: None, bad)


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        (0, "world must be at least 1 rank"),
        (-1, "at least 1"),
        (513, r"world_size must be in \[1, 512\]"),
        (10**5, "512"),
    ],
)
def test_world_size_outside_the_ceiling_is_refused_at_once(bad, match):
    with pytest.raises(ValueError, match=match):
        simdist.run(lambda r: None, bad)


def test_the_ceiling_is_the_clis():
    from simdist.cli.limits import LIMITS

    assert LIMITS["world_size"] == inproc.MAX_RANK_THREADS
    assert simdist.run(lambda r: r, np.int64(2)) == [0, 1]


def test_a_spawn_inside_a_rank_is_refused():
    with pytest.raises(RuntimeError, match="from a rank thread"):
        simdist.run(lambda r: simdist.run(lambda q: q, 2), 2)


@pytest.mark.slow
def test_torch_compile_on_rank_threads_is_refused_by_name():
    def rank(r: int):
        return torch.compile(lambda x: x * 2 + 1, backend="eager")(torch.ones(3))

    with pytest.raises(SharedGlobalStateError, match=r"torch\.compile"):
        simdist.run(rank, 2)
