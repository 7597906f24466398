"""The guard steps, each a pure ``(context, proposal, state, config) -> (proposal, state)``,
in the documented order (GUARD_STEPS), with the context and the proposal they pass along."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Final, TypeAlias

from specgov.policies.common.decisions import Plan, ReasonCode
from specgov.policies.common.observation import Observation
from specgov.policies.common.types import Budget
from specgov.policies.guardrails._common import (
    MAX_SAMPLES,
    ROLLBACK_COOLDOWN,
    Candidates,
    Slots,
)
from specgov.policies.guardrails.config import (
    GuardrailConfig,
)
from specgov.policies.guardrails.overrides import (
    Override,
    pinned_policy,
    slot_winners,
)
from specgov.policies.guardrails.state import (
    ChangeTrial,
    GuardedState,
    RollbackBlock,
    SlotHistory,
    Wanted,
    WindowSample,
    window_sample,
)

# ------------------------------------------------------------------ context, proposal


@dataclass(frozen=True, slots=True)
class GuardContext:
    """What every step reads: the observation, the Budget, and derived views of them."""

    observation: Observation
    budget: Budget
    inner_plan: Plan
    # The engine's slots (first bound published as 1), from the observation or as last seen.
    candidates: Candidates | None
    # The steps in force on those slots; None when nothing is in force (or the layout changed).
    current: Slots | None
    # The inner policy's table (or the one it stands by) on those slots.
    wanted: Wanted | None
    # The operator's overrides in force at this decision (the store's, passed in).
    overrides: tuple[Override, ...] = ()
    # The operator switched the policy (policy set, a pin starting or ending): every slot
    # goes to the new policy's table directly, like the end of an override.
    policy_switched: bool = False
    # Overrides passed in that are no longer active (expired since the last decision).
    expired: tuple[Override, ...] = ()

    @property
    def now_s(self) -> float:
        return self.observation.time_s


@dataclass(frozen=True, slots=True)
class Proposal:
    """The decision under construction, as it passes through the steps."""

    steps: Slots | None
    frozen: ReasonCode | None = None
    override_slots: frozenset[int] = frozenset()
    release_slots: frozenset[int] = frozenset()
    rolled_back_slots: frozenset[int] = frozenset()
    forced_slots: frozenset[int] = frozenset()
    held_by: ReasonCode | None = None
    limited_by: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()

    def policy_changes(self, current: Slots | None) -> dict[int, int]:
        """Slots the policy would move (not overrides, releases, rollbacks or the Budget)."""
        if self.steps is None or current is None:
            return {}
        now = dict(current)
        skip = self.override_slots | self.release_slots | self.rolled_back_slots | self.forced_slots
        return {b: k for b, k in self.steps if b not in skip and now.get(b) != k}

    def note(self, text: str, limit: str | None = None) -> Proposal:
        limited = self.limited_by if limit is None else (*self.limited_by, limit)
        return replace(self, notes=(*self.notes, text), limited_by=limited)

    def hold(self, slots: Iterable[int], current: Slots, code: ReasonCode) -> Proposal:
        """Put ``slots`` back to their steps in force; ``code`` is recorded as the holder."""
        back = set(slots)
        now = dict(current)
        assert self.steps is not None
        steps = tuple((b, now[b] if b in back else k) for b, k in self.steps)
        return replace(self, steps=steps, held_by=self.held_by or code)


StepFn: TypeAlias = Callable[
    [GuardContext, Proposal, GuardedState[Any], GuardrailConfig],
    tuple[Proposal, GuardedState[Any]],
]


def fmt(slots: Iterable[tuple[int, int]]) -> str:
    return "[" + ", ".join(f"{b}:{k}" for b, k in slots) + "]"


def fmt_moves(moves: Mapping[int, tuple[int, int]]) -> str:
    return ", ".join(f"slot {b} {a}->{c}" for b, (a, c) in sorted(moves.items()))


def engine_layout(raw: Candidates | None) -> Candidates | None:
    """The engine's slots as published: candidates sorted and unique, first bound 1."""
    if not raw:
        return None
    return tuple(
        (1 if i == 0 else b, tuple(sorted(set(steps)))) for i, (b, steps) in enumerate(raw)
    )


