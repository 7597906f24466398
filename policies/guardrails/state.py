"""The guard's serialisable bookkeeping (GuardedState) and its building blocks."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Generic

from specgov.policies.guardrails._common import (
    _V1_ONLY_KEYS,
    GUARD_STATE_VERSION,
    Candidates,
    GuardrailError,
    S,
    Slots,
    T,
    _int,
    _keys,
    _list,
    _opt_int,
    _opt_real,
    _real,
)
from specgov.policies.types import (
    Observation,
    PolicyTypeError,
    ReasonCode,
    StepTable,
)
from specgov.policies.validation import (
    is_int,
)

# ------------------------------------------------------------ state building blocks


@dataclass(frozen=True, slots=True)
class SlotHistory:
    """When a slot last changed, from what, and its flap penalty at that time."""

    slot: int
    changed_at_s: float
    previous_steps: int | None
    flap_penalty: float = 0.0

    def penalty_at(self, now_s: float, half_life_s: float) -> float:
        age = max(0.0, now_s - self.changed_at_s)
        return self.flap_penalty * math.pow(0.5, age / half_life_s)

    def to_dict(self) -> dict[str, Any]:
        return {
            "slot": self.slot,
            "changed_at_s": self.changed_at_s,
            "previous_steps": self.previous_steps,
            "flap_penalty": self.flap_penalty,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str) -> SlotHistory:
        d = _keys(where, data, ("slot", "changed_at_s", "previous_steps", "flap_penalty"))
        return cls(
            slot=_int(f"{where}.slot", d["slot"], minimum=1),
            changed_at_s=_real(f"{where}.changed_at_s", d["changed_at_s"]),
            previous_steps=_opt_int(f"{where}.previous_steps", d["previous_steps"], minimum=0),
            flap_penalty=_real(f"{where}.flap_penalty", d["flap_penalty"], minimum=0.0),
        )


@dataclass(frozen=True, slots=True)
class WindowSample:
    """What one observation measured over its window [end_s - window_s, end_s]."""

    end_s: float
    window_s: float
    tokens: int
    running: int | None
    tpot_p50_ms: float | None
    itl_p99_ms: float | None

    @property
    def start_s(self) -> float:
        return self.end_s - self.window_s

    def to_dict(self) -> dict[str, Any]:
        return {
            "end_s": self.end_s,
            "window_s": self.window_s,
            "tokens": self.tokens,
            "running": self.running,
            "tpot_p50_ms": self.tpot_p50_ms,
            "itl_p99_ms": self.itl_p99_ms,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str) -> WindowSample:
        keys = ("end_s", "window_s", "tokens", "running", "tpot_p50_ms", "itl_p99_ms")
        d = _keys(where, data, keys)
        return cls(
            end_s=_real(f"{where}.end_s", d["end_s"]),
            window_s=_real(f"{where}.window_s", d["window_s"], positive=True),
            tokens=_int(f"{where}.tokens", d["tokens"], minimum=0),
            running=_opt_int(f"{where}.running", d["running"], minimum=0),
            tpot_p50_ms=_opt_real(f"{where}.tpot_p50_ms", d["tpot_p50_ms"]),
            itl_p99_ms=_opt_real(f"{where}.itl_p99_ms", d["itl_p99_ms"]),
        )


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

    seconds: float = 0.0
    tokens: float = 0.0
    load_s: float | None = 0.0
    tpot_weighted: float = 0.0
    tpot_seconds: float = 0.0
    itl_weighted: float = 0.0
    itl_seconds: float = 0.0
    last_end_s: float | None = None

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
        return WindowAggregate(
            seconds=self.seconds + cover,
            tokens=self.tokens + sample.tokens * cover / sample.window_s,
            load_s=load,
            tpot_weighted=tpot_w,
            tpot_seconds=tpot_s,
            itl_weighted=itl_w,
            itl_seconds=itl_s,
            last_end_s=sample.end_s,
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

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str) -> WindowAggregate:
        names = [f.name for f in fields(cls)]
        d = _keys(where, data, names)
        return cls(
            seconds=_real(f"{where}.seconds", d["seconds"], minimum=0.0),
            tokens=_real(f"{where}.tokens", d["tokens"], minimum=0.0),
            load_s=None
            if d["load_s"] is None
            else _real(f"{where}.load_s", d["load_s"], minimum=0.0),
            tpot_weighted=_real(f"{where}.tpot_weighted", d["tpot_weighted"], minimum=0.0),
            tpot_seconds=_real(f"{where}.tpot_seconds", d["tpot_seconds"], minimum=0.0),
            itl_weighted=_real(f"{where}.itl_weighted", d["itl_weighted"], minimum=0.0),
            itl_seconds=_real(f"{where}.itl_seconds", d["itl_seconds"], minimum=0.0),
            last_end_s=_opt_real(f"{where}.last_end_s", d["last_end_s"]),
        )


@dataclass(frozen=True, slots=True)
class ChangeTrial:
    """A policy change awaiting its rollback check: (slot, before, after) and the data."""

    version: int
    started_at_s: float
    changes: tuple[tuple[int, int, int], ...]
    baseline: WindowAggregate
    post: WindowAggregate = field(default_factory=WindowAggregate)

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "started_at_s": self.started_at_s,
            "changes": [list(c) for c in self.changes],
            "baseline": self.baseline.to_dict(),
            "post": self.post.to_dict(),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str) -> ChangeTrial:
        d = _keys(where, data, ("version", "started_at_s", "changes", "baseline", "post"))
        changes: list[tuple[int, int, int]] = []
        for i, raw in enumerate(_list(f"{where}.changes", d["changes"])):
            item = _list(f"{where}.changes[{i}]", raw)
            if len(item) != 3:
                raise GuardrailError(
                    f"{where}.changes[{i}]: expected [slot, before, after], got {raw!r}"
                )
            changes.append(
                (
                    _int(f"{where}.changes[{i}][0]", item[0], minimum=1),
                    _int(f"{where}.changes[{i}][1]", item[1], minimum=0),
                    _int(f"{where}.changes[{i}][2]", item[2], minimum=0),
                )
            )
        return cls(
            version=_int(f"{where}.version", d["version"], minimum=0),
            started_at_s=_real(f"{where}.started_at_s", d["started_at_s"]),
            changes=tuple(changes),
            baseline=WindowAggregate.from_dict(d["baseline"], f"{where}.baseline"),
            post=WindowAggregate.from_dict(d["post"], f"{where}.post"),
        )


@dataclass(frozen=True, slots=True)
class RollbackBlock:
    """After a rollback, the move ``slot: from_steps -> to_steps`` is refused until ``until_s``."""

    slot: int
    from_steps: int
    to_steps: int
    until_s: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "slot": self.slot,
            "from_steps": self.from_steps,
            "to_steps": self.to_steps,
            "until_s": self.until_s,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str) -> RollbackBlock:
        d = _keys(where, data, ("slot", "from_steps", "to_steps", "until_s"))
        return cls(
            slot=_int(f"{where}.slot", d["slot"], minimum=1),
            from_steps=_int(f"{where}.from_steps", d["from_steps"], minimum=0),
            to_steps=_int(f"{where}.to_steps", d["to_steps"], minimum=0),
            until_s=_real(f"{where}.until_s", d["until_s"]),
        )


@dataclass(frozen=True, slots=True)
class Wanted:
    """The inner policy's latest table on the engine's slots (a hold stands by it)."""

    steps: Slots
    expected_gain: float | None
    reason: ReasonCode
    # Engine slot bounds whose wanted step is an experiment (a probe): no prediction.
    experiment_slots: frozenset[int] = frozenset()

    def to_dict(self) -> dict[str, Any]:
        return {
            "steps": [list(p) for p in self.steps],
            "expected_gain": self.expected_gain,
            "reason": self.reason.value,
            "experiment_slots": sorted(self.experiment_slots),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str) -> Wanted:
        d = _keys(where, data, ("steps", "expected_gain", "reason"), ("experiment_slots",))
        try:
            reason = ReasonCode(d["reason"])
        except ValueError:
            raise GuardrailError(
                f"{where}.reason: expected one of {[c.value for c in ReasonCode]}, got "
                f"{d['reason']!r}"
            ) from None
        return cls(
            steps=_slots_from(f"{where}.steps", d["steps"]),
            expected_gain=_opt_real(f"{where}.expected_gain", d["expected_gain"]),
            reason=reason,
            experiment_slots=frozenset(
                _int(f"{where}.experiment_slots[{i}]", b, minimum=1)
                for i, b in enumerate(
                    _list(f"{where}.experiment_slots", d.get("experiment_slots", []))
                )
            ),
        )


def _slots_from(where: str, raw: object) -> Slots:
    out: list[tuple[int, int]] = []
    for i, pair in enumerate(_list(where, raw)):
        item = _list(f"{where}[{i}]", pair)
        if len(item) != 2:
            raise GuardrailError(f"{where}[{i}]: expected [bound, steps], got {pair!r}")
        out.append(
            (
                _int(f"{where}[{i}][0]", item[0], minimum=1),
                _int(f"{where}[{i}][1]", item[1], minimum=0),
            )
        )
    return tuple(out)


def _candidates_from(where: str, raw: object) -> Candidates:
    out: list[tuple[int, tuple[int, ...]]] = []
    for i, pair in enumerate(_list(where, raw)):
        item = _list(f"{where}[{i}]", pair)
        if len(item) != 2:
            raise GuardrailError(f"{where}[{i}]: expected [bound, [steps...]], got {pair!r}")
        steps = tuple(
            _int(f"{where}[{i}][1][{j}]", s, minimum=0)
            for j, s in enumerate(_list(f"{where}[{i}][1]", item[1]))
        )
        if not steps:
            raise GuardrailError(f"{where}[{i}][1]: expected a non-empty list of steps")
        out.append((_int(f"{where}[{i}][0]", item[0], minimum=1), steps))
    return tuple(out)


# ----------------------------------------------------------------------------- state


@dataclass(frozen=True, slots=True)
class GuardedState(Generic[S]):
    """The inner policy's state plus the guardrails' bookkeeping (serialisable)."""

    inner: S
    inner_name: str
    # The table in force (last published) and the version counter.
    table: StepTable | None = None
    last_version: int = 0
    # When the steps in force took effect (initial publish or last change).
    table_since_s: float | None = None
    # Last time telemetry was fresh (bounds the keep-alive while frozen).
    last_fresh_s: float | None = None
    # The engine's slot layout as last seen (first bound published as 1).
    last_candidates: Candidates | None = None
    wanted: Wanted | None = None
    slots: tuple[SlotHistory, ...] = ()
    change_times_s: tuple[float, ...] = ()
    samples: tuple[WindowSample, ...] = ()
    trial: ChangeTrial | None = None
    blocks: tuple[RollbackBlock, ...] = ()
    # Slots a step override held at the last decision: when one is no longer overridden
    # it returns to the policy's table directly (derived from the overrides, not a copy).
    override_slots: tuple[int, ...] = ()

    def history(self, slot: int) -> SlotHistory | None:
        for h in self.slots:
            if h.slot == slot:
                return h
        return None

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": GUARD_STATE_VERSION,
            "inner_name": self.inner_name,
            "inner": self.inner.to_dict(),
            "table": None if self.table is None else self.table.to_dict(),
            "last_version": self.last_version,
            "table_since_s": self.table_since_s,
            "last_fresh_s": self.last_fresh_s,
            "last_candidates": None
            if self.last_candidates is None
            else [[b, list(c)] for b, c in self.last_candidates],
            "wanted": None if self.wanted is None else self.wanted.to_dict(),
            "slots": [h.to_dict() for h in self.slots],
            "change_times_s": list(self.change_times_s),
            "samples": [s.to_dict() for s in self.samples],
            "trial": None if self.trial is None else self.trial.to_dict(),
            "blocks": [b.to_dict() for b in self.blocks],
            "override_slots": list(self.override_slots),
        }

    @staticmethod
    def from_dict(
        data: Mapping[str, Any], inner_from_dict: Callable[[Mapping[str, Any]], T]
    ) -> GuardedState[T]:
        """Restore a state written by :meth:`to_dict`; the inner state via ``inner_from_dict``.

        Raises :class:`GuardrailError` naming the bad key. Passing another policy's
        ``initial_state`` (ignoring the data) keeps the bookkeeping across a policy switch.
        """
        w = "GuardedState.from_dict"
        keys = [
            "version",
            "inner_name",
            "inner",
            "table",
            "last_version",
            "table_since_s",
            "last_fresh_s",
            "last_candidates",
            "wanted",
            "slots",
            "change_times_s",
            "samples",
            "trial",
            "blocks",
            "override_slots",
        ]
        if isinstance(data, Mapping) and data.get("version") == 1:
            # Version 1 kept a copy of the overrides in the state; the store is their only
            # home now, so the copy is dropped (overrides are restored from the store).
            data = {k: v for k, v in data.items() if k not in _V1_ONLY_KEYS}
            data["version"], data["override_slots"] = GUARD_STATE_VERSION, []
        d = _keys(w, data, keys)
        if not is_int(d["version"]) or d["version"] != GUARD_STATE_VERSION:
            raise GuardrailError(
                f"{w}: key 'version': expected {GUARD_STATE_VERSION}, got {d['version']!r}"
            )
        if not isinstance(d["inner_name"], str):
            raise GuardrailError(f"{w}: key 'inner_name': expected a str, got {d['inner_name']!r}")
        try:
            table = None if d["table"] is None else StepTable.from_dict(d["table"])
        except GuardrailError:
            raise
        except (PolicyTypeError, TypeError) as exc:
            raise GuardrailError(f"{w}: {exc}") from exc
        return GuardedState(
            inner=inner_from_dict(d["inner"]),
            inner_name=d["inner_name"],
            table=table,
            last_version=_int(f"{w}.last_version", d["last_version"], minimum=0),
            table_since_s=_opt_real(f"{w}.table_since_s", d["table_since_s"]),
            last_fresh_s=_opt_real(f"{w}.last_fresh_s", d["last_fresh_s"]),
            last_candidates=None
            if d["last_candidates"] is None
            else _candidates_from(f"{w}.last_candidates", d["last_candidates"]),
            wanted=None if d["wanted"] is None else Wanted.from_dict(d["wanted"], f"{w}.wanted"),
            slots=tuple(
                SlotHistory.from_dict(h, f"{w}.slots[{i}]")
                for i, h in enumerate(_list(f"{w}.slots", d["slots"]))
            ),
            change_times_s=tuple(
                _real(f"{w}.change_times_s[{i}]", t)
                for i, t in enumerate(_list(f"{w}.change_times_s", d["change_times_s"]))
            ),
            samples=tuple(
                WindowSample.from_dict(s, f"{w}.samples[{i}]")
                for i, s in enumerate(_list(f"{w}.samples", d["samples"]))
            ),
            trial=None if d["trial"] is None else ChangeTrial.from_dict(d["trial"], f"{w}.trial"),
            blocks=tuple(
                RollbackBlock.from_dict(b, f"{w}.blocks[{i}]")
                for i, b in enumerate(_list(f"{w}.blocks", d["blocks"]))
            ),
            override_slots=tuple(
                _int(f"{w}.override_slots[{i}]", s, minimum=1)
                for i, s in enumerate(_list(f"{w}.override_slots", d["override_slots"]))
            ),
        )
