"""The restart loop: what SGLang cannot change live, decided offline.

Tree width (topk), draft tokens, the candidate step set and speculation on/off for
algorithms without adaptive support need a server restart. Periodically the
daemon summarises the recent window of live telemetry (request rate, mean prompt
and output lengths, acceptance), synthesises a trace from it, replays that trace
in the simulator over candidate shapes that fit the VRAM budget, and records the
best launch configuration with its predicted goodput gain over the current one.

The baseline is what the server runs now, replayed on the same synthetic trace: the
step table in force when a daemon policy drives it, as its rules ran at the window's
acceptance (``WorkloadSummary.table``, ``window_table``, replayed as ``batch-table``),
else the candidate closest to the current shape. A saturated window (requests queued in
most of it, or a closed population: ``saturated_concurrency``) is replayed as that many
closed-loop users
(``WorkloadSummary.concurrency``): at saturation the arrival rate is what the server
served, and an open-loop trace at exactly that rate sits on the edge of an unbounded
queue, where any small difference between configurations would read as a huge gain.

The gain is on goodput or, where goodput is equal (within ``EQUAL_GOODPUT``), on TPOT p50;
for a saturated window on throughput instead of goodput: there most requests sit near
the TPOT SLO, so goodput is a threshold count (measured on users-256/h100/ngram: none's
replay gains +218 % goodput but +13 % throughput over the goodput daemon; a 1.8 % TPOT
change moved goodput 26 %), and no prediction of it can be within 25 %. The metric is
named in the recommendation (``metric``) and in the replay JSON (``restart_metric``).
``restart_recommendation`` turns a replay into the decision: it fires only for a
sustained window (``SUSTAINED_S``) and a predicted gain of at least ``RESTART_MIN_GAIN``
over the configuration in force.

Honest limits: acceptance is summarised as one per-position rate fitted to the
observed accept length at the server's current steps (E[L(k)] = (1-α^(k+1))/(1-α)),
so deeper positions are neither better nor worse than the measured average (at 0 busy
steps, the last accept length measured above 0: ``window_acceptance``); and
lengths are log-normal around the observed means. The prediction is only as good
as that summary; the recommendation says so and is never applied unless an
operator configured an apply command. Where the summary visibly fails (the baseline's
replayed TPOT p50 more than ``FIDELITY_FACTOR`` from the window's measured one,
``replay_fidelity``) the check predicts nothing: ``Recommendation.unreliable`` says why
and ``restart_recommendation`` stays silent.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from specgov.adapters.launch_config import (
    SKIP_ZERO_STEP_ENV,
    LaunchConfigError,
    build_launch_config,
    default_slots,
    recommend_skip_zero_step,
)
from specgov.controller.daemon.load_shape import replay_ramp
from specgov.policies.common.codec import to_data
from specgov.policies.common.decisions import RESTART_METRICS, RestartRecommendation
from specgov.policies.common.errors import SpecgovError
from specgov.policies.common.step_table import StepTable
from specgov.policies.common.types import SpecShape
from specgov.policies.common.validation import is_real
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


# The initial steps every candidate server is replayed with (a static policy overrides
# them; SGLang's EMA starts there, as its recommended shape says: 3 steps).
CANDIDATE_SPEC_STEPS = 3

# A restart is recommended only for a window at least this long (a regime, not a burst)
# and a predicted gain of at least this fraction over the configuration in force.
SUSTAINED_S = 120.0
RESTART_MIN_GAIN = 0.10
# Goodputs within this fraction of each other are "equal": the gain is then on TPOT p50.
EQUAL_GOODPUT = 0.01
# An open-loop window is replayed over its own length up to this long (its regimes
# scaled into it): the check's cost stays bounded.
WINDOW_HORIZON_CAP_S = 600.0
# A window is saturated when requests were queued in at least this share of its samples.
SATURATED_SHARE = 0.5
# ...or when it holds a closed population: requests in the server whose interquartile
# range squared is at most this share of their median (see closed_population).
CLOSED_DISPERSION = 0.25
# What a gain can be predicted on (besides TPOT p50, the tie-break): goodput, or for a
# saturated window throughput (module doc: goodput there is a threshold at the SLO edge).
RATE_METRICS = tuple(m for m in RESTART_METRICS if m != "tpot_p50_ms")
# A baseline whose replayed TPOT p50 is more than this factor above or below the window's
# measured TPOT p50 does not describe the window, and its gains are not predictions
# (assumed, not fitted; measured on the policy suite's 40 runs, benchmarks/policies/
# README.md: the replays that reproduce their window are within 0.64-1.21x of it, the
# three that do not 2.9-3.6x, among them phase/h100/ngram's +98 % predicted for +0.6 %).
FIDELITY_FACTOR = 2.0


class RecommendError(SpecgovError, ValueError):
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
    # server, its slot rules evaluated at the window's acceptance (``window_table``): the
    # baseline the candidates are compared with.
    table: tuple[tuple[int, int], ...] | None = None
    # The window's arrival regimes ((duration_s, arrivals/s), ..., at most
    # load_shape.MAX_SEGMENTS, ``arrival_segments``): an open-loop window is replayed
    # following them; empty: steady Poisson arrivals at request_rate_rps.
    segments: tuple[tuple[float, float], ...] = ()
    # The window's measured TPOT p50 (ms): the median of its scrapes' TPOT p50, what the
    # baseline's replay must reproduce (``replay_fidelity``); None: not measured.
    tpot_p50_ms: float | None = None


def saturated_concurrency(samples: Sequence[tuple[int | None, int | None]]) -> float | None:
    """From (running, queued) samples of a window, the users to replay it as (closed loop),
    or None (open loop at the served rate).

    Two regimes are saturated: an overload (requests queued in at least SATURATED_SHARE
    of the samples: the mean requests in the server), and a closed population, a client
    that keeps a fixed number of requests in flight (``closed_population``), which need
    not queue at all: measured on users-256/h100 (256 users, a 256-request batch cap),
    requests were queued in 7 % of the samples while 256 were in the server in all but
    the first and last. Replaying that open loop at the served rate fixes the throughput
    and reads the plain server's gain as a goodput threshold effect (+465 % predicted vs
    +218 % replayed on users-256/h100/ngram, measured)."""
    known = [(r, q) for r, q in samples if r is not None and q is not None]
    if not known:
        return None
    if sum(1 for _, q in known if q > 0) >= SATURATED_SHARE * len(known):
        return sum(r + q for r, q in known) / len(known)
    return closed_population([r + q for r, q in known])


def closed_population(in_server: Sequence[int]) -> float | None:
    """The median requests in the server when that number is held (a closed population),
    else None: an interquartile range whose square is at most CLOSED_DISPERSION times the
    median. Open-loop arrivals spread it (M/G/inf: Poisson, IQR^2 about 1.8 x the mean);
    quartiles keep the ramp-up and drain at a window's ends out of it."""
    if len(in_server) < 4:
        return None
    q1, median, q3 = statistics.quantiles(in_server, n=4, method="inclusive")
    if median < 1 or (q3 - q1) ** 2 > CLOSED_DISPERSION * median:
        return None
    return float(median)