def clamp_step(
    steps: int, candidates: Sequence[int], allowed_steps: Sequence[int] | None
) -> tuple[int, tuple[str, ...]]:
    """The nearest lower playable step (the smallest when none is lower) and what limited it.

    Playable: the slot's candidates narrowed to ``allowed_steps``, or all of them (reported
    as ``limited_by_budget``) when the Budget allows none: a step the engine never built
    cannot be published either way.
    """
    cands = sorted(set(candidates))
    allowed = cands if allowed_steps is None else [c for c in cands if c in allowed_steps]
    limits: list[str] = []
    if not allowed:
        allowed = cands
        limits.append(ReasonCode.LIMITED_BY_BUDGET.value)
    if steps in allowed:
        return steps, tuple(limits)
    lower = [c for c in allowed if c <= steps]
    chosen = max(lower) if lower else min(allowed)
    if steps not in cands:
        limits.insert(0, ReasonCode.LIMITED_BY_CANDIDATES.value)
        cand_lower = [c for c in cands if c <= steps]
        nearest = max(cand_lower) if cand_lower else min(cands)
        if nearest != chosen and ReasonCode.LIMITED_BY_BUDGET.value not in limits:
            limits.append(ReasonCode.LIMITED_BY_BUDGET.value)
    elif ReasonCode.LIMITED_BY_BUDGET.value not in limits:
        limits.append(ReasonCode.LIMITED_BY_BUDGET.value)
    return chosen, tuple(limits)


def effective_dwell_s(history: SlotHistory, now_s: float, config: GuardrailConfig) -> float:
    """``min_dwell_s`` doubled per unit of decayed flap penalty, capped at ``max_dwell_s``."""
    penalty = history.penalty_at(now_s, config.flap_half_life_s)
    return min(config.max_dwell_s, config.min_dwell_s * math.pow(2.0, penalty))


# --------------------------------------------------------------------------- steps


def telemetry_problem(
    observation: Observation, config: GuardrailConfig
) -> tuple[ReasonCode, str] | None:
    """Why the telemetry cannot be acted on (code, text), or None when it is fresh."""
    obs = observation
    missing = [name for name in config.required_fields if getattr(obs, name) is None]
    if missing:
        return ReasonCode.HELD_UNKNOWN_TELEMETRY, (
            f"telemetry unknown ({', '.join(missing)} is None)"
        )
    stale: list[str] = []
    if obs.staleness_s is not None and obs.staleness_s > config.max_staleness_s:
        stale.append(
            f"metrics are {obs.staleness_s:.1f} s old > max_staleness_s={config.max_staleness_s:g}"
        )
    if obs.tier_stats is not None:
        age = obs.time_s - obs.tier_stats.window_end_s
        if age > config.max_tier_stats_age_s:
            stale.append(
                f"tier stats ended {age:.1f} s ago > max_tier_stats_age_s="
                f"{config.max_tier_stats_age_s:g}"
            )
    if stale:
        return ReasonCode.HELD_STALE_TELEMETRY, "telemetry stale (" + "; ".join(stale) + ")"
    return None


def freeze_on_unknown_telemetry(
    ctx: GuardContext, p: Proposal, state: GuardedState[Any], config: GuardrailConfig
) -> tuple[Proposal, GuardedState[Any]]:
    """Step 1: hold the table in force when needed telemetry is unknown or stale."""
    problem = telemetry_problem(ctx.observation, config)
    if problem is None:
        return p, replace(state, last_fresh_s=ctx.now_s)
    code, why = problem
    held = replace(p, steps=ctx.current, frozen=code)
    return held.note(f"{why}: policy table dropped, holding the table in force", code.value), state


