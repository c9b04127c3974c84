"""c10d's corners as gloo answers them: one rank program that records every corner's outcome, bit for bit.

`corner_outcomes` runs on any front end (real gloo processes, simdist's rank threads, simdist's process mode)
and returns, per corner, either the value it produced -- tensors as their raw bytes, dtype and shape; sparse
tensors as their indices' and values' bytes and whether they are coalesced; futures as their type's name and
value -- or the exception's type name. Equal outcomes across front ends mean equal bits or the same error.

The corners (issue 32, item 3, each found by experiment against real gloo, torch 2.13):

* ``all_gather_coalesced``: its output layout (``output_lists[j][k]`` is rank ``j``'s input ``k``) and its
  refusals (a number of lists other than the world size, a shape or reshape mismatch);
* the futures of async collectives: their type (``torch.Future``) and value, and the reduce_scatters' raising
  ``get_future``;
* ``recv`` from any source (``src=None``) and the returned source rank (compared as the set of messages each
  receiver got, since on gloo their order is a race);
* sparse ``all_reduce`` (values with rounding sums and in-rank duplicates; the result's indices, values and
  coalescing; ``MAX`` refused);
* ``ProcessGroup.monitored_barrier`` on a group object;
* a receive into a larger buffer, into another dtype or shape of the same bytes; sends and receives to oneself;
* ``all_to_all_single`` with bad split sizes, and without split sizes on a dim 0 the group size does not
  divide (gloo cuts the bytes).

Every corner is written so that real gloo raises on every rank or on none (a corner where one rank raises and
its peers wait would hang gloo until its timeout); `short_scatter_object_list` is the one exception, kept apart.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

Outcome = tuple
"""``("ok", value)`` or ``("error", type name)``; values are nested tuples of plain data (picklable)."""


def encode(value: Any) -> Any:
    """``value`` as plain data: a tensor as ``("tensor", dtype, shape, raw bytes)``, a sparse tensor as
    ``("sparse", dtype, shape, coalesced, indices' bytes, values' bytes)``, a future as ``("future", type name,
    value)``, lists and tuples element-wise; anything else as itself."""
    if isinstance(value, torch.Tensor):
        if value.is_sparse:
            indices, values = value._indices(), value._values()
            return ("sparse", str(value.dtype), tuple(value.shape), value.is_coalesced(), *_raw(indices), *_raw(values))
        return ("tensor", *_raw(value))
    if isinstance(value, torch._C.Future):
        return ("future", f"{type(value).__module__}.{type(value).__qualname__}", encode(value.wait()))
    if isinstance(value, (list, tuple)):
        return tuple(encode(v) for v in value)
    if isinstance(value, torch.dtype):
        return str(value)
    return value


def _raw(t: torch.Tensor) -> tuple:
    t = t.detach().contiguous()
    return (str(t.dtype), tuple(t.shape), t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")


def _rounding_values(gen: torch.Generator, n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Values whose sums round: normal draws times powers of two 2^-20..2^20, a third negated near-copies."""
    scale = torch.ldexp(torch.ones(n, dtype=torch.float64), torch.randint(-20, 21, (n,), generator=gen))
    x = torch.randn(n, generator=gen, dtype=torch.float64) * scale
    return x.to(dtype)


# -- the corners: each a function (rank, world) -> value; raising is an outcome too --------------------------


def agc_layout(rank: int, world: int) -> Any:
    """gloo fills ``[[1, 2], [11, 12]]`` at P = 2: list j holds rank j's inputs."""
    inputs = [torch.tensor([1.0 + 10 * rank]), torch.tensor([2.0 + 10 * rank])]
    outputs = [[torch.zeros(1), torch.zeros(1)] for _ in range(world)]
    dist.all_gather_coalesced(outputs, inputs)
    return outputs


def agc_mixed_shapes(rank: int, world: int) -> Any:
    """Three inputs of different shapes (rounding-prone bits), one more than P = 2."""
    gen = torch.Generator().manual_seed(100 + rank)
    inputs = [_rounding_values(gen, 1), _rounding_values(gen, 6).reshape(2, 3), _rounding_values(gen, 4)]
    outputs = [[torch.zeros_like(t) for t in inputs] for _ in range(world)]
    dist.all_gather_coalesced(outputs, inputs)
    return outputs


