"""`specgov fit-acceptance`: fit an acceptance profile from a per-token trace (being built)."""

from __future__ import annotations

import click


@click.command(name="fit-acceptance")
def fit_acceptance_cmd() -> None:
    """Fit the simulator's acceptance model from a per-token acceptance trace."""
    raise click.UsageError("specgov fit-acceptance is not built yet")
