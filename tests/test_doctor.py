"""`specgov doctor` against the sim-server: the good deployment and broken ones.

The good variant is the sim-server with specgov's plugin on a private spool (what
`specgov demo` runs). Broken variants are the sim-server itself where it can be broken
that way (no plugin, an API key, stopped), and otherwise the sim-server behind a small
rewriting proxy in this file: it answers what a misconfigured SGLang 0.5.23 would
(/metrics 404 and ``enable_metrics: false`` without --enable-metrics, no
``speculative_adaptive``, NGRAM, another version, a skewed Date header, 503 while starting).
"""

from __future__ import annotations

import email.utils
import http.server
import json
import os
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from specgov.adapters.telemetry import METRICS_READ
from specgov.controller.cli.doctor_cmd import ESSENTIAL_METRICS
from specgov.controller.cli.main import main
from specgov.controller.fleet.gateway import SmgGateway
from specgov.simulator.replay.runner import ServerSpec
from specgov.simulator.server.cli import load_trace_arg
from specgov.simulator.server.core import SimServer

Rewrite = Callable[[str, int, dict[str, str], bytes], tuple[int, dict[str, str], bytes]]


def _wait_for_stats(spool: Path, timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not list((spool / "stats").glob("tier_stats.*.json")):
        assert time.monotonic() < deadline, f"the plugin wrote no statistics in {spool}"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[SimServer, Path]]:
    spool = tmp_path_factory.mktemp("doctor") / "spool"
    spool.mkdir(mode=0o700)
    sim = SimServer(
        load_trace_arg("synthetic:demo"), ServerSpec(), speed=10.0, spool_dir=spool, port=0
    )
    sim.start()
    try:
        sim.wait_ready(60)
        _wait_for_stats(spool)
        yield sim, spool
    finally:
        sim.stop()


def doctor(*args: str, env: dict[str, str] | None = None) -> tuple[int, dict[str, Any], str]:
    """Runs `specgov doctor ARGS` twice (JSON and table); returns exit code, the checks by
    name, and the table."""
    runner = CliRunner()
    base = {"SPECGOV_SGLANG_API_KEY": ""} | (env or {})
    as_json = runner.invoke(main, ["doctor", *args, "--output", "json"], env=base)
    table = runner.invoke(main, ["doctor", *args], env=base)
    assert as_json.exit_code == table.exit_code, (as_json.output, table.output)
    data = json.loads(as_json.output)
    assert data["ready"] is (as_json.exit_code == 0)
    return as_json.exit_code, {c["name"]: c for c in data["checks"]}, table.output


def statuses(checks: dict[str, Any]) -> dict[str, str]:
    return {name: c["status"] for name, c in checks.items()}


class Proxy:
    """Forwards GETs to ``upstream`` and lets ``rewrite`` change the answer."""

    def __init__(self, upstream: str, rewrite: Rewrite) -> None:
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                req = urllib.request.Request(upstream + self.path, headers=dict(self.headers))
                try:
                    with urllib.request.urlopen(req, timeout=30) as resp:
                        status, headers, body = resp.status, dict(resp.headers), resp.read()
                except urllib.error.HTTPError as exc:
                    status, headers, body = exc.code, dict(exc.headers), exc.read()
                status, headers, body = rewrite(self.path, status, headers, body)
                self.send_response_only(status)
                for key, value in headers.items():
                    if key.lower() not in ("content-length", "transfer-encoding", "connection"):
                        self.send_header(key, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *_args: object) -> None:
                pass

        class Server(http.server.ThreadingHTTPServer):
            daemon_threads = True

            def handle_error(self, request: object, client_address: object) -> None:
                # A client that gave up (the timeout test) closes mid-answer: expected.
                if not isinstance(sys.exc_info()[1], ConnectionError):
                    super().handle_error(request, client_address)  # type: ignore[arg-type]

        self.server = Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()
        outer.rewrite = rewrite

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def proxy(good: tuple[SimServer, Path]) -> Iterator[Callable[[Rewrite], Proxy]]:
    made: list[Proxy] = []

    def make(rewrite: Rewrite) -> Proxy:
        p = Proxy(good[0].url, rewrite)
        made.append(p)
        return p

    yield make
    for p in made:
        p.close()


