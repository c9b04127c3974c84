"""Strategies that draw BF16 local gradients value by value: `bf16_values`, `bf16_gradients`, how TP peers'
gradients relate (`peer_gradients`, `PEER_LAYOUTS`) and a whole ``(step, micro, rank, param)`` stream
(`gradient_streams`, `GradientStream`). Public through `simdist.testing.strategies`."""

from __future__ import annotations

import functools

import torch
from hypothesis import strategies as st

from simdist.numerics.floats import float_format
from simdist.testing.strategies.values import float_values, tensors
from simdist.world.spec import ParallelSpec

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


def next_away_from_zero(t: torch.Tensor) -> torch.Tensor:
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
        neighbour = next_away_from_zero(x)
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
