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

SLO: the predicted TPOT of a choice is ``T_step / E[L]``. Only choices with predicted
TPOT <= ``slo_tpot_ms`` (the config's, else the Budget's) are eligible; when none is,
the lowest predicted TPOT is taken and the decision says ``LIMITED_BY_SLO``. (At a
given batch size maximising goodput and minimising TPOT coincide; the SLO bites on
probes, which must meet it even under the conservative acceptance bound, and on
hysteresis, which never keeps an SLO-breaking step.)

Caution with uncertain candidates:

* positions nobody has observed are extrapolated conservatively by the estimator, and
  only candidates up to the first one beyond the observed positions are considered:
  the policy climbs one candidate at a time, never jumps to a large ``k`` on no
  evidence;
* a probe: with probability ``explore`` per decision, at most once per
  ``explore_interval_s``, a candidate whose positions have fewer than ``min_trials``
  trials in that slot and whose predicted goodput is within ``explore_margin`` of
  the best is tried (random draws from a seeded generator kept in the state, so the
  same inputs give the same outputs);
* hysteresis: the current step is kept unless the best is better by more than
  ``hysteresis`` (relative), so estimation noise does not flip the table.

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

GOODPUT_STATE_VERSION: Final = 1


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
    # Probability, per decision, of probing an uncertain near-best candidate.
    explore: float = 0.05
    # Probe only candidates predicted within this fraction of the best goodput.
    explore_margin: float = 0.1
    # At most one probe (over all slots) per this many seconds.
    explore_interval_s: float = 60.0
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
        for key in ("explore", "explore_margin", "hysteresis"):
            value = getattr(self, key)
            if not real(value) or not 0.0 <= value <= 1.0:
                raise bad(key, "a number in [0, 1]", value)
        for key in (
            "explore_interval_s",
            "half_life_s",
            "fast_half_life_s",
            "cost_half_life_s",
            "ttl_s",
        ):
            value = getattr(self, key)
            if not real(value) or value <= 0:
                raise bad(key, "a number > 0 (seconds)", value)
        for key in ("min_trials", "default_kv_tokens_per_request"):
            value = getattr(self, key)
            if not real(value) or value < 0:
                raise bad(key, "a number >= 0", value)
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
        if self.last_probe_s is not None and (
            not isinstance(self.last_probe_s, int | float) or not math.isfinite(self.last_probe_s)
        ):
            raise PolicyTypeError(
                f"GoodputState.last_probe_s: expected None or a finite number, "
                f"got {self.last_probe_s!r}"
            )
        if (
            isinstance(self.decisions, bool)
            or not isinstance(self.decisions, int)
            or (self.decisions < 0)
        ):
            raise PolicyTypeError(
                f"GoodputState.decisions: expected an int >= 0, got {self.decisions!r}"
            )
        if self.version != GOODPUT_STATE_VERSION:
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
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> GoodputState:
        if not isinstance(data, Mapping):
            raise PolicyTypeError(
                f"GoodputState.from_dict: expected a JSON object (mapping), got {data!r}"
            )
        version = data.get("version")
        if isinstance(version, bool) or version != GOODPUT_STATE_VERSION:
            raise PolicyTypeError(
                f"GoodputState.from_dict: key 'version': unsupported state version "
                f"{version!r}; this build reads version {GOODPUT_STATE_VERSION}"
            )
        keys = {f.name for f in fields(cls)}
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
            version=version,
        )


# --------------------------------------------------------------------------- policy


@dataclass(frozen=True, slots=True)
class SlotPlan:
    """What the policy predicted for one slot (for messages and tests)."""

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


