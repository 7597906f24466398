"""Synchronous client of the daemon's control API (used by the CLI commands).

One method per route of :mod:`specgov.controller.daemon.control_api`, returning the
documented JSON. Failures raise a :class:`ControlClientError` subclass whose message is
meant for an operator, never a traceback:

* :class:`DaemonUnreachableError` (also a :class:`ConnectionError`): nothing answered —
  "is `specgov run` running? tried http://127.0.0.1:9465/v1/status";
* :class:`ControlRequestError` (also a :class:`ValueError`): a 4xx, with the daemon's
  own error message; :class:`ControlAuthError` for 401/403 (token missing or wrong);
* :class:`ControlServerError`: a 5xx, or an answer that is not the API's JSON (another
  program on that port).

The client ignores proxy environment variables (``trust_env=False``): the daemon is
on loopback or a private address, and an ``HTTP_PROXY`` must not see the token.
The token is sent only in the ``Authorization`` header; it is never part of a message
or ``repr``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any, Final
from urllib.parse import urlsplit

import httpx

from specgov.policies.common.errors import PermanentError, SpecgovError, TemporaryError
from specgov.policies.common.validation import is_int, is_real

DEFAULT_CONTROL_URL: Final = "http://127.0.0.1:9465"
_API: Final = "/v1"
_USER_AGENT: Final = "specgov-cli/0.1"
_HOST_PORT_RE: Final = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[^\s:/\[\]]+):([0-9]{1,5})$")


class ControlAddressError(SpecgovError, ValueError):
    """A control address is not ``HOST:PORT`` or an ``http(s)://`` URL."""


