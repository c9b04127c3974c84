"""Comparing a real framework's captures with simdist's, capture by capture and element by element.

Both verdict rows are views of one `simdist.numerics.compare.Comparison` (`compare` pools the pairs and finds
the first divergence): `Match` keeps the counts and where the runs first differ, `Figures` the pooled
distance; they keep their fields because the cases' ``--json`` prints them as they are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from simdist.gradpath.families import ParamSpec
from simdist.gradpath.probes import Key, Trace, path_order
from simdist.numerics.compare import Comparison, Pair, compare
from simdist.numerics.floats import bits


@dataclass(frozen=True)
class Match:
    """Whether two runs agree bitwise on every capture one of them made, and where they first do not."""

    compared: int
    equal: int
    first_difference: str | None

    @property
    def bitwise_equal(self) -> bool:
        return self.compared > 0 and self.compared == self.equal

    @classmethod
    def of(cls, comparison: Comparison, names: tuple[str, str] = ("real", "simdist")) -> Match:
        """The counts of ``comparison`` and its first divergence, described (its order holds rank and key)."""
        first = None
        if comparison.first is not None:
            (_, rank, _, key), value, theirs = comparison.first
            first = _describe(key, rank, value, theirs, names)
        return cls(comparison.tensors, comparison.equal, first)


@dataclass(frozen=True)
class Figures:
    """How far one run is from another (e.g. DeepSpeed as shipped from its FP32-staging fix).

    ``max_error_over_terms`` is ``max |a - b| / sum |terms|`` over elements, where
    ``terms`` are the summands that made the element (the TP peers' local
    gradients over the micro-steps so far, each scaled as the correction
    scales it): the quantity the classical bound ``(n - 1) u`` limits.
    """

    tensors_differing: int
    tensors: int
    fraction_differing: float
    max_ulp: int
    max_error_over_terms: float
    params_differing: tuple[str, ...]

    @classmethod
    def of(cls, comparison: Comparison) -> Figures:
        d = comparison.difference
        return cls(
            comparison.tensors - comparison.equal,
            comparison.tensors,
            d.fraction_differing,
            d.max_ulp,
            d.max_term_relative or 0.0,
            tuple(sorted(comparison.differing)),
        )


def _element(a: torch.Tensor, b: torch.Tensor) -> str:
    differing = (bits(a) != bits(b)).reshape(a.shape)
    index = tuple(int(i) for i in differing.nonzero()[0])
    return f"element {index}: {a[index].item():.9g} vs {b[index].item():.9g}"


def match_traces(
    real: list[Trace],
    model: list[Trace],
    stages: tuple[str, ...] = ("local", "hp"),
    names: tuple[str, str] = ("real", "simdist"),
) -> Match:
    """Compare every capture of ``real`` at ``stages`` with ``model``'s (same key), bitwise: a capture ``model``
    lacks, or holds in another dtype or shape, differs; the first difference is the earliest in path order,
    then rank, then capture order."""
    pairs: list[Pair] = []
    for trace, other in zip(real, model, strict=True):
        for index, (key, value) in enumerate(trace.values.items()):
            if key[3] in stages:
                pairs.append((key[2], (path_order(key), trace.rank, index, key), value, other.values.get(key), None))
    return Match.of(compare(pairs), names)


def _describe(key: Key, rank: int, value: torch.Tensor, theirs: torch.Tensor | None, names) -> str:
    step, micro, param, stage = key
    at = f"{param} '{stage}' (rank {rank}, step {step}, micro-step {micro})"
    if theirs is None:
        return f"{at}: {names[1]} has no such capture"
    if theirs.dtype != value.dtype or theirs.shape != value.shape:
        got = f"{names[0]} {value.dtype} {tuple(value.shape)}"
        return f"{at}: {got} vs {names[1]} {theirs.dtype} {tuple(theirs.shape)}"
    return f"{at}: {names[0]} vs {names[1]} first differ at {_element(value, theirs)}"


def figures(
    run_a: list[Trace], run_b: list[Trace], terms: dict[tuple[int, Key], torch.Tensor], stage: str = "hp"
) -> Figures:
    """`Figures` of ``run_a`` against ``run_b`` over their ``stage`` captures; ``terms[(rank, key)]`` = sum |terms|."""
    pairs: list[Pair] = []
    for a, b in zip(run_a, run_b, strict=True):
        for index, (key, value) in enumerate(a.values.items()):
            if key[3] == stage:
                pairs.append((key[2], (path_order(key), a.rank, index), value, b.values[key], terms.get((a.rank, key))))
    return Figures.of(compare(pairs))


def only(traces: list[Trace], names: set[str], stages: set[str] | None = None) -> list[Trace]:
    """The captures of the parameters ``names`` (and, if given, the ``stages``), rank by rank."""
    out = []
    for trace in traces:
        kept = Trace(trace.rank)
        kept.values = {k: v for k, v in trace.values.items() if k[2] in names and (stages is None or k[3] in stages)}
        out.append(kept)
    return out


def zero_weights(rank: int, param: ParamSpec) -> torch.Tensor:
    """BF16 zeros as initial weights: a case that feeds recorded gradients compares gradient captures only,
    which do not depend on the weights."""
    return torch.zeros(param.shape, dtype=torch.bfloat16)
