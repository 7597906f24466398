"""Tables, targets and plots of the policy benchmark, computed from the run results only.

Rows: one per (scenario, policy) that ran, plus two oracle rows per scenario that are
derived after the fact from the static:1..7 runs:

* ``oracle-static`` (best static in hindsight): the static:K with the highest goodput;
  the row repeats that run's numbers.
* ``oracle-per-phase`` (per-phase best static in hindsight): for a scenario with content
  phases, each phase's good tokens (output tokens of the SLO-meeting requests that
  *arrived* in the phase) are taken from the static that did best in that phase, summed
  over phases, and divided by the oracle-static run's duration (first arrival to last
  completion) so the number is a goodput comparable with the others. It is never below
  oracle-static. Without phases it equals oracle-static.

Ratios ``*_vs_ema`` divide by the sglang-ema row of the same scenario.
"""

from __future__ import annotations

import csv
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # headless: never open a window
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.colors import TwoSlopeNorm

from benchmarks.policies.scenarios import (
    DAEMON_POLICIES,
    EMA,
    POLICY_LABELS,
    STATIC_POLICIES,
    Scenario,
)
from specgov.simulator.engine import TimeSeries
from specgov.simulator.plots import write_plots

ORACLE = "oracle-static"
PHASE_ORACLE = "oracle-per-phase"
TARGET_POLICY = "goodput"

CSV_COLUMNS: tuple[str, ...] = (
    "scenario",
    "workload",
    "gpu",
    "profile",
    "policy",
    "resolved",
    "throughput_tok_s",
    "goodput_tok_s",
    "tpot_p50_ms",
    "tpot_p99_ms",
    "ttft_p99_ms",
    "slo_attainment",
    "throughput_vs_ema",
    "goodput_vs_ema",
    "completed_requests",
    "duration_s",
    "mean_accept_length",
    "mean_decode_batch_size",
    "decisions",
    "table_changes",
    "table_changes_per_min",
    "mean_decide_ms",
    "wall_s",
)
PHASE_CSV_COLUMNS: tuple[str, ...] = (
    "scenario",
    "phase",
    "start_s",
    "end_s",
    "policy",
    "good_tokens",
    "phase_goodput_tok_s",
)


@dataclass
class RunResult:
    """One policy's run on one scenario (what a worker sends back)."""

    scenario_id: str
    policy: str
    summary: dict[str, Any]
    phase_good_tokens: dict[str, int] = field(default_factory=dict)
    reason_counts: dict[str, int] = field(default_factory=dict)
    changes: list[dict[str, Any]] = field(default_factory=list)  # the daemon's table changes
    series: TimeSeries | None = None


@dataclass(frozen=True)
class TargetResult:
    key: str
    description: str
    threshold: str
    status: str  # PASS, MISS or N/A
    measured: float | None  # the worst value over the scope
    worst: str  # scenario id of the worst value
    passed: int
    total: int
    values: tuple[tuple[str, float], ...]  # (scenario id, value) over the scope


# ----------------------------------------------------------------------------------- rows


def _ratio(a: Any, b: Any) -> float | None:
    if a is None or b is None or not b:
        return None
    return float(a) / float(b)


def _q(summary: Mapping[str, Any], key: str, q: str) -> float | None:
    v = summary.get(key) or {}
    out = v.get(q)
    return None if out is None else float(out)


def _row(scenario: Scenario, label: str, run: RunResult) -> dict[str, Any]:
    s = run.summary
    duration = s.get("duration_s")
    changes = s.get("table_changes")
    return {
        "scenario": scenario.id,
        "workload": scenario.workload.name,
        "gpu": scenario.gpu,
        "profile": scenario.profile,
        "policy": label,
        "resolved": s.get("name", label),
        "throughput_tok_s": s.get("throughput_tok_s"),
        "goodput_tok_s": s.get("goodput_tok_s"),
        "tpot_p50_ms": _q(s, "tpot_ms", "p50"),
        "tpot_p99_ms": _q(s, "tpot_ms", "p99"),
        "ttft_p99_ms": _q(s, "ttft_ms", "p99"),
        "slo_attainment": s.get("slo_attainment"),
        "throughput_vs_ema": None,
        "goodput_vs_ema": None,
        "completed_requests": s.get("completed_requests"),
        "duration_s": duration,
        "mean_accept_length": s.get("mean_accept_length"),
        "mean_decode_batch_size": s.get("mean_decode_batch_size"),
        "decisions": s.get("decisions"),
        "table_changes": changes,
        "table_changes_per_min": (
            changes / (duration / 60.0) if changes is not None and duration else None
        ),
        "mean_decide_ms": s.get("mean_decide_ms"),
        "wall_s": s.get("wall_s"),
    }


