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

from specgov.controller.cli import options as opt
from specgov.controller.cli.policy_help import kinds_help

EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_UNREACHABLE = 3

DEFAULT_CONTROL_ADDR = "127.0.0.1:9465"

# Built once at import from a dict of strings (no policy code is imported for it).
_POLICY_KINDS = kinds_help(replay=False)


def _fail(message: str, code: int) -> NoReturn:
    click.echo(f"Error: {message}", err=True)
    sys.exit(code)


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


def prior_for(config: Any) -> Any:
    """The step-cost prior from the catalog entry of the deployment (exit 2 without one)."""
    from specgov.controller.daemon.serve import deployment_prior_of

    try:
        return deployment_prior_of(config)
    except ValueError as exc:
        _fail(str(exc), EXIT_USAGE)


# `specgov run`'s flags and the config keys they set (flags win over the file and the
# environment, config.py).
RUN_FLAG_KEYS: dict[str, str] = {
    "server": "server.url",
    "spool_dir": "spool.dir",
    "state_db": "state.db_path",
    "control_addr": "control.listen",
    "metrics_addr": "metrics.listen",
    "mode": "loop.mode",
    "policy": "policy.spec",
}


def run_overrides(params: dict[str, Any]) -> dict[str, Any]:
    """The config overrides of `specgov run`'s parsed flags (``ctx.params``): the flags
    given, each as its config key."""
    return {
        key: str(params[name]) if isinstance(params[name], Path) else params[name]
        for name, key in RUN_FLAG_KEYS.items()
        if params.get(name) is not None
    }


@click.command("run")
@opt.config_option()
@click.option("--server", default=None, help="SGLang base URL (server.url).")
@click.option(
    "--spool-dir",
    type=click.Path(path_type=Path),
    default=None,
    help="Directory shared with the plugin (spool.dir; SPECGOV_SPOOL_DIR of the server).",
)
@click.option(
    "--state-db", type=click.Path(path_type=Path), default=None, help="SQLite state store."
)
@click.option("--control-addr", default=None, help="HOST:PORT of the control API.")
@click.option("--metrics-addr", default=None, help="HOST:PORT of the daemon's /metrics.")
@click.option(
    "--mode",
    type=click.Choice(["observe", "plugin"]),
    default=None,
    help="observe: decide and record, publish nothing; plugin: publish step tables.",
)
@click.option("--policy", default=None, help=f"Policy spec (policy.spec): {_POLICY_KINDS}.")
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
    from specgov.controller.daemon.serve import freeze_startup_heap, serve_daemon

    config = opt.load_config_file(config_file, run_overrides(click.get_current_context().params))
    _configure_logging(config.log.format, config.log.level)
    try:
        code = asyncio.run(serve_daemon(config, ready=freeze_startup_heap))
    except OSError as exc:
        _fail(f"cannot start: {exc}", EXIT_FAILED)
    except ValueError as exc:
        _fail(str(exc), EXIT_USAGE)
    sys.exit(code)


# ------------------------------------------------------------ client commands


def _control_addr(control_addr: str | None) -> str:
    return control_addr or os.environ.get("SPECGOV_CONTROL_ADDR") or _config_control_addr()


def _client(control_addr: str | None, timeout_s: float = 5.0) -> Any:
    from specgov.controller.cli.control_client import ControlAddressError, ControlClient

    try:
        return ControlClient(
            _control_addr(control_addr), token=_client_token(), timeout_s=timeout_s
        )
    except ControlAddressError as exc:
        _fail(str(exc), EXIT_USAGE)


def _client_config() -> Any:
    """The effective configuration (defaults < SPECGOV_<GROUP>__<KEY>), as the daemon of
    this user would see it without a file; None when the environment does not load."""
    from specgov.controller.daemon.config import load_config

    try:
        return load_config(None)
    except ValueError:
        return None


def _client_token() -> str | None:
    """The control token to send: $SPECGOV_CONTROL_TOKEN (control.token_env), else the
    daemon's token file when this user can read it (controller/daemon/control_token.py)."""
    from specgov.controller.daemon.control_token import TokenFileError, client_token

    cfg = _client_config()
    if cfg is None:
        return os.environ.get("SPECGOV_CONTROL_TOKEN") or None
    try:
        return client_token(cfg.control.token_env, cfg.control_token_path, os.environ)
    except TokenFileError as exc:
        # Reading needs no token on loopback; a mutating request then answers 401.
        click.echo(f"Warning: not sending a control token: {exc}", err=True)
        return None


