"""One set of value checks for every specgov parser (config, spool, state, traces, catalogs).

Pure: no IO, nothing from other specgov packages, so every layer may import it.

The names say the semantics:

* :func:`is_int` -- an ``int`` that is not a ``bool`` (a JSON ``true`` is never a count).
* :func:`is_real` -- an ``int`` or ``float``, not a ``bool``, and FINITE: NaN, +-inf and
  ints too large to become a finite float are refused. Every number specgov reads from a
  config, a spool or a saved state must be finite; there is deliberately no "any float"
  predicate, because no caller needs one (NaN compares false with every bound, so a check
  written as ``not value < minimum`` would wave it through).

The ``check_*`` functions raise ``error(f"{where}: expected {form}, got {value!r}")``, with
the caller's error type, so each module keeps its own typed error (``PolicyTypeError``,
``GuardrailError``, ``ConfigError`` ...) and the message names the offending key.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeGuard, cast

__all__ = [
    "ErrorFactory",
    "all_real",
    "check_bool",
    "check_fields",
    "check_int",
    "check_keys",
    "check_opt_int",
    "check_opt_real",
    "check_real",
    "check_type",
    "int_form",
    "is_int",
    "is_real",
    "real_form",
]

# The error to raise, called with the whole message: a ValueError subclass, or a
# function that builds one (an error that takes more arguments than the message).
ErrorFactory = Callable[[str], Exception]


# The exact-type tests first: the estimators check every value of the states they build
# (a few per decision), nearly all plain ints and floats.


def is_int(value: object) -> TypeGuard[int]:
    """An ``int`` that is not a ``bool`` (bool is an int subclass)."""
    return type(value) is int or (isinstance(value, int) and not isinstance(value, bool))


def is_real(value: object) -> TypeGuard[int | float]:
    """A FINITE real: an ``int`` or ``float``, not a ``bool``, not NaN or +-inf.

    An int too large for a float counts as not finite (``float(v)`` would overflow), so
    ``float(value)`` is always finite when this is true.
    """
    if type(value) is float:
        return math.isfinite(value)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int beyond float range
        return False


def is_step_list(steps: Sequence[object]) -> bool:
    """Candidate steps as SGLang accepts them: one or more non-negative ints."""
    return bool(steps) and all(is_int(s) and s >= 0 for s in steps)


def all_real(values: Sequence[object], *, minimum: float | None = None) -> bool:
    """Every value :func:`is_real` (and ``>= minimum`` when given).

    All plain floats (what the estimators build): a NaN or an inf makes the sum NaN or
    inf, so one sum and one min decide; a sum that overflows, or any other value, gets
    the per-value check.
    """
    if values and all(type(v) is float for v in values):
        floats = cast(Sequence[float], values)
        if math.isfinite(sum(floats)) and (minimum is None or min(floats) >= minimum):
            return True
    return all(is_real(v) and (minimum is None or v >= minimum) for v in values)


def int_form(*, minimum: int | None = None, maximum: int | None = None) -> str:
    """How :func:`check_int` names what it expected: ``"an int >= 1"``."""
    if minimum is not None and maximum is not None:
        return f"an int in [{minimum}, {maximum}]"
    if minimum is not None:
        return f"an int >= {minimum}"
    if maximum is not None:
        return f"an int <= {maximum}"
    return "an int"


def real_form(
    *, minimum: float | None = None, maximum: float | None = None, positive: bool = False
) -> str:
    """How :func:`check_real` names what it expected: ``"a finite number > 0"``."""
    if positive:
        return "a finite number > 0" if maximum is None else f"a finite number in (0, {maximum:g}]"
    if minimum is not None and maximum is not None:
        return f"a finite number in [{minimum:g}, {maximum:g}]"
    if minimum is not None:
        return f"a finite number >= {minimum:g}"
    if maximum is not None:
        return f"a finite number <= {maximum:g}"
    return "a finite number"


def check_int(
    where: str,
    value: object,
    *,
    error: ErrorFactory,
    minimum: int | None = None,
    maximum: int | None = None,
    form: str | None = None,
) -> int:
    """``value`` if it is an int (not a bool) within the bounds, else raise ``error``.

    ``form`` replaces the generated description (``"an int >= 1"``) in the message.
    """
    ok = is_int(value)
    if ok and minimum is not None:
        ok = value >= minimum  # type: ignore[operator]
    if ok and maximum is not None:
        ok = value <= maximum  # type: ignore[operator]
    if not ok:
        what = form if form is not None else int_form(minimum=minimum, maximum=maximum)
        raise error(f"{where}: expected {what}, got {value!r}")
    assert isinstance(value, int)
    return value


def check_real(
    where: str,
    value: object,
    *,
    error: ErrorFactory,
    minimum: float | None = None,
    maximum: float | None = None,
    positive: bool = False,
    form: str | None = None,
) -> float:
    """``float(value)`` if ``value`` is a finite real (:func:`is_real`) within the bounds.

    ``positive`` requires ``value > 0``; ``minimum``/``maximum`` are inclusive. Raises
    ``error`` otherwise; ``form`` replaces the generated description in the message.
    """
    ok = is_real(value)
    if ok and minimum is not None:
        ok = value >= minimum  # type: ignore[operator]
    if ok and maximum is not None:
        ok = value <= maximum  # type: ignore[operator]
    if ok and positive:
        ok = value > 0  # type: ignore[operator]
    if not ok:
        what = (
            form
            if form is not None
            else real_form(minimum=minimum, maximum=maximum, positive=positive)
        )
        raise error(f"{where}: expected {what}, got {value!r}")
    return float(value)  # type: ignore[arg-type]


def check_opt_int(where: str, value: object, **checks: Any) -> int | None:
    """None stays None; anything else must pass :func:`check_int` with ``checks``
    (``error=`` and the bounds)."""
    return None if value is None else check_int(where, value, **checks)


def check_opt_real(where: str, value: object, **checks: Any) -> float | None:
    """None stays None; anything else must pass :func:`check_real` with ``checks``
    (``error=`` and the bounds)."""
    return None if value is None else check_real(where, value, **checks)


def check_bool(where: str, value: object, *, error: ErrorFactory, form: str = "a bool") -> bool:
    """``value`` if it is a real ``bool`` (not 0/1, not ``"true"``), else raise ``error``.

    ``form`` names what was expected (``"true or false"`` where the input is JSON or YAML).
    """
    if not isinstance(value, bool):
        raise error(f"{where}: expected {form}, got {value!r}")
    return value


def check_type(
    where: str, value: object, cls: type | tuple[type, ...], *, error: ErrorFactory, form: str
) -> None:
    """Raise ``error`` unless ``value`` is an instance of ``cls`` (``form`` names it)."""
    if not isinstance(value, cls):
        raise error(f"{where}: expected {form}, got {value!r}")


def check_fields(
    owner: str,
    record: object,
    names: Iterable[str],
    check: Callable[..., object],
    *,
    error: ErrorFactory,
    **bounds: Any,
) -> None:
    """Run ``check`` (:func:`check_int`, :func:`check_opt_real` ...) with ``bounds`` on
    each named attribute of ``record``, in order, as ``f"{owner}.{name}"``: the one
    table-driven form of a record's per-field checks."""
    for name in names:
        check(f"{owner}.{name}", getattr(record, name), error=error, **bounds)


def check_keys(
    where: str,
    data: object,
    required: Sequence[str],
    *,
    error: ErrorFactory,
    optional: Iterable[str] = (),
    ignored: Iterable[str] = (),
    form: str = "a mapping",
) -> Mapping[str, Any]:
    """``data`` as a mapping holding every ``required`` key and nothing beyond them and
    ``optional`` (``ignored``: keys older forms carry, allowed and not read); otherwise
    raise ``error`` naming the missing and unknown keys (``form`` names the mapping)."""
    if not isinstance(data, Mapping):
        raise error(f"{where}: expected {form}, got {data!r}")
    allowed = set(required).union(optional)
    skip = allowed.union(ignored)
    missing = [k for k in required if k not in data]
    unknown = sorted(str(k) for k in data if k not in skip)
    if missing or unknown:
        raise error(
            f"{where}: missing key(s) {missing}, unknown key(s) {unknown}; "
            f"expected keys {sorted(allowed)}"
        )
    return data
