"""Precision policies of the gradient path, as data.

A `Policy` says, for each rounding boundary between a BF16 local gradient and
an FP32 master weight, which dtype and rounding mode it uses. From those
settings `Policy.micro_step_stages` derives the named stages one micro-step
runs for a parameter family -- the same list the engine executes and the chain
that is printed, so what is shown is what runs::

    bf16_writeback, router (AVERAGE, tp=2):
        bf16 -> fp32 -> all_reduce[tp] -> /2 -> bf16 -> fp32 -> +=hp
    fp32_staging, same parameter:
        bf16 -> fp32 -> all_reduce[tp] -> /2 -> +=hp

Policies register themselves by name (`register`); the modules in
``policies/`` are the catalogue. A new policy is one `Policy(...)` call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import torch

from simdist.gradpath.families import Correction, Family
from simdist.reduce import ReductionModel

Rounding = Literal["nearest", "stochastic"]


DpScale = Literal["postscale", "prescale", "pre_post_divide"]


_SHORT = {torch.float64: "fp64", torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def dtype_name(dtype: torch.dtype) -> str:
    """``fp32``, ``bf16``, ... for a torch dtype."""
    return _SHORT.get(dtype, str(dtype).removeprefix("torch."))


@dataclass(frozen=True)
class Stage:
    """One step of the gradient path: ``kind`` in cast, all_reduce, divide, accumulate.

    ``capture`` names the probe point after this stage (``staged``,
    ``tp_reduced``, ``corrected``, ``written_back``, ``hp``), or is empty.
    """

    kind: Literal["cast", "all_reduce", "divide", "accumulate"]
    capture: str = ""
    dtype: torch.dtype | None = None
    rounding: Rounding = "nearest"
    divisor: int = 1

    @property
    def label(self) -> str:
        if self.kind == "cast":
            return dtype_name(self.dtype) + (" (stochastic)" if self.rounding == "stochastic" else "")
        if self.kind == "all_reduce":
            return "all_reduce[tp]"
        if self.kind == "divide":
            return f"/{self.divisor}"
        return "+=hp"


@dataclass(frozen=True)
class Policy:
    """The dtype and rounding of every boundary of the gradient path.

    * ``staging`` -- dtype ``lp.grad`` is copied into before the TP
      correction; ``None`` corrects ``lp.grad`` in place in its own dtype;
    * ``writeback`` -- dtype the corrected value is rounded back to before it
      is accumulated (DeepSpeed's BF16 writeback); ``None`` adds the staged
      value directly; ``rounding`` is its rounding mode;
    * ``expert_in_grad_dtype`` -- EXPERT_TP_CANCEL divides ``lp.grad`` in
      place in the grad dtype (as DeepSpeed does) instead of on the staging copy;
    * ``accumulate`` -- dtype of the high-precision gradient buffer;
    * ``correct_at`` -- ``micro_step`` (DeepSpeed) or ``boundary`` (correct the
      accumulated buffer once, as Megatron-Core's finalize step does);
    * ``dp_reduce`` / ``dp_scale`` / ``dp_at`` -- dtype, normalisation and
      timing of the data-parallel reduction;
    * ``master`` / ``moments`` -- dtypes of the master weights and Adam moments;
    * ``tp_model`` -- a reduction model for the TP all-reduce (default: the
      world's); the path then all-gathers the TP values (exact) and sums them
      in that model's order on every member.
    """

    name: str
    summary: str
    staging: torch.dtype | None = torch.float32
    writeback: torch.dtype | None = torch.bfloat16
    rounding: Rounding = "nearest"
    expert_in_grad_dtype: bool = True
    accumulate: torch.dtype = torch.float32
    correct_at: Literal["micro_step", "boundary"] = "micro_step"
    dp_reduce: torch.dtype = torch.float32
    dp_scale: DpScale = "postscale"
    dp_at: Literal["boundary", "micro_step"] = "boundary"
    master: torch.dtype = torch.float32
    moments: torch.dtype = torch.float32
    grad_dtype: torch.dtype = torch.bfloat16
    tp_model: ReductionModel | None = None

    def correction_stages(self, correction: Correction, tp: int, dtype: torch.dtype) -> list[Stage]:
        """The TP correction on a value of ``dtype``: all_reduce and/or divide."""
        stages = []
        if correction.reduces:
            stages.append(Stage("all_reduce", "tp_reduced", dtype))
        if correction.divides:
            stages.append(Stage("divide", "corrected", dtype, divisor=tp))
        elif correction.reduces:
            stages[-1] = Stage("all_reduce", "corrected", dtype)
        return stages

    def micro_step_stages(self, family: Family, tp: int) -> list[Stage]:
        """Stages one micro-step runs for ``family`` on a TP group of ``tp`` ranks, ending in ``+=hp``."""
        return self.stages_for(family.correction(tp), tp)

    def stages_for(self, correction: Correction, tp: int) -> list[Stage]:
        """Stages one micro-step runs for a gradient whose TP correction is ``correction``."""
        if self.correct_at != "micro_step":
            correction = Correction.SKIP
        stages: list[Stage] = []
        dtype = self.grad_dtype
        in_place_expert = correction is Correction.EXPERT_TP_CANCEL and self.expert_in_grad_dtype
        if correction is not Correction.SKIP and self.staging is not None and not in_place_expert:
            stages.append(Stage("cast", "staged", self.staging))
            dtype = self.staging
        stages += self.correction_stages(correction, tp, dtype)
        if self.writeback is not None and dtype != self.writeback and correction is not Correction.SKIP:
            stages.append(Stage("cast", "written_back", self.writeback, self.rounding))
            dtype = self.writeback
        if dtype != self.accumulate:
            stages.append(Stage("cast", "", self.accumulate))
        stages.append(Stage("accumulate", "hp", self.accumulate))
        return stages

    def boundary_stages(self, family: Family, tp: int) -> list[Stage]:
        """Stages run once on the accumulated buffer at the boundary, before the DP reduction."""
        if self.correct_at != "boundary":
            return []
        return self.correction_stages(family.correction(tp), tp, self.accumulate)

    def chain(self, family: Family, tp: int) -> str:
        """The printable chain, e.g. ``bf16 -> fp32 -> all_reduce[tp] -> /2 -> bf16 -> fp32 -> +=hp``."""
        labels = [dtype_name(self.grad_dtype)] + [s.label for s in self.micro_step_stages(family, tp)]
        boundary = self.boundary_stages(family, tp)
        if boundary:
            labels += ["| boundary:"] + [s.label for s in boundary]
        return " -> ".join(labels).replace("-> | boundary: ->", "| boundary:")


_REGISTRY: dict[str, Policy] = {}


@contextlib.contextmanager
def registry_scope() -> Iterator[None]:
    """Policies registered inside the block are forgotten when it ends (a test or a notebook trying one out)."""
    saved = dict(_REGISTRY)
    try:
        yield
    finally:
        _REGISTRY.clear()
        _REGISTRY.update(saved)


def register(policy: Policy) -> Policy:
    """Add ``policy`` to the registry under its name (names are unique)."""
    if policy.name in _REGISTRY and _REGISTRY[policy.name] != policy:
        raise ValueError(f"a different policy is already registered as {policy.name!r}")
    _REGISTRY[policy.name] = policy
    return policy
