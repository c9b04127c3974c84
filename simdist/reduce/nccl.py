"""`Nccl`: the order in which NCCL's all-reduce sums, rebuilt from NCCL's source.

**Not yet confirmed on hardware.** No GPU was available when this was written.
The model follows the source; `experiments/nccl_fingerprint.py` is the check
against real NCCL (it runs fingerprint inputs under torchrun and reports model
== real per case). Until that has run, treat a bitwise claim about NCCL built
on this model as a prediction.

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

1. **Channels used.** The communicator has ``C`` channels (``channels`` here;
   ``NCCL_MIN_NCHANNELS = NCCL_MAX_NCHANNELS = C`` pins it, otherwise topology
   search chooses it). For one call NCCL may use fewer: starting from ``C`` it
   drops one channel while ``N*e < nc * nt * th`` (``nt`` threads per block and
   ``th`` bytes per thread of the chosen algorithm/protocol: Simple 64, LL 8
   (times ``n`` for the ring), LL128 8; ``nt`` is 512 for Simple and LL, 640 for
   LL128, and 256 for Ring/Simple on PCIe-only machines). ``task_channels``
   overrides the result.
2. **Split across channels** ("continuous byte distribution"). Traffic per byte
   is 2 for an all-reduce (times 4 for LL); the buffer is cut in *cells* of
   ``roundup16(ceil(32 KiB / traffic_per_byte))`` bytes; each channel gets about
   ``roundup16(max(32 KiB, traffic) / nc)`` bytes of traffic (16 KiB and
   ``max(16 KiB, traffic / nc)`` before 2.29), i.e. a whole number of
   cells: a first channel, middle channels of equal size and a last channel
   that takes the remainder (the last cell is short when ``N*e`` is not a
   multiple of the cell). Channels are contiguous in the buffer, in channel order.
3. **Ring, per channel.** The channel's part is walked in loops of ``n * K``
   elements, ``K`` = the chunk: ``buffsize / 8 * 4`` bytes for Simple (2 MiB by
   default, ``NCCL_BUFFSIZE``), ``ll_buffsize / 8 / 2`` for LL (32 KiB),
   ``ll128_buffsize / 8 * 15 / 16`` for LL128 (562.5 KiB), rounded down to the
   protocol's grain. In the last, short loop of ``r`` elements the chunk becomes
   ``roundup(ceil(r / n), 16 / e)``. Chunk ``j`` of a loop is reduce-scattered so
   that its final sum lands on ring position ``j``: it starts as the value of
   ring position ``j + 1``, travels to ``j + 2``, ... and each rank adds its own
   value on arrival (one rounding to the dtype per hop), ending at position ``j``;
   the all-gather then copies it round the ring unchanged. So element-wise::

       ((x[p(j+1)] + x[p(j+2)]) + x[p(j+3)]) + ... + x[p(j)]     (positions mod n)

   where ``p(i)`` is the rank at ring position ``i`` of that channel's ring,
   position 0 being rank 0 (NCCL logs each ring from rank 0 as
   ``Channel xx/yy : 0 ...`` with ``NCCL_DEBUG=INFO``; pass it as ``rings``).
   Slices, steps and protocol packing change how bytes move, never which values
   meet in which order.
4. **Tree, per channel.** Each rank combines its own value with the partial
   sums received from its children, in the order of its ``down`` list:
   ``((x[r] + s[down0]) + s[down1]) + s[down2]``; the root's sum is broadcast
   unchanged. Within a node the tree is a chain (the intra-node tree graph of
   the channel), so on one node the sum is the fold from the chain's tail:
   ``(x[c[n-1]] + x[c[n-2]]) + ... + x[c[0]]``. Across nodes NCCL links the
   nodes in a double binary tree (channels in the first half use tree 0, the
   duplicated half tree 1, mirrored for an even node count, shifted for odd);
   `double_binary_trees` builds those ``down`` tables. Chunking does not change
   a tree's order, only which channel (tree) an element belongs to.
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
   they are exact; with several rings this model assumes the same protocol
   knob for these calls.
7. **Layout.** torch's NCCL backend passes NCCL the storage of a tensor that is
   contiguous in its suggested memory format, so a channels-last tensor is
   chunked in memory order; other strided tensors it refuses with
   ``ValueError("Tensors must be contiguous")``, as `storage_flat` does.

Consequences: 2 ranks are one add in every configuration. For small tensors on
the default Simple ring the chunks are ``roundup(ceil(N_channel / n), 16 / e)``
elements, so up to ``n`` different starting ranks appear within a few hundred
bytes; one channel's chunk starts repeat every ``n * K`` elements.

What the model cannot know (explicit parameters, read them from
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
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from simdist.numerics.rounding import round_to
from simdist.reduce.base import AvgMode, ReduceOp, ReductionModel, Tensors, as_stacked

NCCL_VERSION = "v2.30.7-1"
NCCL_COMMIT = "73cf112295c33aee2b895f329f592f2a9b4b0f97"

Algorithm = Literal["ring", "tree"]
Protocol = Literal["simple", "ll", "ll128"]
ALGORITHMS: tuple[str, ...] = ("ring", "tree")
PROTOCOLS: tuple[str, ...] = ("simple", "ll", "ll128")

NCCL_STEPS = 8
"""Slots per connection buffer (``NCCL_STEPS``)."""
DEFAULT_BUFFSIZE = 1 << 22
"""Simple protocol buffer per connection (``NCCL_BUFFSIZE``, 4 MiB)."""
DEFAULT_LL_BUFFSIZE = 8 * 512 * NCCL_STEPS * 16
"""LL buffer (``NCCL_LL_BUFFSIZE``): 8 lines x 512 threads x 8 steps x 16-byte lines."""
DEFAULT_LL128_BUFFSIZE = 120 * 640 * NCCL_STEPS * 8
"""LL128 buffer (``NCCL_LL128_BUFFSIZE``): 120 words x 640 threads x 8 steps x 8 bytes."""
GRAIN_BYTES = {"simple": 512, "ll": 16, "ll128": 32 * 8 // 16 * 15 * 8}
"""Chunk sizes are whole multiples of these (``ncclProtoGrainSize``)."""
MIN_TRAFFIC_PER_CHANNEL = 32 << 10
"""Smallest traffic a channel is given (NCCL 2.29 and later; 16 KiB in 2.26-2.28)."""
VERSIONS: tuple[tuple[int, int], ...] = ((2, 26), (2, 27), (2, 28), (2, 29), (2, 30))
"""NCCL releases whose source this model was checked against (the ordering code is the same in all)."""
MAX_CHANNELS = 64
_DEFAULT_THREADS = {"simple": 512, "ll": 512, "ll128": 640}
_THREAD_THRESHOLD = {"simple": 64, "ll": 8, "ll128": 8}


def _div_up(a: int, b: int) -> int:
    return -(-a // b)


def _align_up(a: int, b: int) -> int:
    return _div_up(a, b) * b


def task_channels(
    nbytes: int,
    channels: int,
    nranks: int,
    algorithm: Algorithm = "ring",
    protocol: Protocol = "simple",
    nthreads: int | None = None,
) -> int:
    """Channels one collective of ``nbytes`` uses out of the communicator's ``channels``.

    NCCL drops channels while ``nbytes < nc * nthreads * threshold`` (step 1 of
    the module docstring); ``nthreads`` defaults to NCCL's NVLink default for
    the protocol.
    """
    nt = _DEFAULT_THREADS[protocol] if nthreads is None else nthreads
    threshold = _THREAD_THRESHOLD[protocol] * (nranks if (algorithm, protocol) == ("ring", "ll") else 1)
    nc = channels
    while nbytes < nc * nt * threshold and nc >= 2:
        nc -= 1
    return nc


def channel_parts(
    count: int,
    element_size: int,
    protocol: Protocol,
    channels: int,
    used_channels: int,
    traffic_per_byte: int = 2,
    nccl_version: tuple[int, int] = (2, 30),
) -> list[tuple[int, int, int]]:
    """``(channel, offset, count)`` of each channel's part of a ``count``-element buffer.

    NCCL's continuous byte distribution for one collective alone in its plan
    (step 2 of the module docstring). ``traffic_per_byte`` is 2 for all-reduce,
    ``n`` for reduce-scatter and all-gather, 1 otherwise.
    """
    if count == 0:
        return []
    per_byte = traffic_per_byte * (4 if protocol == "ll" else 1)
    if nccl_version >= (2, 29):
        min_traffic = MIN_TRAFFIC_PER_CHANNEL
        traffic = max(min_traffic, count * element_size * per_byte)
        per_channel = _div_up(traffic // min(used_channels, channels), 16) * 16
    else:  # 2.26-2.28: 16 KiB minimum, no rounding of the per-channel traffic
        min_traffic = 16 << 10
        traffic = max(min_traffic, count * element_size * per_byte)
        per_channel = max(min_traffic, traffic // min(used_channels, channels))
    cell = _div_up(_div_up(min_traffic, per_byte), 16) * 16
    per_cell = cell // element_size
    cells = _div_up(count * element_size, cell)
    cell_traffic = cell * per_byte
    cells_per_channel = min(cells, _div_up(per_channel, cell_traffic))
    cells_lo = cells if channels == 1 else min(cells, _div_up(per_channel, cell_traffic))
    n_mid = (cells - cells_lo) // cells_per_channel
    cells_hi = (cells - cells_lo) % cells_per_channel
    n_used = (cells_lo != 0) + n_mid + (cells_hi != 0)
    if channels < n_used:  # more parts than channels: spread the rest over the channels left
        n_mid = channels - 2
        cells_per_channel = (cells - cells_lo) // (n_mid + 1)
        cells_hi = cells_per_channel + (cells - cells_lo) % (n_mid + 1)
    if cells_hi == 0 and n_mid != 0:
        cells_hi = cells_per_channel
        n_mid -= 1
    counts = [cells_lo * per_cell] + [cells_per_channel * per_cell] * n_mid
    if cells_hi:
        counts.append(cells_hi * per_cell)
    counts[-1] -= cells * per_cell - count
    parts, offset = [], 0
    for channel, part in enumerate(counts):
        parts.append((channel, offset, part))
        offset += part
    return parts


def ring_chunk_elements(
    protocol: Protocol,
    element_size: int,
    buffsize: int = DEFAULT_BUFFSIZE,
    ll_buffsize: int = DEFAULT_LL_BUFFSIZE,
    ll128_buffsize: int = DEFAULT_LL128_BUFFSIZE,
) -> int:
    """Elements per ring chunk ``K`` in a full loop (step 3 of the module docstring)."""
    if protocol == "simple":
        chunk = buffsize // NCCL_STEPS * (NCCL_STEPS // 2)
    elif protocol == "ll":
        chunk = ll_buffsize // NCCL_STEPS // 2
    else:
        chunk = ll128_buffsize // NCCL_STEPS // 16 * 15
    grain = GRAIN_BYTES[protocol]
    chunk = chunk // grain * grain
    if chunk <= 0:
        raise ValueError(f"buffer size too small for one {grain}-byte {protocol} grain per chunk")
    return chunk // grain * (grain // element_size)


def ring_segments(part_count: int, nranks: int, chunk: int, element_size: int) -> list[tuple[int, int, int]]:
    """``(offset, length, start position)`` of each ring chunk in one channel's part.

    ``start position`` is the ring position whose value the chunk's fold starts
    with (``j + 1 mod n`` for chunk ``j`` of a loop).
    """
    segments = []
    loop = nranks * chunk
    align = max(1, 16 // element_size)
    offset = 0
    while offset < part_count:
        rest = part_count - offset
        k = chunk if rest >= loop else _align_up(_div_up(rest, nranks), align)
        for j in range(nranks):
            lo = j * k
            if lo >= min(loop, rest):
                break
            segments.append((offset + lo, min(k, rest - lo), (j + 1) % nranks))
        offset += loop
    return segments


def btree(nranks: int, rank: int) -> tuple[int, int, int, int]:
    """``(up, down0, down1, child_type)`` of ``rank`` in NCCL's binary tree over ``nranks`` (root 0).

    ``child_type`` is 0 when ``rank`` is its parent's first child, else 1.
    """
    bit = 1
    while bit < nranks and not bit & rank:
        bit <<= 1
    if rank == 0:
        return -1, -1, (bit >> 1 if nranks > 1 else -1), 0
    up = (rank ^ bit) | (bit << 1)
    if up >= nranks:
        up = rank ^ bit
    low = bit >> 1
    down0 = -1 if low == 0 else rank - low
    down1 = -1 if low == 0 else rank + low
    while down1 >= nranks:
        down1 = -1 if low == 0 else rank + low
        low >>= 1
    return up, down0, down1, (0 if rank < up else 1)


def dtree(nranks: int, rank: int) -> tuple[tuple[int, int, int, int], tuple[int, int, int, int]]:
    """NCCL's double binary tree: ``rank``'s ``btree`` entry in tree 0 and in tree 1.

    Tree 1 mirrors tree 0 (``r -> nranks-1-r``) for an even ``nranks``, shifts it
    by one for an odd one.
    """
    first = btree(nranks, rank)
    if nranks % 2:
        up, d0, d1, kind = btree(nranks, (rank - 1) % nranks)
        up, d0, d1 = (-1 if v == -1 else (v + 1) % nranks for v in (up, d0, d1))
    else:
        up, d0, d1, kind = btree(nranks, nranks - 1 - rank)
        up, d0, d1 = (-1 if v == -1 else nranks - 1 - v for v in (up, d0, d1))
    return first, (up, d0, d1, kind)


TreeDown = tuple[tuple[int, ...], ...]
"""A tree as ``down[r]``: the children of rank ``r`` in the order its reduce step adds them."""
TreePattern = Literal["tree", "split", "balanced"]


def chain_tree(order: Sequence[int]) -> TreeDown:
    """The single-node tree: a chain ``order[0] <- order[1] <- ...`` (root ``order[0]``)."""
    down: list[tuple[int, ...]] = [()] * len(order)
    for parent, child in itertools.pairwise(order):
        down[parent] = (child,)
    return tuple(down)


def double_binary_trees(nodes: Sequence[Sequence[int]], pattern: TreePattern = "tree") -> tuple[TreeDown, TreeDown]:
    """NCCL's two trees over several nodes, as ``down`` tables (tree 0, tree 1).

    ``nodes[k]`` is node ``k``'s intra-node chain (head first), nodes in NCCL's
    node order. ``pattern`` is the tree graph's pattern: ``tree`` (the head
    talks to parent and children), ``split`` (the head to the parent, the
    second rank to the children), ``balanced`` (the second rank to child 0,
    the head to child 1).
    """
    n_nodes = len(nodes)
    if pattern != "tree" and any(len(chain) < 2 for chain in nodes):
        raise ValueError(f"pattern {pattern!r} needs at least 2 ranks per node")
    nranks = sum(len(chain) for chain in nodes)
    parent_rank = [chain[0] for chain in nodes]
    child0_rank = [chain[0 if pattern == "tree" else 1] for chain in nodes]
    child1_rank = [chain[1 if pattern == "split" else 0] for chain in nodes]
    trees = []
    for which in (0, 1):
        down: list[list[int]] = [[] for _ in range(nranks)]
        for chain in nodes:
            for parent, child in itertools.pairwise(chain):
                down[parent].append(child)
        for node in range(n_nodes):
            _, d0, d1, _ = dtree(n_nodes, node)[which]
            if d0 != -1:
                down[child0_rank[node]].append(parent_rank[d0])
            if d1 != -1:
                down[child1_rank[node]].append(parent_rank[d1])
        trees.append(tuple(tuple(d) for d in down))
    return trees[0], trees[1]


def _check_tree(down: TreeDown, n: int) -> tuple[int, list[int]]:
    """The root and a children-first order of a ``down`` table; raises unless it spans ``0..n-1``."""
    if len(down) != n:
        raise ValueError(f"tree has {len(down)} ranks, group has {n}")
    children = [c for d in down for c in d]
    roots = sorted(set(range(n)) - set(children))
    if len(roots) != 1 or sorted(children) != sorted(set(children)):
        raise ValueError(f"down table {down} is not a tree over ranks 0..{n - 1}")
    order, stack = [], [roots[0]]
    while stack:
        r = stack.pop()
        order.append(r)
        stack.extend(down[r])
    if len(order) != n:
        raise ValueError(f"down table {down} is not a tree: root {roots[0]} does not reach every rank")
    return roots[0], order[::-1]


def premul_scale(n: int, dtype: torch.dtype) -> torch.Tensor:
    """NCCL's AVG factor for floating ``dtype``: ``1/n`` as a double, then float, then ``dtype``."""
    if dtype == torch.float64:
        return torch.tensor(1.0 / n, dtype=torch.float64)
    return torch.tensor(1.0 / n, dtype=torch.float64).to(torch.float32).to(dtype)


