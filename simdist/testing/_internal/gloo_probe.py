"""Corner cases that pin the `Gloo` reduction to real gloo, and a rank program that runs them anywhere.

A `Case` is plain data: a collective (``all_reduce``, ``reduce``, list
``reduce_scatter`` or ``reduce_scatter_tensor``), a group as given to
``dist.new_group`` (possibly unsorted), a ``dist.ReduceOp`` name, a tensor
layout, and every global rank's input. `run_cases` is an ordinary
``torch.distributed`` rank program: run it on real gloo processes
(``simdist.run(where="gloo")``) and on the simdist backend
(`simdist.run`, thread ranks) and compare the per-rank `Outcome` lists with
`compare`; `reduction_outcomes` gives the same lists straight from the `Gloo`
reduction, without any backend. ``experiments/gloo_corners.py`` prints the table;
``tests/integration/test_gloo_corners.py`` asserts it.

Outcomes hold raw bits (`bits`), so NaN payloads and signed zeros compare
exactly. A case that the reduction refuses (a strided view: gloo would reduce
memory outside it) is expected to raise ``ValueError`` under simdist.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from simdist.errors import UsageError
from simdist.reduce.base import ReduceOp
from simdist.reduce.gloo import Gloo

KINDS = ("all_reduce", "reduce", "reduce_scatter", "reduce_scatter_tensor")
LAYOUTS = ("contiguous", "transposed", "strided")
_BITWISE = {"BAND": torch.bitwise_and, "BOR": torch.bitwise_or, "BXOR": torch.bitwise_xor}


@dataclass(frozen=True)
class Case:
    """One collective call on every member of ``group``.

    ``inputs[r]`` is global rank ``r``'s input: a tensor for ``all_reduce`` and
    ``reduce``; ``[n, *shape]`` (its list) for ``reduce_scatter``; a 1-d tensor
    for ``reduce_scatter_tensor``. ``layout``: ``transposed`` hands the
    collective ``x.t()`` of a contiguous ``x`` holding ``inputs[r].t()`` (a dense
    permuted tensor; 2-d inputs); ``strided`` hands it ``base[:, ::2]`` of a
    ``[a, 2b]`` base whose odd columns hold ``-inputs[r]`` (a view with gaps).
    ``root`` is the global destination rank of ``reduce``.
    """

    name: str
    kind: str
    op: str
    inputs: torch.Tensor
    group: tuple[int, ...] | None = None
    root: int | None = None
    layout: str = "contiguous"
    tags: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise UsageError(f"kind must be one of {KINDS}, got {self.kind!r}")
        if self.layout not in LAYOUTS:
            raise UsageError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")
        if self.layout != "contiguous" and (
            self.kind not in ("all_reduce", "reduce_scatter_tensor") or self.inputs.dim() != 3
        ):
            raise UsageError(
                "layouts other than contiguous are probed with all_reduce and reduce_scatter_tensor on 2-d inputs"
            )

    def members(self, world_size: int) -> list[int]:
        """The group's global ranks in group-rank order (torch sorts them)."""
        return sorted(self.group) if self.group is not None else list(range(world_size))


@dataclass(frozen=True)
class Outcome:
    """What one rank saw: ``tensor`` (its output; for ``strided`` the whole base) and/or an error's type and
    text (with the tensor as the failed all_reduce left it, where that is recorded)."""

    tensor: torch.Tensor | None = None
    error: str | None = None
    message: str = ""

    def describe(self) -> str:
        if self.error is not None:
            return f"{self.error}: {self.message[:60]}"
        assert self.tensor is not None, "an outcome without an error holds the tensor"
        return f"{self.tensor.dtype} {tuple(self.tensor.shape)}"


def bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's storage bytes in index order (``uint8``): NaN payloads, complex parts and bool bytes (gloo
    leaves e.g. 3 in a bool tensor, which ``torch.equal`` on bools would call equal to 1) compare exactly."""
    t = t.detach()
    if t.dtype == torch.bool:
        t = t.view(torch.uint8)  # before any copy: copying a bool tensor writes 0/1
    return t.contiguous().reshape(-1).view(torch.uint8)


def _torch_op(name: str):
    import torch.distributed as dist

    if name.startswith("PREMUL_SUM"):
        return dist._make_nccl_premul_sum(float(name.partition(":")[2] or 0.5))
    return getattr(dist.ReduceOp, name)


def _layout_input(x: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(the tensor the collective gets, the tensor whose bits are the outcome)``."""
    if layout == "transposed":
        t = x.t().contiguous().t()
        return t, t
    if layout == "strided":
        base = torch.stack([x, -x], dim=2).reshape(x.shape[0], 2 * x.shape[1])
        return base[:, ::2], base
    x = x.clone()
    return x, x


