"""How fast the server behind the daemon runs: 1 for a real SGLang, the simulator's speed
for the specgov sim-server (simulated seconds per wall second, from ``/server_info``).

The daemon reports it in its status so rates measured on its wall clock can be shown in the
server's time; the CLI reads it back from the status.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from specgov.policies.common.validation import is_real

# /server_info key of the specgov simulator's speed (simulator.server.endpoints.SIM_SPEED_KEY;
# the controller does not import the simulator; tests/test_sim_server.py checks the two agree).
SIM_SPEED_KEY: Final = "specgov_sim_speed"


def sim_speed(status: Mapping[str, Any]) -> float | None:
    """Simulated seconds per wall second of the server behind a daemon's status
    (``sim_speed``: the specgov simulator says it in ``/server_info``); None for a real
    SGLang, whose ``/server_info`` has no such key, or a value that is not a speed."""
    speed = status.get("sim_speed")
    if not is_real(speed):
        return None
    return float(speed) if speed > 0 else None
