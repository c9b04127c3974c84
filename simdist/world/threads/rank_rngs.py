"""Python's global ``random`` and NumPy's global ``np.random`` generator, one per rank thread.

A rank of a real job is a process with its own ``random`` and ``np.random``
state, so ``random.seed(rank); np.random.seed(rank); random.shuffle(data)``
gives each rank its own stream. Rank threads share one interpreter, so while a
`simdist.run` runs, `RankGenerators` replaces the module functions that use
the shared generators (``random.seed``, ``random.shuffle``, ``np.random.seed``,
``np.random.rand``, ... every function of ``random`` bound to its hidden
instance, every legacy function of ``numpy.random``) with dispatchers: on a
rank thread they call the same method of that rank's own ``random.Random`` /
``np.random.RandomState``, elsewhere the original. A rank's generators start
seeded from OS entropy, as a fresh interpreter's are; seeded with the same
value they give the same numbers as the module functions (the same class and
seeding). Dispatch costs one Python call per use, nothing at baton handoffs
(swapping the states at every handoff would cost ~20 us for ``random`` and
~150 us for NumPy's, on the 2-vCPU machine).

What cannot be dispatched is refused, naming the rank, the call site and the
fix: a reference to the shared generator's methods taken before the spawn
(``from random import shuffle`` at import time, ``random._inst``) reaches the
one shared ``random.Random``; its class is swapped for the spawn's duration for
a subclass whose generator methods raise `SharedGlobalStateError` when called
on a rank thread, at first use. NumPy's ``RandomState`` is a C type whose class
cannot be swapped: a use of the shared one behind the dispatchers' back (a
``from numpy.random import rand`` taken before the spawn, ``np.random.mtrand._rand``)
is found when the spawn ends (its state changed) and refused then, naming it.
NumPy imported by a rank during the spawn is dispatched from the rank's next
baton handoff on (`RankGenerators.refresh`).
"""

from __future__ import annotations

import os
import random
import sys
from collections.abc import Callable
from typing import Any

from simdist.errors import SimdistRuntimeError


class SharedGlobalStateError(SimdistRuntimeError):
    """A rank thread used process-global state that `simdist.run` cannot give each rank (one line, named)."""


FIX = 'run it in process mode: simdist.run(fn, n, where="processes")'
"""The advice every refusal carries."""

_GENERATOR_METHODS = ("random", "getrandbits", "seed", "getstate", "setstate", "randbytes")


def call_site(skip: tuple[str, ...] = ("numpy/random",)) -> str:
    """``file:line`` of the innermost frame outside simdist's world package, ``random`` and files whose path
    contains one of ``skip`` (the framework's own code, so the line named is the user's)."""
    frame = sys._getframe(1)
    world = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # simdist/world/, every wing
    while frame is not None:
        name = frame.f_code.co_filename
        path = name.replace("\\", "/")
        if not name.startswith(world) and name != random.__file__ and not any(s in path for s in skip):
            return f"{name}:{frame.f_lineno}"
        frame = frame.f_back  # type: ignore[assignment]
    return "<unknown>"


def _guarded_class(base: type, rank_of: Callable[[], int | None]) -> type:
    """A subclass of ``random.Random`` whose generator methods refuse to run on a rank thread."""

    def guard(name: str) -> Callable[..., Any]:
        original = getattr(base, name)

        def method(self, *args, **kwargs):
            rank = rank_of()
            if rank is not None:
                raise SharedGlobalStateError(
                    f"rank {rank} used Python's shared global `random` generator at {call_site()} through a "
                    f"reference taken before the spawn (e.g. `from random import ...` at import time): it is one per "
                    "process; call it through the module (`import random` then `random.shuffle(...)`, per rank on "
                    f"threads), or {FIX}"
                )
            return original(self, *args, **kwargs)

        method.__name__ = name
        return method

    return type("SharedRandom", (base,), {name: guard(name) for name in _GENERATOR_METHODS if hasattr(base, name)})


def _bound_to(module: Any, instance: Any) -> list[str]:
    """Names of ``module``'s attributes that are methods bound to ``instance``."""
    return [name for name, value in vars(module).items() if getattr(value, "__self__", None) is instance]


