"""The fleet governor's decision: how many replicas run speculative, and the next move.

Pure (no IO, no clock: the caller passes the time). Inputs: the replicas as the gateway
and their servers report them (:class:`ReplicaView`), the load (requests in flight across
the fleet) observed and its trend (:mod:`~specgov.policies.control.load_forecast`), and
the :class:`MixModel` built from the same step-cost model and acceptance profile as
``specgov plan fleet``: ``pays_up_to``, the largest batch per replica at which a
speculative step is faster per output token than a plain one (the crossover), and each
mode's capacity (requests in flight one replica of that mode carries with its predicted
time per token within the TPOT SLO).

The rule. With a gateway that balances load, every serving replica sees about the same
batch ``b = load / replicas``; below the crossover speculation wins on every replica,
above it plain does, so the target is all speculative or all plain, with a hysteresis
band around the crossover in which the current mix holds (a mixed fleet appears only
while the governor moves it, one replica at a time).

The time a switch takes. A move takes a replica out for ``restart_s`` (its drain and
start-up), one at a time, so a switch of ``k`` replicas is done ``k x restart_s`` after it
starts. The decision plans for the load at that time (:func:`planned_loads`):

* to plain, for the larger of the observed load and the trend projected over
  ``(speculative replicas) x restart_s``, the time to finish the switch: the last
  replica is plain when the load it was moved for arrives, so moves start before the
  crossover when the forecast crosses it;
* to speculative, only when both the observed load and the trend over one move are
  below the band: early is the costly side there (a speculative replica past the
  crossover loses goodput steeply, a plain one at light load only some TPOT), so the
  way back waits for the load to fall.

The last safe moment. While one replica restarts the others carry its load, so a
switch to plain can start only while the ``n - 1`` replicas left carry the load; past
that a speculative fleet is stranded (holding loses, moving loses more). Inside the
band, where either mode is within the hysteresis of the other, the switch to plain
therefore starts once the planned load passes ``(1 - headroom)`` of what ``n - 1``
speculative replicas carry, when that is below the band's top (:func:`band`; reason
``move_to_plain_before_capacity``); the band's bottom, where the fleet moves back, is
lowered with it (the band keeps its ratio, so the mix does not flap at the new top).
Measured why (benchmarks/bench_fleet.py): with EAGLE-3 on llama-3.1-8b the crossover
batch is where a speculative replica's rate peaks, so a band around it lies past what
three of four speculative replicas carry, and a switch that waits for it strands them.

The load's unit. The decision compares load per replica with the crossover and the
capacities, all in one unit (``MixModel.unit``): requests in flight, or the arrival
rate (requests per second, the governor's ``--load arrival-rate``). A rate is the same
whatever mode serves it and however many replicas share it, so the capacity check is
exact for a rate; for requests in flight it is a lower bound (fewer replicas run each
request slower, and more of them are in flight).

A move drains one replica, so it is made only when every replica serves (no move in
flight, none lost), ``dwell_s`` after the last move, and when the replicas that stay
carry the load during the move: the larger of the observed load and the trend over one
``restart_s`` must be within the sum of their capacities, each at its own mode's
(:meth:`MixModel.capacity`; a capacity in requests in flight, so a lower bound on what
the load becomes on fewer replicas). Every decision carries a reason code and a message;
a move the observed load alone would not have made has its own reason (``*_forecast``)
and says so.
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
MOVE_TO_PLAIN_PAST_CAPACITY: Final = "move_to_plain_past_capacity"
MOVE_TO_PLAIN_BEFORE_CAPACITY: Final = "move_to_plain_before_capacity"
MOVE_TO_SPEC_PAST_CAPACITY: Final = "move_to_spec_past_capacity"
MOVE_TO_PLAIN_RESERVE: Final = "move_to_plain_reserve"


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

    All loads in ``unit`` (module docstring): ``pays_up_to``: the crossover load per
    replica (0: speculation never pays); ``replica_capacity``: the load one plain replica
    carries within the SLO; ``spec_capacity``: the same for a speculative replica (None:
    ``replica_capacity``); ``hysteresis``: the band is ``pays_up_to * (1 ± hysteresis)``;
    ``dwell_s``: seconds between moves; ``restart_s``: seconds a moved replica is out
    (drain and start-up), one move of a switch; ``headroom``: the share of the ``n - 1``
    speculative replicas' capacity left free when a switch to plain starts inside the
    band (:func:`band`); ``step_reserve``: the factor the load may jump by with the fleet
    still able to make its next move (:func:`reserve_cap`; 1: no reserve)."""

    pays_up_to: float
    replica_capacity: float
    hysteresis: float = 0.15
    dwell_s: float = 300.0
    restart_s: float = 0.0
    spec_capacity: float | None = None
    headroom: float = 0.10
    unit: str = "requests"
    step_reserve: float = 1.0

    def capacity(self, mode: Mode) -> float:
        """Requests in flight one replica of ``mode`` carries within the SLO."""
        if mode == "spec" and self.spec_capacity is not None:
            return self.spec_capacity
        return self.replica_capacity

    def __post_init__(self) -> None:
        if not math.isfinite(self.pays_up_to) or self.pays_up_to < 0:
            raise FleetMixError(f"pays_up_to must be >= 0, got {self.pays_up_to}")
        if not math.isfinite(self.step_reserve) or self.step_reserve < 1:
            raise FleetMixError(f"step_reserve must be >= 1, got {self.step_reserve}")
        if not 0 <= self.headroom < 1:
            raise FleetMixError(f"headroom must be in [0, 1), got {self.headroom}")
        if not math.isfinite(self.replica_capacity) or self.replica_capacity <= 0:
            raise FleetMixError(f"replica_capacity must be > 0, got {self.replica_capacity}")
        if not 0 <= self.hysteresis < 1:
            raise FleetMixError(f"hysteresis must be in [0, 1), got {self.hysteresis}")
        if not math.isfinite(self.dwell_s) or self.dwell_s < 0:
            raise FleetMixError(f"dwell_s must be >= 0, got {self.dwell_s}")
        if not math.isfinite(self.restart_s) or self.restart_s < 0:
            raise FleetMixError(f"restart_s must be >= 0, got {self.restart_s}")
        spec = self.spec_capacity
        if spec is not None and (not math.isfinite(spec) or spec <= 0):
            raise FleetMixError(f"spec_capacity must be > 0, got {spec}")


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


