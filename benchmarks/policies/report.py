"""Rows and targets of the policy benchmark, computed from the run results only (the
markdown report is rendered by report_markdown.py, CSV tables and plots by report_files.py).

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

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

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
from specgov.simulator.replay.oracle import ceiling, oracle_share

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
    "restart_measured_gain",
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


def fmt_cell(v: Any, digits: int = 1) -> str:
    """A table cell: '-' for a missing number, thousands separators."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if isinstance(v, float):
        return f"{v:,.{digits}f}"
    return str(v)


def ratio(a: Any, b: Any) -> float | None:
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
        # The recommended configuration's gain, replayed (run.py), where it is not `none`.
        "restart_measured_gain": (s.get("restart_recommendation") or {}).get("measured_gain"),
        # When goodput's restart trigger first asked for the check (None: never).
        "restart_triggered_s": s.get("restart_triggered_s"),
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
            r["throughput_vs_ema"] = ratio(r["throughput_tok_s"], ema["throughput_tok_s"])
            r["goodput_vs_ema"] = ratio(r["goodput_tok_s"], ema["goodput_tok_s"])
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
            r["vs_fleet_ceiling"] = ratio(r["goodput_tok_s"], top[0])
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
        return ratio(table[policy]["goodput_tok_s"], ref["goodput_tok_s"] if ref else None)

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
        phase = ratio(table.get(PHASE_ORACLE, {}).get("goodput_tok_s"), ema)
        clair_vs = ratio(clair, ema)
        if clair_vs is not None and clair_vs < threshold:
            causes.append(f"no headroom: the clairvoyant oracle reaches only {clair_vs:.3f}x")
        elif phase is not None and phase < threshold:
            causes.append(
                f"little headroom for a step table: per-phase best static {phase:.3f}x"
                + (f" (clairvoyant {clair_vs:.3f}x)" if clair_vs is not None else "")
            )
    exact = table.get(t.policy)
    if label != t.policy and exact is not None:
        v_exact = ratio(exact["goodput_tok_s"], table.get(ref_name, {}).get("goodput_tok_s"))
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
        f"accept length {fmt_cell(acc, 2)} vs {fmt_cell(acc_ref, 2)} ({ref_name}), "
        f"mean decode batch {fmt_cell(row.get('mean_decode_batch_size'))} vs "
        f"{fmt_cell(ref.get('mean_decode_batch_size'))}"
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


# The restart recommendation fires where restarting gains at least this (issue 20 §4),
# over a run at least the recommendation's sustained window long (SUSTAINED_S)...
RESTART_MIN_GAIN = 0.10
# ...and its predicted gain is within this fraction of the gain measured by replaying it.
RESTART_TOLERANCE = 0.25


def restart_checks(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per scenario with a restart check of the target policy: what it recommended, the
    predicted gain, the gain measured by replaying the plain server (none) on the same
    trace and by replaying what it recommended (none, or another shape: run.py replays
    that), whether it was right (fired where the recommended configuration gains
    >= RESTART_MIN_GAIN; silent where plain does not) and predicted within the tolerance."""
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
            measured = ratio(g.get(metric), none.get(metric))
        else:
            measured = ratio(none.get(metric), g.get(metric))
        gain = None if measured is None else measured - 1.0
        fired = g["restart_recommended"] != "-"
        # A run shorter than the recommendation's sustained window is a burst, not a regime
        # (issue 20 §4: minutes): silence is right there whatever the plain server gains.
        duration = g.get("duration_s")
        burst = duration is not None and float(duration) < SUSTAINED_S
        should = gain is not None and gain >= RESTART_MIN_GAIN and not burst
        pred = g.get("restart_predicted_gain")
        # What the recommended configuration gained when replayed: the plain run for no
        # speculation, else its own replay (run.py); None where it was not replayed.
        plain = g["restart_recommended"] == "no speculation"
        rec_gain = gain if plain else g.get("restart_measured_gain")
        # A fired recommendation is right where its configuration gains >= RESTART_MIN_GAIN
        # (another shape may gain where plain does not), unjudged (None) where it was not
        # replayed; silence is judged against the plain server only (a tree that would
        # have gained is not replayed unless recommended).
        right: bool | None
        if fired:
            right = None if rec_gain is None else rec_gain >= RESTART_MIN_GAIN
        else:
            right = not should
        within = None
        if fired and rec_gain is not None and pred is not None:
            within = abs(pred - rec_gain) <= RESTART_TOLERANCE * abs(rec_gain)
        out.append(
            {
                "scenario": sc,
                "recommended": g["restart_recommended"],
                "predicted_gain": pred,
                "metric": metric,
                "measured_plain_gain": gain,
                "measured_recommended_gain": rec_gain,
                "should_fire": should,
                "burst": burst,
                "right": right,
                "within_tolerance": within,
                "triggered_s": g.get("restart_triggered_s"),
            }
        )
    return out


# The oracle-share columns of a row and the oracle each is measured against.
SHARE_COLUMNS = (("oracle_share", CLAIRVOYANT), ("informed_share", INFORMED))


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
