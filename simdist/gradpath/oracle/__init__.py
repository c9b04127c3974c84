"""The independent FP32/FP64 oracle: explicit TP-then-DP per-parameter reduction and a real ``torch.optim.AdamW``.

This is the accepted numerical reference of the #8913 report ("an explicit FP32
TP-then-DP/per-parameter reducer" next to a real optimizer), written so that it
shares no code with the gradient path it judges (`simdist.gradpath.kernel`,
`simdist.gradpath.policy`, `simdist.gradpath.path`, `simdist.gradpath.batched`):
only the reductions (`simdist.reduce`), the group tables
(`ParallelSpec.groups`), the parameter list (`ParamSpec`) and the capture names
(`simdist.gradpath.probes`) are shared (``tests/unit/meta/test_import_graph.py``
checks every import of the oracle's modules, lazy ones included).

Per optimizer step, for every parameter, in plain loops over ranks and groups:

1. every micro-step, each rank's BF16 local gradient is staged into ``dtype``;
   the TP correction of the parameter's family (`CORRECTIONS`, restated
   from DeepSpeed's ``auto_ep_folding.py``, not read from
   `simdist.gradpath.families`) runs on the staged values of each TP group --
   the group's ``tp_reduction`` sum and/or ``/ tp`` -- on every micro-step, and
   the result is added to the rank's ``dtype`` accumulation buffer;
2. at the boundary, each DP group (the EDP group for routed experts) sums its
   members' buffers in ``dp_reduction``'s order and scales by ``1 / dp`` (the
   dense DP size, for experts too);
3. the reduced gradient is the ``.grad`` of the ``dtype`` master weights
   (every rank's and parameter's, in one flat tensor: AdamW is element-wise),
   and ``torch.optim.AdamW`` -- the real optimizer class, with its own state
   -- takes one step over them; the masters are rounded to BF16 (nearest
   even) as the next step's parameters.

Why the correction rule is restated rather than taken from the family table:
an oracle that read `Family.correction` would share any error in that table
with the gradient path, and the comparison could not see it; restated, a mutated table
makes the gradient path and the oracle disagree (tested). A test also checks that the
restated table equals DeepSpeed's own strategy names for the synthetic
parameters (the ``deepspeed-8913`` case records them from the real code).

Where every TP or DP group has two members, a group sum is one addition whatever the reduction's order, and
`Oracle.step` (when nothing is captured) runs that stage for every parameter at once on one flat buffer
(`FusedPairs`, a third of the per-parameter step's time in the growth study); a NaN in such a sum, whose
payload does depend on the order, sends the stage back to the per-parameter loops. Tested equal, bit for bit.

Power checks (`Control`, used by `simdist.studies.power`): the oracle can run with one deliberate error --
DP before TP, experts over the dense DP group, a BF16 TP sum, the corrected value rounded to BF16 -- so that a
verdict can show that its inputs would see that error; the default `Control()` changes nothing.

Not modelled: global-norm clipping (``max_norm`` must be 0, which every study
uses) and the correction-once marker (the oracle corrects every micro-step,
the intended semantics). Values may carry leading batch dimensions
(``[seed]`` in the growth study): every operation above is element-wise along
them, and each reduction runs per batch item, so each item gets the bits it gets alone (tested).

The oracle's modules, one concept each (import the names from here):

* `rules` -- what it computes, restated: `CORRECTIONS`, `DEEPSPEED_STRATEGY`, `rules.correction`,
  `rules.dp_kind`, the power checks' `Control`, `AdamWSettings`;
* `step` -- how it sums a group (`step.group_sums` per parameter in the reduction's order, `FusedPairs` for every
  parameter at once where groups have two members) and `Oracle`: the state of every rank and one optimizer step;
* `runs` -- several steps' captures: `oracle_values`, `oracle_traces`.
"""

from simdist.gradpath.oracle.rules import (
    CORRECTIONS,
    DEEPSPEED_STRATEGY,
    AdamWSettings,
    Control,
    correction,
    dp_kind,
)
from simdist.gradpath.oracle.runs import Values, oracle_traces, oracle_values
from simdist.gradpath.oracle.step import Captured, Key, Oracle

__all__ = [
    "CORRECTIONS",
    "DEEPSPEED_STRATEGY",
    "AdamWSettings",
    "Captured",
    "Control",
    "Key",
    "Oracle",
    "Values",
    "correction",
    "dp_kind",
    "oracle_traces",
    "oracle_values",
]
