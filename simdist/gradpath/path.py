"""The BF16 mixed-precision gradient path of DeepSpeed's BF16_Optimizer under AutoEP+AutoTP folding.

`train_rank` is a rank program (``fn(comm, ...)``): it runs on `SimWorld` and
on `TorchComm` alike. Per optimizer step it does what DeepSpeed does, with
each precision choice taken from a `Policy`:

Every micro-step, for every parameter with a gradient (``_update_hp_grad``):
  1. unless the correction-once marker is set, apply the family's TP
     correction (the policy's stages: staging cast, all_reduce[tp], ``/tp``,
     writeback) and set the marker;
  2. accumulate into the high-precision buffer (``+=hp``);
  3. the local gradient is zeroed by the next backward prologue.

At the gradient-accumulation boundary (``engine.allreduce_gradients``):
  4. the engine's folding pass clears each set marker (for a parameter whose
     marker is not set it would correct ``lp.grad``, which BF16_Optimizer no
     longer reads);
  5. data-parallel reduction of the high-precision buffers: dense over the
     dense-DP group, experts over the EDP group, both normalised by the dense
     DP size (``sum`` then ``* 1/dp`` by default);
  6. global gradient norm with TP/EP de-duplication, optional clipping;
  7. AdamW on the masters (FusedAdam's AdamW-mode arithmetic), copy of the
     masters back into the BF16 parameters (round to nearest even).

Correction-once marker (``marker="deepspeed"``, the default: as DeepSpeed 0.19.8 ships it, for the
chosen update path). `auto_ep_folding.apply_folding_correction_to_grad_buffer` (auto_ep_folding.py:470-484)
skips a parameter whose marker is set and sets it after correcting. Who clears it depends on the path:

* ``update_path="hooks"`` (``immediate_grad_update=True``): the gradient hook,
  `bf16_optimizer.accumulate_hp_grads_and_remove_lp` (bf16_optimizer.py:707-716), calls
  ``clear_autoep_folding_gradient_corrected`` right after ``_update_hp_grad`` on every call, so
  every micro-step is corrected;
* ``update_path="epilogue"`` (DeepSpeed's default: ``immediate_grad_update: bool = False``,
  runtime/precision_config.py:51): ``update_hp_grads`` never clears it; only the engine's boundary
  pass ``_reduce_autoep_folding_tp_replicated_gradients`` (engine.py:3099-3119) does, so with
  GAS >= 2 micro-steps 2..GAS are added to the buffer *uncorrected*.

``marker="per_micro_step"`` clears it after every micro-step on either path, which is what the
oracles and the intended semantics do.
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

import torch

from simdist.gradpath.families import Correction, Family, ParamSpec
from simdist.gradpath.policy import Policy, Stage
from simdist.gradpath.probes import BOUNDARY, Trace
from simdist.numerics.rounding import stochastic_round
from simdist.reduce import ReduceOp
from simdist.world.groups import Comm


@dataclass(frozen=True)
class AdamW:
    """AdamW hyper-parameters (DeepSpeed/FusedAdam defaults, plus weight decay)."""

    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.01


@dataclass(frozen=True)
class PathConfig:
    """How many steps, micro-steps and which engine semantics a run uses."""

    steps: int = 3
    gas: int = 1
    max_norm: float = 0.0
    marker: Literal["deepspeed", "per_micro_step"] = "deepspeed"
    update_path: Literal["epilogue", "hooks"] = "epilogue"
    seed: int = 0
    adam: AdamW = field(default_factory=AdamW)

    def __post_init__(self) -> None:
        if self.steps < 1 or self.gas < 1:
            raise ValueError(f"steps and gas must be >= 1, got steps={self.steps}, gas={self.gas}")


LocalGrads = Callable[[int, int, int, ParamSpec], torch.Tensor]
"""``(step, micro, rank, param) -> BF16 local gradient`` (synthetic gradients)."""


@runtime_checkable
class GradientSource(Protocol):
    """Gradients that come from running a model: one backward per micro-step.

    ``backward`` runs this rank's forward and backward for ``(step, micro)``
    with the current low-precision weights ``lp`` (name -> tensor, to be used
    read-only) and calls ``deliver(name, grad)`` once per parameter: from a
    post-accumulate-grad hook during backward when ``hooks`` is true
    (DeepSpeed's ``immediate_grad_update``), else after backward in parameter
    order (the backward epilogue). Collectives may run inside ``backward``.
    """

    def backward(
        self,
        comm: Comm,
        step: int,
        micro: int,
        lp: dict[str, torch.Tensor],
        deliver: Callable[[str, torch.Tensor], None],
        hooks: bool,
    ) -> None: ...


@dataclass
class _ParamState:
    spec: ParamSpec
    lp: torch.Tensor
    master: torch.Tensor
    m: torch.Tensor
    v: torch.Tensor
    hp: torch.Tensor
    marker: bool = False
    has_grad: bool = False


def train_rank(
    comm: Comm,
    params: list[ParamSpec],
    initial: Callable[[int, ParamSpec], torch.Tensor],
    local_grads: LocalGrads | GradientSource,
    policy: Policy,
    config: PathConfig,
    keep: frozenset[str] | None = None,
) -> Trace:
    """Run ``config.steps`` optimizer steps of the gradient path on this rank; return its captures."""
    rank = comm.get_rank()
    tp_group, tp = comm.group("tp"), comm.get_world_size(comm.group("tp"))
    dense_dp = comm.get_world_size(comm.group("dp"))
    trace = Trace(rank, keep)
    states = []
    for p in params:
        lp = initial(rank, p).to(policy.grad_dtype)
        states.append(
            _ParamState(
                p,
                lp,
                lp.to(policy.master),
                torch.zeros(p.shape, dtype=policy.moments),
                torch.zeros(p.shape, dtype=policy.moments),
                torch.zeros(p.shape, dtype=policy.accumulate),
            )
        )
    by_name = {s.spec.name: s for s in states}
    index = {s.spec.name: i for i, s in enumerate(states)}
    hooks = config.update_path == "hooks"
    for step in range(config.steps):
        for micro in range(config.gas):

            def deliver(name: str, grad: torch.Tensor, step=step, micro=micro) -> None:
                s = by_name[name]
                grad = grad.to(policy.grad_dtype)
                trace.capture(step, micro, name, "local", grad)
                where = (step, micro, rank, index[name])
                _update_hp_grad(comm, tp_group, tp, dense_dp, s, grad, policy, config, trace, where)
                if hooks:  # accumulate_hp_grads_and_remove_lp clears the marker after every hook call
                    s.marker = False

            if isinstance(local_grads, GradientSource):
                lp = {name: s.lp for name, s in by_name.items()}
                local_grads.backward(comm, step, micro, lp, deliver, hooks)
            else:
                for s in reversed(states) if hooks else states:
                    deliver(s.spec.name, local_grads(step, micro, rank, s.spec))
            if config.marker == "per_micro_step":
                for s in states:
                    s.marker = False
        _boundary(comm, tp_group, tp, dense_dp, states, policy, config, trace, step)
    return trace


def _update_hp_grad(comm, tp_group, tp, dense_dp, s: _ParamState, grad, policy, config, trace, where) -> None:
    step, micro, rank, index = where
    correction = s.spec.family.correction(tp)
    stages = _micro_step_stages(policy, correction, tp)
    correcting = not s.marker and correction is not Correction.SKIP
    if not correcting:
        stages = _uncorrected(policy, grad.dtype)
    value = grad
    for stage in stages:
        if stage.kind == "accumulate":
            if policy.dp_at == "micro_step":
                value = _dp_reduce(comm, value, s.spec.family, dense_dp, policy)
            s.hp.add_(value)
            s.has_grad = True
        else:
            value = _apply(comm, tp_group, stage, value, policy, seed=(config.seed, step, micro, rank, index))
        if stage.capture:
            trace.capture(step, micro, s.spec.name, stage.capture, s.hp if stage.kind == "accumulate" else value)
    if correcting and policy.correct_at == "micro_step":
        s.marker = True


@functools.lru_cache(maxsize=1024)
def _micro_step_stages(policy: Policy, correction: Correction, tp: int) -> tuple[Stage, ...]:
    """`Policy.stages_for`, derived once per policy, correction and TP size (it runs every micro-step)."""
    return tuple(policy.stages_for(correction, tp))


def _uncorrected(policy: Policy, dtype: torch.dtype) -> list[Stage]:
    """A micro-step that skips the TP correction: cast to the buffer dtype and accumulate."""
    stages = [Stage("cast", "", policy.accumulate)] if dtype != policy.accumulate else []
    return [*stages, Stage("accumulate", "hp", policy.accumulate)]


def _apply(comm, tp_group, stage: Stage, value: torch.Tensor, policy: Policy, seed) -> torch.Tensor:
    if stage.kind == "cast":
        if stage.rounding == "stochastic":
            return stochastic_round(value, stage.dtype, _generator(seed))
        return value.to(stage.dtype)
    if stage.kind == "all_reduce":
        if policy.tp_model is not None:
            return _all_reduce_with(policy.tp_model, comm, tp_group, value)
        value = value.clone()
        comm.all_reduce(value, op=ReduceOp.SUM, group=tp_group)
        return value
    if stage.kind == "divide":
        return value / stage.divisor
    raise ValueError(f"unknown stage kind {stage.kind!r}")


def _all_reduce_with(model, comm, group, value: torch.Tensor) -> torch.Tensor:
    """An all-reduce in the policy's own order: gather every member's value (exact), then ``model``'s sum."""
    gathered = torch.empty((group.size, *value.shape), dtype=value.dtype, device=value.device)
    comm.all_gather_into_tensor(gathered, value.contiguous(), group=group)
    return model.reduce(gathered)


def _generator(seed: tuple) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(seed).encode()))


