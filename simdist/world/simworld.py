"""SimWorld: the ranks of a job as threads of one process, with modelled collectives.

`SimWorld.run(fn, *args)` starts one thread per rank, calls ``fn(comm, *args)``
on each with a `SimComm`, and returns the per-rank results in rank order.

`SimComm` is a thin adapter: each of its collectives is a `Call` plus a
``complete`` function handed to the rendezvous `simdist.world.engine.Engine`,
the same engine that serves the ``torch.distributed`` backend
(`simdist.world.backend`, `simdist.spawn`). The engine's docstring says how
calls are matched, how results stay independent of thread arrival order, and
how mismatches, deadlocks, exceptions and timeouts are reported (every rank's
call with its source line; no hangs).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping
from typing import Any

import torch

from simdist.reduce import Gloo, ReduceOp, ReductionModel
from simdist.world.backend import (
    Op,
    exchange_plan,
    exchange_rows,
    reduce_complete,
    reduce_scatter_list_complete,
    refuse_gloo_dtypes,
)
from simdist.world.engine import Call as _Call
from simdist.world.engine import Engine
from simdist.world.groups import Group, group_for, world_group
from simdist.world.modelmap import as_model
from simdist.world.options import _UNSET, DEFAULT_REDUCTION, DEFAULT_TIMEOUT_S, check_timeout, pick_reduction
from simdist.world.spec import GROUP_KINDS, GroupKind, ParallelSpec


class SimComm:
    """One rank's communicator in a `SimWorld` run (implements `simdist.world.groups.Comm`)."""

    def __init__(self, engine: Engine, world: SimWorld, rank: int) -> None:
        self._engine = engine
        self._world_obj = world
        self._rank = rank
        self.spec: ParallelSpec = world.spec
        self._world = world_group(self.spec)
        self._groups: dict[str, Group] = {}

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

    def _resolve(self, group: Group | None) -> Group:
        if group is None:
            return self._world
        if self._rank not in group.ranks:
            raise ValueError(f"rank {self._rank} called a collective on {group}, which it is not a member of")
        if list(group.ranks) != sorted(group.ranks):  # torch sorts a group's ranks: group rank i = i-th smallest
            group = Group(group.kind, tuple(sorted(group.ranks)))
        return group

    def _model(self, group: Group) -> ReductionModel:
        return self._world_obj.model_for(group.kind)

    def _collective(self, call: _Call, group: Group, complete: Callable[[list[_Call]], None]) -> None:
        self._engine.collective(call, group.ranks, complete)

    # -- collectives ---------------------------------------------------------

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, group: Group | None = None) -> None:
        """Reduce ``tensor`` across ``group`` in place with the group's reduction model."""
        group, op = self._resolve(group), ReduceOp.coerce(op)
        model = self._model(group)

        def complete(calls: list[_Call]) -> None:
            try:
                result = model.reduce([c.inputs[0] for c in calls], op)
            except RuntimeError as exc:  # gloo's integer AVG: the SUM is written, then div_ raises
                written = getattr(exc, "written", None)
                for c in calls if written is not None else ():
                    c.inputs[0].copy_(written)
                raise
            for c in calls:
                c.inputs[0].copy_(result)

        sig = ("all_reduce", group, op, tensor.shape, tensor.dtype, tensor.device)
        self._collective(_Call(self._rank, sig, sys._getframe(1), (tensor,)), group, complete)

    def reduce_scatter_tensor(
        self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp = ReduceOp.SUM, group: Group | None = None
    ) -> None:
        """Reduce ``input`` across ``group``; group rank ``i`` receives block ``i`` of the flat result."""
        group, op = self._resolve(group), ReduceOp.coerce(op)
        if input.numel() != output.numel() * group.size or input.dtype != output.dtype:
            raise ValueError(
                f"reduce_scatter_tensor on {group}: input has {input.numel()} {input.dtype} elements, "
                f"output {output.numel()} {output.dtype}; need input numel = {group.size} x output numel, same dtype"
            )
        model = self._model(group)

        def complete(calls: list[_Call]) -> None:
            blocks = model.reduce_scatter([c.inputs[0] for c in calls], op)  # as laid out: gloo reads memory
            for i, c in enumerate(calls):
                c.outputs[0].copy_(blocks[i].view(c.outputs[0].shape))

        sig = ("reduce_scatter_tensor", group, op, input.shape, input.dtype, input.device)
        self._collective(_Call(self._rank, sig, sys._getframe(1), (input,), (output,)), group, complete)

    def reduce(self, tensor: torch.Tensor, dst: int, op: ReduceOp = ReduceOp.SUM, group: Group | None = None) -> None:
        """Reduce ``tensor`` across ``group`` to global rank ``dst``, in place, as the ``torch.distributed`` backend
        does it (same ``complete``): the root gets the model's result; with a gloo model every other member's
        tensor holds gloo's partial sums afterwards, as on real gloo."""
        group, op = self._resolve(group), ReduceOp.coerce(op)
        model = self._model(group)
        if isinstance(model, Gloo):
            refuse_gloo_dtypes("reduce", str(group), [tensor])
        complete = reduce_complete(model, Op(op.name), group.rank_of(dst), 1)
        n = group.size
        sig = ("reduce", group, op, f"dst={dst}", tensor.shape, tensor.dtype, tensor.device)
        call = _Call(self._rank, sig, sys._getframe(1), (tensor,))
        self._collective(call, group, lambda calls: complete(calls, range(n)))

    def reduce_scatter(
        self,
        output: torch.Tensor,
        input_list: list[torch.Tensor],
        op: ReduceOp = ReduceOp.SUM,
        group: Group | None = None,
    ) -> None:
        """List reduce_scatter: entry ``i`` of every member's ``input_list`` reduced into group rank ``i``'s
        ``output``, as the ``torch.distributed`` backend does it (same ``complete``)."""
        group, op = self._resolve(group), ReduceOp.coerce(op)
        if len(input_list) != group.size:
            raise ValueError(f"reduce_scatter on {group}: need {group.size} input tensors, got {len(input_list)}")
        model = self._model(group)
        gloo_rules = isinstance(model, Gloo)
        if gloo_rules:
            refuse_gloo_dtypes("reduce_scatter", str(group), input_list)
        complete = reduce_scatter_list_complete(model, Op(op.name), 1, gloo_rules, str(group))
        n = group.size
        sig = ("reduce_scatter", group, op, output.shape, output.dtype, output.device)
        call = _Call(self._rank, sig, sys._getframe(1), (list(input_list),), (output,), (tuple(output.shape),))
        self._collective(call, group, lambda calls: complete(calls, range(n)))

    def all_gather_into_tensor(self, output: torch.Tensor, input: torch.Tensor, group: Group | None = None) -> None:
        """Concatenate every member's ``input`` (flat, in group-rank order) into ``output``."""
        group = self._resolve(group)
        if output.numel() != input.numel() * group.size or input.dtype != output.dtype:
            raise ValueError(
                f"all_gather_into_tensor on {group}: input has {input.numel()} {input.dtype} elements, "
                f"output {output.numel()} {output.dtype}; need output numel = {group.size} x input numel, same dtype"
            )

        def complete(calls: list[_Call]) -> None:
            gathered = torch.cat([c.inputs[0].reshape(-1) for c in calls])
            for c in calls:
                c.outputs[0].copy_(gathered.view(c.outputs[0].shape))

        sig = ("all_gather_into_tensor", group, input.shape, input.dtype, input.device)
        self._collective(_Call(self._rank, sig, sys._getframe(1), (input,), (output,)), group, complete)

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
        group = self._resolve(group)
        n = group.size
        in_splits, out_splits, trailing = exchange_plan(
            output, input, output_split_sizes, input_split_sizes, n, str(group)
        )

        def complete(calls: list[_Call]) -> None:
            exchange_rows(calls, range(n), str(group))

        sig = ("all_to_all_single", group, input.dtype, f"trailing dims={trailing}", input.device)
        call = _Call(self._rank, sig, sys._getframe(1), (input,), (output,), (in_splits, out_splits))
        self._collective(call, group, complete)

    def broadcast(self, tensor: torch.Tensor, src: int, group: Group | None = None) -> None:
        """Copy global rank ``src``'s ``tensor`` into every member's ``tensor``."""
        group = self._resolve(group)
        source = group.rank_of(src)

        def complete(calls: list[_Call]) -> None:
            value = calls[source].inputs[0]
            for i, c in enumerate(calls):
                if i != source:
                    c.inputs[0].copy_(value)

        sig = ("broadcast", group, f"src={src}", tensor.shape, tensor.dtype, tensor.device)
        self._collective(_Call(self._rank, sig, sys._getframe(1), (tensor,)), group, complete)

    def barrier(self, group: Group | None = None) -> None:
        """Wait until every member of ``group`` has arrived."""
        group = self._resolve(group)
        self._collective(_Call(self._rank, ("barrier", group), sys._getframe(1)), group, lambda calls: None)


