"""The restart loop's recommender: replay a summarised workload over candidate shapes."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from specgov.controller.daemon.recommend import (
    Recommendation,
    RecommendError,
    WorkloadSummary,
    busy_steps,
    fit_acceptance_rate,
    recommend,
    recommendation_document,
    restart_recommendation,
    saturated_concurrency,
    table_as_run,
    table_policy,
    window_acceptance,
    window_table,
)
from specgov.controller.daemon.replay_check import measured_gain, replay_restart_check
from specgov.policies.common.step_table import SlotRule, StepTable
from specgov.policies.common.types import SpecShape
from specgov.simulator.replay.runner import replay
from specgov.simulator.workload.traces import Trace

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))  # benchmarks.policies: the suite's scenarios

H100 = {"gpu": "h100", "model": "llama-3.1-8b", "drafter": "eagle3"}
# Light load, good acceptance: speculation pays.
LIGHT = WorkloadSummary(
    window_s=300,
    request_rate_rps=1.0,
    mean_input_tokens=600,
    mean_output_tokens=250,
    accept_length=2.8,
    current_steps=3,
)


@pytest.mark.parametrize("alpha", [0.2, 0.5, 0.8])
@pytest.mark.parametrize("steps", [1, 3, 5])
def test_fitted_rate_reproduces_the_accept_length(alpha: float, steps: int) -> None:
    length = (1 - alpha ** (steps + 1)) / (1 - alpha)
    assert fit_acceptance_rate(length, steps) == pytest.approx(alpha, abs=1e-6)


def test_light_load_good_acceptance_recommends_speculating_over_none() -> None:
    rec = recommend(
        LIGHT,
        **H100,
        current=SpecShape("NONE", 0, 0, 0, ()),
        slo_tpot_ms=50,
        horizon_s=90,
    )
    assert rec.policy != "none"
    assert rec.current_label == "no speculation"
    assert rec.predicted_gain > 0.0 or rec.predicted_gain == pytest.approx(0.0, abs=0.02)
    # The launch flags come once, from the structured recommendation's shape.
    doc = recommendation_document(rec.structured(), 0.0, rec.to_dict())
    assert "--speculative-algorithm" in doc["launch"]["argv"] and doc["launch"]["error"] is None
    assert "argv" not in doc["details"] and "adaptive_config" not in doc["details"]
    by_name = {r["candidate"]: r for r in rec.candidates}
    assert by_name["no speculation"]["tpot_p50_ms"] > by_name[rec.label]["tpot_p50_ms"]


def test_saturated_with_poor_acceptance_recommends_no_speculation() -> None:
    workload = WorkloadSummary(
        window_s=300,
        request_rate_rps=40.0,
        mean_input_tokens=1500,
        mean_output_tokens=300,
        accept_length=1.15,
        current_steps=3,
    )
    rec = recommend(
        workload,
        **H100,
        current=SpecShape("EAGLE3", 3, 1, 4, (3,)),
        slo_tpot_ms=50,
        horizon_s=60,
    )
    assert rec.policy == "none"
    assert rec.shape.algorithm == "NONE"
    assert rec.predicted_gain > 0.0
    assert rec.current_label == "chain, 3 steps"


def test_no_traffic_is_a_clear_error() -> None:
    empty = WorkloadSummary(60, 0.0, 0.0, 0.0, None, None)
    with pytest.raises(RecommendError, match="no finished requests"):
        recommend(empty, **H100, current=None, slo_tpot_ms=50)


def test_when_the_emas_zero_slots_stay_at_0_the_skip_flag_is_replayed_and_reported(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The trigger itself (recommend_skip_zero_step: every slot that can choose 0 spent
    # >= 90 % of >= 200 batches there) is tested in test_launch_config; here it fires,
    # and the restart loop replays the EMA with the step-0 draft-extend pass skipped.
    import specgov.controller.daemon.recommend as rec_module

    seen: list[dict[tuple[int, int], int]] = []

    def fires(hist: dict[tuple[int, int], int], slots: object, **_: object) -> str:
        seen.append(dict(hist))
        return "the slots that can choose 0 stayed at 0 under load"

    monkeypatch.setattr(rec_module, "recommend_skip_zero_step", fires)
    workload = WorkloadSummary(300, 40.0, 1500, 300, 1.15, 3)
    rec = recommend(
        workload, **H100, current=SpecShape("EAGLE3", 3, 1, 4, (3,)), slo_tpot_ms=50, horizon_s=30
    )
    assert len(seen) == 1 and seen[0]  # called once, with the EMA run's steps histogram
    skip = [r for r in rec.candidates if r.get("environment")]
    assert [r["environment"] for r in skip] == [{"SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND": "1"}]
    ema = next(
        r for r in rec.candidates if r["candidate"].startswith("adaptive") and r is not skip[0]
    )
    assert skip[0]["goodput_tok_s"] != ema["goodput_tok_s"]  # a real second replay
    assert any("replayed with it" in n for n in rec.notes), rec.notes


# ------------------------------------------- the restart decision (issue 20 §4)


def test_saturation_is_queued_requests_in_most_of_the_window() -> None:
    assert saturated_concurrency([(10, 5), (12, 3), (9, 0)]) == pytest.approx(13.0)
    assert saturated_concurrency([(10, 0), (12, 3), (9, 0)]) is None  # a burst
    assert saturated_concurrency([(None, None)]) is None
    assert table_policy(((1, 3), (64, 0))) == "batch-table:1=3,64=0"
    table = ((1, 3), (64, 1), (128, 0))
    assert [busy_steps(table, n) for n in (0.5, 63.9, 100.0, 200.0)] == [3, 3, 1, 0]


def test_a_closed_population_is_saturated_without_a_queue() -> None:
    # 256 closed-loop users under a 256-request batch cap: none queued but at the ends
    # (the users-256 windows, measured), the ramp-up and drain at the ends left out.
    held = [(0, 0), *[(256, 0)] * 24, (250, 6), (253, 3), (116, 0)]
    assert saturated_concurrency(held) == pytest.approx(256.0)
    # Open-loop Poisson arrivals spread the requests in the server: not a population.
    rng = np.random.default_rng(0)
    for mean in (1.0, 4.0, 50.0, 256.0):
        open_loop = [(int(n), 0) for n in rng.poisson(mean, size=40)]
        assert saturated_concurrency(open_loop) is None, mean
    assert saturated_concurrency([(0, 0)] * 10) is None  # idle
    assert saturated_concurrency([(4, 0)] * 3) is None  # too few samples to tell


def test_the_window_acceptance_at_zero_busy_steps_is_the_last_measured_above_zero() -> None:
    samples = [(1.8, 2), (1.17, 1), (None, 0), (1.0, 0)]
    assert window_acceptance(samples, 0) == (1.17, 1)  # the busy slot verifies nothing
    assert window_acceptance(samples, 3) == (1.0, 3)  # the last sample, at the busy steps
    assert window_acceptance([(None, 0), (1.0, 0)], 0) == (None, 0)  # the catalog's profile
    assert window_acceptance([], None) == (None, None)
    # A window ending in a drain (nothing verified in its last scrape): the last known one.
    assert window_acceptance([(1.09, 1), (1.06, 0), (None, 1)], 1) == (1.06, 1)


def test_the_baseline_is_the_table_as_its_rules_ran_at_the_windows_acceptance() -> None:
    # Slot 64's rule at the daemon's prior says 1 step (its slots step); the window's
    # first-draft rate (0.095: accept length 1.095 at 1 step) is under its threshold.
    rule = SlotRule(thresholds=(0.3, 0.6), steps=(0, 1, 2), prior=0.4)
    table = StepTable(((1, 2), (64, 1)), version=1, produced_at_s=0.0, ttl_s=60.0,
                      rules=((64, rule),))  # fmt: skip
    assert table_as_run(table, 0.095) == ((1, 2), (64, 0))
    assert table_as_run(table, 0.7) == ((1, 2), (64, 2))
    assert table_as_run(table, None) == table.slots  # no evidence: the prior's steps
    accepts = [(1.5, 1), (1.095, 1)]
    slots, accept, steps = window_table(table, [64, 64, 66], accepts, gauge_steps=0)
    assert (slots, accept, steps) == (((1, 2), (64, 0)), 1.095, 1)
    assert window_table(None, [64], accepts, gauge_steps=1) == (None, 1.095, 1)


def _rec(gain: float, window_s: float = 300.0, policy: str = "none") -> Recommendation:
    workload = WorkloadSummary(window_s, 10.0, 500, 200, None, None)
    shape = (
        SpecShape("NONE", 0, 0, 0, ()) if policy == "none" else SpecShape("EAGLE3", 1, 1, 2, (1,))
    )
    return Recommendation(
        label="no speculation" if policy == "none" else "chain, 1 step",
        policy=policy,
        shape=shape,
        predicted_goodput_tok_s=100.0 * (1 + gain),
        current_label="the step table in force",
        current_goodput_tok_s=100.0,
        predicted_gain=gain,
        candidates=(),
        workload=workload,
    )


def test_the_recommendation_fires_only_for_a_sustained_gain_of_ten_percent() -> None:
    doc = restart_recommendation(_rec(0.25), drafter="eagle3")
    assert doc is not None
    assert doc["configuration"]["drafter"] == "none" and doc["configuration"]["algorithm"] == "NONE"
    assert (doc["metric"], doc["predicted_gain"]) == ("goodput_tok_s", 0.25)
    assert restart_recommendation(_rec(0.099), drafter="eagle3") is None  # under 10 %
    assert restart_recommendation(_rec(0.5, window_s=60.0), drafter="eagle3") is None  # burst
    other = restart_recommendation(_rec(0.2, policy="static:1"), drafter="eagle3")
    assert other is not None and other["configuration"]["drafter"] == "eagle3"


def test_equal_goodput_compares_tpot_p50() -> None:
    from specgov.controller.daemon.recommend import choose_candidate

    rows = [
        {"candidate": "a", "goodput_tok_s": 100.0, "tpot_p50_ms": 20.0},
        {"candidate": "b", "goodput_tok_s": 100.5, "tpot_p50_ms": 16.0},
        {"candidate": "c", "goodput_tok_s": 90.0, "tpot_p50_ms": 10.0},  # loses goodput
    ]
    choice, metric, gain = choose_candidate(rows, rows[0])
    assert (choice["candidate"], metric) == ("b", "tpot_p50_ms")
    assert gain == pytest.approx(20.0 / 16.0 - 1.0)
    rows[1]["goodput_tok_s"] = 130.0
    choice, metric, gain = choose_candidate(rows, rows[0])
    assert (choice["candidate"], metric, gain) == ("b", "goodput_tok_s", pytest.approx(0.3))


def test_a_baseline_that_did_not_fit_is_no_baseline() -> None:
    # The table in force replayed without a result (it did not fit): the gain is unknown,
    # not a KeyError, and nothing is recommended on it.
    from specgov.controller.daemon.recommend import choose_candidate

    rows = [{"candidate": "plain", "goodput_tok_s": 100.0, "tpot_p50_ms": 20.0}]
    current = {"candidate": "the step table in force", "fits": False}
    choice, metric, gain = choose_candidate(rows, current)
    assert (choice["candidate"], metric, gain) == ("plain", "goodput_tok_s", math.inf)


def _suite_replay(scenario_id: str, data_dir: Path) -> tuple[Any, Any]:
    """One suite scenario replayed as `specgov replay` does: none and goodput, then the
    restart check of the goodput daemon (what its daemon saw)."""
    from benchmarks.policies import scenarios

    (sc,) = scenarios.select([scenario_id], quick=False)
    requests = scenarios.build_requests(sc.workload, data_dir)
    server = sc.server()
    trace = Trace(name=sc.id, requests=tuple(requests), source=sc.id)
    report = replay(trace, server, ["none", "goodput"], seed=0, concurrency=sc.workload.concurrency)
    checks = replay_restart_check(
        report.runs,
        requests,
        gpu=server.gpu,
        model=server.model,
        drafter=server.drafter,
        slo_tpot_ms=report.slo.tpot_ms,
        horizon_s=90.0,
    )
    by = {run.policy.name: run.summary for run in report.runs}
    return checks["goodput"], by


@pytest.mark.parametrize(
    "scenario_id", ["users-256/h100/eagle3", "users-256/h100/ngram", "conv-16x/h100/ngram"]
)
def test_restart_recommendation_on_the_suites_saturation_scenarios(
    azure_trace_dir: Path, scenario_id: str
) -> None:
    # The check fires exactly where replaying the plain server gains >= 10 % on the metric
    # it predicted on (throughput for a window it judged saturated, else goodput):
    # users-256/h100/ngram fires (none: +218 % goodput, +13 % throughput, measured);
    # users-256/h100/eagle3 stays silent (none: -10 % goodput, +2 % throughput);
    # conv-16x/h100/ngram fires (none: +15 % throughput; its busy slot runs 0 steps, so
    # the acceptance is the small slots': window_acceptance). Both users-256 windows are
    # closed populations (no queue) judged saturated, on throughput (users-256/eagle3's
    # rates are within 1 %: a TPOT p50 tie-break).
    rec, by = _suite_replay(scenario_id, azure_trace_dir.parent.parent)
    metric = by["goodput"]["restart_metric"]
    assert metric in ("goodput_tok_s", "throughput_tok_s", "tpot_p50_ms")
    measured = measured_gain(by["none"], by["goodput"], metric)
    assert measured is not None
    assert by["goodput"]["restart_recommendation"] is rec  # the replay JSON's object
    if measured < 0.10:
        assert rec is None
        return
    assert rec is not None  # ...and the recommendation fires, to restart without the drafter
    assert rec["configuration"]["drafter"] == "none" and rec["metric"] == metric
    assert rec["predicted_gain"] >= 0.10 and rec["measured_gain"] == pytest.approx(measured)
    # goodput's own trigger fired too (at 75-90 s, measured); it adds only that time to the
    # JSON: the one prediction is the check's.
    assert rec["source"] == "replay" and by["goodput"]["restart_triggered_s"] > 0


def test_restart_recommendation_is_silent_where_speculation_pays(azure_trace_dir: Path) -> None:
    rec, by = _suite_replay("users-4/h100/eagle3", azure_trace_dir.parent.parent)
    assert by["goodput"]["goodput_tok_s"] >= by["none"]["goodput_tok_s"]  # speculation pays
    assert rec is None and by["goodput"]["restart_recommendation"] is None


# ------------------------------------------------------------- budget.vram_gib


def test_the_vram_budget_keeps_shapes_that_need_more_out_of_the_recommendation() -> None:
    # Llama-3.1-8B on an H100 (80 GiB): with 30 GiB to use, SGLang's pools leave a KV
    # pool without a drafter and none with one (simulator/engine/memory.py).
    free = recommend(LIGHT, **H100, current=None, slo_tpot_ms=50, horizon_s=60)
    assert free.policy != "none" and all(r["fits"] for r in free.candidates)
    tight = recommend(LIGHT, **H100, current=None, slo_tpot_ms=50, horizon_s=60, vram_gib=30.0)
    by_name = {r["candidate"]: r for r in tight.candidates}
    assert by_name["no speculation"]["fits"]
    assert tight.policy == "none"
    speculative = [r for name, r in by_name.items() if name != "no speculation"]
    assert speculative and not any(r["fits"] for r in speculative)
    assert all("GiB" in r["reason"] for r in speculative)


def _restart_loop(config: Any, workload: WorkloadSummary, metrics: Any = None) -> Any:
    """(the daemon's restart loop over a telemetry whose window is *workload*, the status it
    writes), on a clock at 0 with snapshots dropped."""
    import asyncio

    from specgov.controller.daemon.restart_loop import RestartLoop
    from specgov.controller.daemon.status_view import DaemonStatus

    class Telemetry:  # the window the restart loop summarises
        observation = None

        def workload_summary(self, since_s: float | None = None) -> WorkloadSummary:
            return workload

    status = DaemonStatus(started_at_s=0.0)
    loop = RestartLoop(
        lambda: config,
        telemetry=Telemetry(),  # type: ignore[arg-type]
        metrics=metrics,
        status_info=status,
        clock=lambda: 0.0,
        snapshot=lambda _key, _write: None,
        stop=asyncio.Event(),
        every=None,  # type: ignore[arg-type]
    )
    return loop, status


def test_budget_vram_gib_from_the_config_reaches_the_restart_loop(tmp_path: Path) -> None:
    """config.yaml's budget.vram_gib -> the daemon's restart loop -> its recommender."""
    import asyncio

    from specgov.controller.daemon.config import load_config

    path = tmp_path / "specgov.yaml"
    path.write_text(
        "deployment:\n  gpu: h100\n  model: llama-3.1-8b\n  drafter: eagle3\n"
        "budget:\n  vram_gib: 20\n",
        encoding="utf-8",
    )
    config = load_config(path, env={})
    assert config.budget.vram_gib == 20.0

    loop, status = _restart_loop(config, LIGHT)
    assert asyncio.run(loop.recommend_once()) is None
    assert status.recommendation is not None
    assert status.recommendation["message"] == (
        "no candidate shape fits this deployment within budget.vram_gib = 20 GiB"
    )


def test_a_saturated_window_is_judged_on_throughput() -> None:
    from specgov.controller.daemon.recommend import RecommendError, choose_candidate

    rows = [
        {"candidate": "spec", "goodput_tok_s": 100.0, "throughput_tok_s": 1000.0},
        {"candidate": "plain", "goodput_tok_s": 20.0, "throughput_tok_s": 1150.0},
    ]
    choice, metric, gain = choose_candidate(rows, rows[0], "throughput_tok_s")
    assert (choice["candidate"], metric, gain) == ("plain", "throughput_tok_s", pytest.approx(0.15))
    choice, metric, _ = choose_candidate(rows, rows[0])  # goodput: the plain server loses
    assert (choice["candidate"], metric) == ("spec", "goodput_tok_s")
    assert measured_gain(rows[1], rows[0], "throughput_tok_s") == pytest.approx(0.15)
    with pytest.raises(RecommendError, match="metric must be one of"):
        choose_candidate(rows, rows[0], "tokens")


# ------------------------------------------------------- the policy's restart trigger

# A light load whose table in force runs 0 steps (a poor drafter): the plain server keeps
# the goodput and cuts TPOT p50 (the check's tie-break), by more than 10 % (measured).
POOR_AT_ZERO = WorkloadSummary(
    window_s=300,
    request_rate_rps=4.0,
    mean_input_tokens=500,
    mean_output_tokens=150,
    accept_length=1.15,
    current_steps=1,
    table=((1, 0),),
)


def test_a_policy_trigger_runs_the_calibrated_check_once_per_regime(tmp_path: Path) -> None:
    """A policy's restart trigger predicts nothing: the daemon's restart loop answers it
    with the restart check over the trigger's window, whose recommendation (gain, metric,
    configuration) is the one status, store and metrics show; once per regime."""
    import asyncio
    import time

    from prometheus_client import CollectorRegistry

    from specgov.controller.daemon.config import load_config
    from specgov.controller.daemon.own_metrics import DaemonMetrics, render_metrics
    from specgov.controller.daemon.restart_loop import RestartLoop
    from specgov.controller.daemon.status_view import DaemonStatus
    from specgov.policies.common.decisions import RestartTrigger

    path = tmp_path / "specgov.yaml"
    path.write_text("budget:\n  slo_tpot_ms: 50\n", encoding="utf-8")
    config = load_config(path, env={})
    windows: list[float | None] = []

    class Telemetry:  # the window the restart loop summarises
        observation = None

        def workload_summary(self, since_s: float | None = None) -> WorkloadSummary:
            windows.append(since_s)
            return POOR_AT_ZERO

    now = [1000.0]
    stored: dict[str, Any] = {}
    status = DaemonStatus(started_at_s=0.0)
    metrics = DaemonMetrics(CollectorRegistry())
    loop = RestartLoop(
        lambda: config,
        telemetry=Telemetry(),  # type: ignore[arg-type]
        metrics=metrics,
        status_info=status,
        clock=lambda: now[0],
        snapshot=lambda key, _write: stored.setdefault(key, True),
        stop=asyncio.Event(),
        every=None,  # type: ignore[arg-type]
    )
    young = RestartTrigger(since_s=950.0, summary="plain has looked better for 50 s")
    trigger = RestartTrigger(since_s=700.0, summary="plain has looked better for 300 s")

    async def go() -> None:
        assert not loop.trigger(young, now[0])  # a burst so far: no check yet
        assert loop.trigger(trigger, now[0])
        assert not loop.trigger(trigger, now[0])  # one check at a time
        end = time.monotonic() + 300
        while (status.recommendation is None) and time.monotonic() < end:
            await asyncio.sleep(0.05)  # waiting on the check's result, bounded
        now[0] += 600.0
        assert not loop.trigger(trigger, now[0])  # the same regime: checked once

    asyncio.run(go())
    assert windows == [trigger.since_s]  # the trigger's regime is the window replayed
    expected = recommend(
        POOR_AT_ZERO, **H100, current=None, slo_tpot_ms=50.0, vram_gib=config.budget.vram_gib
    )
    assert restart_recommendation(expected, drafter="eagle3") is not None
    doc = status.recommendation
    assert doc is not None and doc["source"] == "replay"
    assert doc["shape"]["algorithm"] == expected.shape.algorithm == "NONE"
    assert (doc["metric"], doc["predicted_gain"]) == (expected.metric, expected.predicted_gain)
    assert doc["details"]["trigger"] == trigger.to_dict()
    assert "setting:recommendation" in stored
    text = render_metrics(metrics.registry)[0].decode()
    assert (
        f'specgov_restart_recommended_gain_ratio{{algorithm="NONE",metric="{expected.metric}",'
        f'num_steps="0",source="replay"}} {expected.predicted_gain}'
    ) in text


# ----------------------------------------- a replay that does not describe its window


def test_window_tpot_is_the_median_of_the_scrapes_that_measured_one() -> None:
    from specgov.controller.daemon.recommend import window_tpot

    assert window_tpot([12.0, None, 10.0, float("nan"), 0.0, 11.0]) == 11.0
    assert window_tpot([None, float("inf")]) is None


def test_replay_fidelity_names_both_tpots_when_they_are_far_apart() -> None:
    from specgov.controller.daemon.recommend import FIDELITY_FACTOR, replay_fidelity

    row = {"candidate": "the step table in force", "tpot_p50_ms": 52.8}
    assert replay_fidelity(row, 52.8 / FIDELITY_FACTOR) is None  # the bound is inside
    assert replay_fidelity(row, 52.8 * FIDELITY_FACTOR) is None
    assert replay_fidelity(row, None) is None and replay_fidelity(None, 14.7) is None
    # phase/h100/ngram (measured): 52.8 ms replayed, 14.7 ms measured.
    why = replay_fidelity(row, 14.7)
    assert why is not None and "52.8 ms replayed against 14.7 ms measured" in why


def test_a_replay_that_does_not_reproduce_the_windows_tpot_predicts_nothing(
    tmp_path: Path,
) -> None:
    """Within FIDELITY_FACTOR of the window's measured TPOT p50 the check fires as before;
    beyond it the gain is no prediction: silent, in the check and in the daemon's status."""
    import asyncio
    from dataclasses import replace

    from specgov.controller.daemon.config import load_config

    path = tmp_path / "specgov.yaml"
    path.write_text("budget:\n  slo_tpot_ms: 50\n", encoding="utf-8")
    config = load_config(path, env={})

    def check(workload: WorkloadSummary) -> Any:
        return recommend(workload, **H100, current=None, slo_tpot_ms=50, horizon_s=90)

    rec = check(POOR_AT_ZERO)
    base = next(r for r in rec.candidates if r["candidate"] == "the step table in force")
    assert rec.unreliable is None and restart_recommendation(rec, drafter="eagle3") is not None
    near = check(replace(POOR_AT_ZERO, tpot_p50_ms=base["tpot_p50_ms"] * 1.5))
    assert near.unreliable is None and restart_recommendation(near, drafter="eagle3") is not None
    far_workload = replace(POOR_AT_ZERO, tpot_p50_ms=base["tpot_p50_ms"] * 3)
    far = check(far_workload)
    assert far.unreliable is not None and "does not reproduce the window" in far.unreliable
    assert far.unreliable in far.notes and far.to_dict()["unreliable"] == far.unreliable
    assert restart_recommendation(far, drafter="eagle3") is None

    loop, status = _restart_loop(config, far_workload)
    assert asyncio.run(loop.recommend_once()) is None
    assert status.recommendation is not None and status.recommendation["recommendation"] is None
    assert "does not reproduce the window" in status.recommendation["message"]


