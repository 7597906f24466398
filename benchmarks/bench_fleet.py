"""The fleet governor end to end: smg + 4 sim-servers + ``specgov fleet run`` under a ramp.

Issue 21 §3. Real parts: the ``smg`` gateway binary (1.13, ``specgov[fleet]``), four
``specgov sim-server`` processes started and restarted by the shipped restart command
(``specgov fleet sim-restart``: each runs speculative EAGLE-3 or plain), and the fleet
governor as its own process (``specgov fleet run``, the code path an operator runs). An
open-loop load generator (Poisson arrivals from a seeded generator, loopback only, a
bounded number of requests and time) sends SGLang ``/generate`` requests through the
gateway at a rate that ramps from light load to beyond what four speculative replicas
sustain and back. The same ramp runs against an all-speculative and an all-plain fleet
(the same gateway policy, no governor).

Time. The sim-servers run at ``--speed`` simulated seconds per wall second; every rate,
duration, latency and start-up below is simulated (wall = simulated / speed), the
governor's intervals, dwell and restart time are given to it in wall seconds (the
simulated figure / speed), its rates per wall second (x speed). A restart costs the
catalog model's ``startup_s`` (SGLang's model load and CUDA graph capture, with its
source in the catalog) unless ``--startup-s`` says otherwise; ``--quick`` shortens it
(said in the output) so that the run fits in under 3 minutes on a 2-core machine. The
governor restarts a replica in place (``fleet sim-restart --in-place``): the server
drops what it has in flight and refuses connections for the start-up, counted from the
restart command's launch, so a loaded machine's slow process start does not lengthen it
(measured before: 90-150 s simulated for a 60 s start-up at speed 8).

The governor reads the load as the arrival rate counted at the gateway (``fleet run
--load arrival-rate --gateway-metrics``) and decides with plan fleet's rates per replica
(``MixCrossover``: the crossover and each mode's sustainable rate). A level lasts 600 s,
against a whole switch of about 424 s at the catalog's costs (4 x (40 s drain + 60 s
start-up) + dwell; measured 515 s, drains of 51 s, restarts of 62-67 s): at 240 s a switch that
starts in a level ends two levels later, and a level's score measured the switch.

Per level and over the whole ramp: goodput (output tokens of requests that met the SLO,
per simulated second), TPOT p50/p99 and TTFT p99 (simulated, as each server reports them
in SGLang's ``meta_info``: ``first_token_latency``, ``e2e_latency``), requests failed,
restarts made. Targets (printed, each met or not): every level's governed goodput >=
0.98x the better fleet; whole ramp >= 1.10x the worse; at the lightest level TPOT p50
within 5% of all-speculative; the load at which the governor first moved to plain within
15% of the crossover ``plan fleet`` predicts for the same fleet (requests in flight per
replica, and as a rate through Little's law with the all-speculative fleet's request
time at that level). It is a measurement: exit 0 unless ``--strict`` and a target misses.

    .venv/bin/python benchmarks/bench_fleet.py [--quick] [--output json] [--json FILE]
        [--kinds governed --baselines EARLIER.json]  # rerun the governed fleet only
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from specgov.controller.fleet.gateway import SmgGateway, launched_smg
from specgov.policies.control.fleet_mix import MOVE_TO_PLAIN_RESERVE
from specgov.simulator.planning.fleet import MixCrossover, mix_crossover
from specgov.simulator.server.replica import restart_replica, stop_replica

HOST = "127.0.0.1"
KINDS = ("governed", "all_spec", "all_plain")
GATEWAY_POLICY = "round_robin"
DEADLINE_S = 120.0  # any one wait for a process (wall)
HYSTERESIS = 0.10


@dataclass(frozen=True)
class Config:
    """One run's settings; rates and durations in simulated units (module docstring)."""

    speed: float = 10.0
    level_rates_rps: tuple[float, ...] = (2.0, 5.0, 8.0, 11.0, 14.0, 11.0, 8.0, 5.0, 2.0)
    # A level is long against a whole switch (4 x (drain + start-up) + 3 dwells, 424 s at
    # the catalog's 60 s start-up) so that a level's score is not one switch's cost.
    level_s: float = 600.0
    prompt_tokens: int = 256
    output_tokens: tuple[int, int] = (1536, 3072)  # uniform range
    tpot_slo_ms: float = 18.0
    ttft_slo_ms: float = 3000.0
    startup_s: float | None = None  # None: the catalog model's
    drain_s: float = 40.0  # expected drain (measured 40.5-41.5 s: the longest request)
    dwell_s: float = 8.0
    interval_s: float = 4.0  # the governor's decision interval
    rate_window_s: float = 60.0  # the arrivals each rate is read over
    forecast_window_s: float = 240.0
    # The ramp is a staircase: a line through a step projects it onward, and the rate
    # edge (policies/control/fleet_mix.py, band) already starts the switch in time.
    forecast: bool = False
    # The governor's --step-reserve; None: the CLI's default (1.5, from the Azure
    # conversation trace's 3-minute rises), not this ramp's own steps, so the bench does not
    # tell the governor what comes next.
    step_reserve: float | None = None
    seed: int = 0
    # The ramp plans 600 s x 66 req/s = 39600 (30000 cut the last three levels off).
    max_requests: int = 45000
    replicas: int = 4
    # The crossover and both modes' capacity; None: plan fleet's for this workload
    crossover: MixCrossover | None = None
    kinds: tuple[str, ...] = KINDS


