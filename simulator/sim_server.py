"""The simulated SGLang server: the discrete-event engine in accelerated real time
behind an HTTP front that speaks SGLang 0.5.23's endpoints (DESIGN.md, "Simulator").

A specgov daemon pointed at :class:`SimServer` sees what it would see from SGLang:
``/metrics`` (SGLang's metric names, :class:`~specgov.simulator.sim_metrics.SimMetrics`),
``/server_info`` and ``/get_server_info``, ``/v1/loads``, ``/health``,
``/health_generate``, ``/ready``, ``/model_info`` and ``/get_model_info``, and
``/set_internal_state`` with SGLang's allowed keys and refusals (bodies:
:mod:`specgov.simulator.sim_endpoints`). Only ``/model_info`` (``model_path`` starting
with ``specgov-sim:``) tells it apart. ``/generate`` is not served: the requests come
from the trace.

Time. ``speed`` X means X simulated seconds per wall second. The engine runs in its own
thread; its ``on_tick`` hook (about every 20 ms of wall time) sleeps so that simulated
time never runs ahead of ``wall_of(sim)``, the linear map from simulated to wall-clock
epoch time fixed at start. If the engine cannot keep up (a CPU-bound replay at a high
speed), the map is shifted forward at the next tick (``lag_resyncs`` counts it), so
timestamps always stay close to the wall clock. What each consumer gets:

* Timestamps the daemon compares with its own clock are wall-clock epoch seconds: the
  plugin's clock (so ``StepTable.produced_at_s + ttl_s`` is judged against the same
  clock the daemon stamped it with, and TTL expiry happens in real seconds), the tier
  statistics windows, ``/v1/loads`` timestamps.
* Durations are simulated seconds: the latency histograms, the ``gen_throughput``
  gauge, and the tier statistics' ``step_time_sum_s`` (the plugin measures a step on
  its wall-mapped clock, i.e. ``sim_dt / speed``; the stats writer multiplies by
  ``speed`` back before writing). A cost model learned from them is the simulated
  GPU's, and SLOs in milliseconds mean what they say.
* Counters advance X times faster per wall second than the simulated rate, so a rate
  a daemon derives from two scrapes over its own (wall) clock is X times the simulated
  one. At speed 1 every view agrees. (Step times in the statistics lose a little
  precision at very high speeds: the plugin subtracts epoch-sized floats, resolution
  ~0.2 µs of wall time, i.e. ``0.2 µs × speed`` simulated.)

In-engine policy. With a ``spool_dir`` the engine runs specgov's SGLang plugin class,
:class:`~specgov.adapters.sglang_plugin.SpecgovAdaptiveParams`, exactly as SGLang would
construct it (``initial_steps``, ``cfg_path`` of an adaptive config written into the
spool, ``sglang_adaptive_config.json``, as a real launch with
``--speculative-adaptive-config`` would have one), on the spool protocol: it follows
``step_table.json`` and falls back to SGLang's EMA; it writes tier statistics with the
spool's :class:`~specgov.adapters.spool.BackgroundStatsWriter` about once per wall
second (``stats_interval_s``, the plugin's flush interval, on the wall-mapped clock: a
daemon polls in wall time, and one window per simulated second at speed 100 would flood
the spool). The adaptive
config defaults to :func:`~specgov.simulator.replay.specgov_adaptive_config`. Without a
spool the engine runs SGLang's own controller (:class:`~specgov.policies.ema.EmaPolicy`,
no plugin) on SGLang's default config unless ``adaptive_config`` is given: the baseline.
Drafters SGLang cannot adapt (not EAGLE/EAGLE3, or topk > 1) run the static
``spec_steps``, and a spool is then unused.

Lifecycle. :meth:`SimServer.start` binds the port (``/health`` answers 503 until the
engine runs), :meth:`~SimServer.wait_ready`, :meth:`~SimServer.stop` (joins every
thread, flushes the last statistics window). When the trace ends the engine idles and
the server keeps serving idle metrics, or, with ``loop_trace=True``, replays the trace
again (one mean inter-arrival gap later). For end-to-end tests: :meth:`~SimServer.restart`
is a server restart (in-flight requests lost, counters reset, a fresh plugin instance
re-reading the spool, overrides gone; optionally refusing connections for ``down_s``
and answering 503 on ``/health`` for ``starting_s``), :meth:`~SimServer.pause` an outage
of the HTTP front only (connections refused, or 503 on every route) while the engine
keeps serving. The same controls are HTTP routes under ``/specgov-sim/`` (``GET state``,
``POST restart``, ``POST outage``) so a test can drive a sim-server in another process.

Threads: the engine thread, the HTTP thread (its own asyncio loop, so the server works
from synchronous code and next to another loop in the same process), the statistics
writer. The metrics object serialises engine events and renders with one lock, so a
scrape sees a state between two engine events.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import concurrent.futures
import contextlib
import dataclasses
import json
import logging
import math
import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import Any, Final, Literal

from aiohttp import web
from aiohttp.typedefs import Handler

from specgov.adapters.sglang_plugin import SpecgovAdaptiveParams
from specgov.adapters.spool import BackgroundStatsWriter, atomic_write_bytes, default_writer_id
from specgov.adapters.tp_sync import LocalChannel
from specgov.policies.adaptive_config import (
    DEFAULT_ADAPTIVE_CONFIG,
    AdaptiveConfig,
    parse_adaptive_config,
)
from specgov.policies.ema import EmaPolicy
from specgov.policies.types import TierStatsSnapshot
from specgov.simulator import sim_endpoints as ep
from specgov.simulator.engine import EngineResult, VirtualClock
from specgov.simulator.replay import (
    ADAPTIVE_ALGORITHMS,
    InEnginePolicy,
    PreparedRun,
    ServerSpec,
    parse_policy,
    prepare_run,
    resolve,
    specgov_adaptive_config,
)
from specgov.simulator.sim_metrics import SimMetrics
from specgov.simulator.traces import Request, Trace

logger = logging.getLogger(__name__)

ADAPTIVE_CONFIG_FILENAME: Final = "sglang_adaptive_config.json"
ADMIN_PREFIX: Final = "/specgov-sim"
DEFAULT_PORT: Final = 30000  # SGLang's default --port
# Engine/wall synchronisation granularity and the lag beyond which the map is shifted.
TICK_WALL_S: Final = 0.02
MAX_LAG_S: Final = 0.5
MAX_BODY_BYTES: Final = 64 * 1024
JOIN_TIMEOUT_S: Final = 10.0

OutageMode = Literal["refuse", "503"]
OUTAGE_MODES: Final = ("refuse", "503")


class SimServerError(ValueError):
    """A sim-server setting or control request is invalid; the message names it."""


class _Stopped(Exception):
    """Raised from the engine's tick hook to end a run (stop or restart)."""


