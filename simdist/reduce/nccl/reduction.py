"""`Nccl`: the order in which NCCL's all-reduce sums, rebuilt from NCCL's source.

**Not yet confirmed on hardware.** No GPU was available when this was written.
The reduction follows the source; `experiments/nccl_fingerprint.py` is the check
against real NCCL (it runs fingerprint inputs under torchrun and reports reduction
== real per case). Until that has run, treat a bitwise claim about NCCL built
on this reduction as a prediction.

Source followed: NCCL ``v2.30.7-1`` (commit ``73cf112295c3``; master at
``5067397c`` has the same text in every file below). The kernels, trees and
chunking read the same, up to formatting, back to ``v2.26.6``; the one change
in that range is the channel split (step 2): before 2.29 the smallest channel
traffic is 16 KiB and the per-channel traffic is not rounded to 16 bytes
(``nccl_version``). Files read:
``src/device/all_reduce.h`` (ring and tree kernels), ``src/device/reduce_scatter.h``,
``src/device/reduce.h``, ``src/device/prims_simple.h`` / ``prims_ll.h`` /
``prims_ll128.h`` and ``common_kernel.h`` (how a step combines its sources),
``src/device/reduce_kernel.h`` (the arithmetic of each op and type),
``src/include/device.h`` (``ncclCollCbdPart``, grain sizes, constants),
``src/enqueue.cc`` (``scheduleCollTasksToPlan``, ``topoGetAlgoInfo``,
``calcCollChunking``, ``hostToDevRedOp``), ``src/graph/tuning.cc`` (thread counts
and thresholds, ``NCCL_ALGO``/``NCCL_PROTO`` parsing), ``src/graph/connect.cc``,
``src/graph/trees.cc`` (chains and the double binary tree), ``src/init.cc``
(buffer sizes, ring index). Nothing below is NCCL's code or text; it is a
description and a reimplementation.

How NCCL orders an all-reduce of ``N`` elements of ``e`` bytes on ``n`` ranks
(one ``ncclAllReduce`` alone in its group, no tuner plugin, NVLS, CollNet, PAT
and symmetric-memory kernels off):

1.-4. **Channels, split, ring, tree**: which bytes each channel takes and in which order a ring or tree
   combines them; written out in `simdist.reduce.nccl.schedule`, which computes them.
5. **Operations.** SUM as above. AVG on floating types is NCCL's ``PreMulSum``:
   each rank multiplies its own value by ``1/n`` (computed as a double, rounded
   to float, then to the dtype) as it first reads it, and the products are summed
   in the order above; on integer types it is the wrapped sum divided by ``n``
   (truncating) once at the end. In a step, NCCL's reduce loads the rank's own
   value, premultiplies it, then adds the received partials one by one. The
   premultiply is a plain ``*`` for fp32/fp64 and ``__hmul``/``__hmul2`` for
   fp16/bf16, none of which forbids the compiler from fusing it with the add
   that follows into one FMA; whether the shipped binary does is a fact of the
   build, not the source, so it is the knob ``premul_fma`` (default: not fused,
   two roundings). For ``n`` a power of two the product is exact and the knob
   cannot matter; the fingerprint's AVG cases tell which holds. PRODUCT folds
   in the same order. MAX/MIN use
   ``fmaxf``/``fminf``-like functions that *ignore* NaN unless every input is NaN,
   so they are order-free (signed zeros are not claimed). With ``n == 1`` NCCL
   only copies (AVG multiplies by 1).
6. **reduce_scatter** (ring only) folds output block ``q`` from ring position
   ``pos(q) + 1`` round to ``q``, whatever the chunking; ``reduce`` to ``root``
   (ring only) folds from ``pos(root) + 1`` round to the root. Both depend on the
   channel split only through the rings, so with one ring for all channels
   they are exact; with several rings this reduction assumes the same protocol
   knob for these calls.
7. **Layout.** torch's NCCL backend passes NCCL the storage of a tensor that is
   contiguous in its suggested memory format, so a channels-last tensor is
   chunked in memory order; other strided tensors it refuses with
   ``ValueError("Tensors must be contiguous")``, as `storage_flat` does.

Consequences: 2 ranks are one add in every configuration. For small tensors on
the default Simple ring the chunks are ``roundup(ceil(N_channel / n), 16 / e)``
elements, so up to ``n`` different starting ranks appear within a few hundred
bytes; one channel's chunk starts repeat every ``n * K`` elements.

What the reduction cannot know (explicit parameters, read them from
``NCCL_DEBUG=INFO`` logs or pin them with the environment): the channel count
(``channels``; ``NCCL_MIN_NCHANNELS``/``NCCL_MAX_NCHANNELS``), the ring order of
each channel (``rings``) and tree of each channel (``trees``), both from topology
search; the algorithm and protocol NCCL's tuner would pick (``algorithm``,
``protocol``; pin ``NCCL_ALGO``/``NCCL_PROTO``); the threads per block for the
channel-dropping rule (``nthreads``). Also not modelled: aggregation of several
collectives in one group (they share channels), tuner plugins
(``NCCL_TUNER_PLUGIN=none``), NaN payloads (CUDA returns a canonical NaN), and
a fused premultiply for fp64 (``premul_fma`` covers fp32, bf16 and fp16).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from simdist.errors import UsageError
from simdist.reduce.base import AvgMode, ReduceOp, Reduction, Tensors
from simdist.reduce.nccl.arith import StepArithmetic, combine_op, premul_scale
from simdist.reduce.nccl.layout import storage_flat
from simdist.reduce.nccl.schedule import (
    ALGORITHMS,
    DEFAULT_BUFFSIZE,
    DEFAULT_LL128_BUFFSIZE,
    DEFAULT_LL_BUFFSIZE,
    MAX_CHANNELS,
    PROTOCOLS,
    VERSIONS,
    Algorithm,
    Protocol,
    TreeDown,
    chain_tree,
    channel_parts,
    check_tree,
    ring_chunk_elements,
    ring_segments,
    task_channels,
)


@dataclass(frozen=True, repr=False)
class Nccl(Reduction):
    """NCCL's all-reduce order for pinned knobs (see the module docstring; unconfirmed on hardware).

    ``algorithm``/``protocol`` are ``NCCL_ALGO``/``NCCL_PROTO``; ``channels`` the
    communicator's channel count (``NCCL_MIN_NCHANNELS = NCCL_MAX_NCHANNELS``);
    ``task_channels`` overrides NCCL's per-call channel dropping; ``rings`` the
    ring of each channel (rank order from rank 0; channel ``c`` uses
    ``rings[c % len(rings)]``, default ``0..n-1``); ``trees`` the ``down``
    table of each channel's tree (default the chain ``0 <- 1 <- ... <- n-1``);
    ``buffsize``/``ll_buffsize``/``ll128_buffsize`` the ``NCCL_*BUFFSIZE``
    values; ``nthreads`` NCCL's threads per block for the chosen algorithm and
    protocol (only used to drop channels for small calls); ``nccl_version``
    the release (2.26 to 2.30; only the channel split differs, see `channel_parts`);
    ``premul_fma`` whether AVG's premultiply of a rank's own value is fused with
    the add of the first partial it receives (one rounding; see the module docstring).
    """

    algorithm: Algorithm = "ring"
    protocol: Protocol = "simple"
    channels: int = 2
    task_channels: int | None = None
    rings: tuple[tuple[int, ...], ...] | None = None
    trees: tuple[TreeDown, ...] | None = None
    buffsize: int = DEFAULT_BUFFSIZE
    ll_buffsize: int = DEFAULT_LL_BUFFSIZE
    ll128_buffsize: int = DEFAULT_LL128_BUFFSIZE
    nthreads: int | None = None
    nccl_version: tuple[int, int] = (2, 30)
    avg: AvgMode = "premul"
    premul_fma: bool = False

    def __post_init__(self) -> None:
        if self.algorithm not in ALGORITHMS:
            raise UsageError(f"algorithm must be one of {', '.join(ALGORITHMS)}, got {self.algorithm!r}")
        if self.protocol not in PROTOCOLS:
            raise UsageError(f"protocol must be one of {', '.join(PROTOCOLS)}, got {self.protocol!r}")
        if not 1 <= self.channels <= MAX_CHANNELS:
            raise UsageError(f"channels must be in 1..{MAX_CHANNELS}, got {self.channels}")
        if self.task_channels is not None and not 1 <= self.task_channels <= self.channels:
            raise UsageError(f"task_channels must be in 1..channels={self.channels}, got {self.task_channels}")
        for name in ("buffsize", "ll_buffsize", "ll128_buffsize"):
            if getattr(self, name) < 1:
                raise UsageError(f"{name} must be positive, got {getattr(self, name)}")
        object.__setattr__(self, "nccl_version", tuple(int(v) for v in self.nccl_version)[:2])
        if self.nccl_version not in VERSIONS:
            valid = ", ".join(f"{a}.{b}" for a, b in VERSIONS)
            raise UsageError(f"nccl_version must be one of {valid} (the releases read), got {self.nccl_version}")
        if self.avg not in ("premul", "postdiv"):
            raise UsageError(f"avg must be 'premul' or 'postdiv', got {self.avg!r}")
        if self.rings is not None:
            object.__setattr__(self, "rings", tuple(tuple(int(r) for r in ring) for ring in self.rings))
            if not self.rings:
                raise UsageError("rings must name at least one ring")
        if self.trees is not None:
            object.__setattr__(self, "trees", tuple(tuple(tuple(d) for d in t) for t in self.trees))
            if not self.trees:
                raise UsageError("trees must name at least one tree")

    @property
    def name(self) -> str:
        extra = ""
        if self.task_channels is not None:
            extra += f", task_channels={self.task_channels}"
        if self.rings is not None:
            extra += f", rings={[list(r) for r in self.rings]}"
        if self.trees is not None:
            extra += f", trees={len(self.trees)}"
        for name, default in (
            ("buffsize", DEFAULT_BUFFSIZE),
            ("ll_buffsize", DEFAULT_LL_BUFFSIZE),
            ("ll128_buffsize", DEFAULT_LL128_BUFFSIZE),
        ):
            if getattr(self, name) != default:
                extra += f", {name}={getattr(self, name)}"
        if self.nthreads is not None:
            extra += f", nthreads={self.nthreads}"
        if self.nccl_version != (2, 30):
            extra += f", nccl_version={self.nccl_version[0]}.{self.nccl_version[1]}"
        if self.avg != "premul":
            extra += f", avg={self.avg}"
        if self.premul_fma:
            extra += ", premul_fma=True"
        return f"nccl({self.algorithm}, {self.protocol}, channels={self.channels}{extra})"

    # -- schedule ---------------------------------------------------------------------------

    def ring_of(self, channel: int, n: int) -> tuple[int, ...]:
        """Ring order (rank at each position, position 0 = rank 0) of ``channel`` for ``n`` ranks."""
        if self.rings is None:
            return tuple(range(n))
        ring = self.rings[channel % len(self.rings)]
        if sorted(ring) != list(range(n)):
            raise UsageError(f"ring {list(ring)} is not a permutation of the {n} group ranks")
        start = ring.index(0)
        return ring[start:] + ring[:start]

    def tree_of(self, channel: int, n: int) -> TreeDown:
        """``down`` table of ``channel``'s tree for ``n`` ranks."""
        return chain_tree(range(n)) if self.trees is None else self.trees[channel % len(self.trees)]

    def parts(self, count: int, element_size: int, n: int, traffic_per_byte: int = 2, nbytes: int | None = None):
        """``(channel, offset, count)`` parts of a ``count``-element collective (see `channel_parts`)."""
        used = self.task_channels
        if used is None:
            size = count * element_size if nbytes is None else nbytes
            algorithm = self.algorithm if traffic_per_byte == 2 else "ring"
            used = task_channels(size, self.channels, n, algorithm, self.protocol, self.nthreads)
        return channel_parts(
            count, element_size, self.protocol, self.channels, used, traffic_per_byte, self.nccl_version
        )

    def ring_plan(self, count: int, element_size: int, n: int) -> list[tuple[int, int, int, int]]:
        """``(offset, length, channel, start position)`` of every ring chunk of an all-reduce."""
        chunk = ring_chunk_elements(self.protocol, element_size, self.buffsize, self.ll_buffsize, self.ll128_buffsize)
        plan = []
        for channel, offset, part in self.parts(count, element_size, n):
            for lo, length, start in ring_segments(part, n, chunk, element_size):
                plan.append((offset + lo, length, channel, start))
        return plan

    def element_orders(self, count: int, element_size: int, n: int) -> torch.Tensor:
        """``[n, count]``: for a ring all-reduce, the rank each element adds at hop ``j`` (hop 0 starts)."""
        if self.algorithm != "ring":
            raise UsageError("element_orders is defined for the ring; a tree is not a fold")
        plan = self.ring_plan(count, element_size, n)
        start = torch.zeros(count, dtype=torch.int64)  # per element: its chunk's start position and channel
        channel = torch.zeros(count, dtype=torch.int64)
        for offset, length, c, s in plan:
            start[offset : offset + length] = s
            channel[offset : offset + length] = c
        rings = torch.tensor([self.ring_of(c, n) for c in range(max((c for _, _, c, _ in plan), default=0) + 1)])
        return rings[channel.unsqueeze(0), (start.unsqueeze(0) + torch.arange(n).unsqueeze(1)) % n]

    # -- arithmetic -------------------------------------------------------------------------

    def sum(self, tensors: Tensors) -> torch.Tensor:
        return self.reduce(tensors, ReduceOp.SUM)

    def reduce(self, tensors: Tensors, op: ReduceOp = ReduceOp.SUM) -> torch.Tensor:
        flat, restore = storage_flat(tensors)
        n = flat.shape[0]
        flat, arith, finish = self._prepare(flat, op)
        if n == 1:
            out = arith.own(flat[0]).clone()
        elif n == 2 and arith.scale is None:  # one combination: every order agrees
            out = arith.combine(flat[0], flat[1])
        elif self.algorithm == "ring":
            out = _fold_groups(flat, _groups(self, "all_reduce", flat.shape[1], flat.element_size(), n), arith)
        else:
            out = self._tree(flat, arith)
        return restore(finish(out))

    def _tree(self, flat: torch.Tensor, arith: StepArithmetic) -> torch.Tensor:
        """The tree all-reduce of ``[n, *batch, columns]``: each channel's part folded up its tree."""
        out = torch.empty_like(flat[0])
        for channel, offset, part in self.parts(flat.shape[-1], flat.element_size(), flat.shape[0]):
            down = self.tree_of(channel, flat.shape[0])
            root, order = check_tree(down, flat.shape[0])
            out[..., offset : offset + part] = _tree_fold(flat[..., offset : offset + part], down, root, order, arith)
        return out

    def sum_many(self, stacked: torch.Tensor, shape: Sequence[int] | None = None) -> torch.Tensor:
        """`Reduction.sum_many`: many independent all-reduces at once, ``[n, *batch, *shape] -> [*batch, *shape]``.

        Each batch item gets the bits `reduce` gives it alone (row-major members of ``prod(shape)`` elements):
        the schedule (channels, chunks, rings, trees) is that of one member, and every operation is element-wise
        along the batch dimension, so the rank-batched gradient path runs no per-item loop.
        """
        n = stacked.shape[0]
        shape = tuple(stacked.shape[2:]) if shape is None else tuple(shape)
        batch = tuple(stacked.shape[1 : stacked.dim() - len(shape)])
        numel = math.prod(shape)
        if n == 1 or numel == 0:  # one rank copies (as `reduce` does): no schedule to follow
            return stacked[0].clone()
        flat = stacked.reshape(n, -1, numel)
        arith = StepArithmetic(combine_op(ReduceOp.SUM, stacked.dtype))
        if n == 2:  # one addition: every order agrees
            out = arith.combine(flat[0], flat[1])
        elif self.algorithm == "ring":
            out = _fold_groups(flat, _groups(self, "all_reduce", numel, stacked.element_size(), n), arith)
        else:
            out = self._tree(flat, arith)
        return out.reshape(*batch, *shape)

    def reduce_scatter(self, tensors: Tensors, op: ReduceOp = ReduceOp.SUM) -> torch.Tensor:
        """Per-rank output blocks ``[n, numel / n]`` of NCCL's ring reduce-scatter."""
        flat, _ = storage_flat(tensors)
        n = flat.shape[0]
        if flat.shape[1] % n:
            raise UsageError(f"reduce_scatter needs numel divisible by the group size {n}, got {flat.shape[1]}")
        block = flat.shape[1] // n
        flat, arith, finish = self._prepare(flat, op)
        if n == 1:
            return finish(arith.own(flat[0]).clone()).reshape(1, block)
        groups = _groups(self, "reduce_scatter", flat.shape[1], flat.element_size(), n)
        return finish(_fold_groups(flat, groups, arith)).reshape(n, block)

    def reduce_scatter_list(
        self, lists: Sequence[Sequence[torch.Tensor]], op: ReduceOp = ReduceOp.SUM
    ) -> list[torch.Tensor]:
        """``dist.reduce_scatter(out, in_list)``: entry ``i`` of every member's list reduced, for group rank ``i``.

        torch's NCCL backend copies a list of same-shaped tensors into one buffer
        and runs one ``ncclReduceScatter`` (so this is `reduce_scatter` of the
        concatenations); other lists it turns into one ``ncclReduce`` per
        rank in a group (`reduce_to` each entry to its rank; the calls share
        channels there, which matters only when channels have different rings).
        """
        n = len(lists)
        if any(len(lst) != n for lst in lists):
            raise UsageError(f"reduce_scatter needs a list of {n} tensors from each of the {n} members")
        shapes = [lists[0][i].shape for i in range(n)]
        if len(set(shapes)) > 1:
            return [self.reduce_to([lst[i] for lst in lists], op, i) for i in range(n)]
        flat = torch.stack([torch.cat([t.reshape(-1) for t in lst]) for lst in lists])
        blocks = self.reduce_scatter(flat, op)
        return [blocks[i].reshape(shapes[i]) for i in range(n)]

    def reduce_to(self, tensors: Tensors, op: ReduceOp = ReduceOp.SUM, root: int = 0) -> torch.Tensor:
        """What ``dist.reduce`` leaves on group rank ``root``: NCCL's ring pipeline ending at the root."""
        flat, restore = storage_flat(tensors)
        n = flat.shape[0]
        if not 0 <= root < n:
            raise UsageError(f"root {root} is not a rank of a group of {n}")
        flat, arith, finish = self._prepare(flat, op)
        if n == 1:
            return restore(finish(arith.own(flat[0]).clone()))
        groups = _groups(self, f"reduce:{root}", flat.shape[1], flat.element_size(), n)
        return restore(finish(_fold_groups(flat, groups, arith)))

    def _prepare(self, flat: torch.Tensor, op: ReduceOp):
        """The inputs as the kernels combine them, the step arithmetic, and the step applied to the result."""
        n = flat.shape[0]
        combine = combine_op(op, flat.dtype)
        if op is not ReduceOp.AVG:
            return flat, StepArithmetic(combine), _identity
        if not flat.dtype.is_floating_point:
            return flat, StepArithmetic(combine), lambda out: torch.div(out, n, rounding_mode="trunc")
        if self.avg == "postdiv":
            return flat, StepArithmetic(combine), lambda out: out / n
        scale = premul_scale(n, flat.dtype).to(flat.device)
        if self.premul_fma:
            return flat, StepArithmetic(combine, scale), _identity
        return flat * scale, StepArithmetic(combine), _identity


