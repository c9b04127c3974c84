"""One spelling of the reduction model: ``reduction=`` on the rank-batched engine and the pytest fixture, the
older ``models=``/``default_model=``/``model=`` as aliases giving the same bits with a `DeprecationWarning` that
names the caller's line, both at once a ``TypeError`` (one message), and one default
(`simdist.world.options.DEFAULT_REDUCTION`).

The inputs are chosen so that gloo's order and the rank-order fold differ on them (checked here), so a keyword
that were silently dropped would show.
"""

from __future__ import annotations

import contextlib
import inspect

import pytest
import torch
import torch.distributed as dist

from simdist.gradpath.batched import BatchedOps, BatchedPath
from simdist.gradpath.catalogue import get_policy
from simdist.gradpath.path import PathConfig
from simdist.models.synthetic import DEFAULT_PARAMS, InitialWeights
from simdist.numerics.compare import same_bits
from simdist.pytest_plugin import SimdistWorld
from simdist.reduce import Gloo, Ring, Sequential
from simdist.studies.growth import BatchedGradients
from simdist.world.options import DEFAULT_REDUCTION, DEFAULT_TIMEOUT_S
from simdist.world.spec import ParallelSpec

SPEC = ParallelSpec(8, tp=2, ep=2)


@contextlib.contextmanager
def deprecated(*names: str, here: bool = True):
    """The block uses the deprecated spellings ``names``: one `DeprecationWarning` naming them, pointing at this
    file (the caller's line) unless ``here`` is false (an old keyword passed on by simdist's own code)."""
    spelled = " and ".join(f"{name}=" for name in names)
    with pytest.warns(DeprecationWarning, match=f"^{spelled} is a deprecated spelling of reduction=") as record:
        yield
    if here:
        assert {w.filename for w in record} == {__file__}


def _values() -> torch.Tensor:
    """``[2, 8, 64]`` values spread over 60 binades: every order of summation rounds differently."""
    gen = torch.Generator().manual_seed(8)
    shape = (2, SPEC.world_size, 64)
    return torch.randn(*shape, generator=gen) * torch.exp2(torch.randint(-30, 30, shape, generator=gen).float())


def _reduce(ops: BatchedOps) -> torch.Tensor:
    """``[3, 2, 8, 64]``: the TP, DP and EDP sums of `_values`."""
    x = _values()
    return torch.stack([ops.all_reduce(x, kind) for kind in ("tp", "dp", "edp")])


def test_batched_ops_reduction_and_its_old_spellings_give_the_same_bits():
    by_name = _reduce(BatchedOps(SPEC, [0, 1], reduction="ring"))
    assert same_bits(by_name, _reduce(BatchedOps(SPEC, [0, 1], reduction=Ring())))
    with deprecated("default_model"):
        older = BatchedOps(SPEC, [0, 1], default_model=Ring())
    assert same_bits(by_name, _reduce(older))
    mixed = _reduce(BatchedOps(SPEC, [0, 1], reduction={"dp": Ring(), "default": Sequential()}))
    with deprecated("models", "default_model"):
        older = BatchedOps(SPEC, [0, 1], models={"dp": Ring()}, default_model=Sequential())
    assert same_bits(mixed, _reduce(older))
    # not vacuous: the models differ on these inputs, per kind as chosen
    sequential = _reduce(BatchedOps(SPEC, [0, 1], reduction=Sequential()))
    assert not same_bits(by_name[1], sequential[1])
    assert same_bits(mixed[1], by_name[1]) and same_bits(mixed[0], sequential[0])


def test_batched_default_is_the_one_default_and_two_spellings_are_refused():
    ops = BatchedOps(SPEC, [0, 1])
    assert DEFAULT_REDUCTION == "gloo" and type(ops.default_model) is Gloo and not ops.models
    assert same_bits(_reduce(ops), _reduce(BatchedOps(SPEC, [0, 1], reduction=Gloo())))
    assert not same_bits(_reduce(ops), _reduce(BatchedOps(SPEC, [0, 1], reduction=Sequential())))
    with pytest.raises(TypeError, match=r"got reduction= and default_model="):
        BatchedOps(SPEC, [0, 1], default_model=Ring(), reduction="ring")
    with pytest.raises(TypeError, match=r"got reduction= and models="):
        BatchedPath(
            SPEC, DEFAULT_PARAMS, get_policy("bf16_writeback"), PathConfig(steps=1), [], [], models={}, reduction="ring"
        )


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
    with deprecated("default_model", here=False):  # BatchedPath hands it to BatchedOps
        assert same_bits(ring, master(default_model=Ring()))
    assert not same_bits(ring, master(reduction="sequential"))


