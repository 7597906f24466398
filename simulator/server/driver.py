"""Accelerated real time: the simulated engine on its own thread, paced to the wall clock.

Time. ``speed`` X means X simulated seconds per wall second. The engine runs in its own
thread (:class:`Generation`); its ``on_tick`` hook (about every :data:`TICK_WALL_S` of
wall time) sleeps so that simulated time never runs ahead of ``wall_of(sim)``, the
linear map from simulated to wall-clock epoch time fixed at start (:class:`RealTime`).
If the engine cannot keep up (a CPU-bound replay at a high speed), the map is shifted
forward at the next tick (``lag_resyncs`` counts it), so timestamps always stay close to
the wall clock. What each consumer gets:

* Timestamps the daemon compares with its own clock are wall-clock epoch seconds: the
  plugin's clock (so ``StepTable.produced_at_s + ttl_s`` is judged against the same
  clock the daemon stamped it with, and TTL expiry happens in real seconds), the tier
  statistics windows, ``/v1/loads`` timestamps.
* Durations are simulated seconds: the latency histograms, the ``gen_throughput``
  gauge, and the tier statistics' ``step_time_sum_s`` (the plugin measures a step on
  its wall-mapped clock, i.e. ``sim_dt / speed``; the stats writer multiplies by
  ``speed`` back before writing). A cost model learned from them is the simulated
  GPU's, and SLOs in milliseconds mean what they say.
* Counters advance X times faster per wall second than the simulated rate, so a rate
  a daemon derives from two scrapes over its own (wall) clock is X times the simulated
  one. At speed 1 every view agrees. (Step times in the statistics lose a little
  precision at very high speeds: the plugin subtracts epoch-sized floats, resolution
  ~0.2 µs of wall time, i.e. ``0.2 µs × speed`` simulated.)

The trace (:class:`TraceFeed`) is handed to the engine in arrival order; when it ends
the engine idles, or with ``loop`` the trace starts again one mean inter-arrival gap
later.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Final

from specgov.adapters.sglang_plugin import SpecgovAdaptiveParams
from specgov.adapters.spool_stats import BackgroundStatsWriter
from specgov.policies.common.errors import SpecgovError
from specgov.simulator.engine.interface import EngineResult
from specgov.simulator.replay.runner import PreparedRun
from specgov.simulator.server import endpoints as ep
from specgov.simulator.server.served_metrics import ServedMetrics
from specgov.simulator.workload.traces import Request

if TYPE_CHECKING:
    from specgov.simulator.server.live import LiveFeed

logger = logging.getLogger(__name__)

# Engine/wall synchronisation granularity and the lag beyond which the map is shifted.
TICK_WALL_S: Final = 0.02
MAX_LAG_S: Final = 0.5
# How long stopping waits for an engine thread.
ENGINE_JOIN_TIMEOUT_S: Final = 10.0


class Stopped(SpecgovError):
    """Raised from the engine's tick hook to end a run (stop or restart)."""


class RealTime:
    """``wall_of(sim) = anchor_wall + (sim - anchor_sim) / speed``, shifted forward
    when the engine falls behind by more than :data:`MAX_LAG_S`."""

    def __init__(self, speed: float, start_sim_s: float) -> None:
        self.speed = speed
        self.start_sim_s = start_sim_s
        self._anchor: tuple[float, float] = (time.time(), start_sim_s)
        # The simulated time served so far (across restarts).
        self.last_sim_s = start_sim_s
        self.tick_s = max(1e-4, TICK_WALL_S * speed)  # simulated seconds per tick
        self.lag_resyncs = 0
        self.lag_total_s = 0.0

    def anchor_now(self) -> None:
        """Start simulated time ``start_sim_s`` now."""
        self._anchor = (time.time(), self._anchor[1])

    def wall_of(self, sim_s: float) -> float:
        """Wall-clock epoch seconds at which simulated time ``sim_s`` is (was) served."""
        wall0, sim0 = self._anchor
        return wall0 + (sim_s - sim0) / self.speed

    def sim_of(self, wall_s: float) -> float:
        """Simulated time served at wall-clock epoch ``wall_s``."""
        wall0, sim0 = self._anchor
        return sim0 + (wall_s - wall0) * self.speed

    def pace(self, sim_s: float, stop_event: threading.Event) -> None:
        """Hold the caller until the wall clock reaches ``wall_of(sim_s)``; raises
        :class:`Stopped` if ``stop_event`` is set meanwhile."""
        delay = self.wall_of(sim_s) - time.time()
        if delay > 0:
            if stop_event.wait(delay):
                raise Stopped
        elif delay < -MAX_LAG_S:
            # Behind: re-anchor so timestamps stay close to the wall clock.
            self.lag_resyncs += 1
            self.lag_total_s += -delay
            wall0, sim0 = self._anchor
            self._anchor = (wall0 - delay, sim0)


