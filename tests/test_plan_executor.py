"""`plan sweep` executor: a job that raises stops the sweep with one typed, one-line
error naming its configuration, and the rows already computed are kept for --resume."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from specgov.controller.cli.main import main
from specgov.simulator.planning import executor as executor_mod
from specgov.simulator.planning.executor import ExecutorError, JobFailedError, run_jobs
from specgov.simulator.planning.search import SearchSettings
from specgov.simulator.planning.sweep import JobSpec, SweepSettings, enumerate_jobs, run_job
from specgov.simulator.workload.synthetic import generate_trace
from specgov.simulator.workload.synthetic_text import parse_synthetic_spec

TRACE_SPEC = "synthetic:duration=10,rate=2,seed=3"
TRACE = generate_trace(parse_synthetic_spec(TRACE_SPEC))
SETTINGS = SweepSettings(slo_tpot_ms=12.0, slo_ttft_ms=1000.0, search=SearchSettings(rel_tol=0.3))


def _jobs(policies: list[str]) -> list[JobSpec]:
    return enumerate_jobs(
        gpus=["h100"], drafters=["eagle3"], policies=policies, settings=SETTINGS, trace=TRACE
    )


def _on_disk(results_dir: Path) -> dict[str, dict[str, Any]]:
    out = {}
    for path in (results_dir / "jobs").iterdir():
        record = json.loads(path.read_text(encoding="utf-8"))
        out[record["job_id"]] = record["row"]
    return out


def _strip(row: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in row.items() if k != "timing"}


def _broken(job: JobSpec) -> JobSpec:
    # A job the engine cannot start (its policy does not parse): raises in any process.
    return dataclasses.replace(job, policy="no-such-policy")


def test_a_raising_job_is_one_line_naming_its_configuration_and_keeps_finished_rows(
    tmp_path: Path,
) -> None:
    plain, static3 = _jobs(["static:3"])
    bad = _broken(static3)
    with pytest.raises(JobFailedError) as caught:
        run_jobs([plain, bad, static3], TRACE, workers=1, results_dir=tmp_path)
    err = caught.value
    assert isinstance(err, ExecutorError)  # what the CLI catches
    assert err.config == {
        "gpu": "h100",
        "drafter": "eagle3",
        "shape": "chain",
        "policy": "no-such-policy",
        "job_id": bad.job_id,
    }
    assert err.reason.startswith("PolicySpecError: ") and "\n" not in err.reason
    text = str(err)
    assert "\n" not in text and "policy=no-such-policy" in text and err.reason in text
    assert f"1 of 3 jobs are done and kept in {tmp_path}" in text
    # The job done before the failure is on disk; the one after it never ran.
    assert list(err.finished) == [plain.job_id]
    assert _on_disk(tmp_path) == err.finished
    # Resuming without the broken job reuses the kept row and runs only the rest.
    rows, reused = run_jobs([plain, static3], TRACE, workers=1, results_dir=tmp_path)
    assert reused == 1 and rows[0] == err.finished[plain.job_id]
    assert rows[1]["status"] == "ok"


def test_an_engine_exception_is_wrapped_with_its_first_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    plain, static3 = _jobs(["static:3"])

    def exploding(job: JobSpec, trace: Any) -> dict[str, Any]:
        if job.policy == "static:3":
            raise ZeroDivisionError("engine exploded\n  at step 12")
        return run_job(job, trace)

    monkeypatch.setattr(executor_mod, "run_job", exploding)
    with pytest.raises(JobFailedError) as caught:
        run_jobs([plain, static3], TRACE, workers=1)
    err = caught.value
    assert err.reason == "ZeroDivisionError: engine exploded"
    assert err.config["policy"] == "static:3"
    assert "1 of 2 jobs were done (kept only with --resume DIR)" in str(err)
    assert list(err.finished) == [plain.job_id]


def test_a_failing_job_on_the_process_pool_keeps_the_jobs_that_were_running(
    tmp_path: Path,
) -> None:
    jobs = _jobs(["static:3", "static:5"])
    bad = _broken(jobs[1])
    inline, _ = run_jobs(jobs, TRACE, workers=1)
    expected = {j.job_id: _strip(r) for j, r in zip(jobs, inline, strict=True)}
    with pytest.raises(JobFailedError) as caught:
        run_jobs([bad, *jobs], TRACE, workers=2, results_dir=tmp_path)
    err = caught.value
    assert err.config["job_id"] == bad.job_id
    assert err.reason.startswith("PolicySpecError: ")
    # The plain job started beside the broken one: it ran to its end and was kept. Jobs
    # queued behind may or may not have started (the pool hands out one ahead); every
    # kept row is on disk and is the row the job gives anywhere.
    assert jobs[0].job_id in err.finished
    assert _on_disk(tmp_path) == err.finished
    assert {k: _strip(v) for k, v in err.finished.items()} == {k: expected[k] for k in err.finished}
    assert bad.job_id not in err.finished


def test_a_worker_with_another_specgov_version_fails_the_job() -> None:
    (plain,) = enumerate_jobs(
        gpus=["h100"], drafters=["none"], policies=["none"], settings=SETTINGS, trace=TRACE
    )
    other = dataclasses.replace(plain, version="0.0.0-other")
    with pytest.raises(JobFailedError, match=r"WorkerMismatchError: this worker runs specgov"):
        run_jobs([other], TRACE, workers=1)


def test_a_catalog_edited_during_the_sweep_fails_the_job_instead_of_writing_a_row(
    tmp_path: Path,
) -> None:
    catalog = tmp_path / "cat.yaml"
    catalog.write_text(
        "gpus:\n  my-gpu: {memory_gib: 80, hbm_bandwidth_tb_s: 3.35, bf16_tflops: 989}\n"
    )
    settings = dataclasses.replace(SETTINGS, catalog_files=(str(catalog),))
    (plain,) = enumerate_jobs(
        gpus=["my-gpu"], drafters=["none"], policies=["none"], settings=settings, trace=TRACE
    )
    catalog.write_text(
        "gpus:\n  my-gpu: {memory_gib: 80, hbm_bandwidth_tb_s: 2.0, bf16_tflops: 989}\n"
    )
    results = tmp_path / "results"
    with pytest.raises(JobFailedError, match=r"is not the one the sweep was planned with"):
        run_jobs([plain], TRACE, workers=1, results_dir=results)
    assert not any((results / "jobs").iterdir())  # no row keyed by data it did not use
    # A node without the file (a Ray worker elsewhere): the job fails, it is no row.
    catalog.unlink()
    with pytest.raises(JobFailedError, match=r"cannot read the sweep's catalog: .*cat.yaml"):
        run_jobs([plain], TRACE, workers=1, results_dir=results)
    assert not any((results / "jobs").iterdir())


def test_a_result_that_cannot_be_written_is_an_executor_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (plain,) = enumerate_jobs(
        gpus=["h100"], drafters=["none"], policies=["none"], settings=SETTINGS, trace=TRACE
    )

    def full(src: Any, dst: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", full)
    with pytest.raises(ExecutorError, match=r"cannot write the result of job .*No space left"):
        run_jobs([plain], TRACE, workers=1, results_dir=tmp_path)
    monkeypatch.undo()
    # The interrupted write left no temporary file behind.
    assert list((tmp_path / "jobs").iterdir()) == []


def test_the_cli_prints_the_failure_in_one_line_and_exits_1(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    def exploding(job: JobSpec, trace: Any) -> dict[str, Any]:
        if job.drafter != "none":
            raise KeyError("slot 7")
        return run_job(job, trace)

    monkeypatch.setattr(executor_mod, "run_job", exploding)
    result = CliRunner().invoke(
        main,
        [
            "plan",
            "sweep",
            "--trace",
            TRACE_SPEC,
            "--drafters",
            "eagle3",
            "--policies",
            "static:3",
            "--rel-tol",
            "0.3",
            "--workers",
            "1",
            "--resume",
            str(tmp_path),
        ],
    )
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    (line,) = [ln for ln in result.output.splitlines() if ln.startswith("Error:")]
    assert "drafter=eagle3 shape=chain policy=static:3" in line
    assert "failed: KeyError: 'slot 7'" in line
    assert f"--resume {tmp_path}" in line
    assert len(list((tmp_path / "jobs").glob("*.json"))) == 1  # the plain row, kept
