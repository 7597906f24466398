"""bandit: converges on simulated bandits, follows shifts, settles, is reproducible."""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import pytest

from specgov.policies.common.decisions import Decision, ReasonCode
from specgov.policies.common.observation import Observation
from specgov.policies.common.types import Budget, PolicyTypeError, TierStat, TierStatsSnapshot
from specgov.policies.daemon.bandit import (
    ArmStat,
    BanditConfig,
    BanditPolicy,
    BanditState,
    tier_reward,
)
from specgov.policies.daemon.protocol import DaemonPolicy
from specgov.policies.daemon.schedules import PolicyStateError

OPEN = Budget(None, None, None, None, None)
ONE_SLOT = ((1, (1, 3, 5, 7)),)
SGLANG_SLOTS = ((1, (1, 3, 5, 7)), (8, (0, 1, 3)), (32, (0, 1)), (64, (0,)))
DT_S = 2.0

Means = Callable[[float], Mapping[int, Mapping[int, float]]]  # time -> slot -> steps -> tok/s


def arm(state: BanditState, slot: int, steps: int) -> ArmStat:
    """The state's statistics of the arm (slot, steps)."""
    (found,) = (a for a in state.arms if (a.slot, a.steps) == (slot, steps))
    return found


def tier(slot: int, steps: int, goodput: float, calls: int = 64, batch: int = 4) -> TierStat:
    """A window of one tier whose measured goodput is exactly ``goodput`` tokens/s."""
    requests = calls * batch
    hist = [0] * (steps + 1)
    hist[min(1, steps)] = requests
    tokens = requests + sum(j * n for j, n in enumerate(hist))
    return TierStat(slot, steps, calls, requests, tuple(hist), tokens / goodput, calls, requests)


def simulate(
    policy: BanditPolicy,
    means: Means,
    *,
    slots: Any = ONE_SLOT,
    duration_s: float = 600.0,
    noise: float = 0.02,
    env_seed: int = 7,
    budget: Budget = OPEN,
    state: BanditState | None = None,
    start_s: float = 0.0,
) -> tuple[list[tuple[float, dict[int, int]]], list[Decision], BanditState]:
    """Closed loop: each window the engine runs the last table's step in every slot.

    Returns (window end, slot -> steps that ran in the window) per decision, the decisions
    and the final state. Before the first table the engine runs its fallback: the slot's
    smallest candidate.
    """
    env = np.random.default_rng(env_seed)
    state = policy.initial_state() if state is None else state
    running = dict(state.choice) or {b: c[0] for b, c in slots}
    plays: list[tuple[float, dict[int, int]]] = []
    decisions: list[Decision] = []
    t = start_s
    while t < start_s + duration_s - 1e-9:
        t += DT_S
        now = means(t)
        tiers = tuple(
            tier(b, k, now[b][k] * (1.0 + noise * float(env.standard_normal())))
            for b, k in running.items()
            if b in now
        )
        observation = Observation(
            time_s=t,
            slot_candidates=slots,
            tier_stats=TierStatsSnapshot(t - DT_S, t, tiers),
        )
        plays.append((t, dict(running)))
        decision, state = policy.decide(observation, state, budget)
        if decision.slots is not None:
            running = dict(decision.slots)
        decisions.append(decision)
    return plays, decisions, state


def share(
    plays: list[tuple[float, dict[int, int]]],
    slot: int,
    steps: int,
    t0: float,
    t1: float = math.inf,
) -> float:
    """Fraction of the windows ending in [t0, t1) in which ``slot`` ran ``steps``."""
    window = [p[slot] for t, p in plays if t0 <= t < t1]
    return sum(k == steps for k in window) / len(window)


def changes_per_minute(plays: list[tuple[float, dict[int, int]]], t0: float) -> float:
    window = [(t, p) for t, p in plays if t >= t0]
    changes = sum(a[1] != b[1] for a, b in itertools.pairwise(window))
    return changes / ((window[-1][0] - window[0][0]) / 60.0)


STATIONARY: dict[int, dict[int, float]] = {1: {1: 800.0, 3: 950.0, 5: 1000.0, 7: 960.0}}


def stationary(t: float) -> Mapping[int, Mapping[int, float]]:
    return STATIONARY


