"""Power checks of the #8913 repro: controls that prove its inputs and layout can see what it asserts.

A verdict "bitwise equal to the oracle" proves something only if a wrong oracle would not be bitwise equal
too. Each `Control` here runs the independent oracle (`simdist.gradpath.oracle`) with one deliberate error
-- the TP correction after the DP reduction, experts reduced over the dense DP group, a BF16 TP sum, the
corrected value rounded to BF16 (the #8913 writeback) -- on the run's own workload, layout and inputs, and
compares its captures with the oracle's, bit for bit. A control *shows power* when some compared tensor
differs. One that cannot change anything in the run's layout (experts over DP where the DP and EDP groups
are the same groups, a TP control at TP 1) is reported as not applicable: the verdict does not cover it.

The controls are oracle runs only (no engine run): a few tenths of a second each on the default layout.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from simdist.gradpath.oracle import Control
from simdist.gradpath.probes import Capture, Trace
from simdist.numerics.floats import bitwise_equal
from simdist.world.spec import ParallelSpec

CONTROLS: dict[str, tuple[Control, str]] = {
    "tp_dp_order_swapped": (Control(dp_then_tp=True), "the TP correction runs after the DP reduction"),
    "experts_over_dp": (Control(expert_dp="dp"), "routed experts are reduced over the dense DP group, not EDP"),
    "bf16_tp_sum": (Control(tp_sum_dtype=torch.bfloat16), "the TP sum runs in BF16"),
    "staging_rounded_to_bf16": (
        Control(corrected_dtype=torch.bfloat16),
        "the corrected gradient is rounded to BF16 before it is accumulated (the #8913 writeback)",
    ),
}
"""``name -> (control, what it breaks)``: the controls every repro runs."""


@dataclass(frozen=True)
class PowerCheck:
    """One control: whether it applies to the layout, and whether it changed the compared bits."""

    name: str
    what: str
    applies: bool
    shown: bool
    differing: int
    """Compared tensors (rank, parameter, capture, step, micro-step) whose bits the control changed."""
    compared: int

    @property
    def line(self) -> str:
        if not self.applies:
            return f"{self.name}: not applicable in this layout ({self.what}: no change here, not covered)"
        if self.shown:
            return f"{self.name}: shows power ({self.differing}/{self.compared} compared tensors flip)"
        return f"{self.name}: NO POWER: {self.what}, yet every compared tensor keeps its bits"


def applies(name: str, spec: ParallelSpec) -> bool:
    """Whether control ``name`` can change anything on ``spec``."""
    if name == "experts_over_dp":
        return spec.groups("dp") != spec.groups("edp")
    return spec.tp > 1


def differing(oracle: list[Trace], control: list[Trace], stages: frozenset[Capture]) -> tuple[int, int]:
    """``(differing, compared)`` tensors between two oracle runs over ``stages``."""
    changed = total = 0
    for ours, theirs in zip(oracle, control, strict=True):
        for key, value in ours.values.items():
            if key[3] in stages and key in theirs.values:
                total += 1
                changed += not bitwise_equal(value, theirs.values[key])
    return changed, total


def power_checks(
    spec: ParallelSpec,
    oracle: list[Trace],
    run_control: Callable[[Control], list[Trace]],
    stages: frozenset[Capture],
) -> tuple[PowerCheck, ...]:
    """Every control in `CONTROLS` that applies to ``spec``, run by ``run_control`` and compared with ``oracle``."""
    checks = []
    for name, (control, what) in CONTROLS.items():
        if not applies(name, spec):
            checks.append(PowerCheck(name, what, False, False, 0, 0))
            continue
        changed, total = differing(oracle, run_control(control), stages)
        checks.append(PowerCheck(name, what, True, changed > 0, changed, total))
    return tuple(checks)


def shows_power(checks: tuple[PowerCheck, ...]) -> bool:
    """Every applicable control changed the compared bits (and at least one applied)."""
    used = [c for c in checks if c.applies]
    return bool(used) and all(c.shown for c in used)
