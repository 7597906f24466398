"""Carrying out a fleet move (controller/fleet/move.py): the fleet file's errors, the
steps of a move in order with their audit rows, the rollback when a restarted replica
does not come back, and a replica lost in both modes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specgov.controller.fleet.gateway import GatewayError
from specgov.controller.fleet.move import (
    AuditLog,
    FleetFileError,
    execute_move,
    load_fleet_file,
    parse_fleet,
    render_command,
)
from specgov.policies.control.fleet_mix import Move

FLEET = {
    "gateway": "http://127.0.0.1:30080",
    "restart_command": "restart-replica --name {name} --mode {mode} --url {url}",
    "startup_timeout_s": 30,
    "replicas": [
        {"name": "r0", "url": "http://127.0.0.1:30001", "mode": "spec"},
        {"name": "r1", "url": "http://127.0.0.1:30002", "mode": "plain"},
    ],
}


class _Gateway:
    def __init__(self, fail_drain: bool = False) -> None:
        self.calls: list[str] = []
        self.fail_drain = fail_drain

    def drain(self, worker_url: str) -> None:
        if self.fail_drain:
            raise GatewayError("gateway down", temporary=True)
        self.calls.append(f"drain {worker_url}")

    def wait_drained(self, worker_url: str, timeout_s: float) -> None:
        self.calls.append(f"drained {worker_url}")

    def add(self, worker_url: str) -> None:
        self.calls.append(f"add {worker_url}")

    def wait_healthy(self, worker_url: str, timeout_s: float) -> None:
        self.calls.append(f"healthy {worker_url}")


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += s


def test_the_fleet_file_loads_and_names_bad_keys(tmp_path: Path) -> None:
    path = tmp_path / "fleet.yaml"
    path.write_text(json.dumps(FLEET))
    fleet = load_fleet_file(path)
    assert [r.mode for r in fleet.replicas] == ["spec", "plain"]
    assert fleet.startup_timeout_s == 30.0
    bad = dict(FLEET, replicas=[{"name": "r0", "url": "http://x", "mode": "fast"}])
    with pytest.raises(FleetFileError, match=r"f: replicas\[0\]: mode: expected spec or plain"):
        parse_fleet(bad, "f")
    with pytest.raises(FleetFileError, match="bad placeholder 'port'"):
        parse_fleet(dict(FLEET, restart_command="go {port}"), "f")
    with pytest.raises(FleetFileError, match="unknown keys"):
        parse_fleet(dict(FLEET, dwell=3), "f")
    with pytest.raises(FleetFileError, match="used twice"):
        parse_fleet(dict(FLEET, replicas=FLEET["replicas"] * 2), "f")  # type: ignore[operator]
    with pytest.raises(FleetFileError, match="gateway: expected an http"):
        parse_fleet(dict(FLEET, gateway="smg:1"), "f")
    assert render_command("a '{name} x' {mode}", name="r 0", mode="plain", url="u") == [
        "a",
        "r 0 x",
        "plain",
    ]


def test_a_move_drains_restarts_and_registers_in_order(tmp_path: Path) -> None:
    fleet = parse_fleet(FLEET, "f")
    gw = _Gateway()
    ran: list[list[str]] = []
    audit = AuditLog(tmp_path / "audit.jsonl")
    clock = _Clock()
    outcome = execute_move(
        Move("r0", "plain"),
        fleet,
        gw,
        audit,
        restart=lambda argv: ran.append(argv) or None,
        healthy=lambda url: clock.t >= 2.0,  # up two seconds after the restart
        clock=clock,
        sleep=clock.sleep,
    )
    assert (outcome.ok, outcome.serving, outcome.mode) == (True, True, "plain")
    url = "http://127.0.0.1:30001"
    assert gw.calls == [f"drain {url}", f"drained {url}", f"add {url}", f"healthy {url}"]
    assert ran == [["restart-replica", "--name", "r0", "--mode", "plain", "--url", url]]
    steps = [r.step for r in audit.rows]
    assert steps == ["drain", "drained", "restart", "healthy", "registered", "done"]
    on_disk = [json.loads(line) for line in (tmp_path / "audit.jsonl").read_text().splitlines()]
    assert [r["reason"] for r in on_disk] == [r.reason for r in audit.rows]


def test_a_replica_that_does_not_come_back_is_rolled_back() -> None:
    fleet = parse_fleet(FLEET, "f")
    gw = _Gateway()
    audit = AuditLog(None)
    clock = _Clock()
    modes: list[str] = []

    def restart(argv: list[str]) -> str | None:
        modes.append(argv[4])
        return None

    # Healthy only once restarted in its old mode (spec).
    outcome = execute_move(
        Move("r0", "plain"),
        fleet,
        gw,
        audit,
        restart=restart,
        healthy=lambda url: modes[-1] == "spec",
        clock=clock,
        sleep=clock.sleep,
    )
    assert modes == ["plain", "spec"]
    assert (outcome.ok, outcome.serving, outcome.mode, outcome.reason) == (
        False,
        True,
        "spec",
        "rolled_back",
    )
    rolled = next(r for r in audit.rows if r.step == "rolled_back")
    assert "not healthy 30 s after the restart" in rolled.message


def test_a_failing_command_in_both_modes_reports_the_replica_lost() -> None:
    fleet = parse_fleet(FLEET, "f")
    audit = AuditLog(None)
    outcome = execute_move(
        Move("r1", "spec"),
        fleet,
        _Gateway(),
        audit,
        restart=lambda argv: "exit 1: no GPU",
        healthy=lambda url: False,
    )
    assert (outcome.serving, outcome.reason) == (False, "replica_lost")
    assert [r.reason for r in audit.rows][-1] == "replica_lost"
    assert "no GPU" in audit.rows[-1].message


def test_a_gateway_that_cannot_drain_holds_the_mix() -> None:
    audit = AuditLog(None)
    ran: list[list[str]] = []
    outcome = execute_move(
        Move("r0", "plain"),
        parse_fleet(FLEET, "f"),
        _Gateway(fail_drain=True),
        audit,
        restart=lambda argv: ran.append(argv) or None,
    )
    assert (outcome.reason, outcome.serving) == ("drain_failed", True) and ran == []
    assert "gateway down" in audit.rows[-1].message


def test_the_shipped_example_fleet_file_loads() -> None:
    root = Path(__file__).resolve().parent.parent
    fleet = load_fleet_file(root / "deploy/kubernetes/fleet/specgov-fleet.yaml")
    assert [r.mode for r in fleet.replicas] == ["spec", "spec", "spec", "plain"]
    assert render_command(fleet.restart_command, name="sglang-0", mode="plain", url="u")[-1] == (
        "plain"
    )
