"""Generation on the simulated server: SGLang's /generate and the OpenAI routes, called
with real clients (the `openai` package, SGLang's request format over httpx), directly
and through the real `smg` gateway; the engine side of live requests with a scripted
source (module specgov.simulator.engine.live)."""

from __future__ import annotations

import asyncio
import json
import math
import socket
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx
import openai
import pytest

from specgov.controller.fleet.gateway import SmgGateway
from specgov.simulator.engine.live import LIVE_INDEX_BASE
from specgov.simulator.engine.requests import RequestState
from specgov.simulator.replay.runner import ServerSpec, parse_policy, prepare_run
from specgov.simulator.server import generate as sg
from specgov.simulator.server.core import SimServer
from specgov.simulator.workload.traces import Request

DEADLINE_S = 60.0
MODEL = "specgov-sim:llama-3.1-8b"


def _wait(predicate: object, what: str, deadline_s: float = DEADLINE_S) -> None:
    assert callable(predicate)
    end = time.monotonic() + deadline_s
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


@pytest.fixture(scope="module")
def sim() -> Iterator[SimServer]:
    """A sim-server with no trace: its engine serves only the requests clients send.
    Speed 4: four simulated seconds per wall second, so requests finish sooner."""
    server = SimServer([], speed=4.0)
    server.start()
    server.wait_ready()
    try:
        yield server
    finally:
        server.stop()


# ------------------------------------------------------------------ parsing (pure)


def test_prompt_tokens_follow_the_stated_rule() -> None:
    text = "x" * 41
    spec = sg.parse_generate({"text": text, "sampling_params": {"max_new_tokens": 7}})
    assert spec.prompt_tokens == math.ceil(41 / sg.CHARS_PER_TOKEN) == 11
    assert spec.max_tokens == 7
    ids = sg.parse_generate({"input_ids": [1, 2, 3]})
    assert (ids.prompt_tokens, ids.max_tokens) == (3, sg.GENERATE_DEFAULT_MAX_NEW_TOKENS)
    chat = sg.parse_chat(
        {"model": "m", "messages": [{"role": "user", "content": "abcd" * 10}], "max_tokens": 5}
    )
    assert chat.prompt_tokens == 10 + sg.CHAT_TOKENS_PER_MESSAGE
    assert sg.parse_completion({"model": "m", "prompt": "hi"}).max_tokens == 16
    chat2 = sg.parse_chat(
        {"model": "m", "messages": [{"role": "user", "content": "a"}], "max_completion_tokens": 9}
    )
    assert chat2.max_tokens == 9


@pytest.mark.parametrize(
    ("parse", "body", "needle"),
    [
        (sg.parse_generate, {}, "Either text, input_ids"),
        (sg.parse_generate, {"text": "a", "input_ids": [1]}, "Either text"),
        (sg.parse_generate, {"input_ids": [1, -2]}, "input_ids[1]"),
        (sg.parse_generate, {"text": "a", "sampling_params": {"max_new_tokens": "9"}}, "max_new"),
        (sg.parse_generate, {"text": ["a", "b"]}, "batch"),
        (sg.parse_generate, [1, 2], "JSON object"),
        (sg.parse_completion, {"prompt": "a"}, "model"),
        (sg.parse_completion, {"model": "m", "prompt": "a", "max_tokens": 0}, "max_tokens"),
        (sg.parse_completion, {"model": "m", "prompt": {"a": 1}}, "prompt"),
        (sg.parse_chat, {"model": "m", "messages": []}, "messages"),
        (sg.parse_chat, {"model": "m", "messages": [{"content": "x"}]}, "messages[0]"),
        (sg.parse_chat, {"model": "m", "messages": [{"role": "u", "content": "x"}], "n": 2}, "n"),
        (
            sg.parse_chat,
            {"model": "m", "messages": [{"role": "u", "content": "x"}], "stream": "yes"},
            "stream",
        ),
    ],
)
def test_bad_requests_name_the_field(parse: object, body: object, needle: str) -> None:
    assert callable(parse)
    with pytest.raises(sg.GenRequestError) as info:
        parse(body)
    assert needle in str(info.value)
    assert info.value.status == 400


def test_a_request_longer_than_the_context_is_refused() -> None:
    spec = sg.parse_generate({"input_ids": [1] * 10, "sampling_params": {"max_new_tokens": 91}})
    with pytest.raises(sg.GenRequestError, match="maximum context length of 100 tokens"):
        sg.check_fits(spec, 100)
    sg.check_fits(sg.parse_generate({"input_ids": [1] * 10}), 10 + 128)


# ------------------------------------------------------------------ the engine side


