"""Guardrails: one wrapper around every daemon policy, operator overrides included.

:class:`GuardedPolicy` wraps any :class:`~specgov.policies.daemon.protocol.DaemonPolicy` (same
``name``, same state contract). The inner policy returns a :class:`Plan` (steps per slot,
reasons, experiments); the guard alone makes the published table from it: its version, its
TTL (``table_ttl_s``) and the keep-alives that re-issue it before the TTL runs out. Each
decision first runs the inner policy (its state always advances as it chose), turns the
inner plan into a proposal over the engine's slots
(``Observation.slot_candidates``; the first bound is published as 1, as SGLang routes smaller
batches there; clamped as in step 6, so steps 3-5 judge the changes that would really happen),
then passes the proposal through these steps, in this order, each a small pure function
``(context, proposal, state, config) -> (proposal, state)`` (``GUARD_STEPS``; the context holds
the observation and the Budget):

1. :func:`freeze_on_unknown_telemetry` — a field of ``config.required_fields`` is None,
   ``staleness_s > max_staleness_s``, or the tier statistics ended more than
   ``max_tier_stats_age_s`` ago: the inner plan is dropped and the table in force is held.
   Codes: ``HELD_UNKNOWN_TELEMETRY``, ``HELD_STALE_TELEMETRY``. Unknown telemetry never
   changes the table; only an active operator override may (still clamped, step 6). The
   unchanged table is re-issued before its TTL runs out for up to ``frozen_keepalive_s``
   after the last fresh telemetry (indefinitely while an override is active), after
   which it is left to expire so the engine falls back to its own policy.
2. :func:`apply_overrides` — the operator's overrides are an input of every decision
   (``GuardedPolicy.decide(..., overrides=...)``; the daemon's store holds them, the
   guard keeps no copy): an active one replaces the steps of its slots (a slot's own
   override beats an all-slots one, the newest wins). Override slots bypass steps 3-5
   and 7 but not the clamp: an override is always clamped. When an override ends
   (expired or cleared), its slots return to the policy's table directly (also
   bypassing 3-5); the guard remembers only which slots were overridden. A policy pin
   is run by the control core (:func:`pinned_policy`). Code: ``OVERRIDE_ACTIVE``.
3. :func:`tolerance_band` — a policy change whose ``expected_gain`` (relative, 0.02 = +2 %)
   is below ``min_gain`` is held; a change without a prediction (``None``) passes.
   Code: ``HELD_TOLERANCE_BAND``.
4. :func:`min_dwell` — a slot that changed less than its dwell time ago keeps its step
   (other slots may change); the dwell time is ``min_dwell_s`` doubled per unit of the
   slot's flap penalty (+1 per reversal A->B->A, halving every ``flap_half_life_s``),
   capped at ``max_dwell_s``. While a change awaits its rollback check, no further policy
   change is made (one experiment at a time). Code: ``HELD_MIN_DWELL``.
5. :func:`rate_limit` — at most ``max_changes_per_window`` table changes (of any cause)
   in any ``rate_window_s``; a policy change is admitted only while the window holds
   fewer than ``max_changes_per_window - 1`` (one is kept for a rollback when rollback
   is enabled). Overrides, their end and Budget enforcement are never delayed but are
   counted. Code: ``HELD_RATE_LIMIT``.
6. :func:`clamp_to_candidates_and_budget` — each slot's step becomes the nearest lower
   step among its candidates narrowed to ``Budget.allowed_steps`` (the smallest when none
   is lower; the engine's full set when the Budget allows none of them, reported).
   Codes in ``limited_by``: ``limited_by_candidates``, ``limited_by_budget``; a change
   made only to obey the Budget has reason ``LIMITED_BY_BUDGET``/``LIMITED_BY_CANDIDATES``.
7. :func:`rollback` — after a policy change, the measured goodput of the windows after it
   (``generation_tokens`` over the window, per running request so a load change is not
   taken for a regression; see :class:`WindowAggregate`) is compared with the windows
   before it. If it fell by more than ``rollback_threshold`` with enough data, or an SLO
   of the Budget that was met (TPOT p50 vs ``slo_tpot_ms``, ITL p99 vs
   ``slo_itl_p99_ms``, TTFT p99 vs ``slo_ttft_p99_ms``) is now broken, the previous steps
   are restored (clamped) and the rejected move is blocked for ``rollback_cooldown_s``.
   Codes: ``ROLLED_BACK_REGRESSION``; a blocked re-proposal is held with
   ``HELD_NO_CHANGE`` and ``rollback_cooldown`` in ``limited_by``.

Finally the result is committed: the very first table is published (``INITIAL``, also
after the engine's slot layout changed); a changed table is published with a new
version; an unchanged table is re-issued (same steps, new version and produced-at) once
its age passes ``keepalive_fraction`` of its TTL, so the engine never falls back by
expiry while the daemon is healthy. ``Decision.table`` is None when nothing is to be
published; the table in force is ``GuardedState.table``. Reason precedence: INITIAL,
ROLLED_BACK_REGRESSION, OVERRIDE_ACTIVE, HELD_*_TELEMETRY, the policy's change reason
(``CHANGED_PREDICTED_GAIN`` unless it gave a change code), LIMITED_BY_BUDGET/CANDIDATES,
the first guardrail that held a change, HELD_NO_CHANGE. Every step that limited the
decision appends its code to ``limited_by`` (after the inner policy's own entries).

Pure (DESIGN.md): time is ``observation.time_s``, no IO, no randomness.
"""

