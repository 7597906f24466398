"""Harness for the end-to-end tests: real `specgov sim-server` and `specgov run` processes.

Every process is started from the installed console script next to ``sys.executable``
(``python -m specgov.controller.cli.main`` if it is missing), talks real HTTP on 127.0.0.1
ports picked by binding port 0, and writes real files under ``tmp_path``. Each process
logs to its own file; the ``e2e`` fixture kills every process it started (SIGTERM, then
SIGKILL) at teardown and, when the test failed, prints the tail of each log.

Timing rules (the suite must hold on a loaded 2-core machine): no fixed sleeps. Every wait
is on an observable event -- an audit row (control API), a spool table version, a metric,
a sim-server admin answer or a connection refused -- polled with ``wait_until`` under a
generous deadline, and assertions compare events by their causal order (an audit row's
``time_s`` against the daemon-side time of an operator action, or against an interval in
which the server was seen refusing connections), never against a wall-clock budget.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Generator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml

from specgov.controller.daemon.runtime import OPERATOR_AUDIT_REASONS

T = TypeVar("T")

HOST = "127.0.0.1"
SPECGOV_EXE = Path(sys.executable).parent / "specgov"
# Deadlines, not expectations: a loaded machine can stall a process for seconds, and a
# deadline only bounds how long a broken build takes to fail.
EVENT_TIMEOUT_S = 90.0
STARTUP_TIMEOUT_S = 90.0
CLI_TIMEOUT_S = 60.0
# SIGTERM to exit: the daemon's own shutdown grace is 10 s; leave room above it.
STOP_GRACE_S = 30.0
# How often a wait re-reads what it waits for (a poll period, not a wait for an effect).
POLL_S = 0.25
# How often the down-window watcher probes the sim-server (the bracket's resolution).
PROBE_S = 0.1
LOG_TAIL_CHARS = 4000

# Fast loop for tests. decide_interval_s (1) < table_ttl_s * (1 - keepalive_fraction) (3),
# the config's rule, so a healthy daemon re-issues its table before the TTL runs out.
BASE_CONFIG: dict[str, Any] = {
    "loop": {"scrape_interval_s": 0.5, "decide_interval_s": 1},
    "guardrails": {
        "table_ttl_s": 6,
        "keepalive_fraction": 0.5,
        "min_dwell_s": 2,
        "max_dwell_s": 10,
        "flap_half_life_s": 60,
        "rate_window_s": 10,
        "max_changes_per_window": 10,
        "max_staleness_s": 3,
        "max_tier_stats_age_s": 5,
        "rollback_window_s": 4,
        "rollback_settle_s": 1,
        "rollback_max_wait_s": 10,
        "rollback_cooldown_s": 30,
    },
    # The restart-recommendation replays are not what these tests measure.
    "recommend": {"enabled": False},
    "log": {"format": "text", "level": "info"},
}

# The decision reasons the daemon may record (specgov.policies.common.decisions.ReasonCode).
TELEMETRY_HOLDS = frozenset({"held_stale_telemetry", "held_unknown_telemetry"})


def specgov_argv() -> list[str]:
    """How to run the `specgov` CLI of the environment running the tests."""
    if SPECGOV_EXE.is_file():
        return [str(SPECGOV_EXE)]
    return [sys.executable, "-m", "specgov.controller.cli.main"]


def child_env() -> dict[str, str]:
    """The test's environment without SPECGOV_* variables (click reads auto-envvars and
    the config reads SPECGOV_<GROUP>__<KEY>: a developer's shell must not leak in)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECGOV_")}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        port: int = s.getsockname()[1]
        return port


def wait_until(
    probe: Callable[[], T | None],
    *,
    what: str,
    timeout_s: float = EVENT_TIMEOUT_S,
    interval_s: float = POLL_S,
) -> T:
    """Poll ``probe`` until it returns something truthy; fail naming ``what`` on timeout."""
    deadline = time.monotonic() + timeout_s
    last: T | None = None
    while True:
        last = probe()
        if last:
            return last
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(interval_s)  # the poll period between two reads of the event


