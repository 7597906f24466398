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

The store's parts, one file each beside this one: ``store_schema`` (the migrations:
new and upgraded files are identical; a newer file is refused), ``store_errors``,
``store_files`` (modes, group, which file is at the path), ``store_records`` (the
record types and the JSON codec of the columns), ``store_rows`` (arguments checked into
rows, the SQL of each write) and ``store_recovery`` (what ``recover`` runs).

Errors. A read-only file or directory, a full disk, a file that cannot be opened, a
busy lock or an I/O error raise :class:`StoreUnavailable` naming the file and the
SQLite cause; the daemon catches it, keeps controlling from memory and reports it.
The connection is then dropped and the next call reconnects, so the store recovers
by itself when the cause goes away. Bad arguments raise :class:`StoreError`
(a ``ValueError``). A row whose JSON (or override fields) cannot be decoded is
skipped with a warning naming its table and id; reads never crash on one bad row.
"""

from __future__ import annotations

import functools
import logging
import os
import shlex
import sqlite3
import threading
import time
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, NoReturn, TypeVar

from specgov.controller.daemon.store_errors import (
    STORE_LOG_NAME,
    StoreCorrupt,
    StoreError,
    StoreRefused,
    StoreReplaced,
    StoreSchemaError,
    StoreUnavailable,
    classify,
)
from specgov.controller.daemon.store_files import StoreFiles, group_id, sidecar
from specgov.controller.daemon.store_records import (
    DECISION_COLUMNS,
    OVERRIDE_COLUMNS,
    BadRow,
    OverrideRecord,
    PolicySnapshot,
    check_finite,
    check_mapping,
    check_opt_finite,
    check_positive_int,
    check_text,
    decision_from_row,
    dumps,
    loads,
    override_from_row,
)
from specgov.controller.daemon.store_rows import (
    clear_filter,
    decision_row,
    insert_decision,
    insert_policy_state,
    insert_table,
    parse_override,
    upsert_override,
)
from specgov.controller.daemon.store_schema import migrate, read_version, refuse_newer, rollback
from specgov.policies.common.validation import is_int, is_real
from specgov.policies.control.core import AuditRecord
from specgov.policies.guardrails import Override

__all__ = [
    "ConnectFn",
    "StartReport",
    "StateStore",
    "recovery_command",
]

log = logging.getLogger(STORE_LOG_NAME)

T = TypeVar("T")

ConnectFn = Callable[[Path], sqlite3.Connection]
"""Opens a connection to the given file; injected by tests (read-only, full disk)."""


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


def _default_connect(timeout_s: float) -> ConnectFn:
    def connect(path: Path) -> sqlite3.Connection:
        # check_same_thread=False: the daemon may call from a worker thread
        # (asyncio.to_thread); the store serialises access with its own lock.
        return sqlite3.connect(
            str(path), timeout=timeout_s, isolation_level=None, check_same_thread=False
        )

    return connect


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
        self._files = StoreFiles(self._path, group_id(file_group))
        self._identity: tuple[int, int] | None = None
        self._created_on_open: bool | None = None
        self._opened_once = False
        self._read_only = False
        if synchronous not in ("FULL", "NORMAL"):
            raise StoreError(
                f"StateStore.synchronous: expected 'FULL' or 'NORMAL', got {synchronous!r}"
            )
        self._synchronous = synchronous
        timeout = check_finite("StateStore.busy_timeout_s", busy_timeout_s)
        self._connect = connect if connect is not None else _default_connect(timeout)
        self._keep_snapshots = check_positive_int(
            "StateStore.keep_policy_snapshots", keep_policy_snapshots
        )
        self._keep_tables = check_positive_int("StateStore.keep_tables", keep_tables)
        self._keep_decisions = check_positive_int("StateStore.keep_decisions", keep_decisions)
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
            self._files.make_parent()
            problem = self._files.path_problem()
            if problem is not None:
                if not self._opened_once:
                    raise StoreRefused(f"state database {self._path}: refusing it: {problem}")
                raise PermissionError(problem)  # once running: an outage, writes kept
            created = self._files.create_file()
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
            migrate(conn, self._path)
        except sqlite3.Error as exc:
            if conn is not None:
                conn.close()
            kind = classify(exc)
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
        self._identity = self._files.identity()
        self._files.remember_sidecars()
        self._files.secure()
        return conn

    # ------------------------------------------------------------ files and identity

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
            now = self._files.identity()
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
            rows = self._files.copy_open(old, target)
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
        self._files.remove_stale_sidecars()
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
                    if classify(exc) is not StoreCorrupt:
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
            rollback(conn)
            kind = classify(exc)
            if kind is None:
                raise
            err = kind(self._path, "start", exc)
            self._last_error = err
            return err
        return None

    def _open_read_only(self) -> sqlite3.Connection | None:
        """A read-only connection for restoring from a file that cannot be written."""
        quoted = urllib.parse.quote(str(self._path.absolute()))
        wal = os.path.lexists(sidecar(self._path, "-wal"))
        # immutable=1 when even the -shm cannot be made (read-only folder); it reads
        # the main file only, so only when there is no -wal with commits in it.
        for query in ("mode=ro", *(() if wal else ("mode=ro&immutable=1",))):
            conn: sqlite3.Connection | None = None
            try:
                conn = sqlite3.connect(f"file:{quoted}?{query}", uri=True, check_same_thread=False)
                conn.isolation_level = None
                version = read_version(conn)
            except sqlite3.Error as exc:
                if conn is not None:
                    conn.close()
                if classify(exc) is StoreCorrupt:
                    raise StoreRefused(self._corrupt_message(str(exc))) from exc
                continue
            refuse_newer(self._path, version)
            log.warning(
                "state database %s cannot be opened for writing: opened read-only to restore "
                "what it holds; writes wait in memory until it is writable",
                self._path,
            )
            self._conn = conn
            self._read_only = True
            self._identity = self._files.identity()
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

    def _read(self, op: str, fn: Callable[[sqlite3.Connection], T]) -> T:
        with self._lock:
            conn = self._connection(op)
            try:
                result = fn(conn)
            except sqlite3.Error as exc:
                kind = classify(exc)
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
                kind = classify(exc)
                if kind is None:
                    rollback(conn)
                    raise
                self._unavailable(kind, op, exc)  # dropping the connection rolls back
            except BaseException:
                rollback(conn)
                raise
            self._last_error = None
            return result

    def _skip(self, table: str, row_id: object, err: BadRow) -> None:
        log.warning("state database %s: %s row id=%s skipped: %s", self._path, table, row_id, err)

    def _decoded(
        self,
        table: str,
        rows: Sequence[Sequence[Any]],
        decode: Callable[[Sequence[Any]], T],
        id_column: int,
    ) -> list[T]:
        """Each row *decode* reads, in order; a bad row (:class:`BadRow`) is skipped with
        a warning naming its id (column *id_column*)."""
        out: list[T] = []
        for row in rows:
            try:
                out.append(decode(row))
            except BadRow as err:
                self._skip(table, row[id_column], err)
        return out

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
        restart_trigger: Mapping[str, Any] | None = None,
    ) -> int:
        """Append one decision to the audit log; returns its id (ids only grow)."""
        row = decision_row(
            time_s=time_s,
            policy=policy,
            reason=reason,
            message=message,
            limited_by=limited_by,
            expected_gain=expected_gain,
            inputs_summary=inputs_summary,
            table_before=table_before,
            table_after=table_after,
            published=published,
            restart_trigger=restart_trigger,
        )
        insert = functools.partial(insert_decision, row=row, keep=self._keep_decisions)
        return self._write("record_decision", insert)

    def decisions(
        self,
        since_s: float | None = None,
        limit: int = 100,
        policy: str | None = None,
    ) -> list[AuditRecord]:
        """The newest ``limit`` decisions with ``time_s >= since_s`` (and of ``policy``),
        newest first (by id, i.e. commit order). Rows that cannot be decoded are skipped
        (logged), so fewer than ``limit`` may come back."""
        since = check_opt_finite("decisions.since_s", since_s)
        n = check_positive_int("decisions.limit", limit)
        if policy is not None:
            check_text("decisions.policy", policy)
        rows = self._read(
            "decisions",
            lambda c: c.execute(
                f"SELECT {DECISION_COLUMNS} FROM decisions "
                "WHERE (?1 IS NULL OR time_s >= ?1) AND (?2 IS NULL OR policy = ?2) "
                "ORDER BY id DESC LIMIT ?3",
                (since, policy, n),
            ).fetchall(),
        )
        return self._decoded("decisions", rows, decision_from_row, 0)

    # ----------------------------------------------------------------- overrides

    def put_override(self, override: Override | Mapping[str, Any]) -> str:
        """Store an override (``Override`` or its ``to_dict()`` form, ``version`` optional,
        plus an optional ``"id"``); returns its id (``ov-<n>`` when none is given).

        Mirrors ``guardrails.set_override``: an uncleared, unexpired override of the same
        kind for the same slot is marked cleared at the new one's ``created_at_s``.
        Putting an existing id replaces that override (and un-clears it), so the daemon
        may re-persist its in-memory overrides after an outage.
        """
        ov, ov_id = parse_override(override)
        return self._write("put_override", functools.partial(upsert_override, ov=ov, ov_id=ov_id))

    def list_overrides(
        self, now_s: float, include_expired: bool = False, include_cleared: bool = False
    ) -> list[OverrideRecord]:
        """Overrides in force at ``now_s`` (optionally also expired / cleared ones), oldest
        first. A row that no longer validates as an ``Override`` is skipped (logged)."""
        now = check_finite("list_overrides.now_s", now_s)
        rows = self._read(
            "list_overrides",
            lambda c: c.execute(
                f"SELECT {OVERRIDE_COLUMNS} FROM overrides "
                "WHERE (?1 OR cleared_at_s IS NULL) AND (?2 OR expires_at_s > ?3) "
                "ORDER BY created_at_s, seq",
                (int(include_cleared), int(include_expired), now),
            ).fetchall(),
        )
        return self._decoded("overrides", rows, override_from_row, 1)

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
        where, params = clear_filter(override_id, slot, all, now_s=now_s)
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
        check_text("save_policy_state.policy_name", policy_name)
        t = check_finite("save_policy_state.time_s", time_s)
        text = dumps("save_policy_state.state", check_mapping("save_policy_state.state", state))
        insert = functools.partial(
            insert_policy_state, row=(policy_name, t, text), keep=self._keep_snapshots
        )
        return self._write("save_policy_state", insert)

    def load_policy_state(self, policy_name: str) -> dict[str, Any] | None:
        """The newest decodable state saved for ``policy_name``, or None."""
        snap = self.load_policy_snapshot(policy_name)
        return None if snap is None else dict(snap.state)

    def load_policy_snapshot(self, policy_name: str) -> PolicySnapshot | None:
        """Like :meth:`load_policy_state`, with the snapshot's id and time."""
        check_text("load_policy_state.policy_name", policy_name)
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
                state = loads("state", raw, dict)
            except BadRow as err:
                self._skip("policy_state", row_id, err)
                continue
            return PolicySnapshot(id=row_id, policy=policy, time_s=float(t), state=state)
        return None

    # ----------------------------------------------------------------- tables

    def save_table(self, table: Mapping[str, Any]) -> int:
        """Record a published table (``StepTable.to_dict()``); the newest ``keep_tables``
        are kept."""
        data = check_mapping("save_table", table)
        version = data.get("version")
        produced = data.get("produced_at_s")
        version_col = version if is_int(version) else None
        produced_col = float(produced) if is_real(produced) else None
        text = dumps("save_table", data)
        insert = functools.partial(
            insert_table, row=(version_col, produced_col, text), keep=self._keep_tables
        )
        return self._write("save_table", insert)

    def last_table(self) -> dict[str, Any] | None:
        """The most recently saved table that decodes, or None."""
        # One row on the common path; the older ones only when the newest is bad.
        rows = self._table_rows(limit=1)
        if rows:
            try:
                newest: dict[str, Any] = loads("data", rows[0][1], dict)
                return newest
            except BadRow as err:
                self._skip("tables", rows[0][0], err)
        for row_id, raw in self._table_rows(limit=None)[1:]:
            try:
                value: dict[str, Any] = loads("data", raw, dict)
            except BadRow as err:
                self._skip("tables", row_id, err)
                continue
            return value
        return None

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
        check_text("get_setting.key", key)
        rows = self._read(
            "get_setting",
            lambda c: c.execute("SELECT value FROM settings WHERE key = ?", (key,)).fetchall(),
        )
        if not rows:
            return default
        try:
            return loads("value", rows[0][0], object)
        except BadRow as err:
            self._skip("settings", repr(key), err)
            return default

    def set_setting(self, key: str, value: Any) -> None:
        """Store a JSON-serialisable ``value`` under ``key`` (replacing any earlier one)."""
        check_text("set_setting.key", key)
        text = dumps(f"set_setting[{key!r}]", value)
        self._write(
            "set_setting",
            lambda c: c.execute(
                "INSERT INTO settings (key, value) VALUES (?, ?) "
                "ON CONFLICT (key) DO UPDATE SET value = excluded.value",
                (key, text),
            ),
        )


# --------------------------------------------------------------------------- recovery


def recovery_command(path: Path) -> str:
    """The shell command that recovers ``path`` (``store_recovery.recover_file``)."""
    import sys

    return (
        f"{shlex.quote(sys.executable)} -m specgov.controller.daemon.state_store recover "
        f"{shlex.quote(str(path))}"
    )


if __name__ == "__main__":
    import sys

    # The documented command (`recovery_command`); the recovery itself lives beside.
    from specgov.controller.daemon.store_recovery import main

    raise SystemExit(main(sys.argv[1:]))
