"""The small commands: ``compare``, ``run`` and ``doctor`` (their options are `simdist.cli.configs`')."""

from __future__ import annotations

from simdist.cli.configs import CompareCommand, DoctorCommand, RunCommand

EXIT_OK, EXIT_DIFFERS = 0, 1


def run_compare(command: CompareCommand) -> int:
    """Exit 0 when every tensor is within the tolerance, 1 when some is not; a `simdist.cli.inputs.BadInput`
    (exit 2) when an input is unreadable or the dumps are not one run."""
    from safetensors import SafetensorError

    from simdist.cli.inputs import BadInput, check_dump
    from simdist.cli.progress import ticking
    from simdist.studies.dumps import compare_dumps, format_comparison

    check_dump(command.dump_a)
    check_dump(command.dump_b)
    try:
        with ticking("compare", enabled=not command.no_progress):
            result = compare_dumps(command.dump_a, command.dump_b, command.tolerance_ulp)
    except SafetensorError as exc:  # a tensor's data unreadable past a valid header
        raise BadInput(f"{command.dump_a} or {command.dump_b}: a rank file is corrupt ({exc})") from None
    print(format_comparison(result))
    return EXIT_OK if result.ok else EXIT_DIFFERS


def run_script_launch(command: RunCommand) -> int:
    """``simdist run``: the script on ``--nproc`` simdist rank processes; the launch's exit status."""
    from simdist.world.processes.script_launch import launch

    return launch(
        command.script,
        list(command.script_args),
        command.nproc,
        reduction=str(command.reduction),
        report_backend=command.report_backend,
        timeout_s=command.timeout,
    )


def run_doctor(version: str) -> int:
    """One line per fact a bug report needs; the kernel line says when reductions run the slower eager path."""
    import platform

    import torch
    import torch.distributed as dist

    from simdist.reduce import native

    print(f"simdist {version}, Python {platform.python_version()}, torch {torch.__version__}")
    available = native.available()  # loads the kernel (first use), which sets its STATUS
    kernel = "native fold kernel: " + native.STATUS
    if not available:
        kernel += " -> reductions run the eager path (same bits, 5-8x slower)"
    print(kernel)
    registered = "SIMDIST" in dist.Backend._plugins
    print(f"torch.distributed backend 'simdist': {'registered' if registered else 'NOT registered'}")
    return EXIT_OK


def run_doctor_command(command: DoctorCommand) -> int:
    """``simdist doctor`` (no options): `run_doctor` with this installation's version."""
    from simdist.cli import installed_version

    return run_doctor(installed_version())
