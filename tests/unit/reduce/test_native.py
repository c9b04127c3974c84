"""The native fold kernel (`simdist.reduce.native`) against the eager path it replaces, bit for bit.

The eager path (`Gloo` with the kernel disabled: the plan's hops, torch's adds, the NaN screen and
`_nan_bits`) is the reference; the kernel shares no arithmetic with it (its rules are C, in integer bit
operations). Compared on raw bits, NaN payloads included: every dtype the kernel covers, SUM and PRODUCT,
1 to 8 members, lengths from 0 past several of gloo's segments (a small ``max_segment_bytes`` makes segments
of a few elements), values drawn from a palette of adversarial bit patterns (NaNs of both signs with any
payload, quiet and signalling, signed zeros, infinities, subnormals, the largest finite values) or built as
rounding ties; and the rank-batched layouts (`Reduction.sum_many`, `sum_many_into` on strided group
views). Each instruction-set variant the machine has is checked (``variant``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sysconfig

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from simdist.numerics.floats import float_format
from simdist.reduce import Gloo, ReduceOp, Ring, Sequential, native
from simdist.testing.strategies import bit_patterns, pattern_tensor

DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
INT = {torch.float32: torch.int32, torch.float64: torch.int64, torch.bfloat16: torch.int16, torch.float16: torch.int16}
SEGMENTS = (1, 2, 4, 8, 24, 64, 1 << 20)
"""``max_segment_bytes`` values: segments of one element up to gloo's own 1 MiB."""

needs_kernel = pytest.mark.skipif(not native.available(), reason=f"native kernel: {native.STATUS}")


def _variants() -> list[str]:
    if not native.available():
        return ["base"]
    kernel = native._KERNEL
    found, current = ["base"], kernel.variant()
    try:
        kernel.variant("avx2")
        found.append("avx2")
    except ValueError:
        pass
    finally:
        kernel.variant(current)
    return found


VARIANTS = _variants()


@contextlib.contextmanager
def on_variant(name: str):
    """Run the block on one instruction-set variant of the kernel (restored afterwards)."""
    previous = native._KERNEL.variant(name)
    try:
        yield
    finally:
        native._KERNEL.variant(previous)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(INT[t.dtype])


def assert_same_bits(kernel: torch.Tensor, eager: torch.Tensor) -> None:
    assert kernel.shape == eager.shape and kernel.dtype == eager.dtype
    k, e = bits(kernel), bits(eager)
    if not torch.equal(k, e):
        where = (k != e).nonzero()[:5].tolist()
        raise AssertionError(f"kernel and eager bits differ at {where}: {k.flatten()[:8]} vs {e.flatten()[:8]}")


@st.composite
def members(draw, max_n: int = 8, max_numel: int = 80):
    """``(dtype, [n tensors of numel])``: elements picked from a palette of adversarial bit patterns, or ties."""
    dtype = draw(st.sampled_from(DTYPES))
    n = draw(st.integers(1, max_n))
    numel = draw(st.one_of(st.sampled_from([0, 1, 2, 3, 2 * n, 2 * n + 1]), st.integers(0, max_numel)))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    if draw(st.booleans()) or numel == 0:
        palette = pattern_tensor(draw(st.lists(bit_patterns(dtype), min_size=1, max_size=12)), dtype)
        picks = torch.randint(0, palette.numel(), (n, max(numel, 0)), generator=gen)
        stacked = palette[picks]
    else:  # rounding ties: one member holds +-1.0 * 2**k, the others half an ulp of it (or of its neighbour)
        precision = float_format(dtype).precision
        scale = 2.0 ** torch.randint(-6, 7, (n, numel), generator=gen).double()
        sign = torch.randint(0, 2, (n, numel), generator=gen).double() * 2 - 1
        big = torch.randint(0, n, (numel,), generator=gen)
        half_ulp = 2.0 ** (1 - precision) / 2 * torch.tensor([1.0, 3.0])[torch.randint(0, 2, (n, numel), generator=gen)]
        values = torch.where(torch.arange(n).unsqueeze(1) == big, sign * scale, half_ulp * scale)
        stacked = values.to(dtype)
    return dtype, [row.clone() for row in stacked]


def eager(fn):
    with native.disabled():
        return fn()


@needs_kernel
def test_the_kernel_runs_where_a_compiler_and_headers_exist():
    """Not silently off: with a C compiler and Python's headers (as in CI), the kernel is built and loaded."""
    compiler = shutil.which(os.environ.get("CC") or "cc")
    headers = os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h"))
    if compiler and headers and os.environ.get("SIMDIST_NATIVE") != "0":
        assert native.STATUS.startswith("loaded"), native.STATUS


