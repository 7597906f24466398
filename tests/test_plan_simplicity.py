"""Plans never recommend what saves nothing (issue 22 §4): ties go to the simpler
configuration, speculation is recommended only when it saves replicas (beyond the
sweep's resolution) or meets an SLO the plain server cannot, and the plan says which."""

from __future__ import annotations

from typing import Any

from specgov.simulator.planning.fleet_judge import choose, recommendation_text
from specgov.simulator.planning.simplicity import complexity, speculation_verdict
from specgov.simulator.planning.sweep import SweepSettings
from specgov.simulator.planning.sweep_document import build_document
from specgov.simulator.workload.synthetic import generate_trace
from specgov.simulator.workload.synthetic_text import parse_synthetic_spec

TRACE = generate_trace(parse_synthetic_spec("synthetic:duration=20,rate=4,seed=1"))
SETTINGS = SweepSettings()


def _row(
    drafter: str,
    policy: str,
    max_rps: float | None,
    fail_rps: float | None = None,
    *,
    gpu: str = "h100",
    status: str = "ok",
) -> dict[str, Any]:
    """A sweep row as run_job writes it: the search's passing point and, above it, the
    lowest failing one (the bracket)."""
    curve = []
    if max_rps:
        curve.append({"rps": max_rps, "passed": True})
    if fail_rps is not None:
        curve.append({"rps": fail_rps, "passed": False})
    plain = drafter == "none"
    return {
        "id": f"{gpu}-{drafter}-{policy}",
        "gpu": gpu,
        "model": "llama-3.1-8b",
        "drafter": drafter,
        "shape": {
            "name": "plain" if plain else "chain",
            "steps": 0 if plain else 3,
            "topk": 0 if plain else 1,
            "num_draft_tokens": 0 if plain else 4,
            "candidate_steps": [] if plain else [3],
        },
        "policy": policy,
        "status": status,
        "reason": None,
        "fits": True,
        "vram": None,
        "max_multiplier": None if max_rps is None else max_rps / 4,
        "max_rps": max_rps,
        "capped": False,
        "at_max": None,
        "curve": curve,
        "replicas": None,
        "cost_per_hour": None,
        "cost_per_mtok": None,
        "cost_per_mtok_at_capacity": None,
        "saving_vs_none": None,
        "speculation": None,
        "launch_args": None,
        "launch_shell": None,
        "adaptive_config": None,
        "launch_error": None,
        "daemon_policy": None,
        "timing": {"wall_s": 0.0, "cpu_s": 0.0, "evals": 0},
    }


def _doc(rows: list[dict[str, Any]], target_rps: float = 40.0) -> dict[str, Any]:
    return build_document(
        rows, trace=TRACE, settings=SETTINGS, target_rps=target_rps, prices=None, executor={}
    )


