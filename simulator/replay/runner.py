"""Replay a trace through the simulated SGLang server once per in-engine policy.

Each policy gets its own server built from the same catalog entries: the
candidate step set decides how many runtime states (CUDA graphs) are captured,
which costs VRAM, so the KV pool can differ between policies, as it would on a
real GPU. Acceptance draws are common random numbers: request *i* sees the same
stream under every policy.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Final

from specgov.adapters.observation_builder import ObservationBuilder, decision_window_s
from specgov.adapters.telemetry import METRICS_READ
from specgov.policies.common.observation import Observation
from specgov.policies.common.types import Budget, SlotLayout
from specgov.policies.common.validation import is_real
from specgov.policies.control.core import ControlCore, policy_builder
from specgov.policies.daemon.estimators.step_cost import StepCostPrior
from specgov.policies.daemon.spec import (
    PolicySpec,
    format_policy_spec,
    parse_policy_spec,
    static_steps,
)

# One class for a bad policy spec, daemon's and replay's: re-exported for replay's callers.
from specgov.policies.daemon.spec import PolicySpecError as PolicySpecError
from specgov.policies.engine.ema import EmaPolicy
from specgov.policies.engine.fixed import FixedStepPolicy
from specgov.policies.engine.protocol import AdaptiveSpecPolicy
from specgov.policies.engine.table import TablePolicy
from specgov.policies.guardrails import GuardrailConfig
from specgov.simulator.catalog import (
    AcceptanceProfileSpec,
    Catalog,
    DrafterSpec,
    GpuSpec,
    ModelSpec,
)
from specgov.simulator.engine.acceptance import AcceptanceModel
from specgov.simulator.engine.core import Engine
from specgov.simulator.engine.cost import CostModel
from specgov.simulator.engine.interface import EngineConfig, EngineResult, VirtualClock
from specgov.simulator.engine.memory import MemoryPlan, budget_memory
from specgov.simulator.engine.prefix_cache import HicacheError, hicache_token_capacity
from specgov.simulator.engine.sglang_metrics import SimMetrics
from specgov.simulator.priors import check_prior_options, replay_step_cost_prior
from specgov.simulator.replay.closed_loop import ClosedLoop, ControlLoopConfig
from specgov.simulator.replay.metrics import Slo, summarise
from specgov.simulator.replay.oracle import ClairvoyantOracle, InformedOracle, oracle_report
from specgov.simulator.workload.traces import Request, Trace

# SGLang's adaptive controller only supports these (adaptive_unsupported_reason).
ADAPTIVE_ALGORITHMS = ("EAGLE", "EAGLE3")

# The adaptive config specgov launches SGLang with when a daemon policy drives it
# (the restart loop's default): finer batch-size slots than SGLang's default table
# and, in every slot, the steps a policy may need there. SGLang builds one runtime
# state per candidate and captures each step's CUDA graphs only for the batch sizes
# whose slot lists it, so large slots list fewer, smaller steps (less graph memory).
SPECGOV_SLOT_CANDIDATES: SlotLayout = (
    (1, (0, 1, 2, 3, 4, 5, 6, 7)),
    (4, (0, 1, 2, 3, 4, 5, 6, 7)),
    (8, (0, 1, 2, 3, 4, 5, 6)),
    (16, (0, 1, 2, 3, 4, 5)),
    (32, (0, 1, 2, 3, 4)),
    (64, (0, 1, 2, 3)),
    (128, (0, 1, 2)),
    (256, (0, 1, 2)),
)


# The file name the simulated server's /server_info reports for that config.
SPECGOV_ADAPTIVE_CONFIG_NAME = "specgov-adaptive.json"


# SGLang's EMA knobs in that config (per slot). SGLang's default table steps by 2 in
# its batch-size-1 slot (1, 3, 5, 7), so from 3 its EMA must leave (0.25, 2.5] to move;
# specgov's slots step by 1, where SGLang's default hysteresis (up 0, down -0.25) leaves
# adjacent steps only 0.25 of overlap (from k up above k - 0.5, from k + 1 down at or
# below k - 0.75), and the EMA of one request's accepted drafts per batch (alpha 0.2)
# swings wider than that every few batches at light load. An up hysteresis of 0.25 makes
# the overlap 0.5. Measured on conv-1x/h100/eagle3 (seed 0, exact prior): the EMA
# fallback's tier switches before the daemon's first table 11 -> 4, all in slot 1.
# Every launch path writes them (fleet_launch, sweep_launch, the simulated server).
SPECGOV_EMA_KNOBS: Final[dict[str, float]] = {"up_hysteresis": 0.25, "down_hysteresis": -0.25}


def specgov_adaptive_config() -> dict[str, Any]:
    """SPECGOV_SLOT_CANDIDATES (and SPECGOV_EMA_KNOBS) as a --speculative-adaptive-config
    JSON object."""
    return {
        str(slot): {"candidate_steps": list(steps), **SPECGOV_EMA_KNOBS}
        for slot, steps in SPECGOV_SLOT_CANDIDATES
    }


@dataclass(frozen=True)
class InEnginePolicy:
    """A named way to run the server: which policy object, which candidates."""

    name: str
    speculative: bool
    candidate_steps: tuple[int, ...]
    build: Callable[[int], AdaptiveSpecPolicy | None]  # initial_steps -> policy
    adaptive: bool = False
    # Daemon policies (closed loop): the spec the daemon runs; the in-engine
    # object is then a TablePolicy over specgov's adaptive config.
    daemon_spec: PolicySpec | None = None


# Domains an "observed" acceptance profile answers for (every label resolves to them).
OBSERVED_DOMAINS = ("sharegpt", "instructcoder", "cnn", "gsm8k", "mtbench")

KNOWN_POLICIES = (
    "in-engine: none, static:K (K >= 0), sglang-ema, oracle (clairvoyant) and "
    "oracle:informed (benchmarks); "
    "daemon (closed loop): batch-table:..., goodput[:...], bandit[:...]"
)
IN_ENGINE_KINDS = ("none", "static", "sglang-ema", "oracle")


def parse_policy(text: str) -> InEnginePolicy:
    """Parse a replay policy name: ``none``, ``static:K``, ``sglang-ema``, ``oracle``,
    ``oracle:informed`` or a daemon policy spec."""
    raw = text.strip()
    kind, _, arg = raw.partition(":")
    kind = kind.strip().lower()
    if kind == "oracle":
        # Benchmark yardsticks (specgov.simulator.replay.oracle): per batch, the step with the most
        # tokens per second given the true acceptance draws (clairvoyant) or the true
        # acceptance distributions (informed); the daemon policies' steps.
        variant = arg.strip().lower()
        if variant not in ("", "informed"):
            raise PolicySpecError(
                f"policy {raw!r}: expected 'oracle' (clairvoyant) or 'oracle:informed'"
            )
        every = tuple(sorted({k for _, ks in SPECGOV_SLOT_CANDIDATES for k in ks}))
        cls = InformedOracle if variant else ClairvoyantOracle
        return InEnginePolicy(
            cls.name,
            True,
            every,
            lambda initial: cls(every, initial if initial in every else None),
        )
    if kind == "none":
        if arg:
            raise PolicySpecError(f"policy {raw!r}: 'none' takes no argument")
        return InEnginePolicy("none", False, (), lambda _steps: None)
    try:
        steps = static_steps(raw)
    except PolicySpecError as exc:
        raise PolicySpecError(f"{exc} (replay policies: {KNOWN_POLICIES})") from None
    if steps is not None:
        return InEnginePolicy(
            f"static:{steps}", True, (steps,), lambda _initial: FixedStepPolicy(steps)
        )
    if kind == "sglang-ema":
        if arg:
            raise PolicySpecError(
                f"policy {raw!r}: sglang-ema uses SGLang's default slot table and takes no argument"
            )
        probe = EmaPolicy(initial_steps=1)
        return InEnginePolicy(
            "sglang-ema",
            True,
            tuple(probe.candidate_steps),
            lambda initial: EmaPolicy(initial_steps=initial),
            adaptive=True,
        )
    try:
        spec = parse_policy_spec(raw)
    except PolicySpecError as exc:  # name replay's own kinds too
        raise PolicySpecError(f"{exc} (replay policies: {KNOWN_POLICIES})") from None
    union = tuple(sorted({k for _, steps in SPECGOV_SLOT_CANDIDATES for k in steps}))
    return InEnginePolicy(
        format_policy_spec(spec),
        True,
        union,
        lambda _initial: None,
        adaptive=True,
        daemon_spec=spec,
    )


def sglang_gpu_defaults(memory_gib: float) -> tuple[int, int]:
    """(chunked_prefill_size, decode cuda_graph_max_bs) SGLang picks by GPU memory, TP < 4.

    From ``arg_groups/memory_hook.py`` of sglang 0.5.23 (thresholds in MiB there).
    """
    mib = memory_gib * 1024
    if mib < 20 * 1024:
        return 2048, 8
    if mib < 35 * 1024:
        return 4096, 48
    if mib < 60 * 1024:
        return 4096, 32
    if mib < 160 * 1024:
        return 8192, 256
    return 16384, 512


@dataclass(frozen=True)
class ServerSpec:
    """The simulated deployment: hardware, model, drafter and SGLang server args."""

    gpu: str = "h100"
    model: str = "llama-3.1-8b"
    drafter: str = "eagle3"
    spec_steps: int = 3  # --speculative-num-steps (initial step for adaptive)
    topk: int = 1
    num_draft_tokens: int | None = None  # None: steps + 1 (chains)
    acceptance_profile: str | None = None  # None: the drafter's own profile
    # Measured per-position conditional acceptance (e.g. from live telemetry): used for
    # every request instead of a named profile when given.
    acceptance_rates: tuple[float, ...] | None = None
    burstiness: float | None = None  # None: the acceptance model's default
    mem_fraction_static: float | None = None
    max_running_requests: int | None = None
    chunked_prefill_size: int | None = None
    cuda_graph_max_bs: int | None = None
    catalog_files: tuple[Path, ...] = ()
    # Wrong priors on purpose (honest evaluation; the simulated GPU stays the catalog's):
    # the daemon policy's step-cost prior believes every step costs prior_scale x the
    # truth, and is built for prior_gpu (None: the simulated gpu) - a wrong knee.
    prior_scale: float = 1.0
    prior_gpu: str | None = None
    # SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND=1 at launch: step 0 skips the draft-extend
    # pass, upshifts draft cold (EngineConfig documents the cost model).
    skip_zero_step_draft_extend: bool = False
    # SGLang's radix cache (on by default there); False: --disable-radix-cache, replay's
    # --no-prefix-cache. Only requests with prefix block ids (hash_ids) can hit.
    prefix_cache: bool = True
    # SGLang's --enable-hierarchical-cache (host tier of the radix cache), sized by
    # --hicache-size (GB per rank, wins when > 0) or --hicache-ratio (x the KV pool;
    # None: SGLang's 2.0). prefix_cache_summary reports the hit rate per tier.
    hierarchical_cache: bool = False
    hicache_ratio: float | None = None
    hicache_size_gb: int = 0
    # GPU time per tier switch (ms); None: the drafter catalog's tier_switch_ms (0 built in).
    tier_switch_ms: float | None = None
    # GPU memory per GPU SGLang may use (GiB; the daemon's budget.vram_gib), planned as if
    # the GPU had only this much; None: the whole GPU.
    vram_gib: float | None = None

    def __post_init__(self) -> None:
        check_prior_options(self.prior_scale, self.prior_gpu, self.catalog_files)
        if self.hierarchical_cache and not self.prefix_cache:
            raise HicacheError(
                "--enable-hierarchical-cache needs the radix cache: drop --disable-radix-cache"
            )
        if not self.hierarchical_cache and (self.hicache_ratio is not None or self.hicache_size_gb):
            raise HicacheError(
                "--hicache-ratio/--hicache-size size the host tier: add "
                "--enable-hierarchical-cache (without it they have no effect)"
            )
        # Checks the flags' forms now (the capacity itself needs the KV pool).
        hicache_token_capacity(
            1, 1.0, hicache_ratio=self.hicache_ratio, hicache_size_gb=self.hicache_size_gb
        )
        ms = self.tier_switch_ms
        if ms is not None and (not is_real(ms) or ms < 0):
            raise PolicySpecError(f"tier_switch_ms: expected a number >= 0 (ms), got {ms!r}")
        vram = self.vram_gib
        if vram is not None and (not is_real(vram) or vram <= 0):
            raise PolicySpecError(f"vram_gib: expected a number > 0 (GiB), got {vram!r}")

    def switch_ms(self, drafter: DrafterSpec) -> float:
        """The tier-switch cost this server runs with (ms): the override, else the catalog's."""
        return drafter.tier_switch_ms if self.tier_switch_ms is None else float(self.tier_switch_ms)


