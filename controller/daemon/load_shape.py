"""The restart check's load shape: a window's arrivals as a bounded number of regimes.

The daemon never sees request timestamps, only what /metrics says at each scrape: the
requests finished since the last one (``sglang:num_requests_total``) and the requests in
the server (running + queued). What arrived in an interval is what finished in it plus
the change in what the server holds, so a window's arrival rate per interval is known
from the scrapes alone (``arrival_segments``). The intervals are cut into regimes where the
rate changes by more than Poisson noise explains (:func:`merge_segments`), at most
``MAX_SEGMENTS``, so a long window costs a bounded summary and a bounded replay.

Measured why (close27): the check replayed every window as steady Poisson arrivals at
its mean rate. On the phase trace (6.0, 16.8 and 3.8 req/s regimes) that read plain's
gain as +30 % where replaying plain gained +60 %; on the bursty Azure code trace (up to
253 requests queued) it replayed 87 % SLO attainment against the run's 4-5 % and stayed
silent where plain gained +20 %.

``replay_ramp`` turns the regimes into the synthetic trace's rate multipliers (a step
function over the replayed horizon; simulator/workload/synthetic.py draws an exact
non-homogeneous Poisson process from them).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

# At most this many regimes summarise a window (the summary and the replay stay bounded).
MAX_SEGMENTS = 32
# A split must gain this many times log(intervals) in log-likelihood (BIC's price of a
# change point and a rate; assumed, not tuned).
PENALTY = 1.0
# A step in the replay's rate multiplier rises over this long (ramp points must increase).
STEP_S = 1e-3

# (duration_s, arrival rate in requests/s) of one regime, in window order.
Segment = tuple[float, float]


def arrival_segments(
    points: Sequence[tuple[float, float | None, int | None]],
    max_segments: int = MAX_SEGMENTS,
) -> tuple[Segment, ...]:
    """The window's arrival regimes from its scrapes in order, each (time_s, requests
    finished per second since the scrape before, requests in the server then): per
    interval, arrivals = finished + the change in requests held (never below 0); then
    adjacent intervals merge (duration-weighted, :func:`merge_segments`) until at most
    *max_segments* are left. Intervals with an unknown count are left out. Empty when
    fewer than two scrapes are known."""
    if max_segments < 1:
        raise ValueError(f"max_segments must be >= 1, got {max_segments!r}")
    segments: list[Segment] = []
    for (t0, _, held0), (t1, finished_rps, held1) in itertools.pairwise(points):
        dt = t1 - t0
        if dt <= 0 or finished_rps is None or held0 is None or held1 is None:
            continue
        arrived = max(finished_rps * dt + (held1 - held0), 0.0)
        segments.append((dt, arrived / dt))
    return merge_segments(segments, max_segments)


def merge_segments(segments: Sequence[Segment], max_segments: int) -> tuple[Segment, ...]:
    """*segments* (intervals in window order) as at most *max_segments* regimes of one
    Poisson rate each, by binary segmentation: starting from the whole window as one
    regime, the regime whose best split gains the most log-likelihood is split there,
    while that gain exceeds ``PENALTY x log(intervals)`` (BIC's price of a change point
    and a rate). A steady window stays one regime; equal neighbours are never split.

    Why not merge the closest neighbours (measured, phase/h100/ngram): kept apart down to
    32, the 5-second intervals of a steady regime keep their Poisson noise (peaks of 22-25
    req/s in a 16.8 req/s regime), and replaying them as Poisson again adds burstiness the
    window did not have; a steady Poisson hour stayed 31 regimes."""
    if not segments:
        return ()
    durations = [d for d, _ in segments]
    counts = [d * r for d, r in segments]
    cum_d = list(itertools.accumulate(durations, initial=0.0))
    cum_n = list(itertools.accumulate(counts, initial=0.0))
    threshold = PENALTY * math.log(max(len(segments), 2))
    cuts = [0, len(segments)]
    while len(cuts) - 1 < max_segments:
        best = max(
            (_best_split(cum_d, cum_n, lo, hi) for lo, hi in itertools.pairwise(cuts)),
            key=lambda g: g[0],
        )
        if best[0] <= threshold:
            break
        cuts = sorted((*cuts, best[1]))
    return tuple(
        (cum_d[hi] - cum_d[lo], (cum_n[hi] - cum_n[lo]) / (cum_d[hi] - cum_d[lo]))
        for lo, hi in itertools.pairwise(cuts)
    )


def _log_likelihood(count: float, duration: float) -> float:
    """A Poisson count's log-likelihood at its own rate (constants dropped)."""
    return count * math.log(count / duration) - count if count > 0 else 0.0


def _best_split(
    cum_d: Sequence[float], cum_n: Sequence[float], lo: int, hi: int
) -> tuple[float, int]:
    """(log-likelihood gained, where) by the best split of intervals [lo, hi)."""
    whole = _log_likelihood(cum_n[hi] - cum_n[lo], cum_d[hi] - cum_d[lo])
    best = (0.0, lo)
    for k in range(lo + 1, hi):
        gain = (
            _log_likelihood(cum_n[k] - cum_n[lo], cum_d[k] - cum_d[lo])
            + _log_likelihood(cum_n[hi] - cum_n[k], cum_d[hi] - cum_d[k])
            - whole
        )
        if gain > best[0]:
            best = (gain, k)
    return best


def replay_ramp(
    segments: Sequence[Segment], horizon_s: float
) -> tuple[tuple[float, float], ...] | None:
    """The ``SyntheticSpec.ramp`` that replays *segments* over *horizon_s* seconds (their
    durations scaled to it) at the window's mean rate: (time_s, multiplier) points of a
    step function whose multipliers average 1 (the spec's rate_rps stays the mean).
    None for fewer than two segments or no arrivals (a steady window: no ramp)."""
    total = sum(d for d, _ in segments)
    arrived = sum(d * r for d, r in segments)
    if len(segments) < 2 or total <= 0 or arrived <= 0 or horizon_s <= 0:
        return None
    mean = arrived / total
    scale = horizon_s / total
    points: list[tuple[float, float]] = []
    start = 0.0
    for duration, rate in segments:
        end = start + duration * scale
        multiplier = rate / mean
        for at in (start + (STEP_S if points else 0.0), min(end, horizon_s)):
            if not points or at > points[-1][0]:  # ramp times must increase
                points.append((at, multiplier))
        start = end
    return tuple(points)