def test_a_replays_run_measures_a_recommendation_only_of_the_same_configuration() -> None:
    from specgov.controller.daemon.recommend import Recommendation
    from specgov.controller.daemon.replay_check import measures_recommendation

    def rec(policy: str, shape: SpecShape, env: tuple[tuple[str, str], ...] = ()) -> Any:
        return Recommendation(
            label=policy,
            policy=policy,
            shape=shape,
            predicted_goodput_tok_s=1.0,
            current_label="now",
            current_goodput_tok_s=1.0,
            predicted_gain=0.2,
            candidates=(),
            workload=LIGHT,
            environment=env,
        )

    plain = rec("none", SpecShape("NONE", 0, 0, 0, ()))
    chain = rec("static:5", SpecShape("EAGLE3", 5, 1, 6, (5,)))
    tree = rec("static:5", SpecShape("EAGLE3", 5, 4, 8, (5,)))
    skip = rec(
        "sglang-ema",
        SpecShape("EAGLE3", 3, 1, 4, (0, 1, 3, 5, 7)),
        (("SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND", "1"),),
    )
    assert measures_recommendation(plain) and measures_recommendation(plain, topk=4)
    assert measures_recommendation(chain) and not measures_recommendation(chain, topk=4)
    assert not measures_recommendation(tree)  # a chain server's static:5 is no tree
    assert measures_recommendation(tree, topk=4, num_draft_tokens=8)
    assert not measures_recommendation(tree, topk=4, num_draft_tokens=16)
    assert not measures_recommendation(skip)  # replay servers run without the flag


