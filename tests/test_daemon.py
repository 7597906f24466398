"""The daemon against an in-process simulated SGLang server (real HTTP on loopback)."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from specgov.controller.daemon.config import SpecgovConfig, load_config
from specgov.controller.daemon.runtime import Daemon
from specgov.controller.daemon.state_store import StateStore
from specgov.controller.daemon.store_errors import StoreUnavailable
from specgov.simulator.replay.runner import ServerSpec
from specgov.simulator.server.core import SimServer
from specgov.simulator.workload.synthetic import generate_trace
from specgov.simulator.workload.synthetic_text import parse_synthetic_spec


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimServer]:
    spool = tmp_path_factory.mktemp("spool")
    trace = generate_trace(parse_synthetic_spec("synthetic:duration=600,rate=10,seed=4"))
    server = SimServer(trace, ServerSpec(), speed=20, spool_dir=spool, loop_trace=True)
    server.start()
    server.wait_ready(30)
    yield server
    server.stop()


def _config(sim: SimServer, tmp_path: Path, **extra: Any) -> SpecgovConfig:
    overrides = {
        "server.url": sim.url,
        "spool.dir": str(sim.state()["spool_dir"]),
        "state.db_path": str(tmp_path / "state.db"),
        "loop.mode": "plugin",
        "loop.decide_interval_s": 1,
        "loop.scrape_interval_s": 0.5,
        **extra,
    }
    return load_config(None, env={}, overrides=overrides)


async def _rounds(daemon: Daemon, n: int, pause_s: float = 0.3) -> list[Any]:
    decisions = []
    for _ in range(n):
        await daemon.scrape_once()
        decisions.append(daemon.decide_once())
        await asyncio.sleep(pause_s)
    return decisions


async def _until_published(daemon: Daemon, max_rounds: int = 40) -> None:
    # The first table needs two scrapes and plugin statistics; how many rounds that
    # takes depends on how busy the machine is.
    for _ in range(max_rounds):
        await _rounds(daemon, 1)
        if daemon.status()["tables_published"]:
            return
    raise AssertionError(f"no table published in {max_rounds} rounds: {daemon.status()}")


def test_plugin_mode_publishes_a_table_the_plugin_follows(sim: SimServer, tmp_path: Path) -> None:
    config = _config(sim, tmp_path)
    store = StateStore(config.state.db_path)
    daemon = Daemon(config, store=store)

    async def go() -> list[Any]:
        try:
            await _until_published(daemon)
            return await _rounds(daemon, 3)
        finally:
            await daemon.close()

    decisions = asyncio.run(go())
    table_file = Path(sim.state()["spool_dir"]) / "step_table.json"
    assert table_file.is_file()
    published = json.loads(table_file.read_text())
    assert published["table"]["slots"][0][0] == 1
    # The audit log has every decision, newest first, with reasons and inputs.
    rows = store.decisions(limit=1000)
    assert len(rows) == daemon.status()["decisions"] >= len(decisions)
    assert all(r.reason and r.message for r in rows)
    assert "initial" in [r.reason for r in rows]
    assert store.last_table() is not None
    assert store.load_policy_state(daemon.policy.name) is not None
    status = daemon.status()
    assert status["tables_published"] >= 1 and status["permanent_error"] is None
    store.close()


def test_spool_group_makes_the_table_readable_by_the_group(sim: SimServer, tmp_path: Path) -> None:
    # spool.group (the two-user deployment, docs/spool-security.md): the table is 0640
    # in that group, so a server running as another user of it can read it.
    group = os.getgid()
    config = _config(sim, tmp_path, **{"spool.group": group})
    assert config.spool.group == group
    daemon = Daemon(config, store=None)

    async def go() -> None:
        try:
            await _until_published(daemon)
        finally:
            await daemon.close()

    asyncio.run(go())
    table_file = Path(sim.state()["spool_dir"]) / "step_table.json"
    assert stat.S_IMODE(table_file.stat().st_mode) == 0o640
    assert table_file.stat().st_gid == group


def test_observe_mode_decides_but_never_writes_the_spool(sim: SimServer, tmp_path: Path) -> None:
    spool = tmp_path / "observe-spool"
    config = _config(sim, tmp_path, **{"loop.mode": "observe", "spool.dir": str(spool)})
    daemon = Daemon(config, store=None)

    async def go() -> None:
        try:
            await _rounds(daemon, 5)
        finally:
            await daemon.close()

    asyncio.run(go())
    assert not (spool / "step_table.json").exists()
    assert daemon.status()["decisions"] == 5
    assert daemon.status()["tables_published"] == 0


def test_override_is_applied_at_the_next_decision_and_survives_a_restart(
    sim: SimServer, tmp_path: Path
) -> None:
    config = _config(sim, tmp_path)

    async def first() -> Any:
        daemon = Daemon(config, store=StateStore(config.state.db_path))
        try:
            await _until_published(daemon)
            daemon.set_override(
                slot=1, steps=0, disable=False, pin_policy=None, ttl_s=600, reason="test"
            )
            (decision,) = await _rounds(daemon, 1)
            return decision, daemon.status()
        finally:
            await daemon.close()
            assert daemon.store is not None
            daemon.store.close()

    decision, status = asyncio.run(first())
    assert str(decision.reason) == "override_active"
    assert dict(status["table"]["slots"])[1] == 0
    # A new daemon on the same database finds the override still in force.
    restarted = Daemon(config, store=StateStore(config.state.db_path))
    overrides = restarted.list_overrides()
    assert len(overrides) == 1 and overrides[0]["steps"] == 0
    assert overrides[0]["id"] is not None
    assert restarted.clear_override(overrides[0]["id"], None) == 1
    assert restarted.list_overrides() == []
    asyncio.run(restarted.close())


class _BrokenStore(StateStore):
    def _fail(self, *args: Any, **kwargs: Any) -> Any:
        raise StoreUnavailable(Path("/nonexistent"), "write", OSError("disk is full"))

    record_decision = save_table = save_policy_state = _fail  # type: ignore[assignment]


def test_unavailable_store_is_reported_and_control_continues(
    sim: SimServer, tmp_path: Path
) -> None:
    config = _config(sim, tmp_path)
    daemon = Daemon(config, store=_BrokenStore(tmp_path / "ok.db"))

    async def go() -> None:
        try:
            await _until_published(daemon)
        finally:
            await daemon.close()  # tries the broken store again: reported, never raised

    asyncio.run(go())
    status = daemon.status()
    assert status["store_error"] and "controlling from memory" in status["store_error"]
    assert status["tables_published"] >= 1
    # Every audit row waits in the journal, and the API answers from it.
    assert len(daemon.decisions(None, 1000)) == status["decisions"]
    assert status["store_journal"]["entries"] == status["decisions"]


def test_rejected_api_key_is_permanent_and_stops_acting(tmp_path: Path) -> None:
    trace = generate_trace(parse_synthetic_spec("synthetic:duration=60,rate=5,seed=1"))
    spool = tmp_path / "spool"
    with SimServer(trace, ServerSpec(), speed=20, spool_dir=spool, api_key="right") as locked:
        locked.wait_ready(30)
        config = _config(locked, tmp_path, **{"server.api_key_env": "TEST_KEY"})
        import os

        os.environ["TEST_KEY"] = "wrong"
        try:
            daemon = Daemon(config, store=None)

            async def go() -> None:
                try:
                    await _rounds(daemon, 2, pause_s=0.1)
                finally:
                    await daemon.close()

            asyncio.run(go())
        finally:
            del os.environ["TEST_KEY"]
    status = daemon.status()
    assert status["permanent_error"] and "401" in status["permanent_error"]
    assert status["tables_published"] == 0
    assert not (spool / "step_table.json").exists()


def test_a_dying_task_stops_the_daemon_with_a_nonzero_exit(sim: SimServer, tmp_path: Path) -> None:
    daemon = Daemon(_config(sim, tmp_path), store=None)

    async def boom() -> None:
        await asyncio.sleep(0.2)
        raise RuntimeError("control API crashed")

    code = asyncio.run(daemon.run({"control-api": boom}, install_signals=False, shutdown_grace_s=2))
    assert code == 1


def test_reload_keeps_the_old_config_when_the_new_one_is_invalid(
    sim: SimServer, tmp_path: Path
) -> None:
    good = _config(sim, tmp_path)
    bad_file = tmp_path / "bad.yaml"
    bad_file.write_text("loop:\n  decide_interval_s: soon\n")

    def loader() -> SpecgovConfig:
        return load_config(bad_file, env={})

    daemon = Daemon(good, store=None, config_loader=loader)
    daemon.reload()
    assert daemon.config is good
    assert any("reload rejected" in n for n in daemon.status()["notes"])
    asyncio.run(daemon.close())


def test_policy_switch_validates_the_spec(sim: SimServer, tmp_path: Path) -> None:
    daemon = Daemon(_config(sim, tmp_path), store=None)
    with pytest.raises(ValueError, match="valid kinds"):
        daemon.set_policy("bogus")
    assert daemon.set_policy("bandit:algo=thompson") == {"policy": daemon.policy.name}
    assert daemon.policy.name.startswith("bandit")
    asyncio.run(daemon.close())


async def _until(daemon: Daemon, done: Any, max_rounds: int = 40) -> Any:
    """Decide until a decision satisfies ``done`` (telemetry may be briefly unknown on
    a busy machine); every decision on the way is kept in the audit log."""
    for _ in range(max_rounds):
        (decision,) = await _rounds(daemon, 1)
        if done(decision):
            return decision
    raise AssertionError(f"no such decision in {max_rounds} rounds: {daemon.status()}")


def _wait_plugin_table(sim: SimServer, version: int, deadline_s: float = 60.0) -> dict[str, Any]:
    """The engine's plugin table once it has picked up ``version`` (or a later one)."""
    import time

    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        plugin = sim.state()["plugin"] or {}
        table = plugin.get("table")
        if table is not None and table["version"] >= version:
            return dict(table)
        time.sleep(0.05)  # polling an observable event, bounded by the deadline
    raise AssertionError(f"the plugin never followed table v{version}: {sim.state()['plugin']}")


