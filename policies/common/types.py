"""Core value types of specgov (DESIGN.md, "Core types").

Every type is a frozen, slotted dataclass that validates itself on construction and
raises :class:`PolicyTypeError` naming the bad field and the expected form. Missing
telemetry is ``None`` ("unknown"), never 0: a policy must be able to tell "no data"
from "zero".
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Annotated, Any, ClassVar, Final, TypeAlias

import msgspec

from specgov.policies.common.codec import (
    NonNegInt,
    from_data,
    from_versioned,
    to_data,
    to_versioned,
)
from specgov.policies.common.errors import SpecgovError
from specgov.policies.common.validation import (
    check_int,
    check_opt_int,
    check_opt_real,
    check_real,
    is_int,
    is_real,
)

SCHEMA_VERSION: Final = 1
# The step table's own format (its "schema" key, and the spool file's): 1 = a step per
# slot; 2 = also a live-acceptance rule per slot (SlotRule); 3 = a rule may name the
# step its 0 band probes with (SlotRule.probe); 4 = a rule carries how fast goodput
# changes with the signal at each cut (SlotRule.slopes). Versions 1 to 3 are still read,
# and a table is written in the oldest format that holds it.
TABLE_SCHEMA: Final = 4
TABLE_SCHEMAS_READ: Final = (1, 2, 3, 4)

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


class PolicyTypeError(SpecgovError, ValueError):
    """A value handed to a specgov core type is malformed; the message names the field."""


# --------------------------------------------------------------------------- helpers


def _fail(where: str, expected: str, got: object) -> PolicyTypeError:
    return PolicyTypeError(f"{where}: {expected}, got {got!r}")


def _check_int(where: str, value: object, *, minimum: int | None = None) -> None:
    check_int(where, value, error=PolicyTypeError, minimum=minimum)


def _check_opt_int(where: str, value: object, *, minimum: int = 0) -> None:
    check_opt_int(where, value, error=PolicyTypeError, minimum=minimum)


def _check_real(
    where: str,
    value: object,
    *,
    minimum: float | None = None,
    positive: bool = False,
) -> None:
    check_real(where, value, error=PolicyTypeError, minimum=minimum, positive=positive)


def _check_opt_real(where: str, value: object, *, positive: bool = False) -> None:
    check_opt_real(where, value, error=PolicyTypeError, minimum=0.0, positive=positive)


def _check_steps_tuple(where: str, value: object) -> None:
    """Sorted, unique, non-negative int steps (a tuple, so the value stays immutable)."""
    if (
        not isinstance(value, tuple)
        or not all(is_int(s) and s >= 0 for s in value)
        or any(a >= b for a, b in itertools.pairwise(value))
    ):
        raise _fail(where, "expected a tuple of strictly increasing non-negative ints", value)


def _check_type(where: str, value: object, cls: type | tuple[type, ...], expected: str) -> None:
    if not isinstance(value, cls):
        raise _fail(where, expected, value)


# ------------------------------------------------------------------- dict helpers


# ------------------------------------------------------------------------ SpecShape


@dataclass(frozen=True, slots=True)
class SpecShape:
    """Restart-level speculation shape: what SGLang can only change at launch."""

    # Nested in a recommendation it is in its own to_dict form, with "schema".
    CODEC_TOLERATED_KEYS: ClassVar[frozenset[str]] = frozenset({"schema"})

    algorithm: str
    num_steps: int
    topk: int
    num_draft_tokens: int
    candidate_steps: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.algorithm not in ALGORITHMS:
            raise _fail(
                "SpecShape.algorithm", f"expected one of {sorted(ALGORITHMS)}", self.algorithm
            )
        _check_steps_tuple("SpecShape.candidate_steps", self.candidate_steps)
        if self.algorithm == "NONE":
            for name in ("num_steps", "topk", "num_draft_tokens"):
                value = getattr(self, name)
                if not is_int(value) or value != 0:
                    raise _fail(f"SpecShape.{name}", "expected 0 when algorithm is NONE", value)
            if self.candidate_steps:
                raise _fail(
                    "SpecShape.candidate_steps",
                    "expected () when algorithm is NONE",
                    self.candidate_steps,
                )
            return
        _check_int("SpecShape.num_steps", self.num_steps, minimum=1)
        _check_int("SpecShape.topk", self.topk, minimum=1)
        _check_int("SpecShape.num_draft_tokens", self.num_draft_tokens, minimum=1)
        if (
            self.algorithm in _EAGLE_FAMILY
            and self.topk == 1
            and self.num_draft_tokens != self.num_steps + 1
        ):
            raise _fail(
                "SpecShape.num_draft_tokens",
                f"expected num_steps + 1 = {self.num_steps + 1} when topk == 1 (as SGLang forces)",
                self.num_draft_tokens,
            )

    # Versioned under "schema", as launch documents and recommendations carry it.
    def to_dict(self) -> dict[str, Any]:
        return to_versioned(self, SCHEMA_VERSION, key="schema")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SpecShape:
        return from_versioned(
            cls,
            data,
            SCHEMA_VERSION,
            key="schema",
            where="SpecShape.from_dict",
            error=PolicyTypeError,
        )


# ------------------------------------------------------------------------ StepTable


@dataclass(frozen=True, slots=True)
class SlotRule:
    """One slot's steps as a function of the live acceptance signal (table schema 2-4).

    The signal is the slot's recent first-draft acceptance rate, which the in-engine
    policy measures from every verify of the slot at steps >= 1 (``TablePolicy``). A
    signal below ``thresholds[0]`` runs ``steps[0]``, from ``thresholds[i - 1]`` up to
    below ``thresholds[i]`` ``steps[i]``, from the last threshold on ``steps[-1]``.
    ``prior`` is the daemon's estimate of the signal: where the live one starts, and
    what it is shrunk to while its evidence is thin. The daemon computes the thresholds
    from its step-cost and acceptance models, so each step count holds exactly where it
    maximises expected goodput for the slot; ``probe_step`` is what a slot at 0 steps
    probes with: ``probe`` (format 3; the daemon names the cheapest positive step the
    slot allows, the one it charged step 0 for) or, without one, the least positive
    step in the rule. ``probe`` is stored only where it matters and differs from that
    default (None otherwise), so equal rules compare and serialise equal.
    ``slopes`` (format 4): per threshold, how fast the expected goodput of the band
    above it gains on the band below as the signal rises there (d/dsignal of
    ``goodput_above / goodput_below - 1`` at the cut, per unit of signal, > 0): the
    engine moves across a cut only where the gain is worth a stated fraction
    (``TablePolicy``). None (formats 2-3): a fixed hysteresis in signal units.
    """

    thresholds: tuple[float, ...]
    steps: tuple[int, ...]
    prior: float
    probe: int | None = None
    slopes: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        th, steps = self.thresholds, self.steps
        if not isinstance(th, tuple) or not all(is_real(t) and 0.0 < t < 1.0 for t in th):
            raise _fail("SlotRule.thresholds", "expected a tuple of numbers in (0, 1)", th)
        if any(a >= b for a, b in itertools.pairwise(th)):
            raise _fail("SlotRule.thresholds", "expected strictly increasing thresholds", th)
        if (
            not isinstance(steps, tuple)
            or len(steps) != len(th) + 1
            or not all(is_int(k) and k >= 0 for k in steps)
        ):
            raise _fail(
                "SlotRule.steps",
                f"expected {len(th) + 1} non-negative ints (one more than the thresholds)",
                steps,
            )
        if not (is_real(self.prior) and 0.0 <= self.prior <= 1.0):
            raise _fail("SlotRule.prior", "expected a number in [0, 1]", self.prior)
        probe = self.probe
        if probe is not None and not (is_int(probe) and probe > 0):
            raise _fail("SlotRule.probe", "expected None or an int >= 1", probe)
        if probe is not None and (0 not in steps or probe == least_positive_step(steps)):
            object.__setattr__(self, "probe", None)  # the default: not stored
        slopes = self.slopes
        if slopes is not None and (
            not isinstance(slopes, tuple)
            or len(slopes) != len(th)
            or not all(is_real(g) and 0.0 < g < math.inf for g in slopes)
        ):
            raise _fail(
                "SlotRule.slopes",
                f"expected None or {len(th)} finite numbers > 0 (one per threshold)",
                slopes,
            )

    def band_for(self, signal: float) -> int:
        """Index into ``steps`` for ``signal``."""
        return bisect.bisect_right(self.thresholds, signal)

    def steps_at(self, signal: float) -> int:
        return self.steps[bisect.bisect_right(self.thresholds, signal)]

    @property
    def probe_step(self) -> int | None:
        """The step a slot at 0 steps probes with (None: the rule never speculates)."""
        return self.probe if self.probe is not None else least_positive_step(self.steps)

    @property
    def all_steps(self) -> tuple[int, ...]:
        """Every step the rule may run (its bands' and its probe's), sorted."""
        steps = set(self.steps)
        if self.probe is not None:
            steps.add(self.probe)
        return tuple(sorted(steps))


def least_positive_step(steps: Iterable[int]) -> int | None:
    """The cheapest positive step of ``steps`` (None: none), the step a 0 band probes with
    unless its rule names another."""
    positive = [k for k in steps if k > 0]
    return min(positive) if positive else None


def _check_slots(owner: str, slots: object) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A (bound, steps) layout starting at bound 1; returns its bounds and steps."""
    if not isinstance(slots, tuple) or not slots:
        raise _fail(f"{owner}.slots", "expected a non-empty tuple of (bound, steps)", slots)
    for pair in slots:
        if not (isinstance(pair, tuple) and len(pair) == 2):
            raise _fail(f"{owner}.slots", "expected (bound, steps) int pairs", pair)
    bounds = tuple(p[0] for p in slots)
    steps = tuple(p[1] for p in slots)
    if (
        not all(is_int(b) for b in bounds)
        or bounds[0] != 1
        or any(a >= b for a, b in itertools.pairwise(bounds))
    ):
        raise _fail(
            f"{owner}.slots",
            "slot lower bounds must be strictly increasing positive ints starting at 1",
            list(bounds),
        )
    if not all(is_int(s) and s >= 0 for s in steps):
        raise _fail(f"{owner}.slots", "steps must be non-negative ints", list(steps))
    return bounds, steps


