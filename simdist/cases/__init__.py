"""Cases: real frameworks as ground truth next to simdist's transcribed policies.

``simdist case list`` shows them, ``simdist case run NAME [--json]`` runs one.
Each case is a small module with a ``CASE`` (`simdist.cases.base.Case`);
this registry imports a module only when its case is asked for, so listing
never imports DeepSpeed.

The cases by framework: DeepSpeed (the package `deepspeed`: #8913, the checkpoint round trip, the GAS marker, the
real engine and its spies), DeepSpeed's optimizer wrappers end to end (`deepspeed_wrappers`), FSDP2 (`fsdp2`) and
Megatron-Core (`megatron_grad_reduce`); what they share: `base` (`Case`, `Verdict`), `compare`, `ranks` (running
the ranks of a real framework), `stdout`. The upstream packages of the DeepSpeed defects found are `upstream`; the
standalone reproducer scripts they ship are package data in ``reproducers/`` (read with `importlib.resources`,
never imported).
"""

from __future__ import annotations

import importlib
import importlib.util

from simdist.cases.base import Case, Verdict
from simdist.errors import UsageError, coerce
from simdist.extras import install_hint

_MODULES: dict[str, str] = {
    "deepspeed-8913": "simdist.cases.deepspeed.issue_8913",
    "deepspeed-checkpoint": "simdist.cases.deepspeed.checkpoint",
    "deepspeed-gas-marker": "simdist.cases.deepspeed.gas_marker",
    "deepspeed-wrappers": "simdist.cases.deepspeed_wrappers.case",
    "fsdp2-reduce-dtype": "simdist.cases.fsdp2.reduce_dtype",
    "fsdp2-reduce-dtype-tp": "simdist.cases.fsdp2.tp_mesh",
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
        raise UsageError(f"unknown case {name!r}; valid: {', '.join(case_names())}")
    return importlib.import_module(_MODULES[name]).CASE


def run_case(name: str, **options) -> Verdict:
    """Run case ``name``; ``ValueError`` for a ``where`` the case cannot run in, then for a missing extra
    (naming the command that installs it). ``where`` is checked first: it is the case's property, not the install's."""
    from simdist.world.options import Where  # here: listing the cases imports no world

    case = get_case(name)
    where = options["where"] = coerce(Where, options.get("where", Where.GLOO), "where")
    if where == Where.THREADS and case.processes_because is not None:
        raise UsageError(
            f"case {name!r} runs in processes only (where 'gloo' or 'processes'): {case.processes_because}"
        )
    missing = case.missing()
    if missing:
        raise UsageError(f"case {name!r} needs the {missing[0]} extra: {install_hint(missing[0])}")
    return case.run(**options)


__all__ = ["Case", "Verdict", "case_names", "get_case", "install_hint", "run_case"]
