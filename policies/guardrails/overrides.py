"""Operator overrides: the Override type and pure helpers over a sequence of them.

The daemon's state store is their only home; every decision receives them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from specgov.policies.common.codec import Versioned
from specgov.policies.guardrails._common import (
    OVERRIDE_VERSION,
    GuardrailError,
    guard_bool,
    guard_int,
    guard_opt_int,
    guard_real,
)

# ------------------------------------------------------------------------- override


@dataclass(frozen=True, slots=True, kw_only=True)
class Override(Versioned):
    """An operator override, active until ``expires_at_s``.

    Exactly one action: ``steps`` (K draft steps), ``disable_speculation`` (0 steps), or
    ``pin_policy`` (run that policy spec; the daemon acts on it, always all slots).
    ``slot`` is a slot lower bound, or None for every slot. Step overrides are clamped to
    the slot's candidates and the Budget like any decision.
    """

    # Versioned: a stored override outlives the build that wrote it.
    CODEC_VERSION = OVERRIDE_VERSION
    CODEC_ERROR = GuardrailError

    expires_at_s: float
    reason: str
    created_at_s: float
    slot: int | None = None
    steps: int | None = None
    disable_speculation: bool = False
    pin_policy: str | None = None

    def __post_init__(self) -> None:
        guard_opt_int("Override.slot", self.slot, minimum=1)
        guard_opt_int("Override.steps", self.steps, minimum=0)
        guard_bool("Override.disable_speculation", self.disable_speculation)
        if self.pin_policy is not None and (
            not isinstance(self.pin_policy, str) or not self.pin_policy.strip()
        ):
            raise GuardrailError(
                f"Override.pin_policy: expected None or a policy spec string, got "
                f"{self.pin_policy!r}"
            )
        actions = [
            name
            for name, on in (
                ("steps", self.steps is not None),
                ("disable_speculation", self.disable_speculation),
                ("pin_policy", self.pin_policy is not None),
            )
            if on
        ]
        if len(actions) != 1:
            raise GuardrailError(
                "Override: expected exactly one of steps, disable_speculation=True or "
                f"pin_policy, got {actions or 'none'}"
            )
        if self.pin_policy is not None and self.slot is not None:
            raise GuardrailError(
                f"Override.slot: a policy pin applies to every slot; expected None, got "
                f"{self.slot!r}"
            )
        created = guard_real("Override.created_at_s", self.created_at_s)
        expires = guard_real("Override.expires_at_s", self.expires_at_s)
        if expires <= created:
            raise GuardrailError(
                f"Override.expires_at_s: expected > created_at_s={created:g}, got {expires!r}"
            )
        if not isinstance(self.reason, str) or not self.reason.strip():
            raise GuardrailError(f"Override.reason: expected a non-empty str, got {self.reason!r}")

    @property
    def kind(self) -> str:
        """``"pin"`` for a policy pin, ``"steps"`` otherwise."""
        return "pin" if self.pin_policy is not None else "steps"

    @property
    def target_steps(self) -> int | None:
        """Steps this override asks for (None for a policy pin)."""
        return 0 if self.disable_speculation else self.steps

    def is_active(self, now_s: float) -> bool:
        # Only expiry counts: created_at_s orders overrides (newest wins) but may come
        # from another clock than the observations.
        return now_s < self.expires_at_s

    def describe(self) -> str:
        where = "all slots" if self.slot is None else f"slot {self.slot}"
        if self.pin_policy is not None:
            what = f"pin policy {self.pin_policy!r}"
        elif self.disable_speculation:
            what = f"{where} -> 0 (speculation disabled)"
        else:
            what = f"{where} -> {self.steps}"
        return f"{what} ({self.reason!r}, until {self.expires_at_s:.1f} s)"


# ------------------------------------------------------------------ override helpers


def with_override(overrides: Sequence[Override], override: Override) -> tuple[Override, ...]:
    """``overrides`` plus ``override``, replacing an earlier one of the same kind for the
    same slot (the rule the daemon's store applies when an override is set)."""
    if not isinstance(override, Override):
        raise GuardrailError(f"with_override: expected an Override, got {override!r}")
    kept = tuple(o for o in overrides if (o.slot, o.kind) != (override.slot, override.kind))
    return (*kept, override)


def without_overrides(
    overrides: Sequence[Override], slot: int | None = None
) -> tuple[Override, ...]:
    """``overrides`` less every one (``slot=None``) or those of one slot (all-slot
    overrides stay when a slot is named, as the store clears them)."""
    if slot is not None:
        guard_int("without_overrides.slot", slot, minimum=1)
        return tuple(o for o in overrides if o.slot != slot)
    return ()


def active_overrides(overrides: Sequence[Override], now_s: float) -> tuple[Override, ...]:
    """Overrides in force at ``now_s``."""
    return tuple(o for o in overrides if o.is_active(now_s))


def slot_winners(overrides: Sequence[Override], bounds: Sequence[int]) -> dict[int, Override]:
    """The step override that sets each engine slot (``bounds``): a slot's own override
    wins over an every-slot one (``--disable`` included), and among overrides of the same
    reach the newest wins. Pins and inactive overrides are the caller's to leave out."""
    steps = [o for o in overrides if o.kind == "steps"]
    winners: dict[int, Override] = {}
    for b in bounds:
        mine = [o for o in steps if o.slot == b] or [o for o in steps if o.slot is None]
        if mine:
            winners[b] = max(mine, key=lambda o: o.created_at_s)
    return winners


def pinned_policy(overrides: Sequence[Override], now_s: float) -> str | None:
    """The policy spec an active operator pin asks for (newest wins), else None."""
    pins = [o for o in active_overrides(overrides, now_s) if o.pin_policy is not None]
    if not pins:
        return None
    return max(pins, key=lambda o: o.created_at_s).pin_policy
