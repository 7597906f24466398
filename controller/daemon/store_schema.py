"""The state database's schema: the ordered migrations and how a file is brought to the
latest one.

``schema_version`` holds one row per applied migration; :data:`MIGRATIONS` is the ordered
list of SQL steps, each migration applied in its own transaction together with its
version row, so a crash mid-migration leaves the previous version intact. A fresh file is
built by running every migration in order, so new and upgraded files are identical. A
file from a newer specgov is refused (:class:`StoreSchemaError`).
"""

from __future__ import annotations

import logging
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from specgov.controller.daemon.store_errors import STORE_LOG_NAME, StoreSchemaError

__all__ = [
    "LATEST_SCHEMA_VERSION",
    "MIGRATIONS",
    "Migration",
    "count_decisions",
    "migrate",
    "read_version",
    "refuse_newer",
    "rollback",
]

log = logging.getLogger(STORE_LOG_NAME)


@dataclass(frozen=True, slots=True)
class Migration:
    """Schema ``version`` is reached by running ``steps`` in one transaction."""

    version: int
    description: str
    steps: tuple[str, ...]


MIGRATIONS: Final[tuple[Migration, ...]] = (
    Migration(
        version=1,
        description="audit log, overrides, policy-state snapshots, published tables",
        steps=(
            """CREATE TABLE schema_version (
                version INTEGER PRIMARY KEY,
                description TEXT NOT NULL,
                applied_at_s REAL NOT NULL
            )""",
            # AUTOINCREMENT: ids are never reused after old rows are pruned, so an id
            # reported to an operator always names the same decision.
            """CREATE TABLE decisions (
                id INTEGER PRIMARY KEY AUTOINCREMENT,
                time_s REAL NOT NULL,
                policy TEXT NOT NULL,
                reason TEXT NOT NULL,
                message TEXT NOT NULL,
                limited_by TEXT NOT NULL,
                expected_gain REAL,
                inputs_summary TEXT NOT NULL,
                table_before TEXT,
                table_after TEXT
            )""",
            """CREATE TABLE overrides (
                seq INTEGER PRIMARY KEY AUTOINCREMENT,
                id TEXT NOT NULL UNIQUE,
                slot INTEGER,
                steps INTEGER,
                disable_speculation INTEGER NOT NULL,
                pin_policy TEXT,
                created_at_s REAL NOT NULL,
                expires_at_s REAL NOT NULL,
                reason TEXT NOT NULL,
                cleared_at_s REAL
            )""",
            """CREATE TABLE policy_state (
                id INTEGER PRIMARY KEY AUTOINCREMENT,
                policy TEXT NOT NULL,
                time_s REAL NOT NULL,
                state TEXT NOT NULL
            )""",
            "CREATE INDEX policy_state_by_policy ON policy_state (policy, id)",
            """CREATE TABLE tables (
                id INTEGER PRIMARY KEY AUTOINCREMENT,
                version INTEGER,
                produced_at_s REAL,
                data TEXT NOT NULL
            )""",
        ),
    ),
    Migration(
        version=2,
        description="decisions.published, settings, decisions time index",
        steps=(
            "ALTER TABLE decisions ADD COLUMN published INTEGER NOT NULL DEFAULT 0",
            "CREATE INDEX decisions_by_time ON decisions (time_s)",
            """CREATE TABLE settings (
                key TEXT PRIMARY KEY,
                value TEXT NOT NULL
            )""",
        ),
    ),
    Migration(
        version=3,
        description="decisions.restart_recommendation (structured, JSON)",
        steps=("ALTER TABLE decisions ADD COLUMN restart_recommendation TEXT",),
    ),
    # A policy no longer predicts a restart: it triggers the restart check. Version 3's
    # column stays (rows written before hold a policy's own prediction) and is not read.
    Migration(
        version=4,
        description="decisions.restart_trigger (structured, JSON)",
        steps=("ALTER TABLE decisions ADD COLUMN restart_trigger TEXT",),
    ),
)

LATEST_SCHEMA_VERSION: Final = MIGRATIONS[-1].version


def migrate(conn: sqlite3.Connection, path: Path) -> None:
    """Bring the file open on ``conn`` to :data:`LATEST_SCHEMA_VERSION`."""
    version = read_version(conn)
    refuse_newer(path, version)
    for migration in MIGRATIONS:
        if migration.version <= version:
            continue
        conn.execute("BEGIN IMMEDIATE")
        try:
            # Another process may have migrated while we waited for the lock.
            current = read_version(conn)
            refuse_newer(path, current)
            if current < migration.version:
                for step in migration.steps:
                    conn.execute(step)
                conn.execute(
                    "INSERT INTO schema_version (version, description, applied_at_s) "
                    "VALUES (?, ?, ?)",
                    (migration.version, migration.description, time.time()),
                )
            conn.execute("COMMIT")
        except BaseException:
            rollback(conn)
            raise
        if current < migration.version:
            log.info(
                "state database %s: migrated to schema v%d (%s)",
                path,
                migration.version,
                migration.description,
            )
        version = max(current, migration.version)


def refuse_newer(path: Path, version: int) -> None:
    """Refuse a file from a newer specgov, or one that is someone else's database."""
    if version > LATEST_SCHEMA_VERSION:
        raise StoreSchemaError(
            f"state database {path} has schema version {version}, newer than this "
            f"specgov supports (version {LATEST_SCHEMA_VERSION}); upgrade specgov or point "
            "state.db_path at another file"
        )
    if version < 0:
        raise StoreSchemaError(
            f"state database {path} is not a specgov state database (it has tables "
            "but no schema_version table); point state.db_path at another file"
        )


def count_decisions(conn: sqlite3.Connection) -> int:
    row = conn.execute("SELECT count(*) FROM decisions").fetchone()
    return 0 if row is None else int(row[0])


def read_version(conn: sqlite3.Connection) -> int:
    """Schema version of the file: 0 for an empty file, -1 for someone else's database."""
    names = {
        str(r[0])
        for r in conn.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'"
        )
    }
    if "schema_version" not in names:
        return -1 if names else 0
    row = conn.execute("SELECT MAX(version) FROM schema_version").fetchone()
    return 0 if row is None or row[0] is None else int(row[0])


def rollback(conn: sqlite3.Connection) -> None:
    if conn.in_transaction:
        try:
            conn.execute("ROLLBACK")
        except sqlite3.Error as exc:
            log.debug("rollback failed: %s", exc)
