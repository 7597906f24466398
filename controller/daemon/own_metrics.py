"""The daemon's own Prometheus metrics, on an injected registry (never the global one).

Two kinds of series:

* **Events**, pushed by the daemon as they happen: ``specgov_decisions_total{policy,
  reason}``, ``specgov_scrape_errors_total{kind}`` and the
  ``specgov_decide_duration_seconds`` histogram (:meth:`DaemonMetrics.on_decision`,
  :meth:`DaemonMetrics.on_scrape_error`); ``specgov_store_failures_total{kind}``,
  ``specgov_spool_failures_total{operation}``,
  ``specgov_telemetry_nonfinite_values_dropped_total``,
  ``specgov_store_journal_dropped_total{kind}``, the ``specgov_store_journal_entries``
  gauge and ``specgov_log_lines_suppressed_total{kind}`` (issue 9 §4); the readiness
  gauges ``specgov_health_failing{code}`` and ``specgov_server_clock_ahead_seconds``
  (issue 23 §3), set after every decision.
* **Derived state**, read at scrape time by a custom collector from one callable that
  returns a :class:`DaemonSnapshot`: ``specgov_table_steps{slot}``,
  ``specgov_table_age_seconds``, ``specgov_accept_length_estimate{slot}``,
  ``specgov_goodput_predicted_tokens_per_second``,
  ``specgov_goodput_observed_tokens_per_second``, ``specgov_override_active`` and
  ``specgov_info{version,policy,mode}``. Reading at scrape time means the table age is
  the age *now*, and nothing can be a stale copy of the daemon's state.

The snapshot callable is injected (``DaemonMetrics(registry, snapshot=daemon.snapshot)``).
Without one, the collector reads what the daemon recorded through
:meth:`~DaemonMetrics.on_decision` (the current table), :meth:`~DaemonMetrics.set_observed`,
:meth:`~DaemonMetrics.set_predicted`, :meth:`~DaemonMetrics.set_accept_lengths`,
:meth:`~DaemonMetrics.set_override_active` and :meth:`~DaemonMetrics.set_info`, with the
table age taken from ``clock`` at scrape time. With one, that callable is the single
source of every derived series and the recorded values are not used.

An unknown value (``None``) is exported as no sample rather than 0, as everywhere in
specgov. A failing snapshot callable never breaks ``/metrics``: the event series are
still served, the derived ones have no samples, the error is logged and counted in
``specgov_metrics_snapshot_errors_total``.

Nothing here may stop the daemon: the ``on_*``/``set_*`` methods ignore (and log) values
they cannot record instead of raising into the control loop.

:func:`metrics_app` serves ``GET /metrics`` from a registry as an aiohttp application,
with prometheus_client's content negotiation (Prometheus text, or OpenMetrics when the
scraper asks for it). The collector runs on the event loop thread, like the daemon's
control loop, so it reads the daemon's state without locks.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from importlib import metadata
from typing import Final

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import (
    GaugeMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector

from specgov.controller.daemon.health import READINESS_CODES
from specgov.policies.common.step_table import StepTable
from specgov.policies.common.validation import is_real

logger = logging.getLogger(__name__)

NAMESPACE: Final = "specgov"
METRICS_PATH: Final = "/metrics"

# CPU seconds of one decision: a table policy takes well under a millisecond, the
# goodput policy with its learned cost model a few tens; seconds would be a bug.
DECIDE_DURATION_BUCKETS_S: Final = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
)
# Kinds the daemon reports (controller/daemon/runtime.py); pre-created at 0 so that rate()
# and increase() see a series before its first error.
DEFAULT_SCRAPE_ERROR_KINDS: Final = ("temporary", "permanent", "format")
# Store failure kinds (controller/daemon/runtime.py): unavailable (full or read-only disk, cannot
# open), corrupt, deleted and replaced (the file under the daemon changed), rejected (a
# queued write the store refused at write-back: dropped, see controller/daemon/store_journal.py).
STORE_FAILURE_KINDS: Final = ("unavailable", "corrupt", "deleted", "replaced", "rejected")
SPOOL_OPERATIONS: Final = ("write", "read")


def _package_version() -> str:
    try:
        return metadata.version("specgov")
    except metadata.PackageNotFoundError:
        return "unknown"


@dataclass(frozen=True, slots=True)
class DaemonSnapshot:
    """The daemon's derived state at one instant, as the metrics collector sees it.

    ``now_s`` must come from the same clock as ``table.produced_at_s``. Keys of
    ``accept_length_by_slot`` are slot lower bounds (as in :class:`StepTable`); values
    are expected accepted tokens per verify step. ``None`` means unknown.
    """

    now_s: float
    table: StepTable | None = None
    accept_length_by_slot: Mapping[int, float] = field(default_factory=dict)
    predicted_goodput_tokens_per_s: float | None = None
    observed_goodput_tokens_per_s: float | None = None
    overrides_active: int = 0
    policy: str = ""
    mode: str = ""


def _finite_or_none(value: object) -> float | None:
    return float(value) if is_real(value) else None


class _DerivedStateCollector(Collector):
    """Builds the derived families from ``snapshot()`` each time the registry is read."""

    def __init__(
        self,
        snapshot: Callable[[], DaemonSnapshot],
        on_error: Callable[[], None],
        version: str,
    ) -> None:
        self._snapshot = snapshot
        self._on_error = on_error
        self._version = version

    @staticmethod
    def _families() -> dict[str, GaugeMetricFamily]:
        return {
            "steps": GaugeMetricFamily(
                f"{NAMESPACE}_table_steps",
                "Draft steps of the current step table per batch-size slot "
                "(slot = the slot's lower bound).",
                labels=["slot"],
            ),
            "age": GaugeMetricFamily(
                f"{NAMESPACE}_table_age_seconds",
                "Seconds since the current step table was produced.",
            ),
            "accept": GaugeMetricFamily(
                f"{NAMESPACE}_accept_length_estimate",
                "Estimated accepted tokens per verify step per batch-size slot.",
                labels=["slot"],
            ),
            "predicted": GaugeMetricFamily(
                f"{NAMESPACE}_goodput_predicted_tokens_per_second",
                "Goodput the policy predicts for the current table, in tokens per second.",
            ),
            "observed": GaugeMetricFamily(
                f"{NAMESPACE}_goodput_observed_tokens_per_second",
                "Goodput measured from the server's telemetry, in tokens per second.",
            ),
            "overrides": GaugeMetricFamily(
                f"{NAMESPACE}_override_active",
                "Number of operator overrides in force (0 when none).",
            ),
        }

    def _info(self, policy: str, mode: str) -> InfoMetricFamily:
        return InfoMetricFamily(
            NAMESPACE,
            "specgov daemon version, current policy and mode.",
            value={"version": self._version, "policy": policy, "mode": mode},
        )

    def describe(self) -> Iterable[Metric]:
        # Names only, so registration detects clashes without calling snapshot(),
        # which may not be ready while the daemon is being constructed.
        families: list[Metric] = list(self._families().values())
        families.append(InfoMetricFamily(NAMESPACE, "specgov daemon version, policy and mode."))
        return families

    def collect(self) -> Iterator[Metric]:
        families = self._families()
        try:
            snap = self._snapshot()
            if not isinstance(snap, DaemonSnapshot):
                raise TypeError(
                    f"snapshot callable returned {type(snap).__name__}, expected DaemonSnapshot"
                )
            self._fill(families, snap)
            info: Metric | None = self._info(snap.policy, snap.mode)
        except Exception:
            logger.exception("own metrics: reading the daemon snapshot failed")
            self._on_error()
            families = self._families()  # drop partial samples
            info = None
        yield from families.values()
        if info is not None:
            yield info

    @staticmethod
    def _fill(families: dict[str, GaugeMetricFamily], snap: DaemonSnapshot) -> None:
        table = snap.table
        if table is not None:
            for bound, steps in table.slots:
                families["steps"].add_metric([str(bound)], float(steps))
            now_s = _finite_or_none(snap.now_s)
            if now_s is not None:
                # Clock steps backwards would give a negative age; 0 is the honest bound.
                families["age"].add_metric([], max(0.0, now_s - table.produced_at_s))
        for bound, length in sorted(snap.accept_length_by_slot.items()):
            value = _finite_or_none(length)
            if value is not None:
                families["accept"].add_metric([str(bound)], value)
        predicted = _finite_or_none(snap.predicted_goodput_tokens_per_s)
        if predicted is not None:
            families["predicted"].add_metric([], predicted)
        observed = _finite_or_none(snap.observed_goodput_tokens_per_s)
        if observed is not None:
            families["observed"].add_metric([], observed)
        families["overrides"].add_metric([], float(snap.overrides_active))


def _labelled_counter(
    registry: CollectorRegistry,
    name: str,
    documentation: str,
    label: str | None = None,
    children: Iterable[str] = (),
) -> Counter:
    """``specgov_<name>``, by *label* when given, with a zero series per *children*
    value (so a dashboard sees 0 before the first event, not no series)."""
    counter = Counter(
        f"{NAMESPACE}_{name}",
        documentation,
        [label] if label is not None else [],
        registry=registry,
    )
    for value in children:
        counter.labels(**{str(label): value})
    return counter


class DaemonMetrics:
    """The daemon's metrics, registered on ``registry``; see the module docstring."""

    def __init__(
        self,
        registry: CollectorRegistry,
        *,
        snapshot: Callable[[], DaemonSnapshot] | None = None,
        clock: Callable[[], float] = time.time,
        scrape_error_kinds: Iterable[str] = DEFAULT_SCRAPE_ERROR_KINDS,
        version: str | None = None,
    ) -> None:
        if not isinstance(registry, CollectorRegistry):
            raise TypeError(
                f"DaemonMetrics.registry: expected a prometheus_client CollectorRegistry, "
                f"got {type(registry).__name__}"
            )
        self.registry = registry
        self._clock = clock
        self._register_event_metrics(registry, scrape_error_kinds)
        self._register_state_metrics(registry)

        # Recorded state: the derived series' source when no snapshot callable is given.
        self._table: StepTable | None = None
        self._accept: dict[int, float] = {}
        self._predicted: float | None = None
        self._observed: float | None = None
        self._overrides = 0
        self._policy = ""
        self._mode = ""

        self._collector = _DerivedStateCollector(
            snapshot if snapshot is not None else self.recorded_snapshot,
            self._snapshot_errors.inc,
            version if version is not None else _package_version(),
        )
        registry.register(self._collector)

    def _register_event_metrics(
        self, registry: CollectorRegistry, scrape_error_kinds: Iterable[str]
    ) -> None:
        """The counters and timings of what the daemon does (decisions, failures, drops),
        registered in the order /metrics lists them."""
        self._decisions = Counter(
            f"{NAMESPACE}_decisions",
            "Decisions made, by policy and reason code.",
            ["policy", "reason"],
            registry=registry,
        )
        self._scrape_errors = _labelled_counter(
            registry,
            "scrape_errors",
            "Failed telemetry scrapes of the SGLang server, by kind "
            "(temporary: retried; permanent: not acting; format: malformed answer).",
            "kind",
            scrape_error_kinds,
        )
        self._decide_duration = Histogram(
            f"{NAMESPACE}_decide_duration_seconds",
            "Time spent computing one decision, in seconds.",
            buckets=DECIDE_DURATION_BUCKETS_S,
            registry=registry,
        )
        self._snapshot_errors = _labelled_counter(
            registry,
            "metrics_snapshot_errors",
            "Scrapes of these metrics during which reading the daemon state failed.",
        )
        self._restart = Gauge(
            f"{NAMESPACE}_restart_recommended_gain_ratio",
            "Predicted relative goodput gain of the restart recommendation in force "
            "(0.1 = +10 %), by who concluded it and the algorithm to restart with; "
            "absent when there is none.",
            ["source", "algorithm", "num_steps"],
            registry=registry,
        )
        self._restart_labels: tuple[str, str, str] | None = None
        self._store_failures = _labelled_counter(
            registry,
            "store_failures",
            "Failed writes or reads of the state database, by kind (unavailable: full or "
            "read-only disk, cannot open; corrupt; deleted or replaced under the daemon; "
            "rejected: a queued write the store refused at write-back, dropped).",
            "kind",
            STORE_FAILURE_KINDS,
        )
        self._spool_failures = _labelled_counter(
            registry,
            "spool_failures",
            "Failed spool operations (write: publishing a step table; read: the plugin's "
            "statistics files).",
            "operation",
            SPOOL_OPERATIONS,
        )
        self._nonfinite = _labelled_counter(
            registry,
            "telemetry_nonfinite_values_dropped",
            "NaN or infinite sample values in the server's /metrics that were dropped "
            "(read as unknown, never as 0).",
        )
        self._journal_entries = Gauge(
            f"{NAMESPACE}_store_journal_entries",
            "Audit rows and override changes waiting in memory for the state database.",
            registry=registry,
        )
        self._journal_dropped = _labelled_counter(
            registry,
            "store_journal_dropped",
            "Writes dropped because the in-memory journal was full while the state "
            "database was unavailable, by kind (decision, override, clear).",
            "kind",
        )
        self._suppressed = _labelled_counter(
            registry,
            "log_lines_suppressed",
            "Repeated warnings not logged (rate-limited per kind), by kind.",
            "kind",
        )

    def _register_state_metrics(self, registry: CollectorRegistry) -> None:
        """The gauges of the daemon's health, after the event metrics."""
        self._health_failing = Gauge(
            f"{NAMESPACE}_health_failing",
            "1 while a readiness check fails, by its reason code (the codes of "
            "/v1/health: no_plugin_statistics = blind, clock_skew = tables expire on "
            "arrival, telemetry_stale, ...), else 0; updated after every decision.",
            ["code"],
            registry=registry,
        )
        for code in READINESS_CODES:
            self._health_failing.labels(code=code).set(0)
        self._clock_ahead = Gauge(
            f"{NAMESPACE}_server_clock_ahead_seconds",
            "How far the server's clock is ahead of the daemon's, from the newest plugin "
            "statistics (stamped by the server's clock, less their delivery delay); at "
            "or beyond guardrails.table_ttl_s every table expires on arrival. No sample "
            "until statistics arrive.",
            ["source"],
            registry=registry,
        )

    # ------------------------------------------------------------------ events

    def on_decision(
        self, policy: str, reason: str, decide_s: float, table: StepTable | None
    ) -> None:
        """One decision: count it, time it; ``table`` is the table now in force (or None)."""
        self._decisions.labels(policy=str(policy), reason=str(reason)).inc()
        if _finite_or_none(decide_s) is not None and decide_s >= 0:
            self._decide_duration.observe(decide_s)
        else:
            logger.warning("own metrics: decide duration %r not recorded", decide_s)
        if table is None or isinstance(table, StepTable):
            self._table = table
        else:
            logger.warning("own metrics: table of type %s ignored", type(table).__name__)
        self._policy = str(policy)

    def on_scrape_error(self, kind: str) -> None:
        """One failed scrape; ``kind`` is a short fixed word (bounded label values)."""
        self._scrape_errors.labels(kind=str(kind)).inc()

    def on_store_failure(self, kind: str) -> None:
        """One failed store call; ``kind`` one of :data:`STORE_FAILURE_KINDS`."""
        self._store_failures.labels(kind=str(kind)).inc()

    def on_spool_failure(self, operation: str) -> None:
        """One failed spool write or read."""
        self._spool_failures.labels(operation=str(operation)).inc()

    def on_nonfinite_dropped(self, count: int) -> None:
        """``count`` NaN/Inf values dropped from one scrape."""
        if count > 0:
            self._nonfinite.inc(count)

    def set_journal(self, entries: int) -> None:
        """Entries waiting in the store journal now."""
        self._journal_entries.set(max(0, int(entries)))

    def on_journal_dropped(self, kind: str, count: int = 1) -> None:
        if count > 0:
            self._journal_dropped.labels(kind=str(kind)).inc(count)

    def on_log_suppressed(self, kind: str) -> None:
        """One warning line not written by the rate limit."""
        self._suppressed.labels(kind=str(kind)).inc()

    # ---------------------------------------------------------- recorded state

    def set_observed(self, tokens_per_s: float | None) -> None:
        """Goodput measured from telemetry (None: unknown)."""
        self._observed = _finite_or_none(tokens_per_s)

    def set_predicted(self, tokens_per_s: float | None) -> None:
        """Goodput the policy expects from the current table (None: unknown)."""
        self._predicted = _finite_or_none(tokens_per_s)

    def set_accept_lengths(self, by_slot: Mapping[int, float]) -> None:
        """Accept-length estimates per slot lower bound; replaces the previous set."""
        accept: dict[int, float] = {}
        for bound, length in by_slot.items():
            value = _finite_or_none(length)
            if isinstance(bound, int) and not isinstance(bound, bool) and value is not None:
                accept[bound] = value
            else:
                logger.warning("own metrics: accept length %r for slot %r ignored", length, bound)
        self._accept = accept

    def set_restart_recommendation(
        self, source: str | None, algorithm: str | None, num_steps: int | None, gain: float | None
    ) -> None:
        """The restart recommendation in force (``source=None``: none)."""
        if self._restart_labels is not None:
            self._restart.remove(*self._restart_labels)
            self._restart_labels = None
        if source is None:
            return
        labels = (str(source), str(algorithm), str(num_steps))
        self._restart.labels(*labels).set(_finite_or_none(gain) or 0.0)
        self._restart_labels = labels

    def set_override_active(self, count: int) -> None:
        """Number of operator overrides in force."""
        self._overrides = max(0, int(count))

    def set_health(self, failing: Iterable[str], server_clock_ahead_s: float | None) -> None:
        """The readiness codes failing now (every other known code goes to 0) and the
        server's clock offset (None: unknown, no sample)."""
        codes = set(failing)
        for code in (*READINESS_CODES, *sorted(codes - set(READINESS_CODES))):
            self._health_failing.labels(code=code).set(1 if code in codes else 0)
        ahead = _finite_or_none(server_clock_ahead_s)
        if ahead is None:
            self._clock_ahead.clear()
        else:
            self._clock_ahead.labels(source="plugin_statistics").set(ahead)

    def set_info(self, *, policy: str, mode: str) -> None:
        """Policy and mode for ``specgov_info`` (policy is also set by on_decision)."""
        self._policy = str(policy)
        self._mode = str(mode)

    def recorded_snapshot(self) -> DaemonSnapshot:
        """The recorded state as a snapshot, aged with ``clock`` now."""
        return DaemonSnapshot(
            now_s=self._clock(),
            table=self._table,
            accept_length_by_slot=dict(self._accept),
            predicted_goodput_tokens_per_s=self._predicted,
            observed_goodput_tokens_per_s=self._observed,
            overrides_active=self._overrides,
            policy=self._policy,
            mode=self._mode,
        )


# --------------------------------------------------------------------- /metrics


def render_metrics(registry: CollectorRegistry, accept: str | None = None) -> tuple[bytes, str]:
    """The registry's exposition for an ``Accept`` header: (body, content type)."""
    encoder, content_type = choose_encoder(accept or "")
    return encoder(registry), content_type


def metrics_app(registry: CollectorRegistry) -> web.Application:
    """An aiohttp application serving ``GET /metrics`` from ``registry``."""

    async def handle_metrics(request: web.Request) -> web.Response:
        body, content_type = render_metrics(registry, request.headers.get("Accept"))
        # content_type carries a charset parameter, which aiohttp's content_type=
        # argument refuses; set the header directly.
        return web.Response(body=body, headers={"Content-Type": content_type})

    app = web.Application()
    app.router.add_get(METRICS_PATH, handle_metrics)
    return app
