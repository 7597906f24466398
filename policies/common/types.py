"""Core value types of specgov (DESIGN.md, "Core types"): the restart-level shape, the
operator's budget and the in-engine tier statistics, and the error they all raise.

Every type is a frozen, slotted dataclass that validates itself on construction and
raises :class:`PolicyTypeError` naming the bad field and the expected form. Missing
telemetry is ``None`` ("unknown"), never 0: a policy must be able to tell "no data"
from "zero". The other core types live by concern: the step table (``step_table``),
what a policy sees (``observation``) and what it answers (``decisions``).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Annotated, ClassVar, Final, TypeAlias

import msgspec

from specgov.policies.common.codec import NonNegInt, Versioned
from specgov.policies.common.errors import SpecgovError
from specgov.policies.common.validation import (
    check_fields,
    check_int,
    check_opt_real,
    check_real,
    is_int,
)

SCHEMA_VERSION: Final = 1

# The engine's slot layout, the one representation every layer uses: per batch-size
# slot, sorted by lower bound, (bound, candidate steps) -- the steps SGLang captured
# CUDA graphs for (its adaptive config's candidate_steps). The annotations are also its
# schema when it is saved (codec).
SlotLayout: TypeAlias = tuple[
    tuple[NonNegInt, Annotated[tuple[NonNegInt, ...], msgspec.Meta(min_length=1)]], ...
]

# Algorithms a restart recommendation may name (SGLang's --speculative-algorithm values
# specgov reasons about, plus NONE for "no speculation").
ALGORITHMS: Final = frozenset({"EAGLE", "EAGLE3", "NEXTN", "STANDALONE", "NGRAM", "NONE"})
# SGLang forces num_draft_tokens = num_steps + 1 when topk == 1 for the EAGLE family
# (arg_groups/speculative_hook.py, _handle_eagle_family); NGRAM sizes its drafts itself.
_EAGLE_FAMILY: Final = frozenset({"EAGLE", "EAGLE3", "NEXTN", "STANDALONE"})
# The sizes of a speculating shape (each >= 1) and the counts of a tier (each >= 0).
_SHAPE_SIZES: Final = ("num_steps", "topk", "num_draft_tokens")
_TIER_COUNTS: Final = ("slot", "steps", "verify_calls", "requests")


class PolicyTypeError(SpecgovError, ValueError):
    """A value handed to a specgov core type is malformed; the message names the field."""

    @classmethod
    def bad(cls, where: str, expected: str, got: object) -> PolicyTypeError:
        """The error for ``got`` at ``where``: ``"{where}: {expected}, got {got!r}"``."""
        return cls(f"{where}: {expected}, got {got!r}")


def _check_steps_tuple(where: str, value: object) -> None:
    """Sorted, unique, non-negative int steps (a tuple, so the value stays immutable)."""
    if (
        not isinstance(value, tuple)
        or not all(is_int(s) and s >= 0 for s in value)
        or any(a >= b for a, b in itertools.pairwise(value))
    ):
        raise PolicyTypeError.bad(
            where, "expected a tuple of strictly increasing non-negative ints", value
        )


# ------------------------------------------------------------------------ SpecShape


@dataclass(frozen=True, slots=True)
class SpecShape(Versioned):
    """Restart-level speculation shape: what SGLang can only change at launch."""

    # Nested in a recommendation it is in its own to_dict form, with "schema".
    CODEC_TOLERATED_KEYS: ClassVar[frozenset[str]] = frozenset({"schema"})
    # Versioned under "schema", as launch documents and recommendations carry it.
    CODEC_VERSION = SCHEMA_VERSION
    CODEC_VERSION_KEY = "schema"
    CODEC_ERROR = PolicyTypeError

    algorithm: str
    num_steps: int
    topk: int
    num_draft_tokens: int
    candidate_steps: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.algorithm not in ALGORITHMS:
            raise PolicyTypeError.bad(
                "SpecShape.algorithm", f"expected one of {sorted(ALGORITHMS)}", self.algorithm
            )
        _check_steps_tuple("SpecShape.candidate_steps", self.candidate_steps)
        if self.algorithm == "NONE":
            for name in _SHAPE_SIZES:
                value = getattr(self, name)
                if not is_int(value) or value != 0:
                    raise PolicyTypeError.bad(
                        f"SpecShape.{name}", "expected 0 when algorithm is NONE", value
                    )
            if self.candidate_steps:
                raise PolicyTypeError.bad(
                    "SpecShape.candidate_steps",
                    "expected () when algorithm is NONE",
                    self.candidate_steps,
                )
            return
        check_fields("SpecShape", self, _SHAPE_SIZES, check_int, error=PolicyTypeError, minimum=1)
        if (
            self.algorithm in _EAGLE_FAMILY
            and self.topk == 1
            and self.num_draft_tokens != self.num_steps + 1
        ):
            raise PolicyTypeError.bad(
                "SpecShape.num_draft_tokens",
                f"expected num_steps + 1 = {self.num_steps + 1} when topk == 1 (as SGLang forces)",
                self.num_draft_tokens,
            )


@dataclass(frozen=True, slots=True)
class Budget:
    """Operator limits every decision must respect."""

    vram_gib: float | None
    slo_tpot_ms: float | None
    slo_itl_p99_ms: float | None
    slo_ttft_p99_ms: float | None
    allowed_steps: tuple[int, ...] | None

    def __post_init__(self) -> None:
        for name in ("vram_gib", "slo_tpot_ms", "slo_itl_p99_ms", "slo_ttft_p99_ms"):
            check_opt_real(
                f"Budget.{name}",
                getattr(self, name),
                error=PolicyTypeError,
                minimum=0.0,
                positive=True,
            )
        if self.allowed_steps is not None:
            _check_steps_tuple("Budget.allowed_steps", self.allowed_steps)
            if not self.allowed_steps:
                raise PolicyTypeError.bad(
                    "Budget.allowed_steps", "expected None or a non-empty tuple", ()
                )


# ------------------------------------------------------------------------ TierStats


@dataclass(frozen=True, slots=True)
class TierStat:
    """What the in-engine policy saw for one (slot lower bound, steps) tier in a window.

    ``accepted_hist[j]`` is the number of requests that accepted exactly j drafts
    (bonus token excluded); its length is ``steps + 1``.
    """

    slot: int
    steps: int
    verify_calls: int
    requests: int
    accepted_hist: tuple[int, ...]
    step_time_sum_s: float
    step_time_count: int
    batch_size_sum: int

    def __post_init__(self) -> None:
        check_fields("TierStat", self, _TIER_COUNTS, check_int, error=PolicyTypeError, minimum=0)
        hist = self.accepted_hist
        if (
            not isinstance(hist, tuple)
            or len(hist) != self.steps + 1
            or not all(is_int(h) and h >= 0 for h in hist)
        ):
            raise PolicyTypeError.bad(
                "TierStat.accepted_hist",
                f"expected a tuple of {self.steps + 1} non-negative ints (steps + 1)",
                hist,
            )
        if sum(hist) != self.requests:
            raise PolicyTypeError.bad(
                "TierStat.accepted_hist",
                f"expected counts summing to requests={self.requests}",
                hist,
            )
        check_real(
            "TierStat.step_time_sum_s", self.step_time_sum_s, error=PolicyTypeError, minimum=0.0
        )
        check_int(
            "TierStat.step_time_count", self.step_time_count, error=PolicyTypeError, minimum=0
        )
        if self.step_time_count > self.verify_calls:
            raise PolicyTypeError.bad(
                "TierStat.step_time_count",
                f"expected <= verify_calls={self.verify_calls}",
                self.step_time_count,
            )
        check_int("TierStat.batch_size_sum", self.batch_size_sum, error=PolicyTypeError, minimum=0)

    @property
    def key(self) -> tuple[int, int]:
        return (self.slot, self.steps)

    @property
    def mean_accepted(self) -> float | None:
        """Mean accepted drafts per request, None when no request was seen."""
        if self.requests == 0:
            return None
        return sum(j * n for j, n in enumerate(self.accepted_hist)) / self.requests

    @property
    def mean_step_time_s(self) -> float | None:
        if self.step_time_count == 0:
            return None
        return self.step_time_sum_s / self.step_time_count


@dataclass(frozen=True, slots=True)
class TierStatsSnapshot(Versioned):
    """Per-tier statistics recorded in one window [window_start_s, window_end_s]."""

    # Versioned under "schema": the spool's stats file, read by another process.
    CODEC_VERSION = SCHEMA_VERSION
    CODEC_VERSION_KEY = "schema"
    CODEC_ERROR = PolicyTypeError

    window_start_s: float
    window_end_s: float
    tiers: tuple[TierStat, ...]

    def __post_init__(self) -> None:
        check_real("TierStatsSnapshot.window_start_s", self.window_start_s, error=PolicyTypeError)
        check_real("TierStatsSnapshot.window_end_s", self.window_end_s, error=PolicyTypeError)
        if self.window_end_s < self.window_start_s:
            raise PolicyTypeError.bad(
                "TierStatsSnapshot.window_end_s",
                f"expected >= window_start_s={self.window_start_s}",
                self.window_end_s,
            )
        if not isinstance(self.tiers, tuple) or not all(
            isinstance(t, TierStat) for t in self.tiers
        ):
            raise PolicyTypeError.bad(
                "TierStatsSnapshot.tiers", "expected a tuple of TierStat", self.tiers
            )
        keys = [t.key for t in self.tiers]
        if len(set(keys)) != len(keys):
            raise PolicyTypeError.bad(
                "TierStatsSnapshot.tiers", "expected unique (slot, steps) keys", sorted(keys)
            )

    def tier(self, slot: int, steps: int) -> TierStat | None:
        for t in self.tiers:
            if t.slot == slot and t.steps == steps:
                return t
        return None
