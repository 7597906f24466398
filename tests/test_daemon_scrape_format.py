"""Issue 9: a malformed or truncated /metrics body is a temporary error of kind "format"
(counted under specgov_scrape_errors_total{kind="format"}, never "permanent"), so the
last good table is kept alive like an outage; the log line and status escape its bytes."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from specgov.adapters.sglang_http import SGLangClient
from specgov.controller.daemon.config import load_config
from specgov.controller.daemon.runtime import Daemon


def _scrape_once_answered_by(tmp_path: Path, respond: Callable[[], httpx.Response]) -> Daemon:
    """A daemon whose server answers every request with a fresh ``respond()``, after one
    scrape (which must yield no telemetry)."""
    config = load_config(None, env={}, overrides={"state.db_path": str(tmp_path / "s.db")})
    transport = httpx.MockTransport(lambda r: respond())
    client = SGLangClient(config.server.url, rng=random.Random(0), transport=transport, retries=0)
    daemon = Daemon(config, store=None, client=client)

    async def go() -> None:
        try:
            assert await daemon.scrape_once() is None
        finally:
            await client.aclose()

    asyncio.run(go())
    return daemon


@pytest.mark.parametrize(
    "body",
    [
        b"<html>502 Bad Gateway</html>",
        b'# TYPE sglang:num_running_reqs gauge\nsglang:num_running_reqs{tp_rank="0"',  # cut
        b'sglang:num_running_reqs{x="\x00\x1b[2J\r"} 1\n'
        b'sglang:num_running_reqs{x="\x00\x1b[2J\r"} 2\n',
    ],
)
def test_a_malformed_metrics_body_counts_as_format_not_permanent(
    tmp_path: Path, body: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        daemon = _scrape_once_answered_by(tmp_path, lambda: httpx.Response(200, content=body))
    sample = daemon.registry.get_sample_value
    assert sample("specgov_scrape_errors_total", {"kind": "format"}) == 1.0
    assert sample("specgov_scrape_errors_total", {"kind": "permanent"}) == 0.0
    assert daemon.status_info.permanent_error is None  # publishing is not blocked
    error = daemon.status_info.last_scrape_error
    assert error is not None and error.startswith("malformed response: ")
    for text in [error, *(r.getMessage() for r in caplog.records)]:
        assert "\x00" not in text and "\x1b" not in text and "\r" not in text


def test_a_restart_continues_from_a_spool_table_newer_than_the_store(tmp_path: Path) -> None:
    # kill -9 between writing a table into the spool and recording it: the store is a
    # table behind the engine. The restarted daemon must take the spool's table as the
    # one in force, so its next version is newer than what the engine follows (an e2e
    # run under load published a second, different v9).
    from specgov.adapters.spool_table import write_step_table
    from specgov.policies.common.step_table import StepTable

    spool = tmp_path / "spool"
    table = StepTable(((1, 3), (8, 1)), version=9, produced_at_s=100.0, ttl_s=30.0)
    write_step_table(spool, table, [0, 1, 3], written_at_s=100.0)
    config = load_config(
        None,
        env={},
        overrides={
            "state.db_path": str(tmp_path / "s.db"),
            "spool.dir": str(spool),
            "loop.mode": "plugin",
        },
    )
    daemon = Daemon(config, store=None)
    assert daemon.core_state.table == table
    # Observe mode publishes nothing and adopts nothing; a spool others can write is not
    # trusted; a torn file is ignored (the daemon starts from its store, here empty).
    observe = dataclasses.replace(config, loop=dataclasses.replace(config.loop, mode="observe"))
    assert Daemon(observe, store=None).core_state.table is None
    spool.chmod(0o777)
    assert Daemon(config, store=None).core_state.table is None
    spool.chmod(0o700)
    (spool / "step_table.json").write_bytes(b'{"table": {"slo')
    assert Daemon(config, store=None).core_state.table is None


def test_a_body_that_cannot_be_decoded_is_a_format_error_not_a_crash(tmp_path: Path) -> None:
    # `Content-Encoding: gzip` on bytes that are not gzip: httpx raises a DecodingError
    # (not a TransportError); it used to escape scrape_once and end the scrape task.
    daemon = _scrape_once_answered_by(
        tmp_path,
        lambda: httpx.Response(200, content=b"not gzip", headers={"Content-Encoding": "gzip"}),
    )
    sample = daemon.registry.get_sample_value
    assert sample("specgov_scrape_errors_total", {"kind": "format"}) == 1.0
    assert "cannot be decoded" in (daemon.status_info.last_scrape_error or "")


def test_the_dashboards_goodput_and_mode_series_are_exported_by_a_deciding_daemon(
    tmp_path: Path,
) -> None:
    from specgov.policies.common.step_table import StepTable
    from specgov.policies.control.core import AuditRecord

    config = load_config(
        None,
        env={},
        overrides={"state.db_path": str(tmp_path / "s.db"), "loop.mode": "plugin"},
    )
    daemon = Daemon(config, store=None)
    import prometheus_client

    def exported() -> str:
        return str(prometheus_client.generate_latest(daemon.registry).decode())

    # The alert "table expired (plugin on fallback)" selects specgov_info{mode="plugin"}.
    assert 'specgov_info{mode="plugin",policy="goodput"' in exported()
    table = StepTable(((1, 3), (8, 1)), version=2, produced_at_s=10.0, ttl_s=30.0)
    daemon._record(
        AuditRecord(
            time_s=10.0,
            policy="goodput",
            reason="changed_predicted_gain",
            message="x",
            limited_by=(),
            expected_gain=0.1,
            inputs_summary={"gen_throughput_tok_s": 1000.0, "accept_length": 2.5, "running": 12},
            table_before=None,
            table_after=table,
            published=True,
            table_in_force=table,
            predicted_goodput_tok_s=1100.0,
        )
    )
    text = exported()
    assert "specgov_goodput_observed_tokens_per_second 1000.0" in text
    assert "specgov_goodput_predicted_tokens_per_second 1100.0" in text
    assert 'specgov_accept_length_estimate{slot="8"} 2.5' in text
