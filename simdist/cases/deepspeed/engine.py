"""Drive the real DeepSpeed engine (``deepspeed.initialize``, ``engine.backward``, ``engine.step``) under folding.

`engine_rank` is a rank program (``fn(comm, runs, seed)``, `simdist.cases.ranks.run_ranks`). For every
`EngineRun` it builds the engine from a DeepSpeed config -- bf16, the ZeRO stage that selects the wrapper,
``communication_data_type``, GAS, gradient clipping, ``tensor_parallel.autotp_size`` and ``expert_parallel``
(AutoEP) -- with ``torch.optim.AdamW`` as the client optimizer, and runs real micro-steps: ``engine(grads)``,
``engine.backward(loss)``, ``engine.step()``.

What DeepSpeed does itself, unmodified: the folding spec (``build_folding_spec``), its validation
(``validate_folding_global``, ``validate_autoep_config``), every process group (TP mesh from
``_configure_tensor_parallel_states``, EP/EDP from ``_create_expert_and_data_parallel(folding_spec=...)``,
the ``FoldingGroupHandles``), the optimizer wrapper chosen from the config, the wrapper's
``configure_autoep_folding_tp_gradient_reduction``, its reduce hooks and buckets, the engine's boundary
folding pass, the global norm, clipping and the optimizer step.

What is done by hand, and why: AutoEP's MoE detection (``AutoEP.ep_parser``) and AutoTP's sharding
(``DeepSpeedEngine._apply_autotp_partitioning``) are replaced by no-ops, because both recognise Hugging Face
model classes through presets (``transformers`` is not installed here, and the replaced AutoEP layer's
token dispatch needs CUDA/Triton kernels). The module is simdist's synthetic parameter set, already shaped
as one rank's shards; its parameters get DeepSpeed's own family markers (``mark_autoep_folding_*``,
``tensor_model_parallel``, ``allreduce=False`` + MoE param group) -- the markings the replaced layers would
set -- and ``engine.has_moe_layers`` is set after ``_configure_expert_parallel`` (the replaced AutoEP layer
would have set it). Each parameter's gradient is exactly the seeded synthetic BF16 local gradient
(the loss is ``sum(p * g)``; the engine's 1/GAS loss scale makes it ``g / GAS``, exact for GAS 1 and 4).

Captures (per rank): the BF16 local gradient (tensor hook), every call of the folding helper (corrected or
skipped by the correction-once marker, the FP32 TP-reduced value before it is written back, the buffer after
the write-back), BF16_Optimizer's FP32 accumulation buffer after each micro-step, and at the boundary the
DP-reduced gradient, the global norm, the FP32 master and both Adam moments (``deepspeed.utils``
``safe_get_full_*``, DeepSpeed's public accessors for every wrapper).
"""

from __future__ import annotations

import contextlib
import importlib
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal, cast

import torch

from simdist.cases.deepspeed.harness import mark_family
from simdist.cases.deepspeed.spy import HelperCall, HelperSpy, patched, spy_on_corrections
from simdist.errors import UsageError
from simdist.gradpath.families import Family

Wrapper = Literal["bf16_optimizer", "zero1", "zero2", "zero3"]
WRAPPERS: tuple[str, ...] = ("bf16_optimizer", "zero1", "zero2", "zero3")
LR, BETAS, EPS, WEIGHT_DECAY = 1e-3, (0.9, 0.999), 1e-8, 0.01


