"""The ``simdist`` command line.

    simdist repro 8913 [--world-size 8 --tp 4 --ep 2 --etp 1 --steps 3 --gas 1 --seed 0 --inputs rounding
                        --policies bf16_writeback,fp32_staging --marker deepspeed --update-path epilogue
                        --reduction gloo --model synthetic --json --expect reproduced|fixed]
    simdist policies [--policy-module my_policies.py]
    simdist compare DUMP_A DUMP_B [--tolerance-ulp 0]
    simdist audit [--json] path/to/script.py [args...]
    simdist blame [--json] [--promote SITE]... [--promote-top K] [--figure PNG]
                  [--nproc N [--processes]] script.py [args...]
    simdist growth --policies bf16_writeback,fp32_staging,bf16_only --steps 10000 --seeds 8 --out runs/NAME
                   [--model synthetic --seed 0 --gas 1 --marker deepspeed --checkpoint-every 500 --force]

Exit status (`EXIT_CODES`, also in every ``--help``): 0 ok / equal, 1 differs beyond the
tolerance (``compare``), the case's verdict is not ok (``case run``) or the verdict is not the one
``--expect`` names (``repro``, ``case run``; `EXPECT_CODES`), 2 bad input. Bad input
-- an unknown policy, an invalid layout, a size above its limit, a missing, unreadable or
corrupt file -- prints one line naming the file or option and what is wrong, never a
traceback, and writes nothing. ``audit`` exits with the audited script's own status. An
unexpected exception (a bug) prints its traceback and exits 3.
"""

from __future__ import annotations

import argparse
import contextlib
import enum
import json
import os
import sys
import traceback
from typing import TYPE_CHECKING, NoReturn

from simdist.errors import UsageError

if TYPE_CHECKING:
    from simdist.world.spec import ParallelSpec

# This module imports no torch (and nothing of simdist that does) at load: ``simdist --help``, ``--version`` and a
# mistyped command are answered by `_light_parser` alone; each command imports what it needs when it runs.

KNOWN_ISSUES = ("8913",)

COMMANDS: tuple[tuple[str, str], ...] = (
    ("repro", "reproduce a known precision issue in the simulator"),
    ("policies", "list the registered precision policies, their chains and origins"),
    ("compare", "compare two per-rank tensor dumps (experiments/crosscheck.py)"),
    ("audit", "run a Python script under the precision audit and report where it narrows precision"),
    ("blame", "rank a script's collective and cast sites by rounding error against the exact result; promote some"),
    ("run", "run an unmodified torchrun script on N simdist rank processes (like torchrun --nproc-per-node N)"),
    ("growth", "error growth of policies against the FP32 oracle over many steps"),
    ("case", "run a real framework next to simdist's policies (simdist/cases)"),
    ("doctor", "what this installation has: versions, the native fold kernel, the torch.distributed backend"),
)
"""The commands and their one-line help, in order: what ``simdist --help`` lists without building the full
parser (``tests/integration/test_light_import.py`` checks both parsers print the same help)."""

DESCRIPTION = "A single-process numerics lab for distributed training."

EXIT_OK, EXIT_DIFFERS, EXIT_BAD_INPUT, EXIT_BUG = 0, 1, 2, 3
EXIT_CODES = """exit status:
  0  ok: the run finished; for compare, every tensor is within the tolerance
  1  differs: compare found tensors beyond --tolerance-ulp; case run: the case's verdict is not ok
  2  bad input: unknown option or policy, invalid layout, a size above its limit, a missing,
     unreadable or corrupt file, an unusable --out (one line on stderr naming it; nothing written)
  3  internal error: an unexpected exception (a bug); its traceback is printed
  audit and blame exit with the script's own status instead (its sys.exit code and message)"""


EXPECT_CODES = """
  repro exits 0 whatever its verdict, unless --expect names one: then 1 when the verdict is not that one
  (reproduced: the #8913 writeback finding shows; fixed: every policy bitwise equal to the oracle) or a
  power check shows no power; case run --expect not-ok exits 1 when the case's verdict IS ok"""


