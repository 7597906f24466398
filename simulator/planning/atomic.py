"""The one way the planning commands write a file: whole or not at all.

Every file a sweep or a report writes (job results for ``--resume``, the report's
page, figures and data) goes through ``write_atomic``: a temporary file in the same
folder, then a rename (``adapters.spool.atomic_write_bytes``, which removes its
temporary file when the write fails). A process killed mid-write (SIGKILL, power
loss) can still leave a temporary file behind; ``remove_partial_writes`` deletes
those, and the writers call it when they start and when they fail.

Temporary names: ``.<name>.<random>.tmp`` (this module) and, from versions before it,
``<name>.tmp<pid>`` (job results); both are matched.
"""

from __future__ import annotations

import contextlib
import re
from pathlib import Path

from specgov.adapters.spool import atomic_write_bytes

__all__ = ["is_partial_write", "remove_partial_writes", "write_atomic"]

# mkstemp's ".<name>.<random>.tmp" (atomic_write_bytes), and the job files' old
# "<job id>.tmp<pid>" (executor.py before write_atomic).
_PARTIAL = re.compile(r"^\..+\.tmp$|^.+\.tmp\d+$")


def write_atomic(path: Path, data: bytes | str) -> Path:
    """Write *data* (text is UTF-8) to *path*: a reader sees the old file or the whole new
    one, never a part. Raises OSError like ``open``; *path* is then as it was. The file
    is 0644: plans and reports are for others to read (mkstemp alone would make 0600)."""
    raw = data.encode("utf-8") if isinstance(data, str) else data
    # fsync: a sweep's results must survive the machine going down, not only the process.
    atomic_write_bytes(Path(path), raw, fsync=True, mode=0o644)
    return Path(path)


def is_partial_write(name: str) -> bool:
    """Whether *name* is a temporary file an interrupted ``write_atomic`` left."""
    return _PARTIAL.match(name) is not None


def remove_partial_writes(folder: Path) -> list[Path]:
    """Delete the temporary files interrupted writes left directly in *folder*; returns
    them. A missing folder has none. One writer per folder at a time: a temporary file of
    a write in progress elsewhere would be removed too."""
    removed: list[Path] = []
    try:
        entries = list(Path(folder).iterdir())
    except FileNotFoundError:
        return removed
    for entry in entries:
        if is_partial_write(entry.name) and entry.is_file() and not entry.is_symlink():
            with contextlib.suppress(FileNotFoundError):
                entry.unlink()
                removed.append(entry)
    return removed
