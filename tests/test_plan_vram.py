"""`specgov plan vram`: the table, the JSON document, exit status and options."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from specgov.controller.cli.main import main
from specgov.simulator.planning.vram import CANDIDATE_PRESETS, parse_candidates


def _run(*args: str) -> tuple[int, Any, str]:
    result = CliRunner().invoke(main, ["plan", "vram", *args])
    try:
        doc = json.loads(result.stdout) if "--output" in args else None
    except ValueError:
        doc = None
    return result.exit_code, doc, result.output


def test_json_document_for_a_fitting_configuration() -> None:
    code, docs, _ = _run("--gpu", "h100", "--candidates", "sglang-default", "--output", "json")
    assert code == 0
    (doc,) = docs
    assert doc["fits"] is True and doc["first_overflow"] is None
    assert doc["candidate_steps"] == [0, 1, 3, 5, 7]
    names = [item["name"] for item in doc["items"]]
    assert names[:3] == ["target weights", "draft weights", "drafter static reserve"]
    assert [t["steps"] for t in doc["cuda_graph_tiers"]] == [0, 1, 3, 5, 7]
    assert sum(item["gib"] for item in doc["items"]) == pytest.approx(doc["total_gib"], abs=1e-3)
    assert doc["kv_pool_tokens"] == doc["sglang_loads_memory"]["token_capacity"] > 100_000
    assert doc["mem_fraction_is_default"] and doc["mem_fraction_static"] == 0.83
    assert doc["assumptions"] and all(isinstance(a, str) for a in doc["assumptions"])


def test_does_not_fit_exits_3_with_the_breakdown_and_first_overflow() -> None:
    code, docs, _ = _run("--gpu", "l40s", "--model", "llama-3.1-70b", "--output", "json")
    assert code == 3
    (doc,) = docs
    assert doc["fits"] is False and doc["first_overflow"] == "target weights"
    assert doc["kv_pool_tokens"] == 0 and doc["overflow_gib"] > 80
    assert "weights 131.5 GiB" in doc["message"]
    code, _, text = _run("--gpu", "l40s", "--model", "llama-3.1-70b")
    assert code == 3
    assert "DOES NOT FIT (first overflow: target weights)" in text
    assert "target weights" in text and "131.50" in text


def test_tensor_parallel_makes_it_fit() -> None:
    code, docs, _ = _run(
        "--gpu", "l40s", "--model", "llama-3.1-70b", "--tp-size", "4", "--output", "json"
    )
    assert code == 0 and docs[0]["fits"] and docs[0]["tp_size"] == 4


def test_several_gpus_one_document_each() -> None:
    code, docs, _ = _run("--gpu", "h100,a100,h200", "--output", "json")
    assert code == 0
    assert [d["gpu"] for d in docs] == ["h100", "a100-80g", "h200"]
    assert docs[2]["kv_pool_tokens"] > docs[0]["kv_pool_tokens"]


def test_options_change_the_numbers() -> None:
    def doc(*args: str) -> dict[str, Any]:
        code, docs, _ = _run(*args, "--output", "json")
        assert code == 0
        result: dict[str, Any] = docs[0]
        return result

    base = doc()
    assert base["candidate_steps"] == [3]
    more = doc("--candidates", "specgov")
    assert more["kv_pool_tokens"] < base["kv_pool_tokens"]
    capped = doc("--max-running-requests", "32")
    assert capped["cuda_graph_max_bs"] == 32 and capped["max_running_requests"] == 32
    assert capped["cuda_graph_tiers"][0]["gib"] < base["cuda_graph_tiers"][0]["gib"]
    low = doc("--mem-fraction-static", "0.7")
    assert low["mem_fraction_static"] == 0.7 and low["kv_pool_tokens"] < base["kv_pool_tokens"]
    tree = doc("--topk", "4", "--num-draft-tokens", "8", "--steps", "5")
    assert tree["shape"] == {"steps": 5, "topk": 4, "num_draft_tokens": 8}
    plain = doc("--drafter", "none")
    assert plain["drafter"] == "none" and plain["candidate_steps"] == []
    assert plain["kv_pool_tokens"] > base["kv_pool_tokens"]
    graphs = doc("--cuda-graph-max-bs", "64")
    assert graphs["cuda_graph_max_bs"] == 64


def test_bad_input_is_one_clear_line() -> None:
    code, _, text = _run("--candidates", "0,x")
    assert code == 2 and "'x' is not a non-negative integer" in text
    assert "Traceback" not in text
    code, _, text = _run("--gpu", "h1000")
    assert code == 2 and "unknown GPU 'h1000'" in text
    code, _, text = _run("--topk", "4")
    assert code == 2 and "needs --num-draft-tokens" in text


def test_parse_candidates() -> None:
    assert parse_candidates(None, 4) == (4,)
    assert parse_candidates("static", 2) == (2,)
    assert parse_candidates("7,1,1,3", 3) == (1, 3, 7)
    assert CANDIDATE_PRESETS["sglang-default"] == (0, 1, 3, 5, 7)
    assert CANDIDATE_PRESETS["specgov"] == tuple(range(8))


def test_report_option(tmp_path: Path) -> None:
    code, _, text = _run("--report", str(tmp_path / "r"))
    if importlib.util.find_spec("specgov.simulator.planning.report") is None:
        assert code == 1 and "the HTML report is not available" in text
    else:
        assert code == 0 and "report: " in text
        assert any((tmp_path / "r").iterdir())


@pytest.mark.parametrize("fraction", ["0.80", "0.83", "0.85", "0.88", "0.90", "0.93"])
def test_fits_never_comes_with_negative_headroom(fraction: str) -> None:
    # Issue 22 §4: `--tp-size 2 --mem-fraction-static 0.85` said FITS with left -0.75 GiB.
    code, docs, _ = _run(
        "--gpu", "h100", "--model", "llama-3.1-70b", "--tp-size", "2", "--drafter", "none",
        "--mem-fraction-static", fraction, "--output", "json",
    )  # fmt: skip
    (doc,) = docs
    assert code == (0 if doc["fits"] else 3)
    if doc["fits"]:
        assert doc["left_gib"] >= 0
        assert next(i["gib"] for i in doc["items"] if i["name"] == "left") >= 0
    elif doc["first_overflow"] == "activation headroom":
        assert doc["overflow_gib"] == pytest.approx(-doc["left_gib"], abs=1e-3)
        assert "short of the activation headroom" in doc["message"]


def test_an_activation_shortfall_does_not_fit_and_says_how_to_fix_it() -> None:
    args = ["--gpu", "h100", "--model", "llama-3.1-70b", "--tp-size", "2", "--drafter", "none"]
    code, _, text = _run(*args, "--mem-fraction-static", "0.85")
    assert code == 3
    assert "DOES NOT FIT (first overflow: activation headroom)" in text
    assert "Use mem_fraction_static <= 0.836" in text
    code, _, text = _run(*args, "--mem-fraction-static", "0.836")
    assert code == 0 and "FITS" in text


def test_the_sweep_agrees_with_plan_vram_on_what_can_run() -> None:
    from specgov.simulator.planning.sweep import SweepSettings, enumerate_jobs, run_job
    from specgov.simulator.workload.synthetic import generate_trace
    from specgov.simulator.workload.synthetic_text import parse_synthetic_spec

    trace = generate_trace(parse_synthetic_spec("synthetic:duration=10,rate=2,seed=1"))
    settings = SweepSettings(mem_fraction_static=0.9)  # 8 GiB of slack on an H100
    (plain,) = enumerate_jobs(
        gpus=["h100"], drafters=["none"], policies=["none"], settings=settings, trace=trace
    )
    row = run_job(plain, trace)
    code, docs, _ = _run("--gpu", "h100", "--drafter", "none", "--mem-fraction-static", "0.9",
                         "--output", "json")  # fmt: skip
    assert code == 3 and docs[0]["fits"] is False
    assert row["status"] == "does-not-fit" and row["fits"] is False
    assert row["reason"] == docs[0]["message"]
