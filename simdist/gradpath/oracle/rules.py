"""What the oracle computes, restated: the TP folding rules, the DP group kind, its power-check controls and AdamW's
hyper-parameters.

Part of the independent oracle (`simdist.gradpath.oracle`). The folding rule of each parameter family is
restated here from DeepSpeed's ``auto_ep_folding.py`` strategies rather than read from
`simdist.gradpath.families.Family.correction`: an oracle that read the family table would share any error in it
with the gradient path, and the comparison could not see it; restated, a mutated table makes the gradient path and
the oracle disagree (``tests/unit/gradpath/oracle/test_step.py``). ``tests/integration/test_cases_deepspeed.py`` checks
that the
restated table equals the strategy names the real DeepSpeed code gives the synthetic parameters.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from simdist.gradpath.families import Family

CORRECTIONS: dict[Family, tuple[bool, bool]] = {
    Family.ROUTER_GATE_REPLICATED: (True, True),  # DeepSpeed "average": TP sum, then / tp
    Family.ROUTER_GATE_PARTIAL: (True, False),  # "sum": TP sum only
    Family.DENSE: (True, True),  # "average"
    Family.MODEL_PARALLEL: (False, False),  # "skip"
    Family.EXPERT: (False, True),  # "expert_tp_cancel": / tp, no TP sum
}
"""``family -> (TP sum, divide by tp)``, restated from DeepSpeed's ``auto_ep_folding`` strategies (with
``tp == 1`` nothing runs)."""

DEEPSPEED_STRATEGY: dict[tuple[bool, bool], str] = {
    (True, True): "average",
    (True, False): "sum",
    (False, False): "skip",
    (False, True): "expert_tp_cancel",
}
"""The name DeepSpeed's folding code gives each rule (what the real optimizer reports per parameter)."""


def correction(family: Family, tp: int) -> tuple[bool, bool]:
    """``(TP sum, divide by tp)`` for ``family`` on a TP group of ``tp`` ranks."""
    return (False, False) if tp <= 1 else CORRECTIONS[family]


def dp_kind(family: Family) -> str:
    """The group kind of the data-parallel reduction: ``edp`` for routed experts, ``dp`` for the rest."""
    return "edp" if family is Family.EXPERT else "dp"


@dataclass(frozen=True)
class Control:
    """A deliberate error in the oracle, for the power checks (`simdist.studies.power`): a verdict whose inputs
    can see what it asserts must see the controlled oracle differ from the oracle. The default is no change.

    * ``dp_then_tp`` -- the TP correction runs after the DP reduction (on the DP-reduced buffer) instead of
      on every micro-step before it;
    * ``expert_dp`` -- routed experts are reduced over this group kind (``"dp"``) instead of `dp_kind`'s;
    * ``tp_sum_dtype`` -- the TP sum runs on values rounded to this dtype, in this dtype (a BF16 TP sum);
    * ``corrected_dtype`` -- the corrected value is rounded to this dtype before it is accumulated (the fix's
      staging rounded to BF16, i.e. the #8913 writeback).
    """

    dp_then_tp: bool = False
    expert_dp: str | None = None
    tp_sum_dtype: torch.dtype | None = None
    corrected_dtype: torch.dtype | None = None

    @property
    def changes(self) -> bool:
        return self != Control()


@dataclass(frozen=True)
class AdamWSettings:
    """The hyper-parameters handed to ``torch.optim.AdamW`` (anything with these attributes will do)."""

    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.01
