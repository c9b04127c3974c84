"""Probes: the value of every named stage of the gradient path, per rank, step and micro-step.

A `Trace` maps ``(step, micro, param, stage)`` to a CPU copy of the tensor
after that stage; boundary stages use ``micro = -1``. The three captures the
#8913 report asks for are ``local`` (the BF16 local gradient), ``corrected``
(the TP-corrected value before any low-precision writeback) and ``hp`` (the
high-precision gradient after the update). `Capture` names every stage, in path order,
with the label reports print.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from simdist.numerics.floats import bitwise_equal


class Capture(enum.StrEnum):
    """A captured stage of the gradient path, declared in path order (micro-step stages, then the boundary's).

    Members are strings, so a trace key's stage may be written either way (``Capture.HP == "hp"``).
    """

    LOCAL = "local"
    STAGED = "staged"
    TP_REDUCED = "tp_reduced"
    CORRECTED = "corrected"
    WRITTEN_BACK = "written_back"
    HP = "hp"
    BOUNDARY_CORRECTED = "boundary_corrected"
    DP_REDUCED = "dp_reduced"
    CLIPPED = "clipped"
    MASTER = "master"
    ADAM_M = "adam_m"
    ADAM_V = "adam_v"
    PARAM = "param"

    @property
    def label(self) -> str:
        """How reports name the tensor (``hp grad``, ``fp32 master``, ...)."""
        return _LABELS.get(self, self.value.replace("_", " "))

    @property
    def order(self) -> int:
        """Position in the path: a micro-step's stages come before the boundary's."""
        return _ORDER[self]

    @property
    def at_boundary(self) -> bool:
        """Captured once per step (``micro = BOUNDARY``) rather than once per micro-step."""
        return self.order >= _ORDER[Capture.BOUNDARY_CORRECTED]


_LABELS = {
    "local": "local grad",
    "corrected": "corrected grad",
    "hp": "hp grad",
    "dp_reduced": "dp-reduced grad",
    "master": "fp32 master",
    "param": "bf16 param",
}
_ORDER = {member: index for index, member in enumerate(Capture)}

MICRO_STAGES: tuple[Capture, ...] = tuple(c for c in Capture if not c.at_boundary)
BOUNDARY_STAGES: tuple[Capture, ...] = tuple(c for c in Capture if c.at_boundary)
STAGE_ORDER: tuple[Capture, ...] = tuple(Capture)
BOUNDARY = -1

Key = tuple[int, int, str, str]


@dataclass
class Trace:
    """Captured stage values of one rank; ``keep`` limits which stages are stored."""

    rank: int
    keep: frozenset[str] | None = None
    values: dict[Key, torch.Tensor] = field(default_factory=dict)
    scalars: dict[tuple[int, str], float] = field(default_factory=dict)

    def capture(self, step: int, micro: int, param: str, stage: str, value: torch.Tensor) -> None:
        if self.keep is None or stage in self.keep:
            self.values[(step, micro, param, stage)] = value.detach().to("cpu", copy=True)

    def get(self, step: int, micro: int, param: str, stage: str) -> torch.Tensor:
        return self.values[(step, micro, param, stage)]

    def params(self) -> list[str]:
        return sorted({k[2] for k in self.values})

    def keys_for(self, param: str) -> list[Key]:
        """Keys of ``param`` in path order: by step, micro-step (boundary last), stage order."""
        return sorted((k for k in self.values if k[2] == param), key=path_order)


def path_order(key: Key) -> tuple[int, int, int]:
    """Sort key of a capture: step, then micro-step with the boundary last, then stage."""
    step, micro, _, stage = key
    return step, micro if micro != BOUNDARY else 1 << 30, Capture(stage).order


@dataclass(frozen=True)
class Divergence:
    """Where two runs first differ for one parameter on one rank."""

    rank: int
    param: str
    step: int
    micro: int
    stage: str
    after: tuple[str, ...] = ()
    """Stages only the first run has, between its last agreeing capture and ``stage`` (e.g. a writeback)."""

    def __str__(self) -> str:
        when = "boundary" if self.micro == BOUNDARY else f"micro-step {self.micro}"
        extra = f" after {', '.join(repr(s) for s in self.after)}" if self.after else ""
        return f"{self.param}: first differs at '{self.stage}'{extra} (rank {self.rank}, step {self.step}, {when})"


def first_divergence(run_a: list[Trace], run_b: list[Trace]) -> dict[str, Divergence | None]:
    """Per parameter, the first stage (in path order, then rank) where ``run_a`` and ``run_b`` differ.

    Only stages captured in both runs are compared (a writeback that one
    policy has and the other lacks shows up at the next common stage, ``hp``);
    values of different dtypes are compared exactly in fp64.
    ``None`` means every common capture is bitwise equal.
    """
    found: dict[str, list[tuple[tuple[int, int, int], int, Key, tuple[str, ...]]]] = {}
    for trace_a, trace_b in zip(run_a, run_b, strict=True):
        for param in trace_a.params():
            found.setdefault(param, [])
            only_a: list[str] = []
            for key in trace_a.keys_for(param):
                other = trace_b.values.get(key)
                if other is None:
                    only_a.append(key[3])
                    continue
                value = trace_a.values[key]
                if value.dtype != other.dtype:
                    value, other = value.double(), other.double()
                if not bitwise_equal(value, other):
                    found[param].append((path_order(key), trace_a.rank, key, tuple(only_a)))
                    break
                only_a = []
    result: dict[str, Divergence | None] = {}
    for param, hits in found.items():
        if not hits:
            result[param] = None
            continue
        _, rank, (step, micro, _, stage), after = min(hits)
        result[param] = Divergence(rank, param, step, micro, stage, after)
    return result
