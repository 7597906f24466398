"""The value predicates the estimators' state (de)serialisation uses."""

from __future__ import annotations

# The value predicates are the project's one set; re-exported for the estimators' imports.
from specgov.policies.common.validation import is_int, is_real

__all__ = ["is_int", "is_real"]
