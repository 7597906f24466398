"""The specgov daemon: scrape SGLang, decide, publish step tables, explain everything.

Long-lived asyncio tasks, each named: ``scrape`` (telemetry -> Observation),
``decide`` (policy behind guardrails -> Decision, audit log, spool publish),
``control-api`` and ``metrics`` (HTTP servers), ``recommend`` (restart loop,
optional). If one of them dies unexpectedly the daemon shuts down cleanly with a
non-zero exit instead of limping on. SIGTERM/SIGINT finish the current step,
persist and exit within ``shutdown_grace_s``; SIGHUP reloads the configuration
(an invalid one is rejected and the old one kept).

Decisions are pure (``specgov.policies``); this module owns every effect: HTTP,
the spool files, the SQLite store, the clock, metrics and logs.

Error handling follows kopf's split: temporary errors (server down, timeouts,
5xx) back off and retry while the last table keeps its TTL (then the plugin falls
back to SGLang's own controller); permanent errors (auth rejected, endpoints
missing, an incompatible shape) stop acting, keep the daemon up and say why.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import random
import re
import signal
import time
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from specgov.adapters.errors import (
    PermanentScrapeError,
    ResponseFormatError,
    ScrapeError,
    TemporaryScrapeError,
    escape_upstream,
)
from specgov.adapters.log_throttle import MAX_LOGGED_CHARS, LogThrottle
from specgov.adapters.observation_builder import ObservationBuilder
from specgov.adapters.sglang_http import SGLangClient
from specgov.adapters.spool_stats import read_tier_stats
from specgov.adapters.spool_table import read_published_table, write_step_table
from specgov.controller.daemon.config import SpecgovConfig, config_changes
from specgov.controller.daemon.health import (
    CLOCK_SKEW,
    NO_PLUGIN_STATISTICS,
    FailureClock,
    HealthInputs,
    liveness,
    readiness,
)
from specgov.controller.daemon.own_metrics import DaemonMetrics
from specgov.controller.daemon.server_speed import SIM_SPEED_KEY, sim_speed
from specgov.controller.daemon.state_store import (
    StateStore,
    StoreCorrupt,
    StoreReplaced,
    StoreUnavailable,
)
from specgov.controller.daemon.store_journal import (
    PendingWrite,
    StoreJournal,
    WriteBack,
    write_entry,
)
from specgov.policies.common.types import (
    Observation,
    RestartRecommendation,
    StepTable,
    TierStatsSnapshot,
)
from specgov.policies.control.core import (
    AuditRecord,
    ControlCore,
    ControlInputs,
    CoreState,
    Publish,
    control_step,
    inputs_summary,
    policy_builder,
)
from specgov.policies.daemon.estimators.step_cost import StepCostPrior
from specgov.policies.daemon.spec import KNOWN_KINDS, parse_policy_spec
from specgov.policies.guardrails import (
    GuardedPolicy,
    GuardedState,
    GuardrailConfig,
    Override,
    active_overrides,
    slot_winners,
    with_override,
    without_overrides,
)

log = logging.getLogger("specgov.daemon")

MAX_OVERRIDE_TTL_S = 7 * 24 * 3600.0
# A recommendation is handed to the apply command only above this predicted gain.
APPLY_MIN_GAIN = 0.05
SERVER_INFO_REFRESH_S = 30.0
MAX_STORE_INCIDENTS = 10  # kept in the status document
MEMORY_DECISIONS = 1000  # the audit tail kept when there is no store at all
# Wall time and monotonic time between two scrapes differing by more than this is a
# clock step (NTP slews far less; its steps are larger).
CLOCK_STEP_TOLERANCE_S = 1.0
# Reasons of the audit rows that record an operator's action, not a decision.
OPERATOR_AUDIT_REASONS = ("override_set", "override_superseded", "override_cleared", "policy_set")
_NONFINITE = re.compile(r"\b(?:nan|[+-]?inf)\b", re.IGNORECASE)


@dataclass
class DaemonStatus:
    """What `specgov status` shows (JSON-friendly via ``Daemon.status``)."""

    started_at_s: float
    last_scrape_s: float | None = None
    last_scrape_error: str | None = None
    scrape_errors: int = 0
    permanent_error: str | None = None
    last_decision: dict[str, Any] | None = None
    store_error: str | None = None
    decisions: int = 0
    tables_published: int = 0
    spool_error: str | None = None
    spool_read_error: str | None = None
    recommendation: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)


class Daemon:
    """One daemon bound to one SGLang server. Collaborators are injected."""

    def __init__(
        self,
        config: SpecgovConfig,
        *,
        store: StateStore | None,
        registry: CollectorRegistry | None = None,
        client: SGLangClient | None = None,
        clock: Callable[[], float] = time.time,
        cpu_clock: Callable[[], float] = time.process_time,
        prior: StepCostPrior | None = None,
        config_loader: Callable[[], SpecgovConfig] | None = None,
        journal: StoreJournal | None = None,
        telemetry_max_age_s: float | None = None,
        monotonic: Callable[[], float] | None = None,
    ) -> None:
        self.config = config
        self.store = store
        self.registry = registry if registry is not None else CollectorRegistry()
        self.metrics = DaemonMetrics(self.registry)
        self.metrics.set_info(policy=config.policy.spec, mode=config.loop.mode)
        self._clock = clock
        self._cpu_clock = cpu_clock
        self._prior = prior
        self._config_loader = config_loader
        self._client = client
        self.status_info = DaemonStatus(started_at_s=clock())
        # Readiness: telemetry older than this is "unavailable" (loop.telemetry_max_age_s).
        self.telemetry_max_age_s = (
            telemetry_max_age_s
            if telemetry_max_age_s is not None
            else config.loop.telemetry_max_age_s
        )
        # Elapsed time, told apart from wall-clock steps; a test that injects only the
        # wall clock runs on it throughout.
        if monotonic is None:
            monotonic = time.monotonic if clock is time.time else clock
        self._monotonic = monotonic
        self._scrape_clocks: tuple[float, float] | None = None  # (wall, monotonic)
        self._throttle = LogThrottle(log, monotonic, on_suppressed=self.metrics.on_log_suppressed)
        # Health ages on the monotonic clock (controller/daemon/health.py): when the daemon
        # started, last scraped and ticked, and when each failing condition started.
        self._started_mono_s = monotonic()
        self._last_scrape_mono_s: float | None = None
        self._last_tick_mono_s: float | None = None
        self._failing = FailureClock(monotonic)
        self._journal = journal if journal is not None else StoreJournal()
        self._journal.on_rejected = self._store_rejected
        self._store_incidents: deque[dict[str, Any]] = deque(maxlen=MAX_STORE_INCIDENTS)
        # Status parts that cost to build, keyed by the object they were built from.
        self._table_doc: tuple[StepTable, dict[str, Any]] | None = None
        self._observation_doc: tuple[Observation, dict[str, Any]] | None = None
        self._override_docs: dict[str, tuple[Override, dict[str, Any]]] = {}
        # /v1/decisions answers, valid until the next audit row.
        self._decisions_cache: dict[tuple[float | None, int], list[dict[str, Any]]] = {}
        self._policy_name: tuple[object, str] | None = None
        self._builder = ObservationBuilder()
        self._observation: Observation | None = None
        self._stats_cursor: dict[str, int] | None = None
        self._stats_pending: list[TierStatsSnapshot] = []
        # Blind and clock-skew checks (controller/daemon/health.py), on the monotonic clock:
        # since when the server has been busy without plugin statistics arriving, and
        # how far ahead of ours the newest statistics' server clock was.
        self._busy_without_stats_mono_s: float | None = None
        self._server_clock_ahead_s: float | None = None
        self._server_info: dict[str, Any] | None = None
        self._server_info_at: float | None = None
        self._adaptive_config_path: str | None = None
        # (time, requests, prompt tokens, generation tokens) counter totals per scrape,
        # for the restart loop's workload summary.
        # (time, requests, prompt tokens, generated tokens, running, queued) per scrape.
        self._totals: list[tuple[float, float, float, float, int | None, int | None]] = []
        self._memory_decisions: list[dict[str, Any]] = []  # when there is no store at all
        # The operator's overrides by id: a cache of the store (the truth), re-read at
        # every decision; it carries on alone only while the store is unavailable.
        self._overrides: dict[str, Override] = {}
        self._override_seq = 0
        # The operator's policy setting (`policy set`, or as restored from the store):
        # held like the overrides, so a file recreated empty gets it back.
        self._policy_setting: str | None = None
        self._applied: tuple[str, float] | None = None  # (recommendation key, when applied)
        # (time, GuardedState.checkpoint_key) of the last policy-state save by a decision.
        self._checkpoint: tuple[float, tuple[object, ...]] | None = None
        self._background: set[asyncio.Task[None]] = set()
        self.core = self._make_core(config)
        self._start_store()
        self.core_state: CoreState = self._restore_state(self._initial_policy_spec())
        self._stop = asyncio.Event()
        self.exit_code = 0

    # ----------------------------------------------------------------- set-up

    def _start_store(self) -> None:
        """Open the store for this start. A corrupt file raises StoreRefused, a newer or
        foreign one StoreSchemaError (both ValueErrors: the daemon does not start); a
        missing one is created (the store logs a WARNING: empty state)."""
        if self.store is None:
            return
        report = self.store.start()
        if report.error is None:
            return
        self._store_failed(report.error)
        if report.read_only:
            note = (
                f"state database {self.store.path} is read-only: restored what it holds; "
                "writes are kept in memory until it is writable"
            )
        else:
            note = (
                f"state database {self.store.path} unusable at start ({report.error.cause}): "
                "the daemon starts with empty state; writes are kept in memory until it "
                "is usable"
            )
        self.status_info.notes.append(note)
        log.warning("%s", note)

    def _initial_policy_spec(self) -> str:
        if self.store is not None:
            try:
                saved = self.store.get_setting("policy_spec")
                if isinstance(saved, str):
                    self._policy_setting = saved
                    return saved
            except StoreUnavailable as exc:
                self._store_failed(exc)
        return self.config.policy.spec

    def _make_core(self, config: SpecgovConfig) -> ControlCore:
        guard_cfg = GuardrailConfig.from_dict(dict(config.guardrails), where="guardrails")
        return ControlCore(
            policy_builder(prior=self._prior, guardrails=guard_cfg),
            config.budget,
            config.loop.mode,
        )

    @property
    def policy(self) -> GuardedPolicy[Any]:
        """The policy running now (the configured one, or an operator's pin)."""
        return self.core.policy(self.core_state.policy_spec)

    @property
    def policy_name(self) -> str:
        """The running policy's name, computed once per policy object (the goodput
        policy's name renders its parameters: too slow for every status request)."""
        policy = self.policy
        if self._policy_name is None or self._policy_name[0] is not policy:
            self._policy_name = (policy, policy.name)
        return self._policy_name[1]

    @property
    def policy_spec(self) -> str:
        return self.core_state.configured_spec

    @property
    def state(self) -> GuardedState[Any]:
        return self.core_state.guard

    def _restore_state(self, spec: str) -> CoreState:
        """The saved guard state and table of ``spec``, and the overrides — each on its own:
        a policy state that cannot be loaded does not cost the overrides."""
        policy = self.core.policy(spec)
        guard: GuardedState[Any] | None = None
        table: StepTable | None = None
        if self.store is not None:
            try:
                saved = self.store.load_policy_state(policy.name)
                if saved is not None:
                    guard = policy.state_from_dict(saved)
                    log.info("restored learned state of %s", policy.name)
            except StoreUnavailable as exc:
                self._store_failed(exc)
            except ValueError as exc:
                self.status_info.notes.append(f"saved state ignored: {exc}")
                log.warning("saved policy state ignored: %s", exc)
            self._refresh_overrides()
            try:
                data = self.store.last_table()
                table = None if data is None else StepTable.from_dict(data)
            except StoreUnavailable as exc:
                self._store_failed(exc)
            except ValueError as exc:
                log.warning("saved table ignored: %s", exc)
        # A kill between writing a table and recording it leaves the spool a table ahead
        # of the store: the engine may be following it, and the next version must be newer.
        spool = self.config.spool.dir
        published = None
        if spool is not None and self.config.loop.mode == "plugin":  # observe publishes nothing
            published = read_published_table(spool, group_gid=self.config.spool.group)
        if published is not None and (table is None or published.version > table.version):
            log.info(
                "the spool holds table v%d, newer than the store's (v%s): continuing from it",
                published.version,
                "-" if table is None else table.version,
            )
            table = published
        state = self.core.initial_state(spec, guard)
        if table is not None:
            state = replace(state, table=table)
        return state

    def _refresh_overrides(self) -> tuple[Override, ...]:
        """Re-read the overrides from the store (keep the cached ones while it is down);
        returns those that expired since the last read, for the decision to say so."""
        now = self._clock()
        expired = tuple(o for o in self._overrides.values() if not o.is_active(now))
        # Writes waiting in the journal go first: the store's view lacks them.
        if self.store is not None and (not self._journal.pending or self._write_back()):
            try:
                records = self.store.list_overrides(now)
            except StoreUnavailable as exc:
                self._store_failed(exc)
            else:
                self._overrides = {r.id: r.override for r in records}
        self._overrides = {k: o for k, o in self._overrides.items() if o.is_active(now)}
        return expired

    def _store_failed(self, exc: StoreUnavailable) -> None:
        """Report a store failure at once: status, metric, journal; one log line per
        burst (the first failure after the store worked), plus one per incident."""
        kind = _store_failure_kind(exc)
        self.metrics.on_store_failure(kind)
        message = f"state store unavailable, controlling from memory: {exc}"
        if isinstance(exc, StoreReplaced):
            incident = {"time_s": self._clock(), "kind": kind, "message": str(exc)}
            self._store_incidents.append(incident)
            message = f"state store: {exc.detail}; pending writes go back at the next write"
            line = f"state database {exc.path}: {exc.detail}"
            log.error("%s", escape_upstream(line, MAX_LOGGED_CHARS))
        elif self.status_info.store_error is None:
            log.error(
                "%s; audit rows and override changes are kept in memory (at most %d) and "
                "written back when it returns",
                escape_upstream(message, MAX_LOGGED_CHARS),
                self._journal.max_entries,
            )
        self.status_info.store_error = message
        self._failing.update("store", message)
        self._journal.note_down(self._clock(), str(exc))

    def _store_rejected(self, kind: str, exc: Exception) -> None:
        """A queued write the store refused at write-back (not an outage): dropped so the
        rest can go on; counted (metric, status) and logged once per burst."""
        self.metrics.on_store_failure("rejected")
        self._throttle.error(
            "store-rejected",
            f"state store refused a queued {kind} write at write-back "
            f"({type(exc).__name__}: {exc}); dropped it and wrote back the rest",
        )

    def _store_write(self, entry: PendingWrite) -> bool:
        """Persist a decision row or override change, or queue it while the store is
        down (earlier queued writes go first, so the store sees them in order)."""
        store = self.store
        if store is None:
            return False
        if not self._journal.pending or self._write_back():
            try:
                write_entry(store, entry)
            except StoreUnavailable as exc:
                self._store_failed(exc)
            else:
                return True
        before = self._journal.dropped
        self._journal.add(entry)
        for k, n in self._journal.dropped.items():
            self.metrics.on_journal_dropped(k, n - before.get(k, 0))
        self.metrics.set_journal(len(self._journal))
        return False

    def _store_snapshot(self, key: str, write: Callable[[StateStore], object]) -> None:
        """Persist a snapshot-like value (policy state, table, setting); while the store
        is down only the latest per key is kept."""
        store = self.store
        if store is None:
            return
        if not self._journal.pending or self._write_back():
            try:
                write(store)
            except StoreUnavailable as exc:
                self._store_failed(exc)
            else:
                return
        self._journal.keep_latest(key, write)

    def _write_back(self) -> bool:
        """Write the journal back, then what the daemon holds (its overrides, so a file
        recreated empty has them), then the gap as an audit row. True when done."""
        store = self.store
        assert store is not None
        try:
            result = self._journal.write_back(store, extra=self._holdings(), gap_row=self._gap_row)
        except StoreUnavailable as exc:
            self._store_failed(exc)
            self.metrics.set_journal(len(self._journal))
            return False
        self.metrics.set_journal(0)
        # A file recreated or swapped in may hold none of the learned state: saved at
        # this decision, not at the next checkpoint.
        self._checkpoint = None
        self._decisions_cache.clear()
        self.status_info.store_error = None
        self._failing.update("store", None)
        dropped = sum(result.dropped.values())
        log.warning(
            "%s",
            escape_upstream(
                f"state store usable again after {self._clock() - result.down_since_s:.0f} s: "
                f"{result.written} queued writes written back, {dropped} dropped",
                MAX_LOGGED_CHARS,
            ),
        )
        return True

    def _holdings(self) -> Iterator[Callable[[StateStore], object]]:
        now = self._clock()
        for oid, override in self._overrides.items():
            if override.is_active(now):
                yield functools.partial(_put_override, {"id": oid, **override.to_dict()})
        spec = self._policy_setting
        if spec is not None:
            yield lambda s: s.set_setting("policy_spec", spec)

    def _gap_row(self, result: WriteBack) -> dict[str, Any] | None:
        """The audit row recording an outage of the store (None: nothing to record)."""
        incidents = [i for i in self._store_incidents if i["time_s"] >= result.down_since_s]
        dropped = sum(result.dropped.values())
        if not (result.written or dropped or incidents or result.rejected):
            return None
        now = self._clock()
        message = (
            f"state store unavailable for {now - result.down_since_s:.1f} s "
            f"({result.cause}); {result.written} audit rows and override changes kept in "
            "memory and written back"
        )
        if dropped:
            kinds = ", ".join(f"{n} {k}" for k, n in sorted(result.dropped.items()))
            message += (
                f"; {dropped} dropped ({kinds}): the journal holds at most "
                f"{self._journal.max_entries}"
            )
        if result.rejected:
            kinds = ", ".join(f"{n} {k}" for k, n in sorted(result.rejected.items()))
            message += f"; {sum(result.rejected.values())} refused by the store ({kinds})"
        return {
            "time_s": now,
            "policy": self.policy_name,
            "reason": "store_gap",
            "message": message,
            "inputs_summary": {
                "store_down_from_s": result.down_since_s,
                "store_back_at_s": now,
                "written_back": result.written,
                "dropped": dict(result.dropped),
                "rejected": dict(result.rejected),
                "journal_max_entries": self._journal.max_entries,
                "cause": result.cause,
                "incidents": [i["message"] for i in incidents],
            },
        }

    # ------------------------------------------------------------- scraping

    def client(self) -> SGLangClient:
        if self._client is None:
            import os

            key = self.config.server.api_key(os.environ)
            self._client = SGLangClient(
                self.config.server.url,
                rng=random.Random(0x5EC60),
                api_key=key,
                timeout_s=self.config.server.timeout_s,
            )
        return self._client

    async def scrape_once(self) -> Observation | None:
        """One scrape round; never raises for server trouble (it is recorded)."""
        client = self.client()
        now = self._clock()
        self._notice_clock_step(now)
        try:
            scrape = await client.scrape_metrics()
            self.metrics.on_nonfinite_dropped(_nonfinite_dropped(scrape.snapshot))
            info = None
            if self._server_info_at is None or now - self._server_info_at > SERVER_INFO_REFRESH_S:
                info = await client.server_info()
                self._server_info, self._server_info_at = info, now
                self._load_adaptive_config(info)
            try:
                loads = await client.loads()
            except (PermanentScrapeError, ResponseFormatError):
                # Older servers have no /v1/loads, and a body that does not parse (now a
                # temporary "format" error) must not cost the round either: gauges suffice.
                loads = None
            obs = self._builder.feed(now, scrape.snapshot, info, loads)
            self._note_totals(now, scrape.snapshot, obs)
            report = self._builder.last_report
            if report is not None and report.restart_detected:
                # The server restarted: its shape may have changed, and the builder
                # dropped it. Fetch /server_info again on the next scrape, not in 30 s.
                self._server_info_at = None
        except PermanentScrapeError as exc:
            self.status_info.permanent_error = str(exc)
            self.status_info.scrape_errors += 1
            self.metrics.on_scrape_error("permanent")
            self._throttle.error(
                "scrape-permanent", f"permanent telemetry error, not acting: {exc}"
            )
            return None
        except ResponseFormatError as exc:
            # A malformed or truncated body (issue 9): temporary, so the last good table
            # stays alive as in an outage, but counted apart from one. The message is
            # already escaped and bounded (adapters/errors.py).
            self.status_info.last_scrape_error = f"malformed response: {exc}"
            self.status_info.scrape_errors += 1
            self.metrics.on_scrape_error(exc.kind)  # "format"
            self._throttle.warning("scrape-format", f"malformed telemetry (will retry): {exc}")
            return None
        except (TemporaryScrapeError, ScrapeError) as exc:
            self.status_info.last_scrape_error = str(exc)
            self.status_info.scrape_errors += 1
            self.metrics.on_scrape_error("temporary")
            self._throttle.warning("scrape-temporary", f"telemetry unavailable (will retry): {exc}")
            return None
        except ValueError as exc:  # a malformed value past the adapters' own checks
            detail = escape_upstream(exc)
            self.status_info.last_scrape_error = f"malformed response: {detail}"
            self.status_info.scrape_errors += 1
            self.metrics.on_scrape_error("format")
            self._throttle.warning("scrape-format", f"malformed telemetry: {detail}")
            return None
        if self.status_info.last_scrape_error or self.status_info.permanent_error:
            log.info("telemetry available again")
        for kind in ("scrape-permanent", "scrape-temporary", "scrape-format"):
            self._throttle.resolve(kind)
        self.status_info.permanent_error = None
        self.status_info.last_scrape_error = None
        self.status_info.last_scrape_s = now
        self._last_scrape_mono_s = self._monotonic()
        self._observation = obs
        busy = bool(obs.running_requests) or bool(obs.generation_tokens)
        if busy and self._busy_without_stats_mono_s is None:
            self._busy_without_stats_mono_s = self._last_scrape_mono_s
        return obs

    def _notice_clock_step(self, now: float) -> None:
        """A wall-clock step (NTP) since the last scrape, told apart from elapsed time by
        the monotonic clock: a window across it means nothing (backwards the builder
        refuses it; forwards it dilutes every rate by the step), so windows start again."""
        mono = self._monotonic()
        last, self._scrape_clocks = self._scrape_clocks, (now, mono)
        if last is None:
            return
        step_s = (now - last[0]) - (mono - last[1])
        if abs(step_s) <= CLOCK_STEP_TOLERANCE_S:
            return
        self._throttle.warning(
            "clock-step",
            f"wall clock stepped {step_s:+.1f} s since the last scrape; "
            "telemetry windows start again",
        )
        self._builder.reset()
        self._totals.clear()
        self._server_info_at = None  # the builder forgot the server's shape

    def _note_totals(self, now: float, snapshot: Any, obs: Observation | None = None) -> None:
        from specgov.adapters.prometheus_text import counter_by_dp

        def total(name: str) -> float | None:
            per_dp = counter_by_dp(snapshot, name)
            return sum(v.value for v in per_dp.values()) if per_dp else None

        values = (
            total("sglang:num_requests_total"),
            total("sglang:prompt_tokens_total"),
            total("sglang:generation_tokens_total"),
        )
        if any(v is None for v in values):
            return
        req, prompt, gen = (float(v) for v in values if v is not None)
        if self._totals and req < self._totals[-1][1]:
            self._totals.clear()  # counters went down: the server restarted
        running = None if obs is None else obs.running_requests
        queued = None if obs is None else obs.queued_requests
        self._totals.append((now, req, prompt, gen, running, queued))
        horizon = now - max(self.config.recommend.interval_s, 60.0)
        while len(self._totals) > 2 and self._totals[0][0] < horizon:
            self._totals.pop(0)

    def workload_summary(self) -> Any:
        """The recent window for the restart loop (None until two scrapes apart)."""
        from specgov.controller.daemon.recommend import (
            WorkloadSummary,
            busy_steps,
            saturated_concurrency,
        )

        if len(self._totals) < 2:
            return None
        (t0, r0, p0, g0, _, _), (t1, r1, p1, g1, _, _) = self._totals[0], self._totals[-1]
        requests = r1 - r0
        if t1 <= t0 or requests <= 0:
            return None
        obs = self._observation
        table = obs.table.slots if obs is not None and obs.table is not None else None
        steps = obs.spec_num_steps if obs is not None else None
        running = [t[4] for t in self._totals if t[4] is not None]
        if table is not None and running:
            # The accept length is the window's, mostly measured at the busy slot's steps
            # (the gauge is only the last batch's).
            steps = busy_steps(table, sum(running) / len(running))
        return WorkloadSummary(
            window_s=t1 - t0,
            request_rate_rps=requests / (t1 - t0),
            mean_input_tokens=(p1 - p0) / requests,
            mean_output_tokens=(g1 - g0) / requests,
            accept_length=obs.accept_length if obs is not None and steps else None,
            current_steps=steps,
            concurrency=saturated_concurrency([(t[4], t[5]) for t in self._totals]),
            # The table in force is the baseline (what a restart would give up).
            table=table,
        )

    async def recommend_once(self) -> dict[str, Any] | None:
        """Replay the recent workload over candidate shapes (in a thread); surface the best."""
        from specgov.controller.daemon.recommend import (
            RecommendError,
            recommend,
            restart_recommendation,
        )

        workload = self.workload_summary()
        if workload is None:
            return None
        dep = self.config.deployment
        obs = self._observation
        try:
            rec = await asyncio.to_thread(
                recommend,
                workload,
                gpu=dep.gpu,
                model=dep.model,
                drafter=dep.drafter,
                current=obs.shape if obs is not None else None,
                slo_tpot_ms=self.config.budget.slo_tpot_ms,
            )
        except (RecommendError, ValueError) as exc:
            self.status_info.recommendation = {"recommendation": None, "message": str(exc)}
            return None
        if restart_recommendation(rec, drafter=dep.drafter) is None:
            # Silent: a burst (window under SUSTAINED_S) or under RESTART_MIN_GAIN.
            self.status_info.recommendation = {
                "recommendation": None,
                "message": (
                    f"no restart recommended: best {rec.label}, predicted "
                    f"{rec.predicted_gain:+.1%} on {rec.metric} over {rec.current_label} "
                    f"in a {workload.window_s:.0f} s window"
                ),
                "details": rec.to_dict(),
            }
            return None
        data = self.surface_recommendation(rec.structured(), self._clock(), rec.to_dict())
        await self._maybe_apply(data)
        return data

    def surface_recommendation(
        self,
        rec: RestartRecommendation,
        time_s: float,
        details: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """One place for every restart recommendation, from a policy or the restart loop:
        status, store, metric and log; the apply hook runs from here (see _maybe_apply)."""
        from specgov.controller.daemon.recommend import recommendation_document

        data = recommendation_document(rec, time_s, details)
        previous = self.status_info.recommendation or {}
        self.status_info.recommendation = data
        self.metrics.set_restart_recommendation(
            rec.source, rec.shape.algorithm, rec.shape.num_steps, rec.predicted_gain
        )
        self._store_snapshot(
            "setting:recommendation", lambda s: s.set_setting("recommendation", data)
        )
        if previous.get("key") != data["key"]:
            log.info("restart recommendation (%s): %s", rec.source, rec.summary)
        return data

    async def _maybe_apply(self, data: dict[str, Any]) -> None:
        """Run the operator's apply command (an argument list, never a shell string)
        once per recommendation and at most once per recommend.interval_s."""
        argv = self.config.recommend.apply_command
        gain = data.get("predicted_gain")
        if not argv or not isinstance(gain, float) or gain < APPLY_MIN_GAIN:
            return
        now = self._clock()
        if self._applied is not None and (
            self._applied[0] == data["key"]
            or now - self._applied[1] < self.config.recommend.interval_s
        ):
            return
        self._applied = (str(data["key"]), now)
        import json
        import os

        env = {**os.environ, "SPECGOV_RECOMMENDATION": json.dumps(data, default=str)}
        try:
            proc = await asyncio.create_subprocess_exec(*argv, env=env)
            code = await proc.wait()
        except OSError as exc:
            data["applied"] = f"failed to start {argv[0]}: {exc}"
            log.error("%s", data["applied"])
            return
        data["applied"] = f"{argv[0]} exited {code}"
        log.info("recommendation handed to %s (exit %d)", argv[0], code)

    async def _recommend_loop(self) -> None:
        async def step() -> None:
            try:
                await self.recommend_once()
            except Exception as exc:  # a simulator bug must not take the daemon down
                log.exception("restart loop failed: %s", exc)
                self.status_info.recommendation = {
                    "recommendation": None,
                    "message": f"restart loop failed: {type(exc).__name__}: {exc}",
                }

        # Let a window of telemetry accumulate before the first replay.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stop.wait(), timeout=self.config.recommend.interval_s)
        await self._every(self.config.recommend.interval_s, step)

    def _load_adaptive_config(self, info: Mapping[str, Any]) -> None:
        """Read the server's --speculative-adaptive-config file (the slots and candidates
        a table must respect); the daemon runs beside the server and shares its volume."""
        path = info.get("speculative_adaptive_config")
        if not isinstance(path, str) or path == self._adaptive_config_path:
            return
        import json

        try:
            config = json.loads(Path(path).read_text())
            builder = ObservationBuilder(adaptive_config=config)
        except (OSError, ValueError) as exc:
            note = f"cannot use the adaptive config {path}: {exc}"
            if note not in self.status_info.notes:
                self.status_info.notes.append(note)
            self._throttle.warning("adaptive-config", note)
            return
        self._builder = builder
        self._adaptive_config_path = path

    def _read_stats(self) -> None:
        spool = self.config.spool.dir
        if spool is None:
            return
        try:
            batch = read_tier_stats(spool, self._stats_cursor, group_gid=self.config.spool.group)
        except OSError as exc:
            self.status_info.spool_read_error = f"cannot read {spool}: {exc}"
            self._failing.update("spool-read", exc)
            self.metrics.on_spool_failure("read")
            self._throttle.warning(
                "spool-read", f"cannot read the plugin statistics in {spool}: {exc}"
            )
            return
        if self.status_info.spool_read_error is not None:
            log.info("plugin statistics in %s readable again", spool)
            self.status_info.spool_read_error = None
            self._failing.update("spool-read", None)
            self._throttle.resolve("spool-read")
        self._stats_cursor = dict(batch.cursor)
        self._stats_pending.extend(r.snapshot for r in batch.records)
        if batch.records:
            self._busy_without_stats_mono_s = None
            newest_s = max(r.snapshot.window_end_s for r in batch.records)
            # Stamped by the server's clock and read within seconds of being written:
            # how far that clock is ahead of ours, less the delivery delay.
            self._server_clock_ahead_s = newest_s - self._clock()

    # ------------------------------------------------------------- deciding

    def _inputs(self) -> ControlInputs:
        now = self._clock()
        self._read_stats()
        stats, self._stats_pending = tuple(self._stats_pending), []
        expired = self._refresh_overrides()
        return ControlInputs(
            now_s=now,
            observation=self._observation,
            tier_stats=stats,
            overrides=(*self._overrides.values(), *expired),
            blocked=self.status_info.permanent_error,
        )

    def decide_once(self) -> AuditRecord:
        """One decision through the control core; its effects carried out here."""
        before = self.core_state
        record, self.core_state = control_step(
            self.core, self.core_state, self._inputs(), _Effects(self), self._cpu_clock
        )
        if before.policy_spec != self.core_state.policy_spec:
            # A pin started or ended: the outgoing policy's learning up to its last
            # decision now lives only in memory (parked); saved, as set_policy does.
            self._save_policy_state(record.time_s, before)
        self._checkpoint_policy_state(record.time_s)
        return record

    def _checkpoint_policy_state(self, time_s: float) -> None:
        """Save the policy state when what the guard acts on changed, else at most every
        ``state.policy_state_interval_s`` (see GuardedState.checkpoint_key)."""
        key = self.state.checkpoint_key()
        saved = self._checkpoint
        if saved is not None and saved[1] == key:
            age_s = time_s - saved[0]
            if 0.0 <= age_s < self.config.state.policy_state_interval_s:
                return
        self._save_policy_state(time_s)
        self._checkpoint = (time_s, key)

    def _save_policy_state(self, time_s: float, core_state: CoreState | None = None) -> None:
        """Save the guard state of ``core_state``'s running policy (default: the current)."""
        if self.store is None:
            return
        cs = self.core_state if core_state is None else core_state
        name, state = self.core.policy(cs.policy_spec).name, cs.guard.to_dict()
        self._store_snapshot(
            f"policy_state:{name}", lambda s: s.save_policy_state(name, state, time_s)
        )

    # The core's effects, carried out for real (through _Effects).

    def _publish_table(self, publish: Publish) -> bool:
        spool = self.config.spool.dir
        if spool is None:
            self.status_info.spool_error = "plugin mode needs spool.dir"
            self._failing.update("spool-write", self.status_info.spool_error)
            return False
        try:
            # Creates the spool 0700 (02750 with spool.group) and refuses one that
            # others could write (SpoolSecurityError, an OSError naming the fix).
            write_step_table(
                spool,
                publish.table,
                list(publish.candidates),
                group_gid=self.config.spool.group,
            )
        except OSError as exc:
            self.status_info.spool_error = f"cannot write {spool}: {exc}"
            self._failing.update("spool-write", exc)
            self.metrics.on_spool_failure("write")
            self._throttle.error("spool-write", f"cannot publish step table: {exc}")
            return False
        if self.status_info.spool_error is not None:
            log.info("spool %s writable again", spool)
            self._throttle.resolve("spool-write")
        self.status_info.spool_error = None
        self._failing.update("spool-write", None)
        self.status_info.tables_published += 1
        return True

    def _export_goodput(self, record: AuditRecord) -> None:
        """Observed goodput (the engine's generation throughput), the goodput the policy's
        model predicts for the table in force at this decision's load (absent when it
        has none: never a stale number) and the accept length under the running batch's
        slot, for the dashboard and the "below prediction" alert."""
        summary = record.inputs_summary
        self.metrics.set_observed(summary.get("gen_throughput_tok_s"))
        predicted = record.predicted_goodput_tok_s
        # The model is in the server's seconds, the observed rate in the daemon's (wall)
        # seconds: the same on a real SGLang; the simulated server runs `speed` times faster.
        speed = sim_speed({"sim_speed": (self._server_info or {}).get(SIM_SPEED_KEY)})
        self.metrics.set_predicted(None if predicted is None else predicted * (speed or 1.0))
        accept, running = summary.get("accept_length"), summary.get("running")
        table = record.table_in_force
        if accept is not None and running is not None and table is not None:
            self.metrics.set_accept_lengths({table.slot_for(max(int(running), 1)): accept})

    def _record(self, record: AuditRecord) -> None:
        decide_s = (record.decide_ms or 0.0) / 1e3
        self.metrics.on_decision(record.policy, record.reason, decide_s, record.table_in_force)
        self._export_goodput(record)
        active = active_overrides(tuple(self._overrides.values()), record.time_s)
        self.metrics.set_override_active(len(active))
        row = record.to_store()
        self.status_info.decisions += 1
        self.status_info.last_decision = row
        self._persist(row)

    def _audit_operator(self, reason: str, message: str, summary: Mapping[str, Any]) -> None:
        """An operator's action as an audit row of its own (``specgov decisions`` lists
        it): every override set, superseded or cleared, whatever decisions follow."""
        self._persist(
            {
                "time_s": self._clock(),
                "policy": self.policy_name,
                "reason": reason,
                "message": message,
                "limited_by": [],
                "expected_gain": None,
                "inputs_summary": dict(summary),
                "table_before": None,
                "table_after": None,
                "published": False,
                "restart_recommendation": None,
            }
        )

    def _persist(self, record: dict[str, Any]) -> None:
        self._decisions_cache.clear()
        if self.store is None:
            self._memory_decisions.append(record)
            del self._memory_decisions[:-MEMORY_DECISIONS]
            return
        self._store_write(PendingWrite("decision", float(record["time_s"]), record))
        after = record["table_after"]
        if record["published"] and after is not None:
            self._store_snapshot("table", lambda s: s.save_table(after))

    # ------------------------------------------------ control service (API)

    def status(self) -> dict[str, Any]:
        s = self.status_info
        now = self._clock()
        table = self.core_state.table
        journal = self._journal
        return {
            "policy": self.policy_name,
            "configured_policy": self.core_state.configured_spec,
            "pinned": self.core_state.policy_spec != self.core_state.configured_spec,
            "mode": self.config.loop.mode,
            "server": self.config.server.url,
            # The specgov simulator's speed (simulated s per wall s) from its /server_info:
            # the CLI gives the wall-clock rates below in simulated time with it. A real
            # SGLang has no such key (None: rates are real).
            "sim_speed": (self._server_info or {}).get(SIM_SPEED_KEY),
            "uptime_s": now - s.started_at_s,
            "last_scrape_age_s": None if s.last_scrape_s is None else now - s.last_scrape_s,
            "last_scrape_error": s.last_scrape_error,
            "permanent_error": s.permanent_error,
            "scrape_errors": s.scrape_errors,
            "store_error": s.store_error,
            "store_journal": {
                "entries": len(journal),
                "max_entries": journal.max_entries,
                "dropped": journal.dropped,
                "rejected": journal.rejected,
                "down_since_s": journal.down_since_s,
            },
            "store_incidents": list(self._store_incidents),
            "spool_error": s.spool_error,
            "spool_read_error": s.spool_read_error,
            "decisions": s.decisions,
            "tables_published": s.tables_published,
            "table": self._table_document(table),
            "table_age_s": None if table is None else now - table.produced_at_s,
            "slots": self._slot_layout(),
            "last_decision": s.last_decision,
            "overrides": self.list_overrides(),
            "override_slots": self._override_slots(now),
            "observation": self._observation_document(),
            "recommendation": s.recommendation,
            "health": self.health()["reasons"],
            "server_clock_ahead_s": self._server_clock_ahead_s,
            "notes": list(s.notes),
        }

    # Built once per table / observation, not once per status request (issue 9 §5):
    # the documents are plain data, so the same object can be served again.
    def _table_document(self, table: StepTable | None) -> dict[str, Any] | None:
        if table is None:
            return None
        if self._table_doc is None or self._table_doc[0] is not table:
            self._table_doc = (table, table.to_dict())
        return self._table_doc[1]

    def _observation_document(self) -> dict[str, Any] | None:
        obs = self._observation
        if obs is None:
            return None
        if self._observation_doc is None or self._observation_doc[0] is not obs:
            self._observation_doc = (obs, inputs_summary(obs))
        return self._observation_doc[1]

    def decisions(self, since_s: float | None, limit: int) -> list[dict[str, Any]]:
        """Newest first; the rows still in the journal come before the stored ones.
        Answers are cached until the next audit row (the API may ask 100 times a second)."""
        key = (since_s, limit)
        cached = self._decisions_cache.get(key)
        if cached is not None:
            return cached
        if self.store is None:
            rows = [r for r in self._memory_decisions if since_s is None or r["time_s"] >= since_s]
            return rows[-limit:][::-1]
        queued = [
            dict(r)
            for r in reversed(self._journal.decisions())
            if since_s is None or r["time_s"] >= since_s
        ][:limit]
        stored: list[dict[str, Any]] = []
        if len(queued) < limit:
            try:
                records = self.store.decisions(since_s=since_s, limit=limit - len(queued))
                stored = [r.to_dict() for r in records]
            except StoreUnavailable as exc:
                self._store_failed(exc)
                return queued  # not cached: the store may answer next time
        out = queued + stored
        if len(self._decisions_cache) > 64:
            self._decisions_cache.clear()
        self._decisions_cache[key] = out
        return out

    def list_overrides(self) -> list[dict[str, Any]]:
        now = self._clock()
        out = []
        for oid, o in sorted(self._overrides.items(), key=lambda kv: kv[1].created_at_s):
            if o.is_active(now):
                out.append(self._override_doc(oid, o))
        return out

    def _override_slots(self, now_s: float) -> dict[str, list[int]] | None:
        """Override id -> the engine slots it sets now (a slot's own override wins over
        an every-slot one, the guardrails' rule); None while the slots are unknown."""
        layout = self._slot_layout()
        if layout is None:
            return None
        ids = {id(o): oid for oid, o in self._overrides.items()}
        active = active_overrides(tuple(self._overrides.values()), now_s)
        out: dict[str, list[int]] = {}
        for bound, o in slot_winners(active, [b for b, _ in layout]).items():
            out.setdefault(ids[id(o)], []).append(bound)
        return out

    def _override_doc(self, oid: str, override: Override) -> dict[str, Any]:
        # Built once per override object (the load profile, issue 9 §5: Override.to_dict
        # cost a third of the API's own time), not once per status/overrides request;
        # plain data, never mutated, so the same dict can be served again.
        cached = self._override_docs.get(oid)
        if cached is None or cached[0] is not override:
            if len(self._override_docs) > 2 * len(self._overrides) + 16:
                self._override_docs.clear()
            cached = (override, {"id": oid, **override.to_dict()})
            self._override_docs[oid] = cached
        return cached[1]

    def _slot_layout(self) -> list[list[Any]] | None:
        """The engine's slots and their candidate steps, as the daemon knows them."""
        obs = self._observation
        layout = (obs.slot_candidates if obs is not None else None) or self.state.last_candidates
        if not layout:
            return None
        return [[bound, list(steps)] for bound, steps in layout]

    def _check_override_target(self, slot: int | None, steps: int | None) -> None:
        """Refuse a slot the engine lacks or steps outside a slot's candidates, naming
        the valid set (a ValueError: 400 from the API, exit 2 from the CLI)."""
        layout = self._slot_layout()
        if layout is None:
            raise ValueError(
                "the engine's slots are not known yet (no telemetry from the server); "
                "retry once `specgov status` shows slots"
            )
        by_slot = {int(b): [int(k) for k in ks] for b, ks in layout}
        if slot is not None and slot not in by_slot:
            raise ValueError(f"slot {slot} is not an engine slot; valid slots: {sorted(by_slot)}")
        if steps is None:
            return
        targets = [slot] if slot is not None else sorted(by_slot)
        bad = [b for b in targets if steps not in by_slot[b]]
        if bad:
            valid = {b: by_slot[b] for b in bad}
            raise ValueError(
                f"steps {steps} is not a candidate of slot(s) {bad}; candidates: {valid}"
            )

    def set_override(
        self,
        slot: int | None,
        steps: int | None,
        disable: bool,
        pin_policy: str | None,
        ttl_s: float,
        reason: str,
    ) -> dict[str, Any]:
        if not 0 < ttl_s <= MAX_OVERRIDE_TTL_S:
            raise ValueError(f"ttl must be > 0 and <= {MAX_OVERRIDE_TTL_S:.0f} s, got {ttl_s}")
        if pin_policy is not None:
            self.core.policy(pin_policy)  # fail early, naming the bad part
        else:
            self._check_override_target(slot, 0 if disable else steps)
        now = self._clock()
        override = Override(
            slot=slot,
            steps=steps,
            disable_speculation=disable,
            pin_policy=pin_policy,
            created_at_s=now,
            expires_at_s=now + ttl_s,
            reason=reason,
        )
        # The daemon names the override, so it has an id even while the store is down.
        self._override_seq += 1
        override_id = f"ov-{int(now * 1000)}-{self._override_seq}"
        data = {"id": override_id, **override.to_dict()}
        kept = with_override(tuple(self._overrides.values()), override)
        superseded = {k: v for k, v in self._overrides.items() if v not in kept}
        self._overrides = {k: v for k, v in self._overrides.items() if v in kept}
        self._overrides[override_id] = override
        self._store_write(PendingWrite("override", now, data))
        log.info("override set: %s", override.describe())
        self._audit_operator(
            "override_set",
            f"override {override_id} set: {override.describe()}",
            {"override": data, "supersedes": sorted(superseded)},
        )
        for oid, old in superseded.items():
            self._audit_operator(
                "override_superseded",
                f"override {oid} ({old.describe()}) superseded by {override_id}",
                {"override_id": oid, "superseded_by": override_id},
            )
        return data

    def clear_override(self, override_id: str | None, slot: int | None) -> int:
        now = self._clock()
        before = {k: o for k, o in self._overrides.items() if o.is_active(now)}
        if override_id is not None:
            self._overrides.pop(override_id, None)
        else:
            kept = without_overrides(tuple(self._overrides.values()), slot=slot)
            self._overrides = {k: v for k, v in self._overrides.items() if v in kept}
        gone = sorted(set(before) - set(self._overrides))
        cleared = len(gone)
        for oid in gone:
            self._audit_operator(
                "override_cleared",
                f"override {oid} ({before[oid].describe()}) cleared by the operator",
                {"override_id": oid},
            )
        if self.store is None:
            return cleared
        selector: dict[str, Any]
        if override_id is not None:
            selector = {"override_id": override_id}
        elif slot is not None:
            selector = {"slot": slot}
        else:
            selector = {"all": True}
        if override_id is not None and not cleared and not self._journal.pending:
            # Not known here (set by another daemon on this file?): the store decides.
            try:
                cleared = self.store.clear_override(override_id=override_id, now_s=now)
            except StoreUnavailable as exc:
                self._store_failed(exc)
            else:
                if cleared:
                    self._audit_operator(
                        "override_cleared",
                        f"override {override_id} cleared by the operator (found in the store)",
                        {"override_id": override_id},
                    )
                return cleared
        self._store_write(PendingWrite("clear", now, selector))
        return cleared

    def _check_policy_steps(self, spec: str) -> None:
        """`static:K` asks for K steps in every slot, as `override set --steps K` does:
        refused the same way when K is not a candidate of every engine slot (the same
        check and message), once the slots are known."""
        parsed = parse_policy_spec(spec)
        if parsed.kind == "static" and self._slot_layout() is not None:
            steps = parsed.params["steps"]
            assert isinstance(steps, int)  # the spec's schema: an int >= 0
            self._check_override_target(None, steps)

    def set_policy(self, spec: str) -> dict[str, Any]:
        policy = self.core.policy(spec)  # raises ValueError naming the bad part
        self._check_policy_steps(spec)
        # The outgoing policy's learning since its last checkpoint, for a switch back.
        self._save_policy_state(self._clock())
        # Keep the guard bookkeeping (table, dwell history); start the inner policy fresh
        # unless the store has learned state for it.
        inner_state = None
        if self.store is not None:
            try:
                saved = self.store.load_policy_state(policy.name)
                if saved is not None:
                    inner_state = policy.state_from_dict(saved).inner
            except StoreUnavailable as exc:
                self._store_failed(exc)
                log.warning("policy switch: saved state not used: %s", exc)
            except ValueError as exc:
                log.warning("policy switch: saved state not used: %s", exc)
            self._policy_setting = spec
            self._store_snapshot(
                "setting:policy_spec", lambda s: s.set_setting("policy_spec", spec)
            )
        before = self.policy_name
        self.core_state = self.core.configure(self.core_state, spec, inner_state)
        log.info("policy switched to %s", policy.name)
        self._audit_operator(
            "policy_set", f"policy set to {policy.name} (was {before})", {"spec": spec}
        )
        return {"policy": policy.name}

    def policies(self) -> dict[str, Any]:
        return {"current": self.policy_name, "kinds": list(KNOWN_KINDS)}

    def _health_inputs(self) -> HealthInputs:
        s = self.status_info
        spool = s.spool_error or s.spool_read_error
        plugin = self.config.loop.mode == "plugin" and self.config.spool.dir is not None
        return HealthInputs(  # every time on the monotonic clock: a wall step flips nothing
            now_s=self._monotonic(),
            started_at_s=self._started_mono_s,
            last_scrape_s=self._last_scrape_mono_s,
            last_scrape_error=s.last_scrape_error,
            permanent_error=s.permanent_error,
            spool_error=spool if self.config.loop.mode == "plugin" else None,
            store_error=s.store_error,
            telemetry_max_age_s=self.telemetry_max_age_s,
            last_tick_s=self._last_tick_mono_s,
            decide_interval_s=self.config.loop.decide_interval_s,
            spool_error_since_s=self._failing.since_s("spool-write", "spool-read"),
            store_error_since_s=self._failing.since_s("store"),
            busy_without_stats_since_s=self._busy_without_stats_mono_s if plugin else None,
            spool_dir=None if self.config.spool.dir is None else str(self.config.spool.dir),
            server_clock_ahead_s=self._server_clock_ahead_s if plugin else None,
            table_ttl_s=float(self.config.guardrails["table_ttl_s"]),
        )

    def health(self) -> dict[str, Any]:
        """Readiness: ok only with fresh telemetry, a writable spool (plugin mode), a
        usable store and no permanent error; ``reasons`` says what fails."""
        return readiness(self._health_inputs())

    def export_health(self) -> dict[str, Any]:
        """Readiness as metrics (``specgov_health_failing{code}``, the server's clock
        offset) and, for the checks nobody polls for, a throttled log line while they
        fail: blind, clock skew. Run after every decision."""
        verdict = self.health()
        codes = set(verdict["codes"])
        self.metrics.set_health(codes, self._server_clock_ahead_s)
        # (code, throttle kind, how its reason starts: controller/daemon/health.py)
        for code, kind, prefix in (
            (NO_PLUGIN_STATISTICS, "blind", "blind:"),
            (CLOCK_SKEW, "clock-skew", "clock skew:"),
        ):
            if code in codes:
                text = next(r for r in verdict["reasons"] if r.startswith(prefix))
                self._throttle.error(kind, f"not ready: {text}")
            else:
                self._throttle.resolve(kind)
        return verdict

    def liveness(self) -> dict[str, Any]:
        """Liveness: the decision loop ticked recently (see controller/daemon/health.py)."""
        return liveness(self._health_inputs())

    def recommend(self) -> dict[str, Any]:
        return self.status_info.recommendation or {
            "recommendation": None,
            "message": "no recommendation yet (recommend.enabled false or not run yet)",
        }

    # ------------------------------------------------------------ the loops

    async def _every(self, interval_s: float, step: Callable[[], Awaitable[object]]) -> None:
        # Fixed deadlines (start + k * interval), not "interval after the last step
        # ended": a late wake-up on a busy loop then shortens the next wait instead of
        # pushing every later step back. A step that overran skips the missed deadlines.
        deadline = time.monotonic()
        while not self._stop.is_set():
            await step()
            deadline += interval_s
            now = time.monotonic()
            if deadline < now:
                deadline += interval_s * ((now - deadline) // interval_s + 1)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), timeout=deadline - now)

    async def _scrape_loop(self) -> None:
        await self._every(self.config.loop.scrape_interval_s, self.scrape_once)

    async def _decide_loop(self) -> None:
        async def step() -> None:
            self._mark_tick()
            self.decide_once()
            self.export_health()

        await self._every(self.config.loop.decide_interval_s, step)

    def _mark_tick(self) -> None:
        """The decision loop ticked (liveness, on the monotonic clock)."""
        self._last_tick_mono_s = self._monotonic()

    def request_stop(self) -> None:
        self._stop.set()

    def reload(self) -> None:
        """SIGHUP: load the configuration again; keep the old one if the new is invalid."""
        if self._config_loader is None:
            return
        try:
            new = self._config_loader()
            core = self._make_core(new)  # guardrails, Budget and mode take effect
            core.policy(new.policy.spec)  # validate before switching
            if new.policy.spec != self.config.policy.spec:
                self._check_policy_steps(new.policy.spec)
            core.policy(self.core_state.policy_spec)
        except (ValueError, OSError) as exc:
            log.error("config reload rejected, keeping the running config: %s", exc)
            self.status_info.notes.append(f"reload rejected: {exc}")
            return
        old_spec = self.config.policy.spec
        changes = config_changes(self.config, new)
        self.config = new
        self.core = core
        self.metrics.set_info(policy=self.core_state.policy_spec, mode=new.loop.mode)
        if new.policy.spec != old_spec:
            self.set_policy(new.policy.spec)
        for change in changes:
            log.info("configuration reloaded: %s", change)
        if not changes:
            log.info("configuration reloaded: no setting changed")

    async def run(
        self,
        extra_tasks: Mapping[str, Callable[[], Coroutine[Any, Any, None]]] | None = None,
        *,
        install_signals: bool = True,
        shutdown_grace_s: float = 10.0,
    ) -> int:
        """Run until stopped; return the exit code (0 clean, 1 a task died)."""
        loop = asyncio.get_running_loop()
        if install_signals:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self.request_stop)
            loop.add_signal_handler(signal.SIGHUP, self.reload)
        factories: dict[str, Callable[[], Coroutine[Any, Any, None]]] = {
            "scrape": self._scrape_loop,
            "decide": self._decide_loop,
            **(extra_tasks or {}),
        }
        if self.config.recommend.enabled:
            factories["recommend"] = self._recommend_loop
        tasks: dict[asyncio.Task[Any], str] = {
            asyncio.create_task(f(), name=name): name for name, f in factories.items()
        }
        stopper: asyncio.Task[Any] = asyncio.create_task(self._stop.wait(), name="stop")
        done, _ = await asyncio.wait([*tasks, stopper], return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            if task is stopper:
                continue
            if self._stop.is_set() and not task.cancelled() and task.exception() is None:
                continue  # a loop that returned because a stop was requested: clean
            name = tasks[task]
            exc = task.exception() if not task.cancelled() else None
            log.error("task %r ended unexpectedly (%s); shutting down", name, exc or "returned")
            self.exit_code = 1
        self._stop.set()
        pending = [t for t in tasks if not t.done()]
        if pending:
            _, still = await asyncio.wait(pending, timeout=shutdown_grace_s)
            for task in still:
                task.cancel()
            await asyncio.gather(*still, return_exceptions=True)
        stopper.cancel()
        await self.close()
        if install_signals:
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                loop.remove_signal_handler(sig)
        return self.exit_code

    async def close(self) -> None:
        if self.store is not None:
            self._save_policy_state(self._clock())
            if self._journal.pending:
                log.error(
                    "%s",
                    escape_upstream(
                        f"state store still unavailable at shutdown ({self._journal.cause}): "
                        f"{len(self._journal)} audit rows and override changes kept in memory "
                        "are lost",
                        MAX_LOGGED_CHARS,
                    ),
                )
        if self._client is not None:
            await self._client.aclose()


class _Effects:
    """The control core's effects, carried out by the daemon (ControlEffects)."""

    def __init__(self, daemon: Daemon) -> None:
        self._daemon = daemon

    def publish(self, publish: Publish) -> bool:
        return self._daemon._publish_table(publish)

    def record(self, record: AuditRecord) -> None:
        self._daemon._record(record)

    def recommend(self, recommendation: RestartRecommendation, record: AuditRecord) -> None:
        data = self._daemon.surface_recommendation(recommendation, record.time_s)
        if not self._daemon.config.recommend.apply_command:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # decided outside the daemon's loop (a test): no hook
        # The hook is a subprocess: run it beside the loop, never inside the decision.
        task = loop.create_task(self._daemon._maybe_apply(data))
        self._daemon._background.add(task)
        task.add_done_callback(self._daemon._background.discard)


def _store_failure_kind(exc: StoreUnavailable) -> str:
    if isinstance(exc, StoreReplaced):
        return "deleted" if exc.deleted else "replaced"
    if isinstance(exc, StoreCorrupt):
        return "corrupt"
    return "unavailable"


def _nonfinite_dropped(snapshot: Any) -> int:
    """NaN/Inf sample values the parser dropped from one scrape (its ``unknown`` list
    names the value in each reason; negative counters are dropped too but are finite)."""
    unknown = getattr(snapshot, "unknown", ())
    return sum(1 for u in unknown if _NONFINITE.search(str(getattr(u, "reason", ""))))


def _put_override(data: Mapping[str, Any], store: StateStore) -> object:
    return store.put_override(data)
