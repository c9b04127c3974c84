"""Parameter families under AutoEP+AutoTP folding and their TP correction.

Why each family needs a correction (DeepSpeed ``auto_ep_folding.py`` and
``moe/ep_tp_dispatch.py``): the folded forward runs the router redundantly on
every TP peer and restores routed tokens with an all-gather across TP whose
backward scales each peer's slice by ``tp``. So

* ``router_gate_replicated`` -- each peer holds ``tp x`` its own slice of the
  router gradient; a TP all_reduce then ``/ tp`` (AVERAGE) gives the full one;
* ``router_gate_partial`` -- a forward-looking contract where each peer holds
  a true partial: TP all_reduce, no division (SUM);
* ``dense`` (dense weights, LayerNorm, shared experts, unmarked biases) --
  replicated and fed identical tokens, so peers hold identical gradients;
  AVERAGE leaves them unchanged;
* ``model_parallel`` -- TP-sharded weights owned by the TP layer: SKIP;
* ``expert`` -- routed experts are not TP-replicated: divide out the ``tp``
  factor with no TP all_reduce (EXPERT_TP_CANCEL); their data-parallel
  reduction runs over the EDP group.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Correction(enum.Enum):
    """What the TP folding correction does to one gradient."""

    AVERAGE = "average"
    SUM = "sum"
    SKIP = "skip"
    EXPERT_TP_CANCEL = "expert_tp_cancel"

    @property
    def reduces(self) -> bool:
        """Whether the correction all-reduces over the TP group."""
        return self in (Correction.AVERAGE, Correction.SUM)

    @property
    def divides(self) -> bool:
        """Whether the correction divides by the TP size."""
        return self in (Correction.AVERAGE, Correction.EXPERT_TP_CANCEL)


class Family(enum.Enum):
    """A parameter's folded reduction family."""

    ROUTER_GATE_REPLICATED = "router_gate_replicated"
    ROUTER_GATE_PARTIAL = "router_gate_partial"
    DENSE = "dense"
    MODEL_PARALLEL = "model_parallel"
    EXPERT = "expert"

    def correction(self, tp: int) -> Correction:
        """The TP correction DeepSpeed applies to this family (nothing when ``tp == 1``)."""
        if tp <= 1:
            return Correction.SKIP
        return _CORRECTIONS[self]

    @property
    def dp_group(self) -> str:
        """The group kind the data-parallel reduction runs over: ``edp`` for experts, else ``dp``."""
        return "edp" if self is Family.EXPERT else "dp"

    @property
    def counted_on_every_tp_rank(self) -> bool:
        """Whether the global norm counts this family on every TP rank (else on TP rank 0 only)."""
        return self in (Family.MODEL_PARALLEL, Family.EXPERT)

    @property
    def identical_on_tp_peers(self) -> bool:
        """Whether TP peers hold the same local gradient (replicated dense compute)."""
        return self is Family.DENSE


_CORRECTIONS = {
    Family.ROUTER_GATE_REPLICATED: Correction.AVERAGE,
    Family.ROUTER_GATE_PARTIAL: Correction.SUM,
    Family.DENSE: Correction.AVERAGE,
    Family.MODEL_PARALLEL: Correction.SKIP,
    Family.EXPERT: Correction.EXPERT_TP_CANCEL,
}


@dataclass(frozen=True)
class ParamSpec:
    """One parameter as a rank holds it: name, folding family and local shape.

    ``frozen`` parameters get no gradient (a gradient source must not deliver
    one) and no optimizer step; every other parameter must get a gradient on
    every micro-step.
    """

    name: str
    family: Family
    shape: tuple[int, ...]
    frozen: bool = False
