"""CLI commands that run the daemon or talk to a running one.

Exit codes (documented in the README): 0 success; 1 the daemon stopped because a
task died, or a command failed; 2 bad usage or configuration; 3 the daemon is not
reachable.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import click

EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_UNREACHABLE = 3

DEFAULT_CONTROL_ADDR = "127.0.0.1:9465"


def _fail(message: str, code: int) -> NoReturn:
    click.echo(f"Error: {message}", err=True)
    sys.exit(code)


def _load(config_file: Path | None, overrides: dict[str, Any]) -> Any:
    from specgov.controller.config import ConfigError, load_config

    try:
        return load_config(config_file, overrides=overrides)
    except ConfigError as exc:
        _fail(str(exc), EXIT_USAGE)
    except OSError as exc:
        _fail(f"cannot read config {config_file}: {exc}", EXIT_USAGE)


def _configure_logging(fmt: str, level: str) -> None:
    handler = logging.StreamHandler()
    if fmt == "json":

        class _Json(logging.Formatter):
            def format(self, record: logging.LogRecord) -> str:
                return json.dumps(
                    {
                        "time": record.created,
                        "level": record.levelname,
                        "logger": record.name,
                        "message": record.getMessage(),
                    }
                )

        handler.setFormatter(_Json())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # One line per HTTP request from the scrape client is noise, not news.
    logging.getLogger("httpx").setLevel(logging.WARNING)


async def serve_daemon(
    config: Any, *, ready: Callable[[dict[str, Any]], None] | None = None
) -> int:
    """Run the daemon with its control API and metrics servers until stopped."""
    from aiohttp import web
    from prometheus_client import CollectorRegistry

    from specgov.controller.control_api import make_app
    from specgov.controller.daemon import Daemon
    from specgov.controller.own_metrics import metrics_app
    from specgov.controller.state_store import StateStore

    store = StateStore(config.state.db_path, open_now=False)
    registry = CollectorRegistry()
    config_file = config.source_path

    def reload_config() -> Any:
        from specgov.controller.config import load_config

        return load_config(config_file)

    daemon = Daemon(
        config,
        store=store,
        registry=registry,
        prior=_prior_for(config),
        config_loader=reload_config if config_file is not None else None,
    )
    token = None
    if config.control.token_env:
        token = os.environ.get(config.control.token_env) or None
    control = make_app(daemon, token=token, listen_host=config.control.listen.host)
    runners: list[web.AppRunner] = []
    bound: dict[str, Any] = {}
    for name, app, addr in (
        ("control", control, config.control.listen),
        ("metrics", metrics_app(registry), config.metrics.listen),
    ):
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, addr.host, addr.port)
        await site.start()
        runners.append(runner)
        sockets = getattr(site._server, "sockets", None) or []
        port = sockets[0].getsockname()[1] if sockets else addr.port
        bound[name] = f"{addr.host}:{port}"
    logging.getLogger("specgov.daemon").info(
        "specgov %s mode, policy %s, server %s, control %s, metrics %s",
        config.loop.mode,
        daemon.policy.name,
        config.server.url,
        bound["control"],
        bound["metrics"],
    )
    if ready is not None:
        ready(bound)
    try:
        return await daemon.run()
    finally:
        for runner in runners:
            await runner.cleanup()
        store.close()


def _prior_for(config: Any) -> Any:
    """The step-cost prior from the catalog entry of the deployment."""
    from specgov.controller.recommend import deployment_prior

    try:
        return deployment_prior(
            config.deployment.gpu, config.deployment.model, config.deployment.drafter
        )
    except ValueError as exc:
        _fail(f"deployment: {exc}", EXIT_USAGE)


@click.command("run")
@click.option("--config", "config_file", type=click.Path(path_type=Path), default=None)
@click.option("--server", default=None, help="SGLang base URL (server.url).")
@click.option("--spool-dir", type=click.Path(path_type=Path), default=None)
@click.option("--state-db", type=click.Path(path_type=Path), default=None)
@click.option("--control-addr", default=None, help="HOST:PORT of the control API.")
@click.option("--metrics-addr", default=None, help="HOST:PORT of the daemon's /metrics.")
@click.option("--mode", type=click.Choice(["observe", "plugin"]), default=None)
@click.option("--policy", default=None, help="Policy spec (policy.spec), e.g. goodput.")
def run_cmd(
    config_file: Path | None,
    server: str | None,
    spool_dir: Path | None,
    state_db: Path | None,
    control_addr: str | None,
    metrics_addr: str | None,
    mode: str | None,
    policy: str | None,
) -> None:
    """Run the daemon next to one SGLang server (flags override the config file)."""
    overrides: dict[str, Any] = {}
    for key, value in (
        ("server.url", server),
        ("spool.dir", str(spool_dir) if spool_dir else None),
        ("state.db_path", str(state_db) if state_db else None),
        ("control.listen", control_addr),
        ("metrics.listen", metrics_addr),
        ("loop.mode", mode),
        ("policy.spec", policy),
    ):
        if value is not None:
            overrides[key] = value
    config = _load(config_file, overrides)
    _configure_logging(config.log.format, config.log.level)
    try:
        code = asyncio.run(serve_daemon(config))
    except OSError as exc:
        _fail(f"cannot start: {exc}", EXIT_FAILED)
    except ValueError as exc:
        _fail(str(exc), EXIT_USAGE)
    sys.exit(code)


# ------------------------------------------------------------ client commands


def _client(control_addr: str | None) -> Any:
    from specgov.controller.control_client import ControlClient

    addr = control_addr or os.environ.get("SPECGOV_CONTROL_ADDR") or _config_control_addr()
    token = os.environ.get("SPECGOV_CONTROL_TOKEN")
    return ControlClient(addr, token=token or None)


def _config_control_addr() -> str:
    try:
        from specgov.controller.config import load_config

        cfg = load_config(None)
        return f"{cfg.control.listen.host}:{cfg.control.listen.port}"
    except ValueError:
        return DEFAULT_CONTROL_ADDR


def _call(fn: Callable[[], Any]) -> Any:
    from specgov.controller.control_client import (
        ControlAuthError,
        ControlClientError,
        ControlRequestError,
        DaemonUnreachableError,
    )

    try:
        return fn()
    except DaemonUnreachableError as exc:
        _fail(str(exc), EXIT_UNREACHABLE)
    except ControlAuthError as exc:
        _fail(str(exc), EXIT_FAILED)
    except ControlRequestError as exc:
        # The daemon refused the request as given (400: a slot the engine lacks, steps
        # outside a slot's candidates, a bad spec): bad usage.
        _fail(str(exc), EXIT_USAGE)
    except ControlClientError as exc:
        _fail(str(exc), EXIT_FAILED)


def _emit(data: Any, output: str, render: Callable[[Any], None]) -> None:
    if output == "json":
        click.echo(json.dumps(data, indent=2, sort_keys=True, default=str))
    else:
        render(data)


_control_option = click.option(
    "--control-addr",
    default=None,
    help="HOST:PORT of the daemon's control API (default: from the config, 127.0.0.1:9465).",
)
_output_option = click.option(
    "--output", type=click.Choice(["table", "json"]), default="table", show_default=True
)


def _table(title: str, columns: list[str], rows: list[list[Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for col in columns:
        table.add_column(col)
    for row in rows:
        table.add_row(*["-" if v is None else str(v) for v in row])
    Console(width=max(Console().width, 120)).print(table)


def _steps(table: dict[str, Any] | None) -> str:
    if not table:
        return "-"
    return ", ".join(f"bs>={slot}: {steps}" for slot, steps in table.get("slots", []))


@click.command("status")
@_control_option
@_output_option
def status_cmd(control_addr: str | None, output: str) -> None:
    """What the daemon is doing: policy, table per slot, telemetry, overrides."""
    client = _client(control_addr)
    data = _call(client.status)

    def render(s: dict[str, Any]) -> None:
        obs = s.get("observation") or {}
        last = s.get("last_decision") or {}
        policy = s.get("policy")
        if s.get("pinned"):
            policy = f"{policy} (operator pin; configured: {s.get('configured_policy')})"
        rec = s.get("recommendation") or {}
        rows: list[list[Any]] = [
            ["policy", policy],
            ["mode", s.get("mode")],
            ["server", s.get("server")],
            ["table", _steps(s.get("table"))],
            ["table age s", _round(s.get("table_age_s"))],
            ["last decision", f"{last.get('reason')}: {last.get('message')}" if last else None],
            ["decisions / published", f"{s.get('decisions')} / {s.get('tables_published')}"],
            ["running / queued", f"{obs.get('running')} / {obs.get('queued')}"],
            ["accept length", obs.get("accept_length")],
            ["throughput tok/s", obs.get("gen_throughput_tok_s")],
            ["TPOT p50 ms", obs.get("tpot_p50_ms")],
            ["overrides", len(s.get("overrides") or [])],
            ["restart recommendation", _recommendation_line(rec) if rec else "none"],
            ["errors", s.get("permanent_error") or s.get("last_scrape_error") or "none"],
        ]
        _table("specgov status", ["", "value"], rows)

    _emit(data, output, render)


def _recommendation_line(rec: dict[str, Any]) -> str:
    if rec.get("summary") is None:
        return str(rec.get("message") or "none")
    gain = rec.get("predicted_gain")
    gain_text = f", predicted {gain:+.1%}" if isinstance(gain, float) else ""
    return f"{rec['summary']} (from {rec.get('source')}{gain_text})"


def _round(v: Any) -> Any:
    return round(v, 1) if isinstance(v, float) else v


@click.command("decisions")
@_control_option
@_output_option
@click.option("--since", default=None, help="Only decisions newer than this duration (e.g. 10m).")
@click.option("--limit", type=click.IntRange(1, 1000), default=20, show_default=True)
def decisions_cmd(control_addr: str | None, output: str, since: str | None, limit: int) -> None:
    """The decision audit log, newest first, each with its reason."""
    since_s = None
    if since is not None:
        from specgov.controller.config import ConfigError, parse_duration

        try:
            since_s = time.time() - parse_duration(since, where="--since")
        except ConfigError as exc:
            _fail(str(exc), EXIT_USAGE)
    client = _client(control_addr)
    data = _call(lambda: client.decisions(since_s=since_s, limit=limit))

    def render(rows: Any) -> None:
        items = rows.get("decisions", rows) if isinstance(rows, dict) else rows
        _table(
            "decisions (newest first)",
            ["time", "reason", "published", "table after", "message"],
            [
                [
                    time.strftime("%H:%M:%S", time.localtime(r.get("time_s", 0))),
                    r.get("reason"),
                    r.get("published"),
                    _steps(r.get("table_after")),
                    r.get("message"),
                ]
                for r in items
            ],
        )

    _emit(data, output, render)


@click.group("override")
def override_group() -> None:
    """Operator overrides (clamped by the guardrails like any decision)."""


@override_group.command("set")
@_control_option
@_output_option
@click.option("--slot", type=click.IntRange(min=1), default=None, help="Batch-size slot.")
@click.option("--steps", type=click.IntRange(min=0), default=None)
@click.option("--disable", is_flag=True, help="Disable speculation in every slot.")
@click.option("--pin-policy", default=None, help="Pin a policy spec for the TTL.")
@click.option("--ttl", required=True, help="How long, e.g. 30m, 2h.")
@click.option("--reason", required=True, help="Why (recorded in the audit log).")
def override_set(
    control_addr: str | None,
    output: str,
    slot: int | None,
    steps: int | None,
    disable: bool,
    pin_policy: str | None,
    ttl: str,
    reason: str,
) -> None:
    """Set a slot's steps, disable speculation, or pin a policy, for a TTL."""
    client = _client(control_addr)
    data = _call(
        lambda: client.set_override(
            ttl=ttl, reason=reason, slot=slot, steps=steps, disable=disable, pin_policy=pin_policy
        )
    )
    _emit(data, output, lambda d: click.echo(f"override set: {json.dumps(d, default=str)}"))


