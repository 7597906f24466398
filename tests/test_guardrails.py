"""Guardrails: each step on its own, then the wrapper end to end (policies/guardrails.py)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pytest

from specgov.policies.common.codec import from_data, to_data
from specgov.policies.common.decisions import Decision, Plan, ReasonCode, RestartRecommendation
from specgov.policies.common.observation import LatencyQuantiles, Observation
from specgov.policies.common.step_table import StepTable
from specgov.policies.common.types import Budget, PolicyTypeError, SpecShape, TierStatsSnapshot
from specgov.policies.daemon.protocol import DaemonPolicy
from specgov.policies.guardrails import (
    GUARD_STEPS,
    ChangeTrial,
    GuardContext,
    GuardedPolicy,
    GuardedState,
    GuardrailConfig,
    GuardrailError,
    Override,
    Proposal,
    SlotHistory,
    Wanted,
    WindowAggregate,
    WindowSample,
    active_overrides,
    clamp_step,
    clamp_to_candidates_and_budget,
    effective_dwell_s,
    evaluate_trial,
    freeze_on_unknown_telemetry,
    min_dwell,
    on_publish_result,
    pinned_policy,
    rate_limit,
    tolerance_band,
    with_override,
    without_overrides,
)

Slots = tuple[tuple[int, int], ...]

# SGLang 0.5.23's default slots and candidates (adaptive_spec_params.DEFAULT_ADAPTIVE_CONFIG).
CANDS: tuple[tuple[int, tuple[int, ...]], ...] = (
    (1, (1, 3, 5, 7)),
    (8, (0, 1, 3)),
    (32, (0, 1)),
    (64, (0,)),
)
A: Slots = ((1, 5), (8, 3), (32, 1), (64, 0))
B: Slots = ((1, 3), (8, 1), (32, 0), (64, 0))
OPEN = Budget(None, None, None, None, None)
H = ReasonCode


# ------------------------------------------------------------------ fake policies


@dataclass(frozen=True)
class CallState:
    calls: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"version": 1, "calls": self.calls}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CallState:
        return cls(calls=data["calls"])


Step = tuple[Slots | None, float | None]


class Scripted:
    """Plays ``script[i]`` on call i (the last entry forever, or cyclically)."""

    def __init__(
        self,
        script: Sequence[Step],
        *,
        cyclic: bool = False,
        reason: ReasonCode = H.CHANGED_PREDICTED_GAIN,
        limited_by: tuple[str, ...] = (),
        restart: RestartRecommendation | None = None,
        name: str = "scripted",
    ) -> None:
        self._script = list(script)
        self._cyclic = cyclic
        self._reason = reason
        self._limited_by = limited_by
        self._restart = restart
        self._name = name

    @property
    def name(self) -> str:
        return self._name

    def initial_state(self) -> CallState:
        return CallState()

    def state_from_dict(self, data: Mapping[str, Any]) -> CallState:
        return CallState.from_dict(data)

    def decide(
        self, observation: Observation, state: CallState, budget: Budget
    ) -> tuple[Plan, CallState]:
        i = state.calls
        slots, gain = (
            self._script[i % len(self._script)]
            if self._cyclic
            else self._script[min(i, len(self._script) - 1)]
        )
        if slots is None:
            plan = Plan(None, H.HELD_NO_CHANGE, "holding", None)
        else:
            plan = Plan(
                slots, self._reason, "scripted table", gain, self._limited_by, self._restart
            )
        return plan, CallState(i + 1)


def const(slots: Slots, gain: float | None = 0.05) -> Scripted:
    return Scripted([(slots, gain)])


# ------------------------------------------------------------------- observations


def obs(
    t: float,
    *,
    tokens: int | None = 5000,
    window_s: float | None = 5.0,
    running: int | None = 8,
    staleness_s: float | None = 0.5,
    tier_age_s: float | None = 1.0,
    tpot_p50_ms: float | None = 20.0,
    itl_p99_ms: float | None = 40.0,
    cands: tuple[tuple[int, tuple[int, ...]], ...] | None = CANDS,
    table: StepTable | None = None,
) -> Observation:
    tiers = (
        None if tier_age_s is None else TierStatsSnapshot(t - tier_age_s - 1.0, t - tier_age_s, ())
    )
    return Observation(
        time_s=t,
        running_requests=running,
        slot_candidates=cands,
        staleness_s=staleness_s,
        tier_stats=tiers,
        window_s=window_s,
        generation_tokens=tokens,
        tpot_ms=None if tpot_p50_ms is None else LatencyQuantiles(p50_ms=tpot_p50_ms),
        itl_ms=None if itl_p99_ms is None else LatencyQuantiles(p99_ms=itl_p99_ms),
        table=table,
    )


Run = list[tuple[float, Decision, GuardedState[Any]]]


def drive(
    policy: GuardedPolicy[Any],
    times: Sequence[float],
    make: Callable[[float], Observation] = obs,
    *,
    state: GuardedState[Any] | None = None,
    budget: Budget = OPEN,
    between: Callable[[float, GuardedState[Any]], GuardedState[Any]] | None = None,
    overrides: Sequence[Override] = (),
) -> Run:
    st = policy.initial_state() if state is None else state
    out: Run = []
    for t in times:
        if between is not None:
            st = between(t, st)
        decision, st = policy.decide(make(t), st, budget, overrides=overrides)
        out.append((t, decision, st))
    return out


def every(start: float, stop: float, step: float = 5.0) -> list[float]:
    n = round((stop - start) / step)
    return [start + i * step for i in range(n + 1)]


def in_force(run: Run) -> Slots | None:
    table = run[-1][2].table
    return None if table is None else table.slots


def changes(run: Run) -> list[tuple[float, Slots]]:
    """(time, new steps) of every published table whose steps differ from the one before."""
    out: list[tuple[float, Slots]] = []
    last: Slots | None = None
    for t, decision, _ in run:
        if decision.table is not None:
            if last is not None and decision.table.slots != last:
                out.append((t, decision.table.slots))
            last = decision.table.slots
    return out


FAST = GuardrailConfig(min_dwell_s=0.0, rollback_enabled=False, max_changes_per_window=100)


# ------------------------------------------------------------------------- config


def test_config_defaults_are_valid_and_round_trip() -> None:
    config = GuardrailConfig()
    assert config.min_gain == 0.02 and config.table_ttl_s == 30.0
    data = json.loads(json.dumps(to_data(config)))
    assert GuardrailConfig.from_dict(data) == config
    assert GuardrailConfig.from_dict({}) == config
    assert GuardrailConfig.from_dict({"min_gain": 0.05}).min_gain == 0.05


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"table_ttl_s": 0}, "GuardrailConfig.table_ttl_s"),
        ({"min_gain": -0.1}, "GuardrailConfig.min_gain"),
        ({"min_dwell_s": float("nan")}, "GuardrailConfig.min_dwell_s"),
        ({"keepalive_fraction": 1.5}, "GuardrailConfig.keepalive_fraction"),
        ({"rollback_threshold": 1.0}, "GuardrailConfig.rollback_threshold"),
        ({"max_changes_per_window": 0}, "GuardrailConfig.max_changes_per_window"),
        ({"max_changes_per_window": 1}, "GuardrailConfig.max_changes_per_window"),
        ({"rollback_enabled": 1}, "GuardrailConfig.rollback_enabled"),
        ({"rollback_min_tokens": 2.5}, "GuardrailConfig.rollback_min_tokens"),
        ({"max_dwell_s": 10.0}, "GuardrailConfig.max_dwell_s"),
        ({"rollback_max_wait_s": 5.0}, "GuardrailConfig.rollback_max_wait_s"),
        ({"required_fields": ("bogus",)}, "GuardrailConfig.required_fields"),
        ({"rollback_max_load_ratio": 0.5}, "GuardrailConfig.rollback_max_load_ratio"),
    ],
)
def test_config_rejects_bad_values_naming_the_field(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(GuardrailError, match=field.replace(".", r"\.")):
        GuardrailConfig(**kwargs)


def test_config_allows_one_change_per_window_without_rollback() -> None:
    assert (
        GuardrailConfig(max_changes_per_window=1, rollback_enabled=False).policy_change_limit == 1
    )
    assert GuardrailConfig(max_changes_per_window=3).policy_change_limit == 2


def test_config_from_dict_names_key_path() -> None:
    with pytest.raises(GuardrailError, match=r"guardrails: unknown key\(s\) \['min_gian'\]"):
        GuardrailConfig.from_dict({"min_gian": 0.1})
    with pytest.raises(GuardrailError, match=r"daemon\.guardrails\.min_gain: expected"):
        GuardrailConfig.from_dict({"min_gain": "lots"}, where="daemon.guardrails")
    with pytest.raises(GuardrailError, match="expected a mapping"):
        GuardrailConfig.from_dict([1, 2])  # type: ignore[arg-type]
    config = GuardrailConfig.from_dict({"required_fields": ["slot_candidates"]})
    assert config.required_fields == ("slot_candidates",)


# ----------------------------------------------------------------------- override


def test_override_validation_names_the_field() -> None:
    ok = {"expires_at_s": 100.0, "reason": "incident 42", "created_at_s": 0.0}
    assert Override(steps=3, slot=8, **ok).target_steps == 3  # type: ignore[arg-type]
    assert Override(disable_speculation=True, **ok).target_steps == 0  # type: ignore[arg-type]
    with pytest.raises(GuardrailError, match="exactly one of"):
        Override(**ok)  # type: ignore[arg-type]
    with pytest.raises(GuardrailError, match="exactly one of"):
        Override(steps=3, disable_speculation=True, **ok)  # type: ignore[arg-type]
    with pytest.raises(GuardrailError, match=r"Override\.slot"):
        Override(pin_policy="static:1", slot=8, **ok)  # type: ignore[arg-type]
    with pytest.raises(GuardrailError, match=r"Override\.slot"):
        Override(steps=1, slot=0, **ok)  # type: ignore[arg-type]
    with pytest.raises(GuardrailError, match=r"Override\.steps"):
        Override(steps=-1, **ok)  # type: ignore[arg-type]
    with pytest.raises(GuardrailError, match=r"Override\.reason"):
        Override(steps=1, expires_at_s=10.0, reason=" ", created_at_s=0.0)
    with pytest.raises(GuardrailError, match=r"Override\.expires_at_s"):
        Override(steps=1, expires_at_s=0.0, reason="x", created_at_s=0.0)
    with pytest.raises(GuardrailError, match=r"Override\.pin_policy"):
        Override(pin_policy="", **ok)  # type: ignore[arg-type]


def test_override_round_trips_and_rejects_bad_dicts() -> None:
    o = Override(slot=8, steps=1, expires_at_s=90.0, reason="r", created_at_s=10.0)
    assert Override.from_dict(json.loads(json.dumps(o.to_dict()))) == o
    with pytest.raises(GuardrailError, match=r"unknown key\(s\) \['extra'\]"):
        Override.from_dict({**o.to_dict(), "extra": 1})
    with pytest.raises(GuardrailError, match="key 'version'"):
        Override.from_dict({**o.to_dict(), "version": 9})


# --------------------------------------------------------------- step: clamp_step


@pytest.mark.parametrize(
    ("steps", "cands", "allowed", "expected", "limits"),
    [
        (3, (1, 3, 5, 7), None, 3, ()),
        (4, (1, 3, 5, 7), None, 3, ("limited_by_candidates",)),
        (0, (1, 3, 5, 7), None, 1, ("limited_by_candidates",)),
        (9, (0, 1, 3), None, 3, ("limited_by_candidates",)),
        (5, (1, 3, 5, 7), (0, 1, 3), 3, ("limited_by_budget",)),
        (4, (1, 3, 5, 7), (0, 1), 1, ("limited_by_candidates", "limited_by_budget")),
        (1, (0, 1, 3), (0,), 0, ("limited_by_budget",)),
        # The Budget allows none of the slot's candidates: the engine's set, reported.
        (5, (1, 3, 5, 7), (0,), 5, ("limited_by_budget",)),
    ],
)
def test_clamp_step(
    steps: int,
    cands: tuple[int, ...],
    allowed: tuple[int, ...] | None,
    expected: int,
    limits: tuple[str, ...],
) -> None:
    assert clamp_step(steps, cands, allowed) == (expected, limits)


# -------------------------------------------------- steps as pure functions


def ctx(
    current: Slots | None,
    *,
    wanted: Slots | None = None,
    gain: float | None = 0.05,
    observation: Observation | None = None,
    budget: Budget = OPEN,
) -> GuardContext:
    o = observation or obs(100.0)
    inner = Plan(None, H.HELD_NO_CHANGE, "x", None)
    w = None if wanted is None else Wanted(wanted, gain, H.CHANGED_PREDICTED_GAIN)
    return GuardContext(o, budget, inner, CANDS, current, w)


def state_with(**kwargs: Any) -> GuardedState[CallState]:
    return dataclasses.replace(GuardedState(inner=CallState(), inner_name="s"), **kwargs)


def test_step_order_is_the_documented_one() -> None:
    assert [name for name, _ in GUARD_STEPS] == [
        "freeze_on_unknown_telemetry",
        "apply_overrides",
        "tolerance_band",
        "min_dwell",
        "rate_limit",
        "clamp_to_candidates_and_budget",
        "rollback",
    ]


def test_freeze_step_holds_on_each_missing_required_field() -> None:
    config = GuardrailConfig()
    for name in config.required_fields:
        o = dataclasses.replace(obs(100.0), **{name: None})
        p, _ = freeze_on_unknown_telemetry(ctx(A, observation=o), Proposal(B), state_with(), config)
        assert p.frozen == H.HELD_UNKNOWN_TELEMETRY and p.steps == A, name
        assert name in p.notes[-1]
    fresh, st = freeze_on_unknown_telemetry(ctx(A), Proposal(B), state_with(), config)
    assert fresh.frozen is None and fresh.steps == B and st.last_fresh_s == 100.0


def test_freeze_step_holds_on_stale_metrics_or_tier_stats() -> None:
    config = GuardrailConfig(max_staleness_s=10.0, max_tier_stats_age_s=15.0)
    stale = obs(100.0, staleness_s=10.5)
    p, _ = freeze_on_unknown_telemetry(ctx(A, observation=stale), Proposal(B), state_with(), config)
    assert p.frozen == H.HELD_STALE_TELEMETRY and p.steps == A
    old = obs(100.0, tier_age_s=16.0)
    p, _ = freeze_on_unknown_telemetry(ctx(A, observation=old), Proposal(B), state_with(), config)
    assert p.frozen == H.HELD_STALE_TELEMETRY and "tier stats" in p.notes[-1]
    ok = obs(100.0, staleness_s=10.0, tier_age_s=15.0)
    p, _ = freeze_on_unknown_telemetry(ctx(A, observation=ok), Proposal(B), state_with(), config)
    assert p.frozen is None


def test_tolerance_step_holds_small_gains_only() -> None:
    config = GuardrailConfig(min_gain=0.02)
    st = state_with()
    p, _ = tolerance_band(ctx(A, wanted=B, gain=0.01), Proposal(B), st, config)
    assert p.steps == A and p.held_by == H.HELD_TOLERANCE_BAND
    assert "held_tolerance_band" in p.limited_by and "+1.0%" in p.notes[-1]
    p, _ = tolerance_band(ctx(A, wanted=B, gain=-0.3), Proposal(B), st, config)
    assert p.steps == A
    for gain in (0.02, 0.5, None):
        p, _ = tolerance_band(ctx(A, wanted=B, gain=gain), Proposal(B), st, config)
        assert p.steps == B and p.held_by is None, gain
    # Override slots bypass the band.
    p, _ = tolerance_band(
        ctx(A, wanted=B, gain=0.0), Proposal(B, override_slots=frozenset({1, 8, 32})), st, config
    )
    assert p.steps == B


def test_tolerance_step_lets_an_experiment_slot_pass_and_judges_the_rest() -> None:
    # Slot 1 is a probe (no prediction), slots 8 and 32 are predicted moves: a small
    # predicted gain holds the predicted moves only; a large one lets everything pass.
    config = GuardrailConfig(min_gain=0.02)
    st = state_with()
    trial = frozenset({1})

    def with_trial(gain: float | None) -> GuardContext:
        c = ctx(A, wanted=B, gain=gain)
        assert c.wanted is not None
        return dataclasses.replace(c, wanted=dataclasses.replace(c.wanted, experiment_slots=trial))

    p, _ = tolerance_band(with_trial(0.01), Proposal(B), st, config)
    assert p.steps == ((1, 3), (8, 3), (32, 1), (64, 0)) and p.held_by == H.HELD_TOLERANCE_BAND
    assert "[8, 32]" in p.notes[-1]
    for gain in (0.05, None):
        p, _ = tolerance_band(with_trial(gain), Proposal(B), st, config)
        assert p.steps == B and p.held_by is None, gain


class Planned(Scripted):
    """Returns ``plan`` at every call."""

    def __init__(self, plan: Plan) -> None:
        super().__init__([(None, None)])
        self.plan = plan

    def decide(
        self, observation: Observation, state: CallState, budget: Budget
    ) -> tuple[Plan, CallState]:
        return self.plan, CallState(state.calls + 1)


def test_wanted_keeps_the_experiment_slots_of_a_plan_on_engine_bounds() -> None:
    slots = ((1, 3), (16, 0))
    plan = Plan(slots, H.CHANGED_PREDICTED_GAIN, "x", 0.04, experiment_slots=(1,))
    policy = GuardedPolicy(Planned(plan))
    decision, st = policy.decide(obs(10.0), policy.initial_state(), OPEN)
    wanted = st.wanted
    assert wanted is not None
    assert decision.table is not None and decision.table.slots == wanted.steps
    assert wanted.steps == ((1, 3), (8, 3), (32, 0), (64, 0))
    assert wanted.experiment_slots == frozenset({1, 8}) and wanted.expected_gain == 0.04
    with pytest.raises(PolicyTypeError, match="experiment_slots"):
        Plan(slots, H.CHANGED_PREDICTED_GAIN, "x", 0.04, experiment_slots=(8,))


def test_dwell_step_holds_recently_changed_slots_only() -> None:
    config = GuardrailConfig(min_dwell_s=30.0)
    st = state_with(
        slots=(
            SlotHistory(1, changed_at_s=90.0, previous_steps=3),
            SlotHistory(8, changed_at_s=50.0, previous_steps=1),
            SlotHistory(32, changed_at_s=50.0, previous_steps=0),
        )
    )
    p, _ = min_dwell(ctx(A), Proposal(B), st, config)
    assert dict(p.steps or ()) == {1: 5, 8: 1, 32: 0, 64: 0}
    assert p.held_by == H.HELD_MIN_DWELL and "slot 1 changed 10 s ago" in p.notes[-1]


def test_dwell_step_waits_for_a_pending_rollback_check() -> None:
    trial = ChangeTrial(
        version=4, started_at_s=95.0, changes=((8, 1, 3),), baseline=WindowAggregate()
    )
    p, _ = min_dwell(ctx(A), Proposal(B), state_with(trial=trial), GuardrailConfig())
    assert p.steps == A and "v4 is still being checked" in p.notes[-1]


def test_flap_penalty_doubles_dwell_and_decays() -> None:
    config = GuardrailConfig(min_dwell_s=30.0, max_dwell_s=1000.0, flap_half_life_s=100.0)
    calm = SlotHistory(1, changed_at_s=0.0, previous_steps=None)
    assert effective_dwell_s(calm, 0.0, config) == 30.0
    flappy = SlotHistory(1, changed_at_s=0.0, previous_steps=3, flap_penalty=3.0)
    assert effective_dwell_s(flappy, 0.0, config) == pytest.approx(240.0)
    assert effective_dwell_s(flappy, 100.0, config) == pytest.approx(30.0 * 2**1.5)
    assert effective_dwell_s(
        SlotHistory(1, 0.0, 3, flap_penalty=10.0), 0.0, config
    ) == pytest.approx(1000.0)


def test_rate_limit_step_counts_changes_in_the_window() -> None:
    config = GuardrailConfig(rate_window_s=60.0, max_changes_per_window=3)
    busy = state_with(change_times_s=(50.0, 90.0))
    p, _ = rate_limit(ctx(A), Proposal(B), busy, config)
    assert p.steps == A and p.held_by == H.HELD_RATE_LIMIT
    # One change left the window (t=40 is not in (40, 100]): room again.
    calm = state_with(change_times_s=(40.0, 90.0))
    p, _ = rate_limit(ctx(A), Proposal(B), calm, config)
    assert p.steps == B
    no_rollback = GuardrailConfig(max_changes_per_window=3, rollback_enabled=False)
    p, _ = rate_limit(ctx(A), Proposal(B), busy, no_rollback)
    assert p.steps == B


def test_clamp_step_function_marks_budget_enforcement() -> None:
    budget = Budget(None, None, None, None, (0, 1, 3))
    p, _ = clamp_to_candidates_and_budget(
        ctx(A, budget=budget), Proposal(A), state_with(), GuardrailConfig()
    )
    assert dict(p.steps or ()) == {1: 3, 8: 3, 32: 1, 64: 0}
    assert p.forced_slots == {1} and "limited_by_budget" in p.limited_by


# --------------------------------------------------------------- end to end


def test_first_decision_publishes_initial_on_engine_slots() -> None:
    # The inner speaks batch-table bounds; the engine's first slot starts at 2.
    cands = ((2, (1, 3, 5, 7)), (8, (0, 1, 3)), (32, (0, 1)))
    inner = const(((1, 5), (16, 1), (64, 0)))
    policy = GuardedPolicy(inner)
    run = drive(policy, [0.0], lambda t: obs(t, cands=cands))
    decision = run[0][1]
    assert decision.reason == H.INITIAL and decision.table is not None
    # Slot 8 takes the inner's 5 (its bound 1 covers 8), clamped to the candidates.
    assert decision.table.slots == ((1, 5), (8, 3), (32, 1))
    assert decision.limited_by == ("limited_by_candidates",)
    assert decision.table.ttl_s == 30.0 and decision.table.produced_at_s == 0.0
    assert decision.table.reason == "initial"
    assert run[0][2].table == decision.table


def test_version_is_above_the_engines_table() -> None:
    engine = StepTable(A, version=41, produced_at_s=-5.0, ttl_s=30.0)
    run = drive(GuardedPolicy(const(A)), [0.0], lambda t: obs(t, table=engine))
    assert run[0][1].table is not None and run[0][1].table.version == 42


def test_unknown_telemetry_holds_and_inner_state_still_advances() -> None:
    policy = GuardedPolicy(Scripted([(A, 0.5), (B, 0.5)]), FAST)
    run = drive(policy, [0.0, 1.0, 2.0], lambda t: obs(t, tokens=None if t > 0 else 5000))
    reasons = [d.reason for _, d, _ in run]
    assert reasons == [H.INITIAL, H.HELD_UNKNOWN_TELEMETRY, H.HELD_UNKNOWN_TELEMETRY]
    assert all(d.table is None for _, d, _ in run[1:])
    assert in_force(run) == A and run[-1][2].inner == CallState(3)
    assert "generation_tokens is None" in run[1][1].message
    # The inner's table made from unknown telemetry is dropped, not remembered.
    assert run[-1][2].wanted is not None and run[-1][2].wanted.steps == A


def test_nothing_is_published_before_telemetry_is_known() -> None:
    run = drive(GuardedPolicy(const(A)), [0.0, 1.0], lambda t: obs(t, cands=None))
    assert all(d.table is None and d.reason == H.HELD_UNKNOWN_TELEMETRY for _, d, _ in run)
    assert "no table published yet" in run[0][1].message


def test_frozen_table_is_kept_alive_then_left_to_expire() -> None:
    config = GuardrailConfig(frozen_keepalive_s=60.0)
    policy = GuardedPolicy(const(A), config)
    run = drive(policy, every(0.0, 120.0), lambda t: obs(t, staleness_s=0.5 if t == 0 else 30.0))
    published = [(t, d.table.slots) for t, d, _ in run if d.table is not None]
    assert all(slots == A for _, slots in published)
    assert [t for t, _ in published] == [0.0, 15.0, 30.0, 45.0, 60.0]
    assert all(d.reason == H.HELD_STALE_TELEMETRY for _, d, _ in run[1:])


def test_steady_policy_settles_and_keeps_the_ttl_alive() -> None:
    run = drive(GuardedPolicy(const(A)), every(0.0, 600.0))
    assert changes(run) == []
    republished = [t for t, d, _ in run if d.table is not None]
    assert republished == every(0.0, 600.0, 15.0)
    assert {d.reason for _, d, _ in run[1:]} == {H.HELD_NO_CHANGE}
    versions = [d.table.version for _, d, _ in run if d.table is not None]
    assert versions == sorted(set(versions))


def test_policy_change_published_with_reason_and_gain() -> None:
    policy = GuardedPolicy(Scripted([(A, None)] * 8 + [(B, 0.07)]))
    run = drive(policy, every(0.0, 45.0))
    t, decision, _ = next((t, d, s) for t, d, s in run if d.table and d.table.slots == B)
    assert t == 40.0 and decision.reason == H.CHANGED_PREDICTED_GAIN
    assert decision.expected_gain == 0.07 and "+7.0%" in decision.message


def test_tolerance_band_end_to_end_remembers_the_gain_of_a_held_table() -> None:
    # The inner issues B once with a 1 % gain, then stands by it (holds, or re-issues
    # it without a prediction): B is never published.
    script: list[Step] = [(A, None)] * 8 + [(B, 0.01)] + [(None, None), (B, None)] * 20
    run = drive(GuardedPolicy(Scripted(script)), every(0.0, 240.0))
    assert changes(run) == []
    assert any(d.reason == H.HELD_TOLERANCE_BAND for _, d, _ in run)


def test_min_dwell_end_to_end_other_slots_may_change() -> None:
    config = GuardrailConfig(min_dwell_s=60.0, rollback_enabled=False)
    a2 = ((1, 5), (8, 1), (32, 1), (64, 0))
    a3 = ((1, 3), (8, 1), (32, 1), (64, 0))
    script: list[Step] = [(A, None)] * 13 + [(a2, 0.1)] * 2 + [(a3, 0.1)]
    run = drive(GuardedPolicy(Scripted(script), config), every(0.0, 150.0))
    assert changes(run) == [(65.0, a2), (75.0, a3)]
    # Now move slot 8 back: held until 60 s after its change at 65.
    script2 = script + [(a3, 0.1)] * 5 + [(((1, 3), (8, 3), (32, 1), (64, 0)), 0.1)]
    run = drive(GuardedPolicy(Scripted(script2), config), every(0.0, 200.0))
    moves = changes(run)
    assert moves[-1][0] == 125.0
    assert any(d.reason == H.HELD_MIN_DWELL for t, d, _ in run if 100.0 <= t < 125.0)


def test_rate_limit_end_to_end() -> None:
    config = GuardrailConfig(
        min_dwell_s=0.0, rollback_enabled=False, max_changes_per_window=2, rate_window_s=60.0
    )
    run = drive(GuardedPolicy(Scripted([(A, 0.5), (B, 0.5)], cyclic=True), config), every(0, 300))
    times = [t for t, _ in changes(run)]
    assert times == [5.0, 10.0, 65.0, 70.0, 125.0, 130.0, 185.0, 190.0, 245.0, 250.0]
    assert any(d.reason == H.HELD_RATE_LIMIT for _, d, _ in run)


def test_budget_limits_policy_and_forces_change_when_it_tightens() -> None:
    policy = GuardedPolicy(const(A))
    first = drive(policy, [0.0])
    assert first[0][1].table is not None and first[0][1].table.slots == A
    tight = Budget(None, None, None, None, (0, 1))
    run = drive(policy, [5.0], state=first[-1][2], budget=tight)
    decision = run[0][1]
    assert decision.reason == H.LIMITED_BY_BUDGET and decision.table is not None
    assert decision.table.slots == ((1, 1), (8, 1), (32, 1), (64, 0))
    assert "limited_by_budget" in decision.limited_by


def test_proposal_equal_to_the_table_after_clamping_is_no_change() -> None:
    # Slot 8 asks for 4 (not a candidate): clamped to 3, which is already in force.
    script: list[Step] = [(A, None)] * 8 + [(((1, 5), (8, 4), (32, 1), (64, 0)), 0.3)]
    run = drive(GuardedPolicy(Scripted(script)), every(0.0, 60.0))
    assert changes(run) == []
    late = [d for t, d, _ in run if t >= 40.0]
    assert {d.reason for d in late} == {H.HELD_NO_CHANGE}
    assert all("limited_by_candidates" in d.limited_by for d in late)


def test_inner_limited_by_and_restart_recommendation_pass_through() -> None:
    shape = RestartRecommendation(
        SpecShape("EAGLE3", 3, 1, 4, (0, 1, 3)), "policy", "restart with 3 steps", 0.12
    )
    inner = Scripted(
        [(((1, 9), (8, 3), (32, 1), (64, 0)), 0.1)], limited_by=("limited_by_slo",), restart=shape
    )
    decision = drive(GuardedPolicy(inner), [0.0])[0][1]
    assert decision.restart_recommendation == shape
    assert decision.limited_by[:2] == ("limited_by_slo", "limited_by_candidates")
    assert decision.table is not None and decision.table.slots[0] == (1, 7)


def test_engine_layout_change_republishes_as_initial() -> None:
    policy = GuardedPolicy(const(A))
    first = drive(policy, [0.0])
    new_cands = ((1, (1, 3)), (16, (0, 1)))
    run = drive(policy, [5.0], lambda t: obs(t, cands=new_cands), state=first[-1][2])
    decision = run[0][1]
    assert decision.reason == H.INITIAL and decision.table is not None
    assert decision.table.slots == ((1, 3), (16, 1)) and "engine slots changed" in decision.message


# ------------------------------------------------------------------- overrides


def ov(**kwargs: Any) -> Override:
    base: dict[str, Any] = {"expires_at_s": 100.0, "reason": "operator test", "created_at_s": 0.0}
    return Override(**{**base, **kwargs})


def test_override_applies_at_once_clamped_and_expires() -> None:
    policy = GuardedPolicy(const(A))
    start = drive(policy, [0.0])[-1][2]
    ovs = (
        ov(slot=8, steps=0, expires_at_s=40.0),
        ov(slot=1, disable_speculation=True, expires_at_s=40.0),
    )
    run = drive(policy, every(5.0, 50.0), state=start, overrides=ovs)
    d5 = run[0][1]
    assert d5.reason == H.OVERRIDE_ACTIVE and d5.table is not None
    # Slot 1 cannot run without speculation (its candidates are 1, 3, 5, 7): clamped.
    assert d5.table.slots == ((1, 1), (8, 0), (32, 1), (64, 0))
    assert {"override_active", "limited_by_candidates"} <= set(d5.limited_by)
    assert "operator test" in d5.message
    d40 = next(d for t, d, _ in run if t == 40.0)
    assert "override ended" in d40.message and d40.table is not None
    assert "override expired" in d40.message
    assert d40.table.slots == A and d40.reason == H.CHANGED_PREDICTED_GAIN
    assert active_overrides(ovs, 50.0) == () and run[-1][2].override_slots == ()


def test_slot_override_beats_all_slots_override_and_set_replaces() -> None:
    policy = GuardedPolicy(const(A))
    st = drive(policy, [0.0])[-1][2]
    ovs = with_override((), ov(disable_speculation=True, created_at_s=1.0))
    ovs = with_override(ovs, ov(slot=8, steps=3, created_at_s=0.5))
    ovs = with_override(ovs, ov(slot=8, steps=1, created_at_s=0.7))  # replaces slot 8 steps=3
    assert len(ovs) == 2
    decision = drive(policy, [5.0], state=st, overrides=ovs)[0][1]
    assert decision.table is not None
    assert decision.table.slots == ((1, 1), (8, 1), (32, 0), (64, 0))


def test_clear_overrides_returns_slots_to_the_policy_directly() -> None:
    # Dwell would hold slot 8 for 30 s after the override moved it; the return bypasses it.
    policy = GuardedPolicy(const(A))
    st = drive(policy, every(0.0, 60.0))[-1][2]
    ovs = (ov(slot=8, steps=0, expires_at_s=1000.0),)
    st = drive(policy, [65.0], state=st, overrides=ovs)[-1][2]
    assert st.table is not None and dict(st.table.slots)[8] == 0
    assert st.override_slots == (8,)
    assert without_overrides(ovs, slot=32) == ovs  # nothing for slot 32: unchanged
    ovs = without_overrides(ovs)
    decision, st = policy.decide(obs(70.0), st, OPEN, overrides=ovs)
    assert decision.table is not None and decision.table.slots == A
    assert "return to the policy" in decision.message


class KeepsWhatRuns(Scripted):
    """Proposes ``A`` first, then whatever the table in force runs (the extreme of a
    policy that keeps its incumbent step near a tie); records the tables it was shown."""

    def __init__(self) -> None:
        super().__init__([(A, 0.05)])
        self.seen: list[Slots | None] = []

    def decide(
        self, observation: Observation, state: CallState, budget: Budget
    ) -> tuple[Plan, CallState]:
        table = observation.table
        self.seen.append(None if table is None else table.slots)
        if table is None:
            return super().decide(observation, state, budget)
        again = Plan(table.slots, H.HELD_NO_CHANGE, "keeps what runs", None)
        return again, CallState(state.calls + 1)


def test_after_a_clear_the_policy_is_back_at_its_own_choice_not_the_overrides() -> None:
    # The daemon shows the policy the table in force; the override's 0 on slot 8 is the
    # operator's, not the policy's incumbent, so after the clear slot 8 returns to 3.
    inner = KeepsWhatRuns()
    policy = GuardedPolicy(inner)

    def in_force(t: float, st: GuardedState[Any]) -> Observation:
        return obs(t, table=st.table)

    st = policy.initial_state()
    for t in every(0.0, 20.0):
        st = policy.decide(in_force(t, st), st, OPEN)[1]
    assert st.table is not None and st.table.slots == A
    ovs = (ov(slot=8, steps=0, expires_at_s=1000.0),)
    for t in every(25.0, 60.0):
        st = policy.decide(in_force(t, st), st, OPEN, overrides=ovs)[1]
        assert st.table is not None and dict(st.table.slots)[8] == 0
    # While the override held slot 8, the policy saw its own step there, never the 0.
    assert inner.seen[-1] == A and all(dict(s or A)[8] == 3 for s in inner.seen)
    decision, st = policy.decide(in_force(65.0, st), st, OPEN)
    assert decision.table is not None and decision.table.slots == A
    assert "return to the policy" in decision.message
    # Without the operator in the table it is shown (a clear already taken), the policy
    # sees what runs as it is.
    st = policy.decide(in_force(70.0, st), st, OPEN)[1]
    assert inner.seen[-1] == A and st.override_slots == ()


def test_override_applies_under_unknown_telemetry_and_pin_is_recorded() -> None:
    policy = GuardedPolicy(const(A))
    st = drive(policy, [0.0])[-1][2]
    ovs = (ov(slot=32, steps=0), ov(pin_policy="static:1"))
    decision, st = policy.decide(obs(5.0, tokens=None, cands=None), st, OPEN, overrides=ovs)
    # Candidates unknown now but seen before: the override is applied, clamped.
    assert decision.reason == H.OVERRIDE_ACTIVE and decision.table is not None
    assert dict(decision.table.slots)[32] == 0 and "held_unknown_telemetry" in decision.limited_by
    assert "static:1" in decision.message and pinned_policy(ovs, 5.0) == "static:1"
    assert pinned_policy(ovs, 200.0) is None


def test_override_ending_while_frozen_waits_for_fresh_telemetry() -> None:
    policy = GuardedPolicy(const(A))
    st = drive(policy, [0.0])[-1][2]
    run = drive(
        policy,
        every(5.0, 40.0),
        lambda t: obs(t, staleness_s=99.0 if t < 35 else 0.5),
        state=st,
        overrides=(ov(slot=8, steps=0, expires_at_s=20.0),),
    )
    by_t = {t: (d, s) for t, d, s in run}
    assert by_t[5.0][0].reason == H.OVERRIDE_ACTIVE and dict(by_t[5.0][1].table.slots)[8] == 0
    # Expired at 20 while frozen: the table stays as it is ...
    assert all(dict(by_t[t][1].table.slots)[8] == 0 for t in (20.0, 25.0, 30.0))
    assert by_t[30.0][1].override_slots == (8,)
    # ... and slot 8 returns to the policy as soon as telemetry is fresh again.
    assert by_t[35.0][0].table is not None and by_t[35.0][0].table.slots == A
    assert "override ended" in by_t[35.0][0].message


def test_override_for_an_unknown_slot_is_ignored_and_said() -> None:
    policy = GuardedPolicy(const(A))
    st = drive(policy, [0.0])[-1][2]
    decision = drive(policy, [5.0], state=st, overrides=(ov(slot=5, steps=0),))[0][1]
    assert "slot 5 is not an engine slot" in decision.message and decision.table is None


def test_a_failed_publish_is_retried_at_once_with_nothing_charged() -> None:
    # Dwell 30 s and one change per window: a change the engine never saw must not use
    # either, so the retry comes at the very next decision.
    config = GuardrailConfig(max_changes_per_window=2, rollback_enabled=False)
    policy = GuardedPolicy(Scripted([(A, None)] * 8 + [(B, 0.2)] * 20), config)
    run = drive(policy, every(0.0, 35.0))
    before = run[-1][2]
    decision, after = policy.decide(obs(40.0), before, OPEN)
    assert decision.table is not None and decision.table.slots == B
    failed = on_publish_result(before, after, ok=False)
    assert failed.table == before.table and failed.change_times_s == before.change_times_s
    assert failed.slots == before.slots
    retry, again = policy.decide(obs(45.0), failed, OPEN)
    assert retry.table is not None and retry.table.slots == B
    assert retry.table.version > decision.table.version  # a version is never reused
    ok = on_publish_result(failed, again, ok=True)
    assert ok.table == retry.table and len(ok.change_times_s) == len(before.change_times_s) + 1
    # Had it been charged, the second change would now be held by dwell and rate limit.
    held, _ = policy.decide(obs(50.0), on_publish_result(before, after, ok=True), OPEN)
    assert held.table is None or held.table.slots == B


# ------------------------------------------------------------------- rollback


def test_regression_is_rolled_back_and_blocked_for_a_cooldown() -> None:
    config = GuardrailConfig(rollback_cooldown_s=300.0)
    script: list[Step] = [(A, None)] * 8 + [(B, 0.2)]
    policy = GuardedPolicy(Scripted(script), config)

    def make(t: float) -> Observation:
        # B runs 30 % slower per request once the engine has it (change at t=40).
        return obs(t, tokens=3500 if t > 42.0 else 5000)

    run = drive(policy, every(0.0, 450.0), make)
    moves = changes(run)
    assert moves[0] == (40.0, B)
    t_back, restored = moves[1]
    assert restored == A and 60.0 <= t_back <= 80.0
    decision = next(d for t, d, _ in run if t == t_back)
    assert decision.reason == H.ROLLED_BACK_REGRESSION and "-30.0%" in decision.message
    blocked = [d for t, d, _ in run if t_back < t < t_back + 300.0]
    assert all(d.table is None or d.table.slots == A for d in blocked)
    assert any("rollback_cooldown" in d.limited_by for d in blocked)
    # After the cool-down (and dwell) the move is tried again.
    assert len(moves) == 3 and moves[2][1] == B and moves[2][0] >= t_back + 300.0


def test_change_that_does_not_hurt_is_kept() -> None:
    policy = GuardedPolicy(Scripted([(A, None)] * 8 + [(B, 0.2)]))
    run = drive(policy, every(0.0, 200.0), lambda t: obs(t, tokens=5200 if t > 42 else 5000))
    assert changes(run) == [(40.0, B)]
    assert any("kept after its check" in d.message for _, d, _ in run)
    assert run[-1][2].trial is None


def test_broken_slo_is_rolled_back_even_without_goodput_loss() -> None:
    budget = Budget(
        None, slo_tpot_ms=30.0, slo_itl_p99_ms=None, slo_ttft_p99_ms=None, allowed_steps=None
    )
    policy = GuardedPolicy(Scripted([(A, None)] * 8 + [(B, 0.2)]))
    run = drive(
        policy,
        every(0.0, 120.0),
        lambda t: obs(t, tpot_p50_ms=40.0 if t > 42 else 25.0),
        budget=budget,
    )
    moves = changes(run)
    assert [m[1] for m in moves] == [B, A]
    decision = next(d for t, d, _ in run if t == moves[1][0])
    assert decision.reason == H.ROLLED_BACK_REGRESSION and "broke its SLO 30 ms" in decision.message


def test_a_broken_ttft_slo_from_the_config_is_rolled_back(tmp_path: Any) -> None:
    """budget.slo_ttft_p99_ms (config.yaml -> the daemon's Budget) is an SLO the rollback
    judges like the TPOT and ITL ones; without it the same change is kept."""
    from specgov.controller.daemon.config import load_config

    path = tmp_path / "specgov.yaml"
    path.write_text("budget:\n  slo_ttft_p99_ms: 500\n", encoding="utf-8")
    budget = load_config(path, env={}).budget
    assert budget.slo_ttft_p99_ms == 500.0

    def make(t: float) -> Observation:
        ttft = LatencyQuantiles(p99_ms=900.0 if t > 42 else 300.0)
        return dataclasses.replace(obs(t), ttft_ms=ttft)

    script: list[Step] = [(A, None)] * 8 + [(B, 0.2)]
    run = drive(GuardedPolicy(Scripted(script)), every(0.0, 120.0), make, budget=budget)
    moves = changes(run)
    assert [m[1] for m in moves] == [B, A]
    decision = next(d for t, d, _ in run if t == moves[1][0])
    assert decision.reason == H.ROLLED_BACK_REGRESSION
    assert "TTFT p99 300.0 -> 900.0 ms broke its SLO 500 ms" in decision.message
    kept = drive(GuardedPolicy(Scripted(script)), every(0.0, 120.0), make, budget=OPEN)
    assert changes(kept) == [(40.0, B)]
    # A window sample saved before TTFT was measured reads back as unknown.
    old = {"end_s": 5.0, "window_s": 5.0, "tokens": 10, "running": 1}
    sample = from_data(WindowSample, {**old, "tpot_p50_ms": None, "itl_p99_ms": None},
                       where="t", error=ValueError)  # fmt: skip
    assert sample.ttft_p99_ms is None


def test_load_change_is_not_taken_for_a_regression() -> None:
    policy = GuardedPolicy(Scripted([(A, None)] * 8 + [(B, 0.2)]))
    # Half the requests, half the tokens: the same per-request speed.
    run = drive(
        policy,
        every(0.0, 120.0),
        lambda t: obs(t, tokens=2500 if t > 42 else 5000, running=4 if t > 42 else 8),
    )
    assert changes(run) == [(40.0, B)]
    # Load moved by more than rollback_max_load_ratio: inconclusive, kept.
    run = drive(
        policy,
        every(0.0, 120.0),
        lambda t: obs(t, tokens=1000 if t > 42 else 5000, running=2 if t > 42 else 8),
    )
    assert changes(run) == [(40.0, B)]
    assert any("load moved too much" in d.message for _, d, _ in run)


def test_change_without_enough_data_after_it_is_kept_after_max_wait() -> None:
    policy = GuardedPolicy(Scripted([(A, None)] * 8 + [(B, 0.2)]))
    run = drive(policy, every(0.0, 200.0), lambda t: obs(t, tokens=10 if t > 42 else 5000))
    assert changes(run) == [(40.0, B)]
    assert any("not enough data within 120 s" in d.message for _, d, _ in run)


def test_evaluate_trial_needs_enough_data() -> None:
    base = WindowAggregate().add(WindowSample(10.0, 10.0, 2000, 4, None, None))
    trial = ChangeTrial(1, 10.0, ((1, 3, 5),), base)
    config = GuardrailConfig()
    assert evaluate_trial(trial, OPEN, config) == (None, "")
    post = WindowAggregate().add(WindowSample(40.0, 20.0, 1000, 4, None, None))
    verdict, text = evaluate_trial(dataclasses.replace(trial, post=post), OPEN, config)
    assert verdict == "regressed" and "-75.0%" in text


def test_window_aggregate_counts_overlaps_once() -> None:
    agg = WindowAggregate()
    for end in (5.0, 6.0, 7.0):  # 5 s windows scraped every second
        agg = agg.add(WindowSample(end, 5.0, 500, 2, 20.0, None))
    assert agg.seconds == pytest.approx(7.0) and agg.tokens == pytest.approx(700.0)
    assert agg.goodput(per_request=True) == pytest.approx(50.0)
    assert agg.goodput(per_request=False) == pytest.approx(100.0)
    assert agg.tpot_ms == pytest.approx(20.0) and agg.itl_p99_ms is None
    assert agg.add(WindowSample(7.0, 5.0, 500, 2, None, None)) == agg
    assert agg.add(WindowSample(8.0, 5.0, 500, None, None, None)).mean_load is None


# -------------------------------------------------------------- no oscillation


def test_flapping_policy_is_damped_to_a_handful_of_changes_per_hour() -> None:
    flapper = Scripted([(A, 0.05), (B, 0.05)], cyclic=True)
    run = drive(GuardedPolicy(flapper), every(0.0, 7200.0))
    times = [t for t, _ in changes(run)]
    first_hour = [t for t in times if t < 3600.0]
    second_hour = [t for t in times if t >= 3600.0]
    # Unguarded it would change 720 times an hour.
    assert len(first_hour) <= 12 and len(second_hour) <= 6
    assert len(second_hour) >= 1  # damped, not stuck: the policy still gets its turns


def test_flapping_policy_below_the_band_never_moves() -> None:
    flapper = Scripted([(A, 0.01), (B, 0.01)], cyclic=True)
    run = drive(GuardedPolicy(flapper), every(0.0, 3600.0))
    assert changes(run) == []


# ------------------------------------------------------------------- state


def test_state_round_trips_mid_run_and_continues_identically() -> None:
    config = GuardrailConfig(rollback_cooldown_s=300.0)
    policy = GuardedPolicy(Scripted([(A, None)] * 8 + [(B, 0.2)]), config)

    def make(t: float) -> Observation:
        return obs(t, tokens=3500 if t > 42.0 else 5000)

    run = drive(policy, every(0.0, 50.0), make)
    st = run[-1][2]
    assert st.trial is not None and st.samples
    restored = policy.state_from_dict(json.loads(json.dumps(st.to_dict())))
    assert restored == st
    a = drive(policy, every(55.0, 200.0), make, state=st)
    b = drive(policy, every(55.0, 200.0), make, state=restored)
    assert [(d, s) for _, d, s in a] == [(d, s) for _, d, s in b]
    assert any(d.reason == H.ROLLED_BACK_REGRESSION for _, d, _ in a)
    again = policy.state_from_dict(json.loads(json.dumps(a[-1][2].to_dict())))
    assert again == a[-1][2] and again.blocks


def test_state_from_dict_names_bad_keys_and_other_policies() -> None:
    policy = GuardedPolicy(const(A))
    data = drive(policy, [0.0])[-1][2].to_dict()
    with pytest.raises(GuardrailError, match="key 'version'"):
        policy.state_from_dict({**data, "version": 3})
    # The codec names the missing field and the path of a bad value; a field with a
    # default may be absent (a state from before the field existed still loads).
    with pytest.raises(GuardrailError, match="missing required field `inner_name`"):
        policy.state_from_dict({k: v for k, v in data.items() if k != "inner_name"})
    assert policy.state_from_dict({k: v for k, v in data.items() if k != "trial"}).trial is None
    with pytest.raises(GuardrailError, match=r"Expected `float`, got `str` - at `\$\.change"):
        policy.state_from_dict({**data, "change_times_s": ["soon"]})
    bad_history = [{"slot": 0, "changed_at_s": 1.0, "previous_steps": None}]
    with pytest.raises(GuardrailError, match=r">= 1 - at `\$\.slots\[0\]\.slot`"):
        policy.state_from_dict({**data, "slots": bad_history})
    with pytest.raises(GuardrailError, match=r"`\$\.last_fresh_s`"):
        policy.state_from_dict({**data, "last_fresh_s": float("nan")})
    with pytest.raises(GuardrailError, match="inner_name"):
        GuardedPolicy(const(A)).state_from_dict({**data, "inner_name": "goodput"})
    # Keeping the bookkeeping across a policy switch: restore with another inner state.
    st = GuardedState.from_dict(data, lambda _: CallState(calls=99))
    assert st.inner == CallState(99) and st.table is not None


def test_guarded_policy_is_a_daemon_policy_named_like_its_inner() -> None:
    policy = GuardedPolicy(const(A, None))
    assert isinstance(policy, DaemonPolicy)
    assert policy.name == "scripted" and policy.config == GuardrailConfig()
    with pytest.raises(GuardrailError, match=r"GuardedPolicy\.config"):
        GuardedPolicy(const(A), config={"min_gain": 0.1})  # type: ignore[arg-type]


def test_version_1_state_loads_without_its_copy_of_the_overrides() -> None:
    policy = GuardedPolicy(const(A))
    data = drive(policy, [0.0])[-1][2].to_dict()
    old = {k: v for k, v in data.items() if k != "override_slots"}
    old.update(
        version=1, overrides=[ov(slot=8, steps=0).to_dict()], released_slots=[], release_all=False
    )
    st = policy.state_from_dict(old)
    assert st.override_slots == () and st.table is not None


def test_rollback_ignores_a_drop_within_the_measured_noise() -> None:
    from specgov.policies.guardrails import WindowSample, goodput_noise

    # Per-window goodput per running request alternating 80/120: ~20 % noise.
    samples = [
        WindowSample(
            end_s=5.0 * (i + 1),
            window_s=5.0,
            tokens=(400 if i % 2 else 600) * 1,
            running=1,
            tpot_p50_ms=None,
            itl_p99_ms=None,
        )
        for i in range(10)
    ]
    noise = goodput_noise(samples, before_s=50.0)
    assert 0.15 < noise < 0.30
    assert goodput_noise(samples[:2], before_s=50.0) == 0.0  # too few windows to judge
