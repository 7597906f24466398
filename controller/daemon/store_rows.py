"""What the store writes: arguments checked and encoded into rows, and the SQL of each
write (run by the store inside its transaction; each bounds its table as it inserts).

Every check raises :class:`StoreError` naming the argument and the expected form.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from specgov.controller.daemon.store_errors import StoreError
from specgov.controller.daemon.store_records import (
    OVERRIDE_ID,
    check_finite,
    check_mapping,
    check_opt_finite,
    check_text,
    dumps,
)
from specgov.policies.common.decisions import RestartRecommendation
from specgov.policies.common.step_table import StepTable
from specgov.policies.common.types import PolicyTypeError
from specgov.policies.common.validation import check_bool, check_opt_int
from specgov.policies.guardrails import OVERRIDE_VERSION, Override

__all__ = [
    "clear_filter",
    "decision_row",
    "insert_decision",
    "insert_policy_state",
    "insert_table",
    "parse_override",
    "upsert_override",
]


def decision_row(
    *,
    time_s: float,
    policy: str,
    reason: str,
    message: str,
    limited_by: Sequence[str],
    expected_gain: float | None,
    inputs_summary: Mapping[str, Any] | None,
    table_before: Mapping[str, Any] | None,
    table_after: Mapping[str, Any] | None,
    published: bool,
    restart_recommendation: Mapping[str, Any] | None,
) -> tuple[Any, ...]:
    """The ``decisions`` row of :meth:`StateStore.record_decision`'s arguments, checked
    and encoded (:class:`StoreError` names the bad one)."""
    where = "record_decision"
    t = check_finite(f"{where}.time_s", time_s)
    check_text(f"{where}.policy", policy)
    check_text(f"{where}.reason", reason)
    check_text(f"{where}.message", message, empty_ok=True)
    if isinstance(limited_by, str) or not isinstance(limited_by, Sequence):
        raise StoreError(f"{where}.limited_by: expected a list of str, got {limited_by!r}")
    for i, item in enumerate(limited_by):
        check_text(f"{where}.limited_by[{i}]", item)
    gain = check_opt_finite(f"{where}.expected_gain", expected_gain)
    check_bool(f"{where}.published", published, error=StoreError)
    summary = check_mapping(f"{where}.inputs_summary", inputs_summary or {})
    # Only what the audit row's reader decodes (AuditRecord.from_store), so a row the
    # store takes is never skipped when read back.
    before = _decodable(f"{where}.table_before", table_before, StepTable.from_dict)
    after = _decodable(f"{where}.table_after", table_after, StepTable.from_dict)
    restart = _decodable(
        f"{where}.restart_recommendation", restart_recommendation, RestartRecommendation.from_dict
    )
    return (
        t,
        policy,
        reason,
        message,
        dumps(f"{where}.limited_by", list(limited_by)),
        gain,
        dumps(f"{where}.inputs_summary", summary),
        None if before is None else dumps(f"{where}.table_before", before),
        None if after is None else dumps(f"{where}.table_after", after),
        int(published),
        None if restart is None else dumps(f"{where}.restart_recommendation", restart),
    )


def _decodable(
    where: str, value: Mapping[str, Any] | None, decode: Callable[[Mapping[str, Any]], object]
) -> Mapping[str, Any] | None:
    if value is None:
        return None
    check_mapping(where, value)
    try:
        decode(value)
    except (PolicyTypeError, TypeError) as exc:
        raise StoreError(f"{where}: {exc}") from exc
    return value


def insert_decision(conn: sqlite3.Connection, *, row: tuple[Any, ...], keep: int) -> int:
    """Append a :func:`decision_row`, keeping the newest ``keep``; its id."""
    cur = conn.execute(
        "INSERT INTO decisions (time_s, policy, reason, message, limited_by, "
        "expected_gain, inputs_summary, table_before, table_after, published, "
        "restart_recommendation) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        row,
    )
    new_id = cur.lastrowid
    assert new_id is not None
    # Bound the log; pruning every 1000 rows keeps the cost off the common path.
    if new_id % 1000 == 0:
        conn.execute("DELETE FROM decisions WHERE id <= ?", (new_id - keep,))
    return new_id


def insert_policy_state(conn: sqlite3.Connection, *, row: tuple[str, float, str], keep: int) -> int:
    """Append a ``(policy, time_s, state JSON)`` snapshot, keeping that policy's newest
    ``keep``; its id."""
    policy_name = row[0]
    cur = conn.execute("INSERT INTO policy_state (policy, time_s, state) VALUES (?, ?, ?)", row)
    conn.execute(
        "DELETE FROM policy_state WHERE policy = ?1 AND id NOT IN "
        "(SELECT id FROM policy_state WHERE policy = ?1 ORDER BY id DESC LIMIT ?2)",
        (policy_name, keep),
    )
    assert cur.lastrowid is not None
    return cur.lastrowid


def insert_table(
    conn: sqlite3.Connection, *, row: tuple[int | None, float | None, str], keep: int
) -> int:
    """Append a ``(version, produced_at_s, data JSON)`` table, keeping the newest
    ``keep``; its id."""
    cur = conn.execute("INSERT INTO tables (version, produced_at_s, data) VALUES (?, ?, ?)", row)
    assert cur.lastrowid is not None
    conn.execute("DELETE FROM tables WHERE id <= ?", (cur.lastrowid - keep,))
    return cur.lastrowid


def parse_override(override: Override | Mapping[str, Any]) -> tuple[Override, str | None]:
    """The override given to :meth:`StateStore.put_override` and its id (None: none given)."""
    ov_id: str | None
    if isinstance(override, Override):
        ov, ov_id = override, None
    else:
        data = dict(check_mapping("put_override", override))
        ov_id = data.pop("id", None)
        if ov_id is not None and (
            not isinstance(ov_id, str) or OVERRIDE_ID.fullmatch(ov_id) is None
        ):
            raise StoreError(
                "put_override.id: expected 1-100 visible ASCII characters (no spaces), "
                f"got {ov_id!r}"
            )
        data.setdefault("version", OVERRIDE_VERSION)
        try:
            ov = Override.from_dict(data)
        except ValueError as exc:
            raise StoreError(f"put_override: {exc}") from exc
    return ov, ov_id


def upsert_override(conn: sqlite3.Connection, *, ov: Override, ov_id: str | None) -> str:
    """Write ``ov`` (a new row, or the row ``ov_id`` replaced and un-cleared) and clear
    the uncleared, unexpired override of the same kind for the same slot; its id."""
    fields = (
        ov.slot,
        ov.steps,
        int(ov.disable_speculation),
        ov.pin_policy,
        ov.created_at_s,
        ov.expires_at_s,
        ov.reason,
    )
    if ov_id is None:
        cur = conn.execute(
            "INSERT INTO overrides (id, slot, steps, disable_speculation, pin_policy, "
            "created_at_s, expires_at_s, reason) "
            "VALUES (' pending', ?, ?, ?, ?, ?, ?, ?)",
            fields,
        )
        new_id = base = f"ov-{cur.lastrowid}"
        suffix = 0
        while conn.execute("SELECT 1 FROM overrides WHERE id = ?", (new_id,)).fetchone():
            suffix += 1  # a caller already chose this id
            new_id = f"{base}.{suffix}"
        conn.execute("UPDATE overrides SET id = ? WHERE seq = ?", (new_id, cur.lastrowid))
    else:
        new_id = ov_id
        conn.execute(
            "INSERT INTO overrides (id, slot, steps, disable_speculation, pin_policy, "
            "created_at_s, expires_at_s, reason) VALUES (?, ?, ?, ?, ?, ?, ?, ?) "
            "ON CONFLICT (id) DO UPDATE SET slot = excluded.slot, steps = excluded.steps, "
            "disable_speculation = excluded.disable_speculation, "
            "pin_policy = excluded.pin_policy, created_at_s = excluded.created_at_s, "
            "expires_at_s = excluded.expires_at_s, reason = excluded.reason, "
            "cleared_at_s = NULL",
            (new_id, *fields),
        )
    pin = ov.pin_policy is not None
    conn.execute(
        "UPDATE overrides SET cleared_at_s = ? WHERE id != ? AND cleared_at_s IS NULL "
        "AND expires_at_s > ? AND slot IS ? AND (pin_policy IS NOT NULL) = ?",
        (ov.created_at_s, new_id, ov.created_at_s, ov.slot, int(pin)),
    )
    return new_id


def clear_filter(
    override_id: str | None, slot: int | None, all: bool, *, now_s: float | None
) -> tuple[str, tuple[Any, ...]]:
    """The ``WHERE`` clause and its parameters for :meth:`StateStore.clear_override`'s
    selector (exactly one of ``override_id``, ``slot``, ``all``)."""
    chosen = [
        name
        for name, on in (
            ("override_id", override_id is not None),
            ("slot", slot is not None),
            ("all", all is True),
        )
        if on
    ]
    if len(chosen) != 1:
        raise StoreError(
            f"clear_override: expected exactly one of override_id, slot or all=True, "
            f"got {chosen or 'none'}"
        )
    if override_id is not None:
        check_text("clear_override.override_id", override_id)
    check_opt_int("clear_override.slot", slot, error=StoreError, minimum=1)
    now = time.time() if now_s is None else check_finite("clear_override.now_s", now_s)
    where = "cleared_at_s IS NULL AND expires_at_s > ?"
    params: tuple[Any, ...] = (now, now)
    if override_id is not None:
        where += " AND id = ?"
        params += (override_id,)
    elif slot is not None:
        where += " AND slot = ?"
        params += (slot,)
    return where, params