@pytest.mark.parametrize("algo", ["ucb", "thompson", "thompson-beta"])
def test_converges_to_the_best_arm(algo: str) -> None:
    policy = BanditPolicy(BanditConfig(algo=algo, seed=3))
    plays, decisions, _ = simulate(policy, stationary, duration_s=600.0)
    # Every arm was tried first (each is unknown until measured).
    assert {p[1] for _, p in plays[:10]} == {1, 3, 5, 7}
    assert share(plays, 1, 5, t0=180.0) >= (0.75 if algo == "thompson-beta" else 0.85)
    assert all(d.slots is None or d.slots[0][1] in (1, 3, 5, 7) for d in decisions)


def test_settles_on_a_steady_workload() -> None:
    """After the first exploration, about one table change a minute (module docstring)."""
    for seed in range(3):
        policy = BanditPolicy(BanditConfig(seed=seed))
        plays, _, _ = simulate(policy, stationary, duration_s=900.0, env_seed=seed)
        assert changes_per_minute(plays, t0=120.0) <= 2.0
        assert share(plays, 1, 5, t0=120.0) >= 0.85


def test_reconverges_when_the_best_arm_degrades() -> None:
    def means(t: float) -> Mapping[int, Mapping[int, float]]:
        if t < 400.0:
            return STATIONARY
        return {1: {1: 850.0, 3: 900.0, 5: 700.0, 7: 600.0}}

    policy = BanditPolicy(BanditConfig(seed=1))
    plays, decisions, _ = simulate(policy, means, duration_s=800.0)
    assert share(plays, 1, 5, t0=200.0, t1=400.0) >= 0.8
    assert share(plays, 1, 5, t0=420.0) < 0.1
    assert share(plays, 1, 3, t0=460.0) >= 0.85
    alarms = [
        t for (t, _), d in zip(plays, decisions, strict=True) if "shift detected" in d.message
    ]
    assert alarms and 400.0 <= alarms[0] <= 410.0  # no false alarm; a 30 % drop alarms fast


def test_finds_an_arm_that_became_best_while_unplayed() -> None:
    """No incumbent change to detect: only forgetting-driven exploration finds it."""

    def means(t: float) -> Mapping[int, Mapping[int, float]]:
        if t < 400.0:
            return {1: {1: 800.0, 3: 950.0, 5: 1000.0, 7: 900.0}}
        return {1: {1: 800.0, 3: 950.0, 5: 1000.0, 7: 1150.0}}

    policy = BanditPolicy(BanditConfig(seed=2))
    plays, _, _ = simulate(policy, means, duration_s=1200.0)
    assert share(plays, 1, 7, t0=200.0, t1=400.0) < 0.1  # not the best before the shift
    assert share(plays, 1, 7, t0=900.0) >= 0.85


def test_only_candidates_and_allowed_steps_are_played() -> None:
    env = np.random.default_rng(0)
    rates = {b: {k: float(env.uniform(500, 1500)) for k in range(8)} for b, _ in SGLANG_SLOTS}
    budget = Budget(None, None, None, None, allowed_steps=(0, 1, 5))
    policy = BanditPolicy(BanditConfig(algo="thompson", seed=5))
    plays, decisions, _ = simulate(
        policy, lambda t: rates, slots=SGLANG_SLOTS, duration_s=300.0, budget=budget
    )
    allowed = {1: {1, 5}, 8: {0, 1}, 32: {0, 1}, 64: {0}}
    for decision in decisions:
        if decision.slots is not None:
            assert [b for b, _ in decision.slots] == [1, 8, 32, 64]
            for b, k in decision.slots:
                assert k in allowed[b]
    assert {p[1] for _, p in plays} == {1, 5}  # both arms of slot 1 were tried


def test_a_slot_without_traffic_keeps_its_step() -> None:
    """Once slot 8 goes idle its scores move by decay alone; its step must not churn."""
    busy = {1: {1: 800.0, 3: 950.0, 5: 1000.0, 7: 960.0}, 8: {0: 900.0, 1: 1000.0, 3: 980.0}}
    idle = {1: busy[1]}  # no batch of 8 or more any more

    def means(t: float) -> Mapping[int, Mapping[int, float]]:
        return busy if t < 200.0 else idle

    slots = ((1, (1, 3, 5, 7)), (8, (0, 1, 3)))
    policy = BanditPolicy(BanditConfig(seed=0))
    plays, _, _ = simulate(policy, means, slots=slots, duration_s=900.0)
    assert len({p[8] for t, p in plays if t < 200.0}) == 3  # slot 8 explored while busy
    assert len({p[8] for t, p in plays if t > 202.0}) == 1


