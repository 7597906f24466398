"""The goodput model's pieces: per-slot plans, accept-length moments, the SLO model, the
restart recommendation, and the slot bookkeeping the policy reads from telemetry."""

from __future__ import annotations

import bisect
import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Final

from specgov.policies.common.decisions import RestartRecommendation
from specgov.policies.common.observation import Observation
from specgov.policies.common.step_table import SlotRule
from specgov.policies.common.types import SpecShape, TierStat, TierStatsSnapshot
from specgov.policies.daemon.estimators.acceptance import (
    AcceptanceEstimate,
)
from specgov.policies.daemon.estimators.step_cost import (
    StepCostModel,
    StepCostPrior,
    local_step_s,
)
from specgov.policies.daemon.goodput.config import (
    DEFAULT_LOG_SPREAD,
    DEFAULT_REQUEST_TOKENS,
    GAUSS_HERMITE,
    MAX_REQUEST_TOKENS,
    MIN_LOG_SPREAD,
    MIN_REQUEST_TOKENS,
    Z90,
)

# --------------------------------------------------------------------------- policy


@dataclass(frozen=True, slots=True)
class SlotPlan:
    """What the policy predicted for one slot (for messages and tests).

    ``slo_fraction`` is the predicted share of requests within the TPOT SLO (1.0 when
    the SLO-aware choice is not active, see the module docstring).
    """

    slot: int
    steps: int
    batch_size: float
    accept_length: float
    step_s: float
    goodput_tok_s: float
    tpot_ms: float
    slo_limited: bool
    budget_limited: bool
    probe: bool
    slo_fraction: float = 1.0
    # The same slot on a server without the drafter: goodput in the SLO sense (tok/s).
    no_drafter_score_tok_s: float | None = None
    # The slot's live-acceptance rule (None: the engine runs ``steps`` whatever it sees).
    rule: SlotRule | None = None

    @property
    def score_tok_s(self) -> float:
        """Goodput in the SLO sense: goodput times the share within the SLO."""
        return self.goodput_tok_s * self.slo_fraction


@dataclass(frozen=True, slots=True)
class Eval:
    accept_length: float
    step_s: float
    goodput: float  # B * E[L] / T, tokens/s
    tpot_ms: float  # T / E[L], decode only (not calibrated)
    slo_fraction: float  # predicted share of requests within the SLO (1 without a model)

    @property
    def score(self) -> float:
        """The objective: goodput in the SLO sense (tokens of requests meeting the SLO)."""
        return self.goodput * self.slo_fraction


def accept_moments(rates: Sequence[float], steps: int) -> tuple[float, float]:
    """Mean and variance of the tokens one verify emits (bonus included) at ``steps``.

    ``rates`` are conditional acceptance rates per position; positions past their end
    reuse the last one (as ``AcceptanceEstimate.expected_accept_length`` does).
    """
    mean = second = 0.0
    reach = 1.0
    for j in range(steps):
        a = rates[j] if j < len(rates) else rates[-1]
        stop = reach * (1.0 - a)  # exactly j drafts accepted: j + 1 tokens
        mean += stop * (j + 1)
        second += stop * (j + 1) ** 2
        reach *= a
    mean += reach * (steps + 1)
    second += reach * (steps + 1) ** 2
    return mean, max(0.0, second - mean * mean)


def flat_past_evidence(est: AcceptanceEstimate) -> tuple[float, ...]:
    """Rates with the positions past the evidence held at the last observed lower bound.

    For the one candidate past the evidence that exploitation considers: running it
    observes those positions within a window, so it is judged on the flat bound rather
    than the estimator's falling extrapolation (which would keep it from ever running).
    """
    m = est.observed
    if m == 0:
        return est.mean
    cap = est.lower[m - 1]
    return est.mean[:m] + tuple(max(r, min(cap, est.mean[m - 1])) for r in est.mean[m:])


