"""gloo's corners against real gloo, bit for bit: one spawn of 4 real gloo processes runs every case.

The cases (`simdist.testing._internal.gloo_probe`) are the fixed corner set (NaN payloads
and signed zeros in fp32/bf16/fp16/fp64 for SUM/PRODUCT/MAX/MIN/AVG on groups
of 1 to 4 ranks given unsorted; integer and bool tensors with every op;
refused ops; reduce to every root; list and tensor reduce_scatter; permuted
and strided layouts) plus cases drawn by Hypothesis on this side and shipped
to the ranks. The same cases then run through the `Gloo` model directly and
through the simdist backend (thread ranks); every case must be bitwise equal,
raise the same error type, or (strided views only) be refused by simdist.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import simdist
from simdist.reduce.gloo import GLOO_MAX_SEGMENT_BYTES
from simdist.testing._internal.gloo_fidelity import (
    Probe,
    disagreements,
    fidelity_probes,
    run_cases_and_probes,
    run_probes,
    tally,
)
from simdist.testing._internal.gloo_probe import (
    KINDS,
    Case,
    bits,
    compare,
    corner_cases,
    from_bits,
    reduction_outcomes,
    run_cases,
    special_columns,
    spread,
)

pytestmark = pytest.mark.gloo

WORLD = 4
FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
INTEGERS = (torch.int32, torch.int8, torch.uint8, torch.int64, torch.bool)
COMPLEX = (torch.complex64, torch.complex128)
SCALE = {torch.float16: 8, torch.bfloat16: 60, torch.float32: 60, torch.float64: 200}  # |binade| of drawn values


def _values(gen: torch.Generator, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Random values of ``dtype``: normal times exact powers of two (floats), or wrapping-prone integers."""
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if dtype.is_complex:
        part = torch.float32 if dtype == torch.complex64 else torch.float64
        return torch.complex(_values(gen, shape, part), _values(gen, shape, part))
    if not dtype.is_floating_point:
        info = torch.iinfo(dtype)
        return torch.randint(max(info.min, -300), min(info.max, 300) + 1, shape, generator=gen).to(dtype)
    k = torch.randint(-SCALE[dtype], SCALE[dtype] + 1, shape, generator=gen, dtype=torch.int64)
    return (
        torch.randn(shape, generator=gen, dtype=torch.float64) * torch.ldexp(torch.ones(shape, dtype=torch.float64), k)
    ).to(dtype)


@st.composite
def drawn_cases(draw, dtypes: tuple[torch.dtype, ...] = FLOATS + INTEGERS + COMPLEX) -> Case:
    """A collective on a drawn group (any size, any order), dtype, op, length and layout, with special values
    (NaN payloads, signed zeros, infinities) planted at drawn places."""
    kind = draw(st.sampled_from(KINDS))
    order = draw(st.permutations(range(WORLD)))
    size = draw(st.integers(1, WORLD))
    group = None if size == WORLD and draw(st.booleans()) else tuple(order[:size])
    members = sorted(group) if group else list(range(WORLD))
    n = len(members)
    dtype = draw(st.sampled_from(dtypes))
    op = draw(st.sampled_from(("SUM", "PRODUCT", "MAX", "MIN", "AVG")))
    layout = "contiguous"
    if kind == "reduce_scatter":
        shape = (n, draw(st.integers(1, 40)))
    elif kind == "reduce_scatter_tensor":
        shape = (n * draw(st.integers(1, 300)),)
    else:
        shape = (draw(st.integers(1, 9)), draw(st.integers(0, 80)))
        if kind == "all_reduce" and draw(st.booleans()):
            layout = "transposed"
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))
    x = _values(gen, (n, *shape), dtype)
    if (dtype.is_floating_point or dtype.is_complex) and x[0].numel():
        planted = torch.view_as_real(x) if dtype.is_complex else x  # complex: specials in either part
        specials = from_bits(special_columns(1, planted.dtype), planted.dtype)[0]
        flat = planted.view(n, -1)
        for _ in range(draw(st.integers(0, 12))):
            rank, where, which = draw(st.integers(0, n - 1)), draw(st.integers(0, 10**6)), draw(st.integers(0, 99))
            flat[rank, where % flat.shape[1]] = specials[which % specials.numel()]
    root = draw(st.sampled_from(members)) if kind == "reduce" else None
    name = f"drawn {kind} {layout} group={group} {str(dtype)[6:]} {op} shape={shape}"
    return Case(name, kind, op, spread(x, members, WORLD), group, root, layout, tags=("drawn",))


