"""The daemon's control API: an aiohttp application over a :class:`ControlService`.

Routes (all JSON; every error is ``{"error": "<message>"}``):

========  ==================  ==============================================================
GET       /v1/health          readiness: ``service.health()``; 200, or 503 when its ``"ok"``
                              is false (``"reasons"`` says why: telemetry older than its
                              bound, spool not writable, store down, a permanent error)
GET       /v1/health/ready    the same (a Kubernetes readiness probe)
GET       /v1/health/live     liveness: ``service.liveness()``; 200, or 503 when the
                              decision loop is stuck (restart the daemon then). The three
                              health routes never need the token; beyond loopback their
                              answer to a caller without it is terse (see Security).
GET       /v1/status          ``service.status()``
GET       /v1/decisions       query ``since`` (unix seconds, >= 0) and ``limit`` (1..1000,
                              default 100) -> ``{"decisions": [...], "count": n,
                              "since_s": since|null, "limit": limit}``
GET       /v1/overrides       ``{"overrides": [...]}`` (the overrides in force)
POST      /v1/overrides       body ``{"slot"?: int >= 1, "steps"?: int >= 0, "disable"?: bool,
                              "pin_policy"?: str, "ttl": "30m" | seconds, "reason": str}``
                              with exactly one action (steps, disable: true or pin_policy);
                              slot only with steps -> 201 ``{"override": {...}}``
DELETE    /v1/overrides       query exactly one of ``id=ov-3``, ``slot=N`` or ``all=true``
                              -> ``{"cleared": n}``; 404 when an id or slot matched nothing
GET       /v1/policy          ``{"policy": <service.policies()["current"]>}``
PUT       /v1/policy          body ``{"spec": "goodput"}`` -> ``service.set_policy(spec)``
GET       /v1/policies        ``service.policies()`` (known kinds and the current policy)
GET       /v1/recommend       ``service.recommend()``
========  ==================  ==============================================================

Status codes: 400 for a malformed request (the message names the field or parameter and
the expected form; JSON nested deeper than :data:`MAX_JSON_DEPTH` is one) and for a
``ValueError`` raised by the service (its message is the answer); 401 for a missing or
wrong token; 404/405 for unknown routes or methods; 413 for a body over
``max_body_bytes`` (16 KiB by default); 500 ("internal error") for anything else, with the
traceback in the daemon's log and never in the answer.

Security: the API listens on loopback by default. When ``listen_host`` is not loopback
(127.0.0.0/8, ::1, localhost) a token is required and :func:`make_app` refuses to build
the app without one. With a token every route except the three health routes needs
``Authorization: Bearer <token>``; on loopback with ``open_reads_on_loopback`` (what the
daemon sets) only the mutating routes do (controller/daemon/control_token.py says where the
daemon's token comes from). Both sides are hashed and compared with
:func:`hmac.compare_digest`, so the comparison time depends on neither the token's
content nor its length. Authentication happens before the body is read.

The health routes stay open for probes (a kubelet has no token), but their full answer
names files and quotes error texts (a spool path, the database path, an upstream
error). So when the API listens beyond loopback, a health request without the valid
token gets only the verdict: ``ok``, the boolean checks and ``"reasons"`` holding just
the fixed reason codes (``"store_unavailable"``, ``"telemetry_stale"``: the service's
``"codes"``), no path and no error text; the status code is the same. With the token,
or when listening on loopback (every caller is then on this host), the answer is the
service's in full. The decision is made on the listen address, not on the caller's
address: a local reverse proxy would make every remote caller look like loopback.

Answers are serialised with sorted keys, and non-finite floats become ``null``
(specgov's "unknown"), so they stay valid JSON for ``jq`` and other strict parsers.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import logging
import math
import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Final, Protocol, runtime_checkable

from aiohttp import web

from specgov.policies.common.errors import SpecgovError
from specgov.policies.common.validation import check_bool, is_int

logger = logging.getLogger(__name__)

API_PREFIX: Final = "/v1"
HEALTH_PATH: Final = f"{API_PREFIX}/health"
HEALTH_PATHS: Final = frozenset({HEALTH_PATH, f"{HEALTH_PATH}/ready", f"{HEALTH_PATH}/live"})
DEFAULT_MAX_BODY_BYTES: Final = 16384
# Request bodies are flat objects; anything nested deeper is refused before parsing
# (json.loads recurses once per level: 8,000 levels would be a RecursionError).
MAX_JSON_DEPTH: Final = 8
MAX_TTL_S: Final = 7 * 24 * 3600.0
DEFAULT_DECISIONS_LIMIT: Final = 100
MAX_DECISIONS_LIMIT: Final = 1000
# Sanity bounds for operator input; the service applies the real limits (candidate
# steps, budget, guardrails) and answers ValueError -> 400 beyond them.
MAX_STEPS: Final = 1024
MAX_SLOT: Final = 1 << 20
MAX_TEXT_CHARS: Final = 500
MAX_SPEC_CHARS: Final = 200
TTL_FORM: Final = 'a duration such as "30s", "5m", "1h", "1d", "250ms" or a number of seconds'

_OVERRIDE_KEYS: Final = ("slot", "steps", "disable", "pin_policy", "ttl", "reason")
_POLICY_KEYS: Final = ("spec",)
_ID_RE: Final = re.compile(r"^[\x21-\x7e]{1,100}$")
_TOKEN_RE: Final = re.compile(r"^[\x21-\x7e]+$")  # visible ASCII: sendable in a header
# One pass: a string (its closing quote optional, so an unterminated one is consumed
# once, not rescanned from every later quote) or a bracket.
_JSON_TOKEN_RE: Final = re.compile(r'"(?:[^"\\]|\\.)*"?|[\[\]{}]', re.DOTALL)


class ControlApiConfigError(SpecgovError, ValueError):
    """make_app was given an unsafe or invalid configuration; the message says which."""


class RequestError(SpecgovError, ValueError):
    """A request the API refuses with 400; the message names the field and expected form."""


@runtime_checkable
class ControlService(Protocol):
    """What the control API needs from the daemon (implemented by ``Daemon``).

    Methods are called on the event loop thread, one at a time per request, with
    arguments already validated for type and range; a ``ValueError`` they raise
    becomes a 400 whose message is the exception's text. Returned mappings and
    sequences must be JSON-serialisable (str keys, str/int/float/bool/None leaves).
    """

    def status(self) -> Mapping[str, Any]: ...

    def decisions(self, since_s: float | None, limit: int) -> Sequence[Mapping[str, Any]]:
        """Newest first. May return the very same object again while the answer is
        unchanged (it is then served from its cached JSON), so never mutate one after
        returning it."""
        ...

    def list_overrides(self) -> Sequence[Mapping[str, Any]]: ...

    def set_override(
        self,
        slot: int | None,
        steps: int | None,
        disable: bool,
        pin_policy: str | None,
        ttl_s: float,
        reason: str,
    ) -> Mapping[str, Any]: ...

    def clear_override(self, override_id: str | None, slot: int | None) -> int:
        """Clear by id, by slot, or every override when both are None; return the count."""
        ...

    def set_policy(self, spec: str) -> Mapping[str, Any]: ...

    def policies(self) -> Mapping[str, Any]:
        """Known policy kinds and the current policy, under the key ``"current"``."""
        ...

    def health(self) -> Mapping[str, Any]:
        """Readiness, ``{"ok": bool, "codes": [...], ...}``; ok false answers 503.
        ``codes``: the fixed reason codes, all a caller without the token is told
        beyond loopback (:func:`terse_health`)."""
        ...

    def liveness(self) -> Mapping[str, Any]:
        """Liveness, ``{"ok": bool, "codes": [...], ...}``; ok false answers 503."""
        ...

    def recommend(self) -> Mapping[str, Any]: ...


# ---------------------------------------------------------------- host and token


def is_loopback_host(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 (bracketed or not) and ``localhost``.

    Anything else, including the wildcard addresses ("", "0.0.0.0", "::") and other
    host names, counts as beyond loopback.
    """
    name = host.strip()
    if name.startswith("[") and name.endswith("]"):
        name = name[1:-1]
    if name.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def _check_token(token: str | None, listen_host: str) -> bytes | None:
    if token is None:
        if not is_loopback_host(listen_host):
            raise ControlApiConfigError(
                f"control API: listening on {listen_host!r} (beyond loopback) requires a "
                "token; set the environment variable named by control.token_env, or "
                "listen on 127.0.0.1"
            )
        return None
    if not isinstance(token, str) or not _TOKEN_RE.match(token):
        raise ControlApiConfigError(
            "control API token: expected a non-empty string of visible ASCII characters "
            "(no spaces), as sent in 'Authorization: Bearer <token>'"
        )
    return hashlib.sha256(token.encode("ascii")).digest()


