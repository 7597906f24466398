"""State that cannot vanish silently (issue 9 §1): each store failure of the issue, on
real SQLite files under tmp_path, against the daemon (no SGLang server is needed: with
no telemetry every decision holds, and every hold is an audit row).

Disk full is an injected write error at the store's seam (its connection factory):
while "full", every writing statement fails with SQLite's SQLITE_FULL message. (SQLite's
``PRAGMA max_page_count`` is used for the store alone in test_state_store.py; here it
would let small rows through into free space of existing pages, which a full disk's
WAL appends would not.) A read-only database is made for real
(file and folder modes, in a child process without root's capabilities).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import sqlite3
import stat
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from store_raw import integrity

from specgov.controller.daemon.config import SpecgovConfig, load_config
from specgov.controller.daemon.runtime import Daemon
from specgov.controller.daemon.state_store import StateStore
from specgov.controller.daemon.store_errors import StoreRefused, StoreReplaced, StoreUnavailable
from specgov.controller.daemon.store_journal import PendingWrite, StoreJournal

PIN = "static:steps=3"


def _config(tmp_path: Path, **extra: Any) -> SpecgovConfig:
    return load_config(
        None,
        env={},
        overrides={
            "server.url": "http://127.0.0.1:9",  # never scraped here
            "state.db_path": str(tmp_path / "state" / "state.db"),
            "spool.dir": str(tmp_path / "spool"),
            "loop.mode": "plugin",
            **extra,
        },
    )


def _daemon(config: SpecgovConfig, store: StateStore, **kwargs: Any) -> Daemon:
    return Daemon(config, store=store, registry=CollectorRegistry(), **kwargs)


def _pin(daemon: Daemon, reason: str = "test") -> str:
    made = daemon.set_override(
        slot=None, steps=None, disable=False, pin_policy=PIN, ttl_s=3600, reason=reason
    )
    return str(made["id"])


def _metric(daemon: Daemon, name: str, **labels: str) -> float:
    value = daemon.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def _close(daemon: Daemon) -> None:
    asyncio.run(daemon.close())


def _store_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "specgov.daemon" and r.levelno >= logging.ERROR and "state" in r.getMessage()
    ]


class _FullDiskConnection(sqlite3.Connection):
    """A connection on a filesystem out of space while ``disk.full``: every statement
    that writes fails as SQLite fails it then (SQLITE_FULL's message)."""

    disk: _Capped

    def execute(self, sql: str, parameters: Any = (), /) -> sqlite3.Cursor:
        verb = sql.lstrip().split(None, 1)[0].upper()
        if self.disk.full and verb in ("INSERT", "UPDATE", "DELETE", "CREATE", "ALTER"):
            raise sqlite3.OperationalError("database or disk is full")
        return super().execute(sql, parameters)


class _Capped:
    """The store's connection factory (its injection seam) with a disk that can fill."""

    def __init__(self) -> None:
        self.full = False

    def __call__(self, path: Path) -> sqlite3.Connection:
        conn = sqlite3.connect(str(path), factory=_FullDiskConnection, check_same_thread=False)
        assert isinstance(conn, _FullDiskConnection)
        conn.disk = self
        return conn

    def fill(self) -> None:
        self.full = True

    def free(self) -> None:
        self.full = False


# ------------------------------------------------------------------ deleted, replaced


def test_deleted_db_is_noticed_reported_and_recreated_with_every_row(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = _config(tmp_path)
    db = config.state.db_path
    daemon = _daemon(config, StateStore(db, open_now=False))
    kept = [_pin(daemon, "keep")]
    for _ in range(5):
        daemon.decide_once()
    for path in db.parent.glob("state.db*"):
        path.unlink()
    caplog.set_level(logging.INFO)
    daemon.decide_once()  # the write notices: reported at once
    status = daemon.status()
    assert [i["kind"] for i in status["store_incidents"]] == ["deleted"]
    assert "was deleted" in status["store_incidents"][0]["message"]
    assert _metric(daemon, "specgov_store_failures_total", kind="deleted") == 1.0
    assert len([m for m in _store_lines(caplog) if "was deleted" in m]) == 1
    assert db.is_file()
    for _ in range(3):
        daemon.decide_once()
    assert daemon.status()["store_error"] is None
    made = daemon.status()["decisions"]
    _close(daemon)

    # The restart finds everything: all decisions, the gap row, both overrides.
    with StateStore(db) as store:
        rows = store.decisions(limit=1000)
        decided = [r for r in rows if r.reason not in ("store_gap", "override_set")]
        assert len(decided) == made == 9
        assert [r.reason for r in rows].count("override_set") == 1  # the pin, audited
        gap = [r for r in rows if r.reason == "store_gap"]
        assert len(gap) == 1 and "was deleted" in json.dumps(gap[0].inputs_summary)
        assert integrity(db) == ["ok"]
    again = _daemon(config, StateStore(db, open_now=False))
    assert sorted(o["id"] for o in again.list_overrides()) == sorted(kept)
    _close(again)


def test_replaced_db_is_saved_aside_and_the_new_file_gets_the_daemons_state(
    tmp_path: Path,
) -> None:
    # A long checkpoint interval: the learned state must reach the new file at once,
    # not at the next checkpoint (a kill before it would restart with a fresh guard).
    config = _config(tmp_path, **{"state.policy_state_interval_s": 3600})
    db = config.state.db_path
    daemon = _daemon(config, StateStore(db, open_now=False))
    kept = _pin(daemon)
    for _ in range(3):
        daemon.decide_once()
    other = tmp_path / "other.db"
    with StateStore(other) as s:
        s.record_decision(time_s=1.0, policy="elsewhere", reason="initial", message="x")
    os.replace(other, db)
    daemon.decide_once()
    incident = daemon.status()["store_incidents"][-1]
    assert incident["kind"] == "replaced" and "saved as" in incident["message"]
    daemon.decide_once()
    with StateStore(db) as new:
        assert new.load_policy_state(daemon.policy.name) == daemon.state.to_dict()
    _close(daemon)
    aside = list(db.parent.glob("state.db.replaced-*"))
    assert len(aside) == 1
    with StateStore(aside[0]) as old:
        # Nothing of the old file lost: 3 decisions and the pin's audit row.
        assert len(old.decisions(limit=100)) == 3 + 1
    with StateStore(db) as new:
        policies = {r.policy for r in new.decisions(limit=100)}
        assert "elsewhere" in policies  # the operator's file, kept
        assert kept in {r.id for r in new.list_overrides(0.0, include_expired=True)}
        assert any(r.reason == "store_gap" for r in new.decisions(limit=100))


def test_a_foreign_db_swapped_in_then_deleted_gets_the_policy_setting_back(
    tmp_path: Path,
) -> None:
    """Issue 23 §3: the recreated file got the overrides back but not the policy setting,
    so the restart came up on the configured `goodput`, not the operator's choice."""
    config = _config(tmp_path)
    db = config.state.db_path
    daemon = _daemon(config, StateStore(db, open_now=False))
    daemon.set_policy("goodput:slo_tpot_ms=40")
    kept = _pin(daemon, "keep")
    daemon.decide_once()
    foreign = tmp_path / "foreign.db"
    with sqlite3.connect(foreign) as raw:
        raw.execute("CREATE TABLE something_else (x)")
    os.replace(foreign, db)
    daemon.decide_once()  # an outage: the foreign file is refused, writes wait
    assert daemon.status()["store_error"] is not None
    for path in db.parent.glob("state.db*"):
        path.unlink()
    daemon.decide_once()  # a new file at the path, written back
    assert daemon.status()["store_error"] is None
    _close(daemon)
    with StateStore(db) as store:
        assert store.get_setting("policy_spec") == "goodput:slo_tpot_ms=40"
        assert kept in {r.id for r in store.list_overrides(0.0)}
    again = _daemon(config, StateStore(db, open_now=False))
    assert again.policy_spec == "goodput:slo_tpot_ms=40"
    _close(again)


def test_store_replaced_is_raised_once_and_the_store_works_after(tmp_path: Path) -> None:
    db = tmp_path / "state.db"
    store = StateStore(db)
    store.record_decision(time_s=1.0, policy="p", reason="r", message="m")
    db.unlink()
    with pytest.raises(StoreReplaced) as info:
        store.record_decision(time_s=2.0, policy="p", reason="r", message="m")
    assert info.value.deleted and info.value.recovered
    store.record_decision(time_s=3.0, policy="p", reason="r", message="m")
    assert [r.time_s for r in store.decisions()] == [3.0, 1.0]
    store.close()


# --------------------------------------------------------------------- disk full


def test_disk_full_rows_are_journaled_and_written_back_with_a_gap_row(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = _config(tmp_path)
    capped = _Capped()
    store = StateStore(config.state.db_path, connect=capped, open_now=False)
    daemon = _daemon(config, store)
    for _ in range(3):
        daemon.decide_once()
    capped.fill()
    caplog.set_level(logging.INFO)
    made_while_full = 6
    for _ in range(made_while_full):
        daemon.decide_once()
    during = _pin(daemon, "set while full")
    status = daemon.status()
    assert status["store_error"] and "full" in status["store_error"]
    health = daemon.health()
    assert health["ok"] is False and health["store"] is False
    assert any("full" in r for r in health["reasons"])
    # The decisions made while full, the override and its own audit row (issue 23).
    assert status["store_journal"]["entries"] >= made_while_full + 2
    assert _metric(daemon, "specgov_store_failures_total", kind="unavailable") >= 1.0
    assert _metric(daemon, "specgov_store_journal_entries") >= made_while_full + 2
    assert len([m for m in _store_lines(caplog) if "full" in m]) == 1  # one per burst
    assert len(daemon.decisions(None, 1000)) == 3 + made_while_full + 1  # journal + stored

    capped.free()
    daemon.decide_once()
    status = daemon.status()
    assert status["store_error"] is None and status["store_journal"]["entries"] == 0
    assert daemon.health()["ok"] is True
    _close(daemon)
    with StateStore(config.state.db_path) as s:
        rows = s.decisions(limit=1000)
        assert len([r for r in rows if r.reason != "store_gap"]) == 3 + made_while_full + 2
        (gap,) = [r for r in rows if r.reason == "store_gap"]
        assert gap.inputs_summary["written_back"] == made_while_full + 2
        assert gap.inputs_summary["dropped"] == {}
        assert "full" in gap.message
        assert during in {r.id for r in s.list_overrides(0.0)}


def test_journal_overflow_is_counted_and_recorded(tmp_path: Path) -> None:
    config = _config(tmp_path)
    capped = _Capped()
    store = StateStore(config.state.db_path, connect=capped, open_now=False)
    daemon = _daemon(config, store, journal=StoreJournal(max_entries=3))
    daemon.decide_once()
    capped.fill()
    for _ in range(8):
        daemon.decide_once()
    status = daemon.status()["store_journal"]
    assert status["entries"] == 3 and status["dropped"] == {"decision": 5}
    assert _metric(daemon, "specgov_store_journal_dropped_total", kind="decision") == 5.0
    capped.free()
    daemon.decide_once()
    _close(daemon)
    with StateStore(config.state.db_path) as s:
        rows = s.decisions(limit=100)
        (gap,) = [r for r in rows if r.reason == "store_gap"]
        assert gap.inputs_summary["dropped"] == {"decision": 5}
        assert gap.inputs_summary["written_back"] == 3
        assert "5 dropped (5 decision)" in gap.message and "at most 3" in gap.message
        assert len(rows) == 1 + 3 + 1 + 1  # before, kept, after, the gap


class _Refusing(StateStore):
    """A store whose file refuses one row for itself (a constraint failure, as a
    foreign trigger or a schema mismatch would raise): not an outage."""

    def record_decision(self, **row: Any) -> int:
        if row.get("message") == "refuse me":
            raise sqlite3.IntegrityError("CHECK constraint failed: decisions")
        return super().record_decision(**row)


def test_a_write_the_store_refuses_is_dropped_and_the_write_back_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = _config(tmp_path)
    capped = _Capped()
    store = _Refusing(config.state.db_path, connect=capped, open_now=False)
    journal = StoreJournal()
    daemon = _daemon(config, store, journal=journal)
    daemon.decide_once()
    capped.fill()
    daemon.decide_once()
    journal.add(
        PendingWrite(
            "decision", 2.0, {"time_s": 2.0, "policy": "p", "reason": "r", "message": "refuse me"}
        )
    )
    journal.add(
        PendingWrite("decision", 2.5, {"time_s": 2.5, "policy": "p", "reason": "r", "message": "x"})
    )
    daemon.decide_once()
    assert len(journal) == 4
    capped.free()
    caplog.set_level(logging.INFO)
    for _ in range(3):
        daemon.decide_once()  # the refused row neither jams the journal nor raises
    status = daemon.status()
    assert status["store_error"] is None and status["store_journal"]["entries"] == 0
    assert status["store_journal"]["rejected"] == {"decision": 1}
    assert _metric(daemon, "specgov_store_failures_total", kind="rejected") == 1.0
    refused = [m for m in _store_lines(caplog) if "refused a queued decision write" in m]
    assert len(refused) == 1 and "IntegrityError: CHECK constraint failed" in refused[0]
    assert daemon.health()["store"] is True
    _close(daemon)
    with StateStore(config.state.db_path) as s:
        rows = s.decisions(limit=100)
        assert "refuse me" not in {r.message for r in rows}
        assert "x" in {r.message for r in rows}  # the entry behind it was written
        (gap,) = [r for r in rows if r.reason == "store_gap"]
        assert gap.inputs_summary["rejected"] == {"decision": 1}
        assert "1 refused by the store (1 decision)" in gap.message
        assert len(rows) == 1 + 3 + 3 + 1  # before, journaled (one refused), after, gap


def test_a_deleted_db_whose_copy_cannot_be_moved_back_is_a_typed_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import specgov.controller.daemon.state_store as state_store

    db = tmp_path / "state.db"
    store = StateStore(db)
    store.record_decision(time_s=1.0, policy="p", reason="r", message="m")
    db.unlink()
    real_replace = os.replace

    def refuse(src: Any, dst: Any) -> None:
        if ".recovering-" in str(src):
            raise OSError(5, "Input/output error")
        real_replace(src, dst)

    monkeypatch.setattr(state_store.os, "replace", refuse)
    with pytest.raises(StoreReplaced) as info:
        store.record_decision(time_s=2.0, policy="p", reason="r", message="m")
    monkeypatch.undo()
    err = info.value
    assert err.deleted and not err.recovered and isinstance(err, StoreUnavailable)
    assert err.saved_to is not None and err.saved_to.exists()
    assert "cannot be moved back (" in str(err) and f"mv {err.saved_to} {db}" in str(err)
    with StateStore(err.saved_to) as saved:
        assert [r.time_s for r in saved.decisions()] == [1.0]  # nothing committed lost
    store.record_decision(time_s=3.0, policy="p", reason="r", message="m")  # goes on
    assert [r.time_s for r in store.decisions()] == [3.0]
    store.close()


def test_overrides_cleared_while_the_store_is_down_stay_cleared(tmp_path: Path) -> None:
    config = _config(tmp_path)
    capped = _Capped()
    daemon = _daemon(config, StateStore(config.state.db_path, connect=capped, open_now=False))
    first = _pin(daemon, "first")
    daemon.decide_once()
    capped.fill()
    daemon.decide_once()
    assert daemon.clear_override(first, None) == 1
    capped.free()
    daemon.decide_once()
    assert daemon.list_overrides() == []  # the store's stale view did not bring it back
    _close(daemon)
    with StateStore(config.state.db_path) as s:
        assert s.list_overrides(0.0) == []


# ----------------------------------------------------------------------- at start


def test_missing_db_is_created_with_a_warning_about_empty_state(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = _config(tmp_path)
    caplog.set_level(logging.WARNING)
    daemon = _daemon(config, StateStore(config.state.db_path, open_now=False))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("starts with empty state" in m and str(config.state.db_path) in m for m in warnings)
    _close(daemon)
    caplog.clear()
    again = _daemon(config, StateStore(config.state.db_path, open_now=False))
    assert not any("empty state" in r.getMessage() for r in caplog.records)
    _close(again)


def _corrupt_a_middle_page(db: Path) -> None:
    with sqlite3.connect(db) as raw:
        page = raw.execute("PRAGMA page_size").fetchone()[0]
        pages = raw.execute("PRAGMA page_count").fetchone()[0]
    assert pages > 4
    with db.open("r+b") as f:
        f.seek(page * (pages - 2))
        f.write(b"\xa5" * page)


def test_corrupt_db_is_refused_with_the_recovery_command(tmp_path: Path) -> None:
    config = _config(tmp_path)
    db = config.state.db_path
    daemon = _daemon(config, StateStore(db, open_now=False))
    _pin(daemon)
    for i in range(40):
        daemon.store.record_decision(  # type: ignore[union-attr]
            time_s=float(i), policy="p", reason="r", message="x" * 500
        )
    _close(daemon)
    daemon.store.close()  # type: ignore[union-attr]
    _corrupt_a_middle_page(db)
    with pytest.raises(StoreRefused) as info:
        _daemon(config, StateStore(db, open_now=False))
    message = str(info.value)
    assert str(db) in message and "corrupt" in message and " recover " in message
    assert "refusing to start" in message
    assert isinstance(info.value, ValueError)  # `specgov run` reports it, exit 2
    command = message.split("Recover what is readable with: ")[1].split(" -- or ")[0]
    out = subprocess.run(
        ["sh", "-c", command], capture_output=True, text=True, timeout=120, check=True
    )
    assert "overrides: 1 rows recovered" in out.stdout, out.stdout
    kept = int(out.stdout.split("decisions: ")[1].split(" rows")[0])
    assert 0 < kept < 41  # the rows on the corrupt page are gone, the others kept
    assert list(db.parent.glob("state.db.corrupt-*"))  # the corrupt file kept aside
    recovered = _daemon(config, StateStore(db, open_now=False))
    assert len(recovered.list_overrides()) == 1  # what was readable came back
    assert len(recovered.decisions(None, 1000)) == kept
    _close(recovered)


def test_a_file_that_is_not_a_database_is_refused(tmp_path: Path) -> None:
    config = _config(tmp_path)
    config.state.db_path.parent.mkdir(parents=True)
    config.state.db_path.write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(StoreRefused, match="refusing to start"):
        _daemon(config, StateStore(config.state.db_path, open_now=False))


_RO_CHILD = textwrap.dedent(
    """
    import json, sys
    from prometheus_client import CollectorRegistry
    from specgov.controller.daemon.config import load_config
    from specgov.controller.daemon.runtime import Daemon
    from specgov.controller.daemon.state_store import StateStore
    config = load_config(None, env={}, overrides=json.loads(sys.argv[1]))
    daemon = Daemon(config, store=StateStore(config.state.db_path, open_now=False),
                    registry=CollectorRegistry())
    record = daemon.decide_once()
    print(json.dumps({
        "overrides": [o["id"] for o in daemon.list_overrides()],
        "policy": daemon.policy.name,
        "store_error": daemon.status()["store_error"],
        "journal": daemon.status()["store_journal"]["entries"],
        "health": daemon.health(),
    }))
    """
)


def test_read_only_db_at_start_restores_every_readable_part(tmp_path: Path) -> None:
    config = _config(tmp_path)
    db = config.state.db_path
    daemon = _daemon(config, StateStore(db, open_now=False))
    kept = _pin(daemon)
    daemon.decide_once()
    _close(daemon)
    daemon.store.close()  # type: ignore[union-attr]
    overrides = {
        "server.url": "http://127.0.0.1:9",
        "state.db_path": str(db),
        "spool.dir": str(tmp_path / "spool"),
        "loop.mode": "plugin",
    }
    command = [sys.executable, "-c", _RO_CHILD, json.dumps(overrides)]
    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("running as root without setpriv: file modes cannot be enforced")
        command = [setpriv, "--bounding-set=-dac_override,-dac_read_search,-fowner", *command]
    db.chmod(0o444)
    db.parent.chmod(0o555)
    try:
        out = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    finally:
        db.parent.chmod(0o700)
        db.chmod(0o600)
    if out.returncode != 0 and "setpriv" in out.stderr:
        pytest.skip(f"cannot drop root's file capabilities here: {out.stderr.strip()}")
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["overrides"] == [kept]  # restored although the file is read-only
    assert seen["policy"].startswith("static")  # the pin restored with it
    assert seen["store_error"] and "read" in seen["store_error"].lower()
    assert seen["journal"] >= 1  # the decision waits for the store
    assert seen["health"]["ok"] is False and seen["health"]["store"] is False


# ---------------------------------------------------------------------- file modes


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_state_files_are_private(tmp_path: Path) -> None:
    db = tmp_path / "new" / "state.db"
    with StateStore(db) as s:
        s.record_decision(time_s=1.0, policy="p", reason="r", message="m")
        files = sorted(db.parent.glob("state.db*"))
        assert {f.name for f in files} >= {"state.db", "state.db-wal", "state.db-shm"}
        assert {f.name: _mode(f) for f in files} == {f.name: 0o600 for f in files}
        assert _mode(db.parent) == 0o700


def test_a_configured_group_gets_read_access(tmp_path: Path) -> None:
    gid = os.getgid()
    db = tmp_path / "state.db"
    with StateStore(db, file_group=gid) as s:
        s.record_decision(time_s=1.0, policy="p", reason="r", message="m")
        for f in db.parent.glob("state.db*"):
            assert _mode(f) == 0o640 and f.stat().st_gid == gid, f


def test_a_group_configured_later_widens_the_existing_files(tmp_path: Path) -> None:
    gid = os.getgid()
    db = tmp_path / "state.db"
    with StateStore(db) as first:  # held open: its -wal and -shm stay, 0600
        first.record_decision(time_s=1.0, policy="p", reason="r", message="m")
        files = sorted(tmp_path.glob("state.db*"))
        assert {f.name for f in files} == {"state.db", "state.db-wal", "state.db-shm"}
        assert {_mode(f) for f in files} == {0o600}
        with StateStore(db, file_group=gid) as s:
            assert len(s.decisions()) == 1
            for f in files:
                assert _mode(f) == 0o640 and f.stat().st_gid == gid, f


def test_a_group_that_cannot_be_given_is_a_clear_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import specgov.controller.daemon.store_files as store_files

    db = tmp_path / "state.db"
    StateStore(db).close()

    def refuse(path: object, mode: int) -> None:
        raise PermissionError(1, "Operation not permitted", str(path))

    monkeypatch.setattr(store_files.os, "chmod", refuse)
    with caplog.at_level(logging.WARNING, logger=store_files.log.name):
        StateStore(db, file_group=os.getgid()).close()
    monkeypatch.undo()
    assert _mode(db) == 0o600
    text = caplog.text
    assert f"state file {db}: state.group is gid {os.getgid()}" in text
    assert "cannot chmod it" in text and "so that group cannot read it" in text
    assert f"chmod g+r {db}" in text


def test_existing_files_lose_extra_bits_but_never_gain_any(tmp_path: Path) -> None:
    loose, locked = tmp_path / "loose.db", tmp_path / "locked.db"
    for path in (loose, locked):
        StateStore(path).close()
    loose.chmod(0o666)
    locked.chmod(0o444)
    StateStore(loose).close()
    assert _mode(loose) == 0o600
    with StateStore(locked):
        assert _mode(locked) == 0o400  # still read-only
        assert integrity(locked) == ["ok"]


def test_unknown_group_is_a_clear_error(tmp_path: Path) -> None:
    from specgov.controller.daemon.store_errors import StoreError

    with pytest.raises(StoreError, match="no group named 'no-such-group-x'"):
        StateStore(tmp_path / "s.db", file_group="no-such-group-x")


@pytest.fixture(autouse=True)
def _no_leftover_modes(tmp_path: Path) -> Iterator[None]:
    yield
    for path in tmp_path.rglob("*"):  # let pytest clean up after chmod tests
        if path.is_dir():
            path.chmod(0o700)


def test_unavailable_is_the_base_of_replaced() -> None:
    assert issubclass(StoreReplaced, StoreUnavailable)


def test_a_foreign_file_swapped_in_while_running_is_an_outage_not_a_crash(
    tmp_path: Path,
) -> None:
    config = _config(tmp_path)
    db = config.state.db_path
    daemon = _daemon(config, StateStore(db, open_now=False))
    daemon.decide_once()
    foreign = tmp_path / "foreign.db"
    with sqlite3.connect(foreign) as raw:
        raw.execute("CREATE TABLE something_else (x)")
    os.replace(foreign, db)
    for _ in range(3):
        daemon.decide_once()  # never raises: the writes wait in the journal
    status = daemon.status()
    assert "not a specgov state database" in (status["store_error"] or "")
    assert status["store_journal"]["entries"] >= 2
    assert daemon.health()["store"] is False
    _close(daemon)


# ------------------------------------------------ paths another user could steer (§2)


@pytest.mark.parametrize("mode", [0o777, 0o1777, 0o770])
def test_a_state_directory_others_can_write_is_refused_at_start(tmp_path: Path, mode: int) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(mode)
    db = shared / "state.db"
    with pytest.raises(StoreRefused, match=r"writable by (every user|its group)") as info:
        StateStore(db, open_now=False).start()
    assert str(shared) in str(info.value) and "fix: `chmod" in str(info.value)
    assert not db.exists()  # nothing created in it


def test_a_group_writable_state_directory_of_the_configured_group_is_accepted(
    tmp_path: Path,
) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o770)
    gid = shared.stat().st_gid
    store = StateStore(shared / "state.db", open_now=False, file_group=gid)
    assert store.start().error is None
    store.close()


def test_a_state_directory_of_another_user_is_refused(tmp_path: Path) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, 65534, -1)
    with pytest.raises(StoreRefused, match="belongs to uid 65534"):
        StateStore(theirs / "state.db", open_now=False).start()


def test_a_dangling_symlink_at_the_db_path_is_not_followed(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    target = tmp_path / "elsewhere.db"
    (state / "state.db").symlink_to(target)
    with pytest.raises(StoreRefused, match=r"symbolic link .* it is not followed"):
        StateStore(state / "state.db", open_now=False).start()
    assert not target.exists()
    # A link to an existing database is the operator's layout and is used.
    (state / "state.db").unlink()
    StateStore(target).close()
    (state / "state.db").symlink_to(target)
    store = StateStore(state / "state.db", open_now=False)
    assert store.start().error is None
    store.close()


def test_specgov_run_refuses_a_world_writable_state_directory_with_exit_2(
    tmp_path: Path,
) -> None:
    shared = tmp_path / "tmp"
    shared.mkdir()
    shared.chmod(0o1777)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECGOV_")}
    argv = [sys.executable, "-m", "specgov.controller.cli.main", "run"]
    argv += ["--state-db", str(shared / "state.db"), "--server", "http://127.0.0.1:9"]
    argv += ["--control-addr", "127.0.0.1:0", "--metrics-addr", "127.0.0.1:0"]
    # A deadline, not an expectation: the refusal comes before anything is served.
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "writable by every user" in done.stderr and "Traceback" not in done.stderr
    assert not (shared / "control.token").exists() and not (shared / "state.db").exists()


# ------------------------------------------- every override is an audit row (§3)


def test_every_override_set_superseded_or_cleared_is_an_audit_row(tmp_path: Path) -> None:
    """20 pins set at once through the control API (each supersedes the one before), then
    a clear: 20 set rows, 19 superseded rows and 1 cleared row, in the store and in
    `GET /v1/decisions`. Before issue 23 only the override in force was anywhere in the
    audit log (through the decisions it steered)."""
    from aiohttp.test_utils import TestClient, TestServer

    from specgov.controller.daemon.control_api import make_app

    config = _config(tmp_path)
    daemon = _daemon(config, StateStore(config.state.db_path, open_now=False))

    async def go() -> list[dict[str, Any]]:
        app = make_app(daemon, token=None, listen_host="127.0.0.1")
        async with TestClient(TestServer(app, host="127.0.0.1")) as client:
            body = {"pin_policy": PIN, "ttl": "1h"}
            replies = await asyncio.gather(
                *(client.post("/v1/overrides", json={**body, "reason": f"r{i}"}) for i in range(20))
            )
            assert [r.status for r in replies] == [201] * 20
            cleared = await client.delete("/v1/overrides", params={"all": "true"})
            assert (await cleared.json())["cleared"] == 1
            switched = await client.put("/v1/policy", json={"spec": "static:1"})
            assert switched.status == 200
            rows = await (await client.get("/v1/decisions", params={"limit": "100"})).json()
            return list(rows["decisions"])

    rows = asyncio.run(go())
    by_reason: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by_reason.setdefault(row["reason"], []).append(row)
    assert sorted(by_reason) == [
        "override_cleared",
        "override_set",
        "override_superseded",
        "policy_set",
    ]
    assert [r["inputs_summary"]["spec"] for r in by_reason["policy_set"]] == ["static:1"]
    made = {r["inputs_summary"]["override"]["id"] for r in by_reason["override_set"]}
    superseded = {r["inputs_summary"]["override_id"] for r in by_reason["override_superseded"]}
    (last,) = made - superseded
    assert len(made) == 20 and len(superseded) == 19 and superseded < made
    assert [r["inputs_summary"]["override_id"] for r in by_reason["override_cleared"]] == [last]
    assert all(not r["published"] and r["table_after"] is None for r in rows)
    assert "cleared by the operator" in by_reason["override_cleared"][0]["message"]
    _close(daemon)
    with StateStore(config.state.db_path) as store:
        stored = [r.reason for r in store.decisions(limit=100)]
    assert sorted(stored) == sorted(r["reason"] for r in rows)  # persisted, not only shown