def _dp_reduce(comm, value: torch.Tensor, family: Family, dense_dp: int, policy: Policy) -> torch.Tensor:
    """Data-parallel reduction: over dp (dense) or edp (experts), normalised by the dense DP size."""
    group = comm.group(family.dp_group)
    x = value.to(policy.dp_reduce, copy=True)
    if policy.dp_scale == "prescale":
        x.mul_(1.0 / dense_dp)
        comm.all_reduce(x, op=ReduceOp.SUM, group=group)
    elif policy.dp_scale == "pre_post_divide":
        pre = _predivide_factor(dense_dp)
        x.div_(pre)
        comm.all_reduce(x, op=ReduceOp.SUM, group=group)
        x.div_(dense_dp / pre)
    else:
        comm.all_reduce(x, op=ReduceOp.SUM, group=group)
        x.mul_(1.0 / dense_dp)
    return x.to(value.dtype)


def _predivide_factor(world: int) -> int:
    """FSDP's split of ``1/world`` into a pre- and post-divide factor (powers of two)."""
    factor = 1
    while world % factor == 0 and world / factor > factor:
        factor *= 2
    return factor


def _boundary(comm, tp_group, tp, dense_dp, states: list[_ParamState], policy, config, trace, step) -> None:
    for s in states:  # the engine's folding pass at the boundary: it only clears markers that are set
        s.marker = False
    for s in states:
        for stage in policy.boundary_stages(s.spec.family, tp):
            s.hp.copy_(_apply(comm, tp_group, stage, s.hp, policy, seed=(config.seed, step, BOUNDARY, 0, 0)))
        if policy.correct_at == "boundary":
            trace.capture(step, BOUNDARY, s.spec.name, "boundary_corrected", s.hp)
        if policy.dp_at == "boundary":
            s.hp.copy_(_dp_reduce(comm, s.hp, s.spec.family, dense_dp, policy))
        trace.capture(step, BOUNDARY, s.spec.name, "dp_reduced", s.hp)
    norm = global_norm(comm, states, tp_group)
    trace.scalars[(step, "grad_norm")] = norm
    if config.max_norm > 0:
        coef = config.max_norm / (norm + 1e-6)
        if coef < 1:
            for s in states:
                s.hp.mul_(coef)
    for s in states:
        trace.capture(step, BOUNDARY, s.spec.name, "clipped", s.hp)
        adamw_step(s.master, s.hp.to(s.master.dtype), s.m, s.v, step + 1, config.adam)
        s.lp.copy_(s.master)  # round to nearest even into the low-precision parameter
        for stage, value in (("master", s.master), ("adam_m", s.m), ("adam_v", s.v), ("param", s.lp)):
            trace.capture(step, BOUNDARY, s.spec.name, stage, value)
        s.hp.zero_()
        s.has_grad = False


