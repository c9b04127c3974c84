"""Process mode of blame: a torchrun-style script on N simdist rank processes, each blamed, the records merged.

    simdist blame --nproc 4 --processes train.py      # DeepSpeed, Megatron: module-global groups per process

`run_processes` starts ``N`` rank processes (``simdist.run(where="processes")``: forked from a server that
has torch and the script's frameworks imported, each with the default group already a ``simdist`` group in
process mode, `simdist.world.processes.transport`, that the script's own ``init_process_group`` attaches to), each
running
the script as ``python script.py args`` would (`_blame_rank`) under a `simdist.attribution.run.Recorder`
whose rank is the process's. A collective in process mode gathers every member's inputs before its
reduction runs (`simdist.world.processes.transport.ProcessTransport`), so each process measures its own outputs
against the FP64 sum of all members' inputs exactly as a rank thread does; casts and arithmetic sites are
each process's own. Each rank returns its sites, promoted events and final state; `merge` joins them: the
same call site on several ranks is one site (calls, elements, non-finite counts and error masses add up,
the max figures are the largest of any rank; `simdist.attribution.measure.SiteErrors.merge`), with each
rank's figures kept for the JSON (``by_rank``); the final states are disjoint (their tensors are named by
rank).

A promoted rerun is another launch with the promoted site keys handed to every rank. Reduction: gloo's.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from simdist.attribution.api import blame_runs
from simdist.attribution.measure import SiteErrors
from simdist.attribution.report import BlameReport
from simdist.attribution.run import Recorder, SiteKey, execute
from simdist.cli.script import ScriptExit, as_main, exit_status, run_main
from simdist.errors import UsageError
from simdist.world.options import DEFAULT_REDUCTION


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
                raise UsageError(f"two ranks saved the same final-state tensor: {sorted(clash)[:3]}")
            into.update(tensors)
    return merged


def frameworks_of(script: str) -> tuple[str, ...]:
    """The framework modules ``script`` imports (DeepSpeed's, Megatron-Core's), for the forkserver to preload:
    their imports cost seconds per rank otherwise (`simdist.world.processes.forkservers`)."""
    from simdist.cases.ranks import DEEPSPEED_MODULES, MEGATRON_MODULES
    from simdist.extras import installed

    text = Path(script).read_text(errors="replace")
    found: list[str] = []
    for name, modules in (("deepspeed", DEEPSPEED_MODULES), ("megatron", MEGATRON_MODULES)):
        if re.search(rf"^\s*(import|from)\s+{name}\b", text, re.MULTILINE) and installed(name):
            found.extend(modules)
    return tuple(found)


def run_processes(
    script: str,
    argv: list[str],
    nproc: int,
    promote: Iterable[SiteKey] = (),
    ops: frozenset[str] = frozenset(),
    timeout_s: float = 3600.0,
    stdout_to_stderr: bool = False,
) -> MergedRun:
    """Run ``script argv`` blamed on ``nproc`` simdist rank processes (gloo's reduction); the ranks'
    merged records.

    The ranks are ``simdist.run(where="processes")``'s (forked from a server with torch and the script's
    frameworks imported); ``stdout_to_stderr``: the ranks' standard output (file descriptor 1) goes to standard
    error (``--json``: stdout is the report's); a rank that raises stops the launch with
    `simdist.world.processes.supervise.RankFailure` (its traceback); a script's non-zero ``sys.exit`` raises
    `ScriptExit`."""
    from simdist.world.runner import run

    plan = (script, list(argv), sorted(promote), sorted(ops), stdout_to_stderr)
    from simdist.cases.stdout import stdout_to_stderr as guard

    # a forkserver started now prints its imports' log lines on the descriptor it inherits
    with guard() if stdout_to_stderr else contextlib.nullcontext():
        records = run(
            _blame_rank,
            nproc,
            where="processes",
            args=plan,
            reduction=DEFAULT_REDUCTION,
            timeout_s=timeout_s,
            preload=frameworks_of(script),
        )
    for record in records:
        if record.get("exit"):
            raise ScriptExit(*record["exit"])
    return merge(records)


def blame_processes(
    script: str,
    argv: list[str],
    nproc: int,
    *,
    promote: Iterable = (),
    promote_top: int = 0,
    ops: str | Iterable[str] | None = None,
    timeout_s: float = 3600.0,
    stdout_to_stderr: bool = False,
) -> BlameReport:
    """`simdist.attribution.api.blame_target` for a torchrun-style script on ``nproc`` rank processes: every
    run (the base run and each promotion's rerun) is a launch (`run_processes`), its ranks' records merged."""

    def run(keys: set, names: frozenset) -> tuple[MergedRun, None]:
        return run_processes(script, argv, nproc, keys, names, timeout_s, stdout_to_stderr), None

    return blame_runs(run, promote=promote, promote_top=promote_top, ops=ops)


def _blame_rank(rank: int, script: str, argv: list[str], promote: list, ops: list[str], to_stderr: bool) -> dict:
    """One rank process: run the script blamed as ``python script.py argv`` would run it (``__main__``, its
    ``sys.argv``, its folder first on ``sys.path``; its ``init_process_group`` attaches to the rank's simdist
    group); this rank's record (`merge`)."""
    from simdist.cases.stdout import stdout_to_stderr as guard

    recorder = Recorder(promote=[tuple(k) for k in promote], ops=frozenset(ops))
    recorder.rank = rank
    try:
        with guard() if to_stderr else contextlib.nullcontext(), as_main(script, argv):
            execute(lambda: run_main(script), recorder)
    except SystemExit as exc:
        status, message = exit_status(exc)
        if status:
            return {"exit": (status, message)}
    return {
        "state": recorder.final_state(),  # first: it notes whether DTensor shards stood in (``sharded``)
        "sites": list(recorder.sites.values()),
        "promoted": recorder.promoted,
        "unpromotable": recorder.unpromotable,
        "sharded": recorder.sharded,
    }
