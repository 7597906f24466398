"""What part of a trace a plan sized for: its rate, and the peak its busiest minute holds.

``plan sweep`` sizes replicas from the highest mean rate one replica sustains over the
trace window it replays; ``plan fleet`` replays the trace scaled to a mean rate. Two
plans of one file agree only when they plan for the same window: a window with a higher
peak-to-mean ratio needs more replicas for the same mean. Both print ``trace_load_text``
so the difference is on screen.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from specgov.simulator.workload.traces import Trace

__all__ = ["PEAK_WINDOW_S", "base_rps", "trace_load", "trace_load_text"]

PEAK_WINDOW_S = 60.0  # the busiest minute: long enough for queues to build


def base_rps(trace: Trace) -> float:
    """The trace's request rate: requests over the arrival span (one request: 1/s)."""
    n = len(trace.requests)
    return n / trace.duration_s if trace.duration_s > 0 else float(n)


def trace_load(trace: Trace) -> dict[str, Any]:
    """What part of a trace a plan sized for, for the screen: its source (file and window
    or other transformations), span, mean rate and peak rate (the busiest
    ``PEAK_WINDOW_S`` seconds). Two plans of one file differ when these differ: replicas
    follow the peak a window holds, not only its mean."""
    arrivals = np.fromiter((r.arrival_s for r in trace.requests), dtype=np.float64)
    n = int(arrivals.size)
    ends = np.searchsorted(arrivals, arrivals + PEAK_WINDOW_S, side="left")
    busiest = int((ends - np.arange(n)).max()) if n else 0
    span = min(PEAK_WINDOW_S, trace.duration_s) if trace.duration_s > 0 else 1.0
    return {
        "source": trace.source,
        "duration_s": trace.duration_s,
        "mean_rps": base_rps(trace),
        "peak_rps": busiest / span,
        "peak_window_s": PEAK_WINDOW_S,
    }


def trace_load_text(load: dict[str, Any], target_rps: float | None = None) -> str:
    """``trace_load`` as the one line both plans print; with *target_rps*, the peak that
    rate brings when the trace is scaled to it (what the replicas are sized for)."""
    text = (
        f"planned for {load['source']}: {load['duration_s']:.0f} s, mean "
        f"{load['mean_rps']:.2f} req/s, peak {load['peak_rps']:.2f} req/s (busiest "
        f"{load['peak_window_s']:g} s)"
    )
    if target_rps is not None and load["mean_rps"] > 0:
        ratio = load["peak_rps"] / load["mean_rps"]
        text += (
            f"; peak/mean {ratio:.2f}, so {target_rps:g} req/s on average peaks at "
            f"{target_rps * ratio:.1f} req/s"
        )
    return text