def busy_steps(table: Sequence[tuple[int, int]], running: float) -> int:
    """The steps *table* runs at a batch of *running* requests (the slot whose bound is the
    largest at or below it; the first slot below every bound), what the window's measured
    accept length was mostly measured at."""
    steps = table[0][1]
    for bound, k in sorted(table):
        if bound <= running:
            steps = k
    return steps


def window_acceptance(
    samples: Sequence[tuple[float | None, int | None]], steps: int | None
) -> tuple[float | None, int | None]:
    """(accept length, the steps it was measured at) for the window's acceptance fit, from
    its (accept length, steps) samples in order and the *steps* the busy slot runs.

    The last known accept length, at *steps*; when the busy slot runs 0 steps (nothing is
    verified there) the last one measured at a step count above 0 (the small slots: the
    window's only evidence), else (None, steps): the catalog's profile. Without this, a
    saturated window with a poor drafter was replayed with the catalog's EAGLE-3
    acceptance (conv-16x/h100/ngram, measured: plain predicted +7.3 % throughput over the
    table in force, +14.8 % replayed). "Known": a window that ends in a drain (no verify
    in its last scrape) has no accept length there; reading only that last sample fell
    back to the catalog's profile too (code-1x/a100-80g/ngram, measured: a tree shape
    recommended at +15.4 % TPOT p50 for a drafter accepting 1.06-1.09 tokens per verify)."""
    if steps:
        known = [a for a, _ in samples if a is not None]
        return (known[-1] if known else None), steps
    for accept, measured_at in reversed(samples):
        if accept is not None and measured_at:
            return accept, measured_at
    return None, steps


