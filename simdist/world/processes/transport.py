"""Process mode: the ``simdist`` backend in real processes (torchrun, ``simdist.run(where="processes")``).

    torchrun --nproc-per-node 4 train.py      # train.py: import simdist; dist.init_process_group("simdist")
    SIMDIST_REDUCTION=ring torchrun ...       # another reduction (default: gloo)

Each ``simdist`` group owns an inner gloo group over the same store. A
collective first all-gathers every member's call description (op, shapes,
dtypes, split sizes, source line) and checks that they match, raising
`CollectiveMismatchError` with every member's call site on every rank if not;
then the members' input tensors travel as bytes (their memory footprint, so
strided inputs reach the reduction with their strides): one broadcast per member
into a kept buffer; for a broadcast only the root's, for a scatter each
member's own entries from the root (one message each). Each rank then runs the
same ``complete`` as in-process mode for itself alone. The arithmetic is
therefore the reduction's, bit for bit the same as `simdist.run`, and
module-global framework state (DeepSpeed's ``groups``, Megatron's
``parallel_state``) lives in each process as usual. Point-to-point messages
and barriers go straight over the inner gloo group.

The reduction is chosen per process: the reduction `use_reduction` installed in this process (the launcher
`simdist.run` does, for a `Reduction` it was given), else the environment's ``SIMDIST_REDUCTION`` (a
reduction name), else gloo; the removed spelling ``SIMDIST_MODEL`` is refused, not read. Hangs are bounded by the
group's timeout.
"""

from __future__ import annotations

import os
import pickle

import torch
import torch.distributed as dist

from simdist.errors import UsageError
from simdist.reduce import Reduction
from simdist.world.backend.process_group import SimProcessGroup
from simdist.world.errors import CollectiveMismatchError
from simdist.world.options import DEFAULT_REDUCTION, as_reduction
from simdist.world.rendezvous.calls import Call

REDUCTION_ENV = "SIMDIST_REDUCTION"
"""The environment variable naming process mode's reduction."""
REMOVED_ENV = "SIMDIST_MODEL"
"""`REDUCTION_ENV`'s spelling before 0.1.0: refused (a `UsageError`) rather than silently ignored."""


class _Chosen:
    """The reduction installed in this rank process by its launcher (`use_reduction`), if any."""

    reduction: Reduction | None = None


def use_reduction(reduction: Reduction | None) -> None:
    """Make every ``simdist`` group created later in this process use ``reduction`` (``None``: the environment's).

    Called by the launcher in each rank process it starts, before the process's groups exist; a reduction object
    cannot travel in an environment variable."""
    _Chosen.reduction = reduction


def process_reduction() -> Reduction:
    """This process's reduction (see the module docstring)."""
    if _Chosen.reduction is not None:
        return _Chosen.reduction
    if os.environ.get(REMOVED_ENV):
        raise UsageError(f"{REMOVED_ENV} was renamed {REDUCTION_ENV} (same values): set {REDUCTION_ENV} instead")
    return as_reduction(os.environ.get(REDUCTION_ENV) or DEFAULT_REDUCTION, REDUCTION_ENV)


def _flatten(tree) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    return [t for item in tree for t in _flatten(item)]


def _skeleton(tree):
    """The nesting of tuples/lists of tensors, with ``None`` for each tensor (picklable)."""
    if isinstance(tree, torch.Tensor):
        return None
    return (isinstance(tree, list), [_skeleton(x) for x in tree])


def _rebuild(skeleton, tensors: list[torch.Tensor]):
    """A `_skeleton` filled with ``tensors`` in order."""
    it = iter(tensors)

    def walk(node):
        if node is None:
            return next(it)
        is_list, children = node
        items = [walk(x) for x in children]
        return items if is_list else tuple(items)

    return walk(skeleton)


def _footprint(t: torch.Tensor) -> tuple[torch.Tensor, tuple]:
    """The bytes a tensor's view spans and how to view them again (shape, stride, dtype)."""
    t = t.detach()
    if t.numel() == 0:
        return torch.empty(0, dtype=torch.uint8), (tuple(t.shape), tuple(t.stride()), t.dtype, 0)
    span = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
    flat = t.as_strided((span,), (1,))
    return flat.contiguous().view(torch.uint8).reshape(-1), (tuple(t.shape), tuple(t.stride()), t.dtype, span)


def _from_footprint(data: torch.Tensor, meta: tuple) -> torch.Tensor:
    shape, stride, dtype, span = meta
    if span == 0:
        return torch.empty(shape, dtype=dtype)
    flat = data.view(dtype)
    return flat.as_strided(shape, stride)


SCRATCH_BYTES = 256 << 20
"""The largest gather buffer a group keeps between calls (`ProcessTransport._scratch`); larger ones are freed."""


