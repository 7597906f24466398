"""The daemon's health as probes see it, and the throttle for the faults it logs.

Readiness (``GET /v1/health`` and ``/v1/health/ready``) is true only when the daemon
can do its job: telemetry fresh enough to act on, the spool writable (plugin mode),
the state store usable, and no permanent error. Each failing check is a reason in
the answer; the answer is 503 then. Liveness (``/v1/health/live``) only says the
process is not stuck: its decision loop ticked recently. A daemon that is alive but not
ready should be left running (it recovers by itself when the server, disk or spool
come back); one that is not alive should be restarted.

:class:`WarningThrottle` keeps a repeated fault from writing a log line every second:
the first of a kind is logged at once, the rest within ``interval_s`` are counted and
the count is reported with the next line logged for that kind. Messages are escaped
(control bytes from upstream answers never reach the log raw).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

__all__ = [
    "DEFAULT_TELEMETRY_MAX_AGE_S",
    "DEFAULT_WARNING_INTERVAL_S",
    "HealthInputs",
    "WarningThrottle",
    "escape_text",
    "liveness",
    "readiness",
]

DEFAULT_TELEMETRY_MAX_AGE_S: Final = 60.0
DEFAULT_WARNING_INTERVAL_S: Final = 60.0
# A decision loop that has not ticked for this many intervals (and at least
# LIVENESS_MIN_S) is stuck.
LIVENESS_INTERVALS: Final = 3.0
LIVENESS_MIN_S: Final = 30.0
MAX_LOGGED_CHARS: Final = 2000

_CONTROL: Final = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\n]")


def escape_text(text: str, max_chars: int = MAX_LOGGED_CHARS) -> str:
    """``text`` with control characters escaped (``\\x1b``, ``\\n``), cut to ``max_chars``."""
    escaped = _CONTROL.sub(lambda m: m.group(0).encode("unicode_escape").decode("ascii"), text)
    if len(escaped) > max_chars:
        return f"{escaped[:max_chars]}... ({len(escaped) - max_chars} more characters)"
    return escaped


@dataclass(frozen=True, slots=True)
class HealthInputs:
    """What the verdict is computed from (the daemon's status, at ``now_s``)."""

    now_s: float
    started_at_s: float
    last_scrape_s: float | None
    last_scrape_error: str | None
    permanent_error: str | None
    spool_error: str | None
    store_error: str | None
    telemetry_max_age_s: float = DEFAULT_TELEMETRY_MAX_AGE_S
    last_tick_s: float | None = None
    decide_interval_s: float = 5.0


def readiness(h: HealthInputs) -> dict[str, object]:
    """``{"ok", "acting", "telemetry", "spool", "store", "reasons": [...]}``."""
    reasons: list[str] = []
    acting = h.permanent_error is None
    if not acting:
        reasons.append(f"not acting: {h.permanent_error}")
    since = h.last_scrape_s if h.last_scrape_s is not None else h.started_at_s
    age_s = h.now_s - since
    telemetry = age_s <= h.telemetry_max_age_s
    if not telemetry:
        what = "no telemetry yet" if h.last_scrape_s is None else "no telemetry"
        cause = f": {h.last_scrape_error}" if h.last_scrape_error else ""
        reasons.append(f"{what} for {age_s:.0f} s (bound {h.telemetry_max_age_s:g} s){cause}")
    spool = h.spool_error is None
    if not spool:
        reasons.append(f"spool: {h.spool_error}")
    store = h.store_error is None
    if not store:
        reasons.append(f"store: {h.store_error}")
    return {
        "ok": not reasons,
        "acting": acting,
        "telemetry": telemetry,
        "telemetry_age_s": age_s,
        "spool": spool,
        "store": store,
        "reasons": reasons,
    }


def liveness(h: HealthInputs) -> dict[str, object]:
    """``{"ok", "last_tick_age_s", "bound_s", "reasons"}``: is the decision loop ticking."""
    bound_s = max(LIVENESS_MIN_S, LIVENESS_INTERVALS * h.decide_interval_s)
    since = h.last_tick_s if h.last_tick_s is not None else h.started_at_s
    age_s = h.now_s - since
    ok = age_s <= bound_s
    reasons = (
        [] if ok else [f"decision loop has not ticked for {age_s:.0f} s (bound {bound_s:g} s)"]
    )
    return {"ok": ok, "last_tick_age_s": age_s, "bound_s": bound_s, "reasons": reasons}


@dataclass
class _Kind:
    last_logged_s: float
    suppressed: int = 0


@dataclass
class WarningThrottle:
    """Per-kind rate limit for log lines (see the module docstring).

    ``on_suppressed(kind)`` is called for every line not written (a metric counter).
    """

    logger: logging.Logger
    clock: Callable[[], float]
    interval_s: float = DEFAULT_WARNING_INTERVAL_S
    on_suppressed: Callable[[str], None] | None = None
    _kinds: dict[str, _Kind] = field(default_factory=dict)

    def log(self, level: int, kind: str, message: str) -> bool:
        """Log ``message`` unless ``kind`` was logged within ``interval_s``; True if written."""
        now = self.clock()
        state = self._kinds.get(kind)
        if state is not None and now - state.last_logged_s < self.interval_s:
            state.suppressed += 1
            if self.on_suppressed is not None:
                self.on_suppressed(kind)
            return False
        text = escape_text(message)
        if state is not None and state.suppressed:
            text += (
                f" ({state.suppressed} similar message(s) suppressed in the last "
                f"{now - state.last_logged_s:.0f} s)"
            )
        self.logger.log(level, "%s", text)
        self._kinds[kind] = _Kind(last_logged_s=now)
        return True

    def warning(self, kind: str, message: str) -> bool:
        return self.log(logging.WARNING, kind, message)

    def error(self, kind: str, message: str) -> bool:
        return self.log(logging.ERROR, kind, message)

    def suppressed(self, kind: str) -> int:
        state = self._kinds.get(kind)
        return 0 if state is None else state.suppressed

    def resolve(self, kind: str) -> int:
        """The condition behind ``kind`` cleared: the next one is logged at once.
        Returns how many lines of it were suppressed since the last one written."""
        state = self._kinds.pop(kind, None)
        return 0 if state is None else state.suppressed
