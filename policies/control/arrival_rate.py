"""The fleet's arrival rate, from what each replica reports: the fleet governor's load
under ``--load arrival-rate``.

Pure (no IO, no clock: the caller passes the readings and the time). Requests are
conserved: what arrived at a replica since the last reading either finished
(SGLang's ``sglang:num_requests_total`` counter) or is still in flight (running and
waiting, ``/v1/loads``), so arrivals = finished + the change in flight, with no lag of a
request's duration (a rate of finishes alone trails a rising load by that long). A
replica's counter that went down was restarted: what it counts since is new, and what it
had in flight was lost (counted once, when it arrived). A replica that did not answer
this time is left out of the step and read again next time (its arrivals then count in
that step). A step may be negative (the two counts are read at slightly different
times); the sum over a window telescopes to what arrived.

:meth:`ArrivalMeter.rate` is the arrivals over the last ``window_s`` divided by the time
they cover: a rate of a Poisson stream read over a few seconds is noise, one over a
minute is a level.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

from specgov.policies.common.errors import SpecgovError


class ArrivalRateError(SpecgovError, ValueError):
    """A reading or window the meter cannot use."""


@dataclass(frozen=True)
class ReplicaCount:
    """One replica's reading: requests finished since it started, requests in flight."""

    finished: float
    in_flight: float

    def __post_init__(self) -> None:
        for name, v in (("finished", self.finished), ("in_flight", self.in_flight)):
            if not math.isfinite(v) or v < 0:
                raise ArrivalRateError(f"{name} must be a finite count >= 0, got {v}")


class ArrivalMeter:
    """Each replica's cumulative arrivals and their rate over ``window_s``; the fleet's
    rate is the sum (module docstring)."""

    def __init__(self, window_s: float) -> None:
        if not math.isfinite(window_s) or window_s <= 0:
            raise ArrivalRateError(f"window_s must be > 0, got {window_s}")
        self.window_s = float(window_s)
        self._last: dict[str, ReplicaCount] = {}
        self._history: dict[str, deque[tuple[float, float]]] = {}
        self._now = -math.inf
        self._arrived = 0.0

    @property
    def arrived(self) -> float:
        """Arrivals counted since each replica's first reading, summed."""
        return self._arrived

    def update(self, at_s: float, readings: Mapping[str, ReplicaCount]) -> None:
        """Count the arrivals since the last reading of each replica in ``readings``."""
        if not math.isfinite(at_s):
            raise ArrivalRateError(f"at_s must be finite, got {at_s}")
        if at_s < self._now:
            raise ArrivalRateError("readings must be in time order")
        self._now = at_s
        for name, now in readings.items():
            history = self._history.setdefault(name, deque())
            before = self._last.get(name)
            step = _arrivals(before, now)
            self._arrived += step
            history.append((at_s, history[-1][1] + step if history else 0.0))
            self._last[name] = now
            # Keep one reading at or before the window's start: the rate spans the window.
            while len(history) > 2 and history[1][0] <= at_s - self.window_s:
                history.popleft()

    def rate(self) -> float | None:
        """Arrivals per second over the last ``window_s``, summed over the replicas, each
        over its own readings; None (unknown, not zero) when a replica's readings span
        less than the window (a rate over a few seconds is noise) or it has none within
        the window."""
        if not self._history:
            return None
        total = 0.0
        for history in self._history.values():
            (t0, a0), (t1, a1) = history[0], history[-1]
            if t1 - t0 < self.window_s or t1 < self._now - self.window_s:
                return None
            total += (a1 - a0) / (t1 - t0)
        return max(0.0, total)


def _arrivals(before: ReplicaCount | None, now: ReplicaCount) -> float:
    """Arrivals at one replica between two readings (module docstring)."""
    if before is None:
        return 0.0
    if now.finished < before.finished:  # restarted: its counts start again
        return now.finished + now.in_flight
    return now.finished - before.finished + now.in_flight - before.in_flight
