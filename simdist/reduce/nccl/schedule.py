"""NCCL's schedule of an all-reduce: channels, the split across them, ring chunks and trees, as NCCL's source
computes them (the version and files read: `simdist.reduce.nccl.reduction`'s docstring, steps 1-4).

Only integers live here: how many channels a call uses (`task_channels`), which bytes each gets
(`channel_parts`), the ring's chunk and segments (`ring_chunk_elements`, `ring_segments`) and the trees
(`btree`, `dtree`, `chain_tree`, `double_binary_trees`, `check_tree`). Which values meet in which order, and
with what rounding, is `simdist.reduce.nccl.reduction.Nccl`'s job; NCCL's kernels simulated step by step
(`simdist.testing._internal.nccl_sim`) check both.

How NCCL orders an all-reduce of ``N`` elements of ``e`` bytes on ``n`` ranks (steps 5-7, the operations,
reduce_scatter/reduce and the layout, are in `simdist.reduce.nccl.reduction`):

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
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Literal

from simdist.errors import UsageError

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
"""NCCL releases whose source this reduction was checked against (the ordering code is the same in all)."""
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
        raise UsageError(f"buffer size too small for one {grain}-byte {protocol} grain per chunk")
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
        raise UsageError(f"pattern {pattern!r} needs at least 2 ranks per node")
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


def check_tree(down: TreeDown, n: int) -> tuple[int, list[int]]:
    """The root and a children-first order of a ``down`` table; raises unless it spans ``0..n-1``."""
    if len(down) != n:
        raise UsageError(f"tree has {len(down)} ranks, group has {n}")
    children = [c for d in down for c in d]
    roots = sorted(set(range(n)) - set(children))
    if len(roots) != 1 or sorted(children) != sorted(set(children)):
        raise UsageError(f"down table {down} is not a tree over ranks 0..{n - 1}")
    order, stack = [], [roots[0]]
    while stack:
        r = stack.pop()
        order.append(r)
        stack.extend(down[r])
    if len(order) != n:
        raise UsageError(f"down table {down} is not a tree: root {roots[0]} does not reach every rank")
    return roots[0], order[::-1]
