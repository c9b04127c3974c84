"""Gradient sources: the seeded synthetic stream (`synthetic`) and the folded MoE block (`moe`), chosen by
`GradientSource`; and the shapes of real MoE models, as data (`production`: the production study's parameters)."""

from __future__ import annotations

import enum


class GradientSource(enum.StrEnum):
    """Where a study's local gradients come from (``--source`` on the command line)."""

    SYNTHETIC = "synthetic"
    """Seeded synthetic gradients with every folding family present (`simdist.sources.synthetic`)."""
    MOE = "moe"
    """The folded MoE block: gradients from a real forward and backward (`simdist.sources.moe`)."""
