"""Case ``fsdp2-reduce-dtype-tp``: FSDP2 over the DP dim of a 2x2 mesh with tensor parallelism.

Question: with a real tensor-parallel MLP (``ColwiseParallel`` then
``RowwiseParallel`` from ``torch.distributed.tensor.parallel``, optionally a
``SequenceParallel`` LayerNorm in front) sharded by ``fully_shard`` over the
``dp`` dim of a 2x2 ``DeviceMesh`` with ``MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=R)``, R = fp32 and bf16: which gradient boundaries round in BF16,
and where; and is the FP32 sharded gradient after every micro-step (GAS 2)
bitwise what simdist's ``fsdp2_reduce_dtype`` stage chain computes from the
same BF16 local gradients?

Real code: torch's DTensor TP styles and FSDP2 (``FSDPParam`` hands each
parameter's unsharded gradient to ``foreach_reduce``; a DTensor gradient whose
TP placement is not the parameter's -- ``Partial(sum)`` for a
``SequenceParallel`` norm -- is first redistributed over TP, in the gradient's
own dtype, BF16). The case records, per parameter, the TP placement the BF16
gradient arrives in and its local tensor before that redistribution (the
local gradient simdist is fed); the model's own backward (matmuls, the BF16
all-reduce of activation gradients inside the TP styles) is upstream of the
local gradient and not part of any chain.

Compared with: simdist's gradient path on SimWorld (TP2 x DP2, gloo's order;
a 2-member sum has one order anyway) with each parameter in the family its
arrival says: a ``Shard`` placement is ``model_parallel`` (no TP stage), a
``Replicate`` or plain gradient is ``dense`` (the chain's FP32 TP average,
exact when TP peers hold bitwise identical gradients -- checked), a
``Partial`` one is ``router_gate_partial`` (a TP sum). The chain claims
equality for every parameter and the comparison is bitwise: torch sums a
``Partial`` gradient over TP in BF16 before FSDP2's cast to the reduce dtype,
and so does ``fsdp2_reduce_dtype`` (``staging=None``). The case also reports the
effect of that order: the same policy with an FP32 staging cast before the TP
sum (``staging=fp32``, this policy's chain until the case found the order).

Worlds: ``threads`` (simdist.run: DTensor and FSDP2 keep no per-rank module
globals, so threads work), ``simdist`` (process mode), ``gloo`` (4 real gloo
processes).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from simdist.cases.base import Case
from simdist.cases.compare import Figures, Match, figures, match_traces, only, zero_weights
from simdist.cases.fsdp2.reduce_dtype import DTYPES, policy_for
from simdist.cases.ranks import CaseWhere
from simdist.errors import UsageError, coerce
from simdist.gradpath.families import Family, ParamSpec
from simdist.gradpath.kernel import Marker
from simdist.gradpath.path import PathConfig, train_rank
from simdist.gradpath.policy import Policy, dtype_name
from simdist.gradpath.probes import Trace
from simdist.numerics.floats import bits, unit_roundoff
from simdist.reduce import make_reduction
from simdist.world.options import Where
from simdist.world.simworld import SimWorld
from simdist.world.spec import ParallelSpec

NAME = "fsdp2-reduce-dtype-tp"
PLANS = ("tp", "tp_sp")
"""``tp``: norm replicated (plain parameter), up Colwise, down Rowwise; ``tp_sp``: norm SequenceParallel too."""
D_MODEL, D_HIDDEN, BATCH, SEQ = 8, 16, 2, 4


TP2_DP2 = ParallelSpec(4, tp=2, ep=1)


@dataclass(frozen=True)
class Config:
    spec: ParallelSpec = TP2_DP2
    """The 2x2 (dp, tp) mesh: TP2 x DP2 on 4 ranks."""
    gas: int = 2
    seed: int = 0
    reduce_dtypes: tuple[str, ...] = ("fp32", "bf16")
    plans: tuple[str, ...] = PLANS

    def __post_init__(self) -> None:
        if (self.spec.world_size, self.spec.tp) != (4, 2):
            raise UsageError(f"fsdp2-reduce-dtype-tp runs a 2x2 (dp, tp) mesh, got {self.spec.describe()}")


@dataclass
class Arrival:
    """How one parameter's BF16 gradient reached FSDP2 on one rank and micro-step."""

    placement: str
    """``Shard(dim=0)``, ``Replicate()``, ``Partial(sum)`` (its TP placement) or ``plain`` (not a DTensor)."""
    local: torch.Tensor
    """The local BF16 tensor before any TP redistribution."""


