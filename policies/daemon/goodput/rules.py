"""The goodput policy's live-acceptance rules (table formats 2 to 4, :class:`SlotRule`).

The daemon's plan is slow (one decision every few seconds) and the acceptance it plans
with is an average; the engine sees every verify. So, per slot, the policy publishes
where each step count is best as a function of the signal the engine measures (the
slot's first-draft acceptance rate, ``TablePolicy``): for every signal on a grid it
scales the slot's per-position acceptance profile to that first-position rate, scores
each candidate with the same evaluation the plan uses (expected goodput in the SLO
sense from the step-cost model), and cuts the signal axis where the best step changes.

Step 0 is charged for the probes the engine runs there (at the rule's probe step, the
share ``table.probe_share`` gives for what a probe batch loses at that signal, as the
engine probes): its goodput is that of the mix, so a slot is put at 0 only where 0
plus its probes beats speculating. Each cut carries its slope (``cut_slopes``, format
4): how fast the band above gains on the band below there, from which the engine
reads what a probe costs at its signal. The probe step has one definition,
:func:`probe_step` (the cheapest positive step the slot allows); the rule names it
(``SlotRule.probe``), so the engine probes at exactly the step charged here, whatever
steps the bands above 0 run.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from specgov.policies.common.step_table import SlotRule, least_positive_step
from specgov.policies.engine.table import probe_share

# Signal grid: the centres of 50 cells of width 0.02 over [0, 1]; thresholds fall on
# cell edges, so the same evidence gives the same rule (a refresh is no change).
_GRID_STEP: Final = 0.02
GRID: Final = tuple(_GRID_STEP * (i + 0.5) for i in range(round(1 / _GRID_STEP)))
# Per-position rates are capped below 1: a verify always has a chance to stop.
_MAX_RATE: Final = 0.99
# A near-tie, not a cut: the slot's incumbent step stays wherever its expected goodput
# is within this fraction of the best. Measured (replay of the Azure conversation trace
# at 1x, goodput policy, TPOT p50 / tier switches): 0.02 gave 6.738 ms / 197 (the
# near-tied 2 and 4 steps run far longer and cost TPOT), 0.01 6.729 ms / 100, 0.005
# 6.729 ms / 94; sglang-ema 6.730 ms / 44. (The same replay's per-decision scores of
# one step at one slot move by 1-2 % from window to window.)
RULE_TIE: Final = 0.01


def scaled_rates(rates: Sequence[float], signal: float) -> tuple[float, ...]:
    """``rates`` scaled so that position 1's rate is ``signal`` (the shape is kept)."""
    first = rates[0] if rates else 0.0
    if first <= 1e-6:
        return tuple(min(signal, _MAX_RATE) for _ in rates) or (signal,)
    scale = signal / first
    return tuple(min(r * scale, _MAX_RATE) for r in rates)


@dataclass(frozen=True, slots=True)
class RuleEval:
    """One candidate at one signal: tokens per verify (per request, bonus included),
    step time, and the predicted share of requests within the SLO (1 without one)."""

    accept_length: float
    step_s: float
    slo_fraction: float


