"""Goodput policy in a known synthetic world.

The world: every slot runs at a fixed batch size; acceptance follows known
per-position rates; a step costs what the simulator's cost model (Llama-3.1-8B +
EAGLE-3 on H100) says, with 2 % noise. The policy starts from a *wrong* prior (weights
read 20 % faster, compute 25 % slower than the truth) and from the in-engine
fallback's steps, and must find the true optimum
``argmax_k B * E[L(k)] / T(B, k)`` per slot. The world's engine keeps the last plan
in force (``enact``: the guard's versions, TTLs and keep-alives are not under test here).

``SloWorld`` adds per-request TPOTs (a Monte Carlo of each request's verifies), so the
SLO-sense optimum, goodput x share of requests within the TPOT SLO, is known too; and
``run_guarded`` puts the policy behind the default guardrails, as the daemon does.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import pytest

from specgov.policies.common.decisions import Plan, ReasonCode, RestartRecommendation
from specgov.policies.common.observation import LatencyQuantiles, Observation
from specgov.policies.common.step_table import StepTable
from specgov.policies.common.types import (
    Budget,
    PolicyTypeError,
    TierStat,
    TierStatsSnapshot,
)
from specgov.policies.daemon.goodput import (
    GOODPUT_STATE_VERSION,
    GoodputConfig,
    GoodputConfigError,
    GoodputPolicy,
    GoodputState,
)
from specgov.policies.daemon.protocol import DaemonPolicy
from specgov.policies.guardrails import GuardedPolicy, GuardrailConfig
from specgov.simulator.catalog import Catalog
from specgov.simulator.engine.cost import CostModel
from specgov.simulator.priors import step_cost_prior

CATALOG = Catalog.load()
TRUTH = CostModel.from_catalog(
    CATALOG.gpu("h100"), CATALOG.model("llama-3.1-8b"), CATALOG.drafter("eagle3")
)
WRONG_PRIOR = step_cost_prior(
    TRUTH.with_overrides(
        {
            "weight_read_s": TRUTH.coefficients.weight_read_s * 0.8,
            "compute_per_token_s": TRUTH.coefficients.compute_per_token_s * 1.25,
        }
    )
)
CTX = 1024
NO_BUDGET = Budget(None, None, None, None, None)
HIGH = (0.9,) * 7
LOW = (0.25,) * 7
# (slot bound, candidate steps, batch size, the fallback's steps before any table)
TWO_SLOTS = ((1, (1, 3, 5, 7), 1, 3), (128, (0, 1, 3), 160, 1))
FOUR_SLOTS = (
    (1, (1, 3, 5, 7), 1, 3),
    (8, (0, 1, 3, 5), 12, 3),
    (32, (0, 1, 3), 40, 1),
    (128, (0, 1, 3), 160, 1),
)


def accept_length(rates: Sequence[float], k: int) -> float:
    total, reach = 1.0, 1.0
    for j in range(k):
        reach *= rates[j]
        total += reach
    return total


def accepted_distribution(rates: Sequence[float], k: int) -> list[float]:
    out, reach = [], 1.0
    for j in range(k):
        out.append(reach * (1.0 - rates[j]))
        reach *= rates[j]
    out.append(reach)
    return out


@dataclass
class World:
    rates: tuple[float, ...]
    slots: tuple[tuple[int, tuple[int, ...], int, int], ...]
    seed: int = 0
    window_s: float = 5.0
    # Report tiers under the table's slot bound, as the in-engine TablePolicy does.
    table_bounds: bool = False
    rng: np.random.Generator = field(init=False)

    def __post_init__(self) -> None:
        self.rng = np.random.default_rng(self.seed)

    @property
    def candidates(self) -> tuple[tuple[int, tuple[int, ...]], ...]:
        return tuple((b, c) for b, c, _, _ in self.slots)

    def goodput(self, bound: int, k: int) -> float:
        batch = next(bs for b, _, bs, _ in self.slots if b == bound)
        return batch * accept_length(self.rates, k) / TRUTH.decode_step_s(batch, k, batch * CTX)

    def optimum(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for bound, cands, _, _ in self.slots:
            out[bound] = max(cands, key=lambda k: self.goodput(bound, k))
        return out

    def margin(self, bound: int) -> float:
        """Relative goodput gap between the best and the second-best candidate."""
        cands = next(c for b, c, _, _ in self.slots if b == bound)
        g = sorted((self.goodput(bound, k) for k in cands), reverse=True)
        return 1.0 - g[1] / g[0]

    def observe(self, t: float, table: StepTable | None) -> Observation:
        tiers = []
        for bound, _, batch, fallback in self.slots:
            k = table.steps_for(bound) if table is not None else fallback
            step_s = TRUTH.decode_step_s(batch, k, batch * CTX)
            verifies = max(1, int(self.window_s / len(self.slots) / step_s))
            requests = verifies * batch
            hist = self.rng.multinomial(requests, accepted_distribution(self.rates, k))
            noisy = step_s * verifies * float(np.exp(self.rng.normal(0.0, 0.02)))
            reported = table.slot_for(bound) if table is not None and self.table_bounds else bound
            tiers.append(
                TierStat(
                    slot=reported,
                    steps=k,
                    verify_calls=verifies,
                    requests=requests,
                    accepted_hist=tuple(int(h) for h in hist),
                    step_time_sum_s=noisy,
                    step_time_count=verifies,
                    batch_size_sum=verifies * batch,
                )
            )
        return Observation(
            time_s=t,
            running_requests=100,
            token_usage=0.5,
            kv_capacity_tokens=2 * 100 * CTX,  # 1024 KV tokens per running request
            table=table,
            tier_stats=TierStatsSnapshot(t - self.window_s, t, tuple(tiers)),
            slot_candidates=self.candidates,
        )


@dataclass
class Run:
    state: GoodputState
    table: StepTable | None
    decisions: list[Plan]
    t: float


def enact(plan: Plan, t: float, table: StepTable | None) -> StepTable | None:
    """The table in force after ``plan``: its steps and rules, else the one before."""
    if plan.slots is None:
        return table
    version = 1 if table is None else table.version + 1
    return StepTable(plan.slots, version, t, 3600.0, rules=plan.rules)


def run(
    world: World,
    policy: GoodputPolicy,
    n: int,
    prev: Run | None = None,
    budget: Budget = NO_BUDGET,
) -> Run:
    state = prev.state if prev is not None else policy.initial_state()
    table = prev.table if prev is not None else None
    t = prev.t if prev is not None else 0.0
    decisions: list[Plan] = []
    for _ in range(n):
        t += world.window_s
        decision, state = policy.decide(world.observe(t, table), state, budget)
        table = enact(decision, t, table)
        decisions.append(decision)
    return Run(state, table, decisions, t)


def policy(**params: object) -> GoodputPolicy:
    base: dict[str, object] = {"explore": 0.0}
    base.update(params)
    return GoodputPolicy(GoodputConfig(**base), prior=WRONG_PRIOR)  # type: ignore[arg-type]


def steps_of(table: StepTable | Plan | None) -> dict[int, int]:
    assert table is not None and table.slots is not None
    return dict(table.slots)


@dataclass
class SloWorld(World):
    """One slot, plus per-request TPOTs for the SLO (a Monte Carlo, not the policy's model).

    Each request emits ``tokens`` tokens in verifies whose accepted drafts are drawn
    independently from the rates; its TPOT is ``scale`` (prefill stalls) x the true step
    time x verifies / tokens emitted x a log-normal batching noise. The window's TPOT,
    TTFT and e2e medians (and TPOT p90) come from ``requests`` such requests at the steps
    in force.
    """

    scale: float = 2.4
    tokens: int = 24
    noise_sd: float = 0.05
    requests: int = 400

    def tpots_ms(self, k: int, n: int, rng: np.random.Generator) -> np.ndarray:
        _, _, batch, _ = self.slots[0]
        step_s = TRUTH.decode_step_s(batch, k, batch * CTX)
        dist = accepted_distribution(self.rates, k)
        emitted = 1 + rng.choice(len(dist), size=(n, self.tokens), p=dist)
        made = np.cumsum(emitted, axis=1)
        verifies = np.argmax(made >= self.tokens, axis=1) + 1
        total = made[np.arange(n), verifies - 1]
        noise = np.exp(self.noise_sd * rng.normal(size=n))
        out: np.ndarray = self.scale * 1e3 * step_s * verifies / total * noise
        return out

    def slo_goodput(self, k: int, slo_ms: float) -> float:
        """True goodput in the SLO sense: goodput x share of requests within the SLO."""
        rng = np.random.default_rng(1234)
        share = float(np.mean(self.tpots_ms(k, 20000, rng) <= slo_ms))
        return self.goodput(self.slots[0][0], k) * share

    def observe(self, t: float, table: StepTable | None) -> Observation:
        obs = super().observe(t, table)
        bound, _, _, fallback = self.slots[0]
        k = table.steps_for(bound) if table is not None else fallback
        tpot = self.tpots_ms(k, self.requests, self.rng)
        p50, p90 = (float(q) for q in np.percentile(tpot, [50, 90]))
        ttft = 100.0
        return replace(
            obs,
            tpot_ms=LatencyQuantiles(p50_ms=p50, p90_ms=p90),
            ttft_ms=LatencyQuantiles(p50_ms=ttft),
            e2e_ms=LatencyQuantiles(p50_ms=ttft + p50 * (self.tokens - 1)),
        )


def daemon_fields(obs: Observation) -> Observation:
    """What the daemon adds for the guardrails: a fresh scrape, its window and tokens."""
    snap = obs.tier_stats
    assert snap is not None
    tokens = sum(sum((j + 1) * n for j, n in enumerate(t.accepted_hist)) for t in snap.tiers)
    return replace(
        obs,
        staleness_s=0.0,
        window_s=snap.window_end_s - snap.window_start_s,
        generation_tokens=tokens,
    )


def run_guarded(world: World, inner: GoodputPolicy, n: int) -> list[StepTable | None]:
    """The policy behind the default guardrails; the table in force after each decision."""
    guarded = GuardedPolicy(inner, GuardrailConfig())
    state = guarded.initial_state()
    table: StepTable | None = None
    tables: list[StepTable | None] = []
    for i in range(n):
        t = world.window_s * (i + 1)
        decision, state = guarded.decide(daemon_fields(world.observe(t, table)), state, NO_BUDGET)
        if decision.table is not None:
            table = decision.table
        tables.append(table)
    return tables


# ------------------------------------------------------------------- convergence


def test_goodput_policy_implements_the_daemon_protocol() -> None:
    assert isinstance(GoodputPolicy(), DaemonPolicy)
    assert GoodputPolicy().name == "goodput"


def test_high_acceptance_batch_1_climbs_to_a_large_k() -> None:
    world = World(HIGH, TWO_SLOTS)
    assert world.optimum() == {1: 7, 128: 3}
    assert min(world.margin(1), world.margin(128)) > 0.03  # a decisive world
    result = run(world, policy(), 20)
    assert steps_of(result.table) == world.optimum()
    first = result.decisions[0]
    assert first.reason is ReasonCode.CHANGED_PREDICTED_GAIN
    assert first.expected_gain is not None and first.expected_gain > 0.05


def test_low_acceptance_at_batch_128_turns_speculation_off() -> None:
    world = World(LOW, ((1, (1, 3, 5, 7), 1, 3), (128, (0, 1, 3), 256, 1)))
    assert world.optimum() == {1: 1, 128: 0}
    assert min(world.margin(1), world.margin(128)) > 0.03
    result = run(world, policy(), 20)
    assert steps_of(result.table) == {1: 1, 128: 0}


def test_four_slots_reach_near_optimal_goodput() -> None:
    # Some optima here are flat (two candidates within 1 %): require every slot's
    # true goodput to be within 2 % (the hysteresis) of the optimum.
    world = World((0.72, 0.73, 0.75, 0.78, 0.80, 0.82, 0.82), FOUR_SLOTS)
    result = run(world, policy(), 30)
    best = world.optimum()
    for bound, k in steps_of(result.table).items():
        assert world.goodput(bound, k) >= 0.98 * world.goodput(bound, best[bound]), bound


def test_never_jumps_past_the_evidence_when_the_jump_could_cost() -> None:
    # The fallback ran k=1: only position 1 is observed. The first table goes one
    # candidate further (3), not to 7, even though 7 is the optimum: with positions 2-7
    # at their conservative bounds, 5 or 7 (4 or 6 more draft forwards per step) would
    # lose more than probe_max_loss.
    world = World(HIGH, ((1, (1, 3, 5, 7), 1, 1),))
    result = run(world, policy(), 1)
    assert steps_of(result.table) == {1: 3}
    result = run(world, policy(), 3, prev=result)
    assert steps_of(result.table) == {1: 7}


def test_follows_a_content_shift_within_a_few_decisions() -> None:
    slots = FOUR_SLOTS
    high = run(World(HIGH, slots), policy(), 20)
    low_world = World(LOW, slots, seed=1)
    after = run(low_world, policy(), 3, prev=high)
    assert steps_of(after.table) == low_world.optimum()


def test_settles_on_a_steady_workload() -> None:
    world = World((0.72, 0.73, 0.75, 0.78, 0.80, 0.82, 0.82), FOUR_SLOTS)
    # The warm-up includes the cost probe of slot 8's untimed neighbour (k=5, the true
    # optimum there, which the wrong prior's slope hid); after it nothing moves.
    warm = run(world, policy(), 120)
    assert steps_of(warm.table)[8] == world.optimum()[8]
    steady = run(world, policy(), 150, prev=warm)
    assert all(d.slots is None for d in steady.decisions)
    assert {d.reason for d in steady.decisions} == {ReasonCode.HELD_NO_CHANGE}


def test_exploration_is_bounded_and_returns_to_the_optimum() -> None:
    # explore=1: probe whenever allowed, i.e. at most once per explore_interval_s.
    world = World(LOW, ((1, (1, 3, 5, 7), 1, 3), (128, (0, 1, 3), 160, 1)))
    pol = policy(explore=1.0, explore_interval_s=60.0)
    warm = run(world, pol, 20)
    steady = run(world, pol, 120, prev=warm)  # 600 s
    probes = [d for d in steady.decisions if d.slots is not None and "probe" in d.message]
    changes = [d for d in steady.decisions if d.slots is not None]
    assert 1 <= len(probes) <= 600 / 60 + 1
    assert len(changes) <= 2 * len(probes)
    assert steps_of(steady.table) == world.optimum()


# ----------------------------------------------------- exploration past the evidence

# n-gram-like acceptance (REFERENCE.md §3): a poor first draft, then long accepted runs.
RISING = (0.65, 0.93, 0.94, 0.95, 0.95, 0.96, 0.96)
ALL_STEPS = tuple(range(8))


def test_cheap_verification_lets_a_probe_jump_past_the_evidence() -> None:
    # Batch 1: verification is nearly free, a draft step costs ~1 ms. The fallback ran
    # k=3 (positions 1-3 observed); the optimum is 7.
    world = World(RISING, ((1, ALL_STEPS, 1, 3),))
    assert world.optimum() == {1: 7}
    first = run(world, policy(), 1).decisions[0]
    assert "k=7 probe" in first.message
    assert first.expected_gain is None  # an experiment, not a prediction
    assert steps_of(first) == {1: 7}
    # The probe's evidence keeps it there.
    result = run(world, policy(), 10)
    assert steps_of(result.table) == {1: 7}
    # One candidate past the evidence at a time (no optimistic probes) starts at 4.
    slow = run(World(RISING, ((1, ALL_STEPS, 1, 3),)), policy(probe_max_loss=0.0), 1)
    assert steps_of(slow.table) == {1: 4}
    assert world.goodput(1, 4) < 0.9 * world.goodput(1, 7)


def test_a_probe_beside_a_predicted_move_leaves_the_move_its_gain() -> None:
    # Slot 1 probes k=7; slot 128 moves on evidence. The probe is named as an
    # experiment and predicts nothing; the table's gain is the predicted move's alone
    # (a probe used to blank the gain of the whole table, so the guardrails could not
    # tell a predicted down move under load from an experiment).
    moving = run(World(RISING, ((1, ALL_STEPS, 1, 3), (128, (0, 1, 2, 3), 256, 1))), policy(), 1)
    first = moving.decisions[0]
    assert first.experiment_slots == (1,) and "k=7 probe" in first.message
    assert first.expected_gain is not None and first.expected_gain > 0.02
    assert "predicted gain" in first.message
    # With only the probe moving, there is no prediction at all.
    still = run(World(RISING, ((1, ALL_STEPS, 1, 3), (128, (0, 1, 2, 3), 256, 3))), policy(), 1)
    assert still.decisions[0].experiment_slots == (1,)
    assert still.decisions[0].expected_gain is None


def test_no_jump_where_verification_costs_compute() -> None:
    # Batch 256: every verified token costs compute. The optimum is 3, but with only
    # position 1 observed the first table goes one candidate past it (2), no probe.
    world = World(HIGH, ((128, (0, 1, 2, 3), 256, 1),))
    assert world.optimum() == {128: 3}
    result = run(world, policy(), 1)
    assert steps_of(result.table) == {1: 2}
    assert "probe" not in result.decisions[0].message
    assert steps_of(run(world, policy(), 5).table) == {1: 3}


def test_the_guardrails_let_the_climb_through() -> None:
    # Under the default guardrails (2 % tolerance band, 30 s dwell) a probe carries no
    # predicted gain, so the band does not hold it: the optimum is in force within
    # 10 s, where climbing one candidate per dwell time takes minutes.
    fast = run_guarded(World(RISING, ((1, ALL_STEPS, 1, 3),)), policy(), 24)
    assert steps_of(fast[1]) == {1: 7}
    slow = run_guarded(World(RISING, ((1, ALL_STEPS, 1, 3),)), policy(probe_max_loss=0.0), 24)
    assert steps_of(slow[1])[1] < 7
    assert [steps_of(t)[1] for t in fast[1:]] == [7] * 23  # and it stays


def test_probes_only_busy_slots() -> None:
    # Slot 8 carries almost no traffic (one verify per window): nothing to learn there,
    # so it is not probed, even with random probes allowed at every decision. (Slot 1
    # has a single candidate, so slot 8 is the only place a probe could go.)
    def thin(tier: TierStat) -> TierStat:
        if tier.slot != 8:
            return tier
        hist = (0,) * tier.steps + (8,)
        return TierStat(8, tier.steps, 1, 8, hist, tier.step_time_sum_s / tier.verify_calls, 1, 8)

    def probes(**params: object) -> int:
        world = World(RISING, ((1, (3,), 1, 3), (8, ALL_STEPS, 8, 3)))
        pol = policy(explore=1.0, explore_interval_s=5.0, **params)
        state = pol.initial_state()
        table = None
        count = 0
        for i in range(20):
            obs = world.observe(5.0 * (i + 1), table)
            assert obs.tier_stats is not None
            tiers = tuple(thin(t) for t in obs.tier_stats.tiers)
            obs = replace(obs, tier_stats=replace(obs.tier_stats, tiers=tiers))
            decision, state = pol.decide(obs, state, NO_BUDGET)
            count += "probe" in decision.message
            table = enact(decision, 5.0 * (i + 1), table)
        return count

    assert probes() == 0
    assert probes(busy_share=0.0) > 0  # the guard is what keeps slot 8 out


# --------------------------------------------------------------- goodput in the SLO sense

NEAR_TIE = (0.7, 0.66, 0.62, 0.62, 0.62, 0.62, 0.62)
SLOT_256 = ((256, (0, 1, 2), 256, 1),)


def slo_policy(**params: object) -> GoodputPolicy:
    """The cost model known (a 1-2 % cost error would swamp the near-tie under test);
    the world's verifies are independent (accept_burstiness=1)."""
    base: dict[str, object] = {
        "explore": 0.0,
        "accept_burstiness": 1.0,
    }
    base.update(params)
    return GoodputPolicy(GoodputConfig(**base), prior=step_cost_prior(TRUTH))  # type: ignore[arg-type]


def test_near_the_slo_a_near_tie_goes_to_more_requests_within_it() -> None:
    # Median TPOT just above the 50 ms SLO. k=1 has the higher goodput (tokens/s), k=2
    # spreads TPOTs more (its accept length varies more), which puts more requests under
    # the SLO: k=2 has the higher goodput in the SLO sense.
    world = SloWorld(NEAR_TIE, SLOT_256, scale=2.4)
    assert 0.97 * world.goodput(256, 1) < world.goodput(256, 2) < world.goodput(256, 1)
    truth = {k: world.slo_goodput(k, 50.0) for k in (0, 1, 2)}
    assert max(truth, key=lambda k: truth[k]) == 2
    assert truth[2] > 1.1 * truth[1]
    pol = slo_policy(slo_tpot_ms=50.0)
    result = run(world, pol, 20)
    assert steps_of(result.table) == {1: 2}
    plan = pol.plan(world.observe(result.t + 5.0, result.table), result.state, NO_BUDGET)[0]
    assert plan.steps == 2 and 0.0 < plan.slo_fraction < 0.5
    # The median request still misses the SLO: the decision says so.
    last_change = next(d for d in reversed(result.decisions) if d.slots is not None)
    assert last_change.reason is ReasonCode.LIMITED_BY_SLO
    # The TPOT statistics are part of the state and survive a round trip.
    assert result.state.slo_stats is not None and result.state.seen_slots is not None
    restored = pol.state_from_dict(json.loads(json.dumps(result.state.to_dict())))
    assert restored == result.state
    # Without an SLO the same world gives the plain goodput optimum.
    free = run(SloWorld(NEAR_TIE, SLOT_256, scale=2.4), slo_policy(), 20)
    assert steps_of(free.table) == {1: 1}


def test_below_the_slo_spread_only_loses_requests() -> None:
    world = SloWorld(NEAR_TIE, SLOT_256, scale=2.0)
    truth = {k: world.slo_goodput(k, 50.0) for k in (0, 1, 2)}
    assert max(truth, key=lambda k: truth[k]) == 1
    result = run(world, slo_policy(slo_tpot_ms=50.0), 20)
    assert steps_of(result.table) == {1: 1}


def test_far_from_the_slo_the_tpot_model_stays_out() -> None:
    # Median TPOT far below the SLO: every choice meets it; plain goodput decides.
    world = SloWorld(NEAR_TIE, SLOT_256, scale=1.0)
    pol = slo_policy(slo_tpot_ms=50.0)
    result = run(world, pol, 10)
    plan = pol.plan(world.observe(result.t + 5.0, result.table), result.state, NO_BUDGET)[0]
    assert plan.slo_fraction == 1.0
    assert steps_of(result.table) == {1: 1}


# ------------------------------------------------------------------ restart trigger


def test_triggers_the_restart_check_when_no_table_beats_the_plain_server() -> None:
    # Low acceptance at batch 256: step 0 everywhere, yet every step still pays the
    # drafter's draft-extend and verify bookkeeping. The policy's own estimate of what a
    # plain server gains only triggers the restart check: no decision carries a gain.
    world = World(LOW, ((128, (0, 1, 2), 256, 1),))
    assert world.optimum() == {128: 0}
    pol = policy()
    result = run(world, pol, 80)  # 400 s
    assert steps_of(result.table) == {1: 0}
    fired = [i for i, d in enumerate(result.decisions) if d.restart_trigger is not None]
    assert fired, "no restart trigger"
    first = result.decisions[fired[0]]
    trigger = first.restart_trigger
    assert trigger is not None and "restart check triggered" in first.message
    assert trigger.summary in first.message
    # One predictor: the trigger and the decision hold no recommendation, gain or metric.
    assert set(trigger.to_dict()) == {"since_s", "summary"}
    for d in result.decisions:
        assert not any(
            isinstance(getattr(d, f.name), RestartRecommendation) for f in dataclasses.fields(d)
        )
    # Sustained: not before restart_after_s, and every decision after the first says so,
    # all for the one regime (the window the restart check replays starts at since_s).
    assert fired[0] * world.window_s >= pol.config.restart_after_s
    assert fired == list(range(fired[0], len(result.decisions)))
    assert {d.restart_trigger.since_s for d in result.decisions[fired[0] :]} == {trigger.since_s}
    held = float(first.message.split("triggered: for ")[1].split(" s ")[0])
    assert held >= pol.config.restart_after_s
    # The drafter's share of a step-0 step: the prior with vs without its drafter.
    prior = WRONG_PRIOR
    without = replace(prior, speculative=False, topk=1, num_draft_tokens=None)
    kv = 256 * CTX
    share = 1.0 - without.predict_s(256.0, 0, kv) / prior.predict_s(256.0, 0, kv)
    assert 0.0 < share < 1.0
    stated = float(first.message.split("pays the drafter (")[1].split("%")[0]) / 100
    assert stated == pytest.approx(share, rel=0.05, abs=0.001)
    # Off when restart_after_s is 0.
    off = run(World(LOW, ((128, (0, 1, 2), 256, 1),)), policy(restart_after_s=0.0), 80)
    assert all(d.restart_trigger is None for d in off.decisions)


def test_no_restart_trigger_while_speculation_pays() -> None:
    result = run(World(HIGH, FOUR_SLOTS), policy(), 80)
    assert all(d.restart_trigger is None for d in result.decisions)
    assert result.state.restart_since_s is None


# -------------------------------------------------------------------- constraints


def test_slo_unreachable_picks_lowest_predicted_tpot_and_says_so() -> None:
    world = World(HIGH, TWO_SLOTS)
    pol = policy(slo_tpot_ms=0.5)
    result = run(world, pol, 10)
    last_change = next(d for d in reversed(result.decisions) if d.slots is not None)
    assert last_change.reason is ReasonCode.LIMITED_BY_SLO
    assert "slo_tpot_ms" in last_change.limited_by
    plans = pol.plan(world.observe(result.t + 5.0, result.table), result.state, NO_BUDGET)
    assert all(p.slo_limited for p in plans)
    # The same steps as without an SLO: at a given batch size the lowest TPOT is the
    # highest goodput.
    assert steps_of(result.table) == world.optimum()


def test_slo_from_budget_and_config_override() -> None:
    world = World(HIGH, TWO_SLOTS)
    tight = Budget(None, 0.5, None, None, None)
    by_budget = run(world, policy(), 3, budget=tight)
    assert by_budget.decisions[0].reason is ReasonCode.LIMITED_BY_SLO
    loose = run(World(HIGH, TWO_SLOTS), policy(slo_tpot_ms=1000.0), 3, budget=tight)
    assert loose.decisions[0].reason is ReasonCode.CHANGED_PREDICTED_GAIN
    assert loose.decisions[0].limited_by == ()
    plans = policy(slo_tpot_ms=1000.0).plan(
        world.observe(loose.t + 5.0, loose.table), loose.state, tight
    )
    assert all(p.tpot_ms <= 1000.0 and not p.slo_limited for p in plans)


def test_probes_never_break_the_slo() -> None:
    # Slot 1 runs k=1 and teaches the pooled estimate (0.25); slot 128 (batch 160) runs
    # k=0, and k=1 there is predicted within a few % of k=0 but has no trials in that
    # slot: a probe candidate. Without an SLO it is probed; with an SLO just above
    # k=0's predicted TPOT, k=1 would break it and is never probed.
    slots = ((1, (1, 3), 1, 1), (128, (0, 1), 160, 0))
    free = run(World(LOW, slots), policy(explore=1.0, explore_interval_s=30.0), 30)
    probes = [d for d in free.decisions if d.slots is not None and "probe" in d.message]
    assert probes
    assert all("slot 128: k=1 probe" in d.message for d in probes)
    warm = run(World(LOW, slots), policy(), 2)
    obs = World(LOW, slots, seed=9).observe(warm.t + 5.0, warm.table)
    plan = {p.slot: p for p in policy().plan(obs, warm.state, NO_BUDGET)}
    assert plan[128].steps == 0
    slo = plan[128].tpot_ms * 1.005
    guarded_policy = policy(explore=1.0, explore_interval_s=30.0, slo_tpot_ms=slo)
    guarded = run(World(LOW, slots), guarded_policy, 30)
    assert not any("probe" in d.message for d in guarded.decisions if d.slots is not None)
    assert steps_of(guarded.table) == {1: 1, 128: 0}


def test_respects_candidates_and_allowed_steps() -> None:
    world = World(HIGH, FOUR_SLOTS)
    budget = Budget(None, None, None, None, (0, 1, 3))
    result = run(world, policy(), 15, budget=budget)
    cands = dict(world.candidates)
    for d in result.decisions:
        if d.slots is None:
            continue
        assert [b for b, _ in d.slots] == [b for b, _ in world.candidates]
        for bound, k in d.slots:
            assert k in cands[bound] and k in (0, 1, 3)
    assert steps_of(result.table)[1] == 3  # 5 and 7 would pay but are not allowed


def test_engine_slots_not_starting_at_1_map_to_a_table_starting_at_1() -> None:
    # The engine's first slot bound is 16; a table must start at 1 (batches below 16
    # route to the first slot anyway), and the engine then reports that slot's tiers
    # under bound 1: they are merged back into slot 16.
    slots = ((16, (0, 1, 3, 5), 24, 1), (128, (0, 1, 3), 160, 1))
    world = World(HIGH, slots, table_bounds=True)
    result = run(world, policy(), 10)
    assert result.table is not None
    assert [b for b, _ in result.table.slots] == [1, 128]
    assert [s.slot for s in result.state.acceptance.slots] == [16, 128]
    assert [b for b, _, _ in result.state.batch] == [16, 128]
    optimum = world.optimum()
    assert steps_of(result.table) == {1: optimum[16], 128: optimum[128]}


def test_no_allowed_candidate_falls_back_to_the_least_speculation() -> None:
    world = World(HIGH, TWO_SLOTS)
    budget = Budget(None, None, None, None, (2,))
    result = run(world, policy(), 2, budget=budget)
    first = result.decisions[0]
    assert first.reason is ReasonCode.LIMITED_BY_BUDGET
    assert "allowed_steps" in first.limited_by
    assert steps_of(result.table) == {1: 1, 128: 0}


# ---------------------------------------------------------------------- telemetry


def test_holds_on_unknown_telemetry() -> None:
    pol = policy()
    state = pol.initial_state()
    world = World(HIGH, TWO_SLOTS)
    obs = world.observe(5.0, None)
    for partial in (
        Observation(time_s=5.0, slot_candidates=world.candidates),
        Observation(time_s=5.0, tier_stats=obs.tier_stats),
    ):
        decision, new_state = pol.decide(partial, state, NO_BUDGET)
        assert decision.slots is None
        assert decision.reason is ReasonCode.HELD_UNKNOWN_TELEMETRY
        assert decision.expected_gain is None
    # No tier statistics: nothing learned.
    decision, new_state = pol.decide(
        Observation(time_s=5.0, slot_candidates=world.candidates), state, NO_BUDGET
    )
    assert new_state.acceptance == state.acceptance
    assert new_state.step_cost == state.step_cost


def test_a_plan_has_steps_rules_and_a_reason_and_no_change_holds() -> None:
    pol = policy()
    world = World(HIGH, TWO_SLOTS)
    prior_table = StepTable(((1, 3), (128, 1)), version=41, produced_at_s=0.0, ttl_s=45.0)
    decision, _ = pol.decide(world.observe(5.0, prior_table), pol.initial_state(), NO_BUDGET)
    assert decision.slots is not None and [b for b, _ in decision.slots] == [1, 128]
    assert decision.reason is ReasonCode.CHANGED_PREDICTED_GAIN
    assert decision.message.startswith("goodput: new table")
    # Converge, then the same table in force gives HELD_NO_CHANGE and no steps.
    result = run(world, pol, 10)
    decision, _ = pol.decide(world.observe(result.t + 5.0, result.table), result.state, NO_BUDGET)
    assert decision.slots is None
    assert decision.reason is ReasonCode.HELD_NO_CHANGE


def test_an_expired_table_is_planned_again() -> None:
    pol = policy()
    world = World(HIGH, TWO_SLOTS)
    result = run(world, pol, 10)
    assert result.table is not None
    stale = StepTable(result.table.slots, result.table.version, 0.0, 10.0)
    decision, _ = pol.decide(world.observe(result.t + 5.0, stale), result.state, NO_BUDGET)
    assert decision.slots == stale.slots


# ---------------------------------------------------------------- determinism/state


def _trace(seed: int) -> tuple[list[tuple[object, ...]], dict[str, Any]]:
    world = World((0.72, 0.73, 0.75, 0.78, 0.80, 0.82, 0.82), FOUR_SLOTS, seed=3)
    result = run(world, policy(explore=0.5, explore_interval_s=10.0, seed=seed), 40)
    trace: list[tuple[object, ...]] = [
        (d.reason, d.message, d.slots, d.rules, d.expected_gain) for d in result.decisions
    ]
    return trace, result.state.to_dict()


def test_same_inputs_give_same_outputs() -> None:
    assert _trace(7) == _trace(7)


def test_state_round_trips_and_continues_identically() -> None:
    world = World(HIGH, FOUR_SLOTS, seed=5)
    pol = policy(explore=0.5, explore_interval_s=10.0)
    first = run(world, pol, 15)
    restored = pol.state_from_dict(json.loads(json.dumps(first.state.to_dict())))
    assert restored == first.state
    obs = [world.observe(first.t + 5.0 * (i + 1), first.table) for i in range(10)]
    a, b = first.state, restored
    for o in obs:
        da, a = pol.decide(o, a, NO_BUDGET)
        db, b = pol.decide(o, b, NO_BUDGET)
        assert da == db
    assert a.to_dict() == b.to_dict()


def test_reads_version_1_states() -> None:
    new_keys = ("restart_since_s", "slo_stats", "seen_slots", "seen_since_s", "first_draft")
    v1 = {k: v for k, v in policy().initial_state().to_dict().items() if k not in new_keys}
    v1["version"] = 1
    v1["last_table"] = v1.pop("last_slots")
    del v1["last_rules"]
    state = GoodputState.from_dict(v1)
    assert state.version == GOODPUT_STATE_VERSION == 4
    assert state.restart_since_s is None and state.slo_stats is None
    assert state.seen_slots is None and state.seen_since_s is None
    with pytest.raises(PolicyTypeError, match=r"unknown key\(s\) \['restart_since_s'\]"):
        GoodputState.from_dict({**v1, "restart_since_s": None})


def test_reads_version_2_states_with_the_proposal_as_a_table() -> None:
    """Versions 1 and 2 kept the last proposal as a versioned table: its steps and
    rules are read (the version and TTL were the guard's business all along)."""
    pol = policy()
    world = World(HIGH, TWO_SLOTS)
    warm = run(world, pol, 10)
    assert warm.state.last_slots is not None
    table = StepTable(warm.state.last_slots, 7, warm.t, 30.0, rules=warm.state.last_rules)
    v2 = warm.state.to_dict()
    del v2["last_slots"], v2["last_rules"], v2["first_draft"]
    v2 |= {"version": 2, "last_table": json.loads(json.dumps(table.to_dict()))}
    state = GoodputState.from_dict(v2)
    assert warm.state.first_draft  # version 4's counts, which older states lack
    assert state == replace(warm.state, first_draft=())
    with pytest.raises(PolicyTypeError, match=r"unknown key\(s\) \['last_slots'\]"):
        GoodputState.from_dict({**v2, "last_slots": None})


def test_a_held_proposal_is_withdrawn_explicitly() -> None:
    # The policy proposed a table the guardrails did not publish; when it wants the
    # table in force again it says so with that table (else the guardrails keep
    # standing by the old proposal), once.
    pol = policy()
    world = World(HIGH, TWO_SLOTS)
    warm = run(world, pol, 10)
    assert warm.table is not None
    state = replace(warm.state, last_slots=((1, 1), (128, 0)), last_rules=())
    decision, state = pol.decide(world.observe(warm.t + 5.0, warm.table), state, NO_BUDGET)
    assert decision.slots == warm.table.slots
    decision, _ = pol.decide(world.observe(warm.t + 10.0, warm.table), state, NO_BUDGET)
    assert decision.slots is None


def test_state_from_dict_rejects_bad_input() -> None:
    good = policy().initial_state().to_dict()
    with pytest.raises(PolicyTypeError, match="unsupported state version 5"):
        GoodputState.from_dict({**good, "version": 5})
    with pytest.raises(PolicyTypeError, match="first_draft"):
        GoodputState.from_dict({**good, "first_draft": [[1, 0, 3.0, 1.0]]})
    with pytest.raises(PolicyTypeError, match="first_draft"):
        GoodputState.from_dict({**good, "first_draft": [[1, 2, 3.0]]})
    with pytest.raises(PolicyTypeError, match=r"unknown key\(s\) \['junk'\]"):
        GoodputState.from_dict({**good, "junk": True})
    with pytest.raises(PolicyTypeError, match="rng_state"):
        GoodputState.from_dict({**good, "rng_state": ["zz", "1", "0", "0"]})
    with pytest.raises(PolicyTypeError, match="AcceptanceState"):
        GoodputState.from_dict({**good, "acceptance": {"version": 1}})


# ------------------------------------------------------------------------- config


def test_config_parses_strings_and_names_bad_keys() -> None:
    cfg = GoodputConfig.from_params({"slo_tpot_ms": "40", "explore": "0.1", "seed": "3"})
    assert cfg.slo_tpot_ms == 40.0 and cfg.explore == 0.1 and cfg.seed == 3
    assert GoodputConfig.from_params({"slo_tpot_ms": "none"}).slo_tpot_ms is None
    assert GoodputPolicy(cfg).name == "goodput:slo_tpot_ms=40,explore=0.1,seed=3"
    with pytest.raises(
        GoodputConfigError, match=r"unknown parameter 'slo'.*valid keys: slo_tpot_ms"
    ):
        GoodputConfig.from_params({"slo": "40"})
    with pytest.raises(GoodputConfigError, match=r"'explore': expected a number, got 'lots'"):
        GoodputConfig.from_params({"explore": "lots"})
    with pytest.raises(GoodputConfigError, match=r"'explore': expected a number in \[0, 1\]"):
        GoodputConfig.from_params({"explore": "2"})
    with pytest.raises(GoodputConfigError, match="'seed': expected an int"):
        GoodputConfig.from_params({"seed": "1.5"})
    with pytest.raises(GoodputConfigError, match="'slo_tpot_ms'"):
        GoodputConfig(slo_tpot_ms=-1.0)
    with pytest.raises(GoodputConfigError, match=r"'probe_max_loss': expected a number in"):
        GoodputConfig.from_params({"probe_max_loss": "1.5"})
    with pytest.raises(GoodputConfigError, match=r"'cost_probe_evidence': expected a number >= 0"):
        GoodputConfig.from_params({"cost_probe_evidence": "-1"})
    with pytest.raises(GoodputConfigError, match="'accept_burstiness': expected a number >= 1"):
        GoodputConfig(accept_burstiness=0.5)
    with pytest.raises(GoodputConfigError, match="'slo_band_sd'"):
        GoodputConfig(slo_band_sd=0.0)
    with pytest.raises(GoodputConfigError, match="'restart_cost_s'"):
        GoodputConfig(restart_cost_s=-1.0)
    assert GoodputConfig.from_params({"restart_after_s": "0"}).restart_after_s == 0.0


# ------------------------------------------------------------- a prior with a wrong knee

# The step-cost prior of another GPU of the catalog (an L40S: about 3x slower, and a
# knee at more batched tokens, so it believes verification and drafting cost relatively
# less than on the H100 the world runs on): a wrong shape, not only a wrong scale.
OTHER_GPU_PRIOR = step_cost_prior(
    CostModel.from_catalog(
        CATALOG.gpu("l40s"), CATALOG.model("llama-3.1-8b"), CATALOG.drafter("eagle3")
    )
)
# EAGLE-3-like falling acceptance: on the H100 at one request k=3 is best; the L40S
# prior, scaled to the H100's step time at k=3 alone, would still put k=7 near it.
FALLING = (0.8, 0.7, 0.62, 0.55, 0.5, 0.45, 0.4)


def test_a_prior_with_a_wrong_knee_ends_at_the_true_optimum() -> None:
    world = World(FALLING, ((1, ALL_STEPS, 1, 3),))
    assert world.optimum() == {1: 3}
    assert world.goodput(1, 7) < 0.95 * world.goodput(1, 3)  # a wrong k=7 costs > 5 %
    pol = GoodputPolicy(GoodputConfig(explore=0.0), prior=OTHER_GPU_PRIOR)
    result = run(world, pol, 30)
    assert steps_of(result.table) == {1: 3}
    # ... and it stays there: what it learned at k=3 does not make larger k look free.
    later = run(world, pol, 60, prev=result)
    assert steps_of(later.table) == {1: 3}
    assert all(steps_of(d)[1] <= 4 for d in later.decisions if d.slots is not None)


# ------------------------------------------------- cost probes (issue 8 §3, wrong GPU)

L40S_PRIOR = step_cost_prior(
    CostModel.from_catalog(
        CATALOG.gpu("l40s"), CATALOG.model("llama-3.1-8b"), CATALOG.drafter("eagle3")
    )
)
# EAGLE-3-like rates at 225 requests on the H100 starting from k=2: k=1 is the optimum
# (3.7 % more goodput), k=0 and k=3 are worse; the shape of users-256/h100/eagle3.
SATURATED = World((0.62, 0.62, 0.585, 0.556, 0.528, 0.502, 0.477), ((1, (0, 1, 2, 3), 225, 2),))


def test_a_wrong_gpu_prior_probes_the_untimed_neighbour_and_keeps_it() -> None:
    assert SATURATED.optimum() == {1: 1}
    pol = GoodputPolicy(GoodputConfig(explore=0.0), prior=L40S_PRIOR)
    r = run(SATURATED, pol, 40)
    # One window at k=2: the L40S slope makes k=1 look worse, but k=1 was never timed
    # here and its favourable bound wins, so it is probed (an experiment) ...
    first = r.decisions[0]
    assert first.slots == ((1, 1),)
    assert first.experiment_slots == (1,)
    # ... and, timed, kept: no further step change; one more table at most, when the
    # experiment ends and the slot gets its live-acceptance rule back.
    assert steps_of(r.table) == {1: 1}
    later = [d for d in r.decisions[1:] if d.slots is not None]
    assert len(later) <= 1 and all(d.slots == ((1, 1),) and d.rules for d in later)


def test_without_cost_probes_the_wrong_gpu_prior_stays_on_the_step_it_ran() -> None:
    pol = GoodputPolicy(GoodputConfig(explore=0.0, cost_probe_evidence=0.0), prior=L40S_PRIOR)
    r = run(SATURATED, pol, 40)
    assert steps_of(r.table) == {1: 2}
    assert all(not d.experiment_slots for d in r.decisions)


def test_the_exact_prior_moves_to_the_optimum_without_a_cost_probe() -> None:
    pol = GoodputPolicy(GoodputConfig(explore=0.0), prior=step_cost_prior(TRUTH))
    r = run(SATURATED, pol, 40)
    assert steps_of(r.table) == {1: 1}
    assert all(not d.experiment_slots for d in r.decisions)


@pytest.mark.parametrize(
    ("changes", "ok"),
    [
        ({"batch": ((1, 2.0, 1.0), (8, 0, 3))}, True),  # ints count
        ({"batch": ((1, float("nan"), 1.0),)}, False),
        ({"batch": ((1, 2.0, float("inf")),)}, False),
        ({"batch": ((1, -1.0, 1.0),)}, False),
        ({"batch": ((True, 2.0, 1.0),)}, False),
        ({"batch": ((1, 2.0),)}, False),
        ({"slo_stats": (0.0, 1.0, -2.0, 3.0, 0.1, 0.1, 5.0)}, True),  # logs may be < 0
        ({"slo_stats": (1e308, 1e308, 1e308, 1e308, 1e308, 1e308, 1e308)}, True),
        ({"slo_stats": (0.0, 1.0, 2.0, float("nan"), 0.1, 0.1, 5.0)}, False),
        ({"slo_stats": (0.0, 1.0, 2.0, 3.0, 0.1, 0.1, float("-inf"))}, False),
        ({"slo_stats": (0.0, 1.0, 2.0, 3.0, 0.1, 0.1, True)}, False),
        ({"seen_slots": ((1, 3), (8, 0))}, True),
        ({"seen_slots": ((1, 3.0),)}, False),
        ({"seen_slots": ((1, True),)}, False),
        ({"seen_slots": ((1, 3, 5),)}, False),
    ],
)
def test_state_fields_take_finite_numbers_and_ints_only(changes: dict[str, Any], ok: bool) -> None:
    # The state is built a few times per decision; its checks take a fast path for plain
    # floats and ints and must still refuse everything the exact checks refuse.
    state = GoodputPolicy().initial_state()
    if ok:
        replace(state, **changes)
    else:
        with pytest.raises(PolicyTypeError, match="GoodputState"):
            replace(state, **changes)


# ------------------------------------------------------------- live-acceptance rules


def test_the_guarded_policy_publishes_live_rules_and_charges_step_0_its_probes() -> None:
    # A poor drafter at a large batch: 0 steps there, with a rule to come back by.
    world = World(LOW, TWO_SLOTS)
    tables = [t for t in run_guarded(world, policy(), 12) if t is not None]
    table = tables[-1]
    assert table.to_dict()["schema"] == 4  # its rules carry their cuts' slopes
    rule = table.rule_for(128)
    assert rule is not None and table.steps_for(128) in rule.steps
    assert rule.steps[0] == 0 and rule.probe_step == 1  # off now, a probe to learn by
    # Step 0 wins only below the acceptance where one step (probes included) pays.
    assert 0.0 < rule.thresholds[0] < 1.0 and rule.steps_at(rule.prior) == 0


def test_published_rules_keep_to_the_budgets_allowed_steps() -> None:
    world = World(HIGH, TWO_SLOTS)
    guarded = GuardedPolicy(policy(), GuardrailConfig())
    state = guarded.initial_state()
    budget = Budget(None, None, None, None, (0, 1, 3))  # 5 and 7 not allowed
    table: StepTable | None = None
    for i in range(12):
        obs = daemon_fields(world.observe(world.window_s * (i + 1), table))
        decision, state = guarded.decide(obs, state, budget)
        if decision.table is not None:
            table = decision.table
    assert table is not None
    for bound, rule in table.rules:
        assert set(rule.steps) <= {0, 1, 3}, (bound, rule)
