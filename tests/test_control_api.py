"""Control API (aiohttp app) and its synchronous client, against a fake ControlService."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import socket
import threading
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from specgov.controller.cli.control_client import (
    ControlAddressError,
    ControlAuthError,
    ControlClient,
    ControlClientError,
    ControlRequestError,
    ControlServerError,
    DaemonUnreachableError,
    control_base_url,
)
from specgov.controller.daemon.control_api import (
    ControlApiConfigError,
    is_loopback_host,
    make_app,
    parse_ttl,
)

TOKEN = "tok-0123456789abcdef"


class FakeService:
    """Records every call; answers like the daemon would, in memory."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.overrides: list[dict[str, Any]] = []
        self.current = "goodput"
        self.ok = True
        self.alive = True
        self.raise_on: dict[str, BaseException] = {}
        self._next_id = 1

    def _call(self, name: str, **kwargs: Any) -> None:
        self.calls.append((name, kwargs))
        if name in self.raise_on:
            raise self.raise_on[name]

    def names(self) -> list[str]:
        return [name for name, _ in self.calls]

    def status(self) -> dict[str, Any]:
        self._call("status")
        return {"policy": self.current, "mode": "observe", "table_age_s": math.nan, "a": [1, 2]}

    def decisions(self, since_s: float | None, limit: int) -> list[dict[str, Any]]:
        self._call("decisions", since_s=since_s, limit=limit)
        rows: list[dict[str, Any]] = [
            {"id": i, "time_s": 100.0 + i, "reason": "initial"} for i in range(3)
        ]
        return [r for r in rows if since_s is None or r["time_s"] >= since_s][:limit]

    def list_overrides(self) -> list[dict[str, Any]]:
        self._call("list_overrides")
        return list(self.overrides)

    def set_override(
        self,
        slot: int | None,
        steps: int | None,
        disable: bool,
        pin_policy: str | None,
        ttl_s: float,
        reason: str,
    ) -> dict[str, Any]:
        args = {
            "slot": slot,
            "steps": steps,
            "disable": disable,
            "pin_policy": pin_policy,
            "ttl_s": ttl_s,
            "reason": reason,
        }
        self._call("set_override", **args)
        override = {"id": f"ov-{self._next_id}", **args}
        self._next_id += 1
        self.overrides.append(override)
        return override

    def clear_override(self, override_id: str | None, slot: int | None) -> int:
        self._call("clear_override", override_id=override_id, slot=slot)
        keep = [
            o
            for o in self.overrides
            if (override_id is not None and o["id"] != override_id)
            or (slot is not None and o["slot"] != slot)
        ]
        cleared = len(self.overrides) - len(keep)
        self.overrides = keep
        return cleared

    def set_policy(self, spec: str) -> dict[str, Any]:
        self._call("set_policy", spec=spec)
        if spec.startswith("nope"):
            raise ValueError(f"policy spec {spec!r}: unknown policy kind 'nope'")
        self.current = spec
        return {"policy": spec}

    def policies(self) -> dict[str, Any]:
        self._call("policies")
        return {"current": self.current, "kinds": ["static", "goodput"]}

    def health(self) -> dict[str, Any]:
        self._call("health")
        return {"ok": self.ok, "acting": self.ok}

    def liveness(self) -> dict[str, Any]:
        self._call("liveness")
        return {"ok": self.alive}

    def recommend(self) -> dict[str, Any]:
        self._call("recommend")
        return {"recommendation": None, "message": "no recommendation yet"}


@dataclass
class Reply:
    status: int
    body: Any
    text: str
    headers: Mapping[str, str]


def run_requests(app: web.Application, *requests: tuple[str, str, dict[str, Any]]) -> list[Reply]:
    """Send the requests in order to ``app`` on a loopback test server."""

    async def go() -> list[Reply]:
        replies = []
        async with TestClient(TestServer(app, host="127.0.0.1")) as client:
            for method, path, kwargs in requests:
                response = await client.request(method, path, **kwargs)
                text = await response.text()
                try:
                    body = json.loads(text)
                except json.JSONDecodeError:
                    body = None
                replies.append(Reply(response.status, body, text, dict(response.headers)))
        return replies

    return asyncio.run(go())


def one(app: web.Application, method: str, path: str, **kwargs: Any) -> Reply:
    return run_requests(app, (method, path, kwargs))[0]


def app_for(service: FakeService, token: str | None = None, **kwargs: Any) -> web.Application:
    return make_app(service, token=token, listen_host="127.0.0.1", **kwargs)


def good_override(**extra: Any) -> dict[str, Any]:
    return {"slot": 8, "steps": 1, "ttl": "30m", "reason": "load test", **extra}


# ------------------------------------------------------------------- happy paths


