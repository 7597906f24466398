"""Golden Observations from every SGLang fixture, and the builder's fault handling.

The expected numbers are worked out by hand from the deltas the fixture generator puts
between scrapes A and B (tests/fixtures/sglang/generate_fixtures.py, A_DELTA / B_DELTA /
C_DELTA). Quantiles follow Prometheus' histogram_quantile: in the bucket (lo, hi] that
holds rank q*N, lo + (hi - lo) * (rank - count below) / count in bucket.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from specgov.adapters.errors import ResponseFormatError
from specgov.adapters.observation_builder import (
    ObservationBuilder,
    parse_loads,
    parse_server_info,
)
from specgov.adapters.prometheus_text import MetricsSnapshot, parse_metrics
from specgov.policies.common.observation import LatencyQuantiles, Observation
from specgov.policies.common.types import SpecShape

FIXTURES = Path(__file__).parent / "fixtures" / "sglang"
INDEX = json.loads((FIXTURES / "scrapes.json").read_text())


def metrics(name: str) -> MetricsSnapshot:
    return parse_metrics((FIXTURES / name).read_text(), source=name)


def body(name: str) -> dict[str, Any]:
    data = json.loads((FIXTURES / name).read_text())
    assert isinstance(data, dict)
    return data


def builder_for(scenario: str, **kwargs: Any) -> ObservationBuilder:
    cfg = INDEX[scenario]["adaptive_config"]
    return ObservationBuilder(adaptive_config=body(cfg) if cfg else None, **kwargs)


def replay(scenario: str, *, with_loads: bool = True, **kwargs: Any) -> list[Observation]:
    sc = INDEX[scenario]
    b = builder_for(scenario, **kwargs)
    info = body(sc["server_info"])
    out = []
    for s in sc["scrapes"]:
        loads = body(s["loads"]) if with_loads and s["loads"] else None
        out.append(b.feed(s["time_s"], metrics(s["metrics"]), info, loads))
    return out


def approx_q(p50: float, p90: float, p99: float) -> Any:
    return pytest.approx((p50, p90, p99))


def q(lat: LatencyQuantiles | None) -> tuple[float | None, ...]:
    assert lat is not None
    return (lat.p50_ms, lat.p90_ms, lat.p99_ms)


# ------------------------------------------------------------------- (a) EAGLE-3


def test_golden_eagle3_adaptive() -> None:
    first, second, _ = replay("eagle3_adaptive")
    shape = SpecShape("EAGLE3", 3, 1, 4, (0, 1, 3, 5))  # union of the fixture config
    slots = ((1, (1, 3, 5)), (16, (0, 1, 3)), (48, (0, 1)))

    # Scrape A: load from /v1/loads (fresher than the gauges), no window yet.
    assert first.running_requests == 47 and first.queued_requests == 2
    assert first.token_usage == 0.4012 and first.kv_capacity_tokens == 398_540
    assert first.spec_num_steps == 3
    assert first.shape == shape and first.slot_candidates == slots
    assert first.window_s is None and first.accept_length is None and first.ttft_ms is None
    assert first.staleness_s == pytest.approx(0.25)  # loads published 0.25 s before answering

    assert second.running_requests == 51 and second.queued_requests == 1
    assert second.token_usage == 0.4398
    assert second.spec_num_steps == 1  # the adaptive controller moved 3 -> 1
    assert second.window_s == 10.0
    assert second.generation_tokens == 24_000  # 16,000 streaming + 8,000 not
    assert second.verify_calls == 8_000
    assert second.accept_length == 3.0  # 24,000 / 8,000
    assert second.retractions == 2
    assert second.gen_throughput_tok_s == pytest.approx(2_531.0)  # 25,310 decode tokens / 10 s
    # TTFT Δ: 50 in (0.1,0.2], 58 in (0.2,0.4], 12 in (0.4,0.6]; N=120.
    #   p50 rank 60: 0.2 + 0.2*10/58; p90 rank 108: top of (0.2,0.4]; p99 rank 118.8:
    #   0.4 + 0.2*10.8/12.
    assert q(second.ttft_ms) == approx_q(1000 * (0.2 + 0.2 * 10 / 58), 400.0, 580.0)
    # ITL Δ: 9,000 (0.006,0.008], 11,000 (0.008,0.01], 3,500 (0.01,0.015],
    #   380 (0.015,0.02], 120 (0.04,0.06]; N=24,000.
    assert q(second.itl_ms) == approx_q(
        1000 * (0.008 + 0.002 * 3_000 / 11_000),  # rank 12,000
        1000 * (0.010 + 0.005 * 1_600 / 3_500),  # rank 21,600
        1000 * (0.015 + 0.005 * 260 / 380),  # rank 23,760
    )
    # TPOT Δ: 40 (0.006,0.008], 65 (0.008,0.01], 15 (0.01,0.015]; N=120.
    assert q(second.tpot_ms) == approx_q(
        1000 * (0.008 + 0.002 * 20 / 65), 1000 * (0.010 + 0.005 * 3 / 15), 14.6
    )
    # e2e Δ: 15 (0.8,1], 60 (1,2], 37 (2,4], 8 (4,6]; N=120.
    assert q(second.e2e_ms) == approx_q(1_750.0, 1000 * (2 + 2 * 33 / 37), 5_700.0)
    assert second.shape == shape and second.slot_candidates == slots


def test_report_explains_sources_and_ages() -> None:
    sc = INDEX["eagle3_adaptive"]
    b = builder_for("eagle3_adaptive")
    b.feed(1000.0, metrics("eagle3_adaptive_A.prom"), body(sc["server_info"]))
    report = b.last_report
    assert report is not None
    assert report.sources["running_requests"] == "metrics"  # no loads fed: the gauge
    assert report.sources["kv_capacity_tokens"] == "server_info"
    assert report.observation.running_requests == 48
    assert any("first scrape" in n for n in report.notes)
    assert report.window is None and not report.restart_detected


def test_gauge_fallback_without_loads() -> None:
    first, second, _ = replay("eagle3_adaptive", with_loads=False)
    assert (first.running_requests, first.queued_requests, first.token_usage) == (48, 3, 0.4101)
    assert (second.running_requests, second.queued_requests, second.token_usage) == (52, 1, 0.4398)
    # internal_states[0].memory_usage.token_capacity
    assert second.kv_capacity_tokens == 398_540
    assert second.staleness_s == 0.0  # the gauges moved between the scrapes


# --------------------------------------------------------------- restart / start-up


def test_restart_is_reported_and_never_gives_negative_rates() -> None:
    sc = INDEX["eagle3_adaptive"]
    b = builder_for("eagle3_adaptive")
    info = body(sc["server_info"])
    b.feed(1000.0, metrics("eagle3_adaptive_A.prom"), info)
    b.feed(1010.0, metrics("eagle3_adaptive_B.prom"), info)
    after = b.feed(1030.0, metrics("eagle3_adaptive_restarted.prom"))
    report = b.last_report
    assert report is not None and report.restart_detected
    assert any("restart" in n for n in report.notes)
    for name in (
        "window_s",
        "generation_tokens",
        "verify_calls",
        "accept_length",
        "gen_throughput_tok_s",
        "retractions",
        "ttft_ms",
        "itl_ms",
        "e2e_ms",
    ):
        assert getattr(after, name) is None, name
    # The shape may have changed with the restart: unknown until /server_info is re-read.
    assert after.shape is None and after.slot_candidates is None
    assert after.running_requests == 6  # gauges still tell the current load
    # The next window is clean again (the same counters 10 s later: nothing finished).
    again = b.feed(1040.0, metrics("eagle3_adaptive_restarted.prom"), info)
    assert again.window_s == 10.0 and again.generation_tokens == 0
    assert again.gen_throughput_tok_s == 0.0
    assert again.accept_length is None  # no verify call in the window: unknown, not 0
    assert again.shape == SpecShape("EAGLE3", 3, 1, 4, (0, 1, 3, 5))


def test_starting_server_has_only_constants() -> None:
    b = ObservationBuilder()
    obs = b.feed(5.0, metrics("starting_metrics.prom"))
    assert obs.running_requests is None and obs.queued_requests is None
    assert obs.token_usage is None and obs.spec_num_steps is None
    assert obs.kv_capacity_tokens == 398_540  # emit_constants ran at start-up
    assert obs.staleness_s is None and obs.shape is None
    report = b.last_report
    assert report is not None and report.sources["kv_capacity_tokens"] == "metrics"


def test_nan_and_missing_series_are_unknown() -> None:
    b = ObservationBuilder(adaptive_config=body("eagle3_adaptive_config.json"))
    obs = b.feed(1.0, metrics("nan_missing.prom"), body("eagle3_adaptive_server_info.json"))
    assert obs.running_requests == 52
    assert obs.queued_requests is None  # never set
    assert obs.token_usage is None  # NaN
    assert obs.spec_num_steps is None  # never set
    report = b.last_report
    assert report is not None
    assert any("sglang:token_usage" in n for n in report.notes)


# ---------------------------------------------------------------------- (b), (c)


def test_golden_nonspec_tp2() -> None:
    first, second = replay("nonspec_tp2")
    none = SpecShape("NONE", 0, 0, 0, ())
    assert first.shape == none and first.slot_candidates is None
    assert (first.running_requests, first.queued_requests, first.token_usage) == (63, 13, 0.8301)
    assert first.kv_capacity_tokens == 512_000  # one pool: TP ranks are not summed
    assert first.spec_num_steps == 0  # a non-speculative scheduler reports 0 steps
    assert second.generation_tokens == 30_000
    assert second.gen_throughput_tok_s == pytest.approx(3_125.0)  # 31,250 / 10 s
    assert second.verify_calls is None and second.accept_length is None
    assert second.retractions is None  # the counter was never exported: unknown
    # TTFT Δ: 20 (0.4,0.6], 30 (0.6,0.8], 10 (0.8,1]; N=60.
    assert q(second.ttft_ms) == approx_q(1000 * (0.6 + 0.2 * 10 / 30), 880.0, 988.0)
    # ITL Δ: 18,000 (0.01,0.015], 11,000 (0.015,0.02], 1,000 (0.02,0.025]; N=30,000.
    assert q(second.itl_ms) == approx_q(
        1000 * (0.010 + 0.005 * 15_000 / 18_000), 1000 * (0.015 + 0.005 * 9_000 / 11_000), 23.5
    )
    assert q(second.tpot_ms) == approx_q(17.5, 19.5, 19.95)  # all 60 in (0.015, 0.02]
    assert q(second.e2e_ms) == approx_q(6_500.0, 7_700.0, 7_970.0)  # 20 (4,6], 40 (6,8]


def test_golden_dp2() -> None:
    first, second = replay("dp2")
    assert first.shape == SpecShape("EAGLE", 3, 1, 4, ())  # static: no candidate set
    assert first.slot_candidates is None
    # /v1/loads: counts add up over DP ranks, token usage is their mean.
    assert (first.running_requests, first.queued_requests) == (28 + 27, 1 + 2)
    assert first.token_usage == pytest.approx((0.33 + 0.44) / 2)
    assert first.kv_capacity_tokens == 2 * 200_000
    assert first.spec_num_steps == 3
    assert first.staleness_s == pytest.approx(0.4)  # rank 1 published 0.1 s earlier
    assert (second.running_requests, second.queued_requests) == (29 + 27, 0 + 3)
    assert second.token_usage == pytest.approx(0.40)
    assert second.generation_tokens == 36_000 and second.verify_calls == 14_400
    assert second.accept_length == 2.5
    assert second.gen_throughput_tok_s == pytest.approx((18_100 + 17_700) / 10)
    assert second.retractions == 1 + 2  # rank 1's counter appeared in B: counted from 0
    assert q(second.ttft_ms) == approx_q(400.0, 600.0, 1000 * (0.6 + 0.2 * 13.5 / 15))
    assert q(second.itl_ms) == approx_q(
        1000 * (0.008 + 0.002 * 18_000 / 20_000), 1000 * (0.010 + 0.005 * 12_400 / 15_000), 18.2
    )
    assert q(second.tpot_ms) == approx_q(12.5, 14.5, 14.95)
    assert q(second.e2e_ms) == approx_q(3_500.0, 5_400.0, 5_940.0)


def test_dp2_gauge_fallback_sums_ranks() -> None:
    first, second = replay("dp2", with_loads=False)
    assert (first.running_requests, first.queued_requests) == (30 + 26, 0 + 4)
    assert first.token_usage == pytest.approx((0.35 + 0.45) / 2)
    assert (second.running_requests, second.queued_requests) == (31 + 27, 0 + 3)
    assert second.kv_capacity_tokens == 400_000  # internal_states: one entry per DP rank


# ------------------------------------------------------------------------- aging


def test_stale_gauges_become_unknown() -> None:
    b = ObservationBuilder(max_gauge_age_s=30.0)
    snap = metrics("dp2_A.prom")
    assert b.feed(3000.0, snap).running_requests == 56
    # The same values 20 s later: not seen refreshed for 20 s, still usable.
    held = b.feed(3020.0, snap)
    assert held.running_requests == 56 and held.staleness_s == 20.0
    # 40 s without any change in either replica's gauges: unknown.
    stale = b.feed(3040.0, snap)
    assert stale.running_requests is None and stale.spec_num_steps is None
    assert stale.kv_capacity_tokens == 400_000  # a start-up constant is never aged
    report = b.last_report
    assert report is not None and any("unchanged for 40.0 s" in n for n in report.notes)


def test_dp_ranks_disagreeing_on_steps_give_unknown() -> None:
    lines = []
    for line in (FIXTURES / "dp2_A.prom").read_text().splitlines():
        if line.startswith('sglang:spec_num_steps{dp_rank="1",'):
            line = line.rsplit(" ", 1)[0] + " 1.0"  # rank 1 now runs 1 step, rank 0 still 3
        lines.append(line)
    obs = ObservationBuilder().feed(1.0, parse_metrics("\n".join(lines) + "\n"))
    assert obs.spec_num_steps is None
    assert ObservationBuilder().feed(1.0, metrics("dp2_A.prom")).spec_num_steps == 3


def test_loads_placeholder_mismatch_and_age_limit_fall_back_to_gauges() -> None:
    info = body("dp2_server_info.json")
    loads = body("dp2_loads_A.json")
    # ShmLoadSnapshotWriter's seed snapshot (timestamp 0.0) is not a measurement.
    seeded = copy.deepcopy(loads)
    seeded["loads"][1] = {**seeded["loads"][1], "timestamp": 0.0, "num_running_reqs": 0}
    obs = ObservationBuilder().feed(1.0, metrics("dp2_A.prom"), info, seeded)
    assert obs.running_requests == 30 + 26  # gauges, not 28 + 0
    # A rank missing from /v1/loads while dp_size is 2.
    short = {**loads, "loads": loads["loads"][:1]}
    assert ObservationBuilder().feed(1.0, metrics("dp2_A.prom"), info, short).running_requests == 56
    # Loads older than the limit.
    strict = ObservationBuilder(loads_max_age_s=0.35)
    assert strict.feed(1.0, metrics("dp2_A.prom"), info, loads).running_requests == 56
    assert ObservationBuilder().feed(1.0, None, info, loads).running_requests == 55


def test_min_window_reaches_back() -> None:
    b = ObservationBuilder(min_window_s=15.0)
    b.feed(1000.0, metrics("eagle3_adaptive_A.prom"))
    assert b.feed(1010.0, metrics("eagle3_adaptive_B.prom")).window_s is None
    later = b.feed(1020.0, metrics("eagle3_adaptive_B.prom"))
    assert later.window_s == 20.0 and later.generation_tokens == 24_000


def test_malformed_body_leaves_the_builder_untouched() -> None:
    b = ObservationBuilder()
    b.feed(1000.0, metrics("eagle3_adaptive_A.prom"))
    with pytest.raises(ResponseFormatError):
        b.feed(1010.0, metrics("eagle3_adaptive_B.prom"), {"dp_size": "two"})
    # The failed round neither advanced time nor consumed scrape B as a window base.
    obs = b.feed(1005.0, metrics("eagle3_adaptive_A.prom"))
    assert obs.window_s == 5.0 and obs.generation_tokens == 0


def test_time_must_not_go_backwards() -> None:
    b = ObservationBuilder()
    b.feed(10.0, metrics("eagle3_adaptive_A.prom"))
    with pytest.raises(ValueError, match="backwards"):
        b.feed(9.0, metrics("eagle3_adaptive_A.prom"))
    b.reset()
    assert b.feed(9.0, metrics("eagle3_adaptive_A.prom")).running_requests == 48


@pytest.mark.parametrize(
    "kwargs",
    [{"max_gauge_age_s": 0}, {"loads_max_age_s": -1.0}, {"min_window_s": -1.0}, {"max_history": 1}],
)
def test_builder_validates_settings(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        ObservationBuilder(**kwargs)


# ----------------------------------------------------------------- /server_info


def test_adaptive_without_config_file_uses_sglangs_default_slots() -> None:
    info = {**body("eagle3_adaptive_server_info.json"), "speculative_adaptive_config": None}
    view = parse_server_info(info)
    assert view.shape == SpecShape("EAGLE3", 3, 1, 4, (0, 1, 3, 5, 7))
    assert view.slot_candidates == ((1, (1, 3, 5, 7)), (8, (0, 1, 3)), (32, (0, 1)), (64, (0,)))


def test_adaptive_config_file_not_supplied_leaves_shape_unknown() -> None:
    view = parse_server_info(body("eagle3_adaptive_server_info.json"))
    assert view.shape is None and view.slot_candidates is None
    assert "/etc/sglang/adaptive.json" in view.notes[0]
    assert view.kv_capacity_tokens == 398_540 and view.dp_size == 1


def test_unmodelled_algorithm_and_incomplete_shape() -> None:
    base = body("dp2_server_info.json")
    view = parse_server_info({**base, "speculative_algorithm": "DFLASH"})
    assert view.shape is None and "DFLASH" in view.notes[0]
    view = parse_server_info({**base, "speculative_num_steps": None})
    assert view.shape is None and "not all reported" in view.notes[0]
    view = parse_server_info({**base, "speculative_algorithm": "eagle"})
    assert view.shape == SpecShape("EAGLE", 3, 1, 4, ())
    # topk 1 with draft tokens != steps + 1 is not a shape SGLang would run.
    view = parse_server_info({**base, "speculative_num_draft_tokens": 7})
    assert view.shape is None and "num_steps + 1" in view.notes[0]


def test_capacity_from_top_level_needs_dp_size() -> None:
    base = {k: v for k, v in body("dp2_server_info.json").items() if k != "internal_states"}
    assert parse_server_info(base).kv_capacity_tokens == 2 * 200_000
    no_dp = {k: v for k, v in base.items() if k != "dp_size"}
    assert parse_server_info(no_dp).kv_capacity_tokens is None


@pytest.mark.parametrize(
    ("patch", "needle"),
    [
        ({"speculative_num_steps": "3"}, "speculative_num_steps"),
        ({"speculative_adaptive": "yes"}, "speculative_adaptive"),
        ({"speculative_algorithm": 3}, "speculative_algorithm"),
        ({"internal_states": {"memory_usage": {}}}, "internal_states"),
        ({"dp_size": 0}, "dp_size"),
    ],
)
def test_malformed_server_info_names_the_key(patch: dict[str, Any], needle: str) -> None:
    info = {**body("dp2_server_info.json"), **patch}
    with pytest.raises(ResponseFormatError, match=needle) as err:
        parse_server_info(info)
    assert "/server_info" in str(err.value)


def test_upstream_values_in_messages_and_notes_are_bounded_and_escaped() -> None:
    # Issue 9: a huge or control-laden value from /server_info is quoted elided and
    # escaped, never rendered whole (a 10^6-item list) or raw (ESC, NUL) into a message.
    base = body("dp2_server_info.json")
    with pytest.raises(ResponseFormatError, match="speculative_algorithm") as err:
        parse_server_info({**base, "speculative_algorithm": list(range(1_000_000))})
    assert len(str(err.value)) < 1_500 and "..." in str(err.value)
    with pytest.raises(ResponseFormatError, match="dp_size") as err:
        parse_server_info({**base, "dp_size": "\x1b[2J\x00" * 1000})
    message = str(err.value)
    assert message.isprintable() and "\\x1b" in message and len(message) < 1_500
    view = parse_server_info({**base, "speculative_algorithm": "X\x1b]0;t\x07" * 10_000})
    assert view.notes[0].isprintable() and len(view.notes[0]) < 300


def test_bad_adaptive_config_fails_at_construction() -> None:
    with pytest.raises(ValueError, match="candidate_steps"):
        ObservationBuilder(adaptive_config={"1": {"candidate_steps": []}})


# -------------------------------------------------------------------- /v1/loads


@pytest.mark.parametrize(
    ("mutate", "needle"),
    [
        (lambda d: d.update(loads={}), "loads"),
        (lambda d: d.update(timestamp="yesterday"), "timestamp"),
        (lambda d: d["loads"][0].update(num_running_reqs=-1), r"loads\[0\].num_running_reqs"),
        (lambda d: d["loads"][0].update(token_usage="high"), r"loads\[0\].token_usage"),
        (lambda d: d["loads"][1].update(dp_rank=0), "each DP rank once"),
        (lambda d: d["loads"][0].pop("dp_rank"), r"loads\[0\].dp_rank"),
    ],
)
def test_malformed_loads_names_the_key(mutate: Any, needle: str) -> None:
    loads = copy.deepcopy(body("dp2_loads_A.json"))
    mutate(loads)
    with pytest.raises(ResponseFormatError, match=needle):
        parse_loads(loads)


def test_loads_ages_use_the_server_clock_only() -> None:
    view = parse_loads(body("dp2_loads_B.json"))
    assert [r.dp_rank for r in view.ranks] == [0, 1]
    assert [view.age_s(r) for r in view.ranks] == pytest.approx([0.3, 0.4])
    no_clock = {k: v for k, v in body("dp2_loads_B.json").items() if k != "timestamp"}
    view = parse_loads(no_clock)
    assert view.age_s(view.ranks[0]) is None


# ------------------------------------------------------------ fixture provenance


def test_fixtures_regenerate_byte_for_byte(sglang_src: Path, tmp_path: Path) -> None:
    script = FIXTURES / "generate_fixtures.py"
    subprocess.run(
        [sys.executable, str(script), "--sglang-src", str(sglang_src), "--out", str(tmp_path)],
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    )
    produced = sorted(p.name for p in tmp_path.iterdir())
    committed = sorted(p.name for p in FIXTURES.iterdir() if p.suffix in (".prom", ".json"))
    assert produced == committed
    for name in produced:
        assert (tmp_path / name).read_text() == (FIXTURES / name).read_text(), name
