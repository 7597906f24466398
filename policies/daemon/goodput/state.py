"""The goodput policy's learned state (GoodputState): estimators, batch mix, RNG, serialised."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from specgov.policies.common.codec import from_data, to_data
from specgov.policies.common.rng import RngState
from specgov.policies.common.step_table import SlotRule, StepTable
from specgov.policies.common.types import PolicyTypeError
from specgov.policies.common.validation import all_real, check_int, check_keys, is_int, is_real
from specgov.policies.daemon.estimators.acceptance import (
    AcceptanceState,
)
from specgov.policies.daemon.estimators.step_cost import (
    StepCostState,
)
from specgov.policies.daemon.goodput.config import (
    GOODPUT_STATE_VERSION,
    READABLE_VERSIONS,
)

# ---------------------------------------------------------------------------- state


@dataclass(frozen=True, slots=True)
class GoodputState:
    """Learned state of :class:`GoodputPolicy`; serialisable (``to_dict``)."""

    acceptance: AcceptanceState
    step_cost: StepCostState
    # The steps and live-acceptance rules of the last plan proposed (None: none yet), so
    # a proposal the guardrails held stays pending.
    last_slots: tuple[tuple[int, int], ...] | None
    rng_state: RngState
    # Per slot: decayed (batch_size_sum, verify_calls), for the representative batch.
    batch: tuple[tuple[int, float, float], ...] = ()
    last_probe_s: float | None = None
    decisions: int = 0
    # Since when a server without the drafter has been predicted to beat the best table
    # (None: not now), for the restart recommendation.
    restart_since_s: float | None = None
    # Decayed per-window TPOT statistics: (time_s, weight, then the weighted sums of
    # log p50, log scale, log-variance, base log-variance, log tokens); None before any.
    slo_stats: tuple[float, ...] | None = None
    # The steps of the table last seen in force (() for none: the engine's fallback) and
    # since when (a window's TPOTs are of requests that finished in it: they tell about a
    # table only once they lived under it from start to end).
    seen_slots: tuple[tuple[int, int], ...] | None = None
    seen_since_s: float | None = None
    last_rules: tuple[tuple[int, SlotRule], ...] = ()
    # Per (slot, steps >= 1): decayed (requests, first drafts accepted); see
    # ``model.first_draft_ratios``. Version 4 on; older states start empty.
    first_draft: tuple[tuple[int, int, float, float], ...] = ()
    version: int = GOODPUT_STATE_VERSION

    def __post_init__(self) -> None:
        if not isinstance(self.acceptance, AcceptanceState):
            raise PolicyTypeError("GoodputState.acceptance: expected an AcceptanceState")
        if not isinstance(self.step_cost, StepCostState):
            raise PolicyTypeError("GoodputState.step_cost: expected a StepCostState")
        if self.last_slots is not None and not _int_pairs(self.last_slots):
            raise PolicyTypeError(
                f"GoodputState.last_slots: expected None or (bound, steps) int pairs, "
                f"got {self.last_slots!r}"
            )
        if not isinstance(self.last_rules, tuple) or not all(
            isinstance(r, tuple) and len(r) == 2 and is_int(r[0]) and isinstance(r[1], SlotRule)
            for r in self.last_rules
        ):
            raise PolicyTypeError(
                f"GoodputState.last_rules: expected (bound, SlotRule) pairs, "
                f"got {self.last_rules!r}"
            )
        rs = self.rng_state
        if (
            not isinstance(rs, tuple)
            or len(rs) != 4
            or not all(is_int(v) and v >= 0 for v in rs)
            or rs[1] % 2 != 1
        ):
            raise PolicyTypeError(
                f"GoodputState.rng_state: expected a PCG64 (state, odd inc, has_uint32, "
                f"uinteger) tuple of non-negative ints, got {rs!r}"
            )
        for entry in self.batch:
            if not _batch_entry(entry):
                raise PolicyTypeError(
                    f"GoodputState.batch: expected (slot, batch_size_sum, verify_calls) "
                    f"entries, got {entry!r}"
                )
        for row in self.first_draft:
            if not _first_draft_entry(row):
                raise PolicyTypeError(
                    f"GoodputState.first_draft: expected (slot, steps >= 1, requests, "
                    f"passed <= requests) entries, got {row!r}"
                )
        if self.slo_stats is not None and (
            not isinstance(self.slo_stats, tuple)
            or len(self.slo_stats) != 7
            or not all_real(self.slo_stats)
        ):
            raise PolicyTypeError(
                f"GoodputState.slo_stats: expected None or 7 finite numbers, got {self.slo_stats!r}"
            )
        if self.seen_slots is not None and not _int_pairs(self.seen_slots):
            raise PolicyTypeError(
                f"GoodputState.seen_slots: expected None or (bound, steps) int pairs, "
                f"got {self.seen_slots!r}"
            )
        for key in ("last_probe_s", "restart_since_s", "seen_since_s"):
            value = getattr(self, key)
            if value is not None and not is_real(value):
                raise PolicyTypeError(
                    f"GoodputState.{key}: expected None or a finite number, got {value!r}"
                )
        check_int("GoodputState.decisions", self.decisions, error=PolicyTypeError, minimum=0)
        if self.version != GOODPUT_STATE_VERSION:  # from_dict upgrades older versions
            raise PolicyTypeError(
                f"GoodputState.version: expected {GOODPUT_STATE_VERSION}, got {self.version!r}"
            )

    # Its own encoding (codec docstring): 128-bit RNG words as hex strings, rows as lists.
    def to_dict(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "acceptance": to_data(self.acceptance),
            "step_cost": self.step_cost.to_dict(),
            "last_slots": None if self.last_slots is None else [list(p) for p in self.last_slots],
            "last_rules": [[b, to_data(r)] for b, r in self.last_rules],
            # 128-bit integers as hex strings: not every JSON reader keeps them exact.
            "rng_state": [hex(v) for v in self.rng_state],
            "batch": [[s, b, v] for s, b, v in self.batch],
            "last_probe_s": self.last_probe_s,
            "decisions": self.decisions,
            "restart_since_s": self.restart_since_s,
            "slo_stats": None if self.slo_stats is None else list(self.slo_stats),
            "seen_slots": None if self.seen_slots is None else [list(p) for p in self.seen_slots],
            "seen_since_s": self.seen_since_s,
            "first_draft": [list(e) for e in self.first_draft],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> GoodputState:
        if not isinstance(data, Mapping):
            raise PolicyTypeError(
                f"GoodputState.from_dict: expected a JSON object (mapping), got {data!r}"
            )
        version = data.get("version")
        if isinstance(version, bool) or version not in READABLE_VERSIONS:
            raise PolicyTypeError(
                f"GoodputState.from_dict: key 'version': unsupported state version "
                f"{version!r}; this build reads versions "
                f"{', '.join(str(v) for v in READABLE_VERSIONS)}"
            )
        keys = {f.name for f in fields(cls)}
        if version == 1:
            keys -= {"restart_since_s", "slo_stats", "seen_slots", "seen_since_s"}
        if version in (1, 2):
            keys = (keys - {"last_slots", "last_rules"}) | {"last_table"}
        if version in (1, 2, 3):
            keys -= {"first_draft"}
        check_keys("GoodputState.from_dict", data, sorted(keys), error=PolicyTypeError)
        raw_rng = data["rng_state"]
        try:
            if not isinstance(raw_rng, list | tuple) or len(raw_rng) != 4:
                raise ValueError
            rng_state = tuple(int(v, 16) for v in raw_rng)
        except (ValueError, TypeError):
            raise PolicyTypeError(
                f"GoodputState.from_dict: key 'rng_state': expected 4 hex strings, got {raw_rng!r}"
            ) from None
        raw_batch = data["batch"]
        if not isinstance(raw_batch, list | tuple) or not all(
            isinstance(e, list | tuple) and len(e) == 3 for e in raw_batch
        ):
            raise PolicyTypeError(
                f"GoodputState.from_dict: key 'batch': expected a list of "
                f"[slot, batch_size_sum, verify_calls], got {raw_batch!r}"
            )
        last_slots, last_rules = _last_plan(data)
        return cls(
            acceptance=AcceptanceState.from_dict(data["acceptance"]),
            step_cost=StepCostState.from_dict(data["step_cost"]),
            last_slots=last_slots,
            last_rules=last_rules,
            rng_state=rng_state,  # type: ignore[arg-type]
            batch=tuple((e[0], e[1], e[2]) for e in raw_batch),
            last_probe_s=data["last_probe_s"],
            decisions=data["decisions"],
            restart_since_s=data.get("restart_since_s"),
            slo_stats=_float_tuple_or_none(data.get("slo_stats")),
            seen_slots=_pairs_or_none(data.get("seen_slots")),
            seen_since_s=data.get("seen_since_s"),
            first_draft=_first_draft_of(data.get("first_draft", [])),
        )


def _int_pairs(value: object) -> bool:
    return isinstance(value, tuple) and all(
        isinstance(p, tuple) and len(p) == 2 and all(is_int(v) for v in p) for p in value
    )


def _last_plan(
    data: Mapping[str, Any],
) -> tuple[tuple[tuple[int, int], ...] | None, tuple[tuple[int, SlotRule], ...]]:
    """The last proposal's steps and rules; versions 1 and 2 kept it as a table."""
    if "last_table" in data:
        raw = data["last_table"]
        if raw is None:
            return None, ()
        table = StepTable.from_dict(raw)
        return table.slots, table.rules
    where = "GoodputState.from_dict: key 'last_rules'"
    rules: tuple[tuple[int, SlotRule], ...] = from_data(
        tuple[tuple[int, SlotRule], ...], data["last_rules"], where=where, error=PolicyTypeError
    )
    return _pairs_or_none(data["last_slots"], "last_slots"), rules


