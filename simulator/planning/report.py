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
import contextlib
import csv
import html
import io
import json
import shlex
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specgov.policies.common.errors import SpecgovError
from specgov.simulator.planning import report_figures as figs
from specgov.simulator.planning.atomic import remove_partial_writes, write_atomic
from specgov.simulator.planning.simplicity import (
    PAYS_TPOT_SLOS_MS,
    pays_curve,
    speculation_crossing_ms,
)

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


class ReportError(SpecgovError, ValueError):
    """The report cannot be written (bad documents or an unwritable folder)."""


def _e(value: object) -> str:
    return html.escape("-" if value is None else str(value))


def _text(value: object, digits: int = 1) -> str:
    """A value as a person reads it (not escaped): yes/no, 1,234, 12.3, "-" for None."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


def _f(value: object, digits: int = 1) -> str:
    """``_text``, escaped for HTML."""
    return html.escape(_text(value, digits))


@dataclass(frozen=True)
class _Col:
    """One column of a table: its header, its value in a record and, for the page, how
    the value reads (default ``_f`` with ``digits``). The CSV files take the value as is,
    so a table's page and its CSV cannot disagree on what a column holds."""

    header: str
    get: Callable[[Mapping[str, Any]], object]
    digits: int = 1
    html: Callable[[Mapping[str, Any]], object] | None = None

    def text(self, record: Mapping[str, Any]) -> object:
        """The cell's text, not escaped (``_table`` escapes it unless it is ``_Raw``)."""
        if self.html is not None:
            return self.html(record)
        return _text(self.get(record), self.digits)


def _key(key: str, header: str | None = None, digits: int = 1) -> _Col:
    """The column of ``record[key]`` (absent: None)."""
    return _Col(header or key, lambda r: r.get(key), digits)


def _keys(*keys: str) -> list[_Col]:
    return [_key(k) for k in keys]


def _table(
    columns: Sequence[_Col],
    records: Iterable[Mapping[str, Any]],
    *,
    left: int = 1,
    classes: Sequence[str] | None = None,
) -> str:
    """An HTML table of *records*; the first *left* columns align left."""
    out = ["<table><tr>"]
    out += [
        f'<th class="{"l" if i < left else ""}">{_e(c.header)}</th>' for i, c in enumerate(columns)
    ]
    out.append("</tr>")
    for n, record in enumerate(records):
        cls = classes[n] if classes is not None and n < len(classes) else ""
        out.append(f'<tr class="{cls}">')
        for i, col in enumerate(columns):
            c = col.text(record)
            out.append(
                f'<td class="{"l" if i < left else ""}">{c if isinstance(c, _Raw) else _e(c)}</td>'
            )
        out.append("</tr>")
    out.append("</table>")
    return "".join(out)


class _Raw(str):
    """Cell text that is already HTML."""


def _flatten(
    records: Iterable[Mapping[str, Any]],
    child_key: str,
    parent: Callable[[Mapping[str, Any]], Mapping[str, Any]],
) -> list[dict[str, Any]]:
    """One record per mapping in each record's list *child_key* (a row's curve points, a
    fleet's replicas), with its parent's fields (``parent(record)``) beside its own."""
    return [
        {**child, **parent(record)}
        for record in records
        for child in record.get(child_key) or []
        if isinstance(child, Mapping)
    ]


def _write_csv(path: Path, columns: Sequence[_Col], records: Iterable[Mapping[str, Any]]) -> Path:
    """The same columns as a CSV file (raw values; None is empty)."""
    buf = io.StringIO(newline="")
    writer = csv.writer(buf)
    writer.writerow([c.header for c in columns])
    for record in records:
        row = [c.get(record) for c in columns]
        writer.writerow(["" if v is None else v for v in row])
    return write_atomic(path, buf.getvalue())


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
        why = (sweep or {}).get("recommendation")
        if why:
            page.add(f'<p class="rec">Why: {_e(why)}.</p>')
        for gpu, answer in ((sweep or {}).get("host_cache_or_gpus") or {}).items():
            page.add(f'<p class="rec">Host cache or GPUs on {_e(gpu)}: {_e(answer["answer"])}.</p>')
    elif sweep is not None:
        page.add('<p class="rec">The sweep found no configuration that holds the SLO.</p>')
    if fleet is not None:
        rec = fleet.get("recommendation")
        page.add(f'<p class="rec"><b>Fleet:</b> {_e(rec or "no fleet recommendation")}</p>')
    page.add("<h3>Launch configuration</h3>")
    blocks: list[str] = []
    if isinstance(best, Mapping):
        blocks.append(_launch_block(page, f"sweep best: {figs.config_label(best)}", best))
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
                src = kind.get("launch_args") or {}
                blocks.append(_launch_block(page, f"fleet: {label}", src))
    if blocks:
        page.add("".join(blocks))
    else:
        page.add('<p class="missing">No launch configuration: nothing holds the SLO.</p>')