class RankGenerators:
    """Per-rank ``random.Random`` and ``np.random.RandomState`` behind the module functions, during one spawn.

    `install` patches the modules, `uninstall` undoes it (the caller's generators are untouched: rank threads
    never reach them), `refresh` patches NumPy if a rank imported it since, `give_back_shared_numpy` says whether
    the shared NumPy generator changed behind the dispatchers' back (and puts back its state).
    """

    def __init__(self, world_size: int, rank_of: Callable[[], int | None]) -> None:
        self.rank_of = rank_of
        self.python: list[random.Random | None] = [None] * world_size
        self.numpy: list[Any] = [None] * world_size
        self._undo: list[Callable[[], None]] = []
        self._numpy_state: Any = None
        self.numpy_patched = False

    def python_of(self, rank: int) -> random.Random:
        gen = self.python[rank]
        if gen is None:
            gen = self.python[rank] = random.Random()  # seeded from OS entropy, as a fresh interpreter's
        return gen

    def numpy_of(self, rank: int) -> Any:
        gen = self.numpy[rank]
        if gen is None:
            gen = self.numpy[rank] = sys.modules["numpy.random"].RandomState()  # entropy-seeded, as at import
        return gen

    def install(self) -> None:
        inst = random._inst
        for name in _bound_to(random, inst):
            self._dispatch(random, name, getattr(random, name), self.python_of, name)
        base = type(inst)
        inst.__class__ = _guarded_class(base, self.rank_of)
        self._undo.append(lambda: setattr(inst, "__class__", base))
        self.refresh()

    def refresh(self) -> None:
        """Dispatch NumPy's legacy functions if NumPy is imported and not yet dispatched (cheap when done)."""
        if self.numpy_patched or "numpy.random" not in sys.modules:
            return
        self.numpy_patched = True
        nprandom = sys.modules["numpy.random"]
        mtrand = nprandom.mtrand
        shared = mtrand._rand
        methods = {name: name for name in _bound_to(mtrand, shared)}
        methods.update(seed="seed", ranf="random_sample", sample="random_sample")  # functions, not bound methods
        for module in (nprandom, mtrand):
            for name, method in sorted(methods.items()):
                if name in vars(module):
                    self._dispatch(module, name, getattr(module, name), self.numpy_of, method)
            for name in ("get_bit_generator", "set_bit_generator"):
                if name in vars(module):
                    self._refuse(module, name, getattr(module, name))
        self._numpy_state = shared.get_state(legacy=False)

    def _dispatch(self, module: Any, name: str, original: Any, of: Callable[[int], Any], method: str) -> None:
        rank_of = self.rank_of

        def dispatch(*args, **kwargs):
            rank = rank_of()
            if rank is None:
                return original(*args, **kwargs)
            return getattr(of(rank), method)(*args, **kwargs)

        dispatch.__name__ = name
        dispatch.__doc__ = getattr(original, "__doc__", None)
        dispatch.simdist_original = original  # type: ignore[attr-defined]
        setattr(module, name, dispatch)
        self._undo.append(lambda: setattr(module, name, original))

    def _refuse(self, module: Any, name: str, original: Any) -> None:
        rank_of = self.rank_of

        def refuse(*args, **kwargs):
            rank = rank_of()
            if rank is None:
                return original(*args, **kwargs)
            raise SharedGlobalStateError(
                f"rank {rank} called np.random.{name} at {call_site()}: NumPy's global bit generator is one per "
                f"process; use np.random.seed/np.random.* (per rank on threads) or {FIX}"
            )

        refuse.__name__ = name
        setattr(module, name, refuse)
        self._undo.append(lambda: setattr(module, name, original))

    def give_back_shared_numpy(self) -> bool:
        """Whether NumPy's shared generator moved during the spawn (used behind the dispatchers' back); if so,
        put back the state it had when dispatch began (the caller's)."""
        if self._numpy_state is None:
            return False
        shared = sys.modules["numpy.random"].mtrand._rand
        now, before = shared.get_state(legacy=False), self._numpy_state
        same = bool((now["state"]["key"] == before["state"]["key"]).all()) and (
            now["state"]["pos"],
            now["has_gauss"],
            now["gauss"],
        ) == (before["state"]["pos"], before["has_gauss"], before["gauss"])
        if not same:
            shared.set_state(before)
        return not same

    def uninstall(self) -> None:
        for step in reversed(self._undo):
            step()
        self._undo.clear()
