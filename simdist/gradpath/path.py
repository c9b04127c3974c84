"""The BF16 mixed-precision gradient path of DeepSpeed's BF16_Optimizer under AutoEP+AutoTP folding.

`train_rank` is a rank program (``fn(comm, ...)``): it runs on `SimWorld` and
on `TorchComm` alike. Per optimizer step it does what DeepSpeed does, with
each precision choice taken from a `Policy`:

Every micro-step, for every parameter (``_update_hp_grad``):
  1. unless the correction-once marker is set, apply the family's TP
     correction (the policy's stages: staging cast, all_reduce[tp], ``/tp``,
     writeback) and set the marker;
  2. accumulate into the high-precision buffer (``+=hp``);
  3. the local gradient is zeroed by the next backward prologue.

At the gradient-accumulation boundary (``DeepSpeedEngine.allreduce_gradients``):
  4. DeepSpeedEngine's folding pass clears each set marker (for a parameter whose
     marker is not set it would correct ``lp.grad``, which BF16_Optimizer no
     longer reads);
  5. data-parallel reduction of the high-precision buffers: dense over the
     dense-DP group, experts over the EDP group, both normalised by the dense
     DP size (``sum`` then ``* 1/dp`` by default);
  6. global gradient norm with TP/EP de-duplication, optional clipping;
  7. AdamW on the masters (``torch.optim.AdamW``'s own arithmetic, see `adamw_step`), copy of the
     masters back into the BF16 parameters (round to nearest even).

Correction-once marker (``marker="deepspeed"``, the default: as DeepSpeed 0.19.8 ships it, for the
chosen update path). `auto_ep_folding.apply_folding_correction_to_grad_buffer` (auto_ep_folding.py:470-484)
skips a parameter whose marker is set and sets it after correcting. Who clears it depends on the path:

* ``update_path="hooks"`` (``immediate_grad_update=True``): the gradient hook,
  `bf16_optimizer.accumulate_hp_grads_and_remove_lp` (bf16_optimizer.py:707-716), calls
  ``clear_autoep_folding_gradient_corrected`` right after ``_update_hp_grad`` on every call, so
  every micro-step is corrected;
* ``update_path="epilogue"`` (DeepSpeed's default: ``immediate_grad_update: bool = False``,
  runtime/precision_config.py:51): ``update_hp_grads`` never clears it; only DeepSpeedEngine's boundary
  pass ``_reduce_autoep_folding_tp_replicated_gradients`` (engine.py:3099-3119) does, so with
  GAS >= 2 micro-steps 2..GAS are added to the buffer *uncorrected*.

``marker="per_micro_step"`` clears it after every micro-step on either path, which is what the
oracles and the intended semantics do.

The stage logic is written once, in `simdist.gradpath.kernel.GradPath`; `train_rank` is its per-rank
adapter (`CommOps`: collectives on the rank's process groups) and `simdist.gradpath.batched.BatchedPath`
its rank-batched one. Inputs are strict: ``marker`` and ``update_path`` are `Marker` / `UpdatePath`
values (or their strings; anything else raises `simdist.errors.UsageError`, a ``ValueError``, listing the
valid ones); a delivered gradient must have the parameter's dtype (``policy.grad_dtype``) and shape, be
delivered once per micro-step, and every parameter not declared frozen (``ParamSpec(..., frozen=True)``) must
get one on every micro-step -- else `UsageError` naming the parameter, what was expected and what was got.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from simdist.errors import UsageError, coerce
from simdist.gradpath.families import ParamSpec
from simdist.gradpath.kernel import GradPath, Marker, UpdatePath, adamw_step
from simdist.gradpath.policy import Policy, predivide_factor
from simdist.gradpath.probes import Trace
from simdist.numerics.rounding import stochastic_round
from simdist.reduce import ReduceOp, Reduction
from simdist.world.groups import Comm

__all__ = [
    "AdamW",
    "CommOps",
    "GradPath",
    "GradientSource",
    "LocalGrads",
    "Marker",
    "PathConfig",
    "UpdatePath",
    "adamw_step",
    "predivide_factor",
    "stochastic_generator",
    "train_rank",
]


@dataclass(frozen=True)
class AdamW:
    """AdamW hyper-parameters (DeepSpeed's and ``torch.optim.AdamW``'s defaults; weight decay 0.01)."""

    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.01


@dataclass(frozen=True)
class PathConfig:
    """How many steps, micro-steps, and which of DeepSpeed's semantics (marker, update path) a run uses."""

    steps: int = 3
    gas: int = 1
    max_norm: float = 0.0
    marker: Marker = Marker.DEEPSPEED
    update_path: UpdatePath = UpdatePath.EPILOGUE
    seed: int = 0
    adam: AdamW = field(default_factory=AdamW)

    def __post_init__(self) -> None:
        if self.steps < 1 or self.gas < 1:
            raise UsageError(f"steps and gas must be >= 1, got steps={self.steps}, gas={self.gas}")
        # strings are accepted and checked: a typo raises instead of running as the default
        object.__setattr__(self, "marker", coerce(Marker, self.marker, "marker"))
        object.__setattr__(self, "update_path", coerce(UpdatePath, self.update_path, "update_path"))


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
    What it returns (the MoE source: its loss) is not used.
    """

    def backward(
        self,
        comm: Comm,
        step: int,
        micro: int,
        lp: dict[str, torch.Tensor],
        deliver: Callable[[str, torch.Tensor], None],
        hooks: bool,
    ) -> object: ...


class CommOps:
    """`simdist.gradpath.kernel.Ops` over a `Comm`: one rank's tensors, collectives on its process groups.

    Works on `SimWorld` threads and on `TorchComm` (real torch.distributed process groups) alike.
    """

    batch: tuple[int, ...] = ()

    def __init__(self, comm: Comm, seed: int) -> None:
        self.comm, self.seed = comm, seed
        self.rank = comm.get_rank()
        self.groups = {kind: comm.group(kind) for kind in ("tp", "dp", "edp", "ep")}
        self.tp_root = self.groups["tp"].rank_of(self.rank) == 0

    def all_reduce(self, value: torch.Tensor, kind: str, reduction: Reduction | None = None) -> torch.Tensor:
        group = self.groups[kind]
        if (
            reduction is not None
        ):  # the policy's own order: gather every member's value (exact), then the reduction's sum
            gathered = torch.empty(group.size * value.numel(), dtype=value.dtype, device=value.device)
            self.comm.all_gather_into_tensor(gathered, value.contiguous().view(-1), group=group)  # flat: gloo's shapes
            return reduction.reduce(gathered.view(group.size, *value.shape))
        out = value.clone()
        self.comm.all_reduce(out, op=ReduceOp.SUM, group=group)
        return out

    def stochastic_cast(self, value: torch.Tensor, dtype: torch.dtype, key: tuple[int, int, int]) -> torch.Tensor:
        step, micro, index = key
        return stochastic_round(value, dtype, stochastic_generator(self.seed, step, micro, self.rank, index))

    def on_tp_root(self, value: torch.Tensor) -> torch.Tensor | None:
        return value if self.tp_root else None

    def grad_norm(self, total: torch.Tensor) -> float:
        return float(total.item()) ** 0.5


def stochastic_generator(seed: int, step: int, micro: int, rank: int, index: int) -> torch.Generator:
    """The generator of stochastic rounding for one rank, step, micro-step and parameter index."""
    return torch.Generator().manual_seed(zlib.crc32(repr((seed, step, micro, rank, index)).encode()))


def train_rank(
    comm: Comm,
    params: list[ParamSpec],
    initial: Callable[[int, ParamSpec], torch.Tensor],
    local_grads: LocalGrads | GradientSource,
    policy: Policy,
    config: PathConfig,
    keep: frozenset[str] | None = None,
) -> Trace:
    """Run ``config.steps`` optimizer steps of the gradient path on this rank; return its captures.

    The stage logic is `simdist.gradpath.kernel.GradPath`; this is its per-rank adapter (`CommOps`).
    """
    ops = CommOps(comm, config.seed)
    rank = ops.rank
    trace = Trace(rank, keep)
    lp = (
        torch.cat([initial(rank, p).to(policy.grad_dtype).reshape(-1) for p in params])
        if params
        else torch.zeros(0, dtype=policy.grad_dtype)
    )
    tp = comm.get_world_size(ops.groups["tp"])
    dp = comm.get_world_size(ops.groups["dp"])

    def scalar(step: int, name: str, value: float) -> None:
        trace.scalars[(step, name)] = value

    path = GradPath(ops, params, policy, config, lp, tp=tp, dp=dp, capture=trace.capture, scalar=scalar)
    hooks = config.update_path is UpdatePath.HOOKS
    for step in range(config.steps):
        for micro in range(config.gas):
            path.begin_micro()

            def deliver(name: str, grad: torch.Tensor, step=step, micro=micro) -> None:
                path.deliver(name, grad, step, micro)

            if isinstance(local_grads, GradientSource):
                local_grads.backward(comm, step, micro, path.params("lp"), deliver, hooks)
            else:
                for slot in path.delivery_order():
                    deliver(slot.spec.name, local_grads(step, micro, rank, slot.spec))
            path.end_micro(step, micro)
        path.boundary(step)
    return trace
