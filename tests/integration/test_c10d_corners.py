"""c10d's corners (issue 32 item 3) as real gloo answers them, in threads and in process mode, bit for bit.

One rank program (`simdist.testing._internal.c10d_corners.corner_outcomes`) records every corner's outcome --
raw bytes of every tensor, sparse indices and values, futures' types and values, or the exception's type -- on real gloo
processes and on simdist; the outcomes must be equal. P = 2 in the default suite, P up to 8 under slow.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import simdist
from simdist.testing._internal.c10d_corners import CORNERS, corner_outcomes, encode, short_scatter_object_list

pytestmark = pytest.mark.gloo


def differences(real: list[dict], seen: list[dict]) -> list[str]:
    """Every corner and rank whose outcome differs from real gloo's."""
    return [
        f"{name} rank {rank}: gloo {str(real[rank][name])[:200]} | simdist {str(seen[rank][name])[:200]}"
        for name in CORNERS
        for rank in range(len(real))
        if real[rank][name] != seen[rank][name]
    ]


@pytest.fixture(scope="module")
def real_p2() -> list[dict]:
    return simdist.run(corner_outcomes, 2, where="gloo", timeout_s=240)


def test_real_gloos_answers_are_the_ones_the_corners_are_about(real_p2):
    """Power: the facts the issue names hold on real gloo (so an equal outcome means something)."""
    rank0 = real_p2[0]
    floats = [[torch.tensor([1.0]), torch.tensor([2.0])], [torch.tensor([11.0]), torch.tensor([12.0])]]
    assert rank0["agc_layout"] == ("ok", encode(floats))  # [[1, 2], [11, 12]], not [[1, 11], [2, 12]]
    for refused in ("agc_transposed_layout", "agc_short_list", "agc_shape_mismatch", "agc_reshape"):
        assert rank0[refused] == ("error", "RuntimeError"), refused
    future, _ = rank0["fut_all_gather_into_tensor"][1]
    assert future[:2] == ("future", "torch.Future") and len(future[2]) == 2  # P pieces, not [output]
    assert rank0["fut_reduce_scatter_tensor"][1][0] == ("get_future raised", "RuntimeError")
    assert rank0["fut_all_reduce_coalesced"][1][0][1] == "torch.Future"
    assert rank0["irecv_any_source_rank"][1][0] == 1
    kind, _, _, coalesced, *_ = rank0["sparse_sum"][1]
    assert (kind, coalesced) == ("sparse", True)
    assert rank0["sparse_max"] == ("error", "RuntimeError")
    assert rank0["sparse_all_reduce_coalesced"] == ("error", "NotImplementedError")
    bigger, other_dtype, _ = real_p2[1]["recv_larger_buffer"][1]
    assert bigger == encode(torch.tensor([1.5, -2.25, -1.0, -1.0]))  # the rest of the buffer kept
    expected = torch.full((3,), -1, dtype=torch.int32)
    expected[:2] = torch.tensor([1.5, -2.25]).view(torch.int32)  # the float's bytes, in an int32 buffer
    assert other_dtype == encode(expected)
    assert (rank0["self_isend"], rank0["self_send"]) == (("error", "RuntimeError"), ("error", "ValueError"))
    for bad in ("a2a_split_count", "a2a_split_sum", "a2a_negative_split", "a2a_bytes_differ"):
        assert rank0[bad] == ("error", "RuntimeError"), bad
    assert rank0["a2a_rows_split"] == ("ok", encode(torch.tensor([[0.0, 1.0], [2.0, 10.0], [11.0, 12.0]])))


def test_rank_threads_answer_every_corner_as_real_gloo(real_p2):
    found = differences(real_p2, simdist.run(corner_outcomes, 2))
    assert not found, "\n".join(found)


def test_process_mode_answers_every_corner_as_real_gloo(real_p2):
    found = differences(real_p2, simdist.run(corner_outcomes, 2, where="processes", timeout_s=240))
    assert not found, "\n".join(found)


@pytest.mark.slow
@pytest.mark.parametrize("world", [3, 4, 5, 8])
def test_every_corner_as_real_gloo_at_larger_worlds(world):
    real = simdist.run(corner_outcomes, world, where="gloo", timeout_s=600)
    for mode, seen in (
        ("threads", simdist.run(corner_outcomes, world)),
        ("process", simdist.run(corner_outcomes, world, where="processes", timeout_s=600)),
    ):
        found = differences(real, seen)
        assert not found, mode + ":\n" + "\n".join(found)


def _short_scatter(rank: int) -> None:
    dist.scatter_object_list([None], ["only one"] if rank == 0 else None, 0)


