"""A rank-batched run that captures nothing (the growth run's ``keep=frozenset()``: the kernel skips its capture
calls) holds the bits of the same run capturing every stage, for every registered policy and the oracle."""

from __future__ import annotations

import pytest

from simdist.gradpath.batched import BatchedPath
from simdist.gradpath.matched_policy import MATCHED_FP32
from simdist.gradpath.path import PathConfig
from simdist.gradpath.probes import BOUNDARY
from simdist.numerics.floats import bitwise_equal
from simdist.policies.catalogue import get_policy, policy_names
from simdist.reduce.gloo import Gloo
from simdist.sources.synthetic import DEFAULT_PARAMS, InitialWeights
from simdist.studies.growth import BatchedGradients
from simdist.world.spec import ParallelSpec


@pytest.mark.parametrize("name", [*policy_names(), "matched_fp32"])
def test_capturing_nothing_changes_no_bit(name):
    spec, seeds = ParallelSpec(4, tp=2, ep=2), [0, 1]
    policy = MATCHED_FP32 if name == "matched_fp32" else get_policy(name)
    config = PathConfig(steps=3, gas=2, marker="per_micro_step" if name == "matched_fp32" else "deepspeed")
    stream = BatchedGradients(spec, DEFAULT_PARAMS, seeds)
    initial = [InitialWeights(spec, s) for s in seeds]
    runs = {
        keep: BatchedPath(spec, DEFAULT_PARAMS, policy, config, initial, seeds, reduction=Gloo(), keep=keep)
        for keep in (None, frozenset())
    }
    traces = {keep: run.run(stream.draw) for keep, run in runs.items()}
    assert traces[frozenset()].values == {}
    # the capturing run holds every stage the kernel captures: the local gradient, the policy's micro-step stages
    # (step 0, micro-step 0: the correction runs) and every boundary capture, for every trained parameter
    path = runs[None].path
    for slot in path.trained:
        micro = {"local"} | {s.capture for s in path.stages(slot.spec.family, True) if s.capture}
        boundary = {c for _, c in policy.boundary_segments(slot.spec.family, spec.tp, spec.dp)}
        boundary |= {"clipped", "master", "adam_m", "adam_v", "param"}
        got = {(m, stage) for (step, m, param, stage) in traces[None].values if step == 0 and param == slot.spec.name}
        assert {(m, c) for m, c in got if m != 1} == {(0, c) for c in micro} | {(BOUNDARY, c) for c in boundary}
    assert not runs[frozenset()].path.capturing and runs[None].path.capturing
    for key, value in runs[None].state().items():
        assert bitwise_equal(runs[frozenset()].state()[key], value), (name, key)