def _batch_entry(entry: object) -> bool:
    """(slot int, batch_size_sum, verify_calls), both sums finite numbers >= 0."""
    return (
        isinstance(entry, tuple)
        and len(entry) == 3
        and is_int(entry[0])
        and all_real(entry[1:], minimum=0.0)
    )


def _first_draft_entry(entry: object) -> bool:
    """(slot int, steps int >= 1, requests, passed), 0 <= passed <= requests finite."""
    return (
        isinstance(entry, tuple)
        and len(entry) == 4
        and is_int(entry[0])
        and is_int(entry[1])
        and entry[1] >= 1
        and all_real(entry[2:], minimum=0.0)
        and entry[3] <= entry[2]
    )


def _first_draft_of(value: object) -> tuple[tuple[int, int, float, float], ...]:
    if not isinstance(value, list | tuple) or not all(
        isinstance(e, list | tuple) and len(e) == 4 for e in value
    ):
        raise PolicyTypeError(
            f"GoodputState.from_dict: key 'first_draft': expected a list of "
            f"[slot, steps, requests, passed], got {value!r}"
        )
    return tuple((e[0], e[1], e[2], e[3]) for e in value)


def _float_tuple_or_none(value: object) -> tuple[float, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list | tuple):
        raise PolicyTypeError(
            f"GoodputState.from_dict: key 'slo_stats': expected null or a list, got {value!r}"
        )
    return tuple(value)


def _pairs_or_none(value: object, key: str = "seen_slots") -> tuple[tuple[int, int], ...] | None:
    if value is None:
        return None
    if not isinstance(value, list | tuple) or not all(
        isinstance(p, list | tuple) and len(p) == 2 for p in value
    ):
        raise PolicyTypeError(
            f"GoodputState.from_dict: key {key!r}: expected null or a list of "
            f"[bound, steps], got {value!r}"
        )
    return tuple((p[0], p[1]) for p in value)
