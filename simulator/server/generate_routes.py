"""The simulated server's generation routes (aiohttp handlers).

SGLang 0.5.23's native ``/generate`` and the OpenAI-compatible ``/v1/completions``,
``/v1/chat/completions`` and ``/v1/models``. Requests and answers are parsed and built by
:mod:`~specgov.simulator.server.generate` (its docstring states the token-count rule and
that the text is filler); each request enters the running engine through the server's
:class:`~specgov.simulator.server.live.LiveFeed` and its tokens are sent when the wall clock
reaches the simulated time of the forward that produced them, whole at the end or
streamed (server-sent events, one chunk per forward the request takes part in: one token
per prefill or plain decode step, the accepted drafts plus one per verify).

Errors have SGLang's statuses and bodies: 400 for a bad body (``/generate``:
``{"error": {"message": ...}}``; OpenAI routes: ``ErrorResponse``), 413 past
:data:`GENERATE_MAX_BODY_BYTES`, 503 while no engine runs or too many requests are open.
A client that disconnects has its request cancelled in the engine (noticed within
:data:`DISCONNECT_POLL_S` while it waits, at once when a write fails).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from typing import Any, Final, Protocol

from aiohttp import web

from specgov.simulator.server import endpoints as ep
from specgov.simulator.server import generate as sg
from specgov.simulator.server.live import LiveFeed, LiveFeedClosed, LiveFeedFull, LiveRequest
from specgov.simulator.server.served_metrics import ServedMetrics

logger = logging.getLogger(__name__)

# A prompt of SGLang's longest contexts as text or token ids stays far below this.
GENERATE_MAX_BODY_BYTES: Final = 8 * 1024 * 1024
DISCONNECT_POLL_S: Final = 0.25
GENERATION_PATHS: Final = ("/generate", "/v1/completions", "/v1/chat/completions")


class Generating(Protocol):
    """What the generation routes read (a :class:`~specgov.simulator.server.core.SimServer`)."""

    def serving(self) -> tuple[ServedMetrics, ep.LaunchInfo] | None: ...

    def live_feed(self) -> LiveFeed | None:
        """The running engine's feed; None while none is up."""
        ...


def add_generate_routes(router: web.UrlDispatcher, served: Generating) -> None:
    routes = _GenerateRoutes(served)
    router.add_route("POST", "/generate", routes.generate)
    router.add_route("PUT", "/generate", routes.generate)
    router.add_post("/v1/completions", routes.completions)
    router.add_post("/v1/chat/completions", routes.chat)
    router.add_get("/v1/models", routes.models)


def _error(spec_endpoint: str, message: str, status: int, param: str | None = None) -> web.Response:
    if spec_endpoint == "generate":
        body = sg.generate_error_body(message)
    else:
        body = sg.openai_error_body(message, status, param)
    return web.json_response(body, status=status)


def _client_gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


async def _read_body(request: web.Request, limit: int) -> bytes | None:
    """The body, or None past ``limit`` bytes (the application's own limit is for the
    small control bodies; a prompt may be larger)."""
    length = request.content_length
    if length is not None and length > limit:
        return None
    data = bytearray()
    async for chunk in request.content.iter_chunked(64 * 1024):
        data += chunk
        if len(data) > limit:
            return None
    return bytes(data)


def _sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


class _GenerateRoutes:
    def __init__(self, served: Generating) -> None:
        self._served = served

    async def generate(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, "generate", sg.parse_generate)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, "completion", sg.parse_completion)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, "chat", sg.parse_chat)

    async def models(self, request: web.Request) -> web.Response:
        serving = self._served.serving()
        if serving is None:
            return web.Response(status=503)
        launch = serving[1]
        body = sg.models_body(
            [launch.model_path],
            created_s=int(time.time()),
            max_model_len=launch.kv_capacity_tokens,
        )
        return web.json_response(body)

    async def _handle(
        self, request: web.Request, endpoint: str, parse: Callable[[object], sg.GenSpec]
    ) -> web.StreamResponse:
        raw = await _read_body(request, GENERATE_MAX_BODY_BYTES)
        if raw is None:
            message = f"request body larger than {GENERATE_MAX_BODY_BYTES} bytes"
            return _error(endpoint, message, 413)
        try:
            body = json.loads(raw)
        except ValueError as exc:
            return _error(endpoint, f"body: expected JSON ({exc})", 400)
        serving = self._served.serving()
        feed = self._served.live_feed()
        if serving is None or feed is None:
            return _error(endpoint, "the simulated server is not serving", 503)
        try:
            spec = parse(body)
            sg.check_fits(spec, serving[1].kv_capacity_tokens)
        except sg.GenRequestError as exc:
            return _error(endpoint, str(exc), exc.status, exc.param)
        try:
            req = feed.submit(spec.prompt_tokens, spec.max_tokens, stream=spec.stream)
        except (LiveFeedClosed, LiveFeedFull) as exc:
            return _error(endpoint, f"the simulated server cannot take it: {exc}", 503)
        answer = _Answer(request, spec, req, feed)
        try:
            if spec.stream:
                return await answer.stream()
            return await answer.whole()
        finally:
            if answer.complete:
                feed.done(req)
            else:
                feed.cancel(req)