def test_read_routes_return_the_service_answers() -> None:
    service = FakeService()
    status, policies, policy, recommend, health, overrides = run_requests(
        app_for(service),
        ("GET", "/v1/status", {}),
        ("GET", "/v1/policies", {}),
        ("GET", "/v1/policy", {}),
        ("GET", "/v1/recommend", {}),
        ("GET", "/v1/health", {}),
        ("GET", "/v1/overrides", {}),
    )
    assert status.status == 200
    assert status.headers["Content-Type"].startswith("application/json")
    # NaN is not JSON: unknown values are sent as null; keys are sorted (stable output).
    assert status.body == {"a": [1, 2], "mode": "observe", "policy": "goodput", "table_age_s": None}
    assert status.text.index('"a"') < status.text.index('"mode"') < status.text.index('"policy"')
    assert policies.body == {"current": "goodput", "kinds": ["static", "goodput"]}
    assert policy.body == {"policy": "goodput"}
    assert recommend.body["recommendation"] is None
    assert (health.status, health.body) == (200, {"acting": True, "ok": True})
    assert overrides.body == {"overrides": []}
    assert service.names() == [
        "status",
        "policies",
        "policies",
        "recommend",
        "health",
        "list_overrides",
    ]


def test_health_is_503_when_not_ok() -> None:
    service = FakeService()
    service.ok = False
    reply = one(app_for(service), "GET", "/v1/health")
    assert (reply.status, reply.body["ok"]) == (503, False)


def test_decisions_passes_since_and_limit() -> None:
    service = FakeService()
    default, filtered = run_requests(
        app_for(service),
        ("GET", "/v1/decisions", {}),
        ("GET", "/v1/decisions", {"params": {"since": "101.5", "limit": "1"}}),
    )
    assert service.calls == [
        ("decisions", {"since_s": None, "limit": 100}),
        ("decisions", {"since_s": 101.5, "limit": 1}),
    ]
    assert default.body["count"] == 3 and len(default.body["decisions"]) == 3
    assert filtered.body == {
        "decisions": [{"id": 2, "reason": "initial", "time_s": 102.0}],
        "count": 1,
        "since_s": 101.5,
        "limit": 1,
    }


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (
            {"slot": 8, "steps": 1, "ttl": "30m", "reason": "  load test "},
            {"slot": 8, "steps": 1, "disable": False, "pin_policy": None, "ttl_s": 1800.0},
        ),
        (
            {"steps": 0, "ttl": 90, "reason": "r"},
            {"slot": None, "steps": 0, "disable": False, "pin_policy": None, "ttl_s": 90.0},
        ),
        (
            {"disable": True, "ttl": "250ms", "reason": "r"},
            {"slot": None, "steps": None, "disable": True, "pin_policy": None, "ttl_s": 0.25},
        ),
        (
            {"pin_policy": "static:3", "ttl": "1h", "reason": "r", "disable": False},
            {
                "slot": None,
                "steps": None,
                "disable": False,
                "pin_policy": "static:3",
                "ttl_s": 3600,
            },
        ),
    ],
)
def test_post_override_validates_and_calls_the_service(
    body: dict[str, Any], expected: dict[str, Any]
) -> None:
    service = FakeService()
    reply = one(app_for(service), "POST", "/v1/overrides", json=body)
    assert reply.status == 201, reply.body
    ((name, args),) = service.calls
    assert name == "set_override"
    assert {k: v for k, v in args.items() if k != "reason"} == expected
    assert args["reason"] == body["reason"].strip()
    assert reply.body["override"]["id"] == "ov-1"


def test_delete_overrides_by_id_slot_and_all() -> None:
    service = FakeService()
    app = app_for(service)
    replies = run_requests(
        app,
        ("POST", "/v1/overrides", {"json": good_override()}),
        ("POST", "/v1/overrides", {"json": good_override(slot=16)}),
        ("POST", "/v1/overrides", {"json": good_override(slot=32)}),
        ("DELETE", "/v1/overrides", {"params": {"id": "ov-1"}}),
        ("DELETE", "/v1/overrides", {"params": {"id": "ov-1"}}),
        ("DELETE", "/v1/overrides", {"params": {"slot": "16"}}),
        ("DELETE", "/v1/overrides", {"params": {"slot": "16"}}),
        ("DELETE", "/v1/overrides", {"params": {"all": "true"}}),
        ("DELETE", "/v1/overrides", {"params": {"all": "true"}}),
    )
    statuses = [(r.status, r.body) for r in replies[3:]]
    assert statuses == [
        (200, {"cleared": 1}),
        (404, {"error": "no override in force with id ov-1"}),
        (200, {"cleared": 1}),
        (404, {"error": "no override in force for slot 16"}),
        (200, {"cleared": 1}),
        (200, {"cleared": 0}),  # clearing nothing at all is not an error
    ]
    clears = [args for name, args in service.calls if name == "clear_override"]
    assert clears[0] == {"override_id": "ov-1", "slot": None}
    assert clears[2] == {"override_id": None, "slot": 16}
    assert clears[4] == {"override_id": None, "slot": None}


