"""Case ``megatron-grad-reduce-fp32``: Megatron-Core's DDP with ``grad_reduce_in_fp32`` True and False.

Question: is Megatron-Core's real ``DistributedDataParallel`` (``megatron.core.distributed``) plus its
``finalize_model_grads`` bitwise what simdist's ``megatron_grad_reduce_fp32`` stage chain computes from the
same BF16 local gradients -- the ``main_grad`` buffer after every micro-step (GAS 2) and after the
boundary -- with ``grad_reduce_in_fp32=True`` (FP32 buffer and reduction) and ``False`` (BF16 buffer and
reduction, the policy with ``accumulate=dp_reduce=bf16``), on DP2, TP2 x DP2 and DP4?

Real code: ``parallel_state.initialize_model_parallel`` on the process group, a
``TransformerConfig``-configured ``DistributedDataParallel`` (its gradient hooks add ``param.grad`` into
``param.main_grad``; ``finish_grad_sync`` scales each bucket by ``1/dp`` and all-reduces it with SUM;
``average_in_collective=False``, the default) and ``finalize_model_grads`` (after the DP all-reduce: a TP
SUM all-reduce of the parameters marked ``sequence_parallel`` and a TP AVG all-reduce of those marked
``average_gradients_across_tp_domain``). The local gradient is exact: the forward is ``sum(p * g)`` with
``g`` simdist's seeded BF16 gradient. Families map to Megatron's markings: ``router_gate_replicated`` ->
``average_gradients_across_tp_domain`` (TP average), ``router_gate_partial`` -> ``sequence_parallel`` (TP
sum), ``dense`` (identical on TP peers) and ``model_parallel`` -> no TP reduction.

Two shims: megatron-core allocates its gradient buffers on ``torch.cuda.current_device()``, which
raises ``AssertionError: Torch not compiled with CUDA enabled`` on a CPU-only torch; each rank process
makes that function answer ``"cpu"``. megatron-core 0.19.2 (``param_and_grad_buffer.py``; the ``megatron`` extra
allows it on Python >= 3.12, and pins 0.16.1, which does not, below) also calls ``torch.cuda.current_stream()`` in
``start_grad_sync`` to wait on CUDA-graph events (none here); it answers ``torch.cpu.current_stream()``, whose
waits are no-ops. Megatron's arithmetic is untouched. Megatron keeps its process groups in module globals
(``megatron.core.parallel_state``), so the ranks are processes (``gloo`` or the simdist backend in process mode),
one world per process.

Where the chains claim equality: every parameter on DP2 and TP2 x DP2 -- the micro-step accumulation and
the boundary, where the policy, like Megatron, runs the TP correction *after* the DP reduction
(``correct_at="after_dp"``, what ``finalize_model_grads`` does). The case also reports the order effect:
the same policy with the TP correction before the DP reduction (``correct_at="boundary"``, this policy's
chain until the case found the order) against Megatron, on the TP-reduced parameters. On DP4 the boundary
is not claimed: Megatron all-reduces each bucket as one flat buffer (parameters in reverse order), the
policy each parameter alone, and gloo's summation order of an element depends on its offset; the case
checks bitwise that the policy's DP stages applied to the flat bucket, reduced by simdist's gloo reduction, are
what Megatron computes.
"""

from __future__ import annotations

import dataclasses
import zlib
from dataclasses import dataclass, field
from typing import cast

import torch

from simdist.cases.base import Case
from simdist.cases.compare import Figures, Match, figures, match_traces, only, zero_weights
from simdist.cases.ranks import MEGATRON_MODULES, CaseWhere, run_ranks
from simdist.errors import UsageError
from simdist.gradpath.families import Family, ParamSpec
from simdist.gradpath.kernel import Marker, apply_stage
from simdist.gradpath.path import PathConfig, train_rank
from simdist.gradpath.policy import Policy
from simdist.gradpath.probes import BOUNDARY, Trace
from simdist.numerics.floats import unit_roundoff
from simdist.policies.catalogue import get_policy
from simdist.reduce import make_reduction
from simdist.sources.synthetic import DEFAULT_PARAMS, InitialWeights, SyntheticGradients
from simdist.world.simworld import SimWorld
from simdist.world.spec import ParallelSpec

