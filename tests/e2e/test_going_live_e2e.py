"""The deploy kit's documented way to go live, and a reload that keeps the flags (issue 23).

§1: the Docker image's and the systemd unit's command lines are read from the files
(ENTRYPOINT + CMD + ENV; ExecStart + Environment), given the change the docs tell an
operator to make (``SPECGOV_LOOP__MODE=plugin``, or ``loop.mode: plugin`` in the config
file), and resolved the way ``specgov run`` resolves them; then each is run against the
sim-server, and the daemon must publish a step table (plugin mode).

§5: a SIGHUP reload re-reads the file but keeps what the command line asked for (flags win
over the file, as at start), logs each changed setting, and refuses a file that does not
validate, keeping the running configuration.

Paths the image and the unit name (/etc/specgov, /run/specgov, /var/lib/specgov) are
mapped into tmp_path and the listen ports to free ones: the only substitutions. The spool
group is dropped: here one user runs server and daemon (docs/spool-security.md covers two).
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml
from test_deploy import parse_dockerfile, unit_keys

from specgov.controller.cli.daemon_cmds import run_cmd, run_overrides
from specgov.controller.daemon.config import load_config

from .conftest import (
    BASE_CONFIG,
    E2E,
    HOST,
    DaemonProc,
    SimServerProc,
    deep_merge,
    free_port,
    specgov_argv,
    wait_until,
)

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "deploy/docker/Dockerfile"
UNIT = REPO / "deploy/systemd/specgov.service"
PACKAGED_CONFIG = REPO / "config.yaml"
STEADY_TRACE = "synthetic:duration=120,rate=2,phases=chat@120,seed=2"


def image_command() -> tuple[list[str], dict[str, str]]:
    """The image's command line (ENTRYPOINT + CMD) and environment (ENV)."""
    steps = parse_dockerfile(DOCKERFILE.read_text())
    entry = json.loads(next(v for k, v in steps if k == "ENTRYPOINT"))
    cmd = json.loads([v for k, v in steps if k == "CMD"][-1])
    env = dict(
        item.split("=", 1) for v in (v for k, v in steps if k == "ENV") for item in v.split()
    )
    return [*entry, *cmd], env


def unit_command() -> tuple[list[str], dict[str, str]]:
    """The unit's ExecStart (the executable as `specgov`) and its Environment= lines."""
    keys = unit_keys(UNIT.read_text())
    (exec_start,) = keys["ExecStart"]
    argv = shlex.split(exec_start)
    assert Path(argv[0]).name == "specgov", argv
    env = dict(item.split("=", 1) for item in keys["Environment"])
    return ["specgov", *argv[1:]], env


COMMANDS = {"image": image_command, "unit": unit_command}


def _relocate(text: str, root: Path) -> str:
    """A path of the image or the unit, moved under ``root``."""
    for prefix in ("/etc/specgov", "/run/specgov", "/var/lib/specgov"):
        if text.startswith(prefix):
            return str(root / prefix.strip("/").replace("/", "-")) + text[len(prefix) :]
    return text


def _config_text(*, live: bool, extra: Mapping[str, Any]) -> str:
    """The packaged config.yaml (what both images install), with the documented edit
    (``mode: observe`` -> ``mode: plugin`` under ``loop:``) when ``live``."""
    text = PACKAGED_CONFIG.read_text()
    if live:
        assert text.count("\n  mode: observe\n") == 1
        text = text.replace("\n  mode: observe\n", "\n  mode: plugin\n")
    data = deep_merge(yaml.safe_load(text), extra)
    return yaml.safe_dump(data, sort_keys=False)


