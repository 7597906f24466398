"""Soak: 24 simulated hours of diurnal traffic against the daemon, accelerated.

Issue 9 §6. `specgov sim-server` replays a synthetic diurnal day (``--sim-hours`` of
simulated time, one period, ``--rate-rps`` swinging between 0.2x and 1.8x) at
``--speed`` simulated seconds per wall second; `specgov run --mode plugin` controls it
with the shipped defaults except a ``--decide-interval-s`` decision interval (wall time)
and the restart replays (off). Every ``--sample-s`` the benchmark samples the daemon from
/proc: resident memory (VmRSS), open file descriptors (/proc/PID/fd), CPU time, and the
audit rows in its SQLite store.

At the end it checks, and prints:

* growth: RSS and open descriptors after the warm-up (first quarter) against the end;
  bounds (stated): RSS may grow at most ``RSS_GROWTH_BOUND_MIB`` (allocator noise and the
  estimators' bounded sample buffers filling up), descriptors at most ``FD_GROWTH_BOUND``;
* completeness: every decision the daemon counted (``specgov_decisions_total``, its own
  metric, summed over labels) has its audit row (the store's ``decisions`` table);
* cadence: no missed decision interval -- the largest gap between consecutive audit rows
  (their ``time_s``) stays below ``MISSED_INTERVAL_FACTOR`` x the interval.

It is a measurement: it exits 0 unless ``--strict`` is given and a check fails. Linux only.

    .venv/bin/python benchmarks/bench_soak.py [--sim-hours 24] [--speed 96] [--json FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import sqlite3
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_daemon_overhead import daemon_stack  # a sibling script, not a package

RSS_GROWTH_BOUND_MIB = 16.0
FD_GROWTH_BOUND = 4
MISSED_INTERVAL_FACTOR = 2.0


@dataclass(frozen=True)
class Sample:
    wall_s: float
    rss_mib: float
    open_fds: int
    cpu_s: float
    rows: int


@dataclass(frozen=True)
class SoakResult:
    sim_hours: float
    speed: float
    wall_s: float
    sim_time_s: float
    decisions_counted: int
    audit_rows: int
    missing_rows: int
    max_gap_s: float
    gaps_over_bound: int
    rss_after_warmup_mib: float
    rss_end_mib: float
    rss_peak_mib: float
    fds_after_warmup: int
    fds_end: int
    cpu_share_of_core: float
    samples: tuple[Sample, ...]


def sample(pid: int, db: Path) -> Sample:
    ticks = os.sysconf("SC_CLK_TCK")
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2 :].split()
    cpu_s = (int(fields[11]) + int(fields[12])) / ticks
    rss = 0.0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1]) / 1024.0
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    return Sample(time.time(), rss, fds, cpu_s, count_rows(db))


def count_rows(db: Path) -> int:
    try:
        with contextlib.closing(
            sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10)
        ) as conn:
            (n,) = conn.execute("SELECT count(*) FROM decisions").fetchone()
            return int(n)
    except sqlite3.Error:
        return 0


def row_times(db: Path) -> list[float]:
    with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10)) as conn:
        return [float(t) for (t,) in conn.execute("SELECT time_s FROM decisions ORDER BY id")]


def decisions_counted(metrics_url: str) -> int:
    with urllib.request.urlopen(metrics_url, timeout=10.0) as resp:
        text = resp.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith("specgov_decisions_total{") or line.startswith(
            "specgov_decisions_total "
        ):
            total += float(line.rsplit(" ", 1)[-1])
    return int(total)


def sim_state(sim_url: str) -> tuple[float, bool]:
    """The sim-server's simulated time and whether its trace has played out."""
    with urllib.request.urlopen(f"{sim_url}/specgov-sim/state", timeout=10.0) as resp:
        state = json.loads(resp.read())
    return float(state["sim_time_s"]), state.get("status") == "finished"


def sim_time(sim_url: str) -> float:
    return sim_state(sim_url)[0]


def run(
    sim_hours: float, speed: float, decide_interval_s: float, sample_s: float, rate_rps: float
) -> SoakResult:
    duration_s = sim_hours * 3600.0
    trace = (
        f"synthetic:duration={duration_s:g},rate={rate_rps:g},diurnal=0.8,period={duration_s:g},"
        f"phases=chat@{duration_s:g},seed=9"
    )
    with daemon_stack(
        decide_interval_s=decide_interval_s,
        speed=speed,
        prefix="specgov-soak-",
        trace=trace,
        loop=False,
        stop_timeout_s=15.0,
    ) as stack:
        start_wall = time.time()
        samples: list[Sample] = []
        # Until the simulated day has played out (the sim-server slows down when
        # starved, so its own state, not the wall, says when).
        while not sim_state(stack.sim_url)[1]:
            stack.check_alive()
            samples.append(sample(stack.daemon.pid, stack.db))
            time.sleep(sample_s)  # the sampling period
        samples.append(sample(stack.daemon.pid, stack.db))
        counted = decisions_counted(f"http://{stack.metrics}/metrics")
        # Rows are written right after a decision is counted: one more sample
        # after a decision interval lets the last one land.
        time.sleep(decide_interval_s)
        times = row_times(stack.db)
        end_sim = sim_time(stack.sim_url)
    return _result(
        sim_hours, speed, decide_interval_s, samples, start_wall, times, counted, end_sim
    )


