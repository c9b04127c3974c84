"""`BlameReport`: the ranked sites of a blamed run, the promotions' end-to-end effects, a table, JSON, a figure."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from simdist.attribution.measure import SiteErrors
from simdist.errors import UsageError
from simdist.numerics.compare import difference


@dataclass
class Movement:
    """How far a promoted run's tensors of one category (parameters, optimizer state, loss) moved."""

    tensors: int = 0
    differing: int = 0
    max_abs: float = 0.0
    max_relative: float = 0.0
    max_ulp: int = 0
    norm_relative: float = 0.0

    @classmethod
    def between(cls, base: dict[str, torch.Tensor], other: dict[str, torch.Tensor]) -> Movement:
        """Compare same-named tensors (``other`` cast to ``base``'s dtype); a name missing on one side is an error."""
        if set(base) != set(other):
            missing = sorted(set(base) ^ set(other))
            raise UsageError(f"the promoted run's final state has other tensors than the base run's: {missing[:4]}")
        moved = cls(tensors=len(base))
        err2 = ref2 = 0.0
        for name, b in base.items():
            o = other[name]
            if o.shape != b.shape:
                raise UsageError(f"{name}: shape {tuple(o.shape)} in the promoted run, {tuple(b.shape)} in the base")
            d = difference(o, b)
            moved.differing += d.differing > 0
            moved.max_relative = max(moved.max_relative, d.max_relative)
            moved.max_ulp = max(moved.max_ulp, d.max_ulp)
            if b.numel():
                gap = (o.detach().double() - b.detach().double()).abs()
                moved.max_abs = max(moved.max_abs, float(torch.nan_to_num(gap, nan=0.0).max()))
            err2 += d.error_norm**2
            ref2 += d.reference_norm**2
        moved.norm_relative = math.sqrt(err2 / ref2) if ref2 else (0.0 if err2 == 0 else math.inf)
        return moved


@dataclass
class Promotion:
    """One counterfactual rerun: the promoted sites and how far the final state moved from the base run."""

    sites: list[int]  # ids in the base report's table
    label: str
    events: int  # promoted events (collective outputs and out-of-place casts) in the rerun
    unpromotable: list[int]  # ids of promoted sites that are in-place casts (computed as usual)
    movement: dict[str, Movement] = field(default_factory=dict)
    unpromotable_why: str = ""
    failed: str | None = None  # why the rerun raised (the program could not go on with the site wide)
    state: dict = field(default_factory=dict, repr=False)  # the rerun's final state (category -> name -> tensor)

    @property
    def effect(self) -> tuple[float, ...]:
        """The sort key: normwise relative movement of parameters, then optimizer state, loss, results."""
        return tuple(self.movement[c].norm_relative if c in self.movement else 0.0 for c in CATEGORIES)


CATEGORIES = ("parameters", "optimizer state", "loss", "results", "scaled loss")
"""What a promotion compares: the optimizers' parameters and state, the last loss per rank (the last
``backward()`` root; where a ``torch.amp.GradScaler`` scaled it, the unscaled loss it was given, and the root
under "scaled loss", whose movement includes the scaler's own changes of scale), and the floating tensors the
rank function returned (`simdist.attribution.blame`; none for a script)."""


def _number(x: float) -> float | str:
    """``x``, or its name (``"inf"``, ``"nan"``) where JSON has no number for it."""
    return x if math.isfinite(x) else str(x)


def _short(path: str, base: str) -> str:
    return os.path.relpath(path, base) if path.startswith(base + os.sep) else path


def _ranks(ranks) -> str:
    ranks = sorted(r for r in ranks if r is not None)
    if not ranks:
        return "-"
    if ranks == list(range(ranks[0], ranks[-1] + 1)) and len(ranks) > 1:
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))


def _error_axis(ax, values: list[float]) -> None:
    """A log axis for errors (symlog where some are zero) whose ticks are labelled also within one decade.

    A log axis labels only powers of ten: errors that stay within a decade (the common case: one rounding per
    step) got a panel without y labels. Then three ticks (the smallest, the geometric middle and the largest
    positive value, and 0 where present) are placed and labelled explicitly.
    """
    import numpy as np
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    finite = [v for v in values if math.isfinite(v)]
    positive = [v for v in finite if v > 0]
    lo, hi = (min(positive), max(positive)) if positive else (1e-9, 1e-9)
    if len(positive) < len(finite):
        ax.set_yscale("symlog", linthresh=lo)
    else:
        ax.set_yscale("log")
    if hi / lo >= 100:
        return  # the axis spans two decades or more: its own labelled powers of ten read well
    ticks = sorted({lo, float(np.sqrt(lo * hi)), hi} | ({0.0} if len(positive) < len(finite) else set()))
    if hi == lo:
        ax.set_ylim(lo / 2 if len(positive) == len(finite) else -lo / 2, hi * 2)
    ax.yaxis.set_major_locator(FixedLocator(ticks))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:.3g}"))
    ax.yaxis.set_minor_locator(NullLocator())