class TraceFeed:
    """The trace's requests, handed out once each on the simulated timeline (loop after
    loop with ``loop``). ``requests`` must be sorted by arrival."""

    def __init__(self, requests: tuple[Request, ...], *, loop: bool) -> None:
        self.requests = requests
        self.loop = loop
        self._arrivals = [r.arrival_s for r in requests]
        if requests:
            duration = requests[-1].arrival_s - requests[0].arrival_s
            gap = duration / (len(requests) - 1) if len(requests) > 1 else 1.0
            # One loop of the trace, plus the mean inter-arrival gap before the next.
            self._period_s = duration + max(gap, 1e-3)
        else:
            self._period_s = 1.0
        self.loop_index = 0
        self._loop_offset_s = 0.0
        self._next_index = 0

    @property
    def first_arrival_s(self) -> float:
        return self._arrivals[0] if self._arrivals else 0.0

    def rewind(self) -> None:
        """Forget what was handed out: after a restart, requests in flight died with the
        old server, and those arriving from now on reach the new one."""
        self._next_index = 0

    def take(self, t_sim: float) -> list[Request]:
        """Requests of the current loop arriving at or after ``t_sim`` not yet handed to
        an engine, shifted onto the simulated timeline; the next loop when exhausted."""
        reqs = self.requests
        n = len(reqs)
        if n == 0:
            return []
        offset = self._loop_offset_s
        i = max(self._next_index, bisect.bisect_left(self._arrivals, t_sim - offset))
        if i >= n:
            if not self.loop:
                self._next_index = n
                return []
            self.loop_index += 1
            offset = max(offset + self._period_s, t_sim - self._arrivals[0])
            self._loop_offset_s = offset
            i = 0
        self._next_index = n
        if offset == 0.0:
            return list(reqs[i:])
        return [dataclasses.replace(r, arrival_s=r.arrival_s + offset) for r in reqs[i:]]


def _copy_counts(counts: Mapping[str, int]) -> dict[str, int]:
    # Read from another thread than the one that updates it: retry a torn iteration.
    for _ in range(5):
        with contextlib.suppress(RuntimeError):
            return dict(counts)
    return {}


