"""The fleet governor's pure decision (policies/control/fleet_mix.py): the mix target around the
crossover, one move at a time, dwell, capacity and health holds, every decision a reason."""

from __future__ import annotations

import pytest

from specgov.policies.control import fleet_mix as fm
from specgov.policies.control.fleet_mix import FleetMixError, MixModel, ReplicaView, decide_mix

MODEL = MixModel(pays_up_to=32, replica_capacity=100.0, hysteresis=0.25, dwell_s=60.0)


def _fleet(modes: str, running: float = 0.0, serving: str | None = None) -> list[ReplicaView]:
    return [
        ReplicaView(
            f"r{i}", "spec" if m == "s" else "plain", serving is None or serving[i] == "y", running
        )
        for i, m in enumerate(modes)
    ]


def test_light_load_keeps_every_replica_speculative() -> None:
    d = decide_mix(_fleet("ssss"), 40.0, MODEL, now_s=0.0, last_move_s=None)
    assert (d.target_spec, d.move, d.reason) == (4, None, fm.HELD_AT_TARGET)
    assert d.batch_per_replica == 10.0


def test_load_past_the_band_moves_one_replica_to_plain() -> None:
    # 4 x 41 = 164 in flight: 41 per replica > 32 x 1.25 = 40.
    d = decide_mix(_fleet("ssss"), 164.0, MODEL, now_s=0.0, last_move_s=None)
    assert d.target_spec == 0
    assert d.move == fm.Move("r0", "plain") and d.reason == fm.MOVE_TO_PLAIN
    assert "41.0 requests per replica" in d.message


def test_inside_the_band_the_mix_holds_both_ways() -> None:
    for modes in ("ssss", "sspp", "pppp"):
        d = decide_mix(_fleet(modes), 4 * 32.0, MODEL, now_s=0.0, last_move_s=None)
        assert d.move is None and d.reason == fm.HELD_IN_BAND
        assert d.target_spec == modes.count("s")


def test_load_falling_below_the_band_moves_back_to_speculative() -> None:
    d = decide_mix(_fleet("sppp"), 4 * 20.0, MODEL, now_s=1000.0, last_move_s=0.0)
    assert d.target_spec == 4 and d.move is not None
    assert d.move.to_mode == "spec" and d.move.replica in {"r1", "r2", "r3"}
    assert d.reason == fm.MOVE_TO_SPEC


def test_the_replica_that_drains_fastest_moves() -> None:
    fleet = [
        ReplicaView("a", "spec", True, 50.0),
        ReplicaView("b", "spec", True, 12.0),
        ReplicaView("c", "plain", True, 0.0),
    ]
    d = decide_mix(fleet, 150.0, MODEL, now_s=0.0, last_move_s=None)
    assert d.move == fm.Move("b", "plain")


def test_dwell_holds_the_next_move() -> None:
    d = decide_mix(_fleet("sspp"), 200.0, MODEL, now_s=30.0, last_move_s=0.0)
    assert d.move is None and d.reason == fm.HELD_DWELL and d.target_spec == 0
    later = decide_mix(_fleet("sspp"), 200.0, MODEL, now_s=61.0, last_move_s=0.0)
    assert later.move is not None and later.move.to_mode == "plain"


def test_no_move_when_the_others_cannot_carry_the_load() -> None:
    # 350 in flight: 3 replicas carry 300 at most while the fourth restarts.
    d = decide_mix(_fleet("ssss"), 350.0, MODEL, now_s=0.0, last_move_s=None)
    assert d.move is None and d.reason == fm.HELD_CAPACITY and d.target_spec == 0
    assert "3 other replicas cannot carry 350" in d.message


def test_the_capacity_check_counts_each_mode_at_its_own_capacity() -> None:
    # A speculative replica carries 60 within the SLO, a plain one 100. 200 in flight:
    # three plain replicas would carry it (300), three speculative ones do not (180).
    model = MixModel(
        pays_up_to=32, replica_capacity=100.0, spec_capacity=60.0, hysteresis=0.25, dwell_s=0.0
    )
    assert (model.capacity("spec"), model.capacity("plain")) == (60.0, 100.0)
    d = decide_mix(_fleet("ssss"), 200.0, model, now_s=0.0, last_move_s=None)
    assert d.move is None and d.reason == fm.HELD_CAPACITY and d.target_spec == 0
    assert "(180 together: 60 a speculative replica, 100 a plain one)" in d.message
    # Two already plain: the two that stay plain and one speculative carry 260.
    mixed = decide_mix(_fleet("sspp"), 200.0, model, now_s=0.0, last_move_s=None)
    assert mixed.move is not None and mixed.reason == fm.MOVE_TO_PLAIN
    # Without a speculative capacity both modes count at the plain one (as before).
    same = MixModel(pays_up_to=32, replica_capacity=100.0, hysteresis=0.25, dwell_s=0.0)
    assert decide_mix(_fleet("ssss"), 200.0, same, now_s=0.0, last_move_s=None).move is not None


