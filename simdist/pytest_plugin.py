"""simdist's pytest plugin (entry point ``pytest11``): the ``simdist_world`` fixture.

Installed with simdist, so a project's tests can say::

    def test_allreduce(simdist_world):
        results = simdist_world.run(fn, 4, args=(grads,))    # fn(rank, grads): plain torch.distributed

`SimdistWorld.run` is the launcher `simdist.run` (each call its own fresh world; ranks as threads unless the call
says ``where=``); `SimdistWorld.blame` is `simdist.blame`. Both take what those functions take -- ``fn``'s own
arguments in ``args=`` and ``kwargs=``, apart from the launcher's keywords -- with the fixture's ``reduction`` and
``timeout_s`` as defaults. The fixture holds no state between calls, so it is session-scoped: Hypothesis
``@given`` tests can take it without a function-scoped-fixture health check.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:  # loading the plugin, which pytest does in every session, imports no torch
    from simdist.attribution.report import BlameReport
    from simdist.world.spec import ParallelSpec

LAUNCHER_DEFAULT: Any = object()
"""``timeout_s`` left to the launcher: `simdist.world.options.DEFAULT_TIMEOUT_S` (not imported here, so that
loading the plugin, which pytest does in every session, imports no torch)."""


class SimdistWorld:
    """Runs rank functions on fresh simulated worlds; ``reduction`` and ``timeout_s`` are the defaults of each run.

    ``reduction`` is what `simdist.run` takes (a name, a `Reduction`, a group kind -> reduction table, ...);
    ``None`` leaves it to `simdist.run`'s default, `simdist.world.options.DEFAULT_REDUCTION` (gloo's order).
    A call's own ``reduction=`` wins over the default.
    ``timeout_s`` left unset is the launcher's one deadline, `simdist.world.options.DEFAULT_TIMEOUT_S`."""

    def __init__(self, reduction: Any = None, timeout_s: Any = LAUNCHER_DEFAULT) -> None:
        self.reduction = reduction
        self.timeout_s = timeout_s

    def _defaults(self, options: dict[str, Any]) -> dict[str, Any]:
        """``options`` with this world's defaults added where the call gave none."""
        if self.reduction is not None:
            options.setdefault("reduction", self.reduction)
        if self.timeout_s is not LAUNCHER_DEFAULT:
            options.setdefault("timeout_s", self.timeout_s)
        return options

    def run(self, fn: Callable[..., Any], world: int | ParallelSpec, **options: Any) -> list[Any]:
        """`simdist.run` with this world's defaults: ``fn(rank, *args, **kwargs)`` on every rank of ``world``, the
        per-rank results in rank order. ``options`` are `simdist.run`'s keywords (``args=``, ``kwargs=``,
        ``where=``, ``reduction=``, ...)."""
        from simdist.world.runner import run

        return run(fn, world, **self._defaults(options))

    def blame(self, fn: Callable[..., Any], world: int | ParallelSpec, **options: Any) -> BlameReport:
        """`simdist.blame` with this world's defaults: per-site rounding error of ``fn``. ``options`` are
        `simdist.blame`'s keywords (``args=``, ``kwargs=``, ``promote=``, ``reduction=``, ...)."""
        from simdist.attribution import blame

        return blame(fn, world, **self._defaults(options))


@pytest.fixture(scope="session")
def simdist_world() -> SimdistWorld:
    """A `SimdistWorld` with the launcher's defaults (gloo's summation order, its one deadline per run)."""
    return SimdistWorld()