def agc_one_input(rank: int, world: int) -> Any:
    inputs = [torch.arange(3, dtype=torch.int64) + 100 * rank]
    outputs = [[torch.zeros(3, dtype=torch.int64)] for _ in range(world)]
    dist.all_gather_coalesced(outputs, inputs)
    return outputs


def agc_transposed_layout(rank: int, world: int) -> Any:
    """``[k][j]`` (all_gather's layout) with P + 1 inputs: gloo refuses it (lists != world size)."""
    inputs = [torch.tensor([1.0 + rank]) for _ in range(world + 1)]
    outputs = [[torch.zeros(1) for _ in range(world)] for _ in range(world + 1)]
    dist.all_gather_coalesced(outputs, inputs)
    return outputs


def agc_too_many_lists(rank: int, world: int) -> Any:
    """P + 1 lists, each as long as the inputs: refused for their number alone."""
    inputs = [torch.tensor([1.0 + rank]), torch.tensor([2.0])]
    outputs = [[torch.zeros(1), torch.zeros(1)] for _ in range(world + 1)]
    dist.all_gather_coalesced(outputs, inputs)
    return outputs


def agc_broadcastable_shape(rank: int, world: int) -> Any:
    """An output of shape (1, 3) for a (3,) input: a copy would broadcast; gloo refuses the shape."""
    inputs = [torch.tensor([1.0, 2.0, 3.0]) + rank]
    outputs = [[torch.zeros(1, 3)] for _ in range(world)]
    dist.all_gather_coalesced(outputs, inputs)
    return outputs


def agc_short_list(rank: int, world: int) -> Any:
    """P lists, each one tensor short."""
    inputs = [torch.tensor([1.0 + rank]), torch.tensor([2.0])]
    outputs = [[torch.zeros(1)] for _ in range(world)]
    dist.all_gather_coalesced(outputs, inputs)
    return outputs


def agc_shape_mismatch(rank: int, world: int) -> Any:
    inputs = [torch.tensor([1.0 + rank]), torch.tensor([2.0])]
    outputs = [[torch.zeros(1), torch.zeros(2)] for _ in range(world)]
    dist.all_gather_coalesced(outputs, inputs)
    return outputs


def agc_reshape(rank: int, world: int) -> Any:
    """An output of the input's numel in another shape: gloo refuses it."""
    inputs = [torch.arange(6.0).reshape(2, 3) + rank]
    outputs = [[torch.zeros(3, 2)] for _ in range(world)]
    dist.all_gather_coalesced(outputs, inputs)
    return outputs


def agc_async(rank: int, world: int) -> Any:
    inputs = [torch.tensor([1.0 + 10 * rank]), torch.tensor([2.0 + 10 * rank])]
    outputs = [[torch.zeros(1), torch.zeros(1)] for _ in range(world)]
    future = dist.all_gather_coalesced(outputs, inputs, async_op=True)
    return future, outputs


def _future_of(start: Callable[[], Any]) -> Any:
    """The Work's future (type and value), or the error ``get_future`` raises, then the Work waited on."""
    work = start()
    try:
        future = work.get_future()
    except Exception as exc:  # gloo raises for the reduce_scatters
        work.wait()
        return ("get_future raised", type(exc).__name__)
    return future


def fut_all_gather_into_tensor(rank: int, world: int) -> Any:
    """gloo's future holds the output's P pieces, not ``[output]``."""
    out = torch.zeros(2 * world, 3)
    future = _future_of(lambda: dist.all_gather_into_tensor(out, torch.full((2, 3), 1.0 + rank), async_op=True))
    return future, out


def fut_reduce_scatter_tensor(rank: int, world: int) -> Any:
    out = torch.zeros(2)
    return _future_of(lambda: dist.reduce_scatter_tensor(out, torch.arange(2.0 * world) + rank, async_op=True)), out


