"""The gradient path's stage logic, written once over a small operations interface.

Everything DeepSpeed's BF16_Optimizer does to a gradient between the backward
pass and the master weights -- the micro-step TP correction guarded by the
correction-once marker, accumulation into the high-precision buffer, the
data-parallel reduction, the boundary, the global norm and clipping, AdamW --
is here, once. What differs between its two adapters (per rank, rank-batched) is only how
a value meets the other ranks, which `Ops` says:

* `Ops.all_reduce` -- SUM over the rank's group of a kind (``tp``, ``dp``,
  ``edp``, ``ep``), optionally in a given `Reduction`'s order;
* `Ops.stochastic_cast` -- seeded stochastic rounding (the seed names the rank);
* `Ops.on_tp_root` / `Ops.grad_norm` -- the rank-dependent parts of the norm.

Every other operation (casts, ``/tp``, ``* 1/dp``, ``+=hp``, AdamW) is
element-wise, so it runs unchanged on a rank's own tensor (per-rank adapter,
`simdist.gradpath.path.CommOps`, ``batch = ()``) and on a tensor that carries
leading ``[batch, rank]`` dimensions (rank-batched adapter,
`simdist.gradpath.batched.BatchedOps`): an element-wise operation gives each
element the same bits whatever tensor it sits in.

State lives in flat buffers ``[*batch, N]`` (every parameter's elements, in
parameter order) with per-parameter views, so the optimizer runs as one
element-wise pass over all parameters.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch.optim.adam import adam

from simdist.errors import UsageError
from simdist.errors import coerce as coerce  # re-exported for studies/growth/run.py and studies/repro/config.py
from simdist.gradpath.families import Correction, Family, ParamSpec
from simdist.gradpath.policy import Policy, Stage
from simdist.gradpath.probes import BOUNDARY
from simdist.reduce import Reduction


class Marker(enum.StrEnum):
    """When the correction-once marker is cleared (see `simdist.gradpath.path`)."""

    DEEPSPEED = "deepspeed"
    PER_MICRO_STEP = "per_micro_step"


class UpdatePath(enum.StrEnum):
    """When ``_update_hp_grad`` runs: after backward (``epilogue``) or from gradient hooks (``hooks``)."""

    EPILOGUE = "epilogue"
    HOOKS = "hooks"


class Ops(Protocol):
    """How the kernel meets the other ranks. Tensors carry the adapter's ``batch`` leading dimensions."""

    batch: tuple[int, ...]

    def all_reduce(self, value: torch.Tensor, kind: str, reduction: Reduction | None = None) -> torch.Tensor:
        """A new tensor: the SUM of ``value`` over the rank's group of ``kind`` (``reduction``'s order if given)."""
        ...

    def stochastic_cast(self, value: torch.Tensor, dtype: torch.dtype, key: tuple[int, int, int]) -> torch.Tensor:
        """``value`` stochastically rounded to ``dtype`` with the generator of ``(seed, step, micro, rank, index)``
        where ``key = (step, micro, index)``."""
        ...

    def on_tp_root(self, value: torch.Tensor) -> torch.Tensor | None:
        """``value`` on TP rank 0, nothing (None or zeros) elsewhere: replicated parameters count once."""
        ...

    def grad_norm(self, total: torch.Tensor) -> torch.Tensor | float:
        """The norm from the summed squares (fp32, shape ``[*batch, 1]``): ``float(total) ** 0.5`` per rank."""
        ...


@dataclass
class Slot:
    """One parameter: its spec, index, element range in the flat buffers and correction-once marker."""

    spec: ParamSpec
    index: int
    start: int
    stop: int
    marker: bool = False
    delivered: bool = False


