"""SGLang-shaped Prometheus metrics for the simulated server.

The names, types, label sets and histogram buckets are SGLang 0.5.23's
(``srt/observability/metrics_collector.py``), and so is *when* each series moves,
because the daemon's telemetry depends on it:

* tokenizer-side counters (``prompt_tokens_total``, ``generation_tokens_total``,
  ``spec_verify_calls_total``, ``num_requests_total``) and the e2e / TPOT histograms
  advance when a request *finishes* (``observe_one_finished_request``); TTFT is
  observed at the first token and ITL per output chunk (interval / tokens,
  counted once per token);
* scheduler gauges (running, queued, token usage, throughput, accept length,
  spec steps) refresh only every ``decode_log_interval`` (40) decode iterations;
* ``num_retracted_requests_total`` advances at each retraction;
* ``cache_hit_rate`` is set at each prefill batch to that batch's prefix-cache hits /
  (hits + computed prompt tokens), re-prefills after a retraction excluded
  (``metrics_reporter.report_prefill_stats``); decode refreshes do not reset it.

The engine calls the event hooks hundreds of thousands of times per replay, so the
values live in plain Python cells and bucket lists (the same float arithmetic
prometheus_client does, without its per-update lock). :meth:`SimMetrics.render`
copies them into a prometheus_client ``CollectorRegistry`` (a fresh one unless one is
injected; no global registry) and returns ``generate_latest`` of it: the full body the
sim-server serves. :meth:`SimMetrics.render_families` writes the same text for a few
families only, straight from the cells: what replay's simulated scrape asks for
(tests/test_sim_metrics.py checks it is byte-for-byte the matching part of
:meth:`render`).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Protocol, cast

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.utils import floatToGoString

from specgov.adapters.prometheus_text import (
    Labels,
    MetricFamily,
    MetricSample,
    MetricsSnapshot,
    assemble_snapshot,
    restrict,
)

# generate_latest's number format (Go's, e.g. "1.7e+09", "+Inf"); the library leaves
# it unannotated.
_go_float = cast(Callable[[float], str], floatToGoString)


class _Settable(Protocol):
    """A prometheus_client value holder (MutexValue or the multiprocess one)."""

    def set(self, value: float) -> None: ...


DECODE_LOG_INTERVAL = 40

TTFT_BUCKETS_S = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)
E2E_BUCKETS_S = (
    0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400, 600, 1200,
    1800, 2400,
)  # fmt: skip
ITL_BUCKETS_S = (
    0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040, 0.060,
    0.080, 0.100, 0.200, 0.400, 0.600, 0.800, 1.000, 2.000, 4.000, 6.000, 8.000,
)  # fmt: skip


class Cell:
    """One counter or gauge series' value (the child prometheus_client would hold)."""

    __slots__ = ("_counter", "value")

    def __init__(self, *, counter: bool) -> None:
        self.value = 0.0
        self._counter = counter

    def inc(self, amount: float = 1.0) -> None:
        if self._counter and amount < 0:
            raise ValueError("Counters can only be incremented by non-negative amounts.")
        self.value += amount

    def set(self, value: float) -> None:
        if self._counter:
            raise ValueError("a counter cannot be set")
        self.value = float(value)


class HistogramCell:
    """One histogram series: per-bucket counts (upper bounds end with +Inf) and sum."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = (*(float(b) for b in bounds), math.inf)
        self.counts = [0.0] * len(self.bounds)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        """prometheus_client's Histogram.observe: sum, then the first bound >= value."""
        self.sum += value
        if value == value:  # NaN lands in no bucket there either
            self.counts[bisect.bisect_left(self.bounds, value)] += 1.0


def _escape_label_value(value: str) -> str:
    # generate_latest's escaping of label values (backslash, newline, double quote).
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _series_text(name: str, labels: dict[str, str]) -> str:
    if not labels:
        return name
    inner = ",".join(f'{k}="{_escape_label_value(v)}"' for k, v in sorted(labels.items()))
    return f"{name}{{{inner}}}"