def test_pinned_policy_runs_for_its_ttl_and_the_engine_follows_it(
    sim: SimServer, tmp_path: Path
) -> None:
    config = _config(sim, tmp_path)
    store = StateStore(config.state.db_path)
    daemon = Daemon(config, store=store)

    async def go() -> tuple[Any, dict[str, Any], dict[str, Any], Any, dict[str, Any]]:
        try:
            await _until_published(daemon)
            pin = daemon.set_override(
                slot=None, steps=None, disable=False, pin_policy="static:1", ttl_s=600, reason="t"
            )
            pinned = await _until(daemon, lambda r: r.published)
            during = daemon.status()
            # The engine follows the pinned table before the pin is cleared (after it, the
            # configured policy's next table may already have replaced it).
            engine = await asyncio.to_thread(_wait_plugin_table, sim, pinned.table_after.version)
            daemon.clear_override(pin["id"], None)
            (back,) = await _rounds(daemon, 1)
            return pinned, during, engine, back, daemon.status()
        finally:
            await daemon.close()
            store.close()

    pinned, during, engine, back, after = asyncio.run(go())
    # status shows the pinned spec as the effective policy, the configured one beside it.
    assert during["policy"] == "static:1" and during["pinned"] is True
    assert during["configured_policy"] == "goodput"
    assert pinned.policy == "static:1" and pinned.published and pinned.table_after is not None
    # The published table is the pinned policy's: 1 step wherever the slot has it.
    layout = {b: ks for b, ks in during["slots"]}
    assert all(k == 1 for b, k in pinned.table_after.slots if 1 in layout[b])
    assert engine["version"] == pinned.table_after.version
    assert [tuple(s) for s in engine["slots"]] == list(pinned.table_after.slots)
    # The pin ended: the configured policy is back.
    assert after["policy"] == "goodput" and after["pinned"] is False
    assert back.policy == "goodput" and "pin ended" in back.message