class _Parser(argparse.ArgumentParser):
    """Every (sub)command's parser: one-line errors with status 2, and the exit statuses after ``--help``.

    The epilog (`EXIT_CODES` unless a command gives its own) is printed as written, line by line; the
    description is wrapped as usual.
    """

    def __init__(self, *args, **kwargs) -> None:
        self._raw_epilog = kwargs.pop("epilog", None) or EXIT_CODES
        super().__init__(*args, **kwargs)

    def format_help(self) -> str:
        return f"{super().format_help().rstrip()}\n\n{self._raw_epilog}\n"

    def error(self, message: str) -> NoReturn:  # one line, exit status 2
        self.exit(EXIT_BAD_INPUT, f"simdist: error: {message}\n")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    from simdist import DISTRIBUTION

    try:
        return version(DISTRIBUTION)
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


class _Version(argparse.Action):
    """``--version``, looked up only when asked for (`importlib.metadata` is a tenth of ``--help``'s time)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None) -> None:
        super().__init__(option_strings=option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser: argparse.ArgumentParser, namespace, values, option_string=None) -> NoReturn:
        print(f"simdist {_version()}")
        parser.exit()


def _int_at_least(minimum: int, what: str):
    """An argparse type: an integer >= ``minimum``, with a one-line error naming ``what`` it must be."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a {what} integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected a {what} integer, got {value}")
        return value

    return parse


_positive = _int_at_least(1, "positive")
_non_negative = _int_at_least(0, "non-negative")


def _add_choice(
    parser: argparse.ArgumentParser, flag: str, choices: type[enum.Enum], default: enum.Enum, help: str, skip=()
) -> None:
    """An option whose choices are the values of the enum the configs take (minus ``skip``)."""
    values = [member.value for member in choices if member not in skip]
    parser.add_argument(flag, choices=values, default=default.value, help=help)


def _add_layout(parser: argparse.ArgumentParser, etp: bool, spec: ParallelSpec | None = None) -> None:
    """``--world-size --tp --ep`` (and ``--etp``), defaulting to ``spec`` (`DEFAULT_SPEC`: TP2/EP2/ETP1 on 4 ranks)."""
    from simdist.world.spec import DEFAULT_SPEC

    spec = spec or DEFAULT_SPEC
    parser.add_argument("--world-size", type=_positive, default=spec.world_size)
    parser.add_argument("--tp", type=_positive, default=spec.tp)
    parser.add_argument("--ep", type=_positive, default=spec.ep)
    if etp:
        parser.add_argument("--etp", type=_positive, default=spec.etp)


def _light_parser() -> argparse.ArgumentParser:
    """``simdist`` with each command's name and help but none of its options: enough to answer ``--help``,
    ``--version`` and a mistyped command, fast, without importing torch; `build_parser` does the rest."""
    parser = _Parser(prog="simdist", description=DESCRIPTION)
    parser.add_argument("--version", action=_Version, help="show program's version number and exit")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name, text in COMMANDS:
        sub.add_parser(name, help=text, add_help=False)
    return parser