def band(replicas: int, model: MixModel) -> tuple[float, float]:
    """(bottom, top) of the band, load per replica: the fleet moves to plain at or above
    the top and back to speculative at or below the bottom. The top is the crossover's
    ``pays_up_to * (1 + hysteresis)``, or lower where ``n - 1`` speculative replicas,
    less the headroom, carry less than that (the last safe moment to start a switch,
    module docstring); the bottom keeps the band's ratio, ``top * (1 - h) / (1 + h)``."""
    h = model.hysteresis
    top = model.pays_up_to * (1.0 + h)
    if replicas >= 2:
        top = min(top, (1.0 - model.headroom) * (replicas - 1) * model.capacity("spec") / replicas)
    return top * (1.0 - h) / (1.0 + h), top


def target_spec_count(
    current_spec: int, replicas: int, batch: float, model: MixModel
) -> tuple[int, bool]:
    """(replicas that should run speculative, whether ``batch`` is inside the band)."""
    low, high = band(replicas, model)
    if model.pays_up_to == 0 or batch >= high:
        return 0, False
    if batch <= low:
        return replicas, False
    return current_spec, True


def reserve_cap(spec: int, replicas: int, load: float, model: MixModel) -> int:
    """The most replicas the step reserve lets run speculative at ``load`` (the fleet's).

    If the load jumped to ``step_reserve x load`` and a switch to plain were then due
    (past the band's top), the next move must still be safe: the ``n - 1`` replicas left,
    each at an even share, within ``(1 - headroom)`` of a speculative replica's capacity.
    The reserve is due where the jumped load per replica is past both (``trigger``): all
    but one replica go plain now, while the load is light (the last speculative one's
    move leaves only plain replicas). It lets go once the jumped load is at or below
    ``trigger x (1 - h) / (1 + h)`` (the band's ratio, so it does not flap), and between
    the two the fleet keeps what it has (at least one plain replica). ``replicas`` when
    no reserve is due."""
    n = replicas
    if model.step_reserve <= 1.0 or n < 2:
        return n
    h = model.hysteresis
    safe = (1.0 - model.headroom) * (n - 1) * model.capacity("spec") / n
    trigger = max(band(n, model)[1], safe)
    jumped = model.step_reserve * load / n
    if jumped >= trigger:
        return 1
    if jumped <= trigger * (1.0 - h) / (1.0 + h):
        return n
    return max(spec, 1)


