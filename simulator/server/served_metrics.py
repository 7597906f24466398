"""What the simulated server publishes from its engine's events, behind one lock.

:class:`ServedMetrics` is SGLang's metric set
(:class:`~specgov.simulator.engine.sglang_metrics.SimMetrics`) plus the state SGLang's scheduler
publishes for ``/server_info`` and ``/v1/loads``
(:class:`~specgov.simulator.server.endpoints.LiveState`). The engine thread feeds events; HTTP
handlers render ``/metrics`` or take a snapshot. One lock serialises both, so a scrape sees a
state between two engine events."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping

from specgov.simulator.engine.sglang_metrics import DecodeStep, FinishedRequest, SimMetrics
from specgov.simulator.server import endpoints as ep


class ServedMetrics(SimMetrics):
    """SimMetrics plus what /server_info and /v1/loads publish, behind one lock.

    The engine thread feeds events; HTTP handlers render or take a :class:`LiveState`.
    Load snapshots are published as SGLang's scheduler does: every
    ``load_snapshot_publish_interval`` (15) decode iterations and when it goes idle
    (prefill-time publishes are not modelled: the engine reports no queue lengths then).
    Lifetime acceptance totals advance at each ``decode_log_interval`` (40) decodes.
    """

    def __init__(
        self,
        *,
        model_name: str,
        kv_capacity_tokens: int,
        wall_of: Callable[[float], float],
        draft_per_round: int,
        publish_interval: int = 15,
    ) -> None:
        self.lock = threading.Lock()
        super().__init__(model_name=model_name, kv_capacity_tokens=kv_capacity_tokens)
        self._capacity = kv_capacity_tokens
        self._wall_of = wall_of
        self._draft_per_round = draft_per_round
        self._publish_interval = publish_interval
        self._decodes = 0
        self._pub_count = 0
        self._running = 0
        self._waiting = 0
        self._used = 0
        self._published_at_s = 0.0
        self._pub_running = self._pub_waiting = self._pub_used = 0
        self._pub_gen_tput = 0.0
        self._pub_retracted = 0
        self._gen_tput = 0.0
        self._log_start_s: float | None = None
        self._log_tokens = 0
        self._log_retracted = 0
        self._iv_acc = self._iv_fwd = self._iv_correct = 0
        self._acc_total = self._fwd_total = 0
        self._accept_rate = 0.0
        self._moments = [0.0] * 6
        self._prefill_tokens = 0
        self._prefill_busy_us = 0
        self._overrides: dict[str, int | float] = {}
        self._idle = True
        self.forwards = 0
        self.finished = 0

    # ------------------------------------------------------------ engine events

    def on_first_token(self, ttft_s: float, queue_s: float) -> None:
        with self.lock:
            super().on_first_token(ttft_s, queue_s)

    def on_tokens(self, interval_s: float, num_tokens: int) -> None:
        with self.lock:
            super().on_tokens(interval_s, num_tokens)

    def on_finish(self, done: FinishedRequest) -> None:
        with self.lock:
            super().on_finish(done)
            self.finished += 1

    def on_prefill(self, new_tokens: int, duration_s: float = 0.0) -> None:
        with self.lock:
            super().on_prefill(new_tokens, duration_s)
            self.forwards += 1
            self._idle = False
            self._prefill_tokens += new_tokens
            self._prefill_busy_us += int(duration_s * 1e6)

    def on_prefix_cache(self, hit_tokens: int, computed_tokens: int) -> None:
        with self.lock:
            super().on_prefix_cache(hit_tokens, computed_tokens)

    def on_retract(self, count: int) -> None:
        with self.lock:
            super().on_retract(count)
            self._log_retracted += count

    def on_decode(self, step: DecodeStep) -> None:
        with self.lock:
            super().on_decode(step)
            self.forwards += 1
            self._idle = False
            self._running, self._waiting, self._used = step.running, step.queued, step.used_tokens
            now_s, emitted, verified = step.now_s, step.emitted_tokens, step.verified_requests
            if self._log_start_s is None:
                self._log_start_s = now_s
            self._log_tokens += emitted
            if verified:
                self._iv_acc += emitted
                self._iv_fwd += verified
                self._iv_correct += emitted - verified
            # SGLang's decode moments use launch-to-launch cadence; here the modelled
            # forward duration, which is that cadence when decodes run back to back.
            step_us = float(int(step.step_s * 1e6))
            if step.running > 0 and step_us > 0:
                m = self._moments
                b = float(step.running)
                m[0] += 1.0
                m[1] += b
                m[2] += step_us
                m[3] += b * b
                m[4] += b * step_us
                m[5] += float(emitted)
            self._decodes += 1
            if self._decodes % self.decode_log_interval == 0:
                span = now_s - self._log_start_s
                self._gen_tput = self._log_tokens / span if span > 0 else 0.0
                self._log_tokens = 0
                self._log_start_s = now_s
                if self._iv_fwd:
                    self._acc_total += self._iv_acc
                    self._fwd_total += self._iv_fwd
                    drafted = self._iv_fwd * self._draft_per_round
                    self._accept_rate = self._iv_correct / drafted if drafted > 0 else 0.0
                self._iv_acc = self._iv_fwd = self._iv_correct = 0
                self._pub_retracted = self._log_retracted
                self._log_retracted = 0
            self._pub_count += 1
            if self._pub_count >= self._publish_interval:
                self._publish(now_s)

    def _publish(self, now_sim_s: float) -> None:
        self._pub_count = 0
        self._published_at_s = self._wall_of(now_sim_s)
        self._pub_running, self._pub_waiting, self._pub_used = (
            self._running,
            self._waiting,
            self._used,
        )
        self._pub_gen_tput = self._gen_tput

    def mark_idle(self, now_sim_s: float) -> None:
        """The engine is idle (nothing running or queued): publish that once, and
        refresh the scheduler gauges to idle values as SGLang's idle path does."""
        with self.lock:
            if self._idle and self._published_at_s > 0:
                return
            self._idle = True
            self._running = self._waiting = self._used = 0
            self._gen_tput = 0.0
            self.g_running.set(0)
            self.g_queue.set(0)
            self.g_gen_throughput.set(0)
            self.g_used_tokens.set(0)
            self.g_token_usage.set(0)
            self.g_available.set(self._capacity)
            self._publish(now_sim_s)

    # -------------------------------------------------------------- HTTP side

    def render(self) -> bytes:
        with self.lock:
            return super().render()

    def apply_overrides(self, overrides: Mapping[str, int | float], *, reset_spec: bool) -> None:
        """Record a /set_internal_state update (accept thresholds restart the lifetime
        acceptance statistics, as SGLang's handler does)."""
        with self.lock:
            self._overrides.update(overrides)
            if reset_spec:
                self._acc_total = self._fwd_total = 0

    def snapshot(self) -> ep.LiveState:
        with self.lock:
            return ep.LiveState(
                published_at_s=self._published_at_s,
                running_requests=self._pub_running,
                waiting_requests=self._pub_waiting,
                used_tokens=self._pub_used,
                gen_throughput_tok_s=self._pub_gen_tput,
                last_gen_throughput_tok_s=self._gen_tput,
                retracted_requests=self._pub_retracted,
                spec_accept_tokens_total=self._acc_total,
                spec_forward_ct_total=self._fwd_total,
                spec_accept_rate=self._accept_rate,
                prefill_uncached_tokens_total=self._prefill_tokens,
                prefill_busy_us_total=self._prefill_busy_us,
                decode_moments=tuple(self._moments),
                overrides=dict(self._overrides),
            )