class GradPath:
    """The gradient path of one run (per rank, or rank-batched): state, micro-steps and the boundary.

    ``lp`` is the flat ``[*batch, N]`` initial low-precision parameter buffer
    in ``policy.grad_dtype``; ``capture(step, micro, param, stage, value)``
    records probe values (a `simdist.gradpath.probes.Trace` or its batched
    twin; None: nothing is captured, and the calls are skipped);
    ``scalar(step, name, value)`` records the gradient norm.
    ``norm`` says whether the boundary computes the global gradient norm
    (always when clipping).
    """

    def __init__(
        self,
        ops: Ops,
        params: Sequence[ParamSpec],
        policy: Policy,
        config,
        lp: torch.Tensor,
        *,
        tp: int,
        dp: int,
        capture: Callable[[int, int, str, str, torch.Tensor], None] | None,
        scalar: Callable[[int, str, Any], None] | None = None,  # the value: a float per rank, a tensor batched
        norm: bool = True,
    ) -> None:
        self.ops, self.policy, self.config, self.tp, self.dp = ops, policy, config, tp, dp
        self.capturing = capture is not None
        self.capture: Callable[[int, int, str, str, torch.Tensor], None] = capture or _capture_nothing
        self.scalar = scalar
        self.norm = norm or config.max_norm > 0
        self.slots: list[Slot] = []
        self.by_name: dict[str, Slot] = {}
        start = 0
        for index, p in enumerate(params):
            if p.name in self.by_name:
                raise UsageError(f"parameter {p.name!r} is listed twice")
            stop = start + math.prod(p.shape)
            slot = Slot(p, index, start, stop)
            self.slots.append(slot)
            self.by_name[p.name] = slot
            start = stop
        self.numel = start
        batch = tuple(lp.shape[:-1])
        if lp.shape[-1] != start:
            raise UsageError(f"initial parameter buffer has {lp.shape[-1]} elements per rank, expected {start}")
        self.batch = batch
        self.lp = lp
        self.master = lp.to(policy.master)
        self.m = torch.zeros(lp.shape, dtype=policy.moments)
        self.v = torch.zeros(lp.shape, dtype=policy.moments)
        self.hp = torch.zeros(lp.shape, dtype=policy.accumulate)
        self.frozen = [s for s in self.slots if s.spec.frozen]
        self.trained = [s for s in self.slots if not s.spec.frozen]
        self._stages: dict[tuple[Family, bool], tuple[Stage, ...]] = {}
        self._boundary: dict[Family, list[tuple[list[Stage], str]]] = {}
        self._views: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    # -- views -----------------------------------------------------------------------------------------------------

    def view(self, buffer: torch.Tensor, slot: Slot) -> torch.Tensor:
        """``slot``'s elements of a flat buffer, as ``[*batch, *shape]`` (a view; cached per buffer)."""
        key = (id(buffer), slot.index)
        found = self._views.get(key)
        if found is None or found[0] is not buffer:
            found = self._views[key] = (buffer, buffer[..., slot.start : slot.stop].view(*self.batch, *slot.spec.shape))
        return found[1]

    def params(self, which: str = "lp") -> dict[str, torch.Tensor]:
        """``{name: view}`` of ``lp``, ``master``, ``m``, ``v`` or ``hp`` (views: they follow the run)."""
        buffer = getattr(self, which)
        return {s.spec.name: self.view(buffer, s) for s in self.slots}

    def state(self) -> dict[str, torch.Tensor]:
        """The optimizer state (for checkpoints): masters, moments, low-precision parameters."""
        return {"master": self.master, "adam_m": self.m, "adam_v": self.v, "lp": self.lp}

    def load(self, state: dict[str, torch.Tensor]) -> None:
        """Restore `state` (between steps: the buffer is empty and every marker clear)."""
        for key, name in (("master", "master"), ("adam_m", "m"), ("adam_v", "v"), ("lp", "lp")):
            getattr(self, name).copy_(state[key])
        self.hp.zero_()

    # -- the micro-step ----------------------------------------------------------------------------------------------

    def delivery_order(self) -> list[Slot]:
        """Parameter order of a micro-step: backward order (reversed) from hooks, parameter order otherwise."""
        hooks = self.config.update_path is UpdatePath.HOOKS
        return list(reversed(self.trained)) if hooks else list(self.trained)

    def begin_micro(self) -> None:
        for slot in self.slots:
            slot.delivered = False

    def deliver(self, name: str, grad: torch.Tensor, step: int, micro: int) -> None:
        """``_update_hp_grad`` for one parameter's local gradient (strict: dtype, shape, once per micro-step)."""
        slot = self.by_name.get(name)
        if slot is None:
            raise UsageError(
                f"a gradient was delivered for {name!r}, which is not a parameter of this run; "
                f"parameters: {', '.join(self.by_name)}"
            )
        if slot.spec.frozen:
            raise UsageError(f"a gradient was delivered for {name!r}, which is declared frozen")
        if slot.delivered:
            raise UsageError(f"the gradient of {name!r} was delivered twice on step {step}, micro-step {micro}")
        expected = (*self.batch, *slot.spec.shape)
        if grad.dtype != self.policy.grad_dtype or tuple(grad.shape) != expected:
            raise UsageError(
                f"gradient of {name!r}: expected dtype {_dtype(self.policy.grad_dtype)} and shape {list(expected)}, "
                f"got dtype {_dtype(grad.dtype)} and shape {list(grad.shape)}"
            )
        slot.delivered = True
        if self.capturing:
            self.capture(step, micro, name, "local", grad)
        self._update_hp_grad(slot, grad, step, micro)
        if self.config.update_path is UpdatePath.HOOKS:
            # bf16_optimizer.accumulate_hp_grads_and_remove_lp clears the marker after every hook call
            slot.marker = False

    def end_micro(self, step: int, micro: int) -> None:
        """Check every trained parameter got its gradient; clear markers if they are cleared per micro-step."""
        missing = [s.spec.name for s in self.trained if not s.delivered]
        if missing:
            raise UsageError(
                f"no gradient was delivered on step {step}, micro-step {micro} for {', '.join(map(repr, missing))}; "
                "declare parameters without gradients frozen (ParamSpec(..., frozen=True))"
            )
        if self.config.marker is Marker.PER_MICRO_STEP:
            for slot in self.slots:
                slot.marker = False

    def stages(self, family: Family, corrected: bool) -> tuple[Stage, ...]:
        """The micro-step stage list of ``family``: with its TP correction, or without (marker set)."""
        key = (family, corrected)
        found = self._stages.get(key)
        if found is None:
            correction = family.correction(self.tp) if corrected else Correction.SKIP
            found = self._stages[key] = tuple(self.policy.stages_for(correction, self.tp, family.dp_group, self.dp))
        return found

    def _update_hp_grad(self, slot: Slot, grad: torch.Tensor, step: int, micro: int) -> None:
        family = slot.spec.family
        correcting = not slot.marker and family.correction(self.tp) is not Correction.SKIP
        value = grad
        name = slot.spec.name
        for stage in self.stages(family, correcting):
            if stage.kind == "accumulate":
                hp = self.view(self.hp, slot)
                hp.add_(value)
                value = hp
            else:
                value = self.apply(stage, value, (step, micro, slot.index))
            if stage.capture and self.capturing:
                self.capture(step, micro, name, stage.capture, value)
        if correcting and self.policy.correct_at == "micro_step":
            slot.marker = True

    def apply(self, stage: Stage, value: torch.Tensor, key: tuple[int, int, int]) -> torch.Tensor:
        """Run one non-accumulating stage on ``value``; a new tensor (`apply_stage` with this path's ops)."""
        return apply_stage(stage, value, self.ops, key, self.policy.tp_reduction)

    # -- the boundary ----------------------------------------------------------------------------------------------

    def run_stages(self, stages: Sequence[Stage], buffer: torch.Tensor, key: tuple[int, int, int]) -> None:
        """Apply ``stages`` in turn to ``buffer``'s value and write the result back into it."""
        if not stages:
            return
        value = buffer
        for stage in stages:
            value = self.apply(stage, value, key)
        buffer.copy_(value)

    def boundary(self, step: int) -> None:
        """The accumulation boundary: clear markers, boundary correction, DP reduction, norm, clip, AdamW."""
        policy = self.policy
        for slot in self.slots:  # DeepSpeedEngine's folding pass at the boundary clears every set marker
            slot.marker = False
        for slot in self.trained:
            name, family = slot.spec.name, slot.spec.family
            hp = self.view(self.hp, slot)
            key = (step, BOUNDARY, slot.index)
            segments = self._boundary.get(family)
            if segments is None:  # the policy states the order (frozen: the same segments every step)
                segments = self._boundary[family] = policy.boundary_segments(family, self.tp, self.dp)
            for stages, capture in segments:
                self.run_stages(stages, hp, key)
                if self.capturing:
                    self.capture(step, BOUNDARY, name, capture, hp)
        if self.norm:
            norm = self.global_norm()
            if self.scalar is not None:
                self.scalar(step, "grad_norm", norm)
            if self.config.max_norm > 0:
                self.clip(norm)
        self.optimizer_step(step)

    def global_norm(self) -> torch.Tensor | float:
        """DeepSpeed's de-duplicated global L2 norm of the high-precision gradients.

        Replicated parameters count on TP rank 0 only; model-parallel and expert
        parameters on every rank. Squared norms are summed in fp32, dense ones
        all-reduced over TP and expert ones over EP; the two norms are combined
        as ``sqrt(dense^2 + expert^2)`` with the squares summed in fp32 and the
        square root taken in Python floats (double precision).
        """
        ops = self.ops
        dense = torch.zeros((*self.batch, 1), dtype=torch.float32)
        expert = torch.zeros((*self.batch, 1), dtype=torch.float32)
        flat = self.hp
        for slot in self.trained:
            family = slot.spec.family
            square = torch.linalg.vector_norm(flat[..., slot.start : slot.stop].float(), dim=-1, keepdim=True) ** 2
            if not family.counted_on_every_tp_rank:
                square = ops.on_tp_root(square)
                if square is None:
                    continue
            (expert if family is Family.EXPERT else dense).add_(square)
        dense = ops.all_reduce(dense, "tp")
        expert = ops.all_reduce(expert, "ep")
        norms = torch.cat([dense.sqrt(), expert.sqrt()], dim=-1)
        return ops.grad_norm((norms**2).sum(dim=-1, keepdim=True))

    def clip(self, norm: torch.Tensor | float) -> None:
        """Scale every buffer by ``max_norm / (norm + 1e-6)`` where that is below 1 (per rank)."""
        max_norm = self.config.max_norm
        if isinstance(norm, float):
            coef = max_norm / (norm + 1e-6)
            if coef < 1:
                self.hp.mul_(coef)
            return
        coef = max_norm / (norm + 1e-6)  # float64, [*batch, 1]
        # ``hp.mul_(python_float)`` multiplies in the dtype's opmath type (fp32 for fp32/bf16/fp16, else its own)
        opmath = torch.float64 if self.hp.dtype == torch.float64 else torch.float32
        scaled = (self.hp.to(opmath) * coef.to(opmath)).to(self.hp.dtype)
        self.hp.copy_(torch.where(coef < 1, scaled, self.hp))

    def optimizer_step(self, step: int) -> None:
        """AdamW on the masters of every trained parameter, copy back to the low-precision parameters."""
        slots = self.trained
        if not self.frozen:  # element-wise: one pass over the flat buffers gives every element its bits
            adamw_step(self.master, self.hp.to(self.master.dtype), self.m, self.v, step + 1, self.config.adam)
            self.lp.copy_(self.master)  # round to nearest even into the low-precision parameters
        else:
            for slot in slots:
                master, lp = self.view(self.master, slot), self.view(self.lp, slot)
                hp = self.view(self.hp, slot)
                adamw_step(
                    master,
                    hp.to(master.dtype),
                    self.view(self.m, slot),
                    self.view(self.v, slot),
                    step + 1,
                    self.config.adam,
                )
                lp.copy_(master)
        for slot in slots if self.capturing else ():
            name = slot.spec.name
            self.capture(step, BOUNDARY, name, "clipped", self.view(self.hp, slot))
            for stage, buffer in (("master", self.master), ("adam_m", self.m), ("adam_v", self.v), ("param", self.lp)):
                self.capture(step, BOUNDARY, name, stage, self.view(buffer, slot))
        self.hp.zero_()


