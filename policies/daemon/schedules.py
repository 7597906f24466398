"""Fixed daemon policies: ``none``, ``static:K`` and ``batch-table:N=K,...``.

Each publishes a full :class:`StepTable` over the engine's slots (the bounds of
``Observation.slot_candidates``) from a rule that never learns:

* :class:`NonePolicy` — step 0 (no speculation) in every slot;
* :class:`StaticPolicy` — the same step in every slot (the baseline every user has today);
* :class:`BatchTablePolicy` — a fixed batch-size -> steps schedule in the style of vLLM's
  dynamic speculative decoding and TensorRT-LLM's draft-length schedule: each engine slot
  with lower bound ``b`` takes the schedule entry with the largest batch size ``<= b``.

A wanted step the slot's candidates lack becomes the nearest lower candidate (the
smallest candidate when none is lower), and the Budget's ``allowed_steps`` narrows the
candidates when it leaves any; the Decision lists what limited it in ``limited_by``.

Publishing rules, shared with the learning policies (:func:`publish_or_hold`): the table
version increments only when a table is issued; an unchanged table is held
(``table=None``, ``HELD_NO_CHANGE``) until its age passes half its TTL, then re-issued
with a new version and ``produced_at_s`` so the in-engine policy, which ignores an expired
table, never falls back while the daemon is alive. Unknown slot candidates hold
(``HELD_UNKNOWN_TELEMETRY``), still re-issuing the last table when it is due.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from specgov.policies.common.codec import from_versioned, to_versioned
from specgov.policies.common.errors import SpecgovError
from specgov.policies.common.types import (
    Budget,
    Decision,
    Observation,
    PolicyTypeError,
    ReasonCode,
    SlotLayout,
    StepTable,
)
from specgov.policies.common.validation import check_int, check_real, is_int

STATE_VERSION: Final = 1
# Long enough that a daemon deciding every few seconds re-issues a table a handful of
# times per minute at most, short enough that a dead daemon hands control back to
# SGLang's own policy within half a minute.
DEFAULT_TTL_S: Final = 30.0

LIMITED_BY_CANDIDATES: Final = ReasonCode.LIMITED_BY_CANDIDATES.value
LIMITED_BY_BUDGET: Final = ReasonCode.LIMITED_BY_BUDGET.value

Slots = SlotLayout


# ------------------------------------------------------------------ shared helpers


def check_ttl_s(owner: str, ttl_s: object) -> float:
    return check_real(f"{owner}.ttl_s", ttl_s, error=PolicyTypeError, positive=True)


def engine_slots(observation: Observation, budget: Budget) -> tuple[Slots | None, str]:
    """The engine's slots with the candidates a policy may play, or ``(None, why)``.

    Candidates are sorted and narrowed to ``budget.allowed_steps`` where that leaves at
    least one (an empty intersection keeps the engine's set: a step the engine never
    built cannot be published either way). The first bound is published as 1: SGLang
    routes batches below its first slot to that slot, so the tables are equivalent.
    """
    raw = observation.slot_candidates
    if raw is None:
        return None, "slot candidates unknown (engine config not seen yet)"
    if not raw:
        return None, "the engine reports no slots"
    bounds = [b for b, _ in raw]
    if not all(is_int(b) for b in bounds) or bounds[0] < 1:
        return None, f"slot bounds {bounds} unusable (expected ints >= 1)"
    allowed = None if budget.allowed_steps is None else set(budget.allowed_steps)
    out: list[tuple[int, tuple[int, ...]]] = []
    for i, (bound, steps) in enumerate(raw):
        cands = tuple(sorted(set(steps)))
        if allowed is not None:
            narrowed = tuple(s for s in cands if s in allowed)
            cands = narrowed or cands
        out.append((1 if i == 0 else bound, cands))
    return tuple(out), ""


def clamp_to_candidates(steps: int, candidates: Sequence[int]) -> int:
    """The nearest candidate not above ``steps``; the smallest when none is lower."""
    lower = [c for c in candidates if c <= steps]
    return max(lower) if lower else min(candidates)


def next_version(last: StepTable | None, observation: Observation) -> int:
    """A version above both our last table and the engine's, so it is always newer."""
    seen = [t.version for t in (last, observation.table) if t is not None]
    return max(seen, default=0) + 1


def refresh_due(last: StepTable, now_s: float) -> bool:
    """True once the table's age passes half its TTL (or the clock went backwards)."""
    age_s = now_s - last.produced_at_s
    return age_s < 0 or age_s >= last.ttl_s / 2


def format_slots(slots: Iterable[tuple[int, int]]) -> str:
    return "[" + ", ".join(f"{b}:{s}" for b, s in slots) + "]"