def test_a_recommendation_that_needs_the_skip_flag_launches_with_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Recommendation.environment -> the restart loop -> the launch document that status,
    `specgov recommend` and the apply hook see: flags and the environment together."""
    import asyncio

    import specgov.controller.daemon.recommend as rec_module
    from specgov.controller.daemon.config import load_config

    flag = {"SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND": "1"}
    skip = Recommendation(
        label="adaptive (SGLang EMA, default slots) + SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND=1",
        policy="sglang-ema",
        shape=SpecShape("EAGLE3", 3, 1, 4, (0, 1, 3, 5, 7)),
        predicted_goodput_tok_s=120.0,
        current_label="the step table in force",
        current_goodput_tok_s=100.0,
        predicted_gain=0.2,
        candidates=(),
        workload=LIGHT,
        environment=tuple(flag.items()),
    )
    monkeypatch.setattr(rec_module, "recommend", lambda *_a, **_k: skip)
    path = tmp_path / "specgov.yaml"
    path.write_text("budget:\n  slo_tpot_ms: 50\n", encoding="utf-8")
    config = load_config(path, env={})

    from prometheus_client import CollectorRegistry

    from specgov.controller.daemon.own_metrics import DaemonMetrics

    loop, status = _restart_loop(config, LIGHT, DaemonMetrics(CollectorRegistry()))
    data = asyncio.run(loop.recommend_once())
    assert data is not None and status.recommendation is data
    assert data["launch"]["environment"] == flag and data["launch"]["error"] is None
    assert "--speculative-algorithm" in data["launch"]["argv"]
    # SGLang's EMA launches on its default slot table, as the check replayed it.
    assert "--speculative-adaptive" in data["launch"]["argv"]
    assert data["launch"]["adaptive_config"] is not None
    # Without the environment the same shape launches without the flag.
    plain = recommendation_document(skip.structured(), 0.0, skip.to_dict())
    assert plain["launch"]["environment"] == {} and plain["launch"]["error"] is None
