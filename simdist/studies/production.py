"""The #8913 simulator study at production shapes: shipped (``bf16_writeback``) and the fix (``fp32_staging``)
next to the independent FP32 oracle, one MoE layer of each catalogue model, for many steps and several seeds.

Shapes come from `simdist.sources.production` (`layer_params`: routers and norms at full size). The training
is the growth study's: `simdist.gradpath.batched.BatchedPath` (the gradient path batched over ``[seed,
rank]``, bit-identical to `train_rank`) and the oracle `simdist.gradpath.oracle.Oracle` (FP32
TP-then-DP per-parameter reducer, TP correction every micro-step, ``torch.optim.AdamW``), fed the growth
stream `BatchedGradients` (BF16, ``randn * 1e-3 * 2**k``, ``k`` in ``[-3, 3]``; norms identical on TP peers,
routers each peer's own).

Per model, policy and family (`FamilyRow`): elements of the FP32 masters that differ from the oracle's after
the last step (mean over seeds), the max and median element-wise relative error there, the growth exponent of
the normwise relative error (log-log slope over steps >= steps/10, median over seeds) and the first step at
which some master differs from the oracle's by more than one BF16 ulp of the oracle's value (earliest over
seeds; ``None``: never).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from simdist.errors import UsageError
from simdist.gradpath.batched import BatchedPath, initial_buffer
from simdist.gradpath.families import Family, ParamSpec
from simdist.gradpath.kernel import Marker
from simdist.gradpath.oracle import Oracle
from simdist.gradpath.path import PathConfig
from simdist.policies.catalogue import get_policy
from simdist.reduce import make_reduction
from simdist.sources.production import CATALOGUE, get_shape, layer_params
from simdist.sources.synthetic import InitialWeights
from simdist.studies.growth.stream import BatchedGradients
from simdist.world.options import DEFAULT_REDUCTION
from simdist.world.spec import DEFAULT_SPEC, ParallelSpec

POLICIES = ("bf16_writeback", "fp32_staging")
"""DeepSpeed as shipped and with the #8913 fix."""


@dataclass
class FamilyRow:
    """One model, policy and family after the study (see the module docstring)."""

    model: str
    policy: str
    family: str
    elements: int
    """Elements of this family per rank."""
    differ: float
    """Mean over seeds of the master elements (all ranks) that differ from the oracle's at the last step."""
    max_rel: float
    median_rel: float
    growth_exponent: float | None
    first_step_over_bf16_ulp: int | None
    over_bf16_ulp: float
    """Mean over seeds of the master elements (all ranks) more than one BF16 ulp from the oracle's, last step."""


def bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """One BF16 ulp at ``|x|`` (FP64; the normal-range spacing ``2**(floor(log2|x|) - 7)``, the subnormal one
    below ``2**-126``)."""
    magnitude = x.double().abs().clamp_min(2.0**-126)
    return torch.exp2(torch.floor(torch.log2(magnitude)) - 7)


def _slices(params: tuple[ParamSpec, ...]) -> dict[Family, list[slice]]:
    out: dict[Family, list[slice]] = {}
    start = 0
    for p in params:
        n = math.prod(p.shape)
        out.setdefault(p.family, []).append(slice(start, start + n))
        start += n
    return out


def _family(flat: torch.Tensor, slices: list[slice]) -> torch.Tensor:
    return torch.cat([flat[..., s] for s in slices], dim=-1)


def study_model(
    name: str,
    steps: int,
    seeds: int,
    spec: ParallelSpec = DEFAULT_SPEC,
    seed: int = 0,
    params: tuple[ParamSpec, ...] | None = None,
    progress: Callable[[int], None] | None = None,
    gas: int = 1,
    policies: tuple[str, ...] = POLICIES,
    marker: Marker = Marker.DEEPSPEED,
) -> list[FamilyRow]:
    """Run the study for catalogue model ``name`` (``params``: another parameter set, e.g. a small one in tests).

    ``gas`` micro-steps per step (each drawn from the stream), ``policies`` by catalogue name, ``marker`` the
    paths' correction-once marker (the oracle corrects every micro-step: at ``gas >= 2`` with DeepSpeed's marker
    every policy also carries the marker defect)."""
    if steps < 1 or seeds < 1 or gas < 1:
        raise UsageError(f"steps, seeds and gas must be >= 1, got {steps}, {seeds} and {gas}")
    if not policies:
        raise UsageError("policies: name at least one")
    params = layer_params(get_shape(name)) if params is None else params
    seed_list = [seed + i for i in range(seeds)]
    stream = BatchedGradients(spec, params, seed_list)
    config = PathConfig(steps=steps, gas=gas, marker=marker)
    oracle, paths = _oracle_and_paths(spec, params, seed_list, policies, config)
    errors = _Errors(_slices(params), steps, len(paths), seeds)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for step in range(steps):
            drawn = [stream.draw(step, micro) for micro in range(gas)]

            def oracle_grads(micro: int, _lp, drawn=drawn) -> dict[str, torch.Tensor]:
                return drawn[micro]

            def path_grads(_step: int, micro: int, drawn=drawn) -> dict[str, torch.Tensor]:
                return drawn[micro]

            oracle.step(step, gas, oracle_grads)
            for path in paths:
                path.run_step(path_grads)
            errors.record(step, oracle.flat("master"), [path.path.master for path in paths])
            if progress is not None:
                progress(step + 1)
    finally:
        torch.set_num_threads(threads)
    return errors.rows(name, policies, [path.path.master for path in paths], oracle.flat("master"), steps)


