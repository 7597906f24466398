"""Shared pieces of the guardrails: types, constants, the typed error, value checks."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import fields
from typing import Any, Final, TypeAlias, TypeVar

from specgov.policies.common.codec import NonNegInt, PosInt
from specgov.policies.common.decisions import ReasonCode
from specgov.policies.common.observation import Observation
from specgov.policies.common.types import PolicyTypeError, SlotLayout
from specgov.policies.common.validation import (
    check_bool,
    check_int,
    check_keys,
    check_opt_int,
    check_opt_real,
    check_real,
)
from specgov.policies.daemon.protocol import PolicyState

GUARD_STATE_VERSION: Final = 2
V1_ONLY_KEYS: Final = frozenset({"overrides", "released_slots", "release_all"})
OVERRIDE_VERSION: Final = 1

S = TypeVar("S", bound=PolicyState)
T = TypeVar("T", bound=PolicyState)

# Slot layouts as the guard holds them; the annotations are also their schema (codec).
Slots: TypeAlias = tuple[tuple[PosInt, NonNegInt], ...]
Candidates: TypeAlias = SlotLayout  # as the guard holds it: first bound published as 1

ROLLBACK_COOLDOWN: Final = "rollback_cooldown"
OBSERVATION_FIELDS: Final = frozenset(f.name for f in fields(Observation)) - {"time_s"}
# Decision codes a policy uses for a change; anything else is reported as a predicted gain.
CHANGE_CODES: Final = frozenset(
    {
        ReasonCode.CHANGED_PREDICTED_GAIN,
        ReasonCode.LIMITED_BY_SLO,
        ReasonCode.LIMITED_BY_BUDGET,
        ReasonCode.LIMITED_BY_CANDIDATES,
        ReasonCode.STATIC_POLICY,
    }
)
# Window samples kept for rollback baselines (bounded however fast the daemon decides).
MAX_SAMPLES: Final = 512


class GuardrailError(PolicyTypeError):
    """Bad guardrail input (config, override, serialised state); the message names it."""


# --------------------------------------------------------------------------- checks


def guard_real(
    where: str, value: object, *, minimum: float | None = None, positive: bool = False
) -> float:
    return check_real(where, value, error=GuardrailError, minimum=minimum, positive=positive)


def _opt_real(where: str, value: object) -> float | None:
    return check_opt_real(where, value, error=GuardrailError)


def guard_int(where: str, value: object, *, minimum: int | None = None) -> int:
    return check_int(where, value, error=GuardrailError, minimum=minimum)


def guard_opt_int(where: str, value: object, *, minimum: int | None = None) -> int | None:
    return check_opt_int(where, value, error=GuardrailError, minimum=minimum)


def guard_bool(where: str, value: object) -> bool:
    return check_bool(where, value, error=GuardrailError)


def _keys(
    owner: str, data: object, required: Sequence[str], optional: Sequence[str] = ()
) -> Mapping[str, Any]:
    return check_keys(owner, data, required, error=GuardrailError, optional=optional)


def _list(where: str, value: object) -> list[Any]:
    if not isinstance(value, list | tuple):
        raise GuardrailError(f"{where}: expected a list, got {value!r}")
    return list(value)
