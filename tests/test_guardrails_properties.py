"""Property tests of the guardrail invariants over random runs (policies/guardrails.py).

Each example is an engine (slots, candidates, Budget), a guardrail config and a sequence of
decision rounds: time step, telemetry quality (fresh, a required field unknown, stale
metrics, old tier stats, candidates unknown), measured tokens and load, what the fake inner
policy proposes (any steps, even ones no slot has) with what gain, and operator actions.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_guardrails import Scripted, Step

from specgov.policies.common.decisions import ReasonCode
from specgov.policies.common.observation import LatencyQuantiles, Observation
from specgov.policies.common.step_table import StepTable
from specgov.policies.common.types import Budget, TierStatsSnapshot
from specgov.policies.guardrails import (
    GuardedPolicy,
    GuardedState,
    GuardrailConfig,
    Override,
    clamp_step,
    with_override,
    without_overrides,
)

Slots = tuple[tuple[int, int], ...]
Cands = tuple[tuple[int, tuple[int, ...]], ...]
# Mostly fresh, so policy changes, trials and rollbacks happen between the freezes.
TELEMETRY = ("fresh",) * 9 + ("unknown", "stale", "old_tiers", "no_cands")


@dataclass(frozen=True)
class Round:
    dt_s: float
    telemetry: str
    tokens: int
    running: int | None
    tpot_ms: float
    proposal: Step
    op: tuple[str, Any] | None


@dataclass(frozen=True)
class Scenario:
    cands: Cands
    budget: Budget
    config: GuardrailConfig
    rounds: tuple[Round, ...]

    @property
    def layout(self) -> Cands:
        """The engine's slots as the guard publishes them (first bound 1)."""
        return tuple((1 if i == 0 else b, c) for i, (b, c) in enumerate(self.cands))


@st.composite
def scenarios(draw: st.DrawFn, *, operators: bool, busy: bool = False) -> Scenario:
    """``busy``: fresh telemetry, no band or dwell, a table every round and noisy goodput,
    so the rate limit and rollbacks are exercised hard."""
    n = draw(st.integers(1, 5))
    first = draw(st.integers(1, 2))
    rest = sorted(draw(st.sets(st.integers(first + 1, 256), min_size=n - 1, max_size=n - 1)))
    bounds = [first, *rest]
    cands = tuple(
        (b, tuple(sorted(draw(st.sets(st.integers(0, 7), min_size=2 if busy else 1, max_size=4)))))
        for b in bounds
    )
    allowed = draw(
        st.none()
        if busy
        else st.none()
        | st.sets(st.integers(0, 7), min_size=1, max_size=5).map(lambda s: tuple(sorted(s)))
    )
    budget = Budget(None, draw(st.none() | st.just(30.0)), None, None, allowed)
    rollback = busy or draw(st.booleans())
    config = GuardrailConfig(
        min_dwell_s=0.0 if busy else draw(st.sampled_from([0.0, 10.0, 30.0])),
        max_changes_per_window=draw(st.integers(2, 3 if busy else 4)),
        rate_window_s=draw(st.sampled_from([30.0, 60.0])),
        rollback_enabled=rollback,
        rollback_window_s=10.0,
        rollback_min_tokens=100,
        rollback_max_wait_s=40.0,
        rollback_cooldown_s=draw(st.sampled_from([20.0, 300.0])),
        min_gain=0.0 if busy else draw(st.sampled_from([0.0, 0.02])),
        frozen_keepalive_s=draw(st.sampled_from([1.0, 120.0])),
    )
    inner_bounds = draw(st.sampled_from([bounds, [1, 4, 16, 64]]))
    table = st.tuples(*[st.integers(0, 9) for _ in inner_bounds]).map(
        lambda ks: tuple(zip([1, *inner_bounds[1:]], ks, strict=True))
    )
    proposal = (
        st.tuples(table, st.just(0.1))
        if busy
        else st.tuples(st.none() | table, st.none() | st.floats(-0.1, 0.3, allow_nan=False))
    )
    slot = st.none() | st.sampled_from([1, *bounds])
    override = st.one_of(
        st.tuples(slot, st.integers(0, 9), st.just(False), st.none()),
        st.tuples(slot, st.none(), st.just(True), st.none()),
        st.tuples(st.none(), st.none(), st.just(False), st.just("static:1")),
    )
    op = (
        st.none()
        | st.tuples(st.just("set"), st.tuples(override, st.floats(1.0, 200.0)))
        | st.tuples(st.just("clear"), slot)
        if operators
        else st.none()
    )
    rounds = draw(
        st.lists(
            st.builds(
                Round,
                dt_s=st.sampled_from([1.0, 2.0, 5.0] if busy else [0.5, 1, 2, 5, 5, 5, 12, 30]),
                telemetry=st.just("fresh") if busy else st.sampled_from(TELEMETRY),
                tokens=st.sampled_from([800, 5000] if busy else [0, 800, 3000, 4000, 5000, 5000]),
                running=st.none() | st.integers(0, 64),
                tpot_ms=st.sampled_from([10.0, 25.0, 45.0]),
                proposal=proposal,
                op=op,
            ),
            min_size=40 if busy else 1,
            max_size=90 if busy else 80,
        )
    )
    return Scenario(cands, budget, config, tuple(rounds))


def observation(s: Scenario, r: Round, t: float) -> Observation:
    kind = r.telemetry
    return Observation(
        time_s=t,
        running_requests=r.running,
        slot_candidates=None if kind == "no_cands" else s.cands,
        staleness_s=60.0 if kind == "stale" else 0.5,
        tier_stats=TierStatsSnapshot(t - 101.0, t - 100.0, ())
        if kind == "old_tiers"
        else TierStatsSnapshot(t - 2.0, t - 1.0, ()),
        window_s=5.0,
        generation_tokens=None if kind == "unknown" else r.tokens,
        tpot_ms=LatencyQuantiles(p50_ms=r.tpot_ms),
    )