Groups = tuple[tuple[tuple[int, ...], tuple[tuple[int, int], ...], torch.Tensor | None], ...]


@functools.lru_cache(maxsize=256)
def _groups(reduction: Nccl, fn: str, count: int, element_size: int, n: int) -> Groups:
    """The ring plan of a call grouped by fold order: ``(order, spans, column index or None)``.

    ``fn`` is ``all_reduce``, ``reduce_scatter`` (``count`` = the whole input)
    or ``reduce:<root>``. Cached: a call's plan depends only on these arguments.
    """
    plan: list[tuple[int, int, tuple[int, ...], int]] = []
    if fn == "all_reduce":
        plan = [(o, ln, reduction.ring_of(c, n), s) for o, ln, c, s in reduction.ring_plan(count, element_size, n)]
    elif fn == "reduce_scatter":
        block = count // n
        for channel, offset, part in reduction.parts(block, element_size, n, traffic_per_byte=n,
                                                 nbytes=count * element_size):  # fmt: skip
            ring = reduction.ring_of(channel, n)
            plan.extend((q * block + offset, part, ring, (ring.index(q) + 1) % n) for q in range(n))
    else:
        root = int(fn.split(":")[1])
        for channel, offset, part in reduction.parts(count, element_size, n, traffic_per_byte=1):
            ring = reduction.ring_of(channel, n)
            plan.append((offset, part, ring, (ring.index(root) + 1) % n))
    by_order: dict[tuple[int, ...], list[tuple[int, int]]] = {}
    for offset, length, ring, start in plan:
        by_order.setdefault(tuple(ring[(start + j) % n] for j in range(n)), []).append((offset, length))
    cache_index = count <= _CACHED_INDEX_LIMIT
    return tuple(
        (order, tuple(spans), _span_index(spans) if len(spans) > 4 and cache_index else None)
        for order, spans in by_order.items()
    )


