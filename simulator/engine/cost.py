"""Step-cost model of a (speculative) SGLang decode/prefill step, in seconds.

The decode-step formula is defined once, in ``specgov.policies.common.roofline`` (the
policies' step-cost prior predicts with the same code); this module derives its
coefficients from the catalog, documents their calibration, and adds prefill.

One target forward over ``n`` batched tokens that reads ``kv`` cached tokens costs::

    fixed + smoothmax(weights_read, n * compute_per_token) + kv * kv_read_per_token
          (+ tensor-parallel all-reduces)

* ``weights_read`` = weight bytes / achieved HBM bandwidth: the memory-bound floor.
  At small ``n`` every weight is read once per forward whatever ``n`` is, so the
  curve is flat; past the roofline knee the GEMMs become compute-bound at
  ``2 * params`` FLOPs per token / achieved compute.
* ``smoothmax(a, b) = (a^p + b^p)^(1/p)`` with p = 2 reproduces the measured knee:
  the Vidur H100 profile (Llama-2-7B linear + norm ops, REFERENCE.md §3) is flat
  5.5-5.9 ms from 1 to 64 tokens, 6.4 ms @128, 9.2 @256, 12.0 @512, 21 @1024,
  40 @2048, 83 @4096. This model gives for Llama-3.1-8B on H100 (without the fixed
  term) 6.0 ms @1, 6.2 @64, 6.7 @128, 8.3 @256, 13.0 @512, 23.8 @1024, 92 @4096
  (22.5 µs/token past the knee; a harder max (large p) would be flat until
  ~266 tokens, which the profile contradicts).
* The KV read (attention over the cache) is a separate memory-bound kernel, so it
  adds instead of joining the roofline max: kv_bytes_per_token / bandwidth, 49 ns
  per cached token for Llama-3.1-8B on H100 (SpecDecode-Bench fit: 39 ns).
* ``fixed`` (1.0 ms) is the per-forward engine overhead (launch, sampling,
  scheduler, detokenizer hand-off). It is fitted so the no-speculation TPOT of
  Llama-3.1-8B on H100 at batch 1 is 7.04 ms (vLLM issue 20780 measured 7.07 ms).

SpecDecode-Bench's linear fit (REFERENCE §3: 5.886 ms + 21.0 µs x batched tokens +
39 ns x KV tokens) has no flat region: at 1 token it agrees with our forward
(5.95 vs 6.04 ms without ``fixed``), between 32 and 1024 tokens it lies above it
(e.g. 7.3 vs 6.2 ms at 64, 8.6 vs 6.7 ms at 128); tests/test_cost_model.py
checks this.

A speculative decode step with ``k`` draft steps for a batch of ``B`` requests::

    k draft forwards   (first over B tokens, then B*topk: a tree expands topk per node)
  + target verify      over B*(k+1) tokens (chains) or B*min(num_draft_tokens, 1+k*topk)
  + draft-extend pass  over the verified tokens (refreshes the drafter's KV)
  + per-verify, per-verified-token and per-request bookkeeping

Each draft forward costs ``smoothmax(draft_weights_read, tokens * draft_compute) +
kv * draft_kv_read + step_overhead``. With ``k = 0`` and a drafter the verify of B
tokens plus the draft-extend pass and the bookkeeping are still paid (SGLang runs
draft-extend at step 0 to keep the draft KV warm), so "off" is cheaper than
speculating but dearer than running without a drafter. The drafter's overheads
come from drafters.yaml; for EAGLE-3 they are fitted so that Llama-3.1-8B on H100
at batch 1 takes 12.5 ms per step at k = 4 (TPOT 4.05 ms x E[L(4)] = 3.08, vLLM
issue 20780). The per-verified-token term (14 µs for EAGLE-3) is fitted to the
EAGLE-3 paper's 1.38x throughput at batch 64 in SGLang on H100: the roofline
alone would keep 1.66x there, while measured speculation gains shrink with load.

Tensor parallelism (an estimate, no source measured here): weights, FLOPs and KV
split evenly over the ranks, plus two all-reduces per layer per forward at
6 µs latency each and 300 GB/s achieved link bandwidth.

Performance: ``decode_step_s`` (inherited from ``Roofline``) and ``prefill_s`` are on
the engine's hot path (~400k calls per replay) and are plain float arithmetic on values
precomputed in ``__init__``.
"""

from __future__ import annotations

from collections.abc import Mapping

from specgov.policies.common.roofline import (
    DEFAULT_ROOFLINE_EXPONENT,
    MAX_STEPS,
    Roofline,
    RooflineCoefficients,
    RooflineError,
)
from specgov.policies.common.validation import is_int
from specgov.simulator.catalog import DrafterSpec, GpuSpec, ModelSpec

__all__ = [
    "DEFAULT_ROOFLINE_EXPONENT",
    "MAX_STEPS",
    "CostCoefficients",
    "CostModel",
    "CostModelError",
    "ZeroStepScaledCost",
]

