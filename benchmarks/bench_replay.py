"""Simulator speed benchmark (not a test): replay the Azure conversation trace.

Replays the whole trace (19,366 requests, ~4.09 M output tokens) at 1x rate with
EAGLE-3 `static:3` on an H100 / Llama-3.1-8B server, then the same trace repeated
2x and 4x back to back, each in a fresh subprocess so peak RSS is per run.
Prints wall time, peak RSS and simulated output tokens per wall second (median
of --repeats runs) and the 2x/4x wall-time ratios against 1x (linear = 2.0, 4.0).

Targets on the 2-core reference machine: 1x in <= 10 s wall and <= 1 GiB RSS.

Then the closed-loop cost (issue 8): the first ``--loop-window-s`` seconds of the same
trace replayed with an in-engine policy (``--in-engine``, default static:3) and with a
daemon policy (``--daemon``, default goodput) driving the engine through the simulated
``/metrics`` every 5 s, each ``--repeats`` times in a fresh subprocess; it prints the
median wall times, their ratio (target <= 3x) and the median per-poll split: render
(SimMetrics' /metrics text), parse (text -> MetricsSnapshot), observe (the rest of
ObservationBuilder.feed) and decide (the policy behind its guardrails, as the closed
loop times it). The split is measured by wrapping those functions where replay calls
them, so it follows whatever replay.py is wired to.

    make bench            # or: python benchmarks/bench_replay.py --repeats 3
    python benchmarks/bench_replay.py --loop-only --loop-window-s 1200
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import json, resource, sys, time
from pathlib import Path
from specgov.simulator.workload.traces import Request
from specgov.simulator.workload.trace_files import load_trace
from specgov.simulator.replay.runner import ServerSpec, build_engine, parse_policy

path, copies = Path(sys.argv[1]), int(sys.argv[2])
t0 = time.perf_counter()
trace = load_trace(path, "azure")
span = trace.requests[-1].arrival_s + 1.0
requests = [
    Request(r.arrival_s + c * span, r.input_tokens, r.output_tokens, r.domain)
    for c in range(copies) for r in trace.requests
]
load_s = time.perf_counter() - t0
engine, _ = build_engine(ServerSpec(gpu="h100", model="llama-3.1-8b", drafter="eagle3"),
                         parse_policy("static:3"), seed=0)
t1 = time.perf_counter()
result = engine.run(requests)
run_s = time.perf_counter() - t1
rss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"copies": copies, "requests": len(requests), "load_s": load_s,
                  "run_s": run_s, "wall_s": load_s + run_s, "output_tokens": result.output_tokens,
                  "completed": result.completed, "rss_mib": rss_kib / 1024}))
"""


LOOP_CHILD = r"""
import json, statistics, sys, time
from pathlib import Path
from specgov.adapters import observation_builder
from specgov.simulator.replay import runner as rp
from specgov.simulator.engine import sglang_metrics as sim_metrics
from specgov.simulator.workload.trace_files import load_trace

path, window_s, policy = Path(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
if sys.argv[4] == "1":
    # What replay.py does once wired to the fast path: render and parse only the
    # families telemetry reads (a stand-in until replay makes that call itself).
    from specgov.adapters.telemetry import METRICS_READ, parse_read_metrics
    sim_metrics.SimMetrics.render = lambda self: self.render_families(METRICS_READ)
    rp.parse_metrics = lambda text, *, source: parse_read_metrics(text, source=source)
    if hasattr(rp, "parse_read_metrics"):
        del rp.parse_read_metrics  # time the stand-in once, as "parse"
trace = load_trace(path, "azure", window_end_s=window_s)
cost = {"render": [], "parse": [], "feed": []}

def timed(key, fn):
    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            cost[key].append(time.perf_counter() - t)
    return wrapper

cls = sim_metrics.SimMetrics
cls.render = timed("render", cls.render)  # covers render_families when patched above
for name in ("parse_metrics", "parse_read_metrics"):  # whichever replay calls
    if hasattr(rp, name):
        setattr(rp, name, timed("parse", getattr(rp, name)))
observation_builder.ObservationBuilder.feed = timed(
    "feed", observation_builder.ObservationBuilder.feed
)
run = rp.prepare_run(rp.ServerSpec(gpu="h100", model="llama-3.1-8b", drafter="eagle3"),
                     rp.parse_policy(policy), seed=0)
t0 = time.perf_counter()
result = run.run(trace.requests)
wall = time.perf_counter() - t0
out = {"policy": policy, "requests": len(trace.requests), "wall_s": wall,
       "output_tokens": result.output_tokens}
if run.loop is not None:
    polls = len(run.loop.log.decisions)
    out["polls"] = polls
    for key, values in cost.items():
        out[key + "_ms"] = 1e3 * sum(values) / max(polls, 1)
    out["decide_ms"] = sum(d.decide_ms or 0.0 for d in run.loop.log.decisions) / max(polls, 1)
print(json.dumps(out))
"""


