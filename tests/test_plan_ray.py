"""`plan sweep --executor ray`: the same jobs as Ray tasks give the local rows.

Needs Ray (`pip install 'specgov[ray]'`): skipped with the reason where it is not
installed, except where SPECGOV_REQUIRE_RAY is set (CI), where that is a failure.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from specgov.simulator.planning.executor import JobFailedError, run_jobs
from specgov.simulator.planning.search import SearchSettings
from specgov.simulator.planning.sweep import SweepSettings, enumerate_jobs
from specgov.simulator.workload.synthetic import generate_trace
from specgov.simulator.workload.synthetic_text import parse_synthetic_spec

TRACE = generate_trace(parse_synthetic_spec("synthetic:duration=20,rate=4,seed=1"))
SETTINGS = SweepSettings(slo_tpot_ms=12.0, slo_ttft_ms=1000.0, search=SearchSettings(rel_tol=0.2))


@pytest.fixture(scope="module")
def ray_local() -> Iterator[Any]:
    try:
        import ray
    except ImportError:
        reason = "ray is not installed (pip install 'specgov[ray]')"
        if os.environ.get("SPECGOV_REQUIRE_RAY"):
            pytest.fail(f"{reason}; SPECGOV_REQUIRE_RAY is set, so this is an error")
        pytest.skip(reason)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()


def _strip(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in row.items() if k != "timing"} for row in rows]


@pytest.mark.slow
def test_ray_and_local_give_identical_rows_for_the_same_seeds(ray_local: Any) -> None:
    jobs = enumerate_jobs(
        gpus=["h100"],
        drafters=["eagle3", "ngram"],
        policies=["static:3", "sglang-ema", "goodput"],
        settings=SETTINGS,
        trace=TRACE,
    )
    local, _ = run_jobs(jobs, TRACE, workers=1)
    seen: list[int] = []
    remote, reused = run_jobs(jobs, TRACE, executor="ray", progress=lambda d, t: seen.append(d))
    assert reused == 0 and seen[-1] == len(jobs)
    assert _strip(remote) == _strip(local)
    assert {r["status"] for r in remote} == {"ok", "cannot-run"}
    # The executor used the Ray it found and left it running.
    assert ray_local.is_initialized()
    # Another seed is another answer (the comparison above is not vacuous): the
    # acceptance draws change, so the adaptive row's latencies do.
    other = SweepSettings(
        slo_tpot_ms=12.0, slo_ttft_ms=1000.0, seed=7, search=SearchSettings(rel_tol=0.2)
    )
    jobs7 = enumerate_jobs(
        gpus=["h100"],
        drafters=["eagle3"],
        policies=["sglang-ema"],
        settings=other,
        trace=TRACE,
    )
    remote7, _ = run_jobs(jobs7, TRACE, executor="ray")
    local7, _ = run_jobs(jobs7, TRACE, workers=1)
    assert _strip(remote7) == _strip(local7)
    (ema0,) = [r for r in remote if r["policy"] == "sglang-ema" and r["drafter"] == "eagle3"]
    assert remote7[1]["curve"][0]["tpot_ms"] != ema0["curve"][0]["tpot_ms"]


def test_a_failing_ray_task_is_one_line_naming_its_configuration(
    ray_local: Any, tmp_path: Path
) -> None:
    jobs = enumerate_jobs(
        gpus=["h100"], drafters=["eagle3"], policies=["static:3"], settings=SETTINGS, trace=TRACE
    )
    bad = dataclasses.replace(jobs[1], policy="no-such-policy")  # raises in the Ray task
    with pytest.raises(JobFailedError) as caught:
        run_jobs([*jobs, bad], TRACE, executor="ray", results_dir=tmp_path)
    err = caught.value
    # Ray's RayTaskError (the remote traceback as text) is reduced to the job's exception.
    assert err.reason.startswith("PolicySpecError: ") and "Traceback" not in str(err)
    assert "\n" not in str(err) and err.config["job_id"] == bad.job_id
    assert bad.job_id not in err.finished
    on_disk = {json.loads(f.read_text())["job_id"] for f in (tmp_path / "jobs").glob("*.json")}
    assert on_disk == set(err.finished)
    assert ray_local.is_initialized()  # the executor left the Ray it found running
