"""What a policy answers: a daemon policy's :class:`Plan`, the guarded :class:`Decision`
made from it, their :class:`ReasonCode`, restart recommendations and goodput predictions."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Final

from specgov.policies.common.codec import from_data, to_data
from specgov.policies.common.step_table import (
    SlotRule,
    StepTable,
    check_rules,
    check_slots,
    slot_index,
)
from specgov.policies.common.types import PolicyTypeError, SpecShape
from specgov.policies.common.validation import check_fields, check_int, check_real, check_type


class ReasonCode(StrEnum):
    """Why a decision is what it is (also a metric label)."""

    INITIAL = "initial"
    HELD_STALE_TELEMETRY = "held_stale_telemetry"
    HELD_UNKNOWN_TELEMETRY = "held_unknown_telemetry"
    HELD_TOLERANCE_BAND = "held_tolerance_band"
    HELD_MIN_DWELL = "held_min_dwell"
    HELD_RATE_LIMIT = "held_rate_limit"
    HELD_NO_CHANGE = "held_no_change"
    CHANGED_PREDICTED_GAIN = "changed_predicted_gain"
    ROLLED_BACK_REGRESSION = "rolled_back_regression"
    LIMITED_BY_SLO = "limited_by_slo"
    LIMITED_BY_BUDGET = "limited_by_budget"
    LIMITED_BY_CANDIDATES = "limited_by_candidates"
    OVERRIDE_ACTIVE = "override_active"
    STATIC_POLICY = "static_policy"


RESTART_SOURCES: Final = ("policy", "replay")


@dataclass(frozen=True, slots=True)
class RestartRecommendation:
    """Restart the server with ``shape``: something a step table cannot do.

    ``source`` says who concluded it: ``policy`` (a live policy from its estimators, e.g.
    goodput when no table beats the server without the drafter) or ``replay`` (the
    restart loop replaying the recent workload over candidate shapes). ``predicted_gain``
    is relative (0.1 = +10 % goodput) against what runs now; ``evidence`` holds the
    numbers behind it by name. Launch flags are derived from ``shape`` in one place
    (``adapters.launch_config``), never stored here in a second form.
    """

    shape: SpecShape
    source: str
    summary: str
    predicted_gain: float | None
    evidence: tuple[tuple[str, float], ...] = ()

    def __post_init__(self) -> None:
        check_type(
            "RestartRecommendation.shape",
            self.shape,
            SpecShape,
            error=PolicyTypeError,
            form="a SpecShape",
        )
        if self.source not in RESTART_SOURCES:
            raise PolicyTypeError.bad(
                "RestartRecommendation.source", f"one of {RESTART_SOURCES}", self.source
            )
        if not isinstance(self.summary, str) or not self.summary.strip():
            raise PolicyTypeError.bad(
                "RestartRecommendation.summary", "expected a non-empty str", self.summary
            )
        if self.predicted_gain is not None:
            check_real(
                "RestartRecommendation.predicted_gain", self.predicted_gain, error=PolicyTypeError
            )
        if not isinstance(self.evidence, tuple):
            raise PolicyTypeError.bad(
                "RestartRecommendation.evidence", "a tuple of (name, number)", self.evidence
            )
        for i, item in enumerate(self.evidence):
            if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
                raise PolicyTypeError.bad(
                    f"RestartRecommendation.evidence[{i}]", "a (name, number) pair", item
                )
            check_real(f"RestartRecommendation.evidence[{i}]", item[1], error=PolicyTypeError)

    # A legacy shape: evidence as a name -> number map, as operators read it.
    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = to_data(self)
        data["shape"] = self.shape.to_dict()
        data["evidence"] = dict(self.evidence)  # name -> number, as operators read it
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RestartRecommendation:
        w = "RestartRecommendation.from_dict"
        if isinstance(data, Mapping) and isinstance(data.get("evidence"), Mapping):
            data = {**data, "evidence": [[k, v] for k, v in data["evidence"].items()]}
        return from_data(cls, data, where=w, error=PolicyTypeError)


@dataclass(frozen=True, slots=True)
class GoodputPrediction:
    """What a policy's model predicts for one slot run at ``steps``: the goodput while a
    batch of this slot runs (tokens/s) and the slot's share of recent batches (weights)."""

    slot: int
    steps: int
    goodput_tok_s: float
    share: float

    def __post_init__(self) -> None:
        check_fields(
            "GoodputPrediction",
            self,
            ("slot", "steps"),
            check_int,
            error=PolicyTypeError,
            minimum=0,
        )
        check_fields(
            "GoodputPrediction",
            self,
            ("goodput_tok_s", "share"),
            check_real,
            error=PolicyTypeError,
            minimum=0.0,
        )


def predicted_goodput_tok_s(
    predictions: Sequence[GoodputPrediction], table: StepTable | None
) -> float | None:
    """Goodput predicted for ``table`` (the table in force) at the recent load: the
    share-weighted goodput of each slot at the steps ``table`` gives it. None when there is
    no table, no load, or a busy slot runs steps the model made no prediction for."""
    if table is None or not predictions:
        return None
    by_key = {(p.slot, p.steps): p for p in predictions}
    shares = {p.slot: p.share for p in predictions}
    total = sum(shares.values())
    if total <= 0:
        return None
    goodput = 0.0
    for slot, share in shares.items():
        if share <= 0:
            continue
        found = by_key.get((slot, table.steps_for(slot)))
        if found is None:
            return None
        goodput += share / total * found.goodput_tok_s
    return goodput


