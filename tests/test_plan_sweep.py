"""`specgov plan sweep`: configurations, rows that say why, the document, prices,
the local executor (deterministic per seed, resumable) and the command."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from specgov.controller.cli.main import main
from specgov.simulator.catalog import Catalog
from specgov.simulator.planning.executor import ExecutorError, run_jobs
from specgov.simulator.planning.prices import PriceError, load_prices
from specgov.simulator.planning.search import SearchSettings
from specgov.simulator.planning.sweep import (
    SweepError,
    SweepSettings,
    enumerate_jobs,
    parse_shape_name,
    run_job,
)
from specgov.simulator.planning.sweep_document import build_document
from specgov.simulator.replay.runner import (
    ServerSpec,
    parse_policy,
    prepare_run,
    specgov_adaptive_config,
)
from specgov.simulator.workload.synthetic import generate_trace
from specgov.simulator.workload.synthetic_text import parse_synthetic_spec

TRACE_SPEC = "synthetic:duration=20,rate=4,seed=1"
TRACE = generate_trace(parse_synthetic_spec(TRACE_SPEC))
# A tight TPOT SLO on this small trace: speculation sustains more load than the plain
# server (measured: about 3.5x vs 2.25x the trace's rate), so savings are visible.
SETTINGS = SweepSettings(slo_tpot_ms=12.0, slo_ttft_ms=1000.0, search=SearchSettings(rel_tol=0.2))
CATALOG = Catalog.load()


def _strip(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in row.items() if k != "timing"} for row in rows]


def _jobs(**kwargs: Any) -> list[Any]:
    args: dict[str, Any] = {
        "gpus": ["h100"],
        "drafters": ["eagle3"],
        "policies": ["static:3"],
        "settings": SETTINGS,
        "trace": TRACE,
    }
    args.update(kwargs)
    return enumerate_jobs(**args)


def test_enumeration_puts_the_plain_server_first_and_dedupes_names() -> None:
    jobs = _jobs(
        gpus=["h100", "a100", "a100-80g"],
        drafters=["eagle3", "eagle-3", "none", "ngram"],
        policies=["none", "static:3", "sglang-ema"],
    )
    keys = [(j.gpu, j.drafter, j.policy) for j in jobs]
    assert keys == [
        ("h100", "none", "none"),
        ("h100", "eagle3", "static:3"),
        ("h100", "eagle3", "sglang-ema"),
        ("h100", "ngram", "static:3"),
        ("h100", "ngram", "sglang-ema"),
        ("a100-80g", "none", "none"),
        ("a100-80g", "eagle3", "static:3"),
        ("a100-80g", "eagle3", "sglang-ema"),
        ("a100-80g", "ngram", "static:3"),
        ("a100-80g", "ngram", "sglang-ema"),
    ]
    assert len({j.job_id for j in jobs}) == len(jobs)
    # Shapes multiply the speculative configurations.
    assert len(_jobs(shapes=["chain", "tree4x8"])) == 1 + 2


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"gpus": ["h1000"]}, "unknown GPU 'h1000'"),
        ({"drafters": ["eagle9"]}, "eagle9"),
        ({"policies": ["static:x"]}, "--policies: static:x: parameter 'steps' of static"),
        ({"shapes": ["tree4"]}, "expected 'chain' or 'treeTxD'"),
        ({"gpus": [" "]}, "--gpus: empty name"),
    ],
)
def test_bad_names_fail_before_any_simulation(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _jobs(**kwargs)


def test_shape_names() -> None:
    assert parse_shape_name("chain").topk == 1
    tree = parse_shape_name("Tree4x8")
    assert (tree.topk, tree.num_draft_tokens) == (4, 8)
    with pytest.raises(SweepError):
        parse_shape_name("tree1x8")


def test_settings_validation() -> None:
    with pytest.raises(SweepError, match=r"tpot_percentile must be in \(0, 100\]"):
        SweepSettings(tpot_percentile=0)
    with pytest.raises(SweepError, match="at least one SLO"):
        SweepSettings(slo_tpot_ms=None, slo_ttft_ms=None)


def test_rows_that_cannot_run_say_why_and_never_raise() -> None:
    big = SweepSettings(model="llama-3.1-70b", search=SearchSettings(rel_tol=0.2))
    jobs = enumerate_jobs(
        gpus=["l40s"], drafters=["eagle3"], policies=["static:3"], settings=big, trace=TRACE
    )
    rows = [run_job(job, TRACE) for job in jobs]
    assert [r["status"] for r in rows] == ["does-not-fit", "does-not-fit"]
    assert all(r["fits"] is False and "weights 131.5 GiB" in r["reason"] for r in rows)
    assert rows[1]["vram"]["first_overflow"] == "target weights"
    # SGLang's adaptive speculation needs EAGLE/EAGLE3 and topk 1.
    (ngram_ema,) = [
        run_job(j, TRACE)
        for j in _jobs(drafters=["ngram"], policies=["sglang-ema"])
        if j.drafter == "ngram"
    ]
    assert ngram_ema["status"] == "cannot-run" and "only EAGLE/EAGLE3" in ngram_ema["reason"]
    (tree_ema,) = [
        run_job(j, TRACE)
        for j in _jobs(policies=["sglang-ema"], shapes=["tree4x8"])
        if j.drafter != "none"
    ]
    assert tree_ema["status"] == "cannot-run" and "topk=1" in tree_ema["reason"]


def test_an_slo_nobody_meets_is_a_row_with_zero_rate() -> None:
    tight = SweepSettings(slo_tpot_ms=0.5, search=SearchSettings(min_multiplier=0.25))
    (plain,) = enumerate_jobs(
        gpus=["h100"], drafters=["none"], policies=["none"], settings=tight, trace=TRACE
    )
    row = run_job(plain, TRACE)
    assert row["status"] == "slo-unmet" and row["max_rps"] == 0.0
    assert "not met even at rate multiplier 0.25" in row["reason"]
    assert [p["multiplier"] for p in row["curve"]] == [0.25, 0.5, 1.0]


def test_a_row_matches_the_replay_it_summarises() -> None:
    plain, static = (run_job(j, TRACE) for j in _jobs())
    for row in (plain, static):
        assert row["status"] == "ok" and row["fits"]
        assert row["at_max"]["passed"] and row["at_max"]["tpot_ms"] <= 12.0
        failing = [p for p in row["curve"] if not p["passed"]]
        assert failing and min(p["multiplier"] for p in failing) > row["max_multiplier"]
        base = len(TRACE.requests) / TRACE.duration_s
        assert row["max_rps"] == pytest.approx(row["max_multiplier"] * base)
    assert static["max_rps"] > plain["max_rps"]
    # The row's KV pool is the simulated server's.
    prepared = prepare_run(ServerSpec(gpu="h100"), parse_policy("static:3"), seed=0)
    assert static["vram"]["kv_pool_tokens"] == prepared.memory.kv_token_capacity


def test_percentile_setting_is_used() -> None:
    loose = SweepSettings(
        slo_tpot_ms=12.0,
        slo_ttft_ms=1000.0,
        tpot_percentile=50.0,
        ttft_percentile=50.0,
        search=SearchSettings(rel_tol=0.2),
    )
    (p99,) = [run_job(j, TRACE) for j in _jobs(policies=["none"])]
    (p50,) = [run_job(j, TRACE) for j in _jobs(policies=["none"], settings=loose)]
    assert p50["max_rps"] > p99["max_rps"]


def _prices(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "prices.yaml"
    path.write_text(text)
    return path


# 50 req/s: static:3 saves a replica there (at 40 the longer per-request TPOT tail of
# issue 22 leaves plain and static:3 at 5 replicas each).
TARGET_RPS = 50.0


def test_document_replicas_costs_savings_and_launch(tmp_path: Path) -> None:
    jobs = _jobs(policies=["none", "static:3", "goodput", "sglang-ema"])
    rows, reused = run_jobs(jobs, TRACE, workers=1)
    assert reused == 0
    prices = load_prices(_prices(tmp_path, "currency: EUR\ngpu_hour:\n  h100: 2.0\n"), CATALOG)
    doc = build_document(
        rows,
        trace=TRACE,
        settings=SETTINGS,
        target_rps=TARGET_RPS,
        prices=prices,
        executor={"kind": "local"},
    )
    by = {r["policy"]: r for r in doc["configurations"]}
    mean_out = TRACE.summary()["mean_output_tokens"]
    for row in by.values():
        assert row["replicas"] == math.ceil(TARGET_RPS / row["max_rps"])
        assert row["cost_per_hour"] == row["replicas"] * 2.0
        assert row["cost_per_mtok"] == pytest.approx(
            row["cost_per_hour"] / (TARGET_RPS * mean_out * 3600 / 1e6)
        )
    plain, static = by["none"], by["static:3"]
    assert plain["saving_vs_none"] is None
    saving = static["saving_vs_none"]
    assert saving["replicas"] == plain["replicas"] - static["replicas"] > 0
    assert saving["cost_fraction"] == pytest.approx(
        1 - static["cost_per_hour"] / plain["cost_per_hour"]
    )
    assert saving["capacity_ratio"] == pytest.approx(static["max_rps"] / plain["max_rps"])
    # Launch flags through adapters.launch_config.
    assert plain["launch_args"] == []
    assert static["launch_args"][:4] == [
        "--speculative-algorithm",
        "EAGLE3",
        "--speculative-num-steps",
        "3",
    ]
    assert static["adaptive_config"] is None
    goodput = by["goodput"]
    assert (
        goodput["daemon_policy"] == "goodput" and "--speculative-adaptive" in goodput["launch_args"]
    )
    assert goodput["adaptive_config"] == specgov_adaptive_config()
    assert by["sglang-ema"]["adaptive_config"]["1"]["candidate_steps"] == [1, 3, 5, 7]
    # Best: cheapest, then the most headroom; speculation whose saving lies within the
    # search's resolution (speculation.pays false) costs what the plain server does.
    assert doc["best_by"] == "cost_per_hour"

    def effective(row: dict[str, Any]) -> float:
        verdict = row.get("speculation")
        return plain["cost_per_hour"] if verdict and not verdict["pays"] else row["cost_per_hour"]

    cheapest = min(effective(r) for r in by.values())
    assert effective(doc["best"]) == cheapest
    assert doc["best_per_gpu"]["h100"] == doc["best"]
    assert doc["prices"]["currency"] == "EUR"
    json.dumps(doc, allow_nan=False)  # JSON-clean
    # Without prices: by replicas, no costs.
    bare = build_document(
        rows, trace=TRACE, settings=SETTINGS, target_rps=TARGET_RPS, prices=None, executor={}
    )
    assert bare["best_by"] == "replicas" and bare["prices"] is None
    assert all(r["cost_per_hour"] is None for r in bare["configurations"])
    with pytest.raises(SweepError, match="target_rps must be a positive number"):
        build_document(rows, trace=TRACE, settings=SETTINGS, target_rps=0, prices=None, executor={})


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("gpu_hour: [1, 2]\n", "gpu_hour must be a non-empty mapping"),
        ("gpu_hour:\n  h100: -1\n", "gpu_hour.h100 must be a positive number"),
        ("gpu_hour:\n  h1000: 2\n", "gpu_hour.h1000: unknown GPU 'h1000'"),
        ("gpu_hour:\n  h100: 2\nprice: 3\n", "unknown key"),
        ("gpu_hour:\n  h100: 2\n  h100-sxm: 3\n", "priced twice"),
        ("gpu_hour: {h100: 2\n", r"prices\.yaml:\d+: not valid YAML"),
        ("- 1\n", "expected a mapping"),
        ("currency: ''\ngpu_hour:\n  h100: 2\n", "currency must be a non-empty text"),
    ],
)
def test_bad_prices_name_the_key(tmp_path: Path, text: str, match: str) -> None:
    with pytest.raises(PriceError, match=match):
        load_prices(_prices(tmp_path, text), CATALOG)


def test_missing_price_for_a_swept_gpu(tmp_path: Path) -> None:
    prices = load_prices(_prices(tmp_path, "gpu_hour:\n  a100: 1.5\n"), CATALOG)
    assert prices.gpu_hour == {"a100-80g": 1.5}
    with pytest.raises(PriceError, match="gpu_hour has no price for 'h100'"):
        prices.require(["a100-80g", "h100"])


def test_process_pool_gives_the_same_rows_as_inline() -> None:
    jobs = _jobs(policies=["static:3", "sglang-ema"], drafters=["eagle3", "ngram"])
    inline, _ = run_jobs(jobs, TRACE, workers=1)
    seen: list[tuple[int, int]] = []
    pooled, _ = run_jobs(jobs, TRACE, workers=2, progress=lambda d, t: seen.append((d, t)))
    assert _strip(pooled) == _strip(inline)
    assert seen[0] == (0, len(jobs)) and seen[-1] == (len(jobs), len(jobs))
    assert [d for d, _ in seen] == list(range(len(jobs) + 1))


def test_resume_skips_finished_jobs(tmp_path: Path) -> None:
    jobs = _jobs(policies=["static:3", "static:5"])
    on_disk: list[tuple[int, int]] = []

    def progress(done: int, _total: int) -> None:
        # Each job is on disk by the time its completion is reported.
        on_disk.append((done, len(list((tmp_path / "jobs").glob("*.json")))))

    first, reused = run_jobs(jobs, TRACE, workers=1, results_dir=tmp_path, progress=progress)
    assert reused == 0
    assert on_disk == [(i, i) for i in range(len(jobs) + 1)]
    files = sorted((tmp_path / "jobs").glob("*.json"))
    assert [f.stem for f in files] == sorted(j.job_id for j in jobs)
    # A finished job is not re-run: its stored row comes back as written, timing included.
    again, reused = run_jobs(jobs, TRACE, workers=1, results_dir=tmp_path)
    assert reused == len(jobs) and again == first
    # A lost or corrupt file is run again; a changed input is a new job.
    files[0].unlink()
    files[1].write_text("{not json")
    third, reused = run_jobs(jobs, TRACE, workers=1, results_dir=tmp_path)
    assert reused == len(jobs) - 2 and _strip(third) == _strip(first)
    other = _jobs(policies=["static:3", "static:5"], settings=SweepSettings(seed=1))
    _, reused = run_jobs(other, TRACE, workers=1, results_dir=tmp_path)
    assert reused == 0


def test_executor_arguments() -> None:
    jobs = _jobs()
    with pytest.raises(ExecutorError, match="unknown executor"):
        run_jobs(jobs, TRACE, executor="slurm")
    with pytest.raises(ExecutorError, match="needs executor 'ray'"):
        run_jobs(jobs, TRACE, ray_address="auto")
    with pytest.raises(ExecutorError, match="same job was given twice"):
        run_jobs([jobs[0], jobs[0]], TRACE)


def _sweep(*args: str) -> Any:
    return CliRunner().invoke(
        main,
        [
            "plan",
            "sweep",
            "--trace",
            TRACE_SPEC,
            "--slo-tpot-ms",
            "12",
            "--slo-ttft-ms",
            "1000",
            "--rel-tol",
            "0.2",
            "--workers",
            "1",
            *args,
        ],
    )


def test_command_json(tmp_path: Path) -> None:
    prices = _prices(tmp_path, "gpu_hour:\n  h100: 2.5\n")
    result = _sweep(
        "--drafters",
        "eagle3,ngram",
        "--policies",
        "none,static:3,sglang-ema",
        "--prices",
        str(prices),
        "--target-rps",
        "30",
        "--resume",
        str(tmp_path / "run"),
        "--output",
        "json",
    )
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    statuses = {(r["drafter"], r["policy"]): r["status"] for r in doc["configurations"]}
    assert statuses == {
        ("none", "none"): "ok",
        ("eagle3", "static:3"): "ok",
        ("eagle3", "sglang-ema"): "ok",
        ("ngram", "static:3"): "ok",
        ("ngram", "sglang-ema"): "cannot-run",
    }
    for key in (
        "gpu",
        "drafter",
        "shape",
        "policy",
        "fits",
        "max_rps",
        "replicas",
        "cost_per_hour",
        "cost_per_mtok",
        "launch_args",
    ):
        assert all(key in r for r in doc["configurations"]), key
    assert doc["target_rps"] == 30 and doc["best"]["cost_per_hour"] is not None
    assert doc["executor"] == {"kind": "local", "workers": 1, "jobs": 5, "reused": 0}
    again = _sweep(
        "--drafters",
        "eagle3,ngram",
        "--policies",
        "none,static:3,sglang-ema",
        "--prices",
        str(prices),
        "--target-rps",
        "30",
        "--resume",
        str(tmp_path / "run"),
        "--output",
        "json",
    )
    assert json.loads(again.stdout)["executor"]["reused"] == 5


def test_command_table_and_errors(tmp_path: Path) -> None:
    result = _sweep("--policies", "static:3")
    assert result.exit_code == 0, result.output
    assert "best on h100:" in result.stdout and "sglang flags:" in result.stdout
    bad = _sweep("--ray-address", "auto")
    assert bad.exit_code == 2 and "--ray-address needs --executor ray" in bad.output
    prices = _prices(tmp_path, "gpu_hour:\n  a100: 1\n")
    missing = _sweep("--prices", str(prices))
    assert missing.exit_code == 2 and "no price for 'h100'" in missing.output
    assert "Traceback" not in missing.output
    nofile = _sweep("--trace", str(tmp_path / "nope.csv"))
    assert nofile.exit_code == 2 and "does not exist" in nofile.output


def test_command_report(tmp_path: Path) -> None:
    import importlib.util

    out = tmp_path / "report"
    result = _sweep("--policies", "static:3", "--report", str(out))
    if importlib.util.find_spec("specgov.simulator.planning.report") is None:
        assert result.exit_code == 1 and "the HTML report is not available" in result.output
        return
    assert result.exit_code == 0, result.output
    html = (out / "index.html").read_text()
    assert "static:3" in html and "h100" in html
    assert json.loads((out / "data" / "sweep.json").read_text())["configurations"]
