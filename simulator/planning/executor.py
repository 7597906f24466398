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
(``atomic.write_atomic``: a temporary name, then a rename, so a killed sweep never
leaves half a file; the temporary files a killed sweep leaves are removed when the next
run starts and when a run fails). With a results directory from an earlier run
(``--resume DIR``), a job whose file is there is not run again; the job id is a digest
of all its inputs (``sweep.JobSpec.job_id``: the catalog's data and the specgov version
included), so a changed input is a new job.

A job that raises (a bug in the engine model, a worker process or Ray task that dies,
a worker with another specgov or catalog: ``sweep.check_worker``) stops the sweep with
``JobFailedError``, naming the configuration and the reason in one line. Jobs not yet
started are cancelled; on the local pool, the jobs already running finish and are
kept; on Ray, the tasks already finished are kept and the others cancelled. Every kept
row is in the results directory, so ``--resume DIR`` continues from there.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import multiprocessing
import os
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from pathlib import Path
from typing import Any

from specgov.policies.common.errors import SpecgovError
from specgov.policies.common.validation import is_int
from specgov.simulator.planning.atomic import remove_partial_writes, write_atomic
from specgov.simulator.planning.sweep import JobSpec, run_job
from specgov.simulator.workload.traces import Trace

__all__ = ["EXECUTORS", "ExecutorError", "JobFailedError", "load_finished", "run_jobs"]

EXECUTORS = ("local", "ray")

_WORKER_TRACE: Trace | None = None


class ExecutorError(SpecgovError, RuntimeError):
    """The executor cannot run (Ray missing or unreachable, bad results directory), or a
    job failed (``JobFailedError``). The message is one line for the operator."""


class JobFailedError(ExecutorError):
    """A job raised instead of returning its row.

    ``config`` is the configuration (``JobSpec.describe()``: gpu, drafter, shape, policy,
    job_id), ``reason`` one line (the exception's type and first line), ``finished`` the
    rows kept by job id (also written to ``results_dir`` when there is one), ``total``
    the jobs of the sweep.
    """

    def __init__(
        self,
        job: JobSpec,
        reason: str,
        *,
        finished: dict[str, dict[str, Any]],
        total: int,
        results_dir: Path | None,
    ) -> None:
        self.job = job
        self.config = job.describe()
        self.reason = reason
        self.finished = finished
        self.total = total
        self.results_dir = results_dir
        c = self.config
        where = (
            f"{len(finished)} of {total} jobs are done and kept in {results_dir}: run again "
            f"with --resume {results_dir} to continue from them"
            if results_dir is not None
            else f"{len(finished)} of {total} jobs were done (kept only with --resume DIR)"
        )
        super().__init__(
            f"configuration gpu={c['gpu']} drafter={c['drafter']} shape={c['shape']} "
            f"policy={c['policy']} (job {c['job_id']}) failed: {reason}; {where}"
        )


def _reason(exc: BaseException) -> str:
    """One line: the exception's type and the first line of its message."""
    # Ray wraps a task's exception (RayTaskError, whose text is the remote traceback).
    cause = getattr(exc, "cause", None)
    if isinstance(cause, BaseException) and cause is not exc:
        exc = cause
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."


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


