"""The control core: one decision of the daemon, as a pure step.

The daemon (``controller/daemon/runtime.py``) and closed-loop replay
(``simulator/replay/closed_loop.py``) both drive this module and nothing else decides: what they
differ in is only how the effects are carried out (files, SQLite and HTTP in the daemon; virtual
time in replay).

One decision, in order (:func:`control_step`):

1. :meth:`ControlCore.decide` — ages the latest observation to ``now`` (staleness),
   merges the plugin's tier-statistics windows since the last decision, sets the table
   in force, runs the policy the operator pinned (or the configured one) behind the
   guardrails with the operator's overrides, and says what to publish
   (:class:`Publish`, or why nothing: observe mode, a permanent telemetry error, the
   engine's candidate steps unknown).
2. The executor carries out the publish and reports whether it reached the engine.
3. :meth:`ControlCore.settle` — the guard learns the outcome
   (:func:`~specgov.policies.guardrails.on_publish_result`: a failed write is not a
   change, so the next decision retries it with no dwell or rate-limit charge), the
   table in force advances only on success (or, in observe mode, to what would run),
   and the audit row is built (:class:`AuditRecord`).
4. The executor records the row and hands a restart trigger, if any, to its restart check.

No IO, no clock: time comes in :class:`ControlInputs`, CPU time through an injected timer.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Final, Literal, Protocol

from specgov.policies.common.decisions import (
    Decision,
    Plan,
    ReasonCode,
    RestartTrigger,
    predicted_goodput_tok_s,
)
from specgov.policies.common.observation import Observation
from specgov.policies.common.step_table import StepTable
from specgov.policies.common.types import Budget, PolicyTypeError, TierStat, TierStatsSnapshot
from specgov.policies.daemon.estimators.step_cost import StepCostPrior
from specgov.policies.daemon.protocol import DaemonPolicy
from specgov.policies.daemon.schedules import NonePolicy
from specgov.policies.daemon.spec import build_daemon_policy, parse_policy_spec
from specgov.policies.guardrails import (
    GuardedPolicy,
    GuardedState,
    GuardrailConfig,
    Override,
    on_publish_result,
    pinned_policy,
)

Mode = Literal["plugin", "observe"]
MODES: Final = ("plugin", "observe")

# Why a decision's table was not published (the audit row and status say so).
NOT_PUBLISHED_OBSERVE: Final = "observe mode: the table is what the daemon would run"
NOT_PUBLISHED_NO_CANDIDATES: Final = "engine candidate steps unknown; not publishing"
# The guardrails' freeze codes (in Decision.limited_by when telemetry was unknown/stale).
_FROZEN_CODES: Final = frozenset(
    {ReasonCode.HELD_UNKNOWN_TELEMETRY.value, ReasonCode.HELD_STALE_TELEMETRY.value}
)


# ----------------------------------------------------------------------- tier statistics


def merge_tier_snapshots(snapshots: Sequence[TierStatsSnapshot]) -> TierStatsSnapshot | None:
    """Sum consecutive plugin windows into one (what one decision reads)."""
    if not snapshots:
        return None
    acc: dict[tuple[int, int], list[Any]] = {}
    for snap in snapshots:
        for t in snap.tiers:
            cur = acc.get((t.slot, t.steps))
            if cur is None:
                acc[(t.slot, t.steps)] = [
                    t.verify_calls,
                    t.requests,
                    list(t.accepted_hist),
                    t.step_time_sum_s,
                    t.step_time_count,
                    t.batch_size_sum,
                ]
            else:
                cur[0] += t.verify_calls
                cur[1] += t.requests
                cur[2] = [a + b for a, b in zip(cur[2], t.accepted_hist, strict=True)]
                cur[3] += t.step_time_sum_s
                cur[4] += t.step_time_count
                cur[5] += t.batch_size_sum
    tiers = tuple(
        TierStat(
            slot=slot,
            steps=steps,
            verify_calls=v[0],
            requests=v[1],
            accepted_hist=tuple(v[2]),
            step_time_sum_s=v[3],
            step_time_count=v[4],
            batch_size_sum=v[5],
        )
        for (slot, steps), v in sorted(acc.items())
    )
    return TierStatsSnapshot(
        window_start_s=snapshots[0].window_start_s,
        window_end_s=snapshots[-1].window_end_s,
        tiers=tiers,
    )


# ---------------------------------------------------------------------------- the types


@dataclass(frozen=True, slots=True)
class ControlInputs:
    """Everything one decision sees, gathered by the executor."""

    now_s: float
    # The latest good scrape (None before the first); aged to ``now_s`` by the core.
    observation: Observation | None
    # The plugin's tier-statistics windows that arrived since the last decision.
    tier_stats: tuple[TierStatsSnapshot, ...] = ()
    # The operator's overrides (the store's; inactive ones are ignored).
    overrides: tuple[Override, ...] = ()
    # A permanent telemetry error (auth rejected, endpoints missing): decide, never act.
    blocked: str | None = None


@dataclass(frozen=True, slots=True)
class CoreState:
    """What the core carries from one decision to the next."""

    guard: GuardedState[Any]
    configured_spec: str  # the operator's policy (config / `policy set`)
    policy_spec: str  # the policy running now: the configured one or an operator pin
    # The table in force: the last one that reached the engine (observe mode: would run).
    table: StepTable | None = None
    # Inner states of policies a pin displaced, by spec, to resume when the pin ends.
    parked: tuple[tuple[str, Any], ...] = ()
    # The operator switched the running policy since the last decision.
    switched: bool = False


@dataclass(frozen=True, slots=True)
class Publish:
    """Write ``table`` to the spool, echoing the engine's ``candidates``."""

    table: StepTable
    candidates: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class AuditRecord:
    """One row of the audit log: the one type for it, as the core makes it, replay keeps
    it, and the daemon's store reads it back (with ``id``). Its persisted form is
    :meth:`to_store` (the store's columns, the journal's queued rows), read by
    :meth:`from_store`; the fields after ``published`` but ``id`` are not persisted."""

    time_s: float
    policy: str
    reason: str
    message: str
    limited_by: tuple[str, ...]
    expected_gain: float | None
    inputs_summary: Mapping[str, Any]
    table_before: StepTable | None
    table_after: StepTable | None
    published: bool
    not_published: str | None = None
    # The policy asked for the restart check (its recommendation, if any, comes from there).
    restart_trigger: RestartTrigger | None = None
    decide_ms: float | None = None
    # The table in force once the decision settled (what the engine follows now).
    table_in_force: StepTable | None = None
    # The goodput the policy's model predicts for table_in_force at the current load
    # (None: no model, no load, or no prediction for a busy slot's steps).
    predicted_goodput_tok_s: float | None = None
    # The row's id in the daemon's audit log (None until stored; replay's rows have none).
    id: int | None = None

    @property
    def changed(self) -> bool:
        """The decision moved the steps in force (a re-issue of the same steps is not)."""
        after = self.table_after
        if after is None or not (self.published or self.not_published == NOT_PUBLISHED_OBSERVE):
            return False
        return self.table_before is None or after.slots != self.table_before.slots

    def to_store(self) -> dict[str, Any]:
        """Keyword arguments of ``StateStore.record_decision``."""
        return {
            "time_s": self.time_s,
            "policy": self.policy,
            "reason": self.reason,
            "message": self.message,
            "limited_by": list(self.limited_by),
            "expected_gain": self.expected_gain,
            "inputs_summary": dict(self.inputs_summary),
            "table_before": None if self.table_before is None else self.table_before.to_dict(),
            "table_after": None if self.table_after is None else self.table_after.to_dict(),
            "published": self.published,
            "restart_trigger": None
            if self.restart_trigger is None
            else self.restart_trigger.to_dict(),
        }

    def to_dict(self) -> dict[str, Any]:
        """The row as the control API and ``specgov decisions`` show it: ``id``, then the
        persisted fields."""
        return {"id": self.id, **self.to_store()}

    @classmethod
    def from_store(cls, data: Mapping[str, Any], *, id: int | None = None) -> AuditRecord:
        """The record of a persisted row (:meth:`to_store`'s keys; absent optional ones
        take ``StateStore.record_decision``'s defaults); PolicyTypeError names a bad key."""
        where = "AuditRecord.from_store"

        def key(name: str) -> Any:
            if name not in data:
                raise PolicyTypeError(f"{where}: missing key {name!r}")
            return data[name]

        def decoded(name: str, kind: Callable[[Mapping[str, Any]], Any]) -> Any:
            raw = data.get(name)
            try:
                return None if raw is None else kind(raw)
            except (PolicyTypeError, TypeError) as exc:
                raise PolicyTypeError(f"{where}: key {name!r}: {exc}") from exc

        gain = data.get("expected_gain")
        return cls(
            time_s=float(key("time_s")),
            policy=str(key("policy")),
            reason=str(key("reason")),
            message=str(key("message")),
            limited_by=tuple(str(x) for x in data.get("limited_by", ())),
            expected_gain=None if gain is None else float(gain),
            inputs_summary=dict(data.get("inputs_summary") or {}),
            table_before=decoded("table_before", StepTable.from_dict),
            table_after=decoded("table_after", StepTable.from_dict),
            published=bool(data.get("published", False)),
            restart_trigger=decoded("restart_trigger", RestartTrigger.from_dict),
            id=id,
        )


