"""SGLangClient against httpx.MockTransport: retries, backoff, auth, faults.

No pytest-asyncio here: each test drives its coroutine with asyncio.run(), and the
client's sleep is a recorder, so no test waits.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest

from specgov.adapters.errors import (
    PermanentScrapeError,
    ResponseFormatError,
    TemporaryScrapeError,
)
from specgov.adapters.sglang_http import MAX_CACHED_URLS, HealthState, SGLangClient

FIXTURES = Path(__file__).parent / "fixtures" / "sglang"
BASE = "http://sglang.test:30000"
METRICS_TEXT = (FIXTURES / "eagle3_adaptive_A.prom").read_text()
SERVER_INFO = json.loads((FIXTURES / "eagle3_adaptive_server_info.json").read_text())
LOADS = json.loads((FIXTURES / "eagle3_adaptive_loads_A.json").read_text())
MODEL_INFO = json.loads((FIXTURES / "eagle3_adaptive_model_info.json").read_text())
STARTING = json.loads((FIXTURES / "starting_health.json").read_text())

T = TypeVar("T")
Handler = Callable[[httpx.Request], httpx.Response]


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


class Recorder:
    """Counts requests, keeps them, and answers from a handler."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.requests: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        return self.handler(request)


class FakeSleep:
    def __init__(self) -> None:
        self.delays: list[float] = []

    async def __call__(self, seconds: float) -> None:
        self.delays.append(seconds)


class FakeClock:
    def __init__(self, start: float = 100.0, step: float = 0.5) -> None:
        self.now = start
        self.step = step

    def __call__(self) -> float:
        value = self.now
        self.now += self.step
        return value


def client(
    handler: Handler, *, sleep: FakeSleep | None = None, seed: int = 7, **kwargs: Any
) -> SGLangClient:
    return SGLangClient(
        BASE,
        rng=random.Random(seed),
        transport=httpx.MockTransport(handler),
        sleep=sleep or FakeSleep(),
        clock=kwargs.pop("clock", FakeClock()),
        **kwargs,
    )


def sglang_like(api_key: str | None = None) -> Handler:
    """Answers like SGLang's routes and auth middleware (decide_request_auth)."""

    def handle(request: httpx.Request) -> httpx.Response:
        path = request.url.path
        open_path = path.startswith(("/health", "/metrics", "/ready"))
        authorized = request.headers.get("Authorization") == f"Bearer {api_key}"
        if api_key and not open_path and not authorized:
            return httpx.Response(401, json={"error": "Unauthorized"})
        if path == "/metrics":
            return httpx.Response(200, text=METRICS_TEXT)
        if path == "/health":
            return httpx.Response(200)
        if path == "/server_info":
            return httpx.Response(200, json=SERVER_INFO)
        if path == "/v1/loads":
            return httpx.Response(200, json=LOADS)
        if path == "/model_info":
            return httpx.Response(200, json=MODEL_INFO)
        return httpx.Response(404, json={"detail": "Not Found"})

    return handle


# --------------------------------------------------------------------- happy path


def test_scrape_metrics_parses_and_stamps_with_the_injected_clock() -> None:
    rec = Recorder(sglang_like())

    async def go() -> None:
        async with client(rec, clock=FakeClock(100.0, 0.5)) as c:
            scrape = await c.scrape_metrics()
            assert scrape.time_s == 100.5 and scrape.latency_s == 0.5
            assert scrape.text == METRICS_TEXT
            assert any(k.name == "sglang:num_running_reqs" for k in scrape.snapshot.gauges)

    run(go())
    assert rec.requests[0].headers["Accept"].startswith("text/plain")
    assert "Authorization" not in rec.requests[0].headers


