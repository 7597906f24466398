"""The simulated server's SGLang routes (aiohttp handlers) and its application.

SGLang 0.5.23's endpoints, with the bodies of :mod:`specgov.simulator.server.endpoints`:
``/health`` and ``/health_generate``, ``/ready``, ``/metrics``, ``/server_info`` and
``/get_server_info``, ``/model_info`` and ``/get_model_info``, ``/v1/loads``, and
``/set_internal_state`` (POST or PUT), and generation (``/generate``, ``/v1/completions``,
``/v1/chat/completions``, ``/v1/models``: :mod:`~specgov.simulator.server.generate_routes`),
whose requests join the trace's in the running engine. A middleware answers 503 on
every SGLang route during a ``503`` outage (the fault controls of
:mod:`specgov.simulator.server.controls` still answer) and applies SGLang's ``--api-key``
rules to every route.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Final, Protocol

from aiohttp import web
from aiohttp.typedefs import Handler

from specgov.simulator.server import endpoints as ep
from specgov.simulator.server.controls import (
    Controlled,
    OutageMode,
    add_admin_routes,
    is_admin_path,
)
from specgov.simulator.server.generate_routes import add_generate_routes
from specgov.simulator.server.live import LiveFeed
from specgov.simulator.server.served_metrics import ServedMetrics

logger = logging.getLogger(__name__)

MAX_BODY_BYTES: Final = 64 * 1024


class Served(Protocol):
    """What the SGLang routes read (a :class:`~specgov.simulator.server.core.SimServer`)."""

    @property
    def healthy(self) -> bool: ...

    @property
    def speed(self) -> float:
        """Simulated seconds per wall second (``/server_info``'s ``specgov_sim_speed``)."""
        ...

    def serving(self) -> tuple[ServedMetrics, ep.LaunchInfo] | None:
        """The running engine's metrics and launch; None while none is up."""
        ...

    def live_feed(self) -> LiveFeed | None:
        """The running engine's feed of client requests; None while none is up."""
        ...


def make_app(
    served: Served,
    *,
    api_key: str | None,
    outage_mode: Callable[[], OutageMode | None],
    controls: Controlled | None,
) -> web.Application:
    """The application: SGLang's routes for ``served``, plus the fault controls for
    ``controls`` (None: no ``/specgov-sim/`` routes)."""

    @web.middleware
    async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
        admin = is_admin_path(request.path)
        if outage_mode() == "503" and not admin:
            return web.Response(status=503)
        if not ep.auth_allowed(
            method=request.method,
            path=request.path,
            authorization=request.headers.get("Authorization"),
            api_key=api_key,
        ):
            return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    app = web.Application(middlewares=[guard], client_max_size=MAX_BODY_BYTES)
    routes = _SglangRoutes(served)
    r = app.router
    for path in ("/health", "/health_generate"):
        r.add_get(path, routes.health)
    r.add_get("/ready", routes.ready)
    r.add_get("/metrics", routes.metrics)
    r.add_get("/server_info", routes.server_info)
    r.add_get("/get_server_info", routes.server_info)
    r.add_get("/model_info", routes.model_info)
    r.add_get("/get_model_info", routes.model_info)
    r.add_get("/v1/loads", routes.loads)
    r.add_route("POST", "/set_internal_state", routes.set_internal_state)
    r.add_route("PUT", "/set_internal_state", routes.set_internal_state)
    add_generate_routes(r, served)
    if controls is not None:
        add_admin_routes(r, controls)
    return app


class _SglangRoutes:
    def __init__(self, served: Served) -> None:
        self._served = served

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self._served.healthy else 503)

    async def ready(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self._served.healthy else 503)

    async def metrics(self, request: web.Request) -> web.Response:
        serving = self._served.serving()
        if serving is None:
            return web.Response(status=503)
        body = serving[0].render()
        return web.Response(body=body, headers={"Content-Type": ep.PROMETHEUS_CONTENT_TYPE})

    async def server_info(self, request: web.Request) -> web.Response:
        serving = self._served.serving()
        if serving is None:
            return web.Response(status=503)
        metrics, launch = serving
        body = ep.server_info_body(launch, metrics.snapshot(), sim_speed=self._served.speed)
        return web.json_response(body)

    async def model_info(self, request: web.Request) -> web.Response:
        serving = self._served.serving()
        if serving is None:
            return web.Response(status=503)
        return web.json_response(ep.model_info_body(serving[1]))

    async def loads(self, request: web.Request) -> web.Response:
        serving = self._served.serving()
        if serving is None:
            return web.Response(status=503)
        metrics, launch = serving
        query = request.query
        dp_rank: int | None = None
        raw_rank = query.get("dp_rank")
        if raw_rank is not None:
            try:
                dp_rank = int(raw_rank)
            except ValueError:
                message = f"query.dp_rank: Input should be a valid integer, got {raw_rank!r}"
                return web.json_response(ep.error_response(message), status=400)
        include = query.get("include")
        live = metrics.snapshot()
        try:
            if query.get("format") == "prometheus":
                text = ep.loads_prometheus_text(launch, live, include=include, dp_rank=dp_rank)
                return web.Response(
                    body=text.encode(), headers={"Content-Type": ep.PROMETHEUS_CONTENT_TYPE}
                )
            body = ep.loads_body(launch, live, include=include, dp_rank=dp_rank, now_s=time.time())
        except ep.InvalidIncludeError as exc:
            # SGLang raises this outside the endpoint's try: an unhandled 500.
            logger.warning("specgov sim-server: /v1/loads: %s", exc)
            return web.Response(status=500, text="Internal Server Error")
        return web.json_response(body)

    async def set_internal_state(self, request: web.Request) -> web.Response:
        serving = self._served.serving()
        if serving is None:
            return web.Response(status=503)
        metrics, launch = serving
        try:
            raw = await request.json()
        except ValueError as exc:
            message = f"body: expected JSON {{'server_args': {{key: number}}}} ({exc})"
            return web.json_response(ep.error_response(message), status=400)
        try:
            requested = ep.parse_set_internal_state(raw)
        except ep.RequestBodyError as exc:
            return web.json_response(ep.error_response(str(exc)), status=400)
        outcome = ep.decide_set_internal_state(requested, launch)
        if outcome.updated:
            metrics.apply_overrides(outcome.overrides, reset_spec=outcome.reset_spec_stats)
            logger.info("specgov sim-server: config updated: %s", dict(outcome.overrides))
        else:
            logger.warning("specgov sim-server: %s", outcome.rejection)
        return web.json_response([outcome.updated])