def draw_cases() -> list[Case]:
    """Cases drawn by Hypothesis (the profile's example count), collected on this side of the spawn; then as
    many again of complex dtypes only (reduce and both reduce_scatters cut them on the real view)."""
    found: list[Case] = []
    for dtypes in (FLOATS + INTEGERS + COMPLEX, COMPLEX):

        @settings(database=None)
        @given(drawn_cases(dtypes))
        def collect(case: Case) -> None:
            found.append(case)

        collect()
    return found


@pytest.fixture(scope="module")
def spawned():
    """ONE spawn of WORLD real gloo processes: the corner cases (fixed and drawn) and the fidelity probes."""
    cases = corner_cases(WORLD) + draw_cases()
    probes = [p for p in fidelity_probes(WORLD)]
    results = simdist.run(run_cases_and_probes, WORLD, where="gloo", args=(cases, probes), timeout_s=240)
    return cases, [r[0] for r in results], probes, [r[1] for r in results]


@pytest.fixture(scope="module")
def corners(spawned):
    return spawned[0], spawned[1]


def _failures(rows) -> list[str]:
    return [
        f"{r.case.name}: {r.verdict} (real {r.real}; simdist {r.modelled})"
        for r in rows
        if r.verdict == "DIFFERENT" or (r.verdict == "refused") != (r.case.layout == "strided")
    ]


def test_the_gloo_model_gives_real_gloos_bits_or_errors_in_every_corner(corners):
    cases, real = corners
    rows = compare(cases, real, reduction_outcomes(cases, WORLD))
    failures = _failures(rows)
    assert not failures, "\n".join(failures)
    verdicts = {r.verdict for r in rows}
    assert verdicts == {"bitwise equal", "same error", "refused"}, verdicts
    assert sum(r.verdict == "bitwise equal" and "drawn" in r.case.tags for r in rows) > 10


def test_the_simdist_backend_gives_real_gloos_bits_or_errors_in_every_corner(corners):
    cases, real = corners
    failures = _failures(compare(cases, real, simdist.run(run_cases, WORLD, args=(cases,))))
    assert not failures, "\n".join(failures)


def test_real_gloo_reduces_memory_outside_a_strided_view_and_simdist_refuses_it(corners):
    cases, real = corners
    strided = [(i, c) for i, c in enumerate(cases) if c.layout == "strided"]
    assert strided
    for i, case in strided:
        base = real[0][i].tensor  # [a, 2b]: the view is the even columns, -x sits in the odd ones
        outside = base[:, 1::2]
        assert not torch.equal(bits(outside), bits(-case.inputs[0])), f"{case.name}: gloo left the gaps alone"
        refused = reduction_outcomes([case], WORLD)[0][0]
        assert refused.error == "ValueError" and "outside the view" in refused.message


def test_errors_are_the_real_backends_types(corners):
    cases, real = corners
    seen = [(c, next(r[i] for r in real if r[i] is not None)) for i, c in enumerate(cases)]
    errors = {(c.op.partition(":")[0], outcome.error) for c, outcome in seen if outcome.error}
    assert ("AVG", "RuntimeError") in errors  # integer and bool AVG: torch's div_ after the SUM
    assert ("PREMUL_SUM", "RuntimeError") in errors and ("BOR", "RuntimeError") in errors


@pytest.mark.slow
def test_the_simdist_backend_in_process_mode_gives_real_gloos_bits(corners):
    cases, real = corners
    failures = _failures(
        compare(cases, real, simdist.run(run_cases, WORLD, where="processes", args=(cases,), timeout_s=240))
    )
    assert not failures, "\n".join(failures)


def _big_nan_cases(world: int) -> list[Case]:
    """Past gloo's 1 MiB segment cap, with NaNs and signed zeros strewn over every chunk."""
    gen = torch.Generator().manual_seed(5)
    cases = []
    for dtype, numel in ((torch.float32, 262144 * (2 * world + 1) + 7), (torch.bfloat16, 524288 * 3 + 5)):
        x = _values(gen, (world, numel), dtype)
        spots = torch.randint(0, numel, (world, 64), generator=gen)
        specials = from_bits(special_columns(1, dtype), dtype)[0]
        for r in range(world):
            x[r, spots[r]] = specials[torch.randint(0, specials.numel(), (64,), generator=gen)]
        for op in ("SUM", "MAX", "MIN"):
            cases.append(Case(f"big {str(dtype)[6:]} {op} numel={numel}", "all_reduce", op, x))
    return cases


