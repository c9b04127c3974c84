"""The communicator interface that rank programs are written against.

A rank program is a plain function ``fn(comm, *args)``. It asks ``comm`` for
its rank and its groups and calls torch.distributed-shaped collectives on it.
`simdist.world.simworld.SimComm` implements this interface with simulated
collectives in one process; `simdist.world.torch_comm.TorchComm` implements it over
real ``torch.distributed`` process groups. Nothing in a rank program knows
which one it has.

Group handles are plain data (`Group`: a kind and its global ranks in
group-rank order), so they compare, print and hash the same in both worlds.
Kinds are `GroupKind` members (a ``StrEnum``: ``"tp"`` and ``GroupKind.TP`` are the same key).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from simdist.errors import UsageError
from simdist.reduce import ReduceOp
from simdist.world.spec import GroupKind, ParallelSpec

__all__ = ["Comm", "Group", "GroupKind", "group_for", "world_group"]


@dataclass(frozen=True)
class Group:
    """A process group: its kind (a `GroupKind`: ``tp``, ``dp``, ..., or ``world``) and its global ranks."""

    kind: GroupKind | str
    ranks: tuple[int, ...]

    @property
    def size(self) -> int:
        return len(self.ranks)

    def rank_of(self, global_rank: int) -> int:
        """Group rank of ``global_rank``; ``ValueError`` if it is not a member."""
        try:
            return self.ranks.index(global_rank)
        except ValueError:
            raise UsageError(f"rank {global_rank} is not in {self}") from None

    def __str__(self) -> str:
        return f"{self.kind}{{{','.join(map(str, self.ranks))}}}"


@runtime_checkable
class Comm(Protocol):
    """What a rank program may call. ``group=None`` means the whole world."""

    spec: ParallelSpec

    def get_rank(self) -> int: ...

    def get_world_size(self, group: Group | None = None) -> int: ...

    def group(self, kind: GroupKind | str) -> Group: ...

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, group: Group | None = None) -> None: ...

    def reduce_scatter_tensor(
        self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp = ReduceOp.SUM, group: Group | None = None
    ) -> None: ...

    def reduce(
        self, tensor: torch.Tensor, dst: int, op: ReduceOp = ReduceOp.SUM, group: Group | None = None
    ) -> None: ...

    def reduce_scatter(
        self,
        output: torch.Tensor,
        input_list: list[torch.Tensor],
        op: ReduceOp = ReduceOp.SUM,
        group: Group | None = None,
    ) -> None: ...

    def all_gather_into_tensor(self, output: torch.Tensor, input: torch.Tensor, group: Group | None = None) -> None: ...

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int] | None = None,
        input_split_sizes: list[int] | None = None,
        group: Group | None = None,
    ) -> None: ...

    def broadcast(self, tensor: torch.Tensor, src: int, group: Group | None = None) -> None: ...

    def barrier(self, group: Group | None = None) -> None: ...


def world_group(spec: ParallelSpec) -> Group:
    """The group of every rank."""
    return Group(GroupKind.WORLD, tuple(range(spec.world_size)))


def group_for(spec: ParallelSpec, kind: GroupKind | str, rank: int) -> Group:
    """The group of ``kind`` that holds ``rank`` (``kind="world"`` for all ranks)."""
    if kind == GroupKind.WORLD:
        return world_group(spec)
    return Group(kind, spec.group_of(kind, rank))
