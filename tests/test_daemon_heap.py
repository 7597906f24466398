"""`specgov run` freezes its start-up heap before the loop starts (daemon/serve.py)."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any

import pytest
from click.testing import CliRunner

from specgov.controller.cli import daemon_cmds
from specgov.controller.daemon import serve


@pytest.fixture
def unfrozen() -> Iterator[None]:
    gc.unfreeze()
    yield
    gc.unfreeze()  # the test process goes on collecting as before


def test_freeze_startup_heap_moves_live_objects_out_of_the_collector(unfrozen: None) -> None:
    before = gc.get_freeze_count()
    kept = [[i] for i in range(1000)]  # alive at "start-up"
    serve.freeze_startup_heap({"control": "127.0.0.1:0"})
    assert gc.get_freeze_count() >= before + len(kept)
    # A later cycle is still collected: only what lived at the freeze is exempt.
    cycle: list[Any] = []
    cycle.append(cycle)
    del cycle
    assert gc.collect() >= 1


def test_run_freezes_the_heap_once_the_daemon_is_built(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    seen: dict[str, Any] = {}

    async def fake_serve(config: Any, *, ready: Any = None) -> int:
        seen["config"], seen["ready"] = config, ready
        return 0

    monkeypatch.setattr(serve, "serve_daemon", fake_serve)
    # The command's own logging set-up would replace the test process's handlers.
    monkeypatch.setattr(daemon_cmds, "_configure_logging", lambda fmt, level: None)
    result = CliRunner().invoke(
        daemon_cmds.run_cmd, ["--state-db", str(tmp_path / "s.db"), "--policy", "goodput"]
    )
    assert result.exit_code == 0, result.output
    assert seen["ready"] is serve.freeze_startup_heap
    assert seen["config"].state.db_path == tmp_path / "s.db"