def _server_info(change: dict[str, Any]) -> Rewrite:
    def rewrite(
        path: str, status: int, headers: dict[str, str], body: bytes
    ) -> tuple[int, dict[str, str], bytes]:
        if path.startswith("/server_info"):
            return status, headers, json.dumps(json.loads(body) | change).encode()
        return status, headers, body

    return rewrite


# ------------------------------------------------------------------------- good


def test_essential_metrics_are_ones_the_daemon_reads() -> None:
    assert ESSENTIAL_METRICS <= METRICS_READ


def test_good_deployment_is_ready(good: tuple[SimServer, Path]) -> None:
    sim, spool = good
    code, checks, table = doctor("--server", sim.url, "--spool-dir", str(spool))
    assert code == 0, table
    assert statuses(checks) == {
        "reachable": "ok",
        "server_info": "ok",
        "version": "ok",
        "metrics": "ok",
        "speculation": "ok",
        "adaptive": "ok",
        "spool": "ok",
        "plugin": "ok",
        "clock": "ok",
    }
    assert all(c["fix"] is None for c in checks.values())
    lines = table.strip().splitlines()
    assert len(lines) == len(checks) + 1 and lines[-1] == "ready"
    assert "EAGLE3, topk 1" in checks["speculation"]["detail"]
    assert "statistics written" in checks["plugin"]["detail"]


# ---------------------------------------------------------- broken: the sim itself


