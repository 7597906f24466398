"""The policy benchmark's files besides the markdown: CSV tables and plots."""

from __future__ import annotations

import csv
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # headless: never open a window
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.colors import TwoSlopeNorm

from benchmarks.policies.scenarios import EMA
from specgov.simulator.engine.core import TimeSeries
from specgov.simulator.replay.plots import write_plots


def _csv_value(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return repr(v)  # full precision: ratios can be recomputed exactly
    return str(v)


def write_csv(rows: Sequence[Mapping[str, Any]], columns: Sequence[str], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="", encoding="utf-8") as fh:
        writer = csv.writer(fh)
        writer.writerow(columns)
        for r in rows:
            writer.writerow([_csv_value(r.get(c)) for c in columns])
    return path


def plot_goodput_ratios(rows: Sequence[dict[str, Any]], path: Path) -> Path | None:
    """Heat map: goodput / sglang-ema goodput, scenario (rows) x policy (columns)."""
    scen = list(dict.fromkeys(r["scenario"] for r in rows))
    pols = [p for p in dict.fromkeys(r["policy"] for r in rows) if p != EMA]
    if not scen or not pols:
        return None
    grid = np.full((len(scen), len(pols)), np.nan)
    for r in rows:
        if r["policy"] in pols and r["goodput_vs_ema"] is not None:
            grid[scen.index(r["scenario"]), pols.index(r["policy"])] = r["goodput_vs_ema"]
    fig, ax = plt.subplots(figsize=(1.0 + 0.75 * len(pols), 1.2 + 0.32 * len(scen)))
    norm = TwoSlopeNorm(vcenter=1.0, vmin=0.5, vmax=1.5)
    im = ax.imshow(np.clip(grid, 0.5, 1.5), cmap="RdYlGn", norm=norm, aspect="auto")
    for i in range(len(scen)):
        for j in range(len(pols)):
            if not np.isnan(grid[i, j]):
                ax.text(j, i, f"{grid[i, j]:.2f}", ha="center", va="center", fontsize=6)
    ax.set_xticks(range(len(pols)), labels=pols, rotation=45, ha="right", fontsize=7)
    ax.set_yticks(range(len(scen)), labels=scen, fontsize=7)
    ax.set_title("goodput / sglang-ema goodput (colour clipped to 0.5-1.5)", fontsize=9)
    fig.colorbar(im, ax=ax, shrink=0.6)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_timeseries(
    scenario_id: str, series: Sequence[tuple[str, TimeSeries]], out_dir: Path
) -> list[Path]:
    """One scenario's time series via specgov.simulator.replay.plots (one PNG per policy + all)."""
    folder = out_dir / re.sub(r"[^A-Za-z0-9_.-]+", "_", scenario_id)
    return write_plots(series, folder)
