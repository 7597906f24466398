"""Property tests: whatever a client sends, the control API answers 2xx or 4xx with a JSON
error naming the problem, never a 500 or a traceback (issue 9 §3).

The service behind the API is a real daemon (no SGLang server: the routes that need
telemetry refuse with a 400 saying so), served on loopback, so the daemon's own
validation is under test too. Hypothesis runs derandomized (the same examples every
run); the number of examples each test ran is printed (``-s`` shows it).
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from aiohttp import web
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from specgov.controller.daemon.config import load_config
from specgov.controller.daemon.control_api import make_app
from specgov.controller.daemon.runtime import Daemon
from specgov.controller.daemon.state_store import StateStore

EXAMPLES = 100
PROFILE = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

_json_leaf = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**30), max_value=10**30)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=40)
)
_json = st.recursive(
    _json_leaf,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4)
    ),
    max_leaves=25,
)
_override_like = st.dictionaries(
    st.sampled_from(["slot", "steps", "disable", "pin_policy", "ttl", "reason", "other"]),
    _json_leaf | st.sampled_from(["30m", "1h", "-5s", "1e400", "goodput", "static:steps=2"]),
    max_size=6,
)
_policy_like = st.dictionaries(
    st.sampled_from(["spec", "other"]),
    _json_leaf | st.sampled_from(["goodput", "static:steps=2", "nope", "goodput:x=1", "ema"]),
    max_size=2,
)


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("api")
    config = load_config(
        None,
        env={},
        overrides={
            "server.url": "http://127.0.0.1:9",
            "state.db_path": str(tmp / "state.db"),
            "spool.dir": str(tmp / "spool"),
        },
    )
    daemon = Daemon(
        config, store=StateStore(config.state.db_path, open_now=False), registry=CollectorRegistry()
    )
    app = make_app(daemon, token=None, listen_host="127.0.0.1")
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app, access_log=None)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = runner.addresses[0][1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.run_until_complete(runner.cleanup())
        loop.close()


@pytest.fixture(scope="module")
def client(api: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=api, timeout=30.0, trust_env=False) as c:
        yield c


_RUNS: dict[str, int] = {}


def _check(client: httpx.Client, test: str, method: str, path: str, **kwargs: Any) -> None:
    _RUNS[test] = _RUNS.get(test, 0) + 1
    reply = client.request(method, path, **kwargs)
    assert reply.status_code < 500, (method, path, kwargs, reply.text)
    assert "Traceback" not in reply.text
    body = json.loads(reply.text)  # always JSON
    if reply.status_code >= 400:
        assert isinstance(body, dict) and isinstance(body.get("error"), str), reply.text
        assert body["error"].strip()


@PROFILE
@given(raw=st.binary(max_size=600))
def test_arbitrary_bytes(client: httpx.Client, raw: bytes) -> None:
    _check(client, "bytes", "POST", "/v1/overrides", content=raw)
    _check(client, "bytes", "PUT", "/v1/policy", content=raw)


@PROFILE
@given(value=_json)
def test_arbitrary_json(client: httpx.Client, value: Any) -> None:
    text = json.dumps(value)
    _check(client, "json", "POST", "/v1/overrides", content=text)
    _check(client, "json", "PUT", "/v1/policy", content=text)


@PROFILE
@given(body=_override_like)
def test_override_shaped_bodies(client: httpx.Client, body: dict[str, Any]) -> None:
    _check(client, "override", "POST", "/v1/overrides", content=json.dumps(body))


@PROFILE
@given(body=_policy_like)
def test_policy_shaped_bodies(client: httpx.Client, body: dict[str, Any]) -> None:
    _check(client, "policy", "PUT", "/v1/policy", content=json.dumps(body))


@PROFILE
@given(depth=st.integers(min_value=0, max_value=5000), opener=st.sampled_from(["[", '{"a":']))
def test_nesting_of_any_depth(client: httpx.Client, depth: int, opener: str) -> None:
    closer = "]" if opener == "[" else "}"
    text = '{"reason": ' + opener * depth + "1" + closer * depth + "}"
    _check(client, "nesting", "POST", "/v1/overrides", content=text)


@PROFILE
@given(
    params=st.dictionaries(
        st.sampled_from(["id", "slot", "all", "since", "limit", "x"]),
        st.text(max_size=20),
        max_size=3,
    )
)
def test_arbitrary_query_parameters(client: httpx.Client, params: dict[str, str]) -> None:
    _check(client, "query", "DELETE", "/v1/overrides", params=params)
    _check(client, "query", "GET", "/v1/decisions", params=params)


def test_examples_ran(capsys: pytest.CaptureFixture[str]) -> None:
    # Runs after the property tests in this file (pytest keeps file order).
    with capsys.disabled():
        print(f"\ncontrol API property examples run: {dict(sorted(_RUNS.items()))}")
    assert set(_RUNS) == {"bytes", "json", "override", "policy", "nesting", "query"}
    assert all(n >= EXAMPLES for n in _RUNS.values())
