"""controller/cli_format: how the CLI renders numbers, times and decision messages."""

from __future__ import annotations

import math
from datetime import datetime

import pytest

from specgov.controller.cli.format import (
    clock,
    decision_summary,
    duration,
    goodput_legend,
    humanize_epochs,
    instant,
    is_overloaded,
    number,
    overload_note,
    percent,
    relative,
    stderr_progress,
    table_slots,
    text,
    throughput,
    vs_baseline,
)
from specgov.controller.daemon.server_speed import sim_speed

NOW = 1_796_128_600.0


@pytest.mark.parametrize(
    ("seconds", "shown"),
    [
        (0.44, "0.4s"),
        (9.96, "10.0s"),
        (12.4, "12s"),
        (112, "1m52s"),
        (3600, "1h00m"),
        (7260, "2h01m"),
        (90000, "1d01h"),
        (-112, "-1m52s"),
        (None, "unknown"),
        (math.nan, "unknown"),
    ],
)
def test_durations_read_like_a_clock(seconds: float | None, shown: str) -> None:
    assert duration(seconds) == shown


def test_instants_are_relative_or_local_iso_never_epoch_floats() -> None:
    assert relative(NOW + 112, NOW) == "in 1m52s"
    assert relative(NOW - 12, NOW) == "12s ago"
    assert relative(NOW + 0.2, NOW) == "now"
    local = datetime.fromtimestamp(NOW + 112).astimezone()
    # The same day: the time of day; another day: the ISO date and time with its offset.
    assert clock(NOW + 112, NOW) == local.strftime("%H:%M:%S")
    assert clock(NOW + 112, NOW + 3 * 86400) == local.isoformat(timespec="seconds")
    assert instant(NOW + 112, NOW) == f"{local.strftime('%H:%M:%S')} (in 1m52s)"
    assert "e+09" not in instant(NOW, NOW) and "1796" not in instant(NOW + 5, NOW)


def test_numbers_are_rounded_and_missing_values_say_unknown() -> None:
    assert number(35980.855, 0) == "35,981"
    assert number(2.3565, 2) == "2.36"
    assert number(12, unit="ms") == "12 ms"
    assert number(None) == "unknown" and number(math.inf) == "unknown"
    assert percent(0.123) == "12%" and percent(None) == "unknown"
    assert text(None) == "unknown" and text(True) == "yes" and text(18.4375) == "18.4"
    assert text(2.3565) == "2.36"
    assert table_slots(None) == "none"
    assert table_slots({"slots": [[1, 4], [8, 3]]}) == "bs>=1: 4, bs>=8: 3"


def test_exact_epochs_in_messages_become_times_rounded_ones_stay_as_written() -> None:
    exact = humanize_epochs("override slot 1 ('t', until 1796128712.5 s)", NOW)
    assert "1796128712" not in exact and "(in 1m52s)" in exact
    # "1.79611e+09" is only good to 10,000 s: it is not turned into a precise-looking time.
    rounded = "blocked until 1.79611e+09 s after a rollback"
    assert humanize_epochs(rounded, NOW) == rounded
    # Durations are not epochs.
    assert humanize_epochs("held slot 32 changed 12 s ago", NOW) == "held slot 32 changed 12 s ago"


HELD = (
    "table v2 [1:4, 4:4, 8:4, 16:4, 32:3, 64:2, 128:2, 256:1] unchanged; held slots [256]: "
    "expected gain +0.0% < min_gain 2.0%; policy goodput: changed_predicted_gain: goodput: "
    "new table, predicted gain +0.0% (slot 1: k=4 B=1.9 E[L]=2.61 T=12.93ms TPOT=4.96ms "
    "G=381tok/s; slot 4: k=4 B=5.1 E[L]=2.66 T=13.73ms TPOT=5.16ms G=997tok/s)"
)
REISSUED = (
    "re-issued unchanged table as v2 before its TTL runs out; policy goodput: held_no_change: "
    "goodput: table unchanged (slot 1: k=4 B=1.9 E[L]=2.69 T=12.75ms TPOT=4.73ms G=410tok/s; "
    "slot 4: k=4 B=5.2 E[L]=2.69 T=13.17ms TPOT=4.89ms G=1054tok/s)"
)


