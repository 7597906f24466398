"""Policy benchmark: every step policy on every scenario, closed loop, one command.

    python benchmarks/policies/run.py [--out DIR] [--quick] [--jobs N] [--scenarios PAT ...]

Writes into DIR (default out/policies/, git-ignored): results.csv, results.md,
phases.csv, results.json (full summaries, steps per slot, the daemons' decision reasons
and table changes) and plots/ (goodput ratio heat map, one phase scenario's time
series); prints the markdown at the end. See README.md in this folder.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import shlex
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    # Run as a script: make the repository root importable for `benchmarks.policies`.
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


from benchmarks.policies import report, report_files, report_markdown
from benchmarks.policies.scenarios import (
    ACCEPT_PRIORS,
    DAEMON_POLICIES,
    ORACLES,
    POLICIES,
    PRIORS_BY_NAME,
    STATIC_POLICIES,
    PolicyRun,
    Scenario,
    ScenarioError,
    build_requests,
    default_data_dir,
    missing_inputs,
    select,
    suite_runs,
)
from specgov.controller.daemon.recommend import candidate_server
from specgov.controller.daemon.replay_check import measured_gain, replay_restart_check
from specgov.simulator.replay.metrics import Slo, good_tokens_by_window, summarise
from specgov.simulator.replay.runner import PolicyRun as ReplayRun
from specgov.simulator.replay.runner import parse_policy, prepare_run

DEFAULT_OUT = Path("out/policies")


@dataclass(frozen=True)
class Job:
    scenario: Scenario
    run: PolicyRun
    data_dir: Path
    seed: int
    slo: Slo
    keep_series: bool
    tier_switch_ms: float | None = None  # None: the catalog's (0 built in)
    restart_check: bool = False  # the restart recommendation of this (daemon) run


def run_job(job: Job) -> report.RunResult:
    """Replay one scenario under one policy (a worker process calls this)."""
    sc = job.scenario
    requests = build_requests(sc.workload, job.data_dir)
    policy = parse_policy(job.run.spec)
    server = job.run.prior.apply(sc.server())
    if job.tier_switch_ms is not None:
        server = replace(server, tier_switch_ms=job.tier_switch_ms)
    prepared = prepare_run(server, policy, seed=job.seed, slo=job.slo)
    started = time.perf_counter()
    result = prepared.run(requests, concurrency=sc.workload.concurrency)
    wall = time.perf_counter() - started
    summary = summarise(policy.name, result, job.slo)
    summary["wall_s"] = wall
    summary["prior"] = _prior_text(job.run, server)
    reasons: dict[str, int] = {}
    changes: list[dict[str, Any]] = []
    if job.restart_check and prepared.loop is not None:
        # What the daemon would recommend from this run's window (controller.recommend,
        # as `specgov replay --output json` reports it); measured against none in report.
        replay_restart_check(
            [ReplayRun(policy, result, prepared.memory, summary, wall, prepared.loop)],
            requests,
            gpu=server.gpu,
            model=server.model,
            drafter=server.drafter,
            slo_tpot_ms=job.slo.tpot_ms,
            seed=job.seed,
            topk=server.topk,
            num_draft_tokens=server.num_draft_tokens,
        )
        _measure_recommendation(summary, server, requests, job)
    if prepared.loop is not None:
        log = prepared.loop.log
        summary["decisions"] = len(log.decisions)
        summary["table_changes"] = log.table_changes
        summary["mean_decide_ms"] = log.mean_decide_ms
        reasons = dict(Counter(d.reason for d in log.decisions))
        changes = [
            {
                "time_s": d.time_s,
                "reason": d.reason,
                "message": d.message,
                "table": None if d.table_after is None else d.table_after.to_dict(),
            }
            for d in log.decisions
            if d.changed
        ]
    # Per-phase accounting: output tokens of SLO-meeting requests, by arrival phase.
    phases = sc.workload.phases()
    phase_tokens = good_tokens_by_window(
        result, job.slo, [(ph.name, ph.start_s, ph.end_s) for ph in phases]
    )
    return report.RunResult(
        scenario_id=sc.id,
        policy=job.run.label,
        summary=summary,
        phase_good_tokens=phase_tokens,
        reason_counts=reasons,
        changes=changes,
        series=result.series if job.keep_series else None,
    )


def _measure_recommendation(
    summary: dict[str, Any], server: Any, requests: Sequence[Any], job: Job
) -> None:
    """A fired recommendation of another speculation shape (a tree, other steps) is
    measured here, by replaying that configuration on the same requests (``measured_gain``
    in the recommendation); no speculation is the suite's own ``none`` run (report.py)."""
    rec = summary.get("restart_recommendation")
    if rec is None or rec["configuration"]["policy"] == "none":
        return
    config = rec["configuration"]
    # As the check replayed the candidate: its shape, initial steps and environment.
    shaped = candidate_server(
        server, int(config["topk"]), int(config["num_draft_tokens"]), config.get("environment")
    )
    policy = parse_policy(str(config["policy"]))
    prepared = prepare_run(shaped, policy, seed=job.seed, slo=job.slo)
    result = prepared.run(requests, concurrency=job.scenario.workload.concurrency)
    rec["measured_gain"] = measured_gain(
        summarise(policy.name, result, job.slo), summary, str(rec["metric"])
    )