# Per (slot, steps >= 1): decayed (requests verified, requests whose first draft was
# accepted). See ``first_draft_ratios``.
FirstDraft = tuple[tuple[int, int, float, float], ...]
# An entry decayed below this many requests is dropped (it no longer moves a ratio).
_FIRST_DRAFT_MIN: Final = 1e-3
# Ratios are kept to 0.01 (finer than their evidence resolves at a few hundred requests).
_RATIO_DIGITS: Final = 2
# A candidate's first-position rate is capped below 1 (a verify always may stop).
_MAX_FIRST_RATE: Final = 0.99


def update_first_draft(
    first: FirstDraft, snapshot: TierStatsSnapshot, decay: float, reset: Collection[int] = ()
) -> FirstDraft:
    """``first`` decayed by ``decay`` with one window's tiers at steps >= 1 added.

    The slots in ``reset`` (where the acceptance estimator detected a shift in this
    window) keep only this window: a ratio of step counts measured before and after a
    content shift would be the shift's, not the step counts'.
    """
    acc = {(slot, k): (n * decay, p * decay) for slot, k, n, p in first if slot not in reset}
    for t in snapshot.tiers:
        if t.steps < 1 or t.requests <= 0 or not t.accepted_hist:
            continue
        n, p = acc.get((t.slot, t.steps), (0.0, 0.0))
        passed = max(0, t.requests - t.accepted_hist[0])
        acc[(t.slot, t.steps)] = (n + t.requests, p + passed)
    return tuple(
        (slot, k, n, p) for (slot, k), (n, p) in sorted(acc.items()) if n >= _FIRST_DRAFT_MIN
    )


def first_draft_ratios(
    first: FirstDraft, slot: int, pseudo: float, run_share: float = 1.0
) -> dict[int, float]:
    """Per step count, the slot's first-draft acceptance rate there over its rate at all.

    The acceptance estimator pools draft position 1 over the step counts that ran, as if
    a verify's first draft were accepted at one rate whatever the step count. Where the
    drafts that pass come in runs (an n-gram drafter copying earlier text), it is not: a
    longer chain crosses a run in fewer verifies, so a smaller share of verifies starts
    inside one. Measured (users-16 H100, n-gram acceptance): 0.217 at 1 step, 0.165 at 2,
    0.138 at 4; users-1: 0.26, 0.16, 0.15.

    Each rate is shrunk towards the slot's pooled rate with ``pseudo`` requests (a step
    count with little evidence keeps a ratio near 1), then made non-increasing in the
    steps (pool-adjacent-violators, weighted by requests): a longer chain can only lower
    the share; a rate that rises with the steps is selection (a live rule moves up
    while acceptance is high), not an effect of the steps, and is pooled away. The
    distance from 1 is then scaled by ``run_share`` (``run_weight`` of the slot's
    profile: how much the steps can move the rate at all; selection makes the rate
    fall with the steps too, since a rule moves up after acceptance was high and the
    signal then falls back towards its mean: measured ratios 0.87-1.1 on
    conv-1x/h100/eagle3, whose simulated per-verify acceptance does not depend on the
    steps). Ratios are rounded to ``_RATIO_DIGITS``: the same evidence, to within noise,
    gives exactly the same rates, so a refresh at a steady workload republishes the
    same rules. Empty for a slot without accepted drafts.
    """
    rows = sorted((k, n, p) for s, k, n, p in first if s == slot)
    total_n = sum(n for _, n, _ in rows)
    total_p = sum(p for _, _, p in rows)
    if total_n <= 0.0 or total_p <= 0.0:
        return {}
    pooled = total_p / total_n
    blocks: list[tuple[float, float, list[int]]] = []  # (weighted rate sum, weight, steps)
    for k, n, p in rows:
        blocks.append((p + pseudo * pooled, n + pseudo, [k]))
        while len(blocks) >= 2 and blocks[-2][0] / blocks[-2][1] < blocks[-1][0] / blocks[-1][1]:
            b = blocks.pop()
            a = blocks.pop()
            blocks.append((a[0] + b[0], a[1] + b[1], a[2] + b[2]))
    out: dict[int, float] = {}
    for total, weight, steps in blocks:
        ratio = round(1.0 + run_share * (total / weight / pooled - 1.0), _RATIO_DIGITS)
        for k in steps:
            out[k] = ratio
    return out


