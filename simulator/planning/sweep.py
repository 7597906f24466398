"""`specgov plan sweep`: sustainable load, replicas and cost per configuration.

A configuration is (GPU, drafter, shape, policy) for one target model. For each, a job
searches (``search.py``: bracketing + bisection over the trace rate multiplier, relative
tolerance 0.05 by default) for the highest request rate one replica sustains while
meeting the SLO, by replaying the trace through ``simulator.replay.prepare_run`` (the
same engine model and policies as ``specgov replay``; daemon policies such as
``goodput`` run their closed loop in virtual time). Every job is deterministic in its
seed: the same seed gives the same row on any executor (``executor.py``).

SLO check at one multiplier (all must hold):

* TPOT percentile (``tpot_percentile``, default 99) <= ``slo_tpot_ms`` (default 50),
  over completed requests with at least two output tokens; TPOT of a request is
  ``(e2e - ttft) / (output_tokens - 1)``;
* TTFT percentile (``ttft_percentile``, default 99) <= ``slo_ttft_ms`` (default 2000);
* no request aborted (one that can never fit the KV pool is a failure, not a pass).

Percentiles are numpy's default (linear interpolation between order statistics). The
trace's base rate is ``requests / duration_s`` of the windowed trace; the multiplier
``m`` divides every inter-arrival time, so the rate is ``m x base``. The check runs
over the replayed window only: a server that falls behind slowly may pass a short
window; use a window long enough for queues to build (minutes).

Fleet arithmetic: ``replicas = ceil(target_rps / max_rps)``; with prices (GPU-hours,
``prices.py``) ``cost_per_hour = replicas x price`` and ``cost_per_mtok =
cost_per_hour / (target_rps x mean output tokens x 3600 / 1e6)``. A replica is one GPU:
the sweep has no tensor-parallel option, because the replay engine it runs
(``simulator.replay.ServerSpec``) simulates tp_size 1 only; ``plan vram --tp-size``
budgets a tensor-parallel server's memory. The plain server
(drafter ``none``, policy ``none``) is always swept once per GPU: the saving of each
speculative configuration is against it, at the same SLO.

Documents (JSON, ``--output json``; the HTML report reads exactly these)
-------------------------------------------------------------------------

``specgov plan vram --output json`` prints a list with one document per GPU asked for;
each document (``vram.vram_document``)::

    {"fits": bool, "items": [{"name": str, "gib": float}, ...],   # sum = total_gib if fits
     "kv_pool_tokens": int, "kv_pool_gib": float, "kv_bytes_per_token": float,
     "left_gib": float, "first_overflow": str | None, "overflow_gib": float,
     "gpu": str, "model": str, "drafter": str ("none": plain), "tp_size": int,
     "shape": {"steps": int, "topk": int, "num_draft_tokens": int},
     "candidate_steps": [int], "mem_fraction_static": float,
     "mem_fraction_is_default": bool, "max_running_requests": int | None,
     "cuda_graph_max_bs": int, "chunked_prefill_size": int, "total_gib": float,
     "static_budget_gib": float, "runtime_slack_gib": float,
     "cuda_graph_tiers": [{"steps": int, "gib": float}],
     "sglang_loads_memory": {"weight_gb": float, "kv_cache_gb": float,
                             "graph_gb": float, "token_capacity": int},
     "message": str | None,            # the overflow arithmetic when it does not fit
     "warnings": [str], "assumptions": [str]}

``specgov plan sweep --output json`` prints one document (``sweep_document.build_document``)::

    {"configurations": [ROW, ...],
     "best": ROW | None,               # overall, by best_by
     "best_by": "cost_per_hour" | "replicas",
     "recommendation": str | None,     # why the best is the best (simplicity.py)
     "best_per_gpu": {gpu: ROW},
     "host_cache_or_gpus": {gpu: {"without": BRIEF | None, "with": [BRIEF + {"pays": bool,
                            "saves_replicas": int | None}], "answer": str}} | None,
                                       # host_cache.py; None without --hicache-sizes
     "trace": {...trace summary..., "base_rps": float,
               "load": {"source": str, "duration_s": float, "mean_rps": float,
                        "peak_rps": float, "peak_window_s": float}},   # trace_load
     "slo": {"tpot_ms", "ttft_ms", "tpot_percentile", "ttft_percentile"},
     "target_rps": float, "model": str, "seed": int,
     "search": {"start", "min_multiplier", "max_multiplier", "rel_tol", "max_evals"},
     "prices": {"currency": str, "gpu_hour": {gpu: float}, "source": str} | None,
     "executor": {"kind": "local" | "ray", "workers": int | None,
                  "jobs": int, "reused": int}}

    ROW = {"id": str, "gpu": str, "model": str, "drafter": str ("none": plain),
           "shape": {"name": str, "steps": int, "topk": int, "num_draft_tokens": int,
                     "candidate_steps": [int]},
           "policy": str,              # canonical: none, static:3, sglang-ema, goodput
           "hicache_size_gb": int,     # host cache tier (--hicache-size), 0: none
           "status": "ok" | "does-not-fit" | "cannot-run" | "slo-unmet",
           "reason": str | None,       # why not ok (or a note, e.g. capped search)
           "fits": bool, "vram": VRAM_DOCUMENT | None,
           "max_multiplier": float | None, "max_rps": float | None,   # 0.0: slo-unmet
           "capped": bool,             # passed at the search's max multiplier
           "at_max": POINT | None,     # metrics at max_multiplier
           "curve": [POINT, ...],      # every evaluated multiplier, increasing
           "replicas": int | None, "cost_per_hour": float | None,
           "cost_per_mtok": float | None, "cost_per_mtok_at_capacity": float | None,
           "saving_vs_none": {"replicas": int, "capacity_ratio": float,
                              "cost_per_hour": float | None,
                              "cost_fraction": float | None} | None,
           "speculation": {"pays": bool, "because": "replicas" | "slo" | None,
                           "detail": str} | None,    # speculative ok rows only
           "launch_args": [str] | None,          # SGLang flags (adapters.launch_config)
           "launch_shell": str | None, "adaptive_config": dict | None,
           "launch_error": str | None, "daemon_policy": str | None,
           "timing": {"wall_s": float, "cpu_s": float, "evals": int}}
                                       # timing: the only non-deterministic part

    POINT = {"multiplier": float, "rps": float, "passed": bool,
             "tpot_ms": float | None, "ttft_ms": float | None,    # at the percentiles
             "throughput_tok_s": float, "goodput_tok_s": float,
             "slo_attainment": float | None, "completed": int, "aborted": int,
             "mean_accept_length": float}
"""