def test_json_endpoints_and_loads_query() -> None:
    rec = Recorder(sglang_like())

    async def go() -> None:
        async with client(rec) as c:
            assert (await c.server_info())["speculative_algorithm"] == "EAGLE3"
            assert (await c.loads())["loads"][0]["dp_rank"] == 0
            assert (await c.model_info())["architectures"] == ["LlamaForCausalLM"]

    run(go())
    paths = [r.url.path for r in rec.requests]
    assert paths == ["/server_info", "/v1/loads", "/model_info"]
    assert rec.requests[1].url.params["include"] == "core,memory,spec,queues"


def test_repeated_requests_send_the_same_absolute_urls_with_their_queries() -> None:
    # The client resolves each (path, query) against the base URL once and reuses it.
    rec = Recorder(sglang_like())

    async def go() -> None:
        async with client(rec) as c:
            for _ in range(2):
                await c.loads()
                await c.scrape_metrics()
            # The same path with another query is another URL (the key holds the query).
            await c.get_json("/v1/loads", params={"include": "core"}, expected="loads")
            # Past the bound, URLs are still resolved, only not kept.
            for i in range(MAX_CACHED_URLS + 2):
                await c.get_json("/v1/loads", params={"n": str(i)}, expected="loads")
            assert len(c._urls) == MAX_CACHED_URLS

    run(go())
    urls = [str(r.url) for r in rec.requests]
    loads_url = f"{BASE}/v1/loads?include=core%2Cmemory%2Cspec%2Cqueues"
    assert urls[:5] == [loads_url, f"{BASE}/metrics"] * 2 + [f"{BASE}/v1/loads?include=core"]
    assert urls[5:] == [f"{BASE}/v1/loads?n={i}" for i in range(MAX_CACHED_URLS + 2)]
    assert [r.headers["Accept"].startswith("text/plain") for r in rec.requests[:4]] == [
        False,
        True,
    ] * 2


def test_api_key_is_sent_as_bearer_and_unlocks_the_server() -> None:
    rec = Recorder(sglang_like(api_key="s3cret"))

    async def go() -> None:
        async with client(rec, api_key="s3cret") as c:
            await c.server_info()
            await c.scrape_metrics()

    run(go())
    assert all(r.headers["Authorization"] == "Bearer s3cret" for r in rec.requests)


def test_admin_requests_send_the_admin_key() -> None:
    rec = Recorder(lambda r: httpx.Response(200, json={"ok": True}))

    async def go() -> None:
        async with client(rec, api_key="user", admin_api_key="root") as c:
            await c.get_json("/hicache/storage-backend", admin=True)
            await c.server_info()

    run(go())
    assert rec.requests[0].headers["Authorization"] == "Bearer root"
    assert rec.requests[1].headers["Authorization"] == "Bearer user"


# ------------------------------------------------------------------ retry/backoff


def flaky(failures: list[Callable[[httpx.Request], httpx.Response]]) -> Handler:
    """Fails with each of ``failures`` in turn, then answers like SGLang."""
    ok = sglang_like()

    def handle(request: httpx.Request) -> httpx.Response:
        if failures:
            return failures.pop(0)(request)
        return ok(request)

    return handle


def status(code: int) -> Callable[[httpx.Request], httpx.Response]:
    return lambda request: httpx.Response(code)


def raise_(exc_type: type[httpx.TransportError]) -> Callable[[httpx.Request], httpx.Response]:
    def fail(request: httpx.Request) -> httpx.Response:
        raise exc_type("simulated", request=request)

    return fail


def test_503_and_timeouts_are_retried_with_capped_full_jitter() -> None:
    rec = Recorder(flaky([status(503), raise_(httpx.ReadTimeout), status(502)]))
    sleep = FakeSleep()

    async def go() -> None:
        async with client(rec, sleep=sleep, retries=3, backoff_base_s=0.5, backoff_max_s=1.5) as c:
            assert (await c.server_info())["version"] == "0.5.23"

    run(go())
    assert len(rec.requests) == 4
    assert len(sleep.delays) == 3
    caps = [0.5, 1.0, 1.5]  # min(max, base * 2**attempt)
    assert all(0.0 <= d <= cap for d, cap in zip(sleep.delays, caps, strict=True))


