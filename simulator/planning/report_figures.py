"""The planning report's figures: PNG files drawn headless (matplotlib's Agg canvas).

Each function takes the plan documents' JSON (``vram``, ``sweep`` and ``fleet``
documents: shapes in ``sweep``'s and ``fleet``'s module docstrings), tolerates
missing optional keys, and returns the PNG it wrote, or None when its data is
absent. Figures are built on ``matplotlib.figure.Figure`` directly (no pyplot
state, no display). Every rate and latency axis starts at 0.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from specgov.policies.common.validation import is_real
from specgov.simulator.planning.atomic import write_atomic

SLO_COLOUR = "#c0392b"
OK_COLOUR = "#2e86c1"
BAD_COLOUR = "#b3b6b7"
BEST_COLOUR = "#1e8449"
DPI = 100
MAX_BARS = 40  # beyond this a bar chart is unreadable: the first MAX_BARS are drawn
# One colour per VRAM item kind (the rest cycle through the default palette).
ITEM_COLOURS = {
    "target weights": "#2e4053",
    "draft weights": "#8e44ad",
    "drafter static reserve": "#c39bd3",
    "target KV pool": "#2e86c1",
    "draft KV pool": "#85c1e9",
    "left": "#e5e8e8",
}


def _num(value: object) -> float | None:
    return float(value) if is_real(value) else None


def _save(fig: Figure, path: Path) -> Path:
    FigureCanvasAgg(fig)
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=DPI, metadata={"Software": None})
    return write_atomic(path, png.getvalue())  # a killed report leaves no half figure


def config_label(row: Mapping[str, Any]) -> str:
    """A sweep configuration as a short label: gpu drafter shape policy (+ its host
    cache tier, if any)."""
    shape = row.get("shape")
    shape_name = shape.get("name") if isinstance(shape, Mapping) else shape
    parts = [row.get("gpu"), row.get("drafter"), shape_name, row.get("policy")]
    label = " ".join(str(p) for p in parts if p not in (None, ""))
    host = row.get("hicache_size_gb")
    return f"{label} +host {host} GB" if isinstance(host, int) and host > 0 else label


def fleet_label(row: Mapping[str, Any]) -> str:
    policy = row.get("policy")
    return f"{row.get('fleet')} {policy or 'plain'} {row.get('router')}"


def vram_label(doc: Mapping[str, Any]) -> str:
    shape = doc.get("shape")
    steps = shape.get("steps") if isinstance(shape, Mapping) else None
    drafter = doc.get("drafter") or "none"
    text = f"{doc.get('gpu')} {drafter}"
    if drafter != "none" and steps:
        text += f" steps {steps}"
    cands = doc.get("candidate_steps")
    if isinstance(cands, list) and len(cands) > 1:
        text += f" cands {','.join(str(c) for c in cands)}"
    policy = doc.get("policy")
    if policy and not (policy == "none" and drafter == "none"):
        text += f" ({policy})"
    return text


def _item_group(name: str) -> str:
    if name.startswith("CUDA graphs"):
        return "CUDA graphs + runtime state"
    if name.startswith("activation headroom"):
        return "activation headroom"
    return name


def vram_figure(docs: Sequence[Mapping[str, Any]], path: Path) -> Path | None:
    """Stacked horizontal bars: every GiB of each GPU, by item."""
    docs = [d for d in docs if isinstance(d.get("items"), list)][:MAX_BARS]
    if not docs:
        return None
    groups: list[str] = []
    values: list[dict[str, float]] = []
    for d in docs:
        acc: dict[str, float] = {}
        for item in d["items"]:
            gib = _num(item.get("gib")) if isinstance(item, Mapping) else None
            if gib is None or gib <= 0:
                continue
            g = _item_group(str(item.get("name")))
            acc[g] = acc.get(g, 0.0) + gib
            if g not in groups:
                groups.append(g)
        values.append(acc)
    fig = Figure(figsize=(11, 2.2 + 0.55 * len(docs)))
    ax = fig.add_subplot(1, 1, 1)
    labels = [vram_label(d) + ("" if d.get("fits", True) else "  [does not fit]") for d in docs]
    lefts = [0.0] * len(docs)
    palette = iter(["#d35400", "#f5b041", "#48c9b0", "#a04000", "#7d3c98", "#566573"])
    for g in groups:
        widths = [v.get(g, 0.0) for v in values]
        colour = ITEM_COLOURS.get(g) or next(palette, None)
        ax.barh(range(len(docs)), widths, left=lefts, label=g, color=colour, edgecolor="white")
        lefts = [a + b for a, b in zip(lefts, widths, strict=True)]
    for i, d in enumerate(docs):
        total = _num(d.get("total_gib"))
        if total is not None:
            ax.plot([total, total], [i - 0.4, i + 0.4], color=SLO_COLOUR, linewidth=2)
        tokens = d.get("kv_pool_tokens")
        if isinstance(tokens, int):
            ax.text(lefts[i], i, f"  KV {tokens:,} tok", va="center", fontsize=8)
    ax.set_yticks(range(len(docs)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, max(lefts + [1.0]) * 1.25)
    ax.set_xlabel("GiB per GPU (red tick: the GPU's memory)")
    ax.set_title("VRAM budget per configuration")
    # Below the axes: inside, it would hide the bars it explains.
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.12 - 0.6 / len(docs)), ncol=4)
    fig.tight_layout()
    return _save(fig, path)


def curves_figure(
    rows: Sequence[Mapping[str, Any]], slo: Mapping[str, Any], path: Path, *, title: str
) -> Path | None:
    """Throughput-latency curves: TPOT and TTFT percentiles against request rate."""
    series = []
    for row in rows:
        pts = [
            p
            for p in row.get("curve") or []
            if isinstance(p, Mapping) and _num(p.get("rps")) is not None
        ]
        if pts:
            series.append((config_label(row), sorted(pts, key=lambda p: float(p["rps"]))))
    if not series:
        return None
    fig = Figure(figsize=(12, 4.8))
    axes = [fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)]
    keys = (("tpot_ms", "tpot_percentile", "TPOT"), ("ttft_ms", "ttft_percentile", "TTFT"))
    for ax, (key, pct_key, name) in zip(axes, keys, strict=True):
        top = 0.0
        for label, pts in series:
            xs = [float(p["rps"]) for p in pts if _num(p.get(key)) is not None]
            ys = [float(p[key]) for p in pts if _num(p.get(key)) is not None]
            if not xs:
                continue
            (line,) = ax.plot(xs, ys, marker="o", markersize=3, label=label)
            failed = [
                (x, y)
                for x, y, p in zip(
                    xs, ys, [p for p in pts if _num(p.get(key)) is not None], strict=True
                )
                if p.get("passed") is False
            ]
            if failed:
                ax.scatter(*zip(*failed, strict=True), marker="x", color=line.get_color())
            top = max(top, max(ys))
        limit = _num(slo.get(key))
        if limit is not None:
            ax.axhline(limit, color=SLO_COLOUR, linestyle="--", label=f"SLO {limit:g} ms")
            top = min(max(top, limit) * 1.1, limit * 4)  # a runaway queue must not flatten it
        ax.set_ylim(0, top if top > 0 else 1)
        ax.set_xlim(left=0)
        pct = _num(slo.get(pct_key)) or 99.0
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(f"{name} p{pct:g} (ms)")
        ax.set_title(f"{name} against load (x: SLO missed)")
    axes[0].legend(fontsize=7, loc="upper left")
    fig.suptitle(title)
    fig.tight_layout()
    return _save(fig, path)


def pays_figure(
    series: Sequence[tuple[str, bool, Sequence[float]]],
    tpot_slos_ms: Sequence[float],
    path: Path,
    *,
    title: str,
) -> Path | None:
    """When speculation pays: sustainable rate per replica against the TPOT SLO, one line
    per configuration (*series*: label, is it the plain server, rate per SLO)."""
    if not series or not any(max(v, default=0.0) > 0 for _, _, v in series):
        return None
    fig = Figure(figsize=(9, 4.8))
    ax = fig.add_subplot(1, 1, 1)
    for label, plain, rates in series:
        ax.step(
            list(tpot_slos_ms),
            list(rates),
            where="post",
            label=label,
            color="black" if plain else None,
            linestyle="--" if plain else "-",
            linewidth=2 if plain else 1.2,
        )
    ax.set_xlim(min(tpot_slos_ms), max(tpot_slos_ms))
    ax.set_ylim(bottom=0)
    ax.set_xlabel("TPOT SLO (ms, at the sweep's percentile)")
    ax.set_ylabel("sustainable request rate per replica (req/s)")
    ax.set_title(title)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    return _save(fig, path)


def _bar_chart(
    labels: Sequence[str],
    values: Sequence[float],
    colours: Sequence[str],
    *,
    head_in: float,
    per_bar_in: float = 0.35,
) -> tuple[Figure, Axes]:
    """Horizontal bars, one per configuration or fleet, the first on top: *head_in* inches
    for titles and axes, *per_bar_in* a bar."""
    fig = Figure(figsize=(11, head_in + per_bar_in * len(labels)))
    ax = fig.add_subplot(1, 1, 1)
    ys = range(len(labels))
    ax.barh(ys, values, color=list(colours))
    ax.set_yticks(ys, list(labels), fontsize=8)
    ax.invert_yaxis()
    return fig, ax


def frontier_figure(
    rows: Sequence[Mapping[str, Any]], target_rps: float | None, path: Path
) -> Path | None:
    """The SLO frontier: the highest request rate one replica sustains at the SLO."""
    data = [(config_label(r), _num(r.get("max_rps")), r) for r in rows][:MAX_BARS]
    data = [(label, v, r) for label, v, r in data if v is not None]
    if not data:
        return None
    data.sort(key=lambda t: t[1] or 0.0, reverse=True)
    fig, ax = _bar_chart(
        [label for label, _, _ in data],
        [v or 0.0 for _, v, _ in data],
        [OK_COLOUR if r.get("status") == "ok" else BAD_COLOUR for _, _, r in data],
        head_in=1.4,
    )
    for i, (_, v, r) in enumerate(data):
        note = f" {v:.2f} req/s" if v else f" {r.get('status') or 'no rate'}"
        ax.text(v or 0.0, i, note, va="center", fontsize=8)
    ax.set_xlim(0, max(v or 0.0 for _, v, _ in data) * 1.3 or 1.0)
    ax.set_xlabel("highest request rate one replica sustains at the SLO (req/s)")
    ax.set_title("SLO frontier per configuration (grey: does not fit, cannot run or never meets)")
    fig.tight_layout()
    return _save(fig, path)


def replicas_figure(
    rows: Sequence[Mapping[str, Any]], target_rps: float | None, path: Path
) -> Path | None:
    """Replicas for the target rate (bars) and cost per hour (markers) per configuration."""
    data = [(config_label(r), r) for r in rows if isinstance(r.get("replicas"), int)][:MAX_BARS]
    if not data:
        return None
    fig, ax = _bar_chart(
        [label for label, _ in data],
        [float(r["replicas"]) for _, r in data],
        [OK_COLOUR] * len(data),
        head_in=1.6,
    )
    ax.set_xlabel(
        "replicas for the target rate" + (f" ({target_rps:g} req/s)" if target_rps else "")
    )
    costs: list[tuple[int, float]] = []
    for i, (_, r) in enumerate(data):
        c = _num(r.get("cost_per_hour"))
        if c is not None:
            costs.append((i, c))
    if costs:
        twin = ax.twiny()
        twin.scatter([c for _, c in costs], [i for i, _ in costs], color=SLO_COLOUR, zorder=3)
        twin.set_xlim(0, max(c for _, c in costs) * 1.2)
        twin.set_xlabel("cost per hour (red dots)")
    ax.set_title("Replicas and cost per configuration")
    fig.tight_layout()
    return _save(fig, path)


def fleet_figure(doc: Mapping[str, Any], path: Path) -> Path | None:
    """Goodput (bars) and SLO attainment (dots) per simulated fleet."""
    rows = [
        r
        for r in doc.get("fleets") or []
        if isinstance(r, Mapping) and _num(r.get("goodput_tok_s")) is not None
    ][:MAX_BARS]
    if not rows:
        return None
    best = doc.get("best") or {}
    best_key = (best.get("fleet"), best.get("policy"), best.get("router"))
    colours = []
    labels = []
    for r in rows:
        if (r.get("fleet"), r.get("policy"), r.get("router")) == best_key:
            colours.append(BEST_COLOUR)
        else:
            colours.append(OK_COLOUR if r.get("meets_slo") else BAD_COLOUR)
        cost = _num(r.get("cost_per_hour"))
        extra = f" | {cost:.2f}/h" if cost is not None else f" | {r.get('gpus')} GPUs"
        labels.append(fleet_label(r) + extra)
    fig, ax = _bar_chart(
        labels, [float(r["goodput_tok_s"]) for r in rows], colours, head_in=1.8, per_bar_in=0.38
    )
    ax.set_xlabel("goodput (output tok/s within the SLO)")
    ax.set_xlim(left=0)
    twin = ax.twiny()
    att = [(_num(r.get("slo_attainment")), i) for i, r in enumerate(rows)]
    pts = [(100.0 * a, i) for a, i in att if a is not None]
    if pts:
        twin.scatter(*zip(*pts, strict=True), color=SLO_COLOUR, zorder=3)
    twin.set_xlim(0, 105)
    twin.set_xlabel("SLO attainment, % of requests (red dots)")
    fig.suptitle("Fleets (green: recommended, blue: holds the SLO, grey: does not)")
    fig.tight_layout()
    return _save(fig, path)


def per_token_figure(doc: Mapping[str, Any], path: Path) -> Path | None:
    """Predicted decode ms per output token by batch size: speculative kinds against plain."""
    kinds = doc.get("replica_kinds") or {}
    if not isinstance(kinds, Mapping):
        return None
    curves: list[tuple[str, list[float], int | None]] = []
    plain: list[float] | None = None
    for name, kind in kinds.items():
        table = kind.get("predicted_ms_per_token") if isinstance(kind, Mapping) else None
        if not isinstance(table, Mapping):
            continue
        spec = table.get("speculative")
        if isinstance(spec, list) and spec:
            pays = kind.get("speculation_pays_up_to_batch")
            curves.append(
                (str(name), [float(v) for v in spec], pays if isinstance(pays, int) else None)
            )
        if plain is None and isinstance(table.get("plain"), list):
            plain = [float(v) for v in table["plain"]]
    if not curves or not plain:
        return None
    fig = Figure(figsize=(10, 4.5))
    ax = fig.add_subplot(1, 1, 1)
    ax.plot(range(1, len(plain) + 1), plain, color="black", label="plain replica")
    top = max(plain)
    for name, spec, pays in curves:
        (line,) = ax.plot(range(1, len(spec) + 1), spec, label=f"speculative ({name})")
        top = max(top, max(spec))
        if pays:
            ax.axvline(
                pays, color=line.get_color(), linestyle=":", label=f"pays up to batch {pays}"
            )
    ax.set_xscale("log")
    ax.set_ylim(0, top * 1.05)
    ax.set_xlabel("active requests on the replica (batch size)")
    ax.set_ylabel("predicted decode ms per output token")
    ax.set_title("Where speculation pays (cost model x expected accept length)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return _save(fig, path)
