"""Windowed telemetry over SGLang ``/metrics`` snapshots taken at known times.

Pure functions (no clock reads, no IO): time arrives as arguments.

* Counter deltas with reset detection. A counter that went down means the server
  restarted; the window is then reported as a restart and every delta is unknown
  (None), never a negative or truncated rate. The next window starts clean.
* Histogram quantiles from bucket deltas, with Prometheus ``histogram_quantile``
  semantics (linear interpolation inside the bucket; a rank in the ``+Inf`` bucket
  answers the highest finite bound; an empty window answers None).
* Accept length over a window, from counters (see :data:`ACCEPT_LENGTH_FORMULA`).
* :class:`GaugeAger`: SGLang's scheduler gauges refresh only every
  ``decode_log_interval`` (default 40) decode iterations, so a gauge value carries an age.

Metric names are SGLang 0.5.23's (``srt/observability/metrics_collector.py``); the
contract test checks every name here against the wheel.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Final

from specgov.adapters.prometheus_text import (
    DPRank,
    HistogramSeries,
    MetricsSnapshot,
    SeriesKey,
    counter_by_dp,
    histogram_by_dp,
    parse_metrics,
    sum_histograms,
)

# ------------------------------------------------------------------ metric names

# Tokenizer side (no rank labels; advance when a request finishes, except TTFT at the
# first token and ITL per streamed chunk).
GENERATION_TOKENS: Final = "sglang:generation_tokens_total"
PROMPT_TOKENS: Final = "sglang:prompt_tokens_total"
VERIFY_CALLS: Final = "sglang:spec_verify_calls_total"
NUM_REQUESTS: Final = "sglang:num_requests_total"
TTFT: Final = "sglang:time_to_first_token_seconds"
ITL: Final = "sglang:inter_token_latency_seconds"
TPOT: Final = "sglang:request_time_per_output_token_seconds"
E2E: Final = "sglang:e2e_request_latency_seconds"
# Scheduler side (rank labels; one replica per DP group is read).
RETRACTIONS: Final = "sglang:num_retracted_requests_total"
# Pre-seeded on every scheduler rank and slow-growing: a restart shows as a drop even
# when the request counters have caught up with their old values.
SCHEDULER_CPU_SECONDS: Final = "sglang:scheduler_process_cpu_seconds_total"
REALTIME_TOKENS: Final = "sglang:realtime_tokens_total"  # label mode="decode" read
REALTIME_DECODE_MODE: Final = "decode"
NUM_RUNNING: Final = "sglang:num_running_reqs"
NUM_QUEUE: Final = "sglang:num_queue_reqs"
TOKEN_USAGE: Final = "sglang:token_usage"
SPEC_NUM_STEPS: Final = "sglang:spec_num_steps"
MAX_TOTAL_NUM_TOKENS: Final = "sglang:max_total_num_tokens"  # constant, set at start-up

# Gauges SchedulerMetricsCollector.log_stats() writes together, in one call, on every
# refresh. When any of them changes, all of them were refreshed (see GaugeAger).
LOG_STATS_GAUGES: Final = frozenset(
    {
        NUM_RUNNING,
        NUM_QUEUE,
        "sglang:num_grammar_queue_reqs",
        "sglang:gen_throughput",
        "sglang:cache_hit_rate",
        "sglang:decode_sum_seq_lens",
        TOKEN_USAGE,
        "sglang:full_token_usage",
        "sglang:num_used_tokens",
        "sglang:kv_available_tokens",
        "sglang:kv_evictable_tokens",
        "sglang:kv_used_tokens",
        "sglang:spec_accept_length",
        "sglang:spec_accept_rate",
        SPEC_NUM_STEPS,
        "sglang:spec_num_draft_tokens",
        "sglang:num_retracted_reqs",
        "sglang:utilization",
        "sglang:new_token_ratio",
    }
)

# Every metric name the telemetry adapters read (checked against the wheel): the
# window counters and histograms, the gauges the ObservationBuilder reads and every
# gauge GaugeAger uses as refresh evidence, the daemon's workload totals. It is also
# the family filter of parse_read_metrics: a scrape parses these families and no other.
METRICS_READ: Final = frozenset(
    {
        GENERATION_TOKENS,
        PROMPT_TOKENS,
        VERIFY_CALLS,
        NUM_REQUESTS,
        TTFT,
        ITL,
        TPOT,
        E2E,
        RETRACTIONS,
        REALTIME_TOKENS,
        SCHEDULER_CPU_SECONDS,
        MAX_TOTAL_NUM_TOKENS,
    }
    | LOG_STATS_GAUGES
)


def parse_read_metrics(text: str, *, source: str = "<metrics text>") -> MetricsSnapshot:
    """``/metrics`` text parsed for telemetry: only the :data:`METRICS_READ` families.

    What the daemon's scrape and replay's simulated scrape both call. The Observation
    built from it equals the one built from the full parse (``parse_metrics(text)``);
    tests/test_prometheus_fast.py checks that on the recorded fixtures and in replay.
    """
    return parse_metrics(text, source=source, families=METRICS_READ)


# Every label name they read.
LABELS_READ: Final = frozenset(
    {"dp_rank", "tp_rank", "pp_rank", "moe_ep_rank", "priority", "mode", "model_name"}
    | {"engine_type", "is_streaming", "le"}
)

ACCEPT_LENGTH_FORMULA: Final = (
    "accept_length = Δ sglang:generation_tokens_total / Δ sglang:spec_verify_calls_total, "
    "both summed over every label set"
)
"""How accept length over a window is derived, and why (SGLang 0.5.23 source):