def table_as_run(table: StepTable, signal: float | None) -> tuple[tuple[int, int], ...]:
    """The (bound, steps) the engine runs under *table* at the live acceptance *signal*
    (the first-draft acceptance rate a slot rule reads): each rule evaluated there; a slot
    without a rule, or no signal, runs its ``slots`` step (the rule at the daemon's prior)."""
    if signal is None:
        return table.slots
    rules = dict(table.rules)
    return tuple((b, rules[b].steps_at(signal) if b in rules else k) for b, k in table.slots)


def window_table(
    in_force: StepTable | None,
    running: Sequence[int],
    accepts: Sequence[tuple[float | None, int | None]],
    gauge_steps: int | None,
) -> tuple[tuple[tuple[int, int], ...] | None, float | None, int | None]:
    """(the table as the engine ran it, accept length, the steps it was measured at) for
    a window: the busy slot from the mean *running*, acceptance by ``window_acceptance``,
    the table's rules evaluated at the fitted first-draft rate (``table_as_run``).

    The rules matter: replaying the ``slots`` steps ran a poor drafter's slots at 1 step
    where the engine's rule ran 0 (users-64/h100/ngram, measured: the plain server
    predicted +21 % throughput over that, +15 % replayed against the run itself)."""
    steps = gauge_steps
    if in_force is not None and running:
        # The gauge is the last batch's steps (at the end of a run, a draining small batch):
        # the accept length was measured over the window, mostly at the busy slot's steps.
        steps = busy_steps(in_force.slots, sum(running) / len(running))
    accept, steps = window_acceptance(accepts, steps)
    if in_force is None:
        return None, accept, steps
    signal = fit_acceptance_rate(accept, steps) if accept is not None and steps else None
    return table_as_run(in_force, signal), accept, steps


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
    # Why the replay does not describe the window (``replay_fidelity``): the gain is then
    # no prediction and restart_recommendation stays silent. None: it does.
    unreliable: str | None = None
    # Environment variables the recommended configuration needs besides its shape (e.g.
    # SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND=1), as sorted (name, value) pairs.
    environment: tuple[tuple[str, str], ...] = ()

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
            metric=self.metric,
        )

    # The report's key names (recommendation, current) are not the field names.
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
            "unreliable": self.unreliable,
            "environment": dict(self.environment),
            # Launch flags are not here: recommendation_document derives them once, from
            # the structured recommendation's shape (its "launch" key).
            "candidates": list(self.candidates),
            "workload": to_data(self.workload),
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
    vram_gib: float | None = None,
    horizon_s: float = 180.0,
    seed: int = 0,
    candidates: Sequence[tuple[str, str, int, int | None]] = CANDIDATES,
) -> Recommendation:
    """Replay a trace synthesised from *workload* over candidate shapes; pick the best
    (module docstring: the baseline, closed-loop replay of a saturated window, metric).

    ``vram_gib`` (``budget.vram_gib``): the GPU memory SGLang may use; a shape that
    needs more is not a candidate (its row says why), and the others are replayed with
    the KV pool that budget leaves."""
    from specgov.simulator.replay.metrics import Slo
    from specgov.simulator.workload.synthetic import generate_trace

    notes: list[str] = []
    rates = _acceptance_rates(workload, notes)
    trace = generate_trace(window_spec(workload, horizon_s=horizon_s, seed=seed, notes=notes))
    users = None
    metric = "goodput_tok_s"
    if workload.concurrency is not None and workload.concurrency >= 1:
        users = max(1, round(workload.concurrency))
        metric = "throughput_tok_s"
        notes.append(
            f"saturated window: replayed as {users} closed-loop users "
            f"({len(trace.requests)} requests); the gain is predicted on throughput (at "
            "saturation goodput counts requests at the SLO edge, a threshold)"
        )
    slo = Slo(tpot_ms=slo_tpot_ms or 50.0)
    replayer = _CandidateReplay(trace, slo, seed, users, gpu, model, drafter, rates, vram_gib)
    rows: list[dict[str, Any]] = []
    current_table = None
    if workload.table:
        current_table = ("the step table in force", table_policy(workload.table), 1, None)
        candidates = (*candidates, current_table)
    for cand in candidates:
        rows.extend(replayer.rows(cand, notes))
    if not any(r["fits"] for r in rows):
        within = "" if vram_gib is None else f" within budget.vram_gib = {vram_gib:g} GiB"
        raise RecommendError(f"no candidate shape fits this deployment{within}")
    if current_table is not None:
        current_row = next((r for r in rows if r["candidate"] == current_table[0]), None)
    else:
        current_row = _current_row(current, rows)
    # The fidelity test needs the window's own baseline: the table in force or the shape
    # the server reported; without either the baseline is a guess (no speculation).
    own_baseline = current_table is not None or current is not None
    return _recommendation(rows, current_row, workload, notes, drafter, metric, own_baseline)