class SimWorld:
    """Runs a rank function on every rank of ``spec``, one thread per rank, in this process.

    ``reduction`` chooses the `ReductionModel` of each group's collectives: a model name, a `Reduction`
    member or a model for every group, or a mapping from group kind (``tp``, ``dp``, ``ep``, ``etp``,
    ``edp``, ``pp``, ``world``) to one of those, kinds not named using its ``"default"`` entry. The default is
    `simdist.world.options.DEFAULT_REDUCTION` (gloo's order; it was a rank-order fold, `Sequential`, before
    every launcher shared one default: pass ``reduction="sequential"`` for that). ``models`` (kind -> model)
    and ``default_model`` are the older spellings, kept as deprecated aliases.

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
        models: Mapping[str, ReductionModel] | None = None,
        default_model: ReductionModel | None = None,
        timeout_s: float | None = DEFAULT_TIMEOUT_S,
        one_cpu: bool = True,
        intra_op_threads: int | None = 1,
        *,
        reduction: ReductionChoice = _UNSET,
    ) -> None:
        self.spec = spec
        older = [name for name, value in (("models", models), ("default_model", default_model)) if value is not None]
        if older and reduction is not _UNSET:
            raise TypeError(f"give the reduction model once, as reduction= (got reduction= and {', '.join(older)}=)")
        if older:  # the deprecated spellings: a kind -> model table and a default
            reduction = {**(models or {}), "default": default_model or as_model(DEFAULT_REDUCTION)}
        per_kind = kind_models(pick_reduction(reduction))
        self.default_model = per_kind.pop("default")
        self.models = per_kind
        self.timeout_s = check_timeout(timeout_s)
        self.one_cpu = one_cpu and hasattr(os, "sched_setaffinity")
        self.intra_op_threads = intra_op_threads

    def model_for(self, kind: GroupKind | str) -> ReductionModel:
        """The reduction model used by groups of ``kind``."""
        return self.models.get(kind, self.default_model)

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Call ``fn(comm, *args, **kwargs)`` on every rank; return the results in rank order."""
        engine = Engine(self.spec.world_size, label="SimWorld")
        return engine.run(
            lambda rank: fn(SimComm(engine, self, rank), *args, **kwargs),
            timeout_s=self.timeout_s,
            one_cpu=self.one_cpu,
            intra_op_threads=self.intra_op_threads,
        )