def hicache_engine_fields(server: ServerSpec, gpu: GpuSpec, memory: MemoryPlan) -> dict[str, Any]:
    """EngineConfig's host-tier fields for *server* on *memory*'s KV pool: the tier's
    tokens (SGLang's sizing) and the PCIe load-back seconds per token (the rank's KV
    bytes over the catalog's ``pcie_gb_s``); empty without a hierarchical cache."""
    if not server.hierarchical_cache:
        return {}
    if gpu.pcie_gb_s is None:
        raise HicacheError(
            f"GPU {gpu.name!r} has no pcie_gb_s in the catalog: the hierarchical cache's "
            "load-back needs it (add pcie_gb_s: <GB/s> to its catalog entry)"
        )
    per_token = memory.kv_bytes_per_token
    return {
        "hicache_token_capacity": hicache_token_capacity(
            memory.kv_token_capacity,
            per_token,
            hicache_ratio=server.hicache_ratio,
            hicache_size_gb=server.hicache_size_gb,
        ),
        "hicache_load_s_per_token": per_token / (gpu.pcie_gb_s * 1e9),
    }


@dataclass
class PolicyRun:
    policy: InEnginePolicy
    result: EngineResult
    memory: MemoryPlan | None
    summary: dict[str, Any]
    wall_s: float
    loop: ClosedLoop | None = None  # daemon policies: the loop (its audit rows)


