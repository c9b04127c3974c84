"""The global gradient norm against a plain-loop computation from the DP-reduced gradients of every rank.

DeepSpeed's de-duplicated norm: a replicated parameter (routers, dense) counts once per TP group (on TP rank
0), a model-parallel one on every TP rank, an expert on every rank of its EP group. Written to kill the
``norm-counts-experts-once`` mutant of bench/mutations.py: batched-vs-per-rank and policy-vs-oracle checks
share the rule, so only a computation outside the kernel sees it. The kernel sums squares in FP32 and this in
FP64, so the check is relative, to 1e-5 (a dropped or doubled family moves the norm by far more).
"""

from __future__ import annotations

import math

from simdist.gradpath.families import Family
from simdist.gradpath.path import PathConfig, train_rank
from simdist.gradpath.probes import BOUNDARY
from simdist.policies.catalogue import get_policy
from simdist.reduce import make_reduction
from simdist.sources.synthetic import DEFAULT_PARAMS, InitialWeights, SyntheticGradients
from simdist.world.simworld import SimWorld
from simdist.world.spec import ParallelSpec

REPLICATED = {Family.ROUTER_GATE_REPLICATED, Family.ROUTER_GATE_PARTIAL, Family.DENSE}


def test_the_global_norm_counts_each_family_as_deepspeed_does():
    for spec in (ParallelSpec(4, tp=2, ep=2), ParallelSpec(8, tp=2, ep=4)):
        grads = SyntheticGradients(spec, seed=2)
        config = PathConfig(steps=1, gas=1, seed=2, marker="per_micro_step")
        traces = SimWorld(spec, reduction=make_reduction("gloo")).run(
            train_rank, list(DEFAULT_PARAMS), InitialWeights(spec, 2), grads, get_policy("fp32_staging"), config
        )

        def squares(rank: int, families: set[Family], traces=traces) -> float:
            return sum(
                float(traces[rank].get(0, BOUNDARY, p.name, "dp_reduced").double().pow(2).sum())
                for p in DEFAULT_PARAMS
                if p.family in families
            )

        for rank in range(spec.world_size):
            tp_group = spec.group_of("tp", rank)
            dense = squares(tp_group[0], REPLICATED) + sum(squares(t, {Family.MODEL_PARALLEL}) for t in tp_group)
            expert = sum(squares(e, {Family.EXPERT}) for e in spec.group_of("ep", rank))
            assert expert > 0 and dense > 0
            norm = traces[rank].scalars[(0, "grad_norm")]
            assert math.isclose(norm, math.sqrt(dense + expert), rel_tol=1e-5), (spec, rank)
