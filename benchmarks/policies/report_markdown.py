"""The policy benchmark's markdown report (README.md of a run), rendered from the rows and
targets ``report.py`` computes; nothing here computes a number of its own."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from benchmarks.policies.report import (
    ORACLE,
    PHASE_ORACLE,
    RESTART_MIN_GAIN,
    RESTART_TOLERANCE,
    SHARE_COLUMNS,
    TARGET_POLICY,
    TargetResult,
    fmt_cell,
    prior_sensitivity,
    ratio,
    restart_checks,
)
from benchmarks.policies.scenarios import CLAIRVOYANT, DAEMON_POLICIES, EMA, INFORMED, Scenario
from specgov.simulator.replay.oracle import MIN_ORACLE_GAIN


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
                fmt_cell(t.measured, digits) + (f" ({where})" if where else ""),
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
            cells.append("-" if t.status == "N/A" else f"{fmt_cell(t.measured, digits)} {t.status}")
        body.append(cells)
    return _table(["target", *names], body)


# Policies whose oracle shares are tabulated (the worst-prior goodput is added).
SHARE_POLICIES = (EMA, ORACLE, PHASE_ORACLE, INFORMED, "batch-table", "goodput", "bandit")


# The share columns: (row key, the oracle it is a share of).


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
            cells.append(fmt_cell(ratio(t.get(oracle, {}).get("goodput_tok_s"), none), 3))
        goodput_row = t.get(TARGET_POLICY, {})
        top = goodput_row.get("fleet_ceiling")
        cells.append(
            "-"
            if top is None
            else f"{top}: goodput {fmt_cell(goodput_row.get('vs_fleet_ceiling'), 3)}x"
            + (" (restart plain)" if top == "none" else "")
        )
        label = worst_prior.get(sc.id)
        for p in names:
            row = t.get(label, {}) if p == "goodput (worst prior)" and label else t.get(p, {})
            vals = []
            for col, _ in SHARE_COLUMNS:
                v = row.get(col)
                vals.append(fmt_cell(v, 2))
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
                        fmt_cell(float(fn(shares[(p, c)])), 2) if shares[(p, c)] else "-"
                        for c, _ in SHARE_COLUMNS
                    )
                    for p in names
                ),
            ]
        )
    head_cells = ["scenario", "oracle / none", "informed / none", "fleet ceiling"]
    return _table([*head_cells, *names], body)


def render_restart_checks(checks: Sequence[Mapping[str, Any]]) -> list[str]:
    if not checks:
        return []
    body = [
        [
            c["scenario"],
            c["metric"],
            c["recommended"],
            fmt_cell(c["predicted_gain"], 3),
            fmt_cell(c["measured_plain_gain"], 3),
            fmt_cell(c.get("measured_recommended_gain"), 3),
            "yes" if c["should_fire"] else "no (burst)" if c.get("burst") else "no",
            "-" if c["right"] is None else "ok" if c["right"] else "WRONG",
            "-" if c["within_tolerance"] is None else "yes" if c["within_tolerance"] else "no",
            "-" if c.get("triggered_s") is None else f"{c['triggered_s']:.0f}",
        ]
        for c in checks
    ]
    right = sum(1 for c in checks if c["right"])
    judged_right = [c for c in checks if c["right"] is not None]
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
            "",
            f"{right}/{len(judged_right)} right",
            f"{within}/{len(judged)} within {RESTART_TOLERANCE:.0%}",
            "",
        ]
    )
    head = [
        "scenario",
        "metric",
        "recommended",
        "predicted",
        "measured (none)",
        "measured (recommended)",
        "should fire (none)",
        "right?",
    ]
    # The policy's trigger (goodput's, when it first asked for the check) predicts nothing:
    # in the daemon it only brings the scheduled check forward.
    return _table([*head, f"within {RESTART_TOLERANCE:.0%}", "policy trigger (s)"], body)


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
        over_ema = ratio(
            t.get(TARGET_POLICY, {}).get("tier_switches"), t.get(EMA, {}).get("tier_switches")
        )
        body.append([sc.id, *(fmt_cell(c) for c in counts), fmt_cell(over_ema, 2)])
    return _table(["scenario", *pols, "goodput / ema"], body)


def render_misses(missed: Sequence[Mapping[str, Any]]) -> list[str]:
    if not missed:
        return ["No target missed."]
    body = [
        [
            m["target"],
            m["scenario"],
            fmt_cell(m["value"], 2 if m["target"].startswith("changes") else 3),
            m["threshold"],
            f"{m['worst_prior']} ({m['prior']})",
            m["cause"],
        ]
        for m in missed
    ]
    return _table(["target", "scenario", "value", "threshold", "worst prior", "cause"], body)


def _section(title: str, intro: str, body: Sequence[str]) -> list[str]:
    """A report section: heading, one explaining paragraph, its table (nothing when the
    table is empty)."""
    return ["", f"## {title}", "", intro, "", *body] if body else []


def _target_sections(
    rows: Sequence[dict[str, Any]],
    targets: Sequence[TargetResult],
    per_prior: Mapping[str, Sequence[TargetResult]] | None,
    misses: Sequence[Mapping[str, Any]],
) -> list[str]:
    lines = [
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
    return lines + render_misses(misses)


def _ceiling_sections(
    rows: Sequence[dict[str, Any]],
    targets: Sequence[TargetResult],
    scenarios: Sequence[Scenario],
) -> list[str]:
    """The oracles' shares, the restart check and the tier switches, each explained."""
    lines = _section(
        "Share of the oracles' gain over none (goodput): clairvoyant / informed",
        "(policy - none) / (oracle - none) on goodput, for the clairvoyant oracle (knows "
        "each request's next acceptance draw) / the informed one (knows each request's "
        "acceptance distribution: what a realisable per-batch policy could reach); '-' "
        f"where the oracle gains less than {MIN_ORACLE_GAIN:.0%} over none. The oracles "
        "maximise tokens per second per batch, not goodput, so a share can exceed 1. "
        "Fleet ceiling: max(clairvoyant oracle, none) and goodput's ratio to it; where it "
        "is none, no step table gets there (step 0 still pays the drafter), a restart "
        "without speculation does.",
        render_oracle_shares(rows, scenarios, targets),
    )
    lines += _section(
        "Restart recommendation (goodput, exact prior)",
        "What the daemon's restart check (controller.recommend: the recent window "
        "replayed over candidate shapes, the table in force as the baseline) recommends "
        "from each run, its predicted gain, and the gain measured by the plain server "
        "(none) on the same trace, both on the run's metric (throughput for a window "
        "judged saturated: queued, or a closed population; else goodput; TPOT p50 for a "
        f"tie). It should fire where that is >= "
        f"{RESTART_MIN_GAIN:.0%} and stay silent elsewhere; a recommendation of another "
        "shape (a tree, other steps) is replayed on the same trace and judged on its own "
        f"gain ('measured (recommended)'); a prediction should be within "
        f"{RESTART_TOLERANCE:.0%} of the gain measured for what it recommends.",
        render_restart_checks(restart_checks(rows)),
    )
    lines += _section(
        "Tier switches (changes of the step count in the engine)",
        "Per scenario and policy; the last column is goodput's count over sglang-ema's "
        "(issue 20's bound: <= 3x). The simulator charges each switch the drafter "
        "catalog's tier_switch_ms (this run: see the meta line).",
        render_tier_switches(rows, scenarios),
    )
    return lines


