"""``specgov fleet``: the fleet governor from the command line.

``specgov fleet status --fleet FILE`` shows the replicas (mode, serving, requests in
flight), the load and the next planned move; ``specgov fleet run --fleet FILE`` observes,
decides and carries out moves, one replica at a time, until stopped (or for
``--duration-s``); ``specgov fleet sim-restart NAME MODE URL --run-dir DIR`` is the restart
command the project ships for fleets of sim-servers
(:mod:`specgov.simulator.server.replica`). The decision is
:func:`specgov.policies.control.fleet_mix.decide_mix`; its
crossover and per-replica capacities come from ``--pays-up-to`` / ``--replica-capacity`` /
``--spec-capacity``, or are computed from a trace and the deployment with the same
per-token tables ``specgov plan fleet`` uses
(:func:`specgov.simulator.planning.fleet.mix_crossover`). A move is
:func:`specgov.controller.fleet.move.execute_move` through the smg gateway
(:mod:`specgov.controller.fleet.gateway`). Each decision and each step of a move is an
audit row (JSON lines, ``--audit``); the replicas' current modes and the time of the last
move are kept in ``--state`` (written atomically) so a restarted governor continues.

Only click is imported at load time.
"""

from __future__ import annotations

import functools
import json
import os
import time
from collections import deque
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from specgov.controller.cli import options as opt

if TYPE_CHECKING:
    from specgov.controller.fleet.gateway import SmgGateway
    from specgov.controller.fleet.metrics import FleetMetrics
    from specgov.controller.fleet.move import FleetFile
    from specgov.policies.control.arrival_rate import ArrivalMeter, ReplicaCount
    from specgov.policies.control.fleet_mix import MixDecision, MixModel, Mode, ReplicaView


def _load_state(path: Path | None, fleet: FleetFile) -> tuple[dict[str, Mode], float | None]:
    modes: dict[str, Mode] = {r.name: r.mode for r in fleet.replicas}
    if path is None or not path.exists():
        return modes, None
    try:
        raw = json.loads(path.read_text())
        saved = raw["modes"]
        last = raw.get("last_move_s")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise click.ClickException(f"{path}: not a fleet state file ({exc})") from None
    for name, mode in saved.items():
        if name in modes and mode in ("spec", "plain"):
            modes[name] = mode
    return modes, float(last) if isinstance(last, int | float) else None