def build_parser() -> argparse.ArgumentParser:
    """The full parser: every command with its options (imports the enums and defaults the options take)."""
    from simdist.attribution.cli import add_blame_subcommand
    from simdist.audit import add_audit_subcommand
    from simdist.cases.cli import add_case_subcommand
    from simdist.cli.inputs import path_argument
    from simdist.gradpath.kernel import Marker, UpdatePath
    from simdist.models import GradientModel
    from simdist.models.synthetic import Inputs
    from simdist.reduce import Reduction
    from simdist.studies.repro import EXPECTATIONS, REPRO_SPEC, Engine
    from simdist.world.options import DEFAULT_REDUCTION

    parser = _Parser(prog="simdist", description=DESCRIPTION)
    parser.add_argument("--version", action=_Version, help="show program's version number and exit")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    helps = dict(COMMANDS)

    repro = sub.add_parser("repro", help=helps["repro"], epilog=EXIT_CODES + EXPECT_CODES)
    repro.add_argument("issue", choices=KNOWN_ISSUES, help="the issue to reproduce")
    _add_layout(repro, etp=True, spec=REPRO_SPEC)  # TP4/EP2 on 8 ranks: every group kind differs
    repro.add_argument("--steps", type=_positive, default=3, help="optimizer steps (default 3)")
    repro.add_argument("--gas", type=_positive, default=1, help="gradient-accumulation micro-steps per step")
    repro.add_argument("--seed", type=int, default=0)
    repro.add_argument("--policies", default="bf16_writeback,fp32_staging", help="comma-separated policy names")
    _add_policy_module(repro)
    repro.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    _add_choice(
        repro,
        "--marker",
        Marker,
        Marker.DEEPSPEED,
        "when the correction-once marker is cleared: as DeepSpeed 0.19.8 does on the chosen update path, or "
        "every micro-step",
    )
    _add_choice(
        repro,
        "--update-path",
        UpdatePath,
        UpdatePath.EPILOGUE,
        "when _update_hp_grad runs: after backward (default) or from gradient hooks (immediate_grad_update)",
    )
    _add_choice(
        repro,
        "--reduction",
        Reduction,
        DEFAULT_REDUCTION,
        "reduction model of every group (default: gloo's order, the launchers' one default)",
        skip=(Reduction.UPCAST,),
    )
    _add_choice(
        repro,
        "--model",
        GradientModel,
        GradientModel.SYNTHETIC,
        "where local gradients come from: seeded synthetic ones (default) or the folded MoE block",
    )
    _add_choice(
        repro,
        "--engine",
        Engine,
        Engine.TRANSCRIBED,
        "simdist's transcription (default) or DeepSpeed's real BF16_Optimizer on 4 gloo processes "
        "(bf16_writeback = as shipped, fp32_staging = with the #8913 fix; gradients only)",
    )
    _add_choice(
        repro,
        "--inputs",
        Inputs,
        Inputs.ROUNDING,
        "distribution of the synthetic local gradients: rounding (31 binades, per-rank magnitudes: sums round, "
        "so order, group and dtype show; default) or narrow (the old 7 binades, whose sums are mostly exact)",
    )
    repro.add_argument(
        "--expect",
        choices=EXPECTATIONS,
        help="exit 1 unless the verdict is this one (reproduced: the #8913 writeback finding shows; fixed: every "
        "policy is bitwise equal to the oracle) and every applicable power check shows power",
    )
    repro.add_argument("--json", action="store_true", help="print the report as JSON (every tensor)")
    repro.add_argument(
        "--shape",
        default="toy",
        help="toy (default: simdist's synthetic parameters), production (one MoE layer of every model of "
        "simdist.models.production at full router and norm size) or one catalogue model, e.g. Mixtral-8x7B",
    )
    diff = repro.add_mutually_exclusive_group()
    diff.add_argument(
        "--diff-only",
        dest="all_tensors",
        action="store_false",
        default=False,
        help="list only the tensors that differ from the oracle (the default)",
    )
    diff.add_argument(
        "--all-tensors", dest="all_tensors", action="store_true", help="list every compared tensor, equal ones too"
    )

    policies = sub.add_parser("policies", help=helps["policies"])
    _add_policy_module(policies)

    compare = sub.add_parser("compare", help=helps["compare"])
    compare.add_argument("dump_a", type=path_argument, help="a dump directory (rank*.safetensors)")
    compare.add_argument("dump_b", type=path_argument, help="another dump directory of the same run")
    compare.add_argument(
        "--tolerance-ulp", type=_non_negative, default=0, help="largest ulp difference accepted (default 0: bitwise)"
    )
    compare.add_argument("--no-progress", action="store_true", help="no progress indicator on stderr")
    add_audit_subcommand(sub)
    add_blame_subcommand(sub)
    _add_growth_subcommand(sub)
    add_case_subcommand(sub)
    sub.add_parser("doctor", help=helps["doctor"])
    return parser


def _add_policy_module(parser: argparse.ArgumentParser) -> None:
    from simdist.cli.inputs import path_argument

    parser.add_argument(
        "--policy-module",
        action="append",
        type=path_argument,
        default=[],
        metavar="MODULE",
        help="load your own policies first: a .py file or a dotted module name that calls "
        "simdist.gradpath.policy.register(Policy(...)) (repeatable)",
    )