def _by_scenario(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    by: dict[str, dict[str, dict[str, Any]]] = {}
    for r in rows:
        by.setdefault(r["scenario"], {})[r["policy"]] = r
    return by


def _target_values(
    by: Mapping[str, Mapping[str, dict[str, Any]]], ran: Sequence[Scenario]
) -> list[str]:
    """Per scenario, the goodput policy's ratios behind the targets."""
    lines = [
        "",
        "Per-scenario values behind the targets: goodput policy's goodput ratios, and the "
        "per-phase oracle's ratio to sglang-ema (the headroom any step table had).",
        "",
    ]
    body = []
    for sc in ran:
        t = by[sc.id]
        g = t.get(TARGET_POLICY)
        if g is None:
            continue

        def vs(ref: str, table: Mapping[str, dict[str, Any]] = t, gr: Any = g) -> str:
            ref_row = table.get(ref)
            return fmt_cell(ratio(gr["goodput_tok_s"], ref_row and ref_row["goodput_tok_s"]), 3)

        body.append(
            [
                sc.id,
                ",".join(sorted(sc.tags)) or "-",
                vs(EMA),
                fmt_cell(t.get(PHASE_ORACLE, {}).get("goodput_vs_ema"), 3),
                vs(PHASE_ORACLE),
                vs("none"),
                vs(ORACLE),
                fmt_cell(t.get(ORACLE, {}).get("resolved")),
                fmt_cell(g["table_changes_per_min"], 2),
            ]
        )
    header = [
        "scenario",
        "tags",
        "vs ema",
        "per-phase oracle vs ema",
        "vs per-phase oracle",
        "vs none",
        "vs best static",
        "best static",
        "changes/min",
    ]
    return lines + _table(header, body)


def _policy_tables(
    rows: Sequence[dict[str, Any]],
    by: Mapping[str, Mapping[str, dict[str, Any]]],
    ran: Sequence[Scenario],
) -> list[str]:
    """Goodput over sglang-ema's per policy, and the daemon policies' change rate and cost."""
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    lines = ["", "## Goodput / sglang-ema goodput", ""]
    lines += _table(
        ["scenario", *policies],
        [
            [sc.id, *(fmt_cell(by[sc.id].get(p, {}).get("goodput_vs_ema"), 3) for p in policies)]
            for sc in ran
        ],
    )
    daemon = [p for p in policies if p.split("@", 1)[0] in DAEMON_POLICIES]
    if not daemon:
        return lines

    def cell(sc: Scenario, p: str) -> str:
        row = by[sc.id].get(p, {})
        changes, decide = row.get("table_changes_per_min"), row.get("mean_decide_ms")
        return f"{fmt_cell(changes, 2)} / {fmt_cell(decide, 2)}"

    lines += ["", "## Daemon policies: table changes per minute / mean decide ms", ""]
    return lines + _table(
        ["scenario", *daemon], [[sc.id, *(cell(sc, p) for p in daemon)] for sc in ran]
    )


def _phase_section(phase_table: Sequence[dict[str, Any]]) -> list[str]:
    if not phase_table:
        return []
    lines = [
        "",
        "## Per-phase goodput (tokens of SLO-meeting requests arriving in the "
        "phase / phase length, tok/s)",
        "",
    ]
    phases = list(dict.fromkeys((r["scenario"], r["phase"]) for r in phase_table))
    cell = {(r["scenario"], r["phase"], r["policy"]): r for r in phase_table}
    ppol = list(dict.fromkeys(r["policy"] for r in phase_table))

    def goodput(s: str, ph: str, p: str) -> str:
        return fmt_cell(cell.get((s, ph, p), {}).get("phase_goodput_tok_s"), 0)

    return lines + _table(
        ["scenario", "phase", *ppol],
        [[s, ph, *(goodput(s, ph, p) for p in ppol)] for s, ph in phases],
    )


RESULT_HEADER = (
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
)


def _results_per_scenario(rows: Sequence[dict[str, Any]], ran: Sequence[Scenario]) -> list[str]:
    lines = ["", "## Results per scenario", ""]
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
                    fmt_cell(r["throughput_tok_s"], 0),
                    fmt_cell(r["goodput_tok_s"], 0),
                    fmt_cell(r["tpot_p50_ms"]),
                    fmt_cell(r["tpot_p99_ms"]),
                    fmt_cell(r["ttft_p99_ms"], 0),
                    fmt_cell(r["slo_attainment"], 3),
                    fmt_cell(r["throughput_vs_ema"], 3),
                    fmt_cell(r["goodput_vs_ema"], 3),
                    fmt_cell(r["table_changes_per_min"], 2),
                    fmt_cell(r["mean_decide_ms"], 2),
                ]
            )
        lines += _table(RESULT_HEADER, body)
        lines.append("")
    return lines


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
    """The run's README.md: targets first, then ceilings, then the tables behind them."""
    lines = ["# Policy benchmark", ""]
    lines += [f"- {k}: {v}" for k, v in meta.items()]
    lines += _target_sections(rows, targets, per_prior, misses)
    lines += _ceiling_sections(rows, targets, scenarios)
    by = _by_scenario(rows)
    ran = [s for s in scenarios if s.id in by]
    lines += _target_values(by, ran)
    lines += _policy_tables(rows, by, ran)
    lines += _phase_section(phase_table)
    lines += _results_per_scenario(rows, ran)
    return "\n".join(lines).rstrip() + "\n"