def publish_or_hold(
    wanted: tuple[tuple[int, int], ...],
    last: StepTable | None,
    observation: Observation,
    *,
    ttl_s: float,
    change_reason: ReasonCode,
    refresh_reason: ReasonCode,
    message: str,
    limited_by: tuple[str, ...] = (),
    expected_gain: float | None = None,
) -> tuple[Decision, StepTable | None]:
    """Issue ``wanted`` when it differs from ``last`` or ``last`` is due for a refresh.

    Returns the decision and the table the policy now stands by (its new ``last``).
    """
    now = observation.time_s
    if last is not None and last.slots == wanted and not refresh_due(last, now):
        age = now - last.produced_at_s
        hold = Decision(
            table=None,
            reason=ReasonCode.HELD_NO_CHANGE,
            message=f"{message}; table v{last.version} unchanged (age {age:.1f}s)",
            expected_gain=None,
            limited_by=limited_by,
        )
        return hold, last
    refresh = last is not None and last.slots == wanted
    table = StepTable(
        slots=wanted,
        version=next_version(last, observation),
        produced_at_s=now,
        ttl_s=ttl_s,
        reason=(refresh_reason if refresh else change_reason).value,
    )
    what = "re-issued before TTL expiry" if refresh else "published"
    decision = Decision(
        table=table,
        reason=refresh_reason if refresh else change_reason,
        message=f"{message}; {what} table v{table.version} {format_slots(wanted)}",
        expected_gain=None if refresh else expected_gain,
        limited_by=limited_by,
    )
    return decision, table


def hold_unknown(
    last: StepTable | None, observation: Observation, why: str
) -> tuple[Decision, StepTable | None]:
    """Hold on unknown telemetry, re-issuing the last table unchanged when it is due.

    Freezing means keeping what runs now; letting the table expire would hand the engine
    back to its fallback policy, which is a change.
    """
    if last is not None and refresh_due(last, observation.time_s):
        table = StepTable(
            slots=last.slots,
            version=next_version(last, observation),
            produced_at_s=observation.time_s,
            ttl_s=last.ttl_s,
            reason=ReasonCode.HELD_UNKNOWN_TELEMETRY.value,
        )
        message = f"{why}; holding, re-issued table v{table.version} before TTL expiry"
        return Decision(table, ReasonCode.HELD_UNKNOWN_TELEMETRY, message, None), table
    return Decision(None, ReasonCode.HELD_UNKNOWN_TELEMETRY, f"{why}; holding", None), last


# ------------------------------------------------------------------------- state


class PolicyStateError(SpecgovError, ValueError):
    """A serialised policy state is malformed; the message names the key."""


@dataclass(frozen=True, slots=True)
class TableState:
    """State of a fixed policy: the last table it issued (for versioning and refresh)."""

    table: StepTable | None = None

    # The PolicyState protocol's pair (the daemon saves any policy's state), versioned.
    def to_dict(self) -> dict[str, Any]:
        return to_versioned(self, STATE_VERSION)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TableState:
        return from_versioned(
            cls, data, STATE_VERSION, where="TableState.from_dict", error=PolicyStateError
        )


def check_state_keys(owner: str, data: object, keys: Sequence[str]) -> None:
    """Exactly ``keys`` present and ``version`` == STATE_VERSION, else PolicyStateError."""
    if not isinstance(data, Mapping):
        raise PolicyStateError(f"{owner}.from_dict: expected a mapping, got {data!r}")
    missing = [k for k in keys if k not in data]
    unknown = sorted(str(k) for k in data if k not in keys)
    if missing or unknown:
        raise PolicyStateError(
            f"{owner}.from_dict: missing key(s) {missing}, unknown key(s) {unknown}; "
            f"expected keys {sorted(keys)}"
        )
    version = data["version"]
    if isinstance(version, bool) or version != STATE_VERSION:
        raise PolicyStateError(
            f"{owner}.from_dict: key 'version': expected {STATE_VERSION}, got {version!r}"
        )


# ---------------------------------------------------------------------- policies


class _FixedPolicy:
    """Shared decide(): map each engine slot bound to a wanted step, clamp, publish."""

    __slots__ = ("_ttl_s",)

    def __init__(self, *, ttl_s: float) -> None:
        self._ttl_s = check_ttl_s(type(self).__name__, ttl_s)

    @property
    def ttl_s(self) -> float:
        return self._ttl_s

    @property
    def name(self) -> str:
        raise NotImplementedError

    def _ttl_suffix(self) -> str:
        return "" if self._ttl_s == DEFAULT_TTL_S else f"ttl_s={_fmt_float(self._ttl_s)}"

    def _wanted(self, bound: int) -> int:
        raise NotImplementedError

    def initial_state(self) -> TableState:
        return TableState()

    def state_from_dict(self, data: Mapping[str, Any]) -> TableState:
        return TableState.from_dict(data)

    def decide(
        self, observation: Observation, state: TableState, budget: Budget
    ) -> tuple[Decision, TableState]:
        slots, why = engine_slots(observation, budget)
        if slots is None:
            decision, table = hold_unknown(state.table, observation, f"{self.name}: {why}")
            return decision, TableState(table)
        wanted: list[tuple[int, int]] = []
        limited: set[str] = set()
        notes: list[str] = []
        # engine_slots keeps the engine's slot order, so zip pairs each with its raw set.
        for (bound, cands), (_, engine_steps) in zip(
            slots, observation.slot_candidates or (), strict=True
        ):
            want = self._wanted(bound)
            got = clamp_to_candidates(want, cands)
            if got != want:
                # The budget limited it when the engine could have run the wanted step.
                limited.add(LIMITED_BY_BUDGET if want in engine_steps else LIMITED_BY_CANDIDATES)
                notes.append(f"slot {bound}: {want} -> {got}")
            wanted.append((bound, got))
        message = f"{self.name}"
        if notes:
            message += " (clamped " + ", ".join(notes) + ")"
        decision, table = publish_or_hold(
            tuple(wanted),
            state.table,
            observation,
            ttl_s=self._ttl_s,
            change_reason=ReasonCode.STATIC_POLICY,
            refresh_reason=ReasonCode.STATIC_POLICY,
            message=message,
            limited_by=tuple(sorted(limited)),
        )
        return decision, TableState(table)


