"""The control API's token file: who may steer a daemon on this host.

A daemon on loopback used to accept mutating requests (overrides, policy switches) from
any local user, which bypassed the spool's rule that only the daemon's user steers the
engine (issue 23 §2). Now, unless the operator opts out (``control.token_file: null``),
the daemon needs a token for every mutating route. Where it comes from, in order:

1. the environment variable named by ``control.token_env`` (``SPECGOV_CONTROL_TOKEN``),
   when set: the operator manages the secret;
2. else the token file (``control.token_file``; ``auto``: ``control.token`` beside the
   state database). The daemon creates it at its first start, 0600 in a directory of
   its own, and reuses it afterwards; the CLI of the same user reads it by itself, so
   `specgov override set` works without setup while other users cannot read it.

The file is trusted only when it is a regular file (a symlink there is not followed)
owned by this user and readable by nobody else; otherwise the daemon refuses to start
and the CLI refuses to use it, each naming the fix.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Final

from specgov.policies.common.errors import SpecgovError

__all__ = [
    "TOKEN_FILENAME",
    "TokenFileError",
    "client_token",
    "daemon_token",
    "ensure_token_file",
    "read_token_file",
]

TOKEN_FILENAME: Final = "control.token"
# 32 random bytes, URL-safe base64: 43 visible ASCII characters, sendable in a header.
TOKEN_BYTES: Final = 32
# A token file is one short line; anything longer is not one of ours.
MAX_TOKEN_FILE_BYTES: Final = 1024


class TokenFileError(SpecgovError, ValueError):
    """The token file cannot be trusted or used; the message names the file and the fix."""


def _open_nofollow(path: Path) -> int:
    try:
        return os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        if os.path.islink(path):
            raise TokenFileError(
                f"control token file {path} is a symbolic link; it is not followed (another "
                f"user could point it anywhere); fix: remove it and let the daemon create it"
            ) from None
        raise TokenFileError(f"control token file {path}: cannot open it: {exc}") from None


def read_token_file(path: Path, *, root_reads_any: bool = False) -> str | None:
    """The token in ``path``; None when the file does not exist.

    Raises :class:`TokenFileError` for a symlink, a non-regular file, a file owned by
    another user or readable by group or others, or content that is not one token.
    ``root_reads_any``: root may read another user's file (an operator's `sudo specgov
    override set` against a daemon running as its own user); the daemon never trusts a
    file it does not own.
    """
    if not os.path.lexists(path):
        return None
    fd = _open_nofollow(path)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise TokenFileError(f"control token file {path} is not a regular file")
        if st.st_uid != os.geteuid() and not (root_reads_any and os.geteuid() == 0):
            raise TokenFileError(
                f"control token file {path} belongs to uid {st.st_uid}, not to this user "
                f"(uid {os.geteuid()}); only the daemon's user may hold its token; fix: "
                f"remove it and let the daemon create it"
            )
        mode = stat.S_IMODE(st.st_mode)
        if mode & 0o077:
            raise TokenFileError(
                f"control token file {path} has mode {mode:04o}: group or others may read "
                f"it; fix: `chmod 600 {path}` (and restart the daemon if another user may "
                f"have read it, after removing the file so that a new token is made)"
            )
        raw = os.read(fd, MAX_TOKEN_FILE_BYTES + 1)
    finally:
        os.close(fd)
    text = raw.decode("ascii", "replace").strip()
    if len(raw) > MAX_TOKEN_FILE_BYTES or not text or any(c <= " " or c > "~" for c in text):
        raise TokenFileError(
            f"control token file {path}: expected one token of visible ASCII characters "
            f"on one line (at most {MAX_TOKEN_FILE_BYTES} bytes); fix: remove it and let "
            f"the daemon create a new one"
        )
    return text


def ensure_token_file(path: Path) -> str:
    """The token in ``path``, creating the file (0600; its directory 0700) if missing."""
    existing = read_token_file(path)
    if existing is not None:
        return existing
    parent = path.parent
    if not parent.exists():
        parent.mkdir(parents=True, mode=0o700)
    token = secrets.token_urlsafe(TOKEN_BYTES)
    tmp = parent / f".{path.name}.{os.getpid()}.tmp"
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    try:
        fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW, 0o600)
    except OSError as exc:
        raise TokenFileError(f"control token file {path}: cannot create it: {exc}") from None
    try:
        os.fchmod(fd, 0o600)  # the umask cannot widen it, but be explicit
        os.write(fd, f"{token}\n".encode("ascii"))
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        # link, not rename: a file created meanwhile by another daemon of this user wins,
        # so two daemons starting together agree on one token.
        os.link(tmp, path)
    except FileExistsError:
        pass
    except OSError as exc:
        raise TokenFileError(f"control token file {path}: cannot create it: {exc}") from None
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()
    kept = read_token_file(path)
    if kept is None:  # removed between link and read: the caller retries at next start
        raise TokenFileError(f"control token file {path} vanished while being created")
    return kept


def daemon_token(
    token_env: str | None, token_file: Path | None, env: Mapping[str, str]
) -> str | None:
    """The token the daemon requires: the environment variable's, else the token file's
    (created at first start); None when neither is configured (the opt-out)."""
    if token_env is not None and env.get(token_env):
        return env[token_env]
    if token_file is None:
        return None
    return ensure_token_file(token_file)


def client_token(
    token_env: str | None, token_file: Path | None, env: Mapping[str, str]
) -> str | None:
    """The token a CLI command sends: the environment variable's, else the token file's
    when it exists (None: send none; a daemon that needs one answers 401)."""
    if token_env is not None and env.get(token_env):
        return env[token_env]
    if token_file is None:
        return None
    return read_token_file(token_file, root_reads_any=True)
