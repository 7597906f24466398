"""Step wall time as a function of batch size, draft steps and context, learned online.

Prior
    :class:`StepCostPrior` holds the roofline coefficients the simulator's
    ``CostModel`` charges with and predicts with the same code
    (:class:`specgov.policies.roofline.Roofline`: one definition; ``simulator/priors.py``
    builds a prior from a cost model, the daemon from the catalog). One speculative
    decode step of ``B`` requests with ``k`` draft steps reading ``kv`` cached tokens
    (batch total) costs::

        fixed + smoothmax(weight read, n * compute) + kv * kv_read + n * per_token
              + draft_extend(n) + k draft forwards + bookkeeping,    n = B * (k + 1)

    (chains; trees verify ``min(num_draft_tokens, 1 + k * topk)`` tokens per request).
    The flat region of the smooth max is where verification is free; past the knee
    every verified token costs compute.

Learned correction
    The prediction is a non-negative combination of the prior's components
    (:data:`FEATURE_NAMES`): the prior is the combination with coefficients
    :meth:`StepCostPrior.prior_coefficients`; two extra roofline terms with the knee at
    half and at twice the prior's batched-token count (coefficient 0 in the prior) let
    the fit move the knee. Every feature is non-decreasing in batch size, steps and KV
    tokens, and the coefficients are constrained to be >= 0, so every prediction is
    monotone non-decreasing in batched tokens by construction.

    Fit: each tier-window with timed steps is one sample (mean batch size
    ``batch_size_sum / verify_calls``, steps, mean step time ``step_time_sum_s /
    step_time_count``, KV tokens = KV per request x mean batch size), weighted by
    ``count / (count + count_saturation)`` (a window counts at most once: windows are not
    independent) and decayed with ``half_life_s``. non-negative least squares
    (SciPy's ``nnls``, the solver scikit-learn's ``LinearRegression(positive=True)``
    calls) fits relative residuals
    ``(observed - predicted) / prior`` inside an iteratively re-weighted loop with Huber
    weights on a robust (MAD) scale, so prefill-heavy windows and GC pauses barely move
    it. Pseudo-observations pull each coefficient towards the prior with strength
    ``prior_strength`` (in windows), so with little data the fit stays at the prior.

State
    A bounded buffer of recent samples (at most ``max_samples``; when full, the oldest
    sample of the most crowded (steps, batch-size octave) cell goes, so rare operating
    points survive) and the fitted coefficients, all plain floats: no solver object is
    stored; the fit is redone only when samples were added.
"""

from __future__ import annotations

import bisect
import itertools
import math
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np
from scipy.optimize import nnls

from specgov.policies.estimators._common import check_keys, is_int, is_real
from specgov.policies.identity_cache import IdentityCache
from specgov.policies.roofline import Roofline, RooflineCoefficients, RooflineError
from specgov.policies.types import PolicyTypeError, TierStatsSnapshot

__all__ = [
    "FEATURE_NAMES",
    "STEP_COST_STATE_VERSION",
    "StepCostConfig",
    "StepCostPrior",
    "StepCostState",
    "StepSample",
    "cost_evidence",
    "default_step_cost_prior",
    "initial_step_cost_state",
    "predict_step_s",
    "step_cost_bounds",
    "update_step_cost",
    "verify_knee_tokens",
]

STEP_COST_STATE_VERSION: Final = 1

# Unit scales of the features that are plain counts, so coefficients are O(1).
_MS: Final = 1e-3
_US: Final = 1e-6
_NS: Final = 1e-9

FEATURE_NAMES: Final = (
    "fixed_ms",  # 1 ms per step (engine + drafter fixed overheads)
    "roofline_knee_x0.5",  # target smooth max with the knee at half the prior's tokens
    "roofline",  # target smooth max (weights read vs compute of n tokens)
    "roofline_knee_x2",  # ... with the knee at twice the prior's tokens
    "verified_token_us",  # 1 µs per verified token (verify bookkeeping, TP all-reduce)
    "request_us",  # 1 µs per request (host-side drafter work)
    "target_kv_ns",  # 1 ns per cached token, target attention
    "draft_kv_ns",  # 1 ns per cached token per draft forward (extend + k drafts)
    "draft_roofline",  # the drafter's smooth max over its forwards
    "draft_step_ms",  # 1 ms per draft step
)
N_FEATURES: Final = len(FEATURE_NAMES)


# --------------------------------------------------------------------------- helpers


# ---------------------------------------------------------------------------- prior


