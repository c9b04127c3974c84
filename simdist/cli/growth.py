"""``simdist growth --out DIR``: the growth study (`simdist.studies.growth`); its options are
`simdist.cli.configs.GrowthCommand`'s, whose ``study`` section is `simdist.studies.growth.GrowthConfig`."""

from __future__ import annotations

import json

from simdist.cli.configs import GrowthCommand
from simdist.cli.policies import load_policy_modules, policy_list


def run_growth_command(command: GrowthCommand) -> int:
    """Check the sizes and ``--out``, run (or reuse) the study, print one line per policy; 0."""
    from simdist.cli.inputs import check_growth_out
    from simdist.cli.limits import check_run, growth_estimate
    from simdist.studies.growth import FILES, run_growth

    load_policy_modules(command.policy_module)
    config = command.study
    names = policy_list(config.policies)
    spec = config.spec
    estimate = growth_estimate(spec.world_size, config.steps, config.seeds, len(names), config.source)
    check_run(
        {
            "world_size": spec.world_size,
            "tp": spec.tp,
            "ep": spec.ep,
            "steps": config.steps,
            "seeds": config.seeds,
            "seed": config.seed,
            "gas": config.gas,
            "checkpoint_every": config.checkpoint_every,
        },
        estimate,
    )
    config.validate()  # layout and source constraints, before anything is written
    out = command.out
    check_growth_out(out, FILES, command.force)
    reused = not command.force and _finished(config, out, FILES)
    summary = run_growth(config, out, force=command.force, progress=not command.no_progress)
    for name, info in summary["policies"].items():
        print(f"{name}: {_growth_line(info, config.source == 'moe')}")
    files = f"{out}/{FILES['metrics']}, {out}/{FILES['plot']} and {out}/{FILES['summary']}"
    if reused:
        print(f"reused: the run in {out} was already complete ({files} unchanged; --force recomputes it)")
    else:
        print(f"wrote {files}")
    return 0


def _growth_line(info: dict, moe: bool) -> str:
    """One policy's final errors and growth exponent, as the summary holds them."""
    from simdist.studies.growth.plot import MOE_BASELINE

    final = info["final_median"]
    exponent = info.get("master_rel_growth_exponent", info.get("param_rel_growth_exponent"))
    if info["bitwise_equal_to_oracle"]:  # for source moe: to the matched FP32 policy (the summary's one key)
        baseline = MOE_BASELINE if moe else "the oracle"
        return f"bitwise equal to {baseline} (error exactly 0 at every step and seed)"
    if moe:
        growth = (
            f"bf16 weights rel {final['param_rel']:.3e} (max {final['param_ulp_max']:.0f} bf16 ulp), "
            f"|loss - matched loss| {final['loss_diff']:.3e} (max over steps {info['max_loss_diff']:.3e})"
        )
        if exponent is not None:
            growth += f", weights growth ~ t^{exponent:.2f}"
        return growth
    growth = (
        f"master rel {final['master_rel']:.3e} ({final['master_ulp_gmean']:.3g} ulp geo-mean), "
        f"adam m rel {final['adam_m_rel']:.3e}, adam v rel {final['adam_v_rel']:.3e}"
    )
    if exponent is not None:
        growth += f", master growth ~ t^{exponent:.2f}"
    return growth


def _finished(config, out: str, files: dict[str, str]) -> bool:
    """Whether ``out`` already holds this finished run (same configuration, a summary): `run_growth` reuses it."""
    from pathlib import Path

    path = Path(out)
    try:
        same = json.loads((path / files["config"]).read_text()) == config.identity()
    except (OSError, ValueError):
        return False
    return same and (path / files["summary"]).is_file()