def test_unreachable_server(tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    spool.mkdir(mode=0o700)
    code, checks, table = doctor("--server", "http://127.0.0.1:9", "--spool-dir", str(spool))
    assert code == 1
    assert (
        checks["reachable"]["status"] == "fail" and "start the server" in checks["reachable"]["fix"]
    )
    for name in ("version", "metrics", "speculation", "adaptive", "plugin", "clock"):
        assert checks[name]["status"] == "skip", name
    assert table.strip().splitlines()[-1] == "not ready: 1 failed (reachable)"


def test_server_without_the_plugin(tmp_path: Path) -> None:
    """SGLang's own EMA runs (no specgov in the server): nothing writes statistics."""
    spool = tmp_path / "spool"
    spool.mkdir(mode=0o700)
    sim = SimServer(load_trace_arg("synthetic:demo"), ServerSpec(), speed=10.0, port=0)
    sim.start()
    try:
        sim.wait_ready(60)
        code, checks, table = doctor("--server", sim.url, "--spool-dir", str(spool))
        assert code == 1, table
        assert checks["plugin"]["status"] == "fail"
        assert "SGLANG_PLUGINS=specgov" in checks["plugin"]["fix"]
        assert "-> fix: install specgov" in table
        # Observe mode needs no plugin: the same finding is a warning, and it is ready.
        code, checks, _ = doctor(
            "--server", sim.url, "--spool-dir", str(spool), "--mode", "observe"
        )
        assert code == 0 and checks["plugin"]["status"] == "warn"
    finally:
        sim.stop()


def test_server_with_an_api_key(tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    spool.mkdir(mode=0o700)
    sim = SimServer(
        load_trace_arg("synthetic:demo"), ServerSpec(), speed=10.0, port=0, api_key="s3cret"
    )
    sim.start()
    try:
        sim.wait_ready(60)
        code, checks, _ = doctor("--server", sim.url, "--spool-dir", str(spool))
        assert code == 1 and checks["server_info"]["status"] == "fail"
        assert "export SPECGOV_SGLANG_API_KEY=" in checks["server_info"]["fix"]
        assert "s3cret" not in json.dumps(checks)
        _, checks, _ = doctor(
            "--server", sim.url, "--spool-dir", str(spool),
            env={"SPECGOV_SGLANG_API_KEY": "s3cret"},
        )  # fmt: skip
        assert checks["server_info"]["status"] == "ok"
        assert checks["metrics"]["status"] == "ok"
    finally:
        sim.stop()


def test_spool_writable_by_everyone(good: tuple[SimServer, Path], tmp_path: Path) -> None:
    sim, _ = good
    spool = tmp_path / "open-spool"
    spool.mkdir()
    os.chmod(spool, 0o777)
    code, checks, _ = doctor("--server", sim.url, "--spool-dir", str(spool))
    assert code == 1
    assert checks["spool"]["status"] == "fail"
    assert "writable by every user" in checks["spool"]["detail"]
    assert f"chmod o-w {spool}" in checks["spool"]["fix"]


def test_missing_spool(good: tuple[SimServer, Path], tmp_path: Path) -> None:
    sim, _ = good
    code, checks, _ = doctor("--server", sim.url, "--spool-dir", str(tmp_path / "nope"))
    assert code == 1 and checks["spool"]["status"] == "fail"
    assert checks["plugin"]["status"] == "skip"


# ------------------------------------------------------- broken: through the proxy


def test_metrics_disabled(good: tuple[SimServer, Path], proxy: Callable[[Rewrite], Proxy]) -> None:
    def no_metrics(
        path: str, status: int, headers: dict[str, str], body: bytes
    ) -> tuple[int, dict[str, str], bytes]:
        if path.startswith("/metrics"):
            return 404, {"Content-Type": "text/plain"}, b"Not Found"
        return status, headers, body

    _, spool = good
    p = proxy(no_metrics)
    code, checks, _ = doctor("--server", p.url, "--spool-dir", str(spool))
    assert code == 1 and checks["metrics"]["status"] == "fail"
    assert "HTTP 404" in checks["metrics"]["detail"]
    assert checks["metrics"]["fix"] == "relaunch the server with --enable-metrics"
    p2 = proxy(_server_info({"enable_metrics": False}))
    code, checks, _ = doctor("--server", p2.url, "--spool-dir", str(spool))
    assert code == 1 and "without --enable-metrics" in checks["metrics"]["detail"]


def test_not_adaptive(good: tuple[SimServer, Path], proxy: Callable[[Rewrite], Proxy]) -> None:
    _, spool = good
    p = proxy(_server_info({"speculative_adaptive": False}))
    code, checks, _ = doctor("--server", p.url, "--spool-dir", str(spool))
    assert code == 1 and checks["adaptive"]["status"] == "fail"
    assert "--speculative-adaptive" in checks["adaptive"]["fix"]
    assert checks["plugin"]["status"] == "skip"


def test_algorithm_without_adaptive_support(
    good: tuple[SimServer, Path], proxy: Callable[[Rewrite], Proxy]
) -> None:
    _, spool = good
    p = proxy(_server_info({"speculative_algorithm": "NGRAM"}))
    code, checks, _ = doctor("--server", p.url, "--spool-dir", str(spool))
    assert code == 1 and checks["speculation"]["status"] == "fail"
    assert "only EAGLE/EAGLE3 are supported" in checks["speculation"]["detail"]
    p2 = proxy(_server_info({"speculative_algorithm": None}))
    code, checks, _ = doctor("--server", p2.url, "--spool-dir", str(spool))
    assert code == 1 and "without speculative decoding" in checks["speculation"]["detail"]


def test_adaptive_config_not_readable_here(
    good: tuple[SimServer, Path], proxy: Callable[[Rewrite], Proxy], tmp_path: Path
) -> None:
    _, spool = good
    p = proxy(_server_info({"speculative_adaptive_config": str(tmp_path / "absent.json")}))
    code, checks, _ = doctor("--server", p.url, "--spool-dir", str(spool))
    assert code == 1 and checks["adaptive"]["status"] == "fail"
    assert "at the same path" not in checks["adaptive"]["detail"]
    assert (
        f"mount the server's adaptive config at {tmp_path / 'absent.json'}"
        in checks["adaptive"]["fix"]
    )
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"defaults": {}}))
    p2 = proxy(_server_info({"speculative_adaptive_config": str(bad)}))
    code, checks, _ = doctor("--server", p2.url, "--spool-dir", str(spool))
    assert code == 1 and "not a config SGLang accepts" in checks["adaptive"]["detail"]
    p3 = proxy(_server_info({"speculative_adaptive_config": None}))
    code, checks, _ = doctor("--server", p3.url, "--spool-dir", str(spool))
    assert code == 0 and "SGLang's default config" in checks["adaptive"]["detail"]


