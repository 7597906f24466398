"""The spool directory: the channel between the specgov daemon and the in-engine plugin.

DESIGN.md, "The three control loops": the daemon publishes the step table, the plugin on
TP rank 0 publishes per-tier statistics, both as files in one directory (a shared volume
in a pod). Every file is written atomically (temp file in the same directory, fsync,
``os.replace``, fsync of the directory), so a reader sees the old file or the new one,
never a mix, and a crash loses at most the file being written.

Layout of a spool directory::

    step_table.json                          written by the daemon (write_step_table)
    stats/tier_stats.<writer>.<seq>.json     written by the plugin (write_tier_stats),
                                             one file per statistics window, the last
                                             ``keep`` per writer kept

The step-table file (schema 1 or 2: the table's own format, ``TABLE_SCHEMA``; 1 is a
step per slot, 2 adds live-acceptance rules; a plugin reads both and counts a newer
one as ``future_version``, falling back to SGLang's controller)::

    {"schema": 2, "kind": "specgov.step_table",
     "table": StepTable.to_dict(),
     "candidate_steps": [...],   # the adaptive config's candidate union the daemon
                                 # planned for, echoed so a mismatch is detected
     "written_at_s": <epoch seconds>}

:class:`SpoolTableReader` (the plugin side) does one ``os.stat`` per poll and reads the
file again only when (mtime_ns, size, inode) changed. A missing, torn, too large,
wrong-kind, future-version, invalid, candidate-mismatched or expired table yields None
(the engine falls back to SGLang's own controller), counted per reason in
``ignored`` and logged at most once per ``log_interval_s`` per reason. It never raises.

Statistics: one file per window, named by a writer id (host and pid by default, so
several engine processes sharing a spool, e.g. data parallelism, never overwrite each
other, and a restarted process starts a fresh sequence) and a sequence number. The daemon
calls :func:`read_tier_stats` with the cursor it got last time and receives every
window written since; the last ``keep`` windows per writer stay on disk, so a daemon
that misses polls for up to ``keep`` seconds loses nothing (gaps are counted).
:class:`BackgroundStatsWriter` does the writing for the plugin on a daemon thread fed
by a bounded queue: the engine never waits for a disk, and a full queue drops the
window (counted) instead of blocking.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import grp
import json
import logging
import os
import pwd
import queue
import re
import socket
import stat as stat_module
import tempfile
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Final, Protocol

from specgov.adapters.errors import escape_upstream
from specgov.adapters.log_throttle import DEFAULT_LOG_INTERVAL_S, LogThrottle
from specgov.policies.common.types import (
    TABLE_SCHEMA,
    TABLE_SCHEMAS_READ,
    FutureTableFormat,
    PolicyTypeError,
    StepTable,
    TierStatsSnapshot,
)
from specgov.policies.common.validation import is_int, is_real

logger = logging.getLogger(__name__)

SPOOL_SCHEMA: Final = 1  # the statistics files' format
TABLE_KIND: Final = "specgov.step_table"
STATS_KIND: Final = "specgov.tier_stats"
TABLE_FILENAME: Final = "step_table.json"
STATS_DIRNAME: Final = "stats"
DEFAULT_STATS_KEEP: Final = 64
# A step table is a few hundred bytes; anything this large is not one of ours.
MAX_TABLE_BYTES: Final = 1 << 20
# A statistics window is a few KB (one entry per slot and step); bound what is read.
MAX_STATS_BYTES: Final = 1 << 20

# Why SpoolTableReader returned None (keys of SpoolTableReader.ignored).
MISSING: Final = "missing"
UNREADABLE: Final = "unreadable"
TOO_LARGE: Final = "too_large"
TORN: Final = "torn"
WRONG_KIND: Final = "wrong_kind"
FUTURE_VERSION: Final = "future_version"
INVALID: Final = "invalid"
CANDIDATE_MISMATCH: Final = "candidate_mismatch"
EXPIRED: Final = "expired"
INTERNAL_ERROR: Final = "internal_error"
WRONG_OWNER: Final = "wrong_owner"  # the file is not the expected user's
INSECURE_DIR: Final = "insecure_dir"  # the spool directory is writable by others
FUTURE_DATED: Final = "future_dated"  # produced further ahead than the TTL cap reaches
# Not a reason to ignore a table: the table is followed with its TTL cut to the cap.
TTL_CAPPED: Final = "ttl_capped"

# Reasons that are expected in normal operation (daemon not started yet, table aged
# out): logged at INFO; the rest point at a bug or a misconfiguration: WARNING.
_QUIET_REASONS: Final = frozenset({MISSING, EXPIRED})

_TABLE_KEYS: Final = frozenset({"schema", "kind", "table", "candidate_steps", "written_at_s"})
_STATS_KEYS: Final = frozenset({"schema", "kind", "writer_id", "seq", "written_at_s", "snapshot"})
_WRITER_ID_RE: Final = re.compile(r"[A-Za-z0-9_-]{1,64}")
_STATS_NAME_RE: Final = re.compile(r"tier_stats\.([A-Za-z0-9_-]{1,64})\.(\d{1,18})\.json")


class SpoolError(ValueError):
    """A value handed to a spool writer or reader is malformed; the message names it."""


# ------------------------------------------------------------- ownership and modes
#
# docs/spool-security.md is the operator's view of what follows. The rules:
#
# * the spool directory is owned by a trusted user (this process's, the configured
#   daemon user's for the plugin, or root) and writable by nobody else: no write bit
#   for others, and the group write bit only when a group is configured and the
#   directory has that group (the two-user deployment);
# * specgov creates what it needs 0700 (files 0600), or with a configured group
#   02750 for the spool itself, 02770 for stats/ (which the server writes into) and
#   0640 for files, so a daemon running as another user of that group can read them;
# * the plugin follows a step table only if the file is owned by the expected user
#   (its own uid, or SPECGOV_DAEMON_UID), and never longer than a TTL cap after it
#   first read it (SPECGOV_MAX_TABLE_TTL_S, default DEFAULT_MAX_TABLE_TTL_S).

SPOOL_GROUP_ENV: Final = "SPECGOV_SPOOL_GROUP"
DAEMON_UID_ENV: Final = "SPECGOV_DAEMON_UID"
MAX_TABLE_TTL_ENV: Final = "SPECGOV_MAX_TABLE_TTL_S"
DEFAULT_MAX_TABLE_TTL_S: Final = 300.0
# A TTL cap beyond a day would no longer bound anything an operator cares about.
MAX_TABLE_TTL_CAP_S: Final = 86_400.0
SPOOL_SUBDIR: Final = "specgov"

_PRIVATE_DIR_MODE: Final = 0o700
_GROUP_DIR_MODE: Final = 0o2750  # setgid: files created inside inherit the group
_GROUP_STATS_DIR_MODE: Final = 0o2770  # the server (a group member) writes here
_PRIVATE_FILE_MODE: Final = 0o600
_GROUP_FILE_MODE: Final = 0o640


class SpoolSecurityError(PermissionError):
    """The spool directory is not safe to use; the message names the path and the fix.

    A ``PermissionError`` (an ``OSError``), so every caller that already handles an
    unwritable spool handles a refused one the same way.
    """


class _StatLike(Protocol):
    @property
    def st_mode(self) -> int: ...
    @property
    def st_uid(self) -> int: ...
    @property
    def st_gid(self) -> int: ...


def _own_uid() -> int:
    return os.geteuid()


def _resolve_id(
    value: object, *, where: str, noun: str, lookup: Callable[[str], int]
) -> int | None:
    """A ``noun`` ("group"/"user") given as a name or a numeric id (int or digit
    string); None stays None. ``lookup(name)`` raises KeyError for an unknown name."""
    if value is None:
        return None
    if is_int(value) and 0 <= value < 2**32:
        return int(value)
    if isinstance(value, str) and value.strip():
        text = value.strip()
        if text.isdecimal():
            return _resolve_id(int(text), where=where, noun=noun, lookup=lookup)
        try:
            return lookup(text)
        except KeyError:
            raise SpoolError(
                f"{where}: no {noun} named {text!r} on this host; expected a {noun} name "
                f"or a numeric {noun[0]}id"
            ) from None
    raise SpoolError(f"{where}: expected a {noun} name or a numeric {noun[0]}id, got {value!r}")


def resolve_gid(value: object, *, where: str) -> int | None:
    """A group given as a name or a numeric gid (int or digit string); None stays None."""
    return _resolve_id(value, where=where, noun="group", lookup=lambda n: grp.getgrnam(n).gr_gid)


def resolve_uid(value: object, *, where: str) -> int | None:
    """A user given as a name or a numeric uid (int or digit string); None stays None."""
    return _resolve_id(value, where=where, noun="user", lookup=lambda n: pwd.getpwnam(n).pw_uid)


def default_spool_dir(
    env: Mapping[str, str] = os.environ,
    *,
    uid: int | None = None,
    stat: Callable[[str], _StatLike] | None = None,
) -> Path:
    """Where the spool goes when the configuration does not say: never a world-writable
    place such as ``/tmp``, where another local user could create it first.

    In order: ``$XDG_RUNTIME_DIR/specgov`` when that runtime directory exists, is
    absolute, belongs to ``uid`` and is private (the per-user tmpfs systemd-logind
    makes, mode 0700); ``/run/specgov`` when it exists and belongs to ``uid`` (a systemd
    unit's ``RuntimeDirectory=specgov``) or when ``uid`` is root (who may create it);
    else ``$XDG_STATE_HOME/specgov/spool`` (default ``$HOME/.local/state``), beside the
    daemon's state database.
    """
    me = _own_uid() if uid is None else uid
    stat_fn = os.stat if stat is None else stat

    def private_to_me(path: str) -> bool:
        try:
            st = stat_fn(path)
        except OSError:
            return False
        return (
            stat_module.S_ISDIR(st.st_mode)
            and st.st_uid == me
            and not st.st_mode & (stat_module.S_IWGRP | stat_module.S_IWOTH)
        )

    runtime = env.get("XDG_RUNTIME_DIR", "")
    if runtime and os.path.isabs(runtime) and private_to_me(runtime):
        return Path(runtime) / SPOOL_SUBDIR
    run_dir = Path("/run") / SPOOL_SUBDIR
    if me == 0 or private_to_me(str(run_dir)):
        return run_dir
    state = env.get("XDG_STATE_HOME", "")
    if not (state and os.path.isabs(state)):
        home = env.get("HOME", "")
        if not home:
            try:
                home = str(Path.home())
            except (KeyError, RuntimeError):  # no HOME and no passwd entry
                return Path("/var/lib") / SPOOL_SUBDIR / "spool"
        state = str(Path(home) / ".local" / "state")
    return Path(state) / SPOOL_SUBDIR / "spool"


def _mode_text(mode: int) -> str:
    return f"{stat_module.S_IMODE(mode):04o}"


def spool_dir_problem(
    path: Path,
    st: _StatLike,
    *,
    group_gid: int | None,
    trusted_uids: Collection[int] | None,
) -> str | None:
    """Why ``path`` (with stat result ``st``) must not be used as a spool directory, or
    None. ``trusted_uids`` None skips the owner check (a subdirectory, whose creator the
    parent's check already vouched for). The message names the fix."""
    mode = st.st_mode
    if not stat_module.S_ISDIR(mode):
        return f"{path} is not a directory"
    if trusted_uids is not None and st.st_uid not in trusted_uids:
        owners = ", ".join(str(u) for u in sorted(trusted_uids))
        return (
            f"{path} is owned by uid {st.st_uid}, not by a trusted user (uid {owners}), so "
            f"that user could rewrite it; fix: remove it and let specgov create it, or "
            f"`chown` it to the daemon's user"
        )
    if mode & stat_module.S_IWOTH:
        return (
            f"{path} is writable by every user (mode {_mode_text(mode)}); fix: "
            f"`chmod o-w {path}`, or point the spool at a directory of its own "
            f"(default: {default_spool_dir()})"
        )
    if mode & stat_module.S_IWGRP and (group_gid is None or st.st_gid != group_gid):
        if group_gid is None:
            allow = (
                f"or configure its group (gid {st.st_gid}) as the spool group "
                f"(spool.group for the daemon, {SPOOL_GROUP_ENV} for the plugin) if "
                "every member of it may steer the engine"
            )
        else:
            allow = f"or `chgrp {group_gid} {path}` (the configured spool group)"
        return (
            f"{path} is writable by its group (gid {st.st_gid}, mode {_mode_text(mode)}), "
            f"which is not the configured spool group; fix: `chmod g-w {path}` {allow}"
        )
    return None


def check_spool_dir(
    spool_dir: str | os.PathLike[str],
    *,
    group_gid: int | None = None,
    trusted_uids: Collection[int] | None = None,
    stat: Callable[[Path], _StatLike] | None = None,
    subdirs: bool = True,
) -> None:
    """Raise :class:`SpoolSecurityError` unless ``spool_dir`` is safe (see
    :func:`spool_dir_problem`); ``trusted_uids`` defaults to this process's uid and
    root. With ``subdirs``, ``stats/`` is checked too when it exists (its mode only).
    A missing ``spool_dir`` raises ``FileNotFoundError``."""
    root = Path(spool_dir)
    trusted = {_own_uid(), 0} if trusted_uids is None else set(trusted_uids)
    if stat is None:
        stat = os.stat
    problem = spool_dir_problem(root, stat(root), group_gid=group_gid, trusted_uids=trusted)
    if problem is None and subdirs:
        stats_dir = root / STATS_DIRNAME
        try:
            st = stat(stats_dir)
        except FileNotFoundError:
            return
        problem = spool_dir_problem(stats_dir, st, group_gid=group_gid, trusted_uids=None)
    if problem is not None:
        raise SpoolSecurityError(f"specgov spool: refusing {problem}")


def _make_dir(path: Path, mode: int, group_gid: int | None) -> None:
    """Create ``path`` (not its parents) with exactly ``mode`` and ``group_gid``; an
    existing directory is left as it is (the operator's layout)."""
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        return
    try:
        if group_gid is not None:
            os.chown(path, -1, group_gid)
        os.chmod(path, mode)  # after chown, which may clear the setgid bit; umask ignored
    except OSError as exc:
        # Leave nothing half-made behind: a private directory without its group would
        # pass the checks and lock the other user out without a word.
        with contextlib.suppress(OSError):
            path.rmdir()
        raise SpoolSecurityError(
            exc.errno,
            f"specgov spool: cannot give {path} the group {group_gid} and mode "
            f"{mode:04o} ({exc.strerror}); is this user (uid {_own_uid()}) a member of "
            "that group?",
        ) from None


def ensure_spool_dir(
    spool_dir: str | os.PathLike[str],
    *,
    group_gid: int | None = None,
    trusted_uids: Collection[int] | None = None,
    create: bool = True,
) -> Path:
    """Create the spool (and its ``stats/``) if missing, then :func:`check_spool_dir`.

    Created 0700/0700, or with ``group_gid`` 02750/02770 in that group. Missing
    parents are created with the process's default mode. ``create`` False: a missing
    spool raises ``FileNotFoundError`` (the plugin of a two-user deployment leaves the
    spool's creation to the daemon, who must own it); ``stats/`` is still created.
    """
    root = Path(spool_dir)
    if not root.is_dir():
        if not create:
            raise FileNotFoundError(
                errno.ENOENT,
                f"specgov spool: {root} does not exist; the daemon creates it (it must own "
                f"it, {DAEMON_UID_ENV}): start the daemon first",
            )
        root.parent.mkdir(parents=True, exist_ok=True)
        _make_dir(root, _PRIVATE_DIR_MODE if group_gid is None else _GROUP_DIR_MODE, group_gid)
    check_spool_dir(root, group_gid=group_gid, trusted_uids=trusted_uids, subdirs=False)
    stats_dir = root / STATS_DIRNAME
    if not stats_dir.is_dir():
        mode = _PRIVATE_DIR_MODE if group_gid is None else _GROUP_STATS_DIR_MODE
        _make_dir(stats_dir, mode, group_gid)
    check_spool_dir(root, group_gid=group_gid, trusted_uids=trusted_uids)
    return root


def file_mode_for(group_gid: int | None) -> int:
    """The mode of the files specgov writes: 0600, or 0640 with a spool group."""
    return _PRIVATE_FILE_MODE if group_gid is None else _GROUP_FILE_MODE


def table_owner_problem(path: Path, st_uid: int, expected_uid: int) -> str | None:
    """Why a step table with owner ``st_uid`` must not be followed, or None."""
    if st_uid == expected_uid:
        return None
    return (
        f"{path} is owned by uid {st_uid}, not by the daemon's uid {expected_uid}; only the "
        f"daemon's tables are followed (set {DAEMON_UID_ENV} in the server's environment "
        "when the daemon runs as another user)"
    )


@dataclass(frozen=True, slots=True)
class SpoolSettings:
    """The plugin's spool settings, from its environment (:meth:`from_env`).

    ``group_gid``: the shared group of a two-user deployment (None: single user);
    ``daemon_uid``: who writes the step tables (None: the server's own uid);
    ``max_table_ttl_s``: the longest a table is followed after it was first read.
    """

    group_gid: int | None = None
    daemon_uid: int | None = None
    max_table_ttl_s: float = DEFAULT_MAX_TABLE_TTL_S

    def __post_init__(self) -> None:
        check_max_table_ttl_s(self.max_table_ttl_s, where="SpoolSettings.max_table_ttl_s")

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> SpoolSettings:
        """Read ``SPECGOV_SPOOL_GROUP``, ``SPECGOV_DAEMON_UID`` and
        ``SPECGOV_MAX_TABLE_TTL_S``; unset or empty means the default. Raises
        :class:`SpoolError` naming the variable."""
        group = env.get(SPOOL_GROUP_ENV) or None
        daemon = env.get(DAEMON_UID_ENV) or None
        raw_ttl = env.get(MAX_TABLE_TTL_ENV) or None
        ttl = DEFAULT_MAX_TABLE_TTL_S
        if raw_ttl is not None:
            try:
                ttl = float(raw_ttl)
            except ValueError:
                raise SpoolError(
                    f"env {MAX_TABLE_TTL_ENV}: expected a number of seconds, got {raw_ttl!r}"
                ) from None
        return cls(
            group_gid=resolve_gid(group, where=f"env {SPOOL_GROUP_ENV}"),
            daemon_uid=resolve_uid(daemon, where=f"env {DAEMON_UID_ENV}"),
            max_table_ttl_s=check_max_table_ttl_s(ttl, where=f"env {MAX_TABLE_TTL_ENV}"),
        )

    @property
    def table_owner_uid(self) -> int:
        """Whose step tables are followed."""
        return _own_uid() if self.daemon_uid is None else self.daemon_uid

    @property
    def trusted_uids(self) -> frozenset[int]:
        """Who may own the spool directory: the server, the daemon, root."""
        return frozenset({_own_uid(), self.table_owner_uid, 0})


def check_max_table_ttl_s(value: object, *, where: str) -> float:
    if not is_real(value) or not 0 < value <= MAX_TABLE_TTL_CAP_S:
        raise SpoolError(
            f"{where}: expected a number of seconds in (0, {MAX_TABLE_TTL_CAP_S:.0f}], "
            f"got {value!r}"
        )
    return float(value)


# ------------------------------------------------------------------- atomic writes


def _fsync_dir(directory: Path) -> None:
    # Makes the rename itself durable. Some filesystems refuse fsync on a directory.
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        with contextlib.suppress(OSError):
            os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(
    path: Path,
    data: bytes,
    *,
    fsync: bool = True,
    mode: int | None = None,
    gid: int | None = None,
) -> None:
    """Write ``data`` to ``path`` atomically: temp file in the same directory (same
    filesystem, so the rename is atomic), fsync, ``os.replace``, fsync the directory.

    The file is 0600 (``mkstemp``'s mode), or ``mode``; ``gid`` sets its group. Both are
    set before the rename, so no reader ever sees the file with other permissions.
    On failure the temp file is removed and ``path`` is left as it was.
    """
    directory = path.parent
    fd, tmp_name = tempfile.mkstemp(dir=directory, prefix=f".{path.name}.", suffix=".tmp")
    try:
        if gid is not None:
            os.fchown(fd, -1, gid)
        if mode is not None:
            os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as tmp:
            tmp.write(data)
            tmp.flush()
            if fsync:
                os.fsync(tmp.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp_name)
        raise
    if fsync:
        _fsync_dir(directory)


def _dump(document: Mapping[str, Any]) -> bytes:
    # allow_nan=False: NaN/Infinity are not JSON; refuse to write them.
    return json.dumps(document, allow_nan=False, separators=(",", ":")).encode("utf-8")


def normalise_candidate_steps(candidate_steps: Iterable[int], *, where: str) -> list[int]:
    """Sorted unique non-negative int steps (the engine's candidate union)."""
    try:
        steps = list(candidate_steps)
    except TypeError:
        raise SpoolError(
            f"{where}: expected a list of non-negative ints, got {candidate_steps!r}"
        ) from None
    if not steps or not all(is_int(s) and s >= 0 for s in steps):
        raise SpoolError(f"{where}: expected a non-empty list of non-negative ints, got {steps!r}")
    return sorted(set(steps))


# ---------------------------------------------------------------------- step table


def write_step_table(
    spool_dir: str | os.PathLike[str],
    table: StepTable,
    candidate_steps: Iterable[int],
    *,
    fsync: bool = True,
    written_at_s: float | None = None,
    group_gid: int | None = None,
) -> Path:
    """Publish ``table`` atomically for the engine; returns the file written.

    ``candidate_steps`` is the candidate union of the adaptive config the daemon
    planned for; a plugin running another config ignores the table. The spool is
    created (and checked) by :func:`ensure_spool_dir` with ``group_gid``; the file is
    0600, or 0640 in ``group_gid``. Raises :class:`SpoolError` (or
    :class:`PolicyTypeError`) for a malformed argument, :class:`SpoolSecurityError`
    (an ``OSError``) for a spool others could write, and ``OSError`` when the
    directory cannot be written.
    """
    if not isinstance(table, StepTable):
        raise SpoolError(f"write_step_table: expected a StepTable, got {type(table).__name__}")
    steps = normalise_candidate_steps(candidate_steps, where="write_step_table: candidate_steps")
    table.validate_against(steps)
    now = time.time() if written_at_s is None else written_at_s
    if not is_real(now):
        raise SpoolError(f"write_step_table: written_at_s must be a finite number, got {now!r}")
    encoded = table.to_dict()
    document = {
        "schema": encoded["schema"],  # the table's format: older plugins read format 1
        "kind": TABLE_KIND,
        "table": encoded,
        "candidate_steps": steps,
        "written_at_s": float(now),
    }
    directory = ensure_spool_dir(spool_dir, group_gid=group_gid)
    path = directory / TABLE_FILENAME
    atomic_write_bytes(
        path, _dump(document), fsync=fsync, mode=file_mode_for(group_gid), gid=group_gid
    )
    return path


class _Rejected(Exception):
    """Internal: the table file cannot be followed, for ``reason``."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


def parse_step_table_document(
    raw: bytes, candidate_steps: list[int] | None, *, strict: bool = True
) -> StepTable:
    """Decode and check a step-table file; raises ``_Rejected`` naming the reason.

    ``strict`` (the plugin): the whole document is checked, and ``candidate_steps`` must
    match the echoed ones. Not strict (the daemon's restart, :func:`read_published_table`:
    it only needs the last version it published): a readable table is enough.
    A format newer than this specgov's is ``future_version`` either way.
    """
    try:
        document = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        # Our writer renames whole files into place, so undecodable bytes mean a
        # partial write by something else (or a truncated copy).
        raise _Rejected(TORN, f"not a complete JSON document ({exc})") from None
    except RecursionError:
        # json's decoder recurses per nesting level; a step table nests four deep.
        raise _Rejected(INVALID, "JSON nested deeper than the decoder allows") from None
    if not isinstance(document, dict):
        raise _Rejected(INVALID, f"expected a JSON object, got {type(document).__name__}")
    schema = document.get("schema")
    if is_int(schema) and schema > TABLE_SCHEMA:
        raise _Rejected(
            FUTURE_VERSION,
            f"key 'schema': version {schema} is newer than this plugin's {TABLE_SCHEMA}; "
            "upgrade specgov in the server environment",
        )
    if strict:
        _check_table_document(document, schema, candidate_steps)
    if "table" not in document:
        raise _Rejected(INVALID, "key 'table': missing")
    try:
        return StepTable.from_dict(document["table"])
    except FutureTableFormat as exc:
        raise _Rejected(FUTURE_VERSION, f"key 'table': {exc}") from None
    except PolicyTypeError as exc:
        raise _Rejected(INVALID, f"key 'table': {exc}") from None


def _check_table_document(
    document: dict[str, Any], schema: object, candidate_steps: list[int] | None
) -> None:
    """The strict checks of :func:`parse_step_table_document`."""
    kind = document.get("kind")
    if kind != TABLE_KIND:
        raise _Rejected(WRONG_KIND, f"key 'kind': expected {TABLE_KIND!r}, got {kind!r}")
    if not is_int(schema) or schema not in TABLE_SCHEMAS_READ:
        raise _Rejected(
            INVALID, f"key 'schema': expected one of {list(TABLE_SCHEMAS_READ)}, got {schema!r}"
        )
    keys = set(document)
    if keys != _TABLE_KEYS:
        raise _Rejected(
            INVALID,
            f"expected keys {sorted(_TABLE_KEYS)}, missing {sorted(_TABLE_KEYS - keys)}, "
            f"unknown {sorted(keys - _TABLE_KEYS)}",
        )
    table = document["table"]
    if isinstance(table, dict) and table.get("schema") != schema:
        raise _Rejected(
            INVALID,
            f"key 'table': format {table.get('schema')!r} inside a schema {schema} document",
        )
    if not is_real(document["written_at_s"]):
        raise _Rejected(
            INVALID, f"key 'written_at_s': expected a number, got {document['written_at_s']!r}"
        )
    echoed = document["candidate_steps"]
    if not isinstance(echoed, list) or not all(is_int(s) and s >= 0 for s in echoed):
        raise _Rejected(
            INVALID, f"key 'candidate_steps': expected a list of non-negative ints, got {echoed!r}"
        )
    if candidate_steps is None or sorted(set(echoed)) != candidate_steps:
        raise _Rejected(
            CANDIDATE_MISMATCH,
            f"key 'candidate_steps': the table was planned for candidate steps "
            f"{sorted(set(echoed))}, this engine runs {candidate_steps} "
            "(--speculative-adaptive-config differs from the daemon's)",
        )


def read_published_table(
    spool_dir: str | os.PathLike[str], *, group_gid: int | None = None
) -> StepTable | None:
    """The table the daemon last wrote into the spool, as the engine may follow it now;
    None when there is none, it does not parse, the spool is not safe or the file is not
    this user's (the daemon then starts from its store).

    A daemon killed between writing a table and recording it restarts with a store one
    table behind the engine: its next version must still be newer than this one.
    """
    path = Path(spool_dir) / TABLE_FILENAME
    try:
        check_spool_dir(spool_dir, group_gid=group_gid)
        if os.stat(path).st_uid != _own_uid():
            logger.warning("published table %s ignored: not written by this user", path)
            return None
        raw = _read_bounded(path, MAX_TABLE_BYTES)
    except FileNotFoundError:
        return None
    except SpoolSecurityError as exc:
        logger.warning("published table %s ignored: %s", path, escape_upstream(exc))
        return None
    except OSError as exc:
        logger.warning("cannot read the published table %s: %s", path, escape_upstream(exc))
        return None
    try:
        return parse_step_table_document(raw, None, strict=False)
    except _Rejected as exc:
        logger.warning("published table %s ignored: %s", path, escape_upstream(exc.detail))
        return None


class SpoolTableReader:
    """The plugin's view of the daemon's step table (``TablePolicy.table_source``).

    Call it at poll boundaries only: each call is one ``os.stat``; the file is read
    and parsed again only when its (mtime_ns, size, inode, owner) changed. Returns the
    table, or None with the reason counted in ``ignored`` and ``last_reason`` set.
    Expiry is judged on every call with ``clock`` (epoch seconds, like the daemon's
    ``produced_at_s``). Never raises.

    ``settings`` (default :class:`SpoolSettings`: single user): each time the file
    changed, the spool directory must pass :func:`check_spool_dir` (else
    ``insecure_dir``) and the file must be owned by ``settings.table_owner_uid`` (else
    ``wrong_owner``). A table is never followed past ``settings.max_table_ttl_s`` after
    it was first read: a longer TTL is cut (counted in ``capped``, logged), and a table
    produced further in the future than that is ``future_dated``.
    """

    def __init__(
        self,
        spool_dir: str | os.PathLike[str],
        candidate_steps: Iterable[int],
        clock: Callable[[], float] = time.time,
        *,
        log_interval_s: float = DEFAULT_LOG_INTERVAL_S,
        max_bytes: int = MAX_TABLE_BYTES,
        settings: SpoolSettings | None = None,
    ) -> None:
        self.spool_dir = Path(spool_dir)
        self.path = self.spool_dir / TABLE_FILENAME
        self.settings = SpoolSettings() if settings is None else settings
        if not isinstance(self.settings, SpoolSettings):
            raise SpoolError(
                f"SpoolTableReader: settings must be a SpoolSettings, got {settings!r}"
            )
        self.candidate_steps = normalise_candidate_steps(
            candidate_steps, where="SpoolTableReader: candidate_steps"
        )
        if not is_real(log_interval_s) or log_interval_s < 0:
            raise SpoolError(
                f"SpoolTableReader: log_interval_s must be a number >= 0, got {log_interval_s!r}"
            )
        if not is_int(max_bytes) or max_bytes < 1:
            raise SpoolError(f"SpoolTableReader: max_bytes must be an int >= 1, got {max_bytes!r}")
        self._clock = clock
        self._max_bytes = max_bytes
        self._log = LogThrottle(logger, clock, log_interval_s)
        self._key: tuple[int, int, int, int] | None = None
        self._table: StepTable | None = None
        self._rejection: _Rejected | None = None
        self._last_poll_s: float | None = None  # the clock at the previous poll
        self.ignored: dict[str, int] = {}
        self.last_reason: str | None = None
        self.stats = 0  # os.stat calls
        self.reads = 0  # file reads (key changed)
        self.capped = 0  # tables whose TTL was cut to settings.max_table_ttl_s

    def __call__(self) -> StepTable | None:
        try:
            return self._poll()
        except Exception as exc:  # never raise into the engine
            self._ignore(_Rejected(INTERNAL_ERROR, f"{type(exc).__name__}: {exc}"))
            return None

    read = __call__

    def _poll(self) -> StepTable | None:
        self.stats += 1
        now = self._clock()
        last, self._last_poll_s = self._last_poll_s, now
        if last is not None and now < last and self._table is not None:
            # The clock stepped back: the table keeps the life it had left, not its date
            # (judged by its date it would be followed for the step plus its TTL).
            self._table = dataclasses.replace(
                self._table, produced_at_s=self._table.produced_at_s - (last - now)
            )
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            self._key = None
            self._table = None
            self._ignore(_Rejected(MISSING, "no step table published yet"))
            return None
        except OSError as exc:
            self._key = None
            self._ignore(_Rejected(UNREADABLE, f"stat failed: {exc}"))
            return None
        key = (st.st_mtime_ns, st.st_size, st.st_ino, st.st_uid)
        if key != self._key:
            self._load(key, st.st_size)
        if self._rejection is not None:
            self._ignore(self._rejection)
            return None
        table = self._table
        if table is None:  # unreachable: _load sets one of the two
            self._ignore(_Rejected(INTERNAL_ERROR, "no table and no reason"))
            return None
        if table.is_expired(self._clock()):
            self._ignore(
                _Rejected(
                    EXPIRED,
                    f"table version {table.version} expired at {table.expires_at_s:.3f} "
                    "(the daemon stopped publishing?)",
                )
            )
            return None
        self.last_reason = None
        return table

    def _load(self, key: tuple[int, int, int, int], size: int) -> None:
        self._table = None
        self._rejection = None
        self._key = key
        settings = self.settings
        try:
            check_spool_dir(
                self.spool_dir,
                group_gid=settings.group_gid,
                trusted_uids=settings.trusted_uids,
                subdirs=False,
            )
        except SpoolSecurityError as exc:
            self._rejection = _Rejected(INSECURE_DIR, str(exc))
            return
        except OSError as exc:
            self._key = None  # try again next poll
            self._rejection = _Rejected(UNREADABLE, f"stat of the spool failed: {exc}")
            return
        if size > self._max_bytes:
            self._rejection = _Rejected(
                TOO_LARGE, f"{size} bytes, more than the {self._max_bytes} a step table may have"
            )
            return
        try:
            with open_spool_file(self.path) as fh:  # no symlink, no FIFO
                # Cache under the key of what was actually read: the file may have been
                # replaced between stat and open; the next poll then sees a new key.
                st = os.fstat(fh.fileno())
                self._key = (st.st_mtime_ns, st.st_size, st.st_ino, st.st_uid)
                owner = table_owner_problem(self.path, st.st_uid, settings.table_owner_uid)
                if owner is not None:
                    self._rejection = _Rejected(WRONG_OWNER, owner)
                    return
                raw = fh.read(self._max_bytes + 1)
        except OSError as exc:
            self._key = None  # try again next poll
            self._rejection = _Rejected(UNREADABLE, f"read failed: {exc}")
            return
        self.reads += 1
        if len(raw) > self._max_bytes:
            self._rejection = _Rejected(TOO_LARGE, f"more than {self._max_bytes} bytes")
            return
        try:
            table = parse_step_table_document(raw, self.candidate_steps)
            self._table = self._capped(table)
        except _Rejected as rejected:
            self._rejection = rejected

    def _capped(self, table: StepTable) -> StepTable:
        """``table`` with its lifetime ending at most ``max_table_ttl_s`` from now (the
        first read of this file): a forged or stale "31-year" table cannot pin the
        engine, whatever its ``produced_at_s``."""
        cap_s = self.settings.max_table_ttl_s
        latest_end_s = self._clock() + cap_s
        ttl_s = min(table.ttl_s, cap_s, latest_end_s - table.produced_at_s)
        if ttl_s <= 0.0:
            raise _Rejected(
                FUTURE_DATED,
                f"table version {table.version} was produced at {table.produced_at_s:.3f}, "
                f"more than the TTL cap of {cap_s:g} s ahead of this clock "
                f"({MAX_TABLE_TTL_ENV}); are the daemon's and the server's clocks in step?",
            )
        if ttl_s >= table.ttl_s:
            return table
        self.capped += 1
        with contextlib.suppress(Exception):
            self._log.log(
                logging.WARNING,
                TTL_CAPPED,
                f"specgov spool: {self.path}: table version {table.version} asks for a TTL "
                f"of {table.ttl_s:g} s; following it for at most {ttl_s:g} s "
                f"({MAX_TABLE_TTL_ENV}={cap_s:g}) [{self.capped} table(s) capped so far]",
            )
        return dataclasses.replace(table, ttl_s=ttl_s)

    def _ignore(self, rejected: _Rejected) -> None:
        reason = rejected.reason
        self.ignored[reason] = count = self.ignored.get(reason, 0) + 1
        self.last_reason = reason
        level = logging.INFO if reason in _QUIET_REASONS else logging.WARNING
        # Logging must not turn an ignored table into an exception (e.g. a broken clock).
        with contextlib.suppress(Exception):
            self._log.log(
                level,
                reason,
                f"specgov spool: not following {self.path} ({reason}: {rejected.detail}); "
                f"SGLang's own adaptive controller answers [{count} poll(s) so far]",
            )


# ---------------------------------------------------------------------- statistics


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
    atomic_write_bytes(
        path, _dump(document), fsync=fsync, mode=file_mode_for(cfg.group_gid), gid=cfg.group_gid
    )
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
        who = f"owner uid {st.st_uid}, group gid {st.st_gid}, mode {_mode_text(st.st_mode)}"
    except OSError:
        who = "its owner, group and mode unknown"
    return (
        f"this process (uid {_own_uid()}, groups {sorted(os.getgroups())}) cannot read "
        f"{path} ({who}); fix: give the server and the daemon a shared group, set "
        f"{SPOOL_GROUP_ENV}=<that group> in the server's environment (its statistics are "
        "then written 0640 in that group) and spool.group in the daemon's config "
        "(docs/spool-security.md, two-user deployment)"
    )


def open_spool_file(path: Path) -> BinaryIO:
    """``path`` opened for reading, refused unless it is a regular file itself.

    ``O_NOFOLLOW``: specgov writes its spool files with ``os.replace``, never as links,
    so a symbolic link in their place was put there by someone else, to make the reader
    read another file (or hang it on a FIFO: ``O_NONBLOCK``, then only regular files
    are read). Raises :class:`SpoolSecurityError` (a ``PermissionError``) naming the
    path for a link or a non-regular file, ``OSError`` as ``open`` does otherwise.
    """
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise SpoolSecurityError(
                f"specgov spool: refusing {path}: it is a symbolic link, not a file specgov "
                "wrote (its spool files are regular files); fix: remove the link"
            ) from None
        raise
    try:
        if not stat_module.S_ISREG(os.fstat(fd).st_mode):
            raise SpoolSecurityError(
                f"specgov spool: refusing {path}: not a regular file; fix: remove it"
            )
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _read_bounded(path: Path, max_bytes: int) -> bytes:
    with open_spool_file(path) as fh:
        raw = fh.read(max_bytes + 1)
    if len(raw) > max_bytes:
        raise SpoolError(f"more than {max_bytes} bytes; not a statistics window")
    return raw


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
    records: list[TierStatsRecord] = []
    skipped = 0
    gaps = 0
    unreadable = 0
    errors: list[str] = []
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
            gaps += fresh[0][0] - last - 1
        for seq, path in fresh:
            try:
                records.append(_parse_stats(_read_bounded(path, MAX_STATS_BYTES), wid, seq))
            except FileNotFoundError:
                gaps += 1  # pruned between listing and reading
            except SpoolSecurityError as exc:  # a symlink or FIFO in place of a window
                skipped += 1
                errors.append(str(exc))
                _read_log.log(logging.ERROR, "stats:refused", str(exc))
            except PermissionError as exc:
                skipped += 1
                unreadable += 1
                errors.append(f"{path}: {exc}")
                _read_log.log(
                    logging.ERROR,
                    "stats:read",
                    f"specgov spool: tier statistics lost: {_permission_fix(path)}",
                )
            except (OSError, ValueError, UnicodeDecodeError) as exc:
                skipped += 1
                errors.append(f"{path}: {exc}")
        new_cursor[wid] = fresh[-1][0]
    records.sort(key=lambda r: (r.written_at_s, r.writer_id, r.seq))
    return TierStatsBatch(
        records=tuple(records),
        cursor=new_cursor,
        skipped=skipped,
        gaps=gaps,
        errors=tuple(errors),
        unreadable=unreadable,
    )


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
