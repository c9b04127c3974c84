"""Per-step divergence metrics of a policy from the oracle (the matched FP32 policy for the MoE source), and the
metrics file. See `simdist.studies.growth`."""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from simdist.numerics.floats import ordered_integers
from simdist.studies.growth.files import atomic_write

if TYPE_CHECKING:
    from simdist.studies.growth.config import GrowthConfig

TENSORS = ("master", "adam_m", "adam_v")


METRICS = ("rel", "ulp_gmean", "ulp_max", "differ")


COLUMNS = tuple(f"{t}_{m}" for t in TENSORS for m in METRICS)
"""Per step, seed and policy, for each tensor: normwise relative error, geometric-mean FP32-ulp distance over
the elements that differ (0 when none), max FP32-ulp distance, fraction of elements that differ."""


MOE_COLUMNS = (
    "loss",
    "matched_loss",
    "loss_diff",
    "grad_norm",
    "matched_grad_norm",
    "param_rel",
    "param_ulp_max",
    "param_differ",
    "grad_rel",
    "grad_ulp_max",
    "grad_differ",
)
"""``source="moe"``, per step, seed and policy: the policy's loss and the matched FP32 policy's (the run it is
compared with, `simdist.studies.training.train`), ``|loss - matched_loss|``, both gradient norms, and for the
BF16 weights after the update (``param``) and the BF16 local gradients (``grad``), pooled over parameters, ranks
and micro-steps: normwise relative error, max BF16-ulp distance, fraction of elements that differ."""


_MOE_DIVERGENCE = ("loss_diff", "param_rel", "param_ulp_max", "param_differ", "grad_rel", "grad_ulp_max", "grad_differ")


def columns(source: str) -> tuple[str, ...]:
    """The metric columns of the rows of gradient source ``source``."""
    return MOE_COLUMNS if source == "moe" else COLUMNS


def _ordered(t: torch.Tensor) -> torch.Tensor:
    """FP32 values as int64 integers monotone in the value (`simdist.numerics.floats.ordered_integers`)."""
    return ordered_integers(t.to(torch.float32))


_HALF_RANGE = 1 << 30
"""Below this magnitude two ordered FP32 integers are less than ``2**31`` apart: their difference fits int32."""


def _ordered32(t: torch.Tensor) -> torch.Tensor:
    """`_ordered` in int32 (the same integers: `ordered_integers`' map before its widening, which cannot
    overflow int32), half the memory traffic of int64."""
    raw = t.to(torch.float32).contiguous().view(torch.int32)
    sign = raw >> 31
    return (raw ^ (sign & 0x7FFFFFFF)) - sign


class Reference:
    """The oracle's tensor ``[S, R, N]`` prepared once per step for `divergence`."""

    def __init__(self, expected: torch.Tensor) -> None:
        self.e32 = expected.to(torch.float32).contiguous()
        self.e64 = self.e32.double().flatten(-2)
        self.ordered32 = _ordered32(self.e32).flatten(-2)
        self.norm = _norm(self.e64)
        # every element is finite exactly when every seed's fp64 norm is (FP32 squares cannot overflow fp64)
        self.finite = bool(torch.isfinite(self.norm).all())
        self.small = _small(self.ordered32)
        self._nan: torch.Tensor | None = None

    @property
    def nan(self) -> torch.Tensor:
        """Where the oracle's values are NaN (only the non-finite branch of `divergence` needs it)."""
        if self._nan is None:
            self._nan = torch.isnan(self.e64)
        return self._nan

    @property
    def ordered(self) -> torch.Tensor:
        """The int64 ordered integers of the oracle's values."""
        return self.ordered32.to(torch.int64)


