"""Async HTTP client for the SGLang 0.5.23 endpoints specgov reads.

Routes (``srt/entrypoints/http_server.py``, ``srt/entrypoints/v1_loads.py``,
``srt/utils/common.py``): ``GET /metrics`` (prometheus_client's multiprocess collector,
mounted with ``--enable-metrics``), ``GET /health`` (503 while the server is starting,
shutting down, or when its one-token health generation got no answer), ``GET
/server_info`` (resolved server args + ``internal_states`` per DP rank), ``GET
/v1/loads?include=...`` (per DP rank load snapshots), ``GET /model_info``.

Auth (``srt/utils/auth.py``): with ``--api-key`` every normal endpoint needs
``Authorization: Bearer <api key>``; admin endpoints take ``--admin-api-key`` instead
when it is set; ``/health``, ``/ready`` and ``/metrics`` are always open.

Temporary failures (timeouts, refused connections, 503, other 5xx, 429) are retried a
bounded number of times with exponential backoff and full jitter drawn from an explicit,
seeded ``random.Random``; permanent ones (401/403/404, other 4xx, unparseable bodies)
are raised at once. The clock and the sleep function are injectable, so tests neither
wait nor depend on wall time.

Requests go through httpx over :class:`~specgov.adapters.aiohttp_transport.AiohttpTransport`
(one aiohttp session; proxy environment variables ignored) unless a ``transport`` is
injected; ``aclose`` closes it.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Awaitable, Callable, Collection, Mapping
from dataclasses import dataclass
from enum import StrEnum
from types import TracebackType
from typing import Any, Final

import httpx

from specgov.adapters.aiohttp_transport import AiohttpTransport
from specgov.adapters.errors import (
    PermanentScrapeError,
    ResponseFormatError,
    ScrapeError,
    TemporaryScrapeError,
    bounded_repr,
    escape_upstream,
)
from specgov.adapters.prometheus_text import EXPECTED_FORMAT, MetricsSnapshot, parse_metrics
from specgov.adapters.telemetry import METRICS_READ
from specgov.policies.common.validation import is_int, is_real

METRICS_PATH: Final = "/metrics"
HEALTH_PATH: Final = "/health"
SERVER_INFO_PATH: Final = "/server_info"
LOADS_PATH: Final = "/v1/loads"
MODEL_INFO_PATH: Final = "/model_info"
# LoadSnapshot.VALID_SECTIONS in srt/managers/load_snapshot.py.
LOADS_INCLUDE: Final = ("core", "memory", "spec", "queues")
ENDPOINT_PATHS: Final = (METRICS_PATH, HEALTH_PATH, SERVER_INFO_PATH, LOADS_PATH, MODEL_INFO_PATH)

# A body larger than this is refused unread (a format error): SGLang's /metrics is
# kilobytes to a few megabytes even with many label sets, its JSON bodies smaller still.
DEFAULT_MAX_BODY_BYTES: Final = 64 * 1024 * 1024
# Absolute URLs kept per client: the endpoints above, with room for get_json callers.
MAX_CACHED_URLS: Final = 64
# prometheus_client serves OpenMetrics only when asked for it; ask for the text format.
_METRICS_ACCEPT: Final = "text/plain; version=0.0.4"
_USER_AGENT: Final = "specgov-telemetry/0.1"


class HealthState(StrEnum):
    """What ``GET /health`` said.

    STARTING is SGLang's bare 503: the server is starting, shutting down, or its health
    generation got no answer in time (SGLang's 503 does not tell these apart; a server
    that stays here long after launch is not starting any more).
    """

    UP = "up"
    STARTING = "starting"
    UNHEALTHY = "unhealthy"  # another 5xx, or no answer within the health timeout
    UNREACHABLE = "unreachable"  # nothing listening / connection failed


@dataclass(frozen=True, slots=True)
class HealthResult:
    state: HealthState
    status_code: int | None
    detail: str

    @property
    def ok(self) -> bool:
        return self.state is HealthState.UP


@dataclass(frozen=True, slots=True)
class MetricsScrape:
    """A parsed ``/metrics`` body, stamped with the client clock when it arrived."""

    time_s: float
    latency_s: float
    snapshot: MetricsSnapshot
    text: str


def _check_positive(name: str, value: float) -> None:
    if not is_real(value) or not value > 0:
        raise ValueError(f"SGLangClient: {name} must be a finite number > 0, got {value!r}")


class SGLangClient:
    """Reads one SGLang server. Use as ``async with SGLangClient(...) as client:``."""

    def __init__(
        self,
        base_url: str,
        *,
        rng: random.Random,
        api_key: str | None = None,
        admin_api_key: str | None = None,
        timeout_s: float = 5.0,
        health_timeout_s: float = 30.0,
        retries: int = 3,
        backoff_base_s: float = 0.25,
        backoff_max_s: float = 5.0,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        transport: httpx.AsyncBaseTransport | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise ValueError(
                f"SGLangClient: base_url must be an http(s) URL such as "
                f"'http://127.0.0.1:30000', got {base_url!r}"
            )
        if not isinstance(rng, random.Random):
            raise ValueError(
                f"SGLangClient: rng must be a seeded random.Random (backoff jitter), got {rng!r}"
            )
        _check_positive("timeout_s", timeout_s)
        # The default health generation waits up to SGLANG_HEALTH_CHECK_TIMEOUT (20 s).
        _check_positive("health_timeout_s", health_timeout_s)
        if not is_int(retries) or retries < 0:
            raise ValueError(f"SGLangClient: retries must be an int >= 0, got {retries!r}")
        if not is_real(backoff_base_s) or backoff_base_s < 0:
            raise ValueError(
                f"SGLangClient: backoff_base_s must be a number >= 0, got {backoff_base_s!r}"
            )
        if not is_real(backoff_max_s) or backoff_max_s < backoff_base_s:
            raise ValueError(
                f"SGLangClient: backoff_max_s must be a number >= backoff_base_s "
                f"({backoff_base_s!r}), got {backoff_max_s!r}"
            )
        if not is_int(max_body_bytes):
            raise ValueError(
                f"SGLangClient: max_body_bytes must be an int >= 1, got {max_body_bytes!r}"
            )
        if max_body_bytes < 1:
            raise ValueError(
                f"SGLangClient: max_body_bytes must be an int >= 1, got {max_body_bytes!r}"
            )
        for name, key in (("api_key", api_key), ("admin_api_key", admin_api_key)):
            if key is not None and (not isinstance(key, str) or not key):
                raise ValueError(f"SGLangClient: {name} must be None or a non-empty str")
        self.base_url = base_url.rstrip("/")
        self._rng = rng
        self._api_key = api_key
        self._admin_api_key = admin_api_key
        self._timeout_s = float(timeout_s)
        self._health_timeout_s = float(health_timeout_s)
        self._retries = retries
        self._backoff_base_s = float(backoff_base_s)
        self._backoff_max_s = float(backoff_max_s)
        self._max_body_bytes = max_body_bytes
        self._clock = clock
        self._sleep = sleep
        # aiohttp underneath unless a transport is injected (tests: httpx.MockTransport):
        # less CPU per scrape than httpcore's, and no proxy from the environment sees the
        # API key (adapters/aiohttp_transport.py).
        self._client = httpx.AsyncClient(
            base_url=self.base_url,
            transport=transport if transport is not None else AiohttpTransport(),
            timeout=self._timeout_s,
            headers={"User-Agent": _USER_AGENT},
            follow_redirects=False,
        )
        self._closed = False
        # The absolute URL of each (path, query) asked for: httpx parses and merges a
        # relative URL into the base at every request, a fifth of a scrape's CPU.
        self._urls: dict[tuple[str, tuple[tuple[str, str], ...]], httpx.URL] = {}

    # ------------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> SGLangClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            await self._client.aclose()

    @property
    def closed(self) -> bool:
        return self._closed

    # ---------------------------------------------------------------- endpoints

    async def scrape_metrics(
        self, *, families: Collection[str] | None = METRICS_READ
    ) -> MetricsScrape:
        """``GET /metrics``, parsed. Raises TemporaryScrapeError / PermanentScrapeError.

        ``families``: the metric families kept in the snapshot (default: the ones
        telemetry reads, parsed by the fast lexer; None: every family, with
        prometheus_client's parser). ``text`` always holds the whole body.
        """
        start = self._clock()
        resp, content = await self._get(
            METRICS_PATH, expected=EXPECTED_FORMAT, headers={"Accept": _METRICS_ACCEPT}
        )
        arrived = self._clock()
        try:
            text = content.decode(resp.encoding or "utf-8", errors="replace")
        except LookupError:  # a charset that names no text codec (e.g. rot13)
            text = content.decode("utf-8", errors="replace")
        snapshot = parse_metrics(text, source=str(resp.request.url), families=families)
        return MetricsScrape(
            time_s=arrived, latency_s=max(arrived - start, 0.0), snapshot=snapshot, text=text
        )

    async def server_info(self) -> dict[str, Any]:
        """``GET /server_info``: resolved server args, scheduler info, internal_states."""
        return await self.get_json(SERVER_INFO_PATH, expected="the /server_info JSON object")

    async def loads(self) -> dict[str, Any]:
        """``GET /v1/loads?include=core,memory,spec,queues``: per-DP-rank load snapshots."""
        return await self.get_json(
            LOADS_PATH,
            params={"include": ",".join(LOADS_INCLUDE)},
            expected='the /v1/loads JSON object with a "loads" list',
        )

    async def model_info(self) -> dict[str, Any]:
        """``GET /model_info``: model path, served model name, architectures."""
        return await self.get_json(MODEL_INFO_PATH, expected="the /model_info JSON object")

    async def get_json(
        self,
        path: str,
        *,
        expected: str = "a JSON object",
        params: Mapping[str, str] | None = None,
        admin: bool = False,
    ) -> dict[str, Any]:
        """GET a JSON-object endpoint. ``admin`` sends the admin key (admin endpoints)."""
        resp, content = await self._get(path, expected=expected, params=params, admin=admin)
        url = str(resp.request.url)
        try:
            body = json.loads(content)
        except (ValueError, UnicodeDecodeError) as exc:
            start = content[:120].decode("utf-8", errors="replace")
            raise ResponseFormatError(
                url, expected, f"body is not JSON ({exc}): {bounded_repr(start)}"
            ) from None
        except RecursionError:  # nesting deeper than the interpreter's stack allows
            raise ResponseFormatError(
                url, expected, "body is JSON nested too deeply to read"
            ) from None
        if not isinstance(body, dict):
            raise ResponseFormatError(url, expected, f"body is a {type(body).__name__}")
        return body

    async def health(self) -> HealthResult:
        """``GET /health`` once, without retries (it is itself the probe).

        Never raises for 503, 5xx, timeouts or connection failures: those are states.
        Raises PermanentScrapeError for 401/403/404 and other 4xx, since SGLang always
        serves /health openly: such an answer comes from something else.
        """
        if self._closed:
            raise RuntimeError("SGLangClient is closed")
        url = f"{self.base_url}{HEALTH_PATH}"
        try:
            resp = await self._client.get(
                HEALTH_PATH, headers=self._auth_headers(False), timeout=self._health_timeout_s
            )
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            return HealthResult(HealthState.UNREACHABLE, None, f"cannot connect: {_describe(exc)}")
        except httpx.TimeoutException as exc:
            return HealthResult(
                HealthState.UNHEALTHY,
                None,
                f"no answer within {self._health_timeout_s:g} s ({_describe(exc)})",
            )
        except httpx.TransportError as exc:
            return HealthResult(
                HealthState.UNREACHABLE, None, f"connection failed: {_describe(exc)}"
            )
        code = resp.status_code
        if 200 <= code < 300:
            return HealthResult(HealthState.UP, code, "healthy")
        if code == 503:
            return HealthResult(
                HealthState.STARTING, code, "503: starting, shutting down, or health check failed"
            )
        if code >= 500:
            return HealthResult(HealthState.UNHEALTHY, code, f"server error {code}")
        raise PermanentScrapeError(
            url,
            "SGLang's /health (always served without a key: 200 up, 503 not ready)",
            f"unexpected status {code}: this does not look like an SGLang server",
            status_code=code,
        )

    # ----------------------------------------------------------------- internals

    def _auth_headers(self, admin: bool) -> dict[str, str]:
        # Normal endpoints accept only --api-key when it is set; admin endpoints take
        # --admin-api-key when the server has one (decide_request_auth, utils/auth.py).
        key = (self._admin_api_key or self._api_key) if admin else self._api_key
        return {"Authorization": f"Bearer {key}"} if key else {}

    def backoff_s(self, attempt: int) -> float:
        """Sleep before retry ``attempt + 1``: full jitter, U(0, min(max, base·2^attempt))."""
        cap = min(self._backoff_max_s, self._backoff_base_s * (2.0**attempt))
        return self._rng.uniform(0.0, cap)

    def _classify(self, resp: httpx.Response, url: str, expected: str) -> ScrapeError | None:
        code = resp.status_code
        if 200 <= code < 300:
            return None
        if code == 503:
            return TemporaryScrapeError(
                url, expected, "service unavailable (starting or shutting down)", status_code=code
            )
        if code == 429 or code >= 500:
            return TemporaryScrapeError(url, expected, f"server error {code}", status_code=code)
        if code == 401:
            sent = "the API key sent was rejected" if self._api_key else "no API key was sent"
            return PermanentScrapeError(
                url,
                expected,
                f"unauthorized: {sent}; the server runs with --api-key "
                "(pass api_key=..., sent as 'Authorization: Bearer <key>')",
                status_code=code,
            )
        if code == 403:
            return PermanentScrapeError(
                url,
                expected,
                "forbidden: an admin endpoint needs the server's --admin-api-key "
                "(pass admin_api_key=...)",
                status_code=code,
            )
        if code == 404:
            path = resp.request.url.path
            hint = (
                "the server was launched without --enable-metrics"
                if path == METRICS_PATH
                else "not an SGLang 0.5.x server, or a version without this endpoint"
            )
            return PermanentScrapeError(
                url, expected, f"endpoint not found: {hint}", status_code=code
            )
        return PermanentScrapeError(url, expected, f"unexpected status {code}", status_code=code)

    async def _get(
        self,
        path: str,
        *,
        expected: str,
        params: Mapping[str, str] | None = None,
        headers: Mapping[str, str] | None = None,
        admin: bool = False,
    ) -> tuple[httpx.Response, bytes]:
        """The response and its body (read up to ``max_body_bytes``), retried as the
        module docstring says."""
        if self._closed:
            raise RuntimeError("SGLangClient is closed")
        url = f"{self.base_url}{path}"
        request_headers = {**self._auth_headers(admin), **(headers or {})}
        query = tuple(params.items()) if params else ()
        target = self._urls.get((path, query))
        if target is None:
            target = self._client.build_request("GET", path, params=params).url
            if len(self._urls) < MAX_CACHED_URLS:  # bounded for get_json's free params
                self._urls[(path, query)] = target
        attempts = 1 + self._retries
        last: ScrapeError | None = None
        for attempt in range(attempts):
            try:
                request = self._client.build_request("GET", target, headers=request_headers)
                resp = await self._client.send(request, stream=True)
                try:
                    err = self._classify(resp, url, expected)
                    content = b"" if err is not None else await self._read_body(resp, url, expected)
                finally:
                    await resp.aclose()
            except httpx.TimeoutException as exc:
                last = TemporaryScrapeError(
                    url, expected, f"timed out after {self._timeout_s:g} s ({_describe(exc)})"
                )
            except (httpx.UnsupportedProtocol, httpx.LocalProtocolError) as exc:
                raise PermanentScrapeError(url, expected, _describe(exc)) from None
            except httpx.TransportError as exc:
                last = TemporaryScrapeError(url, expected, f"connection failed: {_describe(exc)}")
            except httpx.DecodingError as exc:
                # A body that cannot be decoded (a gzip header on plain bytes): malformed,
                # temporary like any format error, not retried within this request.
                raise ResponseFormatError(
                    url, expected, f"body cannot be decoded ({_describe(exc)})"
                ) from None
            except httpx.HTTPError as exc:
                # Anything else httpx raises for one exchange is a temporary fault; it must
                # never escape to the daemon's loop.
                last = TemporaryScrapeError(url, expected, f"request failed: {_describe(exc)}")
            else:
                if err is None:
                    return resp, content
                if isinstance(err, PermanentScrapeError):
                    raise err
                last = err
            if attempt + 1 < attempts:
                await self._sleep(self.backoff_s(attempt))
        assert last is not None
        raise type(last)(
            last.url,
            last.expected,
            f"giving up: {last.detail}",
            status_code=last.status_code,
            attempts=attempts,
        )

    async def _read_body(self, resp: httpx.Response, url: str, expected: str) -> bytes:
        """The decoded body, refused (ResponseFormatError) past ``max_body_bytes``
        without reading the rest: memory stays bounded whatever the server sends,
        a compressed bomb included (the limit counts decompressed bytes)."""
        limit = self._max_body_bytes

        def too_big(what: str) -> ResponseFormatError:
            return ResponseFormatError(
                url, expected, f"body {what} exceeds the limit of {limit} bytes (max_body_bytes)"
            )

        declared = resp.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit and "content-encoding" not in resp.headers:
            raise too_big(f"of {declared} bytes (Content-Length)")
        chunks: list[bytes] = []
        size = 0
        async for chunk in resp.aiter_bytes():
            size += len(chunk)
            if size > limit:
                raise too_big("read so far")
            chunks.append(chunk)
        return b"".join(chunks)


def _describe(exc: BaseException) -> str:
    # httpx/h11 texts can quote the server's bytes (a bad status line, a header).
    text = escape_upstream(str(exc))
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
