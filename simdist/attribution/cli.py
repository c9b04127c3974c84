"""``simdist blame [options] SCRIPT [ARGS...]``: rank a script's call sites by rounding error, promote some.

The script either starts its ranks itself with `simdist.run` (as ``experiments/blame_8913.py`` does), or
is a ``torchrun``-style script run on ``--nproc N`` rank threads: its ``__main__`` runs once per rank with the
default group already initialised (its own ``dist.init_process_group`` and ``destroy_process_group`` calls
are then no-ops; ranks come from ``dist.get_rank()``, not from environment variables, which the threads
share). With ``--processes`` the ranks are processes instead (`simdist.attribution.processes`): scripts that
keep their groups in module globals (DeepSpeed, Megatron) need them.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import runpy
import sys
import traceback

from simdist.audit.cli import exit_status
from simdist.errors import UsageError


class ScriptExit(Exception):
    """The script exited with a non-zero status (``sys.exit``)."""

    def __init__(self, status: int, message: str | None) -> None:
        super().__init__(message or f"exit status {status}")
        self.status = status
        self.message = message


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


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {value}")
    return value


def _nproc(text: str) -> int:
    value = _count(text)
    if not 1 <= value <= 512:
        raise argparse.ArgumentTypeError(f"--nproc must be between 1 and 512, got {value}")
    return value


def add_blame_subcommand(subparsers) -> argparse.ArgumentParser:
    """Add ``blame`` to a ``simdist`` sub-command table."""
    parser = subparsers.add_parser(
        "blame",
        help="rank a script's collective and cast sites by rounding error against the exact result; promote some",
        epilog="exit status: the script's own (sys.exit(n): n; an uncaught exception: 1, with its traceback);\n"
        "  2 when blame's own arguments are bad (no such script, a --promote naming no site)",
        description="Run SCRIPT under simdist blame: every reducing collective of the simdist backend is compared "
        "with the FP64 sum of the same inputs, every narrowing cast with its wide input, grouped by call site and "
        "ranked by error mass. --promote reruns the script with a site exact and reports how far the final "
        "parameters, optimizer state and loss move. Options go before SCRIPT.",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON (the script's stdout -> stderr)")
    parser.add_argument("--top", type=_count, default=None, metavar="N", help="print only the N first sites")
    parser.add_argument(
        "--promote",
        action="append",
        default=[],
        metavar="SITE",
        help="rerun with SITE exact (a table id or file:line; repeatable, one rerun each)",
    )
    parser.add_argument("--promote-top", type=_count, default=0, metavar="K", help="promote each of the K first sites")
    parser.add_argument(
        "--ops",
        default=None,
        metavar="OPS",
        help="also measure floating ops against FP64: 'all' or a comma-separated subset (add,mul,mm,bmm,addmm,"
        "sum,mean,_foreach_add,_fused_adamw,...); slower",
    )
    parser.add_argument("--figure", metavar="PNG", help="write the figure (error per site, error vs step) here")
    parser.add_argument(
        "--nproc", type=_nproc, default=None, metavar="N", help="run a torchrun-style SCRIPT on N simdist rank threads"
    )
    parser.add_argument(
        "--processes",
        action="store_true",
        help="with --nproc: run the N ranks as processes (process mode: module-global groups such as "
        "DeepSpeed's and Megatron's), merging each call site's records over the ranks; chosen by itself when "
        "the script imports deepspeed or megatron",
    )
    parser.add_argument("script", help="path of the Python script to run")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS", help="arguments for the script")
    return parser


def _script_target(script: str, argv: list[str], nproc: int | None):
    import torch.distributed as dist

    def run_main() -> None:
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as exc:
            status, message = exit_status(exc)
            if status:
                raise ScriptExit(status, message) from None

    def rank_main(rank: int) -> None:
        run_main()

    def target() -> None:
        saved_argv, saved_path = sys.argv, list(sys.path)
        saved_init, saved_destroy = dist.init_process_group, dist.destroy_process_group
        sys.argv = [script, *argv]
        sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
        try:
            if nproc is None:

                def init_outside_ranks(*args, **kwargs):
                    from simdist.world.inproc import current

                    from_env = len(args) < 2 and not {"init_method", "store"} & set(kwargs)
                    missing = [v for v in ("RANK", "WORLD_SIZE") if v not in os.environ]
                    if current() is None and from_env and missing and "world_size" not in kwargs:
                        raise TorchrunStyle(
                            f"{script} calls dist.init_process_group() from torchrun's environment "
                            f"({', '.join(missing)} unset): a torchrun-style script; run it with --nproc N"
                        )
                    return saved_init(*args, **kwargs)

                dist.init_process_group = init_outside_ranks
                run_main()
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
            sys.argv = saved_argv
            sys.path[:] = saved_path

    return target


def run_blame(args: argparse.Namespace) -> int:
    """Run ``args.script`` blamed and print the report; returns the script's exit status."""
    from simdist.attribution.api import SiteNotFound, blame_target
    from simdist.attribution.arithmetic import op_names
    from simdist.attribution.processes import ScriptExit as RankScriptExit
    from simdist.world.supervise import RankFailure

    script = args.script
    if not os.path.isfile(script):
        raise UsageError(f"no such script: {script!r}")
    if args.figure is not None:
        check_figure(args.figure)
    op_names(args.ops)  # an unknown op is bad input, before the run
    if args.processes and args.nproc is None:
        raise UsageError("--processes runs the script on --nproc N rank processes: give --nproc")
    if args.nproc is not None and not args.processes:
        from simdist.attribution.processes import frameworks_of

        if frameworks_of(script):  # DeepSpeed's or Megatron's module-global groups: threads would share them
            print(
                f"simdist blame: {script} imports a framework with module-global process groups "
                "(DeepSpeed, Megatron-Core): its ranks run as processes (--processes)",
                file=sys.stderr,
            )
            args.processes = True
    target = _script_target(script, args.script_args, args.nproc)
    redirect = contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext()
    try:
        with redirect:
            if args.processes:
                from simdist.attribution.processes import blame_processes

                report = blame_processes(
                    script, args.script_args, args.nproc, promote=args.promote, promote_top=args.promote_top,
                    ops=args.ops, stdout_to_stderr=args.json,
                )  # fmt: skip
            else:
                report = blame_target(target, promote=args.promote, promote_top=args.promote_top, ops=args.ops)
    except RankScriptExit as exc:
        if exc.message is not None:
            print(exc.message, file=sys.stderr)
        return exc.status
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
    if args.figure:
        report.figure().savefig(args.figure, dpi=100)
    if args.json:
        print(report.to_json())
    else:
        print(f"simdist blame {script}")
        print(report.format(limit=args.top))
        if args.figure:
            print(f"wrote {args.figure}")
    return 0
