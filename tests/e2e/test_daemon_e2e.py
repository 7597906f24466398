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

No test sleeps for a fixed time or bounds an effect by wall-clock time: each waits for the
event it needs (an audit row, a spool version, the sim-server refusing or answering) and
compares audit rows with the daemon-side time of an operator action (``created_at_s``,
``expires_at_s``, the store's ``cleared_at_s``) or with an interval in which the server
was seen refusing connections (conftest.py, ``watch_down_window``).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Sequence
from typing import Any

import pytest

from specgov.policies.common.decisions import ReasonCode

from .conftest import (
    E2E,
    EVENT_TIMEOUT_S,
    TELEMETRY_HOLDS,
    DaemonProc,
    DownWindow,
    SimServerProc,
    brief,
    briefs,
    reachable_steps,
    slot_steps,
    steps_for,
    tables_in_force,
    wait_until,
    watch_down_window,
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
KEEPALIVE_AGE_S = 3.0  # BASE_CONFIG table_ttl_s * keepalive_fraction
# A scrape in flight when the sim-server closes its port may still be answered: aiohttp's
# runner drains handlers for up to its shutdown_timeout (1 s, simulator/server/http_front.py).
DRAIN_S = 1.0
# How long an override set by the first test stays in force: long enough for several
# decisions at 1 s (it is checked by count, not by time).
OVERRIDE_TTL_S = 8.0


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
    first = daemon.first_decision_after(0.0, published=True, what="the first published table")
    return sim, daemon, first


def _settle(sim: SimServerProc, daemon: DaemonProc, first: dict[str, Any]) -> None:
    """The plugin follows a daemon table and the daemon made two more decisions."""
    wait_until(
        lambda: _plugin_follows_daemon(first["table_after"]["version"])(sim.state()),
        what="the plugin following the daemon's first table",
    )
    daemon.wait_decisions_after(first["time_s"], 2, "steady control before the disturbance")


def _in_window(
    rows: Sequence[dict[str, Any]], start_s: float, end_s: float
) -> list[tuple[dict[str, Any], dict[str, Any] | None]]:
    """(row, table in force after it) for the decisions with start_s <= time_s <= end_s."""
    pairs = zip(rows, tables_in_force(rows), strict=True)
    return [(r, t) for r, t in pairs if start_s <= r["time_s"] <= end_s]


def _probe_changes(down: DownWindow) -> list[tuple[str, float]]:
    """Each probe whose outcome differs from the one before it: the bracket's evidence."""
    changes: list[tuple[str, float]] = []
    for probe in down.probes:
        if not changes or changes[-1][0] != probe.outcome:
            changes.append((probe.outcome, round(probe.started_s, 3)))
    return changes


def _check_frozen(
    rows: list[dict[str, Any]], down: DownWindow, *, from_s: float, min_rows: int, min_stale: int
) -> None:
    """From ``from_s`` until the server was last seen refusing connections, the table in
    force changed only by decisions on telemetry scraped before the port was seen closed
    (a decision's observation is ``staleness_s`` old: up to max_staleness_s the daemon
    rightly acts on the last scrape it has), and every decision in that span made more
    than max_staleness_s after the port was seen closed held for stale/unknown telemetry."""
    pairs = list(zip(rows, tables_in_force(rows), strict=True))
    before = [t for r, t in pairs if r["time_s"] < from_s]
    assert before and before[-1] is not None, briefs(rows)
    held = before[-1]
    window = _in_window(rows, from_s, down.refused_until_s)
    context = (
        f"server seen refusing {down.refused_from_s:.3f}..{down.refused_until_s:.3f}, "
        f"checked from {from_s:.3f}; table in force before: v{held['version']} "
        f"{held['slots']}\nprobes (outcome changes): {_probe_changes(down)}"
        f"\n{briefs(rows)}"
    )
    assert len(window) >= min_rows, context
    current = held
    for row, table in window:
        assert table is not None, context
        if table["slots"] != current["slots"]:
            seen_at = row["time_s"] - (row["inputs_summary"].get("staleness_s") or 0.0)
            assert seen_at < down.refused_from_s, f"changed on blind telemetry: {row}\n{context}"
            current = table
    stale_from = down.refused_from_s + MAX_STALENESS_S + DRAIN_S
    stale = [r for r, _ in window if r["time_s"] > stale_from]
    assert len(stale) >= min_stale, context
    for row in stale:
        assert row["reason"] in TELEMETRY_HOLDS, context


# --------------------------------------------------------------------------- 1. ramp


def _assert_follows_policy_plan(row: dict[str, Any], *, slot: int, context: str) -> int:
    """``row`` published a table whose ``slot`` runs the daemon policy's own plan for it
    (the goodput policy's per-slot summary "slot N: k=K ..." in the message), not an
    override's step; returns that step."""
    table = row["table_after"]
    detail = f"{context}\nrow: {brief(row)}\nfull message: {row['message']}"
    assert row["published"] and table is not None, detail
    assert row["reason"] not in OVERRIDE_REASONS, detail
    planned = re.search(rf"policy goodput: .*?\bslot {slot}: k=(\d+)", row["message"])
    assert planned is not None, detail
    chosen = slot_steps(table)[slot]
    assert chosen == int(planned.group(1)), detail
    return chosen


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

    # 24 s at 20x on an idle machine; the sim slows down (re-anchors) when starved.
    wait_until(trace_done, timeout_s=300, what="the ramp trace to play out", interval_s=0.5)

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
    # force has steps again (within one of the peak table's: goodput's optimum is flat over
    # k = 4..6 there with the per-token acceptance model, and the acceptance it re-learns
    # after the peak may move it by one), and the engine runs them. A slot with a live rule
    # (table format 2) runs the rule's step for the live acceptance: its published step is
    # only the rule's starting point, so the rule must be able to reach that many steps.
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
        assert max(reachable_steps(table, running)) >= max(
            1, steps_for(rows[peak_zero[0]]["table_after"], running) - 1
        ), (running, table)
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

    # Set: the first decision after the daemon accepted it (its created_at_s, the daemon's
    # clock, as the audit rows' time_s) publishes slot 1 = 0 with reason override_active.
    done = daemon.cli(
        "override", "set", "--slot", "1", "--steps", "0", "--ttl", f"{OVERRIDE_TTL_S:g}s",
        "--reason", "e2e", "--output", "json",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    override = json.loads(done.stdout)
    assert (override["slot"], override["steps"], override["reason"]) == (1, 0, "e2e")
    created = override["created_at_s"]
    expires = override["expires_at_s"]
    assert expires == pytest.approx(created + OVERRIDE_TTL_S)
    first = daemon.first_decision_after(created, what="the first decision after the override")
    # A rollback verdict on an earlier policy change would outrank the reason (the
    # override still applies to its slot).
    assert first["reason"] in OVERRIDE_REASONS, first
    assert first["published"] and slot_steps(first["table_after"])[1] == 0, first
    # The operator's action is an audit row of its own (issue 23 §3).
    audit = [r for r in daemon.audit_rows() if r["reason"] == "override_set"]
    assert [r["inputs_summary"]["override"]["id"] for r in audit] == [override["id"]]

    # Expiry: in force for every decision before expires_at_s (daemon clock), gone at the
    # first decision after it.
    after = daemon.first_decision_after(expires, what="the first decision after the expiry")
    rows = daemon.decisions()
    during = _in_window(rows, first["time_s"], expires - 1e-6)
    assert len(during) >= 4, briefs([r for r, _ in during])
    for row, t in during:
        assert t is not None and slot_steps(t)[1] == 0, row
        assert row["reason"] in OVERRIDE_REASONS, row
    # Slot 1 is the policy's again: the table follows the policy's own plan for it (see
    # the clear below for why that plan may be 0 on a loaded machine).
    _assert_follows_policy_plan(after, slot=1, context=f"expired at {expires:.3f}")
    assert "override expired" in after["message"], after["message"]
    assert daemon.cli_json("override", "list") == []

    # Clear: a long override, then `override clear --all` reverts at the first decision
    # after the daemon cleared it (the store's cleared_at_s, on the daemon's clock).
    second = daemon.cli_json(
        "override", "set", "--slot", "1", "--steps", "0", "--ttl", "5m", "--reason", "e2e-clear",
    )  # fmt: skip
    applied = daemon.first_decision_after(
        second["created_at_s"], what="the first decision after the second override"
    )
    assert applied["published"] and slot_steps(applied["table_after"])[1] == 0, applied
    # In force until cleared: listed, and every table in the spool since has slot 1 = 0.
    listed = daemon.cli_json("override", "list")
    assert [o["id"] for o in listed] == [second["id"]], listed
    spool = sim.spool_table()
    assert spool is not None and spool["version"] >= applied["table_after"]["version"], spool
    assert slot_steps(spool)[1] == 0, spool
    done = daemon.cli("override", "clear", "--all")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["cleared:", "1"], done.stdout
    cleared_at = daemon.override_cleared_at(second["id"])
    assert cleared_at is not None and cleared_at > second["created_at_s"], cleared_at
    reverted = daemon.first_decision_after(cleared_at, what="the first decision after the clear")
    # Slot 1 is the policy's again at once: the first decision after the clear publishes
    # the policy's own step for it (an override's 0 is the operator's, not the policy's
    # incumbent), and the live rule the plugin follows from there starts on that step.
    # The step itself may differ from the one before the overrides, 0 included: the
    # policy kept learning while they held (measured: 5 vs 2 in one full run; 0 in two
    # CI runs on a loaded machine, at the expiry and at the clear; the policy's way back
    # from 0 is its probes, tested in the policy's own tests).
    context = f"cleared at {cleared_at:.3f}\n" + briefs(daemon.decisions_after(applied["time_s"]))
    chosen = _assert_follows_policy_plan(reverted, slot=1, context=context)
    after_clear = reverted["table_after"]
    assert "return to the policy" in reverted["message"], reverted["message"]
    rule = {int(b): r for b, r in after_clear.get("rules") or ()}.get(1)
    if rule is not None:
        band = sum(1 for t in rule["thresholds"] if t <= rule["prior"])
        assert rule["steps"][band] == chosen, rule
    assert daemon.cli_json("override", "list") == []

    # `specgov status --output json` and the daemon's /metrics, read with no change of the
    # steps in force between them (the daemon keeps deciding, and re-issuing its table
    # under a new version every few seconds, while the test reads).
    def slots_now() -> Any:
        table = daemon.api("status")["table"]
        return None if table is None else table["slots"]

    def consistent_read() -> tuple[dict[str, Any], dict[str, float]] | None:
        before = slots_now()
        status = daemon.status()
        samples = _metric_samples(daemon.metrics_text())
        after = slots_now()
        unchanged = status["table"] is not None and before == status["table"]["slots"] == after
        return (status, samples) if unchanged else None

    status, samples = wait_until(consistent_read, what="status and /metrics under one table")
    assert (status["mode"], status["policy"], status["server"]) == ("plugin", "goodput", sim.url)
    assert status["decisions"] >= len(rows) and status["tables_published"] >= 3
    assert status["permanent_error"] is None and status["store_error"] is None
    assert status["spool_error"] is None and status["last_scrape_error"] is None
    # The table status shows is the one a decision after the clear published: slot 1
    # runs the policy's plan again (see the clear's check above).
    assert status["table"] is not None
    shown = [
        r for r in daemon.decisions()
        if r["published"] and (r["table_after"] or {}).get("version") == status["table"]["version"]
    ]  # fmt: skip
    assert len(shown) == 1 and shown[0]["time_s"] >= reverted["time_s"], briefs(shown)
    assert slot_steps(shown[0]["table_after"]) == slot_steps(status["table"]), shown
    assert shown[0]["reason"] not in OVERRIDE_REASONS, briefs(shown)
    assert status["overrides"] == []
    assert status["observation"]["running"] is not None
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
    in_table = daemon.first_decision_after(
        override["created_at_s"], published=True, what="the override in a published table"
    )
    assert slot_steps(in_table["table_after"])[4] == 1, in_table
    daemon.wait_decisions_after(in_table["time_s"], 3, "a few decisions under the override")

    # Kill just after a table reaches the spool, so it has most of its TTL left.
    version = sim.spool_version()
    wait_until(lambda: sim.spool_version() > version, what="the next table in the spool")
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

    fallback = wait_until(fell_back, what="the plugin's fallback")
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
        what="the 'restored learned state' log line",
    )
    listed = restarted.cli_json("override", "list")
    assert [o["id"] for o in listed] == [override["id"]], listed
    assert (listed[0]["slot"], listed[0]["steps"], listed[0]["reason"]) == (4, 1, "e2e-kill")
    republished = restarted.first_decision_after(
        killed_at, published=True, what="a table from the restarted daemon"
    )
    assert republished["reason"] in OVERRIDE_REASONS, republished
    assert slot_steps(republished["table_after"])[4] == 1, republished
    # The guard state came back too: versions continue, no second `initial` table.
    assert republished["table_after"]["version"] > last["version"]
    wait_until(
        lambda: _plugin_follows_daemon(republished["table_after"]["version"])(sim.state()),
        what="the plugin following the restarted daemon",
    )
    # Every audit row of before the kill is still there (the override's own row too).
    audited = restarted.audit_rows()
    assert [r["id"] for r in audited[: len(seen)]] == [r["id"] for r in reversed(seen)]
    assert len(audited) > before_kill
    rows = restarted.decisions()
    assert sum(r["reason"] == "initial" for r in rows) == 1
    _check_rows(rows)


def test_restarted_daemon_only_claims_tables_it_published(e2e: E2E) -> None:
    sim, daemon, _ = _start_steady(e2e)
    daemon.proc.stop()
    last = sim.spool_table()
    assert last is not None
    # Older than keepalive_fraction * table_ttl_s: due for re-issue at restart.
    wait_until(
        lambda: time.time() - last["produced_at_s"] > KEEPALIVE_AGE_S + 0.5,
        what="the spool's table to be due for re-issue",
    )
    t_restart = time.time()
    restarted = e2e.start_daemon(sim, db_path=daemon.db_path)
    restarted.first_decision_after(t_restart, published=True, what="the restarted daemon's table")
    rows = restarted.decisions()
    _check_rows(rows)
    _check_publish_claims(rows)


# ------------------------------------------------------- 4. restart and outage


def test_sim_server_restart_counter_reset_holds_then_resumes(e2e: E2E) -> None:
    sim, daemon, first = _start_steady(e2e)
    _settle(sim, daemon, first)

    # Connections refused for 10 s, /health 503 for 2 s more, then fresh counters. The
    # window the probes see can be seconds shorter than the server's (a probe that times out
    # on a loaded machine says nothing about the port), and at least one decision must fall
    # more than max_staleness_s + drain after the first refusal seen: 10 s leaves room.
    sim.restart(down_s=10, starting_s=2)
    down = watch_down_window(
        sim,
        back=lambda: sim.state()["generation"] == 1,
        timeout_s=10 + 2 + EVENT_TIMEOUT_S,
    )
    assert daemon.proc.alive() and daemon.reachable()

    # No table change while the server was away: the steps in force stayed those from
    # before it went down, and once its telemetry was stale every decision held.
    rows = daemon.decisions()
    _check_rows(rows)
    _check_frozen(rows, down, from_s=down.refused_from_s, min_rows=4, min_stale=1)

    # Back up: the daemon publishes for the new server and its plugin follows the table;
    # every decision that says it published, did.
    daemon.first_decision_after(down.back_s, published=True, what="a table after the restart")
    wait_until(
        lambda: _plugin_follows_daemon()(sim.state()),
        what="the restarted server's plugin following a daemon table",
    )
    rows = daemon.decisions()
    _check_rows(rows)
    _check_publish_claims(rows)
    assert daemon.proc.alive()


@pytest.mark.slow
def test_30s_outage_freezes_the_table_and_control_resumes(e2e: E2E) -> None:
    sim, daemon, first = _start_steady(e2e)
    _settle(sim, daemon, first)

    # 30 s of connection refused on every route; the engine keeps serving.
    fallback_before = sim.state()["plugin"]["fallback_batches"]

    def daemon_up() -> None:
        assert daemon.proc.alive(), daemon.proc.log_text()[-2000:]
        assert daemon.reachable()

    sim.outage(30, "refuse")
    down = watch_down_window(
        sim, back=lambda: True, timeout_s=30 + EVENT_TIMEOUT_S, while_down=daemon_up
    )
    fresh = wait_until(
        lambda: [
            r for r in daemon.decisions_after(down.back_s) if r["reason"] not in TELEMETRY_HOLDS
        ],
        what="a decision on fresh telemetry after the outage",
    )
    assert fresh[0]["inputs_summary"]["staleness_s"] <= MAX_STALENESS_S, fresh[0]
    status = wait_until(
        lambda: (
            (s := daemon.status())["last_scrape_age_s"] is not None
            and s["last_scrape_age_s"] < MAX_STALENESS_S
            and s
        ),
        what="status showing a current scrape",
    )
    assert status["last_scrape_error"] is None and status["permanent_error"] is None
    assert status["scrape_errors"] > 0
    # The plugin never fell back: the frozen table was re-issued before its TTL throughout.
    fallback_after = sim.state()["plugin"]["fallback_batches"]
    for reason in ("expired", "no_table"):
        assert fallback_after.get(reason, 0) == fallback_before.get(reason, 0), fallback_after

    rows = daemon.decisions()
    _check_rows(rows)
    _check_publish_claims(rows)
    # Frozen once the telemetry went stale (the engine keeps running and its plugin keeps
    # writing statistics, so before that the daemon may still act).
    frozen_from = down.refused_from_s + MAX_STALENESS_S + DRAIN_S
    _check_frozen(rows, down, from_s=frozen_from, min_rows=20, min_stale=20)
    frozen = _in_window(rows, frozen_from, down.refused_until_s)
    assert sum(r["published"] for r, _ in frozen) >= 5, "the held table was not kept alive"
    samples = _metric_samples(daemon.metrics_text())
    assert samples.get('specgov_scrape_errors_total{kind="temporary"}', 0) >= 10
    stale = 'specgov_decisions_total{policy="goodput",reason="held_stale_telemetry"}'
    assert samples.get(stale, 0) >= 10
    assert daemon.proc.alive()
