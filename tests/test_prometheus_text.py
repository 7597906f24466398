"""Parsing SGLang's /metrics text and selecting one value per DP group."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from specgov.adapters.errors import (
    PermanentScrapeError,
    ResponseFormatError,
    TemporaryScrapeError,
)
from specgov.adapters.prometheus_text import (
    Aggregation,
    HistogramSeries,
    SeriesKey,
    aggregate_dp,
    counter_by_dp,
    gauge_by_dp,
    histogram_by_dp,
    parse_metrics,
    sum_histograms,
)

FIXTURES = Path(__file__).parent / "fixtures" / "sglang"
LLAMA = "meta-llama/Llama-3.1-8B-Instruct"


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


SCHED = 'engine_type="unified",model_name="m",moe_ep_rank="0",pp_rank="0"'


def test_fixture_parses_into_typed_series() -> None:
    snap = parse_metrics(fixture("eagle3_adaptive_B.prom"))
    # Counters keep their sample name (the _total suffix SGLang declares).
    gen = {
        k.get("is_streaming"): v
        for k, v in snap.counters.items()
        if k.name == "sglang:generation_tokens_total"
    }
    assert gen == {"false": 739_520.0, "true": 2_226_480.0}
    assert snap.types["sglang:generation_tokens_total"] == "counter"
    assert snap.types["sglang:num_running_reqs"] == "gauge"
    assert snap.types["sglang:time_to_first_token_seconds"] == "histogram"
    key = SeriesKey.of(
        "sglang:num_running_reqs",
        {
            "engine_type": "unified",
            "model_name": LLAMA,
            "moe_ep_rank": "0",
            "pp_rank": "0",
            "tp_rank": "0",
        },
    )
    assert snap.gauges[key] == 52.0
    ttft = snap.histograms[
        SeriesKey.of(
            "sglang:time_to_first_token_seconds",
            {"engine_type": "unified", "is_streaming": "false", "model_name": LLAMA},
        )
    ]
    assert ttft.bounds[0] == 0.1 and math.isinf(ttft.bounds[-1])
    assert ttft.cumulative[-1] == ttft.count == 3_328.0
    assert ttft.total == 3_328.0
    # SGLang's fwd_occupancy defaults to NaN: kept out, listed as unknown.
    assert any(u.key.name == "sglang:fwd_occupancy" for u in snap.unknown)
    assert not any(k.name == "sglang:fwd_occupancy" for k in snap.gauges)


def test_nan_and_inf_gauges_are_unknown_not_zero() -> None:
    snap = parse_metrics(fixture("nan_missing.prom"))
    reasons = {u.key.name: u.reason for u in snap.unknown}
    assert "nan" in reasons["sglang:token_usage"]
    assert "inf" in reasons["sglang:gen_throughput"]
    assert gauge_by_dp(snap, "sglang:token_usage") == {}
    assert gauge_by_dp(snap, "sglang:gen_throughput") == {}
    # Missing series are simply absent.
    assert gauge_by_dp(snap, "sglang:num_queue_reqs") == {}
    assert counter_by_dp(snap, "sglang:generation_tokens_total") == {}
    assert snap.has_metric("sglang:token_usage")  # exported, but its value is unknown
    assert not snap.has_metric("sglang:num_queue_reqs")


def test_illegal_counter_and_bucket_values_are_unknown() -> None:
    text = """# TYPE c_total counter
