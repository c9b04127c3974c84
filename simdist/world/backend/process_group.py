"""The ``simdist`` backend of ``torch.distributed``: unmodified code, collectives computed by reductions.

`SimProcessGroup` is a ``torch.distributed.ProcessGroup`` written in Python.
``torch.distributed`` (``dist.all_reduce``, ``new_group``, DeviceMesh),
the functional collectives (``_functional_collectives``, the ``_c10d_functional``
ops that DTensor uses) and FSDP2 all reach it through c10d's ordinary group
machinery; the backend is registered under the name ``simdist`` by
`register` (done on import of ``simdist.world``).

Every collective is written once, in `simdist.world.collectives.reductions` and
`simdist.world.collectives.data_movement` (shared with `simdist.world.simworld.SimComm`):
one `simdist.world.rendezvous.calls.Call` per member
plus a ``complete(calls, targets)`` function that computes the result from all
members' calls (in group-rank order) and writes the outputs of the members in
``targets``. This module maps c10d's methods and options onto those functions;
a *transport* brings the calls together:

* in-process (`simdist.world.threads.spawn.spawn_threads`): one thread per rank, the
  `simdist.world.rendezvous.meeting.Rendezvous`; the last member to arrive runs
  ``complete`` for every member;
* process mode (`simdist.world.processes.transport`): real processes; each rank gathers
  the members' calls over an inner gloo group and runs ``complete`` for itself.

Both run the same ``complete`` on the same inputs, so both give the same bits.
What gloo's dispatch does around the reduction, found by experiment against real
gloo (torch 2.13, 4 processes), applies where the group's reduction has
``gloo_rules`` (`simdist.world.collectives.gloo_rules` and the collectives say which checks):

* ``all_reduce_coalesced`` (and the functional ``all_reduce_coalesced``) is
  ONE all-reduce of the concatenation of the flat tensors;
* the functional ``reduce_scatter_tensor`` (gloo's
  ``reduce_scatter_tensor_coalesced``) equals ``reduce_scatter_tensor`` per
  tensor;
* ``PREMUL_SUM`` raises ``RuntimeError`` on gloo; ``BAND``/``BOR``/``BXOR``
  on a floating tensor raise ``RuntimeError`` (at the call, on every rank).

Every collective tells the observers (`simdist.world.rendezvous.observers.observed`: the
audit, blame) before the transport runs it, in `SimProcessGroup._go` (most
through `_run`; ``allreduce``'s one-tensor path tests for observers itself).
"""

from __future__ import annotations

import sys
from typing import Protocol

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import GroupName

from simdist.reduce import Reduction
from simdist.world.collectives import data_movement as dm
from simdist.world.collectives import reduce_ops as ops
from simdist.world.collectives import reductions as red
from simdist.world.rendezvous.calls import Call, Complete, Prepared
from simdist.world.rendezvous.observers import Observers, observed

BACKEND_NAME = "simdist"


class Transport(Protocol):
    """How the members' calls of one group meet (threads of one process, or real processes)."""

    def collective(self, pg: SimProcessGroup, call: Call, complete: Complete) -> None: ...

    def send(self, pg: SimProcessGroup, call: Call, tensor: torch.Tensor, dst: int, tag: int) -> dist.Work: ...

    def recv(self, pg: SimProcessGroup, call: Call, tensor: torch.Tensor, src: int, tag: int) -> dist.Work: ...

    def recv_any(self, pg: SimProcessGroup, call: Call, tensor: torch.Tensor, tag: int) -> dist.Work: ...


_WORK_INIT = dist.Work.__init__


GETFUTURE_NOT_IMPLEMENTED = "Work::getFuture not implemented."
"""What gloo's Work raises from ``get_future()`` for the reduce_scatters (found by experiment, torch 2.13)."""


class DoneWork(dist.Work):
    """A finished collective's ``Work``: ``wait()`` returns at once; the future holds what gloo's holds.

    ``result`` is the future's value (each collective's, as real gloo fills it: `SimProcessGroup`'s methods
    say which); ``no_future`` makes ``get_future()`` raise gloo's ``RuntimeError`` instead."""

    __slots__ = ("_no_future", "_result")  # one is made per collective: no instance dict

    def __init__(self, result: list | None = None, no_future: bool = False) -> None:
        _WORK_INIT(self)
        self._result = result or []
        self._no_future = no_future

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def exception(self):
        return None

    def result(self) -> list:
        return self._result

    def get_future(self) -> torch.futures.Future:
        if self._no_future:
            raise RuntimeError(GETFUTURE_NOT_IMPLEMENTED)
        future: torch._C.Future = torch._C.Future([])  # gloo's type ("torch.Future"), not the Python subclass
        future.set_result(self.result())
        return future  # type: ignore[return-value]


