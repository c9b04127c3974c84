"""The ``simdist`` backend of ``torch.distributed``, registered without importing torch.

``import simdist`` must cost nothing (no torch, no ``torch.distributed``, no compiler), yet a script that did
only ``import simdist`` must find ``dist.init_process_group("simdist")`` working. `install` does both:

* when ``torch.distributed`` is already imported, it registers the backend at once;
* otherwise it puts a finder on ``sys.meta_path`` that registers it right after ``torch.distributed`` is
  imported (``import torch`` imports it).

The same finder wraps DDP's ZeRO overlap hooks when their module is imported (gloo refuses that overlap, and so
must a ``simdist`` group that models gloo: `simdist.world.backend.gloo_names`), and removes itself once it has seen
both modules. This is the one place the backend is registered from: nothing else registers it at import.

Registering is one entry in ``dist.Backend``'s table whose factory, `create_group`, imports the backend itself
(`simdist.world.backend.registration`) when c10d makes the first ``simdist`` group and completes the registration
there: the first use pays, nothing before it. This is the one place that registers the backend: importing
``simdist.world`` or any module under it registers nothing.
torch offers no entry point for process-group backends (its ``torch.backends`` entry points would run in every
``import torch`` of the environment), hence the finder. This module imports only the standard library.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import warnings
from collections.abc import Callable
from types import ModuleType
from typing import Any

BACKEND = "simdist"
"""The name given to ``init_process_group`` (`simdist.world.backend.process_group.BACKEND_NAME`; a test checks they
agree)."""

_DIST = "torch.distributed"
_ZERO_HOOK = "torch.distributed.algorithms.ddp_comm_hooks.ddp_zero_hook"
"""`simdist.world.backend.gloo_names.ZERO_HOOK_MODULE` (a test checks they agree): its ZeRO overlap hooks are wrapped
when a program imports it, so no run pays for importing it (about 1 s) to wrap what it never calls."""


def create_group(options: Any, backend_options: Any = None) -> Any:
    """c10d's factory for ``simdist`` groups: imports the backend on first use and hands over to it."""
    from simdist.world.backend import registration

    registration.complete()  # the rest of the registration (gloo's name-based decisions)
    return registration.create_group(options, backend_options)


def register(dist: ModuleType) -> None:
    """Add the ``simdist`` entry to ``dist.Backend`` (no-op when present, or when torch lacks distributed)."""
    backend = getattr(dist, "Backend", None)
    if backend is None or BACKEND.upper() in getattr(backend, "_plugins", {}):
        return
    backend.register_backend(BACKEND, create_group, extended_api=True, devices=["cpu", "cuda"])


def _register_quietly(dist: ModuleType) -> None:
    try:
        register(dist)
    except Exception as exc:  # never break the user's `import torch`; say why the backend is missing
        warnings.warn(f"simdist: could not register the 'simdist' backend: {exc!r}", RuntimeWarning, stacklevel=2)


def _wrap_zero_hooks(module: ModuleType) -> None:
    """gloo's refusal of ZeRO's DDP overlap on the ``simdist`` groups that model gloo (the backend's
    `simdist.world.backend.gloo_names`; ``torch.distributed`` is loaded, as the hook module's parent)."""
    try:
        from simdist.world.backend.gloo_names import wrap_zero_hooks

        wrap_zero_hooks(module)
    except Exception as exc:  # never break the user's import
        warnings.warn(f"simdist: could not wrap the ZeRO overlap hooks: {exc!r}", RuntimeWarning, stacklevel=2)


_ON_IMPORT: dict[str, Callable[[ModuleType], None]] = {_DIST: _register_quietly, _ZERO_HOOK: _wrap_zero_hooks}
"""Module -> what runs right after it is first imported (each once; `_Finder`)."""


class _WatchingLoader(importlib.abc.Loader):
    """The loader of a watched module, which runs its `_ON_IMPORT` action once the module has run."""

    def __init__(self, inner: importlib.abc.Loader, then: Callable[[ModuleType], None]) -> None:
        self._inner = inner
        self._then = then

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        self._then(module)

    def __getattr__(self, name: str) -> Any:  # get_source, get_code, ... for inspect and friends
        return getattr(self._inner, name)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the loader the other finders give each watched module, once; it removes itself
    when every watched module has been seen."""

    def __init__(self, watched: dict[str, Callable[[ModuleType], None]]) -> None:
        self.watched = watched

    def find_spec(self, fullname: str, path: Any, target: ModuleType | None = None) -> Any:
        then = self.watched.pop(fullname, None)
        if then is None:
            return None
        if not self.watched:
            _uninstall()
        for finder in sys.meta_path:
            if finder is self:
                continue
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _WatchingLoader(spec.loader, then)
                return spec
        return None


def _uninstall() -> None:
    sys.meta_path[:] = [finder for finder in sys.meta_path if not isinstance(finder, _Finder)]


def install() -> None:
    """Register now if ``torch.distributed`` is loaded, else as soon as it is, and wrap the ZeRO hooks likewise
    (idempotent, thread-safe under the import lock)."""
    if any(isinstance(finder, _Finder) for finder in sys.meta_path):
        return
    unseen = {}
    for name, then in _ON_IMPORT.items():
        module = sys.modules.get(name)
        if module is None:
            unseen[name] = then
        elif name != _DIST or hasattr(module, "Backend"):
            then(module)
    if unseen:
        sys.meta_path.insert(0, _Finder(unseen))
