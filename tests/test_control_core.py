"""One control core: the daemon and closed-loop replay decide alike from the same inputs.

A closed-loop replay runs a goodput policy on a simulated server through a scripted
sequence: two telemetry gaps, a failed publish, an operator override set and cleared,
and a permanent telemetry error. Every tick's /metrics text and plugin windows are
recorded. The real daemon then runs over exactly those inputs — the /metrics text
served over (mock) HTTP to its own SGLang client, the plugin windows written into its
spool, the step table written to a spool file that is made unwritable for the failed
publish, the override set and cleared through its API methods, an HTTP 401 for the
permanent error — and must make the same decisions: same reasons, same tables, same
publish outcomes, in the same order.
"""

from __future__ import annotations

import asyncio
import json
import random
import shutil
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
import pytest

from specgov.adapters.sglang_http import SGLangClient
from specgov.adapters.spool_stats import write_tier_stats
from specgov.adapters.telemetry import METRICS_READ
from specgov.controller.daemon.config import load_config
from specgov.controller.daemon.runtime import Daemon
from specgov.controller.daemon.state_store import StateStore
from specgov.policies.common.decisions import ReasonCode, RestartTrigger
from specgov.policies.common.observation import Observation
from specgov.policies.common.step_table import StepTable
from specgov.policies.common.types import Budget, TierStatsSnapshot
from specgov.policies.control.core import (
    NOT_PUBLISHED_OBSERVE,
    AuditRecord,
    ControlCore,
    ControlInputs,
    CoreState,
    Publish,
    control_step,
    policy_builder,
)
from specgov.policies.guardrails import GuardrailConfig, Override
from specgov.simulator.engine.cost import CostModel
from specgov.simulator.priors import step_cost_prior
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

INTERVAL_S = 5.0
SCRAPES_PER_DECISION = 5  # the daemon's defaults: scrape every 1 s, decide every 5 s
GAPS = {8, 9}  # telemetry unavailable (HTTP 503 for the daemon)
FAILED_PUBLISH = {3, 4}  # the spool write fails (twice in a row, where tables change)
OVERRIDE_SET, OVERRIDE_CLEARED = 18, 24
BLOCKED = {30, 31}  # permanent telemetry error (HTTP 401 for the daemon)
TICKS = 40
PERMANENT = "SGLang rejected the API key (HTTP 401)"


@dataclass
class Recording:
    times: list[float] = field(default_factory=list)
    texts: list[bytes | None] = field(default_factory=list)
    stats: list[tuple[TierStatsSnapshot, ...]] = field(default_factory=list)
    records: list[AuditRecord] = field(default_factory=list)
    override: Override | None = None
    decide_times: list[float] = field(default_factory=list)  # the scrapes decided on
    kv_capacity: int = 0
    spec_steps: int = 3
    algorithm: str = "EAGLE3"


def _tick_of(now_s: float) -> int:
    return round(now_s / INTERVAL_S)


def _record_replay() -> Recording:
    server = ServerSpec(gpu="h100", model="llama-3.1-8b", drafter="eagle3")
    run = prepare_run(server, parse_policy("goodput"), seed=3, slo=Slo())
    loop, metrics = run.loop, run.metrics
    assert loop is not None and metrics is not None
    rec = Recording(kv_capacity=run.memory.kv_token_capacity, spec_steps=server.spec_steps)
    observe = loop.observe

    def scripted_observe(now_s: float) -> Observation | None:
        tick = _tick_of(now_s)
        rec.times.append(now_s)
        if tick in GAPS or tick in BLOCKED:
            rec.texts.append(None)
            return None
        # Replay reads the simulated server's snapshot; the daemon gets the text of the
        # same moment to scrape and parse: the decisions must still be the same.
        rec.texts.append(metrics.render_families(METRICS_READ))
        return observe(now_s)

    def overrides(now_s: float) -> tuple[Override, ...]:
        tick = _tick_of(now_s)
        if not OVERRIDE_SET <= tick < OVERRIDE_CLEARED:
            return ()
        if rec.override is None:
            rec.override = Override(
                slot=1,
                steps=0,
                created_at_s=now_s,
                expires_at_s=now_s + 600.0,
                reason="differential test",
            )
        return (rec.override,)

    decide = loop.core.decide

    def recording_decide(state: CoreState, inputs: ControlInputs, timer: Any = None) -> Any:
        rec.stats.append(inputs.tier_stats)  # the plugin windows this decision reads
        rec.decide_times.append(inputs.now_s)
        return decide(state, inputs, timer)

    loop.core.decide = recording_decide  # type: ignore[method-assign]
    loop.observe = scripted_observe
    loop.overrides = overrides
    loop.blocked = lambda now_s: PERMANENT if _tick_of(now_s) in BLOCKED else None
    loop.publish_hook = lambda now_s, _table: _tick_of(now_s) not in FAILED_PUBLISH
    trace = generate_trace(parse_synthetic_spec("synthetic:duration=240,rate=6,seed=5"))
    run.run(trace.requests)
    rec.records = list(loop.records)
    assert len(rec.records) >= TICKS, "the trace must outlast the script"
    return rec