def test_put_policy_switches_and_service_errors_are_400() -> None:
    service = FakeService()
    ok, bad, now = run_requests(
        app_for(service),
        ("PUT", "/v1/policy", {"json": {"spec": "static:3"}}),
        ("PUT", "/v1/policy", {"json": {"spec": "nope:1"}}),
        ("GET", "/v1/policy", {}),
    )
    assert (ok.status, ok.body) == (200, {"policy": "static:3"})
    assert bad.status == 400
    assert bad.body == {"error": "policy spec 'nope:1': unknown policy kind 'nope'"}
    assert now.body == {"policy": "static:3"}


# -------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ("{", "malformed JSON"),
        ("", "empty body"),
        ("[1, 2]", "expected a JSON object"),
        (b"\xff\xfe", "UTF-8"),
        (json.dumps(good_override(slots=2)), "unknown key 'slots'"),
        (json.dumps(good_override(steps="3")), "steps: expected an integer"),
        (json.dumps(good_override(steps=-1)), "steps: expected an integer from 0"),
        (json.dumps(good_override(steps=1.5)), "steps:"),
        (json.dumps(good_override(slot=0)), "slot: expected an integer from 1"),
        (json.dumps(good_override(slot=True)), "slot:"),
        (json.dumps(good_override(ttl=0)), "ttl: expected a duration > 0"),
        (json.dumps(good_override(ttl="-5m")), "ttl: expected a duration such as"),
        (
            json.dumps(good_override(ttl="200h")),
            "ttl: '200h' is 720000 s, over the limit of 604800 s (7 days)",
        ),
        (json.dumps(good_override(ttl="soon")), "ttl: expected a duration such as"),
        (json.dumps(good_override(ttl=None)), "ttl:"),
        (json.dumps({"steps": 1, "reason": "r"}), "ttl: required"),
        (json.dumps(good_override(reason="   ")), "reason: expected a non-empty string"),
        (json.dumps(good_override(reason=3)), "reason:"),
        (json.dumps({"steps": 1, "ttl": "5m"}), "reason: required"),
        (json.dumps(good_override(reason="x" * 501)), "reason: expected at most 500"),
        (json.dumps(good_override(disable="yes")), "disable: expected true or false"),
        (json.dumps(good_override(disable=True)), "exactly one action"),
        (json.dumps({"slot": 4, "disable": True, "ttl": 5, "reason": "r"}), "slot: applies only"),
        (json.dumps({"slot": 4, "pin_policy": "goodput", "ttl": 5, "reason": "r"}), "slot:"),
        (json.dumps({"ttl": 5, "reason": "r"}), "exactly one action"),
        (json.dumps({"pin_policy": "", "ttl": 5, "reason": "r"}), "pin_policy:"),
        ('{"steps": NaN, "ttl": 5, "reason": "r"}', "NaN"),
        ('{"steps": 1, "steps": 2, "ttl": 5, "reason": "r"}', "'steps' appears twice"),
    ],
)
def test_bad_override_bodies_are_400_naming_the_field(raw: str | bytes, field: str) -> None:
    service = FakeService()
    reply = one(
        app_for(service),
        "POST",
        "/v1/overrides",
        data=raw,
        headers={"Content-Type": "application/json"},
    )
    assert reply.status == 400, reply.text
    assert set(reply.body) == {"error"}
    assert field in reply.body["error"]
    assert service.calls == []


@pytest.mark.parametrize(
    ("method", "path", "params", "field"),
    [
        ("GET", "/v1/decisions", {"limit": "0"}, "limit: expected an integer from 1 to 1000"),
        ("GET", "/v1/decisions", {"limit": "many"}, "limit:"),
        ("GET", "/v1/decisions", {"limit": "1001"}, "limit:"),
        ("GET", "/v1/decisions", {"since": "-1"}, "since: expected unix time"),
        ("GET", "/v1/decisions", {"since": "inf"}, "since:"),
        ("GET", "/v1/decisions", {"sinse": "1"}, "unknown query parameter 'sinse'"),
        ("GET", "/v1/status", {"verbose": "1"}, "unknown query parameter 'verbose'"),
        ("DELETE", "/v1/overrides", {}, "expected exactly one query parameter"),
        ("DELETE", "/v1/overrides", {"id": "ov-1", "slot": "2"}, "got id, slot"),
        ("DELETE", "/v1/overrides", {"all": "yes"}, "all: expected 'true'"),
        ("DELETE", "/v1/overrides", {"slot": "0"}, "slot: expected an integer from 1"),
        ("DELETE", "/v1/overrides", {"id": "a b"}, "id: expected an override id"),
    ],
)
def test_bad_query_parameters_are_400(
    method: str, path: str, params: dict[str, str], field: str
) -> None:
    service = FakeService()
    reply = one(app_for(service), method, path, params=params)
    assert reply.status == 400, reply.text
    assert field in reply.body["error"]
    assert service.calls == []


