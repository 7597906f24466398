"""The daemon against the simulated SGLang server, as separate processes (issue 5, §7).

Each test starts `specgov sim-server` (accelerated real time, specgov's plugin on a spool
directory in tmp_path) and `specgov run --mode plugin` (SQLite store in tmp_path, control
API and /metrics on free loopback ports) and checks what an operator would see: the
published step tables (spool file, the sim-server's plugin state), the audit log
(`specgov decisions --output json`), `specgov status`, `specgov override ...`, /metrics,
and the daemon's behaviour across `kill -9`, a server restart and a 30 s outage.

The loop is fast (decide every 1 s, scrape every 0.5 s, tables live 6 s, stale after
3 s; ``BASE_CONFIG`` in conftest.py), so the file takes about two minutes on two cores,
most of it the 30 s outage.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import pytest

from specgov.policies.types import ReasonCode

from .conftest import (
    E2E,
    TELEMETRY_HOLDS,
    DaemonProc,
    SimServerProc,
    slot_steps,
    steps_for,
    tables_in_force,
    wait_until,
)

KNOWN_REASONS = frozenset(code.value for code in ReasonCode)

# Chat content with short prompts under a load ramp (test 1 explains the numbers).
RAMP_TRACE = (
    "synthetic:duration=480,rate=2.5,ramp=0:1+60:1+80:15+260:15+280:1+480:1,"
    "phases=chat@480,in=256,seed=1"
)
# Steady load for the tests that are not about load: chat traffic at about 2 req/s,
# replayed forever, at 10x (a few requests in flight: slots 1..8 are busy).
STEADY_TRACE = "synthetic:duration=120,rate=2,phases=chat@120,seed=2"
STEADY_SPEED = 10.0
# Reasons of a decision while an override is active (a rollback verdict outranks it).
OVERRIDE_REASONS = ("override_active", "rolled_back_regression")
MAX_STALENESS_S = 3.0  # BASE_CONFIG guardrails.max_staleness_s
# After the server is healthy again the daemon needs two scrapes (a counter window), a
# statistics window from the plugin and one decision: a few seconds. 10 s is generous.
RESUME_BOUND_S = 10.0


def _decisions_after(daemon: DaemonProc, t_s: float) -> list[dict[str, Any]]:
    return [r for r in daemon.api_decisions(since_s=t_s, limit=200) if r["time_s"] > t_s]


def _first_decision_after(daemon: DaemonProc, t_s: float, timeout_s: float) -> dict[str, Any]:
    def probe() -> dict[str, Any] | None:
        rows = _decisions_after(daemon, t_s)
        return rows[0] if rows else None

    return wait_until(probe, timeout_s=timeout_s, what=f"a decision after {t_s:.1f}")


def _first_published_after(daemon: DaemonProc, t_s: float, timeout_s: float) -> dict[str, Any]:
    def probe() -> dict[str, Any] | None:
        rows = [r for r in _decisions_after(daemon, t_s) if r["published"]]
        return rows[0] if rows else None

    return wait_until(probe, timeout_s=timeout_s, what=f"a table published after {t_s:.1f}")


def _plugin_follows_daemon(
    daemon_table_version: int | None = None,
) -> Callable[[dict[str, Any]], bool]:
    """A probe factory: the sim-server's plugin follows a daemon table (not the EMA)."""

    def check(state: dict[str, Any]) -> bool:
        plugin = state["plugin"]
        table = plugin["table"]
        return (
            plugin["mode"] == "table"
            and plugin["fallback_reason"] is None
            and table is not None
            and (daemon_table_version is None or table["version"] >= daemon_table_version)
        )

    return check


def _check_rows(rows: list[dict[str, Any]]) -> None:
    """Every audit row names a known reason, explains itself, and its inputs are sane
    (a counter reset must never show up as a negative rate)."""
    for row in rows:
        assert row["reason"] in KNOWN_REASONS, row
        assert row["message"].strip(), row
        assert row["policy"] == "goodput", row
        if row["published"]:
            assert row["table_after"] is not None, row
            assert row["table_after"]["reason"] == row["reason"], row
        inputs = row["inputs_summary"]
        for key in ("gen_throughput_tok_s", "running", "queued", "token_usage"):
            value = inputs.get(key)
            assert value is None or value >= 0, (key, row)
        accept = inputs.get("accept_length")
        assert accept is None or accept >= 1.0, row


def _check_publish_claims(rows: list[dict[str, Any]]) -> None:
    """A row whose message says a table went out was really published."""
    for row in rows:
        if row["message"].startswith(("published", "re-issued")):
            assert row["published"], f"says it published but did not: {row['message'][:200]}"