@pytest.fixture(scope="module")
def recording() -> Recording:
    return _record_replay()


class Clock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def _daemon_decisions(rec: Recording, tmp: Path) -> list[AuditRecord]:
    spool = tmp / "spool"
    spool.mkdir()
    adaptive = tmp / "adaptive.json"
    adaptive.write_text(json.dumps(specgov_adaptive_config()))
    info = specgov_server_info(
        algorithm=rec.algorithm, spec_steps=rec.spec_steps, kv_capacity=rec.kv_capacity
    )
    info["speculative_adaptive_config"] = str(adaptive)
    clock = Clock()
    current: dict[str, Any] = {"text": None, "tick": 0}

    def handler(request: httpx.Request) -> httpx.Response:
        tick = current["tick"]
        if tick in BLOCKED:
            return httpx.Response(401, text="unauthorized")
        if request.url.path == "/metrics":
            if current["text"] is None:
                return httpx.Response(503, text="unavailable")
            return httpx.Response(
                200, content=current["text"], headers={"Content-Type": "text/plain"}
            )
        if request.url.path == "/server_info":
            return httpx.Response(200, json=info)
        return httpx.Response(404, text="not found")

    client = SGLangClient(
        "http://sim.test",
        rng=random.Random(0),
        transport=httpx.MockTransport(handler),
        retries=0,
        clock=clock,
    )
    slo = Slo()
    config = load_config(
        None,
        env={},
        overrides={
            "server.url": "http://sim.test",
            "spool.dir": str(spool),
            "state.db_path": str(tmp / "state.db"),
            "loop.mode": "plugin",
            "policy.spec": "goodput",
            "budget.slo_tpot_ms": slo.tpot_ms,
            "budget.slo_ttft_p99_ms": slo.ttft_ms,
        },
    )
    catalog = resolve(ServerSpec())
    prior = step_cost_prior(CostModel.from_catalog(catalog.gpu, catalog.model, catalog.drafter))
    store = StateStore(config.state.db_path)
    daemon = Daemon(config, store=store, client=client, clock=clock, prior=prior)
    table_path = spool / "step_table.json"
    out: list[AuditRecord] = []

    async def go() -> None:
        try:
            # The daemon scrapes at every scrape the replay made and decides on those the
            # replay decided on, as both loops run (simulator/replay/closed_loop.py).
            decided = {t: d for d, t in enumerate(rec.decide_times[:TICKS])}
            for i, now in enumerate(rec.times):
                if len(out) == TICKS:
                    break
                tick = _tick_of(now)
                clock.now_s = now
                current["tick"], current["text"] = tick, rec.texts[i]
                d = decided.get(now)
                if d is None:
                    await daemon.scrape_once()
                    continue
                for seq, snap in enumerate(rec.stats[d]):
                    write_tier_stats(spool, snap, writer_id="rank0", seq=d * 1000 + seq)
                if tick in FAILED_PUBLISH:
                    if table_path.exists():
                        table_path.unlink()
                    table_path.mkdir()  # rename onto a directory fails: the write fails
                await daemon.scrape_once()
                if tick == OVERRIDE_SET:
                    daemon.set_override(
                        slot=1,
                        steps=0,
                        disable=False,
                        pin_policy=None,
                        ttl_s=600.0,
                        reason="differential test",
                    )
                if tick == OVERRIDE_CLEARED:
                    assert daemon.clear_override(None, None) == 1
                out.append(daemon.decide_once())
                if tick in FAILED_PUBLISH:
                    shutil.rmtree(table_path)
        finally:
            await daemon.close()
            store.close()

    asyncio.run(go())
    return out