@dataclass(frozen=True, slots=True)
class StepCostPrior:
    """The roofline step cost of one deployment: shared coefficients plus the step shape.

    ``coefficients`` is the :class:`~specgov.policies.roofline.RooflineCoefficients`
    object itself (``simulator/priors.py`` hands over the simulator cost model's), and
    :meth:`predict_s` is :meth:`Roofline.decode_step_s`: no second implementation.
    ``speculative`` is False for a server without a drafter (steps are then ignored).
    ``topk == 1`` is a chain; a tree (``topk > 1``) needs ``num_draft_tokens``.
    """

    coefficients: RooflineCoefficients
    speculative: bool = True
    topk: int = 1
    num_draft_tokens: int | None = None
    _roofline: Roofline = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.coefficients, RooflineCoefficients):
            raise PolicyTypeError(
                f"StepCostPrior.coefficients: expected RooflineCoefficients, "
                f"got {type(self.coefficients).__name__}"
            )
        c = self.coefficients
        if c.weight_read_s <= 0 and c.compute_per_token_s <= 0:
            raise PolicyTypeError(
                "StepCostPrior.weight_read_s/compute_per_token_s: expected at least one > 0"
            )
        if not isinstance(self.speculative, bool):
            raise PolicyTypeError(
                f"StepCostPrior.speculative: expected a bool, got {self.speculative!r}"
            )
        if not is_int(self.topk) or self.topk < 1:
            raise PolicyTypeError(f"StepCostPrior.topk: expected an int >= 1, got {self.topk!r}")
        if self.topk > 1:
            if not is_int(self.num_draft_tokens) or self.num_draft_tokens < 2:
                raise PolicyTypeError(
                    f"StepCostPrior.num_draft_tokens: expected an int >= 2 for a tree "
                    f"(topk={self.topk}), got {self.num_draft_tokens!r}"
                )
            if not self.speculative:
                raise PolicyTypeError("StepCostPrior.topk: a tree (topk > 1) needs a drafter")
        elif self.num_draft_tokens is not None:
            raise PolicyTypeError(
                f"StepCostPrior.num_draft_tokens: expected None for a chain (topk=1), "
                f"got {self.num_draft_tokens!r}"
            )
        roofline = Roofline(
            c,
            speculative=self.speculative,
            topk=self.topk,
            num_draft_tokens=self.num_draft_tokens,
        )
        object.__setattr__(self, "_roofline", roofline)

    # ------------------------------------------------------------------ model

    @property
    def roofline(self) -> Roofline:
        """The shared step-cost formula for this prior's coefficients and shape."""
        return self._roofline

    def verify_tokens_per_request(self, steps: int) -> int:
        """Target tokens verified per request at ``steps`` (1 without a drafter)."""
        return self._roofline.verify_tokens_per_request(steps)

    def features(self, batch_size: float, steps: int, kv_tokens: float) -> tuple[float, ...]:
        """The model's components (see :data:`FEATURE_NAMES`) for one decode step.

        The roofline's own terms (:meth:`Roofline.decode_step_terms`) in the units of
        :data:`FEATURE_NAMES`, plus the two moved-knee variants of the target roofline.
        """
        rl = self._roofline
        one, roof, n, requests, kv, draft_kv, draft, k = rl.decode_step_terms(
            batch_size, steps, kv_tokens
        )
        return (
            one * _MS,
            rl.target_roofline_s(n, 2.0),  # knee at half the tokens
            roof,
            rl.target_roofline_s(n, 0.5),  # knee at twice the tokens
            n * _US,
            requests * _US,
            kv * _NS,
            draft_kv * _NS,
            draft,
            k * _MS,
        )

    def prior_coefficients(self) -> tuple[float, ...]:
        """Coefficients of :meth:`features` that reproduce this prior exactly."""
        fixed, roof, per_token, per_request, kv, draft_kv, draft, per_step = (
            self._roofline.term_weights
        )
        return (
            fixed / _MS,
            0.0,
            roof,
            0.0,
            per_token / _US,
            per_request / _US,
            kv / _NS,
            draft_kv / _NS,
            draft,
            per_step / _MS,
        )

    def predict_s(self, batch_size: float, steps: int, kv_tokens: float) -> float:
        """Seconds per decode step of ``batch_size`` requests reading ``kv_tokens`` (total)."""
        _check_point(batch_size, steps, kv_tokens)
        return self._roofline.decode_step_s(batch_size, steps, kv_tokens)

    # -------------------------------------------------------------- serialise

    def to_dict(self) -> dict[str, Any]:
        """Flat: the coefficient fields, then ``speculative``, ``topk``, ``num_draft_tokens``."""
        out: dict[str, Any] = {
            name: getattr(self.coefficients, name) for name in RooflineCoefficients.field_names()
        }
        out.update(
            speculative=self.speculative, topk=self.topk, num_draft_tokens=self.num_draft_tokens
        )
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StepCostPrior:
        if isinstance(data, Mapping):
            # States saved before the roofline was shared lack these two (both were 0:
            # the fixed TP latency was folded into fixed_overhead_s, prefill unused).
            data = {name: 0.0 for name in _LEGACY_OPTIONAL_KEYS if name not in data} | dict(data)
        check_keys("StepCostPrior", data, _PRIOR_KEYS)
        shape = ("speculative", "topk", "num_draft_tokens")
        try:
            coefficients = RooflineCoefficients(**{k: v for k, v in data.items() if k not in shape})
        except RooflineError as exc:
            raise PolicyTypeError(f"StepCostPrior.from_dict: {exc}") from None
        return cls(
            coefficients=coefficients,
            speculative=data["speculative"],
            topk=data["topk"],
            num_draft_tokens=data["num_draft_tokens"],
        )


_PRIOR_KEYS: Final = (
    *RooflineCoefficients.field_names(),
    "speculative",
    "topk",
    "num_draft_tokens",
)
_LEGACY_OPTIONAL_KEYS: Final = ("attention_per_token_pair_s", "tp_comm_fixed_s")


def _dot(a: Sequence[float], b: Sequence[float]) -> float:
    """Sum of the products in order (what every prediction has been computed with)."""
    if len(a) != len(b):
        raise PolicyTypeError(f"step cost: {len(a)} coefficients for {len(b)} features")
    return float(sum(map(operator.mul, a, b)))


def _check_point(batch_size: float, steps: int, kv_tokens: float) -> None:
    if not is_real(batch_size) or batch_size < 0:
        raise PolicyTypeError(f"step cost: batch_size: expected a number >= 0, got {batch_size!r}")
    if not is_int(steps) or steps < 0:
        raise PolicyTypeError(f"step cost: steps: expected an int >= 0, got {steps!r}")
    if not is_real(kv_tokens) or kv_tokens < 0:
        raise PolicyTypeError(f"step cost: kv_tokens: expected a number >= 0, got {kv_tokens!r}")


def default_step_cost_prior() -> StepCostPrior:
    """Llama-3.1-8B + EAGLE-3 chain on one H100 (the catalog's figures, simulator/cost.py).

    Used when the operator names no hardware; tests/test_step_cost_estimator.py checks
    it against ``simulator.priors.step_cost_prior`` of the catalog cost model.
    """
    coefficients = RooflineCoefficients(
        fixed_overhead_s=1.0e-3,
        weight_read_s=5.992537313432835e-3,
        compute_per_token_s=2.2553645657791255e-05,
        kv_read_per_token_s=4.8907462686567165e-08,
        tp_comm_per_token_s=0.0,
        draft_weight_read_s=3.134328358208955e-04,
        draft_compute_per_token_s=1.1796427367711493e-06,
        draft_kv_read_per_token_s=1.528358208955224e-09,
        draft_step_overhead_s=0.75e-3,
        draft_extend_overhead_s=0.35e-3,
        spec_verify_overhead_s=0.5e-3,
        spec_verify_per_token_s=14.0e-6,
        draft_per_request_s=0.0,
        roofline_exponent=2.0,
    )
    return StepCostPrior(coefficients, speculative=True)


