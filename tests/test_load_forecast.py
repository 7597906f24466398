"""The fleet governor's load forecast (policies/control/load_forecast.py) and how the mix
decision plans with it (policies/control/fleet_mix.py): a ramp is met before it
arrives, the capacity check weighs the forecast, and the reason says when the forecast
drove a move."""

from __future__ import annotations

import pytest

from specgov.policies.control import fleet_mix as fm
from specgov.policies.control.fleet_mix import MixModel, ReplicaView, decide_mix
from specgov.policies.control.load_forecast import (
    LoadForecastError,
    LoadSample,
    forecast_load,
)

MODEL = MixModel(
    pays_up_to=32, replica_capacity=100.0, hysteresis=0.25, dwell_s=60.0, restart_s=60.0
)


def _ramp(start: float, per_s: float, seconds: int, step_s: float = 5.0) -> list[LoadSample]:
    return [LoadSample(t * step_s, start + per_s * t * step_s) for t in range(seconds)]


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
    assert f.projected == pytest.approx(95.0 + 60.0)
    assert "forecast 155 in 60 s" in f.describe()


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
    # observed load alone), rising 1.5/s: 210 (52 per replica) when a restart is done.
    ramp = _ramp(120.0 - 1.5 * 55.0, 1.5, 12)
    f = forecast_load(ramp, horizon_s=MODEL.restart_s, window_s=120.0)
    assert f is not None
    without = decide_mix(_fleet("ssss"), 120.0, MODEL, now_s=0.0, last_move_s=None)
    assert without.move is None and without.reason == fm.HELD_IN_BAND
    d = decide_mix(_fleet("ssss"), 120.0, MODEL, now_s=0.0, last_move_s=None, forecast=f)
    assert d.move == fm.Move("r0", "plain") and d.reason == fm.MOVE_TO_PLAIN_FORECAST
    assert d.forecast_drove and d.planned_load == pytest.approx(210.0)
    assert "the forecast sets the target" in d.message and "forecast 210 in 60 s" in d.message


def test_a_falling_load_moves_back_to_spec_early_and_a_flat_one_is_not_the_forecasts() -> None:
    falling = forecast_load(_ramp(260.0, -2.0, 12), horizon_s=60.0, window_s=120.0)
    assert falling is not None and falling.projected == pytest.approx(30.0)
    d = decide_mix(
        _fleet("pppp"), falling.now, MODEL, now_s=0.0, last_move_s=None, forecast=falling
    )
    assert d.move is not None and d.move.to_mode == "spec"
    assert d.reason == fm.MOVE_TO_SPEC_FORECAST
    flat = forecast_load(_ramp(200.0, 0.0, 12), horizon_s=60.0, window_s=120.0)
    assert flat is not None
    same = decide_mix(_fleet("ssss"), 200.0, MODEL, now_s=0.0, last_move_s=None, forecast=flat)
    assert same.reason == fm.MOVE_TO_PLAIN and not same.forecast_drove


def test_the_capacity_check_weighs_the_forecast_peak() -> None:
    # 250 now fits on 3 replicas (300); 340 forecast does not: the move would leave the
    # fleet short while the replica restarts.
    rising = forecast_load(_ramp(250.0 - 1.5 * 55.0, 1.5, 12), horizon_s=60.0, window_s=120.0)
    assert rising is not None and rising.projected == pytest.approx(340.0)
    d = decide_mix(_fleet("ssss"), 250.0, MODEL, now_s=0.0, last_move_s=None, forecast=rising)
    assert d.move is None and d.reason == fm.HELD_CAPACITY and "cannot carry 340" in d.message


def test_restart_s_is_checked() -> None:
    with pytest.raises(fm.FleetMixError, match="restart_s must be >= 0"):
        MixModel(pays_up_to=1, replica_capacity=1.0, restart_s=-1.0)
