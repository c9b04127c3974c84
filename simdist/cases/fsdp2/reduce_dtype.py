"""Case ``fsdp2-reduce-dtype``: where does FSDP2's mixed precision round gradients, and does simdist agree?

Question: with ``fully_shard(..., mp_policy=MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=R))`` on DP4, for ``R`` = fp32 and bf16, which gradient
boundaries round in BF16, and are the sharded FP32 gradients after every
micro-step (GAS 2: FSDP2 reduce-scatters and accumulates on every backward)
bitwise what simdist's ``fsdp2_reduce_dtype`` stage chain computes from the
same BF16 local gradients?

Real code: torch's FSDP2 (``torch.distributed.fsdp.fully_shard``: the BF16
all-gather for compute, ``foreach_reduce``'s cast to the reduce dtype,
divide factors from ``_get_gradient_divide_factors`` -- recorded as the run
calls it --, reduce-scatter, cast to the FP32 parameter dtype and ``+=`` into
the sharded gradient), on 4 real gloo processes (or the simdist backend).
The local gradient is made exact: the forward is ``sum(p * g)`` with ``g``
simdist's seeded BF16 gradient, so the unsharded BF16 gradient is ``g``.

Compared with: ``fsdp2_reduce_dtype`` (FP32 reduce) and the same policy with
``dp_reduce=bf16`` for ``reduce_dtype=bf16``, on simdist's gradient path with
the DP reduction on every micro-step, on SimWorld with gloo's order. The
chain claims equality for every element: a pre/post divide by powers of two
and a divide by the world size (torch 2.13 uses ``ReduceOp.AVG``) are the same
exact scaling for DP4.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import cast

import torch
from torch.distributed.tensor import DTensor

from simdist.cases.base import Case
from simdist.cases.compare import Figures, Match, figures, match_traces
from simdist.cases.ranks import CaseWhere, run_ranks
from simdist.errors import UsageError
from simdist.gradpath.families import Family
from simdist.gradpath.path import PathConfig, train_rank
from simdist.gradpath.policy import Policy
from simdist.gradpath.probes import Trace
from simdist.numerics.floats import unit_roundoff
from simdist.policies.catalogue import get_policy
from simdist.reduce import make_reduction
from simdist.sources.synthetic import DEFAULT_PARAMS, InitialWeights, SyntheticGradients
from simdist.world.options import DEFAULT_REDUCTION
from simdist.world.simworld import SimWorld
from simdist.world.spec import ParallelSpec

NAME = "fsdp2-reduce-dtype"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


DP4 = ParallelSpec(4, tp=1, ep=1)


@dataclass(frozen=True)
class Config:
    spec: ParallelSpec = DP4
    """A DP-only layout (``tp = ep = 1``): the case drives plain ``fully_shard`` over every rank."""
    gas: int = 2
    steps: int = 1
    seed: int = 0
    reduce_dtypes: tuple[str, ...] = ("fp32", "bf16")
    spread: int = 16
    """Local gradients are scaled by ``2**k``, ``k`` uniform in ``[-spread, spread]``: wide enough that FP32 sums
    of the four BF16 values round, so the FP32 run tells one summation order from another (with the synthetic
    default of 3 every FP32 sum here was exact and a transcription in any order matched; with 16, one in
    sequential, tree or ring order differs from real FSDP2 in every compared tensor, gloo's order in none)."""
    reduction: str = DEFAULT_REDUCTION
    """The reduction of the transcription (the real run always sums in its backend's order)."""

    def __post_init__(self) -> None:
        if self.spec.tp != 1 or self.spec.ep != 1:
            raise UsageError(f"fsdp2-reduce-dtype runs DP only (tp = ep = 1), got {self.spec.describe()}")


@dataclass
class RealRun:
    trace: Trace
    divide_factors: list[str] = field(default_factory=list)
    torch_version: str = ""


@dataclass
class DtypeResult:
    reduce_dtype: str
    real_chain: str
    """The boundaries the real run went through, from what ``foreach_reduce`` was told to do."""
    simdist_chain: str
    real_vs_policy: Match
    vs_fp32_reduce: Figures | None
    """This reduce dtype against ``reduce_dtype=fp32`` (None for fp32 itself)."""


@dataclass
class FsdpVerdict:
    ok: bool
    summary: str
    torch_version: str
    where: str
    layout: str
    results: list[DtypeResult]
    bf16_unit_roundoff: float = unit_roundoff(torch.bfloat16)


def policy_for(reduce_dtype: str) -> Policy:
    """The simdist policy the case checks for ``reduce_dtype``."""
    policy = get_policy("fsdp2_reduce_dtype")
    if reduce_dtype == "fp32":
        return policy
    return dataclasses.replace(
        policy, name=f"fsdp2_reduce_dtype[dp_reduce={reduce_dtype}]", dp_reduce=DTYPES[reduce_dtype]
    )


def _holder(params, initial, rank: int) -> torch.nn.Module:
    """A module with ``params`` (dotted names, FP32) whose forward is ``sum(p * g)`` over a dict of gradients."""

    class Holder(torch.nn.Module):
        def forward(self, grads: dict[str, torch.Tensor]) -> torch.Tensor:
            # sum() starts from the int 0; a module with parameters always returns a tensor
            return cast(torch.Tensor, sum((p * grads[name]).sum() for name, p in self.named_parameters()))

    root = Holder()
    for p in params:
        *path, leaf = p.name.split(".")
        owner = root
        for part in path:
            if not hasattr(owner, part):
                owner.add_module(part, torch.nn.Module())
            owner = getattr(owner, part)
        owner.register_parameter(leaf, torch.nn.Parameter(initial(rank, p).float()))
    return root


def fsdp_rank(comm, config: Config) -> dict[str, RealRun]:
    """Rank program: for each reduce dtype, GAS micro-steps of real FSDP2; the full FP32 grads after each."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives as collectives

    rank = comm.get_rank()
    spec = comm.spec
    grads_of = SyntheticGradients(spec, seed=config.seed, spread=config.spread)
    initial = InitialWeights(spec, config.seed)
    mesh = init_device_mesh("cpu", (spec.world_size,))
    out = {}
    real_factors = collectives._get_gradient_divide_factors
    for name in config.reduce_dtypes:
        run = RealRun(Trace(rank), torch_version=torch.__version__)

        def spy(*args, run=run, **kwargs):
            result = real_factors(*args, **kwargs)
            pre, post, rs_op, _ = result
            run.divide_factors.append(f"pre-divide {pre}, reduce-scatter {rs_op}, post-divide {post}")
            return result

        module = _holder(DEFAULT_PARAMS, initial, rank)
        fully_shard(
            module, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=DTYPES[name])
        )
        collectives._get_gradient_divide_factors = spy
        try:
            for step in range(config.steps):
                for micro in range(config.gas):
                    grads = {p.name: grads_of(step, micro, rank, p) for p in DEFAULT_PARAMS}
                    module(grads).backward()
                    for pname, param in module.named_parameters():
                        grad = param.grad
                        assert isinstance(grad, DTensor), f"FSDP2 leaves {pname}.grad a DTensor"
                        run.trace.capture(step, micro, pname, "hp", grad.full_tensor())
                module.zero_grad(set_to_none=True)
        finally:
            collectives._get_gradient_divide_factors = real_factors
        out[name] = run
    return out


def transcription(config: Config, policy: Policy) -> list[Trace]:
    """``policy`` on SimWorld from the same local gradients, summed in ``config.reduction``'s order."""
    path = PathConfig(steps=config.steps, gas=config.gas, seed=config.seed)
    grads = SyntheticGradients(config.spec, seed=config.seed, spread=config.spread)
    world = SimWorld(config.spec, reduction=make_reduction(config.reduction))
    return world.run(train_rank, list(DEFAULT_PARAMS), InitialWeights(config.spec, config.seed), grads, policy, path)


def sum_of_terms(config: Config, traces: list[Trace]) -> dict:
    """``(rank, hp key) -> sum |terms|``: the DP peers' |local gradients| / dp, summed over micro-steps."""
    spec = config.spec
    grads_of = SyntheticGradients(spec, seed=config.seed, spread=config.spread)
    by_name = {p.name: p for p in DEFAULT_PARAMS}
    out = {}
    for trace in traces:
        for key in trace.values:
            step, micro, name, _ = key
            p = by_name[name]
            out[(trace.rank, key)] = (
                sum(grads_of(step, m, r, p).double().abs() for m in range(micro + 1) for r in range(spec.world_size))
                / spec.world_size
            )
    return out


def _real_chain(reduce_dtype: str, factors: list[str]) -> str:
    seen = sorted(set(factors))
    return f"bf16 -> {reduce_dtype} -> [{'; '.join(seen)}] -> fp32 -> +=grad"


def judge(
    config: Config, real: list[dict[str, RealRun]], policies: dict[str, Policy] | None = None, where: str = "gloo"
) -> FsdpVerdict:
    policies = policies or {name: policy_for(name) for name in config.reduce_dtypes}
    results = []
    fp32 = [r["fp32"].trace for r in real] if "fp32" in config.reduce_dtypes else None
    for name in config.reduce_dtypes:
        traces = [r[name].trace for r in real]
        policy = policies[name]
        match = match_traces(traces, transcription(config, policy), stages=("hp",), names=("FSDP2", policy.name))
        versus = None if name == "fp32" or fp32 is None else figures(traces, fp32, sum_of_terms(config, traces))
        results.append(
            DtypeResult(
                name, _real_chain(name, real[0][name].divide_factors), policy.chain(Family.DENSE, 1), match, versus
            )
        )
    ok = all(r.real_vs_policy.bitwise_equal for r in results)
    spec = config.spec
    verdict = FsdpVerdict(
        ok, "", real[0][config.reduce_dtypes[0]].torch_version, where, f"DP{spec.world_size}, GAS {config.gas}", results
    )
    verdict.summary = summarize(verdict)
    return verdict


def summarize(v: FsdpVerdict) -> str:
    lines = [f"real FSDP2 (torch {v.torch_version}) fully_shard, param_dtype=bf16, {v.layout} ({v.where} processes):"]
    for r in v.results:
        m = r.real_vs_policy
        same = "==" if m.bitwise_equal else "!="
        lines.append(f"  reduce_dtype={r.reduce_dtype}: real path {r.real_chain}")
        lines.append(
            f"  reduce_dtype={r.reduce_dtype}: FSDP2 {same} simdist {r.simdist_chain} "
            f"({m.equal}/{m.compared} sharded grads bitwise)"
            + ("" if m.bitwise_equal else f"; first: {m.first_difference}")
        )
        if r.vs_fp32_reduce is not None:
            f = r.vs_fp32_reduce
            lines.append(
                f"  reduce_dtype={r.reduce_dtype} vs fp32: {f.tensors_differing}/{f.tensors} grads differ, "
                f"{100 * f.fraction_differing:.1f}% of elements, max {f.max_ulp} fp32 ulp, max error / "
                f"sum|terms| {f.max_error_over_terms:.2e} (BF16 u = {v.bf16_unit_roundoff:.2e}): the BF16 "
                "boundary is the reduce-scatter"
            )
    lines.append("verdict: " + ("the policy's chain is bitwise what FSDP2 computes" if v.ok else "MISMATCH"))
    return "\n".join(lines)


SPY_IS_A_MODULE_GLOBAL = (
    "the case records FSDP2's divide factors by replacing the module function "
    "torch.distributed.fsdp._fully_shard._fsdp_collectives._get_gradient_divide_factors in each rank, and rank "
    "threads would share it (FSDP2 itself keeps no per-rank module globals: on threads its gradients are "
    "bitwise those of process mode, and fsdp2-reduce-dtype-tp runs on threads)"
)
"""Why this case refuses ``--where threads`` (found by experiment: on `simdist.run` threads the 96 hp captures
are bitwise those of process mode, but every rank's divide-factor calls land in the spy of the rank that
installed it last)."""


def run_real(config: Config, where: CaseWhere = "gloo") -> list[dict[str, RealRun]]:
    return run_ranks(fsdp_rank, config.spec, config, where=where, processes_because=SPY_IS_A_MODULE_GLOBAL)


def run(where: CaseWhere = "gloo", **options) -> FsdpVerdict:
    config = dataclasses.replace(Config(), **options)
    return judge(config, run_real(config, where), where=where)


CASE = Case(
    name=NAME,
    question="Which gradient boundaries does FSDP2's MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32|bf16) "
    "round in BF16, and is fsdp2_reduce_dtype's chain bitwise what fully_shard computes (DP4, GAS 2)?",
    real_code="torch.distributed.fsdp.fully_shard (foreach_reduce, _get_gradient_divide_factors), 4 gloo processes",
    policies=("fsdp2_reduce_dtype",),
    requires=(),
    run=run,
    processes_because=SPY_IS_A_MODULE_GLOBAL,
)
