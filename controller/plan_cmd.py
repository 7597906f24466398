"""`specgov plan`: capacity planning (VRAM budget, sustainable load, fleets).

Registered on the `specgov` group by ``controller/cli.py``; the simulator is
imported inside each command (DESIGN.md layering).
"""

from __future__ import annotations

import click


@click.group(name="plan")
def plan_group() -> None:
    """Plan capacity offline: VRAM budgets, sustainable load under an SLO, fleets."""


def _register() -> None:
    from specgov.controller.plan_fleet_cmd import fleet_cmd

    plan_group.add_command(fleet_cmd)


_register()