def test_repeated_query_parameter_is_400() -> None:
    reply = one(app_for(FakeService()), "GET", "/v1/decisions?limit=1&limit=2")
    assert reply.status == 400
    assert "'limit' given 2 times" in reply.body["error"]


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({}, "spec: required"),
        ({"spec": ""}, "spec: expected a non-empty string"),
        ({"spec": 3}, "spec:"),
        ({"spec": "goodput", "force": True}, "unknown key 'force'"),
    ],
)
def test_bad_policy_bodies_are_400(body: dict[str, Any], field: str) -> None:
    service = FakeService()
    reply = one(app_for(service), "PUT", "/v1/policy", json=body)
    assert reply.status == 400
    assert field in reply.body["error"]
    assert service.calls == []


def test_oversized_body_is_413() -> None:
    service = FakeService()
    app = app_for(service, max_body_bytes=256)
    padded = good_override(reason="r" * 400)

    async def chunks() -> AsyncIterator[bytes]:
        data = json.dumps(padded).encode()
        for i in range(0, len(data), 64):
            yield data[i : i + 64]

    with_length, chunked, small = run_requests(
        app,
        ("POST", "/v1/overrides", {"json": padded}),
        ("POST", "/v1/overrides", {"data": chunks()}),  # no Content-Length: read() enforces it
        ("POST", "/v1/overrides", {"json": good_override()}),
    )
    for reply in (with_length, chunked):
        assert reply.status == 413
        assert reply.body == {"error": "request body too large: expected at most 256 bytes"}
    assert small.status == 201
    assert service.names() == ["set_override"]


def test_unknown_route_and_method_are_json_errors() -> None:
    missing, wrong = run_requests(
        app_for(FakeService()),
        ("GET", "/v1/nothing", {}),
        ("PATCH", "/v1/policy", {}),
    )
    assert missing.status == 404 and "/v1/" in missing.body["error"]
    assert wrong.status == 405
    assert "GET" in wrong.body["error"] and "PUT" in wrong.body["error"]


def test_unexpected_service_error_is_a_generic_500(caplog: pytest.LogCaptureFixture) -> None:
    service = FakeService()
    service.raise_on["status"] = RuntimeError("secret internal detail")
    with caplog.at_level(logging.ERROR, logger="specgov.controller.daemon.control_api"):
        reply = one(app_for(service), "GET", "/v1/status")
    assert reply.status == 500
    assert reply.body == {"error": "internal error in the specgov daemon; see its log"}
    assert "secret internal detail" not in reply.text
    assert "secret internal detail" in caplog.text  # logged with its traceback


def test_service_answer_that_is_not_json_is_a_500() -> None:
    service = FakeService()
    service.recommend = lambda: {"when": object()}  # type: ignore[method-assign]
    reply = one(app_for(service), "GET", "/v1/recommend")
    assert reply.status == 500


def test_service_value_error_message_is_the_400_answer() -> None:
    service = FakeService()
    service.raise_on["set_override"] = ValueError("Override.steps: 9 is not a candidate step")
    reply = one(app_for(service), "POST", "/v1/overrides", json=good_override())
    assert (reply.status, reply.body) == (
        400,
        {"error": "Override.steps: 9 is not a candidate step"},
    )


# ---------------------------------------------------------------------- security


def test_token_required_on_every_route_but_health() -> None:
    service = FakeService()
    app = make_app(service, token=TOKEN, listen_host="127.0.0.1")
    good = {"Authorization": f"Bearer {TOKEN}"}
    replies = run_requests(
        app,
        ("GET", "/v1/status", {}),
        ("GET", "/v1/status", {"headers": {"Authorization": "Bearer wrong-token"}}),
        ("GET", "/v1/status", {"headers": {"Authorization": f"Basic {TOKEN}"}}),
        ("GET", "/v1/status", {"headers": {"Authorization": TOKEN}}),
        ("GET", "/v1/status", {"headers": {"Authorization": f"Bearer {TOKEN}x"}}),
        ("POST", "/v1/overrides", {"json": good_override()}),
        ("DELETE", "/v1/overrides", {"params": {"all": "true"}}),
        ("PUT", "/v1/policy", {"json": {"spec": "static:1"}}),
        ("GET", "/v1/nothing", {}),
        ("GET", "/v1/health", {}),
        ("GET", "/v1/status", {"headers": good}),
        ("GET", "/v1/status", {"headers": {"Authorization": f"bearer  {TOKEN} "}}),
    )
    *refused, health, ok, ok_lenient = replies
    for reply in refused:
        assert reply.status == 401, reply.text
        assert "Authorization: Bearer <token>" in reply.body["error"]
        assert reply.headers["WWW-Authenticate"].startswith("Bearer")
        assert TOKEN not in reply.text
    assert health.status == 200
    assert ok.status == 200 and ok_lenient.status == 200
    # Refused requests never reached the service (nothing was changed).
    assert service.names() == ["health", "status", "status"]