def _prior_text(run: PolicyRun, server: Any) -> str:
    """What the run's policy was told: "exact", "x0.7", "gpu=l40s", "prior_mean=0.3"."""
    if run.variant.startswith("accept"):
        return "prior_mean=" + run.spec.split(":prior_mean=", 1)[1]
    if run.prior.other_gpu:
        return f"gpu={getattr(server, 'prior_gpu', '?')}"
    return run.prior.name


def _cost(job: Job) -> float:
    """Rough relative cost, to start the longest jobs first."""
    w = job.scenario.workload
    n = float(w.max_requests or 4000)
    if w.rate_scale > 1 or (w.concurrency or 0) >= 64:
        n *= 1.5
    if job.scenario.gpu != "h100":
        n *= 1.3
    daemon = parse_policy(job.run.spec).daemon_spec is not None
    oracle = job.run.spec in ORACLES
    return n * (4.0 if daemon else 2.5 if oracle else 1.0) * (3.0 if job.restart_check else 1.0)


def plot_scenario(scenarios: Sequence[Scenario]) -> Scenario | None:
    """The phase scenario whose time series is plotted (H100 + EAGLE-3 when present)."""
    phase = [s for s in scenarios if "phase_shift" in s.tags]
    preferred = [s for s in phase if s.gpu == "h100" and s.profile == "eagle3"]
    chosen = preferred or phase
    return chosen[0] if chosen else None


@dataclass
class SuiteOutput:
    rows: list[dict[str, Any]]
    targets: list[report.TargetResult]
    markdown: str
    files: list[Path]
    wall_s: float