def _combine(op: ReduceOp, dtype: torch.dtype) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    if op in (ReduceOp.SUM, ReduceOp.AVG):
        return torch.add
    if getattr(ReduceOp, "PRODUCT", None) is not None and op is ReduceOp.PRODUCT:
        return torch.mul
    floating = dtype.is_floating_point
    if op is ReduceOp.MAX:
        return torch.fmax if floating else torch.maximum
    if op is ReduceOp.MIN:
        return torch.fmin if floating else torch.minimum
    raise ValueError(f"unsupported reduce op {op!r}")


def fma_round(x: torch.Tensor, s: torch.Tensor, acc: torch.Tensor) -> torch.Tensor:
    """``x * s + acc`` rounded once to the dtype (fp32, bf16 or fp16), as a fused multiply-add does.

    The product is exact in fp64; the sum is split into its fp64 rounding and
    the exact error (TwoSum), turned into the round-to-odd fp64 value, and
    rounded from there, which is correct for any format of 24 bits or fewer.
    """
    dtype = x.dtype
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"a fused premultiply is modelled for fp32, bf16 and fp16, not {dtype}")
    p = x.double() * s.double()
    a = acc.double()
    total = p + a
    back = total - p
    error = (p - (total - back)) + (a - back)
    even = (total.view(torch.int64) & 1) == 0
    toward = torch.where(error > 0, float("inf"), float("-inf")).to(torch.float64)
    odd = torch.where((error != 0) & even & torch.isfinite(total), torch.nextafter(total, toward), total)
    return round_to(odd, dtype)


