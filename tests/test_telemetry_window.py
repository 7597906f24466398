"""Windowing over scrapes: counter resets, histogram quantiles, accept length, gauge age."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from specgov.adapters.prometheus_text import HistogramSeries, SeriesKey, parse_metrics
from specgov.adapters.telemetry import (
    GENERATION_TOKENS,
    REALTIME_TOKENS,
    CounterDelta,
    GaugeAger,
    TimedSnapshot,
    accept_length,
    compute_window,
    counter_delta,
    dp_counter_delta,
    dp_histogram_delta,
    histogram_delta,
    histogram_quantile,
    quantiles,
)

FIXTURES = Path(__file__).parent / "fixtures" / "sglang"
INF = math.inf


def snap(name: str, t: float) -> TimedSnapshot:
    return TimedSnapshot(t, parse_metrics((FIXTURES / name).read_text(), source=name))


def hist(bounds: tuple[float, ...], cumulative: tuple[float, ...]) -> HistogramSeries:
    return HistogramSeries(bounds, cumulative, None, cumulative[-1] if cumulative else None)


# ------------------------------------------------------------------ quantile math

H = hist((0.1, 0.2, 0.4, INF), (2.0, 6.0, 10.0, 10.0))


@pytest.mark.parametrize(
    ("q", "expected"),
    [
        # rank 1 lies in the first bucket, which starts at 0: 0 + 0.1 * (1 / 2)
        (0.1, 0.05),
        # rank 5: bucket (0.1, 0.2] holds ranks 2..6 -> 0.1 + 0.1 * (5 - 2) / 4
        (0.5, 0.175),
        # rank 9: bucket (0.2, 0.4] holds ranks 6..10 -> 0.2 + 0.2 * (9 - 6) / 4
        (0.9, 0.35),
        # rank 10 is the top of (0.2, 0.4]
        (1.0, 0.4),
        (0.0, 0.0),
    ],
)
def test_quantile_interpolates_inside_the_bucket(q: float, expected: float) -> None:
    assert histogram_quantile(q, H) == pytest.approx(expected)


def test_rank_in_the_inf_bucket_answers_the_highest_finite_bound() -> None:
    h = hist((0.1, 0.2, 0.4, INF), (2.0, 6.0, 8.0, 10.0))
    # rank 9.5 > 8 = count up to 0.4: Prometheus answers 0.4 (an underestimate).
    assert histogram_quantile(0.95, h) == 0.4
    assert histogram_quantile(0.8, h) == pytest.approx(0.4)  # rank 8 still inside 0.4


def test_zero_first_bound_as_in_sglang_queue_time() -> None:
    # queue_time_seconds starts with le="0.0": ranks in it answer 0.
    h = hist((0.0, 0.001, INF), (5.0, 8.0, 8.0))
    assert histogram_quantile(0.5, h) == 0.0
    # rank 7.2: 0.0 + 0.001 * (7.2 - 5) / 3
    assert histogram_quantile(0.9, h) == pytest.approx(0.001 * 2.2 / 3)


@pytest.mark.parametrize(
    "h",
    [
        hist((0.1, 0.2), (1.0, 2.0)),  # no +Inf bucket
        hist((0.1, INF), (0.0, 0.0)),  # empty window
        hist((INF,), (4.0,)),  # only +Inf
    ],
)
def test_quantile_unknown_cases(h: HistogramSeries) -> None:
    assert histogram_quantile(0.5, h) is None


def test_quantiles_of_empty_window_is_none() -> None:
    assert quantiles(None) is None
    assert quantiles(hist((0.1, INF), (0.0, 0.0))) is None
    # rank 9.9 for p99: 0.2 + 0.2 * (9.9 - 6) / 4
    assert quantiles(H) == pytest.approx((0.175, 0.35, 0.395))


def test_non_monotonic_buckets_are_forced_monotonic() -> None:
    torn = hist((0.1, 0.2, 0.4, INF), (2.0, 1.0, 10.0, 10.0))
    fixed = hist((0.1, 0.2, 0.4, INF), (2.0, 2.0, 10.0, 10.0))
    for q in (0.1, 0.5, 0.9):
        assert histogram_quantile(q, torn) == histogram_quantile(q, fixed)


@pytest.mark.parametrize("q", [-0.1, 1.5, math.nan])
def test_quantile_rejects_q_outside_unit_interval(q: float) -> None:
    with pytest.raises(ValueError, match=r"q must be in \[0, 1\]"):
        histogram_quantile(q, H)


@given(
    counts=st.lists(st.integers(min_value=0, max_value=1000), min_size=2, max_size=8),
    qs=st.lists(st.floats(min_value=0.0, max_value=1.0), min_size=2, max_size=5),
)
def test_quantiles_are_monotone_in_q_and_inside_the_bounds(
    counts: list[int], qs: list[float]
) -> None:
    bounds = tuple(0.01 * (i + 1) for i in range(len(counts) - 1)) + (INF,)
    cumulative = tuple(float(sum(counts[: i + 1])) for i in range(len(counts)))
    h = hist(bounds, cumulative)
    values = [histogram_quantile(q, h) for q in sorted(qs)]
    if cumulative[-1] == 0:
        assert all(v is None for v in values)
        return
    known = [v for v in values if v is not None]
    assert known == sorted(known)
    assert all(0.0 <= v <= bounds[-2] for v in known)


# ------------------------------------------------------------------ counter deltas


def test_counter_delta_and_reset() -> None:
    assert counter_delta(10.0, 25.0) == CounterDelta(15.0)
    assert counter_delta(None, 25.0) == CounterDelta(None)
    assert counter_delta(10.0, None) == CounterDelta(None)
    # A decrease is a restart: unknown, never negative.
    assert counter_delta(25.0, 3.0) == CounterDelta(None, reset=True)


def test_dp_counter_delta_rules() -> None:
    # Metric absent before: unknown (it may simply not have been exported).
    assert dp_counter_delta({}, {"0": 5.0}) == CounterDelta(None)
    # A new DP group while the metric existed: its child was created since, from 0.
    assert dp_counter_delta({"0": 5.0}, {"0": 6.0, "1": 2.0}) == CounterDelta(3.0)
    # A vanished group or metric, or a decrease: reset.
    assert dp_counter_delta({"0": 5.0, "1": 1.0}, {"0": 6.0}).reset
    assert dp_counter_delta({"0": 5.0}, {}).reset
    assert dp_counter_delta({"0": 5.0, "1": 4.0}, {"0": 6.0, "1": 3.0}).reset


def test_histogram_delta_rules() -> None:
    a = HistogramSeries((0.1, INF), (1.0, 3.0), 0.5, 3.0)
    b = HistogramSeries((0.1, INF), (4.0, 9.0), 1.5, 9.0)
    d = histogram_delta(a, b)
    assert d.histogram == HistogramSeries((0.1, INF), (3.0, 6.0), 1.0, 6.0)
    assert histogram_delta(b, a).reset
    assert histogram_delta(a, HistogramSeries((0.2, INF), (4.0, 9.0), 1.5, 9.0)).reset
    assert histogram_delta(None, b).histogram is None
    # New DP group counts from 0; vanished group is a reset.
    assert dp_histogram_delta({"0": a}, {"0": b, "1": a}).histogram == HistogramSeries(
        (0.1, INF), (4.0, 9.0), 1.5, 9.0
    )
    assert dp_histogram_delta({"0": a, "1": a}, {"0": b}).reset


def test_accept_length_needs_verify_calls() -> None:
    assert accept_length(24_000.0, 8_000.0) == 3.0
    assert accept_length(24_000.0, 0.0) is None
    assert accept_length(None, 8_000.0) is None
    assert accept_length(24_000.0, None) is None


# ------------------------------------------------------------------ fixture windows


def test_window_over_eagle3_fixture() -> None:
    w = compute_window(
        snap("eagle3_adaptive_A.prom", 1000.0), snap("eagle3_adaptive_B.prom", 1010.0)
    )
    assert not w.restart_detected and w.window_s == 10.0
    assert w.generation_tokens == 24_000.0  # 16,000 streaming + 8,000 not
    assert w.verify_calls == 8_000.0
    assert w.accept_length == 3.0  # 24,000 / 8,000
    assert w.requests == 120.0
    assert w.accept_length_excl_prefill == pytest.approx((24_000 - 120) / 8_000)
    assert w.decode_tokens == 25_310.0
    assert w.throughput_source == REALTIME_TOKENS
    assert w.gen_throughput_tok_s == pytest.approx(2_531.0)
    assert w.retractions == 2.0
    assert w.ttft is not None and w.ttft.total == 120.0
    assert w.itl is not None and w.itl.total == 24_000.0


def test_restart_makes_every_window_value_unknown() -> None:
    w = compute_window(
        snap("eagle3_adaptive_B.prom", 1010.0), snap("eagle3_adaptive_restarted.prom", 1030.0)
    )
    assert w.restart_detected
    assert GENERATION_TOKENS in w.reset_metrics
    # num_retracted_requests_total vanished (no retraction since the restart): also a reset.
    assert "sglang:num_retracted_requests_total" in w.reset_metrics
    for value in (w.generation_tokens, w.verify_calls, w.decode_tokens, w.retractions, w.ttft):
        assert value is None
    assert w.accept_length is None and w.gen_throughput_tok_s is None


def test_restart_is_caught_even_when_request_counters_caught_up() -> None:
    # A long gap: the relaunched server already served more than before. Only the
    # slow-growing scheduler CPU-seconds counter went down.
    def text(tokens: float, cpu_s: float) -> str:
        return (
            "# TYPE sglang:generation_tokens_total counter\n"
            f"sglang:generation_tokens_total {tokens}\n"
            "# TYPE sglang:scheduler_process_cpu_seconds_total counter\n"
            f"sglang:scheduler_process_cpu_seconds_total{{{LBL}}} {cpu_s}\n"
        )

    before = TimedSnapshot(0.0, parse_metrics(text(1_000.0, 3_600.0)))
    after = TimedSnapshot(600.0, parse_metrics(text(90_000.0, 12.5)))
    w = compute_window(before, after)
    assert w.restart_detected and w.reset_metrics == ("sglang:scheduler_process_cpu_seconds_total",)
    assert w.generation_tokens is None
    calm = TimedSnapshot(600.0, parse_metrics(text(90_000.0, 3_900.0)))
    assert compute_window(before, calm).generation_tokens == 89_000.0


def test_non_speculative_window_has_no_accept_length() -> None:
    w = compute_window(snap("nonspec_tp2_A.prom", 2000.0), snap("nonspec_tp2_B.prom", 2010.0))
    assert not w.restart_detected
    assert w.verify_calls is None and w.accept_length is None
    assert w.retractions is None  # never exported: unknown, not 0
    assert w.generation_tokens == 30_000.0
    # TP rank 1 exports no realtime counter; rank 0's 31,250 decode tokens are not doubled.
    assert w.gen_throughput_tok_s == pytest.approx(3_125.0)


def test_throughput_falls_back_to_generation_tokens() -> None:
    a = parse_metrics(
        "# TYPE sglang:generation_tokens_total counter\nsglang:generation_tokens_total 100\n"
    )
    b = parse_metrics(
        "# TYPE sglang:generation_tokens_total counter\nsglang:generation_tokens_total 600\n"
    )
    w = compute_window(TimedSnapshot(0.0, a), TimedSnapshot(5.0, b))
    assert w.throughput_source == GENERATION_TOKENS
    assert w.gen_throughput_tok_s == 100.0


def test_window_needs_increasing_time() -> None:
    a = snap("eagle3_adaptive_A.prom", 1000.0)
    with pytest.raises(ValueError, match="taken after"):
        compute_window(a, TimedSnapshot(1000.0, a.metrics))


# ------------------------------------------------------------------------ gauge age

LBL = 'engine_type="unified",model_name="m",moe_ep_rank="0",pp_rank="0",tp_rank="0"'


def gauges(running: float, throughput: float, capacity: float = 1000.0, dp: str = "") -> str:
    extra = f',dp_rank="{dp}"' if dp else ""
    return (
        "# TYPE sglang:num_running_reqs gauge\n"
        f"sglang:num_running_reqs{{{LBL}{extra}}} {running}\n"
        "# TYPE sglang:gen_throughput gauge\n"
        f"sglang:gen_throughput{{{LBL}{extra}}} {throughput}\n"
        "# TYPE sglang:max_total_num_tokens gauge\n"
        f"sglang:max_total_num_tokens{{{LBL}{extra}}} {capacity}\n"
    )


def key(name: str, dp: str = "") -> SeriesKey:
    labels = {
        "engine_type": "unified",
        "model_name": "m",
        "moe_ep_rank": "0",
        "pp_rank": "0",
        "tp_rank": "0",
    }
    if dp:
        labels["dp_rank"] = dp
    return SeriesKey.of(name, labels)


def test_gauge_age_grows_while_the_value_holds_and_group_refresh_resets_it() -> None:
    ager = GaugeAger()
    running, cap = key("sglang:num_running_reqs"), key("sglang:max_total_num_tokens")
    ager.observe(parse_metrics(gauges(5, 100.0)), 0.0)
    assert ager.age_s(running, 0.0) == 0.0  # first sighting counts as a refresh
    ager.observe(parse_metrics(gauges(5, 100.0)), 10.0)
    assert ager.age_s(running, 10.0) == 10.0
    # gen_throughput moved: log_stats() wrote every gauge of the replica, so the
    # unchanged running count was refreshed too.
    ager.observe(parse_metrics(gauges(5, 120.0)), 20.0)
    assert ager.age_s(running, 20.0) == 0.0
    assert ager.refreshed_at(running) == 20.0
    # A constant outside the log_stats set only ages.
    assert ager.age_s(cap, 20.0) == 20.0
    ager.observe(parse_metrics(gauges(6, 120.0)), 30.0)
    assert ager.age_s(running, 35.0) == 5.0


def two_replicas(run0: float, tput0: float, run1: float, tput1: float) -> str:
    return (
        "# TYPE sglang:num_running_reqs gauge\n"
        f'sglang:num_running_reqs{{{LBL},dp_rank="0"}} {run0}\n'
        f'sglang:num_running_reqs{{{LBL},dp_rank="1"}} {run1}\n'
        "# TYPE sglang:gen_throughput gauge\n"
        f'sglang:gen_throughput{{{LBL},dp_rank="0"}} {tput0}\n'
        f'sglang:gen_throughput{{{LBL},dp_rank="1"}} {tput1}\n'
    )


def test_group_refresh_is_per_replica() -> None:
    ager = GaugeAger()
    ager.observe(parse_metrics(two_replicas(5, 100.0, 4, 90.0)), 0.0)
    # Only DP rank 0's scheduler published (its throughput moved).
    ager.observe(parse_metrics(two_replicas(5, 130.0, 4, 90.0)), 10.0)
    assert ager.age_s(key("sglang:num_running_reqs", "0"), 10.0) == 0.0
    assert ager.age_s(key("sglang:num_running_reqs", "1"), 10.0) == 10.0


def test_nan_gauges_age_and_vanished_series_are_forgotten() -> None:
    ager = GaugeAger()
    occupancy = key("sglang:fwd_occupancy")
    text = f"# TYPE sglang:fwd_occupancy gauge\nsglang:fwd_occupancy{{{LBL}}} NaN\n"
    ager.observe(parse_metrics(text), 0.0)
    ager.observe(parse_metrics(text), 7.0)
    assert ager.age_s(occupancy, 7.0) == 7.0  # NaN -> NaN is no change
    ager.observe(parse_metrics(""), 8.0)
    assert ager.age_s(occupancy, 8.0) is None
    with pytest.raises(ValueError, match="backwards"):
        ager.observe(parse_metrics(""), 1.0)
    ager.reset()
    assert ager.age_s(occupancy, 8.0) is None
    ager.observe(parse_metrics(""), 1.0)  # after reset, time may start over
