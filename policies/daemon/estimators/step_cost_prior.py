"""The step-cost estimator's prior: the roofline step cost of one deployment.

:class:`StepCostPrior` holds the roofline coefficients the simulator's ``CostModel`` charges
with and predicts with the same code (:class:`specgov.policies.common.roofline.Roofline`), and
names the components (:data:`FEATURE_NAMES`) the learned correction combines; see
:mod:`specgov.policies.daemon.estimators.step_cost` for the model."""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from specgov.policies.common.roofline import Roofline, RooflineCoefficients, RooflineError
from specgov.policies.common.types import PolicyTypeError
from specgov.policies.common.validation import check_bool, check_keys
from specgov.policies.daemon.estimators._common import is_int, is_real

__all__ = [
    "FEATURE_NAMES",
    "N_FEATURES",
    "StepCostPrior",
    "check_point",
    "default_step_cost_prior",
    "dot_in_order",
]

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


@dataclass(frozen=True, slots=True)
class StepCostPrior:
    """The roofline step cost of one deployment: shared coefficients plus the step shape.

    ``coefficients`` is the :class:`~specgov.policies.common.roofline.RooflineCoefficients`
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
        check_bool("StepCostPrior.speculative", self.speculative, error=PolicyTypeError)
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
        check_point(batch_size, steps, kv_tokens)
        return self._roofline.decode_step_s(batch_size, steps, kv_tokens)

    # -------------------------------------------------------------- serialise

    # Its own flat shape (coefficients beside the shape keys); from_dict fills old keys.
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
        check_keys(
            "StepCostPrior.from_dict",
            data,
            sorted(_PRIOR_KEYS),
            error=PolicyTypeError,
            form="a JSON object (mapping)",
        )
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


def dot_in_order(a: Sequence[float], b: Sequence[float]) -> float:
    """Sum of the products in order (what every prediction has been computed with)."""
    if len(a) != len(b):
        raise PolicyTypeError(f"step cost: {len(a)} coefficients for {len(b)} features")
    return float(sum(map(operator.mul, a, b)))


def check_point(batch_size: float, steps: int, kv_tokens: float) -> None:
    if not is_real(batch_size) or batch_size < 0:
        raise PolicyTypeError(f"step cost: batch_size: expected a number >= 0, got {batch_size!r}")
    if not is_int(steps) or steps < 0:
        raise PolicyTypeError(f"step cost: steps: expected an int >= 0, got {steps!r}")
    if not is_real(kv_tokens) or kv_tokens < 0:
        raise PolicyTypeError(f"step cost: kv_tokens: expected a number >= 0, got {kv_tokens!r}")


def default_step_cost_prior() -> StepCostPrior:
    """Llama-3.1-8B + EAGLE-3 chain on one H100 (the catalog's figures, simulator/engine/cost.py).

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