def _metric_samples(text: str) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value} (labels as rendered)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def _start_steady(e2e: E2E) -> tuple[SimServerProc, DaemonProc, dict[str, Any]]:
    sim = e2e.start_sim(STEADY_TRACE, speed=STEADY_SPEED, loop=True)
    daemon = e2e.start_daemon(sim)
    first = _first_published_after(daemon, 0.0, timeout_s=30)
    return sim, daemon, first


# --------------------------------------------------------------------------- 1. ramp


def test_load_ramp_zeroes_busy_high_slots_and_low_slots_speculate_again(e2e: E2E) -> None:
    # Chat content under SGLang's n-gram drafter (first-token acceptance ~0.35) with
    # short prompts (256 tokens): at batches of ~200 a verify costs more than it
    # returns (k=0 beats k=1 by 7-15 % at batches of 200-400), at small batches 4-6 steps
    # pay (+35 %). Load: 2.5 req/s, ramp to 37.5 req/s (batches of 200-450), hold to
    # 260 s, back down by 280 s, calm until 480 s; at 20x about 24 s.
    sim = e2e.start_sim(RAMP_TRACE, speed=20)
    daemon = e2e.start_daemon(sim)
    samples: list[dict[str, Any]] = []

    def trace_done() -> bool:
        state = sim.state()
        samples.append(state)
        return bool(state["sim_time_s"] >= 460 or state["status"] == "finished")

    wait_until(trace_done, timeout_s=90, what="the ramp trace to play out", interval_s=0.5)

    rows = daemon.decisions()
    _check_rows(rows)
    in_force = tables_in_force(rows)
    busy = [i for i, r in enumerate(rows) if (r["inputs_summary"].get("running") or 0) >= 128]
    assert len(busy) >= 3, [r["inputs_summary"].get("running") for r in rows]

    # At the peak the daemon published (changed or re-issued) a table that runs the busy
    # slot without speculation, and the engine ran 0 steps.
    def busy_steps(i: int, table: dict[str, Any] | None) -> int | None:
        return None if table is None else steps_for(table, rows[i]["inputs_summary"]["running"])

    peak_zero = [
        i for i in busy if rows[i]["published"] and busy_steps(i, rows[i]["table_after"]) == 0
    ]
    assert peak_zero, [(rows[i]["inputs_summary"]["running"], in_force[i]) for i in busy]
    assert any(rows[i]["inputs_summary"].get("spec_num_steps") == 0 for i in busy), [
        rows[i]["inputs_summary"] for i in busy
    ]
    # If the busy slot speculated when the peak began, a decision took it down, saying
    # why (a predicted gain).
    before_peak = in_force[busy[0] - 1] if busy[0] > 0 else None
    if (busy_steps(busy[0], before_peak) or 0) > 0:
        downs = [
            rows[i]
            for i in range(busy[0], peak_zero[0] + 1)
            if rows[i]["reason"] == "changed_predicted_gain" and "->0" in rows[i]["message"]
        ]
        assert downs, [rows[i]["message"][:120] for i in range(busy[0], peak_zero[0] + 1)]
        assert all(d["expected_gain"] is not None and d["expected_gain"] > 0 for d in downs)
    peak_table = slot_steps(rows[peak_zero[0]]["table_after"])
    assert peak_table[1] > 0 and peak_table[4] > 0, peak_table
    # The sim-server's plugin followed daemon tables at the peak (not SGLang's EMA).
    peak_samples = [s for s in samples if 100 <= s["sim_time_s"] <= 260]
    assert peak_samples, [s["sim_time_s"] for s in samples]
    followed = [s for s in peak_samples if _plugin_follows_daemon()(s)]
    assert followed, peak_samples[-1]["plugin"]
    assert any(s["plugin"]["table"]["slots"][-1][1] == 0 for s in followed)

    # When the load drops, the batches fall back into the low slots, where the table in
    # force has steps again (at least those of the peak table), and the engine runs them.
    calm = [
        i
        for i in range(busy[-1] + 1, len(rows))
        if 1 <= (rows[i]["inputs_summary"].get("running") or 0) <= 8
    ]
    assert calm, "no decision at low load after the peak"
    for i in calm:
        table = in_force[i]
        assert table is not None
        running = rows[i]["inputs_summary"]["running"]
        assert steps_for(table, running) >= max(
            1, steps_for(rows[peak_zero[0]]["table_after"], running)
        )
    assert any((rows[i]["inputs_summary"].get("spec_num_steps") or 0) >= 1 for i in calm)

    # Reasons are recorded: the first table is `initial`, later rows name their cause;
    # the spool holds a table the audit log recorded as published.
    published = [r for r in rows if r["published"]]
    assert published[0]["reason"] == "initial"
    assert len({r["reason"] for r in rows}) >= 2
    _check_publish_claims(rows)
    spool = sim.spool_table()
    assert spool is not None
    logged = {r["table_after"]["version"]: r for r in daemon.decisions() if r["published"]}
    assert spool["version"] in logged
    assert spool["slots"] == logged[spool["version"]]["table_after"]["slots"]
    assert daemon.proc.alive()