from __future__ import annotations

from specgov.policies.guardrails._common import (
    GUARD_STATE_VERSION,
    OVERRIDE_VERSION,
    ROLLBACK_COOLDOWN,
    Candidates,
    GuardrailError,
    Slots,
)
from specgov.policies.guardrails.config import (
    DEFAULT_TABLE_TTL_S,
    GuardrailConfig,
)
from specgov.policies.guardrails.overrides import (
    Override,
    active_overrides,
    pinned_policy,
    slot_winners,
    with_override,
    without_overrides,
)
from specgov.policies.guardrails.state import (
    ChangeTrial,
    GuardedState,
    RollbackBlock,
    SlotHistory,
    Wanted,
    WindowAggregate,
    WindowSample,
    window_sample,
)
from specgov.policies.guardrails.steps import (
    GUARD_STEPS,
    GuardContext,
    Proposal,
    StepFn,
    apply_overrides,
    clamp_step,
    clamp_to_candidates_and_budget,
    effective_dwell_s,
    engine_layout,
    evaluate_trial,
    freeze_on_unknown_telemetry,
    goodput_noise,
    min_dwell,
    rate_limit,
    rollback,
    telemetry_problem,
    tolerance_band,
)
from specgov.policies.guardrails.wrapper import (
    GuardedPolicy,
    on_publish_result,
)

__all__ = [
    "DEFAULT_TABLE_TTL_S",
    "GUARD_STATE_VERSION",
    "GUARD_STEPS",
    "OVERRIDE_VERSION",
    "ROLLBACK_COOLDOWN",
    "Candidates",
    "ChangeTrial",
    "GuardContext",
    "GuardedPolicy",
    "GuardedState",
    "GuardrailConfig",
    "GuardrailError",
    "Override",
    "Proposal",
    "RollbackBlock",
    "SlotHistory",
    "Slots",
    "StepFn",
    "Wanted",
    "WindowAggregate",
    "WindowSample",
    "active_overrides",
    "apply_overrides",
    "clamp_step",
    "clamp_to_candidates_and_budget",
    "effective_dwell_s",
    "engine_layout",
    "evaluate_trial",
    "freeze_on_unknown_telemetry",
    "goodput_noise",
    "min_dwell",
    "on_publish_result",
    "pinned_policy",
    "rate_limit",
    "rollback",
    "slot_winners",
    "telemetry_problem",
    "tolerance_band",
    "window_sample",
    "with_override",
    "without_overrides",
]