def http_json(
    method: str, url: str, body: Mapping[str, Any] | None = None, timeout_s: float = 5.0
) -> tuple[int, Any]:
    """One HTTP request; (status, decoded JSON or text). Raises OSError when unreachable."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    text = raw.decode(errors="replace")
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


def http_text(url: str, timeout_s: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:
        body: bytes = resp.read()
        return body.decode()


def steps_for(table: Mapping[str, Any], batch_size: int) -> int:
    """The steps a table gives ``batch_size`` (its slot: the largest lower bound <= it;
    batches below the first bound use the first slot, as the engine does)."""
    slots = sorted((int(b), int(k)) for b, k in table["slots"])
    chosen = slots[0][1]
    for bound, steps in slots:
        if bound <= batch_size:
            chosen = steps
    return chosen


def reachable_steps(table: Mapping[str, Any], batch_size: int) -> set[int]:
    """Every step the engine may run for ``batch_size`` under ``table``: its slot's live
    rule's steps when the table carries one (format 2: the plugin picks among them by the
    live acceptance signal), else the slot's one step."""
    slots = sorted(int(b) for b, _ in table["slots"])
    slot = max((b for b in slots if b <= batch_size), default=slots[0])
    for bound, rule in table.get("rules") or ():
        if int(bound) == slot:
            return {int(k) for k in rule["steps"]}
    return {steps_for(table, batch_size)}


def slot_steps(table: Mapping[str, Any]) -> dict[int, int]:
    return {int(b): int(k) for b, k in table["slots"]}


def brief(row: Mapping[str, Any]) -> str:
    """One audit row in a line, for assertion messages."""
    table = row.get("table_after")
    slots = None if table is None else table["slots"]
    staleness = (row.get("inputs_summary") or {}).get("staleness_s")
    return (
        f"t={row['time_s']:.3f} {row['reason']} published={row['published']} "
        f"staleness_s={staleness} slots={slots} {row['message'][:120]!r}"
    )


def briefs(rows: Sequence[Mapping[str, Any]]) -> str:
    return "\n".join(brief(r) for r in rows)


def tables_in_force(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any] | None]:
    """For each decision (oldest first), the daemon's table in force after it: the last
    published ``table_after`` at or before it."""
    current: dict[str, Any] | None = None
    out: list[dict[str, Any] | None] = []
    for row in rows:
        if row["published"] and row["table_after"] is not None:
            current = dict(row["table_after"])
        out.append(current)
    return out


