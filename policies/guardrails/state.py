"""The guard's serialisable bookkeeping (GuardedState) and its building blocks."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Generic

from specgov.policies.common.codec import (
    NonNegInt,
    NonNegReal,
    OptReal,
    PosInt,
    PosReal,
    Real,
    from_data,
    to_data,
)
from specgov.policies.common.decisions import ReasonCode
from specgov.policies.common.observation import Observation
from specgov.policies.common.step_table import SlotRule, StepTable
from specgov.policies.common.validation import (
    is_int,
)
from specgov.policies.guardrails._common import (
    GUARD_STATE_VERSION,
    V1_ONLY_KEYS,
    Candidates,
    GuardrailError,
    S,
    Slots,
    T,
)

# ------------------------------------------------------------ state building blocks


@dataclass(frozen=True, slots=True)
class SlotHistory:
    """When a slot last changed, from what, and its flap penalty at that time."""

    slot: PosInt
    changed_at_s: Real
    previous_steps: NonNegInt | None
    flap_penalty: NonNegReal = 0.0

    def penalty_at(self, now_s: float, half_life_s: float) -> float:
        age = max(0.0, now_s - self.changed_at_s)
        return self.flap_penalty * math.pow(0.5, age / half_life_s)


@dataclass(frozen=True, slots=True)
class WindowSample:
    """What one observation measured over its window [end_s - window_s, end_s]."""

    end_s: Real
    window_s: PosReal
    tokens: NonNegInt
    running: NonNegInt | None
    tpot_p50_ms: OptReal
    itl_p99_ms: OptReal
    # Added later: a sample saved before it reads as unknown.
    ttft_p99_ms: OptReal = None

    @property
    def start_s(self) -> float:
        return self.end_s - self.window_s


def window_sample(observation: Observation) -> WindowSample | None:
    """The observation's measurement window, or None when it lacks tokens or a window."""
    obs = observation
    if obs.window_s is None or obs.window_s <= 0 or obs.generation_tokens is None:
        return None
    return WindowSample(
        end_s=obs.time_s - (obs.staleness_s or 0.0),
        window_s=obs.window_s,
        tokens=obs.generation_tokens,
        running=obs.running_requests,
        tpot_p50_ms=None if obs.tpot_ms is None else obs.tpot_ms.p50_ms,
        itl_p99_ms=None if obs.itl_ms is None else obs.itl_ms.p99_ms,
        ttft_p99_ms=None if obs.ttft_ms is None else obs.ttft_ms.p99_ms,
    )


@dataclass(frozen=True, slots=True)
class WindowAggregate:
    """Measurements of consecutive windows, overlaps counted once.

    Goodput is ``tokens / seconds``; when every window knew its running requests it is
    normalised per running request, ``tokens / load_s`` with ``load_s`` = Σ seconds ×
    max(running, 1): with open-loop arrivals raw tokens/s follows the arrival rate,
    while tokens per request-second is the decode speed speculation actually changes
    (and is throughput / batch size at saturation).
    """

    seconds: NonNegReal = 0.0
    tokens: NonNegReal = 0.0
    load_s: NonNegReal | None = 0.0
    tpot_weighted: NonNegReal = 0.0
    tpot_seconds: NonNegReal = 0.0
    itl_weighted: NonNegReal = 0.0
    itl_seconds: NonNegReal = 0.0
    last_end_s: OptReal = None
    ttft_weighted: NonNegReal = 0.0
    ttft_seconds: NonNegReal = 0.0

    def add(self, sample: WindowSample) -> WindowAggregate:
        last = self.last_end_s
        cover = sample.window_s if last is None else min(sample.window_s, sample.end_s - last)
        if cover <= 0:
            return self
        load = None
        if self.load_s is not None and sample.running is not None:
            load = self.load_s + cover * max(sample.running, 1)
        tpot_w, tpot_s, itl_w, itl_s = (
            self.tpot_weighted,
            self.tpot_seconds,
            self.itl_weighted,
            self.itl_seconds,
        )
        if sample.tpot_p50_ms is not None:
            tpot_w, tpot_s = tpot_w + cover * sample.tpot_p50_ms, tpot_s + cover
        if sample.itl_p99_ms is not None:
            itl_w, itl_s = itl_w + cover * sample.itl_p99_ms, itl_s + cover
        ttft_w, ttft_s = self.ttft_weighted, self.ttft_seconds
        if sample.ttft_p99_ms is not None:
            ttft_w, ttft_s = ttft_w + cover * sample.ttft_p99_ms, ttft_s + cover
        return WindowAggregate(
            seconds=self.seconds + cover,
            tokens=self.tokens + sample.tokens * cover / sample.window_s,
            load_s=load,
            tpot_weighted=tpot_w,
            tpot_seconds=tpot_s,
            itl_weighted=itl_w,
            itl_seconds=itl_s,
            last_end_s=sample.end_s,
            ttft_weighted=ttft_w,
            ttft_seconds=ttft_s,
        )

    @property
    def mean_load(self) -> float | None:
        if self.load_s is None or self.seconds <= 0:
            return None
        return self.load_s / self.seconds

    def goodput(self, per_request: bool) -> float | None:
        denominator = self.load_s if per_request else self.seconds
        if denominator is None or denominator <= 0:
            return None
        return self.tokens / denominator

    @property
    def tpot_ms(self) -> float | None:
        return self.tpot_weighted / self.tpot_seconds if self.tpot_seconds > 0 else None

    @property
    def itl_p99_ms(self) -> float | None:
        return self.itl_weighted / self.itl_seconds if self.itl_seconds > 0 else None

    @property
    def ttft_p99_ms(self) -> float | None:
        return self.ttft_weighted / self.ttft_seconds if self.ttft_seconds > 0 else None


