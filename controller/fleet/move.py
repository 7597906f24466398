"""The fleet file, and carrying out one move of the fleet governor.

The fleet file (YAML) names the gateway, the replicas and how to restart one in a mode::

    gateway: http://127.0.0.1:30080          # smg's address (its /workers API)
    restart_command: "/opt/fleet/restart {name} {mode} {url}"
    startup_timeout_s: 600                    # a restart with CUDA graph capture
    drain_timeout_s: 300
    replicas:
      - {name: r0, url: "http://10.0.0.1:30000", mode: spec}
      - {name: r1, url: "http://10.0.0.2:30000", mode: plain}

``restart_command`` is a template the operator supplies: ``{name}``, ``{mode}`` (``spec`` or
``plain``) and ``{url}`` are substituted, the result split like a shell line and run
without a shell; it must return once the restart is under way (exit 0) or fail (non-zero).

A move (:func:`execute_move`): drain the replica in the gateway (no new requests; those
it serves finish), wait until it has left, run the restart command for the new mode,
wait until the server answers ``/health`` 200, register it again and wait until the
gateway reports it healthy. If the command fails or the server does not come back within
``startup_timeout_s``, roll back: restart it in its old mode and put it back. Every step
is an audit row (:class:`AuditRow`) with its reason; a move never leaves the fleet with
fewer serving replicas than it started with except the one being moved, and a replica
that does not come back in either mode is reported lost (the governor then holds the mix:
``policies/control/fleet_mix.py``, ``held_replica_not_serving``).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Final, Protocol

import httpx
import yaml

from specgov.controller.fleet.gateway import GatewayError
from specgov.policies.common.errors import SpecgovError
from specgov.policies.common.validation import is_real
from specgov.policies.control.fleet_mix import MODES, Mode, Move

DEFAULT_STARTUP_TIMEOUT_S: Final = 600.0
DEFAULT_DRAIN_TIMEOUT_S: Final = 300.0
RESTART_COMMAND_TIMEOUT_S: Final = 120.0
_PLACEHOLDERS: Final = ("name", "mode", "url")


class FleetFileError(SpecgovError, ValueError):
    """A fleet file that cannot be used; the message names the file and key."""


@dataclass(frozen=True)
class ReplicaEntry:
    name: str
    url: str
    mode: Mode


@dataclass(frozen=True)
class FleetFile:
    gateway: str
    restart_command: str
    replicas: tuple[ReplicaEntry, ...]
    startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S

    def replica(self, name: str) -> ReplicaEntry:
        for r in self.replicas:
            if r.name == name:
                return r
        raise KeyError(name)


def _url(value: object, where: str) -> str:
    if not isinstance(value, str) or not value.startswith(("http://", "https://")):
        raise FleetFileError(f"{where}: expected an http(s) URL, got {value!r}")
    return value.rstrip("/")


def _seconds(raw: Mapping[str, Any], key: str, default: float, where: str) -> float:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise FleetFileError(f"{where}: {key}: expected seconds (a number), got {value!r}")
    if not is_real(value) or value <= 0:
        raise FleetFileError(f"{where}: {key}: expected seconds > 0, got {value!r}")
    return float(value)


def parse_fleet(raw: object, where: str) -> FleetFile:
    """A parsed fleet file's content (``where``: the file, for messages)."""
    if not isinstance(raw, Mapping):
        raise FleetFileError(f"{where}: expected a mapping with gateway, restart_command, replicas")
    unknown = set(raw) - {
        "gateway",
        "restart_command",
        "replicas",
        "startup_timeout_s",
        "drain_timeout_s",
    }
    if unknown:
        raise FleetFileError(f"{where}: unknown keys {sorted(unknown)}")
    gateway = _url(raw.get("gateway"), f"{where}: gateway")
    command = raw.get("restart_command")
    if not isinstance(command, str) or not command.strip():
        raise FleetFileError(f"{where}: restart_command: expected a command template")
    try:
        render_command(command, name="x", mode="spec", url="http://x")
    except FleetFileError as exc:
        raise FleetFileError(f"{where}: restart_command: {exc}") from None
    items = raw.get("replicas")
    if not isinstance(items, list) or not items:
        raise FleetFileError(f"{where}: replicas: expected a non-empty list")
    replicas: list[ReplicaEntry] = []
    for i, item in enumerate(items):
        at = f"{where}: replicas[{i}]"
        if not isinstance(item, Mapping):
            raise FleetFileError(f"{at}: expected a mapping with name, url, mode")
        name, mode = item.get("name"), item.get("mode")
        if not isinstance(name, str) or not name:
            raise FleetFileError(f"{at}: name: expected a non-empty string")
        if mode not in MODES:
            raise FleetFileError(f"{at}: mode: expected spec or plain, got {mode!r}")
        if any(r.name == name for r in replicas):
            raise FleetFileError(f"{at}: name {name!r} is used twice")
        replicas.append(ReplicaEntry(name, _url(item.get("url"), f"{at}: url"), mode))
    return FleetFile(
        gateway=gateway,
        restart_command=command,
        replicas=tuple(replicas),
        startup_timeout_s=_seconds(raw, "startup_timeout_s", DEFAULT_STARTUP_TIMEOUT_S, where),
        drain_timeout_s=_seconds(raw, "drain_timeout_s", DEFAULT_DRAIN_TIMEOUT_S, where),
    )


def load_fleet_file(path: Path) -> FleetFile:
    try:
        text = path.read_text()
    except OSError as exc:
        raise FleetFileError(f"{path}: cannot read: {exc}") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise FleetFileError(f"{path}: not YAML: {exc}") from None
    return parse_fleet(raw, str(path))