def deep_merge(base: Mapping[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


class Proc:
    """A child process logging stdout and stderr to one file."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        log_path: Path,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        self._log = log_path.open("ab")
        self.popen = subprocess.Popen(
            self.argv,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**child_env(), **(env or {})},
            start_new_session=True,  # a Ctrl-C at the terminal reaches pytest only
        )

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def kill9(self) -> None:
        """SIGKILL, as an OOM killer or `kill -9` would; waits for the process to go."""
        if self.alive():
            os.kill(self.pid, signal.SIGKILL)
        self.popen.wait(timeout=STOP_GRACE_S)  # bounded: SIGKILL cannot be ignored

    def stop(self) -> int | None:
        """SIGTERM, then SIGKILL after a grace period; the exit status."""
        if self.alive():
            self.popen.terminate()
            try:
                self.popen.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout=STOP_GRACE_S)
        self._log.close()
        return self.popen.returncode

    def log_text(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")


class SimServerProc:
    """`specgov sim-server` in a child process, driven through its admin routes."""

    def __init__(self, proc: Proc, port: int, spool_dir: Path) -> None:
        self.proc = proc
        self.port = port
        self.spool_dir = spool_dir
        self.url = f"http://{HOST}:{port}"

    def healthy(self) -> bool:
        try:
            status, _ = http_json("GET", f"{self.url}/health", timeout_s=2.0)
        except OSError:
            return False
        return status == 200

    def probe(self) -> Probe:
        """One GET /health: ``refused`` (the port is closed), the HTTP status, or
        ``error`` (a timeout or a reset: says nothing about the port)."""
        started = time.time()
        try:
            status, _ = http_json("GET", f"{self.url}/health", timeout_s=2.0)
            outcome = str(status)
        except urllib.error.URLError as exc:
            refused = isinstance(exc.reason, ConnectionRefusedError)
            outcome = "refused" if refused else "error"
        except ConnectionRefusedError:
            outcome = "refused"
        except OSError:
            outcome = "error"
        return Probe(outcome, started, time.time())

    def wait_ready(self) -> None:
        def probe() -> bool:
            if not self.proc.alive():
                raise AssertionError(f"sim-server exited early:\n{self.proc.log_text()}")
            return self.healthy()

        wait_until(probe, timeout_s=STARTUP_TIMEOUT_S, what="the sim-server's /health")

    def state(self) -> dict[str, Any]:
        status, body = http_json("GET", f"{self.url}/specgov-sim/state")
        assert status == 200, f"GET /specgov-sim/state: {status} {body}"
        assert isinstance(body, dict)
        return body

    def restart(self, *, down_s: float, starting_s: float) -> None:
        status, body = http_json(
            "POST",
            f"{self.url}/specgov-sim/restart",
            {"down_s": down_s, "starting_s": starting_s},
        )
        assert status == 202, f"POST /specgov-sim/restart: {status} {body}"

    def outage(self, seconds: float, mode: str = "refuse") -> None:
        status, body = http_json(
            "POST", f"{self.url}/specgov-sim/outage", {"seconds": seconds, "mode": mode}
        )
        assert status == 202, f"POST /specgov-sim/outage: {status} {body}"

    def spool_table(self) -> dict[str, Any] | None:
        """The step table file the daemon published into the spool (its `table`)."""
        path = self.spool_dir / "step_table.json"
        try:
            document = json.loads(path.read_text())
        except FileNotFoundError:
            return None
        table: dict[str, Any] = document["table"]
        return table

    def spool_version(self) -> int:
        """The version of the table in the spool (0 when there is none)."""
        table = self.spool_table()
        return 0 if table is None else int(table["version"])


@dataclasses.dataclass(frozen=True)
class Probe:
    outcome: str  # "refused", "error" or an HTTP status ("200", "503")
    started_s: float
    ended_s: float


@dataclasses.dataclass(frozen=True)
class DownWindow:
    """When a sim-server was seen refusing connections, from the test's probes.

    The server refused at some instant of the first refused probe and at some instant of
    the last, and a down window is one contiguous interval, so it was down throughout
    ``[refused_from_s, refused_until_s]`` (the first probe's end, the last one's start).
    ``back_s`` ends the first probe after it for which ``back`` held."""

    refused_from_s: float
    refused_until_s: float
    back_s: float
    probes: tuple[Probe, ...]


def watch_down_window(
    sim: SimServerProc,
    *,
    back: Callable[[], bool],
    timeout_s: float,
    while_down: Callable[[], None] = lambda: None,
) -> DownWindow:
    """Probe ``sim`` until it has refused connections and then ``back()`` holds; call
    ``while_down`` between probes (checks that must hold throughout)."""
    deadline = time.monotonic() + timeout_s
    probes: list[Probe] = []
    refused: list[Probe] = []
    while True:
        probe = sim.probe()
        probes.append(probe)
        if probe.outcome == "refused":
            refused.append(probe)
        elif len(refused) >= 2 and probe.outcome == "200" and back():
            return DownWindow(refused[0].ended_s, refused[-1].started_s, time.time(), tuple(probes))
        if time.monotonic() > deadline:
            outcomes = [p.outcome for p in probes]
            raise AssertionError(
                f"timed out after {timeout_s:.0f} s watching the sim-server go down and "
                f"come back; probes: {outcomes}"
            )
        while_down()
        time.sleep(PROBE_S)  # the probing period (the bracket's resolution)


class DaemonProc:
    """`specgov run` in a child process, inspected through the `specgov` client CLI."""

    def __init__(
        self, proc: Proc, control_addr: str, metrics_addr: str, db_path: Path, spool: Path
    ) -> None:
        self.proc = proc
        self.control_addr = control_addr
        self.metrics_addr = metrics_addr
        self.db_path = db_path
        self.spool_dir = spool

    def cli(self, *args: str, timeout_s: float = CLI_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
        """Run `specgov ARGS --control-addr ...` against this daemon, as its user: the
        CLI finds the daemon's control token beside its state database, as an operator's
        does with the default paths (here pointed at by the config's environment)."""
        env = {**child_env(), "SPECGOV_STATE__DB_PATH": str(self.db_path)}
        return subprocess.run(
            [*specgov_argv(), *args, "--control-addr", self.control_addr],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=env,
            check=False,
        )

    def cli_json(self, *args: str) -> Any:
        done = self.cli(*args, "--output", "json")
        assert done.returncode == 0, (
            f"specgov {' '.join(args)} --output json: exit {done.returncode}\n"
            f"stdout: {done.stdout}\nstderr: {done.stderr}"
        )
        return json.loads(done.stdout)

    def decisions(self, limit: int = 1000) -> list[dict[str, Any]]:
        """The decisions in the audit log through `specgov decisions --output json`,
        oldest first (the rows of operator actions left out: see ``operator_rows``)."""
        return [r for r in self.audit_rows(limit) if r["reason"] not in OPERATOR_AUDIT_REASONS]

    def audit_rows(self, limit: int = 1000) -> list[dict[str, Any]]:
        """Every audit row through `specgov decisions --output json`, oldest first."""
        rows = self.cli_json("decisions", "--limit", str(limit))
        assert isinstance(rows, list), rows
        return list(reversed(rows))

    def status(self) -> dict[str, Any]:
        data = self.cli_json("status")
        assert isinstance(data, dict), data
        return data

    def api(self, path: str) -> Any:
        """GET the control API directly (cheaper than a CLI process, for polling)."""
        status, body = http_json("GET", f"http://{self.control_addr}/v1/{path}")
        assert status == 200, f"GET /v1/{path}: {status} {body}"
        return body

    def api_decisions(self, since_s: float | None = None, limit: int = 1000) -> list[Any]:
        query = f"decisions?limit={limit}" + ("" if since_s is None else f"&since={since_s}")
        rows = self.api(query)["decisions"]
        assert isinstance(rows, list)
        return [r for r in reversed(rows) if r["reason"] not in OPERATOR_AUDIT_REASONS]

    def decisions_after(self, t_s: float) -> list[dict[str, Any]]:
        """Audit rows with ``time_s`` strictly after ``t_s``, oldest first."""
        return [r for r in self.api_decisions(since_s=t_s) if r["time_s"] > t_s]

    def first_decision_after(
        self, t_s: float, *, published: bool = False, what: str = ""
    ) -> dict[str, Any]:
        """The first decision (or published decision) made after ``t_s`` (daemon
        clock), waiting for it."""

        def probe() -> dict[str, Any] | None:
            rows = [r for r in self.decisions_after(t_s) if r["published"] or not published]
            return rows[0] if rows else None

        kind = "a published table" if published else "a decision"
        return wait_until(probe, what=what or f"{kind} after t={t_s:.3f}")

    def wait_decisions_after(self, t_s: float, count: int, what: str) -> list[dict[str, Any]]:
        """Wait until ``count`` decisions were made after ``t_s``; return them."""

        def probe() -> list[dict[str, Any]] | None:
            rows = self.decisions_after(t_s)
            return rows if len(rows) >= count else None

        return wait_until(probe, what=f"{count} decisions after t={t_s:.3f} ({what})")

    def metrics_text(self) -> str:
        return http_text(f"http://{self.metrics_addr}/metrics")

    def reachable(self) -> bool:
        try:
            status, _ = http_json("GET", f"http://{self.control_addr}/v1/health", timeout_s=2.0)
        except OSError:
            return False
        return status in (200, 503)

    def wait_ready(self) -> None:
        def probe() -> bool:
            if not self.proc.alive():
                raise AssertionError(f"specgov run exited early:\n{self.proc.log_text()}")
            return self.reachable()

        wait_until(probe, timeout_s=STARTUP_TIMEOUT_S, what="the daemon's control API")

    def count_rows(self, table: str, where: str = "") -> int:
        """Rows in the daemon's SQLite store, read directly (read-only, WAL-aware)."""
        uri = f"file:{self.db_path}?mode=ro"
        with contextlib.closing(sqlite3.connect(uri, uri=True, timeout=10.0)) as db:
            (count,) = db.execute(f"SELECT count(*) FROM {table} {where}").fetchone()
        return int(count)

    def override_cleared_at(self, override_id: str) -> float | None:
        """When the daemon cleared an override (its clock, from the store), or None."""
        uri = f"file:{self.db_path}?mode=ro"
        with contextlib.closing(sqlite3.connect(uri, uri=True, timeout=10.0)) as db:
            row = db.execute(
                "SELECT cleared_at_s FROM overrides WHERE id = ?", (override_id,)
            ).fetchone()
        return None if row is None or row[0] is None else float(row[0])


class E2E:
    """Starts sim-servers and daemons for one test; stops all of them at the end."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.procs: list[Proc] = []
        self._n = 0

    def _proc(self, name: str, argv: Sequence[str]) -> Proc:
        return self.start_process(name, argv)

    def start_process(
        self, name: str, argv: Sequence[str], env: Mapping[str, str] | None = None
    ) -> Proc:
        """Any command, logged and stopped like the others (``env``: added variables)."""
        self._n += 1
        proc = Proc(name, argv, self.root / f"{self._n:02d}-{name}.log", env)
        self.procs.append(proc)
        return proc

    def start_sim(
        self,
        trace: str,
        *,
        speed: float,
        loop: bool = False,
        acceptance_profile: str | None = "ngram",
        spool_dir: Path | None = None,
    ) -> SimServerProc:
        port = free_port()
        spool = spool_dir if spool_dir is not None else self.root / "spool"
        argv = [
            *specgov_argv(),
            "sim-server",
            "--port",
            str(port),
            "--spool-dir",
            str(spool),
            "--trace",
            trace,
            "--speed",
            str(speed),
        ]
        if loop:
            argv.append("--loop")
        if acceptance_profile is not None:
            argv += ["--acceptance-profile", acceptance_profile]
        sim = SimServerProc(self._proc("sim-server", argv), port, spool)
        sim.wait_ready()
        return sim

    def write_config(self, extra: Mapping[str, Any] | None = None) -> Path:
        path = self.root / "specgov.yaml"
        path.write_text(yaml.safe_dump(deep_merge(BASE_CONFIG, extra or {}), sort_keys=False))
        return path

    def start_daemon(
        self,
        sim: SimServerProc,
        *,
        config: Path | None = None,
        db_path: Path | None = None,
        policy: str = "goodput",
        wait: bool = True,
    ) -> DaemonProc:
        cfg = config if config is not None else self.write_config()
        db = db_path if db_path is not None else self.root / "state" / "state.db"
        control = f"{HOST}:{free_port()}"
        metrics = f"{HOST}:{free_port()}"
        argv = [
            *specgov_argv(),
            "run",
            "--config",
            str(cfg),
            "--server",
            sim.url,
            "--spool-dir",
            str(sim.spool_dir),
            "--state-db",
            str(db),
            "--control-addr",
            control,
            "--metrics-addr",
            metrics,
            "--mode",
            "plugin",
            "--policy",
            policy,
        ]
        daemon = DaemonProc(self._proc("daemon", argv), control, metrics, db, sim.spool_dir)
        if wait:
            daemon.wait_ready()
        return daemon

    def close(self, *, failed: bool) -> None:
        for proc in reversed(self.procs):
            with contextlib.suppress(Exception):
                proc.stop()
        if failed:
            for proc in self.procs:
                with contextlib.suppress(OSError):
                    text = proc.log_path.read_text(errors="replace")
                    print(f"----- {proc.log_path.name} (exit {proc.popen.returncode}) -----")
                    print(text[-LOG_TAIL_CHARS:])


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, Any, None]:
    # Remember each phase's outcome on the item so the fixture can print logs on failure.
    outcome = yield
    report = outcome.get_result()
    setattr(item, f"e2e_report_{report.when}", report)


@pytest.fixture
def e2e(request: pytest.FixtureRequest, tmp_path: Path) -> Generator[E2E, None, None]:
    harness = E2E(tmp_path)
    try:
        yield harness
    finally:
        report = getattr(request.node, "e2e_report_call", None)
        harness.close(failed=report is None or report.failed)
