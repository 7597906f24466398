"""Fault injection against the daemon and the plugin (issue 9 §7), in virtual time.

The daemon runs over a recorded closed-loop replay: each tick's ``/metrics`` text and the
plugin's statistics windows come from a simulated server driven by specgov's goodput
policy, served to the daemon's own SGLang client over ``httpx.MockTransport`` (a real
aiohttp server on loopback for the slow-response case) with the daemon's wall clock,
monotonic clock and the client's sleep all injected. A fault is a change of what the
fake server answers: connection refused, 5xx, a connection dropped mid-body, a slow
answer, a restart between two requests of one scrape, a 10-minute outage, a garbled
body, a clock step. Each test asserts what the daemon records (audit rows), publishes
(the spool file as the plugin's reader sees it), reports (status, health) and counts
(its Prometheus metrics) — never only that nothing crashed.

The plugin's side (torn, stale and future-version tables, clock steps) drives
``SpecgovAdaptiveParams`` through its ``clock`` seam, with EmaPolicy as SGLang's
controller (the contract tests show they answer alike).
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from prometheus_client import CollectorRegistry

from specgov.adapters.sglang_http import SGLangClient
from specgov.adapters.sglang_plugin import SpecgovAdaptiveParams
from specgov.adapters.spool_stats import write_tier_stats
from specgov.adapters.spool_table import SpoolTableReader, write_step_table
from specgov.adapters.telemetry import METRICS_READ
from specgov.adapters.tp_sync import LocalChannel
from specgov.controller.daemon.config import load_config
from specgov.controller.daemon.runtime import Daemon
from specgov.controller.daemon.state_store import StateStore
from specgov.policies.common.decisions import ReasonCode
from specgov.policies.common.observation import Observation
from specgov.policies.common.step_table import TABLE_SCHEMA, StepTable
from specgov.policies.common.types import TierStatsSnapshot
from specgov.policies.control.core import AuditRecord, ControlInputs, CoreState
from specgov.policies.engine.ema import EmaPolicy
from specgov.policies.guardrails import GuardrailConfig
from specgov.simulator.engine.cost import CostModel
from specgov.simulator.priors import step_cost_prior
from specgov.simulator.replay.closed_loop import ControlLoopConfig
from specgov.simulator.replay.metrics import Slo
from specgov.simulator.replay.runner import (
    ServerSpec,
    parse_policy,
    prepare_run,
    resolve,
    specgov_adaptive_config,
    specgov_server_info,
)
from specgov.simulator.workload.synthetic import generate_trace
from specgov.simulator.workload.synthetic_text import parse_synthetic_spec

GUARD = GuardrailConfig()  # the daemon runs with the defaults
HOLDS = {ReasonCode.HELD_STALE_TELEMETRY.value, ReasonCode.HELD_UNKNOWN_TELEMETRY.value}
RETRIES = 1  # each scrape request is tried twice


# ----------------------------------------------------------------- the recording


@dataclass
class Recording:
    """What a simulated server served at each decision tick of a closed-loop replay."""

    times: list[float] = field(default_factory=list)
    texts: list[bytes] = field(default_factory=list)
    stats: list[tuple[TierStatsSnapshot, ...]] = field(default_factory=list)
    kv_capacity: int = 0
    spec_steps: int = 3


def _record_replay() -> Recording:
    server = ServerSpec(gpu="h100", model="llama-3.1-8b", drafter="eagle3")
    # One scrape per decision: the harness below scrapes the daemon once before each.
    cadence = ControlLoopConfig(scrape_interval_s=ControlLoopConfig().interval_s)
    run = prepare_run(server, parse_policy("goodput"), seed=3, slo=Slo(), loop_config=cadence)
    loop, metrics = run.loop, run.metrics
    assert loop is not None and metrics is not None
    rec = Recording(kv_capacity=run.memory.kv_token_capacity, spec_steps=server.spec_steps)
    observe = loop.observe

    def recording_observe(now_s: float) -> Observation | None:
        obs = observe(now_s)
        rec.times.append(now_s)
        # What the simulated server would serve now (replay reads its snapshot).
        rec.texts.append(metrics.render_families(METRICS_READ))
        return obs

    decide = loop.core.decide

    def recording_decide(state: CoreState, inputs: ControlInputs, timer: Any = None) -> Any:
        rec.stats.append(inputs.tier_stats)
        return decide(state, inputs, timer)

    loop.core.decide = recording_decide  # type: ignore[method-assign]
    loop.observe = recording_observe
    trace = generate_trace(parse_synthetic_spec("synthetic:duration=240,rate=6,seed=5"))
    run.run(trace.requests)
    assert len(rec.times) == len(rec.stats) >= 40, "the trace must outlast the tests"
    return rec


@pytest.fixture(scope="module")
def rec() -> Recording:
    return _record_replay()


# ------------------------------------------------------------------- the harness


class Clock:
    """The daemon's wall clock and monotonic clock, the client's and the plugin's."""

    def __init__(self, now_s: float = 0.0) -> None:
        self.now_s = now_s

    def __call__(self) -> float:
        return self.now_s