def window_spec(
    workload: WorkloadSummary,
    *,
    horizon_s: float = 180.0,
    seed: int = 0,
    notes: list[str] | None = None,
) -> Any:
    """The synthetic trace's spec (simulator.workload.synthetic ``SyntheticSpec``) the
    check replays for *workload*, what it chose said in *notes*.

    An open-loop window with arrival regimes (``WorkloadSummary.segments``) is replayed
    following them (``load_shape.replay_ramp``: Poisson arrivals at each regime's rate)
    over its own length, at least *horizon_s* and at most WINDOW_HORIZON_CAP_S (the
    regimes' durations scaled to it); a saturated window (closed-loop users) or a steady
    one as Poisson arrivals at the mean rate over *horizon_s*."""
    from specgov.simulator.workload.synthetic import Phase, SyntheticSpec

    if workload.request_rate_rps <= 0 or workload.mean_output_tokens <= 0:
        raise RecommendError("no finished requests in the window: nothing to recommend from")
    saturated = workload.concurrency is not None and workload.concurrency >= 1
    ramp = None
    if not saturated and len(workload.segments) >= 2:
        horizon_s = max(horizon_s, min(workload.window_s, WINDOW_HORIZON_CAP_S))
        ramp = replay_ramp(workload.segments, horizon_s)
    if ramp is not None and notes is not None:
        peak = max(r for _, r in workload.segments)
        notes.append(
            f"arrivals replayed as the window's {len(workload.segments)} regimes over "
            f"{horizon_s:.0f} s (mean {workload.request_rate_rps:.2f} req/s, peak {peak:.2f})"
        )
    return SyntheticSpec(
        duration_s=horizon_s,
        rate_rps=workload.request_rate_rps,
        arrival="poisson",
        ramp=ramp,
        mean_input_tokens=max(workload.mean_input_tokens, 1.0),
        mean_output_tokens=max(workload.mean_output_tokens, 1.0),
        phases=(Phase(horizon_s, {"chat": 1.0}),),
        seed=seed,
    )


def _acceptance_rates(workload: WorkloadSummary, notes: list[str]) -> tuple[float, ...] | None:
    """Per-position acceptance fitted to the window's accept length (None: the drafter's
    catalog profile), said in *notes*."""
    if workload.accept_length is not None and workload.current_steps:
        alpha = fit_acceptance_rate(workload.accept_length, workload.current_steps)
        notes.append(
            f"acceptance: α={alpha:.3f} per position, fitted to accept length "
            f"{workload.accept_length:.2f} at {workload.current_steps} steps"
        )
        return (alpha,) * 7
    notes.append("acceptance not observed: the drafter's catalog profile is assumed")
    return None


