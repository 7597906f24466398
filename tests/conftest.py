"""Shared fixtures: where the real SGLang wheel and the public traces live.

Both live outside the repository. Locally a missing one skips the tests that
need it with a reason; CI sets SPECGOV_REQUIRE_SGLANG / SPECGOV_REQUIRE_SHARED_DATA
so that a missing one fails instead.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from specgov.controller.fleet.gateway import SmgGateway
    from specgov.simulator.server.core import SimServer

REPO_ROOT = Path(__file__).resolve().parent.parent


def _missing(reason: str, require_env: str) -> None:
    if os.environ.get(require_env):
        pytest.fail(f"{reason} ({require_env} is set, so this is an error)")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def sglang_src() -> Path:
    """Root of the unpacked sglang==0.5.23 wheel (the folder holding `sglang/`)."""
    raw = os.environ.get("SPECGOV_SGLANG_SRC", str(REPO_ROOT / ".cache/sglang-0.5.23/x"))
    root = Path(raw)
    if not (root / "sglang/srt/speculative/adaptive_spec_params.py").is_file():
        _missing(
            f"sglang 0.5.23 wheel not unpacked at {root} (run `make sglang-src`)",
            "SPECGOV_REQUIRE_SGLANG",
        )
    return root


@pytest.fixture(scope="session")
def azure_trace_dir() -> Path:
    """Folder with the public Azure LLM inference traces (never copied here)."""
    raw = os.environ.get("SPECGOV_SHARED_DATA", str(REPO_ROOT.parent / "shared/data"))
    folder = Path(raw) / "traces/azure-llm-2023"
    if not (folder / "AzureLLMInferenceTrace_conv.csv").is_file():
        _missing(f"Azure traces not found under {folder}", "SPECGOV_REQUIRE_SHARED_DATA")
    return folder


@pytest.fixture(scope="session")
def smg_binary() -> Path:
    """The `smg` gateway binary (the optional extra specgov[fleet], PyPI smg==1.13.0):
    next to this interpreter (a virtualenv's bin/) or on PATH."""
    import shutil
    import sys

    local = Path(sys.executable).parent / "smg"
    found = str(local) if local.is_file() else shutil.which("smg")
    if found is None:
        _missing(
            "the smg gateway is not installed (pip install -e '.[fleet]')",
            "SPECGOV_REQUIRE_SMG",
        )
    return Path(str(found))


SMG_DEADLINE_S = 60.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def smg_gateway(
    smg_binary: Path, worker_urls: list[str]
) -> contextlib.AbstractContextManager[SmgGateway]:
    """A real smg gateway (round robin) over ``worker_urls``, each healthy in it, and the
    governor's client of it; the gateway is stopped on exit."""
    from specgov.controller.fleet.gateway import launched_smg

    return launched_smg(
        smg_binary,
        worker_urls,
        port=_free_port(),
        metrics_port=_free_port(),
        healthy_within_s=SMG_DEADLINE_S,
    )


@pytest.fixture()
def smg_launch(
    smg_binary: Path,
) -> Callable[[list[str]], contextlib.AbstractContextManager[SmgGateway]]:
    """:func:`smg_gateway` on the installed binary: ``with smg_launch(urls) as gw``."""
    return lambda urls: smg_gateway(smg_binary, urls)


@pytest.fixture()
def free_port() -> Callable[[], int]:
    """A free loopback port (for a server the test starts)."""
    return _free_port


@pytest.fixture()
def smg_fleet(smg_binary: Path) -> Iterator[tuple[SmgGateway, list[SimServer]]]:
    """Two sim-servers (no trace, speed 2) behind a real smg gateway (round robin), and
    the governor's client of that gateway."""
    from specgov.simulator.server.core import SimServer

    servers = [SimServer([], speed=2.0, seed=i) for i in range(2)]
    try:
        for s in servers:
            s.start()
            s.wait_ready()
        with smg_gateway(smg_binary, [s.url for s in servers]) as gw:
            yield gw, servers
    finally:
        for s in servers:
            s.stop()


# The fast tier (`make test-fast`, the inner loop) leaves these out: end-to-end runs of the
# real processes, the wheel build, property tests and the replay-heavy modules (chosen from
# `pytest --durations` on the 2-core machine: processes, process pools, kill -9, HTTP
# fronts, plots, planning sweeps and oracle replays). `make test` (CI) runs everything.
INTEGRATION_MODULES = frozenset(
    {
        "test_wheel.py",
        "test_fit_acceptance.py",
        "test_policy_benchmark.py",
        "test_recommend.py",
        "test_replay_cli.py",
        "test_replay_prior.py",
        "test_plan_sweep.py",
        "test_plan_report.py",
        "test_plan_ray.py",
        "test_acceptance_runs.py",
        "test_daemon.py",
        "test_control_api.py",
        "test_sim_server.py",
        "test_sim_generate.py",
        "test_tp_broadcast.py",
        "test_measure_step_cost.py",
        "test_spool_security.py",
        "test_plan_fleet_cli.py",
        "test_plan_fleet.py",
        "test_oracle.py",
        "test_http_listener.py",
        "test_faults.py",
        "test_plots.py",
        "test_plan_executor.py",
        "test_plan_resume.py",
        "test_store_faults.py",
        "test_hicache.py",
        "test_state_store_crash.py",
        "test_plan_simplicity.py",
    }
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        path = Path(str(item.fspath))
        if (
            "e2e" in path.parts
            or path.name in INTEGRATION_MODULES
            or path.name.endswith("_properties.py")
            or path.name.startswith("test_fleet_")
        ):
            item.add_marker(pytest.mark.integration)
