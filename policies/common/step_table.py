"""The step table: what the daemon publishes and the in-engine policy runs.

:class:`StepTable` maps batch-size slots to draft steps (with optional live-acceptance
:class:`SlotRule` per slot), its spool format and the versions of it that are read
(:data:`TABLE_SCHEMA`), and the slot lookup every layer shares (:func:`slot_index`).
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Final

from specgov.policies.common.codec import from_data, to_versioned
from specgov.policies.common.types import PolicyTypeError
from specgov.policies.common.validation import check_int, check_real, check_type, is_int, is_real

# The step table's own format (its "schema" key, and the spool file's): 1 = a step per
# slot; 2 = also a live-acceptance rule per slot (SlotRule); 3 = a rule may name the
# step its 0 band probes with (SlotRule.probe); 4 = a rule carries how fast goodput
# changes with the signal at each cut (SlotRule.slopes). Versions 1 to 3 are still read,
# and a table is written in the oldest format that holds it.
TABLE_SCHEMA: Final = 4
TABLE_SCHEMAS_READ: Final = (1, 2, 3, 4)


@dataclass(frozen=True, slots=True)
class SlotRule:
    """One slot's steps as a function of the live acceptance signal (table schema 2-4).

    The signal is the slot's recent first-draft acceptance rate, which the in-engine
    policy measures from every verify of the slot at steps >= 1 (``TablePolicy``). A
    signal below ``thresholds[0]`` runs ``steps[0]``, from ``thresholds[i - 1]`` up to
    below ``thresholds[i]`` ``steps[i]``, from the last threshold on ``steps[-1]``.
    ``prior`` is the daemon's estimate of the signal: where the live one starts, and
    what it is shrunk to while its evidence is thin. The daemon computes the thresholds
    from its step-cost and acceptance models, so each step count holds exactly where it
    maximises expected goodput for the slot; ``probe_step`` is what a slot at 0 steps
    probes with: ``probe`` (format 3; the daemon names the cheapest positive step the
    slot allows, the one it charged step 0 for) or, without one, the least positive
    step in the rule. ``probe`` is stored only where it matters and differs from that
    default (None otherwise), so equal rules compare and serialise equal.
    ``slopes`` (format 4): per threshold, how fast the expected goodput of the band
    above it gains on the band below as the signal rises there (d/dsignal of
    ``goodput_above / goodput_below - 1`` at the cut, per unit of signal, > 0): the
    engine moves across a cut only where the gain is worth a stated fraction
    (``TablePolicy``). None (formats 2-3): a fixed hysteresis in signal units.
    """

    thresholds: tuple[float, ...]
    steps: tuple[int, ...]
    prior: float
    probe: int | None = None
    slopes: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        th, steps = self.thresholds, self.steps
        if not isinstance(th, tuple) or not all(is_real(t) and 0.0 < t < 1.0 for t in th):
            raise PolicyTypeError.bad(
                "SlotRule.thresholds", "expected a tuple of numbers in (0, 1)", th
            )
        if any(a >= b for a, b in itertools.pairwise(th)):
            raise PolicyTypeError.bad(
                "SlotRule.thresholds", "expected strictly increasing thresholds", th
            )
        if (
            not isinstance(steps, tuple)
            or len(steps) != len(th) + 1
            or not all(is_int(k) and k >= 0 for k in steps)
        ):
            raise PolicyTypeError.bad(
                "SlotRule.steps",
                f"expected {len(th) + 1} non-negative ints (one more than the thresholds)",
                steps,
            )
        if not (is_real(self.prior) and 0.0 <= self.prior <= 1.0):
            raise PolicyTypeError.bad("SlotRule.prior", "expected a number in [0, 1]", self.prior)
        probe = self.probe
        if probe is not None and not (is_int(probe) and probe > 0):
            raise PolicyTypeError.bad("SlotRule.probe", "expected None or an int >= 1", probe)
        if probe is not None and (0 not in steps or probe == least_positive_step(steps)):
            object.__setattr__(self, "probe", None)  # the default: not stored
        slopes = self.slopes
        if slopes is not None and (
            not isinstance(slopes, tuple)
            or len(slopes) != len(th)
            or not all(is_real(g) and 0.0 < g < math.inf for g in slopes)
        ):
            raise PolicyTypeError.bad(
                "SlotRule.slopes",
                f"expected None or {len(th)} finite numbers > 0 (one per threshold)",
                slopes,
            )

    def band_for(self, signal: float) -> int:
        """Index into ``steps`` for ``signal``."""
        return bisect.bisect_right(self.thresholds, signal)

    def steps_at(self, signal: float) -> int:
        return self.steps[bisect.bisect_right(self.thresholds, signal)]

    @property
    def probe_step(self) -> int | None:
        """The step a slot at 0 steps probes with (None: the rule never speculates)."""
        return self.probe if self.probe is not None else least_positive_step(self.steps)

    @property
    def all_steps(self) -> tuple[int, ...]:
        """Every step the rule may run (its bands' and its probe's), sorted."""
        steps = set(self.steps)
        if self.probe is not None:
            steps.add(self.probe)
        return tuple(sorted(steps))


def least_positive_step(steps: Iterable[int]) -> int | None:
    """The cheapest positive step of ``steps`` (None: none), the step a 0 band probes with
    unless its rule names another."""
    positive = [k for k in steps if k > 0]
    return min(positive) if positive else None


def check_slots(owner: str, slots: object) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A (bound, steps) layout starting at bound 1; returns its bounds and steps."""
    if not isinstance(slots, tuple) or not slots:
        raise PolicyTypeError.bad(
            f"{owner}.slots", "expected a non-empty tuple of (bound, steps)", slots
        )
    for pair in slots:
        if not (isinstance(pair, tuple) and len(pair) == 2):
            raise PolicyTypeError.bad(f"{owner}.slots", "expected (bound, steps) int pairs", pair)
    bounds = tuple(p[0] for p in slots)
    steps = tuple(p[1] for p in slots)
    if (
        not all(is_int(b) for b in bounds)
        or bounds[0] != 1
        or any(a >= b for a, b in itertools.pairwise(bounds))
    ):
        raise PolicyTypeError.bad(
            f"{owner}.slots",
            "slot lower bounds must be strictly increasing positive ints starting at 1",
            list(bounds),
        )
    if not all(is_int(s) and s >= 0 for s in steps):
        raise PolicyTypeError.bad(f"{owner}.slots", "steps must be non-negative ints", list(steps))
    return bounds, steps


