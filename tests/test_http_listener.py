"""Bounded connections (issue 23 §4): the listeners of the control API, the metrics port
and the sim-server (adapters/http_listener.py), flooded on loopback with a bounded
number of connections for a bounded time.

Before this change they were aiohttp's ``TCPSite``: no cap (20,117 idle connections
exhausted the descriptors, asyncio logged ``socket.accept() out of system resource``
656,767 times and health stopped answering), and a connection trickling its headers was
kept for aiohttp's 75 s keep-alive timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import socket
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp import ClientSession, ClientTimeout, web
from prometheus_client import CollectorRegistry

from specgov.adapters import http_listener
from specgov.adapters.http_listener import BoundedSite, serve
from specgov.controller.daemon.config import load_config
from specgov.controller.daemon.control_api import make_app
from specgov.controller.daemon.runtime import Daemon

HOST = "127.0.0.1"
# Deadlines, not expectations: they bound how long a broken build takes to fail.
DEADLINE_S = 30.0


def _ping_app(gate: asyncio.Event | None = None) -> web.Application:
    async def ping(request: web.Request) -> web.Response:
        if gate is not None and request.query.get("wait"):
            await gate.wait()
        return web.Response(text="pong")

    app = web.Application()
    app.router.add_get("/ping", ping)
    return app


async def _idle_connections(port: int, count: int) -> list[tuple[Any, Any]]:
    """``count`` connections that send nothing (each is accepted before the next)."""
    conns = []
    for _ in range(count):
        conns.append(await asyncio.open_connection(HOST, port))
    return conns


def _close_all(conns: list[tuple[Any, Any]]) -> None:
    for _, writer in conns:
        writer.close()


async def _get(port: int, path: str, timeout_s: float) -> tuple[int, str]:
    async with (
        ClientSession(timeout=ClientTimeout(total=timeout_s)) as session,
        session.get(f"http://{HOST}:{port}{path}") as reply,
    ):
        return reply.status, await reply.text()


def _run(coro: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(coro(), DEADLINE_S))


def _listener(site: BoundedSite) -> Any:
    assert site.listener is not None
    return site.listener


def test_a_flood_of_idle_connections_past_the_cap_does_not_lock_out_a_request() -> None:
    async def go() -> None:
        runner, site = await serve(_ping_app(), HOST, 0, name="test", max_connections=8)
        try:
            flood = await _idle_connections(site.port, 40)
            await asyncio.sleep(0)  # let the listener see the last ones
            listener = _listener(site)
            for _ in range(5):
                assert await _get(site.port, "/ping", timeout_s=1.0) == (200, "pong")
            assert len(listener.live) <= 8
            assert listener.evicted >= 40 - 8
            _close_all(flood)
        finally:
            await runner.cleanup()

    _run(go)


def test_when_every_connection_is_busy_a_new_one_is_refused_not_queued() -> None:
    async def go() -> None:
        gate = asyncio.Event()
        runner, site = await serve(_ping_app(gate), HOST, 0, name="test", max_connections=2)
        try:
            busy = [asyncio.create_task(_get(site.port, "/ping?wait=1", 20.0)) for _ in range(2)]
            listener = _listener(site)
            while sum(g.headers_done for g in listener.live) < 2:
                await asyncio.sleep(0.01)  # the poll period until both are in
            reader, writer = await asyncio.open_connection(HOST, site.port)
            assert await asyncio.wait_for(reader.read(), 10.0) == b""  # closed at once
            writer.close()
            assert listener.refused == 1
            gate.set()
            assert [await t for t in busy] == [(200, "pong")] * 2  # untouched
        finally:
            await runner.cleanup()

    _run(go)


def test_a_connection_trickling_its_headers_is_cut_off_at_the_idle_timeout() -> None:
    async def go() -> None:
        runner, site = await serve(_ping_app(), HOST, 0, name="test", idle_timeout_s=0.5)
        try:
            reader, writer = await asyncio.open_connection(HOST, site.port)
            writer.write(b"GET /ping HTTP/1.1\r\n")
            started = time.monotonic()
            closed = False
            while not closed:
                writer.write(b"X")  # one header byte every 0.1 s, never the blank line
                try:
                    await writer.drain()
                    closed = await asyncio.wait_for(reader.read(1), 0.1) == b""
                except TimeoutError:
                    pass
                except ConnectionError:
                    closed = True
            # aiohttp's default would keep it 75 s; the listener's bound is 0.5 s.
            assert time.monotonic() - started < 20.0
            writer.close()
        finally:
            await runner.cleanup()

    _run(go)


def test_accept_errors_back_off_and_log_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Out of descriptors: the listener waits 50 ms, 100 ms, ... between tries and logs
    one line, instead of a line per try in a tight loop."""
    caplog.set_level(logging.WARNING, logger=http_listener.__name__)

    async def go() -> None:
        loop = asyncio.get_running_loop()
        real = loop.sock_accept
        failures = {"left": 5}

        async def failing(sock: socket.socket) -> tuple[socket.socket, Any]:
            if failures["left"]:
                failures["left"] -= 1
                raise OSError(errno.EMFILE, "Too many open files")
            return await real(sock)

        monkeypatch.setattr(loop, "sock_accept", failing)
        started = time.monotonic()
        runner, site = await serve(_ping_app(), HOST, 0, name="test")
        try:
            assert await _get(site.port, "/ping", timeout_s=20.0) == (200, "pong")
            # 0.05 + 0.1 + 0.2 + 0.4 + 0.8 s of backoff before the accept that worked.
            assert time.monotonic() - started >= 1.5
            assert _listener(site).accept_errors == 5
        finally:
            await runner.cleanup()

    _run(go)
    lines = [r for r in caplog.records if "cannot accept" in r.getMessage()]
    assert len(lines) == 1 and "Too many open files" in lines[0].getMessage()