def apply_op(
    overrides: tuple[Override, ...], op: tuple[str, Any] | None, t: float
) -> tuple[Override, ...]:
    if op is None:
        return overrides
    kind, arg = op
    if kind == "clear":
        return without_overrides(overrides, arg)
    (slot, steps, disable, pin), ttl = arg
    o = Override(
        slot=slot,
        steps=steps,
        disable_speculation=disable,
        pin_policy=pin,
        expires_at_s=t + ttl,
        reason="property test",
        created_at_s=t,
    )
    return with_override(overrides, o)


def winning_override(overrides: Sequence[Override], slot: int, t: float) -> Override | None:
    live = [o for o in overrides if o.kind == "steps" and o.is_active(t)]
    mine = [o for o in live if o.slot == slot] or [o for o in live if o.slot is None]
    return max(mine, key=lambda o: o.created_at_s) if mine else None


Trace = list[
    tuple[float, Observation, GuardedState[Any], Any, GuardedState[Any], tuple[Override, ...]]
]


def run(s: Scenario) -> Trace:
    script: list[Step] = [r.proposal for r in s.rounds]
    policy = GuardedPolicy(Scripted(script), s.config)
    state = policy.initial_state()
    overrides: tuple[Override, ...] = ()
    t = 0.0
    out: Trace = []
    for r in s.rounds:
        t += r.dt_s
        overrides = apply_op(overrides, r.op, t)
        o = observation(s, r, t)
        decision, new = policy.decide(o, state, s.budget, overrides=overrides)
        out.append((t, o, state, decision, new, overrides))
        state = new
    return out


def frozen(o: Observation, config: GuardrailConfig) -> bool:
    if any(getattr(o, name) is None for name in config.required_fields):
        return True
    assert o.staleness_s is not None and o.tier_stats is not None
    return (
        o.staleness_s > config.max_staleness_s
        or o.time_s - o.tier_stats.window_end_s > config.max_tier_stats_age_s
    )


def steps_of(table: StepTable | None) -> Slots | None:
    return None if table is None else table.slots


PROPS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPS
@given(scenarios(operators=True))
def test_every_published_step_is_a_candidate_within_budget_and_overrides_are_clamped(
    s: Scenario,
) -> None:
    cands = dict(s.layout)
    allowed = s.budget.allowed_steps
    last_version = 0
    for t, _, before, decision, after, ovs in run(s):
        # Every decision explains itself.
        assert isinstance(decision.reason, ReasonCode) and decision.message.strip()
        assert all(isinstance(x, str) and x for x in decision.limited_by)
        table = decision.table
        if table is None:
            assert after.table == before.table
            continue
        assert after.table == table and table.version > last_version
        last_version = table.version
        assert [b for b, _ in table.slots] == [b for b, _ in s.layout]
        for b, k in table.slots:
            assert k in cands[b]
            playable = [c for c in cands[b] if allowed is None or c in allowed]
            if playable:
                assert k in playable
            o = winning_override(ovs, b, t)
            if o is not None:
                assert o.target_steps is not None
                assert k == clamp_step(o.target_steps, cands[b], allowed)[0]


@PROPS
@given(scenarios(operators=True))
def test_unknown_telemetry_never_changes_the_table(s: Scenario) -> None:
    for t, o, before, decision, after, ovs in run(s):
        if not frozen(o, s.config):
            continue
        if any(ov.kind == "steps" and ov.is_active(t) for ov in ovs):
            continue  # an operator override may act on a frozen table (clamped)
        assert steps_of(after.table) == steps_of(before.table)
        if decision.table is not None:
            assert decision.table.slots == steps_of(before.table)
        assert decision.reason in {
            ReasonCode.HELD_UNKNOWN_TELEMETRY,
            ReasonCode.HELD_STALE_TELEMETRY,
        }


@PROPS
@given(st.booleans().flatmap(lambda busy: scenarios(operators=False, busy=busy)))
def test_rate_limit_and_dwell_hold_in_any_window(s: Scenario) -> None:
    config = s.config
    change_times: list[float] = []
    slot_changed: dict[int, float] = {}
    for t, _, before, decision, _, _ in run(s):
        if decision.table is None:
            continue
        old = steps_of(before.table)
        new = decision.table.slots
        if old is None:
            slot_changed = dict.fromkeys((b for b, _ in new), t)
            continue
        moved = [b for (b, k), (_, k0) in zip(new, old, strict=True) if k != k0]
        if not moved:
            continue
        change_times.append(t)
        if decision.reason == ReasonCode.CHANGED_PREDICTED_GAIN:
            for b in moved:
                assert t - slot_changed[b] >= config.min_dwell_s
        else:
            assert decision.reason == ReasonCode.ROLLED_BACK_REGRESSION
        for b in moved:
            slot_changed[b] = t
    for end in change_times:
        window = [x for x in change_times if end - config.rate_window_s < x <= end]
        assert len(window) <= config.max_changes_per_window


@settings(max_examples=40, deadline=None)
@given(scenarios(operators=True))
def test_state_serialises_at_every_round(s: Scenario) -> None:
    policy = GuardedPolicy(Scripted([r.proposal for r in s.rounds]), s.config)
    for _, _, _, _, after, _ in run(s):
        assert policy.state_from_dict(json.loads(json.dumps(after.to_dict()))) == after