def test_backoff_is_deterministic_for_a_seed() -> None:
    def delays(seed: int) -> list[float]:
        sleep = FakeSleep()
        rec = Recorder(flaky([status(503)] * 3))

        async def go() -> None:
            async with client(rec, sleep=sleep, seed=seed, retries=3) as c:
                await c.scrape_metrics()

        run(go())
        return sleep.delays

    assert delays(1) == delays(1)
    assert delays(1) != delays(2)


def test_gives_up_after_the_retry_budget() -> None:
    rec = Recorder(status(503))
    sleep = FakeSleep()

    async def go() -> None:
        async with client(rec, sleep=sleep, retries=2) as c:
            await c.loads()

    with pytest.raises(TemporaryScrapeError) as err:
        run(go())
    assert len(rec.requests) == 3 and len(sleep.delays) == 2
    assert err.value.attempts == 3 and err.value.status_code == 503
    assert "after 3 attempts" in str(err.value) and "/v1/loads" in str(err.value)


def test_server_gone_is_a_temporary_connection_error() -> None:
    rec = Recorder(raise_(httpx.ConnectError))

    async def go() -> None:
        async with client(rec, retries=1) as c:
            await c.scrape_metrics()

    with pytest.raises(TemporaryScrapeError, match="connection failed") as err:
        run(go())
    assert err.value.attempts == 2 and len(rec.requests) == 2


def test_timeout_error_names_the_limit() -> None:
    rec = Recorder(raise_(httpx.ConnectTimeout))

    async def go() -> None:
        async with client(rec, retries=0, timeout_s=2.5) as c:
            await c.server_info()

    with pytest.raises(TemporaryScrapeError, match=r"timed out after 2\.5 s"):
        run(go())
    assert len(rec.requests) == 1


@pytest.mark.parametrize(
    ("code", "path", "needle"),
    [
        (401, "/server_info", "--api-key"),
        (403, "/server_info", "--admin-api-key"),
        (404, "/metrics", "--enable-metrics"),
        (404, "/server_info", "not an SGLang 0.5.x server"),
        (400, "/v1/loads", "unexpected status 400"),
    ],
)
def test_permanent_errors_are_not_retried(code: int, path: str, needle: str) -> None:
    rec = Recorder(status(code))
    sleep = FakeSleep()

    async def go() -> None:
        async with client(rec, sleep=sleep, retries=5) as c:
            if path == "/metrics":
                await c.scrape_metrics()
            elif path == "/v1/loads":
                await c.loads()
            else:
                await c.server_info()

    with pytest.raises(PermanentScrapeError) as err:
        run(go())
    assert not isinstance(err.value, TemporaryScrapeError)
    assert len(rec.requests) == 1 and sleep.delays == []
    assert err.value.status_code == code and needle in str(err.value)
    assert path in err.value.url


def test_missing_key_against_a_keyed_server() -> None:
    rec = Recorder(sglang_like(api_key="s3cret"))

    async def go() -> None:
        async with client(rec) as c:
            # /metrics is always open (Prometheus scraping needs no secret) ...
            await c.scrape_metrics()
            # ... /server_info is not.
            await c.server_info()

    with pytest.raises(PermanentScrapeError, match="no API key was sent"):
        run(go())


@pytest.mark.parametrize(
    ("path", "body", "needle"),
    [
        ("/metrics", "<html>oops</html>", "unparseable"),
        ("/server_info", "not json", "not JSON"),
        ("/server_info", "[1, 2]", "body is a list"),
    ],
)
def test_bad_bodies_are_format_errors(path: str, body: str, needle: str) -> None:
    rec = Recorder(lambda r: httpx.Response(200, text=body))

    async def go() -> None:
        async with client(rec, retries=3) as c:
            if path == "/metrics":
                await c.scrape_metrics()
            else:
                await c.server_info()

    with pytest.raises(ResponseFormatError, match=needle) as err:
        run(go())
    assert len(rec.requests) == 1  # not retried at once: the next scrape round retries
    # Issue 9: temporary, counted as kind "format", never "permanent".
    assert isinstance(err.value, TemporaryScrapeError)
    assert not isinstance(err.value, PermanentScrapeError)
    assert err.value.kind == "format"


