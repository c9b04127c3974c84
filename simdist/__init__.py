"""simdist: a single-process numerics lab for distributed training.

The pieces most programs start from:

* `simdist.world.spec.ParallelSpec` -- a TP/DP/EP/ETP/EDP layout and its group tables;
* `simdist.world.simworld.SimWorld` -- run a rank program ``fn(comm, ...)`` on every rank, in one process;
* `simdist.reduce` and `simdist.reduce.gloo` -- how collectives sum and round;
* `simdist.gradpath.policy` / ``policies/`` -- precision policies of the BF16 gradient path;
* `simdist.gradpath.path.train_rank` -- DeepSpeed's BF16_Optimizer gradient path as a rank program;
* `simdist.studies.repro` -- the DeepSpeed #8913 reproduction behind ``simdist repro 8913``;
* `simdist.spawn` -- run unmodified ``torch.distributed`` code on simulated ranks (backend ``simdist``);
* `simdist.blame` -- where such code loses precision: per-call-site error against the exact result.

Importing ``simdist`` registers the ``torch.distributed`` backend ``simdist``, so a script started by
torchrun needs only ``import simdist`` before ``dist.init_process_group("simdist")``. That imports torch
(every simdist module needs it anyway); ``python -m simdist.launch`` runs a rank program under torchrun.
"""

DISTRIBUTION = "simdist-lab"
"""The name this project is installed under (``pip install 'simdist-lab[megatron]'``, `importlib.metadata`): the
PyPI name ``simdist`` belongs to an unrelated package. The import name stays ``simdist``."""


def __getattr__(name: str):
    """``simdist.spawn`` (`simdist.world.inproc.spawn`) and ``simdist.blame`` (`simdist.attribution.blame`),
    imported on first use. (The package behind ``blame`` is not named ``simdist.blame``: importing it would bind
    the module over this function.)"""
    if name == "spawn":
        from simdist.world.inproc import spawn

        return spawn
    if name == "blame":
        from simdist.attribution import blame

        return blame
    raise AttributeError(f"module 'simdist' has no attribute {name!r}")


def _register_backend() -> None:
    """``dist.init_process_group("simdist")`` works after a plain ``import simdist`` (`simdist.world.plugin`)."""
    from simdist.world.plugin import register

    register()


_register_backend()