def test_other_sglang_version_warns(
    good: tuple[SimServer, Path], proxy: Callable[[Rewrite], Proxy]
) -> None:
    _, spool = good
    p = proxy(_server_info({"version": "0.5.22"}))
    code, checks, table = doctor("--server", p.url, "--spool-dir", str(spool))
    assert code == 0 and checks["version"]["status"] == "warn"
    assert "SGLang 0.5.22" in checks["version"]["detail"]
    assert table.strip().splitlines()[-1] == "ready with 1 warning(s) (version)"


def test_clock_skew(good: tuple[SimServer, Path], proxy: Callable[[Rewrite], Proxy]) -> None:
    def skew(seconds: float) -> Rewrite:
        def rewrite(
            path: str, status: int, headers: dict[str, str], body: bytes
        ) -> tuple[int, dict[str, str], bytes]:
            stamp = email.utils.formatdate(time.time() + seconds, usegmt=True)
            return (
                status,
                {**{k: v for k, v in headers.items() if k != "Date"}, "Date": stamp},
                body,
            )

        return rewrite

    _, spool = good
    code, checks, _ = doctor("--server", proxy(skew(60)).url, "--spool-dir", str(spool))
    assert code == 1 and checks["clock"]["status"] == "fail"
    assert "-60" in checks["clock"]["detail"] or "-59" in checks["clock"]["detail"]
    assert "NTP" in checks["clock"]["fix"]
    _, checks, _ = doctor("--server", proxy(skew(-6)).url, "--spool-dir", str(spool))
    assert checks["clock"]["status"] == "warn"


def test_the_clock_is_judged_against_the_table_ttl(
    good: tuple[SimServer, Path], proxy: Callable[[Rewrite], Proxy]
) -> None:
    """A server clock ahead by the table TTL sees every table expired on arrival (issue
    23 §3): doctor says so, with the TTL of the daemon's configuration."""

    def ahead(seconds: float) -> Rewrite:
        def rewrite(
            path: str, status: int, headers: dict[str, str], body: bytes
        ) -> tuple[int, dict[str, str], bytes]:
            stamp = email.utils.formatdate(time.time() + seconds, usegmt=True)
            return status, {**headers, "Date": stamp}, body

        return rewrite

    _, spool = good
    env = {"SPECGOV_GUARDRAILS__TABLE_TTL_S": "6", "SPECGOV_LOOP__DECIDE_INTERVAL_S": "1"}
    url = proxy(ahead(9)).url
    code, checks, _ = doctor("--server", url, "--spool-dir", str(spool), env=env)
    assert code == 1 and checks["clock"]["status"] == "fail"
    assert (
        "table TTL of 6 s (guardrails.table_ttl_s) every table would have expired"
        in (checks["clock"]["detail"])
    )
    # The same skew against the default 30 s TTL: tables are followed, for less long.
    _, checks, _ = doctor("--server", url, "--spool-dir", str(spool))
    assert "every table would have expired" not in checks["clock"]["detail"]
    assert "would be followed for only 2" in checks["clock"]["detail"]


def test_starting_server(good: tuple[SimServer, Path], proxy: Callable[[Rewrite], Proxy]) -> None:
    def starting(
        path: str, status: int, headers: dict[str, str], body: bytes
    ) -> tuple[int, dict[str, str], bytes]:
        return (503, headers, b"") if path.startswith("/health") else (status, headers, body)

    _, spool = good
    code, checks, _ = doctor("--server", proxy(starting).url, "--spool-dir", str(spool))
    assert code == 1 and checks["reachable"]["status"] == "fail"
    assert "503" in checks["reachable"]["detail"]
    assert checks["server_info"]["status"] == "ok", "the other checks still run"