def best_static(runs: Mapping[str, RunResult]) -> str | None:
    """The static:K label with the highest goodput (ties: the smaller K)."""
    statics = [p for p in STATIC_POLICIES if p in runs]
    if not statics:
        return None
    return max(statics, key=lambda p: (float(runs[p].summary["goodput_tok_s"]), -statics.index(p)))


def per_phase_oracle(
    scenario: Scenario, runs: Mapping[str, RunResult]
) -> tuple[float, dict[str, str]] | None:
    """(good tokens summed over phases from each phase's best static, phase -> static)."""
    phases = scenario.workload.phases()
    statics = [p for p in STATIC_POLICIES if p in runs]
    if not phases or not statics:
        return None
    total = 0.0
    choice: dict[str, str] = {}
    for ph in phases:
        best = max(statics, key=lambda p: (runs[p].phase_good_tokens.get(ph.name, 0), -int(p[7:])))
        choice[ph.name] = best
        total += runs[best].phase_good_tokens.get(ph.name, 0)
    return total, choice


def build_rows(scenarios: Sequence[Scenario], results: Sequence[RunResult]) -> list[dict[str, Any]]:
    """Table rows in scenario order, policies in POLICIES order, oracle rows after the statics."""
    by_scenario: dict[str, dict[str, RunResult]] = {}
    for r in results:
        by_scenario.setdefault(r.scenario_id, {})[r.policy] = r
    rows: list[dict[str, Any]] = []
    for sc in scenarios:
        runs = by_scenario.get(sc.id)
        if not runs:
            continue
        order = {p: i for i, p in enumerate(POLICY_LABELS)}
        labels = sorted(runs, key=lambda p: (order.get(p, len(order)), p))
        sc_rows = [_row(sc, label, runs[label]) for label in labels]
        oracle = _oracle_rows(sc, runs)
        if oracle:
            last = max(i for i, r in enumerate(sc_rows) if r["policy"] in STATIC_POLICIES)
            sc_rows[last + 1 : last + 1] = oracle
        rows.extend(_with_ratios(sc_rows))
    return rows


def _oracle_rows(sc: Scenario, runs: Mapping[str, RunResult]) -> list[dict[str, Any]]:
    best = best_static(runs)
    if best is None:
        return []
    oracle = _row(sc, ORACLE, runs[best])
    oracle["resolved"] = best
    oracle["wall_s"] = None
    phase = per_phase_oracle(sc, runs)
    if phase is None:
        per_phase = dict(oracle, policy=PHASE_ORACLE, resolved=f"{best} (no phases)")
    else:
        good_tokens, choice = phase
        duration = float(runs[best].summary["duration_s"])
        per_phase = {k: None for k in CSV_COLUMNS}
        per_phase.update(
            scenario=sc.id,
            workload=sc.workload.name,
            gpu=sc.gpu,
            profile=sc.profile,
            policy=PHASE_ORACLE,
            resolved=" ".join(f"{ph}={p}" for ph, p in choice.items()),
            goodput_tok_s=good_tokens / duration if duration > 0 else None,
            duration_s=duration,
        )
    return [oracle, per_phase]


def _with_ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    ema = next((r for r in rows if r["policy"] == EMA), None)
    for r in rows:
        if ema is not None:
            r["throughput_vs_ema"] = _ratio(r["throughput_tok_s"], ema["throughput_tok_s"])
            r["goodput_vs_ema"] = _ratio(r["goodput_tok_s"], ema["goodput_tok_s"])
    return rows


def phase_rows(scenarios: Sequence[Scenario], results: Sequence[RunResult]) -> list[dict[str, Any]]:
    """Per content phase and policy: good tokens of SLO-meeting requests arriving in it."""
    by_id = {s.id: s for s in scenarios}
    out: list[dict[str, Any]] = []
    for r in results:
        sc = by_id.get(r.scenario_id)
        if sc is None:
            continue
        for ph in sc.workload.phases():
            tokens = r.phase_good_tokens.get(ph.name, 0)
            out.append(
                {
                    "scenario": sc.id,
                    "phase": ph.name,
                    "start_s": ph.start_s,
                    "end_s": ph.end_s,
                    "policy": r.policy,
                    "good_tokens": tokens,
                    "phase_goodput_tok_s": tokens / (ph.end_s - ph.start_s),
                }
            )
    return out


