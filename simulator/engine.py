"""A discrete-event model of one SGLang server with (adaptive) speculative decoding.

What it models, in SGLang's own order (scheduler event loop of 0.5.23, non-overlap):

* Requests arrive from a trace into a FCFS waiting queue.
* Each iteration the scheduler first tries to build a prefill batch
  (``get_new_batch_prefill``): FCFS admission bounded by ``max_running_requests``,
  the chunked-prefill token budget (one request at a time may be split into
  chunks) and the KV budget (free KV minus the tokens still reserved for
  running requests: ``min(remaining_output, 4096) * new_token_ratio``).
  A prefill batch runs instead of decode: decoding requests stall meanwhile.
* Otherwise every running request decodes in one batch. With speculation the
  in-engine policy object is asked ``get_steps_for_batch(batch_size)`` before the
  forward (``activate_step_by_batch``) and told ``on_verify_complete(accepted
  drafts per request, batch_size)`` after it; a returned step switches the
  runtime state at once, exactly as ``AdaptiveController`` does. Any step that
  is not a prebuilt candidate raises, as in SGLang.
* The KV pool has a fixed token capacity (from the VRAM plan). A decode step
  needs room for every verified token; when the pool runs dry requests are
  retracted in SGLang's order (fewest output tokens first, then longest input)
  and re-queued at the front, and ``new_token_ratio`` is re-estimated.

Virtual time only advances by modelled forward durations. There is a single
ordered event source (the sorted arrivals) and one server, so a plain loop is
the whole event queue; the optional event log makes runs comparable: same
inputs and seed, same log.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from specgov.policies.protocol import AdaptiveSpecPolicy
    from specgov.simulator.sim_metrics import SimMetrics
    from specgov.simulator.traces import Request

# SGLang constants (environ.py / schedule_policy.py, 0.5.23).
CLIP_MAX_NEW_TOKENS = 4096
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO_FACTOR = 0.14
NEW_TOKEN_RATIO_DECAY_STEPS = 600
RETRACT_DECODE_STEPS = 20

# Slot lower bounds used for reporting steps per batch-size slot: SGLang's
# default adaptive table (1, 8, 32, 64).
REPORT_SLOTS: tuple[int, ...] = (1, 8, 32, 64)

# ITL histogram: log-spaced bins, 1 % wide, from 1 µs to ~1000 s.
_ITL_MIN_S = 1e-6
_ITL_LOG_STEP = math.log(1.01)
_ITL_BINS = int(math.log(1e9) / _ITL_LOG_STEP) + 2


class StepCost(Protocol):
    """What the engine needs from a cost model (seconds)."""

    def decode_step_s(self, batch_size: int, steps: int, kv_tokens: int) -> float: ...

    def prefill_s(self, new_tokens: int, prefix_kv_tokens: int) -> float: ...


class Sampler(Protocol):
    def draw(self, steps: int) -> int: ...


@runtime_checkable
class PeekableSampler(Protocol):
    """A sampler that can tell its next draw without consuming it (for the oracle)."""

    def draw(self, steps: int) -> int: ...

    def peek(self, steps: int) -> int: ...


@runtime_checkable
class BatchOracle(Protocol):
    """An in-engine policy allowed to see each running request's true next acceptance.

    Benchmarks only (``specgov.simulator.oracle``): the engine binds its cost model and
    config once, then before every ``get_steps_for_batch`` hands over, per running
    request, ``peek(steps)`` (the accepted drafts its next verify would get) and the
    output tokens it still has to generate, plus the KV tokens in use.
    """

    def bind_engine(self, cost: StepCost, config: EngineConfig) -> None: ...

    def observe_batch(
        self,
        peeks: Sequence[Callable[[int], int]],
        remaining_tokens: Sequence[int],
        kv_used_tokens: int,
    ) -> None: ...


class SamplerFactory(Protocol):
    def sampler(
        self, request_index: int, domain: str | None, acc_len: Sequence[int] | None = None
    ) -> Sampler: ...


def sglang_decode_cuda_graph_bs(max_bs: int, speculative: bool) -> list[int]:
    """SGLang's default decode CUDA-graph batch sizes (cuda_graph_hook.py, 0.5.23)."""
    if speculative:
        capture = (
            list(range(1, 9))
            + list(range(10, 33, 2))
            + list(range(40, 65, 4))
            + list(range(72, 257, 8))
            + list(range(272, max_bs + 1, 16))
        )
    else:
        capture = (
            [1, 2, 4, 8, 12]
            + list(range(16, 257, 8))
            + list(range(272, 512, 16))
            + list(range(512, max_bs + 1, 32))
        )
    capture = [bs for bs in capture if bs <= max_bs]
    if max_bs not in capture:
        capture.append(max_bs)
    return capture


