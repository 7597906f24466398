"""The state database's files: where they may be opened, their modes and group, and
which file is at the path.

The file and its -wal/-shm get the state mode (0600, or 0640 with a configured group);
a path another user could steer is refused. The store compares the file's identity
(device, inode) before every write to notice a file deleted or replaced under it.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import stat
from pathlib import Path

from specgov.adapters.spool import SpoolError, resolve_gid
from specgov.controller.daemon.store_errors import STORE_LOG_NAME, StoreError
from specgov.controller.daemon.store_schema import count_decisions

__all__ = ["StoreFiles", "group_id", "sidecar"]

log = logging.getLogger(STORE_LOG_NAME)


class StoreFiles:
    """The state file at ``path`` and its -wal/-shm, owned by this user (and ``gid``)."""

    def __init__(self, path: Path, gid: int | None) -> None:
        self.path = path
        self.gid = gid
        # 0600: the audit log and overrides are the operator's business; 0640 when a
        # group (e.g. the inference server's) is configured to read them.
        self.file_mode = 0o600 if gid is None else 0o640
        self._sidecar_ids: dict[str, tuple[int, int]] = {}

    def make_parent(self) -> None:
        parent = self.path.parent
        if not parent.exists():
            parent.mkdir(parents=True, mode=0o700 if self.gid is None else 0o750)

    def path_problem(self) -> str | None:
        """Why the path must not be opened, or None: a dangling symlink there (SQLite
        would create the file wherever it points), or a directory that another user
        could write (they could plant the file, its -wal or a symlink under its name)."""
        path, parent = self.path, self.path.parent
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
        if mode & stat.S_IWGRP and st.st_gid != self.gid:
            return (
                f"its directory {parent} is writable by its group (gid {st.st_gid}, mode "
                f"{mode:04o}), which could plant the file or a link under its name; fix: "
                f"`chmod g-w {parent}`"
            )
        return None

    def create_file(self) -> bool:
        """Create the file with the state mode before SQLite does (SQLite gives the -wal
        and -shm files the database file's mode); True if it was created."""
        if os.path.lexists(self.path):
            return False
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, self.file_mode)
        except FileExistsError:
            return False
        try:
            if self.gid is not None:
                os.fchown(fd, -1, self.gid)
            os.fchmod(fd, self.file_mode)  # the umask may have taken bits away
        finally:
            os.close(fd)
        return True

    def secure(self) -> None:
        """Give the file, -wal and -shm the state mode: bits beyond it are taken away;
        with a configured group, the group is set and group read added (a file made
        0600 before ``state.group`` was configured widens to 0640). Write bits are
        never added: a read-only file stays read-only."""
        for path in (self.path, sidecar(self.path, "-wal"), sidecar(self.path, "-shm")):
            try:
                st = os.stat(path)
            except OSError:
                continue
            if not stat.S_ISREG(st.st_mode):
                continue
            mode = stat.S_IMODE(st.st_mode)
            wanted = mode & self.file_mode
            if self.gid is not None and mode & stat.S_IRUSR:
                wanted |= stat.S_IRGRP
            if self.gid is not None and st.st_gid != self.gid:
                try:
                    os.chown(path, -1, self.gid)
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
        if step == "chmod" and mode & ~self.file_mode:
            log.warning(
                "state file %s has mode %o, readable beyond its owner%s, and cannot be changed: %s",
                path,
                mode,
                "" if self.gid is None else " and group",
                exc,
            )
            return
        # Widening failed: the configured group cannot read the file.
        log.warning(
            "state file %s: state.group is gid %s but the file has gid %d and mode %o, and "
            "this process (uid %d) cannot %s it (%s), so that group cannot read it; fix: "
            "as the file's owner or root, `chgrp %s %s && chmod g+r %s`",
            path,
            self.gid,
            st.st_gid,
            mode,
            os.geteuid(),
            step,
            exc,
            self.gid,
            path,
            path,
        )

    def identity(self) -> tuple[int, int] | None:
        return _file_identity(self.path)

    def remove_stale_sidecars(self) -> None:
        """Unlink the old file's -wal/-shm still under the path's names: SQLite would
        replay that WAL into the new file (its frames are checked against the WAL
        header, not the database). A -wal that came with a replacement file is kept."""
        for suffix, ident in self._sidecar_ids.items():
            path = sidecar(self.path, suffix)
            if _file_identity(path) == ident:
                try:
                    path.unlink()
                except OSError as exc:
                    log.warning("state file %s (the old file's) cannot be removed: %s", path, exc)
        self._sidecar_ids = {}

    def remember_sidecars(self) -> None:
        """Note the -wal/-shm now under the path's names (the open file's own)."""
        self._sidecar_ids = {
            suffix: ident
            for suffix in ("-wal", "-shm")
            if (ident := _file_identity(sidecar(self.path, suffix))) is not None
        }

    def copy_open(self, conn: sqlite3.Connection, target: Path) -> int:
        """Copy the database open on ``conn`` to a new file ``target`` (state mode);
        returns how many decisions it holds."""
        self.make_parent()
        fd = os.open(target, os.O_CREAT | os.O_EXCL | os.O_WRONLY, self.file_mode)
        os.close(fd)
        copy = sqlite3.connect(str(target), check_same_thread=False)
        try:
            conn.backup(copy)
        finally:
            copy.close()
        return count_decisions(conn)


def group_id(group: str | int | None) -> int | None:
    try:
        return resolve_gid(group, where="StateStore.file_group")
    except SpoolError as exc:
        raise StoreError(str(exc)) from None


def _file_identity(path: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


def sidecar(path: Path, suffix: str) -> Path:
    return path.with_name(path.name + suffix)
