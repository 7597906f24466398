"""The document of a sweep (`specgov plan sweep --output json`, the HTML report's input):
its rows ranked, priced and explained. The document's shape is in the docstring of
:mod:`specgov.simulator.planning.sweep`, whose jobs make the rows."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from specgov.policies.common.validation import is_real
from specgov.simulator.catalog import Catalog
from specgov.simulator.planning.host_cache import host_cache_answer
from specgov.simulator.planning.prices import Prices
from specgov.simulator.planning.simplicity import complexity, speculation_verdict
from specgov.simulator.planning.sweep import SweepError, SweepSettings
from specgov.simulator.planning.sweep_launch import fill_launch
from specgov.simulator.planning.trace_load import base_rps, trace_load
from specgov.simulator.planning.vram import NO_DRAFTER
from specgov.simulator.workload.traces import Trace

__all__ = ["build_document"]


def _why(best: dict[str, Any] | None, rows: Sequence[dict[str, Any]]) -> str | None:
    """Why the best configuration is the best, in one sentence."""
    if best is None:
        return None
    if best.get("speculation"):
        return f"speculation pays: {best['speculation']['detail']}"
    if not any(r["drafter"] != NO_DRAFTER for r in rows):
        return "the plain server (no speculative configuration was swept)"
    if not any(r.get("speculation") for r in rows):
        return "the plain server: no speculative configuration met the SLO"
    return (
        "the plain server: no speculative configuration saves a replica or cost beyond "
        "the sweep's resolution or meets an SLO it cannot (ties go to the simpler "
        "configuration)"
    )


def build_document(
    rows: Sequence[dict[str, Any]],
    *,
    trace: Trace,
    settings: SweepSettings,
    target_rps: float,
    prices: Prices | None,
    executor: dict[str, Any],
) -> dict[str, Any]:
    """Replicas, costs, savings against the plain server, launch flags and the best
    configurations (module docstring: document shape)."""
    if not (is_real(target_rps) and target_rps > 0):
        raise SweepError(f"target_rps must be a positive number of requests/s, got {target_rps!r}")
    catalog = Catalog.load([Path(p) for p in settings.catalog_files])
    summary = trace.summary()
    mean_out = float(summary["mean_output_tokens"] or 0.0)
    out_rows = [dict(r) for r in rows]
    for row in out_rows:
        if row["status"] == "ok":
            _price_row(row, target_rps=target_rps, mean_out=mean_out, prices=prices)
            fill_launch(row, settings, catalog)
    plain = {_where(r): r for r in out_rows if r["drafter"] == NO_DRAFTER and r["status"] == "ok"}
    for row in out_rows:
        base = plain.get(_where(row))
        if row["status"] != "ok" or base is None or row is base:
            continue
        row["saving_vs_none"] = _saving(row, base)
    all_plain = {_where(r): r for r in out_rows if r["drafter"] == NO_DRAFTER}
    for row in out_rows:
        if row["status"] == "ok" and row["drafter"] != NO_DRAFTER:
            row["speculation"] = speculation_verdict(
                row, all_plain.get(_where(row)), target_rps=target_rps
            )
    ranking = _Ranking(plain, prices is not None)
    ok_rows = [r for r in out_rows if r["status"] == "ok"]
    ranking.host = host_cache_answer(
        ok_rows,
        ranking.key,
        target_rps=target_rps,
        trace_has_ids=bool(summary.get("with_hash_ids")),
    )
    best_per_gpu: dict[str, Any] = {}
    for gpu in dict.fromkeys(r["gpu"] for r in out_rows):
        candidates = [r for r in ok_rows if r["gpu"] == gpu]
        if candidates:
            best_per_gpu[gpu] = min(candidates, key=ranking.key)
    best = min(ok_rows, key=ranking.key) if ok_rows else None
    return {
        "configurations": out_rows,
        "best": best,
        "best_by": "cost_per_hour" if prices is not None else "replicas",
        "recommendation": _why(best, out_rows),
        "best_per_gpu": best_per_gpu,
        "host_cache_or_gpus": ranking.host,
        "trace": {**summary, "base_rps": base_rps(trace), "load": trace_load(trace)},
        "slo": {
            "tpot_ms": settings.slo_tpot_ms,
            "ttft_ms": settings.slo_ttft_ms,
            "tpot_percentile": settings.tpot_percentile,
            "ttft_percentile": settings.ttft_percentile,
        },
        "target_rps": float(target_rps),
        "model": settings.model,
        "seed": settings.seed,
        "search": settings.search.to_json(),
        "prices": (
            {"currency": prices.currency, "gpu_hour": prices.gpu_hour, "source": prices.source}
            if prices is not None
            else None
        ),
        "executor": executor,
    }


def _where(row: Mapping[str, Any]) -> tuple[str, int]:
    """Where a row runs (GPU, host tier): the plain server to compare it with runs there."""
    return (row["gpu"], int(row.get("hicache_size_gb") or 0))


def _price_row(
    row: dict[str, Any], *, target_rps: float, mean_out: float, prices: Prices | None
) -> None:
    """Replicas for *target_rps* and, with prices, what they cost (one GPU a replica)."""
    max_rps = float(row["max_rps"])
    row["replicas"] = math.ceil(target_rps / max_rps - 1e-9)
    if prices is None:
        return
    mtok_per_hour = target_rps * mean_out * 3600 / 1e6
    per_replica = prices.per_gpu_hour(row["gpu"])  # one GPU a replica (docstring)
    row["cost_per_hour"] = row["replicas"] * per_replica
    row["cost_per_mtok"] = row["cost_per_hour"] / mtok_per_hour if mtok_per_hour else None
    capacity_mtok = max_rps * mean_out * 3600 / 1e6
    row["cost_per_mtok_at_capacity"] = per_replica / capacity_mtok if capacity_mtok else None


def _saving(row: Mapping[str, Any], base: Mapping[str, Any]) -> dict[str, Any]:
    """What *row* saves against the plain server *base* (replicas, capacity, cost)."""
    saving: dict[str, Any] = {
        "replicas": base["replicas"] - row["replicas"],
        "capacity_ratio": row["max_rps"] / base["max_rps"],
        "cost_per_hour": None,
        "cost_fraction": None,
    }
    if row["cost_per_hour"] is not None and base["cost_per_hour"]:
        saving["cost_per_hour"] = base["cost_per_hour"] - row["cost_per_hour"]
        saving["cost_fraction"] = 1 - row["cost_per_hour"] / base["cost_per_hour"]
    return saving


class _Ranking:
    """The order of configurations: cost first (dollars with prices, else replicas);
    speculation (or a host tier) that saves nothing costs what the plain server (the
    best row without a host tier) does: simplicity.py, host_cache.py. Equal costs go to
    the simpler configuration. ``host`` is the host-cache answer once known (None while
    ``host_cache_answer`` itself ranks with ``key``)."""

    def __init__(self, plain: Mapping[tuple[str, int], Mapping[str, Any]], priced: bool) -> None:
        self._plain = plain
        self._priced = priced
        self.host: dict[str, Any] | None = None

    def _cost(self, row: Mapping[str, Any]) -> float:
        return float(row["cost_per_hour"] if self._priced else row["replicas"])

    def key(self, row: Mapping[str, Any]) -> tuple[float, int, int, float, str]:
        verdict = row.get("speculation")
        base = self._plain.get(_where(row))
        first = self._cost(base) if verdict and not verdict["pays"] and base else self._cost(row)
        gb = int(row.get("hicache_size_gb") or 0)
        host = self.host
        if host is not None and gb and row["gpu"] in host:
            answer = host[row["gpu"]]
            entry = next((e for e in answer["with"] if e["hicache_size_gb"] == gb), None)
            if entry is not None and not entry["pays"] and answer["without"] is not None:
                first = max(first, self._cost(answer["without"]))
        return (first, complexity(row), int(gb > 0), -float(row["max_rps"]), row["id"])