def slot_rule(
    mean_rates: Sequence[float],
    planned: Sequence[int],
    allowed: Sequence[int],
    batch: float,
    evaluate: Callable[[float, int], RuleEval],
    hard_slo_ms: float | None,
    incumbent: int | None,
    tie: float,
    in_force: SlotRule | None = None,
) -> SlotRule | None:
    """One slot's rule: ``planned`` (the steps its plan weighed) and ``probe_step(allowed)``
    (the probe a slot at 0 runs, named in the rule) scored at every grid signal by
    ``evaluate(signal, k)``; goodput in the SLO sense, step 0 charged for its probes.
    A step past ``hard_slo_ms`` (a TPOT SLO without the SLO model) is out while any
    other meets it. None when one step wins at every signal or nothing can be scored.
    ``in_force`` (the slot's rule in the table in force) is kept, with the new prior,
    while it gives ``incumbent`` at the prior and near the prior it stays within ``tie``
    of the best (``_NEAR_PRIOR``).
    ``incumbent`` (the step the slot's plan keeps) wins wherever it scores within ``tie``
    of the best (``build_rule``).
    """
    cands = list(planned)
    probe = probe_step(allowed)
    if probe is not None and probe not in cands:
        cands.append(probe)
    if len(cands) < 2 or not mean_rates:
        return None

    def scores_at(signal: float) -> dict[int, float]:
        evals = {k: evaluate(signal, k) for k in cands}
        tokens = {k: batch * e.accept_length for k, e in evals.items()}
        times = {k: e.step_s for k, e in evals.items()}
        if 0 in evals and probe is not None:
            tokens[0], times[0] = probe_charged(tokens[0], times[0], tokens[probe], times[probe])
        tpot_ms = {k: 1e3 * times[k] * batch / tokens[k] for k in cands}
        feasible = [k for k in cands if hard_slo_ms is None or tpot_ms[k] <= hard_slo_ms]
        if not feasible:  # nothing meets the SLO: the least TPOT, as the plan does
            return {k: -tpot_ms[k] for k in cands}
        return {k: tokens[k] / times[k] * evals[k].slo_fraction for k in feasible}

    table = [scores_at(signal) for signal in GRID]
    prior = min(max(mean_rates[0], 0.0), 1.0)
    if (
        in_force is not None
        and (incumbent is None or in_force.steps_at(prior) == incumbent)
        and _still_good(in_force, prior, table, tie)
    ):
        return SlotRule(
            in_force.thresholds,
            in_force.steps,
            prior=prior,
            probe=probe,
            slopes=cut_slopes(table, in_force.thresholds, in_force.steps),
        )
    return build_rule(table, prior=prior, incumbent=incumbent, tie=tie, probe=probe)


def probe_step(allowed: Iterable[int]) -> int | None:
    """The step a slot at 0 steps probes with: the cheapest positive step it allows
    (None when it allows none)."""
    return least_positive_step(allowed)


def probe_charged(
    tokens_0: float, time_0_s: float, tokens_p: float, time_p_s: float
) -> tuple[float, float]:
    """(tokens, seconds) per batch of a slot at 0 steps with its probes mixed in, at the
    share the engine probes with where a probe batch loses what it loses here
    (``table.probe_share``)."""
    rate_0 = tokens_0 / time_0_s if time_0_s > 0 else 0.0
    rate_p = tokens_p / time_p_s if time_p_s > 0 else 0.0
    share = probe_share(1.0 - rate_p / rate_0 if rate_0 > 0 else 0.0)
    return (
        (1.0 - share) * tokens_0 + share * tokens_p,
        (1.0 - share) * time_0_s + share * time_p_s,
    )


def build_rule(
    table: Sequence[Mapping[int, float]],
    prior: float,
    *,
    incumbent: int | None = None,
    tie: float = 0.0,
    probe: int | None = None,
) -> SlotRule | None:
    """The rule that picks, at every grid signal, the step with the best score.

    ``table[i]``: score per candidate step at signal ``GRID[i]`` (ties go to the
    fewer steps). A near-tie is not a cut: ``incumbent`` (the step the slot runs) is
    kept wherever it scores within ``tie`` (a fraction, ``RULE_TIE``) of the best, so
    that the slot's signal wandering between near-tied steps does not switch the
    engine's tier for no measurable gain. None when one step wins everywhere (the slot
    needs no rule). ``probe``: the step its 0 band probes with (``probe_step``).

    The tie never makes the way back from 0 harder (``_tie_pick``): the 0 band ends
    where speculation first wins, and where it wins by less than ``tie`` (just above
    the cut) the cheapest step that beats 0 runs, not a dearer near-tied incumbent.
    """
    best = [_tie_pick(scores, incumbent, tie) for scores in table]
    thresholds: list[float] = []
    steps = [best[0]]
    for i in range(1, len(best)):
        if best[i] != steps[-1]:
            thresholds.append(round(_GRID_STEP * i, 6))
            steps.append(best[i])
    if len(steps) == 1:
        return None
    return SlotRule(
        thresholds=tuple(thresholds),
        steps=tuple(steps),
        prior=min(max(prior, 0.0), 1.0),
        probe=probe,
        slopes=cut_slopes(table, thresholds, steps),
    )