# ------------------------------------------------------------------- engine helpers


class _ServedMetrics(SimMetrics):
    """SimMetrics plus what /server_info and /v1/loads publish, behind one lock.

    The engine thread feeds events; HTTP handlers render or take a :class:`LiveState`.
    Load snapshots are published as SGLang's scheduler does: every
    ``load_snapshot_publish_interval`` (15) decode iterations and when it goes idle
    (prefill-time publishes are not modelled: the engine reports no queue lengths then).
    Lifetime acceptance totals advance at each ``decode_log_interval`` (40) decodes.
    """

    def __init__(
        self,
        *,
        model_name: str,
        kv_capacity_tokens: int,
        wall_of: Callable[[float], float],
        draft_per_round: int,
        publish_interval: int = 15,
    ) -> None:
        self.lock = threading.Lock()
        super().__init__(model_name=model_name, kv_capacity_tokens=kv_capacity_tokens)
        self._capacity = kv_capacity_tokens
        self._wall_of = wall_of
        self._draft_per_round = draft_per_round
        self._publish_interval = publish_interval
        self._decodes = 0
        self._pub_count = 0
        self._running = 0
        self._waiting = 0
        self._used = 0
        self._published_at_s = 0.0
        self._pub_running = self._pub_waiting = self._pub_used = 0
        self._pub_gen_tput = 0.0
        self._pub_retracted = 0
        self._gen_tput = 0.0
        self._log_start_s: float | None = None
        self._log_tokens = 0
        self._log_retracted = 0
        self._iv_acc = self._iv_fwd = self._iv_correct = 0
        self._acc_total = self._fwd_total = 0
        self._accept_rate = 0.0
        self._moments = [0.0] * 6
        self._prefill_tokens = 0
        self._prefill_busy_us = 0
        self._overrides: dict[str, int | float] = {}
        self._idle = True
        self.forwards = 0
        self.finished = 0

    # ------------------------------------------------------------ engine events

    def on_first_token(self, ttft_s: float, queue_s: float) -> None:
        with self.lock:
            super().on_first_token(ttft_s, queue_s)

    def on_tokens(self, interval_s: float, num_tokens: int) -> None:
        with self.lock:
            super().on_tokens(interval_s, num_tokens)

    def on_finish(
        self,
        *,
        prompt_tokens: int,
        generation_tokens: int,
        verify_calls: int,
        e2e_s: float,
        tpot_s: float | None,
    ) -> None:
        with self.lock:
            super().on_finish(
                prompt_tokens=prompt_tokens,
                generation_tokens=generation_tokens,
                verify_calls=verify_calls,
                e2e_s=e2e_s,
                tpot_s=tpot_s,
            )
            self.finished += 1

    def on_prefill(self, new_tokens: int, duration_s: float = 0.0) -> None:
        with self.lock:
            super().on_prefill(new_tokens, duration_s)
            self.forwards += 1
            self._idle = False
            self._prefill_tokens += new_tokens
            self._prefill_busy_us += int(duration_s * 1e6)

    def on_retract(self, count: int) -> None:
        with self.lock:
            super().on_retract(count)
            self._log_retracted += count

    def on_decode(
        self,
        *,
        now_s: float,
        running: int,
        queued: int,
        used_tokens: int,
        capacity_tokens: int,
        steps: int,
        emitted_tokens: int,
        verified_requests: int,
        step_s: float = 0.0,
    ) -> None:
        with self.lock:
            super().on_decode(
                now_s=now_s,
                running=running,
                queued=queued,
                used_tokens=used_tokens,
                capacity_tokens=capacity_tokens,
                steps=steps,
                emitted_tokens=emitted_tokens,
                verified_requests=verified_requests,
                step_s=step_s,
            )
            self.forwards += 1
            self._idle = False
            self._running, self._waiting, self._used = running, queued, used_tokens
            if self._log_start_s is None:
                self._log_start_s = now_s
            self._log_tokens += emitted_tokens
            if verified_requests:
                self._iv_acc += emitted_tokens
                self._iv_fwd += verified_requests
                self._iv_correct += emitted_tokens - verified_requests
            # SGLang's decode moments use launch-to-launch cadence; here the modelled
            # forward duration, which is that cadence when decodes run back to back.
            step_us = float(int(step_s * 1e6))
            if running > 0 and step_us > 0:
                m = self._moments
                b = float(running)
                m[0] += 1.0
                m[1] += b
                m[2] += step_us
                m[3] += b * b
                m[4] += b * step_us
                m[5] += float(emitted_tokens)
            self._decodes += 1
            if self._decodes % self.decode_log_interval == 0:
                span = now_s - self._log_start_s
                self._gen_tput = self._log_tokens / span if span > 0 else 0.0
                self._log_tokens = 0
                self._log_start_s = now_s
                if self._iv_fwd:
                    self._acc_total += self._iv_acc
                    self._fwd_total += self._iv_fwd
                    drafted = self._iv_fwd * self._draft_per_round
                    self._accept_rate = self._iv_correct / drafted if drafted > 0 else 0.0
                self._iv_acc = self._iv_fwd = self._iv_correct = 0
                self._pub_retracted = self._log_retracted
                self._log_retracted = 0
            self._pub_count += 1
            if self._pub_count >= self._publish_interval:
                self._publish(now_s)

    def _publish(self, now_sim_s: float) -> None:
        self._pub_count = 0
        self._published_at_s = self._wall_of(now_sim_s)
        self._pub_running, self._pub_waiting, self._pub_used = (
            self._running,
            self._waiting,
            self._used,
        )
        self._pub_gen_tput = self._gen_tput

    def mark_idle(self, now_sim_s: float) -> None:
        """The engine is idle (nothing running or queued): publish that once, and
        refresh the scheduler gauges to idle values as SGLang's idle path does."""
        with self.lock:
            if self._idle and self._published_at_s > 0:
                return
            self._idle = True
            self._running = self._waiting = self._used = 0
            self._gen_tput = 0.0
            self.g_running.set(0)
            self.g_queue.set(0)
            self.g_gen_throughput.set(0)
            self.g_used_tokens.set(0)
            self.g_token_usage.set(0)
            self.g_available.set(self._capacity)
            self._publish(now_sim_s)

    # -------------------------------------------------------------- HTTP side

    def render(self) -> bytes:
        with self.lock:
            return super().render()

    def apply_overrides(self, overrides: Mapping[str, int | float], *, reset_spec: bool) -> None:
        """Record a /set_internal_state update (accept thresholds restart the lifetime
        acceptance statistics, as SGLang's handler does)."""
        with self.lock:
            self._overrides.update(overrides)
            if reset_spec:
                self._acc_total = self._fwd_total = 0

    def snapshot(self) -> ep.LiveState:
        with self.lock:
            return ep.LiveState(
                published_at_s=self._published_at_s,
                running_requests=self._pub_running,
                waiting_requests=self._pub_waiting,
                used_tokens=self._pub_used,
                gen_throughput_tok_s=self._pub_gen_tput,
                last_gen_throughput_tok_s=self._gen_tput,
                retracted_requests=self._pub_retracted,
                spec_accept_tokens_total=self._acc_total,
                spec_forward_ct_total=self._fwd_total,
                spec_accept_rate=self._accept_rate,
                prefill_uncached_tokens_total=self._prefill_tokens,
                prefill_busy_us_total=self._prefill_busy_us,
                decode_moments=tuple(self._moments),
                overrides=dict(self._overrides),
            )