@dataclass(frozen=True, slots=True)
class Decision:
    """A guarded decision: the table the guard publishes (versioned, stamped with its TTL;
    None: nothing to publish) and/or a restart recommendation, explained. Daemon policies
    answer with a :class:`Plan`; the guard makes the Decision from it.

    ``predictions``: the policy model's goodput per slot and steps (empty: it has no
    model), from which the goodput of whatever table ends up in force is predicted
    (:func:`predicted_goodput_tok_s`), at every decision.
    """

    table: StepTable | None
    reason: ReasonCode
    message: str
    expected_gain: float | None
    limited_by: tuple[str, ...] = ()
    restart_recommendation: RestartRecommendation | None = None
    predictions: tuple[GoodputPrediction, ...] = ()

    def __post_init__(self) -> None:
        if self.table is not None and not isinstance(self.table, StepTable):
            raise PolicyTypeError.bad("Decision.table", "expected None or a StepTable", self.table)
        _check_answer("Decision", self)


@dataclass(frozen=True, slots=True)
class Plan:
    """A daemon policy's answer: the steps it wants per slot, explained.

    ``slots`` is a layout like :attr:`StepTable.slots` (sorted, the first bound 1), or
    None: the policy stands by its last plan (nothing new to propose, or telemetry it
    cannot use). ``rules`` (table format 2) are the live-acceptance rules it wants per
    slot. A plan has no version, produced time or TTL: the guard alone turns plans into
    the published :class:`StepTable` (``policies.guardrails``), and owns its versions,
    TTL and keep-alives.
    """

    slots: tuple[tuple[int, int], ...] | None
    reason: ReasonCode
    message: str
    expected_gain: float | None
    limited_by: tuple[str, ...] = ()
    restart_recommendation: RestartRecommendation | None = None
    rules: tuple[tuple[int, SlotRule], ...] = ()
    # Slot lower bounds whose step is an experiment (a probe), not a prediction:
    # ``expected_gain`` leaves them out and the tolerance band lets them pass.
    experiment_slots: tuple[int, ...] = ()
    predictions: tuple[GoodputPrediction, ...] = ()
    _bounds: tuple[int, ...] = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        bounds: tuple[int, ...] = ()
        if self.slots is not None:
            bounds, _ = check_slots("Plan", self.slots)
        check_rules("Plan", self.rules, bounds)
        if not isinstance(self.experiment_slots, tuple) or not set(self.experiment_slots) <= set(
            bounds
        ):
            raise PolicyTypeError.bad(
                "Plan.experiment_slots",
                f"expected a tuple of the plan's slot bounds {list(bounds)}",
                self.experiment_slots,
            )
        _check_answer("Plan", self)
        object.__setattr__(self, "_bounds", bounds)

    def steps_for(self, batch_size: int) -> int:
        """Steps wanted for ``batch_size`` (the slot with the largest lower bound <= it)."""
        assert self.slots is not None, "Plan.steps_for: a hold has no steps"
        return self.slots[slot_index(self._bounds, batch_size)][1]

    def slot_for(self, batch_size: int) -> int:
        """Lower bound of the plan's slot ``batch_size`` falls in."""
        return self._bounds[slot_index(self._bounds, batch_size)]

    def rule_for(self, batch_size: int) -> SlotRule | None:
        """The rule wanted for the slot ``batch_size`` falls in, if any."""
        return dict(self.rules).get(self.slot_for(batch_size))


def _check_answer(owner: str, answer: Decision | Plan) -> None:
    """The fields a Decision and a Plan share: reason, message, gain, limits, extras."""
    if not isinstance(answer.predictions, tuple) or not all(
        isinstance(p, GoodputPrediction) for p in answer.predictions
    ):
        raise PolicyTypeError.bad(
            f"{owner}.predictions", "a tuple of GoodputPrediction", answer.predictions
        )
    check_type(
        f"{owner}.reason", answer.reason, ReasonCode, error=PolicyTypeError, form="a ReasonCode"
    )
    if not isinstance(answer.message, str) or not answer.message.strip():
        raise PolicyTypeError.bad(f"{owner}.message", "expected a non-empty str", answer.message)
    if answer.expected_gain is not None:
        check_real(f"{owner}.expected_gain", answer.expected_gain, error=PolicyTypeError)
    if not isinstance(answer.limited_by, tuple) or not all(
        isinstance(s, str) and s for s in answer.limited_by
    ):
        raise PolicyTypeError.bad(
            f"{owner}.limited_by", "expected a tuple of non-empty str", answer.limited_by
        )
    if answer.restart_recommendation is not None and not isinstance(
        answer.restart_recommendation, RestartRecommendation
    ):
        raise PolicyTypeError.bad(
            f"{owner}.restart_recommendation",
            "expected None or a RestartRecommendation",
            answer.restart_recommendation,
        )
