"""Health that tells the truth (issue 9 §4): readiness and liveness, the counters for
spool failures and NaN/Inf values, and rate-limited warnings."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client import CollectorRegistry

from specgov.adapters.log_throttle import LogThrottle
from specgov.adapters.prometheus_text import parse_metrics
from specgov.adapters.sglang_http import MetricsScrape
from specgov.controller.daemon.config import SpecgovConfig, load_config
from specgov.controller.daemon.control_api import make_app
from specgov.controller.daemon.health import FailureClock, HealthInputs, liveness, readiness
from specgov.controller.daemon.runtime import Daemon
from specgov.policies.common.step_table import StepTable
from specgov.policies.control.core import Publish


class Clock:
    def __init__(self, now_s: float = 1000.0) -> None:
        self.now_s = now_s

    def __call__(self) -> float:
        return self.now_s


def _inputs(**kwargs: Any) -> HealthInputs:
    base: dict[str, Any] = {
        "now_s": 100.0,
        "started_at_s": 0.0,
        "last_scrape_s": 99.0,
        "last_scrape_error": None,
        "permanent_error": None,
        "spool_error": None,
        "store_error": None,
        "telemetry_max_age_s": 60.0,
    }
    return HealthInputs(**{**base, **kwargs})


# ------------------------------------------------------------------ the verdicts


def test_ready_when_everything_works() -> None:
    verdict = readiness(_inputs())
    assert verdict["ok"] is True and verdict["reasons"] == []


@pytest.mark.parametrize(
    ("change", "check", "reason"),
    [
        (
            {"last_scrape_s": 10.0, "last_scrape_error": "connection refused"},
            "telemetry",
            "no telemetry for 90 s (bound 60 s): connection refused",
        ),
        ({"last_scrape_s": None}, "telemetry", "no telemetry yet for 100 s (bound 60 s)"),
        ({"spool_error": "cannot write /s: EROFS"}, "spool", "spool: cannot write /s: EROFS"),
        ({"store_error": "disk is full"}, "store", "store: disk is full"),
        ({"permanent_error": "401"}, "acting", "not acting: 401"),
    ],
)
def test_each_failing_check_makes_it_unready_with_its_reason(
    change: dict[str, Any], check: str, reason: str
) -> None:
    verdict = readiness(_inputs(**change))
    assert verdict["ok"] is False and verdict[check] is False
    assert verdict["reasons"] == [reason]


def test_telemetry_at_the_bound_is_still_fresh() -> None:
    assert readiness(_inputs(last_scrape_s=40.0))["ok"] is True
    assert readiness(_inputs(last_scrape_s=39.9))["ok"] is False


def test_liveness_follows_the_decision_loop() -> None:
    assert liveness(_inputs(last_tick_s=95.0, decide_interval_s=5.0))["ok"] is True
    stuck = liveness(_inputs(last_tick_s=50.0, decide_interval_s=5.0))
    assert stuck["ok"] is False and "has not ticked for 50 s (bound 30 s)" in stuck["reasons"][0]
    # The bound grows with long intervals: 3 intervals.
    assert liveness(_inputs(last_tick_s=0.0, now_s=100.0, decide_interval_s=60.0))["ok"] is True


# ------------------------------------------------------------------- the throttle


def test_repeated_warnings_are_rate_limited_per_kind_with_a_count(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock(0.0)
    suppressed: list[str] = []
    logger = logging.getLogger("test.throttle")
    throttle = LogThrottle(logger, clock, interval_s=60.0, on_suppressed=suppressed.append)
    caplog.set_level(logging.WARNING, logger="test.throttle")
    for i in range(10):
        clock.now_s = float(i)
        throttle.warning("scrape", f"server down {i}")
        throttle.warning("spool", "spool unwritable")
    assert [r.getMessage() for r in caplog.records] == ["server down 0", "spool unwritable"]
    assert suppressed.count("scrape") == 9 and suppressed.count("spool") == 9
    clock.now_s = 61.0
    throttle.warning("scrape", "server down again")
    assert caplog.records[-1].getMessage() == (
        "server down again (9 similar message(s) suppressed in the last 61 s)"
    )
    assert throttle.resolve("spool") == 9
    throttle.warning("spool", "spool unwritable")  # resolved: logged at once
    assert caplog.records[-1].getMessage() == "spool unwritable"


def test_logged_text_is_escaped_and_bounded(caplog: pytest.LogCaptureFixture) -> None:
    throttle = LogThrottle(logging.getLogger("test.escape"), Clock(0.0))
    caplog.set_level(logging.WARNING, logger="test.escape")
    throttle.warning("a", "a\x1b[31mred\x00\r\nz")
    throttle.warning("b", "x" * 5000)
    first, long = (r.getMessage() for r in caplog.records)
    assert first == "a\\x1b[31mred\\x00\\r\\nz"
    assert len(long) < 2100 and long.endswith("[cut: 5000 characters in all]")


def test_a_clock_that_went_backwards_does_not_hold_a_kind_back(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock(100.0)
    throttle = LogThrottle(logging.getLogger("test.back"), clock, interval_s=60.0)
    caplog.set_level(logging.WARNING, logger="test.back")
    assert throttle.warning("k", "one") is True
    clock.now_s = 50.0
    assert throttle.warning("k", "two") is True
    assert [r.getMessage() for r in caplog.records] == ["one", "two"]


# ------------------------------------------------------------- against the daemon


def _config(tmp_path: Path, **extra: Any) -> SpecgovConfig:
    return load_config(
        None,
        env={},
        overrides={
            "server.url": "http://127.0.0.1:9",
            "state.db_path": str(tmp_path / "state.db"),
            "spool.dir": str(tmp_path / "spool"),
            "loop.mode": "plugin",
            **extra,
        },
    )


def _get(daemon: Daemon, path: str) -> tuple[int, Any]:
    async def go() -> tuple[int, Any]:
        app = make_app(daemon, token=None, listen_host="127.0.0.1")
        async with TestClient(TestServer(app, host="127.0.0.1")) as client:
            reply = await client.get(path)
            return reply.status, await reply.json()

    return asyncio.run(go())


def test_health_goes_503_when_telemetry_is_missing_past_the_bound(tmp_path: Path) -> None:
    clock = Clock()
    daemon = Daemon(
        _config(tmp_path),
        store=None,
        registry=CollectorRegistry(),
        clock=clock,
        telemetry_max_age_s=20.0,
    )
    assert _get(daemon, "/v1/health")[0] == 200
    clock.now_s += 21.0
    status, body = _get(daemon, "/v1/health")
    assert status == 503 and body["telemetry"] is False
    assert body["reasons"] == ["no telemetry yet for 21 s (bound 20 s)"]
    assert body["codes"] == ["no_telemetry_yet"]
    assert _get(daemon, "/v1/health/ready")[0] == 503
    assert daemon.status()["health"] == body["reasons"]
    # Alive all the same (its loop bound is 30 s): a probe must not restart a daemon
    # waiting for its server.
    assert _get(daemon, "/v1/health/live")[0] == 200


def test_liveness_fails_when_the_decision_loop_stops_ticking(tmp_path: Path) -> None:
    clock = Clock()
    daemon = Daemon(_config(tmp_path), store=None, registry=CollectorRegistry(), clock=clock)
    clock.now_s += 100.0  # decide interval 5 s: bound 30 s, never ticked since start
    status, body = _get(daemon, "/v1/health/live")
    assert status == 503 and "has not ticked" in body["reasons"][0]


def test_unwritable_spool_is_counted_unready_and_logged_once_per_burst(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the spool folder should be")
    config = _config(tmp_path, **{"spool.dir": str(blocker / "spool")})
    daemon = Daemon(config, store=None, registry=CollectorRegistry())
    table = StepTable(slots=((1, 2),), version=1, produced_at_s=0.0, ttl_s=60.0)
    caplog.set_level(logging.INFO, logger="specgov.daemon")
    for _ in range(10):
        assert daemon._publish_table(Publish(table, (0, 1, 2))) is False
    value = daemon.registry.get_sample_value
    assert value("specgov_spool_failures_total", {"operation": "write"}) == 10.0
    assert value("specgov_log_lines_suppressed_total", {"kind": "spool-write"}) == 9.0
    lines = [r for r in caplog.records if "cannot publish" in r.getMessage()]
    assert len(lines) == 1
    health = daemon.health()
    assert health["ok"] is False and health["spool"] is False
    assert "cannot write" in health["reasons"][0]


@pytest.mark.parametrize("step_s", [3600.0, -3600.0])
def test_a_wall_clock_step_flips_neither_readiness_nor_liveness(
    tmp_path: Path, step_s: float
) -> None:
    wall, mono = Clock(1_000_000.0), Clock(50.0)
    daemon = _clocked_daemon(tmp_path, wall, mono, _StepClient())
    asyncio.run(daemon.scrape_once())
    daemon._mark_tick()
    assert daemon.health()["telemetry"] is True
    wall.now_s += step_s  # NTP steps the wall clock; 1 s of real time passes
    mono.now_s += 1.0
    ready, live = daemon.health(), daemon.liveness()
    assert ready["telemetry"] is True and ready["telemetry_age_s"] == pytest.approx(1.0)
    assert live["ok"] is True and live["last_tick_age_s"] == pytest.approx(1.0)
    # And the other way: real time past the bound is stale whatever the wall says.
    mono.now_s += 30.0
    wall.now_s -= step_s
    ready = daemon.health()
    assert ready["telemetry"] is False and ready["codes"] == ["telemetry_stale"]


def test_failure_ages_are_monotonic_and_shown(tmp_path: Path) -> None:
    wall, mono = Clock(1_000_000.0), Clock(50.0)
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the spool folder should be")
    config = _config(tmp_path, **{"spool.dir": str(blocker / "spool")})
    daemon = Daemon(config, store=None, registry=CollectorRegistry(), clock=wall, monotonic=mono)
    table = StepTable(slots=((1, 2),), version=1, produced_at_s=0.0, ttl_s=60.0)
    assert daemon._publish_table(Publish(table, (0, 1, 2))) is False
    mono.now_s += 12.0
    wall.now_s -= 7200.0  # a wall step: the age is real time
    assert daemon._publish_table(Publish(table, (0, 1, 2))) is False  # same burst
    health = daemon.health()
    assert health["spool"] is False and health["spool_error_age_s"] == pytest.approx(12.0)
    assert health["reasons"][-1].endswith("(for 12 s)") and "spool_failing" in health["codes"]
    assert health["store_error_age_s"] is None


def test_failure_clock_keeps_the_start_of_a_burst() -> None:
    clock = Clock(10.0)
    failing = FailureClock(clock)
    failing.update("a", "down")
    clock.now_s = 20.0
    failing.update("a", "still down")
    failing.update("b", "down")
    assert failing.since_s("a") == 10.0 and failing.since_s("a", "b") == 10.0
    failing.update("a", None)
    assert failing.since_s("a") is None and failing.since_s("a", "b") == 20.0


def test_beyond_loopback_a_probe_without_the_token_sees_no_path(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the spool folder should be")
    daemon = Daemon(
        _config(tmp_path, **{"spool.dir": str(blocker / "spool")}),
        store=None,
        registry=CollectorRegistry(),
    )
    table = StepTable(slots=((1, 2),), version=1, produced_at_s=0.0, ttl_s=60.0)
    assert daemon._publish_table(Publish(table, (0, 1, 2))) is False

    async def go() -> list[tuple[int, str]]:
        app = make_app(daemon, token="tok-abcdef0123", listen_host="0.0.0.0")
        async with TestClient(TestServer(app, host="127.0.0.1")) as client:
            replies = []
            for headers in ({}, {"Authorization": "Bearer tok-abcdef0123"}):
                reply = await client.get("/v1/health", headers=headers)
                replies.append((reply.status, await reply.text()))
            return replies

    (terse_status, terse), (full_status, full) = asyncio.run(go())
    assert terse_status == full_status == 503
    assert '"reasons": ["spool_failing"]' in terse and str(tmp_path) not in terse
    assert str(blocker) in full


class _NanClient:
    """Stands in for SGLangClient: a /metrics body with NaN and Inf values."""

    BODY = (
        "# TYPE sglang:num_running_reqs gauge\n"
        'sglang:num_running_reqs{model_name="m"} NaN\n'
        "# TYPE sglang:num_queue_reqs gauge\n"
        'sglang:num_queue_reqs{model_name="m"} +Inf\n'
        "# TYPE sglang:generation_tokens_total counter\n"
        'sglang:generation_tokens_total{model_name="m"} -1\n'
    )

    async def scrape_metrics(self) -> MetricsScrape:
        return MetricsScrape(0.0, 0.001, parse_metrics(self.BODY), self.BODY)

    async def server_info(self) -> dict[str, Any]:
        return {}

    async def loads(self) -> Any:
        return None

    async def aclose(self) -> None:
        return None


class _StepClient(_NanClient):
    """A server whose /metrics always answers (an empty but valid body)."""

    BODY = ""


def test_nan_and_inf_values_are_counted_where_the_observation_arrives(tmp_path: Path) -> None:
    daemon = Daemon(
        _config(tmp_path),
        store=None,
        registry=CollectorRegistry(),
        client=_NanClient(),  # type: ignore[arg-type]
    )
    asyncio.run(daemon.scrape_once())
    asyncio.run(daemon.scrape_once())
    # Two non-finite values per scrape; the negative counter is dropped but finite.
    value = daemon.registry.get_sample_value("specgov_telemetry_nonfinite_values_dropped_total")
    assert value == 4.0


# ------------------------------------------- blind and clock skew (issue 23 §3)


class _BusyClient(_NanClient):
    """A server with requests running (it would write plugin statistics if loaded)."""

    BODY = (
        "# TYPE sglang:num_running_reqs gauge\n"
        'sglang:num_running_reqs{model_name="m"} 8\n'
        "# TYPE sglang:num_queue_reqs gauge\n"
        'sglang:num_queue_reqs{model_name="m"} 0\n'
    )


def _stats(window_end_s: float) -> Any:
    from specgov.policies.common.types import TierStat, TierStatsSnapshot

    tier = TierStat(
        slot=1,
        steps=1,
        verify_calls=4,
        requests=4,
        accepted_hist=(1, 3),
        step_time_sum_s=0.04,
        step_time_count=4,
        batch_size_sum=4,
    )
    return TierStatsSnapshot(window_end_s - 1.0, window_end_s, (tier,))


def _clocked_daemon(
    tmp_path: Path, wall: Clock, mono: Clock, client: _NanClient, **extra: Any
) -> Daemon:
    """A daemon on the given clocks and stand-in server, telemetry bound 30 s."""
    return Daemon(
        _config(tmp_path, **{"loop.telemetry_max_age_s": 30.0, **extra}),
        store=None,
        registry=CollectorRegistry(),
        client=client,  # type: ignore[arg-type]
        clock=wall,
        monotonic=mono,
    )


def _busy_daemon(tmp_path: Path, wall: Clock, mono: Clock, **extra: Any) -> Daemon:
    return _clocked_daemon(tmp_path, wall, mono, _BusyClient(), **extra)


def test_blind_is_not_healthy_503_with_the_reason_a_metric_and_one_log_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The plugin is not loaded (nothing writes statistics) while the server is busy:
    every decision holds on unknown telemetry and no table is published. Before issue 23
    health answered 200 throughout and nothing was logged."""
    from specgov.adapters.spool_stats import write_tier_stats

    wall, mono = Clock(1_000_000.0), Clock(50.0)
    daemon = _busy_daemon(tmp_path, wall, mono)
    caplog.set_level(logging.INFO, logger="specgov.daemon")
    for _ in range(8):  # 40 s of scrapes and decisions, every 5 s
        asyncio.run(daemon.scrape_once())
        record = daemon.decide_once()
        daemon.export_health()
        assert record.reason == "held_unknown_telemetry" and not record.published
        wall.now_s += 5.0
        mono.now_s += 5.0
    status, body = _get(daemon, "/v1/health")
    assert status == 503 and body["plugin_statistics"] is False
    assert body["codes"] == ["no_plugin_statistics"]
    assert "blind: the server has been busy for 40 s (bound 30 s)" in body["reasons"][0]
    assert str(tmp_path / "spool") in body["reasons"][0]
    assert daemon.status()["health"] == body["reasons"]
    value = daemon.registry.get_sample_value
    assert value("specgov_health_failing", {"code": "no_plugin_statistics"}) == 1.0
    assert value("specgov_health_failing", {"code": "telemetry_stale"}) == 0.0
    lines = [r for r in caplog.records if "not ready: blind" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.ERROR  # throttled: one per burst
    # The plugin's statistics arrive: healthy again, the gauge back to 0.
    write_tier_stats(tmp_path / "spool", _stats(wall.now_s), writer_id="w", fsync=False)
    asyncio.run(daemon.scrape_once())
    daemon.decide_once()
    daemon.export_health()
    assert daemon.health()["ok"] is True
    assert value("specgov_health_failing", {"code": "no_plugin_statistics"}) == 0.0


def test_an_idle_server_without_statistics_is_not_blind(tmp_path: Path) -> None:
    wall, mono = Clock(1_000_000.0), Clock(50.0)
    daemon = _clocked_daemon(tmp_path, wall, mono, _StepClient())
    for _ in range(10):
        asyncio.run(daemon.scrape_once())
        daemon.decide_once()
        mono.now_s += 5.0
    assert daemon.health()["ok"] is True  # an idle engine writes no statistics


def test_observe_mode_without_a_plugin_is_not_blind(tmp_path: Path) -> None:
    wall, mono = Clock(1_000_000.0), Clock(50.0)
    daemon = _busy_daemon(tmp_path, wall, mono, **{"loop.mode": "observe"})
    for _ in range(10):
        asyncio.run(daemon.scrape_once())
        daemon.decide_once()
        mono.now_s += 5.0
    assert daemon.health()["ok"] is True


@pytest.mark.parametrize(("ahead_s", "ok"), [(45.0, False), (30.0, False), (10.0, True)])
def test_a_server_clock_ahead_by_the_table_ttl_is_clock_skew(
    tmp_path: Path, ahead_s: float, ok: bool
) -> None:
    """The server's clock runs ``ahead_s`` ahead of the daemon's: with the default
    30 s table TTL every table has expired when the plugin reads it (from 30 s on)."""
    from specgov.adapters.spool_stats import write_tier_stats

    wall, mono = Clock(1_000_000.0), Clock(50.0)
    daemon = _busy_daemon(tmp_path, wall, mono)
    asyncio.run(daemon.scrape_once())
    write_tier_stats(tmp_path / "spool", _stats(wall.now_s + ahead_s), writer_id="w", fsync=False)
    daemon.decide_once()
    verdict = daemon.export_health()
    assert verdict["ok"] is ok and verdict["server_clock_ahead_s"] == pytest.approx(ahead_s)
    value = daemon.registry.get_sample_value
    gauge = value("specgov_server_clock_ahead_seconds", {"source": "plugin_statistics"})
    assert gauge == pytest.approx(ahead_s)
    assert value("specgov_health_failing", {"code": "clock_skew"}) == (0.0 if ok else 1.0)
    assert daemon.status()["server_clock_ahead_s"] == pytest.approx(ahead_s)
    if not ok:
        assert verdict["codes"] == ["clock_skew"]
        assert f"{ahead_s:.0f} s ahead of the daemon's" in verdict["reasons"][0]
        assert "table TTL (guardrails.table_ttl_s 30 s)" in verdict["reasons"][0]
