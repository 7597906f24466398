"""The restart command shipped for fleets of sim-servers (``specgov fleet sim-restart``,
simulator/server/replica.py): its refusals, and a real spec -> plain -> spec switch of
one replica through the real smg gateway, carried out by the fleet governor's move
(controller/fleet/move.py) with the shipped command, while clients keep sending requests
through the gateway: none is lost, and the audit rows tell the story."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner

from specgov.controller.cli.main import main
from specgov.controller.fleet.gateway import SmgGateway
from specgov.controller.fleet.move import AuditLog, execute_move, parse_fleet
from specgov.policies.control.fleet_mix import Move
from specgov.simulator.server.core import SimServer
from specgov.simulator.server.replica import restart_in_place, stop_replica

TOKENS = 30
SPEED_30 = ("--speed", "30")
DEADLINE_S = 60.0


def _restart(run_dir: Path, name: str, mode: str, url: str, *extra: str) -> str:
    args = ["fleet", "sim-restart", name, mode, url, "--run-dir", str(run_dir), *extra]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    return result.output


@pytest.fixture()
def run_dir(tmp_path: Path) -> Iterator[Path]:
    """The replicas' pid files; every sim-server started there is stopped at teardown."""
    folder = tmp_path / "run"
    yield folder
    for pid_file in folder.glob("*.pid"):
        stop_replica(pid_file)


def test_sim_restart_refuses_what_it_cannot_do(run_dir: Path, free_port: Callable[[], int]) -> None:
    runner = CliRunner()
    bad = runner.invoke(main, ["fleet", "sim-restart", "r0", "fast", "http://127.0.0.1:1"])
    assert bad.exit_code == 2 and "'fast' is not one of 'spec', 'plain'" in bad.output
    url = f"http://127.0.0.1:{free_port()}"
    args = ["fleet", "sim-restart", "r0", "spec", url, "--run-dir", str(run_dir)]
    reserved = runner.invoke(main, [*args, "--", "--port", "1"])
    assert reserved.exit_code == 1 and "--port: sim-restart sets --host" in reserved.output
    bad_startup = runner.invoke(main, [*args, "--startup-s", "soon"])
    assert bad_startup.exit_code == 1 and "expected seconds >= 0 or 'catalog'" in bad_startup.output
    broken = runner.invoke(main, [*args, "--startup-s", "0", "--", "--gpu", "nope"])
    assert broken.exit_code == 1 and "exited 1 before it was healthy" in broken.output
    assert "nope" in broken.output and not (run_dir / "r0.pid").exists()
    # --timeout-s: a server not healthy in time is stopped, and the command fails.
    slow = runner.invoke(main, [*args, "--timeout-s", "0.01", "--startup-s", "0"])
    assert slow.exit_code == 1 and "not healthy 0.01 s after its 0.0 s start-up" in slow.output
    assert not (run_dir / "r0.pid").exists()
    with pytest.raises(httpx.ConnectError):  # the stopped server no longer listens
        httpx.get(f"{url}/health", timeout=5)
    # A server this command did not start is never stopped: an error instead.
    with SimServer([]) as other:
        other.wait_ready()
        args[4] = other.url
        taken = runner.invoke(main, args)
        assert taken.exit_code == 1 and "stop that server first" in taken.output
        assert other.healthy


def test_a_restarted_replica_serves_only_after_its_start_up(
    run_dir: Path, free_port: Callable[[], int]
) -> None:
    """The start-up a real restart costs (model load, CUDA graph capture): by default the
    catalog model's startup_s, scaled by --speed; the port stays closed until then."""
    url = f"http://127.0.0.1:{free_port()}"
    out = _restart(run_dir, "r0", "plain", url, "--", "--speed", "30")
    # llama-3.1-8b's catalog startup_s is 60 s: 2 s of wall time at --speed 30.
    assert "60 s of simulated start-up" in out
    healthy_after_s = float(out.split("healthy after ")[1].split(" s")[0])
    assert healthy_after_s >= 2.0
    fast = _restart(run_dir, "r0", "spec", url, "--startup-s", "3", "--", "--speed", "30")
    assert "3 s of simulated start-up" in fast and "as spec" in fast


def test_an_in_place_restart_keeps_the_process_and_costs_the_start_up_from_its_launch(
    run_dir: Path, free_port: Callable[[], int]
) -> None:
    """``--in-place``: the running sim-server restarts itself in the other mode (same
    pid), refusing connections for the start-up; the start-up counts from when the
    restart began, so time already spent (the command's own start) is not added."""
    url = f"http://127.0.0.1:{free_port()}"
    first = restart_in_place("r0", "spec", url, run_dir, sim_args=SPEED_30, startup_s="0")
    assert first.mode == "spec"  # no server of its own yet: a process start
    began = time.monotonic()
    moved = restart_in_place("r0", "plain", url, run_dir, sim_args=SPEED_30, startup_s="60")
    # llama-3.1-8b's 60 s at --speed 30: 2 s of wall time before it serves again.
    assert moved.pid == first.pid and moved.mode == "plain"
    assert time.monotonic() - began >= 2.0 and moved.simulated_startup_s == 60.0
    info = httpx.get(f"{url}/server_info", timeout=DEADLINE_S).json()
    assert info["speculative_algorithm"] is None
    # Begun 1.5 s ago (say, a slow process start): only what is left of the 2 s remains.
    began = time.monotonic()
    back = restart_in_place(
        "r0", "spec", url, run_dir, sim_args=SPEED_30, startup_s="60", launched_s=began - 1.5
    )
    assert back.pid == first.pid and back.mode == "spec" and back.startup_s >= 2.0
    assert time.monotonic() - began >= 0.5
    # Launched long ago (a long-lived caller, e.g. this test process): no start-up is
    # left, and the health wait still gets its whole timeout from now.
    late = restart_in_place(
        "r0",
        "plain",
        url,
        run_dir,
        sim_args=SPEED_30,
        startup_s="60",
        launched_s=time.monotonic() - 1000.0,
        timeout_s=30.0,
    )
    assert late.pid == first.pid and late.mode == "plain"
    # The command line: --in-place, and the same refusal of a bad mode.
    out = _restart(run_dir, "r0", "spec", url, "--startup-s", "3", "--in-place", "--", *SPEED_30)
    assert f"pid {first.pid} serves {url} as spec" in out


