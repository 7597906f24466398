"""SGLang's ``--speculative-adaptive-config`` format, parsed and validated.

Semantics follow ``_load_adaptive_config`` of sglang 0.5.23
(``sglang/srt/speculative/adaptive_spec_params.py``):

* digit-string keys are batch-size slot lower bounds, each a JSON object with
  ``candidate_steps`` (non-empty list of non-negative ints; 0 disables drafting);
* non-digit keys are defaults merged into every slot (``{**cfg, **entry}``, the
  slot's own keys win);
* at least one digit key must exist.

The numeric knobs SGLang reads per slot (``ema_alpha``, ``update_interval``,
``warmup_batches``, ``down_hysteresis``, ``up_hysteresis``, ``ceiling_coeff``) take
SGLang's defaults. SGLang does not validate them (a bad value fails later, at run
time, inside the engine); here they are checked up front, so this parser is
stricter than SGLang in exactly these ways, all for values SGLang would crash on or
silently misread:

* a knob must be a real number of the right range (``update_interval`` an int >= 1,
  ``warmup_batches`` an int >= 0, ``ema_alpha`` in [0, 1], ``ceiling_coeff`` >= 0);
* a slot entry must be an object (SGLang raises AttributeError on anything else);
* ``true``/``false`` are not steps (Python's ``isinstance(True, int)`` lets SGLang
  accept them as 1/0).

No file IO here: adapters read the file and pass the decoded mapping.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from specgov.policies.common.types import PolicyTypeError, SlotLayout
from specgov.policies.common.validation import check_int, check_real, is_step_list

# Identical to sglang 0.5.23's DEFAULT_ADAPTIVE_CONFIG (checked by a contract test).
# Read-only: copy it (copy.deepcopy) to edit.
DEFAULT_ADAPTIVE_CONFIG: Final[dict[str, dict[str, Any]]] = {
    "1": {
        "candidate_steps": [1, 3, 5, 7],
        "up_hysteresis": 0.0,
        "down_hysteresis": -0.25,
        "ceiling_coeff": 0,
    },
    "8": {
        "candidate_steps": [0, 1, 3],
        "up_hysteresis": 0.0,
        "down_hysteresis": 0.0,
        "ceiling_coeff": 0,
    },
    "32": {
        "candidate_steps": [0, 1],
        "up_hysteresis": 0.0,
        "down_hysteresis": 0.0,
        "ceiling_coeff": 0,
    },
    "64": {
        "candidate_steps": [0],
        "up_hysteresis": 0.0,
        "down_hysteresis": 0.0,
        "ceiling_coeff": 0,
    },
}

# SGLang's per-slot defaults (AdaptiveStepSlot.__init__).
DEFAULT_EMA_ALPHA: Final = 0.2
DEFAULT_UPDATE_INTERVAL: Final = 5
DEFAULT_WARMUP_BATCHES: Final = 10
DEFAULT_DOWN_HYSTERESIS: Final = -0.25
DEFAULT_UP_HYSTERESIS: Final = 0.0
DEFAULT_CEILING_COEFF: Final = 0.0


class AdaptiveConfigError(PolicyTypeError):
    """An adaptive config is malformed; the message names the source and the key."""


@dataclass(frozen=True, slots=True)
class SlotConfig:
    """One batch-size slot of the adaptive config, defaults merged in."""

    bound: int
    candidate_steps: tuple[int, ...]  # sorted, unique (as AdaptiveStepSlot stores them)
    ema_alpha: float = DEFAULT_EMA_ALPHA
    update_interval: int = DEFAULT_UPDATE_INTERVAL
    warmup_batches: int = DEFAULT_WARMUP_BATCHES
    down_hysteresis: float = DEFAULT_DOWN_HYSTERESIS
    up_hysteresis: float = DEFAULT_UP_HYSTERESIS
    ceiling_coeff: float = DEFAULT_CEILING_COEFF

    def __post_init__(self) -> None:
        check_int(
            "SlotConfig.bound",
            self.bound,
            error=AdaptiveConfigError,
            minimum=0,
            form="a non-negative int",
        )
        steps = self.candidate_steps
        if (
            not isinstance(steps, tuple)
            or not is_step_list(steps)
            or list(steps) != sorted(set(steps))
        ):
            raise AdaptiveConfigError(
                "SlotConfig.candidate_steps: expected a non-empty tuple of strictly increasing "
                f"non-negative ints, got {steps!r}"
            )
        for name in _KNOBS:
            _KNOBS[name][0](f"SlotConfig.{name}", getattr(self, name))


@dataclass(frozen=True, slots=True)
class AdaptiveConfig:
    """A validated adaptive config: slots sorted by lower bound."""

    slots: tuple[SlotConfig, ...]
    source: str = "<default>"

    def __post_init__(self) -> None:
        if not self.slots or not all(isinstance(s, SlotConfig) for s in self.slots):
            raise AdaptiveConfigError(
                "AdaptiveConfig.slots: expected a non-empty tuple of SlotConfig, "
                f"got {self.slots!r}"
            )
        bounds = [s.bound for s in self.slots]
        if bounds != sorted(set(bounds)):
            raise AdaptiveConfigError(
                f"AdaptiveConfig.slots: expected strictly increasing slot bounds, got {bounds}"
            )

    @property
    def bounds(self) -> tuple[int, ...]:
        return tuple(s.bound for s in self.slots)

    @property
    def layout(self) -> SlotLayout:
        """The slot layout (bound, candidate steps) this config gives the engine."""
        return tuple((s.bound, s.candidate_steps) for s in self.slots)

    @property
    def candidate_steps(self) -> list[int]:
        """Union of every slot's candidate steps (what SGLang prebuilds)."""
        return sorted({step for s in self.slots for step in s.candidate_steps})