def _sample_key(name: str, labels: dict[str, str]) -> tuple[str, Labels]:
    """The (sample name, sorted label pairs) the parser makes of a series' line."""
    return name, tuple(sorted(labels.items()))


@dataclass(frozen=True, slots=True)
class _Family:
    """One exported family: what its lines look like and which cells feed them."""

    name: str  # as in the TYPE line (counters with _total)
    kind: str  # counter | gauge | histogram
    header: str  # the HELP and TYPE lines
    # Counters and gauges: (sample line prefix "name{labels} ", cell).
    scalars: tuple[tuple[str, Cell], ...] = ()
    # Histograms: (prefix, cell, which value of the cell it shows).
    buckets: tuple[tuple[str, HistogramCell, int], ...] = ()
    # The parsed (sample name, labels) of each line above, in the same order.
    keys: tuple[tuple[str, Labels], ...] = ()


# Which value of a HistogramCell a line shows: the cumulative count up to bucket i
# (i >= 0), the total count, or the sum.
_COUNT = -1
_SUM = -2


@dataclass(frozen=True, slots=True)
class FinishedRequest:
    """One request as the metrics see it when it finishes: its prompt and generated
    tokens, its verify calls, its end-to-end latency and its TPOT (None: one token)."""

    prompt_tokens: int
    generation_tokens: int
    verify_calls: int
    e2e_s: float
    tpot_s: float | None


@dataclass(frozen=True, slots=True)
class DecodeStep:
    """One decode forward as the metrics see it: when it ended, the batch and queue,
    the KV pool, the step count, the tokens it emitted, the requests it verified (0
    without a speculation policy) and how long it ran."""

    now_s: float
    running: int
    queued: int
    used_tokens: int
    capacity_tokens: int
    steps: int
    emitted_tokens: int
    verified_requests: int
    step_s: float = 0.0


