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
* ``num_retracted_requests_total`` advances at each retraction.

A fresh ``CollectorRegistry`` is used unless one is injected (no global registry).
"""

from __future__ import annotations

import bisect

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

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
        tok = {"model_name": model_name, "engine_type": "unified"}
        sched = {**tok, "tp_rank": "0", "pp_rank": "0", "moe_ep_rank": "0"}
        stream = {**tok, "is_streaming": "true" if streaming else "false"}
        reg = self.registry
        tok_names = list(tok)
        stream_names = [*tok, "is_streaming"]
        sched_names = list(sched)

        def counter(name: str, doc: str, labels: dict[str, str]) -> Counter:
            return Counter(name, doc, list(labels), registry=reg)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, sched_names, registry=reg)

        self.prompt_tokens = counter(
            "sglang:prompt_tokens_total", "Number of prefill tokens processed.", stream
        ).labels(**stream)
        self.generation_tokens = counter(
            "sglang:generation_tokens_total", "Number of generation tokens processed.", stream
        ).labels(**stream)
        self.verify_calls = counter(
            "sglang:spec_verify_calls_total",
            "Number of speculative decoding verification calls.",
            tok,
        ).labels(**tok)
        self.requests = counter(
            "sglang:num_requests_total", "Number of requests processed.", tok
        ).labels(**tok)
        self.retracted = counter(
            "sglang:num_retracted_requests_total", "Total number of retracted requests.", sched
        ).labels(**sched)
        self.ttft = Histogram(
            "sglang:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            stream_names,
            buckets=TTFT_BUCKETS_S,
            registry=reg,
        ).labels(**stream)
        self.itl = Histogram(
            "sglang:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            tok_names,
            buckets=ITL_BUCKETS_S,
            registry=reg,
        ).labels(**tok)
        self.tpot = Histogram(
            "sglang:request_time_per_output_token_seconds",
            "Per-request TPOT in seconds: (finished_time - first_token_time) / "
            "(completion_tokens - 1).",
            stream_names,
            buckets=ITL_BUCKETS_S,
            registry=reg,
        ).labels(**stream)
        self.e2e = Histogram(
            "sglang:e2e_request_latency_seconds",
            "Histogram of End-to-end request latency in seconds",
            stream_names,
            buckets=E2E_BUCKETS_S,
            registry=reg,
        ).labels(**stream)
        self.queue_time = Histogram(
            "sglang:queue_time_seconds",
            "Histogram of queueing time in seconds.",
            sched_names,
            buckets=E2E_BUCKETS_S,
            registry=reg,
        ).labels(**sched)
        self.g_running = gauge("sglang:num_running_reqs", "The number of running requests.").labels(
            **sched
        )
        self.g_queue = gauge(
            "sglang:num_queue_reqs", "The number of requests in the waiting queue."
        )
        self.g_queue = self.g_queue.labels(**sched)
        self.g_token_usage = gauge("sglang:token_usage", "The token usage.").labels(**sched)
        self.g_used_tokens = gauge("sglang:num_used_tokens", "The number of used tokens.").labels(
            **sched
        )
        self.g_available = gauge(
            "sglang:kv_available_tokens", "The number of available KV tokens."
        ).labels(**sched)
        self.g_gen_throughput = gauge(
            "sglang:gen_throughput", "The generation throughput (token/s)."
        ).labels(**sched)
        self.g_accept_length = gauge(
            "sglang:spec_accept_length", "The average acceptance length of speculative decoding."
        ).labels(**sched)
        self.g_num_steps = gauge(
            "sglang:spec_num_steps", "The current speculative num_steps (adaptive)."
        ).labels(**sched)
        self.g_retracted = gauge(
            "sglang:num_retracted_reqs", "The number of retracted requests."
        ).labels(**sched)
        realtime = Counter(
            "sglang:realtime_tokens_total",
            "Total number of tokens processed (updated on each log interval). "
            "mode: prefill_compute, prefill_cache, decode.",
            [*sched_names, "mode"],
            registry=reg,
        )
        self.realtime_decode = realtime.labels(**sched, mode="decode")
        self.realtime_prefill = realtime.labels(**sched, mode="prefill_compute")
        if kv_capacity_tokens is not None:
            gauge(
                "sglang:max_total_num_tokens",
                "Maximum total number of tokens in the KV cache pool.",
            ).labels(**sched).set(kv_capacity_tokens)
        # Accumulators between gauge refreshes (SGLang's metrics_reporter does the same).
        self._decode_ct = 0
        self._iv_tokens = 0
        self._iv_verify_tokens = 0
        self._iv_verifies = 0
        self._iv_start_s: float | None = None
        self._iv_retracted = 0
        self._iv_prefill_tokens = 0
        # ITL buckets: prometheus_client has no "observe n times"; SGLang bumps the
        # bucket by n directly. We keep the same arithmetic via observe() n times only
        # for the rare n > 1 path below, and bisect for the common case.
        self._itl_bounds = ITL_BUCKETS_S

    # ------------------------------------------------------------------ events

    def on_first_token(self, ttft_s: float, queue_s: float) -> None:
        self.ttft.observe(ttft_s)
        self.queue_time.observe(queue_s)

    def on_tokens(self, interval_s: float, num_tokens: int) -> None:
        """One output chunk of one request (SGLang's observe_inter_token_latency)."""
        if num_tokens <= 0:
            return
        value = interval_s / num_tokens
        hist = self.itl
        # Same effect as SGLang's fast path: sum += interval, bucket(value) += n.
        hist._sum.inc(interval_s)
        idx = bisect.bisect_left(self._itl_bounds, value)
        hist._buckets[idx].inc(num_tokens)

    def on_finish(
        self,
        *,
        prompt_tokens: int,
        generation_tokens: int,
        verify_calls: int,
        e2e_s: float,
        tpot_s: float | None,
    ) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(generation_tokens)
        if verify_calls > 0:
            self.verify_calls.inc(verify_calls)
        self.requests.inc()
        self.e2e.observe(e2e_s)
        if tpot_s is not None:
            self.tpot.observe(tpot_s)

    def on_prefill(self, new_tokens: int, duration_s: float = 0.0) -> None:
        """One prefill forward of ``new_tokens`` that took ``duration_s`` (modelled)."""
        self._iv_prefill_tokens += new_tokens

    def on_retract(self, count: int) -> None:
        self.retracted.inc(count)
        self._iv_retracted += count

    def on_decode(
        self,
        *,
        now_s: float,
        running: int,
        queued: int,
        used_tokens: int,
        capacity_tokens: int,
        steps: int,
        emitted_tokens: int,
        verified_requests: int,
        step_s: float = 0.0,
    ) -> None:
        """After each decode forward (``step_s`` long); gauges refresh every
        decode_log_interval iterations."""
        if self._iv_start_s is None:
            self._iv_start_s = now_s
        self._decode_ct += 1
        self._iv_tokens += emitted_tokens
        self._iv_verify_tokens += emitted_tokens if verified_requests else 0
        self._iv_verifies += verified_requests
        if self._decode_ct % self.decode_log_interval != 0:
            return
        span = now_s - self._iv_start_s
        self.g_running.set(running)
        self.g_queue.set(queued)
        self.g_used_tokens.set(used_tokens)
        self.g_available.set(capacity_tokens - used_tokens)
        self.g_token_usage.set(used_tokens / capacity_tokens if capacity_tokens else 0.0)
        self.g_gen_throughput.set(self._iv_tokens / span if span > 0 else 0.0)
        if self._iv_verifies:
            self.g_accept_length.set(self._iv_verify_tokens / self._iv_verifies)
        self.g_num_steps.set(steps)
        self.g_retracted.set(self._iv_retracted)
        self.realtime_decode.inc(self._iv_tokens)
        self.realtime_prefill.inc(self._iv_prefill_tokens)
        self._iv_prefill_tokens = 0
        self._iv_tokens = self._iv_verify_tokens = self._iv_verifies = 0
        self._iv_retracted = 0
        self._iv_start_s = now_s

    # ------------------------------------------------------------------ output

    def render(self) -> bytes:
        """The /metrics body (Prometheus text exposition format)."""
        return generate_latest(self.registry)