def apply_overrides(
    ctx: GuardContext, p: Proposal, state: GuardedState[Any], config: GuardrailConfig
) -> tuple[Proposal, GuardedState[Any]]:
    """Step 2: apply the active step overrides to their slots; release ended ones."""
    pin = pinned_policy(ctx.overrides, ctx.now_s)
    if pin is not None:
        p = p.note(f"operator pinned policy {pin!r}")
    for o in ctx.expired:
        p = p.note(f"override expired: {o.describe()}")
    cands = ctx.candidates
    step_overrides = [o for o in ctx.overrides if o.kind == "steps"]
    if cands is None:
        if step_overrides:
            p = p.note("overrides not applied: the engine's slot candidates are unknown")
        return p, state
    bounds = [b for b, _ in cands]
    winners = slot_winners(step_overrides, bounds)
    for o in step_overrides:
        if o.slot is not None and o.slot not in bounds:
            p = p.note(f"override ignored: slot {o.slot} is not an engine slot {bounds}")
    ended = {b for b in state.override_slots if b in bounds} - set(winners)
    if ctx.policy_switched:
        ended |= set(bounds) - set(winners)
    if p.frozen:
        # Held slots stay as they are; an ended override releases once telemetry is back.
        state = replace(state, override_slots=tuple(sorted(set(winners) | ended)))
    else:
        state = replace(state, override_slots=tuple(sorted(winners)))
        if ended:
            p = replace(p, release_slots=frozenset(ended)).note(
                f"override ended: slots {sorted(ended)} return to the policy's table"
            )
    if not winners:
        return p, state
    base = p.steps if p.steps is not None else ctx.current
    if base is None and len(winners) < len(bounds):
        return p.note(
            "override waits for the policy's first table (it covers some slots only)"
        ), state
    steps = dict(base) if base is not None else {}
    for b, o in winners.items():
        target = o.target_steps
        assert target is not None  # a steps override always has a target
        steps[b] = target
    texts = sorted({o.describe() for o in winners.values()})
    p = replace(p, steps=tuple((b, steps[b]) for b in bounds), override_slots=frozenset(winners))
    return p.note("override active: " + "; ".join(texts), ReasonCode.OVERRIDE_ACTIVE.value), state


def tolerance_band(
    ctx: GuardContext, p: Proposal, state: GuardedState[Any], config: GuardrailConfig
) -> tuple[Proposal, GuardedState[Any]]:
    """Step 3: hold a policy change predicted to gain less than ``min_gain``.

    A slot the policy marks as an experiment (a probe) carries no prediction and passes;
    the rollback check judges it once it runs.
    """
    if p.frozen or ctx.current is None or ctx.wanted is None:
        return p, state
    trials = ctx.wanted.experiment_slots
    changes = {b: k for b, k in p.policy_changes(ctx.current).items() if b not in trials}
    gain = ctx.wanted.expected_gain
    if not changes or gain is None or gain >= config.min_gain:
        return p, state
    code = ReasonCode.HELD_TOLERANCE_BAND
    p = p.hold(changes, ctx.current, code)
    text = (
        f"held slots {sorted(changes)}: expected gain {gain:+.1%} < min_gain {config.min_gain:.1%}"
    )
    return p.note(text, code.value), state


def _policy_moves(ctx: GuardContext, p: Proposal) -> tuple[dict[int, int], Slots] | None:
    """The slots the policy would move and the table in force, for a step that may hold
    them; None when there is nothing to hold (frozen, no table yet, or no move)."""
    if p.frozen or ctx.current is None:
        return None
    changes = p.policy_changes(ctx.current)
    return (changes, ctx.current) if changes else None