def test_auth_is_checked_before_the_body_is_read() -> None:
    service = FakeService()
    app = make_app(service, token=TOKEN, listen_host="127.0.0.1", max_body_bytes=64)
    reply = one(app, "POST", "/v1/overrides", json=good_override(reason="r" * 200))
    assert reply.status == 401


def test_token_is_compared_in_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: Any, b: Any) -> bool:
        seen.append((a, b))
        return real(a, b)

    # control_api looks hmac.compare_digest up at call time, so the spy sees every use.
    monkeypatch.setattr(hmac, "compare_digest", spy)
    app = make_app(FakeService(), token=TOKEN, listen_host="127.0.0.1")
    wrong, right = run_requests(
        app,
        ("GET", "/v1/status", {"headers": {"Authorization": "Bearer x"}}),
        ("GET", "/v1/status", {"headers": {"Authorization": f"Bearer {TOKEN}"}}),
    )
    assert (wrong.status, right.status) == (401, 200)
    assert len(seen) == 2
    # Digests of equal length: the comparison time leaks neither content nor length.
    assert all(len(a) == len(b) == 32 for a, b in seen)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "", "10.1.2.3", "192.168.0.7", "example.com"])
def test_listening_beyond_loopback_needs_a_token(host: str) -> None:
    with pytest.raises(ControlApiConfigError, match="requires a token"):
        make_app(FakeService(), token=None, listen_host=host)
    assert isinstance(make_app(FakeService(), token=TOKEN, listen_host=host), web.Application)


@pytest.mark.parametrize("host", ["127.0.0.1", "127.4.5.6", "::1", "[::1]", "localhost"])
def test_loopback_listen_may_run_without_a_token(host: str) -> None:
    assert is_loopback_host(host)
    reply = one(make_app(FakeService(), token=None, listen_host=host), "GET", "/v1/status")
    assert reply.status == 200


@pytest.mark.parametrize("token", ["", "two words", "tab\there", "naïve"])
def test_unsendable_tokens_are_refused(token: str) -> None:
    with pytest.raises(ControlApiConfigError, match="visible ASCII"):
        make_app(FakeService(), token=token, listen_host="127.0.0.1")


def test_make_app_checks_its_arguments() -> None:
    with pytest.raises(ControlApiConfigError, match="lacks ControlService"):
        make_app(object(), token=None, listen_host="127.0.0.1")  # type: ignore[arg-type]
    with pytest.raises(ControlApiConfigError, match="max_body_bytes"):
        make_app(FakeService(), token=None, listen_host="127.0.0.1", max_body_bytes=0)


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        ("30s", 30.0),
        ("5m", 300.0),
        ("1h", 3600.0),
        ("250ms", 0.25),
        (90, 90.0),
        ("90", 90.0),
        (" 1.5m ", 90.0),
        (604800, 604800.0),
        ("7d", 604800.0),
        ("1e3", 1000.0),
    ],
)
def test_parse_ttl_accepts_the_duration_forms(value: str | int, seconds: float) -> None:
    assert parse_ttl(value) == pytest.approx(seconds)


@pytest.mark.parametrize("value", [0, -1, 604801, "0s", "8d", "1 hour", True, math.inf, [5]])
def test_parse_ttl_rejects(value: object) -> None:
    with pytest.raises(ValueError, match="ttl"):
        parse_ttl(value)


@pytest.mark.parametrize(
    ("value", "seconds"), [("30d", 2592000), ("169h", 608400), (604801, 604801)]
)
def test_a_ttl_over_the_limit_says_so(value: object, seconds: int) -> None:
    """Issue 23: `--ttl 30d` was refused as unparseable; the limit is what it is over."""
    with pytest.raises(ValueError) as err:
        parse_ttl(value)
    assert str(err.value) == (f"ttl: {value!r} is {seconds} s, over the limit of 604800 s (7 days)")


# ------------------------------------------------------------------------ client


@contextmanager
def serve(app: web.Application) -> Iterator[str]:
    """Run ``app`` on a free 127.0.0.1 port in a background thread; yield its URL."""
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
        thread.join(timeout=5)
        loop.run_until_complete(runner.cleanup())
        loop.close()


