"""Model maps of the simdist backend are checked: typos and wrong types fail at once, listing the valid values."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import simdist
from simdist.reduce import REDUCTION_NAMES, make_reduction
from simdist.world.backend.reduction_map import Chooser
from simdist.world.options import REDUCTION_KINDS as MAP_KINDS
from simdist.world.spec import GROUP_KINDS, ParallelSpec

SPEC = ParallelSpec(4, tp=2)


def test_parallel_spec_defaults_are_no_parallelism():
    assert ParallelSpec(4) == ParallelSpec(4, tp=1, ep=1, etp=1, pp=1)
    assert (SPEC.dp, SPEC.ep, SPEC.edp) == (2, 1, 4)
    assert SPEC.groups("tp") == ((0, 1), (2, 3))


@pytest.mark.parametrize("kind", ["tpp", "TP", "data", 3])
def test_an_unknown_kind_is_an_error_listing_the_kinds(kind):
    with pytest.raises(ValueError, match="unknown group kind") as info:
        Chooser({kind: "ring"}, 4, SPEC)
    assert all(k in str(info.value) for k in MAP_KINDS)


def test_an_unknown_model_name_is_an_error_listing_the_names():
    for choice in ("rnig", {"tp": "rnig"}):
        with pytest.raises(ValueError, match="unknown reduction 'rnig'") as info:
            Chooser(choice, 4, SPEC)
        assert all(name in str(info.value) for name in REDUCTION_NAMES)


@pytest.mark.parametrize("choice", [3, {"tp": 3}, {"tp": torch.float32}, ["gloo"]])
def test_a_wrong_type_is_a_type_error_naming_the_valid_values(choice):
    with pytest.raises(TypeError) as info:
        Chooser(choice, 4, SPEC)
    assert "gloo" in str(info.value) and "Reduction" in str(info.value)


def test_none_is_the_default_reduction_as_in_every_front_end():
    assert type(Chooser(None, 4, SPEC)((0, 1))[1]) is type(make_reduction("gloo"))


def test_spec_kinds_without_a_spec_are_an_error():
    with pytest.raises(ValueError, match="pass spec="):
        Chooser({"tp": "ring"}, 4)
    Chooser({"world": "ring", "group": "tree", "default": "sequential"}, 4)  # fine without a spec


def test_a_callable_must_return_a_model():
    chooser = Chooser(lambda ranks: "ring", 4)
    with pytest.raises(TypeError, match="not a Reduction"):
        chooser((0, 1))


def test_valid_maps_still_choose_per_kind():
    chooser = Chooser({"tp": "sequential", "dp": make_reduction("tree")}, 4, SPEC)
    assert chooser((0, 1)) == ("tp", chooser.table.by_kind["tp"])
    assert type(chooser((0, 1))[1]) is type(make_reduction("sequential"))
    assert type(chooser((1, 3))[1]) is type(make_reduction("tree"))
    assert chooser((1, 3))[0] == "dp"
    assert type(chooser((0, 1, 2, 3))[1]) is type(make_reduction("gloo"))  # the default


def test_spawn_refuses_a_misspelt_kind_before_any_rank_runs():
    ran = []

    def fn(rank):
        ran.append(rank)
        dist.barrier()

    with pytest.raises(ValueError, match="'tpp'"):
        simdist.run(fn, SPEC, reduction={"tpp": "ring"})
    assert ran == []
    assert set(GROUP_KINDS) <= set(MAP_KINDS)