def check_rules(
    owner: str, rules: object, bounds: Sequence[int]
) -> tuple[tuple[int, SlotRule], ...]:
    """(slot bound, SlotRule) pairs on increasing bounds among ``bounds``."""
    if not isinstance(rules, tuple) or not all(
        isinstance(r, tuple) and len(r) == 2 and isinstance(r[1], SlotRule) for r in rules
    ):
        raise PolicyTypeError.bad(
            f"{owner}.rules", "expected a tuple of (slot bound, SlotRule)", rules
        )
    rule_bounds = [b for b, _ in rules]
    if any(a >= b for a, b in itertools.pairwise(rule_bounds)) or not set(rule_bounds) <= set(
        bounds
    ):
        raise PolicyTypeError.bad(
            f"{owner}.rules",
            f"expected increasing slot bounds among the table's {list(bounds)}",
            rule_bounds,
        )
    return rules


def slot_index(bounds: Sequence[int], batch_size: int) -> int:
    """Index of the slot ``batch_size`` falls in (the largest lower bound <= it).

    Batch sizes below the first bound (0 for an idle batch) use the first slot, as
    SGLang's own routing does (adaptive_spec_params._find_closest_bs).
    """
    idx = bisect.bisect_right(bounds, batch_size) - 1
    return idx if idx > 0 else 0


class FutureTableFormat(PolicyTypeError):
    """A step table in a newer format than this specgov knows (upgrade the plugin)."""


