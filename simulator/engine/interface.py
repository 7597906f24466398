"""What the discrete-event engine takes and gives: its settings (``EngineConfig``), the
protocols of its injected collaborators (cost model, acceptance samplers, the oracle), the
virtual clock it shares with in-engine policies, and what one run measured
(``EngineResult``). The engine itself: ``specgov.simulator.engine.core``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from specgov.policies.common.errors import SpecgovError
from specgov.policies.common.validation import check_fields, check_int, check_opt_int, check_real
from specgov.simulator.engine.series import TimeSeries

__all__ = [
    "BatchOracle",
    "EngineConfig",
    "EngineConfigError",
    "EngineResult",
    "PeekableSampler",
    "Sampler",
    "SamplerFactory",
    "SkipZeroStepCost",
    "StaleableSampler",
    "StepCost",
    "VirtualClock",
    "sglang_decode_cuda_graph_bs",
]


class StepCost(Protocol):
    """What the engine needs from a cost model (seconds)."""

    def decode_step_s(self, batch_size: int, steps: int, kv_tokens: int) -> float: ...

    def prefill_s(self, new_tokens: int, prefix_kv_tokens: int) -> float: ...


class Sampler(Protocol):
    def draw(self, steps: int) -> int: ...


@runtime_checkable
class SkipZeroStepCost(Protocol):
    """A cost model that can say what the step-0 draft-extend pass costs (the part
    ``SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND`` saves)."""

    def draft_extend_pass_s(self, batch_size: float, steps: int, kv_tokens: float) -> float: ...


@runtime_checkable
class StaleableSampler(Protocol):
    """A sampler whose drafter state can go stale (see ``acceptance_cold.ColdDrafter``)."""

    def draw(self, steps: int) -> int: ...

    def go_stale(self, penalty: float, verifies: int) -> None: ...


@runtime_checkable
class PeekableSampler(Protocol):
    """A sampler that can tell its next draw without consuming it (for the oracle)."""

    def draw(self, steps: int) -> int: ...

    def peek(self, steps: int) -> int: ...


@runtime_checkable
class BatchOracle(Protocol):
    """An in-engine policy allowed to see each running request's true next acceptance.

    Benchmarks only (``specgov.simulator.replay.oracle``): the engine binds its cost model,
    config and acceptance model once, then before every ``get_steps_for_batch`` hands
    over, per running request, ``peek(steps)`` (the accepted drafts its next verify would
    get), the output tokens it still has to generate and its domain, plus the KV tokens
    in use.
    """

    def bind_engine(self, cost: StepCost, config: EngineConfig, acceptance: object) -> None: ...

    def observe_batch(
        self,
        peeks: Sequence[Callable[[int], int]],
        remaining_tokens: Sequence[int],
        kv_used_tokens: int,
        domains: Sequence[str | None],
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


class EngineConfigError(SpecgovError, ValueError):
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
    # SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND (0.5.23, experimental): step-0 verifies skip
    # the draft-extend pass (cheaper), and requests that went through them draft cold
    # after an upshift: the first drafted verify accepts nothing (zeroed stubs), then
    # accepted drafts are cut by cold_penalty, recovering linearly over
    # cold_recovery_verifies verifies. 0.146: vLLM #53426's measured 14.6 % lower
    # acceptance after resuming with stale drafter state (DFlash drafter; assumed to
    # carry over to EAGLE-3 in SGLang); 16 verifies: assumed (no public figure).
    skip_zero_step_draft_extend: bool = False
    cold_penalty: float = 0.146
    cold_recovery_verifies: int = 16
    # SGLang's radix cache; False is its --disable-radix-cache (module docstring).
    prefix_cache: bool = True
    # Host tier (HiCache) tokens; 0: none. Load-back seconds per token (PCIe).
    hicache_token_capacity: int = 0
    hicache_load_s_per_token: float = 0.0
    # GPU time one tier switch (a change of the runtime state's step count) stalls the
    # next decode forward (the drafter catalog's tier_switch_ms; default 0: free).
    tier_switch_s: float = 0.0

    def __post_init__(self) -> None:
        where, error = "EngineConfig", EngineConfigError
        counts = ("kv_token_capacity", "chunked_prefill_size", "topk", "cold_recovery_verifies")
        check_fields(where, self, counts, check_int, error=error, minimum=1)
        caps = ("max_running_requests", "cuda_graph_max_bs")  # None: SGLang's default / none
        check_fields(where, self, caps, check_opt_int, error=error, minimum=1)
        check_fields(where, self, ("hicache_token_capacity",), check_int, error=error, minimum=0)
        check_fields(where, self, ("sample_interval_s",), check_real, error=error, positive=True)
        check_fields(
            where, self, ("cold_penalty",), check_real, error=error, minimum=0.0, maximum=1.0
        )
        seconds = ("hicache_load_s_per_token", "tier_switch_s")
        check_fields(where, self, seconds, check_real, error=error, minimum=0.0)
        if self.topk > 1 and (self.num_draft_tokens is None or self.num_draft_tokens < 2):
            raise EngineConfigError(
                f"num_draft_tokens must be >= 2 with topk={self.topk}, got {self.num_draft_tokens}"
            )
        if self.hicache_token_capacity and not self.prefix_cache:
            raise EngineConfigError(
                "a hierarchical cache needs the radix cache (prefix_cache=True), as SGLang's "
                "--enable-hierarchical-cache does"
            )

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
    steps_hist: dict[tuple[int, int], int]  # (policy's slot, steps) -> decode batches
    batch_size_hist: dict[int, int]
    series: TimeSeries
    events: list[tuple[float, str, int, int]]
    prefill_tokens: int = 0  # tokens prefill forwards computed (cached prefixes excluded)
    # Prefix cache, first admissions only (re-prefills after a retraction excluded, as
    # SGLang's hit rate excludes them): prompt tokens reused / looked up.
    cache_hit_tokens: int = 0
    cache_lookup_tokens: int = 0
    cache_evicted_tokens: int = 0
    # Host tier (HiCache): hits served from it (loaded back), its capacity, its
    # evictions and the PCIe seconds spent loading back.
    cache_hit_host_tokens: int = 0
    hicache_token_capacity: int = 0
    cache_host_evicted_tokens: int = 0
    hicache_load_s: float = 0.0

    @property
    def prefix_cache_hit_rate_host(self) -> float:
        """Reused prompt tokens that came from the host tier / looked-up tokens."""
        if self.cache_lookup_tokens <= 0:
            return 0.0
        return self.cache_hit_host_tokens / self.cache_lookup_tokens

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Reused / looked-up prompt tokens (SGLang's cache_hit_rate, whole run, both
        tiers); 0 when nothing was looked up (no cache, or no request with block ids)."""
        if self.cache_lookup_tokens <= 0:
            return 0.0
        return self.cache_hit_tokens / self.cache_lookup_tokens