def _token_matches(header: str, expected_digest: bytes) -> bool:
    scheme, _, credentials = header.strip().partition(" ")
    # Hash first: compare_digest then sees equal-length inputs, so neither content nor
    # length leaks through timing. Always compare, even when the scheme is wrong.
    given = hashlib.sha256(credentials.strip().encode("utf-8", "replace")).digest()
    same = hmac.compare_digest(given, expected_digest)
    return same and scheme.lower() == "bearer"


# ------------------------------------------------------------------ validation


def parse_ttl(value: object, *, field: str = "ttl", max_s: float = MAX_TTL_S) -> float:
    """A TTL from JSON: a duration string or a number of seconds, in (0, max_s]; read
    like every other duration (config.parse_duration), so a refusal says why."""
    from specgov.controller.daemon.config_values import ConfigError, parse_duration

    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise RequestError(f"{field}: expected {TTL_FORM}, got {value!r}")
    try:
        seconds = parse_duration(value, where=field, allow_zero=True)
    except ConfigError:
        raise RequestError(f"{field}: expected {TTL_FORM}, got {value!r}") from None
    if seconds <= 0:
        raise RequestError(
            f"{field}: expected a duration > 0 and at most {max_s:g} s (7 days), got {value!r}"
        )
    if seconds > max_s:
        raise RequestError(
            f"{field}: {value!r} is {seconds:.10g} s, over the limit of {max_s:g} s "
            f"({max_s / 86400:g} days)"
        )
    return seconds


