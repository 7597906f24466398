"""The daemon's telemetry: scrape SGLang (metrics, server info, loads) into an
Observation, read the plugin's statistics from the spool, and keep the recent counter
totals the restart loop summarises.

Never raises for server trouble: every failure is recorded (status, metric, one
throttled log line per burst) and the round answers None; temporary errors keep the
last table alive for its TTL, permanent ones stop acting (controller/daemon/runtime.py).
"""

from __future__ import annotations

import logging
import random
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from specgov.adapters.errors import (
    PermanentScrapeError,
    ResponseFormatError,
    ScrapeError,
    TemporaryScrapeError,
    escape_upstream,
)
from specgov.adapters.log_throttle import LogThrottle
from specgov.adapters.observation_builder import ObservationBuilder, decision_window_s
from specgov.adapters.sglang_http import SGLangClient
from specgov.adapters.spool_stats import read_tier_stats
from specgov.controller.daemon.config import SpecgovConfig
from specgov.controller.daemon.health import FailureClock
from specgov.controller.daemon.own_metrics import DaemonMetrics
from specgov.controller.daemon.status_view import DaemonStatus
from specgov.policies.common.observation import Observation
from specgov.policies.common.types import TierStatsSnapshot

log = logging.getLogger("specgov.daemon")

SERVER_INFO_REFRESH_S = 30.0
# Wall time and monotonic time between two scrapes differing by more than this is a
# clock step (NTP slews far less; its steps are larger).
CLOCK_STEP_TOLERANCE_S = 1.0
_NONFINITE = re.compile(r"\b(?:nan|[+-]?inf)\b", re.IGNORECASE)


class _ScrapeTotals(NamedTuple):
    """One scrape's counters and gauges, as the restart loop's window reads them."""

    at_s: float
    requests: float
    prompt_tokens: float
    generated_tokens: float
    running: int | None
    queued: int | None
    accept_length: float | None
    spec_steps: int | None
    tpot_p50_ms: float | None  # the scrape window's TPOT p50


