"""Benchmark `specgov plan sweep`: 48 configurations over the Azure conversation trace.

Measures the sweep's wall time on the local executor with 1 worker (inline) and with
2 worker processes, the parallel speed-up, and what one daemon-policy job (the
``goodput`` closed loop) costs against an in-engine one (seconds per simulated
evaluation: the jobs' search takes different numbers of evaluations). Checks that
the rows are identical across worker counts (apart from their timing).

Configurations: 4 GPUs (h100, a100-80g, h200, l40s) x [plain server + EAGLE-3 with
static:1,2,3,5,7, sglang-ema, goodput + n-gram with static:1,3,5,7] = 48.

    SPECGOV_SHARED_DATA=../shared/data .venv/bin/python benchmarks/bench_plan_sweep.py \
        [--window-end-s 120] [--workers 1,2] [--json OUT.json]

Wall times depend on the machine and on what else runs on it: the output prints
os.cpu_count() and the load average before the run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from specgov.simulator.planning.executor import run_jobs
from specgov.simulator.planning.sweep import (
    JobSpec,
    SweepSettings,
    enumerate_jobs,
)
from specgov.simulator.planning.sweep_document import build_document
from specgov.simulator.workload.trace_files import load_trace
from specgov.simulator.workload.traces import Trace

GPUS = ["h100", "a100-80g", "h200", "l40s"]
EAGLE_POLICIES = [
    "static:1",
    "static:2",
    "static:3",
    "static:5",
    "static:7",
    "sglang-ema",
    "goodput",
]
NGRAM_POLICIES = ["static:1", "static:3", "static:5", "static:7"]
IN_ENGINE = ("static:", "sglang-ema")


def configurations(trace: Trace, settings: SweepSettings) -> list[JobSpec]:
    eagle = enumerate_jobs(
        gpus=GPUS, drafters=["eagle3"], policies=EAGLE_POLICIES, settings=settings, trace=trace
    )
    ngram = enumerate_jobs(
        gpus=GPUS, drafters=["ngram"], policies=NGRAM_POLICIES, settings=settings, trace=trace
    )
    seen = {j.job_id for j in eagle}
    jobs = eagle + [j for j in ngram if j.job_id not in seen]  # the plain rows once
    return sorted(jobs, key=lambda j: (GPUS.index(j.gpu), j.drafter, j.policy))


def _strip(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in r.items() if k != "timing"} for r in rows]


def _per_eval(rows: list[dict[str, Any]], pick: Any) -> list[float]:
    return [
        r["timing"]["wall_s"] / r["timing"]["evals"]
        for r in rows
        if pick(r) and r["timing"]["evals"] > 0
    ]


def _args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_data = os.environ.get("SPECGOV_SHARED_DATA", "../shared/data")
    parser.add_argument(
        "--trace",
        type=Path,
        default=Path(default_data) / "traces/azure-llm-2023/AzureLLMInferenceTrace_conv.csv",
    )
    parser.add_argument("--window-end-s", type=float, default=120.0)
    parser.add_argument("--workers", default="1,2", help="comma-separated worker counts")
    parser.add_argument("--target-rps", type=float, default=40.0)
    parser.add_argument("--json", type=Path, default=None, help="write the measurements here")
    return parser.parse_args()


def _sweep_per_count(
    jobs: list[JobSpec], trace: Trace, counts: list[int]
) -> tuple[dict[int, float], dict[int, list[dict[str, Any]]]]:
    """The sweep once per worker count: its wall time and its rows, each printed."""
    walls: dict[int, float] = {}
    results: dict[int, list[dict[str, Any]]] = {}
    for workers in counts:
        load = os.getloadavg()[0]
        started = time.perf_counter()
        rows, _ = run_jobs(jobs, trace, workers=workers)
        walls[workers] = time.perf_counter() - started
        results[workers] = rows
        evals = sum(r["timing"]["evals"] for r in rows)
        ok = sum(1 for r in rows if r["status"] == "ok")
        # The jobs' own wall times, summed: against wall x workers it says whether the
        # workers had their cores (efficiency near 1) or shared them with other load.
        job_s = sum(r["timing"]["wall_s"] for r in rows)
        cpu_s = sum(r["timing"]["cpu_s"] for r in rows)
        print(
            f"workers {workers}: wall {walls[workers]:.1f} s, {evals} evaluations, {ok} rows ok; "
            f"job-seconds {job_s:.1f} (CPU {cpu_s:.1f}), efficiency "
            f"{job_s / (walls[workers] * workers):.2f}, loadavg at start {load:.2f}"
        )
    return walls, results


def _identical(results: dict[int, list[dict[str, Any]]], counts: list[int]) -> bool:
    """Whether every worker count gave the first one's rows (timing aside); each row
    that differs is printed."""
    first = results[counts[0]]
    identical = all(_strip(results[w]) == _strip(first) for w in counts)
    print(f"rows identical across worker counts: {identical}")
    for w in counts:
        for a, b in zip(_strip(first), _strip(results[w]), strict=True):
            if a != b:
                print(
                    f"  differs ({w} workers): {a['gpu']} {a['drafter']} {a['policy']}: "
                    f"{a['status']} {a['reason']} / {b['status']} {b['reason']}"
                )
    return identical


def _per_eval_costs(base: list[dict[str, Any]], out: dict[str, Any]) -> None:
    """Seconds per evaluation of the daemon policy against in-engine ones, printed and
    added to *out* (when the sweep has all three kinds of job)."""
    daemon = _per_eval(base, lambda r: r["policy"] == "goodput")
    ema = _per_eval(base, lambda r: r["policy"] == "sglang-ema")
    in_engine = _per_eval(
        base, lambda r: r["drafter"] != "none" and r["policy"].startswith(IN_ENGINE)
    )
    if daemon and ema and in_engine:
        d, e, i = (statistics.mean(x) for x in (daemon, ema, in_engine))
        print(
            f"seconds per evaluation: goodput (daemon, closed loop) {d:.3f}, sglang-ema "
            f"{e:.3f}, every in-engine speculative job {i:.3f}; daemon/in-engine "
            f"{d / e:.2f}x vs sglang-ema, {d / i:.2f}x vs all in-engine (target <= 3x)"
        )
        out["per_eval_s"] = {"goodput": d, "sglang-ema": e, "in_engine": i}
        out["daemon_over_ema"] = d / e
        out["daemon_over_in_engine"] = d / i


def _print_plan(doc: dict[str, Any], target_rps: float) -> None:
    """The statuses and each GPU's best configuration against the plain server."""
    statuses: dict[str, int] = {}
    for r in doc["configurations"]:
        statuses[r["status"]] = statuses.get(r["status"], 0) + 1
    print(f"statuses: {statuses}")
    for gpu, best in doc["best_per_gpu"].items():
        plain = next(r for r in doc["configurations"] if r["gpu"] == gpu and r["drafter"] == "none")
        print(
            f"  {gpu}: best {best['drafter']} {best['policy']} "
            f"{best['max_rps']:.2f} req/s/replica, "
            f"{best['replicas']} replicas for {target_rps:g} req/s "
            f"(plain: {plain['max_rps'] or 0:.2f} req/s, {plain['replicas']} replicas)"
        )