# --------------------------------------------------------------------------- config


@dataclass(frozen=True, slots=True)
class StepCostConfig:
    """Knobs of the step-cost estimator (documented defaults)."""

    # Sample buffer bound (each sample is six floats).
    max_samples: int = 256
    # Sample weights halve every this many seconds: hardware cost drifts slowly.
    half_life_s: float = 600.0
    # Pull of every coefficient towards the prior, in (full-weight) windows.
    prior_strength: float = 3.0
    # Huber threshold in robust standard deviations of the relative residual.
    huber_delta: float = 1.345
    # Floor of the robust relative scale, so a perfect fit does not flag everything.
    min_rel_scale: float = 0.02
    irls_iterations: int = 8
    # A window of c timed steps weighs c / (c + count_saturation).
    count_saturation: float = 16.0
    # KV tokens per request assumed when the observation does not say.
    default_kv_tokens_per_request: float = 1024.0

    def __post_init__(self) -> None:
        if not is_int(self.max_samples) or self.max_samples < 1:
            raise PolicyTypeError(
                f"StepCostConfig.max_samples: expected an int >= 1, got {self.max_samples!r}"
            )
        if not is_int(self.irls_iterations) or self.irls_iterations < 1:
            raise PolicyTypeError(
                f"StepCostConfig.irls_iterations: expected an int >= 1, "
                f"got {self.irls_iterations!r}"
            )
        for name in ("half_life_s", "prior_strength", "huber_delta", "min_rel_scale"):
            value = getattr(self, name)
            if not is_real(value) or value <= 0:
                raise PolicyTypeError(
                    f"StepCostConfig.{name}: expected a finite number > 0, got {value!r}"
                )
        for name in ("count_saturation", "default_kv_tokens_per_request"):
            value = getattr(self, name)
            if not is_real(value) or value < 0:
                raise PolicyTypeError(
                    f"StepCostConfig.{name}: expected a finite number >= 0, got {value!r}"
                )


# ---------------------------------------------------------------------------- state


@dataclass(frozen=True, slots=True)
class StepSample:
    """One tier-window: mean step time at a mean batch size, steps and KV tokens."""

    time_s: float
    batch_size: float
    steps: int
    kv_tokens: float
    step_s: float
    weight: float

    def __post_init__(self) -> None:
        if not is_int(self.steps) or self.steps < 0:
            raise PolicyTypeError(f"StepSample.steps: expected an int >= 0, got {self.steps!r}")
        if not is_real(self.time_s):
            raise PolicyTypeError(
                f"StepSample.time_s: expected a finite number, got {self.time_s!r}"
            )
        for name in ("batch_size", "step_s", "weight"):
            value = getattr(self, name)
            if not is_real(value) or value <= 0:
                raise PolicyTypeError(
                    f"StepSample.{name}: expected a finite number > 0, got {value!r}"
                )
        if not is_real(self.kv_tokens) or self.kv_tokens < 0:
            raise PolicyTypeError(
                f"StepSample.kv_tokens: expected a finite number >= 0, got {self.kv_tokens!r}"
            )

    def to_list(self) -> list[float | int]:
        return [self.time_s, self.batch_size, self.steps, self.kv_tokens, self.step_s, self.weight]


@dataclass(frozen=True, slots=True)
class StepCostState:
    """The prior, the recent samples and the fitted coefficients; serialisable."""

    prior: StepCostPrior
    samples: tuple[StepSample, ...]
    coefficients: tuple[float, ...]
    last_time_s: float | None = None
    fits: int = 0
    version: int = STEP_COST_STATE_VERSION

    def __post_init__(self) -> None:
        if not isinstance(self.prior, StepCostPrior):
            raise PolicyTypeError(
                f"StepCostState.prior: expected a StepCostPrior, got {self.prior!r}"
            )
        if not isinstance(self.samples, tuple) or not all(
            isinstance(s, StepSample) for s in self.samples
        ):
            raise PolicyTypeError("StepCostState.samples: expected a tuple of StepSample")
        if (
            not isinstance(self.coefficients, tuple)
            or len(self.coefficients) != N_FEATURES
            or not all(is_real(c) and c >= 0 for c in self.coefficients)
        ):
            raise PolicyTypeError(
                f"StepCostState.coefficients: expected {N_FEATURES} finite numbers >= 0 "
                f"({', '.join(FEATURE_NAMES)}), got {self.coefficients!r}"
            )
        if self.last_time_s is not None and not is_real(self.last_time_s):
            raise PolicyTypeError(
                f"StepCostState.last_time_s: expected None or a finite number, "
                f"got {self.last_time_s!r}"
            )
        if not is_int(self.fits) or self.fits < 0:
            raise PolicyTypeError(f"StepCostState.fits: expected an int >= 0, got {self.fits!r}")
        if self.version != STEP_COST_STATE_VERSION:
            raise PolicyTypeError(
                f"StepCostState.version: expected {STEP_COST_STATE_VERSION}, got {self.version!r}"
            )

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "prior": self.prior.to_dict(),
            "samples": [s.to_list() for s in self.samples],
            "coefficients": list(self.coefficients),
            "last_time_s": self.last_time_s,
            "fits": self.fits,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StepCostState:
        if isinstance(data, Mapping):
            version = data.get("version")
            if not is_int(version) or version != STEP_COST_STATE_VERSION:
                raise PolicyTypeError(
                    f"StepCostState.from_dict: key 'version': unsupported state version "
                    f"{version!r}; this build reads version {STEP_COST_STATE_VERSION}"
                )
        check_keys(
            "StepCostState",
            data,
            ("version", "prior", "samples", "coefficients", "last_time_s", "fits"),
        )
        raw = data["samples"]
        if not isinstance(raw, list | tuple):
            raise PolicyTypeError(
                f"StepCostState.from_dict: key 'samples': expected a list, got {raw!r}"
            )
        samples: list[StepSample] = []
        for i, row in enumerate(raw):
            if not isinstance(row, list | tuple) or len(row) != 6:
                raise PolicyTypeError(
                    f"StepCostState.from_dict: key 'samples'[{i}]: expected "
                    f"[time_s, batch_size, steps, kv_tokens, step_s, weight], got {row!r}"
                )
            samples.append(StepSample(*row))
        coef = data["coefficients"]
        if not isinstance(coef, list | tuple):
            raise PolicyTypeError(
                f"StepCostState.from_dict: key 'coefficients': expected a list, got {coef!r}"
            )
        return cls(
            prior=StepCostPrior.from_dict(data["prior"]),
            samples=tuple(samples),
            coefficients=tuple(coef),
            last_time_s=data["last_time_s"],
            fits=data["fits"],
            version=data["version"],
        )