QUICK = Config(
    speed=10.0,
    level_rates_rps=(2.0, 9.0, 16.0, 9.0, 2.0),
    level_s=80.0,
    output_tokens=(1536, 3072),
    tpot_slo_ms=18.0,
    startup_s=12.0,
    dwell_s=4.0,
    interval_s=2.0,
    rate_window_s=20.0,
    forecast_window_s=24.0,
    max_requests=4000,
    step_reserve=1.5,
)


@dataclass
class Outcome:
    level: int
    status: int
    tokens: int = 0
    ttft_s: float | None = None
    e2e_s: float | None = None


@dataclass
class FleetRun:
    kind: str
    outcomes: list[Outcome] = field(default_factory=list)
    audit: list[dict[str, Any]] = field(default_factory=list)
    wall_s: float = 0.0


# ------------------------------------------------------------------ processes


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def smg_binary() -> str:
    local = Path(sys.executable).parent / "smg"
    found = str(local) if local.is_file() else shutil.which("smg")
    if found is None:
        raise SystemExit("bench_fleet: smg is not installed (pip install -e '.[fleet]')")
    return found


def specgov_argv() -> list[str]:
    return [sys.executable, "-m", "specgov.controller.cli.main"]


def smg_gateway(
    urls: Sequence[str], metrics_port: int
) -> contextlib.AbstractContextManager[SmgGateway]:
    return launched_smg(
        smg_binary(),
        urls,
        port=free_port(),
        metrics_port=metrics_port,
        policy=GATEWAY_POLICY,
        host=HOST,
        healthy_within_s=DEADLINE_S,
    )


def sim_args(cfg: Config, seed: int) -> list[str]:
    return ["--speed", f"{cfg.speed:g}", "--seed", str(seed)]


@contextlib.contextmanager
def replicas(cfg: Config, modes: Sequence[str], run_dir: Path) -> Iterator[list[str]]:
    """The sim-servers, started in parallel by the shipped restart command's code (a first
    start, so without the restart's start-up); every one stopped on exit."""
    urls = [f"http://{HOST}:{free_port()}" for _ in modes]
    errors: list[BaseException] = []

    def start(i: int) -> None:
        try:
            restart_replica(
                f"r{i}", modes[i], urls[i], run_dir, sim_args=sim_args(cfg, i), startup_s="0"
            )
        except BaseException as exc:  # reported below, on the main thread
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(i,)) for i in range(len(modes))]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(DEADLINE_S)
        if errors:
            raise SystemExit(f"bench_fleet: a replica did not start: {errors[0]}")
        yield urls
    finally:
        for pid_file in run_dir.glob("*.pid"):
            stop_replica(pid_file)


def step_reserve(cfg: Config) -> float:
    """The governor's --step-reserve: the config's, else the CLI's default."""
    from specgov.controller.cli.fleet_cmd import STEP_RESERVE

    return STEP_RESERVE if cfg.step_reserve is None else cfg.step_reserve


