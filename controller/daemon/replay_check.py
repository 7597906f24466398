"""The restart check over a simulator replay (``specgov replay``, the policy suite): the
window a daemon policy's replay run saw, summarised as the restart loop summarises live
telemetry (``replay_workload``), the check run on it (``replay_restart_check``, the replay
JSON's ``restart_recommendation``), and the gain measured by a run of the configuration it
recommends (``measures_recommendation``, ``measured_gain``). The check itself is
``recommend.py``'s."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from specgov.controller.daemon.load_shape import arrival_segments
from specgov.controller.daemon.recommend import (
    RATE_METRICS,
    Recommendation,
    RecommendError,
    WorkloadSummary,
    recommend,
    restart_recommendation,
    saturated_concurrency,
    window_table,
    window_tpot,
)


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
    shape = arrival_segments(
        [
            (r.time_s, _finished_rps(r.inputs_summary), _held(q))
            for r, q in zip(records, samples, strict=True)
        ]
    )
    table, accept, steps = window_table(
        in_force,
        [r for r, _ in samples if r is not None],
        [
            (r.inputs_summary.get("accept_length"), r.inputs_summary.get("spec_num_steps"))
            for r in records
        ],
        last.get("spec_num_steps"),
    )
    return WorkloadSummary(
        window_s=duration,
        request_rate_rps=completed / duration,
        mean_input_tokens=sum(inputs) / len(inputs) if inputs else 0.0,
        mean_output_tokens=result.output_tokens / completed if completed else 0.0,
        accept_length=accept,
        current_steps=steps,
        concurrency=saturated_concurrency(samples),
        table=table,
        segments=shape,
        tpot_p50_ms=window_tpot([r.inputs_summary.get("tpot_p50_ms") for r in records]),
    )


def _finished_rps(summary: Mapping[str, Any]) -> float | None:
    """Requests finished per second over an audit row's observation window, or None."""
    finished, window = summary.get("finished_requests"), summary.get("window_s")
    return None if finished is None or not window else float(finished) / float(window)


def _held(sample: tuple[int | None, int | None]) -> int | None:
    """Requests in the server (running + queued) of a (running, queued) sample, or None."""
    running, queued = sample
    return None if running is None or queued is None else running + queued


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
    topk: int = 1,
    num_draft_tokens: int | None = None,
) -> dict[str, dict[str, Any] | None]:
    """Per daemon policy of one replay (``PolicyRun``s), its ``restart_recommendation``
    (None when it does not fire), also set as that key of the run's summary (the replay
    JSON). Where the replay also ran the recommended configuration on the same trace, the
    object carries the gain measured there (``measured_gain``): its policy on the replay's
    server shape (*topk*, *num_draft_tokens*), or ``none``; a run of ``static:5`` on a chain
    server does not measure a tree of 5 steps.

    The check runs over the whole replay, as the daemon's scheduled check does over its
    window; a policy's restart trigger (goodput's) predicts nothing and adds only when it
    first asked for a check (``restart_triggered_s`` in the summary, absent when never)."""
    summaries = {r.policy.name: r.summary for r in runs}
    out: dict[str, dict[str, Any] | None] = {}
    for run in runs:
        if run.policy.daemon_spec is None:
            continue
        triggers = [] if run.loop is None else run.loop.log.restart_triggers
        if triggers:
            run.summary["restart_triggered_s"] = triggers[0][0]
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
        run.summary["restart_metric"] = rec.metric  # what the check predicted on, fired or not
        if rec.unreliable is not None:
            run.summary["restart_check"] = rec.unreliable  # why it predicts nothing
        doc = restart_recommendation(rec, drafter=drafter)
        if doc is not None:
            same = measures_recommendation(rec, topk=topk, num_draft_tokens=num_draft_tokens)
            measured = summaries.get(rec.policy) if same else None
            if measured is not None:
                doc["measured_gain"] = measured_gain(measured, run.summary, rec.metric)
        out[run.policy.name] = doc
    for run in runs:
        if run.policy.name in out:
            run.summary["restart_recommendation"] = out[run.policy.name]
    return out


def measures_recommendation(
    rec: Recommendation, *, topk: int = 1, num_draft_tokens: int | None = None
) -> bool:
    """Whether a replay's run of ``rec.policy`` on a server of tree width *topk* (and
    *num_draft_tokens*, for trees) is the configuration *rec* recommends: no speculation,
    or the same policy on the same shape with no environment of its own (a replay's
    servers run without SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND)."""
    if rec.policy == "none":
        return True
    if rec.environment or rec.shape.topk != topk:
        return False
    return topk == 1 or rec.shape.num_draft_tokens == num_draft_tokens


def measured_gain(
    recommended: Mapping[str, Any], current: Mapping[str, Any], metric: str
) -> float | None:
    """What replaying the recommended configuration gained over the current run, on
    *metric* (goodput, throughput: more is better; TPOT p50: less is better)."""
    if metric == "tpot_p50_ms":
        a, b = recommended["tpot_ms"]["p50"], current["tpot_ms"]["p50"]
        return None if not a or b is None else float(b) / float(a) - 1.0
    if metric not in RATE_METRICS:
        raise RecommendError(f"metric must be one of {', '.join(RATE_METRICS)}, got {metric!r}")
    a, b = recommended.get(metric), current.get(metric)
    return None if a is None or not b else float(a) / float(b) - 1.0