def _nonfinite(e) -> str:
    """The inf/nan cell: the site's non-finite results, marked ``!`` when some had a finite exact value."""
    return f"{e.nonfinite}!" if e.overflow else str(e.nonfinite)


@dataclass
class BlameReport:
    """Sites ranked by error mass (largest first; ids are 1-based positions), the final state, promotions."""

    sites: list[SiteErrors]
    state: dict[str, dict[str, torch.Tensor]]
    results: Any = None
    promotions: list[Promotion] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # how the promotions' figures were taken (local shards)

    @property
    def total_mass(self) -> float:
        return sum(s.errors.mass for s in self.sites)

    def share(self, site: SiteErrors) -> float:
        total = self.total_mass
        return site.errors.mass / total if total else 0.0

    def site(self, ident: int) -> SiteErrors:
        if not 1 <= ident <= len(self.sites):
            ids = f"ids 1-{len(self.sites)}" if self.sites else "no sites"
            raise UsageError(f"site id {ident} is not in the table ({ids})")
        return self.sites[ident - 1]

    def where(self, site: SiteErrors, base: str | None = None) -> str:
        return f"{_short(site.file, os.path.abspath(base or os.getcwd()))}:{site.line} in {site.function}"

    # -- output ---------------------------------------------------------------------------

    def ranked_promotions(self) -> list[Promotion]:
        """Promotions by end-to-end effect, largest first; failed and unpromotable ones last."""
        return sorted(self.promotions, key=lambda p: (p.failed is None and p.events > 0, p.effect), reverse=True)

    def to_dict(self) -> dict:
        """Plain, JSON-able data: every site with its figures and per-step errors, every promotion."""
        number = _number
        sites = [self._site_dict(i, s) for i, s in enumerate(self.sites, 1)]
        promotions = [
            {
                "sites": p.sites,
                "label": p.label,
                "events": p.events,
                "unpromotable": p.unpromotable,
                "unpromotable_why": p.unpromotable_why,
                "movement": {c: {k: number(v) for k, v in m.__dict__.items()} for c, m in p.movement.items()},
                "failed": p.failed,
            }
            for p in self.ranked_promotions()
        ]
        return {
            "total_error_mass": number(self.total_mass),
            "sites": sites,
            "promotions": promotions,
            "notes": self.notes,
        }

    def _site_dict(self, i: int, s: SiteErrors) -> dict:
        """Site number ``i`` (from 1, in ranking order) as plain data: its figures, per rank and per step."""
        number, e = _number, s.errors
        return {
            "id": i,
            "file": s.file,
            "line": s.line,
            "function": s.function,
            "kind": s.kind,
            "op": s.op,
            "dtypes": s.dtypes,
            "groups": sorted(s.groups),
            "ranks": sorted(r for r in s.ranks if r is not None),
            "by_rank": {
                str(r): {
                    "elements": v.elements,
                    "max_ulp": number(v.max_ulp),
                    "max_err_over_sum_abs_terms": number(v.max_term_relative),
                    "error_mass": number(v.mass),
                    "overflow": v.overflow,
                }
                for r, v in sorted(s.by_rank.items(), key=lambda kv: -1 if kv[0] is None else kv[0])
            },
            "calls": s.calls,
            "elements": e.elements,
            "nonfinite": e.nonfinite,
            "overflow": e.overflow,
            "max_ulp": number(e.max_ulp),
            "max_err_over_sum_abs_terms": number(e.max_term_relative),
            "max_rel_err": number(e.max_relative),
            "error_mass": number(e.mass),
            "share": number(self.share(s)),
            "steps": {
                str(k): {
                    "max_err_over_sum_abs_terms": number(v.max_term_relative),
                    "error_mass": number(v.mass),
                }
                for k, v in sorted(s.steps.items())
            },
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def format(self, limit: int | None = None, base: str | None = None) -> str:
        """The ranked table, then the promotions ordered by their end-to-end effect."""
        nonfinite = any(s.errors.nonfinite for s in self.sites)
        lines = [
            f"{len(self.sites)} sites; error mass = sum over elements of |result - exact| / sum|terms| "
            f"(total {self.total_mass:.4g})"
        ]
        if nonfinite:
            overflowing = sum(1 for s in self.sites if s.errors.overflow)
            lines.append(
                f"inf/nan: non-finite results, not in the error mass; '!' where the exact value was finite "
                f"(overflow: {overflowing} site(s), ranked first)"
            )
        column = f" {'inf/nan':>7}" if nonfinite else ""
        lines.append(
            f"{'id':>3} {'share':>6}  {'kind':<10} {'op':<22} {'dtypes':<10} {'calls':>6} {'elements':>9} "
            f"{'max ulp':>8} {'err/sum|t|':>10} {'max rel':>9}{column}  site"
        )
        for i, s in enumerate(self.sites[:limit], 1):
            e = s.errors
            extra = [f"groups {' '.join(sorted(s.groups))}"] if s.groups else []
            extra.append(f"ranks {_ranks(s.ranks)}")
            cell = f" {_nonfinite(e):>7}" if nonfinite else ""
            lines.append(
                f"{i:>3} {100 * self.share(s):>5.1f}%  {s.kind:<10} {s.op:<22} {s.dtypes:<10} {s.calls:>6} "
                f"{e.elements:>9} {e.max_ulp:>8.3g} {e.max_term_relative:>10.3g} {e.max_relative:>9.3g}{cell}  "
                f"{self.where(s, base)}  [{'; '.join(extra)}]"
            )
        if limit is not None and len(self.sites) > limit:
            lines.append(f"... {len(self.sites) - limit} more sites")
        if self.promotions:
            lines.append("")
            lines.append("promotions (the site exact: a collective's FP64 sum rounded once; a cast not narrowed),")
            lines.append("final state moved vs the unpromoted run, largest end-to-end effect first:")
            lines += [f"({note})" for note in self.notes]
            lines.append(
                f"{'promoted':<34} {'category':<16} {'differ':>7} {'max abs':>9} {'max rel':>9} "
                f"{'max ulp':>9} {'norm rel':>9}"
            )
            for p in self.ranked_promotions():
                head = p.label
                if p.failed:
                    lines.append(f"{head:<34} rerun failed with the site wide: {p.failed}")
                    continue
                if p.unpromotable and not p.events:
                    lines.append(f"{head:<34} not promotable: {p.unpromotable_why}")
                    continue
                compared = [c for c in CATEGORIES if c in p.movement and p.movement[c].tensors]
                if not compared:
                    lines.append(f"{head:<34} nothing to compare: no optimizer, no backward(), no tensor results")
                for j, c in enumerate(compared):
                    m = p.movement[c]
                    lines.append(
                        f"{head if j == 0 else '':<34} {c:<16} {m.differing:>3}/{m.tensors:<3} {m.max_abs:>9.3g} "
                        f"{m.max_relative:>9.3g} {m.max_ulp:>9} {m.norm_relative:>9.3g}"
                    )
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format()

    def figure(self, top: int = 8):
        """A matplotlib figure: each site's share of the error mass (bars), and max err/sum|terms| per step."""
        from matplotlib.figure import Figure

        shown = self.sites[:top]
        fig = Figure(figsize=(11, 0.45 * max(len(shown), 4) + 1.5))
        ax_share, ax_steps = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1, 1.2]})
        labels = [f"#{i} {os.path.basename(s.file)}:{s.line} {s.op} {s.dtypes}" for i, s in enumerate(shown, 1)]
        ax_share.barh(range(len(shown)), [100 * self.share(s) for s in shown], color="tab:red")
        ax_share.set_yticks(range(len(shown)), labels, fontsize=8)
        ax_share.invert_yaxis()
        ax_share.set_xlabel("share of the run's error mass (%)")
        ax_share.set_title("error per site")
        plotted: list[float] = []
        for i, s in enumerate(shown, 1):
            steps = sorted(s.steps)
            values = [s.steps[k].max_term_relative for k in steps]
            plotted += values
            ax_steps.plot(steps, values, marker="o", markersize=3, label=f"#{i}")
        _error_axis(ax_steps, plotted)
        ax_steps.set_xlabel("optimizer step")
        ax_steps.set_ylabel("max |result - exact| / sum|terms|")
        ax_steps.set_title("error vs step")
        if shown:
            ax_steps.legend(fontsize=8, ncol=2)
        fig.tight_layout()
        return fig