from __future__ import annotations

import functools
import hashlib
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

from specgov.policies.common.errors import SpecgovError
from specgov.policies.common.validation import is_int
from specgov.simulator.catalog import Catalog
from specgov.simulator.engine.memory import MemoryPlanError
from specgov.simulator.planning.search import SearchResult, SearchSettings, find_max_multiplier
from specgov.simulator.planning.trace_load import base_rps
from specgov.simulator.planning.vram import NO_DRAFTER, vram_document, vram_plan
from specgov.simulator.replay.metrics import Slo, slo_mask
from specgov.simulator.replay.runner import (
    InEnginePolicy,
    PolicySpecError,
    ServerSpec,
    parse_policy,
    prepare_run,
)
from specgov.simulator.workload.traces import Trace, transform_trace

__all__ = [
    "JobSpec",
    "Shape",
    "SweepError",
    "SweepSettings",
    "WorkerMismatchError",
    "catalog_fingerprint",
    "check_worker",
    "enumerate_jobs",
    "parse_shape_name",
    "run_job",
    "specgov_version",
    "trace_fingerprint",
]

DEFAULT_POLICIES = ("none", "static:3", "sglang-ema", "goodput")


class SweepError(SpecgovError, ValueError):
    """A bad sweep argument; the message names it and the valid form."""


class WorkerMismatchError(SpecgovError, RuntimeError):
    """The process running a job is not the one the sweep was planned for: another
    specgov version, or another catalog (a file edited since, or missing or different
    on a cluster node). Its rows would be keyed by data they were not computed from,
    so the job fails instead of writing one."""


@dataclass(frozen=True)
class Shape:
    """The speculative tree shape: a chain (topk 1) or a tree (topk, draft tokens)."""

    name: str
    topk: int = 1
    num_draft_tokens: int | None = None


def parse_shape_name(text: str) -> Shape:
    """``chain`` or ``treeTxD`` (topk T, D draft tokens per verify, e.g. ``tree4x8``)."""
    raw = text.strip().lower()
    if raw == "chain":
        return Shape("chain")
    if raw.startswith("tree") and "x" in raw[4:]:
        t, _, d = raw[4:].partition("x")
        if t.isdigit() and d.isdigit() and int(t) >= 2 and int(d) >= 2:
            return Shape(raw, int(t), int(d))
    raise SweepError(
        f"shape {text!r}: expected 'chain' or 'treeTxD' with topk T >= 2 and D >= 2 draft "
        "tokens (e.g. tree4x8)"
    )