ReductionChoice = str | ReductionModel | Mapping[str, str | ReductionModel]
"""What `SimWorld` accepts as ``reduction=``: a name or `Reduction` member, a model, or a kind -> either table."""

SIMWORLD_KINDS: tuple[str, ...] = (*GROUP_KINDS, GroupKind.WORLD, "default")
"""The keys of a `SimWorld` kind -> model table."""


def kind_models(choice: ReductionChoice) -> dict[str, ReductionModel]:
    """``{kind: model}`` with a ``"default"`` entry from a `ReductionChoice`; unknown kinds and names are errors."""
    if isinstance(choice, str | ReductionModel):
        return {"default": as_model(choice, "reduction")}
    if isinstance(choice, Mapping):
        unknown = [k for k in choice if k not in SIMWORLD_KINDS]
        if unknown:
            raise ValueError(f"reduction: unknown group kind(s) {unknown}; valid: {', '.join(SIMWORLD_KINDS)}")
        table = {str(k): as_model(m, f"reduction[{k!r}]") for k, m in choice.items()}
        table.setdefault("default", as_model(DEFAULT_REDUCTION))
        return table
    raise TypeError(
        "reduction must be a model name, a Reduction member, a ReductionModel or a mapping from group kind to one "
        f"of those (SimWorld has no per-rank-tuple callable: use simdist.spawn), got {type(choice).__name__} "
        f"{choice!r}"
    )
