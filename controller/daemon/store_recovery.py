"""Recovering a corrupt state database: every readable row is copied into a new file.

Run as ``python -m specgov.controller.daemon.state_store recover STATE_DB`` (the command
a refused start prints, :func:`~specgov.controller.daemon.state_store.recovery_command`).
"""

from __future__ import annotations

import os
import sqlite3
import time
import urllib.parse
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

from specgov.controller.daemon.state_store import StateStore
from specgov.controller.daemon.store_files import sidecar

__all__ = ["main", "recover_file"]

# Tables copied by recover_file, oldest schema first; their rows keep their ids.
_RECOVER_TABLES: Final = ("decisions", "overrides", "policy_state", "tables", "settings")


def _readable_rows(
    src: sqlite3.Connection, table: str, columns: Sequence[str]
) -> tuple[list[tuple[Any, ...]], int]:
    """Every row of ``table`` that can be read, in rowid order, and how many rowid
    probes hit unreadable pages. A corrupt page costs the rows on it only: the scan
    resumes past it by seeking ever further rowids."""
    cols = ", ".join(["rowid", *columns])
    query = f"SELECT {cols} FROM {table} WHERE rowid >= ? ORDER BY rowid"
    rows: list[tuple[Any, ...]] = []
    try:
        (top,) = src.execute(f"SELECT max(rowid) FROM {table}").fetchone()
    except sqlite3.DatabaseError:
        top = None  # the last page is unreadable: probe up to a far bound
    limit = (1 << 40) if top is None else int(top)
    floor, skipped, failures = 1, 0, 0
    while floor <= limit:
        try:
            for row in src.execute(query, (floor,)):
                rows.append(tuple(row[1:]))
                floor = int(row[0]) + 1
                failures = 0
            break
        except sqlite3.DatabaseError:
            # The scan hit an unreadable page at or after ``floor``: step past it one
            # rowid at a time across a few pages, then ever faster.
            skipped += 1
            failures += 1
            floor += 1 if failures < 256 else 1 << min(failures - 256, 40)
    return rows, skipped


def recover_file(path: str | Path) -> dict[str, dict[str, int]]:
    """Copy every readable row of a corrupt state database into a new file at ``path``.

    The corrupt file (and its -wal/-shm) is kept as ``<name>.corrupt-<time>``. Returns
    ``{table: {"rows": kept, "unreadable_probes": n}}``. The new file has the current
    schema; ids are preserved, so audit ids stay what operators were told.
    """
    target = Path(path)
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    fresh = target.with_name(f"{target.name}.recovered-{stamp}")
    quoted = urllib.parse.quote(str(target.absolute()))
    src = sqlite3.connect(f"file:{quoted}?mode=ro", uri=True)
    report: dict[str, dict[str, int]] = {}
    try:
        StateStore(fresh).close()
        dst = sqlite3.connect(str(fresh), isolation_level=None)
        try:
            dst.execute("BEGIN")
            for table in _RECOVER_TABLES:
                wanted = [str(r[1]) for r in dst.execute(f"PRAGMA table_info({table})")]
                try:
                    have = {str(r[1]) for r in src.execute(f"PRAGMA table_info({table})")}
                except sqlite3.DatabaseError:
                    have = set()
                columns = [c for c in wanted if c in have]
                if not columns:
                    report[table] = {"rows": 0, "unreadable_probes": 0}
                    continue
                rows, skipped = _readable_rows(src, table, columns)
                marks = ", ".join("?" for _ in columns)
                dst.executemany(
                    f"INSERT OR REPLACE INTO {table} ({', '.join(columns)}) VALUES ({marks})", rows
                )
                report[table] = {"rows": len(rows), "unreadable_probes": skipped}
            dst.execute("COMMIT")
        finally:
            dst.close()
    finally:
        src.close()
    aside = target.with_name(f"{target.name}.corrupt-{stamp}")
    for suffix in ("", "-wal", "-shm"):
        old = sidecar(target, suffix)
        if os.path.lexists(old):
            os.replace(old, sidecar(aside, suffix))
    os.replace(fresh, target)
    for suffix in ("-wal", "-shm"):
        leftover = sidecar(fresh, suffix)
        if os.path.lexists(leftover):
            leftover.unlink()
    return report


def main(argv: Sequence[str]) -> int:
    if len(argv) != 2 or argv[0] != "recover":
        print("usage: python -m specgov.controller.daemon.state_store recover STATE_DB")
        return 2
    path = Path(argv[1])
    if not path.is_file():
        print(f"error: {path}: no such file")
        return 2
    try:
        report = recover_file(path)
    except (OSError, sqlite3.Error) as exc:
        print(f"error: cannot recover {path}: {exc}")
        return 1
    for table, counts in report.items():
        print(f"{table}: {counts['rows']} rows recovered, {counts['unreadable_probes']} unreadable")
    print(f"recovered into {path}; the corrupt file is kept beside it as {path.name}.corrupt-*")
    return 0
