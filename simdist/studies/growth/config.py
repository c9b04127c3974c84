"""`GrowthConfig`: what one growth run computes, the configuration ``simdist growth`` is generated from.

A module of its own so that the run (`simdist.studies.growth.run`), its metrics (`simdist.studies.growth.metrics`)
and its plot (`simdist.studies.growth.plot`) all read the configuration without importing each other (no import
circle, type-only ones included: ``tests/unit/meta/test_import_graph.py``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from simdist.errors import UsageError, coerce
from simdist.gradpath.kernel import Marker
from simdist.policies.catalogue import get_policy
from simdist.reduce import ReductionName
from simdist.sources import GradientSource
from simdist.world.options import DEFAULT_REDUCTION
from simdist.world.spec import DEFAULT_SPEC, ParallelSpec

__all__ = ["GrowthConfig"]


@dataclass(frozen=True)
class GrowthConfig:
    """One growth run. ``seeds`` ensemble members use seeds ``seed, seed+1, ...``.

    Metrics (synthetic source) are recorded at every step up to ``metrics_dense``, then at every
    ``metrics_every``-th step and the last (`simdist.studies.growth.metrics.metric_steps`): on the log step axis
    of the plot that is at least 900 points per decade, and the metrics cost a tenth as much over the last 90%
    of a 10,000-step run. The training itself runs every step either way. On the command line:
    ``simdist growth --metrics-dense N --metrics-every K``.
    """

    policies: tuple[str, ...] = field(
        default=("bf16_writeback", "fp32_staging", "bf16_only"), metadata={"help": "comma-separated policy names"}
    )
    steps: int = field(default=10_000, metadata={"help": "optimizer steps", "minimum": 1})
    seeds: int = field(default=8, metadata={"help": "ensemble size, run batched", "minimum": 1})
    seed: int = field(default=0, metadata={"help": "first seed of the ensemble"})
    gas: int = field(default=1, metadata={"help": "gradient-accumulation micro-steps per step", "minimum": 1})
    marker: Marker = field(
        default=Marker.DEEPSPEED,
        metadata={"help": "when the correction-once marker is cleared (matters for --gas >= 2)"},
    )
    source: GradientSource = field(
        default=GradientSource.SYNTHETIC,
        metadata={
            "help": "where the gradients come from: the synthetic stream (batched over seeds) or the folded MoE "
            "block (each seed and policy run in turn next to the matched FP32 policy; resumes per run)"
        },
    )
    spec: ParallelSpec = field(default=DEFAULT_SPEC, metadata={"etp": False})
    reduction: ReductionName = field(default=DEFAULT_REDUCTION, metadata={"cli": False})
    checkpoint_every: int = field(default=500, metadata={"help": "steps between checkpoints", "minimum": 1})
    metrics_dense: int = field(
        default=1000,
        metadata={"help": "record the metrics at every step up to this one (synthetic source)", "minimum": 0},
    )
    metrics_every: int = field(
        default=10,
        metadata={
            "help": "after --metrics-dense, record them every this many steps, and the last (1: every step)",
            "minimum": 1,
        },
    )

    def __post_init__(self) -> None:
        # strings are accepted and checked: a typo raises instead of running as a default
        object.__setattr__(self, "marker", coerce(Marker, self.marker, "marker"))
        object.__setattr__(self, "source", coerce(GradientSource, self.source, "source"))
        object.__setattr__(self, "reduction", coerce(ReductionName, self.reduction, "reduction"))
        object.__setattr__(self, "policies", tuple(self.policies))

    def identity(self) -> dict:
        """What must match for a checkpoint or a finished run to be reused (not ``checkpoint_every``)."""
        out = asdict(self)
        out.pop("checkpoint_every")
        out["policies"] = list(self.policies)
        return out

    def validate(self) -> None:
        if min(self.steps, self.seeds, self.gas, self.checkpoint_every, self.metrics_every) < 1:
            raise UsageError("steps, seeds, gas, checkpoint_every and metrics_every must be >= 1")
        if self.metrics_dense < 0:
            raise UsageError(f"metrics_dense must be >= 0, got {self.metrics_dense}")
        for name in self.policies:
            get_policy(name)
        if self.source == GradientSource.MOE:
            from simdist.sources.moe import MoEConfig

            MoEConfig().validate(self.spec)
