"""Step wall time as a function of batch size, draft steps and context, learned online.

Prior
    :class:`StepCostPrior` holds the roofline coefficients the simulator's
    ``CostModel`` charges with and predicts with the same code
    (:class:`specgov.policies.common.roofline.Roofline`: one definition; ``simulator/priors.py``
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
    stored; the fit is redone only when samples were added. Derived, not serialised: the
    samples' columns with the prior's terms of each (``SampleColumns``, built once per
    state, mostly copied from the previous state's).

Model
    The queries (:func:`local_step_s`, :func:`step_cost_bounds`, :func:`cost_evidence`)
    read a :class:`StepCostModel`: one state under one config with what every query
    compares against (each sample's log(observed / fitted), its decayed weight, the
    samples of each step count ranked). A policy builds one per state
    (:func:`step_cost_model`) and asks it dozens of points per decision.

Modules: :mod:`.step_cost_prior` (the prior and its features), :mod:`.step_cost_samples`
(config, samples, their columns, eviction), :mod:`.step_cost_fit` (the fit and the
medians); this module holds the state, the model and the update, and is the API.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np

from specgov.policies.common.types import PolicyTypeError, TierStatsSnapshot
from specgov.policies.common.validation import check_keys
from specgov.policies.daemon.estimators._common import is_int, is_real
from specgov.policies.daemon.estimators.step_cost_fit import (
    fit,
    median_sorted,
    weighted_median,
    weighted_median_sorted,
)
from specgov.policies.daemon.estimators.step_cost_prior import (
    FEATURE_NAMES,
    N_FEATURES,
    StepCostPrior,
    check_point,
    default_step_cost_prior,
    dot_in_order,
)
from specgov.policies.daemon.estimators.step_cost_samples import (
    SampleColumns,
    StepCostConfig,
    StepSample,
    evict,
)

__all__ = [
    "FEATURE_NAMES",
    "STEP_COST_STATE_VERSION",
    "StepCostConfig",
    "StepCostModel",
    "StepCostPrior",
    "StepCostState",
    "StepSample",
    "cost_evidence",
    "default_step_cost_prior",
    "initial_step_cost_state",
    "local_step_s",
    "predict_step_s",
    "step_cost_bounds",
    "step_cost_model",
    "update_step_cost",
]

STEP_COST_STATE_VERSION: Final = 1


# ---------------------------------------------------------------------------- state


@dataclass(frozen=True, slots=True)
class StepCostState:
    """The prior, the recent samples and the fitted coefficients; serialisable."""

    prior: StepCostPrior
    samples: tuple[StepSample, ...]
    coefficients: tuple[float, ...]
    last_time_s: float | None = None
    fits: int = 0
    version: int = STEP_COST_STATE_VERSION
    # Derived (not compared, not serialised): given by update_step_cost, which has them;
    # otherwise built here.
    columns: SampleColumns | None = field(default=None, repr=False, compare=False, kw_only=True)

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
        cols = self.columns
        if cols is None or cols.samples is not self.samples or cols.prior != self.prior:
            object.__setattr__(self, "columns", SampleColumns.build(self.prior, self.samples))

    @property
    def sample_columns(self) -> SampleColumns:
        """The samples as columns with the prior's terms of each (built once per state)."""
        cols = self.columns
        assert cols is not None  # set by __post_init__
        return cols

    # Its own encoding (codec docstring): hundreds of samples saved as rows of numbers.
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
            "StepCostState.from_dict",
            data,
            sorted(("version", "prior", "samples", "coefficients", "last_time_s", "fits")),
            error=PolicyTypeError,
            form="a JSON object (mapping)",
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
    check_point(batch_size, steps, kv_tokens)
    return dot_in_order(state.coefficients, state.prior.features(batch_size, steps, kv_tokens))


# Same operating region: a batch size within this factor either way (one octave).
_NEAR_FACTOR: Final = 2.0


def _near(sample: StepSample, batch_size: float) -> bool:
    """Same operating region: a batch size within ``_NEAR_FACTOR`` either way."""
    return batch_size / _NEAR_FACTOR <= sample.batch_size <= _NEAR_FACTOR * batch_size


@dataclass(frozen=True, slots=True)
class StepCostModel:
    """One state under one config, with what the queries compare against (built once).

    The goodput policy asks dozens of step times per decision against one state; each
    sample's log(observed / fitted), its decayed weight and the ranking of each step
    count's samples are the same for all of them, so :func:`step_cost_model` computes
    them once per state instead of once per query. ``regions`` holds the cells of each
    operating region asked about, keyed by the region's range in ``batch_sorted`` (the
    samples a batch size is near are a contiguous range there, so batch sizes with the
    same near samples share one entry): a decision asks ~10 batch sizes in ~8 regions
    for ~5 step counts each, and a region's cells cost ~150 us (measured by
    ``benchmarks/bench_step_cost.py``: ~8 ms per decision without this).
    """

    state: StepCostState
    config: StepCostConfig
    log_fit: np.ndarray  # log(observed / fitted) per sample
    prior_ratio: np.ndarray  # observed / the prior's prediction
    decayed: np.ndarray  # weights decayed by age (half_life_s)
    # steps -> (its sample indices, the same ordered by log_fit, a stable sort)
    by_steps: dict[int, tuple[np.ndarray, np.ndarray]]
    batch_sorted: list[float]  # the samples' batch sizes, ascending
    regions: dict[tuple[int, int], _Cells] = field(default_factory=dict)

    def near(self, batch_size: float) -> np.ndarray:
        """The samples in ``batch_size``'s operating region (``_near``)."""
        batch = self.state.sample_columns.batch
        return (batch >= batch_size / _NEAR_FACTOR) & (batch <= _NEAR_FACTOR * batch_size)

    def correction(self, batch_size: float, steps: int) -> float:
        """``local_step_s``'s factor ``exp(c * shrink)`` (1.0: no correction)."""
        region = (
            bisect.bisect_left(self.batch_sorted, batch_size / _NEAR_FACTOR),
            bisect.bisect_right(self.batch_sorted, _NEAR_FACTOR * batch_size),
        )
        if region[0] >= region[1]:
            return 1.0  # no sample near
        cells = self.regions.get(region)
        if cells is None:
            cells = self.regions[region] = self._cells(self.near(batch_size))
        return _cell_correction(cells, steps, self.config.min_rel_scale)

    def _cells(self, near: np.ndarray) -> _Cells:
        cells: dict[int, tuple[list[float], list[float], float]] = {}
        spread: list[float] = []
        for k, (idx, ranked) in self.by_steps.items():
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
            m = median_sorted(ordered)
            spread.extend([abs(v - m) for v in ordered])
        return _Cells(cells=cells, scatter=1.4826 * median_sorted(sorted(spread)))


