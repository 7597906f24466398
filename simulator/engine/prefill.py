"""The prefill side of the scheduler loop (``Run`` in ``specgov.simulator.engine.core``):
prefill batch formation (SGLang's ``get_new_batch_prefill``: FCFS admission bounded by the
running cap, the chunk budget and the KV left after running requests' reservations, with
or without the prefix cache) and the prefill forward with its token emission.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from specgov.simulator.engine.requests import ITL_MIN_S, ITL_SCALE, ITL_TOP, RequestState

if TYPE_CHECKING:
    from specgov.simulator.engine.core import Run

__all__ = ["CLIP_MAX_NEW_TOKENS", "form_prefill_batch", "run_prefill"]

# SGLang's clip on a running request's remaining output in admission (environ.py, 0.5.23).
CLIP_MAX_NEW_TOKENS = 4096


def form_prefill_batch(run: Run) -> list[tuple[RequestState, int]]:
    """get_new_batch_prefill: (request, tokens to prefill now) pairs.

    The chunked request's next chunk first, then FCFS admission bounded by the
    running cap, the chunk token budget and the KV left once running requests'
    reservations (``min(remaining, 4096) * new_token_ratio``) are set aside. A
    request that can never fit, even alone, is aborted.
    """
    batch: list[tuple[RequestState, int]] = []
    budget = run.chunk_budget
    chunked = run.chunked
    running = run.running
    waiting = run.waiting
    running_cap = run.running_cap
    if chunked is not None:
        take = min(chunked.prefill_target - chunked.prefilled, budget)
        batch.append((chunked, take))
        budget -= take
    if waiting and budget > 0 and len(running) + len(batch) < running_cap:
        if run.cache is not None:
            _admit_cached(run, batch, budget)
            return batch
        new_token_ratio = run.new_token_ratio
        kv_used = run.kv_used
        rem_total = run.capacity - kv_used - _reserved_decode_tokens(run)
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
                    run.abort(r)
                    continue
                break
            waiting.popleft()
            take = need if need < budget else budget
            batch.append((r, take))
            budget -= take
            rem_total -= total
    return batch


def _reserved_decode_tokens(run: Run) -> float:
    """KV the running requests may still need: their remaining outputs (each clipped
    at CLIP_MAX_NEW_TOKENS) times the new-token ratio (SGLang's admission estimate)."""
    reserved = 0.0
    for r in run.running:
        rem = r.output_tokens - r.generated
        reserved += rem if rem < CLIP_MAX_NEW_TOKENS else CLIP_MAX_NEW_TOKENS
    return reserved * run.new_token_ratio


def _admit_cached(run: Run, batch: list[tuple[RequestState, int]], budget: int) -> None:
    """FCFS admission with the prefix cache (``form_prefill_batch``'s loop): each
    request reuses its longest cached prefix, pins it and needs KV for the rest.

    Evictable cached blocks count as free (SGLang's ``rem_total_tokens`` adds
    ``evictable_size``); pinning a reused block takes it out of that pool.
    """
    cache = run.cache
    assert cache is not None
    chunked = run.chunked
    running = run.running
    waiting = run.waiting
    running_cap = run.running_cap
    new_token_ratio = run.new_token_ratio
    kv_used = run.kv_used
    rem_total = run.capacity - kv_used - cache.pinned_tokens - _reserved_decode_tokens(run)
    if chunked is not None:
        rem_total -= chunked.prefill_target - chunked.prefilled
    now = run.now
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
                run.abort(r)
                continue
            break
        waiting.popleft()
        if path:
            host = cache.host_only_tokens(path)
            if host:
                run.batch_load_tokens += host
                # Reused tokens past the device part came from the host tier.
                host_hit = cached - (cache.path_tokens(path) - host)
                if host_hit > 0 and r.retracted == 0:
                    run.cache_hit_host += host_hit
            cache.pin(path)
            r.cache_nodes = list(path)
        r.cached = cached
        r.prefilled += cached  # reused: counts as prefilled, charged as prefix
        if r.retracted == 0:
            # SGLang's hit rate: first attempts only (re-prefills are "reprocessed").
            run.cache_hit += cached
            run.cache_lookup += r.input_tokens
            run.batch_cache_hit += cached
        take = need if need < budget else budget
        batch.append((r, take))
        budget -= take
        rem_total -= total + pin_cost


def run_prefill(run: Run, batch: list[tuple[RequestState, int]]) -> None:
    """One prefill forward; decoding requests stall meanwhile. Requests whose
    prefill completes emit their next token and join the running batch."""
    now, dt = _prefill_forward(run, batch)
    metrics = run.metrics
    cache = run.cache
    chunked = None
    running = run.running
    record = run.record
    events = run.events
    queue = run.ledger.queue_s
    itl_hist = run.ledger.itl_hist
    log = math.log
    itl_min = ITL_MIN_S
    itl_scale = ITL_SCALE
    itl_top = ITL_TOP
    kv_used = run.kv_used
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
            kv_used -= run.finish(r, now)
        else:
            running.append(r)
    run.chunked = chunked
    run.sampler.tokens += tokens
    run.kv_used = kv_used
    if run.live is not None:
        run.live.emitted(now, [r for r, _ in batch])
    used = kv_used if cache is None else kv_used + cache.pinned_tokens
    if used > run.kv_peak:
        run.kv_peak = used
    if now >= run.sampler.next_sample_s:
        run.flush_samples(now)


def _prefill_forward(run: Run, batch: list[tuple[RequestState, int]]) -> tuple[float, float]:
    """The prefill forward's time (compute or load-back copies, the longer) and the
    cache room it needs; returns the time it ends and its duration."""
    new_tokens = 0
    prefix = 0
    for r, take in batch:
        new_tokens += take
        prefix += r.prefilled
    dt = run.prefill_s(new_tokens, prefix)
    if run.batch_load_tokens:
        # Load-back copies overlap the forward layer by layer (module docstring).
        load_s = run.batch_load_tokens * run.engine.config.hicache_load_s_per_token
        run.hicache_load_s += load_s
        run.batch_load_tokens = 0
        if load_s > dt:
            dt = load_s
    now = run.now + dt
    run.now = now
    run.prefill_time += dt
    run.prefill_tokens += new_tokens
    metrics = run.metrics
    if metrics is not None:
        metrics.on_prefill(new_tokens, dt)
    cache = run.cache
    if cache is not None:
        # Room for the new tokens: evict unpinned cached blocks, LRU first (admission
        # counted them as free).
        free = run.capacity - run.kv_used - cache.total_tokens
        if new_tokens > free:
            cache.evict(new_tokens - free)
        if metrics is not None:
            # SGLang's per-prefill-batch gauge: hits / (hits + computed), first
            # attempts only.
            first = sum(take for r, take in batch if r.retracted == 0)
            metrics.on_prefix_cache(run.batch_cache_hit, first)
        run.batch_cache_hit = 0
    run.prefill_batches += 1
    return now, dt