def test_client_round_trips_every_route() -> None:
    service = FakeService()
    with serve(app_for(service)) as url, ControlClient(url) as client:
        assert client.health() == {"ok": True, "acting": True}
        assert client.status()["policy"] == "goodput"
        assert [d["id"] for d in client.decisions()] == [0, 1, 2]
        assert [d["id"] for d in client.decisions(since_s=101.0, limit=1)] == [1]
        created = client.set_override(slot=8, steps=1, ttl="30m", reason="load test")
        assert created["id"] == "ov-1" and created["ttl_s"] == 1800.0
        client.set_override(disable=True, ttl=60, reason="incident")
        client.set_override(pin_policy="static:1", ttl=60, reason="pin")
        assert [o["id"] for o in client.list_overrides()] == ["ov-1", "ov-2", "ov-3"]
        assert client.clear_override(override_id="ov-2") == 1
        assert client.clear_override(slot=8) == 1
        assert client.clear_override(clear_all=True) == 1
        assert client.set_policy("static:3") == {"policy": "static:3"}
        assert client.policy() == {"policy": "static:3"}
        assert client.policies()["current"] == "static:3"
        assert client.recommend()["recommendation"] is None
    decisions = [args for name, args in service.calls if name == "decisions"]
    assert decisions == [{"since_s": None, "limit": 100}, {"since_s": 101.0, "limit": 1}]
    sets = [args for name, args in service.calls if name == "set_override"]
    assert [(a["disable"], a["pin_policy"]) for a in sets] == [
        (False, None),
        (True, None),
        (False, "static:1"),
    ]


def test_client_health_returns_a_503_answer() -> None:
    service = FakeService()
    service.ok = False
    with serve(app_for(service)) as url, ControlClient(url) as client:
        assert client.health()["ok"] is False


def test_client_raises_the_servers_400_message() -> None:
    service = FakeService()
    with serve(app_for(service)) as url, ControlClient(url) as client:
        with pytest.raises(ControlRequestError) as info:
            client.set_override(slot=8, steps=1, ttl="forever", reason="x")
        with pytest.raises(ControlRequestError, match="no override in force with id ov-9"):
            client.clear_override(override_id="ov-9")
    error = info.value
    assert isinstance(error, ValueError)  # the CLI treats it as bad input
    assert error.status_code == 400
    assert "ttl: expected a duration" in str(error)
    assert f"POST {url}/v1/overrides -> HTTP 400" in str(error)


def test_client_sends_the_token_and_explains_401() -> None:
    service = FakeService()
    app = make_app(service, token=TOKEN, listen_host="127.0.0.1")
    with serve(app) as url:
        with (
            ControlClient(url, token="wrong-token") as bad,
            pytest.raises(ControlAuthError) as info,
        ):
            bad.status()
        with ControlClient(url, token=TOKEN) as good:
            assert good.status()["policy"] == "goodput"
            assert TOKEN not in repr(good)
    assert info.value.status_code == 401
    assert "token" in str(info.value) and "wrong-token" not in str(info.value)


def test_client_says_when_the_daemon_is_not_running() -> None:
    # A bound socket that is not listening: connecting to its port is refused.
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        port = holder.getsockname()[1]
        client = ControlClient(f"127.0.0.1:{port}", timeout_s=2.0)
        with client, pytest.raises(DaemonUnreachableError) as info:
            client.status()
    message = str(info.value)
    assert "is `specgov run` running?" in message
    assert f"tried http://127.0.0.1:{port}/v1/status" in message
    assert isinstance(info.value, ConnectionError)
    assert info.value.status_code is None


def _mock(handler: Any) -> ControlClient:
    return ControlClient("http://127.0.0.1:9465", transport=httpx.MockTransport(handler))


