"""PNG time series of replays (headless matplotlib)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display: never open a window, never need a GUI toolkit
import matplotlib.pyplot as plt

from specgov.simulator.engine import TimeSeries


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_") or "policy"


def plot_series(name: str, series: TimeSeries, path: Path) -> Path:
    """Batch size, steps per slot, throughput and TPOT over time for one policy."""
    fig, axes = plt.subplots(4, 1, figsize=(10, 10), sharex=True)
    t = series.time_s
    axes[0].plot(t, series.mean_batch_size, lw=0.8, label="mean decode batch")
    axes[0].plot(t, series.queued_requests, lw=0.8, label="queued", alpha=0.7)
    axes[0].set_ylabel("requests")
    axes[0].legend(loc="upper right", fontsize=8)
    for slot, values in sorted(series.steps_by_slot.items()):
        axes[1].plot(t, values, lw=0.8, marker=".", ms=2, label=f"slot bs>={slot}")
    axes[1].set_ylabel("draft steps")
    axes[1].legend(loc="upper right", fontsize=8)
    axes[2].plot(t, series.output_tok_s, lw=0.8)
    axes[2].set_ylabel("output tok/s")
    axes[3].plot(t, series.mean_tpot_ms, lw=0.8)
    axes[3].set_ylabel("TPOT ms (finished)")
    axes[3].set_xlabel("simulated time (s)")
    fig.suptitle(name)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def plot_comparison(runs: Sequence[tuple[str, TimeSeries]], path: Path) -> Path:
    """Throughput and TPOT of every policy on shared axes."""
    fig, axes = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    for name, series in runs:
        axes[0].plot(series.time_s, series.output_tok_s, lw=0.8, label=name)
        axes[1].plot(series.time_s, series.mean_tpot_ms, lw=0.8, label=name)
    axes[0].set_ylabel("output tok/s")
    axes[1].set_ylabel("TPOT ms")
    axes[1].set_xlabel("simulated time (s)")
    axes[0].legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def write_plots(runs: Sequence[tuple[str, TimeSeries]], out_dir: Path) -> list[Path]:
    """One PNG per policy plus a comparison; returns the files written."""
    paths = [plot_series(name, s, out_dir / f"{_safe(name)}.png") for name, s in runs]
    paths.append(plot_comparison(runs, out_dir / "comparison.png"))
    return paths