def _fmt_float(value: float) -> str:
    text = repr(float(value))
    return text[:-2] if text.endswith(".0") else text


def _check_steps(owner: str, steps: object) -> int:
    return check_int(owner, steps, error=PolicyTypeError, minimum=0)


class NonePolicy(_FixedPolicy):
    """No speculation: step 0 in every slot (clamped where a slot cannot run 0)."""

    __slots__ = ()

    def __init__(self, *, ttl_s: float = DEFAULT_TTL_S) -> None:
        super().__init__(ttl_s=ttl_s)

    @property
    def name(self) -> str:
        suffix = self._ttl_suffix()
        return f"none:{suffix}" if suffix else "none"

    def _wanted(self, bound: int) -> int:
        return 0


class StaticPolicy(_FixedPolicy):
    """The same step count in every slot."""

    __slots__ = ("_steps",)

    def __init__(self, steps: int, *, ttl_s: float = DEFAULT_TTL_S) -> None:
        super().__init__(ttl_s=ttl_s)
        self._steps = _check_steps("StaticPolicy.steps", steps)

    @property
    def steps(self) -> int:
        return self._steps

    @property
    def name(self) -> str:
        suffix = self._ttl_suffix()
        return f"static:{self._steps}" + (f",{suffix}" if suffix else "")

    def _wanted(self, bound: int) -> int:
        return self._steps


class BatchTablePolicy(_FixedPolicy):
    """A fixed batch-size -> steps schedule mapped onto the engine's slots.

    ``schedule`` maps batch sizes (strictly increasing, the first 1) to steps; an engine
    slot with lower bound ``b`` takes the entry with the largest batch size ``<= b``.
    """

    __slots__ = ("_keys", "_schedule")

    def __init__(
        self,
        schedule: Mapping[int, int] | Sequence[tuple[int, int]],
        *,
        ttl_s: float = DEFAULT_TTL_S,
    ) -> None:
        super().__init__(ttl_s=ttl_s)
        pairs = list(schedule.items()) if isinstance(schedule, Mapping) else list(schedule)
        self._schedule = validate_schedule(pairs)
        self._keys = tuple(n for n, _ in self._schedule)

    @property
    def schedule(self) -> tuple[tuple[int, int], ...]:
        return self._schedule

    @property
    def name(self) -> str:
        body = ",".join(f"{n}={k}" for n, k in self._schedule)
        suffix = self._ttl_suffix()
        return f"batch-table:{body}" + (f",{suffix}" if suffix else "")

    def _wanted(self, bound: int) -> int:
        idx = bisect.bisect_right(self._keys, bound) - 1
        return self._schedule[max(idx, 0)][1]


def validate_schedule(pairs: Sequence[object]) -> tuple[tuple[int, int], ...]:
    """Check a batch-size -> steps schedule; PolicyTypeError names the bad entry."""
    where = "BatchTablePolicy.schedule"
    if not pairs:
        raise PolicyTypeError(f"{where}: expected at least one (batch_size, steps) pair")
    out: list[tuple[int, int]] = []
    for i, pair in enumerate(pairs):
        if not isinstance(pair, tuple) or len(pair) != 2:
            raise PolicyTypeError(
                f"{where}[{i}]: expected a (batch_size, steps) pair, got {pair!r}"
            )
        n, k = pair
        if not is_int(n) or n < 1:
            raise PolicyTypeError(f"{where}[{i}]: batch size must be an int >= 1, got {n!r}")
        if i == 0 and n != 1:
            raise PolicyTypeError(f"{where}: the first batch size must be 1, got {n}")
        if out and n <= out[-1][0]:
            raise PolicyTypeError(
                f"{where}[{i}]: batch sizes must be strictly increasing, got {n} after {out[-1][0]}"
            )
        out.append((n, _check_steps(f"{where}[{i}] (batch size {n}) steps", k)))
    return tuple(out)