def _by(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {r["policy"]: r for r in doc["configurations"]}


def test_equal_replicas_go_to_the_plain_server() -> None:
    # The README's H100 case: speculation sustains a little more, but 4 replicas either way.
    doc = _doc([_row("none", "none", 10.2, 10.8), _row("eagle3", "goodput", 10.5, 11.0)])
    assert doc["best"]["drafter"] == "none"
    assert doc["best_per_gpu"]["h100"]["drafter"] == "none"
    verdict = _by(doc)["goodput"]["speculation"]
    assert verdict["pays"] is False and verdict["because"] is None
    assert "saves nothing: 4 replica(s), as many as the plain server" in verdict["detail"]
    assert doc["recommendation"].startswith("the plain server: no speculative configuration")


def test_a_saving_within_the_search_bracket_is_no_saving() -> None:
    # Plain passes 13.0 and fails 14.0 req/s: at 40 req/s it needs 4 replicas at 13.0, but
    # 3 if its limit is near 14.0; speculation's 3 replicas at 13.5 may be the search's
    # tolerance, not a saving.
    doc = _doc([_row("none", "none", 13.0, 14.0), _row("eagle3", "static:3", 13.5, 14.5)])
    spec = _by(doc)["static:3"]
    assert (spec["replicas"], _by(doc)["none"]["replicas"]) == (3, 4)
    assert spec["speculation"]["pays"] is False
    assert "within the sweep's resolution" in spec["speculation"]["detail"]
    assert doc["best"]["drafter"] == "none"


def test_speculation_that_saves_replicas_is_recommended_and_says_so() -> None:
    doc = _doc([_row("none", "none", 10.0, 10.5), _row("eagle3", "static:3", 20.5, 21.5)])
    assert doc["best"]["policy"] == "static:3"
    verdict = doc["best"]["speculation"]
    assert verdict == {
        "pays": True,
        "because": "replicas",
        "detail": "saves 2 replica(s): 2 instead of 4 plain",
    }
    assert doc["recommendation"] == "speculation pays: saves 2 replica(s): 2 instead of 4 plain"


def test_among_speculative_ties_static_beats_sglang_adaptive_beats_a_daemon_policy() -> None:
    rows = [
        _row("none", "none", 10.0, 10.5),
        _row("eagle3", "goodput", 21.0, 22.0),
        _row("eagle3", "sglang-ema", 20.8, 21.5),
        _row("eagle3", "static:3", 20.5, 21.5),
    ]
    assert _doc(rows)["best"]["policy"] == "static:3"
    assert _doc(rows[:3])["best"]["policy"] == "sglang-ema"
    assert [complexity(r) for r in rows] == [0, 3, 2, 1]


def test_speculation_that_meets_an_slo_plain_cannot_pays_on_the_slo() -> None:
    doc = _doc(
        [_row("none", "none", 0.0, 0.1, status="slo-unmet"), _row("eagle3", "static:3", 5.0)]
    )
    assert doc["best"]["policy"] == "static:3"
    assert doc["best"]["speculation"]["because"] == "slo"


def test_the_verdict_is_against_the_plain_server_of_the_same_gpu() -> None:
    plain = _row("none", "none", 10.0, 10.5)
    plain["replicas"] = 4
    spec = _row("eagle3", "static:3", 14.0, 15.0)
    spec["replicas"] = 3
    assert speculation_verdict(spec, plain, target_rps=40.0)["because"] == "replicas"
    assert speculation_verdict(spec, None, target_rps=40.0)["because"] == "slo"


def _fleet(kind: str, gpus: int, *, policy: str = "goodput", spec: int = 0) -> dict[str, Any]:
    return {
        "kind": kind,
        "fleet": f"{gpus} {kind}",
        "gpus": gpus,
        "replicas": gpus,
        "speculative_replicas": spec,
        "plain_replicas": gpus - spec,
        "policy": policy if spec else "none",
        "router": "least-loaded",
        "gpu": "h100",
        "fits": True,
        "meets_slo": True,
        "slo_attainment": 1.0,
        "slo_tpot_at_percentile_ms": 30.0 if kind == "plain" else 20.0,
        "slo_ttft_at_percentile_ms": 500.0,
        "goodput_tok_s": 1000.0 if kind == "plain" else 1100.0,
        "cost_per_hour": None,
    }


def test_plan_fleet_prefers_plain_replicas_at_the_same_cost() -> None:
    # The README's fleet case: 4 speculative replicas hold the SLO with more headroom, 4
    # plain ones hold it too: same cost, so the plain fleet.
    rows = [_fleet("speculative", 4, spec=4), _fleet("plain", 4)]
    slo = {"tpot_ms": 50.0, "ttft_ms": 2000.0, "percentile": 99.0}
    chosen = choose(rows, priced=False, slo=slo)
    assert chosen["best"]["kind"] == "plain"
    doc = {**chosen, "offered_rps": 40.0, "fleets": rows, "slo": slo, "prices": None}
    assert "Speculation does not pay at this load" in recommendation_text(doc)
    # One GPU fewer: speculation pays, and the text says by how much.
    rows[0] = _fleet("speculative", 3, spec=3)
    chosen = choose(rows, priced=False, slo=slo)
    assert chosen["best"]["kind"] == "speculative"
    doc = {**chosen, "offered_rps": 40.0, "fleets": rows, "slo": slo, "prices": None}
    assert "Speculation saves 1 GPUs against the best plain fleet" in recommendation_text(doc)


# ------------------------------------------------------------------- add host cache or GPUs?


def _host(row: dict[str, Any], gb: int) -> dict[str, Any]:
    return {**row, "id": f"{row['id']}-host{gb}", "hicache_size_gb": gb}


def test_host_cache_that_saves_replicas_is_the_answer_and_the_best() -> None:
    rows = [
        _host(_row("none", "none", 10.0, 10.5), 0),
        _host(_row("none", "none", 20.5, 21.5), 64),
    ]
    doc = _doc(rows)
    answer = doc["host_cache_or_gpus"]["h100"]
    assert answer["answer"] == "add host cache: 64 GB per GPU needs 2 replica(s) instead of 4"
    assert answer["with"][0]["pays"] and answer["with"][0]["saves_replicas"] == 2
    assert doc["best"]["hicache_size_gb"] == 64
    assert doc["best"]["launch_args"][-3:] == [
        "--enable-hierarchical-cache",
        "--hicache-size",
        "64",
    ]


def test_host_cache_that_saves_nothing_is_not_recommended() -> None:
    # 4 replicas at 10.0 and at 10.4 req/s (plain's bracket reaches 10.8): add GPUs.
    rows = [
        _host(_row("none", "none", 10.0, 10.8), 0),
        _host(_row("none", "none", 10.4, 10.9), 64),
    ]
    doc = _doc(rows)
    answer = doc["host_cache_or_gpus"]["h100"]["answer"]
    assert answer.startswith("add GPUs: the trace has no prefix block ids")
    assert doc["best"]["hicache_size_gb"] == 0
    # Without a host cache size swept, the plan has no such answer.
    assert _doc([_host(_row("none", "none", 10.0, 10.8), 0)])["host_cache_or_gpus"] is None


def test_plan_sweep_answers_host_cache_or_gpus_end_to_end() -> None:
    import json

    from click.testing import CliRunner

    from specgov.controller.cli.main import main

    # Multi-turn chat on a small KV pool: prefills of growing prompts bound the TTFT, and
    # a host tier keeps the evicted turns (measured: 2.6 vs 4.1 req/s per replica).
    trace = (
        "synthetic:duration=120,rate=3,turns=5,think=8,turn_in=200,phases=chat@120,"
        "chat.in=1500,chat.out=200,seed=4"
    )
    args = ["plan", "sweep", "--trace", trace, "--gpus", "h100", "--drafters", "none",
            "--policies", "none", "--mem-fraction-static", "0.25", "--slo-ttft-ms", "600",
            "--target-rps", "20", "--workers", "1", "--rel-tol", "0.1"]  # fmt: skip
    result = CliRunner().invoke(main, [*args, "--hicache-sizes", "0,20", "--output", "json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    by_size = {r["hicache_size_gb"]: r for r in doc["configurations"]}
    assert by_size[20]["max_rps"] > 1.2 * by_size[0]["max_rps"]
    assert doc["host_cache_or_gpus"]["h100"]["answer"].startswith("add host cache: 20 GB")
    bad = CliRunner().invoke(main, [*args, "--hicache-sizes", "0,lots"])
    assert bad.exit_code == 2 and "--hicache-sizes '0,lots': expected whole GB" in bad.output
