"""Fold plans: a reduction order, precomputed once, applied as one copy, one strided view and the adds.

Every rank-fold order simdist reductions (rank order, gloo's ring, the textbook ring) has one shape: the flat
tensor is cut into chunks of ``length`` elements, ``period`` consecutive chunks form a cycle that repeats
along the tensor, and chunk ``p`` of a cycle (``p = (e // length) % period``) is the left fold of the members
``rows[h + p]`` for the hops ``h = 0, 1, ..., n-1`` (``n-1, ..., 0`` when ``descending``). ``rows`` has
``n + period - 1`` entries: a rotation of the members written out twice, so that every chunk's walk is a
window of it.

Applying a plan (`FoldPlan.hops`) copies the ``rows`` members one after the other into one buffer (one
``torch.cat`` or ``index_select``), and every hop of every chunk is then one ``as_strided`` view of that
buffer: hop ``h`` reads row ``h + p`` for chunk ``p``, a fixed stride per chunk. The fold is ``n - 1``
element-wise adds over whole tensors, whatever the number of chunks, and the same for a batch of independent
reductions (``[n, count, numel]``: the batch rides along in the view). The last chunk of a member may be
short: its lanes past ``numel`` read the next row (a few more rows are copied at the end for the last one),
are folded like the others and cut off by `FoldPlan.trim`; nothing there reaches a result. ``period == 1``
is an order that is the same at every element: no copy at all, the hops are the members themselves.

Stacked members whose length is whole chunks are instead gathered chunk by chunk into contiguous hops (one
``index_select`` with an index of ``n * count * chunks`` rows, used while that is at most `ROW_GATHER_LIMIT`):
contiguous adds are cheaper than strided ones for small tensors.

A plan holds a handful of integers (``rows`` has at most ``2n - 1``) and at most 4 index tensors (the rows per
device, the chunk rows per batch size: at most `ROW_GATHER_LIMIT` entries, 128 KiB), never a per-element index
of an unbounded tensor, so its memory does not grow with the tensor (at most about 0.5 MiB a plan, 128 MiB for
the two plan caches of `PLAN_CACHE_SIZE` entries);
`simdist.reduce.base.Reduction.plan` caches at most `PLAN_CACHE_SIZE` of them. `FoldPlan.index`
writes the order out per element (``[n, numel]``) for inspection only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from simdist.errors import UsageError

Hops = Sequence[torch.Tensor]
"""The values a fold combines, in hop order: hop 0 first."""

ROW_GATHER_LIMIT = 1 << 14
"""Stacked members cut in whole chunks are gathered chunk by chunk (an index of ``n * count * chunks`` rows,
kept per batch size) while that index has at most this many entries; else through the strided view."""

PLAN_CACHE_SIZE = 128
"""Plans kept per plan cache (each a few integers, a tuple of at most ``2n`` member indices and at most 4
small index tensors)."""


def fold(ordered: torch.Tensor | Hops, multiply: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
    """Left fold over the leading dimension, rounding each partial sum (or product) to the tensor dtype.

    ``out``: where the fold is written (e.g. a contiguous tensor for strided hops, whose sum torch would
    otherwise lay out in their memory order); by default a new tensor.
    """
    parts = ordered.unbind(0) if isinstance(ordered, torch.Tensor) else ordered  # one call, not n indexings
    if len(parts) == 1:
        return parts[0].clone() if out is None else out.copy_(parts[0])
    if multiply:
        acc = torch.mul(parts[0], parts[1], out=out) if out is not None else parts[0] * parts[1]
        for part in parts[2:]:
            acc *= part
        return acc
    acc = torch.add(parts[0], parts[1], out=out) if out is not None else parts[0] + parts[1]
    for part in parts[2:]:
        acc += part
    return acc


@dataclass(frozen=True)
class FoldPlan:
    """The order of an ``n``-member fold over ``numel`` elements (see the module docstring).

    Element ``e``'s hop ``j`` adds member ``rows[h + p]`` with ``p = (e // length) % period`` and
    ``h = j`` (``h = n - 1 - j`` when ``descending``).
    """

    n: int
    numel: int
    length: int
    period: int
    rows: tuple[int, ...]
    descending: bool = False
    padded: int = field(init=False, compare=False)
    """Elements per member in whole cycles: ``numel`` rounded up to a multiple of ``period * length``."""
    _hop_rows: tuple[int, ...] = field(init=False, repr=False, compare=False)
    _copied: tuple[int, ...] = field(init=False, repr=False, compare=False)
    _index: dict = field(init=False, repr=False, compare=False)
    _view: tuple = field(init=False, repr=False, compare=False)
    packed: object = field(default=None, init=False, repr=False, compare=False)
    """The plan as `simdist.reduce.native`'s kernel reads it (built there on first use; None until then)."""

    def __post_init__(self) -> None:
        if self.n < 1 or self.period < 1 or self.length < 1:
            raise UsageError(f"a fold plan needs n, period and length >= 1, got {self.n}, {self.period}, {self.length}")
        if len(self.rows) != self.n + self.period - 1:
            raise UsageError(f"a fold plan of {self.n} members and period {self.period} needs "
                             f"{self.n + self.period - 1} rows, got {len(self.rows)}")  # fmt: skip
        if any(not 0 <= r < self.n for r in self.rows):
            raise UsageError(f"fold plan rows {self.rows} name members outside 0..{self.n - 1}")
        cycle = self.period * self.length
        padded = -(-self.numel // cycle) * cycle
        spill = -(-(padded - self.numel) // self.numel) if self.numel else 0  # rows the last chunk reads past the end
        setattr_ = object.__setattr__
        setattr_(self, "padded", padded)
        setattr_(self, "_hop_rows", tuple(self.rows[h] for h in self.hop_order()))
        setattr_(self, "_copied", self.rows + self.rows[:1] * spill)
        setattr_(self, "_index", {})
        setattr_(self, "_view", self._view_of(1))

    @classmethod
    def uniform(cls, order: Sequence[int], numel: int) -> FoldPlan:
        """The same order at every element: ``order[0] + order[1] + ...``."""
        return cls(len(order), numel, max(1, numel), 1, tuple(order))

    @property
    def is_uniform(self) -> bool:
        """Whether every element folds in the same order (then a stacked input of any shape is folded as it is)."""
        return self.period == 1

    def hop_order(self) -> range:
        """The window offsets ``h`` in hop order."""
        return range(self.n - 1, -1, -1) if self.descending else range(self.n)

    def hops(self, members: torch.Tensor | Hops) -> list[torch.Tensor]:
        """The values each hop combines, hop 0 first.

        ``members``: one tensor per member (a sequence, or stacked on dim 0). For a uniform plan any
        shape (the hops are the members themselves, no copy); otherwise a sequence of ``[numel]`` tensors,
        or a stacked ``[n, numel]`` or ``[n, count, numel]`` (``count`` independent reductions, any
        strides), and the hops are ``[count, cycles, period, length]`` views of one copy; fold them into
        `output` and `trim` maps the result back.
        """
        if self.is_uniform:
            parts = members.unbind(0) if isinstance(members, torch.Tensor) else members
            if len(parts) != self.n:
                raise UsageError(f"this plan folds {self.n} members, got {len(parts)}")
            return [parts[r] for r in self._hop_rows]
        count = 1
        if not isinstance(members, torch.Tensor):
            shape = members[0].shape
            if len(members) != self.n or shape != (self.numel,) or any(t.shape != shape for t in members):
                raise UsageError(f"this plan folds {self.n} 1-d members of {self.numel} elements, got shapes "
                                 f"{[tuple(t.shape) for t in members]}")  # fmt: skip
            buffer = torch.cat([members[r] for r in self._copied])
        elif members.shape[0] != self.n or members.shape[-1] != self.numel or members.dim() not in (2, 3):
            raise UsageError(f"this plan folds [{self.n}, (count,) {self.numel}] members, got {tuple(members.shape)}")
        elif self.padded == self.numel and members.numel() // self.length <= ROW_GATHER_LIMIT:
            # whole chunks: gather them as rows of `length` into hop order (contiguous hops, faster adds)
            count = 1 if members.dim() == 2 else members.shape[1]
            rows = members.reshape(-1, self.length).index_select(0, self._chunk_rows(count, members.device))
            return list(rows.view(self.n, *members.shape[1:]).unbind(0))
        elif members.dim() == 2:
            buffer = members.index_select(0, self._rows_on(members.device))
        elif members.shape[1] == 1:
            buffer = members.view(self.n, self.numel).index_select(0, self._rows_on(members.device))
        else:  # [count, copied rows, numel]: each reduction's rows together, so the fold comes out in order
            count = members.shape[1]
            buffer = members.transpose(0, 1).index_select(1, self._rows_on(members.device))
        size, stride = self._view if count == 1 else self._view_of(count)
        view = buffer.as_strided(size, stride).unbind(0)
        return list(view[::-1] if self.descending else view)

    def _view_of(self, count: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Size and strides of the hops' view ``[n, count, cycles, period, length]`` of the copied buffer,
        without its dimensions of size 1 (fewer dimensions make torch's element-wise loops cheaper)."""
        numel, cycle = self.numel, self.period * self.length
        dims = [
            (self.n, numel),
            (count, len(self._copied) * numel),
            (self.padded // cycle, cycle),
            (self.period, numel + self.length),
            (self.length, 1),
        ]
        kept = [dims[0]] + [d for d in dims[1:] if d[0] > 1]
        return tuple(d[0] for d in kept), tuple(d[1] for d in kept)

    def output(self, hops: Hops) -> torch.Tensor | None:
        """Where to fold `hops`: None (a new tensor) unless torch would lay the sum of these strided views
        out in another order (several cycles), then a contiguous ``[count, cycles, period, length]``."""
        if self.is_uniform or self.padded == self.period * self.length or hops[0].is_contiguous():
            return None
        first = hops[0]
        return torch.empty(first.shape, dtype=first.dtype, device=first.device)

    def trim(self, folded: torch.Tensor, members: torch.Tensor | Hops) -> torch.Tensor:
        """A fold of `hops` as ``[numel]`` (1-d members) or ``[count, numel]``; a uniform fold as it is."""
        if self.is_uniform:
            return folded
        count = members.shape[1] if isinstance(members, torch.Tensor) and members.dim() != 2 else None
        if folded.shape == ((self.numel,) if count is None else (count, self.numel)):  # gathered whole chunks
            return folded
        if count is None:
            flat = folded.view(self.padded)
            return flat if self.padded == self.numel else flat[: self.numel]
        flat = folded.view(count, self.padded)
        return flat if self.padded == self.numel else flat[:, : self.numel]

    def index(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """``index[j, e]``: the member element ``e`` adds at hop ``j`` (``[n, numel]``; for inspection)."""
        rows = torch.tensor(self.rows, dtype=torch.long, device=device)
        hop = torch.tensor(list(self.hop_order()), dtype=torch.long, device=device).unsqueeze(1)
        chunk = (torch.arange(self.numel, device=device) // self.length) % self.period
        return rows[hop + chunk.unsqueeze(0)]

    def _chunk_rows(self, count: int, device: torch.device) -> torch.Tensor:
        """Row index into ``members.reshape(-1, length)`` that lists, hop by hop, every reduction's chunks in
        order: hop ``j``, item ``b``, chunk ``q`` reads member ``rows[h + q % period]``'s chunk ``q``."""
        key = (count, device)
        index = self._index.get(key)
        if index is None:
            chunks = self.numel // self.length
            hop = torch.tensor(list(self.hop_order()), dtype=torch.long).view(-1, 1, 1)
            item = torch.arange(count).view(1, -1, 1)
            chunk = torch.arange(chunks).view(1, 1, -1)
            member = torch.tensor(self.rows, dtype=torch.long)[hop + chunk % self.period]
            index = ((member * count + item) * chunks + chunk).reshape(-1).to(device)
            if len(self._index) >= 4:
                self._index.clear()
            self._index[key] = index
        return index

    def _rows_on(self, device: torch.device) -> torch.Tensor:
        """The copied rows as an index tensor on ``device`` (kept: one small tensor per device)."""
        index = self._index.get(device)
        if index is None:
            index = self._index[device] = torch.tensor(self._copied, dtype=torch.long, device=device)
        return index
