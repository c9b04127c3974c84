"""Scripts that initialise their own group run unchanged on simdist, with real gloo's bits.

The torch tutorial's ``mp.spawn`` worker (tests/idiom_programs.py) calls ``init_process_group`` with a backend
name and an init method, names the backend again in ``new_group``, branches on ``dist.get_backend()`` and
destroys its group. Default suite: on rank threads every backend name and init method gives the same bits,
mistakes are c10d's errors, ``report_backend`` changes the gated path. Slow suite: the worker under real
``torch.multiprocessing.spawn`` on gloo (the reference, no simdist code involved) against ``simdist.run`` on
threads and in process mode, bitwise, P = 2, 4, 8.
"""

from __future__ import annotations

import socket
from pathlib import Path

import idiom_programs as programs
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import simdist
from simdist.extras import installed, not_installed_reason
from simdist.numerics.floats import bits

bound_init = dist.init_process_group  # a script's `from torch.distributed import init_process_group`, at import
bound_destroy = dist.destroy_process_group

KEYS = ("total", "pair", "gathered", "scaled")


def _same(a: dict, b: dict, keys=KEYS) -> bool:
    return all(torch.equal(bits(a[k]), bits(b[k])) for k in keys)


def _plain(rank: int) -> dict:
    """The same collectives in a function that leaves the group to the launcher (the older simdist idiom)."""
    n = dist.get_world_size()
    x = programs._values(rank, 33)
    total = x.clone()
    dist.all_reduce(total)
    return {"total": total, "x": x, "n": n}


@pytest.mark.parametrize(
    ("backend", "init_method"),
    [("gloo", "env://"), ("nccl", "tcp://127.0.0.1:29999"), ("cpu:gloo,cuda:nccl", None), (None, None)],
)
def test_a_worker_that_initialises_its_own_group_runs_on_threads(backend, init_method):
    n = 4
    seen = simdist.run(programs.tutorial_worker, n, args=(n, init_method, backend))
    plain = simdist.run(_plain, n)
    for rank in range(n):
        assert torch.equal(bits(seen[rank]["total"]), bits(plain[rank]["total"]))
        assert torch.equal(bits(seen[rank]["gathered"]), bits(torch.stack([p["x"] for p in plain])))
        assert seen[rank]["initialised_after"] is False
    # power: the reduction reaches the worker's group (another order changes the sum's bits)
    ring = simdist.run(programs.tutorial_worker, n, args=(n, init_method, backend), reduction="sequential")
    assert not all(torch.equal(bits(s["total"]), bits(r["total"])) for s, r in zip(seen, ring, strict=True))
    assert not dist.is_initialized()


def test_report_backend_gives_the_asked_name_to_gated_code():
    n = 3
    asked = simdist.run(programs.tutorial_worker, n, args=(n, None, "nccl"), report_backend=True)
    default = simdist.run(programs.tutorial_worker, n, args=(n, None, "nccl"))
    for a, d in zip(asked, default, strict=True):
        assert torch.equal(bits(a["total"]), bits(d["total"]))
        assert torch.equal(bits(a["scaled"]), bits(a["total"] / n))  # the "nccl" branch
        assert torch.equal(bits(d["scaled"]), bits(d["total"] * (1.0 / n)))  # the other one
    assert not all(torch.equal(a["scaled"], d["scaled"]) for a, d in zip(asked, default, strict=True))
    names = simdist.run(lambda r: (dist.init_process_group("gloo"), str(dist.get_backend()))[1], 2, report_backend=True)
    assert names == ["gloo", "gloo"]
    assert simdist.run(lambda r: (dist.init_process_group("gloo"), str(dist.get_backend()))[1], 2) == ["simdist"] * 2


def test_destroy_then_init_again_makes_a_new_group():
    n = 3
    seen = simdist.run(programs.reinit_worker, n, args=(n,))
    assert all(torch.equal(bits(s["second"]), bits(seen[0]["second"])) for s in seen)
    assert not torch.equal(seen[0]["first"], seen[0]["second"])


def test_a_second_init_is_c10ds_error_and_a_wrong_rank_or_size_is_refused():
    def twice(rank: int) -> None:
        dist.init_process_group("gloo")
        dist.init_process_group("gloo")

    with pytest.raises(ValueError, match="initialize the default process group twice"):
        simdist.run(twice, 2)
    with pytest.raises(ValueError, match=r"rank=0\) on simdist rank 1"):
        simdist.run(lambda r: dist.init_process_group("gloo", rank=0, world_size=2), 2)
    with pytest.raises(ValueError, match=r"world_size=8\) on simdist rank 0 of a 2-rank"):
        simdist.run(lambda r: dist.init_process_group("gloo", rank=r, world_size=8), 2)
    assert dist.init_process_group.__module__ == "torch.distributed.distributed_c10d"  # the originals are back


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _mp_entry(rank: int, world_size: int, init_method: str, out: str) -> None:
    torch.save(programs.tutorial_worker(rank, world_size, init_method, "gloo"), Path(out) / f"{rank}.pt")


