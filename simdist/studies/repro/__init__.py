"""Reproduce DeepSpeed #8913 in the simulator: each policy against the FP32 oracle, tensor by tensor.

TP4/EP2/ETP1 on 8 simulated ranks by default (`REPRO_SPEC`: TP4 x DP2, EP2 x EDP4,
so every group kind differs and a group mix-up or a BF16 TP sum changes bits), 3 BF16
updates, seeded local gradients from the ``rounding`` distribution
(`simdist.sources.synthetic.Inputs`: sums round, so order, group and dtype show) that
differ between TP peers for the router (identical peers hide the defect), every
parameter family present. For every tensor of every rank
-- local gradient, corrected gradient, high-precision gradient, FP32 master,
Adam m and v, over all steps -- the report says whether it is bitwise equal to
the oracle, the largest ulp difference and the fraction of differing elements;
then each policy's chains, the first divergent stage per parameter, and a
verdict computed from those comparisons, with the power checks (`simdist.studies.power`)
that prove the inputs and layout could see a wrong order, group or dtype.

This module runs the study (`reproduce`: the oracle, each policy, the comparisons); `config` holds what to run
(`ReproConfig`, the ``simdist repro`` command line's configuration tree) and what a comparison records,
`verdict` the findings and power checks computed from the comparisons, `report` the text and JSON.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from simdist.errors import coerce
from simdist.gradpath.oracle import Control, oracle_traces
from simdist.gradpath.path import PathConfig, train_rank
from simdist.gradpath.policy import Policy
from simdist.gradpath.probes import Trace, first_divergence, path_order
from simdist.numerics.compare import Pair, compare
from simdist.policies.catalogue import get_policy
from simdist.reduce import Reduction, make_reduction
from simdist.sources import GradientSource
from simdist.sources.synthetic import DEFAULT_PARAMS, InitialWeights, Inputs, synthetic_gradients
from simdist.studies.power import PowerCheck, power_checks
from simdist.studies.repro.config import (
    COMPARED,
    EXPECTATIONS,
    GRADIENT_STAGES,
    ORACLE_SUMMARY,
    REPRO_SPEC,
    Code,
    PolicyReport,
    ReproConfig,
    Row,
)
from simdist.studies.repro.report import format_report, to_json
from simdist.studies.repro.verdict import (
    CORRECTION_MARKER,
    POWER_STAGES,
    WRITEBACK,
    ExactDistance,
    Finding,
    Verdict,
    exact_distances,
    findings,
    meets,
    with_power,
)
from simdist.world.simworld import SimWorld
from simdist.world.spec import ParallelSpec

__all__ = [
    "COMPARED",
    "CORRECTION_MARKER",
    "EXPECTATIONS",
    "ORACLE_SUMMARY",
    "REPRO_SPEC",
    "WRITEBACK",
    "Code",
    "ExactDistance",
    "Finding",
    "PolicyReport",
    "ReproConfig",
    "Row",
    "Verdict",
    "compare_with_oracle",
    "findings",
    "format_report",
    "meets",
    "reproduce",
    "run",
    "run_count",
    "run_oracle",
    "to_json",
    "workload",
]


def workload(
    name: GradientSource | str, spec: ParallelSpec, seed: int, gas: int, inputs: Inputs | str = Inputs.ROUNDING
):
    """``(params, initial, gradients)`` of the gradient source ``name`` (synthetic gradients drawn from ``inputs``)."""
    if coerce(GradientSource, name, "source") == GradientSource.SYNTHETIC:
        return DEFAULT_PARAMS, InitialWeights(spec, seed), synthetic_gradients(spec, seed, inputs)
    from simdist.sources.moe import MoEGradients

    source = MoEGradients(spec, seed=seed, gas=gas)
    return tuple(source.params), source.initial, source


def run(
    spec: ParallelSpec,
    policy: Policy,
    config: PathConfig,
    reduction: Reduction,
    source: GradientSource | str = GradientSource.SYNTHETIC,
    inputs: Inputs | str = Inputs.ROUNDING,
) -> list[Trace]:
    """Every rank's trace of ``policy`` on ``spec`` in a SimWorld whose groups all use ``reduction``.

    ``source`` picks where the local gradients come from (`GradientSource`), ``inputs`` their distribution.
    """
    params, initial, grads = workload(source, spec, config.seed, config.gas, inputs)
    world = SimWorld(spec, reduction=reduction, timeout_s=None)  # a long study has no deadline
    return world.run(train_rank, list(params), initial, grads, policy, config)


def run_oracle(
    config: ReproConfig,
    reduction: Reduction,
    magnitudes: bool = False,
    control: Control | None = None,
    dtype: torch.dtype = torch.float32,
) -> list[Trace]:
    """The independent FP32 oracle (`simdist.gradpath.oracle`) on the run's workload: every group sums in
    ``reduction``'s order, the TP correction runs on every micro-step, the step is ``torch.optim.AdamW``'s.

    ``magnitudes`` runs it on ``|local gradients|`` (synthetic source only), which gives ``sum|terms|``;
    ``control`` runs it with one deliberate error (a power check); ``dtype`` is its staging, accumulation,
    reduction and master dtype (``float64``: the exact reference of `exact_distances`).
    """
    params, initial, grads = workload(config.source, config.spec, config.seed, config.gas, config.inputs)
    return oracle_traces(
        config.spec,
        list(params),
        initial,
        _Magnitudes(grads) if magnitudes else grads,
        steps=config.steps,
        gas=config.gas,
        tp_reduction=reduction,
        dp_reduction=reduction,
        control=control,
        dtype=dtype,
    )


def compare_with_oracle(traces: list[Trace], oracle: list[Trace], magnitudes: list[Trace] | None = None) -> list[Row]:
    """One `Row` per rank, parameter and tensor kind, pooled over steps and micro-steps.

    ``magnitudes`` are the oracle's traces on ``|local gradients|``: the oracle's gradient stages are linear
    in the local gradients (casts, sums, ``/tp``, ``+=``), so there they hold ``sum|terms|`` per element.
    """
    rows = []
    for index, (trace, reference) in enumerate(zip(traces, oracle, strict=True)):
        scale = magnitudes[index].values if magnitudes is not None else {}
        for param in trace.params():
            for stage in COMPARED:
                keys = [k for k in trace.values if k[2] == param and k[3] == stage and k in reference.values]
                if not keys:
                    continue
                sums = scale if stage in GRADIENT_STAGES else {}
                pairs: list[Pair] = [
                    (param, path_order(k), trace.values[k], reference.values[k], sums.get(k)) for k in keys
                ]
                rows.append(Row.of(trace.rank, param, stage.label, compare(pairs)))
    return rows


class _Magnitudes:
    """Local gradients as their absolute values: the oracle run on these gives ``sum|terms|``."""

    def __init__(self, grads) -> None:
        self.grads = grads

    def __call__(self, step: int, micro: int, rank: int, param) -> torch.Tensor:
        return self.grads(step, micro, rank, param).abs()


def reproduce(config: ReproConfig, progress: Callable[[str], None] | None = None) -> tuple[list[PolicyReport], Verdict]:
    """Run the oracle and every policy; return the per-policy reports and the verdict.

    ``progress`` (the CLI's bar) is called with a label after each run: the oracle, the |terms| run (synthetic
    source only) and each policy -- `run_count` calls in all.
    """
    done = progress or (lambda label: None)
    spec = config.spec
    policies = [get_policy(name) for name in config.policies]
    reduction = make_reduction(config.reduction)
    path = PathConfig(
        steps=config.steps, gas=config.gas, seed=config.seed, marker=config.marker, update_path=config.update_path
    )
    oracle = run_oracle(config, reduction)
    done("oracle")
    magnitudes = None
    if config.source == GradientSource.SYNTHETIC:  # a model's gradients depend on its weights: no |terms| run for it
        magnitudes = run_oracle(config, reduction, magnitudes=True)
        done("|terms|")
    families = {p.name: p.family for p in workload(config.source, spec, config.seed, config.gas, config.inputs)[0]}
    reports = []
    kept: dict[str, list[Trace]] = {}
    real = _real_traces(config)
    for policy in policies:
        traces = (
            real[policy.name]
            if real
            else run(spec, policy, path, reduction, source=config.source, inputs=config.inputs)
        )
        kept[policy.name] = traces
        rows = compare_with_oracle(traces, oracle, magnitudes)
        divergence = first_divergence(traces, oracle)
        done(policy.name)
        reports.append(
            PolicyReport(
                policy.name,
                policy.summary,
                {name: policy.chain(family, spec.tp) for name, family in families.items()},
                rows,
                {p: (str(d) if d else None) for p, d in divergence.items()},
                sorted({r.param for r in rows if not r.bitwise_equal}),
                divergence,
            )
        )
    verdict = findings(config, reports, families)
    power: tuple[PowerCheck, ...] = ()
    exact: tuple[ExactDistance, ...] = ()
    if config.source == GradientSource.SYNTHETIC:
        power = power_checks(spec, oracle, lambda control: run_oracle(config, reduction, control=control), POWER_STAGES)
        exact = exact_distances(run_oracle(config, reduction, dtype=torch.float64), {"oracle": oracle, **kept})
        done("power checks")
    return reports, replace(with_power(config, verdict, power), exact=exact)


def _real_traces(config: ReproConfig) -> dict[str, list[Trace]]:
    """The policies' traces from a real framework (``{}`` for the transcribed code)."""
    if config.code == Code.TRANSCRIBED:
        return {}
    from simdist.cases.deepspeed.issue_8913 import repro_traces

    return repro_traces(config)


def run_count(config: ReproConfig) -> int:
    """How many runs `reproduce` makes (its ``progress`` calls): the oracle, the |terms| run, the policies, the
    power checks (one call for all)."""
    return 1 + 2 * (config.source == GradientSource.SYNTHETIC) + len(config.policies)