def test_bad_usage_exits_2(tmp_path: Path) -> None:
    runner = CliRunner()
    assert runner.invoke(main, ["doctor", "--server", "ftp://x"]).exit_code == 2
    bad = tmp_path / "config.yaml"
    bad.write_text("loop:\n  mode: sideways\n")
    result = runner.invoke(main, ["doctor", "--config", str(bad)])
    assert result.exit_code == 2 and "loop.mode" in result.output


def test_config_file_supplies_server_and_spool(
    good: tuple[SimServer, Path], tmp_path: Path
) -> None:
    """Without --server / --spool-dir the doctor reads server.url and spool.dir from
    --config, the file the daemon will run with."""
    sim, spool = good
    config = tmp_path / "config.yaml"
    config.write_text(f"server:\n  url: {sim.url}\nspool:\n  dir: {spool}\n")
    code, checks, table = doctor("--config", str(config))
    assert code == 0, table
    assert sim.url in checks["reachable"]["detail"]
    assert str(spool) in checks["spool"]["detail"]


def test_timeout_applies_to_each_request(
    good: tuple[SimServer, Path], proxy: Callable[[Rewrite], Proxy]
) -> None:
    answered = threading.Event()

    def slow_server_info(
        path: str, status: int, headers: dict[str, str], body: bytes
    ) -> tuple[int, dict[str, str], bytes]:
        if path.startswith("/server_info"):
            answered.wait(5.0)  # released as soon as the doctor has given up
        return status, headers, body

    _, spool = good
    p = proxy(slow_server_info)
    try:
        code, checks, _ = doctor("--server", p.url, "--spool-dir", str(spool), "--timeout-s", "0.5")
    finally:
        answered.set()
    assert code == 1
    assert checks["server_info"]["status"] == "fail"
    assert "no answer within 0.5 s" in checks["server_info"]["detail"]


def test_doctor_checks_the_fleets_gateway(
    good: tuple[SimServer, Path],
    smg_fleet: tuple[SmgGateway, list[SimServer]],
    tmp_path: Path,
) -> None:
    sim, spool = good
    gw, (a, b) = smg_fleet

    def gateway_check(gateway: str, urls: list[str]) -> tuple[int, dict[str, Any], str]:
        fleet = tmp_path / "fleet.yaml"
        replicas = [{"name": f"r{i}", "url": u, "mode": "spec"} for i, u in enumerate(urls)]
        doc = {"gateway": gateway, "restart_command": "true {name}", "replicas": replicas}
        fleet.write_text(json.dumps(doc))
        args = ("--server", sim.url, "--spool-dir", str(spool), "--fleet", str(fleet))
        code, checks, table = doctor(*args)
        return code, checks["gateway"], table

    code, check, _ = gateway_check(gw.url, [a.url, b.url])
    assert check["status"] == "ok" and "lists all 2 replicas, healthy and ready" in check["detail"]
    assert code == 0
    # A worker the file does not name: the governor never moves it.
    _, check, _ = gateway_check(gw.url, [a.url])
    assert check["status"] == "warn" and b.url in check["detail"]
    # A replica the gateway does not list fails, named.
    absent = "http://127.0.0.1:9"
    code, check, table = gateway_check(gw.url, [a.url, b.url, absent])
    assert (code, check["status"]) == (1, "fail") and "does not list r2" in check["detail"]
    assert table.strip().splitlines()[-1] == "not ready: 1 failed (gateway)"
    # The gateway unreachable.
    _, check, _ = gateway_check(absent, [a.url])
    assert check["status"] == "fail" and "start smg" in check["fix"]
    # A broken fleet file is bad configuration (exit 2), naming the file and key.
    bad = tmp_path / "bad.yaml"
    bad.write_text("gateway: smg\n")
    result = CliRunner().invoke(main, ["doctor", "--server", sim.url, "--fleet", str(bad)])
    assert result.exit_code == 2 and f"{bad}: gateway: expected an http(s) URL" in result.output
