"""Error of one rounded result against its exact (FP64) value, and the per-site accumulation of those errors.

For every element of a result ``r`` (a collective's output, a cast's narrowed value) blame knows the exact
value ``e`` of the same inputs (an FP64 sum of the members' tensors; the wide input of a cast) and
``t = sum |terms|`` (the sum of the absolute values of the reduced terms; ``|input|`` for a cast). From
them, in FP64:

* ``ulp``: ``|r - e|`` in units of the spacing of ``r``'s dtype at ``|e|`` (a correctly rounded result is
  at most 0.5; the figure explodes where a sum cancels to nearly zero);
* ``err/sum|t|``: ``|r - e| / t``, the figure that stays comparable to the unit roundoff (the classical
  bound of a recursive sum of n terms is ``(n - 1) u``); summed over elements it is the site's *error
  mass*, and a site's share is its mass over the mass of every site of the run;
* ``rel``: ``|r - e| / |e|`` over non-zero ``e``.

Elements whose exact value or result is not finite are counted (``nonfinite``), never averaged in; those
whose exact value is finite and whose result is not (an overflow to +-inf, a NaN the rounding made) are
counted again as ``overflow``: blame ranks a site with overflow before every site without (its error has no
finite size, and leaving it out of the mass would make the overflowing variant look the better one).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from simdist.errors import UsageError


def spacing(exact: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The distance between consecutive values of ``dtype`` at ``|exact|`` (FP64; subnormal spacing near 0)."""
    info = torch.finfo(dtype)
    floor = info.tiny * info.eps
    magnitude = exact.abs()
    _, exponent = torch.frexp(magnitude)
    step = torch.ldexp(torch.full_like(magnitude, info.eps), exponent - 1)
    return torch.where(magnitude < info.tiny, torch.full_like(magnitude, floor), step)


@dataclass
class Errors:
    """The figures of one comparison (or many, combined with `add`)."""

    elements: int = 0
    nonfinite: int = 0
    overflow: int = 0
    max_ulp: float = 0.0
    max_term_relative: float = 0.0
    max_relative: float = 0.0
    mass: float = 0.0

    def add(self, other: Errors) -> None:
        self.elements += other.elements
        self.nonfinite += other.nonfinite
        self.overflow += other.overflow
        self.max_ulp = max(self.max_ulp, other.max_ulp)
        self.max_term_relative = max(self.max_term_relative, other.max_term_relative)
        self.max_relative = max(self.max_relative, other.max_relative)
        self.mass += other.mass


def errors(result: torch.Tensor, exact: torch.Tensor, terms: torch.Tensor, low: torch.Tensor | None = None) -> Errors:
    """Compare ``result`` (any floating dtype) with ``exact`` and ``terms`` (FP64, same number of elements).

    ``low``, when given, is the part of the exact value FP64 could not hold (``exact + low``, a TwoSum pair:
    `simdist.attribution.collectives`); the error is taken against the pair."""
    r = result.detach().reshape(-1).double()
    e = exact.detach().reshape(-1).double()
    t = terms.detach().reshape(-1).double()
    lo = torch.zeros_like(e) if low is None else low.detach().reshape(-1).double()
    n = r.numel()
    if n == 0:
        return Errors()
    finite = torch.isfinite(r) & torch.isfinite(e) & torch.isfinite(t)
    nonfinite = int(n - finite.sum())
    overflow = int((~torch.isfinite(r) & torch.isfinite(e)).sum()) if nonfinite else 0
    if nonfinite:
        r, e, t, lo = r[finite], e[finite], t[finite], lo[finite]
    if r.numel() == 0:
        return Errors(elements=n, nonfinite=nonfinite, overflow=overflow)
    err = ((r - e) - lo).abs()
    ulp = err / spacing(e, result.dtype)
    scaled = torch.where(t > 0, err / t, torch.where(err > 0, math.inf, 0.0))
    nonzero = e != 0
    rel = (err[nonzero] / e[nonzero].abs()) if bool(nonzero.any()) else err.new_zeros(1)
    return Errors(
        elements=n,
        nonfinite=nonfinite,
        overflow=overflow,
        max_ulp=float(ulp.max()),
        max_term_relative=float(scaled.max()),
        max_relative=float(rel.max()),
        mass=float(scaled.sum()),
    )


@dataclass
class SiteErrors:
    """Everything blame saw at one site: call count, ranks, groups, errors overall and per step."""

    file: str
    line: int
    function: str
    kind: str  # "collective" or "cast"
    op: str  # all_reduce, reduce_scatter_tensor, ..., or the cast's aten op
    dtypes: str  # "fp32" for a collective, "fp32->bf16" for a cast
    calls: int = 0
    ranks: set = field(default_factory=set)
    groups: set = field(default_factory=set)
    errors: Errors = field(default_factory=Errors)
    steps: dict = field(default_factory=dict)  # step -> Errors
    by_rank: dict = field(default_factory=dict)  # rank -> Errors (the JSON's per-rank detail)

    @property
    def key(self) -> tuple:
        return (self.file, self.line, self.function, self.kind, self.op, self.dtypes)

    def add(self, rank: int | None, step: int, found: Errors, group: str | None = None) -> None:
        self.calls += 1
        if rank is not None:
            self.ranks.add(rank)
        if group:
            self.groups.add(group)
        self.errors.add(found)
        self.steps.setdefault(step, Errors()).add(found)
        self.by_rank.setdefault(rank, Errors()).add(found)

    def merge(self, other: SiteErrors) -> None:
        """Add the record of the same site seen by another process (process mode: each rank records its own
        calls): calls, elements, non-finite counts and masses add up, the max figures are the larger."""
        if other.key != self.key:
            raise UsageError(f"cannot merge site {other.key} into {self.key}")
        self.calls += other.calls
        self.ranks |= other.ranks
        self.groups |= other.groups
        self.errors.add(other.errors)
        for step, found in other.steps.items():
            self.steps.setdefault(step, Errors()).add(found)
        for rank, found in other.by_rank.items():
            self.by_rank.setdefault(rank, Errors()).add(found)
