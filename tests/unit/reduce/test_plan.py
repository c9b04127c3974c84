"""Fold plans against plain loops: every planned order equals its documented order, restated element by element.

The restatements below are written from the models' documented orders (the module docstrings of
`simdist.reduce.textbook` and `simdist.reduce.gloo.reduction`), not from their code: for each element they list the
ranks
in fold order with a formula of their own, then add one element at a time (0-d tensors, one rounding per add).
They never touch `FoldPlan`, the models' chunk functions or `fold`. Each property compares raw bits
(`.view(int)`): signed zeros, infinities, subnormals, ties and empty tensors included. NaN bits are compared
exactly for `Gloo` (the model claims gloo's NaN bits, restated here from its docstring) and for fp32 and fp64
under `Sequential`, `Tree` and `Ring` (torch's vectorised and scalar fp32 loops return the same NaN here).
For bf16 and fp16 under those models, and for `Upcast`, only NaN-ness is compared; these models claim no NaN
bits, and torch's own kernels disagree: a bf16 add writes ``0xFFFF`` in its vectorised loop and ``0x7FC0`` in
its scalar one, an fp16 add of two NaNs keeps the second operand's payload in the vectorised loop and the
first's in the scalar one (torch 2.13, x86), so those bits depend on where an element falls in torch's loop
(measured; the batched tree, a view of the same adds, differs from the per-item one there); `Upcast` rounds a
NaN back with `round_to`, which keeps payload bits torch's ``.to`` drops.
"""

from __future__ import annotations

import torch
from hypothesis import example, given
from hypothesis import strategies as st

