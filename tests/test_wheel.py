"""The released artefact: `python -m build` gives a wheel that works when installed.

Built once per session (sdist, then the wheel from the sdist, as a release does), installed
*not editable* into a fresh virtualenv, and run from a directory outside the repository,
so nothing can be found through the source tree or the editable install:

* the wheel carries every run-time file: the simulator catalog YAML (package data), the
  default config.yaml, the dashboard, the alert rules and the systemd unit (under
  ``<prefix>/share/specgov/``), and no test or cache file;
* ``specgov --help``, ``specgov replay synthetic:demo ...`` and the SGLang plugin entry
  point work from the fresh environment.

The fresh environment gets specgov from the wheel only; its third-party dependencies come
from this environment's site-packages through a ``.pth`` path line (a path line adds the
folder to ``sys.path`` without running that folder's own ``.pth`` files, so the
development tree's editable finder stays inactive). That keeps the test offline and under
a minute after the build; the test asserts that ``specgov`` itself resolves to the wheel.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import sysconfig
import textwrap
import threading
import time
import urllib.error
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SHARE_FILES = {
    "config.yaml": REPO / "config.yaml",
    "grafana/specgov-dashboard.json": REPO / "deploy/grafana/specgov-dashboard.json",
    "prometheus/specgov-alerts.yaml": REPO / "deploy/prometheus/specgov-alerts.yaml",
    "systemd/specgov.service": REPO / "deploy/systemd/specgov.service",
}
CATALOG = ("drafters.yaml", "gpus.yaml", "models.yaml")


@dataclass(frozen=True)
class Installed:
    wheel: Path
    prefix: Path
    python: Path
    specgov: Path
    workdir: Path

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        """A clean environment: no SPECGOV_* settings or PYTHONPATH from the test run."""
        base = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("SPECGOV_", "PYTHON")) and k != "VIRTUAL_ENV"
        }
        base["PATH"] = f"{self.prefix / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"
        base["MPLBACKEND"] = "Agg"
        return base | (extra or {})

    def run(
        self, *argv: str, env: dict[str, str] | None = None, timeout_s: float = 180
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            argv,
            cwd=self.workdir,
            env=self.env(env),
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )


def _check(done: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    assert done.returncode == 0, f"{done.args} exited {done.returncode}:\n{done.stderr[-3000:]}"
    return done


@pytest.fixture(scope="session")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    try:
        import build  # noqa: F401  (the dev extra's `build`)
    except ImportError:
        if os.environ.get("CI") or os.environ.get("SPECGOV_REQUIRE_DEPLOY_TOOLS"):
            pytest.fail("the `build` package is not installed (pip install -e '.[dev]')")
        pytest.skip("the `build` package is not installed (pip install -e '.[dev]')")
    root = tmp_path_factory.mktemp("wheel")
    dist = root / "dist"
    _check(
        subprocess.run(
            [sys.executable, "-m", "build", "--outdir", str(dist), str(REPO)],
            capture_output=True,
            text=True,
            timeout=600,
        )
    )
    [wheel] = dist.glob("specgov-*-py3-none-any.whl")
    prefix = root / "venv"
    _check(
        subprocess.run(
            [sys.executable, "-m", "venv", "--without-pip", str(prefix)],
            capture_output=True,
            text=True,
            timeout=120,
        )
    )
    python = prefix / "bin/python"
    pip = [sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet"]
    _check(
        subprocess.run(
            [*pip, "--no-deps", "--no-index", "--no-compile", str(wheel)],
            capture_output=True,
            text=True,
            timeout=300,
        )
    )
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    (Path(site) / "_dev_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    workdir = root / "elsewhere"
    workdir.mkdir()
    return Installed(wheel, prefix, python, prefix / "bin/specgov", workdir)


def test_wheel_carries_its_run_time_files(installed: Installed) -> None:
    with zipfile.ZipFile(installed.wheel) as zf:
        names = set(zf.namelist())
        data = "specgov-{}.data/data/share/specgov/".format(installed.wheel.name.split("-")[1])
        for rel, source in SHARE_FILES.items():
            assert zf.read(data + rel) == source.read_bytes(), rel
    for name in CATALOG:
        assert f"specgov/simulator/data/{name}" in names
    for package in ("policies", "adapters", "controller", "simulator"):
        assert f"specgov/{package}/py.typed" in names
    assert not [n for n in names if n.startswith(("tests/", "benchmarks/")) or ".cache" in n]
    assert not [n for n in names if n.endswith(".pyc")]
    meta = next(n for n in names if n.endswith(".dist-info/METADATA"))
    with zipfile.ZipFile(installed.wheel) as zf:
        metadata = zf.read(meta).decode()
        assert "License-Expression: Apache-2.0" in metadata
        assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    # Installed where docs/operations.md and the deploy files say.
    for rel, source in SHARE_FILES.items():
        assert (installed.prefix / "share/specgov" / rel).read_bytes() == source.read_bytes()


def test_specgov_resolves_to_the_wheel(installed: Installed) -> None:
    done = _check(
        installed.run(
            str(installed.python),
            "-c",
            "import specgov.controller.cli.main as c, importlib.metadata as m; "
            "print(c.__file__); print(m.version('specgov'))",
        )
    )
    path, version = done.stdout.split()
    assert Path(path).is_relative_to(installed.prefix), path
    assert version == installed.wheel.name.split("-")[1]


def test_help(installed: Installed) -> None:
    done = _check(installed.run(str(installed.specgov), "--help"))
    for command in ("run", "status", "replay", "doctor", "sim-server", "demo"):
        assert f"  {command} " in done.stdout, command


def test_replay_from_the_wheel(installed: Installed) -> None:
    """A replay reads the catalog YAML from the installed package (importlib.resources)."""
    done = _check(
        installed.run(
            str(installed.specgov),
            "replay",
            "synthetic:demo",
            "--policy",
            "static:3",
            "--policy",
            "sglang-ema",
            "--max-requests",
            "40",
            "--output",
            "json",
        )
    )
    report = json.loads(done.stdout)
    by_name = {p["name"]: p for p in report["policies"]}
    assert set(by_name) == {"static:3", "sglang-ema"}
    assert all(p["completed_requests"] == 40 for p in by_name.values())
    assert report["server"]["gpu"] == "h100"


def test_plugin_entry_point_from_the_wheel(installed: Installed, sglang_src: Path) -> None:
    """SGLang's loader finds the entry point in the fresh environment, and register()
    REPLACEs AdaptiveSpeculativeParams in SGLang's real HookRegistry (its file from the
    0.5.23 wheel, stdlib-only, on a stub package path: importing sglang needs torch)."""
    stub = installed.workdir / "sglang-stub"
    plugins = stub / "sglang/srt/plugins"
    plugins.mkdir(parents=True, exist_ok=True)
    for pkg in (stub / "sglang", stub / "sglang/srt", plugins):
        (pkg / "__init__.py").write_text("")
    hooks = sglang_src / "sglang/srt/plugins/hook_registry.py"
    (plugins / "hook_registry.py").write_text(hooks.read_text())
    script = textwrap.dedent(
        """
        from importlib.metadata import entry_points
        from sglang.srt.plugins.hook_registry import HookRegistry
        [ep] = [e for e in entry_points(group="sglang.srt.plugins") if e.name == "specgov"]
        ep.load()()
        target = "sglang.srt.speculative.adaptive_spec_params.AdaptiveSpeculativeParams"
        [(kind, cls, _source)] = HookRegistry._hooks[target]
        import sys
        print(ep.value, kind.name, cls.__module__, sys.modules[cls.__module__].__file__)
        """
    )
    done = _check(installed.run(str(installed.python), "-c", script, env={"PYTHONPATH": str(stub)}))
    value, kind, module, path = done.stdout.split()
    assert value == "specgov.adapters.sglang_plugin:register"
    assert kind == "REPLACE" and module == "specgov.adapters.sglang_plugin"
    assert Path(path).is_relative_to(installed.prefix)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _first_line(proc: subprocess.Popen[str], pattern: str, timeout_s: float) -> re.Match[str]:
    """The first stdout line of ``proc`` matching ``pattern``, waited for up to a deadline."""
    lines: queue.Queue[str] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while True:
        remaining = deadline - time.monotonic()
        assert remaining > 0 and proc.poll() is None, f"no line matching {pattern!r}"
        try:
            m = re.search(pattern, lines.get(timeout=min(remaining, 1.0)))
        except queue.Empty:
            continue
        if m is not None:
            return m


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_from_the_wheel_to_a_daemon_in_observe_mode(installed: Installed) -> None:
    """docs/operations.md's path with the installed wheel only: a server (the sim-server
    with the plugin), `specgov doctor`, `specgov run --mode observe`, its health, status
    and /metrics (every specgov metric the dashboard and alert rules name is served)."""
    from test_dashboards import dashboard_exprs, metric_names, rule_exprs

    spool = installed.workdir / "observe-spool"
    spool.mkdir(mode=0o700, exist_ok=True)
    sim = subprocess.Popen(
        [str(installed.specgov), "sim-server", "--port", "0", "--speed", "10", "--loop",
         "--spool-dir", str(spool)],
        cwd=installed.workdir, env=installed.env(), stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    daemon: subprocess.Popen[str] | None = None
    try:
        url = _first_line(sim, r"server on (http://\S+)", 120).group(1)
        control, metrics = _free_port(), _free_port()
        daemon = subprocess.Popen(
            [str(installed.specgov), "run", "--server", url, "--mode", "observe",
             "--spool-dir", str(spool), "--state-db", str(installed.workdir / "state.db"),
             "--control-addr", f"127.0.0.1:{control}", "--metrics-addr", f"127.0.0.1:{metrics}"],
            cwd=installed.workdir, env=installed.env(), stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        deadline = time.monotonic() + 120
        status: dict[str, object] = {}
        while True:
            assert daemon.poll() is None, "the daemon exited"
            assert time.monotonic() < deadline, f"no decision within 120 s: {status}"
            code, body = (0, "")
            with contextlib.suppress(OSError):
                code, body = _get(f"http://127.0.0.1:{control}/v1/status")
            if code == 200:
                status = json.loads(body)
                if status.get("last_decision"):
                    break
            time.sleep(0.2)
        assert status["mode"] == "observe"
        doctor = installed.run(
            str(installed.specgov), "doctor", "--server", url, "--spool-dir", str(spool)
        )
        assert doctor.returncode == 0, doctor.stdout + doctor.stderr
        code, exposition = _get(f"http://127.0.0.1:{metrics}/metrics")
        assert code == 200
        families = set(re.findall(r"^# TYPE (\S+) ", exposition, flags=re.M))
        samples = set(re.findall(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)[ {]", exposition, flags=re.M))
        named = {
            n
            for expr in [e for _, e in dashboard_exprs()] + rule_exprs()
            for n in metric_names(expr)
            if n.startswith("specgov")
        }
        suffixes = ("_total", "_bucket", "_sum", "_count", "_created", "_info")
        # The fleet row's metrics are the fleet governor's (`specgov fleet run`), not the
        # daemon's; tests/test_dashboards.py checks that registry serves them.
        unserved = sorted(
            n
            for n in named
            if n not in samples
            and not any(n.removesuffix(x) in families for x in suffixes)
            and not n.startswith("specgov_fleet_")
        )
        assert not unserved, f"the installed daemon does not serve {unserved}"
    finally:
        for proc in (daemon, sim):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in (daemon, sim):
            if proc is not None:
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
    assert daemon.returncode == 0, daemon.stderr.read() if daemon.stderr else ""
