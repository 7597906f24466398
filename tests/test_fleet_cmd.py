"""`specgov fleet status` and `specgov fleet run` against a real smg gateway and two
sim-servers: the status of an idle fleet, and a move whose restart command fails in the
new mode, rolled back to the old one, with the audit rows telling the story."""

from __future__ import annotations

import contextlib
import json
import socket
import sys
import threading
import time
from pathlib import Path

import httpx
import yaml
from click.testing import CliRunner

from specgov.controller.cli.main import main
from specgov.controller.fleet.gateway import SmgGateway
from specgov.simulator.server.core import SimServer


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _fleet_file(tmp_path: Path, gw: SmgGateway, servers: list[SimServer], command: str) -> Path:
    path = tmp_path / "fleet.yaml"
    doc = {
        "gateway": gw.url,
        "restart_command": command,
        "startup_timeout_s": 30,
        "drain_timeout_s": 30,
        "replicas": [
            {"name": f"r{i}", "url": s.url, "mode": "spec"} for i, s in enumerate(servers)
        ],
    }
    path.write_text(yaml.safe_dump(doc))
    return path


def test_status_of_an_idle_fleet(
    tmp_path: Path, smg_fleet: tuple[SmgGateway, list[SimServer]]
) -> None:
    gw, servers = smg_fleet
    fleet = _fleet_file(tmp_path, gw, servers, "true {name}")
    args = ["fleet", "status", "--fleet", str(fleet), "--pays-up-to", "32",
            "--replica-capacity", "100", "--output", "json"]  # fmt: skip
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert [r["serving"] for r in doc["replicas"]] == [True, True]
    assert doc["load_requests"] == 0.0
    assert (doc["target_spec"], doc["next_move"], doc["reason"]) == (2, None, "held_at_target")
    # Without --spec-capacity a speculative replica counts at --replica-capacity.
    assert doc["model"]["capacity"] == {"spec": 100.0, "plain": 100.0}
    given = CliRunner().invoke(
        main, [*args, "--spec-capacity", "60", "--restart-s", "85", "--headroom", "0.2"]
    )
    assert given.exit_code == 0, given.output
    model = json.loads(given.output)["model"]
    assert model == {
        "pays_up_to": 32,
        "capacity": {"spec": 60.0, "plain": 100.0},
        "restart_s": 85.0,
        "headroom": 0.2,
        "step_reserve": 1.5,
    }
    refused = CliRunner().invoke(main, [*args, "--spec-capacity", "0"])
    assert refused.exit_code == 2 and "--spec-capacity" in refused.output


def test_status_reads_the_arrival_rate_in_its_own_unit(
    tmp_path: Path, smg_fleet: tuple[SmgGateway, list[SimServer]]
) -> None:
    """--load arrival-rate: the load is arrivals per second read from each replica's
    /metrics (an idle fleet: 0), the numbers are rates per replica, the messages say so."""
    gw, servers = smg_fleet
    fleet = _fleet_file(tmp_path, gw, servers, "true {name}")
    args = ["fleet", "status", "--fleet", str(fleet), "--load", "arrival-rate",
            "--rate-window-s", "0.5", "--pays-up-to", "2.5", "--replica-capacity", "3.5",
            "--spec-capacity", "2.7", "--output", "json"]  # fmt: skip
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert doc["load_requests"] == 0.0 and doc["reason"] == "held_at_target"
    assert doc["model"]["pays_up_to"] == 2.5
    assert "0.0 req/s per replica against a crossover at 2.5" in doc["message"]