def test_overrides_for_unknown_slots_or_steps_are_refused_with_the_valid_set(
    sim: SimServer, tmp_path: Path
) -> None:
    daemon = Daemon(_config(sim, tmp_path), store=None)

    async def go() -> None:
        try:
            with pytest.raises(ValueError, match="slots are not known yet"):
                daemon.set_override(
                    slot=1, steps=0, disable=False, pin_policy=None, ttl_s=60, reason="x"
                )
            await daemon.scrape_once()
            slots = dict((b, ks) for b, ks in daemon.status()["slots"])
            with pytest.raises(ValueError, match=r"slot 5 is not an engine slot; valid slots"):
                daemon.set_override(
                    slot=5, steps=0, disable=False, pin_policy=None, ttl_s=60, reason="x"
                )
            last = max(slots)
            with pytest.raises(
                ValueError, match=rf"steps 9 is not a candidate of slot\(s\) \[{last}"
            ):
                daemon.set_override(
                    slot=last, steps=9, disable=False, pin_policy=None, ttl_s=60, reason="x"
                )
            with pytest.raises(ValueError, match="valid kinds"):
                daemon.set_override(
                    slot=None, steps=None, disable=False, pin_policy="turbo", ttl_s=60, reason="x"
                )
            assert daemon.list_overrides() == []
        finally:
            await daemon.close()

    asyncio.run(go())


