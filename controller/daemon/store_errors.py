"""The state store's typed errors, and which one an ``sqlite3`` error maps to.

:class:`StoreError` (a ``ValueError``): bad input, or a file that is not a usable specgov
state database. :class:`StoreUnavailable`: the file cannot be used right now; the daemon
keeps controlling from memory and the store retries on the next call.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Final

from specgov.policies.common.errors import PermanentError, SpecgovError, TemporaryError

__all__ = [
    "STORE_LOG_NAME",
    "StoreCorrupt",
    "StoreError",
    "StoreRefused",
    "StoreReplaced",
    "StoreSchemaError",
    "StoreUnavailable",
    "classify",
]

# Every store module logs under this one name, the store's public module (operators
# filter the daemon's log on it; it was one module before the store was cut in files).
STORE_LOG_NAME: Final = "specgov.controller.daemon.state_store"


class StoreError(SpecgovError, ValueError):
    """Bad input to the store, or a file that is not a usable specgov state database."""


class StoreSchemaError(StoreError):
    """The file's schema is newer than this specgov (or not a specgov state database)."""


class StoreUnavailable(TemporaryError):
    """The database cannot be used right now (read-only, disk full, cannot open, busy, I/O).

    The daemon keeps controlling from memory and reports it; the store retries on the
    next call.
    """

    def __init__(self, path: Path, operation: str, cause: BaseException) -> None:
        self.path = path
        self.operation = operation
        self.cause = cause
        super().__init__(f"state database {path} unavailable during {operation}: {cause}")


class StoreCorrupt(StoreUnavailable):
    """SQLite reports the file as corrupt or not a database."""


class StoreReplaced(StoreUnavailable):
    """The file at the path is no longer the one the store had open (deleted or replaced).

    Raised once, by the write that noticed; the store has already dealt with it (see
    :meth:`StateStore.check_identity`): ``recovered`` says whether every committed row
    is in the file now at the path (``saved_to``: where the old content went, if aside).
    The write that raised was not made; the caller retries it.
    """

    def __init__(
        self,
        path: Path,
        operation: str,
        cause: BaseException,
        *,
        deleted: bool,
        recovered: bool,
        detail: str,
        saved_to: Path | None = None,
    ) -> None:
        self.deleted = deleted
        self.recovered = recovered
        self.detail = detail
        self.saved_to = saved_to
        super().__init__(path, operation, cause)
        self.args = (f"state database {path}: {detail}",)

    def __str__(self) -> str:
        return str(self.args[0])


class StoreRefused(StoreError, PermanentError):
    """The file cannot be trusted at start (corrupt, or a path another user could steer):
    the daemon must not start on it."""


# Primary SQLite result codes (extended code & 0xff) that mean "not usable right now".
_UNAVAILABLE_CODES: Final = {
    3: "SQLITE_PERM",
    5: "SQLITE_BUSY",
    6: "SQLITE_LOCKED",
    7: "SQLITE_NOMEM",
    8: "SQLITE_READONLY",
    10: "SQLITE_IOERR",
    13: "SQLITE_FULL",
    14: "SQLITE_CANTOPEN",
    15: "SQLITE_PROTOCOL",
}
_CORRUPT_CODES: Final = {11: "SQLITE_CORRUPT", 26: "SQLITE_NOTADB"}
# Fallback for exceptions without an error code (e.g. raised by an injected factory).
_UNAVAILABLE_MARKERS: Final = (
    "readonly",
    "read-only",
    "disk is full",
    "unable to open",
    "disk i/o error",
    "database is locked",
    "database table is locked",
    "out of memory",
    "access permission denied",
)
_CORRUPT_MARKERS: Final = ("malformed", "not a database")


def classify(exc: sqlite3.Error) -> type[StoreUnavailable] | None:
    """Which typed error an sqlite3 error maps to (None: a bug, re-raised as is)."""
    code = getattr(exc, "sqlite_errorcode", None)
    if isinstance(code, int):
        primary = code & 0xFF
        if primary in _CORRUPT_CODES:
            return StoreCorrupt
        if primary in _UNAVAILABLE_CODES:
            return StoreUnavailable
    text = str(exc).lower()
    if any(m in text for m in _CORRUPT_MARKERS):
        return StoreCorrupt
    if any(m in text for m in _UNAVAILABLE_MARKERS):
        return StoreUnavailable
    return None
