"""The restart loop: what SGLang cannot change live, decided offline.

Tree width (topk), draft tokens, the candidate step set and speculation on/off for
algorithms without adaptive support need a server restart. Periodically the
daemon summarises the recent window of live telemetry (request rate, mean prompt
and output lengths, acceptance), synthesises a trace from it, replays that trace
in the simulator over candidate shapes that fit the VRAM budget, and records the
best launch configuration with its predicted goodput gain over the current one.

The baseline is what the server runs now, replayed on the same synthetic trace: the
step table in force when a daemon policy drives it (``WorkloadSummary.table``, replayed
as ``batch-table``), else the candidate closest to the current shape. A saturated window
(requests queued in most of it) is replayed as that many closed-loop users
(``WorkloadSummary.concurrency``): at saturation the arrival rate is what the server
served, and an open-loop trace at exactly that rate sits on the edge of an unbounded
queue, where any small difference between configurations would read as a huge gain.

The gain is on goodput or, where goodput is equal (within ``EQUAL_GOODPUT``), on TPOT p50.
``restart_recommendation`` turns a replay into the decision: it fires only for a
sustained window (``SUSTAINED_S``) and a predicted gain of at least ``RESTART_MIN_GAIN``
over the configuration in force.

Honest limits: acceptance is summarised as one per-position rate fitted to the
observed accept length at the server's current steps (E[L(k)] = (1-α^(k+1))/(1-α)),
so deeper positions are neither better nor worse than the measured average; and
lengths are log-normal around the observed means. The prediction is only as good
as that summary; the recommendation says so and is never applied unless an
operator configured an apply command.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from specgov.adapters.launch_config import (
    ADAPTIVE_ALGORITHMS,
    DEFAULT_ADAPTIVE_CONFIG_PATH,
    DIGITS,
    SGLANG_VERSION,
    SKIP_ZERO_STEP_ENV,
    LaunchConfig,
    LaunchConfigError,
    SlotCandidates,
    build_launch_config,
    default_slots,
    format_slots,
    make_shape,
    normalise_algorithm,
    recommend_skip_zero_step,
)
from specgov.policies.common.types import ALGORITHMS, RestartRecommendation, SpecShape
from specgov.policies.common.validation import is_int, is_real
from specgov.policies.daemon.estimators.step_cost import StepCostPrior

# Candidate shapes replayed for a recommendation: (label, policy, topk, draft tokens).
CANDIDATES: tuple[tuple[str, str, int, int | None], ...] = (
    ("no speculation", "none", 1, None),
    ("chain, 1 step", "static:1", 1, None),
    ("chain, 2 steps", "static:2", 1, None),
    ("chain, 3 steps", "static:3", 1, None),
    ("chain, 5 steps", "static:5", 1, None),
    ("tree 5x4, 8 draft tokens", "static:5", 4, 8),
    ("adaptive (SGLang EMA, default slots)", "sglang-ema", 1, None),
)


# A restart is recommended only for a window at least this long (a regime, not a burst)
# and a predicted gain of at least this fraction over the configuration in force.
SUSTAINED_S = 120.0
RESTART_MIN_GAIN = 0.10
# Goodputs within this fraction of each other are "equal": the gain is then on TPOT p50.
EQUAL_GOODPUT = 0.01
# A window is saturated when requests were queued in at least this share of its samples.
SATURATED_SHARE = 0.5


class RecommendError(ValueError):
    """Not enough telemetry, or the deployment is unknown to the catalog."""


@dataclass(frozen=True)
class WorkloadSummary:
    """The recent window the recommendation is computed from."""

    window_s: float
    request_rate_rps: float
    mean_input_tokens: float
    mean_output_tokens: float
    accept_length: float | None  # tokens per verify at current_steps
    current_steps: int | None
    # Saturated window: the mean requests in the server (running + queued), replayed as
    # that many closed-loop users; None: open loop at request_rate_rps.
    concurrency: float | None = None
    # The step table in force ((slot bound, steps), ...) when a daemon policy drives the
    # server: the baseline the candidates are compared with.
    table: tuple[tuple[int, int], ...] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "window_s": self.window_s,
            "request_rate_rps": self.request_rate_rps,
            "mean_input_tokens": self.mean_input_tokens,
            "mean_output_tokens": self.mean_output_tokens,
            "accept_length": self.accept_length,
            "current_steps": self.current_steps,
            "concurrency": self.concurrency,
            "table": None if self.table is None else [list(e) for e in self.table],
        }


def saturated_concurrency(samples: Sequence[tuple[int | None, int | None]]) -> float | None:
    """From (running, queued) samples of a window: the mean requests in the server when
    requests were queued in at least SATURATED_SHARE of the samples, else None."""
    known = [(r, q) for r, q in samples if r is not None and q is not None]
    if not known or sum(1 for _, q in known if q > 0) < SATURATED_SHARE * len(known):
        return None
    return sum(r + q for r, q in known) / len(known)


def busy_steps(table: Sequence[tuple[int, int]], running: float) -> int:
    """The steps *table* runs at a batch of *running* requests (the slot whose bound is the
    largest at or below it; the first slot below every bound), what the window's measured
    accept length was mostly measured at."""
    steps = table[0][1]
    for bound, k in sorted(table):
        if bound <= running:
            steps = k
    return steps


def table_policy(table: Sequence[tuple[int, int]]) -> str:
    """The replay policy that runs a fixed step table (what a daemon has in force)."""
    return "batch-table:" + ",".join(f"{bound}={steps}" for bound, steps in table)


@dataclass(frozen=True)
class Recommendation:
    label: str
    policy: str
    shape: SpecShape
    predicted_goodput_tok_s: float
    current_label: str
    current_goodput_tok_s: float
    predicted_gain: float
    candidates: tuple[dict[str, Any], ...]
    workload: WorkloadSummary
    notes: tuple[str, ...] = field(default=())
    metric: str = "goodput_tok_s"  # what predicted_gain is measured on

    def structured(self) -> RestartRecommendation:
        """The replay's conclusion in the one structured form every recommendation has."""
        evidence = [
            ("predicted_goodput_tok_s", self.predicted_goodput_tok_s),
            ("current_goodput_tok_s", self.current_goodput_tok_s),
            ("window_s", self.workload.window_s),
            ("request_rate_rps", self.workload.request_rate_rps),
        ]
        gain = self.predicted_gain if math.isfinite(self.predicted_gain) else None
        return RestartRecommendation(
            shape=self.shape,
            source="replay",
            summary=f"{self.label} (replay of the recent workload; now: {self.current_label})",
            predicted_gain=gain,
            evidence=tuple((k, float(v)) for k, v in evidence if math.isfinite(v)),
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "recommendation": self.label,
            "policy": self.policy,
            "shape": self.shape.to_dict(),
            "predicted_goodput_tok_s": self.predicted_goodput_tok_s,
            "current": self.current_label,
            "current_goodput_tok_s": self.current_goodput_tok_s,
            "predicted_gain": self.predicted_gain,
            "metric": self.metric,
            # Launch flags are not here: recommendation_document derives them once, from
            # the structured recommendation's shape (its "launch" key).
            "candidates": list(self.candidates),
            "workload": self.workload.to_dict(),
            "notes": list(self.notes),
        }