class NoSleep:
    """The client's backoff sleep: recorded, never waited."""

    def __init__(self) -> None:
        self.delays: list[float] = []

    async def __call__(self, seconds: float) -> None:
        self.delays.append(seconds)


# A fault: None (answer), "refused" (nothing listening), "reset" (the connection drops
# before the body is complete), or an HTTP status code.
Fault = str | int | None


class FakeServer:
    """SGLang's routes over one recording: ``/metrics`` serves ``text``; ``fault``
    (and ``faults_by_path``) turns answers into failures. Every request is logged."""

    def __init__(self, server_info: dict[str, Any]) -> None:
        self.server_info = server_info
        self.text: bytes = b""
        self.fault: Fault = None
        self.faults_by_path: dict[str, Fault] = {}
        self.garble: Callable[[bytes], bytes] | None = None  # what /metrics turns into
        self.requests: list[str] = []

    def answer(self, path: str) -> tuple[int, bytes]:
        """(status, body), or raises the transport error of the fault."""
        self.requests.append(path)
        fault = self.faults_by_path.get(path, self.fault)
        if fault == "refused":
            raise httpx.ConnectError("[Errno 111] Connection refused")
        if fault == "reset":
            raise httpx.RemoteProtocolError(
                "peer closed connection without sending complete message body"
            )
        if isinstance(fault, int):
            return fault, b"upstream trouble"
        if path == "/metrics":
            return 200, self.text if self.garble is None else self.garble(self.text)
        if path == "/server_info":
            return 200, json.dumps(self.server_info).encode()
        return 404, b'{"detail": "Not Found"}'  # no /v1/loads: gauges suffice

    def handler(self, request: httpx.Request) -> httpx.Response:
        code, body = self.answer(request.url.path)
        return httpx.Response(code, content=body, headers={"Content-Type": "text/plain"})

    def count(self, path: str) -> int:
        return self.requests.count(path)


class Harness:
    """A daemon (real store, spool and client) over a :class:`FakeServer`."""

    def __init__(
        self,
        rec: Recording,
        tmp: Path,
        *,
        base_url: str = "http://sglang.test",
        transport: httpx.AsyncBaseTransport | None = None,
        timeout_s: float = 5.0,
        **config: Any,
    ) -> None:
        self.rec = rec
        self.spool = tmp / "spool"
        self.spool.mkdir(mode=0o700)
        adaptive = tmp / "adaptive.json"
        adaptive.write_text(json.dumps(specgov_adaptive_config()))
        info = specgov_server_info(
            algorithm="EAGLE3", spec_steps=rec.spec_steps, kv_capacity=rec.kv_capacity
        )
        info["speculative_adaptive_config"] = str(adaptive)
        self.server = FakeServer(info)
        self.clock = Clock(rec.times[0])
        # The monotonic clock follows the wall clock except across a wall-clock step:
        # ``stepped_s`` is the sum of the steps a test made.
        self.mono = Clock(rec.times[0])
        self.stepped_s = 0.0
        self.sleep = NoSleep()
        self.client = SGLangClient(
            base_url,
            rng=random.Random(0),
            transport=transport or httpx.MockTransport(self.server.handler),
            retries=RETRIES,
            timeout_s=timeout_s,
            clock=self.clock,
            sleep=self.sleep,
        )
        slo = Slo()
        self.config = load_config(
            None,
            env={},
            overrides={
                "server.url": base_url,
                "spool.dir": str(self.spool),
                "state.db_path": str(tmp / "state.db"),
                "loop.mode": "plugin",
                "policy.spec": "goodput",
                "budget.slo_tpot_ms": slo.tpot_ms,
                "budget.slo_ttft_p99_ms": slo.ttft_ms,
                **config,
            },
        )
        catalog = resolve(ServerSpec())
        prior = step_cost_prior(CostModel.from_catalog(catalog.gpu, catalog.model, catalog.drafter))
        self.store = StateStore(self.config.state.db_path)
        self.registry = CollectorRegistry()
        self.daemon = Daemon(
            self.config,
            store=self.store,
            registry=self.registry,
            client=self.client,
            clock=self.clock,
            monotonic=self.mono,
            prior=prior,
        )
        self.records: list[AuditRecord] = []
        self._seq = 0

    async def tick(
        self, i: int, *, offset_s: float = 0.0, stats: bool = True, jump_to_s: float | None = None
    ) -> AuditRecord:
        """One decision interval: tick ``i`` of the recording, ``offset_s`` later (or
        at ``jump_to_s``): the plugin's windows written, one scrape, one decision."""
        shift = offset_s if jump_to_s is None else jump_to_s - self.rec.times[i]
        self.clock.now_s = self.rec.times[i] + shift
        self.mono.now_s = self.clock.now_s - self.stepped_s
        self.server.text = self.rec.texts[i]
        if stats:
            for snap in self.rec.stats[i]:
                moved = replace(
                    snap,
                    window_start_s=snap.window_start_s + shift,
                    window_end_s=snap.window_end_s + shift,
                )
                self._seq += 1
                write_tier_stats(self.spool, moved, writer_id="rank0", seq=self._seq)
        await self.daemon.scrape_once()
        self.daemon._mark_tick()  # what the decide loop's step does first
        record = self.daemon.decide_once()
        self.records.append(record)
        return record

    async def until_published(self, max_ticks: int = 20) -> int:
        """Ticks from 0 until the first table is published; the next tick's index."""
        for i in range(max_ticks):
            if (await self.tick(i)).published:
                return i + 1
        raise AssertionError(f"no table in {max_ticks} ticks: {self.daemon.status()}")

    async def close(self) -> None:
        await self.daemon.close()
        self.store.close()

    # What the operator and the engine see.

    def metric(self, name: str, **labels: str) -> float:
        value = self.registry.get_sample_value(name, labels)
        return 0.0 if value is None else value

    def scrape_errors(self) -> dict[str, float]:
        return {
            kind: self.metric("specgov_scrape_errors_total", kind=kind)
            for kind in ("temporary", "permanent", "format")
        }

    def candidates(self) -> list[int]:
        doc = json.loads((self.spool / "step_table.json").read_text())
        return list(doc["candidate_steps"])

    def plugin_view(self, clock: Callable[[], float] | None = None) -> SpoolTableReader:
        """A fresh plugin reader of the spool (judging expiry at ``clock``), polled once."""
        reader = SpoolTableReader(self.spool, self.candidates(), clock or self.clock)
        reader()
        return reader

    def stored_rows(self) -> list[Any]:
        return self.store.decisions(limit=10_000)


