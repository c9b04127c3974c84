"""SimWorld: the ranks of a job as threads of one process, with modelled collectives.

`SimWorld.run(fn, *args)` starts one thread per rank, calls ``fn(comm, *args)``
on each with a `SimComm`, and returns the per-rank results in rank order.

`SimComm` is a thin adapter: each of its collectives is the one written in
`simdist.world.collectives.reductions` or `simdist.world.collectives.data_movement` (a `Call` plus a
``complete`` function), handed to the `simdist.world.rendezvous.meeting.Rendezvous`, exactly as the
``torch.distributed`` backend (`simdist.world.backend.process_group`, `simdist.run`) does:
same checks (gloo's rules where the group's reduction has ``gloo_rules``), same
completion, same bits. `simdist.world.rendezvous.meeting` says how
calls are matched, how results stay independent of thread arrival order, and
how mismatches, deadlocks, exceptions and timeouts are reported (every rank's
call with its source line; no hangs).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import torch

from simdist.errors import UsageError
from simdist.reduce import ReduceOp, Reduction
from simdist.world.collectives import data_movement as dm
from simdist.world.collectives import reduce_ops as ops
from simdist.world.collectives import reductions as red
from simdist.world.groups import Group, group_for, world_group
from simdist.world.options import _UNSET, DEFAULT_TIMEOUT_S, ReductionChoice, check_timeout, read_reduction
from simdist.world.rendezvous.calls import Prepared
from simdist.world.rendezvous.meeting import Rendezvous
from simdist.world.rendezvous.observers import Observers, observed
from simdist.world.spec import GroupKind, ParallelSpec


class _Members:
    """SimComm's view of one `Group` for the collectives (a `simdist.world.rendezvous.calls.Members`), built once per
    group
    and communicator."""

    __slots__ = ("checked", "gloo_rules", "group", "key", "kind", "label", "ranks", "reduction", "size")

    def __init__(self, group: Group, reduction: Reduction, key: int) -> None:
        self.group = group
        self.kind = group.kind
        self.label = str(group)
        self.reduction = reduction
        self.gloo_rules = reduction.gloo_rules
        self.ranks = group.ranks
        self.size = len(group.ranks)
        self.key = key  # the call sequence on the rendezvous: `Rendezvous.intern` of the ranks
        self.checked: dict = {}  # reductions.all_reduce_one's checks, per (op, shape, dtype)


class SimComm:
    """One rank's communicator in a `SimWorld` run (implements `simdist.world.groups.Comm`).

    Each collective is `simdist.world.collectives.reductions`' or `simdist.world.collectives.data_movement`' (the
    backend's too), run on
    the rendezvous; this class only resolves groups and ranks.
    """

    def __init__(self, rendezvous: Rendezvous, world: SimWorld, rank: int) -> None:
        self._rendezvous = rendezvous
        self._world_obj = world
        self._rank = rank
        self.spec: ParallelSpec = world.spec
        self._world = world_group(self.spec)
        self._groups: dict[str, Group] = {}
        self._members: dict[Group | None, _Members] = {}

    # -- identity ------------------------------------------------------------

    def get_rank(self) -> int:
        return self._rank

    def get_world_size(self, group: Group | None = None) -> int:
        return self.spec.world_size if group is None else group.size

    def group(self, kind: GroupKind | str) -> Group:
        """The group of ``kind`` (``tp``, ``dp``, ``ep``, ``etp``, ``edp``, ``pp`` or ``world``) holding this rank."""
        found = self._groups.get(kind)
        if found is None:
            found = self._groups[kind] = group_for(self.spec, kind, self._rank)
        return found

    def _resolve(self, group: Group | None) -> _Members:
        """The members of ``group`` (``None``: the world), checked and cached per group."""
        found = self._members.get(group)
        if found is not None:
            return found
        resolved = self._world if group is None else group
        if self._rank not in resolved.ranks:
            raise UsageError(f"rank {self._rank} called a collective on {resolved}, which it is not a member of")
        if list(resolved.ranks) != sorted(resolved.ranks):  # torch sorts a group's ranks: group rank i = i-th smallest
            resolved = Group(resolved.kind, tuple(sorted(resolved.ranks)))
        reduction = self._world_obj.reduction_for(resolved.kind)
        found = self._members[group] = _Members(resolved, reduction, self._rendezvous.intern(resolved.ranks))
        return found

    def _run(self, members: _Members, prepared: Prepared) -> None:
        """The one funnel of every collective: the observers (`simdist.world.rendezvous.observers`) are told, then the
        rendezvous runs it."""
        call, complete = prepared
        rendezvous, ranks, key = self._rendezvous, members.ranks, members.key
        if Observers.subscribed:
            observed(call, complete, "comm", lambda: members.kind, lambda c: rendezvous.collective(call, ranks, c, key))
            return
        rendezvous.collective(call, ranks, complete, key)

    # -- collectives ---------------------------------------------------------

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, group: Group | None = None) -> None:
        """Reduce ``tensor`` across ``group`` in place with the group's reduction."""
        # the hot path of every training step: `_resolve` and `_run` inline (a Python call each, per rank and call)
        m = self._members.get(group) or self._resolve(group)
        call, complete = red.all_reduce_one(m, self._rank, sys._getframe(1), tensor, ops.named_op(op))
        if Observers.subscribed:
            self._run(m, (call, complete))
        else:
            self._rendezvous.collective(call, m.ranks, complete, m.key)

    def reduce_scatter_tensor(
        self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp = ReduceOp.SUM, group: Group | None = None
    ) -> None:
        """Reduce ``input`` across ``group``; group rank ``i`` receives block ``i`` of the flat result."""
        m = self._resolve(group)
        self._run(m, red.reduce_scatter_tensors(m, self._rank, sys._getframe(1), (output,), (input,), ops.named_op(op)))

    def reduce(self, tensor: torch.Tensor, dst: int, op: ReduceOp = ReduceOp.SUM, group: Group | None = None) -> None:
        """Reduce ``tensor`` across ``group`` to global rank ``dst``, in place: the root gets the reduction's result;
        with a reduction that says what the others hold (gloo's) every other member's tensor holds that afterwards
        (gloo's partial sums), as on the real backend."""
        m = self._resolve(group)
        root = m.group.rank_of(dst)
        self._run(m, red.reduce(m, self._rank, sys._getframe(1), (tensor,), ops.named_op(op), root))

    def reduce_scatter(
        self,
        output: torch.Tensor,
        input_list: list[torch.Tensor],
        op: ReduceOp = ReduceOp.SUM,
        group: Group | None = None,
    ) -> None:
        """List reduce_scatter: entry ``i`` of every member's ``input_list`` reduced into group rank ``i``'s
        ``output``."""
        m = self._resolve(group)
        prepared = red.reduce_scatter_list(m, self._rank, sys._getframe(1), (output,), (input_list,), ops.named_op(op))
        self._run(m, prepared)

    def all_gather_into_tensor(self, output: torch.Tensor, input: torch.Tensor, group: Group | None = None) -> None:
        """Concatenate every member's ``input`` (flat, in group-rank order) into ``output``."""
        m = self._resolve(group)
        self._run(m, dm.all_gather_tensors(m, self._rank, sys._getframe(1), (output,), (input,)))

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int] | None = None,
        input_split_sizes: list[int] | None = None,
        group: Group | None = None,
    ) -> None:
        """Exchange dim-0 slices: this rank's ``input`` slice ``j`` goes to group rank ``j``.

        Without split sizes dim 0 is cut evenly. Split sizes may be uneven; each
        member's input split for ``j`` must equal ``j``'s output split for it.
        """
        m = self._resolve(group)
        frame = sys._getframe(1)
        self._run(m, dm.all_to_all_single(m, self._rank, frame, output, input, output_split_sizes, input_split_sizes))

    def broadcast(self, tensor: torch.Tensor, src: int, group: Group | None = None) -> None:
        """Copy global rank ``src``'s ``tensor`` into every member's ``tensor``."""
        m = self._resolve(group)
        self._run(m, dm.broadcast(m, self._rank, sys._getframe(1), (tensor,), m.group.rank_of(src)))

    def barrier(self, group: Group | None = None) -> None:
        """Wait until every member of ``group`` has arrived."""
        m = self._resolve(group)
        self._run(m, dm.barrier(m, self._rank, sys._getframe(1)))


