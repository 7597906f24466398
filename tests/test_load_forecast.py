"""The fleet governor's load forecast (policies/control/load_forecast.py) and how the mix
decision plans with it (policies/control/fleet_mix.py): a ramp is met before it
arrives, the capacity check weighs the forecast, and the reason says when the forecast
drove a move."""

from __future__ import annotations

import pytest

from specgov.policies.control import fleet_mix as fm
from specgov.policies.control.fleet_mix import MixModel, ReplicaView, decide_mix
from specgov.policies.control.load_forecast import (
    LoadForecast,
    LoadForecastError,
    LoadSample,
    forecast_load,
)

MODEL = MixModel(
    pays_up_to=32, replica_capacity=100.0, hysteresis=0.25, dwell_s=60.0, restart_s=60.0
)


def _ramp(start: float, per_s: float, seconds: int, step_s: float = 5.0) -> list[LoadSample]:
    return [LoadSample(t * step_s, start + per_s * t * step_s) for t in range(seconds)]


def _line(now: float, per_s: float, horizon_s: float = 60.0) -> LoadForecast:
    """A fitted line (as forecast_load gives) over 10 minutes of samples."""
    return LoadForecast(now, max(0.0, now + per_s * horizon_s), per_s, horizon_s, 60, 600.0)


def _fleet(modes: str) -> list[ReplicaView]:
    return [
        ReplicaView(f"r{i}", "spec" if m == "s" else "plain", True, 0.0)
        for i, m in enumerate(modes)
    ]


def test_a_ramp_is_projected_over_the_horizon() -> None:
    f = forecast_load(_ramp(40.0, 1.0, 12), horizon_s=60.0, window_s=120.0)
    assert f is not None
    assert f.trend_per_s == pytest.approx(1.0)
    assert f.now == pytest.approx(40.0 + 55.0)
    # The samples reach 55 s back: the line is projected 55 s ahead at most.
    assert f.span_s == 55.0 and f.projected == pytest.approx(95.0 + 55.0)
    assert "forecast 150 in 60 s" in f.describe() and "12 samples, 55 s" in f.describe()
    longer = forecast_load(_ramp(40.0, 1.0, 25, step_s=10.0), horizon_s=60.0, window_s=300.0)
    assert longer is not None and longer.projected == pytest.approx(280.0 + 60.0)


def test_a_fleet_filling_up_is_not_a_trend_for_minutes() -> None:
    # The first seconds of a ramp: 0 to 22 in flight in 4 s (requests arriving into an
    # empty fleet). Over the 148 s a switch takes, the line would say 800; it reaches 4 s.
    start = [LoadSample(0.0, 0.0), LoadSample(2.0, 11.0), LoadSample(4.0, 22.0)]
    f = forecast_load(start, horizon_s=37.0, window_s=24.0)
    assert f is not None and f.trend_per_s == pytest.approx(5.5)
    assert f.at(148.0) == pytest.approx(22.0 + 5.5 * 4.0)


def test_only_the_window_counts_and_a_fall_is_clipped_at_zero() -> None:
    samples = [
        *_ramp(500.0, 0.0, 10),
        *[LoadSample(50.0 + 5 * i, 100.0 - 20 * i) for i in range(5)],
    ]
    f = forecast_load(samples, horizon_s=60.0, window_s=20.0)
    assert f is not None and f.samples == 5  # the flat part before the window is left out
    assert f.trend_per_s == pytest.approx(-4.0) and f.projected == 0.0


def test_too_few_samples_give_no_trend() -> None:
    assert forecast_load([], horizon_s=10.0, window_s=60.0) is None
    f = forecast_load([LoadSample(0.0, 10.0), LoadSample(5.0, 90.0)], horizon_s=10.0, window_s=60.0)
    assert f is not None and (f.now, f.projected, f.trend_per_s) == (90.0, 90.0, 0.0)


@pytest.mark.parametrize(
    ("samples", "horizon", "window", "match"),
    [
        ([LoadSample(0.0, -1.0)], 1.0, 1.0, "sample 0: expected a finite time and a load >= 0"),
        ([LoadSample(5.0, 1.0), LoadSample(1.0, 1.0)], 1.0, 1.0, "sample 1: samples must be in"),
        ([], -1.0, 1.0, "horizon_s must be >= 0"),
        ([], 1.0, 0.0, "window_s must be > 0"),
    ],
)
def test_bad_samples_are_refused(
    samples: list[LoadSample], horizon: float, window: float, match: str
) -> None:
    with pytest.raises(LoadForecastError, match=match):
        forecast_load(samples, horizon_s=horizon, window_s=window)


