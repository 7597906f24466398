"""AiohttpTransport (SGLangClient's default transport) against real local servers.

Each test drives its coroutine with asyncio.run(); servers listen on 127.0.0.1:0. Where
a test needs a server that misbehaves (stalls, cuts a body, sends no HTTP) it is a raw
asyncio server, so the bytes on the wire are the test's. Stalls wait on an asyncio.Event
that the test sets when it is done; the only waiting is the client timeout under test.
"""

from __future__ import annotations

import asyncio
import gc
import gzip
import json
import random
import shutil
import socket
import ssl
import subprocess
import time
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import httpx
import pytest
from aiohttp import web
from aiohttp.http_exceptions import BadStatusLine
from aiohttp.test_utils import TestServer

from specgov.adapters.aiohttp_transport import AiohttpTransport, client_timeout, map_error
from specgov.adapters.errors import (
    PermanentScrapeError,
    ResponseFormatError,
    TemporaryScrapeError,
)
from specgov.adapters.sglang_http import HealthState, SGLangClient

FIXTURES = Path(__file__).parent / "fixtures" / "sglang"
METRICS_TEXT = (FIXTURES / "eagle3_adaptive_A.prom").read_text()
LOADS = json.loads((FIXTURES / "eagle3_adaptive_loads_A.json").read_text())
PROM_TYPE = "text/plain; version=0.0.4; charset=utf-8"
DEADLINE_S = 30.0  # generous bound on anything the tests wait for

T = TypeVar("T")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
RawServe = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


class NoSleep:
    """The client's backoff sleep: recorded, not waited."""

    def __init__(self) -> None:
        self.delays: list[float] = []

    async def __call__(self, seconds: float) -> None:
        self.delays.append(seconds)


def sglang(base_url: str, **kwargs: Any) -> SGLangClient:
    kwargs.setdefault("retries", 0)
    return SGLangClient(base_url, rng=random.Random(3), sleep=NoSleep(), **kwargs)