@dataclass(frozen=True)
class PlannedLoads:
    """The loads the decision plans for (module docstring): ``to_plain`` over the time
    the switch to plain takes (``to_plain_horizon_s``), ``one_move`` over one move (the
    way back to speculative and the capacity check)."""

    to_plain: float
    to_plain_horizon_s: float
    one_move: float


def planned_loads(
    observed: float, spec_replicas: int, model: MixModel, forecast: LoadForecast | None
) -> PlannedLoads:
    """The observed load, raised to the forecast's where it is higher."""
    horizon = spec_replicas * model.restart_s
    if forecast is None:
        return PlannedLoads(observed, horizon, observed)
    return PlannedLoads(
        max(observed, forecast.at(horizon)), horizon, max(observed, forecast.at(model.restart_s))
    )


def _target(spec: int, n: int, loads: PlannedLoads, model: MixModel) -> tuple[int, bool, float]:
    """(target speculative replicas, inside the band, the load the target is for)."""
    to_plain, in_band = target_spec_count(spec, n, loads.to_plain / n, model)
    if to_plain == 0 and not in_band:
        return 0, False, loads.to_plain
    target, in_band = target_spec_count(spec, n, loads.one_move / n, model)
    return target, in_band, loads.one_move


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
    load's trend (None: plan for the observed load)."""
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
    loads = planned_loads(load_requests, spec, model, forecast)
    target, in_band, planned = _target(spec, n, loads, model)
    batch = planned / n
    observed_only = planned_loads(load_requests, spec, model, None)
    drove = forecast is not None and target != _target(spec, n, observed_only, model)[0]
    where = _where(batch, model, loads, forecast, drove)
    cap = reserve_cap(spec, n, loads.one_move, model)
    reserved = cap < (spec if in_band else target)
    if reserved:
        target, in_band = cap, False
        where += (
            f"; the step reserve: at {model.step_reserve:g}x the load "
            f"({_num(model.step_reserve * loads.one_move)} {model.unit}) a switch to plain "
            f"would be due and {n - 1} replicas could not carry its move, so {cap}/{n} "
            "speculative now"
        )

    def held(reason: str, message: str) -> MixDecision:
        return MixDecision(target, None, reason, message, batch, planned, drove)

    if in_band:
        return held(HELD_IN_BAND, f"holding {spec}/{n} speculative: {where}")
    if target == spec:
        return held(HELD_AT_TARGET, f"{spec}/{n} speculative is the target: {where}")
    if last_move_s is not None and now_s - last_move_s < model.dwell_s:
        wait = model.dwell_s - (now_s - last_move_s)
        return held(
            HELD_DWELL, f"target {target}/{n} speculative; next move in {wait:.0f} s: {where}"
        )
    to_mode: Mode = "spec" if target > spec else "plain"
    from_mode = "plain" if to_mode == "spec" else "spec"
    # The replica of the other mode that drains fastest: fewest requests in flight.
    pick = min(
        (r for r in replicas if r.mode == from_mode), key=lambda r: (r.running_requests, r.name)
    )
    short = _capacity_shortfall(replicas, pick, to_mode, load_requests, loads, model)
    if short is not None and not short[1]:
        return held(HELD_CAPACITY, f"target {target}/{n} speculative, but {short[0]}")
    reason, why = _move_reason(to_mode, short, reserved, drove, batch, n, model)
    where += why
    return MixDecision(
        target,
        Move(pick.name, to_mode),
        reason,
        f"restarting {pick.name} as {to_mode} (target {target}/{n} speculative): {where}",
        batch,
        planned,
        drove,
    )