NAME = "megatron-grad-reduce-fp32"
LAYOUTS = {"dp2": (2, 1), "tp2dp2": (4, 2), "dp4": (4, 1)}
"""Layout name -> (world size, TP size); DP is the rest."""
PARAMS: tuple[ParamSpec, ...] = tuple(p for p in DEFAULT_PARAMS if p.family is not Family.EXPERT)
"""simdist's synthetic parameters without the routed expert (Megatron's expert path is not driven here)."""
TP_MARK = {
    Family.ROUTER_GATE_REPLICATED: "average_gradients_across_tp_domain",
    Family.ROUTER_GATE_PARTIAL: "sequence_parallel",
}


class SpreadGradients(SyntheticGradients):
    """simdist's synthetic BF16 gradients (same owners: identical on TP peers for ``dense``) over ``2 * spread + 1``
    binades, so that FP32 sums of a few of them round and their order shows (the synthetic stream spans 7)."""

    def __init__(self, spec: ParallelSpec, seed: int = 0, spread: int = 12) -> None:
        super().__init__(spec, seed)
        self.spread = spread

    def __call__(self, step: int, micro: int, rank: int, param: ParamSpec) -> torch.Tensor:
        key = repr(("spread", self.spread, self.seed, step, micro, param.name, self.owner(rank, param)))
        g = torch.Generator().manual_seed(zlib.crc32(key.encode()))
        exponent = torch.randint(-self.spread, self.spread + 1, param.shape, generator=g).to(torch.float32)
        return (torch.randn(param.shape, generator=g) * self.scale * torch.pow(2.0, exponent)).to(torch.bfloat16)


@dataclass(frozen=True)
class Config:
    gas: int = 2
    seed: int = 0
    spread: int = 12
    """Binades either side of the gradients' scale (`SpreadGradients`)."""
    layouts: tuple[str, ...] = ("dp2", "tp2dp2", "dp4")
    fp32_reduce: tuple[bool, ...] = (True, False)

    def spec(self, layout: str) -> ParallelSpec:
        world, tp = LAYOUTS[layout]
        return ParallelSpec(world, tp=tp, ep=1)

    def gradients(self, layout: str) -> SpreadGradients:
        return SpreadGradients(self.spec(layout), self.seed, self.spread)


@dataclass
class RealRun:
    trace: Trace
    megatron_version: str = ""
    groups: dict[str, list[int]] = field(default_factory=dict)
    main_grad_dtype: str = ""


def _holder(initial: InitialWeights, rank: int) -> torch.nn.Module:
    """A BF16 module holding `PARAMS` (TP-reduced ones marked as Megatron marks them) with forward ``sum(p*g)``."""

    class Holder(torch.nn.Module):
        def forward(self, grads: dict[str, torch.Tensor]) -> torch.Tensor:
            # sum() starts from the int 0; the holder always holds PARAMS, so the result is a tensor
            return cast(torch.Tensor, sum((p * grads[name]).float().sum() for name, p in self.named_parameters()))

    root = Holder()
    for p in PARAMS:
        *path, leaf = p.name.split(".")
        owner = root
        for part in path:
            if not hasattr(owner, part):
                owner.add_module(part, torch.nn.Module())
            owner = getattr(owner, part)
        param = torch.nn.Parameter(initial(rank, p).to(torch.bfloat16))
        if p.family in TP_MARK:
            setattr(param, TP_MARK[p.family], True)
        owner.register_parameter(leaf, param)
    return root


