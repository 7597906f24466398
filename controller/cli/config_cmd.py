"""`specgov config validate|show`: check and inspect the daemon's configuration.

Exit codes of both commands: 0 success; 2 the configuration is invalid (every error
found, one line each on stderr naming the file and line or environment variable, the key
path, the value and the expected form) or the command line is wrong (click's usage
errors).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click

from specgov.controller.cli import options as opt

EXIT_OK = 0


def _display(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


@click.group("config")
def config_group() -> None:
    """Check and inspect the daemon's configuration.

    Sources, lowest to highest precedence: the packaged defaults (documented key by
    key in the repository's config.yaml), the --config FILE, environment variables
    SPECGOV_<GROUP>__<KEY>, command-line flags of `specgov run`.
    """


@config_group.command("validate")
@click.argument("file", required=False, type=click.Path(path_type=Path))
def validate(file: Path | None) -> None:
    """Check FILE (default: the packaged defaults) plus SPECGOV_<GROUP>__<KEY> variables.

    Exit codes: 0 valid ("OK: ..." on stdout); 2 invalid (the error on stderr). A
    required secret whose variable is unset is a warning here, not an error, so a file
    can be checked away from the machine that holds the secrets; `specgov run` refuses it.
    """
    from specgov.controller.daemon.config import check_secrets
    from specgov.controller.daemon.config_values import ConfigError

    cfg = opt.load_config_file(file)
    overrides = sorted({origin for origin in cfg.sources.values() if origin.startswith("env ")})
    where = str(file) if file is not None else "packaged defaults"
    if overrides:
        where += f" + {len(overrides)} environment override(s)"
    click.echo(
        f"OK: {where}: mode {cfg.loop.mode}, policy {cfg.policy.spec}, "
        f"server {cfg.server.url}, control {cfg.control.listen}, metrics {cfg.metrics.listen}, "
        f"decide every {cfg.loop.decide_interval_s:g} s"
    )
    try:
        check_secrets(cfg)
    except ConfigError as exc:
        click.echo(f"warning: {exc}", err=True)


@config_group.command("show")
@opt.config_option()
@opt.output_option("A table for people, or stable JSON for scripts.")
def show(config_file: Path | None, output: str) -> None:
    """Print the effective configuration and where each value came from.

    Secrets are never printed: only the names of the variables holding them and
    whether they are set. JSON: {"file", "config", "sources", "secrets"}; "config"
    loads back as a config file. Exit codes: 0 shown; 2 invalid configuration.
    """
    from specgov.controller.daemon.config import effective_config_dict, secret_status

    cfg = opt.load_config_file(config_file)
    data = effective_config_dict(cfg)
    secrets = secret_status(cfg)
    if output == "json":
        document = {
            "file": str(config_file) if config_file is not None else None,
            "config": data,
            "sources": dict(cfg.sources),
            "secrets": secrets,
        }
        click.echo(json.dumps(document, indent=2))
        return

    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    title = f"specgov config: {config_file if config_file is not None else 'packaged defaults'}"
    table = Table(title=title, title_justify="left")
    for column in ("key", "value", "source"):
        table.add_column(column)
    for group, keys in data.items():
        for key, value in keys.items():
            dotted = f"{group}.{key}"
            # Text(), not markup: values such as "[0, 1]" must print as written.
            table.add_row(Text(dotted), Text(_display(value)), Text(cfg.sources.get(dotted, "")))
    for name, status in secrets.items():
        if status["env"] is None:
            shown = "not configured"
        else:
            shown = f"${status['env']} is " + ("set (value hidden)" if status["set"] else "unset")
            if status["required"] and not status["set"]:
                shown += " but required"
        table.add_row(Text(name), Text(shown), Text("environment"))
    console = Console(width=None if sys.stdout.isatty() else 200)
    console.print(table)