@dataclass(frozen=True, slots=True)
class PendingStep:
    """A decision made, its effects not yet carried out (see :meth:`ControlCore.settle`)."""

    decision: Decision
    observation: Observation
    publish: Publish | None
    not_published: str | None
    before: CoreState
    after: CoreState
    policy_name: str
    decide_ms: float | None = None


class ControlEffects(Protocol):
    """How an executor carries out a decision's effects."""

    def publish(self, publish: Publish) -> bool:
        """Make the table visible to the engine; True when it got there."""
        ...

    def record(self, record: AuditRecord) -> None: ...

    def trigger_restart_check(self, trigger: RestartTrigger, record: AuditRecord) -> None:
        """The policy asks for the restart check now (the executor decides when it runs)."""
        ...


PolicyBuilder = Callable[[str], GuardedPolicy[Any]]


def policy_builder(
    *, prior: StepCostPrior | None, guardrails: GuardrailConfig | None = None
) -> PolicyBuilder:
    """Spec text -> the guarded policy, as the daemon and replay build it.

    ``sglang-ema`` has no daemon side: it becomes an observe-only policy that never
    publishes, so SGLang's own controller decides.
    """

    def build(spec_text: str) -> GuardedPolicy[Any]:
        spec = parse_policy_spec(spec_text)
        inner: DaemonPolicy[Any] | None = build_daemon_policy(spec, prior=prior)
        if inner is None:
            inner = ObserveOnlyPolicy(NonePolicy(), spec_text)
        return GuardedPolicy(inner, guardrails or GuardrailConfig())

    return build