@override_group.command("clear")
@_control_option
@click.option("--id", "override_id", default=None)
@click.option("--slot", type=click.IntRange(min=1), default=None)
@click.option("--all", "clear_all", is_flag=True)
def override_clear(
    control_addr: str | None, override_id: str | None, slot: int | None, clear_all: bool
) -> None:
    """Clear one override (--id), a slot's (--slot) or all (--all)."""
    if sum(x is not None and x is not False for x in (override_id, slot, clear_all or None)) != 1:
        _fail("give exactly one of --id, --slot, --all", EXIT_USAGE)
    client = _client(control_addr)
    data = _call(
        lambda: client.clear_override(override_id=override_id, slot=slot, clear_all=clear_all)
    )
    click.echo(f"cleared: {json.dumps(data, default=str)}")


@override_group.command("list")
@_control_option
@_output_option
def override_list(control_addr: str | None, output: str) -> None:
    """Active overrides."""
    client = _client(control_addr)
    data = _call(client.list_overrides)

    def render(d: Any) -> None:
        items = d.get("overrides", d) if isinstance(d, dict) else d
        _table(
            "overrides",
            ["id", "slot", "steps", "disable", "pin", "expires in s", "reason"],
            [
                [
                    o.get("id"),
                    o.get("slot"),
                    o.get("steps"),
                    o.get("disable_speculation"),
                    o.get("pin_policy"),
                    _round(o.get("expires_at_s", 0) - time.time()),
                    o.get("reason"),
                ]
                for o in items
            ],
        )

    _emit(data, output, render)


