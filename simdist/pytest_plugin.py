"""simdist's pytest plugin (entry point ``pytest11``): the ``simdist_world`` fixture.

Installed with simdist, so a project's tests can say::

    def test_allreduce(simdist_world):
        results = simdist_world.spawn(fn, 4)          # fn(rank, ...): plain torch.distributed

`SimdistWorld.spawn` is `simdist.run` on threads (each call its own fresh world, ranks as threads, collectives by a
reduction); `SimdistWorld.blame` is `simdist.blame`. The fixture holds no state between calls, so it
is session-scoped: Hypothesis ``@given`` tests can take it without a function-scoped-fixture health check.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

LAUNCHER_DEFAULT: Any = object()
"""``timeout_s`` left to the launcher: `simdist.world.options.DEFAULT_TIMEOUT_S` (not imported here, so that
loading the plugin, which pytest does in every session, imports no torch)."""


class SimdistWorld:
    """Runs rank functions on fresh simulated worlds; ``reduction`` and ``timeout_s`` are the defaults of each run.

    ``reduction`` is what `simdist.run` takes (a name, a `Reduction`, a kind -> reduction table, ...);
    ``None`` leaves it to `simdist.run`'s default, `simdist.world.options.DEFAULT_REDUCTION` (gloo's order).
    A call's own ``reduction=`` wins over the default.
    ``timeout_s`` left unset is the launcher's one deadline, `simdist.world.options.DEFAULT_TIMEOUT_S`."""

    def __init__(self, reduction: Any = None, timeout_s: Any = LAUNCHER_DEFAULT) -> None:
        self.reduction = reduction
        self.timeout_s = timeout_s

    def _defaults(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        if self.reduction is not None and "reduction" not in kwargs:
            kwargs["reduction"] = self.reduction
        if self.timeout_s is not LAUNCHER_DEFAULT:
            kwargs.setdefault("timeout_s", self.timeout_s)
        return kwargs

    def spawn(self, fn: Callable[..., Any], world_size: int, *args: Any, **kwargs: Any) -> list[Any]:
        """``fn(rank, *args, **kwargs)`` on ``world_size`` rank threads; the per-rank results (`simdist.run`; the
        launcher's keywords parted from ``fn``'s by `simdist.world.runner.split_keywords`)."""
        from simdist.world.runner import run, split_keywords

        world, launch, fn_kwargs = split_keywords(world_size, self._defaults(kwargs))
        return run(fn, world, args=args, kwargs=fn_kwargs, **launch)

    def blame(self, fn: Callable[..., Any], world_size: int, *args: Any, **kwargs: Any):
        """`simdist.blame` on this world's defaults: per-site rounding error of ``fn``."""
        from simdist.attribution import blame

        return blame(fn, world_size, *args, **self._defaults(kwargs))


@pytest.fixture(scope="session")
def simdist_world() -> SimdistWorld:
    """A `SimdistWorld` with the launcher's defaults (gloo's summation order, its one deadline per run)."""
    return SimdistWorld()