def _load_policy_modules(args: argparse.Namespace) -> None:
    from simdist.policies.catalogue import load_policy_module

    for source in args.policy_module:
        load_policy_module(source)


def _policy_list(text: str) -> tuple[str, ...]:
    from simdist.policies.catalogue import get_policy

    names = tuple(n.strip() for n in text.split(",") if n.strip())
    if not names:
        raise UsageError("--policies needs at least one policy name")
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise UsageError(f"--policies {text}: {', '.join(map(repr, twice))} listed more than once (each runs once)")
    for name in names:
        get_policy(name)  # a ValueError names the valid policies
    return names


def _add_growth_subcommand(sub) -> None:
    from simdist.cli.inputs import path_argument
    from simdist.gradpath.kernel import Marker
    from simdist.models import GradientModel

    launch = sub.add_parser("run", help=dict(COMMANDS)["run"])
    launch.add_argument("--nproc", type=_positive, required=True, help="number of rank processes")
    launch.add_argument("--reduction", default="gloo", help="reduction model of every group (default gloo)")
    launch.add_argument(
        "--report-backend", action="store_true", help="dist.get_backend() answers the name the script asked for"
    )
    launch.add_argument("--timeout", type=float, default=3600.0, help="stop the launch after this many seconds")
    launch.add_argument("script", help="the training script, as given to torchrun")
    launch.add_argument("script_args", nargs=argparse.REMAINDER, help="the script's own arguments")

    growth = sub.add_parser("growth", help=dict(COMMANDS)["growth"])
    growth.add_argument(
        "--policies", default="bf16_writeback,fp32_staging,bf16_only", help="comma-separated policy names"
    )
    _add_policy_module(growth)
    growth.add_argument("--steps", type=_positive, default=10_000, help="optimizer steps (default 10000)")
    growth.add_argument("--seeds", type=_positive, default=8, help="ensemble size, run batched (default 8)")
    growth.add_argument("--seed", type=int, default=0, help="first seed of the ensemble")
    growth.add_argument("--gas", type=_positive, default=1, help="gradient-accumulation micro-steps per step")
    _add_choice(
        growth,
        "--marker",
        Marker,
        Marker.DEEPSPEED,
        "when the correction-once marker is cleared (matters for --gas >= 2)",
    )
    _add_choice(
        growth,
        "--model",
        GradientModel,
        GradientModel.SYNTHETIC,
        "gradient source: the synthetic stream (batched over seeds) or the folded MoE block "
        "(each seed and policy run in turn next to the FP32 oracle; resumes per run)",
    )
    _add_layout(growth, etp=False)
    growth.add_argument("--checkpoint-every", type=_positive, default=500, help="steps between checkpoints")
    growth.add_argument(
        "--metrics-dense",
        type=_non_negative,
        default=1000,
        help="record the metrics at every step up to this one (default 1000; synthetic model)",
    )
    growth.add_argument(
        "--metrics-every",
        type=_positive,
        default=10,
        help="after --metrics-dense, record them every this many steps, and the last (default 10; 1: every step)",
    )
    growth.add_argument(
        "--out", required=True, type=path_argument, help="run directory (resumed if it holds a checkpoint)"
    )
    growth.add_argument("--force", action="store_true", help="recompute a finished run")
    growth.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")


