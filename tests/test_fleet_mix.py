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