# ----------------------------------------------------------------------- validation


def _knob(check: Callable[..., object], **bounds: Any) -> Callable[[str, object], None]:
    """A knob's check: ``check`` (validation's) with its bounds, raising
    AdaptiveConfigError."""

    def run(where: str, value: object) -> None:
        check(where, value, error=AdaptiveConfigError, **bounds)

    return run


# knob -> (validator, default, is float). Floats are stored as float: int and float
# operands give bit-identical results in SGLang's arithmetic, so converting is exact.
_KNOBS: Final[dict[str, tuple[Callable[[str, object], None], float | int, bool]]] = {
    "ema_alpha": (
        _knob(check_real, minimum=0.0, maximum=1.0, form="a number in [0, 1]"),
        DEFAULT_EMA_ALPHA,
        True,
    ),
    "update_interval": (_knob(check_int, minimum=1), DEFAULT_UPDATE_INTERVAL, False),
    "warmup_batches": (_knob(check_int, minimum=0), DEFAULT_WARMUP_BATCHES, False),
    "down_hysteresis": (_knob(check_real), DEFAULT_DOWN_HYSTERESIS, True),
    "up_hysteresis": (_knob(check_real), DEFAULT_UP_HYSTERESIS, True),
    "ceiling_coeff": (
        _knob(check_real, minimum=0.0, form="a finite number >= 0 (0 disables the ceiling)"),
        DEFAULT_CEILING_COEFF,
        True,
    ),
}


def parse_adaptive_config(cfg: Mapping[str, Any], *, source: str = "<default>") -> AdaptiveConfig:
    """Validate a decoded adaptive config the way SGLang's loader does.

    Raises :class:`AdaptiveConfigError` (a ValueError) naming ``source`` and the key.
    """
    if not isinstance(cfg, Mapping):
        raise AdaptiveConfigError(
            f"{source}: adaptive config must be a JSON object mapping batch-size keys to "
            f"slot objects, got {type(cfg).__name__}"
        )
    entries: dict[int, tuple[str, Mapping[str, Any]]] = {}
    for key, entry in cfg.items():
        if not isinstance(key, str):
            raise AdaptiveConfigError(f"{source}: key {key!r}: keys must be strings")
        if not key.isdigit():
            continue
        if not isinstance(entry, Mapping):
            raise AdaptiveConfigError(
                f"{source}: key {key!r}: expected an object with 'candidate_steps', got {entry!r}"
            )
        steps = entry.get("candidate_steps")
        if not isinstance(steps, list) or not is_step_list(steps):
            raise AdaptiveConfigError(
                f"{source}: key {key!r} (BS {key}): candidate_steps must be a non-empty list of "
                f"non-negative ints, got {steps!r}"
            )
        try:
            bound = int(key)
        except ValueError:  # str.isdigit() admits digits int() rejects, e.g. "²"
            raise AdaptiveConfigError(
                f"{source}: key {key!r}: batch-size keys must be decimal integers"
            ) from None
        # A later key with the same value ("01" after "1") replaces the earlier one,
        # as in SGLang's dict.
        entries[bound] = (key, entry)
    if not entries:
        raise AdaptiveConfigError(
            f"{source}: adaptive config must contain at least one integer-string BS key, "
            f'e.g. {{"1": {{"candidate_steps": [1,3,7]}}}}. Got keys: {list(cfg.keys())}'
        )
    slots = []
    for bound in sorted(entries):
        key, entry = entries[bound]
        merged = {**cfg, **entry}
        knobs: dict[str, Any] = {}
        for name, (check, default, is_float) in _KNOBS.items():
            value = merged.get(name, default)
            where = f"{source}: key {key!r}.{name}" if name in entry else f"{source}: key {name!r}"
            check(where, value)
            knobs[name] = float(value) if is_float else value
        slots.append(
            SlotConfig(
                bound=bound,
                candidate_steps=tuple(sorted(set(entry["candidate_steps"]))),
                **knobs,
            )
        )
    return AdaptiveConfig(slots=tuple(slots), source=source)