# The coefficients and their errors are the policies' roofline types: one definition,
# shared with the step-cost estimator's prior (policies/common/roofline.py).
CostCoefficients = RooflineCoefficients
CostModelError = RooflineError

# Per-forward engine overhead (launch, sampling, scheduling), seconds; see module doc.
DEFAULT_FIXED_OVERHEAD_S = 1.0e-3
# Tensor-parallel all-reduce (estimate): latency per all-reduce, achieved link bytes/s.
TP_ALLREDUCE_LATENCY_S = 6e-6
TP_LINK_BYTES_S = 300e9
ACTIVATION_BYTES = 2  # bf16 activations travel in the all-reduces


class CostModel(Roofline):
    """Seconds per target forward, per decode step and per prefill, for one shape.

    The decode step and the target forward are :class:`~specgov.policies.common.roofline.Roofline`'s
    (the same code the step-cost prior predicts with); this class adds the catalog
    builder and the prefill cost, which only the simulator charges.
    ``speculative`` is True when a drafter is configured (even at steps 0). The
    tree shape is fixed at construction: ``topk == 1`` is a chain (verify k+1 tokens
    per request), ``topk > 1`` a tree verifying ``min(num_draft_tokens, 1+k*topk)``.
    ``kv_tokens`` arguments are the KV tokens read by the whole batch (sum of the
    running requests' cached tokens).
    """

    __slots__ = ()

    # ------------------------------------------------------------------ builders

    @classmethod
    def from_catalog(
        cls,
        gpu: GpuSpec,
        model: ModelSpec,
        drafter: DrafterSpec | None,
        overrides: Mapping[str, float] | None = None,
        *,
        topk: int = 1,
        num_draft_tokens: int | None = None,
        tp_size: int = 1,
    ) -> CostModel:
        """Coefficients derived from catalog figures, then *overrides* by field name."""
        if not is_int(tp_size) or tp_size < 1:
            raise CostModelError(f"tp_size must be an integer >= 1, got {tp_size!r}")
        if drafter is not None and not drafter.supports(model.name):
            raise CostModelError(
                f"drafter '{drafter.name}' cannot draft for '{model.name}'; "
                f"it supports: {', '.join(drafter.targets)}"
            )
        bw = gpu.achieved_bandwidth_bytes_s
        flops = gpu.achieved_flops_s
        tp = float(tp_size)
        comm_fixed = comm_tok = 0.0
        if tp_size > 1:
            allreduces = 2 * model.num_layers
            comm_fixed = allreduces * TP_ALLREDUCE_LATENCY_S
            ring = 2.0 * (tp - 1.0) / tp  # ring all-reduce traffic factor
            comm_tok = allreduces * model.hidden_size * ACTIVATION_BYTES * ring / TP_LINK_BYTES_S
        kwargs: dict[str, float] = {
            "fixed_overhead_s": DEFAULT_FIXED_OVERHEAD_S,
            "weight_read_s": model.weight_bytes / tp / bw,
            "compute_per_token_s": 2.0 * model.params_b * 1e9 / tp / flops,
            "kv_read_per_token_s": model.kv_bytes_per_token / tp / bw,
            # QK^T and PV: 2 x 2 FLOPs per (query, key) pair per hidden unit per layer.
            "attention_per_token_pair_s": 4.0 * model.num_layers * model.hidden_size / tp / flops,
            "tp_comm_fixed_s": comm_fixed,
            "tp_comm_per_token_s": comm_tok,
        }
        if drafter is not None:
            dparams = drafter.params_b_for(model.name)
            kwargs.update(
                draft_weight_read_s=drafter.weight_bytes_for(model.name) / tp / bw,
                draft_compute_per_token_s=2.0 * dparams * 1e9 / tp / flops,
                draft_kv_read_per_token_s=drafter.kv_bytes_per_token / tp / bw,
                draft_step_overhead_s=drafter.step_overhead_ms * 1e-3,
                draft_extend_overhead_s=drafter.extend_overhead_ms * 1e-3,
                spec_verify_overhead_s=drafter.verify_overhead_ms * 1e-3,
                spec_verify_per_token_s=drafter.verify_token_overhead_us * 1e-6,
                draft_per_request_s=drafter.per_request_us * 1e-6,
            )
        coef = CostCoefficients(**kwargs).with_overrides(overrides)
        if drafter is not None and (
            drafter.zero_step_extend_scale != 1.0 or drafter.zero_step_verify_scale != 1.0
        ):
            return ZeroStepScaledCost(
                coef,
                topk=topk,
                num_draft_tokens=num_draft_tokens,
                extend_scale=drafter.zero_step_extend_scale,
                verify_scale=drafter.zero_step_verify_scale,
            )
        return cls(
            coef, speculative=drafter is not None, topk=topk, num_draft_tokens=num_draft_tokens
        )

    def with_overrides(self, overrides: Mapping[str, float]) -> CostModel:
        """The same shape with some coefficients replaced (e.g. fitted online)."""
        return CostModel(
            self._coef.with_overrides(overrides),
            speculative=self.speculative,
            topk=self.topk,
            num_draft_tokens=self.num_draft_tokens,
        )

    def zero_step_terms_s(self, batch_size: float, kv_tokens: float) -> dict[str, float]:
        """What a speculative step at 0 drafts pays beyond a plain step, by term
        (seconds for the whole batch): the draft-extend pass and the verify bookkeeping
        (per-verify overhead plus the per-verified-token work on the batch's tokens);
        ``other`` is the rest (the n-gram drafter's per-request host work)."""
        if not self.speculative:
            return {"draft_extend": 0.0, "verify_bookkeeping": 0.0, "other": 0.0}
        c = self._coef
        extend = self.draft_extend_pass_s(batch_size, 0, kv_tokens)
        verify = self._zero_verify_scale() * (
            c.spec_verify_overhead_s + batch_size * c.spec_verify_per_token_s
        )
        return {
            "draft_extend": extend,
            "verify_bookkeeping": verify,
            "other": batch_size * c.draft_per_request_s,
        }

    def _zero_verify_scale(self) -> float:
        return 1.0

    def draft_extend_pass_s(self, batch_size: float, steps: int, kv_tokens: float) -> float:
        """The draft-extend pass inside ``decode_step_s(batch_size, steps, kv_tokens)``:
        the drafter's forward over the verified tokens, its KV read and its launch
        overhead. ``SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND`` saves it at steps 0."""
        if not self.speculative:
            return 0.0
        self._check_steps(steps)
        n = batch_size * self._vtok[steps]
        p = self._p
        t: float = (
            (self._dw_p + (n * self._dcomp) ** p) ** self._ip
            + kv_tokens * self._dkv
            + self._coef.draft_extend_overhead_s
        )
        return t

    # ------------------------------------------------------------------ hot path

    def prefill_s(self, new_tokens: int, prefix_kv_tokens: int) -> float:
        """HOT. One prefill forward of *new_tokens* on top of *prefix_kv_tokens* cached.

        Batch totals are accepted; attention pairs are then counted as for one
        request (new x prefix + new^2/2), an upper bound for several requests.
        With a drafter the draft model prefills the same tokens (draft-extend).
        """
        p = self._p
        ip = self._ip
        c = self._coef
        pairs = new_tokens * (prefix_kv_tokens + 0.5 * (new_tokens + 1))
        t: float = (
            self._fixed
            + (self._w_p + (new_tokens * self._tc) ** p) ** ip
            + prefix_kv_tokens * self._kv
            + pairs * c.attention_per_token_pair_s
            + new_tokens * self._tp_tok
        )
        if self.speculative:
            t += (
                (self._dw_p + (new_tokens * self._dcomp) ** p) ** ip
                + prefix_kv_tokens * self._dkv
                + c.draft_extend_overhead_s
            )
        return t


