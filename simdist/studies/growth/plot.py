"""Plots of error growth. See `simdist.studies.growth`."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from simdist.gradpath.policy import dtype_name
from simdist.policies.catalogue import get_policy
from simdist.studies.growth.files import atomic_write
from simdist.studies.growth.metrics import COLUMNS, MOE_COLUMNS, TENSORS, metric_steps

if TYPE_CHECKING:
    from simdist.studies.growth.config import GrowthConfig


def random_walk(steps: np.ndarray, median: np.ndarray, anchor: int = 10) -> np.ndarray | None:
    """``median[t0] * sqrt(t / t0)`` with ``t0`` the first step >= ``anchor`` where the median is non-zero."""
    ok = np.nonzero((steps >= min(anchor, steps[-1])) & (median > 0))[0]
    if not len(ok):
        return None
    t0 = ok[0]
    return median[t0] * np.sqrt(steps / steps[t0])


MOE_BASELINE = "the matched FP32 policy"
"""What ``source="moe"``'s errors are measured against: the run of `MATCHED_FP32` next to each policy's."""


def plot_growth(config: GrowthConfig, metrics: np.ndarray, path: str | Path) -> None:
    """Write `growth_figure` to ``path`` (PNG, atomically)."""
    _save_figure(growth_figure(config, metrics), path)


def growth_figure(config: GrowthConfig, metrics: np.ndarray):
    """Panels of the relative and ulp error of masters, m, v against step (log x, symlog y so that an exact 0
    is drawn): median, band over seeds (`band`), sqrt(t) line; a policy equal to the oracle is a line at 0.

    ``source="moe"``: BF16 weights' relative and max-ulp error, the loss difference and the local gradients' error,
    against the matched FP32 policy (`MOE_BASELINE`: what `simdist.studies.training.train` compares with).
    Panels are spaced so that no y label or tick label overlaps the panel to its left (`_make_room`).
    """
    if config.source == "moe":
        return _moe_figure(config, metrics)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = metric_steps(config)
    fig, axes = plt.subplots(2, 3, figsize=(15, 9), sharex=True)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    labels = {"master": "FP32 master", "adam_m": "Adam m", "adam_v": "Adam v"}
    for row, (metric, unit) in enumerate(
        (
            ("rel", "normwise relative error  ‖p − o‖₂ / ‖o‖₂  (1)"),
            ("ulp_gmean", "geo-mean error, differing elements (FP32 ulps)"),
        )
    ):
        for col, tensor in enumerate(TENSORS):
            ax = axes[row, col]
            k = COLUMNS.index(f"{tensor}_{metric}")
            _panel(ax, steps, metrics[:, :, :, k], config.policies, colours, walk=tensor == "master")
            ax.set_title(labels[tensor])
            ax.set_ylabel(unit, fontsize=9)
            if row == 1:
                ax.set_xlabel("optimizer step (count)")
    _legend(fig, axes)
    spec = config.spec
    dtypes = _dtypes(config)
    fig.suptitle(
        y=0.99,
        t=f"Error growth vs the FP32 oracle — {spec.describe()}, "
        f"source {config.source} (no loss: gradients are drawn, not derived), {config.seeds} seeds, "
        f"GAS {config.gas}\n{dtypes}",
        fontsize=9,
    )
    fig.subplots_adjust(
        left=0.06, right=0.99, bottom=0.17, top=0.95 - 0.02 * (len(config.policies) + 1), hspace=0.22, wspace=0.22
    )
    _make_room(fig, axes)
    return fig


def _panel(
    ax, steps: np.ndarray, errors: np.ndarray, policies, colours, walk: bool, baseline: str = "the oracle"
) -> None:
    """One error panel: each policy's band over seeds (``errors[step, policy, seed]``) on a log step axis that
    spans every step (an all-zero panel draws only horizontal lines) and a symlog error axis. ``baseline``: what
    the errors are measured against, in the labels (the oracle; the matched FP32 policy for ``source="moe"``)."""
    zero = [
        _draw_band(ax, steps, errors[:, j, :], colours[j % len(colours)], name, walk, baseline)
        for j, name in enumerate(policies)
    ]
    ax.set_xscale("log")
    ax.set_xlim(1, max(2, int(steps[-1])))
    _error_axis(ax, errors, any(zero), baseline)
    ax.grid(True, which="major", alpha=0.3)


def label_overlaps(fig, axes) -> list[tuple[int, int]]:
    """``(row, col)`` of every panel whose y label or tick labels reach into the panel to its left."""
    renderer = fig.canvas.get_renderer()
    found = []
    for row in range(axes.shape[0]):
        for col in range(1, axes.shape[1]):
            left_edge = axes[row, col].get_tightbbox(renderer).x0  # its y label and tick labels included
            if left_edge < axes[row, col - 1].get_window_extent(renderer).x1:
                found.append((row, col))
    return found


def _make_room(fig, axes) -> None:
    """Widen the space between panels until no y label overlaps the panel to its left (at most 0.6 of a panel)."""
    fig.align_ylabels(axes[:, 0])
    wspace = fig.subplotpars.wspace
    while label_overlaps(fig, axes) and wspace < 0.6:
        wspace += 0.04
        fig.subplots_adjust(wspace=wspace)


def _legend(fig, axes) -> None:
    """One legend for the figure: every label of every panel, once (a policy may be zero on some panels only)."""
    seen: dict[str, object] = {}
    for ax in np.ravel(axes):
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            seen.setdefault(label, handle)
    fig.legend(list(seen.values()), list(seen), loc="lower center", ncol=3, fontsize=8)


def _dtypes(config: GrowthConfig) -> str:
    return "\n".join(
        f"{n}: grad {dtype_name(p.grad_dtype)}, writeback {dtype_name(p.writeback) if p.writeback else 'none'}, "
        f"acc {dtype_name(p.accumulate)}, dp {dtype_name(p.dp_reduce)}, master/moments {dtype_name(p.master)}/"
        f"{dtype_name(p.moments)}"
        for n, p in ((n, get_policy(n)) for n in config.policies)
    )


def _save_figure(fig, path: str | Path) -> None:
    import matplotlib.pyplot as plt

    def save(tmp: Path) -> None:
        fig.savefig(tmp, format="png", dpi=90, metadata={"Software": None})

    atomic_write(Path(path), save)
    plt.close(fig)


BAND_QUANTILE_SEEDS = 10
"""Seeds needed before the band is the 10-90% quantile range; with fewer it is the min-max range."""


def band(values: np.ndarray) -> tuple[np.ndarray, np.ndarray, str]:
    """``(low, high, label)`` of the spread over seeds (``values[step, seed]``).

    With at least `BAND_QUANTILE_SEEDS` seeds: the 10th and 90th percentiles (``"10–90% band"``). With fewer,
    a 10th percentile would only interpolate between the two smallest seeds, so the band is the
    min-max range and says so (``"min–max band, 2 seeds"``).
    """
    seeds = values.shape[1]
    if seeds >= BAND_QUANTILE_SEEDS:
        return np.percentile(values, 10, axis=1), np.percentile(values, 90, axis=1), "10–90% band"
    return values.min(axis=1), values.max(axis=1), f"min–max band, {seeds} seed{'s' if seeds != 1 else ''}"


def _draw_band(
    ax, steps: np.ndarray, values: np.ndarray, colour, name: str, walk: bool, baseline: str = "the oracle"
) -> bool:
    """Median and band over seeds (``values[step, seed]``); returns whether every value is exactly zero.

    The axis is symlog (`_error_axis`), so exact zeros are drawn at the bottom (0) instead of vanishing as
    they would on a log axis. A policy whose error is zero at every step and seed is drawn as a line at 0
    and labelled as bitwise equal to ``baseline``.
    """
    if not (values != 0).any():
        ax.axhline(
            0.0,
            color=colour,
            linewidth=2.5,
            alpha=0.8,
            label=f"{name}: bitwise equal to {baseline} (error exactly 0 at every step and seed)",
        )
        return True
    med = np.median(values, axis=1)
    lo, hi, what = band(values)
    ax.fill_between(steps, lo, hi, color=colour, alpha=0.2, linewidth=0)
    ax.plot(steps, med, color=colour, label=f"{name} median, {what}")
    line = random_walk(steps, med) if walk else None
    if line is not None:
        ax.plot(steps, line, color=colour, linestyle="--", linewidth=1, label=f"{name} random walk ∝ √t")
    return False


def _error_axis(ax, values: np.ndarray, any_zero_policy: bool, baseline: str = "the oracle") -> None:
    """A symlog y axis: logarithmic above the smallest non-zero error, linear from it down to an exact 0.

    ``values`` are every value drawn on the panel. With no non-zero value at all the axis is linear on [0, 1].
    A panel where some policy is bitwise equal to ``baseline`` gets a note at its bottom line.
    """
    finite = values[np.isfinite(values)]
    positive = finite[finite > 0]
    if positive.size:
        threshold = float(10 ** (np.floor(np.log10(positive.min())) - 1))  # a decade below the smallest error
        ax.set_yscale("symlog", linthresh=threshold, linscale=1.0)
        top = float(positive.max()) * 3
        ax.set_ylim(bottom=-0.3 * threshold, top=top)  # room for the line at 0
        first, last = round(float(np.log10(threshold))), int(np.ceil(np.log10(top)))
        stride = max(1, (last - first + 8) // 9)  # at most about 9 decades labelled
        from matplotlib.ticker import FixedLocator, NullFormatter

        ax.yaxis.set_major_locator(FixedLocator([0.0] + [10.0**k for k in range(first, last + 1, stride)]))
        ax.yaxis.set_minor_formatter(NullFormatter())
    else:
        ax.set_ylim(-0.05, 1.0)
    if any_zero_policy:
        ax.annotate(
            f"0 = bitwise equal to {baseline}",
            xy=(0.01, 0.0),
            xycoords=("axes fraction", "data"),
            xytext=(0, 3),
            textcoords="offset points",
            fontsize=7,
            va="bottom",
        )


def _moe_figure(config: GrowthConfig, metrics: np.ndarray):
    """Log-x / symlog-y panels for the MoE block: BF16 weights' relative and ulp error, loss difference, local grads."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from simdist.sources.moe import MoEConfig

    steps = np.arange(1, metrics.shape[0] + 1)
    fig, axes = plt.subplots(2, 2, figsize=(13, 10), sharex=True)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    panels = (
        ("param_rel", "BF16 weights after the update", "normwise relative error  ‖p − o‖₂ / ‖o‖₂  (1)", True),
        ("param_ulp_max", "BF16 weights after the update", "max error over elements (BF16 ulps)", False),
        (
            "loss_diff",
            "loss difference (loss of step t, before its update)",
            "|loss_policy − loss_matched|  (loss units: MSE)",
            False,
        ),
        ("grad_rel", "BF16 local gradients (model backward)", "normwise relative error  ‖p − o‖₂ / ‖o‖₂  (1)", False),
    )
    for ax, (column, title, unit, walk) in zip(axes.flat, panels, strict=True):
        k = MOE_COLUMNS.index(column)
        _panel(ax, steps, metrics[:, :, :, k], config.policies, colours, walk, baseline=MOE_BASELINE)
        ax.set_title(title, fontsize=10)
        ax.set_ylabel(unit, fontsize=9)
    for ax in axes[1]:
        ax.set_xlabel("optimizer step (count)")
    _legend(fig, axes)
    cfg = MoEConfig()
    fig.suptitle(
        y=0.99,
        t=f"Error growth vs the matched FP32 policy — {config.spec.describe()}, source moe (folded "
        f"MoE block: hidden {cfg.hidden}, {cfg.experts} experts top-{cfg.top_k}, {cfg.tokens} tokens/rank; "
        f"BF16 weights and local grads), {config.seeds} seeds, GAS {config.gas}\n{_dtypes(config)}",
        fontsize=9,
    )
    fig.subplots_adjust(
        left=0.08, right=0.99, bottom=0.13, top=0.95 - 0.02 * (len(config.policies) + 1), hspace=0.2, wspace=0.22
    )
    _make_room(fig, axes)
    return fig
