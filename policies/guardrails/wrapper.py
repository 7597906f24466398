"""GuardedPolicy: the inner policy behind the steps, the commit of a decision, and
:func:`on_publish_result` (the guard learns whether a publish reached the engine)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Generic

from specgov.policies.common.decisions import Decision, Plan, ReasonCode
from specgov.policies.common.observation import Observation
from specgov.policies.common.step_table import SlotRule, StepTable
from specgov.policies.common.types import Budget
from specgov.policies.daemon.protocol import DaemonPolicy
from specgov.policies.guardrails._common import (
    CHANGE_CODES,
    Candidates,
    GuardrailError,
    S,
    Slots,
)
from specgov.policies.guardrails.config import (
    GuardrailConfig,
)
from specgov.policies.guardrails.overrides import (
    Override,
    active_overrides,
)
from specgov.policies.guardrails.state import (
    ChangeTrial,
    GuardedState,
    SlotHistory,
    Wanted,
    WindowAggregate,
    WindowSample,
)
from specgov.policies.guardrails.steps import (
    GUARD_STEPS,
    GuardContext,
    Proposal,
    clamp_all,
    engine_layout,
    fmt,
    fmt_moves,
    telemetry_problem,
)

# ---------------------------------------------------------------------- the wrapper


def _next_version(state: GuardedState[Any], observation: Observation) -> int:
    seen = [state.last_version]
    seen += [t.version for t in (state.table, observation.table) if t is not None]
    return max(seen) + 1


def _keepalive_due(table: StepTable, now_s: float, config: GuardrailConfig) -> bool:
    age = now_s - table.produced_at_s
    return age < 0 or age >= table.ttl_s * config.keepalive_fraction


class GuardedPolicy(Generic[S]):
    """``inner`` behind the guardrails (module docstring): takes the inner policy's
    :class:`Plan` and alone makes the published :class:`StepTable` from it (version, TTL
    ``config.table_ttl_s``, keep-alives)."""

    __slots__ = ("_config", "_inner")

    def __init__(self, inner: DaemonPolicy[S], config: GuardrailConfig | None = None) -> None:
        if config is not None and not isinstance(config, GuardrailConfig):
            raise GuardrailError(
                f"GuardedPolicy.config: expected a GuardrailConfig, got {config!r}"
            )
        self._inner = inner
        self._config = config or GuardrailConfig()

    @property
    def name(self) -> str:
        return self._inner.name

    @property
    def inner(self) -> DaemonPolicy[S]:
        return self._inner

    @property
    def config(self) -> GuardrailConfig:
        return self._config

    def initial_state(self) -> GuardedState[S]:
        return GuardedState(inner=self._inner.initial_state(), inner_name=self._inner.name)

    def state_from_dict(self, data: Mapping[str, Any]) -> GuardedState[S]:
        state = GuardedState.from_dict(data, self._inner.state_from_dict)
        if state.inner_name != self._inner.name:
            raise GuardrailError(
                f"GuardedState.from_dict: key 'inner_name': state of policy "
                f"{state.inner_name!r}, expected {self._inner.name!r}"
            )
        return state

    def decide(
        self,
        observation: Observation,
        state: GuardedState[S],
        budget: Budget,
        overrides: Sequence[Override] = (),
        policy_switched: bool = False,
    ) -> tuple[Decision, GuardedState[S]]:
        """One guarded decision; ``overrides`` are the operator's (inactive ones ignored);
        ``policy_switched``: the operator just switched to this policy (its table is taken
        without tolerance band, dwell or rate limit, as when an override ends).

        The returned state assumes a published table reaches the engine; when it does
        not, :func:`on_publish_result` takes the change back.
        """
        inner_plan, inner_state = self._inner.decide(
            policy_view(observation, state), state.inner, budget
        )
        cands = engine_layout(observation.slot_candidates) or state.last_candidates
        st: GuardedState[Any] = replace(state, inner=inner_state, last_candidates=cands)
        current: Slots | None = None
        layout_note = ""
        if st.table is not None:
            bounds = tuple(b for b, _ in st.table.slots)
            if cands is None or bounds == tuple(b for b, _ in cands):
                current = st.table.slots
            else:
                layout_note = f"engine slots changed from {list(bounds)} to {[b for b, _ in cands]}"
        # Stored at commit unless frozen: a table made from unknown telemetry is dropped.
        wanted = _wanted(inner_plan, st.wanted, cands)
        active = active_overrides(overrides, observation.time_s)
        expired = tuple(o for o in overrides if not o.is_active(observation.time_s))
        ctx = GuardContext(
            observation,
            budget,
            inner_plan,
            cands,
            current,
            wanted,
            active,
            policy_switched,
            expired,
        )
        p = Proposal(steps=current)
        if layout_note:
            p = p.note(layout_note)
        if wanted is not None and telemetry_problem(observation, self._config) is None:
            # Clamped up front too, so steps 3-5 judge the changes that would really happen.
            steps, limits, texts, _ = clamp_all(ctx, wanted.steps, frozenset())
            p = replace(p, steps=steps, limited_by=tuple(limits))
            if texts:
                p = p.note("policy table clamped: " + "; ".join(texts))
        for _, step in GUARD_STEPS:
            p, st = step(ctx, p, st, self._config)
        decision, st = _commit(ctx, p, st, self._config, self._inner.name)
        return decision, st


def policy_view(observation: Observation, state: GuardedState[Any]) -> Observation:
    """``observation`` as the inner policy would see it without the operator: the slots a
    step override set in the table in force show the policy's own wanted step and rule.

    An override is the operator's, not evidence: a policy that keeps the step in force
    near a tie (hysteresis, a rule's incumbent) would otherwise keep the override's step
    after a clear, a step it never chose (a 0-step slot would then wait for the
    engine's probes to bring it back). The engine's statistics are left as they are:
    what ran under the override is real cost evidence.
    """
    table, wanted = observation.table, state.wanted
    held = set(state.override_slots)
    if table is None or wanted is None or not held:
        return observation
    if [b for b, _ in table.slots] != [b for b, _ in wanted.steps]:
        return observation  # another layout: the override's slots are not these
    own_steps, own_rules = dict(wanted.steps), dict(wanted.rules)
    slots = tuple((b, own_steps[b] if b in held else k) for b, k in table.slots)
    rules = {b: r for b, r in table.rules if b not in held}
    rules.update((b, r) for b, r in own_rules.items() if b in held)
    view = replace(table, slots=slots, rules=tuple(sorted(rules.items())))
    return replace(observation, table=view)


def on_publish_result(before: GuardedState[S], after: GuardedState[S], ok: bool) -> GuardedState[S]:
    """The guard learns whether the table of the decision that took ``before`` to
    ``after`` reached the engine.

    On success ``after`` stands. On failure the change never happened for the engine:
    the table in force, when it took effect, the slots' change history (dwell, flap
    penalty), the rate-limit window and the rollback trial go back to ``before``, so the
    next decision retries the same change at once with nothing charged for it. What the
    decision learned (inner policy state, telemetry samples, the policy's wanted table)
    is kept, and the version counter never goes back (a version is never reused).
    """
    if ok or after.table is before.table:
        return after
    return replace(
        after,
        table=before.table,
        table_since_s=before.table_since_s,
        slots=before.slots,
        change_times_s=before.change_times_s,
        trial=before.trial,
        blocks=before.blocks,
    )


def _wanted(plan: Plan, previous: Wanted | None, cands: Candidates | None) -> Wanted | None:
    """The inner policy's plan on the engine's slots; a hold stands by its last one."""
    if cands is None:
        return previous
    bounds = [b for b, _ in cands]
    if plan.slots is None:
        if previous is not None and [b for b, _ in previous.steps] == bounds:
            return previous
        return None
    steps = tuple((b, plan.steps_for(b)) for b in bounds)
    rules = tuple((b, r) for b in bounds if (r := plan.rule_for(b)) is not None)
    gain = plan.expected_gain
    trials = set(plan.experiment_slots)
    experiments = frozenset(b for b in bounds if plan.slot_for(b) in trials)
    if previous is not None and previous.steps == steps and gain is None and not experiments:
        # A re-issue of the same table carries no prediction; keep the one it came with.
        gain = previous.expected_gain
        experiments = previous.experiment_slots
    return Wanted(
        steps=steps,
        expected_gain=gain,
        reason=plan.reason,
        experiment_slots=experiments,
        rules=rules,
    )


def _published_rules(
    ctx: GuardContext, p: Proposal, steps: Slots
) -> tuple[tuple[int, SlotRule], ...]:
    """The policy's rules for the slots whose published step the rule can produce.

    A slot an override, a rollback or a clamp set keeps that step (no rule); so does one
    whose rule names a step the engine did not build for the slot or the budget forbids.
    """
    wanted = ctx.wanted
    if wanted is None or not wanted.rules or ctx.candidates is None:
        return ()
    fixed = p.override_slots | p.rolled_back_slots | p.forced_slots
    built = dict(ctx.candidates)
    allowed = ctx.budget.allowed_steps
    by_bound = dict(wanted.rules)
    rules = []
    for b, k in steps:
        rule = by_bound.get(b)
        if rule is None or b in fixed or k not in rule.steps:
            continue
        if all(s in built.get(b, ()) and (allowed is None or s in allowed) for s in rule.steps):
            rules.append((b, rule))
    return tuple(rules)


@dataclass(frozen=True, slots=True)
class _Change:
    """What a proposal would change for the engine (:func:`_change`)."""

    publishable: bool  # steps for exactly the engine's candidate slots
    initial: bool  # the first table
    moves: dict[int, tuple[int, int]]  # slot -> (steps in force, proposed steps)
    keepalive: bool  # an unchanged table re-issued before its TTL runs out
    rules: tuple[tuple[int, SlotRule], ...]  # the live-acceptance rules to publish
    rules_moved: bool  # new cuts: a change for the engine

    @property
    def publish(self) -> bool:
        return self.publishable and (
            self.initial or bool(self.moves) or self.keepalive or self.rules_moved
        )


def _change(
    ctx: GuardContext, p: Proposal, state: GuardedState[Any], config: GuardrailConfig
) -> _Change:
    """Compare the proposal with the table in force: what publishing it would change."""
    now = ctx.now_s
    cur = ctx.current
    steps = p.steps
    publishable = (
        steps is not None
        and ctx.candidates is not None
        and [b for b, _ in steps] == [b for b, _ in ctx.candidates]
    )
    initial = cur is None and publishable
    moves: dict[int, tuple[int, int]] = {}
    if cur is not None and steps is not None:
        before = dict(cur)
        moves = {b: (before[b], k) for b, k in steps if before.get(b) != k}
    keepalive = False
    if publishable and not initial and not moves and state.table is not None:
        fresh_enough = (
            state.last_fresh_s is not None and now - state.last_fresh_s <= config.frozen_keepalive_s
        )
        allowed = not p.frozen or bool(p.override_slots) or fresh_enough
        keepalive = allowed and _keepalive_due(state.table, now, config)
        if keepalive and p.frozen and not p.override_slots:
            assert steps is not None
            keepalive = clamp_all(ctx, steps, frozenset())[0] == steps
    rules: tuple[tuple[int, SlotRule], ...] = ()
    rules_moved = False
    if publishable:
        assert steps is not None
        rules = _published_rules(ctx, p, steps)
        in_force = () if state.table is None else state.table.rules
        # New cuts are a change for the engine; a new prior alone waits for a keepalive.
        rules_moved = not p.frozen and [(b, r.thresholds, r.steps) for b, r in rules] != [
            (b, r.thresholds, r.steps) for b, r in in_force
        ]
    return _Change(publishable, initial, moves, keepalive, rules, rules_moved)


def _headline(change: _Change, version: int, steps: Slots, gain: float | None) -> str:
    """The first sentence of a published decision's message."""
    if change.initial:
        return f"published initial table v{version} {fmt(steps)}"
    if change.moves:
        headline = f"published v{version}: {fmt_moves(change.moves)}"
        if gain is not None:
            headline += f" (expected gain {gain:+.1%})"
        return headline
    if change.rules_moved:
        return f"published v{version}: live-acceptance rules moved"
    return f"re-issued unchanged table as v{version} before its TTL runs out"


def _commit(
    ctx: GuardContext,
    p: Proposal,
    state: GuardedState[Any],
    config: GuardrailConfig,
    inner_name: str,
) -> tuple[Decision, GuardedState[Any]]:
    """Publish (or not) the proposal and update the bookkeeping."""
    change = _change(ctx, p, state, config)
    initial, moves = change.initial, change.moves
    skip = p.override_slots | p.release_slots | p.rolled_back_slots | p.forced_slots
    policy_moves = {b: m for b, m in moves.items() if b not in skip}
    gain = ctx.wanted.expected_gain if ctx.wanted is not None and policy_moves else None
    reason = _reason(ctx, p, initial, moves, policy_moves)
    table: StepTable | None = None
    notes = list(p.notes)
    if change.publish:
        steps = p.steps
        assert steps is not None
        version = _next_version(state, ctx.observation)
        table = StepTable(
            slots=steps,
            version=version,
            produced_at_s=ctx.now_s,
            ttl_s=config.table_ttl_s,
            reason=reason.value,
            rules=change.rules,
        )
        headline = _headline(change, version, steps, gain)
        state = replace(state, table=table, last_version=version)
        if initial or moves:
            state, trial_note = _record_change(
                state, ctx, steps, moves, policy_moves, initial, p, config, version
            )
            if trial_note:
                notes.append(trial_note)
    elif state.table is not None:
        headline = f"table v{state.table.version} {fmt(state.table.slots)} unchanged"
    else:
        headline = "no table published yet"
    if not p.frozen:
        state = replace(state, wanted=ctx.wanted)
    if ctx.inner_plan.message:
        notes.append(
            f"policy {inner_name}: {ctx.inner_plan.reason.value}: {ctx.inner_plan.message}"
        )
    limited = tuple(dict.fromkeys((*ctx.inner_plan.limited_by, *p.limited_by)))
    decision = Decision(
        table=table,
        reason=reason,
        message="; ".join([headline, *notes]),
        expected_gain=gain,
        limited_by=limited,
        restart_recommendation=ctx.inner_plan.restart_recommendation,
        predictions=ctx.inner_plan.predictions,
    )
    return decision, state


def _reason(
    ctx: GuardContext,
    p: Proposal,
    initial: bool,
    moves: Mapping[int, tuple[int, int]],
    policy_moves: Mapping[int, tuple[int, int]],
) -> ReasonCode:
    if initial:
        return ReasonCode.INITIAL
    if p.rolled_back_slots:
        return ReasonCode.ROLLED_BACK_REGRESSION
    if p.override_slots:
        return ReasonCode.OVERRIDE_ACTIVE
    if p.frozen is not None:
        return p.frozen
    if policy_moves or set(moves) & p.release_slots:
        if ctx.wanted is not None and ctx.wanted.reason in CHANGE_CODES:
            return ctx.wanted.reason
        return ReasonCode.CHANGED_PREDICTED_GAIN
    if moves:
        if ReasonCode.LIMITED_BY_BUDGET.value in p.limited_by:
            return ReasonCode.LIMITED_BY_BUDGET
        return ReasonCode.LIMITED_BY_CANDIDATES
    if p.held_by is not None:
        return p.held_by
    return ReasonCode.HELD_NO_CHANGE


def _record_change(
    state: GuardedState[Any],
    ctx: GuardContext,
    steps: Slots,
    moves: Mapping[int, tuple[int, int]],
    policy_moves: Mapping[int, tuple[int, int]],
    initial: bool,
    p: Proposal,
    config: GuardrailConfig,
    version: int,
) -> tuple[GuardedState[Any], str]:
    now = ctx.now_s
    since = state.table_since_s
    if initial:
        histories = tuple(
            SlotHistory(slot=b, changed_at_s=now, previous_steps=None) for b, _ in steps
        )
        return replace(state, slots=histories, table_since_s=now, trial=None), ""
    damped = set(policy_moves) | set(p.rolled_back_slots)
    histories_list: list[SlotHistory] = []
    for b, _ in steps:
        hist = state.history(b)
        if b not in moves:
            if hist is not None:
                histories_list.append(hist)
            continue
        before, after = moves[b]
        penalty = 0.0 if hist is None else hist.penalty_at(now, config.flap_half_life_s)
        if b in damped and hist is not None and hist.previous_steps == after:
            penalty += 1.0  # a reversal A->B->A: the slot is flapping
        histories_list.append(
            SlotHistory(slot=b, changed_at_s=now, previous_steps=before, flap_penalty=penalty)
        )
    times = tuple(t for t in state.change_times_s if t > now - config.rate_window_s) + (now,)
    state = replace(state, slots=tuple(histories_list), change_times_s=times, table_since_s=now)
    only_policy = bool(policy_moves) and len(policy_moves) == len(moves)
    if not (config.rollback_enabled and only_policy and state.trial is None):
        return state, ""
    baseline = _baseline(state.samples, since, config)
    if (
        baseline.seconds < config.rollback_window_s / 2
        or baseline.tokens < config.rollback_min_tokens
    ):
        return state, f"v{version} not checked for rollback: too little data before it"
    trial = ChangeTrial(
        version=version,
        started_at_s=now,
        changes=tuple((b, m[0], m[1]) for b, m in sorted(policy_moves.items())),
        baseline=baseline,
    )
    return replace(state, trial=trial), (
        f"v{version} will be checked against the {baseline.seconds:.0f} s before it"
    )


def _baseline(
    samples: Sequence[WindowSample], since_s: float | None, config: GuardrailConfig
) -> WindowAggregate:
    """The last ``rollback_window_s`` of windows that ran entirely on the table in force."""
    start = -math.inf if since_s is None else since_s + config.rollback_settle_s
    eligible = [s for s in samples if s.start_s >= start]
    if not eligible:
        return WindowAggregate()
    last_end = eligible[-1].end_s
    agg = WindowAggregate()
    for s in eligible:
        if s.end_s > last_end - config.rollback_window_s:
            agg = agg.add(s)
    return agg