@dataclass(frozen=True, slots=True)
class ChangeTrial:
    """A policy change awaiting its rollback check: (slot, before, after) and the data."""

    version: NonNegInt
    started_at_s: Real
    changes: tuple[tuple[PosInt, NonNegInt, NonNegInt], ...]
    baseline: WindowAggregate
    post: WindowAggregate = field(default_factory=WindowAggregate)


@dataclass(frozen=True, slots=True)
class RollbackBlock:
    """After a rollback, the move ``slot: from_steps -> to_steps`` is refused until ``until_s``."""

    slot: PosInt
    from_steps: NonNegInt
    to_steps: NonNegInt
    until_s: Real


@dataclass(frozen=True, slots=True)
class Wanted:
    """The inner policy's latest table on the engine's slots (a hold stands by it)."""

    steps: Slots
    expected_gain: OptReal
    reason: ReasonCode
    # Engine slot bounds whose wanted step is an experiment (a probe): no prediction.
    experiment_slots: frozenset[PosInt] = frozenset()
    # The policy's live-acceptance rules by engine slot bound (table format 2).
    rules: tuple[tuple[PosInt, SlotRule], ...] = ()


# ----------------------------------------------------------------------------- state


@dataclass(frozen=True, slots=True)
class GuardedState(Generic[S]):
    """The inner policy's state plus the guardrails' bookkeeping (serialisable)."""

    inner: S
    inner_name: str
    # The table in force (last published) and the version counter.
    table: StepTable | None = None
    last_version: NonNegInt = 0
    # When the steps in force took effect (initial publish or last change).
    table_since_s: OptReal = None
    # Last time telemetry was fresh (bounds the keep-alive while frozen).
    last_fresh_s: OptReal = None
    # The engine's slot layout as last seen (first bound published as 1).
    last_candidates: Candidates | None = None
    wanted: Wanted | None = None
    slots: tuple[SlotHistory, ...] = ()
    change_times_s: tuple[Real, ...] = ()
    samples: tuple[WindowSample, ...] = ()
    trial: ChangeTrial | None = None
    blocks: tuple[RollbackBlock, ...] = ()
    # Slots a step override held at the last decision: when one is no longer overridden
    # it returns to the policy's table directly (derived from the overrides, not a copy).
    override_slots: tuple[PosInt, ...] = ()

    def history(self, slot: int) -> SlotHistory | None:
        for h in self.slots:
            if h.slot == slot:
                return h
        return None

    def checkpoint_key(self) -> tuple[object, ...]:
        """What the guard acts on beyond learning, for deciding when to save the state.

        A saver may skip saving while this equals the saved state's (the daemon does,
        for up to ``state.policy_state_interval_s``): what it leaves out is learning
        that the next windows re-learn after a crash (the inner policy's estimators,
        window samples, the wanted table, a trial's post-change sums) and the time of
        the last fresh observation (restored older, a frozen table's keep-alive ends
        sooner: the safe side), while the table, versions, change times, slot
        histories, the trial in progress, rollback blocks, overridden slots and the
        policy are never older on disk than in memory.
        """
        trial = self.trial
        return (
            self.inner_name,
            self.table,
            self.last_version,
            self.table_since_s,
            self.slots,
            self.change_times_s,
            None if trial is None else (trial.version, trial.started_at_s, trial.changes),
            self.blocks,
            self.override_slots,
        )

    # Versioned, with the inner policy's own state inside (and version 1 still read).
    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = to_data(replace(self, inner=None))  # type: ignore[arg-type]
        data["version"] = GUARD_STATE_VERSION
        data["inner"] = self.inner.to_dict()
        return data

    @staticmethod
    def from_dict(
        data: Mapping[str, Any], inner_from_dict: Callable[[Mapping[str, Any]], T]
    ) -> GuardedState[T]:
        """Restore a state written by :meth:`to_dict`; the inner state via ``inner_from_dict``.

        Raises :class:`GuardrailError` naming the bad key. Passing another policy's
        ``initial_state`` (ignoring the data) keeps the bookkeeping across a policy switch.
        """
        w = "GuardedState.from_dict"
        if not isinstance(data, Mapping):
            raise GuardrailError(f"{w}: expected a mapping, got {data!r}")
        if data.get("version") == 1:
            # Version 1 kept a copy of the overrides in the state; the store is their only
            # home now, so the copy is dropped (overrides are restored from the store).
            data = {k: v for k, v in data.items() if k not in V1_ONLY_KEYS}
            data["version"], data["override_slots"] = GUARD_STATE_VERSION, []
        version = data.get("version")
        if not is_int(version) or version != GUARD_STATE_VERSION:
            raise GuardrailError(
                f"{w}: key 'version': expected {GUARD_STATE_VERSION}, got {version!r}"
            )
        if "inner" not in data:
            raise GuardrailError(f"{w}: missing key 'inner' (the policy's own state)")
        # The bookkeeping by its schema; the inner state by the policy that owns it.
        rest = {k: v for k, v in data.items() if k not in ("version", "inner")}
        state: GuardedState[Any] = from_data(
            GuardedState[Any], {**rest, "inner": None}, where=w, error=GuardrailError
        )
        return replace(state, inner=inner_from_dict(data["inner"]))
