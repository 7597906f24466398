"""The goodput policy's live-acceptance rules (table format 2, :class:`SlotRule`).

The daemon's plan is slow (one decision every few seconds) and the acceptance it plans
with is an average; the engine sees every verify. So, per slot, the policy publishes
where each step count is best as a function of the signal the engine measures (the
slot's first-draft acceptance rate, ``TablePolicy``): for every signal on a grid it
scales the slot's per-position acceptance profile to that first-position rate, scores
each candidate with the same evaluation the plan uses (expected goodput in the SLO
sense from the step-cost model), and cuts the signal axis where the best step changes.

Step 0 is charged for the probes the engine runs there (``PROBE_SHARE`` of the slot's
batches at the rule's probe step): its goodput is that of the mix, so a slot is put at
0 only where 0 plus its probes beats speculating.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Final

from specgov.policies.table import PROBE_SHARE
from specgov.policies.types import SlotRule

# Signal grid: the centres of 50 cells of width 0.02 over [0, 1]; thresholds fall on
# cell edges, so the same evidence gives the same rule (a refresh is no change).
_GRID_STEP: Final = 0.02
GRID: Final = tuple(_GRID_STEP * (i + 0.5) for i in range(round(1 / _GRID_STEP)))
# Per-position rates are capped below 1: a verify always has a chance to stop.
_MAX_RATE: Final = 0.99


def scaled_rates(rates: Sequence[float], signal: float) -> tuple[float, ...]:
    """``rates`` scaled so that position 1's rate is ``signal`` (the shape is kept)."""
    first = rates[0] if rates else 0.0
    if first <= 1e-6:
        return tuple(min(signal, _MAX_RATE) for _ in rates) or (signal,)
    scale = signal / first
    return tuple(min(r * scale, _MAX_RATE) for r in rates)


def probe_charged(
    tokens_0: float, time_0_s: float, tokens_p: float, time_p_s: float
) -> tuple[float, float]:
    """(tokens, seconds) per batch of a slot at 0 steps with its probes mixed in."""
    share = PROBE_SHARE
    return (
        (1.0 - share) * tokens_0 + share * tokens_p,
        (1.0 - share) * time_0_s + share * time_p_s,
    )


def build_rule(scores_at: Callable[[float], Mapping[int, float]], prior: float) -> SlotRule | None:
    """The rule that picks, at every grid signal, the step with the best score.

    ``scores_at(signal)``: score per candidate step at that signal (ties go to the
    fewer steps). None when one step wins everywhere (the slot needs no rule).
    """
    best: list[int] = []
    for signal in GRID:
        scores = scores_at(signal)
        best.append(max(scores, key=lambda k: (scores[k], -k)))
    thresholds: list[float] = []
    steps = [best[0]]
    for i in range(1, len(best)):
        if best[i] != steps[-1]:
            thresholds.append(round(_GRID_STEP * i, 6))
            steps.append(best[i])
    if len(steps) == 1:
        return None
    return SlotRule(
        thresholds=tuple(thresholds), steps=tuple(steps), prior=min(max(prior, 0.0), 1.0)
    )


# A new rule whose cuts all lie within this of the rule in force is no change: the
# estimates jitter by a grid cell from window to window at a steady workload. A cut far
# from where the signal is matters only once the signal gets near it, and by then the
# prior (the daemon sees the same verifies) has moved and the cut is refreshed: the
# tolerance grows by half the cut's distance from the prior.
_CUT_TOLERANCE: Final = 4 * _GRID_STEP + 1e-9


def steady_rule(new: SlotRule, in_force: SlotRule | None) -> SlotRule:
    """``new``, or the cuts in force with ``new``'s prior when they barely moved."""
    if in_force is None or in_force.steps != new.steps:
        return new
    for a, b in zip(new.thresholds, in_force.thresholds, strict=True):
        if abs(a - b) > _CUT_TOLERANCE + 0.5 * min(abs(a - new.prior), abs(b - new.prior)):
            return new
    return SlotRule(thresholds=in_force.thresholds, steps=in_force.steps, prior=new.prior)
