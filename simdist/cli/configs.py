"""Each command's configuration tree: the one source of its options, their defaults and their help.

`simdist.cli.options.add_options` makes a command's argparse options from its dataclass here, and
`simdist.cli.options.from_args` builds the dataclass back from the parsed arguments; the command runs on the
dataclass. A study's own parameters are a *section* of its command (`ReproCommand.study` is
`simdist.studies.repro.ReproConfig`, `GrowthCommand.study` is `simdist.studies.growth.GrowthConfig`): the
study's defaults are the command line's. The fields' metadata keys are described in `simdist.cli.options`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from simdist.cases.ranks import CaseWhere
from simdist.reduce import ReductionName
from simdist.studies.growth import GrowthConfig
from simdist.studies.repro import EXPECTATIONS, ReproConfig
from simdist.world.options import DEFAULT_REDUCTION

KNOWN_ISSUES = ("8913",)
"""The issues ``simdist repro`` reproduces."""

assert EXPECTATIONS == ("reproduced", "fixed")  # the Literal below spells them out for the type checker

POLICY_MODULE = {
    "help": "load your own policies first: a .py file or a dotted module name that calls "
    "simdist.gradpath.policy.register(Policy(...)) (repeatable)",
    "repeat": True,
    "path": True,
    "metavar": "MODULE",
}
NO_PROGRESS = {"help": "no progress bar on stderr"}


@dataclass(frozen=True)
class ReproCommand:
    """``simdist repro ISSUE``: the study's configuration and how to report it."""

    issue: Literal["8913"] = field(default="8913", metadata={"positional": True, "help": "the issue to reproduce"})
    study: ReproConfig = field(default_factory=ReproConfig, metadata={"section": True})
    policy_module: tuple[str, ...] = field(default=(), metadata=POLICY_MODULE)
    no_progress: bool = field(default=False, metadata=NO_PROGRESS)
    expect: Literal["reproduced", "fixed"] | None = field(
        default=None,
        metadata={
            "help": "exit 1 unless the verdict is this one (reproduced: the #8913 writeback finding shows; fixed: "
            "every policy is bitwise equal to the oracle) and every applicable power check shows power"
        },
    )
    json: bool = field(default=False, metadata={"help": "print the report as JSON (every tensor)"})
    shape: str = field(
        default="toy",
        metadata={
            "help": "toy (simdist's synthetic parameters), production (one MoE layer of every model of "
            "simdist.sources.production at full router and norm size) or one catalogue model, e.g. Mixtral-8x7B"
        },
    )
    all_tensors: bool = field(
        default=False,
        metadata={
            "help": "list every compared tensor, equal ones too",
            "off": "--diff-only",
            "off_help": "list only the tensors that differ from the oracle (the default)",
        },
    )


@dataclass(frozen=True)
class GrowthCommand:
    """``simdist growth --out DIR``: the growth study's configuration and its run directory."""

    study: GrowthConfig = field(default_factory=GrowthConfig, metadata={"section": True})
    policy_module: tuple[str, ...] = field(default=(), metadata=POLICY_MODULE)
    out: str = field(
        default="",
        metadata={"required": True, "path": True, "help": "run directory (resumed if it holds a checkpoint)"},
    )
    force: bool = field(default=False, metadata={"help": "recompute a finished run"})
    no_progress: bool = field(default=False, metadata=NO_PROGRESS)


@dataclass(frozen=True)
class PoliciesCommand:
    """``simdist policies``."""

    policy_module: tuple[str, ...] = field(default=(), metadata=POLICY_MODULE)


@dataclass(frozen=True)
class CompareCommand:
    """``simdist compare DUMP_A DUMP_B``."""

    dump_a: str = field(
        default="", metadata={"positional": True, "path": True, "help": "a dump directory (rank*.safetensors)"}
    )
    dump_b: str = field(
        default="", metadata={"positional": True, "path": True, "help": "another dump directory of the same run"}
    )
    tolerance_ulp: int = field(
        default=0, metadata={"minimum": 0, "help": "largest ulp difference accepted (0: bitwise)"}
    )
    no_progress: bool = field(default=False, metadata={"help": "no progress indicator on stderr"})


@dataclass(frozen=True)
class RunCommand:
    """``simdist run --nproc N SCRIPT [ARGS...]``: an unmodified torchrun script on simdist rank processes."""

    nproc: int = field(default=1, metadata={"required": True, "minimum": 1, "help": "number of rank processes"})
    reduction: ReductionName = field(default=DEFAULT_REDUCTION, metadata={"help": "reduction of every group"})
    report_backend: bool = field(
        default=False, metadata={"help": "dist.get_backend() answers the name the script asked for"}
    )
    timeout: float = field(default=3600.0, metadata={"help": "stop the launch after this many seconds"})
    script: str = field(default="", metadata={"positional": True, "help": "the training script, as given to torchrun"})
    script_args: tuple[str, ...] = field(default=(), metadata={"remainder": True, "help": "the script's own arguments"})