def test_client_timeout_is_unreachable() -> None:
    def slow(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("timed out", request=request)

    with _mock(slow) as client, pytest.raises(DaemonUnreachableError, match="within 5 s"):
        client.status()


def test_client_5xx_and_foreign_answers_are_server_errors() -> None:
    answers = iter(
        [
            httpx.Response(
                500, json={"error": "internal error in the specgov daemon; see its log"}
            ),
            httpx.Response(502, text="<html>Bad Gateway</html>"),
            httpx.Response(200, text="<html>hello</html>"),
            httpx.Response(200, json=[1, 2]),
            httpx.Response(200, json={"decisions": "nope"}),
        ]
    )
    with _mock(lambda request: next(answers)) as client:
        with pytest.raises(ControlServerError, match="HTTP 500: internal error"):
            client.status()
        with pytest.raises(ControlServerError, match="not the specgov control API"):
            client.status()
        with pytest.raises(ControlServerError, match="not a JSON object"):
            client.status()
        with pytest.raises(ControlServerError, match="not a JSON object"):
            client.status()
        with pytest.raises(ControlServerError, match="list of objects under 'decisions'"):
            client.decisions()


def test_client_ignores_proxy_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")
    monkeypatch.setenv("ALL_PROXY", "http://127.0.0.1:9")
    service = FakeService()
    with serve(app_for(service)) as url, ControlClient(url) as client:
        assert client.status()["policy"] == "goodput"


def test_clear_override_needs_exactly_one_selector() -> None:
    with _mock(lambda request: httpx.Response(200, json={"cleared": 0})) as client:
        with pytest.raises(ValueError, match="exactly one"):
            client.clear_override()
        with pytest.raises(ValueError, match="exactly one"):
            client.clear_override(override_id="ov-1", slot=2)
        assert client.clear_override(clear_all=True) == 0


@pytest.mark.parametrize(
    ("address", "url"),
    [
        ("127.0.0.1:9465", "http://127.0.0.1:9465"),
        ("localhost:80", "http://localhost:80"),
        ("[::1]:9465", "http://[::1]:9465"),
        ("http://127.0.0.1:9465/", "http://127.0.0.1:9465"),
        ("https://ctl.internal:8443", "https://ctl.internal:8443"),
    ],
)
def test_control_base_url_accepts(address: str, url: str) -> None:
    assert control_base_url(address) == url


@pytest.mark.parametrize(
    "address",
    ["127.0.0.1", "127.0.0.1:0", "127.0.0.1:70000", "ftp://x:1", "http://h:1/v1", "::1:9"],
)
def test_control_base_url_rejects(address: str) -> None:
    with pytest.raises(ControlAddressError, match="control address"):
        control_base_url(address)


def test_client_errors_share_one_base() -> None:
    for cls in (DaemonUnreachableError, ControlRequestError, ControlAuthError, ControlServerError):
        assert issubclass(cls, ControlClientError)


# ------------------------------------------------------- health routes, nesting depth


def test_ready_and_live_routes_answer_503_when_not_ok_and_need_no_token() -> None:
    service = FakeService()
    app = app_for(service, token=TOKEN)
    replies = run_requests(
        app,
        ("GET", "/v1/health/ready", {}),
        ("GET", "/v1/health/live", {}),
        ("GET", "/v1/status", {}),
    )
    assert [r.status for r in replies] == [200, 200, 401]
    service.ok, service.alive = False, True
    ready, live = run_requests(
        app_for(service, token=TOKEN),
        ("GET", "/v1/health/ready", {}),
        ("GET", "/v1/health/live", {}),
    )
    assert (ready.status, live.status) == (503, 200)  # alive, not ready: leave it running
    service.alive = False
    live = one(app_for(service), "GET", "/v1/health/live")
    assert live.status == 503 and live.body == {"ok": False}


class _DetailedHealth(FakeService):
    """Health answers as the daemon gives them: paths and error texts in the reasons."""

    SECRET_PATH = "/srv/specgov/state/state.db"

    def health(self) -> dict[str, Any]:
        self._call("health")
        return {
            "ok": False,
            "acting": True,
            "store": False,
            "store_error_age_s": 12.0,
            "reasons": [f"store: state database {self.SECRET_PATH} unavailable: disk I/O error"],
            "codes": ["store_unavailable", "Not A Code: /etc/passwd"],
        }

    def liveness(self) -> dict[str, Any]:
        self._call("liveness")
        return {"ok": False, "reasons": ["loop stuck at /srv/x"], "codes": ["decision_loop_stuck"]}


def test_health_beyond_loopback_tells_a_caller_without_the_token_only_the_codes() -> None:
    service = _DetailedHealth()
    app = make_app(service, token=TOKEN, listen_host="0.0.0.0")
    good = {"Authorization": f"Bearer {TOKEN}"}
    bad = {"Authorization": "Bearer wrong-token"}
    ready, live, wrong, ready_auth, live_auth = run_requests(
        app,
        ("GET", "/v1/health", {}),
        ("GET", "/v1/health/live", {}),
        ("GET", "/v1/health/ready", {"headers": bad}),
        ("GET", "/v1/health/ready", {"headers": good}),
        ("GET", "/v1/health/live", {"headers": good}),
    )
    for reply in (ready, wrong):
        assert reply.status == 503
        assert reply.body == {
            "ok": False,
            "acting": True,
            "store": False,
            "reasons": ["store_unavailable"],
            "detail": "send the control token (Authorization: Bearer <token>) for the detail",
        }
        assert "/srv" not in reply.text and "I/O" not in reply.text
    assert live.status == 503 and live.body["reasons"] == ["decision_loop_stuck"]
    assert "/srv" not in live.text
    # With the token: the detail.
    assert ready_auth.status == 503 and service.SECRET_PATH in ready_auth.body["reasons"][0]
    assert ready_auth.body["store_error_age_s"] == 12.0
    assert live_auth.body["reasons"] == ["loop stuck at /srv/x"]


def test_health_on_loopback_gives_the_detail_without_a_token() -> None:
    service = _DetailedHealth()
    for token in (None, TOKEN):
        ready, live = run_requests(
            make_app(service, token=token, listen_host="127.0.0.1"),
            ("GET", "/v1/health", {}),
            ("GET", "/v1/health/live", {}),
        )
        assert ready.status == 503 and service.SECRET_PATH in ready.body["reasons"][0]
        assert live.body["reasons"] == ["loop stuck at /srv/x"]


def test_a_terse_answer_without_codes_still_says_it_is_not_ok() -> None:
    service = FakeService()
    service.ok = False
    reply = one(make_app(service, token=TOKEN, listen_host="::"), "GET", "/v1/health")
    assert reply.status == 503 and reply.body["reasons"] == ["unspecified"]
    service.ok = True
    reply = one(make_app(service, token=TOKEN, listen_host="::"), "GET", "/v1/health")
    assert reply.status == 200 and reply.body["reasons"] == [] and reply.body["ok"] is True


@pytest.mark.parametrize("depth", [9, 100, 8000])
def test_deeply_nested_bodies_are_a_400_naming_the_bound(depth: int) -> None:
    service = FakeService()
    body = '{"reason": ' + "[" * depth + "]" * depth + ', "ttl": "1m", "steps": 1}'
    for method, path in (("POST", "/v1/overrides"), ("PUT", "/v1/policy")):
        reply = one(app_for(service), method, path, data=body)
        assert reply.status == 400, reply.text
        # The body's own object is the first level.
        assert f"nested {depth + 1} levels deep; expected at most 8" in reply.body["error"]
    assert "set_override" not in service.names() and "set_policy" not in service.names()


def test_nesting_at_the_bound_reaches_field_validation() -> None:
    body = '{"reason": ' + "[" * 7 + "]" * 7 + ', "ttl": "1m", "steps": 1}'
    reply = one(app_for(FakeService()), "POST", "/v1/overrides", data=body)
    assert reply.status == 400 and reply.body["error"].startswith("reason: expected")


def test_brackets_inside_strings_do_not_count_as_nesting() -> None:
    service = FakeService()
    reply = one(
        app_for(service),
        "POST",
        "/v1/overrides",
        json=good_override(reason='[[[[[[[[[[{{{{{{{{{{ \\" ]]]'),
    )
    assert reply.status == 201, reply.text


def test_json_depth_is_linear_on_adversarial_strings() -> None:
    from specgov.controller.daemon.control_api import json_depth

    # An unterminated string full of escaped quotes: a naive string regex rescans it
    # from every quote (quadratic: seconds for 16 KB).
    assert json_depth('"' + '\\"' * 8000) == 0
    assert json_depth('[{"a": "]]]", "b": [1, [2]]}]') == 4


class _SameRows(FakeService):
    """Hands back the same list object for two calls, then a new one (as the daemon does
    until its next audit row)."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[dict[str, Any]] = [{"id": 1, "time_s": 1.0, "gain": math.inf}]

    def decisions(self, since_s: float | None, limit: int) -> list[dict[str, Any]]:
        self._call("decisions", since_s=since_s, limit=limit)
        if self.names().count("decisions") == 3:
            self.rows = [{"id": 2, "time_s": 2.0}, {"id": 1, "time_s": 1.0}]
        return self.rows


def test_decisions_answer_is_serialised_once_per_answer_object() -> None:
    first, second, third = run_requests(
        app_for(_SameRows()),
        ("GET", "/v1/decisions", {}),
        ("GET", "/v1/decisions", {}),
        ("GET", "/v1/decisions", {}),
    )
    assert first.body == {
        "count": 1,
        "decisions": [{"id": 1, "time_s": 1.0, "gain": None}],  # inf is unknown: null
        "limit": 100,
        "since_s": None,
    }
    assert second.text == first.text  # served from the cached JSON
    assert [r["id"] for r in third.body["decisions"]] == [2, 1] and third.body["count"] == 2


def test_load_benchmark_runs_tiny() -> None:
    """benchmarks/bench_control_api_load.py end to end at a tiny scale: it measures and
    prints both phases (no timing asserted: this machine's load is not the product's)."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parents[1] / "benchmarks" / "bench_control_api_load.py"
    out = subprocess.run(
        [
            sys.executable,
            str(script),
            "--rate",
            "20",
            "--duration-s",
            "2",
            "--decide-interval-s",
            "0.5",
            "--warmup-s",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    idle = next(line for line in lines if line.startswith("idle "))
    load = next(line for line in lines if line.startswith("load "))
    assert int(idle.split()[1]) == 0 and int(load.split()[1]) == 40  # requests sent
    assert int(load.split()[2]) == 0  # no errors
    assert any(line.startswith("targets: ") for line in lines)