class Generation:
    """One (re)start of the simulated server: engine, policy, metrics, stats writer,
    and the engine thread that runs the trace in real time."""

    def __init__(
        self,
        index: int,
        prepared: PreparedRun,
        metrics: ServedMetrics,
        plugin: SpecgovAdaptiveParams | None,
        writer: BackgroundStatsWriter | None,
    ) -> None:
        self.index = index
        self.prepared = prepared
        self.engine = prepared.engine
        self.metrics = metrics
        self.plugin = plugin
        self.writer = writer
        self.launch: ep.LaunchInfo | None = None
        self.stop_event = threading.Event()
        self.thread: threading.Thread | None = None
        self.status = "starting"  # starting | up | finished | stopped | failed
        self.error: str | None = None
        self.tick_forwards = -1
        self.results: list[EngineResult] = []
        # The requests clients send (sim_generate_routes), set by the server before start.
        self.live: LiveFeed | None = None

    def plugin_state(self) -> dict[str, Any] | None:
        plugin = self.plugin
        if plugin is None:
            return None
        policy = plugin.policy
        table = plugin.table
        reader = plugin.reader
        writer = self.writer
        return {
            "mode": plugin.mode,
            "disabled_reason": plugin.disabled_reason,
            "table": None if table is None else table.to_dict(),
            "fallback_reason": None if policy is None else policy.fallback_reason,
            "fallback_batches": {} if policy is None else _copy_counts(policy.fallback_reasons),
            "errors": plugin.errors + (0 if policy is None else policy.errors),
            "last_error": plugin.last_error or (None if policy is None else policy.last_error),
            "spool_ignored": {} if reader is None else _copy_counts(reader.ignored),
            "stats_windows": 0 if policy is None else policy.flushes,
            "stats_written": 0 if writer is None else writer.written,
            "stats_dropped": 0 if writer is None else writer.dropped,
        }

    def start(self, feed: TraceFeed, clock: RealTime) -> None:
        """Run the engine on its own thread, fed from ``feed``, paced by ``clock``."""
        self.status = "up"
        thread = threading.Thread(
            target=self._run,
            args=(feed, clock),
            name=f"specgov-sim-engine-{self.index}",
            daemon=True,
        )
        self.thread = thread
        thread.start()

    def stop(self) -> None:
        """End the run (in-flight requests are lost) and flush the last statistics."""
        self.stop_event.set()
        thread = self.thread
        if thread is not None:
            thread.join(ENGINE_JOIN_TIMEOUT_S)
            if thread.is_alive():
                logger.error("specgov sim-server: engine thread %d did not stop", self.index)
        elif self.status == "starting":
            self.status = "stopped"
            self._flush()

    def _run(self, feed: TraceFeed, clock: RealTime) -> None:
        def tick(now_sim: float) -> None:
            self._on_tick(clock, now_sim)

        try:
            t = clock.start_sim_s
            if self.index:  # a restarted server continues at the current simulated time
                t = max(clock.sim_of(time.time()), clock.last_sim_s)
            live = self.live
            while not self.stop_event.is_set():
                reqs = feed.take(t)
                if not reqs:
                    break
                # With clients the engine starts at once (they may arrive before the
                # trace's next request) and waits for arrivals itself.
                start = t if live is not None else None
                first = reqs[0].arrival_s
                if start is not None:
                    first = start = min(first, t)
                elif first > t:
                    self.metrics.mark_idle(t)
                    clock.pace(first, self.stop_event)
                self.engine.clock.now_s = first
                result = self.engine.run(
                    reqs,
                    metrics=self.metrics,
                    on_tick=tick,
                    tick_interval_s=clock.tick_s,
                    live=live,
                    start_s=start,
                )
                self.results.append(result)
                t = result.end_s
                clock.last_sim_s = t
            self.metrics.mark_idle(t)
            self.status = "finished"
            if live is not None and not self.stop_event.is_set():
                # The trace is served; the engine keeps serving clients until stopped.
                live.keep_waiting = True
                self.engine.clock.now_s = t
                self.engine.run(
                    [],
                    metrics=self.metrics,
                    on_tick=tick,
                    tick_interval_s=clock.tick_s,
                    live=live,
                    start_s=t,
                )
        except Stopped:
            self.status = "stopped"
        except Exception as exc:
            self.status = "failed"
            self.error = f"{type(exc).__name__}: {exc}"
            logger.exception("specgov sim-server: the simulated engine failed")
        finally:
            self._flush()

    def _flush(self) -> None:
        if self.live is not None:
            self.live.close(f"the simulated server stopped ({self.status})")
        plugin = self.plugin
        if plugin is not None and plugin.policy is not None:
            plugin.policy.flush()  # the last window, on the engine's own thread
        if self.writer is not None and not self.writer.close():
            logger.warning("specgov sim-server: statistics writer did not finish in time")

    def _on_tick(self, clock: RealTime, now_sim: float) -> None:
        if self.stop_event.is_set():
            raise Stopped
        clock.last_sim_s = now_sim
        metrics = self.metrics
        if metrics.forwards == self.tick_forwards:
            # Two ticks without a forward: the engine is jumping over an idle gap.
            metrics.mark_idle(now_sim)
        self.tick_forwards = metrics.forwards
        clock.pace(now_sim, self.stop_event)
