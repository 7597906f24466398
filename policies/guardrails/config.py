"""The guardrails' configuration (GuardrailConfig), validated field by field."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Final

from specgov.policies.common.validation import (
    is_real,
)
from specgov.policies.guardrails._common import (
    OBSERVATION_FIELDS,
    GuardrailError,
    guard_bool,
    guard_int,
    guard_real,
)

# --------------------------------------------------------------------------- config

# The table TTL, defined once (the guard stamps it; health, doctor and the config
# default read it). Long enough that a daemon deciding every few seconds re-issues a
# table a handful of times per minute at most, short enough that a dead daemon hands
# control back to SGLang's own policy within half a minute.
DEFAULT_TABLE_TTL_S: Final = 30.0


@dataclass(frozen=True, slots=True)
class GuardrailConfig:
    """Guardrail settings; every default is what the daemon runs with.

    Times are seconds of ``Observation.time_s``; gains and thresholds are fractions.
    """

    # TTL stamped on every published table; the in-engine policy ignores an expired one.
    table_ttl_s: float = DEFAULT_TABLE_TTL_S
    # Re-issue an unchanged table once its age passes this fraction of its TTL.
    keepalive_fraction: float = 0.5
    # While frozen, keep re-issuing the held table for this long after the last fresh
    # telemetry; then let it expire so the engine falls back to its own policy (0: never).
    frozen_keepalive_s: float = 120.0
    # Observation fields that must be known (not None) for the policy to act.
    required_fields: tuple[str, ...] = (
        "slot_candidates",
        "staleness_s",
        "tier_stats",
        "window_s",
        "generation_tokens",
    )
    # Scraped metrics older than this are stale.
    max_staleness_s: float = 10.0
    # Tier statistics whose window ended longer ago than this are stale.
    max_tier_stats_age_s: float = 15.0
    # Tolerance band: a change predicted to gain less than this (relative) is held.
    min_gain: float = 0.02
    # A slot keeps its step at least this long after changing (doubles per flap penalty).
    min_dwell_s: float = 30.0
    # Cap on the flap-damped dwell time.
    max_dwell_s: float = 1800.0
    # Half-life of a slot's flap penalty (+1 per reversal A->B->A).
    flap_half_life_s: float = 3600.0
    # Rate limit: at most this many table changes in any rate_window_s.
    rate_window_s: float = 60.0
    max_changes_per_window: int = 3
    # Rollback of a change that measurably hurt goodput or broke an SLO.
    rollback_enabled: bool = True
    # Relative drop of goodput (per running request) that counts as a regression.
    rollback_threshold: float = 0.10
    # Seconds of data compared after the change (at least half as much before it).
    rollback_window_s: float = 20.0
    # Windows starting within this long after a change are skipped (engine pick-up).
    rollback_settle_s: float = 2.0
    # Generated tokens each side needs for a verdict.
    rollback_min_tokens: int = 500
    # A change not judged within this long is kept (inconclusive).
    rollback_max_wait_s: float = 120.0
    # Mean running requests differing by more than this factor: inconclusive, kept.
    rollback_max_load_ratio: float = 2.0
    # An SLO counts as broken above slo * (1 + margin).
    rollback_slo_margin: float = 0.05
    # A rolled-back move is blocked this long.
    rollback_cooldown_s: float = 600.0
    # A drop counts as a regression only beyond this many standard deviations of the
    # per-window goodput measured before the change (noise is not a regression).
    rollback_noise_z: float = 2.0

    def __post_init__(self) -> None:
        _validate_config(self, "GuardrailConfig")

    @property
    def policy_change_limit(self) -> int:
        """A policy change is admitted only while the rate window holds fewer changes."""
        return self.max_changes_per_window - (1 if self.rollback_enabled else 0)

    # Its own loader, not the codec's from_data: the errors name the config key
    # (guardrails.min_gain). The other way is the codec's to_data.
    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, where: str = "guardrails") -> GuardrailConfig:
        """Build from a (YAML/JSON) mapping; missing keys take their defaults.

        Errors name ``where.key`` and the expected form (unknown keys list the valid ones).
        """
        if not isinstance(data, Mapping):
            raise GuardrailError(f"{where}: expected a mapping, got {data!r}")
        names = [f.name for f in fields(cls)]
        unknown = sorted(str(k) for k in data if k not in names)
        if unknown:
            raise GuardrailError(f"{where}: unknown key(s) {unknown}; valid keys are {names}")
        kwargs = dict(data)
        if "required_fields" in kwargs and isinstance(kwargs["required_fields"], list):
            kwargs["required_fields"] = tuple(kwargs["required_fields"])
        for key, value in kwargs.items():
            _check_config_field(f"{where}.{key}", key, value)
        config = cls(**kwargs)
        _check_config_relations(config, where)
        return config


_POSITIVE: Final = (
    "table_ttl_s",
    "max_staleness_s",
    "max_tier_stats_age_s",
    "flap_half_life_s",
    "rate_window_s",
    "rollback_window_s",
    "rollback_max_wait_s",
)
_NON_NEGATIVE: Final = (
    "frozen_keepalive_s",
    "min_gain",
    "min_dwell_s",
    "max_dwell_s",
    "rollback_settle_s",
    "rollback_slo_margin",
    "rollback_cooldown_s",
    "rollback_noise_z",
)


def _check_config_field(where: str, name: str, value: object) -> None:
    if name in _POSITIVE:
        guard_real(where, value, positive=True)
    elif name in _NON_NEGATIVE:
        guard_real(where, value, minimum=0.0)
    elif name == "keepalive_fraction":
        if not (is_real(value) and 0.0 < value <= 1.0):
            raise GuardrailError(f"{where}: expected a number in (0, 1], got {value!r}")
    elif name == "rollback_threshold":
        if not (is_real(value) and 0.0 < value < 1.0):
            raise GuardrailError(f"{where}: expected a number in (0, 1), got {value!r}")
    elif name == "rollback_max_load_ratio":
        guard_real(where, value, minimum=1.0)
    elif name == "max_changes_per_window":
        guard_int(where, value, minimum=1)
    elif name == "rollback_min_tokens":
        guard_int(where, value, minimum=0)
    elif name == "rollback_enabled":
        guard_bool(where, value)
    elif name == "required_fields":
        if not isinstance(value, tuple) or not all(isinstance(v, str) for v in value):
            raise GuardrailError(
                f"{where}: expected a list of Observation field names, got {value!r}"
            )
        bad = [v for v in value if v not in OBSERVATION_FIELDS]
        if bad:
            raise GuardrailError(
                f"{where}: unknown Observation field(s) {bad}; expected some of "
                f"{sorted(OBSERVATION_FIELDS)}"
            )


def _check_config_relations(config: GuardrailConfig, where: str) -> None:
    if config.max_dwell_s < config.min_dwell_s:
        raise GuardrailError(
            f"{where}.max_dwell_s: expected >= min_dwell_s={config.min_dwell_s:g}, "
            f"got {config.max_dwell_s!r}"
        )
    if config.rollback_enabled and config.max_changes_per_window < 2:
        raise GuardrailError(
            f"{where}.max_changes_per_window: expected >= 2 while rollback_enabled "
            f"(one change of each window is kept for a rollback), got "
            f"{config.max_changes_per_window!r}"
        )
    needed = config.rollback_settle_s + config.rollback_window_s
    if config.rollback_max_wait_s < needed:
        raise GuardrailError(
            f"{where}.rollback_max_wait_s: expected >= rollback_settle_s + "
            f"rollback_window_s = {needed:g}, got {config.rollback_max_wait_s!r}"
        )


def _validate_config(config: GuardrailConfig, where: str) -> None:
    for f in fields(config):
        _check_config_field(f"{where}.{f.name}", f.name, getattr(config, f.name))
    _check_config_relations(config, where)