def _move_reason(
    to_mode: Mode,
    short: tuple[str, bool] | None,
    reserved: bool,
    drove: bool,
    batch: float,
    n: int,
    model: MixModel,
) -> tuple[str, str]:
    """(reason code, what the message adds) for a move the decision makes."""
    if short is not None:
        reason = MOVE_TO_SPEC_PAST_CAPACITY if to_mode == "spec" else MOVE_TO_PLAIN_PAST_CAPACITY
        return reason, f"; {short[0]}, but the fleet is past its capacity already"
    if to_mode == "spec":
        return (MOVE_TO_SPEC_FORECAST if drove else MOVE_TO_SPEC), ""
    if reserved:
        return MOVE_TO_PLAIN_RESERVE, ""
    if batch < model.pays_up_to * (1.0 + model.hysteresis):
        return MOVE_TO_PLAIN_BEFORE_CAPACITY, (
            f"; past {_num(band(n, model)[1])} per replica, the last load at which "
            f"{n - 1} speculative replicas carry a move with {model.headroom:.0%} headroom"
        )
    return (MOVE_TO_PLAIN_FORECAST if drove else MOVE_TO_PLAIN), ""


def _where(
    batch: float, model: MixModel, loads: PlannedLoads, forecast: LoadForecast | None, drove: bool
) -> str:
    """The decision's grounds, for its message."""
    where = (
        f"{batch:.1f} {model.unit} per replica against a crossover at {model.pays_up_to:g} "
        f"(band ±{model.hysteresis:.0%})"
    )
    if forecast is None:
        return where
    return (
        f"{where}; {forecast.describe()}, {_num(loads.to_plain)} in "
        f"{loads.to_plain_horizon_s:.0f} s (a switch to plain)"
        + (", the forecast sets the target" if drove else "")
    )


def _capacity_shortfall(
    replicas: Sequence[ReplicaView],
    pick: ReplicaView,
    to_mode: Mode,
    observed: float,
    loads: PlannedLoads,
    model: MixModel,
) -> tuple[str, bool] | None:
    """None when the replicas that stay carry the load over one move; else (why not,
    whether to move all the same): only when the observed load is past what the whole
    fleet carries in its current mix and ``to_mode`` carries more than ``pick``'s mode.
    Holding then keeps the fleet past its capacity for as long as the load stays; the
    move lowers it for one restart and raises it after."""
    staying = sum(model.capacity(r.mode) for r in replicas if r.name != pick.name)
    if loads.one_move <= staying:
        return None
    why = (
        f"the {len(replicas) - 1} other replicas cannot carry {_num(loads.one_move)} "
        f"{model.unit} ({_num(staying)} together: {_capacities(model)}) while {pick.name} "
        "restarts"
    )
    whole = staying + model.capacity(pick.mode)
    raises = model.capacity(to_mode) > model.capacity(pick.mode)
    return why, observed > whole and raises


def _capacities(model: MixModel) -> str:
    spec, plain = model.capacity("spec"), model.capacity("plain")
    return f"{_num(spec)} a speculative replica, {_num(plain)} a plain one"


def _num(x: float) -> str:
    """A load for a message: whole above 100, else three significant digits."""
    return f"{x:.0f}" if abs(x) >= 100 else f"{x:.3g}"
