"""The simulated SGLang server: the discrete-event engine in accelerated real time
behind an HTTP front that speaks SGLang 0.5.23's endpoints (DESIGN.md, "Simulator").

A specgov daemon pointed at :class:`SimServer` sees what it would see from SGLang (the
routes: :mod:`~specgov.simulator.server.routes`, their bodies:
:mod:`~specgov.simulator.server.endpoints`, the metrics:
:mod:`~specgov.simulator.server.served_metrics`). Only ``/model_info`` (``model_path``
starting with ``specgov-sim:``) tells it apart. How simulated time maps onto the wall
clock, and which view gets which: :mod:`~specgov.simulator.server.driver`. The command
line (``specgov sim-server``): :mod:`~specgov.simulator.server.cli`.

This module assembles one server and owns its lifecycle. The parts:

* :mod:`~specgov.simulator.server.launch`: what the launch fixes (deployment, adaptive
  config file, in-engine policy) and how each (re)start is built;
* :mod:`~specgov.simulator.server.driver`: the engine thread of one (re)start
  (:class:`~specgov.simulator.server.driver.Generation`), the trace feed and the
  simulated/wall time map;
* :mod:`~specgov.simulator.server.http_front`: the HTTP server on its own thread and
  asyncio loop, with outages;
* :mod:`~specgov.simulator.server.routes`: the SGLang routes;
* :mod:`~specgov.simulator.server.controls`: the fault controls over HTTP
  (``/specgov-sim/...``), :class:`SimServerError`.

Which in-engine policy the engine runs (specgov's plugin on a spool, SGLang's EMA, or
static steps) is decided by the launch (:mod:`~specgov.simulator.server.launch`).

Lifecycle. :meth:`SimServer.start` binds the port (``/health`` answers 503 until the
engine runs), :meth:`~SimServer.wait_ready`, :meth:`~SimServer.stop` (joins every
thread, flushes the last statistics window). When the trace ends the engine idles and
the server keeps serving idle metrics, or, with ``loop_trace=True``, replays the trace
again (one mean inter-arrival gap later). For end-to-end tests: :meth:`~SimServer.restart`
is a server restart (in-flight requests lost, counters reset, a fresh plugin instance
re-reading the spool, overrides gone; optionally refusing connections for ``down_s``
and answering 503 on ``/health`` for ``starting_s``), :meth:`~SimServer.pause` an outage
of the HTTP front only (connections refused, or 503 on every route) while the engine
keeps serving. The same controls are HTTP routes under ``/specgov-sim/``
(:mod:`~specgov.simulator.server.controls`) so a test can drive a sim-server in another
process.

Threads: the engine thread, the HTTP thread, the statistics writer, and during a
restart the restart sequence.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from aiohttp import web

from specgov.policies.common.validation import is_int, is_real
from specgov.policies.engine.table import DEFAULT_FLUSH_INTERVAL_S
from specgov.simulator.engine.interface import EngineResult
from specgov.simulator.replay.runner import ServerSpec
from specgov.simulator.server import endpoints as ep
from specgov.simulator.server.controls import (
    OutageMode,
    SimServerError,
    check_outage_mode,
    check_seconds,
)
from specgov.simulator.server.driver import ENGINE_JOIN_TIMEOUT_S, Generation, RealTime, TraceFeed
from specgov.simulator.server.http_front import HttpFront
from specgov.simulator.server.launch import Launch
from specgov.simulator.server.live import LiveFeed
from specgov.simulator.server.routes import make_app
from specgov.simulator.server.served_metrics import ServedMetrics
from specgov.simulator.workload.traces import Request, Trace

__all__ = ["SimServer", "SimServerError"]  # SimServerError: the error its methods raise

logger = logging.getLogger(__name__)


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
        stats_interval_s: float = DEFAULT_FLUSH_INTERVAL_S,
        speculative: bool = True,
    ) -> None:
        _check_options(speed, stats_interval_s, port, host, api_key)
        requests = _sorted_requests(trace)
        self.server = server if server is not None else ServerSpec()
        self.speed = float(speed)
        self.stats_interval_s = float(stats_interval_s)
        self.spool_dir = None if spool_dir is None else Path(spool_dir)
        self.host = host
        self.seed = seed
        self._api_key = api_key
        self._admin_routes = admin_routes
        self._feed = TraceFeed(requests, loop=loop_trace)
        self._clock = RealTime(self.speed, self._feed.first_arrival_s)

        self._adaptive_config = adaptive_config
        self._launch = self._new_launch(self.server, speculative)
        # What the launch runs (SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND applied).
        self.server = self._launch.server
        self.policy_name = self._launch.policy_name

        self._http = HttpFront(self._make_app, host, port)
        self._lifecycle = threading.Lock()
        self._stop_event = threading.Event()
        self._gen: Generation | None = None
        self._done_generations: list[Generation] = []
        self._generations = 0
        self._restart_thread: threading.Thread | None = None
        self._started = False
        self._stopped = False
        self._fatal: str | None = None

    # ------------------------------------------------------------------ public

    @property
    def loop_trace(self) -> bool:
        return self._feed.loop

    @property
    def lag_resyncs(self) -> int:
        """How often the engine fell behind the wall clock and the time map was shifted."""
        return self._clock.lag_resyncs

    @property
    def lag_total_s(self) -> float:
        return self._clock.lag_total_s

    @property
    def port(self) -> int:
        return self._http.port

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def speculative_algorithm(self) -> str | None:
        """SGLang's ``--speculative-algorithm`` of this launch (the drafter's); None: plain."""
        return self._launch.algorithm

    @property
    def adaptive_config_path(self) -> Path | None:
        """The ``--speculative-adaptive-config`` file the engine was launched with."""
        return self._launch.config_path

    @property
    def generation(self) -> int:
        """0 for the first start, +1 per restart."""
        return -1 if self._gen is None else self._gen.index

    def results(self) -> list[EngineResult]:
        """The engine's measurements of every replay that ran to the end (one per loop
        of the trace), across restarts; summarise with specgov.simulator.replay.metrics. A run
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
                self._launch.write_adaptive_config()
                gen = self._new_generation()
                self._gen = gen
                self._http.start()
            except OSError as exc:
                self._stopped = True
                self._launch.cleanup()
                raise SimServerError(
                    f"sim-server on {self.host}:{self._http.port} cannot start: {exc}"
                ) from exc
            except BaseException:
                self._stopped = True
                self._launch.cleanup()
                raise
            gen.launch = self._launch_info(gen)
            self._clock.anchor_now()
            gen.start(self._feed, self._clock)
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
            restart.join(ENGINE_JOIN_TIMEOUT_S)
        gen = self._gen
        if gen is not None:
            gen.stop()
        self._http.stop()
        self._launch.cleanup()

    def restart(
        self,
        *,
        down_s: float = 0.0,
        starting_s: float = 0.0,
        wait: bool = True,
        speculative: bool | None = None,
    ) -> None:
        """Restart the simulated server: stop the engine (in-flight requests are lost),
        refuse connections for ``down_s``, answer 503 on /health for ``starting_s``, then
        serve again with fresh counters, a fresh plugin and no overrides. The trace
        continues at the current simulated time. ``speculative``: relaunch speculative
        (the drafter's algorithm) or plain (``--speculative-algorithm NONE``), as a fleet
        restarts a replica in the other mode; None keeps this launch's mode."""
        down = check_seconds("down_s", down_s)
        starting = check_seconds("starting_s", starting_s)
        if speculative is not None and not isinstance(speculative, bool):
            raise SimServerError(f"speculative: expected true or false, got {speculative!r}")
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
                args=(time.monotonic() + down, starting, speculative),
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
        duration = check_seconds("seconds", seconds)
        mode = check_outage_mode(mode)
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
        clock = self._clock
        path = self._launch.config_path
        return {
            "url": self.url,
            "generation": None if gen is None else gen.index,
            "status": "failed" if self._fatal else (None if gen is None else gen.status),
            "healthy": self.healthy,
            "error": self._fatal or (None if gen is None else gen.error),
            "speed": self.speed,
            "sim_time_s": clock.last_sim_s,
            "wall_of_sim_s": clock.wall_of(clock.last_sim_s),
            "loop": self._feed.loop_index,
            "loop_trace": self.loop_trace,
            "trace_requests": len(self._feed.requests),
            "requests_finished": None if gen is None else gen.metrics.finished,
            "lag_resyncs": clock.lag_resyncs,
            "lag_total_s": clock.lag_total_s,
            "outage": self._http.outage_mode,
            "outage_until_s": self._http.outage_until_s,
            "policy": self.policy_name,
            "server": self._launch.summary(),
            "seed": self.seed,
            "spool_dir": None if self.spool_dir is None else str(self.spool_dir),
            "adaptive_config": None if path is None else str(path),
            "plugin": None if gen is None else gen.plugin_state(),
        }

    def wall_of(self, sim_s: float) -> float:
        """Wall-clock epoch seconds at which simulated time ``sim_s`` is (was) served."""
        return self._clock.wall_of(sim_s)

    def sim_of(self, wall_s: float) -> float:
        """Simulated time served at wall-clock epoch ``wall_s``."""
        return self._clock.sim_of(wall_s)

    def live_feed(self) -> LiveFeed | None:
        """The running generation's feed of client requests; None while none is up."""
        gen = self._gen
        if gen is None or gen.launch is None or self._stop_event.is_set():
            return None
        return gen.live

    def serving(self) -> tuple[ServedMetrics, ep.LaunchInfo] | None:
        """The running generation's metrics and launch; None before start, after stop,
        and between a restart's stop and its new launch."""
        gen = self._gen
        if gen is None or gen.launch is None or self._stop_event.is_set():
            return None
        return gen.metrics, gen.launch

    # ------------------------------------------------------------ generations

    def _new_generation(self) -> Generation:
        index = self._generations
        self._generations += 1
        gen = self._launch.new_generation(index, self._clock)
        gen.live = LiveFeed(self._clock, label=f"g{index}")
        return gen

    def _launch_info(self, gen: Generation) -> ep.LaunchInfo:
        return self._launch.launch_info(
            gen, host=self.host, port=self.port, api_key_set=self._api_key is not None
        )

    def _new_launch(self, server: ServerSpec, speculative: bool) -> Launch:
        return Launch(
            server,
            spool_dir=self.spool_dir,
            adaptive_config=self._adaptive_config,
            seed=self.seed,
            speed=self.speed,
            stats_interval_s=self.stats_interval_s,
            speculative=speculative,
        )

    def _relaunch(self, speculative: bool) -> None:
        """The launch of a restart in the other mode (the old engine has stopped): its
        algorithm, KV pool and policy are the new mode's, as a relaunched SGLang's."""
        old = self._launch
        self._launch = self._new_launch(old.server, speculative)
        self.server = self._launch.server
        self.policy_name = self._launch.policy_name
        old.cleanup()
        self._launch.write_adaptive_config()

    def _restart_sequence(
        self, down_until: float, starting_s: float, speculative: bool | None
    ) -> None:
        """Stop the engine, refuse connections until ``down_until`` (monotonic; the down
        window counts from the restart's request, and the new engine is built inside it,
        as a relaunched server builds its own within its start-up), then serve."""
        try:
            old = self._gen
            if old is not None:
                old.stop()
                self._done_generations.append(old)
            outage: concurrent.futures.Future[None] | None = None
            down_s = down_until - time.monotonic()
            if down_s > 0:
                try:
                    outage = self._http.outage(down_s, "refuse")
                except SimServerError as exc:
                    logger.warning("specgov sim-server: restart without a down window: %s", exc)
            if speculative is not None and speculative != self._launch.speculative:
                self._relaunch(speculative)
            gen = self._new_generation()
            gen.launch = self._launch_info(gen)
            if outage is not None:
                # Ended early (resume() or stop()): cancelled.
                with contextlib.suppress(concurrent.futures.CancelledError):
                    outage.result()
            if self._stop_event.is_set():
                return
            self._feed.rewind()
            self._gen = gen
            if starting_s > 0 and self._stop_event.wait(starting_s):
                return
            if not self._stop_event.is_set():
                self._fatal = None
                gen.start(self._feed, self._clock)
        except Exception as exc:
            self._fatal = f"restart failed: {type(exc).__name__}: {exc}"
            logger.exception("specgov sim-server: restart failed")

    def _make_app(self) -> web.Application:
        return make_app(
            self,
            api_key=self._api_key,
            outage_mode=lambda: self._http.outage_mode,
            controls=self if self._admin_routes else None,
        )