def megatron_rank(comm, config: Config, layout: str) -> dict[bool, RealRun]:
    """Rank program: for grad_reduce_in_fp32 True/False, GAS micro-steps of Megatron's DDP, then finalize."""
    import importlib.metadata

    # the CPU shims: megatron-core allocates its buffers on torch.cuda.current_device(), and from 0.17 its
    # bucket groups also ask for torch.cuda.current_stream() (to wait on CUDA-graph events, none here); torch's
    # own CPU stream stands in (its waits are no-ops: CPU work is synchronous)
    # (shims of another type than torch's CUDA functions, on purpose)
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]
    torch.cuda.current_stream = torch.cpu.current_stream  # type: ignore[assignment]
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.transformer import TransformerConfig

    rank = comm.get_rank()
    spec = comm.spec
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=spec.tp)
    groups = {
        "tp": dist.get_process_group_ranks(parallel_state.get_tensor_model_parallel_group()),
        "dp": dist.get_process_group_ranks(parallel_state.get_data_parallel_group()),
    }
    grads_of = config.gradients(layout)
    initial = InitialWeights(spec, config.seed)
    out = {}
    for fp32 in config.fp32_reduce:
        run = RealRun(Trace(rank), importlib.metadata.version("megatron-core"), groups)
        transformer = TransformerConfig(
            num_layers=1,
            hidden_size=16,
            num_attention_heads=spec.tp,
            params_dtype=torch.bfloat16,
            bf16=True,
            tensor_model_parallel_size=spec.tp,
            sequence_parallel=spec.tp > 1,
        )
        ddp = DistributedDataParallel(
            transformer, DistributedDataParallelConfig(grad_reduce_in_fp32=fp32), _holder(initial, rank)
        )
        named = dict(ddp.module.named_parameters())
        run.main_grad_dtype = str(named[PARAMS[0].name].main_grad.dtype)
        for micro in range(config.gas):
            ddp({p.name: grads_of(0, micro, rank, p) for p in PARAMS}).backward()
            for p in PARAMS:
                run.trace.capture(0, micro, p.name, "hp", named[p.name].main_grad)
        finalize_model_grads([ddp])
        for p in PARAMS:
            run.trace.capture(0, BOUNDARY, p.name, "dp_reduced", named[p.name].main_grad)
        out[fp32] = run
    parallel_state.destroy_model_parallel()
    return out


def run_real(config: Config, layout: str, where: CaseWhere = "gloo") -> list[dict[bool, RealRun]]:
    return run_ranks(megatron_rank, config.spec(layout), config, layout, where=where, preload=MEGATRON_MODULES)


# -- the simdist side ---------------------------------------------------------------------------------------------


def policy_for(fp32: bool) -> Policy:
    """``megatron_grad_reduce_fp32`` for ``grad_reduce_in_fp32=True``; with a BF16 buffer and reduction for False."""
    policy = get_policy("megatron_grad_reduce_fp32")
    if fp32:
        return policy
    return dataclasses.replace(
        policy,
        name="megatron_grad_reduce_fp32[accumulate=dp_reduce=bf16]",
        accumulate=torch.bfloat16,
        dp_reduce=torch.bfloat16,
    )


def transcription(config: Config, layout: str, policy: Policy) -> list[Trace]:
    """The policy on simdist's gradient path (SimWorld, gloo's order): hp per micro-step, dp_reduced."""
    spec = config.spec(layout)
    path = PathConfig(steps=1, gas=config.gas, seed=config.seed, marker=Marker.PER_MICRO_STEP)
    return SimWorld(spec, reduction=make_reduction("gloo")).run(
        train_rank,
        list(PARAMS),
        zero_weights,
        config.gradients(layout),
        policy,
        path,
        frozenset({"hp", "dp_reduced"}),
    )


def flat_bucket(config: Config, layout: str, policy: Policy, traces: list[Trace]) -> list[Trace]:
    """The policy's DP stages on one flat bucket per rank (parameters in reverse order, as Megatron lays out its
    buffer), reduced with simdist's gloo reduction: the boundary as Megatron runs it when DP is the whole world."""
    spec = config.spec(layout)
    if spec.tp != 1 or spec.dp != spec.world_size:
        raise UsageError("the flat-bucket boundary is modelled for DP-only layouts")
    order = [p for p in reversed(PARAMS)]
    stages = policy.dp_stages("dp", spec.dp, policy.accumulate)
    at = next(i for i, stage in enumerate(stages) if stage.kind == "all_reduce")
    buffers = []
    for trace in traces:
        value = torch.cat([trace.get(0, config.gas - 1, p.name, "hp").flatten() for p in order])
        for stage in stages[:at]:
            value = apply_stage(stage, value)
        buffers.append(value)
    value = make_reduction("gloo").reduce(torch.stack(buffers))
    for stage in stages[at + 1 :]:
        value = apply_stage(stage, value)
    out = []
    for trace in traces:
        result, offset = Trace(trace.rank), 0
        for p in order:
            numel = trace.get(0, config.gas - 1, p.name, "hp").numel()
            result.capture(0, BOUNDARY, p.name, "dp_reduced", value[offset : offset + numel].reshape(p.shape))
            offset += numel
        out.append(result)
    return out