def _save_state(path: Path | None, modes: dict[str, Mode], last_move_s: float | None) -> None:
    if path is None:
        return
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"modes": modes, "last_move_s": last_move_s}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _in_flight(url: str) -> float | None:
    import httpx

    try:
        with httpx.Client(timeout=5.0, trust_env=False) as client:
            r = client.get(f"{url}/v1/loads")
        load = r.json()["loads"][0]
        return float(load["num_running_reqs"]) + float(load["num_waiting_reqs"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
        return None


def _counts(url: str) -> ReplicaCount | None:
    """A replica's requests finished (``sglang:num_requests_total``) and in flight
    (running and queued), from one ``/metrics`` scrape; None when it does not answer."""
    import httpx

    from specgov.adapters import telemetry as tm
    from specgov.adapters.prometheus_text import counter_by_dp, gauge_by_dp, parse_metrics
    from specgov.policies.control.arrival_rate import ReplicaCount

    try:
        with httpx.Client(timeout=5.0, trust_env=False) as client:
            r = client.get(f"{url}/metrics")
        r.raise_for_status()
        snap = parse_metrics(r.text, families={tm.NUM_REQUESTS, tm.NUM_RUNNING, tm.NUM_QUEUE})
    except (httpx.HTTPError, ValueError):
        return None
    finished = counter_by_dp(snap, tm.NUM_REQUESTS)
    if not finished:
        return None
    flight = sum(
        v.value for m in (tm.NUM_RUNNING, tm.NUM_QUEUE) for v in gauge_by_dp(snap, m).values()
    )
    return ReplicaCount(sum(v.value for v in finished.values()), flight)


def observe_counts(
    fleet: FleetFile, gateway_metrics: str | None
) -> tuple[dict[str, ReplicaCount], list[str]]:
    """The counts the arrival rate is read from, and the names expected: the gateway's
    requests received (``--gateway-metrics``: the demand, refused requests included), else
    each answering replica's (:func:`_counts`)."""
    from specgov.controller.fleet.gateway import gateway_requests
    from specgov.policies.control.arrival_rate import ReplicaCount

    if gateway_metrics is not None:
        received = gateway_requests(gateway_metrics)
        found = {} if received is None else {"gateway": ReplicaCount(received, 0.0)}
        return found, ["gateway"]
    counts = {r.name: _counts(r.url) for r in fleet.replicas}
    return {n: c for n, c in counts.items() if c is not None}, [r.name for r in fleet.replicas]


def observe(
    fleet: FleetFile, gateway: SmgGateway, modes: dict[str, Mode]
) -> tuple[list[ReplicaView], float | None, str | None]:
    """The replicas now, the load (requests in flight), and why not when unknown."""
    from specgov.controller.fleet.gateway import GatewayError
    from specgov.policies.control.fleet_mix import ReplicaView

    try:
        registered = {w.url: w for w in gateway.workers()}
    except GatewayError as exc:
        return [], None, str(exc)
    views: list[ReplicaView] = []
    total = 0.0
    missing: list[str] = []
    for r in fleet.replicas:
        worker = registered.get(r.url)
        running = _in_flight(r.url)
        serving = worker is not None and worker.healthy and worker.status == "ready"
        if running is None:
            missing.append(r.name)
            serving = False
        views.append(ReplicaView(r.name, modes[r.name], serving, running or 0.0))
        total += running or 0.0
    why = f"no load from {', '.join(missing)}" if missing else None
    return views, total, why


def _restart_seconds(restart_s: float | None, model: str) -> float:
    """--restart-s, else the catalog model's start-up (what a restart costs)."""
    if restart_s is not None:
        return restart_s
    from specgov.simulator.catalog import Catalog, CatalogError

    try:
        found = Catalog.load().model(model).startup_s
    except CatalogError as exc:
        raise click.UsageError(f"--restart-s: {exc}; give --restart-s") from None
    if found is None:
        raise click.UsageError(f"--restart-s: the catalog model {model!r} gives no startup_s")
    return found


LOADS = ("in-flight", "arrival-rate")
# The load jump the fleet keeps a move's reserve for (docs/operations.md, "The step
# reserve"): in the Azure LLM conversation trace (2023) the largest rise over the next
# 3 minutes (the rate window and one move) is at most 1.56x in 99% of minutes, 1.26x in 95%.
STEP_RESERVE = 1.5
UNITS = {"in-flight": "requests", "arrival-rate": "req/s"}


def _model(
    numbers: tuple[float | None, float | None, float | None],
    trace: str | None,
    deployment: tuple[str, str, str],
    tpot_ms: float,
    knobs: tuple[float, float, float, float, float],
    load: str,
) -> MixModel:
    """The decision's model; ``numbers``: --pays-up-to, --replica-capacity, --spec-capacity
    in the --load unit (each None: computed from --trace as plan fleet does); ``knobs``:
    --dwell-s, --hysteresis, --restart-s, --headroom, --step-reserve."""
    from specgov.policies.control.fleet_mix import FleetMixError, MixModel

    dwell_s, hysteresis, restart_s, headroom, step_reserve = knobs
    pays_up_to, replica_capacity, spec_capacity = numbers
    if trace is not None and None in numbers:
        from specgov.simulator.planning.fleet import mix_crossover
        from specgov.simulator.replay.runner import ServerSpec
        from specgov.simulator.server.cli import load_trace_arg

        gpu, model, drafter = deployment
        found = mix_crossover(
            load_trace_arg(trace),
            ServerSpec(gpu=gpu, model=model, drafter=drafter),
            tpot_ms=tpot_ms,
        )
        if found is None:
            raise click.ClickException("no per-token model for this deployment: give the numbers")
        rate = load == "arrival-rate"
        if pays_up_to is None:
            pays_up_to = found.pays_up_to_rps if rate else found.pays_up_to
        if replica_capacity is None:
            replica_capacity = found.plain_rps if rate else float(found.plain_capacity)
        if spec_capacity is None:
            spec_capacity = found.spec_rps if rate else float(found.spec_capacity)
    if pays_up_to is None or replica_capacity is None:
        raise click.UsageError("give --pays-up-to and --replica-capacity, or --trace")
    try:
        return MixModel(
            pays_up_to,
            replica_capacity,
            hysteresis=hysteresis,
            dwell_s=dwell_s,
            restart_s=restart_s,
            spec_capacity=spec_capacity,
            headroom=headroom,
            unit=UNITS[load],
            step_reserve=step_reserve,
        )
    except FleetMixError as exc:
        raise click.UsageError(str(exc)) from None


def _decision_doc(
    views: list[ReplicaView], load: float | None, d: MixDecision, mix: MixModel
) -> dict[str, Any]:
    return {
        "model": {
            "pays_up_to": mix.pays_up_to,
            "capacity": {"spec": mix.capacity("spec"), "plain": mix.capacity("plain")},
            "restart_s": mix.restart_s,
            "headroom": mix.headroom,
            "step_reserve": mix.step_reserve,
        },
        "replicas": [asdict(v) for v in views],
        "load_requests": load,
        "target_spec": d.target_spec,
        "next_move": None if d.move is None else asdict(d.move),
        "reason": d.reason,
        "message": d.message,
    }


# The options every fleet command takes.
_options = opt.compose(
    click.option(
        "--fleet", "fleet_path", type=click.Path(dir_okay=False, path_type=Path), required=True
    ),
    click.option(
        "--state",
        "state_path",
        type=click.Path(dir_okay=False, path_type=Path),
        default=None,
        help="The governor's state file (modes, last move).",
    ),
    click.option(
        "--load",
        "load_measure",
        type=click.Choice(LOADS),
        default="in-flight",
        show_default=True,
        help="The load the decision reads: requests in flight, or the arrival rate "
        "(requests per second: finished plus the change in flight, from each replica's "
        "/metrics). The three numbers below are in its unit, per replica.",
    ),
    click.option(
        "--gateway-metrics",
        default=None,
        metavar="URL",
        help="--load arrival-rate: count arrivals at the gateway, smg's Prometheus endpoint "
        "(smg launch --prometheus-port; its requests received, refused ones included), "
        "instead of at each replica.",
    ),
    click.option(
        "--pays-up-to",
        type=click.FloatRange(min=0),
        default=None,
        help="Crossover: the load per replica up to which speculation pays.",
    ),
    click.option(
        "--replica-capacity",
        type=click.FloatRange(min=0, min_open=True),
        default=None,
        help="The load one plain replica carries within the SLO.",
    ),
    click.option(
        "--spec-capacity",
        type=click.FloatRange(min=0, min_open=True),
        default=None,
        help="The same for a speculative replica [default: from --trace, else --replica-capacity].",
    ),
    click.option("--trace", default=None, help="Compute both from this trace (as plan fleet)."),
    opt.gpu_option(),
    opt.model_option(),
    opt.drafter_option("Speculative replicas' drafter."),
    click.option(
        "--tpot-ms", type=click.FloatRange(min=0, min_open=True), default=50.0, show_default=True
    ),
    click.option("--dwell-s", type=click.FloatRange(min=0), default=300.0, show_default=True),
    click.option(
        "--headroom",
        type=click.FloatRange(0, 1, max_open=True),
        default=0.10,
        show_default=True,
        help="Share of what n-1 speculative replicas carry left free when a switch to plain "
        "starts (it starts inside the band when waiting would strand them).",
    ),
    click.option(
        "--step-reserve",
        type=click.FloatRange(min=1),
        default=STEP_RESERVE,
        show_default=True,
        help="The factor the load may jump by with the fleet still able to make its next "
        "move: past it, all but one replica go plain early (reason move_to_plain_reserve); "
        "1 turns it off. Default: the Azure conversation trace's largest 3-minute rise, "
        "99th percentile (docs/operations.md).",
    ),
    click.option(
        "--rate-window-s",
        type=click.FloatRange(min=0, min_open=True),
        default=60.0,
        show_default=True,
        help="--load arrival-rate: the seconds of arrivals each rate is read over.",
    ),
    click.option(
        "--hysteresis", type=click.FloatRange(0, 1, max_open=True), default=0.15, show_default=True
    ),
    click.option(
        "--restart-s",
        type=click.FloatRange(min=0),
        default=None,
        help="Seconds one moved replica is out (drain and SGLang start-up); the load is "
        "forecast over one move and over a whole switch (moves x this) [default: the "
        "catalog --model's startup_s].",
    ),
)


@click.group("fleet")
def fleet_group() -> None:
    """Govern the mix of speculative and plain replicas behind an smg gateway."""


def _prepare(
    opts: dict[str, Any],
) -> tuple[FleetFile, dict[str, Mode], float | None, MixModel]:
    """The fleet file, the saved modes and last move, and the decision's model, from the
    options every fleet command takes."""
    from specgov.controller.fleet.move import FleetFileError, load_fleet_file

    try:
        fleet = load_fleet_file(opts["fleet_path"])
    except FleetFileError as exc:
        raise click.ClickException(str(exc)) from None
    modes, last = _load_state(opts["state_path"], fleet)
    mix = _model(
        (opts["pays_up_to"], opts["replica_capacity"], opts["spec_capacity"]),
        opts["trace"],
        (opts["gpu"], opts["model"], opts["drafter"]),
        opts["tpot_ms"],
        (
            opts["dwell_s"],
            opts["hysteresis"],
            _restart_seconds(opts["restart_s"], opts["model"]),
            opts["headroom"],
            opts["step_reserve"],
        ),
        opts["load_measure"],
    )
    return fleet, modes, last, mix


STATUS_RATE_MAX_S = 5.0  # status reads the arrival rate over at most this long


def _status_rate(fleet: FleetFile, window_s: float, gateway_metrics: str | None) -> float | None:
    """The arrival rate over two readings ``min(window_s, 5 s)`` apart (status is one
    look, not a loop)."""
    from specgov.policies.control.arrival_rate import ArrivalMeter

    wait_s = min(window_s, STATUS_RATE_MAX_S)
    meter = ArrivalMeter(wait_s)
    meter.update(time.time(), observe_counts(fleet, gateway_metrics)[0])
    time.sleep(wait_s)
    meter.update(time.time(), observe_counts(fleet, gateway_metrics)[0])
    return meter.rate()


@fleet_group.command("status")
@_options
@opt.output_option("Lines for people, or one JSON object for scripts.")
def status_cmd(output: str, **opts: Any) -> None:
    """The replicas, their mode and load, and the next planned move."""
    from specgov.controller.fleet.gateway import SmgGateway, gateway_token
    from specgov.policies.control.fleet_mix import decide_mix

    fleet, modes, last, mix = _prepare(opts)
    gw = SmgGateway(fleet.gateway, token=gateway_token())
    try:
        views, load, why = observe(fleet, gw, modes)
        if opts["load_measure"] == "arrival-rate":
            load = _status_rate(fleet, opts["rate_window_s"], opts["gateway_metrics"])
    finally:
        gw.close()
    if not views:
        raise click.ClickException(f"gateway {fleet.gateway}: {why}")
    d = decide_mix(views, load, mix, now_s=time.time(), last_move_s=last)
    doc = _decision_doc(views, load, d, mix)
    if output == "json":
        click.echo(json.dumps(doc, indent=2))
        return
    for v in views:
        state = "serving" if v.serving else "NOT serving"
        click.echo(f"{v.name:12} {v.mode:6} {state:12} {v.running_requests:6.0f} in flight")
    move = "none" if d.move is None else f"{d.move.replica} -> {d.move.to_mode}"
    click.echo(f"load {load if load is not None else 'unknown'}; next move: {move}")
    click.echo(f"{d.reason}: {d.message}")


@fleet_group.command("run")
@_options
@click.option(
    "--audit", "audit_path", type=click.Path(dir_okay=False, path_type=Path), required=True
)
@click.option("--interval-s", type=click.FloatRange(min=0.05), default=10.0, show_default=True)
@click.option(
    "--duration-s",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    help="Stop after this long (default: until interrupted).",
)
@click.option(
    "--metrics-addr",
    default=None,
    help="Serve the specgov_fleet_* metrics on HOST:PORT (e.g. 127.0.0.1:9466).",
)
@click.option(
    "--forecast-window-s",
    type=click.FloatRange(min=0, min_open=True),
    default=120.0,
    show_default=True,
    help="The recent load samples the trend is fitted on (projected over --restart-s).",
)
@click.option(
    "--forecast/--no-forecast",
    default=True,
    show_default=True,
    help="Plan for the load's trend (a line through the recent samples); without it the "
    "decision plans for the load now (a staircase load: a line through a step projects "
    "the step onward).",
)
def run_cmd(
    audit_path: Path,
    interval_s: float,
    duration_s: float | None,
    metrics_addr: str | None,
    forecast_window_s: float,
    forecast: bool,
    **opts: Any,
) -> None:
    """Observe, decide and move replicas, one at a time (audit rows in --audit)."""
    from specgov.controller.fleet.gateway import SmgGateway, gateway_token
    from specgov.controller.fleet.metrics import FleetMetrics
    from specgov.controller.fleet.move import AuditLog, AuditRow, execute_move
    from specgov.policies.control.arrival_rate import ArrivalMeter
    from specgov.policies.control.fleet_mix import decide_mix
    from specgov.policies.control.load_forecast import LoadSample, forecast_load

    fleet, modes, last, mix = _prepare(opts)
    state_path: Path | None = opts["state_path"]
    meter = ArrivalMeter(opts["rate_window_s"]) if opts["load_measure"] == "arrival-rate" else None
    # The samples the forecast fits; bounded (the window at the polling interval).
    samples: deque[LoadSample] = deque(maxlen=max(8, int(forecast_window_s / interval_s) + 2))
    metrics = FleetMetrics()
    if metrics_addr is not None:
        _serve_metrics(metrics, metrics_addr)
    audit = AuditLog(audit_path)
    gw = SmgGateway(fleet.gateway, token=gateway_token())
    end = None if duration_s is None else time.monotonic() + duration_s
    try:
        while end is None or time.monotonic() < end:
            views, load, why = observe(fleet, gw, modes)
            now = time.time()
            if meter is not None:
                load, why = _rate_now(meter, fleet, now, why, opts["gateway_metrics"])
            if not views:
                metrics.held("held_gateway_unreachable")
                audit.write(
                    AuditRow(
                        now, "-", "decide", "held_gateway_unreachable", f"holding the mix: {why}"
                    )
                )
            else:
                if load is not None and why is None:
                    samples.append(LoadSample(now, load))
                trend = (
                    forecast_load(samples, horizon_s=mix.restart_s, window_s=forecast_window_s)
                    if forecast
                    else None
                )
                d = decide_mix(views, load, mix, now_s=now, last_move_s=last, forecast=trend)
                metrics.observe(views, load, d)
                note = f" ({why})" if why else ""
                audit.write(
                    AuditRow(
                        now,
                        d.move.replica if d.move else "-",
                        "decide",
                        d.reason,
                        d.message + note,
                        load_requests=load,
                        planned_load=d.planned_load,
                    )
                )
                if d.move is not None:
                    current = modes[d.move.replica]
                    outcome = execute_move(d.move, fleet, gw, audit, current=current)
                    modes[outcome.replica] = outcome.mode
                    metrics.moved(outcome.reason)
                    last = time.time()
                    _save_state(state_path, modes, last)
            time.sleep(interval_s)
    except KeyboardInterrupt:
        pass
    finally:
        gw.close()
        _save_state(state_path, modes, last)


def _serve_metrics(metrics: FleetMetrics, metrics_addr: str) -> None:
    host, _, port = metrics_addr.rpartition(":")
    if not host or not port.isdigit():
        raise click.UsageError(f"--metrics-addr: expected HOST:PORT, got {metrics_addr!r}")
    try:
        metrics.serve(host, int(port))
    except OSError as exc:
        raise click.ClickException(f"--metrics-addr {metrics_addr}: {exc}") from None


def _rate_now(
    meter: ArrivalMeter, fleet: FleetFile, now: float, why: str | None, gateway_metrics: str | None
) -> tuple[float | None, str | None]:
    """The arrival rate with this reading counted, and why a count is missing from it."""
    counts, expected = observe_counts(fleet, gateway_metrics)
    meter.update(now, counts)
    missing = [name for name in expected if name not in counts]
    if missing:
        why = (why + "; " if why else "") + f"no request counts from {', '.join(missing)}"
    return meter.rate(), why


@fleet_group.command("sim-restart")
@click.argument("name")
@click.argument("mode", type=click.Choice(["spec", "plain"]))
@click.argument("url")
@click.option(
    "--run-dir",
    type=click.Path(file_okay=False, path_type=Path),
    required=True,
    help="Where each replica's pid file (NAME.pid) and log (NAME.log) live.",
)
@click.option(
    "--timeout-s",
    type=click.FloatRange(min=0, min_open=True),
    default=100.0,
    show_default=True,
    help="Give up (and stop it) when the new server is not healthy this long after its start-up.",
)
@click.option(
    "--startup-s",
    default="catalog",
    show_default=True,
    metavar="SECONDS|catalog",
    help="The simulated start-up of the new server (model load, CUDA graph capture; "
    "wall time: this / its --speed): seconds, or 'catalog', the model's startup_s.",
)
@click.option(
    "--in-place",
    is_flag=True,
    help="Restart the running sim-server of NAME inside its process (in-flight requests "
    "lost, the port closed for the start-up, counted from this command's launch), so a "
    "busy machine's process start does not lengthen it; starts a process when none runs.",
)
@click.argument("sim_args", nargs=-1, type=click.UNPROCESSED)
def sim_restart_cmd(
    name: str,
    mode: str,
    url: str,
    run_dir: Path,
    timeout_s: float,
    startup_s: str,
    in_place: bool,
    sim_args: tuple[str, ...],
) -> None:
    """Restart sim-server replica NAME in MODE (spec or plain) on URL's port; returns once
    it is healthy. The restart command for a fleet of sim-servers, e.g. in the fleet file
    ``restart_command: "specgov fleet sim-restart {name} {mode} {url} --run-dir /run/fleet
    -- --speed 1"``; arguments after ``--`` go to ``specgov sim-server`` (default
    ``--trace none``)."""
    from specgov.simulator.server.cli import process_age_s
    from specgov.simulator.server.replica import ReplicaError, restart_in_place, restart_replica

    # In place, the start-up counts from this command's launch.
    restart = (
        functools.partial(restart_in_place, launched_s=time.monotonic() - (process_age_s() or 0.0))
        if in_place
        else restart_replica
    )
    try:
        started = restart(
            name, mode, url, run_dir, sim_args=sim_args, timeout_s=timeout_s, startup_s=startup_s
        )
    except ReplicaError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(
        f"{name}: sim-server pid {started.pid} serves {url} as {mode} "
        f"(healthy after {started.startup_s:.1f} s, {started.simulated_startup_s:g} s of "
        "simulated start-up)"
    )