def apply_stage(
    stage: Stage,
    value: torch.Tensor,
    ops: Ops | None = None,
    key: tuple[int, int, int] = (0, 0, 0),
    tp_reduction: Reduction | None = None,
) -> torch.Tensor:
    """Run one non-accumulating stage of a policy on ``value``; a new tensor. The one stage interpreter: the
    kernel's micro-steps and boundary, and the cases that replay a policy's stages on their own buffers.

    ``ops`` meets the other ranks (an ``all_reduce`` stage, in ``tp_reduction``'s order for the TP group; a
    stochastic cast, seeded by ``key = (step, micro, index)``); element-wise stages need none.
    """
    kind = stage.kind
    if kind == "cast":
        if stage.rounding == "stochastic":
            assert stage.dtype is not None, "a cast stage always names its dtype"
            return _needs(ops, stage).stochastic_cast(value, stage.dtype, key)
        return value.to(stage.dtype)
    if kind == "all_reduce":
        reduction = tp_reduction if stage.group == "tp" else None
        return _needs(ops, stage).all_reduce(value, stage.group, reduction)
    if kind == "divide":
        return value / stage.divisor
    if kind == "scale":
        return value * (1.0 / stage.divisor)
    raise UsageError(f"unknown stage kind {kind!r}")


def _needs(ops: Ops | None, stage: Stage) -> Ops:
    if ops is None:
        raise UsageError(f"the stage {stage.label!r} meets the other ranks: apply_stage needs their ops")
    return ops