def sum_of_terms(config: Config, layout: str, traces: list[Trace]) -> dict:
    """``(rank, boundary key) -> sum |terms|``: |local gradients| over micro-steps, DP peers / dp, TP peers."""
    spec = config.spec(layout)
    grads_of = config.gradients(layout)
    by_name = {p.name: p for p in PARAMS}
    out = {}
    for trace in traces:
        for key in trace.values:
            p = by_name[key[2]]
            peers = set(spec.group_of("dp", trace.rank))
            if p.family in TP_MARK:
                peers = {t for d in peers for t in spec.group_of("tp", d)}
            scale = len(spec.group_of("dp", trace.rank)) * (spec.tp if p.family is Family.ROUTER_GATE_REPLICATED else 1)
            out[(trace.rank, key)] = (
                sum(grads_of(0, m, r, p).double().abs() for m in range(config.gas) for r in peers) / scale
            )
    return out


@dataclass
class RunResult:
    layout: str
    grad_reduce_in_fp32: bool
    main_grad_dtype: str
    groups_match_spec: bool
    claimed: Match
    """Real vs the policy: every capture (on DP4 the micro-steps only: the boundary is bucketed)."""
    order_effect: Figures | None
    """TP-reduced parameters at the boundary (TP2 x DP2): real vs the policy with the TP correction *before*
    the DP reduction (``correct_at="boundary"``): how much the order Megatron uses matters."""
    boundary_vs_policy: Figures | None = None
    """DP > 2: the boundary captures (not claimed: the policy reduces each parameter alone) vs the policy."""
    boundary_vs_flat_bucket: Match | None = None
    """DP > 2: the same vs the policy's DP stages on Megatron's flat bucket, reduced by simdist's gloo reduction."""
    simdist_chains: dict[str, str] = field(default_factory=dict)


@dataclass
class MegatronVerdict:
    ok: bool
    summary: str
    megatron_version: str
    where: str
    results: list[RunResult]
    bf16_unit_roundoff: float = unit_roundoff(torch.bfloat16)


def judge_run(config: Config, layout: str, fp32: bool, runs: list[RealRun], policy: Policy) -> RunResult:
    spec = config.spec(layout)
    real = [r.trace for r in runs]
    model = transcription(config, layout, policy)
    names = {p.name for p in PARAMS}
    bucketed = spec.dp > 2  # an element's sum order may depend on its offset in the flat bucket
    stages = {"hp"} if bucketed else {"hp", "dp_reduced"}
    claimed = match_traces(
        only(real, names, stages), only(model, names, stages), stages=tuple(stages), names=("Megatron", policy.name)
    )
    order_effect = None
    tp_reduced = {p.name for p in PARAMS if p.family in TP_MARK} if spec.tp > 1 else set()
    if tp_reduced and not bucketed:
        at_boundary = only(real, tp_reduced, {"dp_reduced"})
        before_dp = transcription(config, layout, dataclasses.replace(policy, correct_at="boundary"))
        order_effect = figures(
            at_boundary,
            only(before_dp, tp_reduced, {"dp_reduced"}),
            sum_of_terms(config, layout, at_boundary),
            stage="dp_reduced",
        )
    boundary = bucket = None
    if bucketed:
        at_boundary = only(real, names, {"dp_reduced"})
        boundary = figures(
            at_boundary,
            only(model, names, {"dp_reduced"}),
            sum_of_terms(config, layout, at_boundary),
            stage="dp_reduced",
        )
        bucket = match_traces(
            at_boundary,
            flat_bucket(config, layout, policy, model),
            stages=("dp_reduced",),
            names=("Megatron", f"{policy.name} on the flat bucket"),
        )
    groups_ok = all(
        set(r.groups["tp"]) == set(spec.group_of("tp", rank)) and set(r.groups["dp"]) == set(spec.group_of("dp", rank))
        for rank, r in enumerate(runs)
    )
    families = sorted({p.family for p in PARAMS}, key=lambda f: f.value)
    chains = {f.value: policy.chain(f, spec.tp, spec.dp) for f in families}
    return RunResult(layout, fp32, runs[0].main_grad_dtype, groups_ok, claimed, order_effect, boundary, bucket, chains)


