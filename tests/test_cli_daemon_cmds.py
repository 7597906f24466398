"""The daemon's client commands as an operator reads them: status, decisions, overrides,
policy, recommend; tables, human times, units, one-line decisions, exit codes.

The CLI talks HTTP to the real control API (``control_api.make_app``) on loopback,
served from a thread; the service behind it is a canned fake, except for the override
refusal test, which runs a real Daemon against an in-process simulated server.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from click.testing import CliRunner, Result

from specgov.controller.cli.main import main
from specgov.controller.daemon.control_api import make_app
from specgov.policies.daemon.spec import KNOWN_KINDS

HELD = (
    "table v2 [1:4, 8:4, 32:3, 64:2] unchanged; held slots [64]: expected gain +0.0% < "
    "min_gain 2.0%; policy goodput: changed_predicted_gain: goodput: new table, predicted "
    "gain +0.0% (slot 1: k=4 B=1.9 E[L]=2.61 T=12.93ms TPOT=4.96ms G=381tok/s; slot 8: k=4 "
    "B=10.4 E[L]=2.67 T=15.07ms TPOT=5.65ms G=1845tok/s)"
)
IN_112_S = re.compile(r"\(in 1m5[12]s\)")  # 112 s, less the time the answer took
EPOCH_FLOAT = re.compile(r"1[0-9]{9}(\.[0-9]+)?|1\.[0-9]+e\+09")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@contextmanager
def serve(service: Any, before: Callable[[], Awaitable[object]] | None = None) -> Iterator[str]:
    """The control API over ``service`` on a loopback port, from a thread's event loop;
    ``before`` runs on that loop first (a daemon's first scrape). Yields HOST:PORT."""
    port = _free_port()
    ready = threading.Event()
    failure: list[BaseException] = []
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()

    async def main_task() -> None:
        try:
            runner = web.AppRunner(make_app(service, token=None, listen_host="127.0.0.1"))
            if before is not None:
                await before()
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", port).start()
        except BaseException as exc:
            failure.append(exc)
            ready.set()
            raise
        ready.set()
        await stop.wait()
        await runner.cleanup()

    thread = threading.Thread(target=lambda: loop.run_until_complete(main_task()), daemon=True)
    thread.start()
    assert ready.wait(60), "control API did not start"
    if failure:
        raise failure[0]
    try:
        yield f"127.0.0.1:{port}"
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(30)
        loop.close()


class FakeDaemon:
    """Canned answers in the shapes Daemon returns (controller/daemon/runtime.py)."""

    def __init__(self) -> None:
        self.policy_spec = "goodput:slo_tpot_ms=40"
        self.sim_speed: float | None = 20.0
        self.health: list[str] = []

    # Times are relative to each answer, as a live daemon's are.
    @property
    def table(self) -> dict[str, Any]:
        return {
            "schema": 1,
            "version": 2,
            "slots": [[1, 4], [8, 4], [32, 3], [64, 2]],
            "ttl_s": 30.0,
            "produced_at_s": time.time() - 5.9,
            "reason": "held_no_change",
        }

    @property
    def override(self) -> dict[str, Any]:
        now = time.time()
        return {
            "id": "ov-1",
            "version": 1,
            "slot": 1,
            "steps": 0,
            "disable_speculation": False,
            "pin_policy": None,
            "created_at_s": now - 8.0,
            "expires_at_s": now + 112.0,
            "reason": "trying it",
        }

    @property
    def decision(self) -> dict[str, Any]:
        return {
            "id": 13,
            "time_s": time.time() - 12.0,
            "policy": "goodput",
            "reason": "held_tolerance_band",
            "message": HELD,
            "published": False,
            "table_before": self.table,
            "table_after": None,
            "expected_gain": None,
            "limited_by": ["held_tolerance_band"],
            "inputs_summary": {"running": 6, "queued": 0},
            "restart_trigger": None,
        }

    def status(self) -> Mapping[str, Any]:
        data: dict[str, Any] = {
            "policy": self.policy_spec,
            "configured_policy": self.policy_spec,
            "pinned": False,
            "mode": "plugin",
            "server": "http://127.0.0.1:30000",
            "uptime_s": 95.2,
            "last_scrape_age_s": 0.48,
            "last_scrape_error": None,
            "permanent_error": None,
            "scrape_errors": 0,
            "store_error": None,
            "spool_error": None,
            "decisions": 12,
            "tables_published": 2,
            "table": self.table,
            "table_age_s": 5.9,
            "slots": [[1, [0, 1, 2, 3, 4]], [8, [0, 1, 2, 3]], [32, [0, 1, 2]], [64, [0, 1]]],
            "last_decision": self.decision,
            "overrides": [self.override],
            "observation": {
                "running": 6,
                "queued": 0,
                "token_usage": 0.0593,
                "gen_throughput_tok_s": 40_000.0,
                "accept_length": 2.3565,
                "tpot_p50_ms": 18.4375,
                "itl_p99_ms": None,
                "spec_num_steps": 4,
                "staleness_s": 0.06,
                "tier_windows": 6,
            },
            "recommendation": None,
            "health": self.health,
            "notes": [],
        }
        if self.sim_speed is not None:
            data["sim_speed"] = self.sim_speed
        return data

    def decisions(self, since_s: float | None, limit: int) -> Sequence[Mapping[str, Any]]:
        expires = time.time() + 112.0
        held = {
            **self.decision,
            "id": 12,
            "reason": "held_override",
            "message": f"table v2 unchanged; override slot 1 -> 0 ('t', until {expires:.1f} s)",
        }
        return [self.decision, held][:limit]

    def list_overrides(self) -> Sequence[Mapping[str, Any]]:
        return [self.override]

    def set_override(
        self,
        slot: int | None,
        steps: int | None,
        disable: bool,
        pin_policy: str | None,
        ttl_s: float,
        reason: str,
    ) -> Mapping[str, Any]:
        return {**self.override, "slot": slot, "steps": steps, "reason": reason}

    def clear_override(self, override_id: str | None, slot: int | None) -> int:
        return 1

    def set_policy(self, spec: str) -> Mapping[str, Any]:
        if spec.startswith("bogus"):
            raise ValueError(f"{spec}: unknown policy kind 'bogus'")
        return {"policy": spec}

    def policies(self) -> Mapping[str, Any]:
        return {"current": self.policy_spec, "kinds": list(KNOWN_KINDS)}

    def health(self) -> Mapping[str, Any]:
        return {"ok": True, "acting": True, "store": True}

    def liveness(self) -> Mapping[str, Any]:
        return {"ok": True}

    def recommend(self) -> Mapping[str, Any]:
        return {
            "summary": "restart with EAGLE3 4 steps",
            "source": "replay",
            "predicted_gain": 0.061,
            "metric": "throughput_tok_s",
            "shape": {"algorithm": "EAGLE3", "num_steps": 4, "topk": 1, "num_draft_tokens": 5},
            "launch": {"argv": ["--speculative-algorithm", "EAGLE3"]},
            "applied": None,
        }


@pytest.fixture(scope="module")
def fake() -> Iterator[tuple[FakeDaemon, str]]:
    service = FakeDaemon()
    with serve(service) as addr:
        yield service, addr


def cli(addr: str, *args: str) -> Result:
    return CliRunner().invoke(main, [*args, "--control-addr", addr])


def _no_raw_values(output: str) -> None:
    assert "None" not in output, output
    assert EPOCH_FLOAT.search(output) is None, output


def test_status_says_what_health_fails(fake: tuple[FakeDaemon, str]) -> None:
    service, addr = fake
    assert "ready" in cli(addr, "status").output
    service.health = ["blind: the server has been busy for 40 s (bound 30 s)"]
    out = cli(addr, "status").output
    assert "blind: the server has been busy for 40 s" in out


def test_status_shows_simulated_tokens_per_second_and_human_times(
    fake: tuple[FakeDaemon, str],
) -> None:
    service, addr = fake
    result = cli(addr, "status")
    assert result.exit_code == 0, result.output
    out = result.output
    # 40,000 tok/s per wall second at 20x is 2,000 per simulated second: that is the headline.
    assert "2,000 tok/s simulated (40,000 per wall second at 20x)" in out
    assert "5.9s (TTL 30s, expires in 24s)" in out
    assert "1m35s" in out  # uptime 95.2 s
    assert "18.4 ms" in out and "2.36" in out  # rounded, with units
    assert "ITL p99" in out and "unknown" in out  # a missing value says so
    assert "slot 1 -> 0 steps until" in out and IN_112_S.search(out)
    assert "held slots [64]" in out and "k=4" not in out  # the one-line decision
    _no_raw_values(out)
    # Against a real server (no sim_speed) the rate is simply tokens per second.
    service.sim_speed = None
    try:
        plain = cli(addr, "status").output
    finally:
        service.sim_speed = 20.0
    assert "40,000 tok/s" in plain and "simulated" not in plain


def test_status_verbose_and_json_carry_the_full_decision(fake: tuple[FakeDaemon, str]) -> None:
    _, addr = fake
    verbose = cli(addr, "status", "--verbose").output
    assert "k=4" in verbose.replace("\n", " ")
    data = json.loads(cli(addr, "status", "--output", "json").output)
    assert data["last_decision"]["message"] == HELD
    assert data["observation"]["gen_throughput_tok_s"] == 40_000.0  # exact, unconverted


def test_decisions_are_one_line_each_with_detail_behind_verbose(
    fake: tuple[FakeDaemon, str],
) -> None:
    _, addr = fake
    short = cli(addr, "decisions")
    assert short.exit_code == 0, short.output
    assert "(12s ago)" in short.output
    assert "table v2 unchanged; held slots [64]" in short.output
    assert "k=4" not in short.output and "--verbose" in short.output
    # An exact epoch in a message reads as a time: "until 13:08:09 (in 1m52s)".
    assert IN_112_S.search(short.output), short.output
    _no_raw_values(short.output)
    full = cli(addr, "decisions", "--verbose").output.replace("\n", " ")
    assert "k=4" in full
    rows = json.loads(cli(addr, "decisions", "--output", "json").output)
    assert rows[0]["message"] == HELD


def test_overrides_read_in_human_terms(fake: tuple[FakeDaemon, str]) -> None:
    _, addr = fake
    listed = cli(addr, "override", "list")
    assert listed.exit_code == 0, listed.output
    assert IN_112_S.search(listed.output), listed.output
    _no_raw_values(listed.output)
    done = cli(
        addr, "override", "set", "--slot", "1", "--steps", "0", "--ttl", "2m", "--reason", "r"
    )
    assert done.exit_code == 0, done.output
    assert done.output.startswith("override ov-1 set: slot 1 -> 0 steps until ")
    assert "{" not in done.output
    _no_raw_values(done.output)
    cleared = cli(addr, "override", "clear", "--all")
    assert cleared.exit_code == 0 and cleared.output.split() == ["cleared:", "1"]
    as_json = json.loads(cli(addr, "override", "clear", "--all", "--output", "json").output)
    assert as_json == {"cleared": 1}


def test_every_command_honours_output_table(fake: tuple[FakeDaemon, str]) -> None:
    _, addr = fake
    for args in (("policy", "list"), ("policy", "show"), ("recommend",)):
        table = cli(addr, *args)
        assert table.exit_code == 0, (args, table.output)
        assert not table.output.lstrip().startswith("{"), (args, table.output)
        assert "┃" in table.output or "│" in table.output, (args, table.output)
        data = json.loads(cli(addr, *args, "--output", "json").output)
        assert isinstance(data, dict)
    show = cli(addr, "policy", "show").output
    assert "goodput:slo_tpot_ms=40" in show and "slo_tpot_ms=40" in show
    assert "model-based" in show
    rec = cli(addr, "recommend").output
    assert "(from replay, predicted +6.1% on throughput_tok_s)" in " ".join(rec.split())
    switched = cli(addr, "policy", "set", "static:3")
    assert switched.exit_code == 0 and switched.output.strip() == "policy switched to static:3"


def test_policy_list_shows_the_current_policy_when_a_daemon_answers(
    fake: tuple[FakeDaemon, str],
) -> None:
    _, addr = fake
    out = cli(addr, "policy", "list").output
    assert f"current policy: goodput:slo_tpot_ms=40 (daemon at {addr})" in out
    data = json.loads(cli(addr, "policy", "list", "--output", "json").output)
    assert data["current"] == "goodput:slo_tpot_ms=40" and data["daemon"]["reachable"]


def test_policy_list_works_without_a_daemon() -> None:
    addr = f"127.0.0.1:{_free_port()}"  # nothing listens there
    result = cli(addr, "policy", "list")
    assert result.exit_code == 0, result.output
    for kind in KNOWN_KINDS:
        assert kind in result.output
    assert "current policy: unknown (no daemon answered" in result.output
    data = json.loads(cli(addr, "policy", "list", "--output", "json").output)
    assert data["current"] is None and data["kinds"] == list(KNOWN_KINDS)
    goodput = next(r for r in data["details"] if r["kind"] == "goodput")
    assert "slo_tpot_ms" in goodput["keys"] and "ttl_s" not in goodput["keys"]


def test_exit_codes_match_the_readme(fake: tuple[FakeDaemon, str]) -> None:
    _, addr = fake
    refused = cli(addr, "policy", "set", "bogus")  # the daemon's 400: bad usage
    assert refused.exit_code == 2 and "unknown policy kind" in refused.output
    unreachable = cli(f"127.0.0.1:{_free_port()}", "status")
    assert unreachable.exit_code == 3 and "is `specgov run` running?" in unreachable.output
    bad_addr = cli("nope", "status")
    assert bad_addr.exit_code == 2 and "HOST:PORT" in bad_addr.output
    bad_flag = cli(addr, "override", "clear")  # none of --id/--slot/--all
    assert bad_flag.exit_code == 2
    for result in (refused, unreachable, bad_addr, bad_flag):
        assert "Traceback" not in result.output


def test_policy_help_lists_every_kind() -> None:
    for command in (["run", "--help"], ["replay", "--help"]):
        out = CliRunner().invoke(main, command).output.replace("\n", " ")
        flat = re.sub(r"\s+", "", out)
        for kind in KNOWN_KINDS:
            assert kind in flat, (command, kind)
    assert "oracle" in CliRunner().invoke(main, ["replay", "--help"]).output


# ------------------------------------------------- a real daemon refuses bad targets


@contextmanager
def real_daemon(tmp_path: Path) -> Iterator[Any]:
    """A real Daemon (plugin mode, no store) against an in-process simulated server."""
    from specgov.controller.daemon.config import load_config
    from specgov.controller.daemon.runtime import Daemon
    from specgov.simulator.replay.runner import ServerSpec
    from specgov.simulator.server.core import SimServer
    from specgov.simulator.workload.synthetic import generate_trace
    from specgov.simulator.workload.synthetic_text import parse_synthetic_spec

    trace = generate_trace(parse_synthetic_spec("synthetic:duration=120,rate=5,seed=4"))
    sim = SimServer(trace, ServerSpec(), speed=10, spool_dir=tmp_path / "spool", loop_trace=True)
    sim.start()
    try:
        sim.wait_ready(30)
        config = load_config(
            None,
            env={},
            overrides={
                "server.url": sim.url,
                "spool.dir": str(tmp_path / "spool"),
                "state.db_path": str(tmp_path / "state.db"),
                "loop.mode": "plugin",
            },
        )
        yield Daemon(config, store=None)
    finally:
        sim.stop()


def test_override_on_a_slot_the_engine_lacks_or_steps_outside_its_candidates(
    tmp_path: Path,
) -> None:
    with real_daemon(tmp_path) as daemon:

        async def first_scrape() -> None:
            await daemon.scrape_once()

        with serve(daemon, before=first_scrape) as addr:
            layout = {b: ks for b, ks in daemon.status()["slots"]}
            lacking = cli(
                addr, "override", "set", "--slot", "5", "--steps", "0", "--ttl", "1m",
                "--reason", "x",
            )  # fmt: skip
            assert lacking.exit_code == 2, lacking.output
            assert "slot 5 is not an engine slot" in lacking.output
            assert f"valid slots: {sorted(layout)}" in lacking.output
            last = max(layout)
            outside = cli(
                addr, "override", "set", "--slot", str(last), "--steps", "9", "--ttl", "1m",
                "--reason", "x",
            )  # fmt: skip
            assert outside.exit_code == 2, outside.output
            assert f"steps 9 is not a candidate of slot(s) [{last}]" in outside.output
            assert str(layout[last]) in outside.output
            fine = cli(
                addr, "override", "set", "--slot", str(last), "--steps", str(layout[last][0]),
                "--ttl", "1m", "--reason", "x",
            )  # fmt: skip
            assert fine.exit_code == 0, fine.output
            # Issue 23: `policy set static:K` asks for K steps everywhere, as
            # `override set --steps K` does: refused the same way, not clamped silently.
            static = cli(addr, "policy", "set", "static:99")
            assert static.exit_code == 2, static.output
            assert "steps 99 is not a candidate of slot(s)" in static.output
            assert daemon.status()["policy"] != "static:99"
            everywhere = sorted(set.intersection(*(set(ks) for ks in layout.values())))
            ok = cli(addr, "policy", "set", f"static:{everywhere[-1]}")
            assert ok.exit_code == 0, ok.output
            for result in (lacking, outside, static):
                assert "Traceback" not in result.output


def test_disable_with_a_slot_override_status_says_what_the_table_does(tmp_path: Path) -> None:
    """Issue 23: `--disable` with a slot override showed "speculation off everywhere"
    while the table kept that slot speculating. The rule (docs/operations.md): a slot's
    own override wins over an every-slot one; status says which slots each one sets."""
    with real_daemon(tmp_path) as daemon:

        async def overridden_table() -> None:
            # Scrape until the engine's slots are known, then decide under both overrides.
            for _ in range(60):
                await daemon.scrape_once()
                if daemon.status()["slots"]:
                    break
                await asyncio.sleep(0.3)
            slots = {b: ks for b, ks in daemon.status()["slots"]}
            first = min(slots)
            assert 1 in slots[first], slots
            daemon.set_override(None, None, True, None, 600.0, "incident")
            daemon.set_override(first, 1, False, None, 600.0, "keep slot speculating")
            for _ in range(60):
                daemon.decide_once()
                table = daemon.status()["table"]
                if table is not None and dict(table["slots"]).get(first) == 1:
                    return
                await asyncio.sleep(0.3)
                await daemon.scrape_once()
            raise AssertionError(f"no overridden table: {daemon.status()['last_decision']}")

        with serve(daemon, before=overridden_table) as addr:
            data = json.loads(cli(addr, "status", "--output", "json").output)
            table = dict(data["table"]["slots"])
            first, rest = min(table), sorted(b for b in table if b != min(table))
            assert table[first] == 1 and all(table[b] == 0 for b in rest), table
            text = cli(addr, "status").output.replace("\n", " ")
            text = re.sub(r"\s*│\s*", " ", text)
            assert "speculation off everywhere" not in text, text
            assert f"speculation off in slots {', '.join(map(str, rest))}" in text, text
            assert f"slot {first} -> 1 steps" in text, text