# ----------------------------------------------------------------------- 2. override


def test_override_applies_next_decision_expires_on_time_and_clears(e2e: E2E) -> None:
    sim, daemon, table = _start_steady(e2e)
    assert slot_steps(table["table_after"])[1] > 0, f"slot 1 should speculate: {table}"

    # Set: the very next decision publishes slot 1 = 0 with reason override_active.
    done = daemon.cli(
        "override", "set", "--slot", "1", "--steps", "0", "--ttl", "6s", "--reason", "e2e",
        "--output", "json",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    override = json.loads(done.stdout)
    assert (override["slot"], override["steps"], override["reason"]) == (1, 0, "e2e")
    created = override["created_at_s"]
    assert override["expires_at_s"] == pytest.approx(created + 6.0)
    first = _first_decision_after(daemon, created, timeout_s=10)
    # A rollback verdict on an earlier policy change would outrank the reason (the
    # override still applies to its slot).
    assert first["reason"] in OVERRIDE_REASONS, first
    assert first["published"] and slot_steps(first["table_after"])[1] == 0, first
    # Within one decision interval (1 s), with slack for a busy machine.
    assert first["time_s"] - created <= 2.0
    listed = daemon.cli_json("override", "list")
    assert [o["id"] for o in listed] == [override["id"]]
    spool = sim.spool_table()
    assert spool is not None and slot_steps(spool)[1] == 0

    # Expiry: in force until expires_at_s, gone at the first decision after it.
    expires = override["expires_at_s"]
    after = _first_decision_after(daemon, expires, timeout_s=15)
    rows = daemon.decisions()
    pairs = list(zip(rows, tables_in_force(rows), strict=True))
    during = [(r, t) for r, t in pairs if first["time_s"] <= r["time_s"] < expires]
    assert len(during) >= 4, [r["time_s"] for r, _ in during]
    for row, t in during:
        assert t is not None and slot_steps(t)[1] == 0, row
        assert row["reason"] in OVERRIDE_REASONS, row
    assert after["published"] and slot_steps(after["table_after"])[1] > 0, after
    assert "override expired" in after["message"], after["message"]
    assert after["time_s"] - expires <= 2.0
    assert daemon.cli_json("override", "list") == []

    # Clear: a long override, then `override clear --all` reverts at the next decision.
    done = daemon.cli(
        "override", "set", "--slot", "1", "--steps", "0", "--ttl", "5m", "--reason", "e2e-clear",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    wait_until(
        lambda: (t := daemon.api("status")["table"]) and slot_steps(t)[1] == 0,
        timeout_s=10,
        what="the second override in the table",
    )
    t_clear = time.time()
    done = daemon.cli("override", "clear", "--all")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["cleared:", "1"], done.stdout
    reverted = _first_decision_after(daemon, t_clear, timeout_s=10)
    assert reverted["published"] and slot_steps(reverted["table_after"])[1] > 0, reverted
    assert daemon.cli_json("override", "list") == []

    # `specgov status --output json` and the daemon's /metrics, once.
    status = daemon.status()
    assert (status["mode"], status["policy"], status["server"]) == ("plugin", "goodput", sim.url)
    assert status["decisions"] >= len(rows) and status["tables_published"] >= 3
    assert status["permanent_error"] is None and status["store_error"] is None
    assert status["spool_error"] is None and status["last_scrape_error"] is None
    assert status["table"] is not None and slot_steps(status["table"])[1] > 0
    assert status["overrides"] == []
    assert status["observation"]["running"] is not None
    samples = _metric_samples(daemon.metrics_text())
    decided = 'specgov_decisions_total{policy="goodput",reason="%s"}'
    assert samples.get(decided % "override_active", 0) >= 5
    assert samples.get(decided % "initial") == 1
    total = sum(v for k, v in samples.items() if k.startswith("specgov_decisions_total{"))
    assert total >= len(rows)
    assert samples.get('specgov_table_steps{slot="1"}') == slot_steps(status["table"])[1]
    assert samples.get("specgov_override_active") == 0
    assert samples.get("specgov_decide_duration_seconds_count", 0) >= len(rows)
    final = daemon.decisions()
    _check_rows(final)
    _check_publish_claims(final)

    # SIGTERM: the daemon finishes its step, persists and exits 0 within the grace period.
    assert daemon.proc.stop() == 0, daemon.proc.log_text()[-2000:]
    assert "Traceback" not in daemon.proc.log_text()


# ------------------------------------------------------------------------ 3. kill -9


def test_kill_9_then_restart_keeps_audit_learned_state_and_override(e2e: E2E) -> None:
    sim, daemon, _ = _start_steady(e2e)
    done = daemon.cli(
        "override", "set", "--slot", "4", "--steps", "1", "--ttl", "10m", "--reason", "e2e-kill",
        "--output", "json",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    override = json.loads(done.stdout)
    in_table = _first_published_after(daemon, override["created_at_s"], timeout_s=10)
    assert slot_steps(in_table["table_after"])[4] == 1, in_table
    time.sleep(2.5)  # a few more decisions

    seen = daemon.cli_json("decisions", "--limit", "1000")
    before_kill = daemon.count_rows("decisions")
    assert before_kill >= len(seen) >= 3
    daemon.proc.kill9()
    killed_at = time.time()
    # Nothing committed is lost: every row seen before the kill is in the file after it,
    # with the learned state and the override.
    assert daemon.count_rows("decisions") >= before_kill
    assert daemon.count_rows("policy_state", "WHERE policy = 'goodput'") >= 1
    assert daemon.count_rows("overrides", "WHERE cleared_at_s IS NULL") == 1
    last = sim.spool_table()
    assert last is not None and slot_steps(last)[4] == 1
    expires_at = last["produced_at_s"] + last["ttl_s"]
    assert expires_at > killed_at

    # The plugin keeps serving the last table until its TTL, then falls back to the EMA.
    serving: list[dict[str, Any]] = []

    def fell_back() -> dict[str, Any] | None:
        plugin = sim.state()["plugin"]
        sample = {"at": time.time(), **plugin}
        if plugin["table"] is not None:
            serving.append(sample)
            return None
        return sample

    fallback = wait_until(fell_back, timeout_s=last["ttl_s"] + 10, what="the plugin's fallback")
    assert serving, "the plugin dropped the table at once after the kill"
    # (A table published just before the kill may reach the plugin a poll later.)
    assert all(s["table"]["version"] <= last["version"] for s in serving)
    assert serving[-1]["table"]["version"] == last["version"]
    assert all(s["fallback_reason"] is None and s["mode"] == "table" for s in serving)
    # Expiry is judged at the plugin's poll boundaries on its (wall-mapped) clock: 0.5 s.
    assert fallback["at"] >= expires_at - 0.5, (fallback["at"], expires_at)
    assert fallback["fallback_reason"] in ("expired", "no_table"), fallback
    fallback_batches = fallback["fallback_batches"]
    assert fallback_batches.get("expired", 0) + fallback_batches.get("no_table", 0) > 0

    # Restart on the same database.
    restarted = e2e.start_daemon(sim, db_path=daemon.db_path)
    wait_until(
        lambda: "restored learned state of goodput" in restarted.proc.log_text(),
        timeout_s=10,
        what="the 'restored learned state' log line",
    )
    listed = restarted.cli_json("override", "list")
    assert [o["id"] for o in listed] == [override["id"]], listed
    assert (listed[0]["slot"], listed[0]["steps"], listed[0]["reason"]) == (4, 1, "e2e-kill")
    republished = _first_published_after(restarted, killed_at, timeout_s=15)
    assert republished["reason"] in OVERRIDE_REASONS, republished
    assert slot_steps(republished["table_after"])[4] == 1, republished
    # The guard state came back too: versions continue, no second `initial` table.
    assert republished["table_after"]["version"] > last["version"]
    wait_until(
        lambda: _plugin_follows_daemon(republished["table_after"]["version"])(sim.state()),
        timeout_s=10,
        what="the plugin following the restarted daemon",
    )
    rows = restarted.decisions()
    assert [r["id"] for r in rows[: len(seen)]] == [r["id"] for r in reversed(seen)]
    assert sum(r["reason"] == "initial" for r in rows) == 1
    assert len(rows) > before_kill
    _check_rows(rows)


def test_restarted_daemon_only_claims_tables_it_published(e2e: E2E) -> None:
    sim, daemon, _ = _start_steady(e2e)
    daemon.proc.stop()
    # Older than keepalive_fraction * table_ttl_s (3 s): due for re-issue at restart.
    time.sleep(3.5)
    t_restart = time.time()
    restarted = e2e.start_daemon(sim, db_path=daemon.db_path)
    _first_published_after(restarted, t_restart, timeout_s=10)
    rows = restarted.decisions()
    _check_rows(rows)
    _check_publish_claims(rows)


# ------------------------------------------------------- 4. restart and outage


def test_sim_server_restart_counter_reset_holds_then_resumes(e2e: E2E) -> None:
    sim, daemon, _ = _start_steady(e2e)
    time.sleep(2)

    # Connections refused for 6 s, /health 503 for 2 s more, then fresh counters.
    t_restart = time.time()
    sim.restart(down_s=6, starting_s=2)
    wait_until(
        lambda: sim.healthy() and sim.state()["generation"] == 1,
        timeout_s=20,
        what="the restarted sim-server",
    )
    t_up = time.time()
    assert daemon.proc.alive() and daemon.reachable()

    # No table change while the server was away: only held decisions once telemetry went
    # stale, and the steps in force stayed those from before the restart.
    rows = daemon.decisions()
    _check_rows(rows)
    pairs = list(zip(rows, tables_in_force(rows), strict=True))
    before = [t for r, t in pairs if r["time_s"] <= t_restart]
    assert before and before[-1] is not None
    down = [(r, t) for r, t in pairs if t_restart < r["time_s"] <= t_restart + 6.0]
    assert len(down) >= 4, [r["time_s"] for r, _ in down]
    for row, t in down:
        assert t is not None and t["slots"] == before[-1]["slots"], row
        if row["time_s"] >= t_restart + MAX_STALENESS_S + 1.5:
            assert row["reason"] in TELEMETRY_HOLDS, row

    # Back up: the daemon publishes for the new server within a few seconds and its
    # plugin follows the table; every decision that says it published, did.
    published = _first_published_after(daemon, t_up, timeout_s=RESUME_BOUND_S)
    assert published["time_s"] - t_up <= RESUME_BOUND_S
    wait_until(
        lambda: _plugin_follows_daemon()(sim.state()),
        timeout_s=RESUME_BOUND_S,
        what="the restarted server's plugin following a daemon table",
    )
    rows = daemon.decisions()
    _check_rows(rows)
    _check_publish_claims(rows)
    assert daemon.proc.alive()


@pytest.mark.slow
def test_30s_outage_freezes_the_table_and_control_resumes(e2e: E2E) -> None:
    sim, daemon, _ = _start_steady(e2e)
    time.sleep(2)

    # 30 s of connection refused on every route; the engine keeps serving.
    fallback_before = sim.state()["plugin"]["fallback_batches"]
    t_out = time.time()
    sim.outage(30, "refuse")
    while time.time() < t_out + 30:
        assert daemon.proc.alive(), daemon.proc.log_text()[-2000:]
        assert daemon.reachable()
        time.sleep(1.0)
    wait_until(sim.healthy, timeout_s=10, what="the sim-server after the outage")
    t_back = time.time()
    wait_until(
        lambda: [r for r in _decisions_after(daemon, t_back) if r["reason"] not in TELEMETRY_HOLDS],
        timeout_s=RESUME_BOUND_S,
        what="a decision on fresh telemetry after the outage",
    )
    status = daemon.status()
    assert status["last_scrape_error"] is None and status["permanent_error"] is None
    assert status["scrape_errors"] > 0
    assert status["last_scrape_age_s"] is not None and status["last_scrape_age_s"] < 3
    # The plugin never fell back: the frozen table was re-issued before its TTL throughout.
    fallback_after = sim.state()["plugin"]["fallback_batches"]
    for reason in ("expired", "no_table"):
        assert fallback_after.get(reason, 0) == fallback_before.get(reason, 0), fallback_after

    rows = daemon.decisions()
    _check_rows(rows)
    _check_publish_claims(rows)
    pairs = list(zip(rows, tables_in_force(rows), strict=True))
    frozen = [
        (r, t) for r, t in pairs if t_out + MAX_STALENESS_S + 1.5 <= r["time_s"] <= t_out + 30
    ]
    assert len(frozen) >= 20, len(frozen)
    held = frozen[0][1]
    assert held is not None
    for row, t in frozen:
        assert row["reason"] in TELEMETRY_HOLDS, row
        assert t is not None and t["slots"] == held["slots"], row
    assert sum(r["published"] for r, _ in frozen) >= 5, "the held table was not kept alive"
    samples = _metric_samples(daemon.metrics_text())
    assert samples.get('specgov_scrape_errors_total{kind="temporary"}', 0) >= 10
    stale = 'specgov_decisions_total{policy="goodput",reason="held_stale_telemetry"}'
    assert samples.get(stale, 0) >= 10
    assert daemon.proc.alive()