@dataclass
class RealRun:
    """One rank's run of one plan and reduce dtype: arrivals per micro-step, the FP32 grads after each."""

    arrivals: dict[tuple[int, str], Arrival] = field(default_factory=dict)
    hp: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)


class Block(torch.nn.Module):
    """LayerNorm, then an MLP whose two linears the TP plan splits column- and row-wise."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(D_MODEL)
        self.up = torch.nn.Linear(D_MODEL, D_HIDDEN)
        self.down = torch.nn.Linear(D_HIDDEN, D_MODEL)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(self.norm(x))))


def _tp_plan(plan: str) -> dict:
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    if plan == "tp":
        return {"up": ColwiseParallel(), "down": RowwiseParallel()}
    if plan == "tp_sp":
        return {
            "norm": SequenceParallel(),
            "up": ColwiseParallel(input_layouts=Shard(1)),
            "down": RowwiseParallel(output_layouts=Shard(1)),
        }
    raise UsageError(f"unknown plan {plan!r}; valid: {', '.join(PLANS)}")


def _seeded(shape: tuple[int, ...], *key: object) -> torch.Tensor:
    import zlib

    return torch.randn(shape, generator=torch.Generator().manual_seed(zlib.crc32(repr(key).encode())))


def _spy_arrivals(fsdp_param, run: RealRun, micro: list[int]) -> None:
    """Record the gradient ``fsdp_param`` hands to FSDP2 (this instance only: thread-safe)."""
    from torch.distributed.tensor import DTensor

    inner = fsdp_param._get_grad_inner_tensor

    def spy(grad):
        name = fsdp_param._param_fqn  # set when FSDP2 lazily initialises the root, after this spy is installed
        if isinstance(grad, DTensor):
            placement = repr(grad.placements[-1])
            local = grad._local_tensor
            if hasattr(local, "wait"):
                local = local.wait()
        else:
            placement, local = "plain", grad
        run.arrivals[(micro[0], name)] = Arrival(placement, local.detach().clone())
        return inner(grad)

    fsdp_param._get_grad_inner_tensor = spy


def _tp_local(grad, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This TP rank's part of the full FP32 gradient: all-gathered over DP (exact), split as TP splits it."""
    from torch.distributed.tensor import Shard

    full = grad.full_tensor()
    placements = grad.placements
    if len(placements) == 2 and isinstance(placements[1], Shard):
        return full.chunk(tp_size, dim=placements[1].dim)[tp_rank].clone()
    return full


def fsdp_tp_rank(rank: int, config: Config) -> dict[tuple[str, str], RealRun]:
    """Rank program (plain torch.distributed): every plan and reduce dtype, GAS micro-steps each."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank, tp_rank = mesh["dp"].get_local_rank(), mesh["tp"].get_local_rank()
    out = {}
    for plan in config.plans:
        for name in config.reduce_dtypes:
            run = RealRun()
            torch.manual_seed(config.seed)  # every rank builds the same initial weights
            module = Block()
            parallelize_module(module, mesh["tp"], _tp_plan(plan))
            sharded = fully_shard(  # the same module, now an FSDPModule
                module,
                mesh=mesh["dp"],
                mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=DTYPES[name]),
            )
            micro = [0]
            param_group = sharded._get_fsdp_state()._fsdp_param_group
            assert param_group is not None, "fully_shard of a module with parameters builds its param group"
            for fsdp_param in param_group.fsdp_params:
                _spy_arrivals(fsdp_param, run, micro)
            for m in range(config.gas):
                micro[0] = m
                # TP peers see the same tokens, except under sequence parallelism (each its own sequence shard)
                owner = (dp_rank, tp_rank) if plan == "tp_sp" else (dp_rank,)
                x = _seeded((BATCH, SEQ, D_MODEL), "x", config.seed, m, owner)
                weight = _seeded((BATCH, SEQ, D_MODEL), "w", config.seed, m, owner)
                (module(x).float() * weight).sum().backward()
                for pname, param in module.named_parameters():
                    run.hp[(m, pname)] = _tp_local(param.grad, tp_rank, 2)
                    run.shapes[pname] = tuple(run.hp[(m, pname)].shape)
            out[(plan, name)] = run
    return out


def run_real(config: Config, where: CaseWhere = "threads") -> list[dict[tuple[str, str], RealRun]]:
    """Every rank's runs, on ``where``: ``threads``, ``processes`` (process mode) or ``gloo`` (`simdist.run`)."""
    from simdist.world.runner import run

    return run(fsdp_tp_rank, 4, where=coerce(Where, where, "where"), args=(config,), timeout_s=300)