def _log_outage_failure(future: concurrent.futures.Future[None]) -> None:
    if future.cancelled():
        return
    exc = future.exception()
    if exc is not None:
        logger.error("specgov sim-server: outage failed: %s", exc)


def _check_options(
    speed: float, stats_interval_s: float, port: int, host: str, api_key: str | None
) -> None:
    """SimServer's scalar options, each against the form it expects."""
    if not is_real(speed) or speed <= 0:
        raise SimServerError(f"speed: expected a finite number > 0, got {speed!r}")
    if not is_real(stats_interval_s) or stats_interval_s <= 0:
        raise SimServerError(
            f"stats_interval_s: expected a finite number of seconds > 0, got {stats_interval_s!r}"
        )
    if not is_int(port) or not 0 <= port <= 65535:
        raise SimServerError(f"port: expected an int in [0, 65535], got {port!r}")
    if not isinstance(host, str) or not host:
        raise SimServerError(f"host: expected a host name or address, got {host!r}")
    if api_key is not None and (not isinstance(api_key, str) or not api_key):
        raise SimServerError("api_key: expected a non-empty string or None")


def _sorted_requests(trace: Trace | Sequence[Request]) -> tuple[Request, ...]:
    """The trace's requests, each a Request, in arrival order (or SimServerError)."""
    requests = tuple(trace.requests if isinstance(trace, Trace) else trace)
    for i, req in enumerate(requests):
        if not isinstance(req, Request):
            raise SimServerError(f"trace: item {i} is a {type(req).__name__}, expected a Request")
        if i and req.arrival_s < requests[i - 1].arrival_s:
            raise SimServerError(
                f"trace: requests must be sorted by arrival_s (request {i} at "
                f"{req.arrival_s} s comes after one at {requests[i - 1].arrival_s} s)"
            )
    return requests