def test_a_fleet_past_its_capacity_moves_to_the_mode_that_carries_more() -> None:
    # 250 in flight is past what four speculative replicas carry (240): holding keeps it
    # there, a move to plain raises it after one restart. The way back never does this.
    model = MixModel(
        pays_up_to=32, replica_capacity=100.0, spec_capacity=60.0, hysteresis=0.25, dwell_s=0.0
    )
    d = decide_mix(_fleet("ssss"), 250.0, model, now_s=0.0, last_move_s=None)
    assert d.move == fm.Move("r0", "plain") and d.reason == fm.MOVE_TO_PLAIN_PAST_CAPACITY
    assert "past its capacity already" in d.message
    # When the target mode carries less (here a speculative replica 150, a plain one
    # 100), a fleet past its capacity holds: that move would lower it for good.
    plain_fleet = MixModel(pays_up_to=0, replica_capacity=100.0, spec_capacity=150.0)
    held = decide_mix(_fleet("sppp"), 450.0, plain_fleet, now_s=0.0, last_move_s=None)
    assert held.move is None and held.reason == fm.HELD_CAPACITY


def test_a_replica_not_serving_holds_the_mix() -> None:
    d = decide_mix(_fleet("ssss", serving="ynyy"), 500.0, MODEL, now_s=0.0, last_move_s=None)
    assert d.move is None and d.reason == fm.HELD_NOT_SERVING and "r1" in d.message


def test_unknown_load_holds() -> None:
    d = decide_mix(_fleet("ss"), None, MODEL, now_s=0.0, last_move_s=None)
    assert d.move is None and d.reason == fm.HELD_NO_LOAD_DATA


def test_speculation_that_never_pays_targets_plain() -> None:
    never = MixModel(pays_up_to=0, replica_capacity=100.0)
    d = decide_mix(_fleet("ss"), 1.0, never, now_s=0.0, last_move_s=None)
    assert d.target_spec == 0 and d.move == fm.Move("r0", "plain")


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"pays_up_to": -1, "replica_capacity": 1.0}, "pays_up_to"),
        ({"pays_up_to": 1, "replica_capacity": 0.0}, "replica_capacity"),
        ({"pays_up_to": 1, "replica_capacity": 1.0, "hysteresis": 1.0}, "hysteresis"),
        ({"pays_up_to": 1, "replica_capacity": 1.0, "dwell_s": -1.0}, "dwell_s"),
        ({"pays_up_to": 1, "replica_capacity": 1.0, "spec_capacity": 0.0}, "spec_capacity"),
    ],
)
def test_bad_models_are_refused(kwargs: dict[str, float], needle: str) -> None:
    with pytest.raises(FleetMixError, match=needle):
        MixModel(**kwargs)  # type: ignore[arg-type]


def test_bad_replicas_are_refused() -> None:
    with pytest.raises(FleetMixError, match="mode"):
        ReplicaView("x", "fast", True, 0.0)  # type: ignore[arg-type]
    with pytest.raises(FleetMixError, match="running_requests"):
        ReplicaView("x", "spec", True, -1.0)
    with pytest.raises(FleetMixError, match="no replicas"):
        decide_mix([], 0.0, MODEL, now_s=0.0, last_move_s=None)


# EAGLE-3 on llama-3.1-8b as the bench's plan fleet gives it, in arrival rates per replica:
# the crossover is where a speculative replica's rate peaks (2.78 req/s), so a band around
# it lies past what three of four speculative replicas carry (8.33 req/s).
RATES = MixModel(
    pays_up_to=2.78,
    replica_capacity=3.57,
    spec_capacity=2.78,
    hysteresis=0.10,
    dwell_s=0.0,
    restart_s=100.0,
    unit="req/s",
)


def test_the_switch_to_plain_starts_while_the_replicas_left_carry_a_move() -> None:
    low, high = fm.band(4, RATES)
    # (1 - 10% headroom) x 3 x 2.78 / 4 = 1.88 per replica, below the crossover's 3.06.
    assert high == pytest.approx(0.9 * 3 * 2.78 / 4)
    assert low == pytest.approx(high * 0.9 / 1.1)  # the band keeps its ratio
    d = decide_mix(_fleet("ssss"), 8.0, RATES, now_s=0.0, last_move_s=None)
    assert d.move == fm.Move("r0", "plain") and d.reason == fm.MOVE_TO_PLAIN_BEFORE_CAPACITY
    assert "2.0 req/s per replica" in d.message and "3 speculative replicas carry" in d.message
    # Below the lowered top it holds; past what three carry it cannot move at all.
    assert decide_mix(_fleet("ssss"), 7.0, RATES, now_s=0.0, last_move_s=None).move is None
    late = decide_mix(_fleet("ssss"), 8.5, RATES, now_s=0.0, last_move_s=None)
    assert late.move is None and late.reason == fm.HELD_CAPACITY


