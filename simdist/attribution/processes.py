"""Process mode of blame: a torchrun-style script on N simdist rank processes, each blamed, the records merged.

    simdist blame --nproc 4 --processes train.py      # DeepSpeed, Megatron: module-global groups per process

`run_processes` starts ``N`` Python processes with the environment torchrun gives a rank, each running
`rank_main`: the script runs as `simdist.world.script_launch.rank_main` runs it (its ``init_process_group``
makes a ``simdist`` group in process mode, `simdist.world.process`), under a `simdist.attribution.run.Recorder`
whose rank is the process's. A collective in process mode gathers every member's inputs before its
reduction model runs (`simdist.world.process.ProcessTransport`), so each process measures its own outputs
against the FP64 sum of all members' inputs exactly as a rank thread does; casts and arithmetic sites are
each process's own. Each rank saves its sites, promoted events and final state; `merge` joins them: the
same call site on several ranks is one site (calls, elements, non-finite counts and error masses add up,
the max figures are the largest of any rank; `simdist.attribution.measure.SiteErrors.merge`), with each
rank's figures kept for the JSON (``by_rank``); the final states are disjoint (their tensors are named by
rank).

A promoted rerun is another launch with the promoted site keys handed to every rank. Reduction model: gloo's
(``SIMDIST_REDUCTION`` is set for the ranks), as in ``simdist run``.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from simdist.attribution.api import blame_runs
from simdist.attribution.measure import SiteErrors
from simdist.attribution.report import BlameReport
from simdist.attribution.run import Recorder, SiteKey, execute

PLAN = "plan.pt"
"""The file in the launch's folder that tells every rank which sites to promote and which ops to measure."""


class RankExit(Exception):
    """A rank process of a blamed launch exited with a non-zero status (its own output says why)."""

    def __init__(self, status: int, rank: int) -> None:
        super().__init__(f"rank {rank} exited with status {status}")
        self.status = status
        self.rank = rank


@dataclass
class MergedRun:
    """The records of every rank process of one launch, merged (what a `Recorder` holds after a thread run)."""

    sites: dict[SiteKey, SiteErrors] = field(default_factory=dict)
    promoted: dict[SiteKey, int] = field(default_factory=dict)
    unpromotable: dict[SiteKey, str] = field(default_factory=dict)
    sharded: bool = False
    state: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)

    def final_state(self) -> dict[str, dict[str, torch.Tensor]]:
        return self.state


def merge(records: Iterable[dict]) -> MergedRun:
    """Join the ranks' saved records (`rank_main`'s files): one site per call site, disjoint final states."""
    merged = MergedRun()
    for record in records:
        for site in record["sites"]:
            mine = merged.sites.get(site.key)
            if mine is None:
                merged.sites[site.key] = site
            else:
                mine.merge(site)
        for key, count in record["promoted"].items():
            merged.promoted[key] = merged.promoted.get(key, 0) + count
        merged.unpromotable.update(record["unpromotable"])
        merged.sharded = merged.sharded or record["sharded"]
        for category, tensors in record["state"].items():
            into = merged.state.setdefault(category, {})
            clash = set(into) & set(tensors)
            if clash:
                raise ValueError(f"two ranks saved the same final-state tensor: {sorted(clash)[:3]}")
            into.update(tensors)
    return merged


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_processes(
    script: str,
    argv: list[str],
    nproc: int,
    promote: Iterable[SiteKey] = (),
    ops: frozenset[str] = frozenset(),
    timeout_s: float = 3600.0,
) -> MergedRun:
    """Run ``script argv`` blamed on ``nproc`` simdist rank processes; the ranks' merged records.

    A rank that exits non-zero stops the launch (the others are killed) and raises `RankExit` with its status;
    a launch past ``timeout_s`` raises ``TimeoutError``."""
    with tempfile.TemporaryDirectory(prefix="simdist-blame-") as folder:
        out = Path(folder)
        torch.save({"promote": sorted(promote), "ops": sorted(ops)}, out / PLAN)
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
        env.update(WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc), SIMDIST_REDUCTION="gloo")
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        procs = [
            subprocess.Popen(
                [sys.executable, "-m", "simdist.attribution.processes", folder, script, *argv],
                env=dict(env, RANK=str(r), LOCAL_RANK=str(r), GROUP_RANK="0"),
            )
            for r in range(nproc)
        ]
        deadline = time.monotonic() + timeout_s
        try:
            running = dict(enumerate(procs))
            while running:
                for rank, p in list(running.items()):
                    code = p.poll()
                    if code is None:
                        continue
                    del running[rank]
                    if code != 0:
                        raise RankExit(code, rank)
                if time.monotonic() > deadline:
                    raise TimeoutError(f"simdist blame: the {nproc} rank processes ran past {timeout_s:g} s")
                time.sleep(0.05)
        finally:
            for p in procs:  # the peers of a failed rank would wait for it until their timeout
                if p.poll() is None:
                    p.kill()
                p.wait()
        return merge(torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(nproc))


def blame_processes(
    script: str,
    argv: list[str],
    nproc: int,
    *,
    promote: Iterable = (),
    promote_top: int = 0,
    ops: str | Iterable[str] | None = None,
    timeout_s: float = 3600.0,
) -> BlameReport:
    """`simdist.attribution.api.blame_target` for a torchrun-style script on ``nproc`` rank processes: every
    run (the base run and each promotion's rerun) is a launch (`run_processes`), its ranks' records merged."""

    def run(keys: set, names: frozenset) -> tuple[MergedRun, None]:
        return run_processes(script, argv, nproc, keys, names, timeout_s), None

    return blame_runs(run, promote=promote, promote_top=promote_top, ops=ops)


def rank_main(argv: list[str]) -> None:
    """One rank process: run the script blamed (`execute`), save this rank's record into the launch's folder."""
    from simdist.audit.cli import exit_status
    from simdist.world.script_launch import rank_main as run_script

    folder, script, *args = argv
    out = Path(folder)
    plan = torch.load(out / PLAN, weights_only=False)
    rank = int(os.environ["RANK"])
    recorder = Recorder(promote=[tuple(k) for k in plan["promote"]], ops=frozenset(plan["ops"]))
    recorder.rank = rank
    try:
        execute(lambda: run_script([script, *args]), recorder)
    except SystemExit as exc:
        status, message = exit_status(exc)
        if status:
            if message:
                print(message, file=sys.stderr)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(status)
    record = {
        "state": recorder.final_state(),  # first: it notes whether DTensor shards stood in (``sharded``)
        "sites": list(recorder.sites.values()),
        "promoted": recorder.promoted,
        "unpromotable": recorder.unpromotable,
        "sharded": recorder.sharded,
    }
    torch.save(record, out / f"rank{rank}.tmp")
    os.replace(out / f"rank{rank}.tmp", out / f"rank{rank}.pt")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # frameworks leave groups undestroyed (DeepSpeed's): their teardown can abort a finished rank


if __name__ == "__main__":
    rank_main(sys.argv[1:])