def run_suite(
    scenarios: Sequence[Scenario],
    *,
    out_dir: Path,
    jobs: int = 2,
    data_dir: Path | None = None,
    seed: int = 0,
    slo: Slo | None = None,
    policies: Sequence[str] = POLICIES,
    priors: Sequence[str] = tuple(PRIORS_BY_NAME),
    accept_priors: Sequence[float] = ACCEPT_PRIORS,
    oracle: bool = True,
    prior_families: Sequence[str] = DAEMON_POLICIES,
    command: str | None = None,
    progress: bool = True,
    tier_switch_ms: float | None = None,
    restart_check: bool = True,
) -> SuiteOutput:
    """Run every policy on every scenario, then write the tables, targets and plots.

    Daemon policies run once per step-cost prior variant in ``priors`` (names of
    ``scenarios.PRIORS``), goodput once more per acceptance prior in ``accept_priors``,
    and ``oracle`` adds the two oracles (clairvoyant and informed). ``tier_switch_ms``
    charges every tier switch that much GPU time (None: the catalog's, 0 built in).
    ``restart_check`` computes the restart recommendation of goodput's exact-prior run.
    """
    started = time.perf_counter()
    slo = slo or Slo()
    data = data_dir or default_data_dir()
    runs = suite_runs(
        policies,
        priors=priors,
        accept_priors=accept_priors,
        oracle=oracle,
        prior_families=prior_families,
    )
    for r in runs:
        parse_policy(r.spec)  # fail before any simulation on a bad policy
    plotted = plot_scenario(scenarios)
    work = _jobs(
        scenarios,
        runs,
        plotted,
        data_dir=data,
        seed=seed,
        slo=slo,
        tier_switch_ms=tier_switch_ms,
        restart_check=restart_check,
    )
    results = _run_work(work, jobs, progress, started)

    # Scenario order, then policy order: tables read the same whatever finished first.
    sc_order = {s.id: i for i, s in enumerate(scenarios)}
    p_order = {r.label: i for i, r in enumerate(runs)}
    results.sort(key=lambda r: (sc_order[r.scenario_id], p_order[r.policy]))
    rows = report.build_rows(scenarios, results, [r.label for r in runs])
    phase_table = report.phase_rows(scenarios, results)
    targets = report.evaluate_targets(rows, scenarios)
    per_prior = report.targets_per_prior(rows, scenarios)
    missed = report.misses(rows, scenarios, targets)
    meta = _meta(
        rows,
        command=command,
        scenarios=f"{len(scenarios)} ({len(work)} runs)",
        slo=slo,
        seed=seed,
        wall=f"{time.perf_counter() - started:.0f} s with {jobs} job(s)",
        policies=policies,
        priors=priors,
        accept_priors=accept_priors,
        tier_switch_ms=tier_switch_ms,
    )
    markdown = report_markdown.render_markdown(
        rows, targets, scenarios, meta, phase_table, per_prior=per_prior, misses=missed
    )
    document = _document(meta, targets, per_prior, missed, rows, results)
    files = _write_files(out_dir, rows, phase_table, markdown, document)
    if plotted is not None:
        files += _plot_series(plotted, rows, results, out_dir / "plots" / "timeseries")
    return SuiteOutput(rows, targets, markdown, files, time.perf_counter() - started)


def _jobs(
    scenarios: Sequence[Scenario],
    runs: Sequence[PolicyRun],
    plotted: Scenario | None,
    *,
    data_dir: Path,
    seed: int,
    slo: Slo,
    tier_switch_ms: float | None,
    restart_check: bool,
) -> list[Job]:
    """One job per scenario and run, the longest first; the exact-prior runs of the
    *plotted* scenario keep their time series, the target policy's runs check restarts."""
    work = [
        Job(
            sc,
            r,
            data_dir,
            seed,
            slo,
            keep_series=sc == plotted and r.variant == "exact",
            tier_switch_ms=tier_switch_ms,
            restart_check=restart_check and r.label == report.TARGET_POLICY,
        )
        for sc in scenarios
        for r in runs
    ]
    return sorted(work, key=_cost, reverse=True)


def _run_work(
    work: Sequence[Job], jobs: int, progress: bool, started: float
) -> list[report.RunResult]:
    """Every job's result, in the order they finish (in this process with one job)."""
    results: list[report.RunResult] = []
    if jobs <= 1:
        for i, job in enumerate(work, 1):
            results.append(run_job(job))
            _progress(progress, i, len(work), results[-1], started)
    else:
        with multiprocessing.Pool(jobs) as pool:
            for i, res in enumerate(pool.imap_unordered(run_job, work), 1):
                results.append(res)
                _progress(progress, i, len(work), res, started)
    return results


def _meta(
    rows: Sequence[dict[str, Any]],
    *,
    command: str | None,
    scenarios: str,
    slo: Slo,
    seed: int,
    wall: str,
    policies: Sequence[str],
    priors: Sequence[str],
    accept_priors: Sequence[float],
    tier_switch_ms: float | None,
) -> dict[str, str]:
    """The run's settings, as the markdown's header table and results.json's "meta"."""
    return {
        "command": f"`{command}`" if command else "run_suite(...)",
        "scenarios": scenarios,
        "SLO": f"TPOT <= {slo.tpot_ms} ms" + (f", TTFT <= {slo.ttft_ms} ms" if slo.ttft_ms else ""),
        "seed": str(seed),
        "wall time": wall,
        "targets apply to": f"{report.TARGET_POLICY}, worst over its prior variants "
        f"({', '.join(report.variants_of(rows, report.TARGET_POLICY))})",
        "batch-table": next((p for p in policies if p.startswith("batch-table")), "-"),
        "wrong step-cost priors": ", ".join(
            f"{PRIORS_BY_NAME[p].name}: {PRIORS_BY_NAME[p].description}" for p in priors
        )
        or "-",
        "acceptance priors (goodput prior_mean)": ", ".join(f"{m:g}" for m in accept_priors) or "-",
        "tier-switch cost": "the drafter catalog's (0 ms built in)"
        if tier_switch_ms is None
        else f"{tier_switch_ms:g} ms per switch",
    }


