"""What a policy sees: one :class:`Observation` of the server (load, latencies, the
table in force, the tier statistics), with None for every series that is unknown."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from specgov.policies.common.step_table import StepTable
from specgov.policies.common.types import (
    PolicyTypeError,
    SlotLayout,
    SpecShape,
    TierStatsSnapshot,
)
from specgov.policies.common.validation import (
    check_fields,
    check_opt_int,
    check_opt_real,
    check_real,
    is_int,
)

# The counts (ints >= 0) and amounts (finite numbers >= 0) an observation may leave
# unknown (None); the load's counts are also a LoadSnapshot's.
_LOAD_COUNTS: Final = ("running_requests", "queued_requests", "kv_capacity_tokens")
_COUNTS: Final = (
    "generation_tokens",
    "verify_calls",
    "retractions",
    "finished_requests",
    "spec_num_steps",
    *_LOAD_COUNTS,
)
_AMOUNTS: Final = (
    "window_s",
    "token_usage",
    "gen_throughput_tok_s",
    "accept_length",
    "staleness_s",
)


@dataclass(frozen=True, slots=True)
class LoadSnapshot:
    """Server load at one instant; None means the series is unknown."""

    running_requests: int | None
    queued_requests: int | None
    token_usage: float | None
    kv_capacity_tokens: int | None

    def __post_init__(self) -> None:
        check_fields(
            "LoadSnapshot", self, _LOAD_COUNTS, check_opt_int, error=PolicyTypeError, minimum=0
        )
        check_opt_real(
            "LoadSnapshot.token_usage", self.token_usage, error=PolicyTypeError, minimum=0.0
        )


@dataclass(frozen=True, slots=True)
class LatencyQuantiles:
    """Latency quantiles over a window, in milliseconds; None means unknown."""

    p50_ms: float | None = None
    p90_ms: float | None = None
    p99_ms: float | None = None

    def __post_init__(self) -> None:
        known: list[tuple[str, float]] = []
        for name in ("p50_ms", "p90_ms", "p99_ms"):
            value = getattr(self, name)
            check_opt_real(f"LatencyQuantiles.{name}", value, error=PolicyTypeError, minimum=0.0)
            if value is not None:
                known.append((name, value))
        for (lo_name, lo), (hi_name, hi) in itertools.pairwise(known):
            if hi < lo:
                raise PolicyTypeError.bad(
                    f"LatencyQuantiles.{hi_name}", f"expected >= {lo_name}={lo}", hi
                )


@dataclass(frozen=True, slots=True)
class Observation:
    """One snapshot a policy sees. Missing or stale series are None, never 0."""

    time_s: float
    running_requests: int | None = None
    queued_requests: int | None = None
    token_usage: float | None = None
    kv_capacity_tokens: int | None = None
    gen_throughput_tok_s: float | None = None
    accept_length: float | None = None
    ttft_ms: LatencyQuantiles | None = None
    itl_ms: LatencyQuantiles | None = None
    tpot_ms: LatencyQuantiles | None = None
    shape: SpecShape | None = None
    table: StepTable | None = None
    tier_stats: TierStatsSnapshot | None = None
    staleness_s: float | None = None
    # Window the rates and quantiles above cover (seconds), and its counter deltas.
    window_s: float | None = None
    generation_tokens: int | None = None  # Δ sglang:generation_tokens_total
    verify_calls: int | None = None  # Δ sglang:spec_verify_calls_total
    retractions: int | None = None  # Δ sglang:num_retracted_requests_total
    finished_requests: int | None = None  # Δ sglang:num_requests_total (requests done)
    e2e_ms: LatencyQuantiles | None = None
    spec_num_steps: int | None = None  # the sglang:spec_num_steps gauge (aged)
    # Per slot lower bound, the steps the engine captured for it (its adaptive
    # config's candidate_steps); a published table must stay inside these.
    slot_candidates: SlotLayout | None = None

    def __post_init__(self) -> None:
        check_real("Observation.time_s", self.time_s, error=PolicyTypeError)
        check_fields("Observation", self, _COUNTS, check_opt_int, error=PolicyTypeError, minimum=0)
        check_fields(
            "Observation", self, _AMOUNTS, check_opt_real, error=PolicyTypeError, minimum=0.0
        )
        if self.slot_candidates is not None:
            bounds = [b for b, _ in self.slot_candidates]
            if bounds != sorted(set(bounds)) or any(
                not steps or any(not is_int(k) or k < 0 for k in steps)
                for _, steps in self.slot_candidates
            ):
                raise PolicyTypeError.bad(
                    "Observation.slot_candidates",
                    "sorted unique slot bounds, each with a non-empty tuple of steps >= 0",
                    self.slot_candidates,
                )
        check_opt_int(
            "Observation.running_requests", self.running_requests, error=PolicyTypeError, minimum=0
        )
        check_opt_int(
            "Observation.queued_requests", self.queued_requests, error=PolicyTypeError, minimum=0
        )
        check_opt_real(
            "Observation.token_usage", self.token_usage, error=PolicyTypeError, minimum=0.0
        )
        check_opt_int(
            "Observation.kv_capacity_tokens",
            self.kv_capacity_tokens,
            error=PolicyTypeError,
            minimum=0,
        )
        check_opt_real(
            "Observation.gen_throughput_tok_s",
            self.gen_throughput_tok_s,
            error=PolicyTypeError,
            minimum=0.0,
        )
        check_opt_real(
            "Observation.accept_length", self.accept_length, error=PolicyTypeError, minimum=0.0
        )
        check_opt_real(
            "Observation.staleness_s", self.staleness_s, error=PolicyTypeError, minimum=0.0
        )
        optional_types: Sequence[tuple[str, type]] = (
            ("ttft_ms", LatencyQuantiles),
            ("itl_ms", LatencyQuantiles),
            ("tpot_ms", LatencyQuantiles),
            ("e2e_ms", LatencyQuantiles),
            ("shape", SpecShape),
            ("table", StepTable),
            ("tier_stats", TierStatsSnapshot),
        )
        for name, cls in optional_types:
            value = getattr(self, name)
            if value is not None and not isinstance(value, cls):
                raise PolicyTypeError.bad(
                    f"Observation.{name}", f"expected None or a {cls.__name__}", value
                )

    @property
    def load(self) -> LoadSnapshot:
        return LoadSnapshot(
            running_requests=self.running_requests,
            queued_requests=self.queued_requests,
            token_usage=self.token_usage,
            kv_capacity_tokens=self.kv_capacity_tokens,
        )