class VirtualClock:
    """The engine's virtual time, readable by in-engine collaborators (TablePolicy's clock)."""

    __slots__ = ("now_s",)

    def __init__(self, now_s: float = 0.0) -> None:
        self.now_s = now_s

    def __call__(self) -> float:
        return self.now_s


class EngineConfigError(ValueError):
    """An engine setting is out of range; the message names it."""


@dataclass(frozen=True)
class EngineConfig:
    """Scheduler settings of the simulated server (SGLang server-arg names)."""

    kv_token_capacity: int
    max_running_requests: int | None = None  # None: SGLang's default, from the KV pool
    chunked_prefill_size: int = 8192
    cuda_graph_max_bs: int | None = 256  # None: CUDA graphs disabled (no padding)
    # Tree shapes (topk > 1) verify min(num_draft_tokens, 1 + steps * topk)
    # tokens per request; chains (topk == 1) verify steps + 1.
    topk: int = 1
    num_draft_tokens: int | None = None
    sample_interval_s: float = 1.0
    record_events: bool = False

    def __post_init__(self) -> None:
        if self.kv_token_capacity < 1:
            raise EngineConfigError(
                f"kv_token_capacity must be a positive token count, got {self.kv_token_capacity}"
            )
        if self.max_running_requests is not None and self.max_running_requests < 1:
            raise EngineConfigError(
                f"max_running_requests must be >= 1, got {self.max_running_requests}"
            )
        if self.chunked_prefill_size < 1:
            raise EngineConfigError(
                f"chunked_prefill_size must be >= 1, got {self.chunked_prefill_size}"
            )
        if self.cuda_graph_max_bs is not None and self.cuda_graph_max_bs < 1:
            raise EngineConfigError(
                f"cuda_graph_max_bs must be >= 1 or None, got {self.cuda_graph_max_bs}"
            )
        if self.topk < 1:
            raise EngineConfigError(f"topk must be >= 1, got {self.topk}")
        if self.topk > 1 and (self.num_draft_tokens is None or self.num_draft_tokens < 2):
            raise EngineConfigError(
                f"num_draft_tokens must be >= 2 with topk={self.topk}, got {self.num_draft_tokens}"
            )
        if self.sample_interval_s <= 0:
            raise EngineConfigError(f"sample_interval_s must be > 0, got {self.sample_interval_s}")

    def verify_tokens_per_request(self, steps: int) -> int:
        if self.topk == 1 or steps == 0 or self.num_draft_tokens is None:
            return steps + 1
        return min(self.num_draft_tokens, 1 + steps * self.topk)

    @property
    def running_cap(self) -> int:
        # SGLang derives the default from the token pool (model_runner): at
        # most half the pool's tokens, never more than 4096 requests.
        if self.max_running_requests is not None:
            return self.max_running_requests
        return max(1, min(4096, self.kv_token_capacity // 2))


class _Req:
    """Mutable per-request state on the engine's hot path."""

    __slots__ = (
        "arrival_s",
        "domain",
        "draw",
        "first_token_s",
        "generated",
        "index",
        "input_tokens",
        "kv_tokens",
        "last_token_s",
        "output_tokens",
        "peek",
        "prefill_target",
        "prefilled",
        "retracted",
        "verifies",
    )

    def __init__(self, index: int, request: Request, draw: Callable[[int], int] | None) -> None:
        self.index = index
        self.arrival_s = request.arrival_s
        self.input_tokens = request.input_tokens
        self.output_tokens = request.output_tokens
        self.domain = request.domain
        self.draw = draw
        self.peek: Callable[[int], int] | None = None
        self.generated = 0
        self.kv_tokens = 0
        self.prefilled = 0
        self.prefill_target = request.input_tokens
        self.first_token_s = -1.0
        self.last_token_s = -1.0
        self.retracted = 0
        self.verifies = 0


@dataclass
class TimeSeries:
    """Per-interval samples for plots and reports (one entry per interval)."""

    time_s: list[float] = field(default_factory=list)
    mean_batch_size: list[float] = field(default_factory=list)
    queued_requests: list[int] = field(default_factory=list)
    running_requests: list[int] = field(default_factory=list)
    output_tok_s: list[float] = field(default_factory=list)
    mean_tpot_ms: list[float] = field(default_factory=list)  # NaN: nothing finished
    kv_used_fraction: list[float] = field(default_factory=list)
    # Mean steps used by decode batches of each report slot (NaN: none ran).
    steps_by_slot: dict[int, list[float]] = field(default_factory=dict)


@dataclass
class EngineResult:
    """Everything one simulated run measured; metrics.py summarises it."""

    completed: int
    aborted: int
    output_tokens: int
    first_arrival_s: float
    end_s: float
    ttft_s: list[float]
    tpot_s: list[float]  # per completed request; NaN for single-token requests
    e2e_s: list[float]
    queue_s: list[float]
    req_output_tokens: list[int]
    req_arrival_s: list[float]
    itl_hist: list[int]  # token-weighted, log bins (see itl_bin_edges)
    decode_batches: int
    prefill_batches: int
    decode_time_s: float  # GPU time spent in decode forwards
    prefill_time_s: float  # GPU time spent in prefill forwards
    verify_calls: int
    accepted_drafts: int
    verified_requests: int
    retractions: int
    tier_switches: int
    kv_peak_tokens: int
    kv_token_capacity: int
    steps_hist: dict[tuple[int, int], int]  # (report slot, steps) -> decode batches
    batch_size_hist: dict[int, int]
    series: TimeSeries
    events: list[tuple[float, str, int, int]]


def itl_bin_value(index: int) -> float:
    """Representative value (seconds) of ITL histogram bin *index*."""
    return _ITL_MIN_S * math.exp((index + 0.5) * _ITL_LOG_STEP)


class Engine:
    """One simulated SGLang server. Collaborators are injected.

    ``policy`` is the in-engine ``AdaptiveSpecPolicy`` object (None: no speculation
    at all, as when SGLang runs without ``--speculative-algorithm``). ``acceptance``
    draws accepted drafts per request; it is required with a policy.
    """

    def __init__(
        self,
        *,
        config: EngineConfig,
        cost: StepCost,
        policy: AdaptiveSpecPolicy | None,
        acceptance: SamplerFactory | None,
        initial_steps: int | None = None,
        clock: VirtualClock | None = None,
    ) -> None:
        if policy is not None and acceptance is None:
            raise EngineConfigError("a speculative policy needs an acceptance model")
        self.config = config
        # Virtual time as seen by the policy: set before get_steps_for_batch and
        # after each forward, so a TablePolicy measures modelled step times.
        self.clock = clock if clock is not None else VirtualClock()
        self.cost = cost
        self.policy = policy
        self.acceptance = acceptance
        self.candidates: frozenset[int] = (
            frozenset(policy.candidate_steps) if policy else frozenset()
        )
        self.cuda_graph_bs: list[int] | None = (
            sglang_decode_cuda_graph_bs(config.cuda_graph_max_bs, policy is not None)
            if config.cuda_graph_max_bs is not None
            else None
        )
        self.oracle: BatchOracle | None = policy if isinstance(policy, BatchOracle) else None
        if self.oracle is not None:
            self.oracle.bind_engine(cost, config)
        if policy is not None:
            # AdaptiveController.init_states: graphs first, then the initial state.
            policy.set_cuda_graph_bs(self.cuda_graph_bs)
            start = policy.get_steps_for_batch(1) if initial_steps is None else initial_steps
            self._check_step(start)
            self.initial_steps = start
        else:
            self.initial_steps = 0

    def _check_step(self, step: int) -> None:
        if step not in self.candidates:
            # Same failure as AdaptiveController._activate.
            raise ValueError(f"Missing adaptive runtime state for steps={step}")

    def run(
        self,
        requests: Sequence[Request],
        *,
        progress: Callable[[int, int], None] | None = None,
        time_limit_s: float | None = None,
        metrics: SimMetrics | None = None,
        on_tick: Callable[[float], None] | None = None,
        tick_interval_s: float = 1.0,
        concurrency: int | None = None,
    ) -> EngineResult:
        """Replay *requests* (sorted by arrival) to completion and return the measurements.

        ``metrics`` receives SGLang's metric events (for a /metrics endpoint or the
        closed-loop daemon); ``on_tick(now_s)`` is called whenever virtual time
        passes another ``tick_interval_s`` (at forward boundaries, as a sidecar
        polling a real server would see it).

        ``concurrency=N`` replays as N closed-loop users instead of open-loop
        arrivals: the first N requests arrive at time 0 and each completion (or
        abort) sends the next request at once; trace arrival times are ignored.
        """
        if concurrency is not None and concurrency < 1:
            raise EngineConfigError(f"concurrency must be >= 1, got {concurrency}")
        if tick_interval_s <= 0:
            raise EngineConfigError(f"tick_interval_s must be > 0, got {tick_interval_s}")
        cfg = self.config
        policy = self.policy
        acceptance = self.acceptance
        cost = self.cost
        decode_step_s = cost.decode_step_s
        prefill_s = cost.prefill_s
        capacity = cfg.kv_token_capacity
        running_cap = cfg.running_cap
        chunk_budget = cfg.chunked_prefill_size
        verify_tokens = cfg.verify_tokens_per_request
        graph_bs = self.cuda_graph_bs
        record = cfg.record_events
        events: list[tuple[float, str, int, int]] = []
        vclock = self.clock
        oracle = self.oracle

        n_total = len(requests)
        if concurrency is not None:
            # Closed loop: arrival times are assigned as users get their answers.
            arrivals = [0.0 if i < concurrency else math.inf for i in range(n_total)]
        else:
            arrivals = [r.arrival_s for r in requests]
        next_client = min(concurrency, n_total) if concurrency is not None else n_total
        for i in range(1, n_total):
            if arrivals[i] < arrivals[i - 1]:
                raise ValueError(
                    f"requests must be sorted by arrival_s (request {i} arrives at "
                    f"{arrivals[i]} before request {i - 1} at {arrivals[i - 1]})"
                )
        next_arrival = 0
        waiting: deque[_Req] = deque()
        running: list[_Req] = []
        chunked: _Req | None = None  # the one request whose prefill is split
        now = arrivals[0] if n_total else 0.0
        first_arrival = now

        init_ratio = INIT_NEW_TOKEN_RATIO
        min_ratio = init_ratio * MIN_NEW_TOKEN_RATIO_FACTOR
        ratio_decay = (init_ratio - min_ratio) / NEW_TOKEN_RATIO_DECAY_STEPS
        new_token_ratio = init_ratio

        kv_used = 0
        kv_peak = 0
        current_steps = self.initial_steps

        ttft: list[float] = []
        tpot: list[float] = []
        e2e: list[float] = []
        queue: list[float] = []
        req_out: list[int] = []
        req_arr: list[float] = []
        itl_hist = [0] * _ITL_BINS
        log = math.log
        itl_scale = 1.0 / _ITL_LOG_STEP
        itl_top = _ITL_BINS - 1
        steps_hist: dict[tuple[int, int], int] = {}
        bs_hist: dict[int, int] = {}
        completed = 0
        aborted = 0
        out_tokens = 0
        decode_batches = 0
        prefill_batches = 0
        decode_time = 0.0
        prefill_time = 0.0
        verify_calls = 0
        accepted_total = 0
        verified_requests = 0
        retractions = 0
        tier_switches = 0

        # Time series accumulators.
        series = TimeSeries(steps_by_slot={s: [] for s in REPORT_SLOTS})
        interval = cfg.sample_interval_s
        next_sample = now + interval
        iv_bs_time = 0.0
        iv_busy = 0.0
        iv_tokens = 0
        iv_tpot_sum = 0.0
        iv_tpot_n = 0
        iv_steps_sum = dict.fromkeys(REPORT_SLOTS, 0)
        iv_steps_n = dict.fromkeys(REPORT_SLOTS, 0)
        report_slots = REPORT_SLOTS

        def slot_of(batch_size: int) -> int:
            padded = batch_size
            if graph_bs is not None:
                j = bisect.bisect_left(graph_bs, batch_size)
                if j < len(graph_bs):
                    padded = graph_bs[j]
            j = bisect.bisect_right(report_slots, padded) - 1
            return report_slots[max(0, j)]

        def flush_samples(upto: float) -> None:
            nonlocal next_sample, iv_bs_time, iv_busy, iv_tokens, iv_tpot_sum, iv_tpot_n
            while next_sample <= upto:
                series.time_s.append(next_sample - first_arrival)
                series.mean_batch_size.append(iv_bs_time / iv_busy if iv_busy > 0 else 0.0)
                series.queued_requests.append(len(waiting))
                series.running_requests.append(len(running))
                series.output_tok_s.append(iv_tokens / interval)
                series.mean_tpot_ms.append(
                    1000.0 * iv_tpot_sum / iv_tpot_n if iv_tpot_n else math.nan
                )
                series.kv_used_fraction.append(kv_used / capacity)
                for s in report_slots:
                    n = iv_steps_n[s]
                    series.steps_by_slot[s].append(iv_steps_sum[s] / n if n else math.nan)
                    iv_steps_sum[s] = 0
                    iv_steps_n[s] = 0
                iv_bs_time = iv_busy = 0.0
                iv_tokens = iv_tpot_n = 0
                iv_tpot_sum = 0.0
                next_sample += interval

        next_tick = now + tick_interval_s

        def next_user_request(t: float) -> None:
            nonlocal next_client
            if next_client < n_total:
                arrivals[next_client] = t
                next_client += 1

        def finish(r: _Req, t: float) -> None:
            nonlocal completed, out_tokens, kv_used, iv_tpot_sum, iv_tpot_n
            completed += 1
            if concurrency is not None:
                next_user_request(t)
            out_tokens += r.generated
            kv_used -= r.kv_tokens
            r.kv_tokens = 0
            ttft.append(r.first_token_s - r.arrival_s)
            e2e.append(t - r.arrival_s)
            req_out.append(r.generated)
            req_arr.append(r.arrival_s)
            if r.generated >= 2:
                v = (t - r.first_token_s) / (r.generated - 1)
                tpot.append(v)
                iv_tpot_sum += v
                iv_tpot_n += 1
            else:
                tpot.append(math.nan)
            if metrics is not None:
                metrics.on_finish(
                    prompt_tokens=r.input_tokens,
                    generation_tokens=r.generated,
                    verify_calls=r.verifies,
                    e2e_s=t - r.arrival_s,
                    tpot_s=tpot[-1] if r.generated >= 2 else None,
                )
            if record:
                events.append((t, "finish", r.index, r.generated))

        def make_req(i: int) -> _Req:
            req = requests[i]
            draw = None
            sampler = None
            if acceptance is not None:
                sampler = acceptance.sampler(i, req.domain, req.acc_len)
                draw = sampler.draw
            state = _Req(i, req, draw)
            if oracle is not None:
                if not isinstance(sampler, PeekableSampler):
                    raise EngineConfigError(
                        "the oracle policy needs an acceptance model whose samplers have peek()"
                    )
                state.peek = sampler.peek
            state.arrival_s = arrivals[i]
            return state

        iterations = 0
        while True:
            # Admit arrivals up to now.
            while next_arrival < n_total and arrivals[next_arrival] <= now:
                waiting.append(make_req(next_arrival))
                if record:
                    events.append((arrivals[next_arrival], "arrive", next_arrival, 0))
                next_arrival += 1
            if on_tick is not None and now >= next_tick:
                while next_tick <= now:
                    next_tick += tick_interval_s
                on_tick(now)
            if not running and not waiting and chunked is None:
                if next_arrival >= n_total:
                    break
                # Idle: jump to the next arrival, still ticking on the way.
                target = arrivals[next_arrival]
                if on_tick is not None:
                    while next_tick <= target:
                        on_tick(next_tick)
                        next_tick += tick_interval_s
                now = target
                flush_samples(now)
                continue
            if time_limit_s is not None and now - first_arrival > time_limit_s:
                break
            iterations += 1
            if progress is not None and iterations % 4096 == 0:
                progress(completed + aborted, n_total)

            # ---- prefill (has priority, as in get_next_batch_to_run) ----
            batch: list[tuple[_Req, int]] = []
            budget = chunk_budget
            if chunked is not None:
                take = min(chunked.prefill_target - chunked.prefilled, budget)
                batch.append((chunked, take))
                budget -= take
            if waiting and budget > 0 and len(running) + len(batch) < running_cap:
                reserved = 0.0
                for r in running:
                    rem = r.output_tokens - r.generated
                    reserved += rem if rem < CLIP_MAX_NEW_TOKENS else CLIP_MAX_NEW_TOKENS
                reserved *= new_token_ratio
                rem_total = capacity - kv_used - reserved
                if chunked is not None:
                    rem_total -= chunked.prefill_target - chunked.prefilled
                while waiting and budget > 0 and len(running) + len(batch) < running_cap:
                    r = waiting[0]
                    need = r.prefill_target - r.prefilled
                    rem_out = r.output_tokens - r.generated
                    total = need + min(rem_out, CLIP_MAX_NEW_TOKENS) * new_token_ratio
                    if total > rem_total:
                        if not running and not batch and chunked is None and kv_used == 0:
                            # Can never fit, even alone: SGLang rejects it.
                            waiting.popleft()
                            aborted += 1
                            if concurrency is not None:
                                next_user_request(now)
                            if record:
                                events.append((now, "abort", r.index, 0))
                            continue
                        break
                    waiting.popleft()
                    take = need if need < budget else budget
                    batch.append((r, take))
                    budget -= take
                    rem_total -= total
            if batch:
                new_tokens = 0
                prefix = 0
                for r, take in batch:
                    new_tokens += take
                    prefix += r.prefilled
                dt = prefill_s(new_tokens, prefix)
                now += dt
                prefill_time += dt
                if metrics is not None:
                    metrics.on_prefill(new_tokens, dt)
                prefill_batches += 1
                chunked = None
                for r, take in batch:
                    r.prefilled += take
                    r.kv_tokens += take
                    kv_used += take
                    if r.prefilled < r.prefill_target:
                        chunked = r
                        continue
                    # Prefill done: it produces the next token.
                    r.generated += 1
                    iv_tokens += 1
                    if r.first_token_s < 0:
                        r.first_token_s = now
                        queue.append(now - dt - r.arrival_s)
                        if metrics is not None:
                            metrics.on_first_token(now - r.arrival_s, now - dt - r.arrival_s)
                    else:
                        gap = now - r.last_token_s
                        b = int(log(gap / _ITL_MIN_S) * itl_scale) if gap > _ITL_MIN_S else 0
                        itl_hist[b if b < itl_top else itl_top] += 1
                        if metrics is not None:
                            metrics.on_tokens(gap, 1)
                    r.last_token_s = now
                    if record:
                        events.append((now, "prefill", r.index, r.prefilled))
                    if r.generated >= r.output_tokens:
                        finish(r, now)
                    else:
                        running.append(r)
                if kv_used > kv_peak:
                    kv_peak = kv_used
                if now >= next_sample:
                    flush_samples(now)
                continue

            if not running:
                # Nothing decodes and nothing could be prefilled: the head of
                # the queue can never be admitted (the abort rule above covers
                # the usual case; this guards against a stuck loop).
                if waiting:
                    r = waiting.popleft()
                    aborted += 1
                    if concurrency is not None:
                        next_user_request(now)
                    if record:
                        events.append((now, "abort", r.index, 0))
                continue

            # ---- decode ----
            bsz = len(running)
            vclock.now_s = now
            if oracle is not None:
                oracle.observe_batch(
                    [r.peek for r in running],  # type: ignore[misc]
                    [r.output_tokens - r.generated for r in running],
                    kv_used,
                )
            if policy is not None:
                target = policy.get_steps_for_batch(bsz)
                if target != current_steps:
                    self._check_step(target)
                    current_steps = target
                    tier_switches += 1
            k = current_steps
            per_req = verify_tokens(k)
            needed = bsz * per_req
            if capacity - kv_used < needed and bsz > 1:
                # retract_decode: keep the longest-decoded; pop fewest outputs,
                # then longest input, until the step fits (keep at least one).
                running.sort(key=lambda q: (q.generated, -q.input_tokens), reverse=True)
                retracted_now: list[_Req] = []
                while len(running) > 1 and capacity - kv_used < len(running) * per_req:
                    q = running.pop()
                    kv_used -= q.kv_tokens
                    q.kv_tokens = 0
                    q.prefilled = 0
                    q.prefill_target = q.input_tokens + q.generated
                    q.retracted += 1
                    retractions += 1
                    retracted_now.append(q)
                    if record:
                        events.append((now, "retract", q.index, q.generated))
                if metrics is not None:
                    metrics.on_retract(len(retracted_now))
                # Re-queued at the front, in their original order.
                for q in sorted(retracted_now, key=lambda q: q.index, reverse=True):
                    waiting.appendleft(q)
                dec = 0
                mx = 0
                for q in running:
                    dec += q.generated
                    mx += q.output_tokens
                new_token_ratio = min(1.0, (dec + RETRACT_DECODE_STEPS * len(running)) / (mx + 1))
                bsz = len(running)
                if oracle is not None:
                    oracle.observe_batch(
                        [r.peek for r in running],  # type: ignore[misc]
                        [r.output_tokens - r.generated for r in running],
                        kv_used,
                    )
                if policy is not None:
                    target = policy.get_steps_for_batch(bsz)
                    if target != current_steps:
                        self._check_step(target)
                        current_steps = target
                        tier_switches += 1
                    k = current_steps
                    per_req = verify_tokens(k)
            dt = decode_step_s(bsz, k, kv_used)
            start = now
            now += dt
            vclock.now_s = now
            decode_time += dt
            decode_batches += 1
            bs_hist[bsz] = bs_hist.get(bsz, 0) + 1
            iv_bs_time += bsz * dt
            iv_busy += dt
            done: list[_Req] = []
            emitted_total = 0
            if k > 0:
                accepted: list[int] = []
                acc_sum = 0
                for r in running:
                    a = r.draw(k)  # type: ignore[misc]
                    accepted.append(a)
                    acc_sum += a
                    rem = r.output_tokens - r.generated
                    e = a + 1 if a < rem else rem
                    gap = now - r.last_token_s
                    v = gap / e
                    b = int(log(v / _ITL_MIN_S) * itl_scale) if v > _ITL_MIN_S else 0
                    itl_hist[b if b < itl_top else itl_top] += e
                    r.verifies += 1
                    if metrics is not None:
                        metrics.on_tokens(gap, e)
                    r.generated += e
                    r.kv_tokens += e
                    r.last_token_s = now
                    emitted_total += e
                    if e == rem:
                        done.append(r)
                accepted_total += acc_sum
            else:
                accepted = [0] * bsz if policy is not None else []
                for r in running:
                    if r.draw is not None:
                        # Step 0 still verifies one token: a per-token
                        # acceptance replay must advance its position too.
                        r.draw(0)
                        r.verifies += 1
                    gap = now - r.last_token_s
                    b = int(log(gap / _ITL_MIN_S) * itl_scale) if gap > _ITL_MIN_S else 0
                    itl_hist[b if b < itl_top else itl_top] += 1
                    if metrics is not None:
                        metrics.on_tokens(gap, 1)
                    r.generated += 1
                    r.kv_tokens += 1
                    r.last_token_s = now
                    if r.generated >= r.output_tokens:
                        done.append(r)
                emitted_total = bsz
            kv_used += emitted_total
            if kv_used > kv_peak:
                kv_peak = kv_used
            iv_tokens += emitted_total
            slot = slot_of(bsz)
            key = (slot, k)
            steps_hist[key] = steps_hist.get(key, 0) + 1
            iv_steps_sum[slot] += k
            iv_steps_n[slot] += 1
            if record:
                events.append((start, "decode", bsz, k))
            if policy is not None:
                verify_calls += 1
                verified_requests += bsz
                ret = policy.on_verify_complete(accepted, bsz)
                if ret is not None and ret != current_steps:
                    self._check_step(ret)
                    current_steps = ret
                    tier_switches += 1
            if metrics is not None:
                metrics.on_decode(
                    now_s=now,
                    running=bsz,
                    queued=len(waiting),
                    used_tokens=kv_used,
                    capacity_tokens=capacity,
                    steps=k,
                    emitted_tokens=emitted_total,
                    verified_requests=bsz if policy is not None else 0,
                    step_s=dt,
                )
            if done:
                for r in done:
                    finish(r, now)
                done_set = set(map(id, done))
                running = [r for r in running if id(r) not in done_set]
            new_token_ratio = max(new_token_ratio - ratio_decay, min_ratio)
            if now >= next_sample:
                flush_samples(now)

        flush_samples(now + interval)
        if progress is not None:
            progress(completed + aborted, n_total)
        return EngineResult(
            completed=completed,
            aborted=aborted,
            output_tokens=out_tokens,
            first_arrival_s=first_arrival,
            end_s=now,
            ttft_s=ttft,
            tpot_s=tpot,
            e2e_s=e2e,
            queue_s=queue,
            req_output_tokens=req_out,
            req_arrival_s=req_arr,
            itl_hist=itl_hist,
            decode_batches=decode_batches,
            prefill_batches=prefill_batches,
            decode_time_s=decode_time,
            prefill_time_s=prefill_time,
            verify_calls=verify_calls,
            accepted_drafts=accepted_total,
            verified_requests=verified_requests,
            retractions=retractions,
            tier_switches=tier_switches,
            kv_peak_tokens=kv_peak,
            kv_token_capacity=capacity,
            steps_hist=steps_hist,
            batch_size_hist=bs_hist,
            series=series,
            events=events,
        )
