"""The simulated server's fault controls over HTTP: ``/specgov-sim/...`` routes.

An end-to-end test in another process drives a sim-server with these (the in-process
API is :meth:`SimServer.restart <specgov.simulator.server.core.SimServer.restart>`,
``pause`` and ``resume``):

* ``GET /specgov-sim/state``: what the server is doing (``SimServer.state()``).
* ``POST /specgov-sim/restart`` ``{"down_s": S, "starting_s": S, "mode": "spec"|"plain"}``
  (each optional): a server restart, in ``mode`` when given (a fleet's restart in the
  other mode, performed in place: ``specgov fleet sim-restart --in-place``); 202
  ``{"restarting": true, "previous_generation": N}``.
* ``POST /specgov-sim/outage`` ``{"seconds": S, "mode": "refuse"|"503"}``: an outage of
  the HTTP front; 202 ``{"outage": MODE}``.

A malformed body is a 400 ``{"error": ...}`` naming the key. These routes answer during
a ``503`` outage (only the SGLang routes are down); with an API key they need it, like
SGLang's own routes.
"""

from __future__ import annotations

from typing import Any, Final, Literal, Protocol

from aiohttp import web

from specgov.policies.common.errors import SpecgovError
from specgov.policies.common.validation import is_real

ADMIN_PREFIX: Final = "/specgov-sim"

OutageMode = Literal["refuse", "503"]
OUTAGE_MODES: Final = ("refuse", "503")
RESTART_MODES: Final = ("spec", "plain")


class SimServerError(SpecgovError, ValueError):
    """A sim-server setting or control request is invalid; the message names it."""


def check_seconds(name: str, value: object) -> float:
    """``value`` as seconds; :class:`SimServerError` unless a finite number >= 0."""
    if not is_real(value) or value < 0:
        raise SimServerError(f"{name}: expected a finite number of seconds >= 0, got {value!r}")
    return float(value)


def check_outage_mode(value: object) -> OutageMode:
    if value == "refuse":
        return "refuse"
    if value == "503":
        return "503"
    raise SimServerError(f"mode: expected one of {', '.join(OUTAGE_MODES)}, got {value!r}")


class Controlled(Protocol):
    """What the control routes drive (a :class:`~specgov.simulator.server.core.SimServer`)."""

    @property
    def generation(self) -> int: ...

    def state(self) -> dict[str, Any]: ...

    # Both raise SimServerError for a request they refuse.
    def restart(
        self,
        *,
        down_s: float = ...,
        starting_s: float = ...,
        wait: bool = ...,
        speculative: bool | None = ...,
    ) -> None: ...

    def pause(self, seconds: float, *, mode: OutageMode = ...) -> None: ...


def is_admin_path(path: str) -> bool:
    return path.startswith(ADMIN_PREFIX + "/")


def add_admin_routes(router: web.UrlDispatcher, server: Controlled) -> None:
    """Register ``/specgov-sim/{state,restart,outage}`` for ``server``."""

    async def state(request: web.Request) -> web.Response:
        return web.json_response(server.state())

    async def restart(request: web.Request) -> web.Response:
        previous = server.generation
        try:
            body = await _json_object(request)
            unknown = set(body) - {"down_s", "starting_s", "mode"}
            if unknown:
                raise SimServerError(
                    f"body: unknown keys {sorted(unknown)} (expected down_s, starting_s, mode)"
                )
            mode = body.get("mode")
            if mode not in (None, *RESTART_MODES):
                raise SimServerError(f"mode: expected spec or plain, got {mode!r}")
            server.restart(
                down_s=body.get("down_s", 0.0),
                starting_s=body.get("starting_s", 0.0),
                wait=False,
                speculative=None if mode is None else mode == "spec",
            )
        except SimServerError as exc:
            return web.json_response({"error": str(exc)}, status=400)
        return web.json_response({"restarting": True, "previous_generation": previous}, status=202)

    async def outage(request: web.Request) -> web.Response:
        try:
            body = await _json_object(request)
            unknown = set(body) - {"seconds", "mode"}
            if unknown or "seconds" not in body:
                raise SimServerError(
                    'body: expected {"seconds": S, "mode": "refuse"|"503"}, got ' + repr(body)
                )
            mode = check_outage_mode(body.get("mode", "refuse"))
            server.pause(body["seconds"], mode=mode)
        except SimServerError as exc:
            return web.json_response({"error": str(exc)}, status=400)
        return web.json_response({"outage": mode}, status=202)

    router.add_get(f"{ADMIN_PREFIX}/state", state)
    router.add_post(f"{ADMIN_PREFIX}/restart", restart)
    router.add_post(f"{ADMIN_PREFIX}/outage", outage)


async def _json_object(request: web.Request) -> dict[str, Any]:
    if not request.can_read_body:
        return {}
    try:
        body = await request.json()
    except ValueError as exc:
        raise SimServerError(f"body: expected a JSON object ({exc})") from None
    if not isinstance(body, dict):
        raise SimServerError(f"body: expected a JSON object, got {body!r}")
    return body