def _document(
    meta: dict[str, str],
    targets: Sequence[report.TargetResult],
    per_prior: dict[str, list[report.TargetResult]],
    missed: Any,
    rows: Sequence[dict[str, Any]],
    results: Sequence[report.RunResult],
) -> dict[str, Any]:
    """results.json: the settings, targets, misses, headline shares and every run."""
    return {
        "meta": meta,
        "targets": [t.__dict__ for t in targets],
        "targets_per_prior": {k: [t.__dict__ for t in v] for k, v in per_prior.items()},
        "misses": missed,
        # Headline: per policy, the median share of each oracle's gain over none.
        "median_oracle_shares": report.median_shares(rows),
        "restart_checks": report.restart_checks(rows),
        "runs": [
            {
                "scenario": r.scenario_id,
                "policy": r.policy,
                "summary": r.summary,
                "phase_good_tokens": r.phase_good_tokens,
                "reason_counts": r.reason_counts,
                "table_changes": r.changes,
            }
            for r in sorted(results, key=lambda r: (r.scenario_id, r.policy))
        ],
    }


def _write_files(
    out_dir: Path,
    rows: Sequence[dict[str, Any]],
    phase_table: Sequence[dict[str, Any]],
    markdown: str,
    document: dict[str, Any],
) -> list[Path]:
    """results.csv, phases.csv, results.md, results.json and the goodput heat map."""
    out_dir.mkdir(parents=True, exist_ok=True)
    files = [
        report_files.write_csv(rows, report.CSV_COLUMNS, out_dir / "results.csv"),
        report_files.write_csv(phase_table, report.PHASE_CSV_COLUMNS, out_dir / "phases.csv"),
    ]
    md_path = out_dir / "results.md"
    md_path.write_text(markdown, encoding="utf-8")
    files.append(md_path)
    json_path = out_dir / "results.json"
    json_path.write_text(json.dumps(document, indent=1, default=str), encoding="utf-8")
    files.append(json_path)
    heat = report_files.plot_goodput_ratios(rows, out_dir / "plots" / "goodput_vs_ema.png")
    if heat is not None:
        files.append(heat)
    return files


# Time series plotted for the phase scenario (plus its best static in hindsight).
SERIES_POLICIES = ("none", "sglang-ema", "batch-table", "goodput", "bandit", "oracle")


def _plot_series(
    scenario: Scenario,
    rows: Sequence[dict[str, Any]],
    results: Sequence[report.RunResult],
    out_dir: Path,
) -> list[Path]:
    best = next(
        (
            r["resolved"]
            for r in rows
            if r["scenario"] == scenario.id and r["policy"] == report.ORACLE
        ),
        None,
    )
    wanted = [*SERIES_POLICIES, *([best] if best in STATIC_POLICIES else [])]
    series = [
        (r.policy, r.series)
        for r in results
        if r.scenario_id == scenario.id and r.policy in wanted and r.series is not None
    ]
    return report_files.plot_timeseries(scenario.id, series, out_dir) if series else []