def ratio_at(ratios: Mapping[int, float], steps: int) -> float:
    """``steps``' ratio (``first_draft_ratios``); a step count not measured takes that of
    the nearest one measured below it (the ratios do not rise with the steps, so that is
    the most it can be), else of the least one measured; 1 with no ratios at all."""
    if steps in ratios:
        return ratios[steps]
    below = [k for k in ratios if k < steps]
    if below:
        return ratios[max(below)]
    return ratios[min(ratios)] if ratios else 1.0


def run_weight(rates: Sequence[float]) -> float:
    """How far the steps can move the first-draft rate: ``(a2 - a1) / a2``, in [0, 1].

    A verify's first draft is accepted at about ``a1`` when it starts between runs and
    at the continuation rate ``a2`` when the verify before it accepted all its drafts
    inside a run; the steps change only the share of verifies of each kind, so the rate
    they make can differ from the pooled one by at most ``a2 - a1``. Where the profile
    is flat or falling (EAGLE-3: 0.69, 0.66 on chat) there is nothing for the steps to
    move, and a rate that still differs is the live rule's selection; where it rises
    steeply (n-gram: 0.35, 0.84) the measured ratio counts nearly in full. 0 with fewer
    than two positions.
    """
    if len(rates) < 2 or rates[1] <= 0.0:
        return 0.0
    return min(max((rates[1] - rates[0]) / rates[1], 0.0), 1.0)


def first_scaled(rates: tuple[float, ...], ratio: float) -> tuple[float, ...]:
    """``rates`` with draft position 1 scaled by ``ratio`` (a step count's
    ``first_draft_ratios`` entry; 1: unchanged), capped below 1."""
    if ratio == 1.0 or not rates:
        return rates
    return (min(rates[0] * ratio, _MAX_FIRST_RATE), *rates[1:])


def optimistic_rates(est: AcceptanceEstimate) -> tuple[float, ...]:
    """Per-position rates for the optimistic side of a probe decision.

    Observed positions keep their posterior mean; a position past the evidence takes
    at least the last observed mean (the prior mean with no evidence at all): measured
    acceptance is flat or rising with position once the first drafts are accepted
    (REFERENCE.md §3; n-gram rises from 0.35 to 0.9), so continuing the last rate is
    optimistic but plausible, where the estimator's own extrapolation is capped at the
    last *lower* bound.
    """
    rates = list(est.mean)
    m = est.observed
    floor = rates[m - 1] if m > 0 else max(rates[0], 0.0)
    for i in range(m, len(rates)):
        rates[i] = max(rates[i], floor)
    return tuple(rates)


