"""simdist's pytest plugin (entry point ``pytest11``): the ``simdist_world`` fixture.

Installed with simdist, so a project's tests can say::

    def test_allreduce(simdist_world):
        results = simdist_world.spawn(fn, 4)          # fn(rank, ...): plain torch.distributed

`SimdistWorld.spawn` is `simdist.spawn` (each call its own fresh world, ranks as threads, collectives by a
reduction model); `SimdistWorld.blame` is `simdist.blame`. The fixture holds no state between calls, so it
is session-scoped: Hypothesis ``@given`` tests can take it without a function-scoped-fixture health check.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest


class SimdistWorld:
    """Runs rank functions on fresh simulated worlds; ``model`` and ``timeout_s`` are the defaults of each run."""

    def __init__(self, model: Any = "gloo", timeout_s: float | None = 120.0) -> None:
        self.model = model
        self.timeout_s = timeout_s

    def spawn(self, fn: Callable[..., Any], world_size: int, *args: Any, **kwargs: Any) -> list[Any]:
        """``fn(rank, *args, **kwargs)`` on ``world_size`` rank threads; the per-rank results (`simdist.spawn`)."""
        from simdist.world.inproc import spawn

        kwargs.setdefault("model", self.model)
        kwargs.setdefault("timeout_s", self.timeout_s)
        return spawn(fn, world_size, *args, **kwargs)

    def blame(self, fn: Callable[..., Any], world_size: int, *args: Any, **kwargs: Any):
        """`simdist.blame` on this world's defaults: per-site rounding error of ``fn``."""
        from simdist.attribution import blame

        kwargs.setdefault("model", self.model)
        kwargs.setdefault("timeout_s", self.timeout_s)
        return blame(fn, world_size, *args, **kwargs)


@pytest.fixture(scope="session")
def simdist_world() -> SimdistWorld:
    """A `SimdistWorld` (gloo's summation order, a 120 s bound per run)."""
    return SimdistWorld()