class SimMetrics:
    """The simulated server's /metrics, fed by the engine as SGLang's collectors are."""

    def __init__(
        self,
        *,
        model_name: str,
        kv_capacity_tokens: int | None = None,
        registry: CollectorRegistry | None = None,
        streaming: bool = True,
        decode_log_interval: int = DECODE_LOG_INTERVAL,
    ) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.decode_log_interval = decode_log_interval
        self._families: list[_Family] = []
        # (prometheus_client value holder, cell) pairs, copied across at a full render.
        self._sync_scalars: list[tuple[_Settable, Cell]] = []
        self._sync_hists: list[tuple[list[_Settable], _Settable, HistogramCell]] = []
        self._plans: dict[frozenset[str], tuple[_Family, ...]] = {}
        tok = {"model_name": model_name, "engine_type": "unified"}
        sched = {**tok, "tp_rank": "0", "pp_rank": "0", "moe_ep_rank": "0"}
        stream = {**tok, "is_streaming": "true" if streaming else "false"}

        self._register_tokenizer_metrics(tok, stream, sched)
        self._register_scheduler_metrics(sched, kv_capacity_tokens)
        # Accumulators between gauge refreshes (SGLang's metrics_reporter does the same).
        self._decode_ct = 0
        self._iv_tokens = 0
        self._iv_verify_tokens = 0
        self._iv_verifies = 0
        self._iv_start_s: float | None = None
        self._iv_retracted = 0
        self._iv_prefill_tokens = 0
        self._itl_counts = self.itl.counts
        self._itl_bounds = self.itl.bounds

    # ------------------------------------------------------------ construction

    def _register_tokenizer_metrics(
        self, tok: dict[str, str], stream: dict[str, str], sched: dict[str, str]
    ) -> None:
        """The request counters and latency histograms (first in SGLang's /metrics)."""
        self.prompt_tokens = self._counter(
            "sglang:prompt_tokens_total", "Number of prefill tokens processed.", [stream]
        )[0]
        self.generation_tokens = self._counter(
            "sglang:generation_tokens_total", "Number of generation tokens processed.", [stream]
        )[0]
        self.verify_calls = self._counter(
            "sglang:spec_verify_calls_total",
            "Number of speculative decoding verification calls.",
            [tok],
        )[0]
        self.requests = self._counter(
            "sglang:num_requests_total", "Number of requests processed.", [tok]
        )[0]
        self.retracted = self._counter(
            "sglang:num_retracted_requests_total", "Total number of retracted requests.", [sched]
        )[0]
        self.ttft = self._histogram(
            "sglang:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            stream,
            TTFT_BUCKETS_S,
        )
        self.itl = self._histogram(
            "sglang:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            tok,
            ITL_BUCKETS_S,
        )
        self.tpot = self._histogram(
            "sglang:request_time_per_output_token_seconds",
            "Per-request TPOT in seconds: (finished_time - first_token_time) / "
            "(completion_tokens - 1).",
            stream,
            ITL_BUCKETS_S,
        )
        self.e2e = self._histogram(
            "sglang:e2e_request_latency_seconds",
            "Histogram of End-to-end request latency in seconds",
            stream,
            E2E_BUCKETS_S,
        )
        self.queue_time = self._histogram(
            "sglang:queue_time_seconds",
            "Histogram of queueing time in seconds.",
            sched,
            E2E_BUCKETS_S,
        )

    def _register_scheduler_metrics(
        self, sched: dict[str, str], kv_capacity_tokens: int | None
    ) -> None:
        """The scheduler's gauges and token counters, in SGLang's order."""
        self.g_running = self._gauge(
            "sglang:num_running_reqs", "The number of running requests.", sched
        )
        self.g_queue = self._gauge(
            "sglang:num_queue_reqs", "The number of requests in the waiting queue.", sched
        )
        self.g_token_usage = self._gauge("sglang:token_usage", "The token usage.", sched)
        self.g_used_tokens = self._gauge(
            "sglang:num_used_tokens", "The number of used tokens.", sched
        )
        self.g_available = self._gauge(
            "sglang:kv_available_tokens", "The number of available KV tokens.", sched
        )
        self.g_gen_throughput = self._gauge(
            "sglang:gen_throughput", "The generation throughput (token/s).", sched
        )
        self.g_cache_hit_rate = self._gauge(
            "sglang:cache_hit_rate", "The prefix cache hit rate.", sched
        )
        self.g_accept_length = self._gauge(
            "sglang:spec_accept_length",
            "The average acceptance length of speculative decoding.",
            sched,
        )
        self.g_num_steps = self._gauge(
            "sglang:spec_num_steps", "The current speculative num_steps (adaptive).", sched
        )
        self.g_retracted = self._gauge(
            "sglang:num_retracted_reqs", "The number of retracted requests.", sched
        )
        self.realtime_decode, self.realtime_prefill = self._counter(
            "sglang:realtime_tokens_total",
            "Total number of tokens processed (updated on each log interval). "
            "mode: prefill_compute, prefill_cache, decode.",
            [{**sched, "mode": "decode"}, {**sched, "mode": "prefill_compute"}],
        )
        if kv_capacity_tokens is not None:
            self._gauge(
                "sglang:max_total_num_tokens",
                "Maximum total number of tokens in the KV cache pool.",
                sched,
            ).set(kv_capacity_tokens)

    @staticmethod
    def _header(name: str, doc: str, kind: str) -> str:
        escaped = doc.replace("\\", r"\\").replace("\n", r"\n")
        return f"# HELP {name} {escaped}\n# TYPE {name} {kind}\n"

    def _counter(self, name: str, doc: str, children: list[dict[str, str]]) -> list[Cell]:
        labelnames = list(children[0])
        parent = Counter(name, doc, labelnames, registry=self.registry)
        cells: list[Cell] = []
        lines: list[tuple[str, Cell]] = []
        for labels in children:
            cell = Cell(counter=True)
            child = parent.labels(**labels)
            self._sync_scalars.append((cast(_Settable, child._value), cell))
            lines.append((_series_text(name, labels) + " ", cell))
            cells.append(cell)
        keys = tuple(_sample_key(name, labels) for labels in children)
        header = self._header(name, doc, "counter")
        self._families.append(_Family(name, "counter", header, tuple(lines), keys=keys))
        return cells

    def _gauge(self, name: str, doc: str, labels: dict[str, str]) -> Cell:
        parent = Gauge(name, doc, list(labels), registry=self.registry)
        cell = Cell(counter=False)
        self._sync_scalars.append((cast(_Settable, parent.labels(**labels)._value), cell))
        line = (_series_text(name, labels) + " ", cell)
        header = self._header(name, doc, "gauge")
        keys = (_sample_key(name, labels),)
        self._families.append(_Family(name, "gauge", header, (line,), keys=keys))
        return cell

    def _histogram(
        self, name: str, doc: str, labels: dict[str, str], buckets: tuple[float, ...]
    ) -> HistogramCell:
        parent = Histogram(name, doc, list(labels), buckets=buckets, registry=self.registry)
        cell = HistogramCell(buckets)
        child = parent.labels(**labels)
        holders = cast(list[_Settable], child._buckets)
        self._sync_hists.append((holders, cast(_Settable, child._sum), cell))
        series = [(f"{name}_bucket", {**labels, "le": _go_float(b)}) for b in cell.bounds]
        series += [(f"{name}_count", labels), (f"{name}_sum", labels)]
        which = [*range(len(cell.bounds)), _COUNT, _SUM]
        lines = tuple(
            (_series_text(n, lab) + " ", cell, w) for (n, lab), w in zip(series, which, strict=True)
        )
        keys = tuple(_sample_key(n, lab) for n, lab in series)
        header = self._header(name, doc, "histogram")
        self._families.append(_Family(name, "histogram", header, buckets=lines, keys=keys))
        return cell

    # ------------------------------------------------------------------ events

    def on_first_token(self, ttft_s: float, queue_s: float) -> None:
        self.ttft.observe(ttft_s)
        self.queue_time.observe(queue_s)

    def on_tokens(self, interval_s: float, num_tokens: int) -> None:
        """One output chunk of one request (SGLang's observe_inter_token_latency)."""
        if num_tokens <= 0:
            return
        # SGLang's fast path: sum += interval, bucket(interval / n) += n.
        self.itl.sum += interval_s
        self._itl_counts[bisect.bisect_left(self._itl_bounds, interval_s / num_tokens)] += (
            num_tokens
        )

    def on_finish(self, done: FinishedRequest) -> None:
        self.prompt_tokens.inc(done.prompt_tokens)
        self.generation_tokens.inc(done.generation_tokens)
        if done.verify_calls > 0:
            self.verify_calls.inc(done.verify_calls)
        self.requests.inc()
        self.e2e.observe(done.e2e_s)
        if done.tpot_s is not None:
            self.tpot.observe(done.tpot_s)

    def on_prefill(self, new_tokens: int, duration_s: float = 0.0) -> None:
        """One prefill forward of ``new_tokens`` that took ``duration_s`` (modelled)."""
        self._iv_prefill_tokens += new_tokens

    def on_prefix_cache(self, hit_tokens: int, computed_tokens: int) -> None:
        """One prefill batch's prefix-cache outcome (first attempts only): prompt tokens
        reused and computed."""
        total = hit_tokens + computed_tokens
        self.g_cache_hit_rate.set(hit_tokens / total if total > 0 else 0.0)

    def on_retract(self, count: int) -> None:
        self.retracted.inc(count)
        self._iv_retracted += count

    def on_decode(self, step: DecodeStep) -> None:
        """After each decode forward; gauges refresh every decode_log_interval
        iterations."""
        if self._iv_start_s is None:
            self._iv_start_s = step.now_s
        self._decode_ct += 1
        self._iv_tokens += step.emitted_tokens
        self._iv_verify_tokens += step.emitted_tokens if step.verified_requests else 0
        self._iv_verifies += step.verified_requests
        if self._decode_ct % self.decode_log_interval != 0:
            return
        span = step.now_s - self._iv_start_s
        used, capacity = step.used_tokens, step.capacity_tokens
        self.g_running.set(step.running)
        self.g_queue.set(step.queued)
        self.g_used_tokens.set(used)
        self.g_available.set(capacity - used)
        self.g_token_usage.set(used / capacity if capacity else 0.0)
        self.g_gen_throughput.set(self._iv_tokens / span if span > 0 else 0.0)
        if self._iv_verifies:
            self.g_accept_length.set(self._iv_verify_tokens / self._iv_verifies)
        self.g_num_steps.set(step.steps)
        self.g_retracted.set(self._iv_retracted)
        self.realtime_decode.inc(self._iv_tokens)
        self.realtime_prefill.inc(self._iv_prefill_tokens)
        self._iv_prefill_tokens = 0
        self._iv_tokens = self._iv_verify_tokens = self._iv_verifies = 0
        self._iv_retracted = 0
        self._iv_start_s = step.now_s

    # ------------------------------------------------------------------ output

    def _sync(self) -> None:
        """Copy the cells into the prometheus_client children (set, not add: exact)."""
        for holder, cell in self._sync_scalars:
            holder.set(cell.value)
        for buckets, total, hcell in self._sync_hists:
            for holder, count in zip(buckets, hcell.counts, strict=True):
                holder.set(count)
            total.set(hcell.sum)

    def render(self) -> bytes:
        """The /metrics body (Prometheus text exposition format): every family of the
        registry, ``_created`` timestamps included."""
        self._sync()
        return generate_latest(self.registry)

    def render_families(self, families: Collection[str]) -> bytes:
        """The part of :meth:`render` for ``families`` (snapshot names, as
        ``parse_metrics(..., families=...)`` takes them: counters with ``_total``,
        histograms by base name), in the same order and bytes, written from the cells.
        Families this object does not export (and ``_created`` timestamps, and
        collectors of an injected registry) are not written.
        """
        out: list[str] = []
        fmt = _go_float
        for family in self._plan(families):
            out.append(family.header)
            for prefix, cell in family.scalars:
                out.append(f"{prefix}{fmt(cell.value)}\n")
            acc = 0.0  # cumulative, as prometheus_client sums its buckets
            for prefix, hcell, which in family.buckets:
                if which >= 0:
                    acc += hcell.counts[which]
                    out.append(f"{prefix}{fmt(acc)}\n")
                elif which == _COUNT:
                    out.append(f"{prefix}{fmt(acc)}\n")
                else:
                    out.append(f"{prefix}{fmt(hcell.sum)}\n")
        return "".join(out).encode()

    def _plan(self, families: Collection[str]) -> tuple[_Family, ...]:
        key = families if isinstance(families, frozenset) else frozenset(families)
        plan = self._plans.get(key)
        if plan is None:
            plan = tuple(f for f in self._families if f.name in key)
            self._plans[key] = plan
        return plan

    def read_snapshot(self, families: Collection[str]) -> MetricsSnapshot:
        """What the daemon's parser makes of :meth:`render_families`' text, built from
        the cells without the text (replay's scrape at every tick): the same samples,
        values and order, through the parser's own assembly rules
        (tests/test_sim_metrics.py checks both paths give the same observations)."""
        out: list[MetricFamily] = []
        for family in self._plan(families):
            samples: list[MetricSample] = []
            if family.kind != "histogram":
                for (name, labels), (_, cell) in zip(family.keys, family.scalars, strict=True):
                    samples.append((name, labels, cell.value))
            else:
                acc = 0.0  # cumulative, as render_families writes it
                for (name, labels), (_, hcell, which) in zip(
                    family.keys, family.buckets, strict=True
                ):
                    if which >= 0:
                        acc += hcell.counts[which]
                        samples.append((name, labels, acc))
                    elif which == _COUNT:
                        samples.append((name, labels, acc))
                    else:
                        samples.append((name, labels, hcell.sum))
            out.append((family.name, family.kind, samples))
        wanted = families if isinstance(families, frozenset) else frozenset(families)
        return restrict(assemble_snapshot(out, "simulated /metrics"), wanted)
