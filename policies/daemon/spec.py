"""Policy specs: the one string syntax the CLI and the config file share.

Grammar (whitespace around items is ignored)::

    spec   := kind | kind ":" item ("," item)*
    item   := key "=" value
    static:K[,key=value...]        the bare first item is the step count
    batch-table:N=K,N=K,...
                                   batch size N (ascending, the first 1) -> steps K

Kinds and their keys:

* ``none`` — no speculation (no keys); * ``static:K`` — K steps everywhere (``steps`` = the bare
K); * ``sglang-ema`` — SGLang's built-in controller, in-engine only: no daemon policy, no keys;
* ``batch-table:1=5,8=3,32=1,64=0`` — a fixed schedule (no other keys); * ``goodput[:...]`` —
the model-based policy; keys are the fields of
:class:`~specgov.policies.daemon.goodput.GoodputConfig` (e.g. ``slo_tpot_ms=40,explore=0.05``);
* ``bandit[:...]`` — keys are the fields of
:class:`~specgov.policies.daemon.bandit.BanditConfig` (e.g.
``algo=thompson,seed=1,window_s=60``).

No kind takes a TTL: a policy returns a plan, and the guardrails stamp every published
table with theirs (``table_ttl_s``, config ``guardrails.table_ttl_s``), the one TTL knob.

Values are typed by their key: ints (``3``), numbers (``40``, ``0.05``, ``1e-3``; finite),
booleans (``true``/``false``), words (``thompson``), and ``none`` for optional keys.

:func:`parse_policy_spec` validates everything the policy would (unknown kind or key, bad
value, duplicate key, malformed schedule) and raises :class:`PolicySpecError` naming the
bad part; :func:`format_policy_spec` writes the canonical form (keys sorted, schedule
ascending), and ``parse_policy_spec(format_policy_spec(spec)) == spec``.
"""

from __future__ import annotations

import dataclasses
import math
import re
import reprlib
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

from specgov.policies.common.errors import SpecgovError
from specgov.policies.common.validation import is_int, is_real
from specgov.policies.daemon.bandit import BanditConfig, BanditPolicy
from specgov.policies.daemon.protocol import DaemonPolicy
from specgov.policies.daemon.schedules import (
    BatchTablePolicy,
    NonePolicy,
    StaticPolicy,
)

if TYPE_CHECKING:
    from specgov.policies.daemon.estimators.step_cost import StepCostPrior

KNOWN_KINDS: Final = ("none", "static", "sglang-ema", "batch-table", "goodput", "bandit")

ParamValue = str | int | float | bool | None

_SCHEDULE_FORM: Final = "expected N=K pairs with N >= 1 ascending, first N = 1"
_INT_RE: Final = re.compile(r"[+-]?[0-9]+")
_FLOAT_RE: Final = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
_WORD_RE: Final = re.compile(r"[A-Za-z0-9_.+-]+")
_DIGITS_RE: Final = re.compile(r"[0-9]+")
# Error messages quote the spec; a pasted novel is cut.
_QUOTE_MAX: Final = 160
# The longest spec text accepted (a batch-table of hundreds of entries fits); the control
# API and the config pass user text here.
MAX_SPEC_CHARS: Final = 4096


class PolicySpecError(SpecgovError, ValueError):
    """A policy spec is malformed; the message names the bad part and the valid forms."""


# ------------------------------------------------------------------ key schemas


@dataclass(frozen=True, slots=True)
class _KeyType:
    """The scalar type of one key: ``base`` in (int, float, bool, str), maybe optional."""

    base: type
    optional: bool = False

    @property
    def form(self) -> str:
        text = {int: "an int", float: "a finite number", bool: "true or false"}.get(
            self.base, "a word of letters, digits, '_', '.', '+', '-'"
        )
        return text + (" or none" if self.optional else "")


_FIXED_SCHEMAS: Final[dict[str, dict[str, _KeyType]]] = {
    "none": {},
    "static": {"steps": _KeyType(int)},
    "sglang-ema": {},
    "batch-table": {},
}


def _config_schema(cls: type) -> dict[str, _KeyType]:
    """Spec keys of a config dataclass: its scalar fields, typed by their annotations."""
    hints = typing.get_type_hints(cls)
    out: dict[str, _KeyType] = {}
    for f in dataclasses.fields(cls):
        if not f.init or f.name.startswith("_"):
            continue
        hint = hints[f.name]
        optional = False
        if typing.get_origin(hint) in (typing.Union, types.UnionType):
            args = [a for a in typing.get_args(hint) if a is not type(None)]
            optional = len(args) < len(typing.get_args(hint))
            if len(args) != 1:
                continue
            hint = args[0]
        if hint in (int, float, bool, str):
            out[f.name] = _KeyType(hint, optional)
    return out


