"""What `specgov status` shows: the daemon's status record and the documents built from it.

The parts that cost to build (the table, the observation summary, each override) are
built once per object they come from, not once per status request (issue 9 §5): the
documents are plain data, never mutated, so the same object can be served again.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from specgov.policies.common.observation import Observation
from specgov.policies.common.step_table import StepTable
from specgov.policies.control.core import inputs_summary
from specgov.policies.guardrails import Override, active_overrides, slot_winners


@dataclass
class DaemonStatus:
    """What `specgov status` shows (JSON-friendly via ``Daemon.status``)."""

    started_at_s: float
    last_scrape_s: float | None = None
    last_scrape_error: str | None = None
    scrape_errors: int = 0
    permanent_error: str | None = None
    last_decision: dict[str, Any] | None = None
    store_error: str | None = None
    decisions: int = 0
    tables_published: int = 0
    spool_error: str | None = None
    spool_read_error: str | None = None
    recommendation: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)


class StatusDocuments:
    """The status parts that cost to build, keyed by the object they were built from."""

    def __init__(self) -> None:
        self._table_doc: tuple[StepTable, dict[str, Any]] | None = None
        self._observation_doc: tuple[Observation, dict[str, Any]] | None = None
        self._override_docs: dict[str, tuple[Override, dict[str, Any]]] = {}

    def table(self, table: StepTable | None) -> dict[str, Any] | None:
        if table is None:
            return None
        if self._table_doc is None or self._table_doc[0] is not table:
            self._table_doc = (table, table.to_dict())
        return self._table_doc[1]

    def observation(self, obs: Observation | None) -> dict[str, Any] | None:
        if obs is None:
            return None
        if self._observation_doc is None or self._observation_doc[0] is not obs:
            self._observation_doc = (obs, inputs_summary(obs))
        return self._observation_doc[1]

    def override(self, oid: str, override: Override, held: int) -> dict[str, Any]:
        """``held``: how many overrides the daemon holds (bounds the cache)."""
        # Built once per override object (the load profile, issue 9 §5: Override.to_dict
        # cost a third of the API's own time), not once per status/overrides request.
        cached = self._override_docs.get(oid)
        if cached is None or cached[0] is not override:
            if len(self._override_docs) > 2 * held + 16:
                self._override_docs.clear()
            cached = (override, {"id": oid, **override.to_dict()})
            self._override_docs[oid] = cached
        return cached[1]

    def overrides(self, overrides: Mapping[str, Override], now_s: float) -> list[dict[str, Any]]:
        """The active overrides, oldest first."""
        out = []
        for oid, o in sorted(overrides.items(), key=lambda kv: kv[1].created_at_s):
            if o.is_active(now_s):
                out.append(self.override(oid, o, len(overrides)))
        return out


def slot_layout(obs: Observation | None, last_candidates: Any) -> list[list[Any]] | None:
    """The engine's slots and their candidate steps, as the daemon knows them (from the
    observation, else the guard's last candidates)."""
    layout = (obs.slot_candidates if obs is not None else None) or last_candidates
    if not layout:
        return None
    return [[bound, list(steps)] for bound, steps in layout]


def override_slots(
    layout: list[list[Any]] | None, overrides: Mapping[str, Override], now_s: float
) -> dict[str, list[int]] | None:
    """Override id -> the engine slots it sets now (a slot's own override wins over
    an every-slot one, the guardrails' rule); None while the slots are unknown."""
    if layout is None:
        return None
    ids = {id(o): oid for oid, o in overrides.items()}
    active = active_overrides(tuple(overrides.values()), now_s)
    out: dict[str, list[int]] = {}
    for bound, o in slot_winners(active, [b for b, _ in layout]).items():
        out.setdefault(ids[id(o)], []).append(bound)
    return out