def _key(r: AuditRecord) -> tuple[Any, ...]:
    after = None if r.table_after is None else (r.table_after.slots, r.table_after.version)
    # The window each decision's rates cover: the daemon's and the replay's builders
    # reach back alike (adapters/observation_builder.py, decision_window_s).
    window = r.inputs_summary.get("window_s")
    window = None if window is None else round(window, 6)
    return (round(r.time_s, 6), r.reason, after, r.published, r.table_in_force, window)


def test_daemon_and_replay_make_the_same_decisions(recording: Recording, tmp_path: Path) -> None:
    replayed = recording.records[:TICKS]
    live = _daemon_decisions(recording, tmp_path)
    assert [_key(r) for r in live] == [_key(r) for r in replayed]
    # The script exercised what it meant to: each event left its mark on the decisions.
    by_tick = {_tick_of(r.time_s): r for r in replayed}
    assert any(r.reason == "initial" and r.published for r in replayed)
    assert by_tick[min(GAPS) + 1].reason in {"held_stale_telemetry", "held_unknown_telemetry"} or (
        by_tick[min(GAPS) + 1].inputs_summary["staleness_s"] >= INTERVAL_S
    )
    failed = [by_tick[t] for t in sorted(FAILED_PUBLISH) if by_tick[t].table_after is not None]
    for r in failed:
        assert not r.published and r.table_in_force != r.table_after
    # The first decision after the disk recovered publishes what the failed ones tried,
    # at once (no dwell or rate limit charged for changes the engine never saw).
    retry = by_tick[max(FAILED_PUBLISH) + 1]
    assert failed and retry.published and retry.table_after is not None
    assert retry.table_after.slots == failed[-1].table_after.slots  # type: ignore[union-attr]
    assert by_tick[OVERRIDE_SET].reason == ReasonCode.OVERRIDE_ACTIVE
    assert by_tick[OVERRIDE_SET].table_in_force is not None
    assert dict(by_tick[OVERRIDE_SET].table_in_force.slots)[1] == 0
    assert "override ended" in by_tick[OVERRIDE_CLEARED].message
    for t in BLOCKED:
        assert not by_tick[t].published


def test_the_script_hits_a_failed_publish(recording: Recording) -> None:
    # The failed-publish tick must carry a table for the retry check above to bite.
    by_tick = {_tick_of(r.time_s): r for r in recording.records}
    failed = [by_tick[t] for t in FAILED_PUBLISH]
    assert any(r.table_after is not None and not r.published for r in failed)


# ------------------------------------------------------------------ core unit tests


class Effects:
    def __init__(self, ok: bool = True) -> None:
        self.ok = ok
        self.published: list[Publish] = []
        self.records: list[AuditRecord] = []
        self.triggers: list[RestartTrigger] = []

    def publish(self, publish: Publish) -> bool:
        self.published.append(publish)
        return self.ok

    def record(self, record: AuditRecord) -> None:
        self.records.append(record)

    def trigger_restart_check(self, trigger: RestartTrigger, record: AuditRecord) -> None:
        self.triggers.append(trigger)


CANDS = ((1, (0, 1, 2, 3)), (8, (0, 1, 2)), (32, (0, 1)))


def _obs(t: float) -> Observation:
    return Observation(
        time_s=t,
        running_requests=4,
        queued_requests=0,
        slot_candidates=CANDS,
        staleness_s=0.5,
        window_s=5.0,
        generation_tokens=1000,
    )


def _core(mode: str = "plugin") -> ControlCore:
    return ControlCore(
        policy_builder(prior=None, guardrails=GuardrailConfig()),
        Budget(None, None, None, None, None),
        mode,  # type: ignore[arg-type]
    )


