"""A literal, slow simulation of NCCL's ring and tree kernels, as a reference for `Nccl`.

`Nccl` computes NCCL's order in a vectorised way (one fold per distinct
order). This module instead walks the kernels step by step, every rank with
its own buffers and every message passed explicitly, as ``runRing`` and
``runTreeSplit`` in ``src/device/all_reduce.h``, ``reduce_scatter.h`` and
``reduce.h`` of NCCL v2.30.7 do: per channel part, per loop, step 0 sends,
``n - 2`` receive-reduce-send steps, the final reduce, the all-gather copies.
A reduce step adds the rank's own value to what it received. The channel split
and chunk size come from `Nccl` itself (they are pinned separately by tests).

It returns what every rank holds, so a test can also check that all ranks end
with the same bits. Inputs must already be premultiplied for AVG; only SUM is
simulated. Only for tests and ``experiments/nccl_fingerprint.py --dry-run``.
"""

from __future__ import annotations

import torch

from simdist.reduce.nccl import Nccl
from simdist.reduce.nccl.schedule import ring_chunk_elements


def _span(base: int, elem: int, rem: int, chunk: int, c: int) -> slice:
    """Elements of chunk ``c`` of the loop at ``elem`` (NCCL's ``min(chunk, rem - c * chunk)``, maybe empty)."""
    lo = base + elem + c * chunk
    return slice(lo, lo + max(0, min(chunk, rem - c * chunk)))


def simulate_ring_allreduce(x: torch.Tensor, reduction: Nccl) -> list[torch.Tensor]:
    """Every rank's output of the ring all-reduce of ``x`` (``[n, count]``, group-rank order)."""
    n, count = x.shape
    e = x.element_size()
    align = max(1, 16 // e)
    out = [torch.full((count,), float("nan"), dtype=x.dtype) for _ in range(n)]
    full_chunk = ring_chunk_elements(
        reduction.protocol, e, reduction.buffsize, reduction.ll_buffsize, reduction.ll128_buffsize
    )
    for channel, base, part in reduction.parts(count, e, n):
        ring = reduction.ring_of(channel, n)
        chunk = full_chunk
        loop = n * chunk
        for elem in range(0, part, loop):
            rem = part - elem
            if rem < loop:
                chunk = (rem + n - 1) // n
                chunk = (chunk + align - 1) // align * align
            spans = [_span(base, elem, rem, chunk, c) for c in range(n)]
            # ring index i receives from i - 1; chunk (i - j) mod n is handled at step j.
            wire = [x[ring[i], spans[(i - 1) % n]].clone() for i in range(n)]
            for j in range(2, n):
                wire = [x[ring[i], spans[(i - j) % n]] + wire[i - 1] for i in range(n)]
            final = [x[ring[i], spans[i]] + wire[i - 1] for i in range(n)]
            for i in range(n):
                out[ring[i]][spans[i]] = final[i]
            wire = final
            for j in range(1, n - 1):
                for i in range(n):
                    out[ring[i]][spans[(i - j) % n]] = wire[i - 1]
                wire = [wire[i - 1] for i in range(n)]
            for i in range(n):
                out[ring[i]][spans[(i + 1) % n]] = wire[i - 1]
    return out


def simulate_ring_reduce_scatter(x: torch.Tensor, reduction: Nccl) -> torch.Tensor:
    """``[n, count / n]``: block ``q`` as rank ``q`` receives it from the ring reduce-scatter."""
    n, count = x.shape
    block = count // n
    e = x.element_size()
    out = torch.empty(n, block, dtype=x.dtype)
    for channel, base, part in reduction.parts(block, e, n, traffic_per_byte=n, nbytes=count * e):
        ring = reduction.ring_of(channel, n)
        cols = [slice(q * block + base, q * block + base + part) for q in range(n)]
        # at step j, ring index i works on the block of the rank j places behind it.
        wire = [x[ring[i], cols[ring[(i - 1) % n]]].clone() for i in range(n)]
        for j in range(2, n):
            wire = [x[ring[i], cols[ring[(i - j) % n]]] + wire[i - 1] for i in range(n)]
        for i in range(n):
            out[ring[i], base : base + part] = x[ring[i], cols[ring[i]]] + wire[i - 1]
    return out


def simulate_ring_reduce(x: torch.Tensor, reduction: Nccl, root: int) -> torch.Tensor:
    """What rank ``root`` holds after NCCL's ring reduce (a pipeline from the rank after the root)."""
    n, count = x.shape
    out = torch.empty(count, dtype=x.dtype)
    for channel, base, part in reduction.parts(count, x.element_size(), n, traffic_per_byte=1):
        ring = reduction.ring_of(channel, n)
        cols = slice(base, base + part)
        i = (ring.index(root) + 1) % n
        wire = x[ring[i], cols].clone()
        for _ in range(n - 1):
            i = (i + 1) % n
            wire = x[ring[i], cols] + wire
        out[cols] = wire
    return out


def simulate_tree_allreduce(x: torch.Tensor, reduction: Nccl) -> list[torch.Tensor]:
    """Every rank's output of the tree all-reduce: reduce up each channel's tree, broadcast down."""
    n, count = x.shape
    out = [torch.full((count,), float("nan"), dtype=x.dtype) for _ in range(n)]
    for channel, base, part in reduction.parts(count, x.element_size(), n):
        down = reduction.tree_of(channel, n)
        up = {child: parent for parent in range(n) for child in down[parent]}
        cols = slice(base, base + part)
        inbox: dict[int, list[tuple[int, torch.Tensor]]] = {r: [] for r in range(n)}
        pending = {r: len(down[r]) for r in range(n)}
        ready = [r for r in range(n) if pending[r] == 0]
        while ready:
            r = ready.pop()
            acc = x[r, cols].clone()
            received = dict(inbox[r])
            for child in down[r]:  # sources in the order of the down list
                acc = acc + received[child]
            if r not in up:
                total = acc
                continue
            parent = up[r]
            inbox[parent].append((r, acc))
            pending[parent] -= 1
            if pending[parent] == 0:
                ready.append(parent)
        for r in range(n):
            out[r][cols] = total
    return out
