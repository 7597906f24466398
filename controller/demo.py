"""`specgov demo`: the whole system on one machine, no GPU.

The demo starts a simulated SGLang server (accelerated real time, SGLang's
endpoints and metric names, specgov's in-engine plugin on a spool directory) on a
free loopback port, starts the daemon against it in plugin mode with its control
API on the usual address (so `specgov status`, `specgov override set ...` and
`specgov decisions` work from another terminal), shows a live view, and ends
with a side-by-side summary: the live run against SGLang's built-in EMA replayed
on the same trace in the simulator. (`specgov sim-server`, the simulated server on its
own, is specgov.simulator.sim_cli.)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

import click


def _free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


# ------------------------------------------------------------------- the demo


def _live_table(status: dict[str, Any], sim_state: dict[str, Any], recent: list[str]) -> Any:
    from rich.console import Group
    from rich.table import Table

    obs = status.get("observation") or {}
    head = Table.grid(padding=(0, 2))
    head.add_row(
        f"[b]sim time[/b] {sim_state.get('sim_time_s', 0):6.0f} s",
        f"[b]running[/b] {obs.get('running')}",
        f"[b]queued[/b] {obs.get('queued')}",
        f"[b]accept len[/b] {obs.get('accept_length')}",
        f"[b]tok/s[/b] {obs.get('gen_throughput_tok_s')}",
        f"[b]TPOT p50 ms[/b] {obs.get('tpot_p50_ms')}",
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
        log.add_row(line)
    plugin = (sim_state.get("plugin") or {}).get("mode")
    footer = (
        f"policy {status.get('policy')} | mode {status.get('mode')} | plugin {plugin} | "
        f"control API {status.get('_control')} (try: specgov status, specgov decisions, "
        "specgov override set --slot 1 --steps 0 --ttl 2m --reason test)"
    )
    return Group(head, slots, log, footer)


async def _run_demo(
    *,
    speed: float,
    control_addr: str,
    metrics_addr: str,
    workdir: Path,
    policy: str,
    refresh_s: float,
) -> tuple[list[Any], Any]:
    from rich.console import Console
    from rich.live import Live

    from specgov.controller.config import load_config
    from specgov.controller.daemon_cmds import _prior_for
    from specgov.controller.state_store import StateStore
    from specgov.simulator.replay import ServerSpec
    from specgov.simulator.sim_server import SimServer
    from specgov.simulator.synthetic import DEFAULT_DEMO_SPEC, generate_trace

    trace = generate_trace(DEFAULT_DEMO_SPEC)
    spool = workdir / "spool"
    sim = SimServer(trace, ServerSpec(), speed=speed, spool_dir=spool, port=_free_port())
    sim.start()
    sim.wait_ready(60)
    config = load_config(
        None,
        overrides={
            "server.url": sim.url,
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
    from aiohttp import web
    from prometheus_client import CollectorRegistry

    from specgov.controller.control_api import make_app
    from specgov.controller.daemon import Daemon
    from specgov.controller.own_metrics import metrics_app

    store = StateStore(config.state.db_path)
    registry = CollectorRegistry()
    daemon = Daemon(config, store=store, registry=registry, prior=_prior_for(config))
    runners = []
    for app, addr in (
        (make_app(daemon, token=None, listen_host=config.control.listen.host), config.control),
        (metrics_app(registry), config.metrics),
    ):
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, addr.listen.host, addr.listen.port).start()
        runners.append(runner)
    run_task = asyncio.create_task(daemon.run(install_signals=False))
    console = Console()
    seen = 0
    recent: list[str] = []
    try:
        with Live(console=console, refresh_per_second=4, transient=False) as live:
            while not run_task.done():
                state = sim.state()
                status = daemon.status()
                status["_control"] = control_addr
                rows = daemon.decisions(None, 50)[::-1]
                for r in rows[seen:] if len(rows) > seen else []:
                    stamp = time.strftime("%H:%M:%S", time.localtime(r["time_s"]))
                    recent.append(f"{stamp} {r['reason']}: {r['message'][:110]}")
                seen = len(rows)
                live.update(_live_table(status, state, recent))
                if sim.results():
                    break
                await asyncio.sleep(refresh_s)
    finally:
        daemon.request_stop()
        with contextlib.suppress(Exception):
            await run_task
        for runner in runners:
            await runner.cleanup()
        store.close()
        sim.stop()
    return sim.results(), trace


def _summary(live_results: list[Any], trace: Any) -> None:
    from rich.console import Console
    from rich.table import Table

    from specgov.simulator.metrics import Slo, summarise
    from specgov.simulator.replay import ServerSpec, replay

    slo = Slo()
    rows = []
    if live_results:
        rows.append(summarise("specgov (live, goodput)", live_results[0], slo))
    click.echo("replaying the same trace with SGLang's built-in EMA for comparison ...")
    report = replay(trace, ServerSpec(), ["sglang-ema", "none"], slo=slo)
    rows.extend(run.summary for run in report.runs)
    base = next(r for r in rows if r["name"] == "sglang-ema")
    table = Table(title="same trace, side by side (SLO TPOT 50 ms)", title_justify="left")
    for col in ("run", "tok/s", "goodput", "vs ema", "TPOT p50 ms", "TPOT p99 ms", "TTFT p99 ms"):
        table.add_column(col, justify="left" if col == "run" else "right")
    for r in rows:
        table.add_row(
            r["name"],
            f"{r['throughput_tok_s']:,.0f}",
            f"{r['goodput_tok_s']:,.0f}",
            f"{r['goodput_tok_s'] / base['goodput_tok_s']:.3f}x" if base["goodput_tok_s"] else "-",
            f"{r['tpot_ms']['p50']:.2f}",
            f"{r['tpot_ms']['p99']:.2f}",
            f"{r['ttft_ms']['p99']:,.0f}",
        )
    Console(width=max(Console().width, 110)).print(table)
    if not live_results:
        click.echo("(the live run was interrupted before the trace finished: no live row)")


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
    logging.getLogger().setLevel(logging.WARNING)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    tmp = None
    if workdir is None:
        tmp = tempfile.TemporaryDirectory(prefix="specgov-demo-")
        workdir = Path(tmp.name)
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        results, trace = asyncio.run(
            _run_demo(
                speed=speed,
                control_addr=control_addr,
                metrics_addr=metrics_addr,
                workdir=workdir,
                policy=policy,
                refresh_s=0.5,
            )
        )
        _summary(results, trace)
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
