"""Per-request state and bookkeeping of one engine run.

``RequestState`` is the mutable state of one request on the engine's hot path;
``RequestLedger`` collects what finished requests measured (TTFT, TPOT, E2E,
queueing, the token-weighted ITL histogram) and the completion/abort counts.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from specgov.simulator.engine.prefix_cache import CacheNode
    from specgov.simulator.workload.traces import Request

# ITL histogram: log-spaced bins, 1 % wide, from 1 µs to ~1000 s.
ITL_MIN_S = 1e-6
ITL_LOG_STEP = math.log(1.01)
ITL_BINS = int(math.log(1e9) / ITL_LOG_STEP) + 2
# Binning a gap: bin = int(log(gap / ITL_MIN_S) * ITL_SCALE), capped at ITL_TOP.
ITL_SCALE = 1.0 / ITL_LOG_STEP
ITL_TOP = ITL_BINS - 1


def itl_bin_value(index: int) -> float:
    """Representative value (seconds) of ITL histogram bin *index*."""
    return ITL_MIN_S * math.exp((index + 0.5) * ITL_LOG_STEP)


class RequestState:
    """Mutable per-request state on the engine's hot path."""

    __slots__ = (
        "arrival_s",
        "cache_nodes",
        "cached",
        "domain",
        "draw",
        "first_token_s",
        "generated",
        "go_stale",
        "hash_ids",
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
        # Set when the engine skips the step-0 draft-extend pass (the drafter goes stale).
        self.go_stale: Callable[[float, int], None] | None = None
        self.generated = 0
        self.kv_tokens = 0
        self.prefilled = 0
        self.prefill_target = request.input_tokens
        self.first_token_s = -1.0
        self.last_token_s = -1.0
        self.retracted = 0
        self.verifies = 0
        # Prefix cache (engine with a PrefixCache only): the prompt's block ids, the
        # cached blocks this request pins, the prompt tokens it reused at admission.
        self.hash_ids = request.hash_ids
        self.cache_nodes: list[CacheNode] = []
        self.cached = 0


class RequestLedger:
    """What the run's requests measured, one entry per finished request (in finish order).

    The engine bins token gaps into ``itl_hist`` inline (the per-token loops stay
    local); ``finish`` records one completed request.
    """

    __slots__ = (
        "aborted",
        "completed",
        "e2e_s",
        "itl_hist",
        "output_tokens",
        "queue_s",
        "req_arrival_s",
        "req_output_tokens",
        "tpot_s",
        "ttft_s",
    )

    def __init__(self) -> None:
        self.completed = 0
        self.aborted = 0
        self.output_tokens = 0
        self.ttft_s: list[float] = []
        self.tpot_s: list[float] = []  # NaN for single-token requests
        self.e2e_s: list[float] = []
        self.queue_s: list[float] = []  # appended at first token, not at finish
        self.req_output_tokens: list[int] = []
        self.req_arrival_s: list[float] = []
        self.itl_hist = [0] * ITL_BINS

    def finish(self, r: RequestState, t: float) -> float | None:
        """Record *r* finishing at *t*; return its TPOT (None for a single-token request)."""
        self.completed += 1
        self.output_tokens += r.generated
        self.ttft_s.append(r.first_token_s - r.arrival_s)
        self.e2e_s.append(t - r.arrival_s)
        self.req_output_tokens.append(r.generated)
        self.req_arrival_s.append(r.arrival_s)
        if r.generated >= 2:
            v = (t - r.first_token_s) / (r.generated - 1)
            self.tpot_s.append(v)
            return v
        self.tpot_s.append(math.nan)
        return None
