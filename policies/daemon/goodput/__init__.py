"""``goodput``: per slot, the draft steps that maximise expected goodput.

For each batch-size slot the engine built (``Observation.slot_candidates``) the policy
picks, among that slot's candidate steps (and ``Budget.allowed_steps``), the ``k``
maximising::

    G(k, B) = B * E[L(k)] / T_step(B, k, ctx)

* ``E[L(k)]`` — expected tokens per verify from the acceptance estimator
  (:mod:`~specgov.policies.daemon.estimators.acceptance`, per slot and draft position).
* ``T_step`` — predicted step seconds from the step-cost estimator
  (:mod:`~specgov.policies.daemon.estimators.step_cost`), at
* ``B`` — the slot's representative batch size: the mean batch size observed in that
  slot (``batch_size_sum / verify_calls``, decayed with ``half_life_s``), else the
  slot's lower bound (the cheapest batch the slot can see, so an unobserved slot is
  not judged at a load it may never carry), and
* ``ctx`` — KV tokens per request, ``token_usage * kv_capacity_tokens /
  running_requests`` from the observation, else ``default_kv_tokens_per_request``.

``k = 0`` is chosen when speculation does not pay (``E[L(0)] = 1`` at the step cost of
``k = 0``, which still pays the draft-extend pass).

SLO. Without a TPOT SLO (the config's ``slo_tpot_ms``, else the Budget's) the policy
maximises ``G``. With one, the objective is goodput in the SLO sense: ``G`` times the
predicted share of requests whose TPOT meets the SLO. A request's TPOT is modelled as
log-normal around ``scale * T / E[L]``: ``scale`` calibrates the decode-only prediction
on the window (observed median TPOT over the predicted TPOT of what ran: prefill stalls,
model error; at a given throughput a fixed share of the wall time goes to prefill, so
the ratio does not depend on the steps); the log-variance is what the window's p50/p90
show, minus the acceptance part of what ran, plus the acceptance part of the candidate:
a request's mean accept length varies with ``accept_burstiness * Var[L] / (E[L] *
tokens)`` (``tokens`` per request from the e2e, TTFT and TPOT medians). These window
statistics are smoothed over ``slo_half_life_s`` (a window holds a few dozen
completions), and a window counts only once its requests lived under the table in force
from start to end (a request lifetime after a change). Longer drafts
spread TPOTs more: when the median sits above the SLO that puts more requests under it,
when below fewer. Two limits keep this model where it is trustworthy: it is used only
while the observed median TPOT is within ``slo_band_sd`` standard deviations of the SLO
(farther away the SLO is met, or lost, whatever the steps), and only among candidates
within ``slo_tradeoff`` of the slot's best ``G`` (a request at the SLO's edge is not
worth much capacity). Without a usable window (no TPOT quantiles) choices with
predicted TPOT ``T / E[L]`` <= SLO are preferred; when none is, the lowest predicted TPOT
is taken. Either way a decision whose choice misses the SLO (for the median request)
says ``LIMITED_BY_SLO``.

Caution and exploration:

* positions nobody has observed are extrapolated conservatively by the estimator, and
  the exploiting choice considers candidates only up to the first one beyond the
  observed positions;
* an optimistic probe climbs further when it is cheap: a candidate past the evidence is
  probed when, with the unobserved positions continuing the last observed acceptance
  (measured acceptance is flat or rising with position), it would beat the slot's
  choice by more than ``hysteresis``, and when, with every position at its
  conservative bound, it would lose at most ``probe_max_loss`` against staying. At
  small batches verification is nearly free and a probe may jump several steps; at
  large batches every verified token costs compute and the conservative loss forbids
  jumps on no evidence. One probe per decision (the busy slot where it is worth most);
  its evidence arrives within a window, after which the probed positions are observed
  and the exploiting choice takes over;
* a random probe: with probability ``explore`` per decision, at most once per
  ``explore_interval_s``, a candidate whose positions have fewer than ``min_trials``
  trials in that slot and whose predicted goodput is within ``explore_margin`` of the
  best (random draws from a seeded generator kept in the state, so the same inputs give
  the same outputs);
* probes never go to a slot carrying less than ``busy_share`` of the verifies (nothing
  to learn there) and never to a choice predicted to break the SLO under the
  conservative bound. A decision that probes carries no expected gain (an experiment,
  not a prediction), so the guardrails' tolerance band does not veto it; their rollback
  still judges it;
* hysteresis: the current step is kept unless the best is better by more than
  ``hysteresis`` (relative), so estimation noise does not flip the table.

Restart trigger. A table cannot remove what the drafter costs at step 0 (the
draft-extend pass and verify bookkeeping run on every step; the drafter's KV cache and
the candidate steps' graphs shrink the KV pool). Per busy slot the policy also predicts
the goodput (SLO sense) of the same server without the drafter (the learned step-0 time
scaled by the prior's no-drafter/step-0 ratio). When that beats the plan by at least
``restart_min_gain`` (verify-weighted over the busy slots) for at least
``restart_after_s`` and long enough for the gain to pay back ``restart_cost_s`` of
restart downtime, every decision carries ``restart_trigger`` and says why in its message.
The trigger predicts nothing: it asks the restart check (controller/daemon/recommend.py,
the one calibrated predictor) to replay the window now; the recommendation, its gain,
metric and configuration, are the check's.

The decision holds (``HELD_UNKNOWN_TELEMETRY``, no table) when the tier statistics or
the slot candidates are unknown; estimators still learn from whatever arrived. A
table equal to the one in force gives ``HELD_NO_CHANGE`` and no table; an expired
table in force counts as none (it is republished).
"""

from __future__ import annotations

from specgov.policies.daemon.goodput.config import (
    GOODPUT_STATE_VERSION,
    GoodputConfig,
    GoodputConfigError,
)
from specgov.policies.daemon.goodput.model import SlotPlan
from specgov.policies.daemon.goodput.policy import GoodputPolicy
from specgov.policies.daemon.goodput.state import GoodputState

__all__ = [
    "GOODPUT_STATE_VERSION",
    "GoodputConfig",
    "GoodputConfigError",
    "GoodputPolicy",
    "GoodputState",
    "SlotPlan",
]
