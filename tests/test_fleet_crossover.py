"""The live fleet governor decides with plan fleet's own crossover: mix_crossover gives
the `speculation_pays_up_to_batch` that `plan fleet` reports for the same deployment and
trace, and a plain and a speculative replica's capacity whose predicted time per token
meets the TPOT."""

from __future__ import annotations

from specgov.simulator.planning.fleet import mix_crossover, plan_fleet
from specgov.simulator.planning.fleet_spec import FleetPlanConfig, enumerate_fleets
from specgov.simulator.planning.router import parse_routers
from specgov.simulator.replay.metrics import Slo
from specgov.simulator.replay.runner import ServerSpec
from specgov.simulator.workload.synthetic import generate_trace
from specgov.simulator.workload.synthetic_text import parse_synthetic_spec

TRACE = generate_trace(parse_synthetic_spec("synthetic:duration=10,rate=4,seed=3"))


def test_the_governor_uses_plan_fleets_crossover() -> None:
    server = ServerSpec()
    cfg = FleetPlanConfig(
        fleets=enumerate_fleets((1,), []),
        routers=parse_routers("least-loaded"),
        policies=("static:3",),
        slo=Slo(tpot_ms=40.0, ttft_ms=2000.0),
    )
    doc = plan_fleet(TRACE, server, cfg)
    planned = doc["replica_kinds"]["static:3"]["speculation_pays_up_to_batch"]
    found = mix_crossover(TRACE, server, "static:3", tpot_ms=40.0)
    assert found is not None
    assert found.pays_up_to == planned and planned > 0
    tables = doc["replica_kinds"]["static:3"]["predicted_ms_per_token"]
    for kind, capacity in (("plain", found.plain_capacity), ("speculative", found.spec_capacity)):
        per_token_ms = tables[kind]
        assert per_token_ms[capacity - 1] <= 40.0, kind
        assert capacity == len(per_token_ms) or per_token_ms[capacity] > 40.0, kind


def test_the_crossover_and_capacities_as_arrival_rates_follow_littles_law() -> None:
    """--load arrival-rate: the same tables as rates per replica, b / (L t(b)) with L the
    trace's mean output length; a sustainable rate is the best over the batches within
    the TPOT, so at least the rate at the capacity batch."""
    server = ServerSpec()
    found = mix_crossover(TRACE, server, "static:3", tpot_ms=40.0)
    assert found is not None
    cfg = FleetPlanConfig(
        fleets=enumerate_fleets((1,), []),
        routers=parse_routers("least-loaded"),
        policies=("static:3",),
        slo=Slo(tpot_ms=40.0, ttft_ms=2000.0),
    )
    tables = plan_fleet(TRACE, server, cfg)["replica_kinds"]["static:3"]["predicted_ms_per_token"]
    mean_out = sum(r.output_tokens for r in TRACE.requests) / len(TRACE.requests)

    def rate(kind: str, batch: int) -> float:
        return batch / (mean_out * tables[kind][batch - 1] / 1000.0)

    pays = found.pays_up_to
    assert abs(found.pays_up_to_rps - rate("speculative", pays)) <= 1e-3 * found.pays_up_to_rps
    for kind, cap, rps in (
        ("plain", found.plain_capacity, found.plain_rps),
        ("speculative", found.spec_capacity, found.spec_rps),
    ):
        assert rps >= rate(kind, cap) * (1 - 1e-3) > 0, kind
        assert all(rate(kind, b) <= rps * (1 + 1e-3) for b in range(1, cap + 1)), kind