class ControlClientError(SpecgovError):
    """A control API call failed; ``url`` and ``status_code`` (None: no answer) say where."""

    def __init__(self, message: str, *, url: str, status_code: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.url = url
        self.status_code = status_code

    def __str__(self) -> str:
        return self.message


class DaemonUnreachableError(ControlClientError, ConnectionError, TemporaryError):
    """Nothing answered at the control address (refused, timed out, name unknown)."""


class ControlRequestError(ControlClientError, ValueError, PermanentError):
    """The daemon refused the request (4xx); the message is the daemon's."""


class ControlAuthError(ControlRequestError):
    """401/403: the daemon needs a token and did not get the right one."""


class ControlServerError(ControlClientError, TemporaryError):
    """A 5xx, or an answer that is not the control API's JSON."""


def control_base_url(address: str) -> str:
    """``HOST:PORT`` (``[::1]:9465`` for IPv6) or an ``http(s)://`` URL -> base URL."""
    text = address.strip()
    if "://" in text:
        parts = urlsplit(text)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ControlAddressError(
                f"control address {address!r}: expected HOST:PORT or http(s)://HOST:PORT"
            )
        try:
            port = parts.port
        except ValueError:
            port = -1
        if port is not None and not 1 <= port <= 65535:
            raise ControlAddressError(f"control address {address!r}: port must be 1..65535")
        if parts.path not in ("", "/") or parts.query or parts.fragment:
            raise ControlAddressError(
                f"control address {address!r}: expected no path, query or fragment "
                f"(the client adds {_API}/...)"
            )
        return f"{parts.scheme}://{parts.netloc}"
    match = _HOST_PORT_RE.match(text)
    if match is None or not 1 <= int(match.group(2)) <= 65535:
        raise ControlAddressError(
            f"control address {address!r}: expected HOST:PORT such as 127.0.0.1:9465 "
            "(IPv6 as [::1]:9465) or an http(s):// URL"
        )
    return f"http://{match.group(1)}:{int(match.group(2))}"


class ControlClient:
    """Talks to one daemon's control API; see the module docstring."""

    def __init__(
        self,
        base_url: str = DEFAULT_CONTROL_URL,
        *,
        token: str | None = None,
        timeout_s: float = 5.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        if not is_real(timeout_s) or timeout_s <= 0:
            raise ValueError(
                f"ControlClient.timeout_s: expected a finite number > 0, got {timeout_s!r}"
            )
        self.base_url = control_base_url(base_url)
        self.timeout_s = float(timeout_s)
        headers = {"User-Agent": _USER_AGENT, "Accept": "application/json"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        self._http = httpx.Client(
            base_url=self.base_url,
            headers=headers,
            timeout=self.timeout_s,
            transport=transport,
            trust_env=False,
            follow_redirects=False,
        )

    def __repr__(self) -> str:
        return f"ControlClient({self.base_url!r})"

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> ControlClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ---------------------------------------------------------------- routes

    def health(self) -> dict[str, Any]:
        """``GET /v1/health``; a 503 (daemon up, not acting) is returned, not raised."""
        return self._object(self._request("GET", "/health", ok_statuses=(200, 503)), "health")

    def status(self) -> dict[str, Any]:
        return self._object(self._request("GET", "/status"), "status")

    def decisions(self, since_s: float | None = None, limit: int = 100) -> list[dict[str, Any]]:
        """Newest first, at most ``limit``, optionally only those at or after ``since_s``."""
        params: dict[str, str] = {"limit": str(limit)}
        if since_s is not None:
            params["since"] = repr(float(since_s))
        return self._list(self._request("GET", "/decisions", params=params), "decisions")

    def list_overrides(self) -> list[dict[str, Any]]:
        return self._list(self._request("GET", "/overrides"), "overrides")

    def set_override(
        self,
        *,
        ttl: str | float,
        reason: str,
        slot: int | None = None,
        steps: int | None = None,
        disable: bool = False,
        pin_policy: str | None = None,
    ) -> dict[str, Any]:
        """Set an override; ``ttl`` is a duration ("30m") or seconds. Returns it."""
        payload: dict[str, Any] = {"ttl": ttl, "reason": reason}
        if slot is not None:
            payload["slot"] = slot
        if steps is not None:
            payload["steps"] = steps
        if disable:
            payload["disable"] = True
        if pin_policy is not None:
            payload["pin_policy"] = pin_policy
        response = self._request("POST", "/overrides", json_body=payload, ok_statuses=(201,))
        return self._nested_object(response, "override")

    def clear_override(
        self,
        *,
        override_id: str | None = None,
        slot: int | None = None,
        clear_all: bool = False,
    ) -> int:
        """Clear by id, by slot, or every override (``clear_all``); returns how many."""
        chosen = [
            (key, value)
            for key, value in (
                ("id", override_id),
                ("slot", None if slot is None else str(slot)),
                ("all", "true" if clear_all else None),
            )
            if value is not None
        ]
        if len(chosen) != 1:
            raise ValueError(
                "clear_override: expected exactly one of override_id, slot or clear_all=True"
            )
        response = self._request("DELETE", "/overrides", params=dict(chosen))
        body = self._object(response, "clear")
        cleared = body.get("cleared")
        if not is_int(cleared):
            raise self._bad_answer(response, "an object with an integer 'cleared'")
        return cleared

    def policy(self) -> dict[str, Any]:
        """``{"policy": <the current policy>}``."""
        return self._object(self._request("GET", "/policy"), "policy")

    def set_policy(self, spec: str) -> dict[str, Any]:
        return self._object(self._request("PUT", "/policy", json_body={"spec": spec}), "policy")

    def policies(self) -> dict[str, Any]:
        return self._object(self._request("GET", "/policies"), "policies")

    def recommend(self) -> dict[str, Any]:
        return self._object(self._request("GET", "/recommend"), "recommend")

    # -------------------------------------------------------------- plumbing

    def _request(
        self,
        method: str,
        route: str,
        *,
        params: Mapping[str, str] | None = None,
        json_body: Mapping[str, Any] | None = None,
        ok_statuses: tuple[int, ...] = (200,),
    ) -> httpx.Response:
        url = f"{self.base_url}{_API}{route}"
        try:
            response = self._http.request(method, f"{_API}{route}", params=params, json=json_body)
        except httpx.TimeoutException:
            raise DaemonUnreachableError(
                f"the specgov daemon did not answer within {self.timeout_s:g} s: is "
                f"`specgov run` running and responsive? tried {url}",
                url=url,
            ) from None
        except httpx.TransportError as exc:
            why = str(exc) or type(exc).__name__
            raise DaemonUnreachableError(
                f"cannot reach the specgov daemon ({why}): is `specgov run` running? tried {url}",
                url=url,
            ) from None
        if response.status_code in ok_statuses:
            return response
        message = self._server_message(response)
        where = f"{method} {url} -> HTTP {response.status_code}"
        if response.status_code in (401, 403):
            raise ControlAuthError(
                f"{where}: {message} (the daemon's control token: $SPECGOV_CONTROL_TOKEN "
                "when it was started with one, else its token file, control.token beside "
                "its state database, which only the daemon's user can read; point "
                "SPECGOV_CONTROL__TOKEN_FILE or SPECGOV_STATE__DB_PATH at it)",
                url=url,
                status_code=response.status_code,
            )
        if 400 <= response.status_code < 500:
            raise ControlRequestError(
                f"{where}: {message}", url=url, status_code=response.status_code
            )
        raise ControlServerError(f"{where}: {message}", url=url, status_code=response.status_code)

    @staticmethod
    def _server_message(response: httpx.Response) -> str:
        try:
            data = response.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            data = None
        if isinstance(data, dict) and isinstance(data.get("error"), str):
            return str(data["error"])
        snippet = response.text[:200].strip()
        return f"unexpected answer (not the specgov control API?): {snippet or 'empty body'}"

    @staticmethod
    def _bad_answer(response: httpx.Response, expected: str) -> ControlServerError:
        url = str(response.request.url)
        return ControlServerError(
            f"{response.request.method} {url}: the answer is not {expected}; is this a specgov "
            "daemon's control address?",
            url=url,
            status_code=response.status_code,
        )

    def _object(self, response: httpx.Response, what: str) -> dict[str, Any]:
        try:
            data = response.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise self._bad_answer(response, f"a JSON object ({what})") from None
        if not isinstance(data, dict):
            raise self._bad_answer(response, f"a JSON object ({what})")
        return data

    def _list(self, response: httpx.Response, key: str) -> list[dict[str, Any]]:
        rows = self._object(response, key).get(key)
        if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
            raise self._bad_answer(response, f"an object with a list of objects under {key!r}")
        return rows

    def _nested_object(self, response: httpx.Response, key: str) -> dict[str, Any]:
        value = self._object(response, key).get(key)
        if not isinstance(value, dict):
            raise self._bad_answer(response, f"an object with an object under {key!r}")
        return value
