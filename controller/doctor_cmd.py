"""`specgov doctor`: preflight checks against a real SGLang server (being built)."""

from __future__ import annotations

import click


@click.command(name="doctor")
def doctor_cmd() -> None:
    """Check an SGLang server before putting specgov next to it."""
    raise click.UsageError("specgov doctor is not built yet")
