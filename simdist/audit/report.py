"""Audit records and reports: plain data, picklable, mergeable across ranks, printable and JSON-able."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

CAST, ACCUMULATE, STORE, COLLECTIVE, IGNORE = "cast", "accumulate", "store", "collective", "ignore"
"""Record kinds (``ignore`` is only an op class: never recorded)."""

# -- dtypes --------------------------------------------------------------------

_SHORT = {torch.float64: "fp64", torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def dtype_name(dtype: torch.dtype) -> str:
    """``fp32``, ``bf16``, ``float8_e4m3fn``... for a torch dtype."""
    return _SHORT.get(dtype) or str(dtype).removeprefix("torch.")


def _format_of(dtype: torch.dtype) -> tuple[int, float, float]:
    info = torch.finfo(dtype)
    return round(-math.log2(info.eps)), math.log2(info.max), math.log2(info.smallest_normal)


_NARROWS: dict[tuple[torch.dtype, torch.dtype], bool] = {}


def narrows(src: torch.dtype, dst: torch.dtype) -> bool:
    """True if floating ``dst`` cannot hold every value of floating ``src``: fewer mantissa bits or less range."""
    key = (src, dst)
    found = _NARROWS.get(key)
    if found is None:
        found = False
        if src != dst and src.is_floating_point and dst.is_floating_point:
            try:
                (m_src, hi_src, lo_src), (m_dst, hi_dst, lo_dst) = _format_of(src), _format_of(dst)
                found = m_dst < m_src or hi_dst < hi_src or lo_dst > lo_src
            except (TypeError, ValueError):  # a dtype finfo does not know: compare widths
                found = dst.itemsize < src.itemsize
        _NARROWS[key] = found
    return found


def _wider(a: torch.dtype | None, b: torch.dtype) -> torch.dtype:
    if a is None or a == b:
        return b
    return torch.promote_types(a, b)  # bf16 + fp16 -> fp32


# -- records and reports ---------------------------------------------------------


class _Site:
    """Display helpers shared by a record and a site summary (both have file, line, kind and dtypes)."""

    file: str
    line: int
    kind: str
    in_dtypes: tuple[str, ...]
    out_dtype: str

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"

    @property
    def dtypes(self) -> str:
        """``fp32->bf16``, ``bf16+fp32->bf16``; a collective's single dtype as ``bf16``."""
        return _dtypes(self.kind, self.in_dtypes, self.out_dtype)


@dataclass(frozen=True)
class Record(_Site):
    """One narrowing (or collective) event: op, dtypes, shape, where, on which rank, in which context."""

    op: str
    kind: str
    in_dtypes: tuple[str, ...]
    out_dtype: str
    shape: tuple[int, ...]
    file: str
    line: int
    function: str
    rank: int | None = None
    context: str = ""


@dataclass
class SiteSummary(_Site):
    """Every record of one site (source line, op, kind, dtypes, context): count and worst rounding error."""

    file: str
    line: int
    function: str
    op: str
    kind: str
    in_dtypes: tuple[str, ...]
    out_dtype: str
    context: str = ""
    count: int = 0
    max_rel_error: float | None = None
    shapes: list[tuple[int, ...]] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)

    @property
    def key(self) -> tuple:
        return (self.file, self.line, self.function, self.op, self.kind, self.in_dtypes, self.out_dtype, self.context)


_MAX_SHAPES = 4


def _dtypes(kind: str, in_dtypes: tuple[str, ...], out_dtype: str) -> str:
    if kind == COLLECTIVE and in_dtypes == (out_dtype,):
        return out_dtype
    return f"{'+'.join(in_dtypes)}->{out_dtype}"


def _max_error(a: float | None, b: float | None) -> float | None:
    if a is None:
        return b
    if b is None:
        return a
    return max(a, b)