@dataclass(frozen=True, slots=True)
class SloModel:
    """Per-request TPOT model near the SLO (see the module docstring).

    A request's TPOT is ``scale * T * exp(e) / Lbar``: ``T`` the step time, ``e`` a
    normal batching noise of variance ``base_var`` (prefill stalls, batch changes: does
    not depend on the steps) and ``Lbar`` the request's mean accept length over its
    ``tokens`` output tokens, normal by the central limit theorem with variance
    ``burstiness * Var[L] * E[L] / tokens`` (``tokens / E[L]`` verifies, positively
    correlated). Modelling ``Lbar`` itself as normal, not ``log TPOT``, keeps the skew of
    short requests: a few lucky verifies pull a short request far under the SLO.
    """

    slo_ms: float
    scale: float
    base_var: float
    tokens: float
    burstiness: float

    def fraction(self, tpot_ms: float, accept_mean: float, accept_var: float) -> float:
        """Share of requests within the SLO when the decode-only TPOT is ``tpot_ms``."""
        cost_ms = self.scale * tpot_ms * accept_mean  # scale * T: TPOT of a request at L=1
        sd_e = math.sqrt(self.base_var)
        sd_l = math.sqrt(self.burstiness * accept_var * accept_mean / self.tokens)
        if sd_l < 1e-9 * accept_mean:  # no acceptance spread: log-normal in e alone
            z = (math.log(self.slo_ms * accept_mean / cost_ms)) / sd_e
            return _normal_cdf(z)
        # P(Lbar >= cost * exp(e) / slo), averaged over e (Gauss-Hermite quadrature).
        total = 0.0
        for x, w in GAUSS_HERMITE:
            need = cost_ms * math.exp(sd_e * x) / self.slo_ms
            total += w * _normal_cdf((accept_mean - need) / sd_l)
        return total


def slo_sample(
    obs: Observation,
    cost: StepCostModel,
    snap: TierStatsSnapshot,
    default_ctx: float,
    burstiness: float,
) -> tuple[float, float, float, float, float] | None:
    """One window's view of per-request TPOTs (see SloModel), for smoothing.

    ``(log p50, log scale, log-variance, base log-variance, log tokens)``: ``scale``
    is the observed median TPOT over the decode-only TPOT the step-cost model
    predicts for what ran (request-weighted over the window's tiers, with their
    measured accept lengths); it absorbs prefill stalls and model error and, in a
    steady state, does not depend on the steps (a fixed share of the wall time goes
    to prefill at a given throughput). The base variance is the observed one less
    the acceptance part of what ran. None when the window cannot tell.
    """
    q = obs.tpot_ms
    if q is None or q.p50_ms is None or q.p50_ms <= 0:
        return None
    ctx = kv_per_request(obs)
    if ctx is None:
        ctx = default_ctx
    weight = tpot_sum = var_sum = 0.0
    for t in snap.tiers:
        if t.verify_calls == 0 or t.batch_size_sum == 0 or t.requests == 0:
            continue
        batch = t.batch_size_sum / t.verify_calls
        el = sum((j + 1) * n for j, n in enumerate(t.accepted_hist)) / t.requests
        second = sum((j + 1) ** 2 * n for j, n in enumerate(t.accepted_hist)) / t.requests
        # The same prediction the choice is made with, so the scale is consistent.
        step_s = local_step_s(cost, batch, t.steps, ctx * batch)
        weight += t.requests
        tpot_sum += t.requests * 1e3 * step_s / el
        var_sum += t.requests * max(0.0, second - el * el) / el
    if weight <= 0 or tpot_sum <= 0:
        return None
    p50 = q.p50_ms
    spread = DEFAULT_LOG_SPREAD
    if q.p90_ms is not None and q.p90_ms > p50:
        spread = max(math.log(q.p90_ms / p50) / Z90, MIN_LOG_SPREAD)
    tokens = DEFAULT_REQUEST_TOKENS
    e2e, ttft = obs.e2e_ms, obs.ttft_ms
    if e2e is not None and ttft is not None and e2e.p50_ms is not None:
        # A typical request's output tokens: its decode time over its TPOT.
        decode_ms = e2e.p50_ms - (ttft.p50_ms or 0.0)
        tokens = min(max(decode_ms / p50 + 1.0, MIN_REQUEST_TOKENS), MAX_REQUEST_TOKENS)
    accept_var = burstiness * (var_sum / weight) / tokens
    return (
        math.log(p50),
        math.log(p50 / (tpot_sum / weight)),
        spread * spread,
        max(spread * spread - accept_var, MIN_LOG_SPREAD**2),
        math.log(tokens),
    )


