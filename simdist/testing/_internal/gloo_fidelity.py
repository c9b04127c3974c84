"""What torch's gloo backend does around the ring, probed by category: a rank program and a comparison table.

`simdist.testing._internal.gloo_probe` pins the ring arithmetic; this module pins the
dispatch around it, found against real gloo (torch 2.13): ``dist.reduce``
above ``2 * n`` MiB (its own segment sizing), complex tensors in
``reduce``/``reduce_scatter_tensor``/list ``reduce_scatter``, ``scatter`` of
transposed entries (storage order), bool SUM bytes, and every refusal (dtypes
gloo has no kernel for, complex ``gather``, non-contiguous ``send``,
mismatched list entries, ...). A `Probe` is plain data; its inputs are made
inside each rank from a seed (big probes would not pickle cheaply), so the
same `run_probes` runs on real gloo processes, on `simdist.run` threads and
in process mode, and `tally` counts, per category, the silent differences
(both succeed, storage bytes differ) and refusal mismatches (one side raises,
or the exception types differ). ``experiments/gloo_corners.py`` prints the
table; ``tests/integration/test_gloo_corners.py`` asserts it.

Outcomes are storage bytes (``uint8`` views): a bool byte 3 or a NaN payload
is compared as it lies in memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from simdist.errors import UsageError
from simdist.reduce.gloo import GLOO_MAX_SEGMENT_BYTES

UNSUPPORTED = (torch.int16, torch.uint16, torch.uint32, torch.uint64, torch.float8_e4m3fn, torch.float8_e5m2)
"""dtypes torch's gloo backend has no collective kernel for ("Invalid scalar type")."""
SUPPORTED: tuple[torch.dtype, ...] = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8)
SUPPORTED += (torch.uint8, torch.int32, torch.int64, torch.bool)
MOVERS = ("broadcast", "all_gather", "all_gather_into_tensor", "all_to_all", "all_to_all_single", "gather", "scatter")
REDUCERS = ("all_reduce", "reduce", "reduce_scatter_tensor", "reduce_scatter")


@dataclass(frozen=True)
class Probe:
    """One collective on the world group: ``kind``, input ``dtype`` and ``shape`` (per member, or per list entry),
    ``op`` (reductions), ``variant`` (a layout or a malformed call), ``seed`` for the inputs, ``category``."""

    name: str
    category: str
    kind: str
    dtype: torch.dtype = torch.float32
    shape: tuple[int, ...] = (6,)
    op: str = "SUM"
    variant: str = ""
    root: int = 0
    seed: int = 0


@dataclass(frozen=True)
class Seen:
    """What one rank saw: the storage bytes of its outputs, or an exception's type and first line."""

    data: torch.Tensor | None = None
    error: str | None = None
    message: str = ""


def make(shape: Sequence[int], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Deterministic inputs: normal values times ``2**k`` (``k`` in [-20, 20]) for floats, both parts for
    complex, small integers, random bools (built without ``exp2``, whose bits vary by code path)."""
    gen = torch.Generator().manual_seed(seed)
    shape = tuple(shape)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if dtype.is_complex:
        part = torch.float32 if dtype == torch.complex64 else torch.float64
        return torch.complex(make(shape, part, seed + 7919), make(shape, part, seed + 104729))
    if dtype.is_floating_point and dtype.itemsize > 1:
        k = torch.randint(-20, 21, shape, generator=gen, dtype=torch.int32)
        return (torch.randn(shape, generator=gen) * ((k + 127) << 23).view(torch.float32)).to(dtype)
    return torch.randint(0, 100, shape, generator=gen).to(dtype)


def storage_bytes(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The tensors' elements as they lie in memory, as bytes (bool bytes such as 3 are kept)."""
    parts = []
    for t in tensors:
        t = t.detach()
        if t.dtype == torch.bool:
            t = t.view(torch.uint8)
        parts.append(t.contiguous().reshape(-1).view(torch.uint8))
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)


def _op(name: str):
    import torch.distributed as dist

    return getattr(dist.ReduceOp, name)


