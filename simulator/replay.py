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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specgov.policies.ema import EmaPolicy
from specgov.policies.fixed import FixedStepPolicy
from specgov.policies.protocol import AdaptiveSpecPolicy
from specgov.simulator.acceptance import AcceptanceModel
from specgov.simulator.catalog import Catalog, DrafterSpec, GpuSpec, ModelSpec
from specgov.simulator.cost import CostModel
from specgov.simulator.engine import Engine, EngineConfig, EngineResult
from specgov.simulator.memory import MemoryPlan, plan_memory
from specgov.simulator.metrics import Slo, summarise
from specgov.simulator.traces import Trace

# SGLang's adaptive controller only supports these (adaptive_unsupported_reason).
ADAPTIVE_ALGORITHMS = ("EAGLE", "EAGLE3")


class PolicySpecError(ValueError):
    """A --policy value could not be understood; the message says which part."""


@dataclass(frozen=True)
class InEnginePolicy:
    """A named way to run the server: which policy object, which candidates."""

    name: str
    speculative: bool
    candidate_steps: tuple[int, ...]
    build: Callable[[int], AdaptiveSpecPolicy | None]  # initial_steps -> policy
    adaptive: bool = False


KNOWN_POLICIES = "none, static:K (K >= 0), sglang-ema"


def parse_policy(text: str) -> InEnginePolicy:
    """Parse a replay policy name: ``none``, ``static:K`` or ``sglang-ema``."""
    raw = text.strip()
    kind, _, arg = raw.partition(":")
    kind = kind.strip().lower()
    if kind == "none":
        if arg:
            raise PolicySpecError(f"policy {raw!r}: 'none' takes no argument")
        return InEnginePolicy("none", False, (), lambda _steps: None)
    if kind == "static":
        try:
            steps = int(arg)
        except ValueError:
            raise PolicySpecError(
                f"policy {raw!r}: expected static:K with K a non-negative integer, got {arg!r}"
            ) from None
        if steps < 0:
            raise PolicySpecError(f"policy {raw!r}: K must be >= 0, got {steps}")
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
    raise PolicySpecError(f"unknown policy {raw!r}; valid: {KNOWN_POLICIES}")


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
    burstiness: float | None = None  # None: the acceptance model's default
    mem_fraction_static: float | None = None
    max_running_requests: int | None = None
    chunked_prefill_size: int | None = None
    cuda_graph_max_bs: int | None = None
    catalog_files: tuple[Path, ...] = ()


@dataclass
class PolicyRun:
    policy: InEnginePolicy
    result: EngineResult
    memory: MemoryPlan | None
    summary: dict[str, Any]
    wall_s: float


@dataclass
class ReplayReport:
    trace: dict[str, Any]
    server: dict[str, Any]
    seed: int
    slo: Slo
    runs: list[PolicyRun] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "policies": [run.summary for run in self.runs],
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


def resolve(server: ServerSpec) -> BuiltServer:
    catalog = Catalog.load(server.catalog_files)
    return BuiltServer(
        gpu=catalog.gpu(server.gpu),
        model=catalog.model(server.model),
        drafter=catalog.drafter(server.drafter),
    )


def build_engine(
    server: ServerSpec,
    policy: InEnginePolicy,
    *,
    seed: int,
    built: BuiltServer | None = None,
    record_events: bool = False,
) -> tuple[Engine, MemoryPlan]:
    """Construct the simulated server for one policy (fails early if it cannot fit)."""
    b = built or resolve(server)
    drafter = b.drafter if policy.speculative else None
    if policy.adaptive:
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
    chunk_default, graph_default = sglang_gpu_defaults(b.gpu.memory_gib)
    chunk = server.chunked_prefill_size or chunk_default
    graph_max_bs = server.cuda_graph_max_bs or graph_default
    if server.max_running_requests is not None:
        graph_max_bs = min(graph_max_bs, server.max_running_requests)
    ndt = server.num_draft_tokens if server.topk > 1 else None
    memory = plan_memory(
        b.gpu,
        b.model,
        drafter,
        mem_fraction_static=server.mem_fraction_static,
        candidate_steps=policy.candidate_steps if policy.speculative else (),
        cuda_graph_max_bs=graph_max_bs,
        topk=server.topk,
        num_draft_tokens=ndt,
        chunked_prefill_size=chunk,
    )
    cost = CostModel.from_catalog(b.gpu, b.model, drafter, topk=server.topk, num_draft_tokens=ndt)
    acceptance = None
    if policy.speculative:
        kwargs: dict[str, Any] = {"topk": server.topk, "num_draft_tokens": ndt, "seed": seed}
        if server.burstiness is not None:
            kwargs["burstiness"] = server.burstiness
        acceptance = AcceptanceModel(
            server.acceptance_profile or b.drafter.acceptance_profile, **kwargs
        )
    in_engine = policy.build(server.spec_steps)
    config = EngineConfig(
        kv_token_capacity=memory.kv_token_capacity,
        max_running_requests=server.max_running_requests,
        chunked_prefill_size=chunk,
        cuda_graph_max_bs=graph_max_bs,
        topk=server.topk,
        num_draft_tokens=ndt,
        record_events=record_events,
    )
    initial = None
    if in_engine is not None:
        # SGLang starts on --speculative-num-steps; a static server *is* that step.
        initial = server.spec_steps if server.spec_steps in in_engine.candidate_steps else None
    engine = Engine(
        config=config, cost=cost, policy=in_engine, acceptance=acceptance, initial_steps=initial
    )
    return engine, memory


def replay(
    trace: Trace,
    server: ServerSpec,
    policies: Sequence[str | InEnginePolicy],
    *,
    slo: Slo | None = None,
    seed: int = 0,
    progress: Callable[[str, int, int], None] | None = None,
) -> ReplayReport:
    """Run *trace* once per policy and summarise each run."""
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
        server={
            "gpu": built.gpu.name,
            "model": built.model.name,
            "drafter": built.drafter.name,
            "algorithm": built.drafter.algorithm,
            "spec_steps": server.spec_steps,
            "topk": server.topk,
            "num_draft_tokens": server.num_draft_tokens,
            "acceptance_profile": server.acceptance_profile or built.drafter.acceptance_profile,
        },
        seed=seed,
        slo=slo,
    )
    # Build every engine first so a configuration that cannot fit fails
    # before any simulation time is spent.
    engines = [(p, *build_engine(server, p, seed=seed, built=built)) for p in parsed]
    for policy, engine, memory in engines:
        cb = None
        if progress is not None:

            def cb(done: int, total: int, _name: str = policy.name) -> None:
                progress(_name, done, total)

        started = time.perf_counter()
        result = engine.run(trace.requests, progress=cb)
        wall = time.perf_counter() - started
        summary = summarise(policy.name, result, slo)
        summary["wall_s"] = wall
        summary["sim_output_tokens_per_wall_s"] = result.output_tokens / wall if wall > 0 else None
        report.runs.append(PolicyRun(policy, result, memory, summary, wall))
    return report
