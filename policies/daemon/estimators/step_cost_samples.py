"""The step-cost estimator's samples: its knobs, one timed window, the bounded buffer.

:class:`SampleColumns` holds a samples tuple as columns together with the prior's terms
of each sample (its features and prediction): what the fit and a state's model read per
sample. A sample's terms depend on the prior and the sample only and a sample stays in
successive states (an update adds a window and evicts a few), so a state's columns are
built once, from the previous state's rows where it keeps them (:meth:`extended`,
by the kept samples' positions: :func:`evict` says which), not once per fit or query.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from specgov.policies.common.types import PolicyTypeError
from specgov.policies.common.validation import check_fields, check_int, check_real
from specgov.policies.daemon.estimators._common import is_int, is_real
from specgov.policies.daemon.estimators.step_cost_prior import N_FEATURES, StepCostPrior

__all__ = ["SampleColumns", "StepCostConfig", "StepSample", "evict"]


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
        counts = ("max_samples", "irls_iterations")
        check_fields("StepCostConfig", self, counts, check_int, error=PolicyTypeError, minimum=1)
        positive = ("half_life_s", "prior_strength", "huber_delta", "min_rel_scale")
        check_fields(
            "StepCostConfig", self, positive, check_real, error=PolicyTypeError, positive=True
        )
        non_negative = ("count_saturation", "default_kv_tokens_per_request")
        check_fields(
            "StepCostConfig", self, non_negative, check_real, error=PolicyTypeError, minimum=0.0
        )


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
class SampleColumns:
    """``samples`` as columns, with ``prior``'s terms of each (module docstring)."""

    prior: StepCostPrior
    samples: tuple[StepSample, ...]
    features: np.ndarray  # (samples, N_FEATURES): StepCostPrior.features of each
    prior_s: np.ndarray  # the prior's prediction of each
    step_s: np.ndarray
    batch: np.ndarray
    steps: np.ndarray  # int
    time_s: list[float]
    weight: list[float]

    @classmethod
    def build(cls, prior: StepCostPrior, samples: tuple[StepSample, ...]) -> SampleColumns:
        """Every row computed from its sample."""
        terms = [
            (
                prior.features(x.batch_size, x.steps, x.kv_tokens),
                prior.predict_s(x.batch_size, x.steps, x.kv_tokens),
            )
            for x in samples
        ]
        rows = itertools.chain.from_iterable(t[0] for t in terms)
        features = np.fromiter(rows, dtype=float, count=len(samples) * N_FEATURES)
        return cls(
            prior=prior,
            samples=samples,
            features=features.reshape(len(samples), N_FEATURES),
            prior_s=np.asarray([t[1] for t in terms], dtype=float),
            step_s=np.asarray([x.step_s for x in samples], dtype=float),
            batch=np.asarray([x.batch_size for x in samples], dtype=float),
            steps=np.asarray([x.steps for x in samples], dtype=int),
            time_s=[x.time_s for x in samples],
            weight=[x.weight for x in samples],
        )

    def extended(self, added: tuple[StepSample, ...], keep: Sequence[int]) -> SampleColumns:
        """The columns of ``(self.samples + added)`` at the positions ``keep`` (ascending):
        the kept rows of this tuple copied, only ``added``'s computed."""
        merged = self.samples + added
        samples = tuple(merged[i] for i in keep)
        if not self.samples or keep[0] >= len(self.samples):
            return SampleColumns.build(self.prior, samples)  # nothing of this tuple kept
        new = SampleColumns.build(self.prior, added)
        take = np.asarray(keep, dtype=np.intp)

        def pick(old: np.ndarray, fresh: np.ndarray) -> np.ndarray:
            out: np.ndarray = np.concatenate([old, fresh])[take]
            return out

        return SampleColumns(
            prior=self.prior,
            samples=samples,
            features=pick(self.features, new.features),
            prior_s=pick(self.prior_s, new.prior_s),
            step_s=pick(self.step_s, new.step_s),
            batch=pick(self.batch, new.batch),
            steps=pick(self.steps, new.steps),
            time_s=[x.time_s for x in samples],
            weight=[x.weight for x in samples],
        )


def _cell(sample: StepSample) -> tuple[int, int]:
    return (sample.steps, round(math.log2(sample.batch_size)))


def evict(samples: Sequence[StepSample], max_samples: int) -> list[int]:
    """Positions of the samples kept (ascending) when the oldest sample of the most
    crowded (steps, batch-size octave) cell goes until at most ``max_samples`` are left."""
    keep = list(range(len(samples)))
    if len(keep) <= max_samples:
        return keep
    # Each sample's cell once, and the counts kept as samples go (a full buffer drops a
    # few per window: recounting all for each would cost more than the fit).
    cells = [_cell(s) for s in samples]
    counts: dict[tuple[int, int], int] = {}
    for key in cells:
        counts[key] = counts.get(key, 0) + 1
    while len(keep) > max_samples:
        most = max(counts.values())
        oldest = min(
            (i for i, key in enumerate(cells) if counts[key] == most),
            key=lambda i: (samples[keep[i]].time_s, i),
        )
        key = cells.pop(oldest)
        counts[key] -= 1
        if not counts[key]:
            del counts[key]
        del keep[oldest]
    return keep
