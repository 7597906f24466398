"""The fleet governor's gateway client (controller/fleet/gateway.py): its error typing
against a mock gateway, and the drain it relies on against the real smg 1.13 binary with
two sim-servers: a drained replica gets no new request, the requests it serves finish
(none lost), it leaves the gateway, and it can be put back."""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from specgov.controller.fleet.gateway import GatewayError, SmgGateway, gateway_token
from specgov.simulator.server.core import SimServer

DEADLINE_S = 60.0


def _mock(handler: object) -> SmgGateway:
    assert callable(handler)
    return SmgGateway(
        "http://gw.test", transport=httpx.MockTransport(handler), sleep=lambda _s: None, poll_s=0
    )


def test_workers_are_parsed_and_bad_answers_typed() -> None:
    body = {"workers": [{"id": "a", "url": "http://r0/", "is_healthy": True, "status": "ready"}]}
    gw = _mock(lambda req: httpx.Response(200, json=body))
    [w] = gw.workers()
    assert (w.id, w.url, w.healthy, w.status) == ("a", "http://r0", True, "ready")
    with pytest.raises(GatewayError) as down:
        _mock(lambda req: httpx.Response(503)).workers()
    assert down.value.temporary
    with pytest.raises(GatewayError) as shape:
        _mock(lambda req: httpx.Response(200, json={"nope": 1})).workers()
    assert not shape.value.temporary and "'workers' list" in str(shape.value)

    def refuse(req: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=req)

    with pytest.raises(GatewayError) as refused:
        _mock(refuse).workers()
    assert refused.value.temporary
    with pytest.raises(GatewayError, match="no worker at http://r9"):
        gw.drain("http://r9")


def test_a_wait_is_bounded_and_says_what_it_waited_for() -> None:
    body = {"workers": [{"id": "a", "url": "http://r0", "is_healthy": False, "status": "ready"}]}
    gw = _mock(lambda req: httpx.Response(200, json=body))
    with pytest.raises(GatewayError, match=r"http://r0 to be healthy .* not done after 0\.05 s"):
        gw.wait_healthy("http://r0", timeout_s=0.05)
    conflict = _mock(lambda req: httpx.Response(409, json={"code": "WORKER_ALREADY_EXISTS"}))
    with pytest.raises(GatewayError, match="still registered") as info:
        conflict.add("http://r0")
    assert info.value.temporary


# ------------------------------------------------------------------ the real smg


def test_a_gateway_with_control_plane_keys_needs_the_governors_token(
    smg_binary: Path, free_port: Callable[[], int]
) -> None:
    """smg --control-plane-api-keys guards /workers; the governor sends the key from
    SPECGOV_FLEET_GATEWAY_TOKEN as a bearer token."""
    port = free_port()
    argv = [str(smg_binary), "launch", "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--worker-urls", "http://127.0.0.1:1", "--prometheus-host", "127.0.0.1"]
    argv += ["--prometheus-port", str(free_port())]
    argv += ["--control-plane-api-keys", "k1:governor:admin:s3cret"]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        keyed = SmgGateway(url, token=gateway_token({"SPECGOV_FLEET_GATEWAY_TOKEN": "s3cret"}))
        deadline = time.monotonic() + DEADLINE_S
        while True:  # until the gateway listens
            try:
                keyed.workers()
                break
            except GatewayError:
                assert time.monotonic() < deadline, "smg did not answer"
                time.sleep(0.1)
        assert (
            gateway_token({}) is None
            and gateway_token({"SPECGOV_FLEET_GATEWAY_TOKEN": " "}) is None
        )
        with pytest.raises(GatewayError, match="answered 401") as refused:
            SmgGateway(url, token=gateway_token({})).workers()
        assert not refused.value.temporary
        keyed.close()
    finally:
        proc.kill()
        proc.wait(30)


def test_a_drain_loses_no_request_and_the_replica_comes_back(
    smg_fleet: tuple[SmgGateway, list[SimServer]],
) -> None:
    gw, (a, b) = smg_fleet
    results: list[tuple[int, int]] = []
    lock = threading.Lock()

    def long_request() -> None:
        r = httpx.post(
            f"{gw.url}/generate",
            json={"text": "x", "sampling_params": {"max_new_tokens": 300}},
            timeout=DEADLINE_S,
        )
        tokens = r.json()["meta_info"]["completion_tokens"] if r.status_code == 200 else -1
        with lock:
            results.append((r.status_code, tokens))

    threads = [threading.Thread(target=long_request) for _ in range(4)]
    for t in threads:
        t.start()
    feed_a = a.live_feed()
    assert feed_a is not None
    deadline = time.monotonic() + DEADLINE_S
    while feed_a.open_requests == 0:  # round robin: two of the four reach a
        assert time.monotonic() < deadline, "no request reached replica a"
        time.sleep(0.01)
    gw.drain(a.url)
    w = gw.find(a.url)
    assert w is None or w.status == "draining"
    finished_a = a.state()["requests_finished"]
    finished_b = b.state()["requests_finished"]
    for _ in range(4):  # new requests go to b only
        r = httpx.post(
            f"{gw.url}/generate",
            json={"text": "y", "sampling_params": {"max_new_tokens": 3}},
            timeout=DEADLINE_S,
        )
        assert r.status_code == 200
    assert b.state()["requests_finished"] - finished_b >= 4
    for t in threads:
        t.join(DEADLINE_S)
    assert sorted(results) == [(200, 300)] * 4  # the drained replica finished its own
    gw.wait_drained(a.url, DEADLINE_S)
    assert gw.find(a.url) is None
    assert a.state()["requests_finished"] - finished_a <= 2  # only its in-flight ones
    gw.add(a.url)
    gw.wait_healthy(a.url, DEADLINE_S)
    before = a.state()["requests_finished"]
    for _ in range(4):
        httpx.post(f"{gw.url}/generate", json={"text": "z"}, timeout=DEADLINE_S)
    assert a.state()["requests_finished"] > before  # routed to again