@click.group("policy")
def policy_group() -> None:
    """The running policy."""


@policy_group.command("list")
@_control_option
@_output_option
def policy_list(control_addr: str | None, output: str) -> None:
    """Known policy kinds and the current one."""
    client = _client(control_addr)
    _emit(_call(client.policies), output, lambda d: click.echo(json.dumps(d, indent=2)))


@policy_group.command("show")
@_control_option
@_output_option
def policy_show(control_addr: str | None, output: str) -> None:
    """The current policy."""
    client = _client(control_addr)
    _emit(_call(client.policy), output, lambda d: click.echo(json.dumps(d, indent=2)))


@policy_group.command("set")
@_control_option
@_output_option
@click.argument("spec")
def policy_set(control_addr: str | None, output: str, spec: str) -> None:
    """Switch the policy (e.g. `goodput:slo_tpot_ms=40`)."""
    client = _client(control_addr)
    _emit(_call(lambda: client.set_policy(spec)), output, lambda d: click.echo(json.dumps(d)))


@click.command("recommend")
@_control_option
@_output_option
def recommend_cmd(control_addr: str | None, output: str) -> None:
    """The latest restart recommendation (shape, candidates) with its predicted gain."""
    client = _client(control_addr)

    def render(rec: dict[str, Any]) -> None:
        shape = rec.get("shape") or {}
        launch = rec.get("launch") or {}
        rows: list[list[Any]] = [
            ["recommendation", _recommendation_line(rec)],
            ["algorithm", shape.get("algorithm")],
            [
                "steps / topk / draft tokens",
                "/".join(str(shape.get(k)) for k in ("num_steps", "topk", "num_draft_tokens"))
                if shape
                else None,
            ],
            ["launch flags", " ".join(launch.get("argv") or []) or None],
            ["applied", rec.get("applied") or "no"],
        ]
        _table("specgov recommend", ["", "value"], rows)

    _emit(_call(client.recommend), output, render)


COMMANDS = [
    run_cmd,
    status_cmd,
    decisions_cmd,
    override_group,
    policy_group,
    recommend_cmd,
]
