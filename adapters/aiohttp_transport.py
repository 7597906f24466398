"""An ``httpx.AsyncBaseTransport`` that sends requests through one ``aiohttp.ClientSession``.

Why: the daemon scrapes SGLang (``/metrics``, ``/v1/loads``) twice a second at a 1 s
decision interval, and httpx's default transport (httpcore over anyio) spends most of the
CPU of such a request in its own machinery: measured 2.0 ms CPU per 25 KB ``/metrics``
GET, against 0.55 ms for aiohttp's own GET (issue 8 §4; ``/tmp/s16/http_mb.py``). aiohttp
is a dependency already (the daemon's servers run on it). httpx stays the client API, so
``SGLangClient``'s retry, classification and body-limit code keeps one path, and tests keep
injecting ``httpx.MockTransport``.

What it keeps of httpx's behaviour:

* The body streams to httpx raw (``auto_decompress=False``): httpx decodes
  Content-Encoding itself, so a limit on decoded bytes and ``httpx.DecodingError`` for a
  bad gzip body behave as with the default transport. The response stream reads chunks as
  they arrive and releases the connection on ``aclose`` (closes it when the body was not
  read to its end).
* The per-request timeout extension (``request.extensions["timeout"]``) maps to
  ``aiohttp.ClientTimeout``: ``connect`` to ``sock_connect``, ``read`` to ``sock_read``
  (the longest wait for the next bytes, the head included), ``pool`` + ``connect`` bound
  the whole acquisition of a connection (aiohttp's ``connect``; a pool wait past it is a
  ``ConnectTimeout``). ``write`` is not enforced: aiohttp has no write timeout. A request
  without a body (all ``SGLangClient`` sends) is queued whole at once and its read timeout
  starts then, so a peer that never takes it still ends in a ``ReadTimeout``.
* aiohttp and asyncio errors become the httpx exceptions ``SGLangClient`` classifies
  (``_ERRORS`` below); no aiohttp exception leaves this module.
* Response heads within aiohttp's limits (a line or header field of at most 8190 bytes,
  128 header fields; h11 allows a 16 KiB head): a larger one is a
  ``RemoteProtocolError``. SGLang's heads are a few hundred bytes.
* Keep-alive: connections are reused, idle ones dropped after 5 s (httpcore's default
  ``keepalive_expiry``; uvicorn, which serves SGLang, closes idle ones after 5 s too).
* TLS: https uses ``httpx.create_ssl_context()`` (certifi, or ``SSL_CERT_FILE`` /
  ``SSL_CERT_DIR``), the CA trust httpx's default transport has; built on the first https
  request only.

What it changes on purpose: proxy environment variables (``HTTP_PROXY``, ``ALL_PROXY``,
...) and ``.netrc`` are ignored (``trust_env=False``). Requests carry the server's API key
as a Bearer header; an inherited proxy setting would hand it to the proxy, and an operator
scraping a server on the same host or network has no use for one. The control client
(``controller/cli/control_client.py``) refuses environment proxies for the same reason.

The session is created lazily inside the running event loop on the first request (the
transport may be constructed outside any loop) and closed by ``aclose``; the transport is
bound to that loop from then on.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Final

import aiohttp
import httpx
from aiohttp.http_exceptions import HttpProcessingError
from multidict import CIMultiDict
from yarl import URL

# Read the body in chunks of at most this many bytes (aiohttp's read buffer size):
# each chunk is handed to httpx as it arrives, so a body limit stops reading early.
CHUNK_BYTES: Final = 64 * 1024
# httpcore's defaults (httpx.Limits()): 100 connections, idle ones kept 5 s.
MAX_CONNECTIONS: Final = 100
KEEPALIVE_S: Final = 5.0
# httpx always sets these; aiohttp must not add its own values when a request lacks one.
_NO_AUTO_HEADERS: Final = ("Accept", "Accept-Encoding", "User-Agent", "Content-Type")

_ErrorType = type[httpx.TransportError]

# aiohttp/asyncio error -> httpx error, first match wins (subclasses before their bases).
_ERRORS: Final[tuple[tuple[type[BaseException], _ErrorType], ...]] = (
    (aiohttp.ConnectionTimeoutError, httpx.ConnectTimeout),
    (aiohttp.ServerTimeoutError, httpx.ReadTimeout),  # SocketTimeoutError: sock_read
    (asyncio.TimeoutError, httpx.ReadTimeout),
    (aiohttp.InvalidURL, httpx.UnsupportedProtocol),
    (aiohttp.NonHttpUrlClientError, httpx.UnsupportedProtocol),
    # DNS, refused, unreachable, TLS handshake and certificate errors.
    (aiohttp.ClientConnectorError, httpx.ConnectError),
    (aiohttp.ServerDisconnectedError, httpx.RemoteProtocolError),
    (aiohttp.ClientPayloadError, httpx.RemoteProtocolError),  # body cut short, bad chunks
    (aiohttp.ClientResponseError, httpx.RemoteProtocolError),  # an unparseable head
    (HttpProcessingError, httpx.RemoteProtocolError),
    (aiohttp.ClientConnectionError, httpx.ReadError),  # reset, other socket errors
    (aiohttp.ClientError, httpx.TransportError),
    (OSError, httpx.ReadError),
)


def map_error(exc: BaseException, request: httpx.Request) -> httpx.TransportError | None:
    """The httpx error for an aiohttp/asyncio one, or None when it is not one of those."""
    for source, target in _ERRORS:
        if isinstance(exc, source):
            text = str(exc) or type(exc).__name__
            return target(f"{text} ({type(exc).__name__})", request=request)
    return None


def client_timeout(extension: object) -> aiohttp.ClientTimeout:
    """``aiohttp.ClientTimeout`` for httpx's ``timeout`` request extension (see module doc)."""
    limits: Mapping[str, object] = extension if isinstance(extension, Mapping) else {}

    def seconds(key: str) -> float | None:
        value = limits.get(key)
        return float(value) if isinstance(value, int | float) else None

    connect, pool, read = seconds("connect"), seconds("pool"), seconds("read")
    acquire = None if connect is None or pool is None else connect + pool
    return aiohttp.ClientTimeout(total=None, connect=acquire, sock_connect=connect, sock_read=read)


