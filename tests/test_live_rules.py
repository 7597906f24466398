"""Live-acceptance rules (step table formats 2 to 4): followed at batch speed in TablePolicy,
with hysteresis and dwell, probes that keep a slot at 0 steps learnable, the same answers
in the plugin as in replay, and the table format versioned both ways."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import pytest
from verify_stubs import Clock
from verify_stubs import draw_accepted as draw

import specgov.policies.engine.table as table_mod
from specgov.adapters.sglang_plugin import SpecgovAdaptiveParams
from specgov.adapters.spool_table import SpoolTableReader, write_step_table
from specgov.adapters.tp_sync import LocalChannel
from specgov.policies.common.step_table import TABLE_SCHEMA, SlotRule, StepTable
from specgov.policies.common.types import PolicyTypeError, TierStatsSnapshot
from specgov.policies.daemon.goodput.rules import GRID, RuleEval, slot_rule
from specgov.policies.engine.ema import EmaPolicy
from specgov.policies.engine.table import (
    PROBE_COST,
    PROBE_EVERY_BATCHES,
    PROBE_MIN_EVERY,
    PROBE_SHARE,
    RULE_CONFIRM_S,
    RULE_DWELL_S,
    RULE_HYSTERESIS,
    RULE_MOVE_GAIN,
    STICKY_BAND,
    STICKY_GAIN,
    TablePolicy,
    probe_every,
    probe_share,
)

CANDIDATES = [0, 1, 3, 5, 7]
# CUDA graphs off: SGLang's default config captures no step 0 for small batches.
GRAPHS = None
BATCH_S = 0.01  # simulated seconds per decode batch


def rule_table(rule: SlotRule, at_s: float, *, steps: int | None = None) -> StepTable:
    nominal = rule.steps_at(rule.prior) if steps is None else steps
    return StepTable(
        ((1, nominal), (8, 1)),
        version=1,
        produced_at_s=at_s,
        ttl_s=1e6,
        rules=((1, rule),),
    )


def table_policy(source: object, clock: Clock, poll: int = 16) -> TablePolicy:
    snapshots: list[TierStatsSnapshot] = []
    policy = TablePolicy(
        table_source=source,  # type: ignore[arg-type]
        stats_sink=snapshots.append,
        clock=clock,
        fallback=EmaPolicy(3),
        poll_every_batches=poll,
    )
    policy.set_cuda_graph_bs(GRAPHS)
    return policy


def run(
    policy: TablePolicy | SpecgovAdaptiveParams,
    clock: Clock,
    rng: random.Random,
    seconds: float,
    p: float,
    batch_size: int = 2,
) -> list[int]:
    """Drive ``seconds`` of decode batches at acceptance ``p``; the steps of each batch."""
    ran = []
    for _ in range(round(seconds / BATCH_S)):
        steps = policy.get_steps_for_batch(batch_size)
        ran.append(steps)
        policy.on_verify_complete(draw(rng, steps, batch_size, p), batch_size)
        clock.now_s += BATCH_S
    return ran


# ------------------------------------------------------------------ following


def test_the_rule_follows_the_live_acceptance_both_ways() -> None:
    clock = Clock()
    rule = SlotRule(thresholds=(0.3, 0.6), steps=(0, 1, 5), prior=0.45)
    policy = table_policy(lambda: rule_table(rule, clock()), clock)
    rng = random.Random(0)
    assert run(policy, clock, rng, 1.0, 0.45)[0] == 1  # the prior's band to start with
    high = run(policy, clock, rng, 15.0, 0.85)
    assert high[-1] == 5  # acceptance rose: more steps
    low = run(policy, clock, rng, 30.0, 0.1)
    assert low[-1] == 0  # fell: none (with probes now and then)
    assert policy.rule_changes >= 2
    assert set(policy.live_rules) == {1}


def test_steady_load_changes_a_slot_at_most_once_per_dwell() -> None:
    # The true acceptance sits right on a threshold: the worst case for flapping.
    clock = Clock()
    rule = SlotRule(thresholds=(0.5,), steps=(1, 3), prior=0.5)
    refreshed = [rule_table(rule, clock())]  # a new table object every poll (worst case)
    policy = table_policy(
        lambda: refreshed.append(rule_table(rule, clock())) or refreshed[-1], clock
    )
    rng = random.Random(3)
    ran = run(policy, clock, rng, 120.0, 0.5, batch_size=4)
    switches = [i * BATCH_S for i in range(1, len(ran)) if ran[i] != ran[i - 1]]
    assert policy.rule_changes == len(switches)
    gaps = [b - a for a, b in itertools.pairwise(switches)]
    # At most one tier change per slot per 10 s (judged on the poll clock: one poll's slack).
    assert RULE_DWELL_S == 10.0
    assert all(g >= RULE_DWELL_S - 16 * BATCH_S for g in gaps), gaps
    assert len(switches) <= 120 / 10 + 1


def test_a_dip_shorter_than_the_confirmation_moves_nothing_a_lasting_one_does() -> None:
    clock = Clock()
    rule = SlotRule(thresholds=(0.5,), steps=(1, 3), prior=0.7)
    policy = table_policy(lambda: rule_table(rule, clock()), clock)
    rng = random.Random(4)
    assert set(run(policy, clock, rng, 15.0, 0.7, batch_size=4)) == {3}
    # The batch's mix of requests turns poor for under RULE_CONFIRM_S: the signal falls
    # far past the cut, and the slot stays where it is.
    dip = RULE_CONFIRM_S / 2
    assert policy.live_rules[1][1] == 3
    low = run(policy, clock, rng, dip, 0.1, batch_size=4)
    assert policy.live_rules[1][0] < 0.5 - 0.06, policy.live_rules  # the dip was seen
    after = run(policy, clock, rng, 15.0, 0.7, batch_size=4)
    assert set(low) | set(after) == {3} and policy.rule_changes == 0
    # A poor phase that lasts: one move, within the confirmation (and a poll) of the
    # signal crossing.
    poor = run(policy, clock, rng, 10.0, 0.1, batch_size=4)
    moved_s = poor.index(1) * BATCH_S
    assert RULE_CONFIRM_S - 0.5 <= moved_s <= RULE_CONFIRM_S + 1.0, moved_s
    assert set(poor[poor.index(1) :]) == {1} and policy.rule_changes == 1


def test_a_steep_rule_moves_within_its_narrow_bands_a_flat_one_keeps_the_fixed_hysteresis() -> None:
    """A poor drafter's rule has cuts a few hundredths apart and steep slopes: its
    hysteresis is what moves goodput by RULE_MOVE_GAIN (0.02 / 1.0 = 0.02 here), not
    the fixed RULE_HYSTERESIS (0.06), which is wider than its bands. Without slopes
    (formats 2-3) a signal 0.04 below the cut stays inside the fixed band."""
    assert RULE_HYSTERESIS == 0.06 and RULE_MOVE_GAIN == 0.02

    def ran_after(slopes: tuple[float, ...] | None) -> set[int]:
        clock = Clock()
        rule = SlotRule(thresholds=(0.12, 0.16), steps=(0, 1, 3), prior=0.2, slopes=slopes)
        policy = table_policy(lambda: rule_table(rule, clock()), clock)
        rng = random.Random(6)
        assert set(run(policy, clock, rng, 15.0, 0.2, batch_size=4)) == {3}
        # The signal settles at 0.12-0.14: 0.02-0.04 below the 1 | 3 cut.
        return set(run(policy, clock, rng, 40.0, 0.13, batch_size=4)[-500:])

    assert ran_after((1.0, 1.0)) == {1}  # moved down one band, and stays
    assert ran_after(None) == {3}  # within the fixed 0.06: held


def _alternating_slots_switches() -> tuple[int, set[int]]:
    clock = Clock()
    # Slot 1 cuts 3 -> 5 at 0.60, slot 8 at 0.64; the acceptance sits between them.
    table = StepTable(
        ((1, 5), (8, 3)),
        version=1,
        produced_at_s=clock(),
        ttl_s=1e6,
        rules=(
            (1, SlotRule((0.60,), (3, 5), prior=0.62)),
            (8, SlotRule((0.64,), (3, 5), prior=0.62)),
        ),
    )
    policy = table_policy(lambda: table, clock)
    rng = random.Random(5)
    ran = []
    for i in range(6000):
        batch_size = 7 if i % 3 else 8  # batches cross the slot boundary all the time
        steps = policy.get_steps_for_batch(batch_size)
        ran.append(steps)
        policy.on_verify_complete(draw(rng, steps, batch_size, 0.62), batch_size)
        clock.now_s += BATCH_S
    return sum(1 for a, b in itertools.pairwise(ran) if a != b), set(ran)


def test_neighbouring_slots_near_a_tie_keep_the_engines_tier(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    switches, steps = _alternating_slots_switches()
    assert steps <= {3, 5}
    # Each slot changes its own choice at most once per dwell (two slots, 60 s); the
    # engine's tier follows those changes, not the 4,000 slot crossings.
    assert switches <= 2 * (60 / RULE_DWELL_S + 1) * 2, switches
    monkeypatch.setattr(table_mod, "STICKY_BAND", 0.0)
    alone, _ = _alternating_slots_switches()
    assert switches * 3 < alone, (switches, alone)


def _crossings_with_a_fixed_neighbour(rule: SlotRule, fixed: int, p: float) -> list[int]:
    """Slot 1 runs a fixed step (no rule: e.g. the daemon's experiment there), slot 8
    follows ``rule``; batches cross the slot boundary all the time at acceptance ``p``."""
    clock = Clock()
    table = StepTable(
        ((1, fixed), (8, rule.steps_at(rule.prior))),
        version=1,
        produced_at_s=clock(),
        ttl_s=1e6,
        rules=((8, rule),),
    )
    policy = table_policy(lambda: table, clock)
    rng = random.Random(6)
    ran = []
    for i in range(3000):
        batch_size = 7 if i % 3 else 8
        steps = policy.get_steps_for_batch(batch_size)
        ran.append(steps)
        policy.on_verify_complete(draw(rng, steps, batch_size, p), batch_size)
        clock.now_s += BATCH_S
    return ran


def test_a_slot_without_a_rule_owns_the_tier_a_neighbour_keeps_where_it_loses_little() -> None:
    # Slot 8's rule gives 5 within STICKY_BAND of its signal: it keeps slot 1's tier.
    near = _crossings_with_a_fixed_neighbour(SlotRule((0.64,), (3, 5), prior=0.60), 5, 0.60)
    assert sum(1 for a, b in itertools.pairwise(near) if a != b) <= 12  # of 2,000 crossings
    # Format 4: slot 1 at 1 step, slot 8's signal 0.1 past its steep cut to 3 (slope 1:
    # keeping 1 would lose 10 % > STICKY_GAIN): slot 8 runs its own 3.
    steep = SlotRule((0.3,), (1, 3), prior=0.4, slopes=(1.0,))
    ran = _crossings_with_a_fixed_neighbour(steep, 1, 0.4)
    assert ran[0::3].count(1) < 0.05 * len(ran[0::3])  # slot 8's batches (size 8)
    # Without slopes the 0.12 STICKY_BAND holds: slot 8 keeps slot 1's tier while its
    # signal (about 0.4, 0.1 past the cut) stays within it.
    flat = SlotRule((0.3,), (1, 3), prior=0.4)
    ran = _crossings_with_a_fixed_neighbour(flat, 1, 0.4)
    assert ran[0::3].count(1) > 0.5 * len(ran[0::3])
    assert STICKY_GAIN / 1.0 < 0.1 < STICKY_BAND


def test_a_slot_at_zero_probes_and_returns_within_30_s_when_acceptance_rises() -> None:
    clock = Clock()
    rule = SlotRule(thresholds=(0.35,), steps=(0, 3), prior=0.2)
    policy = table_policy(lambda: rule_table(rule, clock()), clock)
    rng = random.Random(7)
    poor = run(policy, clock, rng, 120.0, 0.1, batch_size=1)
    assert poor[-2000:].count(0) > 1900  # off while the drafter is poor ...
    probes = sum(1 for k in poor[100:] if k > 0)
    # ... but probing: a bounded share of the batches, never zero.
    assert 0 < probes <= 1.2 * PROBE_SHARE * len(poor[100:])
    assert PROBE_SHARE <= 0.01
    rich = run(policy, clock, rng, 60.0, 0.75, batch_size=1)
    back = next(i for i in range(len(rich)) if rich[i] == 3 and rich[i + 1] == 3)
    assert back * BATCH_S <= 30.0, f"back to speculating after {back * BATCH_S:.1f} s"
    assert rich[-1] == 3


def test_a_new_table_keeps_the_slots_evidence() -> None:
    clock = Clock()
    tables = [rule_table(SlotRule((0.5,), (1, 5), prior=0.3), clock())]
    policy = table_policy(lambda: tables[-1], clock)
    rng = random.Random(1)
    assert run(policy, clock, rng, 12.0, 0.9)[-1] == 5
    # A refresh with a new prior: the live signal, not the prior, decides.
    tables.append(rule_table(SlotRule((0.5,), (1, 5), prior=0.2), clock() + 1))
    assert run(policy, clock, rng, 1.0, 0.9) == [5] * 100
    assert policy.live_rules[1][0] > 0.8


# ------------------------------------------------------------ plugin == replay


def test_the_plugin_and_replay_answer_alike(tmp_path: Path) -> None:
    clock = Clock()
    rule = SlotRule(thresholds=(0.3, 0.55, 0.75), steps=(0, 1, 3, 7), prior=0.5)
    table = rule_table(rule, clock())
    write_step_table(tmp_path, table, CANDIDATES)
    plugin = SpecgovAdaptiveParams(
        3,
        None,
        spool_dir=tmp_path,
        original=None,
        channel_factory=LocalChannel,
        clock=clock,
        poll_every_batches=16,
        stats_writer=None,
    )
    plugin.set_cuda_graph_bs(GRAPHS)
    replay = table_policy(lambda: table, clock)  # what simulator/replay/runner.py builds
    rng = random.Random(11)
    p = 0.5
    for i in range(20_000):
        if i % 2000 == 0:
            p = rng.choice([0.05, 0.4, 0.6, 0.9])
        batch_size = rng.choice([1, 2, 3, 5, 9])
        steps = replay.get_steps_for_batch(batch_size)
        assert plugin.get_steps_for_batch(batch_size) == steps, f"call {i}"
        accepted = draw(rng, steps, batch_size, p)
        assert plugin.on_verify_complete(accepted, batch_size) == replay.on_verify_complete(
            accepted, batch_size
        ), f"call {i}"
        clock.now_s += BATCH_S
    assert plugin.policy is not None and plugin.policy.rule_changes == replay.rule_changes > 2


# ----------------------------------------------------------------- versioning


def test_an_older_table_a_step_per_slot_is_still_followed(tmp_path: Path) -> None:
    clock = Clock()
    old = StepTable(((1, 5), (8, 1)), version=3, produced_at_s=clock(), ttl_s=60.0)
    path = write_step_table(tmp_path, old, CANDIDATES)
    document = json.loads(path.read_text())
    assert document["schema"] == 1 and document["table"]["schema"] == 1
    assert "rules" not in document["table"]  # what a format-1 plugin expects
    reader = SpoolTableReader(tmp_path, CANDIDATES, clock)
    policy = table_policy(reader, clock)
    assert [policy.get_steps_for_batch(b) for b in (1, 7, 8, 30)] == [5, 5, 1, 1]
    assert policy.fallback_reasons == {}


def test_a_newer_format_falls_back_to_sglangs_controller_with_a_counted_reason(
    tmp_path: Path,
) -> None:
    clock = Clock()
    table = rule_table(SlotRule((0.5,), (1, 5), prior=0.7), clock())
    path = write_step_table(tmp_path, table, CANDIDATES)
    document = json.loads(path.read_text())
    assert document["schema"] == 2 and document["table"]["schema"] == 2
    document["schema"] = document["table"]["schema"] = TABLE_SCHEMA + 1
    document["table"]["rules"] = [[1, {"a_field_of_a_future_format": True}]]
    path.write_text(json.dumps(document))
    reader = SpoolTableReader(tmp_path, CANDIDATES, clock)
    policy = table_policy(reader, clock, poll=1)
    twin = EmaPolicy(3)
    twin.set_cuda_graph_bs(GRAPHS)
    rng = random.Random(2)
    for _ in range(200):
        steps = twin.get_steps_for_batch(4)
        assert policy.get_steps_for_batch(4) == steps
        accepted = draw(rng, steps, 4, 0.6)
        twin.on_verify_complete(accepted, 4)
        policy.on_verify_complete(accepted, 4)
    assert reader.ignored == {"future_version": 200}
    assert policy.table is None and policy.fallback_reasons == {"no_table": 200}


# ------------------------------------------------------------- the daemon side


def toy(signal: float, k: int) -> RuleEval:
    """A drafter whose every position is accepted at ``signal``; step time 1 + 0.3 k."""
    accept = sum(signal**j for j in range(k + 1))
    return RuleEval(accept_length=accept, step_s=1.0 + 0.3 * k, slo_fraction=1.0)


def test_slot_rule_cuts_where_the_best_step_changes_and_charges_the_probe() -> None:
    rule = slot_rule((0.5,), (0, 1, 3), (0, 1, 3), 1.0, toy, None, None, 0.0)
    assert rule is not None and rule.steps[0] == 0 and rule.steps[-1] == 3
    # Step 1 beats 0 from signal 0.3 on (1 + s > 1.3); the probe's cost moves the cut
    # no further than a grid cell.
    assert abs(rule.thresholds[0] - 0.3) <= GRID[1] - GRID[0]
    assert slot_rule((0.5,), (0,), (0,), 1.0, toy, None, None, 0.0) is None  # one step


def test_a_rule_still_good_near_the_signal_is_kept() -> None:
    fresh = slot_rule((0.5,), (0, 1, 3), (0, 1, 3), 1.0, toy, None, None, 0.02)
    assert fresh is not None
    # Cuts a cell off, far from the prior 0.9: kept, with the new prior.
    nudged = SlotRule(tuple(t + 0.02 for t in fresh.thresholds), fresh.steps, prior=0.3)
    kept = slot_rule((0.9,), (0, 1, 3), (0, 1, 3), 1.0, toy, None, None, 0.02, nudged)
    assert kept is not None and kept.thresholds == nudged.thresholds and kept.prior == 0.9
    # A rule that runs 0 where 3 is far better is replaced.
    wrong = SlotRule((0.95,), (0, 3), prior=0.9)
    new = slot_rule((0.9,), (0, 1, 3), (0, 1, 3), 1.0, toy, None, None, 0.02, wrong)
    assert new is not None and new.steps_at(0.9) == 3


def test_a_near_tie_is_not_a_cut_the_incumbent_step_stays() -> None:
    free = slot_rule((0.5,), (0, 1, 3), (0, 1, 3), 1.0, toy, None, None, 0.0)
    sticky = slot_rule((0.5,), (0, 1, 3), (0, 1, 3), 1.0, toy, None, 3, 0.05)
    assert free is not None and sticky is not None
    # With a 5 % tie, the incumbent 3 steps take over part of the signal range 1 step
    # had: exactly the signals where 3 steps score within 5 % of 1 step.
    assert sticky.thresholds[-1] < free.thresholds[-1]
    cut = sticky.thresholds[-1]
    for signal in GRID:
        near = toy(signal, 3).accept_length / toy(signal, 3).step_s
        best = max(toy(signal, k).accept_length / toy(signal, k).step_s for k in (0, 1, 3))
        if signal > free.thresholds[-1] - 0.02 and signal < free.thresholds[-1]:
            continue  # the cell the unbiased cut falls in
        assert (signal >= cut) == (near >= best * 0.95 or signal >= free.thresholds[-1]), signal


# ------------------------------------------------------------- the probe step


def dear_one(signal: float, k: int) -> RuleEval:
    """As ``toy``, but any speculation costs 0.5 up front: 1 step never wins."""
    accept = sum(signal**j for j in range(k + 1))
    return RuleEval(accept_length=accept, step_s=1.0 + (0.5 + 0.05 * k) * (k > 0), slo_fraction=1)


def test_the_probe_is_the_cheapest_allowed_step_it_was_charged_for() -> None:
    # 1 step never wins, so the bands are 0 | 3; but step 0 was charged for
    # probes at 1 step, the cheapest allowed, and the rule names it.
    rule = slot_rule((0.5,), (0, 1, 2, 3), (0, 1, 2, 3), 1.0, dear_one, None, None, 0.0)
    assert rule is not None and rule.steps[0] == 0 and 1 not in rule.steps
    assert rule.probe == rule.probe_step == 1
    # Without 1 step allowed, the probe is the next cheapest.
    at_two = slot_rule((0.5,), (0, 2, 3), (0, 2, 3), 1.0, dear_one, None, None, 0.0)
    assert at_two is not None and at_two.probe == at_two.probe_step == 2
    # The engine probes at exactly the rule's probe step (here bands 0 | 3, probe 1).
    clock = Clock()
    low = SlotRule(rule.thresholds, (0, 3), prior=0.1, probe=1)
    policy = table_policy(lambda: rule_table(low, clock()), clock)
    ran = run(policy, clock, random.Random(3), 60.0, 0.1, batch_size=1)
    assert ran.count(0) > 0.95 * len(ran) and {k for k in ran if k > 0} == {1}


def test_a_near_tie_never_makes_the_way_back_from_0_harder() -> None:
    free = slot_rule((0.5,), (0, 1, 2, 3), (0, 1, 2, 3), 1.0, toy, None, None, 0.0)
    assert free is not None and free.steps[:2] == (0, 1)
    for incumbent in (0, 1, 2, 3):
        tied = slot_rule((0.5,), (0, 1, 2, 3), (0, 1, 2, 3), 1.0, toy, None, incumbent, 0.15)
        assert tied is not None
        # 0 ends where speculation first wins, whatever the slot runs now ...
        assert tied.thresholds[0] == free.thresholds[0], incumbent
        # ... and just above it the cheapest step that beats 0 runs, not the dearer
        # incumbent near-tied with it.
        assert tied.steps[:2] == (0, 1), incumbent


def test_a_rule_named_probe_is_format_3_and_an_unbuilt_probe_is_refused() -> None:
    clock = Clock()
    named = rule_table(SlotRule((0.5,), (0, 3), prior=0.2, probe=1), clock())
    data = json.loads(json.dumps(named.to_dict()))
    assert data["schema"] == 3 and data["rules"][0][1]["probe"] == 1
    assert StepTable.from_dict(data) == named and named.slot_steps(1) == (0, 1, 3)
    # The default probe is not stored: such a table is still format 2.
    plain = rule_table(SlotRule((0.3, 0.5), (0, 1, 3), prior=0.2, probe=1), clock())
    assert plain.rules[0][1].probe is None and plain.to_dict()["schema"] == 2
    with pytest.raises(PolicyTypeError, match=r"SlotRule\.probe: expected None or an int >= 1"):
        SlotRule((0.5,), (0, 3), prior=0.2, probe=0)
    # A probe the engine has not built: the table is not followed.
    unbuilt = rule_table(SlotRule((0.5,), (0, 3), prior=0.2, probe=2), clock())
    policy = table_policy(lambda: unbuilt, clock)
    steps = policy.get_steps_for_batch(1)
    assert policy.table is None and policy.fallback_reasons == {"invalid_step": 1}
    assert steps in CANDIDATES


# ------------------------------------------------- format 4: the probes' evidence rate


def test_the_probe_rate_follows_its_cost_within_its_bounds() -> None:
    # Far below the cut a probe batch loses much: the slowest probing, PROBE_SHARE.
    assert probe_every(0.5) == PROBE_EVERY_BATCHES and probe_share(0.5) == PROBE_SHARE
    # At or above the cut it loses nothing: the fastest.
    assert probe_every(0.0) == probe_every(-0.1) == PROBE_MIN_EVERY
    costs = [i / 1000 for i in range(1, 300)]
    everies = [probe_every(c) for c in costs]
    assert everies == sorted(everies)  # dearer probes, rarer
    for c in costs:
        # Between the bounds, the probes cost the slot PROBE_COST of its goodput.
        if PROBE_MIN_EVERY < probe_every(c) < PROBE_EVERY_BATCHES:
            assert probe_share(c) * c == pytest.approx(PROBE_COST, rel=0.05)


def _seconds_back_from_zero(slopes: tuple[float, ...] | None) -> float:
    """A slot at 0 steps just below its cut (acceptance 0.25, cut 0.3): the seconds it
    takes to speculate again once acceptance rises to 0.45, past the cut by a margin
    worth 15 % of goodput (slope 1 per unit of signal)."""
    clock = Clock()
    rule = SlotRule(thresholds=(0.3,), steps=(0, 3), prior=0.1, slopes=slopes)
    policy = table_policy(lambda: rule_table(rule, clock()), clock)
    rng = random.Random(8)
    poor = run(policy, clock, rng, 120.0, 0.25, batch_size=1)
    assert poor[-3000:].count(0) > 0.9 * 3000  # off while 0 scores best
    rich = run(policy, clock, rng, 120.0, 0.45, batch_size=1)
    # Back: speculating for longer than a probe burst, and from then on.
    back = next(i for i in range(len(rich)) if set(rich[i : i + 50]) == {3})
    assert set(rich[back:]) == {3}
    return back * BATCH_S


def test_a_slot_leaves_0_within_10_s_once_its_signal_is_past_the_cut_by_a_gain() -> None:
    with_slopes = _seconds_back_from_zero((1.0,))
    assert with_slopes <= 10.0, with_slopes
    # A format-3 rule (no slopes) probes at the fixed PROBE_SHARE: much slower back.
    fixed = _seconds_back_from_zero(None)
    assert fixed > 2 * with_slopes, (fixed, with_slopes)


def test_far_below_the_cut_a_slot_at_0_probes_no_more_than_before() -> None:
    clock = Clock()
    rule = SlotRule(thresholds=(0.5,), steps=(0, 3), prior=0.1, slopes=(1.0,))
    policy = table_policy(lambda: rule_table(rule, clock()), clock)
    ran = run(policy, clock, random.Random(9), 120.0, 0.05, batch_size=1)
    probes = sum(1 for k in ran[1000:] if k > 0)
    assert 0 < probes <= 1.2 * PROBE_SHARE * len(ran[1000:])


def test_a_steady_signal_near_the_cut_out_of_0_moves_the_slot_at_most_once_per_10_s() -> None:
    clock = Clock()
    rule = SlotRule(thresholds=(0.3,), steps=(0, 3), prior=0.3, slopes=(1.0,))
    policy = table_policy(lambda: rule_table(rule, clock()), clock)
    run(policy, clock, random.Random(10), 120.0, 0.3, batch_size=1)
    assert policy.rule_changes <= 120 / RULE_DWELL_S + 1


def test_format_4_round_trips_and_an_older_format_carrying_slopes_is_refused() -> None:
    clock = Clock()
    table = rule_table(SlotRule((0.3, 0.6), (0, 1, 3), prior=0.2, slopes=(0.9, 0.4)), clock())
    data = json.loads(json.dumps(table.to_dict()))
    assert data["schema"] == 4 == TABLE_SCHEMA and data["rules"][0][1]["slopes"] == [0.9, 0.4]
    assert StepTable.from_dict(data) == table
    data["schema"] = 3
    with pytest.raises(PolicyTypeError, match=r"format 3 rules carry no 'slopes'"):
        StepTable.from_dict(data)
    with pytest.raises(PolicyTypeError, match=r"SlotRule\.slopes: expected None or 2 finite"):
        SlotRule((0.3, 0.6), (0, 1, 3), prior=0.2, slopes=(0.9,))
    with pytest.raises(PolicyTypeError, match=r"SlotRule\.slopes"):
        SlotRule((0.3,), (0, 1), prior=0.2, slopes=(0.0,))


def test_the_daemon_s_rule_carries_the_gain_slope_of_each_cut() -> None:
    rule = slot_rule((0.5,), (0, 1, 3), (0, 1, 3), 1.0, toy, None, None, 0.0)
    assert rule is not None and rule.slopes is not None
    assert len(rule.slopes) == len(rule.thresholds)
    # toy: 1 step over 0 gains (1 + s) / 1.3 - 1 per unit of s, a slope of 1 / 1.3
    # (less its probes: the 0 band's score includes them).
    assert rule.slopes[0] == pytest.approx(1 / 1.3, rel=0.1)
