"""simdist: a single-process numerics lab for distributed training.

The pieces most programs start from:

* `simdist.spec.ParallelSpec` -- a TP/DP/EP/ETP/EDP layout and its group tables;
* `simdist.simworld.SimWorld` -- run a rank program ``fn(comm, ...)`` on every rank, in one process;
* `simdist.reduction` and `simdist.gloo_model` -- how collectives sum and round;
* `simdist.policy` / ``policies/`` -- precision policies of the BF16 gradient path;
* `simdist.gradpath.train_rank` -- DeepSpeed's BF16_Optimizer gradient path as a rank program;
* `simdist.repro` -- the DeepSpeed #8913 reproduction behind ``simdist repro 8913``.
"""
