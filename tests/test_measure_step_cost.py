"""benchmarks/gpu/measure_step_cost.py end to end on CPU with a tiny configuration.

The script is meant for a GPU (Llama-3.1-8B's architecture, bf16, CUDA); here it runs the
same code on a 2-layer, 64-wide model so that building, timing, CSV, fitting and the
catalog entry are exercised without one, and the entry is loaded by the simulator.
"""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

from specgov.simulator.catalog import Catalog
from specgov.simulator.replay.runner import ServerSpec, parse_policy, prepare_run
from specgov.simulator.workload.traces import Request

for _module in ("torch", "transformers"):
    try:
        __import__(_module)
    except ImportError:
        # Heavy extras outside `make test` (`make extras` installs them); CI requires them.
        _reason = f"{_module} is not installed (`make extras`)"
        if os.environ.get("SPECGOV_REQUIRE_TORCH"):
            pytest.fail(f"{_reason}; SPECGOV_REQUIRE_TORCH is set", pytrace=False)
        pytest.skip(_reason, allow_module_level=True)

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu" / "measure_step_cost.py"


def test_tiny_cpu_run_writes_a_grid_and_a_catalog_entry_replay_loads(tmp_path: Path) -> None:
    out = tmp_path / "step-cost"
    args = ["--config", "tiny", "--device", "cpu", "--dtype", "bfloat16", "--base-gpu", "h100"]
    args += ["--batch-sizes", "1,4", "--tokens-per-request", "1,2", "--kv-lengths", "16,32"]
    args += ["--repeats", "2", "--warmup", "1", "--no-compile", "--name", "tiny-cpu"]
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *args, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "fit over 8 eager target forwards" in proc.stdout
    with (out / "step_cost.csv").open(encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    targets = {
        (int(r["batch_size"]), int(r["tokens_per_request"]), int(r["kv_len"]))
        for r in rows
        if r["component"] == "target"
    }
    assert targets == {(b, t, kv) for b in (1, 4) for t in (1, 2) for kv in (16, 32)}
    assert {r["component"] for r in rows} == {
        "target",
        "draft_step",
        "draft_extend",
        "plain_step",
        "step0_step",
    }
    # Issue 22 §2: step 0 timed against a plain step, its terms fitted as catalog scales.
    assert "step 0 vs a plain step over 4 shapes" in proc.stdout
    assert all(float(r["median_ms"]) > 0 for r in rows)
    entry = out / "catalog_entry.yaml"
    catalog = Catalog.load([entry])
    gpu = catalog.gpu("tiny-cpu")
    assert 0 < gpu.bandwidth_efficiency <= 1 and 0 < gpu.compute_efficiency <= 1
    assert {f for f, _, _ in gpu.provenance} >= {"bandwidth_efficiency", "compute_efficiency"}
    drafter = catalog.drafter("eagle3-tiny-cpu")
    prov = {f: kind for f, kind, _ in drafter.provenance}
    assert prov["zero_step_extend_scale"] == prov["zero_step_verify_scale"] == "fitted"
    assert drafter.zero_step_extend_scale > 0
    server = ServerSpec(gpu="tiny-cpu", drafter="eagle3-tiny-cpu", catalog_files=(entry,))
    result = prepare_run(server, parse_policy("static:2"), seed=0).run(
        [Request(0.0, 64, 16, "chat") for _ in range(2)]
    )
    assert result.completed == 2 and result.decode_time_s > 0


def test_bad_arguments_are_refused_before_any_work(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--batch-sizes", "0,2", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 2
    assert "expected integers >= 1, got '0,2'" in proc.stderr
