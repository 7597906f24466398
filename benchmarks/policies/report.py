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

Two oracle runs (``specgov.simulator.replay.oracle``) bound what per-batch step choice can do:
the clairvoyant ``oracle`` (knows each request's next acceptance draw) and the informed
``oracle:informed`` (knows each request's acceptance distribution, not the draws: what a
realisable per-batch policy could reach). ``oracle_share`` = (policy - none) / (oracle -
none) on goodput (the headline metric), ``informed_share`` the same against the informed
oracle, ``oracle_share_throughput`` the clairvoyant share on throughput (what the oracles
maximise per batch). Left empty where the oracle gains less than ``MIN_ORACLE_GAIN`` over
``none``: there is no gain to share (an unsaturated server serves every arrival whatever
the steps). Where ``none`` beats an oracle (saturation: step 0 still pays the drafter) the
ceiling is the fleet's, ``max(oracle, none)`` (``fleet_ceiling``, ``vs_fleet_ceiling``):
only a restart without speculation gets there.

Wrong priors: a daemon policy run with a step-cost or acceptance prior other than the
truth is labelled ``policy@variant`` (``goodput@x0.7``, ``goodput@gpu``,
``goodput@accept0.3``). The targets are computed per variant and, as the headline, for
the worst prior: per scenario, the worst value over all of the policy's variants.
"""

from __future__ import annotations

import csv
import dataclasses
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
    CLAIRVOYANT,
    DAEMON_POLICIES,
    EMA,
    INFORMED,
    POLICY_LABELS,
    STATIC_POLICIES,
    Scenario,
)
from specgov.controller.daemon.recommend import SUSTAINED_S
from specgov.simulator.engine.core import TimeSeries
from specgov.simulator.replay.oracle import MIN_ORACLE_GAIN, ceiling, oracle_share
from specgov.simulator.replay.plots import write_plots

ORACLE = "oracle-static"
PHASE_ORACLE = "oracle-per-phase"
TARGET_POLICY = "goodput"

CSV_COLUMNS: tuple[str, ...] = (
    "scenario",
    "workload",
    "gpu",
    "profile",
    "policy",
    "family",
    "prior",
    "resolved",
    "throughput_tok_s",
    "goodput_tok_s",
    "tpot_p50_ms",
    "tpot_p99_ms",
    "ttft_p99_ms",
    "slo_attainment",
    "throughput_vs_ema",
    "goodput_vs_ema",
    "oracle_share",
    "informed_share",
    "oracle_share_throughput",
    "fleet_ceiling",
    "vs_fleet_ceiling",
    "completed_requests",
    "duration_s",
    "mean_accept_length",
    "mean_decode_batch_size",
    "kv_token_capacity",
    "retractions",
    "tier_switches",
    "decisions",
    "table_changes",
    "table_changes_per_min",
    "mean_decide_ms",
    "restart_recommended",
    "restart_predicted_gain",
    "restart_metric",
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
    policy: str = TARGET_POLICY  # the policy family the target is about
    worst_prior: str = ""  # the variant label behind the worst value
    # (scenario id, variant label whose value is the one in ``values``): the worst prior.
    priors: tuple[tuple[str, str], ...] = ()


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
        "family": label.split("@", 1)[0],
        "prior": s.get("prior", "exact"),
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
        "kv_token_capacity": s.get("kv_token_capacity"),
        "retractions": s.get("retractions"),
        "tier_switches": s.get("tier_switches"),
        "decisions": s.get("decisions"),
        "table_changes": changes,
        "table_changes_per_min": (
            changes / (duration / 60.0) if changes is not None and duration else None
        ),
        "mean_decide_ms": s.get("mean_decide_ms"),
        "restart_recommended": _restart_label(s),
        "restart_predicted_gain": (s.get("restart_recommendation") or {}).get("predicted_gain"),
        "restart_metric": s.get("restart_metric"),
        "wall_s": s.get("wall_s"),
    }


def _restart_label(summary: Mapping[str, Any]) -> str | None:
    """The configuration the run's restart check recommends, "-" when it stayed silent,
    None when no check ran."""
    if "restart_recommendation" not in summary:
        return None
    rec = summary["restart_recommendation"]
    return "-" if rec is None else str(rec["configuration"]["label"])


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


def build_rows(
    scenarios: Sequence[Scenario],
    results: Sequence[RunResult],
    labels: Sequence[str] = POLICY_LABELS,
) -> list[dict[str, Any]]:
    """Table rows in scenario order, policies in ``labels`` order (others after, by name),
    the two hindsight rows after the statics."""
    by_scenario: dict[str, dict[str, RunResult]] = {}
    for r in results:
        by_scenario.setdefault(r.scenario_id, {})[r.policy] = r
    rows: list[dict[str, Any]] = []
    order = {p: i for i, p in enumerate(labels)}
    for sc in scenarios:
        runs = by_scenario.get(sc.id)
        if not runs:
            continue
        ordered = sorted(runs, key=lambda p: (order.get(p, len(order)), p))
        sc_rows = [_row(sc, label, runs[label]) for label in ordered]
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
    oracle["family"] = ORACLE
    oracle["wall_s"] = None
    phase = per_phase_oracle(sc, runs)
    if phase is None:
        per_phase = dict(
            oracle, policy=PHASE_ORACLE, family=PHASE_ORACLE, resolved=f"{best} (no phases)"
        )
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
            family=PHASE_ORACLE,
            prior="exact",
            resolved=" ".join(f"{ph}={p}" for ph, p in choice.items()),
            goodput_tok_s=good_tokens / duration if duration > 0 else None,
            duration_s=duration,
        )
    return [oracle, per_phase]


def _with_ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    ema = next((r for r in rows if r["policy"] == EMA), None)
    none = next((r for r in rows if r["policy"] == "none"), None)
    clair = next((r for r in rows if r["policy"] == CLAIRVOYANT), None)
    informed = next((r for r in rows if r["policy"] == INFORMED), None)
    top: tuple[float, str] | None = None
    if none is not None and clair is not None:
        # The fleet ceiling: the clairvoyant oracle, or none where none beats it.
        top = ceiling(float(none["goodput_tok_s"]), float(clair["goodput_tok_s"]))
    for r in rows:
        if ema is not None:
            r["throughput_vs_ema"] = _ratio(r["throughput_tok_s"], ema["throughput_tok_s"])
            r["goodput_vs_ema"] = _ratio(r["goodput_tok_s"], ema["goodput_tok_s"])
        if none is None:
            continue
        for col, metric, oracle in (
            ("oracle_share", "goodput_tok_s", clair),
            ("informed_share", "goodput_tok_s", informed),
            ("oracle_share_throughput", "throughput_tok_s", clair),
        ):
            if oracle is not None:
                r[col] = oracle_share(r[metric], none[metric], oracle[metric])
        if top is not None:
            r["fleet_ceiling"] = CLAIRVOYANT if top[1] == "oracle" else "none"
            r["vs_fleet_ceiling"] = _ratio(r["goodput_tok_s"], top[0])
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


@dataclass(frozen=True)
class TargetDef:
    """One target: the ratio of ``family``'s goodput to ``reference``'s (or its table
    changes per minute when ``reference`` is None) over the scenarios tagged ``tags``."""

    key: str
    description: str
    threshold: float
    family: str
    reference: str | None
    tags: frozenset[str] | None
    higher_is_better: bool = True
    fmt: str = "{:.3f}"

    def value(self, label: str) -> Callable[[Mapping[str, dict[str, Any]]], float | None]:
        if self.reference is None:
            return _changes(label)
        return _vs(label, self.reference)


TARGETS: tuple[TargetDef, ...] = (
    TargetDef(
        "vs_ema_all",
        "goodput ratio vs sglang-ema, every scenario",
        0.99,
        TARGET_POLICY,
        EMA,
        None,
    ),
    TargetDef(
        "vs_ema_phase_high_load",
        "goodput ratio vs sglang-ema, phase-shift and high-load scenarios",
        1.10,
        TARGET_POLICY,
        EMA,
        frozenset({"phase_shift", "high_load"}),
    ),
    TargetDef(
        "vs_per_phase_oracle",
        "goodput ratio vs per-phase best static in hindsight, every scenario",
        0.97,
        TARGET_POLICY,
        PHASE_ORACLE,
        None,
    ),
    TargetDef(
        "vs_none_saturation",
        "goodput ratio vs none (no speculation), saturation scenarios",
        0.98,
        TARGET_POLICY,
        "none",
        frozenset({"saturation"}),
    ),
    TargetDef(
        "vs_best_static_one_user",
        "goodput ratio vs best static in hindsight, one user",
        0.98,
        TARGET_POLICY,
        ORACLE,
        frozenset({"one_user"}),
    ),
    *(
        TargetDef(
            f"changes_per_min_steady_{policy}",
            f"{policy}: table changes per simulated minute, steady load",
            MAX_CHANGES_PER_MIN,
            policy,
            None,
            frozenset({"steady"}),
            higher_is_better=False,
            fmt="{:.2f}",
        )
        for policy in ("goodput", "bandit")
    ),
)


def variants_of(rows: Sequence[dict[str, Any]], family: str) -> list[str]:
    """Labels of ``family``'s runs in the rows (``goodput``, ``goodput@x0.7``, ...)."""
    return list(dict.fromkeys(r["policy"] for r in rows if r.get("family") == family))


def _evaluate(
    t: TargetDef,
    rows: Sequence[dict[str, Any]],
    scenarios: Sequence[Scenario],
    labels: Sequence[str],
) -> TargetResult:
    """``t`` with, per scenario, the worst value over ``labels`` (the worst prior)."""
    worst: dict[str, tuple[float, str]] = {}
    for label in labels:
        for sc_id, v in _scope_values(rows, scenarios, label, t.value(label), t.tags):
            cur = worst.get(sc_id)
            if cur is None or (v < cur[0] if t.higher_is_better else v > cur[0]):
                worst[sc_id] = (v, label)
    order = [sc.id for sc in scenarios if sc.id in worst]
    base = _target(
        t.key,
        t.description,
        t.threshold,
        [(sc_id, worst[sc_id][0]) for sc_id in order],
        higher_is_better=t.higher_is_better,
        fmt=t.fmt,
    )
    priors = tuple((sc_id, worst[sc_id][1]) for sc_id in order)
    return dataclasses.replace(
        base,
        policy=t.family,
        worst_prior=worst[base.worst][1] if base.worst else "",
        priors=priors,
    )


def evaluate_targets(
    rows: Sequence[dict[str, Any]], scenarios: Sequence[Scenario]
) -> list[TargetResult]:
    """The targets for the worst prior: per scenario, the worst value over every variant
    of the target's policy in the rows (exact, wrong step-cost and acceptance priors)."""
    return [_evaluate(t, rows, scenarios, variants_of(rows, t.family)) for t in TARGETS]


def targets_per_prior(
    rows: Sequence[dict[str, Any]], scenarios: Sequence[Scenario]
) -> dict[str, list[TargetResult]]:
    """Variant suffix ("exact", "x0.7", ...) -> the targets for that one variant."""
    out: dict[str, list[TargetResult]] = {}
    for label in variants_of(rows, TARGET_POLICY):
        suffix = label.split("@", 1)[1] if "@" in label else "exact"
        results = []
        for t in TARGETS:
            own = f"{t.family}@{suffix}" if suffix != "exact" else t.family
            results.append(_evaluate(t, rows, scenarios, [own]))
        out[suffix] = results
    return out


# The reference row of each target, for the causes of a miss.
_REFERENCE_OF = {t.key: t.reference for t in TARGETS}


def _cause(
    t: TargetResult,
    table: Mapping[str, dict[str, Any]],
    label: str,
    threshold: float,
) -> str:
    """A computed diagnosis of one miss (several may apply; the first is the main one)."""
    row = table[label]
    ref_name = _REFERENCE_OF.get(t.key)
    causes: list[str] = []
    if ref_name is None:
        minutes = (row.get("duration_s") or 0.0) / 60.0
        return (
            f"churn: {row.get('table_changes')} table changes in {minutes:.1f} simulated min "
            f"({row.get('decisions')} decisions)"
        )
    ema = table.get(EMA, {}).get("goodput_tok_s")
    clair = table.get(CLAIRVOYANT, {}).get("goodput_tok_s")
    if ref_name == EMA:
        phase = _ratio(table.get(PHASE_ORACLE, {}).get("goodput_tok_s"), ema)
        clair_vs = _ratio(clair, ema)
        if clair_vs is not None and clair_vs < threshold:
            causes.append(f"no headroom: the clairvoyant oracle reaches only {clair_vs:.3f}x")
        elif phase is not None and phase < threshold:
            causes.append(
                f"little headroom for a step table: per-phase best static {phase:.3f}x"
                + (f" (clairvoyant {clair_vs:.3f}x)" if clair_vs is not None else "")
            )
    exact = table.get(t.policy)
    if label != t.policy and exact is not None:
        v_exact = _ratio(exact["goodput_tok_s"], table.get(ref_name, {}).get("goodput_tok_s"))
        if v_exact is not None and v_exact >= threshold:
            causes.append(f"wrong prior {row.get('prior')}: the exact prior gives {v_exact:.3f}")
        elif v_exact is not None:
            causes.append(f"misses with the exact prior too ({v_exact:.3f})")
    ref = table.get(ref_name, {})
    kv, kv_ref = row.get("kv_token_capacity"), ref.get("kv_token_capacity")
    retr, retr_ref = row.get("retractions") or 0, ref.get("retractions") or 0
    ttft, ttft_ref = row.get("ttft_p99_ms"), ref.get("ttft_p99_ms")
    queued = retr > retr_ref or (ttft and ttft_ref and ttft > 1.1 * ttft_ref)
    if kv and kv_ref and kv < 0.97 * kv_ref and queued:
        causes.append(
            f"smaller KV pool (8 captured step graphs): {kv:,} vs {kv_ref:,} tokens, "
            f"{row.get('retractions')} vs {ref.get('retractions')} retractions"
        )
    tpot, tpot_ref = row.get("tpot_p50_ms"), ref.get("tpot_p50_ms")
    if tpot and tpot_ref and tpot > 1.03 * tpot_ref:
        causes.append(f"slower decode: TPOT p50 {tpot:.2f} vs {tpot_ref:.2f} ms")
    att, att_ref = row.get("slo_attainment"), ref.get("slo_attainment")
    if att is not None and att_ref is not None and att < att_ref - 0.01:
        causes.append(f"SLO attainment {att:.3f} vs {att_ref:.3f}")
    # Always: how the steps differed (accept length rises with the steps used).
    acc, acc_ref = row.get("mean_accept_length"), ref.get("mean_accept_length")
    causes.append(
        f"accept length {_fmt(acc, 2)} vs {_fmt(acc_ref, 2)} ({ref_name}), "
        f"mean decode batch {_fmt(row.get('mean_decode_batch_size'))} vs "
        f"{_fmt(ref.get('mean_decode_batch_size'))}"
    )
    return "; ".join(causes)


def misses(
    rows: Sequence[dict[str, Any]],
    scenarios: Sequence[Scenario],
    targets: Sequence[TargetResult],
) -> list[dict[str, Any]]:
    """Every (target, scenario) the worst prior misses, with the variant and a cause."""
    by: dict[str, dict[str, dict[str, Any]]] = {}
    for r in rows:
        by.setdefault(r["scenario"], {})[r["policy"]] = r
    defs = {t.key: t for t in TARGETS}
    out: list[dict[str, Any]] = []
    for t in targets:
        d = defs.get(t.key)
        if d is None:
            continue
        prior_of = dict(t.priors)
        for sc_id, v in t.values:
            ok = v >= d.threshold if d.higher_is_better else v <= d.threshold
            if ok:
                continue
            label = prior_of.get(sc_id, d.family)
            table = by[sc_id]
            out.append(
                {
                    "target": t.key,
                    "description": t.description,
                    "threshold": t.threshold,
                    "scenario": sc_id,
                    "value": v,
                    "worst_prior": label,
                    "prior": table[label].get("prior"),
                    "cause": _cause(t, table, label, d.threshold),
                }
            )
    return out


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
        where = ", ".join(x for x in (t.worst, t.worst_prior) if x)
        body.append(
            [
                t.description,
                t.threshold,
                _fmt(t.measured, digits) + (f" ({where})" if where else ""),
                f"{t.passed}/{t.total}",
                f"**{t.status}**",
            ]
        )
    return _table(
        ["target", "threshold", "measured (worst; where, prior)", "scenarios met", "result"],
        body,
    )


def render_targets_per_prior(per_prior: Mapping[str, Sequence[TargetResult]]) -> list[str]:
    """Targets (rows) x prior variant (columns): the worst value and PASS/MISS."""
    if not per_prior:
        return []
    names = list(per_prior)
    keys = [t.key for t in next(iter(per_prior.values()))]
    body = []
    for i, key in enumerate(keys):
        first = per_prior[names[0]][i]
        cells = [f"{first.description} ({first.threshold})"]
        for n in names:
            t = per_prior[n][i]
            digits = 2 if key.startswith("changes") else 3
            cells.append("-" if t.status == "N/A" else f"{_fmt(t.measured, digits)} {t.status}")
        body.append(cells)
    return _table(["target", *names], body)


# Policies whose oracle shares are tabulated (the worst-prior goodput is added).
SHARE_POLICIES = (EMA, ORACLE, PHASE_ORACLE, INFORMED, "batch-table", "goodput", "bandit")
# The share columns: (row key, the oracle it is a share of).
SHARE_COLUMNS = (("oracle_share", CLAIRVOYANT), ("informed_share", INFORMED))


def render_oracle_shares(
    rows: Sequence[dict[str, Any]],
    scenarios: Sequence[Scenario],
    targets: Sequence[TargetResult],
) -> list[str]:
    """Per scenario: each oracle's gain over none, the fleet ceiling, and each policy's
    share of each oracle's gain ("clairvoyant / informed"); median and min per policy."""
    by: dict[str, dict[str, dict[str, Any]]] = {}
    for r in rows:
        by.setdefault(r["scenario"], {})[r["policy"]] = r
    ran = [s for s in scenarios if s.id in by and CLAIRVOYANT in by[s.id]]
    if not ran:
        return []
    worst_prior = {}
    head = next((t for t in targets if t.key == "vs_ema_all"), None)
    if head is not None:
        worst_prior = dict(head.priors)
    pols = [p for p in SHARE_POLICIES if any(p in by[s.id] for s in ran)]
    names = [*pols, "goodput (worst prior)"]
    shares: dict[tuple[str, str], list[float]] = {
        (p, c): [] for p in names for c, _ in SHARE_COLUMNS
    }
    body = []
    for sc in ran:
        t = by[sc.id]
        none = t.get("none", {}).get("goodput_tok_s")
        cells = [sc.id]
        for _, oracle in SHARE_COLUMNS:
            cells.append(_fmt(_ratio(t.get(oracle, {}).get("goodput_tok_s"), none), 3))
        goodput_row = t.get(TARGET_POLICY, {})
        top = goodput_row.get("fleet_ceiling")
        cells.append(
            "-"
            if top is None
            else f"{top}: goodput {_fmt(goodput_row.get('vs_fleet_ceiling'), 3)}x"
            + (" (restart plain)" if top == "none" else "")
        )
        label = worst_prior.get(sc.id)
        for p in names:
            row = t.get(label, {}) if p == "goodput (worst prior)" and label else t.get(p, {})
            vals = []
            for col, _ in SHARE_COLUMNS:
                v = row.get(col)
                vals.append(_fmt(v, 2))
                if v is not None:
                    shares[(p, col)].append(v)
            cell = " / ".join(vals)
            if p == "goodput (worst prior)" and label:
                cell += f" ({label})"
            cells.append(cell)
        body.append(cells)
    for name, fn in (("median", np.median), ("min", np.min)):
        body.append(
            [
                f"**{name}**",
                "",
                "",
                "",
                *(
                    " / ".join(
                        _fmt(float(fn(shares[(p, c)])), 2) if shares[(p, c)] else "-"
                        for c, _ in SHARE_COLUMNS
                    )
                    for p in names
                ),
            ]
        )
    head_cells = ["scenario", "oracle / none", "informed / none", "fleet ceiling"]
    return _table([*head_cells, *names], body)


# The restart recommendation fires where restarting gains at least this (issue 20 §4),
# over a run at least the recommendation's sustained window long (SUSTAINED_S)...
RESTART_MIN_GAIN = 0.10
# ...and its predicted gain is within this fraction of the gain measured by replaying it.
RESTART_TOLERANCE = 0.25


def restart_checks(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per scenario with a restart check of the target policy: what it recommended, the
    predicted gain, the gain measured by replaying the plain server (none) on the same
    trace, and whether it fired where it should and predicted within the tolerance."""
    by: dict[str, dict[str, dict[str, Any]]] = {}
    for r in rows:
        by.setdefault(r["scenario"], {})[r["policy"]] = r
    out = []
    for sc, t in by.items():
        g, none = t.get(TARGET_POLICY), t.get("none")
        if g is None or none is None or g.get("restart_recommended") is None:
            continue
        # Measured on the metric the check predicted on (throughput for a saturated window).
        # A TPOT p50 tie-break (rates within 1 %) is judged on TPOT p50: less is better.
        metric = g.get("restart_metric") or "goodput_tok_s"
        if metric == "tpot_p50_ms":
            measured = _ratio(g.get(metric), none.get(metric))
        else:
            measured = _ratio(none.get(metric), g.get(metric))
        gain = None if measured is None else measured - 1.0
        fired = g["restart_recommended"] != "-"
        # A run shorter than the recommendation's sustained window is a burst, not a regime
        # (issue 20 §4: minutes): silence is right there whatever the plain server gains.
        duration = g.get("duration_s")
        burst = duration is not None and float(duration) < SUSTAINED_S
        should = gain is not None and gain >= RESTART_MIN_GAIN and not burst
        pred = g.get("restart_predicted_gain")
        within = None
        if (
            fired
            and gain is not None
            and pred is not None
            and g["restart_recommended"] == ("no speculation")
        ):
            within = abs(pred - gain) <= RESTART_TOLERANCE * abs(gain)
        out.append(
            {
                "scenario": sc,
                "recommended": g["restart_recommended"],
                "predicted_gain": pred,
                "metric": metric,
                "measured_plain_gain": gain,
                "should_fire": should,
                "burst": burst,
                "right": fired == should,
                "within_tolerance": within,
            }
        )
    return out


def render_restart_checks(checks: Sequence[Mapping[str, Any]]) -> list[str]:
    if not checks:
        return []
    body = [
        [
            c["scenario"],
            c["metric"],
            c["recommended"],
            _fmt(c["predicted_gain"], 3),
            _fmt(c["measured_plain_gain"], 3),
            "yes" if c["should_fire"] else "no (burst)" if c.get("burst") else "no",
            "ok" if c["right"] else "WRONG",
            "-" if c["within_tolerance"] is None else "yes" if c["within_tolerance"] else "no",
        ]
        for c in checks
    ]
    right = sum(1 for c in checks if c["right"])
    judged = [c for c in checks if c["within_tolerance"] is not None]
    within = sum(1 for c in judged if c["within_tolerance"])
    body.append(
        [
            "**total**",
            "",
            "",
            "",
            "",
            "",
            f"{right}/{len(checks)} right",
            f"{within}/{len(judged)} within {RESTART_TOLERANCE:.0%}",
        ]
    )
    head = [
        "scenario",
        "metric",
        "recommended",
        "predicted",
        "measured (none)",
        "should fire",
        "fired?",
    ]
    return _table([*head, f"within {RESTART_TOLERANCE:.0%}"], body)


# Policies whose tier switches are tabulated.
SWITCH_POLICIES = (EMA, "batch-table", "goodput", "bandit", CLAIRVOYANT, INFORMED)


def render_tier_switches(
    rows: Sequence[dict[str, Any]], scenarios: Sequence[Scenario]
) -> list[str]:
    """Per scenario: each policy's tier switches, and goodput's over sglang-ema's."""
    by: dict[str, dict[str, dict[str, Any]]] = {}
    for r in rows:
        by.setdefault(r["scenario"], {})[r["policy"]] = r
    ran = [s for s in scenarios if s.id in by]
    pols = [p for p in SWITCH_POLICIES if any(p in by[s.id] for s in ran)]
    if not pols:
        return []
    body = []
    for sc in ran:
        t = by[sc.id]
        counts = [t.get(p, {}).get("tier_switches") for p in pols]
        ratio = _ratio(
            t.get(TARGET_POLICY, {}).get("tier_switches"), t.get(EMA, {}).get("tier_switches")
        )
        body.append([sc.id, *(_fmt(c) for c in counts), _fmt(ratio, 2)])
    return _table(["scenario", *pols, "goodput / ema"], body)


def median_shares(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """Per policy label, the median share of each oracle's gain over the scenarios where
    it is defined (the headline: ``{"oracle": ..., "oracle:informed": ...}``)."""
    out: dict[str, dict[str, float | None]] = {}
    labels = dict.fromkeys(r["policy"] for r in rows)
    for label in labels:
        entry: dict[str, float | None] = {}
        for col, oracle in SHARE_COLUMNS:
            vals = [r[col] for r in rows if r["policy"] == label and r.get(col) is not None]
            entry[oracle] = float(np.median(vals)) if vals else None
        out[label] = entry
    return out


def prior_sensitivity(rows: Sequence[dict[str, Any]]) -> dict[str, tuple[int, int]]:
    """Family -> (scenarios where every wrong-prior run equals the exact run, scenarios
    with variants): a policy the prior does not reach shows n/n."""
    by: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        if r.get("family") in DAEMON_POLICIES:
            by.setdefault((r["scenario"], r["family"]), []).append(r)
    out: dict[str, tuple[int, int]] = {}
    keys = ("throughput_tok_s", "goodput_tok_s", "table_changes", "tpot_p50_ms")
    for (_, family), group in by.items():
        if len(group) < 2:
            continue
        same = len({tuple(r.get(k) for k in keys) for r in group}) == 1
        a, b = out.get(family, (0, 0))
        out[family] = (a + int(same), b + 1)
    return out


def render_misses(missed: Sequence[Mapping[str, Any]]) -> list[str]:
    if not missed:
        return ["No target missed."]
    body = [
        [
            m["target"],
            m["scenario"],
            _fmt(m["value"], 2 if m["target"].startswith("changes") else 3),
            m["threshold"],
            f"{m['worst_prior']} ({m['prior']})",
            m["cause"],
        ]
        for m in missed
    ]
    return _table(["target", "scenario", "value", "threshold", "worst prior", "cause"], body)


def render_markdown(
    rows: Sequence[dict[str, Any]],
    targets: Sequence[TargetResult],
    scenarios: Sequence[Scenario],
    meta: Mapping[str, str],
    phase_table: Sequence[dict[str, Any]] = (),
    *,
    per_prior: Mapping[str, Sequence[TargetResult]] | None = None,
    misses: Sequence[Mapping[str, Any]] = (),
) -> str:
    lines = ["# Policy benchmark", ""]
    lines += [f"- {k}: {v}" for k, v in meta.items()]
    lines += [
        "",
        "## Targets (worst prior)",
        "",
        "Per scenario the worst value over every prior variant the policy ran with "
        "(exact, wrong step-cost priors, other acceptance priors); the variant behind the "
        "worst value is named.",
        "",
    ]
    lines += render_targets(targets)
    if per_prior:
        lines += ["", "## Targets per prior", ""]
        lines += render_targets_per_prior(per_prior)
    sens = prior_sensitivity(rows)
    if sens:
        lines += [
            "",
            "Runs identical to the exact prior under every prior variant (the prior does "
            "not reach the policy where this is all scenarios): "
            + ", ".join(f"{f} {a}/{b} scenarios" for f, (a, b) in sorted(sens.items()))
            + ".",
        ]
    lines += ["", "## Misses (worst prior) and their causes", ""]
    lines += render_misses(misses)
    shares = render_oracle_shares(rows, scenarios, targets)
    if shares:
        lines += [
            "",
            "## Share of the oracles' gain over none (goodput): clairvoyant / informed",
            "",
            "(policy - none) / (oracle - none) on goodput, for the clairvoyant oracle (knows "
            "each request's next acceptance draw) / the informed one (knows each request's "
            "acceptance distribution: what a realisable per-batch policy could reach); '-' "
            f"where the oracle gains less than {MIN_ORACLE_GAIN:.0%} over none. The oracles "
            "maximise tokens per second per batch, not goodput, so a share can exceed 1. "
            "Fleet ceiling: max(clairvoyant oracle, none) and goodput's ratio to it; where it "
            "is none, no step table gets there (step 0 still pays the drafter), a restart "
            "without speculation does.",
            "",
        ]
        lines += shares
    restart = render_restart_checks(restart_checks(rows))
    if restart:
        lines += [
            "",
            "## Restart recommendation (goodput, exact prior)",
            "",
            "What the daemon's restart check (controller.recommend: the recent window "
            "replayed over candidate shapes, the table in force as the baseline) recommends "
            "from each run, its predicted gain, and the gain measured by the plain server "
            "(none) on the same trace, both on the run's metric (throughput for a window "
            "judged saturated: queued, or a closed population; else goodput; TPOT p50 for a "
            f"tie). It should fire where that is >= "
            f"{RESTART_MIN_GAIN:.0%} and stay silent elsewhere; a no-speculation prediction "
            f"should be within {RESTART_TOLERANCE:.0%} of the measured gain.",
            "",
        ]
        lines += restart
    switches = render_tier_switches(rows, scenarios)
    if switches:
        lines += [
            "",
            "## Tier switches (changes of the step count in the engine)",
            "",
            "Per scenario and policy; the last column is goodput's count over sglang-ema's "
            "(issue 20's bound: <= 3x). The simulator charges each switch the drafter "
            "catalog's tier_switch_ms (this run: see the meta line).",
            "",
        ]
        lines += switches
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

    daemon = [p for p in policies if p.split("@", 1)[0] in DAEMON_POLICIES]
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
    """One scenario's time series via specgov.simulator.replay.plots (one PNG per policy + all)."""
    folder = out_dir / re.sub(r"[^A-Za-z0-9_.-]+", "_", scenario_id)
    return write_plots(series, folder)
