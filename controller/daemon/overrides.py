"""The operator's overrides: held by id, re-read from the store (the truth) at every
decision, carried on alone only while the store is unavailable; every set, superseded
or cleared override is an audit row of its own.

The daemon (controller/daemon/runtime.py) validates an override against the engine's
slots and the policies it knows before it is added here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from specgov.controller.daemon.store_errors import StoreUnavailable
from specgov.controller.daemon.store_gateway import StoreGateway
from specgov.controller.daemon.store_journal import PendingWrite
from specgov.policies.guardrails import Override, with_override, without_overrides

log = logging.getLogger("specgov.daemon")

# Records an operator's action as an audit row: (reason, message, inputs summary).
Audit = Callable[[str, str, Mapping[str, Any]], None]


class OperatorOverrides:
    """The overrides by id, as the daemon holds them."""

    def __init__(self, gateway: StoreGateway, *, clock: Callable[[], float], audit: Audit) -> None:
        self._gateway = gateway
        self._clock = clock
        self._audit = audit
        # A cache of the store (the truth), re-read at every decision.
        self.by_id: dict[str, Override] = {}
        self._seq = 0

    def refresh(self) -> tuple[Override, ...]:
        """Re-read the overrides from the store (keep the cached ones while it is down);
        returns those that expired since the last read, for the decision to say so."""
        now = self._clock()
        expired = tuple(o for o in self.by_id.values() if not o.is_active(now))
        # Writes waiting in the journal go first: the store's view lacks them.
        if self._gateway.store is not None and (
            not self._gateway.journal.pending or self._gateway.write_back()
        ):
            try:
                records = self._gateway.store.list_overrides(now)
            except StoreUnavailable as exc:
                self._gateway.failed(exc)
            else:
                self.by_id = {r.id: r.override for r in records}
        self.by_id = {k: o for k, o in self.by_id.items() if o.is_active(now)}
        return expired

    def add(self, override: Override) -> dict[str, Any]:
        """Record an override the daemon validated and built (created now); audit it and
        what it supersedes."""
        now = override.created_at_s
        # The daemon names the override, so it has an id even while the store is down.
        self._seq += 1
        override_id = f"ov-{int(now * 1000)}-{self._seq}"
        data = {"id": override_id, **override.to_dict()}
        kept = with_override(tuple(self.by_id.values()), override)
        superseded = {k: v for k, v in self.by_id.items() if v not in kept}
        self.by_id = {k: v for k, v in self.by_id.items() if v in kept}
        self.by_id[override_id] = override
        self._gateway.write(PendingWrite("override", now, data))
        log.info("override set: %s", override.describe())
        self._audit(
            "override_set",
            f"override {override_id} set: {override.describe()}",
            {"override": data, "supersedes": sorted(superseded)},
        )
        for oid, old in superseded.items():
            self._audit(
                "override_superseded",
                f"override {oid} ({old.describe()}) superseded by {override_id}",
                {"override_id": oid, "superseded_by": override_id},
            )
        return data

    def clear(self, override_id: str | None, slot: int | None) -> int:
        now = self._clock()
        before = {k: o for k, o in self.by_id.items() if o.is_active(now)}
        if override_id is not None:
            self.by_id.pop(override_id, None)
        else:
            kept = without_overrides(tuple(self.by_id.values()), slot=slot)
            self.by_id = {k: v for k, v in self.by_id.items() if v in kept}
        gone = sorted(set(before) - set(self.by_id))
        cleared = len(gone)
        for oid in gone:
            self._audit(
                "override_cleared",
                f"override {oid} ({before[oid].describe()}) cleared by the operator",
                {"override_id": oid},
            )
        if self._gateway.store is None:
            return cleared
        selector: dict[str, Any]
        if override_id is not None:
            selector = {"override_id": override_id}
        elif slot is not None:
            selector = {"slot": slot}
        else:
            selector = {"all": True}
        if override_id is not None and not cleared and not self._gateway.journal.pending:
            # Not known here (set by another daemon on this file?): the store decides.
            try:
                cleared = self._gateway.store.clear_override(override_id=override_id, now_s=now)
            except StoreUnavailable as exc:
                self._gateway.failed(exc)
            else:
                if cleared:
                    self._audit(
                        "override_cleared",
                        f"override {override_id} cleared by the operator (found in the store)",
                        {"override_id": override_id},
                    )
                return cleared
        self._gateway.write(PendingWrite("clear", now, selector))
        return cleared