c_total{a="1"} NaN
c_total{a="2"} -3
c_total{a="3"} 7
# TYPE h histogram
h_bucket{le="1.0"} NaN
h_bucket{le="+Inf"} 2
h_sum 1.5
h_count 2
"""
    snap = parse_metrics(text)
    assert list(snap.counters.values()) == [7.0]
    kinds = sorted((u.kind, u.key.get("a") or "") for u in snap.unknown)
    assert kinds == [("counter", "1"), ("counter", "2"), ("histogram", "")]
    assert snap.histograms == {}


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("<html><body>502 Bad Gateway</body></html>", "unparseable"),
        ('{"error": "Unauthorized"}', "unparseable"),
        ("# TYPE g gauge\ng 1\ng 2\n", "appears twice"),
        ('# TYPE h histogram\nh_bucket{le="fast"} 1\n', "le='fast'"),
    ],
)
def test_malformed_text_raises_a_temporary_format_error_naming_the_source(
    text: str, needle: str
) -> None:
    # Temporary, kind "format" (issue 9): a garbled or cut body is not a reason to stop
    # publishing at once, the way a 401 or 404 is; the next scrape may parse.
    with pytest.raises(ResponseFormatError) as err:
        parse_metrics(text, source="http://sglang:30000/metrics")
    assert isinstance(err.value, TemporaryScrapeError) and isinstance(err.value, ValueError)
    assert not isinstance(err.value, PermanentScrapeError)
    assert err.value.kind == "format"
    assert "http://sglang:30000/metrics" in str(err.value)
    assert needle in str(err.value)


def test_empty_body_is_an_empty_snapshot() -> None:
    snap = parse_metrics("")
    assert not snap.counters and not snap.gauges and not snap.histograms


def test_tp_ranks_are_not_summed_constants_and_preseeded_counters() -> None:
    # Fixture (b): every TP rank exports max_total_num_tokens and pre-seeded counters.
    snap = parse_metrics(fixture("nonspec_tp2_A.prom"))
    cap = gauge_by_dp(snap, "sglang:max_total_num_tokens")
    assert set(cap) == {None}
    assert cap[None].value == 512_000.0
    assert cap[None].keys[0].get("tp_rank") == "0"
    idle = counter_by_dp(snap, "sglang:scheduler_idle_seconds_total")
    assert idle[None].value == 95.4  # TP rank 1's pre-seeded 0 is not added
    assert snap.dp_groups() == frozenset({None})


def test_all_schedulers_mode_reads_one_tp_replica() -> None:
    # --enable-metrics-for-all-schedulers: every TP rank reports the same gauge values.
    text = f"""# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{{{SCHED},tp_rank="1"}} 5
sglang:num_running_reqs{{{SCHED},tp_rank="0"}} 5
sglang:num_running_reqs{{{SCHED},tp_rank="10"}} 5
"""
    got = gauge_by_dp(parse_metrics(text), "sglang:num_running_reqs")
    assert got[None].value == 5.0
    assert got[None].keys[0].get("tp_rank") == "0"


def test_dp_attention_groups_by_dp_rank_not_tp_rank() -> None:
    # Under DP attention tp_rank is global: DP group 1's logging rank is tp_rank 2.
    text = f"""# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{{{SCHED},dp_rank="0",tp_rank="0"}} 7
sglang:num_running_reqs{{{SCHED},dp_rank="0",tp_rank="1"}} 7
sglang:num_running_reqs{{{SCHED},dp_rank="1",tp_rank="2"}} 4
sglang:num_running_reqs{{{SCHED},dp_rank="1",tp_rank="3"}} 4
"""
    snap = parse_metrics(text)
    got = gauge_by_dp(snap, "sglang:num_running_reqs")
    assert {dp: rv.value for dp, rv in got.items()} == {"0": 7.0, "1": 4.0}
    assert aggregate_dp({dp: rv.value for dp, rv in got.items()}, Aggregation.SUM) == 11.0
    assert snap.dp_groups() == frozenset({"0", "1"})


def test_dp2_fixture_sums_counts_and_averages_ratios() -> None:
    snap = parse_metrics(fixture("dp2_A.prom"))
    running = {dp: rv.value for dp, rv in gauge_by_dp(snap, "sglang:num_running_reqs").items()}
    assert running == {"0": 30.0, "1": 26.0}
    assert aggregate_dp(running, Aggregation.SUM) == 56.0
    usage = {dp: rv.value for dp, rv in gauge_by_dp(snap, "sglang:token_usage").items()}
    assert aggregate_dp(usage, Aggregation.MEAN) == pytest.approx((0.35 + 0.45) / 2)
    steps = {dp: rv.value for dp, rv in gauge_by_dp(snap, "sglang:spec_num_steps").items()}
    assert aggregate_dp(steps, Aggregation.AGREE) == 3.0
    # Per-rank views stay available; DP rank 1 has not retracted yet (no child).
    retracted = counter_by_dp(snap, "sglang:num_retracted_requests_total")
    assert {dp: rv.value for dp, rv in retracted.items()} == {"0": 5.0}
    # Tokenizer series have no rank label: one group, summed over label sets.
    gen = counter_by_dp(snap, "sglang:generation_tokens_total")
    assert set(gen) == {None} and gen[None].value == 7_120_006.0


def test_pid_labelled_gauges_are_read() -> None:
    snap = parse_metrics(fixture("dp2_A.prom"))
    got = gauge_by_dp(snap, "sglang:num_retracted_reqs")
    assert {dp: rv.keys[0].get("pid") for dp, rv in got.items()} == {"0": "3002", "1": "3003"}


def test_priority_breakdown_reads_the_total() -> None:
    text = f"""# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{{{SCHED},priority="",tp_rank="0"}} 7