@dataclass
class ReplayReport:
    trace: dict[str, Any]
    server: dict[str, Any]
    seed: int
    slo: Slo
    runs: list[PolicyRun] = field(default_factory=list)
    # The oracles' fleet ceiling (specgov.simulator.replay.oracle.oracle_report); None: no oracle.
    ceiling: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "policies": [run.summary for run in self.runs],
            "ceiling": self.ceiling,
            "trace": self.trace,
            "server": self.server,
            "slo": {"tpot_ms": self.slo.tpot_ms, "ttft_ms": self.slo.ttft_ms},
            "seed": self.seed,
        }


@dataclass(frozen=True)
class BuiltServer:
    gpu: GpuSpec
    model: ModelSpec
    drafter: DrafterSpec
    # The acceptance profile from a catalog file (e.g. `specgov fit-acceptance`'s), when
    # the server's profile names one; None: a built-in profile.
    acceptance: AcceptanceProfileSpec | None = None


def resolve(server: ServerSpec) -> BuiltServer:
    catalog = Catalog.load(server.catalog_files)
    drafter = catalog.drafter(server.drafter)
    return BuiltServer(
        gpu=catalog.gpu(server.gpu),
        model=catalog.model(server.model),
        drafter=drafter,
        acceptance=catalog.acceptance_profile(
            server.acceptance_profile or drafter.acceptance_profile
        ),
    )


