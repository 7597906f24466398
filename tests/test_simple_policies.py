"""none / static / batch-table: full tables over the engine's slots, clamped, kept alive."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specgov.policies.common.types import (
    Budget,
    Decision,
    Observation,
    PolicyTypeError,
    ReasonCode,
    StepTable,
)
from specgov.policies.daemon.protocol import DaemonPolicy
from specgov.policies.daemon.schedules import (
    DEFAULT_TTL_S,
    LIMITED_BY_BUDGET,
    LIMITED_BY_CANDIDATES,
    BatchTablePolicy,
    NonePolicy,
    PolicyStateError,
    StaticPolicy,
    TableState,
)

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
    policy: DaemonPolicy[TableState],
    state: TableState,
    time_s: float,
    slots: Any = SGLANG_SLOTS,
    budget: Budget = OPEN,
) -> tuple[Decision, TableState]:
    return policy.decide(obs(time_s, slots), state, budget)


def test_none_is_zero_where_the_engine_allows_it() -> None:
    policy = NonePolicy()
    decision, state = decide(policy, policy.initial_state(), 100.0)
    assert decision.table is not None
    # Slot 1 of SGLang's default config cannot run 0: its smallest candidate is used.
    assert decision.table.slots == ((1, 1), (8, 0), (32, 0), (64, 0))
    assert decision.reason is ReasonCode.STATIC_POLICY
    assert decision.limited_by == (LIMITED_BY_CANDIDATES,)
    assert decision.table.version == 1
    assert decision.table.produced_at_s == 100.0
    assert decision.table.ttl_s == DEFAULT_TTL_S
    assert state.table == decision.table
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
    assert decision.table is not None
    assert decision.table.slots == expected
    assert (LIMITED_BY_CANDIDATES in decision.limited_by) is limited
    decision.table.validate_against({s for _, c in SGLANG_SLOTS for s in c})


def test_static_within_candidates_is_not_limited() -> None:
    policy = StaticPolicy(2)
    decision, _ = decide(policy, policy.initial_state(), 0.0, WIDE_SLOTS)
    assert decision.table is not None
    assert {s for _, s in decision.table.slots} == {2}
    assert decision.limited_by == ()


def test_budget_narrows_candidates_and_says_so() -> None:
    budget = Budget(None, None, None, None, allowed_steps=(0, 1, 3))
    policy = StaticPolicy(5)
    decision, _ = decide(policy, policy.initial_state(), 0.0, WIDE_SLOTS, budget)
    assert decision.table is not None
    assert {s for _, s in decision.table.slots} == {3}
    assert decision.limited_by == (LIMITED_BY_BUDGET,)


def test_batch_table_maps_schedule_onto_engine_slots() -> None:
    policy = BatchTablePolicy({1: 5, 8: 3, 32: 1, 64: 0})
    decision, _ = decide(policy, policy.initial_state(), 0.0, WIDE_SLOTS)
    assert decision.table is not None
    # Each engine bound takes the entry with the largest batch size <= the bound.
    assert decision.table.slots == ((1, 5), (4, 5), (16, 3), (48, 1), (96, 0))
    assert decision.limited_by == ()
    decision, _ = decide(policy, policy.initial_state(), 0.0, SGLANG_SLOTS)
    assert decision.table is not None
    assert decision.table.slots == ((1, 5), (8, 3), (32, 1), (64, 0))
    assert policy.name == "batch-table:1=5,8=3,32=1,64=0"


def test_batch_table_clamps_like_static() -> None:
    policy = BatchTablePolicy([(1, 7), (8, 7)])
    decision, _ = decide(policy, policy.initial_state(), 0.0)
    assert decision.table is not None
    assert decision.table.slots == ((1, 7), (8, 3), (32, 1), (64, 0))
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
    with pytest.raises(PolicyTypeError, match=r"NonePolicy.ttl_s: expected a finite number > 0"):
        NonePolicy(ttl_s=0)
    with pytest.raises(PolicyTypeError, match=r"StaticPolicy.ttl_s"):
        StaticPolicy(3, ttl_s=float("nan"))


def test_unchanged_table_is_held_then_refreshed_before_ttl() -> None:
    policy = StaticPolicy(3, ttl_s=20.0)
    first, state = decide(policy, policy.initial_state(), 0.0)
    assert first.table is not None and first.table.version == 1
    held, state2 = decide(policy, state, 9.9)  # age < ttl/2
    assert held.table is None
    assert held.reason is ReasonCode.HELD_NO_CHANGE
    assert state2 == state
    refreshed, state3 = decide(policy, state2, 10.0)  # age reaches ttl/2
    assert refreshed.table is not None
    assert refreshed.table.slots == first.table.slots
    assert refreshed.table.version == 2
    assert refreshed.table.produced_at_s == 10.0
    assert refreshed.reason is ReasonCode.STATIC_POLICY
    assert "re-issued" in refreshed.message
    assert state3.table == refreshed.table


def test_engine_never_sees_an_expired_table() -> None:
    """Deciding every few seconds, the latest issued table is always live."""
    policy = NonePolicy(ttl_s=12.0)
    state = policy.initial_state()
    live: StepTable | None = None
    versions = []
    for i in range(100):
        now = i * 5.0
        decision, state = decide(policy, state, now)
        if decision.table is not None:
            live = decision.table
            versions.append(live.version)
        assert live is not None and not live.is_expired(now + 5.0 - 1e-9)
    assert versions == sorted(set(versions))  # strictly increasing
    assert len(versions) < 60  # held in between, not re-issued every decision


def test_version_changes_only_when_the_table_changes() -> None:
    policy = StaticPolicy(3)
    _, state = decide(policy, policy.initial_state(), 0.0)
    d2, state = decide(policy, state, 1.0)
    assert d2.table is None
    # The engine restarted with other slots: a new table, next version.
    d3, state = decide(policy, state, 2.0, WIDE_SLOTS)
    assert d3.table is not None and d3.table.version == 2
    assert d3.reason is ReasonCode.STATIC_POLICY


def test_version_is_above_the_engines_table() -> None:
    policy = StaticPolicy(1)
    foreign = StepTable(((1, 3),), version=41, produced_at_s=0.0, ttl_s=30.0)
    decision, _ = policy.decide(obs(0.0, table=foreign), policy.initial_state(), OPEN)
    assert decision.table is not None and decision.table.version == 42


def test_unknown_candidates_hold_and_keep_the_last_table_alive() -> None:
    policy = StaticPolicy(3, ttl_s=10.0)
    decision, state = decide(policy, policy.initial_state(), 0.0, None)
    assert decision.table is None
    assert decision.reason is ReasonCode.HELD_UNKNOWN_TELEMETRY
    first, state = decide(policy, state, 1.0)
    assert first.table is not None
    held, state = decide(policy, state, 2.0, None)
    assert held.table is None and held.reason is ReasonCode.HELD_UNKNOWN_TELEMETRY
    due, state = decide(policy, state, 6.0, None)
    assert due.reason is ReasonCode.HELD_UNKNOWN_TELEMETRY
    assert due.table is not None
    assert due.table.slots == first.table.slots and due.table.version == first.table.version + 1


def test_clock_going_backwards_reissues() -> None:
    policy = StaticPolicy(3)
    _, state = decide(policy, policy.initial_state(), 100.0)
    decision, _ = decide(policy, state, 50.0)
    assert decision.table is not None and decision.table.produced_at_s == 50.0


def test_first_bound_is_published_as_one() -> None:
    policy = StaticPolicy(1)
    decision, _ = decide(policy, policy.initial_state(), 0.0, ((4, (0, 1)), (16, (0, 1))))
    assert decision.table is not None
    assert decision.table.slots == ((1, 1), (16, 1))


def test_unusable_slot_bounds_hold() -> None:
    policy = StaticPolicy(1)
    decision, _ = decide(policy, policy.initial_state(), 0.0, ((0, (0, 1)), (16, (0, 1))))
    assert decision.table is None
    assert decision.reason is ReasonCode.HELD_UNKNOWN_TELEMETRY
    assert "unusable" in decision.message


@pytest.mark.parametrize(
    ("policy", "name"),
    [
        (NonePolicy(), "none"),
        (NonePolicy(ttl_s=20), "none:ttl_s=20"),
        (StaticPolicy(3), "static:3"),
        (StaticPolicy(3, ttl_s=7.5), "static:3,ttl_s=7.5"),
        (BatchTablePolicy({1: 5, 8: 0}, ttl_s=10), "batch-table:1=5,8=0,ttl_s=10"),
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
    assert policy.state_from_dict(policy.initial_state().to_dict()) == TableState()
    # A restored state continues exactly like the original.
    assert decide(policy, restored, 4.0) == decide(policy, state, 4.0)


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ({"version": 1, "table": {"version": 1, "produced_at_s": 0, "ttl_s": 1}}, "`slots`"),
        ({"version": 2, "table": None}, "key 'version': expected 1, got 2"),
        ({"version": 1, "table": None, "x": 1}, "unknown key(s) ['x']"),
        ({"version": 1, "table": {"slots": []}}, "at `$.table`"),
        ([1, 2], "expected an object"),
    ],
)
def test_state_from_dict_names_the_bad_key(data: Any, expected: str) -> None:
    with pytest.raises(PolicyStateError) as err:
        TableState.from_dict(data)
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
        assert decision.table is not None
        assert [b for b, _ in decision.table.slots] == [b for b, _ in slots]
        for (_, got), (_, cands) in zip(decision.table.slots, slots, strict=True):
            assert got in cands
        if isinstance(policy, StaticPolicy):
            for (_, got), (_, cands) in zip(decision.table.slots, slots, strict=True):
                lower = [c for c in cands if c <= steps]
                assert got == (max(lower) if lower else min(cands))
            clamped = any(steps not in cands for _, cands in slots)
            assert (LIMITED_BY_CANDIDATES in decision.limited_by) is clamped