def adamw_step(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, step: int, h) -> None:
    """One step of ``torch.optim.AdamW`` on ``p`` in place: torch's own implementation, not a transcription.

    It calls ``torch.optim.adam.adam`` (the functional form ``torch.optim.AdamW.step`` runs, with
    ``decoupled_weight_decay=True``) in its single-tensor form, which is what ``torch.optim.AdamW`` picks for
    CPU tensors (``foreach=None``). This is the optimizer DeepSpeed 0.19.8 builds for ``"type": "AdamW"`` with
    ``"torch_adam": true`` (found by experiment: ``deepspeed.initialize`` returns ``torch.optim.adamw.AdamW``,
    ``foreach=None``); without ``torch_adam`` DeepSpeed runs FusedAdam (a CUDA kernel, or on CPU a JIT-built
    C++ kernel), whose order of operations differs and is not modelled here. Every operation is element-wise,
    so a flat buffer of many parameters (and leading ``[batch, rank]`` dimensions) gives each element the bits
    ``torch.optim.AdamW`` gives it on the parameter's own tensor (tested against the real optimizer class).
    ``m`` and ``v`` must have ``p``'s dtype (torch's AdamW keeps its moments in the parameter's dtype).
    """
    adam(
        [p],
        [g],
        [m],
        [v],
        [],
        [torch.tensor(float(step - 1))],  # torch increments the step counter before using it
        foreach=False,
        decoupled_weight_decay=True,
        amsgrad=False,
        beta1=h.beta1,
        beta2=h.beta2,
        lr=h.lr,
        weight_decay=h.weight_decay,
        eps=h.eps,
        maximize=False,
    )


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _capture_nothing(step: int, micro: int, param: str, stage: str, value: torch.Tensor) -> None:
    """The capture of a path that keeps nothing (its calls are skipped: ``capturing`` is False)."""