def startup_s(cfg: Config) -> float:
    from specgov.simulator.catalog import Catalog
    from specgov.simulator.replay.runner import ServerSpec

    if cfg.startup_s is not None:
        return cfg.startup_s
    found = Catalog.load().model(ServerSpec().model).startup_s
    return 0.0 if found is None else found


def write_fleet_file(cfg: Config, urls: Sequence[str], gateway: str, run_dir: Path) -> Path:
    command = " ".join(specgov_argv()) + " fleet sim-restart {name} {mode} {url}"
    # In place: the catalog's start-up, not the loaded machine's process start (replica.py).
    command += f" --run-dir {run_dir} --startup-s {startup_s(cfg):g} --in-place -- "
    command += "--speed {speed}".format(speed=f"{cfg.speed:g}")
    fleet = {
        "gateway": gateway,
        "restart_command": command,
        "startup_timeout_s": DEADLINE_S,
        "drain_timeout_s": DEADLINE_S,
        "replicas": [{"name": f"r{i}", "url": url, "mode": "spec"} for i, url in enumerate(urls)],
    }
    path = run_dir / "fleet.json"  # JSON is YAML
    path.write_text(json.dumps(fleet, indent=2))
    return path


@contextlib.contextmanager
def governor(
    cfg: Config,
    fleet_file: Path,
    crossover: MixCrossover,
    audit: Path,
    wall_s: float,
    gateway_metrics: str,
) -> Iterator[None]:
    """``specgov fleet run`` for the ramp, in wall seconds (module docstring): the load is
    the arrival rate, so the crossover and capacities are plan fleet's rates per replica,
    per wall second (the simulated rate x the speed)."""
    s = cfg.speed
    argv = [*specgov_argv(), "fleet", "run", "--fleet", str(fleet_file), "--audit", str(audit)]
    # Arrivals counted at the gateway: the demand, even while a replica it marked
    # unhealthy gets none (measured: counts at the replicas fell to a third at 11 rps).
    argv += ["--load", "arrival-rate", "--rate-window-s", f"{cfg.rate_window_s / s:g}"]
    argv += ["--gateway-metrics", gateway_metrics]
    argv += ["--pays-up-to", f"{crossover.pays_up_to_rps * s:g}"]
    argv += ["--replica-capacity", f"{crossover.plain_rps * s:g}"]
    argv += ["--spec-capacity", f"{crossover.spec_rps * s:g}"]
    argv += ["--forecast" if cfg.forecast else "--no-forecast"]
    argv += ["--step-reserve", f"{step_reserve(cfg):g}"]
    argv += ["--hysteresis", str(HYSTERESIS), "--dwell-s", f"{cfg.dwell_s / s:g}"]
    argv += ["--interval-s", f"{cfg.interval_s / s:g}", "--duration-s", f"{wall_s:g}"]
    # The time a moved replica is out: its drain, then the start-up.
    argv += ["--restart-s", f"{(cfg.drain_s + startup_s(cfg)) / s:g}"]
    # The line is projected no further than its samples reach back (docs §11): a window
    # at least the time a whole switch takes, one replica at a time.
    window = max(cfg.forecast_window_s, cfg.replicas * (cfg.drain_s + startup_s(cfg)))
    argv += ["--forecast-window-s", f"{window / s:g}"]
    log = open(audit.with_suffix(".log"), "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(argv, stdout=log, stderr=log)
    try:
        yield
    finally:
        proc.send_signal(signal.SIGINT)  # it saves its state and stops between decisions
        try:
            proc.wait(DEADLINE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)
        log.close()


# ------------------------------------------------------------------ load


@dataclass(frozen=True)
class Planned:
    level: int
    arrival_s: float  # simulated, from the ramp's start
    output_tokens: int


def plan_requests(cfg: Config) -> list[Planned]:
    """The ramp's open-loop arrivals: Poisson at each level's rate, seeded, bounded."""
    rng = np.random.default_rng(cfg.seed)
    out: list[Planned] = []
    low, high = cfg.output_tokens
    for level, rate in enumerate(cfg.level_rates_rps):
        start, t = level * cfg.level_s, 0.0
        while True:
            t += float(rng.exponential(1.0 / rate))
            if t >= cfg.level_s or len(out) >= cfg.max_requests:
                break
            out.append(Planned(level, start + t, int(rng.integers(low, high + 1))))
    return out


def as_trace(cfg: Config, planned: Sequence[Planned]) -> Any:
    """The ramp as a trace, for the crossover plan fleet computes for this workload."""
    from specgov.simulator.workload.traces import Request, Trace

    t0 = planned[0].arrival_s
    reqs = tuple(Request(p.arrival_s - t0, cfg.prompt_tokens, p.output_tokens) for p in planned)
    return Trace("bench_fleet", reqs, "bench_fleet ramp")


async def _send(
    session: aiohttp.ClientSession, url: str, cfg: Config, p: Planned, at_wall: float
) -> Outcome:
    await asyncio.sleep(max(0.0, at_wall - time.monotonic()))
    body = {
        "text": "x" * (cfg.prompt_tokens * 4),  # the sim-server counts 4 characters a token
        "sampling_params": {"max_new_tokens": p.output_tokens, "ignore_eos": True},
    }
    try:
        async with session.post(f"{url}/generate", json=body) as r:
            if r.status != 200:
                await r.read()
                return Outcome(p.level, r.status)
            doc = await r.json()
    except (aiohttp.ClientError, TimeoutError):
        return Outcome(p.level, -1)
    meta = doc.get("meta_info", {})
    return Outcome(
        p.level,
        200,
        int(meta.get("completion_tokens", 0)),
        meta.get("first_token_latency"),
        meta.get("e2e_latency"),
    )


async def _drive(cfg: Config, gateway: str, planned: Sequence[Planned]) -> list[Outcome]:
    timeout = aiohttp.ClientTimeout(total=DEADLINE_S * 3)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        t0 = time.monotonic()
        tasks = [_send(session, gateway, cfg, p, t0 + p.arrival_s / cfg.speed) for p in planned]
        return list(await asyncio.gather(*tasks))


def run_fleet(
    kind: str, cfg: Config, planned: Sequence[Planned], crossover: MixCrossover, work: Path
) -> FleetRun:
    """One fleet under the ramp: governed (all speculative to begin with, the governor
    moves it) or fixed all_spec / all_plain."""
    run_dir = work / kind
    run_dir.mkdir(parents=True)
    modes = ["plain" if kind == "all_plain" else "spec"] * cfg.replicas
    ramp_wall_s = len(cfg.level_rates_rps) * cfg.level_s / cfg.speed
    run = FleetRun(kind)
    metrics_port = free_port()
    with replicas(cfg, modes, run_dir) as urls, smg_gateway(urls, metrics_port) as gw:
        audit = run_dir / "audit.jsonl"
        guard: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
        if kind == "governed":
            fleet_file = write_fleet_file(cfg, urls, gw.url, run_dir)
            metrics = f"http://{HOST}:{metrics_port}"
            guard = governor(cfg, fleet_file, crossover, audit, ramp_wall_s + DEADLINE_S, metrics)
        with guard:
            t0 = time.monotonic()
            run.outcomes = asyncio.run(_drive(cfg, gw.url, planned))
            run.wall_s = time.monotonic() - t0
            run.audit = _rows(audit, t0_epoch=time.time() - run.wall_s, speed=cfg.speed)
    return run


def _rows(path: Path, *, t0_epoch: float, speed: float) -> list[dict[str, Any]]:
    """The governor's audit rows, each with ``sim_s``: simulated seconds into the ramp."""
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    for row in rows:
        row["sim_s"] = (row["at_s"] - t0_epoch) * speed
    return rows


# ------------------------------------------------------------------ numbers


def _pct(values: Sequence[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def summarize(outcomes: Sequence[Outcome], cfg: Config, seconds: float) -> dict[str, Any]:
    """Goodput (tokens of requests within both SLOs, per simulated second), latencies
    (simulated ms), and how many requests failed (non-200 or cut short)."""
    tpots: list[float] = []
    ttfts: list[float] = []
    good_tokens = tokens = failed = 0
    for o in outcomes:
        if o.status != 200 or o.ttft_s is None or o.e2e_s is None or o.tokens < 2:
            failed += 1
            continue
        tpot_ms = (o.e2e_s - o.ttft_s) / (o.tokens - 1) * 1000.0
        ttft_ms = o.ttft_s * 1000.0
        tpots.append(tpot_ms)
        ttfts.append(ttft_ms)
        tokens += o.tokens
        if tpot_ms <= cfg.tpot_slo_ms and ttft_ms <= cfg.ttft_slo_ms:
            good_tokens += o.tokens
    return {
        "requests": len(outcomes),
        "failed": failed,
        "goodput_tok_s": good_tokens / seconds,
        "throughput_tok_s": tokens / seconds,
        "tpot_p50_ms": _pct(tpots, 50),
        "tpot_p99_ms": _pct(tpots, 99),
        "ttft_p99_ms": _pct(ttfts, 99),
    }


def _restarts(run: FleetRun, level: int | None, cfg: Config) -> int:
    rows = [r for r in run.audit if r["step"] == "restart"]
    if level is None:
        return len(rows)
    return sum(1 for r in rows if int(r["sim_s"] // cfg.level_s) == level)


def first_move_to_plain(run: FleetRun, *, reserve: bool = True) -> dict[str, Any] | None:
    """The governor's first move to plain; ``reserve=False``: its first crossover move
    (not a step-reserve move, which pre-positions a plain replica before the crossover)."""
    return next(
        (
            r
            for r in run.audit
            if r["step"] == "decide"
            and r["reason"].startswith("move_to_plain")
            and (reserve or r["reason"] != MOVE_TO_PLAIN_RESERVE)
        ),
        None,
    )


def _in_flight_per_replica(levels: list[dict[str, Any]], cfg: Config) -> list[tuple[float, float]]:
    """(rate, requests in flight per replica) of the all-speculative fleet on the way up,
    by Little's law (rate x mean request time)."""
    peak = int(np.argmax(cfg.level_rates_rps))
    out = []
    for lv in levels[: peak + 1]:
        spec = lv["all_spec"]
        if spec is None or spec["mean_e2e_s"] is None:
            continue
        out.append((lv["rate_rps"], lv["rate_rps"] * spec["mean_e2e_s"] / cfg.replicas))
    return out


def _rate_at(curve: list[tuple[float, float]], per_replica: float) -> float | None:
    """The rate at which the curve reaches ``per_replica`` in flight (linear between
    levels)."""
    for (r0, b0), (r1, b1) in itertools.pairwise(curve):
        if b0 <= per_replica <= b1 and b1 > b0:
            return r0 + (r1 - r0) * (per_replica - b0) / (b1 - b0)
    return None


def report(
    cfg: Config,
    runs: dict[str, FleetRun],
    crossover: MixCrossover,
    reused: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The JSON document; ``reused``: an earlier run's document (``--baselines``) whose
    fleets this run did not run are taken from it, said so under ``config``."""
    levels: list[dict[str, Any]] = []
    for i, rate in enumerate(cfg.level_rates_rps):
        level: dict[str, Any] = {"rate_rps": rate}
        for kind in KINDS:
            run = runs.get(kind)
            if run is None:
                level[kind] = None if reused is None else reused["levels"][i].get(kind)
                continue
            mine = [o for o in run.outcomes if o.level == i]
            doc = summarize(mine, cfg, cfg.level_s)
            e2e = [o.e2e_s for o in mine if o.e2e_s is not None and o.status == 200]
            doc["mean_e2e_s"] = float(np.mean(e2e)) if e2e else None
            doc["restarts"] = _restarts(run, i, cfg)
            level[kind] = doc
        levels.append(level)
    total: dict[str, Any] = {}
    seconds = len(cfg.level_rates_rps) * cfg.level_s
    for kind in KINDS:
        run = runs.get(kind)
        if run is None:
            if reused is not None and reused["total"].get(kind) is not None:
                total[kind] = reused["total"][kind]
            continue
        total[kind] = summarize(run.outcomes, cfg, seconds)
        total[kind]["restarts"] = _restarts(run, None, cfg)
        total[kind]["wall_s"] = run.wall_s
    config = {
        **asdict(cfg),
        "startup_s": startup_s(cfg),
        "step_reserve": step_reserve(cfg),
        "gateway_policy": GATEWAY_POLICY,
    }
    if reused is not None:
        config["reused_from_an_earlier_run"] = sorted(set(KINDS) - set(runs))
    return {
        "config": config,
        "crossover": crossover_doc(cfg, runs, levels, crossover),
        "levels": levels,
        "total": total,
        "targets": targets(levels, total, runs, crossover, cfg),
        "governed_moves": _move_rows(runs.get("governed")),
        "governed_move_times": move_times(runs.get("governed")),
    }


def move_times(run: FleetRun | None) -> list[dict[str, Any]]:
    """Each move's measured parts in simulated seconds: the drain (move started to drained)
    and the restart (the restart command run to the server healthy: the simulated start-up
    plus the new process's own start, which a busy machine stretches, times the speed)."""
    out: list[dict[str, Any]] = []
    started: dict[str, dict[str, float]] = {}
    for r in [] if run is None else run.audit:
        mine = started.setdefault(r["replica"], {})
        if r["reason"] in ("move_started", "no_requests_left", "server_healthy"):
            mine[r["reason"]] = r["sim_s"]
        elif r["step"] == "restart":
            mine.setdefault("restart", r["sim_s"])
        if r["step"] in ("done", "lost") or r["reason"] == "rolled_back":
            drain = _span(mine, "move_started", "no_requests_left")
            restart = _span(mine, "restart", "server_healthy")
            out.append({"replica": r["replica"], "drain_s": drain, "restart_s": restart})
            started[r["replica"]] = {}
    return out


def _span(marks: dict[str, float], a: str, b: str) -> float | None:
    return marks[b] - marks[a] if a in marks and b in marks else None


def _move_rows(run: FleetRun | None) -> list[dict[str, Any]]:
    """The governed fleet's audit rows of its moves (each move's decision and steps),
    with the simulated time; the hold decisions are left out (one every interval)."""
    if run is None:
        return []
    keep = ("sim_s", "replica", "step", "reason", "load_requests", "planned_load")
    return [
        {k: r.get(k) for k in keep}
        for r in run.audit
        if r["step"] != "decide" or r["reason"].startswith("move_")
    ]


def crossover_doc(
    cfg: Config,
    runs: dict[str, FleetRun],
    levels: list[dict[str, Any]],
    crossover: MixCrossover,
) -> dict[str, Any]:
    """Where plan fleet puts the crossover and where the governor first moved to plain.

    ``predicted_rate_rps`` (the target's): the rate at which the all-speculative fleet's
    measured requests in flight per replica reach plan fleet's crossover batch (Little's
    law on the measured request time); ``plan_fleet_crossover_rate_rps``: plan fleet's own
    rate (its per-token tables, no queueing), for comparison. The governor's load is the
    arrival rate it measured (per wall second; here per simulated second)."""
    doc: dict[str, Any] = {
        "plan_fleet_pays_up_to_per_replica": crossover.pays_up_to,
        "plan_fleet_replica_capacity": crossover.plain_capacity,
        "plan_fleet_spec_capacity": crossover.spec_capacity,
        "plan_fleet_crossover_rate_rps": crossover.pays_up_to_rps * cfg.replicas,
        "plan_fleet_spec_rps_per_replica": crossover.spec_rps,
        "plan_fleet_plain_rps_per_replica": crossover.plain_rps,
        "hysteresis": HYSTERESIS,
    }
    governed = runs.get("governed")
    curve = _in_flight_per_replica(levels, cfg)
    doc["predicted_rate_rps"] = _rate_at(curve, crossover.pays_up_to)
    # governor_switch (the target's): the first crossover move; governor_first_move: the
    # first move to plain of any reason, a step-reserve move included.
    for key, reserve in (("governor_switch", False), ("governor_first_move", True)):
        first = None if governed is None else first_move_to_plain(governed, reserve=reserve)
        if first is not None:
            doc[key] = _switch_doc(first, cfg, len(levels))
    return doc


def _switch_doc(row: dict[str, Any], cfg: Config, levels: int) -> dict[str, Any]:
    return {
        "sim_s": row["sim_s"],
        "reason": row["reason"],
        "offered_rate_rps": cfg.level_rates_rps[min(int(row["sim_s"] // cfg.level_s), levels - 1)],
        "rate_rps": row["load_requests"] / cfg.speed,
        "planned_rate_rps": row["planned_load"] / cfg.speed,
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b <= 0 else a / b


def targets(
    levels: list[dict[str, Any]],
    total: dict[str, Any],
    runs: dict[str, FleetRun],
    crossover: MixCrossover,
    cfg: Config,
) -> list[dict[str, Any]]:
    """The issue's targets, each with its measured value and whether it is met."""
    if any(lv[k] is None for lv in levels for k in KINDS) or set(total) != set(KINDS):
        return []
    out: list[dict[str, Any]] = []
    for i, lv in enumerate(levels):
        best = max(lv["all_spec"]["goodput_tok_s"], lv["all_plain"]["goodput_tok_s"])
        ratio = _ratio(lv["governed"]["goodput_tok_s"], best)
        out.append(
            {
                "target": f"level {i} ({lv['rate_rps']:g} rps): governed goodput >= 0.98x "
                "the better",
                "value": ratio,
                "met": ratio is not None and ratio >= 0.98,
            }
        )
    worse = min(total["all_spec"]["goodput_tok_s"], total["all_plain"]["goodput_tok_s"])
    ratio = _ratio(total["governed"]["goodput_tok_s"], worse)
    out.append(
        {
            "target": "whole ramp: governed goodput >= 1.10x the worse",
            "value": ratio,
            "met": ratio is not None and ratio >= 1.10,
        }
    )
    light = int(np.argmin(cfg.level_rates_rps))
    ratio = _ratio(
        levels[light]["governed"]["tpot_p50_ms"], levels[light]["all_spec"]["tpot_p50_ms"]
    )
    out.append(
        {
            "target": "lightest level: governed TPOT p50 within 5% of all-speculative",
            "value": ratio,
            "met": ratio is not None and abs(ratio - 1.0) <= 0.05,
        }
    )
    doc = crossover_doc(cfg, runs, levels, crossover)
    switch = doc.get("governor_switch")
    ratio = _ratio(None if switch is None else switch["rate_rps"], doc["predicted_rate_rps"])
    out.append(
        {
            "target": "governor's first move to plain within 15% of plan fleet's crossover rate",
            "value": ratio,
            "met": ratio is not None and abs(ratio - 1.0) <= 0.15,
        }
    )
    return out


def print_report(doc: dict[str, Any]) -> None:
    cfg = doc["config"]
    print(
        f"bench_fleet: {cfg['replicas']} sim-servers behind smg ({cfg['gateway_policy']}), speed "
        f"{cfg['speed']:g} (wall = simulated / {cfg['speed']:g}); a restart costs "
        f"{cfg['startup_s']:g} s simulated start-up; SLO TPOT <= {cfg['tpot_slo_ms']:g} ms, "
        f"TTFT <= {cfg['ttft_slo_ms']:g} ms (all numbers measured on the simulator)"
    )
    print(f"{'rate':>6} | " + " | ".join(f"{k:^34}" for k in KINDS))
    sub = f"{'goodput':>9} {'tpot50':>6} {'tpot99':>6} {'ttft99':>6} {'rst':>3}"
    print(f"{'rps':>6} | " + " | ".join(sub for _ in KINDS))

    def num(v: float | None) -> str:
        return f"{v:6.1f}" if v is not None else f"{'-':>6}"

    def cell(d: dict[str, Any] | None) -> str:
        if d is None:
            return f"{'-':>34}"
        lat = f"{num(d['tpot_p50_ms'])} {num(d['tpot_p99_ms'])} {num(d['ttft_p99_ms'])}"
        return f"{d['goodput_tok_s']:9.0f} {lat} {d['restarts']:3d}"

    for lv in doc["levels"]:
        print(f"{lv['rate_rps']:6g} | " + " | ".join(cell(lv[k]) for k in KINDS))
    print(f"{'total':>6} | " + " | ".join(cell(doc["total"].get(k)) for k in KINDS))
    print(f"crossover: {json.dumps(doc['crossover'])}")
    for m in doc.get("governed_move_times", []):
        drain, restart = num(m["drain_s"]), num(m["restart_s"])
        print(f"  move of {m['replica']}: drain {drain} s, restart {restart} s (simulated)")
    for t in doc["targets"]:
        value = "-" if t["value"] is None else f"{t['value']:.3f}"
        print(f"  [{'met' if t['met'] else 'MISSED'}] {t['target']}: {value}")


def crossover_for(cfg: Config, planned: Sequence[Planned]) -> MixCrossover:
    """plan fleet's crossover and both capacities for this workload and deployment."""
    from specgov.simulator.replay.runner import ServerSpec

    found = mix_crossover(as_trace(cfg, planned), ServerSpec(), tpot_ms=cfg.tpot_slo_ms)
    if found is None:
        raise SystemExit("bench_fleet: plan fleet has no per-token model for this deployment")
    return found


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a shorter ramp (under 3 minutes)")
    ap.add_argument("--output", choices=("table", "json"), default="table")
    ap.add_argument("--json", type=Path, default=None, help="also write the JSON here")
    ap.add_argument("--speed", type=float, default=None)
    ap.add_argument("--startup-s", type=float, default=None, help="simulated start-up")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kinds", default=",".join(KINDS), help="fleets to run (comma list)")
    ap.add_argument("--strict", action="store_true", help="exit 1 when a target misses")
    ap.add_argument(
        "--baselines",
        type=Path,
        default=None,
        help="an earlier run's --json with the same ramp: the fleets not in --kinds come "
        "from it (said so in the output's config)",
    )
    args = ap.parse_args(argv)
    cfg = QUICK if args.quick else Config()
    kinds = tuple(k for k in args.kinds.split(",") if k)
    if not set(kinds) <= set(KINDS):
        ap.error(f"--kinds: expected some of {','.join(KINDS)}")
    cfg = replace(cfg, seed=args.seed, kinds=kinds)
    if args.speed is not None:
        cfg = replace(cfg, speed=args.speed)
    if args.startup_s is not None:
        cfg = replace(cfg, startup_s=args.startup_s)
    reused = None if args.baselines is None else load_baselines(args.baselines, cfg)
    doc = run_bench(cfg, reused)
    if args.json is not None:
        args.json.write_text(json.dumps(doc, indent=2))
    if args.output == "json":
        print(json.dumps(doc, indent=2))
    else:
        print_report(doc)
    missed = any(not t["met"] for t in doc["targets"])
    return 1 if args.strict and missed else 0


RAMP_KEYS = ("speed", "level_rates_rps", "level_s", "prompt_tokens", "output_tokens",
             "tpot_slo_ms", "ttft_slo_ms", "seed", "max_requests", "replicas")  # fmt: skip


def load_baselines(path: Path, cfg: Config) -> dict[str, Any]:
    """An earlier run's document, refused unless its ramp is this one's."""
    try:
        doc = json.loads(path.read_text())
        theirs = doc["config"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        why = f"bench_fleet: --baselines {path}: not a bench_fleet JSON ({exc})"
        raise SystemExit(why) from None
    mine = json.loads(json.dumps(asdict(cfg)))
    differ = [k for k in RAMP_KEYS if theirs.get(k) != mine[k]]
    if differ:
        raise SystemExit(f"bench_fleet: --baselines {path}: another ramp ({', '.join(differ)})")
    return dict(doc)


def run_bench(cfg: Config, reused: dict[str, Any] | None = None) -> dict[str, Any]:
    planned = plan_requests(cfg)
    crossover = cfg.crossover if cfg.crossover is not None else crossover_for(cfg, planned)
    runs: dict[str, FleetRun] = {}
    with tempfile.TemporaryDirectory(prefix="bench_fleet_") as tmp:
        for kind in cfg.kinds:
            runs[kind] = run_fleet(kind, cfg, planned, crossover, Path(tmp))
    return report(cfg, runs, crossover, reused)


if __name__ == "__main__":
    raise SystemExit(main())