@dataclass(frozen=True)
class _Arith:
    """How one step combines values: a rank's own value alone, own value plus the first received
    partial, and a further received partial (NCCL's reduceCopy: sources in order, own value first)."""

    combine: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    scale: torch.Tensor | None = None  # set for a premultiply fused with the first add

    def own(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.scale is None else x * self.scale

    def own_plus(self, x: torch.Tensor, received: torch.Tensor) -> torch.Tensor:
        return self.combine(x, received) if self.scale is None else fma_round(x, self.scale, received)

    def plus(self, acc: torch.Tensor, received: torch.Tensor) -> torch.Tensor:
        return self.combine(acc, received)


@dataclass(frozen=True, repr=False)
class Nccl(ReductionModel):
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
            raise ValueError(f"algorithm must be one of {', '.join(ALGORITHMS)}, got {self.algorithm!r}")
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"protocol must be one of {', '.join(PROTOCOLS)}, got {self.protocol!r}")
        if not 1 <= self.channels <= MAX_CHANNELS:
            raise ValueError(f"channels must be in 1..{MAX_CHANNELS}, got {self.channels}")
        if self.task_channels is not None and not 1 <= self.task_channels <= self.channels:
            raise ValueError(f"task_channels must be in 1..channels={self.channels}, got {self.task_channels}")
        for name in ("buffsize", "ll_buffsize", "ll128_buffsize"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        object.__setattr__(self, "nccl_version", tuple(int(v) for v in self.nccl_version)[:2])
        if self.nccl_version not in VERSIONS:
            valid = ", ".join(f"{a}.{b}" for a, b in VERSIONS)
            raise ValueError(f"nccl_version must be one of {valid} (the releases read), got {self.nccl_version}")
        if self.avg not in ("premul", "postdiv"):
            raise ValueError(f"avg must be 'premul' or 'postdiv', got {self.avg!r}")
        if self.rings is not None:
            object.__setattr__(self, "rings", tuple(tuple(int(r) for r in ring) for ring in self.rings))
            if not self.rings:
                raise ValueError("rings must name at least one ring")
        if self.trees is not None:
            object.__setattr__(self, "trees", tuple(tuple(tuple(d) for d in t) for t in self.trees))
            if not self.trees:
                raise ValueError("trees must name at least one tree")

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
            raise ValueError(f"ring {list(ring)} is not a permutation of the {n} group ranks")
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
            raise ValueError("element_orders is defined for the ring; a tree is not a fold")
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

    def _tree(self, flat: torch.Tensor, arith: _Arith) -> torch.Tensor:
        """The tree all-reduce of ``[n, *batch, columns]``: each channel's part folded up its tree."""
        out = torch.empty_like(flat[0])
        for channel, offset, part in self.parts(flat.shape[-1], flat.element_size(), flat.shape[0]):
            down = self.tree_of(channel, flat.shape[0])
            root, order = _check_tree(down, flat.shape[0])
            out[..., offset : offset + part] = _tree_fold(flat[..., offset : offset + part], down, root, order, arith)
        return out

    def sum_many(self, stacked: torch.Tensor, shape: Sequence[int] | None = None) -> torch.Tensor:
        """`ReductionModel.sum_many`: many independent all-reduces at once, ``[n, *batch, *shape] -> [*batch, *shape]``.

        Each batch item gets the bits `reduce` gives it alone (row-major members of ``prod(shape)`` elements):
        the schedule (channels, chunks, rings, trees) is that of one member, and every operation is element-wise
        along the batch dimension, so the rank-batched engine runs no per-item loop.
        """
        n = stacked.shape[0]
        shape = tuple(stacked.shape[2:]) if shape is None else tuple(shape)
        batch = tuple(stacked.shape[1 : stacked.dim() - len(shape)])
        numel = math.prod(shape)
        if n == 1 or numel == 0:  # one rank copies (as `reduce` does): no schedule to follow
            return stacked[0].clone()
        flat = stacked.reshape(n, -1, numel)
        arith = _Arith(_combine(ReduceOp.SUM, stacked.dtype))
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
            raise ValueError(f"reduce_scatter needs numel divisible by the group size {n}, got {flat.shape[1]}")
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
            raise ValueError(f"reduce_scatter needs a list of {n} tensors from each of the {n} members")
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
            raise ValueError(f"root {root} is not a rank of a group of {n}")
        flat, arith, finish = self._prepare(flat, op)
        if n == 1:
            return restore(finish(arith.own(flat[0]).clone()))
        groups = _groups(self, f"reduce:{root}", flat.shape[1], flat.element_size(), n)
        return restore(finish(_fold_groups(flat, groups, arith)))

    def _prepare(self, flat: torch.Tensor, op: ReduceOp):
        """The inputs as the kernels combine them, the step arithmetic, and the step applied to the result."""
        n = flat.shape[0]
        combine = _combine(op, flat.dtype)
        if op is not ReduceOp.AVG:
            return flat, _Arith(combine), _identity
        if not flat.dtype.is_floating_point:
            return flat, _Arith(combine), lambda out: torch.div(out, n, rounding_mode="trunc")
        if self.avg == "postdiv":
            return flat, _Arith(combine), lambda out: out / n
        scale = premul_scale(n, flat.dtype).to(flat.device)
        if self.premul_fma:
            return flat, _Arith(combine, scale), _identity
        return flat * scale, _Arith(combine), _identity


Groups = tuple[tuple[tuple[int, ...], tuple[tuple[int, int], ...], torch.Tensor | None], ...]


@functools.lru_cache(maxsize=256)
def _groups(model: Nccl, fn: str, count: int, element_size: int, n: int) -> Groups:
    """The ring plan of a call grouped by fold order: ``(order, spans, column index or None)``.

    ``fn`` is ``all_reduce``, ``reduce_scatter`` (``count`` = the whole input)
    or ``reduce:<root>``. Cached: a call's plan depends only on these arguments.
    """
    plan: list[tuple[int, int, tuple[int, ...], int]] = []
    if fn == "all_reduce":
        plan = [(o, ln, model.ring_of(c, n), s) for o, ln, c, s in model.ring_plan(count, element_size, n)]
    elif fn == "reduce_scatter":
        block = count // n
        for channel, offset, part in model.parts(block, element_size, n, traffic_per_byte=n,
                                                 nbytes=count * element_size):  # fmt: skip
            ring = model.ring_of(channel, n)
            plan.extend((q * block + offset, part, ring, (ring.index(q) + 1) % n) for q in range(n))
    else:
        root = int(fn.split(":")[1])
        for channel, offset, part in model.parts(count, element_size, n, traffic_per_byte=1):
            ring = model.ring_of(channel, n)
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


def _fold_groups(flat: torch.Tensor, groups: Groups, arith: _Arith) -> torch.Tensor:
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


def _fold_hops(flat: torch.Tensor, groups: Groups, arith: _Arith) -> torch.Tensor:
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


def _fold_rows(rows: torch.Tensor, order: tuple[int, ...], arith: _Arith) -> torch.Tensor:
    acc = arith.own(rows[order[0]])
    for r in order[1:]:
        acc = arith.own_plus(rows[r], acc)
    return acc


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


_CHANNELS_LAST = {4: (torch.channels_last, (0, 2, 3, 1)), 5: (torch.channels_last_3d, (0, 2, 3, 4, 1))}


def _memory_order(t: torch.Tensor) -> tuple[int, ...] | None:
    """The dims of ``t`` in memory order when torch's NCCL backend accepts it; None for row-major."""
    if t.is_contiguous():
        return None
    fmt, perm = _CHANNELS_LAST.get(t.dim(), (None, None))
    if fmt is not None and t.is_contiguous(memory_format=fmt):
        return perm
    raise ValueError(
        f"Tensors must be contiguous: torch's NCCL backend refuses a tensor of shape {tuple(t.shape)} and "
        f"strides {t.stride()} (only row-major and channels-last tensors reach NCCL)"
    )


def storage_flat(tensors: Tensors) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    """``[n, N]``: each rank's elements in memory order (what NCCL reads), and the map of a flat result back.

    torch's NCCL backend hands NCCL the storage of a tensor that is contiguous in
    its suggested memory format (row-major, or channels-last for 4-d/5-d
    tensors), so chunks and channels are cut in memory order; it refuses
    anything else with ``ValueError("Tensors must be contiguous")``, and so does this.
    """
    per_rank = list(tensors.unbind(0)) if isinstance(tensors, torch.Tensor) else list(tensors)
    if not per_rank:
        raise ValueError("a reduction needs the tensors of at least one rank")
    orders = {_memory_order(t) for t in per_rank}
    if len(orders) > 1:
        raise ValueError("Tensors must be contiguous: the ranks' tensors have different memory formats")
    perm = orders.pop()
    n = len(per_rank)
    if perm is None:
        stacked = as_stacked(tensors)
        shape = stacked.shape[1:]
        return stacked.reshape(n, -1), lambda out: out.reshape(shape)
    stacked = torch.stack([t.permute(perm) for t in per_rank])
    shape = stacked.shape[1:]
    inverse = tuple(sorted(range(len(perm)), key=perm.__getitem__))
    return stacked.reshape(n, -1), lambda out: out.reshape(shape).permute(inverse)


def _tree_fold(rows: torch.Tensor, down: TreeDown, root: int, order: list[int], arith: _Arith) -> torch.Tensor:
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
