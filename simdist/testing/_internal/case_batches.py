"""Property (a)'s cases drawn several at a time: a batch of independent gradient draws per Hypothesis example.

One Hypothesis example of `oracle_case_batches` is a layout, a GAS, a step count and ``cases`` independent
gradient sets for them (`CaseBatch`: ``[case, rank, *shape]`` per step, micro-step and parameter). The
rank-batched gradient path (`simdist.gradpath.batched.BatchedPath`) runs the cases as its batch items and the
independent oracle (`simdist.gradpath.oracle`) takes them as its leading batch dimension, so the fixed cost
of an example -- Hypothesis's own bookkeeping, building the gradient path and the optimizer, the Python of every
stage -- is paid once for ``cases`` checks: `simdist.testing._internal.compact.cases_depart_from_oracle` judges every
case against the oracle, bit for bit, and names the first case that departs.

Each case is drawn and decoded exactly as `simdist.testing.strategies.gradient_batches` draws and decodes one
(the same `VALUE_MODES` and `PEER_LAYOUTS` from the same bytes; ``tests/unit/testing/test_case_batches.py`` checks
`decode_cases` against `simdist.testing.strategies.batches.decode_batch` bit for bit), only with numpy over every case
at once, and with two draws per example instead of two per case.

How many cases an example holds: ``cases`` (default 8), fewer where the drawn bytes of ``cases`` cases at the
largest GAS and step count would pass `BYTE_BUDGET` (Hypothesis keeps an example's choices within 8 KiB), so
the count depends on the layout only, never on the drawn GAS or step count (the cases' mix of GAS and steps is
the examples' mix). TP2/EP2 on 4 ranks holds 8; 8 ranks hold 4.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch
from hypothesis import strategies as st

from simdist.testing._internal.compact import PARAMS as COMPACT_PARAMS
from simdist.testing.strategies import (
    BF16_SAFE_EXPONENT,
    PEER_LAYOUTS,
    VALUE_MODES,
    GradientBatch,
    parallel_specs,
)
from simdist.testing.strategies.batches import check_modes_and_layouts
from simdist.world.spec import ParallelSpec

__all__ = ["BYTE_BUDGET", "CaseBatch", "case_batches", "cases_per_example", "decode_cases", "oracle_case_batches"]

BYTE_BUDGET = 5632
"""The most bytes of gradient bits one example draws (8 cases of TP2/EP2 at GAS 4, 2 steps): with the mode and
layout bytes it stays within Hypothesis's 8 KiB per example, and the simplest example (every value zero) stays
small, as Hypothesis's ``large_base_example`` health check asks."""

MAX_GAS, MAX_STEPS = 4, 2
"""The largest GAS and step count `oracle_case_batches` draws."""


class CaseBatch:
    """``cases`` independent sets of drawn BF16 local gradients of one run shape, held
    ``values[(step, micro, param)] = [case, rank, *shape]``.

    ``batch(step, micro)`` gives ``{param: [case, rank, *shape]}`` for `simdist.gradpath.batched.BatchedPath`
    (the cases are its batch items); ``stacked`` gives the same for `simdist.gradpath.oracle` (its leading
    batch dimension); ``case(i)`` is case ``i`` alone as a `GradientBatch` (to rerun or report it).
    """

    def __init__(self, values: dict[tuple[int, int, str], torch.Tensor], cases: int) -> None:
        self.values, self.cases = values, cases
        self._batches: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        for (step, micro, name), value in values.items():
            self._batches.setdefault((step, micro), {})[name] = value

    def batch(self, step: int, micro: int) -> dict[str, torch.Tensor]:
        return self._batches[(step, micro)]

    def stacked(self, step: int, micro: int) -> dict[str, torch.Tensor]:
        return self._batches[(step, micro)]

    def case(self, index: int) -> GradientBatch:
        """Case ``index`` alone (its tensors are views)."""
        return GradientBatch({key: value[index] for key, value in self.values.items()})

    def __repr__(self) -> str:
        return f"CaseBatch([{', '.join(repr(self.case(i)) for i in range(self.cases))}])"


