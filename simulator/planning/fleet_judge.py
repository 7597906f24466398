"""Judging fleet runs: latency percentiles, goodput, the SLO verdict, the best fleet.

The rules are in ``fleet``'s module docstring (Judging); this module applies them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from specgov.simulator.engine.interface import EngineResult
from specgov.simulator.engine.memory import MemoryPlan
from specgov.simulator.planning.simplicity import complexity
from specgov.simulator.replay.metrics import Slo


def _nearest_rank(values: np.ndarray, pct: float) -> float | None:
    if values.size == 0:
        return None
    ordered = np.sort(values)
    rank = max(1, math.ceil(pct / 100.0 * ordered.size))
    return float(ordered[rank - 1])


def _ms(value: float | None) -> float | None:
    if value is None or not math.isfinite(value):
        return None
    return value * 1e3


def _quantiles(values: np.ndarray) -> dict[str, float | None]:
    return {f"p{q}": _ms(_nearest_rank(values, float(q))) for q in (50, 90, 99)}


def judge(
    results: Sequence[EngineResult], *, n_requests: int, end_s: float, slo: Slo, pct: float
) -> dict[str, Any]:
    """Fleet-wide latency, goodput and SLO verdict (module docstring: Judging)."""
    ttft = np.concatenate([np.asarray(r.ttft_s, dtype=np.float64) for r in results])
    tpot = np.concatenate([np.asarray(r.tpot_s, dtype=np.float64) for r in results])
    out_tok = np.concatenate([np.asarray(r.req_output_tokens, dtype=np.int64) for r in results])
    aborted = sum(r.aborted for r in results)
    ok = np.ones(ttft.shape, dtype=bool)
    if slo.tpot_ms is not None:
        ok &= np.isnan(tpot) | (tpot * 1e3 <= slo.tpot_ms)
    if slo.ttft_ms is not None:
        ok &= ttft * 1e3 <= slo.ttft_ms
    inf = np.full(aborted, np.inf)
    ttft_all = np.concatenate([ttft, inf])
    tpot_all = np.concatenate([tpot[~np.isnan(tpot)], inf])
    span = max(end_s, 1e-9)  # the trace's first arrival is at 0
    ttft_at = _nearest_rank(ttft_all, pct)
    tpot_at = _nearest_rank(tpot_all, pct)
    holds = True
    if slo.tpot_ms is not None and tpot_at is not None:
        holds &= tpot_at * 1e3 <= slo.tpot_ms
    if slo.ttft_ms is not None and ttft_at is not None:
        holds &= ttft_at * 1e3 <= slo.ttft_ms
    return {
        "requests": n_requests,
        "completed": int(ttft.size),
        "aborted": aborted,
        "output_tokens": int(out_tok.sum()),
        "duration_s": span,
        "throughput_tok_s": float(out_tok.sum()) / span,
        "goodput_tok_s": float(out_tok[ok].sum()) / span,
        "slo_attainment": float(ok.sum()) / n_requests if n_requests else None,
        "ttft_ms": _quantiles(ttft_all),
        "tpot_ms": _quantiles(tpot_all),
        "slo_ttft_at_percentile_ms": _ms(ttft_at),
        "slo_tpot_at_percentile_ms": _ms(tpot_at),
        "meets_slo": bool(holds),
    }


def replica_row(index: int, kind: str, result: EngineResult, memory: MemoryPlan) -> dict[str, Any]:
    span = max(result.end_s - result.first_arrival_s, 1e-9)
    bs_total = sum(result.batch_size_hist.values())
    mean_bs = (
        sum(bs * n for bs, n in result.batch_size_hist.items()) / bs_total if bs_total else 0.0
    )
    accept = (
        (result.accepted_drafts + result.verified_requests) / result.verified_requests
        if result.verified_requests
        else 1.0
    )
    tpot = np.asarray(result.tpot_s, dtype=np.float64)
    return {
        "index": index,
        "kind": kind,
        "requests": result.completed + result.aborted,
        "aborted": result.aborted,
        "throughput_tok_s": result.output_tokens / span,
        "mean_decode_batch_size": mean_bs,
        "mean_accept_length": accept,
        "tpot_p99_ms": _ms(_nearest_rank(tpot[~np.isnan(tpot)], 99.0)),
        "ttft_p99_ms": _ms(_nearest_rank(np.asarray(result.ttft_s, dtype=np.float64), 99.0)),
        "kv_token_capacity": memory.kv_token_capacity,
        "kv_peak_fraction": result.kv_peak_tokens / result.kv_token_capacity,
        "retractions": result.retractions,
    }


def slo_margin(row: Mapping[str, Any], slo: Mapping[str, Any] | None) -> float:
    """How close the fleet runs to its SLO: the larger of TPOT and TTFT at the judged
    percentile over their targets (1.0: on the edge; lower is more headroom)."""
    worst = 0.0
    for at, target in (
        ("slo_tpot_at_percentile_ms", "tpot_ms"),
        ("slo_ttft_at_percentile_ms", "ttft_ms"),
    ):
        value = row.get(at)
        limit = (slo or {}).get(target)
        if isinstance(value, int | float) and isinstance(limit, int | float) and limit > 0:
            worst = max(worst, float(value) / float(limit))
    return worst


def _price_key(
    row: Mapping[str, Any], priced: bool, slo: Mapping[str, Any] | None = None
) -> tuple[float, int, float, float]:
    # Cheapest first; at equal cost the simpler fleet (plain before speculative, static
    # before a daemon policy: simplicity.py), then the most SLO headroom (fleets that
    # hold serve the same tokens, so goodput differs by noise), then goodput.
    cost = row.get("cost_per_hour") if priced else row.get("gpus")
    return (
        float(cost) if cost is not None else math.inf,
        complexity(row),
        round(slo_margin(row, slo), 3),
        -float(row.get("goodput_tok_s") or 0),
    )


def choose(
    rows: Sequence[Mapping[str, Any]],
    *,
    priced: bool,
    currency: str | None = None,
    slo: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The best fleet overall, the best plain and speculative ones, and the saving."""
    holding = [r for r in rows if r.get("fits") and r.get("meets_slo")]

    def best_of(candidates: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
        if not candidates:
            return None
        top: Mapping[str, Any] = min(candidates, key=lambda r: _price_key(r, priced, slo))
        return dict(top)

    best = best_of(holding)
    best_plain = best_of([r for r in holding if r["kind"] == "plain"])
    best_spec = best_of([r for r in holding if r["kind"] != "plain"])
    closest = None
    if best is None:
        ran = [r for r in rows if r.get("fits") and r.get("slo_attainment") is not None]
        if ran:
            top = max(ran, key=lambda r: (r["slo_attainment"], -_price_key(r, priced)[0]))
            closest = dict(top)
    saving = None
    if best is not None and best_plain is not None:
        unit = "cost_per_hour" if priced else "gpus"
        plain_cost = float(best_plain[unit])
        best_cost = float(best[unit])
        saving = {
            "unit": f"{currency or 'USD'} per hour" if priced else "GPUs",
            "plain": plain_cost,
            "best": best_cost,
            "saved": plain_cost - best_cost,
            "fraction": (plain_cost - best_cost) / plain_cost if plain_cost > 0 else None,
        }
    return {
        "best": best,
        "best_plain": best_plain,
        "best_speculative": best_spec,
        "closest": closest,
        "saving_vs_plain": saving,
    }


def recommendation_text(doc: Mapping[str, Any]) -> str:
    """One operator-facing sentence (or two) for the plan's outcome."""
    best = doc.get("best")
    rps = doc.get("offered_rps")
    at = f"{rps:.2f} req/s" if isinstance(rps, int | float) else "the trace's rate"
    largest = max((int(r["replicas"]) for r in doc.get("fleets", [])), default=0)
    if best is None:
        closest = doc.get("closest")
        text = f"No fleet of up to {largest} replicas holds the SLO at {at}"
        if closest is not None:
            att = closest.get("slo_attainment")
            text += (
                f"; the closest is {_describe(closest)} "
                f"({100 * att:.1f}% of requests within the SLO)"
                if att is not None
                else ""
            )
        return text + ". Plan more replicas (--replicas)."
    price = best.get("cost_per_hour")
    currency = (doc.get("prices") or {}).get("currency", "USD")
    cost = f", {price:.2f} {currency}/h" if isinstance(price, int | float) else ""
    text = (
        f"Run {_describe(best)} at {at}: TPOT p{_pct(doc)} "
        f"{_num(best.get('slo_tpot_at_percentile_ms'))} ms, TTFT p{_pct(doc)} "
        f"{_num(best.get('slo_ttft_at_percentile_ms'))} ms{cost}."
    )
    if best["kind"] == "plain":
        text += " Speculation does not pay at this load: run plain replicas."
    saving = doc.get("saving_vs_plain")
    if saving is not None and saving["saved"] > 0:
        text += (
            f" Speculation saves {saving['saved']:g} {saving['unit']} against the best plain "
            f"fleet ({doc['best_plain']['fleet']})."
        )
    elif best["kind"] != "plain" and doc.get("best_plain") is None:
        text += f" No plain fleet of up to {largest} replicas holds the SLO."
    return text


def _pct(doc: Mapping[str, Any]) -> str:
    return f"{doc['slo']['percentile']:g}"


def _num(value: object) -> str:
    return f"{value:.1f}" if isinstance(value, int | float) else "-"


def _describe(row: Mapping[str, Any]) -> str:
    parts = []
    if row["speculative_replicas"]:
        parts.append(f"{row['speculative_replicas']} speculative ({row['policy']})")
    if row["plain_replicas"]:
        parts.append(f"{row['plain_replicas']} plain")
    gpu = row.get("gpu", "")
    return f"{' + '.join(parts)} {gpu} replica(s) behind {row['router']}"
