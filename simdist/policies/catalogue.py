"""The policy catalogue: every registered `Policy` by name, and where each came from.

On first use it imports ``simdist.policies`` (the built-in catalogue) and every module or object named by
an entry point of the ``simdist.policies`` group (installed packages); `load_policy_module` adds a user's
module, by file path (``my_policies.py``) or dotted name (``mypkg.policies``). `policy_origin` says where
a policy came from (``simdist policies`` prints it).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import sys
import traceback
from pathlib import Path
from types import ModuleType

from simdist.errors import UsageError
from simdist.gradpath.policy import Policy, register, registered

ENTRY_POINT_GROUP = "simdist.policies"
"""Entry-point group of policy plug-ins: ``[project.entry-points."simdist.policies"] mine = "mypkg.policies"``.
The value is a module (importing it registers its policies) or ``module:attr`` naming a `Policy` or a list
of them (registered by the loader)."""

BUILT_IN = "built-in (simdist.policies)"
_ORIGINS: dict[str, str] = {}
_loaded_entry_points: set[str] = set()
_catalogue_loaded = False


def _load_catalogue() -> None:
    global _catalogue_loaded
    if not _catalogue_loaded:
        import simdist.policies as built_in  # importing registers every policy module (this module's package)

        for module in vars(built_in).values():  # the built-in policies: those the package's own modules hold
            if isinstance(module, ModuleType) and module.__name__.startswith(f"{built_in.__name__}."):
                for value in vars(module).values():
                    if isinstance(value, Policy):
                        _ORIGINS.setdefault(value.name, BUILT_IN)
        _catalogue_loaded = True
        load_entry_point_policies()


def _registered(obj: object) -> list[str]:
    """Register a `Policy` or a list/tuple of them (an entry point's ``module:attr``); their names."""
    items = obj if isinstance(obj, (list, tuple)) else [obj]
    names = []
    for item in items:
        if isinstance(item, Policy):
            register(item)
            names.append(item.name)
    return names


def _where(exc: BaseException, path: str | None = None) -> str:
    """`` at file:line`` of the innermost frame of ``exc`` (in ``path`` when given), or ``""`` (a SyntaxError
    names its own file and line)."""
    if isinstance(exc, SyntaxError):
        return ""
    frames: list[traceback.FrameSummary] = traceback.extract_tb(exc.__traceback__)
    if path is not None:
        frames = [f for f in frames if Path(f.filename).resolve() == Path(path).resolve()] or frames
    return f" at {Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else ""


def load_entry_point_policies() -> list[str]:
    """Load every not yet loaded entry point of `ENTRY_POINT_GROUP`; the names of the policies they registered.

    A broken entry point is a one-line ``ValueError`` naming it (never skipped silently).
    """
    names: list[str] = []
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        key = f"{ep.name}={ep.value}"
        if key in _loaded_entry_points:
            continue
        _loaded_entry_points.add(key)
        before = set(registered())
        try:
            found = _registered(ep.load())
        except Exception as exc:
            raise UsageError(
                f"policy entry point {ep.name!r} ({ep.value}) failed to load{_where(exc)}: {type(exc).__name__}: {exc}"
            ) from None
        dist = getattr(ep, "dist", None)
        origin = f"entry point {ep.name} = {ep.value}" + (f" (package {dist.name})" if dist is not None else "")
        for name in [*found, *(set(registered()) - before)]:
            _ORIGINS[name] = origin
            if name not in names:
                names.append(name)
    return names


def load_policy_module(source: str) -> list[str]:
    """Import a user's policy module and return the names of the policies it registered.

    ``source`` is a file path (ends in ``.py`` or contains a path separator) or a dotted module name. The
    module registers its policies with `simdist.gradpath.policy.register`, as the built-in ones do; it is
    executed afresh on every call (a module imported before is reloaded). Any failure -- no such file or
    module, an exception in the module, a name clash, no policy registered -- is a one-line ``ValueError``
    naming ``source``.
    """
    _load_catalogue()
    before = registered()
    is_path = source.endswith(".py") or "/" in source or "\\" in source
    try:
        if is_path:
            path = Path(source)
            if not path.is_file():
                raise UsageError(f"--policy-module {source}: no such file")
            name = f"simdist_user_policies.{path.stem}"
            spec = importlib.util.spec_from_file_location(name, path)
            if spec is None or spec.loader is None:
                raise UsageError(f"--policy-module {source}: not a Python module")
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            try:
                spec.loader.exec_module(module)
            except BaseException:
                sys.modules.pop(name, None)
                raise
        else:
            try:
                found = importlib.util.find_spec(source)
            except (ImportError, ValueError):  # a parent package is missing, or the name is malformed
                found = None
            if found is None:
                raise UsageError(
                    f"--policy-module {source}: no module named {source!r} (give a dotted module "
                    "name on sys.path or a path to a .py file)"
                )
            module = importlib.reload(sys.modules[source]) if source in sys.modules else importlib.import_module(source)
    except ValueError as exc:
        if str(exc).startswith("--policy-module"):
            raise
        raise UsageError(f"--policy-module {source}{_where(exc, source if is_path else None)}: {exc}") from None
    except (Exception, SystemExit) as exc:
        raise UsageError(
            f"--policy-module {source} failed{_where(exc, source if is_path else None)}: {type(exc).__name__}: {exc}"
        ) from None
    now = registered()
    names = [n for n, p in now.items() if n not in before or p is not before[n]]
    names += [p.name for p in vars(module).values() if isinstance(p, Policy) and p.name in now and p.name not in names]
    if not names:
        raise UsageError(
            f"--policy-module {source}: registered no policy (call "
            "simdist.gradpath.policy.register(Policy(...)) in the module)"
        )
    origin = f"--policy-module {source}"
    for name in names:
        if _ORIGINS.get(name) != BUILT_IN:
            _ORIGINS[name] = origin
    return names


def policy_origin(name: str) -> str:
    """Where policy ``name`` came from: built-in, an entry point, a ``--policy-module``, or registered at runtime."""
    _load_catalogue()
    return _ORIGINS.get(name, "registered at runtime (simdist.gradpath.policy.register)")


def get_policy(name: str) -> Policy:
    """The registered policy called ``name``; ``ValueError`` listing the valid names otherwise."""
    _load_catalogue()
    try:
        return registered()[name]
    except KeyError:
        raise UsageError(f"unknown policy {name!r}; valid: {', '.join(policy_names())}") from None


def policy_names() -> list[str]:
    """Names of every registered policy, in registration order."""
    _load_catalogue()
    return list(registered())
