"""Closed-loop replay: the daemon's control loop in virtual time.

The loop does what ``specgov run`` does against a live SGLang server, on the daemon's
two cadences: it scrapes every ``scrape_interval_s`` simulated seconds and decides every
``interval_s``, on the newest scrape, through the same control core
(:mod:`specgov.policies.control.core`, :func:`control_step`). A decision's rates and
quantiles reach back about one decision interval
(:func:`~specgov.adapters.observation_builder.decision_window_s`, as the daemon's do),
and its first decision finds a window already (a loop that scraped only when it decided
had none, and held the first table one decision longer than the daemon does):

1. scrape: render the simulated server's ``/metrics`` (SGLang's names and update
   moments, :mod:`specgov.simulator.engine.sglang_metrics`) and parse it with the daemon's own
   telemetry code into an :class:`Observation` (windowed counters, histogram
   quantiles, aged gauges); the core adds the per-tier statistics the in-engine
   ``TablePolicy`` flushed (about once a second) since the last decision;
2. decide: the core runs the guarded policy (CPU time measured) with the operator's
   overrides and pins, exactly as in the daemon;
3. publish: the new table reaches the in-engine ``TablePolicy`` after
   ``publish_delay_s`` and is picked up at its next poll (every
   ``poll_every_batches`` decode batches), as through the spool directory.

Staleness is therefore realistic: decisions act on the newest scrape and on plugin
statistics up to one flush old, tables land a poll later, and gauges are as stale as
SGLang's (40 decode iterations).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from specgov.policies.common.decisions import RestartTrigger
from specgov.policies.common.errors import SpecgovError
from specgov.policies.common.observation import Observation
from specgov.policies.common.step_table import StepTable
from specgov.policies.common.types import TierStatsSnapshot
from specgov.policies.control.core import (
    AuditRecord,
    ControlCore,
    ControlInputs,
    CoreState,
    Publish,
    control_step,
)
from specgov.policies.engine.table import DEFAULT_FLUSH_INTERVAL_S, DEFAULT_POLL_EVERY_BATCHES
from specgov.policies.guardrails import GuardedPolicy, Override


class ClosedLoopConfigError(SpecgovError, ValueError):
    """A control-loop setting is out of range; the message names it."""


@dataclass(frozen=True)
class ControlLoopConfig:
    interval_s: float = 5.0  # the daemon's decision period (loop.decide_interval_s)
    scrape_interval_s: float = 1.0  # its scrape period (loop.scrape_interval_s)
    publish_delay_s: float = 0.05  # spool write + rename until the plugin can see it
    stats_flush_s: float = DEFAULT_FLUSH_INTERVAL_S  # the plugin's per-tier statistics cadence
    poll_every_batches: int = DEFAULT_POLL_EVERY_BATCHES  # its spool poll cadence (batches)

    def __post_init__(self) -> None:
        for name in ("interval_s", "scrape_interval_s", "stats_flush_s"):
            value = getattr(self, name)
            if not value > 0:
                raise ClosedLoopConfigError(f"{name} must be > 0 seconds, got {value!r}")
        ratio = self.interval_s / self.scrape_interval_s
        if abs(ratio - round(ratio)) > 1e-9 or round(ratio) < 1:
            raise ClosedLoopConfigError(
                f"interval_s ({self.interval_s!r}) must be a whole multiple of "
                f"scrape_interval_s ({self.scrape_interval_s!r})"
            )
        if self.publish_delay_s < 0:
            raise ClosedLoopConfigError(
                f"publish_delay_s must be >= 0 seconds, got {self.publish_delay_s!r}"
            )
        if self.poll_every_batches < 1:
            raise ClosedLoopConfigError(
                f"poll_every_batches must be >= 1, got {self.poll_every_batches!r}"
            )


@dataclass
class ClosedLoopLog:
    """What the loop recorded: the core's audit rows (the daemon's rows, one type), and
    the decisions' restart triggers (the restart check runs on the whole replay at its
    end: controller.daemon.replay_check.replay_restart_check)."""

    decisions: list[AuditRecord] = field(default_factory=list)
    restart_triggers: list[tuple[float, RestartTrigger]] = field(default_factory=list)

    @property
    def table_changes(self) -> int:
        return sum(1 for d in self.decisions if d.changed)

    @property
    def mean_decide_ms(self) -> float | None:
        if not self.decisions:
            return None
        return sum(d.decide_ms or 0.0 for d in self.decisions) / len(self.decisions)


ObserveFn = Callable[[float], Observation | None]
# Tests script publish failures: (virtual time, table) -> whether the write succeeds.
PublishHook = Callable[[float, StepTable], bool]


class ClosedLoop:
    """The daemon's control core wired to one simulated engine (module docstring).

    Only what is specific to virtual time lives here: the publish delay, the plugin's
    poll and statistics cadence. Every decision is :func:`control_step` of the same
    :class:`ControlCore` the daemon runs. ``observe(now_s)`` returns the scrape (None for
    a telemetry gap); ``replay`` wires it to the daemon's parser over the simulated
    /metrics.
    """

    def __init__(
        self,
        *,
        core: ControlCore,
        policy_spec: str,
        observe: ObserveFn,
        clock: Callable[[], float],
        config: ControlLoopConfig | None = None,
        cpu_clock: Callable[[], float] = time.perf_counter,
        overrides: Callable[[float], Sequence[Override]] | None = None,
        blocked: Callable[[float], str | None] | None = None,
        publish_hook: PublishHook | None = None,
    ) -> None:
        self.core = core
        self.config = config or ControlLoopConfig()
        # What the executor feeds the core each tick; tests script faults through these
        # (a telemetry gap: observe returns None; a permanent error: blocked says why).
        self.observe = observe
        self.overrides = overrides
        self.blocked = blocked
        self.publish_hook = publish_hook
        self._clock = clock  # the engine's virtual time
        self._cpu_clock = cpu_clock
        self.state: CoreState = core.initial_state(policy_spec)
        self.log = ClosedLoopLog()
        self._last_obs: Observation | None = None
        self._published: StepTable | None = None  # visible to the plugin
        self._pending: tuple[float, StepTable] | None = None  # written, not yet visible
        self._stats: list[TierStatsSnapshot] = []
        # When the next decision is due, on a fixed grid as the daemon's decide loop
        # keeps it (None until the first scrape tick sets the grid).
        self._next_decide_s: float | None = None

    @property
    def policy(self) -> GuardedPolicy[Any]:
        return self.core.policy(self.state.policy_spec)

    # The in-engine TablePolicy's collaborators -------------------------------

    def table_source(self) -> StepTable | None:
        pending = self._pending
        if pending is not None and self._clock() >= pending[0]:
            self._published = pending[1]
            self._pending = None
        return self._published

    def stats_sink(self, snapshot: TierStatsSnapshot) -> None:
        self._stats.append(snapshot)

    # The effects, in virtual time ------------------------------------------------

    def publish(self, publish: Publish) -> bool:
        now = self._clock()
        if self.publish_hook is not None and not self.publish_hook(now, publish.table):
            return False
        self._pending = (now + self.config.publish_delay_s, publish.table)
        return True

    @property
    def records(self) -> list[AuditRecord]:
        """Every decision's audit row, in order (as the daemon's store keeps them)."""
        return self.log.decisions

    def record(self, record: AuditRecord) -> None:
        self.log.decisions.append(record)

    def trigger_restart_check(self, trigger: RestartTrigger, record: AuditRecord) -> None:
        self.log.restart_triggers.append((record.time_s, trigger))

    # The daemon tick -----------------------------------------------------------

    def on_tick(self, now_s: float) -> None:
        """One scrape tick (the engine calls it every ``scrape_interval_s``, at forward
        boundaries); a tick at or past the next decision time also decides, on that
        scrape. Decision times stay on a fixed grid (``interval_s`` apart from the run's
        start), as the daemon's decide loop keeps them: a forward that spans several
        scrape intervals (a long prefill) delays one decision, not every later one."""
        observation = self.observe(now_s)
        if observation is not None:
            self._last_obs = observation
        cfg = self.config
        slack = cfg.scrape_interval_s / 2  # a tick lands a little after its nominal time
        due = self._next_decide_s
        if due is None:  # the first tick: one scrape interval after the start
            due = now_s - cfg.scrape_interval_s + cfg.interval_s
        if now_s < due - slack:
            self._next_decide_s = due
            return
        while due - slack <= now_s:
            due += cfg.interval_s
        self._next_decide_s = due
        stats = tuple(self._stats)
        self._stats = []
        inputs = ControlInputs(
            now_s=now_s,
            observation=self._last_obs,
            tier_stats=stats,
            overrides=tuple(self.overrides(now_s)) if self.overrides is not None else (),
            blocked=self.blocked(now_s) if self.blocked is not None else None,
        )
        _, self.state = control_step(self.core, self.state, inputs, self, self._cpu_clock)
