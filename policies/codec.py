"""One way to turn specgov's records into JSON-ready data and back: msgspec.

Every persisted or exchanged record (policy and guard state, overrides, restart
recommendations, tier statistics ...) is a frozen dataclass; its field types, with the
constraint aliases below, are its schema. :func:`to_data` encodes one (fields by name,
enums by value, tuples and sets as lists, int keys as strings); :func:`from_data`
validates and builds one, field by field, with an error that names the path
(``GuardedState: Expected `int` >= 1 - at `$.slots[0].slot```) in the caller's error type.
A dataclass's ``__post_init__`` still runs, so invariants across fields stay where they are.

Conventions:

* Fields whose names start with ``_`` are derived caches (``init=False``, with a
  default); they are never written, and rebuilt by ``__post_init__`` on load.
* Unknown keys are ignored: a state written by a newer release loads in an older one
  (downgrade after a rollout) and a field removed later does not strand old rows. A
  missing required key, a wrong type or a value outside its constraint is an error.
* Numbers are finite: :data:`Real` refuses NaN and +-inf (their magnitude bound is
  1e300), as :func:`specgov.policies.validation.is_real` does for hand-parsed input.

Pure: msgspec is a serialisation library (no IO); policies may import it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Annotated, Any, Final, TypeAlias, TypeVar

import msgspec

__all__ = [
    "NonNegInt",
    "NonNegReal",
    "OptReal",
    "PosInt",
    "PosReal",
    "Real",
    "from_data",
    "to_data",
]

_BOUND: Final = 1e300

# Constraint aliases: the schema of a field is its annotation.
Real: TypeAlias = Annotated[float, msgspec.Meta(ge=-_BOUND, le=_BOUND)]
OptReal: TypeAlias = Real | None
NonNegReal: TypeAlias = Annotated[float, msgspec.Meta(ge=0.0, le=_BOUND)]
PosReal: TypeAlias = Annotated[float, msgspec.Meta(gt=0.0, le=_BOUND)]
NonNegInt: TypeAlias = Annotated[int, msgspec.Meta(ge=0)]
PosInt: TypeAlias = Annotated[int, msgspec.Meta(ge=1)]

R = TypeVar("R")


def to_data(record: object) -> Any:
    """``record`` as JSON-ready builtins (dicts, lists, str, numbers, None)."""
    return _drop_derived(msgspec.to_builtins(record, str_keys=True))


def from_data(
    kind: type[R] | Any,
    data: object,
    *,
    where: str,
    error: Callable[[str], Exception],
) -> R:
    """Validate ``data`` as ``kind`` (a dataclass, or a typing form such as
    ``tuple[X, ...]``); on failure raise ``error(f"{where}: {what} - at {path}")``."""
    try:
        return msgspec.convert(data, kind, str_keys=True)
    except msgspec.ValidationError as exc:
        raise error(f"{where}: {exc}") from None


def _drop_derived(data: Any) -> Any:
    if isinstance(data, Mapping):
        return {k: _drop_derived(v) for k, v in data.items() if not str(k).startswith("_")}
    if isinstance(data, list | tuple):
        return [_drop_derived(v) for v in data]
    return data