class _Script:
    """A scripted live source: requests arriving at given simulated times."""

    def __init__(self, arrivals: Sequence[tuple[float, int, int]], cancel_at: float = -1) -> None:
        self.pending = [(t, Request(t, i, o)) for t, i, o in arrivals]
        self.keys = {id(r): k for k, (_, r) in enumerate(self.pending)}
        self.generated: dict[int, list[tuple[float, int]]] = {}
        self.rejected_keys: list[int] = []
        self.cancel_at = cancel_at
        self.cancel_sent = False

    @property
    def hold_open(self) -> bool:
        return bool(self.pending)

    def take(self, now_s: float) -> list[tuple[int, Request]]:
        ready = [(self.keys[id(r)], r) for t, r in self.pending if t <= now_s]
        self.pending = [(t, r) for t, r in self.pending if t > now_s]
        return ready

    def cancelled(self) -> list[int]:
        if self.cancel_at >= 0 and not self.cancel_sent and 0 in self.generated:
            last_t = self.generated[0][-1][0]
            if last_t >= self.cancel_at:
                self.cancel_sent = True
                return [0]
        return []

    def emitted(self, now_s: float, states: Sequence[RequestState]) -> None:
        for s in states:
            if s.index >= LIVE_INDEX_BASE:
                self.generated.setdefault(s.index - LIVE_INDEX_BASE, []).append(
                    (now_s, s.generated)
                )

    def rejected(self, key: int, reason: str) -> None:
        self.rejected_keys.append(key)

    def idle(self, now_s: float, until_s: float) -> float:
        return until_s


def _engine() -> object:
    return prepare_run(ServerSpec(), parse_policy("static:3"), seed=0).engine


def test_engine_serves_live_requests_as_they_arrive() -> None:
    engine = _engine()
    script = _Script([(0.5, 100, 20), (0.5, 50, 30), (2.0, 10, 5)])
    result = engine.run([], live=script, start_s=0.0)  # type: ignore[attr-defined]
    assert result.completed == 3 and result.aborted == 0
    assert result.output_tokens == 20 + 30 + 5
    for key, want in ((0, 20), (1, 30), (2, 5)):
        events = script.generated[key]
        counts = [g for _, g in events]
        assert counts[-1] == want and counts == sorted(counts)
        # One event per forward, none before the request arrived.
        times = [t for t, _ in events]
        assert times == sorted(times) and times[0] > (0.5 if key < 2 else 2.0)
    # The two requests arriving together share the decode batch: their token times meet.
    assert set(t for t, _ in script.generated[0]) & set(t for t, _ in script.generated[1])


def test_engine_frees_a_cancelled_request() -> None:
    engine = _engine()
    script = _Script([(0.0, 100, 10_000), (0.0, 100, 40)], cancel_at=0.05)
    result = engine.run([], live=script, start_s=0.0)  # type: ignore[attr-defined]
    assert result.completed == 1 and result.aborted == 1
    assert script.generated[0][-1][1] < 10_000
    assert result.output_tokens == 40


def test_engine_rejects_a_request_that_can_never_fit() -> None:
    engine = _engine()
    capacity = engine.config.kv_token_capacity  # type: ignore[attr-defined]
    script = _Script([(0.0, capacity + 10, 5), (0.1, 10, 5)])
    result = engine.run([], live=script, start_s=0.0)  # type: ignore[attr-defined]
    assert script.rejected_keys == [0]
    assert result.completed == 1 and result.aborted == 1


# ------------------------------------------------------------------ over HTTP, openai


def test_openai_client_completions_and_chat(sim: SimServer) -> None:
    client = openai.OpenAI(base_url=f"{sim.url}/v1", api_key="unused", max_retries=0)
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    prompt = "The quick brown fox " * 5  # 100 characters: 25 tokens by the rule
    done = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12)
    assert done.usage is not None
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (25, 12)
    assert done.choices[0].finish_reason == "length"
    assert done.choices[0].text == sg.filler_text(0, 12)
    assert done.system_fingerprint == sg.FILLER_NOTE
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello there!"}], max_tokens=9
    )
    assert chat.usage is not None
    assert chat.usage.completion_tokens == 9
    assert chat.usage.prompt_tokens == 3 + sg.CHAT_TOKENS_PER_MESSAGE
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == sg.filler_text(0, 9)


