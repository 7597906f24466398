"""StateStore: round trips, schema migrations, and behaviour on unusable files.

Read-only files: as root, file modes do not stop writes, so the permission test drops
to ``nobody`` in a subprocess (skipped where that is impossible); the always-run test
opens the file through SQLite's ``mode=ro`` URI, which yields SQLite's real
SQLITE_READONLY. A full disk is produced for real with ``PRAGMA max_page_count`` (SQLite
then answers SQLITE_FULL, "database or disk is full"), and once more with an injected
connection whose INSERT raises that error, as a full filesystem would.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import sqlite3
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from store_raw import integrity, schema_version, table_history

from specgov.controller.daemon import store_schema
from specgov.controller.daemon.state_store import StateStore
from specgov.controller.daemon.store_errors import (
    StoreCorrupt,
    StoreError,
    StoreSchemaError,
    StoreUnavailable,
)
from specgov.controller.daemon.store_schema import LATEST_SCHEMA_VERSION, Migration
from specgov.policies.common.decisions import RestartRecommendation
from specgov.policies.common.step_table import StepTable
from specgov.policies.common.types import SpecShape
from specgov.policies.control.core import AuditRecord
from specgov.policies.guardrails import Override


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return tmp_path / "state" / "specgov.db"


@pytest.fixture
def store(db: Path) -> Iterator[StateStore]:
    s = StateStore(db)
    yield s
    s.close()


def _raw(path: Path) -> sqlite3.Connection:
    return sqlite3.connect(str(path), isolation_level=None)


def _table(slots: tuple[tuple[int, int], ...], version: int) -> dict[str, Any]:
    """A table as the daemon stores it (``StepTable.to_dict``)."""
    return StepTable(slots, version, float(version), 30.0).to_dict()


def _decision(i: int, **extra: Any) -> dict[str, Any]:
    data: dict[str, Any] = {
        "time_s": 100.0 + i,
        "policy": "goodput",
        "reason": "CHANGED_PREDICTED_GAIN",
        "message": f"decision {i}",
        "limited_by": ["limited_by_budget"],
        "expected_gain": 0.05 * i,
        "inputs_summary": {"running": i, "window_s": 5.0},
        "table_before": _table(((1, 3),), i),
        "table_after": _table(((1, 2),), i + 1),
        "published": i % 2 == 0,
        "restart_recommendation": None,
    }
    data.update(extra)
    return data


def _override(slot: int | None = 1, steps: int | None = 2, **extra: Any) -> dict[str, Any]:
    ov = Override(
        slot=slot,
        steps=steps,
        created_at_s=extra.pop("created_at_s", 1000.0),
        expires_at_s=extra.pop("expires_at_s", 2000.0),
        reason=extra.pop("reason", "load test"),
        **extra,
    )
    return ov.to_dict()


# ------------------------------------------------------------------ round trips


def test_decisions_round_trip_across_reopen(db: Path) -> None:
    with StateStore(db) as s:
        ids = [s.record_decision(**_decision(i)) for i in range(3)]
        sparse = s.record_decision(
            time_s=200.0,
            policy="static",
            reason="HELD_NO_CHANGE",
            message="",
            limited_by=(),
            expected_gain=None,
            inputs_summary={},
            table_before=None,
            table_after=None,
            published=False,
        )
    assert ids == sorted(ids) and len(set(ids)) == 3
    with StateStore(db) as s:
        rows = s.decisions()
        assert [r.id for r in rows] == [sparse, *reversed(ids)]  # newest first
        first = rows[-1]
        expected = {"id": ids[0], **_decision(0)}
        assert first.to_dict() == expected
        assert first.limited_by == ("limited_by_budget",)
        assert rows[0].table_before is None and rows[0].expected_gain is None
        assert [r.id for r in s.decisions(since_s=101.0)] == [sparse, ids[2], ids[1]]
        assert [r.id for r in s.decisions(limit=2)] == [sparse, ids[2]]
        assert [r.id for r in s.decisions(policy="static")] == [sparse]
        assert json.loads(json.dumps(first.to_dict())) == expected


def test_numpy_values_in_summaries_are_stored_as_plain_json(store: StateStore) -> None:
    store.record_decision(
        **_decision(1, inputs_summary={"n": np.int64(7), "x": np.float32(0.5), "v": np.arange(3)})
    )
    (row,) = store.decisions()
    assert row.inputs_summary == {"n": 7, "x": 0.5, "v": [0, 1, 2]}


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"time_s": float("nan")}, "record_decision.time_s"),
        ({"policy": ""}, "record_decision.policy"),
        ({"limited_by": "budget"}, "record_decision.limited_by"),
        ({"expected_gain": "high"}, "record_decision.expected_gain"),
        ({"published": 1}, "record_decision.published"),
        ({"inputs_summary": {"obj": object()}}, "record_decision.inputs_summary"),
        ({"table_after": [1, 2]}, "record_decision.table_after"),
        ({"table_after": {"version": 1}}, "record_decision.table_after: StepTable.from_dict"),
        ({"restart_recommendation": {"source": "policy"}}, "record_decision.restart_rec"),
    ],
)
def test_bad_decision_input_is_rejected_by_field(
    store: StateStore, change: dict[str, Any], field: str
) -> None:
    with pytest.raises(StoreError, match=field.replace(".", r"\.")):
        store.record_decision(**_decision(0, **change))
    assert store.decisions() == []


def test_overrides_put_list_expire_and_clear(db: Path) -> None:
    with StateStore(db) as s:
        a = s.put_override(_override(slot=1, steps=2))
        b = s.put_override({**_override(slot=2, steps=None, disable_speculation=True), "id": "b"})
        c = s.put_override(
            Override(pin_policy="static:3", created_at_s=1000.0, expires_at_s=1500.0, reason="pin")
        )
        d = s.put_override(_override(slot=4, steps=1, expires_at_s=1100.0))
        assert a == "ov-1" and b == "b" and c.startswith("ov-")
    with StateStore(db) as s:
        active = s.list_overrides(now_s=1200.0)
        assert [r.id for r in active] == [a, b, c]  # d expired at 1100
        assert active[1].override.target_steps == 0
        assert active[2].override.pin_policy == "static:3"
        assert active[0].to_dict()["slot"] == 1 and active[0].to_dict()["cleared_at_s"] is None
        assert d in [r.id for r in s.list_overrides(now_s=1200.0, include_expired=True)]
        assert [r.id for r in s.list_overrides(now_s=1600.0)] == [a, b]  # the pin expired

        assert s.clear_override(override_id=b, now_s=1200.0) == 1
        assert s.clear_override(override_id=b, now_s=1200.0) == 0
        assert s.clear_override(override_id=d, now_s=1200.0) == 0  # expired: nothing to clear
        assert s.clear_override(slot=1, now_s=1200.0) == 1
        assert [r.id for r in s.list_overrides(now_s=1200.0)] == [c]
        cleared = {r.id: r for r in s.list_overrides(1200.0, include_cleared=True)}
        assert cleared[b].cleared_at_s == 1200.0 and not cleared[b].is_active(1200.0)
        assert s.clear_override(all=True, now_s=1200.0) == 1
        assert s.list_overrides(now_s=1200.0) == []


def test_a_new_override_supersedes_one_of_the_same_slot_and_kind(store: StateStore) -> None:
    first = store.put_override(_override(slot=1, steps=2))
    other_slot = store.put_override(_override(slot=2, steps=2))
    pin = store.put_override(_override(slot=None, steps=None, pin_policy="static:1"))
    second = store.put_override(_override(slot=1, steps=4, created_at_s=1100.0))
    ids = [r.id for r in store.list_overrides(now_s=1200.0)]
    assert ids == [other_slot, pin, second]
    (old,) = [r for r in store.list_overrides(1200.0, include_cleared=True) if r.id == first]
    assert old.cleared_at_s == 1100.0


def test_putting_an_existing_id_replaces_and_reactivates_it(store: StateStore) -> None:
    store.put_override({**_override(slot=1, steps=2), "id": "op-1"})
    assert store.clear_override(all=True, now_s=1500.0) == 1
    store.put_override({**_override(slot=1, steps=3), "id": "op-1"})
    (row,) = store.list_overrides(now_s=1500.0)
    assert (row.id, row.override.steps, row.cleared_at_s) == ("op-1", 3, None)


def test_a_caller_id_that_looks_generated_does_not_collide(store: StateStore) -> None:
    store.put_override({**_override(slot=1), "id": "ov-2"})
    generated = store.put_override(_override(slot=2))
    assert generated != "ov-2"
    assert sorted(r.id for r in store.list_overrides(1500.0)) == sorted(["ov-2", generated])


@pytest.mark.parametrize(
    ("data", "match"),
    [
        ({**_override(), "steps": -1}, "Override.steps"),
        ({**_override(), "expires_at_s": 10.0}, "Override.expires_at_s"),
        ({**_override(), "colour": "red"}, "unknown key"),
        ({**_override(), "id": "has space"}, "put_override.id"),
        ({**_override(), "id": "x" * 101}, "put_override.id"),
        ({**_override(), "id": 7}, "put_override.id"),
    ],
)
def test_bad_override_is_rejected(store: StateStore, data: dict[str, Any], match: str) -> None:
    with pytest.raises(StoreError, match=match):
        store.put_override(data)
    assert store.list_overrides(1500.0, include_expired=True) == []


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"override_id": "a", "slot": 1}, {"slot": 1, "all": True}, {"slot": 0}, {"all": False}],
)
def test_clear_override_needs_exactly_one_valid_selector(
    store: StateStore, kwargs: dict[str, Any]
) -> None:
    with pytest.raises(StoreError, match="clear_override"):
        store.clear_override(**kwargs)


def test_policy_state_keeps_the_latest_snapshots(db: Path) -> None:
    with StateStore(db, keep_policy_snapshots=3) as s:
        for i in range(6):
            s.save_policy_state("goodput", {"step": i, "nested": {"a": [i]}}, time_s=10.0 * i)
        s.save_policy_state("bandit", {"arm": 1}, time_s=5.0)
    with StateStore(db) as s:
        assert s.load_policy_state("goodput") == {"step": 5, "nested": {"a": [5]}}
        snap = s.load_policy_snapshot("goodput")
        assert snap is not None and snap.time_s == 50.0 and snap.policy == "goodput"
        assert s.load_policy_state("bandit") == {"arm": 1}
        assert s.load_policy_state("ema") is None
    with _raw(db) as raw:
        counts = dict(raw.execute("SELECT policy, COUNT(*) FROM policy_state GROUP BY policy"))
    assert counts == {"goodput": 3, "bandit": 1}


def test_tables_history_is_bounded_and_last_is_newest(db: Path) -> None:
    with StateStore(db, keep_tables=4) as s:
        assert s.last_table() is None
        for v in range(1, 8):
            s.save_table({"slots": [[1, v % 3]], "version": v, "produced_at_s": float(v)})
    with StateStore(db) as s:
        assert s.last_table() == {"slots": [[1, 1]], "version": 7, "produced_at_s": 7.0}
        assert [t["version"] for t in table_history(db, 10)] == [4, 5, 6, 7]
        assert [t["version"] for t in table_history(db, 2)] == [6, 7]


def test_settings_round_trip(db: Path) -> None:
    with StateStore(db) as s:
        assert s.get_setting("policy_spec") is None
        assert s.get_setting("policy_spec", "goodput") == "goodput"
        s.set_setting("policy_spec", "bandit")
        s.set_setting("policy_spec", "static:3")
        s.set_setting("ui", {"cols": [1, 2], "on": True})
        with pytest.raises(StoreError, match="set_setting"):
            s.set_setting("bad", object())
        with pytest.raises(StoreError, match="set_setting"):
            s.set_setting("bad", {(1, 2): "a tuple key"})
        s.set_setting("odd", {"nan": float("nan"), "set": {3}})
    with StateStore(db) as s:
        assert s.get_setting("policy_spec") == "static:3"
        assert s.get_setting("ui") == {"cols": [1, 2], "on": True}
        # Stored as JSON any reader accepts: a non-finite float as null, a set as a list.
        assert s.get_setting("odd") == {"nan": None, "set": [3]}
        assert s.get_setting("bad") is None
        assert s.get_setting("bad", "absent") == "absent"


def test_connections_use_wal_and_full_sync(db: Path) -> None:
    opened: list[sqlite3.Connection] = []

    def connect(path: Path) -> sqlite3.Connection:
        conn = sqlite3.connect(str(path), check_same_thread=False)
        opened.append(conn)
        return conn

    with StateStore(db, connect=connect):
        (conn,) = opened
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert conn.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL


def test_concurrent_writers_from_threads(store: StateStore) -> None:
    def work(k: int) -> None:
        for i in range(25):
            store.record_decision(**_decision(i, message=f"t{k}-{i}"))

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    rows = store.decisions(limit=1000)
    assert len(rows) == 100 and len({r.message for r in rows}) == 100


def test_closed_store_refuses_calls(db: Path) -> None:
    s = StateStore(db)
    s.close()
    with pytest.raises(StoreError, match="closed"):
        s.decisions()


def test_one_audit_row_type_from_the_core_to_the_store_and_back(store: StateStore) -> None:
    """The core's AuditRecord is what the store reads back: its persisted form (the
    store's columns, the journal's queued rows) loses nothing of what is persisted."""
    rec = RestartRecommendation(SpecShape("NONE", 0, 0, 0, ()), "policy", "drafter costs", 0.2)
    made = AuditRecord(
        time_s=12.0,
        policy="goodput",
        reason="changed_predicted_gain",
        message="published v3",
        limited_by=("limited_by_budget",),
        expected_gain=0.04,
        inputs_summary={"running": 8},
        table_before=StepTable(((1, 3), (8, 1)), 2, 5.0, 30.0),
        table_after=StepTable(((1, 5), (8, 1)), 3, 12.0, 30.0, reason="changed_predicted_gain"),
        published=True,
        restart_recommendation=rec,
        decide_ms=0.5,  # not persisted, like the other fields after ``published``
    )
    row_id = store.record_decision(**made.to_store())
    (read,) = store.decisions()
    assert read == dataclasses.replace(made, decide_ms=None, id=row_id)
    assert read.to_dict() == {"id": row_id, **made.to_store()}
    # A journal row from before this type was the store's (the same keys, JSON'd).
    queued = json.loads(json.dumps(made.to_store()))
    assert AuditRecord.from_store(queued, id=row_id) == read


def test_a_row_whose_table_no_longer_decodes_is_skipped_and_kept(
    db: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with StateStore(db) as s:
        ids = [s.record_decision(**_decision(i)) for i in range(2)]
    future = json.dumps({"schema": 99, "slots": [[1, 3]]})
    with _raw(db) as raw:
        raw.execute("UPDATE decisions SET table_after = ? WHERE id = ?", (future, ids[0]))
    caplog.set_level(logging.WARNING, logger="specgov.controller.daemon.state_store")
    with StateStore(db) as s:
        assert [r.id for r in s.decisions()] == [ids[1]]
    assert f"decisions row id={ids[0]} skipped" in caplog.text and "table format 99" in caplog.text
    with _raw(db) as raw:  # the row itself stays on disk
        assert raw.execute("SELECT table_after FROM decisions WHERE id = ?", (ids[0],)).fetchone()


# ------------------------------------------------------------------ corrupt rows


def test_corrupt_rows_are_skipped_with_a_warning(
    db: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with StateStore(db) as s:
        ids = [s.record_decision(**_decision(i)) for i in range(3)]
        s.save_policy_state("goodput", {"step": 1}, 1.0)
        bad_state = s.save_policy_state("goodput", {"step": 2}, 2.0)
        s.save_table({"version": 1})
        s.save_table({"version": 2})
        s.set_setting("policy_spec", "goodput")
        s.put_override({**_override(slot=1), "id": "good"})
        s.put_override({**_override(slot=2), "id": "bad"})
    with _raw(db) as raw:
        raw.execute("UPDATE decisions SET inputs_summary = '{oops' WHERE id = ?", (ids[1],))
        raw.execute("UPDATE decisions SET limited_by = '{}' WHERE id = ?", (ids[2],))
        raw.execute("UPDATE policy_state SET state = 'nope' WHERE id = ?", (bad_state,))
        raw.execute("UPDATE tables SET data = '[1' WHERE version = 2")
        raw.execute("UPDATE settings SET value = '{' WHERE key = 'policy_spec'")
        raw.execute("UPDATE overrides SET expires_at_s = 1.0 WHERE id = 'bad'")
    caplog.set_level(logging.WARNING, logger="specgov.controller.daemon.state_store")
    with StateStore(db) as s:
        assert [r.id for r in s.decisions()] == [ids[0]]
        assert s.load_policy_state("goodput") == {"step": 1}  # falls back to the older one
        assert s.last_table() == {"version": 1}
        assert s.get_setting("policy_spec", "default") == "default"
        assert [r.id for r in s.list_overrides(now_s=0.0)] == ["good"]
    text = caplog.text
    for needle in (
        f"decisions row id={ids[1]}",
        f"decisions row id={ids[2]}",
        f"policy_state row id={bad_state}",
        "tables row id=2",
        "settings row id='policy_spec'",
        "overrides row id=bad",
    ):
        assert needle in text, needle


# ------------------------------------------------------------------ schema

V1_DDL = """
CREATE TABLE schema_version (version INTEGER PRIMARY KEY, description TEXT NOT NULL,
    applied_at_s REAL NOT NULL);