def step_cost_model(state: StepCostState, config: StepCostConfig | None = None) -> StepCostModel:
    """``state``'s :class:`StepCostModel` under ``config`` (None: the defaults)."""
    if not isinstance(state, StepCostState):
        raise PolicyTypeError(f"step_cost_model: state: expected a StepCostState, got {state!r}")
    cfg = config or StepCostConfig()
    cols = state.sample_columns
    step_s = cols.step_s
    # predict_step_s for every sample at once: the same products summed in the same order
    # as dot_in_order (element-wise IEEE operations), so the values are bit-identical.
    features = cols.features
    fitted = np.zeros(len(step_s))
    for j, c in enumerate(state.coefficients):
        fitted = fitted + features[:, j] * c
    last = state.last_time_s
    if last is None:
        decayed = [float(w) for w in cols.weight]  # age 0: 0.5 ** 0 is exactly 1
    else:
        decayed = [
            float(w * 0.5 ** (max(0.0, last - t) / cfg.half_life_s))
            for t, w in zip(cols.time_s, cols.weight, strict=True)
        ]
    log_fit = np.asarray([math.log(max(r, 1e-12)) for r in (step_s / fitted).tolist()])
    by_steps: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    for k in np.unique(cols.steps).tolist():
        idx = np.flatnonzero(cols.steps == k)
        by_steps[k] = (idx, idx[np.argsort(log_fit[idx], kind="stable")])
    return StepCostModel(
        state=state,
        config=cfg,
        log_fit=log_fit,
        prior_ratio=step_s / cols.prior_s,
        decayed=np.asarray(decayed, dtype=float),
        by_steps=by_steps,
        batch_sorted=sorted(cols.batch.tolist()),
    )


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
    c = weighted_median_sorted(logs, weights) if n > 0 else 0.0
    if c == 0.0 or n <= 0:
        return 1.0
    shrink = max(0.0, 1.0 - scatter * scatter / (n * c * c))
    return math.exp(c * shrink)


def cost_evidence(model: StepCostModel, batch_size: float, steps: int) -> float:
    """Windows (sample weight) timed at ``steps`` near ``batch_size`` (within 2x).

    Not decayed: a step count once timed here stays timed while its samples are kept
    (the buffer keeps rare operating points), so it is not probed again only because
    time passed.
    """
    check_point(batch_size, steps, 0.0)
    return sum(s.weight for s in model.state.samples if s.steps == steps and _near(s, batch_size))


def local_step_s(model: StepCostModel, batch_size: float, steps: int, kv_tokens: float) -> float:
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
    check_point(batch_size, steps, kv_tokens)
    state = model.state
    pred = dot_in_order(state.coefficients, state.prior.features(batch_size, steps, kv_tokens))
    return pred * model.correction(batch_size, steps)


def step_cost_bounds(
    model: StepCostModel,
    batch_size: float,
    steps: int,
    kv_tokens: float,
    *,
    min_evidence: float = 0.5,
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
    pred = local_step_s(model, batch_size, steps, kv_tokens)
    if not is_real(min_evidence) or min_evidence <= 0:
        raise PolicyTypeError(
            f"step_cost_bounds: min_evidence: expected a number > 0, got {min_evidence!r}"
        )
    near = [s for s in model.state.samples if _near(s, batch_size)]
    by_steps: dict[int, float] = {}  # evidence as cost_evidence counts it
    for s in near:
        by_steps[s.steps] = by_steps.get(s.steps, 0.0) + s.weight
    if by_steps.get(steps, 0.0) >= min_evidence:
        return pred, pred
    anchors = [k for k, w in by_steps.items() if w >= min_evidence]
    if not anchors:
        return pred, pred
    anchor = min(anchors, key=lambda k: (abs(k - steps), k))
    base = local_step_s(model, batch_size, anchor, kv_tokens)
    mask = model.near(batch_size)
    ratio = weighted_median(model.prior_ratio[mask], model.decayed[mask])
    factor = math.exp(abs(math.log(max(ratio, 1e-12))))
    delta = pred - base
    ends = (base + delta / factor, base + delta * factor)
    # The fit's own relative uncertainty bounds how cheap any step can be.
    low = max(min(ends), pred / factor)
    return low, max(max(ends), pred)


# --------------------------------------------------------------------------- update


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
            columns=state.columns,
        )
    new = tuple(added)
    cols = state.sample_columns.extended(new, evict(state.samples + new, cfg.max_samples))
    return StepCostState(
        prior=state.prior,
        samples=cols.samples,
        coefficients=fit(cols, end, cfg, start=state.coefficients),
        last_time_s=end,
        fits=state.fits + 1,
        columns=cols,
    )
