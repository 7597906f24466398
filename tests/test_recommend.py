"""The restart loop's recommender: replay a summarised workload over candidate shapes."""

from __future__ import annotations

import pytest

from specgov.controller.recommend import (
    RecommendError,
    WorkloadSummary,
    fit_acceptance_rate,
    recommend,
    recommendation_document,
)
from specgov.policies.types import SpecShape

H100 = {"gpu": "h100", "model": "llama-3.1-8b", "drafter": "eagle3"}


@pytest.mark.parametrize("alpha", [0.2, 0.5, 0.8])
@pytest.mark.parametrize("steps", [1, 3, 5])
def test_fitted_rate_reproduces_the_accept_length(alpha: float, steps: int) -> None:
    length = (1 - alpha ** (steps + 1)) / (1 - alpha)
    assert fit_acceptance_rate(length, steps) == pytest.approx(alpha, abs=1e-6)


def test_light_load_good_acceptance_recommends_speculating_over_none() -> None:
    workload = WorkloadSummary(
        window_s=300,
        request_rate_rps=1.0,
        mean_input_tokens=600,
        mean_output_tokens=250,
        accept_length=2.8,
        current_steps=3,
    )
    rec = recommend(
        workload,
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
    import specgov.controller.recommend as rec_module

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