def test_a_rising_ramp_moves_to_plain_before_the_load_crosses() -> None:
    # 4 x 30 = 120 in flight now (inside the band's low side: speculation holds on the
    # observed load alone), rising 1.5/s: 210 when one restart is done, 480 (120 per
    # replica) when the fourth is, the whole switch (4 x 60 s).
    f = _line(120.0, 1.5)
    without = decide_mix(_fleet("ssss"), 120.0, MODEL, now_s=0.0, last_move_s=None)
    assert without.move is None and without.reason == fm.HELD_IN_BAND
    d = decide_mix(_fleet("ssss"), 120.0, MODEL, now_s=0.0, last_move_s=None, forecast=f)
    assert d.move == fm.Move("r0", "plain") and d.reason == fm.MOVE_TO_PLAIN_FORECAST
    assert d.forecast_drove and d.planned_load == pytest.approx(480.0)
    assert "the forecast sets the target" in d.message and "forecast 210 in 60 s" in d.message
    assert "480 in 240 s (a switch to plain)" in d.message


def test_the_horizon_is_the_moves_the_switch_still_needs() -> None:
    # 100 in flight rising 0.1/s: over one move (60 s) 106, 26.5 per replica, inside the
    # band; over the whole switch of 4 speculative replicas (240 s) 124, 31 per replica,
    # still inside; with 3 more to move (3 x 60 s) the same line gives 118.
    f = _line(100.0, 0.1)
    loads = fm.planned_loads(100.0, 4, MODEL, f)
    assert (loads.to_plain, loads.to_plain_horizon_s) == (pytest.approx(124.0), 240.0)
    assert loads.one_move == pytest.approx(106.0)
    assert fm.planned_loads(100.0, 3, MODEL, f).to_plain == pytest.approx(118.0)
    # A steeper ramp: 0.4/s is 196 (49 per replica, past 40) over the 4 moves, 172 (43)
    # over 3, 124 (31, inside the band) over one: the fleet with one speculative replica
    # left holds it until its own move's horizon crosses.
    steep = _line(100.0, 0.4)
    for modes, moves in (("ssss", True), ("sssp", True), ("sppp", False)):
        d = decide_mix(_fleet(modes), 100.0, MODEL, now_s=0.0, last_move_s=None, forecast=steep)
        assert (d.move is not None) == moves, (modes, d.reason, d.message)
    last = decide_mix(_fleet("sppp"), 100.0, MODEL, now_s=0.0, last_move_s=None, forecast=steep)
    assert last.reason == fm.HELD_IN_BAND and last.target_spec == 1
    # Without a forecast the observed load is all there is: no horizon.
    assert fm.planned_loads(100.0, 4, MODEL, None) == fm.PlannedLoads(100.0, 240.0, 100.0)


def test_a_falling_load_moves_back_to_spec_only_once_it_is_below_the_band() -> None:
    # Falling 2/s: 150 in flight now (37.5 per replica, inside the band 24..40), 30 a
    # restart later. The way back waits for the observed load (early is the costly side).
    falling = _line(150.0, -2.0)
    assert falling.projected == pytest.approx(30.0)
    d = decide_mix(
        _fleet("pppp"), falling.now, MODEL, now_s=0.0, last_move_s=None, forecast=falling
    )
    assert d.move is None and d.reason == fm.HELD_IN_BAND and d.target_spec == 0
    below = decide_mix(_fleet("pppp"), 80.0, MODEL, now_s=0.0, last_move_s=None, forecast=falling)
    assert below.move is not None and below.move.to_mode == "spec"
    assert below.reason == fm.MOVE_TO_SPEC and not below.forecast_drove
    # Below the band now but rising past it within one move: no move back.
    rising = _line(80.0, 1.0)
    assert rising.projected == pytest.approx(140.0)
    held = decide_mix(_fleet("pppp"), 80.0, MODEL, now_s=0.0, last_move_s=None, forecast=rising)
    assert held.move is None and held.reason == fm.HELD_IN_BAND and held.target_spec == 0
    assert held.forecast_drove
    flat = _line(200.0, 0.0)
    same = decide_mix(_fleet("ssss"), 200.0, MODEL, now_s=0.0, last_move_s=None, forecast=flat)
    assert same.reason == fm.MOVE_TO_PLAIN and not same.forecast_drove


def test_the_forecast_line_projects_over_any_horizon() -> None:
    f = _line(95.0, 1.0)
    assert f.at(60.0) == pytest.approx(f.projected) and f.at(0.0) == pytest.approx(f.now)
    assert f.at(240.0) == pytest.approx(95.0 + 240.0) and f.at(900.0) == pytest.approx(695.0)
    assert _line(100.0, -1.0).at(400.0) == 0.0
    with pytest.raises(LoadForecastError, match="horizon_s must be >= 0"):
        f.at(-1.0)


def test_the_capacity_check_weighs_the_forecast_peak() -> None:
    # 250 now fits on 3 replicas (300); 340 forecast does not: the move would leave the
    # fleet short while the replica restarts.
    rising = _line(250.0, 1.5)
    assert rising.projected == pytest.approx(340.0)
    d = decide_mix(_fleet("ssss"), 250.0, MODEL, now_s=0.0, last_move_s=None, forecast=rising)
    assert d.move is None and d.reason == fm.HELD_CAPACITY and "cannot carry 340" in d.message


def test_restart_s_is_checked() -> None:
    with pytest.raises(fm.FleetMixError, match="restart_s must be >= 0"):
        MixModel(pays_up_to=1, replica_capacity=1.0, restart_s=-1.0)
