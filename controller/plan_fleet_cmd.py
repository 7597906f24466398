"""`specgov plan fleet`: N replicas behind a router on one trace (being built)."""

from __future__ import annotations

import click


@click.command(name="fleet")
def fleet_cmd() -> None:
    """Simulate fleets of speculative and plain replicas behind a router."""
    raise click.UsageError("specgov plan fleet is not built yet")