# -------------------------------------------------------------------------------- targets


def _scope_values(
    rows: Sequence[dict[str, Any]],
    scenarios: Sequence[Scenario],
    policy: str,
    value: Callable[[Mapping[str, dict[str, Any]]], float | None],
    tags: frozenset[str] | None,
) -> list[tuple[str, float]]:
    by: dict[str, dict[str, dict[str, Any]]] = {}
    for r in rows:
        by.setdefault(r["scenario"], {})[r["policy"]] = r
    out: list[tuple[str, float]] = []
    for sc in scenarios:
        if tags is not None and not (sc.tags & tags):
            continue
        table = by.get(sc.id)
        if not table or policy not in table:
            continue
        v = value(table)
        if v is not None:
            out.append((sc.id, v))
    return out


def _target(
    key: str,
    description: str,
    threshold: float,
    values: list[tuple[str, float]],
    *,
    higher_is_better: bool = True,
    fmt: str = "{:.3f}",
) -> TargetResult:
    op = ">=" if higher_is_better else "<="
    if not values:
        return TargetResult(
            key, description, f"{op} {fmt.format(threshold)}", "N/A", None, "", 0, 0, ()
        )

    def ok(v: float) -> bool:
        return v >= threshold if higher_is_better else v <= threshold

    worst = min(values, key=lambda x: x[1]) if higher_is_better else max(values, key=lambda x: x[1])
    passed = sum(1 for _, v in values if ok(v))
    return TargetResult(
        key=key,
        description=description,
        threshold=f"{op} {fmt.format(threshold)}",
        status="PASS" if passed == len(values) else "MISS",
        measured=worst[1],
        worst=worst[0],
        passed=passed,
        total=len(values),
        values=tuple(values),
    )


def _vs(policy: str, reference: str) -> Callable[[Mapping[str, dict[str, Any]]], float | None]:
    def value(table: Mapping[str, dict[str, Any]]) -> float | None:
        ref = table.get(reference)
        return _ratio(table[policy]["goodput_tok_s"], ref["goodput_tok_s"] if ref else None)

    return value


def _changes(policy: str) -> Callable[[Mapping[str, dict[str, Any]]], float | None]:
    def value(table: Mapping[str, dict[str, Any]]) -> float | None:
        v = table[policy]["table_changes_per_min"]
        return None if v is None else float(v)

    return value


MAX_CHANGES_PER_MIN = 6.0


def evaluate_targets(
    rows: Sequence[dict[str, Any]], scenarios: Sequence[Scenario]
) -> list[TargetResult]:
    """Issue 3's targets for the goodput policy, each PASS/MISS with the worst value."""
    p = TARGET_POLICY
    targets = [
        _target(
            "vs_ema_all",
            "goodput ratio vs sglang-ema, every scenario",
            0.99,
            _scope_values(rows, scenarios, p, _vs(p, EMA), None),
        ),
        _target(
            "vs_ema_phase_high_load",
            "goodput ratio vs sglang-ema, phase-shift and high-load scenarios",
            1.10,
            _scope_values(rows, scenarios, p, _vs(p, EMA), frozenset({"phase_shift", "high_load"})),
        ),
        _target(
            "vs_per_phase_oracle",
            "goodput ratio vs per-phase best static in hindsight, every scenario",
            0.97,
            _scope_values(rows, scenarios, p, _vs(p, PHASE_ORACLE), None),
        ),
        _target(
            "vs_none_saturation",
            "goodput ratio vs none (no speculation), saturation scenarios",
            0.98,
            _scope_values(rows, scenarios, p, _vs(p, "none"), frozenset({"saturation"})),
        ),
        _target(
            "vs_best_static_one_user",
            "goodput ratio vs best static in hindsight, one user",
            0.98,
            _scope_values(rows, scenarios, p, _vs(p, ORACLE), frozenset({"one_user"})),
        ),
    ]
    for policy in ("goodput", "bandit"):
        targets.append(
            _target(
                f"changes_per_min_steady_{policy}",
                f"{policy}: table changes per simulated minute, steady load",
                MAX_CHANGES_PER_MIN,
                _scope_values(rows, scenarios, policy, _changes(policy), frozenset({"steady"})),
                higher_is_better=False,
                fmt="{:.2f}",
            )
        )
    return targets