@dataclass(frozen=True)
class EngineRun:
    """One engine configuration: wrapper, its switches, GAS, steps, clipping and whether the fix is patched in."""

    wrapper: Wrapper = "bf16_optimizer"
    immediate: bool = False
    """``bf16.immediate_grad_update`` (BF16_Optimizer only)."""
    overlap_comm: bool = False
    contiguous_gradients: bool = True
    reduce_bucket_size: int = 0
    """0: DeepSpeed's default; small values split the reduction into several buckets."""
    comm_dtype: Literal["default", "fp32"] = "default"
    gas: int = 1
    steps: int = 1
    clip: float = 0.0
    fix: Literal["none", "fp32_staging"] = "none"
    accum_fp32: bool = False
    """``data_types.grad_accum_dtype: fp32`` on a ZeRO wrapper (BF16_Optimizer always has it)."""
    audit: bool = True
    """Run ``simdist.audit`` around every backward and step in the rank process (the narrowing sites found)."""
    experts: bool = True
    """Whether the module holds the routed-expert parameter (ZeRO-3 refuses MoE without a real AutoEP layer)."""

    def params(self):
        """The synthetic parameters this run's module holds."""
        from simdist.sources.synthetic import DEFAULT_PARAMS

        return tuple(p for p in DEFAULT_PARAMS if self.experts or p.family is not Family.EXPERT)

    @property
    def label(self) -> str:
        parts: list[str] = [self.wrapper]
        if self.wrapper == "bf16_optimizer":
            parts.append("immediate" if self.immediate else "epilogue")
        if self.wrapper in ("zero1", "zero2"):
            parts.append("overlap" if self.overlap_comm else "no-overlap")
            if not self.contiguous_gradients:
                parts.append("non-contiguous")
        if self.reduce_bucket_size:
            parts.append(f"bucket {self.reduce_bucket_size}")
        parts.append(f"comm {'fp32' if self.comm_dtype == 'fp32' else 'bf16(default)'}")
        parts.append(f"GAS {self.gas}")
        if self.clip:
            parts.append(f"clip {self.clip:g}")
        if self.accum_fp32 and self.wrapper != "bf16_optimizer":
            parts.append("grad_accum fp32")
        if not self.experts:
            parts.append("no experts")
        if self.fix != "none":
            parts.append(f"+ {self.fix} patch")
        return " ".join(parts)

    def config(self, spec) -> dict:
        """The DeepSpeed config of this run."""
        stage = {"bf16_optimizer": 1, "zero1": 1, "zero2": 2, "zero3": 3}[self.wrapper]
        zero: dict = {"stage": stage}
        if stage in (1, 2):
            zero.update(overlap_comm=self.overlap_comm, contiguous_gradients=self.contiguous_gradients)
        if self.reduce_bucket_size:
            zero["reduce_bucket_size"] = self.reduce_bucket_size
        if stage == 3:
            zero.update(stage3_param_persistence_threshold=0, stage3_max_live_parameters=0)
        config = {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": self.gas,
            "bf16": {"enabled": True, "immediate_grad_update": self.immediate},
            "zero_optimization": zero,
            "gradient_clipping": self.clip,
            "tensor_parallel": {"autotp_size": spec.tp},
            "expert_parallel": {"enabled": True, "autoep_size": spec.ep},
            "steps_per_print": 10**9,
            "zero_allow_untested_optimizer": True,
        }
        if self.wrapper == "bf16_optimizer" or self.accum_fp32:
            config["data_types"] = {"grad_accum_dtype": "fp32"}  # bf16 + ZeRO-1 + FP32 accumulation = BF16_Optimizer
        if self.comm_dtype == "fp32":
            config["communication_data_type"] = "fp32"
        return config


@dataclass
class EngineCapture:
    """One rank's captures of one `EngineRun`."""

    run: EngineRun
    rank: int
    optimizer_class: str = ""
    local: dict[tuple[int, int, str], torch.Tensor] = field(default_factory=dict)
    calls: list[HelperCall] = field(default_factory=list)
    hp: dict[tuple[int, int, str], torch.Tensor] = field(default_factory=dict)
    """BF16_Optimizer's FP32 accumulation buffer after each micro-step (at the boundary: before the DP reduce)."""
    reduced: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)
    norm: dict[int, float] = field(default_factory=dict)
    master: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)
    exp_avg: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)
    exp_avg_sq: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)
    narrowing: list[dict] = field(default_factory=list)
    """The audit's sites on this rank (``at``, ``function``, ``op``, ``kind``, ``dtypes``, ``count``,
    ``max_rel_error``): every narrowing cast/accumulate/store and every collective with its dtype."""
    error: str = ""
    """Why the run could not be driven (the engine raised): the exception's first line."""


