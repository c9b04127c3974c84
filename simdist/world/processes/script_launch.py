"""``simdist run --nproc N script.py args...``: an unmodified torchrun script on simdist's process mode.

    torchrun --nproc-per-node 4 train.py --lr 0.1          # real gloo or NCCL
    simdist run --nproc 4 train.py --lr 0.1                # the same script, simdist's modelled arithmetic
    simdist run --nproc 4 --reduction ring --report-backend train.py --lr 0.1

`launch` starts ``N`` Python processes on this machine with the environment torchrun gives a rank
(``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), each
running `rank_main`: the script's ``dist.init_process_group`` -- whatever backend it names (``gloo``,
``nccl``, ``cpu:gloo,cuda:nccl``) and whatever init method -- makes a ``simdist`` group over one store
per launch (`simdist.world.backend.attach`), ``new_group``'s backend names are served by simdist too, and
``dist.get_backend()`` answers ``"simdist"`` or, with ``--report-backend``, the name the script asked
for. Then the script runs as ``python script.py args`` would run it (``__main__``, ``sys.argv``, its
folder first on ``sys.path``). The reduction is ``SIMDIST_REDUCTION`` (`simdist.world.processes.transport`).

The launch returns the first failing rank's exit status (the others are then stopped), else 0; a launch
that outlives ``timeout_s`` is stopped and returns 124.
"""

from __future__ import annotations

import os
import runpy
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from simdist.errors import UsageError
from simdist.world.backend.attach import Attachment
from simdist.world.backend.attach import install as install_attach
from simdist.world.backend.process_group import BACKEND_NAME
from simdist.world.options import DEFAULT_REDUCTION, as_reduction
from simdist.world.processes.transport import REDUCTION_ENV

REPORT_ENV = "SIMDIST_REPORT_BACKEND"
"""Set to ``1`` in the ranks' environment by ``--report-backend``."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(
    script: str,
    args: list[str],
    nproc: int,
    *,
    reduction: str = DEFAULT_REDUCTION,
    report_backend: bool = False,
    timeout_s: float = 3600.0,
) -> int:
    """Run ``script args`` on ``nproc`` simdist rank processes; return the launch's exit status."""
    if nproc < 1:
        raise UsageError(f"--nproc must be at least 1, got {nproc}")
    if not Path(script).is_file():
        raise UsageError(f"script {script!r} is not a file")
    as_reduction(reduction, "--reduction")  # a bad name is one line now, not N tracebacks later
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    env.update({"WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc), REDUCTION_ENV: reduction})
    env[REPORT_ENV] = "1" if report_backend else "0"
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "simdist.world.processes.script_launch", script, *args],
            env=dict(env, RANK=str(r), LOCAL_RANK=str(r), GROUP_RANK="0"),
        )
        for r in range(nproc)
    ]
    deadline = time.monotonic() + timeout_s
    status = 0
    try:
        while procs and status == 0:
            for p in list(procs):
                code = p.poll()
                if code is not None:
                    procs.remove(p)
                    status = status or code
            if time.monotonic() > deadline:
                print(f"simdist run: stopped after {timeout_s:g} s", file=sys.stderr)
                status = 124
            time.sleep(0.05)
        return status
    finally:
        for p in procs:  # the peers of a failed rank would wait for it until their timeout
            p.kill()
            p.wait()


def rank_main(argv: list[str]) -> None:
    """One rank: serve every ``init_process_group`` with a simdist group, then run the script as ``__main__``."""
    script, *args = argv
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, rank == 0, timeout=timedelta(minutes=30)
    )
    init = dist.init_process_group

    def make_group(n: int) -> None:
        init(BACKEND_NAME, store=dist.PrefixStore(f"simdist-init{n}", store), rank=rank, world_size=world)

    attachment = Attachment(rank, world, make_group, os.environ.get(REPORT_ENV) == "1")
    install_attach(lambda: attachment)  # this process is the rank: nothing to undo
    sys.argv = [script, *args]
    sys.path.insert(0, str(Path(script).resolve().parent))
    runpy.run_path(script, run_name="__main__")
    if dist.is_initialized():  # a script that never destroys its group: torchrun's processes just exit
        dist.destroy_process_group()


if __name__ == "__main__":
    rank_main(sys.argv[1:])
