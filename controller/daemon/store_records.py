"""The state store's rows: the record types it returns, the checks on what it is given,
the JSON codec of its columns, and decoding a stored row.

A row whose JSON (or override fields) cannot be decoded raises :class:`BadRow`; the
store skips it with a warning naming its table and id, so reads never crash on one bad
row. Bad arguments raise :class:`StoreError`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import msgspec

from specgov.controller.daemon.store_errors import StoreError
from specgov.policies.common.errors import SpecgovError
from specgov.policies.common.types import PolicyTypeError
from specgov.policies.common.validation import check_int, check_opt_real, check_real
from specgov.policies.control.core import AuditRecord
from specgov.policies.guardrails import Override

__all__ = [
    "DECISION_COLUMNS",
    "OVERRIDE_COLUMNS",
    "OVERRIDE_ID",
    "BadRow",
    "OverrideRecord",
    "PolicySnapshot",
    "check_finite",
    "check_mapping",
    "check_opt_finite",
    "check_positive_int",
    "check_text",
    "decision_from_row",
    "dumps",
    "loads",
    "override_from_row",
]

# Visible ASCII, as the control API accepts (so a stored id can always be sent back);
# the placeholder used while generating an id contains a space, so never matches.
OVERRIDE_ID: Final = re.compile(r"[\x21-\x7e]{1,100}")
DECISION_COLUMNS: Final = (
    "id, time_s, policy, reason, message, limited_by, expected_gain, inputs_summary, "
    "table_before, table_after, published, restart_trigger"
)
OVERRIDE_COLUMNS: Final = (
    "seq, id, slot, steps, disable_speculation, pin_policy, created_at_s, expires_at_s, "
    "reason, cleared_at_s"
)


@dataclass(frozen=True, slots=True)
class OverrideRecord:
    """A stored override: its id, the override itself, and when it was cleared (if)."""

    id: str
    override: Override
    cleared_at_s: float | None = None

    def is_active(self, now_s: float) -> bool:
        return self.cleared_at_s is None and self.override.is_active(now_s)

    # The API's flat shape: the override's own fields plus id and cleared_at_s.
    def to_dict(self) -> dict[str, Any]:
        """``Override.to_dict()`` plus ``id`` and ``cleared_at_s``."""
        return {"id": self.id, **self.override.to_dict(), "cleared_at_s": self.cleared_at_s}


@dataclass(frozen=True, slots=True)
class PolicySnapshot:
    """A saved policy state (``state`` is what the policy's ``to_dict`` returned)."""

    id: int
    policy: str
    time_s: float
    state: Mapping[str, Any]


# --------------------------------------------------------------------------- checks


def check_finite(where: str, value: object) -> float:
    return check_real(where, value, error=StoreError)


def check_opt_finite(where: str, value: object) -> float | None:
    return check_opt_real(where, value, error=StoreError)


def check_text(where: str, value: object, *, empty_ok: bool = False) -> str:
    if not isinstance(value, str) or (not empty_ok and not value.strip()):
        form = "a str" if empty_ok else "a non-empty str"
        raise StoreError(f"{where}: expected {form}, got {value!r}")
    return value


def check_positive_int(where: str, value: object) -> int:
    return check_int(where, value, error=StoreError, minimum=1)


def _json_default(value: object) -> Any:
    # numpy scalars and arrays reach the audit log through inputs summaries; a lost
    # audit row would cost more than this conversion.
    for attr in ("tolist", "item"):
        convert = getattr(value, attr, None)
        if callable(convert):
            return convert()
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


# msgspec, not json.dumps: the policy state (~15-25 KB, mostly floats) is written at
# every decision, and json.dumps spent ~0.55 ms of CPU on it, msgspec ~0.04 ms (issue 8:
# the daemon's overhead). The same compact UTF-8 JSON; the differences: a non-finite float
# is written as null (json.dumps wrote the non-JSON token NaN, which other readers refuse)
# and a set as a list.
_ENCODER: Final = msgspec.json.Encoder(enc_hook=_json_default)


def dumps(where: str, value: object) -> str:
    try:
        return _ENCODER.encode(value).decode("utf-8")
    except (TypeError, ValueError, OverflowError) as exc:
        raise StoreError(f"{where}: expected a JSON-serialisable value: {exc}") from exc


def check_mapping(where: str, value: object) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise StoreError(f"{where}: expected a mapping, got {value!r}")
    return value


class BadRow(SpecgovError, ValueError):
    """A stored row that cannot be decoded; the reader skips it with a warning."""


def loads(column: str, raw: object, kind: type[Any]) -> Any:
    if not isinstance(raw, str):
        raise BadRow(f"column {column}: expected JSON text, got {type(raw).__name__}")
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise BadRow(f"column {column}: corrupt JSON ({exc})") from exc
    if not isinstance(value, kind):
        raise BadRow(f"column {column}: expected a JSON {kind.__name__}, got {value!r:.80}")
    return value


def _opt_loads(column: str, raw: object) -> dict[str, Any] | None:
    return None if raw is None else loads(column, raw, dict)


def decision_from_row(row: Sequence[Any]) -> AuditRecord:
    """The audit row of a ``decisions`` row (:data:`DECISION_COLUMNS`)."""
    row_id, t, policy, reason, message, limited, gain, summary, before, after = row[:10]
    published, trigger = row[10], row[11]
    limited_by = loads("limited_by", limited, list)
    if not all(isinstance(x, str) for x in limited_by):
        raise BadRow(f"column limited_by: expected a list of str, got {limited_by!r:.80}")
    data = {
        "time_s": t,
        "policy": policy,
        "reason": reason,
        "message": message,
        "limited_by": limited_by,
        "expected_gain": gain,
        "inputs_summary": loads("inputs_summary", summary, dict),
        "table_before": _opt_loads("table_before", before),
        "table_after": _opt_loads("table_after", after),
        "published": bool(published),
        "restart_trigger": _opt_loads("restart_trigger", trigger),
    }
    try:
        return AuditRecord.from_store(data, id=int(row_id))
    except (PolicyTypeError, TypeError, ValueError) as exc:
        raise BadRow(str(exc)) from exc


def override_from_row(row: Sequence[Any]) -> OverrideRecord:
    _seq, ov_id, slot, steps, disable, pin, created, expires, reason, cleared = row
    try:
        ov = Override(
            slot=slot,
            steps=steps,
            disable_speculation=bool(disable),
            pin_policy=pin,
            created_at_s=created,
            expires_at_s=expires,
            reason=reason,
        )
    except ValueError as exc:
        raise BadRow(str(exc)) from exc
    return OverrideRecord(
        id=str(ov_id), override=ov, cleared_at_s=None if cleared is None else float(cleared)
    )
