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

Three modules: this one holds what both sides share (the directory's ownership and modes,
the plugin's :class:`SpoolSettings`, atomic writes, safe bounded reads);
:mod:`specgov.adapters.spool_table` the step table (its writer, its parser and the
plugin's :class:`~specgov.adapters.spool_table.SpoolTableReader`);
:mod:`specgov.adapters.spool_stats` the statistics windows (their writer, the daemon's
reader and the plugin's background writer).
"""

from __future__ import annotations

import contextlib
import errno
import grp
import json
import os
import pwd
import stat as stat_module
import tempfile
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Final, Protocol

from specgov.policies.common.errors import SpecgovError
from specgov.policies.common.validation import is_int, is_real

STATS_DIRNAME: Final = "stats"


class SpoolError(SpecgovError, ValueError):
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


class SpoolSecurityError(SpecgovError, PermissionError):
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


def own_uid() -> int:
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
    me = own_uid() if uid is None else uid
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


def mode_text(mode: int) -> str:
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
            f"{path} is writable by every user (mode {mode_text(mode)}); fix: "
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
            f"{path} is writable by its group (gid {st.st_gid}, mode {mode_text(mode)}), "
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
    trusted = {own_uid(), 0} if trusted_uids is None else set(trusted_uids)
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
            f"{mode:04o} ({exc.strerror}); is this user (uid {own_uid()}) a member of "
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
        return own_uid() if self.daemon_uid is None else self.daemon_uid

    @property
    def trusted_uids(self) -> frozenset[int]:
        """Who may own the spool directory: the server, the daemon, root."""
        return frozenset({own_uid(), self.table_owner_uid, 0})


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


def dump_document(document: Mapping[str, Any]) -> bytes:
    # allow_nan=False: NaN/Infinity are not JSON; refuse to write them.
    return json.dumps(document, allow_nan=False, separators=(",", ":")).encode("utf-8")


def write_document(
    path: Path, document: Mapping[str, Any], *, fsync: bool, group_gid: int | None
) -> None:
    """Write a spool document to ``path``: compact JSON (:func:`dump_document`),
    atomically (:func:`atomic_write_bytes`), 0600 or 0640 in ``group_gid``
    (:func:`file_mode_for`)."""
    atomic_write_bytes(
        path, dump_document(document), fsync=fsync, mode=file_mode_for(group_gid), gid=group_gid
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


def read_bounded(path: Path, max_bytes: int) -> bytes:
    with open_spool_file(path) as fh:
        raw = fh.read(max_bytes + 1)
    if len(raw) > max_bytes:
        raise SpoolError(f"more than {max_bytes} bytes; not a statistics window")
    return raw