class ControlCore:
    """One decision of the daemon, pure; see the module docstring."""

    def __init__(self, build_policy: PolicyBuilder, budget: Budget, mode: Mode) -> None:
        if mode not in MODES:
            raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
        self._build = build_policy
        self.budget = budget
        self.mode: Mode = mode
        self._policies: dict[str, GuardedPolicy[Any]] = {}

    def policy(self, spec: str) -> GuardedPolicy[Any]:
        """The guarded policy of ``spec`` (built once; raises ValueError naming the part)."""
        built = self._policies.get(spec)
        if built is None:
            built = self._build(spec)
            self._policies[spec] = built
        return built

    def initial_state(
        self, configured_spec: str, guard: GuardedState[Any] | None = None
    ) -> CoreState:
        """A fresh core state for ``configured_spec``; ``guard`` restores saved bookkeeping."""
        policy = self.policy(configured_spec)
        return CoreState(
            guard=guard if guard is not None else policy.initial_state(),
            configured_spec=configured_spec,
            policy_spec=configured_spec,
            table=None if guard is None else guard.table,
        )

    def configure(self, state: CoreState, spec: str, inner_state: Any = None) -> CoreState:
        """The operator switched the configured policy to ``spec`` (``inner_state``: its
        saved learning, else fresh). The guard's bookkeeping (table, dwell history) stays.
        Under an operator pin the switch takes effect when the pin ends."""
        policy = self.policy(spec)
        pinned = _pin_running(state)
        parked = tuple((s, v) for s, v in state.parked if s != spec)
        if inner_state is not None:
            parked = (*parked, (spec, inner_state))
        state = replace(state, configured_spec=spec, parked=parked)
        if state.policy_spec != spec and not pinned:
            state = self._run(state, spec, fresh=policy.inner.initial_state())
        return state

    # ------------------------------------------------------------------ deciding

    def decide(
        self, state: CoreState, inputs: ControlInputs, timer: Callable[[], float] | None = None
    ) -> PendingStep:
        now = inputs.now_s
        notes: list[str] = []
        pin = pinned_policy(inputs.overrides, now)
        wanted_spec = pin if pin is not None else state.configured_spec
        running = state
        if wanted_spec != state.policy_spec:
            running = self._run(state, wanted_spec)
            if pin is not None:
                notes.append(f"operator pin: running {pin!r} instead of {state.policy_spec!r}")
            else:
                notes.append(f"pin ended: back to {wanted_spec!r}")
        policy = self.policy(running.policy_spec)
        observation = self.observation(running, inputs)
        started = timer() if timer is not None else None
        decision, guard = policy.decide(
            observation,
            running.guard,
            self.budget,
            overrides=inputs.overrides,
            policy_switched=running.switched,
        )
        decide_ms = None if timer is None or started is None else (timer() - started) * 1e3
        if notes:
            decision = replace(decision, message="; ".join([decision.message, *notes]))
        after = replace(running, guard=guard, switched=False)
        publish: Publish | None = None
        why: str | None = None
        if decision.table is not None:
            candidates = _engine_candidates(observation, guard)
            if self.mode == "observe":
                why = NOT_PUBLISHED_OBSERVE
            elif inputs.blocked is not None:
                why = f"not acting: {inputs.blocked}"
            elif not candidates:
                why = NOT_PUBLISHED_NO_CANDIDATES
            else:
                publish = Publish(decision.table, candidates)
        return PendingStep(
            decision=decision,
            observation=observation,
            publish=publish,
            not_published=why,
            before=running,
            after=after,
            policy_name=policy.name,
            decide_ms=decide_ms,
        )

    def observation(self, state: CoreState, inputs: ControlInputs) -> Observation:
        """The latest observation aged to now, with the plugin's windows and the table."""
        now = inputs.now_s
        base = inputs.observation
        stats = merge_tier_snapshots(inputs.tier_stats)
        if base is None:
            return Observation(time_s=now, tier_stats=stats, table=state.table)
        staleness = max(base.staleness_s or 0.0, now - base.time_s)
        return replace(base, time_s=now, staleness_s=staleness, tier_stats=stats, table=state.table)

    def settle(self, step: PendingStep, published: bool | None) -> tuple[AuditRecord, CoreState]:
        """The outcome of the step's publish (None: nothing was to be published)."""
        decision = step.decision
        ok = bool(published)
        would_run = decision.table is not None and step.not_published == NOT_PUBLISHED_OBSERVE
        guard = on_publish_result(step.before.guard, step.after.guard, ok or would_run)
        table = decision.table if (ok or would_run) else step.before.table
        why = step.not_published
        if step.publish is not None and not ok:
            why = "the spool write failed; the next decision retries the change"
        state = replace(step.after, guard=guard, table=table)
        frozen = bool(_FROZEN_CODES & set(decision.limited_by))
        took_effect = not frozen and (decision.table is None or ok or would_run)
        if step.before.switched and not took_effect:
            # The new policy's first table was dropped (frozen telemetry) or never reached
            # the engine: it decides again from where it started, so a policy that only
            # speaks on a change (static, batch-table) is not silenced by the drop.
            start = replace(guard, inner=step.before.guard.inner)
            state = replace(state, guard=start, switched=True)
        record = AuditRecord(
            time_s=step.observation.time_s,
            policy=step.policy_name,
            reason=str(decision.reason),
            message=decision.message if why is None else f"{decision.message}; {why}",
            limited_by=tuple(decision.limited_by),
            expected_gain=decision.expected_gain,
            inputs_summary=inputs_summary(step.observation),
            table_before=step.before.table,
            table_after=decision.table,
            published=ok,
            not_published=why if decision.table is not None else None,
            restart_trigger=decision.restart_trigger,
            decide_ms=step.decide_ms,
            table_in_force=table,
            # Frozen telemetry: the model's numbers are as old as it; predict nothing.
            predicted_goodput_tok_s=None
            if frozen
            else predicted_goodput_tok_s(decision.predictions, table),
        )
        return record, state

    # ------------------------------------------------------------------ internals

    def _run(self, state: CoreState, spec: str, fresh: Any = None) -> CoreState:
        """Make ``spec`` the running policy, parking the current one's inner state."""
        target = self.policy(spec)
        parked = dict(state.parked)
        parked[state.policy_spec] = state.guard.inner
        inner = parked.pop(spec, None)
        if inner is None:
            inner = fresh if fresh is not None else target.inner.initial_state()
        # The last wanted table was the previous policy's: the new one speaks for itself.
        guard = replace(state.guard, inner=inner, inner_name=target.inner.name, wanted=None)
        return replace(
            state, guard=guard, policy_spec=spec, parked=tuple(parked.items()), switched=True
        )