def _copy_counts(counts: Mapping[str, int]) -> dict[str, int]:
    # Read from another thread than the one that updates it: retry a torn iteration.
    for _ in range(5):
        with contextlib.suppress(RuntimeError):
            return dict(counts)
    return {}


class _Generation:
    """One (re)start of the simulated server: engine, policy, metrics, stats writer."""

    def __init__(
        self,
        index: int,
        prepared: PreparedRun,
        metrics: _ServedMetrics,
        plugin: SpecgovAdaptiveParams | None,
        writer: BackgroundStatsWriter | None,
    ) -> None:
        self.index = index
        self.prepared = prepared
        self.engine = prepared.engine
        self.metrics = metrics
        self.plugin = plugin
        self.writer = writer
        self.launch: ep.LaunchInfo | None = None
        self.stop_event = threading.Event()
        self.thread: threading.Thread | None = None
        self.status = "starting"  # starting | up | finished | stopped | failed
        self.error: str | None = None
        self.tick_forwards = -1
        self.results: list[EngineResult] = []

    def plugin_state(self) -> dict[str, Any] | None:
        plugin = self.plugin
        if plugin is None:
            return None
        policy = plugin.policy
        table = plugin.table
        reader = plugin.reader
        writer = self.writer
        return {
            "mode": plugin.mode,
            "disabled_reason": plugin.disabled_reason,
            "table": None if table is None else table.to_dict(),
            "fallback_reason": None if policy is None else policy.fallback_reason,
            "fallback_batches": {} if policy is None else _copy_counts(policy.fallback_reasons),
            "errors": plugin.errors + (0 if policy is None else policy.errors),
            "last_error": plugin.last_error or (None if policy is None else policy.last_error),
            "spool_ignored": {} if reader is None else _copy_counts(reader.ignored),
            "stats_windows": 0 if policy is None else policy.flushes,
            "stats_written": 0 if writer is None else writer.written,
            "stats_dropped": 0 if writer is None else writer.dropped,
        }


# ----------------------------------------------------------------------- HTTP front