def initial_step_cost_state(
    prior: StepCostPrior, config: StepCostConfig | None = None
) -> StepCostState:
    """No samples yet: predictions are exactly the prior's."""
    if not isinstance(prior, StepCostPrior):
        raise PolicyTypeError(
            f"initial_step_cost_state: prior: expected a StepCostPrior, got {prior!r}"
        )
    return StepCostState(prior=prior, samples=(), coefficients=prior.prior_coefficients())


# ---------------------------------------------------------------------- prediction


def predict_step_s(state: StepCostState, batch_size: float, steps: int, kv_tokens: float) -> float:
    """Predicted seconds per decode step; ``kv_tokens`` is the batch's total KV tokens.

    Monotone non-decreasing in ``batch_size``, ``steps`` and ``kv_tokens``.
    """
    _check_point(batch_size, steps, kv_tokens)
    return _dot(state.coefficients, state.prior.features(batch_size, steps, kv_tokens))


# Same operating region: a batch size within this factor either way (one octave).
_NEAR_FACTOR: Final = 2.0


def _near(sample: StepSample, batch_size: float) -> bool:
    """Same operating region: a batch size within ``_NEAR_FACTOR`` either way."""
    return batch_size / _NEAR_FACTOR <= sample.batch_size <= _NEAR_FACTOR * batch_size


def _decayed_weights(last_time_s: float | None, cols: _Columns, half_life_s: float) -> list[float]:
    """Each sample's weight halved every ``half_life_s`` of its age at ``last_time_s``."""
    if last_time_s is None:
        return [float(w) for w in cols.weight]  # age 0: 0.5 ** 0 is exactly 1
    return [
        float(w * 0.5 ** (max(0.0, last_time_s - t) / half_life_s))
        for t, w in zip(cols.time_s, cols.weight, strict=True)
    ]


def cost_evidence(state: StepCostState, batch_size: float, steps: int) -> float:
    """Windows (sample weight) timed at ``steps`` near ``batch_size`` (within 2x).

    Not decayed: a step count once timed here stays timed while its samples are kept
    (the buffer keeps rare operating points), so it is not probed again only because
    time passed.
    """
    _check_point(batch_size, steps, 0.0)
    return sum(s.weight for s in state.samples if s.steps == steps and _near(s, batch_size))


def local_step_s(
    state: StepCostState,
    batch_size: float,
    steps: int,
    kv_tokens: float,
    config: StepCostConfig | None = None,
) -> float:
    """The fit's prediction corrected by what was timed near ``batch_size`` (within 2x).

    The fit is one smooth function pulled towards the prior's shape, which it keeps
    until many windows at several step counts outweigh the pull; a few windows at a
    step count barely move it there, so a step count a probe has just timed would still
    be judged on the prior's slope. The correction multiplies the fit by ``exp(c)``:
    ``c`` is the weighted median log(observed / fitted) of the samples at ``steps``,
    shrunk towards 0 by positive-part James-Stein, ``max(0, 1 - s^2 / (n c^2))``, with
    ``n`` their weight in windows and ``s`` the windows' robust relative scatter within
    step counts (MAD, at least ``min_rel_scale``): a deviation within the noise is no
    correction, which keeps an exact prior's near ties where they were. A step count
    not timed here takes the correction of the nearest one that was (the fit's error
    there is mostly a level error; correcting only the step counts that ran would bias
    the choice against them): only its slope stays the fit's.
    """
    _check_point(batch_size, steps, kv_tokens)
    cfg = config or StepCostConfig()
    res = _residuals(state, cfg.half_life_s)
    # The policy asks for the same point several times per decision (the SLO sample, the
    # choice, the probes, the plan): the answer depends on the state and the point only.
    key = (batch_size, steps, kv_tokens, cfg.min_rel_scale)
    known = res.local.get(key)
    if known is None:
        pred = _dot(state.coefficients, state.prior.features(batch_size, steps, kv_tokens))
        known = res.local[key] = pred * res.correction(batch_size, steps, cfg.min_rel_scale)
    return known