class ZeroStepScaledCost(CostModel):
    """A speculative cost model whose step-0 terms are scaled (the drafter's
    ``zero_step_extend_scale`` and ``zero_step_verify_scale``, issue 22 §2): at 0 drafts
    the draft-extend pass costs ``extend_scale`` x and the verify bookkeeping
    ``verify_scale`` x what :class:`CostModel` charges; steps > 0 are unchanged. A
    subclass, so the default (both 1) keeps the plain hot path."""

    __slots__ = ("_ext_scale", "_ver_scale")

    def __init__(
        self,
        coefficients: RooflineCoefficients,
        *,
        topk: int = 1,
        num_draft_tokens: int | None = None,
        extend_scale: float,
        verify_scale: float,
    ) -> None:
        super().__init__(
            coefficients, speculative=True, topk=topk, num_draft_tokens=num_draft_tokens
        )
        self._ext_scale = float(extend_scale)
        self._ver_scale = float(verify_scale)

    def _zero_verify_scale(self) -> float:
        return self._ver_scale

    def with_overrides(self, overrides: Mapping[str, float]) -> CostModel:
        return ZeroStepScaledCost(
            self._coef.with_overrides(overrides),
            topk=self.topk,
            num_draft_tokens=self.num_draft_tokens,
            extend_scale=self._ext_scale,
            verify_scale=self._ver_scale,
        )

    def draft_extend_pass_s(self, batch_size: float, steps: int, kv_tokens: float) -> float:
        full = super().draft_extend_pass_s(batch_size, steps, kv_tokens)
        return full * self._ext_scale if steps == 0 else full

    def decode_step_s(self, batch_size: float, steps: int, kv_tokens: float) -> float:
        t = super().decode_step_s(batch_size, steps, kv_tokens)
        if steps != 0:
            return t
        c = self._coef
        extend = super().draft_extend_pass_s(batch_size, 0, kv_tokens)
        verify = c.spec_verify_overhead_s + batch_size * c.spec_verify_per_token_s
        return t + (self._ext_scale - 1.0) * extend + (self._ver_scale - 1.0) * verify