def test_overrides_survive_a_policy_switch_and_restart_and_a_clear_survives_a_kill(
    sim: SimServer, tmp_path: Path
) -> None:
    config = _config(sim, tmp_path)

    async def first() -> str:
        daemon = Daemon(config, store=StateStore(config.state.db_path))
        try:
            await _until_published(daemon)
            ov = daemon.set_override(
                slot=1, steps=0, disable=False, pin_policy=None, ttl_s=600, reason="keep"
            )
            daemon.set_policy("bandit")
            await _rounds(daemon, 1)
            return str(ov["id"])
        finally:
            await daemon.close()
            assert daemon.store is not None
            daemon.store.close()

    ov_id = asyncio.run(first())

    async def second() -> tuple[Any, list[dict[str, Any]]]:
        daemon = Daemon(config, store=StateStore(config.state.db_path))
        assert daemon.policy.name.startswith("bandit")  # the switch survived the restart
        overrides = daemon.list_overrides()
        (decision,) = await _rounds(daemon, 1)
        # Cleared, then the process dies without closing anything (as kill -9 would).
        assert daemon.clear_override(ov_id, None) == 1
        return decision, overrides

    decision, overrides = asyncio.run(second())
    assert [o["id"] for o in overrides] == [ov_id]
    assert decision.reason == "override_active"
    assert decision.table_in_force is not None and dict(decision.table_in_force.slots)[1] == 0
    third = Daemon(config, store=StateStore(config.state.db_path))
    assert third.list_overrides() == []
    asyncio.run(third.close())


class _RecommendingPolicy:
    """A daemon policy that holds the table and recommends a restart without the drafter."""

    name = "recommender"

    def initial_state(self) -> Any:
        from specgov.policies.daemon.schedules import NonePolicy

        return NonePolicy().initial_state()

    def state_from_dict(self, data: Any) -> Any:
        from specgov.policies.daemon.schedules import NonePolicy

        return NonePolicy().state_from_dict(data)

    def decide(self, observation: Any, state: Any, budget: Any) -> tuple[Any, Any]:
        from specgov.policies.common.decisions import Plan, ReasonCode, RestartRecommendation
        from specgov.policies.common.types import SpecShape

        rec = RestartRecommendation(
            SpecShape("NONE", 0, 0, 0, ()),
            "policy",
            "no speculation: the drafter costs more than it returns",
            0.2,
            (("held_s", 300.0),),
        )
        return (
            Plan(None, ReasonCode.HELD_NO_CHANGE, "holding", None, (), rec),
            state,
        )