@dataclass(frozen=True)
class _CandidateReplay:
    """One synthetic trace, replayed for each candidate shape on the deployment."""

    trace: Any  # simulator.workload Trace (the simulator is imported lazily here)
    slo: Any  # simulator.replay.metrics Slo
    seed: int
    users: int | None
    gpu: str
    model: str
    drafter: str
    rates: tuple[float, ...] | None
    vram_gib: float | None = None

    def rows(
        self, cand: tuple[str, str, int, int | None], notes: list[str]
    ) -> list[dict[str, Any]]:
        """The candidate's rows: its replay (or why it does not fit) and, for SGLang's
        EMA, its replay with the step-0 draft-extend pass skipped where that may pay."""
        from specgov.simulator.engine.memory import DoesNotFitError
        from specgov.simulator.replay.runner import ServerSpec, parse_policy, replay

        label, policy, topk, ndt = cand
        base = ServerSpec(
            gpu=self.gpu,
            model=self.model,
            drafter=self.drafter,
            acceptance_rates=self.rates,
            vram_gib=self.vram_gib,
        )
        server = candidate_server(base, topk, ndt)
        run = {"slo": self.slo, "seed": self.seed, "concurrency": self.users}
        try:
            # replay() plans the VRAM first: a shape that does not fit raises.
            report = replay(self.trace, server, [parse_policy(policy)], **run)
        except DoesNotFitError as exc:
            return [{"candidate": label, "fits": False, "reason": str(exc)}]
        except ValueError as exc:
            return [{"candidate": label, "fits": False, "reason": str(exc)}]
        summary = report.runs[0].summary
        goodput = float(summary["goodput_tok_s"])
        shape = {"policy": policy, "topk": topk, "num_draft_tokens": ndt, "fits": True}
        rows: list[dict[str, Any]] = [
            {
                "candidate": label,
                **shape,
                "goodput_tok_s": goodput,
                "throughput_tok_s": float(summary["throughput_tok_s"]),
                "tpot_p50_ms": summary["tpot_ms"]["p50"],
                "slo_attainment": summary["slo_attainment"],
            }
        ]
        if policy != "sglang-ema":
            return rows
        # SGLang's high slots idle at 0 under load: would skipping their draft-extend
        # pass (SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND) pay? Replayed, not assumed.
        why = recommend_skip_zero_step(report.runs[0].result.steps_hist, default_slots())
        if why is not None:
            skip = candidate_server(base, topk, ndt, {SKIP_ZERO_STEP_ENV: "1"})
            skip_report = replay(self.trace, skip, [parse_policy(policy)], **run)
            skip_summary = skip_report.runs[0].summary
            skip_goodput = float(skip_summary["goodput_tok_s"])
            rows.append(
                {
                    "candidate": f"{label} + {SKIP_ZERO_STEP_ENV}=1",
                    **shape,
                    "goodput_tok_s": skip_goodput,
                    "throughput_tok_s": float(skip_summary["throughput_tok_s"]),
                    "environment": {SKIP_ZERO_STEP_ENV: "1"},
                }
            )
            notes.append(
                f"{why}; replayed with it: goodput {skip_goodput:.1f} vs "
                f"{goodput:.1f} tok/s without"
            )
        return rows


def candidate_server(
    base: Any,
    topk: int,
    num_draft_tokens: int | None,
    environment: Mapping[str, str] | None = None,
) -> Any:
    """*base* (a simulator ``ServerSpec``) as a candidate configuration is served: its tree
    width and draft tokens (draft tokens only for a tree), the candidates' initial steps
    (``CANDIDATE_SPEC_STEPS``) and what its *environment* switches on (the skip flag).
    The restart check replays its candidates so; the policy suite measures a
    recommendation so (benchmarks/policies/run.py)."""
    return replace(
        base,
        topk=topk,
        num_draft_tokens=num_draft_tokens if topk > 1 else None,
        spec_steps=CANDIDATE_SPEC_STEPS,
        skip_zero_step_draft_extend=skips_zero_step(environment),
    )