@dataclass(frozen=True)
class AuditCommand:
    """``simdist audit SCRIPT [ARGS...]``."""

    json: bool = field(
        default=False, metadata={"help": "print the report as JSON on stdout (the script's own stdout goes to stderr)"}
    )
    skip: tuple[str, ...] = field(
        default=(),
        metadata={
            "repeat": True,
            "path": True,
            "metavar": "PREFIX",
            "help": "a module, package or path whose frames are not sites (repeatable)",
        },
    )
    no_errors: bool = field(default=False, metadata={"help": "do not compute rounding errors (faster)"})
    main_thread_only: bool = field(default=False, metadata={"help": "do not audit threads the script starts"})
    top: int | None = field(
        default=None, metadata={"minimum": 0, "metavar": "N", "help": "print only the N most frequent sites (N >= 0)"}
    )
    records: bool = field(default=False, metadata={"help": "with --json: include every raw record"})
    script: str = field(
        default="", metadata={"positional": True, "path": True, "help": "path of the Python script to run"}
    )
    script_args: tuple[str, ...] = field(
        default=(), metadata={"remainder": True, "metavar": "ARGS", "help": "arguments for the script"}
    )


def _nproc(text: str) -> int:
    import argparse

    from simdist.cli.options import int_at_least

    value = int_at_least(0)(text)
    if not 1 <= value <= 512:
        raise argparse.ArgumentTypeError(f"--nproc must be between 1 and 512, got {value}")
    return value


@dataclass(frozen=True)
class BlameCommand:
    """``simdist blame SCRIPT [ARGS...]``."""

    json: bool = field(default=False, metadata={"help": "print the report as JSON (the script's stdout -> stderr)"})
    top: int | None = field(
        default=None, metadata={"minimum": 0, "metavar": "N", "help": "print only the N first sites"}
    )
    promote: tuple[str, ...] = field(
        default=(),
        metadata={
            "repeat": True,
            "metavar": "SITE",
            "help": "rerun with SITE exact (a table id or file:line; repeatable, one rerun each)",
        },
    )
    promote_top: int = field(
        default=0, metadata={"minimum": 0, "metavar": "K", "help": "promote each of the K first sites"}
    )
    ops: str | None = field(
        default=None,
        metadata={
            "metavar": "OPS",
            "help": "also measure floating ops against FP64: 'all' or a comma-separated subset (add,mul,mm,bmm,"
            "addmm,sum,mean,_foreach_add,_fused_adamw,...); slower",
        },
    )
    figure: str | None = field(
        default=None, metadata={"metavar": "PNG", "help": "write the figure (error per site, error vs step) here"}
    )
    nproc: int | None = field(
        default=None,
        metadata={"parse": _nproc, "metavar": "N", "help": "run a torchrun-style SCRIPT on N simdist rank threads"},
    )
    processes: bool = field(
        default=False,
        metadata={
            "help": "with --nproc: run the N ranks as processes (process mode: module-global groups such as "
            "DeepSpeed's and Megatron's), merging each call site's records over the ranks; chosen by itself when "
            "the script imports deepspeed or megatron"
        },
    )
    script: str = field(default="", metadata={"positional": True, "help": "path of the Python script to run"})
    script_args: tuple[str, ...] = field(
        default=(), metadata={"remainder": True, "metavar": "ARGS", "help": "arguments for the script"}
    )


@dataclass(frozen=True)
class CaseRunCommand:
    """``simdist case run NAME``."""

    name: str = field(default="", metadata={"positional": True, "help": "a case name (see: simdist case list)"})
    where: CaseWhere = field(
        default="gloo",
        metadata={
            "help": "real gloo processes, the simdist backend in process mode, or simdist threads (cases whose "
            "framework allows it)"
        },
    )
    json: bool = field(default=False, metadata={"help": "print the verdict dataclass as JSON"})
    expect: Literal["ok", "not-ok"] = field(
        default="ok",
        metadata={
            "help": "the verdict the exit status gates on: ok (exit 1 when the case's ok is false) or not-ok (exit 1 "
            "when it is true, e.g. a run meant to show a defect)"
        },
    )


@dataclass(frozen=True)
class CaseListCommand:
    """``simdist case list``."""


@dataclass(frozen=True)
class CaseExportCommand:
    """``simdist case export production DIR``."""

    set: Literal["production"] = field(
        default="production",
        metadata={"positional": True, "help": "production: #8913, the ZeRO norm and the load defects"},
    )
    directory: str = field(
        default="", metadata={"positional": True, "help": "where to write one folder per defect (created if missing)"}
    )
    only: tuple[str, ...] = field(
        default=(), metadata={"repeat": True, "metavar": "NAME", "help": "one package (repeatable; default: all)"}
    )


@dataclass(frozen=True)
class DoctorCommand:
    """``simdist doctor``: no options."""