def _growth(args: argparse.Namespace) -> int:
    from simdist.cli.inputs import check_growth_out
    from simdist.cli.limits import check_run, growth_estimate
    from simdist.studies.growth import FILES, GrowthConfig, run_growth
    from simdist.world.spec import ParallelSpec

    _load_policy_modules(args)
    names = _policy_list(args.policies)
    estimate = growth_estimate(args.world_size, args.steps, args.seeds, len(names), args.model)
    check_run(
        {
            "world_size": args.world_size,
            "tp": args.tp,
            "ep": args.ep,
            "steps": args.steps,
            "seeds": args.seeds,
            "seed": args.seed,
            "gas": args.gas,
            "checkpoint_every": args.checkpoint_every,
        },
        estimate,
    )
    config = GrowthConfig(
        policies=names,
        steps=args.steps,
        seeds=args.seeds,
        seed=args.seed,
        gas=args.gas,
        marker=args.marker,
        model=args.model,
        spec=ParallelSpec(args.world_size, tp=args.tp, ep=args.ep),  # a ValueError names the broken constraint
        checkpoint_every=args.checkpoint_every,
        metrics_dense=args.metrics_dense,
        metrics_every=args.metrics_every,
    )
    config.validate()  # layout and model constraints, before anything is written
    check_growth_out(args.out, FILES, args.force)
    reused = not args.force and _finished(config, args.out, FILES)
    summary = run_growth(config, args.out, force=args.force, progress=not args.no_progress)
    for name, info in summary["policies"].items():
        final = info["final_median"]
        exponent = info.get("master_rel_growth_exponent", info.get("param_rel_growth_exponent"))
        if info["bitwise_equal_to_oracle"]:
            growth = "bitwise equal to the oracle (error exactly 0 at every step and seed)"
        elif args.model == "moe":
            growth = (
                f"bf16 weights rel {final['param_rel']:.3e} (max {final['param_ulp_max']:.0f} bf16 ulp), "
                f"|loss - oracle loss| {final['loss_diff']:.3e} (max over steps {info['max_loss_diff']:.3e})"
            )
            if exponent is not None:
                growth += f", weights growth ~ t^{exponent:.2f}"
        else:
            growth = (
                f"master rel {final['master_rel']:.3e} ({final['master_ulp_gmean']:.3g} ulp geo-mean), "
                f"adam m rel {final['adam_m_rel']:.3e}, adam v rel {final['adam_v_rel']:.3e}"
            )
            if exponent is not None:
                growth += f", master growth ~ t^{exponent:.2f}"
        print(f"{name}: {growth}")
    files = f"{args.out}/{FILES['metrics']}, {args.out}/{FILES['plot']} and {args.out}/{FILES['summary']}"
    if reused:
        print(f"reused: the run in {args.out} was already complete ({files} unchanged; --force recomputes it)")
    else:
        print(f"wrote {files}")
    return EXIT_OK


def _finished(config, out: str, files: dict[str, str]) -> bool:
    """Whether ``out`` already holds this finished run (same configuration, a summary): `run_growth` reuses it."""
    from pathlib import Path

    path = Path(out)
    try:
        same = json.loads((path / files["config"]).read_text()) == config.identity()
    except (OSError, ValueError):
        return False
    return same and (path / files["summary"]).is_file()


def _repro(args: argparse.Namespace) -> int:
    from simdist.cli.limits import check_run, repro_estimate
    from simdist.studies.repro import ReproConfig, format_report, meets, reproduce, run_count, to_json
    from simdist.world.spec import ParallelSpec

    if args.shape != "toy":
        return _repro_production(args)
    _load_policy_modules(args)
    names = _policy_list(args.policies)
    check_run(
        {
            "world_size": args.world_size,
            "tp": args.tp,
            "ep": args.ep,
            "etp": args.etp,
            "steps": args.steps,
            "gas": args.gas,
            "seed": args.seed,
        },
        repro_estimate(args.world_size, args.steps, args.gas, len(names), args.model),
    )
    config = ReproConfig(
        spec=ParallelSpec(args.world_size, tp=args.tp, ep=args.ep, etp=args.etp),  # ValueError names the constraint
        steps=args.steps,
        gas=args.gas,
        seed=args.seed,
        policies=names,
        marker=args.marker,
        reduction=args.reduction,
        update_path=args.update_path,
        model=args.model,
        engine=args.engine,
        inputs=args.inputs,
    )

    def status(reports, verdict) -> int:
        return EXIT_OK if args.expect is None or meets(args.expect, reports, verdict) else EXIT_DIFFERS

    if args.json:  # a real engine's logging (this process and its ranks) goes to stderr: stdout is the JSON
        from simdist.cases.stdout import stdout_to_stderr

        with stdout_to_stderr() as report:
            reports, verdict = _reproduce_with_bar(config, args, reproduce, run_count)
            data = to_json(config, reports, verdict)
            if args.expect is not None:
                data["expect"] = {"expected": args.expect, "met": meets(args.expect, reports, verdict)}
            print(json.dumps(data, indent=2), file=report)
        return status(reports, verdict)
    reports, verdict = _reproduce_with_bar(config, args, reproduce, run_count)
    print(format_report(config, reports, verdict, diff_only=not args.all_tensors))
    if args.expect is not None:
        met = meets(args.expect, reports, verdict)
        print(f"expect {args.expect}: {'met' if met else 'NOT met (exit status 1)'}")
    return status(reports, verdict)