@dataclass(frozen=True, slots=True)
class _Eval:
    accept_length: float
    accept_length_low: float
    step_s: float
    goodput: float
    tpot_ms: float
    tpot_low_ms: float


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
        return replace(
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

    # ---------------------------------------------------------------- decision

    def _evaluate(
        self, est: AcceptanceEstimate, cost: StepCostState, batch: float, ctx: float, k: int
    ) -> _Eval:
        el = est.expected_accept_length(k)
        el_low = est.expected_accept_length(k, conservative=True)
        t = predict_step_s(cost, batch, k, ctx * batch)
        return _Eval(el, el_low, t, batch * el / t, 1e3 * t / el, 1e3 * t / el_low)

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
        return self._decision(observation, state, current, plans, gains)

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
        probe_open = cfg.explore > 0 and (
            state.last_probe_s is None or now - state.last_probe_s >= cfg.explore_interval_s
        )
        rng = _generator(state.rng_state) if probe_open else None
        probed = False

        plans: list[SlotPlan] = []
        gains: list[tuple[float, float, float]] = []  # (weight, new G, current G)
        weights = {slot: v for slot, _, v in state.batch}
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

            eligible = sorted({k for k in allowed if k <= est.observed})
            beyond = [k for k in allowed if k > est.observed]
            if beyond:
                eligible.append(min(beyond))  # one candidate past the evidence, no further
            if cur is not None and cur in allowed and cur not in eligible:
                eligible.append(cur)
            evals = {k: self._evaluate(est, state.step_cost, batch, ctx, k) for k in eligible}
            feasible = [k for k in eligible if slo_ms is None or evals[k].tpot_ms <= slo_ms]
            slo_limited = not feasible
            if feasible:
                best = max(feasible, key=lambda k: (evals[k].goodput, -k))
            else:
                best = min(eligible, key=lambda k: (evals[k].tpot_ms, k))
            if (
                cur is not None
                and cur in evals
                and cur != best
                and (cur in feasible or slo_limited)
                and evals[cur].goodput >= evals[best].goodput * (1.0 - cfg.hysteresis)
            ):
                best = cur

            probe = False
            if rng is not None and not probed:
                uncertain_from = est.uncertain_from(cfg.min_trials)
                options = [
                    k
                    for k in eligible
                    if k != best
                    and k >= uncertain_from
                    and evals[k].goodput >= evals[best].goodput * (1.0 - cfg.explore_margin)
                    and (slo_ms is None or evals[k].tpot_low_ms <= slo_ms)
                ]
                if options and rng.random() < cfg.explore:
                    best = max(options, key=lambda k: (evals[k].goodput, -k))
                    probe = probed = True

            e = evals[best]
            plans.append(
                SlotPlan(
                    slot=bound,
                    steps=best,
                    batch_size=batch,
                    accept_length=e.accept_length,
                    step_s=e.step_s,
                    goodput_tok_s=e.goodput,
                    tpot_ms=e.tpot_ms,
                    slo_limited=slo_limited,
                    budget_limited=budget_limited,
                    probe=probe,
                )
            )
            if cur is not None:
                cur_eval = evals.get(cur) or self._evaluate(est, state.step_cost, batch, ctx, cur)
                gains.append((weights.get(bound, 0.0), e.goodput, cur_eval.goodput))

        if rng is not None:
            state = replace(state, rng_state=_rng_state_of(rng))
        if probed:
            state = replace(state, last_probe_s=now)
        return tuple(plans), gains, state

    def _decision(
        self,
        observation: Observation,
        state: GoodputState,
        current: StepTable | None,
        plans: Sequence[SlotPlan],
        gains: Sequence[tuple[float, float, float]],
    ) -> tuple[Decision, GoodputState]:
        # A table starts at bound 1; batches below the engine's first slot bound use its
        # first slot anyway (StepTable and SGLang route them there alike).
        slots = tuple((1 if i == 0 else p.slot, p.steps) for i, p in enumerate(plans))
        changed = current is None or current.slots != slots
        limited: list[str] = []
        if any(p.slo_limited for p in plans):
            limited.append("slo_tpot_ms")
        if any(p.budget_limited for p in plans):
            limited.append("allowed_steps")
        expected_gain = _expected_gain(gains)
        summary = "; ".join(_describe(p) for p in plans)
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
        gain_text = "" if expected_gain is None else f", predicted gain {expected_gain:+.1%}"
        return (
            Decision(
                table=table,
                reason=reason,
                message=f"goodput: new table{gain_text} ({summary})",
                expected_gain=expected_gain,
                limited_by=tuple(limited),
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
