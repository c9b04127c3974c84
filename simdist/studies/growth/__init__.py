"""Error growth over many steps: each policy next to the FP32 oracle, batched over seeds, resumable.

What is run
-----------
`run_growth` trains the synthetic gradient stream (`BatchedGradients`, the
same per-rank structure as `simdist.models.synthetic`: dense gradients identical on
TP peers, routers ``tp x`` their own slice, shards and experts local) under
each policy and under the FP32 TP-then-DP oracle, for ``steps`` optimizer
steps and ``seeds`` independent seeds, and records per step and seed how far
each policy's FP32 masters and Adam moments are from the oracle's.

How it is batched, and why that is exact
----------------------------------------
Threads of `SimWorld` cost tens of microseconds per collective; 10,000 steps
x 8 seeds x 4 runs would take hours. `Ensemble` instead holds every tensor
of every rank of every seed in one tensor with a leading ``[seed, rank]``
dimension and executes the *same stage list* that `train_rank` executes
(`Policy.micro_step_stages`, `Policy.boundary_stages`, the DP reduction of
`simdist.gradpath.path._dp_reduce`, and `simdist.gradpath.path.adamw_step` itself):

* casts, ``/tp``, ``* 1/dp``, ``+=hp`` and every AdamW operation are
  element-wise, so applying them to a batched tensor gives each element the
  bits it gets in a rank's own tensor (batch-invariance of element-wise ops);
* a collective over a group of two ranks is one addition ``a + b``, which is
  commutative in IEEE arithmetic, so every reduction model (gloo, ring, tree,
  sequential) gives ``x + x[peer]``; groups of more than two ranks are
  refused (their result depends on the modelled order);
* no reduction ever runs over the seed or rank dimension inside the
  arithmetic; only the *metrics* reduce, within one seed.

What batching changes: nothing in the bits of masters, moments or BF16
params (``tests/test_growth.py`` proves bitwise identity with `train_rank` on
`SimWorld` at every step, every rank and seed, for eight policies including
the oracle, GAS 2 and stochastic rounding; and that a seed gives the same
bits alone and inside an ensemble). Not emulated: the gradient-norm scalar
and clipping (growth runs use ``max_norm = 0``, the `PathConfig` default),
and layouts with groups of more than two ranks. The stream has the
distribution of `simdist.models.synthetic.SyntheticGradients` but its own draws (one
generator call per seed and step instead of one per rank and parameter).
Cost: 8 seeds take about 1.8-2.8x the time of one seed (``bench/growth.py``).
The MoE block's backward runs collectives inside autograd and has no batched
emulation: ``model="moe"`` runs unbatched (see below).

The gradient stream is counter-based: step ``t`` of seed ``s`` is drawn from a
generator seeded by ``(s, t, micro)``, so there is no RNG position to save and
a resumed run draws exactly what an uninterrupted run draws.

What the curves show (the random-walk model)
--------------------------------------------
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
* ``fp32_staging`` is bitwise equal to the FP32 oracle (no curve on log axes:
  the error is exactly zero); ``bf16_writeback`` adds one BF16 rounding of the
  router gradients per step (only the two router families differ: dense TP
  peers are identical, so their average is exact, and ``/2`` of a BF16 expert
  gradient is exact); ``bf16_only`` rounds the TP sum, the accumulation and
  the DP reduction in BF16 for every family, so its errors are the largest.
  Measured (``bench/growth.py``, 10,000 steps, 8 seeds): the median master
  error grows as ``t^0.52`` for both, i.e. as the random walk predicts.

The synthetic stream has no loss (gradients are drawn, not derived from the
weights), so the loss panel is omitted for ``model="synthetic"``.

``model="moe"``: the folded MoE block, unbatched
-------------------------------------------------
For every seed (sequentially) and policy, `simdist.studies.training.train` runs the
folded MoE block (`simdist.models.moe.MoEGradients`, default `MoEConfig`) under the
policy next to the FP32 oracle, in lockstep on `SimWorld`, for ``steps``
steps. What it records is what the rows hold (`MOE_COLUMNS`): both losses and
their difference ``|loss_policy - loss_oracle|`` (the loss of step ``t`` is
computed before step ``t``'s update, so step 1's difference is always 0), both
gradient norms, and the divergence of the BF16 weights after the step's update
and of the BF16 local gradients, pooled over parameters and ranks (normwise
relative error, max BF16 ulps, fraction of elements differing). FP32 masters
and Adam moments are private to `train_rank` while it runs, so they are not
recorded. Each (policy, seed) run also reruns the oracle: about 50 ms per step
for a policy and its oracle together (default `MoEConfig`, 4 ranks, CPU).

Resume for MoE is per (policy, seed) run, not per step: the checkpoint holds
the rows of every finished run and is rewritten after each; a killed process
restarts the run it was in from step 0 (`train_rank` does not expose its
state mid-run) and skips the finished ones. A run is deterministic, so the
files equal those of an uninterrupted run.
"""

from simdist.studies.growth.metrics import COLUMNS, MOE_COLUMNS, Reference, divergence, read_metrics, summarise
from simdist.studies.growth.plot import plot_growth
from simdist.studies.growth.run import FILES, GrowthConfig, clean, run_growth
from simdist.studies.growth.stream import BatchedGradients, Ensemble

__all__ = [
    "COLUMNS",
    "FILES",
    "MOE_COLUMNS",
    "BatchedGradients",
    "Ensemble",
    "GrowthConfig",
    "Reference",
    "clean",
    "divergence",
    "plot_growth",
    "read_metrics",
    "run_growth",
    "summarise",
]