@dataclass(frozen=True)
class _Residuals:
    """Per sample of one state: what ``local_step_s`` and ``step_cost_bounds`` compare.

    The goodput policy asks for dozens of step times per decision against one state;
    each sample's fitted and prior prediction is the same for all of them, so it is
    computed once per state (``_residuals``) instead of once per query."""

    batch: np.ndarray  # the samples' mean batch sizes
    steps: np.ndarray  # their step counts
    log_fit: np.ndarray  # log(observed / fitted)
    prior_ratio: np.ndarray  # observed / the prior's prediction
    decayed: np.ndarray  # weights decayed by age (half_life_s)
    # (near-sample mask, steps, min_rel_scale) -> correction (see ``correction``).
    memo: dict[tuple[bytes, int, float], float] = field(default_factory=dict)
    # (batch_size, steps, kv_tokens, min_rel_scale) -> local_step_s's answer.
    local: dict[tuple[float, int, float, float], float] = field(default_factory=dict)
    regions: dict[bytes, _Cells] = field(default_factory=dict)  # near-sample mask -> cells
    region_of: dict[float, bytes] = field(default_factory=dict)  # batch size -> mask (b"": none)
    # steps -> (its sample indices, the same ordered by log_fit), see ``_cells``
    by_steps: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)

    def near(self, batch_size: float) -> np.ndarray:
        """The samples in ``batch_size``'s operating region (``_near``)."""
        return (self.batch >= batch_size / _NEAR_FACTOR) & (self.batch <= _NEAR_FACTOR * batch_size)

    def correction(self, batch_size: float, steps: int, min_rel_scale: float) -> float:
        """``local_step_s``'s factor ``exp(c * shrink)`` (1.0: no correction).

        It depends on ``batch_size`` only through which samples are near it, so it is
        memoised per set of near samples (the policy asks for many batch sizes and step
        counts of one region in one decision), and the set per batch size."""
        region = self.region_of.get(batch_size)
        if region is None:
            near = self.near(batch_size)
            region = self.region_of[batch_size] = near.tobytes() if near.any() else b""
            if region and region not in self.regions:
                self.regions[region] = self._cells(near)
        if not region:
            return 1.0
        key = (region, steps, min_rel_scale)
        known = self.memo.get(key)
        if known is None:
            known = self.memo[key] = _cell_correction(self.regions[region], steps, min_rel_scale)
        return known

    def _cells(self, near: np.ndarray) -> _Cells:
        # Per step count, once per state: its samples in sample order and in ascending
        # log_fit order (a stable sort: the order Python's sorted() gives).
        by_steps = self.by_steps
        if not by_steps:
            for k in np.unique(self.steps).tolist():
                idx = np.flatnonzero(self.steps == k)
                by_steps[k] = (idx, idx[np.argsort(self.log_fit[idx], kind="stable")])
        cells: dict[int, tuple[list[float], list[float], float]] = {}
        spread: list[float] = []
        for k, (idx, ranked) in by_steps.items():
            cell = idx[near[idx]]
            if not len(cell):
                continue
            total = float(np.add.reduce(self.decayed[cell]))  # np.sum, in sample order
            ranked_cell = ranked[near[ranked]]
            # Plain Python from here: a cell holds a few samples, where every numpy call
            # costs more than the arithmetic (np.median ~25 us on 5 floats).
            ordered = self.log_fit[ranked_cell].tolist()
            cells[k] = (ordered, self.decayed[ranked_cell].tolist(), total)
            # Scatter within cells (a slope error moves whole cells apart; not noise).
            m = _median_sorted(ordered)
            spread.extend([abs(v - m) for v in ordered])
        return _Cells(cells=cells, scatter=1.4826 * _median(spread))


@dataclass(frozen=True)
class _Cells:
    """The near samples of one region, by step count, and their within-cell scatter."""

    # steps -> (log(observed / fitted) ascending, the samples' decayed weights in that
    # order, their sum: the cell's weight in windows)
    cells: dict[int, tuple[list[float], list[float], float]]
    scatter: float  # robust (MAD) relative scatter, before the min_rel_scale floor


def _cell_correction(cells: _Cells, steps: int, min_rel_scale: float) -> float:
    by_steps = cells.cells
    # A step count not timed here: the nearest that was (the heavier on a tie).
    key = (
        steps
        if steps in by_steps
        else min(by_steps, key=lambda k: (abs(k - steps), -by_steps[k][2]))
    )
    scatter = max(cells.scatter, min_rel_scale)
    logs, weights, n = by_steps[key]
    c = _weighted_median_sorted(logs, weights) if n > 0 else 0.0
    if c == 0.0 or n <= 0:
        return 1.0
    shrink = max(0.0, 1.0 - scatter * scatter / (n * c * c))
    return math.exp(c * shrink)


# The last few states' residuals (per half-life), by the state's identity.
_RESIDUAL_CACHE: Final[IdentityCache[_Residuals]] = IdentityCache(8)


# Per sample: its features and the prior's prediction. Both depend on the prior and the
# sample only, and a sample stays in successive states (one window is added per update),
# so each is computed once, not once per state. By the sample's and prior's identity.
_TERMS_CACHE: Final[IdentityCache[tuple[tuple[float, ...], float]]] = IdentityCache(16384)


def _sample_terms(prior: StepCostPrior, x: StepSample) -> tuple[tuple[float, ...], float]:
    hit = _TERMS_CACHE.get((x, prior))
    if hit is not None:
        return hit
    feats = prior.features(x.batch_size, x.steps, x.kv_tokens)
    prior_s = prior.predict_s(x.batch_size, x.steps, x.kv_tokens)
    return _TERMS_CACHE.put((x, prior), (feats, prior_s))


@dataclass(frozen=True)
class _Columns:
    """One samples tuple as columns: what ``_fit`` and ``_residuals`` read per sample."""

    features: np.ndarray  # (samples, N_FEATURES): StepCostPrior.features of each
    prior_s: np.ndarray  # the prior's prediction of each
    step_s: np.ndarray
    batch: np.ndarray
    steps: np.ndarray  # int
    time_s: list[float]
    weight: list[float]


# The last few samples tuples' columns, by the tuple's and prior's identity.
# update_step_cost fits the tuple it then stores in the new state, whose residuals the
# policy reads next: both read the same columns.
_COLUMNS_CACHE: Final[IdentityCache[_Columns]] = IdentityCache(8)


def _columns(prior: StepCostPrior, samples: tuple[StepSample, ...]) -> _Columns:
    hit = _COLUMNS_CACHE.get((samples, prior))
    if hit is not None:
        return hit
    cols = None
    newest = _COLUMNS_CACHE.newest()
    if newest is not None:
        # An update keeps most of the previous tuple (in order) and appends a window:
        # the kept samples' rows come from the newest columns, only new ones are built.
        (prev_samples, prev_prior), prev = newest
        if prev_prior is prior:
            assert isinstance(prev_samples, tuple)
            cols = _columns_from(prev_samples, prev, prior, samples)
    if cols is None:
        cols = _build_columns(prior, samples)
    return _COLUMNS_CACHE.put((samples, prior), cols)