def fit_acceptance_rate(accept_length: float, steps: int) -> float:
    """α such that (1-α^(k+1))/(1-α) equals the observed tokens per verify at k steps."""
    if steps <= 0:
        raise RecommendError("acceptance cannot be measured while the server runs 0 steps")
    target = min(max(accept_length, 1.0), steps + 1.0)
    lo, hi = 0.0, 0.999
    for _ in range(60):
        mid = (lo + hi) / 2
        value = (1 - mid ** (steps + 1)) / (1 - mid)
        if value < target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def recommend(
    workload: WorkloadSummary,
    *,
    gpu: str,
    model: str,
    drafter: str,
    current: SpecShape | None,
    slo_tpot_ms: float | None,
    horizon_s: float = 180.0,
    seed: int = 0,
    candidates: Sequence[tuple[str, str, int, int | None]] = CANDIDATES,
) -> Recommendation:
    """Replay a trace synthesised from *workload* over candidate shapes; pick the best
    (module docstring: the baseline, closed-loop replay of a saturated window, metric)."""
    from specgov.simulator.engine.memory import DoesNotFitError
    from specgov.simulator.replay.metrics import Slo
    from specgov.simulator.replay.runner import ServerSpec, parse_policy, replay
    from specgov.simulator.workload.synthetic import Phase, SyntheticSpec, generate_trace

    if workload.request_rate_rps <= 0 or workload.mean_output_tokens <= 0:
        raise RecommendError("no finished requests in the window: nothing to recommend from")
    notes: list[str] = []
    if workload.accept_length is not None and workload.current_steps:
        alpha = fit_acceptance_rate(workload.accept_length, workload.current_steps)
        rates: tuple[float, ...] | None = (alpha,) * 7
        notes.append(
            f"acceptance: α={alpha:.3f} per position, fitted to accept length "
            f"{workload.accept_length:.2f} at {workload.current_steps} steps"
        )
    else:
        rates = None
        notes.append("acceptance not observed: the drafter's catalog profile is assumed")
    spec = SyntheticSpec(
        duration_s=horizon_s,
        rate_rps=workload.request_rate_rps,
        arrival="poisson",
        mean_input_tokens=max(workload.mean_input_tokens, 1.0),
        mean_output_tokens=max(workload.mean_output_tokens, 1.0),
        phases=(Phase(horizon_s, {"chat": 1.0}),),
        seed=seed,
    )
    trace = generate_trace(spec)
    users = None
    if workload.concurrency is not None and workload.concurrency >= 1:
        users = max(1, round(workload.concurrency))
        notes.append(
            f"saturated window: replayed as {users} closed-loop users "
            f"({len(trace.requests)} requests)"
        )
    slo = Slo(tpot_ms=slo_tpot_ms or 50.0)
    rows: list[dict[str, Any]] = []
    best: tuple[float, tuple[str, str, int, int | None]] | None = None
    current_table = None
    if workload.table:
        current_table = ("the step table in force", table_policy(workload.table), 1, None)
        candidates = (*candidates, current_table)
    for cand in candidates:
        label, policy, topk, ndt = cand
        server = ServerSpec(
            gpu=gpu,
            model=model,
            drafter=drafter,
            topk=topk,
            num_draft_tokens=ndt,
            acceptance_rates=rates,
            spec_steps=3,
        )
        try:
            # replay() plans the VRAM first: a shape that does not fit raises.
            report = replay(
                trace, server, [parse_policy(policy)], slo=slo, seed=seed, concurrency=users
            )
        except DoesNotFitError as exc:
            rows.append({"candidate": label, "fits": False, "reason": str(exc)})
            continue
        except ValueError as exc:
            rows.append({"candidate": label, "fits": False, "reason": str(exc)})
            continue
        summary = report.runs[0].summary
        goodput = float(summary["goodput_tok_s"])
        rows.append(
            {
                "candidate": label,
                "policy": policy,
                "topk": topk,
                "num_draft_tokens": ndt,
                "fits": True,
                "goodput_tok_s": goodput,
                "tpot_p50_ms": summary["tpot_ms"]["p50"],
                "slo_attainment": summary["slo_attainment"],
            }
        )
        if best is None or goodput > best[0]:
            best = (goodput, cand)
        if policy == "sglang-ema":
            # SGLang's high slots idle at 0 under load: would skipping their draft-extend
            # pass (SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND) pay? Replayed, not assumed.
            why = recommend_skip_zero_step(report.runs[0].result.steps_hist, default_slots())
            if why is not None:
                skip = replace(server, skip_zero_step_draft_extend=True)
                skip_report = replay(
                    trace, skip, [parse_policy(policy)], slo=slo, seed=seed, concurrency=users
                )
                skip_goodput = float(skip_report.runs[0].summary["goodput_tok_s"])
                rows.append(
                    {
                        "candidate": f"{label} + {SKIP_ZERO_STEP_ENV}=1",
                        "policy": policy,
                        "topk": topk,
                        "num_draft_tokens": ndt,
                        "fits": True,
                        "goodput_tok_s": skip_goodput,
                        "environment": {SKIP_ZERO_STEP_ENV: "1"},
                    }
                )
                notes.append(
                    f"{why}; replayed with it: goodput {skip_goodput:.1f} vs "
                    f"{goodput:.1f} tok/s without"
                )
    if best is None:
        raise RecommendError("no candidate shape fits this deployment")
    if current_table is not None:
        current_row = next((r for r in rows if r["candidate"] == current_table[0]), None)
    else:
        current_row = _current_row(current, rows)
    # The table in force is the baseline, never a restart target (it needs no restart).
    restartable = [
        r for r in rows if r.get("fits") and r.get("candidate") != "the step table in force"
    ]
    choice, metric, gain = choose_candidate(restartable, current_row)
    label, policy = str(choice["candidate"]), str(choice["policy"])
    topk, ndt = int(choice["topk"]), choice["num_draft_tokens"]
    shape = _shape_of(policy, topk, ndt, drafter_algorithm=_algorithm(drafter))
    return Recommendation(
        label=label,
        policy=policy,
        shape=shape,
        predicted_goodput_tok_s=float(choice["goodput_tok_s"]),
        current_label=(
            "unknown (not among the candidates)"
            if current_row is None
            else current_row["candidate"]
        ),
        current_goodput_tok_s=0.0 if current_row is None else float(current_row["goodput_tok_s"]),
        predicted_gain=gain,
        candidates=tuple(rows),
        workload=workload,
        notes=tuple(notes),
        metric=metric,
    )


