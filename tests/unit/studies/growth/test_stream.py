"""The growth stream's fast draw gives the bits of its plain definition, and of the draws README's figures used."""

from __future__ import annotations

import zlib

import pytest
import torch

from simdist.numerics.kernels import kernel_family
from simdist.sources.synthetic import DEFAULT_PARAMS
from simdist.studies.growth import BatchedGradients
from simdist.world.spec import ParallelSpec


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


@pytest.mark.parametrize(
    "spec", [ParallelSpec(4, tp=2, ep=2), ParallelSpec(8, tp=2, ep=2), ParallelSpec(8, tp=4, ep=2)], ids=str
)
def test_draw_gives_the_bits_of_draw_reference(spec):
    """Every parameter, seed, rank, several steps and micro-steps: `draw` == `draw_reference` bit for bit."""
    stream = BatchedGradients(spec, DEFAULT_PARAMS, [0, 5, 11])
    for step in (0, 1, 999, 10_000):
        for micro in (0, 1):
            fast, plain = stream.draw(step, micro), stream.draw_reference(step, micro)
            assert list(fast) == list(plain)
            for name, value in fast.items():
                assert value.dtype == plain[name].dtype == torch.bfloat16
                assert value.shape == plain[name].shape
                assert torch.equal(_raw(value), _raw(plain[name])), (step, micro, name)


BASE_COMMIT_DRAWS = {
    "x86-fma": {(0, 0): 0x400AA7FB, (7, 1): 0x4AD81019},
    "default": {(0, 0): 0x400AA7FB, (7, 1): 0xC379A74C},
}
"""CRC-32 of two draws per kernel family: ``randn`` takes a vectorised path on AVX2/AVX-512 and a scalar one
under ``ATEN_CPU_CAPABILITY=default``, so its bits differ there (step 0's draw is below the vector path's size)."""


def test_the_draws_are_those_of_the_base_commit():
    """A checksum of two draws, taken from the stream before it was made faster (a082653): README's exponents
    come from these bits (the x86-fma family's)."""
    family = kernel_family()
    if family not in BASE_COMMIT_DRAWS:
        pytest.skip(f"no recorded draws for torch's {family!r} CPU kernels")
    stream = BatchedGradients(ParallelSpec(4, tp=2, ep=2), DEFAULT_PARAMS, [0, 1])
    for (step, micro), expected in BASE_COMMIT_DRAWS[family].items():
        drawn = stream.draw(step, micro)
        data = b"".join(_raw(drawn[name]).numpy().tobytes() for name in sorted(drawn))
        assert zlib.crc32(data) == expected, (family, step, micro)