def cases_per_example(spec: ParallelSpec, cases: int, params=COMPACT_PARAMS) -> int:
    """How many of ``cases`` an example of ``spec`` holds: as many as `BYTE_BUDGET` allows at the largest GAS and
    step count (at least one)."""
    per_case = 2 * MAX_GAS * MAX_STEPS * spec.world_size * sum(math.prod(p.shape) for p in params)
    return max(1, min(cases, BYTE_BUDGET // max(per_case, 1)))


@functools.lru_cache(maxsize=64)
def _plan(spec: ParallelSpec, shapes: tuple[tuple[int, ...], ...], modes: tuple[str, ...], layouts: tuple[str, ...]):
    """Per element: its parameter; per rank: its position in its TP group and the group's first rank; the mode
    and layout tables (drawn byte -> index in `VALUE_MODES` / `PEER_LAYOUTS`)."""
    param_of = np.repeat(np.arange(len(shapes)), [math.prod(s) for s in shapes]).astype(np.intp)
    position = np.empty(spec.world_size, dtype=np.int32)
    first = np.empty(spec.world_size, dtype=np.intp)
    for group in spec.groups("tp"):
        for j, rank in enumerate(group):
            position[rank], first[rank] = j, group[0]
    mode_table = np.array([VALUE_MODES.index(m) for m in modes], dtype=np.int32)
    layout_table = np.array([PEER_LAYOUTS.index(name) for name in layouts], dtype=np.int32)
    return param_of, position.reshape(1, 1, -1, 1), first, mode_table, layout_table


# the BF16 bit patterns of the small integers -16 .. 16 (exact in fp32, so the top half of the fp32 pattern)
_INTEGERS = (np.arange(-16, 17, dtype=np.float32).view(np.uint32) >> 16).astype(np.int32)
_CAP = 127 + BF16_SAFE_EXPONENT  # the largest biased exponent a drawn value may have
assert _CAP < 0xFE, "a value one ulp above the largest drawn one must stay finite (midpoint layout)"
_MODE = {name: VALUE_MODES.index(name) for name in VALUE_MODES}
_LAYOUT = {name: PEER_LAYOUTS.index(name) for name in PEER_LAYOUTS}


def _mode_values(words: np.ndarray, mode: np.ndarray) -> np.ndarray:
    """Each element's BF16 bit pattern from its 16 drawn bits under its value mode: the sign and significand
    bits kept, the exponent mapped into the mode's range (or a small integer, or zero)."""
    exponent = (words >> 7) & 0xFF
    chosen = np.choose(
        mode,
        [
            exponent,  # zeros (replaced below)
            exponent,  # integers (replaced below)
            127 - 4 + (exponent & 7),  # near_one: 2**-4 .. 2**3
            np.where(exponent > _CAP, _CAP - (exponent & 7), exponent),  # bits, exponent capped
            _CAP - (exponent & 3),  # huge
            exponent & 1,  # tiny: subnormals and the smallest normal binade
        ],
    )
    values = (words & 0x807F) | (chosen << 7)
    values = np.where(mode == _MODE["integers"], _INTEGERS[(words & 0xFF) % 33], values)
    values = np.where(mode == _MODE["zeros"], 0, values)
    return values


def _peer_layouts(
    values: np.ndarray, words: np.ndarray, layout: np.ndarray, pos: np.ndarray, first: np.ndarray
) -> np.ndarray:
    """Each element's pattern under its peer layout, from the first rank of its TP group (``lead``): the
    values as drawn, identical, cancelling, a midpoint, or a tie (as
    `simdist.testing.strategies.batches.decode_batch` draws them)."""
    lead = values[:, :, first]  # the value of each rank's TP group's first rank
    out = np.where(layout == _LAYOUT["identical"], lead, values)
    out = np.where((layout == _LAYOUT["cancellation"]) & (pos == 1), lead ^ 0x8000, out)
    # one ulp away from zero, either sign: every value's biased exponent is at most _CAP < 254, so the neighbour
    # is finite (decode_batch's step back towards zero, where it would overflow, never fires)
    away = lead + 1
    out = np.where(layout == _LAYOUT["midpoint"], np.where(pos % 2 == 0, lead, away), out)
    # ties: the first rank holds x in {1, 1.5, 3} x 2**k (k in -8..7, sign from the bits), the others half an ulp of
    # x: x's BF16 exponent is k (k + 1 for 3), half its ulp is 2**(that - 8)
    lead_words = words[:, :, first]
    significand = lead_words & 3  # 1, 1.5, 3, 1
    biased = 127 + ((lead_words >> 2) & 15) - 8 + (significand == 2)
    x = (lead_words & 0x8000) | (biased << 7) | np.where((significand == 1) | (significand == 2), 0x40, 0)
    half_ulp = (biased - 8) << 7
    out = np.where(layout == _LAYOUT["ties"], np.where(pos == 0, x, half_ulp), out)
    return out


def decode_cases(
    spec: ParallelSpec,
    params,
    steps: int,
    gas: int,
    raw: bytes,
    choice: bytes,
    cases: int,
    modes: tuple[str, ...] = VALUE_MODES,
    layouts: tuple[str, ...] = PEER_LAYOUTS,
) -> torch.Tensor:
    """``cases`` cases' BF16 gradients ``[case, step, micro, rank, element]`` (elements in parameter order) from
    their bytes: case ``c`` reads ``raw``'s ``c``-th and ``choice``'s ``c``-th equal part as
    `simdist.testing.strategies.batches.decode_batch` reads its two draws, with numpy on 16-bit patterns.

    Every value `decode_batch` makes is a BF16 value built from bits (modes), a sign flip (cancellation), an ulp
    step (midpoint) or a power of two (ties), so here each is built as its BF16 bit pattern directly.
    """
    shapes = tuple(tuple(p.shape) for p in params)
    param_of, pos, first, mode_table, layout_table = _plan(spec, shapes, tuple(modes), tuple(layouts))
    ranks, numel, count, cells = spec.world_size, len(param_of), len(shapes), steps * gas
    if cases * cells * ranks * numel == 0:
        return torch.zeros(cases, steps, gas, ranks, numel, dtype=torch.bfloat16)
    words = np.frombuffer(raw, dtype=">u2").astype(np.int32).reshape(cases, cells, ranks, numel)
    picks = np.frombuffer(choice, dtype=np.uint8).reshape(cases, 2, cells, count)
    # per element: its case's (step, micro) cell's mode and peer layout for its parameter (the same on every rank)
    mode = mode_table[picks[:, 0] % len(modes)][..., param_of][:, :, None, :]
    layout = layout_table[picks[:, 1] % len(layouts)][..., param_of][:, :, None, :]

    out = _peer_layouts(_mode_values(words, mode), words, layout, pos, first)
    patterns = torch.from_numpy(out.astype(np.uint16).view(np.int16))
    return patterns.view(torch.bfloat16).reshape(cases, steps, gas, ranks, numel)


def case_batches(
    spec: ParallelSpec,
    params,
    steps: int,
    gas: int,
    cases: int,
    modes: tuple[str, ...] = VALUE_MODES,
    layouts: tuple[str, ...] = PEER_LAYOUTS,
) -> st.SearchStrategy[CaseBatch]:
    """A `CaseBatch` of ``cases`` independent cases, each as `simdist.testing.strategies.gradient_batches` draws
    one, in two draws: one integer whose bytes are every case's values (its 16 bits each) and one byte string
    with every case's mode and layout bytes. Both shrink towards zero (mode ``zeros``, independent peers)."""
    check_modes_and_layouts(modes, layouts)
    return _case_batches(spec, tuple(params), steps, gas, cases, tuple(modes), tuple(layouts))


@st.composite
def _case_batches(draw, spec, params, steps, gas, cases, modes, layouts) -> CaseBatch:
    shapes = [tuple(p.shape) for p in params]
    numel = sum(math.prod(s) for s in shapes)
    size = 2 * cases * steps * gas * spec.world_size * numel
    picks = 2 * cases * steps * gas * len(shapes)
    raw = draw(st.integers(0, (1 << (8 * size)) - 1)).to_bytes(size, "big") if size else b""
    choice = draw(st.binary(min_size=picks, max_size=picks)) if picks else b""
    out = decode_cases(spec, params, steps, gas, raw, choice, cases, modes, layouts)
    values, start = {}, 0
    for p, shape in zip(params, shapes, strict=True):
        stop = start + math.prod(shape)
        part = out[..., start:stop]
        for step in range(steps):
            for micro in range(gas):
                values[(step, micro, p.name)] = part[:, step, micro].reshape(cases, spec.world_size, *shape)
        start = stop
    return CaseBatch(values, cases)


@st.composite
def oracle_case_batches(draw, spec: ParallelSpec | None = None, max_world_size: int = 8, cases: int = 8):
    """``(spec, gas, steps, batch)`` for property (a), several cases at once: a layout with 2-rank TP groups (or
    ``spec``), GAS 1..4, 1..2 steps (as `simdist.testing.strategies.oracle_cases` draws them), and a `CaseBatch` of
    `cases_per_example` ``(spec, cases)`` independent gradient sets for the compact workload."""
    if spec is None:
        spec = draw(parallel_specs(max_world_size=max_world_size, tp=2))
    gas = draw(st.integers(1, MAX_GAS))
    steps = draw(st.integers(1, MAX_STEPS))
    count = cases_per_example(spec, cases)
    return spec, gas, steps, draw(case_batches(spec, COMPACT_PARAMS, steps, gas, count))
