"""Core value types: validation names the field, round trips are lossless."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specgov.policies.common.decisions import (
    Decision,
    Plan,
    ReasonCode,
    RestartRecommendation,
    RestartTrigger,
)
from specgov.policies.common.observation import LatencyQuantiles, LoadSnapshot, Observation
from specgov.policies.common.step_table import SlotRule, StepTable
from specgov.policies.common.types import (
    Budget,
    PolicyTypeError,
    SpecShape,
    TierStat,
    TierStatsSnapshot,
)


def table(slots: tuple[tuple[int, int], ...] = ((1, 5), (8, 3), (32, 0))) -> StepTable:
    return StepTable(slots, version=3, produced_at_s=1000.0, ttl_s=30.0, reason="test")


# ------------------------------------------------------------------------ SpecShape


def test_spec_shape_valid() -> None:
    shape = SpecShape("EAGLE3", 3, 1, 4, (0, 1, 3, 5, 7))
    assert SpecShape.from_dict(json.loads(json.dumps(shape.to_dict()))) == shape
    assert SpecShape("EAGLE", 5, 4, 8, ()).topk == 4  # Llama's auto-chosen tree
    assert SpecShape("NONE", 0, 0, 0, ()).algorithm == "NONE"


@pytest.mark.parametrize(
    ("kwargs", "field", "expected"),
    [
        (dict(algorithm="MEDUSA"), "SpecShape.algorithm", "expected one of"),
        (dict(num_draft_tokens=5), "SpecShape.num_draft_tokens", "num_steps + 1 = 4"),
        (dict(num_steps=0, num_draft_tokens=1), "SpecShape.num_steps", "int >= 1"),
        (dict(topk=0), "SpecShape.topk", "int >= 1"),
        (dict(candidate_steps=(3, 1)), "SpecShape.candidate_steps", "strictly increasing"),
        (dict(candidate_steps=(1, 1)), "SpecShape.candidate_steps", "strictly increasing"),
        (dict(candidate_steps=(-1, 1)), "SpecShape.candidate_steps", "non-negative"),
        (dict(candidate_steps=[1, 3]), "SpecShape.candidate_steps", "tuple"),
        (dict(num_steps=True, num_draft_tokens=2), "SpecShape.num_steps", "int"),
        (dict(algorithm="NONE"), "SpecShape.num_steps", "0 when algorithm is NONE"),
    ],
)
def test_spec_shape_errors_name_the_field(
    kwargs: dict[str, Any], field: str, expected: str
) -> None:
    base: dict[str, Any] = dict(
        algorithm="EAGLE", num_steps=3, topk=1, num_draft_tokens=4, candidate_steps=(1, 3)
    )
    with pytest.raises(PolicyTypeError) as err:
        SpecShape(**{**base, **kwargs})
    assert str(err.value).startswith(field + ":")
    assert expected in str(err.value)


def test_topk_rule_is_for_the_eagle_family_only() -> None:
    assert SpecShape("NGRAM", 4, 1, 8, ()).num_draft_tokens == 8


# ------------------------------------------------------------------------ StepTable


def test_step_table_error_message_names_field_and_form() -> None:
    with pytest.raises(PolicyTypeError) as err:
        table(((1, 5), (1, 3), (8, 1)))
    assert str(err.value) == (
        "StepTable.slots: slot lower bounds must be strictly increasing positive ints "
        "starting at 1, got [1, 1, 8]"
    )


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(slots=()), "StepTable.slots"),
        (dict(slots=((2, 5),)), "StepTable.slots"),
        (dict(slots=((1, -1),)), "StepTable.slots"),
        (dict(slots=((1, 2.0),)), "StepTable.slots"),
        (dict(slots=((1, 2, 3),)), "StepTable.slots"),
        (dict(slots=[(1, 2)]), "StepTable.slots"),
        (dict(version=-1), "StepTable.version"),
        (dict(version=True), "StepTable.version"),
        (dict(produced_at_s=float("nan")), "StepTable.produced_at_s"),
        (dict(ttl_s=0.0), "StepTable.ttl_s"),
        (dict(ttl_s=float("inf")), "StepTable.ttl_s"),
        (dict(reason=None), "StepTable.reason"),
    ],
)
def test_step_table_errors_name_the_field(kwargs: dict[str, Any], field: str) -> None:
    base: dict[str, Any] = dict(slots=((1, 5),), version=0, produced_at_s=0.0, ttl_s=1.0)
    with pytest.raises(PolicyTypeError, match="^" + field.replace(".", r"\.") + ":"):
        StepTable(**{**base, **kwargs})


def test_steps_for_and_slot_for() -> None:
    t = table()
    assert [t.steps_for(b) for b in (1, 7, 8, 31, 32, 1000)] == [5, 5, 3, 3, 0, 0]
    assert [t.slot_for(b) for b in (1, 7, 8, 31, 32, 1000)] == [1, 1, 8, 8, 32, 32]
    # An idle batch (0) uses the first slot, as SGLang's routing does.
    assert t.steps_for(0) == 5


@settings(max_examples=100, deadline=None)
@given(
    bounds=st.sets(st.integers(2, 512), max_size=6),
    steps=st.lists(st.integers(0, 8), min_size=7, max_size=7),
    batch_size=st.integers(1, 600),
)
def test_steps_for_is_the_largest_bound_at_or_below(
    bounds: set[int], steps: list[int], batch_size: int
) -> None:
    all_bounds = [1, *sorted(bounds)]
    t = StepTable(tuple(zip(all_bounds, steps, strict=False)), 0, 0.0, 1.0)
    best = max(b for b in all_bounds if b <= batch_size)
    assert t.slot_for(batch_size) == best
    assert t.steps_for(batch_size) == dict(t.slots)[best]


def test_is_expired() -> None:
    t = table()
    assert t.expires_at_s == 1030.0
    assert not t.is_expired(1029.999)
    assert t.is_expired(1030.0)


def test_validate_against_names_the_bad_slot() -> None:
    t = table()
    t.validate_against([0, 3, 5])
    with pytest.raises(PolicyTypeError, match=r"StepTable\.slots: .*\[0, 3\].*\[\(1, 5\)\]"):
        t.validate_against([0, 3])


def test_step_table_is_frozen_and_slotted() -> None:
    t = table()
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.version = 4  # type: ignore[misc]
    assert not hasattr(t, "__dict__")
    assert dataclasses.replace(t, version=4).steps_for(8) == 3
    assert t == table() and hash(t) == hash(table())


TABLES = st.builds(
    lambda bounds, steps, version, at, ttl, reason: StepTable(
        tuple(zip([1, *sorted(bounds)], steps, strict=False)), version, at, ttl, reason
    ),
    st.sets(st.integers(2, 4096), max_size=8),
    st.lists(st.integers(0, 16), min_size=9, max_size=9),
    st.integers(0, 2**40),
    st.floats(-1e12, 1e12, allow_nan=False),
    st.floats(1e-6, 1e9, allow_nan=False),
    st.text(max_size=20),
)


@settings(max_examples=100, deadline=None)
@given(t=TABLES)
def test_step_table_round_trips_through_json(t: StepTable) -> None:
    data = json.loads(json.dumps(t.to_dict()))
    assert data["schema"] == 1
    back = StepTable.from_dict(data)
    assert back == t
    assert [back.steps_for(b) for b in range(1, 50)] == [t.steps_for(b) for b in range(1, 50)]


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d.pop("ttl_s"), r"missing required field `ttl_s`"),
        (lambda d: d.update(extra=1), r"unknown key\(s\) \['extra'\]"),
        (lambda d: d.update(schema=0), r"key 'schema': expected one of \[1, 2, 3, 4\], got 0"),
        (lambda d: d.update(schema=5), r"table format 5 is newer than this specgov's 4"),
        (lambda d: d.update(rules=[]), r"key 'rules': format 1 has no rules"),
        (lambda d: d.update(slots={"1": 5}), r"Expected `array`, got `object` - at `\$\.slots`"),
        (lambda d: d.update(slots=[[1, 5], [8]]), r"length 2.* - at `\$\.slots\[1\]`"),
        (
            lambda d: d.update(slots=[[1, 5], [8, "3"]]),
            r"Expected `int`, got `str` - at `\$\.slots\[1\]\[1\]`",
        ),
        (lambda d: d.update(version="3"), r"StepTable\.from_dict: .* at `\$\.version`"),
    ],
)
def test_step_table_from_dict_names_keys(mutate: Any, message: str) -> None:
    data = table().to_dict()
    mutate(data)
    with pytest.raises(PolicyTypeError, match=message):
        StepTable.from_dict(data)


def test_a_probe_needs_format_3() -> None:
    rule = SlotRule((0.5,), (0, 3), prior=0.2, probe=1)
    named = dataclasses.replace(table(), rules=((1, rule),)).to_dict()
    assert named["schema"] == 3
    assert StepTable.from_dict(named).rules == ((1, rule),)
    named["schema"] = 2
    with pytest.raises(PolicyTypeError, match=r"key 'rules': format 2 rules carry no 'probe'"):
        StepTable.from_dict(named)


def test_step_table_from_dict_rejects_non_mapping() -> None:
    with pytest.raises(PolicyTypeError, match=r"StepTable\.from_dict: expected an object"):
        StepTable.from_dict([1, 2])  # type: ignore[arg-type]


def test_reason_is_optional_in_dict() -> None:
    data = table().to_dict()
    del data["reason"]
    assert StepTable.from_dict(data).reason == ""


# --------------------------------------------------------------------------- Budget


def test_budget() -> None:
    b = Budget(
        vram_gib=80.0,
        slo_tpot_ms=None,
        slo_itl_p99_ms=50,
        slo_ttft_p99_ms=None,
        allowed_steps=(0, 1, 3),
    )
    # No lossy knob: speculation stays lossless (SGLang's accept thresholds are never set).
    assert not hasattr(b, "allow_lossy")
    with pytest.raises(PolicyTypeError, match=r"^Budget\.vram_gib: expected a finite number > 0"):
        Budget(0.0, None, None, None, None)
    with pytest.raises(PolicyTypeError, match=r"^Budget\.slo_ttft_p99_ms"):
        Budget(None, None, None, -5.0, None)
    with pytest.raises(PolicyTypeError, match=r"^Budget\.allowed_steps"):
        Budget(None, None, None, None, (3, 1))
    with pytest.raises(PolicyTypeError, match=r"^Budget\.allowed_steps"):
        Budget(None, None, None, None, ())


# ------------------------------------------------------------------------ TierStats


def tier(**overrides: Any) -> TierStat:
    base: dict[str, Any] = dict(
        slot=8,
        steps=3,
        verify_calls=4,
        requests=10,
        accepted_hist=(1, 2, 3, 4),
        step_time_sum_s=0.08,
        step_time_count=4,
        batch_size_sum=10,
    )
    return TierStat(**{**base, **overrides})


def test_tier_stat_derived_values() -> None:
    t = tier()
    assert t.key == (8, 3)
    assert t.mean_accepted == pytest.approx((2 + 6 + 12) / 10)
    assert t.mean_step_time_s == pytest.approx(0.02)
    empty = tier(
        verify_calls=0,
        requests=0,
        accepted_hist=(0, 0, 0, 0),
        step_time_sum_s=0.0,
        step_time_count=0,
        batch_size_sum=0,
    )
    assert empty.mean_accepted is None and empty.mean_step_time_s is None


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        (dict(accepted_hist=(1, 2, 7)), "TierStat.accepted_hist"),  # length != steps + 1
        (dict(accepted_hist=(1, 2, 3, 5)), "TierStat.accepted_hist"),  # sum != requests
        (dict(accepted_hist=(1, 2, 3, 4.0)), "TierStat.accepted_hist"),
        (dict(step_time_count=5), "TierStat.step_time_count"),
        (dict(step_time_sum_s=-0.1), "TierStat.step_time_sum_s"),
        (dict(slot=-1), "TierStat.slot"),
        (dict(batch_size_sum=-1), "TierStat.batch_size_sum"),
    ],
)
def test_tier_stat_errors_name_the_field(overrides: dict[str, Any], field: str) -> None:
    with pytest.raises(PolicyTypeError, match="^" + field.replace(".", r"\.") + ":"):
        tier(**overrides)


def test_tier_stats_snapshot_round_trip_and_checks() -> None:
    snap = TierStatsSnapshot(10.0, 11.0, (tier(), tier(slot=1, steps=0, accepted_hist=(10,))))
    back = TierStatsSnapshot.from_dict(json.loads(json.dumps(snap.to_dict())))
    assert back == snap
    assert back.tier(1, 0) == tier(slot=1, steps=0, accepted_hist=(10,))
    assert back.tier(1, 3) is None
    with pytest.raises(PolicyTypeError, match=r"^TierStatsSnapshot\.window_end_s"):
        TierStatsSnapshot(11.0, 10.0, ())
    with pytest.raises(PolicyTypeError, match=r"^TierStatsSnapshot\.tiers: expected unique"):
        TierStatsSnapshot(10.0, 11.0, (tier(), tier()))
    data = snap.to_dict()
    data["tiers"][0]["requests"] = 11
    with pytest.raises(PolicyTypeError, match=r"TierStat\.accepted_hist"):
        TierStatsSnapshot.from_dict(data)
    data = snap.to_dict()
    del data["tiers"][1]["batch_size_sum"]
    with pytest.raises(
        PolicyTypeError, match=r"missing required field `batch_size_sum` - at `\$\.tiers\[1\]`"
    ):
        TierStatsSnapshot.from_dict(data)


# ---------------------------------------------------------------------- Observation


def test_observation_unknowns_are_none() -> None:
    obs = Observation(time_s=5.0)
    assert obs.running_requests is None and obs.accept_length is None
    assert obs.load == LoadSnapshot(None, None, None, None)
    full = Observation(
        time_s=5.0,
        running_requests=12,
        queued_requests=0,
        token_usage=0.4,
        kv_capacity_tokens=400_000,
        gen_throughput_tok_s=1200.0,
        accept_length=2.7,
        itl_ms=LatencyQuantiles(p50_ms=8.0, p99_ms=20.0),
        shape=SpecShape("EAGLE3", 3, 1, 4, (0, 1, 3)),
        table=table(),
        tier_stats=TierStatsSnapshot(4.0, 5.0, ()),
        staleness_s=0.5,
    )
    assert full.load == LoadSnapshot(12, 0, 0.4, 400_000)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(time_s=float("inf")), "Observation.time_s"),
        (dict(running_requests=-1), "Observation.running_requests"),
        (dict(queued_requests=1.5), "Observation.queued_requests"),
        (dict(token_usage=-0.1), "Observation.token_usage"),
        (dict(accept_length=float("nan")), "Observation.accept_length"),
        (dict(staleness_s=-1.0), "Observation.staleness_s"),
        (dict(table={"slots": []}), "Observation.table"),
        (dict(itl_ms=(1.0, 2.0, 3.0)), "Observation.itl_ms"),
    ],
)
def test_observation_errors_name_the_field(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(PolicyTypeError, match="^" + field.replace(".", r"\.") + ":"):
        Observation(**{"time_s": 1.0, **kwargs})


def test_latency_quantiles_are_ordered() -> None:
    assert LatencyQuantiles(p90_ms=3.0).p50_ms is None
    with pytest.raises(PolicyTypeError, match=r"^LatencyQuantiles\.p99_ms: expected >= p50_ms"):
        LatencyQuantiles(p50_ms=10.0, p99_ms=5.0)
    with pytest.raises(PolicyTypeError, match=r"^LatencyQuantiles\.p90_ms"):
        LatencyQuantiles(p90_ms=-1.0)


def test_load_snapshot_errors() -> None:
    with pytest.raises(PolicyTypeError, match=r"^LoadSnapshot\.kv_capacity_tokens"):
        LoadSnapshot(1, 1, 0.5, -3)


# ------------------------------------------------------------------------- Decision


def test_reason_code_is_a_string_enum() -> None:
    assert ReasonCode.HELD_MIN_DWELL == "held_min_dwell"
    assert ReasonCode("rolled_back_regression") is ReasonCode.ROLLED_BACK_REGRESSION
    assert len({r.value for r in ReasonCode}) == len(ReasonCode)


def test_decision() -> None:
    d = Decision(
        table(),
        ReasonCode.CHANGED_PREDICTED_GAIN,
        "slot 8: 3 -> 1 steps",
        0.04,
        limited_by=("slo_itl_p99",),
    )
    assert d.restart_trigger is None
    hold = Decision(None, ReasonCode.HELD_STALE_TELEMETRY, "metrics 30 s old", None)
    assert hold.table is None


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(reason="initial"), "Decision.reason"),
        (dict(message="  "), "Decision.message"),
        (dict(expected_gain=float("nan")), "Decision.expected_gain"),
        (dict(limited_by=["slo"]), "Decision.limited_by"),
        (dict(limited_by=("",)), "Decision.limited_by"),
        (dict(table="t"), "Decision.table"),
        (dict(restart_trigger={"since_s": 0.0}), "Decision.restart_trigger"),
    ],
)
def test_decision_errors_name_the_field(kwargs: dict[str, Any], field: str) -> None:
    base: dict[str, Any] = dict(
        table=None, reason=ReasonCode.INITIAL, message="m", expected_gain=None
    )
    with pytest.raises(PolicyTypeError, match="^" + field.replace(".", r"\.") + ":"):
        Decision(**{**base, **kwargs})


def test_a_restart_trigger_predicts_nothing_and_round_trips() -> None:
    trigger = RestartTrigger(since_s=12.5, summary="plain looked better for 130 s")
    assert trigger.to_dict() == {"since_s": 12.5, "summary": "plain looked better for 130 s"}
    assert RestartTrigger.from_dict(trigger.to_dict()) == trigger
    with pytest.raises(PolicyTypeError, match=r"^RestartTrigger\.summary:"):
        RestartTrigger(since_s=0.0, summary=" ")
    with pytest.raises(PolicyTypeError, match=r"^RestartTrigger\.since_s:"):
        RestartTrigger(since_s=float("nan"), summary="x")
    with pytest.raises(PolicyTypeError, match="predicted_gain"):
        RestartTrigger.from_dict({"since_s": 0.0, "summary": "x", "predicted_gain": 0.2})


def test_a_restart_recommendation_names_its_metric() -> None:
    none = SpecShape("NONE", 0, 0, 0, ())
    rec = RestartRecommendation(none, "replay", "plain", 0.13, metric="throughput_tok_s")
    assert rec.to_dict()["metric"] == "throughput_tok_s"
    assert RestartRecommendation.from_dict(rec.to_dict()) == rec
    legacy = {k: v for k, v in rec.to_dict().items() if k != "metric"}
    assert RestartRecommendation.from_dict(legacy).metric == "goodput_tok_s"  # older records
    with pytest.raises(PolicyTypeError, match=r"^RestartRecommendation\.metric:"):
        RestartRecommendation(none, "replay", "plain", 0.13, metric="slo_attainment")


def test_plan() -> None:
    plan = Plan(
        ((1, 5), (8, 3)), ReasonCode.CHANGED_PREDICTED_GAIN, "m", 0.1, experiment_slots=(8,)
    )
    assert (plan.steps_for(0), plan.steps_for(9), plan.slot_for(100)) == (5, 3, 8)
    assert plan.rule_for(1) is None
    assert Plan(None, ReasonCode.HELD_NO_CHANGE, "hold", None).slots is None


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(slots=((2, 3),)), "Plan.slots"),
        (dict(slots=((1, -1),)), "Plan.slots"),
        (dict(experiment_slots=(4,)), "Plan.experiment_slots"),
        (dict(rules=((1, "r"),)), "Plan.rules"),
        (dict(reason="initial"), "Plan.reason"),
        (dict(message=""), "Plan.message"),
        (dict(limited_by=("",)), "Plan.limited_by"),
    ],
)
def test_plan_errors_name_the_field(kwargs: dict[str, Any], field: str) -> None:
    base: dict[str, Any] = dict(
        slots=((1, 3),), reason=ReasonCode.INITIAL, message="m", expected_gain=None
    )
    with pytest.raises(PolicyTypeError, match="^" + field.replace(".", r"\.") + ":"):
        Plan(**{**base, **kwargs})


def test_the_adaptive_config_gives_the_one_slot_layout_observations_and_the_guard_use() -> None:
    from specgov.policies.common.codec import from_data, to_data
    from specgov.policies.common.types import SlotLayout
    from specgov.policies.engine.adaptive_config import (
        DEFAULT_ADAPTIVE_CONFIG,
        parse_adaptive_config,
    )

    layout = parse_adaptive_config(DEFAULT_ADAPTIVE_CONFIG).layout
    assert layout == ((1, (1, 3, 5, 7)), (8, (0, 1, 3)), (32, (0, 1)), (64, (0,)))
    assert Observation(time_s=1.0, slot_candidates=layout).slot_candidates == layout
    # Saved and loaded through the codec with its constraints: no slot without steps.
    saved = json.loads(json.dumps(to_data(layout)))
    assert from_data(SlotLayout, saved, where="layout", error=PolicyTypeError) == layout
    with pytest.raises(PolicyTypeError, match=r"length >= 1 - at `\$\[1\]\[1\]`"):
        from_data(SlotLayout, [[1, [1]], [8, []]], where="layout", error=PolicyTypeError)


@dataclasses.dataclass(frozen=True)
class _Leaf:
    value: float
    _cache: float = dataclasses.field(default=0.0, init=False)


@dataclasses.dataclass(frozen=True)
class _Tree:
    leaves: tuple[_Leaf, ...]
    by_name: dict[str, tuple[_Leaf, ...]]
    tags: frozenset[str] = frozenset()


def test_to_data_drops_derived_fields_at_every_depth_and_gives_lists() -> None:
    from specgov.policies.common.codec import to_data

    tree = _Tree(
        leaves=(_Leaf(1.0), _Leaf(2.0)), by_name={"a": (_Leaf(3.0),)}, tags=frozenset({"x"})
    )
    data = to_data(tree)
    assert data == {
        "leaves": [{"value": 1.0}, {"value": 2.0}],
        "by_name": {"a": [{"value": 3.0}]},
        "tags": ["x"],
    }
    # Lists all the way down (JSON-ready; a tuple would compare unequal to a list).
    assert type(data["leaves"]) is list and type(data["by_name"]["a"]) is list
    assert type(data["tags"]) is list
