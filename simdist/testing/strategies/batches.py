"""Strategies that draw a run's BF16 local gradients cheaply: bytes read as BF16 bits (`VALUE_MODES`) with the TP
peer layouts applied by tensor operations (`gradient_batches`, decoded by `decode_batch`), held rank-batched
(`GradientBatch`). Public through `simdist.testing.strategies`."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch
from hypothesis import strategies as st

from simdist.errors import UsageError
from simdist.numerics.floats import float_format
from simdist.testing.strategies.gradients import BF16_SAFE_EXPONENT, PEER_LAYOUTS, next_away_from_zero
from simdist.world.spec import ParallelSpec

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
    return next_away_from_zero(x.to(torch.bfloat16)).to(torch.float32)


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


def check_modes_and_layouts(modes: Sequence[str], layouts: Sequence[str]) -> None:
    """Refuse value modes and peer layouts the gradient decoders do not know, naming the valid ones."""
    for name in modes:
        if name not in VALUE_MODES:
            raise UsageError(f"unknown value mode {name!r}; valid: {', '.join(VALUE_MODES)}")
    for name in layouts:
        if name not in PEER_LAYOUTS:
            raise UsageError(f"unknown peer layout {name!r}; valid: {', '.join(PEER_LAYOUTS)}")
