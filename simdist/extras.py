"""The optional frameworks (``pyproject.toml``'s extras) and whether each is importable here.

One answer for every test, case and command that needs DeepSpeed or Megatron-Core: `installed` asks the import
system where the framework's module is without importing it, and treats a missing parent package as "not
installed". ``importlib.util.find_spec("megatron.core")`` alone raises ``ModuleNotFoundError`` when ``megatron``
itself is absent (it returns ``None`` only for a missing last component), which once stopped the whole test
suite at collection on an install without the extra.
"""

from __future__ import annotations

import importlib.util

from simdist import DISTRIBUTION
from simdist.errors import UsageError

EXTRAS: dict[str, str] = {
    "deepspeed": "deepspeed",
    "megatron": "megatron.core",
}
"""Extra of ``pyproject.toml`` -> the module it makes importable (the one a case or test needs)."""


def importable(module: str) -> bool:
    """Whether ``module`` (dotted) can be imported here, found without importing it.

    Parents of a dotted name are imported by the search itself (that is how Python finds a submodule); a
    missing parent, or a parent that is not a package, means "not importable" instead of an exception.
    """
    try:
        return importlib.util.find_spec(module) is not None
    except (ModuleNotFoundError, ValueError):  # ValueError: a module in sys.modules whose __spec__ is None
        return False


def installed(extra: str) -> bool:
    """Whether the framework of ``extra`` (a key of `EXTRAS`) is importable here."""
    return importable(_module_of(extra))


def install_hint(extra: str) -> str:
    """The command that installs ``extra`` as this project's extra (DeepSpeed without compiling any op).

    With simdist installed, ``pip install 'simdist-lab[extra]'`` adds just the extra's packages (pip keeps the
    installed distribution); from a source checkout, ``pip install -e '.[extra]'``.
    """
    _module_of(extra)
    prefix = "DS_BUILD_OPS=0 " if extra == "deepspeed" else ""
    checkout = f"{prefix}pip install -e '.[{extra}]'"
    return f"{prefix}pip install '{DISTRIBUTION}[{extra}]' (from a source checkout: {checkout})"


def not_installed_reason(extra: str) -> str:
    """Why something that needs ``extra`` cannot run here, and the command that fixes it (tests skip with it)."""
    return f"the {extra} extra is not installed: {install_hint(extra)}"


def missing_extras(extras: tuple[str, ...] | list[str]) -> list[str]:
    """The extras among ``extras`` whose framework is not importable here, in order."""
    return [extra for extra in extras if not installed(extra)]


def _module_of(extra: str) -> str:
    try:
        return EXTRAS[extra]
    except KeyError:
        raise UsageError(f"unknown extra {extra!r}; valid: {', '.join(EXTRAS)}") from None


__all__ = ["EXTRAS", "importable", "install_hint", "installed", "missing_extras", "not_installed_reason"]
