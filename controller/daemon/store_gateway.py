"""The daemon's way to its state store: every write, the journal while the store is down,
the write-back when it returns, and the audit rows read back for ``/v1/decisions``.

The daemon (controller/daemon/runtime.py) owns what it writes; this gateway owns how: a
failure is reported at once (status, metric, journal; one log line per burst), writes
queue in order while the store is down, and the outage is recorded as an audit row of
its own when they are written back.
"""

from __future__ import annotations

import functools
import logging
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from specgov.adapters.errors import escape_upstream
from specgov.adapters.log_throttle import MAX_LOGGED_CHARS, LogThrottle
from specgov.controller.daemon.health import FailureClock
from specgov.controller.daemon.own_metrics import DaemonMetrics
from specgov.controller.daemon.state_store import StateStore
from specgov.controller.daemon.status_view import DaemonStatus
from specgov.controller.daemon.store_errors import StoreCorrupt, StoreReplaced, StoreUnavailable
from specgov.controller.daemon.store_journal import (
    PendingWrite,
    StoreJournal,
    WriteBack,
    write_entry,
)

log = logging.getLogger("specgov.daemon")

MAX_STORE_INCIDENTS = 10  # kept in the status document
MEMORY_DECISIONS = 1000  # the audit tail kept when there is no store at all

# A snapshot-like write (policy state, table, setting): one call on the store.
SnapshotWrite = Callable[[StateStore], object]


