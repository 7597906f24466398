"""``goodput``: per slot, the draft steps that maximise expected goodput.

For each batch-size slot the engine built (``Observation.slot_candidates``) the policy
picks, among that slot's candidate steps (and ``Budget.allowed_steps``), the ``k``
maximising::

    G(k, B) = B * E[L(k)] / T_step(B, k, ctx)

* ``E[L(k)]`` — expected tokens per verify from the acceptance estimator
  (:mod:`~specgov.policies.estimators.acceptance`, per slot and draft position).
* ``T_step`` — predicted step seconds from the step-cost estimator
  (:mod:`~specgov.policies.estimators.step_cost`), at
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

Restart recommendation. A table cannot remove what the drafter costs at step 0 (the
draft-extend pass and verify bookkeeping run on every step; the drafter's KV cache and
the candidate steps' graphs shrink the KV pool). Per busy slot the policy also predicts
the goodput (SLO sense) of the same server without the drafter (the learned step-0 time
scaled by the prior's no-drafter/step-0 ratio). When that beats the plan by at least
``restart_min_gain`` (verify-weighted over the busy slots) for at least
``restart_after_s`` and long enough for the gain to pay back ``restart_cost_s`` of
restart downtime, every decision carries ``restart_recommendation`` (a ``SpecShape``
with algorithm ``NONE``) and says why in its message.

The decision holds (``HELD_UNKNOWN_TELEMETRY``, no table) when the tier statistics or
the slot candidates are unknown; estimators still learn from whatever arrived. A
table equal to the one in force gives ``HELD_NO_CHANGE`` and no table; an expired
table in force counts as none (it is republished).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any, Final

import numpy as np

from specgov.policies.estimators.acceptance import (
    AcceptanceConfig,
    AcceptanceEstimate,
    AcceptanceState,
    acceptance_estimate,
    initial_acceptance_state,
    update_acceptance,
)
from specgov.policies.estimators.step_cost import (
    StepCostConfig,
    StepCostPrior,
    StepCostState,
    default_step_cost_prior,
    initial_step_cost_state,
    predict_step_s,
    update_step_cost,
)
from specgov.policies.types import (
    Budget,
    Decision,
    Observation,
    PolicyTypeError,
    ReasonCode,
    RestartRecommendation,
    SpecShape,
    StepTable,
    TierStat,
    TierStatsSnapshot,
)

__all__ = [
    "GOODPUT_STATE_VERSION",
    "GoodputConfig",
    "GoodputConfigError",
    "GoodputPolicy",
    "GoodputState",
    "SlotPlan",
]

GOODPUT_STATE_VERSION: Final = 2
# Version 1 states are read too: the fields version 2 added start unknown (None).
_READABLE_VERSIONS: Final = (1, 2)


# SLO model constants (see _SloModel): the normal quantile of p90; the log-TPOT spread
# assumed when the window has no p90, and its floor; a typical request's output tokens
# when the window cannot tell, and the range an estimate is clipped to.
_Z90: Final = 1.2816
_DEFAULT_LOG_SPREAD: Final = 0.15
_MIN_LOG_SPREAD: Final = 0.02
_DEFAULT_REQUEST_TOKENS: Final = 256.0
_MIN_REQUEST_TOKENS: Final = 8.0
_MAX_REQUEST_TOKENS: Final = 8192.0
# Nodes and weights (summing to 1) of Gauss-Hermite quadrature against N(0, 1).
_GAUSS_HERMITE: Final = tuple(
    (float(x), float(w) / math.sqrt(2.0 * math.pi))
    for x, w in zip(*np.polynomial.hermite_e.hermegauss(12), strict=True)
)


class GoodputConfigError(ValueError):
    """A goodput parameter is invalid; the message names the key and the valid form."""


# --------------------------------------------------------------------------- config

_OPTIONAL_FLOAT: Final = frozenset({"slo_tpot_ms"})
_INT_KEYS: Final = frozenset({"seed", "max_steps"})


@dataclass(frozen=True, slots=True)
class GoodputConfig:
    """Parameters of the goodput policy (documented defaults).

    Every field can be given as a string (``GoodputConfig.from_params``), as in the
    policy spec ``goodput:slo_tpot_ms=40,explore=0.05``.
    """

    # TPOT SLO in ms; None: the Budget's slo_tpot_ms (None there too: no SLO).
    slo_tpot_ms: float | None = None
    # Probability, per decision, of a random probe of an uncertain near-best candidate
    # (rare: the optimistic probes below do the climbing; 0 turns random probes off).
    explore: float = 0.05
    # Probe only candidates predicted within this fraction of the best goodput.
    explore_margin: float = 0.1
    # At most one random probe (over all slots) per this many seconds.
    explore_interval_s: float = 300.0
    # Keep the current step unless the best is better by more than this fraction.
    hysteresis: float = 0.02
    # Slot trials per position below which a candidate counts as uncertain.
    min_trials: float = 50.0
    # Acceptance memory (slow) and change-detector memory (fast), seconds.
    half_life_s: float = 60.0
    fast_half_life_s: float = 3.0
    # Step-cost sample memory, seconds.
    cost_half_life_s: float = 600.0
    # Lifetime of a published table.
    ttl_s: float = 30.0
    # Seed of the probe generator.
    seed: int = 0
    # Draft positions the acceptance estimator tracks.
    max_steps: int = 7
    # Prior acceptance per position before any data.
    prior_mean: float = 0.6
    # KV tokens per request when the observation cannot tell.
    default_kv_tokens_per_request: float = 1024.0
    # Optimistic probes: the most goodput (fraction of the slot's best) a probe may cost
    # if every unobserved position turned out at its conservative bound; 0: no such probes.
    probe_max_loss: float = 0.04
    # SLO-aware choice: the throughput (fraction of the slot's best goodput) the policy
    # may give up for more tokens within the TPOT SLO.
    slo_tradeoff: float = 0.03
    # SLO-aware choice only while the observed median TPOT is within this many standard
    # deviations (of log TPOT) of the SLO; farther away the SLO is met or lost whatever
    # the steps.
    slo_band_sd: float = 2.0
    # Memory of the per-request TPOT statistics (the windows' quantiles), seconds.
    slo_half_life_s: float = 30.0
    # Variance inflation of a request's mean accept length: accepted runs cluster, so
    # consecutive verifies of one request are not independent (1 = independent).
    accept_burstiness: float = 3.0
    # A slot is busy when it holds at least this share of the (decayed) verifies.
    busy_share: float = 0.05
    # Recommend a restart without speculation once a server without the drafter has
    # been predicted to beat the best table in the busy slots by at least
    # restart_min_gain (goodput in the SLO sense) for at least restart_after_s (0: never
    # recommend) and long enough that the gain pays back restart_cost_s, the downtime
    # of a restart (weights, CUDA graphs), had it lasted as long again.
    restart_after_s: float = 60.0
    restart_min_gain: float = 0.05
    restart_cost_s: float = 60.0

    def __post_init__(self) -> None:
        def bad(key: str, expected: str, value: object) -> GoodputConfigError:
            return GoodputConfigError(
                f"goodput: parameter {key!r}: expected {expected}, got {value!r}"
            )

        def real(value: object) -> bool:
            return (
                isinstance(value, int | float)
                and not isinstance(value, bool)
                and math.isfinite(float(value))
            )

        if self.slo_tpot_ms is not None and (not real(self.slo_tpot_ms) or self.slo_tpot_ms <= 0):
            raise bad("slo_tpot_ms", "a number > 0 (ms) or none", self.slo_tpot_ms)
        for key in (
            "explore",
            "explore_margin",
            "hysteresis",
            "probe_max_loss",
            "slo_tradeoff",
            "busy_share",
            "restart_min_gain",
        ):
            value = getattr(self, key)
            if not real(value) or not 0.0 <= value <= 1.0:
                raise bad(key, "a number in [0, 1]", value)
        for key in (
            "explore_interval_s",
            "slo_half_life_s",
            "half_life_s",
            "fast_half_life_s",
            "cost_half_life_s",
            "ttl_s",
        ):
            value = getattr(self, key)
            if not real(value) or value <= 0:
                raise bad(key, "a number > 0 (seconds)", value)
        for key in (
            "min_trials",
            "default_kv_tokens_per_request",
            "restart_after_s",
            "restart_cost_s",
        ):
            value = getattr(self, key)
            if not real(value) or value < 0:
                raise bad(key, "a number >= 0", value)
        if not real(self.slo_band_sd) or self.slo_band_sd <= 0:
            raise bad("slo_band_sd", "a number > 0", self.slo_band_sd)
        if not real(self.accept_burstiness) or self.accept_burstiness < 1.0:
            raise bad("accept_burstiness", "a number >= 1", self.accept_burstiness)
        if not real(self.prior_mean) or not 0.0 < self.prior_mean < 1.0:
            raise bad("prior_mean", "a number in (0, 1)", self.prior_mean)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise bad("seed", "an int >= 0", self.seed)
        if (
            isinstance(self.max_steps, bool)
            or not isinstance(self.max_steps, int)
            or not 1 <= self.max_steps <= 64
        ):
            raise bad("max_steps", "an int in 1..64", self.max_steps)
        if self.fast_half_life_s >= self.half_life_s:
            raise bad(
                "fast_half_life_s",
                f"a number < half_life_s={self.half_life_s}",
                self.fast_half_life_s,
            )

    @classmethod
    def param_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def from_params(cls, params: Mapping[str, object]) -> GoodputConfig:
        """Build from ``key -> value`` (strings as in a policy spec, or numbers)."""
        valid = cls.param_names()
        kwargs: dict[str, Any] = {}
        for key, raw in params.items():
            if key not in valid:
                raise GoodputConfigError(
                    f"goodput: unknown parameter {key!r}; valid keys: {', '.join(valid)}"
                )
            kwargs[key] = _parse_value(key, raw)
        return cls(**kwargs)

    def to_params(self) -> dict[str, str]:
        """The parameters that differ from the defaults, as spec strings."""
        default = GoodputConfig()
        out: dict[str, str] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value != getattr(default, f.name):
                out[f.name] = _format_value(value)
        return out

    def acceptance_config(self) -> AcceptanceConfig:
        return AcceptanceConfig(
            max_steps=self.max_steps,
            half_life_s=self.half_life_s,
            fast_half_life_s=self.fast_half_life_s,
            prior_mean=self.prior_mean,
        )

    def step_cost_config(self) -> StepCostConfig:
        return StepCostConfig(
            half_life_s=self.cost_half_life_s,
            default_kv_tokens_per_request=self.default_kv_tokens_per_request,
        )


def _format_value(value: object) -> str:
    if value is None:
        return "none"
    if isinstance(value, float):
        short = f"{value:g}"  # 40 rather than 40.0, unless that loses digits
        return short if float(short) == value else repr(value)
    return str(value)


def _parse_value(key: str, raw: object) -> object:
    if not isinstance(raw, str):
        return raw  # numbers are validated by the dataclass
    text = raw.strip()
    if key in _OPTIONAL_FLOAT and text.lower() in ("none", "off", ""):
        return None
    try:
        if key in _INT_KEYS:
            return int(text)
        return float(text)
    except ValueError:
        kind = "an int" if key in _INT_KEYS else "a number"
        raise GoodputConfigError(
            f"goodput: parameter {key!r}: expected {kind}, got {raw!r}"
        ) from None


# ---------------------------------------------------------------------------- state

_RngState = tuple[int, int, int, int]  # PCG64 (state, inc, has_uint32, uinteger)


def _rng_state_of(gen: np.random.Generator) -> _RngState:
    st = gen.bit_generator.state
    return (
        int(st["state"]["state"]),
        int(st["state"]["inc"]),
        int(st["has_uint32"]),
        int(st["uinteger"]),
    )


def _generator(state: _RngState) -> np.random.Generator:
    bit = np.random.PCG64(0)
    bit.state = {
        "bit_generator": "PCG64",
        "state": {"state": state[0], "inc": state[1]},
        "has_uint32": state[2],
        "uinteger": state[3],
    }
    return np.random.Generator(bit)


@dataclass(frozen=True, slots=True)
class GoodputState:
    """Learned state of :class:`GoodputPolicy`; serialisable (``to_dict``)."""

    acceptance: AcceptanceState
    step_cost: StepCostState
    last_table: StepTable | None
    rng_state: _RngState
    # Per slot: decayed (batch_size_sum, verify_calls), for the representative batch.
    batch: tuple[tuple[int, float, float], ...] = ()
    last_probe_s: float | None = None
    decisions: int = 0
    # Since when a server without the drafter has been predicted to beat the best table
    # (None: not now), for the restart recommendation.
    restart_since_s: float | None = None
    # Decayed per-window TPOT statistics: (time_s, weight, then the weighted sums of
    # log p50, log scale, log-variance, base log-variance, log tokens); None before any.
    slo_stats: tuple[float, ...] | None = None
    # The steps of the table last seen in force (() for none: the engine's fallback) and
    # since when (a window's TPOTs are of requests that finished in it: they tell about a
    # table only once they lived under it from start to end).
    seen_slots: tuple[tuple[int, int], ...] | None = None
    seen_since_s: float | None = None
    version: int = GOODPUT_STATE_VERSION

    def __post_init__(self) -> None:
        if not isinstance(self.acceptance, AcceptanceState):
            raise PolicyTypeError("GoodputState.acceptance: expected an AcceptanceState")
        if not isinstance(self.step_cost, StepCostState):
            raise PolicyTypeError("GoodputState.step_cost: expected a StepCostState")
        if self.last_table is not None and not isinstance(self.last_table, StepTable):
            raise PolicyTypeError("GoodputState.last_table: expected None or a StepTable")
        rs = self.rng_state
        if (
            not isinstance(rs, tuple)
            or len(rs) != 4
            or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in rs)
            or rs[1] % 2 != 1
        ):
            raise PolicyTypeError(
                f"GoodputState.rng_state: expected a PCG64 (state, odd inc, has_uint32, "
                f"uinteger) tuple of non-negative ints, got {rs!r}"
            )
        for entry in self.batch:
            if (
                not isinstance(entry, tuple)
                or len(entry) != 3
                or not isinstance(entry[0], int)
                or not all(
                    isinstance(v, int | float) and math.isfinite(v) and v >= 0 for v in entry[1:]
                )
            ):
                raise PolicyTypeError(
                    f"GoodputState.batch: expected (slot, batch_size_sum, verify_calls) "
                    f"entries, got {entry!r}"
                )
        if self.slo_stats is not None and (
            not isinstance(self.slo_stats, tuple)
            or len(self.slo_stats) != 7
            or not all(
                isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
                for v in self.slo_stats
            )
        ):
            raise PolicyTypeError(
                f"GoodputState.slo_stats: expected None or 7 finite numbers, got {self.slo_stats!r}"
            )
        if self.seen_slots is not None and (
            not isinstance(self.seen_slots, tuple)
            or not all(
                isinstance(p, tuple) and len(p) == 2 and all(isinstance(v, int) for v in p)
                for p in self.seen_slots
            )
        ):
            raise PolicyTypeError(
                f"GoodputState.seen_slots: expected None or (bound, steps) int pairs, "
                f"got {self.seen_slots!r}"
            )
        for key in ("last_probe_s", "restart_since_s", "seen_since_s"):
            value = getattr(self, key)
            if value is not None and (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not math.isfinite(value)
            ):
                raise PolicyTypeError(
                    f"GoodputState.{key}: expected None or a finite number, got {value!r}"
                )
        if (
            isinstance(self.decisions, bool)
            or not isinstance(self.decisions, int)
            or (self.decisions < 0)
        ):
            raise PolicyTypeError(
                f"GoodputState.decisions: expected an int >= 0, got {self.decisions!r}"
            )
        if self.version != GOODPUT_STATE_VERSION:  # from_dict upgrades older versions
            raise PolicyTypeError(
                f"GoodputState.version: expected {GOODPUT_STATE_VERSION}, got {self.version!r}"
            )

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "acceptance": self.acceptance.to_dict(),
            "step_cost": self.step_cost.to_dict(),
            "last_table": None if self.last_table is None else self.last_table.to_dict(),
            # 128-bit integers as hex strings: not every JSON reader keeps them exact.
            "rng_state": [hex(v) for v in self.rng_state],
            "batch": [[s, b, v] for s, b, v in self.batch],
            "last_probe_s": self.last_probe_s,
            "decisions": self.decisions,
            "restart_since_s": self.restart_since_s,
            "slo_stats": None if self.slo_stats is None else list(self.slo_stats),
            "seen_slots": None if self.seen_slots is None else [list(p) for p in self.seen_slots],
            "seen_since_s": self.seen_since_s,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> GoodputState:
        if not isinstance(data, Mapping):
            raise PolicyTypeError(
                f"GoodputState.from_dict: expected a JSON object (mapping), got {data!r}"
            )
        version = data.get("version")
        if isinstance(version, bool) or version not in _READABLE_VERSIONS:
            raise PolicyTypeError(
                f"GoodputState.from_dict: key 'version': unsupported state version "
                f"{version!r}; this build reads versions "
                f"{', '.join(str(v) for v in _READABLE_VERSIONS)}"
            )
        keys = {f.name for f in fields(cls)}
        if version == 1:
            keys -= {"restart_since_s", "slo_stats", "seen_slots", "seen_since_s"}
        missing = sorted(keys - set(data))
        unknown = sorted(str(k) for k in set(data) - keys)
        if missing or unknown:
            raise PolicyTypeError(
                f"GoodputState.from_dict: missing key(s) {missing}, unknown key(s) {unknown}; "
                f"expected keys {sorted(keys)}"
            )
        raw_rng = data["rng_state"]
        try:
            if not isinstance(raw_rng, list | tuple) or len(raw_rng) != 4:
                raise ValueError
            rng_state = tuple(int(v, 16) for v in raw_rng)
        except (ValueError, TypeError):
            raise PolicyTypeError(
                f"GoodputState.from_dict: key 'rng_state': expected 4 hex strings, got {raw_rng!r}"
            ) from None
        raw_batch = data["batch"]
        if not isinstance(raw_batch, list | tuple) or not all(
            isinstance(e, list | tuple) and len(e) == 3 for e in raw_batch
        ):
            raise PolicyTypeError(
                f"GoodputState.from_dict: key 'batch': expected a list of "
                f"[slot, batch_size_sum, verify_calls], got {raw_batch!r}"
            )
        last_table = data["last_table"]
        return cls(
            acceptance=AcceptanceState.from_dict(data["acceptance"]),
            step_cost=StepCostState.from_dict(data["step_cost"]),
            last_table=None if last_table is None else StepTable.from_dict(last_table),
            rng_state=rng_state,  # type: ignore[arg-type]
            batch=tuple((e[0], e[1], e[2]) for e in raw_batch),
            last_probe_s=data["last_probe_s"],
            decisions=data["decisions"],
            restart_since_s=data.get("restart_since_s"),
            slo_stats=_float_tuple_or_none(data.get("slo_stats")),
            seen_slots=_pairs_or_none(data.get("seen_slots")),
            seen_since_s=data.get("seen_since_s"),
        )


def _float_tuple_or_none(value: object) -> tuple[float, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list | tuple):
        raise PolicyTypeError(
            f"GoodputState.from_dict: key 'slo_stats': expected null or a list, got {value!r}"
        )
    return tuple(value)


def _pairs_or_none(value: object) -> tuple[tuple[int, int], ...] | None:
    if value is None:
        return None
    if not isinstance(value, list | tuple) or not all(
        isinstance(p, list | tuple) and len(p) == 2 for p in value
    ):
        raise PolicyTypeError(
            f"GoodputState.from_dict: key 'seen_slots': expected null or a list of "
            f"[bound, steps], got {value!r}"
        )
    return tuple((p[0], p[1]) for p in value)


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

    @property
    def score_tok_s(self) -> float:
        """Goodput in the SLO sense: goodput times the share within the SLO."""
        return self.goodput_tok_s * self.slo_fraction


@dataclass(frozen=True, slots=True)
class _Eval:
    accept_length: float
    step_s: float
    goodput: float  # B * E[L] / T, tokens/s
    tpot_ms: float  # T / E[L], decode only (not calibrated)
    slo_fraction: float  # predicted share of requests within the SLO (1 without a model)

    @property
    def score(self) -> float:
        """The objective: goodput in the SLO sense (tokens of requests meeting the SLO)."""
        return self.goodput * self.slo_fraction


def _accept_moments(rates: Sequence[float], steps: int) -> tuple[float, float]:
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


def _flat_past_evidence(est: AcceptanceEstimate) -> tuple[float, ...]:
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


def _optimistic_rates(est: AcceptanceEstimate) -> tuple[float, ...]:
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
class _SloModel:
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
        for x, w in _GAUSS_HERMITE:
            need = cost_ms * math.exp(sd_e * x) / self.slo_ms
            total += w * _normal_cdf((accept_mean - need) / sd_l)
        return total


def _normal_cdf(z: float) -> float:
    return 0.5 * math.erfc(-z / math.sqrt(2.0))


@dataclass(frozen=True, slots=True)
class _SlotWork:
    bound: int
    allowed: tuple[int, ...]
    budget_limited: bool
    est: AcceptanceEstimate
    batch: float
    cur: int | None
    evals: dict[int, _Eval]
    best: int
    slo_limited: bool
    share: float


@dataclass(frozen=True, slots=True)
class _Restart:
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


def _drafter_share(prior: StepCostPrior, batch: float, ctx: float) -> float:
    """Share of a step-0 step the drafter costs: the prior with vs without the drafter."""
    if not prior.speculative:
        return 0.0
    bare = replace(prior, speculative=False, topk=1, num_draft_tokens=None)
    kv = ctx * batch
    with_drafter = prior.predict_s(batch, 0, kv)
    return max(0.0, 1.0 - bare.predict_s(batch, 0, kv) / with_drafter) if with_drafter > 0 else 0.0


def _kv_per_request(obs: Observation) -> float | None:
    if (
        obs.token_usage is None
        or obs.kv_capacity_tokens is None
        or obs.running_requests is None
        or obs.running_requests <= 0
    ):
        return None
    return obs.token_usage * obs.kv_capacity_tokens / obs.running_requests


def _update_batch(
    batch: tuple[tuple[int, float, float], ...],
    snapshot: TierStatsSnapshot,
    decay: float,
) -> tuple[tuple[int, float, float], ...]:
    acc = {slot: (b * decay, v * decay) for slot, b, v in batch}
    for tier in snapshot.tiers:
        b, v = acc.get(tier.slot, (0.0, 0.0))
        acc[tier.slot] = (b + tier.batch_size_sum, v + tier.verify_calls)
    return tuple((slot, b, v) for slot, (b, v) in sorted(acc.items()))


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
            last_table=None,
            rng_state=_rng_state_of(np.random.default_rng(self._config.seed)),
        )

    def state_from_dict(self, data: Mapping[str, Any]) -> GoodputState:
        return GoodputState.from_dict(data)

    # ---------------------------------------------------------------- learning

    def _learn(self, obs: Observation, state: GoodputState) -> GoodputState:
        snap = obs.tier_stats
        if snap is None:
            return state
        if obs.slot_candidates:
            snap = _normalise_slots(snap, tuple(b for b, _ in obs.slot_candidates))
        last = state.acceptance.last_time_s
        if last is not None and snap.window_end_s <= last:
            return state  # seen already
        dt = 0.0 if last is None else snap.window_end_s - last
        state = replace(
            state,
            acceptance=update_acceptance(state.acceptance, snap, self._acc_cfg),
            step_cost=update_step_cost(
                state.step_cost,
                snap,
                kv_tokens_per_request=_kv_per_request(obs),
                config=self._cost_cfg,
            ),
            batch=_update_batch(state.batch, snap, 0.5 ** (dt / self._config.half_life_s)),
        )
        in_force = obs.table.slots if obs.table is not None else ()  # (): the fallback
        if state.seen_since_s is None or in_force != state.seen_slots:
            state = replace(state, seen_slots=in_force, seen_since_s=obs.time_s)
        sample = self._slo_sample(obs, state.step_cost, snap)
        if sample is None or not self._lived_under_table(obs, state, snap):
            return state
        # A window holds a few dozen completions: smooth over several.
        prev = state.slo_stats
        if prev is None:
            decay = 0.0
        else:
            decay = 0.5 ** (max(0.0, obs.time_s - prev[0]) / self._config.slo_half_life_s)
        sums = (0.0,) * 6 if prev is None else prev[1:]
        stats = (obs.time_s, sums[0] * decay + 1.0) + tuple(
            old * decay + new for old, new in zip(sums[1:], sample, strict=True)
        )
        return replace(state, slo_stats=stats)

    # ---------------------------------------------------------------- decision

    def _evaluate(
        self,
        rates: Sequence[float],
        cost: StepCostState,
        batch: float,
        ctx: float,
        k: int,
        slo: _SloModel | None,
    ) -> _Eval:
        el, var = _accept_moments(rates, k)
        t = predict_step_s(cost, batch, k, ctx * batch)
        tpot_ms = 1e3 * t / el
        fraction = 1.0 if slo is None else slo.fraction(tpot_ms, el, var)
        return _Eval(el, t, batch * el / t, tpot_ms, fraction)

    def decide(
        self, observation: Observation, state: GoodputState, budget: Budget
    ) -> tuple[Decision, GoodputState]:
        state = self._learn(observation, state)
        state = replace(state, decisions=state.decisions + 1)
        if observation.tier_stats is None or not observation.slot_candidates:
            missing = "tier statistics" if observation.tier_stats is None else "slot candidates"
            return (
                Decision(
                    table=None,
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
        plans, gains, state = self._plan(
            observation, state, budget, current, observation.slot_candidates
        )
        state, restart = self._restart(observation, state, plans)
        return self._decision(observation, state, current, plans, gains, restart)

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
        return self._plan(observation, state, budget, current, observation.slot_candidates)[0]

    # ------------------------------------------------------------- SLO model

    def _slo_sample(
        self, obs: Observation, cost: StepCostState, snap: TierStatsSnapshot
    ) -> tuple[float, float, float, float, float] | None:
        """One window's view of per-request TPOTs (see _SloModel), for smoothing.

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
        ctx = _kv_per_request(obs)
        if ctx is None:
            ctx = self._config.default_kv_tokens_per_request
        weight = tpot_sum = var_sum = 0.0
        for t in snap.tiers:
            if t.verify_calls == 0 or t.batch_size_sum == 0 or t.requests == 0:
                continue
            batch = t.batch_size_sum / t.verify_calls
            el = sum((j + 1) * n for j, n in enumerate(t.accepted_hist)) / t.requests
            second = sum((j + 1) ** 2 * n for j, n in enumerate(t.accepted_hist)) / t.requests
            step_s = predict_step_s(cost, batch, t.steps, ctx * batch)
            weight += t.requests
            tpot_sum += t.requests * 1e3 * step_s / el
            var_sum += t.requests * max(0.0, second - el * el) / el
        if weight <= 0 or tpot_sum <= 0:
            return None
        p50 = q.p50_ms
        spread = _DEFAULT_LOG_SPREAD
        if q.p90_ms is not None and q.p90_ms > p50:
            spread = max(math.log(q.p90_ms / p50) / _Z90, _MIN_LOG_SPREAD)
        tokens = _DEFAULT_REQUEST_TOKENS
        e2e, ttft = obs.e2e_ms, obs.ttft_ms
        if e2e is not None and ttft is not None and e2e.p50_ms is not None:
            # A typical request's output tokens: its decode time over its TPOT.
            decode_ms = e2e.p50_ms - (ttft.p50_ms or 0.0)
            tokens = min(max(decode_ms / p50 + 1.0, _MIN_REQUEST_TOKENS), _MAX_REQUEST_TOKENS)
        accept_var = self._config.accept_burstiness * (var_sum / weight) / tokens
        return (
            math.log(p50),
            math.log(p50 / (tpot_sum / weight)),
            spread * spread,
            max(spread * spread - accept_var, _MIN_LOG_SPREAD**2),
            math.log(tokens),
        )

    @staticmethod
    def _lived_under_table(obs: Observation, state: GoodputState, snap: TierStatsSnapshot) -> bool:
        """Did the requests that finished in this window run under the table in force?

        They started up to a request lifetime (e2e median) before the window; their TPOTs
        would calibrate the table in force with another table's (or a cold start's)
        timings.
        """
        if state.seen_since_s is None:
            return False
        window_s = obs.window_s or (snap.window_end_s - snap.window_start_s)
        lifetime_s = 0.0
        if obs.e2e_ms is not None and obs.e2e_ms.p50_ms is not None:
            lifetime_s = obs.e2e_ms.p50_ms / 1e3
        return obs.time_s - state.seen_since_s >= window_s + lifetime_s

    def _slo_model(self, state: GoodputState, slo_ms: float | None) -> _SloModel | None:
        """The per-request TPOT model from the smoothed windows, when near the SLO."""
        stats = state.slo_stats
        if slo_ms is None or stats is None or stats[1] <= 0:
            return None
        w = stats[1]
        log_p50, log_scale, var, base_var, log_tokens = (v / w for v in stats[2:])
        if abs(math.log(slo_ms) - log_p50) > self._config.slo_band_sd * math.sqrt(var):
            return None  # met (or lost) by a wide margin whatever the steps
        return _SloModel(
            slo_ms=slo_ms,
            scale=math.exp(log_scale),
            base_var=base_var,
            tokens=math.exp(log_tokens),
            burstiness=self._config.accept_burstiness,
        )

    # ---------------------------------------------------------------- choice

    def _choose(
        self,
        evals: Mapping[int, _Eval],
        cur: int | None,
        slo_ms: float | None,
        slo: _SloModel | None,
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

    def _optimistic_probe(
        self,
        work: Sequence[_SlotWork],
        cost: StepCostState,
        ctx: float,
        slo_ms: float | None,
        slo: _SloModel | None,
    ) -> tuple[int, int] | None:
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
            opt_rates = _optimistic_rates(w.est)
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

    def _plan(
        self,
        observation: Observation,
        state: GoodputState,
        budget: Budget,
        current: StepTable | None,
        slot_candidates: tuple[tuple[int, tuple[int, ...]], ...],
    ) -> tuple[tuple[SlotPlan, ...], list[tuple[float, float, float]], GoodputState]:
        cfg = self._config
        now = observation.time_s
        slo_ms = cfg.slo_tpot_ms if cfg.slo_tpot_ms is not None else budget.slo_tpot_ms
        ctx = _kv_per_request(observation)
        if ctx is None:
            ctx = cfg.default_kv_tokens_per_request
        batch_of = {slot: (b / v if v > 1e-9 else None) for slot, b, v in state.batch}
        snap = observation.tier_stats
        if snap is not None:
            snap = _normalise_slots(snap, tuple(b for b, _ in slot_candidates))
        running_steps = _dominant_steps(snap)
        weights = {slot: v for slot, _, v in state.batch}
        total_w = sum(weights.values())
        cost = state.step_cost
        slo = self._slo_model(state, slo_ms)

        work: list[_SlotWork] = []
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
            flat = _flat_past_evidence(est)
            evals = {
                k: self._evaluate(est.mean if k <= est.observed else flat, cost, batch, ctx, k, slo)
                for k in eligible
            }
            best, slo_limited = self._choose(evals, cur, slo_ms, slo)
            share = weights.get(bound, 0.0) / total_w if total_w > 0 else 0.0
            work.append(
                _SlotWork(
                    bound, allowed, budget_limited, est, batch, cur, evals, best, slo_limited, share
                )
            )

        probes: dict[int, int] = {}
        if cfg.probe_max_loss > 0:
            found = self._optimistic_probe(work, cost, ctx, slo_ms, slo)
            if found is not None:
                probes[found[0]] = found[1]
        probe_open = (
            not probes
            and cfg.explore > 0
            and (state.last_probe_s is None or now - state.last_probe_s >= cfg.explore_interval_s)
        )
        rng = _generator(state.rng_state) if probe_open else None
        if rng is not None:
            # Random probe: an uncertain candidate predicted near the best, now and then.
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
            state = replace(state, rng_state=_rng_state_of(rng))
            if probes:
                state = replace(state, last_probe_s=now)

        plans: list[SlotPlan] = []
        gains: list[tuple[float, float, float]] = []  # (weight, new score, current score)
        for w in work:
            steps = probes.get(w.bound, w.best)
            e = w.evals.get(steps) or self._evaluate(w.est.mean, cost, w.batch, ctx, steps, slo)
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
                )
            )
            if w.cur is not None:
                cur_eval = w.evals.get(w.cur) or self._evaluate(
                    w.est.mean, cost, w.batch, ctx, w.cur, slo
                )
                gains.append((weights.get(w.bound, 0.0), e.score, cur_eval.score))
        return tuple(plans), gains, state

    # --------------------------------------------------------------- restart

    def _restart(
        self, observation: Observation, state: GoodputState, plans: Sequence[SlotPlan]
    ) -> tuple[GoodputState, _Restart | None]:
        """Recommend a restart without the drafter once it has been predicted better.

        A step table cannot remove what the drafter costs at step 0 (the draft-extend
        pass and verify bookkeeping run on every step, and the candidate steps' graphs
        and the draft KV cache shrink the KV pool): only a restart without speculation
        can. When, in the busy slots (verify-weighted), the predicted goodput (SLO sense)
        of the same server without the drafter beats the plan's by ``restart_min_gain``
        for at least ``restart_after_s`` on end and ``gain * held_s >= restart_cost_s``,
        the decision carries the recommendation. The larger KV pool is not in the
        prediction (the policy does not see the memory plan): it under-states the gain.
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
        state = replace(state, restart_since_s=since)
        # Whatever has lasted t is as likely as not to last t more: recommend once the
        # gain over the time held so far would pay for the restart's downtime.
        payback_s = cfg.restart_cost_s / max(gain, 1e-9)
        if since is None or now - since < max(cfg.restart_after_s, payback_s):
            return state, None
        ctx = _kv_per_request(observation) or cfg.default_kv_tokens_per_request
        w_sum = sum(weights[p.slot] for p in busy)
        prior = state.step_cost.prior
        overhead = sum(weights[p.slot] * _drafter_share(prior, p.batch_size, ctx) for p in busy)
        return state, _Restart(
            held_s=now - since,
            slots=tuple(p.slot for p in busy),
            steps=tuple(p.steps for p in busy),
            gain=gain,
            overhead=overhead / w_sum,
        )

    def _no_drafter(
        self, cost: StepCostState, batch: float, ctx: float, slo: _SloModel | None
    ) -> float | None:
        """Goodput (SLO sense) of this slot on the same server without the drafter.

        The learned step-0 time scaled by the prior's no-drafter / step-0 ratio (the
        learned coefficients cannot tell the drafter's part of a step-0 step apart).
        """
        if not cost.prior.speculative or batch <= 0:
            return None
        share = _drafter_share(cost.prior, batch, ctx)
        step_s = predict_step_s(cost, batch, 0, ctx * batch) * (1.0 - share)
        tpot_ms = 1e3 * step_s
        fraction = 1.0 if slo is None else slo.fraction(tpot_ms, 1.0, 0.0)
        return batch / step_s * fraction

    def _decision(
        self,
        observation: Observation,
        state: GoodputState,
        current: StepTable | None,
        plans: Sequence[SlotPlan],
        gains: Sequence[tuple[float, float, float]],
        restart: _Restart | None = None,
    ) -> tuple[Decision, GoodputState]:
        # A table starts at bound 1; batches below the engine's first slot bound use its
        # first slot anyway (StepTable and SGLang route them there alike).
        slots = tuple((1 if i == 0 else p.slot, p.steps) for i, p in enumerate(plans))
        # Also "changed" when the table in force is what we want but our last proposal
        # was not (the guardrails held it): say so, or that proposal stays pending.
        changed = (
            current is None
            or current.slots != slots
            or (state.last_table is not None and state.last_table.slots != slots)
        )
        limited: list[str] = []
        if any(p.slo_limited for p in plans):
            limited.append("slo_tpot_ms")
        if any(p.budget_limited for p in plans):
            limited.append("allowed_steps")
        # A probe is an experiment, not a prediction: it carries no expected gain, so the
        # guardrails' tolerance band does not veto it (their rollback still judges it).
        probing = any(p.probe for p in plans)
        expected_gain = None if probing else _expected_gain(gains)
        summary = "; ".join(_describe(p) for p in plans)
        recommendation = None
        if restart is not None:
            recommendation = restart.recommendation()
            summary += "; " + restart.describe()
        if "slo_tpot_ms" in limited:
            reason = ReasonCode.LIMITED_BY_SLO
        elif "allowed_steps" in limited:
            reason = ReasonCode.LIMITED_BY_BUDGET
        elif changed:
            reason = ReasonCode.CHANGED_PREDICTED_GAIN
        else:
            reason = ReasonCode.HELD_NO_CHANGE
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
            ttl_s=self._config.ttl_s,
            reason=reason.value,
        )
        if probing:
            gain_text = ", probing"
        elif expected_gain is None:
            gain_text = ""
        else:
            gain_text = f", predicted gain {expected_gain:+.1%}"
        return (
            Decision(
                table=table,
                reason=reason,
                message=f"goodput: new table{gain_text} ({summary})",
                expected_gain=expected_gain,
                limited_by=tuple(limited),
                restart_recommendation=recommendation,
            ),
            replace(state, last_table=table),
        )


def _normalise_slots(snapshot: TierStatsSnapshot, bounds: Sequence[int]) -> TierStatsSnapshot:
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


def _dominant_steps(snapshot: TierStatsSnapshot | None) -> dict[int, int]:
    """Per slot, the steps that ran the most verifies in the window (the engine's choice)."""
    if snapshot is None:
        return {}
    best: dict[int, tuple[int, int]] = {}
    for tier in snapshot.tiers:
        calls = best.get(tier.slot, (-1, 0))[0]
        if tier.verify_calls > calls:
            best[tier.slot] = (tier.verify_calls, tier.steps)
    return {slot: steps for slot, (_, steps) in best.items()}


def _expected_gain(gains: Sequence[tuple[float, float, float]]) -> float | None:
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


def _describe(p: SlotPlan) -> str:
    flags = "".join(
        (" probe" if p.probe else "", " slo-limited" if p.slo_limited else "",
         " budget-limited" if p.budget_limited else "")
    )  # fmt: skip
    return (
        f"slot {p.slot}: k={p.steps}{flags} B={p.batch_size:.1f} E[L]={p.accept_length:.2f} "
        f"T={p.step_s * 1e3:.2f}ms TPOT={p.tpot_ms:.2f}ms G={p.goodput_tok_s:.0f}tok/s"
    )