def _build_columns(prior: StepCostPrior, samples: Sequence[StepSample]) -> _Columns:
    terms = [_sample_terms(prior, x) for x in samples]
    rows = itertools.chain.from_iterable(t[0] for t in terms)
    features = np.fromiter(rows, dtype=float, count=len(samples) * N_FEATURES)
    return _Columns(
        features=features.reshape(len(samples), N_FEATURES),
        prior_s=np.asarray([t[1] for t in terms], dtype=float),
        step_s=np.asarray([x.step_s for x in samples], dtype=float),
        batch=np.asarray([x.batch_size for x in samples], dtype=float),
        steps=np.asarray([x.steps for x in samples], dtype=int),
        time_s=[x.time_s for x in samples],
        weight=[x.weight for x in samples],
    )


def _columns_from(
    prev_samples: tuple[StepSample, ...],
    prev: _Columns,
    prior: StepCostPrior,
    samples: tuple[StepSample, ...],
) -> _Columns | None:
    """``samples``' columns, the rows of samples also in ``prev_samples`` copied from
    ``prev`` (rows of the same objects: the same values); None when none is shared.

    By identity: ``prev_samples`` is alive (its cache entry holds it), so no other
    object has the id of one of its samples.
    """
    pos = {id(x): i for i, x in enumerate(prev_samples)}
    fresh: list[StepSample] = []
    index: list[int] = []
    for x in samples:
        i = pos.get(id(x))
        if i is None:
            i = len(prev_samples) + len(fresh)
            fresh.append(x)
        index.append(i)
    if len(fresh) == len(samples):
        return None
    new = _build_columns(prior, fresh)
    take = np.asarray(index, dtype=np.intp)

    def pick(old: np.ndarray, added: np.ndarray) -> np.ndarray:
        out: np.ndarray = np.concatenate([old, added])[take]
        return out

    return _Columns(
        features=pick(prev.features, new.features),
        prior_s=pick(prev.prior_s, new.prior_s),
        step_s=pick(prev.step_s, new.step_s),
        batch=pick(prev.batch, new.batch),
        steps=pick(prev.steps, new.steps),
        time_s=[x.time_s for x in samples],
        weight=[x.weight for x in samples],
    )


def _residuals(state: StepCostState, half_life_s: float) -> _Residuals:
    hit = _RESIDUAL_CACHE.get((state,), half_life_s)
    if hit is not None:
        return hit
    cols = _columns(state.prior, state.samples)
    step_s = cols.step_s
    # predict_step_s for every sample at once: the same products summed in the same order
    # as _dot (element-wise IEEE operations), so the values are bit-identical.
    features = cols.features
    fitted = np.zeros(len(step_s))
    for j, c in enumerate(state.coefficients):
        fitted = fitted + features[:, j] * c
    res = _Residuals(
        batch=cols.batch,
        steps=cols.steps,
        log_fit=np.asarray(
            [math.log(max(r, 1e-12)) for r in (step_s / fitted).tolist()], dtype=float
        ),
        prior_ratio=step_s / cols.prior_s,
        decayed=np.asarray(_decayed_weights(state.last_time_s, cols, half_life_s), dtype=float),
    )
    return _RESIDUAL_CACHE.put((state,), res, half_life_s)


def step_cost_bounds(
    state: StepCostState,
    batch_size: float,
    steps: int,
    kv_tokens: float,
    *,
    min_evidence: float = 0.5,
    config: StepCostConfig | None = None,
) -> tuple[float, float]:
    """(low, high) seconds per step at a step count with too little timing of its own.

    Samples at one step count pin the cost there but not its slope in the steps: the
    fit takes the slope from the prior's shape, and a prior built for other hardware has
    the wrong shape (its knee and its fixed, per-token and per-draft-step parts scale
    differently), so a thinly timed neighbour can be mispredicted in either direction
    while the step in force is predicted exactly. The bounds anchor at the nearest step
    count with at least ``min_evidence`` windows near ``batch_size`` (where the fit is
    data) and widen the fit's increment from it by the factor ``f`` by which the prior
    has been measured wrong near this batch size (weighted median observed / prior,
    ``f = exp(|log ratio|)``): the assumption is that the prior's slope is no more wrong
    than its level. An exact prior (f ~ 1) gives bounds that collapse onto the fit.
    Where ``steps`` has the evidence itself, or nothing near has any, both bounds are
    the prediction.
    """
    cfg = config or StepCostConfig()
    pred = local_step_s(state, batch_size, steps, kv_tokens, config=cfg)
    if not is_real(min_evidence) or min_evidence <= 0:
        raise PolicyTypeError(
            f"step_cost_bounds: min_evidence: expected a number > 0, got {min_evidence!r}"
        )
    near = [s for s in state.samples if _near(s, batch_size)]
    by_steps: dict[int, float] = {}  # evidence as cost_evidence counts it
    for s in near:
        by_steps[s.steps] = by_steps.get(s.steps, 0.0) + s.weight
    if by_steps.get(steps, 0.0) >= min_evidence:
        return pred, pred
    anchors = [k for k, w in by_steps.items() if w >= min_evidence]
    if not anchors:
        return pred, pred
    anchor = min(anchors, key=lambda k: (abs(k - steps), k))
    base = local_step_s(state, batch_size, anchor, kv_tokens, config=cfg)
    res = _residuals(state, cfg.half_life_s)
    mask = res.near(batch_size)
    ratio = _weighted_median(res.prior_ratio[mask], res.decayed[mask])
    factor = math.exp(abs(math.log(max(ratio, 1e-12))))
    delta = pred - base
    ends = (base + delta / factor, base + delta * factor)
    # The fit's own relative uncertainty bounds how cheap any step can be.
    low = max(min(ends), pred / factor)
    return low, max(max(ends), pred)


