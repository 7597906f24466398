"""The statistics side of the spool (:mod:`specgov.adapters.spool`): the plugin writes
one file per statistics window, the daemon reads them.

Each file is named by a writer id (host and pid by default, so several engine processes
sharing a spool, e.g. data parallelism, never overwrite each other, and a restarted
process starts a fresh sequence) and a sequence number. The daemon calls
:func:`read_tier_stats` with the cursor it got last time and receives every window
written since; the last ``keep`` windows per writer stay on disk, so a daemon that misses
polls for up to ``keep`` seconds loses nothing (gaps are counted).
:class:`BackgroundStatsWriter` does the writing for the plugin on a daemon thread fed by
a bounded queue: the engine never waits for a disk, and a full queue drops the window
(counted) instead of blocking.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import re
import socket
import threading
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from specgov.adapters.log_throttle import DEFAULT_LOG_INTERVAL_S, LogThrottle
from specgov.adapters.spool import (
    SPOOL_GROUP_ENV,
    STATS_DIRNAME,
    SpoolError,
    SpoolSecurityError,
    SpoolSettings,
    check_spool_dir,
    ensure_spool_dir,
    mode_text,
    own_uid,
    read_bounded,
    write_document,
)
from specgov.policies.common.types import TierStatsSnapshot
from specgov.policies.common.validation import is_int, is_real

# The spool's one logger, the name it had before the module was split: operators' log
# filters and handlers name it.
logger = logging.getLogger("specgov.adapters.spool")

SPOOL_SCHEMA: Final = 1  # the statistics files' format
STATS_KIND: Final = "specgov.tier_stats"
DEFAULT_STATS_KEEP: Final = 64
# A statistics window is a few KB (one entry per slot and step); bound what is read.
MAX_STATS_BYTES: Final = 1 << 20

_STATS_KEYS: Final = frozenset({"schema", "kind", "writer_id", "seq", "written_at_s", "snapshot"})
_WRITER_ID_RE: Final = re.compile(r"[A-Za-z0-9_-]{1,64}")
_STATS_NAME_RE: Final = re.compile(r"tier_stats\.([A-Za-z0-9_-]{1,64})\.(\d{1,18})\.json")


def default_writer_id() -> str:
    """``<host>-<pid>``, reduced to the characters a stats file name allows."""
    host = re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname())[:40] or "host"
    return f"{host}-{os.getpid()}"


def _check_writer_id(writer_id: str) -> str:
    if not isinstance(writer_id, str) or not _WRITER_ID_RE.fullmatch(writer_id):
        raise SpoolError(
            f"writer_id: expected 1-64 characters from [A-Za-z0-9_-], got {writer_id!r}"
        )
    return writer_id


def _stats_files(stats_dir: Path) -> list[tuple[str, int, str]]:
    """(writer id, seq, file name) of every statistics file; other names are ignored.

    Names, not paths: the daemon lists the directory at every decision and reads one
    or two of its files (a Path per listed file was a third of the read)."""
    try:
        names = os.listdir(stats_dir)
    except FileNotFoundError:
        return []
    found = []
    for name in names:
        match = _STATS_NAME_RE.fullmatch(name)
        if match is not None:
            found.append((match.group(1), int(match.group(2)), name))
    return found


def write_tier_stats(
    spool_dir: str | os.PathLike[str],
    snapshot: TierStatsSnapshot,
    *,
    writer_id: str | None = None,
    seq: int | None = None,
    written_at_s: float | None = None,
    fsync: bool = True,
    keep: int = DEFAULT_STATS_KEEP,
    settings: SpoolSettings | None = None,
) -> Path:
    """Write one statistics window atomically and prune the writer's old windows.

    ``seq`` defaults to one more than the writer's newest file. The spool is checked
    (and created) by :func:`ensure_spool_dir` under ``settings`` (default: single
    user); with a daemon uid configured the spool itself is not created here, since the
    daemon must own it. The file is 0600, or 0640 in ``settings.group_gid``, so a
    daemon running as another user of that group can read it. Raises
    :class:`SpoolError` for a malformed argument, :class:`SpoolSecurityError` for a
    spool others could write and ``OSError`` on IO failure.
    """
    if not isinstance(snapshot, TierStatsSnapshot):
        raise SpoolError(
            f"write_tier_stats: expected a TierStatsSnapshot, got {type(snapshot).__name__}"
        )
    wid = _check_writer_id(default_writer_id() if writer_id is None else writer_id)
    if not is_int(keep) or keep < 1:
        raise SpoolError(f"write_tier_stats: keep must be an int >= 1, got {keep!r}")
    cfg = SpoolSettings() if settings is None else settings
    root = ensure_spool_dir(
        spool_dir,
        group_gid=cfg.group_gid,
        trusted_uids=cfg.trusted_uids,
        create=cfg.daemon_uid is None,
    )
    stats_dir = root / STATS_DIRNAME
    if seq is None:
        mine = [s for w, s, _ in _stats_files(stats_dir) if w == wid]
        seq = max(mine, default=-1) + 1
    if not is_int(seq) or not 0 <= seq < 10**18:
        raise SpoolError(f"write_tier_stats: seq must be an int in [0, 1e18), got {seq!r}")
    now = time.time() if written_at_s is None else written_at_s
    if not is_real(now):
        raise SpoolError(f"write_tier_stats: written_at_s must be a finite number, got {now!r}")
    document = {
        "schema": SPOOL_SCHEMA,
        "kind": STATS_KIND,
        "writer_id": wid,
        "seq": seq,
        "written_at_s": float(now),
        "snapshot": snapshot.to_dict(),
    }
    path = stats_dir / f"tier_stats.{wid}.{seq:012d}.json"
    write_document(path, document, fsync=fsync, group_gid=cfg.group_gid)
    _prune(stats_dir, wid, keep)
    return path


def _prune(stats_dir: Path, writer_id: str, keep: int) -> None:
    mine = sorted((s, name) for w, s, name in _stats_files(stats_dir) if w == writer_id)
    for _, name in mine[:-keep]:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(stats_dir / name)


@dataclass(frozen=True, slots=True)
class TierStatsRecord:
    """One statistics window as the plugin wrote it."""

    writer_id: str
    seq: int
    written_at_s: float
    snapshot: TierStatsSnapshot


@dataclass(frozen=True, slots=True)
class TierStatsBatch:
    """What :func:`read_tier_stats` found since the cursor it was given.

    ``cursor`` (writer id -> last sequence number read) goes into the next call.
    ``skipped``: files that could not be read or parsed (the cursor moves past them).
    ``gaps``: windows pruned before they were read (the daemon polled too rarely).
    ``unreadable``: of ``skipped``, files this process has no permission to read
    (logged with the fix: the two-user deployment's group, docs/spool-security.md).
    """

    records: tuple[TierStatsRecord, ...]
    cursor: Mapping[str, int] = field(default_factory=dict)
    skipped: int = 0
    gaps: int = 0
    errors: tuple[str, ...] = ()
    unreadable: int = 0


def _parse_stats(raw: bytes, writer_id: str, seq: int) -> TierStatsRecord:
    try:
        document = json.loads(raw.decode("utf-8"))
    except RecursionError:
        raise SpoolError("JSON nested deeper than the decoder allows") from None
    if not isinstance(document, dict) or set(document) != _STATS_KEYS:
        raise SpoolError(f"expected a JSON object with keys {sorted(_STATS_KEYS)}")
    if document["kind"] != STATS_KIND:
        raise SpoolError(f"key 'kind': expected {STATS_KIND!r}, got {document['kind']!r}")
    if document["schema"] != SPOOL_SCHEMA or not is_int(document["schema"]):
        raise SpoolError(f"key 'schema': expected {SPOOL_SCHEMA}, got {document['schema']!r}")
    if document["writer_id"] != writer_id or document["seq"] != seq:
        raise SpoolError("keys 'writer_id'/'seq' do not match the file name")
    if not is_real(document["written_at_s"]):
        raise SpoolError(f"key 'written_at_s': expected a number, got {document['written_at_s']!r}")
    return TierStatsRecord(
        writer_id=writer_id,
        seq=seq,
        written_at_s=float(document["written_at_s"]),
        snapshot=TierStatsSnapshot.from_dict(document["snapshot"]),
    )


# The daemon's side: one rate-limited log per kind of read failure for the process.
_read_log = LogThrottle(logger, time.monotonic, DEFAULT_LOG_INTERVAL_S)


def _permission_fix(path: Path) -> str:
    try:
        st = os.stat(path)
        who = f"owner uid {st.st_uid}, group gid {st.st_gid}, mode {mode_text(st.st_mode)}"
    except OSError:
        who = "its owner, group and mode unknown"
    return (
        f"this process (uid {own_uid()}, groups {sorted(os.getgroups())}) cannot read "
        f"{path} ({who}); fix: give the server and the daemon a shared group, set "
        f"{SPOOL_GROUP_ENV}=<that group> in the server's environment (its statistics are "
        "then written 0640 in that group) and spool.group in the daemon's config "
        "(docs/spool-security.md, two-user deployment)"
    )


def read_tier_stats(
    spool_dir: str | os.PathLike[str],
    cursor: Mapping[str, int] | None = None,
    *,
    group_gid: int | None = None,
    trusted_uids: Collection[int] | None = None,
) -> TierStatsBatch:
    """Every statistics window written after ``cursor`` (None: all on disk), oldest first.

    Never raises for a bad or vanishing file (counted in ``skipped``, described in
    ``errors``; a file this process may not read is also counted in ``unreadable`` and
    logged, rate-limited, with the path and the fix). Raises :class:`SpoolSecurityError`
    if an existing spool fails :func:`check_spool_dir` (``group_gid``,
    ``trusted_uids``: as there), and ``OSError`` if the statistics directory exists but
    cannot be listed (logged the same way). A writer whose newest file is older than
    the cursor restarted its sequence under the same id: all its files are returned
    again.
    """
    root = Path(spool_dir)
    stats_dir = root / STATS_DIRNAME
    try:
        check_spool_dir(root, group_gid=group_gid, trusted_uids=trusted_uids)
    except FileNotFoundError:
        pass  # nothing written yet
    except SpoolSecurityError as exc:
        _read_log.log(logging.ERROR, "stats:insecure", str(exc))
        raise
    seen = dict(cursor or {})
    by_writer: dict[str, list[tuple[int, str]]] = {}
    try:
        listed = _stats_files(stats_dir)
    except PermissionError:
        _read_log.log(logging.ERROR, "stats:list", f"specgov spool: {_permission_fix(stats_dir)}")
        raise
    for wid, seq, name in listed:
        by_writer.setdefault(wid, []).append((seq, name))
    tally = _ReadTally()
    new_cursor = dict(seen)
    for wid, files in by_writer.items():
        files.sort()
        last = seen.get(wid, -1)
        if files[-1][0] < last:
            last = -1  # sequence restarted under the same writer id
        fresh = [(s, stats_dir / name) for s, name in files if s > last]
        if not fresh:
            continue
        if last >= 0 and fresh[0][0] > last + 1:
            tally.gaps += fresh[0][0] - last - 1
        for seq, path in fresh:
            tally.read(path, wid, seq)
        new_cursor[wid] = fresh[-1][0]
    records = tally.records
    records.sort(key=lambda r: (r.written_at_s, r.writer_id, r.seq))
    return TierStatsBatch(
        records=tuple(records),
        cursor=new_cursor,
        skipped=tally.skipped,
        gaps=tally.gaps,
        errors=tuple(tally.errors),
        unreadable=tally.unreadable,
    )


@dataclass(slots=True)
class _ReadTally:
    """What one :func:`read_tier_stats` call read, and what it could not."""

    records: list[TierStatsRecord] = field(default_factory=list)
    skipped: int = 0
    gaps: int = 0
    unreadable: int = 0
    errors: list[str] = field(default_factory=list)

    def read(self, path: Path, writer_id: str, seq: int) -> None:
        """Read one window into ``records``, or count why not (never raises for the file)."""
        try:
            self.records.append(_parse_stats(read_bounded(path, MAX_STATS_BYTES), writer_id, seq))
        except FileNotFoundError:
            self.gaps += 1  # pruned between listing and reading
        except SpoolSecurityError as exc:  # a symlink or FIFO in place of a window
            self.skipped += 1
            self.errors.append(str(exc))
            _read_log.log(logging.ERROR, "stats:refused", str(exc))
        except PermissionError as exc:
            self.skipped += 1
            self.unreadable += 1
            self.errors.append(f"{path}: {exc}")
            _read_log.log(
                logging.ERROR,
                "stats:read",
                f"specgov spool: tier statistics lost: {_permission_fix(path)}",
            )
        except (OSError, ValueError, UnicodeDecodeError) as exc:
            self.skipped += 1
            self.errors.append(f"{path}: {exc}")


_STOP: Final = object()


class BackgroundStatsWriter:
    """Writes statistics windows on a daemon thread so the engine never waits on IO.

    :meth:`submit` never blocks and never raises: it puts the snapshot on a bounded
    queue, or drops it (``dropped`` += 1) when the queue is full, e.g. on a stalled
    disk. Write failures (read-only or vanished directory) are counted in ``errors``
    and logged at most once per ``log_interval_s``. The thread starts on the first
    submit, so constructing a writer starts nothing.
    """

    def __init__(
        self,
        spool_dir: str | os.PathLike[str],
        *,
        writer_id: str | None = None,
        max_queue: int = 8,
        keep: int = DEFAULT_STATS_KEEP,
        fsync: bool = True,
        log_interval_s: float = DEFAULT_LOG_INTERVAL_S,
        write: Callable[..., Path] = write_tier_stats,
        settings: SpoolSettings | None = None,
    ) -> None:
        if not is_int(max_queue) or max_queue < 1:
            raise SpoolError(
                f"BackgroundStatsWriter: max_queue must be an int >= 1, got {max_queue!r}"
            )
        if not is_int(keep) or keep < 1:
            raise SpoolError(f"BackgroundStatsWriter: keep must be an int >= 1, got {keep!r}")
        self.spool_dir = Path(spool_dir)
        self.writer_id = _check_writer_id(default_writer_id() if writer_id is None else writer_id)
        self._keep = keep
        self._fsync = fsync
        self._write = write
        # Passed on only when given, so a custom ``write`` need not know the keyword.
        self._write_kwargs: dict[str, Any] = {} if settings is None else {"settings": settings}
        self._queue: queue.Queue[object] = queue.Queue(maxsize=max_queue)
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self._next_seq: int | None = None
        self._log = LogThrottle(logger, time.monotonic, log_interval_s)
        self.submitted = 0
        self.written = 0
        self.dropped = 0
        self.errors = 0
        self.last_error: str | None = None

    def submit(self, snapshot: TierStatsSnapshot) -> bool:
        """Queue ``snapshot`` for writing; False if it was dropped. Never blocks."""
        try:
            if self._thread is None and not self._start():
                self.dropped += 1
                return False
            self._queue.put_nowait(snapshot)
            self.submitted += 1
            return True
        except queue.Full:
            self.dropped += 1
            return False
        except Exception as exc:
            self.dropped += 1
            self._note_error(exc)
            return False

    __call__ = submit

    def close(self, timeout_s: float = 5.0) -> bool:
        """Write what is queued, then stop the thread; True if it finished in time."""
        thread = self._thread
        if thread is None:
            return True
        try:
            self._queue.put(_STOP, timeout=timeout_s)
        except queue.Full:
            return False
        thread.join(timeout_s)
        return not thread.is_alive()

    def _start(self) -> bool:
        with self._start_lock:
            if self._thread is not None:
                return True
            thread = threading.Thread(target=self._run, name="specgov-stats-writer", daemon=True)
            try:
                thread.start()
            except RuntimeError as exc:  # cannot start a thread (resource limits)
                self._note_error(exc)
                return False
            self._thread = thread
            return True

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                self._thread = None
                return
            assert isinstance(item, TierStatsSnapshot)
            try:
                self._write_one(item)
                self.written += 1
            except Exception as exc:
                self._note_error(exc)

    def _write_one(self, snapshot: TierStatsSnapshot) -> None:
        if self._next_seq is None:
            stats_dir = self.spool_dir / STATS_DIRNAME
            mine = [s for w, s, _ in _stats_files(stats_dir) if w == self.writer_id]
            self._next_seq = max(mine, default=-1) + 1
        seq = self._next_seq
        # Advance even if the write fails, so a retry never reuses a number the daemon
        # may already have seen.
        self._next_seq = seq + 1
        self._write(
            self.spool_dir,
            snapshot,
            writer_id=self.writer_id,
            seq=seq,
            fsync=self._fsync,
            keep=self._keep,
            **self._write_kwargs,
        )

    def _note_error(self, exc: BaseException) -> None:
        self.errors += 1
        self.last_error = f"{type(exc).__name__}: {exc}"
        self._log.log(
            logging.WARNING,
            "write",
            f"specgov spool: cannot write tier statistics to {self.spool_dir} "
            f"({self.last_error}); serving is unaffected [{self.errors} failure(s) so far]",
        )