def test_the_lowered_band_holds_plain_until_the_load_falls_below_its_bottom() -> None:
    for load in (7.0, 8.0, 11.0):  # above the bottom (6.13): plain holds
        d = decide_mix(_fleet("pppp"), load, RATES, now_s=0.0, last_move_s=None)
        assert d.move is None, load
    back = decide_mix(_fleet("pppp"), 5.0, RATES, now_s=0.0, last_move_s=None)
    assert back.move is not None and back.move.to_mode == "spec"
    assert back.reason == fm.MOVE_TO_SPEC


def test_without_the_capacity_limit_the_band_is_the_crossovers() -> None:
    # Where n - 1 speculative replicas carry more than the band's top, nothing changes.
    assert fm.band(4, MODEL) == pytest.approx((32 * 0.75, 32 * 1.25))
    assert fm.band(1, RATES)[1] == pytest.approx(2.78 * 1.1)  # one replica: no n - 1
    with pytest.raises(FleetMixError, match="headroom"):
        MixModel(pays_up_to=1, replica_capacity=1.0, headroom=1.0)


# The step reserve: RATES with a reserve for the load to jump 2.5x (5 -> 8 req/s strands
# three speculative replicas during a move: 8 / 3 = 2.67 each against 0.9 x 2.78).
RESERVE = MixModel(**{**RATES.__dict__, "step_reserve": 2.5})


def test_the_step_reserve_moves_all_but_one_replica_to_plain_while_the_load_is_light() -> None:
    # 5 req/s: without the reserve every replica stays speculative (1.25 per replica).
    assert decide_mix(_fleet("ssss"), 5.0, RATES, now_s=0.0, last_move_s=None).move is None
    d = decide_mix(_fleet("ssss"), 5.0, RESERVE, now_s=0.0, last_move_s=None)
    assert d.target_spec == 1 and d.move == fm.Move("r0", "plain")
    assert d.reason == fm.MOVE_TO_PLAIN_RESERVE
    assert "the step reserve: at 2.5x the load (12.5 req/s)" in d.message
    assert decide_mix(_fleet("pssp"), 5.0, RESERVE, now_s=0.0, last_move_s=None).move is not None
    held = decide_mix(_fleet("sppp"), 5.0, RESERVE, now_s=0.0, last_move_s=None)
    assert (held.target_spec, held.move, held.reason) == (1, None, fm.HELD_AT_TARGET)
    # The step arrives: the last speculative replica's move is a crossover move.
    up = decide_mix(_fleet("sppp"), 8.0, RESERVE, now_s=0.0, last_move_s=None)
    assert up.move == fm.Move("r0", "plain") and up.reason == fm.MOVE_TO_PLAIN_BEFORE_CAPACITY


def test_the_step_reserve_lets_go_at_light_load_and_holds_between() -> None:
    # Released at or below the band's bottom after the jump: 2 x 2.5 / 4 = 1.25 <= 1.53.
    back = decide_mix(_fleet("sppp"), 2.0, RESERVE, now_s=0.0, last_move_s=None)
    assert back.target_spec == 4 and back.move is not None and back.move.to_mode == "spec"
    # Between bottom and top after the jump (3.2 x 2.5 / 4 = 2.0 is past the top, 2.8 x
    # 2.5 / 4 = 1.75 inside): the fleet keeps what it has.
    for modes in ("ssss", "sspp", "sppp"):
        d = decide_mix(_fleet(modes), 2.8, RESERVE, now_s=0.0, last_move_s=None)
        assert d.move is None and d.target_spec == modes.count("s"), modes
    # From all plain the way back stops at one speculative replica while the reserve holds.
    d = decide_mix(_fleet("pppp"), 5.0, RESERVE, now_s=0.0, last_move_s=None)
    assert d.target_spec == 1 and d.move is not None and d.reason == fm.MOVE_TO_SPEC


def test_reserve_cap_is_off_where_the_next_move_is_safe() -> None:
    assert fm.reserve_cap(4, 4, 5.0, RATES) == 4  # step_reserve 1: no reserve
    assert fm.reserve_cap(1, 1, 5.0, RESERVE) == 1  # one replica: no move is safe anyway
    assert fm.reserve_cap(4, 4, 5.0, RESERVE) == 1
    # Where the crossover, not the capacity, sets the top, a jump past it is still a safe
    # move (MODEL: n - 1 replicas carry 300, far past the top's 4 x 40): no reserve.
    wide = MixModel(**{**MODEL.__dict__, "step_reserve": 2.0})
    assert fm.reserve_cap(4, 4, 100.0, wide) == 4
    with pytest.raises(FleetMixError, match="step_reserve"):
        MixModel(pays_up_to=1, replica_capacity=1.0, step_reserve=0.9)
