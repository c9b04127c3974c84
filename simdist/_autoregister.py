"""The ``simdist`` backend of ``torch.distributed``, registered without importing torch.

``import simdist`` must cost nothing (no torch, no ``torch.distributed``, no compiler), yet a script that did
only ``import simdist`` must find ``dist.init_process_group("simdist")`` working. `install` does both:

* when ``torch.distributed`` is already imported, it registers the backend at once;
* otherwise it puts a finder on ``sys.meta_path`` that registers it right after ``torch.distributed`` is
  imported (``import torch`` imports it), and then removes itself.

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
from types import ModuleType
from typing import Any

BACKEND = "simdist"
"""The name given to ``init_process_group`` (`simdist.world.backend.process_group.BACKEND_NAME`; a test checks they
agree)."""

_WATCHED = "torch.distributed"


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


class _RegisteringLoader(importlib.abc.Loader):
    """The loader of ``torch.distributed``, which registers the backend once the module has run."""

    def __init__(self, inner: importlib.abc.Loader) -> None:
        self._inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        _register_quietly(module)

    def __getattr__(self, name: str) -> Any:  # get_source, get_code, ... for inspect and friends
        return getattr(self._inner, name)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the loader the other finders give ``torch.distributed``, once."""

    def find_spec(self, fullname: str, path: Any, target: ModuleType | None = None) -> Any:
        if fullname != _WATCHED:
            return None
        _uninstall()
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _RegisteringLoader(spec.loader)
                return spec
        return None


def _uninstall() -> None:
    sys.meta_path[:] = [finder for finder in sys.meta_path if not isinstance(finder, _Finder)]


def install() -> None:
    """Register now if ``torch.distributed`` is loaded, else as soon as it is (idempotent, thread-safe under
    the import lock)."""
    dist = sys.modules.get(_WATCHED)
    if dist is not None and hasattr(dist, "Backend"):
        _register_quietly(dist)
        return
    if not any(isinstance(finder, _Finder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
