"""The goodput policy's per-step first-draft rates (model.first_draft_ratios).

Where accepted drafts come in runs (an n-gram drafter copying earlier text), a verify's
first draft is accepted less often the more steps run: a longer chain crosses a run in
fewer verifies. The policy weighs each step count with the first-draft rate measured
at it, and reads the engine's live signal in the units of the steps that run.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import pytest
from test_goodput_policy import (
    CTX,
    HIGH,
    LOW,
    NO_BUDGET,
    TRUTH,
    World,
    accept_length,
    accepted_distribution,
    policy,
    run,
)

from specgov.policies.common.observation import Observation
from specgov.policies.common.step_table import SlotRule, StepTable
from specgov.policies.common.types import TierStat, TierStatsSnapshot
from specgov.policies.daemon.goodput.model import (
    first_draft_ratios,
    first_scaled,
    ratio_at,
    run_weight,
    update_first_draft,
)
from specgov.policies.engine.table import PROBE_SHARE


def _tier(slot: int, steps: int, hist: Sequence[int]) -> TierStat:
    requests = sum(hist)
    return TierStat(
        slot=slot,
        steps=steps,
        verify_calls=requests,
        requests=requests,
        accepted_hist=tuple(hist),
        step_time_sum_s=0.01 * requests,
        step_time_count=requests,
        batch_size_sum=requests,
    )


def _snap(end_s: float, *tiers: TierStat) -> TierStatsSnapshot:
    return TierStatsSnapshot(end_s - 1.0, end_s, tiers)


def test_counts_decay_add_positive_steps_only_and_reset_on_a_shift() -> None:
    first = update_first_draft((), _snap(1.0, _tier(1, 0, [50]), _tier(1, 2, [60, 10, 30])), 1.0)
    assert first == ((1, 2, 100.0, 40.0),)  # step 0 says nothing about drafts
    first = update_first_draft(first, _snap(2.0, _tier(8, 1, [5, 5])), 0.5)
    assert first == ((1, 2, 50.0, 20.0), (8, 1, 10.0, 5.0))
    # A shift detected at slot 1: its older counts go, this window's stay.
    first = update_first_draft(first, _snap(3.0, _tier(1, 1, [1, 3])), 0.5, reset=(1,))
    assert first == ((1, 1, 4.0, 3.0), (8, 1, 5.0, 2.5))


def test_run_weight_is_zero_where_the_steps_cannot_move_the_first_draft_rate() -> None:
    assert run_weight((0.69, 0.66, 0.69)) == 0.0  # EAGLE-3 on chat: flat, no runs
    assert run_weight((0.35, 0.84, 0.87)) == (0.84 - 0.35) / 0.84  # n-gram: runs
    assert run_weight((0.5,)) == 0.0 and run_weight((0.0, 0.0)) == 0.0


def test_ratios_follow_the_evidence_and_shrink_to_1_without_it() -> None:
    # 1 step: 0.25 of 4,000; 2 steps: 0.16 of 4,000; pooled 0.205.
    first = ((16, 1, 4000.0, 1000.0), (16, 2, 4000.0, 640.0), (16, 3, 2.0, 2.0))
    ratios = first_draft_ratios(first, 16, pseudo=50.0)
    assert ratios[1] == round((1000 + 50 * 0.205) / 4050 / 0.205, 2) == 1.22
    # Two requests at 3 steps, both passed, would rise above 2 steps' rate: a rise
    # with the steps is pooled away (2 and 3 share their rate).
    assert ratios[2] == ratios[3] == 0.79
    # Rates that rise with the steps (a live rule's selection) give no ratio at all.
    rising = ((1, 1, 4000.0, 500.0), (1, 3, 4000.0, 1400.0))
    assert first_draft_ratios(rising, 1, pseudo=50.0) == {1: 1.0, 3: 1.0}
    assert first_draft_ratios(first, 4, pseudo=50.0) == {}  # another slot's evidence
    assert first_draft_ratios(((1, 1, 10.0, 0.0),), 1, pseudo=50.0) == {}
    # Scaled by how far the steps can move the rate (run_weight of the profile).
    assert first_draft_ratios(first, 16, pseudo=50.0, run_share=0.5) == {1: 1.11, 2: 0.89, 3: 0.89}
    assert first_draft_ratios(first, 16, pseudo=50.0, run_share=0.0) == {1: 1.0, 2: 1.0, 3: 1.0}
    # A step count not measured: the nearest measured below it (the most it can be).
    measured = {1: 1.2, 2: 0.8, 4: 0.7}
    assert [ratio_at(measured, k) for k in (1, 3, 4, 7)] == [1.2, 0.8, 0.7, 0.7]
    assert ratio_at({2: 0.8}, 1) == 0.8 and ratio_at({}, 3) == 1.0
    assert first_scaled((0.2, 0.9), 1.0) == (0.2, 0.9)
    assert first_scaled((0.5, 0.9), 1.5) == (0.75, 0.9)
    assert first_scaled((0.8, 0.9), 1.5) == (0.99, 0.9)  # a verify may always stop


@dataclass
class RunWorld(World):
    """One slot whose first-draft rate depends on the steps (acceptance in runs)."""

    first_at: Mapping[int, float] | None = None

    def rates_at(self, k: int) -> tuple[float, ...]:
        assert self.first_at is not None
        return (self.first_at[k], *self.rates[1:])

    def goodput(self, bound: int, k: int) -> float:
        batch = next(bs for b, _, bs, _ in self.slots if b == bound)
        el = accept_length(self.rates_at(k), k) if k > 0 else 1.0
        return batch * el / TRUTH.decode_step_s(batch, k, batch * CTX)

    def observe(self, t: float, table: StepTable | None) -> Observation:
        obs = super().observe(t, table)
        assert obs.tier_stats is not None
        tiers = []
        for tier in obs.tier_stats.tiers:
            dist = accepted_distribution(self.rates_at(tier.steps), tier.steps)
            hist = self.rng.multinomial(tier.requests, dist)
            tiers.append(
                TierStat(
                    slot=tier.slot,
                    steps=tier.steps,
                    verify_calls=tier.verify_calls,
                    requests=tier.requests,
                    accepted_hist=tuple(int(h) for h in hist),
                    step_time_sum_s=tier.step_time_sum_s,
                    step_time_count=tier.step_time_count,
                    batch_size_sum=tier.batch_size_sum,
                )
            )
        snap = TierStatsSnapshot(obs.tier_stats.window_start_s, t, tuple(tiers))
        return Observation(
            time_s=obs.time_s,
            running_requests=obs.running_requests,
            token_usage=obs.token_usage,
            kv_capacity_tokens=obs.kv_capacity_tokens,
            table=obs.table,
            tier_stats=snap,
            slot_candidates=obs.slot_candidates,
        )


# users-16 on the H100 with n-gram acceptance, as measured per step count (0.217 at 1
# step, 0.165 at 2, 0.14 at 3); a run, once entered, goes on (0.95).
NGRAM_FIRST = {0: 0.0, 1: 0.22, 2: 0.165, 3: 0.14}


class MixWorld(RunWorld):
    """Every window runs the slot at 1 and at 2 steps alike (a live rule moving between
    them), whatever the table says."""

    def observe(self, t: float, table: StepTable | None) -> Observation:
        obs = super().observe(t, StepTable(((1, 1),), 1, t, 3600.0))
        other = super().observe(t, StepTable(((1, 2),), 1, t, 3600.0))
        assert obs.tier_stats is not None and other.tier_stats is not None
        tiers = (*obs.tier_stats.tiers, *other.tier_stats.tiers)
        snap = TierStatsSnapshot(obs.tier_stats.window_start_s, t, tiers)
        return Observation(
            time_s=t,
            running_requests=obs.running_requests,
            token_usage=obs.token_usage,
            kv_capacity_tokens=obs.kv_capacity_tokens,
            table=table,
            tier_stats=snap,
            slot_candidates=obs.slot_candidates,
        )


def test_evidence_at_two_step_counts_weighs_each_at_its_own_rate() -> None:
    world = MixWorld((0.2, 0.95, 0.95), ((16, (0, 1, 2, 3), 16, 2),), first_at=NGRAM_FIRST)
    pol = policy()
    result = run(world, pol, 12)
    ratios = first_draft_ratios(result.state.first_draft, 16, pseudo=50.0)
    assert ratios[1] > 1.1 > 0.9 > ratios[2]  # 0.22 and 0.165 over the pooled 0.19
    (plan,) = pol.plan(world.observe(result.t + 5.0, result.table), result.state, NO_BUDGET)
    assert plan.steps == world.optimum()[16] == 1
    # Pooled over both (0.19 at position 1), more steps would look best.
    assert pooled_world(0.19).optimum()[16] > 1


def pooled_world(rate: float) -> RunWorld:
    return RunWorld(
        (0.2, 0.95, 0.95),
        ((16, (0, 1, 2, 3), 16, 2),),
        first_at={0: 0.0} | {k: rate for k in range(1, 4)},
    )


def test_a_slot_is_weighed_at_each_steps_own_first_draft_rate() -> None:
    world = RunWorld((0.2, 0.95, 0.95), ((16, (0, 1, 2, 3), 16, 2),), first_at=NGRAM_FIRST, seed=3)
    best = world.optimum()
    assert best == {16: 1}
    # Weighed with one pooled rate (what 2 steps show, 0.165), 2 steps would win...
    pooled = RunWorld(
        (0.2, 0.95, 0.95), world.slots, first_at={k: 0.165 for k in range(1, 4)} | {0: 0.0}
    )
    assert pooled.optimum() == {16: 2}
    # ... where the truth at 1 step beats 2 (and 0) by a margin.
    assert world.goodput(16, 1) > 1.02 * max(world.goodput(16, 2), world.goodput(16, 0))
    result = run(world, policy(), 40)
    table = result.table
    assert table is not None and table.steps_for(16) == best[16]
    # The rule the engine follows runs 1 step at the rate measured there.
    rule = table.rule_for(table.slot_for(16))
    assert rule is None or rule.steps_at(NGRAM_FIRST[1]) == 1


# ------------------------------------------------------------- no absorbing "off"


@dataclass
class ProbingWorld(World):
    """A slot at 0 steps under a rule also runs its probes (``PROBE_SHARE`` of its
    verifies at the rule's probe step), as the engine's TablePolicy does; they are the
    only acceptance evidence the slot gives while it is off."""

    def observe(self, t: float, table: StepTable | None) -> Observation:
        obs = World.observe(self, t, table)
        assert obs.tier_stats is not None
        tiers = list(obs.tier_stats.tiers)
        for tier in obs.tier_stats.tiers:
            rule = None if table is None else table.rule_for(table.slot_for(tier.slot))
            if tier.steps != 0 or rule is None or rule.probe_step is None:
                continue
            k = rule.probe_step
            batch = tier.batch_size_sum // tier.verify_calls
            verifies = max(1, round(PROBE_SHARE * tier.verify_calls))
            hist = self.rng.multinomial(verifies * batch, accepted_distribution(self.rates, k))
            step_s = TRUTH.decode_step_s(batch, k, batch * CTX)
            tiers.append(
                TierStat(
                    tier.slot,
                    k,
                    verifies,
                    verifies * batch,
                    tuple(int(h) for h in hist),
                    step_s * verifies,
                    verifies,
                    verifies * batch,
                )
            )
        snap = TierStatsSnapshot(obs.tier_stats.window_start_s, t, tuple(tiers))
        return replace(obs, tier_stats=snap)


def _seconds_back(world: type[World]) -> float | None:
    """Seconds after acceptance rises until the daemon's own plan speculates again at
    a slot a poor phase turned off (None: not within two minutes)."""
    slots = ((128, (0, 1, 3), 160, 1),)
    assert world(LOW, slots).optimum() == {128: 0} and world(HIGH, slots).optimum()[128] > 0
    pol = policy()
    result = run(world(LOW, slots), pol, 60)
    assert result.table is not None and result.table.steps_for(128) == 0
    t0 = result.t
    rich = world(HIGH, slots, seed=1)
    for _ in range(24):
        result = run(rich, pol, 1, prev=result)
        if result.table is not None and result.table.steps_for(128) > 0:
            return result.t - t0
    return None


def test_a_slot_turned_off_by_a_poor_phase_speculates_again_when_acceptance_rises() -> None:
    # The engine's probes at 0 steps (a bounded share, charged by the rule) are the
    # evidence: the daemon's plan is back to speculating within a minute (one decision,
    # 5 s, measured here) ...
    back = _seconds_back(ProbingWorld)
    assert back is not None and back <= 60.0, back
    # ... and without them there would be nothing to learn from: 0 would be absorbing.
    assert _seconds_back(World) is None


def test_at_0_steps_the_signal_is_read_at_the_rule_in_forces_probe_step() -> None:
    # Evidence at 1 and 2 steps (first-draft rates 0.22 and 0.165), then the slot at 0
    # under a rule whose probes run 2 steps, or 1: the new rule's prior (the signal it
    # starts from) is in the units of the steps the probes run.
    world = MixWorld((0.2, 0.95, 0.95), ((16, (0, 1, 2, 3), 16, 2),), first_at=NGRAM_FIRST)
    pol = policy()
    warm = run(world, pol, 12)
    priors = {}
    for probe in (1, 2):
        rule = SlotRule(thresholds=(0.5,), steps=(0, probe), prior=0.2)
        table = StepTable(((1, 0),), 1, warm.t, 3600.0, rules=((1, rule),))
        obs = World.observe(world, warm.t + 5.0, table)  # the slot ran 0 steps
        (plan,) = pol.plan(obs, warm.state, NO_BUDGET)
        assert plan.rule is not None
        priors[probe] = plan.rule.prior
    ratios = first_draft_ratios(warm.state.first_draft, 16, pseudo=50.0)
    assert priors[2] < priors[1]
    assert priors[2] / priors[1] == pytest.approx(ratios[2] / ratios[1], rel=0.1)