def test_a_replica_switches_spec_plain_spec_through_smg_losing_no_request(
    smg_launch: Callable[[list[str]], AbstractContextManager[SmgGateway]],
    free_port: Callable[[], int],
    run_dir: Path,
    tmp_path: Path,
) -> None:
    urls = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
    for i, url in enumerate(urls):
        out = _restart(
            run_dir,
            f"r{i}",
            "spec",
            url,
            "--startup-s",
            "0",
            "--",
            "--speed",
            "4",
            "--seed",
            str(i),
        )
        assert f"serves {url} as spec" in out
    specgov = [sys.executable, "-m", "specgov.controller.cli.main"]
    command = (
        " ".join(specgov)
        + f" fleet sim-restart {{name}} {{mode}} {{url}} --run-dir {run_dir} --startup-s 2"
    )
    fleet = parse_fleet(
        {
            "gateway": "http://127.0.0.1:1",  # the gateway object below is what is used
            "restart_command": command + " -- --speed 4",
            "startup_timeout_s": DEADLINE_S,
            "drain_timeout_s": DEADLINE_S,
            "replicas": [
                {"name": f"r{i}", "url": url, "mode": "spec"} for i, url in enumerate(urls)
            ],
        },
        "fleet",
    )
    results: list[tuple[int, int]] = []
    stop = threading.Event()

    def client() -> None:  # closed loop through the gateway until told to stop
        with httpx.Client(timeout=DEADLINE_S, trust_env=False) as c:
            while not stop.is_set():
                r = c.post(
                    f"{gw.url}/generate",
                    json={"text": "hello", "sampling_params": {"max_new_tokens": TOKENS}},
                )
                ok = r.status_code == 200
                results.append(
                    (r.status_code, r.json()["meta_info"]["completion_tokens"] if ok else -1)
                )

    def info(url: str, path: str) -> dict[str, object]:
        return dict(httpx.get(f"{url}{path}", timeout=10, trust_env=False).json())

    with smg_launch(urls) as gw:
        threads = [threading.Thread(target=client) for _ in range(3)]
        for t in threads:
            t.start()
        try:
            audit = AuditLog(tmp_path / "audit.jsonl")
            to_plain = execute_move(Move("r0", "plain"), fleet, gw, audit, current="spec")
            assert (to_plain.ok, to_plain.serving, to_plain.mode) == (True, True, "plain")
            assert info(urls[0], "/server_info")["speculative_algorithm"] is None
            assert info(urls[0], "/specgov-sim/state")["speed"] == 4.0  # `-- --speed 4`
            # The plain replica serves: the gateway routes to it again.
            deadline = time.monotonic() + DEADLINE_S
            while not info(urls[0], "/specgov-sim/state")["requests_finished"]:
                assert time.monotonic() < deadline, "the plain replica got no request"
                time.sleep(0.05)
            back = execute_move(Move("r0", "spec"), fleet, gw, audit, current="plain")
            assert (back.ok, back.serving, back.mode) == (True, True, "spec")
            assert info(urls[0], "/server_info")["speculative_algorithm"] == "EAGLE3"
        finally:
            stop.set()
            for t in threads:
                t.join(DEADLINE_S)
        assert len(gw.workers()) == 2 and all(w.healthy for w in gw.workers())
    assert len(results) >= 10
    assert set(results) == {(200, TOKENS)}, sorted(set(results))
    reasons = [r.reason for r in audit.rows]
    one_move = ["move_started", "no_requests_left", "", "server_healthy", "serving", "move_done"]
    assert reasons == [
        *(r if r else "restart_plain" for r in one_move),
        *(r if r else "restart_spec" for r in one_move),
    ]
    assert "fleet sim-restart r0 plain" in audit.rows[2].message


def test_the_start_up_counts_from_the_process_launch() -> None:
    """A server's start-up includes its own process start: the sim-server waits only what
    is left of it once it has imported and loaded (a busy machine adds nothing)."""
    from specgov.simulator.server.cli import process_age_s

    if process_age_s() is None:
        pytest.skip("no /proc on this platform: the start-up counts from the call")
    code = (
        "import time; time.sleep(0.5); "
        "from specgov.simulator.server.cli import process_age_s; print(process_age_s())"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    age = float(done.stdout.strip())
    # At least the sleep; the upper bound is only that it is this process, not the boot.
    assert 0.5 <= age < 120.0, done.stdout
