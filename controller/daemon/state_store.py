"""The daemon's durable state: one SQLite file (standard library ``sqlite3``, WAL mode).

What survives a restart (issue 5, §3): the decision audit log, operator overrides with
their expiry, learned policy-state snapshots (the latest few per policy), the published
step tables (the last one read in O(log n)), and a few settings such as the current
policy spec.

Durability. Every write method is one transaction, committed before it returns, on a
connection with ``journal_mode=WAL`` and ``synchronous=FULL``. With WAL, a commit is
appended to the ``-wal`` file; ``synchronous=NORMAL`` already makes that survive a
``kill -9`` of the process (the bytes are in the OS page cache once ``write()``
returned) but may lose the last commits on power loss or a kernel crash, because the
WAL is fsynced only at checkpoints. ``FULL`` fsyncs the WAL at every commit, so
"nothing committed is lost" holds for host crashes too. The daemon writes a handful
of rows per decision interval (seconds), so one fsync per commit costs nothing that
matters; ``synchronous="NORMAL"`` can still be passed for bulk use.

Schema. ``schema_version`` holds one row per applied migration; :data:`MIGRATIONS` is
the ordered list of SQL steps, each migration applied in its own transaction together
with its version row, so a crash mid-migration leaves the previous version intact. A
fresh file is built by running every migration in order, so new and upgraded files
are identical. A file from a newer specgov is refused (:class:`StoreSchemaError`).

Errors. A read-only file or directory, a full disk, a file that cannot be opened, a
busy lock or an I/O error raise :class:`StoreUnavailable` naming the file and the
SQLite cause; the daemon catches it, keeps controlling from memory and reports it.
The connection is then dropped and the next call reconnects, so the store recovers
by itself when the cause goes away. Bad arguments raise :class:`StoreError`
(a ``ValueError``). A row whose JSON (or override fields) cannot be decoded is
skipped with a warning naming its table and id; reads never crash on one bad row.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shlex
import sqlite3
import stat
import threading
import time
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Final, Literal, NoReturn, TypeVar

import msgspec

from specgov.adapters.spool import SpoolError, resolve_gid
from specgov.policies.common.validation import (
    check_int,
    check_opt_int,
    check_opt_real,
    check_real,
    is_int,
    is_real,
)
from specgov.policies.guardrails import OVERRIDE_VERSION, Override

__all__ = [
    "LATEST_SCHEMA_VERSION",
    "MIGRATIONS",
    "ConnectFn",
    "DecisionRecord",
    "Migration",
    "OverrideRecord",
    "PolicySnapshot",
    "StartReport",
    "StateStore",
    "StoreCorrupt",
    "StoreError",
    "StoreRefused",
    "StoreReplaced",
    "StoreSchemaError",
    "StoreUnavailable",
]

log = logging.getLogger(__name__)

T = TypeVar("T")

ConnectFn = Callable[[Path], sqlite3.Connection]
"""Opens a connection to the given file; injected by tests (read-only, full disk)."""


class StoreError(ValueError):
    """Bad input to the store, or a file that is not a usable specgov state database."""


class StoreSchemaError(StoreError):
    """The file's schema is newer than this specgov (or not a specgov state database)."""


class StoreUnavailable(Exception):
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


class StoreRefused(StoreError):
    """The file cannot be trusted at start (corrupt, or a path another user could steer):
    the daemon must not start on it."""


@dataclass(frozen=True, slots=True)
class StartReport:
    """What :meth:`StateStore.start` found.

    ``created``: the file did not exist and was created empty. ``read_only``: the file
    could only be opened for reading (restore works; writes fail until it is writable).
    ``error``: why the store is unusable now (None: usable).
    """

    created: bool
    read_only: bool = False
    error: StoreUnavailable | None = None


# --------------------------------------------------------------------------- schema


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
)

LATEST_SCHEMA_VERSION: Final = MIGRATIONS[-1].version

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

# Visible ASCII, as the control API accepts (so a stored id can always be sent back);
# the placeholder used while generating an id contains a space, so never matches.
_OVERRIDE_ID: Final = re.compile(r"[\x21-\x7e]{1,100}")
_DECISION_COLUMNS: Final = (
    "id, time_s, policy, reason, message, limited_by, expected_gain, inputs_summary, "
    "table_before, table_after, published, restart_recommendation"
)
_OVERRIDE_COLUMNS: Final = (
    "seq, id, slot, steps, disable_speculation, pin_policy, created_at_s, expires_at_s, "
    "reason, cleared_at_s"
)


def _classify(exc: sqlite3.Error) -> type[StoreUnavailable] | None:
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


def _default_connect(timeout_s: float) -> ConnectFn:
    def connect(path: Path) -> sqlite3.Connection:
        # check_same_thread=False: the daemon may call from a worker thread
        # (asyncio.to_thread); the store serialises access with its own lock.
        return sqlite3.connect(
            str(path), timeout=timeout_s, isolation_level=None, check_same_thread=False
        )

    return connect


# --------------------------------------------------------------------------- records


