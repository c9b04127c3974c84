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

from simdist.numerics import compare


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
    """Per parameter, the first stage (in path order, then rank) where ``run_a`` and ``run_b`` differ
    (`simdist.numerics.compare.first_divergence` over the parameter's captures).

    Only stages captured in both runs are compared (a writeback that one
    policy has and the other lacks shows up at the next common stage, ``hp``);
    values of different dtypes are compared exactly in fp64.
    ``None`` means every common capture is bitwise equal.
    """
    pairs: dict[str, list[tuple[tuple[tuple[int, int, int], int, Key], torch.Tensor, torch.Tensor | None]]] = {}
    for trace_a, trace_b in zip(run_a, run_b, strict=True):
        for param in trace_a.params():
            pairs.setdefault(param, [])
        for key, value in trace_a.values.items():
            other = trace_b.values.get(key)
            if other is not None:
                pairs[key[2]].append(((path_order(key), trace_a.rank, key), value, other))
    result: dict[str, Divergence | None] = {}
    traces = {trace.rank: (trace, other) for trace, other in zip(run_a, run_b, strict=True)}
    for param, found in pairs.items():
        first = compare.first_divergence(found, exact_across_dtypes=True)
        if first is None:
            result[param] = None
            continue
        _, rank, key = first[0]
        step, micro, _, stage = key
        result[param] = Divergence(rank, param, step, micro, stage, _only_before(*traces[rank], key))
    return result


def _only_before(trace_a: Trace, trace_b: Trace, key: Key) -> tuple[str, ...]:
    """The stages ``trace_a`` captured right before ``key`` (same parameter) that ``trace_b`` lacks."""
    earlier = [k for k in trace_a.keys_for(key[2]) if path_order(k) < path_order(key)]
    after: list[str] = []
    for k in reversed(earlier):
        if k in trace_b.values:
            break
        after.insert(0, k[3])
    return tuple(after)
