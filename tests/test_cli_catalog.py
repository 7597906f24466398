"""`specgov catalog list`: GPUs, models and drafters, offline (no daemon)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from specgov.controller.cli.main import main
from specgov.simulator.catalog import Catalog


def test_catalog_list_names_every_gpu_model_and_drafter_without_a_daemon() -> None:
    cat = Catalog.load()
    result = CliRunner().invoke(main, ["catalog", "list", "--control-addr", "x"])
    # No daemon option at all: the catalog is local.
    assert result.exit_code == 2 and "--control-addr" in result.output
    result = CliRunner().invoke(main, ["catalog", "list"])
    assert result.exit_code == 0, result.output
    for name in (*cat.gpu_names(), *cat.model_names(), *cat.drafter_names()):
        assert name in result.output, name
    assert "GPUs (--gpu)" in result.output and "drafters (--drafter)" in result.output
    assert "80 GiB" in result.output and "3.35 TB/s" in result.output  # H100, with units
    assert "None" not in result.output


def test_catalog_list_json_and_an_extra_file(tmp_path: Path) -> None:
    data = json.loads(CliRunner().invoke(main, ["catalog", "list", "--output", "json"]).output)
    assert set(data) == {"gpus", "models", "drafters"}
    h100 = next(g for g in data["gpus"] if g["name"] == "h100")
    assert h100["memory_gib"] == 80
    extra = tmp_path / "mine.yaml"
    extra.write_text(
        "gpus:\n  my-gpu:\n    memory_gib: 24\n    hbm_bandwidth_tb_s: 1.0\n    bf16_tflops: 100\n"
    )
    mine = json.loads(
        CliRunner()
        .invoke(main, ["catalog", "list", "--catalog", str(extra), "--output", "json"])
        .output
    )
    assert "my-gpu" in [g["name"] for g in mine["gpus"]]
    bad = tmp_path / "bad.yaml"
    bad.write_text("gpus:\n  broken:\n    memory_gib: -1\n")
    refused = CliRunner().invoke(main, ["catalog", "list", "--catalog", str(bad)])
    assert refused.exit_code == 2 and "bad.yaml" in refused.output
    assert "Traceback" not in refused.output


def test_catalog_show_gives_each_step0_term_with_its_provenance(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["catalog", "show", "eagle3"])
    assert result.exit_code == 0, result.output
    for figure in ("zero_step_extend_scale", "zero_step_verify_scale", "kv_pool_reduction_scale"):
        assert figure in result.output
    assert "draft-extend ms" in result.output and "KV pool:" in result.output
    doc = json.loads(
        CliRunner().invoke(main, ["catalog", "show", "eagle3", "--output", "json"]).output
    )
    fields = doc["fields"]
    assert fields["zero_step_verify_scale"]["kind"] == "assumed"
    assert fields["verify_token_overhead_us"]["kind"] == "fitted"
    for row in doc["step_zero"]["by_batch"]:
        extra = row["step0_ms"] - row["plain_step_ms"]
        terms = row["draft_extend_ms"] + row["verify_bookkeeping_ms"] + row["other_ms"]
        assert terms == pytest.approx(extra, rel=1e-6)
    pool = doc["step_zero"]["kv_pool_tokens"]
    assert pool["speculative"] < pool["plain"]
    assert 0.5 < doc["step_zero"]["saturation"]["step0_throughput_over_plain"] < 1.0
    gpu = CliRunner().invoke(main, ["catalog", "show", "h100", "--output", "json"])
    assert json.loads(gpu.output)["section"] == "gpu"
    missing = CliRunner().invoke(main, ["catalog", "show", "nope"])
    assert missing.exit_code == 2 and "no catalog entry 'nope'" in missing.output
    assert "Traceback" not in missing.output
