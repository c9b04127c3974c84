"""How the oracle sums a group: per parameter in the reduction's order, and every parameter at once where a
group has two members.

Part of the independent oracle (`simdist.gradpath.oracle`); it shares no code with the gradient path. Values are
``[*batch, rank, *shape]`` tensors (`stacked`): a group takes its members out of the rank dimension in group-rank
order, and each batch item (a seed of the growth study) gets the bits it gets alone (`group_sum`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from simdist.gradpath.families import ParamSpec
from simdist.gradpath.oracle_rules import correction, dp_kind
from simdist.reduce import Reduction
from simdist.world.spec import ParallelSpec

if TYPE_CHECKING:
    from simdist.gradpath.oracle_step import Oracle


def stacked(per_rank: Sequence[torch.Tensor], p: ParamSpec) -> torch.Tensor:
    """Every rank's ``[*batch, *shape]`` tensor of ``p`` as one ``[*batch, rank, *shape]`` tensor."""
    return torch.stack(list(per_rank), dim=per_rank[0].dim() - len(p.shape))


@functools.lru_cache(maxsize=64)
def pair_indexes(groups: tuple[tuple[int, ...], ...], world: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two-member ``groups``: the ranks of their first members, of their second members, and each rank's group."""
    group_of = [0] * world
    for g, group in enumerate(groups):
        for r in group:
            group_of[r] = g
    first, second = (torch.tensor([group[j] for group in groups]) for j in (0, 1))
    return first, second, torch.tensor(group_of)


def group_sum(reduction: Reduction, members: list[torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
    """``reduction``'s sum of one group's members, each batch item on its own: a reduction's order depends on
    the size of the tensor a rank hands in (a parameter's), not on how many seeds ride along.

    Two members are one addition, which every order performs on the same two values, and IEEE addition is
    commutative: the whole batch is reduced at once, unless the result holds a NaN (whose payload is the first
    operand's, so it depends on the order): then, as for more members, each item is reduced on its own."""
    batch = members[0].shape[: members[0].dim() - len(shape)]
    if not batch:
        return reduction.reduce(members)
    if len(members) <= 2:
        out = reduction.reduce(members)
        if not math.isnan(out.sum().item()):  # a NaN anywhere makes the sum NaN (inf - inf only adds false alarms)
            return out
    flat = [m.reshape(-1, *shape) for m in members]
    items = [reduction.reduce([m[i] for m in flat]) for i in range(flat[0].shape[0])]
    return torch.stack(items).reshape(*batch, *shape)


def group_sums(
    spec: ParallelSpec,
    reduction: Reduction,
    kind: str,
    value: torch.Tensor,
    shape: tuple[int, ...],
    scale: float | None = None,
) -> torch.Tensor:
    """Every rank's group sum (``reduction``'s order, group-rank order) of ``value`` ``[*batch, rank, *shape]`` over
    the groups of ``kind``, times ``scale`` if given, in a new tensor."""
    dim = value.dim() - len(shape) - 1
    groups = spec.groups(kind)
    if all(len(group) == 2 for group in groups):
        # two members are one addition: every group's pair is summed at once (the groups ride along as
        # batch items, as the seeds do in `group_sum`), then each rank takes its group's sum
        first, second, group_of = pair_indexes(groups, spec.world_size)
        pairs = [value.index_select(dim, first), value.index_select(dim, second)]
        out = group_sum(reduction, pairs, shape).index_select(dim, group_of)
        return out if scale is None else out * scale
    sums: dict[int, torch.Tensor] = {}
    rows = value.unbind(dim)
    for group in groups:
        total = group_sum(reduction, [rows[r].contiguous() for r in group], shape)
        for r in group:
            sums[r] = total
    out = torch.stack([sums[r] for r in range(spec.world_size)], dim=dim)
    return out if scale is None else out * scale


class FusedPairs:
    """The oracle's step for every trained parameter at once, where a group sum is one addition.

    When every group of a kind has two members, a group's sum is one addition per element, which every order
    performs on the same two values: it does not depend on where the element sits in its parameter, so one
    reduction of the flat ``[*batch, rank, N]`` buffer (every parameter, in the masters' layout) gives each
    element the bits of its own parameter's reduction (the assumption `group_sum` already makes for the seeds
    that ride along). The per-family TP correction becomes masks over the flat buffer; the DP reduction is
    fused only when every parameter's DP kind has the same groups. A NaN's payload does
    depend on the order: if a fused sum holds a NaN, that stage returns "not done" and `Oracle.step` runs it
    parameter by parameter instead. Used only when nothing is captured; tested equal, bit for bit, to the
    per-parameter step (``tests/unit/test_oracle_fused.py``).
    """

    def __init__(self, spec: ParallelSpec, trained: Sequence[ParamSpec], spans: dict[str, tuple[int, int]], n: int):
        self.spec = spec
        reduces, divides = (torch.zeros(n, dtype=torch.bool) for _ in range(2))
        for p in trained:
            start, stop = spans[p.name]
            reduces[start:stop], divides[start:stop] = correction(p.family, spec.tp)
        self.reduces = reduces if bool(reduces.any()) else None
        self.divides = divides if bool(divides.any()) else None
        pairs = {kind: all(len(g) == 2 for g in spec.groups(kind)) for kind in ("tp", "dp", "edp")}
        self.tp_ready = self.reduces is None or pairs["tp"]
        # the DP reduction at once: every trained parameter's DP kind (``dp``, ``edp`` for experts) has the same
        # two-member groups (``edp`` is ``dp`` unless experts are sharded over more than the TP group)
        kinds = {dp_kind(p.family) for p in trained}
        self.dp_kind = next(iter(sorted(kinds)), "dp")
        self.dp_ready = all(pairs[k] and spec.groups(k) == spec.groups(self.dp_kind) for k in kinds)

    def _pair_sums(self, kind: str, value: torch.Tensor) -> torch.Tensor | None:
        """Every rank's two-member group sum of the flat ``value`` ``[*batch, rank, N]``; None if it holds a NaN.

        One IEEE addition, written here rather than asked of the reduction: every reduction performs this same
        addition on a pair (only a NaN's payload depends on which member receives, and a NaN sends the stage to
        the per-parameter loops, which ask the reduction), so the fused stage shares no code with the gradient path."""
        dim = value.dim() - 2
        first, second, group_of = pair_indexes(self.spec.groups(kind), self.spec.world_size)
        out = value.index_select(dim, first) + value.index_select(dim, second)
        if math.isnan(out.sum().item()):  # as in `group_sum`: a NaN anywhere makes the sum NaN
            return None
        return out.index_select(dim, group_of)

    def micro_step(self, oracle: Oracle, grads: Mapping, hp: torch.Tensor) -> bool:
        """Add one micro-step's corrected local gradients of every trained parameter to ``hp``; False (``hp``
        untouched) when it cannot (a TP group of more than two, or a NaN in the TP sum)."""
        if not self.tp_ready:
            return False
        parts = []
        for p in oracle.trained:
            local = grads[p.name] if p.name in grads else stacked([grads[(r, p.name)] for r in oracle.ranks], p)
            parts.append(local.flatten(local.dim() - len(p.shape)))
        value = torch.cat(parts, dim=-1).to(oracle.dtype)
        if self.reduces is not None:
            summed = self._pair_sums("tp", value)
            if summed is None:
                return False
            value = torch.where(self.reduces, summed, value)
        if self.divides is not None:
            value = torch.where(self.divides, value / self.spec.tp, value)
        hp += value
        return True

    def boundary(self, oracle: Oracle, hp: torch.Tensor) -> torch.Tensor | None:
        """The DP-reduced gradient of every trained parameter, flat; None when it cannot (see `micro_step`)."""
        if not self.dp_ready:
            return None
        reduced = self._pair_sums(self.dp_kind, hp)
        return None if reduced is None else reduced * (1.0 / self.spec.dp)