@needs_kernel
@given(
    members(),
    st.sampled_from(SEGMENTS),
    st.sampled_from([ReduceOp.SUM, ReduceOp.PRODUCT]),
    st.sampled_from(VARIANTS),
    st.data(),
)
def test_reduce_into_writes_the_eager_bits_into_the_targets_in_place(case, segment, op, variant, data):
    """`Gloo.reduce_into` (the in-place all-reduce's one pass): each target, members included, gets the eager
    path's bits; the members that are not targets keep theirs; where the kernel declines (short chunks, an
    empty tensor) nothing is written."""
    dtype, xs = case
    reduction = Gloo(max_segment_bytes=segment)
    expected = eager(lambda: reduction.reduce([x.clone() for x in xs], op))
    targets = data.draw(st.lists(st.integers(0, len(xs) - 1), unique=True, max_size=len(xs)))
    outside = data.draw(st.integers(0, 2))  # targets that are not members (process mode's buffers)
    ys = [x.clone() for x in xs]
    extra = [torch.full_like(xs[0], 7.0) for _ in range(outside)]
    plan = reduction.plan(len(xs), xs[0].numel(), dtype)
    with on_variant(variant):
        applied = reduction.reduce_into(ys, op, [ys[i] for i in targets] + extra)
    short = plan.length < 8 and plan.period > 1  # the kernel's element-by-element path: not covered
    assert applied == (xs[0].numel() > 0 and not short)
    for i, (x, y) in enumerate(zip(xs, ys, strict=True)):
        assert_same_bits(y, expected if applied and i in targets else x)
    for out in extra:
        assert_same_bits(out, expected if applied else torch.full_like(xs[0], 7.0))


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [3, 4])
def test_reduce_into_folds_chunks_of_several_blocks(dtype, n):
    """Chunks longer than the kernel's 1024-element block (each block folded and written at its own elements):
    values 40 binades apart, so any element read from another block or member changes the bits, NaNs and
    infinities past the first block."""
    numel = 9000 + n  # gloo's chunks: about numel / n elements, several blocks each
    gen = torch.Generator().manual_seed(n)
    scale = 2.0 ** torch.randint(-20, 20, (n, numel), generator=gen)
    xs = [row.to(dtype) for row in torch.randn(n, numel, generator=gen) * scale]
    xs[0][2500], xs[1][5000], xs[n - 1][5000], xs[1][7777] = float("nan"), float("inf"), -float("inf"), -float("nan")
    expected = eager(lambda: Gloo().reduce([x.clone() for x in xs], ReduceOp.SUM))
    ys = [x.clone() for x in xs]
    assert Gloo().reduce_into(ys, ReduceOp.SUM, ys)
    for y in ys:
        assert_same_bits(y, expected)


@needs_kernel
@given(
    members(max_n=6, max_numel=60),
    st.sampled_from(SEGMENTS),
    st.sampled_from([ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.AVG]),
)
def test_reduce_scatter_of_listed_members_gives_the_stacked_eager_bits(case, segment, op):
    """`Gloo.reduce_scatter` of a list (folded in place, no stacked copy) against the eager path on the stacked
    members; a size the group does not divide still raises."""
    _, xs = case
    reduction = Gloo(max_segment_bytes=segment)
    n, numel = len(xs), xs[0].numel()
    if numel % n:
        with pytest.raises(ValueError):
            reduction.reduce_scatter(xs, op)
        return
    expected = eager(lambda: reduction.reduce_scatter(torch.stack(xs), op))
    assert_same_bits(reduction.reduce_scatter(xs, op), expected)


@needs_kernel
def test_reduce_into_refuses_outs_it_cannot_write_in_one_pass():
    """An out overlapping a member partly (or another out), not contiguous, or of another dtype or size: False,
    nothing written (the caller then reduces and copies)."""
    reduction = Gloo()
    base = torch.arange(128.0)
    before = base.clone()
    assert not reduction.reduce_into([base[:64], base[64:]], ReduceOp.SUM, [base[32:96]])  # partial overlap
    assert not reduction.reduce_into([base[:64], base[64:]], ReduceOp.SUM, [base[:64], base[:64]])  # the same out twice
    assert torch.equal(base, before)
    xs = [torch.ones(64), torch.ones(64)]
    assert not reduction.reduce_into(xs, ReduceOp.SUM, [torch.zeros(128)[::2]])
    assert not reduction.reduce_into(xs, ReduceOp.SUM, [torch.zeros(64, dtype=torch.float64)])
    assert not reduction.reduce_into(xs, ReduceOp.SUM, [torch.zeros(65)])
    assert not reduction.reduce_into(xs, ReduceOp.AVG, xs)  # AVG divides afterwards: reduce's path
    assert reduction.reduce_into(xs, ReduceOp.SUM, xs) and torch.equal(xs[1], torch.full((64,), 2.0))