def _progress(enabled: bool, i: int, n: int, res: report.RunResult, started: float) -> None:
    if enabled:
        print(
            f"[{i}/{n} {time.perf_counter() - started:6.0f}s] {res.scenario_id} {res.policy}: "
            f"goodput {res.summary['goodput_tok_s']:.0f} tok/s "
            f"(run {res.summary['wall_s']:.1f}s)",
            file=sys.stderr,
            flush=True,
        )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder")
    parser.add_argument("--quick", action="store_true", help="small smoke subset")
    parser.add_argument("--jobs", type=int, default=2, help="worker processes (default 2)")
    parser.add_argument(
        "--scenarios",
        nargs="+",
        metavar="PAT",
        help="workload names or ids workload/gpu/profile (wildcards ok), e.g. 'conv-*' "
        "'phase/h100/*'",
    )
    parser.add_argument("--data-dir", type=Path, default=None, help="holds traces/azure-llm-2023")
    parser.add_argument(
        "--priors",
        nargs="+",
        metavar="NAME",
        default=list(PRIORS_BY_NAME),
        help=f"step-cost prior variants of the daemon policies (default all: "
        f"{' '.join(PRIORS_BY_NAME)}); 'exact' alone runs no wrong prior",
    )
    parser.add_argument(
        "--accept-priors",
        nargs="*",
        type=float,
        metavar="MEAN",
        default=list(ACCEPT_PRIORS),
        help="goodput acceptance priors (prior_mean) to run besides the default "
        f"(default: {' '.join(f'{m:g}' for m in ACCEPT_PRIORS)}; none: give the flag alone)",
    )
    parser.add_argument(
        "--prior-families",
        nargs="+",
        metavar="POLICY",
        default=list(DAEMON_POLICIES),
        help="daemon policies run under the wrong step-cost priors (default all: "
        f"{' '.join(DAEMON_POLICIES)})",
    )
    parser.add_argument(
        "--no-oracle", action="store_true", help="skip the oracles (clairvoyant and informed)"
    )
    parser.add_argument(
        "--no-restart-check",
        action="store_true",
        help="skip goodput's restart recommendation (one replay per candidate per scenario)",
    )
    parser.add_argument(
        "--tier-switch-ms",
        type=float,
        default=None,
        metavar="MS",
        help="GPU time charged per tier switch (default: the drafter catalog's, 0)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--slo-tpot-ms", type=float, default=50.0)
    parser.add_argument("--slo-ttft-ms", type=float, default=None)
    return parser


def _checked(args: argparse.Namespace) -> tuple[Slo, list[Scenario]]:
    """The SLO and the selected scenarios, every name and value checked before anything
    runs (a ValueError otherwise)."""
    slo = Slo(tpot_ms=args.slo_tpot_ms, ttft_ms=args.slo_ttft_ms)
    scenarios = select(args.scenarios, quick=args.quick)
    # Validate the names before anything runs.
    suite_runs(
        priors=args.priors,
        accept_priors=args.accept_priors,
        prior_families=args.prior_families,
    )
    for m in args.accept_priors:
        if not 0.0 < m < 1.0:
            raise ScenarioError(f"--accept-priors: prior_mean must be in (0, 1), got {m:g}")
    return slo, scenarios


def _with_inputs(scenarios: Sequence[Scenario], data_dir: Path) -> list[Scenario]:
    """The scenarios whose trace files are in *data_dir* (a warning for each one not)."""
    missing = missing_inputs({s.workload for s in scenarios}, data_dir)
    for name, path in sorted(missing.items()):
        print(f"warning: skipping {name}: {path} not found", file=sys.stderr)
    return [s for s in scenarios if s.workload.name not in missing]


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs must be >= 1, got {args.jobs}")
    if args.tier_switch_ms is not None and not 0.0 <= args.tier_switch_ms < float("inf"):
        parser.error(f"--tier-switch-ms must be a number >= 0, got {args.tier_switch_ms}")
    try:
        slo, scenarios = _checked(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    data_dir = args.data_dir or default_data_dir()
    runnable = _with_inputs(scenarios, data_dir)
    if scenarios and not runnable:
        print(
            "error: no scenario left to run (set SPECGOV_SHARED_DATA or --data-dir)",
            file=sys.stderr,
        )
        return 2
    command = "python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(argv or sys.argv[1:])])
    try:
        out = run_suite(
            runnable,
            out_dir=args.out,
            jobs=args.jobs,
            data_dir=data_dir,
            seed=args.seed,
            slo=slo,
            priors=args.priors,
            accept_priors=args.accept_priors,
            oracle=not args.no_oracle,
            prior_families=args.prior_families,
            command=command,
            tier_switch_ms=args.tier_switch_ms,
            restart_check=not args.no_restart_check,
        )
    except ScenarioError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(out.markdown)
    print(f"wrote {len(out.files)} files under {args.out} in {out.wall_s:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