def render_command(template: str, *, name: str, mode: str, url: str) -> list[str]:
    """The restart command's argv (no shell)."""
    try:
        text = template.format(name=name, mode=mode, url=url)
    except (KeyError, IndexError, ValueError) as exc:
        raise FleetFileError(
            f"bad placeholder {exc} in {template!r} (only {{name}}, {{mode}}, {{url}})"
        ) from None
    argv = shlex.split(text)
    if not argv:
        raise FleetFileError(f"{template!r} is empty")
    return argv


# ------------------------------------------------------------------ a move


@dataclass(frozen=True)
class AuditRow:
    at_s: float
    replica: str
    step: str  # decide, drain, drained, restart, healthy, registered, rolled_back, lost, done
    reason: str
    message: str
    # decide rows: the fleet's requests in flight, and the load the target is for
    load_requests: float | None = None
    planned_load: float | None = None


class Gateway(Protocol):
    def drain(self, worker_url: str) -> None: ...
    def wait_drained(self, worker_url: str, timeout_s: float) -> None: ...
    def add(self, worker_url: str) -> None: ...
    def wait_healthy(self, worker_url: str, timeout_s: float) -> None: ...


class AuditLog:
    """Audit rows appended to a JSON-lines file, each flushed and fsynced (a crash
    loses none that were written), and kept in memory."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.rows: list[AuditRow] = []

    def write(self, row: AuditRow) -> None:
        self.rows.append(row)
        if self.path is None:
            return
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(asdict(row), separators=(",", ":")) + "\n")
            f.flush()
            os.fsync(f.fileno())


def run_restart_command(argv: list[str]) -> str | None:
    """Run the operator's restart command; None on success, else what went wrong."""
    try:
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=RESTART_COMMAND_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{argv[0]}: {exc}"
    if done.returncode != 0:
        return f"{argv[0]} exited {done.returncode}: {done.stderr.strip()[-300:]}"
    return None


def server_healthy(url: str, timeout_s: float = 5.0) -> bool:
    try:
        with httpx.Client(timeout=timeout_s, trust_env=False) as client:
            return client.get(f"{url}/health").status_code == 200
    except httpx.HTTPError:
        return False


@dataclass(frozen=True)
class MoveOutcome:
    replica: str
    mode: Mode  # what it runs now
    ok: bool  # it runs the mode asked for
    serving: bool  # it is back in the gateway
    reason: str


def _wait_server(
    url: str,
    timeout_s: float,
    healthy: Callable[[str], bool],
    clock: Callable[[], float],
    sleep: Callable[[float], None],
    poll_s: float,
) -> bool:
    deadline = clock() + timeout_s
    while not healthy(url):
        if clock() >= deadline:
            return False
        sleep(poll_s)
    return True


def execute_move(
    move: Move,
    fleet: FleetFile,
    gateway: Gateway,
    audit: AuditLog,
    *,
    restart: Callable[[list[str]], str | None] = run_restart_command,
    healthy: Callable[[str], bool] = server_healthy,
    clock: Callable[[], float] = time.time,
    sleep: Callable[[float], None] = time.sleep,
    poll_s: float = 0.5,
    current: Mode | None = None,
) -> MoveOutcome:
    """Carry out ``move`` (module docstring); every step is an audit row. ``current``:
    the mode the replica runs now (default: the fleet file's)."""
    entry = fleet.replica(move.replica)
    old: Mode = entry.mode if current is None else current

    def row(step: str, reason: str, message: str) -> None:
        audit.write(AuditRow(clock(), entry.name, step, reason, message))

    row("drain", "move_started", f"draining {entry.name} to restart it as {move.to_mode}")
    try:
        gateway.drain(entry.url)
    except GatewayError as exc:  # never left the gateway: it still serves
        row("drain", "drain_failed", f"holding the mix: {exc}")
        return MoveOutcome(entry.name, old, False, True, "drain_failed")
    try:
        gateway.wait_drained(entry.url, fleet.drain_timeout_s)
        row("drained", "no_requests_left", f"{entry.name} left the gateway; its requests finished")
    except GatewayError as exc:
        row("drain", "drain_timeout", f"holding the mix, {entry.name} still draining: {exc}")
        return MoveOutcome(entry.name, old, False, False, "drain_timeout")

    def bring_up(mode: Mode) -> str | None:
        argv = render_command(fleet.restart_command, name=entry.name, mode=mode, url=entry.url)
        row("restart", f"restart_{mode}", f"running {shlex.join(argv)}")
        failure = restart(argv)
        if failure is not None:
            return f"the restart command failed: {failure}"
        if not _wait_server(entry.url, fleet.startup_timeout_s, healthy, clock, sleep, poll_s):
            return f"not healthy {fleet.startup_timeout_s:g} s after the restart"
        row("healthy", "server_healthy", f"{entry.name} answers /health as {mode}")
        try:
            gateway.add(entry.url)
            gateway.wait_healthy(entry.url, fleet.startup_timeout_s)
        except GatewayError as exc:
            return f"the gateway did not take it back: {exc}"
        row("registered", "serving", f"{entry.name} serves again as {mode}")
        return None

    failure = bring_up(move.to_mode)
    if failure is None:
        row("done", "move_done", f"{entry.name}: {old} -> {move.to_mode}")
        return MoveOutcome(entry.name, move.to_mode, True, True, "move_done")
    row(
        "rolled_back", "restart_failed", f"{entry.name} as {move.to_mode}: {failure}; back to {old}"
    )
    again = bring_up(old)
    if again is None:
        return MoveOutcome(entry.name, old, False, True, "rolled_back")
    row("lost", "replica_lost", f"{entry.name} did not come back as {old} either: {again}")
    return MoveOutcome(entry.name, old, False, False, "replica_lost")
