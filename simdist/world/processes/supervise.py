"""The launcher's side of a process launch while its ranks run: wait, stop on the first failure or the deadline.

`supervise` watches the rank processes and the files they leave in the launch's folder
(`simdist.world.processes.rank`): the first rank's traceback becomes `RankFailure`, a rank that died without one
is named with its exit code, and at the deadline each pending rank is asked for its Python stack
(`simdist.world.processes.rank.STACK_SIGNAL`) for the ``TimeoutError``'s message. After a launch
`kill_descendants` ends what a killed rank started, and `remove_build_locks_since` the C++-extension build
locks a rank killed mid-build leaves behind.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from pathlib import Path

from simdist.errors import SimdistRuntimeError
from simdist.world.processes.rank import STACK_SIGNAL


class RankFailure(SimdistRuntimeError):
    """A rank of a process launch raised; carries the rank and its formatted traceback."""

    def __init__(self, rank: int, world_size: int, remote_traceback: str, others: tuple[int, ...] = ()) -> None:
        also = f" (ranks {list(others)} failed after it)" if others else ""
        super().__init__(f"rank {rank} of {world_size} failed{also}:\n{remote_traceback}")
        self.rank = rank
        self.remote_traceback = remote_traceback


def supervise(procs: list, out: Path, timeout_s: float) -> None:
    """Wait for every child; raise on the first failure or at the deadline."""
    n = len(procs)
    deadline = time.monotonic() + timeout_s
    while True:
        errors = sorted(out.glob("rank*.err"), key=lambda p: p.stat().st_mtime_ns)
        if errors:
            time.sleep(0.05)  # let peers that fail in consequence report too
            errors = sorted(out.glob("rank*.err"), key=lambda p: p.stat().st_mtime_ns)
            ranks = [int(p.name[4:].split(".")[0]) for p in errors]
            raise RankFailure(ranks[0], n, errors[0].read_text(), tuple(ranks[1:]))
        for r, p in enumerate(procs):
            if p.exitcode not in (None, 0) and not (out / f"rank{r}.err").exists():
                raise RankFailure(r, n, f"process exited with code {p.exitcode} without a Python traceback")
        if all(p.exitcode == 0 for p in procs):
            return
        if time.monotonic() > deadline:
            pending = [r for r, p in enumerate(procs) if p.exitcode is None]
            stacks = _stacks_of(procs, pending, out)
            raise TimeoutError(
                f"ranks {pending} of {n} did not finish within {timeout_s:g} s; all ranks killed{stacks}"
            )
        time.sleep(0.005)


def kill_descendants(pid: int | None) -> None:
    """SIGKILL every descendant of ``pid`` (Linux: ``/proc/PID/task/*/children``); nothing elsewhere."""
    if pid is None:
        return
    for child in _children(pid):
        kill_descendants(child)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(child, signal.SIGKILL)


def _children(pid: int) -> list[int]:
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        with contextlib.suppress(OSError):
            found += [int(c) for c in task.read_text().split()]
    return found


def remove_build_locks_since(began: float) -> list[Path]:
    """Remove the torch C++-extension build locks created since ``began`` (wall clock), after this launch
    killed ranks: a rank killed while it compiled an op (DeepSpeed's CPU ops build on first use) leaves
    ``<build root>/<python>_<device>/<op>/lock`` (``$TORCH_EXTENSIONS_DIR/<op>/lock``) behind, and every
    later build of that op, in any process, would wait on it forever. Only locks this launch's ranks can have
    made are touched; each is named on stderr."""
    from torch.utils.cpp_extension import get_default_build_root

    chosen = os.environ.get("TORCH_EXTENSIONS_DIR")  # torch's own rule: <dir>/<op>, else <root>/<py>_<dev>/<op>
    root = Path(chosen or get_default_build_root())
    removed = []
    for lock in root.glob("*/lock" if chosen else "*/*/lock") if root.is_dir() else ():
        with contextlib.suppress(OSError):
            if lock.stat().st_mtime >= began - 1.0:
                lock.unlink()
                removed.append(lock)
                print(f"simdist: removed {lock}, left by a rank killed while it built a C++ extension", file=sys.stderr)
    return removed


def _stacks_of(procs: list, pending: list[int], out: Path, wait_s: float = 1.0) -> str:
    """Each pending rank's Python stack, innermost call last (asked for with `STACK_SIGNAL`), for the deadline's
    message: the rank's own line is in it, not only the frame it waits in."""
    if STACK_SIGNAL is None:
        return ""
    for r in pending:
        if procs[r].pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(procs[r].pid, STACK_SIGNAL)
    time.sleep(wait_s)  # faulthandler writes from the signal handler at once; the file may need a moment
    parts = []
    for r in pending:
        path = out / f"rank{r}.stack"
        text = path.read_text(errors="replace").strip() if path.exists() else ""
        if text:
            parts.append(f"\n--- rank {r} (most recent call first) ---\n{_trim_stack(text)}")
    return "".join(parts)


def _trim_stack(text: str, keep: int = 12) -> str:
    """faulthandler's dump of the rank's main thread, at most ``keep`` frames from the innermost."""
    block = text.split("\n\n")[0]
    for candidate in text.split("\n\n"):
        if "Current thread" in candidate or "most recent call first" in candidate:
            block = candidate
            break
    lines = block.splitlines()
    head, frames = lines[:1], lines[1:]
    if len(frames) > keep:
        frames = [*frames[:keep], f"  ... {len(frames) - keep} outer frames"]
    return "\n".join(head + frames)