def test_step_reserve_moves_a_replica_to_plain_before_the_load_jumps(
    tmp_path: Path, smg_fleet: tuple[SmgGateway, list[SimServer]]
) -> None:
    """One request in flight on two replicas: 0.5 per replica, below the band (top 0.9:
    90% of what one speculative replica, 2, carries, shared by two). --step-reserve 2: at
    twice the load a switch to plain would be due and one replica could not carry its
    move (2 > 1.8), so status plans a reserve move; 1 turns it off; 1.5 (the default)
    lies inside the reserve's band, so the all-speculative fleet holds."""
    gw, servers = smg_fleet
    fleet = _fleet_file(tmp_path, gw, servers, "true {name}")
    feed = servers[0].live_feed()
    assert feed is not None
    done = threading.Event()

    def call() -> None:
        body = {"model": "specgov-sim:llama-3.1-8b", "prompt": "x", "max_tokens": 100_000}
        with contextlib.suppress(httpx.HTTPError):  # ended by the stop below
            httpx.post(f"{servers[0].url}/v1/completions", json=body, timeout=120.0)
        done.set()

    def in_flight() -> float:
        # What `fleet status` reads: the engine's running + waiting requests (/v1/loads).
        # The HTTP handler opens the request before the engine admits it, so the feed
        # alone is not enough on a busy machine.
        load = httpx.get(f"{servers[0].url}/v1/loads", timeout=5.0).json()["loads"][0]
        return float(load["num_running_reqs"]) + float(load["num_waiting_reqs"])

    threading.Thread(target=call, daemon=True).start()
    end = time.monotonic() + 60.0
    while feed.open_requests != 1 or in_flight() != 1.0:
        assert time.monotonic() < end, "the request never reached the engine"
        time.sleep(0.05)
    args = ["fleet", "status", "--fleet", str(fleet), "--pays-up-to", "1",
            "--replica-capacity", "10", "--spec-capacity", "2", "--output", "json"]  # fmt: skip

    def status(*more: str) -> dict[str, object]:
        result = CliRunner().invoke(main, [*args, *more])
        assert result.exit_code == 0, result.output
        doc: dict[str, object] = json.loads(result.output)
        assert doc["load_requests"] == 1.0
        return doc

    reserve = status("--step-reserve", "2")
    assert (reserve["target_spec"], reserve["reason"]) == (1, "move_to_plain_reserve")
    assert reserve["next_move"] == {"replica": "r1", "to_mode": "plain"}
    assert "the step reserve: at 2x the load" in str(reserve["message"])
    for off in (status("--step-reserve", "1"), status()):
        assert (off["target_spec"], off["reason"]) == (2, "held_at_target")
    refused = CliRunner().invoke(main, [*args, "--step-reserve", "0.5"])
    assert refused.exit_code == 2 and "--step-reserve" in refused.output
    servers[0].stop()
    assert done.wait(60.0)


def test_a_failed_restart_is_rolled_back_through_the_gateway(
    tmp_path: Path, smg_fleet: tuple[SmgGateway, list[SimServer]]
) -> None:
    gw, servers = smg_fleet
    # The operator's command: plain restarts fail, spec ones succeed (the replica stays up).
    command = f"{sys.executable} -c \"import sys; sys.exit(0 if '{{mode}}' == 'spec' else 3)\""
    fleet = _fleet_file(tmp_path, gw, servers, command)
    audit = tmp_path / "audit.jsonl"
    state = tmp_path / "state.json"
    # Crossover 0: speculation never pays, so the target is all plain.
    port = _free_port()
    args = ["fleet", "run", "--fleet", str(fleet), "--state", str(state), "--audit", str(audit),
            "--pays-up-to", "0", "--replica-capacity", "100", "--dwell-s", "3600",
            "--interval-s", "0.2", "--duration-s", "1",
            "--metrics-addr", f"127.0.0.1:{port}"]  # fmt: skip
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    # The metrics server outlives the command in this process: the last values.
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    assert 'specgov_fleet_moves_total{outcome="rolled_back"} 1.0' in text
    assert 'specgov_fleet_decisions_total{reason="move_to_plain"} 1.0' in text
    assert "specgov_fleet_target_spec_replicas 0.0" in text
    rows = [json.loads(line) for line in audit.read_text().splitlines()]
    reasons = [r["reason"] for r in rows]
    assert reasons[0] == "move_to_plain"
    assert reasons[1:8] == [
        "move_started",
        "no_requests_left",
        "restart_plain",
        "restart_failed",
        "restart_spec",
        "server_healthy",
        "serving",
    ]
    # Later decisions wait out the dwell time after the move.
    assert set(reasons[8:]) <= {"held_dwell"}
    assert "exited 3" in rows[4]["message"]
    moved = rows[0]["replica"]
    assert json.loads(state.read_text())["modes"][moved] == "spec"  # rolled back
    # Both replicas serve again through the gateway.
    assert all(w.healthy for w in gw.workers()) and len(gw.workers()) == 2
