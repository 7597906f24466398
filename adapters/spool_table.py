"""The step-table side of the spool (:mod:`specgov.adapters.spool`): the daemon writes
``step_table.json``, the plugin follows it.

The step-table file (schema 1 to 4: the table's own format, ``TABLE_SCHEMA``; 1 is
a step per slot, 2 adds live-acceptance rules, 3 lets a rule name its probe step, 4
gives each rule's cuts their goodput slopes; a plugin reads all four and counts a newer
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
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Final

from specgov.adapters.errors import escape_upstream
from specgov.adapters.log_throttle import DEFAULT_LOG_INTERVAL_S, LogThrottle
from specgov.adapters.spool import (
    MAX_TABLE_TTL_ENV,
    SpoolError,
    SpoolSecurityError,
    SpoolSettings,
    check_spool_dir,
    ensure_spool_dir,
    open_spool_file,
    own_uid,
    read_bounded,
    table_owner_problem,
    write_document,
)
from specgov.policies.common.errors import SpecgovError
from specgov.policies.common.step_table import (
    TABLE_SCHEMA,
    TABLE_SCHEMAS_READ,
    FutureTableFormat,
    StepTable,
)
from specgov.policies.common.types import PolicyTypeError
from specgov.policies.common.validation import is_int, is_real, is_step_list

# The spool's one logger, the name it had before the module was split: operators' log
# filters and handlers name it.
logger = logging.getLogger("specgov.adapters.spool")

TABLE_KIND: Final = "specgov.step_table"
TABLE_FILENAME: Final = "step_table.json"
# A step table is a few hundred bytes; anything this large is not one of ours.
MAX_TABLE_BYTES: Final = 1 << 20

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


def normalise_candidate_steps(candidate_steps: Iterable[int], *, where: str) -> list[int]:
    """Sorted unique non-negative int steps (the engine's candidate union)."""
    try:
        steps = list(candidate_steps)
    except TypeError:
        raise SpoolError(
            f"{where}: expected a list of non-negative ints, got {candidate_steps!r}"
        ) from None
    if not is_step_list(steps):
        raise SpoolError(f"{where}: expected a non-empty list of non-negative ints, got {steps!r}")
    return sorted(set(steps))


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
    write_document(path, document, fsync=fsync, group_gid=group_gid)
    return path


class _Rejected(SpecgovError):
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
        if os.stat(path).st_uid != own_uid():
            logger.warning("published table %s ignored: not written by this user", path)
            return None
        raw = read_bounded(path, MAX_TABLE_BYTES)
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