def _windows(t: float) -> tuple[TierStatsSnapshot, ...]:
    return (TierStatsSnapshot(t - 1.0, t, ()),)


def _step(
    core: ControlCore, state: CoreState, t: float, effects: Effects, **kw: Any
) -> tuple[AuditRecord, CoreState]:
    inputs = ControlInputs(now_s=t, observation=_obs(t), tier_stats=_windows(t), **kw)
    return control_step(core, state, inputs, effects)


def test_pin_runs_the_pinned_policy_and_expiry_returns_to_the_configured_one() -> None:
    core = _core()
    state = core.initial_state("static:2")
    fx = Effects()
    rec, state = _step(core, state, 0.0, fx)
    assert rec.policy == "static:2" and rec.table_in_force is not None
    pin = Override(pin_policy="static:1", created_at_s=1.0, expires_at_s=20.0, reason="try")
    rec, state = _step(core, state, 5.0, fx, overrides=(pin,))
    assert state.policy_spec == "static:1" and rec.policy == "static:1"
    assert rec.table_in_force is not None and {k for _, k in rec.table_in_force.slots} == {1}
    assert "operator pin" in rec.message
    rec, state = _step(core, state, 25.0, fx, overrides=(pin,))  # expired
    assert state.policy_spec == "static:2" and rec.policy == "static:2"
    assert "pin ended" in rec.message


def test_configure_under_a_pin_takes_effect_when_the_pin_ends() -> None:
    core = _core()
    state = core.initial_state("static:2")
    fx = Effects()
    pin = Override(pin_policy="static:1", created_at_s=0.0, expires_at_s=20.0, reason="try")
    _, state = _step(core, state, 0.0, fx, overrides=(pin,))
    state = core.configure(state, "static:0")
    assert state.policy_spec == "static:1" and state.configured_spec == "static:0"
    rec, state = _step(core, state, 30.0, fx, overrides=(pin,))
    assert state.policy_spec == "static:0" and rec.policy == "static:0"


def test_failed_publish_keeps_the_table_in_force_and_is_retried() -> None:
    core = _core()
    state = core.initial_state("static:2")
    rec, state = _step(core, state, 0.0, Effects(ok=False))
    assert not rec.published and rec.table_after is not None and state.table is None
    assert "spool write failed" in rec.message
    rec, state = _step(core, state, 5.0, Effects())
    assert rec.published and rec.reason == "initial" and state.table == rec.table_after


def test_blocked_and_observe_mode_never_publish() -> None:
    core = _core()
    fx = Effects()
    rec, state = _step(core, core.initial_state("static:2"), 0.0, fx, blocked="401")
    assert fx.published == [] and not rec.published and state.table is None
    assert rec.not_published is not None and "401" in rec.not_published
    observe = _core("observe")
    fx = Effects()
    rec, state = _step(observe, observe.initial_state("static:2"), 0.0, fx)
    assert fx.published == [] and rec.not_published == NOT_PUBLISHED_OBSERVE
    # In observe mode the table is what the daemon would run.
    assert state.table == rec.table_after and rec.changed


def test_observation_is_aged_and_carries_the_windows_and_the_table() -> None:
    core = _core()
    state = replace(
        core.initial_state("static:2"),
        table=StepTable(((1, 2), (8, 2), (32, 1)), version=3, produced_at_s=0.0, ttl_s=30.0),
    )
    obs = core.observation(
        state, ControlInputs(now_s=12.0, observation=_obs(2.0), tier_stats=_windows(12.0))
    )
    assert obs.time_s == 12.0 and obs.staleness_s == pytest.approx(10.0)
    assert obs.table == state.table and obs.tier_stats is not None