def _sum_in_order(x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The sum over the last dimension, element 0 first, one addition at a time (in ``dtype``).

    torch's ``sum`` splits a row into vector lanes whose number depends on the CPU's kernel (AVX-512 is wider
    than AVX2) and on the tensor's shape, so the same row summed inside a larger tensor, or on another machine,
    can round differently. ``cumsum`` runs each row left to right on every kernel: the metrics' figures depend
    only on the row's values (tested under ``ATEN_CPU_CAPABILITY=default``, ``avx2`` and ``avx512``).
    """
    if not x.shape[-1]:
        return x.sum(dim=-1, dtype=dtype)
    return x.cumsum(dim=-1, dtype=dtype)[..., -1]


def _exp2(x: torch.Tensor) -> torch.Tensor:
    """``2**x`` element by element with the C library's ``exp2``, the same function for every element.

    torch's vectorised ``exp2`` gives an element different bits depending on where it falls in the vector lanes
    (measured on AVX-512: one element of 96 against the same 32 computed alone) and on the CPU's kernel; the
    arguments here are a handful per step (a mean of logs, at most 64), so a scalar loop costs nothing."""
    flat = [math.exp2(value) for value in x.reshape(-1).tolist()]
    return torch.tensor(flat, dtype=torch.float64).reshape(x.shape)


def _norm(x: torch.Tensor) -> torch.Tensor:
    """The 2-norm over the last dimension of an fp64 tensor, its squares summed in order (`_sum_in_order`).

    The values are FP32 values or differences of two, whose squares neither overflow nor underflow in fp64, so
    the plain sum of squares needs none of ``vector_norm``'s scaling."""
    return _sum_in_order(x * x).sqrt()


def _small(ordered: torch.Tensor) -> bool:
    """Whether every ordered integer is below ``2**30`` in magnitude (`_HALF_RANGE`; none is ``-2**31``)."""
    if not ordered.numel():
        return True
    low, high = torch.aminmax(ordered)
    return bool(low > -_HALF_RANGE) and bool(high < _HALF_RANGE)


def _same_bits(actual: torch.Tensor, reference: Reference) -> bool:
    """Whether ``actual`` cast to FP32 holds the oracle's bits exactly (one comparison of the raw words)."""
    a32 = actual.to(torch.float32)
    if a32.shape != reference.e32.shape:
        return False
    return bool(np.array_equal(a32.contiguous().view(torch.int32).numpy(), reference.e32.view(torch.int32).numpy()))


def divergence(actual: torch.Tensor, reference: Reference) -> torch.Tensor:
    """Per seed ``[..., S, 4]``: normwise relative error, geometric-mean ulps of the differing elements, max
    ulps, fraction differing.

    Ulps are FP32 ulps, counted exactly (in int32 when both sides' ordered integers are below ``2**30`` in
    magnitude, so that their difference fits, else in int64); the geometric mean is over the elements that
    differ (0 when every element is equal), so a policy that perturbs one parameter family shows the typical
    error of that family's elements, and the few elements near zero (many ulps for a tiny absolute error) do
    not dominate it. Its logarithms are taken in fp32 and summed in fp64 (relative error of the mean below
    1e-6, tested): the log is most of this function's cost, and the figure is a summary, not a bit pattern.

    ``actual`` is ``[S, R, N]``, or ``[P, S, R, N]`` for ``P`` policies at once (one call instead of ``P``: the
    tensors are small, so the per-call cost dominates); it is cast to FP32 (exact for FP32 and BF16 state).
    The metrics reduce over ranks and elements within a seed only, never across seeds or policies. An
    element where exactly one side is NaN counts as ``inf`` ulps.
    """
    return _divergence(actual, reference)[0]


def divergence_each(actual: torch.Tensor, reference: Reference) -> torch.Tensor:
    """`divergence` of ``actual`` ``[P, S, R, N]`` computed one policy at a time: the same bits (every metric
    reduces within one row; on one thread, as the growth run computes it, a row's reductions do not depend on
    how many rows there are; tested), about twice as fast on pieces that stay in the CPU's cache. If any
    policy's error is not finite, the whole call is made at once, which takes the non-finite branch for every
    policy as `divergence` does."""
    parts = []
    for item in actual.unbind(0):
        out, finite = _divergence(item, reference)
        if not finite:
            return divergence(actual, reference)
        parts.append(out)
    return torch.stack(parts)


def _divergence(actual: torch.Tensor, reference: Reference) -> tuple[torch.Tensor, bool]:
    """`divergence`, and whether every error norm was finite (the branch it took)."""
    if reference.finite and reference.e32.numel() and _same_bits(actual, reference):
        # what the computation below gives when ``actual`` is the oracle's bits and finite: err = 0 exactly, so rel
        # is +0.0 whatever the norm, no element differs (0 ulps: count, max, gmean and fraction all +0.0)
        return torch.zeros((*actual.shape[:-2], 4), dtype=torch.float64), True
    a64 = actual.to(torch.float32).double().flatten(-2)
    err = _norm(a64 - reference.e64)
    rel = torch.where(reference.norm > 0, err / reference.norm, torch.where(err > 0, math.inf, 0.0))
    ordered = _ordered32(actual).flatten(-2)
    if reference.small and _small(ordered):
        ulps = (ordered - reference.ordered32).abs_()
    else:
        ulps = (ordered.to(torch.int64) - reference.ordered).abs_()
    finite = bool(torch.isfinite(err).all())
    if finite:
        count = ulps.bool().sum(dim=-1)  # count_nonzero's integers, a third of its time
        top = ulps.amax(dim=-1).double()
        logs = _sum_in_order(ulps.clamp_(min=1).to(torch.float32).log2_(), torch.float64)  # equal elements: 0
    else:  # NaN or inf somewhere: NaN on one side only is inf ulps, on both sides 0
        u = ulps.double()
        u = torch.where(torch.isnan(a64) ^ reference.nan, math.inf, torch.where(torch.isnan(a64), 0.0, u))
        count = torch.count_nonzero(u, dim=-1)
        logs = _sum_in_order(torch.where(u != 0, u, 1.0).log2_())
        top = u.amax(dim=-1)
    gmean = torch.where(count > 0, _exp2(logs / count.clamp(min=1)), 0.0)
    return torch.stack([rel, gmean, top, count.double() / ulps.shape[-1]], dim=-1), finite


def metric_steps(config: GrowthConfig) -> np.ndarray:
    """The 1-based steps whose metrics a run records (``metrics[row]`` is step ``metric_steps(config)[row]``).

    Synthetic source: every step up to ``config.metrics_dense``, then every ``config.metrics_every``-th step, and
    the last step. MoE: every step (its rows come from the training records).
    """
    steps = np.arange(1, config.steps + 1)
    if config.source == "moe":
        return steps
    keep = (steps <= config.metrics_dense) | (steps % config.metrics_every == 0) | (steps == config.steps)
    return steps[keep]


def schedule_note(config: GrowthConfig) -> str:
    """The first line of ``metrics.csv``: which steps it holds (read_metrics skips it)."""
    if config.source == "moe" or config.metrics_every == 1 or config.steps <= config.metrics_dense:
        return "# metrics at every step"
    return (
        f"# metrics at every step up to {config.metrics_dense}, then every {config.metrics_every}th step and the "
        "last (the training runs every step)"
    )


def write_metrics(path: Path, config: GrowthConfig, metrics: np.ndarray) -> None:
    steps = metric_steps(config)

    def write(tmp: Path) -> None:
        with tmp.open("w", newline="") as f:
            f.write(schedule_note(config) + "\n")
            w = csv.writer(f)
            w.writerow(["step", "policy", "seed", *columns(config.source)])
            digits = ".17g" if config.source == "moe" else ".9g"  # MoE losses: exact, so loss_diff is recomputable
            for row in range(metrics.shape[0]):
                for j, name in enumerate(config.policies):
                    for s in range(metrics.shape[2]):
                        values = (format(x, digits) for x in metrics[row, j, s])
                        w.writerow([int(steps[row]), name, config.seed + s, *values])

    atomic_write(path, write)


def read_metrics(path: str | Path) -> tuple[list[str], np.ndarray]:
    """``(policies, metrics[row, policy, seed, column])`` from a ``metrics.csv``: one row per step the file
    holds, in step order (every step, or `metric_steps`; the file's first line says which).

    Columns are in the file's order: `COLUMNS` for the synthetic source, `MOE_COLUMNS` for the MoE.
    """
    with Path(path).open(newline="") as f:
        reader = csv.DictReader(line for line in f if not line.startswith("#"))
        rows = list(reader)
        names = [c for c in (reader.fieldnames or []) if c not in ("step", "policy", "seed")]
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    steps = {t: i for i, t in enumerate(sorted({int(r["step"]) for r in rows}))}
    seeds = sorted({int(r["seed"]) for r in rows})
    out = np.zeros((len(steps), len(policies), len(seeds), len(names)))
    for r in rows:
        where = steps[int(r["step"])], policies.index(r["policy"]), seeds.index(int(r["seed"]))
        out[where] = [float(r[c]) for c in names]
    return policies, out


def loglog_slope(x: np.ndarray, y: np.ndarray) -> float:
    """The least-squares slope of ``log y`` against ``log x`` (the growth exponent), the same bits on every CPU.

    ``np.polyfit`` solves through LAPACK and ``np.log`` through NumPy's SIMD loops, whose kernels are chosen by
    the CPU; here every log is the C library's and every sum is `math.fsum` (correctly rounded), over centred
    values (no cancellation between large sums)."""
    lx = [math.log(float(v)) for v in x]
    ly = [math.log(float(v)) for v in y]
    mx, my = math.fsum(lx) / len(lx), math.fsum(ly) / len(ly)
    dx = [v - mx for v in lx]
    return math.fsum(a * (b - my) for a, b in zip(dx, ly, strict=True)) / math.fsum(a * a for a in dx)


def summarise(config: GrowthConfig, metrics: np.ndarray) -> dict:
    """Final-step medians per policy, and the fitted growth exponent of the master error (log-log slope).

    ``source="moe"``: the exponent is that of the BF16 weights' error (``param_rel_growth_exponent``), and
    ``bitwise_equal_to_oracle`` means every divergence column and the loss difference are 0 at every step (there
    the run compared with is the matched FP32 policy's, `simdist.studies.training.train`; the key is the
    synthetic source's).
    """
    out: dict = {"config": config.identity(), "policies": {}}
    steps = metric_steps(config)
    names = columns(config.source)
    tracked = "param_rel" if config.source == "moe" else "master_rel"
    compared = [names.index(c) for c in (_MOE_DIVERGENCE if config.source == "moe" else COLUMNS)]
    for j, name in enumerate(config.policies):
        final = {c: float(np.median(metrics[-1, j, :, k])) for k, c in enumerate(names)}
        med = np.median(metrics[:, j, :, names.index(tracked)], axis=1)
        late = (steps >= max(10, steps[-1] // 10)) & (med > 0)
        slope = loglog_slope(steps[late], med[late]) if late.sum() >= 3 else None
        out["policies"][name] = {
            "final_median": final,
            f"{tracked}_growth_exponent": slope,
            "bitwise_equal_to_oracle": bool((metrics[:, j, :, compared] == 0).all()),
        }
    if config.source == "moe":
        for j, name in enumerate(config.policies):
            out["policies"][name]["max_loss_diff"] = float(metrics[:, j, :, names.index("loss_diff")].max())
    return out
