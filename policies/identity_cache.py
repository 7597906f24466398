"""Values computed from immutable objects, remembered by those objects' identity.

The estimators compute the same derived values (a state's residuals, a sample's
features, a prior without its drafter ...) many times per decision from objects that
never change. Such objects need not be hashable, and hashing a state would cost more
than the value saves, so the cache keys them by ``id``. An entry holds the objects
themselves: while it exists no other object can take their ids, so a hit is checked by
identity and an entry never goes stale. A full cache is emptied in one step (one atomic
dict operation: a daemon may decide off its event loop) rather than evicting by age.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Generic, TypeVar

V = TypeVar("V")


class IdentityCache(Generic[V]):
    """At most ``max_entries`` values, each keyed by a tuple of objects (by identity)
    and optionally an ``extra`` hashable compared by equality (a parameter)."""

    def __init__(self, max_entries: int) -> None:
        if max_entries < 1:
            raise ValueError(f"IdentityCache: max_entries must be >= 1, got {max_entries!r}")
        self._max_entries = max_entries
        self._entries: dict[tuple[tuple[int, ...], Hashable], tuple[tuple[object, ...], V]] = {}

    def get(self, objects: tuple[object, ...], extra: Hashable = None) -> V | None:
        hit = self._entries.get((tuple(map(id, objects)), extra))
        if hit is None or not all(a is b for a, b in zip(hit[0], objects, strict=True)):
            return None
        return hit[1]

    def put(self, objects: tuple[object, ...], value: V, extra: Hashable = None) -> V:
        if len(self._entries) >= self._max_entries:
            self._entries.clear()
        self._entries[(tuple(map(id, objects)), extra)] = (objects, value)
        return value

    def newest(self) -> tuple[tuple[object, ...], V] | None:
        """The objects and value put last (None when empty)."""
        if not self._entries:
            return None
        return next(reversed(self._entries.values()))

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)