def test_a_restart_recommendation_is_structured_everywhere_and_reaches_the_apply_hook(
    sim: SimServer, tmp_path: Path
) -> None:
    import sys
    import time

    from aiohttp import web
    from click.testing import CliRunner

    from specgov.controller.cli.main import main as cli
    from specgov.controller.daemon.control_api import make_app
    from specgov.controller.daemon.own_metrics import render_metrics
    from specgov.policies.control.core import ControlCore
    from specgov.policies.guardrails import GuardedPolicy

    handed = tmp_path / "handed.json"
    hook = f"import os; open({str(handed)!r}, 'w').write(os.environ['SPECGOV_RECOMMENDATION'])"
    config = _config(sim, tmp_path, **{"recommend.apply_command": [sys.executable, "-c", hook]})
    store = StateStore(config.state.db_path)
    daemon = Daemon(config, store=store)
    guarded = GuardedPolicy(_RecommendingPolicy())
    daemon.core = ControlCore(lambda _spec: guarded, config.budget, "plugin")
    daemon.core_state = daemon.core.initial_state("recommender")

    async def go() -> str:
        runner = web.AppRunner(make_app(daemon, token=None, listen_host="127.0.0.1"))
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        try:
            await _rounds(daemon, 1)
            end = time.monotonic() + 60
            while not handed.exists() and time.monotonic() < end:
                await asyncio.sleep(0.05)  # waiting on the hook's file, bounded
            result = await asyncio.to_thread(
                CliRunner().invoke,
                cli,
                ["recommend", "--output", "json", "--control-addr", f"127.0.0.1:{port}"],
            )
            assert result.exit_code == 0, result.output
            return result.output
        finally:
            await runner.cleanup()
            await daemon.close()

    cli_out = json.loads(asyncio.run(go()))
    # The CLI, the status and the audit row carry the same structured recommendation.
    for doc in (cli_out, daemon.status()["recommendation"]):
        assert doc["shape"]["algorithm"] == "NONE" and doc["source"] == "policy"
        assert doc["predicted_gain"] == 0.2 and doc["evidence"] == {"held_s": 300.0}
    (row,) = store.decisions(limit=1)
    assert row.restart_recommendation is not None
    assert row.restart_recommendation.shape.algorithm == "NONE"
    text = render_metrics(daemon.registry)[0].decode()
    assert (
        'specgov_restart_recommended_gain_ratio{algorithm="NONE",num_steps="0",source="policy"} 0.2'
        in text
    )
    assert handed.exists(), "the apply hook was not run"
    assert json.loads(handed.read_text())["key"] == cli_out["key"]
    store.close()