class _HttpFront:
    """An aiohttp server on its own thread and event loop; can refuse connections for
    a while (its runner is closed and re-opened on the same port)."""

    def __init__(self, make_app: Callable[[], web.Application], host: str, port: int) -> None:
        self._make_app = make_app
        self.host = host
        self.port = port
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None
        self._outage_task: asyncio.Task[None] | None = None
        self._closing = False
        self.outage_mode: str | None = None
        self.outage_until_s: float | None = None

    @property
    def listening(self) -> bool:
        return self._runner is not None

    def start(self) -> None:
        ready = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
            self._loop = loop
            try:
                loop.run_until_complete(self._open())
            except BaseException as exc:
                failure.append(exc)
                ready.set()
                loop.close()
                return
            ready.set()
            try:
                loop.run_forever()
            finally:
                loop.run_until_complete(self._shutdown())
                loop.close()

        thread = threading.Thread(target=run, name="specgov-sim-http", daemon=True)
        self._thread = thread
        thread.start()
        ready.wait()
        if failure:
            thread.join()
            self._thread = None
            raise failure[0]

    async def _open(self) -> None:
        runner = web.AppRunner(self._make_app(), access_log=None, shutdown_timeout=1.0)
        await runner.setup()
        try:
            site = web.TCPSite(runner, self.host, self.port)
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        if self.port == 0:
            self.port = int(runner.addresses[0][1])
        self._runner = runner

    async def _close_runner(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    async def _shutdown(self) -> None:
        self._closing = True
        task = self._outage_task
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self._close_runner()

    def stop(self) -> None:
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        with contextlib.suppress(RuntimeError):  # loop already closed
            loop.call_soon_threadsafe(loop.stop)
        thread.join(JOIN_TIMEOUT_S)
        self._thread = None

    def outage(self, seconds: float, mode: OutageMode) -> concurrent.futures.Future[None]:
        loop = self._loop
        if loop is None:
            raise SimServerError("the HTTP front is not running")
        if self.outage_mode is not None:
            raise SimServerError(f"an outage ({self.outage_mode}) is already in progress")
        # Set here, not in the task: a second call right after this one must see it.
        self.outage_mode = mode
        self.outage_until_s = time.time() + seconds
        began = threading.Event()
        future = asyncio.run_coroutine_threadsafe(self._outage(seconds, mode, began), loop)
        if threading.current_thread() is not self._thread:
            # In force when this returns (the port is closed), unless asked from a
            # handler on the loop itself, which must return first.
            began.wait(JOIN_TIMEOUT_S)
        return future

    async def _outage(self, seconds: float, mode: OutageMode, began: threading.Event) -> None:
        self._outage_task = asyncio.current_task()
        try:
            if mode == "refuse":
                await self._close_runner()
            began.set()
            await asyncio.sleep(seconds)
        finally:
            began.set()
            self.outage_mode = None
            self.outage_until_s = None
            self._outage_task = None
            if mode == "refuse" and not self._closing:
                try:
                    await self._open()
                except OSError as exc:
                    logger.error("specgov sim-server: cannot re-open port %d: %s", self.port, exc)

    def end_outage(self) -> None:
        loop, task = self._loop, self._outage_task
        if loop is not None and task is not None:
            loop.call_soon_threadsafe(task.cancel)


# ------------------------------------------------------------------------ the server


class SimServer:
    """The simulated SGLang server (module docstring). Use as a context manager or
    call :meth:`start` / :meth:`stop`."""

    def __init__(
        self,
        trace: Trace | Sequence[Request],
        server: ServerSpec | None = None,
        *,
        speed: float = 1.0,
        spool_dir: str | os.PathLike[str] | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        seed: int = 0,
        adaptive_config: Mapping[str, Any] | None = None,
        loop_trace: bool = False,
        api_key: str | None = None,
        admin_routes: bool = True,
        stats_interval_s: float = 1.0,
    ) -> None:
        if (
            isinstance(speed, bool)
            or not isinstance(speed, int | float)
            or not math.isfinite(speed)
            or speed <= 0
        ):
            raise SimServerError(f"speed: expected a finite number > 0, got {speed!r}")
        if (
            isinstance(stats_interval_s, bool)
            or not isinstance(stats_interval_s, int | float)
            or not math.isfinite(stats_interval_s)
            or stats_interval_s <= 0
        ):
            raise SimServerError(
                f"stats_interval_s: expected a finite number of seconds > 0, "
                f"got {stats_interval_s!r}"
            )
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise SimServerError(f"port: expected an int in [0, 65535], got {port!r}")
        if not isinstance(host, str) or not host:
            raise SimServerError(f"host: expected a host name or address, got {host!r}")
        if api_key is not None and (not isinstance(api_key, str) or not api_key):
            raise SimServerError("api_key: expected a non-empty string or None")
        requests = tuple(trace.requests if isinstance(trace, Trace) else trace)
        for i, req in enumerate(requests):
            if not isinstance(req, Request):
                raise SimServerError(
                    f"trace: item {i} is a {type(req).__name__}, expected a Request"
                )
            if i and req.arrival_s < requests[i - 1].arrival_s:
                raise SimServerError(
                    f"trace: requests must be sorted by arrival_s (request {i} at "
                    f"{req.arrival_s} s comes after one at {requests[i - 1].arrival_s} s)"
                )
        self.server = server if server is not None else ServerSpec()
        self.speed = float(speed)
        self.stats_interval_s = float(stats_interval_s)
        self.spool_dir = None if spool_dir is None else Path(spool_dir)
        self.host = host
        self.seed = seed
        self.loop_trace = loop_trace
        self._api_key = api_key
        self._admin_routes = admin_routes
        self._requests = requests
        self._arrivals = [r.arrival_s for r in requests]
        if requests:
            duration = requests[-1].arrival_s - requests[0].arrival_s
            gap = duration / (len(requests) - 1) if len(requests) > 1 else 1.0
            # One loop of the trace, plus the mean inter-arrival gap before the next.
            self._period_s = duration + max(gap, 1e-3)
        else:
            self._period_s = 1.0

        self._built = resolve(self.server)
        algorithm = self._built.drafter.algorithm.upper()
        self._algorithm = algorithm
        self._adaptive = algorithm in ADAPTIVE_ALGORITHMS and self.server.topk == 1
        self._adaptive_cfg: AdaptiveConfig | None = None
        self._adaptive_raw: dict[str, Any] | None = None
        if self._adaptive:
            if adaptive_config is None and self.spool_dir is not None:
                adaptive_config = specgov_adaptive_config()
            if adaptive_config is not None:
                self._adaptive_cfg = parse_adaptive_config(
                    adaptive_config, source="SimServer adaptive_config"
                )
                # A private copy, written as the launch's --speculative-adaptive-config.
                self._adaptive_raw = json.loads(json.dumps(adaptive_config))
            else:
                self._adaptive_cfg = parse_adaptive_config(
                    DEFAULT_ADAPTIVE_CONFIG, source="SGLang's default adaptive config"
                )
        elif self.spool_dir is not None:
            logger.warning(
                "specgov sim-server: %s with topk=%d has no adaptive speculation in SGLang; "
                "the engine runs %d static steps and the spool %s is not used",
                algorithm,
                self.server.topk,
                self.server.spec_steps,
                self.spool_dir,
            )
        if self.spool_dir is not None and self._adaptive:
            self.policy_name = "specgov-plugin"
        elif self._adaptive:
            self.policy_name = "sglang-ema"
        else:
            self.policy_name = f"static:{self.server.spec_steps}"

        self._http = _HttpFront(self._make_app, host, port)
        self._lifecycle = threading.Lock()
        self._stop_event = threading.Event()
        self._gen: _Generation | None = None
        self._done_generations: list[_Generation] = []
        self._generations = 0
        self._restart_thread: threading.Thread | None = None
        self._tmpdir: tempfile.TemporaryDirectory[str] | None = None
        self._config_path: Path | None = None
        self._started = False
        self._stopped = False
        self._fatal: str | None = None
        # wall_of(sim) = anchor_wall + (sim - anchor_sim) / speed
        first = self._arrivals[0] if requests else 0.0
        self._anchor: tuple[float, float] = (time.time(), first)
        self._tick_s = max(1e-4, TICK_WALL_S * self.speed)
        self._loop_index = 0
        self._loop_offset_s = 0.0
        self._next_index = 0
        self._last_sim_s = first
        self.lag_resyncs = 0
        self.lag_total_s = 0.0

    # ------------------------------------------------------------------ public

    @property
    def port(self) -> int:
        return self._http.port

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def adaptive_config_path(self) -> Path | None:
        """The ``--speculative-adaptive-config`` file the engine was launched with."""
        return self._config_path

    @property
    def generation(self) -> int:
        """0 for the first start, +1 per restart."""
        return -1 if self._gen is None else self._gen.index

    def results(self) -> list[EngineResult]:
        """The engine's measurements of every replay that ran to the end (one per loop
        of the trace), across restarts; summarise with specgov.simulator.metrics. A run
        cut short by a restart or stop() has none."""
        gens = list(self._done_generations)
        gen = self._gen
        if gen is not None and gen not in gens:
            gens.append(gen)
        return [r for g in gens for r in g.results]

    def __enter__(self) -> SimServer:
        self.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop()

    def start(self) -> None:
        """Write the adaptive config, build the engine, bind the port, start the engine."""
        with self._lifecycle:
            if self._started:
                raise SimServerError("SimServer.start: already started")
            self._started = True
            try:
                self._write_adaptive_config()
                gen = self._new_generation()
                self._gen = gen
                self._http.start()
            except OSError as exc:
                self._stopped = True
                self._cleanup_files()
                raise SimServerError(
                    f"sim-server on {self.host}:{self._http.port} cannot start: {exc}"
                ) from exc
            except BaseException:
                self._stopped = True
                self._cleanup_files()
                raise
            gen.launch = self._launch_info(gen)
            self._anchor = (time.time(), self._anchor[1])
            self._start_engine(gen)
            logger.info(
                "specgov sim-server: %s at speed %gx, policy %s, on %s",
                gen.launch.model_path,
                self.speed,
                self.policy_name,
                self.url,
            )

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        """Block until ``/health`` would answer 200; TimeoutError after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while not self.healthy:
            if self._fatal is not None:
                raise SimServerError(f"the simulated server failed: {self._fatal}")
            gen = self._gen
            if gen is not None and gen.status == "failed":
                raise SimServerError(f"the simulated engine failed: {gen.error}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"sim-server at {self.url} not ready after {timeout_s} s")
            time.sleep(0.01)

    @property
    def healthy(self) -> bool:
        gen = self._gen
        return (
            not self._stopped
            and not self._stop_event.is_set()
            and self._http.listening
            and self._http.outage_mode is None
            and gen is not None
            and gen.launch is not None
            and gen.status in ("up", "finished")
        )

    def stop(self) -> None:
        """Stop the engine (flushing its last statistics window) and the HTTP front."""
        with self._lifecycle:
            if not self._started or self._stopped:
                return
            self._stopped = True
            self._stop_event.set()
        self._http.end_outage()  # a restart may be waiting out its down window
        restart = self._restart_thread
        if restart is not None:
            restart.join(JOIN_TIMEOUT_S)
        gen = self._gen
        if gen is not None:
            self._stop_generation(gen)
        self._http.stop()
        self._cleanup_files()

    def restart(self, *, down_s: float = 0.0, starting_s: float = 0.0, wait: bool = True) -> None:
        """Restart the simulated server: stop the engine (in-flight requests are lost),
        refuse connections for ``down_s``, answer 503 on /health for ``starting_s``, then
        serve again with fresh counters, a fresh plugin and no overrides. The trace
        continues at the current simulated time."""
        down = _seconds("down_s", down_s)
        starting = _seconds("starting_s", starting_s)
        with self._lifecycle:
            if not self._started or self._stopped:
                raise SimServerError("SimServer.restart: the server is not running")
            if self._restart_thread is not None and self._restart_thread.is_alive():
                raise SimServerError("SimServer.restart: a restart is already in progress")
            if down > 0 and self._http.outage_mode is not None:
                raise SimServerError(
                    f"SimServer.restart: an outage ({self._http.outage_mode}) is in progress"
                )
            thread = threading.Thread(
                target=self._restart_sequence,
                args=(down, starting),
                name="specgov-sim-restart",
                daemon=True,
            )
            self._restart_thread = thread
            thread.start()
        if wait:
            thread.join()

    def pause(self, seconds: float, *, mode: OutageMode = "refuse") -> None:
        """An outage of the HTTP front for ``seconds`` (the engine keeps running):
        ``refuse`` closes the port (connection refused, keep-alive connections
        dropped), ``503`` answers 503 on every SGLang route. Returns once the outage
        is in force; it ends by itself (or at :meth:`resume`)."""
        duration = _seconds("seconds", seconds)
        if mode not in OUTAGE_MODES:
            raise SimServerError(f"mode: expected one of {', '.join(OUTAGE_MODES)}, got {mode!r}")
        if not self._started or self._stopped:
            raise SimServerError("SimServer.pause: the server is not running")
        future = self._http.outage(duration, mode)
        future.add_done_callback(_log_outage_failure)

    def resume(self) -> None:
        """End an outage started by :meth:`pause` early."""
        self._http.end_outage()

    def state(self) -> dict[str, Any]:
        """What the simulated server is doing (``GET /specgov-sim/state``)."""
        gen = self._gen
        return {
            "url": self.url,
            "generation": None if gen is None else gen.index,
            "status": "failed" if self._fatal else (None if gen is None else gen.status),
            "healthy": self.healthy,
            "error": self._fatal or (None if gen is None else gen.error),
            "speed": self.speed,
            "sim_time_s": self._last_sim_s,
            "wall_of_sim_s": self.wall_of(self._last_sim_s),
            "loop": self._loop_index,
            "loop_trace": self.loop_trace,
            "trace_requests": len(self._requests),
            "requests_finished": None if gen is None else gen.metrics.finished,
            "lag_resyncs": self.lag_resyncs,
            "lag_total_s": self.lag_total_s,
            "outage": self._http.outage_mode,
            "outage_until_s": self._http.outage_until_s,
            "policy": self.policy_name,
            "spool_dir": None if self.spool_dir is None else str(self.spool_dir),
            "adaptive_config": None if self._config_path is None else str(self._config_path),
            "plugin": None if gen is None else gen.plugin_state(),
        }

    def wall_of(self, sim_s: float) -> float:
        """Wall-clock epoch seconds at which simulated time ``sim_s`` is (was) served."""
        wall0, sim0 = self._anchor
        return wall0 + (sim_s - sim0) / self.speed

    def sim_of(self, wall_s: float) -> float:
        """Simulated time served at wall-clock epoch ``wall_s``."""
        wall0, sim0 = self._anchor
        return sim0 + (wall_s - wall0) * self.speed

    # ------------------------------------------------------------ generations

    def _write_adaptive_config(self) -> None:
        if not self._adaptive or self._adaptive_raw is None:
            return  # SGLang's default config: no file, speculative_adaptive_config null
        if self.spool_dir is not None:
            folder = self.spool_dir
            folder.mkdir(parents=True, exist_ok=True)
        else:
            self._tmpdir = tempfile.TemporaryDirectory(prefix="specgov-sim-")
            folder = Path(self._tmpdir.name)
        path = folder.resolve() / ADAPTIVE_CONFIG_FILENAME
        data = json.dumps(self._adaptive_raw, indent=2, sort_keys=True).encode() + b"\n"
        atomic_write_bytes(path, data)
        self._config_path = path

    def _cleanup_files(self) -> None:
        if self._tmpdir is not None:
            self._tmpdir.cleanup()
            self._tmpdir = None

    def _writer_id(self, index: int) -> str:
        # A restarted server is a new process to the daemon: a new statistics writer.
        return f"{default_writer_id()[:48]}-g{index}"

    def _scaled_sink(self, writer: BackgroundStatsWriter) -> Callable[[TierStatsSnapshot], object]:
        speed = self.speed

        def submit(snapshot: TierStatsSnapshot) -> bool:
            # The plugin timed each step on the wall-mapped clock (sim_dt / speed).
            tiers = tuple(
                dataclasses.replace(t, step_time_sum_s=t.step_time_sum_s * speed)
                for t in snapshot.tiers
            )
            return writer.submit(dataclasses.replace(snapshot, tiers=tiers))

        return submit

    def _new_generation(self) -> _Generation:
        index = self._generations
        self._generations += 1
        clocks: list[VirtualClock] = []

        def plugin_clock() -> float:
            return self.wall_of(clocks[0].now_s) if clocks else time.time()

        plugin: SpecgovAdaptiveParams | None = None
        writer: BackgroundStatsWriter | None = None
        policy: InEnginePolicy
        if self.policy_name == "specgov-plugin":
            assert self.spool_dir is not None and self._config_path is not None
            writer = BackgroundStatsWriter(self.spool_dir, writer_id=self._writer_id(index))
            plugin = SpecgovAdaptiveParams(
                self.server.spec_steps,
                str(self._config_path),
                spool_dir=self.spool_dir,
                original=None,
                channel_factory=LocalChannel,
                clock=plugin_clock,
                flush_interval_s=self.stats_interval_s,
                stats_writer=self._scaled_sink(writer),
            )
            if plugin.disabled_reason is not None:
                raise SimServerError(
                    f"the specgov plugin disabled itself: {plugin.disabled_reason}"
                )
            built_plugin = plugin
            policy = InEnginePolicy(
                "specgov-plugin",
                True,
                tuple(plugin.candidate_steps),
                lambda _initial: built_plugin,
                adaptive=True,
            )
        elif self.policy_name == "sglang-ema":
            cfg = self._adaptive_cfg
            assert cfg is not None
            policy = InEnginePolicy(
                "sglang-ema",
                True,
                tuple(cfg.candidate_steps),
                lambda initial: EmaPolicy(initial, cfg),
                adaptive=True,
            )
        else:
            policy = parse_policy(self.policy_name)
        prepared = prepare_run(self.server, policy, seed=self.seed, built=self._built)
        clocks.append(prepared.engine.clock)
        ndt = self._num_draft_tokens()
        metrics = _ServedMetrics(
            model_name=f"{ep.SIM_MODEL_PREFIX}{self._built.model.name}",
            kv_capacity_tokens=prepared.memory.kv_token_capacity,
            wall_of=self.wall_of,
            draft_per_round=(ndt - 1) if ndt else self.server.spec_steps,
        )
        return _Generation(index, prepared, metrics, plugin, writer)

    def _num_draft_tokens(self) -> int:
        if self.server.topk == 1 or self.server.num_draft_tokens is None:
            return self.server.spec_steps + 1
        return self.server.num_draft_tokens

    def _launch_info(self, gen: _Generation) -> ep.LaunchInfo:
        mem = gen.prepared.memory
        cfg = gen.engine.config
        graph_bs = gen.engine.cuda_graph_bs
        spool = "" if self.spool_dir is None else f" --spool-dir {self.spool_dir}"
        return ep.LaunchInfo(
            model=self._built.model.name,
            gpu=self._built.gpu.name,
            host=self.host,
            port=self.port,
            kv_capacity_tokens=mem.kv_token_capacity,
            effective_max_running_requests=cfg.running_cap,
            chunked_prefill_size=cfg.chunked_prefill_size,
            mem_fraction_static=mem.mem_fraction_static,
            weight_gib=mem.target_weights_gib,
            kv_cache_gib=mem.kv_pool_gib,
            graph_gib=mem.cuda_graph_total_gib,
            total_gib=mem.total_gib,
            drafter=self._built.drafter.name,
            speculative_algorithm=self._algorithm,
            speculative_num_steps=self.server.spec_steps,
            speculative_eagle_topk=self.server.topk,
            speculative_num_draft_tokens=self._num_draft_tokens(),
            speculative_adaptive=self._adaptive,
            speculative_adaptive_config=(
                None if self._config_path is None else str(self._config_path)
            ),
            max_running_requests=self.server.max_running_requests,
            cuda_graph_max_bs=cfg.cuda_graph_max_bs,
            decode_cuda_graph_bs=None if graph_bs is None else tuple(graph_bs),
            launch_command=f"specgov sim-server --port {self.port} --speed {self.speed:g}{spool}",
            api_key_set=self._api_key is not None,
            startup_time={"load_weight": 0.0, "kv_cache_allocation": 0.0},
        )

    def _start_engine(self, gen: _Generation) -> None:
        gen.status = "up"
        thread = threading.Thread(
            target=self._run_generation,
            args=(gen,),
            name=f"specgov-sim-engine-{gen.index}",
            daemon=True,
        )
        gen.thread = thread
        thread.start()

    def _stop_generation(self, gen: _Generation) -> None:
        gen.stop_event.set()
        thread = gen.thread
        if thread is not None:
            thread.join(JOIN_TIMEOUT_S)
            if thread.is_alive():
                logger.error("specgov sim-server: engine thread %d did not stop", gen.index)
        elif gen.status == "starting":
            gen.status = "stopped"
            self._flush_generation(gen)

    def _restart_sequence(self, down_s: float, starting_s: float) -> None:
        try:
            old = self._gen
            if old is not None:
                self._stop_generation(old)
                self._done_generations.append(old)
            if down_s > 0:
                try:
                    self._http.outage(down_s, "refuse").result()
                except concurrent.futures.CancelledError:
                    pass  # ended early (resume() or stop())
                except SimServerError as exc:
                    logger.warning("specgov sim-server: restart without a down window: %s", exc)
            if self._stop_event.is_set():
                return
            gen = self._new_generation()
            gen.launch = self._launch_info(gen)
            # Requests in flight died with the old server; those arriving from now on
            # reach the new one.
            self._next_index = 0
            self._gen = gen
            if starting_s > 0 and self._stop_event.wait(starting_s):
                return
            if not self._stop_event.is_set():
                self._fatal = None
                self._start_engine(gen)
        except Exception as exc:
            self._fatal = f"restart failed: {type(exc).__name__}: {exc}"
            logger.exception("specgov sim-server: restart failed")

    def _take_requests(self, t_sim: float) -> list[Request]:
        """Requests of the current loop arriving at or after ``t_sim`` not yet handed to
        an engine, shifted onto the simulated timeline; the next loop when exhausted."""
        reqs = self._requests
        n = len(reqs)
        if n == 0:
            return []
        offset = self._loop_offset_s
        i = max(self._next_index, bisect.bisect_left(self._arrivals, t_sim - offset))
        if i >= n:
            if not self.loop_trace:
                self._next_index = n
                return []
            self._loop_index += 1
            offset = max(offset + self._period_s, t_sim - self._arrivals[0])
            self._loop_offset_s = offset
            i = 0
        self._next_index = n
        if offset == 0.0:
            return list(reqs[i:])
        return [dataclasses.replace(r, arrival_s=r.arrival_s + offset) for r in reqs[i:]]

    def _run_generation(self, gen: _Generation) -> None:
        def tick(now_sim: float) -> None:
            self._on_tick(gen, now_sim)

        try:
            t = max(self.sim_of(time.time()), self._last_sim_s) if gen.index else self._anchor[1]
            while not gen.stop_event.is_set():
                reqs = self._take_requests(t)
                if not reqs:
                    break
                first = reqs[0].arrival_s
                if first > t:
                    gen.metrics.mark_idle(t)
                    self._pace(gen, first)
                gen.engine.clock.now_s = first
                result = gen.engine.run(
                    reqs, metrics=gen.metrics, on_tick=tick, tick_interval_s=self._tick_s
                )
                gen.results.append(result)
                t = result.end_s
                self._last_sim_s = t
            gen.metrics.mark_idle(t)
            gen.status = "finished"
        except _Stopped:
            gen.status = "stopped"
        except Exception as exc:
            gen.status = "failed"
            gen.error = f"{type(exc).__name__}: {exc}"
            logger.exception("specgov sim-server: the simulated engine failed")
        finally:
            self._flush_generation(gen)

    def _flush_generation(self, gen: _Generation) -> None:
        plugin = gen.plugin
        if plugin is not None and plugin.policy is not None:
            plugin.policy.flush()  # the last window, on the engine's own thread
        if gen.writer is not None and not gen.writer.close():
            logger.warning("specgov sim-server: statistics writer did not finish in time")

    def _on_tick(self, gen: _Generation, now_sim: float) -> None:
        if gen.stop_event.is_set():
            raise _Stopped
        self._last_sim_s = now_sim
        metrics = gen.metrics
        if metrics.forwards == gen.tick_forwards:
            # Two ticks without a forward: the engine is jumping over an idle gap.
            metrics.mark_idle(now_sim)
        gen.tick_forwards = metrics.forwards
        self._pace(gen, now_sim)

    def _pace(self, gen: _Generation, sim_s: float) -> None:
        """Hold the engine until the wall clock reaches ``wall_of(sim_s)``."""
        delay = self.wall_of(sim_s) - time.time()
        if delay > 0:
            if gen.stop_event.wait(delay):
                raise _Stopped
        elif delay < -MAX_LAG_S:
            # Behind: re-anchor so timestamps stay close to the wall clock.
            self.lag_resyncs += 1
            self.lag_total_s += -delay
            wall0, sim0 = self._anchor
            self._anchor = (wall0 - delay, sim0)

    # -------------------------------------------------------------------- HTTP

    def _make_app(self) -> web.Application:
        @web.middleware
        async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
            admin = request.path.startswith(ADMIN_PREFIX + "/")
            if self._http.outage_mode == "503" and not admin:
                return web.Response(status=503)
            if not ep.auth_allowed(
                method=request.method,
                path=request.path,
                authorization=request.headers.get("Authorization"),
                api_key=self._api_key,
            ):
                return web.json_response({"error": "Unauthorized"}, status=401)
            return await handler(request)

        app = web.Application(middlewares=[guard], client_max_size=MAX_BODY_BYTES)
        r = app.router
        for path in ("/health", "/health_generate"):
            r.add_get(path, self._h_health)
        r.add_get("/ready", self._h_ready)
        r.add_get("/metrics", self._h_metrics)
        r.add_get("/server_info", self._h_server_info)
        r.add_get("/get_server_info", self._h_server_info)
        r.add_get("/model_info", self._h_model_info)
        r.add_get("/get_model_info", self._h_model_info)
        r.add_get("/v1/loads", self._h_loads)
        r.add_route("POST", "/set_internal_state", self._h_set_internal_state)
        r.add_route("PUT", "/set_internal_state", self._h_set_internal_state)
        if self._admin_routes:
            r.add_get(f"{ADMIN_PREFIX}/state", self._h_admin_state)
            r.add_post(f"{ADMIN_PREFIX}/restart", self._h_admin_restart)
            r.add_post(f"{ADMIN_PREFIX}/outage", self._h_admin_outage)
        return app

    def _serving(self) -> tuple[_Generation, ep.LaunchInfo] | None:
        gen = self._gen
        if gen is None or gen.launch is None or self._stop_event.is_set():
            return None
        return gen, gen.launch

    async def _h_health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.healthy else 503)

    async def _h_ready(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.healthy else 503)

    async def _h_metrics(self, request: web.Request) -> web.Response:
        serving = self._serving()
        if serving is None:
            return web.Response(status=503)
        body = serving[0].metrics.render()
        return web.Response(body=body, headers={"Content-Type": ep.PROMETHEUS_CONTENT_TYPE})

    async def _h_server_info(self, request: web.Request) -> web.Response:
        serving = self._serving()
        if serving is None:
            return web.Response(status=503)
        gen, launch = serving
        return web.json_response(ep.server_info_body(launch, gen.metrics.snapshot()))

    async def _h_model_info(self, request: web.Request) -> web.Response:
        serving = self._serving()
        if serving is None:
            return web.Response(status=503)
        return web.json_response(ep.model_info_body(serving[1]))

    async def _h_loads(self, request: web.Request) -> web.Response:
        serving = self._serving()
        if serving is None:
            return web.Response(status=503)
        gen, launch = serving
        query = request.query
        dp_rank: int | None = None
        raw_rank = query.get("dp_rank")
        if raw_rank is not None:
            try:
                dp_rank = int(raw_rank)
            except ValueError:
                message = f"query.dp_rank: Input should be a valid integer, got {raw_rank!r}"
                return web.json_response(ep.error_response(message), status=400)
        include = query.get("include")
        live = gen.metrics.snapshot()
        try:
            if query.get("format") == "prometheus":
                text = ep.loads_prometheus_text(launch, live, include=include, dp_rank=dp_rank)
                return web.Response(
                    body=text.encode(), headers={"Content-Type": ep.PROMETHEUS_CONTENT_TYPE}
                )
            body = ep.loads_body(launch, live, include=include, dp_rank=dp_rank, now_s=time.time())
        except ep.InvalidIncludeError as exc:
            # SGLang raises this outside the endpoint's try: an unhandled 500.
            logger.warning("specgov sim-server: /v1/loads: %s", exc)
            return web.Response(status=500, text="Internal Server Error")
        return web.json_response(body)

    async def _h_set_internal_state(self, request: web.Request) -> web.Response:
        serving = self._serving()
        if serving is None:
            return web.Response(status=503)
        gen, launch = serving
        try:
            raw = await request.json()
        except ValueError as exc:
            message = f"body: expected JSON {{'server_args': {{key: number}}}} ({exc})"
            return web.json_response(ep.error_response(message), status=400)
        try:
            requested = ep.parse_set_internal_state(raw)
        except ep.RequestBodyError as exc:
            return web.json_response(ep.error_response(str(exc)), status=400)
        outcome = ep.decide_set_internal_state(requested, launch)
        if outcome.updated:
            gen.metrics.apply_overrides(outcome.overrides, reset_spec=outcome.reset_spec_stats)
            logger.info("specgov sim-server: config updated: %s", dict(outcome.overrides))
        else:
            logger.warning("specgov sim-server: %s", outcome.rejection)
        return web.json_response([outcome.updated])

    async def _h_admin_state(self, request: web.Request) -> web.Response:
        return web.json_response(self.state())

    async def _admin_body(self, request: web.Request) -> dict[str, Any]:
        if not request.can_read_body:
            return {}
        try:
            body = await request.json()
        except ValueError as exc:
            raise SimServerError(f"body: expected a JSON object ({exc})") from None
        if not isinstance(body, dict):
            raise SimServerError(f"body: expected a JSON object, got {body!r}")
        return body

    async def _h_admin_restart(self, request: web.Request) -> web.Response:
        previous = self.generation
        try:
            body = await self._admin_body(request)
            unknown = set(body) - {"down_s", "starting_s"}
            if unknown:
                raise SimServerError(
                    f"body: unknown keys {sorted(unknown)} (expected down_s, starting_s)"
                )
            self.restart(
                down_s=body.get("down_s", 0.0), starting_s=body.get("starting_s", 0.0), wait=False
            )
        except SimServerError as exc:
            return web.json_response({"error": str(exc)}, status=400)
        return web.json_response({"restarting": True, "previous_generation": previous}, status=202)

    async def _h_admin_outage(self, request: web.Request) -> web.Response:
        try:
            body = await self._admin_body(request)
            unknown = set(body) - {"seconds", "mode"}
            if unknown or "seconds" not in body:
                raise SimServerError(
                    'body: expected {"seconds": S, "mode": "refuse"|"503"}, got ' + repr(body)
                )
            mode = body.get("mode", "refuse")
            if mode not in OUTAGE_MODES:
                raise SimServerError(f"mode: expected one of {', '.join(OUTAGE_MODES)}")
            self.pause(body["seconds"], mode=mode)
        except SimServerError as exc:
            return web.json_response({"error": str(exc)}, status=400)
        return web.json_response({"outage": body.get("mode", "refuse")}, status=202)


def _seconds(name: str, value: object) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value < 0
    ):
        raise SimServerError(f"{name}: expected a finite number of seconds >= 0, got {value!r}")
    return float(value)


def _log_outage_failure(future: concurrent.futures.Future[None]) -> None:
    if future.cancelled():
        return
    exc = future.exception()
    if exc is not None:
        logger.error("specgov sim-server: outage failed: %s", exc)


# ----------------------------------------------------------------------- blocking run


def serve(
    sim: SimServer,
    *,
    on_ready: Callable[[SimServer], None] | None = None,
    stop_event: threading.Event | None = None,
    ready_timeout_s: float = 60.0,
) -> int:
    """Start ``sim`` and block until SIGINT / SIGTERM (or ``stop_event``), then stop it
    cleanly. Signal handlers are installed only on the main thread and restored after.
    Returns the exit status (0)."""
    stop = stop_event if stop_event is not None else threading.Event()
    previous: dict[signal.Signals, Any] = {}

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        stop.set()

    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, on_signal)
    try:
        sim.start()
        sim.wait_ready(ready_timeout_s)
        if on_ready is not None:
            on_ready(sim)
        while not stop.wait(0.25):
            pass
    finally:
        sim.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0


def load_trace_arg(text: str, *, seed: int = 0) -> Trace:
    """``synthetic[:...]`` (see specgov.simulator.synthetic) or a trace file path."""
    from specgov.simulator.synthetic import generate_trace, parse_synthetic_spec
    from specgov.simulator.traces import load_trace

    if text == "synthetic" or text.startswith("synthetic:"):
        return generate_trace(parse_synthetic_spec(text))
    return load_trace(Path(text), seed=seed)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m specgov.simulator.sim_server``: serve a trace until Ctrl-C."""
    parser = argparse.ArgumentParser(
        prog="specgov-sim-server", description="A simulated SGLang 0.5.23 server."
    )
    parser.add_argument("--trace", default="synthetic:demo", help="trace file or synthetic:...")
    parser.add_argument("--speed", type=float, default=1.0, help="simulated s per wall s")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT)
    parser.add_argument("--spool-dir", default=None, help="run the specgov plugin on DIR")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--loop", action="store_true", help="replay the trace forever")
    parser.add_argument("--gpu", default=ServerSpec.gpu)
    parser.add_argument("--model", default=ServerSpec.model)
    parser.add_argument("--drafter", default=ServerSpec.drafter)
    parser.add_argument("--spec-steps", type=int, default=ServerSpec.spec_steps)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        trace = load_trace_arg(args.trace, seed=args.seed)
        spec = ServerSpec(
            gpu=args.gpu, model=args.model, drafter=args.drafter, spec_steps=args.spec_steps
        )
        sim = SimServer(
            trace,
            spec,
            speed=args.speed,
            spool_dir=args.spool_dir,
            host=args.host,
            port=args.port,
            seed=args.seed,
            loop_trace=args.loop,
        )

        def ready(server: SimServer) -> None:
            print(f"specgov sim-server ready on {server.url}", flush=True)

        return serve(sim, on_ready=ready)
    except (ValueError, OSError) as exc:
        print(f"specgov sim-server: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