def min_dwell(
    ctx: GuardContext, p: Proposal, state: GuardedState[Any], config: GuardrailConfig
) -> tuple[Proposal, GuardedState[Any]]:
    """Step 4: keep a slot's step for its dwell time; one rollback check at a time."""
    moves = _policy_moves(ctx, p)
    if moves is None:
        return p, state
    changes, current = moves
    code = ReasonCode.HELD_MIN_DWELL
    if state.trial is not None:
        p = p.hold(changes, current, code)
        text = f"held slots {sorted(changes)}: change v{state.trial.version} is still being checked"
        return p.note(text, code.value), state
    held: list[str] = []
    for b in sorted(changes):
        hist = state.history(b)
        if hist is None:
            continue
        dwell = effective_dwell_s(hist, ctx.now_s, config)
        age = ctx.now_s - hist.changed_at_s
        if age < dwell:
            held.append(f"slot {b} changed {age:.0f} s ago < dwell {dwell:.0f} s")
            p = p.hold([b], current, code)
    if held:
        p = p.note("held " + "; ".join(held), code.value)
    return p, state


def rate_limit(
    ctx: GuardContext, p: Proposal, state: GuardedState[Any], config: GuardrailConfig
) -> tuple[Proposal, GuardedState[Any]]:
    """Step 5: at most ``max_changes_per_window`` changes in any ``rate_window_s``."""
    moves = _policy_moves(ctx, p)
    if moves is None:
        return p, state
    changes, current = moves
    recent = [t for t in state.change_times_s if t > ctx.now_s - config.rate_window_s]
    if len(recent) < config.policy_change_limit:
        return p, state
    code = ReasonCode.HELD_RATE_LIMIT
    p = p.hold(changes, current, code)
    text = (
        f"held slots {sorted(changes)}: {len(recent)} table changes in the last "
        f"{config.rate_window_s:g} s (max {config.max_changes_per_window}"
        + (", one kept for a rollback)" if config.rollback_enabled else ")")
    )
    return p.note(text, code.value), state


def clamp_to_candidates_and_budget(
    ctx: GuardContext, p: Proposal, state: GuardedState[Any], config: GuardrailConfig
) -> tuple[Proposal, GuardedState[Any]]:
    """Step 6: every step one of its slot's candidates and allowed by the Budget."""
    if p.steps is None or ctx.candidates is None or (p.frozen and not p.override_slots):
        # Frozen without an override nothing new is published; commit re-issues the held
        # table only if it still passes this clamp unchanged.
        return p, state
    steps, limits, texts, forced = clamp_all(ctx, p.steps, p.override_slots)
    if not texts:
        return p, state
    p = replace(p, steps=steps, forced_slots=p.forced_slots | forced)
    p = p.note("clamped " + "; ".join(texts))
    return replace(p, limited_by=(*p.limited_by, *limits)), state


def clamp_all(
    ctx: GuardContext, steps: Slots, override_slots: frozenset[int]
) -> tuple[Slots, list[str], list[str], frozenset[int]]:
    assert ctx.candidates is not None
    cmap = dict(ctx.candidates)
    current = dict(ctx.current or ())
    out: list[tuple[int, int]] = []
    limits: list[str] = []
    texts: list[str] = []
    forced: set[int] = set()
    allowed = ctx.budget.allowed_steps
    for b, k in steps:
        c, why = clamp_step(k, cmap[b], allowed)
        if c != k or why:
            who = "override " if b in override_slots else ""
            if c != k:
                texts.append(f"{who}slot {b} {k}->{c} (candidates {list(cmap[b])})")
            if not [s for s in cmap[b] if allowed is None or s in allowed]:
                texts.append(
                    f"slot {b}: Budget allowed_steps {list(allowed or ())} "
                    f"contain none of its candidates {list(cmap[b])}"
                )
            limits.extend(w for w in why if w not in limits)
            if c != k and current.get(b) == k:
                forced.add(b)
        out.append((b, c))
    return tuple(out), limits, texts, frozenset(forced)