class Telemetry:
    """What the daemon knows of its server, refreshed by every scrape."""

    def __init__(
        self,
        config: Callable[[], SpecgovConfig],
        *,
        client: SGLangClient | None,
        clock: Callable[[], float],
        monotonic: Callable[[], float],
        metrics: DaemonMetrics,
        status_info: DaemonStatus,
        throttle: LogThrottle,
        failing: FailureClock,
    ) -> None:
        self._config = config  # the daemon's (a reload replaces it)
        self.http_client = client
        self._clock = clock
        self._monotonic = monotonic
        self._metrics = metrics
        self._status = status_info
        self._throttle = throttle
        self._failing = failing
        self._scrape_clocks: tuple[float, float] | None = None  # (wall, monotonic)
        self.last_scrape_mono_s: float | None = None
        # The decision window, from the intervals the daemon's loops run at: they read
        # them once, at start (Daemon.every), so a reload must not move the window alone.
        loop = config().loop
        self._window_s = decision_window_s(loop.decide_interval_s, loop.scrape_interval_s)
        self._builder = ObservationBuilder(min_window_s=self._window_s)
        self.observation: Observation | None = None
        self._stats_cursor: dict[str, int] | None = None
        self._stats_pending: list[TierStatsSnapshot] = []
        # Blind and clock-skew checks (controller/daemon/health.py), on the monotonic clock:
        # since when the server has been busy without plugin statistics arriving, and
        # how far ahead of ours the newest statistics' server clock was.
        self.busy_without_stats_mono_s: float | None = None
        self.server_clock_ahead_s: float | None = None
        self.server_info: dict[str, Any] | None = None
        self._server_info_at: float | None = None
        self._adaptive_config_path: str | None = None
        # One per scrape, for the restart loop's workload summary.
        self._totals: list[_ScrapeTotals] = []

    def take_stats(self) -> tuple[TierStatsSnapshot, ...]:
        """Read the plugin's new statistics from the spool; hand over all not taken yet."""
        self.read_stats()
        stats, self._stats_pending = tuple(self._stats_pending), []
        return stats

    def client(self) -> SGLangClient:
        if self.http_client is None:
            import os

            key = self._config().server.api_key(os.environ)
            self.http_client = SGLangClient(
                self._config().server.url,
                rng=random.Random(0x5EC60),
                api_key=key,
                timeout_s=self._config().server.timeout_s,
            )
        return self.http_client

    async def scrape_once(self) -> Observation | None:
        """One scrape round; never raises for server trouble (it is recorded)."""
        client = self.client()
        now = self._clock()
        self.notice_clock_step(now)
        try:
            scrape = await client.scrape_metrics()
            self._metrics.on_nonfinite_dropped(_nonfinite_dropped(scrape.snapshot))
            info = None
            if self._server_info_at is None or now - self._server_info_at > SERVER_INFO_REFRESH_S:
                info = await client.server_info()
                self.server_info, self._server_info_at = info, now
                self.load_adaptive_config(info)
            try:
                loads = await client.loads()
            except (PermanentScrapeError, ResponseFormatError):
                # Older servers have no /v1/loads, and a body that does not parse (now a
                # temporary "format" error) must not cost the round either: gauges suffice.
                loads = None
            obs = self._builder.feed(now, scrape.snapshot, info, loads)
            self.note_totals(now, scrape.snapshot, obs)
            report = self._builder.last_report
            if report is not None and report.restart_detected:
                # The server restarted: its shape may have changed, and the builder
                # dropped it. Fetch /server_info again on the next scrape, not in 30 s.
                self._server_info_at = None
        except PermanentScrapeError as exc:
            self._status.permanent_error = str(exc)
            self._status.scrape_errors += 1
            self._metrics.on_scrape_error("permanent")
            self._throttle.error(
                "scrape-permanent", f"permanent telemetry error, not acting: {exc}"
            )
            return None
        except ResponseFormatError as exc:
            # A malformed or truncated body (issue 9): temporary, so the last good table
            # stays alive as in an outage, but counted apart from one. The message is
            # already escaped and bounded (adapters/errors.py).
            self._status.last_scrape_error = f"malformed response: {exc}"
            self._status.scrape_errors += 1
            self._metrics.on_scrape_error(exc.kind)  # "format"
            self._throttle.warning("scrape-format", f"malformed telemetry (will retry): {exc}")
            return None
        except (TemporaryScrapeError, ScrapeError) as exc:
            self._status.last_scrape_error = str(exc)
            self._status.scrape_errors += 1
            self._metrics.on_scrape_error("temporary")
            self._throttle.warning("scrape-temporary", f"telemetry unavailable (will retry): {exc}")
            return None
        except ValueError as exc:  # a malformed value past the adapters' own checks
            detail = escape_upstream(exc)
            self._status.last_scrape_error = f"malformed response: {detail}"
            self._status.scrape_errors += 1
            self._metrics.on_scrape_error("format")
            self._throttle.warning("scrape-format", f"malformed telemetry: {detail}")
            return None
        if self._status.last_scrape_error or self._status.permanent_error:
            log.info("telemetry available again")
        for kind in ("scrape-permanent", "scrape-temporary", "scrape-format"):
            self._throttle.resolve(kind)
        self._status.permanent_error = None
        self._status.last_scrape_error = None
        self._status.last_scrape_s = now
        self.last_scrape_mono_s = self._monotonic()
        self.observation = obs
        busy = bool(obs.running_requests) or bool(obs.generation_tokens)
        if busy and self.busy_without_stats_mono_s is None:
            self.busy_without_stats_mono_s = self.last_scrape_mono_s
        return obs

    def notice_clock_step(self, now: float) -> None:
        """A wall-clock step (NTP) since the last scrape, told apart from elapsed time by
        the monotonic clock: a window across it means nothing (backwards the builder
        refuses it; forwards it dilutes every rate by the step), so windows start again."""
        mono = self._monotonic()
        last, self._scrape_clocks = self._scrape_clocks, (now, mono)
        if last is None:
            return
        step_s = (now - last[0]) - (mono - last[1])
        if abs(step_s) <= CLOCK_STEP_TOLERANCE_S:
            return
        self._throttle.warning(
            "clock-step",
            f"wall clock stepped {step_s:+.1f} s since the last scrape; "
            "telemetry windows start again",
        )
        self._builder.reset()
        self._totals.clear()
        self._server_info_at = None  # the builder forgot the server's shape

    def note_totals(self, now: float, snapshot: Any, obs: Observation | None = None) -> None:
        from specgov.adapters.prometheus_text import counter_by_dp

        def total(name: str) -> float | None:
            per_dp = counter_by_dp(snapshot, name)
            return sum(v.value for v in per_dp.values()) if per_dp else None

        values = (
            total("sglang:num_requests_total"),
            total("sglang:prompt_tokens_total"),
            total("sglang:generation_tokens_total"),
        )
        if any(v is None for v in values):
            return
        req, prompt, gen = (float(v) for v in values if v is not None)
        if self._totals and req < self._totals[-1].requests:
            self._totals.clear()  # counters went down: the server restarted
        self._totals.append(
            _ScrapeTotals(
                now,
                req,
                prompt,
                gen,
                None if obs is None else obs.running_requests,
                None if obs is None else obs.queued_requests,
                None if obs is None else obs.accept_length,
                None if obs is None else obs.spec_num_steps,
                None if obs is None or obs.tpot_ms is None else obs.tpot_ms.p50_ms,
            )
        )
        horizon = now - max(self._config().recommend.interval_s, 60.0)
        while len(self._totals) > 2 and self._totals[0].at_s < horizon:
            self._totals.pop(0)

    def workload_summary(self, since_s: float | None = None) -> Any:
        """The recent window for the restart loop (None until two scrapes apart); with
        *since_s*, only the scrapes from then on (a restart trigger's regime)."""
        from specgov.controller.daemon.load_shape import arrival_segments
        from specgov.controller.daemon.recommend import (
            WorkloadSummary,
            saturated_concurrency,
            window_table,
            window_tpot,
        )

        totals = [t for t in self._totals if since_s is None or t.at_s >= since_s]
        if len(totals) < 2:
            return None
        first, last = totals[0], totals[-1]
        requests = last.requests - first.requests
        window_s = last.at_s - first.at_s
        if window_s <= 0 or requests <= 0:
            return None
        obs = self.observation
        table, accept, steps = window_table(
            None if obs is None else obs.table,
            [t.running for t in totals if t.running is not None],
            [(t.accept_length, t.spec_steps) for t in totals],
            None if obs is None else obs.spec_num_steps,
        )
        return WorkloadSummary(
            window_s=window_s,
            request_rate_rps=requests / window_s,
            mean_input_tokens=(last.prompt_tokens - first.prompt_tokens) / requests,
            mean_output_tokens=(last.generated_tokens - first.generated_tokens) / requests,
            accept_length=accept,
            current_steps=steps,
            concurrency=saturated_concurrency([(t.running, t.queued) for t in totals]),
            # The table in force is the baseline (what a restart would give up).
            table=table,
            segments=arrival_segments(_arrival_points(totals)),
            tpot_p50_ms=window_tpot([t.tpot_p50_ms for t in totals]),
        )

    def load_adaptive_config(self, info: Mapping[str, Any]) -> None:
        """Read the server's --speculative-adaptive-config file (the slots and candidates
        a table must respect); the daemon runs beside the server and shares its volume."""
        path = info.get("speculative_adaptive_config")
        if not isinstance(path, str) or path == self._adaptive_config_path:
            return
        import json

        try:
            config = json.loads(Path(path).read_text())
            builder = ObservationBuilder(adaptive_config=config, min_window_s=self._window_s)
        except (OSError, ValueError) as exc:
            note = f"cannot use the adaptive config {path}: {exc}"
            if note not in self._status.notes:
                self._status.notes.append(note)
            self._throttle.warning("adaptive-config", note)
            return
        self._builder = builder
        self._adaptive_config_path = path

    def read_stats(self) -> None:
        spool = self._config().spool.dir
        if spool is None:
            return
        try:
            batch = read_tier_stats(spool, self._stats_cursor, group_gid=self._config().spool.group)
        except OSError as exc:
            self._status.spool_read_error = f"cannot read {spool}: {exc}"
            self._failing.update("spool-read", exc)
            self._metrics.on_spool_failure("read")
            self._throttle.warning(
                "spool-read", f"cannot read the plugin statistics in {spool}: {exc}"
            )
            return
        if self._status.spool_read_error is not None:
            log.info("plugin statistics in %s readable again", spool)
            self._status.spool_read_error = None
            self._failing.update("spool-read", None)
            self._throttle.resolve("spool-read")
        self._stats_cursor = dict(batch.cursor)
        self._stats_pending.extend(r.snapshot for r in batch.records)
        if batch.records:
            self.busy_without_stats_mono_s = None
            newest_s = max(r.snapshot.window_end_s for r in batch.records)
            # Stamped by the server's clock and read within seconds of being written:
            # how far that clock is ahead of ours, less the delivery delay.
            self.server_clock_ahead_s = newest_s - self._clock()


def _nonfinite_dropped(snapshot: Any) -> int:
    """NaN/Inf sample values the parser dropped from one scrape (its ``unknown`` list
    names the value in each reason; negative counters are dropped too but are finite)."""
    unknown = getattr(snapshot, "unknown", ())
    return sum(1 for u in unknown if _NONFINITE.search(str(getattr(u, "reason", ""))))


def _arrival_points(
    totals: Sequence[_ScrapeTotals],
) -> list[tuple[float, float | None, int | None]]:
    """(time, requests finished per second since the scrape before, requests in the
    server) per scrape, what ``arrival_segments`` reads (the first has no rate)."""
    points: list[tuple[float, float | None, int | None]] = []
    for before, t in zip([None, *totals], totals, strict=False):
        held = None if t.running is None or t.queued is None else t.running + t.queued
        dt = None if before is None else t.at_s - before.at_s
        rate = None if before is None or not dt else (t.requests - before.requests) / dt
        points.append((t.at_s, rate, held))
    return points