def _prepare(
    which: str, change: str, root: Path, extra: Mapping[str, Any] | None = None
) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of ``which`` after the operator's ``change``
    (``none``, ``env``: SPECGOV_LOOP__MODE=plugin, ``file``: loop.mode: plugin), paths
    under ``root``. The config file named on the command line is written there."""
    argv, env = COMMANDS[which]()
    argv = [_relocate(a, root) for a in argv]
    env = {k: _relocate(v, root) for k, v in env.items() if k != "SPECGOV_SPOOL__GROUP"}
    config_path = Path(argv[argv.index("--config") + 1])
    config_path.parent.mkdir(parents=True, exist_ok=True)
    config_path.write_text(_config_text(live=change == "file", extra=extra or {}))
    if change == "env":
        env["SPECGOV_LOOP__MODE"] = "plugin"
    return argv, env


@pytest.mark.parametrize("which", sorted(COMMANDS))
@pytest.mark.parametrize(
    ("change", "mode"), [("none", "observe"), ("env", "plugin"), ("file", "plugin")]
)
def test_the_documented_change_sets_the_mode(
    which: str, change: str, mode: str, tmp_path: Path
) -> None:
    """Resolved as `specgov run` resolves it: its flags (click), then load_config."""
    argv, env = _prepare(which, change, tmp_path)
    assert argv[:2] == ["specgov", "run"], argv
    params = run_cmd.make_context("run", argv[2:]).params
    config = load_config(Path(params["config_file"]), env=env, overrides=run_overrides(params))
    assert config.loop.mode == mode, (which, change, config.sources.get("loop.mode"))


def _run_live(e2e: E2E, which: str, change: str) -> tuple[DaemonProc, SimServerProc]:
    root = e2e.root / which
    spool = Path(_relocate("/run/specgov/spool", root))
    sim = e2e.start_sim(STEADY_TRACE, speed=10.0, loop=True, spool_dir=spool)
    control, metrics = f"{HOST}:{free_port()}", f"{HOST}:{free_port()}"
    # The test's fast loop; the server as the docs say to give it (the image: -e
    # SPECGOV_SERVER__URL; the unit: server.url in its config file).
    extra: dict[str, Any] = dict(BASE_CONFIG)
    if which == "unit":
        extra = deep_merge(extra, {"server": {"url": sim.url}})
    argv, env = _prepare(which, change, root, extra)
    env["SPECGOV_CONTROL__LISTEN"] = control
    env["SPECGOV_METRICS__LISTEN"] = metrics
    if which == "image":
        env["SPECGOV_SERVER__URL"] = sim.url
    env.setdefault("SPECGOV_SPOOL__DIR", str(spool))
    env.setdefault("SPECGOV_STATE__DB_PATH", str(root / "state" / "state.db"))
    (root / "state").mkdir(parents=True, exist_ok=True)
    proc = e2e.start_process(f"daemon-{which}", [*specgov_argv(), *argv[1:]], env)
    daemon = DaemonProc(proc, control, metrics, Path(env["SPECGOV_STATE__DB_PATH"]), spool)
    daemon.wait_ready()
    return daemon, sim


@pytest.mark.parametrize(("which", "change"), [("image", "env"), ("unit", "file")])
def test_the_documented_path_publishes_tables(e2e: E2E, which: str, change: str) -> None:
    daemon, sim = _run_live(e2e, which, change)
    assert daemon.status()["mode"] == "plugin"
    table = wait_until(sim.spool_table, what="a step table in the spool")
    assert table["slots"], table
    assert "specgov plugin mode" in daemon.proc.log_text()


def _log_line(daemon: DaemonProc, text: str) -> str | None:
    found = [line for line in daemon.proc.log_text().splitlines() if text in line]
    return "\n".join(found) or None


def test_reload_keeps_the_command_line(e2e: E2E) -> None:
    sim = e2e.start_sim(STEADY_TRACE, speed=10.0, loop=True)
    config = e2e.write_config()
    daemon = e2e.start_daemon(sim, config=config, policy="static:2")  # --mode plugin
    wait_until(sim.spool_table, what="the first table")
    # The file now asks for observe mode and another server and policy; the flags
    # (--mode plugin, --server, --policy static:2) must still win, the rest applies.
    edited = deep_merge(
        yaml.safe_load(config.read_text()),
        {
            "loop": {"mode": "observe", "decide_interval_s": 2},
            "server": {"url": "http://127.0.0.1:1"},
            "policy": {"spec": "goodput"},
        },
    )
    config.write_text(yaml.safe_dump(edited, sort_keys=False))
    reloaded_at = time.time()
    os.kill(daemon.proc.pid, signal.SIGHUP)
    changed = wait_until(
        lambda: _log_line(daemon, "configuration reloaded: "), what="the reload's log lines"
    )
    assert "loop.decide_interval_s: 1.0 -> 2.0" in changed, changed
    assert "loop.mode" not in changed and "server.url" not in changed, changed
    status = daemon.status()
    assert (status["mode"], status["server"], status["policy"]) == ("plugin", sim.url, "static:2")
    # Still live: tables keep going out after the reload.
    row = daemon.first_decision_after(reloaded_at, published=True)
    assert row["policy"] == "static:2", row

    # A file that does not validate is refused, saying why; the running config stays.
    config.write_text("loop:\n  decide_interval_s: soon\n")
    os.kill(daemon.proc.pid, signal.SIGHUP)
    rejected = wait_until(
        lambda: _log_line(daemon, "config reload rejected"), what="the rejection's log line"
    )
    assert "loop.decide_interval_s" in rejected, rejected
    status = daemon.status()
    assert status["mode"] == "plugin" and any("reload rejected" in n for n in status["notes"])
