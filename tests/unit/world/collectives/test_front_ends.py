"""One collective front end: SimComm's reduce and list reduce_scatter, and the observer list of both front ends.

Each collective is written once (`simdist.world.collectives.reductions`, `simdist.world.collectives.data_movement`) and
used by `SimComm`
and the ``simdist`` torch.distributed backend. The references here share no code with it: a rank-order fold
written out with plain ``+`` (what `Sequential` promises), and for gloo's order the backend's own result on
`simdist.run` (the two front ends must agree bit for bit).
"""

import torch
import torch.distributed as dist

import simdist
from simdist.numerics.compare import same_bits
from simdist.reduce import ReduceOp, Sequential
from simdist.reduce.gloo import Gloo
from simdist.world.rendezvous.observers import Observers
from simdist.world.simworld import SimWorld
from simdist.world.spec import ParallelSpec

SPEC = ParallelSpec(4, tp=2, ep=1)  # tp groups {0,1} {2,3}; dp groups {0,2} {1,3}


def _inputs(rank: int, count: int, numel: int) -> list[torch.Tensor]:
    """``count`` bf16 tensors per rank with magnitudes spread over 2^-12..2^12 (so the order of the adds shows)."""
    g = torch.Generator().manual_seed(7919 * rank + 13)
    out = []
    for _ in range(count):
        scale = 2.0 ** torch.randint(-12, 12, (numel,), generator=g)
        out.append((torch.randn(numel, generator=g) * scale).to(torch.bfloat16))
    return out


def _fold(values: list[torch.Tensor]) -> torch.Tensor:
    """((x0 + x1) + x2) + ..., each partial rounded to the dtype: what a rank-order fold must give."""
    acc = values[0].clone()
    for v in values[1:]:
        acc = acc + v
    return acc


# -- SimComm.reduce ---------------------------------------------------------------------------------------------


def _comm_reduce(comm, kind: str, dst_index: int, op):
    group = comm.group(kind)
    (x,) = _inputs(comm.get_rank(), 1, 40)
    before = x.clone()
    comm.reduce(x, dst=group.ranks[dst_index], op=op, group=group)
    return before, x


def test_simcomm_reduce_gives_the_root_the_rank_order_fold_and_leaves_the_others_alone():
    for kind, dst_index in (("dp", 1), ("tp", 0), ("world", 2)):
        for op in (ReduceOp.SUM, ReduceOp.AVG):
            results = SimWorld(SPEC, reduction=Sequential()).run(_comm_reduce, kind, dst_index, op)
            groups = [tuple(range(4))] if kind == "world" else SPEC.groups(kind)
            for ranks in groups:
                expected = _fold([results[r][0] for r in ranks])
                if op is ReduceOp.AVG:
                    expected = expected / len(ranks)
                root = ranks[dst_index]
                assert same_bits(results[root][1], expected), (kind, op, root)
                for r in ranks:
                    if r != root:
                        assert same_bits(results[r][1], results[r][0]), (kind, op, r)


def _dist_reduce(rank: int, dst: int):
    (x,) = _inputs(rank, 1, 40)
    dist.reduce(x, dst=dst)
    return x


def _world_reduce(comm, dst: int):
    (x,) = _inputs(comm.get_rank(), 1, 40)
    comm.reduce(x, dst=dst)
    return x


def test_simcomm_reduce_on_gloo_equals_the_backends_dist_reduce_on_every_rank():
    # every member's tensor afterwards (gloo leaves partial sums on the non-roots), bit for bit
    for dst in (0, 3):
        comm = SimWorld(SPEC, reduction=Gloo()).run(_world_reduce, dst)
        backend = simdist.run(_dist_reduce, 4, args=(dst,), reduction="gloo")
        assert all(same_bits(a, b) for a, b in zip(comm, backend, strict=True))
        assert not same_bits(comm[(dst + 1) % 4], _inputs((dst + 1) % 4, 1, 40)[0])  # partial sums were written