_CACHED_INDEX_LIMIT = 1 << 22
"""Column indexes of calls up to this many elements are kept in the plan cache."""


def _span_index(spans) -> torch.Tensor:
    return torch.cat([torch.arange(o, o + ln) for o, ln in spans])


_HOP_GROUPS = 8
"""Above this many distinct fold orders in one call, `_fold_groups` folds hop by hop over every column at once."""


def _fold_groups(flat: torch.Tensor, groups: Groups, arith: StepArithmetic) -> torch.Tensor:
    """Fold the columns of each group in its order: the first rank's own value, then each next rank's own
    value plus the partial it received. ``flat`` is ``[n, *batch, columns]``: every batch item alike."""
    if len(groups) > _HOP_GROUPS:
        return _fold_hops(flat, groups, arith)
    out = torch.empty_like(flat[0])
    for order, spans, index in groups:
        if index is None and len(spans) > 4:
            index = _span_index(spans)
        if index is None:
            for offset, length in spans:
                out[..., offset : offset + length] = _fold_rows(flat[..., offset : offset + length], order, arith)
            continue
        index = index.to(flat.device)
        out.index_copy_(-1, index, _fold_rows(flat.index_select(-1, index), order, arith))
    return out


def _fold_hops(flat: torch.Tensor, groups: Groups, arith: StepArithmetic) -> torch.Tensor:
    """`_fold_groups` for many orders (a short ring loop on many ranks has up to ``n`` chunk starts): the rows
    of each span are first put in its fold order (one ``index_select`` per span), then every column is folded
    at once, hop by hop: ``spans + n`` operations instead of ``spans * n`` (``n**2`` small ones at world 512),
    for one extra copy of the input. Same operations on the same operands, in the same order."""
    ordered = torch.empty_like(flat)
    for order, spans, _ in groups:
        rows = torch.tensor(order, device=flat.device)
        for offset, length in spans:
            ordered[..., offset : offset + length] = flat[..., offset : offset + length].index_select(0, rows)
    hops = ordered.unbind(0)
    acc = arith.own(hops[0])
    for hop in hops[1:]:
        acc = arith.own_plus(hop, acc)
    return acc


def _fold_rows(rows: torch.Tensor, order: tuple[int, ...], arith: StepArithmetic) -> torch.Tensor:
    acc = arith.own(rows[order[0]])
    for r in order[1:]:
        acc = arith.own_plus(rows[r], acc)
    return acc


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


def _tree_fold(rows: torch.Tensor, down: TreeDown, root: int, order: list[int], arith: StepArithmetic) -> torch.Tensor:
    """Each rank's own value plus its children's partial sums in ``down`` order, leaves first."""
    partial: dict[int, torch.Tensor] = {}
    for r in order:
        children = [partial.pop(child) for child in down[r]]
        acc = arith.own_plus(rows[r], children[0]) if children else arith.own(rows[r])
        for child in children[1:]:
            acc = arith.plus(acc, child)
        partial[r] = acc
    out = partial[root]
    return out.clone() if out.data_ptr() == rows[root].data_ptr() else out