# ----------------------------------------------------------------------- health


@pytest.mark.parametrize(
    ("handler", "state", "code"),
    [
        (status(200), HealthState.UP, 200),
        (
            lambda r: httpx.Response(STARTING["status_code"], text=STARTING["body"]),
            HealthState.STARTING,
            503,
        ),
        (status(500), HealthState.UNHEALTHY, 500),
        (raise_(httpx.ReadTimeout), HealthState.UNHEALTHY, None),
        (raise_(httpx.ConnectError), HealthState.UNREACHABLE, None),
        (raise_(httpx.ReadError), HealthState.UNREACHABLE, None),
    ],
)
def test_health_states_without_retries(
    handler: Handler, state: HealthState, code: int | None
) -> None:
    rec = Recorder(handler)
    sleep = FakeSleep()

    async def go() -> None:
        async with client(rec, sleep=sleep, retries=4) as c:
            result = await c.health()
            assert result.state is state and result.status_code == code
            assert result.ok is (state is HealthState.UP)

    run(go())
    assert len(rec.requests) == 1 and sleep.delays == []
    assert rec.requests[0].url.path == STARTING["path"]


def test_health_from_something_else_is_permanent() -> None:
    rec = Recorder(status(404))

    async def go() -> None:
        async with client(rec) as c:
            await c.health()

    with pytest.raises(PermanentScrapeError, match="does not look like an SGLang server"):
        run(go())


# -------------------------------------------------------------------- lifecycle


def test_context_manager_closes_the_client() -> None:
    rec = Recorder(sglang_like())

    async def go() -> SGLangClient:
        async with client(rec) as c:
            await c.scrape_metrics()
        assert c.closed
        with pytest.raises(RuntimeError, match="closed"):
            await c.scrape_metrics()
        await c.aclose()  # idempotent
        return c

    run(go())
    assert len(rec.requests) == 1


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"base_url": "sglang:30000"}, "http(s) URL"),
        ({"rng": 7}, "seeded random.Random"),
        ({"retries": -1}, "retries"),
        ({"timeout_s": 0}, "timeout_s"),
        ({"backoff_base_s": 2.0, "backoff_max_s": 1.0}, "backoff_max_s"),
        ({"api_key": ""}, "api_key"),
        ({"max_body_bytes": 0}, "max_body_bytes"),
        ({"max_body_bytes": True}, "max_body_bytes"),
    ],
)
def test_constructor_validates(kwargs: dict[str, Any], needle: str) -> None:
    args: dict[str, Any] = {"base_url": BASE, "rng": random.Random(0)}
    args.update(kwargs)
    base_url = args.pop("base_url")
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        SGLangClient(base_url, **args)


def test_backoff_never_exceeds_its_cap() -> None:
    c = SGLangClient(BASE, rng=random.Random(3), backoff_base_s=0.25, backoff_max_s=2.0)
    for attempt in range(12):
        assert 0.0 <= c.backoff_s(attempt) <= min(2.0, 0.25 * 2**attempt)
    run(c.aclose())


# ------------------------------------------------------------- bounded, escaped (issue 9)


def _one(path: str, body: bytes, **kwargs: Any) -> BaseException:
    """The error a client raises for ``path`` answered 200 with ``body``."""
    rec = Recorder(lambda r: httpx.Response(200, content=body))

    async def go() -> None:
        async with client(rec, **kwargs) as c:
            if path == "/metrics":
                await c.scrape_metrics()
            else:
                await c.server_info()

    with pytest.raises(ResponseFormatError) as err:
        run(go())
    return err.value