class StoreGateway:
    """The store (None: none at all), its journal and the outage bookkeeping."""

    def __init__(
        self,
        store: StateStore | None,
        journal: StoreJournal,
        *,
        metrics: DaemonMetrics,
        clock: Callable[[], float],
        status_info: DaemonStatus,
        failing: FailureClock,
        throttle: LogThrottle,
        policy_name: Callable[[], str],
        holdings: Callable[[], Iterator[SnapshotWrite]],
        on_written_back: Callable[[], None],
    ) -> None:
        self.store = store
        self.journal = journal
        self.journal.on_rejected = self.rejected
        self.incidents: deque[dict[str, Any]] = deque(maxlen=MAX_STORE_INCIDENTS)
        self._metrics = metrics
        self._clock = clock
        self._status = status_info
        self._failing = failing
        self._throttle = throttle
        self._policy_name = policy_name
        self._holdings = holdings
        self._on_written_back = on_written_back
        self._memory_decisions: list[dict[str, Any]] = []  # when there is no store at all
        # /v1/decisions answers, valid until the next audit row.
        self._decisions_cache: dict[tuple[float | None, int], list[dict[str, Any]]] = {}

    def start(self) -> None:
        """Open the store for this start. A corrupt file raises StoreRefused, a newer or
        foreign one StoreSchemaError (both ValueErrors: the daemon does not start); a
        missing one is created (the store logs a WARNING: empty state)."""
        if self.store is None:
            return
        report = self.store.start()
        if report.error is None:
            return
        self.failed(report.error)
        if report.read_only:
            note = (
                f"state database {self.store.path} is read-only: restored what it holds; "
                "writes are kept in memory until it is writable"
            )
        else:
            note = (
                f"state database {self.store.path} unusable at start ({report.error.cause}): "
                "the daemon starts with empty state; writes are kept in memory until it "
                "is usable"
            )
        self._status.notes.append(note)
        log.warning("%s", note)

    def failed(self, exc: StoreUnavailable) -> None:
        """Report a store failure at once: status, metric, journal; one log line per
        burst (the first failure after the store worked), plus one per incident."""
        kind = store_failure_kind(exc)
        self._metrics.on_store_failure(kind)
        message = f"state store unavailable, controlling from memory: {exc}"
        if isinstance(exc, StoreReplaced):
            incident = {"time_s": self._clock(), "kind": kind, "message": str(exc)}
            self.incidents.append(incident)
            message = f"state store: {exc.detail}; pending writes go back at the next write"
            line = f"state database {exc.path}: {exc.detail}"
            log.error("%s", escape_upstream(line, MAX_LOGGED_CHARS))
        elif self._status.store_error is None:
            log.error(
                "%s; audit rows and override changes are kept in memory (at most %d) and "
                "written back when it returns",
                escape_upstream(message, MAX_LOGGED_CHARS),
                self.journal.max_entries,
            )
        self._status.store_error = message
        self._failing.update("store", message)
        self.journal.note_down(self._clock(), str(exc))

    def rejected(self, kind: str, exc: Exception) -> None:
        """A queued write the store refused at write-back (not an outage): dropped so the
        rest can go on; counted (metric, status) and logged once per burst."""
        self._metrics.on_store_failure("rejected")
        self._throttle.error(
            "store-rejected",
            f"state store refused a queued {kind} write at write-back "
            f"({type(exc).__name__}: {exc}); dropped it and wrote back the rest",
        )

    def write(self, entry: PendingWrite) -> bool:
        """Persist a decision row or override change, or queue it while the store is
        down (earlier queued writes go first, so the store sees them in order)."""
        store = self.store
        if store is None:
            return False
        if not self.journal.pending or self.write_back():
            try:
                write_entry(store, entry)
            except StoreUnavailable as exc:
                self.failed(exc)
            else:
                return True
        before = self.journal.dropped
        self.journal.add(entry)
        for k, n in self.journal.dropped.items():
            self._metrics.on_journal_dropped(k, n - before.get(k, 0))
        self._metrics.set_journal(len(self.journal))
        return False

    def snapshot(self, key: str, write: SnapshotWrite) -> None:
        """Persist a snapshot-like value (policy state, table, setting); while the store
        is down only the latest per key is kept."""
        store = self.store
        if store is None:
            return
        if not self.journal.pending or self.write_back():
            try:
                write(store)
            except StoreUnavailable as exc:
                self.failed(exc)
            else:
                return
        self.journal.keep_latest(key, write)

    def write_back(self) -> bool:
        """Write the journal back, then what the daemon holds (its overrides, so a file
        recreated empty has them), then the gap as an audit row. True when done."""
        store = self.store
        assert store is not None
        try:
            result = self.journal.write_back(store, extra=self._holdings(), gap_row=self._gap_row)
        except StoreUnavailable as exc:
            self.failed(exc)
            self._metrics.set_journal(len(self.journal))
            return False
        self._metrics.set_journal(0)
        # A file recreated or swapped in may hold none of the learned state: saved at
        # this decision, not at the next checkpoint.
        self._on_written_back()
        self._decisions_cache.clear()
        self._status.store_error = None
        self._failing.update("store", None)
        dropped = sum(result.dropped.values())
        log.warning(
            "%s",
            escape_upstream(
                f"state store usable again after {self._clock() - result.down_since_s:.0f} s: "
                f"{result.written} queued writes written back, {dropped} dropped",
                MAX_LOGGED_CHARS,
            ),
        )
        return True

    def _gap_row(self, result: WriteBack) -> dict[str, Any] | None:
        """The audit row recording an outage of the store (None: nothing to record)."""
        incidents = [i for i in self.incidents if i["time_s"] >= result.down_since_s]
        dropped = sum(result.dropped.values())
        if not (result.written or dropped or incidents or result.rejected):
            return None
        now = self._clock()
        message = (
            f"state store unavailable for {now - result.down_since_s:.1f} s "
            f"({result.cause}); {result.written} audit rows and override changes kept in "
            "memory and written back"
        )
        if dropped:
            kinds = ", ".join(f"{n} {k}" for k, n in sorted(result.dropped.items()))
            message += (
                f"; {dropped} dropped ({kinds}): the journal holds at most "
                f"{self.journal.max_entries}"
            )
        if result.rejected:
            kinds = ", ".join(f"{n} {k}" for k, n in sorted(result.rejected.items()))
            message += f"; {sum(result.rejected.values())} refused by the store ({kinds})"
        return {
            "time_s": now,
            "policy": self._policy_name(),
            "reason": "store_gap",
            "message": message,
            "inputs_summary": {
                "store_down_from_s": result.down_since_s,
                "store_back_at_s": now,
                "written_back": result.written,
                "dropped": dict(result.dropped),
                "rejected": dict(result.rejected),
                "journal_max_entries": self.journal.max_entries,
                "cause": result.cause,
                "incidents": [i["message"] for i in incidents],
            },
        }

    def persist(self, record: dict[str, Any]) -> None:
        """An audit row: to the store (or its journal), or the memory tail without one;
        a published table is saved beside it."""
        self._decisions_cache.clear()
        if self.store is None:
            self._memory_decisions.append(record)
            del self._memory_decisions[:-MEMORY_DECISIONS]
            return
        self.write(PendingWrite("decision", float(record["time_s"]), record))
        after = record["table_after"]
        if record["published"] and after is not None:
            self.snapshot("table", lambda s: s.save_table(after))

    def decisions(self, since_s: float | None, limit: int) -> list[dict[str, Any]]:
        """Newest first; the rows still in the journal come before the stored ones.
        Answers are cached until the next audit row (the API may ask 100 times a second)."""
        key = (since_s, limit)
        cached = self._decisions_cache.get(key)
        if cached is not None:
            return cached
        if self.store is None:
            rows = [r for r in self._memory_decisions if since_s is None or r["time_s"] >= since_s]
            return rows[-limit:][::-1]
        queued = [
            dict(r)
            for r in reversed(self.journal.decisions())
            if since_s is None or r["time_s"] >= since_s
        ][:limit]
        stored: list[dict[str, Any]] = []
        if len(queued) < limit:
            try:
                records = self.store.decisions(since_s=since_s, limit=limit - len(queued))
                stored = [r.to_dict() for r in records]
            except StoreUnavailable as exc:
                self.failed(exc)
                return queued  # not cached: the store may answer next time
        out = queued + stored
        if len(self._decisions_cache) > 64:
            self._decisions_cache.clear()
        self._decisions_cache[key] = out
        return out


def store_failure_kind(exc: StoreUnavailable) -> str:
    if isinstance(exc, StoreReplaced):
        return "deleted" if exc.deleted else "replaced"
    if isinstance(exc, StoreCorrupt):
        return "corrupt"
    return "unavailable"


def put_override(data: Mapping[str, Any]) -> SnapshotWrite:
    """The write that puts one override (as the store's dict) back."""
    return functools.partial(_put_override, data)


def _put_override(data: Mapping[str, Any], store: StateStore) -> object:
    return store.put_override(data)
