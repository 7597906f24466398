"""Simulator speed benchmark (not a test): replay the Azure conversation trace.

Replays the whole trace (19,366 requests, ~4.09 M output tokens) at 1x rate with
EAGLE-3 `static:3` on an H100 / Llama-3.1-8B server, then the same trace repeated
2x and 4x back to back, each in a fresh subprocess so peak RSS is per run.
Prints wall time, peak RSS and simulated output tokens per wall second (median
of --repeats runs) and the 2x/4x wall-time ratios against 1x (linear = 2.0, 4.0).

Targets on the 2-core reference machine: 1x in <= 10 s wall and <= 1 GiB RSS.

    make bench            # or: python benchmarks/bench_replay.py --repeats 3
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
from specgov.simulator.traces import Request, load_trace
from specgov.simulator.replay import ServerSpec, build_engine, parse_policy

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
    args = parser.parse_args()
    if not args.trace.is_file():
        print(f"trace not found: {args.trace} (set SPECGOV_SHARED_DATA)", file=sys.stderr)
        return 2
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
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
