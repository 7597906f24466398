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
* Unknown keys are refused (a typo in a hand-edited state or an API body must not be
  dropped silently), and so are a missing required key, a wrong type and a value outside
  its constraint. A field with a default may be absent: a record written before the field
  existed still loads.
* A dataclass may name keys its other forms carry in ``CODEC_TOLERATED_KEYS`` (the
  step table's spool ``schema``): they are accepted and not read.
* Numbers are finite: :data:`Real` refuses NaN and +-inf (their magnitude bound is
  1e300), as :func:`specgov.policies.common.validation.is_real` does for hand-parsed input.

Three learned states keep a compact encoding of their own, on purpose: the step-cost
estimator's samples and the bandit's arms are rows of numbers (hundreds of them, saved
at every decision: rows keep the state small and the save cheap) and the goodput and
bandit RNG words are strings (128-bit integers). Their ``from_dict`` validates each row;
everything else goes through this module. The operator's guardrail config is parsed by
its own loader (``GuardrailConfig.from_dict``) because its errors name the config key
(``guardrails.min_gain``), not a data path.

Pure: msgspec is a serialisation library (no IO); policies may import it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable, Mapping
from typing import Annotated, Any, ClassVar, Final, Self, TypeAlias, TypeVar

import msgspec
import msgspec.inspect as mi

__all__ = [
    "NonNegInt",
    "NonNegReal",
    "OptReal",
    "PosInt",
    "PosReal",
    "Real",
    "Versioned",
    "from_data",
    "from_versioned",
    "to_data",
    "to_versioned",
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
        record = msgspec.convert(data, kind, str_keys=True)
    except msgspec.ValidationError as exc:
        raise error(f"{where}: {exc}") from None
    unknown = _unknown_keys(_type_info(kind), data, "$")
    if unknown is not None:
        raise error(f"{where}: {unknown}")
    return record


def _type_info(kind: object) -> mi.Type:
    # Introspecting a type costs ~0.4 ms (most of a small record's decode); the kinds
    # are a fixed set of classes and typing forms, so each is introspected once.
    try:
        return _cached_type_info(kind)
    except TypeError:  # an unhashable typing form: introspected every time
        return msgspec.inspect.type_info(kind)


@functools.lru_cache(maxsize=256)
def _cached_type_info(kind: Hashable) -> mi.Type:
    return msgspec.inspect.type_info(kind)


def _unknown_keys(info: mi.Type, data: object, path: str) -> str | None:
    """The first object in ``data`` with a key its dataclass does not have, described."""
    if isinstance(info, mi.Metadata):
        return _unknown_keys(info.type, data, path)
    if isinstance(info, mi.DataclassType) and isinstance(data, Mapping):
        names = {f.encode_name for f in info.fields}
        tolerated: frozenset[str] = getattr(info.cls, "CODEC_TOLERATED_KEYS", frozenset())
        extra = sorted(str(k) for k in data if k not in names and k not in tolerated)
        if extra:
            public = sorted(n for n in names if not n.startswith("_"))
            return f"unknown key(s) {extra} - at `{path}`; expected keys {public}"
        for f in info.fields:
            if f.encode_name in data:
                found = _unknown_keys(f.type, data[f.encode_name], f"{path}.{f.encode_name}")
                if found is not None:
                    return found
        return None
    if isinstance(info, mi.UnionType):
        for option in info.types:
            if isinstance(option, mi.DataclassType | mi.Metadata) and isinstance(data, Mapping):
                return _unknown_keys(option, data, path)
            if isinstance(option, mi.CollectionType | mi.TupleType) and isinstance(
                data, list | tuple
            ):
                return _unknown_keys(option, data, path)
        return None
    if isinstance(data, list | tuple):
        if isinstance(info, mi.TupleType):
            items = list(zip(info.item_types, data, strict=False))
        elif isinstance(info, mi.CollectionType):
            items = [(info.item_type, item) for item in data]
        else:
            return None
        for i, (item_info, item) in enumerate(items):
            found = _unknown_keys(item_info, item, f"{path}[{i}]")
            if found is not None:
                return found
        return None
    if isinstance(info, mi.DictType) and isinstance(data, Mapping):
        for key, value in data.items():
            found = _unknown_keys(info.value_type, value, f"{path}[{key!r}]")
            if found is not None:
                return found
    return None


def to_versioned(record: object, version: int, *, key: str = "version") -> dict[str, Any]:
    """:func:`to_data` of ``record`` with its format version under ``key``."""
    return {key: version, **to_data(record)}


def from_versioned(
    kind: type[R],
    data: object,
    version: int,
    *,
    where: str,
    error: Callable[[str], Exception],
    key: str = "version",
) -> R:
    """:func:`from_data` of a record written by :func:`to_versioned` at ``version``."""
    if not isinstance(data, Mapping):
        raise error(f"{where}: expected an object, got {type(data).__name__}")
    got = data.get(key)
    if type(got) is not int or got != version:
        raise error(f"{where}: key {key!r}: expected {version}, got {got!r}")
    return from_data(kind, {k: v for k, v in data.items() if k != key}, where=where, error=error)


class Versioned:
    """A record's ``to_dict``/``from_dict`` pair through :func:`to_versioned` and
    :func:`from_versioned`, written once: a frozen dataclass that derives from it names
    its format version (``CODEC_VERSION``), the key that carries it
    (``CODEC_VERSION_KEY``, ``"version"`` unless set) and its error type
    (``CODEC_ERROR``); ``from_dict`` errors name ``<Class>.from_dict``."""

    __slots__ = ()
    CODEC_VERSION: ClassVar[int]
    CODEC_VERSION_KEY: ClassVar[str] = "version"
    CODEC_ERROR: ClassVar[Callable[[str], Exception]]

    def to_dict(self) -> dict[str, Any]:
        return to_versioned(self, self.CODEC_VERSION, key=self.CODEC_VERSION_KEY)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Self:
        return from_versioned(
            cls,
            data,
            cls.CODEC_VERSION,
            key=cls.CODEC_VERSION_KEY,
            where=f"{cls.__name__}.from_dict",
            error=cls.CODEC_ERROR,
        )


def _drop_derived(data: Any) -> Any:
    # ``data`` comes from msgspec.to_builtins: only dicts, lists, tuples and scalars, so
    # exact type tests suffice (an ABC isinstance per node was most of the encoding).
    kind = type(data)
    if kind is dict:
        return {k: _drop_derived(v) for k, v in data.items() if not str(k).startswith("_")}
    if kind is list or kind is tuple:
        return [_drop_derived(v) for v in data]
    return data