def _opt_int(
    body: Mapping[str, Any], key: str, minimum: int, maximum: int, what: str
) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if not is_int(value) or not minimum <= value <= maximum:
        raise RequestError(
            f"{key}: expected an integer from {minimum} to {maximum} ({what}), got {value!r}"
        )
    return value


def _text(value: object, key: str, max_chars: int, what: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise RequestError(f"{key}: expected a non-empty string ({what}), got {value!r}")
    if len(value) > max_chars:
        raise RequestError(f"{key}: expected at most {max_chars} characters, got {len(value)}")
    return value.strip()


def _check_keys(body: Mapping[str, Any], allowed: Sequence[str], what: str) -> None:
    unknown = sorted(set(body) - set(allowed))
    if unknown:
        raise RequestError(
            f"{what}: unknown key {unknown[0]!r}; expected keys: {', '.join(allowed)}"
        )


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise RequestError(f"request body: key {key!r} appears twice")
        out[key] = value
    return out


def _reject_constant(name: str) -> Any:
    raise RequestError(f"request body: {name} is not valid JSON; expected a finite number")


def json_depth(text: str) -> int:
    """How deeply arrays and objects nest in ``text`` (brackets inside strings do not
    count); linear in the length and never recursive, so safe on any body."""
    depth = deepest = 0
    for token in _JSON_TOKEN_RE.findall(text):
        if token in ("[", "{"):
            depth += 1
            deepest = max(deepest, depth)
        elif token in ("]", "}"):
            depth -= 1
    return deepest


async def _json_object(request: web.Request, what: str) -> dict[str, Any]:
    limit = request.app[_MAX_BODY_KEY]
    if request.content_length is not None and request.content_length > limit:
        raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=request.content_length)
    raw = await request.read()  # raises 413 past client_max_size
    if not raw.strip():
        raise RequestError(f"{what}: expected a JSON object body, got an empty body")
    try:
        text = raw.decode("utf-8")
        depth = json_depth(text)
        if depth > MAX_JSON_DEPTH:
            raise RequestError(
                f"{what}: JSON nested {depth} levels deep; expected at most {MAX_JSON_DEPTH} "
                "(the body is one flat object)"
            )
        body = json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_reject_constant)
    except UnicodeDecodeError:
        raise RequestError(f"{what}: expected a UTF-8 JSON object body") from None
    except json.JSONDecodeError as exc:
        raise RequestError(
            f"{what}: malformed JSON at line {exc.lineno} column {exc.colno}: {exc.msg}"
        ) from None
    if not isinstance(body, dict):
        raise RequestError(f"{what}: expected a JSON object, got {type(body).__name__}")
    return body


