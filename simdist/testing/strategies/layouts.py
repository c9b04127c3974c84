"""Strategies that draw layouts: valid `ParallelSpec` values (`parallel_specs`). Public through
`simdist.testing.strategies`."""

from __future__ import annotations

from hypothesis import strategies as st

from simdist.world.spec import EpLayout, ParallelSpec


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
