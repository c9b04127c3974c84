"""``simdist blame [options] SCRIPT [ARGS...]``: rank a script's call sites by rounding error, promote some.

The script either starts its ranks itself with `simdist.run` (as ``experiments/blame_8913.py`` does), or
is a ``torchrun``-style script run on ``--nproc N`` rank threads: its ``__main__`` runs once per rank with the
default group already initialised (its own ``dist.init_process_group`` and ``destroy_process_group`` calls
are then no-ops; ranks come from ``dist.get_rank()``, not from environment variables, which the threads
share). With ``--processes`` the ranks are processes instead (`simdist.attribution.processes`): scripts that
keep their groups in module globals (DeepSpeed, Megatron) need them.
"""

from __future__ import annotations

import contextlib
import os
import sys
import traceback

from simdist.cli.configs import BlameCommand
from simdist.cli.script import ScriptExit, as_main, check_script, exit_status, run_main
from simdist.errors import UsageError


class TorchrunStyle(UsageError):
    """A script that initialises the default group from torchrun's environment, run without ``--nproc``."""


def check_figure(path: str) -> None:
    """``ValueError`` unless ``path`` can take the figure: checked before the run, whose table would be lost."""
    from matplotlib.backend_bases import FigureCanvasBase

    if not path.strip():
        raise UsageError("--figure: expected a file path, got an empty one")
    ext = os.path.splitext(path)[1].lstrip(".").lower()
    formats = FigureCanvasBase.get_supported_filetypes()
    if ext and ext not in formats:
        known = ", ".join(sorted(formats))
        raise UsageError(f"--figure {path}: matplotlib writes no .{ext} files (use one of {known})")
    if os.path.isdir(path):
        raise UsageError(f"--figure {path}: is a directory")
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise UsageError(f"--figure {path}: no such directory {directory}")
    if not os.access(directory, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise UsageError(f"--figure {path}: not writable")


def _script_target(script: str, argv: tuple[str, ...], nproc: int | None):
    """The blamed run's body: the script as ``__main__`` once (``nproc`` ``None``: it starts its own ranks) or
    once per rank on ``nproc`` threads with the default group already initialised."""
    import torch.distributed as dist

    def run_script() -> None:
        try:
            run_main(script)
        except SystemExit as exc:
            status, message = exit_status(exc)
            if status:
                raise ScriptExit(status, message) from None

    def rank_main(rank: int) -> None:
        run_script()

    def target() -> None:
        saved_init, saved_destroy = dist.init_process_group, dist.destroy_process_group
        try:
            with as_main(script, argv):
                if nproc is None:

                    def init_outside_ranks(*args, **kwargs):
                        from simdist.world.threads.spawn import current

                        from_env = len(args) < 2 and not {"init_method", "store"} & set(kwargs)
                        missing = [v for v in ("RANK", "WORLD_SIZE") if v not in os.environ]
                        if current() is None and from_env and missing and "world_size" not in kwargs:
                            raise TorchrunStyle(
                                f"{script} calls dist.init_process_group() from torchrun's environment "
                                f"({', '.join(missing)} unset): a torchrun-style script; run it with --nproc N"
                            )
                        return saved_init(*args, **kwargs)

                    dist.init_process_group = init_outside_ranks
                    run_script()
                    return
                from simdist.world.runner import run

                def init_process_group(*args, **kwargs):
                    if not dist.is_initialized():
                        return saved_init(*args, **kwargs)
                    return None

                def destroy_process_group(group=None):
                    if group is not None:
                        return saved_destroy(group)
                    return None

                dist.init_process_group, dist.destroy_process_group = init_process_group, destroy_process_group
                run(rank_main, nproc)
        finally:
            dist.init_process_group, dist.destroy_process_group = saved_init, saved_destroy

    return target


def run_blame(command: BlameCommand) -> int:
    """Run ``command.script`` blamed and print the report; returns the script's exit status."""
    from simdist.attribution.api import SiteNotFound
    from simdist.cases.stdout import stdout_to_stderr
    from simdist.world.processes.supervise import RankFailure

    processes = _checked_where(command)
    guard = stdout_to_stderr() if command.json else contextlib.nullcontext(sys.stdout)
    try:
        with guard as out:
            report = _blame(command, processes)
            if command.figure:
                report.figure().savefig(command.figure, dpi=100)
            if command.json:
                print(report.to_json(), file=out)
    except RankFailure as exc:  # a rank raised: its traceback, named by rank
        print(exc, file=sys.stderr)
        return 1
    except ScriptExit as exc:
        if exc.message is not None:
            print(exc.message, file=sys.stderr)
        return exc.status
    except (SiteNotFound, TorchrunStyle):
        raise
    except Exception:
        traceback.print_exc()
        return 1
    if not command.json:
        print(f"simdist blame {command.script}")
        print(report.format(limit=command.top))
        if command.figure:
            print(f"wrote {command.figure}")
    return 0


def _checked_where(command: BlameCommand) -> bool:
    """Check the script, the figure path and the ops before the run; whether the ranks run as processes
    (``--processes``, or ``--nproc`` on a script that imports a framework with module-global groups)."""
    from simdist.attribution.arithmetic import op_names

    script = command.script
    check_script(script)
    if command.figure is not None:
        check_figure(command.figure)
    op_names(command.ops)  # an unknown op is bad input, before the run
    processes = command.processes
    if processes and command.nproc is None:
        raise UsageError("--processes runs the script on --nproc N rank processes: give --nproc")
    if command.nproc is not None and not processes:
        from simdist.attribution.processes import frameworks_of

        if frameworks_of(script):  # DeepSpeed's or Megatron's module-global groups: threads would share them
            print(
                f"simdist blame: {script} imports a framework with module-global process groups "
                "(DeepSpeed, Megatron-Core): its ranks run as processes (--processes)",
                file=sys.stderr,
            )
            processes = True
    return processes


def _blame(command: BlameCommand, processes: bool):
    """The blame report of ``command.script``: on rank processes, or on threads (one, or ``--nproc``)."""
    from simdist.attribution.api import blame_target

    script = command.script
    if processes:
        from simdist.attribution.processes import blame_processes

        assert command.nproc is not None  # --processes without --nproc was refused by _checked_where

        return blame_processes(
            script, list(command.script_args), command.nproc, promote=command.promote,
            promote_top=command.promote_top, ops=command.ops, stdout_to_stderr=command.json,
        )  # fmt: skip
    target = _script_target(script, command.script_args, command.nproc)
    return blame_target(target, promote=command.promote, promote_top=command.promote_top, ops=command.ops)