sglang:num_queue_reqs{{{SCHED},priority="0",tp_rank="0"}} 3
sglang:num_queue_reqs{{{SCHED},priority="1",tp_rank="0"}} 4
"""
    assert gauge_by_dp(parse_metrics(text), "sglang:num_queue_reqs")[None].value == 7.0


def test_ambiguous_gauge_is_unknown_and_match_pins_it() -> None:
    text = f"""# TYPE sglang:graph_memory_usage_gb gauge
sglang:graph_memory_usage_gb{{{SCHED},phase="decode",tp_rank="0"}} 1.2
sglang:graph_memory_usage_gb{{{SCHED},phase="prefill",tp_rank="0"}} 0.5
"""
    snap = parse_metrics(text)
    assert gauge_by_dp(snap, "sglang:graph_memory_usage_gb") == {}
    pinned = gauge_by_dp(snap, "sglang:graph_memory_usage_gb", match={"phase": "prefill"})
    assert pinned[None].value == 0.5


def test_counter_match_selects_label_values() -> None:
    snap = parse_metrics(fixture("eagle3_adaptive_A.prom"))
    decode = counter_by_dp(snap, "sglang:realtime_tokens_total", match={"mode": "decode"})
    assert decode[None].value == 2_915_800.0
    every_mode = counter_by_dp(snap, "sglang:realtime_tokens_total")
    assert every_mode[None].value == 2_915_800.0 + 14_500_000.0 + 9_877_001.0


def test_histogram_by_dp_sums_label_sets_bucketwise() -> None:
    snap = parse_metrics(fixture("eagle3_adaptive_A.prom"))
    ttft = histogram_by_dp(snap, "sglang:time_to_first_token_seconds")[None]
    assert len(ttft.keys) == 2  # is_streaming false + true
    assert ttft.histogram.total == 3_288.0 + 9_862.0
    assert ttft.histogram.cumulative[0] == 210.0 + 690.0


def test_aggregate_dp_rules() -> None:
    assert aggregate_dp({}, Aggregation.SUM) is None
    assert aggregate_dp({"0": 1.0, "1": 2.0}, Aggregation.MEAN) == 1.5
    assert aggregate_dp({"0": 3.0, "1": 1.0}, Aggregation.AGREE) is None
    # A DP group known to exist but missing makes a sum unknown, never a partial sum.
    assert aggregate_dp({"0": 3.0}, Aggregation.SUM, expected={"0", "1"}) is None


def test_sum_histograms_needs_one_layout() -> None:
    a = HistogramSeries((1.0, math.inf), (1.0, 2.0), 1.0, 2.0)
    b = HistogramSeries((2.0, math.inf), (1.0, 2.0), 1.0, 2.0)
    with pytest.raises(ResponseFormatError, match="bucket layout"):
        sum_histograms([a, b], what="h")
    assert sum_histograms([], what="h") is None
    c = HistogramSeries((1.0, math.inf), (0.0, 3.0), None, 3.0)
    total = sum_histograms([a, c], what="h")
    assert total is not None
    assert total.cumulative == (1.0, 5.0) and total.sum is None and total.count == 5.0


def test_histogram_series_validates_its_shape() -> None:
    with pytest.raises(ValueError, match="strictly increasing"):
        HistogramSeries((2.0, 1.0), (0.0, 0.0))
    with pytest.raises(ValueError, match="bounds but"):
        HistogramSeries((1.0,), (0.0, 1.0))
