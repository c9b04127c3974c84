"""Precision policies of the gradient path, as data.

A `Policy` says, for each rounding boundary between a BF16 local gradient and
an FP32 master weight, which dtype and rounding mode it uses. From those
settings `Policy.micro_step_stages` and `Policy.boundary_stages` derive the
named stages a micro-step and a boundary run for a parameter family -- the same
lists the kernel (`simdist.gradpath.kernel`) executes and the chain that is
printed (tested: a run captures exactly the stages its chain names)::

    bf16_writeback, router (AVERAGE, tp=2):
        bf16 -> fp32 -> all_reduce[tp] -> /2 -> bf16 -> fp32 -> +=hp
        | boundary: fp32 -> all_reduce[dp] -> *1/dp -> adamw(fp32)
    fp32_staging, same parameter:
        bf16 -> fp32 -> all_reduce[tp] -> /2 -> +=hp
        | boundary: fp32 -> all_reduce[dp] -> *1/dp -> adamw(fp32)

Policies register themselves by name (`register`); the modules of `simdist.policies` are the catalogue
(`simdist.policies.catalogue` finds them by name). A new policy is one `Policy(...)` call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal, get_args

import torch

from simdist.errors import UsageError
from simdist.gradpath.families import Correction, Family
from simdist.reduce import Reduction

Rounding = Literal["nearest", "stochastic"]


DpScale = Literal["postscale", "prescale", "pre_post_divide"]


_SHORT = {torch.float64: "fp64", torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def dtype_name(dtype: torch.dtype) -> str:
    """``fp32``, ``bf16``, ... for a torch dtype."""
    return _SHORT.get(dtype, str(dtype).removeprefix("torch."))


@dataclass(frozen=True)
class Stage:
    """One step of the gradient path: ``kind`` in cast, all_reduce, divide, scale, accumulate.

    * ``cast`` -- round to ``dtype`` (``rounding``: nearest or stochastic);
    * ``all_reduce`` -- SUM over the rank's group of kind ``group`` (tp, dp, edp) in the value's dtype;
    * ``divide`` -- ``value / divisor``; ``scale`` -- ``value * (1 / divisor)`` (the factor is computed in
      double and rounded to the value's dtype by torch, as ``x.mul_(1.0 / n)`` does);
    * ``accumulate`` -- ``hp += value`` (``+=hp``).

    ``capture`` names the probe point after this stage (``staged``,
    ``tp_reduced``, ``corrected``, ``written_back``, ``hp``), or is empty.
    ``symbol`` replaces the number in the label when a chain is printed
    without a DP size (``*1/dp``).
    """

    kind: Literal["cast", "all_reduce", "divide", "scale", "accumulate"]
    capture: str = ""
    dtype: torch.dtype | None = None
    rounding: Rounding = "nearest"
    divisor: float = 1
    group: str = "tp"
    symbol: str = ""

    @property
    def label(self) -> str:
        if self.kind == "cast":
            assert self.dtype is not None, "every Policy method that builds a cast passes its dtype"
            return dtype_name(self.dtype) + (" (stochastic)" if self.rounding == "stochastic" else "")
        if self.kind == "all_reduce":
            return f"all_reduce[{self.group}]"
        number = self.symbol or f"{self.divisor:g}"
        if self.kind == "divide":
            return f"/{number}"
        if self.kind == "scale":
            return f"*1/{number}"
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
    * ``correct_at`` -- ``micro_step`` (DeepSpeed), ``boundary`` (correct the
      accumulated buffer once, before the DP reduction) or ``after_dp`` (once,
      after the DP reduction, as Megatron-Core's ``finalize_model_grads`` does);
    * ``dp_reduce`` / ``dp_scale`` / ``dp_at`` -- dtype, normalisation and
      timing of the data-parallel reduction;
    * ``master`` / ``moments`` -- dtypes of the master weights and Adam moments;
    * ``tp_reduction`` -- a reduction for the TP all-reduce (default: the
      world's); the path then all-gathers the TP values (exact) and sums them
      in that reduction's order on every member.
    """

    name: str
    summary: str
    staging: torch.dtype | None = torch.float32
    writeback: torch.dtype | None = torch.bfloat16
    rounding: Rounding = "nearest"
    expert_in_grad_dtype: bool = True
    accumulate: torch.dtype = torch.float32
    correct_at: Literal["micro_step", "boundary", "after_dp"] = "micro_step"
    dp_reduce: torch.dtype = torch.float32
    dp_scale: DpScale = "postscale"
    dp_at: Literal["boundary", "micro_step"] = "boundary"
    master: torch.dtype = torch.float32
    moments: torch.dtype = torch.float32
    grad_dtype: torch.dtype = torch.bfloat16
    tp_reduction: Reduction | None = None

    def __post_init__(self) -> None:
        """Reject a field the path cannot run, in one line naming the field and its valid values (a ValueError:
        the CLI's bad input, exit 2) -- a string for a dtype, an integer dtype, an unknown choice."""
        if not isinstance(self.name, str) or not self.name or any(c == "," or c.isspace() for c in self.name):
            raise UsageError(
                f"Policy.name={self.name!r}: expected a non-empty string without commas or spaces "
                "(--policies separates names by commas)"
            )
        if not isinstance(self.summary, str):
            raise UsageError(f"Policy {self.name!r}: summary={self.summary!r} must be a string")
        if not (
            self.writeback is None or (isinstance(self.writeback, torch.dtype) and self.writeback.is_floating_point)
        ):
            raise UsageError(
                f"Policy {self.name!r}: writeback={self.writeback!r} is not a floating torch.dtype; valid: None or "
                "one, e.g. torch.bfloat16, torch.float16, torch.float8_e4m3fn (a writeback is only a cast)"
            )
        for field in ("staging", "accumulate", "dp_reduce", "master", "moments", "grad_dtype"):
            value = getattr(self, field)
            if (value is None and field == "staging") or any(value is d for d in _SHORT):
                continue
            raise UsageError(
                f"Policy {self.name!r}: {field}={value!r} is not a dtype the path computes in; valid: "
                + ", ".join(f"torch.{str(d).removeprefix('torch.')}" for d in _SHORT)
                + (" or None" if field == "staging" else "")
            )
        for field, choices in _CHOICES.items():
            if getattr(self, field) not in choices:
                raise UsageError(
                    f"Policy {self.name!r}: {field}={getattr(self, field)!r}; valid: {', '.join(map(repr, choices))}"
                )
        if not isinstance(self.expert_in_grad_dtype, bool):
            raise UsageError(
                f"Policy {self.name!r}: expert_in_grad_dtype={self.expert_in_grad_dtype!r}; valid: True, False"
            )
        if self.tp_reduction is not None and not isinstance(self.tp_reduction, Reduction):
            raise UsageError(
                f"Policy {self.name!r}: tp_reduction={self.tp_reduction!r} is not a Reduction "
                "(simdist.reduce.make_reduction(name) builds one) or None"
            )

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

    def micro_step_stages(self, family: Family, tp: int, dp: int | None = None) -> list[Stage]:
        """Stages one micro-step runs for ``family`` on a TP group of ``tp`` ranks, ending in ``+=hp``.

        With ``dp_at="micro_step"`` they include the DP reduction (over ``dp`` ranks; symbolic when None).
        """
        return self.stages_for(family.correction(tp), tp, family.dp_group, dp)

    def stages_for(self, correction: Correction, tp: int, dp_group: str = "dp", dp: int | None = None) -> list[Stage]:
        """Stages one micro-step runs for a gradient whose TP correction is ``correction``.

        ``Correction.SKIP`` gives the uncorrected micro-step (a cast to the buffer dtype and ``+=hp``), which is
        also what a parameter whose correction-once marker is set runs.
        """
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
        if self.dp_at == "micro_step":
            stages += self.dp_stages(dp_group, dp, self.accumulate)
        stages.append(Stage("accumulate", "hp", self.accumulate))
        return stages

    def dp_stages(self, group: str, dp: int | None, dtype: torch.dtype) -> list[Stage]:
        """The data-parallel reduction of a ``dtype`` value over ``group`` (``dp`` or ``edp``), normalised by the
        dense DP size ``dp`` (symbolic labels when None): cast to ``dp_reduce``, scale and all_reduce in the order
        ``dp_scale`` names, cast back."""
        stages: list[Stage] = []
        if self.dp_reduce != dtype:
            stages.append(Stage("cast", "", self.dp_reduce))
        reduce = Stage("all_reduce", "", self.dp_reduce, group=group)
        n = dp or 1
        if self.dp_scale == "prescale":
            stages += [Stage("scale", "", self.dp_reduce, divisor=n, symbol="" if dp else "dp"), reduce]
        elif self.dp_scale == "pre_post_divide":
            pre = predivide_factor(n)
            stages += [
                Stage("divide", "", self.dp_reduce, divisor=pre, symbol="" if dp else "pre"),
                reduce,
                Stage("divide", "", self.dp_reduce, divisor=n / pre, symbol="" if dp else "post"),
            ]
        else:
            stages += [reduce, Stage("scale", "", self.dp_reduce, divisor=n, symbol="" if dp else "dp")]
        if self.dp_reduce != dtype:
            stages.append(Stage("cast", "", dtype))
        return stages

    def boundary_correction_stages(self, family: Family, tp: int) -> list[Stage]:
        """The TP correction run once on the accumulated buffer at the boundary (``correct_at`` ``boundary`` or
        ``after_dp``)."""
        if self.correct_at == "micro_step":
            return []
        return self.correction_stages(family.correction(tp), tp, self.accumulate)

    def boundary_segments(self, family: Family, tp: int, dp: int | None = None) -> list[tuple[list[Stage], str]]:
        """The boundary as ``(stages, capture)`` segments: the kernel runs each segment's stages on the
        accumulated buffer, writes the result back and captures it under ``capture``.

        The one statement of the boundary order: ``correct_at="boundary"`` runs the TP correction (captured as
        ``boundary_corrected``, even where the family has no correction) and then the DP reduction;
        ``after_dp`` (Megatron's ``finalize_model_grads``) the DP reduction and then the TP correction. The
        last capture is ``dp_reduced``: the gradient the optimizer sees, whichever order produced it.
        """
        correction = self.boundary_correction_stages(family, tp)
        dp_stages = self.dp_stages(family.dp_group, dp, self.accumulate) if self.dp_at == "boundary" else []
        if self.correct_at == "boundary":
            return [(correction, "boundary_corrected"), (dp_stages, "dp_reduced")]
        return [(dp_stages + correction, "dp_reduced")]

    def boundary_stages(self, family: Family, tp: int, dp: int | None = None) -> list[Stage]:
        """Stages run once on the accumulated buffer at the boundary: the TP correction and the DP reduction, in
        the order ``correct_at`` names (``boundary``: correction first; ``after_dp``: DP reduction first), as
        `boundary_segments` states it."""
        return [stage for stages, _ in self.boundary_segments(family, tp, dp) for stage in stages]

    def chain(self, family: Family, tp: int, dp: int | None = None) -> str:
        """The printable chain of every stage that runs, with the dtype each runs in, e.g.

        ``bf16 -> fp32 -> all_reduce[tp] -> /2 -> bf16 -> fp32 -> +=hp | boundary: fp32 -> all_reduce[dp] -> *1/dp
        -> adamw(fp32)``: the micro-step from the BF16 local gradient to the buffer, then the boundary from
        the buffer's dtype (TP correction if it runs there, DP reduction, optimizer on the masters).
        ``dp`` fills in the DP normalisation; without it the labels are symbolic.
        """
        micro = [dtype_name(self.grad_dtype)] + [s.label for s in self.micro_step_stages(family, tp, dp)]
        boundary = [dtype_name(self.accumulate)] + [s.label for s in self.boundary_stages(family, tp, dp)]
        boundary.append(
            f"adamw({dtype_name(self.master)})"
            if self.moments == self.master
            else f"adamw({dtype_name(self.master)}, moments {dtype_name(self.moments)})"
        )
        return " -> ".join(micro) + " | boundary: " + " -> ".join(boundary)


_CHOICES: dict[str, tuple[str, ...]] = {
    "rounding": get_args(Rounding),
    "correct_at": ("micro_step", "boundary", "after_dp"),
    "dp_scale": get_args(DpScale),
    "dp_at": ("boundary", "micro_step"),
}
"""The valid values of each `Policy` field that is a choice (checked on construction)."""


def predivide_factor(world: int) -> int:
    """FSDP's split of ``1/world`` into a pre- and post-divide factor: the pre-divide factor (a power of two)."""
    factor = 1
    while world % factor == 0 and world / factor > factor:
        factor *= 2
    return factor


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


def registered() -> dict[str, Policy]:
    """Every registered policy by name, in registration order (a copy: `register` is the way in)."""
    return dict(_REGISTRY)


def register(policy: Policy) -> Policy:
    """Add ``policy`` to the registry under its name (names are unique).

    Registering the same policy again (the same object, or an equal one: a policy module that is loaded
    afresh) is a no-op; a different policy under a taken name is an error.
    """
    if not isinstance(policy, Policy):
        raise UsageError(f"register() takes a Policy, got {type(policy).__name__}")
    if policy.name in _REGISTRY and _REGISTRY[policy.name] != policy:
        raise UsageError(f"a different policy is already registered as {policy.name!r}")
    _REGISTRY[policy.name] = policy
    return policy