def _check_rules(
    owner: str, rules: object, bounds: Sequence[int]
) -> tuple[tuple[int, SlotRule], ...]:
    """(slot bound, SlotRule) pairs on increasing bounds among ``bounds``."""
    if not isinstance(rules, tuple) or not all(
        isinstance(r, tuple) and len(r) == 2 and isinstance(r[1], SlotRule) for r in rules
    ):
        raise _fail(f"{owner}.rules", "expected a tuple of (slot bound, SlotRule)", rules)
    rule_bounds = [b for b, _ in rules]
    if any(a >= b for a, b in itertools.pairwise(rule_bounds)) or not set(rule_bounds) <= set(
        bounds
    ):
        raise _fail(
            f"{owner}.rules",
            f"expected increasing slot bounds among the table's {list(bounds)}",
            rule_bounds,
        )
    return rules


def slot_index(bounds: Sequence[int], batch_size: int) -> int:
    """Index of the slot ``batch_size`` falls in (the largest lower bound <= it).

    Batch sizes below the first bound (0 for an idle batch) use the first slot, as
    SGLang's own routing does (adaptive_spec_params._find_closest_bs).
    """
    idx = bisect.bisect_right(bounds, batch_size) - 1
    return idx if idx > 0 else 0


class FutureTableFormat(PolicyTypeError):
    """A step table in a newer format than this specgov knows (upgrade the plugin)."""


