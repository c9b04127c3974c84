"""Drive DeepSpeed's real ``BF16_Optimizer`` folding path on a process group, micro-step by micro-step.

`deepspeed_rank` is a rank program (``fn(comm, runs, seed)``, see
`simdist.cases.ranks.run_ranks`). In each rank process it

1. wraps the already-initialised torch.distributed group in DeepSpeed's
   communication layer (``deepspeed.comm.init_distributed``) with the
   shared-memory CPU op disabled: that op is compiled on first use, serves
   only ``inference_all_reduce``, and must not build in CI;
2. creates DeepSpeed's own groups: TP/DP with
   ``groups._init_tp_groups_with_new_group`` and EP/EDP with
   ``groups._create_expert_and_data_parallel(..., folding_spec=...)``, the
   call the engine makes for AutoEP+AutoTP folding; the rank tables are
   checked against simdist's `ParallelSpec`;
3. for every requested `DsRun`, builds a module whose parameters are
   simdist's synthetic parameters (names, shapes, BF16 initial weights), tags
   each with DeepSpeed's family markers (router: ``mark_autoep_folding_*``;
   TP-sharded: ``tensor_model_parallel``; routed experts: ``allreduce=False``
   in an MoE param group), wraps a plain ``torch.optim.SGD`` in
   ``BF16_Optimizer`` (no ``deepspeed.initialize``, no fused op, nothing
   compiled) and calls ``configure_autoep_folding_tp_gradient_reduction``;
4. runs the engine's per-micro-step sequence: ``backward_prologue``, a real
   autograd backward whose gradient is exactly simdist's seeded BF16 local
   gradient, ``backward_epilogue`` (``update_hp_grads``; with
   ``immediate_grad_update`` the post-accumulate-grad hooks have called
   ``accumulate_hp_grads_and_remove_lp`` during backward instead), and at the
   accumulation boundary the engine's own folding pass
   (``DeepSpeedEngine._reduce_autoep_folding_tp_replicated_gradients``,
   called on a stand-in engine);
5. captures, after every micro-step, each parameter's local gradient and
   its high-precision gradient (``fp32_groups_gradients``) into a simdist
   `Trace` (stages ``local`` and ``hp``), and what every call of the folding
   helper did (corrected, or skipped because the correction-once marker was
   set).

``fix="fp32_staging"`` replaces ``_update_hp_grad`` on the optimizer instance
with the fix proposed in #8913 (written here, not copied): copy ``lp.grad``
into an FP32 staging tensor, apply DeepSpeed's own folding helper to the
staging tensor, add it to the FP32 buffer; readiness flag, marker and
clearing behave as before.

Not driven: the data-parallel reduction and the optimizer step (the hp
gradient before them is the #8913 boundary).
"""

from __future__ import annotations

import importlib
import types
from dataclasses import dataclass, field
from typing import Literal

import torch

from simdist.gradpath.families import Family
from simdist.gradpath.kernel import UpdatePath
from simdist.gradpath.probes import Trace

Fix = Literal["none", "fp32_staging"]

CORRECTED = "corrected"
SKIPPED_MARKER = "skipped: marker set"
SKIPPED_FAMILY = "skip"


@dataclass(frozen=True)
class DsRun:
    """One run of the real optimizer: update path, micro-steps, steps and whether the #8913 fix is applied."""

    update_path: UpdatePath = UpdatePath.EPILOGUE
    gas: int = 1
    steps: int = 2
    fix: Fix = "none"

    @property
    def label(self) -> str:
        fix = "" if self.fix == "none" else f" + {self.fix} patch"
        return f"{self.update_path} GAS {self.gas}{fix}"


@dataclass
class RankCapture:
    """One rank's captures of one `DsRun`."""

    run: DsRun
    trace: Trace
    actions: dict[tuple[int, int, str], str] = field(default_factory=dict)
    """``(step, micro, param) -> what the folding helper did`` (`CORRECTED`, `SKIPPED_MARKER`, ...)."""
    strategies: dict[str, str] = field(default_factory=dict)
    """DeepSpeed's reduction strategy per parameter (``average``, ``sum``, ``skip``, ``expert_tp_cancel``)."""
    deepspeed_version: str = ""


def deepspeed_rank(comm, runs: tuple[DsRun, ...], seed: int, inputs: str = "narrow") -> list[RankCapture]:
    """Rank program: every `DsRun` on this rank's real DeepSpeed optimizer; one `RankCapture` each.

    ``inputs`` names the synthetic gradients' distribution (`simdist.sources.synthetic.Inputs`; ``narrow``, the
    old one, unless the caller names another). DeepSpeed's log lines go to stderr (`simdist.cases.stdout`):
    stdout belongs to the CLI's report.
    """
    from simdist.cases.stdout import stdout_to_stderr

    with stdout_to_stderr():
        return _deepspeed_rank(comm, runs, seed, inputs)


