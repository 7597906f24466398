"""Fleet planning: N replicas behind a router on one trace, speculative and plain mixed.

A speculative SGLang server cannot switch speculation off completely at run time:
step 0 still pays the drafter's memory and its draft-extend pass (REFERENCE §1;
vLLM measured a K=0 speculative engine at 232 tok/s where a plain one served 331
at 8 concurrent requests, REFERENCE §3). So at high load the cheapest fleet may
mix speculative replicas (fast at small batch) with plain ones (no drafter, more
KV, cheaper steps at large batch), and route by load. This module simulates that:

* a fleet is ``n`` speculative replicas (one in-engine or daemon policy, the
  specs replay takes: ``static:K``, ``sglang-ema``, ``goodput``, ...) plus ``m``
  plain replicas (``none``: no drafter memory, no step-0 cost), each built by
  ``replay.prepare_run`` from the same catalog entries, so its KV pool and step
  costs are what a real server of that kind would have;
* the trace is scaled to the target rate and routed over the replicas in
  lock-step virtual time (``fleet_engine``) by a router (``router``);
* per fleet: goodput, SLO attainment, the latency percentiles the SLO is judged
  on, GPUs and cost; then the best fleet for the target rate, the best plain and
  the best speculative fleet, and what speculation saves.

Judging (the same for every fleet, so rows compare):

* a request meets the SLO when its TPOT is within ``slo_tpot_ms`` (single-token
  requests have no TPOT and pass that part) and its TTFT within ``slo_ttft_ms``;
  an aborted request meets neither and counts as an infinite latency;
* a fleet *holds* the SLO when the ``slo_percentile``-th percentile (nearest
  rank, over every request of the trace) of TPOT and of TTFT are within the
  targets;
* ``slo_attainment`` is the fraction of the trace's requests that met the SLO;
  goodput is their output tokens over the fleet's span (first arrival to last
  completion), as ``simulator.metrics`` defines it for one server.

The best fleet is the cheapest that holds the SLO (cost per hour with prices,
GPUs without); at equal cost the simpler one (plain before speculative, static before
a daemon policy: ``simplicity.py``), then the most SLO headroom, then goodput. When
none holds it, the plan says so and names the fleet closest to holding it (highest
attainment).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from specgov.simulator.engine.acceptance import AcceptanceModel
from specgov.simulator.engine.cost import CostModel
from specgov.simulator.engine.memory import MemoryPlan, MemoryPlanError
from specgov.simulator.planning.fleet_engine import ReplicaStepper, simulate_fleet
from specgov.simulator.planning.fleet_judge import choose, judge, recommendation_text, replica_row
from specgov.simulator.planning.fleet_launch import launch_args
from specgov.simulator.planning.fleet_model import PerTokenTables, per_token_tables, slot_candidates
from specgov.simulator.planning.fleet_spec import (
    PLAIN,
    FleetPlanConfig,
    FleetShape,
    FleetSpecError,
    offered_rps,
    scale_to_rps,
)
from specgov.simulator.planning.prices import Prices
from specgov.simulator.planning.router import RouterSpec
from specgov.simulator.planning.trace_load import trace_load
from specgov.simulator.planning.vram import vram_document
from specgov.simulator.replay.metrics import Slo
from specgov.simulator.replay.runner import (
    BuiltServer,
    InEnginePolicy,
    PolicySpecError,
    PreparedRun,
    ServerSpec,
    parse_policy,
    prepare_run,
    resolve,
)
from specgov.simulator.workload.traces import Trace

TABLE_DOC_LEN = 512


@dataclass
class _Kind:
    """One replica kind, resolved once: its policy and a probe of its memory and costs."""

    policy: InEnginePolicy
    memory: MemoryPlan | None
    error: str | None
    launch: dict[str, Any]
    probe: PreparedRun | None


def _kind(server: ServerSpec, built: BuiltServer, name: str, cfg: FleetPlanConfig) -> _Kind:
    return _probe_kind(server, built, name, seed=cfg.seed, slo=cfg.slo)


def _probe_kind(server: ServerSpec, built: BuiltServer, name: str, *, seed: int, slo: Slo) -> _Kind:
    policy = parse_policy(name)
    launch = launch_args(
        policy if policy.speculative else None,
        algorithm=built.drafter.algorithm.upper(),
        server=server,
    )
    try:
        probe = prepare_run(server, policy, seed=seed, slo=slo, built=built)
    except (MemoryPlanError, PolicySpecError, ValueError) as exc:
        return _Kind(policy, None, str(exc), launch, None)
    return _Kind(policy, probe.memory, None, launch, probe)


def _domain_weights(trace: Trace) -> dict[str | None, float]:
    weights: dict[str | None, float] = {}
    for r in trace.requests:
        weights[r.domain] = weights.get(r.domain, 0.0) + 1.0
    return weights


def _runnable_batch(prepared: PreparedRun, footprint_tokens: float) -> int:
    """Requests a replica can run at once: its running cap and the KV pool's share."""
    cfg = prepared.engine.config
    by_kv = int(prepared.memory.kv_token_capacity // max(footprint_tokens, 1.0))
    return max(1, min(cfg.running_cap, by_kv, 4096))


def _tables(kind: _Kind, plain: _Kind, trace: Trace) -> PerTokenTables | None:
    """The spec-aware router's per-token tables for this speculative kind."""
    if kind.probe is None or plain.probe is None:
        return None
    engine = kind.probe.engine
    acceptance = engine.acceptance
    spec_cost = engine.cost
    plain_cost = plain.probe.engine.cost
    if (
        not isinstance(acceptance, AcceptanceModel)
        or not isinstance(spec_cost, CostModel)
        or not isinstance(plain_cost, CostModel)
    ):
        return None
    n = len(trace.requests)
    context = sum(r.input_tokens + r.output_tokens / 2.0 for r in trace.requests) / n
    footprint = sum(r.input_tokens + r.output_tokens for r in trace.requests) / n
    return per_token_tables(
        spec_cost,
        plain_cost,
        acceptance,
        slot_candidates(kind.policy, engine.cuda_graph_bs),
        context_tokens=context,
        domain_weights=_domain_weights(trace),
        spec_max_batch=_runnable_batch(kind.probe, footprint),
        plain_max_batch=_runnable_batch(plain.probe, footprint),
    )


@dataclass(frozen=True)
class MixCrossover:
    """What the live fleet governor decides with (policies/control/fleet_mix.py): the
    crossover batch per replica (``PerTokenTables.pays_up_to``), and the requests in flight
    one plain / one speculative replica carries with its predicted time per token within
    the TPOT (each table runs to its kind's runnable batch: running cap and KV pool).

    The same as arrival rates per replica (the governor's ``--load arrival-rate``), by
    Little's law from the same tables: a replica running ``b`` requests at ``t(b)``
    seconds per output token, each of the trace's mean output length ``L``, finishes
    ``b / (L t(b))`` requests a second. ``pays_up_to_rps``: a speculative replica's rate
    at the crossover batch; ``plain_rps`` / ``spec_rps``: the most a replica of that kind
    sustains with its time per token within the TPOT (at any batch up to its capacity).
    Estimates: prefill time and the queueing of a random arrival stream are not counted,
    so a sustainable rate is an upper bound."""

    pays_up_to: int
    plain_capacity: int
    spec_capacity: int
    pays_up_to_rps: float = 0.0
    plain_rps: float = 0.0
    spec_rps: float = 0.0


def mix_crossover(
    trace: Trace,
    server: ServerSpec,
    policy: str = "sglang-ema",
    *,
    tpot_ms: float = 50.0,
    seed: int = 0,
) -> MixCrossover | None:
    """The crossover and both kinds' capacity (:class:`MixCrossover`), from the same tables
    this plan's spec-aware router scores with. None when the drafter has no per-token model
    (acceptance from a trace) or a kind does not fit."""
    built = resolve(server)
    slo = Slo(tpot_ms=tpot_ms)
    spec = _probe_kind(server, built, policy, seed=seed, slo=slo)
    plain = _probe_kind(server, built, PLAIN, seed=seed, slo=slo)
    table = _tables(spec, plain, trace)
    if table is None:
        return None
    limit_s = tpot_ms / 1000.0

    def capacity(per_token: tuple[float, ...]) -> int:
        return max((b for b, t in enumerate(per_token, 1) if t <= limit_s), default=1)

    output = sum(r.output_tokens for r in trace.requests) / len(trace.requests)

    def rate(per_token: tuple[float, ...], batch: int) -> float:
        return batch / (output * per_token[batch - 1])

    def sustained(per_token: tuple[float, ...]) -> float:
        return max(rate(per_token, b) for b in range(1, capacity(per_token) + 1))

    pays = table.pays_up_to
    return MixCrossover(
        pays,
        capacity(table.plain),
        capacity(table.speculative),
        pays_up_to_rps=rate(table.speculative, pays) if pays > 0 else 0.0,
        plain_rps=sustained(table.plain),
        spec_rps=sustained(table.speculative),
    )


def _cost(
    gpus: int, gpu: str, prices: Prices | None, throughput: float, goodput: float
) -> dict[str, float | None]:
    if prices is None or gpu not in prices.gpu_hour:
        return {"cost_per_hour": None, "cost_per_mtok": None, "cost_per_good_mtok": None}
    per_hour = gpus * prices.per_gpu_hour(gpu)
    return {
        "cost_per_hour": per_hour,
        "cost_per_mtok": per_hour / (throughput * 3600.0) * 1e6 if throughput > 0 else None,
        "cost_per_good_mtok": per_hour / (goodput * 3600.0) * 1e6 if goodput > 0 else None,
    }


def _simulate(
    trace: Trace,
    fleet: FleetShape,
    spec: _Kind | None,
    plain: _Kind,
    router: RouterSpec,
    tables: PerTokenTables | None,
    *,
    server: ServerSpec,
    built: BuiltServer,
    cfg: FleetPlanConfig,
    progress: Callable[[int, int], None] | None,
) -> dict[str, Any]:
    replicas: list[ReplicaStepper] = []
    kinds: list[tuple[str, MemoryPlan]] = []
    for i in range(fleet.replicas):
        kind = spec if i < fleet.speculative and spec is not None else plain
        prepared = prepare_run(server, kind.policy, seed=cfg.seed, slo=cfg.slo, built=built)
        loop = prepared.loop
        replicas.append(
            ReplicaStepper(
                prepared.engine,
                speculative=kind.policy.speculative,
                on_tick=loop.on_tick if loop is not None else None,
                tick_interval_s=loop.config.scrape_interval_s if loop is not None else 1.0,
                metrics=prepared.metrics,
            )
        )
        kinds.append(("speculative" if kind.policy.speculative else "plain", prepared.memory))
    started = time.perf_counter()
    built_router = router.build((tables.speculative, tables.plain) if tables is not None else None)
    run = simulate_fleet(trace.requests, replicas, built_router, progress=progress)
    wall = time.perf_counter() - started
    row = judge(
        run.results,
        n_requests=len(trace.requests),
        end_s=run.end_s,
        slo=cfg.slo,
        pct=cfg.slo_percentile,
    )
    row["per_replica"] = [
        replica_row(i, kind, result, memory)
        for i, ((kind, memory), result) in enumerate(zip(kinds, run.results, strict=True))
    ]
    row["wall_s"] = wall
    return row


def plan_fleet(
    trace: Trace,
    server: ServerSpec,
    cfg: FleetPlanConfig,
    *,
    target_rps: float | None = None,
    progress: Callable[[str, int, int], None] | None = None,
) -> dict[str, Any]:
    """Simulate every (fleet, policy, router) of *cfg* on *trace*; the JSON document.

    With *target_rps* the trace is first scaled to that mean request rate. A fleet
    whose replicas cannot be built (VRAM, an unsupported policy) is a row with
    ``fits: false`` and the reason, never an exception.
    """
    scale = None
    if target_rps is not None:
        trace, scale = scale_to_rps(trace, target_rps)
    built = resolve(server)
    plain = _kind(server, built, PLAIN, cfg)
    spec_kinds = _spec_kinds(server, built, cfg)
    tables = {name: _tables(kind, plain, trace) for name, kind in spec_kinds.items()}
    runs = _FleetRuns(trace, server, built, cfg, plain, spec_kinds, tables, progress, {})
    rows: list[dict[str, Any]] = []
    for fleet in cfg.fleets:
        policy_names: list[str | None] = list(spec_kinds) if fleet.speculative else [None]
        for pname in policy_names:
            for router in cfg.routers:
                rows.append(runs.row(fleet, pname, router))
    doc = _plan_document(runs, rows, scale=scale, target_rps=target_rps)
    gpu = built.gpu.name
    doc.update(
        choose(
            rows,
            priced=cfg.prices is not None and gpu in cfg.prices.gpu_hour,
            currency=cfg.prices.currency if cfg.prices is not None else None,
            slo=doc["slo"],
        )
    )
    doc["recommendation"] = recommendation_text(doc)
    return doc


def _spec_kinds(server: ServerSpec, built: BuiltServer, cfg: FleetPlanConfig) -> dict[str, _Kind]:
    """The speculative replica kinds of *cfg*, by policy name (each speculative, once)."""
    spec_kinds: dict[str, _Kind] = {}
    for name in cfg.policies:
        kind = _kind(server, built, name, cfg)
        if not kind.policy.speculative:
            raise FleetSpecError(
                f"policy {name!r} is not speculative: plain replicas are the m of a fleet n+m; "
                "give the speculative replicas' policies (static:K, sglang-ema, goodput, ...)"
            )
        if kind.policy.name in spec_kinds:
            raise FleetSpecError(f"policy given twice: {kind.policy.name}")
        spec_kinds[kind.policy.name] = kind
    return spec_kinds


@dataclass
class _FleetRuns:
    """One plan's trace, deployment and replica kinds; each (fleet, policy, routing)
    simulated once (``cache``)."""

    trace: Trace
    server: ServerSpec
    built: BuiltServer
    cfg: FleetPlanConfig
    plain: _Kind
    spec_kinds: dict[str, _Kind]
    tables: dict[str, PerTokenTables | None]
    progress: Callable[[str, int, int], None] | None
    cache: dict[tuple[str, str | None, str], dict[str, Any]]

    def row(self, fleet: FleetShape, pname: str | None, router: RouterSpec) -> dict[str, Any]:
        """The plan's row for *fleet* with policy *pname* behind *router*."""
        plain, progress = self.plain, self.progress
        gpu = self.built.gpu.name
        spec = self.spec_kinds[pname] if pname is not None else None
        table = self.tables.get(pname) if pname is not None else None
        effective = _effective_router(router, fleet)
        routes_as = effective.name
        row: dict[str, Any] = {
            "fleet": fleet.name,
            "kind": fleet.kind,
            "speculative_replicas": fleet.speculative,
            "plain_replicas": fleet.plain,
            "replicas": fleet.replicas,
            "gpus": fleet.replicas * 1,  # tp_size 1 per replica
            "gpu": gpu,
            "policy": pname,
            "router": router.name,
            "routes_as": routes_as,
        }
        kinds = ([spec] if spec is not None else []) + ([plain] if fleet.plain else [])
        failed = next((k for k in kinds if k.error is not None), None)
        if failed is not None:
            row.update(fits=False, reason=f"{failed.policy.name}: {failed.error}")
            row.update(meets_slo=False)
            return row
        if (
            router.kind == "spec-aware"
            and router.max_batch is None
            and fleet.kind == "mixed"
            and table is None
        ):
            row.update(
                fits=True,
                meets_slo=False,
                reason="spec-aware: no per-token model for this drafter (its "
                "acceptance comes from a trace); give spec-aware:B",
            )
            return row
        key = (fleet.name, pname, routes_as)
        if key not in self.cache:
            cb = None
            if progress is not None:
                label = f"{fleet.name} {pname or 'plain'} {router.name}"

                def cb(done: int, total: int, _label: str = label) -> None:
                    progress(_label, done, total)

            self.cache[key] = _simulate(
                self.trace,
                fleet,
                spec,
                plain,
                effective,
                table,
                server=self.server,
                built=self.built,
                cfg=self.cfg,
                progress=cb,
            )
        measured = dict(self.cache[key])
        row.update(fits=True, reason=None)
        row.update(measured)
        row.update(
            _cost(
                row["gpus"],
                gpu,
                self.cfg.prices,
                float(measured["throughput_tok_s"]),
                float(measured["goodput_tok_s"]),
            )
        )
        return row


def _plan_document(
    runs: _FleetRuns, rows: list[dict[str, Any]], *, scale: float | None, target_rps: float | None
) -> dict[str, Any]:
    """The plan's JSON document around its *rows* (the choice not yet made)."""
    trace, server, built, cfg = runs.trace, runs.server, runs.built, runs.cfg
    tables = runs.tables
    return {
        "trace": {**trace.summary(), "load": trace_load(trace)},
        "rate_scale": scale,
        "target_rps": target_rps,
        "offered_rps": offered_rps(trace),
        "server": {
            "gpu": built.gpu.name,
            "model": built.model.name,
            "drafter": built.drafter.name,
            "algorithm": built.drafter.algorithm,
            "spec_steps": server.spec_steps,
            "acceptance_profile": server.acceptance_profile or built.drafter.acceptance_profile,
            "max_running_requests": server.max_running_requests,
            "mem_fraction_static": server.mem_fraction_static,
        },
        "slo": {
            "tpot_ms": cfg.slo.tpot_ms,
            "ttft_ms": cfg.slo.ttft_ms,
            "percentile": cfg.slo_percentile,
        },
        "seed": cfg.seed,
        "prices": (
            {
                "currency": cfg.prices.currency,
                "gpu_hour": dict(cfg.prices.gpu_hour),
                "source": cfg.prices.source,
            }
            if cfg.prices is not None
            else None
        ),
        "replica_kinds": {
            name: {
                "policy": kind.policy.name,
                "speculative": kind.policy.speculative,
                "fits": kind.error is None,
                "reason": kind.error,
                "kv_token_capacity": kind.memory.kv_token_capacity if kind.memory else None,
                "speculation_pays_up_to_batch": _pays(tables.get(name)),
                "predicted_ms_per_token": _table_doc(tables.get(name)),
                "vram": _vram(kind, server),
                "launch_args": kind.launch,
            }
            for name, kind in [(PLAIN, runs.plain), *runs.spec_kinds.items()]
        },
        "fleets": rows,
    }


def _vram(kind: _Kind, server: ServerSpec) -> dict[str, Any] | None:
    """The replica kind's VRAM breakdown in ``plan vram``'s document shape."""
    if kind.memory is None:
        return None
    if kind.policy.speculative:
        steps = server.spec_steps
        shape = {"steps": steps, "topk": server.topk, "num_draft_tokens": steps + 1}
    else:
        shape = {"steps": 0, "topk": 0, "num_draft_tokens": 0}
    doc = vram_document(kind.memory, shape=shape, max_running_requests=server.max_running_requests)
    doc["policy"] = kind.policy.name
    return doc


def _pays(table: PerTokenTables | None) -> int | None:
    return table.pays_up_to if table is not None else None


def _table_doc(table: PerTokenTables | None) -> dict[str, list[float]] | None:
    if table is None:
        return None
    # The first TABLE_DOC_LEN batch sizes: enough to see the crossing, not 4096 rows.
    return {
        "speculative": [1e3 * t for t in table.speculative[:TABLE_DOC_LEN]],
        "plain": [1e3 * t for t in table.plain[:TABLE_DOC_LEN]],
    }


def _effective_router(router: RouterSpec, fleet: FleetShape) -> RouterSpec:
    """The router as it acts on *fleet*: equivalent routers are simulated once.

    One replica: every router sends it everything. A homogeneous fleet: spec-aware
    (either form) has no plain replica to prefer, so it routes as least-loaded.
    """
    if fleet.replicas == 1:
        return RouterSpec("least-loaded")
    if router.kind == "spec-aware" and fleet.kind != "mixed":
        return RouterSpec("least-loaded")
    return router
