"""Fixed daemon policies: ``none``, ``static:K`` and ``batch-table:N=K,...``.

Each plans a step for every one of the engine's slots (the bounds of
``Observation.slot_candidates``) from a rule that never learns:

* :class:`NonePolicy` — step 0 (no speculation) in every slot;
* :class:`StaticPolicy` — the same step in every slot (the baseline every user has today);
* :class:`BatchTablePolicy` — a fixed batch-size -> steps schedule in the style of vLLM's
  dynamic speculative decoding and TensorRT-LLM's draft-length schedule: each engine slot
  with lower bound ``b`` takes the schedule entry with the largest batch size ``<= b``.

A wanted step the slot's candidates lack becomes the nearest lower candidate (the
smallest candidate when none is lower), and the Budget's ``allowed_steps`` narrows the
candidates when it leaves any; the Plan lists what limited it in ``limited_by``.

Each decision returns the full plan (a fixed rule has nothing to remember); unknown slot
candidates hold (``HELD_UNKNOWN_TELEMETRY``, no steps). Versions, the TTL and the
keep-alives that re-issue a table before it expires are the guard's
(``policies.guardrails``), never a policy's.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Final

from specgov.policies.common.codec import Versioned
from specgov.policies.common.decisions import Plan, ReasonCode
from specgov.policies.common.errors import SpecgovError
from specgov.policies.common.observation import Observation
from specgov.policies.common.types import Budget, PolicyTypeError, SlotLayout
from specgov.policies.common.validation import check_int, check_keys, is_int

STATE_VERSION: Final = 1

LIMITED_BY_CANDIDATES: Final = ReasonCode.LIMITED_BY_CANDIDATES.value
LIMITED_BY_BUDGET: Final = ReasonCode.LIMITED_BY_BUDGET.value

Slots = SlotLayout


# ------------------------------------------------------------------ shared helpers


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


def format_slots(slots: Iterable[tuple[int, int]]) -> str:
    return "[" + ", ".join(f"{b}:{s}" for b, s in slots) + "]"


# ------------------------------------------------------------------------- state


class PolicyStateError(SpecgovError, ValueError):
    """A serialised policy state is malformed; the message names the key."""


@dataclass(frozen=True, slots=True)
class FixedState(Versioned):
    """State of a fixed policy: nothing (its rule never learns).

    A state saved before the guard owned the table versions held the policy's copy of its
    last table (key ``table``); it is read and dropped (the guard keeps the table).
    """

    CODEC_TOLERATED_KEYS: ClassVar[frozenset[str]] = frozenset({"table"})
    # The PolicyState protocol's pair (the daemon saves any policy's state), versioned.
    CODEC_VERSION = STATE_VERSION
    CODEC_ERROR = PolicyStateError


def check_state_keys(
    owner: str, data: object, keys: Sequence[str], dropped: Sequence[str] = ()
) -> None:
    """Exactly ``keys`` present (``dropped``: keys older states carry, allowed and
    ignored) and ``version`` == STATE_VERSION, else PolicyStateError."""
    data = check_keys(f"{owner}.from_dict", data, keys, error=PolicyStateError, ignored=dropped)
    version = data["version"]
    if isinstance(version, bool) or version != STATE_VERSION:
        raise PolicyStateError(
            f"{owner}.from_dict: key 'version': expected {STATE_VERSION}, got {version!r}"
        )


# ---------------------------------------------------------------------- policies


class _FixedPolicy:
    """Shared decide(): map each engine slot bound to a wanted step, clamp, plan."""

    __slots__ = ()

    @property
    def name(self) -> str:
        raise NotImplementedError

    def _wanted(self, bound: int) -> int:
        raise NotImplementedError

    def initial_state(self) -> FixedState:
        return FixedState()

    def state_from_dict(self, data: Mapping[str, Any]) -> FixedState:
        return FixedState.from_dict(data)

    def decide(
        self, observation: Observation, state: FixedState, budget: Budget
    ) -> tuple[Plan, FixedState]:
        slots, why = engine_slots(observation, budget)
        if slots is None:
            message = f"{self.name}: {why}; holding"
            return Plan(None, ReasonCode.HELD_UNKNOWN_TELEMETRY, message, None), state
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
        message = f"{self.name}: {format_slots(wanted)}"
        if notes:
            message += " (clamped " + ", ".join(notes) + ")"
        plan = Plan(
            tuple(wanted),
            ReasonCode.STATIC_POLICY,
            message,
            None,
            limited_by=tuple(sorted(limited)),
        )
        return plan, state


def _check_steps(owner: str, steps: object) -> int:
    return check_int(owner, steps, error=PolicyTypeError, minimum=0)


class NonePolicy(_FixedPolicy):
    """No speculation: step 0 in every slot (clamped where a slot cannot run 0)."""

    __slots__ = ()

    @property
    def name(self) -> str:
        return "none"

    def _wanted(self, bound: int) -> int:
        return 0


class StaticPolicy(_FixedPolicy):
    """The same step count in every slot."""

    __slots__ = ("_steps",)

    def __init__(self, steps: int) -> None:
        self._steps = _check_steps("StaticPolicy.steps", steps)

    @property
    def steps(self) -> int:
        return self._steps

    @property
    def name(self) -> str:
        return f"static:{self._steps}"

    def _wanted(self, bound: int) -> int:
        return self._steps


class BatchTablePolicy(_FixedPolicy):
    """A fixed batch-size -> steps schedule mapped onto the engine's slots.

    ``schedule`` maps batch sizes (strictly increasing, the first 1) to steps; an engine
    slot with lower bound ``b`` takes the entry with the largest batch size ``<= b``.
    """

    __slots__ = ("_keys", "_schedule")

    def __init__(self, schedule: Mapping[int, int] | Sequence[tuple[int, int]]) -> None:
        pairs = list(schedule.items()) if isinstance(schedule, Mapping) else list(schedule)
        self._schedule = validate_schedule(pairs)
        self._keys = tuple(n for n, _ in self._schedule)

    @property
    def schedule(self) -> tuple[tuple[int, int], ...]:
        return self._schedule

    @property
    def name(self) -> str:
        return "batch-table:" + ",".join(f"{n}={k}" for n, k in self._schedule)

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
