"""Closed-loop replay: the daemon's control loop in virtual time.

Every ``interval_s`` simulated seconds the loop does what ``specgov run`` does
against a live SGLang server:

1. scrape: render the simulated server's ``/metrics`` (SGLang's names and update
   moments, :mod:`specgov.simulator.sim_metrics`) and parse it with the daemon's own
   telemetry code into an :class:`Observation` (windowed counters, histogram
   quantiles, aged gauges), adding the per-tier statistics the in-engine
   ``TablePolicy`` flushed (about once a second) since the last decision;
2. decide: run the (guarded) daemon policy, timing its CPU cost;
3. publish: the new table reaches the in-engine ``TablePolicy`` after
   ``publish_delay_s`` and is picked up at its next poll (every
   ``poll_every_batches`` decode batches), as through the spool directory.

Staleness is therefore realistic: decisions act on data up to one interval old,
tables land a poll later, and gauges are as stale as SGLang's (40 decode
iterations).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from specgov.policies.daemon import DaemonPolicy
from specgov.policies.types import (
    Budget,
    Decision,
    Observation,
    StepTable,
    TierStat,
    TierStatsSnapshot,
)


class ClosedLoopConfigError(ValueError):
    """A control-loop setting is out of range; the message names it."""


@dataclass(frozen=True)
class ControlLoopConfig:
    interval_s: float = 5.0  # the daemon's decision period
    publish_delay_s: float = 0.05  # spool write + rename until the plugin can see it
    stats_flush_s: float = 1.0  # the plugin's per-tier statistics cadence
    poll_every_batches: int = 64  # the plugin's spool poll cadence (decode batches)

    def __post_init__(self) -> None:
        for name in ("interval_s", "stats_flush_s"):
            value = getattr(self, name)
            if not value > 0:
                raise ClosedLoopConfigError(f"{name} must be > 0 seconds, got {value!r}")
        if self.publish_delay_s < 0:
            raise ClosedLoopConfigError(
                f"publish_delay_s must be >= 0 seconds, got {self.publish_delay_s!r}"
            )
        if self.poll_every_batches < 1:
            raise ClosedLoopConfigError(
                f"poll_every_batches must be >= 1, got {self.poll_every_batches!r}"
            )


@dataclass
class DecisionRecord:
    time_s: float
    reason: str
    message: str
    changed: bool
    decide_ms: float
    table: dict[str, Any] | None


@dataclass
class ClosedLoopLog:
    decisions: list[DecisionRecord] = field(default_factory=list)

    @property
    def table_changes(self) -> int:
        return sum(1 for d in self.decisions if d.changed)

    @property
    def mean_decide_ms(self) -> float | None:
        if not self.decisions:
            return None
        return sum(d.decide_ms for d in self.decisions) / len(self.decisions)


def merge_tier_snapshots(snapshots: Sequence[TierStatsSnapshot]) -> TierStatsSnapshot | None:
    """Sum several consecutive windows into one (what the daemon reads per decision)."""
    if not snapshots:
        return None
    acc: dict[tuple[int, int], list[Any]] = {}
    for snap in snapshots:
        for t in snap.tiers:
            cur = acc.get((t.slot, t.steps))
            if cur is None:
                acc[(t.slot, t.steps)] = [
                    t.verify_calls,
                    t.requests,
                    list(t.accepted_hist),
                    t.step_time_sum_s,
                    t.step_time_count,
                    t.batch_size_sum,
                ]
            else:
                cur[0] += t.verify_calls
                cur[1] += t.requests
                cur[2] = [a + b for a, b in zip(cur[2], t.accepted_hist, strict=True)]
                cur[3] += t.step_time_sum_s
                cur[4] += t.step_time_count
                cur[5] += t.batch_size_sum
    tiers = tuple(
        TierStat(
            slot=slot,
            steps=steps,
            verify_calls=v[0],
            requests=v[1],
            accepted_hist=tuple(v[2]),
            step_time_sum_s=v[3],
            step_time_count=v[4],
            batch_size_sum=v[5],
        )
        for (slot, steps), v in sorted(acc.items())
    )
    return TierStatsSnapshot(
        window_start_s=snapshots[0].window_start_s,
        window_end_s=snapshots[-1].window_end_s,
        tiers=tiers,
    )


ObserveFn = Callable[[float, TierStatsSnapshot | None, StepTable | None], Observation]


class ClosedLoop:
    """The daemon loop wired to one simulated engine (see the module docstring).

    ``observe(now_s, tier_stats, table_in_force)`` builds the Observation the
    policy sees; ``replay`` wires it to the daemon's telemetry parser over the
    simulated /metrics.
    """

    def __init__(
        self,
        *,
        policy: DaemonPolicy[Any],
        budget: Budget,
        observe: ObserveFn,
        clock: Callable[[], float],
        config: ControlLoopConfig | None = None,
        cpu_clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.policy = policy
        self.budget = budget
        self.config = config or ControlLoopConfig()
        self._observe = observe
        self._clock = clock  # the engine's virtual time
        self._cpu_clock = cpu_clock
        self.state: Any = policy.initial_state()
        self.log = ClosedLoopLog()
        self._published: StepTable | None = None  # visible to the plugin
        self._pending: tuple[float, StepTable] | None = None  # written, not yet visible
        self._stats: list[TierStatsSnapshot] = []

    # The in-engine TablePolicy's collaborators -------------------------------

    def table_source(self) -> StepTable | None:
        pending = self._pending
        if pending is not None and self._clock() >= pending[0]:
            self._published = pending[1]
            self._pending = None
        return self._published

    def stats_sink(self, snapshot: TierStatsSnapshot) -> None:
        self._stats.append(snapshot)

    # The daemon tick -----------------------------------------------------------

    def on_tick(self, now_s: float) -> None:
        stats = merge_tier_snapshots(self._stats)
        self._stats = []
        in_force = self._pending[1] if self._pending is not None else self._published
        observation = self._observe(now_s, stats, in_force)
        started = self._cpu_clock()
        decision, self.state = self.policy.decide(observation, self.state, self.budget)
        decide_ms = (self._cpu_clock() - started) * 1e3
        changed = False
        if decision.table is not None:
            changed = in_force is None or decision.table.slots != in_force.slots
            self._pending = (now_s + self.config.publish_delay_s, decision.table)
        self.log.decisions.append(_record(now_s, decision, changed, decide_ms))


def _record(now_s: float, decision: Decision, changed: bool, decide_ms: float) -> DecisionRecord:
    return DecisionRecord(
        time_s=now_s,
        reason=str(decision.reason),
        message=decision.message,
        changed=changed,
        decide_ms=decide_ms,
        table=decision.table.to_dict() if decision.table is not None else None,
    )


SlotCandidates = tuple[tuple[int, tuple[int, ...]], ...]


def slot_candidates_of(config: Mapping[int, Sequence[int]]) -> SlotCandidates:
    """Observation.slot_candidates from a slot -> candidate steps mapping."""
    return tuple((slot, tuple(sorted(set(steps)))) for slot, steps in sorted(config.items()))