def _repro_production(args: argparse.Namespace) -> int:
    """``repro 8913 --shape``: the production study; honours the layout, ``--steps``, ``--gas``, ``--seed``,
    ``--policies``, ``--marker``, ``--json`` and ``--expect``, and refuses the options it cannot honour."""
    from simdist.gradpath.kernel import UpdatePath
    from simdist.models import GradientModel
    from simdist.models.synthetic import Inputs
    from simdist.studies.production import meets, repro_production
    from simdist.studies.repro import Engine
    from simdist.world.options import DEFAULT_REDUCTION
    from simdist.world.spec import ParallelSpec

    unsupported = {
        "--engine": (args.engine, Engine.TRANSCRIBED),
        "--model": (args.model, GradientModel.SYNTHETIC),
        "--reduction": (args.reduction, DEFAULT_REDUCTION),
        "--update-path": (args.update_path, UpdatePath.EPILOGUE),
        "--inputs": (args.inputs, Inputs.ROUNDING),
    }
    for option, (got, default) in unsupported.items():
        if got != default:
            raise UsageError(
                f"--shape {args.shape} runs the production study (the growth stream, gloo's order, the epilogue "
                f"path, simdist's transcription): {option} {got} is not supported there (leave it at {default}; "
                f"the real engine at production shapes is bench/production_engine.py)"
            )
    _load_policy_modules(args)
    policies = _policy_list(args.policies)
    if args.expect == "reproduced" and "bf16_writeback" not in policies:
        raise UsageError("--expect reproduced needs bf16_writeback among --policies")
    spec = ParallelSpec(args.world_size, tp=args.tp, ep=args.ep, etp=args.etp)
    text, rows = repro_production(
        args.shape,
        args.steps,
        args.seed,
        spec,
        args.json,
        not args.no_progress,
        gas=args.gas,
        policies=policies,
        marker=args.marker,
    )
    print(text)
    if args.expect is None:
        return EXIT_OK
    met = meets(args.expect, rows)
    if not args.json:
        print(f"expect {args.expect}: {'met' if met else 'NOT met (exit status 1)'}")
    return EXIT_OK if met else EXIT_DIFFERS


def _reproduce_with_bar(config, args: argparse.Namespace, reproduce, run_count):
    """``reproduce(config)`` with a progress bar on stderr (unless ``--no-progress``)."""
    from simdist.cli.progress import bar

    shown = bar(run_count(config), "repro 8913", unit="run", enabled=not args.no_progress)
    try:
        return reproduce(config, progress=(lambda label: shown.update(1)) if shown is not None else None)
    finally:
        if shown is not None:
            shown.close()


def _compare(args: argparse.Namespace) -> int:
    """Exit 0 when every tensor is within the tolerance, 1 when some is not, 2 when an input is unreadable or
    the dumps are not one run."""
    from safetensors import SafetensorError

    from simdist.cli.inputs import BadInput, check_dump
    from simdist.cli.progress import ticking
    from simdist.studies.dumps import compare_dumps, format_comparison

    check_dump(args.dump_a)
    check_dump(args.dump_b)
    try:
        with ticking("compare", enabled=not args.no_progress):
            result = compare_dumps(args.dump_a, args.dump_b, args.tolerance_ulp)  # NotSameRun: one-line ValueError
    except SafetensorError as exc:  # a tensor's data unreadable past a valid header
        raise BadInput(f"{args.dump_a} or {args.dump_b}: a rank file is corrupt ({exc})") from None
    print(format_comparison(result))
    return EXIT_OK if result.ok else EXIT_DIFFERS