class _Leaf(torch.nn.Module):
    """Holds some parameters; ``forward(grads) = sum(p * g)`` over them (ZeRO-3 gathers a module's own params)."""

    def forward(self, grads: dict[str, torch.Tensor], prefix: str) -> torch.Tensor:
        # sum() starts from the int 0; the leaves of the one-level parameter names hold parameters: a tensor
        return cast(
            torch.Tensor,
            sum((p * grads[prefix + n].to(p.dtype)).sum() for n, p in self.named_parameters(recurse=False)),
        )


class SyntheticModule(torch.nn.Module):
    """simdist's synthetic parameters as one rank's shards; ``forward = sum(p * g)`` so ``dL/dp = g``.

    The gradients ``g`` are set in ``self.grads`` before each forward, not passed as input: AutoTP checks that
    a forward's inputs are identical on TP peers, and the local gradients of TP peers differ.
    """

    def __init__(self, params, initial, rank: int) -> None:
        super().__init__()
        for p in params:
            *path, leaf = p.name.split(".")
            owner: torch.nn.Module = self
            for part in path:
                if not hasattr(owner, part):
                    owner.add_module(part, _Leaf())
                owner = getattr(owner, part)
            owner.register_parameter(leaf, torch.nn.Parameter(initial(rank, p).to(torch.bfloat16).clone()))
        self.grads: dict[str, torch.Tensor] = {}

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return sum(leaf(self.grads, f"{name}.") for name, leaf in self.named_children())


def mark_families(module: torch.nn.Module, params, ep: int) -> list[dict]:
    """DeepSpeed's family markers on each parameter; the client optimizer's param groups (experts: MoE group)."""

    named = dict(module.named_parameters())
    dense: list[torch.nn.Parameter] = []
    experts: list[torch.nn.Parameter] = []
    for p in params:
        param = named[p.name]
        mark_family(param, p.family, ep)
        (experts if p.family is Family.EXPERT else dense).append(param)
    groups: list[dict[str, object]] = [{"params": dense, "name": "dense"}]
    if experts:
        groups.append({"params": experts, "moe": True, "name": f"ep_size_{ep}"})
    return groups


@contextlib.contextmanager
def no_model_injection() -> Iterator[None]:
    """The two hand-done steps: no HF MoE block to detect, no HF preset to shard (see the module docstring)."""
    from deepspeed.module_inject.auto_ep import AutoEP
    from deepspeed.module_inject.auto_ep_layer import ReplacementSourceMap
    from deepspeed.runtime.engine import DeepSpeedEngine

    real_configure_ep = DeepSpeedEngine._configure_expert_parallel

    def configure_ep(self, model, collect_sources=None):
        sources = real_configure_ep(self, model, collect_sources=collect_sources)
        # what the replaced AutoEP layer makes _configure_distributed_model set
        self.has_moe_layers = any(getattr(p, "allreduce", True) is False for p in model.parameters())
        return sources

    with (
        patched(AutoEP, "ep_parser", lambda self: []),
        patched(DeepSpeedEngine, "_apply_autotp_partitioning", lambda self, model, tp_config: ReplacementSourceMap()),
        patched(DeepSpeedEngine, "_configure_expert_parallel", configure_ep),
    ):
        yield


