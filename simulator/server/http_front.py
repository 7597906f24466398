"""The simulated server's HTTP front: an aiohttp server on its own thread and loop.

Its own thread and asyncio loop let the server run from synchronous code and next to
another loop in the same process. An outage (:meth:`HttpFront.outage`) either closes
the port for a while (connections refused, keep-alive connections dropped; the runner is
closed and re-opened on the same port) or leaves it open while the application answers
503 (``outage_mode == "503"``, which the routes' middleware reads).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Final

from aiohttp import web

from specgov.adapters.http_listener import serve
from specgov.simulator.server.controls import OutageMode, SimServerError

logger = logging.getLogger(__name__)

# How long stop() and a synchronous outage() wait for the HTTP thread.
HTTP_JOIN_TIMEOUT_S: Final = 10.0
# Its clients: a daemon, probes, and generation clients (directly or through a gateway),
# each in-flight request one connection; as many as the live feed holds open
# (live.DEFAULT_MAX_OPEN). SGLang's own HTTP server caps none.
SIM_MAX_CONNECTIONS: Final = 4096


class HttpFront:
    """An aiohttp server on its own thread and event loop; can refuse connections for
    a while (its runner is closed and re-opened on the same port)."""

    def __init__(self, make_app: Callable[[], web.Application], host: str, port: int) -> None:
        self._make_app = make_app
        self.host = host
        self.port = port
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None
        self._outage_task: asyncio.Task[None] | None = None
        self._closing = False
        self.outage_mode: OutageMode | None = None
        self.outage_until_s: float | None = None

    @property
    def listening(self) -> bool:
        return self._runner is not None

    def start(self) -> None:
        ready = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
            self._loop = loop
            try:
                loop.run_until_complete(self._open())
            except BaseException as exc:
                failure.append(exc)
                ready.set()
                loop.close()
                return
            ready.set()
            try:
                loop.run_forever()
            finally:
                loop.run_until_complete(self._shutdown())
                loop.close()

        thread = threading.Thread(target=run, name="specgov-sim-http", daemon=True)
        self._thread = thread
        thread.start()
        ready.wait()
        if failure:
            thread.join()
            self._thread = None
            raise failure[0]

    async def _open(self) -> None:
        # Capped, with a header timeout and accept backoff (adapters/http_listener.py).
        runner, site = await serve(
            self._make_app(),
            self.host,
            self.port,
            name="sim-server",
            max_connections=SIM_MAX_CONNECTIONS,
            shutdown_timeout=1.0,
        )
        if self.port == 0:
            self.port = site.port
        self._runner = runner

    async def _close_runner(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    async def _shutdown(self) -> None:
        self._closing = True
        task = self._outage_task
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self._close_runner()

    def stop(self) -> None:
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        with contextlib.suppress(RuntimeError):  # loop already closed
            loop.call_soon_threadsafe(loop.stop)
        thread.join(HTTP_JOIN_TIMEOUT_S)
        self._thread = None

    def outage(self, seconds: float, mode: OutageMode) -> concurrent.futures.Future[None]:
        loop = self._loop
        if loop is None:
            raise SimServerError("the HTTP front is not running")
        if self.outage_mode is not None:
            raise SimServerError(f"an outage ({self.outage_mode}) is already in progress")
        # Set here, not in the task: a second call right after this one must see it.
        self.outage_mode = mode
        self.outage_until_s = time.time() + seconds
        began = threading.Event()
        future = asyncio.run_coroutine_threadsafe(self._outage(seconds, mode, began), loop)
        if threading.current_thread() is not self._thread:
            # In force when this returns (the port is closed), unless asked from a
            # handler on the loop itself, which must return first.
            began.wait(HTTP_JOIN_TIMEOUT_S)
        return future

    async def _outage(self, seconds: float, mode: OutageMode, began: threading.Event) -> None:
        self._outage_task = asyncio.current_task()
        try:
            if mode == "refuse":
                await self._close_runner()
            began.set()
            await asyncio.sleep(seconds)
        finally:
            began.set()
            self.outage_mode = None
            self.outage_until_s = None
            self._outage_task = None
            if mode == "refuse" and not self._closing:
                try:
                    await self._open()
                except OSError as exc:
                    logger.error("specgov sim-server: cannot re-open port %d: %s", self.port, exc)

    def end_outage(self) -> None:
        loop, task = self._loop, self._outage_task
        if loop is not None and task is not None:
            loop.call_soon_threadsafe(task.cancel)