def acceptance_model(
    server: ServerSpec, built: BuiltServer, *, seed: int, token_model: bool = True
) -> AcceptanceModel:
    """The acceptance model of *server*: measured rates, a catalog file's profile (e.g.
    fitted by ``specgov fit-acceptance``) or a built-in profile, in that order."""
    ndt = server.num_draft_tokens if server.topk > 1 else None
    kwargs: dict[str, Any] = {
        "topk": server.topk,
        "num_draft_tokens": ndt,
        "seed": seed,
        "token_model": token_model,
    }
    if server.burstiness is not None:
        kwargs["burstiness"] = server.burstiness
    if server.acceptance_rates is not None:
        rates = tuple(server.acceptance_rates)
        return AcceptanceModel(
            "observed",
            profiles={"observed": {domain: rates for domain in OBSERVED_DOMAINS}},
            **kwargs,
        )
    if built.acceptance is not None:
        spec = built.acceptance
        return AcceptanceModel(
            spec.name,
            profiles=spec.as_profiles(),
            default_domain=spec.default_domain,
            **kwargs,
        )
    return AcceptanceModel(server.acceptance_profile or built.drafter.acceptance_profile, **kwargs)


@dataclass
class PreparedRun:
    """One simulated server, ready to replay: the engine and, for daemon policies,
    the closed loop (daemon in virtual time) and the /metrics it scrapes."""

    policy: InEnginePolicy
    engine: Engine
    memory: MemoryPlan
    loop: ClosedLoop | None = None
    metrics: SimMetrics | None = None

    def run(
        self,
        requests: Sequence[Request],
        *,
        progress: Callable[[int, int], None] | None = None,
        concurrency: int | None = None,
    ) -> EngineResult:
        if self.loop is None:
            return self.engine.run(
                requests, progress=progress, metrics=self.metrics, concurrency=concurrency
            )
        return self.engine.run(
            requests,
            progress=progress,
            metrics=self.metrics,
            on_tick=self.loop.on_tick,
            tick_interval_s=self.loop.config.scrape_interval_s,
            concurrency=concurrency,
        )


