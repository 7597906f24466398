"""Control API under load, and what the load does to the decision cadence (issue 9 §5).

Targets: 500 requests/s of mixed status / decisions / overrides queries on loopback
with p99 latency < 50 ms, while the decision cadence stays within 50 ms of its
interval. The benchmark runs `specgov sim-server` (the plugin on a spool directory,
chat traffic replayed forever) and `specgov run --mode plugin` against it as separate
processes, waits for the first published table, then measures two phases of
``--duration-s`` each: without load, and with an open-loop load of ``--rate`` requests/s
from this process (keep-alive connections; each request is due at a fixed time, and
its latency is counted from that time, so a stalled server cannot hide its queue).

The mix, in a fixed round-robin order (no random draws): 40 % ``GET /v1/status``,
30 % ``GET /v1/decisions?limit=20``, 28 % ``GET /v1/overrides``, 1 % ``POST
/v1/overrides`` (a pin of the running policy: harmless) and 1 % ``DELETE
/v1/overrides?all=true``. The cadence is read from the audit log: the gaps between
consecutive decisions made in each phase, against ``--decide-interval-s``.

It measures and prints (``--json FILE`` writes the numbers); it is not a test, and
exits 0 unless ``--strict`` is given and a target is missed. Linux only (``/proc``).

    .venv/bin/python benchmarks/bench_control_api_load.py [--rate 500] [--duration-s 60]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import sqlite3
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_daemon_overhead import daemon_stack, sample_proc  # a sibling script, not a package

STARTUP_TIMEOUT_S = 90.0
TARGET_P99_MS = 50.0
TARGET_CADENCE_MS = 50.0
# (kind, weight in 100): the fixed mix, expanded into a round-robin schedule.
MIX = (("status", 40), ("decisions", 30), ("overrides", 28), ("set", 1), ("clear", 1))


@dataclass
class Phase:
    name: str
    duration_s: float
    requests: int = 0
    errors: int = 0
    achieved_rps: float = 0.0
    p50_ms: float | None = None
    p99_ms: float | None = None
    max_ms: float | None = None
    p99_by_kind_ms: dict[str, float] = field(default_factory=dict)
    decisions: int = 0
    mean_interval_s: float | None = None
    max_cadence_dev_ms: float | None = None
    daemon_cpu_share: float = 0.0
    client_cpu_share: float = 0.0  # this process: a saturated client shows here
    daemon_cpu_per_request_ms: float | None = None
    # The host's 1-minute load average at the phase's end: on a shared machine the
    # latencies mean little without it.
    load_average_1m: float = 0.0


def decision_times(db: Path, since_s: float, until_s: float) -> list[float]:
    try:
        with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10)) as c:
            rows = c.execute(
                "SELECT time_s FROM decisions WHERE time_s >= ? AND time_s < ? "
                "AND reason != 'store_gap' ORDER BY id",
                (since_s, until_s),
            ).fetchall()
    except sqlite3.Error:
        return []
    return [float(r[0]) for r in rows]


def cpu_seconds(pid: int) -> float:
    return sample_proc(pid).cpu_s


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def schedule() -> list[str]:
    """The 100-slot round robin: each kind spread evenly by its weight."""
    slots: list[tuple[float, str]] = []
    for kind, weight in MIX:
        slots += [((i + 0.5) / weight, kind) for i in range(weight)]
    return [kind for _, kind in sorted(slots)]


async def one_request(
    session: aiohttp.ClientSession, base: str, kind: str, due: float
) -> tuple[str, float, bool]:
    loop = asyncio.get_running_loop()
    try:
        if kind == "status":
            resp = await session.get(f"{base}/v1/status")
        elif kind == "decisions":
            resp = await session.get(f"{base}/v1/decisions", params={"limit": "20"})
        elif kind == "overrides":
            resp = await session.get(f"{base}/v1/overrides")
        elif kind == "set":
            body = {"pin_policy": "goodput", "ttl": "1m", "reason": "load benchmark"}
            resp = await session.post(f"{base}/v1/overrides", json=body)
        else:
            resp = await session.delete(f"{base}/v1/overrides", params={"all": "true"})
        await resp.read()
        ok = resp.status < 500 and resp.status != 400
        resp.release()
    except (aiohttp.ClientError, OSError):
        ok = False
    return kind, (loop.time() - due) * 1000.0, ok


async def load(base: str, rate: float, duration_s: float) -> list[tuple[str, float, bool]]:
    kinds = schedule()
    loop = asyncio.get_running_loop()
    connector = aiohttp.TCPConnector(limit=64)
    tasks: list[asyncio.Task[tuple[str, float, bool]]] = []
    async with aiohttp.ClientSession(connector=connector) as session:
        t0 = loop.time() + 0.05
        n = int(rate * duration_s)
        for i in range(n):
            due = t0 + i / rate
            delay = due - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(
                asyncio.create_task(one_request(session, base, kinds[i % len(kinds)], due))
            )
        return list(await asyncio.gather(*tasks))


def measure(
    name: str,
    db: Path,
    pid: int,
    base: str,
    duration_s: float,
    rate: float,
    interval_s: float,
) -> Phase:
    phase = Phase(name, duration_s)
    wall0, cpu0, own0 = time.time(), cpu_seconds(pid), time.process_time()
    if rate > 0:
        results = asyncio.run(load(base, rate, duration_s))
    else:
        time.sleep(duration_s)
        results = []
    wall1, cpu1, own1 = time.time(), cpu_seconds(pid), time.process_time()
    phase.daemon_cpu_share = (cpu1 - cpu0) / (wall1 - wall0)
    phase.client_cpu_share = (own1 - own0) / (wall1 - wall0)
    phase.load_average_1m = os.getloadavg()[0]
    if results:
        latencies = [ms for _, ms, _ in results]
        phase.requests = len(results)
        phase.errors = sum(1 for *_, ok in results if not ok)
        phase.achieved_rps = len(results) / (wall1 - wall0)
        phase.daemon_cpu_per_request_ms = 1000.0 * (cpu1 - cpu0) / len(results)
        phase.p50_ms = percentile(latencies, 0.50)
        phase.p99_ms = percentile(latencies, 0.99)
        phase.max_ms = max(latencies)
        for kind, _ in MIX:
            of_kind = [ms for k, ms, _ in results if k == kind]
            if of_kind:
                phase.p99_by_kind_ms[kind] = percentile(of_kind, 0.99)
    times = decision_times(db, wall0, wall1)
    phase.decisions = len(times)
    gaps = [b - a for a, b in itertools.pairwise(times)]
    if gaps:
        phase.mean_interval_s = statistics.fmean(gaps)
        phase.max_cadence_dev_ms = max(abs(g - interval_s) for g in gaps) * 1000.0
    return phase


def run(
    rate: float,
    duration_s: float,
    decide_interval_s: float,
    warmup_s: float,
    speed: float,
    profile: Path | None = None,
) -> list[Phase]:
    with daemon_stack(
        decide_interval_s=decide_interval_s,
        speed=speed,
        prefix="specgov-bench-load-",
        profile=profile,
        startup_timeout_s=STARTUP_TIMEOUT_S,
    ) as stack:
        time.sleep(warmup_s)
        base, db, pid = f"http://{stack.control}", stack.db, stack.daemon.pid
        phases = [
            measure("idle", db, pid, base, duration_s, 0.0, decide_interval_s),
            measure("load", db, pid, base, duration_s, rate, decide_interval_s),
        ]
        stack.check_alive()
    return phases


def _fmt(value: float | None, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def report(phases: list[Phase], rate: float, interval_s: float) -> bool:
    print(f"control API load: {rate:g} req/s target, decide interval {interval_s:g} s")
    print(
        f"{'phase':<6} {'req':>7} {'err':>4} {'req/s':>7} {'p50 ms':>7} {'p99 ms':>7} "
        f"{'max ms':>7} {'decisions':>9} {'mean gap s':>10} {'max dev ms':>10} {'daemon':>7} "
        f"{'client':>7} {'load1':>5}"
    )
    for p in phases:
        print(
            f"{p.name:<6} {p.requests:>7} {p.errors:>4} {p.achieved_rps:>7.1f} "
            f"{_fmt(p.p50_ms):>7} {_fmt(p.p99_ms):>7} {_fmt(p.max_ms):>7} {p.decisions:>9} "
            f"{_fmt(p.mean_interval_s, '.3f'):>10} {_fmt(p.max_cadence_dev_ms):>10} "
            f"{p.daemon_cpu_share:>7.1%} {p.client_cpu_share:>7.1%} {p.load_average_1m:>5.1f}"
        )
    loaded = phases[-1]
    if loaded.daemon_cpu_per_request_ms is not None:
        print(
            f"daemon CPU per request under load: {loaded.daemon_cpu_per_request_ms:.3f} ms "
            f"(decisions and scrapes included); load average now {os.getloadavg()[0]:.1f} "
            f"on {os.cpu_count()} CPUs"
        )
    if loaded.p99_by_kind_ms:
        kinds = ", ".join(f"{k} {v:.1f}" for k, v in loaded.p99_by_kind_ms.items())
        print(f"p99 by kind under load (ms): {kinds}")
    ok = (
        loaded.p99_ms is not None
        and loaded.p99_ms < TARGET_P99_MS
        and loaded.errors == 0
        and all(
            p.max_cadence_dev_ms is None or p.max_cadence_dev_ms <= TARGET_CADENCE_MS
            for p in phases
        )
    )
    print(
        f"targets: p99 < {TARGET_P99_MS:g} ms, no errors, cadence within "
        f"{TARGET_CADENCE_MS:g} ms: {'met' if ok else 'MISSED'}"
    )
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=500.0, help="requests/s of load")
    parser.add_argument("--duration-s", type=float, default=60.0, help="each phase")
    parser.add_argument("--decide-interval-s", type=float, default=5.0)
    parser.add_argument("--warmup-s", type=float, default=5.0)
    parser.add_argument("--speed", type=float, default=1.0, help="sim-server time speed-up")
    parser.add_argument("--json", type=Path, default=None, help="write the numbers here")
    parser.add_argument("--strict", action="store_true", help="exit 1 if a target is missed")
    parser.add_argument(
        "--profile", type=Path, default=None, help="run the daemon under cProfile, stats here"
    )
    args = parser.parse_args(argv)
    phases = run(
        args.rate, args.duration_s, args.decide_interval_s, args.warmup_s, args.speed, args.profile
    )
    ok = report(phases, args.rate, args.decide_interval_s)
    if args.json is not None:
        args.json.write_text(json.dumps([asdict(p) for p in phases], indent=2))
    return 1 if args.strict and not ok else 0


if __name__ == "__main__":
    sys.exit(main())
