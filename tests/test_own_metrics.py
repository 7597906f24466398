"""The daemon's own metrics: names, labels, values, the derived-state collector, /metrics."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client import REGISTRY, CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from specgov.controller.daemon.own_metrics import (
    DEFAULT_SCRAPE_ERROR_KINDS,
    DaemonMetrics,
    DaemonSnapshot,
    metrics_app,
)
from specgov.policies.common.step_table import StepTable


def _table(
    produced_at_s: float = 90.0, slots: tuple[tuple[int, int], ...] = ((1, 3), (8, 1))
) -> StepTable:
    return StepTable(slots=slots, version=1, produced_at_s=produced_at_s, ttl_s=60.0)


class Clock:
    def __init__(self, now_s: float) -> None:
        self.now_s = now_s

    def __call__(self) -> float:
        return self.now_s


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    value = registry.get_sample_value(name, labels)
    return None if value is None else float(value)


def test_decisions_counted_by_policy_and_reason_and_timed() -> None:
    registry = CollectorRegistry()
    metrics = DaemonMetrics(registry, clock=Clock(100.0))
    metrics.on_decision("goodput", "changed_predicted_gain", 0.003, _table())
    metrics.on_decision("goodput", "changed_predicted_gain", 0.02, _table())
    metrics.on_decision("goodput", "held_min_dwell", 0.0004, None)
    metrics.on_decision("static:3", "static_policy", 0.0001, None)

    total = "specgov_decisions_total"
    assert sample(registry, total, policy="goodput", reason="changed_predicted_gain") == 2
    assert sample(registry, total, policy="goodput", reason="held_min_dwell") == 1
    assert sample(registry, total, policy="static:3", reason="static_policy") == 1
    assert sample(registry, total, policy="static:3", reason="held_min_dwell") is None

    hist = "specgov_decide_duration_seconds"
    assert sample(registry, f"{hist}_count") == 4
    assert sample(registry, f"{hist}_sum") == pytest.approx(0.003 + 0.02 + 0.0004 + 0.0001)
    assert sample(registry, f"{hist}_bucket", le="0.0005") == 2
    assert sample(registry, f"{hist}_bucket", le="0.005") == 3
    assert sample(registry, f"{hist}_bucket", le="+Inf") == 4


def test_bad_decide_duration_is_skipped_not_raised() -> None:
    registry = CollectorRegistry()
    metrics = DaemonMetrics(registry)
    metrics.on_decision("goodput", "initial", -0.5, None)
    metrics.on_decision("goodput", "initial", math.nan, None)
    assert sample(registry, "specgov_decisions_total", policy="goodput", reason="initial") == 2
    assert sample(registry, "specgov_decide_duration_seconds_count") == 0


def test_scrape_errors_by_kind_start_at_zero() -> None:
    registry = CollectorRegistry()
    metrics = DaemonMetrics(registry)
    for kind in DEFAULT_SCRAPE_ERROR_KINDS:
        assert sample(registry, "specgov_scrape_errors_total", kind=kind) == 0
    metrics.on_scrape_error("temporary")
    metrics.on_scrape_error("temporary")
    metrics.on_scrape_error("auth")
    assert sample(registry, "specgov_scrape_errors_total", kind="temporary") == 2
    assert sample(registry, "specgov_scrape_errors_total", kind="auth") == 1
    assert sample(registry, "specgov_scrape_errors_total", kind="permanent") == 0


def test_recorded_table_is_aged_at_scrape_time() -> None:
    registry = CollectorRegistry()
    clock = Clock(100.0)
    metrics = DaemonMetrics(registry, clock=clock)
    assert sample(registry, "specgov_table_age_seconds") is None  # no table yet: unknown
    metrics.on_decision("goodput", "initial", 0.001, _table(produced_at_s=90.0))

    assert sample(registry, "specgov_table_steps", slot="1") == 3
    assert sample(registry, "specgov_table_steps", slot="8") == 1
    assert sample(registry, "specgov_table_age_seconds") == pytest.approx(10.0)
    clock.now_s = 145.5  # no call to the metrics object in between
    assert sample(registry, "specgov_table_age_seconds") == pytest.approx(55.5)

    metrics.on_decision("goodput", "changed_predicted_gain", 0.001, _table(140.0, ((1, 2),)))
    assert sample(registry, "specgov_table_steps", slot="1") == 2
    assert sample(registry, "specgov_table_steps", slot="8") is None  # gone with the old table
    assert sample(registry, "specgov_table_age_seconds") == pytest.approx(5.5)

    metrics.on_decision("goodput", "held_no_change", 0.001, None)  # table withdrawn
    assert sample(registry, "specgov_table_steps", slot="1") is None
    assert sample(registry, "specgov_table_age_seconds") is None


def test_table_from_the_future_has_age_zero() -> None:
    registry = CollectorRegistry()
    metrics = DaemonMetrics(registry, clock=Clock(50.0))
    metrics.on_decision("goodput", "initial", 0.001, _table(produced_at_s=60.0))
    assert sample(registry, "specgov_table_age_seconds") == 0.0


def test_recorded_estimates_goodput_overrides_and_info() -> None:
    registry = CollectorRegistry()
    metrics = DaemonMetrics(registry, clock=Clock(0.0), version="9.9.9")
    predicted = "specgov_goodput_predicted_tokens_per_second"
    observed = "specgov_goodput_observed_tokens_per_second"
    assert sample(registry, predicted) is None
    assert sample(registry, observed) is None

    metrics.set_predicted(1500.0)
    metrics.set_observed(1234.5)
    metrics.set_accept_lengths({1: 2.75, 16: 1.5, 32: math.nan})
    metrics.set_override_active(2)
    metrics.set_info(policy="bandit", mode="observe")
    assert sample(registry, predicted) == 1500.0
    assert sample(registry, observed) == 1234.5
    assert sample(registry, "specgov_accept_length_estimate", slot="1") == 2.75
    assert sample(registry, "specgov_accept_length_estimate", slot="16") == 1.5
    assert sample(registry, "specgov_accept_length_estimate", slot="32") is None
    assert sample(registry, "specgov_override_active") == 2
    assert sample(registry, "specgov_info", version="9.9.9", policy="bandit", mode="observe") == 1

    metrics.set_observed(None)  # telemetry lost: unknown, not 0
    metrics.set_accept_lengths({1: 3.0})  # replaces the previous set
    metrics.set_override_active(0)
    assert sample(registry, observed) is None
    assert sample(registry, "specgov_accept_length_estimate", slot="16") is None
    assert sample(registry, "specgov_accept_length_estimate", slot="1") == 3.0
    assert sample(registry, "specgov_override_active") == 0


def test_injected_snapshot_is_read_at_every_scrape() -> None:
    registry = CollectorRegistry()
    state = {
        "snap": DaemonSnapshot(
            now_s=200.0,
            table=_table(produced_at_s=180.0),
            accept_length_by_slot={1: 2.5},
            predicted_goodput_tokens_per_s=900.0,
            observed_goodput_tokens_per_s=850.0,
            overrides_active=1,
            policy="goodput",
            mode="plugin",
        )
    }
    reads: list[int] = []

    def snapshot() -> DaemonSnapshot:
        reads.append(1)
        return state["snap"]

    metrics = DaemonMetrics(registry, snapshot=snapshot, version="1.2.3")
    assert reads == []  # registering does not read the daemon's state
    assert sample(registry, "specgov_table_age_seconds") == pytest.approx(20.0)
    assert sample(registry, "specgov_table_steps", slot="8") == 1
    assert sample(registry, "specgov_accept_length_estimate", slot="1") == 2.5
    assert sample(registry, "specgov_goodput_predicted_tokens_per_second") == 900.0
    assert sample(registry, "specgov_goodput_observed_tokens_per_second") == 850.0
    assert sample(registry, "specgov_override_active") == 1
    assert sample(registry, "specgov_info", version="1.2.3", policy="goodput", mode="plugin") == 1
    assert reads

    # The daemon's state moves on; the next scrape sees it without any metrics call.
    state["snap"] = DaemonSnapshot(now_s=260.0, table=None, policy="static:1", mode="observe")
    # The injected snapshot is the only source: a table recorded here does not leak in.
    metrics.on_decision("static:1", "static_policy", 0.001, _table(produced_at_s=250.0))
    assert sample(registry, "specgov_table_age_seconds") is None
    assert sample(registry, "specgov_table_steps", slot="1") is None
    assert sample(registry, "specgov_override_active") == 0
    assert sample(registry, "specgov_info", version="1.2.3", policy="static:1", mode="observe") == 1
    assert (
        sample(registry, "specgov_info", version="1.2.3", policy="goodput", mode="plugin") is None
    )


def test_failing_snapshot_keeps_metrics_served(caplog: pytest.LogCaptureFixture) -> None:
    registry = CollectorRegistry()

    def broken() -> DaemonSnapshot:
        raise RuntimeError("daemon state torn")

    metrics = DaemonMetrics(registry, snapshot=broken)
    metrics.on_decision("goodput", "initial", 0.001, None)
    text = generate_latest(registry).decode()
    assert 'specgov_decisions_total{policy="goodput",reason="initial"} 1.0' in text
    assert "# TYPE specgov_table_steps gauge" in text  # the family, without samples
    assert sample(registry, "specgov_override_active") is None
    assert (sample(registry, "specgov_metrics_snapshot_errors_total") or 0) >= 1
    assert "daemon state torn" in caplog.text


def test_snapshot_of_wrong_type_is_an_error_not_a_crash() -> None:
    registry = CollectorRegistry()

    def bad() -> Any:
        return {"now_s": 1.0}

    DaemonMetrics(registry, snapshot=bad)
    assert sample(registry, "specgov_override_active") is None
    assert sample(registry, "specgov_metrics_snapshot_errors_total") == 1


def test_registries_are_isolated_and_global_registry_untouched() -> None:
    first, second = CollectorRegistry(), CollectorRegistry()
    DaemonMetrics(first).on_scrape_error("temporary")
    DaemonMetrics(second)
    assert sample(first, "specgov_scrape_errors_total", kind="temporary") == 1
    assert sample(second, "specgov_scrape_errors_total", kind="temporary") == 0
    assert REGISTRY.get_sample_value("specgov_scrape_errors_total", {"kind": "temporary"}) is None
    with pytest.raises(ValueError, match="Duplicated"):
        DaemonMetrics(first)  # the same names twice on one registry
    with pytest.raises(TypeError, match="CollectorRegistry"):
        DaemonMetrics(object())  # type: ignore[arg-type]


def test_names_follow_prometheus_conventions() -> None:
    registry = CollectorRegistry()
    metrics = DaemonMetrics(registry, clock=Clock(100.0))
    metrics.on_decision("goodput", "initial", 0.001, _table())
    metrics.set_predicted(1.0)
    metrics.set_observed(1.0)
    metrics.set_accept_lengths({1: 2.0})
    families = {m.name: m for m in registry.collect()}
    expected = {
        "specgov_decisions": "counter",
        "specgov_scrape_errors": "counter",
        "specgov_decide_duration_seconds": "histogram",
        "specgov_table_steps": "gauge",
        "specgov_table_age_seconds": "gauge",
        "specgov_accept_length_estimate": "gauge",
        "specgov_goodput_predicted_tokens_per_second": "gauge",
        "specgov_goodput_observed_tokens_per_second": "gauge",
        "specgov_override_active": "gauge",
        "specgov": "info",
    }
    for name, kind in expected.items():
        assert families[name].type == kind, name
    for family in families.values():
        assert family.name.startswith("specgov"), family.name
        assert family.documentation, family.name
        if family.type == "counter":
            assert all(s.name.endswith(("_total", "_created")) for s in family.samples), family.name
    labels = {
        name: {k for s in families[name].samples for k in s.labels}
        for name in ("specgov_decisions", "specgov_table_steps", "specgov_accept_length_estimate")
    }
    assert labels["specgov_decisions"] == {"policy", "reason"}
    assert labels["specgov_table_steps"] == {"slot"}
    assert labels["specgov_accept_length_estimate"] == {"slot"}


def _get(app_registry: CollectorRegistry, accept: str | None) -> tuple[int, str, str]:
    async def go() -> tuple[int, str, str]:
        headers = {"Accept": accept} if accept else {}
        async with TestClient(TestServer(metrics_app(app_registry))) as client:
            response = await client.get("/metrics", headers=headers)
            return response.status, response.headers["Content-Type"], await response.text()

    return asyncio.run(go())


def test_metrics_endpoint_serves_the_registry() -> None:
    registry = CollectorRegistry()
    clock = Clock(100.0)
    metrics = DaemonMetrics(registry, clock=clock)
    metrics.on_decision("goodput", "changed_predicted_gain", 0.002, _table(produced_at_s=95.0))
    metrics.on_scrape_error("format")

    status, content_type, text = _get(registry, None)
    assert status == 200
    assert content_type.startswith("text/plain")
    parsed = {f.name: f for f in text_string_to_metric_families(text)}
    decisions = parsed["specgov_decisions"].samples
    assert [(s.labels, s.value) for s in decisions if s.name.endswith("_total")] == [
        ({"policy": "goodput", "reason": "changed_predicted_gain"}, 1.0)
    ]
    assert [s.value for s in parsed["specgov_table_age_seconds"].samples] == [5.0]
    errors = {
        s.labels["kind"]: s.value
        for s in parsed["specgov_scrape_errors"].samples
        if s.name.endswith("_total")
    }
    assert errors["format"] == 1.0

    clock.now_s = 130.0
    _, _, later = _get(registry, None)
    assert "specgov_table_age_seconds 35.0" in later


def test_metrics_endpoint_negotiates_openmetrics() -> None:
    registry = CollectorRegistry()
    DaemonMetrics(registry).on_scrape_error("temporary")
    status, content_type, text = _get(registry, "application/openmetrics-text; version=1.0.0")
    assert status == 200
    assert content_type.startswith("application/openmetrics-text")
    assert text.rstrip().endswith("# EOF")
    assert 'specgov_scrape_errors_total{kind="temporary"} 1.0' in text


def test_fault_counters_exist_at_zero_and_count() -> None:
    registry = CollectorRegistry()
    metrics = DaemonMetrics(registry)
    get = registry.get_sample_value
    for kind in ("unavailable", "corrupt", "deleted", "replaced"):
        assert get("specgov_store_failures_total", {"kind": kind}) == 0.0
    for op in ("write", "read"):
        assert get("specgov_spool_failures_total", {"operation": op}) == 0.0
    assert get("specgov_telemetry_nonfinite_values_dropped_total") == 0.0
    metrics.on_store_failure("deleted")
    metrics.on_spool_failure("write")
    metrics.on_nonfinite_dropped(3)
    metrics.on_nonfinite_dropped(0)
    metrics.set_journal(7)
    metrics.on_journal_dropped("decision", 2)
    metrics.on_log_suppressed("scrape-temporary")
    assert get("specgov_store_failures_total", {"kind": "deleted"}) == 1.0
    assert get("specgov_spool_failures_total", {"operation": "write"}) == 1.0
    assert get("specgov_telemetry_nonfinite_values_dropped_total") == 3.0
    assert get("specgov_store_journal_entries") == 7.0
    assert get("specgov_store_journal_dropped_total", {"kind": "decision"}) == 2.0
    assert get("specgov_log_lines_suppressed_total", {"kind": "scrape-temporary"}) == 1.0
