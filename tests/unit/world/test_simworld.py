"""SimWorld: collective semantics, determinism, and loud failure."""

import threading

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from simdist.numerics.floats import bitwise_equal
from simdist.reduce import ReduceOp, Ring, Sequential, Tree, Upcast
from simdist.reduce.gloo import Gloo
from simdist.testing.strategies import float_values, parallel_specs
from simdist.world.errors import CollectiveDeadlockError, CollectiveMismatchError, SimTimeoutError
from simdist.world.simworld import SimWorld
from simdist.world.spec import ParallelSpec

SPEC = ParallelSpec(4, tp=2, ep=2)
REDUCTIONS = [Sequential(), Tree(), Ring(chunk_size=2), Upcast(torch.float64), Gloo()]


def _values(comm, seed: int, numel: int, dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1000 + comm.get_rank())
    return (torch.randn(numel, generator=g) * 2.0 ** torch.randint(-20, 20, (numel,), generator=g)).to(dtype)


def reduce_everywhere(comm, seed, numel, dtype, kind):
    x = _values(comm, seed, numel, dtype)
    inputs = x.clone()
    group = comm.group(kind)
    comm.all_reduce(x, group=group)
    return inputs, x


@given(
    parallel_specs(max_world_size=8),
    st.sampled_from(["tp", "dp", "ep", "edp", "world"]),
    st.sampled_from(REDUCTIONS),
    st.integers(0, 2**16),
    st.integers(1, 50),
    st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_all_reduce_gives_every_member_the_models_bits_in_group_order(spec, kind, reduction, seed, numel, dtype):
    results = SimWorld(spec, reduction=reduction).run(reduce_everywhere, seed, numel, dtype, kind)
    groups = [tuple(range(spec.world_size))] if kind == "world" else spec.groups(kind)
    for group in groups:
        expected = reduction.reduce([results[r][0] for r in group])
        for r in group:
            assert bitwise_equal(results[r][1], expected)


@given(st.sampled_from(REDUCTIONS), st.integers(0, 2**16), st.integers(1, 8))
def test_repeated_runs_give_identical_bits(reduction, seed, blocks):
    world = SimWorld(ParallelSpec(4, tp=2, ep=2), reduction=reduction)
    first = world.run(reduce_everywhere, seed, blocks * 4, torch.bfloat16, "world")
    second = world.run(reduce_everywhere, seed, blocks * 4, torch.bfloat16, "world")
    assert all(bitwise_equal(a[1], b[1]) for a, b in zip(first, second, strict=True))


def scatter_then_gather(comm, seed, blocks, dtype, op):
    x = _values(comm, seed, blocks * comm.get_world_size(), dtype)
    piece = torch.empty(blocks, dtype=dtype)
    comm.reduce_scatter_tensor(piece, x, op=op)
    gathered = torch.empty_like(x)
    comm.all_gather_into_tensor(gathered, piece)
    comm.all_reduce(x, op=op)
    return gathered, x


@given(
    st.sampled_from(REDUCTIONS),
    st.integers(0, 2**16),
    st.integers(1, 8),
    st.sampled_from([torch.float32, torch.bfloat16]),
    st.sampled_from(list(ReduceOp)),
)
def test_all_gather_of_reduce_scatter_equals_all_reduce(reduction, seed, blocks, dtype, op):
    for gathered, reduced in SimWorld(SPEC, reduction=reduction).run(scatter_then_gather, seed, blocks, dtype, op):
        assert bitwise_equal(gathered, reduced)


def test_groups_may_carry_their_own_models():
    spec = ParallelSpec(8, tp=4, ep=2)
    reductions = {"tp": Upcast(torch.float64), "world": Ring(chunk_size=1)}
    world = SimWorld(spec, reduction={**reductions, "default": Sequential()})

    def fn(comm):
        # 1.0 on the first rank of each group and 2**-8 elsewhere: in bf16 a rank-order fold loses every 2**-8
        # (ties to even), a single rounding of the exact sum does not, and a ring starting elsewhere does not either
        x = torch.full((8,), 1.0 if comm.get_rank() % 4 == 0 else 2.0**-8, dtype=torch.bfloat16)
        tp, everyone = x.clone(), x.clone()
        comm.all_reduce(tp, group=comm.group("tp"))
        comm.all_reduce(everyone)
        return x, tp, everyone

    results = world.run(fn)
    for kind, reduction in (("tp", reductions["tp"]), ("world", reductions["world"])):
        groups = spec.groups("tp") if kind == "tp" else [tuple(range(8))]
        position = 1 if kind == "tp" else 2
        for group in groups:
            expected = reduction.reduce([results[r][0] for r in group])
            assert not bitwise_equal(expected, Sequential().reduce([results[r][0] for r in group])), kind
            assert all(bitwise_equal(results[r][position], expected) for r in group), kind


def exchange(comm, value_rows):
    rank = comm.get_rank()
    group = comm.group("ep")
    me = group.rank_of(rank)
    send = [value_rows[rank][peer] for peer in range(group.size)]
    inp = torch.cat([torch.full((k, 2), float(10 * rank + peer)) for peer, k in enumerate(send)])
    recv = [value_rows[group.ranks[peer]][me] for peer in range(group.size)]
    out = torch.empty(sum(recv), 2)
    comm.all_to_all_single(out, inp, output_split_sizes=recv, input_split_sizes=send, group=group)
    return out


def test_all_to_all_single_with_uneven_splits():
    rows = {0: [1, 3], 1: [0, 2], 2: [2, 0], 3: [1, 1]}
    out = SimWorld(SPEC).run(exchange, rows)
    # rank 0 (group ep{0,1}) receives 1 row from itself and 0 rows from rank 1
    assert out[0].tolist() == [[0.0, 0.0]]
    assert out[1].tolist() == [[1.0, 1.0]] * 3 + [[11.0, 11.0]] * 2
    assert out[2].tolist() == [[20.0, 20.0]] * 2 + [[30.0, 30.0]]
    assert out[3].tolist() == [[31.0, 31.0]]


def test_all_to_all_single_rejects_inconsistent_splits():
    rows = {0: [1, 3], 1: [0, 2], 2: [2, 0], 3: [1, 1]}

    def wrong(comm):
        rank = comm.get_rank()
        inp = torch.zeros(sum(rows[rank]), 2)
        out = torch.zeros(4, 2)  # claims 2 rows from each peer
        comm.all_to_all_single(
            out, inp, output_split_sizes=[2, 2], input_split_sizes=rows[rank], group=comm.group("ep")
        )

    with pytest.raises(CollectiveMismatchError, match="split sizes do not match"):
        SimWorld(SPEC).run(wrong)


def test_broadcast_takes_a_global_source_rank():
    def fn(comm):
        t = torch.full((3,), float(comm.get_rank()))
        comm.broadcast(t, src=comm.group("dp").ranks[1], group=comm.group("dp"))
        return t

    assert [t[0].item() for t in SimWorld(SPEC).run(fn)] == [2.0, 3.0, 2.0, 3.0]


def test_barrier_and_world_sizes():
    def fn(comm):
        comm.barrier()
        comm.barrier(comm.group("tp"))
        return comm.get_rank(), comm.get_world_size(), comm.get_world_size(comm.group("ep"))

    assert SimWorld(SPEC).run(fn) == [(r, 4, 2) for r in range(4)]


def test_collectives_inside_autograd_backward():
    def fn(comm):
        w = torch.nn.Parameter(torch.full((4,), float(comm.get_rank() + 1)))
        w.register_hook(lambda g: (comm.all_reduce(g, group=comm.group("tp")), g)[1])
        (w * w).sum().backward()
        return w.grad

    grads = SimWorld(SPEC).run(fn)
    assert grads[0].tolist() == [6.0] * 4 and grads[3].tolist() == [14.0] * 4


def test_a_mismatch_names_every_rank_and_its_source_line():
    def fn(comm):
        t = torch.zeros(3 if comm.get_rank() == 1 else 4)
        comm.all_reduce(t, group=comm.group("tp"))

    with pytest.raises(CollectiveMismatchError) as info:
        SimWorld(SPEC).run(fn)
    message = str(info.value)
    assert "rank 0: all_reduce(group=tp{0,1}, op=SUM, shape=(4,), dtype=float32" in message
    assert "rank 1: all_reduce(group=tp{0,1}, op=SUM, shape=(3,), dtype=float32" in message
    assert "world/test_simworld.py" in message and "in fn" in message


@pytest.mark.parametrize("second", ["op", "dtype", "collective"])
def test_mismatched_ops_dtypes_and_collectives_are_caught(second):
    def fn(comm):
        t = torch.zeros(4)
        if comm.get_rank() == 0:
            comm.all_reduce(t)
        elif second == "op":
            comm.all_reduce(t, op=ReduceOp.MAX)
        elif second == "dtype":
            comm.all_reduce(t.double())
        else:
            comm.broadcast(t, src=0)

    with pytest.raises(CollectiveMismatchError, match="collective #0 on world"):
        SimWorld(SPEC).run(fn)


def test_an_exception_on_one_rank_stops_the_run_and_is_reraised_with_the_rank():
    def fn(comm):
        if comm.get_rank() == 2:
            raise KeyError("boom")
        comm.all_reduce(torch.zeros(2))

    # the other ranks wait in all_reduce for rank 2; they must be stopped by its exception, not by the world's
    # timeout (1 s here: stopping them late would raise SimTimeoutError instead of the KeyError)
    with pytest.raises(KeyError, match="boom") as info:
        SimWorld(SPEC, timeout_s=1.0).run(fn)
    assert "raised on rank 2 of a SimWorld run" in info.value.__notes__


def test_a_rank_that_returns_early_is_named():
    def fn(comm):
        if comm.get_rank() != 3:
            comm.all_reduce(torch.zeros(2))

    with pytest.raises(CollectiveDeadlockError, match=r"rank\(s\) \[3\] returned while world\{0,1,2,3\} waits"):
        SimWorld(SPEC).run(fn)


def test_crossed_group_orders_are_a_deadlock_not_a_hang():
    def fn(comm):
        # 0 waits on dp{0,2} for 2, 2 on tp{2,3} for 3, 3 on dp{1,3} for 1, 1 on tp{0,1} for 0
        first, second = ("dp", "tp") if comm.get_rank() in (0, 3) else ("tp", "dp")
        comm.all_reduce(torch.zeros(1), group=comm.group(first))
        comm.all_reduce(torch.zeros(1), group=comm.group(second))

    with pytest.raises(CollectiveDeadlockError, match="no collective can complete"):
        SimWorld(SPEC).run(fn)


def test_a_rank_stuck_outside_collectives_times_out_with_its_location():
    release = threading.Event()

    def fn(comm):
        if comm.get_rank() == 1:
            release.wait(5)
        try:
            comm.barrier()
        finally:  # the timeout ends the others' barrier: let rank 1 go then, not after the run's grace waits
            release.set()

    with pytest.raises(SimTimeoutError, match="rank 1"):
        SimWorld(SPEC, timeout_s=0.3).run(fn)
    release.set()


def test_no_rank_thread_outlives_a_failed_run():
    def fn(comm):
        if comm.get_rank() == 0:
            raise RuntimeError("stop")
        comm.barrier()

    with pytest.raises(RuntimeError):
        SimWorld(SPEC).run(fn)
    assert not [t for t in threading.enumerate() if t.name.startswith("simdist-rank-")]


def test_a_non_member_group_is_rejected():
    def fn(comm):
        comm.all_reduce(torch.zeros(1), group=comm.group("tp") if comm.get_rank() else SPEC_TP_OTHER)

    with pytest.raises(ValueError, match=r"rank 0 called a collective on tp\{2,3\}"):
        SimWorld(SPEC).run(fn)


SPEC_TP_OTHER = __import__("simdist.world.groups", fromlist=["Group"]).Group("tp", (2, 3))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tensors_reduce_to_the_cpu_bits():
    def fn(comm, device):
        x = _values(comm, 7, 1000, torch.bfloat16).to(device)
        comm.all_reduce(x)
        return x.cpu()

    cpu = SimWorld(SPEC).run(fn, "cpu")
    gpu = SimWorld(SPEC).run(fn, "cuda")
    assert all(bitwise_equal(a, b) for a, b in zip(cpu, gpu, strict=True))


@given(float_values(torch.float32, min_exponent=-3, max_exponent=3))
def test_float_values_strategy_respects_the_exponent_window(value):
    assert value == 0 or 2.0**-3 <= abs(value) < 2.0**4


@pytest.mark.parametrize("change", ["shape", "dtype", "op"])
def test_a_mismatch_after_cached_calls_is_still_caught(change):
    """all_reduce's checks and signature are cached per (op, shape, dtype) on each group (collectives.
    all_reduce_one): after matching calls have filled the caches (on the world and on tp), one rank calling with
    another shape, dtype or op must still be a mismatch (a cache keyed too coarsely would hand it the cached
    signature of another call)."""

    def fn(comm):
        t = torch.zeros(4)
        for _ in range(3):
            comm.all_reduce(t)
        comm.all_reduce(t, op=ReduceOp.MAX)
        comm.all_reduce(t.double())
        comm.all_reduce(torch.zeros(5))
        comm.all_reduce(t, group=comm.group("tp"))
        if comm.get_rank() != 1:
            comm.all_reduce(t)
        elif change == "shape":
            comm.all_reduce(torch.zeros(5))
        elif change == "dtype":
            comm.all_reduce(t.double())
        else:
            comm.all_reduce(t, op=ReduceOp.MAX)

    with pytest.raises(CollectiveMismatchError, match="collective #6 on world") as info:
        SimWorld(SPEC).run(fn)
    assert "rank 1: all_reduce(group=world{0,1,2,3}" in str(info.value)