CREATE TABLE decisions (id INTEGER PRIMARY KEY AUTOINCREMENT, time_s REAL NOT NULL,
    policy TEXT NOT NULL, reason TEXT NOT NULL, message TEXT NOT NULL,
    limited_by TEXT NOT NULL, expected_gain REAL, inputs_summary TEXT NOT NULL,
    table_before TEXT, table_after TEXT);
CREATE TABLE overrides (seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL UNIQUE,
    slot INTEGER, steps INTEGER, disable_speculation INTEGER NOT NULL, pin_policy TEXT,
    created_at_s REAL NOT NULL, expires_at_s REAL NOT NULL, reason TEXT NOT NULL,
    cleared_at_s REAL);
CREATE TABLE policy_state (id INTEGER PRIMARY KEY AUTOINCREMENT, policy TEXT NOT NULL,
    time_s REAL NOT NULL, state TEXT NOT NULL);
CREATE INDEX policy_state_by_policy ON policy_state (policy, id);
CREATE TABLE tables (id INTEGER PRIMARY KEY AUTOINCREMENT, version INTEGER,
    produced_at_s REAL, data TEXT NOT NULL);
INSERT INTO schema_version VALUES (1, 'hand-made v1', 0.0);
INSERT INTO decisions (time_s, policy, reason, message, limited_by, expected_gain,
    inputs_summary, table_before, table_after)
    VALUES (5.0, 'goodput', 'INITIAL', 'from v1', '[]', NULL, '{"running": 3}', NULL,
    '{"schema": 1, "slots": [[1, 3]], "version": 1, "produced_at_s": 4.0, "ttl_s": 30.0}');
