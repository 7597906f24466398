"""The fleet governor end to end (issue 21 §3): the bench's quick path, smaller, through
the real smg binary. Two sim-servers start speculative behind smg; ``specgov fleet run``
(its own process) governs them while an open-loop ramp (seeded, bounded) goes from light
load past the crossover and back through the gateway. Asserted: every request succeeds
through the gateway with all its tokens (none lost while a replica drains and restarts),
the governor moves a replica to plain once the load crosses the crossover, and back to
speculative when it falls, and the audit rows tell that story in order. No fixed sleeps:
the run waits on its requests' answers and the governor's rows; every wait is bounded
(benchmarks/bench_fleet.py: DEADLINE_S)."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks import bench_fleet as bf  # noqa: E402
from specgov.simulator.planning.fleet import MixCrossover  # noqa: E402

# 2 replicas at 10x; the governor reads the arrival rate, and the crossover is given
# (1.5 requests per second per replica, ±10%) so that a small load crosses it: 6 rps is
# 3 per replica, 0.5 rps 0.25. The capacities are large: no capacity limit lowers the band.
CROSSOVER = MixCrossover(
    pays_up_to=8,
    plain_capacity=100,
    spec_capacity=100,
    pays_up_to_rps=1.5,
    plain_rps=50.0,
    spec_rps=50.0,
)
CFG = replace(
    bf.QUICK,
    replicas=2,
    speed=10.0,
    level_rates_rps=(0.5, 6.0, 6.0, 0.5, 0.5),
    level_s=50.0,
    output_tokens=(256, 512),
    tpot_slo_ms=50.0,
    startup_s=5.0,
    drain_s=5.0,
    dwell_s=2.0,
    interval_s=1.0,
    forecast_window_s=10.0,
    max_requests=800,
    crossover=CROSSOVER,
    kinds=("governed",),
)


def test_the_governor_moves_replicas_as_load_crosses_and_loses_no_request(
    smg_binary: Path, tmp_path: Path
) -> None:
    planned = bf.plan_requests(CFG)
    run = bf.run_fleet("governed", CFG, planned, CFG.crossover or (0, 0, 0), tmp_path)
    assert len(run.outcomes) == len(planned) > 100
    lost = [o for o in run.outcomes if o.status != 200]
    assert not lost, f"{len(lost)} requests failed through the gateway: {lost[:3]}"
    asked = {(p.level, p.output_tokens) for p in planned}
    assert all((o.level, o.tokens) in asked for o in run.outcomes)
    assert sum(o.tokens for o in run.outcomes) == sum(p.output_tokens for p in planned)

    decisions = [r for r in run.audit if r["step"] == "decide"]
    to_plain = bf.first_move_to_plain(run)
    assert to_plain is not None, [r["reason"] for r in decisions]
    # It moved once the load crossed: the rate it planned for (per wall second, so / the
    # speed) is past the band's top.
    pays = CROSSOVER.pays_up_to_rps
    planned_rps = to_plain["planned_load"] / CFG.speed
    assert planned_rps / CFG.replicas >= pays * (1 + bf.HYSTERESIS)
    assert to_plain["sim_s"] >= CFG.level_s * 0.5  # not while the load was light
    # ... and back to speculative when it fell.
    later = [r for r in decisions if r["at_s"] > to_plain["at_s"]]
    assert any(r["reason"].startswith("move_to_spec") for r in later), [r["reason"] for r in later]
    # Each move's rows, in order, for the replica moved.
    moved = to_plain["replica"]
    steps = [r["reason"] for r in run.audit if r["replica"] == moved and r["step"] != "decide"]
    story = ["move_started", "no_requests_left", "restart_plain", "server_healthy", "serving"]
    assert steps[: len(story) + 1] == [*story, "move_done"], steps
    assert all(r["reason"] not in ("replica_lost", "rolled_back") for r in run.audit)
