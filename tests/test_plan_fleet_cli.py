"""`specgov plan fleet` end to end through click's CliRunner: every option has an effect."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from specgov.controller.cli.main import main

TRACE = "synthetic:duration=10,rate=4,seed=1"
SATURATED = "synthetic:duration=30,rate=40,in=256,out=128,seed=2"


def _run(*args: str) -> Result:
    return CliRunner().invoke(main, ["plan", "fleet", *args], catch_exceptions=False)


def _json(*args: str) -> dict[str, Any]:
    result = _run("--output", "json", *args)
    assert result.exit_code == 0, result.output
    doc: dict[str, Any] = json.loads(result.output)
    return doc


def _base(*extra: str) -> dict[str, Any]:
    return _json("--trace", TRACE, "--replicas", "1", "--routers", "least-loaded", *extra)


def test_defaults_simulate_every_mix_and_router() -> None:
    doc = _json("--trace", TRACE, "--replicas", "2")
    fleets = {(r["fleet"], r["router"]) for r in doc["fleets"]}
    assert {f for f, _ in fleets} == {"2+0", "1+1", "0+2"}
    assert {r for _, r in fleets} == {"round-robin", "least-loaded", "spec-aware"}
    assert {r["policy"] for r in doc["fleets"]} == {"sglang-ema", None}
    assert doc["slo"] == {"tpot_ms": 50.0, "ttft_ms": 2000.0, "percentile": 99.0}
    assert doc["best"] is not None and doc["best"]["replicas"] == 2


def test_table_output_marks_the_best_fleet_and_says_what_to_run() -> None:
    result = _run("--trace", TRACE, "--replicas", "1", "--routers", "least-loaded")
    assert result.exit_code == 0, result.output
    assert "1+0 *" in result.output or "0+1 *" in result.output
    assert "Run 1 " in result.output and "req/s" in result.output


def test_mix_and_replicas() -> None:
    doc = _json("--trace", TRACE, "--mix", "1+2,3+0", "--routers", "round-robin")
    assert [r["fleet"] for r in doc["fleets"]] == ["3+0", "1+2"]
    doc = _base("--mix", "none")
    assert [r["fleet"] for r in doc["fleets"]] == ["1+0", "0+1"]
    doc = _json("--trace", TRACE, "--replicas", "2", "--mix", "none", "--routers", "round-robin")
    assert [r["fleet"] for r in doc["fleets"]] == ["2+0", "0+2"]


def test_policies_and_routers() -> None:
    args = ["--trace", TRACE, "--mix", "1+1", "--policies", "static:2"]
    doc = _json(*args, "--policies", "sglang-ema", "--routers", "spec-aware:3,round-robin")
    got = [(r["policy"], r["router"]) for r in doc["fleets"]]
    assert got == [
        ("static:2", "spec-aware:3"),
        ("static:2", "round-robin"),
        ("sglang-ema", "spec-aware:3"),
        ("sglang-ema", "round-robin"),
    ]
    assert doc["replica_kinds"]["static:2"]["launch_args"]["argv"][3] == "2"


def test_rate_options() -> None:
    doc = _base("--target-rps", "9")
    assert doc["offered_rps"] == pytest.approx(9.0)
    assert doc["target_rps"] == 9.0 and doc["rate_scale"] > 1
    plain = _base()
    doubled = _base("--rate-scale", "2")
    assert doubled["offered_rps"] == pytest.approx(2 * plain["offered_rps"])
    result = _run("--trace", TRACE, "--replicas", "1", "--rate-scale", "2", "--target-rps", "3")
    assert result.exit_code == 2 and "give one" in result.output


def test_trace_selection_options() -> None:
    full = _base()["trace"]["requests"]
    assert _base("--max-requests", "7")["trace"]["requests"] == 7
    half = _base("--sample", "0.5")["trace"]
    assert half["requests"] == round(full * 0.5)
    windowed = _base("--window-start-s", "2", "--window-end-s", "6")["trace"]
    assert 0 < windowed["requests"] < full and windowed["duration_s"] < 4.0
    # --seed draws the sample (and the acceptance streams).
    a = _base("--sample", "0.5", "--seed", "1")["fleets"][0]["output_tokens"]
    b = _base("--sample", "0.5", "--seed", "2")["fleets"][0]["output_tokens"]
    assert a != b


def test_azure_trace_and_format(azure_trace_dir: Path) -> None:
    conv = str(azure_trace_dir / "AzureLLMInferenceTrace_conv.csv")
    args = ["--trace", conv, "--format", "azure", "--max-requests", "40", "--replicas", "1"]
    doc = _json(*args, "--routers", "least-loaded")
    assert doc["trace"]["requests"] == 40 and doc["trace"]["source"].startswith("azure:")
    result = _run("--trace", conv, "--format", "mooncake", "--replicas", "1")
    assert result.exit_code == 2 and "Error" in result.output


def test_server_options(tmp_path: Path) -> None:
    base = _base()
    assert base["server"]["gpu"] == "h100" and base["server"]["model"] == "llama-3.1-8b"
    a100 = _base("--gpu", "a100")
    assert a100["server"]["gpu"] == "a100-80g"
    assert (
        a100["fleets"][0]["slo_tpot_at_percentile_ms"]
        > base["fleets"][0]["slo_tpot_at_percentile_ms"]
    )
    small = _base("--model", "llama-3.2-1b", "--drafter", "ngram", "--policies", "static:2")
    assert small["server"]["model"] == "llama-3.2-1b" and small["server"]["drafter"] == "ngram"
    steps = _base("--spec-steps", "5")
    argv = steps["replica_kinds"]["sglang-ema"]["launch_args"]["argv"]
    assert argv[argv.index("--speculative-num-steps") + 1] == "5"
    profile = _base("--acceptance-profile", "ngram")
    assert profile["server"]["acceptance_profile"] == "ngram"
    accept = [doc["fleets"][0]["per_replica"][0]["mean_accept_length"] for doc in (base, profile)]
    assert accept[0] != accept[1]
    capped = _base("--max-running-requests", "2", "--target-rps", "20")
    assert capped["fleets"][0]["per_replica"][0]["mean_decode_batch_size"] <= 2.0
    assert "--max-running-requests" in capped["replica_kinds"]["none"]["launch_args"]["argv"]
    mem = _base("--mem-fraction-static", "0.6")
    assert mem["replica_kinds"]["none"]["vram"]["mem_fraction_static"] == 0.6
    assert (
        mem["replica_kinds"]["none"]["kv_token_capacity"]
        < base["replica_kinds"]["none"]["kv_token_capacity"]
    )
    catalog = tmp_path / "gpus.yaml"
    catalog.write_text(
        "gpus:\n  toy-gpu:\n    memory_gib: 80\n    hbm_bandwidth_tb_s: 1.0\n    bf16_tflops: 300\n"
    )
    toy = _base("--catalog", str(catalog), "--gpu", "toy-gpu")
    assert toy["server"]["gpu"] == "toy-gpu"


def test_slo_options_change_the_verdict() -> None:
    loose = _base("--target-rps", "12")
    assert all(r["meets_slo"] for r in loose["fleets"])
    tight = _base("--target-rps", "12", "--slo-tpot-ms", "5")
    assert not any(r["meets_slo"] for r in tight["fleets"]) and tight["best"] is None
    ttft = _base("--target-rps", "12", "--slo-ttft-ms", "1")
    assert not any(r["meets_slo"] for r in ttft["fleets"])
    p50 = _base("--target-rps", "12", "--slo-percentile", "50")
    p99 = loose
    assert (
        p50["fleets"][0]["slo_tpot_at_percentile_ms"]
        < p99["fleets"][0]["slo_tpot_at_percentile_ms"]
    )


def test_prices_rank_by_cost(tmp_path: Path) -> None:
    prices = tmp_path / "prices.yaml"
    prices.write_text("currency: EUR\ngpu_hour:\n  h100: 3.0\n")
    args = ["--trace", SATURATED, "--replicas", "1-2", "--policies", "static:3"]
    args += ["--routers", "least-loaded", "--slo-tpot-ms", "25", "--prices", str(prices)]
    doc = _json(*args)
    assert doc["best"]["fleet"] == "0+1" and doc["best"]["cost_per_hour"] == 3.0
    assert all(r["cost_per_hour"] == 3.0 * r["gpus"] for r in doc["fleets"])
    assert "3.00 EUR/h" in doc["recommendation"]
    other = tmp_path / "a100.yaml"
    other.write_text("gpu_hour:\n  a100: 1.0\n")
    result = _run("--trace", TRACE, "--replicas", "1", "--prices", str(other))
    assert result.exit_code == 2 and "no price for 'h100'" in result.output


def test_report_folder(tmp_path: Path) -> None:
    out = tmp_path / "report"
    doc = _base("--report", str(out))
    assert doc["report"] == str(out / "index.html")
    assert (out / "index.html").is_file() and (out / "figures" / "fleets.png").is_file()
    saved = json.loads((out / "data" / "fleet.json").read_text())
    assert saved["fleets"] == doc["fleets"]
    table = _run("--trace", TRACE, "--replicas", "1", "--report", str(tmp_path / "t"))
    assert table.exit_code == 0 and "report: " in table.output


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (["--replicas", "0"], 2, "must be >= 1"),
        (["--mix", "2-2"], 2, "expected n+m"),
        (["--replicas", "1", "--routers", "random"], 2, "unknown router"),
        (["--replicas", "1", "--policies", "none"], 2, "not speculative"),
        (["--replicas", "1", "--policies", "static:x"], 2, "static:K"),
        (["--replicas", "1", "--gpu", "tpu"], 2, "unknown GPU"),
        ([], 2, "give --replicas"),
    ],
)
def test_bad_input_is_one_clear_line(args: list[str], code: int, message: str) -> None:
    result = _run("--trace", TRACE, *args)
    assert result.exit_code == code
    assert message in result.output
    assert "Traceback" not in result.output