# -- the simdist side ---------------------------------------------------------------------------------------------

FAMILY_OF_ARRIVAL = {"plain": Family.DENSE, "Replicate()": Family.DENSE, "Partial(sum)": Family.ROUTER_GATE_PARTIAL}


def family_of(placement: str) -> Family:
    """The simdist family a gradient arriving in TP ``placement`` belongs to (``Shard``: model parallel)."""
    if placement.startswith("Shard"):
        return Family.MODEL_PARALLEL
    if placement not in FAMILY_OF_ARRIVAL:
        raise UsageError(f"no simdist family for a gradient arriving as {placement}")
    return FAMILY_OF_ARRIVAL[placement]


class RecordedGradients:
    """``(step, micro, rank, param) -> BF16 local gradient`` replaying what real FSDP2 received (picklable)."""

    def __init__(self, runs: list[RealRun]) -> None:
        self.runs = runs

    def __call__(self, step: int, micro: int, rank: int, param: ParamSpec) -> torch.Tensor:
        return self.runs[rank].arrivals[(micro, param.name)].local


def param_specs(runs: list[RealRun]) -> tuple[ParamSpec, ...]:
    """Each parameter with the family its arrival placement says (the same on every rank and micro-step)."""
    first = runs[0]
    specs = []
    for pname, shape in first.shapes.items():
        placements = {run.arrivals[(m, pname)].placement for run in runs for (m, n) in run.arrivals if n == pname}
        if len(placements) != 1:
            raise UsageError(f"{pname}: arrival placements differ between ranks or micro-steps: {placements}")
        specs.append(ParamSpec(pname, family_of(placements.pop()), shape))
    return tuple(specs)


def simdist_traces(config: Config, runs: list[RealRun], policy: Policy) -> list[Trace]:
    """simdist's gradient path on the recorded local gradients (hp captures: FP32 after every micro-step)."""
    params = list(param_specs(runs))
    # FSDP2 has no correction-once marker: whatever TP stage a gradient has runs on every micro-step
    path = PathConfig(steps=1, gas=config.gas, seed=config.seed, marker=Marker.PER_MICRO_STEP)
    return SimWorld(config.spec, reduction=make_reduction("gloo")).run(
        train_rank, params, zero_weights, RecordedGradients(runs), policy, path, frozenset({"hp"})
    )


def real_traces(runs: list[RealRun], names: set[str] | None = None) -> list[Trace]:
    traces = []
    for rank, run in enumerate(runs):
        trace = Trace(rank)
        for (m, pname), value in run.hp.items():
            if names is None or pname in names:
                trace.capture(0, m, pname, "hp", value)
        traces.append(trace)
    return traces


def tp_in_fp32(policy: Policy) -> Policy:
    """``policy`` with an FP32 staging cast before the TP sum (not what DTensor's redistribute does)."""
    return dataclasses.replace(policy, name=f"{policy.name}[staging=fp32]", staging=torch.float32)


def sum_of_terms(config: Config, runs: list[RealRun], families: dict[str, Family]) -> dict:
    """``(rank, hp key) -> sum |terms|``: |local gradients| summed over TP peers (Partial only), averaged over
    DP peers, summed over micro-steps so far."""
    spec = config.spec
    out = {}
    for rank, run in enumerate(runs):
        for m, pname in run.hp:
            peers = set(spec.group_of("dp", rank))
            if families[pname] is Family.ROUTER_GATE_PARTIAL:
                peers = {t for d in peers for t in spec.group_of("tp", d)}
            total = sum(runs[r].arrivals[(k, pname)].local.double().abs() for k in range(m + 1) for r in peers)
            out[(rank, (0, m, pname, "hp"))] = total / len(spec.group_of("dp", rank))
    return out