def lived_under_table(
    obs: Observation, seen_since_s: float | None, snap: TierStatsSnapshot
) -> bool:
    """Did the requests that finished in this window run under the table in force?

    (In force since ``seen_since_s``.) They started up to a request lifetime (e2e
    median) before the window; their TPOTs would calibrate the table in force with
    another table's (or a cold start's) timings.
    """
    if seen_since_s is None:
        return False
    window_s = obs.window_s or (snap.window_end_s - snap.window_start_s)
    lifetime_s = 0.0
    if obs.e2e_ms is not None and obs.e2e_ms.p50_ms is not None:
        lifetime_s = obs.e2e_ms.p50_ms / 1e3
    return obs.time_s - seen_since_s >= window_s + lifetime_s


def _normal_cdf(z: float) -> float:
    return 0.5 * math.erfc(-z / math.sqrt(2.0))


@dataclass(frozen=True, slots=True)
class SlotWork:
    bound: int
    allowed: tuple[int, ...]
    budget_limited: bool
    est: AcceptanceEstimate
    batch: float
    cur: int | None
    evals: dict[int, Eval]
    best: int
    slo_limited: bool
    share: float
    # Per step count, the first-draft rate ratio (``first_draft_ratios``), and the steps
    # the engine's live signal for this slot is measured at (the rule's signal units).
    first_ratio: Mapping[int, float]
    signal_steps: int


@dataclass(frozen=True, slots=True)
class Restart:
    held_s: float
    slots: tuple[int, ...]
    steps: tuple[int, ...]
    gain: float  # predicted, no drafter vs the best table (SLO-sense goodput)
    overhead: float  # share of a step-0 step the drafter costs

    def recommendation(self) -> RestartRecommendation:
        """The structured form the daemon records, shows, exports and may apply."""
        slots = ", ".join(f"{b}:{k}" for b, k in zip(self.slots, self.steps, strict=True))
        return RestartRecommendation(
            shape=SpecShape("NONE", 0, 0, 0, ()),
            source="policy",
            summary=(
                f"no speculation: predicted {self.gain:+.1%} goodput over the best table "
                f"in the busy slots ({slots}) for {self.held_s:.0f} s"
            ),
            predicted_gain=self.gain,
            evidence=(
                ("held_s", self.held_s),
                ("drafter_share_of_step0", self.overhead),
            ),
        )

    def describe(self) -> str:
        slots = ", ".join(f"{b}:{k}" for b, k in zip(self.slots, self.steps, strict=True))
        return (
            f"restart recommended without speculation (--speculative-algorithm NONE): for "
            f"{self.held_s:.0f} s a server without the drafter has been predicted "
            f"{self.gain:+.1%} goodput over the best table in the busy slots ({slots}); "
            f"a table cannot get there: even at step 0 every step pays the drafter "
            f"({self.overhead:.1%} of it: draft-extend, verify bookkeeping), and without "
            f"it the KV pool is larger (no draft KV cache, no candidate-step graphs)"
        )


def drafter_share(prior: StepCostPrior, batch: float, ctx: float) -> float:
    """Share of a step-0 step the drafter costs: the prior with vs without the drafter."""
    if not prior.speculative:
        return 0.0
    # Built per call (~6 us, a few per decision: measured), not remembered.
    bare = replace(prior, speculative=False, topk=1, num_draft_tokens=None)
    kv = ctx * batch
    with_drafter = prior.predict_s(batch, 0, kv)
    return max(0.0, 1.0 - bare.predict_s(batch, 0, kv) / with_drafter) if with_drafter > 0 else 0.0


def kv_per_request(obs: Observation) -> float | None:
    if (
        obs.token_usage is None
        or obs.kv_capacity_tokens is None
        or obs.running_requests is None
        or obs.running_requests <= 0
    ):
        return None
    return obs.token_usage * obs.kv_capacity_tokens / obs.running_requests


