"""simdist: a single-process numerics lab for distributed training.

The pieces most programs start from:

* `simdist.world.spec.ParallelSpec` -- a TP/DP/EP/ETP/EDP layout and its group tables;
* `simdist.world.simworld.SimWorld` -- run a rank program ``fn(comm, ...)`` on every rank, in one process;
* `simdist.reduce` and `simdist.reduce.gloo.reduction` -- how collectives sum and round (``reduction=`` of every
launcher;
  default `simdist.world.options.DEFAULT_REDUCTION`, gloo's order);
* `simdist.gradpath.policy` / `simdist.policies` -- precision policies of the BF16 gradient path (as data; the
  catalogue, one module each);
* `simdist.gradpath.path.train_rank` -- DeepSpeed's BF16_Optimizer gradient path as a rank program;
* `simdist.studies.repro` -- the DeepSpeed #8913 reproduction behind ``simdist repro 8913``;
* `simdist.run` -- the one launcher: a rank function on threads, processes or real gloo (`simdist.world.runner`);
  unmodified ``torch.distributed`` code runs there on simulated ranks (backend ``simdist``);
* `simdist.blame` -- where such code loses precision: per-call-site error against the exact result.

Importing ``simdist`` costs nothing: it imports no torch and compiles nothing. It arranges for the
``torch.distributed`` backend ``simdist`` to be registered as soon as ``torch.distributed`` is imported
(`simdist._autoregister`), so a script started by torchrun needs only ``import simdist`` before
``dist.init_process_group("simdist")``; the backend itself is imported when the first ``simdist`` group is made.
``python -m simdist.launch`` runs a rank program under torchrun.
"""

from typing import TYPE_CHECKING

DISTRIBUTION = "simdist-lab"
"""The name this project is installed under (``pip install 'simdist-lab[megatron]'``, `importlib.metadata`): the
PyPI name ``simdist`` belongs to an unrelated package. The import name stays ``simdist``."""


if TYPE_CHECKING:  # what type checkers and IDEs see; at run time `__getattr__` imports each on first use
    from simdist.attribution import blame
    from simdist.reduce import Reduction, ReductionName
    from simdist.world.options import Api, Where
    from simdist.world.runner import run
    from simdist.world.simworld import SimWorld
    from simdist.world.spec import GroupKind, ParallelSpec

_LAZY: dict[str, tuple[str, str]] = {
    "run": ("simdist.world.runner", "run"),
    "Where": ("simdist.world.options", "Where"),
    "Api": ("simdist.world.options", "Api"),
    "SimWorld": ("simdist.world.simworld", "SimWorld"),
    "ParallelSpec": ("simdist.world.spec", "ParallelSpec"),
    "GroupKind": ("simdist.world.spec", "GroupKind"),
    "ReductionName": ("simdist.reduce", "ReductionName"),
    "Reduction": ("simdist.reduce", "Reduction"),
    "blame": ("simdist.attribution", "blame"),
}
"""Public name -> (module, attribute), imported on first use (`__getattr__`)."""

__all__ = [
    "DISTRIBUTION",
    "Api",
    "GroupKind",
    "ParallelSpec",
    "Reduction",
    "ReductionName",
    "SimWorld",
    "Where",
    "blame",
    "run",
]
"""``DISTRIBUTION`` and every name of `_LAZY` (``tests/integration/test_run.py`` checks that they are the same)."""


def __getattr__(name: str):
    """The names of `__all__`, each imported from its module on first use. (The package behind ``blame`` is
    not named ``simdist.blame``: importing it would bind the module over this function.)"""
    found = _LAZY.get(name)
    if found is None:
        raise AttributeError(f"module 'simdist' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(found[0]), found[1])
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


def _register_backend() -> None:
    """``dist.init_process_group("simdist")`` works after a plain ``import simdist``, which imports no torch."""
    from simdist._autoregister import install

    install()


_register_backend()