@dataclass(frozen=True, slots=True)
class DecisionRecord:
    """One row of the audit log."""

    id: int
    time_s: float
    policy: str
    reason: str
    message: str
    limited_by: tuple[str, ...]
    expected_gain: float | None
    inputs_summary: Mapping[str, Any]
    table_before: Mapping[str, Any] | None
    table_after: Mapping[str, Any] | None
    published: bool
    restart_recommendation: Mapping[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "time_s": self.time_s,
            "policy": self.policy,
            "reason": self.reason,
            "message": self.message,
            "limited_by": list(self.limited_by),
            "expected_gain": self.expected_gain,
            "inputs_summary": dict(self.inputs_summary),
            "table_before": None if self.table_before is None else dict(self.table_before),
            "table_after": None if self.table_after is None else dict(self.table_after),
            "published": self.published,
            "restart_recommendation": None
            if self.restart_recommendation is None
            else dict(self.restart_recommendation),
        }


@dataclass(frozen=True, slots=True)
class OverrideRecord:
    """A stored override: its id, the override itself, and when it was cleared (if)."""

    id: str
    override: Override
    cleared_at_s: float | None = None

    def is_active(self, now_s: float) -> bool:
        return self.cleared_at_s is None and self.override.is_active(now_s)

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


def _finite(where: str, value: object) -> float:
    return check_real(where, value, error=StoreError)


def _opt_finite(where: str, value: object) -> float | None:
    return check_opt_real(where, value, error=StoreError)


def _text(where: str, value: object, *, empty_ok: bool = False) -> str:
    if not isinstance(value, str) or (not empty_ok and not value.strip()):
        form = "a str" if empty_ok else "a non-empty str"
        raise StoreError(f"{where}: expected {form}, got {value!r}")
    return value


def _positive_int(where: str, value: object) -> int:
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


def _dumps(where: str, value: object) -> str:
    try:
        return _ENCODER.encode(value).decode("utf-8")
    except (TypeError, ValueError, OverflowError) as exc:
        raise StoreError(f"{where}: expected a JSON-serialisable value: {exc}") from exc


def _mapping(where: str, value: object) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise StoreError(f"{where}: expected a mapping, got {value!r}")
    return value


class _BadRow(ValueError):
    """A stored row that cannot be decoded; the reader skips it with a warning."""


def _loads(column: str, raw: object, kind: type[Any]) -> Any:
    if not isinstance(raw, str):
        raise _BadRow(f"column {column}: expected JSON text, got {type(raw).__name__}")
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise _BadRow(f"column {column}: corrupt JSON ({exc})") from exc
    if not isinstance(value, kind):
        raise _BadRow(f"column {column}: expected a JSON {kind.__name__}, got {value!r:.80}")
    return value


def _opt_loads(column: str, raw: object) -> dict[str, Any] | None:
    return None if raw is None else _loads(column, raw, dict)


# --------------------------------------------------------------------------- the store


