"""Plots of error growth. See `simdist.studies.growth`."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from simdist.gradpath.catalogue import get_policy
from simdist.gradpath.policy import dtype_name
from simdist.studies.growth.files import atomic_write
from simdist.studies.growth.metrics import COLUMNS, MOE_COLUMNS, TENSORS

if TYPE_CHECKING:
    from simdist.studies.growth.run import GrowthConfig


def random_walk(steps: np.ndarray, median: np.ndarray, anchor: int = 10) -> np.ndarray | None:
    """``median[t0] * sqrt(t / t0)`` with ``t0`` the first step >= ``anchor`` where the median is non-zero."""
    ok = np.nonzero((steps >= min(anchor, steps[-1])) & (median > 0))[0]
    if not len(ok):
        return None
    t0 = ok[0]
    return median[t0] * np.sqrt(steps / steps[t0])


def plot_growth(config: GrowthConfig, metrics: np.ndarray, path: str | Path) -> None:
    """Log-log panels (relative and ulp error of masters, m, v against step): median, 10-90% band, sqrt(t) line.

    ``model="moe"``: BF16 weights' relative and max-ulp error, the loss difference and the local gradients' error.
    """
    if config.model == "moe":
        _plot_moe(config, metrics, path)
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = np.arange(1, metrics.shape[0] + 1)
    fig, axes = plt.subplots(2, 3, figsize=(15, 9), sharex=True)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    labels = {"master": "FP32 master", "adam_m": "Adam m", "adam_v": "Adam v"}
    for row, (metric, unit) in enumerate((("rel", "normwise relative error  ‖p − o‖₂ / ‖o‖₂  (1)"),
                                          ("ulp_gmean", "geo-mean error, differing elements (FP32 ulps)"))):
        for col, tensor in enumerate(TENSORS):
            ax = axes[row, col]
            k = COLUMNS.index(f"{tensor}_{metric}")
            for j, name in enumerate(config.policies):
                _draw_band(ax, steps, metrics[:, j, :, k], colours[j % len(colours)], name, walk=tensor == "master")
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_title(labels[tensor])
            ax.set_ylabel(unit, fontsize=9)
            if row == 1:
                ax.set_xlabel("optimizer step (count)")
            ax.grid(True, which="major", alpha=0.3)
    handles, names = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, names, loc="lower center", ncol=3, fontsize=8)
    spec = config.spec
    dtypes = _dtypes(config)
    fig.suptitle(y=0.99, t=f"Error growth vs the FP32 oracle — {spec.describe()}, "
                 f"model {config.model} (no loss: gradients are drawn, not derived), {config.seeds} seeds, "
                 f"GAS {config.gas}\n{dtypes}", fontsize=9)
    fig.subplots_adjust(left=0.06, right=0.99, bottom=0.17, top=0.95 - 0.02 * (len(config.policies) + 1),
                        hspace=0.22, wspace=0.22)

    _save_figure(fig, path)


def _dtypes(config: GrowthConfig) -> str:
    return "\n".join(
        f"{n}: grad {dtype_name(p.grad_dtype)}, writeback {dtype_name(p.writeback) if p.writeback else 'none'}, "
        f"acc {dtype_name(p.accumulate)}, dp {dtype_name(p.dp_reduce)}, master/moments {dtype_name(p.master)}/"
        f"{dtype_name(p.moments)}" for n, p in ((n, get_policy(n)) for n in config.policies))


def _save_figure(fig, path: str | Path) -> None:
    import matplotlib.pyplot as plt

    def save(tmp: Path) -> None:
        fig.savefig(tmp, format="png", dpi=90, metadata={"Software": None})

    atomic_write(Path(path), save)
    plt.close(fig)


def _draw_band(ax, steps: np.ndarray, values: np.ndarray, colour, name: str, walk: bool) -> None:
    """Median and 10-90% band over seeds (``values[step, seed]``) on log axes; zeros are not drawn."""
    med = np.median(values, axis=1)
    if not (med > 0).any() and not (values > 0).any():
        ax.plot([], [], color=colour, label=f"{name} (bitwise equal to oracle: zero error)")
        return
    lo, hi = np.percentile(values, 10, axis=1), np.percentile(values, 90, axis=1)
    ax.fill_between(steps, np.where(lo > 0, lo, np.nan), np.where(hi > 0, hi, np.nan),
                    color=colour, alpha=0.2, linewidth=0)
    ax.plot(steps, np.where(med > 0, med, np.nan), color=colour, label=f"{name} median, 10–90% band")
    line = random_walk(steps, med) if walk else None
    if line is not None:
        ax.plot(steps, line, color=colour, linestyle="--", linewidth=1, label=f"{name} random walk ∝ √t")


def _plot_moe(config: GrowthConfig, metrics: np.ndarray, path: str | Path) -> None:
    """Log-log panels for the MoE block: BF16 weights' relative and ulp error, loss difference, local grads."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from simdist.models.moe import MoEConfig

    steps = np.arange(1, metrics.shape[0] + 1)
    fig, axes = plt.subplots(2, 2, figsize=(13, 10), sharex=True)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    panels = (
        ("param_rel", "BF16 weights after the update", "normwise relative error  ‖p − o‖₂ / ‖o‖₂  (1)", True),
        ("param_ulp_max", "BF16 weights after the update", "max error over elements (BF16 ulps)", False),
        ("loss_diff", "loss difference (loss of step t, before its update)",
         "|loss_policy − loss_oracle|  (loss units: MSE)", False),
        ("grad_rel", "BF16 local gradients (model backward)", "normwise relative error  ‖p − o‖₂ / ‖o‖₂  (1)",
         False),
    )
    for ax, (column, title, unit, walk) in zip(axes.flat, panels, strict=True):
        k = MOE_COLUMNS.index(column)
        for j, name in enumerate(config.policies):
            _draw_band(ax, steps, metrics[:, j, :, k], colours[j % len(colours)], name, walk)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(title, fontsize=10)
        ax.set_ylabel(unit, fontsize=9)
        ax.grid(True, which="major", alpha=0.3)
    for ax in axes[1]:
        ax.set_xlabel("optimizer step (count)")
    handles, names = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, names, loc="lower center", ncol=3, fontsize=8)
    cfg = MoEConfig()
    fig.suptitle(y=0.99, t=f"Error growth vs the FP32 oracle — {config.spec.describe()}, model moe (folded "
                 f"MoE block: hidden {cfg.hidden}, {cfg.experts} experts top-{cfg.top_k}, {cfg.tokens} tokens/rank; "
                 f"BF16 weights and local grads), {config.seeds} seeds, GAS {config.gas}\n{_dtypes(config)}",
                 fontsize=9)
    fig.subplots_adjust(left=0.08, right=0.99, bottom=0.13, top=0.95 - 0.02 * (len(config.policies) + 1),
                        hspace=0.2, wspace=0.22)
    _save_figure(fig, path)