ADAPTIVE_FLAG = "--speculative-adaptive-config"


def _launch_block(page: _Page, title: str, src: Mapping[str, Any]) -> str:
    """The launch command, complete: ``--enable-metrics`` (specgov reads ``/metrics``) and
    the adaptive config written as a file next to the report, named in the command."""
    argv = src.get("launch_args") if "launch_args" in src else src.get("argv")
    error = src.get("launch_error") if "launch_error" in src else src.get("error")
    text = f"<p><b>{_e(title)}</b></p>"
    if error:
        return text + f'<p class="missing">{_e(error)}</p>'
    args = [str(a) for a in argv] if isinstance(argv, list) else []
    config = src.get("adaptive_config")
    config_path: Path | None = None
    if config:
        config_path = page.out_dir / f"adaptive-config-{_slug(title)}.json"
        page.data(write_atomic(config_path, json.dumps(config, indent=1) + "\n"))
        if ADAPTIVE_FLAG in args[:-1]:
            args[args.index(ADAPTIVE_FLAG) + 1] = str(config_path.resolve())
    flags = shlex.join(["--enable-metrics", *args])
    text += f"<pre>python -m sglang.launch_server --model-path MODEL {_e(flags)}</pre>"
    if config_path is not None:
        name = config_path.name
        text += (
            f'<p>{ADAPTIVE_FLAG} file (<a href="{_e(name)}">{_e(name)}</a>, written next '
            f"to this report):</p><pre>{_e(_compact_json(config))}</pre>"
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
    page.add(
        _table(
            [
                _Col("configuration", figs.vram_label),
                _key("total_gib", "GPU GiB"),
                _key("mem_fraction_static", "mem frac", 3),
                _key("kv_pool_tokens", "KV tokens"),
                _key("kv_pool_gib", "KV GiB", 2),
                _key("left_gib", "left GiB", 2),
                _Col(
                    "fits",
                    lambda d: d.get("fits", True),
                    html=lambda d: (
                        "yes" if d.get("fits", True) else f"no: {d.get('first_overflow')}"
                    ),
                ),
            ],
            docs,
            classes=["" if d.get("fits", True) else "bad" for d in docs],
        )
    )
    for d in docs:
        items = [i for i in d.get("items") or [] if isinstance(i, Mapping)]
        if not items:
            continue
        page.add(f"<details><summary>{_e(figs.vram_label(d))}: items</summary>")
        page.add(_table([_key("name", "item"), _key("gib", "GiB", 3)], items))
        notes = [*(d.get("warnings") or []), *(d.get("assumptions") or [])]
        if d.get("message"):
            notes.insert(0, d["message"])
        if notes:
            page.add("<ul>" + "".join(f"<li>{_e(n)}</li>" for n in notes) + "</ul>")
        page.add("</details>")
    page.data(
        _write_csv(
            page.data_dir / "vram_items.csv",
            [*_keys("configuration", "gpu", "drafter", "fits"), _key("name", "item"), _key("gib")],
            _flatten(
                docs,
                "items",
                lambda d: {
                    "configuration": figs.vram_label(d),
                    "gpu": d.get("gpu"),
                    "drafter": d.get("drafter"),
                    "fits": d.get("fits"),
                },
            ),
        )
    )


def _saving(key: str) -> Callable[[Mapping[str, Any]], object]:
    return lambda row: _sub(row, "saving_vs_none").get(key)


def _shape_name(row: Mapping[str, Any]) -> object:
    shape = row.get("shape")
    return shape.get("name") if isinstance(shape, Mapping) else shape


# data/sweep_configurations.csv: one row per configuration.
SWEEP_COLUMNS = (
    _key("id"),
    _key("gpu"),
    _key("drafter"),
    _Col("shape", _shape_name),
    _key("policy"),
    _key("status"),
    _key("fits"),
    _key("max_rps"),
    _key("replicas"),
    _key("cost_per_hour"),
    _key("cost_per_mtok"),
    _Col("saving_replicas", _saving("replicas")),
    _Col("saving_cost_fraction", _saving("cost_fraction")),
    _key("launch_shell"),
    _key("reason"),
)

# The page's SLO frontier table.
SWEEP_TABLE = (
    _Col("configuration", figs.config_label),
    _key("status"),
    _key("max_rps", "max req/s", 2),
    _key("replicas"),
    _key("cost_per_hour", "cost/h", 2),
    _key("cost_per_mtok", "cost/Mtok", 3),
    _Col("replicas saved", _saving("replicas")),
    _key("reason"),
)

# A sweep row's curve POINT (sweep.py), as data/sweep_curves.csv gives it.
POINT_KEYS = (
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
    page.data(
        _write_csv(
            page.data_dir / "sweep_curves.csv",
            _keys("id", "configuration", *POINT_KEYS),
            _flatten(
                rows,
                "curve",
                lambda row: {"id": row.get("id"), "configuration": figs.config_label(row)},
            ),
        )
    )

    page.add("<h2>SLO frontier</h2>")
    target = sweep.get("target_rps")
    target_f = float(target) if isinstance(target, int | float) else None
    page.figure(
        "slo_frontier",
        lambda p: figs.frontier_figure(rows, target_f, p),
        "The highest request rate one replica of each configuration sustains within the SLO",
    )
    best = _sub(sweep, "best")
    classes = [
        "best"
        if row.get("id") is not None and row.get("id") == best.get("id")
        else ("" if row.get("status") == "ok" else "bad")
        for row in rows
    ]
    page.add(_table(SWEEP_TABLE, rows, classes=classes))
    page.data(_write_csv(page.data_dir / "sweep_configurations.csv", SWEEP_COLUMNS, rows))

    _pays_section(page, by_gpu, slo)

    page.add("<h2>Replicas and cost</h2>")
    if not page.figure(
        "replicas_cost",
        lambda p: figs.replicas_figure(rows, target_f, p),
        "Replicas each configuration needs for the target rate, and their cost per hour",
    ):
        page.add(
            '<p class="missing">No configuration has a replica count (none holds the SLO).</p>'
        )


def _pays_section(
    page: _Page, by_gpu: Mapping[str, list[dict[str, Any]]], slo: Mapping[str, Any]
) -> None:
    """When speculation pays: sustainable rate per replica against the TPOT SLO, plain
    against each speculative configuration, and where they cross (simplicity.py)."""
    page.add("<h2>When speculation pays</h2>")
    slos = PAYS_TPOT_SLOS_MS
    ttft = slo.get("ttft_ms")
    ttft_ms = float(ttft) if isinstance(ttft, int | float) else None
    records: list[dict[str, Any]] = []
    notes: list[str] = []
    for gpu, rows in by_gpu.items():
        # Rows that ran (a configuration that cannot run has no curve to read).
        series = [
            (figs.config_label(r), r.get("drafter") == "none", r) for r in rows if r.get("curve")
        ]
        curves = [(label, plain, pays_curve(r, ttft_ms=ttft_ms)) for label, plain, r in series]
        plain_curve = next((c for _, plain, c in curves if plain), None)
        for (label, plain, curve), (_, _, row) in zip(curves, series, strict=True):
            records += [
                {"id": row.get("id"), "configuration": label, "tpot_slo_ms": x, "rps": y}
                for x, y in zip(slos, curve, strict=True)
            ]
            if plain or plain_curve is None:
                continue
            cross = speculation_crossing_ms(plain_curve, curve, slos)
            notes.append(
                f"{label}: "
                + (
                    "never sustains more than the plain server at a TPOT SLO of "
                    f"{slos[0]:g}-{slos[-1]:g} ms"
                    if cross is None
                    else f"sustains more than the plain server at a TPOT SLO of {cross:g} ms "
                    "and tighter"
                )
            )

        def draw(
            p: Path, c: list[tuple[str, bool, list[float]]] = curves, g: str = gpu
        ) -> Path | None:
            return figs.pays_figure(c, slos, p, title=f"{g}: when speculation pays")

        page.figure(
            f"speculation_pays_{_slug(gpu)}",
            draw,
            f"{gpu}: the highest rate one replica sustains against the TPOT SLO (TTFT SLO "
            "held), plain (dashed) and each speculative configuration; read from the "
            "sweep's evaluated rates (a step curve at the search's resolution)",
        )
    if notes:
        page.add("<ul>" + "".join(f"<li>{_e(n)}</li>" for n in notes) + "</ul>")
    else:
        page.add('<p class="missing">No plain server and speculative curve to compare.</p>')
    page.data(
        _write_csv(
            page.data_dir / "speculation_pays.csv",
            _keys("id", "configuration", "tpot_slo_ms", "rps"),
            records,
        )
    )


# data/fleets.csv: one row per fleet and router.
FLEET_COLUMNS = tuple(
    _keys(
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
)

# What names one fleet result (a fleet under one policy behind one router).
FLEET_KEY = ("fleet", "policy", "router")

# data/fleet_replicas.csv: one row per replica of each fleet (its per_replica entries).
REPLICA_KEYS = (
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


def _router_text(r: Mapping[str, Any]) -> str:
    router = str(r.get("router"))
    if r.get("routes_as") and r.get("routes_as") != r.get("router"):
        router += f" (as {r['routes_as']})"
    return router


def _percent(r: Mapping[str, Any]) -> str:
    att = r.get("slo_attainment")
    return _text(100.0 * att, 1) if isinstance(att, int | float) else "-"


def _fleet_table(pct: str) -> list[_Col]:
    """The page's fleet table; *pct* names the SLO percentile (e.g. p99)."""
    return [
        _key("fleet", "fleet (spec+plain)"),
        _Col("policy", lambda r: r.get("policy") or "-"),
        _Col("router", _router_text),
        _key("goodput_tok_s", "goodput tok/s", 0),
        _Col("SLO %", lambda r: r.get("slo_attainment"), html=_percent),
        _key("slo_tpot_at_percentile_ms", f"TPOT {pct} ms", 1),
        _key("slo_ttft_at_percentile_ms", f"TTFT {pct} ms", 0),
        _key("meets_slo", "holds"),
        _key("gpus", "GPUs"),
        _key("cost_per_hour", "cost/h", 2),
        _key("cost_per_mtok", "cost/Mtok", 3),
        _key("reason", "note"),
    ]


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
    key = [best.get(k) for k in FLEET_KEY]
    classes = [
        "best" if [r.get(k) for k in FLEET_KEY] == key else ("" if r.get("meets_slo") else "bad")
        for r in rows
    ]
    pct = f"p{_text(slo.get('percentile'), 0)}"
    page.add(_table(_fleet_table(pct), rows, left=3, classes=classes))
    page.figure(
        "where_speculation_pays",
        lambda p: figs.per_token_figure(fleet, p),
        "Predicted decode time per output token by batch size (what the spec-aware router "
        "scores replicas with)",
    )
    page.data(_write_csv(page.data_dir / "fleets.csv", FLEET_COLUMNS, rows))
    page.data(
        _write_csv(
            page.data_dir / "fleet_replicas.csv",
            _keys("fleet", "policy", "router", *REPLICA_KEYS),
            _flatten(rows, "per_replica", lambda r: {k: r.get(k) for k in FLEET_KEY}),
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
    folders = (out_dir, page.figures_dir, page.data_dir)
    try:
        page.figures_dir.mkdir(parents=True, exist_ok=True)
        page.data_dir.mkdir(parents=True, exist_ok=True)
        for folder in folders:  # what an interrupted earlier report was writing
            remove_partial_writes(folder)
        for name, value in (("vram", vram), ("sweep", sweep), ("fleet", fleet)):
            if value is not None:
                try:
                    text = json.dumps(value, indent=1, allow_nan=False)
                except ValueError as exc:
                    raise ReportError(f"write_report: {name} is not JSON-clean: {exc}") from None
                page.data(write_atomic(page.data_dir / f"{name}.json", text))
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
        index = write_atomic(
            out_dir / "index.html",
            "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
            "<meta name='viewport' content='width=device-width, initial-scale=1'>"
            f"<title>specgov capacity plan</title><style>{CSS}</style></head><body>"
            + "\n".join(page.parts)
            + "</body></html>\n",
        )
    except BaseException as exc:
        for folder in folders:
            with contextlib.suppress(OSError):  # the failure itself is what to report
                remove_partial_writes(folder)
        if isinstance(exc, OSError):
            raise ReportError(f"cannot write the report into {str(out_dir)!r}: {exc}") from None
        raise
    return index