@dataclass(frozen=True)
class SweepSettings:
    """What every job of a sweep shares."""

    model: str = "llama-3.1-8b"
    spec_steps: int = 3  # --speculative-num-steps; the initial step of adaptive policies
    slo_tpot_ms: float | None = 50.0
    slo_ttft_ms: float | None = 2000.0
    tpot_percentile: float = 99.0
    ttft_percentile: float = 99.0
    seed: int = 0
    mem_fraction_static: float | None = None
    max_running_requests: int | None = None
    catalog_files: tuple[str, ...] = ()
    search: SearchSettings = field(default_factory=SearchSettings)

    def __post_init__(self) -> None:
        for name in ("tpot_percentile", "ttft_percentile"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise SweepError(f"{name} must be a number in (0, 100], got {value!r}")
            if not 0 < value <= 100:
                raise SweepError(f"{name} must be in (0, 100], got {value!r}")
        if self.slo_tpot_ms is None and self.slo_ttft_ms is None:
            raise SweepError("give at least one SLO: slo_tpot_ms or slo_ttft_ms")
        Slo(tpot_ms=self.slo_tpot_ms, ttft_ms=self.slo_ttft_ms)  # validates the values

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["search"] = self.search.to_json()
        out["catalog_files"] = list(self.catalog_files)
        return out


@dataclass(frozen=True)
class JobSpec:
    """One configuration's search: everything a worker needs besides the trace."""

    gpu: str
    drafter: str  # "none": plain server
    shape: Shape
    policy: str  # canonical policy name
    settings: SweepSettings
    trace_id: str  # trace_fingerprint of the trace the job replays
    catalog_id: str  # catalog_fingerprint of the catalog data (built-in + settings' files)
    version: str  # specgov_version() of the process that enumerated the job
    hicache_size_gb: int = 0  # SGLang's --hicache-size host tier; 0: no hierarchical cache

    @property
    def job_id(self) -> str:
        """A digest of every input: a changed input is a different job (resume).

        Inputs are the configuration, the settings, the trace's requests, the catalog's
        data (not its file names: an edited catalog is a new job) and the specgov
        version (an upgrade may change the engine model: its rows are computed anew).
        """
        blob = json.dumps(
            {
                "gpu": self.gpu,
                "drafter": self.drafter,
                "shape": asdict(self.shape),
                "policy": self.policy,
                "settings": self.settings.to_json(),
                "trace": self.trace_id,
                "catalog": self.catalog_id,
                "specgov": self.version,
                # Only when set: sweeps without a host tier keep their job ids.
                **({"hicache_size_gb": self.hicache_size_gb} if self.hicache_size_gb else {}),
            },
            sort_keys=True,
        )
        return hashlib.sha256(blob.encode()).hexdigest()[:20]

    def describe(self) -> dict[str, str]:
        """The configuration in the words of a sweep row (for messages about the job)."""
        return {
            "gpu": self.gpu,
            "drafter": self.drafter,
            "shape": self.shape.name,
            "policy": self.policy,
            **({"hicache_size_gb": str(self.hicache_size_gb)} if self.hicache_size_gb else {}),
            "job_id": self.job_id,
        }


def specgov_version() -> str:
    """The installed specgov's version ("unknown" when running from an uninstalled tree)."""
    try:
        return metadata.version("specgov")
    except metadata.PackageNotFoundError:
        return "unknown"


def catalog_fingerprint(catalog: Catalog) -> str:
    """A digest of the catalog's data: every GPU, model, drafter and acceptance profile
    as parsed (built-in entries and the user's files merged), so an edited value is a
    new digest while a reformatted file or a comment is not."""
    h = hashlib.sha256()
    for kind, entries in (
        ("gpu", catalog.gpus()),
        ("model", catalog.models()),
        ("drafter", catalog.drafters()),
        (
            "acceptance",
            [catalog.acceptance_profile(n) for n in catalog.acceptance_profile_names()],
        ),
    ):
        for entry in entries:
            # Frozen dataclasses of str/int/float/tuple: their repr is exact and stable.
            h.update(f"{kind}:{entry!r};".encode())
    return h.hexdigest()[:20]


def trace_fingerprint(trace: Trace) -> str:
    """A digest of the requests a job replays (arrivals, lengths, domains)."""
    h = hashlib.sha256()
    for r in trace.requests:
        h.update(f"{r.arrival_s!r},{r.input_tokens},{r.output_tokens},{r.domain};".encode())
        if r.acc_len is not None:
            h.update(",".join(map(str, r.acc_len)).encode())
    return h.hexdigest()[:20]


def _names(items: Sequence[str], what: str) -> list[str]:
    out: list[str] = []
    for item in items:
        name = item.strip()
        if not name:
            raise SweepError(f"{what}: empty name in the list")
        if name not in out:
            out.append(name)
    if not out:
        raise SweepError(f"{what}: give at least one")
    return out


def enumerate_jobs(
    *,
    gpus: Sequence[str],
    drafters: Sequence[str],
    policies: Sequence[str],
    shapes: Sequence[str] = ("chain",),
    settings: SweepSettings,
    trace: Trace,
    hicache_sizes_gb: Sequence[int] = (0,),
) -> list[JobSpec]:
    """Every configuration: the plain server once per GPU, then GPU x drafter x shape x
    speculative policy; all of it once per host cache size (``hicache_sizes_gb``, 0: no
    hierarchical cache), so a plan can answer "add host cache or add GPUs?". Names are
    resolved (catalog aliases, canonical policy names) so that a configuration given twice
    runs once; an unknown name fails here, before any simulation."""
    catalog = Catalog.load([Path(p) for p in settings.catalog_files])
    gpu_names = [catalog.gpu(g).name for g in _names(gpus, "--gpus")]
    gpu_names = list(dict.fromkeys(gpu_names))
    drafter_names: list[str] = []
    for d in _names(drafters, "--drafters"):
        name = NO_DRAFTER if d.lower() == NO_DRAFTER else catalog.drafter(d).name
        if name not in drafter_names:
            drafter_names.append(name)
    parsed: list[InEnginePolicy] = []
    for p in _names(policies, "--policies"):
        try:
            policy = parse_policy(p)
        except PolicySpecError as exc:
            raise SweepError(f"--policies: {exc}") from None
        if policy.name not in [q.name for q in parsed]:
            parsed.append(policy)
    shape_list = [parse_shape_name(s) for s in _names(shapes, "--shapes")]
    shape_list = list({s.name: s for s in shape_list}.values())
    tid = trace_fingerprint(trace)
    cid = catalog_fingerprint(catalog)
    version = specgov_version()
    sizes = list(dict.fromkeys(hicache_sizes_gb))
    if not sizes or any(not is_int(g) or g < 0 for g in sizes):
        raise SweepError(
            f"--hicache-sizes: expected whole GB >= 0 (0: no host cache), got {hicache_sizes_gb!r}"
        )
    jobs: list[JobSpec] = []
    for gb in sizes:
        for gpu in gpu_names:
            plain = Shape("plain", 0, 0)
            jobs.append(JobSpec(gpu, NO_DRAFTER, plain, "none", settings, tid, cid, version, gb))
            for drafter in drafter_names:
                if drafter == NO_DRAFTER:
                    continue
                for shape in shape_list:
                    for policy in parsed:
                        if not policy.speculative:
                            continue
                        jobs.append(
                            JobSpec(
                                gpu, drafter, shape, policy.name, settings, tid, cid, version, gb
                            )
                        )
    return jobs


def _percentile_ms(values_s: Sequence[float], q: float) -> float | None:
    arr = np.asarray(values_s, dtype=np.float64)
    arr = arr[~np.isnan(arr)]
    return float(np.percentile(arr, q)) * 1e3 if arr.size else None


def _server(job: JobSpec) -> ServerSpec:
    s = job.settings
    return ServerSpec(
        gpu=job.gpu,
        model=s.model,
        drafter="eagle3" if job.drafter == NO_DRAFTER else job.drafter,
        spec_steps=s.spec_steps,
        topk=job.shape.topk if job.drafter != NO_DRAFTER else 1,
        num_draft_tokens=job.shape.num_draft_tokens,
        mem_fraction_static=s.mem_fraction_static,
        max_running_requests=s.max_running_requests,
        catalog_files=tuple(Path(p) for p in s.catalog_files),
        hierarchical_cache=job.hicache_size_gb > 0,
        hicache_size_gb=job.hicache_size_gb,
    )


def _row_shape(job: JobSpec, policy: InEnginePolicy) -> dict[str, Any]:
    if job.drafter == NO_DRAFTER:
        return {
            "name": "plain",
            "steps": 0,
            "topk": 0,
            "num_draft_tokens": 0,
            "candidate_steps": [],
        }
    steps = (
        policy.candidate_steps[0] if len(policy.candidate_steps) == 1 else job.settings.spec_steps
    )
    topk = job.shape.topk
    return {
        "name": job.shape.name,
        "steps": steps,
        "topk": topk,
        "num_draft_tokens": job.shape.num_draft_tokens if topk > 1 else steps + 1,
        "candidate_steps": list(policy.candidate_steps),
    }


def _empty_row(job: JobSpec, shape: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": job.job_id,
        "gpu": job.gpu,
        "model": job.settings.model,
        "drafter": job.drafter,
        "shape": shape,
        "policy": job.policy,
        "hicache_size_gb": job.hicache_size_gb,
        "status": "cannot-run",
        "reason": None,
        "fits": False,
        "vram": None,
        "max_multiplier": None,
        "max_rps": None,
        "capped": False,
        "at_max": None,
        "curve": [],
        "replicas": None,
        "cost_per_hour": None,
        "cost_per_mtok": None,
        "cost_per_mtok_at_capacity": None,
        "saving_vs_none": None,
        "speculation": None,
        "launch_args": None,
        "launch_shell": None,
        "adaptive_config": None,
        "launch_error": None,
        "daemon_policy": None,
        "timing": {"wall_s": 0.0, "cpu_s": 0.0, "evals": 0},
    }


@functools.lru_cache(maxsize=8)
def _worker_catalog_fingerprint(files: tuple[str, ...], texts: tuple[bytes, ...]) -> str:
    # Keyed by the files' bytes: a worker parses the YAML (a quarter of a second on a
    # busy machine) once per catalog it sees, not once per job; an edit is a new key.
    del texts
    return catalog_fingerprint(Catalog.load([Path(p) for p in files]))


def check_worker(job: JobSpec) -> None:
    """Raise ``WorkerMismatchError`` unless this process has the job's specgov version and
    reads the job's catalog data (its ``catalog_id``)."""
    version = specgov_version()
    if version != job.version:
        raise WorkerMismatchError(
            f"this worker runs specgov {version}, the sweep was planned with {job.version}: "
            "install the same specgov version on every worker"
        )
    files = job.settings.catalog_files
    try:
        texts = tuple(Path(p).read_bytes() for p in files)
        fingerprint = _worker_catalog_fingerprint(files, texts)
    except OSError as exc:
        raise WorkerMismatchError(
            f"this worker cannot read the sweep's catalog: {exc.filename}: {exc.strerror}"
        ) from None
    except ValueError as exc:  # CatalogError: a file malformed here
        raise WorkerMismatchError(f"this worker cannot load the sweep's catalog: {exc}") from None
    if fingerprint != job.catalog_id:
        where = ", ".join(files) if files else "the built-in catalog"
        raise WorkerMismatchError(
            f"the catalog this worker reads ({where}) is not the one the sweep was planned "
            "with: it changed since the sweep started, or differs on this node"
        )


def run_job(job: JobSpec, trace: Trace) -> dict[str, Any]:
    """Search one configuration; never raises for a configuration that cannot run.

    A configuration that does not fit in VRAM, or that the simulator or SGLang cannot
    run (e.g. adaptive speculation with an n-gram drafter), is a row whose ``status``
    and ``reason`` say why. A worker that is not the one planned for (``check_worker``)
    raises ``WorkerMismatchError``: that is no property of the configuration.
    """
    started = time.perf_counter()
    cpu_started = time.process_time()
    check_worker(job)
    s = job.settings
    policy = parse_policy(job.policy)
    shape = _row_shape(job, policy)
    row = _empty_row(job, shape)
    if not _fits(job, policy, shape, row):
        return row
    slo = Slo(tpot_ms=s.slo_tpot_ms, ttft_ms=s.slo_ttft_ms)
    server = _server(job)
    rate = base_rps(trace)
    evaluate = _evaluator(trace, server, policy, s, slo, rate)
    try:
        found = find_max_multiplier(evaluate, s.search)
    except (PolicySpecError, MemoryPlanError, ValueError) as exc:
        # e.g. SGLang's adaptive speculation with an NGRAM drafter or a tree shape
        row["status"] = "cannot-run"
        row["reason"] = str(exc)
        row["timing"] = _timing(started, cpu_started, evals=0)
        return row
    row["curve"] = [metrics for _m, _ok, metrics in found.points]
    row["capped"] = found.capped
    row["timing"] = _timing(started, cpu_started, evals=found.evals)
    _fill_search_result(row, found, s, rate)
    return row


def _timing(started: float, cpu_started: float, *, evals: int) -> dict[str, Any]:
    # CPU seconds beside wall seconds: on a shared machine they tell contention apart.
    return {
        "wall_s": time.perf_counter() - started,
        "cpu_s": time.process_time() - cpu_started,
        "evals": evals,
    }


def _fits(job: JobSpec, policy: InEnginePolicy, shape: dict[str, Any], row: dict[str, Any]) -> bool:
    """Whether the configuration fits in VRAM; the row gets the VRAM document, or the
    reason it cannot be planned or does not fit."""
    s = job.settings
    try:
        plan, used = vram_plan(
            gpu=job.gpu,
            model=s.model,
            drafter=job.drafter,
            steps=shape["steps"],
            topk=max(1, shape["topk"]),
            num_draft_tokens=job.shape.num_draft_tokens,
            candidate_steps=policy.candidate_steps,
            mem_fraction_static=s.mem_fraction_static,
            max_running_requests=s.max_running_requests,
            catalog_files=[Path(p) for p in s.catalog_files],
        )
    except (MemoryPlanError, ValueError) as exc:
        row["reason"] = str(exc)
        return False
    vram = vram_document(plan, shape=used["shape"], max_running_requests=s.max_running_requests)
    row["vram"] = vram
    row["fits"] = vram["fits"]
    if not vram["fits"]:
        row["status"] = "does-not-fit"
        row["reason"] = vram["message"]
        return False
    return True


def _evaluator(
    trace: Trace,
    server: ServerSpec,
    policy: InEnginePolicy,
    s: SweepSettings,
    slo: Slo,
    rate: float,
) -> Callable[[float], tuple[bool, dict[str, Any]]]:
    """The search's probe: replay *trace* at rate multiplier m; (passed, its metrics)."""

    def evaluate(m: float) -> tuple[bool, dict[str, Any]]:
        scaled = transform_trace(trace, rate_scale=m) if m != 1.0 else trace
        prepared = prepare_run(server, policy, seed=s.seed, slo=slo)
        result = prepared.run(scaled.requests)
        tpot = _percentile_ms(result.tpot_s, s.tpot_percentile)
        ttft = _percentile_ms(result.ttft_s, s.ttft_percentile)
        ok = result.aborted == 0 and result.completed == len(scaled.requests)
        if s.slo_tpot_ms is not None:
            ok = ok and (tpot is None or tpot <= s.slo_tpot_ms)
        if s.slo_ttft_ms is not None:
            ok = ok and ttft is not None and ttft <= s.slo_ttft_ms
        span = max(result.end_s - result.first_arrival_s, 1e-9)
        mask = slo_mask(result, slo)
        out_tokens = np.asarray(result.req_output_tokens, dtype=np.int64)
        good = int(out_tokens[mask].sum()) if out_tokens.size else 0
        accept = (
            (result.accepted_drafts + result.verified_requests) / result.verified_requests
            if result.verified_requests
            else 1.0
        )
        return ok, {
            "multiplier": m,
            "rps": m * rate,
            "passed": ok,
            "tpot_ms": tpot,
            "ttft_ms": ttft,
            "throughput_tok_s": result.output_tokens / span,
            "goodput_tok_s": good / span,
            "slo_attainment": float(mask.mean()) if mask.size else None,
            "completed": result.completed,
            "aborted": result.aborted,
            "mean_accept_length": accept,
        }

    return evaluate


def _fill_search_result(
    row: dict[str, Any], found: SearchResult, s: SweepSettings, rate: float
) -> None:
    """The row's status, highest passing rate and metrics there, from the search."""
    if found.best is None:
        row["status"] = "slo-unmet"
        row["max_multiplier"] = 0.0
        row["max_rps"] = 0.0
        row["reason"] = (
            f"the SLO is not met even at rate multiplier {s.search.min_multiplier:g} "
            f"({s.search.min_multiplier * rate:.3g} req/s)"
        )
        return
    row["status"] = "ok"
    row["max_multiplier"] = found.best
    row["max_rps"] = found.best * rate
    row["at_max"] = next(m for x, _ok, m in found.points if x == found.best)
    if found.capped:
        row["reason"] = (
            f"passes even at the search cap x{s.search.max_multiplier:g}: the true limit is higher"
        )