def fut_reduce_scatter(rank: int, world: int) -> Any:
    out = torch.zeros(1)
    inputs = [torch.ones(1) * (rank + i) for i in range(world)]
    return _future_of(lambda: dist.reduce_scatter(out, inputs, async_op=True)), out


def fut_all_reduce_coalesced(rank: int, world: int) -> Any:
    """``dist.all_reduce_coalesced(async_op=True)`` returns the Work's future (``torch.Future`` on gloo)."""
    gen = torch.Generator().manual_seed(7 + rank)
    tensors = [_rounding_values(gen, 5), _rounding_values(gen, 3)]
    return dist.all_reduce_coalesced(tensors, async_op=True), tensors


def fut_all_reduce(rank: int, world: int) -> Any:
    gen = torch.Generator().manual_seed(3 + rank)
    t = _rounding_values(gen, 4)
    return _future_of(lambda: dist.all_reduce(t, async_op=True))


def fut_broadcast(rank: int, world: int) -> Any:
    return _future_of(lambda: dist.broadcast(torch.full((2,), 1.0 + rank), world - 1, async_op=True))


def fut_all_gather(rank: int, world: int) -> Any:
    outs = [torch.zeros(2) for _ in range(world)]
    return _future_of(lambda: dist.all_gather(outs, torch.full((2,), 1.0 + rank), async_op=True))


def fut_reduce(rank: int, world: int) -> Any:
    return _future_of(lambda: dist.reduce(torch.full((2,), 1.0 + rank), 0, async_op=True))


def fut_barrier(rank: int, world: int) -> Any:
    return _future_of(lambda: dist.barrier(async_op=True))


def fut_all_to_all_single(rank: int, world: int) -> Any:
    out = torch.zeros(world)
    return _future_of(lambda: dist.all_to_all_single(out, torch.arange(float(world)) + 10 * rank, async_op=True))


def fut_all_to_all(rank: int, world: int) -> Any:
    outs = [torch.zeros(1) for _ in range(world)]
    ins = [torch.ones(1) * (10 * rank + i) for i in range(world)]
    return _future_of(lambda: dist.all_to_all(outs, ins, async_op=True))


def fut_gather(rank: int, world: int) -> Any:
    outs = [torch.zeros(1) for _ in range(world)] if rank == 0 else None
    return _future_of(lambda: dist.gather(torch.ones(1) * rank, outs, 0, async_op=True))


def fut_scatter(rank: int, world: int) -> Any:
    ins = [torch.ones(1) * i for i in range(world)] if rank == 0 else None
    return _future_of(lambda: dist.scatter(torch.zeros(1), ins, 0, async_op=True))


def recv_any(rank: int, world: int) -> Any:
    """Rank 0 receives one message from every other rank without naming the source: the set it got."""
    if rank == 0:
        got = []
        for _ in range(world - 1):
            t = torch.zeros(2)
            src = dist.recv(t)
            got.append((src, encode(t)))
        return tuple(sorted(got))
    dist.send(torch.tensor([float(rank), 0.1 * rank]), 0)
    return None


def irecv_any_source_rank(rank: int, world: int) -> Any:
    """``irecv`` without a source, one sender (the last rank), tag 5: the Work's source rank."""
    if rank == 0:
        t = torch.zeros(2)
        work = dist.irecv(t, tag=5)
        assert work is not None
        work.wait()
        return work._source_rank(), t
    if rank == world - 1:
        dist.send(torch.tensor([float(rank), 7.0]), 0, tag=5)
    return None


def _sparse(gen: torch.Generator, size: tuple[int, ...], nnz: int, dtype: torch.dtype) -> torch.Tensor:
    """An uncoalesced sparse tensor: ``nnz`` entries at drawn (often repeated) places, rounding-prone values."""
    indices = torch.stack([torch.randint(0, s, (nnz,), generator=gen) for s in size])
    return torch.sparse_coo_tensor(indices, _rounding_values(gen, nnz, dtype), size, check_invariants=True)