@pytest.mark.slow
@pytest.mark.parametrize("world", [5, 8])
def test_larger_worlds_and_segmented_lengths_with_special_values(world):
    cases = corner_cases(world) + _big_nan_cases(world)
    real = simdist.run(run_cases, world, where="gloo", args=(cases,), timeout_s=600)
    failures = _failures(compare(cases, real, reduction_outcomes(cases, world)))
    assert not failures, "\n".join(failures)


def test_every_fidelity_category_equals_real_gloo_in_storage_bytes(spawned):
    """Complex reduce/reduce_scatter, scatter layouts, bool bytes, refusals and the dtype table (threads)."""
    _, _, probes, real = spawned
    found = disagreements(probes, real, simdist.run(run_probes, WORLD, args=(probes,)))
    counts = tally(probes, found, WORLD)
    assert set(counts) >= {"complex", "scatter layout", "bool bytes", "refusals", "dtype table"}
    assert not found, "\n".join(f"{v.kind}: {v.probe.name} rank {v.rank}: {v.real} | {v.simulated}" for v in found)


def drawn_big_reduces(world: int, count: int = 3) -> list[Probe]:
    """``dist.reduce`` probes drawn by Hypothesis around ``2 * world`` MiB (fp32 or bf16, any root)."""
    found: list[Probe] = []

    @settings(database=None, max_examples=count)
    @given(st.sampled_from((torch.float32, torch.bfloat16)), st.integers(-2, 2), st.integers(0, 10**6), st.data())
    def collect(dtype, segments, offset, data) -> None:
        m = GLOO_MAX_SEGMENT_BYTES // dtype.itemsize
        numel = (2 * world + segments) * m + offset % m
        root = data.draw(st.integers(0, world - 1))
        name = f"drawn reduce {str(dtype)[6:]} {numel} to {root} P={world}"
        found.append(Probe(name, "reduce 2P MiB", "reduce", dtype, (numel,), root=root, seed=900 + len(found)))

    collect()
    return found


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3, 5, pytest.param(8, marks=pytest.mark.nightly)])  # P=8: ~2 min
def test_fidelity_categories_with_reduce_above_2p_mib_in_threads_and_process_mode(world):
    """Every category plus ``dist.reduce`` around 2P MiB (gloo's own segment sizing) at P = 2..8: fixed sizes
    just above it and sizes drawn by Hypothesis around it."""
    probes = [p for p in fidelity_probes(world, big=True)] + drawn_big_reduces(world)
    real = simdist.run(run_probes, world, where="gloo", args=(probes,), timeout_s=600)
    for mode, seen in (
        ("threads", simdist.run(run_probes, world, args=(probes,))),
        ("process", simdist.run(run_probes, world, where="processes", args=(probes,), timeout_s=600)),
    ):
        found = disagreements(probes, real, seen)
        assert not found, mode + ":\n" + "\n".join(f"{v.kind}: {v.probe.name} rank {v.rank}" for v in found)


def test_fidelity_probe_inputs_have_the_layouts_they_are_named_for():
    """Real gloo and simdist run the same probe program, so a probe whose input lost its layout would still agree:
    the layouts are checked here (the refusals need their gaps, stride-0 rows and mismatched dim 0; the scatter
    probes their transposed and gapped entries)."""
    from simdist.testing._internal.gloo_fidelity import _reduce_scatter_input, _scatter_entries

    world, seed = 4, 7
    gaps = _reduce_scatter_input(Probe("p", "c", "reduce_scatter_tensor", shape=(3, 2), variant="gaps"), world, seed)
    assert gaps.shape == (12, 2) and gaps.stride() == (4, 1)
    expand = _reduce_scatter_input(Probe("p", "c", "reduce_scatter_tensor", shape=(2, 3), variant="expand"), world, 0)
    assert expand.shape == (8, 3) and expand.stride()[0] == 0
    dense = Probe("p", "c", "reduce_scatter_tensor", shape=(2, 3))
    mismatch = _reduce_scatter_input(dataclasses.replace(dense, variant="dim 0 mismatch"), world, seed)
    assert (
        mismatch.numel() == 24 and mismatch.shape[0] != 8 and _reduce_scatter_input(dense, world, seed).shape == (8, 3)
    )
    for variant, contiguous in (("transposed", False), ("gaps", False), ("", True)):
        entries = _scatter_entries(Probe("p", "c", "scatter", shape=(3, 4), variant=variant), world, seed)
        assert len(entries) == world and all(e.shape == (3, 4) for e in entries)
        assert all(e.is_contiguous() == contiguous for e in entries), variant
