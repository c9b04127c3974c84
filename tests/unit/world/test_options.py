"""One ``reduction=`` grammar and one coercer message: every front end refuses the same bad value with the same
words (`simdist.world.options.read_reduction`), and `simdist.errors.coerce` names every valid value."""

from __future__ import annotations

import enum

import pytest
import torch.distributed as dist

import simdist
from simdist.errors import UsageError, coerce
from simdist.gradpath.batched import BatchedOps
from simdist.reduce import REDUCTION_NAMES
from simdist.world.options import REDUCTION_KINDS, Where
from simdist.world.simworld import SimWorld
from simdist.world.spec import ParallelSpec

SPEC = ParallelSpec(4, tp=2)


def _barrier(rank: int) -> None:
    dist.barrier()


FRONT_ENDS = {
    "SimWorld": lambda reduction: SimWorld(SPEC, reduction=reduction),
    "simdist.run threads (backend reduction map)": lambda reduction: simdist.run(_barrier, SPEC, reduction=reduction),
    "rank-batched path": lambda reduction: BatchedOps(SPEC, [0], reduction=reduction),
}


def _message(make, reduction) -> tuple[type, str]:
    with pytest.raises((UsageError, TypeError)) as info:
        make(reduction)
    return type(info.value), str(info.value)


@pytest.mark.parametrize("bad", ["rign", {"tp": "rign"}, {"tpp": "ring"}, 3, {"dp": 3}], ids=repr)
def test_every_front_end_refuses_a_bad_reduction_with_one_message(bad):
    messages = {name: _message(make, bad) for name, make in FRONT_ENDS.items()}
    assert len(set(messages.values())) == 1, messages


def test_the_one_message_names_the_valid_values():
    kind, text = _message(FRONT_ENDS["SimWorld"], "rign")
    assert kind is UsageError and text == f"unknown reduction 'rign'; valid: {', '.join(REDUCTION_NAMES)}"
    kind, text = _message(FRONT_ENDS["rank-batched path"], {"tpp": "ring"})
    assert kind is UsageError and text == f"reduction: unknown group kind 'tpp'; valid: {', '.join(REDUCTION_KINDS)}"


def test_the_coercer_returns_members_and_names_every_valid_value():
    assert coerce(Where, "gloo", "where") is Where.GLOO and coerce(Where, Where.THREADS, "where") is Where.THREADS
    with pytest.raises(UsageError) as info:
        coerce(Where, "thread", "where")
    assert str(info.value) == "unknown where 'thread'; valid: threads, processes, gloo"

    class Colour(enum.Enum):
        RED = 1

    with pytest.raises(UsageError, match=r"^unknown colour 'red'; valid: 1$"):
        coerce(Colour, "red", "colour")
