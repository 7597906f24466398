"""none / static / batch-table: full plans over the engine's slots, clamped; behind the
guard (which alone versions tables and keeps them alive) the engine never sees one expire."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specgov.policies.common.decisions import Plan, ReasonCode
from specgov.policies.common.observation import Observation
from specgov.policies.common.step_table import StepTable
from specgov.policies.common.types import Budget, PolicyTypeError
from specgov.policies.daemon.protocol import DaemonPolicy
from specgov.policies.daemon.schedules import (
    LIMITED_BY_BUDGET,
    LIMITED_BY_CANDIDATES,
    BatchTablePolicy,
    FixedState,
    NonePolicy,
    PolicyStateError,
    StaticPolicy,
)
from specgov.policies.guardrails import GuardedPolicy, GuardrailConfig

# SGLang 0.5.23's default adaptive slots (policies/engine/adaptive_config.py).
SGLANG_SLOTS = ((1, (1, 3, 5, 7)), (8, (0, 1, 3)), (32, (0, 1)), (64, (0,)))
WIDE_SLOTS = tuple((b, (0, 1, 2, 3, 4, 5, 6, 7)) for b in (1, 4, 16, 48, 96))
OPEN = Budget(None, None, None, None, None)


def obs(
    time_s: float,
    slots: Any = SGLANG_SLOTS,
    table: StepTable | None = None,
) -> Observation:
    return Observation(time_s=time_s, slot_candidates=slots, table=table)


def decide(
    policy: DaemonPolicy[FixedState],
    state: FixedState,
    time_s: float,
    slots: Any = SGLANG_SLOTS,
    budget: Budget = OPEN,
) -> tuple[Plan, FixedState]:
    return policy.decide(obs(time_s, slots), state, budget)


# The guard acts on the slot candidates alone here (the fixed policies need nothing else).
CANDIDATES_ONLY = GuardrailConfig(required_fields=("slot_candidates",))


def test_none_is_zero_where_the_engine_allows_it() -> None:
    policy = NonePolicy()
    decision, state = decide(policy, policy.initial_state(), 100.0)
    # Slot 1 of SGLang's default config cannot run 0: its smallest candidate is used.
    assert decision.slots == ((1, 1), (8, 0), (32, 0), (64, 0))
    assert decision.reason is ReasonCode.STATIC_POLICY
    assert decision.limited_by == (LIMITED_BY_CANDIDATES,)
    assert state == FixedState()
    assert "slot 1: 0 -> 1" in decision.message


@pytest.mark.parametrize(
    ("steps", "expected", "limited"),
    [
        (3, ((1, 3), (8, 3), (32, 1), (64, 0)), True),
        (4, ((1, 3), (8, 3), (32, 1), (64, 0)), True),  # nearest lower candidate
        (7, ((1, 7), (8, 3), (32, 1), (64, 0)), True),
        (1, ((1, 1), (8, 1), (32, 1), (64, 0)), True),
    ],
)
def test_static_clamps_to_the_nearest_lower_candidate(
    steps: int, expected: tuple[tuple[int, int], ...], limited: bool
) -> None:
    policy = StaticPolicy(steps)
    decision, _ = decide(policy, policy.initial_state(), 5.0)
    assert decision.slots == expected
    assert (LIMITED_BY_CANDIDATES in decision.limited_by) is limited
    allowed = {s for _, c in SGLANG_SLOTS for s in c}
    assert all(k in allowed for _, k in decision.slots)


def test_static_within_candidates_is_not_limited() -> None:
    policy = StaticPolicy(2)
    decision, _ = decide(policy, policy.initial_state(), 0.0, WIDE_SLOTS)
    assert {s for _, s in decision.slots} == {2}
    assert decision.limited_by == ()


def test_budget_narrows_candidates_and_says_so() -> None:
    budget = Budget(None, None, None, None, allowed_steps=(0, 1, 3))
    policy = StaticPolicy(5)
    decision, _ = decide(policy, policy.initial_state(), 0.0, WIDE_SLOTS, budget)
    assert {s for _, s in decision.slots} == {3}
    assert decision.limited_by == (LIMITED_BY_BUDGET,)


def test_batch_table_maps_schedule_onto_engine_slots() -> None:
    policy = BatchTablePolicy({1: 5, 8: 3, 32: 1, 64: 0})
    decision, _ = decide(policy, policy.initial_state(), 0.0, WIDE_SLOTS)
    # Each engine bound takes the entry with the largest batch size <= the bound.
    assert decision.slots == ((1, 5), (4, 5), (16, 3), (48, 1), (96, 0))
    assert decision.limited_by == ()
    decision, _ = decide(policy, policy.initial_state(), 0.0, SGLANG_SLOTS)
    assert decision.slots == ((1, 5), (8, 3), (32, 1), (64, 0))
    assert policy.name == "batch-table:1=5,8=3,32=1,64=0"


def test_batch_table_clamps_like_static() -> None:
    policy = BatchTablePolicy([(1, 7), (8, 7)])
    decision, _ = decide(policy, policy.initial_state(), 0.0)
    assert decision.slots == ((1, 7), (8, 3), (32, 1), (64, 0))
    assert decision.limited_by == (LIMITED_BY_CANDIDATES,)


@pytest.mark.parametrize(
    ("schedule", "expected"),
    [
        ([], "at least one"),
        ([(2, 5)], "first batch size must be 1, got 2"),
        ([(1, 5), (8, 3), (8, 1)], "strictly increasing, got 8 after 8"),
        ([(1, 5), (8, -1)], "(batch size 8) steps: expected an int >= 0, got -1"),
        ([(1, True)], "expected an int >= 0, got True"),
        ([(0, 1)], "batch size must be an int >= 1, got 0"),
    ],
)
def test_batch_table_validation_names_the_entry(schedule: Any, expected: str) -> None:
    with pytest.raises(PolicyTypeError) as err:
        BatchTablePolicy(schedule)
    assert "BatchTablePolicy.schedule" in str(err.value)
    assert expected in str(err.value)


def test_constructor_errors() -> None:
    with pytest.raises(PolicyTypeError, match=r"StaticPolicy.steps: expected an int >= 0"):
        StaticPolicy(-1)


def test_a_fixed_plan_is_the_same_every_decision() -> None:
    policy = StaticPolicy(3)
    first, state = decide(policy, policy.initial_state(), 0.0)
    again, state2 = decide(policy, state, 9.9)
    assert again == first and state2 == state
    # The engine restarted with other slots: the plan follows them.
    moved, _ = decide(policy, state, 2.0, WIDE_SLOTS)
    assert [b for b, _ in moved.slots or ()] == [1, 4, 16, 48, 96]


def test_behind_the_guard_the_engine_never_sees_an_expired_table() -> None:
    """Deciding every few seconds, the latest published table is always live: the guard
    versions it and re-issues it before its TTL (guardrails.table_ttl_s) runs out."""
    guarded = GuardedPolicy(NonePolicy(), replace(CANDIDATES_ONLY, table_ttl_s=12.0))
    state = guarded.initial_state()
    live: StepTable | None = None
    versions = []
    for i in range(100):
        now = i * 5.0
        decision, state = guarded.decide(obs(now), state, OPEN)
        if decision.table is not None:
            live = decision.table
            assert live.ttl_s == 12.0 and live.produced_at_s == now
            versions.append(live.version)
        assert live is not None and not live.is_expired(now + 5.0 - 1e-9)
    assert versions == sorted(set(versions))  # strictly increasing
    assert len(versions) < 60  # held in between, not re-issued every decision


def test_behind_the_guard_the_version_is_above_the_engines_table() -> None:
    guarded = GuardedPolicy(StaticPolicy(1), CANDIDATES_ONLY)
    foreign = StepTable(((1, 3),), version=41, produced_at_s=0.0, ttl_s=30.0)
    decision, _ = guarded.decide(obs(0.0, table=foreign), guarded.initial_state(), OPEN)
    assert decision.table is not None and decision.table.version == 42


def test_unknown_candidates_hold() -> None:
    policy = StaticPolicy(3)
    decision, state = decide(policy, policy.initial_state(), 0.0, None)
    assert decision.slots is None
    assert decision.reason is ReasonCode.HELD_UNKNOWN_TELEMETRY
    first, state = decide(policy, state, 1.0)
    assert first.slots is not None


def test_first_bound_is_published_as_one() -> None:
    policy = StaticPolicy(1)
    decision, _ = decide(policy, policy.initial_state(), 0.0, ((4, (0, 1)), (16, (0, 1))))
    assert decision.slots == ((1, 1), (16, 1))


def test_unusable_slot_bounds_hold() -> None:
    policy = StaticPolicy(1)
    decision, _ = decide(policy, policy.initial_state(), 0.0, ((0, (0, 1)), (16, (0, 1))))
    assert decision.slots is None
    assert decision.reason is ReasonCode.HELD_UNKNOWN_TELEMETRY
    assert "unusable" in decision.message


@pytest.mark.parametrize(
    ("policy", "name"),
    [
        (NonePolicy(), "none"),
        (StaticPolicy(3), "static:3"),
        (BatchTablePolicy({1: 5, 8: 0}), "batch-table:1=5,8=0"),
    ],
)
def test_names_and_protocol(policy: Any, name: str) -> None:
    assert policy.name == name
    assert isinstance(policy, DaemonPolicy)


def test_state_round_trips_through_json() -> None:
    policy = BatchTablePolicy({1: 5, 8: 3})
    _, state = decide(policy, policy.initial_state(), 3.0)
    data = json.loads(json.dumps(state.to_dict()))
    assert data["version"] == 1
    restored = policy.state_from_dict(data)
    assert restored == state
    assert policy.state_from_dict(policy.initial_state().to_dict()) == FixedState()
    # A restored state continues exactly like the original.
    assert decide(policy, restored, 4.0) == decide(policy, state, 4.0)


def test_a_state_saved_with_the_policys_own_table_is_still_read() -> None:
    """Before the guard owned the table versions, a fixed policy kept its last table."""
    table = {"schema": 1, "slots": [[1, 3]], "version": 4, "produced_at_s": 0.0, "ttl_s": 30.0}
    for data in ({"version": 1, "table": table}, {"version": 1, "table": None}):
        assert StaticPolicy(3).state_from_dict(data) == FixedState()


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ({"version": 2}, "expected 1"),
        ({"version": 1, "x": 1}, "unknown key(s) ['x']"),
        ([1, 2], "expected an object"),
    ],
)
def test_state_from_dict_names_the_bad_key(data: Any, expected: str) -> None:
    with pytest.raises(PolicyStateError) as err:
        FixedState.from_dict(data)
    assert expected in str(err.value)


slot_sets = st.lists(
    st.tuples(
        st.integers(min_value=2, max_value=512),
        st.sets(st.integers(min_value=0, max_value=9), min_size=1).map(lambda s: tuple(sorted(s))),
    ),
    max_size=6,
    unique_by=lambda p: p[0],
).map(lambda extra: tuple(sorted(extra)))


@settings(max_examples=150, deadline=None)
@given(
    first=st.sets(st.integers(min_value=0, max_value=9), min_size=1),
    extra=slot_sets,
    steps=st.integers(min_value=0, max_value=12),
)
def test_published_steps_are_always_candidates(
    first: set[int], extra: tuple[tuple[int, tuple[int, ...]], ...], steps: int
) -> None:
    slots = ((1, tuple(sorted(first))), *extra)
    for policy in (StaticPolicy(steps), NonePolicy(), BatchTablePolicy({1: steps, 64: 0})):
        decision, _ = decide(policy, policy.initial_state(), 0.0, slots)
        assert decision.slots is not None
        assert [b for b, _ in decision.slots] == [b for b, _ in slots]
        for (_, got), (_, cands) in zip(decision.slots, slots, strict=True):
            assert got in cands
        if isinstance(policy, StaticPolicy):
            for (_, got), (_, cands) in zip(decision.slots, slots, strict=True):
                lower = [c for c in cands if c <= steps]
                assert got == (max(lower) if lower else min(cands))
            clamped = any(steps not in cands for _, cands in slots)
            assert (LIMITED_BY_CANDIDATES in decision.limited_by) is clamped
