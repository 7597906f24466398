"""Validation helpers shared by the estimators' state (de)serialisation."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from specgov.policies.types import PolicyTypeError


def is_real(value: object) -> bool:
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(float(value))
    )


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


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