from simdist.gradpath.batched import batched_sum
from simdist.reduce import Gloo, Ring, Sequential, Tree, Upcast
from simdist.testing.strategies import float_values

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
INT = {torch.float64: torch.int64, torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


# -- the documented orders, restated ------------------------------------------------------------------------------


def gloo_chunk(numel: int, n: int, element_size: int, max_segment_bytes: int) -> int:
    """gloo's ring chunk length, from the formula in `simdist.reduce.gloo.reduction`'s docstring (step 1)."""
    per_segment = max(1, max_segment_bytes // element_size)
    segments = max((numel + per_segment - 1) // per_segment, 2 * n)
    segments = (segments + n - 1) // n * n
    return segments // n * ((numel + segments - 1) // segments)


def gloo_order(n: int, numel: int, element_size: int, max_segment_bytes: int, e: int) -> list[int]:
    """Chunk ``c`` starts at rank ``c - 1`` and walks down the ring: ``x[c-1], x[c-2], ..., x[c]``."""
    c = e // max(1, gloo_chunk(numel, n, element_size, max_segment_bytes))
    return [(c - 1 - j) % n for j in range(n)]


def ring_order(reduction: Ring, n: int, e: int) -> list[int]:
    """Chunk ``c`` starts at ring position ``(c + shift) mod n`` and visits every position once."""
    ring = list(range(n)) if reduction.ring is None else list(reduction.ring)
    c = e // reduction.chunk_size
    return [ring[(c + reduction.shift + j) % n] for j in range(n)]


def tree_sum(values: list[torch.Tensor]) -> torch.Tensor:
    """Neighbours pairwise, level by level; an odd one out is carried up unchanged."""
    while len(values) > 1:
        pairs = [values[i] + values[i + 1] for i in range(0, len(values) - 1, 2)]
        values = pairs + ([values[-1]] if len(values) % 2 else [])
    return values[0]


def gloo_nan(local: torch.Tensor, acc: torch.Tensor) -> int:
    """The NaN gloo's sum leaves (bits): `Gloo`'s docstring, "NaN bits"."""
    dtype = local.dtype
    if dtype == torch.bfloat16:
        return 0x7FC0
    lb, ab = int(local.view(INT[dtype])), int(acc.view(INT[dtype]))
    if dtype == torch.float16:
        negative = lb < 0 if local.isnan() else ab < 0 if acc.isnan() else True
        return 0xFE00 - (1 << 16) if negative else 0x7E00
    quiet = 1 << (51 if dtype == torch.float64 else 22)
    if local.isnan():
        return lb | quiet
    if acc.isnan():
        return ab | quiet
    return -quiet  # x86's default NaN: sign set, quiet bit set


def restated(reduction, x: torch.Tensor) -> torch.Tensor:
    """``model``'s SUM of ``x`` (``[n, numel]``), one element and one hop at a time."""
    n, numel = x.shape
    out = torch.empty(numel, dtype=x.dtype)
    for e in range(numel):
        column = [x[r, e] for r in range(n)]
        if isinstance(reduction, Gloo):
            if n == 1:
                out[e] = column[0]
                continue
            order = gloo_order(n, numel, x.element_size(), reduction.max_segment_bytes, e)
            acc = column[order[0]]
            for r in order[1:]:
                local = column[r]
                value = local + acc
                if value.isnan():
                    value = torch.tensor(gloo_nan(local, acc), dtype=INT[x.dtype]).view(x.dtype)
                acc = value
        elif isinstance(reduction, Ring):
            order = ring_order(reduction, n, e)
            acc = column[order[0]].clone()
            for r in order[1:]:
                acc = acc + column[r]
        elif isinstance(reduction, Tree):
            acc = tree_sum(column)
        elif isinstance(reduction, Upcast):
            acc = column[0].to(reduction.acc_dtype)
            for r in range(1, n):
                acc = acc + column[r].to(reduction.acc_dtype)
            acc = acc.to(x.dtype)  # one rounding (acc_dtype is chosen below so that .to rounds once, correctly)
        else:  # Sequential
            acc = column[0].clone()
            for r in range(1, n):
                acc = acc + column[r]
        out[e] = acc
    return out


def same_bits(got: torch.Tensor, want: torch.Tensor, nan_bits: bool) -> bool:
    if got.shape != want.shape:
        return False
    g, w = got.contiguous().view(INT[got.dtype]), want.contiguous().view(INT[want.dtype])
    if nan_bits:
        return torch.equal(g, w)
    both_nan = got.isnan() & want.isnan()
    return torch.equal(got.isnan(), want.isnan()) and torch.equal(g[~both_nan], w[~both_nan])


# -- inputs -------------------------------------------------------------------------------------------------------


def reductions(dtype: torch.dtype):
    acc = torch.float64 if dtype in (torch.float32, torch.float64) else torch.float32
    return st.one_of(
        st.just(Sequential()),
        st.just(Tree()),
        st.just(Upcast(acc)),
        st.builds(Ring, chunk_size=st.integers(1, 6), shift=st.integers(0, 7)),
        st.builds(lambda k: Ring(chunk_size=k, ring=(2, 0, 3, 1)), st.integers(1, 4)),  # n = 4 only
        st.builds(Gloo, max_segment_bytes=st.sampled_from([1, 2, 4, 8, 16, 64, 1 << 20])),
    )


def ties(dtype: torch.dtype) -> st.SearchStrategy[float]:
    """Values whose sums land halfway between two neighbours of ``dtype`` (round-half-to-even decides)."""
    p = {torch.float64: 53, torch.float32: 24, torch.float16: 11, torch.bfloat16: 8}[dtype]
    return st.sampled_from([1.0, -1.0, 2.0**-p, -(2.0**-p), 1.0 + 2.0 ** (1 - p), 3 * 2.0**-p, 2.0 ** (1 - p)])


@st.composite
def groups(draw, count: int | None = None):
    """``(model, x)``: ``x`` is ``[n, numel]`` (or ``[n, count, numel]``) with NaN payloads (quiet and signalling,
    both signs), signed zeros, infinities, subnormals and ties."""
    dtype = draw(st.sampled_from(DTYPES))
    reduction = draw(reductions(dtype))
    n = 4 if isinstance(reduction, Ring) and reduction.ring is not None else draw(st.integers(1, 6))
    top = 40 if count is None else 16
    numel = draw(st.one_of(st.integers(0, top), st.sampled_from([n * 2, n * 4, 12, 16])))  # whole chunks, often
    shape = (n, numel) if count is None else (n, count, numel)
    total = n * numel * (count or 1)
    top = 1023 if dtype == torch.float64 else None  # 2.0**1024 overflows a Python float
    elements = st.one_of(float_values(dtype, max_exponent=top, nan=True, infinity=True), ties(dtype))
    x = torch.tensor(draw(st.lists(elements, min_size=total, max_size=total)), dtype=dtype).reshape(shape)
    payloads = draw(st.lists(st.integers(1, 63), min_size=total, max_size=total))
    nan = x.isnan().reshape(-1)
    raw = x.view(INT[dtype]).reshape(-1)
    raw[nan] ^= torch.tensor(payloads, dtype=INT[dtype])[nan]  # other payloads; some signalling
    return reduction, x


def claims_nan_bits(reduction, dtype: torch.dtype) -> bool:
    """Gloo's NaN bits always; the others' where torch's add gives one NaN in every loop (fp32, fp64), and not
    `Upcast`'s (its one rounding of a NaN back to the dtype keeps a payload torch's ``.to`` would not)."""
    if isinstance(reduction, Gloo):
        return True
    return dtype in (torch.float32, torch.float64) and not isinstance(reduction, Upcast)


# -- properties ---------------------------------------------------------------------------------------------------


@given(groups())
@example((Gloo(max_segment_bytes=4), torch.tensor([[1.0, -0.0, 5.0], [2.0**-24, -0.0, 2.0**-149], [2.0**-24, 0, 1]])))
def test_the_planned_sum_is_the_documented_order_element_by_element(group):
    """`sum` (a sequence and a stacked tensor) == the plain-loop restatement, bit for bit."""
    reduction, x = group
    want = restated(reduction, x)
    nan_bits = claims_nan_bits(reduction, x.dtype)
    assert same_bits(reduction.sum(x), want, nan_bits), reduction
    assert same_bits(reduction.sum(list(x.unbind(0))), want, nan_bits), reduction


@given(groups(count=3))
def test_the_batched_sum_is_the_documented_order_for_every_item(group):
    """`sum_many` (the rank-batched gradient path's path) == the restatement of each item, bit for bit."""
    reduction, x = group
    got = batched_sum(reduction, x, (x.shape[2],))
    for i in range(x.shape[1]):
        assert same_bits(got[i], restated(reduction, x[:, i]), claims_nan_bits(reduction, x.dtype)), (reduction, i)


@given(groups(), st.sampled_from(["items outer", "elements outer", "members outer"]))
def test_a_batch_in_any_layout_gives_the_same_bits(group, layout):
    """The rank-batched gradient path hands `sum_many` strided views (its groups are views of the rank dimension):
    the members' memory layout does not change a bit."""
    reduction, x = group
    items = [x, -x, x * 2]
    if layout == "items outer":  # the gradient path's "blocks" layout: [item, member, element] in memory
        members = torch.stack(items).transpose(0, 1)
    elif layout == "elements outer":
        members = torch.stack(items, dim=-1).permute(0, 2, 1)
    else:
        members = torch.stack(items, dim=1)
    got = batched_sum(reduction, members, (x.shape[1],))
    for i in range(3):
        assert same_bits(got[i], restated(reduction, items[i]), claims_nan_bits(reduction, x.dtype)), (reduction, i)


def test_the_restatements_see_a_wrong_order():
    """The checks above can fail: a fingerprint (1 and two half-ulps) tells rank orders apart."""
    x = torch.zeros(4, 1024)
    x[1], x[2], x[3] = 1.0, 2.0**-24, 2.0**-24
    gloo, sequential = restated(Gloo(), x), restated(Sequential(), x)
    assert not torch.equal(gloo, sequential)
    assert torch.equal(Gloo().sum(x), gloo)


def test_a_new_model_is_one_class_batched_through_its_plan_and_an_undeclared_order_warns():
    """A model that only states its plan gets `sum` and the batched path from it, with no warning; a subclass that
    rewrites `sum` without stating its order is not batched with its parent's plan (it warns and goes item by item)."""
    import warnings

    from simdist.reduce import REDUCTIONS, FoldPlan, PerItemWarning, ReductionName, make_reduction

    class Descending(Sequential):
        def fold_plan(self, n, numel, dtype):
            return FoldPlan.uniform(range(n - 1, -1, -1), numel)

    class Reversed(Sequential):
        def sum(self, tensors):
            return super().sum(list(tensors)[::-1])

    h = 2.0**-24  # half an ulp of 1: 1 + h + h is 1 one way round and 1 + 2h the other
    x = torch.tensor([[1.0, h], [h, h], [h, 1.0]])  # [3 members, 2 elements]
    stacked = torch.stack([x, x.flip(1)], dim=1)  # [3 members, 2 items, 2 elements]
    with warnings.catch_warnings():
        warnings.simplefilter("error", PerItemWarning)
        assert torch.equal(Descending().sum(x), restated(Sequential(), x.flip(0)))
        assert torch.equal(batched_sum(Descending(), stacked, (2,))[0], restated(Sequential(), x.flip(0)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = batched_sum(Reversed(), stacked, (2,))
    assert any(issubclass(w.category, PerItemWarning) for w in caught)
    assert torch.equal(got[0], restated(Sequential(), x.flip(0)))
    assert not torch.equal(got[0], restated(Sequential(), x))  # the parent's order would differ here
    assert {m.value: m.reduction for m in ReductionName} == REDUCTIONS
    assert all(type(make_reduction(name)) is cls for name, cls in REDUCTIONS.items())