def skips_zero_step(environment: Mapping[str, str] | None) -> bool:
    """Whether *environment* turns on SGLang's step-0 draft-extend skip."""
    return (environment or {}).get(SKIP_ZERO_STEP_ENV) == "1"


def _recommendation(
    rows: list[dict[str, Any]],
    current_row: dict[str, Any] | None,
    workload: WorkloadSummary,
    notes: list[str],
    drafter: str,
    metric: str = "goodput_tok_s",
    own_baseline: bool = True,
) -> Recommendation:
    """The best restartable candidate of *rows* against the baseline *current_row*, on
    *metric* (``choose_candidate``); the baseline is checked against the window's
    measured TPOT (``replay_fidelity``) where it is the window's own (*own_baseline*)."""
    # The table in force is the baseline, never a restart target (it needs no restart).
    restartable = [
        r for r in rows if r.get("fits") and r.get("candidate") != "the step table in force"
    ]
    choice, metric, gain = choose_candidate(restartable, current_row, metric)
    unreliable = replay_fidelity(current_row, workload.tpot_p50_ms) if own_baseline else None
    if unreliable is not None:
        notes.append(unreliable)
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
        current_goodput_tok_s=(
            0.0 if current_row is None else float(current_row.get("goodput_tok_s") or 0.0)
        ),
        predicted_gain=gain,
        candidates=tuple(rows),
        workload=workload,
        notes=tuple(notes),
        metric=metric,
        unreliable=unreliable,
        environment=tuple(sorted((choice.get("environment") or {}).items())),
    )


def replay_fidelity(
    current: Mapping[str, Any] | None, measured_tpot_ms: float | None
) -> str | None:
    """Why the baseline's replay (*current*, its row) does not describe the window whose
    measured TPOT p50 is *measured_tpot_ms*, or None when it does (or cannot be checked:
    no baseline, nothing measured). The replayed TPOT p50 must lie within FIDELITY_FACTOR
    of the measured one: the synthetic window (one acceptance rate, log-normal lengths,
    Poisson arrivals) cannot stand for a workload it runs that differently."""
    replayed = None if current is None else current.get("tpot_p50_ms")
    if not is_real(replayed) or replayed <= 0:
        return None
    if not is_real(measured_tpot_ms) or measured_tpot_ms <= 0:
        return None
    ratio = float(replayed) / float(measured_tpot_ms)
    if 1.0 / FIDELITY_FACTOR <= ratio <= FIDELITY_FACTOR:
        return None
    return (
        f"the replay does not reproduce the window: the baseline's TPOT p50 is "
        f"{float(replayed):.1f} ms replayed against {float(measured_tpot_ms):.1f} ms measured "
        f"({ratio:.2f}x, outside 1/{FIDELITY_FACTOR:g}-{FIDELITY_FACTOR:g}x), "
        "so no gain is predicted"
    )


def choose_candidate(
    rows: Sequence[dict[str, Any]],
    current: Mapping[str, Any] | None,
    metric: str = "goodput_tok_s",
) -> tuple[dict[str, Any], str, float]:
    """(best candidate, metric, predicted gain over *current*): the most *metric* (goodput,
    or throughput for a saturated window) or, where that is within EQUAL_GOODPUT of the
    current value, the lowest TPOT p50 among the candidates that keep it."""
    if metric not in RATE_METRICS:
        raise RecommendError(f"metric must be one of {', '.join(RATE_METRICS)}, got {metric!r}")
    best = max(rows, key=lambda r: float(r[metric]))
    # A baseline without the metric (its replay did not fit, e.g. within budget.vram_gib)
    # is no baseline: the gain is unknown, and restart_recommendation stays silent on it.
    value = None if current is None else current.get(metric)
    if current is None or not is_real(value) or value <= 0:
        return dict(best), metric, math.inf
    base = float(value)
    gain = float(best[metric]) / base - 1.0
    if gain > EQUAL_GOODPUT:
        return dict(best), metric, gain
    keep = [r for r in rows if float(r[metric]) >= (1.0 - EQUAL_GOODPUT) * base]
    tpot = current.get("tpot_p50_ms")
    timed = [r for r in keep if r.get("tpot_p50_ms") is not None]
    if not is_real(tpot) or tpot <= 0 or not timed:
        return dict(best), metric, gain
    fastest = min(timed, key=lambda r: float(r["tpot_p50_ms"]))
    return dict(fastest), "tpot_p50_ms", float(tpot) / float(fastest["tpot_p50_ms"]) - 1.0


