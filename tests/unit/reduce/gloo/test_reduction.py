"""gloo's reduce segmenting, complex and bool tensors, and simdist's refusals where gloo crashes or hangs.

In-process checks (no real gloo; `tests/integration/test_gloo_corners.py` holds the
comparisons against real gloo processes). The reference for ``dist.reduce`` is
a step-by-step run of gloo's reduce loop (``gloo/reduce.cc``: segments,
iterations, the two scratch slots, the gather to the root), written from the
algorithm and sharing no code with `simdist.reduce.gloo.reduction`; a small
``max_segment_bytes`` puts many segments in a chunk with tiny tensors.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import simdist
from simdist.numerics.floats import bits
from simdist.reduce import ReduceOp
from simdist.reduce.gloo import Gloo, chunk_length, reduce_chunk_length
from simdist.world.groups import Group
from simdist.world.simworld import SimWorld
from simdist.world.spec import ParallelSpec


def step_by_step_gloo_reduce(xs: list[torch.Tensor], root: int, max_segment_bytes: int) -> list[torch.Tensor]:
    """Every rank's buffer after gloo's ``reduce`` (SUM, in place), iteration by iteration, all ranks in lockstep."""
    n, numel, e = len(xs), xs[0].numel(), xs[0].element_size()
    total = numel * e
    cap = e * (max_segment_bytes // e)
    seg_bytes = -(-min(-(-total // (2 * n)), cap) // e) * e
    seg = seg_bytes // e
    segments = max(-(-total // seg_bytes), 2 * n)
    segments += (-segments) % n
    per_rank = segments // n
    buf = [x.clone() for x in xs]
    tmp = [[None, None] for _ in range(n)]

    def span(r: int, i: int, which: int) -> tuple[int, int]:  # which: 1 = send, 2 = receive
        start = (((r + which) * per_rank + i) * seg) % (segments * seg)
        return start, min(start + seg, numel)

    for i in range(segments):
        if i >= 2:
            for r in range(n):
                lo, hi = span(r, i - 2, 2)
                if hi > lo:
                    buf[r][lo:hi] = buf[r][lo:hi] + tmp[r][i & 1]  # out = in + received
        if i < segments - 2:
            sent = [buf[(r + 1) % n][slice(*span((r + 1) % n, i, 1))].clone() for r in range(n)]
            for r in range(n):
                lo, hi = span(r, i, 2)
                if hi > lo:
                    tmp[r][i & 1] = sent[r]
    for r in range(n):
        if r != root:
            lo, hi = r * per_rank * seg, min((r + 1) * per_rank * seg, numel)
            if hi > lo:
                buf[root][lo:hi] = buf[r][lo:hi]
    return buf


@pytest.mark.parametrize("n", [2, 3, 5])
@pytest.mark.parametrize("numel", [5, 31, 61, 200])
def test_reduce_buffers_equal_a_step_by_step_run_of_gloos_reduce_loop(n, numel):
    gen = torch.Generator().manual_seed(n * 1000 + numel)
    k = torch.randint(-20, 21, (n, numel), generator=gen, dtype=torch.int32)
    x = torch.randn(n, numel, generator=gen) * ((k + 127) << 23).view(torch.float32)
    for segment_bytes in (4, 20, 36, 1 << 20):  # tiny caps: many segments per chunk, as above 2n MiB
        model = Gloo(max_segment_bytes=segment_bytes)
        for root in sorted({0, n - 1, n // 2}):
            expected = step_by_step_gloo_reduce(list(x), root, segment_bytes)
            got = model.reduce_buffers(list(x), ReduceOp.SUM, root)
            for r in range(n):
                assert torch.equal(bits(got[r]), bits(expected[r])), (segment_bytes, root, r)


def test_reduce_chunks_are_all_reduce_chunks_up_to_2n_segments_and_whole_segments_above():
    m = (1 << 20) // 4
    for n in range(2, 9):
        for numel in (1, 7, 1000, 2 * n * m - 1, 2 * n * m):
            assert reduce_chunk_length(numel, n, 4) == chunk_length(numel, n, 4), (n, numel)
        assert reduce_chunk_length(2 * n * m + 1, n, 4) % m == 0
    assert (reduce_chunk_length(1572865, 3, 4), chunk_length(1572865, 3, 4)) == (786432, 524289)  # the case


def test_complex_reduce_is_reduced_on_the_real_view_and_refuses_what_gloo_refuses():
    gen = torch.Generator().manual_seed(3)
    x = torch.complex(torch.randn(4, 37, generator=gen), torch.randn(4, 37, generator=gen))
    real = torch.view_as_real(x)
    modelled = Gloo().reduce_buffers(list(x), ReduceOp.SUM, 1), Gloo().reduce_buffers(list(real), ReduceOp.SUM, 1)
    pairs = zip(*modelled, strict=True)
    for r, (got, want) in enumerate(pairs):
        assert torch.equal(bits(got), bits(torch.view_as_complex(want))), r
    avg = Gloo().reduce_to(list(x), ReduceOp.AVG, 0)
    assert torch.equal(bits(avg), bits(torch.view_as_complex(Gloo().reduce(list(real))).div_(4)))  # complex div_
    for op in (ReduceOp.MAX, ReduceOp.MIN, ReduceOp.PRODUCT):
        with pytest.raises(RuntimeError, match=r"does not support \w+ on complex tensors"):
            Gloo().reduce_to(list(x), op, 0)


def test_bool_sum_leaves_byte_counts_and_reduce_leaves_partial_counts():
    ones = [torch.ones(4, dtype=torch.bool)] * 3
    assert bits(Gloo().reduce(ones)).tolist() == [3] * 4  # real gloo: bytes [3, 3, 3, 3]
    buffers = Gloo().reduce_buffers(ones, ReduceOp.SUM, 0)
    assert [bits(b).tolist() for b in buffers] == [[3, 3, 3, 3], [2, 2, 3, 3], [1, 1, 2, 2]]  # as real gloo


def _bool_and_refusals(rank):
    out = {}
    t = torch.ones(2, dtype=torch.bool)
    dist.all_reduce(t)
    out["bool sum"] = bits(t)
    for name, call in (
        ("0-dim output", lambda: dist.reduce_scatter_tensor(torch.zeros(()), torch.ones(dist.get_world_size()))),
        ("wrong-shape scatter", lambda: dist.scatter(torch.zeros(3), [torch.ones(2)] * 3 if rank == 0 else None, 0)),
    ):
        try:
            call()
            out[name] = "ran"
        except RuntimeError as exc:
            out[name] = str(exc)
    return out


def test_simdist_refuses_on_every_rank_where_gloo_crashes_or_hangs_and_keeps_bool_bytes():
    results = simdist.run(_bool_and_refusals, 3)
    for r in results:
        assert r["bool sum"].tolist() == [3, 3]
        assert "segmentation fault" in r["0-dim output"]  # gloo's process dies on this
        assert "hangs the peers" in r["wrong-shape scatter"]


def _reduces_via_comm(comm, dtype):
    n = comm.get_world_size()
    x = _inputs(comm.get_rank(), n, dtype)
    comm.reduce(x, dst=2, group=Group("world", tuple(range(n))))
    out = torch.zeros(5, dtype=dtype)
    comm.reduce_scatter(out, list(_inputs(comm.get_rank() + 10, n, dtype).split(5)))
    return bits(x), bits(out)


def _reduces_via_torch(rank, dtype):
    n = dist.get_world_size()
    x = _inputs(rank, n, dtype)
    dist.reduce(x, dst=2)
    out = torch.zeros(5, dtype=dtype)
    dist.reduce_scatter(out, list(_inputs(rank + 10, n, dtype).split(5)))
    return bits(x), bits(out)


def _inputs(seed: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, (5 * n,), generator=gen).bool()
    if dtype.is_complex:
        return torch.complex(torch.randn(5 * n, generator=gen), torch.randn(5 * n, generator=gen))
    return torch.randn(5 * n, generator=gen).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.complex64, torch.bool])
def test_simcomm_reduce_and_list_reduce_scatter_give_the_backends_bytes(dtype):
    world = SimWorld(ParallelSpec(4, tp=1, ep=1), reduction=Gloo())
    via_comm = world.run(_reduces_via_comm, dtype)
    via_torch = simdist.run(_reduces_via_torch, 4, args=(dtype,))
    for r in range(4):
        for a, b in zip(via_comm[r], via_torch[r], strict=True):
            assert torch.equal(a, b), r


def _reverse_tags(rank):
    x = torch.zeros(2)
    if rank == 0:
        dist.send(torch.ones(2), 1, tag=1)
        dist.send(torch.ones(2) * 2, 1, tag=2)
    else:
        dist.recv(x, 0, tag=2)  # gloo: rank 0 is still blocked in its tag-1 send; neither returns
        dist.recv(x, 0, tag=1)
    return x


def _exchange(rank):
    peer = 1 - rank
    x = torch.full((2,), float(rank))
    got = torch.zeros(2)
    reqs = [dist.isend(x, peer, tag=5), dist.irecv(got, peer, tag=5)]
    for req in reqs:
        req.wait()
    if rank == 0:  # blocking sends received in order
        dist.send(x + 1, 1, tag=1)
        dist.send(x + 2, 1, tag=2)
    else:
        dist.recv(x, 0, tag=1)
        dist.recv(got, 0, tag=2)
    return x, got


def test_blocking_sends_received_in_reverse_tag_order_are_a_reported_deadlock():
    from simdist.world.errors import CollectiveDeadlockError

    with pytest.raises(CollectiveDeadlockError, match="blocking send"):
        simdist.run(_reverse_tags, 2)
    (_, got0), (x1, got1) = simdist.run(_exchange, 2)  # isend/irecv and in-order blocking sends still run
    assert got0.tolist() == [1.0, 1.0] and x1.tolist() == [1.0, 1.0] and got1.tolist() == [2.0, 2.0]
