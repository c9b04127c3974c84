"""``simdist repro 8913``: the #8913 study (`simdist.studies.repro`), or at production shapes
(`simdist.studies.production`) with ``--shape``; its options are `simdist.cli.configs.ReproCommand`'s."""

from __future__ import annotations

import json
from dataclasses import fields

from simdist.cli.configs import ReproCommand
from simdist.cli.policies import load_policy_modules, policy_list
from simdist.errors import UsageError

EXIT_OK, EXIT_DIFFERS = 0, 1


def run_repro(command: ReproCommand) -> int:
    """Run the study and print its report; 0, or 1 when ``--expect`` names a verdict the run does not meet."""
    from simdist.cli.limits import check_run, repro_estimate
    from simdist.studies.repro import format_report, meets, reproduce, to_json

    if command.shape != "toy":
        return _repro_production(command)
    load_policy_modules(command.policy_module)
    config = command.study
    names = policy_list(config.policies)
    spec = config.spec
    check_run(
        {
            "world_size": spec.world_size,
            "tp": spec.tp,
            "ep": spec.ep,
            "etp": spec.etp,
            "steps": config.steps,
            "gas": config.gas,
            "seed": config.seed,
        },
        repro_estimate(spec.world_size, config.steps, config.gas, len(names), config.source),
    )

    def status(reports, verdict) -> int:
        return EXIT_OK if command.expect is None or meets(command.expect, reports, verdict) else EXIT_DIFFERS

    if command.json:  # a real engine's logging (this process and its ranks) goes to stderr: stdout is the JSON
        from simdist.cases.stdout import stdout_to_stderr

        with stdout_to_stderr() as report:
            reports, verdict = _reproduce_with_bar(command, reproduce)
            data = to_json(config, reports, verdict)
            if command.expect is not None:
                data["expect"] = {"expected": command.expect, "met": meets(command.expect, reports, verdict)}
            print(json.dumps(data, indent=2), file=report)
        return status(reports, verdict)
    reports, verdict = _reproduce_with_bar(command, reproduce)
    print(format_report(config, reports, verdict, diff_only=not command.all_tensors))
    if command.expect is not None:
        met = meets(command.expect, reports, verdict)
        print(f"expect {command.expect}: {'met' if met else 'NOT met (exit status 1)'}")
    return status(reports, verdict)


UNSUPPORTED_AT_SHAPE = ("code", "source", "reduction", "update_path", "inputs")
"""The `ReproConfig` fields the production study (``--shape``) fixes at their defaults."""


def _repro_production(command: ReproCommand) -> int:
    """``repro 8913 --shape``: the production study; honours the layout, ``--steps``, ``--gas``, ``--seed``,
    ``--policies``, ``--marker``, ``--json`` and ``--expect``, and refuses the options it cannot honour."""
    from simdist.studies.production import meets, repro_production
    from simdist.studies.repro import ReproConfig

    config = command.study
    defaults = {f.name: f.default for f in fields(ReproConfig)}
    for name in UNSUPPORTED_AT_SHAPE:
        got, default = getattr(config, name), defaults[name]
        if got != default:
            option = "--" + name.replace("_", "-")
            raise UsageError(
                f"--shape {command.shape} runs the production study (the growth stream, gloo's order, the epilogue "
                f"path, simdist's transcription): {option} {got} is not supported there (leave it at {default}; "
                f"the real engine at production shapes is bench/production_engine.py)"
            )
    load_policy_modules(command.policy_module)
    policies = policy_list(config.policies)
    if command.expect == "reproduced" and "bf16_writeback" not in policies:
        raise UsageError("--expect reproduced needs bf16_writeback among --policies")
    text, rows = repro_production(
        command.shape,
        config.steps,
        config.seed,
        config.spec,
        command.json,
        not command.no_progress,
        gas=config.gas,
        policies=policies,
        marker=config.marker,
    )
    print(text)
    if command.expect is None:
        return EXIT_OK
    met = meets(command.expect, rows)
    if not command.json:
        print(f"expect {command.expect}: {'met' if met else 'NOT met (exit status 1)'}")
    return EXIT_OK if met else EXIT_DIFFERS


def _reproduce_with_bar(command: ReproCommand, reproduce):
    """``reproduce(config)`` with a progress bar on stderr (unless ``--no-progress``)."""
    from simdist.cli.progress import bar
    from simdist.studies.repro import run_count

    shown = bar(run_count(command.study), "repro 8913", unit="run", enabled=not command.no_progress)
    try:
        return reproduce(command.study, progress=(lambda label: shown.update(1)) if shown is not None else None)
    finally:
        if shown is not None:
            shown.close()
