"""Run a sweep's jobs: inline, on a local process pool, or as Ray tasks.

Every job is a pure function of its ``JobSpec`` and the trace (``sweep.run_job``,
seeded), so the executor only decides where it runs: the rows are identical, apart
from their ``timing``, whichever executor and however many workers.

* ``local``: ``workers`` processes (default: every core); one worker runs the jobs in
  this process, one after the other. The pool uses the ``forkserver`` start method
  (never ``fork``: this process may hold threads, e.g. the progress bar's), and each
  worker receives the trace once, at start-up.
* ``ray``: one Ray task per job (``num_cpus=1`` each) on the cluster at
  ``ray_address`` (``ray.init(address=...)``: ``auto`` for the cluster this machine
  belongs to, ``ray://host:10001`` for a remote one through Ray Client); without an
  address, an already initialised Ray is used, else a local one is started (and shut
  down at the end). The trace travels once, through the object store (``ray.put``).
  Needs ``pip install 'specgov[ray]'``; the cluster's workers need specgov installed.

Results are written as each job completes: ``<results_dir>/jobs/<job_id>.json``
(written to a temporary name, then renamed, so a killed sweep never leaves half a
file). With a results directory from an earlier run (``--resume DIR``), a job whose
file is there is not run again; the job id is a digest of all its inputs, so a changed
input is a new job.
"""

from __future__ import annotations

import importlib
import json
import multiprocessing
import os
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from pathlib import Path
from typing import Any

from specgov.simulator.planning.sweep import JobSpec, run_job
from specgov.simulator.traces import Trace

__all__ = ["EXECUTORS", "ExecutorError", "load_finished", "run_jobs"]

EXECUTORS = ("local", "ray")

_WORKER_TRACE: Trace | None = None


class ExecutorError(RuntimeError):
    """The executor cannot run (Ray missing or unreachable, bad results directory)."""


def _init_worker(trace: Trace) -> None:
    global _WORKER_TRACE
    _WORKER_TRACE = trace


def _pool_job(job: JobSpec) -> dict[str, Any]:
    assert _WORKER_TRACE is not None, "worker started without a trace"
    return run_job(job, _WORKER_TRACE)


def _ray_job(job: JobSpec, trace: Trace) -> dict[str, Any]:
    return run_job(job, trace)


def _job_file(results_dir: Path, job_id: str) -> Path:
    return results_dir / "jobs" / f"{job_id}.json"


def load_finished(results_dir: Path, jobs: Sequence[JobSpec]) -> dict[str, dict[str, Any]]:
    """The rows of ``jobs`` already in ``results_dir`` (by job id)."""
    done: dict[str, dict[str, Any]] = {}
    for job in jobs:
        path = _job_file(results_dir, job.job_id)
        if not path.is_file():
            continue
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue  # unreadable: run the job again rather than trust it
        if isinstance(record, dict) and record.get("job_id") == job.job_id:
            row = record.get("row")
            if isinstance(row, dict):
                done[job.job_id] = row
    return done


def _write(results_dir: Path, job: JobSpec, row: dict[str, Any]) -> None:
    path = _job_file(results_dir, job.job_id)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps({"job_id": job.job_id, "row": row}, allow_nan=False))
    os.replace(tmp, path)


def run_jobs(
    jobs: Sequence[JobSpec],
    trace: Trace,
    *,
    executor: str = "local",
    workers: int | None = None,
    ray_address: str | None = None,
    results_dir: Path | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> tuple[list[dict[str, Any]], int]:
    """Run every job (skipping those finished in ``results_dir``).

    Returns (rows in ``jobs`` order, how many were reused from ``results_dir``).
    ``progress(done, total)`` is called once up front and after each job.
    """
    if executor not in EXECUTORS:
        raise ExecutorError(f"unknown executor {executor!r}; valid: {', '.join(EXECUTORS)}")
    if workers is not None and (isinstance(workers, bool) or workers < 1):
        raise ExecutorError(f"workers must be an integer >= 1, got {workers!r}")
    if ray_address is not None and executor != "ray":
        raise ExecutorError("a Ray address needs executor 'ray'")
    ids = [job.job_id for job in jobs]
    if len(set(ids)) != len(ids):
        raise ExecutorError("the same job was given twice")
    rows: dict[str, dict[str, Any]] = {}
    if results_dir is not None:
        try:
            (results_dir / "jobs").mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ExecutorError(
                f"results directory {str(results_dir)!r}: {exc.strerror or exc}"
            ) from None
        rows.update(load_finished(results_dir, jobs))
    reused = len(rows)
    todo = [job for job in jobs if job.job_id not in rows]
    total = len(jobs)

    def finished(job: JobSpec, row: dict[str, Any]) -> None:
        rows[job.job_id] = row
        if results_dir is not None:
            _write(results_dir, job, row)
        if progress is not None:
            progress(len(rows), total)

    if progress is not None:
        progress(len(rows), total)
    if executor == "ray":
        _run_ray(todo, trace, ray_address, finished)
    elif todo and (workers == 1 or len(todo) == 1):
        for job in todo:
            finished(job, run_job(job, trace))
    elif todo:
        _run_pool(todo, trace, workers or os.cpu_count() or 1, finished)
    return [rows[i] for i in ids], reused


def _run_pool(
    todo: Sequence[JobSpec],
    trace: Trace,
    workers: int,
    finished: Callable[[JobSpec, dict[str, Any]], None],
) -> None:
    method = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
    context = multiprocessing.get_context(method)
    with ProcessPoolExecutor(
        max_workers=min(workers, len(todo)),
        mp_context=context,
        initializer=_init_worker,
        initargs=(trace,),
    ) as pool:
        pending: dict[Future[dict[str, Any]], JobSpec] = {
            pool.submit(_pool_job, job): job for job in todo
        }
        while pending:
            done, _ = wait(pending, return_when=FIRST_COMPLETED)
            for future in done:
                finished(pending.pop(future), future.result())


def _run_ray(
    todo: Sequence[JobSpec],
    trace: Trace,
    address: str | None,
    finished: Callable[[JobSpec, dict[str, Any]], None],
) -> None:
    try:
        # By name: Ray is an optional extra, and type-checking must not need it.
        ray: Any = importlib.import_module("ray")
    except ImportError:
        raise ExecutorError(
            "executor 'ray' needs Ray: pip install 'specgov[ray]' (ray>=2.9)"
        ) from None
    started = False
    if not ray.is_initialized():
        try:
            ray.init(address=address, include_dashboard=False, log_to_driver=False)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            where = address or "a local Ray instance"
            raise ExecutorError(f"cannot start or reach Ray at {where}: {exc}") from None
        started = True
    try:
        if not todo:
            return
        remote = ray.remote(num_cpus=1)(_ray_job)
        trace_ref = ray.put(trace)
        pending = {remote.remote(job, trace_ref): job for job in todo}
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1)
            for ref in done:
                finished(pending.pop(ref), ray.get(ref))
    finally:
        if started:
            ray.shutdown()