class PiecesWork(DoneWork):
    """all_gather_into_tensor's Work on gloo: its result and future hold the output's group-size pieces along
    dim 0 (views of it), cut only when asked (the collective itself does not pay for them)."""

    __slots__ = ("_pieces",)

    def __init__(self, output: torch.Tensor, pieces: int) -> None:
        super().__init__([output])
        self._pieces = pieces

    def result(self) -> list:
        return list(self._result[0].chunk(self._pieces))


def _untracked(tree):
    """A call's tensors as ``.data`` aliases: written as gloo writes from C++ (no autograd record, no version bump).

    So ``dist.broadcast(param, 0)`` on an ``nn.Parameter`` works, and a tensor
    saved for backward can be overwritten as on gloo (found by experiment).
    """
    if isinstance(tree, torch.Tensor):
        return tree.data
    if not tree:  # most collectives have no separate outputs
        return tree
    # one list comprehension, tensors inline: this runs on every collective
    return type(tree)([item.data if isinstance(item, torch.Tensor) else _untracked(item) for item in tree])


class SimProcessGroup(dist.ProcessGroup):
    """One rank's handle on one simulated group; collectives go through a `Transport` to the group's reduction.

    ``ranks`` are the group's global ranks in group-rank order (torch sorts
    them); ``label`` names the group in error messages.
    """

    def __init__(
        self,
        rank: int,
        size: int,
        ranks: tuple[int, ...],
        name: str,
        label: str,
        reduction: Reduction,
        transport: Transport,
    ) -> None:
        # torch's stub lists only (store, rank, size); the binding also takes (rank, size), as the backend API uses
        super().__init__(rank, size)  # type: ignore[call-arg]
        self._group_rank = rank
        self._group_size = size
        self.ranks = ranks
        self._name = name
        self.label = label
        self.reduction = reduction
        self.transport = transport
        self.global_rank = ranks[rank]
        self.gloo_rules = reduction.gloo_rules  # refuse what torch's gloo backend refuses (shape rules, PREMUL_SUM)
        self.checked: dict = {}  # reductions.all_reduce_one's checks, per (op, shape, dtype)
        self._done = DoneWork()  # the Work of c10d's synchronous all_reduce (see `allreduce`)

    # -- identity ---------------------------------------------------------------

    def size(self) -> int:
        return self._group_size

    def rank(self) -> int:
        return self._group_rank

    def getBackendName(self) -> str:
        return BACKEND_NAME

    @property
    def group_name(self) -> GroupName:
        return GroupName(self._name)

    @property
    def pg_name(self) -> str:
        return self._name

    def __repr__(self) -> str:
        rank = f"rank {self._group_rank} of {self._group_size}"
        return f"SimProcessGroup({self.label}, {rank}, reduction={self.reduction.name})"

    # -- plumbing ---------------------------------------------------------------

    def _call(self, op: str, details: tuple, inputs=(), outputs=(), extra=None) -> Call:
        frame = sys._getframe(2)
        return Call(self.global_rank, (op, self.label, *details), frame, inputs, outputs, extra)

    def _run(self, prepared: Prepared, result: list | DoneWork, no_future: bool = False) -> DoneWork:
        """The one funnel of every collective: the observers (`simdist.world.rendezvous.observers`) are told, then the
        transport runs it.

        ``result`` is what the Work's future holds (as on gloo), or the Work itself; ``no_future``: its
        ``get_future`` raises."""
        call, complete = prepared
        call.inputs = _untracked(call.inputs)
        if call.outputs:
            call.outputs = _untracked(call.outputs)
        self._go(call, complete)
        return result if isinstance(result, DoneWork) else DoneWork(result, no_future)

    def _go(self, call: Call, complete: Complete) -> None:
        """`_run` after the call's tensors are untracked (`allreduce` passes ``.data`` aliases itself)."""
        if Observers.subscribed:
            observed(call, complete, "dist", self._observed_group, lambda c: self.transport.collective(self, call, c))
        else:
            self.transport.collective(self, call, complete)

    def _finished(self, opts, result: list[torch.Tensor]) -> DoneWork:
        """The Work of a finished collective: c10d's synchronous calls (``opts.asyncOp`` False: every c10d
        function without ``async_op=True``; options made elsewhere default to True) wait on it and drop it, so one
        Work per group serves them all (a new one costs a C++ object per rank and collective); any other call
        gets its own."""
        if opts is not None and not opts.asyncOp:
            done = self._done
            done._result = result
            return done
        return DoneWork(result)

    def _observed_group(self) -> str:
        return f"{self.label}, backend simdist"

    # -- reductions (each collective's checks and completion: simdist.world.collectives.reductions)
    # -------------------------

    def allreduce(self, tensors, opts=None):
        op = ops.resolve_op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        if len(tensors) == 1 and not (tensor := tensors[0]).is_sparse:
            # dist.all_reduce, the hot path: checks cached per (op, shape, dtype). A tensor that requires grad is
            # untracked here (a `.data` alias, so the native kernel applies); any other is passed itself: the
            # completion writes it through the kernel (a C write: no version bump) or through a `.data` alias
            # it makes, so a `.data` alias per rank call (the dearest step left of this path) is not made
            if Observers.subscribed:
                call, complete = red.all_reduce_one(self, self.global_rank, sys._getframe(1), tensor.data, op)
                self._go(call, complete)
            else:
                mine = tensor.data if tensor.requires_grad else tensor
                call, complete = red.all_reduce_one(self, self.global_rank, sys._getframe(1), mine, op)
                self.transport.collective(self, call, complete)
            return self._finished(opts, tensors)
        if tensors and tensors[0].is_sparse:
            return self._sparse_allreduce(tensors, op)
        return self._run(red.all_reduce(self, self.global_rank, sys._getframe(1), tensors, op), tensors)

    def _sparse_allreduce(self, tensors, op: ops.Op) -> DoneWork:
        """A sparse all_reduce as gloo does it (`simdist.world.collectives.reductions.all_reduce_sparse`): the result is
        written into the caller's sparse tensor itself (not a ``.data`` alias: a sparse tensor's indices and
        values are replaced, which an alias would not pass on)."""
        (tensor,) = tensors
        call, complete = red.all_reduce_sparse(self, self.global_rank, sys._getframe(2), tensor, op)
        self._go(call, complete)
        return DoneWork([tensor])

    def allreduce_coalesced(self, tensors, opts=None):
        if any(t.is_sparse for t in tensors):  # on gloo c10d's dispatcher refuses before the backend
            raise NotImplementedError(
                "Could not run 'c10d::allreduce_coalesced_' with arguments from the 'SparseCPU' backend "
                "(torch raises this on gloo too: all_reduce_coalesced has no sparse kernel; all_reduce each tensor)"
            )
        op = ops.resolve_op((opts or dist.AllreduceCoalescedOptions()).reduceOp)
        return self._run(red.all_reduce_coalesced(self, self.global_rank, sys._getframe(1), tensors, op), tensors)

    def reduce(self, tensors, opts=None):
        opts = opts or dist.ReduceOptions()
        op = ops.resolve_op(opts.reduceOp)
        prepared = red.reduce(self, self.global_rank, sys._getframe(1), tensors, op, opts.rootRank)
        return self._run(prepared, list(tensors))

    def reduce_scatter_single(self, output, input, opts=None):
        return self._reduce_scatter_tensors([output], [input], opts, "reduce_scatter_tensor")

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        return self._reduce_scatter_tensors(list(outputs), list(inputs), opts, "reduce_scatter_tensor_coalesced")

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    def _reduce_scatter_tensors(self, outputs, inputs, opts, name):
        op = ops.resolve_op((opts or dist.ReduceScatterOptions()).reduceOp)
        prepared = red.reduce_scatter_tensors(self, self.global_rank, sys._getframe(2), outputs, inputs, op, name)
        return self._run(prepared, list(outputs), no_future=self.gloo_rules)  # gloo: getFuture not implemented

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        op = ops.resolve_op((opts or dist.ReduceScatterOptions()).reduceOp)
        prepared = red.reduce_scatter_list(self, self.global_rank, sys._getframe(1), output_tensors, input_tensors, op)
        return self._run(prepared, list(output_tensors), no_future=self.gloo_rules)

    # -- data movement ------------------------------------------------------------

    def broadcast(self, tensors, opts=None):
        root = (opts or dist.BroadcastOptions()).rootRank
        return self._run(dm.broadcast(self, self.global_rank, sys._getframe(1), tensors, root), list(tensors))

    def allgather(self, output_tensors, input_tensors, opts=None):
        prepared = dm.all_gather(self, self.global_rank, sys._getframe(1), output_tensors, input_tensors)
        return self._run(prepared, [t for o in output_tensors for t in o])

    def allgather_coalesced(self, output_lists, input_list, opts=None):
        """gloo's layout: ``output_lists[j][k]`` gets group rank ``j``'s ``input_list[k]``; the future holds
        the lists."""
        prepared = dm.all_gather_coalesced(self, self.global_rank, sys._getframe(1), output_lists, input_list)
        return self._run(prepared, [list(outs) for outs in output_lists])

    def all_gather_single(self, output, input, opts=None):
        return self._all_gather_tensors([output], [input], "all_gather_into_tensor")

    _allgather_base = all_gather_single

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        return self._all_gather_tensors(list(outputs), list(inputs), "all_gather_into_tensor_coalesced")

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def _all_gather_tensors(self, outputs, inputs, name):
        prepared = dm.all_gather_tensors(self, self.global_rank, sys._getframe(2), outputs, inputs, name)
        if name == "all_gather_into_tensor" and self.gloo_rules and outputs[0].dim():
            # gloo's future holds the output's group-size pieces along dim 0 (views), not the output
            return self._run(prepared, PiecesWork(outputs[0], self._group_size))
        return self._run(prepared, list(outputs))

    def gather(self, output_tensors, input_tensors, opts=None):
        root = (opts or dist.GatherOptions()).rootRank
        prepared = dm.gather(self, self.global_rank, sys._getframe(1), output_tensors, input_tensors, root)
        return self._run(prepared, [t for o in output_tensors for t in o])

    def scatter(self, output_tensors, input_tensors, opts=None):
        root = (opts or dist.ScatterOptions()).rootRank
        prepared = dm.scatter(self, self.global_rank, sys._getframe(1), output_tensors, input_tensors, root)
        return self._run(prepared, list(output_tensors))

    def alltoall(self, output_tensors, input_tensors, opts=None):
        prepared = dm.all_to_all(self, self.global_rank, sys._getframe(1), output_tensors, input_tensors)
        return self._run(prepared, list(output_tensors))

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        frame = sys._getframe(1)
        prepared = dm.all_to_all_single(
            self, self.global_rank, frame, output, input, output_split_sizes, input_split_sizes
        )
        return self._run(prepared, [output])

    alltoall_base = all_to_all_single

    def barrier(self, opts=None):
        call, complete = dm.barrier(self, self.global_rank, sys._getframe(1))
        self._go(call, complete)
        return self._finished(opts, [])

    def monitored_barrier(self, timeout=None, wait_all_ranks: bool = False) -> None:
        """``group.monitored_barrier()`` called on the group object, as gloo's groups answer it (a barrier of
        the members; in process mode gloo's own on the inner group, which names the ranks that did not arrive).
        Refused, as c10d refuses it, where the group's reduction is not gloo's."""
        if not self.gloo_rules:
            raise RuntimeError(
                f"monitored_barrier on {self.label}: only gloo implements it, and this group's reduction is "
                f"{self.reduction.name}"
            )
        inner = getattr(self.transport, "inner", None)
        if inner is None:  # rank threads: the rendezvous names the ranks that do not arrive
            call, complete = dm.barrier(self, self.global_rank, sys._getframe(1))
            self._go(call, complete)
            return None
        if timeout is None:
            return inner.monitored_barrier(wait_all_ranks=wait_all_ranks)
        return inner.monitored_barrier(timeout, wait_all_ranks=wait_all_ranks)

    # -- point to point -------------------------------------------------------------

    def _refuse_self(self, peer: int, what: str) -> None:
        """gloo has no connection from a rank to itself: ``isend``/``irecv`` (and the group's own
        ``send``/``recv``) with its own rank raise this ``RuntimeError`` (``dist.send``/``dist.recv`` refuse it
        earlier with ``ValueError``)."""
        if peer == self._group_rank:
            raise RuntimeError(
                f"{what} on {self.label}: rank {self.global_rank} to itself; gloo raises this (Pair is not "
                "connected): a rank has no connection to itself"
            )

    def send(self, tensors, dst_rank, tag=0):
        (tensor,) = tensors
        self._refuse_self(dst_rank, "send")
        if self.gloo_rules and not tensor.is_contiguous():
            raise RuntimeError(
                f"send on {self.label}: input tensor has to be contiguous (as on gloo, which raises this)"
            )
        call = self._call("send", (f"dst={self.ranks[dst_rank]}", f"tag={tag}", tensor.shape, tensor.dtype))
        return self.transport.send(self, call, tensor, dst_rank, tag)

    def recv(self, tensors, src_rank, tag=0):
        (tensor,) = tensors
        self._refuse_self(src_rank, "recv")
        if self.gloo_rules and not tensor.is_contiguous():
            raise RuntimeError(f"recv on {self.label}: the receive buffer must be contiguous (as on gloo)")
        call = self._call("recv", (f"src={self.ranks[src_rank]}", f"tag={tag}", tensor.shape, tensor.dtype))
        return self.transport.recv(self, call, tensor, src_rank, tag)

    def recv_anysource(self, tensors, tag=0):
        """``dist.recv(t)``/``irecv(t)`` without ``src``: a message from any other member. In process mode
        gloo's own (the first to arrive); in threads the earliest sent in simdist's schedule
        (`simdist.world.rendezvous.meeting.Rendezvous.post_recv_any`: deterministic)."""
        (tensor,) = tensors
        if self.gloo_rules and not tensor.is_contiguous():
            raise RuntimeError(f"recv on {self.label}: the receive buffer must be contiguous (as on gloo)")
        call = self._call("recv", ("src=any", f"tag={tag}", tensor.shape, tensor.dtype))
        return self.transport.recv_any(self, call, tensor, tag)