def global_norm(comm, states: list[_ParamState], tp_group) -> float:
    """DeepSpeed's de-duplicated global L2 norm of the high-precision gradients, as a Python float.

    Replicated parameters count on TP rank 0 only; model-parallel and expert
    parameters on every rank. Squared norms are summed in fp32, dense ones
    all-reduced over TP and expert ones over EP, and the two norms combined
    in double precision.
    """
    tp_rank = tp_group.rank_of(comm.get_rank())
    dense = torch.zeros(1, dtype=torch.float32)
    expert = torch.zeros(1, dtype=torch.float32)
    for s in states:
        if not s.has_grad or not (tp_rank == 0 or s.spec.family.counted_on_every_tp_rank):
            continue
        square = s.hp.float().norm(2) ** 2
        (expert if s.spec.family is Family.EXPERT else dense).add_(square)
    comm.all_reduce(dense, group=tp_group)
    comm.all_reduce(expert, group=comm.group("ep"))
    norms = torch.cat([dense.sqrt(), expert.sqrt()])
    return float((norms**2).sum().item()) ** 0.5


def adamw_step(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, step: int, h: AdamW) -> None:
    """One AdamW step in the parameter's dtype, in FusedAdam's AdamW-mode order of operations.

    ``m = b1*m + (1-b1)*g``; ``v = b2*v + (1-b2)*g*g``;
    ``p -= lr * ((m / bc1) / (sqrt(v / bc2) + eps) + wd * p)`` with
    ``bc_i = 1 - b_i**step`` computed in double and used in the tensor dtype.
    """
    bc1 = 1.0 - h.beta1**step
    bc2 = 1.0 - h.beta2**step
    m.mul_(h.beta1).add_(g.to(m.dtype), alpha=1.0 - h.beta1)
    v.mul_(h.beta2).addcmul_(g.to(v.dtype), g.to(v.dtype), value=1.0 - h.beta2)
    denom = (v.to(p.dtype) / bc2).sqrt_().add_(h.eps)
    update = (m.to(p.dtype) / bc1).div_(denom).add_(p, alpha=h.weight_decay)
    p.add_(update, alpha=-h.lr)
