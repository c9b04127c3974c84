"""Cases: real frameworks as ground truth next to simdist's transcribed policies.

``simdist case list`` shows them, ``simdist case run NAME [--json]`` runs one.
Each case is a small module with a ``CASE`` (`simdist.cases.base.Case`);
this registry imports a module only when its case is asked for, so listing
never imports DeepSpeed.
"""

from __future__ import annotations

import importlib
import importlib.util

from simdist.cases.base import Case, Verdict

_MODULES: dict[str, str] = {
    "deepspeed-8913": "simdist.cases.deepspeed_8913",
    "deepspeed-checkpoint": "simdist.cases.deepspeed_checkpoint",
    "deepspeed-gas-marker": "simdist.cases.deepspeed_gas_marker",
    "deepspeed-wrappers": "simdist.cases.deepspeed_wrappers",
    "fsdp2-reduce-dtype": "simdist.cases.fsdp2_reduce_dtype",
    "fsdp2-reduce-dtype-tp": "simdist.cases.fsdp2_tp_mesh",
    "megatron-grad-reduce-fp32": "simdist.cases.megatron_grad_reduce",
}


def case_names() -> list[str]:
    """Every registered case, in priority order."""
    return [name for name in _MODULES if _exists(name)]


def _exists(name: str) -> bool:
    return importlib.util.find_spec(_MODULES[name]) is not None


def get_case(name: str) -> Case:
    """The case called ``name``; ``ValueError`` listing the valid names otherwise."""
    if name not in _MODULES or not _exists(name):
        raise ValueError(f"unknown case {name!r}; valid: {', '.join(case_names())}")
    return importlib.import_module(_MODULES[name]).CASE


EXTRAS = ("deepspeed", "megatron")
"""The extras of ``pyproject.toml`` that cases require, named like the packages they import."""


def install_hint(package: str) -> str:
    """The command that installs ``package`` (a case's requirement) as this project's extra.

    With simdist installed, ``pip install 'simdist-lab[extra]'`` adds just the extra's packages (pip takes the
    installed distribution); DeepSpeed is installed with ``DS_BUILD_OPS=0`` (the cases compile no op).
    """
    from simdist import DISTRIBUTION

    if package not in EXTRAS:
        return f"pip install {package}"
    prefix = "DS_BUILD_OPS=0 " if package == "deepspeed" else ""
    checkout = f"{prefix}pip install -e '.[{package}]'"
    return f"{prefix}pip install '{DISTRIBUTION}[{package}]' (from a source checkout: {checkout})"


def run_case(name: str, **options) -> Verdict:
    """Run case ``name``; ``ValueError`` naming the missing package if its framework is not installed."""
    case = get_case(name)
    missing = case.missing()
    if missing:
        raise ValueError(f"case {name!r} needs {', '.join(missing)}: {install_hint(missing[0])}")
    return case.run(**options)


__all__ = ["Case", "Verdict", "case_names", "get_case", "run_case"]