def rollback(
    ctx: GuardContext, p: Proposal, state: GuardedState[Any], config: GuardrailConfig
) -> tuple[Proposal, GuardedState[Any]]:
    """Step 7: judge the pending change; restore the previous steps if it hurt."""
    if not config.rollback_enabled:
        return p, state
    now = ctx.now_s
    blocks = tuple(b for b in state.blocks if b.until_s > now)
    samples = state.samples
    sample = None if p.frozen else window_sample(ctx.observation)
    if sample is not None and (not samples or sample.end_s > samples[-1].end_s):
        horizon = now - (2 * config.rollback_window_s + config.rollback_settle_s + 60.0)
        samples = tuple(s for s in (*samples, sample) if s.end_s >= horizon)[-MAX_SAMPLES:]
    else:
        sample = None
    state = replace(state, blocks=blocks, samples=samples)
    trial = state.trial
    if trial is not None:
        trial_slots = {b for b, _, _ in trial.changes}
        if trial_slots & (p.override_slots | p.release_slots):
            p = p.note(f"change v{trial.version} not checked: an override changed its slots")
            trial = None
        else:
            if (
                sample is not None
                and sample.start_s >= trial.started_at_s + config.rollback_settle_s
            ):
                trial = replace(trial, post=trial.post.add(sample))
            noise = goodput_noise(samples, trial.started_at_s)
            verdict, text = evaluate_trial(trial, ctx.budget, config, noise=noise)
            if verdict is None and now - trial.started_at_s > config.rollback_max_wait_s:
                verdict, text = (
                    "inconclusive",
                    (
                        f"change v{trial.version} kept: not enough data within "
                        f"{config.rollback_max_wait_s:g} s to check it"
                    ),
                )
            if verdict == "regressed":
                p, blocks = _roll_back(ctx, p, trial, text, blocks, config)
                state = replace(state, blocks=blocks)
                trial = None
            elif verdict is not None:
                p = p.note(text)
                trial = None
        state = replace(state, trial=trial)
    if blocks and ctx.current is not None and not p.frozen:
        current = dict(ctx.current)
        refused = [
            (b, k, blk)
            for b, k in p.policy_changes(ctx.current).items()
            for blk in blocks
            if blk.slot == b and blk.from_steps == current[b] and blk.to_steps == k
        ]
        if refused:
            p = p.hold([b for b, _, _ in refused], ctx.current, ReasonCode.HELD_NO_CHANGE)
            text = "; ".join(
                f"slot {b} {current[b]}->{k} blocked until {blk.until_s:.1f} s after a rollback"
                for b, k, blk in refused
            )
            p = p.note(text, ROLLBACK_COOLDOWN)
    return p, state


def _roll_back(
    ctx: GuardContext,
    p: Proposal,
    trial: ChangeTrial,
    text: str,
    blocks: tuple[RollbackBlock, ...],
    config: GuardrailConfig,
) -> tuple[Proposal, tuple[RollbackBlock, ...]]:
    if p.steps is None or ctx.current is None:
        return p.note(text + "; nothing to restore"), blocks
    current = dict(ctx.current)
    restore = {
        b: before
        for b, before, after in trial.changes
        if b not in p.override_slots and current.get(b) == after
    }
    if not restore:
        return p.note(text + "; its slots have moved on, nothing to restore"), blocks
    steps = tuple((b, restore.get(b, k)) for b, k in p.steps)
    limits: list[str] = []
    if ctx.candidates is not None:
        clamped, limits, notes, _ = clamp_all(ctx, steps, p.override_slots)
        if notes:
            p = p.note("clamped " + "; ".join(notes))
        steps = clamped
    new_blocks = tuple(
        RollbackBlock(
            slot=b,
            from_steps=before,
            to_steps=after,
            until_s=ctx.now_s + config.rollback_cooldown_s,
        )
        for b, before, after in trial.changes
        if b in restore
    )
    p = replace(
        p,
        steps=steps,
        rolled_back_slots=frozenset(restore),
        limited_by=(*p.limited_by, *limits),
    )
    text += (
        f"; restored {fmt(sorted(restore.items()))}, "
        f"move blocked for {config.rollback_cooldown_s:g} s"
    )
    return p.note(text, ReasonCode.ROLLED_BACK_REGRESSION.value), blocks + new_blocks