* ``req.spec_verify_ct += 1`` runs once per request per verify pass it takes part in
  (``managers/scheduler_components/batch_result_processor.py``), so a batch of B
  requests verified once adds B: the count is per request, not per batch.
* ``TokenizerMetricsCollector.observe_one_finished_request`` adds, when a request
  finishes, its ``completion_tokens`` to ``generation_tokens_total`` and its
  ``spec_verify_ct`` to ``spec_verify_calls_total`` (only if > 0).
* So the window ratio is Σ completion_tokens / Σ verify passes over the requests that
  finished in the window: accepted drafts + the bonus token per request-verify, the
  same quantity as SGLang's per-request ``meta_info["spec_accept_length"]``
  (``tokenizer_manager.py``: ``completion_tokens / spec_verify_ct``).

Known biases, all from the wheel: only finished requests count (a window lags by the
request lifetime); ``completion_tokens`` includes the first token, which prefill
produced, not a verify (``WindowStats.accept_length_excl_prefill`` subtracts one token
per finished request); requests that finished without any verify add tokens but no
verify calls. The ``sglang:spec_accept_rate`` gauge is not used: it divides by the
start-up ``speculative_num_draft_tokens - 1``, which is wrong once adaptive steps move.
"""


# ---------------------------------------------------------------- counter deltas


@dataclass(frozen=True, slots=True)
class CounterDelta:
    """Increase of a counter over a window; ``delta`` None means unknown."""

    delta: float | None
    reset: bool = False


def counter_delta(prev: float | None, cur: float | None) -> CounterDelta:
    """Delta of one counter value. A decrease is a reset (server restart): unknown."""
    if prev is None or cur is None:
        return CounterDelta(None)
    if cur < prev:
        return CounterDelta(None, reset=True)
    return CounterDelta(cur - prev)


def dp_counter_delta(prev: Mapping[DPRank, float], cur: Mapping[DPRank, float]) -> CounterDelta:
    """Delta of a counter summed over DP groups.

    A metric missing from the earlier scrape is unknown (it may not have been exported
    then). A DP group new in the later scrape, while the metric already existed, counts
    from 0: prometheus_client creates a labelled child on its first increment. A metric
    or DP group that vanished, or any group that went down, is a reset: within one
    process lifetime prometheus_client never drops a child, and SGLang starts each launch
    with a fresh multiprocess directory, so only a restart removes a series.
    """
    if not prev:
        return CounterDelta(None)
    if not set(prev) <= set(cur):
        return CounterDelta(None, reset=True)
    total = 0.0
    for dp, value in cur.items():
        step = counter_delta(prev.get(dp, 0.0), value)
        if step.reset:
            return step
        assert step.delta is not None
        total += step.delta
    return CounterDelta(total)


@dataclass(frozen=True, slots=True)
class HistogramDelta:
    """Bucket-wise increase of a histogram over a window; None means unknown."""

    histogram: HistogramSeries | None
    reset: bool = False


def histogram_delta(prev: HistogramSeries | None, cur: HistogramSeries | None) -> HistogramDelta:
    """Bucket-wise delta; a bucket that went down or a changed layout is a reset."""
    if prev is None or cur is None:
        return HistogramDelta(None)
    if prev.bounds != cur.bounds:
        return HistogramDelta(None, reset=True)
    if any(c < p for p, c in zip(prev.cumulative, cur.cumulative, strict=True)):
        return HistogramDelta(None, reset=True)
    if prev.count is not None and cur.count is not None and cur.count < prev.count:
        return HistogramDelta(None, reset=True)
    cumulative = tuple(c - p for p, c in zip(prev.cumulative, cur.cumulative, strict=True))
    d_sum = None if prev.sum is None or cur.sum is None else cur.sum - prev.sum
    d_count = None if prev.count is None or cur.count is None else cur.count - prev.count
    return HistogramDelta(HistogramSeries(cur.bounds, cumulative, d_sum, d_count))


def dp_histogram_delta(
    prev: Mapping[DPRank, HistogramSeries], cur: Mapping[DPRank, HistogramSeries]
) -> HistogramDelta:
    """Delta of a histogram summed over DP groups (same rules as dp_counter_delta)."""
    if not prev:
        return HistogramDelta(None)
    if not set(prev) <= set(cur):
        return HistogramDelta(None, reset=True)
    parts: list[HistogramSeries] = []
    for dp, hist in cur.items():
        base = prev.get(dp)
        if base is None:  # a group's first observation since the metric existed
            base = HistogramSeries(hist.bounds, tuple(0.0 for _ in hist.bounds), 0.0, 0.0)
        step = histogram_delta(base, hist)
        if step.reset:
            return step
        assert step.histogram is not None
        parts.append(step.histogram)
    return HistogramDelta(sum_histograms(parts, what="histogram delta"))


# ----------------------------------------------------------------------- quantiles


def histogram_quantile(q: float, hist: HistogramSeries) -> float | None:
    """The q-quantile of a (delta) histogram, as Prometheus ``histogram_quantile``.

    Linear interpolation inside the bucket holding rank ``q * total`` (the first bucket
    starts at 0 when its bound is positive). None when there is no ``+Inf`` bucket,
    fewer than two buckets, or no observation. A rank in the ``+Inf`` bucket answers the
    highest finite bound (an underestimate, as in Prometheus). Cumulative counts are
    forced monotonic first, like Prometheus does for scrapes torn across buckets.
    """
    if not 0.0 <= q <= 1.0 or math.isnan(q):
        raise ValueError(f"histogram_quantile: q must be in [0, 1], got {q!r}")
    bounds = hist.bounds
    if len(bounds) < 2 or not math.isinf(bounds[-1]):
        return None
    cumulative: list[float] = []
    running = 0.0
    for c in hist.cumulative:
        running = max(running, c)
        cumulative.append(running)
    total = cumulative[-1]
    if total <= 0:
        return None
    rank = q * total
    b = next((i for i in range(len(bounds) - 1) if cumulative[i] >= rank), len(bounds) - 1)
    if b == len(bounds) - 1:
        return bounds[-2]
    if b == 0 and bounds[0] <= 0:
        return bounds[0]
    start = 0.0 if b == 0 else bounds[b - 1]
    below = 0.0 if b == 0 else cumulative[b - 1]
    count = cumulative[b] - below
    if count <= 0:
        return start
    # min(): rounding must not push a value past its bucket (quantiles stay ordered).
    return min(bounds[b], start + (bounds[b] - start) * ((rank - below) / count))


QUANTILES: Final = (0.5, 0.9, 0.99)


def quantiles(
    hist: HistogramSeries | None, qs: Iterable[float] = QUANTILES
) -> tuple[float | None, ...] | None:
    """Quantiles of a delta histogram; None for no histogram or an empty window."""
    if hist is None or not hist.total:
        return None
    return tuple(histogram_quantile(q, hist) for q in qs)


# ------------------------------------------------------------------------ windows


@dataclass(frozen=True, slots=True)
class TimedSnapshot:
    """A scrape and the (monotonic) time it was taken at, in seconds."""

    time_s: float
    metrics: MetricsSnapshot


def accept_length(generation_tokens: float | None, verify_calls: float | None) -> float | None:
    """Tokens per request-verify over a window (see ACCEPT_LENGTH_FORMULA)."""
    if generation_tokens is None or not verify_calls:
        return None
    return generation_tokens / verify_calls


@dataclass(frozen=True, slots=True)
class WindowStats:
    """Counter and histogram deltas between two scrapes. None means unknown."""

    start_s: float
    end_s: float
    restart_detected: bool
    reset_metrics: tuple[str, ...]
    generation_tokens: float | None
    verify_calls: float | None
    requests: float | None
    retractions: float | None
    decode_tokens: float | None  # Δ realtime_tokens_total{mode="decode"}
    ttft: HistogramSeries | None
    itl: HistogramSeries | None
    tpot: HistogramSeries | None
    e2e: HistogramSeries | None

    @property
    def window_s(self) -> float:
        return self.end_s - self.start_s

    @property
    def accept_length(self) -> float | None:
        return accept_length(self.generation_tokens, self.verify_calls)

    @property
    def accept_length_excl_prefill(self) -> float | None:
        """(Δgeneration − Δrequests) / Δverify: without each request's prefill token."""
        if self.generation_tokens is None or self.requests is None or not self.verify_calls:
            return None
        return max(self.generation_tokens - self.requests, 0.0) / self.verify_calls

    @property
    def throughput_source(self) -> str | None:
        """Which counter the throughput comes from.

        ``realtime_tokens_total{mode="decode"}`` advances every decode iteration, so it
        is preferred; ``generation_tokens_total`` advances only when requests finish
        (lumpy), and is the fallback for exporters without the realtime counter.
        """
        if self.decode_tokens is not None:
            return REALTIME_TOKENS
        if self.generation_tokens is not None:
            return GENERATION_TOKENS
        return None

    @property
    def gen_throughput_tok_s(self) -> float | None:
        tokens = self.decode_tokens if self.decode_tokens is not None else self.generation_tokens
        if tokens is None or self.window_s <= 0:
            return None
        return tokens / self.window_s


