"""policies/identity_cache.py: values by their source objects' identity."""

from __future__ import annotations

import pytest

from specgov.policies.identity_cache import IdentityCache


def test_a_hit_needs_the_same_objects_and_the_same_extra() -> None:
    cache: IdentityCache[str] = IdentityCache(4)
    a, b = [1], [1]  # equal, not the same object
    assert cache.put((a,), "from a", 0.5) == "from a"
    assert cache.get((a,), 0.5) == "from a"
    assert cache.get((b,), 0.5) is None  # equality is not identity
    assert cache.get((a,), 0.25) is None  # another parameter
    assert cache.get((a, b)) is None


def test_an_entry_keeps_its_objects_alive_so_an_id_is_never_reused_under_it() -> None:
    cache: IdentityCache[int] = IdentityCache(4)
    cache.put(([7],), 1)  # the list's only reference is the cache's
    (objects, value) = cache.newest() or ((), 0)
    assert objects == ([7],) and value == 1


def test_a_full_cache_is_emptied_and_newest_is_the_last_put() -> None:
    cache: IdentityCache[int] = IdentityCache(2)
    xs = [object() for _ in range(3)]
    cache.put((xs[0],), 0)
    cache.put((xs[1],), 1)
    assert len(cache) == 2
    cache.put((xs[2],), 2)
    assert len(cache) == 1 and cache.get((xs[0],)) is None and cache.get((xs[2],)) == 2
    newest = cache.newest()
    assert newest is not None and newest[0][0] is xs[2] and newest[1] == 2
    cache.clear()
    assert cache.newest() is None and len(cache) == 0


def test_size_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_entries must be >= 1"):
        IdentityCache(0)
