"""Power checks: the one `PowerCheck` record and its one line (`power_line`), and the #8913 repro's controls.

A verdict "bitwise equal to the oracle" proves something only if a wrong oracle would not be bitwise equal
too. A power check runs a control -- the same comparison with one deliberate error -- and records whether it
changed the compared bits (`PowerCheck`): it *shows power* when it did. One that cannot change anything in the
run's layout or configuration is reported as not applicable: the verdict does not cover it. Every verdict that
has power checks (the repro here, the DeepSpeed cases in `simdist.cases`) records them as `PowerCheck` values,
prints them with `power_line` and counts them with `shows_power`.

The repro's controls (`CONTROLS`): each runs the independent oracle (`simdist.gradpath.oracle`) with one
deliberate error -- the TP correction after the DP reduction, experts reduced over the dense DP group, a BF16
TP sum, the corrected value rounded to BF16 (the #8913 writeback) -- on the run's own workload, layout and
inputs, and compares its captures with the oracle's, bit for bit (`power_checks`). Experts over DP does not
apply where the DP and EDP groups are the same groups, the TP controls not at TP 1. They are oracle runs only
(no gradient-path run): a few tenths of a second each on the default layout.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
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
    """One power check: a control (one deliberate error) and whether it changed the compared bits.

    ``what`` says what the control breaks; ``applies`` is false where it cannot change anything in this layout
    or configuration (then it is reported and not counted); ``shown``: it changed the compared bits, as the
    check defines it. ``differing`` of ``compared`` items (``unit``) differ, ``0/0`` where the check counts
    nothing; ``against`` names what the control is compared with, ``layout`` the layout it ran on (verdicts
    that run several), both optional.
    """

    name: str
    what: str
    applies: bool
    shown: bool = False
    differing: int = 0
    """Compared items (tensors, captures, elements: ``unit``) whose bits the control changed."""
    compared: int = 0
    against: str = ""
    layout: str = ""
    unit: str = "compared tensors"

    @property
    def line(self) -> str:
        """`power_line` of this check."""
        return power_line(self)


def power_line(check: PowerCheck) -> str:
    """One line for a power check: ``name (layout): shows power (d/c <unit> differ from <against>)``,
    ``... NO POWER: <what>, yet ...`` or ``... not applicable (...)``; the one format every verdict prints."""
    head = check.name + (f" ({check.layout})" if check.layout else "")
    if not check.applies:
        return f"{head}: not applicable ({check.what}: no change here, not covered)"
    counts = ""
    if check.compared:
        against = f" from {check.against}" if check.against else ""
        counts = f" ({check.differing}/{check.compared} {check.unit} differ{against})"
    if check.shown:
        return f"{head}: shows power{counts}"
    return f"{head}: NO POWER: {check.what}, yet the compared bits do not change{counts}"


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
            checks.append(PowerCheck(name, what, applies=False))
            continue
        changed, total = differing(oracle, run_control(control), stages)
        checks.append(PowerCheck(name, what, True, changed > 0, changed, total))
    return tuple(checks)


def shows_power(checks: Sequence[PowerCheck]) -> bool:
    """Every applicable control changed the compared bits (and at least one applied)."""
    used = [c for c in checks if c.applies]
    return bool(used) and all(c.shown for c in used)
