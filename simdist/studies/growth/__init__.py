"""Error growth over many steps: each policy next to the FP32 oracle, batched over seeds, resumable.

(``source="moe"`` compares each policy with the matched FP32 policy instead; see its section below.)

What is run
-----------
`run_growth` trains the synthetic gradient stream (`BatchedGradients`, the
same per-rank structure as `simdist.sources.synthetic`: dense gradients identical on
TP peers, routers ``tp x`` their own slice, shards and experts local) under
each policy and under the FP32 TP-then-DP oracle, for ``steps`` optimizer
steps and ``seeds`` independent seeds, and records per step and seed how far
each policy's FP32 masters and Adam moments are from the oracle's.

How it is batched, and why that is exact
----------------------------------------
Threads of `SimWorld` cost tens of microseconds per collective; 10,000 steps
x 8 seeds x 4 runs would take hours. Each run is instead a
`simdist.gradpath.batched.BatchedPath`: the one implementation of the
gradient path (`simdist.gradpath.kernel.GradPath`, which `train_rank` also
runs) on the rank-batched operations, where every tensor of every rank of
every seed sits in one tensor with leading ``[seed, rank]`` dimensions:

* casts, ``/tp``, ``* 1/dp``, ``+=hp`` and every AdamW operation are
  element-wise, so applying them to a batched tensor gives each element the
  bits it gets in a rank's own tensor (batch-invariance of element-wise ops);
* a collective gathers each group's members along the rank dimension and
  applies the group's reduction (``reduction``, default ``gloo``) to the
  stacked members, with the reduction's per-element order of one member's tensor
  -- so any group size and layout (DP4 on 8 ranks, TP4, ...) gives the bits a
  real run in that order gives;
* nothing reduces over the seed dimension inside the arithmetic; only the
  *metrics* reduce, within one seed.

What batching changes: nothing in the bits of masters, moments or BF16
params (``tests/unit/gradpath/test_batched.py`` proves rank-batched == `train_rank`
on `SimWorld` threads at every step, rank, seed and captured tensor, for every
registered policy and the oracle, several layouts and every reduction;
``tests/integration/test_growth.py`` that a seed gives the same bits alone and inside an
ensemble). Not recorded: the gradient-norm scalar (growth runs use
``max_norm = 0``, the `PathConfig` default, so no norm is computed). The
stream has the distribution of `simdist.sources.synthetic.SyntheticGradients`
but its own draws (one generator call per seed and step instead of one per
rank and parameter). ``bench/growth.py`` prints the cost of 8 seeds against one
and of world 8 against world 4.
The MoE block's backward runs collectives inside autograd and has no batched
emulation: ``source="moe"`` runs unbatched (see below).

The gradient stream is counter-based: step ``t`` of seed ``s`` is drawn from a
generator seeded by ``(s, t, micro)``, so there is no RNG position to save and
a resumed run draws exactly what an uninterrupted run draws.

What the curves show (a random walk)
------------------------------------
If each step added an independent, zero-mean rounding error of similar size
to a quantity that keeps everything it is given, its error would grow like a
random walk: ``err(t) ~ err(t0) * sqrt(t / t0)``. The plot draws that line on
the master panels (the quantity that keeps everything it is given), anchored at
the median at step 10 (`random_walk`), dashed, in each policy's colour.

* masters sum every update, so their error follows the random walk while the
  per-step update errors are independent -- and departs from it upward when
  the errors are biased (same sign every step: linear growth), or when the
  masters' own divergence changes the update (weight decay, feedback);
* Adam ``m`` forgets with ``beta1 = 0.9`` (memory ~10 steps): its error only
  reflects the last few gradients' rounding and is flat from the first step;
  ``v`` averages squared gradients over ~1000 steps (``beta2 = 0.999``): its
  *relative* error falls while the average still gathers independent terms
  and levels off after about 1000 steps -- neither grows as ``sqrt(t)``;
* step 1 is special: Adam's first update is ``lr * g / |g|`` (a sign), which a
  small rounding of ``g`` rarely changes, so the master error jumps between
  steps 1 and 2 and the line is anchored at step 10;
* ``fp32_staging`` is bitwise equal to the FP32 oracle (the error is exactly
  zero: the plot's symlog axis draws it as a line at 0); ``bf16_writeback`` adds one BF16 rounding of the
  router gradients per step (only the two router families differ: dense TP
  peers are identical, so their average is exact, and ``/2`` of a BF16 expert
  gradient is exact); ``bf16_only`` rounds the TP sum, the accumulation and
  the DP reduction in BF16 for every family, so its errors are the largest.
  Measured (``bench/growth.py``, 10,000 steps, 8 seeds): the median master
  error grows as ``t^0.52`` for both, i.e. as the random walk predicts.

The synthetic stream has no loss (gradients are drawn, not derived from the
weights), so the loss panel is omitted for ``source="synthetic"``.

``source="moe"``: the folded MoE block, unbatched
-------------------------------------------------
For every seed (sequentially) and policy, `simdist.studies.training.train` runs the
folded MoE block (`simdist.sources.moe.MoEGradients`, default `MoEConfig`) under the
policy next to the matched FP32 policy (`simdist.gradpath.matched_policy.MATCHED_FP32`:
the oracle's FP32 staging run through the gradient path, TP correction every
micro-step), in lockstep on `SimWorld`, for ``steps``
steps. What it records is what the rows hold (`MOE_COLUMNS`): both losses and
their difference ``|loss_policy - loss_matched|`` (the loss of step ``t`` is
computed before step ``t``'s update, so step 1's difference is always 0), both
gradient norms, and the divergence of the BF16 weights after the step's update
and of the BF16 local gradients, pooled over parameters and ranks (normwise
relative error, max BF16 ulps, fraction of elements differing). FP32 masters
and Adam moments are private to `train_rank` while it runs, so they are not
recorded. Each (policy, seed) run also reruns the matched policy: about 50 ms per step
for a policy and its matched run together (default `MoEConfig`, 4 ranks, CPU).

Resume for MoE is per (policy, seed) run, not per step: the checkpoint holds
the rows of every finished run and is rewritten after each; a killed process
restarts the run it was in from step 0 (`train_rank` does not expose its
state mid-run) and skips the finished ones. A run is deterministic, so the
files equal those of an uninterrupted run.
"""

from simdist.studies.growth.metrics import COLUMNS, MOE_COLUMNS, Reference, divergence, read_metrics, summarise
from simdist.studies.growth.plot import plot_growth
from simdist.studies.growth.run import FILES, GrowthConfig, clean, run_growth
from simdist.studies.growth.stream import BatchedGradients

__all__ = [
    "COLUMNS",
    "FILES",
    "MOE_COLUMNS",
    "BatchedGradients",
    "GrowthConfig",
    "Reference",
    "clean",
    "divergence",
    "plot_growth",
    "read_metrics",
    "run_growth",
    "summarise",
]