@dataclass(frozen=True, slots=True)
class StepTable:
    """The live decision: batch-size slot lower bound -> draft steps.

    ``slots`` is sorted by lower bound; the first bound is 1. A batch of size b uses the
    slot with the largest lower bound <= b. The table is valid until
    ``produced_at_s + ttl_s``. ``rules`` (format 2, optional): (slot bound, SlotRule)
    pairs; a slot with a rule runs the rule's steps for the live acceptance signal
    (its ``slots`` step is the rule at the daemon's prior, for reports and guards), a
    slot without one runs its ``slots`` step.
    """

    slots: tuple[tuple[int, int], ...]
    version: int
    produced_at_s: float
    ttl_s: float
    reason: str = ""
    rules: tuple[tuple[int, SlotRule], ...] = ()
    # A table nested in a saved state may be in its spool form (to_dict), with "schema".
    CODEC_TOLERATED_KEYS: ClassVar[frozenset[str]] = frozenset({"schema"})
    # Derived lookup arrays (not part of equality or the serialised form; the default
    # lets the codec build a table from data, __post_init__ fills them in).
    _bounds: tuple[int, ...] = field(default=(), init=False, repr=False, compare=False)
    _steps: tuple[int, ...] = field(default=(), init=False, repr=False, compare=False)
    _rules: tuple[SlotRule | None, ...] = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        bounds, steps = _check_slots("StepTable", self.slots)
        _check_int("StepTable.version", self.version, minimum=0)
        _check_real("StepTable.produced_at_s", self.produced_at_s)
        _check_real("StepTable.ttl_s", self.ttl_s, positive=True)
        _check_type("StepTable.reason", self.reason, str, "expected a str")
        rules = _check_rules("StepTable", self.rules, bounds)
        by_bound = dict(rules)
        object.__setattr__(self, "_bounds", bounds)
        object.__setattr__(self, "_steps", steps)
        object.__setattr__(self, "_rules", tuple(by_bound.get(b) for b in bounds))

    @property
    def expires_at_s(self) -> float:
        return self.produced_at_s + self.ttl_s

    def _index(self, batch_size: int) -> int:
        return slot_index(self._bounds, batch_size)

    def steps_for(self, batch_size: int) -> int:
        """Steps for ``batch_size``: the slot with the largest lower bound <= batch_size."""
        return self._steps[self._index(batch_size)]

    def slot_for(self, batch_size: int) -> int:
        """Lower bound of the slot ``batch_size`` falls in."""
        return self._bounds[self._index(batch_size)]

    def rule_for(self, batch_size: int) -> SlotRule | None:
        """The live-acceptance rule of the slot ``batch_size`` falls in, if it has one."""
        return self._rules[self._index(batch_size)]

    def slot_steps(self, batch_size: int) -> tuple[int, ...]:
        """Every step the slot of ``batch_size`` may run (its step and its rule's)."""
        i = self._index(batch_size)
        rule = self._rules[i]
        return (self._steps[i],) if rule is None else rule.all_steps

    def is_expired(self, now_s: float) -> bool:
        return now_s >= self.produced_at_s + self.ttl_s

    def validate_against(self, candidate_steps: Iterable[int]) -> None:
        """Raise :class:`PolicyTypeError` if a slot names a step the engine has not built."""
        allowed = set(candidate_steps)
        bad = [(b, s) for b, s in self.slots if s not in allowed]
        bad += [(b, s) for b, r in self.rules for s in r.all_steps if s not in allowed]
        if bad:
            raise PolicyTypeError(
                f"StepTable.slots: every step must be one of the engine's candidate steps "
                f"{sorted(allowed)}, got (bound, steps) {bad} (table version {self.version})"
            )

    def to_dict(self) -> dict[str, Any]:
        """The oldest format that holds the table (what older plugins read): 4 when a
        rule carries slopes, 3 when one names its probe, 2 when the table has rules,
        else 1."""
        rules = [r for _, r in self.rules]
        version = (
            4
            if any(r.slopes is not None for r in rules)
            else 3
            if any(r.probe is not None for r in rules)
            else 2
            if rules
            else 1
        )
        data = to_versioned(self, version, key="schema")
        if not self.rules:
            del data["rules"]
        for _, rule in data.get("rules", ()):
            for key in _RULE_OPTIONAL_KEYS:
                if rule.get(key) is None:
                    del rule[key]
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StepTable:
        """Formats 1 to 4; a newer one raises :class:`FutureTableFormat`."""
        where = "StepTable.from_dict"
        if not isinstance(data, Mapping):
            raise PolicyTypeError(f"{where}: expected an object, got {type(data).__name__}")
        version = data.get("schema")
        if is_int(version) and version > TABLE_SCHEMA:
            raise FutureTableFormat(
                f"{where}: key 'schema': table format {version} is newer than this "
                f"specgov's {TABLE_SCHEMA}; upgrade specgov in the server environment"
            )
        if not is_int(version) or version not in TABLE_SCHEMAS_READ:
            raise PolicyTypeError(
                f"{where}: key 'schema': expected one of {list(TABLE_SCHEMAS_READ)}, "
                f"got {version!r}"
            )
        if version == 1 and "rules" in data:
            raise PolicyTypeError(f"{where}: key 'rules': format 1 has no rules")
        for key, since in _RULE_OPTIONAL_KEYS.items():
            if version < since and _rules_name(data.get("rules"), key):
                raise PolicyTypeError(
                    f"{where}: key 'rules': format {version} rules carry no {key!r} "
                    f"(that is format {since})"
                )
        body = {k: v for k, v in data.items() if k != "schema"}
        return from_data(cls, body, where=where, error=PolicyTypeError)