def _oracle_and_paths(
    spec: ParallelSpec, params: tuple[ParamSpec, ...], seeds: list[int], policies: tuple[str, ...], config: PathConfig
) -> tuple[Oracle, list[BatchedPath]]:
    """The oracle and one batched gradient path per policy, from the same BF16 initial weights, all reducing in
    the default reduction's order."""
    initial = [InitialWeights(spec, s) for s in seeds]
    reduction = make_reduction(DEFAULT_REDUCTION)
    stacked = {
        (r, p.name): torch.stack([init(r, p).to(torch.bfloat16) for init in initial])
        for r in range(spec.world_size)
        for p in params
    }
    oracle = Oracle(spec, params, stacked, tp_reduction=reduction, dp_reduction=reduction)
    paths = [
        BatchedPath(
            spec,
            params,
            policy,
            config,
            initial_buffer(spec, params, initial, policy.grad_dtype),
            seeds,
            reduction=reduction,
        )
        for policy in (get_policy(n) for n in policies)
    ]
    return oracle, paths


class _Errors:
    """The masters' errors against the oracle's as the study runs, per policy, family and seed: the normwise
    relative error at the recorded steps (`record_steps`), and the first step some element is more than one BF16
    ulp off (checked every step until every seed has one)."""

    def __init__(self, slices: dict[Family, list[slice]], steps: int, policies: int, seeds: int) -> None:
        self.slices = slices
        self.families = list(slices)
        self.recorded = record_steps(steps)
        self.row_of = {int(t): i for i, t in enumerate(self.recorded)}
        self.rel = np.zeros((len(self.recorded), policies, len(self.families), seeds))
        self.first = np.zeros((policies, len(self.families), seeds), dtype=np.int64)  # 0: not yet

    def record(self, step: int, reference: torch.Tensor, masters: list[torch.Tensor]) -> None:
        """After 0-based ``step``: each policy's ``[seed, rank, N]`` masters against the oracle's ``reference``."""
        row = self.row_of.get(step + 1)
        first = self.first
        for j, master in enumerate(masters):
            for f, family in enumerate(self.families):
                if row is None and first[j, f].all():
                    continue
                got = _family(master, self.slices[family]).double()
                want = _family(reference, self.slices[family]).double()
                error = (got - want).abs()
                if row is not None:
                    norms = want.flatten(1).norm(dim=1).clamp_min(1e-300)
                    self.rel[row, j, f] = (error.flatten(1).norm(dim=1) / norms).numpy()
                if not first[j, f].all():
                    over = (error > bf16_ulp(want)).flatten(1).any(dim=1).numpy()
                    first[j, f] = np.where((first[j, f] == 0) & over, step + 1, first[j, f])

    def rows(
        self, name: str, policies: tuple[str, ...], masters: list[torch.Tensor], reference: torch.Tensor, steps: int
    ) -> list[FamilyRow]:
        """One `FamilyRow` per policy and family after the last step."""
        rows = []
        for j, master in enumerate(masters):
            for f, family in enumerate(self.families):
                got = _family(master, self.slices[family])
                want = _family(reference, self.slices[family])
                differ = (got.view(torch.int32) != want.view(torch.int32)).flatten(1).sum(dim=1).double().mean()
                relative = ((got.double() - want.double()).abs() / want.double().abs().clamp_min(1e-300)).flatten()
                median = np.median(self.rel[:, j, f], axis=1)
                late = (self.recorded >= max(10, steps // 10)) & (median > 0)
                slope = _slope(self.recorded[late], median[late]) if late.sum() >= 3 else None
                hits = self.first[j, f][self.first[j, f] > 0]
                beyond = (got.double() - want.double()).abs() > bf16_ulp(want)
                rows.append(
                    FamilyRow(
                        model=name,
                        policy=policies[j],
                        family=family.value,
                        elements=sum(s.stop - s.start for s in self.slices[family]),
                        differ=float(differ),
                        max_rel=float(relative.max()),
                        median_rel=float(relative.median()),
                        growth_exponent=slope,
                        first_step_over_bf16_ulp=int(hits.min()) if hits.size else None,
                        over_bf16_ulp=float(beyond.flatten(1).sum(dim=1).double().mean()),
                    )
                )
        return rows


def record_steps(steps: int) -> np.ndarray:
    """The 1-based steps whose normwise error is recorded: every step to 100, then every 10th, and the last."""
    dense = np.arange(1, min(steps, 100) + 1)
    sparse = np.arange(110, steps + 1, 10)
    return np.unique(np.concatenate([dense, sparse, [steps]]))


def _slope(x: np.ndarray, y: np.ndarray) -> float:
    return float(np.polyfit(np.log(x), np.log(y), 1)[0])


def study(
    models: list[str] | None = None,
    steps: int = 1000,
    seeds: int = 3,
    spec: ParallelSpec = DEFAULT_SPEC,
    progress: Callable[[str, int], None] | None = None,
) -> list[FamilyRow]:
    """`study_model` for each catalogue model (all by default)."""
    rows = []
    for name in models or list(CATALOGUE):
        report = None if progress is None else (lambda step, name=name: progress(name, step))
        rows += study_model(name, steps, seeds, spec, progress=report)
    return rows


def format_table(rows: list[FamilyRow]) -> str:
    """A Markdown table of ``rows``."""

    def number(x: float | int | None, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    lines = [
        "| model | policy | family | elements/rank | masters differing (mean, 4 ranks) | max rel | median rel "
        "| growth exp. | first step > 1 BF16 ulp | masters > 1 BF16 ulp (mean) |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.model} | {r.policy} | {r.family} | {r.elements} | {r.differ:.0f} | {number(r.max_rel, '.3g')} "
            f"| {number(r.median_rel, '.3g')} | {number(r.growth_exponent, '.2f')} "
            f"| {number(r.first_step_over_bf16_ulp, 'd')} | {r.over_bf16_ulp:.0f} |"
        )
    return "\n".join(lines)


def _ticker(bar) -> Callable[[int], None]:
    def tick(_step: int) -> None:
        bar.update(1)

    return tick


def shape_models(shape: str) -> list[str]:
    """The catalogue models ``--shape`` names: ``production`` (all) or one model; ``ValueError`` otherwise."""
    if shape == "production":
        return list(CATALOGUE)
    get_shape(shape)
    return [shape]


EXPECTATIONS = ("reproduced", "fixed")
"""``--expect`` with ``--shape``: ``reproduced`` -- ``bf16_writeback``'s router masters differ from the oracle's;
``fixed`` -- every policy's masters equal the oracle's bit for bit in every family."""


def meets(expect: str, rows: list[FamilyRow]) -> bool:
    """Whether the production rows show ``expect`` (`EXPECTATIONS`); ``ValueError`` when they cannot."""
    if expect not in EXPECTATIONS:
        raise UsageError(f"--expect {expect}: expected one of {', '.join(EXPECTATIONS)}")
    if expect == "fixed":
        return all(r.differ == 0 for r in rows)
    shipped = [r for r in rows if r.policy == "bf16_writeback" and r.family == Family.ROUTER_GATE_REPLICATED.value]
    if not shipped:
        raise UsageError("--expect reproduced needs bf16_writeback among --policies")
    return all(r.differ > 0 for r in shipped)


def repro_production(
    shape: str,
    steps: int,
    seed: int,
    spec: ParallelSpec,
    as_json: bool = False,
    progress: bool = True,
    gas: int = 1,
    policies: tuple[str, ...] = POLICIES,
    marker: Marker = Marker.DEEPSPEED,
) -> tuple[str, list[FamilyRow]]:
    """``simdist repro 8913 --shape production|MODEL``: the study for ``steps`` steps and one seed; ``(text,
    rows)``. The text's first line states the layout, GAS, marker and policies."""
    models = shape_models(shape)
    for name in policies:
        get_policy(name)  # a clear error for an unknown name before any work
    rows = []
    for name in models:
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=steps, desc=f"repro 8913 {name}", unit="step")
        rows += study_model(
            name,
            steps,
            1,
            spec,
            seed,
            progress=None if bar is None else _ticker(bar),
            gas=gas,
            policies=policies,
            marker=marker,
        )
        if bar is not None:
            bar.close()
    if as_json:
        import json
        from dataclasses import asdict

        return json.dumps([asdict(r) for r in rows], indent=2), rows
    from simdist.sources.production import SLICE_NOTE

    head = (
        f"#8913 at production shapes ({', '.join(models)}): one MoE layer, layout {spec.describe()}, GAS {gas}, "
        f"marker {marker}, {steps} steps, seed {seed}; {', '.join(policies)} against the independent FP32 oracle "
        f"(TP correction every micro-step); {SLICE_NOTE}."
    )
    return head + "\n\n" + format_table(rows), rows
