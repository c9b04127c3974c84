"""Hypothesis strategies for numerics properties of distributed reductions: public API.

Composable building blocks for property tests of your own distributed code (with the ``simdist_world``
fixture of `simdist.pytest_plugin`; README, "Property-test your own distributed code") and of simdist's:

* `parallel_specs` -- valid `ParallelSpec` layouts (optionally with fixed sizes);
* `float_values` -- exact values of one dtype, with the adversarial corners a
  reduction meets: subnormals, the largest finite values, signed zeros and,
  when allowed, NaN and infinities;
* `tensors` -- a tensor of such values;
* `rank_tensors` -- the per-rank tensors of one group, including structured
  cases that plain independent draws almost never hit: exact cancellation
  between ranks and sums that land on a rounding tie;
* `bf16_values`, `bf16_gradients`, `peer_gradients` -- BF16 local gradients
  and how TP peers' gradients relate (independent, identical, cancelling,
  on ties, at BF16 midpoints);
* `gradient_streams` -- a whole ``(step, micro, rank, param) -> gradient``
  stream for a spec, value by value;
* `gradient_batches` -- the same, cheap to draw: bytes read as BF16 bits
  (`VALUE_MODES`) with the peer layouts applied by tensor operations, held
  rank-batched (`GradientBatch`) for `simdist.gradpath.batched.BatchedPath`;
* `policies` -- registered precision policies;
* `oracle_cases` -- property (a)'s cases: a layout, GAS, steps and a gradient batch for the compact workload
  of `simdist.testing._internal.compact`.

All values are built from sign, exponent and significand integers, so every
drawn value is exactly representable in the requested dtype and shrinks
towards small, simple numbers.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch
from hypothesis import strategies as st

from simdist.errors import UsageError
from simdist.numerics.floats import float_format
from simdist.testing._internal.compact import PARAMS as COMPACT_PARAMS
from simdist.world.spec import EpLayout, ParallelSpec

__all__ = [
    "BF16_SAFE_EXPONENT",
    "PEER_LAYOUTS",
    "VALUE_MODES",
    "GradientBatch",
    "GradientStream",
    "bf16_gradients",
    "bf16_values",
    "float_values",
    "gradient_batches",
    "gradient_streams",
    "oracle_cases",
    "parallel_specs",
    "peer_gradients",
    "policies",
    "rank_tensors",
    "tensors",
]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@st.composite
def parallel_specs(
    draw,
    max_world_size: int = 8,
    tp: int | None = None,
    min_ep: int = 1,
    ep_layout: EpLayout = "contiguous",
) -> ParallelSpec:
    """Valid `ParallelSpec` values with ``world_size <= max_world_size``.

    ``tp`` fixes the tensor-parallel size (only layouts where it fits are
    drawn); ``min_ep`` asks for expert parallelism of at least that size.
    """
    worlds = [w for w in range(1, max_world_size + 1) if tp is None or w % tp == 0]
    world = draw(st.sampled_from(worlds))
    pp = draw(st.sampled_from([p for p in _divisors(world) if tp is None or (world // p) % tp == 0]))
    stage = world // pp
    tp_size = tp if tp is not None else draw(st.sampled_from(_divisors(stage)))
    widths = [w for w in _divisors(stage) if w >= min_ep]
    width = draw(st.sampled_from(widths))
    etp = draw(st.sampled_from([e for e in _divisors(width) if width // e >= min_ep]))
    return ParallelSpec(world, tp=tp_size, ep=width // etp, etp=etp, pp=pp, ep_layout=ep_layout)


def float_values(
    dtype: torch.dtype,
    *,
    min_exponent: int | None = None,
    max_exponent: int | None = None,
    subnormals: bool = True,
    nan: bool = False,
    infinity: bool = False,
) -> st.SearchStrategy[float]:
    """Exact values of ``dtype`` as Python floats.

    Normal values have exponents in ``[min_exponent, max_exponent]`` (default:
    the dtype's full range) and any significand; subnormals, signed zeros,
    NaN and infinities are mixed in when allowed.
    """
    fmt = float_format(dtype)
    lo = fmt.emin if min_exponent is None else max(min_exponent, fmt.emin)
    hi = fmt.emax if max_exponent is None else min(max_exponent, fmt.emax)
    frac_bits = fmt.precision - 1
    sign = st.sampled_from([1.0, -1.0])
    normal = st.builds(
        lambda s, e, m: s * (1.0 + m / 2.0**frac_bits) * 2.0**e,
        sign,
        st.integers(lo, hi),
        st.integers(0, 2**frac_bits - 1),
    )
    options = [normal, st.sampled_from([0.0, -0.0] + ([1.0, -1.0] if lo <= 0 <= hi else []))]
    if subnormals and (min_exponent is None or min_exponent <= fmt.emin):
        quantum = 2.0 ** (fmt.emin - frac_bits)
        options.append(st.builds(lambda s, m: s * m * quantum, sign, st.integers(1, 2**frac_bits - 1)))
    if nan:
        options.append(st.just(float("nan")))
    if infinity:
        options.append(st.sampled_from([float("inf"), float("-inf")]))
    return st.one_of(*options)


@functools.lru_cache(maxsize=256)
def tensors(dtype: torch.dtype, numel: int, elements: st.SearchStrategy[float] | None = None):
    """A 1-D tensor of ``numel`` values of ``dtype`` (default elements: `float_values` of finite values).

    Cached per argument tuple: `rank_tensors` draws one per rank, and building and validating a fresh
    strategy for each draw cost more than the draw itself.
    """
    elements = elements if elements is not None else float_values(dtype)
    return st.lists(elements, min_size=numel, max_size=numel).map(lambda v: torch.tensor(v, dtype=dtype))


_INT_DTYPE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bit_patterns(dtype: torch.dtype) -> st.SearchStrategy[int]:
    """Raw bit patterns of ``dtype`` as signed integers of its width, covering every class of value.

    Arbitrary patterns, plus the corners arbitrary patterns rarely hit: both zeros, both infinities, the
    largest finite values, subnormals, the quiet NaN torch makes, and NaNs of either sign with any payload
    (quiet or signalling). `pattern_tensor` turns a list of them into a tensor.
    """
    width = torch.finfo(dtype).bits
    fmt = float_format(dtype)
    mantissa = fmt.precision - 1
    exponent_ones = ((1 << (width - 1 - mantissa)) - 1) << mantissa
    sign_bit = 1 << (width - 1)

    def signed(raw: int) -> int:
        return raw - (1 << width) if raw & sign_bit else raw

    info = torch.finfo(dtype)
    specials = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, info.max, -info.max, info.tiny], dtype=dtype)
    special = st.sampled_from(specials.view(_INT_DTYPE[width // 8]).tolist())
    nan = st.builds(
        lambda sign, payload: signed((sign_bit if sign else 0) | exponent_ones | payload),
        st.booleans(),
        st.integers(1, (1 << mantissa) - 1),
    )
    subnormal = st.builds(
        lambda sign, m: signed((sign_bit if sign else 0) | m), st.booleans(), st.integers(1, (1 << mantissa) - 1)
    )
    anything = st.integers(-(1 << (width - 1)), (1 << (width - 1)) - 1)
    return st.one_of(anything, special, nan, subnormal)


def pattern_tensor(patterns: list[int], dtype: torch.dtype) -> torch.Tensor:
    """A 1-D tensor of ``dtype`` holding exactly the raw bit patterns ``patterns`` (see `bit_patterns`)."""
    width = torch.finfo(dtype).bits
    return torch.tensor(patterns, dtype=_INT_DTYPE[width // 8]).view(dtype)


@st.composite
def rank_tensors(
    draw,
    group_size: int,
    numel: int,
    dtype: torch.dtype,
    elements: st.SearchStrategy[float] | None = None,
) -> list[torch.Tensor]:
    """The per-rank tensors of one group, in group-rank order.

    Besides independent draws, two structured shapes are mixed in:

    * cancellation -- rank 1 holds rank 0's values negated, so the exact sum
      cancels and rounding errors of later partials are exposed;
    * ties -- rank 0 holds ``x`` and the others hold half an ulp of ``x``
      (for ``x`` a power-of-two multiple of 1), so sums land on rounding ties.
    """
    elements = elements if elements is not None else float_values(dtype)
    shape = draw(st.sampled_from(["independent", "independent", "cancellation", "ties"]))
    per_rank = [draw(tensors(dtype, numel, elements)) for _ in range(group_size)]
    if shape == "cancellation" and group_size >= 2:
        per_rank[1] = -per_rank[0]
    elif shape == "ties":
        fmt = float_format(dtype)
        base = draw(st.integers(-8, 8))
        x = draw(tensors(dtype, numel, st.sampled_from([1.0, -1.0, 1.5, 3.0]))) * 2.0**base
        _, exponent = torch.frexp(x.float())
        half_ulp = torch.ldexp(torch.ones(numel), exponent - 1 - fmt.precision).to(dtype)
        per_rank = [x] + [half_ulp.clone() for _ in range(group_size - 1)]
    return per_rank


# -- gradient-path strategies --------------------------------------------------
# The strategy builders below are cached per argument tuple: building and validating a fresh strategy for each
# tensor of a gradient stream would dominate the cost of a gradient-path example.

BF16_SAFE_EXPONENT = 120
"""Default largest binade of `bf16_values`: a sum of up to 64 such values stays below 2**128, the overflow
threshold of BF16 and FP32 alike, so TP, GAS and DP sums of drawn gradients never overflow (Adam's ``g*g``
may, identically in every policy)."""

PEER_LAYOUTS: tuple[str, ...] = ("independent", "identical", "cancellation", "ties", "midpoint")
"""How the TP peers' local gradients relate (see `peer_gradients`)."""


@functools.lru_cache(maxsize=64)
def bf16_values(
    *,
    max_exponent: int = BF16_SAFE_EXPONENT,
    subnormals: bool = True,
    nan: bool = False,
    infinity: bool = False,
) -> st.SearchStrategy[float]:
    """Exact BF16 values as Python floats, weighted towards the corners of a BF16 gradient path.

    A mix of `float_values` over the whole BF16 range up to ``2**max_exponent``
    (signed zeros included), small exact integers (the values unit tests like
    to use), huge magnitudes in the top four binades below ``2**(max_exponent+1)``
    and, with ``subnormals``, values at the bottom of the range (the smallest
    normal binade and BF16 subnormals).
    """
    bf16 = torch.bfloat16
    emin = float_format(bf16).emin
    options = [
        float_values(bf16, max_exponent=max_exponent, subnormals=subnormals, nan=nan, infinity=infinity),
        st.integers(-16, 16).map(float),
        float_values(bf16, min_exponent=max_exponent - 3, max_exponent=max_exponent),
    ]
    if subnormals:
        options.append(float_values(bf16, max_exponent=emin))
    return st.one_of(*options)


@functools.lru_cache(maxsize=256)
def bf16_gradients(
    shape: tuple[int, ...],
    elements: st.SearchStrategy[float] | None = None,
    *,
    max_exponent: int = BF16_SAFE_EXPONENT,
) -> st.SearchStrategy[torch.Tensor]:
    """BF16 tensors of ``shape`` (zero-size shapes allowed) with adversarial values.

    Elements default to `bf16_values` (subnormals, huge magnitudes below the
    overflow-safe bound ``2**(max_exponent+1)``, signed zeros, small integers).
    Cross-rank structure -- cancellation between peers and TP averages that
    land on BF16 rounding ties -- is what `peer_gradients` adds on top.
    """
    elements = elements if elements is not None else bf16_values(max_exponent=max_exponent)
    numel = 1
    for size in shape:
        numel *= size
    return tensors(torch.bfloat16, numel, elements).map(lambda t: t.reshape(shape))


def _next_away_from_zero(t: torch.Tensor) -> torch.Tensor:
    """The BF16 neighbour of each element one ulp further from zero (towards zero where that would overflow)."""
    raw = t.contiguous().view(torch.int16)
    up = (raw + 1).view(torch.bfloat16)
    down = (raw - 1).view(torch.bfloat16)
    return torch.where(torch.isfinite(up), up, down)


@functools.lru_cache(maxsize=256)
@st.composite
def peer_gradients(
    draw,
    group_size: int,
    shape: tuple[int, ...],
    elements: st.SearchStrategy[float] | None = None,
    layouts: tuple[str, ...] = PEER_LAYOUTS,
) -> list[torch.Tensor]:
    """The BF16 local gradients of one TP group (group-rank order), in one of ``layouts``.

    * ``independent`` -- one `bf16_gradients` draw per peer;
    * ``identical`` -- every peer holds the same tensor (replicated compute:
      the TP average is the BF16 value itself, so a BF16 writeback rounds nothing);
    * ``cancellation`` -- peer 1 holds peer 0's values negated (the exact sum is zero);
    * ``ties`` -- peer 0 holds ``x`` in {±1, 1.5, 3} x 2**k and the others half a
      BF16 ulp of ``x``: with two peers ``x + h`` and ``(x + h) / 2`` are exact
      BF16 rounding ties;
    * ``midpoint`` -- peers alternate ``x`` and its BF16 neighbour away from
      zero, so with an even group the FP32 average (and the sum) is exactly
      half-way between two BF16 values.
    """
    layout = draw(st.sampled_from(layouts))
    if layout == "identical":
        x = draw(bf16_gradients(shape, elements))
        return [x.clone() for _ in range(group_size)]
    if layout == "midpoint":
        x = draw(bf16_gradients(shape, elements))
        neighbour = _next_away_from_zero(x)
        return [(x if i % 2 == 0 else neighbour).clone() for i in range(group_size)]
    if layout == "ties":
        numel = 1
        for size in shape:
            numel *= size
        base = draw(st.integers(-8, 8))
        x = draw(tensors(torch.bfloat16, numel, st.sampled_from([1.0, -1.0, 1.5, 3.0]))) * 2.0**base
        _, exponent = torch.frexp(x.float())
        half_ulp = torch.ldexp(torch.ones(numel), exponent - 1 - float_format(torch.bfloat16).precision)
        half_ulp = half_ulp.to(torch.bfloat16)
        return [x.reshape(shape)] + [half_ulp.reshape(shape).clone() for _ in range(group_size - 1)]
    per_rank = [draw(bf16_gradients(shape, elements)) for _ in range(group_size)]
    if layout == "cancellation" and group_size >= 2:
        per_rank[1] = -per_rank[0]
    return per_rank


class GradientStream:
    """A drawn ``(step, micro, rank, param) -> BF16 local gradient``, backed by a dict of tensors.

    ``values`` maps ``(step, micro, rank, param name)`` to the tensor; each call
    returns a copy, so a run that mutated its input could not corrupt the next.
    """

    def __init__(self, values: dict[tuple[int, int, int, str], torch.Tensor]) -> None:
        self.values = values

    def __call__(self, step: int, micro: int, rank: int, param) -> torch.Tensor:
        return self.values[(step, micro, rank, param.name)].clone()

    def __repr__(self) -> str:
        items = ", ".join(f"{k}: {v.float().tolist()}" for k, v in sorted(self.values.items()))
        return f"GradientStream({{{items}}})"


@st.composite
def gradient_streams(
    draw,
    spec: ParallelSpec,
    params,
    steps: int,
    gas: int,
    elements: st.SearchStrategy[float] | None = None,
    layouts: tuple[str, ...] = PEER_LAYOUTS,
) -> GradientStream:
    """A `GradientStream` for every step, micro-step, rank of ``spec`` and parameter of ``params``.

    ``params`` are `simdist.gradpath.families.ParamSpec` values. For each step,
    micro-step, parameter and TP group the peers' gradients are one
    `peer_gradients` draw (``elements`` and ``layouts`` are passed on), so
    cancellation and BF16 rounding ties meet the TP correction.
    """
    values = {}
    for step in range(steps):
        for micro in range(gas):
            for param in params:
                for group in spec.groups("tp"):
                    per_rank = draw(peer_gradients(len(group), tuple(param.shape), elements, layouts))
                    for rank, grad in zip(group, per_rank, strict=True):
                        values[(step, micro, rank, param.name)] = grad
    return GradientStream(values)


def policies() -> st.SearchStrategy:
    """Registered precision policies (`simdist.gradpath.policy.Policy`), sampled by name from `policy_names`.

    The names are read when the strategy is first drawn from, so policies
    registered after this call (for instance by a test module) are included.
    """
    from simdist.policies.catalogue import get_policy, policy_names

    return st.deferred(lambda: st.sampled_from(policy_names()).map(get_policy))


# -- cheap gradient batches: bytes viewed as BF16 bits -----------------------------------------------------------

VALUE_MODES: tuple[str, ...] = ("zeros", "integers", "near_one", "bits", "huge", "tiny")
"""How `gradient_batches` reads a tensor's bytes (one mode per step, micro-step and parameter), simplest first:

* ``zeros`` -- zero (what shrinking reaches first: only the tensors that matter keep values);
* ``bits`` -- the bytes are the BF16 bit pattern, exponent capped at ``2**BF16_SAFE_EXPONENT`` (no NaN/Inf);
* ``integers`` -- small exact integers ``-16 .. 16``;
* ``near_one`` -- binades ``2**-4 .. 2**3`` with any significand;
* ``huge`` -- the top four binades below ``2**(BF16_SAFE_EXPONENT + 1)``;
* ``tiny`` -- BF16 subnormals and the smallest normal binade.
"""


class GradientBatch:
    """Drawn BF16 local gradients of one run, held rank-batched: ``values[(step, micro, param)] = [rank, *shape]``.

    Usable both ways: ``batch(step, micro)`` gives ``{param: [1, rank, *shape]}`` for
    `simdist.gradpath.batched.BatchedPath`, and calling it as ``(step, micro, rank, param)`` gives one
    rank's tensor (a copy) for `simdist.gradpath.path.train_rank`.
    """

    def __init__(self, values: dict[tuple[int, int, str], torch.Tensor]) -> None:
        self.values = values
        self._batches: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        for (step, micro, name), value in values.items():
            self._batches.setdefault((step, micro), {})[name] = value.unsqueeze(0)  # views: edits show

    def __call__(self, step: int, micro: int, rank: int, param) -> torch.Tensor:
        return self.values[(step, micro, param.name)][rank].clone()

    def get(self, step: int, micro: int, rank: int, name: str) -> torch.Tensor:
        """One rank's tensor (a view: tests may edit it in place before a run)."""
        return self.values[(step, micro, name)][rank]

    def batch(self, step: int, micro: int) -> dict[str, torch.Tensor]:
        return self._batches[(step, micro)]

    def stacked(self, step: int, micro: int) -> dict[str, torch.Tensor]:
        """``{param: [rank, *shape]}``: every rank's tensors at once (for `simdist.gradpath.oracle`)."""
        return {name: value[0] for name, value in self._batches[(step, micro)].items()}

    def __repr__(self) -> str:
        items = ", ".join(f"{k}: {v.float().tolist()}" for k, v in sorted(self.values.items()))
        return f"GradientBatch({{{items}}})"


@functools.lru_cache(maxsize=64)
def _batch_plan(spec: ParallelSpec, shapes: tuple[tuple[int, ...], ...]):
    """Per element: its parameter; per rank: its position in its TP group and the group's first rank."""
    import math

    param_of = (
        torch.cat([torch.full((math.prod(s),), i, dtype=torch.long) for i, s in enumerate(shapes)])
        if shapes
        else torch.zeros(0, dtype=torch.long)
    )
    position = torch.empty(spec.world_size, dtype=torch.long)
    first = torch.empty(spec.world_size, dtype=torch.long)
    for group in spec.groups("tp"):
        for j, rank in enumerate(group):
            position[rank], first[rank] = j, group[0]
    return param_of, position, first


def _read_bf16(bits: torch.Tensor, mode: torch.Tensor) -> torch.Tensor:
    """BF16 values (as fp32) from 16-bit patterns ``bits`` (int32) read in `VALUE_MODES` ``mode`` (per element)."""
    sign = bits & 0x8000
    exponent = (bits >> 7) & 0xFF
    mantissa = bits & 0x7F
    cap = 127 + BF16_SAFE_EXPONENT
    full = torch.where(exponent > cap, cap - (exponent & 7), exponent)
    near_one = 127 - 4 + (exponent & 7)
    huge = cap - (exponent & 3)
    tiny = exponent & 1
    chosen = torch.where(mode == 3, full, torch.where(mode == 2, near_one, torch.where(mode == 4, huge, tiny)))
    pattern = sign | (chosen << 7) | mantissa
    values = (pattern << 16).view(torch.float32)
    integers = ((bits & 0xFF) % 33 - 16).to(torch.float32)
    return torch.where(mode == 0, 0.0, torch.where(mode == 1, integers, values))


def _away_from_zero(x: torch.Tensor) -> torch.Tensor:
    """The BF16 neighbour of each fp32-held BF16 value one ulp further from zero (towards zero at the top)."""
    return _next_away_from_zero(x.to(torch.bfloat16)).to(torch.float32)


def gradient_batches(
    spec: ParallelSpec,
    params,
    steps: int,
    gas: int,
    modes: tuple[str, ...] = VALUE_MODES,
    layouts: tuple[str, ...] = PEER_LAYOUTS,
) -> st.SearchStrategy[GradientBatch]:
    """A `GradientBatch` for every step, micro-step, rank of ``spec`` and parameter of ``params``, drawn cheaply.

    Two draws make an example: one integer whose bytes are every value's 16 bits (read in one of ``modes``
    per step, micro-step and parameter, see `VALUE_MODES`), and one byte string with a mode byte and a
    peer-layout byte per step, micro-step and parameter (``layouts``: the `peer_gradients` layouts --
    independent, identical, cancellation, ties, midpoint -- applied to every TP group's values). Decoding
    is vectorised, so an example costs a few tensor operations whatever its size. Hypothesis shrinks both
    towards zero: zero tensors (mode ``zeros``) and independent peers, so a shrunk example keeps values
    only where they matter.
    """
    check_modes_and_layouts(modes, layouts)
    return _gradient_batches(spec, tuple(params), steps, gas, tuple(modes), tuple(layouts))


@st.composite
def _gradient_batches(draw, spec, params, steps, gas, modes, layouts) -> GradientBatch:
    shapes = tuple(tuple(p.shape) for p in params)
    ranks, numel, count = spec.world_size, sum(_numel(s) for s in shapes), len(shapes)
    cells = steps * gas
    size = 2 * cells * ranks * numel
    raw = draw(st.integers(0, (1 << (8 * size)) - 1)).to_bytes(size, "big") if size else b""
    choice = draw(st.binary(min_size=2 * cells * count, max_size=2 * cells * count)) if cells * count else b""
    return decode_batch(spec, params, steps, gas, raw, choice, modes, layouts)


def decode_batch(spec, params, steps, gas, raw: bytes, choice: bytes, modes, layouts) -> GradientBatch:
    """The `GradientBatch` that `gradient_batches` makes of its two draws: ``raw`` (two bytes per value: every
    step, micro-step, rank and parameter element, big-endian) and ``choice`` (a mode byte, then a layout byte, per
    step, micro-step and parameter). Torch operations; `simdist.testing._internal.case_batches` decodes many at once."""
    shapes = tuple(tuple(p.shape) for p in params)
    param_of, position, first = _batch_plan(spec, shapes)
    ranks, numel, count = spec.world_size, int(param_of.numel()), len(shapes)
    cells = steps * gas
    words = (
        torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(torch.int32)
        if raw
        else torch.zeros(0, dtype=torch.int32)
    )
    bits = (words[0::2] << 8 | words[1::2]).reshape(cells, ranks, numel)
    picks = (
        torch.frombuffer(bytearray(choice), dtype=torch.uint8).to(torch.long).reshape(2, cells, count)
        if choice
        else torch.zeros(2, cells, count, dtype=torch.long)
    )
    mode_table = torch.tensor([VALUE_MODES.index(m) for m in modes])
    layout_table = torch.tensor([PEER_LAYOUTS.index(name) for name in layouts])
    # per element: its (step, micro) cell's mode and peer layout for its parameter (the same on every rank)
    mode = mode_table[picks[0] % len(modes)][:, param_of].unsqueeze(1)
    layout = layout_table[picks[1] % len(layouts)][:, param_of].unsqueeze(1)
    values = _read_bf16(bits, mode)
    lead = values[:, first]  # the value of each rank's TP group's first rank
    pos = position.view(1, -1, 1)
    out = values
    out = torch.where(layout == PEER_LAYOUTS.index("identical"), lead, out)
    out = torch.where((layout == PEER_LAYOUTS.index("cancellation")) & (pos == 1), -lead, out)
    midpoint = torch.where(pos % 2 == 0, lead, _away_from_zero(lead))
    out = torch.where(layout == PEER_LAYOUTS.index("midpoint"), midpoint, out)
    # ties: the first rank holds x in {1, 1.5, 3} x 2**k (k in -8..7, sign from the bits), the others half an ulp of x
    lead_bits = bits[:, first]
    significand = torch.tensor([1.0, 1.5, 3.0, 1.0])[lead_bits & 3]
    ones = torch.ones(lead_bits.shape)
    x = torch.where(lead_bits & 0x8000 != 0, -significand, significand) * torch.ldexp(ones, ((lead_bits >> 2) & 15) - 8)
    _, exponent = torch.frexp(x)
    half_ulp = torch.ldexp(ones, exponent - 1 - float_format(torch.bfloat16).precision)
    out = torch.where(layout == PEER_LAYOUTS.index("ties"), torch.where(pos == 0, x, half_ulp), out)
    out = out.to(torch.bfloat16).reshape(steps, gas, ranks, numel)
    result, start = {}, 0
    for p, shape in zip(params, shapes, strict=True):
        stop = start + _numel(shape)
        for step in range(steps):
            for micro in range(gas):
                result[(step, micro, p.name)] = out[step, micro, :, start:stop].reshape(ranks, *shape)
        start = stop
    return GradientBatch(result)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for size in shape:
        n *= size
    return n


@st.composite
def oracle_cases(draw, spec: ParallelSpec | None = None, max_world_size: int = 8):
    """``(spec, gas, steps, gradients)`` for property (a): a layout with 2-rank TP groups (or ``spec``),
    GAS 1..4, 1..2 steps, and a `GradientBatch` drawn cheaply (`simdist.testing.strategies.gradient_batches`)."""
    if spec is None:
        spec = draw(parallel_specs(max_world_size=max_world_size, tp=2))
    gas = draw(st.integers(1, 4))
    steps = draw(st.integers(1, 2))
    return spec, gas, steps, draw(gradient_batches(spec, COMPACT_PARAMS, steps, gas))


def check_modes_and_layouts(modes: Sequence[str], layouts: Sequence[str]) -> None:
    """Refuse value modes and peer layouts the gradient decoders do not know, naming the valid ones."""
    for name in modes:
        if name not in VALUE_MODES:
            raise UsageError(f"unknown value mode {name!r}; valid: {', '.join(VALUE_MODES)}")
    for name in layouts:
        if name not in PEER_LAYOUTS:
            raise UsageError(f"unknown peer layout {name!r}; valid: {', '.join(PEER_LAYOUTS)}")