def _result(
    sim_hours: float,
    speed: float,
    decide_interval_s: float,
    samples: list[Sample],
    start_wall: float,
    times: list[float],
    counted: int,
    end_sim: float,
) -> SoakResult:
    """The soak's figures from its samples and the audit rows' times."""
    warm = samples[max(0, len(samples) // 4)]
    end = samples[-1]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    bound = MISSED_INTERVAL_FACTOR * decide_interval_s
    return SoakResult(
        sim_hours=sim_hours,
        speed=speed,
        wall_s=end.wall_s - start_wall,
        sim_time_s=end_sim,
        decisions_counted=counted,
        audit_rows=len(times),
        missing_rows=max(0, counted - len(times)),
        max_gap_s=max(gaps, default=0.0),
        gaps_over_bound=sum(1 for g in gaps if g > bound),
        rss_after_warmup_mib=warm.rss_mib,
        rss_end_mib=end.rss_mib,
        rss_peak_mib=max(s.rss_mib for s in samples),
        fds_after_warmup=warm.open_fds,
        fds_end=end.open_fds,
        cpu_share_of_core=(end.cpu_s - samples[0].cpu_s)
        / max(end.wall_s - samples[0].wall_s, 1e-9),
        samples=tuple(samples),
    )


def report(r: SoakResult, decide_interval_s: float) -> bool:
    rss_growth = r.rss_end_mib - r.rss_after_warmup_mib
    fd_growth = r.fds_end - r.fds_after_warmup
    checks = {
        "rss": rss_growth <= RSS_GROWTH_BOUND_MIB,
        "fds": fd_growth <= FD_GROWTH_BOUND,
        "complete": r.missing_rows == 0,
        "cadence": r.gaps_over_bound == 0,
    }
    ok = "OK", "MISSED"
    print(f"specgov soak: {r.sim_hours:g} simulated hours at {r.speed:g}x")
    print(f"  wall time                {r.wall_s:10.0f} s (simulated {r.sim_time_s:.0f} s)")
    print(f"  decisions (daemon count) {r.decisions_counted:10d}")
    print(
        f"  audit rows               {r.audit_rows:10d}   missing {r.missing_rows}  "
        f"{ok[not checks['complete']]}"
    )
    print(
        f"  largest gap between rows {r.max_gap_s:10.2f} s   > {MISSED_INTERVAL_FACTOR:g} x "
        f"{decide_interval_s:g} s: {r.gaps_over_bound}  {ok[not checks['cadence']]}"
    )
    print(
        f"  RSS warm -> end (peak)   {r.rss_after_warmup_mib:7.1f} -> {r.rss_end_mib:.1f} MiB "
        f"({r.rss_peak_mib:.1f}); growth {rss_growth:+.1f} <= {RSS_GROWTH_BOUND_MIB:g}  "
        f"{ok[not checks['rss']]}"
    )
    print(
        f"  open fds warm -> end     {r.fds_after_warmup:10d} -> {r.fds_end}; growth "
        f"{fd_growth:+d} <= {FD_GROWTH_BOUND}  {ok[not checks['fds']]}"
    )
    print(f"  daemon CPU share of a core {100 * r.cpu_share_of_core:8.2f} %")
    return all(checks.values())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sim-hours", type=float, default=24.0)
    parser.add_argument("--speed", type=float, default=96.0, help="sim-server speed")
    parser.add_argument("--decide-interval-s", type=float, default=1.0)
    parser.add_argument("--sample-s", type=float, default=10.0)
    parser.add_argument(
        "--rate-rps", type=float, default=1.0, help="mean request rate of the simulated day"
    )
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--strict", action="store_true", help="exit 1 if a check fails")
    args = parser.parse_args(argv)
    if not Path("/proc/self/stat").exists():
        print("bench_soak: needs Linux /proc", file=sys.stderr)
        return 2
    result = run(args.sim_hours, args.speed, args.decide_interval_s, args.sample_s, args.rate_rps)
    passed = report(result, args.decide_interval_s)
    if args.json is not None:
        args.json.write_text(json.dumps({**asdict(result), "passed": passed}, indent=2) + "\n")
    return 1 if args.strict and not passed else 0


if __name__ == "__main__":
    raise SystemExit(main())
