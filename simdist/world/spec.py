"""Parallel layouts: one `ParallelSpec` and the group tables derived from it.

A spec names the sizes of a job (world, tensor-, expert-, expert-tensor- and
pipeline-parallel); every group table (tp, dp, ep, etp, edp, pp) is a pure
function of it, so there is one source of truth for "who reduces with whom".

The default layout is DeepSpeed's AutoEP+AutoTP folding layout as the #8913
report describes it: within each pipeline stage, TP groups are contiguous
blocks, dense-DP groups are strided by ``tp``, EP groups are contiguous blocks
(of ``ep`` ranks, or ``ep * etp`` ranks strided by ``etp`` when ``etp > 1``) and
EDP groups are strided across EP groups. On four ranks with TP2/EP2/ETP1::

    tp  {0,1} {2,3}    dp  {0,2} {1,3}
    ep  {0,1} {2,3}    edp {0,2} {1,3}

A DeepSpeed pull-request branch of the folding work (2da665b) lays EP groups
over the TP-lane-major rank order instead (so an EP group spans TP lanes:
TP2/EP2 gives ep {0,2} {1,3}); ``ep_layout="tp_lane_major"`` selects that
layout. Both are derived here, neither is a copy.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from functools import cached_property
from typing import Literal

from simdist.errors import UsageError


class GroupKind(enum.StrEnum):
    """The kinds of process group. Members compare equal to their strings (``GroupKind.TP == "tp"``), so code
    that passes ``"tp"`` keeps working; ``WORLD`` is every rank, ``GROUP`` any group that is no spec kind."""

    TP = "tp"
    DP = "dp"
    EP = "ep"
    ETP = "etp"
    EDP = "edp"
    PP = "pp"
    WORLD = "world"
    GROUP = "group"


GROUP_KINDS: tuple[GroupKind, ...] = tuple(k for k in GroupKind if k not in (GroupKind.WORLD, GroupKind.GROUP))
"""Every group kind a spec defines. ``dp`` is the dense data-parallel group."""

EpLayout = Literal["contiguous", "tp_lane_major"]
EP_LAYOUTS: tuple[str, ...] = ("contiguous", "tp_lane_major")

GroupTable = tuple[tuple[int, ...], ...]


def _divisors(value: int) -> list[int]:
    return [d for d in range(1, value + 1) if value % d == 0]


def _require_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UsageError(f"{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class ParallelSpec:
    """Sizes of a parallel job; everything else is derived.

    ``dp = stage / tp`` and ``edp = stage / (ep * etp)`` where
    ``stage = world_size / pp``. Every size but ``world_size`` defaults to 1 (no
    such parallelism): ``ParallelSpec(8, tp=2)`` is TP2 x DP4 with no experts split.
    Invalid combinations raise ``ValueError`` naming the broken constraint and
    the values that would be valid.
    """

    world_size: int
    tp: int = 1
    ep: int = 1
    etp: int = 1
    pp: int = 1
    ep_layout: EpLayout = "contiguous"

    def __post_init__(self) -> None:
        for name in ("world_size", "tp", "ep", "etp", "pp"):
            _require_positive_int(name, getattr(self, name))
        if self.ep_layout not in EP_LAYOUTS:
            raise UsageError(f"ep_layout={self.ep_layout!r} is unknown; valid: {', '.join(EP_LAYOUTS)}")
        if self.world_size % self.pp:
            raise UsageError(
                f"pp={self.pp} must divide world_size={self.world_size}; valid pp values: {_divisors(self.world_size)}"
            )
        stage = self.world_size // self.pp
        if stage % self.tp:
            raise UsageError(
                f"tp={self.tp} must divide the stage size (world_size {self.world_size} / pp {self.pp} = {stage}) "
                f"so that dp is an integer; valid tp values: {_divisors(stage)}"
            )
        if stage % (self.ep * self.etp):
            valid = [d for d in _divisors(stage) if d % self.etp == 0]
            raise UsageError(
                f"ep*etp={self.ep}*{self.etp}={self.ep * self.etp} must divide the stage size "
                f"(world_size {self.world_size} / pp {self.pp} = {stage}) so that edp is an integer; "
                f"valid ep*etp values: {valid}"
            )

    # -- derived sizes -------------------------------------------------------

    @property
    def stage_size(self) -> int:
        """Ranks per pipeline stage."""
        return self.world_size // self.pp

    @property
    def dp(self) -> int:
        """Dense data-parallel size: ``stage / tp``."""
        return self.stage_size // self.tp

    @property
    def edp(self) -> int:
        """Expert data-parallel size: ``stage / (ep * etp)``."""
        return self.stage_size // (self.ep * self.etp)

    def size(self, kind: str) -> int:
        """Size of one group of ``kind``."""
        return len(self.groups(kind)[0])

    # -- group tables --------------------------------------------------------

    @cached_property
    def _tables(self) -> dict[str, GroupTable]:
        tables: dict[str, list[tuple[int, ...]]] = {kind: [] for kind in GROUP_KINDS}
        stage, tp, ep, etp = self.stage_size, self.tp, self.ep, self.etp
        for start in range(0, self.world_size, stage):
            ranks = list(range(start, start + stage))
            tables["tp"] += [tuple(ranks[i : i + tp]) for i in range(0, stage, tp)]
            tables["dp"] += [tuple(ranks[lane::tp]) for lane in range(tp)]
            if self.ep_layout == "tp_lane_major" and tp > 1:
                order = [r for lane in range(tp) for r in ranks[lane::tp]]
            else:
                order = ranks
            width = ep * etp
            blocks = [order[i : i + width] for i in range(0, stage, width)]
            tables["etp"] += [tuple(b[i : i + etp]) for b in blocks for i in range(0, width, etp)]
            tables["ep"] += [tuple(b[j::etp]) for b in blocks for j in range(etp)]
            tables["edp"] += [tuple(b[p] for b in blocks) for p in range(width)]
        per_stage = self.stage_size
        tables["pp"] = [tuple(range(i, self.world_size, per_stage)) for i in range(per_stage)]
        # Group-rank order is ascending global rank, as torch.distributed.new_group orders its ranks.
        return {kind: tuple(sorted(tuple(sorted(g)) for g in groups)) for kind, groups in tables.items()}

    def groups(self, kind: str) -> GroupTable:
        """All groups of ``kind``, each a tuple of global ranks in group-rank (ascending) order."""
        try:
            return self._tables[kind]
        except KeyError:
            raise UsageError(f"unknown group kind {kind!r}; valid: {', '.join(GROUP_KINDS)}") from None

    def group_of(self, kind: str, rank: int) -> tuple[int, ...]:
        """The group of ``kind`` that holds global ``rank``."""
        if not 0 <= rank < self.world_size:
            raise UsageError(f"rank {rank} is outside 0..{self.world_size - 1}")
        return next(g for g in self.groups(kind) if rank in g)

    def describe(self) -> str:
        """A short name such as ``TP2/EP2/ETP1 on 4 ranks``."""
        parts = f"TP{self.tp}/DP{self.dp}/EP{self.ep}/ETP{self.etp}/EDP{self.edp}"
        if self.pp > 1:
            parts += f"/PP{self.pp}"
        return f"{parts} on {self.world_size} ranks"


DEFAULT_SPEC = ParallelSpec(4, tp=2, ep=2)
"""TP2/EP2/ETP1 on 4 ranks: the layout of DeepSpeed #8913 and every study's default."""
