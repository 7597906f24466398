"""The daemon's restart loop: every ``recommend.interval_s`` it replays the recent
workload over candidate server shapes (controller/daemon/recommend.py, in a thread) and
surfaces the best as a restart recommendation; the operator's apply command, when set,
is handed a recommendation worth it. That check is the one restart predictor: a policy
that sees a regime where a restart may pay (goodput's restart trigger) only brings the
next check forward (``trigger``), over the window since that regime began, once the
regime has lasted a sustained window (``recommend.SUSTAINED_S``), once per regime and
never within that long of the last check, so a trigger held at every decision costs one
replay, not one per decision.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from specgov.controller.daemon.config import SpecgovConfig
from specgov.controller.daemon.own_metrics import DaemonMetrics
from specgov.controller.daemon.status_view import DaemonStatus
from specgov.controller.daemon.store_gateway import SnapshotWrite
from specgov.controller.daemon.telemetry import Telemetry
from specgov.policies.common.decisions import RestartRecommendation, RestartTrigger

log = logging.getLogger("specgov.daemon")

# A recommendation is handed to the apply command only above this predicted gain.
APPLY_MIN_GAIN = 0.05

# Runs a step at fixed deadlines until the daemon stops (Daemon.every).
Every = Callable[[float, Callable[[], Awaitable[object]]], Awaitable[None]]


class RestartLoop:
    """The restart recommendation in force, how it was found, and its apply hook."""

    def __init__(
        self,
        config: Callable[[], SpecgovConfig],
        *,
        telemetry: Telemetry,
        metrics: DaemonMetrics,
        status_info: DaemonStatus,
        clock: Callable[[], float],
        snapshot: Callable[[str, SnapshotWrite], None],
        stop: asyncio.Event,
        every: Every,
    ) -> None:
        self._config = config  # the daemon's (a reload replaces it)
        self._telemetry = telemetry
        self._metrics = metrics
        self._status = status_info
        self._clock = clock
        self._snapshot = snapshot
        self._stop = stop
        self._every = every
        self._applied: tuple[str, float] | None = None  # (recommendation key, when applied)
        self._checking = False  # a check is replaying (the schedule's or a trigger's)
        self._last_check_s: float | None = None
        self._checked_since: float | None = None  # the regime a trigger last checked
        self._triggered: set[asyncio.Task[Any]] = set()

    def trigger(self, trigger: RestartTrigger, time_s: float) -> bool:
        """A policy's restart trigger at *time_s*: start a check of the window since the
        trigger's regime began when one is due (module docstring; never with
        ``recommend.enabled`` false); True when started."""
        from specgov.controller.daemon.recommend import SUSTAINED_S

        due = (
            self._config().recommend.enabled
            and not self._checking
            and time_s - trigger.since_s >= SUSTAINED_S
            and trigger.since_s != self._checked_since
            and (self._last_check_s is None or time_s - self._last_check_s >= SUSTAINED_S)
        )
        if not due:
            return False
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return False  # decided outside the daemon's loop (a test): no check
        self._checked_since = trigger.since_s
        task = loop.create_task(self._triggered_check(trigger))
        self._triggered.add(task)
        task.add_done_callback(self._triggered.discard)
        return True

    async def _triggered_check(self, trigger: RestartTrigger) -> None:
        try:
            await self.recommend_once(trigger)
        except Exception as exc:  # a simulator bug must not take the daemon down
            self._failed(exc)

    async def recommend_once(self, trigger: RestartTrigger | None = None) -> dict[str, Any] | None:
        """Replay the recent workload over candidate shapes (in a thread); surface the best.
        With *trigger*, the window is the trigger's regime (since its ``since_s``). None
        when there is no window yet, or while another check is replaying."""
        if self._checking:
            return None
        workload = self._telemetry.workload_summary(
            since_s=None if trigger is None else trigger.since_s
        )
        if workload is None:
            return None
        self._checking, self._last_check_s = True, self._clock()
        try:
            return await self._check(workload, trigger)
        finally:
            self._checking = False

    async def _check(self, workload: Any, trigger: RestartTrigger | None) -> dict[str, Any] | None:
        from specgov.controller.daemon.recommend import (
            RecommendError,
            recommend,
            restart_recommendation,
        )

        dep = self._config().deployment
        obs = self._telemetry.observation
        try:
            rec = await asyncio.to_thread(
                recommend,
                workload,
                gpu=dep.gpu,
                model=dep.model,
                drafter=dep.drafter,
                current=obs.shape if obs is not None else None,
                slo_tpot_ms=self._config().budget.slo_tpot_ms,
                vram_gib=self._config().budget.vram_gib,
            )
        except (RecommendError, ValueError) as exc:
            self._status.recommendation = {"recommendation": None, "message": str(exc)}
            return None
        details = rec.to_dict()
        if trigger is not None:
            details["trigger"] = trigger.to_dict()  # what brought this check forward
        if restart_recommendation(rec, drafter=dep.drafter) is None:
            # Silent: a burst (window under SUSTAINED_S), a replay that does not describe
            # the window (rec.unreliable) or under RESTART_MIN_GAIN.
            why = (
                f"best {rec.label}, predicted {rec.predicted_gain:+.1%} on {rec.metric} "
                f"over {rec.current_label} in a {workload.window_s:.0f} s window"
                if rec.unreliable is None
                else rec.unreliable
            )
            self._status.recommendation = {
                "recommendation": None,
                "message": f"no restart recommended: {why}",
                "details": details,
            }
            return None
        data = self.surface(rec.structured(), self._clock(), details, dict(rec.environment))
        await self.maybe_apply(data)
        return data

    def surface(
        self,
        rec: RestartRecommendation,
        time_s: float,
        details: Mapping[str, Any] | None = None,
        environment: Mapping[str, str] | None = None,
    ) -> dict[str, Any]:
        """One place for every restart recommendation (the restart check's): status,
        store, metric and log; the apply hook runs from here (see maybe_apply).
        ``environment``: what its launch needs besides the shape (the skip flag)."""
        from specgov.controller.daemon.recommend import recommendation_document

        data = recommendation_document(rec, time_s, details, environment)
        previous = self._status.recommendation or {}
        self._status.recommendation = data
        self._metrics.set_restart_recommendation(
            rec.source, rec.shape.algorithm, rec.shape.num_steps, rec.predicted_gain, rec.metric
        )
        self._snapshot("setting:recommendation", lambda s: s.set_setting("recommendation", data))
        if previous.get("key") != data["key"]:
            log.info("restart recommendation (%s): %s", rec.source, rec.summary)
        return data

    async def maybe_apply(self, data: dict[str, Any]) -> None:
        """Run the operator's apply command (an argument list, never a shell string)
        once per recommendation and at most once per recommend.interval_s."""
        argv = self._config().recommend.apply_command
        gain = data.get("predicted_gain")
        if not argv or not isinstance(gain, float) or gain < APPLY_MIN_GAIN:
            return
        now = self._clock()
        if self._applied is not None and (
            self._applied[0] == data["key"]
            or now - self._applied[1] < self._config().recommend.interval_s
        ):
            return
        self._applied = (str(data["key"]), now)
        import json
        import os

        env = {**os.environ, "SPECGOV_RECOMMENDATION": json.dumps(data, default=str)}
        try:
            proc = await asyncio.create_subprocess_exec(*argv, env=env)
            code = await proc.wait()
        except OSError as exc:
            data["applied"] = f"failed to start {argv[0]}: {exc}"
            log.error("%s", data["applied"])
            return
        data["applied"] = f"{argv[0]} exited {code}"
        log.info("recommendation handed to %s (exit %d)", argv[0], code)

    async def run(self) -> None:
        async def step() -> None:
            try:
                await self.recommend_once()
            except Exception as exc:  # a simulator bug must not take the daemon down
                self._failed(exc)

        # Let a window of telemetry accumulate before the first replay.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stop.wait(), timeout=self._config().recommend.interval_s)
        await self._every(self._config().recommend.interval_s, step)

    def _failed(self, exc: Exception) -> None:
        log.exception("restart loop failed: %s", exc)
        self._status.recommendation = {
            "recommendation": None,
            "message": f"restart loop failed: {type(exc).__name__}: {exc}",
        }

    def document(self) -> dict[str, Any]:
        return self._status.recommendation or {
            "recommendation": None,
            "message": "no recommendation yet (recommend.enabled false or not run yet)",
        }