def _pin_running(state: CoreState) -> bool:
    return state.policy_spec != state.configured_spec


def _engine_candidates(observation: Observation, guard: GuardedState[Any]) -> tuple[int, ...]:
    """The engine's candidate steps echoed in the spool file: from live telemetry, else
    the slot layout the guard remembers (e.g. right after a daemon restart)."""
    layout = observation.slot_candidates or guard.last_candidates or ()
    steps = {k for _, ks in layout for k in ks}
    if not steps and observation.shape is not None:
        steps = set(observation.shape.candidate_steps)
    return tuple(sorted(steps))


def control_step(
    core: ControlCore,
    state: CoreState,
    inputs: ControlInputs,
    effects: ControlEffects,
    timer: Callable[[], float] | None = None,
) -> tuple[AuditRecord, CoreState]:
    """One decision with its effects carried out by ``effects``, in the documented order."""
    step = core.decide(state, inputs, timer)
    published = effects.publish(step.publish) if step.publish is not None else None
    record, state = core.settle(step, published)
    effects.record(record)
    if record.restart_trigger is not None:
        effects.trigger_restart_check(record.restart_trigger, record)
    return record, state


# ---------------------------------------------------------------- observe-only policy


class ObserveOnlyPolicy:
    """``sglang-ema`` under the daemon: never publishes, so SGLang's own EMA decides."""

    def __init__(self, inner: DaemonPolicy[Any], name: str) -> None:
        self._inner = inner
        self._name = name

    @property
    def name(self) -> str:
        return self._name

    def initial_state(self) -> Any:
        return self._inner.initial_state()

    def decide(self, observation: Observation, state: Any, budget: Budget) -> tuple[Plan, Any]:
        return (
            Plan(
                slots=None,
                reason=ReasonCode.HELD_NO_CHANGE,
                message="sglang-ema: SGLang's built-in controller decides; nothing published",
                expected_gain=None,
            ),
            state,
        )

    def state_from_dict(self, data: Mapping[str, Any]) -> Any:
        return self._inner.state_from_dict(data)


