"""The engine's time-series sampler: per-interval accumulators and their samples.

The engine adds to the open interval's accumulators as forwards finish and calls
``flush`` once virtual time has passed the interval's end; a flush appends one
sample per elapsed interval (an idle jump over several intervals appends several).

Steps are recorded per batch-size slot of the layout in force: the slots the policy
decides for (``slot_layout``), so a daemon policy over specgov's 8-slot adaptive
config reports 8 slots and SGLang's EMA its 4.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

from specgov.policies.engine.ema import EmaPolicy
from specgov.policies.engine.fixed import FixedStepPolicy
from specgov.policies.engine.table import TablePolicy

# SGLang's default adaptive table (1, 8, 32, 64): the report slots of a policy that
# has no slot table of its own but answers per batch (the oracle, test doubles).
REPORT_SLOTS: tuple[int, ...] = (1, 8, 32, 64)
# One answer for every batch size (no speculation, static:K): a single slot.
ONE_SLOT: tuple[int, ...] = (1,)


def slot_layout(policy: object) -> tuple[int, ...]:
    """The slot lower bounds *policy* decides for, sorted.

    SGLang's EMA (and any ``EmaPolicy``): its config's slots; a ``TablePolicy`` (the
    plugin a daemon policy drives): the slots of the adaptive config it was launched
    with (its fallback's, which the daemon's tables are built over); no policy or a
    fixed step: one slot; anything else: ``REPORT_SLOTS``.
    """
    if isinstance(policy, TablePolicy):
        policy = policy.fallback
    if isinstance(policy, EmaPolicy):
        return tuple(policy.slot_bounds())
    if policy is None or isinstance(policy, FixedStepPolicy):
        return ONE_SLOT
    return REPORT_SLOTS


@dataclass
class TimeSeries:
    """Per-interval samples for plots and reports (one entry per interval)."""

    time_s: list[float] = field(default_factory=list)
    mean_batch_size: list[float] = field(default_factory=list)
    queued_requests: list[int] = field(default_factory=list)
    running_requests: list[int] = field(default_factory=list)
    output_tok_s: list[float] = field(default_factory=list)
    mean_tpot_ms: list[float] = field(default_factory=list)  # NaN: nothing finished
    kv_used_fraction: list[float] = field(default_factory=list)
    # Mean steps used by decode batches of each report slot (NaN: none ran).
    steps_by_slot: dict[int, list[float]] = field(default_factory=dict)


def report_slot(
    batch_size: int, graph_bs: list[int] | None, slots: tuple[int, ...] = REPORT_SLOTS
) -> int:
    """The slot of a decode batch, routed as SGLang routes it: the CUDA-graph padded
    size floored to a slot bound of *slots* (below the first bound: the first slot)."""
    padded = batch_size
    if graph_bs is not None:
        j = bisect.bisect_left(graph_bs, batch_size)
        if j < len(graph_bs):
            padded = graph_bs[j]
    j = bisect.bisect_right(slots, padded) - 1
    return slots[max(0, j)]


class IntervalSampler:
    """Accumulates one sample interval at a time into a ``TimeSeries``.

    The engine writes the accumulators directly (attribute adds on the hot path):
    ``bs_time`` (batch size x decode seconds), ``busy_s`` (decode seconds),
    ``tokens`` (output tokens), ``tpot_sum_s``/``tpot_n`` (finished requests'
    TPOT) and ``steps_sum``/``steps_n`` per slot of ``slots`` (sorted lower bounds).
    """

    __slots__ = (
        "bs_time",
        "busy_s",
        "interval_s",
        "next_sample_s",
        "origin_s",
        "series",
        "slots",
        "steps_n",
        "steps_sum",
        "tokens",
        "tpot_n",
        "tpot_sum_s",
    )

    def __init__(
        self, origin_s: float, interval_s: float, slots: tuple[int, ...] = REPORT_SLOTS
    ) -> None:
        if not slots or list(slots) != sorted(set(slots)):
            raise ValueError(f"IntervalSampler.slots: expected increasing bounds, got {slots!r}")
        self.slots = slots
        self.series = TimeSeries(steps_by_slot={s: [] for s in slots})
        self.origin_s = origin_s  # sample times are reported relative to this
        self.interval_s = interval_s
        self.next_sample_s = origin_s + interval_s
        self.bs_time = 0.0
        self.busy_s = 0.0
        self.tokens = 0
        self.tpot_sum_s = 0.0
        self.tpot_n = 0
        self.steps_sum: dict[int, int] = dict.fromkeys(slots, 0)
        self.steps_n: dict[int, int] = dict.fromkeys(slots, 0)

    def flush(
        self, upto_s: float, queued: int, running: int, kv_used: int, kv_capacity: int
    ) -> None:
        """Close every interval that ended by *upto_s*; gauges are read as of now."""
        series = self.series
        interval = self.interval_s
        steps_sum = self.steps_sum
        steps_n = self.steps_n
        while self.next_sample_s <= upto_s:
            series.time_s.append(self.next_sample_s - self.origin_s)
            series.mean_batch_size.append(self.bs_time / self.busy_s if self.busy_s > 0 else 0.0)
            series.queued_requests.append(queued)
            series.running_requests.append(running)
            series.output_tok_s.append(self.tokens / interval)
            series.mean_tpot_ms.append(
                1000.0 * self.tpot_sum_s / self.tpot_n if self.tpot_n else math.nan
            )
            series.kv_used_fraction.append(kv_used / kv_capacity)
            for s in self.slots:
                n = steps_n[s]
                series.steps_by_slot[s].append(steps_sum[s] / n if n else math.nan)
                steps_sum[s] = 0
                steps_n[s] = 0
            self.bs_time = self.busy_s = 0.0
            self.tokens = self.tpot_n = 0
            self.tpot_sum_s = 0.0
            self.next_sample_s += interval
