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

from specgov.simulator.engine import decode, prefill
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
    RequestLedger,
    RequestState,
)
from specgov.simulator.engine.requests import itl_bin_value as itl_bin_value
from specgov.simulator.engine.series import REPORT_SLOTS as REPORT_SLOTS
from specgov.simulator.engine.series import IntervalSampler, slot_layout
from specgov.simulator.engine.series import TimeSeries as TimeSeries
from specgov.simulator.engine.sglang_metrics import FinishedRequest

if TYPE_CHECKING:
    from specgov.policies.engine.protocol import AdaptiveSpecPolicy
    from specgov.simulator.engine.live import LiveSource
    from specgov.simulator.engine.sglang_metrics import SimMetrics
    from specgov.simulator.workload.traces import Request

# SGLang constants (environ.py / schedule_policy.py, 0.5.23); the admission clip and the
# retraction constant live with their users (engine/prefill.py, engine/decode.py).
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO_FACTOR = 0.14
NEW_TOKEN_RATIO_DECAY_STEPS = 600


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
            self.check_step(start)
            self.initial_steps = start
        else:
            self.initial_steps = 0

    def check_step(self, step: int) -> None:
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
            st.schedule()
        st.close_series()
        if progress is not None:
            progress(ledger.completed + ledger.aborted, n_total)
        return st.result()


class Run:
    """The state of one ``Engine.run`` and the steps of its scheduler loop.

    One method per concern of SGLang's loop: admission (arrivals, closed-loop
    users), ticks, prefill batch formation, prefill, decode (step choice,
    retraction, verify and token emission), finishing. Prefill and decode are
    functions of the run in ``engine/prefill.py`` and ``engine/decode.py`` (the
    methods here call them). Methods work at batch granularity; the per-request
    loops inside them bind what they use to locals.
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
        self.abort(r)

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
        self.flush_samples(target)
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
        self.flush_samples(self.now)
        return True

    def flush_samples(self, upto_s: float) -> None:
        self.sampler.flush(
            upto_s, len(self.waiting), len(self.running), self.in_use_tokens(), self.capacity
        )

    def in_use_tokens(self) -> int:
        """KV tokens in use: requests' own plus the cached blocks they pin (evictable
        cached blocks count as free, as SGLang's num_used_tokens counts them)."""
        cache = self.cache
        return self.kv_used if cache is None else self.kv_used + cache.pinned_tokens

    # ---- request ends ----

    def abort(self, r: RequestState) -> None:
        self.ledger.aborted += 1
        if self.live is not None and self.live_states.pop(r.index, None) is not None:
            self.live.rejected(r.index - LIVE_INDEX_BASE, "the request can never fit the KV pool")
        if self.concurrency is not None:
            self._next_user_request(self.now)
        if self.record:
            self.events.append((self.now, "abort", r.index, 0))

    def schedule(self) -> None:
        """One scheduler iteration with work: a prefill batch when one forms (SGLang
        prefers prefill), else a decode of the running batch, else nothing can run."""
        batch = self.form_prefill_batch()
        if batch:
            self.run_prefill(batch)
        elif self.running:
            self.decode()
        else:
            self.abort_stuck()

    def abort_stuck(self) -> None:
        """Nothing decodes and nothing could be prefilled: the head of the queue can
        never be admitted (the abort rule of prefill formation covers the usual case;
        this guards against a stuck loop)."""
        if self.waiting:
            self.abort(self.waiting.popleft())

    def finish(self, r: RequestState, t: float) -> int:
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
                FinishedRequest(
                    prompt_tokens=r.input_tokens,
                    generation_tokens=r.generated,
                    verify_calls=r.verifies,
                    e2e_s=t - r.arrival_s,
                    tpot_s=tpot,
                )
            )
        if self.record:
            self.events.append((t, "finish", r.index, r.generated))
        if self.live_states:
            self.live_states.pop(r.index, None)
        return kv

    # ---- prefill (has priority, as in get_next_batch_to_run): engine/prefill.py ----

    def form_prefill_batch(self) -> list[tuple[RequestState, int]]:
        """get_new_batch_prefill: (request, tokens to prefill now) pairs
        (``specgov.simulator.engine.prefill.form_prefill_batch``)."""
        return prefill.form_prefill_batch(self)

    def run_prefill(self, batch: list[tuple[RequestState, int]]) -> None:
        """One prefill forward (``specgov.simulator.engine.prefill.run_prefill``)."""
        prefill.run_prefill(self, batch)

    # ---- decode: engine/decode.py ----

    def decode(self) -> None:
        """One decode forward over every running request
        (``specgov.simulator.engine.decode.decode``)."""
        decode.decode(self)

    # ---- the result ----

    def close_series(self) -> None:
        """Sample the last, partial interval."""
        self.flush_samples(self.now + self.sampler.interval_s)

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