_WINDOW_COUNTERS: Final = {
    "generation_tokens": (GENERATION_TOKENS, None),
    "verify_calls": (VERIFY_CALLS, None),
    "requests": (NUM_REQUESTS, None),
    "retractions": (RETRACTIONS, None),
    "decode_tokens": (REALTIME_TOKENS, {"mode": REALTIME_DECODE_MODE}),
}
# Counters that only tell about a restart (not reported as window fields).
_RESTART_WITNESSES: Final = (PROMPT_TOKENS, SCHEDULER_CPU_SECONDS)
_WINDOW_HISTOGRAMS: Final = {"ttft": TTFT, "itl": ITL, "tpot": TPOT, "e2e": E2E}


def _counter_values(
    snapshot: MetricsSnapshot, name: str, match: Mapping[str, str] | None
) -> dict[DPRank, float]:
    return {dp: rv.value for dp, rv in counter_by_dp(snapshot, name, match=match).items()}


def compute_window(prev: TimedSnapshot, cur: TimedSnapshot) -> WindowStats:
    """Deltas between two scrapes. Raises ValueError unless ``cur`` is later.

    If any counter or histogram went down, the server restarted in between: the result
    has ``restart_detected`` and every delta None (a partial post-restart count over the
    whole window would understate every rate).
    """
    if not cur.time_s > prev.time_s:
        raise ValueError(
            f"compute_window: the later scrape must be taken after the earlier one, got "
            f"{prev.time_s!r} then {cur.time_s!r}"
        )
    reset: list[str] = []
    counters: dict[str, float | None] = {}
    for field_name, (metric, match) in _WINDOW_COUNTERS.items():
        d = dp_counter_delta(
            _counter_values(prev.metrics, metric, match),
            _counter_values(cur.metrics, metric, match),
        )
        counters[field_name] = d.delta
        if d.reset:
            reset.append(metric)
    for metric in _RESTART_WITNESSES:
        d = dp_counter_delta(
            _counter_values(prev.metrics, metric, None), _counter_values(cur.metrics, metric, None)
        )
        if d.reset:
            reset.append(metric)
    hists: dict[str, HistogramSeries | None] = {}
    for field_name, metric in _WINDOW_HISTOGRAMS.items():
        hd = dp_histogram_delta(
            {dp: rh.histogram for dp, rh in histogram_by_dp(prev.metrics, metric).items()},
            {dp: rh.histogram for dp, rh in histogram_by_dp(cur.metrics, metric).items()},
        )
        hists[field_name] = hd.histogram
        if hd.reset:
            reset.append(metric)
    restarted = bool(reset)
    if restarted:
        counters = dict.fromkeys(counters)
        hists = dict.fromkeys(hists)
    return WindowStats(
        start_s=prev.time_s,
        end_s=cur.time_s,
        restart_detected=restarted,
        reset_metrics=tuple(reset),
        generation_tokens=counters["generation_tokens"],
        verify_calls=counters["verify_calls"],
        requests=counters["requests"],
        retractions=counters["retractions"],
        decode_tokens=counters["decode_tokens"],
        ttft=hists["ttft"],
        itl=hists["itl"],
        tpot=hists["tpot"],
        e2e=hists["e2e"],
    )