def _run_memory(
    server: ServerSpec, policy: InEnginePolicy, b: BuiltServer, drafter: DrafterSpec | None
) -> tuple[MemoryPlan, int, int, int | None]:
    """The run's memory plan (fails when it cannot fit), with the chunked-prefill size,
    CUDA-graph batch bound and draft-token count it was planned for."""
    chunk_default, graph_default = sglang_gpu_defaults(b.gpu.memory_gib)
    chunk = server.chunked_prefill_size or chunk_default
    graph_max_bs = server.cuda_graph_max_bs or graph_default
    if server.max_running_requests is not None:
        graph_max_bs = min(graph_max_bs, server.max_running_requests)
    ndt = server.num_draft_tokens if server.topk > 1 else None
    # A VRAM budget below the GPU's: SGLang sizes its pools from what it may use.
    planned_gpu = b.gpu
    if server.vram_gib is not None and server.vram_gib < b.gpu.memory_gib:
        planned_gpu = replace(b.gpu, memory_gib=float(server.vram_gib))
    memory = budget_memory(
        planned_gpu,
        b.model,
        drafter,
        mem_fraction_static=server.mem_fraction_static,
        candidate_steps=policy.candidate_steps if policy.speculative else (),
        cuda_graph_max_bs=graph_max_bs,
        topk=server.topk,
        num_draft_tokens=ndt,
        chunked_prefill_size=chunk,
    ).require_fit()
    return memory, chunk, graph_max_bs, ndt