def staged_update_hp_grad(self, lp, group_idx, param_idx, clear_lp_grads):
    """BF16_Optimizer fix (#8913): correct an FP32 staging copy of ``lp.grad``, add it to the FP32 buffer."""
    bf16_module = importlib.import_module("deepspeed.runtime.bf16_optimizer")
    if lp.grad is None:
        return
    hp_grad = self.fp32_groups_gradients[group_idx][param_idx]
    staging = lp.grad.data.to(hp_grad.dtype, copy=True)
    if self.autoep_folding_tp_group is not None and getattr(lp, "ds_grad_is_ready", True):
        bf16_module.apply_folding_correction_to_grad_buffer(
            self.autoep_folding_spec, lp, staging, tp_group=self.autoep_folding_tp_group,
            param_name=self.param_names.get(lp),
        )  # fmt: skip
    hp_grad.data.add_(staging.view(hp_grad.shape))
    lp._hp_grad = hp_grad
    self.fp32_groups_has_gradients[group_idx][param_idx] = True
    if clear_lp_grads:
        lp.grad.zero_()


def engine_rank(comm, runs: tuple[EngineRun, ...], seed: int, distribution: str = "rounding") -> list[EngineCapture]:
    """Rank program: every `EngineRun` on a fresh real engine; one `EngineCapture` each (DeepSpeed logs to stderr).

    ``distribution`` names the synthetic gradients' (`simdist.sources.synthetic.Inputs`)."""
    from simdist.cases.stdout import stdout_to_stderr

    with stdout_to_stderr():
        return [_drive(comm, run, seed, distribution) for run in runs]


def init_comm() -> None:
    import logging

    from deepspeed import comm as ds_comm
    from deepspeed.utils import logger

    logger.setLevel(logging.ERROR)
    ds_torch: Any = importlib.import_module("deepspeed.comm.torch")  # untyped module: no stubs
    ds_torch.build_shm_op = lambda: None  # the shm CPU op compiles on first use; collectives don't need it
    ds_comm.init_distributed(dist_backend="gloo", dist_init_required=False, verbose=False)


def reset_groups() -> None:
    """Forget DeepSpeed's module-global groups so the next engine builds its own (they persist per process)."""
    from deepspeed.utils import groups

    groups._TENSOR_MODEL_PARALLEL_GROUP = None
    groups._MODEL_PARALLEL_GROUP = None
    groups._DATA_PARALLEL_GROUP = None
    groups._EXPERT_PARALLEL_GROUP = {}
    groups._EXPERT_DATA_PARALLEL_GROUP = {}
    groups.mpu = None


def _drive(comm, run: EngineRun, seed: int, distribution: str) -> EngineCapture:
    import deepspeed

    from simdist.sources.synthetic import InitialWeights, synthetic_gradients

    spec, rank = comm.spec, comm.get_rank()
    init_comm()
    reset_groups()
    capture = EngineCapture(run, rank)
    local_grads = synthetic_gradients(spec, seed, distribution)
    module = SyntheticModule(run.params(), InitialWeights(spec, seed), rank)
    groups = mark_families(module, run.params(), spec.ep)
    names = {p: n for n, p in module.named_parameters()}
    spy = HelperSpy(capture.calls, names)
    optimizer = torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
    with contextlib.ExitStack() as stack:
        stack.enter_context(no_model_injection())
        spy_on_corrections(stack, spy)
        try:
            engine, *_ = deepspeed.initialize(model=module, optimizer=optimizer, config=run.config(spec))
        except Exception as exc:  # a configuration the engine refuses on this machine: reported, not hidden
            first = str(exc).splitlines()[0] if str(exc) else ""
            capture.error = f"deepspeed.initialize: {type(exc).__name__}: {first}"
            return capture
        capture.optimizer_class = type(engine.optimizer).__name__
        inputs = {  # made before any audit: generating them casts FP32 to BF16 outside DeepSpeed
            (step, micro): {p.name: local_grads(step, micro, rank, p) for p in run.params()}
            for step in range(run.steps)
            for micro in range(run.gas)
        }
        if run.fix == "fp32_staging":
            _apply_fix(engine, run)
        try:
            if run.audit:
                _audited_steps(engine, run, inputs, spy, capture)
            else:
                _steps(engine, run, inputs, spy, capture)
        except Exception as exc:
            import traceback

            frame = traceback.extract_tb(exc.__traceback__)[-1]
            first = str(exc).splitlines()[0] if str(exc) else ""
            capture.error = f"{type(exc).__name__}: {first} (at {frame.filename}:{frame.lineno})"
            return capture
        finally:
            with contextlib.suppress(Exception):
                engine.destroy()
    return capture