class StateStore:
    """The daemon's SQLite state (see the module docstring for durability and errors).

    ``path`` is created with its parent folders if missing. ``connect`` replaces the
    connection factory (tests inject read-only or size-limited connections); it gets the
    path and must return a connection (``check_same_thread=False`` if the store is used
    from several threads). With ``open_now=False`` nothing is opened until the first call,
    so a daemon can start while the disk is unavailable and pick the file up later.
    Thread-safe: one lock serialises every call.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        connect: ConnectFn | None = None,
        synchronous: Literal["FULL", "NORMAL"] = "FULL",
        busy_timeout_s: float = 2.0,
        keep_policy_snapshots: int = 5,
        keep_tables: int = 1000,
        keep_decisions: int = 200_000,
        open_now: bool = True,
        file_group: str | int | None = None,
    ) -> None:
        self._path = Path(path)
        self._gid = _group_id(file_group)
        # 0600: the audit log and overrides are the operator's business; 0640 when a
        # group (e.g. the inference server's) is configured to read them.
        self._file_mode = 0o600 if self._gid is None else 0o640
        self._identity: tuple[int, int] | None = None
        self._sidecar_ids: dict[str, tuple[int, int]] = {}
        self._created_on_open: bool | None = None
        self._opened_once = False
        self._read_only = False
        if synchronous not in ("FULL", "NORMAL"):
            raise StoreError(
                f"StateStore.synchronous: expected 'FULL' or 'NORMAL', got {synchronous!r}"
            )
        self._synchronous = synchronous
        timeout = _finite("StateStore.busy_timeout_s", busy_timeout_s)
        self._connect = connect if connect is not None else _default_connect(timeout)
        self._keep_snapshots = _positive_int(
            "StateStore.keep_policy_snapshots", keep_policy_snapshots
        )
        self._keep_tables = _positive_int("StateStore.keep_tables", keep_tables)
        self._keep_decisions = _positive_int("StateStore.keep_decisions", keep_decisions)
        self._lock = threading.RLock()
        self._conn: sqlite3.Connection | None = None
        self._closed = False
        self._last_error: StoreUnavailable | None = None
        if open_now:
            with self._lock:
                self._connection("open")

    # ----------------------------------------------------------------- lifecycle

    @property
    def path(self) -> Path:
        return self._path

    @property
    def last_error(self) -> StoreUnavailable | None:
        """The most recent unavailability, cleared by the next successful call."""
        return self._last_error

    def close(self) -> None:
        """Close the connection; later calls raise :class:`StoreError`."""
        with self._lock:
            self._closed = True
            self._drop()

    def __enter__(self) -> StateStore:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def schema_version(self) -> int:
        """The file's schema version (after migration: :data:`LATEST_SCHEMA_VERSION`)."""
        return self._read("schema_version", _read_version)

    def integrity_check(self) -> list[str]:
        """``PRAGMA integrity_check`` rows (``["ok"]`` when the file is sound)."""
        return self._read(
            "integrity_check",
            lambda c: [str(r[0]) for r in c.execute("PRAGMA integrity_check").fetchall()],
        )

    def _drop(self) -> None:
        conn, self._conn = self._conn, None
        self._read_only = False
        if conn is not None:
            try:
                conn.close()  # rolls back any open transaction
            except sqlite3.Error as exc:
                log.debug("state store %s: closing the connection failed: %s", self._path, exc)

    def _unavailable(self, kind: type[StoreUnavailable], op: str, exc: BaseException) -> NoReturn:
        self._drop()  # reconnect on the next call: the cause may be transient
        err = kind(self._path, op, exc)
        self._last_error = err
        raise err from exc

    def _connection(self, op: str) -> sqlite3.Connection:
        if self._closed:
            raise StoreError(f"state database {self._path}: the store is closed")
        if self._conn is not None:
            return self._conn
        try:
            self._make_parent()
            problem = self._path_problem()
            if problem is not None:
                if not self._opened_once:
                    raise StoreRefused(f"state database {self._path}: refusing it: {problem}")
                raise PermissionError(problem)  # once running: an outage, writes kept
            created = self._create_file()
        except OSError as exc:
            self._unavailable(StoreUnavailable, op, exc)
        if self._created_on_open is None:
            self._created_on_open = created
        conn: sqlite3.Connection | None = None
        try:
            conn = self._connect(self._path)
            conn.isolation_level = None  # explicit BEGIN/COMMIT below
            mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()
            if mode is None or str(mode[0]).lower() != "wal":
                log.warning(
                    "state database %s: WAL mode unavailable (journal_mode=%s); "
                    "commits stay atomic but readers may block writers",
                    self._path,
                    None if mode is None else mode[0],
                )
            conn.execute(f"PRAGMA synchronous={self._synchronous}")
            self._migrate(conn)
        except sqlite3.Error as exc:
            if conn is not None:
                conn.close()
            kind = _classify(exc)
            if kind is None:
                raise
            self._unavailable(kind, op, exc)
        except StoreSchemaError as exc:
            if conn is not None:
                conn.close()
            if not self._opened_once:
                raise  # at start: refuse the file
            # Once running, a file swapped for a foreign or newer one is an outage of
            # the store (the daemon keeps its writes), not a reason to stop controlling.
            self._unavailable(StoreUnavailable, op, exc)
        except BaseException:
            if conn is not None:
                conn.close()
            raise
        assert conn is not None
        self._conn = conn
        self._opened_once = True
        self._read_only = False
        self._identity = self._stat_identity()
        self._sidecar_ids = {
            suffix: ident
            for suffix in ("-wal", "-shm")
            if (ident := _identity(_sidecar(self._path, suffix))) is not None
        }
        self._secure_files()
        return conn

    # ------------------------------------------------------------ files and identity

    def _make_parent(self) -> None:
        parent = self._path.parent
        if not parent.exists():
            parent.mkdir(parents=True, mode=0o700 if self._gid is None else 0o750)

    def _path_problem(self) -> str | None:
        """Why the path must not be opened, or None: a dangling symlink there (SQLite
        would create the file wherever it points), or a directory that another user
        could write (they could plant the file, its -wal or a symlink under its name)."""
        path, parent = self._path, self._path.parent
        if path.is_symlink() and not path.exists():
            return (
                f"it is a symbolic link to {os.readlink(path)!r}, which does not exist; "
                "it is not followed (the file would be created wherever it points); fix: "
                "remove the link, or point state.db_path at the real file"
            )
        st = os.stat(parent)
        mode = stat.S_IMODE(st.st_mode)
        if st.st_uid not in (os.geteuid(), 0):
            return (
                f"its directory {parent} belongs to uid {st.st_uid}, not to this user "
                f"(uid {os.geteuid()}) or root, so that user could swap the file; fix: "
                "keep the state in a directory of the daemon's user"
            )
        if mode & stat.S_IWOTH:
            return (
                f"its directory {parent} is writable by every user (mode {mode:04o}), who "
                f"could plant the file or a link under its name; fix: `chmod o-w {parent}` "
                "or keep the state in a directory of its own (default ~/.local/state/specgov)"
            )
        if mode & stat.S_IWGRP and st.st_gid != self._gid:
            return (
                f"its directory {parent} is writable by its group (gid {st.st_gid}, mode "
                f"{mode:04o}), which could plant the file or a link under its name; fix: "
                f"`chmod g-w {parent}`"
            )
        return None

    def _create_file(self) -> bool:
        """Create the file with the state mode before SQLite does (SQLite gives the -wal
        and -shm files the database file's mode); True if it was created."""
        if os.path.lexists(self._path):
            return False
        try:
            fd = os.open(self._path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, self._file_mode)
        except FileExistsError:
            return False
        try:
            if self._gid is not None:
                os.fchown(fd, -1, self._gid)
            os.fchmod(fd, self._file_mode)  # the umask may have taken bits away
        finally:
            os.close(fd)
        return True

    def _secure_files(self) -> None:
        """Give the file, -wal and -shm the state mode: bits beyond it are taken away;
        with a configured group, the group is set and group read added (a file made
        0600 before ``state.group`` was configured widens to 0640). Write bits are
        never added: a read-only file stays read-only."""
        for path in (self._path, _sidecar(self._path, "-wal"), _sidecar(self._path, "-shm")):
            try:
                st = os.stat(path)
            except OSError:
                continue
            if not stat.S_ISREG(st.st_mode):
                continue
            mode = stat.S_IMODE(st.st_mode)
            wanted = mode & self._file_mode
            if self._gid is not None and mode & stat.S_IRUSR:
                wanted |= stat.S_IRGRP
            if self._gid is not None and st.st_gid != self._gid:
                try:
                    os.chown(path, -1, self._gid)
                except OSError as exc:
                    # Without the group, group read would go to the wrong group.
                    wanted &= ~stat.S_IRGRP
                    self._secure_failed(path, st, mode, "chgrp", exc)
            if wanted != mode:
                try:
                    os.chmod(path, wanted)
                except OSError as exc:
                    self._secure_failed(path, st, mode, "chmod", exc)
                else:
                    log.info("state file %s: mode %o -> %o (state mode)", path, mode, wanted)

    def _secure_failed(
        self, path: Path, st: os.stat_result, mode: int, step: str, exc: OSError
    ) -> None:
        if step == "chmod" and mode & ~self._file_mode:
            log.warning(
                "state file %s has mode %o, readable beyond its owner%s, and cannot be changed: %s",
                path,
                mode,
                "" if self._gid is None else " and group",
                exc,
            )
            return
        # Widening failed: the configured group cannot read the file.
        log.warning(
            "state file %s: state.group is gid %s but the file has gid %d and mode %o, and "
            "this process (uid %d) cannot %s it (%s), so that group cannot read it; fix: "
            "as the file's owner or root, `chgrp %s %s && chmod g+r %s`",
            path,
            self._gid,
            st.st_gid,
            mode,
            os.geteuid(),
            step,
            exc,
            self._gid,
            path,
            path,
        )

    def _stat_identity(self) -> tuple[int, int] | None:
        return _identity(self._path)

    def _remove_stale_sidecars(self) -> None:
        """Unlink the old file's -wal/-shm still under the path's names: SQLite would
        replay that WAL into the new file (its frames are checked against the WAL
        header, not the database). A -wal that came with a replacement file is kept."""
        for suffix, ident in self._sidecar_ids.items():
            path = _sidecar(self._path, suffix)
            if _identity(path) == ident:
                try:
                    path.unlink()
                except OSError as exc:
                    log.warning("state file %s (the old file's) cannot be removed: %s", path, exc)
        self._sidecar_ids = {}

    def check_identity(self, op: str = "check_identity") -> None:
        """Raise :class:`StoreReplaced` if the file at the path is not the one open.

        Called before every write (a stat: microseconds). A deleted file is recreated
        at the path from the still-open connection (SQLite's backup API reads the
        unlinked file through its open descriptors), so no committed row is lost. A
        replaced file is taken as the operator's choice: the old content is saved
        beside it as ``<name>.replaced-<unix time>`` and the store switches to the new
        file. Either way the store is usable again when this raises.
        """
        with self._lock:
            if self._conn is None or self._identity is None or self._read_only:
                return
            now = self._stat_identity()
            if now == self._identity:
                return
            if now is None and os.path.lexists(self._path):
                return  # stat failed for another reason; the write will say why
            self._recover_file(op, deleted=now is None)

    def _recover_file(self, op: str, *, deleted: bool) -> NoReturn:
        old = self._conn
        assert old is not None
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
        if deleted:
            # Copy to a temporary name first: closing the old connection deletes
            # "<path>-wal" by name, which must not be the new file's.
            target = self._path.with_name(f"{self._path.name}.recovering-{stamp}")
        else:
            target = self._path.with_name(f"{self._path.name}.replaced-{stamp}")
        cause: BaseException = FileNotFoundError(f"{self._path} no longer exists")
        try:
            self._make_parent()
            fd = os.open(target, os.O_CREAT | os.O_EXCL | os.O_WRONLY, self._file_mode)
            os.close(fd)
            copy = sqlite3.connect(str(target), check_same_thread=False)
            try:
                old.backup(copy)
            finally:
                copy.close()
            rows = _count_rows(old)
        except (OSError, sqlite3.Error) as exc:
            self._drop()
            self._identity = None
            what = "was deleted" if deleted else "was replaced by another file"
            detail = (
                f"{what} while the daemon ran; copying its open copy to {target} failed "
                f"({exc}); the rows committed before are lost unless written back"
            )
            err = StoreReplaced(
                self._path, op, exc, deleted=deleted, recovered=False, detail=detail
            )
            self._last_error = err
            raise err from exc
        # SQLite does not checkpoint or delete the WAL of a moved file on close; the old
        # -wal/-shm names are removed here instead.
        self._drop()
        self._remove_stale_sidecars()
        if deleted:
            try:
                os.replace(target, self._path)
            except OSError as exc:
                self._identity = None
                detail = (
                    f"was deleted while the daemon ran; its open copy ({rows} decisions and "
                    f"every other committed row) was saved as {target} but cannot be moved "
                    f"back ({exc}); the daemon goes on with a new file at the path; to keep "
                    f"the old rows stop it and `mv {shlex.quote(str(target))} "
                    f"{shlex.quote(str(self._path))}`"
                )
                err = StoreReplaced(
                    self._path,
                    op,
                    exc,
                    deleted=True,
                    recovered=False,
                    detail=detail,
                    saved_to=target,
                )
                self._last_error = err
                raise err from exc
            detail = (
                f"was deleted while the daemon ran; recreated it from the daemon's open copy "
                f"({rows} decisions and every other committed row kept)"
            )
            saved: Path | None = None
        else:
            detail = (
                f"was replaced by another file while the daemon ran; the daemon now uses the "
                f"new file; the old content ({rows} decisions) is saved as {target}"
            )
            saved = target
        self._identity = None
        err = StoreReplaced(
            self._path, op, cause, deleted=deleted, recovered=True, detail=detail, saved_to=saved
        )
        self._last_error = err
        raise err

    # ----------------------------------------------------------------- start-up

    def start(self) -> StartReport:
        """Open the file for a daemon start and say what was found.

        A missing file is created, with a WARNING that the daemon starts with empty
        state. A corrupt file (SQLite cannot read it, or ``PRAGMA quick_check`` fails)
        raises :class:`StoreRefused` with the recovery command: starting empty on it
        would silently drop the audit log and overrides. A file that cannot be opened
        for writing (read-only file, folder or disk) is opened read-only so every
        readable part can be restored; writes then fail (:class:`StoreUnavailable`)
        until it is writable. A newer or foreign file raises :class:`StoreSchemaError`.
        """
        with self._lock:
            error: StoreUnavailable | None = None
            conn: sqlite3.Connection | None
            try:
                conn = self._connection("start")
            except StoreCorrupt as exc:
                raise StoreRefused(self._corrupt_message(str(exc.cause))) from exc
            except StoreUnavailable as exc:
                error = exc
                conn = self._open_read_only() if os.path.lexists(self._path) else None
            created = bool(self._created_on_open)
            if created:
                log.warning(
                    "state database %s did not exist: created it; the daemon starts with "
                    "empty state (no audit log, overrides, learned policy state or table)",
                    self._path,
                )
            if conn is not None:
                try:
                    rows = [str(r[0]) for r in conn.execute("PRAGMA quick_check").fetchall()]
                except sqlite3.Error as exc:
                    if _classify(exc) is not StoreCorrupt:
                        raise
                    rows = [str(exc)]
                if rows != ["ok"]:
                    self._drop()
                    raise StoreRefused(self._corrupt_message("; ".join(rows[:3])))
                if error is None:
                    error = self._probe_write(conn)
            return StartReport(created=created, read_only=self._read_only, error=error)

    def _probe_write(self, conn: sqlite3.Connection) -> StoreUnavailable | None:
        """Whether a write lock can be taken (SQLite opens a write-protected file
        read-only without saying so); the connection stays for reading either way."""
        try:
            conn.execute("BEGIN IMMEDIATE")
            conn.execute("ROLLBACK")
        except sqlite3.Error as exc:
            _rollback(conn)
            kind = _classify(exc)
            if kind is None:
                raise
            err = kind(self._path, "start", exc)
            self._last_error = err
            return err
        return None

    def _open_read_only(self) -> sqlite3.Connection | None:
        """A read-only connection for restoring from a file that cannot be written."""
        quoted = urllib.parse.quote(str(self._path.absolute()))
        wal = os.path.lexists(_sidecar(self._path, "-wal"))
        # immutable=1 when even the -shm cannot be made (read-only folder); it reads
        # the main file only, so only when there is no -wal with commits in it.
        for query in ("mode=ro", *(() if wal else ("mode=ro&immutable=1",))):
            conn: sqlite3.Connection | None = None
            try:
                conn = sqlite3.connect(f"file:{quoted}?{query}", uri=True, check_same_thread=False)
                conn.isolation_level = None
                version = _read_version(conn)
            except sqlite3.Error as exc:
                if conn is not None:
                    conn.close()
                if _classify(exc) is StoreCorrupt:
                    raise StoreRefused(self._corrupt_message(str(exc))) from exc
                continue
            self._refuse_newer(version)
            log.warning(
                "state database %s cannot be opened for writing: opened read-only to restore "
                "what it holds; writes wait in memory until it is writable",
                self._path,
            )
            self._conn = conn
            self._read_only = True
            self._identity = self._stat_identity()
            return conn
        return None

    def _corrupt_message(self, cause: str) -> str:
        p = shlex.quote(str(self._path))
        bad = shlex.quote(f"{self._path}.corrupt")
        return (
            f"state database {self._path} is corrupt ({cause}); refusing to start on it, "
            "since starting empty would drop its audit log and overrides. Recover what is "
            f"readable with: {recovery_command(self._path)} -- or move it aside "
            f"(mv {p} {bad}) to start with empty state"
        )

    def _migrate(self, conn: sqlite3.Connection) -> None:
        version = _read_version(conn)
        self._refuse_newer(version)
        for migration in MIGRATIONS:
            if migration.version <= version:
                continue
            conn.execute("BEGIN IMMEDIATE")
            try:
                # Another process may have migrated while we waited for the lock.
                current = _read_version(conn)
                self._refuse_newer(current)
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
                _rollback(conn)
                raise
            if current < migration.version:
                log.info(
                    "state database %s: migrated to schema v%d (%s)",
                    self._path,
                    migration.version,
                    migration.description,
                )
            version = max(current, migration.version)

    def _refuse_newer(self, version: int) -> None:
        if version > LATEST_SCHEMA_VERSION:
            raise StoreSchemaError(
                f"state database {self._path} has schema version {version}, newer than this "
                f"specgov supports (version {LATEST_SCHEMA_VERSION}); upgrade specgov or point "
                "state.db_path at another file"
            )
        if version < 0:
            raise StoreSchemaError(
                f"state database {self._path} is not a specgov state database (it has tables "
                "but no schema_version table); point state.db_path at another file"
            )

    def _read(self, op: str, fn: Callable[[sqlite3.Connection], T]) -> T:
        with self._lock:
            conn = self._connection(op)
            try:
                result = fn(conn)
            except sqlite3.Error as exc:
                kind = _classify(exc)
                if kind is None:
                    raise
                self._unavailable(kind, op, exc)
            self._last_error = None
            return result

    def _write(self, op: str, fn: Callable[[sqlite3.Connection], T]) -> T:
        """Run ``fn`` in one transaction, committed before returning."""
        with self._lock:
            conn = self._connection(op)
            self.check_identity(op)
            try:
                conn.execute("BEGIN IMMEDIATE")
                result = fn(conn)
                conn.execute("COMMIT")
            except sqlite3.Error as exc:
                kind = _classify(exc)
                if kind is None:
                    _rollback(conn)
                    raise
                self._unavailable(kind, op, exc)  # dropping the connection rolls back
            except BaseException:
                _rollback(conn)
                raise
            self._last_error = None
            return result

    def _skip(self, table: str, row_id: object, err: _BadRow) -> None:
        log.warning("state database %s: %s row id=%s skipped: %s", self._path, table, row_id, err)

    # ----------------------------------------------------------------- decisions

    def record_decision(
        self,
        *,
        time_s: float,
        policy: str,
        reason: str,
        message: str,
        limited_by: Sequence[str] = (),
        expected_gain: float | None = None,
        inputs_summary: Mapping[str, Any] | None = None,
        table_before: Mapping[str, Any] | None = None,
        table_after: Mapping[str, Any] | None = None,
        published: bool = False,
        restart_recommendation: Mapping[str, Any] | None = None,
    ) -> int:
        """Append one decision to the audit log; returns its id (ids only grow)."""
        where = "record_decision"
        t = _finite(f"{where}.time_s", time_s)
        _text(f"{where}.policy", policy)
        _text(f"{where}.reason", reason)
        _text(f"{where}.message", message, empty_ok=True)
        if isinstance(limited_by, str) or not isinstance(limited_by, Sequence):
            raise StoreError(f"{where}.limited_by: expected a list of str, got {limited_by!r}")
        for i, item in enumerate(limited_by):
            _text(f"{where}.limited_by[{i}]", item)
        gain = _opt_finite(f"{where}.expected_gain", expected_gain)
        if not isinstance(published, bool):
            raise StoreError(f"{where}.published: expected a bool, got {published!r}")
        summary = _mapping(f"{where}.inputs_summary", inputs_summary or {})
        before = None if table_before is None else _mapping(f"{where}.table_before", table_before)
        after = None if table_after is None else _mapping(f"{where}.table_after", table_after)
        restart = (
            None
            if restart_recommendation is None
            else _mapping(f"{where}.restart_recommendation", restart_recommendation)
        )
        row = (
            t,
            policy,
            reason,
            message,
            _dumps(f"{where}.limited_by", list(limited_by)),
            gain,
            _dumps(f"{where}.inputs_summary", summary),
            None if before is None else _dumps(f"{where}.table_before", before),
            None if after is None else _dumps(f"{where}.table_after", after),
            int(published),
            None if restart is None else _dumps(f"{where}.restart_recommendation", restart),
        )

        def insert(conn: sqlite3.Connection) -> int:
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
                conn.execute(
                    "DELETE FROM decisions WHERE id <= ?", (new_id - self._keep_decisions,)
                )
            return new_id

        return self._write("record_decision", insert)

    def decisions(
        self,
        since_s: float | None = None,
        limit: int = 100,
        policy: str | None = None,
    ) -> list[DecisionRecord]:
        """The newest ``limit`` decisions with ``time_s >= since_s`` (and of ``policy``),
        newest first (by id, i.e. commit order). Rows that cannot be decoded are skipped
        (logged), so fewer than ``limit`` may come back."""
        since = _opt_finite("decisions.since_s", since_s)
        n = _positive_int("decisions.limit", limit)
        if policy is not None:
            _text("decisions.policy", policy)
        rows = self._read(
            "decisions",
            lambda c: c.execute(
                f"SELECT {_DECISION_COLUMNS} FROM decisions "
                "WHERE (?1 IS NULL OR time_s >= ?1) AND (?2 IS NULL OR policy = ?2) "
                "ORDER BY id DESC LIMIT ?3",
                (since, policy, n),
            ).fetchall(),
        )
        out: list[DecisionRecord] = []
        for row in rows:
            try:
                out.append(_decision_from_row(row))
            except _BadRow as err:
                self._skip("decisions", row[0], err)
        return out

    # ----------------------------------------------------------------- overrides

    def put_override(self, override: Override | Mapping[str, Any]) -> str:
        """Store an override (``Override`` or its ``to_dict()`` form, ``version`` optional,
        plus an optional ``"id"``); returns its id (``ov-<n>`` when none is given).

        Mirrors ``guardrails.set_override``: an uncleared, unexpired override of the same
        kind for the same slot is marked cleared at the new one's ``created_at_s``.
        Putting an existing id replaces that override (and un-clears it), so the daemon
        may re-persist its in-memory overrides after an outage.
        """
        ov_id: str | None
        if isinstance(override, Override):
            ov, ov_id = override, None
        else:
            data = dict(_mapping("put_override", override))
            ov_id = data.pop("id", None)
            if ov_id is not None and (
                not isinstance(ov_id, str) or _OVERRIDE_ID.fullmatch(ov_id) is None
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
        fields = (
            ov.slot,
            ov.steps,
            int(ov.disable_speculation),
            ov.pin_policy,
            ov.created_at_s,
            ov.expires_at_s,
            ov.reason,
        )

        def upsert(conn: sqlite3.Connection) -> str:
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

        return self._write("put_override", upsert)

    def list_overrides(
        self, now_s: float, include_expired: bool = False, include_cleared: bool = False
    ) -> list[OverrideRecord]:
        """Overrides in force at ``now_s`` (optionally also expired / cleared ones), oldest
        first. A row that no longer validates as an ``Override`` is skipped (logged)."""
        now = _finite("list_overrides.now_s", now_s)
        rows = self._read(
            "list_overrides",
            lambda c: c.execute(
                f"SELECT {_OVERRIDE_COLUMNS} FROM overrides "
                "WHERE (?1 OR cleared_at_s IS NULL) AND (?2 OR expires_at_s > ?3) "
                "ORDER BY created_at_s, seq",
                (int(include_cleared), int(include_expired), now),
            ).fetchall(),
        )
        out: list[OverrideRecord] = []
        for row in rows:
            try:
                out.append(_override_from_row(row))
            except _BadRow as err:
                self._skip("overrides", row[1], err)
        return out

    def clear_override(
        self,
        override_id: str | None = None,
        slot: int | None = None,
        all: bool = False,  # shadows the builtin: the documented API name
        *,
        now_s: float | None = None,
    ) -> int:
        """Clear overrides in force at ``now_s`` (default: wall clock): the one with
        ``override_id``, those of ``slot`` (not all-slot ones, as
        ``guardrails.clear_overrides``), or ``all``. Exactly one selector. Returns how
        many were cleared."""
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
            _text("clear_override.override_id", override_id)
        check_opt_int("clear_override.slot", slot, error=StoreError, minimum=1)
        now = time.time() if now_s is None else _finite("clear_override.now_s", now_s)
        where = "cleared_at_s IS NULL AND expires_at_s > ?"
        params: tuple[Any, ...] = (now, now)
        if override_id is not None:
            where += " AND id = ?"
            params += (override_id,)
        elif slot is not None:
            where += " AND slot = ?"
            params += (slot,)
        return self._write(
            "clear_override",
            lambda c: (
                c.execute(f"UPDATE overrides SET cleared_at_s = ? WHERE {where}", params).rowcount
            ),
        )

    # ----------------------------------------------------------------- policy state

    def save_policy_state(self, policy_name: str, state: Mapping[str, Any], time_s: float) -> int:
        """Snapshot a policy's state; the newest ``keep_policy_snapshots`` per policy are
        kept (older ones are the fallback if the newest cannot be decoded)."""
        _text("save_policy_state.policy_name", policy_name)
        t = _finite("save_policy_state.time_s", time_s)
        text = _dumps("save_policy_state.state", _mapping("save_policy_state.state", state))

        def insert(conn: sqlite3.Connection) -> int:
            cur = conn.execute(
                "INSERT INTO policy_state (policy, time_s, state) VALUES (?, ?, ?)",
                (policy_name, t, text),
            )
            conn.execute(
                "DELETE FROM policy_state WHERE policy = ?1 AND id NOT IN "
                "(SELECT id FROM policy_state WHERE policy = ?1 ORDER BY id DESC LIMIT ?2)",
                (policy_name, self._keep_snapshots),
            )
            assert cur.lastrowid is not None
            return cur.lastrowid

        return self._write("save_policy_state", insert)

    def load_policy_state(self, policy_name: str) -> dict[str, Any] | None:
        """The newest decodable state saved for ``policy_name``, or None."""
        snap = self.load_policy_snapshot(policy_name)
        return None if snap is None else dict(snap.state)

    def load_policy_snapshot(self, policy_name: str) -> PolicySnapshot | None:
        """Like :meth:`load_policy_state`, with the snapshot's id and time."""
        _text("load_policy_state.policy_name", policy_name)
        rows = self._read(
            "load_policy_state",
            lambda c: c.execute(
                "SELECT id, policy, time_s, state FROM policy_state WHERE policy = ? "
                "ORDER BY id DESC",
                (policy_name,),
            ).fetchall(),
        )
        for row_id, policy, t, raw in rows:
            try:
                state = _loads("state", raw, dict)
            except _BadRow as err:
                self._skip("policy_state", row_id, err)
                continue
            return PolicySnapshot(id=row_id, policy=policy, time_s=float(t), state=state)
        return None

    # ----------------------------------------------------------------- tables

    def save_table(self, table: Mapping[str, Any]) -> int:
        """Record a published table (``StepTable.to_dict()``); the newest ``keep_tables``
        are kept."""
        data = _mapping("save_table", table)
        version = data.get("version")
        produced = data.get("produced_at_s")
        version_col = version if is_int(version) else None
        produced_col = float(produced) if is_real(produced) else None
        text = _dumps("save_table", data)

        def insert(conn: sqlite3.Connection) -> int:
            cur = conn.execute(
                "INSERT INTO tables (version, produced_at_s, data) VALUES (?, ?, ?)",
                (version_col, produced_col, text),
            )
            assert cur.lastrowid is not None
            conn.execute("DELETE FROM tables WHERE id <= ?", (cur.lastrowid - self._keep_tables,))
            return cur.lastrowid

        return self._write("save_table", insert)

    def last_table(self) -> dict[str, Any] | None:
        """The most recently saved table that decodes, or None."""
        # One row on the common path; the older ones only when the newest is bad.
        rows = self._table_rows(limit=1)
        if rows:
            try:
                newest: dict[str, Any] = _loads("data", rows[0][1], dict)
                return newest
            except _BadRow as err:
                self._skip("tables", rows[0][0], err)
        for row_id, raw in self._table_rows(limit=None)[1:]:
            try:
                value: dict[str, Any] = _loads("data", raw, dict)
            except _BadRow as err:
                self._skip("tables", row_id, err)
                continue
            return value
        return None

    def table_history(self, limit: int = 20) -> list[dict[str, Any]]:
        """The newest ``limit`` saved tables, oldest first (undecodable rows skipped)."""
        n = _positive_int("table_history.limit", limit)
        out: list[dict[str, Any]] = []
        for row_id, raw in reversed(self._table_rows(limit=n)):
            try:
                out.append(_loads("data", raw, dict))
            except _BadRow as err:
                self._skip("tables", row_id, err)
        return out

    def _table_rows(self, limit: int | None) -> list[tuple[int, object]]:
        # Newest first via the primary key: reading the last table costs O(log n).
        return self._read(
            "tables",
            lambda c: [
                (int(r[0]), r[1])
                for r in c.execute(
                    "SELECT id, data FROM tables ORDER BY id DESC LIMIT ?",
                    (-1 if limit is None else limit,),
                )
            ],
        )

    # ----------------------------------------------------------------- settings

    def get_setting(self, key: str, default: Any = None) -> Any:
        """The JSON value stored under ``key`` (``default`` if absent or undecodable)."""
        _text("get_setting.key", key)
        rows = self._read(
            "get_setting",
            lambda c: c.execute("SELECT value FROM settings WHERE key = ?", (key,)).fetchall(),
        )
        if not rows:
            return default
        try:
            return _loads("value", rows[0][0], object)
        except _BadRow as err:
            self._skip("settings", repr(key), err)
            return default

    def set_setting(self, key: str, value: Any) -> None:
        """Store a JSON-serialisable ``value`` under ``key`` (replacing any earlier one)."""
        _text("set_setting.key", key)
        text = _dumps(f"set_setting[{key!r}]", value)
        self._write(
            "set_setting",
            lambda c: c.execute(
                "INSERT INTO settings (key, value) VALUES (?, ?) "
                "ON CONFLICT (key) DO UPDATE SET value = excluded.value",
                (key, text),
            ),
        )


# --------------------------------------------------------------------------- helpers


def _group_id(group: str | int | None) -> int | None:
    try:
        return resolve_gid(group, where="StateStore.file_group")
    except SpoolError as exc:
        raise StoreError(str(exc)) from None


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


def _sidecar(path: Path, suffix: str) -> Path:
    return path.with_name(path.name + suffix)


def _count_rows(conn: sqlite3.Connection) -> int:
    row = conn.execute("SELECT count(*) FROM decisions").fetchone()
    return 0 if row is None else int(row[0])


def _read_version(conn: sqlite3.Connection) -> int:
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


def _rollback(conn: sqlite3.Connection) -> None:
    if conn.in_transaction:
        try:
            conn.execute("ROLLBACK")
        except sqlite3.Error as exc:
            log.debug("rollback failed: %s", exc)


def _decision_from_row(row: Sequence[Any]) -> DecisionRecord:
    row_id, t, policy, reason, message, limited, gain, summary, before, after = row[:10]
    published, rec = row[10], row[11]
    limited_by = _loads("limited_by", limited, list)
    if not all(isinstance(x, str) for x in limited_by):
        raise _BadRow(f"column limited_by: expected a list of str, got {limited_by!r:.80}")
    return DecisionRecord(
        id=int(row_id),
        time_s=float(t),
        policy=str(policy),
        reason=str(reason),
        message=str(message),
        limited_by=tuple(limited_by),
        expected_gain=None if gain is None else float(gain),
        inputs_summary=_loads("inputs_summary", summary, dict),
        table_before=_opt_loads("table_before", before),
        table_after=_opt_loads("table_after", after),
        published=bool(published),
        restart_recommendation=_opt_loads("restart_recommendation", rec),
    )


def _override_from_row(row: Sequence[Any]) -> OverrideRecord:
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
        raise _BadRow(str(exc)) from exc
    return OverrideRecord(
        id=str(ov_id), override=ov, cleared_at_s=None if cleared is None else float(cleared)
    )


# --------------------------------------------------------------------------- recovery

# Tables copied by recover_file, oldest schema first; their rows keep their ids.
_RECOVER_TABLES: Final = ("decisions", "overrides", "policy_state", "tables", "settings")


def recovery_command(path: Path) -> str:
    """The shell command that recovers ``path`` (see :func:`recover_file`)."""
    import sys

    return (
        f"{shlex.quote(sys.executable)} -m specgov.controller.daemon.state_store recover "
        f"{shlex.quote(str(path))}"
    )


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
        old = _sidecar(target, suffix)
        if os.path.lexists(old):
            os.replace(old, _sidecar(aside, suffix))
    os.replace(fresh, target)
    for suffix in ("-wal", "-shm"):
        leftover = _sidecar(fresh, suffix)
        if os.path.lexists(leftover):
            leftover.unlink()
    return report


def _main(argv: Sequence[str]) -> int:
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


if __name__ == "__main__":
    import sys

    raise SystemExit(_main(sys.argv[1:]))
