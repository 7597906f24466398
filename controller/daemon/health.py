"""The daemon's health as probes see it.

Readiness (``GET /v1/health`` and ``/v1/health/ready``) is true only when the daemon
can do its job: telemetry fresh enough to act on, the spool writable (plugin mode),
plugin statistics arriving while the server is busy (plugin mode: blind is not
healthy), the server's clock not so far ahead that tables expire on arrival, the state
store usable, and no permanent error. Each failing check is a reason in
the answer, and a short fixed code in ``"codes"`` (:data:`READINESS_CODES`: what an
unauthenticated probe beyond loopback is told, see controller/daemon/control_api.py); the
answer is 503 then. Liveness (``/v1/health/live``) only says the process is not stuck:
its decision loop ticked recently. A daemon that is alive but not ready should be left
running (it recovers by itself when the server, disk or spool come back); one that is
not alive should be restarted.

Every age is computed on the daemon's monotonic clock, never on wall time: an NTP step
of the wall clock must neither make fresh telemetry look stale (a forward step) nor
keep stale telemetry looking fresh (a backward one). :class:`FailureClock` keeps when
each failing condition started on that clock.

The rate limit for repeated log lines is :class:`specgov.adapters.log_throttle.LogThrottle`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

from specgov.policies.guardrails import DEFAULT_TABLE_TTL_S

__all__ = [
    "DEFAULT_TELEMETRY_MAX_AGE_S",
    "LIVENESS_CODES",
    "READINESS_CODES",
    "FailureClock",
    "HealthInputs",
    "liveness",
    "readiness",
]

DEFAULT_TELEMETRY_MAX_AGE_S: Final = 60.0
# A decision loop that has not ticked for this many intervals (and at least
# LIVENESS_MIN_S) is stuck.
LIVENESS_INTERVALS: Final = 3.0
LIVENESS_MIN_S: Final = 30.0

# The codes of the failing checks (the "codes" of an answer; fixed words, no detail).
NOT_ACTING: Final = "not_acting"
NO_TELEMETRY_YET: Final = "no_telemetry_yet"
TELEMETRY_STALE: Final = "telemetry_stale"
SPOOL_FAILING: Final = "spool_failing"
STORE_UNAVAILABLE: Final = "store_unavailable"
NO_PLUGIN_STATISTICS: Final = "no_plugin_statistics"
CLOCK_SKEW: Final = "clock_skew"
LOOP_STUCK: Final = "decision_loop_stuck"
READINESS_CODES: Final = (
    NOT_ACTING,
    NO_TELEMETRY_YET,
    TELEMETRY_STALE,
    SPOOL_FAILING,
    STORE_UNAVAILABLE,
    NO_PLUGIN_STATISTICS,
    CLOCK_SKEW,
)
LIVENESS_CODES: Final = (LOOP_STUCK,)


@dataclass
class FailureClock:
    """When each failing condition (by name) started, on a monotonic ``clock``.

    ``update(name, error)`` after every change of a condition: the first failure of a
    burst starts it, None (working again) ends it.
    """

    clock: Callable[[], float]
    _since_s: dict[str, float] = field(default_factory=dict)

    def update(self, name: str, error: object | None) -> None:
        if error is None:
            self._since_s.pop(name, None)
        elif name not in self._since_s:
            self._since_s[name] = self.clock()

    def since_s(self, *names: str) -> float | None:
        """The earliest start among ``names`` still failing (None: none is)."""
        starts = [self._since_s[n] for n in names if n in self._since_s]
        return min(starts) if starts else None


@dataclass(frozen=True, slots=True)
class HealthInputs:
    """What the verdict is computed from (the daemon's status, at ``now_s``).

    Every time here (``now_s``, ``started_at_s``, ``last_scrape_s``, ``last_tick_s``,
    the ``*_since_s``) is on one monotonic clock (the daemon's elapsed-time clock),
    never wall time; only differences of them are used.
    """

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
    spool_error_since_s: float | None = None
    store_error_since_s: float | None = None
    # Blind (plugin mode): since when the server has been busy (running requests or
    # generated tokens) with no plugin statistics arriving; None: not blind, or not
    # expected (observe mode, no spool). An idle engine writes none, so idle is not blind.
    busy_without_stats_since_s: float | None = None
    spool_dir: str | None = None
    # Clock skew: how far the server's clock is ahead of the daemon's, as the newest
    # plugin statistics (stamped by the server's clock) show; at or beyond the table
    # TTL every table has expired when the plugin reads it.
    server_clock_ahead_s: float | None = None
    table_ttl_s: float = DEFAULT_TABLE_TTL_S


def _age(now_s: float, since_s: float | None) -> float | None:
    return None if since_s is None else max(0.0, now_s - since_s)


def _lasting(age_s: float | None) -> str:
    return "" if age_s is None else f" (for {age_s:.0f} s)"


def readiness(h: HealthInputs) -> dict[str, object]:
    """``{"ok", "acting", "telemetry", "spool", "store", "plugin_statistics", "clock",
    "reasons": [...], "codes": [...]}`` and the ages: ``telemetry_age_s``,
    ``spool_error_age_s``, ``store_error_age_s`` (None while that check passes or its
    start is unknown) and ``server_clock_ahead_s``."""
    reasons: list[str] = []
    codes: list[str] = []
    acting = h.permanent_error is None
    if not acting:
        reasons.append(f"not acting: {h.permanent_error}")
        codes.append(NOT_ACTING)
    since = h.last_scrape_s if h.last_scrape_s is not None else h.started_at_s
    age_s = h.now_s - since
    telemetry = age_s <= h.telemetry_max_age_s
    if not telemetry:
        what = "no telemetry yet" if h.last_scrape_s is None else "no telemetry"
        cause = f": {h.last_scrape_error}" if h.last_scrape_error else ""
        reasons.append(f"{what} for {age_s:.0f} s (bound {h.telemetry_max_age_s:g} s){cause}")
        codes.append(NO_TELEMETRY_YET if h.last_scrape_s is None else TELEMETRY_STALE)
    spool = h.spool_error is None
    spool_age_s = None if spool else _age(h.now_s, h.spool_error_since_s)
    if not spool:
        reasons.append(f"spool: {h.spool_error}{_lasting(spool_age_s)}")
        codes.append(SPOOL_FAILING)
    store = h.store_error is None
    store_age_s = None if store else _age(h.now_s, h.store_error_since_s)
    if not store:
        reasons.append(f"store: {h.store_error}{_lasting(store_age_s)}")
        codes.append(STORE_UNAVAILABLE)
    blind_s = _age(h.now_s, h.busy_without_stats_since_s)
    plugin_statistics = blind_s is None or blind_s <= h.telemetry_max_age_s
    if not plugin_statistics:
        reasons.append(
            f"blind: the server has been busy for {blind_s:.0f} s (bound "
            f"{h.telemetry_max_age_s:g} s) and no plugin statistics arrived in the spool "
            f"{h.spool_dir}; is the plugin loaded, with SPECGOV_SPOOL_DIR of the server "
            "naming this directory? no table is published until they arrive"
        )
        codes.append(NO_PLUGIN_STATISTICS)
    ahead_s = h.server_clock_ahead_s
    clock = ahead_s is None or ahead_s < h.table_ttl_s
    if not clock:
        reasons.append(
            f"clock skew: the server's clock is {ahead_s:.0f} s ahead of the daemon's "
            f"(from the plugin's statistics), at least the table TTL "
            f"(guardrails.table_ttl_s {h.table_ttl_s:g} s), so every table has expired "
            "when the plugin reads it and SGLang's own controller answers; sync both "
            "clocks (NTP)"
        )
        codes.append(CLOCK_SKEW)
    return {
        "ok": not reasons,
        "acting": acting,
        "telemetry": telemetry,
        "telemetry_age_s": age_s,
        "spool": spool,
        "spool_error_age_s": spool_age_s,
        "store": store,
        "store_error_age_s": store_age_s,
        "plugin_statistics": plugin_statistics,
        "clock": clock,
        "server_clock_ahead_s": ahead_s,
        "reasons": reasons,
        "codes": codes,
    }


def liveness(h: HealthInputs) -> dict[str, object]:
    """``{"ok", "last_tick_age_s", "bound_s", "reasons", "codes"}``: is the decision loop
    ticking."""
    bound_s = max(LIVENESS_MIN_S, LIVENESS_INTERVALS * h.decide_interval_s)
    since = h.last_tick_s if h.last_tick_s is not None else h.started_at_s
    age_s = h.now_s - since
    ok = age_s <= bound_s
    reasons = (
        [] if ok else [f"decision loop has not ticked for {age_s:.0f} s (bound {bound_s:g} s)"]
    )
    codes = [] if ok else [LOOP_STUCK]
    return {
        "ok": ok,
        "last_tick_age_s": age_s,
        "bound_s": bound_s,
        "reasons": reasons,
        "codes": codes,
    }
