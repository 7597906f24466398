"""PNG figures of replays (headless matplotlib), meant to be read at a glance.

Per policy: load, draft steps per batch-size slot over time (a heatmap: one row per
slot of the layout the policy decides for - 8 for a daemon policy over specgov's
adaptive config, SGLang's 4 for its EMA, one for a static step - so slots with the same
steps never hide behind each other, and a slot that ran no decode batch in an interval
is grey, not a gap), output throughput and TPOT with the SLO. The comparison puts every
policy's throughput and TPOT on shared axes; a policy whose curve is identical to an
earlier one's says so in the legend and is drawn dashed on top. Every y axis of a rate
or latency starts at 0, so a constant value is a flat line at its height, not a line
across a 2.85-3.15 axis. Times are simulated seconds since the trace's first arrival;
rates are per simulated second.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # no display: never open a window, never need a GUI toolkit
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.colors import BoundaryNorm
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from specgov.simulator.engine.core import TimeSeries

TIME_LABEL = "simulated time since the first arrival (s)"
IDLE_COLOUR = "#d9d9d9"
SLO_COLOUR = "#c0392b"
STEPS_COLOUR_MAX = 7  # SGLang's largest default candidate; more widens the scale
TITLE_MAX_CHARS = 110
SMOOTH_S = 15.0  # the comparison's moving mean: policies differ by less than the noise


def _title(head: str, context: str) -> str:
    text = f"{head} | {context}" if context else head
    return text if len(text) <= TITLE_MAX_CHARS else text[: TITLE_MAX_CHARS - 1] + "…"


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_") or "policy"


def _interval_s(t: Sequence[float] | np.ndarray) -> float:
    """The sample interval of samples taken at interval ends ``t``."""
    times = np.asarray(t, dtype=np.float64)
    return float(np.median(np.diff(times))) if times.size > 1 else float(times[0]) or 1.0


def _edges(t: Sequence[float]) -> np.ndarray:
    """Cell edges for samples at interval ends ``t`` (uniform intervals)."""
    times = np.asarray(t, dtype=np.float64)
    if times.size == 0:
        return np.array([0.0, 1.0])
    return np.concatenate([[times[0] - _interval_s(times)], times])


def _from_zero(ax: Any, values: Sequence[float]) -> None:
    """Start the y axis at 0 with some headroom (a constant series stays readable)."""
    finite = [v for v in values if isinstance(v, int | float) and math.isfinite(v)]
    top = max(finite, default=0.0)
    ax.set_ylim(0.0, top * 1.1 if top > 0 else 1.0)


def _slo_line(ax: Any, slo_tpot_ms: float | None, values: Sequence[float]) -> None:
    if slo_tpot_ms is None:
        _from_zero(ax, values)
        return
    ax.axhline(slo_tpot_ms, color=SLO_COLOUR, ls="--", lw=1.2, label=f"SLO {slo_tpot_ms:g} ms")
    _from_zero(ax, [*values, slo_tpot_ms])


def _steps_heatmap(ax: Any, series: TimeSeries, fig: Any) -> None:
    slots = sorted(series.steps_by_slot)
    if not slots or not series.time_s:
        ax.text(0.5, 0.5, "no decode batches", ha="center", va="center", transform=ax.transAxes)
        return
    grid = np.array([series.steps_by_slot[s] for s in slots], dtype=np.float64)
    top = math.ceil(float(np.nanmax(grid))) if np.isfinite(grid).any() else 0
    # The same colour means the same steps in every policy's figure.
    top = max(top, STEPS_COLOUR_MAX)
    cmap = plt.get_cmap("viridis", top + 1).with_extremes(bad=IDLE_COLOUR)
    # One colour per whole step; a fractional mean (a slot switching inside an interval)
    # takes the colour of the step it rounds down to.
    norm = BoundaryNorm(np.arange(-0.5, top + 1.5), cmap.N)
    mesh = ax.pcolormesh(
        _edges(series.time_s),
        np.arange(len(slots) + 1),
        np.ma.masked_invalid(grid),
        cmap=cmap,
        norm=norm,
        shading="flat",
    )
    ax.set_yticks(np.arange(len(slots)) + 0.5)
    ax.set_yticklabels(["every batch size"] if len(slots) == 1 else [f"bs>={s}" for s in slots])
    ax.set_ylabel("batch-size slot\n(lower bound)")
    bar = fig.colorbar(mesh, ax=ax, ticks=range(top + 1), pad=0.01)
    bar.set_label(f"draft steps (mean per {_interval_s(series.time_s):g} s)")
    # Above the heatmap, right: inside it the box would cover the top slot's cells.
    ax.legend(
        handles=[Patch(color=IDLE_COLOUR, label="no decode batch in this slot")],
        loc="lower right",
        bbox_to_anchor=(1.0, 1.0),
        fontsize=8,
        frameon=False,
        borderaxespad=0.1,
    )


def _steps_title(series: TimeSeries) -> str:
    n = len(series.steps_by_slot)
    if n == 1:
        return "draft steps (one slot: the policy answers every batch size alike)"
    return f"draft steps per batch-size slot (the {n} slots the policy decides for)"


def _save(fig: Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def plot_series(
    name: str,
    series: TimeSeries,
    path: Path,
    *,
    slo_tpot_ms: float | None = None,
    context: str = "",
) -> Path:
    """Load, steps per slot, throughput and TPOT over time for one policy."""
    return _save(series_figure(name, series, slo_tpot_ms=slo_tpot_ms, context=context), path)


def series_figure(
    name: str, series: TimeSeries, *, slo_tpot_ms: float | None = None, context: str = ""
) -> Figure:
    """The figure of :func:`plot_series` (the caller saves or closes it)."""
    fig, axes = plt.subplots(
        4, 1, figsize=(11, 11), sharex=True, gridspec_kw={"height_ratios": [1, 1.2, 1, 1]}
    )
    t = series.time_s
    # Running and the mean decode batch nearly coincide: running is an area, the batch a
    # thin dark line over it, so neither hides the other.
    axes[0].fill_between(t, series.running_requests, lw=0, alpha=0.35, label="running")
    axes[0].plot(t, series.mean_batch_size, lw=0.7, color="black", label="mean decode batch")
    axes[0].plot(t, series.queued_requests, lw=1.0, color="tab:orange", label="queued")
    axes[0].set_ylabel("requests")
    axes[0].set_title("load", loc="left", fontsize=10)
    _from_zero(axes[0], [*series.running_requests, *series.queued_requests])
    axes[0].legend(loc="upper right", fontsize=8)
    _steps_heatmap(axes[1], series, fig)
    axes[1].set_title(_steps_title(series), loc="left", fontsize=10)
    axes[2].plot(t, series.output_tok_s, lw=0.9)
    axes[2].set_ylabel("output tok/s\n(per simulated s)")
    axes[2].set_title("throughput", loc="left", fontsize=10)
    _from_zero(axes[2], series.output_tok_s)
    axes[3].plot(t, series.mean_tpot_ms, lw=0.9, label="mean TPOT of requests finished")
    axes[3].set_ylabel("TPOT (ms)")
    axes[3].set_title("time per output token", loc="left", fontsize=10)
    _slo_line(axes[3], slo_tpot_ms, series.mean_tpot_ms)
    axes[3].legend(loc="upper right", fontsize=8)
    axes[3].set_xlabel(TIME_LABEL)
    for ax in axes[[0, 2, 3]]:
        ax.grid(alpha=0.3)
    fig.suptitle(_title(name, context), fontsize=12)
    # The heatmap's colourbar narrows its panel; keep every x axis the same width.
    fig.tight_layout()
    left, right = axes[1].get_position().x0, axes[1].get_position().x1
    for ax in axes[[0, 2, 3]]:
        box = ax.get_position()
        ax.set_position((left, box.y0, right - left, box.height))
    return fig


def _same(a: Sequence[float], b: Sequence[float]) -> bool:
    return len(a) == len(b) and bool(
        np.array_equal(np.asarray(a, dtype=float), np.asarray(b, dtype=float), equal_nan=True)
    )


def _moving_mean(t: Sequence[float], values: Sequence[float], window_s: float) -> np.ndarray:
    """Centred moving mean over about ``window_s`` (NaNs ignored; all-NaN stays NaN)."""
    v = np.asarray(values, dtype=np.float64)
    if v.size < 2:
        return v
    step = float(np.median(np.diff(np.asarray(t, dtype=np.float64))))
    n = max(1, round(window_s / step)) if step > 0 else 1
    if n == 1:
        return v
    kernel = np.ones(n)
    ok = np.isfinite(v)
    sums = np.convolve(np.where(ok, v, 0.0), kernel, mode="same")
    counts = np.convolve(ok.astype(np.float64), kernel, mode="same")
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(counts > 0, sums / counts, np.nan)


def plot_comparison(
    runs: Sequence[tuple[str, TimeSeries]],
    path: Path,
    *,
    slo_tpot_ms: float | None = None,
    context: str = "",
) -> Path:
    """Throughput, TPOT (with the SLO) and queue of every policy on shared axes."""
    return _save(comparison_figure(runs, slo_tpot_ms=slo_tpot_ms, context=context), path)


def comparison_figure(
    runs: Sequence[tuple[str, TimeSeries]],
    *,
    slo_tpot_ms: float | None = None,
    context: str = "",
) -> Figure:
    """The figure of :func:`plot_comparison` (the caller saves or closes it)."""
    fig, axes = plt.subplots(3, 1, figsize=(11, 9), sharex=True)
    tpot_all: list[float] = []
    tput_all: list[float] = []
    for i, (name, series) in enumerate(runs):
        twin = next(
            (
                other
                for other, s in runs[:i]
                if _same(s.output_tok_s, series.output_tok_s)
                and _same(s.mean_tpot_ms, series.mean_tpot_ms)
                and _same(s.queued_requests, series.queued_requests)
            ),
            None,
        )
        label = name if twin is None else f"{name} (identical to {twin})"
        # A twin is drawn dashed and wider on top, so both stay visible.
        ls: Any = "-" if twin is None else (0, (4, 3))
        lw = 1.0 if twin is None else 1.8
        t = series.time_s
        tput = _moving_mean(t, series.output_tok_s, SMOOTH_S)
        tpot = _moving_mean(t, series.mean_tpot_ms, SMOOTH_S)
        axes[0].plot(t, tput, lw=lw, ls=ls, label=label)
        axes[1].plot(t, tpot, lw=lw, ls=ls, label=label)
        axes[2].plot(t, series.queued_requests, lw=lw, ls=ls, label=label)
        tput_all.extend(tput.tolist())
        tpot_all.extend(tpot.tolist())
    axes[0].set_ylabel("output tok/s\n(per simulated s)")
    axes[0].set_title(f"throughput ({SMOOTH_S:g} s moving mean)", loc="left", fontsize=10)
    _from_zero(axes[0], tput_all)
    axes[1].set_ylabel("TPOT (ms)")
    axes[1].set_title(
        f"mean TPOT of requests finished ({SMOOTH_S:g} s moving mean)", loc="left", fontsize=10
    )
    _slo_line(axes[1], slo_tpot_ms, tpot_all)
    axes[2].set_ylabel("requests")
    axes[2].set_title("queued requests (overload shows here first)", loc="left", fontsize=10)
    _from_zero(axes[2], [v for _, s in runs for v in s.queued_requests])
    axes[2].set_xlabel(TIME_LABEL)
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(loc="upper left", fontsize=8)
    fig.suptitle(_title("policies compared", context), fontsize=12)
    fig.tight_layout()
    return fig


def write_plots(
    runs: Sequence[tuple[str, TimeSeries]],
    out_dir: Path,
    *,
    slo_tpot_ms: float | None = None,
    context: str = "",
) -> list[Path]:
    """One PNG per policy plus a comparison; returns the files written."""
    paths = [
        plot_series(
            name, s, out_dir / f"{_safe(name)}.png", slo_tpot_ms=slo_tpot_ms, context=context
        )
        for name, s in runs
    ]
    paths.append(
        plot_comparison(runs, out_dir / "comparison.png", slo_tpot_ms=slo_tpot_ms, context=context)
    )
    return paths
