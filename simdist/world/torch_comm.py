"""`TorchComm`: the `Comm` interface over real ``torch.distributed`` process groups.

The same rank program that runs on `SimWorld` runs here under torchrun or
``simdist.run(api="comm", where="gloo")``. The communicator is built after the default
process group is initialised; it creates one process group per distinct rank
set of every group kind of the spec (all ranks create them in the same order,
as ``dist.new_group`` requires) and maps the plain-data `Group` handles to
them. Nothing is stored in module globals.

Backend differences handled here:

* ``AVG`` off NCCL is ``SUM`` then an in-place division by the group size,
  which is what torch 2.13's gloo backend does for ``dist.ReduceOp.AVG`` too
  (`simdist.reduce.gloo.reduction`), the ``postdiv`` rounding of the simulated reductions.
  On NCCL ``dist.ReduceOp.AVG`` is passed through.
  The same holds for ``reduce_scatter_tensor`` (which gloo implements as an
  all-reduce of a copy of the input, keeping this rank's block; see
  `simdist.reduce.gloo.reduction`).
* torch orders a group's ranks by sorting them; `ParallelSpec` lists every
  group in that same ascending order, so block ``i`` of a block collective
  belongs to ``group.ranks[i]`` in both worlds.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from simdist.errors import UsageError
from simdist.reduce import ReduceOp
from simdist.world.groups import Group, group_for, world_group
from simdist.world.spec import GROUP_KINDS, ParallelSpec

_TORCH_OPS = {
    ReduceOp.SUM: dist.ReduceOp.SUM,
    ReduceOp.AVG: dist.ReduceOp.AVG,
    ReduceOp.MAX: dist.ReduceOp.MAX,
    ReduceOp.MIN: dist.ReduceOp.MIN,
}

_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class TorchComm:
    """A `simdist.world.groups.Comm` over the initialised default ``torch.distributed`` process group."""

    def __init__(self, spec: ParallelSpec) -> None:
        if not dist.is_initialized():
            raise RuntimeError("TorchComm needs an initialised default process group (dist.init_process_group)")
        if dist.get_world_size() != spec.world_size:
            raise UsageError(f"process group has {dist.get_world_size()} ranks but the spec needs {spec.world_size}")
        self.spec = spec
        self.backend = str(dist.get_backend())
        self._rank = dist.get_rank()
        world = world_group(spec).ranks
        self._pgs: dict[tuple[int, ...], dist.ProcessGroup | None] = {world: dist.group.WORLD}
        for kind in GROUP_KINDS:  # same order on every rank
            for ranks in spec.groups(kind):
                if ranks not in self._pgs:
                    self._pgs[ranks] = dist.new_group(list(ranks))

    # -- topology --------------------------------------------------------------

    def get_rank(self) -> int:
        """This process's global rank."""
        return self._rank

    def get_world_size(self, group: Group | None = None) -> int:
        """Size of ``group`` (the world when ``None``)."""
        return self.spec.world_size if group is None else group.size

    def group(self, kind: str) -> Group:
        """The group of ``kind`` (or ``"world"``) that holds this rank."""
        return group_for(self.spec, kind, self._rank)

    def _resolve(self, group: Group | None) -> tuple[Group, dist.ProcessGroup]:
        group = group or world_group(self.spec)
        if self._rank not in group.ranks:
            raise UsageError(f"rank {self._rank} called a collective on {group}, which it is not a member of")
        pg = self._pgs.get(group.ranks)
        if pg is None:
            raise UsageError(f"{group} is not a group of {self.spec.describe()}")
        return group, pg

    # -- collectives -----------------------------------------------------------

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, group: Group | None = None) -> None:
        """Reduce ``tensor`` in place across ``group`` (SUM, AVG, MAX or MIN)."""
        op = ReduceOp.coerce(op)
        group, pg = self._resolve(group)
        if op is ReduceOp.AVG and self.backend != "nccl":
            dist.all_reduce(tensor, dist.ReduceOp.SUM, group=pg)
            tensor.div_(group.size)
            return
        dist.all_reduce(tensor, _TORCH_OPS[op], group=pg)

    def reduce_scatter_tensor(
        self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp = ReduceOp.SUM, group: Group | None = None
    ) -> None:
        """Reduce ``input`` across ``group``; block ``i`` of ``group.size`` (dim 0) lands on ``group.ranks[i]``."""
        op = ReduceOp.coerce(op)
        group, pg = self._resolve(group)
        if op is ReduceOp.AVG and self.backend != "nccl":
            _reduce_scatter(output, input, dist.ReduceOp.SUM, group=pg)
            output.div_(group.size)
            return
        _reduce_scatter(output, input, _TORCH_OPS[op], group=pg)

    def reduce(self, tensor: torch.Tensor, dst: int, op: ReduceOp = ReduceOp.SUM, group: Group | None = None) -> None:
        """``dist.reduce`` of ``tensor`` to global rank ``dst`` (the other members' tensors hold what the backend
        leaves there: on gloo, partial sums)."""
        group, pg = self._resolve(group)
        dist.reduce(tensor, dst, _TORCH_OPS[ReduceOp.coerce(op)], group=pg)

    def reduce_scatter(
        self,
        output: torch.Tensor,
        input_list: list[torch.Tensor],
        op: ReduceOp = ReduceOp.SUM,
        group: Group | None = None,
    ) -> None:
        """List ``dist.reduce_scatter``: entry ``i`` of every member's list reduced into group rank ``i``'s output."""
        group, pg = self._resolve(group)
        dist.reduce_scatter(output, list(input_list), _TORCH_OPS[ReduceOp.coerce(op)], group=pg)

    def all_gather_into_tensor(self, output: torch.Tensor, input: torch.Tensor, group: Group | None = None) -> None:
        """Concatenate every rank's ``input`` along dim 0 into ``output`` in ``group.ranks`` order."""
        _, pg = self._resolve(group)
        dist.all_gather_into_tensor(output, input, group=pg)

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int] | None = None,
        input_split_sizes: list[int] | None = None,
        group: Group | None = None,
    ) -> None:
        """Send split ``i`` of ``input`` to ``group.ranks[i]``; receive into ``output`` in the same order."""
        _, pg = self._resolve(group)
        dist.all_to_all_single(output, input, output_split_sizes, input_split_sizes, group=pg)

    def broadcast(self, tensor: torch.Tensor, src: int, group: Group | None = None) -> None:
        """Copy ``tensor`` from global rank ``src`` to every rank of ``group``, in place."""
        group, pg = self._resolve(group)
        if src not in group.ranks:
            raise UsageError(f"broadcast source rank {src} is not in {group}")
        dist.broadcast(tensor, src, group=pg)

    def barrier(self, group: Group | None = None) -> None:
        """Block until every rank of ``group`` has reached this barrier."""
        _, pg = self._resolve(group)
        dist.barrier(group=pg)

    def __repr__(self) -> str:
        return f"TorchComm(rank={self._rank}, backend={self.backend}, {self.spec.describe()})"