# ------------------------------------------------------------------------------- markdown


def _fmt(v: Any, digits: int = 1) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if isinstance(v, float):
        return f"{v:,.{digits}f}"
    return str(v)


def _table(header: Sequence[str], body: Sequence[Sequence[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out.extend("| " + " | ".join(cells) + " |" for cells in body)
    return out


def render_targets(targets: Sequence[TargetResult]) -> list[str]:
    body = []
    for t in targets:
        digits = 2 if t.key.startswith("changes") else 3
        body.append(
            [
                t.description,
                t.threshold,
                _fmt(t.measured, digits) + (f" ({t.worst})" if t.worst else ""),
                f"{t.passed}/{t.total}",
                f"**{t.status}**",
            ]
        )
    return _table(
        ["target", "threshold", "measured (worst, where)", "scenarios met", "result"], body
    )


def render_markdown(
    rows: Sequence[dict[str, Any]],
    targets: Sequence[TargetResult],
    scenarios: Sequence[Scenario],
    meta: Mapping[str, str],
    phase_table: Sequence[dict[str, Any]] = (),
) -> str:
    lines = ["# Policy benchmark", ""]
    lines += [f"- {k}: {v}" for k, v in meta.items()]
    lines += ["", "## Targets", ""]
    lines += render_targets(targets)
    lines += [
        "",
        "Per-scenario values behind the targets: goodput policy's goodput ratios, and the "
        "per-phase oracle's ratio to sglang-ema (the headroom any step table had).",
        "",
    ]
    by: dict[str, dict[str, dict[str, Any]]] = {}
    for r in rows:
        by.setdefault(r["scenario"], {})[r["policy"]] = r
    ran = [s for s in scenarios if s.id in by]
    body = []
    for sc in ran:
        t = by[sc.id]
        g = t.get(TARGET_POLICY)
        if g is None:
            continue

        def vs(ref: str, table: Mapping[str, dict[str, Any]] = t, gr: Any = g) -> str:
            ref_row = table.get(ref)
            return _fmt(_ratio(gr["goodput_tok_s"], ref_row and ref_row["goodput_tok_s"]), 3)

        body.append(
            [
                sc.id,
                ",".join(sorted(sc.tags)) or "-",
                vs(EMA),
                _fmt(t.get(PHASE_ORACLE, {}).get("goodput_vs_ema"), 3),
                vs(PHASE_ORACLE),
                vs("none"),
                vs(ORACLE),
                _fmt(t.get(ORACLE, {}).get("resolved")),
                _fmt(g["table_changes_per_min"], 2),
            ]
        )
    lines += _table(
        [
            "scenario",
            "tags",
            "vs ema",
            "per-phase oracle vs ema",
            "vs per-phase oracle",
            "vs none",
            "vs best static",
            "best static",
            "changes/min",
        ],
        body,
    )

    policies = list(dict.fromkeys(r["policy"] for r in rows))
    lines += ["", "## Goodput / sglang-ema goodput", ""]
    lines += _table(
        ["scenario", *policies],
        [
            [sc.id, *(_fmt(by[sc.id].get(p, {}).get("goodput_vs_ema"), 3) for p in policies)]
            for sc in ran
        ],
    )

    daemon = [p for p in policies if p in DAEMON_POLICIES]
    if daemon:
        lines += ["", "## Daemon policies: table changes per minute / mean decide ms", ""]
        lines += _table(
            ["scenario", *daemon],
            [
                [
                    sc.id,
                    *(
                        f"{_fmt(by[sc.id].get(p, {}).get('table_changes_per_min'), 2)} / "
                        f"{_fmt(by[sc.id].get(p, {}).get('mean_decide_ms'), 2)}"
                        for p in daemon
                    ),
                ]
                for sc in ran
            ],
        )

    if phase_table:
        lines += [
            "",
            "## Per-phase goodput (tokens of SLO-meeting requests arriving in the "
            "phase / phase length, tok/s)",
            "",
        ]
        phases = list(dict.fromkeys((r["scenario"], r["phase"]) for r in phase_table))
        cell = {(r["scenario"], r["phase"], r["policy"]): r for r in phase_table}
        ppol = list(dict.fromkeys(r["policy"] for r in phase_table))
        lines += _table(
            ["scenario", "phase", *ppol],
            [
                [
                    s,
                    ph,
                    *(_fmt(cell.get((s, ph, p), {}).get("phase_goodput_tok_s"), 0) for p in ppol),
                ]
                for s, ph in phases
            ],
        )

    lines += ["", "## Results per scenario", ""]
    header = [
        "policy",
        "throughput tok/s",
        "goodput tok/s",
        "TPOT p50 ms",
        "TPOT p99 ms",
        "TTFT p99 ms",
        "SLO att.",
        "thr/ema",
        "good/ema",
        "changes/min",
        "decide ms",
    ]
    for sc in ran:
        lines += [f"### {sc.id}", "", sc.workload.description, ""]
        body = []
        for r in rows:
            if r["scenario"] != sc.id:
                continue
            name = r["policy"]
            if name in (ORACLE, PHASE_ORACLE):
                name = f"{name} ({r['resolved']})"
            body.append(
                [
                    name,
                    _fmt(r["throughput_tok_s"], 0),
                    _fmt(r["goodput_tok_s"], 0),
                    _fmt(r["tpot_p50_ms"]),
                    _fmt(r["tpot_p99_ms"]),
                    _fmt(r["ttft_p99_ms"], 0),
                    _fmt(r["slo_attainment"], 3),
                    _fmt(r["throughput_vs_ema"], 3),
                    _fmt(r["goodput_vs_ema"], 3),
                    _fmt(r["table_changes_per_min"], 2),
                    _fmt(r["mean_decide_ms"], 2),
                ]
            )
        lines += _table(header, body)
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


# ------------------------------------------------------------------------------ files


def _csv_value(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return repr(v)  # full precision: ratios can be recomputed exactly
    return str(v)


def write_csv(rows: Sequence[Mapping[str, Any]], columns: Sequence[str], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="", encoding="utf-8") as fh:
        writer = csv.writer(fh)
        writer.writerow(columns)
        for r in rows:
            writer.writerow([_csv_value(r.get(c)) for c in columns])
    return path


def plot_goodput_ratios(rows: Sequence[dict[str, Any]], path: Path) -> Path | None:
    """Heat map: goodput / sglang-ema goodput, scenario (rows) x policy (columns)."""
    scen = list(dict.fromkeys(r["scenario"] for r in rows))
    pols = [p for p in dict.fromkeys(r["policy"] for r in rows) if p != EMA]
    if not scen or not pols:
        return None
    grid = np.full((len(scen), len(pols)), np.nan)
    for r in rows:
        if r["policy"] in pols and r["goodput_vs_ema"] is not None:
            grid[scen.index(r["scenario"]), pols.index(r["policy"])] = r["goodput_vs_ema"]
    fig, ax = plt.subplots(figsize=(1.0 + 0.75 * len(pols), 1.2 + 0.32 * len(scen)))
    norm = TwoSlopeNorm(vcenter=1.0, vmin=0.5, vmax=1.5)
    im = ax.imshow(np.clip(grid, 0.5, 1.5), cmap="RdYlGn", norm=norm, aspect="auto")
    for i in range(len(scen)):
        for j in range(len(pols)):
            if not np.isnan(grid[i, j]):
                ax.text(j, i, f"{grid[i, j]:.2f}", ha="center", va="center", fontsize=6)
    ax.set_xticks(range(len(pols)), labels=pols, rotation=45, ha="right", fontsize=7)
    ax.set_yticks(range(len(scen)), labels=scen, fontsize=7)
    ax.set_title("goodput / sglang-ema goodput (colour clipped to 0.5-1.5)", fontsize=9)
    fig.colorbar(im, ax=ax, shrink=0.6)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_timeseries(
    scenario_id: str, series: Sequence[tuple[str, TimeSeries]], out_dir: Path
) -> list[Path]:
    """One scenario's time series via specgov.simulator.plots (one PNG per policy + all)."""
    folder = out_dir / re.sub(r"[^A-Za-z0-9_.-]+", "_", scenario_id)
    return write_plots(series, folder)
