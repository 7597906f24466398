"""The restart loop: what SGLang cannot change live, decided offline.

Tree width (topk), draft tokens, the candidate step set and speculation on/off for
algorithms without adaptive support need a server restart. Periodically the
daemon summarises the recent window of live telemetry (request rate, mean prompt
and output lengths, acceptance), synthesises a trace from it, replays that trace
in the simulator over candidate shapes that fit the VRAM budget, and records the
best launch configuration with its predicted goodput gain over the current one.

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
from dataclasses import dataclass, field
from typing import Any

from specgov.policies.estimators.step_cost import StepCostPrior
from specgov.policies.types import RestartRecommendation, SpecShape

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

    def to_dict(self) -> dict[str, Any]:
        return {
            "window_s": self.window_s,
            "request_rate_rps": self.request_rate_rps,
            "mean_input_tokens": self.mean_input_tokens,
            "mean_output_tokens": self.mean_output_tokens,
            "accept_length": self.accept_length,
            "current_steps": self.current_steps,
        }


@dataclass(frozen=True)
class Recommendation:
    label: str
    policy: str
    shape: SpecShape
    predicted_goodput_tok_s: float
    current_label: str
    current_goodput_tok_s: float
    predicted_gain: float
    argv: tuple[str, ...]
    adaptive_config: dict[str, Any] | None
    candidates: tuple[dict[str, Any], ...]
    workload: WorkloadSummary
    notes: tuple[str, ...] = field(default=())

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
            "argv": list(self.argv),
            "adaptive_config": self.adaptive_config,
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
    """Replay a trace synthesised from *workload* over candidate shapes; pick the best."""
    from specgov.simulator.memory import DoesNotFitError
    from specgov.simulator.metrics import Slo
    from specgov.simulator.replay import ServerSpec, parse_policy, replay
    from specgov.simulator.synthetic import Phase, SyntheticSpec, generate_trace

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
    slo = Slo(tpot_ms=slo_tpot_ms or 50.0)
    rows: list[dict[str, Any]] = []
    best: tuple[float, tuple[str, str, int, int | None]] | None = None
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
            report = replay(trace, server, [parse_policy(policy)], slo=slo, seed=seed)
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
    if best is None:
        raise RecommendError("no candidate shape fits this deployment")
    goodput, (label, policy, topk, ndt) = best
    current_label, current_goodput = _current_row(current, rows)
    gain = goodput / current_goodput - 1.0 if current_goodput > 0 else math.inf
    shape = _shape_of(policy, topk, ndt, drafter_algorithm=_algorithm(drafter))
    launch = launch_for(shape, rationale=f"specgov recommend: {label}")
    argv = tuple(launch["argv"])
    adaptive = launch["adaptive_config"]
    if launch["error"]:
        notes.append(f"launch flags not produced: {launch['error']}")
    return Recommendation(
        label=label,
        policy=policy,
        shape=shape,
        predicted_goodput_tok_s=goodput,
        current_label=current_label,
        current_goodput_tok_s=current_goodput,
        predicted_gain=gain,
        argv=argv,
        adaptive_config=adaptive,
        candidates=tuple(rows),
        workload=workload,
        notes=tuple(notes),
    )


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


def _current_row(current: SpecShape | None, rows: Sequence[dict[str, Any]]) -> tuple[str, float]:
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
            return str(r["candidate"]), float(r["goodput_tok_s"])
    for r in fitting:
        if r.get("policy") == wanted:
            return str(r["candidate"]), float(r["goodput_tok_s"])
    return "unknown (not among the candidates)", 0.0


def launch_for(shape: SpecShape, *, rationale: str) -> dict[str, Any]:
    """SGLang launch flags and adaptive JSON for ``shape`` (the one place a recommendation
    becomes flags): ``{"argv", "adaptive_config", "error"}``. No speculation needs no
    speculative flags (argv empty)."""
    from specgov.adapters.launch_config import LaunchConfigError, build_launch_config

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
        "argv": launch["argv"],
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
    from specgov.simulator.cost import CostModel
    from specgov.simulator.priors import step_cost_prior

    catalog = Catalog.load()
    cost = CostModel.from_catalog(catalog.gpu(gpu), catalog.model(model), catalog.drafter(drafter))
    return step_cost_prior(cost)
