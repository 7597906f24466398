"""The specgov daemon: scrape SGLang, decide, publish step tables, explain everything.

Long-lived asyncio tasks, each named: ``scrape`` (telemetry -> Observation),
``decide`` (policy behind guardrails -> Decision, audit log, spool publish),
``control-api`` and ``metrics`` (HTTP servers), ``recommend`` (restart loop,
optional). If one of them dies unexpectedly the daemon shuts down cleanly with a
non-zero exit instead of limping on. SIGTERM/SIGINT finish the current step,
persist and exit within ``shutdown_grace_s``; SIGHUP reloads the configuration
(an invalid one is rejected and the old one kept).

Decisions are pure (``specgov.policies``); the daemon owns every effect: HTTP,
the spool files, the SQLite store, the clock, metrics and logs. ``Daemon`` composes
them from collaborators cut along their seams: ``telemetry.py`` (scrapes, plugin
statistics, the workload window), ``store_gateway.py`` (every store write, the journal
while the store is down, the write-back), ``overrides.py`` (the operator's overrides),
``restart_loop.py`` (restart recommendations and the apply hook) and ``status_view.py``
(the status record and its documents); it keeps the decision, the policy and the loops.

Error handling follows kopf's split: temporary errors (server down, timeouts,
5xx) back off and retry while the last table keeps its TTL (then the plugin falls
back to SGLang's own controller); permanent errors (auth rejected, endpoints
missing, an incompatible shape) stop acting, keep the daemon up and say why.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Mapping
from dataclasses import replace
from typing import Any

from prometheus_client import CollectorRegistry

from specgov.adapters.errors import escape_upstream
from specgov.adapters.log_throttle import MAX_LOGGED_CHARS, LogThrottle
from specgov.adapters.sglang_http import SGLangClient
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
from specgov.controller.daemon.overrides import OperatorOverrides
from specgov.controller.daemon.own_metrics import DaemonMetrics
from specgov.controller.daemon.restart_loop import RestartLoop
from specgov.controller.daemon.server_speed import SIM_SPEED_KEY, sim_speed
from specgov.controller.daemon.state_store import StateStore
from specgov.controller.daemon.status_view import (
    DaemonStatus,
    StatusDocuments,
    override_slots,
    slot_layout,
)
from specgov.controller.daemon.store_errors import StoreUnavailable
from specgov.controller.daemon.store_gateway import SnapshotWrite, StoreGateway, put_override
from specgov.controller.daemon.store_journal import StoreJournal
from specgov.controller.daemon.telemetry import Telemetry
from specgov.policies.common.decisions import RestartRecommendation
from specgov.policies.common.observation import Observation
from specgov.policies.common.step_table import StepTable
from specgov.policies.control.core import (
    AuditRecord,
    ControlCore,
    ControlInputs,
    CoreState,
    Publish,
    control_step,
    policy_builder,
)
from specgov.policies.daemon.estimators.step_cost import StepCostPrior
from specgov.policies.daemon.spec import KNOWN_KINDS, parse_policy_spec
from specgov.policies.guardrails import (
    GuardedPolicy,
    GuardedState,
    Override,
    active_overrides,
)

log = logging.getLogger("specgov.daemon")

MAX_OVERRIDE_TTL_S = 7 * 24 * 3600.0
# Reasons of the audit rows that record an operator's action, not a decision.
OPERATOR_AUDIT_REASONS = ("override_set", "override_superseded", "override_cleared", "policy_set")


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
        self.registry = registry if registry is not None else CollectorRegistry()
        self.metrics = DaemonMetrics(self.registry)
        self.metrics.set_info(policy=config.policy.spec, mode=config.loop.mode)
        self._clock = clock
        self._cpu_clock = cpu_clock
        self._prior = prior
        self._config_loader = config_loader
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
        self._throttle = LogThrottle(log, monotonic, on_suppressed=self.metrics.on_log_suppressed)
        # Health ages on the monotonic clock (controller/daemon/health.py): when the daemon
        # started and last ticked, and when each failing condition started.
        self._started_mono_s = monotonic()
        self._last_tick_mono_s: float | None = None
        self._failing = FailureClock(monotonic)
        self.gateway = StoreGateway(
            store,
            journal if journal is not None else StoreJournal(),
            metrics=self.metrics,
            clock=clock,
            status_info=self.status_info,
            failing=self._failing,
            throttle=self._throttle,
            policy_name=lambda: self.policy_name,
            holdings=self._holdings,
            on_written_back=self._forget_checkpoint,
        )
        self.telemetry = self._make_telemetry(client)
        self._documents = StatusDocuments()
        self._policy_name: tuple[object, str] | None = None
        # The operator's overrides by id: a cache of the store (the truth), re-read at
        # every decision; it carries on alone only while the store is unavailable.
        self.overrides = OperatorOverrides(self.gateway, clock=clock, audit=self._audit_operator)
        # The operator's policy setting (`policy set`, or as restored from the store):
        # held like the overrides, so a file recreated empty gets it back.
        self._policy_setting: str | None = None
        # (time, GuardedState.checkpoint_key) of the last policy-state save by a decision.
        self._checkpoint: tuple[float, tuple[object, ...]] | None = None
        self._background: set[asyncio.Task[None]] = set()
        self.core = self._make_core(config)
        self.gateway.start()
        self.core_state: CoreState = self._restore_state(self._initial_policy_spec())
        self._stop = asyncio.Event()
        self.restart = self._make_restart_loop()
        self.exit_code = 0

    @property
    def store(self) -> StateStore | None:
        return self.gateway.store

    def _make_telemetry(self, client: SGLangClient | None) -> Telemetry:
        return Telemetry(
            lambda: self.config,
            client=client,
            clock=self._clock,
            monotonic=self._monotonic,
            metrics=self.metrics,
            status_info=self.status_info,
            throttle=self._throttle,
            failing=self._failing,
        )

    def _make_restart_loop(self) -> RestartLoop:
        return RestartLoop(
            lambda: self.config,
            telemetry=self.telemetry,
            metrics=self.metrics,
            status_info=self.status_info,
            clock=self._clock,
            snapshot=self.gateway.snapshot,
            stop=self._stop,
            every=self.every,
        )

    # ----------------------------------------------------------------- set-up

    def _initial_policy_spec(self) -> str:
        if self.store is not None:
            try:
                saved = self.store.get_setting("policy_spec")
                if isinstance(saved, str):
                    self._policy_setting = saved
                    return saved
            except StoreUnavailable as exc:
                self.gateway.failed(exc)
        return self.config.policy.spec

    def _make_core(self, config: SpecgovConfig) -> ControlCore:
        return ControlCore(
            policy_builder(prior=self._prior, guardrails=config.guardrail_config()),
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
                self.gateway.failed(exc)
            except ValueError as exc:
                self.status_info.notes.append(f"saved state ignored: {exc}")
                log.warning("saved policy state ignored: %s", exc)
            self.overrides.refresh()
            try:
                data = self.store.last_table()
                table = None if data is None else StepTable.from_dict(data)
            except StoreUnavailable as exc:
                self.gateway.failed(exc)
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

    def _holdings(self) -> Iterator[SnapshotWrite]:
        now = self._clock()
        for oid, override in self.overrides.by_id.items():
            if override.is_active(now):
                yield put_override({"id": oid, **override.to_dict()})
        spec = self._policy_setting
        if spec is not None:
            yield lambda s: s.set_setting("policy_spec", spec)

    def _forget_checkpoint(self) -> None:
        """The store was written back: save the policy state at the next decision."""
        self._checkpoint = None

    # ------------------------------------------------------------- scraping

    def client(self) -> SGLangClient:
        return self.telemetry.client()

    async def scrape_once(self) -> Observation | None:
        """One scrape round; never raises for server trouble (it is recorded)."""
        return await self.telemetry.scrape_once()

    # ------------------------------------------------------------- deciding

    def _inputs(self) -> ControlInputs:
        now = self._clock()
        stats = self.telemetry.take_stats()
        expired = self.overrides.refresh()
        return ControlInputs(
            now_s=now,
            observation=self.telemetry.observation,
            tier_stats=stats,
            overrides=(*self.overrides.by_id.values(), *expired),
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
        self.gateway.snapshot(
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
        speed = sim_speed({"sim_speed": (self.telemetry.server_info or {}).get(SIM_SPEED_KEY)})
        self.metrics.set_predicted(None if predicted is None else predicted * (speed or 1.0))
        accept, running = summary.get("accept_length"), summary.get("running")
        table = record.table_in_force
        if accept is not None and running is not None and table is not None:
            self.metrics.set_accept_lengths({table.slot_for(max(int(running), 1)): accept})

    def _record(self, record: AuditRecord) -> None:
        decide_s = (record.decide_ms or 0.0) / 1e3
        self.metrics.on_decision(record.policy, record.reason, decide_s, record.table_in_force)
        self._export_goodput(record)
        active = active_overrides(tuple(self.overrides.by_id.values()), record.time_s)
        self.metrics.set_override_active(len(active))
        row = record.to_store()
        self.status_info.decisions += 1
        self.status_info.last_decision = row
        self.gateway.persist(row)

    def _audit_operator(self, reason: str, message: str, summary: Mapping[str, Any]) -> None:
        """An operator's action as an audit row of its own (``specgov decisions`` lists
        it): every override set, superseded or cleared, whatever decisions follow."""
        self.gateway.persist(
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

    # ------------------------------------------------ control service (API)

    def status(self) -> dict[str, Any]:
        s = self.status_info
        now = self._clock()
        table = self.core_state.table
        journal = self.gateway.journal
        return {
            "policy": self.policy_name,
            "configured_policy": self.core_state.configured_spec,
            "pinned": self.core_state.policy_spec != self.core_state.configured_spec,
            "mode": self.config.loop.mode,
            "server": self.config.server.url,
            # The specgov simulator's speed (simulated s per wall s) from its /server_info:
            # the CLI gives the wall-clock rates below in simulated time with it. A real
            # SGLang has no such key (None: rates are real).
            "sim_speed": (self.telemetry.server_info or {}).get(SIM_SPEED_KEY),
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
            "store_incidents": list(self.gateway.incidents),
            "spool_error": s.spool_error,
            "spool_read_error": s.spool_read_error,
            "decisions": s.decisions,
            "tables_published": s.tables_published,
            "table": self._documents.table(table),
            "table_age_s": None if table is None else now - table.produced_at_s,
            "slots": self._slot_layout(),
            "last_decision": s.last_decision,
            "overrides": self.list_overrides(),
            "override_slots": self._override_slots(now),
            "observation": self._documents.observation(self.telemetry.observation),
            "recommendation": s.recommendation,
            "health": self.health()["reasons"],
            "server_clock_ahead_s": self.telemetry.server_clock_ahead_s,
            "notes": list(s.notes),
        }

    def decisions(self, since_s: float | None, limit: int) -> list[dict[str, Any]]:
        """Newest first; the rows still in the journal come before the stored ones."""
        return self.gateway.decisions(since_s, limit)

    def list_overrides(self) -> list[dict[str, Any]]:
        return self._documents.overrides(self.overrides.by_id, self._clock())

    def _override_slots(self, now_s: float) -> dict[str, list[int]] | None:
        return override_slots(self._slot_layout(), self.overrides.by_id, now_s)

    def _slot_layout(self) -> list[list[Any]] | None:
        """The engine's slots and their candidate steps, as the daemon knows them."""
        return slot_layout(self.telemetry.observation, self.state.last_candidates)

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
        return self.overrides.add(override)

    def clear_override(self, override_id: str | None, slot: int | None) -> int:
        return self.overrides.clear(override_id, slot)

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
                self.gateway.failed(exc)
                log.warning("policy switch: saved state not used: %s", exc)
            except ValueError as exc:
                log.warning("policy switch: saved state not used: %s", exc)
            self._policy_setting = spec
            self.gateway.snapshot(
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
            last_scrape_s=self.telemetry.last_scrape_mono_s,
            last_scrape_error=s.last_scrape_error,
            permanent_error=s.permanent_error,
            spool_error=spool if self.config.loop.mode == "plugin" else None,
            store_error=s.store_error,
            telemetry_max_age_s=self.telemetry_max_age_s,
            last_tick_s=self._last_tick_mono_s,
            decide_interval_s=self.config.loop.decide_interval_s,
            spool_error_since_s=self._failing.since_s("spool-write", "spool-read"),
            store_error_since_s=self._failing.since_s("store"),
            busy_without_stats_since_s=self.telemetry.busy_without_stats_mono_s if plugin else None,
            spool_dir=None if self.config.spool.dir is None else str(self.config.spool.dir),
            server_clock_ahead_s=self.telemetry.server_clock_ahead_s if plugin else None,
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
        self.metrics.set_health(codes, self.telemetry.server_clock_ahead_s)
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
        return self.restart.document()

    # ------------------------------------------------------------ the loops

    async def every(self, interval_s: float, step: Callable[[], Awaitable[object]]) -> None:
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
        await self.every(self.config.loop.scrape_interval_s, self.scrape_once)

    async def _decide_loop(self) -> None:
        async def step() -> None:
            self._mark_tick()
            self.decide_once()
            self.export_health()

        await self.every(self.config.loop.decide_interval_s, step)

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
            factories["recommend"] = self.restart.run
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
            journal = self.gateway.journal
            if journal.pending:
                log.error(
                    "%s",
                    escape_upstream(
                        f"state store still unavailable at shutdown ({journal.cause}): "
                        f"{len(journal)} audit rows and override changes kept in memory "
                        "are lost",
                        MAX_LOGGED_CHARS,
                    ),
                )
        if self.telemetry.http_client is not None:
            await self.telemetry.http_client.aclose()


class _Effects:
    """The control core's effects, carried out by the daemon (ControlEffects)."""

    def __init__(self, daemon: Daemon) -> None:
        self._daemon = daemon

    def publish(self, publish: Publish) -> bool:
        return self._daemon._publish_table(publish)

    def record(self, record: AuditRecord) -> None:
        self._daemon._record(record)

    def recommend(self, recommendation: RestartRecommendation, record: AuditRecord) -> None:
        data = self._daemon.restart.surface(recommendation, record.time_s)
        if not self._daemon.config.recommend.apply_command:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # decided outside the daemon's loop (a test): no hook
        # The hook is a subprocess: run it beside the loop, never inside the decision.
        task = loop.create_task(self._daemon.restart.maybe_apply(data))
        self._daemon._background.add(task)
        task.add_done_callback(self._daemon._background.discard)
