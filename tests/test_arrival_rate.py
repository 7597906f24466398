"""The fleet's arrival rate from what each replica reports (policies/control/arrival_rate.py):
arrivals = finished + the change in flight, restarts counted once, a silent replica read
again later, the rate over a window."""

from __future__ import annotations

import pytest

from specgov.policies.control.arrival_rate import ArrivalMeter, ArrivalRateError, ReplicaCount


def test_arrivals_are_finished_plus_the_change_in_flight() -> None:
    meter = ArrivalMeter(window_s=100.0)
    meter.update(0.0, {"a": ReplicaCount(10, 5), "b": ReplicaCount(0, 0)})
    assert meter.rate() is None  # one reading: no rate yet
    # a: 4 finished, in flight 5 -> 8 (7 arrived); b: 2 finished, 1 in flight (3 arrived).
    meter.update(10.0, {"a": ReplicaCount(14, 8), "b": ReplicaCount(2, 1)})
    assert meter.arrived == 10.0
    assert meter.rate() is None  # 10 s of readings: not yet a window's
    meter.update(100.0, {"a": ReplicaCount(100, 12), "b": ReplicaCount(2, 1)})
    assert meter.rate() == pytest.approx((10 + 86 + 4) / 100.0)


def test_a_rising_load_shows_at_once_not_a_request_time_later() -> None:
    # Requests arrive at 2/s and none finishes yet (each takes longer than the window):
    # a rate of finishes would read 0, the meter reads what arrived.
    meter = ArrivalMeter(window_s=30.0)
    meter.update(0.0, {"a": ReplicaCount(0, 0)})
    meter.update(5.0, {"a": ReplicaCount(0, 10)})
    assert meter.rate() is None  # 5 s of readings are not a rate
    for t in range(10, 31, 5):
        meter.update(float(t), {"a": ReplicaCount(0, 2.0 * t)})
    assert meter.rate() == pytest.approx(2.0)


def test_a_restarted_replica_counts_again_from_zero() -> None:
    meter = ArrivalMeter(window_s=100.0)
    meter.update(0.0, {"a": ReplicaCount(100, 0)})
    # Restarted: its counter is back to 3 finished and 2 in flight: 5 arrivals since.
    meter.update(10.0, {"a": ReplicaCount(3, 2)})
    assert meter.arrived == 5.0


def test_a_replica_that_did_not_answer_counts_at_its_next_reading() -> None:
    meter = ArrivalMeter(window_s=20.0)
    meter.update(0.0, {"a": ReplicaCount(0, 0), "b": ReplicaCount(0, 0)})
    meter.update(10.0, {"a": ReplicaCount(10, 0)})  # b silent
    assert meter.arrived == 10.0
    meter.update(20.0, {"a": ReplicaCount(20, 0), "b": ReplicaCount(20, 0)})
    assert meter.arrived == 40.0 and meter.rate() == pytest.approx(2.0)


def test_the_rate_covers_the_last_window() -> None:
    meter = ArrivalMeter(window_s=20.0)
    finished = 0.0
    for t in range(0, 101, 10):
        finished += 10.0 if t <= 50 else 50.0  # 1/s, then 5/s from t = 60
        meter.update(float(t), {"a": ReplicaCount(finished, 0)})
    assert meter.rate() == pytest.approx(5.0)


def test_bad_readings_are_refused() -> None:
    with pytest.raises(ArrivalRateError, match="window_s"):
        ArrivalMeter(0.0)
    with pytest.raises(ArrivalRateError, match="in_flight"):
        ReplicaCount(1, -1)
    meter = ArrivalMeter(10.0)
    meter.update(5.0, {})
    with pytest.raises(ArrivalRateError, match="time order"):
        meter.update(4.0, {})


def test_a_gap_in_one_replica_does_not_lump_its_arrivals_into_the_fleets_rate() -> None:
    # Both at 1/s; b is not read for 40 s: the rate stays 2/s, neither falling while b
    # is silent nor jumping when it answers again.
    meter = ArrivalMeter(window_s=30.0)
    for t in range(0, 101, 5):
        readings = {"a": ReplicaCount(float(t), 0)}
        if not 40 <= t < 80:
            readings["b"] = ReplicaCount(float(t), 0)
        meter.update(float(t), readings)
        if t >= 30 and not 70 <= t < 80:  # a window's readings, b's last within it
            assert meter.rate() == pytest.approx(2.0), t
    # Silent for longer than the window: the fleet's rate is unknown, not 1/s.
    meter.update(140.0, {"a": ReplicaCount(140.0, 0)})
    assert meter.rate() is None
