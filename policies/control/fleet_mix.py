"""The fleet governor's decision: how many replicas run speculative, and the next move.

Pure (no IO, no clock: the caller passes the time). Inputs: the replicas as the gateway
and their servers report them (:class:`ReplicaView`), the load (requests in flight across
the fleet) observed and forecast (:mod:`~specgov.policies.control.load_forecast`: the
trend of the recent window projected over ``restart_s``, the time a moved replica is
out), and the
:class:`MixModel` built from the same step-cost model and acceptance profile as
``specgov plan fleet`` (its ``pays_up_to``: the largest batch per replica at which a
speculative step is faster per output token than a plain one, the crossover).

The rule. With a gateway that balances load, every serving replica sees about the same
batch ``b = load / serving``; below the crossover speculation wins on every replica,
above it plain does, so the target is all speculative or all plain, with a hysteresis
band around the crossover in which the current mix holds (a mixed fleet appears only
while the governor moves it, one replica at a time). A move drains one replica, so it is
made only when the others carry the load (``load <= (serving - 1) * replica_capacity``),
only when every replica serves (no move in flight, none lost), and only after
``dwell_s`` since the last move. The target comes from the forecast load (a ramp is met
before it arrives: the replica is back in its new mode when the load it was moved for
comes), the capacity check from the larger of the observed and forecast loads. Every
decision carries a reason code and a message; a move the observed load alone would not
have made has its own reason (``*_forecast``) and says so.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, Literal

from specgov.policies.common.errors import SpecgovError
from specgov.policies.control.load_forecast import LoadForecast

Mode = Literal["spec", "plain"]
MODES: Final = ("spec", "plain")

# Reason codes (the audit row's `reason`).
HELD_NOT_SERVING: Final = "held_replica_not_serving"
HELD_AT_TARGET: Final = "held_at_target"
HELD_IN_BAND: Final = "held_in_hysteresis_band"
HELD_DWELL: Final = "held_dwell"
HELD_CAPACITY: Final = "held_capacity"
HELD_NO_LOAD_DATA: Final = "held_unknown_load"
MOVE_TO_PLAIN: Final = "move_to_plain"
MOVE_TO_SPEC: Final = "move_to_spec"
MOVE_TO_PLAIN_FORECAST: Final = "move_to_plain_forecast"
MOVE_TO_SPEC_FORECAST: Final = "move_to_spec_forecast"


class FleetMixError(SpecgovError, ValueError):
    """A fleet description or model the decision cannot use."""


@dataclass(frozen=True)
class ReplicaView:
    """One replica now: its mode, whether it serves (registered with the gateway and
    healthy), and its requests in flight."""

    name: str
    mode: Mode
    serving: bool
    running_requests: float

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise FleetMixError(f"replica {self.name}: mode must be spec or plain, got {self.mode}")
        if not math.isfinite(self.running_requests) or self.running_requests < 0:
            raise FleetMixError(
                f"replica {self.name}: running_requests must be >= 0, got {self.running_requests}"
            )


@dataclass(frozen=True)
class MixModel:
    """What the decision knows of the replicas' speed (module docstring).

    ``pays_up_to``: the crossover batch per replica (0: speculation never pays);
    ``replica_capacity``: requests in flight one replica carries within the SLO;
    ``hysteresis``: the band is ``pays_up_to * (1 ± hysteresis)``; ``dwell_s``: seconds
    between moves; ``restart_s``: seconds a moved replica is out (drain and start-up),
    the horizon the caller forecasts the load over."""

    pays_up_to: int
    replica_capacity: float
    hysteresis: float = 0.15
    dwell_s: float = 300.0
    restart_s: float = 0.0

    def __post_init__(self) -> None:
        if self.pays_up_to < 0:
            raise FleetMixError(f"pays_up_to must be >= 0, got {self.pays_up_to}")
        if not math.isfinite(self.replica_capacity) or self.replica_capacity <= 0:
            raise FleetMixError(f"replica_capacity must be > 0, got {self.replica_capacity}")
        if not 0 <= self.hysteresis < 1:
            raise FleetMixError(f"hysteresis must be in [0, 1), got {self.hysteresis}")
        if not math.isfinite(self.dwell_s) or self.dwell_s < 0:
            raise FleetMixError(f"dwell_s must be >= 0, got {self.dwell_s}")
        if not math.isfinite(self.restart_s) or self.restart_s < 0:
            raise FleetMixError(f"restart_s must be >= 0, got {self.restart_s}")


@dataclass(frozen=True)
class Move:
    """Drain ``replica``, restart it in ``to_mode``, put it back."""

    replica: str
    to_mode: Mode


@dataclass(frozen=True)
class MixDecision:
    target_spec: int  # replicas that should run speculative
    move: Move | None
    reason: str
    message: str
    batch_per_replica: float | None
    planned_load: float | None = None  # the load the target is for (the forecast's)
    forecast_drove: bool = False  # the observed load alone gives another target


def target_spec_count(
    current_spec: int, replicas: int, batch: float, model: MixModel
) -> tuple[int, bool]:
    """(replicas that should run speculative, whether ``batch`` is inside the band)."""
    low = model.pays_up_to * (1.0 - model.hysteresis)
    high = model.pays_up_to * (1.0 + model.hysteresis)
    if model.pays_up_to == 0 or batch >= high:
        return 0, False
    if batch <= low:
        return replicas, False
    return current_spec, True


def decide_mix(
    replicas: Sequence[ReplicaView],
    load_requests: float | None,
    model: MixModel,
    *,
    now_s: float,
    last_move_s: float | None,
    forecast: LoadForecast | None = None,
) -> MixDecision:
    """The target mix and the next move (None: hold), with the reason; ``forecast``: the
    load over the next ``model.restart_s`` (None: plan for the observed load)."""
    n = len(replicas)
    if n == 0:
        raise FleetMixError("the fleet has no replicas")
    spec = sum(1 for r in replicas if r.mode == "spec")
    down = [r.name for r in replicas if not r.serving]
    if down:
        return MixDecision(
            spec,
            None,
            HELD_NOT_SERVING,
            f"holding the mix: {', '.join(down)} not serving (a move in progress or a "
            f"replica lost)",
            None,
        )
    if load_requests is None or not math.isfinite(load_requests) or load_requests < 0:
        return MixDecision(spec, None, HELD_NO_LOAD_DATA, "holding the mix: no load data", None)
    planned = load_requests if forecast is None else forecast.projected
    batch = planned / n
    target, in_band = target_spec_count(spec, n, batch, model)
    observed_target = target_spec_count(spec, n, load_requests / n, model)[0]
    drove = forecast is not None and observed_target != target
    where = (
        f"{batch:.1f} requests per replica against a crossover at {model.pays_up_to} "
        f"(band ±{model.hysteresis:.0%})"
    )
    if forecast is not None:
        where += f"; {forecast.describe()}" + (", the forecast sets the target" if drove else "")

    def held(reason: str, message: str, tgt: int = target) -> MixDecision:
        return MixDecision(tgt, None, reason, message, batch, planned, drove)

    if in_band:
        return held(HELD_IN_BAND, f"holding {spec}/{n} speculative: {where}")
    if target == spec:
        return held(HELD_AT_TARGET, f"{spec}/{n} speculative is the target: {where}")
    if last_move_s is not None and now_s - last_move_s < model.dwell_s:
        wait = model.dwell_s - (now_s - last_move_s)
        return held(
            HELD_DWELL, f"target {target}/{n} speculative; next move in {wait:.0f} s: {where}"
        )
    peak = max(load_requests, planned)
    if peak > (n - 1) * model.replica_capacity:
        return held(
            HELD_CAPACITY,
            f"target {target}/{n} speculative, but {n - 1} replicas cannot carry "
            f"{peak:.0f} requests in flight ({model.replica_capacity:.0f} each) while "
            f"one restarts",
        )
    to_mode: Mode = "spec" if target > spec else "plain"
    from_mode = "plain" if to_mode == "spec" else "spec"
    # The replica of the other mode that drains fastest: fewest requests in flight.
    pick = min(
        (r for r in replicas if r.mode == from_mode), key=lambda r: (r.running_requests, r.name)
    )
    if to_mode == "spec":
        reason = MOVE_TO_SPEC_FORECAST if drove else MOVE_TO_SPEC
    else:
        reason = MOVE_TO_PLAIN_FORECAST if drove else MOVE_TO_PLAIN
    return MixDecision(
        target,
        Move(pick.name, to_mode),
        reason,
        f"restarting {pick.name} as {to_mode} (target {target}/{n} speculative): {where}",
        batch,
        planned,
        drove,
    )