# -------------------------------------------------------------------- audit summary


def inputs_summary(obs: Observation | None) -> dict[str, Any]:
    """The observation's headline numbers, as the audit row and `specgov status` show."""
    if obs is None:
        return {}

    def finite(x: float | None) -> float | None:
        return None if x is None or not math.isfinite(x) else round(x, 4)

    return {
        "running": obs.running_requests,
        "queued": obs.queued_requests,
        "token_usage": finite(obs.token_usage),
        "gen_throughput_tok_s": finite(obs.gen_throughput_tok_s),
        "accept_length": finite(obs.accept_length),
        "tpot_p50_ms": finite(None if obs.tpot_ms is None else obs.tpot_ms.p50_ms),
        "itl_p99_ms": finite(None if obs.itl_ms is None else obs.itl_ms.p99_ms),
        "spec_num_steps": obs.spec_num_steps,
        # The window's finished requests: with running + queued, its arrivals (the
        # restart check replays the window's load shape from them: arrival_segments).
        "finished_requests": obs.finished_requests,
        "window_s": finite(obs.window_s),
        "staleness_s": finite(obs.staleness_s),
        "tier_windows": None if obs.tier_stats is None else len(obs.tier_stats.tiers),
    }


__all__ = [
    "MODES",
    "AuditRecord",
    "ControlCore",
    "ControlEffects",
    "ControlInputs",
    "CoreState",
    "ObserveOnlyPolicy",
    "PendingStep",
    "Publish",
    "control_step",
    "inputs_summary",
    "merge_tier_snapshots",
    "policy_builder",
]
