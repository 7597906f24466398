"""The roofline cost of one (speculative) SGLang decode step, in seconds: ONE definition.

The simulator charges this for every decode step (``simulator/engine/cost.py``: ``CostModel``
is a :class:`Roofline` plus prefill) and the policies' step-cost estimator predicts
with it (``policies/daemon/estimators/step_cost.py``: ``StepCostPrior`` holds a
:class:`RooflineCoefficients` and predicts with :meth:`Roofline.decode_step_s`), so the
prior and the simulated GPU cannot drift apart. It lives here because ``policies/`` may
not import the simulator; the simulator imports it. Calibration notes (where the
coefficients come from) are in ``simulator/engine/cost.py``.

One target forward over ``n`` batched tokens that reads ``kv`` cached tokens::

    fixed + smoothmax(weights_read, n * compute_per_token) + kv * kv_read_per_token
          + n * tp_comm_per_token

``smoothmax(a, b) = (a^p + b^p)^(1/p)`` (``p = roofline_exponent``): the weights are
read once per forward whatever ``n`` is (the memory-bound floor), and past the knee the
GEMMs are compute-bound. The KV read is a separate memory-bound kernel, so it adds.

A speculative decode step with ``k`` draft steps for a batch of ``B`` requests::

    target verify      over n = B * v(k) tokens, v(k) = k + 1 (chains) or
                       min(num_draft_tokens, 1 + k * topk) (trees), plus n * verify_per_token
  + draft-extend pass  smoothmax(draft_weights, n * draft_compute) + kv * draft_kv_read
  + k draft forwards   the first over B tokens, the rest over B * topk, each
                       smoothmax(...) + kv * draft_kv_read + draft_step_overhead
  + draft_extend_overhead + spec_verify_overhead + B * draft_per_request

With ``k = 0`` and a drafter the verify, the draft-extend pass and the bookkeeping are
still paid (SGLang keeps the draft KV warm), so "off" is dearer than no drafter.

:meth:`Roofline.decode_step_terms` writes the same step as a weighted sum of its terms
(the weights are :attr:`Roofline.term_weights`), which is what the estimator fits a
correction over; tests hold ``decode_step_s`` equal to that sum.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from specgov.policies.common.types import PolicyTypeError
from specgov.policies.common.validation import is_int, is_real

__all__ = [
    "DEFAULT_ROOFLINE_EXPONENT",
    "MAX_STEPS",
    "Roofline",
    "RooflineCoefficients",
    "RooflineError",
    "scaled_coefficients",
]

# Largest draft step count a roofline answers for (verify widths are precomputed).
MAX_STEPS: Final = 64
DEFAULT_ROOFLINE_EXPONENT: Final = 2.0


class RooflineError(PolicyTypeError):
    """A cost coefficient or step shape is invalid; the message names it and the valid form."""


@dataclass(frozen=True, slots=True)
class RooflineCoefficients:
    """All cost coefficients of one deployment, in seconds (per token / per forward as named).

    ``roofline_exponent`` is the one unitless entry (p of the smooth max).
    ``attention_per_token_pair_s`` is used only by the simulator's prefill cost (decode
    attention is memory-bound: ``kv_read_per_token_s``).
    """

    fixed_overhead_s: float
    weight_read_s: float
    compute_per_token_s: float
    kv_read_per_token_s: float
    attention_per_token_pair_s: float = 0.0
    tp_comm_fixed_s: float = 0.0
    tp_comm_per_token_s: float = 0.0
    draft_weight_read_s: float = 0.0
    draft_compute_per_token_s: float = 0.0
    draft_kv_read_per_token_s: float = 0.0
    draft_step_overhead_s: float = 0.0
    draft_extend_overhead_s: float = 0.0
    spec_verify_overhead_s: float = 0.0
    spec_verify_per_token_s: float = 0.0
    draft_per_request_s: float = 0.0
    roofline_exponent: float = DEFAULT_ROOFLINE_EXPONENT

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise RooflineError(f"cost coefficient {f.name} must be a number, got {value!r}")
            if not is_real(value) or value < 0:  # also an int beyond float range
                raise RooflineError(
                    f"cost coefficient {f.name} must be finite and >= 0, got {value!r}"
                )
        if self.roofline_exponent < 1.0:
            raise RooflineError(
                f"cost coefficient roofline_exponent must be >= 1, got {self.roofline_exponent!r}"
            )

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    def with_overrides(self, overrides: Mapping[str, float] | None) -> RooflineCoefficients:
        """A copy with coefficients replaced by field name."""
        if not overrides:
            return self
        valid = self.field_names()
        unknown = sorted(k for k in overrides if k not in valid)
        if unknown:
            raise RooflineError(
                f"unknown cost coefficient(s) {', '.join(map(repr, unknown))}; "
                f"valid: {', '.join(valid)}"
            )
        return dataclasses.replace(self, **{k: float(v) for k, v in overrides.items()})


def scaled_coefficients(coefficients: RooflineCoefficients, scale: float) -> RooflineCoefficients:
    """Every time coefficient times ``scale``: every step then costs exactly ``scale`` x.

    Exact because each term is linear in the coefficients and the smooth max is
    homogeneous of degree 1 (``smoothmax(s*a, s*b) = s * smoothmax(a, b)``).
    """
    if isinstance(scale, bool) or not isinstance(scale, int | float):
        raise RooflineError(f"scale must be a number > 0, got {scale!r}")
    if not is_real(scale) or scale <= 0:
        raise RooflineError(f"scale must be a finite number > 0, got {scale!r}")
    if scale == 1.0:
        return coefficients
    return dataclasses.replace(
        coefficients,
        **{
            name: getattr(coefficients, name) * scale
            for name in RooflineCoefficients.field_names()
            if name != "roofline_exponent"
        },
    )


class Roofline:
    """Seconds per target forward and per decode step, for one coefficient set and shape.

    ``speculative`` is True when a drafter is configured (even at steps 0). ``topk == 1``
    is a chain (verify k+1 tokens per request); ``topk > 1`` a tree verifying
    ``min(num_draft_tokens, 1+k*topk)`` (``num_draft_tokens`` is ignored for chains).
    ``kv_tokens`` arguments are the KV tokens read by the whole batch (sum of the running
    requests' cached tokens). ``batch_size`` may be fractional (a mean batch size).

    Performance: :meth:`decode_step_s` is on the simulator's hot path (~400k calls per
    replay): plain float arithmetic on values precomputed in ``__init__`` (it inlines
    the forward of :meth:`target_forward_s`, the model's one-forward time, which the
    calibration checks against measured knees).
    """

    __slots__ = (
        "_coef",
        "_dcomp",
        "_dkv",
        "_draft_fixed",
        "_dstep_o",
        "_dw_p",
        "_fixed",
        "_ip",
        "_kv",
        "_p",
        "_per_req",
        "_tc",
        "_topk",
        "_tp_tok",
        "_vt_o",
        "_vtok",
        "_w_p",
        "num_draft_tokens",
        "speculative",
        "topk",
    )

    def __init__(
        self,
        coefficients: RooflineCoefficients,
        *,
        speculative: bool,
        topk: int = 1,
        num_draft_tokens: int | None = None,
    ) -> None:
        if not isinstance(coefficients, RooflineCoefficients):
            raise RooflineError(
                f"coefficients: expected RooflineCoefficients, got {type(coefficients).__name__}"
            )
        if not isinstance(speculative, bool):
            raise RooflineError(f"speculative must be a bool, got {speculative!r}")
        if not is_int(topk) or topk < 1:
            raise RooflineError(f"topk must be an integer >= 1, got {topk!r}")
        if topk > 1:
            if num_draft_tokens is None:
                raise RooflineError(
                    f"a tree (topk={topk}) needs num_draft_tokens (an integer >= 2)"
                )
            if not is_int(num_draft_tokens) or num_draft_tokens < 2:
                raise RooflineError(
                    f"num_draft_tokens must be an integer >= 2, got {num_draft_tokens!r}"
                )
        else:
            num_draft_tokens = None  # chains verify steps+1 tokens, whatever was passed
        if topk > 1 and not speculative:
            raise RooflineError("a tree shape (topk > 1) needs a drafter")
        c = coefficients
        self._coef = c
        self.speculative = speculative
        self.topk = topk
        self.num_draft_tokens = num_draft_tokens
        p = c.roofline_exponent
        self._p = p
        self._ip = 1.0 / p
        self._w_p = c.weight_read_s**p
        self._tc = c.compute_per_token_s
        self._kv = c.kv_read_per_token_s
        self._fixed = c.fixed_overhead_s + c.tp_comm_fixed_s
        self._tp_tok = c.tp_comm_per_token_s
        self._dw_p = c.draft_weight_read_s**p
        self._dcomp = c.draft_compute_per_token_s
        self._dkv = c.draft_kv_read_per_token_s
        self._dstep_o = c.draft_step_overhead_s
        self._draft_fixed = c.draft_extend_overhead_s + c.spec_verify_overhead_s
        self._per_req = c.draft_per_request_s
        self._vt_o = c.spec_verify_per_token_s
        self._topk = topk
        # Tokens per request verified (and re-run by draft-extend) at each step count.
        vtok = [1]
        for s in range(1, MAX_STEPS + 1):
            v = s + 1 if num_draft_tokens is None else min(num_draft_tokens, 1 + s * topk)
            vtok.append(v)
        self._vtok = vtok

    @property
    def coefficients(self) -> RooflineCoefficients:
        return self._coef

    def verify_tokens_per_request(self, steps: int) -> int:
        """Target tokens verified per request at *steps* (1 without speculation)."""
        if not self.speculative:
            return 1
        self._check_steps(steps)
        return self._vtok[steps]

    def _check_steps(self, steps: int) -> None:
        if not is_int(steps) or not 0 <= steps <= MAX_STEPS:
            raise RooflineError(f"steps must be in 0..{MAX_STEPS}, got {steps!r}")

    # ------------------------------------------------------------------ hot path

    def target_forward_s(self, n_tokens: float, kv_tokens: float) -> float:
        """One target forward over *n_tokens* batched tokens reading *kv_tokens*."""
        p = self._p
        t: float = (
            self._fixed
            + (self._w_p + (n_tokens * self._tc) ** p) ** self._ip
            + kv_tokens * self._kv
            + n_tokens * self._tp_tok
        )
        return t

    def decode_step_s(self, batch_size: float, steps: int, kv_tokens: float) -> float:
        """HOT. One decode step (drafts + verify + draft-extend) for the whole batch.

        Without a drafter ``steps`` is ignored.
        """
        p = self._p
        ip = self._ip
        t: float
        if not self.speculative:
            t = (
                self._fixed
                + (self._w_p + (batch_size * self._tc) ** p) ** ip
                + kv_tokens * self._kv
                + batch_size * self._tp_tok
            )
            return t
        if steps < 0 or steps > MAX_STEPS:
            self._check_steps(steps)
        n = batch_size * self._vtok[steps]
        # Target verify.
        t = (
            self._fixed
            + (self._w_p + (n * self._tc) ** p) ** ip
            + kv_tokens * self._kv
            + n * (self._tp_tok + self._vt_o)
        )
        dkv = kv_tokens * self._dkv
        dcomp = self._dcomp
        dw_p = self._dw_p
        # Draft-extend over the verified tokens, plus per-verify and per-request work.
        t += (dw_p + (n * dcomp) ** p) ** ip + dkv + self._draft_fixed
        t += batch_size * self._per_req
        if steps > 0:
            first: float = (dw_p + (batch_size * dcomp) ** p) ** ip + dkv + self._dstep_o
            if self._topk == 1 or steps == 1:
                t += steps * first
            else:
                wide: float = (
                    (dw_p + (batch_size * self._topk * dcomp) ** p) ** ip + dkv + self._dstep_o
                )
                t += first + (steps - 1) * wide
        return t

    # ------------------------------------------------------------- decomposition

    def target_roofline_s(self, n_tokens: float, compute_scale: float = 1.0) -> float:
        """The target's smooth max for *n_tokens*; ``compute_scale`` scales compute per token
        (2.0 moves the knee to half the tokens), for fitting a moved knee."""
        return float((self._w_p + (n_tokens * self._tc * compute_scale) ** self._p) ** self._ip)

    def decode_step_terms(
        self, batch_size: float, steps: int, kv_tokens: float
    ) -> tuple[float, float, float, float, float, float, float, float]:
        """The decode step as terms whose :attr:`term_weights`-weighted sum is
        :meth:`decode_step_s`: ``(1, target smooth max [s], verified tokens, requests,
        target KV tokens, draft KV tokens read (extend + k drafts), draft smooth maxes
        [s], draft steps)``. Without a drafter the draft terms are 0 and steps ignored.
        """
        k = steps if self.speculative else 0
        n = batch_size * self.verify_tokens_per_request(k)
        roof = self.target_roofline_s(n)
        if not self.speculative:
            return (1.0, roof, n, batch_size, kv_tokens, 0.0, 0.0, 0.0)
        p, ip = self._p, self._ip
        dw_p = self._dw_p
        dc = self._dcomp
        draft = (dw_p + (n * dc) ** p) ** ip  # draft-extend over the verified tokens
        if k > 0:
            first = (dw_p + (batch_size * dc) ** p) ** ip
            if self._topk == 1 or k == 1:
                draft += k * first
            else:
                wide = (dw_p + (batch_size * self._topk * dc) ** p) ** ip
                draft += first + (k - 1) * wide
        return (1.0, roof, n, batch_size, kv_tokens, kv_tokens * (1 + k), float(draft), float(k))

    @property
    def term_weights(self) -> tuple[float, float, float, float, float, float, float, float]:
        """Seconds per unit of each :meth:`decode_step_terms` term."""
        if not self.speculative:
            return (self._fixed, 1.0, self._tp_tok, 0.0, self._kv, 0.0, 0.0, 0.0)
        c = self._coef
        return (
            self._fixed + c.draft_extend_overhead_s + c.spec_verify_overhead_s,
            1.0,
            self._tp_tok + self._vt_o,
            self._per_req,
            self._kv,
            self._dkv,
            1.0,
            self._dstep_o,
        )