def verify_knee_tokens(
    state: StepCostState,
    *,
    kv_tokens: float = 0.0,
    tolerance: float = 0.25,
    max_tokens: int = 16384,
) -> int:
    """Batched tokens at which verification stops being free.

    The smallest number of tokens ``n`` verified in one step (``n`` requests without
    drafts, ``kv_tokens`` total cached tokens) whose predicted step time exceeds that
    of one token by more than ``tolerance``; ``max_tokens`` if none does.
    """
    if not is_real(tolerance) or tolerance <= 0:
        raise PolicyTypeError(f"verify_knee_tokens: tolerance: expected > 0, got {tolerance!r}")
    base = predict_step_s(state, 1.0, 0, kv_tokens) * (1.0 + tolerance)
    if predict_step_s(state, float(max_tokens), 0, kv_tokens) <= base:
        return max_tokens
    lo, hi = 1, max_tokens  # predict(lo) <= base < predict(hi); monotone in between
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if predict_step_s(state, float(mid), 0, kv_tokens) > base:
            hi = mid
        else:
            lo = mid
    return hi


# --------------------------------------------------------------------------- update


def _cell(sample: StepSample) -> tuple[int, int]:
    return (sample.steps, round(math.log2(sample.batch_size)))


def _evict(samples: list[StepSample], max_samples: int) -> list[StepSample]:
    """Drop the oldest sample of the most crowded cells until the buffer fits."""
    if len(samples) <= max_samples:
        return samples
    # Each sample's cell once, and the counts kept as samples go (a full buffer drops a
    # few per window: recounting all for each would cost more than the fit).
    cells = [_cell(s) for s in samples]
    counts: dict[tuple[int, int], int] = {}
    for key in cells:
        counts[key] = counts.get(key, 0) + 1
    while len(samples) > max_samples:
        most = max(counts.values())
        oldest = min(
            (i for i, key in enumerate(cells) if counts[key] == most),
            key=lambda i: (samples[i].time_s, i),
        )
        key = cells.pop(oldest)
        counts[key] -= 1
        if not counts[key]:
            del counts[key]
        del samples[oldest]
    return samples


# Per (prior, config) by identity: _penalty_scales is data-independent and every fit of
# a policy's life asks for the same one.
_PENALTY_CACHE: Final[IdentityCache[np.ndarray]] = IdentityCache(16)


def _penalty_scales(prior: StepCostPrior, config: StepCostConfig) -> np.ndarray:
    """Typical relative contribution of one unit of each coefficient (data-independent).

    Read-only: the array is shared by every fit with this prior and config.
    """
    hit = _PENALTY_CACHE.get((prior, config))
    if hit is not None:
        return hit
    out = _compute_penalty_scales(prior, config)
    out.flags.writeable = False
    return _PENALTY_CACHE.put((prior, config), out)


def _compute_penalty_scales(prior: StepCostPrior, config: StepCostConfig) -> np.ndarray:
    steps = (0, 1, 3, 5, 7) if prior.speculative else (0,)
    acc = np.zeros(N_FEATURES)
    count = 0
    for b in (1.0, 4.0, 16.0, 64.0, 256.0):
        for k in steps:
            kv = b * config.default_kv_tokens_per_request
            f = np.asarray(prior.features(b, k, kv))
            acc += f / prior.predict_s(b, k, kv)
            count += 1
    scales = acc / count
    # The extra knee terms share the main roofline's scale; nothing is left unpinned.
    scales[1] = scales[3] = scales[2]
    out: np.ndarray = np.maximum(scales, 1e-3)
    return out


def _huber_weights(resid: np.ndarray, config: StepCostConfig) -> np.ndarray:
    """Huber IRLS weights on a robust (MAD) scale of the relative residuals."""
    mad = _median(np.abs(resid - _median(resid)))
    limit = config.huber_delta * max(1.4826 * mad, config.min_rel_scale)
    out: np.ndarray = np.minimum(1.0, limit / np.maximum(np.abs(resid), 1e-12))
    return out


def _weighted_median(
    values: Sequence[float] | np.ndarray, weights: Sequence[float] | np.ndarray
) -> float:
    """The weighted median (lower on a tie); 1.0 when the weights are all zero (or none).

    Arrays (the fit's hundreds of samples) go through numpy's argsort / cumsum /
    searchsorted; lists (a cell's few samples, where numpy's per-call cost dominates)
    through the same operations in plain Python (a stable sort, a sequential sum, a
    left bisection): the same value.
    """
    if isinstance(values, np.ndarray):
        order = np.argsort(values)
        cum_np = np.cumsum(np.asarray(weights)[order])
        if not len(cum_np) or cum_np[-1] <= 0:
            return 1.0
        return float(values[order][int(np.searchsorted(cum_np, 0.5 * cum_np[-1]))])
    rank = sorted(range(len(values)), key=values.__getitem__)
    return _weighted_median_sorted([values[i] for i in rank], [weights[i] for i in rank])


def _weighted_median_sorted(values: Sequence[float], weights: Sequence[float]) -> float:
    """:func:`_weighted_median` of ``values`` already in ascending order."""
    cum = list(itertools.accumulate(weights))
    if not cum or cum[-1] <= 0:
        return 1.0
    return float(values[bisect.bisect_left(cum, 0.5 * cum[-1])])


def _median(values: Sequence[float] | np.ndarray) -> float:
    """``np.median`` of a non-empty list or array: the middle value, or the mean of the
    two middle ones (selected by ``np.partition`` for an array, as np.median does)."""
    n = len(values)
    mid = n // 2
    if isinstance(values, np.ndarray):
        if n % 2:
            return float(np.partition(values, mid)[mid])
        part = np.partition(values, (mid - 1, mid))
        return float((part[mid - 1] + part[mid]) / 2.0)
    return _median_sorted(sorted(values))