class SimWorld:
    """Runs a rank function on every rank of ``spec``, one thread per rank, in this process.

    ``reduction`` chooses the `Reduction` of each group's collectives, as every front end reads it
    (`simdist.world.options.read_reduction`): a reduction name, a `ReductionName` member or a reduction for every
    group, a mapping from group kind (``tp``, ``dp``, ``ep``, ``etp``, ``edp``, ``pp``, ``world``, ``group``) to one
    of those, kinds not named using its ``"default"`` entry (a callable ``(ranks) -> Reduction`` is for
    ``simdist.run(api="dist")``: a `SimWorld` chooses per kind). The default is
    `simdist.world.options.DEFAULT_REDUCTION` (gloo's order; it was a rank-order fold, `Sequential`, before
    every launcher shared one default: pass ``reduction="sequential"`` for that).

    ``one_cpu`` (default on) pins the rank threads to one CPU. Ranks run in
    lockstep at every collective, so each collective hands the interpreter
    from thread to thread; on one CPU a handoff is a plain context switch
    (about 6 us on the 2-vCPU CI machine) instead of a cross-CPU wake-up
    (about 30 us there). Turn it off for rank programs whose local compute is
    large enough to profit from intra-op threads on several CPUs.

    ``timeout_s`` bounds a whole run (`simdist.world.options.DEFAULT_TIMEOUT_S`; ``None``: no bound); a rank
    still busy then is reported with its current source line (collective deadlocks are detected without it).
    `SimWorld.run` is ``simdist.run(fn, spec, api="comm", where="threads")`` on this world's settings.
    """

    def __init__(
        self,
        spec: ParallelSpec,
        *,
        reduction: ReductionChoice = _UNSET,
        timeout_s: float | None = DEFAULT_TIMEOUT_S,
        one_cpu: bool = True,
        intra_op_threads: int | None = 1,
    ) -> None:
        self.spec = spec
        self.table = read_reduction(reduction, callable_ok=False)
        self.reductions, self.default_reduction = self.table.named, self.table.default
        self.timeout_s = check_timeout(timeout_s)
        self.one_cpu = one_cpu and hasattr(os, "sched_setaffinity")
        self.intra_op_threads = intra_op_threads

    def reduction_for(self, kind: GroupKind | str) -> Reduction:
        """The reduction used by groups of ``kind``."""
        return self.table.for_kind(kind)

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Call ``fn(comm, *args, **kwargs)`` on every rank; return the results in rank order."""
        rendezvous = Rendezvous(self.spec.world_size, label="SimWorld")
        return rendezvous.run(
            lambda rank: fn(SimComm(rendezvous, self, rank), *args, **kwargs),
            timeout_s=self.timeout_s,
            one_cpu=self.one_cpu,
            intra_op_threads=self.intra_op_threads,
        )