def run_cases(rank: int, cases: Sequence[Case]) -> list[Outcome | None]:
    """Rank program (plain ``torch.distributed``, default group initialised): every case, in order.

    Returns one `Outcome` per case (``None`` where this rank is not a member).
    Every member of a group is created on every rank in the same order, as
    ``new_group`` requires. An error is recorded and the next case runs; the
    backends raise these errors on every member, so no rank is left waiting.
    """
    import torch.distributed as dist

    world = dist.get_world_size()
    groups = {}
    for case in cases:
        if case.group is not None and case.group not in groups:
            groups[case.group] = dist.new_group(list(case.group))
    out: list[Outcome | None] = []
    for case in cases:
        seen = None
        if rank not in case.members(world):
            out.append(None)
            continue
        pg = groups.get(case.group) if case.group is not None else None
        op = _torch_op(case.op)
        x = case.inputs[rank]
        try:
            if case.kind == "all_reduce":
                t, seen = _layout_input(x, case.layout)
                dist.all_reduce(t, op, group=pg)  # on an error, ``seen`` shows what it left in the tensor
            elif case.kind == "reduce":
                seen = x.clone()
                dist.reduce(seen, dst=case.root, op=op, group=pg)
            elif case.kind == "reduce_scatter":
                seen = torch.empty_like(x[0])
                dist.reduce_scatter(seen, [t.clone() for t in x], op=op, group=pg)
            else:
                n = len(case.members(world))
                t, _ = _layout_input(x, case.layout)
                seen = torch.empty((x.shape[0] // n, *x.shape[1:]), dtype=x.dtype)
                dist.reduce_scatter_tensor(seen, t, op=op, group=pg)
            out.append(Outcome(seen))
        except Exception as exc:
            kept = seen if case.kind == "all_reduce" and case.layout == "contiguous" else None
            out.append(Outcome(kept, type(exc).__name__, str(exc).splitlines()[0]))
    return out


def reduction_outcomes(
    cases: Sequence[Case], world_size: int, reduction: Gloo | None = None
) -> list[list[Outcome | None]]:
    """Per global rank, what the `Gloo` reduction says each case leaves there (same shape as `run_cases` results)."""
    reduction = reduction or Gloo()
    per_rank: list[list[Outcome | None]] = [[] for _ in range(world_size)]
    for case in cases:
        members = case.members(world_size)
        got = _reduction_case(reduction, case, members)
        for r in range(world_size):
            per_rank[r].append(got.get(r) if r in members else None)
    return per_rank


def _reduction_case(reduction: Gloo, case: Case, members: list[int]) -> dict[int, Outcome]:
    refused = None  # torch's gloo backend raises these at the call, leaving the tensors alone
    if case.op.startswith("PREMUL_SUM"):
        refused = "Cannot use ReduceOp.PREMUL_SUM with Gloo"
    elif case.op in _BITWISE and case.inputs.is_floating_point():
        refused = f"Cannot use ReduceOp.{case.op} with non-integral dtype"
    if refused is not None:
        untouched = case.kind == "all_reduce" and case.layout == "contiguous"
        return {r: Outcome(case.inputs[r] if untouched else None, "RuntimeError", refused) for r in members}
    if case.op in _BITWISE:
        return dict.fromkeys(members, Outcome(functools.reduce(_BITWISE[case.op], [case.inputs[r] for r in members])))
    op = ReduceOp[case.op]
    try:
        if case.kind == "all_reduce":
            seen = [_layout_input(case.inputs[r], case.layout)[0] for r in members]
            if case.inputs.is_complex():  # torch's Python layer: refuse MAX/MIN/PRODUCT, else reduce the real view
                if op not in (ReduceOp.SUM, ReduceOp.AVG):  # before the call: the tensors stay as they were
                    kept = case.layout == "contiguous"
                    message = f"all_reduce does not support {op.name} on complex tensors"
                    return {r: Outcome(case.inputs[r] if kept else None, "ValueError", message) for r in members}
                result = torch.view_as_complex(reduction.reduce([torch.view_as_real(t) for t in seen], op))
            else:
                result = reduction.reduce(seen, op)
            return {r: Outcome(result) for r in members}
        if case.kind == "reduce":
            assert case.root is not None, "a reduce case names its root"
            buffers = reduction.reduce_buffers([case.inputs[r] for r in members], op, members.index(case.root))
            return {r: Outcome(b) for r, b in zip(members, buffers, strict=True)}
        if case.kind == "reduce_scatter":
            block_lists = reduction.reduce_scatter_list([list(case.inputs[r]) for r in members], op)
            return {r: Outcome(block_lists[i]) for i, r in enumerate(members)}
        blocks = reduction.reduce_scatter([_layout_input(case.inputs[r], case.layout)[0] for r in members], op)
        shape = (case.inputs.shape[1] // len(members), *case.inputs.shape[2:])
        return {r: Outcome(blocks[i].view(shape)) for i, r in enumerate(members)}
    except (ValueError, RuntimeError) as exc:
        recorded = case.kind == "all_reduce" and case.layout == "contiguous"  # as `run_cases` records it
        written = getattr(exc, "written", None) if recorded else None
        return dict.fromkeys(members, Outcome(written, type(exc).__name__, str(exc).splitlines()[0]))


def agree(real: Outcome | None, modelled: Outcome | None) -> bool:
    """The same error type (or none) and the same tensor bits and shape (or no tensor on both sides)."""
    if real is None or modelled is None:
        return real is modelled
    if real.error != modelled.error:
        return False
    a, b = real.tensor, modelled.tensor
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


@dataclass(frozen=True)
class Row:
    """One case of the comparison table: the verdict and what each side saw on the first rank that differs."""

    case: Case
    verdict: str  # "bitwise equal", "same error", "refused", "DIFFERENT"
    real: str
    modelled: str


def compare(cases: Sequence[Case], real: Sequence[Sequence[Outcome | None]], modelled) -> list[Row]:
    """Case by case: does every rank's modelled outcome agree with the real one?

    A case that real gloo runs but the reduction refuses with ``ValueError`` (a
    strided view) is ``refused``; it is ``DIFFERENT`` only if nothing else holds.
    """
    rows = []
    for i, case in enumerate(cases):
        pairs = [(r[i], m[i]) for r, m in zip(real, modelled, strict=True) if r[i] is not None or m[i] is not None]
        bad = [(r, m) for r, m in pairs if not agree(r, m)]
        first_r, first_m = (bad or pairs)[0]
        if not bad:
            # (both None never pairs; one None alone disagrees: an agreeing pair holds two outcomes)
            verdict = "same error" if first_r is not None and first_r.error else "bitwise equal"
        elif all(r is not None and r.error is None and m is not None and m.error == "ValueError" for r, m in bad):
            verdict = "refused"
        else:
            verdict = "DIFFERENT"
        rows.append(Row(case, verdict, first_r.describe() if first_r else "-", first_m.describe() if first_m else "-"))
    return rows


# -- the corner cases ------------------------------------------------------------------

_ONE = {torch.float64: 0x3FF0000000000000, torch.float32: 0x3F800000, torch.bfloat16: 0x3F80, torch.float16: 0x3C00}
_SIGN = {torch.float64: 1 << 63, torch.float32: 1 << 31, torch.bfloat16: 1 << 15, torch.float16: 1 << 15}
_INF = {torch.float64: 0x7FF0000000000000, torch.float32: 0x7F800000, torch.bfloat16: 0x7F80, torch.float16: 0x7C00}
_NANS = {  # quiet and signalling NaNs of both signs with payloads (unsigned bit patterns)
    torch.float64: (0x7FF8000000000000, 0xFFF8000000000000, 0x7FF8000000000001, 0xFFF9000000000ABC, 0x7FF0000000000001),
    torch.float32: (0x7FC00000, 0xFFC00000, 0x7FC00001, 0xFFC12345, 0x7F800001, 0xFF800002),
    torch.bfloat16: (0x7FC0, 0xFFC0, 0x7FC1, 0xFFD5, 0x7F81, 0xFF82),
    torch.float16: (0x7E00, 0xFE00, 0x7E01, 0xFE55, 0x7C01, 0xFC02),
}


def from_bits(columns: Sequence[Sequence[int]], dtype: torch.dtype) -> torch.Tensor:
    """``[n, E]`` tensor of ``dtype`` from ``E`` columns of ``n`` unsigned bit patterns."""
    width = 8 * torch.empty(0, dtype=dtype).element_size()
    signed = [[v - (1 << width) if v >= 1 << (width - 1) else v for v in col] for col in columns]
    int_t = {16: torch.int16, 32: torch.int32, 64: torch.int64}[width]
    return torch.tensor(signed, dtype=torch.int64).t().contiguous().to(int_t).view(dtype)


def special_columns(n: int, dtype: torch.dtype) -> list[list[int]]:
    """Element columns over ``n`` ranks: one NaN at each position, pairs of different NaNs in both orders,
    all NaN, a lone ``+0`` among ``-0`` (and the reverse), ``+inf`` and ``-inf`` at each pair of positions."""
    one, sign, inf, nans = _ONE[dtype], _SIGN[dtype], _INF[dtype], _NANS[dtype]
    cols = []
    for nan in nans:
        cols += [[nan if r == p else one for r in range(n)] for p in range(n)]
    for a, b in itertools.combinations(nans[:4], 2):
        cols += [
            [a if r == p else b if r == q else one for r in range(n)] for p, q in itertools.permutations(range(n), 2)
        ]
    cols.append([nans[r % len(nans)] for r in range(n)])
    for p in range(n):
        cols.append([0 if r == p else sign for r in range(n)])
        cols.append([sign if r == p else 0 for r in range(n)])
    cols += [
        [inf if r == p else inf | sign if r == q else one for r in range(n)]
        for p, q in itertools.permutations(range(n), 2)
    ]
    return cols


def spread(per_member: torch.Tensor, members: Sequence[int], world_size: int) -> torch.Tensor:
    """``[world_size, ...]`` inputs with ``per_member[i]`` on global rank ``members[i]`` (zeros elsewhere)."""
    out = torch.zeros((world_size, *per_member.shape[1:]), dtype=per_member.dtype)
    out[list(members)] = per_member
    return out


def corner_cases(world_size: int = 4) -> list[Case]:
    """The fixed corner set for ``world_size`` (>= 4) ranks: special values, every op and dtype, 1- to
    ``world_size``-rank groups given unsorted, reduce to every root, list and tensor reduce_scatter, layouts."""
    if world_size < 4:
        raise UsageError(f"the corner set needs at least 4 ranks, got {world_size}")
    groups = [None, (1, 2), (3, 0, 1), (2,)]  # the world, 2 ranks, 3 ranks given unsorted, 1 rank
    gen = torch.Generator().manual_seed(12)  # drawn from by the reductions, then the layouts, in that order
    return [
        *_special_cases(world_size, groups),
        *_integer_and_refused_cases(world_size),
        *_reduction_cases(world_size, groups[:3], gen),
        *_layout_cases(world_size, gen),
    ]


_FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _special_cases(w: int, groups: list) -> list[Case]:
    """Special values (zeros of both signs, infinities, NaN payloads, extremes) all-reduced by every op, in
    every float dtype, on every group."""
    cases = []
    for group in groups:
        members = sorted(group) if group else list(range(w))
        n = len(members)
        for dtype in _FLOATS:
            x = spread(from_bits(special_columns(n, dtype), dtype), members, w)
            for op in ("SUM", "PRODUCT", "MAX", "MIN", "AVG"):
                cases.append(
                    Case(f"specials n={n} {_short(dtype)} {op}", "all_reduce", op, x, group, tags=("specials",))
                )
    return cases


def _integer_and_refused_cases(w: int) -> list[Case]:
    """Integer and bool all-reduces by every op (wrap-around, bitwise ops), then the float ops gloo refuses."""
    cases = []
    ints = torch.tensor(
        [[100, 7, -3, 64, 127, -128], [100, 9, 5, 64, 1, -1], [100, 11, 7, 64, 1, 1], [100, 13, 9, 64, 0, 2]]
    )
    ints = torch.cat([ints, ints.flip(0)] * (w // 4 + 1))[:w]
    for dtype in (torch.int8, torch.uint8, torch.int32, torch.int64, torch.bool):
        for op in ("SUM", "PRODUCT", "MAX", "MIN", "AVG", "BAND", "BXOR", "PREMUL_SUM:0.5"):
            cases.append(Case(f"integers {_short(dtype)} {op}", "all_reduce", op, ints.to(dtype), tags=("integers",)))
    for dtype in _FLOATS[:3]:
        x = torch.arange(w * 6, dtype=torch.float32).reshape(w, 6).to(dtype)
        for op in ("BOR", "PREMUL_SUM:0.5"):
            cases.append(Case(f"refused {_short(dtype)} {op}", "all_reduce", op, x, tags=("refused",)))
    return cases


def _reduction_cases(w: int, groups: list, gen: torch.Generator) -> list[Case]:
    """reduce to every root and list/tensor reduce_scatter on each group, of order fingerprints (the result
    shows the order) and wide-binade values, at sizes that cross gloo's segment and chunk boundaries."""
    cases = []
    for group in groups:
        members = sorted(group) if group else list(range(w))
        n = len(members)
        for dtype in (torch.float32, torch.bfloat16):
            for numel in (1, 3, 64, 1000):
                x = spread(order_fingerprint(n, numel, dtype), members, w)
                y = spread(_wide_normal(gen, (n, numel), dtype), members, w)
                for op in ("PRODUCT", "MAX", "AVG"):
                    name = f"reduce n={n} to {members[-1]} {numel} {_short(dtype)} {op}"
                    cases.append(Case(name, "reduce", op, y, group, members[-1]))
                for root in members:
                    cases.append(
                        Case(f"reduce n={n} to {root} {numel} {_short(dtype)}", "reduce", "SUM", x, group, root)
                    )
            for block in (1, 5, 333):
                x = spread(order_fingerprint(n, n * block, dtype).reshape(n, n, block), members, w)
                cases.append(
                    Case(f"reduce_scatter list n={n} {block} {_short(dtype)}", "reduce_scatter", "SUM", x, group)
                )
                x = spread(_wide_normal(gen, (n, n * block), dtype), members, w)
                for op in ("SUM", "MAX", "AVG"):
                    cases.append(Case(f"reduce_scatter_tensor n={n} {block} {_short(dtype)} {op}",
                                      "reduce_scatter_tensor", op, x, group))  # fmt: skip
    return cases


def _layout_cases(w: int, gen: torch.Generator) -> list[Case]:
    """Transposed and strided (non-contiguous) inputs, all-reduced and reduce-scattered."""
    cases = []
    for shape in ((3, 5), (64, 48), (7, 130), (8, 33)):
        x = _wide_normal(gen, (w, *shape), torch.float32)
        for layout in ("transposed", "strided"):
            cases.append(Case(f"{layout} {shape}", "all_reduce", "SUM", x, layout=layout, tags=("layout",)))
        if shape[0] % w == 0:
            name = f"reduce_scatter_tensor transposed {shape}"
            cases.append(Case(name, "reduce_scatter_tensor", "SUM", x, layout="transposed", tags=("layout",)))
    return cases


def order_fingerprint(n: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """``[n, numel]``: at each element 1.0 on one rank and half an ulp of 1.0 on two others (every triple in turn).

    The sum is ``1 + ulp`` exactly when the two small values meet before the 1.0, so the result shows the order.
    """
    if n < 3:
        return torch.ones(n, numel, dtype=dtype) * torch.tensor([1.0, 2.0**-9], dtype=dtype)[:n, None]
    triples = [(b, p, q) for b in range(n) for p, q in itertools.combinations([r for r in range(n) if r != b], 2)]
    small = 2.0 ** (-8 if dtype == torch.bfloat16 else -24)
    pick = torch.tensor(triples)[torch.arange(numel) % len(triples)]
    x = torch.zeros(n, numel, dtype=torch.float64)
    cols = torch.arange(numel)
    x[pick[:, 0], cols] = 1.0
    x[pick[:, 1], cols] = small
    x[pick[:, 2], cols] = small
    return x.to(dtype)


def _wide_normal(gen: torch.Generator, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Normal values times exact powers of two ``2**k``, ``k`` in [-20, 20] (no ``exp2``: its bits vary by path)."""
    k = torch.randint(-20, 21, shape, generator=gen, dtype=torch.int32)
    return (torch.randn(shape, generator=gen) * ((k + 127) << 23).view(torch.float32)).to(dtype)


def _short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