def prepare_run(
    server: ServerSpec,
    policy: InEnginePolicy,
    *,
    seed: int,
    slo: Slo | None = None,
    built: BuiltServer | None = None,
    record_events: bool = False,
    loop_config: ControlLoopConfig | None = None,
    guardrails: GuardrailConfig | None = None,
) -> PreparedRun:
    """Construct the simulated server for one policy (fails early if it cannot fit)."""
    b = built or resolve(server)
    drafter = b.drafter if policy.speculative else None
    if policy.adaptive:
        _check_adaptive(policy, server, b)
    memory, chunk, graph_max_bs, ndt = _run_memory(server, policy, b, drafter)
    cost = CostModel.from_catalog(b.gpu, b.model, drafter, topk=server.topk, num_draft_tokens=ndt)
    acceptance = None
    if policy.speculative:
        acceptance = acceptance_model(server, b, seed=seed)
    config = _engine_config(
        server,
        policy,
        b,
        memory,
        chunk=chunk,
        graph_max_bs=graph_max_bs,
        record_events=record_events,
    )
    clock = VirtualClock()
    loop: ClosedLoop | None = None
    metrics: SimMetrics | None = None
    in_engine: AdaptiveSpecPolicy | None
    if policy.daemon_spec is not None:
        metrics = SimMetrics(model_name=b.model.name, kv_capacity_tokens=memory.kv_token_capacity)
        loop = _closed_loop(
            policy.daemon_spec,
            prior=_replay_prior(cost, server),
            clock=clock,
            metrics=metrics,
            kv_capacity=memory.kv_token_capacity,
            slo=slo or Slo(),
            loop_config=loop_config,
            guardrails=guardrails,
            algorithm=b.drafter.algorithm.upper(),
            spec_steps=server.spec_steps,
        )
        in_engine = _table_policy(loop, clock, server.spec_steps)
    else:
        in_engine = policy.build(server.spec_steps)
    initial = None
    if in_engine is not None:
        # SGLang starts on --speculative-num-steps; a static server *is* that step.
        initial = server.spec_steps if server.spec_steps in in_engine.candidate_steps else None
    engine = Engine(
        config=config,
        cost=cost,
        policy=in_engine,
        acceptance=acceptance,
        initial_steps=initial,
        clock=clock,
    )
    return PreparedRun(policy=policy, engine=engine, memory=memory, loop=loop, metrics=metrics)


def _engine_config(
    server: ServerSpec,
    policy: InEnginePolicy,
    b: BuiltServer,
    memory: MemoryPlan,
    *,
    chunk: int,
    graph_max_bs: int,
    record_events: bool,
) -> EngineConfig:
    """The engine's scheduler and cache settings, as SGLang would run *server*."""
    ndt = server.num_draft_tokens if server.topk > 1 else None
    return EngineConfig(
        kv_token_capacity=memory.kv_token_capacity,
        max_running_requests=server.max_running_requests,
        chunked_prefill_size=chunk,
        cuda_graph_max_bs=graph_max_bs,
        topk=server.topk,
        num_draft_tokens=ndt,
        record_events=record_events,
        skip_zero_step_draft_extend=server.skip_zero_step_draft_extend,
        prefix_cache=server.prefix_cache,
        **hicache_engine_fields(server, b.gpu, memory),
        tier_switch_s=server.switch_ms(b.drafter) / 1e3 if policy.speculative else 0.0,
    )


def _replay_prior(cost: CostModel, server: ServerSpec) -> StepCostPrior:
    """The daemon policies' step-cost prior: the simulated GPU's truth, or the wrong
    prior the server asks for on purpose (--prior-scale, --prior-gpu)."""
    return replay_step_cost_prior(
        cost,
        model=server.model,
        drafter=server.drafter,
        prior_scale=server.prior_scale,
        prior_gpu=server.prior_gpu,
        catalog_files=server.catalog_files,
    )


def _check_adaptive(policy: InEnginePolicy, server: ServerSpec, b: BuiltServer) -> None:
    """SGLang's adaptive speculation runs only EAGLE/EAGLE3 chains."""
    algo = b.drafter.algorithm.upper()
    if algo not in ADAPTIVE_ALGORITHMS:
        raise PolicySpecError(
            f"policy {policy.name!r} needs SGLang's adaptive speculation, which supports "
            f"only EAGLE/EAGLE3 drafters; drafter {b.drafter.name!r} is {algo}"
        )
    if server.topk != 1:
        raise PolicySpecError(
            f"policy {policy.name!r}: SGLang's adaptive speculation supports only topk=1, "
            f"got topk={server.topk}"
        )


def _table_policy(loop: ClosedLoop, clock: VirtualClock, spec_steps: int) -> TablePolicy:
    """The in-engine side of a daemon policy: the plugin's table policy on the loop's
    spool stand-ins, SGLang's EMA as its fallback."""
    fallback = EmaPolicy(initial_steps=spec_steps, config=specgov_adaptive_config())
    return TablePolicy(
        table_source=loop.table_source,
        stats_sink=loop.stats_sink,
        clock=clock,
        fallback=fallback,
        flush_interval_s=loop.config.stats_flush_s,
        poll_every_batches=loop.config.poll_every_batches,
    )


