"""The goodput policy's answer: its per-slot plans as one Plan, a reason and a message."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from specgov.policies.common.decisions import Plan, ReasonCode
from specgov.policies.common.step_table import StepTable
from specgov.policies.daemon.goodput.model import Restart, SlotPlan, describe, expected_gain_of
from specgov.policies.daemon.goodput.rules import rule_cuts
from specgov.policies.daemon.goodput.state import GoodputState


def goodput_plan(
    state: GoodputState,
    current: StepTable | None,
    plans: Sequence[SlotPlan],
    gains: Sequence[tuple[float, float, float]],
    restart: Restart | None = None,
) -> tuple[Plan, GoodputState]:
    """The Plan for *plans* (their steps and rules, or a hold when the table in force is
    what they want) and the state that remembers the steps proposed."""
    # A table starts at bound 1; batches below the engine's first slot bound use its
    # first slot anyway (StepTable and SGLang route them there alike).
    slots = tuple((1 if i == 0 else p.slot, p.steps) for i, p in enumerate(plans))
    rules = tuple(
        (1 if i == 0 else p.slot, p.rule) for i, p in enumerate(plans) if p.rule is not None
    )
    # Also "changed" when the table in force is what we want but our last proposal
    # was not (the guardrails held it): say so, or that proposal stays pending.
    # Rules count by their cuts and steps (the prior moves with every window).
    in_force = None if current is None else (current.slots, current.rules)
    proposed = None if state.last_slots is None else (state.last_slots, state.last_rules)
    changed = any(
        t is None or t[0] != slots or rule_cuts(t[1]) != rule_cuts(rules)
        for t in ((in_force,) if proposed is None else (in_force, proposed))
    )
    limited: list[str] = []
    if any(p.slo_limited for p in plans):
        limited.append("slo_tpot_ms")
    if any(p.budget_limited for p in plans):
        limited.append("allowed_steps")
    # A probe is an experiment, not a prediction: its slot is named in
    # ``experiment_slots`` (the guardrails' tolerance band lets it pass; their rollback
    # still judges it) and the expected gain is that of the other slots' moves.
    experiments = tuple(b for (b, _), p in zip(slots, plans, strict=True) if p.probe)
    predicted_moves = any(new != cur for _, new, cur in gains)
    expected_gain = expected_gain_of(gains) if predicted_moves else None
    summary = "; ".join(describe(p) for p in plans)
    recommendation = None
    if restart is not None:
        recommendation = restart.recommendation()
        summary += "; " + restart.describe()
    reason = _reason(limited, changed)
    if changed:
        message = "goodput: new table"
        if expected_gain is not None:
            message += f", predicted gain {expected_gain:+.1%}"
        if experiments:
            message += f", probing slot(s) {list(experiments)}"
        state = replace(state, last_slots=slots, last_rules=rules)
    else:
        message = "goodput: table unchanged"
    plan = Plan(
        # Unchanged: a hold (None), and the guard keeps the table in force.
        slots=slots if changed else None,
        reason=reason,
        message=f"{message} ({summary})",
        expected_gain=expected_gain,
        limited_by=tuple(limited),
        restart_recommendation=recommendation,
        rules=rules if changed else (),
        experiment_slots=experiments if changed else (),
    )
    return plan, state


def _reason(limited: Sequence[str], changed: bool) -> ReasonCode:
    """The decision's reason: a limit that bound the plan first, else changed or held."""
    if "slo_tpot_ms" in limited:
        return ReasonCode.LIMITED_BY_SLO
    if "allowed_steps" in limited:
        return ReasonCode.LIMITED_BY_BUDGET
    if changed:
        return ReasonCode.CHANGED_PREDICTED_GAIN
    return ReasonCode.HELD_NO_CHANGE