class _Answer:
    """One request being answered."""

    def __init__(
        self, request: web.Request, spec: sg.GenSpec, req: LiveRequest, feed: LiveFeed
    ) -> None:
        self.request = request
        self.spec = spec
        self.req = req
        self.feed = feed
        self.complete = False
        prefix = {"generate": "", "completion": "cmpl-", "chat": "chatcmpl-"}[spec.endpoint]
        self.outcome = sg.Outcome(
            request_id=spec.rid or f"{prefix}specgov-sim-{feed.label}-{req.key}",
            created_s=int(time.time()),
            prompt_tokens=spec.prompt_tokens,
            completion_tokens=0,
            cached_tokens=0,
            e2e_latency_s=0.0,
        )

    async def _next(self) -> sg.Outcome | str | None:
        """The next batch of tokens at its wall time (the outcome so far), an error
        message, or None when the client went away."""
        while True:
            try:
                event = await asyncio.wait_for(self.req.events.get(), DISCONNECT_POLL_S)
            except TimeoutError:
                if _client_gone(self.request):
                    return None
                continue
            if event.error is not None:
                return event.error
            delay = self.feed.wall_of(event.sim_s) - time.time()
            if delay > 0:
                await asyncio.sleep(delay)
            self.outcome = sg.Outcome(
                request_id=self.outcome.request_id,
                created_s=self.outcome.created_s,
                prompt_tokens=self.outcome.prompt_tokens,
                completion_tokens=event.generated,
                cached_tokens=event.cached_tokens,
                e2e_latency_s=event.sim_s - self.req.arrival_s,
                first_token_latency_s=(
                    None
                    if event.first_token_s is None
                    else event.first_token_s - self.req.arrival_s
                ),
            )
            if event.finished:
                self.complete = True
            return self.outcome

    async def whole(self) -> web.StreamResponse:
        while not self.complete:
            got = await self._next()
            if got is None:
                return web.Response(status=499)  # nobody reads it
            if isinstance(got, str):
                return _error(self.spec.endpoint, got, 503)
        out = self.outcome
        if self.spec.endpoint == "generate":
            return web.json_response(sg.generate_body(out))
        return web.json_response(sg.openai_body(self.spec, out))

    async def stream(self) -> web.StreamResponse:
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await resp.prepare(self.request)
        spec = self.spec
        try:
            if spec.endpoint == "chat":
                first = sg.openai_chunk(
                    spec, self.outcome, start=0, count=0, finished=False, role=True
                )
                await resp.write(_sse(first))
            sent = 0
            while not self.complete:
                got = await self._next()
                if got is None:
                    return resp
                if isinstance(got, str):
                    await resp.write(_sse({"error": sg.openai_error_body(got, 503)}))
                    break
                n = got.completion_tokens
                if spec.endpoint == "generate":
                    chunk = sg.generate_body(got, finished=self.complete)
                else:
                    chunk = sg.openai_chunk(
                        spec, got, start=sent, count=n - sent, finished=self.complete
                    )
                sent = n
                await resp.write(_sse(chunk))
            if self.complete and spec.include_usage:
                await resp.write(_sse(sg.openai_usage_chunk(spec, self.outcome)))
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except ConnectionError as exc:  # the client left: the caller cancels the request
            logger.debug("specgov sim-server: client left a stream: %s", exc)
        return resp
