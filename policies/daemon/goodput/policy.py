"""GoodputPolicy: learn from each observation, plan per slot, decide (see the package docs)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any, NamedTuple

import numpy as np

from specgov.policies.common.decisions import GoodputPrediction, Plan, ReasonCode
from specgov.policies.common.observation import Observation
from specgov.policies.common.rng import generator, rng_state_of, seeded_rng_state
from specgov.policies.common.step_table import SlotRule, StepTable
from specgov.policies.common.types import Budget
from specgov.policies.daemon.estimators.acceptance import (
    acceptance_estimate,
    initial_acceptance_state,
    update_acceptance,
)
from specgov.policies.daemon.estimators.step_cost import (
    StepCostModel,
    StepCostPrior,
    cost_evidence,
    default_step_cost_prior,
    initial_step_cost_state,
    local_step_s,
    predict_step_s,
    step_cost_bounds,
    step_cost_model,
    update_step_cost,
)
from specgov.policies.daemon.goodput.config import (
    GoodputConfig,
    GoodputConfigError,
)
from specgov.policies.daemon.goodput.decision import goodput_plan
from specgov.policies.daemon.goodput.model import (
    Eval,
    Restart,
    SloModel,
    SlotPlan,
    SlotWork,
    accept_moments,
    dominant_steps,
    drafter_share,
    first_draft_ratios,
    first_scaled,
    flat_past_evidence,
    kv_per_request,
    lived_under_table,
    normalise_slots,
    optimistic_rates,
    ratio_at,
    run_weight,
    slo_sample,
    update_batch,
    update_first_draft,
)
from specgov.policies.daemon.goodput.rules import (
    RULE_TIE,
    RuleEval,
    probe_step,
    scaled_rates,
    slot_rule,
)
from specgov.policies.daemon.goodput.state import GoodputState


class _Weighing(NamedTuple):
    """What a plan weighs every candidate with: the step-cost model, KV tokens per
    request, the TPOT SLO and the SLO model."""

    cost: StepCostModel
    ctx: float
    slo_ms: float | None
    slo: SloModel | None


class GoodputPolicy:
    """Model-based goodput maximiser; see the module docstring."""

    __slots__ = ("_acc_cfg", "_config", "_cost_cfg", "_prior")

    def __init__(
        self, config: GoodputConfig | None = None, *, prior: StepCostPrior | None = None
    ) -> None:
        if config is not None and not isinstance(config, GoodputConfig):
            raise GoodputConfigError(
                f"GoodputPolicy.config: expected a GoodputConfig, got {type(config).__name__}"
            )
        if prior is not None and not isinstance(prior, StepCostPrior):
            raise GoodputConfigError(
                f"GoodputPolicy.prior: expected a StepCostPrior, got {type(prior).__name__}"
            )
        self._config = config or GoodputConfig()
        self._prior = prior or default_step_cost_prior()
        self._acc_cfg = self._config.acceptance_config()
        self._cost_cfg = self._config.step_cost_config()

    @property
    def name(self) -> str:
        params = self._config.to_params()
        if not params:
            return "goodput"
        return "goodput:" + ",".join(f"{k}={v}" for k, v in params.items())

    @property
    def config(self) -> GoodputConfig:
        return self._config

    def initial_state(self) -> GoodputState:
        return GoodputState(
            acceptance=initial_acceptance_state((), self._acc_cfg),
            step_cost=initial_step_cost_state(self._prior, self._cost_cfg),
            last_slots=None,
            rng_state=seeded_rng_state(self._config.seed),
        )

    def state_from_dict(self, data: Mapping[str, Any]) -> GoodputState:
        return GoodputState.from_dict(data)

    # ---------------------------------------------------------------- learning

    def _learn(self, obs: Observation, state: GoodputState, **also: Any) -> GoodputState:
        """``state`` with this observation absorbed (and the fields in ``also`` set).

        One new state, not one per field: each construction validates every field.
        """
        snap = obs.tier_stats
        if snap is None:
            return replace(state, **also) if also else state
        if obs.slot_candidates:
            snap = normalise_slots(snap, tuple(b for b, _ in obs.slot_candidates))
        last = state.acceptance.last_time_s
        if last is not None and snap.window_end_s <= last:
            return replace(state, **also) if also else state  # seen already
        dt = 0.0 if last is None else snap.window_end_s - last
        step_cost = update_step_cost(
            state.step_cost,
            snap,
            kv_tokens_per_request=kv_per_request(obs),
            config=self._cost_cfg,
        )
        in_force = obs.table.slots if obs.table is not None else ()  # (): the fallback
        seen_slots, seen_since_s = state.seen_slots, state.seen_since_s
        if seen_since_s is None or in_force != seen_slots:
            seen_slots, seen_since_s = in_force, obs.time_s
        slo_stats = state.slo_stats
        cfg = self._config
        model = step_cost_model(step_cost, self._cost_cfg)
        sample = slo_sample(
            obs, model, snap, cfg.default_kv_tokens_per_request, cfg.accept_burstiness
        )
        if sample is not None and lived_under_table(obs, seen_since_s, snap):
            # A window holds a few dozen completions: smooth over several.
            if slo_stats is None:
                decay = 0.0
            else:
                elapsed_s = max(0.0, obs.time_s - slo_stats[0])
                decay = 0.5 ** (elapsed_s / self._config.slo_half_life_s)
            sums = (0.0,) * 6 if slo_stats is None else slo_stats[1:]
            slo_stats = (obs.time_s, sums[0] * decay + 1.0) + tuple(
                old * decay + new for old, new in zip(sums[1:], sample, strict=True)
            )
        acceptance = update_acceptance(state.acceptance, snap, self._acc_cfg)
        decay = 0.5 ** (dt / self._config.half_life_s)
        shifted = [s.slot for s in acceptance.slots if s.last_change_s == snap.window_end_s]
        return replace(
            state,
            acceptance=acceptance,
            step_cost=step_cost,
            batch=update_batch(state.batch, snap, decay),
            first_draft=update_first_draft(state.first_draft, snap, decay, shifted),
            seen_slots=seen_slots,
            seen_since_s=seen_since_s,
            slo_stats=slo_stats,
            **also,
        )

    # ---------------------------------------------------------------- decision

    def _evaluate(
        self,
        rates: Sequence[float],
        cost: StepCostModel,
        batch: float,
        ctx: float,
        k: int,
        slo: SloModel | None,
        step_s: float | None = None,
    ) -> Eval:
        """``step_s``: the step time to assume (None: the fit's prediction)."""
        el, var = accept_moments(rates, k)
        if step_s is None:
            step_s = local_step_s(cost, batch, k, ctx * batch)
        t = step_s
        tpot_ms = 1e3 * t / el
        fraction = 1.0 if slo is None else slo.fraction(tpot_ms, el, var)
        return Eval(el, t, batch * el / t, tpot_ms, fraction)

    def decide(
        self, observation: Observation, state: GoodputState, budget: Budget
    ) -> tuple[Plan, GoodputState]:
        state = self._learn(observation, state, decisions=state.decisions + 1)
        if observation.tier_stats is None or not observation.slot_candidates:
            missing = "tier statistics" if observation.tier_stats is None else "slot candidates"
            return (
                Plan(
                    slots=None,
                    reason=ReasonCode.HELD_UNKNOWN_TELEMETRY,
                    message=f"goodput: holding the table: {missing} unknown",
                    expected_gain=None,
                    limited_by=("telemetry",),
                ),
                state,
            )
        current = observation.table
        if current is not None and current.is_expired(observation.time_s):
            current = None  # not in force any more: whatever we decide is a change
        plans, gains, state, predictions = self._plan(observation, state, budget, current)
        state, restart = self._restart(observation, state, plans)
        plan, state = goodput_plan(state, current, plans, gains, restart)
        return replace(plan, predictions=predictions), state

    def plan(
        self, observation: Observation, state: GoodputState, budget: Budget
    ) -> tuple[SlotPlan, ...]:
        """The per-slot choices and predictions ``decide`` would make (for reports, tests).

        Empty when the telemetry is unknown.
        """
        state = self._learn(observation, state)
        if observation.tier_stats is None or not observation.slot_candidates:
            return ()
        current = observation.table
        if current is not None and current.is_expired(observation.time_s):
            current = None
        return self._plan(observation, state, budget, current)[0]

    # ------------------------------------------------------------- SLO model

    def _slo_model(self, state: GoodputState, slo_ms: float | None) -> SloModel | None:
        """The per-request TPOT model from the smoothed windows, when near the SLO."""
        stats = state.slo_stats
        if slo_ms is None or stats is None or stats[1] <= 0:
            return None
        w = stats[1]
        log_p50, log_scale, var, base_var, log_tokens = (v / w for v in stats[2:])
        if abs(math.log(slo_ms) - log_p50) > self._config.slo_band_sd * math.sqrt(var):
            return None  # met (or lost) by a wide margin whatever the steps
        return SloModel(
            slo_ms=slo_ms,
            scale=math.exp(log_scale),
            base_var=base_var,
            tokens=math.exp(log_tokens),
            burstiness=self._config.accept_burstiness,
        )

    # ---------------------------------------------------------------- choice

    def _choose(
        self,
        evals: Mapping[int, Eval],
        cur: int | None,
        slo_ms: float | None,
        slo: SloModel | None,
    ) -> tuple[int, bool]:
        """The exploiting choice of one slot and whether the SLO limited it."""
        hysteresis = self._config.hysteresis
        if slo is not None:
            # Goodput in the SLO sense, among the steps within slo_tradeoff of the best
            # throughput: a lost request is only worth so much capacity.
            top = max(e.goodput for e in evals.values())
            pool = [
                k for k, e in evals.items() if e.goodput >= top * (1.0 - self._config.slo_tradeoff)
            ]
            best = max(pool, key=lambda k: (evals[k].score, -k))
            if (
                cur is not None
                and cur in pool
                and cur != best
                and evals[cur].score >= evals[best].score * (1.0 - hysteresis)
            ):
                best = cur
            return best, evals[best].slo_fraction < 0.5
        feasible = [k for k, e in evals.items() if slo_ms is None or e.tpot_ms <= slo_ms]
        slo_limited = not feasible
        if feasible:
            best = max(feasible, key=lambda k: (evals[k].goodput, -k))
        else:
            best = min(evals, key=lambda k: (evals[k].tpot_ms, k))
        if (
            cur is not None
            and cur in evals
            and cur != best
            and (cur in feasible or slo_limited)
            and evals[cur].goodput >= evals[best].goodput * (1.0 - hysteresis)
        ):
            best = cur
        return best, slo_limited

    def _optimistic_probe(self, work: Sequence[SlotWork], ws: _Weighing) -> tuple[int, int] | None:
        """(slot, steps) of the most valuable safe optimistic probe, if any.

        Candidates are the steps that would use positions past the evidence. One is
        worth probing when, with those positions at the optimistic rates, some such step
        beats the slot's choice by more than ``hysteresis``; it is safe when, with every
        position at its conservative bound, it loses at most ``probe_max_loss`` against
        staying with that choice (and meets the SLO). Where verification is nearly free
        (small batches) that allows a jump of several steps; where every verified token
        costs compute (large batches) even one step past the evidence is often unsafe.
        """
        cfg = self._config
        cost, ctx, slo_ms, slo = ws
        chosen: tuple[float, int, int] | None = None
        for w in work:
            if w.share <= 0 or w.share < cfg.busy_share:
                continue  # a probe of an idle slot learns nothing
            informative = [k for k in w.allowed if k > w.est.observed and k != w.best]
            if not informative:
                continue
            base = w.evals[w.best].score
            if base <= 0:
                continue  # nothing within the SLO either way: no measure of a gain
            # The pessimistic world: every position at its conservative bound, for the
            # probe and for staying alike (the loss is relative to staying).
            base_low = self._evaluate(w.est.lower, cost, w.batch, ctx, w.best, slo).score
            opt_rates = optimistic_rates(w.est)
            opt = {k: self._evaluate(opt_rates, cost, w.batch, ctx, k, slo) for k in informative}
            if max(e.score for e in opt.values()) < base * (1.0 + cfg.hysteresis):
                continue
            safe = []
            for k in informative:
                if opt[k].score < base:
                    continue
                low = self._evaluate(w.est.lower, cost, w.batch, ctx, k, slo)
                if low.score < base_low * (1.0 - cfg.probe_max_loss):
                    continue
                if slo is None and slo_ms is not None and low.tpot_ms > slo_ms:
                    continue
                safe.append(k)
            if not safe:
                continue
            k = max(safe, key=lambda k: (opt[k].score, -k))
            value = w.share * (opt[k].score / base - 1.0)
            if chosen is None or value > chosen[0]:
                chosen = (value, w.bound, k)
        return None if chosen is None else (chosen[1], chosen[2])

    def _cost_probe(self, work: Sequence[SlotWork], ws: _Weighing) -> tuple[int, int] | None:
        """(slot, steps) of the most valuable cost probe, if any.

        The fit learns the cost of a step count from windows run at it; from one step
        count alone it cannot tell the cost's slope in the steps and takes it from the
        prior, which a prior for other hardware gets wrong (``step_cost_bounds``). So a
        busy slot's neighbouring candidates (the next lower and higher allowed step)
        with less than ``cost_probe_evidence`` windows (``cost_evidence``) near the
        slot's batch size, and acceptance observed up to them (past the evidence the
        loss-bounded optimistic probe decides), are candidates; one is probed when,
        at the favourable end of its step-time bounds, it would beat the slot's choice
        by more than ``hysteresis``, and the current
        model (the fit) predicts it to lose at most ``probe_max_loss``: a near tie that
        only the prior's slope decides. The pessimistic end of the bounds is not the
        loss bound (they are wide exactly when the prior was measured wrong); the probe
        is an experiment that ends itself, since running it gives the neighbour the
        evidence it lacked. At the pessimistic end it must still meet the SLO (when
        there is one and no SLO model).
        """
        cfg = self._config
        cost, ctx, slo_ms, slo = ws
        need = cfg.cost_probe_evidence
        chosen: tuple[float, int, int] | None = None
        for w in work:
            if w.share <= 0 or w.share < cfg.busy_share:
                continue
            base = w.evals[w.best].score
            if base <= 0:
                continue
            lower = [k for k in w.allowed if k < w.best]
            upper = [k for k in w.allowed if k > w.best]
            neighbours = ([max(lower)] if lower else []) + ([min(upper)] if upper else [])
            for k in neighbours:
                if k > w.est.observed:
                    continue  # acceptance unknown too: the optimistic probe's (loss-bounded)
                if cost_evidence(cost, w.batch, k) >= need:
                    continue
                low_s, high_s = step_cost_bounds(cost, w.batch, k, ctx * w.batch, min_evidence=need)
                rates = first_scaled(w.est.mean, ratio_at(w.first_ratio, k))
                opt = self._evaluate(rates, cost, w.batch, ctx, k, slo, step_s=low_s)
                if opt.score <= base * (1.0 + cfg.hysteresis):
                    continue
                # Near-tied by the current model: predicted to lose at most probe_max_loss
                # of throughput (the SLO share is steep in the step time, so it would
                # turn a small cost error into a large predicted loss).
                expected = w.evals.get(k) or self._evaluate(rates, cost, w.batch, ctx, k, slo)
                if expected.goodput < w.evals[w.best].goodput * (1.0 - cfg.probe_max_loss):
                    continue
                if slo is None and slo_ms is not None:
                    worst = self._evaluate(rates, cost, w.batch, ctx, k, slo, step_s=high_s)
                    if worst.tpot_ms > slo_ms:
                        continue
                value = w.share * (opt.score / base - 1.0)
                if chosen is None or value > chosen[0]:
                    chosen = (value, w.bound, k)
        return None if chosen is None else (chosen[1], chosen[2])

    def _slot_rule(self, w: SlotWork, ws: _Weighing, in_force: SlotRule | None) -> SlotRule | None:
        """The slot's live-acceptance rule (``rules.slot_rule``) over the candidates its
        plan weighed, with the plan's acceptance profiles, step times and SLO model."""
        cost, ctx, slo_ms, slo = ws
        ratios = w.first_ratio
        flat = flat_past_evidence(w.est)
        # The signal is the first-draft rate at the steps that run (``signal_steps``); a
        # candidate's own first-position rate is that times its ratio over theirs.
        ref = ratio_at(ratios, w.signal_steps)

        def evaluate(signal: float, k: int) -> RuleEval:
            ratio = ratio_at(ratios, k)
            rates = first_scaled(w.est.mean if k <= w.est.observed else flat, ratio)
            rates = scaled_rates(rates, signal * ratio / ref)
            step_s = w.evals[k].step_s if k in w.evals else None
            e = self._evaluate(rates, cost, w.batch, ctx, k, slo, step_s)
            return RuleEval(e.accept_length, e.step_s, e.slo_fraction)

        hard_slo_ms = slo_ms if slo is None else None
        cands = tuple(sorted(w.evals))
        # The incumbent is the plan's choice, which keeps the step in force near a tie.
        return slot_rule(
            first_scaled(w.est.mean, ref),
            cands,
            w.allowed,
            w.batch,
            evaluate,
            hard_slo_ms,
            w.best,
            RULE_TIE,
            in_force,
        )

    def _plan(
        self,
        observation: Observation,
        state: GoodputState,
        budget: Budget,
        current: StepTable | None,
    ) -> tuple[
        tuple[SlotPlan, ...],
        list[tuple[float, float, float]],
        GoodputState,
        tuple[GoodputPrediction, ...],
    ]:
        cfg = self._config
        slo_ms = cfg.slo_tpot_ms if cfg.slo_tpot_ms is not None else budget.slo_tpot_ms
        ctx = kv_per_request(observation)
        if ctx is None:
            ctx = cfg.default_kv_tokens_per_request
        cost = step_cost_model(state.step_cost, self._cost_cfg)
        ws = _Weighing(cost, ctx, slo_ms, self._slo_model(state, slo_ms))
        work = self._slot_work(observation, state, budget, current, ws)
        probes, state = self._probes(work, state, observation.time_s, ws)
        weights = {slot: v for slot, _, v in state.batch}
        plans, gains, predicted = self._slot_plans(work, probes, current, weights, ws)
        return plans, gains, state, predicted

    def _slot_work(
        self,
        observation: Observation,
        state: GoodputState,
        budget: Budget,
        current: StepTable | None,
        ws: _Weighing,
    ) -> list[SlotWork]:
        """Per slot (of the observation's layout, which the callers checked is known): the
        allowed and eligible steps, their evaluations and the best."""
        slot_candidates = observation.slot_candidates or ()
        cost, ctx, slo_ms, slo = ws
        batch_of = {slot: (b / v if v > 1e-9 else None) for slot, b, v in state.batch}
        snap = observation.tier_stats
        if snap is not None:
            snap = normalise_slots(snap, tuple(b for b, _ in slot_candidates))
        running_steps = dominant_steps(snap)
        weights = {slot: v for slot, _, v in state.batch}
        total_w = sum(weights.values())
        work: list[SlotWork] = []
        for bound, cands in slot_candidates:
            allowed = tuple(
                k for k in cands if budget.allowed_steps is None or k in budget.allowed_steps
            )
            budget_limited = not allowed
            if budget_limited:
                allowed = (min(cands),)  # nothing allowed was built: the least speculation
            est = acceptance_estimate(state.acceptance, bound, self._acc_cfg)
            rep = batch_of.get(bound)
            batch = float(bound) if rep is None else rep
            cur = current.steps_for(bound) if current is not None else running_steps.get(bound)

            # Exploitation looks one candidate past the evidence, no further (probes may).
            eligible = sorted({k for k in allowed if k <= est.observed})
            beyond = [k for k in allowed if k > est.observed]
            if beyond:
                eligible.append(min(beyond))
            if cur is not None and cur in allowed and cur not in eligible:
                eligible.append(cur)
            ratios = first_draft_ratios(
                state.first_draft, bound, self._config.min_trials, run_weight(est.mean)
            )
            flat = flat_past_evidence(est)
            evals = {
                k: self._evaluate(
                    first_scaled(est.mean if k <= est.observed else flat, ratio_at(ratios, k)),
                    cost,
                    batch,
                    ctx,
                    k,
                    slo,
                )
                for k in eligible
            }
            best, slo_limited = self._choose(evals, cur, slo_ms, slo)
            share = weights.get(bound, 0.0) / total_w if total_w > 0 else 0.0
            # The engine's live signal is measured at the steps that ran; at 0, at those
            # of its probes: the rule in force's probe step.
            ran = running_steps.get(bound, cur if cur is not None else best)
            rule = None if current is None else current.rule_for(bound)
            if ran == 0:
                ran = (rule.probe_step if rule is not None else probe_step(allowed)) or 0
            work.append(
                SlotWork(
                    bound,
                    allowed,
                    budget_limited,
                    est,
                    batch,
                    cur,
                    evals,
                    best,
                    slo_limited,
                    share,
                    ratios,
                    ran,
                )
            )
        return work

    def _probes(
        self, work: Sequence[SlotWork], state: GoodputState, now: float, ws: _Weighing
    ) -> tuple[dict[int, int], GoodputState]:
        """{slot: steps} of this decision's probe, if any (loss-bounded optimistic, else
        cost, else now and then a random one), and the state with the random draw."""
        cfg = self._config
        probes: dict[int, int] = {}
        if cfg.probe_max_loss > 0:
            found = self._optimistic_probe(work, ws)
            if found is not None:
                probes[found[0]] = found[1]
        if not probes and cfg.cost_probe_evidence > 0:
            found = self._cost_probe(work, ws)
            if found is not None:
                probes[found[0]] = found[1]
        probe_open = (
            not probes
            and cfg.explore > 0
            and (state.last_probe_s is None or now - state.last_probe_s >= cfg.explore_interval_s)
        )
        rng = generator(state.rng_state) if probe_open else None
        if rng is not None:
            self._random_probe(work, rng, probes, ws)
            last_probe_s = now if probes else state.last_probe_s
            state = replace(state, rng_state=rng_state_of(rng), last_probe_s=last_probe_s)
        return probes, state

    def _random_probe(
        self,
        work: Sequence[SlotWork],
        rng: np.random.Generator,
        probes: dict[int, int],
        ws: _Weighing,
    ) -> None:
        """Random probe (into *probes*): an uncertain candidate predicted near the best,
        now and then."""
        cfg = self._config
        cost, ctx, slo_ms, slo = ws
        for w in work:
            if w.share <= 0 or w.share < cfg.busy_share:
                continue  # a probe of an idle slot learns nothing
            uncertain_from = w.est.uncertain_from(cfg.min_trials)
            options = []
            for k, e in w.evals.items():
                if k == w.best or k < uncertain_from:
                    continue
                if e.score < w.evals[w.best].score * (1.0 - cfg.explore_margin):
                    continue
                low = self._evaluate(w.est.lower, cost, w.batch, ctx, k, slo)
                if slo_ms is not None and (
                    low.tpot_ms > slo_ms if slo is None else low.slo_fraction < 0.5
                ):
                    continue
                options.append(k)
            if options and rng.random() < cfg.explore:
                probes[w.bound] = max(options, key=lambda k: (w.evals[k].score, -k))
                break

    def _slot_plans(
        self,
        work: Sequence[SlotWork],
        probes: Mapping[int, int],
        current: StepTable | None,
        weights: Mapping[int, float],
        ws: _Weighing,
    ) -> tuple[
        tuple[SlotPlan, ...], list[tuple[float, float, float]], tuple[GoodputPrediction, ...]
    ]:
        """Per slot its plan (a probe's steps, else the best), the table's gain terms and
        the goodput predicted for every step evaluated."""
        cost, ctx, _, slo = ws
        plans: list[SlotPlan] = []
        gains: list[tuple[float, float, float]] = []  # (weight, new score, current score)
        predicted: dict[tuple[int, int], GoodputPrediction] = {}
        for w in work:
            # A probe is a fixed experiment; elsewhere the engine follows the slot's rule,
            # and the slot's step is the rule's at the prior (where the engine starts).
            in_force = None if current is None else current.rule_for(w.bound)
            rule = None if w.bound in probes else self._slot_rule(w, ws, in_force)
            steps = probes.get(w.bound, w.best if rule is None else rule.steps_at(rule.prior))
            e = w.evals.get(steps) or self._evaluate(
                first_scaled(w.est.mean, ratio_at(w.first_ratio, steps)),
                cost,
                w.batch,
                ctx,
                steps,
                slo,
            )
            for k, ev in (*w.evals.items(), (steps, e)):
                predicted[(w.bound, k)] = GoodputPrediction(w.bound, k, ev.goodput, w.share)
            plans.append(
                SlotPlan(
                    slot=w.bound,
                    steps=steps,
                    batch_size=w.batch,
                    accept_length=e.accept_length,
                    step_s=e.step_s,
                    goodput_tok_s=e.goodput,
                    tpot_ms=e.tpot_ms,
                    slo_limited=w.slo_limited,
                    budget_limited=w.budget_limited,
                    probe=w.bound in probes,
                    slo_fraction=e.slo_fraction,
                    no_drafter_score_tok_s=self._no_drafter(cost, w.batch, ctx, slo),
                    rule=rule,
                )
            )
            if w.cur is not None:
                cur_eval = w.evals.get(w.cur) or self._evaluate(
                    first_scaled(w.est.mean, ratio_at(w.first_ratio, w.cur)),
                    cost,
                    w.batch,
                    ctx,
                    w.cur,
                    slo,
                )
                # A probe predicts nothing: the table's gain counts its slot as unchanged.
                new_score = cur_eval.score if w.bound in probes else e.score
                gains.append((weights.get(w.bound, 0.0), new_score, cur_eval.score))
                predicted[(w.bound, w.cur)] = GoodputPrediction(
                    w.bound, w.cur, cur_eval.goodput, w.share
                )
        return tuple(plans), gains, tuple(predicted.values())

    # --------------------------------------------------------------- restart

    def _restart(
        self, observation: Observation, state: GoodputState, plans: Sequence[SlotPlan]
    ) -> tuple[GoodputState, Restart | None]:
        """Trigger the restart check once a server without the drafter has looked better.

        A step table cannot remove what the drafter costs at step 0 (the draft-extend
        pass and verify bookkeeping run on every step, and the candidate steps' graphs
        and the draft KV cache shrink the KV pool): only a restart without speculation
        can. When, in the busy slots (verify-weighted), the predicted goodput (SLO sense)
        of the same server without the drafter beats the plan's by ``restart_min_gain``
        for at least ``restart_after_s`` on end and ``gain * held_s >= restart_cost_s``,
        the decision carries a restart trigger. That is all it is: this per-slot estimate
        is not calibrated (users-256/h100/ngram, measured: +193 % goodput where replaying
        the plain server gained +13 % throughput), so whether a restart pays, on which
        metric and into what, is the restart check's (controller/daemon/recommend.py).
        """
        cfg = self._config
        now = observation.time_s
        weights = {slot: v for slot, _, v in state.batch}
        total = sum(weights.values())
        busy = [
            p
            for p in plans
            if total > 0
            and weights.get(p.slot, 0.0) > 0
            and weights.get(p.slot, 0.0) / total >= cfg.busy_share
            and p.no_drafter_score_tok_s is not None
        ]
        gain = 0.0
        if busy:
            plan_sum = sum(weights[p.slot] * p.score_tok_s for p in busy)
            bare_sum = sum(weights[p.slot] * (p.no_drafter_score_tok_s or 0.0) for p in busy)
            gain = bare_sum / plan_sum - 1.0 if plan_sum > 0 else 0.0
        since = state.restart_since_s
        if cfg.restart_after_s > 0 and busy and gain >= cfg.restart_min_gain:
            since = now if since is None else since
        else:
            since = None
        if since != state.restart_since_s:
            state = replace(state, restart_since_s=since)
        # Whatever has lasted t is as likely as not to last t more: recommend once the
        # gain over the time held so far would pay for the restart's downtime.
        payback_s = cfg.restart_cost_s / max(gain, 1e-9)
        if since is None or now - since < max(cfg.restart_after_s, payback_s):
            return state, None
        ctx = kv_per_request(observation) or cfg.default_kv_tokens_per_request
        w_sum = sum(weights[p.slot] for p in busy)
        prior = state.step_cost.prior
        overhead = sum(weights[p.slot] * drafter_share(prior, p.batch_size, ctx) for p in busy)
        return state, Restart(
            since_s=since,
            held_s=now - since,
            slots=tuple(p.slot for p in busy),
            steps=tuple(p.steps for p in busy),
            min_gain=cfg.restart_min_gain,
            overhead=overhead / w_sum,
        )

    def _no_drafter(
        self, cost: StepCostModel, batch: float, ctx: float, slo: SloModel | None
    ) -> float | None:
        """Goodput (SLO sense) of this slot on the same server without the drafter.

        The learned step-0 time scaled by the prior's no-drafter / step-0 ratio (the
        learned coefficients cannot tell the drafter's part of a step-0 step apart).
        """
        prior = cost.state.prior
        if not prior.speculative or batch <= 0:
            return None
        share = drafter_share(prior, batch, ctx)
        step_s = predict_step_s(cost.state, batch, 0, ctx * batch) * (1.0 - share)
        tpot_ms = 1e3 * step_s
        fraction = 1.0 if slo is None else slo.fraction(tpot_ms, 1.0, 0.0)
        return batch / step_s * fraction