# -- SimComm.reduce_scatter (list form) --------------------------------------------------------------------------


def _comm_reduce_scatter(comm, kind: str):
    group = comm.group(kind)
    entries = _inputs(comm.get_rank(), group.size, 24)
    out = torch.empty(24, dtype=torch.bfloat16)
    comm.reduce_scatter(out, entries, group=group)
    return entries, out


def test_simcomm_list_reduce_scatter_gives_group_rank_i_the_fold_of_every_members_entry_i():
    for kind in ("tp", "dp", "world"):
        results = SimWorld(SPEC, reduction=Sequential()).run(_comm_reduce_scatter, kind)
        groups = [tuple(range(4))] if kind == "world" else SPEC.groups(kind)
        for ranks in groups:
            for i, r in enumerate(ranks):
                expected = _fold([results[member][0][i] for member in ranks])
                assert same_bits(results[r][1], expected), (kind, r)


def _dist_reduce_scatter(rank: int):
    entries = _inputs(rank, 4, 24)
    out = torch.empty(24, dtype=torch.bfloat16)
    dist.reduce_scatter(out, entries)
    return out


def test_simcomm_list_reduce_scatter_on_gloo_equals_the_backends():
    comm = SimWorld(SPEC, reduction=Gloo()).run(_comm_reduce_scatter, "world")
    backend = simdist.run(_dist_reduce_scatter, 4, reduction="gloo")
    assert all(same_bits(c[1], b) for c, b in zip(comm, backend, strict=True))


# -- the observer list sees every collective of both front ends -----------------------------------------------------


def _every_comm_collective(comm):
    rank, tp = comm.get_rank(), comm.group("tp")
    x = torch.ones(4)
    comm.all_reduce(x, group=tp)
    comm.reduce(x, dst=tp.ranks[0], group=tp)
    comm.reduce_scatter_tensor(torch.empty(2), torch.ones(4), group=tp)
    comm.reduce_scatter(torch.empty(4), [torch.ones(4), torch.ones(4)], group=tp)
    comm.all_gather_into_tensor(torch.empty(8), x, group=tp)
    comm.all_to_all_single(torch.empty(4), torch.ones(4), group=tp)
    comm.broadcast(x, src=tp.ranks[1], group=tp)
    comm.barrier()
    return rank


COMM_OPS = [
    "all_reduce",
    "reduce",
    "reduce_scatter_tensor",
    "reduce_scatter",
    "all_gather_into_tensor",
    "all_to_all_single",
    "broadcast",
    "barrier",
]


def _every_dist_collective(rank: int):
    x = torch.ones(4)
    dist.all_reduce(x)
    dist.all_reduce_coalesced([x, torch.ones(2)])
    dist.reduce(x, dst=1)
    dist.reduce_scatter_tensor(torch.empty(1), torch.ones(4))
    dist.reduce_scatter(torch.empty(4), [torch.ones(4) for _ in range(4)])
    dist.broadcast(x, src=2)
    dist.all_gather([torch.empty(4) for _ in range(4)], x)
    dist.all_gather_into_tensor(torch.empty(16), x)
    dist.gather(x, [torch.empty(4) for _ in range(4)] if rank == 0 else None, dst=0)
    dist.scatter(torch.empty(4), [torch.ones(4) for _ in range(4)] if rank == 0 else None, src=0)
    dist.all_to_all([torch.empty(1) for _ in range(4)], [torch.ones(1) for _ in range(4)])
    dist.all_to_all_single(torch.empty(4), torch.ones(4))
    dist.barrier()
    return rank


DIST_OPS = [
    "all_reduce",
    "all_reduce_coalesced",
    "reduce",
    "reduce_scatter_tensor",
    "reduce_scatter",
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "gather",
    "scatter",
    "all_to_all",
    "all_to_all_single",
    "barrier",
]