# A SlotRule's optional keys, each stored only when set, and the format that added it.
_RULE_OPTIONAL_KEYS: Final = {"probe": 3, "slopes": 4}


def _rules_name(rules: Any, key: str) -> bool:
    """Whether a saved table's ``rules`` (``[[bound, rule], ...]``) carry ``key``."""
    if not isinstance(rules, list | tuple):
        return False
    return any(
        isinstance(e, list | tuple) and len(e) == 2 and isinstance(e[1], Mapping) and key in e[1]
        for e in rules
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
            _check_opt_real(f"Budget.{name}", getattr(self, name), positive=True)
        if self.allowed_steps is not None:
            _check_steps_tuple("Budget.allowed_steps", self.allowed_steps)
            if not self.allowed_steps:
                raise _fail("Budget.allowed_steps", "expected None or a non-empty tuple", ())


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
        _check_int("TierStat.slot", self.slot, minimum=0)
        _check_int("TierStat.steps", self.steps, minimum=0)
        _check_int("TierStat.verify_calls", self.verify_calls, minimum=0)
        _check_int("TierStat.requests", self.requests, minimum=0)
        hist = self.accepted_hist
        if (
            not isinstance(hist, tuple)
            or len(hist) != self.steps + 1
            or not all(is_int(h) and h >= 0 for h in hist)
        ):
            raise _fail(
                "TierStat.accepted_hist",
                f"expected a tuple of {self.steps + 1} non-negative ints (steps + 1)",
                hist,
            )
        if sum(hist) != self.requests:
            raise _fail(
                "TierStat.accepted_hist",
                f"expected counts summing to requests={self.requests}",
                hist,
            )
        _check_real("TierStat.step_time_sum_s", self.step_time_sum_s, minimum=0.0)
        _check_int("TierStat.step_time_count", self.step_time_count, minimum=0)
        if self.step_time_count > self.verify_calls:
            raise _fail(
                "TierStat.step_time_count",
                f"expected <= verify_calls={self.verify_calls}",
                self.step_time_count,
            )
        _check_int("TierStat.batch_size_sum", self.batch_size_sum, minimum=0)

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
class TierStatsSnapshot:
    """Per-tier statistics recorded in one window [window_start_s, window_end_s]."""

    window_start_s: float
    window_end_s: float
    tiers: tuple[TierStat, ...]

    def __post_init__(self) -> None:
        _check_real("TierStatsSnapshot.window_start_s", self.window_start_s)
        _check_real("TierStatsSnapshot.window_end_s", self.window_end_s)
        if self.window_end_s < self.window_start_s:
            raise _fail(
                "TierStatsSnapshot.window_end_s",
                f"expected >= window_start_s={self.window_start_s}",
                self.window_end_s,
            )
        if not isinstance(self.tiers, tuple) or not all(
            isinstance(t, TierStat) for t in self.tiers
        ):
            raise _fail("TierStatsSnapshot.tiers", "expected a tuple of TierStat", self.tiers)
        keys = [t.key for t in self.tiers]
        if len(set(keys)) != len(keys):
            raise _fail(
                "TierStatsSnapshot.tiers", "expected unique (slot, steps) keys", sorted(keys)
            )

    def tier(self, slot: int, steps: int) -> TierStat | None:
        for t in self.tiers:
            if t.slot == slot and t.steps == steps:
                return t
        return None

    # Versioned under "schema": the spool's stats file, read by another process.
    def to_dict(self) -> dict[str, Any]:
        return to_versioned(self, SCHEMA_VERSION, key="schema")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TierStatsSnapshot:
        return from_versioned(
            cls,
            data,
            SCHEMA_VERSION,
            key="schema",
            where="TierStatsSnapshot.from_dict",
            error=PolicyTypeError,
        )


# ---------------------------------------------------------------------- Observation


@dataclass(frozen=True, slots=True)
class LoadSnapshot:
    """Server load at one instant; None means the series is unknown."""

    running_requests: int | None
    queued_requests: int | None
    token_usage: float | None
    kv_capacity_tokens: int | None

    def __post_init__(self) -> None:
        _check_opt_int("LoadSnapshot.running_requests", self.running_requests)
        _check_opt_int("LoadSnapshot.queued_requests", self.queued_requests)
        _check_opt_real("LoadSnapshot.token_usage", self.token_usage)
        _check_opt_int("LoadSnapshot.kv_capacity_tokens", self.kv_capacity_tokens)


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
            _check_opt_real(f"LatencyQuantiles.{name}", value)
            if value is not None:
                known.append((name, value))
        for (lo_name, lo), (hi_name, hi) in itertools.pairwise(known):
            if hi < lo:
                raise _fail(f"LatencyQuantiles.{hi_name}", f"expected >= {lo_name}={lo}", hi)


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
    e2e_ms: LatencyQuantiles | None = None
    spec_num_steps: int | None = None  # the sglang:spec_num_steps gauge (aged)
    # Per slot lower bound, the steps the engine captured for it (its adaptive
    # config's candidate_steps); a published table must stay inside these.
    slot_candidates: SlotLayout | None = None

    def __post_init__(self) -> None:
        _check_real("Observation.time_s", self.time_s)
        _check_opt_real("Observation.window_s", self.window_s)
        _check_opt_int("Observation.generation_tokens", self.generation_tokens)
        _check_opt_int("Observation.verify_calls", self.verify_calls)
        _check_opt_int("Observation.retractions", self.retractions)
        _check_opt_int("Observation.spec_num_steps", self.spec_num_steps)
        if self.slot_candidates is not None:
            bounds = [b for b, _ in self.slot_candidates]
            if bounds != sorted(set(bounds)) or any(
                not steps or any(not is_int(k) or k < 0 for k in steps)
                for _, steps in self.slot_candidates
            ):
                raise _fail(
                    "Observation.slot_candidates",
                    "sorted unique slot bounds, each with a non-empty tuple of steps >= 0",
                    self.slot_candidates,
                )
        _check_opt_int("Observation.running_requests", self.running_requests)
        _check_opt_int("Observation.queued_requests", self.queued_requests)
        _check_opt_real("Observation.token_usage", self.token_usage)
        _check_opt_int("Observation.kv_capacity_tokens", self.kv_capacity_tokens)
        _check_opt_real("Observation.gen_throughput_tok_s", self.gen_throughput_tok_s)
        _check_opt_real("Observation.accept_length", self.accept_length)
        _check_opt_real("Observation.staleness_s", self.staleness_s)
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
                raise _fail(f"Observation.{name}", f"expected None or a {cls.__name__}", value)

    @property
    def load(self) -> LoadSnapshot:
        return LoadSnapshot(
            running_requests=self.running_requests,
            queued_requests=self.queued_requests,
            token_usage=self.token_usage,
            kv_capacity_tokens=self.kv_capacity_tokens,
        )


# ------------------------------------------------------------------------- Decision


class ReasonCode(StrEnum):
    """Why a decision is what it is (also a metric label)."""

    INITIAL = "initial"
    HELD_STALE_TELEMETRY = "held_stale_telemetry"
    HELD_UNKNOWN_TELEMETRY = "held_unknown_telemetry"
    HELD_TOLERANCE_BAND = "held_tolerance_band"
    HELD_MIN_DWELL = "held_min_dwell"
    HELD_RATE_LIMIT = "held_rate_limit"
    HELD_NO_CHANGE = "held_no_change"
    CHANGED_PREDICTED_GAIN = "changed_predicted_gain"
    ROLLED_BACK_REGRESSION = "rolled_back_regression"
    LIMITED_BY_SLO = "limited_by_slo"
    LIMITED_BY_BUDGET = "limited_by_budget"
    LIMITED_BY_CANDIDATES = "limited_by_candidates"
    OVERRIDE_ACTIVE = "override_active"
    STATIC_POLICY = "static_policy"


RESTART_SOURCES: Final = ("policy", "replay")


@dataclass(frozen=True, slots=True)
class RestartRecommendation:
    """Restart the server with ``shape``: something a step table cannot do.

    ``source`` says who concluded it: ``policy`` (a live policy from its estimators, e.g.
    goodput when no table beats the server without the drafter) or ``replay`` (the
    restart loop replaying the recent workload over candidate shapes). ``predicted_gain``
    is relative (0.1 = +10 % goodput) against what runs now; ``evidence`` holds the
    numbers behind it by name. Launch flags are derived from ``shape`` in one place
    (``adapters.launch_config``), never stored here in a second form.
    """

    shape: SpecShape
    source: str
    summary: str
    predicted_gain: float | None
    evidence: tuple[tuple[str, float], ...] = ()

    def __post_init__(self) -> None:
        _check_type("RestartRecommendation.shape", self.shape, SpecShape, "expected a SpecShape")
        if self.source not in RESTART_SOURCES:
            raise _fail("RestartRecommendation.source", f"one of {RESTART_SOURCES}", self.source)
        if not isinstance(self.summary, str) or not self.summary.strip():
            raise _fail("RestartRecommendation.summary", "expected a non-empty str", self.summary)
        if self.predicted_gain is not None:
            _check_real("RestartRecommendation.predicted_gain", self.predicted_gain)
        if not isinstance(self.evidence, tuple):
            raise _fail(
                "RestartRecommendation.evidence", "a tuple of (name, number)", self.evidence
            )
        for i, item in enumerate(self.evidence):
            if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
                raise _fail(f"RestartRecommendation.evidence[{i}]", "a (name, number) pair", item)
            _check_real(f"RestartRecommendation.evidence[{i}]", item[1])

    # A legacy shape: evidence as a name -> number map, as operators read it.
    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = to_data(self)
        data["shape"] = self.shape.to_dict()
        data["evidence"] = dict(self.evidence)  # name -> number, as operators read it
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RestartRecommendation:
        w = "RestartRecommendation.from_dict"
        if isinstance(data, Mapping) and isinstance(data.get("evidence"), Mapping):
            data = {**data, "evidence": [[k, v] for k, v in data["evidence"].items()]}
        return from_data(cls, data, where=w, error=PolicyTypeError)


@dataclass(frozen=True, slots=True)
class GoodputPrediction:
    """What a policy's model predicts for one slot run at ``steps``: the goodput while a
    batch of this slot runs (tokens/s) and the slot's share of recent batches (weights)."""

    slot: int
    steps: int
    goodput_tok_s: float
    share: float

    def __post_init__(self) -> None:
        _check_int("GoodputPrediction.slot", self.slot, minimum=0)
        _check_int("GoodputPrediction.steps", self.steps, minimum=0)
        _check_real("GoodputPrediction.goodput_tok_s", self.goodput_tok_s, minimum=0.0)
        _check_real("GoodputPrediction.share", self.share, minimum=0.0)


def predicted_goodput_tok_s(
    predictions: Sequence[GoodputPrediction], table: StepTable | None
) -> float | None:
    """Goodput predicted for ``table`` (the table in force) at the recent load: the
    share-weighted goodput of each slot at the steps ``table`` gives it. None when there is
    no table, no load, or a busy slot runs steps the model made no prediction for."""
    if table is None or not predictions:
        return None
    by_key = {(p.slot, p.steps): p for p in predictions}
    shares = {p.slot: p.share for p in predictions}
    total = sum(shares.values())
    if total <= 0:
        return None
    goodput = 0.0
    for slot, share in shares.items():
        if share <= 0:
            continue
        found = by_key.get((slot, table.steps_for(slot)))
        if found is None:
            return None
        goodput += share / total * found.goodput_tok_s
    return goodput


@dataclass(frozen=True, slots=True)
class Decision:
    """A guarded decision: the table the guard publishes (versioned, stamped with its TTL;
    None: nothing to publish) and/or a restart recommendation, explained. Daemon policies
    answer with a :class:`Plan`; the guard makes the Decision from it.

    ``predictions``: the policy model's goodput per slot and steps (empty: it has no
    model), from which the goodput of whatever table ends up in force is predicted
    (:func:`predicted_goodput_tok_s`), at every decision.
    """

    table: StepTable | None
    reason: ReasonCode
    message: str
    expected_gain: float | None
    limited_by: tuple[str, ...] = ()
    restart_recommendation: RestartRecommendation | None = None
    predictions: tuple[GoodputPrediction, ...] = ()

    def __post_init__(self) -> None:
        if self.table is not None and not isinstance(self.table, StepTable):
            raise _fail("Decision.table", "expected None or a StepTable", self.table)
        _check_answer("Decision", self)


@dataclass(frozen=True, slots=True)
class Plan:
    """A daemon policy's answer: the steps it wants per slot, explained.

    ``slots`` is a layout like :attr:`StepTable.slots` (sorted, the first bound 1), or
    None: the policy stands by its last plan (nothing new to propose, or telemetry it
    cannot use). ``rules`` (table format 2) are the live-acceptance rules it wants per
    slot. A plan has no version, produced time or TTL: the guard alone turns plans into
    the published :class:`StepTable` (``policies.guardrails``), and owns its versions,
    TTL and keep-alives.
    """

    slots: tuple[tuple[int, int], ...] | None
    reason: ReasonCode
    message: str
    expected_gain: float | None
    limited_by: tuple[str, ...] = ()
    restart_recommendation: RestartRecommendation | None = None
    rules: tuple[tuple[int, SlotRule], ...] = ()
    # Slot lower bounds whose step is an experiment (a probe), not a prediction:
    # ``expected_gain`` leaves them out and the tolerance band lets them pass.
    experiment_slots: tuple[int, ...] = ()
    predictions: tuple[GoodputPrediction, ...] = ()
    _bounds: tuple[int, ...] = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        bounds: tuple[int, ...] = ()
        if self.slots is not None:
            bounds, _ = _check_slots("Plan", self.slots)
        _check_rules("Plan", self.rules, bounds)
        if not isinstance(self.experiment_slots, tuple) or not set(self.experiment_slots) <= set(
            bounds
        ):
            raise _fail(
                "Plan.experiment_slots",
                f"expected a tuple of the plan's slot bounds {list(bounds)}",
                self.experiment_slots,
            )
        _check_answer("Plan", self)
        object.__setattr__(self, "_bounds", bounds)

    def steps_for(self, batch_size: int) -> int:
        """Steps wanted for ``batch_size`` (the slot with the largest lower bound <= it)."""
        assert self.slots is not None, "Plan.steps_for: a hold has no steps"
        return self.slots[slot_index(self._bounds, batch_size)][1]

    def slot_for(self, batch_size: int) -> int:
        """Lower bound of the plan's slot ``batch_size`` falls in."""
        return self._bounds[slot_index(self._bounds, batch_size)]

    def rule_for(self, batch_size: int) -> SlotRule | None:
        """The rule wanted for the slot ``batch_size`` falls in, if any."""
        return dict(self.rules).get(self.slot_for(batch_size))


def _check_answer(owner: str, answer: Decision | Plan) -> None:
    """The fields a Decision and a Plan share: reason, message, gain, limits, extras."""
    if not isinstance(answer.predictions, tuple) or not all(
        isinstance(p, GoodputPrediction) for p in answer.predictions
    ):
        raise _fail(f"{owner}.predictions", "a tuple of GoodputPrediction", answer.predictions)
    _check_type(f"{owner}.reason", answer.reason, ReasonCode, "expected a ReasonCode")
    if not isinstance(answer.message, str) or not answer.message.strip():
        raise _fail(f"{owner}.message", "expected a non-empty str", answer.message)
    if answer.expected_gain is not None:
        _check_real(f"{owner}.expected_gain", answer.expected_gain)
    if not isinstance(answer.limited_by, tuple) or not all(
        isinstance(s, str) and s for s in answer.limited_by
    ):
        raise _fail(f"{owner}.limited_by", "expected a tuple of non-empty str", answer.limited_by)
    if answer.restart_recommendation is not None and not isinstance(
        answer.restart_recommendation, RestartRecommendation
    ):
        raise _fail(
            f"{owner}.restart_recommendation",
            "expected None or a RestartRecommendation",
            answer.restart_recommendation,
        )