class _ResponseStream(httpx.AsyncByteStream):
    """aiohttp's response body as httpx's raw stream: chunks as they arrive."""

    def __init__(self, response: aiohttp.ClientResponse, request: httpx.Request) -> None:
        self._response = response
        self._request = request

    async def __aiter__(self) -> AsyncIterator[bytes]:
        content = self._response.content
        while True:
            try:
                chunk = await content.read(CHUNK_BYTES)
            except (aiohttp.ClientError, HttpProcessingError, OSError) as exc:
                mapped = map_error(exc, self._request)
                assert mapped is not None  # every one of these has a row in _ERRORS
                raise mapped from exc
            if not chunk:
                return
            yield chunk

    async def aclose(self) -> None:
        # A body read to its end leaves a connection fit for the next request; one cut
        # short (past a body limit, an error) is closed: its unread bytes are in the way.
        if self._response.content.is_eof():
            self._response.release()
        else:
            self._response.close()


class AiohttpTransport(httpx.AsyncBaseTransport):
    """httpx transport over one lazily created ``aiohttp.ClientSession``; see module doc."""

    def __init__(
        self,
        *,
        ssl_context_factory: Callable[[], ssl.SSLContext] = httpx.create_ssl_context,
    ) -> None:
        self._ssl_context_factory = ssl_context_factory
        self._ssl_context: ssl.SSLContext | None = None
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False

    @property
    def session(self) -> aiohttp.ClientSession | None:
        """The session, once the first request created it (None before, and after close)."""
        return self._session

    def ssl_for(self, scheme: str) -> ssl.SSLContext | bool:
        """What aiohttp's ``ssl=`` gets: httpx's CA trust for https, built once, on demand."""
        if scheme != "https":
            return True  # aiohttp's default; no TLS on a plain connection
        if self._ssl_context is None:
            self._ssl_context = self._ssl_context_factory()
        return self._ssl_context

    def _session_for_this_loop(self) -> aiohttp.ClientSession:
        if self._closed:
            raise RuntimeError("AiohttpTransport is closed")
        loop = asyncio.get_running_loop()
        if self._session is None:
            self._loop = loop
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(
                    limit=MAX_CONNECTIONS, keepalive_timeout=KEEPALIVE_S
                ),
                auto_decompress=False,  # httpx decodes, so its body limit counts decoded bytes
                trust_env=False,  # no env proxies, no .netrc (module docstring)
                cookie_jar=aiohttp.DummyCookieJar(),  # httpx's client keeps the cookies
                skip_auto_headers=_NO_AUTO_HEADERS,
                timeout=aiohttp.ClientTimeout(total=None),  # per request, from httpx
                read_bufsize=CHUNK_BYTES,
            )
        elif loop is not self._loop:
            raise RuntimeError(
                "AiohttpTransport is bound to the event loop of its first request; "
                "create one transport (one SGLangClient) per event loop"
            )
        return self._session

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        scheme = request.url.scheme
        if scheme not in ("http", "https"):
            raise httpx.UnsupportedProtocol(
                f"Request URL has an unsupported protocol {scheme + '://'!r}: "
                "expected 'http://' or 'https://'",
                request=request,
            )
        if not request.url.host:
            raise httpx.UnsupportedProtocol(
                f"Request URL {str(request.url)!r} is missing a host", request=request
            )
        if "transfer-encoding" in request.headers:
            raise httpx.LocalProtocolError(
                "AiohttpTransport sends buffered request bodies only (no chunked upload)",
                request=request,
            )
        session = self._session_for_this_loop()
        body = await request.aread()
        try:
            # The names as httpx spelled them, in its order (multi_items() lower-cases).
            headers = CIMultiDict(
                (name.decode("ascii"), value.decode("utf-8")) for name, value in request.headers.raw
            )
            response = await session.request(
                request.method,
                URL(str(request.url), encoded=True),  # httpx's encoding of path and query
                headers=headers,
                data=body or None,
                allow_redirects=False,  # httpx follows redirects itself when asked
                timeout=client_timeout(request.extensions.get("timeout")),
                ssl=self.ssl_for(scheme),
            )
        except (aiohttp.ClientError, HttpProcessingError, OSError) as exc:
            mapped = map_error(exc, request)
            assert mapped is not None  # every one of these has a row in _ERRORS
            raise mapped from exc
        except ValueError as exc:  # a header value with CR/LF in it, or not UTF-8
            raise httpx.LocalProtocolError(str(exc), request=request) from exc
        version = response.version
        return httpx.Response(
            status_code=response.status,
            headers=list(response.raw_headers),
            stream=_ResponseStream(response, request),
            extensions={
                "http_version": f"HTTP/{version.major}.{version.minor}".encode()
                if version is not None
                else b"HTTP/1.1",
                "reason_phrase": (response.reason or "").encode("latin-1", "replace"),
            },
        )

    async def aclose(self) -> None:
        self._closed = True
        session, self._session = self._session, None
        if session is not None:
            await session.close()