def sparse_sum(rank: int, world: int) -> Any:
    gen = torch.Generator().manual_seed(20 + rank)
    s = _sparse(gen, (7,), 40, torch.float32)  # every place summed from several entries of every rank
    dist.all_reduce(s)
    return s


def sparse_sum_2d_bf16(rank: int, world: int) -> Any:
    gen = torch.Generator().manual_seed(40 + rank)
    s = _sparse(gen, (3, 4), 8, torch.bfloat16)
    dist.all_reduce(s)
    return s


def sparse_hybrid(rank: int, world: int) -> Any:
    """One sparse dim, one dense dim."""
    gen = torch.Generator().manual_seed(60 + rank)
    indices = torch.randint(0, 4, (1, 5), generator=gen)
    s = torch.sparse_coo_tensor(indices, _rounding_values(gen, 10).reshape(5, 2), (4, 2), check_invariants=True)
    dist.all_reduce(s)
    return s


def sparse_int64_and_empty(rank: int, world: int) -> Any:
    a = torch.sparse_coo_tensor(torch.tensor([[0, 2, 0]]), torch.tensor([1 + rank, 3, 5]), (4,), check_invariants=True)
    empty = torch.sparse_coo_tensor(torch.zeros(1, 0, dtype=torch.long), torch.zeros(0), (3,), check_invariants=True)
    dist.all_reduce(a)
    dist.all_reduce(empty)
    return a, empty


def sparse_async(rank: int, world: int) -> Any:
    s = torch.sparse_coo_tensor(torch.tensor([[1]]), torch.tensor([1.0 + rank]), (3,), check_invariants=True)
    work = dist.all_reduce(s, async_op=True)
    work.wait()
    return s, work.get_future()


def sparse_max(rank: int, world: int) -> Any:
    s = torch.sparse_coo_tensor(torch.tensor([[0]]), torch.tensor([1.0 + rank]), (3,), check_invariants=True)
    dist.all_reduce(s, op=dist.ReduceOp.MAX)
    return s


def sparse_all_reduce_coalesced(rank: int, world: int) -> Any:
    s = torch.sparse_coo_tensor(torch.tensor([[0]]), torch.tensor([1.0 + rank]), (3,), check_invariants=True)
    dist.all_reduce_coalesced([s])
    return s


def group_monitored_barrier(rank: int, world: int) -> Any:
    group: Any = dist.group.WORLD  # torch's stub omits the binding's monitored_barrier
    return group.monitored_barrier(), group.monitored_barrier(datetime.timedelta(seconds=30), True)


def recv_larger_buffer(rank: int, world: int) -> Any:
    """Rank 0 sends 2 floats; rank 1 receives into 4 floats, then into int32s, then into another shape."""
    if rank == 0:
        dist.send(torch.tensor([1.5, -2.25]), 1)
        dist.send(torch.tensor([1.5, -2.25]), 1)
        dist.send(torch.arange(6.0).reshape(2, 3), 1)
    elif rank == 1:
        bigger = torch.full((4,), -1.0)
        other_dtype = torch.full((3,), -1, dtype=torch.int32)
        other_shape = torch.zeros(3, 2)
        dist.recv(bigger, 0)
        dist.recv(other_dtype, 0)
        dist.recv(other_shape, 0)
        return bigger, other_dtype, other_shape
    return None


def self_isend(rank: int, world: int) -> Any:
    work = dist.isend(torch.ones(2), rank)
    return work.wait() if work is not None else None


def self_irecv(rank: int, world: int) -> Any:
    work = dist.irecv(torch.ones(2), rank)
    return work.wait() if work is not None else None


def self_group_send(rank: int, world: int) -> Any:
    group = dist.group.WORLD
    assert group is not None
    return group.send([torch.ones(2)], rank, 0).wait()


def self_send(rank: int, world: int) -> Any:
    dist.send(torch.ones(2), rank)


def a2a_split_count(rank: int, world: int) -> Any:
    dist.all_to_all_single(torch.zeros(world), torch.arange(float(world)), [1] * (world + 1), [1] * world)


