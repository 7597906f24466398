"""The decode side of the scheduler loop (``Run`` in ``specgov.simulator.engine.core``):
step choice (the oracle's view, the policy's step, tier switches), retraction when the KV
pool runs dry (SGLang's ``retract_decode``), the decode forward, acceptance draws and token
emission, and the per-slot step counts.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from specgov.simulator.engine.requests import ITL_MIN_S, ITL_SCALE, ITL_TOP, RequestState
from specgov.simulator.engine.series import report_slot
from specgov.simulator.engine.sglang_metrics import DecodeStep

if TYPE_CHECKING:
    from specgov.simulator.engine.core import Run

__all__ = ["RETRACT_DECODE_STEPS", "decode"]

# SGLang's constant for re-estimating new_token_ratio after a retraction (0.5.23).
RETRACT_DECODE_STEPS = 20


def _switch_steps(run: Run, step: int) -> None:
    run.engine.check_step(step)
    run.current_steps = step
    run.tier_switches += 1
    run.switch_stall_s += run.switch_s


def _choose_steps(run: Run, bsz: int) -> int:
    """activate_step_by_batch: the oracle sees the batch, the policy picks its step."""
    oracle = run.oracle
    if oracle is not None:
        running = run.running
        oracle.observe_batch(
            [r.peek for r in running],  # type: ignore[misc]
            [r.output_tokens - r.generated for r in running],
            run.in_use_tokens(),
            [r.domain for r in running],
        )
    policy = run.policy
    if policy is not None:
        target = policy.get_steps_for_batch(bsz)
        if target != run.current_steps:
            _switch_steps(run, target)
    return run.current_steps


def _retract(run: Run, per_req: int) -> None:
    """retract_decode: keep the longest-decoded; pop fewest outputs, then longest
    input, until the step fits (keep at least one); re-estimate new_token_ratio."""
    running = run.running
    running.sort(key=lambda q: (q.generated, -q.input_tokens), reverse=True)
    retracted_now: list[RequestState] = []
    capacity = run.capacity
    kv_used = run.kv_used
    record = run.record
    cache = run.cache
    # With the cache, only pinned blocks are in the way: the rest is evicted below.
    pinned = 0 if cache is None else cache.pinned_tokens
    while len(running) > 1 and capacity - kv_used - pinned < len(running) * per_req:
        q = running.pop()
        kv_used -= q.kv_tokens
        q.kv_tokens = 0
        if q.cache_nodes:
            cache.unpin(q.cache_nodes, run.now)  # type: ignore[union-attr]
            q.cache_nodes = []
            pinned = cache.pinned_tokens  # type: ignore[union-attr]
        q.prefilled = 0
        q.prefill_target = q.input_tokens + q.generated
        q.retracted += 1
        retracted_now.append(q)
        if record:
            run.events.append((run.now, "retract", q.index, q.generated))
    run.kv_used = kv_used
    if cache is not None:
        short = len(running) * per_req - (capacity - kv_used - cache.total_tokens)
        if short > 0:
            cache.evict(short)
    run.retractions += len(retracted_now)
    if run.metrics is not None:
        run.metrics.on_retract(len(retracted_now))
    # Re-queued at the front, in their original order.
    waiting = run.waiting
    for q in sorted(retracted_now, key=lambda q: q.index, reverse=True):
        waiting.appendleft(q)
    dec = 0
    mx = 0
    for q in running:
        dec += q.generated
        mx += q.output_tokens
    run.new_token_ratio = min(1.0, (dec + RETRACT_DECODE_STEPS * len(running)) / (mx + 1))


def decode(run: Run) -> None:
    """One decode forward over every running request, retracting first when the
    KV pool cannot hold the step's verified tokens."""
    bsz, k = _fit_step(run)
    cache = run.cache
    kv_used = run.kv_used
    dt = run.decode_step_s(bsz, k, kv_used)
    if run.switch_stall_s:
        # The switches since the last forward stall this one (decode GPU time).
        dt += run.switch_stall_s
        run.switch_stall_s = 0.0
    start = run.now
    now = start + dt
    run.now = now
    run.vclock.now_s = now
    run.decode_time += dt
    run.decode_batches += 1
    bs_hist = run.bs_hist
    bs_hist[bsz] = bs_hist.get(bsz, 0) + 1
    sampler = run.sampler
    sampler.bs_time += bsz * dt
    sampler.busy_s += dt
    accepted, emitted_total, done = _verify(run, k, now)
    kv_used += emitted_total
    run.kv_used = kv_used
    used = kv_used if cache is None else kv_used + cache.pinned_tokens
    if used > run.kv_peak:
        run.kv_peak = used
    sampler.tokens += emitted_total
    _count_steps(run, bsz, k)
    if run.record:
        run.events.append((start, "decode", bsz, k))
    policy = run.policy
    if policy is not None:
        run.verify_calls += 1
        run.verified_requests += bsz
        ret = policy.on_verify_complete(accepted, bsz)
        if ret is not None and ret != run.current_steps:
            _switch_steps(run, ret)
    if run.metrics is not None:
        run.metrics.on_decode(
            DecodeStep(
                now_s=now,
                running=bsz,
                queued=len(run.waiting),
                used_tokens=used,
                capacity_tokens=run.capacity,
                steps=k,
                emitted_tokens=emitted_total,
                verified_requests=bsz if policy is not None else 0,
                step_s=dt,
            )
        )
    stepped = run.running
    if done:
        for r in done:
            kv_used -= run.finish(r, now)
        run.kv_used = kv_used
        done_set = set(map(id, done))
        run.running = [r for r in run.running if id(r) not in done_set]
    if run.live is not None:
        run.live.emitted(now, stepped)
    run.new_token_ratio = max(run.new_token_ratio - run.ratio_decay, run.min_ratio)
    if now >= sampler.next_sample_s:
        run.flush_samples(now)