class Seen:
    """What a server saw: requests and the client ends of its connections."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str, list[tuple[bytes, bytes]]]] = []
        self.peers: list[object] = []

    def connections(self) -> int:
        return len(set(self.peers))


@asynccontextmanager
async def web_server(handler: Handler) -> AsyncIterator[tuple[str, Seen]]:
    seen = Seen()

    async def recording(request: web.Request) -> web.StreamResponse:
        assert request.transport is not None
        seen.requests.append((request.method, request.path_qs, list(request.raw_headers)))
        seen.peers.append(request.transport.get_extra_info("peername"))
        return await handler(request)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", recording)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        yield str(server.make_url("")).rstrip("/"), seen
    finally:
        await server.close()


@asynccontextmanager
async def raw_server(serve: RawServe) -> AsyncIterator[str]:
    """A server that reads one request head per connection and runs ``serve``."""

    async def on_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            await serve(reader, writer)
        finally:
            writer.close()

    server = await asyncio.start_server(on_connection, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.close()
        await server.wait_closed()


async def sglang_routes(request: web.Request) -> web.StreamResponse:
    if request.path == "/metrics":
        return web.Response(body=METRICS_TEXT.encode(), headers={"Content-Type": PROM_TYPE})
    if request.path == "/v1/loads":
        return web.json_response(LOADS)
    if request.path == "/server_info":
        return web.json_response({"internal_states": [{}]})
    if request.path == "/health":
        return web.Response(text="")
    return web.Response(status=404)


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port  # closed on leaving: nothing listens there


# ---------------------------------------------------------------- the default path


def test_sglang_client_uses_the_aiohttp_transport_unless_one_is_injected() -> None:
    client = SGLangClient("http://127.0.0.1:1", rng=random.Random(0))
    mock = SGLangClient(
        "http://127.0.0.1:1",
        rng=random.Random(0),
        transport=httpx.MockTransport(lambda r: httpx.Response(200)),
    )
    assert isinstance(client._client._transport, AiohttpTransport)
    assert isinstance(mock._client._transport, httpx.MockTransport)
    run(client.aclose())
    run(mock.aclose())


def test_a_scrape_of_a_real_server_parses_metrics_and_json() -> None:
    async def body() -> None:
        async with web_server(sglang_routes) as (base, seen), sglang(base) as client:
            scrape = await client.scrape_metrics()
            loads = await client.loads()
            health = await client.health()
        assert scrape.text == METRICS_TEXT
        assert any(k.name == "sglang:num_running_reqs" for k in scrape.snapshot.gauges)
        assert loads == LOADS
        assert health.state is HealthState.UP
        assert [path for _, path, _ in seen.requests] == [
            "/metrics",
            "/v1/loads?include=core%2Cmemory%2Cspec%2Cqueues",
            "/health",
        ]

    run(body())


def test_requests_arrive_exactly_as_with_httpx_default_transport() -> None:
    async def body() -> dict[str, list[tuple[str, str, list[tuple[bytes, bytes]]]]]:
        out = {}
        async with web_server(sglang_routes) as (base, seen):
            for name, transport in (
                ("httpcore", httpx.AsyncHTTPTransport()),
                ("aiohttp", AiohttpTransport()),
            ):
                seen.requests.clear()
                async with sglang(base, api_key="k-123", transport=transport) as client:
                    await client.scrape_metrics()
                    await client.loads()
                    await client.server_info()
                out[name] = list(seen.requests)
        return out

    sent = run(body())
    assert len(sent["aiohttp"]) == 3
    # Method, path and query, header names (their case too), values and order.
    assert sent["aiohttp"] == sent["httpcore"]
    headers = dict(sent["aiohttp"][0][2])
    assert headers[b"Authorization"] == b"Bearer k-123"
    assert headers[b"User-Agent"] == b"specgov-telemetry/0.1"
    assert headers[b"Accept"] == b"text/plain; version=0.0.4"


def test_responses_arrive_exactly_as_with_httpx_default_transport() -> None:
    async def odd(request: web.Request) -> web.StreamResponse:
        resp = web.Response(status=299, reason="Fine Anyway", body=b"\x00\xffbody")
        resp.headers.add("X-Twice", "one")
        resp.headers.add("X-Twice", "two")
        return resp

    async def body() -> list[tuple[Any, ...]]:
        got = []
        async with web_server(odd) as (base, _):
            for transport in (httpx.AsyncHTTPTransport(), AiohttpTransport()):
                async with httpx.AsyncClient(transport=transport) as http:
                    r = await http.get(f"{base}/x")
                got.append(
                    (r.status_code, r.reason_phrase, r.http_version, r.content)
                    + (
                        [
                            (k, v)
                            for k, v in r.headers.multi_items()
                            if k != "date"  # the second may tick between the two
                        ],
                    )
                )
        return got

    httpcore_seen, aiohttp_seen = run(body())
    assert aiohttp_seen[:4] == (299, "Fine Anyway", "HTTP/1.1", b"\x00\xffbody")
    assert ("x-twice", "one") in aiohttp_seen[4] and ("x-twice", "two") in aiohttp_seen[4]
    assert aiohttp_seen == httpcore_seen


def test_404_is_permanent_and_503_temporary_and_retried() -> None:
    async def answer(request: web.Request) -> web.StreamResponse:
        return web.Response(status=404 if request.path == "/metrics" else 503)

    async def body() -> tuple[PermanentScrapeError, TemporaryScrapeError, Seen]:
        async with web_server(answer) as (base, seen), sglang(base, retries=2) as client:
            with pytest.raises(PermanentScrapeError) as missing:
                await client.scrape_metrics()
            with pytest.raises(TemporaryScrapeError) as busy:
                await client.loads()
        return missing.value, busy.value, seen

    missing, busy, seen = run(body())
    assert missing.status_code == 404 and "--enable-metrics" in missing.detail
    assert busy.status_code == 503 and busy.attempts == 3
    assert [path.split("?")[0] for _, path, _ in seen.requests] == ["/metrics"] + ["/v1/loads"] * 3
    assert seen.connections() == 1  # error answers keep the connection too


def test_a_closed_port_is_a_temporary_connection_error() -> None:
    base = f"http://127.0.0.1:{closed_port()}"

    async def body() -> None:
        async with sglang(base) as client:
            with pytest.raises(TemporaryScrapeError, match="connection failed: ConnectError"):
                await client.scrape_metrics()
            assert (await client.health()).state is HealthState.UNREACHABLE
        async with httpx.AsyncClient(transport=AiohttpTransport()) as http:
            with pytest.raises(httpx.ConnectError):
                await http.get(f"{base}/metrics")

    run(body())


# ------------------------------------------------------------- stalls and cut bodies


def test_a_server_that_stalls_before_answering_is_a_read_timeout() -> None:
    timeout_s = 0.2
    release = asyncio.Event()

    async def stall(request: web.Request) -> web.StreamResponse:
        await release.wait()
        return web.Response(text="late")

    async def body() -> float:
        async with web_server(stall) as (base, _):
            try:
                async with sglang(base, timeout_s=timeout_s) as client:
                    started = time.monotonic()
                    with pytest.raises(TemporaryScrapeError) as err:
                        await client.scrape_metrics()
                    waited_s = time.monotonic() - started
                    assert f"timed out after {timeout_s:g} s (ReadTimeout" in err.value.detail
            finally:
                release.set()
        return waited_s

    waited_s = run(body())
    assert timeout_s * 0.9 <= waited_s < DEADLINE_S


def test_a_body_that_stalls_midway_is_a_read_timeout() -> None:
    timeout_s = 0.2
    release = asyncio.Event()
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 100000\r\n\r\n"

    async def half_then_stall(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(head + b"x" * 1000)
        await writer.drain()
        await release.wait()

    async def body() -> None:
        async with raw_server(half_then_stall) as base:
            try:
                async with (
                    httpx.AsyncClient(transport=AiohttpTransport(), timeout=timeout_s) as http,
                    http.stream("GET", f"{base}/metrics") as resp,
                ):
                    assert resp.status_code == 200  # the head arrived in time
                    with pytest.raises(httpx.ReadTimeout):
                        await resp.aread()
                async with sglang(base, timeout_s=timeout_s) as client:
                    with pytest.raises(TemporaryScrapeError, match="ReadTimeout"):
                        await client.scrape_metrics()
            finally:
                release.set()

    run(body())


def test_a_server_that_closes_mid_body_is_a_protocol_error() -> None:
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 100000\r\n\r\n"

    async def half_then_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(head + b"x" * 1000)
        await writer.drain()

    async def body() -> None:
        async with raw_server(half_then_close) as base:
            async with httpx.AsyncClient(transport=AiohttpTransport()) as http:
                with pytest.raises(httpx.RemoteProtocolError):
                    await http.get(f"{base}/metrics")
            async with sglang(base) as client:
                with pytest.raises(
                    TemporaryScrapeError, match="connection failed: RemoteProtocolError"
                ):
                    await client.scrape_metrics()

    run(body())


@pytest.mark.parametrize(
    "answer",
    [b"", b"SSH-2.0-OpenSSH_9.6\r\n", b"HTTP/1.1 2xx Nope\r\n\r\n"],
    ids=["nothing", "not-http", "bad-status"],
)
def test_an_answer_that_is_not_http_is_a_temporary_error(answer: bytes) -> None:
    async def reply(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(answer)
        await writer.drain()

    async def body() -> None:
        async with raw_server(reply) as base:
            async with httpx.AsyncClient(transport=AiohttpTransport()) as http:
                with pytest.raises(httpx.RemoteProtocolError):
                    await http.get(f"{base}/metrics")
            async with sglang(base, retries=1) as client:
                with pytest.raises(TemporaryScrapeError, match="RemoteProtocolError") as err:
                    await client.scrape_metrics()
                assert err.value.attempts == 2

    run(body())


def test_a_head_past_aiohttp_s_field_limit_is_a_protocol_error() -> None:
    async def long_header(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(
            b"HTTP/1.1 200 OK\r\nX-Long: " + b"a" * 9000 + b"\r\nContent-Length: 0\r\n\r\n"
        )
        await writer.drain()

    async def body() -> None:
        transport = AiohttpTransport()
        async with raw_server(long_header) as base, httpx.AsyncClient(transport=transport) as http:
            with pytest.raises(httpx.RemoteProtocolError):
                await http.get(f"{base}/metrics")

    run(body())


# ------------------------------------------------------------------ bodies, encodings


def test_a_gzip_body_is_decoded_by_httpx() -> None:
    async def zipped(request: web.Request) -> web.StreamResponse:
        return web.Response(
            body=gzip.compress(METRICS_TEXT.encode()),
            headers={"Content-Type": PROM_TYPE, "Content-Encoding": "gzip"},
        )

    async def body() -> str:
        async with web_server(zipped) as (base, seen):
            async with sglang(base) as client:
                text: str = (await client.scrape_metrics()).text
            assert b"gzip" in dict(seen.requests[0][2])[b"Accept-Encoding"]  # httpx's offer
        return text

    assert run(body()) == METRICS_TEXT


def test_a_bad_gzip_body_is_a_format_error() -> None:
    async def lying(request: web.Request) -> web.StreamResponse:
        return web.Response(
            body=METRICS_TEXT.encode(),
            headers={"Content-Type": PROM_TYPE, "Content-Encoding": "gzip"},
        )

    async def body() -> None:
        async with web_server(lying) as (base, _), sglang(base) as client:
            with pytest.raises(ResponseFormatError, match="body cannot be decoded"):
                await client.scrape_metrics()

    run(body())


def test_a_streamed_body_past_the_limit_is_refused_and_the_rest_never_read() -> None:
    chunk = b"a" * 65536
    total_bytes = 1024 * len(chunk)  # 64 MiB: far more than the socket buffers hold
    written = {"bytes": 0}
    done = asyncio.Event()

    async def endless(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": PROM_TYPE})
        resp.enable_chunked_encoding()  # no Content-Length: only reading can tell
        await resp.prepare(request)
        try:
            while written["bytes"] < total_bytes:
                await resp.write(chunk)
                written["bytes"] += len(chunk)
        except (ConnectionError, aiohttp.ClientConnectionError):
            pass  # the client hung up, as it should
        finally:
            done.set()
        return resp

    async def body() -> None:
        async with web_server(endless) as (base, seen):
            async with sglang(base, max_body_bytes=256 * 1024) as client:
                with pytest.raises(ResponseFormatError, match="exceeds the limit of 262144"):
                    await client.scrape_metrics()
                await asyncio.wait_for(done.wait(), DEADLINE_S)
                # The cut connection is not reused: the next request opens another.
                with pytest.raises(ResponseFormatError):
                    await client.scrape_metrics()
            assert seen.connections() == 2

    run(body())
    assert 0 < written["bytes"] < total_bytes


def test_a_gzip_bomb_is_refused_by_its_decoded_size() -> None:
    bomb = gzip.compress(b"\0" * (16 * 1024 * 1024))

    async def bombing(request: web.Request) -> web.StreamResponse:
        return web.Response(
            body=bomb, headers={"Content-Type": PROM_TYPE, "Content-Encoding": "gzip"}
        )

    async def body() -> None:
        limit = 1024 * 1024
        async with web_server(bombing) as (base, _), sglang(base, max_body_bytes=limit) as client:
            with pytest.raises(ResponseFormatError, match="read so far exceeds the limit"):
                await client.scrape_metrics()

    assert len(bomb) < 1024 * 1024  # the limit counts decoded bytes, not wire bytes
    run(body())


def test_one_connection_carries_many_requests() -> None:
    async def body() -> Seen:
        async with web_server(sglang_routes) as (base, seen), sglang(base) as client:
            for _ in range(4):
                await client.scrape_metrics()
                await client.loads()
        return seen

    seen = run(body())
    assert len(seen.requests) == 8
    assert seen.connections() == 1


# ------------------------------------------------------------- proxies, TLS, lifecycle


def test_a_proxy_in_the_environment_is_not_used(monkeypatch: pytest.MonkeyPatch) -> None:
    dead = f"http://127.0.0.1:{closed_port()}"
    for name in ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.setenv(name, dead)
    for name in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)

    async def body() -> None:
        async with web_server(sglang_routes) as (base, seen):
            async with sglang(base) as client:
                assert (await client.scrape_metrics()).text == METRICS_TEXT
            assert len(seen.requests) == 1
            # The same environment sends httpx's own default transport to the dead proxy,
            # which is why SGLangClient no longer uses it.
            async with httpx.AsyncClient() as http:
                with pytest.raises(httpx.ConnectError):
                    await http.get(f"{base}/metrics")
            assert len(seen.requests) == 1

    run(body())


def test_tls_context_is_httpx_s_and_built_only_for_https() -> None:
    built: list[ssl.SSLContext] = []

    def factory() -> ssl.SSLContext:
        built.append(httpx.create_ssl_context())
        return built[-1]

    transport = AiohttpTransport(ssl_context_factory=factory)
    assert transport.ssl_for("http") is True  # aiohttp's plain-connection default
    assert built == []
    context = transport.ssl_for("https")
    assert transport.ssl_for("https") is context and built == [context]
    # The default factory is httpx's own: the same CA trust (certifi, SSL_CERT_FILE).
    assert AiohttpTransport()._ssl_context_factory is httpx.create_ssl_context


@pytest.fixture
def self_signed(tmp_path: Path) -> tuple[Path, Path]:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed: no certificate for the TLS server")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            "openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
            "ec_paramgen_curve:prime256v1", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
            "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert),
        ],
        check=True,
        capture_output=True,
    )  # fmt: skip
    return cert, key


def test_https_verifies_with_httpx_trust(
    self_signed: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    cert, key = self_signed
    server_ssl = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ssl.load_cert_chain(cert, key)
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    monkeypatch.delenv("SSL_CERT_DIR", raising=False)

    async def body() -> None:
        app = web.Application()
        app.router.add_route("GET", "/{tail:.*}", sglang_routes)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=server_ssl)
        await site.start()
        server = site._server
        assert isinstance(server, asyncio.base_events.Server)
        base = f"https://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        try:
            # certifi does not know this certificate: refused, as httpx would refuse it.
            async with sglang(base) as client:
                with pytest.raises(TemporaryScrapeError, match=r"ConnectError.*certificate"):
                    await client.scrape_metrics()
            # SSL_CERT_FILE, which httpx.create_ssl_context honours, makes it trusted.
            monkeypatch.setenv("SSL_CERT_FILE", str(cert))
            async with sglang(base) as client:
                assert (await client.scrape_metrics()).text == METRICS_TEXT
        finally:
            await runner.cleanup()

    run(body())


def test_aclose_closes_the_session_without_warnings() -> None:
    async def body() -> None:
        async with web_server(sglang_routes) as (base, _):
            # Built before any request: the session comes with the first one.
            client = sglang(base)
            transport = client._client._transport
            assert isinstance(transport, AiohttpTransport)
            assert transport.session is None
            await client.scrape_metrics()
            session = transport.session
            assert session is not None and not session.closed
            await client.aclose()
            assert session.closed and transport.session is None
            with pytest.raises(RuntimeError, match="closed"):
                await client.scrape_metrics()

    # A session or connector left open warns when collected ("Unclosed client session",
    # "Unclosed connector"); -W error makes such a warning fail the run as well.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run(body())
        gc.collect()
    assert [str(w.message) for w in caught if "Unclosed" in str(w.message)] == []


def test_a_transport_refuses_a_second_event_loop() -> None:
    transport = AiohttpTransport()

    async def get() -> None:
        async with web_server(sglang_routes) as (base, _):
            await transport.handle_async_request(httpx.Request("GET", f"{base}/health"))

    with asyncio.Runner() as first:
        first.run(get())
        with asyncio.Runner() as second, pytest.raises(RuntimeError, match="bound to the event"):
            second.run(get())
        first.run(transport.aclose())  # closed from its own loop, which is still open


# -------------------------------------------------------------------- the mappings


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (aiohttp.ConnectionTimeoutError("connect"), httpx.ConnectTimeout),
        (aiohttp.SocketTimeoutError("read"), httpx.ReadTimeout),
        (TimeoutError(), httpx.ReadTimeout),
        (aiohttp.ServerDisconnectedError(), httpx.RemoteProtocolError),
        (aiohttp.ClientPayloadError("cut"), httpx.RemoteProtocolError),
        (BadStatusLine("SSH-2.0"), httpx.RemoteProtocolError),
        (aiohttp.ClientConnectionResetError("reset"), httpx.ReadError),
        (aiohttp.ClientOSError(104, "reset"), httpx.ReadError),
        (aiohttp.InvalidURL("http://["), httpx.UnsupportedProtocol),
        (aiohttp.NonHttpUrlClientError("ftp://x"), httpx.UnsupportedProtocol),
        (ConnectionResetError(104, "reset"), httpx.ReadError),
        (aiohttp.ClientError("other"), httpx.TransportError),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, BaseException) else v.__name__,
)
def test_every_aiohttp_error_maps_to_the_httpx_type_the_client_classifies(
    error: BaseException, expected: type[httpx.TransportError]
) -> None:
    request = httpx.Request("GET", "http://127.0.0.1:1/metrics")
    mapped = map_error(error, request)
    assert type(mapped) is expected
    assert mapped.request is request
    assert type(error).__name__ in str(mapped)


def test_a_connector_error_is_a_connect_error() -> None:
    # ClientConnectorError needs a connection key; build it as aiohttp does.
    async def refused() -> BaseException:
        port = closed_port()
        async with aiohttp.ClientSession() as session:
            try:
                await session.get(f"http://127.0.0.1:{port}/")
            except aiohttp.ClientConnectorError as exc:
                return exc
        raise AssertionError("the closed port answered")

    error = run(refused())
    assert type(map_error(error, httpx.Request("GET", "http://x/"))) is httpx.ConnectError


def test_non_aiohttp_errors_are_not_mapped() -> None:
    assert map_error(KeyError("x"), httpx.Request("GET", "http://x/")) is None


def test_httpx_timeouts_map_to_aiohttp_timeouts() -> None:
    timeout = client_timeout({"connect": 1.5, "read": 4.0, "write": 9.0, "pool": 2.0})
    assert timeout == aiohttp.ClientTimeout(
        total=None, connect=3.5, sock_connect=1.5, sock_read=4.0
    )
    assert client_timeout(None) == aiohttp.ClientTimeout(total=None)
    assert client_timeout({"connect": None, "read": 2, "pool": 1}) == aiohttp.ClientTimeout(
        total=None, connect=None, sock_connect=None, sock_read=2.0
    )


@pytest.mark.parametrize(
    ("url", "needle"),
    [("ftp://127.0.0.1/x", "unsupported protocol 'ftp://'"), ("http:///x", "missing a host")],
)
def test_a_url_the_transport_cannot_carry_is_unsupported(url: str, needle: str) -> None:
    async def body() -> None:
        transport = AiohttpTransport()
        with pytest.raises(httpx.UnsupportedProtocol, match=needle):
            await transport.handle_async_request(httpx.Request("GET", url))
        await transport.aclose()

    run(body())


def test_a_header_with_a_line_break_is_a_permanent_error() -> None:
    async def body() -> None:
        async with web_server(sglang_routes) as (base, seen):
            async with sglang(base, api_key="k\r\nX-Injected: 1") as client:
                with pytest.raises(PermanentScrapeError, match="LocalProtocolError"):
                    await client.loads()
            assert seen.requests == []

    run(body())