def main() -> int:
    args = _args()
    if not args.trace.is_file():
        print(f"trace not found: {args.trace} (set SPECGOV_SHARED_DATA)", file=sys.stderr)
        return 2
    trace = load_trace(args.trace, "azure", window_end_s=args.window_end_s)
    settings = SweepSettings()  # TPOT p99 <= 50 ms, TTFT p99 <= 2000 ms, rel_tol 0.05
    jobs = configurations(trace, settings)
    counts = [int(w) for w in args.workers.split(",")]
    summary = trace.summary()
    print(
        f"trace {summary['name']} window [0, {args.window_end_s:g}) s: {summary['requests']} "
        f"requests, {summary['requests'] / summary['duration_s']:.2f} req/s; "
        f"{len(jobs)} configurations; cpu_count {os.cpu_count()}, "
        f"loadavg {' '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    walls, results = _sweep_per_count(jobs, trace, counts)
    out: dict[str, Any] = {
        "configurations": len(jobs),
        "requests": summary["requests"],
        "window_end_s": args.window_end_s,
        "wall_s": {str(w): walls[w] for w in counts},
        "identical_rows": _identical(results, counts),
        "cpu_count": os.cpu_count(),
    }
    if 1 in walls and len(walls) > 1:
        for w in counts:
            if w != 1:
                print(f"speed-up with {w} workers: {walls[1] / walls[w]:.2f}x")
                out[f"speedup_{w}"] = walls[1] / walls[w]
    # Cost per evaluation, from the inline run (no process contention between jobs).
    base = results.get(1, results[counts[0]])
    _per_eval_costs(base, out)
    doc = build_document(
        base,
        trace=trace,
        settings=settings,
        target_rps=args.target_rps,
        prices=None,
        executor={"kind": "local"},
    )
    _print_plan(doc, args.target_rps)
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
