"""Bounded HTTP listeners: the daemon's control API and metrics port, the sim-server.

Issue 23 §4: 20,117 idle loopback connections made asyncio log ``socket.accept() out of
system resource`` 656,767 times (a 291 MB log in ~75 s), health stopped answering and no
table was published for ~60 s; 1,100 header-trickling connections were all still open
after 60 s. :func:`serve` replaces ``web.TCPSite`` with a listener that

* caps the connections it holds (``max_connections``). At the cap, a new connection
  closes the oldest one that has not finished sending its first request's headers (an
  idle or trickling one), so a flood of idle connections cannot lock out a real client
  (health, a scrape); when every connection is past its headers, the new one is closed;
* gives every connection ``idle_timeout_s`` to send a request's headers, from connect
  and again after each response (aiohttp's keep-alive timeout, which also closes a
  connection still waiting for its request line); a trickling client is cut off then;
* backs off when accepting fails for lack of resources (EMFILE, ENFILE, ENOBUFS,
  ENOMEM: 50 ms doubling to 2 s) instead of retrying in a tight loop, and logs that at
  most once a minute per listener, with the count of what it left out.

The accept loop is a task on the caller's event loop; each accept is one await, so the
decision loop and the other listeners keep their turns while one listener is flooded.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import socket
import time
from collections.abc import Callable
from typing import Any, Final

from aiohttp import web

from specgov.adapters.log_throttle import LogThrottle
from specgov.policies.common.validation import is_int

__all__ = [
    "DEFAULT_IDLE_TIMEOUT_S",
    "DEFAULT_MAX_CONNECTIONS",
    "BoundedSite",
    "serve",
]

logger = logging.getLogger(__name__)

DEFAULT_MAX_CONNECTIONS: Final = 64
# Time to send a request's headers (from connect, and after each response).
DEFAULT_IDLE_TIMEOUT_S: Final = 10.0
ACCEPT_BACKOFF_MIN_S: Final = 0.05
ACCEPT_BACKOFF_MAX_S: Final = 2.0
LOG_INTERVAL_S: Final = 60.0
_RESOURCE_ERRNOS: Final = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
_HEADERS_END: Final = b"\r\n\r\n"


class _Guard(asyncio.Protocol):
    """Wraps aiohttp's protocol for one connection: tells the listener when it opened,
    closed and finished its first request's headers (found by the blank line ending
    them); everything else is passed through unchanged."""

    def __init__(self, listener: _Listener, inner: asyncio.Protocol) -> None:
        self._listener = listener
        self._inner = inner
        self._tail = b""
        self.transport: asyncio.Transport | None = None
        self.headers_done = False
        self.opened_s = time.monotonic()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self._listener.live[self] = None
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if not self.headers_done:
            seen = self._tail + data
            if _HEADERS_END in seen:
                self.headers_done = True
                self._tail = b""
            else:
                self._tail = seen[-(len(_HEADERS_END) - 1) :]
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self._listener.live.pop(self, None)
        self._inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()


class _Listener(asyncio.AbstractServer):
    """The accept loop of one listening socket (what BaseSite keeps as its server)."""

    def __init__(
        self,
        sock: socket.socket,
        factory: Callable[[], asyncio.Protocol],
        *,
        name: str,
        max_connections: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.sockets = [sock]
        self._sock = sock
        self._factory = factory
        self._name = name
        self._max = max_connections
        self._throttle = LogThrottle(logger, clock, LOG_INTERVAL_S)
        self.live: dict[_Guard, None] = {}  # insertion-ordered: oldest first
        self.accept_errors = 0
        self.evicted = 0
        self.refused = 0
        self._loop = asyncio.get_running_loop()
        self._task: asyncio.Task[None] | None = self._loop.create_task(
            self._accept_loop(), name=f"{name}-accept"
        )

    async def _accept_loop(self) -> None:
        backoff_s = ACCEPT_BACKOFF_MIN_S
        while True:
            try:
                conn, _ = await self._loop.sock_accept(self._sock)
            except OSError as exc:
                if exc.errno not in _RESOURCE_ERRNOS:
                    continue  # the client went away before it was accepted
                self.accept_errors += 1
                self._throttle.warning(
                    "accept",
                    f"{self._name} listener: cannot accept ({exc}); backing off "
                    f"{backoff_s:g} s (connections held: {len(self.live)})",
                )
                await asyncio.sleep(backoff_s)
                backoff_s = min(ACCEPT_BACKOFF_MAX_S, backoff_s * 2)
                continue
            backoff_s = ACCEPT_BACKOFF_MIN_S
            if len(self.live) >= self._max and not self._make_room():
                self.refused += 1
                conn.close()
                continue
            try:
                await self._loop.connect_accepted_socket(
                    lambda: _Guard(self, self._factory()), conn
                )
            except OSError:
                conn.close()

    def _make_room(self) -> bool:
        """Close the oldest connection still before its first request's headers; False
        when every connection is past them (the new one is refused)."""
        victim = next((g for g in self.live if not g.headers_done), None)
        if victim is None or victim.transport is None:
            self._throttle.warning(
                "cap",
                f"{self._name} listener: {len(self.live)} connections, its cap, all "
                "busy; refusing new ones until one ends",
            )
            return False
        self.live.pop(victim, None)
        victim.transport.abort()
        self.evicted += 1
        self._throttle.warning(
            "cap",
            f"{self._name} listener: at its cap of {self._max} connections; closing the "
            "oldest idle one for each new one",
        )
        return True

    # asyncio.AbstractServer, as much as aiohttp's BaseSite and BaseRunner use.

    def close(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
        with contextlib.suppress(OSError):
            self._sock.close()

    def get_loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def is_serving(self) -> bool:
        return self._task is not None

    async def start_serving(self) -> None:
        return None

    async def serve_forever(self) -> None:
        task = self._task
        if task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def wait_closed(self) -> None:
        return None


class BoundedSite(web.BaseSite):
    """A ``web.TCPSite`` with a connection cap and accept backoff (module docstring)."""

    def __init__(
        self,
        runner: web.BaseRunner,
        host: str,
        port: int,
        *,
        name: str,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        backlog: int = 128,
    ) -> None:
        super().__init__(runner, backlog=backlog)
        if not is_int(max_connections):
            raise TypeError(f"max_connections: expected an int >= 1, got {max_connections!r}")
        if max_connections < 1:
            raise ValueError(f"max_connections: expected an int >= 1, got {max_connections}")
        self._host = host
        self._port = port
        self._label = name
        self._max_connections = max_connections
        self.listener: _Listener | None = None

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self.port}"

    @property
    def port(self) -> int:
        if self.listener is None:
            return self._port
        return int(self.listener.sockets[0].getsockname()[1])

    async def start(self) -> None:
        await super().start()
        server = self._runner.server
        assert server is not None, "runner.setup() first"
        sock = _bind(self._host, self._port, self._backlog)
        self.listener = _Listener(
            sock, server, name=self._label, max_connections=self._max_connections
        )
        self._server = self.listener


def _bind(host: str, port: int, backlog: int) -> socket.socket:
    name = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    infos = socket.getaddrinfo(name or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, _, _, _, address = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(backlog)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


async def serve(
    app: web.Application,
    host: str,
    port: int,
    *,
    name: str,
    max_connections: int = DEFAULT_MAX_CONNECTIONS,
    idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
    **runner_kwargs: Any,
) -> tuple[web.AppRunner, BoundedSite]:
    """Serve ``app`` on ``host:port`` behind a :class:`BoundedSite`; the runner (clean
    it up to stop) and the site (its ``port`` is the bound one)."""
    runner = web.AppRunner(app, access_log=None, keepalive_timeout=idle_timeout_s, **runner_kwargs)
    await runner.setup()
    site = BoundedSite(runner, host, port, name=name, max_connections=max_connections)
    try:
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner, site