def choose_candidate(
    rows: Sequence[dict[str, Any]], current: Mapping[str, Any] | None
) -> tuple[dict[str, Any], str, float]:
    """(best candidate, metric, predicted gain over *current*): the most goodput or, where
    that is within EQUAL_GOODPUT of the current goodput, the lowest TPOT p50 among the
    candidates that keep the goodput."""
    best = max(rows, key=lambda r: float(r["goodput_tok_s"]))
    if current is None or float(current["goodput_tok_s"]) <= 0:
        return dict(best), "goodput_tok_s", math.inf
    base = float(current["goodput_tok_s"])
    gain = float(best["goodput_tok_s"]) / base - 1.0
    if gain > EQUAL_GOODPUT:
        return dict(best), "goodput_tok_s", gain
    keep = [r for r in rows if float(r["goodput_tok_s"]) >= (1.0 - EQUAL_GOODPUT) * base]
    tpot = current.get("tpot_p50_ms")
    timed = [r for r in keep if r.get("tpot_p50_ms") is not None]
    if not is_real(tpot) or tpot <= 0 or not timed:
        return dict(best), "goodput_tok_s", gain
    fastest = min(timed, key=lambda r: float(r["tpot_p50_ms"]))
    return dict(fastest), "tpot_p50_ms", float(tpot) / float(fastest["tpot_p50_ms"]) - 1.0


