"""The restart check replays the window's own load shape: its arrival regimes, read
from what the daemon observes at each scrape (finished requests, requests held)."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from specgov.controller.daemon.load_shape import (
    MAX_SEGMENTS,
    arrival_segments,
    merge_segments,
    replay_ramp,
)
from specgov.controller.daemon.recommend import (
    WINDOW_HORIZON_CAP_S,
    RecommendError,
    WorkloadSummary,
    recommend,
    window_spec,
)
from specgov.controller.daemon.replay_check import replay_workload
from specgov.simulator.replay.runner import ServerSpec, replay
from specgov.simulator.workload.synthetic import Phase, SyntheticSpec, generate_trace

H100 = {"gpu": "h100", "model": "llama-3.1-8b", "drafter": "eagle3"}


def _scrapes(rates: list[float], held: list[int] | None = None) -> list[Any]:
    """Scrapes 1 s apart: (time, finished per second since the one before, held)."""
    held = held or [5] * (len(rates) + 1)
    return [(0.0, None, held[0])] + [
        (float(i + 1), rate, held[i + 1]) for i, rate in enumerate(rates)
    ]


def test_arrivals_are_what_finished_plus_the_change_in_what_the_server_holds() -> None:
    # 5 finished per second while the queue grows by 5 per second: 10 arrived per second.
    segments = arrival_segments(_scrapes([5.0] * 10, [0, 5, 10, 15, 20, 25, 30, 35, 40, 45, 50]))
    assert segments == ((10.0, pytest.approx(10.0)),)
    # A drain (held falls faster than requests finish) never reads as negative arrivals.
    assert arrival_segments(_scrapes([1.0], [20, 0])) == ((1.0, 0.0),)
    # Unknown counts are left out; fewer than two scrapes: no shape.
    assert arrival_segments(_scrapes([None, 3.0], [None, 4, 4])) == ((1.0, 3.0),)  # type: ignore[list-item]
    assert arrival_segments(_scrapes([])) == ()
    with pytest.raises(ValueError, match="max_segments"):
        arrival_segments(_scrapes([1.0]), max_segments=0)


def test_a_long_window_stays_bounded_and_keeps_its_arrivals() -> None:
    rng = np.random.default_rng(7)
    # An hour of 1 s scrapes through 120 regimes of 30 s alternating 2 and 12 req/s: more
    # regimes than the summary holds.
    rates = [float(r) for k in range(120) for r in rng.poisson(2.0 if k % 2 else 12.0, 30)]
    segments = arrival_segments(_scrapes(rates))
    assert len(segments) == MAX_SEGMENTS
    assert sum(d for d, _ in segments) == pytest.approx(3600.0)
    assert sum(d * r for d, r in segments) == pytest.approx(sum(rates))
    # Equal neighbours are one regime, and so is a steady Poisson hour (its noise is not
    # a regime: replaying it as one would add burstiness the window did not have).
    assert merge_segments([(1.0, 2.0)] * 50, MAX_SEGMENTS) == ((50.0, 2.0),)
    steady = [float(r) for r in rng.poisson(4.0, size=3600)]
    assert len(arrival_segments(_scrapes(steady))) == 1


def test_regimes_are_found_through_poisson_noise() -> None:
    # The phase scenario's three regimes (16.8, 6.0 and 3.8 req/s, 300 s each) seen in
    # 5 s scrapes: three regimes, their bounds within two scrapes, their rates within noise.
    rng = np.random.default_rng(3)
    counts = [rng.poisson(rate * 5, 60) for rate in (16.8, 6.0, 3.8)]
    segments = merge_segments([(5.0, float(c) / 5) for cs in counts for c in cs], MAX_SEGMENTS)
    assert [d for d, _ in segments] == pytest.approx([300.0, 300.0, 300.0], abs=10.0)
    assert [r for _, r in segments] == pytest.approx([16.8, 6.0, 3.8], rel=0.05)


def test_a_two_regime_window_is_replayed_as_two_regimes() -> None:
    # 150 s at 2 req/s, then 150 s at 10 req/s (a 300 s window, 6 req/s on average).
    segments = arrival_segments(_scrapes([2.0] * 150 + [10.0] * 150))
    assert segments == ((150.0, 2.0), (150.0, 10.0))
    workload = WorkloadSummary(300, 6.0, 600, 200, 2.5, 3, segments=segments)
    notes: list[str] = []
    spec = window_spec(workload, horizon_s=180.0, seed=0, notes=notes)
    assert spec.duration_s == 300.0  # the window's own length (within the cap)
    arrivals = np.array([r.arrival_s for r in generate_trace(spec).requests])
    first, second = int((arrivals < 150).sum()), int((arrivals >= 150).sum())
    assert first == pytest.approx(300, rel=0.2) and second == pytest.approx(1500, rel=0.1)
    assert "2 regimes over 300 s" in notes[0]
    # Without regimes (or saturated: closed-loop users), steady Poisson over the horizon.
    steady = window_spec(dataclasses.replace(workload, segments=()), horizon_s=180.0)
    assert steady.duration_s == 180.0 and steady.ramp is None
    closed = window_spec(dataclasses.replace(workload, concurrency=64.0), horizon_s=180.0)
    assert closed.ramp is None
    # A window longer than the cap is scaled into it (its regimes keep their shares).
    long = dataclasses.replace(workload, window_s=3000, segments=((1500, 2.0), (1500, 10.0)))
    capped = window_spec(long, horizon_s=180.0)
    assert capped.duration_s == WINDOW_HORIZON_CAP_S
    assert replay_ramp(long.segments, WINDOW_HORIZON_CAP_S) == capped.ramp
    with pytest.raises(RecommendError, match="no finished requests"):
        window_spec(dataclasses.replace(workload, request_rate_rps=0.0))


def test_a_bursty_windows_replay_queues_like_the_window_did() -> None:
    # Bursts of 20 s at 42 req/s, then 40 s of silence: the server queues in each burst.
    # The goodput daemon's audit rows (its observations) summarise the window; the check's
    # trace follows its regimes, and plain (none) replayed on it misses the SLO about as
    # often as on the real window; on steady arrivals at the mean rate it never misses.
    spec = SyntheticSpec(
        duration_s=240,
        rate_rps=14.0,
        arrival="onoff",
        on_s=20,
        off_s=40,
        mean_input_tokens=600,
        mean_output_tokens=250,
        phases=(Phase(240, {"chat": 1.0}),),
        seed=3,
    )
    trace = generate_trace(spec)
    server = ServerSpec(**H100)
    report = replay(trace, server, ["none", "goodput"], seed=0)
    by = {r.policy.name: r for r in report.runs}
    workload = replay_workload(by["goodput"], list(trace.requests))
    assert workload.concurrency is None and len(workload.segments) >= 4

    def plain_attainment(w: WorkloadSummary) -> float:
        shaped = generate_trace(window_spec(w, horizon_s=180.0, seed=0))
        return float(replay(shaped, server, ["none"], seed=0).runs[0].summary["slo_attainment"])

    real = float(by["none"].summary["slo_attainment"])  # 0.58, measured
    assert real < 0.9
    assert plain_attainment(workload) == pytest.approx(real, abs=0.2)  # 0.69, measured
    assert plain_attainment(dataclasses.replace(workload, segments=())) > 0.95  # 1.0


def test_the_daemons_restart_loop_replays_its_own_windows_regimes(tmp_path: Path) -> None:
    """Scrapes -> the daemon's Telemetry -> its window's regimes -> the restart loop's
    check, which says it replayed them."""
    from prometheus_client import CollectorRegistry

    from specgov.controller.daemon.config import load_config
    from specgov.controller.daemon.own_metrics import DaemonMetrics
    from specgov.controller.daemon.restart_loop import RestartLoop
    from specgov.controller.daemon.status_view import DaemonStatus
    from specgov.policies.common.observation import LatencyQuantiles, Observation

    path = tmp_path / "specgov.yaml"
    path.write_text(
        "deployment:\n  gpu: h100\n  model: llama-3.1-8b\n  drafter: eagle3\n"
        "recommend:\n  interval_s: 600\n",
        encoding="utf-8",
    )
    config = load_config(path, env={})
    status = DaemonStatus(started_at_s=0.0)
    telemetry = _telemetry(config, status)
    # 150 s at 1 req/s, then 150 s at 4 req/s, scraped every 5 s; nothing queued, and
    # 2 or 6 requests running (an open loop: a steady count would be a closed population).
    requests = 0.0
    for tick in range(61):
        now = 5.0 * tick
        requests += 0 if tick == 0 else 5 * (1.0 if now <= 150 else 4.0)
        running = 2 if tick % 2 == 0 else 6
        # Each scrape's TPOT p50 (10, 11, 12 ms in turn; one scrape measured none): the
        # window's is their median, what the check's baseline replay must reproduce.
        tpot = None if tick == 7 else LatencyQuantiles(p50_ms=10.0 + tick % 3)
        held = Observation(time_s=now, running_requests=running, queued_requests=0, tpot_ms=tpot)
        telemetry.note_totals(now, _snapshot(requests), held)
    workload = telemetry.workload_summary()
    assert workload is not None and workload.concurrency is None
    assert workload.tpot_p50_ms == 11.0
    assert workload.window_s == 300.0 and workload.request_rate_rps == pytest.approx(2.5)
    assert 2 <= len(workload.segments) <= MAX_SEGMENTS

    def mean_rate(start: float, end: float) -> float:  # the regimes' arrivals there
        t, arrived = 0.0, 0.0
        for duration, rate in workload.segments:
            overlap = max(0.0, min(end, t + duration) - max(start, t))
            arrived, t = arrived + overlap * rate, t + duration
        return arrived / (end - start)

    assert mean_rate(0, 150) == pytest.approx(1.0, abs=0.05)
    assert mean_rate(150, 300) == pytest.approx(4.0, abs=0.05)

    loop = RestartLoop(
        lambda: config,
        telemetry=telemetry,
        metrics=DaemonMetrics(CollectorRegistry()),
        status_info=status,
        clock=lambda: 300.0,
        snapshot=lambda _key, _write: None,
        stop=asyncio.Event(),
        every=None,  # type: ignore[arg-type]
    )
    asyncio.run(loop.recommend_once())
    assert status.recommendation is not None
    notes = status.recommendation["details"]["notes"]
    regimes = len(workload.segments)
    assert any(f"the window's {regimes} regimes over 300 s" in n for n in notes)
    shown = status.recommendation["details"]["workload"]["segments"]
    assert [tuple(s) for s in shown] == [pytest.approx(s) for s in workload.segments]


def _telemetry(config: Any, status: Any) -> Any:
    import logging

    from specgov.adapters.log_throttle import LogThrottle
    from specgov.controller.daemon.health import FailureClock
    from specgov.controller.daemon.telemetry import Telemetry

    return Telemetry(
        lambda: config,
        client=None,
        clock=lambda: 0.0,
        monotonic=lambda: 0.0,
        metrics=None,  # type: ignore[arg-type]
        status_info=status,
        throttle=LogThrottle(logging.getLogger("test"), lambda: 0.0),
        failing=FailureClock(lambda: 0.0),
    )


def _snapshot(requests: float) -> Any:
    from specgov.adapters.prometheus_text import parse_metrics

    counters = {
        "sglang:num_requests_total": requests,
        "sglang:prompt_tokens_total": requests * 600,
        "sglang:generation_tokens_total": requests * 200,
    }
    text = "".join(
        f'# TYPE {name} counter\n{name}{{model_name="m"}} {value}\n'
        for name, value in counters.items()
    )
    return parse_metrics(text)


def test_recommend_replays_the_regimes_it_is_given() -> None:
    segments = ((60.0, 0.5), (60.0, 2.0))
    workload = WorkloadSummary(120, 1.25, 600, 200, 2.8, 3, segments=segments)
    rec = recommend(workload, **H100, current=None, slo_tpot_ms=50, horizon_s=60)
    assert any("2 regimes over 120 s" in n for n in rec.notes)
    steady = recommend(
        dataclasses.replace(workload, segments=()),
        **H100,
        current=None,
        slo_tpot_ms=50,
        horizon_s=60,
    )
    assert not any("regimes" in n for n in steady.notes)