def goodput_noise(samples: Sequence[WindowSample], before_s: float) -> float:
    """Relative s.d. of per-window goodput per running request before ``before_s``."""
    rates = [
        s.tokens / s.window_s / max(s.running or 1, 1)
        for s in samples
        if s.end_s <= before_s and s.window_s > 0
    ][-12:]
    if len(rates) < 3:
        return 0.0
    mean = sum(rates) / len(rates)
    if mean <= 0:
        return 0.0
    var = sum((r - mean) ** 2 for r in rates) / (len(rates) - 1)
    return math.sqrt(var) / mean


def evaluate_trial(
    trial: ChangeTrial, budget: Budget, config: GuardrailConfig, *, noise: float = 0.0
) -> tuple[str | None, str]:
    """``("regressed" | "kept" | "inconclusive", message)``, or ``(None, "")`` for more data.

    ``noise``: relative s.d. of the per-window goodput before the change; a drop within
    ``rollback_noise_z`` of it is not called a regression.
    """
    base, post = trial.baseline, trial.post
    if post.seconds < config.rollback_window_s or post.tokens < config.rollback_min_tokens:
        return None, ""
    tag = f"change v{trial.version}"
    per_request = base.load_s is not None and post.load_s is not None
    if per_request:
        b_load, a_load = base.mean_load, post.mean_load
        assert b_load is not None and a_load is not None
        ratio = max(a_load / b_load, b_load / a_load)
        if ratio > config.rollback_max_load_ratio:
            return "inconclusive", (
                f"{tag} kept: load moved too much to judge it (running requests "
                f"{b_load:.1f} -> {a_load:.1f})"
            )
    b_rate, a_rate = base.goodput(per_request), post.goodput(per_request)
    unit = "tok/s per running request" if per_request else "tok/s"
    broken: list[str] = []
    for name, slo, before, after in (
        ("TPOT p50", budget.slo_tpot_ms, base.tpot_ms, post.tpot_ms),
        ("ITL p99", budget.slo_itl_p99_ms, base.itl_p99_ms, post.itl_p99_ms),
        ("TTFT p99", budget.slo_ttft_p99_ms, base.ttft_p99_ms, post.ttft_p99_ms),
    ):
        if slo is None or before is None or after is None:
            continue
        if before <= slo < after / (1.0 + config.rollback_slo_margin):
            broken.append(f"{name} {before:.1f} -> {after:.1f} ms broke its SLO {slo:g} ms")
    change = None
    if b_rate is not None and a_rate is not None and b_rate > 0:
        change = a_rate / b_rate - 1.0
    measured = (
        "" if change is None else f"goodput {b_rate:.2f} -> {a_rate:.2f} {unit} ({change:+.1%})"
    )
    threshold = max(config.rollback_threshold, config.rollback_noise_z * noise)
    if broken or (change is not None and change < -threshold):
        why = "; ".join([m for m in (measured,) if m] + broken)
        return "regressed", f"{tag} rolled back: {why}"
    return "kept", f"{tag} kept after its check: {measured or 'no goodput measured'}"


GUARD_STEPS: Final[tuple[tuple[str, StepFn], ...]] = (
    ("freeze_on_unknown_telemetry", freeze_on_unknown_telemetry),
    ("apply_overrides", apply_overrides),
    ("tolerance_band", tolerance_band),
    ("min_dwell", min_dwell),
    ("rate_limit", rate_limit),
    ("clamp_to_candidates_and_budget", clamp_to_candidates_and_budget),
    ("rollback", rollback),
)
