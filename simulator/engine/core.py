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
* Prefix caching (``EngineConfig.prefix_cache``, SGLang's radix cache, on by default as
  there; ``specgov.simulator.engine.prefix_cache``): a request whose trace gives prompt block
  ids reuses the longest cached prefix and prefills only the rest; the cache holds
  finished requests' prompts in the same KV pool, running requests pin theirs, and
  unpinned blocks are evicted LRU when requests need room (before any retraction, as
  ``check_decode_mem`` evicts first). Requests without ids reuse nothing; a trace
  without any ids runs exactly as with the cache off. With a host tier
  (``EngineConfig.hicache_token_capacity``, SGLang's ``--enable-hierarchical-cache``)
  evicted blocks stay in host memory; a hit there is loaded back over PCIe at
  ``hicache_load_s_per_token``: SGLang copies layer by layer on its own stream while
  the prefill forward runs, so a prefill batch takes the longer of its compute and its
  copies (assumed: full overlap, no contention; the write-through D2H backups run on
  their own stream and are not charged).
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

import math
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from specgov.simulator.engine.interface import (
    BatchOracle,
    EngineConfig,
    EngineConfigError,
    EngineResult,
    PeekableSampler,
    SamplerFactory,
    SkipZeroStepCost,
    StaleableSampler,
    StepCost,
    VirtualClock,
    sglang_decode_cuda_graph_bs,
)
from specgov.simulator.engine.live import LIVE_INDEX_BASE
from specgov.simulator.engine.prefix_cache import PrefixCache
from specgov.simulator.engine.requests import (
    ITL_BINS,
    ITL_LOG_STEP,
    ITL_MIN_S,
    RequestLedger,
    RequestState,
)
from specgov.simulator.engine.requests import itl_bin_value as itl_bin_value
from specgov.simulator.engine.series import REPORT_SLOTS as REPORT_SLOTS
from specgov.simulator.engine.series import IntervalSampler, report_slot, slot_layout
from specgov.simulator.engine.series import TimeSeries as TimeSeries

if TYPE_CHECKING:
    from specgov.policies.engine.protocol import AdaptiveSpecPolicy
    from specgov.simulator.engine.live import LiveSource
    from specgov.simulator.engine.sglang_metrics import SimMetrics
    from specgov.simulator.workload.traces import Request

# SGLang constants (environ.py / schedule_policy.py, 0.5.23).
CLIP_MAX_NEW_TOKENS = 4096
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO_FACTOR = 0.14
NEW_TOKEN_RATIO_DECAY_STEPS = 600
RETRACT_DECODE_STEPS = 20

# ITL histogram binning: bin = int(log(gap / ITL_MIN_S) * _ITL_SCALE), capped at _ITL_TOP.
_ITL_SCALE = 1.0 / ITL_LOG_STEP
_ITL_TOP = ITL_BINS - 1


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
        if config.skip_zero_step_draft_extend and not isinstance(cost, SkipZeroStepCost):
            raise EngineConfigError(
                "skip_zero_step_draft_extend needs a cost model with draft_extend_pass_s()"
            )
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
        # One cache per server: it outlives a run (the sim-server runs one per trace loop).
        self.prefix_cache: PrefixCache | None = (
            PrefixCache(host_token_capacity=config.hicache_token_capacity)
            if config.prefix_cache
            else None
        )
        self.oracle: BatchOracle | None = policy if isinstance(policy, BatchOracle) else None
        if self.oracle is not None:
            self.oracle.bind_engine(cost, config, acceptance)
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
        live: LiveSource | None = None,
        start_s: float | None = None,
    ) -> EngineResult:
        """Replay *requests* (sorted by arrival) to completion and return the measurements.

        ``metrics`` receives SGLang's metric events (for a /metrics endpoint or the
        closed-loop daemon); ``on_tick(now_s)`` is called whenever virtual time
        passes another ``tick_interval_s`` (at forward boundaries, as a sidecar
        polling a real server would see it).

        ``concurrency=N`` replays as N closed-loop users instead of open-loop
        arrivals: the first N requests arrive at time 0 and each completion (or
        abort) sends the next request at once; trace arrival times are ignored.

        ``live`` also serves the requests it hands over as they arrive
        (:mod:`~specgov.simulator.engine.live`); ``start_s`` starts the run at that
        simulated time instead of the first arrival (at most the first arrival).
        """
        if concurrency is not None and concurrency < 1:
            raise EngineConfigError(f"concurrency must be >= 1, got {concurrency}")
        if tick_interval_s <= 0:
            raise EngineConfigError(f"tick_interval_s must be > 0, got {tick_interval_s}")
        st = Run(
            self,
            requests,
            metrics=metrics,
            on_tick=on_tick,
            tick_interval_s=tick_interval_s,
            concurrency=concurrency,
            live=live,
            start_s=start_s,
        )
        ledger = st.ledger
        n_total = st.n_total
        iterations = 0
        # SGLang's event_loop_normal: one batch per iteration, prefill first.
        while True:
            st.admit_arrivals()
            st.tick()
            if not st.running and not st.waiting and st.chunked is None:
                if not st.skip_idle():
                    break  # every request has arrived and finished
                continue
            if time_limit_s is not None and st.now - st.first_arrival_s > time_limit_s:
                break
            iterations += 1
            if progress is not None and iterations % 4096 == 0:
                progress(ledger.completed + ledger.aborted, n_total)
            batch = st.form_prefill_batch()
            if batch:
                st.run_prefill(batch)
            elif st.running:
                st.decode()
            else:
                st.abort_stuck()
        st.close_series()
        if progress is not None:
            progress(ledger.completed + ledger.aborted, n_total)
        return st.result()


