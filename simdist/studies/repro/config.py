"""What ``simdist repro`` runs and what it records: `ReproConfig` (the configuration tree the command line is
generated from), the layout `REPRO_SPEC`, the code choice `Code`, and the rows a comparison with the oracle gives
(`Row`, `PolicyReport`)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from simdist.gradpath.kernel import Marker, UpdatePath, coerce
from simdist.gradpath.probes import Capture, Divergence
from simdist.numerics.compare import Comparison
from simdist.reduce import ReductionName
from simdist.sources import GradientSource
from simdist.sources.synthetic import Inputs
from simdist.world.options import DEFAULT_REDUCTION
from simdist.world.spec import ParallelSpec

COMPARED: tuple[Capture, ...] = (
    Capture.LOCAL,
    Capture.CORRECTED,
    Capture.HP,
    Capture.MASTER,
    Capture.ADAM_M,
    Capture.ADAM_V,
)
"""The captures the report compares with the oracle, in path order (a `Row`'s ``kind`` is the capture's label)."""


ORACLE_SUMMARY = (
    "independent FP32 TP-then-DP per-parameter reducer (simdist.gradpath.oracle), every group summed in the "
    "chosen reduction's order (default: gloo's, as found by experiment and pinned to real gloo), TP "
    "correction on every micro-step, torch.optim.AdamW on FP32 masters"
)
"""How the report names its oracle."""


REPRO_SPEC = ParallelSpec(8, tp=4, ep=2)
"""The repro's default layout: TP4/DP2/EP2/ETP1/EDP4 on 8 ranks, where the TP, DP, EP and EDP groups all differ
(on `DEFAULT_SPEC` the DP and EDP groups coincide, so experts reduced over DP could not show)."""


EXPECTATIONS = ("reproduced", "fixed")
"""``--expect`` values: ``reproduced`` -- the #8913 writeback finding shows; ``fixed`` -- every policy run is
bitwise equal to the oracle in every compared tensor. Either also needs every applicable power check to show."""


class Code(enum.StrEnum):
    """Which code runs the policies' gradient path (``simdist repro --code``)."""

    TRANSCRIBED = "transcribed"
    """simdist's transcription of it (`simdist.gradpath`)."""
    DEEPSPEED = "deepspeed"
    """DeepSpeed's real BF16_Optimizer (`simdist.cases.deepspeed.issue_8913.repro_traces`; local and hp gradients
    only)."""


@dataclass(frozen=True)
class ReproConfig:
    """What to run: layout, steps, GAS, seed, policies, marker semantics, reduction, gradient source and code.

    The configuration tree of ``simdist repro``: each field's ``metadata`` is its option's help, and the command
    line's options and defaults are generated from these fields (`simdist.cli.options`). The choices accept
    their enum members or their string values; an unknown value raises ``ValueError``.
    """

    spec: ParallelSpec = field(default=REPRO_SPEC, metadata={"etp": True})
    steps: int = field(default=3, metadata={"help": "optimizer steps", "minimum": 1})
    gas: int = field(default=1, metadata={"help": "gradient-accumulation micro-steps per step", "minimum": 1})
    seed: int = field(default=0, metadata={"help": "seed of the local gradients and the initial weights"})
    policies: tuple[str, ...] = field(
        default=("bf16_writeback", "fp32_staging"), metadata={"help": "comma-separated policy names"}
    )
    marker: Marker = field(
        default=Marker.DEEPSPEED,
        metadata={
            "help": "when the correction-once marker is cleared: as DeepSpeed 0.19.8 does on the chosen update "
            "path, or every micro-step"
        },
    )
    reduction: ReductionName = field(
        default=DEFAULT_REDUCTION,
        metadata={"help": "reduction of every group (the launchers' one default: gloo's order)", "skip": ("upcast",)},
    )
    update_path: UpdatePath = field(
        default=UpdatePath.EPILOGUE,
        metadata={"help": "when _update_hp_grad runs: after backward or from gradient hooks (immediate_grad_update)"},
    )
    source: GradientSource = field(
        default=GradientSource.SYNTHETIC,
        metadata={"help": "where the local gradients come from: seeded synthetic ones or the folded MoE block"},
    )
    code: Code = field(
        default=Code.TRANSCRIBED,
        metadata={
            "help": "which code runs the gradient path: simdist's transcription, or DeepSpeed's real BF16_Optimizer "
            "on 4 gloo processes (bf16_writeback = as shipped, fp32_staging = with the #8913 fix; gradients only)"
        },
    )
    inputs: Inputs = field(
        default=Inputs.ROUNDING,
        metadata={
            "help": "distribution of the synthetic local gradients: rounding (31 binades, per-rank magnitudes: sums "
            "round, so order, group and dtype show) or narrow (the old 7 binades, whose sums are mostly exact)"
        },
    )
    """The synthetic gradients' distribution (`Inputs`; ``narrow`` is the old one, whose sums are mostly exact)."""

    def __post_init__(self) -> None:
        for name, kind in (
            ("inputs", Inputs),
            ("marker", Marker),
            ("reduction", ReductionName),
            ("update_path", UpdatePath),
            ("source", GradientSource),
            ("code", Code),
        ):
            object.__setattr__(self, name, coerce(kind, getattr(self, name), name.replace("_", " ")))
        object.__setattr__(self, "policies", tuple(self.policies))


@dataclass
class Row:
    """One tensor of one rank compared with the oracle, pooled over every step (and micro-step).

    ``term_relative`` is ``max |policy - oracle| / sum|terms|`` for the gradient tensors (the terms are the
    local gradients that the oracle's reduction adds; see `simdist.numerics.compare`), ``None`` for masters
    and moments, which are not sums.
    """

    rank: int
    param: str
    kind: str
    bitwise_equal: bool
    max_ulp: int
    fraction_differing: float
    norm_relative: float
    term_relative: float | None

    @classmethod
    def of(cls, rank: int, param: str, kind: str, comparison: Comparison) -> Row:
        """The row of one rank's tensor: a view of its `Comparison` (fields kept: ``--json`` prints them)."""
        diff = comparison.difference
        return cls(
            rank,
            param,
            kind,
            diff.bitwise_equal,
            diff.max_ulp,
            diff.fraction_differing,
            diff.norm_relative,
            diff.max_term_relative,
        )


@dataclass
class PolicyReport:
    name: str
    summary: str
    chains: dict[str, str]
    rows: list[Row]
    first_divergence: dict[str, str | None]
    departs: list[str] = field(default_factory=list)
    divergences: dict[str, Divergence | None] = field(default_factory=dict, repr=False)


GRADIENT_STAGES = frozenset({Capture.LOCAL, Capture.CORRECTED, Capture.HP})
"""Captures that are sums of local gradients, so a per-element ``sum|terms|`` exists for them."""
