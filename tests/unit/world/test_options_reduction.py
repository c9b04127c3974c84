"""One spelling of the reduction: ``reduction=`` on the rank-batched gradient path, the compact workload and the
pytest fixture; the spellings removed before 0.1.0 (``models=``, ``default_model=``, ``model=``,
``SIMDIST_MODEL``) are unknown keywords (``TypeError``) or a refused variable; one default
(`simdist.world.options.DEFAULT_REDUCTION`).

The inputs are chosen so that gloo's order and the rank-order fold differ on them (checked here), so a keyword
that were silently dropped would show.
"""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.distributed as dist

from simdist.gradpath.batched import BatchedOps, BatchedPath
from simdist.gradpath.path import PathConfig
from simdist.numerics.compare import same_bits
from simdist.policies.catalogue import get_policy
from simdist.pytest_plugin import SimdistWorld
from simdist.reduce import Gloo, Ring, Sequential
from simdist.sources.synthetic import DEFAULT_PARAMS, InitialWeights
from simdist.studies.growth import BatchedGradients
from simdist.world.options import DEFAULT_REDUCTION, DEFAULT_TIMEOUT_S
from simdist.world.spec import ParallelSpec

SPEC = ParallelSpec(8, tp=2, ep=2)


def _values() -> torch.Tensor:
    """``[2, 8, 64]`` values spread over 60 binades: every order of summation rounds differently."""
    gen = torch.Generator().manual_seed(8)
    shape = (2, SPEC.world_size, 64)
    return torch.randn(*shape, generator=gen) * torch.exp2(torch.randint(-30, 30, shape, generator=gen).float())


def _reduce(ops: BatchedOps) -> torch.Tensor:
    """``[3, 2, 8, 64]``: the TP, DP and EDP sums of `_values`."""
    x = _values()
    return torch.stack([ops.all_reduce(x, kind) for kind in ("tp", "dp", "edp")])


def test_batched_ops_reads_reduction_by_name_model_or_kind_table():
    by_name = _reduce(BatchedOps(SPEC, [0, 1], reduction="ring"))
    assert same_bits(by_name, _reduce(BatchedOps(SPEC, [0, 1], reduction=Ring())))
    mixed = _reduce(BatchedOps(SPEC, [0, 1], reduction={"dp": Ring(), "default": Sequential()}))
    # not vacuous: the models differ on these inputs, per kind as chosen
    sequential = _reduce(BatchedOps(SPEC, [0, 1], reduction=Sequential()))
    assert not same_bits(by_name[1], sequential[1])
    assert same_bits(mixed[1], by_name[1]) and same_bits(mixed[0], sequential[0])


def test_batched_default_is_the_one_default_and_the_removed_spellings_are_unknown():
    ops = BatchedOps(SPEC, [0, 1])
    assert DEFAULT_REDUCTION == "gloo" and type(ops.default_reduction) is Gloo and not ops.reductions
    assert same_bits(_reduce(ops), _reduce(BatchedOps(SPEC, [0, 1], reduction=Gloo())))
    assert not same_bits(_reduce(ops), _reduce(BatchedOps(SPEC, [0, 1], reduction=Sequential())))
    with pytest.raises(TypeError, match="unexpected keyword argument 'default_model'"):
        BatchedOps(SPEC, [0, 1], default_model=Ring())
    with pytest.raises(TypeError):  # reduction is keyword-only: a positional kind table is not read as one
        BatchedOps(SPEC, [0, 1], {"dp": Ring()})
    with pytest.raises(TypeError, match="unexpected keyword argument 'models'"):
        BatchedPath(SPEC, DEFAULT_PARAMS, get_policy("bf16_writeback"), PathConfig(steps=1), [], [], models={})


def test_batched_path_passes_reduction_to_its_ops():
    spec = SPEC  # DP groups of 4 reducing in BF16 (on 2 members, or in FP32 here, every order gives one sum)
    stream = BatchedGradients(spec, DEFAULT_PARAMS, [0, 1])
    initial = [InitialWeights(spec, s) for s in (0, 1)]

    def master(**reduction) -> torch.Tensor:
        path = BatchedPath(
            spec, DEFAULT_PARAMS, get_policy("bf16_only"), PathConfig(steps=2), initial, [0, 1], **reduction
        )
        path.run(stream.draw)
        return path.path.master

    ring = master(reduction="ring")
    assert same_bits(ring, master(reduction=Ring()))
    assert not same_bits(ring, master(reduction="sequential"))