def _query(request: web.Request, allowed: Sequence[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for key in request.query:
        if key not in allowed:
            expected = ", ".join(allowed) if allowed else "none"
            raise RequestError(f"unknown query parameter {key!r}; expected: {expected}")
        values = request.query.getall(key)
        if len(values) > 1:
            raise RequestError(f"query parameter {key!r} given {len(values)} times; expected once")
        out[key] = values[0]
    return out


def _query_int(params: Mapping[str, str], key: str, minimum: int, maximum: int) -> int | None:
    raw = params.get(key)
    if raw is None:
        return None
    try:
        value = int(raw.strip())
    except ValueError:
        value = None
    if value is None or not minimum <= value <= maximum:
        raise RequestError(f"{key}: expected an integer from {minimum} to {maximum}, got {raw!r}")
    return value


def _validate_override(body: Mapping[str, Any]) -> dict[str, Any]:
    _check_keys(body, _OVERRIDE_KEYS, "override")
    slot = _opt_int(body, "slot", 1, MAX_SLOT, "a batch-size slot lower bound")
    steps = _opt_int(body, "steps", 0, MAX_STEPS, "draft steps")
    disable = check_bool(
        "disable", body.get("disable", False), error=RequestError, form="true or false"
    )
    pin = body.get("pin_policy")
    if pin is not None:
        pin = _text(pin, "pin_policy", MAX_SPEC_CHARS, 'a policy spec such as "goodput"')
    if "ttl" not in body:
        raise RequestError(f"ttl: required; expected {TTL_FORM}")
    ttl_s = parse_ttl(body["ttl"])
    if "reason" not in body:
        raise RequestError("reason: required; expected a non-empty string saying why")
    reason = _text(body["reason"], "reason", MAX_TEXT_CHARS, "why the override is needed")

    actions = [
        name
        for name, on in (("steps", steps is not None), ("disable", disable), ("pin_policy", pin))
        if on
    ]
    if len(actions) != 1:
        got = " and ".join(actions) if actions else "none"
        raise RequestError(
            f"override: expected exactly one action: steps (with an optional slot), "
            f"disable: true, or pin_policy; got {got}"
        )
    if slot is not None and steps is None:
        raise RequestError(
            f"slot: applies only with steps (disable and pin_policy act on every slot; "
            f"to stop speculating in one slot set steps: 0), got slot {slot} with {actions[0]}"
        )
    return {
        "slot": slot,
        "steps": steps,
        "disable": disable,
        "pin_policy": pin,
        "ttl_s": ttl_s,
        "reason": reason,
    }


# ------------------------------------------------------------------- responses


def _jsonable(value: Any, path: str = "$") -> Any:
    """Plain JSON data; non-finite floats become None. TypeError for anything else."""
    if value is None or isinstance(value, str | bool | int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v, f"{path}.{k}") for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v, f"{path}[{i}]") for i, v in enumerate(value)]
    raise TypeError(f"control API answer: {path} is a {type(value).__name__}, not JSON data")


def json_response(data: Any, status: int = 200) -> web.Response:
    try:
        # The C encoder on plain data first (issue 9 §5: the Python walk below cost
        # milliseconds per status document); NaN/inf, non-dict mappings or foreign
        # types make it raise, and the walk then converts (or names the bad path).
        body = json.dumps(data, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError):
        body = json.dumps(_jsonable(data), sort_keys=True, allow_nan=False)
    return web.Response(text=body, status=status, content_type="application/json")