def a2a_split_sum(rank: int, world: int) -> Any:
    dist.all_to_all_single(torch.zeros(world), torch.arange(float(world)), [1] * world, [2] + [1] * (world - 1))


def a2a_negative_split(rank: int, world: int) -> Any:
    dist.all_to_all_single(torch.zeros(world), torch.arange(float(world)), [1] * world, [-1, 2] + [1] * (world - 2))


def a2a_indivisible(rank: int, world: int) -> Any:
    """P + 1 fp32 rows: gloo cuts the bytes (at P = 2, 6-byte pieces: half floats), or refuses when they do not
    divide (P = 3)."""
    out = torch.full((world + 1,), -1.0)
    dist.all_to_all_single(out, torch.arange(float(world + 1)) + 10 * rank)
    return out


def a2a_rows_split(rank: int, world: int) -> Any:
    """A (3, 2) input: at P = 2 gloo sends one and a half rows to each rank."""
    out = torch.full((3, 2), -1.0)
    dist.all_to_all_single(out, torch.arange(6.0).reshape(3, 2) + 10 * rank)
    return out


def a2a_bytes_differ(rank: int, world: int) -> Any:
    out = torch.full((world, 2), -1.0)
    dist.all_to_all_single(out, torch.arange(2.0 * world + 2).reshape(world + 1, 2))
    return out


CORNERS: dict[str, Callable[[int, int], Any]] = {
    f.__name__: f
    for f in (
        agc_layout,
        agc_mixed_shapes,
        agc_one_input,
        agc_transposed_layout,
        agc_too_many_lists,
        agc_broadcastable_shape,
        agc_short_list,
        agc_shape_mismatch,
        agc_reshape,
        agc_async,
        fut_all_gather_into_tensor,
        fut_reduce_scatter_tensor,
        fut_reduce_scatter,
        fut_all_reduce_coalesced,
        fut_all_reduce,
        fut_broadcast,
        fut_all_gather,
        fut_reduce,
        fut_barrier,
        fut_all_to_all_single,
        fut_all_to_all,
        fut_gather,
        fut_scatter,
        recv_any,
        irecv_any_source_rank,
        sparse_sum,
        sparse_sum_2d_bf16,
        sparse_hybrid,
        sparse_int64_and_empty,
        sparse_async,
        sparse_max,
        sparse_all_reduce_coalesced,
        group_monitored_barrier,
        recv_larger_buffer,
        self_isend,
        self_irecv,
        self_group_send,
        self_send,
        a2a_split_count,
        a2a_split_sum,
        a2a_negative_split,
        a2a_indivisible,
        a2a_rows_split,
        a2a_bytes_differ,
    )
}
"""Every corner by name, in the order `corner_outcomes` runs them."""


def corner_outcomes(rank: int, names: tuple[str, ...] | None = None) -> dict[str, Outcome]:
    """Run the corners ``names`` (default: all of `CORNERS`) on this rank; each one's outcome by name."""
    world = dist.get_world_size()
    found: dict[str, Outcome] = {}
    for name in names or tuple(CORNERS):
        try:
            found[name] = ("ok", encode(CORNERS[name](rank, world)))
        except Exception as exc:
            found[name] = ("error", type(exc).__name__)
    # a last collective before the ranks part; not a barrier: gloo's barrier re-raises the errors of earlier
    # collectives whose work failed (the all_to_all enforces), on some ranks, by a race (seen at P = 5)
    dist.all_reduce(torch.zeros(1))
    return found


def short_scatter_object_list(rank: int) -> tuple[str, bool]:
    """The root (rank 0) passes one object for P ranks: ``(its error's type name, whether it is a RuntimeError)``;
    on gloo the root raises at the call and the others wait until the group's 2 s timeout."""
    group = dist.new_group(timeout=datetime.timedelta(seconds=2))
    got: list[Any] = [None]
    try:
        dist.scatter_object_list(got, ["only one"] if rank == 0 else None, 0, group=group)
    except Exception as exc:
        return type(exc).__name__, isinstance(exc, RuntimeError)
    return "no error", False