def specgov_server_info(*, algorithm: str, spec_steps: int, kv_capacity: int) -> dict[str, Any]:
    """The ``/server_info`` fields the daemon reads, as SGLang 0.5.23 reports them for a
    server launched with specgov's adaptive config (``SPECGOV_SLOT_CANDIDATES``)."""
    return {
        "dp_size": 1,
        "max_total_num_tokens": kv_capacity,
        "speculative_algorithm": algorithm,
        "speculative_adaptive": True,
        "speculative_adaptive_config": SPECGOV_ADAPTIVE_CONFIG_NAME,
        "speculative_num_steps": spec_steps,
        "speculative_eagle_topk": 1,
        "speculative_num_draft_tokens": spec_steps + 1,
    }


def _closed_loop(
    spec: PolicySpec,
    *,
    prior: StepCostPrior,
    clock: VirtualClock,
    metrics: SimMetrics,
    kv_capacity: int,
    slo: Slo,
    loop_config: ControlLoopConfig | None,
    guardrails: GuardrailConfig | None,
    algorithm: str,
    spec_steps: int,
) -> ClosedLoop:
    """The daemon side: the daemon's control core, observing the simulated /metrics."""
    core = ControlCore(
        policy_builder(prior=prior, guardrails=guardrails),
        Budget(
            vram_gib=None,
            slo_tpot_ms=slo.tpot_ms,
            slo_itl_p99_ms=None,
            slo_ttft_p99_ms=slo.ttft_ms,
            allowed_steps=None,
        ),
        "plugin",
    )
    cadence = loop_config or ControlLoopConfig()
    builder = ObservationBuilder(
        adaptive_config=specgov_adaptive_config(),
        min_window_s=decision_window_s(cadence.interval_s, cadence.scrape_interval_s),
    )
    info: list[dict[str, Any]] = [
        specgov_server_info(algorithm=algorithm, spec_steps=spec_steps, kv_capacity=kv_capacity)
    ]

    def observe(now_s: float) -> Observation:
        # As the daemon: /metrics every poll, /server_info once (the builder keeps it).
        # Only the families the daemon reads, as the snapshot its parser would make of
        # their text, built from the simulated server's cells without rendering and
        # parsing the text back (tests/test_sim_metrics.py: the same observations).
        snapshot = metrics.read_snapshot(METRICS_READ)
        return builder.feed(now_s, snapshot, info.pop() if info else None)

    return ClosedLoop(
        core=core,
        policy_spec=format_policy_spec(spec),
        observe=observe,
        clock=clock,
        config=cadence,
    )


def build_engine(
    server: ServerSpec,
    policy: InEnginePolicy,
    *,
    seed: int,
    built: BuiltServer | None = None,
    record_events: bool = False,
) -> tuple[Engine, MemoryPlan]:
    """The engine for an in-engine policy (daemon policies need ``prepare_run``)."""
    if policy.daemon_spec is not None:
        raise PolicySpecError(
            f"policy {policy.name!r} runs a daemon loop: use prepare_run(...).run(...)"
        )
    prepared = prepare_run(server, policy, seed=seed, built=built, record_events=record_events)
    return prepared.engine, prepared.memory


def prefix_cache_summary(result: EngineResult) -> dict[str, Any]:
    """The prefix-cache figures of one run (replay JSON keys): the hit rate (reused /
    looked-up prompt tokens, first admissions, as SGLang's cache_hit_rate), the tokens
    behind it, the prefill tokens computed and the cached tokens evicted; with a
    hierarchical cache also the host tier's share of the hits, its token capacity,
    its evictions and the PCIe load-back seconds (the hit rate counts both tiers)."""
    out: dict[str, Any] = {
        "prefix_cache_hit_rate": result.prefix_cache_hit_rate,
        "prefix_cache_hit_tokens": result.cache_hit_tokens,
        "prefix_cache_lookup_tokens": result.cache_lookup_tokens,
        "prefix_cache_evicted_tokens": result.cache_evicted_tokens,
        "prefill_tokens": result.prefill_tokens,
    }
    if result.hicache_token_capacity:
        out.update(
            {
                "prefix_cache_hit_rate_device": result.prefix_cache_hit_rate
                - result.prefix_cache_hit_rate_host,
                "prefix_cache_hit_rate_host": result.prefix_cache_hit_rate_host,
                "prefix_cache_hit_host_tokens": result.cache_hit_host_tokens,
                "hicache_token_capacity": result.hicache_token_capacity,
                "hicache_evicted_tokens": result.cache_host_evicted_tokens,
                "hicache_load_s": result.hicache_load_s,
            }
        )
    return out


