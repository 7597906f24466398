"""A sim-server as a fleet replica: (re)start one in a mode on its URL's port.

The restart command the project ships for fleets of sim-servers (``specgov fleet
sim-restart NAME MODE URL --run-dir DIR``, a fleet file's ``restart_command``, see
docs/operations.md §11) is :func:`restart_replica`: stop the sim-server this command
started for ``NAME`` before (its pid file in ``DIR``), start ``specgov sim-server`` on the
URL's host and port in ``MODE`` (``spec``: the drafter's algorithm; ``plain``:
``--speculative-algorithm NONE``) with the start-up a real restart costs (``--startup-s``:
by default the model's catalog ``startup_s``, model load and CUDA graph capture; the
server listens only after it, scaled by ``--speed``), and return once it answers
``/health`` 200 and
``/server_info`` says the mode asked for. The new server is its own session (it outlives
the command); its output goes to ``DIR/NAME.log``.

In place (``--in-place``, :func:`restart_in_place`): when the sim-server this command
started for ``NAME`` runs on the URL, it is told to restart itself in ``MODE``
(``POST /specgov-sim/restart``): its engine stops (requests in flight are lost, as in a
process restart), its port refuses connections for the start-up, then it serves again
in the new mode with fresh counters, a fresh plugin and no overrides. The process is
kept, so the start-up costs what the catalog says however long a Python process takes
to start on a busy machine (measured: process restarts of 90-150 s simulated for a 60 s
start-up at ``--speed 8`` on a loaded 2-core machine). The start-up counts from this
command's own launch (its process start is part of the restart, as a real server's
start is part of its start-up). Without a running sim-server of its own on the URL it
starts one as above.

Only a process this module started is ever signalled: the pid file names it, and its
command line must still be a sim-server's (a pid reused by another program is left
alone). Something else answering on the port is an error, not a kill.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final
from urllib.parse import urlsplit

import click
import httpx

from specgov.policies.common.errors import SpecgovError
from specgov.simulator.server.cli import PLAIN_ALGORITHM, STARTUP_FROM_CATALOG, startup_seconds

MODES: Final = ("spec", "plain")
# sim-restart sets these itself; the pass-through arguments may not.
RESERVED_FLAGS: Final = ("--host", "--port", "--speculative-algorithm", "--startup-s")
STOP_TIMEOUT_S: Final = 30.0
POLL_S: Final = 0.1


class ReplicaError(SpecgovError, RuntimeError):
    """A replica that could not be (re)started; the message says why and what to do."""


@dataclass(frozen=True)
class Started:
    pid: int
    url: str
    mode: str
    startup_s: float  # wall seconds from the start until healthy
    simulated_startup_s: float  # the start-up it simulated (model load, CUDA graphs)


def _host_port(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    if parts.scheme != "http" or parts.hostname is None or parts.port is None:
        raise ReplicaError(f"url {url!r}: expected http://HOST:PORT")
    return parts.hostname, parts.port


def _is_sim_server(pid: int) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return b"specgov.simulator.server.cli" in cmdline


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (exited, not yet reaped by its parent) has no cmdline left.
    return _is_sim_server(pid)


def stop_replica(pid_file: Path, timeout_s: float = STOP_TIMEOUT_S) -> int | None:
    """Stop the sim-server ``pid_file`` names (SIGTERM, SIGKILL after ``timeout_s``);
    the pid stopped, or None when there was none running."""
    try:
        pid = int(pid_file.read_text().strip())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise ReplicaError(f"{pid_file}: not a pid file ({exc})") from None
    if not _is_sim_server(pid):
        pid_file.unlink(missing_ok=True)  # that server is gone; the pid may be reused
        return None
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while _alive(pid):
        if time.monotonic() >= deadline:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            break
        time.sleep(POLL_S)
    pid_file.unlink(missing_ok=True)
    return pid


def _answers(url: str) -> httpx.Response | None:
    try:
        with httpx.Client(timeout=2.0, trust_env=False) as client:
            return client.get(f"{url}/health")
    except httpx.HTTPError:
        return None


def _flag(sim_args: Sequence[str], flag: str) -> str | None:
    """The value of ``flag`` among the pass-through arguments (``--f v`` or ``--f=v``)."""
    found: str | None = None
    for i, arg in enumerate(sim_args):
        if arg == flag and i + 1 < len(sim_args):
            found = sim_args[i + 1]
        elif arg.startswith(flag + "="):
            found = arg.split("=", 1)[1]
    return found


def _startup(startup_s: str, sim_args: Sequence[str]) -> tuple[float, float]:
    """(simulated start-up seconds, the wall seconds they take at the server's --speed)."""
    model = _flag(sim_args, "--model")
    if model is None and startup_s.strip().lower() == STARTUP_FROM_CATALOG:
        # Imported only for the catalog's default model (a heavy import: the simulator).
        from specgov.simulator.replay.runner import ServerSpec

        model = ServerSpec().model
    try:
        seconds = startup_seconds(startup_s, model or "")
        speed = float(_flag(sim_args, "--speed") or 1.0)
    except (ValueError, click.ClickException) as exc:
        message = exc.format_message() if isinstance(exc, click.ClickException) else str(exc)
        raise ReplicaError(f"--startup-s {startup_s}: {message}") from None
    if not speed > 0:
        raise ReplicaError(f"--speed {speed}: expected > 0")
    return seconds, seconds / speed


def _log_tail(path: Path, chars: int = 600) -> str:
    try:
        return path.read_text(errors="replace")[-chars:].strip()
    except OSError:
        return ""


def _pid_of(pid_file: Path) -> int | None:
    """The live sim-server ``pid_file`` names, else None."""
    try:
        pid = int(pid_file.read_text().strip())
    except (OSError, ValueError):
        return None
    return pid if _alive(pid) else None


def restart_in_place(
    name: str,
    mode: str,
    url: str,
    run_dir: Path,
    *,
    sim_args: Sequence[str] = (),
    timeout_s: float = 100.0,
    startup_s: str = STARTUP_FROM_CATALOG,
    launched_s: float | None = None,
) -> Started:
    """Restart replica ``name`` in ``mode`` inside its running sim-server (module
    docstring), the start-up counted from ``launched_s`` (``time.monotonic()`` when the
    restart began, e.g. this command's launch; None: now): the port is closed for what
    is left of it; a first start (no sim-server of its own on ``url``) is
    :func:`restart_replica`'s."""
    pid = _pid_of(run_dir / f"{name}.pid")
    if pid is None or _answers(url) is None:
        return restart_replica(
            name, mode, url, run_dir, sim_args=sim_args, timeout_s=timeout_s, startup_s=startup_s
        )
    if mode not in MODES:
        raise ReplicaError(f"mode {mode!r}: expected spec or plain")
    simulated, startup_wall_s = _startup(startup_s, sim_args)
    started_s = time.monotonic() if launched_s is None else launched_s
    down_s = max(0.0, startup_wall_s - (time.monotonic() - started_s))
    body = {"mode": mode, "down_s": down_s}
    try:
        with httpx.Client(timeout=10.0, trust_env=False) as client:
            r = client.post(f"{url}/specgov-sim/restart", json=body)
    except httpx.HTTPError as exc:
        raise ReplicaError(f"{name!r} on {url}: the restart request failed: {exc}") from None
    if r.status_code != 202:
        raise ReplicaError(f"{name!r} on {url}: restart refused ({r.status_code}): {r.text[:300]}")
    # timeout_s counts from when the server should serve again (now + what is left of
    # its start-up), never from the launch: a launch long ago (a long-lived caller)
    # must not leave a deadline already past.
    deadline = time.monotonic() + down_s + timeout_s
    while True:
        answer = _answers(url)
        if answer is not None and answer.status_code == 200 and _mode_of(url) == mode:
            break
        if time.monotonic() >= deadline:
            raise ReplicaError(
                f"{name!r} on {url} not healthy as {mode} {timeout_s:g} s after its "
                f"{startup_wall_s:.1f} s start-up"
            )
        time.sleep(POLL_S)
    return Started(pid, url, mode, time.monotonic() - started_s, simulated)


def _mode_of(url: str) -> str | None:
    """``spec`` or ``plain`` as ``/server_info`` says; None when it does not answer."""
    try:
        with httpx.Client(timeout=5.0, trust_env=False) as client:
            info = client.get(f"{url}/server_info").json()
    except (httpx.HTTPError, ValueError):
        return None
    if not isinstance(info, dict):
        return None
    return "plain" if info.get("speculative_algorithm") is None else "spec"


def restart_replica(
    name: str,
    mode: str,
    url: str,
    run_dir: Path,
    *,
    sim_args: Sequence[str] = (),
    timeout_s: float = 100.0,
    startup_s: str = STARTUP_FROM_CATALOG,
) -> Started:
    """(Re)start replica ``name`` as a sim-server in ``mode`` on ``url`` (module docstring).
    ``startup_s``: the simulated start-up (seconds, or ``catalog``: the model's); the
    server listens only after it, and ``timeout_s`` counts from then."""
    if mode not in MODES:
        raise ReplicaError(f"mode {mode!r}: expected spec or plain")
    if not name or "/" in name or name.startswith("."):
        raise ReplicaError(f"name {name!r}: expected a plain file name (no '/')")
    for arg in sim_args:
        if arg.split("=", 1)[0] in RESERVED_FLAGS:
            raise ReplicaError(f"{arg}: sim-restart sets {', '.join(RESERVED_FLAGS)} itself")
    host, port = _host_port(url)
    simulated, startup_wall_s = _startup(startup_s, sim_args)
    run_dir.mkdir(parents=True, exist_ok=True)
    pid_file = run_dir / f"{name}.pid"
    stop_replica(pid_file)
    if _answers(url) is not None:
        raise ReplicaError(
            f"{url} answers but no sim-server started by sim-restart for {name!r} runs "
            f"(no live pid in {pid_file}); stop that server first"
        )
    argv = [sys.executable, "-m", "specgov.simulator.server.cli", "--host", host]
    argv += [
        "--port",
        str(port),
        *(["--speculative-algorithm", PLAIN_ALGORITHM] * (mode == "plain")),
        "--startup-s",
        f"{simulated:g}",
    ]
    has_trace = any(a.split("=", 1)[0] == "--trace" for a in sim_args)
    argv += list(sim_args) if has_trace else ["--trace", "none", *sim_args]
    log_path = run_dir / f"{name}.log"
    started_s = time.monotonic()
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True
        )
    tmp = pid_file.with_name(pid_file.name + ".tmp")
    tmp.write_text(f"{proc.pid}\n")
    os.replace(tmp, pid_file)
    deadline = started_s + startup_wall_s + timeout_s
    while True:
        if proc.poll() is not None:
            pid_file.unlink(missing_ok=True)
            raise ReplicaError(
                f"the sim-server for {name!r} exited {proc.returncode} before it was healthy: "
                f"{_log_tail(log_path)}"
            )
        answer = _answers(url)
        if answer is not None and answer.status_code == 200:
            break
        if time.monotonic() >= deadline:
            stop_replica(pid_file)
            raise ReplicaError(
                f"{name!r} on {url} not healthy {timeout_s:g} s after its "
                f"{startup_wall_s:.1f} s start-up; stopped it"
            )
        time.sleep(POLL_S)
    came_up = _mode_of(url)
    if came_up != mode:
        stop_replica(pid_file)
        raise ReplicaError(f"{name!r} came up as {came_up}, not {mode}")
    return Started(proc.pid, url, mode, time.monotonic() - started_s, simulated)