def test_the_engines_observers_see_every_collective_of_both_front_ends():
    seen: list[tuple[str, int, str, str]] = []
    after: list[int] = []

    def observer(event):
        seen.append((event.front, event.call.rank, event.call.signature[0], event.group))
        return lambda: after.append(event.call.rank)

    Observers.subscribe(observer)
    try:
        SimWorld(SPEC, reduction=Gloo()).run(_every_comm_collective)
        comm_seen = list(seen)
        seen.clear()
        simdist.run(_every_dist_collective, 4, reduction="gloo")
        dist_seen = list(seen)
    finally:
        Observers.unsubscribe(observer)
    assert observer not in Observers.subscribed
    for rank in range(4):
        mine = [(front, op) for front, r, op, _ in comm_seen if r == rank]
        assert mine == [("comm", op) for op in COMM_OPS], rank
        groups = [group for _, r, _, group in comm_seen if r == rank]
        assert groups == ["tp"] * (len(COMM_OPS) - 1) + ["world"]
        mine = [(front, op) for front, r, op, _ in dist_seen if r == rank]
        assert [op for front, op in mine if front == "dist"] == DIST_OPS, rank
    assert len(after) == len(comm_seen) + len(dist_seen)  # every collective's "after" ran once it returned


def test_an_observer_may_wrap_the_completion():
    calls: list[str] = []

    def observer(event):
        complete = event.complete

        def wrapped(members, targets):
            calls.append(event.call.signature[0])
            complete(members, targets)

        event.complete = wrapped

    def fn(comm):
        x = torch.full((3,), float(comm.get_rank()))
        comm.all_reduce(x)
        return x

    Observers.subscribe(observer)
    try:
        results = SimWorld(SPEC, reduction=Sequential()).run(fn)
    finally:
        Observers.unsubscribe(observer)
    assert calls == ["all_reduce"]  # the completion runs once, on the last member to arrive
    assert all(torch.equal(r, torch.full((3,), 6.0)) for r in results)


# -- a Comm program's policy-order gather on a gloo group (gloo's rules now apply to SimComm too) -------------------


def _own_order(comm):
    from simdist.gradpath.path import CommOps
    from simdist.reduce import Ring

    (x,) = _inputs(comm.get_rank(), 1, 12)
    return x, CommOps(comm, 0).all_reduce(x.view(3, 4), "tp", reduction=Ring(chunk_size=1))


def test_a_policys_own_tp_order_runs_on_a_gloo_world():
    from simdist.reduce import Ring

    results = SimWorld(SPEC, reduction=Gloo()).run(_own_order)
    for ranks in SPEC.groups("tp"):
        expected = Ring(chunk_size=1).reduce([results[r][0].view(3, 4) for r in ranks])
        for r in ranks:
            assert same_bits(results[r][1], expected)


def test_resolve_op_names_every_c10d_op_however_given_and_keeps_each_premul_sums_factor():
    """`resolve_op`'s one-hash fast path: each op type, given as c10d's ``ReduceOp`` object or its ``RedOpType``,
    first and repeated calls alike, resolves to its own name; ``PREMUL_SUM`` is resolved afresh per call (its
    factor is the call's), even after other factors."""
    from torch.distributed.distributed_c10d import ReduceOp as C10dOp

    from simdist.world.collectives.reduce_ops import resolve_op

    names = ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR")
    for _ in range(2):
        for name in names:
            kind = getattr(C10dOp, name)  # a RedOpType
            for given in (kind, C10dOp(kind)):
                op = resolve_op(given)
                assert op.name == name and op.shown == f"op={name}", (name, given)
    for factor in (0.5, 2.0, 0.5):
        op = resolve_op(dist._make_nccl_premul_sum(factor))
        assert op.name == "PREMUL_SUM" and op.factor == factor and op.shown == f"op=PREMUL_SUM({factor})"
        assert resolve_op(C10dOp(C10dOp.SUM)).name == "SUM"