def _server_summary(server: ServerSpec, built: BuiltServer) -> dict[str, Any]:
    """The replay report's ``server`` object: what the runs were simulated on."""
    return {
        "gpu": built.gpu.name,
        "model": built.model.name,
        "drafter": built.drafter.name,
        "algorithm": built.drafter.algorithm,
        "spec_steps": server.spec_steps,
        "topk": server.topk,
        "num_draft_tokens": server.num_draft_tokens,
        "acceptance_profile": server.acceptance_profile or built.drafter.acceptance_profile,
        "skip_zero_step_draft_extend": server.skip_zero_step_draft_extend,
        "prefix_cache": server.prefix_cache,
        "hierarchical_cache": server.hierarchical_cache,
        "hicache_ratio": server.hicache_ratio,
        "hicache_size_gb": server.hicache_size_gb,
        "tier_switch_ms": server.switch_ms(built.drafter),
        # Only when set: a run without a budget reports what it always did.
        **({} if server.vram_gib is None else {"vram_gib": server.vram_gib}),
        "prior": {
            "gpu": (
                Catalog.load(server.catalog_files).gpu(server.prior_gpu).name
                if server.prior_gpu is not None
                else built.gpu.name
            ),
            "scale": server.prior_scale,
        },
    }


def replay(
    trace: Trace,
    server: ServerSpec,
    policies: Sequence[str | InEnginePolicy],
    *,
    slo: Slo | None = None,
    seed: int = 0,
    progress: Callable[[str, int, int], None] | None = None,
    concurrency: int | None = None,
) -> ReplayReport:
    """Run *trace* once per policy and summarise each run.

    ``concurrency=N`` replays as N closed-loop users (see ``Engine.run``).
    """
    parsed = [p if isinstance(p, InEnginePolicy) else parse_policy(p) for p in policies]
    if not parsed:
        raise PolicySpecError(f"no policy given; valid: {KNOWN_POLICIES}")
    names = [p.name for p in parsed]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise PolicySpecError(f"policy given twice: {', '.join(dupes)}")
    slo = slo or Slo()
    built = resolve(server)
    report = ReplayReport(
        trace=trace.summary(),
        server=_server_summary(server, built),
        seed=seed,
        slo=slo,
    )
    if concurrency is not None:
        report.trace["concurrency"] = concurrency
    # Build every engine first so a configuration that cannot fit fails
    # before any simulation time is spent.
    prepared = [prepare_run(server, p, seed=seed, slo=slo, built=built) for p in parsed]
    for run in prepared:
        policy, memory = run.policy, run.memory
        cb = None
        if progress is not None:

            def cb(done: int, total: int, _name: str = policy.name) -> None:
                progress(_name, done, total)

        started = time.perf_counter()
        result = run.run(trace.requests, progress=cb, concurrency=concurrency)
        wall = time.perf_counter() - started
        summary = summarise(policy.name, result, slo)
        summary.update(prefix_cache_summary(result))
        summary["wall_s"] = wall
        summary["sim_output_tokens_per_wall_s"] = result.output_tokens / wall if wall > 0 else None
        if run.loop is not None:
            log = run.loop.log
            summary["decisions"] = len(log.decisions)
            summary["table_changes"] = log.table_changes
            summary["mean_decide_ms"] = log.mean_decide_ms
        report.runs.append(PolicyRun(policy, result, memory, summary, wall, run.loop))
    report.ceiling = oracle_report([run.summary for run in report.runs])
    return report
