"""`specgov status` against a standalone `specgov sim-server` running accelerated.

The daemon measures rates over its own (wall) clock; the sim-server says in /server_info
how many simulated seconds pass per wall second (``specgov_sim_speed``), the daemon's
status carries it (``sim_speed``) and `specgov status` shows the rate in simulated
tokens per second, labelled so. The test compares that number with the sim-server's own
throughput in simulated time (decode tokens over its simulated clock).
"""

from __future__ import annotations

import re
import statistics
from typing import Any

import pytest

from specgov.adapters.prometheus_text import counter_by_dp, parse_metrics
from specgov.adapters.telemetry import REALTIME_DECODE_MODE, REALTIME_TOKENS

from .conftest import E2E, SimServerProc, http_text, wait_until

SPEED = 20.0
# Steady Poisson load the server serves within the SLO at this speed.
TRACE = "synthetic:duration=120,rate=6,phases=chat@120,seed=4"
SAMPLES = 8
SIMULATED = re.compile(r"([\d,]+) tok/s simulated \(([\d,]+) per wall second at 20x\)")


def _sim_clock_and_tokens(sim: SimServerProc) -> tuple[float, float]:
    """(simulated seconds, decode tokens so far) of the sim-server, read together."""
    sim_s = float(sim.state()["sim_time_s"])
    snap = parse_metrics(http_text(f"{sim.url}/metrics"), source="sim /metrics")
    tokens = counter_by_dp(snap, REALTIME_TOKENS, match={"mode": REALTIME_DECODE_MODE})
    return sim_s, tokens[None].value


def _scrape_at(status: dict[str, Any]) -> float:
    """When the daemon last scraped, on its uptime clock (the age alone moves every read)."""
    return float(status["uptime_s"]) - float(status["last_scrape_age_s"])


def _after_scrape(status: dict[str, Any], after_s: float) -> dict[str, Any] | None:
    return status if _scrape_at(status) > after_s + 1e-3 else None


def test_status_shows_simulated_tok_s_of_an_accelerated_sim_server(e2e: E2E) -> None:
    sim = e2e.start_sim(TRACE, speed=SPEED, loop=True)
    daemon = e2e.start_daemon(sim)

    def status_with_rate() -> dict[str, Any] | None:
        s = daemon.api("status")
        obs = s.get("observation") or {}
        return s if obs.get("gen_throughput_tok_s") else None

    first = wait_until(status_with_rate, what="a status with a measured throughput")
    assert first["sim_speed"] == SPEED  # read from the sim-server's /server_info

    # The daemon's rate (per wall second) over several scrape windows, and the
    # sim-server's own simulated throughput over the same stretch.
    start = _sim_clock_and_tokens(sim)
    wall_rates: list[float] = []
    seen_scrape = _scrape_at(first)
    while len(wall_rates) < SAMPLES:
        s = wait_until(
            lambda after=seen_scrape: _after_scrape(daemon.api("status"), after),
            what="the daemon's next scrape",
        )
        seen_scrape = _scrape_at(s)
        rate = (s.get("observation") or {}).get("gen_throughput_tok_s")
        if isinstance(rate, int | float) and rate > 0:
            wall_rates.append(float(rate))
    end = _sim_clock_and_tokens(sim)
    sim_rate = (end[1] - start[1]) / (end[0] - start[0])
    assert sim_rate > 0
    daemon_simulated = statistics.fmean(wall_rates) / SPEED
    assert daemon_simulated == pytest.approx(sim_rate, rel=0.25), (wall_rates, sim_rate)

    # What an operator reads: simulated tok/s as the headline, the wall rate beside it.
    done = daemon.cli("status")
    assert done.returncode == 0, done.stderr
    match = SIMULATED.search(done.stdout)
    assert match is not None, done.stdout
    shown = float(match.group(1).replace(",", ""))
    per_wall = float(match.group(2).replace(",", ""))
    assert shown == pytest.approx(per_wall / SPEED, rel=0.01, abs=1.0)
    # One scrape window's rate, not the mean above: on a loaded machine a window can be
    # half or twice the mean. The headline is in simulated units (a wall rate would be
    # SPEED = 20 times this), which a factor-of-3 band around the sim-server's own
    # throughput tells apart.
    assert sim_rate / 3 <= shown <= sim_rate * 3, (shown, sim_rate, wall_rates)