@needs_kernel
@given(
    members(),
    st.sampled_from(SEGMENTS),
    st.sampled_from([ReduceOp.SUM, ReduceOp.PRODUCT]),
    st.booleans(),
    st.sampled_from(VARIANTS),
)
def test_the_kernel_gives_the_eager_bits(case, segment, op, stacked, variant):
    with on_variant(variant):
        check_reduce(case, segment, op, stacked)


def check_reduce(case, segment, op, stacked) -> None:
    dtype, xs = case
    reduction = Gloo(max_segment_bytes=segment)
    given_members = torch.stack(xs) if stacked else xs
    plan = reduction.plan(len(xs), xs[0].numel(), dtype)
    kernel = native.fold(plan, given_members, op is ReduceOp.PRODUCT)
    assert (kernel is None) == (xs[0].numel() == 0)  # the kernel covers every non-empty case drawn here
    assert_same_bits(reduction.reduce(given_members, op), eager(lambda: reduction.reduce(given_members, op)))
    if kernel is not None:
        assert_same_bits(kernel, eager(lambda: reduction.reduce(xs, op)))


@needs_kernel
@given(
    members(),
    st.one_of(
        st.just(Sequential()),
        st.builds(Ring, chunk_size=st.integers(1, 12), shift=st.integers(0, 3)),
    ),
    st.sampled_from([ReduceOp.SUM, ReduceOp.PRODUCT]),
    st.booleans(),
    st.sampled_from(VARIANTS),
)
def test_plain_left_folds_give_the_eager_bits(case, reduction, op, stacked, variant):
    """`Sequential` and `Ring` (the base class's left fold, torch's NaN bits): the kernel gives the same values
    and declines wherever a result is NaN, so the eager path gives those bits."""
    _, xs = case
    given_members = torch.stack(xs) if stacked else xs
    with on_variant(variant):
        assert_same_bits(reduction.reduce(given_members, op), eager(lambda: reduction.reduce(given_members, op)))
        if len(xs) > 1 and xs[0].numel():
            batch = torch.stack(xs).unsqueeze(1).expand(len(xs), 3, xs[0].numel())
            assert_same_bits(reduction.sum_many(batch), eager(lambda: reduction.sum_many(batch)))


@needs_kernel
@given(members(max_n=4, max_numel=24), st.sampled_from(SEGMENTS), st.integers(1, 3), st.integers(1, 3), st.data())
def test_batched_layouts_give_the_eager_bits(case, segment, batch, groups, data):
    """`sum_many` and `sum_many_into` on the rank-batched gradient path's views: ``[k, batch, G, *shape]`` views of a
    ``[batch, rank, *shape]`` tensor (blocks: rank ``g * k + j``; strided: ``j * G + g``), and a permuted one."""
    with on_variant(data.draw(st.sampled_from(VARIANTS))):
        check_batched(case, segment, batch, groups, data)