@dataclass
class AuditReport:
    """What an audit saw: sites (grouped records, most frequent first) and the raw records (up to a cap)."""

    sites: list[SiteSummary]
    records: list[Record]
    dropped: int = 0
    rank: int | None = None

    @property
    def total(self) -> int:
        """Number of events recorded (also those beyond the record cap)."""
        return sum(s.count for s in self.sites)

    def keys(self, kinds: Iterable[str] = (CAST, ACCUMULATE, STORE)) -> set[tuple[str, str, str]]:
        """``{(file:line, kind, "fp32->bf16"), ...}`` of the sites of ``kinds`` (default: every narrowing)."""
        kinds = set(kinds)
        return {(s.where, s.kind, s.dtypes) for s in self.sites if s.kind in kinds}

    def narrowings(self, src: str | None = None, dst: str | None = None) -> list[SiteSummary]:
        """Narrowing sites (cast, accumulate, store), optionally only ``src`` -> ``dst`` (short names: fp32, bf16)."""
        return [
            s
            for s in self.sites
            if s.kind != COLLECTIVE and (src is None or src in s.in_dtypes) and (dst is None or s.out_dtype == dst)
        ]

    @classmethod
    def merge(cls, reports: Iterable[AuditReport]) -> AuditReport:
        """One report from several (e.g. one per rank): counts add up, errors take the maximum, ranks join."""
        merged: dict[tuple, SiteSummary] = {}
        records: list[Record] = []
        dropped = 0
        for report in reports:
            records += report.records
            dropped += report.dropped
            for s in report.sites:
                m = merged.get(s.key)
                if m is None:
                    m = merged[s.key] = SiteSummary(*s.key)
                m.count += s.count
                m.max_rel_error = _max_error(m.max_rel_error, s.max_rel_error)
                m.shapes += [x for x in s.shapes if x not in m.shapes][: _MAX_SHAPES - len(m.shapes)]
                m.ranks = sorted(set(m.ranks) | set(s.ranks))
        return cls(_sorted(merged.values()), records, dropped)

    def to_dict(self) -> dict:
        """Plain data (picklable, JSON-able apart from ``inf`` errors): sites and records as dicts."""

        def plain(obj) -> dict:
            data = dict(obj.__dict__)
            data["where"] = obj.where
            data["dtypes"] = obj.dtypes
            data["in_dtypes"] = list(data["in_dtypes"])
            if "shape" in data:
                data["shape"] = list(data["shape"])
            if "shapes" in data:
                data["shapes"] = [list(x) for x in data["shapes"]]
            return data

        return {
            "rank": self.rank,
            "total": self.total,
            "dropped": self.dropped,
            "sites": [plain(s) for s in self.sites],
            "records": [plain(r) for r in self.records],
        }

    @classmethod
    def from_dict(cls, data: dict) -> AuditReport:
        """Inverse of `to_dict`."""

        def fields(d: dict, names: Iterable[str]) -> dict:
            out = {k: d[k] for k in names if k in d}
            out["in_dtypes"] = tuple(out["in_dtypes"])
            if "shape" in out:
                out["shape"] = tuple(out["shape"])
            if "shapes" in out:
                out["shapes"] = [tuple(x) for x in out["shapes"]]
            return out

        site_names = SiteSummary.__dataclass_fields__
        record_names = Record.__dataclass_fields__
        return cls(
            [SiteSummary(**fields(s, site_names)) for s in data["sites"]],
            [Record(**fields(r, record_names)) for r in data["records"]],
            data.get("dropped", 0),
            data.get("rank"),
        )

    def to_json(self, records: bool = False) -> str:
        """JSON text (``inf`` errors written as the string ``"inf"``); raw records only if ``records``."""
        data = self.to_dict()
        if not records:
            data.pop("records")
        for s in data["sites"]:
            e = s["max_rel_error"]
            if e is not None and not math.isfinite(e):
                s["max_rel_error"] = str(e)
        return json.dumps(data, indent=2)

    def format(self, limit: int | None = None, relative_to: str | None = None) -> str:
        """A table, most frequent site first: count, kind, op, dtypes, max relative error, site."""
        base = os.path.abspath(relative_to or os.getcwd())
        ranks = sorted({r for s in self.sites for r in s.ranks})
        head = f"{len(self.sites)} sites, {self.total} events"
        if ranks:
            head += f", ranks {_ranges(ranks)}"
        if self.dropped:
            head += f" ({self.dropped} records beyond the cap kept only in the site counts)"
        lines = [head, f"{'count':>6}  {'kind':<10}  {'op':<22}  {'dtypes':<16}  {'max rel err':>11}  site"]
        for s in self.sites[:limit]:
            err = "-" if s.max_rel_error is None else f"{s.max_rel_error:.3g}"
            where = f"{_short_path(s.file, base)}:{s.line} in {s.function}"
            extra = [s.context] if s.context else []
            if s.ranks and len(ranks) > 1:
                extra.append(f"ranks {_ranges(s.ranks)}")
            tail = f"  [{'; '.join(extra)}]" if extra else ""
            lines.append(f"{s.count:>6}  {s.kind:<10}  {s.op:<22}  {s.dtypes:<16}  {err:>11}  {where}{tail}")
        if limit is not None and len(self.sites) > limit:
            lines.append(f"... {len(self.sites) - limit} more sites")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format()


def _sorted(sites: Iterable[SiteSummary]) -> list[SiteSummary]:
    return sorted(sites, key=lambda s: (-s.count, s.file, s.line, s.op, s.dtypes, s.context))


def _short_path(path: str, base: str) -> str:
    if path.startswith(base + os.sep):
        return os.path.relpath(path, base)
    return path


def _ranges(ranks: list[int]) -> str:
    parts, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            parts.append(str(start) if start == r else f"{start}-{r}")
            start = None
    return ",".join(parts)
