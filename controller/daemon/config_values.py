"""The configuration's error type and value forms (:mod:`specgov.controller.daemon.config`).

:class:`ConfigError` names where a bad value came from; :func:`parse_duration` and
:func:`parse_listen_address` read the forms several keys (and CLI flags) share; values in
messages are shown elided (:func:`show_value`).
"""

from __future__ import annotations

import ipaddress
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, cast

from specgov.adapters.errors import eliding_repr, escape_upstream
from specgov.policies.common.errors import SpecgovError
from specgov.policies.common.validation import is_real

# Bounds on what an error message shows (the config module's docstring).
MESSAGE_MAX_CHARS: Final = 2000
MAX_PROBLEMS: Final = 50  # errors listed by one failed load (the rest are counted)


class ConfigError(SpecgovError, ValueError):
    """Bad configuration; the message names the source, key path, value and expected form.

    ``problems``: one printable line per error found (at most about
    :data:`MESSAGE_MAX_CHARS` characters each, control characters escaped, the rest cut
    with a marker; at most :data:`MAX_PROBLEMS` of them, then how many more). The message
    is the one line, or ``N errors:`` and one indented line per error.
    """

    def __init__(self, message: str | Sequence[str]) -> None:
        found = [message] if isinstance(message, str) else list(message)
        lines = [escape_upstream(m, MESSAGE_MAX_CHARS) for m in found[:MAX_PROBLEMS]]
        if len(found) > MAX_PROBLEMS:
            lines.append(f"... and {len(found) - MAX_PROBLEMS} more errors")
        self.problems: tuple[str, ...] = tuple(lines)
        if len(found) == 1:
            text = lines[0]
        else:
            text = f"{len(found)} errors:\n" + "\n".join(f"  {line}" for line in lines)
        super().__init__(text)


class ConfigProblems:
    """Errors found while loading, so that one run reports every one of them."""

    def __init__(self) -> None:
        self.found: list[str] = []

    def add(self, exc: ConfigError) -> None:
        self.found.extend(exc.problems)

    def raise_any(self) -> None:
        if self.found:
            raise ConfigError(self.found)


_SHOW: Final = eliding_repr(chars=200, digits=40, items=12)


def show_value(value: object) -> str:
    """``repr(value)`` for a message, elided: a huge value is never rendered whole."""
    return _SHOW.repr(value)


# ----------------------------------------------------------------------- value forms

DURATION_FORM: Final = "a duration like '5s', '250ms', '5m', '1h', '1d' or a number of seconds"
_DURATION_RE: Final = re.compile(
    r"(?P<num>(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?)\s*(?P<unit>ms|s|m|h|d)?"
)
_UNIT_S: Final = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}
_HOSTNAME_RE: Final = re.compile(
    r"(?=.{1,253}\Z)[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
    r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?"
)
LISTEN_FORM: Final = "'HOST:PORT' like '127.0.0.1:9465' or '[::1]:9465' (port 0-65535)"


def parse_duration(value: object, *, where: str = "duration", allow_zero: bool = False) -> float:
    """Seconds from ``"30s"``, ``"250ms"``, ``"5m"``, ``"1h"``, ``"1d"``, ``"30"`` or a number.

    Must be finite and > 0 (>= 0 with ``allow_zero``). Raises :class:`ConfigError`
    ``"{where}: expected ..., got {show_value(value)}"``; the CLI uses it for ``--ttl`` and friends.
    """
    seconds: float | None = None
    if is_real(value):  # finite: NaN, inf and ints beyond float range are refused below
        seconds = float(value)
    elif isinstance(value, str):
        match = _DURATION_RE.fullmatch(value.strip())
        if match is not None:
            seconds = float(match["num"]) * _UNIT_S[match["unit"]]
    ok = seconds is not None and math.isfinite(seconds) and seconds >= 0.0
    ok = ok and (allow_zero or cast(float, seconds) > 0.0)
    if not ok:
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(f"{where}: expected {DURATION_FORM} {bound}, got {show_value(value)}")
    return cast(float, seconds)


@dataclass(frozen=True, slots=True)
class ListenAddress:
    """A ``HOST:PORT`` to listen on (or connect to); port 0 picks a free port."""

    host: str
    port: int

    @property
    def is_loopback(self) -> bool:
        """True only for addresses that cannot be reached from another machine."""
        if self.host.lower().rstrip(".") == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False  # another host name: it may resolve to anything

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def parse_listen_address(value: object, *, where: str = "address") -> ListenAddress:
    """``"127.0.0.1:9465"``, ``"[::1]:9465"``, ``"localhost:9465"`` -> ListenAddress."""

    def bad(why: str = "") -> ConfigError:
        return ConfigError(f"{where}: expected {LISTEN_FORM}{why}, got {show_value(value)}")

    if not isinstance(value, str):
        raise bad()
    text = value.strip()
    host, sep, port_text = text.rpartition(":")
    if not sep or not host or not port_text.isascii() or not port_text.isdigit():
        raise bad()
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise bad(" (not an IPv6 address in the brackets)") from None
    elif ":" in host:
        raise bad(" (an IPv6 address needs brackets)")
    elif all(part.isdigit() for part in host.split(".")):
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            raise bad(" (not an IPv4 address)") from None
    elif not _HOSTNAME_RE.fullmatch(host):
        raise bad(" (not a host name)")
    port = int(port_text)
    if port > 65535:
        raise bad(" (port out of range)")
    return ListenAddress(host=host, port=port)


def plain_value(value: object) -> Any:
    if isinstance(value, Path | ListenAddress):
        return str(value)
    if isinstance(value, tuple | list):
        return [plain_value(v) for v in value]
    return value
