"""`plan sweep --resume DIR`: what a finished job is recognised by (the catalog's data
and the specgov version, not only file names), and the temporary files interrupted
writes leave (removed at start and on failure; one atomic-write helper)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import pytest

from specgov.simulator.planning import executor as executor_mod
from specgov.simulator.planning import sweep as sweep_mod
from specgov.simulator.planning.atomic import is_partial_write, write_atomic
from specgov.simulator.planning.executor import run_jobs
from specgov.simulator.planning.search import SearchSettings
from specgov.simulator.planning.sweep import JobSpec, SweepSettings, enumerate_jobs
from specgov.simulator.workload.synthetic import generate_trace
from specgov.simulator.workload.synthetic_text import parse_synthetic_spec

TRACE = generate_trace(parse_synthetic_spec("synthetic:duration=10,rate=2,seed=3"))
SETTINGS = SweepSettings(slo_tpot_ms=12.0, slo_ttft_ms=1000.0, search=SearchSettings(rel_tol=0.3))
GPU_LINE = "gpus:\n  my-gpu: {{memory_gib: 80, hbm_bandwidth_tb_s: {bw}, bf16_tflops: 989}}\n"


def _plain(settings: SweepSettings, gpu: str = "h100") -> list[JobSpec]:
    return enumerate_jobs(
        gpus=[gpu], drafters=["none"], policies=["none"], settings=settings, trace=TRACE
    )


def _catalog_sweep(catalog: Path, results: Path) -> tuple[list[dict[str, Any]], int]:
    settings = dataclasses.replace(SETTINGS, catalog_files=(str(catalog),))
    return run_jobs(_plain(settings, "my-gpu"), TRACE, workers=1, results_dir=results)


def test_an_edited_catalog_is_recomputed_and_an_unchanged_one_reused(tmp_path: Path) -> None:
    catalog = tmp_path / "catalog.yaml"
    results = tmp_path / "results"
    catalog.write_text(GPU_LINE.format(bw=3.35))
    first, reused = _catalog_sweep(catalog, results)
    assert reused == 0 and first[0]["status"] == "ok"
    # Unchanged data, even reformatted with a comment: the stored row comes back.
    catalog.write_text("# same GPU, another layout\n" + GPU_LINE.format(bw="3.350"))
    again, reused = _catalog_sweep(catalog, results)
    assert reused == 1 and again == first
    # The same file name with other data: recomputed, and the row is the new data's.
    catalog.write_text(GPU_LINE.format(bw=1.2))
    edited, reused = _catalog_sweep(catalog, results)
    assert reused == 0
    slow, fast = edited[0]["at_max"], first[0]["at_max"]
    assert edited[0]["max_rps"] < first[0]["max_rps"] or slow["tpot_ms"] > fast["tpot_ms"]
    # Both results stay on disk: going back to the first data reuses the first row.
    catalog.write_text(GPU_LINE.format(bw=3.35))
    back, reused = _catalog_sweep(catalog, results)
    assert reused == 1 and back == first


def test_another_specgov_version_is_recomputed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (job,) = _plain(SETTINGS)
    run_jobs([job], TRACE, workers=1, results_dir=tmp_path)
    _, reused = run_jobs(_plain(SETTINGS), TRACE, workers=1, results_dir=tmp_path)
    assert reused == 1
    monkeypatch.setattr(sweep_mod, "specgov_version", lambda: "9.9.9")
    (upgraded,) = _plain(SETTINGS)
    assert upgraded.version == "9.9.9" and upgraded.job_id != job.job_id
    rows, reused = run_jobs([upgraded], TRACE, workers=1, results_dir=tmp_path)
    assert reused == 0 and rows[0]["id"] == upgraded.job_id


def test_the_resume_key_covers_the_catalog_data_and_the_version() -> None:
    (job,) = _plain(SETTINGS)
    assert job.version == sweep_mod.specgov_version()
    ids = {
        job.job_id,
        dataclasses.replace(job, catalog_id="0" * 20).job_id,
        dataclasses.replace(job, version="0.0.1").job_id,
    }
    assert len(ids) == 3


def test_leftover_temporary_files_are_removed_when_a_resumed_sweep_starts(
    tmp_path: Path,
) -> None:
    (job,) = _plain(SETTINGS)
    jobs_dir = tmp_path / "jobs"
    jobs_dir.mkdir()
    # What a killed run leaves: write_atomic's temporary name, and the old <id>.tmp<pid>.
    stale = [jobs_dir / f".{job.job_id}.json.k3j9x1.tmp", jobs_dir / f"{job.job_id}.tmp4242"]
    for path in stale:
        path.write_text('{"job_id": "half')
    other = jobs_dir / "README.txt"
    other.write_text("not ours to delete")
    rows, reused = run_jobs([job], TRACE, workers=1, results_dir=tmp_path)
    assert reused == 0 and rows[0]["status"] == "ok"
    assert sorted(p.name for p in jobs_dir.iterdir()) == sorted(
        ["README.txt", f"{job.job_id}.json"]
    )


def test_a_failed_sweep_leaves_no_temporary_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (job,) = _plain(SETTINGS)
    jobs_dir = tmp_path / "jobs"

    def interrupted(j: JobSpec, trace: Any) -> dict[str, Any]:
        # Ctrl-C while a write is half done (its temporary file on disk).
        (jobs_dir / f".{j.job_id}.json.a1b2c3.tmp").write_text("{")
        raise KeyboardInterrupt

    monkeypatch.setattr(executor_mod, "run_job", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run_jobs([job], TRACE, workers=1, results_dir=tmp_path)
    assert list(jobs_dir.iterdir()) == []


def test_write_atomic_leaves_the_old_file_or_the_whole_new_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "row.json"
    write_atomic(path, "old")
    assert path.read_text() == "old"

    def refused(src: Any, dst: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", refused)
    with pytest.raises(OSError, match="No space"):
        write_atomic(path, "new")
    monkeypatch.undo()
    assert [p.name for p in tmp_path.iterdir()] == ["row.json"] and path.read_text() == "old"
    write_atomic(path, b"new")
    assert path.read_text() == "new"


@pytest.mark.parametrize(
    ("name", "partial"),
    [
        (".0123abcd.json.x8_k2.tmp", True),
        ("0123abcd.tmp991", True),
        ("0123abcd.json", False),
        ("index.html", False),
        ("notes.tmp", False),  # not a name write_atomic makes
        (".hidden", False),
    ],
)
def test_which_names_are_partial_writes(name: str, partial: bool) -> None:
    assert is_partial_write(name) is partial