def _reduce_scatter_input(p: Probe, world: int, seed: int) -> torch.Tensor:
    """The ``[world x rows, ...]`` input of a reduce_scatter_tensor probe, in ``p.variant``'s layout: with gaps
    (every other row), of the right numel but another dim 0, an expanded (stride 0) row, or contiguous."""
    rows = (world * p.shape[0], *p.shape[1:])
    if p.variant == "gaps":
        return make((2 * rows[0], *rows[1:]), p.dtype, seed)[::2]
    if p.variant == "dim 0 mismatch":  # same numel, but output dim 0 x P != input dim 0
        return make((rows[0] * rows[1] // 2, 2), p.dtype, seed)
    if p.variant == "expand":
        return make((1, *rows[1:]), p.dtype, seed).expand(rows)
    return make(rows, p.dtype, seed)


def _scatter_entries(p: Probe, world: int, seed: int) -> list[torch.Tensor]:
    """The root's ``world`` entries of a scatter probe, in ``p.variant``'s layout (transposed, with gaps, or
    contiguous)."""
    if p.variant == "transposed":  # entry j: x.t() of a contiguous x
        return [make(p.shape[::-1], p.dtype, seed * 31 + j).t() for j in range(world)]
    if p.variant == "gaps":
        return [make((p.shape[0], 2 * p.shape[1]), p.dtype, seed * 31 + j)[:, ::2] for j in range(world)]
    return [make(p.shape, p.dtype, seed * 31 + j) for j in range(world)]


def _run_one(p: Probe, rank: int, world: int) -> list[torch.Tensor]:
    """Run probe ``p`` on this rank; returns the tensors whose bytes are its outcome."""
    import torch.distributed as dist

    seed = p.seed * 1000 + rank
    if p.kind == "all_reduce":
        t = make(p.shape, p.dtype, seed)
        dist.all_reduce(t, _op(p.op))
        return [t]
    if p.kind == "reduce":
        t = make(p.shape, p.dtype, seed)
        dist.reduce(t, p.root, _op(p.op))
        return [t]
    if p.kind == "reduce_scatter_tensor":
        out = torch.zeros(p.shape, dtype=p.dtype)
        dist.reduce_scatter_tensor(out, _reduce_scatter_input(p, world, seed), _op(p.op))
        return [out]
    if p.kind == "reduce_scatter":
        entry = (p.shape[0] + 1, *p.shape[1:]) if p.variant == "mismatched entries" else p.shape
        inputs = [make(entry, p.dtype, seed * 31 + j) for j in range(world)]
        out = torch.zeros(p.shape, dtype=p.dtype)
        dist.reduce_scatter(out, inputs, _op(p.op))
        return [out]
    if p.kind == "broadcast":
        t = make(p.shape, p.dtype, seed)
        dist.broadcast(t, p.root)
        return [t]
    if p.kind == "all_gather":
        outs = [torch.zeros(p.shape, dtype=p.dtype) for _ in range(world)]
        dist.all_gather(outs, make(p.shape, p.dtype, seed))
        return outs
    if p.kind == "all_gather_into_tensor":
        out = torch.zeros((world * p.shape[0], *p.shape[1:]), dtype=p.dtype)
        dist.all_gather_into_tensor(out, make(p.shape, p.dtype, seed))
        return [out]
    if p.kind == "all_to_all":
        outs = [torch.zeros(p.shape, dtype=p.dtype) for _ in range(world)]
        dist.all_to_all(outs, [make(p.shape, p.dtype, seed * 31 + j) for j in range(world)])
        return outs
    if p.kind == "all_to_all_single":
        out = torch.zeros((world * p.shape[0], *p.shape[1:]), dtype=p.dtype)
        dist.all_to_all_single(out, make((world * p.shape[0], *p.shape[1:]), p.dtype, seed))
        return [out]
    if p.kind == "gather":
        gathered = [torch.zeros(p.shape, dtype=p.dtype) for _ in range(world)] if rank == p.root else None
        dist.gather(make(p.shape, p.dtype, seed), gathered, p.root)
        return gathered or []
    if p.kind == "scatter":
        out = torch.zeros(p.shape, dtype=p.dtype)
        dist.scatter(out, _scatter_entries(p, world, seed) if rank == p.root else None, p.root)
        return [out]
    if p.kind == "send":  # a non-contiguous send: gloo refuses it at the sender (nobody receives)
        if rank == 0:
            dist.send(make(p.shape[::-1], p.dtype, seed).t(), 1)
        return []
    if p.kind == "monitored_barrier":
        dist.monitored_barrier()
        return []
    raise UsageError(f"unknown probe kind {p.kind!r}")


def run_probes(rank: int, probes: Sequence[Probe]) -> list[Seen]:
    """Rank program (plain ``torch.distributed``, default group initialised): every probe, in order.

    An error is recorded and the next probe runs (every probe raises on every rank or on none, or is
    one-sided by design: the non-contiguous send)."""
    import torch.distributed as dist

    world = dist.get_world_size()
    seen = []
    for p in probes:
        try:
            seen.append(Seen(storage_bytes(_run_one(p, rank, world))))
        except Exception as exc:
            seen.append(Seen(None, type(exc).__name__, (str(exc).splitlines() or [""])[0][:200]))
    return seen


def fidelity_probes(world: int, big: bool = False) -> list[Probe]:
    """The probes of every category for a world of ``world`` ranks; ``big`` adds ``dist.reduce`` just above
    ``2 * world`` MiB (fp32 ``2nm + 1`` and ``(2n + 1)m + 7`` elements, ``m`` = 1 MiB of fp32)."""
    probes: list[Probe] = []
    last = world - 1

    def add(name: str, category: str, kind: str, **kw) -> None:
        probes.append(Probe(f"{name} P={world}", category, kind, seed=len(probes) + 1, **kw))

    for dtype in (torch.complex64, torch.complex128):
        short = str(dtype)[6:]
        for op in ("SUM", "AVG", "MAX", "PRODUCT"):
            for numel in (1, 7, 1000):
                add(f"reduce {short} {op} {numel}", "complex", "reduce", dtype=dtype, shape=(numel,), op=op, root=last)
            add(
                f"reduce_scatter_tensor {short} {op}",
                "complex",
                "reduce_scatter_tensor",
                dtype=dtype,
                shape=(5,),
                op=op,
            )
            add(f"reduce_scatter {short} {op}", "complex", "reduce_scatter", dtype=dtype, shape=(333,), op=op)
    for variant in ("transposed", "gaps", ""):
        for dtype in (torch.float32, torch.bfloat16):
            add(f"scatter {variant or 'contiguous'} {str(dtype)[6:]}", "scatter layout", "scatter", dtype=dtype,
                shape=(3, 4), variant=variant)  # fmt: skip
    for kind in REDUCERS:
        for op in ("SUM", "PRODUCT", "MAX", "MIN"):
            add(f"{kind} bool {op}", "bool bytes", kind, dtype=torch.bool, shape=(9,), op=op, root=last)
    add("empty reduce", "refusals", "reduce", shape=(0,), root=last)
    add("reduce_scatter_tensor of a view with gaps", "refusals", "reduce_scatter_tensor", shape=(3, 2), variant="gaps")
    add("reduce_scatter_tensor of an expand()", "refusals", "reduce_scatter_tensor", shape=(2, 3), variant="expand")
    add(
        "reduce_scatter_tensor dim 0 mismatch",
        "refusals",
        "reduce_scatter_tensor",
        shape=(2, 3),
        variant="dim 0 mismatch",
    )
    add("gather complex64", "refusals", "gather", dtype=torch.complex64, shape=(4,))
    add("send non-contiguous", "refusals", "send", shape=(2, 3))
    add("reduce_scatter mismatched entries", "refusals", "reduce_scatter", shape=(3,), variant="mismatched entries")
    add("monitored_barrier", "refusals", "monitored_barrier")
    for dtype in UNSUPPORTED:
        for kind in (*MOVERS, "all_reduce", "reduce", "reduce_scatter_tensor"):
            add(f"{kind} {str(dtype)[6:]}", "dtype table", kind, dtype=dtype, shape=(4,))
    for dtype in SUPPORTED:
        for kind in (*MOVERS, "all_reduce", "reduce"):
            add(f"{kind} {str(dtype)[6:]}", "dtype table", kind, dtype=dtype, shape=(4,), root=last)
    if big:
        m = GLOO_MAX_SEGMENT_BYTES // 4
        for numel in (2 * world * m + 1, (2 * world + 1) * m + 7):
            for root in (0, last):
                add(f"reduce fp32 {numel} to {root}", "reduce 2P MiB", "reduce", shape=(numel,), root=root)
    return probes


@dataclass(frozen=True)
class Verdict:
    """One probe on one rank where two runs disagree."""

    probe: Probe
    rank: int
    kind: str  # "silent difference" or "refusal mismatch"
    real: str
    simulated: str


def _show(s: Seen) -> str:
    if s.error or s.data is None:
        return f"{s.error}: {s.message[:80]}"
    return f"{s.data.numel()} bytes"


def disagreements(
    probes: Sequence[Probe], real: Sequence[Sequence[Seen]], sim: Sequence[Sequence[Seen]]
) -> list[Verdict]:
    """Every (probe, rank) where ``sim`` differs from ``real``: bytes (silent) or raising/type (refusal)."""
    out = []
    for i, p in enumerate(probes):
        for rank, (r_seen, s_seen) in enumerate(zip(real, sim, strict=True)):
            r, s = r_seen[i], s_seen[i]
            if r.error or s.error:
                if r.error != s.error:
                    out.append(Verdict(p, rank, "refusal mismatch", _show(r), _show(s)))
            elif r.data is None or s.data is None or not torch.equal(r.data, s.data):
                out.append(Verdict(p, rank, "silent difference", _show(r), _show(s)))
    return out


def tally(probes: Sequence[Probe], found: Sequence[Verdict], world: int) -> dict[str, tuple[int, int, int]]:
    """Per category: ``(pairs compared, silent differences, refusal mismatches)``; a pair is (probe, rank)."""
    counts: dict[str, list[int]] = {}
    for p in probes:
        counts.setdefault(p.category, [0, 0, 0])[0] += world
    for v in found:
        counts[v.probe.category][1 if v.kind == "silent difference" else 2] += 1
    return {k: (a, b, c) for k, (a, b, c) in counts.items()}


def run_cases_and_probes(rank: int, cases: Sequence, probes: Sequence[Probe]) -> tuple[list, list[Seen]]:
    """`simdist.testing._internal.gloo_probe.run_cases` then `run_probes` in one rank program (one spawn for both)."""
    from simdist.testing._internal.gloo_probe import run_cases

    return run_cases(rank, cases), run_probes(rank, probes)