def update_batch(
    batch: tuple[tuple[int, float, float], ...],
    snapshot: TierStatsSnapshot,
    decay: float,
) -> tuple[tuple[int, float, float], ...]:
    acc = {slot: (b * decay, v * decay) for slot, b, v in batch}
    for tier in snapshot.tiers:
        b, v = acc.get(tier.slot, (0.0, 0.0))
        acc[tier.slot] = (b + tier.batch_size_sum, v + tier.verify_calls)
    return tuple((slot, b, v) for slot, (b, v) in sorted(acc.items()))


def normalise_slots(snapshot: TierStatsSnapshot, bounds: Sequence[int]) -> TierStatsSnapshot:
    """Re-key tiers to the engine's slot bounds (largest bound <= the tier's slot).

    A published table's first bound is always 1, so the engine reports the first slot's
    tiers under 1 even when its own first bound is higher; this merges them back.
    """
    if all(t.slot in bounds for t in snapshot.tiers):
        return snapshot
    merged: dict[tuple[int, int], TierStat] = {}
    for t in snapshot.tiers:
        idx = bisect.bisect_right(bounds, t.slot) - 1
        slot = bounds[max(idx, 0)]
        prev = merged.get((slot, t.steps))
        if prev is None:
            merged[(slot, t.steps)] = replace(t, slot=slot)
            continue
        merged[(slot, t.steps)] = TierStat(
            slot=slot,
            steps=t.steps,
            verify_calls=prev.verify_calls + t.verify_calls,
            requests=prev.requests + t.requests,
            accepted_hist=tuple(
                a + b for a, b in zip(prev.accepted_hist, t.accepted_hist, strict=True)
            ),
            step_time_sum_s=prev.step_time_sum_s + t.step_time_sum_s,
            step_time_count=prev.step_time_count + t.step_time_count,
            batch_size_sum=prev.batch_size_sum + t.batch_size_sum,
        )
    return TierStatsSnapshot(
        window_start_s=snapshot.window_start_s,
        window_end_s=snapshot.window_end_s,
        tiers=tuple(merged[k] for k in sorted(merged)),
    )


def dominant_steps(snapshot: TierStatsSnapshot | None) -> dict[int, int]:
    """Per slot, the steps that ran the most verifies in the window (the engine's choice)."""
    if snapshot is None:
        return {}
    best: dict[int, tuple[int, int]] = {}
    for tier in snapshot.tiers:
        calls = best.get(tier.slot, (-1, 0))[0]
        if tier.verify_calls > calls:
            best[tier.slot] = (tier.verify_calls, tier.steps)
    return {slot: steps for slot, (_, steps) in best.items()}


def expected_gain_of(gains: Sequence[tuple[float, float, float]]) -> float | None:
    if not gains:
        return None
    total_w = sum(w for w, _, _ in gains)
    if total_w <= 0:
        gains = [(1.0, new, cur) for _, new, cur in gains]
    new = sum(w * g for w, g, _ in gains)
    cur = sum(w * g for w, _, g in gains)
    if cur <= 0 or not math.isfinite(new / cur):
        return None
    return new / cur - 1.0


def describe(p: SlotPlan) -> str:
    flags = "".join(
        (" probe" if p.probe else "", " slo-limited" if p.slo_limited else "",
         " budget-limited" if p.budget_limited else "")
    )  # fmt: skip
    rule = ""
    if p.rule is not None:
        cuts = "".join(
            f"<{t:g}<=" + str(k) for t, k in zip(p.rule.thresholds, p.rule.steps[1:], strict=True)
        )
        rule = f" rule={p.rule.steps[0]}{cuts}@{p.rule.prior:.2f}"
    return (
        f"slot {p.slot}: k={p.steps}{flags}{rule} B={p.batch_size:.1f} "
        f"E[L]={p.accept_length:.2f} T={p.step_s * 1e3:.2f}ms TPOT={p.tpot_ms:.2f}ms "
        f"G={p.goodput_tok_s:.0f}tok/s"
    )