@pytest.mark.parametrize("algo", ["ucb", "thompson", "thompson-beta"])
def test_deterministic_given_the_seed(algo: str) -> None:
    def run(seed: int) -> list[Decision]:
        return simulate(BanditPolicy(BanditConfig(algo=algo, seed=seed)), stationary)[1]

    assert run(4) == run(4)
    if algo != "ucb":  # ucb draws nothing; Thompson's draws follow the seed
        assert run(4) != run(5)


@pytest.mark.parametrize("algo", ["ucb", "thompson"])
def test_state_round_trips_and_resumes_identically(algo: str) -> None:
    policy = BanditPolicy(BanditConfig(algo=algo, seed=9))
    _, _, state = simulate(policy, stationary, duration_s=200.0)
    assert state.arms and state.choice
    data = json.loads(json.dumps(state.to_dict()))
    assert data["version"] == 1
    restored = policy.state_from_dict(data)
    assert restored == state
    # A state saved while the bandit still kept its own copy of the table reads the same.
    table = {"schema": 1, "slots": [list(p) for p in state.choice], "version": 3}
    legacy = {**data, "table": {**table, "produced_at_s": 190.0, "ttl_s": 30.0}}
    assert policy.state_from_dict(legacy) == state
    tail_a = simulate(policy, stationary, state=state, start_s=200.0, duration_s=100.0)
    tail_b = simulate(policy, stationary, state=restored, start_s=200.0, duration_s=100.0)
    assert tail_a[1] == tail_b[1]
    assert tail_a[2] == tail_b[2]


def test_holds_when_tier_stats_are_unknown() -> None:
    policy = BanditPolicy()
    _, _, state = simulate(policy, stationary, duration_s=40.0)
    assert state.choice
    t = state.time_s or 0.0
    blind = Observation(time_s=t + 1.0, slot_candidates=ONE_SLOT)
    decision, held = policy.decide(blind, state, OPEN)
    assert decision.reason is ReasonCode.HELD_UNKNOWN_TELEMETRY
    assert decision.slots is None
    assert held == state
    # And with nothing known at all, nothing is planned.
    first, _ = policy.decide(Observation(time_s=0.0), policy.initial_state(), OPEN)
    assert first.slots is None and first.reason is ReasonCode.HELD_UNKNOWN_TELEMETRY


def test_an_unchanged_choice_is_planned_again() -> None:
    """The guard may drop a plan (made under telemetry it distrusts): the next fresh
    window offers the same choice again, as an unchanged plan without a predicted gain."""
    policy = BanditPolicy()
    _, decisions, _ = simulate(policy, stationary, duration_s=40.0)
    unchanged = [d for d in decisions if d.reason is ReasonCode.HELD_NO_CHANGE]
    assert unchanged
    assert all(d.slots is not None and d.expected_gain is None for d in unchanged)


def test_a_window_seen_twice_is_not_learned_twice() -> None:
    policy = BanditPolicy()
    snap = TierStatsSnapshot(0.0, 2.0, (tier(1, 3, 900.0),))
    observation = Observation(time_s=2.0, slot_candidates=ONE_SLOT, tier_stats=snap)
    _, state = policy.decide(observation, policy.initial_state(), OPEN)
    again = Observation(time_s=3.0, slot_candidates=ONE_SLOT, tier_stats=snap)
    decision, state2 = policy.decide(again, state, OPEN)
    assert decision.reason is ReasonCode.HELD_STALE_TELEMETRY
    assert decision.slots is None
    assert state2 == state
    # A window ending earlier is a restarted engine's clock, not a duplicate.
    restarted = TierStatsSnapshot(0.0, 1.0, (tier(1, 3, 900.0),))
    later = Observation(time_s=4.0, slot_candidates=ONE_SLOT, tier_stats=restarted)
    decision, state3 = policy.decide(later, state2, OPEN)
    assert decision.reason is not ReasonCode.HELD_STALE_TELEMETRY
    assert arm(state3, 1, 3).weight > arm(state2, 1, 3).weight


def test_fallback_tiers_count_for_the_arm_that_ran() -> None:
    policy = BanditPolicy()
    tiers = (tier(1, 3, 900.0), tier(1, 5, 1000.0), tier(8, 1, 700.0))
    observation = Observation(
        time_s=2.0,
        slot_candidates=((1, (1, 3, 5)), (8, (0, 1))),
        tier_stats=TierStatsSnapshot(0.0, 2.0, tiers),
    )
    decision, state = policy.decide(observation, policy.initial_state(), OPEN)
    assert {(a.slot, a.steps) for a in state.arms} == {(1, 3), (1, 5), (8, 1)}
    assert math.isclose(arm(state, 1, 5).mean, 1000.0)
    # Unmeasured arms are tried first, lowest steps first.
    assert decision.slots == ((1, 1), (8, 0))
    assert decision.reason is ReasonCode.CHANGED_PREDICTED_GAIN