@pytest.mark.parametrize(
    "body",
    [
        METRICS_TEXT[: len(METRICS_TEXT) // 2].rsplit("{", 1)[0] + '{tp_rank="0"',  # cut
        METRICS_TEXT.replace('"', "", 3),  # garbled
        "\x00\x1b[31m\rEVIL\n" * 3,
    ],
)
def test_truncated_or_garbled_metrics_is_a_format_error(body: str) -> None:
    err = _one("/metrics", body.encode())
    assert isinstance(err, TemporaryScrapeError) and getattr(err, "kind", None) == "format"


def test_upstream_bytes_in_error_messages_are_escaped_and_bounded() -> None:
    # A label value and a JSON body carrying NUL, ESC, CR, newline, DEL, a C1 control
    # and a bidi override: none reaches the message raw; a huge line is cut.
    nasty = "a\x00b\x1b[2Jc\x7ff\x85g\u202eh\\n\rz"  # "\\n": an escaped newline
    # A family the daemon reads (the default scrape parses only those).
    g = "sglang:num_running_reqs"
    text = f'# TYPE {g} gauge\n{g}{{x="{nasty}"}} 1\n{g}{{x="{nasty}"}} 2\n'
    err = _one("/metrics", text.encode())
    message = str(err)
    assert "appears twice" in message
    assert message.isprintable()
    for raw in ("\x00", "\x1b", "\r", "\n", "\x7f", "\x85", "\u202e"):
        assert raw not in message
    assert "\\x00" in message and "\\x1b" in message and "\\r" in message

    huge = g + "{" + "y" * 3_000_000 + " 1\n"
    err = _one("/metrics", huge.encode())
    message = str(err)
    assert len(message) < 2_000
    assert "[cut: " in message and "characters in all]" in message

    err = _one("/server_info", b"\x00\x1b]0;pwned\x07" + b"z" * 100_000)
    assert str(err).isprintable() and len(str(err)) < 2_000


def test_deeply_nested_json_is_a_format_error_not_a_recursion_error() -> None:
    err = _one("/server_info", b"[" * 200_000 + b"]" * 200_000)
    assert "nested too deeply" in str(err) or "not JSON" in str(err)


def test_a_body_past_max_body_bytes_is_refused_without_reading_it_all() -> None:
    chunks_sent: list[int] = []

    async def stream() -> Any:
        for _ in range(1000):  # 1000 x 64 KiB = 62.5 MiB if it were read whole
            chunks_sent.append(1)
            yield b"# HELP x y\n" * 6000

    async def go() -> None:
        transport = httpx.MockTransport(lambda r: httpx.Response(200, content=stream()))
        async with SGLangClient(
            BASE, rng=random.Random(0), transport=transport, max_body_bytes=1_000_000
        ) as c:
            await c.scrape_metrics()

    with pytest.raises(ResponseFormatError, match="exceeds the limit of 1000000 bytes") as err:
        run(go())
    assert err.value.kind == "format"
    assert len(chunks_sent) < 30  # stopped soon after the limit, not at the end

    declared = Recorder(
        lambda r: httpx.Response(200, content=b"x" * 2000, headers={"Content-Length": "2000"})
    )

    async def go_declared() -> None:
        async with client(declared, max_body_bytes=1000) as c:
            await c.server_info()

    with pytest.raises(ResponseFormatError, match="of 2000 bytes"):
        run(go_declared())


def test_health_details_from_transport_errors_are_escaped() -> None:
    def broken(request: httpx.Request) -> httpx.Response:
        raise httpx.RemoteProtocolError("illegal status line: b'HTTP/1.1 200\x1b[2J\x00\r'")

    async def go() -> Any:
        async with client(broken) as c:
            return await c.health()

    result = run(go())
    assert result.state is HealthState.UNREACHABLE
    assert result.detail.isprintable() and "\\x1b" in result.detail
