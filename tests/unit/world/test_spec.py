"""ParallelSpec: the folding layout, derived sizes, and clear errors for invalid specs."""

import pytest
from hypothesis import given

from simdist.testing.strategies import parallel_specs
from simdist.world.spec import GROUP_KINDS, ParallelSpec


def test_tp2_ep2_etp1_tables_match_the_folding_layout():
    spec = ParallelSpec(4, tp=2, ep=2)
    assert spec.groups("tp") == ((0, 1), (2, 3))
    assert spec.groups("dp") == ((0, 2), (1, 3))
    assert spec.groups("ep") == ((0, 1), (2, 3))
    assert spec.groups("edp") == ((0, 2), (1, 3))
    assert (spec.dp, spec.edp) == (2, 2)


def test_tp_lane_major_layout_lets_ep_groups_span_tp_lanes():
    spec = ParallelSpec(4, tp=2, ep=2, ep_layout="tp_lane_major")
    assert spec.groups("ep") == ((0, 2), (1, 3))
    assert spec.groups("edp") == ((0, 1), (2, 3))


def test_groups_list_their_ranks_in_ascending_order_as_torch_does():
    spec = ParallelSpec(4, tp=2, ep=4, ep_layout="tp_lane_major")  # lane-major order would be 0, 2, 1, 3
    assert spec.groups("ep") == ((0, 1, 2, 3),)


def test_etp_groups_are_contiguous_and_ep_strided_by_etp():
    spec = ParallelSpec(8, tp=2, ep=2, etp=2)
    assert spec.groups("etp") == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert spec.groups("ep") == ((0, 2), (1, 3), (4, 6), (5, 7))
    assert spec.groups("edp") == ((0, 4), (1, 5), (2, 6), (3, 7))


def test_pipeline_stages_each_get_their_own_groups():
    spec = ParallelSpec(8, tp=2, ep=2, pp=2)
    assert spec.groups("tp") == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert spec.groups("dp") == ((0, 2), (1, 3), (4, 6), (5, 7))
    assert spec.groups("pp") == ((0, 4), (1, 5), (2, 6), (3, 7))


@given(parallel_specs(max_world_size=16))
def test_every_rank_is_in_exactly_one_group_of_each_kind(spec):
    for kind in GROUP_KINDS:
        members = sorted(r for group in spec.groups(kind) for r in group)
        assert members == list(range(spec.world_size)), kind
        assert len({len(g) for g in spec.groups(kind)}) == 1, kind
    assert spec.tp * spec.dp == spec.ep * spec.etp * spec.edp == spec.stage_size
    assert (spec.size("tp"), spec.size("dp"), spec.size("ep"), spec.size("edp")) == (
        spec.tp,
        spec.dp,
        spec.ep,
        spec.edp,
    )


@given(parallel_specs(max_world_size=16))
def test_tp_and_dp_groups_cross_in_exactly_one_rank(spec):
    for tp_group in spec.groups("tp"):
        for dp_group in spec.groups("dp"):
            shared = set(tp_group) & set(dp_group)
            same_stage = tp_group[0] // spec.stage_size == dp_group[0] // spec.stage_size
            assert len(shared) == (1 if same_stage else 0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(world_size=4, tp=3, ep=2), r"tp=3 must divide the stage size .* valid tp values: \[1, 2, 4\]"),
        (
            dict(world_size=4, tp=2, ep=3),
            r"ep\*etp=3\*1=3 must divide the stage size .* valid ep\*etp values: "
            r"\[1, 2, 4\]",
        ),
        (dict(world_size=6, tp=2, ep=2, pp=4), r"pp=4 must divide world_size=6; valid pp values: \[1, 2, 3, 6\]"),
        (dict(world_size=4, tp=0, ep=2), r"tp must be a positive integer, got 0"),
        (dict(world_size=4, tp=2, ep=2, ep_layout="diagonal"), r"ep_layout='diagonal' is unknown; valid: "),
    ],
)
def test_invalid_specs_name_the_broken_constraint_and_valid_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ParallelSpec(**kwargs)


def test_unknown_group_kind_lists_the_valid_kinds():
    with pytest.raises(ValueError, match="unknown group kind 'mp'; valid: tp, dp, ep, etp, edp, pp"):
        ParallelSpec(4, tp=2, ep=2).groups("mp")