@dataclass
class ParamResult:
    param: str
    arrives_as: str
    family: str
    chain_claims_equality: bool
    real_vs_policy_bitwise: bool


@dataclass
class RunResult:
    plan: str
    reduce_dtype: str
    params: list[ParamResult]
    claimed: Match
    """Real vs the policy on every parameter."""
    tp_peers_identical: bool
    """Replicated/plain gradients are bitwise the same on both TP peers (what makes the chain's TP average exact)."""
    partial_vs_fp32_tp_sum: Figures | None
    """Partial-sum parameters: real vs the policy with the TP sum in FP32 (``staging=fp32``): the order effect."""
    vs_fp32_reduce: Figures | None
    simdist_chains: dict[str, str]
    rounding_boundaries: list[str] = field(default_factory=list)
    """Where this run's gradients round, in path order (dtypes as recorded; the TP and DP dtypes as the bitwise
    matches above establish them)."""


@dataclass
class TpVerdict:
    ok: bool
    summary: str
    torch_version: str
    where: str
    layout: str
    results: list[RunResult]
    bf16_unit_roundoff: float = unit_roundoff(torch.bfloat16)


def _identical_on_tp_peers(config: Config, runs: list[RealRun], names: list[str]) -> bool:
    spec = config.spec
    for rank, run in enumerate(runs):
        for peer in spec.group_of("tp", rank):
            for (m, pname), arrival in run.arrivals.items():
                if pname in names and not torch.equal(bits(arrival.local), bits(runs[peer].arrivals[(m, pname)].local)):
                    return False
    return True


def judge_run(
    config: Config, plan: str, reduce_dtype: str, runs: list[RealRun], policy: Policy, fp32_runs: list[RealRun] | None
) -> RunResult:
    specs = param_specs(runs)
    families = {p.name: p.family for p in specs}
    partial = {n for n, f in families.items() if f is Family.ROUTER_GATE_PARTIAL}
    claimed_names = set(families)
    real = real_traces(runs)
    model = simdist_traces(config, runs, policy)
    claimed = match_traces(
        only(real, claimed_names), only(model, claimed_names), stages=("hp",), names=("FSDP2", policy.name)
    )
    per_param = []
    for p in specs:
        m = match_traces(only(real, {p.name}), only(model, {p.name}), stages=("hp",))
        per_param.append(
            ParamResult(
                p.name,
                runs[0].arrivals[(0, p.name)].placement,
                p.family.value,
                p.name in claimed_names,
                m.bitwise_equal,
            )
        )
    partial_fig = None
    terms = sum_of_terms(config, runs, families)
    if partial:
        partial_fig = figures(
            only(real, partial), only(simdist_traces(config, runs, tp_in_fp32(policy)), partial), terms
        )
    versus = None
    if fp32_runs is not None:
        versus = figures(real, real_traces(fp32_runs), terms)
    replicated = [n for n, f in families.items() if f is Family.DENSE]
    chains = {f.value: policy.chain(f, 2, 2) for f in sorted(set(families.values()), key=lambda f: f.value)}
    local_dtype = dtype_name(next(iter(runs[0].arrivals.values())).local.dtype)
    boundaries = [f"local grads in {local_dtype} (param_dtype: the backward's matmuls and TP activation all-reduces)"]
    if partial:
        boundaries.append(
            f"TP all-reduce of Partial(sum) grads ({', '.join(sorted(partial))}) in {local_dtype}, "
            "before the cast to the reduce dtype (DTensor redistribute in FSDPParam)"
        )
    boundaries.append(f"DP reduce-scatter in {reduce_dtype}")
    boundaries.append(f"+= into the sharded grad in {dtype_name(next(iter(runs[0].hp.values())).dtype)}")
    return RunResult(
        plan,
        reduce_dtype,
        per_param,
        claimed,
        _identical_on_tp_peers(config, runs, replicated),
        partial_fig,
        versus,
        chains,
        boundaries,
    )