def test_decision_summary_is_one_line_without_the_per_slot_detail() -> None:
    held = decision_summary(HELD)
    assert held == "table v2 unchanged; held slots [256]: expected gain +0.0% < min_gain 2.0%"
    reissued = decision_summary(REISSUED)
    assert reissued == (
        "re-issued unchanged table as v2 before its TTL runs out; "
        "policy goodput (held_no_change): table unchanged"
    )
    published = decision_summary("published v3: 32:3->2 (expected gain +2.1%)")
    assert published == "published v3: 32:3->2 (expected gain +2.1%)"
    for line in (held, reissued, decision_summary("x; " * 100)):
        assert "\n" not in line and len(line) <= 110
        assert "k=4" not in line
    assert decision_summary(None) == ""


def test_goodput_and_vs_ema_are_defined_and_overload_is_said() -> None:
    legend = goodput_legend({"tpot_ms": 50.0, "ttft_ms": None}, baseline="sglang-ema")
    assert "goodput: output tokens per second" in legend and "TPOT <= 50 ms" in legend
    assert "vs ema: goodput / sglang-ema's goodput" in legend
    assert "vs ema" not in goodput_legend({"tpot_ms": 50.0}, baseline=None)
    rows = [{"name": "none", "slo_attainment": 0.12}, {"name": "static:3", "slo_attainment": 0.9}]
    note = overload_note(rows)
    assert note is not None and note.startswith("OVERLOADED") and "none 12%" in note
    assert "static:3" not in note
    assert is_overloaded(rows[0]) and not is_overloaded(rows[1])
    assert overload_note(rows[1:]) is None
    assert not is_overloaded({"name": "x", "slo_attainment": None})


@pytest.mark.parametrize(
    ("speed", "shown"),
    [
        (None, "40,000 tok/s"),  # a real SGLang: real tokens per second
        (1.0, "40,000 tok/s simulated"),  # simulated at real time: one rate, still simulated
        (20.0, "2,000 tok/s simulated (40,000 per wall second at 20x)"),
        (0.5, "80,000 tok/s simulated (40,000 per wall second at 0.5x)"),
    ],
)
def test_throughput_is_in_the_servers_time_and_says_so(speed: float | None, shown: str) -> None:
    assert throughput(40_000.0, speed) == shown


def test_throughput_unknown_without_a_rate() -> None:
    assert throughput(None, 20.0) == "unknown"


@pytest.mark.parametrize("bad", [None, 0, -2.0, math.nan, math.inf, True, "20", [20]])
def test_sim_speed_ignores_anything_that_is_not_a_speed(bad: object) -> None:
    assert sim_speed({"sim_speed": bad}) is None
    assert sim_speed({}) is None


def test_sim_speed_reads_the_status() -> None:
    assert sim_speed({"sim_speed": 20}) == 20.0


def test_vs_baseline_marks_overloaded_runs_and_missing_baselines() -> None:
    base = {"name": "sglang-ema", "goodput_tok_s": 2000.0, "slo_attainment": 0.9}
    assert vs_baseline({"goodput_tok_s": 2030.0, "slo_attainment": 0.95}, base) == "1.015x"
    low = {"goodput_tok_s": 100.0, "slo_attainment": 0.12}
    assert vs_baseline(low, base) == "0.050x (overloaded)"
    assert vs_baseline(low, None) == "-"
    assert vs_baseline(low, {**base, "goodput_tok_s": 0.0}) == "-"


def test_stderr_progress_draws_one_line_per_task_on_a_terminal_only(
    capsys: pytest.CaptureFixture[str],
) -> None:
    update, stop = stderr_progress("doing {task.description}", "things", enabled=False)
    assert update is None
    stop()
    assert capsys.readouterr().err == ""
    update, stop = stderr_progress("doing {task.description}", "things", enabled=True)
    assert update is not None
    update("alpha", 1, 4)
    update("beta", 3, 3)
    stop()
    err = capsys.readouterr().err
    assert "doing alpha" in err and "doing beta" in err and "3/3 things" in err
