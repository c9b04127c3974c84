"""Frameworks that cannot run on rank threads, refused where they initialise, in one line.

DeepSpeed keeps its communication backend and process groups in module globals
(``deepspeed.comm.comm.cdb``, ``deepspeed.utils.groups``), Megatron its groups in
``megatron.core.parallel_state``: rank threads of one process would share them
(the first rank's backend, the last rank's groups). While a `simdist.run`
runs, `install` replaces their initialisers (DeepSpeed's ``init_distributed``,
which ``deepspeed.initialize`` calls; Megatron's ``initialize_model_parallel``)
in the modules already imported by ones that raise `SharedGlobalStateError` on
a rank thread, naming the rank, the call site and process mode; elsewhere they
call the original. A framework first imported inside a rank is not covered.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from simdist.world.threads.rank_rngs import FIX, SharedGlobalStateError, call_site

# module -> (function, what the framework keeps in module globals)
INITIALISERS: dict[str, tuple[str, str]] = {
    "deepspeed": ("init_distributed", "deepspeed.comm.comm.cdb and deepspeed.utils.groups"),
    "deepspeed.comm": ("init_distributed", "deepspeed.comm.comm.cdb and deepspeed.utils.groups"),
    "deepspeed.comm.comm": ("init_distributed", "deepspeed.comm.comm.cdb and deepspeed.utils.groups"),
    "megatron.core.parallel_state": ("initialize_model_parallel", "megatron.core.parallel_state"),
}


_SKIP = ("/deepspeed/", "/megatron/")


def install(rank_of: Callable[[], int | None]) -> Callable[[], None]:
    """Refuse the imported frameworks' initialisers on rank threads; returns the undo."""
    saved = []
    for module_name, (name, globals_) in INITIALISERS.items():
        module = sys.modules.get(module_name)
        original = getattr(module, name, None)
        if module is None or original is None:
            continue

        def refuse(*args, _original=original, _name=f"{module_name}.{name}", _globals=globals_, **kwargs):
            rank = rank_of()
            if rank is None:
                return _original(*args, **kwargs)
            raise SharedGlobalStateError(
                f"rank {rank} called {_name} at {call_site(_SKIP)}: the framework keeps its groups in module globals "
                f"({_globals}) that rank threads would share; {FIX}"
            )

        setattr(module, name, refuse)
        saved.append((module, name, original))

    def undo() -> None:
        for module, name, original in saved:
            setattr(module, name, original)

    return undo