def test_a_bad_cap_is_refused() -> None:
    async def go() -> None:
        runner = web.AppRunner(_ping_app())
        await runner.setup()
        try:
            with pytest.raises(ValueError, match="max_connections: expected an int >= 1"):
                BoundedSite(runner, HOST, 0, name="t", max_connections=0)
        finally:
            await runner.cleanup()

    _run(go)


def test_a_flooded_control_listener_leaves_health_and_the_decision_cadence_alone(
    tmp_path: Path,
) -> None:
    """The daemon's own listener (serve, as `specgov run` starts it, default cap 64)
    flooded with 200 idle loopback connections: health answers within 1 s each time and
    the decision loop keeps ticking every 0.25 s."""
    config = load_config(
        None,
        env={},
        overrides={
            "server.url": "http://127.0.0.1:9",  # no server: every decision holds
            "state.db_path": str(tmp_path / "state.db"),
            "spool.dir": str(tmp_path / "spool"),
            "loop.decide_interval_s": 0.25,
            "loop.scrape_interval_s": 0.25,
            "recommend.enabled": False,
        },
    )
    daemon = Daemon(config, store=None, registry=CollectorRegistry())

    async def go() -> None:
        app = make_app(daemon, token=None, listen_host=HOST)
        runner, site = await serve(app, HOST, 0, name="control")
        run = asyncio.create_task(daemon.run(install_signals=False))
        try:
            flood = await _idle_connections(site.port, 200)
            before = daemon.status_info.decisions
            t0 = time.monotonic()
            for _ in range(8):
                status, _ = await _get(site.port, "/v1/health/live", timeout_s=1.0)
                assert status == 200
                await asyncio.sleep(0.25)
            elapsed_s = time.monotonic() - t0
            made = daemon.status_info.decisions - before
            # A tick every 0.25 s: at least half of them while flooded and probed.
            assert made >= int(elapsed_s / 0.25 * 0.5), (made, elapsed_s)
            assert len(_listener(site).live) <= 64
            _close_all(flood)
        finally:
            daemon.request_stop()
            await run
            await runner.cleanup()

    _run(go)


def test_the_sim_servers_front_is_bounded_too() -> None:
    """The sim-server's HTTP front (its own thread and loop) serves through the same
    listener: 150 idle connections past its cap of 128 leave a request answered."""
    import urllib.request

    from specgov.simulator.server.http_front import SIM_MAX_CONNECTIONS, HttpFront

    front = HttpFront(_ping_app, HOST, 0)
    front.start()
    flood: list[socket.socket] = []
    try:
        for _ in range(SIM_MAX_CONNECTIONS + 22):
            flood.append(socket.create_connection((HOST, front.port), timeout=10.0))
        for _ in range(3):
            with urllib.request.urlopen(f"http://{HOST}:{front.port}/ping", timeout=1.0) as r:
                assert r.status == 200 and r.read() == b"pong"
        # The oldest idle ones made room: closed by the server (aiohttp alone kept them).
        flood[0].settimeout(10.0)
        with contextlib.suppress(ConnectionResetError):  # a reset is closed all the same
            assert flood[0].recv(1) == b""
    finally:
        for sock in flood:
            sock.close()
        front.stop()
