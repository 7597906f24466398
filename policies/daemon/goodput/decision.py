"""The goodput policy's decision: its per-slot plans as a table, a reason and a message."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from specgov.policies.common.types import Decision, Observation, ReasonCode, StepTable
from specgov.policies.daemon.goodput.model import Restart, SlotPlan, describe, expected_gain_of
from specgov.policies.daemon.goodput.rules import rule_cuts
from specgov.policies.daemon.goodput.state import GoodputState


def goodput_decision(
    observation: Observation,
    state: GoodputState,
    current: StepTable | None,
    plans: Sequence[SlotPlan],
    gains: Sequence[tuple[float, float, float]],
    restart: Restart | None = None,
    *,
    ttl_s: float,
) -> tuple[Decision, GoodputState]:
    """The decision for *plans* (a new table with *ttl_s*, or none when the table in force
    is what they want) and the state that remembers the table proposed."""
    # A table starts at bound 1; batches below the engine's first slot bound use its
    # first slot anyway (StepTable and SGLang route them there alike).
    slots = tuple((1 if i == 0 else p.slot, p.steps) for i, p in enumerate(plans))
    rules = tuple(
        (1 if i == 0 else p.slot, p.rule) for i, p in enumerate(plans) if p.rule is not None
    )
    # Also "changed" when the table in force is what we want but our last proposal
    # was not (the guardrails held it): say so, or that proposal stays pending.
    # Rules count by their cuts and steps (the prior moves with every window).
    last = state.last_table
    changed = any(
        t is None or t.slots != slots or rule_cuts(t.rules) != rule_cuts(rules)
        for t in ((current,) if last is None else (current, last))
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
    if not changed:
        return (
            Decision(
                table=None,
                reason=reason,
                message=f"goodput: table unchanged ({summary})",
                expected_gain=expected_gain,
                limited_by=tuple(limited),
                restart_recommendation=recommendation,
            ),
            state,
        )
    versions = [t.version for t in (observation.table, state.last_table) if t is not None]
    table = StepTable(
        slots=slots,
        version=max(versions, default=0) + 1,
        produced_at_s=observation.time_s,
        ttl_s=ttl_s,
        reason=reason.value,
        rules=rules,
    )
    gain_text = "" if expected_gain is None else f", predicted gain {expected_gain:+.1%}"
    if experiments:
        gain_text += f", probing slot(s) {list(experiments)}"
    return (
        Decision(
            table=table,
            reason=reason,
            message=f"goodput: new table{gain_text} ({summary})",
            expected_gain=expected_gain,
            limited_by=tuple(limited),
            restart_recommendation=recommendation,
            experiment_slots=experiments,
        ),
        replace(state, last_table=table),
    )


def _reason(limited: Sequence[str], changed: bool) -> ReasonCode:
    """The decision's reason: a limit that bound the plan first, else changed or held."""
    if "slo_tpot_ms" in limited:
        return ReasonCode.LIMITED_BY_SLO
    if "allowed_steps" in limited:
        return ReasonCode.LIMITED_BY_BUDGET
    if changed:
        return ReasonCode.CHANGED_PREDICTED_GAIN
    return ReasonCode.HELD_NO_CHANGE
