"""The forkservers of process launches: a rank carries torch, simdist's rank body and its own launch's ``preload``,
never a module another launch preloaded (issue 34: ranks of a plain launch after a DeepSpeed one carried
DeepSpeed), and a server is kept for the next launch that asks for the same set.

Checked by what the ranks have in ``sys.modules`` and by which process forked them (their parent), never by a
clock or by memory figures.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os
import sys
from pathlib import Path

import pytest

import simdist
from simdist.extras import installed, not_installed_reason
from simdist.world.processes.forkservers import FREEZE, SERVER_PRELOAD, rank_context, server_modules


def modules_and_server(rank: int, names: tuple[str, ...]) -> tuple[dict[str, bool], int]:
    """Which of ``names`` this rank has imported, and the pid of the process it was forked from."""
    return {name: name in sys.modules for name in names}, os.getppid()


def test_a_servers_modules_are_torch_the_launchs_preload_and_the_freezer_last():
    assert server_modules() == (*SERVER_PRELOAD, FREEZE)
    assert server_modules(("json", "torch", FREEZE, "__main__", "json")) == (*SERVER_PRELOAD, "json", FREEZE)


@pytest.mark.skipif("forkserver" not in multiprocessing.get_all_start_methods(), reason="no forkserver here")
def test_each_preload_set_has_its_own_kept_server_and_the_stdlibs_is_given_back():
    """In this process only (a server starts at its first fork, and nothing forks here): the server a launch's
    processes would be forked from, by the stdlib's module-level lookups that its process starts make."""
    stdlib = multiprocessing.forkserver
    own = stdlib._forkserver  # type: ignore[attr-defined]
    chosen = []
    for preload in (("launch_probe",), (), ("launch_probe",), ("json", "launch_probe")):
        with rank_context(preload) as ctx:
            assert ctx.get_start_method() == "forkserver"
            server = stdlib._forkserver  # type: ignore[attr-defined]
            assert stdlib.connect_to_new_process.__self__ is server and server is not own
            assert server._preload_modules == list(server_modules(preload))  # exactly: nothing another launch had
            chosen.append(server)
        assert stdlib._forkserver is own and stdlib.connect_to_new_process.__self__ is own  # type: ignore[attr-defined]
    probe, plain, again, both = chosen
    assert again is probe and len({id(probe), id(plain), id(both)}) == 3


@pytest.mark.slow
@pytest.mark.gloo
def test_a_plain_launch_after_a_preloading_one_forks_ranks_without_that_module(monkeypatch):
    """``launch_probe`` stands in for a framework (it imports nothing). Python 3.11's forkserver imports its
    preload list on the environment's path (PYTHONPATH), not on this process's ``sys.path``."""
    here = str(Path(__file__).resolve().parent)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")])))
    stdlib_server = multiprocessing.forkserver._forkserver  # type: ignore[attr-defined]
    probe = ("launch_probe",)
    first = simdist.run(modules_and_server, 2, where="gloo", args=(probe,), preload=probe)
    plain = simdist.run(modules_and_server, 2, where="processes", args=(probe,))
    again = simdist.run(modules_and_server, 2, where="processes", args=(probe,), preload=probe)
    assert [m for m, _ in first] == [{"launch_probe": True}] * 2
    assert [m for m, _ in plain] == [{"launch_probe": False}] * 2  # the old server kept every preload: True
    assert [m for m, _ in again] == [{"launch_probe": True}] * 2
    servers = [{pid for _, pid in launch} for launch in (first, plain, again)]
    assert all(len(s) == 1 for s in servers) and servers[0] != servers[1]
    assert servers[2] == servers[0]  # the probe's server was kept, not started again
    assert multiprocessing.forkserver._forkserver is stdlib_server  # type: ignore[attr-defined]


@pytest.mark.slow
@pytest.mark.gloo
@pytest.mark.skipif(not installed("deepspeed"), reason=not_installed_reason("deepspeed"))
def test_a_plain_launch_after_a_deepspeed_one_has_no_deepspeed_in_its_ranks():
    from simdist.cases.ranks import DEEPSPEED_MODULES

    names = ("deepspeed", "deepspeed.runtime.engine")
    with_ds = simdist.run(modules_and_server, 2, where="processes", args=(names,), preload=DEEPSPEED_MODULES)
    plain = simdist.run(modules_and_server, 2, where="processes", args=(names,))
    assert [m for m, _ in with_ds] == [dict.fromkeys(names, True)] * 2
    assert [m for m, _ in plain] == [dict.fromkeys(names, False)] * 2