def _rank_sum(rank: int) -> torch.Tensor:
    """Rank ``rank``'s row of `_values` summed over the world."""
    t = _values()[0, rank].clone()
    dist.all_reduce(t)
    return t


def test_the_fixture_takes_reduction_and_a_call_may_override_it():
    ring = torch.stack(SimdistWorld(reduction="ring").spawn(_rank_sum, 8))
    with deprecated("model"):
        older = SimdistWorld(model="ring")
    assert same_bits(ring, torch.stack(older.spawn(_rank_sum, 8)))
    assert older.model == "ring"
    gloo = torch.stack(SimdistWorld().spawn(_rank_sum, 8))
    assert not same_bits(ring, gloo)
    # a call's own keyword wins over the fixture's default (once a TypeError: the fixture added model=)
    assert same_bits(torch.stack(SimdistWorld(reduction="ring").spawn(_rank_sum, 8, reduction="gloo")), gloo)
    with deprecated("model", here=False):  # SimdistWorld.spawn hands it to simdist.spawn
        assert same_bits(torch.stack(SimdistWorld(reduction="gloo").spawn(_rank_sum, 8, model="ring")), ring)
    with pytest.raises(TypeError, match=r"got reduction= and model="):
        SimdistWorld(reduction="ring", model="gloo")


def test_the_fixture_leaves_the_deadline_to_the_launchers_one_default(monkeypatch):
    """The fixture once bounded each run by 120 s of its own; unset, a run gets the launcher's one deadline."""
    import simdist.world.inproc as inproc

    seen = []

    def recording_spawn(fn, world_size, *args, **kwargs):
        seen.append(kwargs.get("timeout_s", inspect.signature(spawn).parameters["timeout_s"].default))
        return spawn(fn, world_size, *args, **kwargs)

    spawn = inproc.spawn
    monkeypatch.setattr(inproc, "spawn", recording_spawn)
    SimdistWorld().spawn(_rank_sum, 2)
    SimdistWorld(timeout_s=7.5).spawn(_rank_sum, 2)
    SimdistWorld(timeout_s=7.5).spawn(_rank_sum, 2, timeout_s=None)
    assert seen == [DEFAULT_TIMEOUT_S, 7.5, None]


def test_the_compact_workload_takes_reduction_with_model_as_its_alias():
    from simdist.gradpath.probes import Capture
    from simdist.testing.compact import run_batched, run_oracle

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
    with deprecated("model", here=False):  # passed on by batched() and oracle() above
        assert same_bits(ring, batched(model=Ring())) and same_bits(oracle(reduction=Ring()), oracle(model=Ring()))
    assert not same_bits(ring, batched(reduction=Sequential()))
    assert same_bits(batched(), batched(reduction=Gloo()))  # the one default
    assert same_bits(oracle(), oracle(reduction=Gloo()))
    with pytest.raises(TypeError, match=r"got reduction= and model="):
        run_batched(SPEC, policy, local, config, reduction=Ring(), model=Ring())
    with pytest.raises(TypeError, match=r"got reduction= and model="):
        run_oracle(SPEC, local, 1, 1, reduction=Ring(), model=Ring())


def test_the_older_environment_variable_warns_and_the_new_one_wins(monkeypatch):
    """``SIMDIST_MODEL`` (process mode, torchrun) still works, with a `FutureWarning` (shown by Python's default
    filters, unlike a `DeprecationWarning` raised inside simdist); ``SIMDIST_REDUCTION`` wins, silently."""
    import warnings

    from simdist.world.process import process_reduction

    monkeypatch.delenv("SIMDIST_REDUCTION", raising=False)
    monkeypatch.setenv("SIMDIST_MODEL", "ring")
    with pytest.warns(FutureWarning, match=r"^SIMDIST_MODEL is a deprecated spelling of SIMDIST_REDUCTION"):
        assert type(process_reduction()) is Ring
    monkeypatch.setenv("SIMDIST_REDUCTION", "sequential")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert type(process_reduction()) is Sequential