def _run(h: Harness, body: Callable[[], Any]) -> None:
    async def go() -> None:
        try:
            await body()
        finally:
            await h.close()

    asyncio.run(go())


def _slots(table: StepTable | None) -> Any:
    return None if table is None else table.slots


# ------------------------------------------------- 1. refused, 5xx, dropped body

FAULT_TEXT = {
    "refused": "connection failed",
    "reset": "peer closed connection",
    500: "500",
    502: "502",
    503: "503",
}


@pytest.mark.parametrize("fault", list(FAULT_TEXT), ids=str)
def test_a_temporary_fault_holds_the_table_keeps_health_and_recovers(
    rec: Recording, tmp_path: Path, fault: Fault, caplog: pytest.LogCaptureFixture
) -> None:
    h = Harness(rec, tmp_path)
    caplog.set_level(logging.INFO, logger="specgov.daemon")
    fault_ticks = 5  # 25 s: past max_staleness_s (10 s), within the health bound (60 s)

    async def body() -> None:
        i = await h.until_published()
        in_force = h.daemon.core_state.table
        assert in_force is not None
        metrics_before = h.server.count("/metrics")
        h.server.fault = fault
        during = [await h.tick(i + k) for k in range(fault_ticks)]
        status = h.daemon.status()

        # Recorded as temporary, retried, never taken for a permanent error.
        assert FAULT_TEXT[fault] in (status["last_scrape_error"] or ""), status
        assert status["permanent_error"] is None
        assert status["scrape_errors"] == fault_ticks
        assert h.scrape_errors() == {"temporary": fault_ticks, "permanent": 0, "format": 0}
        assert h.server.count("/metrics") - metrics_before == fault_ticks * (RETRIES + 1)
        # Every decision is in the audit log; once the telemetry is stale each one holds
        # the table in force, and no decision changes the steps.
        assert len(h.stored_rows()) == len(h.records)
        stale = [r for r in during if r.inputs_summary["staleness_s"] > GUARD.max_staleness_s]
        assert len(stale) >= 2
        assert all(r.reason == ReasonCode.HELD_STALE_TELEMETRY.value for r in stale), stale
        assert all(_slots(r.table_in_force) == in_force.slots for r in during)
        # The engine keeps following the held table (re-issued before its TTL).
        view = h.plugin_view()
        assert view.last_reason is None and _slots(view()) == in_force.slots
        # 25 s without telemetry is within the bound: still ready, alive.
        assert h.daemon.health()["ok"] is True and h.daemon.liveness()["ok"] is True
        # One warning for the burst, not one per failed scrape.
        warned = [r for r in caplog.records if "telemetry unavailable" in r.getMessage()]
        assert len(warned) == 1 and warned[0].levelno == logging.WARNING

        h.server.fault = None
        after = [await h.tick(i + fault_ticks + k) for k in range(3)]
        status = h.daemon.status()
        assert status["last_scrape_error"] is None and status["last_scrape_age_s"] == 0.0
        assert any("telemetry available again" in r.getMessage() for r in caplog.records)
        assert h.scrape_errors()["temporary"] == fault_ticks  # nothing more counted
        assert after[-1].reason not in HOLDS, after[-1]
        assert after[-1].inputs_summary["staleness_s"] <= GUARD.max_staleness_s

    _run(h, body)