def _rank_sum(rank: int) -> torch.Tensor:
    """Rank ``rank``'s row of `_values` summed over the world."""
    t = _values()[0, rank].clone()
    dist.all_reduce(t)
    return t


def test_the_fixture_takes_reduction_and_a_call_may_override_it():
    ring = torch.stack(SimdistWorld(reduction="ring").run(_rank_sum, 8))
    assert SimdistWorld(reduction="ring").reduction == "ring"
    gloo = torch.stack(SimdistWorld().run(_rank_sum, 8))
    assert not same_bits(ring, gloo)
    # a call's own keyword wins over the fixture's default (once a TypeError: the fixture added model=)
    assert same_bits(torch.stack(SimdistWorld(reduction="ring").run(_rank_sum, 8, reduction="gloo")), gloo)
    with pytest.raises(TypeError, match="unexpected keyword argument 'model'"):
        SimdistWorld(model="ring")


def test_the_fixture_leaves_the_deadline_to_the_launchers_one_default(monkeypatch):
    """The fixture once bounded each run by 120 s of its own; unset, a run gets the launcher's one deadline."""
    import simdist.world.runner as runner

    seen = []

    def recording_run(fn, world, **kwargs):
        seen.append(kwargs.get("timeout_s", inspect.signature(run).parameters["timeout_s"].default))
        return run(fn, world, **kwargs)

    run = runner.run
    monkeypatch.setattr(runner, "run", recording_run)
    SimdistWorld().run(_rank_sum, 2)
    SimdistWorld(timeout_s=7.5).run(_rank_sum, 2)
    SimdistWorld(timeout_s=7.5).run(_rank_sum, 2, timeout_s=None)
    assert seen == [DEFAULT_TIMEOUT_S, 7.5, None]


def test_the_compact_workload_takes_reduction_and_no_other_spelling():
    from simdist.gradpath.probes import Capture
    from simdist.testing._internal.compact import run_batched, run_oracle

    def local(step, micro, rank, param):
        """BF16 gradients over 40 binades: DP sums of 4 round differently in different orders."""
        gen = torch.Generator().manual_seed(rank * 1000 + step * 10 + micro)
        x = torch.randn(param.shape, generator=gen) * torch.exp2(torch.randint(-20, 20, param.shape, generator=gen))
        return x.to(torch.bfloat16)

    config = PathConfig(steps=1, gas=1)
    keep = frozenset({Capture.DP_REDUCED})
    policy = get_policy("bf16_only")

    def batched(**kw) -> torch.Tensor:
        traces = run_batched(SPEC, policy, local, config, keep=keep, norm=False, **kw).rank_traces(0)
        return torch.cat([v.flatten().float() for t in traces for v in t.values.values()])

    def oracle(**kw) -> torch.Tensor:
        return torch.cat(
            [v.flatten() for t in run_oracle(SPEC, local, 1, 1, keep=keep, **kw) for v in t.values.values()]
        )

    ring = batched(reduction=Ring())
    assert not same_bits(oracle(reduction=Ring()), oracle(reduction=Sequential()))
    assert not same_bits(ring, batched(reduction=Sequential()))
    assert same_bits(batched(), batched(reduction=Gloo()))  # the one default
    assert same_bits(oracle(), oracle(reduction=Gloo()))
    with pytest.raises(TypeError, match="unexpected keyword argument 'model'"):
        run_batched(SPEC, policy, local, config, model=Ring())
    with pytest.raises(TypeError, match="unexpected keyword argument 'model'"):
        run_oracle(SPEC, local, 1, 1, model=Ring())


def test_the_removed_environment_variable_is_refused_not_ignored(monkeypatch):
    """``SIMDIST_MODEL`` (process mode, torchrun) was renamed ``SIMDIST_REDUCTION``: silently ignoring it would run
    gloo's order where the user asked for another, so it is a `UsageError` naming the new variable."""
    from simdist.errors import UsageError
    from simdist.world.processes.transport import process_reduction

    monkeypatch.delenv("SIMDIST_MODEL", raising=False)
    monkeypatch.setenv("SIMDIST_REDUCTION", "sequential")
    assert type(process_reduction()) is Sequential
    monkeypatch.setenv("SIMDIST_MODEL", "ring")
    with pytest.raises(UsageError, match=r"^SIMDIST_MODEL was renamed SIMDIST_REDUCTION"):
        process_reduction()