class _CountingStore(StateStore):
    """A real store that also lists every policy-state save (time, policy)."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.saves: list[tuple[float, str]] = []

    def save_policy_state(self, policy_name: str, state: Any, time_s: float) -> int:
        self.saves.append((time_s, policy_name))
        return super().save_policy_state(policy_name, state, time_s)


class _StepClock:
    """A wall clock that moves only when told (one decision interval per round)."""

    def __init__(self) -> None:
        self.now_s = 1_000_000.0

    def __call__(self) -> float:
        return self.now_s


async def _clocked_rounds(daemon: Daemon, clock: _StepClock, n: int, step_s: float) -> None:
    for _ in range(n):
        clock.now_s += step_s
        await daemon.scrape_once()
        daemon.decide_once()
        await asyncio.sleep(0.2)  # lets the simulated server run a little (not awaited on)


async def _clocked_until_published(daemon: Daemon, clock: _StepClock) -> None:
    for _ in range(40):
        await _clocked_rounds(daemon, clock, 1, 1.0)
        if daemon.status()["tables_published"]:
            return
    raise AssertionError(f"no table published in 40 rounds: {daemon.status()}")


def _saved_key(store: StateStore, daemon: Daemon) -> tuple[object, ...]:
    saved = store.load_policy_state(daemon.policy.name)
    assert saved is not None
    return daemon.policy.state_from_dict(saved).checkpoint_key()


@pytest.mark.parametrize("interval", [0, 10])
def test_policy_state_is_saved_when_the_guard_changes_and_else_at_the_interval(
    sim: SimServer, tmp_path: Path, interval: int
) -> None:
    # state.policy_state_interval_s, as a config file sets it (load_config's overrides
    # are the same path): 0 saves at every decision; 10 saves at most every 10 s of
    # decisions, but at once whenever what the guard acts on changed, so the saved
    # table, versions, trial and blocks are never older than the running ones.
    config = _config(sim, tmp_path, **{"state.policy_state_interval_s": interval})
    assert config.state.policy_state_interval_s == interval
    clock = _StepClock()
    store = _CountingStore(config.state.db_path)
    daemon = Daemon(config, store=store, clock=clock)
    keys: list[tuple[object, ...]] = []
    start_s = 0.0

    async def go() -> list[float]:
        nonlocal start_s
        try:
            await _clocked_until_published(daemon, clock)
            start_s = clock.now_s
            for _ in range(24):
                await _clocked_rounds(daemon, clock, 1, 1.0)
                assert _saved_key(store, daemon) == daemon.state.checkpoint_key()
                keys.append(daemon.state.checkpoint_key())
            return [t for t, _ in store.saves if t > start_s]
        finally:
            saves_before_close = len(store.saves)
            await daemon.close()
            # Shutdown saves the newest state whatever the interval.
            assert len(store.saves) == saves_before_close + 1

    during = asyncio.run(go())
    decided = [r.time_s for r in store.decisions(limit=1000) if r.time_s > start_s]
    if interval == 0:
        assert len(during) == 24 and during == sorted(decided)
    else:
        # 24 decisions 1 s apart: saves at least every 10 s, and otherwise only for a
        # change of the guard's key (counted from the keys seen after each decision).
        changes = sum(a != b for a, b in itertools.pairwise(keys))
        assert 2 <= len(during) <= 3 + changes < 24, (during, changes)
        gaps = [b - a for a, b in itertools.pairwise(during)]
        assert max(gaps) <= 10.0, gaps
    assert store.saves[-1][0] == clock.now_s
    store.close()


@pytest.mark.parametrize("switch", ["policy set", "pin"])
def test_a_switch_saves_the_outgoing_policys_learning(
    sim: SimServer, tmp_path: Path, switch: str
) -> None:
    # `policy set` switches at once; a pin switches inside the control core at the next
    # decision, the configured policy parked in memory. Either way the outgoing policy's
    # learning up to the switch is saved then, not only the incoming one's at the next
    # checkpoint (a restart, or a switch back after one, resumes from it).
    config = _config(sim, tmp_path, **{"state.policy_state_interval_s": 3600})
    clock = _StepClock()
    store = _CountingStore(config.state.db_path)
    daemon = Daemon(config, store=store, clock=clock)

    async def go() -> None:
        try:
            await _clocked_until_published(daemon, clock)
            await _clocked_rounds(daemon, clock, 5, 1.0)
            outgoing = daemon.policy.name
            before = daemon.state.to_dict()
            if switch == "policy set":
                daemon.set_policy("bandit")
            else:
                daemon.set_override(None, None, False, "bandit", 600.0, "pin test")
                await _clocked_rounds(daemon, clock, 1, 1.0)
            assert daemon.policy.name != outgoing
            snapshot = store.load_policy_snapshot(outgoing)
            assert snapshot is not None and snapshot.time_s == clock.now_s
            assert dict(snapshot.state) == before
        finally:
            await daemon.close()

    asyncio.run(go())
    store.close()


def test_predicted_goodput_is_exported_at_every_decision_for_the_table_in_force(
    sim: SimServer, tmp_path: Path
) -> None:
    """Issue 23: the gauge was set only at a change that carried a gain, then stayed
    frozen while the load moved. Now every decision predicts for the table in force: the
    gauge is the audit record's prediction each time, and it moves between changes."""
    daemon = Daemon(_config(sim, tmp_path), store=None)
    name = "specgov_goodput_predicted_tokens_per_second"
    seen: list[tuple[bool, float | None, float | None]] = []

    async def go() -> None:
        try:
            await _until_published(daemon)
            for _ in range(12):
                await daemon.scrape_once()
                record = daemon.decide_once()
                exported = daemon.registry.get_sample_value(name)
                seen.append((record.changed, record.predicted_goodput_tok_s, exported))
                await asyncio.sleep(0.3)
        finally:
            await daemon.close()

    asyncio.run(go())
    # In the daemon's (wall) seconds, as the observed gauge: x the sim-server's speed.
    speed = daemon.status()["sim_speed"]
    assert speed == 20
    for _, predicted, exported in seen:
        assert exported == (None if predicted is None else pytest.approx(predicted * speed)), seen
    held = [predicted for changed, predicted, _ in seen if not changed and predicted is not None]
    assert len(held) >= 3, seen
    assert len(set(held)) >= 2, f"the prediction froze between changes: {seen}"
