"""Validation helpers shared by the estimators' state (de)serialisation."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from specgov.policies.common.types import PolicyTypeError

# The value predicates are the project's one set; re-exported for the estimators' imports.
from specgov.policies.common.validation import is_int, is_real

__all__ = ["check_keys", "is_int", "is_real"]


def check_keys(owner: str, data: object, keys: Iterable[str]) -> Mapping[str, Any]:
    """``data`` as a mapping with exactly ``keys``; otherwise an error naming the difference."""
    if not isinstance(data, Mapping):
        raise PolicyTypeError(f"{owner}.from_dict: expected a JSON object (mapping), got {data!r}")
    expected = set(keys)
    missing = sorted(expected - set(data))
    unknown = sorted(str(k) for k in set(data) - expected)
    if missing or unknown:
        raise PolicyTypeError(
            f"{owner}.from_dict: missing key(s) {missing}, unknown key(s) {unknown}; "
            f"expected keys {sorted(expected)}"
        )
    return data