# ---------------------------------------------------------------------- gauge age

# Labels that do not identify the log_stats() call that wrote a gauge: the "all"-mode
# pid label and the per-priority breakdown written in the same call.
_NON_PUBLISHER_LABELS: Final = ("pid", "priority")


def _same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


class GaugeAger:
    """When was each gauge series last refreshed, as far as scrapes can tell.

    A scrape cannot see a refresh that wrote the same value again, so the ager tracks
    when each value last *changed* (its first sighting counts as a change). Because
    ``SchedulerMetricsCollector.log_stats()`` writes all of a replica's scheduler gauges
    in one call, a change in any gauge of :data:`LOG_STATS_GAUGES` proves that all of that
    replica's gauges in the set were refreshed at that moment; a gauge's refresh time is
    the later of the two. A gauge dropped as unknown (NaN) counts as the value NaN.
    Series that vanish are forgotten. Feed scrapes in time order.
    """

    def __init__(self, refresh_group: Iterable[str] = LOG_STATS_GAUGES) -> None:
        self._group_names = frozenset(refresh_group)
        self._values: dict[SeriesKey, float] = {}
        self._changed_at: dict[SeriesKey, float] = {}
        self._publisher_refreshed_at: dict[tuple[tuple[str, str], ...], float] = {}
        self._last_time_s: float | None = None

    def reset(self) -> None:
        """Forget everything (another server, or a deliberate restart of tracking)."""
        self._values.clear()
        self._changed_at.clear()
        self._publisher_refreshed_at.clear()
        self._last_time_s = None

    def _publisher(self, key: SeriesKey) -> tuple[tuple[str, str], ...] | None:
        if key.name not in self._group_names:
            return None
        return key.without(*_NON_PUBLISHER_LABELS)

    def observe(self, snapshot: MetricsSnapshot, time_s: float) -> None:
        if self._last_time_s is not None and time_s < self._last_time_s:
            raise ValueError(
                f"GaugeAger.observe: time went backwards ({self._last_time_s!r} -> {time_s!r})"
            )
        self._last_time_s = time_s
        current: dict[SeriesKey, float] = dict(snapshot.gauges)
        for u in snapshot.unknown:
            if u.kind == "gauge":
                current[u.key] = math.nan
        for key in [k for k in self._values if k not in current]:
            del self._values[key]
            del self._changed_at[key]
        for key, value in current.items():
            old = self._values.get(key)
            if old is None or not _same(old, value):
                self._changed_at[key] = time_s
                publisher = self._publisher(key)
                if publisher is not None:
                    self._publisher_refreshed_at[publisher] = time_s
            self._values[key] = value

    def refreshed_at(self, key: SeriesKey) -> float | None:
        """Latest time the series is known to have been (re)written; None if never seen."""
        changed = self._changed_at.get(key)
        if changed is None:
            return None
        publisher = self._publisher(key)
        if publisher is None:
            return changed
        return max(changed, self._publisher_refreshed_at.get(publisher, changed))

    def age_s(self, key: SeriesKey, now_s: float) -> float | None:
        refreshed = self.refreshed_at(key)
        if refreshed is None:
            return None
        return max(now_s - refreshed, 0.0)
