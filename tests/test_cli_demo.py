"""`specgov demo` as an operator reads it: what it announces, the live view's units, the
summary's definitions and its overload warning. The live run and the comparison replay
are replaced by stand-ins here (the real ones take minutes); the demo's own e2e is the
wheel test's `specgov demo` run."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
from click.testing import CliRunner
from rich.console import Console

from specgov.controller.cli import demo
from specgov.controller.cli.main import main
from specgov.controller.daemon.control_api import ControlService


def _summary_row(name: str, goodput: float, slo: float) -> dict[str, Any]:
    return {
        "name": name,
        "throughput_tok_s": 2285.0,
        "goodput_tok_s": goodput,
        "slo_attainment": slo,
        "tpot_ms": {"p50": 16.9, "p90": 40.0, "p99": 93.0},
        "ttft_ms": {"p50": 100.0, "p90": 900.0, "p99": 4338.0},
    }


@dataclass
class _Run:
    summary: dict[str, Any]


@dataclass
class _Report:
    runs: list[_Run]


def _stand_ins(monkeypatch: pytest.MonkeyPatch, slo: float) -> list[str]:
    calls: list[str] = []

    async def fake_run_demo(**kwargs: Any) -> list[Any]:
        calls.append("live")
        # The live view's last frame ends without a newline, as rich's Live leaves it.
        print("LIVE-FRAME", end="", flush=True)
        return []

    def fake_replay(trace: Any, server: Any, policies: list[str], **kwargs: Any) -> _Report:
        calls.append("replay " + ",".join(policies))
        return _Report([_Run(_summary_row(p, 2181.0 - i, slo)) for i, p in enumerate(policies)])

    monkeypatch.setattr(demo, "_run_demo", fake_run_demo)
    monkeypatch.setattr("specgov.simulator.replay.runner.replay", fake_replay)
    return calls


def test_demo_announces_each_phase_and_the_summary_starts_on_a_new_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = _stand_ins(monkeypatch, slo=0.94)
    result = CliRunner().invoke(main, ["demo", "--speed", "10"])
    assert result.exit_code == 0, result.output
    assert calls == ["live", "replay sglang-ema,none"]
    lines = result.output.splitlines()
    assert lines[0].startswith("starting a simulated SGLang server (H100")
    assert "10x real time" in lines[0] and "requests over 10 simulated minutes" in lines[0]
    assert "LIVE-FRAME" in lines  # alone on its line: the summary did not glue onto it
    after = lines[lines.index("LIVE-FRAME") + 1]
    assert after.startswith("replaying the same")
    out = result.output
    assert "goodput: output tokens per second (simulated)" in out
    assert "vs ema: goodput / sglang-ema's goodput" in out
    assert "SLO %" in out and "94.0%" in out
    assert "OVERLOADED" not in out and "overloaded" not in out


def test_demo_says_overloaded_before_any_goodput_ratio(monkeypatch: pytest.MonkeyPatch) -> None:
    _stand_ins(monkeypatch, slo=0.12)
    result = CliRunner().invoke(main, ["demo"])
    assert result.exit_code == 0, result.output
    out = result.output
    assert "OVERLOADED" in out and "12%" in out
    assert out.index("OVERLOADED") < out.index("vs ema")
    assert "(overloaded)" in out


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--policy", "bogus"], "unknown policy kind 'bogus'"),
        (["--control-addr", "nope"], "--control-addr"),
        (["--metrics-addr", "1.2.3.4"], "--metrics-addr"),
    ],
)
def test_bad_demo_options_exit_2_before_anything_starts(
    monkeypatch: pytest.MonkeyPatch, args: list[str], needle: str
) -> None:
    calls = _stand_ins(monkeypatch, slo=0.9)
    result = CliRunner().invoke(main, ["demo", *args])
    assert result.exit_code == 2, result.output
    assert needle in result.output and "Traceback" not in result.output
    assert calls == [] and "starting" not in result.output


def _render(group: Any) -> str:
    console = Console(record=True, width=200)
    console.print(group)
    return console.export_text()


def test_live_view_shows_simulated_tokens_per_second() -> None:
    status = {
        "observation": {
            "running": 12,
            "queued": None,
            "accept_length": 2.3565,
            "gen_throughput_tok_s": 49_000.0,  # per wall second, at 10x
            "tpot_p50_ms": 18.4375,
        },
        "table": {"slots": [[1, 4], [8, 3]]},
        "policy": "goodput",
        "mode": "plugin",
        "sim_speed": 10.0,
    }
    text = _render(demo._live_table(status, {"sim_time_s": 312.4}, ["12:00:01 x: y"]))
    # The headline is the simulated rate; the wall rate is only the aside.
    assert "output 4,900 tok/s simulated (49,000 per wall second at 10x)" in text
    assert "output tokens per simulated second" in text and "10x real time" in text
    assert "queued unknown" in text and "None" not in text
    assert "accept len 2.36" in text and "TPOT p50 18.4 ms" in text
    assert "sim time 312 s" in text


def test_demo_status_carries_the_speed_for_specgov_status() -> None:
    class Inner:
        def status(self) -> dict[str, Any]:
            return {"policy": "goodput"}

        def decisions(self, since_s: float | None, limit: int) -> list[Any]:
            return ["d"]

    wrapped = demo._DemoStatus(Inner(), 10.0)
    assert wrapped.status() == {"policy": "goodput", "sim_speed": 10.0}
    assert wrapped.decisions(None, 5) == ["d"]

    class Reporting(Inner):
        def status(self) -> dict[str, Any]:
            return {"policy": "goodput", "sim_speed": 4.0}

    # A daemon that read the speed from the server's /server_info keeps its own.
    assert demo._DemoStatus(Reporting(), 10.0).status()["sim_speed"] == 4.0


def test_demo_status_wraps_a_real_daemon_as_a_control_service(tmp_path: Any) -> None:
    from specgov.controller.daemon.config import load_config
    from specgov.controller.daemon.runtime import Daemon

    config = load_config(None, env={}, overrides={"state.db_path": str(tmp_path / "s.db")})
    wrapped = demo._DemoStatus(Daemon(config, store=None), 10.0)
    assert isinstance(wrapped, ControlService)
    assert wrapped.status()["sim_speed"] == 10.0


def test_headline_says_what_specgov_gained_and_where_in_one_line() -> None:
    from specgov.simulator.workload.synthetic import DEFAULT_DEMO_SPEC

    assert demo.trace_phases(DEFAULT_DEMO_SPEC) == [
        ("code", 0.0, 200.0),
        ("chat", 200.0, 400.0),
        ("rag", 400.0, 600.0),
    ]
    line = demo.headline(
        {"live": 1100.0, "sglang-ema": 1000.0, "none": 880.0},
        {
            "live": {"code": 100, "chat": 300, "rag": 90},
            "sglang-ema": {"code": 100, "chat": 200, "rag": 100},
            "none": {"code": 50, "chat": 250, "rag": 120},
        },
        "live",
    )
    assert line == (
        "specgov's goodput: +10.0% vs SGLang's EMA and +25.0% vs no speculation over the "
        "whole trace; most in the chat phase: +50.0% vs EMA, +20.0% vs no speculation."
    )


def test_the_summary_ends_with_the_headline_from_real_runs(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from specgov.simulator.replay.runner import ServerSpec, replay
    from specgov.simulator.workload.synthetic import generate_trace
    from specgov.simulator.workload.synthetic_text import parse_synthetic_spec

    spec = parse_synthetic_spec("synthetic:duration=40,rate=2,out=64,phases=code@20+chat@20,seed=2")
    trace = generate_trace(spec)
    live = replay(trace, ServerSpec(), ["static:2"]).runs[0].result
    demo._summary([live], trace, spec)
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("specgov's goodput: ") and " vs SGLang's EMA and " in last
    assert "; most in the " in last and last.endswith(" vs no speculation.")