def test_a_short_scatter_object_list_is_gloos_runtime_error_in_threads():
    """The root raises gloo's RuntimeError at the call; in threads that stops the run (gloo's peers hang)."""
    with pytest.raises(RuntimeError, match="Incorrect input list size 1") as caught:
        simdist.run(_short_scatter, 2)
    assert type(caught.value) is RuntimeError and "raised on rank 0" in str(caught.value.__notes__)


@pytest.mark.slow
def test_a_short_scatter_object_list_raises_as_on_gloo_in_process_mode():
    real = simdist.run(short_scatter_object_list, 2, where="gloo", timeout_s=120)
    seen = simdist.run(short_scatter_object_list, 2, where="processes", timeout_s=120)
    assert real[0] == seen[0] == ("RuntimeError", True)  # the root: gloo's type
    assert real[1][1] and seen[1][1]  # the peer: the group's timeout, a RuntimeError on both


# -- any-source receives in threads: deterministic ----------------------------------------------------------


def _fan_in(rank: int, early: bool) -> list[int] | None:
    """Ranks 1.. send to rank 0, which receives without naming the source; ``early``: the messages are queued
    (isend, then a barrier) before rank 0 posts its receives."""
    world = dist.get_world_size()
    if rank == 0:
        if early:
            dist.barrier()
        got = []
        for _ in range(world - 1):
            t = torch.zeros(1)
            src = dist.recv(t)
            assert t.item() == src
            got.append(src)
        if not early:
            dist.barrier()
        return got
    work = dist.isend(torch.tensor([float(rank)]), 0)
    dist.barrier()
    work.wait()
    return None


@pytest.mark.parametrize("early", [False, True])
def test_any_source_receives_in_threads_take_the_earliest_sent_message(early):
    """Rank threads run one at a time, rank 0 first: the messages are sent in rank order, and an any-source
    receive takes the earliest sent (queued, or the first to come); the same order on every run."""
    runs = [simdist.run(_fan_in, 4, args=(early,))[0] for _ in range(2)]
    assert runs[0] == runs[1] == [1, 2, 3]


def _send_in_reverse(rank: int, early: bool) -> list[int] | None:
    """The last rank sends to rank 0 first, then passes a token down; each rank sends to 0 once it has the token,
    so the messages are sent in reverse rank order. ``early``: they are all queued (isend, then a barrier) before
    rank 0 posts its receives."""
    world = dist.get_world_size()
    if rank == 0:
        if early:
            dist.barrier()
        got = [dist.recv(torch.zeros(1)) for _ in range(world - 1)]
        if not early:
            dist.barrier()
        return got
    if rank < world - 1:
        dist.recv(torch.zeros(1), rank + 1)
    work = dist.isend(torch.tensor([float(rank)]), 0)
    if rank > 1:
        dist.send(torch.tensor([0.0]), rank - 1)
    dist.barrier()
    work.wait()
    return None


@pytest.mark.parametrize("early", [False, True])
def test_an_any_source_receive_follows_the_send_order_not_the_rank_order(early):
    assert simdist.run(_send_in_reverse, 4, args=(early,))[0] == [3, 2, 1]


# -- what simdist refuses where gloo has no answer or the model is not gloo's ---------------------------------


def _smaller_buffer(rank: int) -> None:
    if rank == 0:
        dist.send(torch.ones(3), 1)
    else:
        dist.recv(torch.zeros(2), 0)


def test_a_receive_into_a_smaller_buffer_fails_the_run_naming_both_calls():
    """On gloo the receiver crashes or hangs; simdist says which send and which receive."""
    from simdist.world.errors import CollectiveMismatchError

    with pytest.raises(CollectiveMismatchError, match=r"12 bytes\) does not fit the receive buffer \(8 bytes") as e:
        simdist.run(_smaller_buffer, 2)
    assert "rank 0: send" in str(e.value) and "rank 1: recv" in str(e.value)


def _sparse_and_monitored(rank: int, which: str) -> None:
    if which == "sparse":
        dist.all_reduce(torch.sparse_coo_tensor(torch.tensor([[0]]), torch.tensor([1.0]), (2,), check_invariants=True))
    else:
        group: object = dist.group.WORLD
        group.monitored_barrier()  # type: ignore[attr-defined]


@pytest.mark.parametrize("which", ["sparse", "monitored_barrier"])
def test_sparse_all_reduce_and_group_monitored_barrier_are_refused_under_another_model(which):
    """Only gloo's sparse all_reduce and monitored_barrier are modelled: another reduction refuses them."""
    simdist.run(_sparse_and_monitored, 2, args=(which,))  # the default model is gloo's: answered
    with pytest.raises(RuntimeError, match="reduction is sequential" if which == "sparse" else "only gloo implements"):
        simdist.run(_sparse_and_monitored, 2, args=(which,), reduction="sequential")
