"""Comparing a real framework's captures with simdist's, capture by capture and element by element."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from simdist.gradpath.families import ParamSpec
from simdist.gradpath.probes import Key, Trace, path_order
from simdist.numerics.compare import difference
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
    """Compare every capture of ``real`` at ``stages`` with ``model``'s (same key), bitwise."""
    compared = equal = 0
    first: tuple[tuple, str] | None = None
    for trace, other in zip(real, model, strict=True):
        for key, value in trace.values.items():
            if key[3] not in stages:
                continue
            compared += 1
            theirs = other.values.get(key)
            if (
                theirs is not None
                and value.dtype == theirs.dtype
                and value.shape == theirs.shape
                and torch.equal(bits(value), bits(theirs))
            ):
                equal += 1
                continue
            where = (path_order(key), trace.rank)
            if first is None or where < first[0]:
                first = (where, _describe(key, trace.rank, value, theirs, names))
    return Match(compared, equal, first[1] if first else None)


def _describe(key: Key, rank: int, value: torch.Tensor, theirs: torch.Tensor | None, names) -> str:
    step, micro, param, stage = key
    where = f"{param} '{stage}' (rank {rank}, step {step}, micro-step {micro})"
    if theirs is None:
        return f"{where}: {names[1]} has no such capture"
    if theirs.dtype != value.dtype or theirs.shape != value.shape:
        got = f"{names[0]} {value.dtype} {tuple(value.shape)}"
        return f"{where}: {got} vs {names[1]} {theirs.dtype} {tuple(theirs.shape)}"
    return f"{where}: {names[0]} vs {names[1]} first differ at {_element(value, theirs)}"


def figures(
    run_a: list[Trace], run_b: list[Trace], terms: dict[tuple[int, Key], torch.Tensor], stage: str = "hp"
) -> Figures:
    """`Figures` of ``run_a`` against ``run_b`` over their ``stage`` captures; ``terms[(rank, key)]`` = sum |terms|."""
    tensors = differing_tensors = 0
    numel = differing = 0.0
    max_ulp = 0
    worst = 0.0
    params: set[str] = set()
    for a, b in zip(run_a, run_b, strict=True):
        for key, value in a.values.items():
            if key[3] != stage:
                continue
            other = b.values[key]
            d = difference(value, other)
            tensors += 1
            numel += d.numel
            differing += d.fraction_differing * d.numel
            max_ulp = max(max_ulp, d.max_ulp)
            if not d.bitwise_equal:
                differing_tensors += 1
                params.add(key[2])
                scale = terms[(a.rank, key)].double()
                error = (value.double() - other.double()).abs()
                usable = scale > 0
                if usable.any():
                    worst = max(worst, float((error[usable] / scale[usable]).max()))
    return Figures(
        differing_tensors, tensors, differing / numel if numel else 0.0, max_ulp, worst, tuple(sorted(params))
    )


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