def test_a_pin_that_starts_on_frozen_telemetry_still_takes_effect() -> None:
    core = _core()
    state = core.initial_state("static:2")
    fx = Effects()
    _, state = _step(core, state, 0.0, fx)
    pin = Override(pin_policy="static:1", created_at_s=1.0, expires_at_s=100.0, reason="try")
    frozen = ControlInputs(now_s=5.0, observation=_obs(5.0), overrides=(pin,))  # no windows
    rec, state = control_step(core, state, frozen, fx)
    assert "held_unknown_telemetry" in rec.limited_by and not rec.published
    # static:1 speaks only when its table changes; the dropped first table must not
    # silence it: the next fresh decision publishes it.
    rec, state = _step(core, state, 10.0, fx, overrides=(pin,))
    assert rec.published and rec.table_in_force is not None
    assert {k for _, k in rec.table_in_force.slots} == {1}


# ------------------------------------------------------------- the loop's cadence


def test_replay_runs_the_daemon_cadence_and_its_first_decision_has_a_window() -> None:
    """Closed-loop replay scrapes every scrape interval and decides every decision
    interval on the newest scrape, with the daemon's default intervals, so its first
    decision (5 s in) already has a window and publishes, as the daemon's does."""
    from specgov.controller.daemon.config_schema import LoopConfig
    from specgov.simulator.replay.closed_loop import ControlLoopConfig

    daemon_loop, replay_loop = LoopConfig(), ControlLoopConfig()
    assert replay_loop.interval_s == daemon_loop.decide_interval_s
    assert replay_loop.scrape_interval_s == daemon_loop.scrape_interval_s
    server = ServerSpec(gpu="h100", model="llama-3.1-8b", drafter="eagle3")
    run = prepare_run(server, parse_policy("goodput"), seed=3, slo=Slo())
    loop = run.loop
    assert loop is not None
    scrapes: list[float] = []
    observe = loop.observe

    def counting_observe(now_s: float) -> Observation | None:
        scrapes.append(now_s)
        return observe(now_s)

    loop.observe = counting_observe
    trace = generate_trace(parse_synthetic_spec("synthetic:duration=30,rate=6,seed=5"))
    run.run(trace.requests)
    first = loop.records[0]
    assert first.time_s < INTERVAL_S + 1.0
    assert first.reason == "initial" and first.published, first.message
    assert first.inputs_summary["window_s"] >= INTERVAL_S - 1.5  # about one interval
    # Decisions on a fixed 5 s grid from the start (a tick lands at a forward boundary,
    # so each within one scrape interval of its grid time), one per grid time; about five
    # scrapes per decision.
    start = first.time_s - INTERVAL_S
    for k, record in enumerate(loop.records, start=1):
        assert -0.5 < record.time_s - (start + k * INTERVAL_S) < 1.0, (k, record.time_s)
    assert SCRAPES_PER_DECISION * (len(loop.records) - 1) <= len(scrapes)


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"scrape_interval_s": 0.0}, "scrape_interval_s must be > 0"),
        ({"interval_s": 5.0, "scrape_interval_s": 2.0}, "whole multiple of scrape_interval_s"),
        ({"interval_s": 1.0, "scrape_interval_s": 2.0}, "whole multiple of scrape_interval_s"),
        ({"publish_delay_s": -1.0}, "publish_delay_s must be >= 0"),
        ({"poll_every_batches": 0}, "poll_every_batches must be >= 1"),
    ],
)
def test_a_loop_cadence_that_does_not_divide_is_refused(
    kwargs: dict[str, float], named: str
) -> None:
    from specgov.simulator.replay.closed_loop import ClosedLoopConfigError, ControlLoopConfig

    with pytest.raises(ClosedLoopConfigError, match=named):
        ControlLoopConfig(**kwargs)


def test_replay_decisions_stay_on_their_grid_when_a_forward_spans_scrapes() -> None:
    """A long forward (a big prefill) makes the engine call one scrape tick for several
    intervals: the next decision still comes at its grid time, not one scrape later for
    the rest of the run (the daemon's decide loop keeps fixed deadlines)."""
    server = ServerSpec(gpu="h100", model="llama-3.1-8b", drafter="eagle3")
    loop = prepare_run(server, parse_policy("goodput"), seed=3, slo=Slo()).loop
    assert loop is not None
    for now_s in (1.0, 2.0, 3.0, 4.0, 5.0, 8.2, 9.0, 10.0, 11.0, 15.3):
        loop.on_tick(now_s)
    assert [r.time_s for r in loop.records] == [5.0, 10.0, 15.3]