@pytest.mark.slow
@pytest.mark.gloo
@pytest.mark.parametrize("n", [2, 4, 8])
def test_the_tutorial_worker_gives_real_gloos_bits_on_threads_and_processes(n, tmp_path):
    mp.spawn(_mp_entry, args=(n, f"tcp://127.0.0.1:{_free_port()}", str(tmp_path)), nprocs=n)
    gloo = [torch.load(tmp_path / f"{r}.pt") for r in range(n)]
    threads = simdist.run(programs.tutorial_worker, n, args=(n, "env://", "gloo"))
    processes = simdist.run(programs.tutorial_worker, n, args=(n, None, "nccl"), where="processes", timeout_s=300)
    for rank in range(n):
        assert _same(threads[rank], gloo[rank]), rank
        assert _same(processes[rank], gloo[rank]), rank


SCRIPT = Path(__file__).parent.parent / "idiom_torchrun_script.py"


def _script_results(outdir: Path, n: int) -> list[dict]:
    return [torch.load(outdir / f"{r}.pt") for r in range(n)]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["run", "--nproc", "0", str(SCRIPT)], "expected a positive integer"),
        (["run", "--nproc", "2", "no_such_script.py"], "is not a file"),
        (["run", "--nproc", "2", "--reduction", "no-such-model", str(SCRIPT)], "no-such-model"),
    ],
)
def test_simdist_run_refuses_bad_input_in_one_line(argv, message, capsys):
    from simdist.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.slow
@pytest.mark.gloo
@pytest.mark.parametrize("n", [2, 4])
def test_a_torchrun_script_asking_for_nccl_gives_real_gloos_bits_under_simdist_run(n, tmp_path):
    import subprocess
    import sys

    real, simulated = tmp_path / "torchrun", tmp_path / "simdist"
    real.mkdir()
    simulated.mkdir()
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n), "--master-port"]
    subprocess.run([*torchrun, str(_free_port()), str(SCRIPT), "gloo", str(real)], check=True, timeout=600)
    simdist_run = [sys.executable, "-c", "import sys, simdist.cli as c; sys.exit(c.main())", "run", "--nproc", str(n)]
    subprocess.run([*simdist_run, "--report-backend", str(SCRIPT), "nccl", str(simulated)], check=True, timeout=600)
    for r, s in zip(_script_results(real, n), _script_results(simulated, n), strict=True):
        assert torch.equal(bits(r["total"]), bits(s["total"])) and torch.equal(bits(r["gathered"]), bits(s["gathered"]))
        assert (r["backend"], s["backend"]) == ("gloo", "nccl")
    if n == 4:  # power: the launch really computes with simdist's model (another order changes the bits)
        other = tmp_path / "sequential"
        other.mkdir()
        subprocess.run([*simdist_run, "--reduction", "sequential", str(SCRIPT), "gloo", str(other)], check=True)
        pairs = zip(_script_results(other, n), _script_results(real, n), strict=True)
        assert not all(torch.equal(a["total"], b["total"]) for a, b in pairs)


def _installed(name: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


@pytest.mark.skipif(not _installed("deepspeed"), reason="needs the [deepspeed] extra")
def test_deepspeed_on_rank_threads_is_refused_where_it_initialises_in_one_line():
    import deepspeed
    from torch import nn

    from simdist.world.threads.isolation import SharedGlobalStateError

    def rank(r: int):
        deepspeed.initialize(model=nn.Linear(2, 2), config={"train_batch_size": 2})  # line named

    line = rank.__code__.co_firstlineno + 1
    with pytest.raises(
        SharedGlobalStateError,
        match=rf"rank 0 called deepspeed.comm.init_distributed at .*test_idioms.py:{line}: .*where=\"processes\"",
    ):
        simdist.run(rank, 2)
    assert deepspeed.comm.init_distributed.__module__ == "deepspeed.comm.comm"  # given back


def _plain17(rank: int) -> torch.Tensor:
    x = programs._values(rank, 17)
    dist.all_reduce(x)
    return x


def _bound_worker(rank: int, backend: str) -> list[torch.Tensor]:
    """A worker that calls torch's function objects bound before the spawn (not the module attributes)."""
    sums = []
    for _ in range(2):  # init, destroy, init again
        bound_init(backend, init_method="env://", rank=rank, world_size=3)
        x = programs._values(rank, 17)
        dist.all_reduce(x)
        sums.append(x)
        bound_destroy()
    return sums


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_init_process_group_bound_before_the_spawn_attaches_too(backend):
    seen = simdist.run(_bound_worker, 3, args=(backend,))
    plain = simdist.run(_plain17, 3)
    for rank in range(3):
        for total in seen[rank]:
            assert torch.equal(bits(total), bits(plain[rank]))
    # outside a rank, the bound name is torch's own again: it refuses a second init as torch does
    func = bound_init.__closure__[bound_init.__code__.co_freevars.index("func")].cell_contents
    assert func.__code__.co_filename.endswith("c10d_logger.py")  # torch's time-logging wrapper, not simdist's
    assert not dist.is_initialized()


@pytest.mark.skipif(not installed("megatron"), reason=not_installed_reason("megatron"))
def test_megatron_on_rank_threads_is_refused_where_it_initialises_in_one_line():
    from megatron.core import parallel_state

    from simdist.world.threads.isolation import SharedGlobalStateError

    def rank(r: int):
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)  # line named

    line = rank.__code__.co_firstlineno + 1
    with pytest.raises(
        SharedGlobalStateError,
        match=rf"rank 0 called megatron.core.parallel_state.initialize_model_parallel at .*test_idioms.py:{line}: "
        r".*megatron.core.parallel_state.*where=\"processes\"",
    ):
        simdist.run(rank, 2)
    assert parallel_state.initialize_model_parallel.__module__ == "megatron.core.parallel_state"  # given back