def judge(
    config: Config,
    real: list[dict[tuple[str, str], RealRun]],
    policies: dict[str, Policy] | None = None,
    where: str = "threads",
) -> TpVerdict:
    policies = policies or {name: policy_for(name) for name in config.reduce_dtypes}
    results = []
    for plan in config.plans:
        fp32 = [r[(plan, "fp32")] for r in real] if "fp32" in config.reduce_dtypes else None
        for name in config.reduce_dtypes:
            runs = [r[(plan, name)] for r in real]
            results.append(judge_run(config, plan, name, runs, policies[name], None if name == "fp32" else fp32))
    ok = all(r.claimed.bitwise_equal and r.tp_peers_identical for r in results)
    verdict = TpVerdict(ok, "", torch.__version__, where, f"2x2 mesh (dp, tp), GAS {config.gas}", results)
    verdict.summary = summarize(verdict)
    return verdict


def summarize(v: TpVerdict) -> str:
    lines = [
        f"real FSDP2 + TP (torch {v.torch_version}), fully_shard over dp of a {v.layout}, param_dtype=bf16, "
        f"on {v.where}:"
    ]
    for r in v.results:
        head = f"  [{r.plan}, reduce_dtype={r.reduce_dtype}]"
        arrivals = ", ".join(f"{p.param} {p.arrives_as}" for p in r.params)
        lines.append(f"{head} BF16 grads arrive as: {arrivals}")
        lines.append(f"{head} rounding boundaries: {'; '.join(r.rounding_boundaries)}")
        same = "==" if r.claimed.bitwise_equal else "!="
        lines.append(
            f"{head} where the chains claim equality: FSDP2 {same} simdist "
            f"({r.claimed.equal}/{r.claimed.compared} grads bitwise; replicated grads identical on TP "
            f"peers: {r.tp_peers_identical})"
            + ("" if r.claimed.bitwise_equal else f"; first: {r.claimed.first_difference}")
        )
        if r.partial_vs_fp32_tp_sum is not None:
            f = r.partial_vs_fp32_tp_sum
            lines.append(
                f"{head} order effect on Partial(sum) grads: torch (and the policy) sum over TP in BF16 before "
                f"the cast to the reduce dtype; an FP32 staging cast before the TP sum (staging=fp32) gives: "
                f"{f.tensors_differing}/{f.tensors} differ, {100 * f.fraction_differing:.1f}% of elements, max "
                f"{f.max_ulp} fp32 ulp, max error / sum|terms| {f.max_error_over_terms:.2e}"
            )
        if r.vs_fp32_reduce is not None:
            f = r.vs_fp32_reduce
            lines.append(
                f"{head} vs reduce_dtype=fp32: {f.tensors_differing}/{f.tensors} grads differ, "
                f"{100 * f.fraction_differing:.1f}% of elements, max error / sum|terms| "
                f"{f.max_error_over_terms:.2e} (BF16 u = {v.bf16_unit_roundoff:.2e})"
            )
    lines.append(
        "verdict: "
        + (
            "fsdp2_reduce_dtype is bitwise what FSDP2+TP computes, Partial TP sums in BF16 included"
            if v.ok
            else "MISMATCH"
        )
    )
    return "\n".join(lines)


def run(where: CaseWhere = "threads", **options) -> TpVerdict:
    config = dataclasses.replace(Config(), **options)
    return judge(config, run_real(config, where), where=where)


CASE = Case(
    name=NAME,
    question="On a 2x2 (dp, tp) mesh with Colwise/Rowwise (and SequenceParallel) TP under fully_shard over dp, "
    "which gradient boundaries round in BF16, and is fsdp2_reduce_dtype's chain bitwise what FSDP2 computes?",
    real_code="torch.distributed.tensor.parallel (ColwiseParallel, RowwiseParallel, SequenceParallel) + "
    "torch.distributed.fsdp.fully_shard over the dp dim of a 2-D DeviceMesh, 4 ranks",
    policies=("fsdp2_reduce_dtype",),
    requires=(),
    run=run,
    processes_because=None,
)