def _algorithm(drafter: str) -> str:
    from specgov.simulator.catalog import Catalog

    return Catalog.load().drafter(drafter).algorithm.upper()


def _shape_of(policy: str, topk: int, ndt: int | None, *, drafter_algorithm: str) -> SpecShape:
    if policy == "none":
        return SpecShape("NONE", 0, 0, 0, ())
    if policy == "sglang-ema":
        return SpecShape(drafter_algorithm, 3, 1, 4, (0, 1, 3, 5, 7))
    steps = int(policy.split(":")[1])
    draft_tokens = ndt if topk > 1 and ndt is not None else steps + 1
    return SpecShape(drafter_algorithm, steps, topk, draft_tokens, (steps,))


def _current_row(
    current: SpecShape | None, rows: Sequence[dict[str, Any]]
) -> dict[str, Any] | None:
    """The candidate closest to what the server runs now (its goodput is the baseline)."""
    fitting = [r for r in rows if r.get("fits")]
    if current is None or current.algorithm == "NONE":
        wanted = "none"
    elif len(current.candidate_steps) > 1:
        wanted = "sglang-ema"
    else:
        wanted = f"static:{current.num_steps}"
    for r in fitting:
        if r.get("policy") == wanted and (r.get("topk") or 1) == (current.topk if current else 1):
            return r
    for r in fitting:
        if r.get("policy") == wanted:
            return r
    return None


def launch_for(shape: SpecShape, *, rationale: str) -> dict[str, Any]:
    """SGLang launch flags and adaptive JSON for ``shape`` (the one place a recommendation
    becomes flags): ``{"argv", "adaptive_config", "error"}``. No speculation needs no
    speculative flags (argv empty)."""
    if shape.algorithm == "NONE":
        return {"argv": [], "adaptive_config": None, "error": None}
    try:
        launch = build_launch_config(shape, rationale=rationale)
    except LaunchConfigError as exc:
        return {"argv": [], "adaptive_config": None, "error": str(exc)}
    return {
        "argv": list(launch.to_argv()),
        "adaptive_config": launch.adaptive_config_json(),
        "error": None,
    }