@dataclass(frozen=True, slots=True)
class StepTable:
    """The live decision: batch-size slot lower bound -> draft steps.

    ``slots`` is sorted by lower bound; the first bound is 1. A batch of size b uses the
    slot with the largest lower bound <= b. The table is valid until
    ``produced_at_s + ttl_s``. ``rules`` (format 2, optional): (slot bound, SlotRule)
    pairs; a slot with a rule runs the rule's steps for the live acceptance signal
    (its ``slots`` step is the rule at the daemon's prior, for reports and guards), a
    slot without one runs its ``slots`` step.
    """

    slots: tuple[tuple[int, int], ...]
    version: int
    produced_at_s: float
    ttl_s: float
    reason: str = ""
    rules: tuple[tuple[int, SlotRule], ...] = ()
    # A table nested in a saved state may be in its spool form (to_dict), with "schema".
    CODEC_TOLERATED_KEYS: ClassVar[frozenset[str]] = frozenset({"schema"})
    # Derived lookup arrays (not part of equality or the serialised form; the default
    # lets the codec build a table from data, __post_init__ fills them in).
    _bounds: tuple[int, ...] = field(default=(), init=False, repr=False, compare=False)
    _steps: tuple[int, ...] = field(default=(), init=False, repr=False, compare=False)
    _rules: tuple[SlotRule | None, ...] = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        bounds, steps = check_slots("StepTable", self.slots)
        check_int("StepTable.version", self.version, error=PolicyTypeError, minimum=0)
        check_real("StepTable.produced_at_s", self.produced_at_s, error=PolicyTypeError)
        check_real("StepTable.ttl_s", self.ttl_s, error=PolicyTypeError, positive=True)
        check_type("StepTable.reason", self.reason, str, error=PolicyTypeError, form="a str")
        rules = check_rules("StepTable", self.rules, bounds)
        by_bound = dict(rules)
        object.__setattr__(self, "_bounds", bounds)
        object.__setattr__(self, "_steps", steps)
        object.__setattr__(self, "_rules", tuple(by_bound.get(b) for b in bounds))

    @property
    def expires_at_s(self) -> float:
        return self.produced_at_s + self.ttl_s

    def _index(self, batch_size: int) -> int:
        return slot_index(self._bounds, batch_size)

    def steps_for(self, batch_size: int) -> int:
        """Steps for ``batch_size``: the slot with the largest lower bound <= batch_size."""
        return self._steps[self._index(batch_size)]

    def slot_for(self, batch_size: int) -> int:
        """Lower bound of the slot ``batch_size`` falls in."""
        return self._bounds[self._index(batch_size)]

    def rule_for(self, batch_size: int) -> SlotRule | None:
        """The live-acceptance rule of the slot ``batch_size`` falls in, if it has one."""
        return self._rules[self._index(batch_size)]

    def slot_steps(self, batch_size: int) -> tuple[int, ...]:
        """Every step the slot of ``batch_size`` may run (its step and its rule's)."""
        i = self._index(batch_size)
        rule = self._rules[i]
        return (self._steps[i],) if rule is None else rule.all_steps

    def is_expired(self, now_s: float) -> bool:
        return now_s >= self.produced_at_s + self.ttl_s

    def validate_against(self, candidate_steps: Iterable[int]) -> None:
        """Raise :class:`PolicyTypeError` if a slot names a step the engine has not built."""
        allowed = set(candidate_steps)
        bad = [(b, s) for b, s in self.slots if s not in allowed]
        bad += [(b, s) for b, r in self.rules for s in r.all_steps if s not in allowed]
        if bad:
            raise PolicyTypeError(
                f"StepTable.slots: every step must be one of the engine's candidate steps "
                f"{sorted(allowed)}, got (bound, steps) {bad} (table version {self.version})"
            )

    def to_dict(self) -> dict[str, Any]:
        """The oldest format that holds the table (what older plugins read): 4 when a
        rule carries slopes, 3 when one names its probe, 2 when the table has rules,
        else 1."""
        rules = [r for _, r in self.rules]
        version = (
            4
            if any(r.slopes is not None for r in rules)
            else 3
            if any(r.probe is not None for r in rules)
            else 2
            if rules
            else 1
        )
        data = to_versioned(self, version, key="schema")
        if not self.rules:
            del data["rules"]
        for _, rule in data.get("rules", ()):
            for key in _RULE_OPTIONAL_KEYS:
                if rule.get(key) is None:
                    del rule[key]
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StepTable:
        """Formats 1 to 4; a newer one raises :class:`FutureTableFormat`."""
        where = "StepTable.from_dict"
        if not isinstance(data, Mapping):
            raise PolicyTypeError(f"{where}: expected an object, got {type(data).__name__}")
        version = data.get("schema")
        if is_int(version) and version > TABLE_SCHEMA:
            raise FutureTableFormat(
                f"{where}: key 'schema': table format {version} is newer than this "
                f"specgov's {TABLE_SCHEMA}; upgrade specgov in the server environment"
            )
        if not is_int(version) or version not in TABLE_SCHEMAS_READ:
            raise PolicyTypeError(
                f"{where}: key 'schema': expected one of {list(TABLE_SCHEMAS_READ)}, "
                f"got {version!r}"
            )
        if version == 1 and "rules" in data:
            raise PolicyTypeError(f"{where}: key 'rules': format 1 has no rules")
        for key, since in _RULE_OPTIONAL_KEYS.items():
            if version < since and _rules_name(data.get("rules"), key):
                raise PolicyTypeError(
                    f"{where}: key 'rules': format {version} rules carry no {key!r} "
                    f"(that is format {since})"
                )
        body = {k: v for k, v in data.items() if k != "schema"}
        return from_data(cls, body, where=where, error=PolicyTypeError)


# A SlotRule's optional keys, each stored only when set, and the format that added it.
_RULE_OPTIONAL_KEYS: Final = {"probe": 3, "slopes": 4}


def _rules_name(rules: Any, key: str) -> bool:
    """Whether a saved table's ``rules`` (``[[bound, rule], ...]``) carry ``key``."""
    if not isinstance(rules, list | tuple):
        return False
    return any(
        isinstance(e, list | tuple) and len(e) == 2 and isinstance(e[1], Mapping) and key in e[1]
        for e in rules
    )
