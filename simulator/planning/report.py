"""The capacity-planning report: one offline HTML page, its figures as PNG, its data as CSV/JSON.

``write_report(out_dir, vram=..., sweep=..., fleet=...)`` takes the JSON documents
``specgov plan vram``, ``plan sweep`` and ``plan fleet`` print with ``--output json``
(shapes: ``sweep``'s and ``fleet``'s module docstrings; any may be None, optional
keys may be missing) and writes::

    out_dir/index.html      self-contained: styles inline, figures embedded as
                            data: URIs, no script, font or style from anywhere else
    out_dir/figures/*.png   the same figures as files
    out_dir/data/*.json     the documents as given
    out_dir/data/*.csv      their tables, one row per configuration / point / fleet

Sections: the recommendation and its SGLang launch configuration, VRAM budgets,
throughput-latency curves per configuration, the SLO frontier, replicas and cost,
the fleet comparison (and where speculation pays), the data files. A section
whose document is absent says which command fills it. Numbers are the documents'
(simulated; the documents say with which catalog, trace and seed).
"""

from __future__ import annotations

import base64
import csv
import html
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from specgov.simulator.planning import report_figures as figs

__all__ = ["ReportError", "write_report"]

CSS = """
body { font-family: system-ui, -apple-system, 'Segoe UI', sans-serif; margin: 2em auto;
       max-width: 1180px; color: #1b2631; line-height: 1.45; padding: 0 1em; }
h1 { font-size: 1.6em; margin-bottom: 0.2em; } h2 { border-bottom: 2px solid #d5d8dc;
     padding-bottom: 0.2em; margin-top: 2em; }
.sub { color: #566573; margin-top: 0; }
table { border-collapse: collapse; font-size: 0.85em; margin: 0.8em 0; }
th, td { border: 1px solid #d5d8dc; padding: 0.25em 0.55em; text-align: right; }
th { background: #f2f3f4; } td.l, th.l { text-align: left; } td.l { white-space: nowrap; }
tr.best td { background: #e9f7ef; font-weight: 600; } tr.bad td { color: #7f8c8d; }
.rec { background: #eaf2f8; border-left: 5px solid #2e86c1; padding: 0.8em 1em; }
.missing { color: #7f8c8d; font-style: italic; }
pre { background: #f8f9f9; border: 1px solid #d5d8dc; padding: 0.7em; overflow-x: auto;
      font-size: 0.85em; white-space: pre-wrap; word-break: break-all; }
figure { margin: 1em 0; } figure img { max-width: 100%; border: 1px solid #eaeded; }
figcaption { color: #566573; font-size: 0.85em; }
"""


VRAM_HINT = "run specgov plan vram --report DIR"
SWEEP_HINT = "run specgov plan sweep --report DIR"
FLEET_HINT = "run specgov plan fleet --report DIR"


class ReportError(ValueError):
    """The report cannot be written (bad documents or an unwritable folder)."""


def _e(value: object) -> str:
    return html.escape("-" if value is None else str(value))


def _f(value: object, digits: int = 1) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return _e(value)


def _table(
    header: Sequence[str],
    rows: Iterable[Sequence[object]],
    *,
    left: int = 1,
    classes: Sequence[str] | None = None,
) -> str:
    """An HTML table; the first *left* columns align left. Cells are pre-formatted text."""
    out = ["<table><tr>"]
    out += [f'<th class="{"l" if i < left else ""}">{_e(h)}</th>' for i, h in enumerate(header)]
    out.append("</tr>")
    for n, row in enumerate(rows):
        cls = classes[n] if classes is not None and n < len(classes) else ""
        out.append(f'<tr class="{cls}">')
        out += [
            f'<td class="{"l" if i < left else ""}">{c if isinstance(c, _Raw) else _e(c)}</td>'
            for i, c in enumerate(row)
        ]
        out.append("</tr>")
    out.append("</table>")
    return "".join(out)


class _Raw(str):
    """Cell text that is already HTML."""


def _write_csv(path: Path, header: Sequence[str], rows: Iterable[Sequence[object]]) -> Path:
    with path.open("w", newline="", encoding="utf-8") as fh:
        writer = csv.writer(fh)
        writer.writerow(header)
        for row in rows:
            writer.writerow(["" if v is None else v for v in row])
    return path