def _deepspeed_rank(comm, runs: tuple[DsRun, ...], seed: int, inputs: str) -> list[RankCapture]:
    import deepspeed

    from simdist.sources.synthetic import DEFAULT_PARAMS, InitialWeights, synthetic_gradients

    spec = comm.spec
    folding = _setup_deepspeed(spec)
    local_grads = synthetic_gradients(spec, seed, inputs)
    initial = InitialWeights(spec, seed)
    return [
        _drive(comm.get_rank(), spec, folding, DEFAULT_PARAMS, initial, local_grads, run, deepspeed.__version__)
        for run in runs
    ]


def _quiet() -> None:
    import logging

    from deepspeed.utils import logger

    logger.setLevel(logging.ERROR)


def _setup_deepspeed(spec):
    """DeepSpeed's comm layer and process groups on the current torch.distributed world; the folding spec."""
    _quiet()
    from deepspeed import comm as ds_comm
    from deepspeed.module_inject.auto_ep_folding import build_folding_spec, local_folding_ranks
    from deepspeed.utils import groups

    # ``import deepspeed.comm.torch as m`` would bind torch itself (the package re-exports it).
    ds_torch = importlib.import_module("deepspeed.comm.torch")
    ds_torch.build_shm_op = lambda: None  # the shm CPU op compiles on first use; collectives don't need it
    ds_comm.init_distributed(dist_backend="gloo", dist_init_required=False, verbose=False)
    folding = build_folding_spec(
        world_size=spec.world_size, pp_size=spec.pp, tp_size=spec.tp, ep_size=spec.ep, etp_size=spec.etp, mp_mode="tp"
    )
    groups._init_tp_groups_with_new_group(spec.tp)
    groups._create_expert_and_data_parallel(
        spec.ep, mp_size=spec.tp, pp_size=spec.pp, mp_mode="tp", folding_spec=folding
    )
    rank = torch.distributed.get_rank()
    theirs = local_folding_ranks(rank, folding)
    ours = {"tp": "tp", "dense_dp": "dp", "ep": "ep", "edp": "edp"}
    for kind, mine in ours.items():
        if tuple(sorted(theirs[kind])) != spec.group_of(mine, rank):
            raise RuntimeError(
                f"DeepSpeed's {kind} group of rank {rank} is {theirs[kind]}, simdist's "
                f"{mine} group is {spec.group_of(mine, rank)}: the layouts differ"
            )
    return folding


def _module(params, initial, rank: int, ep: int):
    """A module holding ``params`` (dotted names) with DeepSpeed's family markers; ``(module, param groups)``."""

    root = torch.nn.Module()
    dense: list[torch.nn.Parameter] = []
    experts: list[torch.nn.Parameter] = []
    for p in params:
        *path, leaf = p.name.split(".")
        owner = root
        for part in path:
            if not hasattr(owner, part):
                owner.add_module(part, torch.nn.Module())
            owner = getattr(owner, part)
        param = torch.nn.Parameter(initial(rank, p).to(torch.bfloat16).clone())
        owner.register_parameter(leaf, param)
        mark_family(param, p.family, ep)
        (experts if p.family is Family.EXPERT else dense).append(param)
    param_groups: list[dict[str, object]] = [{"params": dense}]
    if experts:
        param_groups.append({"params": experts, "moe": True, "name": f"ep_size_{ep}"})
    return root, param_groups


def mark_family(param: torch.nn.Parameter, family: Family, ep: int) -> None:
    """Mark ``param`` as DeepSpeed's AutoEP/AutoTP injection would for its family (its own marker functions for
    routers; the ad-hoc attributes DeepSpeed reads for TP-sharded and expert parameters)."""
    from deepspeed.module_inject import auto_ep_folding as fold

    if family is Family.ROUTER_GATE_REPLICATED:
        fold.mark_autoep_folding_router_parameter(param)
    elif family is Family.ROUTER_GATE_PARTIAL:
        fold.mark_autoep_folding_partial_router_parameter(param)
    elif family is Family.MODEL_PARALLEL:
        # DeepSpeed's family markers are ad-hoc attributes that torch's Parameter does not declare
        param.tensor_model_parallel = True  # type: ignore[attr-defined]
    elif family is Family.EXPERT:
        param.allreduce = False  # type: ignore[attr-defined]
        param.group_name = f"ep_size_{ep}"  # type: ignore[attr-defined]


def _staged_update_hp_grad(self, lp, group_idx, param_idx, clear_lp_grads):
    """The #8913 fix: correct an FP32 staging copy of ``lp.grad`` and add it to the FP32 buffer directly."""
    bf16_module = importlib.import_module("deepspeed.runtime.bf16_optimizer")
    if lp.grad is None:
        return
    hp_grad = self.fp32_groups_gradients[group_idx][param_idx]
    staging = lp.grad.data.to(hp_grad.dtype, copy=True)
    if self.autoep_folding_tp_group is not None and getattr(lp, "ds_grad_is_ready", True):
        bf16_module.apply_folding_correction_to_grad_buffer(
            self.autoep_folding_spec,
            lp,
            staging,
            tp_group=self.autoep_folding_tp_group,
            param_name=self.param_names.get(lp),
        )
    hp_grad.data.add_(staging.view(hp_grad.shape))
    lp._hp_grad = hp_grad
    self.fp32_groups_has_gradients[group_idx][param_idx] = True
    if clear_lp_grads:
        lp.grad.zero_()