def judge(
    config: Config,
    real: dict[str, list[dict[bool, RealRun]]],
    policies: dict[bool, Policy] | None = None,
    where: str = "gloo",
) -> MegatronVerdict:
    policies = policies or {fp32: policy_for(fp32) for fp32 in config.fp32_reduce}
    results = [
        judge_run(config, layout, fp32, [r[fp32] for r in real[layout]], policies[fp32])
        for layout in config.layouts
        for fp32 in config.fp32_reduce
    ]
    ok = all(
        r.claimed.bitwise_equal
        and r.groups_match_spec
        and (r.boundary_vs_flat_bucket is None or r.boundary_vs_flat_bucket.bitwise_equal)
        for r in results
    )
    first = real[config.layouts[0]][0][config.fp32_reduce[0]]
    verdict = MegatronVerdict(ok, "", first.megatron_version, where, results)
    verdict.summary = summarize(verdict)
    return verdict


def summarize(v: MegatronVerdict) -> str:
    lines = [
        f"real Megatron-Core {v.megatron_version} DistributedDataParallel + finalize_model_grads, GAS 2, "
        f"{v.where} processes:"
    ]
    for r in v.results:
        head = f"  [{r.layout}, grad_reduce_in_fp32={r.grad_reduce_in_fp32}]"
        same = "==" if r.claimed.bitwise_equal else "!="
        lines.append(
            f"{head} main_grad {r.main_grad_dtype}; where the chains claim equality: Megatron {same} "
            f"simdist ({r.claimed.equal}/{r.claimed.compared} captures bitwise)"
            + ("" if r.claimed.bitwise_equal else f"; first: {r.claimed.first_difference}")
        )
        if r.order_effect is not None:
            f = r.order_effect
            lines.append(
                f"{head} order effect on the TP-reduced grads: the TP correction before the DP reduction "
                f"(correct_at=boundary) instead of after it as Megatron does: {f.tensors_differing}/{f.tensors} "
                f"differ, {100 * f.fraction_differing:.1f}% of elements, max {f.max_ulp} ulp, max error / "
                f"sum|terms| {f.max_error_over_terms:.2e}"
            )
        if r.boundary_vs_flat_bucket is not None and r.boundary_vs_policy is not None:  # (set together)
            f, m = r.boundary_vs_policy, r.boundary_vs_flat_bucket
            lines.append(
                f"{head} boundary (DP > 2): Megatron all-reduces one flat bucket, the policy each parameter: "
                f"{f.tensors_differing}/{f.tensors} differ, {100 * f.fraction_differing:.1f}% of elements, max "
                f"{f.max_ulp} ulp, max error / sum|terms| {f.max_error_over_terms:.2e}; the policy's DP stages on "
                f"the flat bucket: {m.equal}/{m.compared} bitwise"
                + ("" if m.bitwise_equal else f"; first: {m.first_difference}")
            )
    lines.append(
        "verdict: "
        + (
            "megatron_grad_reduce_fp32 is bitwise what Megatron computes (on DP > 2 with the DP stages on "
            "Megatron's flat bucket)"
            if v.ok
            else "MISMATCH"
        )
    )
    return "\n".join(lines)


def run(where: CaseWhere = "gloo", **options) -> MegatronVerdict:
    config = dataclasses.replace(Config(), **options)
    real = {layout: run_real(config, layout, where) for layout in config.layouts}
    return judge(config, real, where=where)


CASE = Case(
    name=NAME,
    question="Is megatron_grad_reduce_fp32's chain (grad_reduce_in_fp32 True, and False as a BF16 buffer) bitwise "
    "what Megatron-Core's DistributedDataParallel + finalize_model_grads compute on DP2 and TP2 x DP2?",
    real_code="megatron.core.distributed.DistributedDataParallel, finalize_model_grads (megatron-core), "
    "2 and 4 gloo processes",
    policies=("megatron_grad_reduce_fp32",),
    requires=("megatron",),
    run=run,
)