def recommendation_document(
    rec: RestartRecommendation, time_s: float, details: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """What status, the store, `specgov recommend` and the apply hook see of ``rec``."""
    launch = launch_for(rec.shape, rationale=f"specgov {rec.source}: {rec.summary}")
    return {
        "recommendation": rec.summary,
        **rec.to_dict(),
        "key": f"{rec.source}:{rec.shape.algorithm}:{rec.shape.num_steps}:{rec.shape.topk}:"
        f"{rec.shape.num_draft_tokens}:{list(rec.shape.candidate_steps)}",
        "launch": launch,
        "time_s": time_s,
        "details": None if details is None else dict(details),
    }


def deployment_prior(gpu: str, model: str, drafter: str) -> StepCostPrior:
    """The daemon's step-cost prior: the catalog's roofline for the deployment.

    The daemon reaches the simulator only through this module (an import-linter
    contract names it): the catalog and the roofline are the simulator's physics.
    Raises ValueError naming an unknown GPU, model or drafter.
    """
    from specgov.simulator.catalog import Catalog
    from specgov.simulator.engine.cost import CostModel
    from specgov.simulator.priors import step_cost_prior

    catalog = Catalog.load()
    cost = CostModel.from_catalog(catalog.gpu(gpu), catalog.model(model), catalog.drafter(drafter))
    return step_cost_prior(cost)


# ------------------------------------------------- from a `specgov replay` report
# (`specgov sglang-args --from-replay`): the offline one-off; the same module as the
# restart loop, so every restart recommendation is made in one place.


def _fail_report(where: str, expected: str, got: object) -> LaunchConfigError:
    return LaunchConfigError(f"replay report: {where}: {expected}, got {got!r}")


@dataclass(frozen=True, slots=True)
class _Run:
    name: str
    goodput_tok_s: float
    steps_per_slot: dict[int, dict[int, int]]


def _read_runs(report: Mapping[str, Any]) -> list[_Run]:
    if not isinstance(report, Mapping):
        raise _fail_report("top level", "expected a JSON object", type(report).__name__)
    policies = report.get("policies")
    if not isinstance(policies, list) or not policies:
        raise _fail_report(
            "key 'policies'", "expected a non-empty list (specgov replay --output json)", policies
        )
    runs = []
    for i, p in enumerate(policies):
        where = f"policies[{i}]"
        if not isinstance(p, Mapping):
            raise _fail_report(where, "expected an object", p)
        name = p.get("name")
        if not isinstance(name, str) or not name:
            raise _fail_report(f"{where}.name", "expected a policy name", name)
        goodput = p.get("goodput_tok_s")
        if not is_real(goodput) or goodput < 0:
            raise _fail_report(f"{where}.goodput_tok_s", "expected a number >= 0", goodput)
        raw_hist = p.get("steps_per_slot", {})
        if not isinstance(raw_hist, Mapping):
            raise _fail_report(f"{where}.steps_per_slot", "expected an object", raw_hist)
        hist: dict[int, dict[int, int]] = {}
        for slot_key, per_step in raw_hist.items():
            if not isinstance(slot_key, str) or not DIGITS.fullmatch(slot_key):
                raise _fail_report(f"{where}.steps_per_slot", "expected digit keys", slot_key)
            if not isinstance(per_step, Mapping):
                raise _fail_report(
                    f"{where}.steps_per_slot[{slot_key!r}]", "expected an object", per_step
                )
            counts: dict[int, int] = {}
            for step_key, n in per_step.items():
                if not isinstance(step_key, str) or not DIGITS.fullmatch(step_key):
                    raise _fail_report(
                        f"{where}.steps_per_slot[{slot_key!r}]", "expected digit keys", step_key
                    )
                if not is_int(n) or n < 0:
                    raise _fail_report(
                        f"{where}.steps_per_slot[{slot_key!r}][{step_key!r}]",
                        "expected a batch count >= 0",
                        n,
                    )
                counts[int(step_key)] = n
            hist[int(slot_key)] = counts
        runs.append(_Run(name, float(goodput), hist))
    return runs


def _static_steps(name: str) -> int | None:
    kind, sep, arg = name.partition(":")
    if kind.strip().lower() == "static" and sep and DIGITS.fullmatch(arg.strip()):
        return int(arg)
    return None


def _report_algorithm(server: Mapping[str, Any], algorithm: str | None) -> str:
    if algorithm is not None:
        return normalise_algorithm(algorithm, "--algorithm")
    declared = server.get("algorithm")
    if declared is not None:
        return normalise_algorithm(declared, "replay report: server.algorithm")
    drafter = server.get("drafter")
    guess = drafter.replace("-", "").upper() if isinstance(drafter, str) else None
    if guess in ALGORITHMS and guess != "NONE":
        return guess
    raise LaunchConfigError(
        f"replay report: server.drafter {drafter!r} does not name an SGLang "
        "--speculative-algorithm; pass the algorithm explicitly (--algorithm)"
    )


def recommend_from_replay(
    report: Mapping[str, Any],
    *,
    algorithm: str | None = None,
    draft_model_path: str | None = None,
    min_share: float = 0.05,
    adaptive_config_path: str = DEFAULT_ADAPTIVE_CONFIG_PATH,
) -> LaunchConfig:
    """Recommend a launch configuration from a ``specgov replay --output json`` report.

    * The best ``static:K`` run by goodput (ties: fewer steps) gives
      ``--speculative-num-steps``.
    * If the best adaptive run (any policy other than ``none``/``static:K`` with a
      steps histogram) matches or beats it, each of its slots gets as candidates the
      steps used in at least ``min_share`` of that slot's decode batches (the most
      used one always). The best static step joins the busiest slot if no slot has it
      (SGLang requires ``--speculative-num-steps`` among the candidates). If that
      leaves a single step everywhere, adaptive speculation would only add start-up
      cost, and the static shape is recommended instead.
    * If ``none`` beats every speculative run, or the winner never drafts (0 steps:
      SGLang would still run the draft-extend pass), no speculation is recommended.

    The algorithm comes from ``algorithm``, else the report's ``server.algorithm``,
    else its ``server.drafter`` when that names one (``eagle3`` -> EAGLE3). The
    explanation is in ``rationale``. Raises :class:`LaunchConfigError`.
    """
    if not is_real(min_share) or not 0.0 < min_share <= 1.0:
        raise LaunchConfigError(f"min_share: expected a fraction in (0, 1], got {min_share!r}")
    runs = _read_runs(report)
    server = report.get("server", {})
    if not isinstance(server, Mapping):
        raise _fail_report("key 'server'", "expected an object", server)
    trace = report.get("trace", {})
    trace_name = trace.get("name", "?") if isinstance(trace, Mapping) else "?"
    lines = [
        f"replay of {trace_name!r} (seed {report.get('seed', '?')}, "
        f"{server.get('gpu', '?')} {server.get('model', '?')} + {server.get('drafter', '?')}):"
    ]

    none_run = next((r for r in runs if r.name.strip().lower() == "none"), None)
    statics = sorted(
        ((k, r) for r in runs if (k := _static_steps(r.name)) is not None),
        key=lambda kr: (-kr[1].goodput_tok_s, kr[0]),
    )
    adaptive_runs = sorted(
        (
            r
            for r in runs
            if r is not none_run
            and _static_steps(r.name) is None
            and any(sum(c.values()) > 0 for c in r.steps_per_slot.values())
        ),
        key=lambda r: (-r.goodput_tok_s, r.name),
    )
    if not statics and not adaptive_runs:
        raise LaunchConfigError(
            "replay report: no static:K and no adaptive run to recommend from "
            f"(policies: {[r.name for r in runs]}); replay with e.g. --policy static:1 "
            "--policy static:3 --policy sglang-ema"
        )
    best_static = statics[0] if statics else None
    best_adaptive = adaptive_runs[0] if adaptive_runs else None
    if best_static is not None:
        others = ", ".join(f"{r.name} {r.goodput_tok_s:,.1f}" for _, r in statics[1:])
        lines.append(
            f"best static run {best_static[1].name} at {best_static[1].goodput_tok_s:,.1f} "
            "goodput tok/s" + (f" (others: {others})" if others else "")
        )
    if best_adaptive is not None:
        lines.append(
            f"best adaptive run {best_adaptive.name} at "
            f"{best_adaptive.goodput_tok_s:,.1f} goodput tok/s"
        )

    def no_speculation(why: str) -> LaunchConfig:
        lines.append(why + ": launch without speculation")
        return build_launch_config(
            SpecShape("NONE", 0, 0, 0, ()),
            rationale="\n".join(lines),
            adaptive_config_path=adaptive_config_path,
        )

    best_spec = max(
        [r.goodput_tok_s for _, r in statics[:1]] + [r.goodput_tok_s for r in adaptive_runs[:1]]
    )
    if none_run is not None and none_run.goodput_tok_s > best_spec:
        return no_speculation(
            f"no speculation ({none_run.goodput_tok_s:,.1f} tok/s) beats every speculative run"
        )
    algo = _report_algorithm(server, algorithm)
    topk = server.get("topk", 1)
    topk = 1 if topk is None else topk
    if not is_int(topk) or topk < 1:
        raise _fail_report("server.topk", "expected an int >= 1", topk)

    def shape_for(k: int) -> SpecShape:
        if topk == 1:
            return make_shape(algo, k, 1, k + 1, "replay report: server")
        draft = server.get("num_draft_tokens")
        if not is_int(draft):
            raise _fail_report("server.num_draft_tokens", f"expected an int for topk={topk}", draft)
        return make_shape(algo, k, topk, draft, "replay report: server")

    def static_config(k: int, source: str) -> LaunchConfig:
        if k == 0:
            return no_speculation(
                f"{source} never drafts (0 steps still pays SGLang's draft-extend pass)"
            )
        lines.append(f"static speculation: --speculative-num-steps {k}, from {source}")
        return build_launch_config(
            shape_for(k),
            rationale="\n".join(lines),
            draft_model_path=draft_model_path,
            adaptive_config_path=adaptive_config_path,
        )

    if best_adaptive is None or (
        best_static is not None and best_adaptive.goodput_tok_s < best_static[1].goodput_tok_s
    ):
        assert best_static is not None
        return static_config(best_static[0], best_static[1].name)
    if algo not in ADAPTIVE_ALGORITHMS or topk != 1:
        lines.append(f"adaptive speculation is not available for {algo} with topk {topk}")
        if best_static is None:
            raise LaunchConfigError(
                "replay report: only adaptive runs, but SGLang "
                f"{SGLANG_VERSION} cannot run adaptive speculation with {algo}, topk {topk}"
            )
        return static_config(best_static[0], best_static[1].name)

    hist = best_adaptive.steps_per_slot
    slots = _slots_from_histogram(hist, min_share)
    union = sorted({s for slot in slots for s in slot.candidate_steps})
    if best_static is not None and best_static[0] > 0:
        num_steps = best_static[0]
        steps_note = f"--speculative-num-steps {num_steps} = best static step"
        if num_steps not in union:
            busiest = max(hist, key=lambda b: (sum(hist[b].values()), -b))
            slots = [
                SlotCandidates.of(s.bound, (*s.candidate_steps, num_steps))
                if s.bound == busiest
                else s
                for s in slots
            ]
            steps_note += (
                f", added to the busiest slot {busiest} (SGLang requires it among the candidates)"
            )
            union = sorted({*union, num_steps})
    else:
        num_steps = _most_used_positive(hist, union)
        steps_note = f"--speculative-num-steps {num_steps} = most used positive step"
    share_note = f"steps used in >= {min_share:.0%} of a slot's decode batches"
    if len(union) == 1:
        lines.append(
            f"{best_adaptive.name} settles on step {union[0]} in every slot ({share_note}), "
            "so adaptive speculation would only add start-up cost"
        )
        return static_config(union[0], f"{best_adaptive.name}'s only step")
    if num_steps == 0:
        return no_speculation(f"{best_adaptive.name} never drafts")
    lines.append(
        f"adaptive speculation, per-slot candidates from {best_adaptive.name}'s {share_note}: "
        f"--slots '{format_slots(slots)}'; {steps_note}"
    )
    return build_launch_config(
        shape_for(num_steps),
        slots,
        rationale="\n".join(lines),
        draft_model_path=draft_model_path,
        adaptive_config_path=adaptive_config_path,
    )


def _slots_from_histogram(
    hist: Mapping[int, Mapping[int, int]], min_share: float
) -> list[SlotCandidates]:
    slots = []
    for bound in sorted(hist):
        counts = hist[bound]
        total = sum(counts.values())
        if total == 0:
            continue
        top = max(counts, key=lambda s: (counts[s], -s))
        chosen = {s for s, n in counts.items() if n / total >= min_share} | {top}
        slots.append(SlotCandidates.of(bound, chosen))
    return slots


def _most_used_positive(hist: Mapping[int, Mapping[int, int]], union: Sequence[int]) -> int:
    totals: dict[int, int] = {}
    for counts in hist.values():
        for step, n in counts.items():
            if step > 0 and step in union:
                totals[step] = totals.get(step, 0) + n
    if not totals:
        return 0
    return max(totals, key=lambda s: (totals[s], -s))


# ------------------------------------------------- the decision: fire or stay silent


def restart_recommendation(
    rec: Recommendation,
    *,
    drafter: str,
    min_gain: float = RESTART_MIN_GAIN,
    sustained_s: float = SUSTAINED_S,
) -> dict[str, Any] | None:
    """The ``restart_recommendation`` object of *rec*, or None when it does not fire: a
    window shorter than *sustained_s* (a burst), or a predicted gain under *min_gain*."""
    if rec.workload.window_s < sustained_s:
        return None
    if not math.isfinite(rec.predicted_gain) or rec.predicted_gain < min_gain:
        return None
    shape = rec.shape
    return {
        "configuration": {
            "label": rec.label,
            "policy": rec.policy,
            "drafter": "none" if shape.algorithm == "NONE" else drafter,
            **shape.to_dict(),
        },
        "metric": rec.metric,
        "predicted_gain": rec.predicted_gain,
        "current": rec.current_label,
        "window_s": rec.workload.window_s,
        "source": "replay",
        "notes": list(rec.notes),
    }


def replay_workload(run: Any, requests: Sequence[Any]) -> WorkloadSummary:
    """The window a daemon policy's replay run saw (its whole run), as the restart loop
    summarises it: rates and lengths from the counters, acceptance, saturation and the
    table in force from the daemon's own audit rows (what its observations said)."""
    result = run.result
    records = [] if run.loop is None else run.loop.records
    duration = max(result.end_s - result.first_arrival_s, 1e-9)
    completed = max(result.completed, 0)
    inputs = [r.input_tokens for r in requests[: max(completed, 1)]]
    last = records[-1].inputs_summary if records else {}
    in_force = next(
        (r.table_in_force for r in reversed(records) if r.table_in_force is not None), None
    )
    samples = [(r.inputs_summary.get("running"), r.inputs_summary.get("queued")) for r in records]
    running = [r for r, _ in samples if r is not None]
    steps = last.get("spec_num_steps")
    if in_force is not None and running:
        # The gauge is the last batch's steps (at the end of a run, a draining small batch):
        # the accept length was measured over the window, mostly at the busy slot's steps.
        steps = busy_steps(in_force.slots, sum(running) / len(running))
    return WorkloadSummary(
        window_s=duration,
        request_rate_rps=completed / duration,
        mean_input_tokens=sum(inputs) / len(inputs) if inputs else 0.0,
        mean_output_tokens=result.output_tokens / completed if completed else 0.0,
        accept_length=last.get("accept_length") if steps else None,
        current_steps=steps,
        concurrency=saturated_concurrency(samples),
        table=None if in_force is None else tuple(in_force.slots),
    )


def replay_restart_check(
    runs: Sequence[Any],
    requests: Sequence[Any],
    *,
    gpu: str,
    model: str,
    drafter: str,
    slo_tpot_ms: float | None,
    seed: int = 0,
    horizon_s: float = 180.0,
) -> dict[str, dict[str, Any] | None]:
    """Per daemon policy of one replay (``PolicyRun``s), its ``restart_recommendation``
    (None when it does not fire), also set as that key of the run's summary (the replay
    JSON). Where the replay also ran the recommended configuration on the same trace, the
    object carries the gain measured there (``measured_gain``)."""
    summaries = {r.policy.name: r.summary for r in runs}
    out: dict[str, dict[str, Any] | None] = {}
    for run in runs:
        if run.policy.daemon_spec is None:
            continue
        workload = replay_workload(run, requests)
        try:
            rec = recommend(
                workload,
                gpu=gpu,
                model=model,
                drafter=drafter,
                current=None,
                slo_tpot_ms=slo_tpot_ms,
                horizon_s=horizon_s,
                seed=seed,
            )
        except RecommendError as exc:
            out[run.policy.name] = None
            run.summary["restart_check"] = str(exc)  # why there is nothing to recommend
            continue
        doc = restart_recommendation(rec, drafter=drafter)
        if doc is not None:
            measured = summaries.get(rec.policy)
            if measured is not None:
                doc["measured_gain"] = measured_gain(measured, run.summary, rec.metric)
        out[run.policy.name] = doc
    for run in runs:
        if run.policy.name in out:
            run.summary["restart_recommendation"] = out[run.policy.name]
    return out


def measured_gain(
    recommended: Mapping[str, Any], current: Mapping[str, Any], metric: str
) -> float | None:
    """What replaying the recommended configuration gained over the current run, on
    *metric* (goodput: more is better; TPOT p50: less is better)."""
    if metric == "tpot_p50_ms":
        a, b = recommended["tpot_ms"]["p50"], current["tpot_ms"]["p50"]
        return None if not a or b is None else float(b) / float(a) - 1.0
    a, b = recommended.get("goodput_tok_s"), current.get("goodput_tok_s")
    return None if a is None or not b else float(a) / float(b) - 1.0
