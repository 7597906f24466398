"""Fleet simulation: lock-step replicas are the engine's own runs, routers, judging, planning."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from typing import Any

import pytest

from specgov.simulator.engine.interface import EngineResult
from specgov.simulator.planning.fleet import plan_fleet
from specgov.simulator.planning.fleet_engine import (
    FleetSimulationError,
    ReplicaStepper,
    TraceIndexed,
    simulate_fleet,
)
from specgov.simulator.planning.fleet_judge import judge
from specgov.simulator.planning.fleet_model import slot_candidates
from specgov.simulator.planning.fleet_spec import (
    FleetPlanConfig,
    FleetShape,
    FleetSpecError,
    enumerate_fleets,
    parse_mix,
    parse_replicas,
    scale_to_rps,
)
from specgov.simulator.planning.router import (
    LeastLoaded,
    ReplicaLoad,
    RoundRobin,
    RouterSpec,
    RouterSpecError,
    SpecAware,
    SpecAwareBound,
    parse_router,
    parse_routers,
)
from specgov.simulator.replay.metrics import Slo
from specgov.simulator.replay.runner import ServerSpec, parse_policy, prepare_run
from specgov.simulator.workload.synthetic import generate_trace
from specgov.simulator.workload.synthetic_text import parse_synthetic_spec
from specgov.simulator.workload.traces import Request, Trace

TRACE = generate_trace(parse_synthetic_spec("synthetic:duration=20,rate=6,seed=3"))
# Short requests at a load one plain H100 holds and one speculative one does not
# (measured: TPOT p99 20.5 ms plain, 26.5 ms static:3 at 41.8 req/s, SLO 25 ms).
SATURATED = generate_trace(
    parse_synthetic_spec("synthetic:duration=30,rate=40,in=256,out=128,seed=2")
)
SERVER = ServerSpec()

# Every list and counter of a run; the time series too (same origin: the trace's 0).
COMPARED = [f.name for f in dataclasses.fields(EngineResult) if f.name not in ("events", "series")]


def _same(a: EngineResult, b: EngineResult) -> None:
    for name in COMPARED:
        va, vb = getattr(a, name), getattr(b, name)
        if isinstance(va, list) and va and isinstance(va[0], float):
            assert len(va) == len(vb), name
            assert all(
                (math.isnan(x) and math.isnan(y)) or x == y for x, y in zip(va, vb, strict=True)
            ), name
        else:
            assert va == vb, name


def _stepper(policy: str, seed: int = 0) -> ReplicaStepper:
    prepared = prepare_run(SERVER, parse_policy(policy), seed=seed)
    loop = prepared.loop
    return ReplicaStepper(
        prepared.engine,
        speculative=prepared.policy.speculative,
        on_tick=loop.on_tick if loop is not None else None,
        tick_interval_s=loop.config.scrape_interval_s if loop is not None else 1.0,
        metrics=prepared.metrics,
    )


@pytest.mark.parametrize("policy", ["none", "static:3", "sglang-ema", "goodput"])
def test_a_one_replica_fleet_is_the_engines_own_run(policy: str) -> None:
    # The lock-step loop runs exactly Engine.run's iterations: bit for bit, daemon
    # policies (closed loop ticking in virtual time) included.
    alone = prepare_run(SERVER, parse_policy(policy), seed=0).run(TRACE.requests)
    run = simulate_fleet(TRACE.requests, [_stepper(policy)], LeastLoaded())
    _same(run.results[0], alone)
    assert run.results[0].series == alone.series
    assert run.assignment == [0] * len(TRACE.requests)
    assert run.end_s == alone.end_s


@pytest.mark.parametrize("policy", ["none", "static:3"])
def test_round_robin_replicas_equal_standalone_runs_of_their_share(policy: str) -> None:
    # Round-robin ignores state, so each replica must be what one server gives on
    # every other request - with acceptance keyed by the request's trace index.
    run = simulate_fleet(TRACE.requests, [_stepper(policy), _stepper(policy)], RoundRobin())
    assert run.assignment == [i % 2 for i in range(len(TRACE.requests))]
    for r in (0, 1):
        share = [i for i, a in enumerate(run.assignment) if a == r]
        prepared = prepare_run(SERVER, parse_policy(policy), seed=0)
        engine = prepared.engine
        if engine.acceptance is not None:
            engine.acceptance = TraceIndexed(engine.acceptance, share)
        alone = engine.run([TRACE.requests[i] for i in share])
        got = run.results[r]
        for name in ("ttft_s", "tpot_s", "e2e_s", "req_output_tokens", "accepted_drafts"):
            assert getattr(got, name) == pytest.approx(getattr(alone, name), nan_ok=True), name
        assert got.decode_batches == alone.decode_batches


def test_acceptance_is_keyed_by_the_trace_index() -> None:
    calls: list[int] = []

    class Factory:
        def sampler(self, request_index: int, domain: str | None, acc_len: Any = None) -> Any:
            calls.append(request_index)
            return None

    wrapped = TraceIndexed(Factory(), [7, 3, 11])
    wrapped.sampler(1, None)
    wrapped.sampler(2, None)
    assert calls == [3, 11]


class Recording:
    """Least-loaded, recording what it saw at each arrival."""

    name = "recording"

    def __init__(self) -> None:
        self.seen: list[list[ReplicaLoad]] = []

    def choose(self, loads: Sequence[ReplicaLoad]) -> int:
        self.seen.append(list(loads))
        return LeastLoaded().choose(loads)


def test_the_router_counts_a_request_active_until_its_last_forward_ends() -> None:
    router = Recording()
    run = simulate_fleet(TRACE.requests, [_stepper("none"), _stepper("static:3")], router)
    finish: list[list[float]] = []
    for res in run.results:
        finish.append([a + e for a, e in zip(res.req_arrival_s, res.e2e_s, strict=True)])
    for i, loads in enumerate(router.seen):
        t = TRACE.requests[i].arrival_s
        for r, load in enumerate(loads):
            sent = sum(1 for a in run.assignment[:i] if a == r)
            done = sum(1 for f in finish[r] if f <= t)
            assert load.in_flight == sent - done
            assert load.speculative == (r == 1)
    assert any(load.in_flight > 0 for loads in router.seen for load in loads)


def test_unsorted_requests_and_empty_fleets_are_refused() -> None:
    reqs = [Request(1.0, 10, 10), Request(0.5, 10, 10)]
    with pytest.raises(FleetSimulationError, match="sorted by arrival_s"):
        simulate_fleet(reqs, [_stepper("none")], RoundRobin())
    with pytest.raises(FleetSimulationError, match="at least one replica"):
        simulate_fleet(reqs, [], RoundRobin())


# ------------------------------------------------------------------------------- routers


def _loads(*spec_inflight: tuple[bool, int]) -> list[ReplicaLoad]:
    return [ReplicaLoad(i, s, n) for i, (s, n) in enumerate(spec_inflight)]


def test_round_robin_and_least_loaded() -> None:
    rr = RoundRobin()
    loads = _loads((True, 9), (False, 0), (False, 0))
    assert [rr.choose(loads) for _ in range(5)] == [0, 1, 2, 0, 1]
    ll = LeastLoaded()
    assert ll.choose(_loads((True, 3), (False, 1), (False, 1))) == 1  # ties: lowest index
    assert ll.choose(_loads((True, 0), (False, 1))) == 0


def test_spec_aware_scores_predicted_time_per_token() -> None:
    # Speculative replica: 5 ms/token up to batch 2, then 12; plain: 8 ms flat.
    router = SpecAware([0.005, 0.005, 0.012, 0.012], [0.008] * 4)
    assert router.choose(_loads((True, 0), (False, 0))) == 0
    assert router.choose(_loads((True, 1), (False, 0))) == 0
    assert router.choose(_loads((True, 2), (False, 0))) == 1  # batch 3 no longer pays
    # Past a table a request only queues: the score keeps growing.
    assert router.choose(_loads((True, 0), (False, 9))) == 0
    assert router.score(ReplicaLoad(0, False, 7)) == pytest.approx(0.008 * 8 / 4)
    # Homogeneous: the fewest active requests wins, as least-loaded.
    assert router.choose(_loads((False, 3), (False, 2))) == 1
    with pytest.raises(RouterSpecError, match="non-empty and positive"):
        SpecAware([], [0.1])


def test_spec_aware_bound_fills_speculative_replicas_first() -> None:
    router = SpecAwareBound(2)
    assert router.choose(_loads((False, 0), (True, 1))) == 1
    assert router.choose(_loads((False, 0), (True, 2))) == 0  # bound reached: plain
    assert router.choose(_loads((False, 3), (True, 3))) == 0  # ties go to plain
    assert router.choose(_loads((False, 5), (True, 3))) == 1
    assert router.choose(_loads((True, 5), (True, 3))) == 1  # homogeneous: least-loaded


def test_router_names() -> None:
    assert [s.name for s in parse_routers("round-robin, least-loaded,spec-aware:8")] == [
        "round-robin",
        "least-loaded",
        "spec-aware:8",
    ]
    assert parse_router("Spec-Aware") == RouterSpec("spec-aware")
    for bad, match in (
        ("random", "unknown router"),
        ("least-loaded:3", "takes no argument"),
        ("spec-aware:x", "integer >= 1"),
        ("spec-aware:0", "B must be >= 1"),
    ):
        with pytest.raises(RouterSpecError, match=match):
            parse_router(bad)
    with pytest.raises(RouterSpecError, match="given twice"):
        parse_routers("round-robin,round-robin")
    with pytest.raises(RouterSpecError, match="no router"):
        parse_routers(" , ")
    with pytest.raises(RouterSpecError, match="per-token tables"):
        RouterSpec("spec-aware").build()


def test_slot_candidates_follow_the_policy_tables() -> None:
    ema = slot_candidates(parse_policy("sglang-ema"), [1, 2, 4, 8, 16, 32, 64])
    assert ema(1) == (1, 3, 5, 7)
    assert ema(7) == (0, 1, 3)  # padded to the graph size 8: slot 8
    assert ema(40) == (0,)  # padded to 64
    goodput = slot_candidates(parse_policy("goodput"), None)
    assert goodput(300) == (0, 1, 2)
    assert slot_candidates(parse_policy("static:4"), None)(999) == (4,)


# --------------------------------------------------------------------------- fleet specs


def test_fleet_specs() -> None:
    assert parse_replicas("4") == (4,)
    assert parse_replicas("1-3, 6") == (1, 2, 3, 6)
    assert parse_mix(" 2+1 ") == FleetShape(2, 1)
    for bad in ("0", "3-1", "x", "70"):
        with pytest.raises(FleetSpecError):
            parse_replicas(bad)
    for bad in ("2", "a+b", "0+0", "-1+2"):
        with pytest.raises(FleetSpecError, match="n\\+m"):
            parse_mix(bad)
    names = [f.name for f in enumerate_fleets((3,), ["all"])]
    assert names == ["3+0", "2+1", "1+2", "0+3"]
    assert [f.name for f in enumerate_fleets((2,), ["1+3"])] == ["2+0", "0+2", "1+3"]
    kinds = [f.kind for f in enumerate_fleets((), ["1+0", "0+1", "1+1"])]
    assert kinds == ["speculative", "plain", "mixed"]
    with pytest.raises(FleetSpecError, match="give --replicas"):
        enumerate_fleets((), ["all"])
    with pytest.raises(FleetSpecError, match="no fleet"):
        enumerate_fleets((), [])


def test_scale_to_rps() -> None:
    scaled, scale = scale_to_rps(TRACE, 30.0)
    n = len(scaled.requests)
    assert (n - 1) / scaled.duration_s == pytest.approx(30.0)
    assert scale == pytest.approx(30.0 * TRACE.duration_s / (n - 1))
    with pytest.raises(FleetSpecError, match="at least two requests"):
        scale_to_rps(Trace("one", (Request(0.0, 5, 5),), "test"), 3.0)
    with pytest.raises(FleetSpecError, match="positive"):
        scale_to_rps(TRACE, 0.0)


# ------------------------------------------------------------------------------- judging


def test_aborted_requests_are_misses_and_infinite_latencies() -> None:
    # The second request can never fit the KV pool: SGLang rejects it.
    reqs = (Request(0.0, 100, 20), Request(0.1, 5_000_000, 20))
    trace = Trace("abort", reqs, "test")
    run = simulate_fleet(trace.requests, [_stepper("none")], LeastLoaded())
    assert run.results[0].aborted == 1
    slo = Slo(tpot_ms=1000.0, ttft_ms=60_000.0)
    half = judge(run.results, n_requests=2, end_s=run.end_s, slo=slo, pct=50.0)
    assert half["slo_attainment"] == 0.5 and half["meets_slo"] is True
    full = judge(run.results, n_requests=2, end_s=run.end_s, slo=slo, pct=100.0)
    assert full["meets_slo"] is False and full["slo_ttft_at_percentile_ms"] is None
    assert full["ttft_ms"]["p99"] is None  # infinite: not a number in JSON
    assert full["aborted"] == 1 and full["completed"] == 1


def _cfg(**kw: Any) -> FleetPlanConfig:
    args: dict[str, Any] = {
        "fleets": enumerate_fleets((1, 2), []),
        "routers": parse_routers("least-loaded"),
        "policies": ("static:3",),
        "slo": Slo(tpot_ms=25.0, ttft_ms=2000.0),
    }
    args.update(kw)
    return FleetPlanConfig(**args)


def test_the_saturation_case_is_answered_with_plain_replicas() -> None:
    from specgov.simulator.catalog import Catalog
    from specgov.simulator.planning.prices import Prices

    prices = Prices("EUR", {"h100": 2.0}, "test")
    doc = plan_fleet(SATURATED, SERVER, _cfg(prices=prices))
    json.dumps(doc, allow_nan=False)
    rows = {(r["fleet"], r["policy"]): r for r in doc["fleets"]}
    spec1, plain1 = rows[("1+0", "static:3")], rows[("0+1", None)]
    assert not spec1["meets_slo"] and plain1["meets_slo"]
    assert spec1["slo_tpot_at_percentile_ms"] > 25.0 >= plain1["slo_tpot_at_percentile_ms"]
    best = doc["best"]
    assert (best["fleet"], best["kind"]) == ("0+1", "plain")
    assert best["cost_per_hour"] == 2.0
    assert best["cost_per_mtok"] == pytest.approx(2.0 / (best["throughput_tok_s"] * 3600) * 1e6)
    assert doc["best_plain"]["fleet"] == "0+1"
    assert doc["best_speculative"]["fleet"] == "2+0"
    assert doc["saving_vs_plain"]["saved"] == 0.0
    assert "Speculation does not pay at this load: run plain replicas" in doc["recommendation"]
    assert doc["prices"]["currency"] == "EUR"
    # Replica kinds: the plain one has no drafter memory, so a bigger KV pool.
    kinds = doc["replica_kinds"]
    assert kinds["none"]["kv_token_capacity"] > kinds["static:3"]["kv_token_capacity"]
    assert kinds["none"]["launch_args"]["argv"] == []
    assert kinds["static:3"]["launch_args"]["argv"][:2] == ["--speculative-algorithm", "EAGLE3"]
    assert kinds["none"]["vram"]["drafter"] == "none"
    assert Catalog.load().gpu("h100").name == doc["server"]["gpu"]


def test_spec_aware_routes_as_least_loaded_on_homogeneous_fleets_and_is_simulated_once() -> None:
    doc = plan_fleet(
        TRACE,
        SERVER,
        _cfg(
            fleets=enumerate_fleets((2,), ["1+1"]), routers=parse_routers("least-loaded,spec-aware")
        ),
    )
    rows = {(r["fleet"], r["router"]): r for r in doc["fleets"]}
    for fleet in ("2+0", "0+2"):
        ll, sa = rows[(fleet, "least-loaded")], rows[(fleet, "spec-aware")]
        assert sa["routes_as"] == "least-loaded"
        assert sa["goodput_tok_s"] == ll["goodput_tok_s"] and sa["wall_s"] == ll["wall_s"]
    mixed = rows[("1+1", "spec-aware")]
    assert mixed["routes_as"] == "spec-aware"
    # At this light load the speculative replica's batch never leaves where
    # speculation pays: it gets every request.
    assert [p["requests"] for p in mixed["per_replica"]] == [len(TRACE.requests), 0]
    assert mixed["per_replica"][0]["mean_decode_batch_size"] < 20
    kind = doc["replica_kinds"]["static:3"]
    table = kind["predicted_ms_per_token"]
    pays = kind["speculation_pays_up_to_batch"]
    assert 0 < pays < len(table["speculative"])
    assert table["speculative"][pays - 1] < table["plain"][pays - 1]
    assert table["speculative"][pays] >= table["plain"][pays]


def test_spec_aware_sends_plain_replicas_the_load_speculation_cannot_carry() -> None:
    doc = plan_fleet(
        SATURATED,
        SERVER,
        _cfg(
            fleets=enumerate_fleets((), ["1+1"]), routers=parse_routers("spec-aware,spec-aware:4")
        ),
    )
    model, bound = doc["fleets"]
    spec_sent, plain_sent = (p["requests"] for p in model["per_replica"])
    assert spec_sent > 0 and plain_sent > 0
    # The model puts more on the speculative replica than the plain one; a small
    # explicit bound hands the plain replica more (then balances by load).
    assert spec_sent > plain_sent
    assert bound["router"] == "spec-aware:4"
    assert bound["per_replica"][0]["requests"] < spec_sent


def test_a_fleet_that_does_not_fit_is_a_row_with_the_reason() -> None:
    server = ServerSpec(gpu="l40s", model="llama-3.1-70b")
    doc = plan_fleet(TRACE, server, _cfg(fleets=enumerate_fleets((1,), [])))
    assert doc["best"] is None and doc["closest"] is None
    for row in doc["fleets"]:
        assert row["fits"] is False and "first item over the budget" in row["reason"]
    assert doc["replica_kinds"]["none"]["fits"] is False
    assert "No fleet of up to 1 replicas holds the SLO" in doc["recommendation"]


def test_plan_options_are_checked() -> None:
    with pytest.raises(FleetSpecError, match="not speculative"):
        plan_fleet(TRACE, SERVER, _cfg(policies=("none",)))
    with pytest.raises(FleetSpecError, match="given twice"):
        plan_fleet(TRACE, SERVER, _cfg(policies=("static:3", "static:3")))
    with pytest.raises(FleetSpecError, match="slo_percentile"):
        _cfg(slo_percentile=0.0)
    with pytest.raises(FleetSpecError, match="need a policy"):
        _cfg(policies=())


def _row(fleet: str, kind: str, gpus: int, tpot: float, goodput: float) -> dict[str, Any]:
    spec, plain = (int(x) for x in fleet.split("+"))
    return {
        "fleet": fleet,
        "kind": kind,
        "speculative_replicas": spec,
        "plain_replicas": plain,
        "replicas": spec + plain,
        "gpus": gpus,
        "gpu": "h100",
        "policy": "sglang-ema" if spec else None,
        "router": "least-loaded",
        "fits": True,
        "meets_slo": tpot <= 50.0,
        "slo_attainment": 1.0,
        "slo_tpot_at_percentile_ms": tpot,
        "slo_ttft_at_percentile_ms": 200.0,
        "goodput_tok_s": goodput,
        "cost_per_hour": None,
    }


def test_equal_cost_fleets_go_to_the_simpler_then_by_slo_headroom() -> None:
    from specgov.simulator.planning.fleet_judge import choose, recommendation_text, slo_margin

    slo = {"tpot_ms": 50.0, "ttft_ms": 2000.0, "percentile": 99.0}
    rows = [
        _row("2+1", "mixed", 3, 34.0, 9818.0),  # more goodput by noise, less headroom
        _row("0+3", "plain", 3, 27.5, 9800.0),
        _row("2+0", "speculative", 2, 80.0, 500.0),  # cheaper, does not hold
    ]
    assert slo_margin(rows[0], slo) == pytest.approx(34.0 / 50.0)
    picked = choose(rows, priced=False, slo=slo)
    assert picked["best"]["fleet"] == "0+3" and picked["best_plain"]["fleet"] == "0+3"
    # Issue 22 §4: more headroom does not make speculation worth it at the same cost.
    rows[1]["slo_tpot_at_percentile_ms"] = 40.0
    picked = choose(rows, priced=False, slo=slo)
    assert picked["best"]["fleet"] == "0+3"
    doc = {"fleets": rows, "slo": slo, "offered_rps": 40.0, **picked}
    assert "Speculation does not pay at this load" in recommendation_text(doc)
    # Between equal-cost speculative fleets, headroom still decides.
    rows.append(_row("3+0", "speculative", 3, 30.0, 9800.0))
    rows.append(_row("1+2", "mixed", 3, 20.0, 9800.0))
    spec_only = [r for r in rows if r["kind"] != "plain"]
    assert choose(spec_only, priced=False, slo=slo)["best"]["fleet"] == "1+2"


def test_a_daemon_replica_launches_with_the_config_replay_simulates() -> None:
    # The EMA fallback must be exactly SGLang's controller on the launched config, so the
    # launch flags carry specgov's slots and EMA knobs (up_hysteresis) as replay runs them.
    from specgov.policies.engine.adaptive_config import parse_adaptive_config
    from specgov.simulator.planning.fleet_launch import launch_args
    from specgov.simulator.replay.runner import ServerSpec, parse_policy, specgov_adaptive_config

    args = launch_args(parse_policy("goodput"), algorithm="EAGLE3", server=ServerSpec())
    assert args.get("error") is None
    launched = parse_adaptive_config(args["adaptive_config"])
    assert launched == parse_adaptive_config(specgov_adaptive_config())
    assert {s.up_hysteresis for s in launched.slots} == {0.25}