def _goodput_module() -> Any:
    """The goodput module, imported on first use (it pulls in the estimators)."""
    try:
        from specgov.policies.daemon import goodput
    except ImportError as exc:  # pragma: no cover - only while the module is missing
        raise PolicySpecError(f"goodput: the goodput policy is not available ({exc})") from exc
    return goodput


def policy_schema(kind: str) -> dict[str, _KeyType]:
    """The keys a policy spec of ``kind`` accepts, with their value types."""
    if kind == "bandit":
        return _config_schema(BanditConfig)
    if kind == "goodput":
        return _config_schema(_goodput_module().GoodputConfig)
    return _FIXED_SCHEMAS[kind]


# ------------------------------------------------------------------- values


def _quote(text: str) -> str:
    """``text`` for a message: cut at _QUOTE_MAX, unprintable characters (control, bidi,
    line separators) escaped the way repr() does, so a message is one printable line."""
    cut = text if len(text) <= _QUOTE_MAX else text[: _QUOTE_MAX - 3] + "..."
    if cut.isprintable():
        return cut
    return "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in cut)


_REPR: Final = reprlib.Repr()
_REPR.maxstring = 80
_REPR.maxother = 80
for _limit in ("maxlist", "maxtuple", "maxdict", "maxset", "maxfrozenset"):
    setattr(_REPR, _limit, 8)


def _show(value: object) -> str:
    """``repr(value)`` for a message, elided (a huge value is never rendered whole)."""
    return _quote(_REPR.repr(value))


def _convert(where: str, kind: str, key: str, value: object, spec: _KeyType) -> ParamValue:
    """One value, from its spec text or already typed, normalised to the key's type."""

    def bad() -> PolicySpecError:
        return PolicySpecError(
            f"{where}: parameter {_show(key)} of {kind}: expected {spec.form}, got {_show(value)}"
        )

    if value is None or (spec.optional and isinstance(value, str) and value == "none"):
        if spec.optional:
            return None
        raise bad()
    if isinstance(value, str):
        text = value
        try:
            if spec.base is bool:
                if text not in ("true", "false"):
                    raise bad()
                return text == "true"
            if spec.base is int:
                if not _INT_RE.fullmatch(text):
                    raise bad()
                return int(text)
            if spec.base is float:
                if not _FLOAT_RE.fullmatch(text):
                    raise bad()
                number = float(text)
                if not math.isfinite(number):
                    raise bad()
                return number
        except (ValueError, OverflowError) as exc:  # e.g. an int of 5000 digits
            raise bad() from exc
        if not _WORD_RE.fullmatch(text):
            raise bad()
        return text
    if spec.base is bool:
        if isinstance(value, bool):
            return value
        raise bad()
    if isinstance(value, bool):
        raise bad()
    if spec.base is int and isinstance(value, int):
        return value
    if spec.base is float and is_real(value):  # finite; an int beyond float range too
        return float(value)
    raise bad()


def _batch_size(key: str) -> int | None:
    """``key`` as a batch size (ASCII digits, canonical int), None when it is not one."""
    if not _DIGITS_RE.fullmatch(key) or len(key) > 9:
        return None
    return int(key)


def _format_value(value: ParamValue) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        text = repr(value)
        return text[:-2] if text.endswith(".0") else text
    return str(value)


# --------------------------------------------------------------------- spec