class _Page:
    """Collects the HTML sections and the files written beside them."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = out_dir
        self.figures_dir = out_dir / "figures"
        self.data_dir = out_dir / "data"
        self.parts: list[str] = []
        self.files: list[Path] = []

    def add(self, text: str) -> None:
        self.parts.append(text)

    def figure(self, name: str, draw: Callable[[Path], Path | None], caption: str) -> Path | None:
        path = draw(self.figures_dir / f"{name}.png")
        if path is None:
            return None
        data = base64.b64encode(path.read_bytes()).decode("ascii")
        self.files.append(path)
        self.add(
            f'<figure><img alt="{_e(caption)}" src="data:image/png;base64,{data}">'
            f'<figcaption>{_e(caption)} (<a href="figures/{_e(path.name)}">{_e(path.name)}</a>)'
            "</figcaption></figure>"
        )
        return path

    def data(self, path: Path) -> None:
        self.files.append(path)


def _sub(doc: Mapping[str, Any] | None, key: str) -> Mapping[str, Any]:
    """``doc[key]`` when it is a mapping, else an empty one (optional keys may be absent)."""
    value = (doc or {}).get(key)
    return value if isinstance(value, Mapping) else {}


def _as_list(value: Any) -> list[dict[str, Any]]:
    if isinstance(value, list):
        return [v for v in value if isinstance(v, dict)]
    return []


def _vram_docs(
    vram: Sequence[Mapping[str, Any]] | None,
    sweep: Mapping[str, Any] | None,
    fleet: Mapping[str, Any] | None,
) -> list[dict[str, Any]]:
    """Every VRAM document the inputs hold, each configuration once."""
    docs: list[dict[str, Any]] = [dict(d) for d in (vram or []) if isinstance(d, Mapping)]
    for row in _as_list((sweep or {}).get("configurations")):
        if isinstance(row.get("vram"), dict):
            docs.append(dict(row["vram"], policy=row.get("policy")))
    kinds = (fleet or {}).get("replica_kinds")
    if isinstance(kinds, Mapping):
        for kind in kinds.values():
            if isinstance(kind, Mapping) and isinstance(kind.get("vram"), dict):
                docs.append(dict(kind["vram"]))
    seen: set[str] = set()
    out = []
    for d in docs:
        key = json.dumps(
            [d.get(k) for k in ("gpu", "model", "drafter", "shape", "candidate_steps", "tp_size")]
            + [d.get("mem_fraction_static"), d.get("max_running_requests")],
            sort_keys=True,
            default=str,
        )
        if key not in seen:
            seen.add(key)
            out.append(d)
    return out


# ------------------------------------------------------------------------------ sections


def _summary(page: _Page, sweep: Mapping[str, Any] | None, fleet: Mapping[str, Any] | None) -> None:
    page.add("<h2>Recommendation</h2>")
    if sweep is None and fleet is None:
        page.add('<p class="missing">No sweep or fleet plan in this report.</p>')
        return
    best = (sweep or {}).get("best")
    if isinstance(best, Mapping):
        cost = best.get("cost_per_hour")
        saving = best.get("saving_vs_none") or {}
        text = (
            f"<b>One replica type:</b> {_e(figs.config_label(best))} sustains "
            f"{_f(best.get('max_rps'), 2)} req/s at the SLO; {_f(best.get('replicas'))} "
            f"replica(s) for {_f((sweep or {}).get('target_rps'), 1)} req/s"
        )
        if cost is not None:
            currency = ((sweep or {}).get("prices") or {}).get("currency", "")
            text += f", {_f(cost, 2)} {_e(currency)}/h"
        if isinstance(saving, Mapping) and saving.get("replicas") is not None:
            saved = _f(saving.get("replicas"))
            text += f"; speculation saves {saved} replica(s) against no speculation"
            if saving.get("cost_fraction") is not None:
                text += f" ({_f(100 * float(saving['cost_fraction']), 1)}% of the cost)"
        page.add(f'<p class="rec">{text}.</p>')
    elif sweep is not None:
        page.add('<p class="rec">The sweep found no configuration that holds the SLO.</p>')
    if fleet is not None:
        rec = fleet.get("recommendation")
        page.add(f'<p class="rec"><b>Fleet:</b> {_e(rec or "no fleet recommendation")}</p>')
    page.add("<h3>Launch configuration</h3>")
    blocks: list[str] = []
    if isinstance(best, Mapping):
        blocks.append(_launch_block(f"sweep best: {figs.config_label(best)}", best))
    kinds = (fleet or {}).get("replica_kinds")
    fleet_best = (fleet or {}).get("best")
    if isinstance(kinds, Mapping) and isinstance(fleet_best, Mapping):
        wanted = []
        if fleet_best.get("speculative_replicas"):
            wanted.append(str(fleet_best.get("policy")))
        if fleet_best.get("plain_replicas"):
            wanted.append("none")
        for name in wanted:
            kind = kinds.get(name)
            if isinstance(kind, Mapping):
                label = "plain replicas" if name == "none" else f"speculative replicas ({name})"
                blocks.append(_launch_block(f"fleet: {label}", kind.get("launch_args") or {}))
    if blocks:
        page.add("".join(blocks))
    else:
        page.add('<p class="missing">No launch configuration: nothing holds the SLO.</p>')


def _launch_block(title: str, src: Mapping[str, Any]) -> str:
    argv = src.get("launch_args") if "launch_args" in src else src.get("argv")
    error = src.get("launch_error") if "launch_error" in src else src.get("error")
    text = f"<p><b>{_e(title)}</b></p>"
    if error:
        return text + f'<p class="missing">{_e(error)}</p>'
    flags = " ".join(str(a) for a in argv) if isinstance(argv, list) else ""
    text += f"<pre>python -m sglang.launch_server --model-path MODEL {_e(flags)}</pre>"
    if src.get("adaptive_config"):
        text += (
            "<p>--speculative-adaptive-config JSON:</p>"
            f"<pre>{_e(_compact_json(src['adaptive_config']))}</pre>"
        )
    if src.get("daemon_policy"):
        daemon = _e(src["daemon_policy"])
        text += f"<p>Run the specgov daemon beside it with policy <code>{daemon}</code>.</p>"
    return text


def _compact_json(obj: object) -> str:
    """A JSON object one top-level key per line (a slot table reads as a table)."""
    if isinstance(obj, Mapping) and obj:
        lines = [f"  {json.dumps(str(k))}: {json.dumps(v)}" for k, v in obj.items()]
        return "{\n" + ",\n".join(lines) + "\n}"
    return json.dumps(obj)


def _vram_section(page: _Page, docs: list[dict[str, Any]]) -> None:
    page.add("<h2>VRAM budgets</h2>")
    if not docs:
        page.add(f'<p class="missing">No VRAM documents ({VRAM_HINT}).</p>')
        return
    page.figure(
        "vram",
        lambda p: figs.vram_figure(docs, p),
        "Every GiB of the GPU per configuration: weights, drafter, CUDA graphs, activations, KV",
    )
    rows = []
    classes = []
    for d in docs:
        overflow = d.get("first_overflow")
        rows.append(
            [
                figs.vram_label(d),
                _f(d.get("total_gib"), 1),
                _f(d.get("mem_fraction_static"), 3),
                _f(d.get("kv_pool_tokens")),
                _f(d.get("kv_pool_gib"), 2),
                _f(d.get("left_gib"), 2),
                "yes" if d.get("fits", True) else f"no: {overflow}",
            ]
        )
        classes.append("" if d.get("fits", True) else "bad")
    page.add(
        _table(
            ["configuration", "GPU GiB", "mem frac", "KV tokens", "KV GiB", "left GiB", "fits"],
            rows,
            classes=classes,
        )
    )
    for d in docs:
        items = [i for i in d.get("items") or [] if isinstance(i, Mapping)]
        if not items:
            continue
        page.add(f"<details><summary>{_e(figs.vram_label(d))}: items</summary>")
        page.add(_table(["item", "GiB"], [[i.get("name"), _f(i.get("gib"), 3)] for i in items]))
        notes = [*(d.get("warnings") or []), *(d.get("assumptions") or [])]
        if d.get("message"):
            notes.insert(0, d["message"])
        if notes:
            page.add("<ul>" + "".join(f"<li>{_e(n)}</li>" for n in notes) + "</ul>")
        page.add("</details>")
    path = _write_csv(
        page.data_dir / "vram_items.csv",
        ["configuration", "gpu", "drafter", "fits", "item", "gib"],
        (
            [
                figs.vram_label(d),
                d.get("gpu"),
                d.get("drafter"),
                d.get("fits"),
                i.get("name"),
                i.get("gib"),
            ]
            for d in docs
            for i in d.get("items") or []
            if isinstance(i, Mapping)
        ),
    )
    page.data(path)


SWEEP_COLUMNS = (
    "id",
    "gpu",
    "drafter",
    "shape",
    "policy",
    "status",
    "fits",
    "max_rps",
    "replicas",
    "cost_per_hour",
    "cost_per_mtok",
    "saving_replicas",
    "saving_cost_fraction",
    "launch_shell",
    "reason",
)


def _sweep_row_values(row: Mapping[str, Any]) -> list[object]:
    shape = row.get("shape")
    saving = _sub(row, "saving_vs_none")
    return [
        row.get("id"),
        row.get("gpu"),
        row.get("drafter"),
        shape.get("name") if isinstance(shape, Mapping) else shape,
        row.get("policy"),
        row.get("status"),
        row.get("fits"),
        row.get("max_rps"),
        row.get("replicas"),
        row.get("cost_per_hour"),
        row.get("cost_per_mtok"),
        saving.get("replicas"),
        saving.get("cost_fraction"),
        row.get("launch_shell"),
        row.get("reason"),
    ]


def _sweep_sections(page: _Page, sweep: Mapping[str, Any] | None) -> None:
    page.add("<h2>Sustainable load: throughput-latency curves</h2>")
    rows = _as_list((sweep or {}).get("configurations"))
    if sweep is None or not rows:
        page.add(f'<p class="missing">No sweep in this report ({SWEEP_HINT}).</p>')
        for title in ("SLO frontier", "Replicas and cost"):
            page.add(f"<h2>{title}</h2><p class='missing'>No sweep in this report.</p>")
        return
    slo = _sub(sweep, "slo")
    by_gpu: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by_gpu.setdefault(str(row.get("gpu")), []).append(row)
    drawn = 0
    for gpu, gpu_rows in by_gpu.items():

        def draw(p: Path, r: list[dict[str, Any]] = gpu_rows, g: str = gpu) -> Path | None:
            return figs.curves_figure(r, slo, p, title=f"{g}: latency against load")

        if page.figure(
            f"curves_{_slug(gpu)}",
            draw,
            f"{gpu}: TPOT and TTFT percentiles against request rate, per configuration "
            "(the search's evaluated rates)",
        ):
            drawn += 1
    if not drawn:
        page.add('<p class="missing">The sweep recorded no curve points.</p>')
    points = _write_csv(
        page.data_dir / "sweep_curves.csv",
        [
            "id",
            "configuration",
            "multiplier",
            "rps",
            "passed",
            "tpot_ms",
            "ttft_ms",
            "throughput_tok_s",
            "goodput_tok_s",
            "slo_attainment",
            "completed",
            "aborted",
            "mean_accept_length",
        ],
        (
            [row.get("id"), figs.config_label(row)]
            + [
                p.get(k)
                for k in (
                    "multiplier",
                    "rps",
                    "passed",
                    "tpot_ms",
                    "ttft_ms",
                    "throughput_tok_s",
                    "goodput_tok_s",
                    "slo_attainment",
                    "completed",
                    "aborted",
                    "mean_accept_length",
                )
            ]
            for row in rows
            for p in row.get("curve") or []
            if isinstance(p, Mapping)
        ),
    )
    page.data(points)

    page.add("<h2>SLO frontier</h2>")
    target = sweep.get("target_rps")
    target_f = float(target) if isinstance(target, int | float) else None
    page.figure(
        "slo_frontier",
        lambda p: figs.frontier_figure(rows, target_f, p),
        "The highest request rate one replica of each configuration sustains within the SLO",
    )
    best = _sub(sweep, "best")
    table_rows = []
    classes = []
    for row in rows:
        v = _sweep_row_values(row)
        table_rows.append(
            [
                figs.config_label(row),
                _e(row.get("status")),
                _f(row.get("max_rps"), 2),
                _f(row.get("replicas")),
                _f(row.get("cost_per_hour"), 2),
                _f(row.get("cost_per_mtok"), 3),
                _f(v[11]),
                _f(row.get("reason")),
            ]
        )
        classes.append(
            "best"
            if row.get("id") is not None and row.get("id") == best.get("id")
            else ("" if row.get("status") == "ok" else "bad")
        )
    page.add(
        _table(
            [
                "configuration",
                "status",
                "max req/s",
                "replicas",
                "cost/h",
                "cost/Mtok",
                "replicas saved",
                "reason",
            ],
            table_rows,
            classes=classes,
        )
    )
    path = _write_csv(
        page.data_dir / "sweep_configurations.csv",
        SWEEP_COLUMNS,
        (_sweep_row_values(r) for r in rows),
    )
    page.data(path)

    page.add("<h2>Replicas and cost</h2>")
    if not page.figure(
        "replicas_cost",
        lambda p: figs.replicas_figure(rows, target_f, p),
        "Replicas each configuration needs for the target rate, and their cost per hour",
    ):
        page.add(
            '<p class="missing">No configuration has a replica count (none holds the SLO).</p>'
        )


FLEET_COLUMNS = (
    "fleet",
    "kind",
    "speculative_replicas",
    "plain_replicas",
    "policy",
    "router",
    "routes_as",
    "fits",
    "meets_slo",
    "slo_attainment",
    "goodput_tok_s",
    "throughput_tok_s",
    "slo_tpot_at_percentile_ms",
    "slo_ttft_at_percentile_ms",
    "aborted",
    "gpus",
    "cost_per_hour",
    "cost_per_mtok",
    "reason",
)


def _fleet_section(page: _Page, fleet: Mapping[str, Any] | None) -> None:
    page.add("<h2>Fleet comparison</h2>")
    rows = _as_list((fleet or {}).get("fleets"))
    if fleet is None or not rows:
        page.add(f'<p class="missing">No fleet plan in this report ({FLEET_HINT}).</p>')
        return
    slo = _sub(fleet, "slo")
    rps = fleet.get("offered_rps")
    page.add(
        f"<p>Every fleet replays the same trace at {_f(rps, 2)} req/s behind its router. "
        f"It holds the SLO when the p{_f(slo.get('percentile'), 0)} of TPOT "
        f"(&le; {_f(slo.get('tpot_ms'), 0)} ms) and of TTFT (&le; {_f(slo.get('ttft_ms'), 0)} ms) "
        "over every request are within it; aborted requests count as misses.</p>"
    )
    page.figure(
        "fleets",
        lambda p: figs.fleet_figure(fleet, p),
        "Goodput and SLO attainment per fleet and router",
    )
    best = _sub(fleet, "best")
    key = (best.get("fleet"), best.get("policy"), best.get("router"))
    table_rows = []
    classes = []
    for r in rows:
        att = r.get("slo_attainment")
        router = str(r.get("router"))
        if r.get("routes_as") and r.get("routes_as") != r.get("router"):
            router += f" (as {r['routes_as']})"
        table_rows.append(
            [
                r.get("fleet"),
                r.get("policy") or "-",
                router,
                _f(r.get("goodput_tok_s"), 0),
                _f(100.0 * att, 1) if isinstance(att, int | float) else "-",
                _f(r.get("slo_tpot_at_percentile_ms"), 1),
                _f(r.get("slo_ttft_at_percentile_ms"), 0),
                _f(r.get("meets_slo")),
                _f(r.get("gpus")),
                _f(r.get("cost_per_hour"), 2),
                _f(r.get("cost_per_mtok"), 3),
                _f(r.get("reason")),
            ]
        )
        classes.append(
            "best"
            if (r.get("fleet"), r.get("policy"), r.get("router")) == key
            else ("" if r.get("meets_slo") else "bad")
        )
    pct = f"p{_f(slo.get('percentile'), 0)}"
    page.add(
        _table(
            [
                "fleet (spec+plain)",
                "policy",
                "router",
                "goodput tok/s",
                "SLO %",
                f"TPOT {pct} ms",
                f"TTFT {pct} ms",
                "holds",
                "GPUs",
                "cost/h",
                "cost/Mtok",
                "note",
            ],
            table_rows,
            left=3,
            classes=classes,
        )
    )
    page.figure(
        "where_speculation_pays",
        lambda p: figs.per_token_figure(fleet, p),
        "Predicted decode time per output token by batch size (what the spec-aware router "
        "scores replicas with)",
    )
    page.data(
        _write_csv(
            page.data_dir / "fleets.csv",
            FLEET_COLUMNS,
            ([r.get(c) for c in FLEET_COLUMNS] for r in rows),
        )
    )
    page.data(
        _write_csv(
            page.data_dir / "fleet_replicas.csv",
            [
                "fleet",
                "policy",
                "router",
                "index",
                "kind",
                "requests",
                "aborted",
                "throughput_tok_s",
                "mean_decode_batch_size",
                "mean_accept_length",
                "tpot_p99_ms",
                "ttft_p99_ms",
                "kv_token_capacity",
                "kv_peak_fraction",
            ],
            (
                [r.get("fleet"), r.get("policy"), r.get("router")]
                + [
                    p.get(k)
                    for k in (
                        "index",
                        "kind",
                        "requests",
                        "aborted",
                        "throughput_tok_s",
                        "mean_decode_batch_size",
                        "mean_accept_length",
                        "tpot_p99_ms",
                        "ttft_p99_ms",
                        "kv_token_capacity",
                        "kv_peak_fraction",
                    )
                ]
                for r in rows
                for p in r.get("per_replica") or []
                if isinstance(p, Mapping)
            ),
        )
    )


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in text) or "x"


def _context(sweep: Mapping[str, Any] | None, fleet: Mapping[str, Any] | None) -> str:
    parts = []
    for label, doc in (("sweep", sweep), ("fleet", fleet)):
        if not doc:
            continue
        trace = _sub(doc, "trace")
        parts.append(
            f"{label}: trace {_e(trace.get('name'))} ({_f(trace.get('requests'))} requests), "
            f"seed {_e(doc.get('seed'))}"
        )
    return "; ".join(parts)


def write_report(
    out_dir: Path,
    *,
    vram: list[dict[str, Any]] | None,
    sweep: dict[str, Any] | None,
    fleet: dict[str, Any] | None,
) -> Path:
    """Write the report into *out_dir* (created if needed); returns ``index.html``'s path."""
    out_dir = Path(out_dir)
    for name, value, kind in (("vram", vram, list), ("sweep", sweep, dict), ("fleet", fleet, dict)):
        if value is not None and not isinstance(value, kind):
            raise ReportError(
                f"write_report: {name} must be a {kind.__name__} (the plan {name} JSON "
                f"document) or None, got {type(value).__name__}"
            )
    page = _Page(out_dir)
    try:
        page.figures_dir.mkdir(parents=True, exist_ok=True)
        page.data_dir.mkdir(parents=True, exist_ok=True)
        for name, value in (("vram", vram), ("sweep", sweep), ("fleet", fleet)):
            if value is not None:
                try:
                    text = json.dumps(value, indent=1, allow_nan=False)
                except ValueError as exc:
                    raise ReportError(f"write_report: {name} is not JSON-clean: {exc}") from None
                path = page.data_dir / f"{name}.json"
                path.write_text(text, encoding="utf-8")
                page.data(path)
        page.add(
            f"<h1>specgov capacity plan</h1><p class='sub'>{_context(sweep, fleet)}. "
            "Every number is simulated (specgov's engine model, catalog and policies).</p>"
        )
        _summary(page, sweep, fleet)
        _vram_section(page, _vram_docs(vram, sweep, fleet))
        _sweep_sections(page, sweep)
        _fleet_section(page, fleet)
        page.add("<h2>Data files</h2><ul>")
        for path in page.files:
            rel = path.relative_to(out_dir).as_posix()
            page.add(f'<li><a href="{_e(rel)}">{_e(rel)}</a></li>')
        page.add("</ul>")
        index = out_dir / "index.html"
        index.write_text(
            "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
            "<meta name='viewport' content='width=device-width, initial-scale=1'>"
            f"<title>specgov capacity plan</title><style>{CSS}</style></head><body>"
            + "\n".join(page.parts)
            + "</body></html>\n",
            encoding="utf-8",
        )
    except OSError as exc:
        raise ReportError(f"cannot write the report into {str(out_dir)!r}: {exc}") from None
    return index