def test_openai_client_streams_one_chunk_per_forward(sim: SimServer) -> None:
    client = openai.OpenAI(base_url=f"{sim.url}/v1", api_key="unused", max_retries=0)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "stream please"}],
        max_tokens=40,
        stream=True,
        stream_options={"include_usage": True},
    )
    texts: list[str] = []
    arrivals: list[float] = []
    usage = None
    finish = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                texts.append(choice.delta.content)
                arrivals.append(time.monotonic())
            finish = choice.finish_reason or finish
    assert "".join(texts) == sg.filler_text(0, 40)
    assert usage is not None and usage.completion_tokens == 40
    assert finish == "length"
    # Speculation (EAGLE-3, up to 3 drafts + 1 per verify): fewer chunks than tokens, but
    # at least one per 4 tokens after the prefill's first.
    assert 1 + math.ceil(39 / 4) <= len(texts) < 40
    assert arrivals == sorted(arrivals)


def test_openai_errors_are_openai_shaped(sim: SimServer) -> None:
    client = openai.OpenAI(base_url=f"{sim.url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="x", max_tokens=10**7)
    assert "maximum context length" in str(info.value)
    body = info.value.body
    assert isinstance(body, dict) and body.get("code") == 400
    big = httpx.post(f"{sim.url}/v1/completions", content=b"x" * (9 * 1024 * 1024), timeout=30)
    assert big.status_code == 413
    assert big.json()["code"] == 413


# ------------------------------------------------------------------ SGLang's format


def test_sglang_generate_with_input_ids_and_stream(sim: SimServer) -> None:
    r = httpx.post(
        f"{sim.url}/generate",
        json={"input_ids": list(range(30)), "sampling_params": {"max_new_tokens": 8}},
        timeout=DEADLINE_S,
    )
    assert r.status_code == 200
    meta = r.json()["meta_info"]
    assert (meta["prompt_tokens"], meta["completion_tokens"]) == (30, 8)
    assert meta["finish_reason"] == {"type": "length", "length": 8}
    assert meta["specgov_sim"] == sg.FILLER_NOTE
    assert meta["e2e_latency"] > 0
    chunks = []
    began = time.monotonic()
    with httpx.stream(
        "POST",
        f"{sim.url}/generate",
        json={"text": "abc", "sampling_params": {"max_new_tokens": 20}, "stream": True},
        timeout=DEADLINE_S,
    ) as s:
        for line in s.iter_lines():
            if line.startswith("data: "):
                chunks.append(line[len("data: ") :])
    assert chunks[-1] == "[DONE]"
    bodies = [json.loads(c) for c in chunks[:-1]]
    counts = [b["meta_info"]["completion_tokens"] for b in bodies]
    assert counts == sorted(counts) and counts[-1] == 20  # cumulative, as SGLang streams
    assert bodies[-1]["text"] == sg.filler_text(0, 20)
    assert bodies[-1]["meta_info"]["finish_reason"]["type"] == "length"
    # Tokens leave at the simulated step times, never earlier: the last one no sooner
    # than the request's simulated latency in wall seconds (a busy machine only adds).
    elapsed_s = time.monotonic() - began
    assert elapsed_s >= 0.95 * bodies[-1]["meta_info"]["e2e_latency"] / sim.speed
    bad = httpx.post(f"{sim.url}/generate", json={"sampling_params": {}}, timeout=DEADLINE_S)
    assert bad.status_code == 400
    want = "Either text, input_ids or input_embeds should be provided."
    assert bad.json() == {"error": {"message": want}}


def test_concurrent_requests_share_the_batch(sim: SimServer) -> None:
    body = {"text": "x" * 40, "sampling_params": {"max_new_tokens": 64}}

    async def one(client: httpx.AsyncClient) -> float:
        r = await client.post(f"{sim.url}/generate", json=body, timeout=DEADLINE_S)
        assert r.status_code == 200
        return float(r.json()["meta_info"]["e2e_latency"])

    async def run(n: int) -> list[float]:
        async with httpx.AsyncClient() as client:
            return list(await asyncio.gather(*(one(client) for _ in range(n))))

    alone = asyncio.run(run(1))[0]
    together = asyncio.run(run(8))
    # Continuous batching: eight at once take about as long as one (a step costs a
    # little more at batch 8), far from eight times as long.
    assert max(together) < 3 * alone


def test_a_disconnecting_client_frees_its_request(sim: SimServer) -> None:
    feed = sim.live_feed()
    assert feed is not None
    loads = f"{sim.url}/v1/loads"

    def running() -> int:
        return int(httpx.get(loads, timeout=10).json()["loads"][0]["num_running_reqs"])

    with httpx.stream(
        "POST",
        f"{sim.url}/generate",
        json={"text": "x", "sampling_params": {"max_new_tokens": 200_000}, "stream": True},
        timeout=DEADLINE_S,
    ) as s:
        lines = s.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        assert feed.open_requests == 1
        _wait(lambda: running() == 1, "the engine to report the request running")
    # The client closed its connection: the request leaves the feed and the engine.
    _wait(lambda: feed.open_requests == 0, "the feed to drop the request")
    _wait(lambda: running() == 0, "the engine to free the request")


def test_cli_serves_without_a_trace(tmp_path: Path) -> None:
    port = _free_port()
    proc = subprocess.Popen(
        [
            *_specgov(),
            "sim-server",
            "--trace",
            "none",
            "--port",
            str(port),
            "--speed",
            "4",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        _wait(lambda: _up(url), "the sim-server CLI to serve")
        r = httpx.post(f"{url}/generate", json={"text": "hi"}, timeout=DEADLINE_S)
        assert r.json()["meta_info"]["completion_tokens"] == sg.GENERATE_DEFAULT_MAX_NEW_TOKENS
    finally:
        proc.terminate()
        proc.wait(30)


# ------------------------------------------------------------------ through smg


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _specgov() -> list[str]:
    import sys

    return [sys.executable, "-m", "specgov.controller.cli.main"]


def _up(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_through_the_smg_gateway(smg_fleet: tuple[SmgGateway, list[SimServer]]) -> None:
    gw, servers = smg_fleet
    client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0)
    for _ in range(4):
        chat = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "via smg"}], max_tokens=6
        )
        assert chat.choices[0].message.content == sg.filler_text(0, 6)
    stream = client.completions.create(model=MODEL, prompt="abcd", max_tokens=10, stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == sg.filler_text(0, 10)
    r = httpx.post(
        f"{gw.url}/generate",
        json={"input_ids": [5] * 12, "sampling_params": {"max_new_tokens": 7}},
        timeout=DEADLINE_S,
    )
    assert r.status_code == 200
    assert r.json()["meta_info"]["completion_tokens"] == 7
    # Round robin: both replicas served some of the six requests.
    finished = [s.state()["requests_finished"] for s in servers]
    assert sum(finished) == 6 and min(finished) >= 1


def _open_long_request(server: SimServer) -> tuple[threading.Thread, dict[str, object]]:
    """A completion far longer than any test, sent on a thread and awaited until the
    engine holds it open; ``result["status"]`` is its HTTP status once it ends."""
    result: dict[str, object] = {}

    def call() -> None:
        r = httpx.post(
            f"{server.url}/v1/completions",
            json={"model": MODEL, "prompt": "x", "max_tokens": 100_000},
            timeout=DEADLINE_S,
        )
        result["status"] = r.status_code

    t = threading.Thread(target=call)
    t.start()
    feed = server.live_feed()
    assert feed is not None
    _wait(lambda: feed.open_requests == 1, "the request to be open")
    return t, result


def test_stop_ends_open_requests_with_an_error() -> None:
    server = SimServer([], speed=1.0)
    server.start()
    server.wait_ready()
    t, result = _open_long_request(server)
    server.restart(wait=True)
    t.join(DEADLINE_S)
    assert result["status"] == 503
    server.stop()


def test_a_restart_in_the_other_mode_drops_open_requests_and_serves_in_that_mode() -> None:
    """A fleet's restart in place (``restart(speculative=...)``, the route's ``mode``): the
    open request ends with an error as in a process restart, the port refuses connections
    for ``down_s``, and the server comes back plain, then speculative again."""
    server = SimServer([], speed=1.0)
    server.start()
    server.wait_ready()
    try:
        assert server.speculative_algorithm is not None
        t, result = _open_long_request(server)
        r = httpx.post(
            f"{server.url}/specgov-sim/restart",
            json={"mode": "plain", "down_s": 0.5},
            timeout=DEADLINE_S,
        )
        assert r.status_code == 202
        t.join(DEADLINE_S)
        assert result["status"] == 503
        server.wait_ready(DEADLINE_S)
        info = httpx.get(f"{server.url}/server_info", timeout=DEADLINE_S).json()
        assert info["speculative_algorithm"] is None and server.policy_name == "none"
        assert server.generation == 1
        server.restart(speculative=True, wait=True)
        server.wait_ready(DEADLINE_S)
        info = httpx.get(f"{server.url}/server_info", timeout=DEADLINE_S).json()
        assert info["speculative_algorithm"] == server.speculative_algorithm is not None
        bad = httpx.post(f"{server.url}/specgov-sim/restart", json={"mode": "fast"}, timeout=10)
        assert bad.status_code == 400 and "mode: expected spec or plain" in bad.json()["error"]
    finally:
        server.stop()
