"""Guardrails: one wrapper around every daemon policy, operator overrides included.

:class:`GuardedPolicy` wraps any :class:`~specgov.policies.daemon.DaemonPolicy` and is one
itself (same ``name``). Each decision first runs the inner policy (its state always
advances as it chose), turns the inner table into a proposal over the engine's slots
(``Observation.slot_candidates``; the first bound is published as 1, as SGLang routes
smaller batches there; clamped as in step 6, so steps 3-5 judge the changes that would
really happen), then passes the proposal through these steps, in this order,
each a small pure function ``(context, proposal, state, config) -> (proposal, state)``
(``GUARD_STEPS``; the context holds the observation and the Budget):

1. :func:`freeze_on_unknown_telemetry` — a field of ``config.required_fields`` is None,
   ``staleness_s > max_staleness_s``, or the tier statistics ended more than
   ``max_tier_stats_age_s`` ago: the inner table is dropped and the table in force is held.
   Codes: ``HELD_UNKNOWN_TELEMETRY``, ``HELD_STALE_TELEMETRY``. Unknown telemetry never
   changes the table; only an active operator override may (still clamped, step 6). The
   unchanged table is re-issued before its TTL runs out for up to ``frozen_keepalive_s``
   after the last fresh telemetry (indefinitely while an override is active), after
   which it is left to expire so the engine falls back to its own policy.
2. :func:`apply_overrides` — the operator's overrides are an input of every decision
   (``GuardedPolicy.decide(..., overrides=...)``; the daemon's store holds them, the
   guard keeps no copy): an active one replaces the steps of its slots (a slot's own
   override beats an all-slots one, the newest wins). Override slots bypass steps 3-5
   and 7 but not the clamp: an override is always clamped. When an override ends
   (expired or cleared), its slots return to the policy's table directly (also
   bypassing 3-5); the guard remembers only which slots were overridden. A policy pin
   is run by the control core (:func:`pinned_policy`). Code: ``OVERRIDE_ACTIVE``.
3. :func:`tolerance_band` — a policy change whose ``expected_gain`` (relative, 0.02 = +2 %)
   is below ``min_gain`` is held; a change without a prediction (``None``) passes.
   Code: ``HELD_TOLERANCE_BAND``.
4. :func:`min_dwell` — a slot that changed less than its dwell time ago keeps its step
   (other slots may change); the dwell time is ``min_dwell_s`` doubled per unit of the
   slot's flap penalty (+1 per reversal A->B->A, halving every ``flap_half_life_s``),
   capped at ``max_dwell_s``. While a change awaits its rollback check, no further policy
   change is made (one experiment at a time). Code: ``HELD_MIN_DWELL``.
5. :func:`rate_limit` — at most ``max_changes_per_window`` table changes (of any cause)
   in any ``rate_window_s``; a policy change is admitted only while the window holds
   fewer than ``max_changes_per_window - 1`` (one is kept for a rollback when rollback
   is enabled). Overrides, their end and Budget enforcement are never delayed but are
   counted. Code: ``HELD_RATE_LIMIT``.
6. :func:`clamp_to_candidates_and_budget` — each slot's step becomes the nearest lower
   step among its candidates narrowed to ``Budget.allowed_steps`` (the smallest when none
   is lower; the engine's full set when the Budget allows none of them, reported).
   Codes in ``limited_by``: ``limited_by_candidates``, ``limited_by_budget``; a change
   made only to obey the Budget has reason ``LIMITED_BY_BUDGET``/``LIMITED_BY_CANDIDATES``.
7. :func:`rollback` — after a policy change, the measured goodput of the windows after it
   (``generation_tokens`` over the window, per running request so a load change is not
   taken for a regression; see :class:`WindowAggregate`) is compared with the windows
   before it. If it fell by more than ``rollback_threshold`` with enough data, or an SLO
   of the Budget that was met (TPOT p50 vs ``slo_tpot_ms``, ITL p99 vs
   ``slo_itl_p99_ms``) is now broken, the previous steps are restored (clamped) and the
   rejected move is blocked for ``rollback_cooldown_s``. Codes: ``ROLLED_BACK_REGRESSION``;
   a blocked re-proposal is held with ``HELD_NO_CHANGE`` and ``rollback_cooldown`` in
   ``limited_by``.

Finally the result is committed: the very first table is published (``INITIAL``, also
after the engine's slot layout changed); a changed table is published with a new
version; an unchanged table is re-issued (same steps, new version and produced-at) once
its age passes ``keepalive_fraction`` of its TTL, so the engine never falls back by
expiry while the daemon is healthy. ``Decision.table`` is None when nothing is to be
published; the table in force is ``GuardedState.table``. Reason precedence: INITIAL,
ROLLED_BACK_REGRESSION, OVERRIDE_ACTIVE, HELD_*_TELEMETRY, the policy's change reason
(``CHANGED_PREDICTED_GAIN`` unless it gave a change code), LIMITED_BY_BUDGET/CANDIDATES,
the first guardrail that held a change, HELD_NO_CHANGE. Every step that limited the
decision appends its code to ``limited_by`` (after the inner policy's own entries).

Pure (DESIGN.md): time is ``observation.time_s``, no IO, no randomness.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any, Final, Generic, TypeAlias, TypeVar

from specgov.policies.daemon import DaemonPolicy, PolicyState
from specgov.policies.types import (
    Budget,
    Decision,
    Observation,
    PolicyTypeError,
    ReasonCode,
    StepTable,
)
from specgov.policies.validation import (
    check_bool,
    check_int,
    check_opt_int,
    check_opt_real,
    check_real,
    is_int,
    is_real,
)

GUARD_STATE_VERSION: Final = 2
_V1_ONLY_KEYS: Final = frozenset({"overrides", "released_slots", "release_all"})
OVERRIDE_VERSION: Final = 1

S = TypeVar("S", bound=PolicyState)
T = TypeVar("T", bound=PolicyState)

Slots: TypeAlias = tuple[tuple[int, int], ...]
Candidates: TypeAlias = tuple[tuple[int, tuple[int, ...]], ...]

ROLLBACK_COOLDOWN: Final = "rollback_cooldown"
_OBSERVATION_FIELDS: Final = frozenset(f.name for f in fields(Observation)) - {"time_s"}
# Decision codes a policy uses for a change; anything else is reported as a predicted gain.
_CHANGE_CODES: Final = frozenset(
    {
        ReasonCode.CHANGED_PREDICTED_GAIN,
        ReasonCode.LIMITED_BY_SLO,
        ReasonCode.LIMITED_BY_BUDGET,
        ReasonCode.LIMITED_BY_CANDIDATES,
        ReasonCode.STATIC_POLICY,
    }
)
# Window samples kept for rollback baselines (bounded however fast the daemon decides).
_MAX_SAMPLES: Final = 512


class GuardrailError(PolicyTypeError):
    """Bad guardrail input (config, override, serialised state); the message names it."""


# --------------------------------------------------------------------------- checks


def _real(
    where: str, value: object, *, minimum: float | None = None, positive: bool = False
) -> float:
    return check_real(where, value, error=GuardrailError, minimum=minimum, positive=positive)


def _opt_real(where: str, value: object) -> float | None:
    return check_opt_real(where, value, error=GuardrailError)


def _int(where: str, value: object, *, minimum: int | None = None) -> int:
    return check_int(where, value, error=GuardrailError, minimum=minimum)


def _opt_int(where: str, value: object, *, minimum: int | None = None) -> int | None:
    return check_opt_int(where, value, error=GuardrailError, minimum=minimum)


def _bool(where: str, value: object) -> bool:
    return check_bool(where, value, error=GuardrailError)


def _keys(
    owner: str, data: object, required: Sequence[str], optional: Sequence[str] = ()
) -> Mapping[str, Any]:
    if not isinstance(data, Mapping):
        raise GuardrailError(f"{owner}: expected a mapping, got {data!r}")
    allowed = set(required) | set(optional)
    missing = [k for k in required if k not in data]
    unknown = sorted(str(k) for k in data if k not in allowed)
    if missing or unknown:
        raise GuardrailError(
            f"{owner}: missing key(s) {missing}, unknown key(s) {unknown}; "
            f"expected keys {sorted(allowed)}"
        )
    return data


def _list(where: str, value: object) -> list[Any]:
    if not isinstance(value, list | tuple):
        raise GuardrailError(f"{where}: expected a list, got {value!r}")
    return list(value)


# --------------------------------------------------------------------------- config


@dataclass(frozen=True, slots=True)
class GuardrailConfig:
    """Guardrail settings; every default is what the daemon runs with.

    Times are seconds of ``Observation.time_s``; gains and thresholds are fractions.
    """

    # TTL stamped on every published table; the in-engine policy ignores an expired one.
    table_ttl_s: float = 30.0
    # Re-issue an unchanged table once its age passes this fraction of its TTL.
    keepalive_fraction: float = 0.5
    # While frozen, keep re-issuing the held table for this long after the last fresh
    # telemetry; then let it expire so the engine falls back to its own policy (0: never).
    frozen_keepalive_s: float = 120.0
    # Observation fields that must be known (not None) for the policy to act.
    required_fields: tuple[str, ...] = (
        "slot_candidates",
        "staleness_s",
        "tier_stats",
        "window_s",
        "generation_tokens",
    )
    # Scraped metrics older than this are stale.
    max_staleness_s: float = 10.0
    # Tier statistics whose window ended longer ago than this are stale.
    max_tier_stats_age_s: float = 15.0
    # Tolerance band: a change predicted to gain less than this (relative) is held.
    min_gain: float = 0.02
    # A slot keeps its step at least this long after changing (doubles per flap penalty).
    min_dwell_s: float = 30.0
    # Cap on the flap-damped dwell time.
    max_dwell_s: float = 1800.0
    # Half-life of a slot's flap penalty (+1 per reversal A->B->A).
    flap_half_life_s: float = 3600.0
    # Rate limit: at most this many table changes in any rate_window_s.
    rate_window_s: float = 60.0
    max_changes_per_window: int = 3
    # Rollback of a change that measurably hurt goodput or broke an SLO.
    rollback_enabled: bool = True
    # Relative drop of goodput (per running request) that counts as a regression.
    rollback_threshold: float = 0.10
    # Seconds of data compared after the change (at least half as much before it).
    rollback_window_s: float = 20.0
    # Windows starting within this long after a change are skipped (engine pick-up).
    rollback_settle_s: float = 2.0
    # Generated tokens each side needs for a verdict.
    rollback_min_tokens: int = 500
    # A change not judged within this long is kept (inconclusive).
    rollback_max_wait_s: float = 120.0
    # Mean running requests differing by more than this factor: inconclusive, kept.
    rollback_max_load_ratio: float = 2.0
    # An SLO counts as broken above slo * (1 + margin).
    rollback_slo_margin: float = 0.05
    # A rolled-back move is blocked this long.
    rollback_cooldown_s: float = 600.0
    # A drop counts as a regression only beyond this many standard deviations of the
    # per-window goodput measured before the change (noise is not a regression).
    rollback_noise_z: float = 2.0

    def __post_init__(self) -> None:
        _validate_config(self, "GuardrailConfig")

    @property
    def policy_change_limit(self) -> int:
        """A policy change is admitted only while the rate window holds fewer changes."""
        return self.max_changes_per_window - (1 if self.rollback_enabled else 0)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self)}
        out["required_fields"] = list(self.required_fields)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, where: str = "guardrails") -> GuardrailConfig:
        """Build from a (YAML/JSON) mapping; missing keys take their defaults.

        Errors name ``where.key`` and the expected form (unknown keys list the valid ones).
        """
        if not isinstance(data, Mapping):
            raise GuardrailError(f"{where}: expected a mapping, got {data!r}")
        names = [f.name for f in fields(cls)]
        unknown = sorted(str(k) for k in data if k not in names)
        if unknown:
            raise GuardrailError(f"{where}: unknown key(s) {unknown}; valid keys are {names}")
        kwargs = dict(data)
        if "required_fields" in kwargs and isinstance(kwargs["required_fields"], list):
            kwargs["required_fields"] = tuple(kwargs["required_fields"])
        for key, value in kwargs.items():
            _check_config_field(f"{where}.{key}", key, value)
        config = cls(**kwargs)
        _check_config_relations(config, where)
        return config


_POSITIVE: Final = (
    "table_ttl_s",
    "max_staleness_s",
    "max_tier_stats_age_s",
    "flap_half_life_s",
    "rate_window_s",
    "rollback_window_s",
    "rollback_max_wait_s",
)
_NON_NEGATIVE: Final = (
    "frozen_keepalive_s",
    "min_gain",
    "min_dwell_s",
    "max_dwell_s",
    "rollback_settle_s",
    "rollback_slo_margin",
    "rollback_cooldown_s",
    "rollback_noise_z",
)


def _check_config_field(where: str, name: str, value: object) -> None:
    if name in _POSITIVE:
        _real(where, value, positive=True)
    elif name in _NON_NEGATIVE:
        _real(where, value, minimum=0.0)
    elif name == "keepalive_fraction":
        if not (is_real(value) and 0.0 < value <= 1.0):
            raise GuardrailError(f"{where}: expected a number in (0, 1], got {value!r}")
    elif name == "rollback_threshold":
        if not (is_real(value) and 0.0 < value < 1.0):
            raise GuardrailError(f"{where}: expected a number in (0, 1), got {value!r}")
    elif name == "rollback_max_load_ratio":
        _real(where, value, minimum=1.0)
    elif name == "max_changes_per_window":
        _int(where, value, minimum=1)
    elif name == "rollback_min_tokens":
        _int(where, value, minimum=0)
    elif name == "rollback_enabled":
        _bool(where, value)
    elif name == "required_fields":
        if not isinstance(value, tuple) or not all(isinstance(v, str) for v in value):
            raise GuardrailError(
                f"{where}: expected a list of Observation field names, got {value!r}"
            )
        bad = [v for v in value if v not in _OBSERVATION_FIELDS]
        if bad:
            raise GuardrailError(
                f"{where}: unknown Observation field(s) {bad}; expected some of "
                f"{sorted(_OBSERVATION_FIELDS)}"
            )


def _check_config_relations(config: GuardrailConfig, where: str) -> None:
    if config.max_dwell_s < config.min_dwell_s:
        raise GuardrailError(
            f"{where}.max_dwell_s: expected >= min_dwell_s={config.min_dwell_s:g}, "
            f"got {config.max_dwell_s!r}"
        )
    if config.rollback_enabled and config.max_changes_per_window < 2:
        raise GuardrailError(
            f"{where}.max_changes_per_window: expected >= 2 while rollback_enabled "
            f"(one change of each window is kept for a rollback), got "
            f"{config.max_changes_per_window!r}"
        )
    needed = config.rollback_settle_s + config.rollback_window_s
    if config.rollback_max_wait_s < needed:
        raise GuardrailError(
            f"{where}.rollback_max_wait_s: expected >= rollback_settle_s + "
            f"rollback_window_s = {needed:g}, got {config.rollback_max_wait_s!r}"
        )


def _validate_config(config: GuardrailConfig, where: str) -> None:
    for f in fields(config):
        _check_config_field(f"{where}.{f.name}", f.name, getattr(config, f.name))
    _check_config_relations(config, where)


# ------------------------------------------------------------------------- override


@dataclass(frozen=True, slots=True, kw_only=True)
class Override:
    """An operator override, active until ``expires_at_s``.

    Exactly one action: ``steps`` (K draft steps), ``disable_speculation`` (0 steps), or
    ``pin_policy`` (run that policy spec; the daemon acts on it, always all slots).
    ``slot`` is a slot lower bound, or None for every slot. Step overrides are clamped to
    the slot's candidates and the Budget like any decision.
    """

    expires_at_s: float
    reason: str
    created_at_s: float
    slot: int | None = None
    steps: int | None = None
    disable_speculation: bool = False
    pin_policy: str | None = None

    def __post_init__(self) -> None:
        _opt_int("Override.slot", self.slot, minimum=1)
        _opt_int("Override.steps", self.steps, minimum=0)
        _bool("Override.disable_speculation", self.disable_speculation)
        if self.pin_policy is not None and (
            not isinstance(self.pin_policy, str) or not self.pin_policy.strip()
        ):
            raise GuardrailError(
                f"Override.pin_policy: expected None or a policy spec string, got "
                f"{self.pin_policy!r}"
            )
        actions = [
            name
            for name, on in (
                ("steps", self.steps is not None),
                ("disable_speculation", self.disable_speculation),
                ("pin_policy", self.pin_policy is not None),
            )
            if on
        ]
        if len(actions) != 1:
            raise GuardrailError(
                "Override: expected exactly one of steps, disable_speculation=True or "
                f"pin_policy, got {actions or 'none'}"
            )
        if self.pin_policy is not None and self.slot is not None:
            raise GuardrailError(
                f"Override.slot: a policy pin applies to every slot; expected None, got "
                f"{self.slot!r}"
            )
        created = _real("Override.created_at_s", self.created_at_s)
        expires = _real("Override.expires_at_s", self.expires_at_s)
        if expires <= created:
            raise GuardrailError(
                f"Override.expires_at_s: expected > created_at_s={created:g}, got {expires!r}"
            )
        if not isinstance(self.reason, str) or not self.reason.strip():
            raise GuardrailError(f"Override.reason: expected a non-empty str, got {self.reason!r}")

    @property
    def kind(self) -> str:
        """``"pin"`` for a policy pin, ``"steps"`` otherwise."""
        return "pin" if self.pin_policy is not None else "steps"

    @property
    def target_steps(self) -> int | None:
        """Steps this override asks for (None for a policy pin)."""
        return 0 if self.disable_speculation else self.steps

    def is_active(self, now_s: float) -> bool:
        # Only expiry counts: created_at_s orders overrides (newest wins) but may come
        # from another clock than the observations.
        return now_s < self.expires_at_s

    def describe(self) -> str:
        where = "all slots" if self.slot is None else f"slot {self.slot}"
        if self.pin_policy is not None:
            what = f"pin policy {self.pin_policy!r}"
        elif self.disable_speculation:
            what = f"{where} -> 0 (speculation disabled)"
        else:
            what = f"{where} -> {self.steps}"
        return f"{what} ({self.reason!r}, until {self.expires_at_s:g} s)"

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": OVERRIDE_VERSION,
            "slot": self.slot,
            "steps": self.steps,
            "disable_speculation": self.disable_speculation,
            "pin_policy": self.pin_policy,
            "expires_at_s": self.expires_at_s,
            "reason": self.reason,
            "created_at_s": self.created_at_s,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Override:
        keys = (
            "version",
            "slot",
            "steps",
            "disable_speculation",
            "pin_policy",
            "expires_at_s",
            "reason",
            "created_at_s",
        )
        d = _keys("Override.from_dict", data, keys)
        if not is_int(d["version"]) or d["version"] != OVERRIDE_VERSION:
            raise GuardrailError(
                f"Override.from_dict: key 'version': expected {OVERRIDE_VERSION}, got "
                f"{d['version']!r}"
            )
        return cls(
            slot=d["slot"],
            steps=d["steps"],
            disable_speculation=d["disable_speculation"],
            pin_policy=d["pin_policy"],
            expires_at_s=d["expires_at_s"],
            reason=d["reason"],
            created_at_s=d["created_at_s"],
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

    def to_dict(self) -> dict[str, Any]:
        return {
            "steps": [list(p) for p in self.steps],
            "expected_gain": self.expected_gain,
            "reason": self.reason.value,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str) -> Wanted:
        d = _keys(where, data, ("steps", "expected_gain", "reason"))
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


# ------------------------------------------------------------------ override helpers


def with_override(overrides: Sequence[Override], override: Override) -> tuple[Override, ...]:
    """``overrides`` plus ``override``, replacing an earlier one of the same kind for the
    same slot (the rule the daemon's store applies when an override is set)."""
    if not isinstance(override, Override):
        raise GuardrailError(f"with_override: expected an Override, got {override!r}")
    kept = tuple(o for o in overrides if (o.slot, o.kind) != (override.slot, override.kind))
    return (*kept, override)


def without_overrides(
    overrides: Sequence[Override], slot: int | None = None
) -> tuple[Override, ...]:
    """``overrides`` less every one (``slot=None``) or those of one slot (all-slot
    overrides stay when a slot is named, as the store clears them)."""
    if slot is not None:
        _int("without_overrides.slot", slot, minimum=1)
        return tuple(o for o in overrides if o.slot != slot)
    return ()


def active_overrides(overrides: Sequence[Override], now_s: float) -> tuple[Override, ...]:
    """Overrides in force at ``now_s``."""
    return tuple(o for o in overrides if o.is_active(now_s))


def pinned_policy(overrides: Sequence[Override], now_s: float) -> str | None:
    """The policy spec an active operator pin asks for (newest wins), else None."""
    pins = [o for o in active_overrides(overrides, now_s) if o.pin_policy is not None]
    if not pins:
        return None
    return max(pins, key=lambda o: o.created_at_s).pin_policy


# ------------------------------------------------------------------ context, proposal


@dataclass(frozen=True, slots=True)
class GuardContext:
    """What every step reads: the observation, the Budget, and derived views of them."""

    observation: Observation
    budget: Budget
    inner_decision: Decision
    # The engine's slots (first bound published as 1), from the observation or as last seen.
    candidates: Candidates | None
    # The steps in force on those slots; None when nothing is in force (or the layout changed).
    current: Slots | None
    # The inner policy's table (or the one it stands by) on those slots.
    wanted: Wanted | None
    # The operator's overrides in force at this decision (the store's, passed in).
    overrides: tuple[Override, ...] = ()
    # The operator switched the policy (policy set, a pin starting or ending): every slot
    # goes to the new policy's table directly, like the end of an override.
    policy_switched: bool = False
    # Overrides passed in that are no longer active (expired since the last decision).
    expired: tuple[Override, ...] = ()

    @property
    def now_s(self) -> float:
        return self.observation.time_s


@dataclass(frozen=True, slots=True)
class Proposal:
    """The decision under construction, as it passes through the steps."""

    steps: Slots | None
    frozen: ReasonCode | None = None
    override_slots: frozenset[int] = frozenset()
    release_slots: frozenset[int] = frozenset()
    rolled_back_slots: frozenset[int] = frozenset()
    forced_slots: frozenset[int] = frozenset()
    held_by: ReasonCode | None = None
    limited_by: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()

    def policy_changes(self, current: Slots | None) -> dict[int, int]:
        """Slots the policy would move (not overrides, releases, rollbacks or the Budget)."""
        if self.steps is None or current is None:
            return {}
        now = dict(current)
        skip = self.override_slots | self.release_slots | self.rolled_back_slots | self.forced_slots
        return {b: k for b, k in self.steps if b not in skip and now.get(b) != k}

    def note(self, text: str, limit: str | None = None) -> Proposal:
        limited = self.limited_by if limit is None else (*self.limited_by, limit)
        return replace(self, notes=(*self.notes, text), limited_by=limited)

    def hold(self, slots: Iterable[int], current: Slots, code: ReasonCode) -> Proposal:
        """Put ``slots`` back to their steps in force; ``code`` is recorded as the holder."""
        back = set(slots)
        now = dict(current)
        assert self.steps is not None
        steps = tuple((b, now[b] if b in back else k) for b, k in self.steps)
        return replace(self, steps=steps, held_by=self.held_by or code)


StepFn: TypeAlias = Callable[
    [GuardContext, Proposal, GuardedState[Any], GuardrailConfig],
    tuple[Proposal, GuardedState[Any]],
]


def _fmt(slots: Iterable[tuple[int, int]]) -> str:
    return "[" + ", ".join(f"{b}:{k}" for b, k in slots) + "]"


def _fmt_moves(moves: Mapping[int, tuple[int, int]]) -> str:
    return ", ".join(f"slot {b} {a}->{c}" for b, (a, c) in sorted(moves.items()))


def engine_layout(raw: Candidates | None) -> Candidates | None:
    """The engine's slots as published: candidates sorted and unique, first bound 1."""
    if not raw:
        return None
    return tuple(
        (1 if i == 0 else b, tuple(sorted(set(steps)))) for i, (b, steps) in enumerate(raw)
    )


def clamp_step(
    steps: int, candidates: Sequence[int], allowed_steps: Sequence[int] | None
) -> tuple[int, tuple[str, ...]]:
    """The nearest lower playable step (the smallest when none is lower) and what limited it.

    Playable: the slot's candidates narrowed to ``allowed_steps``, or all of them (reported
    as ``limited_by_budget``) when the Budget allows none: a step the engine never built
    cannot be published either way.
    """
    cands = sorted(set(candidates))
    allowed = cands if allowed_steps is None else [c for c in cands if c in allowed_steps]
    limits: list[str] = []
    if not allowed:
        allowed = cands
        limits.append(ReasonCode.LIMITED_BY_BUDGET.value)
    if steps in allowed:
        return steps, tuple(limits)
    lower = [c for c in allowed if c <= steps]
    chosen = max(lower) if lower else min(allowed)
    if steps not in cands:
        limits.insert(0, ReasonCode.LIMITED_BY_CANDIDATES.value)
        cand_lower = [c for c in cands if c <= steps]
        nearest = max(cand_lower) if cand_lower else min(cands)
        if nearest != chosen and ReasonCode.LIMITED_BY_BUDGET.value not in limits:
            limits.append(ReasonCode.LIMITED_BY_BUDGET.value)
    elif ReasonCode.LIMITED_BY_BUDGET.value not in limits:
        limits.append(ReasonCode.LIMITED_BY_BUDGET.value)
    return chosen, tuple(limits)


def effective_dwell_s(history: SlotHistory, now_s: float, config: GuardrailConfig) -> float:
    """``min_dwell_s`` doubled per unit of decayed flap penalty, capped at ``max_dwell_s``."""
    penalty = history.penalty_at(now_s, config.flap_half_life_s)
    return min(config.max_dwell_s, config.min_dwell_s * math.pow(2.0, penalty))


# --------------------------------------------------------------------------- steps


def telemetry_problem(
    observation: Observation, config: GuardrailConfig
) -> tuple[ReasonCode, str] | None:
    """Why the telemetry cannot be acted on (code, text), or None when it is fresh."""
    obs = observation
    missing = [name for name in config.required_fields if getattr(obs, name) is None]
    if missing:
        return ReasonCode.HELD_UNKNOWN_TELEMETRY, (
            f"telemetry unknown ({', '.join(missing)} is None)"
        )
    stale: list[str] = []
    if obs.staleness_s is not None and obs.staleness_s > config.max_staleness_s:
        stale.append(
            f"metrics are {obs.staleness_s:.1f} s old > max_staleness_s={config.max_staleness_s:g}"
        )
    if obs.tier_stats is not None:
        age = obs.time_s - obs.tier_stats.window_end_s
        if age > config.max_tier_stats_age_s:
            stale.append(
                f"tier stats ended {age:.1f} s ago > max_tier_stats_age_s="
                f"{config.max_tier_stats_age_s:g}"
            )
    if stale:
        return ReasonCode.HELD_STALE_TELEMETRY, "telemetry stale (" + "; ".join(stale) + ")"
    return None


def freeze_on_unknown_telemetry(
    ctx: GuardContext, p: Proposal, state: GuardedState[Any], config: GuardrailConfig
) -> tuple[Proposal, GuardedState[Any]]:
    """Step 1: hold the table in force when needed telemetry is unknown or stale."""
    problem = telemetry_problem(ctx.observation, config)
    if problem is None:
        return p, replace(state, last_fresh_s=ctx.now_s)
    code, why = problem
    held = replace(p, steps=ctx.current, frozen=code)
    return held.note(f"{why}: policy table dropped, holding the table in force", code.value), state


def apply_overrides(
    ctx: GuardContext, p: Proposal, state: GuardedState[Any], config: GuardrailConfig
) -> tuple[Proposal, GuardedState[Any]]:
    """Step 2: apply the active step overrides to their slots; release ended ones."""
    pin = pinned_policy(ctx.overrides, ctx.now_s)
    if pin is not None:
        p = p.note(f"operator pinned policy {pin!r}")
    for o in ctx.expired:
        p = p.note(f"override expired: {o.describe()}")
    cands = ctx.candidates
    step_overrides = [o for o in ctx.overrides if o.kind == "steps"]
    if cands is None:
        if step_overrides:
            p = p.note("overrides not applied: the engine's slot candidates are unknown")
        return p, state
    bounds = [b for b, _ in cands]
    winners: dict[int, Override] = {}
    for b in bounds:
        mine = [o for o in step_overrides if o.slot == b] or [
            o for o in step_overrides if o.slot is None
        ]
        if mine:
            winners[b] = max(mine, key=lambda o: o.created_at_s)
    for o in step_overrides:
        if o.slot is not None and o.slot not in bounds:
            p = p.note(f"override ignored: slot {o.slot} is not an engine slot {bounds}")
    ended = {b for b in state.override_slots if b in bounds} - set(winners)
    if ctx.policy_switched:
        ended |= set(bounds) - set(winners)
    if p.frozen:
        # Held slots stay as they are; an ended override releases once telemetry is back.
        state = replace(state, override_slots=tuple(sorted(set(winners) | ended)))
    else:
        state = replace(state, override_slots=tuple(sorted(winners)))
        if ended:
            p = replace(p, release_slots=frozenset(ended)).note(
                f"override ended: slots {sorted(ended)} return to the policy's table"
            )
    if not winners:
        return p, state
    base = p.steps if p.steps is not None else ctx.current
    if base is None and len(winners) < len(bounds):
        return p.note(
            "override waits for the policy's first table (it covers some slots only)"
        ), state
    steps = dict(base) if base is not None else {}
    for b, o in winners.items():
        target = o.target_steps
        assert target is not None  # a steps override always has a target
        steps[b] = target
    texts = sorted({o.describe() for o in winners.values()})
    p = replace(p, steps=tuple((b, steps[b]) for b in bounds), override_slots=frozenset(winners))
    return p.note("override active: " + "; ".join(texts), ReasonCode.OVERRIDE_ACTIVE.value), state


def tolerance_band(
    ctx: GuardContext, p: Proposal, state: GuardedState[Any], config: GuardrailConfig
) -> tuple[Proposal, GuardedState[Any]]:
    """Step 3: hold a policy change predicted to gain less than ``min_gain``."""
    if p.frozen or ctx.current is None or ctx.wanted is None:
        return p, state
    changes = p.policy_changes(ctx.current)
    gain = ctx.wanted.expected_gain
    if not changes or gain is None or gain >= config.min_gain:
        return p, state
    code = ReasonCode.HELD_TOLERANCE_BAND
    p = p.hold(changes, ctx.current, code)
    text = (
        f"held slots {sorted(changes)}: expected gain {gain:+.1%} < min_gain {config.min_gain:.1%}"
    )
    return p.note(text, code.value), state


def min_dwell(
    ctx: GuardContext, p: Proposal, state: GuardedState[Any], config: GuardrailConfig
) -> tuple[Proposal, GuardedState[Any]]:
    """Step 4: keep a slot's step for its dwell time; one rollback check at a time."""
    if p.frozen or ctx.current is None:
        return p, state
    changes = p.policy_changes(ctx.current)
    if not changes:
        return p, state
    code = ReasonCode.HELD_MIN_DWELL
    if state.trial is not None:
        p = p.hold(changes, ctx.current, code)
        text = f"held slots {sorted(changes)}: change v{state.trial.version} is still being checked"
        return p.note(text, code.value), state
    held: list[str] = []
    for b in sorted(changes):
        hist = state.history(b)
        if hist is None:
            continue
        dwell = effective_dwell_s(hist, ctx.now_s, config)
        age = ctx.now_s - hist.changed_at_s
        if age < dwell:
            held.append(f"slot {b} changed {age:.0f} s ago < dwell {dwell:.0f} s")
            p = p.hold([b], ctx.current, code)
    if held:
        p = p.note("held " + "; ".join(held), code.value)
    return p, state


def rate_limit(
    ctx: GuardContext, p: Proposal, state: GuardedState[Any], config: GuardrailConfig
) -> tuple[Proposal, GuardedState[Any]]:
    """Step 5: at most ``max_changes_per_window`` changes in any ``rate_window_s``."""
    if p.frozen or ctx.current is None:
        return p, state
    changes = p.policy_changes(ctx.current)
    if not changes:
        return p, state
    recent = [t for t in state.change_times_s if t > ctx.now_s - config.rate_window_s]
    if len(recent) < config.policy_change_limit:
        return p, state
    code = ReasonCode.HELD_RATE_LIMIT
    p = p.hold(changes, ctx.current, code)
    text = (
        f"held slots {sorted(changes)}: {len(recent)} table changes in the last "
        f"{config.rate_window_s:g} s (max {config.max_changes_per_window}"
        + (", one kept for a rollback)" if config.rollback_enabled else ")")
    )
    return p.note(text, code.value), state


def clamp_to_candidates_and_budget(
    ctx: GuardContext, p: Proposal, state: GuardedState[Any], config: GuardrailConfig
) -> tuple[Proposal, GuardedState[Any]]:
    """Step 6: every step one of its slot's candidates and allowed by the Budget."""
    if p.steps is None or ctx.candidates is None or (p.frozen and not p.override_slots):
        # Frozen without an override nothing new is published; commit re-issues the held
        # table only if it still passes this clamp unchanged.
        return p, state
    steps, limits, texts, forced = _clamp_all(ctx, p.steps, p.override_slots)
    if not texts:
        return p, state
    p = replace(p, steps=steps, forced_slots=p.forced_slots | forced)
    p = p.note("clamped " + "; ".join(texts))
    return replace(p, limited_by=(*p.limited_by, *limits)), state


def _clamp_all(
    ctx: GuardContext, steps: Slots, override_slots: frozenset[int]
) -> tuple[Slots, list[str], list[str], frozenset[int]]:
    assert ctx.candidates is not None
    cmap = dict(ctx.candidates)
    current = dict(ctx.current or ())
    out: list[tuple[int, int]] = []
    limits: list[str] = []
    texts: list[str] = []
    forced: set[int] = set()
    allowed = ctx.budget.allowed_steps
    for b, k in steps:
        c, why = clamp_step(k, cmap[b], allowed)
        if c != k or why:
            who = "override " if b in override_slots else ""
            if c != k:
                texts.append(f"{who}slot {b} {k}->{c} (candidates {list(cmap[b])})")
            if not [s for s in cmap[b] if allowed is None or s in allowed]:
                texts.append(
                    f"slot {b}: Budget allowed_steps {list(allowed or ())} "
                    f"contain none of its candidates {list(cmap[b])}"
                )
            limits.extend(w for w in why if w not in limits)
            if c != k and current.get(b) == k:
                forced.add(b)
        out.append((b, c))
    return tuple(out), limits, texts, frozenset(forced)


def rollback(
    ctx: GuardContext, p: Proposal, state: GuardedState[Any], config: GuardrailConfig
) -> tuple[Proposal, GuardedState[Any]]:
    """Step 7: judge the pending change; restore the previous steps if it hurt."""
    if not config.rollback_enabled:
        return p, state
    now = ctx.now_s
    blocks = tuple(b for b in state.blocks if b.until_s > now)
    samples = state.samples
    sample = None if p.frozen else window_sample(ctx.observation)
    if sample is not None and (not samples or sample.end_s > samples[-1].end_s):
        horizon = now - (2 * config.rollback_window_s + config.rollback_settle_s + 60.0)
        samples = tuple(s for s in (*samples, sample) if s.end_s >= horizon)[-_MAX_SAMPLES:]
    else:
        sample = None
    state = replace(state, blocks=blocks, samples=samples)
    trial = state.trial
    if trial is not None:
        trial_slots = {b for b, _, _ in trial.changes}
        if trial_slots & (p.override_slots | p.release_slots):
            p = p.note(f"change v{trial.version} not checked: an override changed its slots")
            trial = None
        else:
            if (
                sample is not None
                and sample.start_s >= trial.started_at_s + config.rollback_settle_s
            ):
                trial = replace(trial, post=trial.post.add(sample))
            noise = goodput_noise(samples, trial.started_at_s)
            verdict, text = evaluate_trial(trial, ctx.budget, config, noise=noise)
            if verdict is None and now - trial.started_at_s > config.rollback_max_wait_s:
                verdict, text = (
                    "inconclusive",
                    (
                        f"change v{trial.version} kept: not enough data within "
                        f"{config.rollback_max_wait_s:g} s to check it"
                    ),
                )
            if verdict == "regressed":
                p, blocks = _roll_back(ctx, p, trial, text, blocks, config)
                state = replace(state, blocks=blocks)
                trial = None
            elif verdict is not None:
                p = p.note(text)
                trial = None
        state = replace(state, trial=trial)
    if blocks and ctx.current is not None and not p.frozen:
        current = dict(ctx.current)
        refused = [
            (b, k, blk)
            for b, k in p.policy_changes(ctx.current).items()
            for blk in blocks
            if blk.slot == b and blk.from_steps == current[b] and blk.to_steps == k
        ]
        if refused:
            p = p.hold([b for b, _, _ in refused], ctx.current, ReasonCode.HELD_NO_CHANGE)
            text = "; ".join(
                f"slot {b} {current[b]}->{k} blocked until {blk.until_s:g} s after a rollback"
                for b, k, blk in refused
            )
            p = p.note(text, ROLLBACK_COOLDOWN)
    return p, state


def _roll_back(
    ctx: GuardContext,
    p: Proposal,
    trial: ChangeTrial,
    text: str,
    blocks: tuple[RollbackBlock, ...],
    config: GuardrailConfig,
) -> tuple[Proposal, tuple[RollbackBlock, ...]]:
    if p.steps is None or ctx.current is None:
        return p.note(text + "; nothing to restore"), blocks
    current = dict(ctx.current)
    restore = {
        b: before
        for b, before, after in trial.changes
        if b not in p.override_slots and current.get(b) == after
    }
    if not restore:
        return p.note(text + "; its slots have moved on, nothing to restore"), blocks
    steps = tuple((b, restore.get(b, k)) for b, k in p.steps)
    limits: list[str] = []
    if ctx.candidates is not None:
        clamped, limits, notes, _ = _clamp_all(ctx, steps, p.override_slots)
        if notes:
            p = p.note("clamped " + "; ".join(notes))
        steps = clamped
    new_blocks = tuple(
        RollbackBlock(
            slot=b,
            from_steps=before,
            to_steps=after,
            until_s=ctx.now_s + config.rollback_cooldown_s,
        )
        for b, before, after in trial.changes
        if b in restore
    )
    p = replace(
        p,
        steps=steps,
        rolled_back_slots=frozenset(restore),
        limited_by=(*p.limited_by, *limits),
    )
    text += (
        f"; restored {_fmt(sorted(restore.items()))}, "
        f"move blocked for {config.rollback_cooldown_s:g} s"
    )
    return p.note(text, ReasonCode.ROLLED_BACK_REGRESSION.value), blocks + new_blocks


def goodput_noise(samples: Sequence[WindowSample], before_s: float) -> float:
    """Relative s.d. of per-window goodput per running request before ``before_s``."""
    rates = [
        s.tokens / s.window_s / max(s.running or 1, 1)
        for s in samples
        if s.end_s <= before_s and s.window_s > 0
    ][-12:]
    if len(rates) < 3:
        return 0.0
    mean = sum(rates) / len(rates)
    if mean <= 0:
        return 0.0
    var = sum((r - mean) ** 2 for r in rates) / (len(rates) - 1)
    return math.sqrt(var) / mean


def evaluate_trial(
    trial: ChangeTrial, budget: Budget, config: GuardrailConfig, *, noise: float = 0.0
) -> tuple[str | None, str]:
    """``("regressed" | "kept" | "inconclusive", message)``, or ``(None, "")`` for more data.

    ``noise``: relative s.d. of the per-window goodput before the change; a drop within
    ``rollback_noise_z`` of it is not called a regression.
    """
    base, post = trial.baseline, trial.post
    if post.seconds < config.rollback_window_s or post.tokens < config.rollback_min_tokens:
        return None, ""
    tag = f"change v{trial.version}"
    per_request = base.load_s is not None and post.load_s is not None
    if per_request:
        b_load, a_load = base.mean_load, post.mean_load
        assert b_load is not None and a_load is not None
        ratio = max(a_load / b_load, b_load / a_load)
        if ratio > config.rollback_max_load_ratio:
            return "inconclusive", (
                f"{tag} kept: load moved too much to judge it (running requests "
                f"{b_load:.1f} -> {a_load:.1f})"
            )
    b_rate, a_rate = base.goodput(per_request), post.goodput(per_request)
    unit = "tok/s per running request" if per_request else "tok/s"
    broken: list[str] = []
    for name, slo, before, after in (
        ("TPOT p50", budget.slo_tpot_ms, base.tpot_ms, post.tpot_ms),
        ("ITL p99", budget.slo_itl_p99_ms, base.itl_p99_ms, post.itl_p99_ms),
    ):
        if slo is None or before is None or after is None:
            continue
        if before <= slo < after / (1.0 + config.rollback_slo_margin):
            broken.append(f"{name} {before:.1f} -> {after:.1f} ms broke its SLO {slo:g} ms")
    change = None
    if b_rate is not None and a_rate is not None and b_rate > 0:
        change = a_rate / b_rate - 1.0
    measured = (
        "" if change is None else f"goodput {b_rate:.2f} -> {a_rate:.2f} {unit} ({change:+.1%})"
    )
    threshold = max(config.rollback_threshold, config.rollback_noise_z * noise)
    if broken or (change is not None and change < -threshold):
        why = "; ".join([m for m in (measured,) if m] + broken)
        return "regressed", f"{tag} rolled back: {why}"
    return "kept", f"{tag} kept after its check: {measured or 'no goodput measured'}"


GUARD_STEPS: Final[tuple[tuple[str, StepFn], ...]] = (
    ("freeze_on_unknown_telemetry", freeze_on_unknown_telemetry),
    ("apply_overrides", apply_overrides),
    ("tolerance_band", tolerance_band),
    ("min_dwell", min_dwell),
    ("rate_limit", rate_limit),
    ("clamp_to_candidates_and_budget", clamp_to_candidates_and_budget),
    ("rollback", rollback),
)


# ---------------------------------------------------------------------- the wrapper


def _next_version(state: GuardedState[Any], observation: Observation) -> int:
    seen = [state.last_version]
    seen += [t.version for t in (state.table, observation.table) if t is not None]
    return max(seen) + 1


def _keepalive_due(table: StepTable, now_s: float, config: GuardrailConfig) -> bool:
    age = now_s - table.produced_at_s
    return age < 0 or age >= table.ttl_s * config.keepalive_fraction


class GuardedPolicy(Generic[S]):
    """``inner`` behind the guardrails (module docstring); a DaemonPolicy itself."""

    __slots__ = ("_config", "_inner")

    def __init__(self, inner: DaemonPolicy[S], config: GuardrailConfig | None = None) -> None:
        if config is not None and not isinstance(config, GuardrailConfig):
            raise GuardrailError(
                f"GuardedPolicy.config: expected a GuardrailConfig, got {config!r}"
            )
        self._inner = inner
        self._config = config or GuardrailConfig()

    @property
    def name(self) -> str:
        return self._inner.name

    @property
    def inner(self) -> DaemonPolicy[S]:
        return self._inner

    @property
    def config(self) -> GuardrailConfig:
        return self._config

    def initial_state(self) -> GuardedState[S]:
        return GuardedState(inner=self._inner.initial_state(), inner_name=self._inner.name)

    def state_from_dict(self, data: Mapping[str, Any]) -> GuardedState[S]:
        state = GuardedState.from_dict(data, self._inner.state_from_dict)
        if state.inner_name != self._inner.name:
            raise GuardrailError(
                f"GuardedState.from_dict: key 'inner_name': state of policy "
                f"{state.inner_name!r}, expected {self._inner.name!r}"
            )
        return state

    def decide(
        self,
        observation: Observation,
        state: GuardedState[S],
        budget: Budget,
        overrides: Sequence[Override] = (),
        policy_switched: bool = False,
    ) -> tuple[Decision, GuardedState[S]]:
        """One guarded decision; ``overrides`` are the operator's (inactive ones ignored);
        ``policy_switched``: the operator just switched to this policy (its table is taken
        without tolerance band, dwell or rate limit, as when an override ends).

        The returned state assumes a published table reaches the engine; when it does
        not, :func:`on_publish_result` takes the change back.
        """
        inner_decision, inner_state = self._inner.decide(observation, state.inner, budget)
        cands = engine_layout(observation.slot_candidates) or state.last_candidates
        st: GuardedState[Any] = replace(state, inner=inner_state, last_candidates=cands)
        current: Slots | None = None
        layout_note = ""
        if st.table is not None:
            bounds = tuple(b for b, _ in st.table.slots)
            if cands is None or bounds == tuple(b for b, _ in cands):
                current = st.table.slots
            else:
                layout_note = f"engine slots changed from {list(bounds)} to {[b for b, _ in cands]}"
        # Stored at commit unless frozen: a table made from unknown telemetry is dropped.
        wanted = _wanted(inner_decision, st.wanted, cands)
        active = active_overrides(overrides, observation.time_s)
        expired = tuple(o for o in overrides if not o.is_active(observation.time_s))
        ctx = GuardContext(
            observation,
            budget,
            inner_decision,
            cands,
            current,
            wanted,
            active,
            policy_switched,
            expired,
        )
        p = Proposal(steps=current)
        if layout_note:
            p = p.note(layout_note)
        if wanted is not None and telemetry_problem(observation, self._config) is None:
            # Clamped up front too, so steps 3-5 judge the changes that would really happen.
            steps, limits, texts, _ = _clamp_all(ctx, wanted.steps, frozenset())
            p = replace(p, steps=steps, limited_by=tuple(limits))
            if texts:
                p = p.note("policy table clamped: " + "; ".join(texts))
        for _, step in GUARD_STEPS:
            p, st = step(ctx, p, st, self._config)
        decision, st = _commit(ctx, p, st, self._config, self._inner.name)
        return decision, st


def on_publish_result(before: GuardedState[S], after: GuardedState[S], ok: bool) -> GuardedState[S]:
    """The guard learns whether the table of the decision that took ``before`` to
    ``after`` reached the engine.

    On success ``after`` stands. On failure the change never happened for the engine:
    the table in force, when it took effect, the slots' change history (dwell, flap
    penalty), the rate-limit window and the rollback trial go back to ``before``, so the
    next decision retries the same change at once with nothing charged for it. What the
    decision learned (inner policy state, telemetry samples, the policy's wanted table)
    is kept, and the version counter never goes back (a version is never reused).
    """
    if ok or after.table is before.table:
        return after
    return replace(
        after,
        table=before.table,
        table_since_s=before.table_since_s,
        slots=before.slots,
        change_times_s=before.change_times_s,
        trial=before.trial,
        blocks=before.blocks,
    )


def _wanted(decision: Decision, previous: Wanted | None, cands: Candidates | None) -> Wanted | None:
    """The inner policy's table on the engine's slots; a hold stands by its last one."""
    if cands is None:
        return previous
    bounds = [b for b, _ in cands]
    if decision.table is None:
        if previous is not None and [b for b, _ in previous.steps] == bounds:
            return previous
        return None
    steps = tuple((b, decision.table.steps_for(b)) for b in bounds)
    gain = decision.expected_gain
    if previous is not None and previous.steps == steps and gain is None:
        # A re-issue of the same table carries no prediction; keep the one it came with.
        gain = previous.expected_gain
    return Wanted(steps=steps, expected_gain=gain, reason=decision.reason)


def _commit(
    ctx: GuardContext,
    p: Proposal,
    state: GuardedState[Any],
    config: GuardrailConfig,
    inner_name: str,
) -> tuple[Decision, GuardedState[Any]]:
    """Publish (or not) the proposal and update the bookkeeping."""
    now = ctx.now_s
    cur = ctx.current
    steps = p.steps
    publishable = (
        steps is not None
        and ctx.candidates is not None
        and [b for b, _ in steps] == [b for b, _ in ctx.candidates]
    )
    initial = cur is None and publishable
    moves: dict[int, tuple[int, int]] = {}
    if cur is not None and steps is not None:
        before = dict(cur)
        moves = {b: (before[b], k) for b, k in steps if before.get(b) != k}
    keepalive = False
    if publishable and not initial and not moves and state.table is not None:
        fresh_enough = (
            state.last_fresh_s is not None and now - state.last_fresh_s <= config.frozen_keepalive_s
        )
        allowed = not p.frozen or bool(p.override_slots) or fresh_enough
        keepalive = allowed and _keepalive_due(state.table, now, config)
        if keepalive and p.frozen and not p.override_slots:
            assert steps is not None
            keepalive = _clamp_all(ctx, steps, frozenset())[0] == steps
    publish = publishable and (initial or bool(moves) or keepalive)

    skip = p.override_slots | p.release_slots | p.rolled_back_slots | p.forced_slots
    policy_moves = {b: m for b, m in moves.items() if b not in skip}
    gain = ctx.wanted.expected_gain if ctx.wanted is not None and policy_moves else None
    reason = _reason(ctx, p, initial, moves, policy_moves)
    table: StepTable | None = None
    notes = list(p.notes)
    if publish:
        assert steps is not None
        version = _next_version(state, ctx.observation)
        table = StepTable(
            slots=steps,
            version=version,
            produced_at_s=now,
            ttl_s=config.table_ttl_s,
            reason=reason.value,
        )
        if initial:
            headline = f"published initial table v{version} {_fmt(steps)}"
        elif moves:
            headline = f"published v{version}: {_fmt_moves(moves)}"
            if gain is not None:
                headline += f" (expected gain {gain:+.1%})"
        else:
            headline = f"re-issued unchanged table as v{version} before its TTL runs out"
        state = replace(state, table=table, last_version=version)
        if initial or moves:
            state, trial_note = _record_change(
                state, ctx, steps, moves, policy_moves, initial, p, config, version
            )
            if trial_note:
                notes.append(trial_note)
    elif state.table is not None:
        headline = f"table v{state.table.version} {_fmt(state.table.slots)} unchanged"
    else:
        headline = "no table published yet"
    if not p.frozen:
        state = replace(state, wanted=ctx.wanted)
    if ctx.inner_decision.message:
        notes.append(
            f"policy {inner_name}: {ctx.inner_decision.reason.value}: {ctx.inner_decision.message}"
        )
    limited = tuple(dict.fromkeys((*ctx.inner_decision.limited_by, *p.limited_by)))
    decision = Decision(
        table=table,
        reason=reason,
        message="; ".join([headline, *notes]),
        expected_gain=gain,
        limited_by=limited,
        restart_recommendation=ctx.inner_decision.restart_recommendation,
    )
    return decision, state


def _reason(
    ctx: GuardContext,
    p: Proposal,
    initial: bool,
    moves: Mapping[int, tuple[int, int]],
    policy_moves: Mapping[int, tuple[int, int]],
) -> ReasonCode:
    if initial:
        return ReasonCode.INITIAL
    if p.rolled_back_slots:
        return ReasonCode.ROLLED_BACK_REGRESSION
    if p.override_slots:
        return ReasonCode.OVERRIDE_ACTIVE
    if p.frozen is not None:
        return p.frozen
    if policy_moves or set(moves) & p.release_slots:
        if ctx.wanted is not None and ctx.wanted.reason in _CHANGE_CODES:
            return ctx.wanted.reason
        return ReasonCode.CHANGED_PREDICTED_GAIN
    if moves:
        if ReasonCode.LIMITED_BY_BUDGET.value in p.limited_by:
            return ReasonCode.LIMITED_BY_BUDGET
        return ReasonCode.LIMITED_BY_CANDIDATES
    if p.held_by is not None:
        return p.held_by
    return ReasonCode.HELD_NO_CHANGE


def _record_change(
    state: GuardedState[Any],
    ctx: GuardContext,
    steps: Slots,
    moves: Mapping[int, tuple[int, int]],
    policy_moves: Mapping[int, tuple[int, int]],
    initial: bool,
    p: Proposal,
    config: GuardrailConfig,
    version: int,
) -> tuple[GuardedState[Any], str]:
    now = ctx.now_s
    since = state.table_since_s
    if initial:
        histories = tuple(
            SlotHistory(slot=b, changed_at_s=now, previous_steps=None) for b, _ in steps
        )
        return replace(state, slots=histories, table_since_s=now, trial=None), ""
    damped = set(policy_moves) | set(p.rolled_back_slots)
    histories_list: list[SlotHistory] = []
    for b, _ in steps:
        hist = state.history(b)
        if b not in moves:
            if hist is not None:
                histories_list.append(hist)
            continue
        before, after = moves[b]
        penalty = 0.0 if hist is None else hist.penalty_at(now, config.flap_half_life_s)
        if b in damped and hist is not None and hist.previous_steps == after:
            penalty += 1.0  # a reversal A->B->A: the slot is flapping
        histories_list.append(
            SlotHistory(slot=b, changed_at_s=now, previous_steps=before, flap_penalty=penalty)
        )
    times = tuple(t for t in state.change_times_s if t > now - config.rate_window_s) + (now,)
    state = replace(state, slots=tuple(histories_list), change_times_s=times, table_since_s=now)
    only_policy = bool(policy_moves) and len(policy_moves) == len(moves)
    if not (config.rollback_enabled and only_policy and state.trial is None):
        return state, ""
    baseline = _baseline(state.samples, since, config)
    if (
        baseline.seconds < config.rollback_window_s / 2
        or baseline.tokens < config.rollback_min_tokens
    ):
        return state, f"v{version} not checked for rollback: too little data before it"
    trial = ChangeTrial(
        version=version,
        started_at_s=now,
        changes=tuple((b, m[0], m[1]) for b, m in sorted(policy_moves.items())),
        baseline=baseline,
    )
    return replace(state, trial=trial), (
        f"v{version} will be checked against the {baseline.seconds:.0f} s before it"
    )


def _baseline(
    samples: Sequence[WindowSample], since_s: float | None, config: GuardrailConfig
) -> WindowAggregate:
    """The last ``rollback_window_s`` of windows that ran entirely on the table in force."""
    start = -math.inf if since_s is None else since_s + config.rollback_settle_s
    eligible = [s for s in samples if s.start_s >= start]
    if not eligible:
        return WindowAggregate()
    last_end = eligible[-1].end_s
    agg = WindowAggregate()
    for s in eligible:
        if s.end_s > last_end - config.rollback_window_s:
            agg = agg.add(s)
    return agg