def _audited_steps(engine, run: EngineRun, inputs: dict, spy: HelperSpy, capture: EngineCapture) -> None:
    """`_steps` under `simdist.audit`: the floating-point sites DeepSpeed runs go to ``capture.narrowing``."""
    from simdist.audit import audit  # a lazy import of a lower layer (docs/ARCHITECTURE.md)

    # this module's frames (the synthetic forward) and the spy's are skipped: sites land in DeepSpeed
    with audit(skip=(__name__, HelperSpy.__module__), rank=capture.rank) as watched:
        _steps(engine, run, inputs, spy, capture)
    capture.narrowing = [
        {
            "at": site.where,
            "function": site.function,
            "op": site.op,
            "kind": site.kind,
            "dtypes": site.dtypes,
            "count": site.count,
            "max_rel_error": site.max_rel_error,
        }
        for site in watched.report().sites
    ]


def _apply_fix(engine, run: EngineRun) -> None:
    if run.wrapper == "bf16_optimizer":
        engine.optimizer._update_hp_grad = types.MethodType(staged_update_hp_grad, engine.optimizer)
        return
    raise UsageError(f"no FP32-staging patch for {run.wrapper}")


def _steps(engine, run: EngineRun, inputs: dict, spy: HelperSpy, capture: EngineCapture) -> None:
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad, safe_get_full_optimizer_state

    named = dict(engine.module.named_parameters())
    hp_of = {}
    if hasattr(engine.optimizer, "fp32_groups_gradients") and hasattr(engine.optimizer, "bf16_groups"):
        names = {p: n for n, p in named.items()}
        hp_of = {
            names[lp]: engine.optimizer.fp32_groups_gradients[i][j]
            for i, group in enumerate(engine.optimizer.bf16_groups)
            for j, lp in enumerate(group)
        }
    real_allreduce = engine.allreduce_gradients

    def allreduce_gradients(*args, **kwargs):
        """The FP32 accumulation buffer at the boundary, before the boundary pass and the DP reduction."""
        for name, hp in hp_of.items():
            capture.hp[(*spy.step_micro, name)] = hp.detach().view(named[name].shape).clone()
        return real_allreduce(*args, **kwargs)

    engine.allreduce_gradients = allreduce_gradients
    for step in range(run.steps):
        for micro in range(run.gas):
            spy.step_micro = (step, micro)
            grads = inputs[(step, micro)]
            handles = [
                param.register_hook(
                    lambda g, name=name, key=(step, micro): capture.local.__setitem__((*key, name), g.detach().clone())
                )
                for name, param in named.items()
            ]
            try:
                engine.module.grads = grads
                loss = engine(torch.tensor([step, micro]))
                engine.backward(loss)
            finally:
                for h in handles:
                    h.remove()
            for name, hp in hp_of.items():
                capture.hp.setdefault((step, micro, name), hp.detach().view(named[name].shape).clone())
            if micro == run.gas - 1:
                for name, param in named.items():
                    grad = safe_get_full_grad(param)
                    if grad is not None:
                        capture.reduced[(step, name)] = grad.detach().float().clone()
            engine.step()
        norm = engine.get_global_grad_norm()
        capture.norm[step] = float(norm) if norm is not None else float("nan")
        for name, param in named.items():
            capture.master[(step, name)] = safe_get_full_fp32_param(param).detach().clone()
            for key, store in (("exp_avg", capture.exp_avg), ("exp_avg_sq", capture.exp_avg_sq)):
                try:
                    state = safe_get_full_optimizer_state(param, key)
                except ValueError:  # DeepSpeed finds no such state for this parameter (recorded as missing)
                    state = None
                if state is not None:
                    store[(step, name)] = state.detach().clone()
