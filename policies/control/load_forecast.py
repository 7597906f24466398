"""The fleet governor's load forecast: the load a move must meet when it is done.

Pure (no IO, no clock: the caller passes the samples and the time). A move takes a
replica out for its drain and restart (the model load and CUDA graph capture of SGLang's
start-up), so the governor plans for the load at the end of that time, not the load now.
The forecast is a least-squares line through the recent samples (requests in flight
across the fleet) of the last ``window_s``, projected ``horizon_s`` ahead: a ramp is met
before it arrives. Its level now is the line's value at the last sample (the samples'
noise averaged out); the projection is clipped at 0, and it reaches no further ahead than
the samples it was fitted on reach back (``span_s``): a line through a few seconds of a
fleet filling up from empty is not a trend for minutes, and a horizon longer than the
window is projected over the window only (give a window at least the horizon). With fewer
than ``MIN_SAMPLES`` samples, or all at one instant, there is no trend: the forecast is the
last sample. :meth:`LoadForecast.at` projects the same line over another horizon (the mix
decision asks for one move's and for a whole switch's).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Final

from specgov.policies.common.errors import SpecgovError

MIN_SAMPLES: Final = 3


class LoadForecastError(SpecgovError, ValueError):
    """Samples or a horizon the forecast cannot use."""


@dataclass(frozen=True)
class LoadSample:
    at_s: float
    load_requests: float


@dataclass(frozen=True)
class LoadForecast:
    """``now``: the load at the last sample; ``projected``: at ``horizon_s`` later;
    ``trend_per_s``: requests in flight per second (0 without a trend); ``span_s``: the
    time the fitted samples cover, the furthest the line is projected."""

    now: float
    projected: float
    trend_per_s: float
    horizon_s: float
    samples: int
    span_s: float = 0.0

    def at(self, horizon_s: float) -> float:
        """The line's load ``horizon_s`` (at most ``span_s``) after the last sample,
        clipped at 0."""
        if not math.isfinite(horizon_s) or horizon_s < 0:
            raise LoadForecastError(f"horizon_s must be >= 0, got {horizon_s}")
        return max(0.0, self.now + self.trend_per_s * min(horizon_s, self.span_s))

    def describe(self) -> str:
        return (
            f"load {self.now:.0f} now, forecast {self.projected:.0f} in {self.horizon_s:.0f} s "
            f"({self.trend_per_s:+.2f}/s over {self.samples} samples, {self.span_s:.0f} s)"
        )


def _check(samples: Sequence[LoadSample], horizon_s: float, window_s: float) -> None:
    if not math.isfinite(horizon_s) or horizon_s < 0:
        raise LoadForecastError(f"horizon_s must be >= 0, got {horizon_s}")
    if not math.isfinite(window_s) or window_s <= 0:
        raise LoadForecastError(f"window_s must be > 0, got {window_s}")
    for i, s in enumerate(samples):
        if not (math.isfinite(s.at_s) and math.isfinite(s.load_requests)) or s.load_requests < 0:
            raise LoadForecastError(f"sample {i}: expected a finite time and a load >= 0, got {s}")
        if i and s.at_s < samples[i - 1].at_s:
            raise LoadForecastError(f"sample {i}: samples must be in time order")


def forecast_load(
    samples: Sequence[LoadSample], *, horizon_s: float, window_s: float
) -> LoadForecast | None:
    """The load ``horizon_s`` after the last sample (module docstring); None: no samples."""
    _check(samples, horizon_s, window_s)
    if not samples:
        return None
    last = samples[-1]
    recent = [s for s in samples if s.at_s >= last.at_s - window_s]
    n = len(recent)
    mean_t = sum(s.at_s for s in recent) / n
    mean_y = sum(s.load_requests for s in recent) / n
    var_t = sum((s.at_s - mean_t) ** 2 for s in recent)
    if n < MIN_SAMPLES or var_t <= 0:
        return LoadForecast(last.load_requests, last.load_requests, 0.0, horizon_s, n)
    slope = sum((s.at_s - mean_t) * (s.load_requests - mean_y) for s in recent) / var_t
    now = max(0.0, mean_y + slope * (last.at_s - mean_t))
    line = LoadForecast(now, now, slope, horizon_s, n, last.at_s - recent[0].at_s)
    return replace(line, projected=line.at(horizon_s))