def _median_sorted(ordered: Sequence[float]) -> float:
    """:func:`_median` of a non-empty list already in ascending order."""
    mid = len(ordered) // 2
    if len(ordered) % 2:
        return float(ordered[mid])
    return float((ordered[mid - 1] + ordered[mid]) / 2.0)


def _recalibration(
    ratios: np.ndarray, weights: np.ndarray, steps: Sequence[int], config: StepCostConfig
) -> float:
    """The factor that scales the prior the fit is pulled towards.

    While the samples cover one step count only, the fit cannot tell which coefficients
    are off; pulled towards the raw prior, the least-penalised terms (the per-draft-step
    ones) absorb the whole scale error and the predicted cost goes flat in the steps, so
    an unrun larger step count looks free. Pulled towards the prior recalibrated by one
    factor (the weighted median of observed / predicted), the fit keeps the prior's shape
    where the data is silent, and is exact when the prior's only error is its scale.
    The pull (``prior_strength`` windows on each of the coefficients) outweighs a few
    windows, so this matters until the data dominates: once a second step count holds
    as much weight as the whole pull, the data pins the cost per step and the pull
    returns to the prior itself (log-linearly in between).
    """
    by_steps: dict[int, float] = {}
    for k, wk in zip(steps, weights.tolist(), strict=True):
        by_steps[k] = by_steps.get(k, 0.0) + wk
    covered = sorted(by_steps.values(), reverse=True)
    second = covered[1] if len(covered) > 1 else 0.0
    trust = min(1.0, second / (N_FEATURES * config.prior_strength))
    return float(_weighted_median(ratios, weights) ** (1.0 - trust))


def _fit(
    prior: StepCostPrior,
    samples: tuple[StepSample, ...],
    now_s: float,
    config: StepCostConfig,
    start: tuple[float, ...] | None = None,
) -> tuple[float, ...]:
    """Robust non-negative fit; ``start`` (the previous fit) seeds the Huber weights."""
    theta0 = np.asarray(prior.prior_coefficients())
    if not samples:
        return tuple(float(t) for t in theta0)
    cols = _columns(prior, samples)
    feats = cols.features
    base = feats @ theta0  # prior prediction per sample
    x = feats / base[:, None]
    y = cols.step_s / base
    age = np.maximum(0.0, now_s - np.asarray(cols.time_s))
    w = np.asarray(cols.weight) * 0.5 ** (age / config.half_life_s)
    target = theta0 * _recalibration(y, w, cols.steps.tolist(), config)
    scales = _penalty_scales(prior, config)
    root_l = math.sqrt(config.prior_strength)
    pen_x = np.diag(root_l * scales)
    pen_y = root_l * scales * target
    theta = theta0 if start is None else np.asarray(start)
    huber = _huber_weights(y - x @ theta, config) if start is not None else np.ones(len(y))
    for _ in range(config.irls_iterations):
        sw = np.sqrt(w * huber)
        a = np.vstack([x * sw[:, None], pen_x])
        b = np.concatenate([y * sw, pen_y])
        new = np.maximum(nnls(a, b)[0], 0.0)
        huber = _huber_weights(y - x @ new, config)
        # Ten coefficients: plain Python (the same max of the same differences).
        new_l, old_l = new.tolist(), theta.tolist()
        step = max(abs(a - b) for a, b in zip(new_l, old_l, strict=True))
        converged = step < 1e-6 * max(1.0, max(new_l))
        theta = new
        if converged:
            break
    if not np.all(np.isfinite(theta)):
        return tuple(float(t) for t in theta0)
    return tuple(float(t) for t in theta)


def update_step_cost(
    state: StepCostState,
    snapshot: TierStatsSnapshot,
    *,
    kv_tokens_per_request: float | None,
    config: StepCostConfig | None = None,
) -> StepCostState:
    """Add one window's timed tiers as samples and refit (only if something was added).

    ``kv_tokens_per_request`` is the mean cached context per running request over the
    window (None: ``config.default_kv_tokens_per_request``). A snapshot whose window
    ends at or before the newest one absorbed is ignored (seen already).
    """
    cfg = config or StepCostConfig()
    if not isinstance(snapshot, TierStatsSnapshot):
        raise PolicyTypeError(
            f"update_step_cost: snapshot: expected a TierStatsSnapshot, got {snapshot!r}"
        )
    if kv_tokens_per_request is not None and (
        not is_real(kv_tokens_per_request) or kv_tokens_per_request < 0
    ):
        raise PolicyTypeError(
            f"update_step_cost: kv_tokens_per_request: expected None or a number >= 0, "
            f"got {kv_tokens_per_request!r}"
        )
    end = snapshot.window_end_s
    if state.last_time_s is not None and end <= state.last_time_s:
        return state
    ctx = (
        cfg.default_kv_tokens_per_request
        if kv_tokens_per_request is None
        else float(kv_tokens_per_request)
    )
    added: list[StepSample] = []
    for tier in snapshot.tiers:
        if tier.step_time_count == 0 or tier.verify_calls == 0 or tier.batch_size_sum == 0:
            continue
        if tier.steps > 0 and not state.prior.speculative:
            continue  # a drafter-less prior cannot explain speculative steps
        mean_s = tier.step_time_sum_s / tier.step_time_count
        if not math.isfinite(mean_s) or mean_s <= 0:
            continue
        batch = tier.batch_size_sum / tier.verify_calls
        count = tier.step_time_count
        added.append(
            StepSample(
                time_s=end,
                batch_size=batch,
                steps=tier.steps,
                kv_tokens=ctx * batch,
                step_s=mean_s,
                weight=count / (count + cfg.count_saturation),
            )
        )
    if not added:
        return StepCostState(
            prior=state.prior,
            samples=state.samples,
            coefficients=state.coefficients,
            last_time_s=end,
            fits=state.fits,
        )
    samples = tuple(_evict(list(state.samples) + added, cfg.max_samples))
    return StepCostState(
        prior=state.prior,
        samples=samples,
        coefficients=_fit(state.prior, samples, end, cfg, start=state.coefficients),
        last_time_s=end,
        fits=state.fits + 1,
    )