def _policies(args: argparse.Namespace) -> int:
    from simdist.gradpath.families import Family
    from simdist.policies.catalogue import get_policy, policy_names, policy_origin

    _load_policy_modules(args)
    for name in policy_names():
        policy = get_policy(name)
        print(f"{name}: {policy.summary}")
        print(f"    from: {policy_origin(name)}")
        print(f"    router (AVERAGE, tp=2): {policy.chain(Family.ROUTER_GATE_REPLICATED, 2)}")
        print(f"    expert (/tp, tp=2):     {policy.chain(Family.EXPERT, 2)}")
    return EXIT_OK


def _doctor(args: argparse.Namespace) -> int:
    """One line per fact a bug report needs; the kernel line says when reductions run the slower eager path."""
    import platform

    import torch
    import torch.distributed as dist

    from simdist.reduce import native

    print(f"simdist {_version()}, Python {platform.python_version()}, torch {torch.__version__}")
    kernel = "native fold kernel: " + native.STATUS
    if not native.available():
        kernel += " -> reductions run the eager path (same bits, 5-8x slower)"
    print(kernel)
    registered = "SIMDIST" in dist.Backend._plugins
    print(f"torch.distributed backend 'simdist': {'registered' if registered else 'NOT registered'}")
    return EXIT_OK


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "run":
        from simdist.world.script_launch import launch

        return launch(
            args.script,
            args.script_args,
            args.nproc,
            reduction=args.reduction,
            report_backend=args.report_backend,
            timeout_s=args.timeout,
        )
    from simdist.attribution.cli import run_blame
    from simdist.audit import run_audit
    from simdist.cases.cli import run_case_command
    from simdist.cli.progress import ticking

    if args.command == "audit":
        return run_audit(args)
    if args.command == "blame":
        return run_blame(args)
    if args.command == "repro":
        return _repro(args)
    if args.command == "compare":
        return _compare(args)
    if args.command == "case":
        if getattr(args, "case_action", None) == "run" and not args.json:
            with ticking(f"case {args.name}"):
                return run_case_command(args)
        return run_case_command(args)
    if args.command == "growth":
        return _growth(args)
    if args.command == "doctor":
        return _doctor(args)
    return _policies(args)


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status (`EXIT_CODES`), also for argparse errors and ``--help``.

    Without ``argv`` this is the ``simdist`` process itself: Ctrl-C then ends it at once with one line and
    status 130 wherever the signal lands (`simdist.cli.interrupt`); with ``argv`` (a library call) Python's
    ``KeyboardInterrupt`` gives the same line and status."""
    if argv is None:
        from simdist.cli.interrupt import exit_on_interrupt

        exit_on_interrupt()
    try:
        return _main(argv)
    except KeyboardInterrupt:  # Ctrl-C while parsing or importing: one line, as during a run
        print("simdist: interrupted", file=sys.stderr)
        return 130


def _main(argv: list[str] | None) -> int:
    try:
        _light_parser().parse_known_args(argv)  # --help, --version, a mistyped command: answered without torch
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # --help, --version, a usage error (already printed on one line)
        return exc.code if isinstance(exc.code, int) else EXIT_BAD_INPUT
    try:
        return _dispatch(args)
    except UsageError as exc:  # what the user can fix: BadInput, SizeError, an unknown policy, a broken layout, ...
        message = " ".join(str(exc).split("\n")[0].split())
        print(f"simdist: error: {message}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except BrokenPipeError:  # stdout closed early (| head): stop quietly, as a killed-by-SIGPIPE tool would
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except OSError as exc:  # a file that cannot be read or written
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"simdist: error: {where}{exc.strerror or exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("simdist: interrupted", file=sys.stderr)
        return 130
    except Exception:
        traceback.print_exc()
        print("simdist: internal error (a bug in simdist: please report the traceback above)", file=sys.stderr)
        return EXIT_BUG