class _Results:
    """The rows so far: each one kept in memory, written to the results directory and
    reported to ``progress`` as it arrives; a failure becomes one JobFailedError."""

    def __init__(
        self,
        rows: dict[str, dict[str, Any]],
        total: int,
        results_dir: Path | None,
        progress: Callable[[int, int], None] | None,
    ) -> None:
        self.rows = rows
        self.total = total
        self.results_dir = results_dir
        self.progress = progress

    def finished(self, job: JobSpec, row: dict[str, Any]) -> None:
        if self.results_dir is not None:
            try:
                text = json.dumps({"job_id": job.job_id, "row": row}, allow_nan=False)
            except (TypeError, ValueError) as exc:  # NaN or a non-JSON value: a job bug
                raise self.failed(job, exc) from None
            path = _job_file(self.results_dir, job.job_id)
            try:
                write_atomic(path, text)
            except OSError as exc:
                raise ExecutorError(
                    f"cannot write the result of job {job.job_id} to {path}: {exc.strerror or exc}"
                ) from None
        self.rows[job.job_id] = row
        if self.progress is not None:
            self.progress(len(self.rows), self.total)

    def failed(self, job: JobSpec, exc: BaseException) -> JobFailedError:
        return JobFailedError(
            job,
            _reason(exc),
            finished=dict(self.rows),
            total=self.total,
            results_dir=self.results_dir,
        )


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
    if workers is not None and (not is_int(workers) or workers < 1):
        raise ExecutorError(f"workers must be an integer >= 1, got {workers!r}")
    if ray_address is not None and executor != "ray":
        raise ExecutorError("a Ray address needs executor 'ray'")
    ids = [job.job_id for job in jobs]
    if len(set(ids)) != len(ids):
        raise ExecutorError("the same job was given twice")
    rows: dict[str, dict[str, Any]] = {}
    jobs_dir: Path | None = None
    if results_dir is not None:
        jobs_dir = results_dir / "jobs"
        try:
            jobs_dir.mkdir(parents=True, exist_ok=True)
            remove_partial_writes(jobs_dir)  # what a killed earlier run was writing
        except OSError as exc:
            raise ExecutorError(
                f"results directory {str(results_dir)!r}: {exc.strerror or exc}"
            ) from None
        rows.update(load_finished(results_dir, jobs))
    reused = len(rows)
    todo = [job for job in jobs if job.job_id not in rows]
    results = _Results(rows, len(jobs), results_dir, progress)
    if progress is not None:
        progress(len(rows), len(jobs))
    try:
        if executor == "ray":
            _run_ray(todo, trace, ray_address, results)
        elif todo and (workers == 1 or len(todo) == 1):
            for job in todo:
                try:
                    row = run_job(job, trace)
                except Exception as exc:  # any job failure: one line with its configuration
                    raise results.failed(job, exc) from exc
                results.finished(job, row)
        elif todo:
            _run_pool(todo, trace, workers or os.cpu_count() or 1, results)
    except BaseException:
        if jobs_dir is not None:
            with contextlib.suppress(OSError):  # the failure itself is what to report
                remove_partial_writes(jobs_dir)
        raise
    return [rows[i] for i in ids], reused


def _run_pool(todo: Sequence[JobSpec], trace: Trace, workers: int, results: _Results) -> None:
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
        failure: tuple[JobSpec, BaseException] | None = None
        try:
            while pending:
                done, _ = wait(pending, return_when=FIRST_COMPLETED)
                for future in done:
                    job = pending.pop(future)
                    if future.cancelled():
                        continue
                    exc = future.exception()
                    if exc is None:
                        results.finished(job, future.result())
                    elif failure is None:
                        # Stop: jobs not started are cancelled, those running finish
                        # (kept: they are computed work) before the error is raised.
                        failure = (job, exc)
                        for other in pending:
                            other.cancel()
        except BaseException:
            # An error of our own (or Ctrl-C): the pool's exit must not run the rest.
            for other in pending:
                other.cancel()
            raise
        if failure is not None:
            raise results.failed(*failure) from failure[1]


def _run_ray(
    todo: Sequence[JobSpec],
    trace: Trace,
    address: str | None,
    results: _Results,
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
    pending: dict[Any, JobSpec] = {}
    try:
        if not todo:
            return
        remote = ray.remote(num_cpus=1)(_ray_job)
        trace_ref = ray.put(trace)
        pending = {remote.remote(job, trace_ref): job for job in todo}
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1)
            for ref in done:
                job = pending.pop(ref)
                try:
                    row = ray.get(ref)
                except Exception as exc:  # RayTaskError, a dead worker, a lost object
                    _keep_ready(ray, pending, results)
                    raise results.failed(job, exc) from exc
                results.finished(job, row)
    finally:
        for ref in pending:  # not finished: cancelled rather than left running
            with contextlib.suppress(Exception):  # must not hide the error that stopped us
                ray.cancel(ref)
        if started:
            ray.shutdown()


def _keep_ready(ray: Any, pending: dict[Any, JobSpec], results: _Results) -> None:
    """Keep the rows of the Ray tasks already finished (a failure stops the rest)."""
    if not pending:
        return
    ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=0)
    for ref in ready:
        job = pending.pop(ref)
        try:
            row = ray.get(ref)
        except Exception:  # another failure: the first one is the one reported
            continue
        results.finished(job, row)