def check_batched(case, segment, batch, groups, data) -> None:
    dtype, xs = case
    k, numel = len(xs), xs[0].numel()
    shape = data.draw(st.sampled_from([(numel,), (1, numel)] + ([(2, numel // 2)] if numel % 2 == 0 else [])))
    pool = torch.stack(xs).view(INT[dtype])
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    value = pool.flatten()[torch.randint(0, max(1, pool.numel()), (batch, groups * k, numel), generator=gen)]
    value = value.view(dtype).view(batch, groups * k, *shape)
    layout = data.draw(st.sampled_from(["blocks", "strided", "permuted"]))
    if layout == "blocks":
        stacked = value.view(batch, groups, k, *shape).movedim(2, 0)
    elif layout == "strided":
        stacked = value.view(batch, k, groups, *shape).movedim(1, 0)
    else:  # members outermost in memory, items innermost: batch dimensions of unusual strides
        stacked = value.view(batch, groups, k, *shape).permute(2, 1, 0, *range(3, 3 + len(shape)))
    reduction = Gloo(max_segment_bytes=segment)
    expected = eager(lambda: reduction.sum_many(stacked, shape))
    assert_same_bits(reduction.sum_many(stacked, shape), expected)
    out = torch.full(stacked.shape, 7.0, dtype=dtype)
    assert reduction.sum_many_into(stacked, out, shape) is out
    for r in range(k):
        assert_same_bits(out[r], expected)


@needs_kernel
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_half_precision_pattern_sums_and_multiplies_as_eager(dtype, variant):
    """Every one of the 65,536 bit patterns against partners that hit subnormals, overflow, ties and NaNs:
    the kernel's own widening, rounding and NaN bits for the 16-bit formats, exhaustively."""
    every = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(dtype)
    # smallest subnormals, 1.0 in either format, the largest finite values, signalling and quiet NaNs of both
    # signs, the smallest normal, 0.5, a power of two whose sums with 65504 reach fp16's overflow tie (65520)
    partners = [0x0001, 0x8001, 0x3C00, 0x3F80, 0x7BFF, 0x7F7F, 0x7C01, 0xFE01, 0x0400, 0x3800, 0x1400, 0x0002, 0x4C00]
    with on_variant(variant):
        check_every_pattern(dtype, every, partners)


def check_every_pattern(dtype, every, partners) -> None:
    for partner in partners:
        other = torch.full_like(every.view(torch.int16), partner - (1 << 16) if partner >= 1 << 15 else partner)
        xs = [every, other.view(dtype)]
        for op in (ReduceOp.SUM, ReduceOp.PRODUCT):
            for reduction in (Gloo(), Gloo(max_segment_bytes=2)):
                assert_same_bits(reduction.reduce(xs, op), eager(lambda m=reduction, o=op, x=xs: m.reduce(x, o)))


@needs_kernel
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n", [2, 3])
def test_every_combination_of_special_values_gives_the_eager_bits(n, dtype, variant):
    """Every n-tuple of special values (signed zeros, infinities, NaNs of both signs quiet and signalling with
    payloads, the largest and smallest values, subnormals) as one element each: the NaN rule's every branch
    (the receiving rank's NaN, the partial's, the default NaN of ``inf - inf`` and ``0 * inf``); and for the
    plain left folds (`Sequential`, `Ring`), whose NaN bits are torch's, the kernel declining every NaN."""
    info = torch.finfo(dtype)
    width, mantissa = info.bits, float_format(dtype).precision - 1
    quiet, exponent, sign = 1 << (mantissa - 1), ((1 << (width - 1 - mantissa)) - 1) << mantissa, 1 << (width - 1)
    nans = [exponent | quiet | 5, exponent | 3, sign | exponent | quiet, sign | exponent | 9]
    values = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), 1.0, -1.5, info.max, -info.max, info.tiny,
                           info.tiny * 2.0**-20, -info.tiny * 2.0**-20], dtype=dtype)  # fmt: skip
    patterns = values.view(INT[dtype]).tolist() + [p - (1 << width) if p & sign else p for p in nans]
    grid = torch.cartesian_prod(*[torch.arange(len(patterns))] * n).t()  # [n, combinations]
    table = torch.tensor(patterns, dtype=INT[dtype])
    xs = [table[row].view(dtype) for row in grid]
    with on_variant(variant):
        for op in (ReduceOp.SUM, ReduceOp.PRODUCT):
            for reduction in (Gloo(), Gloo(max_segment_bytes=width // 8), Sequential(), Ring(), Ring(chunk_size=16)):
                assert_same_bits(reduction.reduce(xs, op), eager(lambda m=reduction, o=op: m.reduce(xs, o)))


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "eager"])
def test_two_members_both_nan_keep_the_receiving_members_payload_in_each_chunk(kernel):
    """n = 2, four fp32 elements: gloo's chunks of 2; chunk c's walk starts at member (c - 1) mod 2 and member
    c mod 2 receives, so its NaN (quieted) is the result: payloads 1 and 2 give 0x7FC00001 twice, then
    0x7FC00002 twice -- in every entry point, with the kernel and without (the eager two-member add must not
    hand back the order-free sum's NaN)."""
    if kernel and not native.available():
        pytest.skip(f"native kernel: {native.STATUS}")
    nans = torch.tensor([[0x7F800001] * 4, [0x7F800002] * 4], dtype=torch.int32).view(torch.float32)
    expected = torch.tensor([0x7FC00001, 0x7FC00001, 0x7FC00002, 0x7FC00002], dtype=torch.int32)
    stacked = nans.unsqueeze(1).expand(2, 3, 4)  # three items, as the rank-batched gradient path hands them
    reduction = Gloo()
    with contextlib.nullcontext() if kernel else native.disabled():
        results = [reduction.reduce(list(nans)), reduction.reduce(nans), *reduction.sum_many(stacked)]
        out = torch.empty(2, 3, 4)
        results += [*reduction.sum_many_into(stacked, out, (4,)).flatten(0, 1)]
    for result in results:
        assert torch.equal(result.view(torch.int32), expected), result.view(torch.int32)


@needs_kernel
def test_what_the_kernel_does_not_cover_runs_the_eager_path():
    """Other dtypes, non-contiguous members, a non-CPU request or an empty tensor: None, and `Gloo` reduces
    them eagerly (the same answers as with the kernel disabled)."""
    reduction = Gloo()
    plan = reduction.plan(3, 6, torch.float32)
    permuted = [(torch.arange(6.0).view(2, 3) + r).t() for r in range(3)]  # dense, read in memory order
    assert native.fold(plan, permuted, flat=True) is None
    assert_same_bits(reduction.reduce(permuted), eager(lambda: reduction.reduce(permuted)))
    ints = [torch.arange(6, dtype=torch.int32) * r for r in range(3)]
    assert native.fold(reduction.plan(3, 6, torch.int32), ints) is None
    assert torch.equal(reduction.reduce(ints), eager(lambda: reduction.reduce(ints)))
    gappy = torch.arange(36.0).view(3, 2, 6)[:, :, ::2]  # member dimensions with gaps: not the kernel's layout
    assert native.fold(reduction.plan(3, 6, torch.float32), gappy) is None
    assert native.fold(reduction.plan(3, 0, torch.float32), [torch.zeros(0)] * 3) is None
    tracked = [torch.ones(6, requires_grad=True) for _ in range(3)]  # the eager result carries autograd history
    assert native.fold(plan, tracked) is None and native.fold(plan, torch.stack(tracked)) is None
    assert reduction.reduce(tracked).grad_fn is not None
    with native.disabled():
        assert not native.available() and native.fold(plan, [torch.zeros(6)] * 3) is None


def test_the_switch_and_a_failed_build_leave_the_eager_path(monkeypatch):
    """``SIMDIST_NATIVE=0`` loads nothing; without a compiler the kernel is unavailable (no error) unless
    ``SIMDIST_NATIVE=1`` demands it."""
    status = native.STATUS
    try:
        monkeypatch.setenv("SIMDIST_NATIVE", "0")
        assert native._load() is None and "SIMDIST_NATIVE=0" in native.STATUS
        monkeypatch.setenv("SIMDIST_NATIVE", "")
        monkeypatch.setenv("CC", "/nonexistent/cc")
        with pytest.warns(RuntimeWarning, match="eager path") as warned:  # one warning says so
            assert native._load(installed_first=False) is None and "no C compiler" in native.STATUS
        assert len(warned) == 1
        monkeypatch.setenv("SIMDIST_NATIVE", "1")
        with pytest.raises(RuntimeError, match="SIMDIST_NATIVE=1"):
            native._load(installed_first=False)
    finally:
        native.STATUS = status


def test_a_kernel_built_from_another_fold_c_is_not_loaded(monkeypatch):
    """An editable install keeps the extension it built; after the source changes (a pull), that build's functions
    may not be the ones `native` calls. It carries the SHA-256 of the source it was built from, and a mismatch
    sends `native` to the build-on-first-use path instead of loading it."""
    import types

    # `_installed` records what it loaded in native.STATUS: the fake module below must not leak into it (a
    # STATUS of "current.so (built at install)" where no extension was installed, e.g. a source tree on PYTHONPATH)
    monkeypatch.setattr(native, "STATUS", native.STATUS)
    stale = types.SimpleNamespace(SOURCE_SHA256="0" * 64, __file__="stale.so")
    current = types.SimpleNamespace(SOURCE_SHA256=native.source_sha256(), __file__="current.so")
    for module, expected in ((stale, None), (current, current)):
        monkeypatch.setattr(native.importlib, "import_module", lambda name, module=module: module)
        assert native._installed() is expected
    if native._KERNEL is not None:  # the kernel loaded here, installed or built on first use, is this source's
        assert native.source_sha256() == native._KERNEL.SOURCE_SHA256
