"""``plan sweep``'s answer to "add host cache or add GPUs?" (SGLang's hierarchical cache).

With ``--hicache-sizes 0,N,...`` every configuration is swept once per host tier size
(``--enable-hierarchical-cache --hicache-size N``, GB per GPU). Per GPU, the best
configuration with each host tier is held against the best one without: the host tier
pays when it needs fewer replicas than the configuration without it would even at the
top of that one's search bracket (``simplicity.upper_rps``: the sweep's resolution), as
speculation must. A host tier that pays saves GPUs for host memory; one that does not
means the load needs GPUs. Host memory is not priced (assumed part of the GPU-hour
price; SGLang refuses a tier the host cannot allocate). A trace without prefix block ids
(``hash_ids``) has no prefix reuse, so a host tier cannot help it; the answer says so.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from specgov.simulator.planning.simplicity import upper_rps

__all__ = ["host_cache_answer"]


def _brief(row: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "id": row["id"],
        "hicache_size_gb": int(row.get("hicache_size_gb") or 0),
        "replicas": row["replicas"],
        "cost_per_hour": row["cost_per_hour"],
        "max_rps": row["max_rps"],
    }


def host_cache_answer(
    ok_rows: Sequence[Mapping[str, Any]],
    key: Callable[[Mapping[str, Any]], Any],
    *,
    target_rps: float,
    trace_has_ids: bool,
) -> dict[str, Any] | None:
    """Per GPU: the best row without a host tier, the best with each size, whether each
    pays and the answer in one sentence; None when no host tier size was swept."""
    sizes = sorted({int(r.get("hicache_size_gb") or 0) for r in ok_rows} - {0})
    if not sizes:
        return None
    out: dict[str, Any] = {}
    for gpu in dict.fromkeys(r["gpu"] for r in ok_rows):
        mine = [r for r in ok_rows if r["gpu"] == gpu]
        without = [r for r in mine if not r.get("hicache_size_gb")]
        base = min(without, key=key) if without else None
        top = upper_rps(base) if base is not None else math.inf
        need = math.ceil(target_rps / top - 1e-9) if math.isfinite(top) else 1
        entries = []
        for gb in sizes:
            rows = [r for r in mine if int(r.get("hicache_size_gb") or 0) == gb]
            if not rows:
                continue
            best = min(rows, key=key)
            pays = base is None or int(best["replicas"]) < need
            saved = None if base is None else int(base["replicas"]) - int(best["replicas"])
            entries.append({**_brief(best), "pays": pays, "saves_replicas": saved})
        paying = [e for e in entries if e["pays"]]
        if base is None:
            answer = "only with a host cache does a configuration hold the SLO"
        elif paying:
            top_entry = max(paying, key=lambda e: (e["saves_replicas"] or 0, -e["hicache_size_gb"]))
            answer = (
                f"add host cache: {top_entry['hicache_size_gb']} GB per GPU needs "
                f"{top_entry['replicas']} replica(s) instead of {base['replicas']}"
            )
        else:
            why = (
                "the trace has no prefix block ids (hash_ids), so nothing to keep in host memory"
                if not trace_has_ids
                else "the host tier saves no replica beyond the sweep's resolution"
            )
            answer = f"add GPUs: {why} ({base['replicas']} replica(s) either way)"
        out[gpu] = {
            "without": None if base is None else _brief(base),
            "with": entries,
            "answer": answer,
        }
    return out