# ------------------------------------------------------------ 2. a 10-minute outage


def test_a_ten_minute_outage_freezes_then_lets_the_table_expire_and_control_resumes(
    rec: Recording, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    h = Harness(rec, tmp_path)
    caplog.set_level(logging.INFO, logger="specgov.daemon")
    outage_s, step_s = 600.0, 5.0
    bound_s = h.daemon.telemetry_max_age_s

    async def body() -> None:
        i = await h.until_published()
        for _ in range(3):
            await h.tick(i)
            i += 1
        in_force = h.daemon.core_state.table
        assert in_force is not None
        last_fresh_s = h.clock()
        # The server is down: nothing listens, and its plugin writes no statistics.
        h.server.fault = "refused"
        during: list[AuditRecord] = []
        ready: list[tuple[float, bool, list[str]]] = []
        followed: list[tuple[float, bool]] = []
        for n in range(1, int(outage_s / step_s) + 1):
            during.append(await h.tick(i, jump_to_s=last_fresh_s + n * step_s, stats=False))
            health = h.daemon.health()
            ready.append((n * step_s, bool(health["ok"]), list(health["reasons"])))
            assert h.daemon.liveness()["ok"] is True  # the loop ticks: never restart it
            followed.append((n * step_s, h.plugin_view().last_reason is None))
        status = h.daemon.status()

        # Every decision recorded, each one holding the steps in force.
        assert len(h.stored_rows()) == len(h.records)
        assert all(r.reason in HOLDS for r in during), {r.reason for r in during}
        assert all(_slots(r.table_in_force) == in_force.slots for r in during)
        # The held table is re-issued before its TTL for frozen_keepalive_s after the
        # last fresh telemetry, then left to expire: the engine falls back to SGLang's
        # own controller instead of following a table nobody is watching.
        reissued = [r.time_s - last_fresh_s for r in during if r.published]
        assert reissued and max(reissued) <= GUARD.frozen_keepalive_s
        assert len(reissued) >= GUARD.frozen_keepalive_s / (GUARD.table_ttl_s / 2) - 1
        keep_until_s = GUARD.frozen_keepalive_s + GUARD.table_ttl_s
        assert all(ok for t, ok in followed if t < GUARD.frozen_keepalive_s)
        assert not any(ok for t, ok in followed if t >= keep_until_s)
        assert h.plugin_view().last_reason == "expired"
        # Ready while the telemetry is within its bound, then 503 saying why.
        assert all(ok for t, ok, _ in ready if t <= bound_s)
        late = [reasons for t, ok, reasons in ready if t > bound_s]
        assert late and all(reasons for reasons in late)
        assert not any(ok for t, ok, _ in ready if t > bound_s)
        assert late[-1] == [
            f"no telemetry for {outage_s:.0f} s (bound {bound_s:g} s): "
            f"{status['last_scrape_error']}"
        ]
        # Counted, and logged once a minute with the count of what was held back.
        n_scrapes = len(during)
        assert h.scrape_errors() == {"temporary": n_scrapes, "permanent": 0, "format": 0}
        assert status["permanent_error"] is None and status["last_scrape_age_s"] == outage_s
        lines = [m for r in caplog.records if "telemetry unavailable" in (m := r.getMessage())]
        # 10 minutes at one line a minute (the first line, then one per 60 s).
        assert outage_s / 60 - 1 <= len(lines) <= outage_s / 60 + 1
        assert "similar message(s) suppressed" in lines[-1]
        suppressed = h.metric("specgov_log_lines_suppressed_total", kind="scrape-temporary")
        assert suppressed == n_scrapes - len(lines)

        # The server is back: fresh telemetry, ready again, a table the engine follows.
        h.server.fault = None
        after: list[AuditRecord] = []
        for k in range(8):
            after.append(await h.tick(i + k, offset_s=outage_s))
            if after[-1].published and after[-1].reason not in HOLDS:
                break
        assert after[-1].published and after[-1].reason not in HOLDS, [r.message for r in after]
        assert after[-1].table_after is not None
        assert after[-1].table_after.produced_at_s == h.clock()
        assert h.daemon.health()["ok"] is True, h.daemon.health()
        assert h.daemon.status()["last_scrape_error"] is None
        view = h.plugin_view()
        assert view.last_reason is None and _slots(view()) == after[-1].table_after.slots
        assert h.scrape_errors()["temporary"] == n_scrapes

    _run(h, body)


# -------------------------------------------------- 3. a restart in mid-scrape


def test_a_server_restart_between_two_requests_of_a_scrape(rec: Recording, tmp_path: Path) -> None:
    h = Harness(rec, tmp_path)

    async def body() -> None:
        i = await h.until_published()
        for _ in range(3):
            await h.tick(i)
            i += 1
        in_force = h.daemon.core_state.table
        assert in_force is not None
        last_scrape_s = h.clock()  # the last tick's scrape succeeded
        # The old server answers /metrics, then goes away before /v1/loads.
        h.server.faults_by_path["/v1/loads"] = "refused"
        half = await h.tick(i)
        status = h.daemon.status()
        assert (
            "/v1/loads" in status["last_scrape_error"]
            and "connection failed" in (status["last_scrape_error"])
        )
        # The half scrape is dropped whole: the telemetry in use is the previous one.
        assert status["last_scrape_age_s"] == h.clock() - last_scrape_s
        assert h.scrape_errors() == {"temporary": 1, "permanent": 0, "format": 0}
        assert _slots(half.table_in_force) == in_force.slots

        # The restarted server: every counter from zero again (the recording's start).
        h.server.faults_by_path.clear()
        offset_s = h.clock() + 5.0 - rec.times[0]
        first = await h.tick(0, offset_s=offset_s)
        info_before = h.server.count("/server_info")
        # Counters went down: the window is unknown (never a negative rate), the table
        # held, and the server's shape is fetched again at once, not in 30 s.
        assert first.reason in HOLDS, first
        assert first.inputs_summary.get("generation_tokens") is None
        assert _slots(first.table_in_force) == in_force.slots
        await h.tick(1, offset_s=offset_s)
        assert h.server.count("/server_info") == info_before + 1
        await h.tick(2, offset_s=offset_s)
        assert h.server.count("/server_info") == info_before + 1  # then every 30 s again
        # Then control resumes on the new server's telemetry.
        for k in range(3, 16):
            r = await h.tick(k, offset_s=offset_s)
            if r.reason not in HOLDS and r.published:
                break
        assert r.reason not in HOLDS and r.published, h.records[-3:]
        rows = h.stored_rows()
        assert len(rows) == len(h.records)
        gen = [row.inputs_summary.get("generation_tokens") for row in rows]
        assert all(g is None or g >= 0 for g in gen)
        assert h.daemon.status()["last_scrape_error"] is None
        view = h.plugin_view()
        assert view.last_reason is None and r.table_after is not None
        assert _slots(view()) == r.table_after.slots

    _run(h, body)


# --------------------------------------------------- 4. slow past the timeout


def test_an_answer_slower_than_the_timeout_is_a_temporary_error_that_never_stalls(
    rec: Recording, tmp_path: Path
) -> None:
    timeout_s = 0.3

    async def body() -> None:
        gate = asyncio.Event()
        slow = {"on": False}
        holder: dict[str, FakeServer] = {}

        async def handle(request: web.Request) -> web.Response:
            if slow["on"] and request.path == "/metrics":
                await gate.wait()  # past the client's timeout
            code, payload = holder["server"].answer(request.path)
            return web.Response(status=code, body=payload, content_type="text/plain")

        app = web.Application()
        app.router.add_route("GET", "/{tail:.*}", handle)
        server = TestServer(app, host="127.0.0.1")
        await server.start_server()
        h = Harness(
            rec,
            tmp_path,
            base_url=str(server.make_url("")).rstrip("/"),
            transport=httpx.AsyncHTTPTransport(),  # real sockets: the timeout is httpx's
            timeout_s=timeout_s,
        )
        holder["server"] = h.server
        try:
            i = await h.until_published()
            in_force = h.daemon.core_state.table
            slow["on"] = True
            started = time.monotonic()
            held = await h.tick(i)
            waited_s = time.monotonic() - started
            # Both attempts ran into the timeout; the round ended, the decision was made.
            assert (RETRIES + 1) * timeout_s * 0.9 <= waited_s < 30.0
            status = h.daemon.status()
            assert f"timed out after {timeout_s:g} s" in status["last_scrape_error"], status
            assert status["permanent_error"] is None
            assert h.scrape_errors() == {"temporary": 1, "permanent": 0, "format": 0}
            assert len(h.stored_rows()) == len(h.records)
            assert in_force is not None and _slots(held.table_in_force) == in_force.slots
            slow["on"] = False
            gate.set()
            await h.tick(i + 1)
            assert h.daemon.status()["last_scrape_error"] is None
            assert h.daemon.status()["last_scrape_age_s"] == 0.0
        finally:
            gate.set()
            await h.close()
            await server.close()

    asyncio.run(body())


# ------------------------------------------------------ 5. a garbled /metrics body


def _cut(text: bytes) -> bytes:
    """The body cut inside a label set, as a dropped connection leaves it."""
    head = text[: len(text) // 2]
    return head.rsplit(b"{", 1)[0] + b'{tp_rank="0"'


def _garbage(text: bytes) -> bytes:
    return b"\x00\x1b[31m\rnot prometheus text\n" * 3


@pytest.mark.parametrize("garble", [_cut, _garbage], ids=["cut", "garbage"])
def test_a_garbled_body_is_temporary_and_keeps_the_table_alive_as_long_as_an_outage(
    rec: Recording, tmp_path: Path, garble: Callable[[bytes], bytes]
) -> None:
    # Issue 9: a garbled body was permanent: publishing stopped and the table expired
    # after 30 s, while a real outage keeps it for frozen_keepalive_s.
    h = Harness(rec, tmp_path)

    async def body() -> None:
        i = await h.until_published()
        in_force = h.daemon.core_state.table
        assert in_force is not None
        last_fresh_s = h.clock()
        h.server.garble = garble
        followed: list[tuple[float, bool]] = []
        during: list[AuditRecord] = []
        for n in range(1, 35):  # 170 s
            during.append(await h.tick(i + n, jump_to_s=last_fresh_s + 5.0 * n))
            followed.append((5.0 * n, h.plugin_view().last_reason is None))
        status = h.daemon.status()
        assert status["permanent_error"] is None, status["permanent_error"]
        assert (status["last_scrape_error"] or "").startswith("malformed response: ")
        assert h.scrape_errors()["permanent"] == 0
        assert all(r.reason in HOLDS for r in during if r.time_s - last_fresh_s > 10.0)
        assert all(_slots(r.table_in_force) == in_force.slots for r in during)
        # Held and re-issued exactly as through an outage, then left to expire.
        assert all(ok for t, ok in followed if t < GUARD.frozen_keepalive_s)
        # The guard's freeze starts at its last decision on fresh telemetry.
        fresh_s = max(r.time_s for r in h.records if r.reason not in HOLDS) - last_fresh_s
        reissued = [r.time_s - last_fresh_s for r in during if r.published]
        assert max(reissued) > GUARD.table_ttl_s
        assert max(reissued) <= fresh_s + GUARD.frozen_keepalive_s
        expired_from = fresh_s + GUARD.frozen_keepalive_s + GUARD.table_ttl_s
        assert not any(ok for t, ok in followed if t >= expired_from)
        assert h.plugin_view().last_reason == "expired"
        assert h.daemon.health()["ok"] is False
        assert h.daemon.health()["telemetry"] is False

        h.server.garble = None
        await h.tick(i + 35, jump_to_s=last_fresh_s + 175.0)
        assert h.daemon.status()["last_scrape_error"] is None

    _run(h, body)


def test_a_garbled_body_is_counted_under_kind_format(rec: Recording, tmp_path: Path) -> None:
    # Issue 9: it was counted as "permanent" while kind="format" never moved.
    h = Harness(rec, tmp_path)

    async def body() -> None:
        i = await h.until_published()
        h.server.garble = _cut
        for k in range(3):
            await h.tick(i + k)
        assert h.scrape_errors() == {"temporary": 0, "permanent": 0, "format": 3}

    _run(h, body)


# -------------------------------------------------- 6. clock steps at the daemon


def test_a_forward_clock_step_at_the_daemon_republishes_at_once_for_the_new_time(
    rec: Recording, tmp_path: Path
) -> None:
    h = Harness(rec, tmp_path)
    step_s = 3600.0

    async def body() -> None:
        i = await h.until_published()
        await h.tick(i)
        before = h.daemon.core_state.table
        assert before is not None
        # The wall clock (daemon and server host alike) steps an hour forward.
        h.stepped_s += step_s
        after = [await h.tick(i + 1, offset_s=step_s)]
        # The table from before the step is expired for the plugin on the new time; by
        # the next decision interval (operations.md) one dated on the new time is out.
        assert before.is_expired(h.clock())
        if not after[0].published:
            after.append(await h.tick(i + 2, offset_s=step_s))
        published = after[-1]
        assert published.published and published.table_after is not None
        assert published.table_after.produced_at_s == h.clock()
        view = h.plugin_view()
        assert view.last_reason is None and _slots(view()) == published.table_after.slots
        status = h.daemon.status()
        assert status["last_scrape_error"] is None and status["table_age_s"] == 0.0
        assert h.daemon.health()["ok"] is True and h.daemon.liveness()["ok"] is True
        for k in range(3, 6):
            r = await h.tick(i + k, offset_s=step_s)
            assert r.time_s == h.clock() and r.reason not in HOLDS, r
        assert h.scrape_errors() == {"temporary": 0, "permanent": 0, "format": 0}
        assert len(h.stored_rows()) == len(h.records)

    _run(h, body)


def test_a_backward_clock_step_at_the_daemon_keeps_control_and_republishes(
    rec: Recording, tmp_path: Path
) -> None:
    h = Harness(rec, tmp_path)
    step_s = -3600.0

    async def body() -> None:
        i = await h.until_published()
        await h.tick(i)
        # docs/operations.md, "Clock jumps": the table is re-issued with the new time.
        h.stepped_s += step_s
        first = await h.tick(i + 1, offset_s=step_s)
        status = h.daemon.status()
        assert status["last_scrape_error"] is None, status["last_scrape_error"]
        assert h.scrape_errors() == {"temporary": 0, "permanent": 0, "format": 0}
        assert first.published and first.table_after is not None
        assert first.table_after.produced_at_s == h.clock()
        view = h.plugin_view()
        assert view.last_reason is None and _slots(view()) == first.table_after.slots
        # Control goes on with windows on the new time base.
        later = [await h.tick(i + k, offset_s=step_s) for k in range(2, 6)]
        assert later[-1].reason not in HOLDS, later[-1]
        assert h.daemon.status()["last_scrape_age_s"] == 0.0
        assert len(h.stored_rows()) == len(h.records)

    _run(h, body)


def test_no_decision_acts_on_a_window_that_spans_a_forward_clock_step(
    rec: Recording, tmp_path: Path
) -> None:
    h = Harness(rec, tmp_path)
    step_s = 3600.0

    async def body() -> None:
        i = await h.until_published()
        before = await h.tick(i)
        throughput = before.inputs_summary["gen_throughput_tok_s"]
        assert throughput is not None and throughput > 0
        h.stepped_s += step_s
        first = await h.tick(i + 1, offset_s=step_s)
        # Either the window across the step is unknown (held), or it measured the 5 s
        # that really passed: never an hour's dilution.
        measured = first.inputs_summary["gen_throughput_tok_s"]
        assert first.reason in HOLDS or (measured or 0.0) > throughput / 10, (
            first.reason,
            measured,
            throughput,
        )
        assert not first.changed

    _run(h, body)


# ------------------------------------ 7. the plugin: bad tables and clock steps

GRAPHS = [1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 24, 32, 48, 64, 96, 128, 256]
PLUGIN_CANDIDATES = [0, 1, 3, 5, 7]  # SGLang's default adaptive config
POLL = 8
BATCH_S = 0.01  # fake time per decode batch


class Engine:
    """A decode loop driving the plugin and SGLang's controller (EmaPolicy: the
    contract tests show it answers call for call like SGLang's class) side by side."""

    def __init__(self, spool: Path, clock: Clock, seed: int = 5) -> None:
        self.clock = clock
        self.plugin = SpecgovAdaptiveParams(
            3,
            None,
            spool_dir=spool,
            original=None,
            channel_factory=LocalChannel,
            clock=clock,
            poll_every_batches=POLL,
            stats_writer=None,
        )
        self.sglang = EmaPolicy(3)
        self.plugin.set_cuda_graph_bs(GRAPHS)
        self.sglang.set_cuda_graph_bs(GRAPHS)
        self.rng = random.Random(seed)

    def run(self, polls: int) -> list[tuple[int, int, int]]:
        """``polls`` poll intervals of batches: (padded batch size, plugin's steps,
        SGLang's steps) for each."""
        out = []
        for _ in range(polls * POLL):
            batch_size = self.rng.randint(1, 64)
            ours = self.plugin.get_steps_for_batch(batch_size)
            theirs = self.sglang.get_steps_for_batch(batch_size)
            out.append((_pad(batch_size), ours, theirs))
            accepted = [min(ours, self.rng.randint(0, ours)) for _ in range(batch_size)]
            self.plugin.on_verify_complete(accepted, batch_size)
            self.sglang.on_verify_complete(accepted, batch_size)
            self.clock.now_s += BATCH_S
        return out

    @property
    def reader(self) -> SpoolTableReader:
        reader = self.plugin.reader
        assert reader is not None and self.plugin.mode == "table"
        return reader


def _pad(batch_size: int) -> int:
    return next(g for g in GRAPHS if g >= batch_size)


def _follows(calls: list[tuple[int, int, int]], table: StepTable) -> bool:
    return all(ours == table.steps_for(padded) for padded, ours, _ in calls)


def _like_sglang(calls: list[tuple[int, int, int]]) -> bool:
    return all(ours == theirs for _, ours, theirs in calls)


def _plugin_table(version: int, at_s: float, ttl_s: float = 30.0) -> StepTable:
    return StepTable(((1, 5), (8, 1), (32, 0)), version=version, produced_at_s=at_s, ttl_s=ttl_s)


def test_the_plugin_answers_like_sglang_on_torn_stale_and_future_tables_and_follows_good_ones(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    spool = tmp_path / "spool"
    spool.mkdir(mode=0o700)
    clock = Clock(1_700_000_000.0)
    engine = Engine(spool, clock)
    caplog.set_level(logging.INFO, logger="specgov.adapters.spool")
    table_file = spool / "step_table.json"

    def good(version: int) -> StepTable:
        table = _plugin_table(version, clock())
        write_step_table(spool, table, PLUGIN_CANDIDATES)
        return table

    first = good(1)
    assert _follows(engine.run(4), first)
    valid = table_file.read_bytes()

    # Torn: someone else's partial write (specgov's writer renames whole files).
    table_file.write_bytes(valid[: len(valid) // 2])
    assert _like_sglang(engine.run(4)) and engine.reader.last_reason == "torn"
    second = good(2)
    assert _follows(engine.run(4), second)

    # A newer daemon's schema: not guessed at, SGLang's controller answers.
    document = json.loads(table_file.read_text())
    table_file.write_text(
        json.dumps({**document, "schema": TABLE_SCHEMA + 1, "field_of_the_future": True})
    )
    assert _like_sglang(engine.run(4)) and engine.reader.last_reason == "future_version"
    third = good(3)
    assert _follows(engine.run(4), third)

    # Stale: a table that expired before it was read (the daemon stopped long ago).
    write_step_table(spool, _plugin_table(4, clock() - 100.0), PLUGIN_CANDIDATES)
    assert _like_sglang(engine.run(4)) and engine.reader.last_reason == "expired"
    fifth = good(5)
    assert _follows(engine.run(1), fifth)

    ignored = engine.reader.ignored
    assert ignored["torn"] == ignored["future_version"] == ignored["expired"] == 4
    assert engine.plugin.errors == 0
    warned = {r.getMessage() for r in caplog.records if r.levelno == logging.WARNING}
    assert any("(torn:" in m for m in warned)
    assert any("(future_version:" in m and "upgrade specgov" in m for m in warned)


def test_plugin_clock_steps_expire_or_keep_tables_and_a_new_table_is_followed_at_once(
    tmp_path: Path,
) -> None:
    spool = tmp_path / "spool"
    spool.mkdir(mode=0o700)
    clock = Clock(1_700_000_000.0)
    engine = Engine(spool, clock)
    before = _plugin_table(1, clock())
    write_step_table(spool, before, PLUGIN_CANDIDATES)
    assert _follows(engine.run(4), before)

    # Forward past the TTL: expired at the next poll, the engine runs SGLang's controller;
    # the daemon's next table (dated on the new time) is followed at the next poll.
    clock.now_s += 3600.0
    assert _like_sglang(engine.run(4)) and engine.reader.last_reason == "expired"
    after = _plugin_table(2, clock())
    write_step_table(spool, after, PLUGIN_CANDIDATES)
    assert _follows(engine.run(4), after)

    # Backward (daemon and server on one host step together): the daemon's next table,
    # dated on the earlier time, is followed, not refused as from the future.
    clock.now_s -= 7200.0
    earlier = _plugin_table(3, clock())
    write_step_table(spool, earlier, PLUGIN_CANDIDATES)
    assert _follows(engine.run(4), earlier) and engine.reader.last_reason is None

    # A table dated further ahead than the TTL cap (the daemon's clock an hour fast).
    write_step_table(spool, _plugin_table(4, clock() + 3600.0), PLUGIN_CANDIDATES)
    assert _like_sglang(engine.run(4)) and engine.reader.last_reason == "future_dated"
    assert engine.plugin.errors == 0


def test_a_backward_clock_step_at_the_plugin_does_not_extend_a_tables_life(
    tmp_path: Path,
) -> None:
    spool = tmp_path / "spool"
    spool.mkdir(mode=0o700)
    clock = Clock(1_700_000_000.0)
    engine = Engine(spool, clock)
    table = _plugin_table(1, clock(), ttl_s=30.0)
    write_step_table(spool, table, PLUGIN_CANDIDATES)
    assert _follows(engine.run(4), table)
    # The clock steps an hour back, and the daemon publishes nothing more (it died).
    clock.now_s -= 3600.0
    polls = int(table.ttl_s / (POLL * BATCH_S)) + 1  # the TTL's worth of batches
    engine.run(polls)
    assert _like_sglang(engine.run(4)) and engine.reader.last_reason == "expired"