class ProcessTransport:
    """Members are processes: gather every member's call over an inner gloo group, complete for this rank."""

    def __init__(self, inner: dist.ProcessGroup, group_rank: int, group_size: int) -> None:
        self.inner = inner
        self.group_rank = group_rank
        self.group_size = group_size
        self._buffer = torch.empty(0, dtype=torch.uint8)

    def _scratch(self, nbytes: int) -> torch.Tensor:
        """A byte buffer of ``nbytes``: one kept for the group and reused call after call, up to `SCRATCH_BYTES`.

        Each collective gathers every member's inputs into such a buffer, and the other members' tensors are
        views of it until ``complete`` returns. Allocating it afresh each call let glibc's heap grow: 4 ranks
        doing 4 MiB all_reduces went from 279 MB RSS after one call to 687 MB after 21 (real gloo: 241 MB); with
        the buffer kept and no copies of the views, 378 MB after 75 calls, and about 10 % faster."""
        if nbytes > SCRATCH_BYTES:
            return torch.empty(nbytes, dtype=torch.uint8)
        if self._buffer.numel() < nbytes:
            self._buffer = torch.empty(nbytes, dtype=torch.uint8)
        return self._buffer[:nbytes]

    def _gather_bytes(self, payload: torch.Tensor) -> list[torch.Tensor]:
        n = self.group_size
        length = torch.tensor([payload.numel()], dtype=torch.int64)
        lengths = torch.empty(n, dtype=torch.int64)
        self.inner._allgather_base(lengths, length).wait()
        width = int(lengths.max())
        if payload.numel() == width and payload.is_contiguous():
            padded = payload  # every member's length when they are equal: no copy
        else:
            padded = torch.zeros(width, dtype=torch.uint8)
            padded[: payload.numel()] = payload
        gathered = self._scratch(n * width)
        self.inner._allgather_base(gathered, padded).wait()
        return [gathered[i * width : i * width + int(lengths[i])] for i in range(n)]

    def _exchange_bytes(self, payload: torch.Tensor) -> list[torch.Tensor]:
        """Every member's ``payload`` (bytes, lengths may differ), this rank's own as it is: one broadcast per
        member into a slot of the kept buffer. Not an all-gather: gloo's all-gather allocates a temporary of the
        gathered size on every call, which glibc then keeps (4 ranks gathering 4 MiB 60 times: 371 MB peak RSS
        per rank against 259 MB with broadcasts, which write in place; bench/memory.py)."""
        n, me = self.group_size, self.group_rank
        length = torch.tensor([payload.numel()], dtype=torch.int64)
        lengths = torch.empty(n, dtype=torch.int64)
        self.inner._allgather_base(lengths, length).wait()
        sizes = lengths.tolist()
        slots = [-(-size // 64) * 64 for size in sizes]  # each slot 64-byte aligned: every dtype views in place
        gathered = self._scratch(sum(slots) - slots[me])
        out, offset = [], 0
        for r, size in enumerate(sizes):
            if r == me:
                data = payload.contiguous()
            else:
                data, offset = gathered[offset : offset + size], offset + slots[r]
            if size:
                options = dist.BroadcastOptions()
                options.rootRank = r
                self.inner.broadcast([data], options).wait()
            out.append(data)
        return out

    def collective(self, pg: SimProcessGroup, call: Call, complete) -> None:
        mine = _flatten(call.inputs)
        prints = [_footprint(t) for t in mine]
        meta = (call.signature, call.site, call.extra, [m for _, m in prints], _skeleton(call.inputs))
        metas = [pickle.loads(b.numpy().tobytes()) for b in self._gather_bytes(_bytes(pickle.dumps(meta)))]
        calls: list[Call] = []
        for i, (signature, where, extra, _, _) in enumerate(metas):
            calls.append(Call(pg.ranks[i], signature, where, (), (), extra))
        if any(c.signature != calls[0].signature for c in calls):
            lines = "\n  ".join(c.describe() for c in calls)
            raise CollectiveMismatchError(f"collective on {pg.label} does not match:\n  {lines}")
        source = rooted_source(call.signature, pg.ranks)
        wanted: list[bool] | None = None  # which of the root's tensors this rank receives (None: all)
        if source is None:
            blobs: list[torch.Tensor | None] = list(self._exchange_bytes(_joined(prints)))
        elif call.signature[0] == "scatter":  # each member receives its own entries of the root's lists only
            entry_of = _entries(metas[source][4])
            wanted = [entry == self.group_rank for entry in entry_of]
            blobs = [None] * len(calls)
            blobs[source] = self._scatter_entries(prints, metas[source][3], entry_of, source)
        else:  # only the root's tensors are read: they alone travel, once, instead of every member's padded copy
            blobs = [None] * len(calls)
            payload = _joined(prints) if self.group_rank == source else torch.empty(0, dtype=torch.uint8)
            blobs[source] = self._broadcast_bytes(payload, _nbytes(metas[source][3]), source)
        for i, (c, blob) in enumerate(zip(calls, blobs, strict=True)):
            if i == self.group_rank:
                calls[i] = call
                continue
            tensors, offset = [], 0
            for j, m in enumerate(metas[i][3]):
                nbytes = _nbytes([m])
                if blob is None or (wanted is not None and not wanted[j]):
                    # data this rank never reads (another member's, another rank's scatter entry): its layout
                    # only, which the checks read
                    tensors.append(torch.empty_strided(m[0], m[1], dtype=m[2], device="meta"))
                    continue
                tensors.append(_from_footprint(_aligned(blob[offset : offset + nbytes], m[2]), m))
                offset += nbytes
            c.inputs = _rebuild(metas[i][4], tensors)
        complete(calls, [self.group_rank])

    def _scatter_entries(self, prints: list, metas: list, entry_of: list[int], source: int) -> torch.Tensor | None:
        """A scatter's bytes: the root sends each member the footprints of that member's entries (one message);
        every other member returns what it received (None on the root, which reads its own tensors). So a
        non-root holds its own entries only, not the root's whole lists (P=8, 25 MB objects: each rank had
        received all 8)."""
        me = self.group_rank
        if me == source:
            for r in range(self.group_size):
                parts = [prints[j][0] for j, entry in enumerate(entry_of) if entry == r]
                if r == me or not parts:
                    continue
                data = parts[0].contiguous() if len(parts) == 1 else torch.cat(parts)
                if data.numel():
                    self.inner.send([data], r, SCATTER_TAG).wait()
            return None
        nbytes = _nbytes([m for m, entry in zip(metas, entry_of, strict=True) if entry == me])
        data = self._scratch(nbytes)
        if nbytes:
            self.inner.recv([data], source, SCATTER_TAG).wait()
        return data

    def _broadcast_bytes(self, payload: torch.Tensor, nbytes: int, source: int) -> torch.Tensor:
        """Member ``source``'s ``nbytes`` bytes on every member (its own ``payload`` there)."""
        data = payload.contiguous() if self.group_rank == source else self._scratch(nbytes)
        if nbytes:
            options = dist.BroadcastOptions()
            options.rootRank = source
            self.inner.broadcast([data], options).wait()
        return data

    def send(self, pg: SimProcessGroup, call: Call, tensor: torch.Tensor, dst: int, tag: int) -> dist.Work:
        return self.inner.send([tensor], dst, tag)

    def recv(self, pg: SimProcessGroup, call: Call, tensor: torch.Tensor, src: int, tag: int) -> dist.Work:
        return self.inner.recv([tensor], src, tag)

    def recv_any(self, pg: SimProcessGroup, call: Call, tensor: torch.Tensor, tag: int) -> dist.Work:
        return self.inner.recv_anysource([tensor], tag)  # gloo's own: its Work knows the source rank

    def barrier(self) -> None:
        self.inner.barrier().wait()


ROOTED = ("broadcast", "scatter")
"""The collectives whose completion reads the root's tensors only (the others' layouts, for checks)."""


def rooted_source(signature: tuple, ranks: tuple[int, ...]) -> int | None:
    """The group index of the member whose tensors a `ROOTED` collective reads; None for every other one.

    The root is the signature's ``src=<global rank>`` (`simdist.world.collectives.data_movement.broadcast`,
    ``scatter``)."""
    if signature[0] not in ROOTED:
        return None
    source = next(str(d) for d in signature if str(d).startswith("src="))
    return ranks.index(int(source.removeprefix("src=")))


def _joined(prints: list) -> torch.Tensor:
    """The footprints' bytes end to end; one tensor's (every all_reduce) as they are, without a copy."""
    if len(prints) == 1:
        return prints[0][0]
    return torch.cat([p for p, _ in prints]) if prints else torch.empty(0, dtype=torch.uint8)


SCATTER_TAG = 0x5D157
"""The tag of a scatter's messages on the inner group (`ProcessTransport._scatter_entries`), apart from the small
tags programs use for their own point-to-point messages, which share the inner group."""


def _entries(skeleton) -> list[int]:
    """For each tensor of a scatter's inputs (lists of entries, `_skeleton`'s form), in flattened order: its
    index in its list, the group rank it goes to."""
    _, lists = skeleton
    return [i for _, entries in lists for i in range(len(entries))]


def _nbytes(metas: list) -> int:
    """The bytes of the footprints ``metas`` describe (`_footprint`'s ``(shape, stride, dtype, span)``)."""
    return sum(span * torch.empty(0, dtype=dtype).element_size() for _, _, dtype, span in metas)


def _aligned(data: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``data`` (bytes) where it can be viewed as ``dtype`` in place, else a copy that can."""
    size = torch.empty(0, dtype=dtype).element_size()
    return data if data.storage_offset() % size == 0 else data.clone()


def _bytes(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def process_group(store, group_rank: int, group_size: int, ranks: tuple[int, ...], name: str, timeout):
    """The backend's group in a real process: an inner gloo group on the same store carries the calls."""
    inner = dist.ProcessGroupGloo(dist.PrefixStore("simdist-inner/", store), group_rank, group_size, timeout)
    reduction = process_reduction()
    world = int(os.environ.get("WORLD_SIZE", len(ranks)))
    kind = "world" if len(ranks) == world else "group"
    label = f"{kind}{{{','.join(map(str, ranks))}}}" + ("" if kind == "world" else f"#{name}")
    # torch's stub derives ProcessGroupGloo from a Backend stub without the collectives the C++ class binds
    transport = ProcessTransport(inner, group_rank, group_size)  # type: ignore[arg-type]
    return SimProcessGroup(group_rank, group_size, ranks, name, label, reduction, transport)
