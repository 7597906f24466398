"""`specgov demo`: the whole system on one machine, no GPU.

The demo starts a simulated SGLang server (accelerated real time, SGLang's
endpoints and metric names, specgov's in-engine plugin on a spool directory) on a
free loopback port, starts the daemon against it in plugin mode with its control
API on the usual address (so `specgov status`, `specgov override set ...` and
`specgov decisions` work from another terminal), shows a live view, and ends
with a side-by-side summary: the live run against SGLang's built-in EMA replayed
on the same trace in the simulator. (`specgov sim-server`, the simulated server on its
own, is specgov.simulator.server.cli.)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from specgov.controller.daemon.config import SpecgovConfig
    from specgov.controller.daemon.runtime import Daemon
    from specgov.simulator.server.core import SimServer


def _free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


# ------------------------------------------------------------------- the demo


def _live_table(status: dict[str, Any], sim_state: dict[str, Any], recent: list[str]) -> Any:
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    from specgov.controller.cli.format import number, text, throughput
    from specgov.controller.daemon.server_speed import sim_speed

    obs = status.get("observation") or {}
    # The same conversion as `specgov status`: the daemon measures over its wall clock,
    # the status says how fast the simulated server runs (sim_speed).
    speed = sim_speed(status)
    head = Table.grid(padding=(0, 2))
    head.add_row(
        f"[b]sim time[/b] {number(sim_state.get('sim_time_s'), 0)} s",
        f"[b]running[/b] {number(obs.get('running'))}",
        f"[b]queued[/b] {number(obs.get('queued'))}",
        f"[b]accept len[/b] {number(obs.get('accept_length'), 2)}",
        f"[b]output[/b] {throughput(obs.get('gen_throughput_tok_s'), speed)}",
        f"[b]TPOT p50[/b] {number(obs.get('tpot_p50_ms'), 1)} ms",
    )
    pace = "real time" if speed is None else f"the server runs {speed:g}x real time"
    units = Text(
        f"tok/s simulated: output tokens per simulated second over the daemon's last scrape "
        f"window ({pace}); TPOT in simulated ms; accept len: tokens per verify, bonus "
        "included",
        style="dim",
    )
    slots = Table(
        title="step table per batch-size slot (published by specgov)", title_justify="left"
    )
    table = status.get("table") or {}
    pairs = table.get("slots") or []
    for slot, _ in pairs:
        slots.add_column(f"bs>={slot}", justify="right")
    if pairs:
        slots.add_row(*[str(steps) for _, steps in pairs])
    log = Table(title="decisions (newest last)", title_justify="left", show_header=False)
    log.add_column("decision")
    for line in recent[-6:]:
        log.add_row(Text(line))
    plugin = (sim_state.get("plugin") or {}).get("mode")
    footer = (
        f"policy {text(status.get('policy'))} | mode {text(status.get('mode'))} | "
        f"plugin {text(plugin)} | control API {text(status.get('_control'))} "
        "(try: specgov status, specgov decisions, "
        "specgov override set --slot 1 --steps 0 --ttl 2m --reason test)"
    )
    return Group(head, units, slots, log, Text(footer))


class _DemoStatus:
    """The daemon's status with the simulated server's speed (``sim_speed``) for the
    live view and `specgov status` from another terminal. A daemon that read the speed
    from the server's /server_info keeps its own; until it has one (or when it does not
    report it) the demo fills in the speed it launched the server at."""

    def __init__(self, daemon: Any, speed: float) -> None:
        self._daemon = daemon
        self._speed = speed

    def status(self) -> dict[str, Any]:
        from specgov.controller.daemon.server_speed import sim_speed

        data: dict[str, Any] = self._daemon.status()
        if sim_speed(data) is None:
            data["sim_speed"] = self._speed
        return data

    def __getattr__(self, name: str) -> Any:
        return getattr(self._daemon, name)


async def _run_demo(
    *,
    speed: float,
    control_addr: str,
    metrics_addr: str,
    workdir: Path,
    policy: str,
    refresh_s: float,
    trace: Any,
) -> list[Any]:
    from prometheus_client import CollectorRegistry

    from specgov.controller.cli.daemon_cmds import prior_for
    from specgov.controller.daemon.runtime import Daemon
    from specgov.controller.daemon.state_store import StateStore
    from specgov.simulator.replay.runner import ServerSpec
    from specgov.simulator.server.core import SimServer

    spool = workdir / "spool"
    sim = SimServer(trace, ServerSpec(), speed=speed, spool_dir=spool, port=_free_port())
    sim.start()
    sim.wait_ready(60)
    config = _demo_config(sim.url, spool, workdir, policy, control_addr, metrics_addr)
    store = StateStore(config.state.db_path)
    registry = CollectorRegistry()
    daemon = Daemon(config, store=store, registry=registry, prior=prior_for(config))
    service = _DemoStatus(daemon, speed)
    runners = await _serve_endpoints(config, service, registry)
    run_task = asyncio.create_task(daemon.run(install_signals=False))
    try:
        await _watch(sim, service, daemon, run_task, control_addr, refresh_s)
    finally:
        daemon.request_stop()
        with contextlib.suppress(Exception):
            await run_task
        for runner in runners:
            await runner.cleanup()
        store.close()
        sim.stop()
    results: list[Any] = sim.results()
    return results


def _demo_config(
    url: str,
    spool: Path,
    workdir: Path,
    policy: str,
    control_addr: str,
    metrics_addr: str,
) -> SpecgovConfig:
    """The daemon's configuration for the demo: plugin mode on the simulated server,
    everything it writes in the work folder, quick loops."""
    from specgov.controller.daemon.config import load_config

    return load_config(
        None,
        overrides={
            "server.url": url,
            "spool.dir": str(spool),
            "state.db_path": str(workdir / "state.db"),
            "loop.mode": "plugin",
            "policy.spec": policy,
            "loop.scrape_interval_s": 1,
            "loop.decide_interval_s": 2,
            "control.listen": control_addr,
            "metrics.listen": metrics_addr,
        },
    )


async def _serve_endpoints(
    config: SpecgovConfig, service: _DemoStatus, registry: CollectorRegistry
) -> list[Any]:
    """The control API and the metrics endpoint, as the daemon serves them."""
    from specgov.adapters.http_listener import serve
    from specgov.controller.daemon.config import load_config
    from specgov.controller.daemon.control_api import make_app
    from specgov.controller.daemon.control_token import daemon_token
    from specgov.controller.daemon.own_metrics import metrics_app

    # The token file where `specgov override set` in another terminal looks for it (the
    # default config's, not the work folder's): steering the demo needs it like a daemon.
    token = daemon_token(config.control.token_env, load_config(None).control_token_path, os.environ)
    control = make_app(
        service,
        token=token,
        listen_host=config.control.listen.host,
        open_reads_on_loopback=True,
    )
    runners = []
    for name, app, addr in (
        ("control", control, config.control),
        ("metrics", metrics_app(registry), config.metrics),
    ):
        runner, _ = await serve(app, addr.listen.host, addr.listen.port, name=name)
        runners.append(runner)
    return runners


async def _watch(
    sim: SimServer,
    service: _DemoStatus,
    daemon: Daemon,
    run_task: asyncio.Task[int],
    control_addr: str,
    refresh_s: float,
) -> None:
    """The live view (status, server state, the newest decisions) until the trace is
    done or the daemon stops."""
    from rich.console import Console
    from rich.live import Live

    from specgov.controller.cli.format import clock, decision_summary

    seen = 0
    recent: list[str] = []
    with Live(console=Console(), refresh_per_second=4, transient=False) as live:
        while not run_task.done():
            state = sim.state()
            status = service.status()
            status["_control"] = control_addr
            rows = daemon.decisions(None, 50)[::-1]
            for r in rows[seen:] if len(rows) > seen else []:
                stamp = clock(r["time_s"], time.time())
                recent.append(f"{stamp} {r['reason']}: {decision_summary(r['message'])}")
            seen = len(rows)
            live.update(_live_table(status, state, recent))
            if sim.results():
                break
            await asyncio.sleep(refresh_s)


def trace_phases(spec: Any) -> list[tuple[str, float, float]]:
    """(name, start_s, end_s) of a synthetic spec's content phases, each named after its
    heaviest domain ("code", "chat", ...)."""
    out: list[tuple[str, float, float]] = []
    start = 0.0
    for i, ph in enumerate(spec.phases or ()):
        name = max(ph.domains, key=lambda d: ph.domains[d])
        if any(name == n for n, _, _ in out):
            name = f"{name} #{i + 1}"  # the same domain again: a phase of its own
        out.append((name, start, start + ph.duration_s))
        start += ph.duration_s
    return out


def _change(new: float, old: float) -> str:
    """A relative change in plain words: "+12.3 %" or "-4.0 %" (or "n/a" without a base)."""
    return "n/a" if old <= 0 else f"{new / old - 1.0:+.1%}"


def headline(goodput: dict[str, float], by_phase: dict[str, dict[str, int]], live: str) -> str:
    """One plain line: what the live run gained over sglang-ema and over no speculation,
    overall and in the phase where it gained most over sglang-ema."""
    g, ema, none = goodput[live], goodput["sglang-ema"], goodput["none"]
    line = (
        f"specgov's goodput: {_change(g, ema)} vs SGLang's EMA and {_change(g, none)} vs no "
        "speculation over the whole trace"
    )
    phases = [
        (p, t) for p, t in by_phase.get(live, {}).items() if by_phase["sglang-ema"].get(p, 0) > 0
    ]
    if phases:
        best, tokens = max(phases, key=lambda pt: pt[1] / by_phase["sglang-ema"][pt[0]])
        line += (
            f"; most in the {best} phase: {_change(tokens, by_phase['sglang-ema'][best])} vs "
            f"EMA, {_change(tokens, by_phase['none'].get(best, 0))} vs no speculation"
        )
    return line + "."


_DEMO_COLUMNS = (
    "tok/s",
    "goodput tok/s",
    "vs ema",
    "SLO %",
    "TPOT p50 ms",
    "TPOT p99 ms",
    "TTFT p99 ms",
)


def _summary(live_results: list[Any], trace: Any, spec: Any = None) -> None:
    from rich.console import Console

    from specgov.controller.cli.format import goodput_legend, overload_note, summary_table
    from specgov.simulator.replay.metrics import Slo, good_tokens_by_window, summarise
    from specgov.simulator.replay.runner import ServerSpec, replay

    slo = Slo()
    rows = []
    if live_results:
        rows.append(summarise("specgov (live, goodput)", live_results[0], slo))
    click.echo(
        f"replaying the same {len(trace.requests):,} requests in the simulator with SGLang's "
        "built-in EMA and with no speculation, for comparison ..."
    )
    report = replay(trace, ServerSpec(), ["sglang-ema", "none"], slo=slo)
    rows.extend(run.summary for run in report.runs)
    base = next(r for r in rows if r["name"] == "sglang-ema")
    caption = goodput_legend(
        {"tpot_ms": slo.tpot_ms, "ttft_ms": slo.ttft_ms}, baseline="sglang-ema"
    )
    caption += (
        " Means over the whole trace, in simulated time (the live view shows the last seconds)."
    )
    table = summary_table(
        rows,
        base,
        name_header="run",
        columns=_DEMO_COLUMNS,
        title=f"same trace, side by side (SLO TPOT {slo.tpot_ms:g} ms)",
        caption=caption,
    )
    console = Console(width=max(Console().width, 110))
    overload = overload_note(rows)
    if overload is not None:
        console.print(overload, style="bold red", markup=False, highlight=False)
    console.print(table)
    if not live_results:
        click.echo("(the live run was interrupted before the trace finished: no live row)")
        return
    # The headline: good tokens by the content phase the requests arrived in (each run's
    # arrivals measured from its first one, as the trace's are from its first request).
    windows = trace_phases(spec) if spec is not None else []
    t0 = trace.requests[0].arrival_s if trace.requests else 0.0
    results = {rows[0]["name"]: live_results[0]}
    results.update({run.policy.name: run.result for run in report.runs})
    by_phase = {
        name: good_tokens_by_window(r, slo, windows, offset_s=t0 - r.first_arrival_s)
        for name, r in results.items()
    }
    goodput = {r["name"]: float(r["goodput_tok_s"]) for r in rows}
    click.echo(headline(goodput, by_phase, rows[0]["name"]))


@click.command("demo")
@click.option(
    "--speed",
    type=click.FloatRange(min=0.1),
    default=10.0,
    show_default=True,
    help="Simulated seconds per wall second (the trace is 10 simulated minutes).",
)
@click.option("--control-addr", default="127.0.0.1:9465", show_default=True)
@click.option("--metrics-addr", default="127.0.0.1:9464", show_default=True)
@click.option("--policy", default="goodput", show_default=True)
@click.option(
    "--workdir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Where the spool and state database go (default: a temporary folder).",
)
def demo_cmd(
    speed: float, control_addr: str, metrics_addr: str, policy: str, workdir: Path | None
) -> None:
    """Live demo: a simulated SGLang server with a content- and load-shifting trace,
    the specgov daemon driving it, and a side-by-side summary against SGLang's EMA."""
    from specgov.controller.daemon.config_values import ConfigError, parse_listen_address
    from specgov.policies.daemon.spec import PolicySpecError, parse_policy_spec

    # Bad options fail before anything starts (exit 2, the README's code for bad usage).
    try:
        parse_policy_spec(policy)
    except PolicySpecError as exc:
        raise click.BadParameter(str(exc), param_hint="--policy") from None
    for flag, addr in (("--control-addr", control_addr), ("--metrics-addr", metrics_addr)):
        try:
            parse_listen_address(addr, where=flag)
        except ConfigError as exc:
            raise click.BadParameter(str(exc), param_hint=flag) from None
    logging.getLogger().setLevel(logging.WARNING)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    tmp = None
    if workdir is None:
        tmp = tempfile.TemporaryDirectory(prefix="specgov-demo-")
        workdir = Path(tmp.name)
    workdir.mkdir(parents=True, exist_ok=True)
    from specgov.simulator.workload.synthetic import DEFAULT_DEMO_SPEC, generate_trace

    trace = generate_trace(DEFAULT_DEMO_SPEC)
    span_s = trace.requests[-1].arrival_s - trace.requests[0].arrival_s if trace.requests else 0.0
    click.echo(
        f"starting a simulated SGLang server (H100, Llama-3.1-8B + EAGLE-3, {speed:g}x real "
        f"time) replaying {len(trace.requests):,} requests over {span_s / 60:.0f} simulated "
        f"minutes (about {span_s / speed:.0f} s here), and the specgov daemon "
        f"(policy {policy}) ..."
    )
    try:
        results = asyncio.run(
            _run_demo(
                speed=speed,
                control_addr=control_addr,
                metrics_addr=metrics_addr,
                workdir=workdir,
                policy=policy,
                refresh_s=0.5,
                trace=trace,
            )
        )
        # The live view's last frame stays on screen; the summary starts on a new line.
        click.echo()
        _summary(results, trace, DEFAULT_DEMO_SPEC)
    except KeyboardInterrupt:
        click.echo("\ninterrupted; stopped cleanly")
    except OSError as exc:
        raise click.ClickException(
            f"{exc} (is another specgov using {control_addr} or {metrics_addr}? "
            "pass --control-addr/--metrics-addr)"
        ) from None
    finally:
        if tmp is not None:
            tmp.cleanup()
