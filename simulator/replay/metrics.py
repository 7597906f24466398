"""Summaries of one simulated run: throughput, goodput, latency quantiles, SLO attainment.

Definitions (the same for every policy, so ratios are fair):

* throughput: output tokens of completed requests / (last completion - first arrival).
* goodput: output tokens of the completed requests that met the SLO, over the same span.
  A request meets the SLO when its TPOT (``(e2e - ttft) / (output_tokens - 1)``) is within
  ``slo_tpot_ms`` (single-token requests have no TPOT and pass that part) and, when set,
  its TTFT is within ``slo_ttft_ms``.
* ITL: SGLang's definition (``observe_inter_token_latency``): the gap since the request's
  previous output divided by the tokens that arrived together, counted once per token.
* mean_accept_length: tokens per request-verify, bonus included; 1.0 without speculation.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from specgov.policies.common.errors import SpecgovError
from specgov.simulator.engine.core import itl_bin_value
from specgov.simulator.engine.interface import EngineResult


class SloError(SpecgovError, ValueError):
    """An SLO value is not a positive number of milliseconds."""


@dataclass(frozen=True)
class Slo:
    tpot_ms: float | None = 50.0
    ttft_ms: float | None = None

    def __post_init__(self) -> None:
        for name in ("tpot_ms", "ttft_ms"):
            value = getattr(self, name)
            if value is not None and not (value > 0 and math.isfinite(value)):
                raise SloError(f"SLO {name} must be a positive number of ms, got {value!r}")


def _quantiles_ms(values_s: list[float]) -> dict[str, float | None]:
    arr = np.asarray(values_s, dtype=np.float64)
    arr = arr[~np.isnan(arr)]
    if arr.size == 0:
        return {"p50": None, "p90": None, "p99": None}
    p50, p90, p99 = np.percentile(arr, [50.0, 90.0, 99.0])
    return {"p50": float(p50) * 1e3, "p90": float(p90) * 1e3, "p99": float(p99) * 1e3}


def _hist_quantiles_ms(hist: list[int]) -> dict[str, float | None]:
    counts = np.asarray(hist, dtype=np.float64)
    total = counts.sum()
    if total <= 0:
        return {"p50": None, "p90": None, "p99": None}
    cum = np.cumsum(counts)
    out: dict[str, float | None] = {}
    for name, q in (("p50", 0.50), ("p90", 0.90), ("p99", 0.99)):
        idx = int(np.searchsorted(cum, q * total, side="left"))
        out[name] = itl_bin_value(idx) * 1e3
    return out


def slo_mask(result: EngineResult, slo: Slo) -> np.ndarray:
    """Boolean array over completed requests: did each meet the SLO?"""
    tpot = np.asarray(result.tpot_s, dtype=np.float64)
    ok = np.ones(tpot.shape, dtype=bool)
    if slo.tpot_ms is not None:
        ok &= np.isnan(tpot) | (tpot * 1e3 <= slo.tpot_ms)
    if slo.ttft_ms is not None:
        ok &= np.asarray(result.ttft_s, dtype=np.float64) * 1e3 <= slo.ttft_ms
    return ok


def good_tokens_by_window(
    result: EngineResult,
    slo: Slo,
    windows: Sequence[tuple[str, float, float]],
    *,
    offset_s: float = 0.0,
) -> dict[str, int]:
    """Output tokens of the SLO-meeting requests by the (name, start_s, end_s) window their
    arrival (``+ offset_s``) fell in; the first window also takes earlier arrivals and the
    last later ones (rounding at the edges)."""
    ok = slo_mask(result, slo)
    arrival = np.asarray(result.req_arrival_s, dtype=np.float64) + offset_s
    tokens = np.asarray(result.req_output_tokens, dtype=np.int64)
    out: dict[str, int] = {}
    for i, (name, start_s, end_s) in enumerate(windows):
        lower = -np.inf if i == 0 else start_s
        upper = np.inf if i == len(windows) - 1 else end_s
        out[name] = int(tokens[ok & (arrival >= lower) & (arrival < upper)].sum())
    return out


def summarise(name: str, result: EngineResult, slo: Slo) -> dict[str, Any]:
    """The per-policy JSON object of ``specgov replay --output json``."""
    span = max(result.end_s - result.first_arrival_s, 1e-9)
    ok = slo_mask(result, slo)
    out_tokens = np.asarray(result.req_output_tokens, dtype=np.int64)
    good_tokens = int(out_tokens[ok].sum()) if out_tokens.size else 0
    if result.verified_requests:
        mean_accept = (result.accepted_drafts + result.verified_requests) / result.verified_requests
    else:
        mean_accept = 1.0
    steps_per_slot: dict[str, dict[str, int]] = {}
    for (slot, steps), n in sorted(result.steps_hist.items()):
        steps_per_slot.setdefault(str(slot), {})[str(steps)] = n
    bs_total = sum(result.batch_size_hist.values())
    mean_bs = (
        sum(bs * n for bs, n in result.batch_size_hist.items()) / bs_total if bs_total else 0.0
    )
    return {
        "name": name,
        "throughput_tok_s": result.output_tokens / span,
        "goodput_tok_s": good_tokens / span,
        "completed_requests": result.completed,
        "aborted_requests": result.aborted,
        "output_tokens": result.output_tokens,
        "duration_s": span,
        "ttft_ms": _quantiles_ms(result.ttft_s),
        "tpot_ms": _quantiles_ms(result.tpot_s),
        "itl_ms": _hist_quantiles_ms(result.itl_hist),
        "e2e_ms": _quantiles_ms(result.e2e_s),
        "queue_ms": _quantiles_ms(result.queue_s),
        "slo_attainment": float(ok.mean()) if ok.size else None,
        "mean_accept_length": mean_accept,
        "accepted_tokens_per_verify": mean_accept,
        "retractions": result.retractions,
        "kv_peak_fraction": result.kv_peak_tokens / result.kv_token_capacity,
        "kv_token_capacity": result.kv_token_capacity,
        "decode_batches": result.decode_batches,
        "prefill_batches": result.prefill_batches,
        "mean_decode_batch_size": mean_bs,
        "tier_switches": result.tier_switches,
        "steps_per_slot": steps_per_slot,
    }