class Run:
    """The state of one ``Engine.run`` and the steps of its scheduler loop.

    One method per concern of SGLang's loop: admission (arrivals, closed-loop
    users), ticks, prefill batch formation, prefill, decode (step choice,
    retraction, verify and token emission), finishing. Methods work at batch
    granularity; the per-request loops inside them bind what they use to locals.
    """

    __slots__ = (
        "acceptance",
        "accepted_total",
        "arrivals",
        "batch_cache_hit",
        "batch_load_tokens",
        "bs_hist",
        "cache",
        "cache_hit",
        "cache_hit_host",
        "cache_lookup",
        "capacity",
        "chunk_budget",
        "chunked",
        "concurrency",
        "current_steps",
        "decode_batches",
        "decode_step_s",
        "decode_time",
        "engine",
        "events",
        "first_arrival_s",
        "graph_bs",
        "hicache_load_s",
        "kv_peak",
        "kv_used",
        "ledger",
        "live",
        "live_states",
        "metrics",
        "min_ratio",
        "n_total",
        "new_token_ratio",
        "next_arrival",
        "next_client",
        "next_tick",
        "now",
        "on_tick",
        "oracle",
        "policy",
        "prefill_batches",
        "prefill_s",
        "prefill_time",
        "prefill_tokens",
        "ratio_decay",
        "record",
        "requests",
        "retractions",
        "running",
        "running_cap",
        "sampler",
        "skip_zero",
        "slot_of_bsz",
        "steps_hist",
        "switch_s",
        "switch_stall_s",
        "tick_interval_s",
        "tier_switches",
        "vclock",
        "verified_requests",
        "verify_calls",
        "verify_tokens",
        "waiting",
    )

    def __init__(
        self,
        engine: Engine,
        requests: Sequence[Request],
        *,
        metrics: SimMetrics | None,
        on_tick: Callable[[float], None] | None,
        tick_interval_s: float,
        concurrency: int | None,
        live: LiveSource | None = None,
        start_s: float | None = None,
    ) -> None:
        self.engine = engine
        self.requests = requests
        self.metrics = metrics
        self.on_tick = on_tick
        self.tick_interval_s = tick_interval_s
        self.concurrency = concurrency
        self._bind_models(engine)
        self._init_timeline(requests, tick_interval_s, concurrency, live, start_s)
        self._init_counters(engine, requests)

    def _bind_models(self, engine: Engine) -> None:
        """The engine's collaborators and settings, bound to attributes the loop reads."""
        cfg = engine.config
        self.policy = engine.policy
        self.oracle = engine.oracle
        self.acceptance = engine.acceptance
        self.vclock = engine.clock
        self.decode_step_s = engine.cost.decode_step_s
        self.skip_zero = cfg.skip_zero_step_draft_extend and engine.policy is not None
        if self.skip_zero:
            full = engine.cost.decode_step_s
            extend = engine.cost.draft_extend_pass_s  # type: ignore[attr-defined]

            def step_s(batch_size: int, steps: int, kv_tokens: int) -> float:
                t = full(batch_size, steps, kv_tokens)
                if steps == 0:
                    t -= extend(batch_size, 0, kv_tokens)  # replaced by zeroed stubs
                return t

            self.decode_step_s = step_s
        self.prefill_s = engine.cost.prefill_s
        self.capacity = cfg.kv_token_capacity
        self.running_cap = cfg.running_cap
        self.chunk_budget = cfg.chunked_prefill_size
        self.verify_tokens = cfg.verify_tokens_per_request
        self.graph_bs = engine.cuda_graph_bs
        self.record = cfg.record_events
        self.events: list[tuple[float, str, int, int]] = []

    def _init_timeline(
        self,
        requests: Sequence[Request],
        tick_interval_s: float,
        concurrency: int | None,
        live: LiveSource | None,
        start_s: float | None,
    ) -> None:
        """Arrivals (open or closed loop), the queues, and the run's start time."""
        n_total = len(requests)
        if concurrency is not None:
            # Closed loop: arrival times are assigned as users get their answers.
            arrivals = [0.0 if i < concurrency else math.inf for i in range(n_total)]
        else:
            arrivals = [r.arrival_s for r in requests]
        for i in range(1, n_total):
            if arrivals[i] < arrivals[i - 1]:
                raise ValueError(
                    f"requests must be sorted by arrival_s (request {i} arrives at "
                    f"{arrivals[i]} before request {i - 1} at {arrivals[i - 1]})"
                )
        self.n_total = n_total
        self.arrivals = arrivals
        self.next_client = min(concurrency, n_total) if concurrency is not None else n_total
        self.next_arrival = 0
        self.waiting: deque[RequestState] = deque()
        self.running: list[RequestState] = []
        self.chunked: RequestState | None = None  # the one request whose prefill is split
        self.now = arrivals[0] if n_total else 0.0
        if start_s is not None:
            if n_total and start_s > self.now:
                raise EngineConfigError(f"start_s {start_s} is after the first arrival {self.now}")
            self.now = start_s
        self.first_arrival_s = self.now
        self.live = live
        self.live_states: dict[int, RequestState] = {}  # live index -> state, in flight
        self.next_tick = self.now + tick_interval_s

    def _init_counters(self, engine: Engine, requests: Sequence[Request]) -> None:
        """The scheduler's estimates, the run's counters, the sampler and the cache."""
        cfg = engine.config
        init_ratio = INIT_NEW_TOKEN_RATIO
        self.min_ratio = init_ratio * MIN_NEW_TOKEN_RATIO_FACTOR
        self.ratio_decay = (init_ratio - self.min_ratio) / NEW_TOKEN_RATIO_DECAY_STEPS
        self.new_token_ratio = init_ratio

        self.kv_used = 0
        self.kv_peak = 0
        self.current_steps = engine.initial_steps
        self.decode_batches = 0
        self.prefill_batches = 0
        self.decode_time = 0.0
        self.prefill_time = 0.0
        self.verify_calls = 0
        self.accepted_total = 0
        self.verified_requests = 0
        self.retractions = 0
        self.tier_switches = 0
        self.switch_s = cfg.tier_switch_s
        self.switch_stall_s = 0.0  # switch time not yet charged to a forward
        self.steps_hist: dict[tuple[int, int], int] = {}
        self.bs_hist: dict[int, int] = {}
        self.slot_of_bsz: dict[int, int] = {}  # report_slot memo: batch size -> slot
        self.ledger = RequestLedger()
        # Steps are reported per slot of the layout the policy decides for.
        self.sampler = IntervalSampler(self.now, cfg.sample_interval_s, slot_layout(engine.policy))
        self.prefill_tokens = 0
        # The cache takes part only when something can hit: without block ids the run
        # takes exactly the cache-free path (same arithmetic, same results).
        cache = engine.prefix_cache
        if cache is not None and not cache.total_tokens and not any(r.hash_ids for r in requests):
            cache = None
        self.cache = cache
        self.cache_hit = 0
        self.cache_lookup = 0
        self.batch_cache_hit = 0
        self.cache_hit_host = 0
        self.batch_load_tokens = 0
        self.hicache_load_s = 0.0

    # ---- admission and time ----

    def _make_req(self, i: int) -> RequestState:
        req = self.requests[i]
        draw = None
        sampler = None
        if self.acceptance is not None:
            sampler = self.acceptance.sampler(i, req.domain, req.acc_len)
            draw = sampler.draw
        state = RequestState(i, req, draw)
        if self.skip_zero:
            if not isinstance(sampler, StaleableSampler):
                raise EngineConfigError(
                    "skip_zero_step_draft_extend needs samplers with go_stale()"
                )
            state.go_stale = sampler.go_stale
        if self.oracle is not None:
            if not isinstance(sampler, PeekableSampler):
                raise EngineConfigError(
                    "the oracle policy needs an acceptance model whose samplers have peek()"
                )
            state.peek = sampler.peek
        state.arrival_s = self.arrivals[i]
        return state

    def admit_arrivals(self) -> None:
        """Queue (FCFS) every request that has arrived by now."""
        arrivals = self.arrivals
        n_total = self.n_total
        now = self.now
        i = self.next_arrival
        while i < n_total and arrivals[i] <= now:
            self.waiting.append(self._make_req(i))
            if self.record:
                self.events.append((arrivals[i], "arrive", i, 0))
            i += 1
        self.next_arrival = i
        if self.live is not None:
            self._admit_live()

    def _admit_live(self) -> None:
        """Drop the live requests whose client left, then queue those that arrived."""
        live = self.live
        assert live is not None
        for key in live.cancelled():
            r = self.live_states.get(LIVE_INDEX_BASE + key)
            if r is not None:
                self._drop(r)
        acceptance = self.acceptance
        for key, req in live.take(self.now):
            index = LIVE_INDEX_BASE + key
            sampler = None if acceptance is None else acceptance.sampler(index, req.domain)
            state = RequestState(index, req, None if sampler is None else sampler.draw)
            if self.skip_zero:
                state.go_stale = sampler.go_stale  # type: ignore[union-attr]
            if self.oracle is not None:
                state.peek = sampler.peek  # type: ignore[union-attr]
            self.live_states[index] = state
            self.waiting.append(state)

    def _drop(self, r: RequestState) -> None:
        """Free a live request wherever it is (queued, chunked, running); count it aborted."""
        self.live_states.pop(r.index, None)
        if r is self.chunked:
            self.chunked = None
        if r in self.running:
            self.running.remove(r)
        elif r in self.waiting:
            self.waiting.remove(r)
        self.kv_used -= r.kv_tokens
        r.kv_tokens = 0
        if r.cache_nodes:
            self.cache.unpin(r.cache_nodes, self.now)  # type: ignore[union-attr]
            r.cache_nodes = []
        self._abort(r)

    def _next_user_request(self, t: float) -> None:
        """Closed loop: a user got its answer (or an abort) at *t* and sends its next request."""
        if self.next_client < self.n_total:
            self.arrivals[self.next_client] = t
            self.next_client += 1

    def tick(self) -> None:
        """Call ``on_tick`` once if virtual time has passed another tick interval."""
        on_tick = self.on_tick
        if on_tick is not None and self.now >= self.next_tick:
            while self.next_tick <= self.now:
                self.next_tick += self.tick_interval_s
            on_tick(self.now)

    def skip_idle(self) -> bool:
        """Nothing queued or running: jump to the next arrival, still ticking on the way.

        False when no arrival is left (the run is over). With a live source it waits
        (``LiveSource.idle``) up to the next tick or trace arrival instead.
        """
        if self.live is not None:
            return self._idle_live()
        if self.next_arrival >= self.n_total:
            return False
        target = self.arrivals[self.next_arrival]
        on_tick = self.on_tick
        if on_tick is not None:
            while self.next_tick <= target:
                on_tick(self.next_tick)
                self.next_tick += self.tick_interval_s
        self.now = target
        self._flush_samples(target)
        return True

    def _idle_live(self) -> bool:
        live = self.live
        assert live is not None
        pending = self.next_arrival < self.n_total
        if not pending and not live.hold_open:
            return False
        until = self.next_tick
        if until <= self.now:  # no tick hook: next_tick does not move
            until = self.now + self.tick_interval_s
        if pending and self.arrivals[self.next_arrival] < until:
            until = self.arrivals[self.next_arrival]
        self.now = max(self.now, min(live.idle(self.now, until), until))
        self._flush_samples(self.now)
        return True

    def _flush_samples(self, upto_s: float) -> None:
        self.sampler.flush(
            upto_s, len(self.waiting), len(self.running), self._in_use(), self.capacity
        )

    def _in_use(self) -> int:
        """KV tokens in use: requests' own plus the cached blocks they pin (evictable
        cached blocks count as free, as SGLang's num_used_tokens counts them)."""
        cache = self.cache
        return self.kv_used if cache is None else self.kv_used + cache.pinned_tokens

    # ---- request ends ----

    def _abort(self, r: RequestState) -> None:
        self.ledger.aborted += 1
        if self.live is not None and self.live_states.pop(r.index, None) is not None:
            self.live.rejected(r.index - LIVE_INDEX_BASE, "the request can never fit the KV pool")
        if self.concurrency is not None:
            self._next_user_request(self.now)
        if self.record:
            self.events.append((self.now, "abort", r.index, 0))

    def abort_stuck(self) -> None:
        """Nothing decodes and nothing could be prefilled: the head of the queue can
        never be admitted (the abort rule of prefill formation covers the usual case;
        this guards against a stuck loop)."""
        if self.waiting:
            self._abort(self.waiting.popleft())

    def _finish(self, r: RequestState, t: float) -> int:
        """*r* produced its last token at *t*; returns the KV tokens it releases
        (the caller takes them off its ``kv_used``)."""
        if self.concurrency is not None:
            self._next_user_request(t)
        kv = r.kv_tokens
        r.kv_tokens = 0
        if r.cache_nodes:
            self.cache.unpin(r.cache_nodes, t)  # type: ignore[union-attr]
            r.cache_nodes = []
        tpot = self.ledger.finish(r, t)
        if tpot is not None:
            sampler = self.sampler
            sampler.tpot_sum_s += tpot
            sampler.tpot_n += 1
        if self.metrics is not None:
            self.metrics.on_finish(
                prompt_tokens=r.input_tokens,
                generation_tokens=r.generated,
                verify_calls=r.verifies,
                e2e_s=t - r.arrival_s,
                tpot_s=tpot,
            )
        if self.record:
            self.events.append((t, "finish", r.index, r.generated))
        if self.live_states:
            self.live_states.pop(r.index, None)
        return kv

    # ---- prefill (has priority, as in get_next_batch_to_run) ----

    def form_prefill_batch(self) -> list[tuple[RequestState, int]]:
        """get_new_batch_prefill: (request, tokens to prefill now) pairs.

        The chunked request's next chunk first, then FCFS admission bounded by the
        running cap, the chunk token budget and the KV left once running requests'
        reservations (``min(remaining, 4096) * new_token_ratio``) are set aside. A
        request that can never fit, even alone, is aborted.
        """
        batch: list[tuple[RequestState, int]] = []
        budget = self.chunk_budget
        chunked = self.chunked
        running = self.running
        waiting = self.waiting
        running_cap = self.running_cap
        if chunked is not None:
            take = min(chunked.prefill_target - chunked.prefilled, budget)
            batch.append((chunked, take))
            budget -= take
        if waiting and budget > 0 and len(running) + len(batch) < running_cap:
            if self.cache is not None:
                self._admit_cached(batch, budget)
                return batch
            new_token_ratio = self.new_token_ratio
            kv_used = self.kv_used
            rem_total = self.capacity - kv_used - self._reserved_decode_tokens()
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
                        self._abort(r)
                        continue
                    break
                waiting.popleft()
                take = need if need < budget else budget
                batch.append((r, take))
                budget -= take
                rem_total -= total
        return batch

    def _reserved_decode_tokens(self) -> float:
        """KV the running requests may still need: their remaining outputs (each clipped
        at CLIP_MAX_NEW_TOKENS) times the new-token ratio (SGLang's admission estimate)."""
        reserved = 0.0
        for r in self.running:
            rem = r.output_tokens - r.generated
            reserved += rem if rem < CLIP_MAX_NEW_TOKENS else CLIP_MAX_NEW_TOKENS
        return reserved * self.new_token_ratio

    def _admit_cached(self, batch: list[tuple[RequestState, int]], budget: int) -> None:
        """FCFS admission with the prefix cache (``form_prefill_batch``'s loop): each
        request reuses its longest cached prefix, pins it and needs KV for the rest.

        Evictable cached blocks count as free (SGLang's ``rem_total_tokens`` adds
        ``evictable_size``); pinning a reused block takes it out of that pool.
        """
        cache = self.cache
        assert cache is not None
        chunked = self.chunked
        running = self.running
        waiting = self.waiting
        running_cap = self.running_cap
        new_token_ratio = self.new_token_ratio
        kv_used = self.kv_used
        rem_total = self.capacity - kv_used - cache.pinned_tokens - self._reserved_decode_tokens()
        if chunked is not None:
            rem_total -= chunked.prefill_target - chunked.prefilled
        now = self.now
        while waiting and budget > 0 and len(running) + len(batch) < running_cap:
            r = waiting[0]
            path = []
            cached = 0
            if r.hash_ids and r.prefilled == 0:
                path = cache.match(r.hash_ids, r.input_tokens, now)
                # The last prompt token is always computed (its logits).
                cached = min(cache.path_tokens(path), r.prefill_target - 1)
                if cached <= 0:
                    path, cached = [], 0
            need = r.prefill_target - r.prefilled - cached
            rem_out = r.output_tokens - r.generated
            total = need + min(rem_out, CLIP_MAX_NEW_TOKENS) * new_token_ratio
            pin_cost = cache.unpinned_tokens(path)  # host-only blocks: loaded back
            if total + pin_cost > rem_total:
                if not running and not batch and chunked is None and kv_used == 0:
                    waiting.popleft()  # can never fit, even alone: SGLang rejects it
                    self._abort(r)
                    continue
                break
            waiting.popleft()
            if path:
                host = cache.host_only_tokens(path)
                if host:
                    self.batch_load_tokens += host
                    # Reused tokens past the device part came from the host tier.
                    host_hit = cached - (cache.path_tokens(path) - host)
                    if host_hit > 0 and r.retracted == 0:
                        self.cache_hit_host += host_hit
                cache.pin(path)
                r.cache_nodes = list(path)
            r.cached = cached
            r.prefilled += cached  # reused: counts as prefilled, charged as prefix
            if r.retracted == 0:
                # SGLang's hit rate: first attempts only (re-prefills are "reprocessed").
                self.cache_hit += cached
                self.cache_lookup += r.input_tokens
                self.batch_cache_hit += cached
            take = need if need < budget else budget
            batch.append((r, take))
            budget -= take
            rem_total -= total + pin_cost

    def run_prefill(self, batch: list[tuple[RequestState, int]]) -> None:
        """One prefill forward; decoding requests stall meanwhile. Requests whose
        prefill completes emit their next token and join the running batch."""
        now, dt = self._prefill_forward(batch)
        metrics = self.metrics
        cache = self.cache
        chunked = None
        running = self.running
        record = self.record
        events = self.events
        queue = self.ledger.queue_s
        itl_hist = self.ledger.itl_hist
        log = math.log
        itl_min = ITL_MIN_S
        itl_scale = _ITL_SCALE
        itl_top = _ITL_TOP
        kv_used = self.kv_used
        tokens = 0
        for r, take in batch:
            r.prefilled += take
            r.kv_tokens += take
            kv_used += take
            if r.prefilled < r.prefill_target:
                chunked = r
                continue
            if cache is not None and r.hash_ids:
                # The prompt's blocks enter the cache (cache_unfinished_req); blocks
                # another request cached meanwhile replace this one's copy.
                added, moved, dup = cache.insert(r.hash_ids, r.input_tokens, r.cache_nodes, now)
                if added:
                    r.cache_nodes.extend(added)
                    r.kv_tokens -= moved + dup
                    kv_used -= moved + dup
            # Prefill done: it produces the next token.
            r.generated += 1
            tokens += 1
            if r.first_token_s < 0:
                r.first_token_s = now
                queue.append(now - dt - r.arrival_s)
                if metrics is not None:
                    metrics.on_first_token(now - r.arrival_s, now - dt - r.arrival_s)
            else:
                gap = now - r.last_token_s
                b = int(log(gap / itl_min) * itl_scale) if gap > itl_min else 0
                itl_hist[b if b < itl_top else itl_top] += 1
                if metrics is not None:
                    metrics.on_tokens(gap, 1)
            r.last_token_s = now
            if record:
                events.append((now, "prefill", r.index, r.prefilled))
            if r.generated >= r.output_tokens:
                kv_used -= self._finish(r, now)
            else:
                running.append(r)
        self.chunked = chunked
        self.sampler.tokens += tokens
        self.kv_used = kv_used
        if self.live is not None:
            self.live.emitted(now, [r for r, _ in batch])
        used = kv_used if cache is None else kv_used + cache.pinned_tokens
        if used > self.kv_peak:
            self.kv_peak = used
        if now >= self.sampler.next_sample_s:
            self._flush_samples(now)

    def _prefill_forward(self, batch: list[tuple[RequestState, int]]) -> tuple[float, float]:
        """The prefill forward's time (compute or load-back copies, the longer) and the
        cache room it needs; returns the time it ends and its duration."""
        new_tokens = 0
        prefix = 0
        for r, take in batch:
            new_tokens += take
            prefix += r.prefilled
        dt = self.prefill_s(new_tokens, prefix)
        if self.batch_load_tokens:
            # Load-back copies overlap the forward layer by layer (module docstring).
            load_s = self.batch_load_tokens * self.engine.config.hicache_load_s_per_token
            self.hicache_load_s += load_s
            self.batch_load_tokens = 0
            if load_s > dt:
                dt = load_s
        now = self.now + dt
        self.now = now
        self.prefill_time += dt
        self.prefill_tokens += new_tokens
        metrics = self.metrics
        if metrics is not None:
            metrics.on_prefill(new_tokens, dt)
        cache = self.cache
        if cache is not None:
            # Room for the new tokens: evict unpinned cached blocks, LRU first (admission
            # counted them as free).
            free = self.capacity - self.kv_used - cache.total_tokens
            if new_tokens > free:
                cache.evict(new_tokens - free)
            if metrics is not None:
                # SGLang's per-prefill-batch gauge: hits / (hits + computed), first
                # attempts only.
                first = sum(take for r, take in batch if r.retracted == 0)
                metrics.on_prefix_cache(self.batch_cache_hit, first)
            self.batch_cache_hit = 0
        self.prefill_batches += 1
        return now, dt

    # ---- decode ----

    def _switch_steps(self, step: int) -> None:
        self.engine._check_step(step)
        self.current_steps = step
        self.tier_switches += 1
        self.switch_stall_s += self.switch_s

    def _choose_steps(self, bsz: int) -> int:
        """activate_step_by_batch: the oracle sees the batch, the policy picks its step."""
        oracle = self.oracle
        if oracle is not None:
            running = self.running
            oracle.observe_batch(
                [r.peek for r in running],  # type: ignore[misc]
                [r.output_tokens - r.generated for r in running],
                self._in_use(),
                [r.domain for r in running],
            )
        policy = self.policy
        if policy is not None:
            target = policy.get_steps_for_batch(bsz)
            if target != self.current_steps:
                self._switch_steps(target)
        return self.current_steps

    def _retract(self, per_req: int) -> None:
        """retract_decode: keep the longest-decoded; pop fewest outputs, then longest
        input, until the step fits (keep at least one); re-estimate new_token_ratio."""
        running = self.running
        running.sort(key=lambda q: (q.generated, -q.input_tokens), reverse=True)
        retracted_now: list[RequestState] = []
        capacity = self.capacity
        kv_used = self.kv_used
        record = self.record
        cache = self.cache
        # With the cache, only pinned blocks are in the way: the rest is evicted below.
        pinned = 0 if cache is None else cache.pinned_tokens
        while len(running) > 1 and capacity - kv_used - pinned < len(running) * per_req:
            q = running.pop()
            kv_used -= q.kv_tokens
            q.kv_tokens = 0
            if q.cache_nodes:
                cache.unpin(q.cache_nodes, self.now)  # type: ignore[union-attr]
                q.cache_nodes = []
                pinned = cache.pinned_tokens  # type: ignore[union-attr]
            q.prefilled = 0
            q.prefill_target = q.input_tokens + q.generated
            q.retracted += 1
            retracted_now.append(q)
            if record:
                self.events.append((self.now, "retract", q.index, q.generated))
        self.kv_used = kv_used
        if cache is not None:
            short = len(running) * per_req - (capacity - kv_used - cache.total_tokens)
            if short > 0:
                cache.evict(short)
        self.retractions += len(retracted_now)
        if self.metrics is not None:
            self.metrics.on_retract(len(retracted_now))
        # Re-queued at the front, in their original order.
        waiting = self.waiting
        for q in sorted(retracted_now, key=lambda q: q.index, reverse=True):
            waiting.appendleft(q)
        dec = 0
        mx = 0
        for q in running:
            dec += q.generated
            mx += q.output_tokens
        self.new_token_ratio = min(1.0, (dec + RETRACT_DECODE_STEPS * len(running)) / (mx + 1))

    def decode(self) -> None:
        """One decode forward over every running request, retracting first when the
        KV pool cannot hold the step's verified tokens."""
        bsz, k = self._fit_step()
        cache = self.cache
        kv_used = self.kv_used
        dt = self.decode_step_s(bsz, k, kv_used)
        if self.switch_stall_s:
            # The switches since the last forward stall this one (decode GPU time).
            dt += self.switch_stall_s
            self.switch_stall_s = 0.0
        start = self.now
        now = start + dt
        self.now = now
        self.vclock.now_s = now
        self.decode_time += dt
        self.decode_batches += 1
        bs_hist = self.bs_hist
        bs_hist[bsz] = bs_hist.get(bsz, 0) + 1
        sampler = self.sampler
        sampler.bs_time += bsz * dt
        sampler.busy_s += dt
        accepted, emitted_total, done = self._verify(k, now)
        kv_used += emitted_total
        self.kv_used = kv_used
        used = kv_used if cache is None else kv_used + cache.pinned_tokens
        if used > self.kv_peak:
            self.kv_peak = used
        sampler.tokens += emitted_total
        self._count_steps(bsz, k)
        if self.record:
            self.events.append((start, "decode", bsz, k))
        policy = self.policy
        if policy is not None:
            self.verify_calls += 1
            self.verified_requests += bsz
            ret = policy.on_verify_complete(accepted, bsz)
            if ret is not None and ret != self.current_steps:
                self._switch_steps(ret)
        if self.metrics is not None:
            self.metrics.on_decode(
                now_s=now,
                running=bsz,
                queued=len(self.waiting),
                used_tokens=used,
                capacity_tokens=self.capacity,
                steps=k,
                emitted_tokens=emitted_total,
                verified_requests=bsz if policy is not None else 0,
                step_s=dt,
            )
        stepped = self.running
        if done:
            for r in done:
                kv_used -= self._finish(r, now)
            self.kv_used = kv_used
            done_set = set(map(id, done))
            self.running = [r for r in self.running if id(r) not in done_set]
        if self.live is not None:
            self.live.emitted(now, stepped)
        self.new_token_ratio = max(self.new_token_ratio - self.ratio_decay, self.min_ratio)
        if now >= sampler.next_sample_s:
            self._flush_samples(now)

    def _fit_step(self) -> tuple[int, int]:
        """The batch size and step of the next decode forward: the policy's step, and
        when the pool cannot hold its verified tokens, cached blocks evicted first
        (check_decode_mem), then requests retracted and the step chosen again."""
        bsz = len(self.running)
        self.vclock.now_s = self.now
        k = self._choose_steps(bsz)
        per_req = self.verify_tokens(k)
        cache = self.cache
        if cache is not None:
            # check_decode_mem: evict unpinned cached blocks before retracting anyone.
            short = bsz * per_req - (self.capacity - self.kv_used - cache.total_tokens)
            if short > 0:
                cache.evict(short)
            room = self.capacity - self.kv_used - cache.total_tokens
        else:
            room = self.capacity - self.kv_used
        if room < bsz * per_req and bsz > 1:
            self._retract(per_req)
            bsz = len(self.running)
            k = self._choose_steps(bsz)
        return bsz, k

    def _count_steps(self, bsz: int, k: int) -> None:
        """Count a step-*k* forward of *bsz* requests in the histogram and the sampler,
        per slot of the policy's layout."""
        sampler = self.sampler
        slot = self.slot_of_bsz.get(bsz)
        if slot is None:
            slot = self.slot_of_bsz[bsz] = report_slot(bsz, self.graph_bs, sampler.slots)
        key = (slot, k)
        steps_hist = self.steps_hist
        steps_hist[key] = steps_hist.get(key, 0) + 1
        sampler.steps_sum[slot] += k
        sampler.steps_n[slot] += 1

    def _verify(self, k: int, now: float) -> tuple[list[int], int, list[RequestState]]:
        """Acceptance draws and token emission for a step-*k* forward ending at *now*.

        Returns the accepted drafts per request (what on_verify_complete gets), the
        tokens emitted and the requests that finished. The per-request loops.
        """
        running = self.running
        metrics = self.metrics
        itl_hist = self.ledger.itl_hist
        log = math.log
        itl_min = ITL_MIN_S
        itl_scale = _ITL_SCALE
        itl_top = _ITL_TOP
        done: list[RequestState] = []
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
                b = int(log(v / itl_min) * itl_scale) if v > itl_min else 0
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
            self.accepted_total += acc_sum
        else:
            accepted = [0] * len(running) if self.policy is not None else []
            for r in running:
                if r.draw is not None:
                    # Step 0 still verifies one token: a per-token
                    # acceptance replay must advance its position too.
                    r.draw(0)
                    r.verifies += 1
                gap = now - r.last_token_s
                b = int(log(gap / itl_min) * itl_scale) if gap > itl_min else 0
                itl_hist[b if b < itl_top else itl_top] += 1
                if metrics is not None:
                    metrics.on_tokens(gap, 1)
                r.generated += 1
                r.kv_tokens += 1
                r.last_token_s = now
                if r.generated >= r.output_tokens:
                    done.append(r)
            emitted_total = len(running)
            if self.skip_zero:
                cfg = self.engine.config
                for r in running:
                    r.go_stale(cfg.cold_penalty, cfg.cold_recovery_verifies)  # type: ignore[misc]
        return accepted, emitted_total, done

    # ---- the result ----

    def close_series(self) -> None:
        """Sample the last, partial interval."""
        self._flush_samples(self.now + self.sampler.interval_s)

    def result(self) -> EngineResult:
        ledger = self.ledger
        return EngineResult(
            completed=ledger.completed,
            aborted=ledger.aborted,
            output_tokens=ledger.output_tokens,
            first_arrival_s=self.first_arrival_s,
            end_s=self.now,
            ttft_s=ledger.ttft_s,
            tpot_s=ledger.tpot_s,
            e2e_s=ledger.e2e_s,
            queue_s=ledger.queue_s,
            req_output_tokens=ledger.req_output_tokens,
            req_arrival_s=ledger.req_arrival_s,
            itl_hist=ledger.itl_hist,
            decode_batches=self.decode_batches,
            prefill_batches=self.prefill_batches,
            decode_time_s=self.decode_time,
            prefill_time_s=self.prefill_time,
            verify_calls=self.verify_calls,
            accepted_drafts=self.accepted_total,
            verified_requests=self.verified_requests,
            retractions=self.retractions,
            tier_switches=self.tier_switches,
            kv_peak_tokens=self.kv_peak,
            kv_token_capacity=self.capacity,
            steps_hist=self.steps_hist,
            batch_size_hist=self.bs_hist,
            series=self.sampler.series,
            events=self.events,
            prefill_tokens=self.prefill_tokens,
            cache_hit_tokens=self.cache_hit,
            cache_lookup_tokens=self.cache_lookup,
            cache_evicted_tokens=0 if self.cache is None else self.cache.evicted_tokens,
            cache_hit_host_tokens=self.cache_hit_host,
            hicache_token_capacity=0 if self.cache is None else self.cache.host_token_capacity,
            cache_host_evicted_tokens=0 if self.cache is None else self.cache.host_evicted_tokens,
            hicache_load_s=self.hicache_load_s,
        )