def _fit_step(run: Run) -> tuple[int, int]:
    """The batch size and step of the next decode forward: the policy's step, and
    when the pool cannot hold its verified tokens, cached blocks evicted first
    (check_decode_mem), then requests retracted and the step chosen again."""
    bsz = len(run.running)
    run.vclock.now_s = run.now
    k = _choose_steps(run, bsz)
    per_req = run.verify_tokens(k)
    cache = run.cache
    if cache is not None:
        # check_decode_mem: evict unpinned cached blocks before retracting anyone.
        short = bsz * per_req - (run.capacity - run.kv_used - cache.total_tokens)
        if short > 0:
            cache.evict(short)
        room = run.capacity - run.kv_used - cache.total_tokens
    else:
        room = run.capacity - run.kv_used
    if room < bsz * per_req and bsz > 1:
        _retract(run, per_req)
        bsz = len(run.running)
        k = _choose_steps(run, bsz)
    return bsz, k


def _count_steps(run: Run, bsz: int, k: int) -> None:
    """Count a step-*k* forward of *bsz* requests in the histogram and the sampler,
    per slot of the policy's layout."""
    sampler = run.sampler
    slot = run.slot_of_bsz.get(bsz)
    if slot is None:
        slot = run.slot_of_bsz[bsz] = report_slot(bsz, run.graph_bs, sampler.slots)
    key = (slot, k)
    steps_hist = run.steps_hist
    steps_hist[key] = steps_hist.get(key, 0) + 1
    sampler.steps_sum[slot] += k
    sampler.steps_n[slot] += 1


def _verify(run: Run, k: int, now: float) -> tuple[list[int], int, list[RequestState]]:
    """Acceptance draws and token emission for a step-*k* forward ending at *now*.

    Returns the accepted drafts per request (what on_verify_complete gets), the
    tokens emitted and the requests that finished. The per-request loops.
    """
    running = run.running
    metrics = run.metrics
    itl_hist = run.ledger.itl_hist
    log = math.log
    itl_min = ITL_MIN_S
    itl_scale = ITL_SCALE
    itl_top = ITL_TOP
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
        run.accepted_total += acc_sum
    else:
        accepted = [0] * len(running) if run.policy is not None else []
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
        if run.skip_zero:
            cfg = run.engine.config
            for r in running:
                r.go_stale(cfg.cold_penalty, cfg.cold_recovery_verifies)  # type: ignore[misc]
    return accepted, emitted_total, done