def _error(status: int, message: str, headers: Mapping[str, str] | None = None) -> web.Response:
    response = json_response({"error": message}, status)
    if headers:
        response.headers.update(headers)
    return response


def _mapping(value: object, method: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise TypeError(f"ControlService.{method} returned {type(value).__name__}, not a mapping")
    return value


def _sequence(value: object, method: str) -> list[Any]:
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        raise TypeError(f"ControlService.{method} returned {type(value).__name__}, not a list")
    return list(value)


def _service_call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    try:
        return fn(*args, **kwargs)
    except RequestError:
        raise
    except ValueError as exc:
        # The service's own validation (guardrails, policy specs): its text is the answer.
        raise RequestError(str(exc) or type(exc).__name__) from exc


# ------------------------------------------------------------------ the app

_SERVICE_KEY: Final[web.AppKey[ControlService]] = web.AppKey("specgov_control_service")
# True when health answers go out in full to callers without the token (loopback).
_HEALTH_OPEN_KEY: Final[web.AppKey[bool]] = web.AppKey("specgov_control_health_open", bool)
# The token's digest (None: no token), for the open routes' own check.
_DIGEST_KEY: Final[web.AppKey[bytes | None]] = web.AppKey("specgov_control_token_digest")
# What a reason code may look like: the fixed words of controller/daemon/health.py.
_CODE_RE: Final = re.compile(r"^[a-z][a-z0-9_]{0,63}$")
TERSE_HINT: Final = "send the control token (Authorization: Bearer <token>) for the detail"
_MAX_BODY_KEY: Final[web.AppKey[int]] = web.AppKey("specgov_control_max_body_bytes", int)
# (since_s, limit) -> (the service's answer object, its JSON): see _get_decisions.
_DecisionsCache = dict[tuple[float | None, int], tuple[object, str]]
_DECISIONS_BODY_KEY: Final[web.AppKey[_DecisionsCache]] = web.AppKey(
    "specgov_control_decisions_bodies"
)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _status_text(exc: web.HTTPException, limit: int) -> str:
    if exc.status == 413:
        return f"request body too large: expected at most {limit} bytes"
    if exc.status == 404:
        return f"no such route; the control API's routes are under {API_PREFIX}/"
    if exc.status == 405:
        return f"method not allowed here; allowed: {exc.headers.get('Allow', 'none')}"
    return exc.reason


def _error_middleware(limit: int) -> Any:
    @web.middleware
    async def errors(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except RequestError as exc:
            return _error(400, str(exc))
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            headers = {k: v for k, v in exc.headers.items() if k in ("Allow", "WWW-Authenticate")}
            return _error(exc.status, _status_text(exc, limit), headers)
        except Exception:
            logger.exception("control API: %s %s failed", request.method, request.path)
            return _error(500, "internal error in the specgov daemon; see its log")

    return errors


def _auth_middleware(expected_digest: bytes, *, open_reads: bool) -> Any:
    @web.middleware
    async def auth(request: web.Request, handler: Handler) -> web.StreamResponse:
        reading = request.method in ("GET", "HEAD")
        open_route = reading and (open_reads or request.path in HEALTH_PATHS)
        if not open_route and not _token_matches(
            request.headers.get("Authorization", ""), expected_digest
        ):
            return _error(
                401,
                "missing or invalid token; expected the header 'Authorization: Bearer <token>'",
                {"WWW-Authenticate": 'Bearer realm="specgov"'},
            )
        return await handler(request)

    return auth


def _service(request: web.Request) -> ControlService:
    return request.app[_SERVICE_KEY]


def terse_health(data: Mapping[str, Any]) -> dict[str, Any]:
    """A health answer without detail: its booleans (``ok``, the checks) and, as
    ``reasons``, only its reason codes (``data["codes"]``: fixed words; anything else in
    them is left out), plus a hint at how to get the rest. No path, no error text."""
    out: dict[str, Any] = {k: v for k, v in data.items() if isinstance(v, bool)}
    codes = data.get("codes")
    listed = codes if isinstance(codes, list | tuple) else ()
    reasons = [c for c in listed if isinstance(c, str) and _CODE_RE.match(c)]
    if not reasons and not data.get("ok", True):
        reasons = ["unspecified"]
    out["reasons"] = reasons
    out["detail"] = TERSE_HINT
    return out


def _health_answer(request: web.Request, data: Mapping[str, Any]) -> web.Response:
    status = 200 if data.get("ok", True) else 503
    if request.app[_HEALTH_OPEN_KEY]:
        return json_response(data, status)
    # A probe sends no token and gets the terse answer; the operator's token the rest.
    digest, header = request.app[_DIGEST_KEY], request.headers.get("Authorization")
    if digest is not None and header is not None and _token_matches(header, digest):
        return json_response(data, status)
    return json_response(terse_health(data), status)


async def _get_health(request: web.Request) -> web.Response:
    _query(request, ())
    return _health_answer(request, _mapping(_service_call(_service(request).health), "health"))


async def _get_liveness(request: web.Request) -> web.Response:
    _query(request, ())
    data = _mapping(_service_call(_service(request).liveness), "liveness")
    return _health_answer(request, data)


async def _get_status(request: web.Request) -> web.Response:
    _query(request, ())
    return json_response(_mapping(_service_call(_service(request).status), "status"))


async def _get_decisions(request: web.Request) -> web.Response:
    params = _query(request, ("since", "limit"))
    since_s: float | None = None
    if "since" in params:
        raw = params["since"]
        try:
            since_s = float(raw)
        except ValueError:
            since_s = None
        if since_s is None or not math.isfinite(since_s) or since_s < 0:
            raise RequestError(f"since: expected unix time in seconds (a number >= 0), got {raw!r}")
    limit = _query_int(params, "limit", 1, MAX_DECISIONS_LIMIT)
    if limit is None:
        limit = DEFAULT_DECISIONS_LIMIT
    answer = _service_call(_service(request).decisions, since_s=since_s, limit=limit)
    # A service that hands back the same list until it changes (the daemon does, until
    # its next audit row) has it serialised once, not once per request.
    cache = request.app[_DECISIONS_BODY_KEY]
    cached = cache.get((since_s, limit))
    if cached is not None and cached[0] is answer:
        rows_json = cached[1]
    else:
        rows = _sequence(answer, "decisions")
        rows_json = json_response(rows).text or "[]"
        if len(cache) >= 64:
            cache.clear()
        cache[(since_s, limit)] = (answer, rows_json)
        answer = rows
    count = len(answer)
    since_json = json.dumps(since_s)
    body = (
        f'{{"count": {count}, "decisions": {rows_json}, "limit": {limit}, "since_s": {since_json}}}'
    )
    return web.Response(text=body, content_type="application/json")


async def _get_overrides(request: web.Request) -> web.Response:
    _query(request, ())
    rows = _sequence(_service_call(_service(request).list_overrides), "list_overrides")
    return json_response({"overrides": rows})


async def _post_override(request: web.Request) -> web.Response:
    _query(request, ())
    args = _validate_override(await _json_object(request, "override"))
    created = _mapping(_service_call(_service(request).set_override, **args), "set_override")
    return json_response({"override": created}, 201)


async def _delete_overrides(request: web.Request) -> web.Response:
    params = _query(request, ("id", "slot", "all"))
    if len(params) != 1:
        raise RequestError(
            "expected exactly one query parameter: id=<override id>, slot=<slot lower bound> "
            f"or all=true; got {', '.join(sorted(params)) or 'none'}"
        )
    override_id = params.get("id")
    if override_id is not None and not _ID_RE.match(override_id):
        raise RequestError(
            f"id: expected an override id as listed by GET {API_PREFIX}/overrides "
            f"(1 to 100 visible characters), got {override_id!r}"
        )
    slot = _query_int(params, "slot", 1, MAX_SLOT)
    if "all" in params and params["all"].strip().lower() != "true":
        raise RequestError(f"all: expected 'true' (to clear every override), got {params['all']!r}")
    cleared = _service_call(_service(request).clear_override, override_id=override_id, slot=slot)
    if not is_int(cleared):
        raise TypeError(f"ControlService.clear_override returned {cleared!r}, not an int")
    if cleared == 0 and override_id is not None:
        return _error(404, f"no override in force with id {override_id}")
    if cleared == 0 and slot is not None:
        return _error(404, f"no override in force for slot {slot}")
    return json_response({"cleared": cleared})


async def _get_policy(request: web.Request) -> web.Response:
    _query(request, ())
    data = _mapping(_service_call(_service(request).policies), "policies")
    if "current" not in data:
        raise TypeError("ControlService.policies returned no 'current' key")
    return json_response({"policy": data["current"]})


async def _put_policy(request: web.Request) -> web.Response:
    _query(request, ())
    body = await _json_object(request, "policy")
    _check_keys(body, _POLICY_KEYS, "policy")
    if "spec" not in body:
        raise RequestError('spec: required; expected a policy spec string such as "goodput"')
    spec = _text(body["spec"], "spec", MAX_SPEC_CHARS, 'a policy spec such as "goodput"')
    return json_response(_mapping(_service_call(_service(request).set_policy, spec), "set_policy"))


async def _get_policies(request: web.Request) -> web.Response:
    _query(request, ())
    return json_response(_mapping(_service_call(_service(request).policies), "policies"))


async def _get_recommend(request: web.Request) -> web.Response:
    _query(request, ())
    return json_response(_mapping(_service_call(_service(request).recommend), "recommend"))


def make_app(
    service: ControlService,
    *,
    token: str | None,
    listen_host: str,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    open_reads_on_loopback: bool = False,
) -> web.Application:
    """The control API over ``service``; see the module docstring.

    ``open_reads_on_loopback``: with a token and a loopback ``listen_host``, the
    read-only routes (GET, HEAD) answer without it and only the mutating ones (POST,
    PUT, DELETE) need it (the daemon's rule: every local user may look, only the
    token's holder may steer). Beyond loopback every route but health needs it.

    Raises :class:`ControlApiConfigError` when ``listen_host`` is beyond loopback and no
    token is given, when the token is not sendable in a header, or when
    ``max_body_bytes`` is not a positive int.
    """
    if not is_int(max_body_bytes) or max_body_bytes < 1:
        raise ControlApiConfigError(
            f"control API max_body_bytes: expected an int >= 1, got {max_body_bytes!r}"
        )
    if not isinstance(service, ControlService):
        raise ControlApiConfigError(
            f"control API service: {type(service).__name__} lacks ControlService's methods"
        )
    digest = _check_token(token, listen_host)
    middlewares = [_error_middleware(max_body_bytes)]
    if digest is not None:
        open_reads = open_reads_on_loopback and is_loopback_host(listen_host)
        middlewares.append(_auth_middleware(digest, open_reads=open_reads))
    app = web.Application(client_max_size=max_body_bytes, middlewares=middlewares)
    app[_SERVICE_KEY] = service
    app[_HEALTH_OPEN_KEY] = is_loopback_host(listen_host)
    app[_DIGEST_KEY] = digest
    app[_MAX_BODY_KEY] = max_body_bytes
    app[_DECISIONS_BODY_KEY] = {}
    r = app.router
    r.add_get(f"{API_PREFIX}/health", _get_health)
    r.add_get(f"{API_PREFIX}/health/ready", _get_health)
    r.add_get(f"{API_PREFIX}/health/live", _get_liveness)
    r.add_get(f"{API_PREFIX}/status", _get_status)
    r.add_get(f"{API_PREFIX}/decisions", _get_decisions)
    r.add_get(f"{API_PREFIX}/overrides", _get_overrides)
    r.add_post(f"{API_PREFIX}/overrides", _post_override)
    r.add_delete(f"{API_PREFIX}/overrides", _delete_overrides)
    r.add_get(f"{API_PREFIX}/policy", _get_policy)
    r.add_put(f"{API_PREFIX}/policy", _put_policy)
    r.add_get(f"{API_PREFIX}/policies", _get_policies)
    r.add_get(f"{API_PREFIX}/recommend", _get_recommend)
    return app