INSERT INTO overrides (id, slot, steps, disable_speculation, pin_policy, created_at_s,
    expires_at_s, reason) VALUES ('old', 1, 0, 0, NULL, 1.0, 9999.0, 'kept across upgrade');
"""


def test_fresh_file_records_every_migration(store: StateStore, db: Path) -> None:
    assert schema_version(db) == LATEST_SCHEMA_VERSION == 3
    assert integrity(db) == ["ok"]
    with _raw(db) as raw:
        versions = [r[0] for r in raw.execute("SELECT version FROM schema_version ORDER BY 1")]
    assert versions == [m.version for m in store_schema.MIGRATIONS]


def test_migrates_a_v1_file(db: Path) -> None:
    db.parent.mkdir(parents=True)
    with _raw(db) as raw:
        raw.executescript(V1_DDL)
    with StateStore(db) as s:
        assert schema_version(db) == 3
        (old,) = s.decisions()
        assert (old.message, old.published, old.inputs_summary) == (
            "from v1",
            False,
            {"running": 3},
        )
        assert old.table_after == StepTable(((1, 3),), 1, 4.0, 30.0)
        assert old.restart_recommendation is None
        assert [r.id for r in s.list_overrides(now_s=10.0)] == ["old"]
        s.set_setting("policy_spec", "goodput")  # a table v2 added
        new_id = s.record_decision(**_decision(1))
        assert new_id > old.id
        rec = RestartRecommendation(SpecShape("NONE", 0, 0, 0, ()), "policy", "x", 0.1)
        rec_id = s.record_decision(**_decision(2, restart_recommendation=rec.to_dict()))
        assert s.decisions(limit=1)[0].restart_recommendation == rec and rec_id > new_id
    with StateStore(db) as s:  # reopening does not migrate again
        assert schema_version(db) == 3
        assert s.get_setting("policy_spec") == "goodput"


def test_a_failing_migration_leaves_the_file_at_the_previous_version(
    db: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    StateStore(db).close()
    broken = Migration(
        version=4,
        description="broken",
        steps=("CREATE TABLE extra (x INTEGER)", "ALTER TABLE missing ADD COLUMN y"),
    )
    monkeypatch.setattr(store_schema, "MIGRATIONS", (*store_schema.MIGRATIONS, broken))
    monkeypatch.setattr(store_schema, "LATEST_SCHEMA_VERSION", 4)
    with pytest.raises(sqlite3.OperationalError, match="missing"):
        StateStore(db)
    with _raw(db) as raw:
        assert raw.execute("SELECT MAX(version) FROM schema_version").fetchone()[0] == 3
        names = {r[0] for r in raw.execute("SELECT name FROM sqlite_master")}
    assert "extra" not in names


def test_a_file_from_a_newer_specgov_is_refused(db: Path) -> None:
    StateStore(db).close()
    with _raw(db) as raw:
        raw.execute("INSERT INTO schema_version VALUES (7, 'future', 0.0)")
    with pytest.raises(StoreSchemaError) as info:
        StateStore(db)
    msg = str(info.value)
    assert str(db) in msg and "version 7" in msg and f"version {LATEST_SCHEMA_VERSION}" in msg


def test_someone_elses_database_is_refused(db: Path) -> None:
    db.parent.mkdir(parents=True)
    with _raw(db) as raw:
        raw.execute("CREATE TABLE customers (name TEXT)")
    with pytest.raises(StoreSchemaError, match="not a specgov state database"):
        StateStore(db)


def test_a_file_that_is_not_sqlite_is_reported_corrupt(db: Path) -> None:
    db.parent.mkdir(parents=True)
    db.write_bytes(b"definitely not a database " * 200)
    with pytest.raises(StoreCorrupt) as info:
        StateStore(db)
    assert isinstance(info.value, StoreUnavailable) and str(db) in str(info.value)


# ------------------------------------------------------------------ unusable files


def test_read_only_database_raises_unavailable_and_reads_still_work(db: Path) -> None:
    with StateStore(db) as s:
        kept = s.record_decision(**_decision(1))

    def read_only(path: Path) -> sqlite3.Connection:
        return sqlite3.connect(f"file:{path}?mode=ro", uri=True, check_same_thread=False)

    with StateStore(db, connect=read_only) as s:
        assert [r.id for r in s.decisions()] == [kept]
        with pytest.raises(StoreUnavailable) as info:
            s.record_decision(**_decision(2))
        assert str(db) in str(info.value) and "readonly" in str(info.value)
        assert isinstance(info.value.cause, sqlite3.OperationalError)
        assert s.last_error is info.value
        with pytest.raises(StoreUnavailable):
            s.put_override(_override())
        assert [r.id for r in s.decisions()] == [kept]  # reconnected; still usable
        assert s.last_error is None


_RO_CHILD = textwrap.dedent(
    """
    import sys
    from specgov.controller.daemon.state_store import StateStore
    from specgov.controller.daemon.store_errors import StoreUnavailable
    try:
        s = StateStore(sys.argv[1])
        s.record_decision(time_s=1.0, policy="p", reason="r", message="m")
    except StoreUnavailable as exc:
        print("UNAVAILABLE", exc)
    else:
        print("WROTE")
    """
)


def test_read_only_file_and_folder_by_permissions(tmp_path: Path) -> None:
    folder = tmp_path / "ro"
    path = folder / "state.db"
    with StateStore(path) as s:
        s.record_decision(**_decision(1))
    command = [sys.executable, "-c", _RO_CHILD, str(path)]
    if os.geteuid() == 0:
        # Root ignores file modes through CAP_DAC_OVERRIDE; run the writer without it.
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("running as root without setpriv: file modes cannot be enforced")
        command = [setpriv, "--bounding-set=-dac_override,-dac_read_search,-fowner", *command]
    path.chmod(0o444)
    folder.chmod(0o555)
    try:
        out = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    finally:
        folder.chmod(0o755)
        path.chmod(0o644)
    if out.returncode != 0 and "setpriv" in out.stderr:
        pytest.skip(f"cannot drop root's file capabilities here: {out.stderr.strip()}")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("UNAVAILABLE") and str(path) in out.stdout, out.stdout
    with StateStore(path) as s:
        assert len(s.decisions()) == 1 and integrity(path) == ["ok"]


def test_full_disk_raises_unavailable_then_recovers(db: Path) -> None:
    StateStore(db).close()
    with _raw(db) as raw:
        pages = raw.execute("PRAGMA page_count").fetchone()[0]
    limit = [pages + 2]
    opened: list[sqlite3.Connection] = []

    def capped(path: Path) -> sqlite3.Connection:
        conn = sqlite3.connect(str(path), check_same_thread=False)
        conn.execute(f"PRAGMA max_page_count = {limit[0]}")
        opened.append(conn)
        return conn

    big = {"blob": "x" * 20_000}
    with StateStore(db, connect=capped) as s:
        committed: list[int] = []
        with pytest.raises(StoreUnavailable) as info:
            for i in range(20):
                committed.append(s.record_decision(**_decision(i, inputs_summary=big)))
        assert "database or disk is full" in str(info.value) and str(db) in str(info.value)
        assert [r.id for r in s.decisions(limit=100)] == committed[::-1]  # nothing partial
        limit[0] = 1_000_000  # space freed, for the open connection too
        opened[-1].execute(f"PRAGMA max_page_count = {limit[0]}")
        again = s.record_decision(**_decision(99, inputs_summary=big))
        assert s.last_error is None
        assert s.decisions(limit=1)[0].id == again
        assert integrity(db) == ["ok"]


class _FullDisk(sqlite3.Connection):
    """A connection on a filesystem that has run out of space: every INSERT fails."""

    full = True

    def execute(self, sql: str, parameters: Any = (), /) -> sqlite3.Cursor:
        if _FullDisk.full and sql.lstrip().upper().startswith("INSERT"):
            raise sqlite3.OperationalError("database or disk is full")
        return super().execute(sql, parameters)


def test_injected_full_disk_error_is_unavailable_and_transient(db: Path) -> None:
    StateStore(db).close()

    def connect(path: Path) -> sqlite3.Connection:
        return sqlite3.connect(str(path), factory=_FullDisk, check_same_thread=False)

    _FullDisk.full = True
    try:
        with StateStore(db, connect=connect) as s:
            with pytest.raises(StoreUnavailable, match="disk is full"):
                s.save_policy_state("goodput", {"a": 1}, 1.0)
            with pytest.raises(StoreUnavailable, match="disk is full"):
                s.set_setting("k", 1)
            _FullDisk.full = False
            s.save_policy_state("goodput", {"a": 2}, 2.0)
            assert s.load_policy_state("goodput") == {"a": 2}
    finally:
        _FullDisk.full = True


def test_unopenable_path_is_unavailable(tmp_path: Path) -> None:
    folder = tmp_path / "a-directory.db"
    folder.mkdir()
    with pytest.raises(StoreUnavailable, match="unable to open") as info:
        StateStore(folder)
    assert str(folder) in str(info.value)


def test_store_recovers_when_the_path_becomes_usable(tmp_path: Path) -> None:
    blocker = tmp_path / "state"
    blocker.write_text("a file where the folder should be")
    s = StateStore(blocker / "specgov.db", open_now=False)
    with pytest.raises(StoreUnavailable) as info:
        s.record_decision(**_decision(1))
    assert str(blocker / "specgov.db") in str(info.value)
    assert s.last_error is info.value
    blocker.unlink()
    new_id = s.record_decision(**_decision(1))
    assert [r.id for r in s.decisions()] == [new_id] and s.last_error is None
    s.close()


def test_transient_open_failure_from_the_factory(db: Path) -> None:
    failures = [2]

    def flaky(path: Path) -> sqlite3.Connection:
        if failures[0] > 0:
            failures[0] -= 1
            raise sqlite3.OperationalError("unable to open database file")
        return sqlite3.connect(str(path), check_same_thread=False)

    s = StateStore(db, connect=flaky, open_now=False)
    for _ in range(2):
        with pytest.raises(StoreUnavailable, match="unable to open"):
            s.get_setting("x")
    s.set_setting("x", 1)
    assert s.get_setting("x") == 1
    s.close()