# A cut's slope is fitted over this many grid cells either side of it (0.06 of signal):
# wide enough to average the grid's rounding, narrow enough to stay local to the cut.
_SLOPE_CELLS: Final = 3
# A floor for a cut where the band above does not gain on the band below as the signal
# rises (a near-tie kept by ``tie``, or scores that bend): crossing it then takes the
# engine's largest margin, not an infinite one.
_MIN_SLOPE: Final = 1e-3


def cut_slopes(
    table: Sequence[Mapping[int, float]],
    thresholds: Sequence[float],
    steps: Sequence[int],
) -> tuple[float, ...] | None:
    """Per cut, how fast the band above gains on the band below as the signal rises
    (``SlotRule.slopes``): the least-squares slope over the grid cells near the cut of
    ``score_above / score_below - 1``. None where a band's step was not scored (the
    rule then keeps the engine's fixed hysteresis)."""
    slopes = []
    n = len(table)
    for t, lo, hi in zip(thresholds, steps, steps[1:], strict=False):
        cut = round(t / _GRID_STEP)
        xs, ys = [], []
        for i in range(max(0, cut - _SLOPE_CELLS), min(n, cut + _SLOPE_CELLS)):
            below, above = table[i].get(lo), table[i].get(hi)
            if below is None or above is None or below <= 0.0:
                continue
            xs.append(GRID[i])
            ys.append(above / below - 1.0)
        if len(xs) < 2:
            return None
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        sxx = sum((x - mx) ** 2 for x in xs)
        sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
        slopes.append(max(sxy / sxx, _MIN_SLOPE))
    return tuple(slopes)


def _tie_pick(scores: Mapping[int, float], incumbent: int | None, tie: float) -> int:
    """The step a rule runs at one signal: the best, or ``incumbent`` within ``tie``
    of it; 0 only where it is the best; and where 0 is within ``tie`` of a positive
    best, the least step that beats 0."""
    top = max(scores, key=lambda k: (scores[k], -k))
    floor = scores[top] * (1.0 - tie)
    if top == 0 or floor <= 0.0:
        return top
    zero = scores.get(0)
    if zero is not None and zero >= floor:
        return min(k for k in scores if k > 0 and scores[k] > zero)
    if incumbent is not None and incumbent > 0 and scores.get(incumbent, -1.0) >= floor:
        return incumbent
    return top


# The rule in force stays (with the new prior) while, over where the signal is likely
# to be before the next decision (within this of the new prior), the steps it runs lose
# on average less than half of ``tie`` against the best: the estimates jitter from
# window to window at a steady workload, moving cuts by a cell or two where the steps
# either side are near-tied anyway, and a cut far from the signal matters only once the
# signal gets near it, by when the prior (the daemon sees the same verifies) has too.
_NEAR_PRIOR: Final = 0.15


def _still_good(
    in_force: SlotRule, prior: float, table: Sequence[Mapping[int, float]], tie: float
) -> bool:
    losses = []
    for signal, scores in zip(GRID, table, strict=True):
        if abs(signal - prior) > _NEAR_PRIOR:
            continue
        k = in_force.steps_at(signal)
        top = max(scores.values())
        if k not in scores or top <= 0:
            return False
        losses.append(1.0 - scores[k] / top)
    return not losses or sum(losses) / len(losses) <= tie / 2


def rule_cuts(
    rules: Sequence[tuple[int, SlotRule]],
) -> tuple[tuple[int, tuple[float, ...], tuple[int, ...]], ...]:
    """What a table's rules decide, without the priors they start from."""
    return tuple((b, r.thresholds, r.steps) for b, r in rules)
