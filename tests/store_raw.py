"""Reading a state file behind the store's back (test helpers, raw SQLite)."""

from __future__ import annotations

import contextlib
import json
import sqlite3
from pathlib import Path
from typing import Any

from specgov.controller.daemon.store_schema import read_version


def _query(path: Path, sql: str, *args: object) -> list[tuple[Any, ...]]:
    with contextlib.closing(sqlite3.connect(str(path), isolation_level=None)) as raw:
        return raw.execute(sql, args).fetchall()


def integrity(path: Path) -> list[str]:
    """``PRAGMA integrity_check`` rows of the file (``["ok"]`` when it is sound)."""
    return [str(r[0]) for r in _query(path, "PRAGMA integrity_check")]


def schema_version(path: Path) -> int:
    """The file's schema version, as the store reads it."""
    with contextlib.closing(sqlite3.connect(str(path), isolation_level=None)) as raw:
        return read_version(raw)


def table_history(path: Path, limit: int) -> list[dict[str, Any]]:
    """The newest *limit* saved tables, oldest first."""
    rows = _query(path, "SELECT data FROM tables ORDER BY id DESC LIMIT ?", limit)
    return [json.loads(r[0]) for r in reversed(rows)]