def _algorithm(drafter: str) -> str:
    from specgov.simulator.catalog import Catalog

    return Catalog.load().drafter(drafter).algorithm.upper()


def _shape_of(policy: str, topk: int, ndt: int | None, *, drafter_algorithm: str) -> SpecShape:
    if policy == "none":
        return SpecShape("NONE", 0, 0, 0, ())
    if policy == "sglang-ema":
        return SpecShape(
            drafter_algorithm, CANDIDATE_SPEC_STEPS, 1, CANDIDATE_SPEC_STEPS + 1, (0, 1, 3, 5, 7)
        )
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


def launch_for(
    shape: SpecShape, *, rationale: str, environment: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """SGLang launch flags, adaptive JSON and environment for ``shape`` (the one place a
    recommendation becomes flags): ``{"argv", "adaptive_config", "environment", "error"}``.
    ``environment``: what the recommended configuration needs besides its shape
    (``Recommendation.environment``: the skip-zero-step flag). No speculation needs no
    speculative flags (argv empty)."""
    if shape.algorithm == "NONE":
        return {"argv": [], "adaptive_config": None, "environment": {}, "error": None}
    skip = skips_zero_step(environment)
    # A shape of several candidate steps is SGLang's EMA on its default slot table, as
    # the check replayed it ("adaptive (SGLang EMA, default slots)", _shape_of); a static
    # launch cannot build it.
    slots = default_slots() if len(shape.candidate_steps) > 1 else ()
    try:
        launch = build_launch_config(
            shape, slots, rationale=rationale, skip_zero_step_draft_extend=skip
        )
    except LaunchConfigError as exc:
        return {"argv": [], "adaptive_config": None, "environment": {}, "error": str(exc)}
    return {
        "argv": list(launch.to_argv()),
        "adaptive_config": launch.adaptive_config_json(),
        "environment": launch.environment(),
        "error": None,
    }


def recommendation_document(
    rec: RestartRecommendation,
    time_s: float,
    details: Mapping[str, Any] | None = None,
    environment: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """What status, the store, `specgov recommend` and the apply hook see of ``rec``
    (``environment``: what the launch needs besides the shape, ``launch_for``)."""
    launch = launch_for(
        rec.shape, rationale=f"specgov {rec.source}: {rec.summary}", environment=environment
    )
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


# ------------------------------------------------- the decision: fire or stay silent


def restart_recommendation(
    rec: Recommendation,
    *,
    drafter: str,
    min_gain: float = RESTART_MIN_GAIN,
    sustained_s: float = SUSTAINED_S,
) -> dict[str, Any] | None:
    """The ``restart_recommendation`` object of *rec*, or None when it does not fire: a
    window shorter than *sustained_s* (a burst), a replay that does not describe the
    window (``Recommendation.unreliable``), or a predicted gain under *min_gain*."""
    if rec.workload.window_s < sustained_s or rec.unreliable is not None:
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
            "environment": dict(rec.environment),
        },
        "metric": rec.metric,
        "predicted_gain": rec.predicted_gain,
        "current": rec.current_label,
        "window_s": rec.workload.window_s,
        "source": "replay",
        "notes": list(rec.notes),
    }


def window_tpot(per_scrape_ms: Sequence[float | None]) -> float | None:
    """The window's measured TPOT p50 (``WorkloadSummary.tpot_p50_ms``): the median of its
    scrapes' TPOT p50 (the finite, positive ones), None when no scrape measured one."""
    values = [float(v) for v in per_scrape_ms if is_real(v) and v > 0]
    return statistics.median(values) if values else None