def _config_control_addr() -> str:
    cfg = _client_config()
    if cfg is None:
        return DEFAULT_CONTROL_ADDR
    return f"{cfg.control.listen.host}:{cfg.control.listen.port}"


def _call(fn: Callable[[], Any]) -> Any:
    from specgov.controller.cli.control_client import (
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


def _ask(control_addr: str | None, request: Callable[[Any], Any]) -> Any:
    """``request(client)``: one request to the daemon at *control_addr* (_control_addr),
    a bad address or a failed request one line on stderr and its exit code."""
    client = _client(control_addr)
    return _call(lambda: request(client))


def _emit(data: Any, output: str, render: Callable[[Any], None]) -> None:
    if output == "json":
        click.echo(json.dumps(data, indent=2, sort_keys=True, default=str))
    else:
        render(data)


# Every command that asks the daemon: where it listens, and how to print its answer.
_client_options = opt.compose(
    click.option(
        "--control-addr",
        default=None,
        help="HOST:PORT of the daemon's control API (default: $SPECGOV_CONTROL_ADDR, "
        "else the config's control.listen, 127.0.0.1:9465).",
    ),
    opt.output_option(
        "A table for people, or the daemon's JSON (exact values, epoch seconds) for scripts."
    ),
)


def _slot_option(help: str) -> Callable[[Any], Any]:
    """``--slot N``: a batch-size slot by its lower bound (none by default)."""
    return click.option("--slot", type=click.IntRange(min=1), default=None, help=help)


_verbose_option = click.option(
    "--verbose",
    "-v",
    is_flag=True,
    help="Full decision messages (the inner policy's per-slot detail) instead of one line.",
)


def _table(
    title: str, columns: list[str], rows: list[list[Any]], caption: str | None = None
) -> None:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    from specgov.controller.cli.format import text

    table = Table(title=title, title_justify="left", caption=caption, caption_justify="left")
    for col in columns:
        table.add_column(col, overflow="fold")
    for row in rows:
        # Text(), not markup: values such as "[256]" print as written.
        table.add_row(*[Text(text(v)) for v in row])
    Console(width=max(Console().width, 120)).print(table)


def _errors(s: dict[str, Any]) -> str:
    errors = [
        f"{label}: {s[key]}"
        for key, label in (
            ("permanent_error", "stopped acting"),
            ("last_scrape_error", "scrape"),
            ("store_error", "state store"),
            ("spool_error", "spool"),
        )
        if s.get(key)
    ]
    return "; ".join(errors) or "none"


def _decision_line(row: dict[str, Any], now_s: float, verbose: bool) -> str:
    from specgov.controller.cli.format import clock, decision_summary, humanize_epochs

    message = humanize_epochs(str(row.get("message") or ""), now_s)
    detail = message if verbose else decision_summary(message)
    return f"{clock(row.get('time_s'), now_s)} {row.get('reason')}: {detail}"


@click.command("status")
@_client_options
@_verbose_option
def status_cmd(control_addr: str | None, output: str, verbose: bool) -> None:
    """What the daemon is doing: policy, table per slot, telemetry, overrides."""
    data = _ask(control_addr, lambda client: client.status())

    def render(s: dict[str, Any]) -> None:
        from specgov.controller.cli.format import (
            duration,
            number,
            relative,
            table_slots,
            throughput,
        )
        from specgov.controller.daemon.server_speed import sim_speed

        now = time.time()
        obs = s.get("observation") or {}
        last = s.get("last_decision") or {}
        policy = s.get("policy")
        if s.get("pinned"):
            policy = f"{policy} (operator pin; configured: {s.get('configured_policy')})"
        rec = s.get("recommendation") or {}
        table = s.get("table") or {}
        age = s.get("table_age_s")
        ttl = table.get("ttl_s")
        if table and isinstance(age, int | float) and isinstance(ttl, int | float):
            left = ttl - age
            expiry = f"expires in {duration(left)}" if left > 0 else "expired: plugin on fallback"
            age_text = f"{duration(age)} (TTL {duration(ttl)}, {expiry})"
        else:
            age_text = duration(age) if table else "no table published"
        scrape_age = s.get("last_scrape_age_s")
        rows: list[list[Any]] = [
            ["policy", policy],
            ["mode", s.get("mode")],
            ["server", s.get("server")],
            ["uptime", duration(s.get("uptime_s"))],
            ["table", table_slots(table) + (f" (v{table['version']})" if table else "")],
            ["table age", age_text],
            ["last decision", _decision_line(last, now, verbose) if last else "none yet"],
            ["decisions / published", f"{s.get('decisions')} / {s.get('tables_published')}"],
            [
                "last scrape",
                "never" if scrape_age is None else relative(now - scrape_age, now),
            ],
            [
                "running / queued requests",
                f"{number(obs.get('running'))} / {number(obs.get('queued'))}",
            ],
            ["accept length (tokens/verify)", number(obs.get("accept_length"), 2)],
            [
                "throughput (last window)",
                throughput(obs.get("gen_throughput_tok_s"), sim_speed(s)),
            ],
            ["TPOT p50", number(obs.get("tpot_p50_ms"), 1, "ms")],
            ["ITL p99", number(obs.get("itl_p99_ms"), 1, "ms")],
            ["overrides", _overrides_line(s.get("overrides") or [], now, s.get("override_slots"))],
            ["restart recommendation", _recommendation_line(rec) if rec else "none"],
            ["errors", _errors(s)],
            ["health", "; ".join(str(r) for r in s.get("health") or []) or "ready"],
        ]
        notes = s.get("notes") or []
        if notes:
            rows.append(["notes", "; ".join(str(n) for n in notes)])
        _table("specgov status", ["", "value"], rows)

    _emit(data, output, render)


def _overrides_line(
    items: list[dict[str, Any]], now_s: float, slots_of: dict[str, list[int]] | None = None
) -> str:
    if not items:
        return "none"
    return "; ".join(_override_text(o, now_s, slots_of) for o in items)


def _override_text(
    o: dict[str, Any], now_s: float, slots_of: dict[str, list[int]] | None = None
) -> str:
    """What the override does to the table now: a slot's own override wins over an
    every-slot one (``slots_of``: the daemon's override id -> slots it sets)."""
    from specgov.controller.cli.format import instant

    if o.get("pin_policy"):
        what = f"policy pinned to {o['pin_policy']}"
    else:
        off = o.get("disable_speculation")
        action = "speculation off" if off else f"{o.get('steps')} steps"
        if o.get("slot") is not None:
            what = f"{action} in slot {o['slot']}" if off else f"slot {o['slot']} -> {action}"
        else:
            what = f"{action} everywhere" if off else f"every slot -> {action}"
            sets = None if slots_of is None else slots_of.get(str(o.get("id")), [])
            others = set(_all_slots(slots_of)) - set(sets or [])
            if sets is not None and others:
                where = f"slots {', '.join(map(str, sets))}" if sets else "no slot"
                owned = ", ".join(map(str, sorted(others)))
                what = f"{action} in {where} (slot(s) {owned}: their own override wins)"
    return f"{what} until {instant(o.get('expires_at_s'), now_s)} ({o.get('reason')!r})"


def _all_slots(slots_of: dict[str, list[int]] | None) -> list[int]:
    return sorted({b for bounds in (slots_of or {}).values() for b in bounds})


def _recommendation_line(rec: dict[str, Any]) -> str:
    if rec.get("summary") is None:
        return str(rec.get("message") or "none")
    gain = rec.get("predicted_gain")
    # The gain is on the recommendation's metric (records without one were on goodput).
    metric = rec.get("metric") or "goodput_tok_s"
    gain_text = f", predicted {gain:+.1%} on {metric}" if isinstance(gain, float) else ""
    return f"{rec['summary']} (from {rec.get('source')}{gain_text})"


@click.command("decisions")
@_client_options
@_verbose_option
@click.option("--since", default=None, help="Only decisions newer than this duration (e.g. 10m).")
@click.option(
    "--limit",
    type=click.IntRange(1, 1000),
    default=20,
    show_default=True,
    help="At most this many decisions.",
)
def decisions_cmd(
    control_addr: str | None, output: str, verbose: bool, since: str | None, limit: int
) -> None:
    """The decision audit log, newest first, each with its reason.

    One line per decision; --verbose shows each full message, --output json every field.
    """
    since_s = None
    if since is not None:
        from specgov.controller.daemon.config_values import ConfigError, parse_duration

        try:
            since_s = time.time() - parse_duration(since, where="--since")
        except ConfigError as exc:
            _fail(str(exc), EXIT_USAGE)
    data = _ask(control_addr, lambda client: client.decisions(since_s=since_s, limit=limit))

    def render(rows: Any) -> None:
        from specgov.controller.cli.format import (
            clock,
            decision_summary,
            humanize_epochs,
            relative,
            table_slots,
        )

        now = time.time()
        items = rows.get("decisions", rows) if isinstance(rows, dict) else rows
        table_rows: list[list[Any]] = []
        for r in items:
            message = humanize_epochs(str(r.get("message") or ""), now)
            table_rows.append(
                [
                    f"{clock(r.get('time_s'), now)} ({relative(r.get('time_s'), now)})",
                    r.get("reason"),
                    r.get("published"),
                    table_slots(r.get("table_after")) if r.get("published") else "-",
                    message if verbose else decision_summary(message),
                ]
            )
        _table(
            "decisions (newest first)",
            ["time", "reason", "published", "table published", "what happened"],
            table_rows,
            caption=None if verbose else "--verbose: the full message of each decision",
        )

    _emit(data, output, render)


@click.group("override")
def override_group() -> None:
    """Operator overrides (clamped by the guardrails like any decision)."""


@override_group.command("set")
@_client_options
@_slot_option("Batch-size slot (its lower bound, as `specgov status` lists them).")
@click.option(
    "--steps",
    type=click.IntRange(min=0),
    default=None,
    help="Draft steps for the slot (one of its candidates; 0 turns speculation off there).",
)
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
    """Set a slot's steps, disable speculation, or pin a policy, for a TTL.

    A slot the engine lacks, or steps outside a slot's candidates, is refused with the
    valid set (exit 2).
    """
    data = _ask(
        control_addr,
        lambda client: client.set_override(
            ttl=ttl, reason=reason, slot=slot, steps=steps, disable=disable, pin_policy=pin_policy
        ),
    )
    _emit(
        data,
        output,
        lambda d: click.echo(f"override {d.get('id')} set: {_override_text(d, time.time())}"),
    )


@override_group.command("clear")
@_client_options
@click.option("--id", "override_id", default=None, help="The override's id (override list).")
@_slot_option("Every override of a slot.")
@click.option("--all", "clear_all", is_flag=True, help="Every override.")
def override_clear(
    control_addr: str | None,
    output: str,
    override_id: str | None,
    slot: int | None,
    clear_all: bool,
) -> None:
    """Clear one override (--id), a slot's (--slot) or all (--all)."""
    if sum(x is not None and x is not False for x in (override_id, slot, clear_all or None)) != 1:
        _fail("give exactly one of --id, --slot, --all", EXIT_USAGE)
    cleared = _ask(
        control_addr,
        lambda client: client.clear_override(
            override_id=override_id, slot=slot, clear_all=clear_all
        ),
    )
    _emit(
        {"cleared": cleared},
        output,
        # "cleared: N", as scripts and the e2e test read it; JSON has {"cleared": N}.
        lambda d: click.echo(f"cleared: {d['cleared']}"),
    )


@override_group.command("list")
@_client_options
def override_list(control_addr: str | None, output: str) -> None:
    """Active overrides."""
    data = _ask(control_addr, lambda client: client.list_overrides())

    def render(d: Any) -> None:
        from specgov.controller.cli.format import instant

        now = time.time()
        items = d.get("overrides", d) if isinstance(d, dict) else d
        _table(
            "overrides",
            ["id", "slot", "steps", "disable", "pin", "expires", "reason"],
            [
                [
                    o.get("id"),
                    "every" if o.get("slot") is None else o.get("slot"),
                    "-" if o.get("steps") is None else o.get("steps"),
                    o.get("disable_speculation"),
                    o.get("pin_policy") or "-",
                    instant(o.get("expires_at_s"), now),
                    o.get("reason"),
                ]
                for o in items
            ],
        )

    _emit(data, output, render)


@click.group("policy")
def policy_group() -> None:
    """Policy kinds (offline) and the running policy."""


@policy_group.command("list")
@_client_options
def policy_list(control_addr: str | None, output: str) -> None:
    """Known policy kinds, with examples and keys; the current one if a daemon answers.

    Works without a daemon (exit 0): the current policy is then "unknown".
    """
    from specgov.controller.cli.control_client import ControlClientError
    from specgov.controller.cli.policy_help import kinds_rows

    addr = _control_addr(control_addr)
    current: str | None = None
    daemon: dict[str, Any] = {"address": addr, "reachable": False, "error": None}
    try:
        # A short timeout: the list is what was asked for, the current policy a bonus.
        with _client(control_addr, timeout_s=1.0) as client:
            current = client.policies().get("current")
        daemon["reachable"] = True
    except ControlClientError as exc:
        daemon["error"] = str(exc)
    rows = kinds_rows()
    data = {
        "current": current,
        "kinds": [r["kind"] for r in rows],
        "details": rows,
        "daemon": daemon,
    }

    def render(d: dict[str, Any]) -> None:
        caption = (
            f"current policy: {d['current']} (daemon at {addr})"
            if daemon["reachable"]
            else f"current policy: unknown (no daemon answered at {addr})"
        )
        _table(
            "policy kinds (spec syntax: KIND[:key=value,...])",
            ["kind", "example", "what it does", "keys (default)"],
            [
                [
                    r["kind"],
                    r["example"],
                    r["description"],
                    ", ".join(f"{k}={_key_default(v)}" for k, v in r["keys"].items()) or "-",
                ]
                for r in d["details"]
            ],
            caption=caption,
        )

    _emit(data, output, render)


def _key_default(value: Any) -> str:
    return "unset" if value is None else f"{value:g}" if isinstance(value, float) else str(value)


@policy_group.command("show")
@_client_options
def policy_show(control_addr: str | None, output: str) -> None:
    """The current policy and its parameters."""
    data = _ask(control_addr, lambda client: client.policy())

    def render(d: dict[str, Any]) -> None:
        from specgov.controller.cli.policy_help import DAEMON_KINDS
        from specgov.policies.daemon.spec import PolicySpecError, parse_policy_spec

        name = d.get("policy")
        rows: list[list[Any]] = [["policy", name]]
        try:
            spec = parse_policy_spec(str(name))
        except PolicySpecError:
            spec = None
        if spec is not None:
            rows.append(["kind", spec.kind])
            rows.append(["what it does", DAEMON_KINDS.get(spec.kind, ("", "unknown"))[1]])
            given = ", ".join(f"{k}={v}" for k, v in spec.params.items())
            rows.append(["parameters given", given or "none (defaults)"])
        _table("specgov policy", ["", "value"], rows)

    _emit(data, output, render)


@policy_group.command("set")
@_client_options
@click.argument("spec")
def policy_set(control_addr: str | None, output: str, spec: str) -> None:
    """Switch the policy (e.g. `goodput:slo_tpot_ms=40`); a bad spec exits 2."""
    _emit(
        _ask(control_addr, lambda client: client.set_policy(spec)),
        output,
        lambda d: click.echo(f"policy switched to {d.get('policy')}"),
    )


@click.command("recommend")
@_client_options
def recommend_cmd(control_addr: str | None, output: str) -> None:
    """The latest restart recommendation (shape, candidates) with its predicted gain."""

    def render(rec: dict[str, Any]) -> None:
        shape = rec.get("shape") or {}
        launch = rec.get("launch") or {}
        rows: list[list[Any]] = [
            ["recommendation", _recommendation_line(rec)],
            ["algorithm", shape.get("algorithm") or "-"],
            [
                "steps / topk / draft tokens",
                "/".join(str(shape.get(k)) for k in ("num_steps", "topk", "num_draft_tokens"))
                if shape
                else "-",
            ],
            ["launch flags", " ".join(launch.get("argv") or []) or "-"],
            [
                "launch environment",
                " ".join(f"{k}={v}" for k, v in (launch.get("environment") or {}).items()) or "-",
            ],
            ["applied", rec.get("applied") or "no"],
        ]
        _table("specgov recommend", ["", "value"], rows)

    _emit(_ask(control_addr, lambda client: client.recommend()), output, render)


COMMANDS = [
    run_cmd,
    status_cmd,
    decisions_cmd,
    override_group,
    policy_group,
    recommend_cmd,
]
