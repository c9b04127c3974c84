"""`Gloo`: the summation order of torch.distributed's gloo backend on CPU, bit for bit.

What gloo does (torch 2.13, ``ProcessGroupGloo`` -> ``gloo::allreduce``, ring
algorithm, ``gloo/allreduce.cc``), for ``n`` ranks, ``N`` elements of ``e``
bytes each:

1. The flat buffer is cut into ``S`` segments, a multiple of ``n`` and at
   least ``2n``, each at most ``max_segment_bytes`` (1 MiB, gloo's
   ``kMaxSegmentSize``; torch does not change it)::

       m   = max(1, max_segment_bytes // e)          # elements per segment, at most
       S   = roundup(max(ceil(N / m), 2 * n), n)
       seg = ceil(N / S)                             # elements per segment
       L   = (S // n) * seg                          # elements per chunk

   Chunk ``c`` (``c = 0 .. n-1``) is elements ``[c*L, (c+1)*L)`` clipped to
   ``N``; the last chunks may be short or empty. For ``N <= 2n*m`` this is
   ``L = 2 * ceil(N / (2n))``.
2. Ring reduce-scatter: rank ``r`` sends to ``r-1`` and receives from
   ``r+1``. Chunk ``c`` starts at rank ``c-1`` and walks down the ring, each
   hop adding the local value and rounding to the dtype, so element ``k`` in
   chunk ``c`` is the left fold::

       ((x[c-1] + x[c-2]) + x[c-3]) + ... + x[c]          (rank indices mod n)

   and ends on rank ``c``, which owns it; a ring all-gather then copies it out
   unchanged. Each add is ``gloo::sum<T>``: one IEEE fp32 add, or for bf16 a
   float add rounded to nearest-even, which is what torch's bf16 add does.
3. ``reduce_scatter_tensor`` on gloo clones the input, runs this same
   all-reduce on the whole ``N = n * block`` buffer and keeps block ``i`` on
   rank ``i``, so the inherited `Reduction.reduce_scatter` (the matching
   slices of `reduce` on the flat tensor) is already exact.

Consequences: with 2 ranks every order gives the same value (only NaN bits
differ). Chunks are cut by length, not by ``n``-way splitting of the tensor, so
for ``N <= 2`` every element is in chunk 0 and the order is the descending fold
``x[n-1] + ... + x[0]``; e.g. ``n=4, N=1024``: ``L=256``, chunks 0..3 start at
ranks 3, 0, 1, 2.

Every op follows this walk. At each hop the receiving rank combines its own
value ``local`` with the partial ``acc`` it received, as gloo's element-wise
functions do:

* ``SUM``/``PRODUCT``: ``local + acc`` / ``local * acc``, rounded to the dtype
  (bf16/fp16 through float). NaN bits: fp32/fp64 keep ``local``'s NaN, else
  ``acc``'s, quieted (x86: the first operand's), else the default NaN
  ``0xFFC00000`` (``inf - inf``, ``0 * inf``); bf16 results are always
  ``0x7FC0`` (c10's float -> bf16 rounding); fp16 keep that NaN's sign with
  payload ``0x7E00``. Integers wrap (two's complement); bool tensors are
  reduced as bytes (``uint8``): three ``True`` sum to byte 3 (found against real gloo).
* ``MAX``/``MIN``: ``std::max(local, acc)``: ``acc`` if ``acc > local`` (``<``
  for MIN), else ``local``. A comparison with NaN is false, so NaN wins only
  when it is on the receiving side, and of ``+0``/``-0`` the later rank's
  zero stays: the result depends on where a NaN or zero sits on the walk.
  Bits are copied unchanged.
* ``AVG``: torch's gloo backend runs ``SUM``, then ``tensor.div_(n)`` in the
  tensor dtype; on integer and bool tensors that division raises
  ``RuntimeError`` (after the collective), and `Gloo.reduce` raises it too.
  ``PREMUL_SUM`` and ``BAND``/``BOR``/``BXOR`` on floats raise ``RuntimeError``
  in torch (the simdist backend refuses them the same way).
* one rank: the input is left as it is (a signalling NaN stays signalling).

What the collectives around the walk do (torch 2.13):

* ``reduce`` runs gloo's own reduce ring (``gloo/reduce.cc``): segments of
  ``min(ceil(T / 2n), 1 MiB)`` bytes (`reduce_chunk_length`; the all-reduce's
  chunks up to ``2n`` MiB, whole 1 MiB segments above). The root gets the full
  result (`Gloo.reduce_to`), every other rank the partial sums of its own hops
  (`Gloo.reduce_buffers`, including the ``s - 2`` extra steps when a chunk has
  ``s > 2`` segments); with AVG every rank's tensor is then divided by ``n``.
* complex tensors (``reduce`` and both reduce_scatters; torch's Python layer
  hands the others ``view_as_real``) are reduced on ``view_as_real``; AVG then
  divides the complex tensor; MAX/MIN/PRODUCT raise ``RuntimeError``.
* ``reduce_scatter_tensor`` all-reduces a clone of the input (a permuted
  input in memory order) and gives rank ``i`` chunk ``i`` of dim 0.
* integer ``AVG``: the SUM is in the tensor when ``div_`` raises.
* list ``reduce_scatter`` is one all-reduce per list entry, entry ``i`` kept by
  rank ``i`` (`Gloo.reduce_scatter_list`).
* the group's ranks are sorted by torch (``new_group([3, 0, 1])`` is group
  order 0, 1, 3).
* gloo reads ``numel`` elements from a tensor's data pointer: a dense
  permuted tensor (``x.t()``) is reduced in memory order (`memory_rows`); a
  view with gaps (``x[:, ::2]``) makes gloo reduce memory outside the view,
  which `Gloo` refuses with ``ValueError`` naming that hazard.

Evidence (torch 2.13.0+cpu, real gloo processes on 127.0.0.1, spawned with
``simdist.run(where="gloo")``):

* fingerprints for n = 3..8: at every element one rank holds 1.0 and two others
  hold the half-ulp (bf16 ``2**-8``, fp32 ``2**-24``), the rest 0, cycling over
  every (big, small, small) triple; the result is ``1 + ulp`` exactly when both
  small values meet before the 1.0. All elements matched this reduction for 20
  lengths from 1 to ``m * (2n+1) + 7`` (past the segment cap, so ``S > 2n``),
  in fp32 and bf16; rank-order folds differed at about 45 % of them.
* random data for n = 2..8: normal values and ``normal * 2**k``, ``k`` uniform
  in ``[-60, 60]``, 20 lengths each (1 .. 100000 and random up to 200000),
  fp32 and bf16: all-reduce and reduce_scatter_tensor equal to this reduction bit
  for bit (``tests/integration/test_gloo_reduction.py`` repeats this for 2, 3 and 4 ranks).
  fp16 (``k`` in ``[-8, 8]``) and fp64 matched too, for n = 3, 4, 5, 8.
* corner cases (`simdist.testing._internal.gloo_probe`, ``experiments/gloo_corners.py``,
  ``tests/integration/test_gloo_corners.py``): NaN payloads (quiet and signalling, both
  signs), signed zeros and infinities at every rank position in fp32, bf16,
  fp16 and fp64 for SUM/PRODUCT/MAX/MIN/AVG on groups of 1 to 4 ranks (and of
  5 and 8, slow), integer and bool tensors with every op, reduce to every
  root, list and tensor reduce_scatter, permuted and strided layouts, plus
  Hypothesis-drawn cases: all bitwise equal, the same error type, or (strided
  views) refused.
* inputs for such checks must be built without ``exp2``/``pow``: their
  vectorised and scalar paths differ in the last bit, so a tensor computed with
  another thread count is not the same tensor (an early "mismatch" was that).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from simdist.errors import UsageError
from simdist.reduce import native
from simdist.reduce.base import AvgMode, ReduceOp, Reduction, Tensors, may_hold_nan
from simdist.reduce.gloo.arith import arith_walk, compare_walk
from simdist.reduce.gloo.layout import Rows, memory_rows, ring_view
from simdist.reduce.gloo.schedule import (
    GLOO_MAX_SEGMENT_BYTES,
    chunk_length,
    chunk_start_ranks,
    reduce_chunk_length,
    reduce_segment_length,
    ring_plan,
)
from simdist.reduce.plan import FoldPlan, fold

__all__ = [
    "GLOO_MAX_SEGMENT_BYTES",
    "Gloo",
    "Rows",
    "chunk_length",
    "chunk_start_ranks",
    "memory_rows",
    "reduce_chunk_length",
    "reduce_segment_length",
    "ring_plan",
]


@dataclass(frozen=True, repr=False)
class Gloo(Reduction):
    """gloo's ring all-reduce: per chunk, a walk that starts at rank ``c-1`` and goes down the ring.

    Every op follows the same walk; each hop combines the receiving rank's own
    value with the partial it received, as gloo's element-wise function does
    (see the module docstring for the chunk formula, the per-op semantics and
    the evidence). ``max_segment_bytes`` is gloo's segment cap (only change it
    to reduction a gloo built or configured differently).
    """

    max_segment_bytes: int = GLOO_MAX_SEGMENT_BYTES
    avg: AvgMode = "postdiv"
    gloo_rules = True

    def __post_init__(self) -> None:
        if self.max_segment_bytes < 1:
            raise UsageError(f"max_segment_bytes must be >= 1, got {self.max_segment_bytes}")
        if self.avg != "postdiv":
            raise UsageError("gloo's AVG is its SUM divided by the group size (avg='postdiv')")

    @property
    def name(self) -> str:
        if self.max_segment_bytes == GLOO_MAX_SEGMENT_BYTES:
            return "gloo"
        return f"gloo(max_segment_bytes={self.max_segment_bytes})"

    def sum(self, tensors: Tensors) -> torch.Tensor:
        return self.reduce(tensors, ReduceOp.SUM)

    def product(self, tensors: Tensors) -> torch.Tensor:
        return self.reduce(tensors, ReduceOp.PRODUCT)

    def reduce(self, tensors: Tensors, op: ReduceOp = ReduceOp.SUM) -> torch.Tensor:
        """What ``dist.all_reduce`` leaves on every rank of a gloo group.

        ``AVG`` is the ``SUM`` then ``tensor.div_(n)`` in the tensor's dtype
        (for a complex tensor a complex division, whose bits can differ from
        dividing the real view), as torch's gloo backend does after the collective; on integer and bool
        tensors that division raises torch's ``RuntimeError``, and so does this,
        with the SUM (which real gloo has written into the tensor by then) as
        the exception's ``written`` attribute. Complex and bool tensors are
        reduced as gloo reduces them (`ring_view`). Contiguous fp32/fp64/bf16/fp16 members on CPU go straight
        to the native kernel (`simdist.reduce.native`) for SUM and PRODUCT: the same bits, read in memory order.
        """
        if (op is ReduceOp.SUM or op is ReduceOp.PRODUCT) and native.available() and len(tensors):
            first = tensors[0]
            plan = ring_plan(len(tensors), first.numel(), first.element_size(), self.max_segment_bytes)
            out = native.fold(plan, tensors, op is ReduceOp.PRODUCT, flat=True)
            if out is not None:
                return out
        return self._reduced(tensors, op, "all_reduce", for_reduce=False)

    def reduce_into(self, tensors: Sequence[torch.Tensor], op: ReduceOp, outs: Sequence[torch.Tensor]) -> bool:
        """`reduce`'s result written into each of ``outs`` (an in-place all-reduce's writes: ``outs`` may be
        members), in one pass of the native kernel; False where it does not apply (nothing written: call
        `reduce`). The same bits as `reduce` (tests/unit/reduce/test_native.py)."""
        if (op is ReduceOp.SUM or op is ReduceOp.PRODUCT) and native.available() and len(tensors):
            first = tensors[0]
            plan = ring_plan(len(tensors), first.numel(), first.element_size(), self.max_segment_bytes)
            return native.fold_to(plan, tensors, outs, op is ReduceOp.PRODUCT)
        return False

    def reduce_to(self, tensors: Tensors, op: ReduceOp = ReduceOp.SUM, root: int = 0) -> torch.Tensor:
        """What ``dist.reduce`` leaves on group rank ``root``: the ring of gloo's ``reduce``, whatever the root.

        Up to ``2n`` MiB its chunks are the all-reduce's; above, gloo's reduce
        cuts whole 1 MiB segments (`reduce_chunk_length`), so the fold order differs.
        """
        if not 0 <= root < len(tensors):
            raise UsageError(f"root {root} is not a rank of a group of {len(tensors)}")
        return self._reduced(tensors, op, "reduce", for_reduce=True)

    def _reduced(self, tensors: Tensors, op: ReduceOp, what: str, for_reduce: bool) -> torch.Tensor:
        if len(tensors) == 0:
            raise UsageError("a reduction needs the tensors of at least one rank")
        dtype = tensors[0].dtype
        tensors, restore = ring_view(tensors, op, what)
        rows, back = memory_rows(tensors)
        n = len(rows)
        if op is ReduceOp.AVG:
            if rows[0].is_floating_point():
                return restore(back(self._ring(rows, ReduceOp.SUM, for_reduce))).div_(n)  # in the caller's dtype
            try:
                torch.empty(0, dtype=dtype).div_(n)  # torch's own error, as gloo's div_ raises it
            except RuntimeError as exc:
                # what the tensor holds, on torch's own RuntimeError (which declares no such field: set via __dict__)
                vars(exc)["written"] = restore(back(self._ring(rows, ReduceOp.SUM, for_reduce)))
                raise
            raise AssertionError(f"unreachable: an in-place division of a {dtype} tensor did not raise")
        return restore(back(self._ring(rows, op, for_reduce)))

    def reduce_buffers(self, tensors: Tensors, op: ReduceOp = ReduceOp.SUM, root: int = 0) -> list[torch.Tensor]:
        """What ``dist.reduce`` leaves in every member's tensor (group-rank order), found by experiment.

        gloo's reduce runs the ring reduce-scatter in place (its own chunks,
        `reduce_chunk_length`) and sends the owned chunks to the root: the root
        holds the full result (`reduce_to`); every other rank holds, in each
        chunk, the partial of the walk up to and including its own hop (the
        walk's first rank keeps its input; a chunk's owner holds the full
        result). Above ``2n`` MiB a chunk has ``s > 2`` segments and gloo's
        loop runs ``s - 2`` steps past the reduce-scatter: the owner of chunk
        ``c`` sends its first ``s - 2`` finished segments on to rank ``c - 1``,
        which adds its own input to them (``x[c-1] + full``; found against real
        gloo, P=3, 1,572,865 fp32). ``AVG`` divides every rank's tensor by the group size in place
        afterwards, the root's and the others' alike. An empty tensor is left
        empty on every rank.
        """
        full = self.reduce_to(tensors, op, root)  # raises what gloo raises (integer AVG, complex MAX, ...)
        tensors, restore = ring_view(tensors, op, "reduce")
        if op is ReduceOp.AVG:  # div_ on the caller's tensor: a complex division for a complex tensor
            sums = self._buffers(tensors, ReduceOp.SUM, root)
            return [full if r == root else restore(b).div_(len(sums)) for r, b in enumerate(sums)]
        return [full if r == root else restore(b) for r, b in enumerate(self._buffers(tensors, op, root))]

    def _buffers(self, tensors: Tensors, op: ReduceOp, root: int) -> list[torch.Tensor]:
        """Every member's tensor after gloo's reduce of ``op`` (``tensors`` already in gloo's dtype view)."""
        rows, back = memory_rows(tensors)
        n, numel = len(rows), rows[0].numel()
        if n == 1 or numel == 0:
            return [back(r.clone()) for r in rows]
        hops, chunks = self._hops(rows, for_reduce=True)
        partials = [hops[0]]
        for local in hops[1:]:
            pair = [partials[-1], local]
            partials.append(compare_walk(pair, op) if op in (ReduceOp.MAX, ReduceOp.MIN) else arith_walk(
                pair, multiply=op is ReduceOp.PRODUCT))  # fmt: skip
        stacked = torch.stack(partials).view(n, chunks, -1)
        length = stacked.shape[2]
        segment = reduce_segment_length(numel, n, rows[0].element_size(), self.max_segment_bytes)
        extra = length // segment - 2  # segments per chunk beyond 2: gloo's ring runs that many steps further
        chunk = torch.arange(chunks)
        out = []
        for r in range(n):
            own = stacked[(chunk - 1 - r) % n, chunk].reshape(-1)[:numel].clone()  # chunk c: hop (c - 1 - r) mod n
            c = (r + 1) % n
            lo, hi = c * length, min(c * length + extra * segment, numel)
            if extra > 0 and c < chunks and hi > lo:
                # the owner of chunk c = r + 1 sends the first ``extra`` finished segments on to rank r, which
                # adds its own input to them (its buffer still holds its input there: it started that walk)
                pair = [stacked[n - 1, c, : hi - lo], rows[r][lo:hi]]
                own[lo:hi] = compare_walk(pair, op) if op in (ReduceOp.MAX, ReduceOp.MIN) else arith_walk(
                    pair, multiply=op is ReduceOp.PRODUCT)  # fmt: skip
            out.append(back(own))
        return out

    def reduce_scatter(self, tensors: Tensors, op: ReduceOp = ReduceOp.SUM) -> torch.Tensor:
        """``reduce_scatter_tensor``: torch's gloo backend all-reduces a clone of the input (``clone()``: a
        permuted input stays in memory order, a view with gaps or an ``expand()`` becomes contiguous) and
        hands rank ``i`` chunk ``i`` of dim 0; flat ``[n, numel / n]`` blocks."""
        if not isinstance(tensors, torch.Tensor):
            tensors = [t if t.is_contiguous() else t.clone() for t in tensors]
            n = len(tensors)
            if op in (ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.AVG) and n and tensors[0].numel() % n == 0:
                # the members as they are, not stacked into a copy first (FSDP2's gradient buffers: a copy of
                # every member's full gradient per call); the kernel's plan and bits are the stacked call's, and
                # AVG is that SUM divided in the dtype, as `reduce` does (FSDP2 on torch 2.13 reduces with AVG)
                first = tensors[0]
                plan = ring_plan(n, first.numel(), first.element_size(), self.max_segment_bytes)
                out = native.fold(plan, tensors, op is ReduceOp.PRODUCT, flat=True)
                if out is not None:
                    return (out.div_(n) if op is ReduceOp.AVG else out).reshape(n, -1)
        if isinstance(tensors, torch.Tensor) or all(t.is_contiguous() for t in tensors):
            return super().reduce_scatter(tensors, op)
        n = len(tensors)
        full = self.reduce(tensors, op)
        if full.shape[0] % n:
            raise UsageError(f"reduce_scatter of a non-contiguous input needs dim 0 divisible by {n}, got {full.shape}")
        return torch.stack([part.reshape(-1) for part in full.chunk(n, 0)])

    def reduce_scatter_list(
        self, lists: Sequence[Sequence[torch.Tensor]], op: ReduceOp = ReduceOp.SUM
    ) -> list[torch.Tensor]:
        """``dist.reduce_scatter(out, in_list)``: entry ``i`` of every member's list all-reduced, for rank ``i``.

        torch's gloo backend needs every entry of a rank's list to have that
        rank's output shape; the simdist backend refuses other lists before
        this runs (`simdist.world.backend.process_group`).
        """
        n = len(lists)
        if any(len(lst) != n for lst in lists):
            raise UsageError(f"reduce_scatter needs a list of {n} tensors from each of the {n} members")
        return [self.reduce([lst[i] for lst in lists], op) for i in range(n)]

    def fold_plan(self, n: int, numel: int, dtype: torch.dtype) -> FoldPlan:
        """The all-reduce's walk (`ring_plan`) for ``n`` members of ``numel`` elements of ``dtype``."""
        return ring_plan(n, numel, dtype.itemsize, self.max_segment_bytes)

    def fold_hops_trimmed(self, plan: FoldPlan, members: Tensors, multiply: bool = False) -> torch.Tensor:
        """The plan's fold with gloo's NaN bits: the plain fold is exact except where its result is NaN
        (`arith_walk`); with 2 members the fold needs no plan (one operation, any order). The native kernel
        (`simdist.reduce.native`) computes the same bits in one loop where it applies."""
        out = native.fold(plan, members, multiply)
        if out is not None:
            return out
        if plan.n == 2:
            out = fold(members, multiply)
            hops = None
        else:
            hops = plan.hops(members)
            out = plan.trim(fold(hops, multiply, plan.output(hops)), members)
        if not may_hold_nan(out):
            return out
        hops = plan.hops(members) if hops is None else hops
        if plan.is_uniform:
            flat = [h.reshape(-1) for h in hops]
        else:
            flat = [plan.trim(h.contiguous(), members).reshape(-1) for h in hops]
        return arith_walk(flat, multiply).view(out.shape)

    def sum_many(self, stacked: torch.Tensor, shape: Sequence[int] | None = None) -> torch.Tensor:
        """`Reduction.sum_many` on the values gloo's kernels see (bool as bytes, complex as real pairs); the
        native kernel reads the stacked members in place (batch dimensions of any strides); without it, two
        members are one add and the NaN screen."""
        plan = self._native_plan(stacked, shape)
        out = native.fold(plan, stacked) if plan is not None else None
        if out is not None:
            return out
        if stacked.shape[0] == 2 and stacked.is_floating_point():
            # two members: the same IEEE value in either order, so one add over the layout as it is; only a NaN
            # result needs the walk (its bits depend on which member receives)
            out = torch.add(stacked[0], stacked[1])
            if not may_hold_nan(out):
                return out
        if stacked.dtype != torch.bool and not stacked.is_complex():
            return super().sum_many(stacked, shape)
        shape = tuple(stacked.shape[2:]) if shape is None else tuple(shape)
        viewed, restore = ring_view(stacked, ReduceOp.SUM, "all_reduce")
        assert isinstance(viewed, torch.Tensor)
        return restore(super().sum_many(viewed, shape + tuple(viewed.shape[stacked.dim() :])))

    def sum_many_into(
        self, stacked: torch.Tensor, out: torch.Tensor, shape: Sequence[int] | None = None
    ) -> torch.Tensor:
        """`Reduction.sum_many_into`: the native kernel writes every member's copy in the same pass."""
        plan = self._native_plan(stacked, shape)
        if plan is not None and native.fold_into(plan, stacked, out):
            return out
        return super().sum_many_into(stacked, out, shape)

    def _native_plan(self, stacked: torch.Tensor, shape: Sequence[int] | None) -> FoldPlan | None:
        """The plan the native kernel folds a stacked ``[n, *batch, *shape]`` input with (it reads the members in
        place); None where the kernel is off or there is nothing to fold."""
        if stacked.dim() < 2 or not native.available():
            return None
        numel = math.prod(stacked.shape[2:] if shape is None else shape)
        return self.plan(stacked.shape[0], numel, stacked.dtype) if numel else None

    def _hops(self, rows: Rows, for_reduce: bool = False) -> tuple[list[torch.Tensor], int]:
        """``(hops, chunks)``: ``hops[j]`` holds, per element, the value hop ``j`` of its chunk's
        walk combines (rank ``(c - 1 - j) mod n``), padded with zeros to ``chunks * length`` when there are
        several chunks; one chunk is the ranks in descending order, unpadded."""
        first = rows[0]
        plan = ring_plan(len(rows), first.numel(), first.element_size(), self.max_segment_bytes, for_reduce)
        hops = plan.hops(rows)
        return (hops if plan.is_uniform else [h.reshape(-1) for h in hops]), plan.period

    def _ring(self, rows: Rows, op: ReduceOp, for_reduce: bool = False) -> torch.Tensor:
        """The flat result of the ring walk of ``op`` over ``rows`` (see `memory_rows`)."""
        n, first = len(rows), rows[0]
        numel = first.numel()
        if n == 1 or numel == 0:
            return first.clone()
        plan = ring_plan(n, numel, first.element_size(), self.max_segment_bytes, for_reduce)
        if op is ReduceOp.SUM or op is ReduceOp.PRODUCT:
            return self.fold_hops_trimmed(plan, rows, multiply=op is ReduceOp.PRODUCT)
        if op is ReduceOp.MAX or op is ReduceOp.MIN:
            hops = plan.hops(rows)
            out = plan.output(hops)
            walked = compare_walk(hops, op)
            return plan.trim(walked if out is None else out.copy_(walked), rows)
        raise UsageError(f"unsupported reduce op {op!r}")
