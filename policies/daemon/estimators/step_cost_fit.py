"""The step-cost estimator's fit: robust non-negative least squares towards the prior.

Relative residuals ``(observed - predicted) / prior`` fitted by SciPy's ``nnls`` inside
an iteratively re-weighted loop with Huber weights on a robust (MAD) scale, with
pseudo-observations that pull each coefficient towards the (recalibrated) prior; see
:mod:`specgov.policies.daemon.estimators.step_cost` for the model. The medians here are the
estimator's one set: a rule on sorted values, the sort done by the caller's means.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Sequence
from typing import Final

import numpy as np
from scipy.optimize import nnls

from specgov.policies.daemon.estimators.step_cost_prior import (
    FEATURE_NAMES,
    N_FEATURES,
    StepCostPrior,
)
from specgov.policies.daemon.estimators.step_cost_samples import SampleColumns, StepCostConfig

__all__ = [
    "fit",
    "median",
    "median_sorted",
    "penalty_scales",
    "recalibration",
    "weighted_median",
    "weighted_median_sorted",
]


def penalty_scales(prior: StepCostPrior, config: StepCostConfig) -> np.ndarray:
    """Typical relative contribution of one unit of each coefficient (data-independent).

    Computed per fit: 25 roofline evaluations, ~70 us (measured,
    ``benchmarks/bench_step_cost.py``), less than handing them from state to state
    would be worth (the bar is 0.2 ms per decision).
    """
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


def median_sorted(ordered: Sequence[float] | np.ndarray) -> float:
    """``np.median`` of non-empty values in ascending order: the middle value, or the
    mean of the two middle ones."""
    mid = len(ordered) // 2
    if len(ordered) % 2:
        return float(ordered[mid])
    return float((ordered[mid - 1] + ordered[mid]) / 2.0)


def median(values: np.ndarray) -> float:
    """``np.median`` of a non-empty array (:func:`median_sorted` of its sort)."""
    return median_sorted(np.sort(values))


def weighted_median_sorted(values: Sequence[float], weights: Sequence[float]) -> float:
    """The weighted median of ``values`` in ascending order (the lower on a tie): the
    first whose cumulative weight reaches half the total; 1.0 when the weights are all
    zero (or there are none)."""
    cum = list(itertools.accumulate(weights))
    if not cum or cum[-1] <= 0:
        return 1.0
    return float(values[bisect.bisect_left(cum, 0.5 * cum[-1])])


def weighted_median(values: np.ndarray, weights: np.ndarray) -> float:
    """:func:`weighted_median_sorted` of ``values`` ordered by ``np.argsort``."""
    order = np.argsort(values)
    return weighted_median_sorted(values[order].tolist(), np.asarray(weights)[order].tolist())


def _huber_weights(resid: np.ndarray, config: StepCostConfig) -> np.ndarray:
    """Huber IRLS weights on a robust (MAD) scale of the relative residuals."""
    mad = median(np.abs(resid - median(resid)))
    limit = config.huber_delta * max(1.4826 * mad, config.min_rel_scale)
    out: np.ndarray = np.minimum(1.0, limit / np.maximum(np.abs(resid), 1e-12))
    return out


# The terms a GPU's speed scales (memory bandwidth and compute: the rooflines and the
# KV reads); the others are per-event overheads (launches, bookkeeping per step, per
# token, per request) that the catalog charges alike on every GPU.
_HARDWARE_TERMS: Final = frozenset(
    (
        "roofline_knee_x0.5",
        "roofline",
        "roofline_knee_x2",
        "target_kv_ns",
        "draft_kv_ns",
        "draft_roofline",
    )
)
_HARDWARE: Final = np.asarray([name in _HARDWARE_TERMS for name in FEATURE_NAMES])


def recalibration(
    x: np.ndarray, y: np.ndarray, weights: np.ndarray, theta0: np.ndarray, config: StepCostConfig
) -> np.ndarray:
    """Per-coefficient factors that scale the prior the fit is pulled towards.

    ``x`` holds the samples' features over the prior's prediction, ``y`` observed over
    predicted, ``weights`` their decayed weights. Pulled towards the raw prior, the
    least-penalised terms absorb a wrong prior's whole error and the predicted cost
    keeps the prior's shape where the data is silent. A prior built for another GPU is
    wrong in a structured way: its hardware terms (:data:`_HARDWARE_TERMS`, the weight
    and KV reads and the compute) are off by that GPU's speed, its per-event overheads
    are not. So the prior is recalibrated by two factors, one per group, the weighted
    least-squares fit of ``y`` on each sample's two shares of the prior, ridge-pulled
    (``prior_strength`` windows each) to one common factor, the weighted median of
    ``y``: samples that cannot tell the groups apart (one step count at one batch size)
    give that one factor, and where the shares vary (several step counts or batch
    sizes) the data separates them. An exact prior gives factors ~1, a prior wrong
    only by its scale that scale for both; the slope in the steps (per-step overheads
    against the verify roofline) then follows the measured split, not the prior's.
    """
    common = weighted_median(y, weights)
    hw = x[:, _HARDWARE] @ theta0[_HARDWARE]
    ov = x[:, ~_HARDWARE] @ theta0[~_HARDWARE]
    # The ridge counts prior_strength windows of the samples' mean shares, so a group
    # that is a small share of every step is still pinned by data that varies it.
    total = max(float(np.sum(weights)), 1e-12)
    lam_hw = config.prior_strength * float(weights @ (hw * hw)) / total
    lam_ov = config.prior_strength * float(weights @ (ov * ov)) / total
    a = np.asarray(
        [
            [float(weights @ (hw * hw)) + lam_hw, float(weights @ (hw * ov))],
            [float(weights @ (hw * ov)), float(weights @ (ov * ov)) + lam_ov],
        ]
    )
    b = np.asarray(
        [float(weights @ (hw * y)) + lam_hw * common, float(weights @ (ov * y)) + lam_ov * common]
    )
    try:
        r_hw, r_ov = np.linalg.solve(a, b).tolist()
    except np.linalg.LinAlgError:
        r_hw = r_ov = common
    if not (math.isfinite(r_hw) and math.isfinite(r_ov)) or r_hw <= 0 or r_ov <= 0:
        r_hw = r_ov = common
    return np.where(_HARDWARE, r_hw, r_ov)


def fit(
    cols: SampleColumns,
    now_s: float,
    config: StepCostConfig,
    start: tuple[float, ...] | None = None,
) -> tuple[float, ...]:
    """Robust non-negative fit of ``cols``' samples at ``now_s``; ``start`` (the previous
    fit) seeds the Huber weights."""
    theta0 = np.asarray(cols.prior.prior_coefficients())
    if not cols.samples:
        return tuple(float(t) for t in theta0)
    feats = cols.features
    base = feats @ theta0  # prior prediction per sample
    x = feats / base[:, None]
    y = cols.step_s / base
    age = np.maximum(0.0, now_s - np.asarray(cols.time_s))
    w = np.asarray(cols.weight) * 0.5 ** (age / config.half_life_s)
    target = theta0 * recalibration(x, y, w, theta0, config)
    scales = penalty_scales(cols.prior, config)
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