def test_tier_reward_is_tokens_per_second_of_decode_time() -> None:
    t = TierStat(1, 3, 10, 40, (10, 10, 10, 10), 0.5, 10, 40)
    # requests * (mean accepted + 1) / step_time_sum = 40 * 2.5 / 0.5
    assert tier_reward(t) == pytest.approx(200.0)
    assert tier_reward(t, "per-request") == pytest.approx(200.0 / 4.0)
    half_timed = TierStat(1, 3, 10, 40, (10, 10, 10, 10), 0.25, 5, 40)
    assert tier_reward(half_timed) == pytest.approx(200.0)  # time scaled to all verifies
    assert tier_reward(TierStat(1, 3, 10, 40, (10, 10, 10, 10), 0.0, 0, 40)) is None
    assert tier_reward(TierStat(1, 3, 0, 0, (0, 0, 0, 0), 0.0, 0, 0)) is None


def test_expected_gain_reflects_the_means() -> None:
    policy = BanditPolicy(BanditConfig(switch_margin=0.0))
    _, decisions, _ = simulate(policy, stationary, duration_s=120.0, noise=0.0)
    changes = [d for d in decisions if d.reason is ReasonCode.CHANGED_PREDICTED_GAIN]
    gains = [d.expected_gain for d in changes if d.expected_gain is not None]
    assert gains, "some change moved between two measured arms"
    # An exploit move predicts a gain, an exploration move a loss; both are bounded.
    assert all(-1.0 < g < 1.0 for g in gains)
    assert any(g > 0 for g in gains)


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        (dict(algo="exp3"), "BanditConfig.algo: expected one of ucb, thompson, thompson-beta"),
        (dict(seed=-1), "BanditConfig.seed: expected an int >= 0"),
        (dict(window_s=0.0), "BanditConfig.window_s: expected a finite number > 0"),
        (dict(explore=-1.0), "BanditConfig.explore: expected a finite number >= 0"),
        (dict(switch_margin=math.inf), "BanditConfig.switch_margin"),
        (dict(full_weight_calls=0), "BanditConfig.full_weight_calls: expected an int >= 1"),
        (dict(reward="x"), "BanditConfig.reward: expected one of goodput, per-request"),
    ],
)
def test_config_errors_name_the_field(kwargs: dict[str, Any], expected: str) -> None:
    with pytest.raises(PolicyTypeError) as err:
        BanditConfig(**kwargs)
    assert expected in str(err.value)


def test_name_lists_non_default_knobs() -> None:
    assert BanditPolicy().name == "bandit"
    policy = BanditPolicy(BanditConfig(algo="thompson", seed=1, window_s=60.0))
    assert policy.name == "bandit:algo=thompson,seed=1,window_s=60"
    assert isinstance(policy, DaemonPolicy)


@pytest.mark.parametrize(
    ("mutate", "expected"),
    [
        (lambda d: d.pop("rng"), "missing key(s) ['rng']"),
        (lambda d: d.update(version=7), "key 'version': expected 1"),
        (lambda d: d.update(rng=["x", "1", "0", "0"]), "key 'rng'"),
        (lambda d: d.update(arms=[[1, 3, -1.0, 0, 0, 0, 0]]), "key 'arms'[0]"),
        (lambda d: d.update(arms=[[1, 3]]), "key 'arms'[0]"),
        (lambda d: d.update(choice=[[1]]), "key 'choice'"),
        (lambda d: d.update(time_s="now"), "key 'time_s'"),
        (lambda d: d.update(tables=None), "unknown key(s) ['tables']"),
    ],
)
def test_state_from_dict_names_the_bad_key(
    mutate: Callable[[dict[str, Any]], object], expected: str
) -> None:
    policy = BanditPolicy()
    _, _, state = simulate(policy, stationary, duration_s=20.0)
    data = json.loads(json.dumps(state.to_dict()))
    mutate(data)
    with pytest.raises(PolicyStateError) as err:
        policy.state_from_dict(data)
    assert expected in str(err.value)
