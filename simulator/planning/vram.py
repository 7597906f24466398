"""`specgov plan vram`: one configuration's VRAM budget as a document (dict, JSON-ready).

The arithmetic is ``specgov.simulator.engine.memory`` (SGLang 0.5.23's accounting plus the
planner's stated estimates); this module resolves names from the catalog, picks the
candidate step set and turns the plan into the ``plan vram --output json`` document
whose shape ``specgov.simulator.planning.sweep``'s docstring gives.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from specgov.policies.engine.adaptive_config import DEFAULT_ADAPTIVE_CONFIG
from specgov.simulator.catalog import Catalog
from specgov.simulator.engine.memory import (
    VRAM_ASSUMPTIONS,
    MemoryPlan,
    MemoryPlanError,
    budget_memory,
)
from specgov.simulator.replay.runner import SPECGOV_SLOT_CANDIDATES, sglang_gpu_defaults

__all__ = ["CANDIDATE_PRESETS", "parse_candidates", "render_vram", "vram_document", "vram_plan"]

NO_DRAFTER = "none"


def _union(table: dict[Any, Any]) -> tuple[int, ...]:
    steps: set[int] = set()
    for entry in table.values():
        steps.update(entry if isinstance(entry, tuple) else entry["candidate_steps"])
    return tuple(sorted(steps))


# Named adaptive candidate sets: the union of a slot table is what SGLang prebuilds.
CANDIDATE_PRESETS: dict[str, tuple[int, ...]] = {
    "sglang-default": _union(DEFAULT_ADAPTIVE_CONFIG),
    "specgov": _union(dict(SPECGOV_SLOT_CANDIDATES)),
}


def parse_candidates(text: str | None, steps: int) -> tuple[int, ...]:
    """``None``/``static`` -> (steps,); a preset name; or a comma list like ``0,1,3,5``."""
    if text is None or text.strip().lower() == "static":
        return (steps,)
    raw = text.strip().lower()
    if raw in CANDIDATE_PRESETS:
        return CANDIDATE_PRESETS[raw]
    out: list[int] = []
    for part in raw.split(","):
        part = part.strip()
        if not part.isdigit():
            raise MemoryPlanError(
                f"--candidates {text!r}: {part!r} is not a non-negative integer; expected "
                f"'static', one of {sorted(CANDIDATE_PRESETS)} or a list like 0,1,3,5"
            )
        out.append(int(part))
    return tuple(sorted(set(out)))


def vram_plan(
    *,
    gpu: str,
    model: str,
    drafter: str | None,
    steps: int = 3,
    topk: int = 1,
    num_draft_tokens: int | None = None,
    candidate_steps: Sequence[int] | None = None,
    mem_fraction_static: float | None = None,
    max_running_requests: int | None = None,
    cuda_graph_max_bs: int | None = None,
    tp_size: int = 1,
    catalog_files: Sequence[Path] = (),
) -> tuple[MemoryPlan, dict[str, Any]]:
    """Resolve the names and plan the memory; returns (plan, the shape/knobs it used).

    ``drafter`` None or ``"none"`` plans a plain server. The CUDA-graph batch limit
    defaults like SGLang's (by GPU memory) and never exceeds ``max_running_requests``.
    """
    catalog = Catalog.load(catalog_files)
    g = catalog.gpu(gpu)
    m = catalog.model(model)
    plain = drafter is None or drafter.strip().lower() == NO_DRAFTER
    d = None if plain else catalog.drafter(drafter or "")
    chunk, graph_default = sglang_gpu_defaults(g.memory_gib)
    graph_bs = cuda_graph_max_bs or graph_default
    if max_running_requests is not None:
        graph_bs = min(graph_bs, max_running_requests)
    if d is None:
        candidates: tuple[int, ...] = ()
        ndt = None
        shape: dict[str, Any] = {"steps": 0, "topk": 0, "num_draft_tokens": 0}
    else:
        candidates = tuple(candidate_steps) if candidate_steps is not None else (steps,)
        ndt = num_draft_tokens if topk > 1 else None
        shape = {
            "steps": steps,
            "topk": topk,
            "num_draft_tokens": ndt if ndt is not None else steps + 1,
        }
    plan = budget_memory(
        g,
        m,
        d,
        mem_fraction_static=mem_fraction_static,
        candidate_steps=candidates,
        cuda_graph_max_bs=graph_bs,
        topk=topk if d is not None else 1,
        num_draft_tokens=ndt,
        tp_size=tp_size,
        chunked_prefill_size=chunk,
    )
    used = {"shape": shape, "max_running_requests": max_running_requests}
    return plan, used


def vram_document(
    plan: MemoryPlan, *, shape: dict[str, Any], max_running_requests: int | None
) -> dict[str, Any]:
    """The ``plan vram --output json`` document (shape: sweep.py's module docstring).

    A configuration fits when a KV pool is left *and* the runtime slack (total x (1 -
    mem_fraction_static)) holds SGLang's activation headroom and the CUDA graphs it
    keeps: with less, a full prefill chunk may run out of memory at run time, so
    neither ``plan vram`` nor the sweep (which reads this document) says it fits, and
    ``left`` is never negative on a configuration that fits.
    """
    warnings: list[str] = []
    fits = plan.fits
    first_overflow = plan.first_overflow
    message = None if plan.fits else plan.overflow_message()
    overflow_gib = 0.0 if plan.fits else -plan.kv_pool_gib
    if plan.fits and plan.runtime_left_gib < 0:
        fits = False
        first_overflow = "activation headroom"
        overflow_gib = -plan.runtime_left_gib
        graphs = plan.cuda_graph_total_gib - plan.cuda_graph_in_static_gib
        # Room for the activations and every graph in the slack, rounded down.
        need_gib = plan.activations_reserve_gib + plan.cuda_graph_total_gib
        at_most = math.floor(1000 * (1 - need_gib / plan.total_gib)) / 1000
        message = (
            f"the runtime slack {plan.runtime_reserve_gib:.2f} GiB ({plan.total_gib:g} GiB x "
            f"(1 - mem_fraction_static {plan.mem_fraction_static:.3f})) is "
            f"{-plan.runtime_left_gib:.2f} GiB short of the activation headroom "
            f"{plan.activations_reserve_gib:.2f} GiB + the CUDA graphs it holds "
            f"{graphs:.2f} GiB: a full prefill chunk of {plan.chunked_prefill_size} tokens "
            "may run out of memory. "
            f"Use mem_fraction_static <= {at_most:.3f}, a smaller chunked_prefill_size or "
            "more tensor parallelism."
        )
    return {
        "fits": fits,
        "items": [{"name": name, "gib": round(gib, 4)} for name, gib in plan.items()],
        "kv_pool_tokens": plan.kv_token_capacity,
        "kv_pool_gib": round(max(0.0, plan.kv_pool_gib), 4),
        "kv_bytes_per_token": plan.kv_bytes_per_token,
        "left_gib": round(plan.left_gib, 4),
        "first_overflow": first_overflow,
        "overflow_gib": round(overflow_gib, 4),
        "gpu": plan.gpu,
        "model": plan.model,
        "drafter": plan.drafter or NO_DRAFTER,
        "tp_size": plan.tp_size,
        "shape": shape,
        "candidate_steps": list(plan.candidate_steps) if plan.drafter else [],
        "mem_fraction_static": plan.mem_fraction_static,
        "mem_fraction_is_default": plan.mem_fraction_is_default,
        "max_running_requests": max_running_requests,
        "cuda_graph_max_bs": plan.cuda_graph_max_bs,
        "chunked_prefill_size": plan.chunked_prefill_size,
        "total_gib": plan.total_gib,
        "static_budget_gib": round(plan.usable_gib, 4),
        "runtime_slack_gib": round(plan.runtime_reserve_gib, 4),
        "cuda_graph_tiers": [
            {"steps": s, "gib": round(g, 4)} for s, g in plan.cuda_graph_reserve_gib
        ],
        "sglang_loads_memory": plan.sglang_loads_memory(),
        "message": message,
        "warnings": warnings,
        "assumptions": list(VRAM_ASSUMPTIONS),
    }


def render_vram(doc: dict[str, Any]) -> str:
    """The document as an aligned text table (what ``plan vram`` prints by default)."""
    who = doc["model"] + ("" if doc["drafter"] == NO_DRAFTER else f" + {doc['drafter']}")
    tp = f", tp_size {doc['tp_size']} (per GPU)" if doc["tp_size"] > 1 else ""
    shape = doc["shape"]
    lines = [
        f"{who} on {doc['gpu']}{tp}: "
        + ("FITS" if doc["fits"] else f"DOES NOT FIT (first overflow: {doc['first_overflow']})"),
        f"  shape steps {shape['steps']} topk {shape['topk']} draft tokens "
        f"{shape['num_draft_tokens']}, candidates {doc['candidate_steps'] or '-'}, "
        f"mem_fraction_static {doc['mem_fraction_static']:.3f}"
        f"{' (SGLang default)' if doc['mem_fraction_is_default'] else ''}, "
        f"cuda_graph_max_bs {doc['cuda_graph_max_bs']}, max_running_requests "
        f"{doc['max_running_requests'] or 'SGLang default'}",
        f"  {'item':<44} {'GiB':>9}",
    ]
    for item in doc["items"]:
        lines.append(f"  {item['name']:<44} {item['gib']:9.2f}")
    lines.append(f"  {'GPU total':<44} {doc['total_gib']:9.2f}")
    lines.append(
        f"  KV pool: {doc['kv_pool_tokens']:,} tokens ({doc['kv_bytes_per_token']:,.0f} B/token), "
        f"static budget {doc['static_budget_gib']:.2f} GiB, runtime slack "
        f"{doc['runtime_slack_gib']:.2f} GiB"
    )
    loads = doc["sglang_loads_memory"]
    lines.append(
        "  SGLang /v1/loads memory would read: " + ", ".join(f"{k} {v}" for k, v in loads.items())
    )
    if doc["message"]:
        lines.append("  " + doc["message"])
    lines += [f"  warning: {w}" for w in doc["warnings"]]
    lines.append("  assumptions:")
    lines += [f"    - {a}" for a in doc["assumptions"]]
    return "\n".join(lines)