class _HelperSpy:
    """Records what each call of the folding helper did, then calls the real helper unchanged."""

    def __init__(self, real, names: dict) -> None:
        self.real, self.names = real, names
        self.step_micro: tuple[int, int] = (0, 0)
        self.actions: dict[tuple[int, int, str], str] = {}

    def __call__(self, folding_spec, param, grad, **kwargs):
        from deepspeed.module_inject.auto_ep_folding import is_autoep_folding_gradient_corrected

        was_set = is_autoep_folding_gradient_corrected(param)
        strategy = self.real(folding_spec, param, grad, **kwargs)
        action = SKIPPED_MARKER if was_set else (SKIPPED_FAMILY if strategy == "skip" else CORRECTED)
        self.actions[(*self.step_micro, self.names[param])] = action
        return strategy


def _drive(rank, spec, folding, params, initial, local_grads, run: DsRun, version: str) -> RankCapture:
    from deepspeed.module_inject.auto_ep_folding import autoep_folding_gradient_reduction_strategy
    from deepspeed.runtime import bf16_optimizer as bf16_module
    from deepspeed.runtime.engine import DeepSpeedEngine

    module, param_groups = _module(params, initial, rank, spec.ep)
    names = {p: n for n, p in module.named_parameters()}
    by_name = {n: p for p, n in names.items()}
    optimizer = _bf16_optimizer(param_groups, names, folding, run)
    engine = types.SimpleNamespace(
        _autoep_folding_spec=folding,
        optimizer=optimizer,
        module=module,
        zero_optimization_partition_weights=lambda: False,
    )
    spy = _HelperSpy(bf16_module.apply_folding_correction_to_grad_buffer, names)
    capture = RankCapture(run, Trace(rank), spy.actions, deepspeed_version=version)
    capture.strategies = {
        n: str(autoep_folding_gradient_reduction_strategy(folding, p, param_name=n)) for n, p in by_name.items()
    }
    hp_of = {
        names[lp]: optimizer.fp32_groups_gradients[i][j]
        for i, group in enumerate(optimizer.bf16_groups)
        for j, lp in enumerate(group)
    }
    real_helper = bf16_module.apply_folding_correction_to_grad_buffer
    bf16_module.apply_folding_correction_to_grad_buffer = spy
    try:
        for step in range(run.steps):
            for micro in range(run.gas):
                spy.step_micro = (step, micro)
                grads = {p.name: local_grads(step, micro, rank, p) for p in params}
                optimizer.backward_prologue()
                loss = sum((by_name[name] * grad).sum() for name, grad in grads.items())
                if run.update_path == UpdatePath.EPILOGUE:
                    loss.backward()
                    for name, p in by_name.items():
                        capture.trace.capture(step, micro, name, "local", p.grad)
                else:
                    _backward_capturing_local(loss, by_name, capture.trace, step, micro)
                optimizer.backward_epilogue()
                for name, hp in hp_of.items():
                    capture.trace.capture(step, micro, name, "hp", hp.view(by_name[name].shape))
                if micro == run.gas - 1:
                    DeepSpeedEngine._reduce_autoep_folding_tp_replicated_gradients(engine)
            optimizer.clear_hp_grads()
            optimizer.clear_lp_grads()
    finally:
        bf16_module.apply_folding_correction_to_grad_buffer = real_helper
        optimizer.destroy()
    return capture


def _bf16_optimizer(param_groups: list[dict], names: dict, folding, run: DsRun):
    """DeepSpeed's BF16_Optimizer over ``param_groups`` (an SGD at lr 0 inside: only the gradient path is
    compared), FP32 gradient accumulation, the AutoEP folding TP correction configured, on ``run``'s update path
    (``immediate_grad_update`` for the hooks path), with the FP32-staging fix patched in where ``run`` asks."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config
    from deepspeed.utils import groups

    config = DeepSpeedBF16Config(enabled=True, immediate_grad_update=run.update_path == UpdatePath.HOOKS)
    optimizer = BF16_Optimizer(
        torch.optim.SGD(param_groups, lr=0.0),
        names,
        config,
        dp_process_group=groups.get_data_parallel_group(),
        grad_acc_dtype=torch.float32,
        has_moe_layers=any(g.get("moe") for g in param_groups),
    )
    optimizer.configure_autoep_folding_tp_gradient_reduction(folding)
    if run.fix == "fp32_staging":
        optimizer._update_hp_grad = types.MethodType(_staged_update_hp_grad, optimizer)
    return optimizer


def _backward_capturing_local(loss, by_name, trace: Trace, step: int, micro: int) -> None:
    """Backward with ``immediate_grad_update``: record each gradient as autograd computes it.

    DeepSpeed's post-accumulate-grad hook consumes and frees ``p.grad``, so the
    local gradient is read by a tensor hook, which sees it before accumulation
    (into a ``None`` grad, so the value accumulated is this one).
    """
    handles = [
        p.register_hook(lambda g, name=name: trace.capture(step, micro, name, "local", g))
        for name, p in by_name.items()
    ]
    try:
        loss.backward()
    finally:
        for h in handles:
            h.remove()
