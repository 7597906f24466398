"""The goodput policy's configuration (GoodputConfig), its spec keys and their checks,
and the constants the model shares."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Final

import numpy as np

from specgov.policies.common.errors import SpecgovError
from specgov.policies.common.validation import is_int, is_real
from specgov.policies.daemon.estimators.acceptance import (
    AcceptanceConfig,
)
from specgov.policies.daemon.estimators.step_cost import (
    StepCostConfig,
)

GOODPUT_STATE_VERSION: Final = 4
# Older states are read too: the fields version 2 added start unknown (None); versions 1
# and 2 kept the last proposal as a versioned table (``last_table``), version 3 keeps its
# steps and rules only (the guard owns versions and TTLs); version 4 adds the per-step
# first-draft counts (older states start without).
READABLE_VERSIONS: Final = (1, 2, 3, 4)


# SLO model constants (see _SloModel): the normal quantile of p90; the log-TPOT spread
# assumed when the window has no p90, and its floor; a typical request's output tokens
# when the window cannot tell, and the range an estimate is clipped to.
Z90: Final = 1.2816
DEFAULT_LOG_SPREAD: Final = 0.15
MIN_LOG_SPREAD: Final = 0.02
DEFAULT_REQUEST_TOKENS: Final = 256.0
MIN_REQUEST_TOKENS: Final = 8.0
MAX_REQUEST_TOKENS: Final = 8192.0
# Nodes and weights (summing to 1) of Gauss-Hermite quadrature against N(0, 1).
GAUSS_HERMITE: Final = tuple(
    (float(x), float(w) / math.sqrt(2.0 * math.pi))
    for x, w in zip(*np.polynomial.hermite_e.hermegauss(12), strict=True)
)


class GoodputConfigError(SpecgovError, ValueError):
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
    # Cost probes: a busy slot's neighbouring step count (acceptance observed) timed
    # for less than this much evidence (window weights; 0.5: one window of
    # count_saturation steps) near the slot's batch size is probed when the
    # fit predicts it within probe_max_loss of the choice (throughput) and, at the
    # favourable end of its step-time bounds (``step_cost_bounds``: the fit's slope there
    # is the prior's), it would beat the choice by more than ``hysteresis``; 0: none.
    cost_probe_evidence: float = 0.5
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
    # Trigger the restart check (controller/daemon/recommend.py, which alone predicts a
    # restart's gain) once a server without the drafter has been predicted to beat the
    # best table in the busy slots by at least restart_min_gain (goodput in the SLO
    # sense) for at least restart_after_s (0: never trigger; the check still runs on its
    # schedule) and long enough that the gain pays back restart_cost_s, the downtime of a
    # restart (weights, CUDA graphs), had it lasted as long again.
    restart_after_s: float = 60.0
    restart_min_gain: float = 0.05
    restart_cost_s: float = 60.0

    def __post_init__(self) -> None:
        def bad(key: str, expected: str, value: object) -> GoodputConfigError:
            return GoodputConfigError(
                f"goodput: parameter {key!r}: expected {expected}, got {value!r}"
            )

        if self.slo_tpot_ms is not None and (
            not is_real(self.slo_tpot_ms) or self.slo_tpot_ms <= 0
        ):
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
            if not is_real(value) or not 0.0 <= value <= 1.0:
                raise bad(key, "a number in [0, 1]", value)
        for key in (
            "explore_interval_s",
            "slo_half_life_s",
            "half_life_s",
            "fast_half_life_s",
            "cost_half_life_s",
        ):
            value = getattr(self, key)
            if not is_real(value) or value <= 0:
                raise bad(key, "a number > 0 (seconds)", value)
        for key in (
            "min_trials",
            "cost_probe_evidence",
            "default_kv_tokens_per_request",
            "restart_after_s",
            "restart_cost_s",
        ):
            value = getattr(self, key)
            if not is_real(value) or value < 0:
                raise bad(key, "a number >= 0", value)
        if not is_real(self.slo_band_sd) or self.slo_band_sd <= 0:
            raise bad("slo_band_sd", "a number > 0", self.slo_band_sd)
        if not is_real(self.accept_burstiness) or self.accept_burstiness < 1.0:
            raise bad("accept_burstiness", "a number >= 1", self.accept_burstiness)
        if not is_real(self.prior_mean) or not 0.0 < self.prior_mean < 1.0:
            raise bad("prior_mean", "a number in (0, 1)", self.prior_mean)
        if not is_int(self.seed) or self.seed < 0:
            raise bad("seed", "an int >= 0", self.seed)
        if not is_int(self.max_steps) or not 1 <= self.max_steps <= 64:
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