def _normalise(
    kind: object, params: Mapping[str, object], where: str
) -> tuple[str, dict[str, ParamValue]]:
    """Check ``kind`` and ``params`` the way the policy would; return them normalised."""
    if not isinstance(kind, str) or kind not in KNOWN_KINDS:
        raise PolicySpecError(
            f"{where}: unknown policy kind {_show(kind)}; valid kinds: {', '.join(KNOWN_KINDS)}"
        )
    if not isinstance(params, Mapping):
        raise PolicySpecError(f"{where}: parameters must be a mapping, got {_show(params)}")
    schema = policy_schema(kind)
    out: dict[str, ParamValue] = {}
    schedule: list[tuple[int, int]] = []
    for key, value in params.items():
        if not isinstance(key, str):
            raise PolicySpecError(f"{where}: parameter keys must be str, got {_show(key)}")
        if kind == "batch-table" and key not in schema:
            batch = _batch_size(key)
            if batch is None:
                raise PolicySpecError(
                    f"{where}: key {_show(key)} is not a batch size ({_SCHEDULE_FORM})"
                )
            if str(batch) in out:
                raise PolicySpecError(f"{where}: duplicate batch size {batch}")
            steps = value
            if isinstance(value, str) and _DIGITS_RE.fullmatch(value) and len(value) < 10:
                steps = int(value)
            if not is_int(steps) or steps < 0:
                raise PolicySpecError(
                    f"{where}: steps for batch size {batch} must be an int >= 0, "
                    f"got {_show(value)} ({_SCHEDULE_FORM})"
                )
            out[str(batch)] = steps
            schedule.append((batch, steps))
            continue
        if key not in schema:
            valid = ", ".join(schema) if schema else "(none: it takes no parameters)"
            raise PolicySpecError(
                f"{where}: unknown parameter {_show(key)} for {kind}; valid keys: {valid}"
            )
        out[key] = _convert(where, kind, key, value, schema[key])
    _check_semantics(kind, out, schedule, where)
    return kind, out


def _check_semantics(
    kind: str, params: dict[str, ParamValue], schedule: list[tuple[int, int]], where: str
) -> None:
    """What the typed values alone do not show: required keys, ranges, the schedule."""
    if kind == "static":
        steps = params.get("steps")
        if steps is None:
            raise PolicySpecError(f"{where}: static needs a step count, e.g. static:3")
        if not is_int(steps) or steps < 0:
            raise PolicySpecError(f"{where}: static steps must be an int >= 0, got {_show(steps)}")
    if kind == "batch-table":
        if not schedule:
            raise PolicySpecError(f"{where}: batch-table needs a schedule ({_SCHEDULE_FORM})")
        for i, (n, _) in enumerate(schedule):
            if i == 0 and n != 1:
                raise PolicySpecError(
                    f"{where}: the first batch size must be 1, got {n} ({_SCHEDULE_FORM})"
                )
            if i > 0 and n <= schedule[i - 1][0]:
                raise PolicySpecError(
                    f"{where}: batch size {n} after {schedule[i - 1][0]} is not ascending "
                    f"({_SCHEDULE_FORM})"
                )
    # The policy's own config runs its checks (ranges, choices); the fixed policies are
    # their own config and cheap to build.
    try:
        if kind == "goodput":
            _goodput_module().GoodputConfig(**params)
        elif kind == "bandit":
            BanditConfig(**params)  # type: ignore[arg-type]
        else:
            _build(kind, params, prior=None)
    except PolicySpecError:
        raise
    except (ValueError, TypeError, ArithmeticError) as exc:
        raise PolicySpecError(f"{where}: {exc}") from exc


@dataclass(frozen=True)
class PolicySpec:
    """A parsed policy spec: ``kind`` and typed ``params`` (read-only mapping).

    ``text`` is the text it was parsed from (the canonical form when built directly);
    it is not part of equality, so specs that differ only in spelling are equal.
    Constructing one validates it exactly as :func:`parse_policy_spec` does.
    """

    kind: str
    params: Mapping[str, ParamValue] = field(default_factory=dict)
    text: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        where = _quote(self.text) if self.text else f"policy {_show(self.kind)}"
        _, params = _normalise(self.kind, self.params, where)
        object.__setattr__(self, "params", types.MappingProxyType(params))
        if not self.text:
            object.__setattr__(self, "text", format_policy_spec(self))

    def __hash__(self) -> int:
        return hash((self.kind, tuple(sorted((k, repr(v)) for k, v in self.params.items()))))

    def __reduce__(self) -> tuple[type[PolicySpec], tuple[str, dict[str, ParamValue], str]]:
        # The read-only params view cannot be pickled; rebuild (and re-validate) instead,
        # so specs can travel to benchmark worker processes.
        return (PolicySpec, (self.kind, dict(self.params), self.text))


def _ordered_items(spec: PolicySpec) -> list[tuple[str, ParamValue]]:
    """Schedule entries ascending, then named keys sorted (``steps`` is written bare)."""
    digits = sorted((k for k in spec.params if k.isdigit()), key=int)
    named = sorted(k for k in spec.params if not k.isdigit() and k != "steps")
    return [(k, spec.params[k]) for k in digits + named]


def format_policy_spec(spec: PolicySpec) -> str:
    """The canonical text of ``spec``: parses back to an equal spec."""
    items = [f"{k}={_format_value(v)}" for k, v in _ordered_items(spec)]
    if spec.kind == "static":
        items.insert(0, _format_value(spec.params["steps"]))
    return spec.kind + (":" + ",".join(items) if items else "")