def closed_loop(args: argparse.Namespace) -> None:
    runs: dict[str, list[dict[str, float]]] = {args.in_engine: [], args.daemon: []}
    for _ in range(args.repeats):
        for policy in runs:  # alternate, so load drift hits both alike
            out = subprocess.run(
                [
                    sys.executable,
                    "-c",
                    LOOP_CHILD,
                    str(args.trace),
                    str(args.loop_window_s),
                    policy,
                    "1" if args.simulate_fast_wiring else "0",
                ],
                check=False,
                capture_output=True,
                text=True,
            )
            if out.returncode != 0:
                raise SystemExit(f"closed-loop run of {policy} failed:\n{out.stderr[-3000:]}")
            runs[policy].append(json.loads(out.stdout.strip().splitlines()[-1]))
    base = statistics.median(r["wall_s"] for r in runs[args.in_engine])
    loop = statistics.median(r["wall_s"] for r in runs[args.daemon])
    first = runs[args.daemon][0]
    print(
        f"\nclosed loop: {args.trace.name} first {args.loop_window_s:g} s "
        f"({first['requests']} requests, {first.get('polls', 0)} polls of 5 s), "
        f"median of {args.repeats}"
        + (", fast scrape path patched in" if args.simulate_fast_wiring else "")
    )
    print(f"  in-engine {args.in_engine:<12} wall {base:7.2f} s")
    print(f"  daemon    {args.daemon:<12} wall {loop:7.2f} s")
    print(f"  ratio daemon / in-engine   {loop / base:7.2f}x   (target <= 3x)")
    parts = ("render", "parse", "feed", "decide")
    med = {p: statistics.median(r[p + "_ms"] for r in runs[args.daemon]) for p in parts}
    # feed() includes nothing of render/parse (they run before it in replay's observe).
    print(
        "  per poll (median ms): "
        + "  ".join(f"{'observe' if p == 'feed' else p} {med[p]:.2f}" for p in parts)
        + f"  total {sum(med.values()):.2f}"
    )
    polls = first.get("polls", 0)
    in_loop_s = sum(med.values()) * polls / 1e3
    print(
        f"  polls cost {in_loop_s:.2f} s of the {loop:.2f} s; the rest over the in-engine run "
        f"({max(loop - base - in_loop_s, 0.0):.2f} s) is the daemon policy's in-engine side "
        "(table policy, metric hooks)"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--copies", type=int, nargs="+", default=[1, 2, 4])
    default_data = os.environ.get(
        "SPECGOV_SHARED_DATA", str(Path(__file__).resolve().parents[2] / "shared/data")
    )
    parser.add_argument(
        "--trace",
        type=Path,
        default=Path(default_data) / "traces/azure-llm-2023/AzureLLMInferenceTrace_conv.csv",
    )
    parser.add_argument("--loop-window-s", type=float, default=1200.0)
    parser.add_argument("--in-engine", default="static:3")
    parser.add_argument("--daemon", default="goodput")
    parser.add_argument("--loop-only", action="store_true", help="only the closed-loop part")
    parser.add_argument(
        "--simulate-fast-wiring",
        action="store_true",
        help="patch replay's scrape to render/parse only METRICS_READ (until replay does)",
    )
    args = parser.parse_args()
    if not args.trace.is_file():
        print(f"trace not found: {args.trace} (set SPECGOV_SHARED_DATA)", file=sys.stderr)
        return 2
    if args.loop_only:
        closed_loop(args)
        return 0
    rows = []
    for copies in args.copies:
        runs = []
        for _ in range(args.repeats):
            out = subprocess.run(
                [sys.executable, "-c", CHILD, str(args.trace), str(copies)],
                check=True,
                capture_output=True,
                text=True,
            )
            runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
        wall = statistics.median(r["wall_s"] for r in runs)
        run_s = statistics.median(r["run_s"] for r in runs)
        rss = max(r["rss_mib"] for r in runs)
        tokens = runs[0]["output_tokens"]
        rows.append((copies, runs[0]["requests"], tokens, wall, run_s, rss, tokens / run_s))
    base_wall = rows[0][3]
    print(
        f"trace: {args.trace.name}, static:3 EAGLE-3, H100 llama-3.1-8b, "
        f"median of {args.repeats} runs"
    )
    print(
        f"{'copies':>6} {'requests':>9} {'out tokens':>11} {'wall s':>7} {'sim s':>7} "
        f"{'peak MiB':>9} {'sim tok/wall s':>15} {'wall ratio':>10}"
    )
    for copies, n, tokens, wall, run_s, rss, tps in rows:
        print(
            f"{copies:>6} {n:>9} {tokens:>11,} {wall:>7.2f} {run_s:>7.2f} {rss:>9.0f} "
            f"{tps:>15,.0f} {wall / base_wall:>10.2f}"
        )
    one = rows[0]
    print(f"1x target: wall <= 10 s -> {one[3]:.2f} s; RSS <= 1024 MiB -> {one[5]:.0f} MiB")
    closed_loop(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