def parse_policy_spec(text: str) -> PolicySpec:
    """Parse ``text``; raise :class:`PolicySpecError` naming the bad part."""
    if not isinstance(text, str):
        raise PolicySpecError(f"a policy spec must be a str, got {_show(text)}")
    if len(text) > MAX_SPEC_CHARS:
        raise PolicySpecError(
            f"{_quote(text)}: the spec has {len(text)} characters; a policy spec holds at "
            f"most {MAX_SPEC_CHARS}"
        )
    stripped = text.strip()
    where = _quote(stripped)
    if not stripped:
        raise PolicySpecError(
            f"empty policy spec; expected one of {', '.join(KNOWN_KINDS)} (e.g. static:3)"
        )
    kind, sep, body = stripped.partition(":")
    kind = kind.strip()
    if kind not in KNOWN_KINDS:
        raise PolicySpecError(
            f"{where}: unknown policy kind {_show(kind)}; valid kinds: {', '.join(KNOWN_KINDS)}"
        )
    params: dict[str, str] = {}
    if sep:
        if not body.strip():
            raise PolicySpecError(f"{where}: nothing after ':' (expected key=value items)")
        for i, raw in enumerate(body.split(",")):
            item = raw.strip()
            if not item:
                raise PolicySpecError(f"{where}: empty item at position {i + 1} (stray ',')")
            key, eq, value = item.partition("=")
            key, value = key.strip(), value.strip()
            if not eq:
                if kind == "static" and i == 0:
                    key, value = "steps", item
                elif kind == "batch-table":
                    raise PolicySpecError(
                        f"{where}: item {_show(item)} is not N=K ({_SCHEDULE_FORM})"
                    )
                else:
                    raise PolicySpecError(f"{where}: item {_show(item)} is not key=value")
            if not key:
                raise PolicySpecError(f"{where}: item {_show(item)} has no key before '='")
            if key in params:
                raise PolicySpecError(f"{where}: duplicate key {_show(key)}")
            params[key] = value
    return PolicySpec(kind, params, stripped)


def static_steps(spec: PolicySpec | str) -> int | None:
    """K of a ``static:K`` spec; None for a spec of another kind, or text whose kind is
    not ``static`` (e.g. a replay-only name such as ``oracle``). A malformed ``static``
    spec raises :class:`PolicySpecError` with :func:`parse_policy_spec`'s message: this
    is the one place ``static:K`` is read."""
    if isinstance(spec, str):
        if spec.strip().partition(":")[0].strip() != "static":
            return None
        spec = parse_policy_spec(spec)
    if spec.kind != "static":
        return None
    steps = spec.params["steps"]
    assert isinstance(steps, int)  # _check_semantics ran on construction
    return steps


# ------------------------------------------------------------------- build


def _build(
    kind: str, params: Mapping[str, ParamValue], *, prior: StepCostPrior | None
) -> DaemonPolicy[Any] | None:
    if kind == "sglang-ema":
        return None
    if kind == "none":
        return NonePolicy()
    if kind == "static":
        steps = params["steps"]
        assert isinstance(steps, int)  # _check_semantics ran first
        return StaticPolicy(steps)
    if kind == "batch-table":
        schedule = [(int(k), v) for k, v in params.items() if k.isdigit()]
        return BatchTablePolicy(sorted(schedule))  # type: ignore[arg-type]
    if kind == "bandit":
        return BanditPolicy(BanditConfig(**params))  # type: ignore[arg-type]
    goodput = _goodput_module()
    policy: DaemonPolicy[Any] = goodput.GoodputPolicy(goodput.GoodputConfig(**params), prior=prior)
    return policy


def build_daemon_policy(
    spec: PolicySpec | str, *, prior: StepCostPrior | None = None
) -> DaemonPolicy[Any] | None:
    """The daemon policy ``spec`` names; None for ``sglang-ema`` (in-engine only).

    ``prior`` (the catalog's step-cost prior) is used by ``goodput`` and ignored by the
    others, so a caller can pass it whatever the spec.
    """
    if isinstance(spec, str):
        spec = parse_policy_spec(spec)
    if not isinstance(spec, PolicySpec):
        raise PolicySpecError(f"expected a PolicySpec or a spec string, got {_show(spec)}")
    try:
        return _build(spec.kind, spec.params, prior=prior)
    except PolicySpecError:
        raise
    except (ValueError, TypeError) as exc:
        raise PolicySpecError(f"{_quote(spec.text)}: {exc}") from exc
