"""`specgov replay` / `specgov demo` contract: JSON shape, errors, determinism, real traces."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner

from specgov.controller.cli.main import main

SMALL_SYNTH = "synthetic:duration=60,rate=6,seed=3"
POLICY_KEYS = {
    "name",
    "throughput_tok_s",
    "goodput_tok_s",
    "completed_requests",
    "output_tokens",
    "ttft_ms",
    "tpot_ms",
    "itl_ms",
    "slo_attainment",
    "mean_accept_length",
    "retractions",
    "kv_peak_fraction",
}


def _replay_json(*args: str) -> dict[str, Any]:
    result = CliRunner().invoke(main, ["replay", *args, "--output", "json"])
    assert result.exit_code == 0, result.output
    data: dict[str, Any] = json.loads(result.output)
    return data


def test_json_contract_on_a_synthetic_trace() -> None:
    data = _replay_json(
        SMALL_SYNTH, "--policy", "none", "--policy", "static:3", "--policy", "sglang-ema"
    )
    assert set(data) >= {"policies", "trace", "seed"}
    assert data["seed"] == 0
    names = [p["name"] for p in data["policies"]]
    assert names == ["none", "static:3", "sglang-ema"]
    for p in data["policies"]:
        assert set(p) >= POLICY_KEYS
        for key in ("ttft_ms", "tpot_ms", "itl_ms"):
            assert set(p[key]) == {"p50", "p90", "p99"}
            assert p[key]["p50"] <= p[key]["p90"] <= p[key]["p99"]
        assert p["completed_requests"] == data["trace"]["requests"]
        assert 0.0 <= p["slo_attainment"] <= 1.0
        assert p["goodput_tok_s"] <= p["throughput_tok_s"] + 1e-9
        assert 0.0 < p["kv_peak_fraction"] <= 1.0
    by_name = {p["name"]: p for p in data["policies"]}
    assert by_name["none"]["mean_accept_length"] == 1.0
    assert by_name["static:3"]["mean_accept_length"] > 1.5
    # Every policy generates exactly the trace's tokens: speculation is lossless.
    assert len({p["output_tokens"] for p in data["policies"]}) == 1


def test_same_seed_is_reproducible_and_seed_matters() -> None:
    args = (SMALL_SYNTH, "--policy", "static:3", "--policy", "sglang-ema")
    first = _replay_json(*args, "--seed", "5")
    second = _replay_json(*args, "--seed", "5")
    for a, b in zip(first["policies"], second["policies"], strict=True):
        a.pop("wall_s")
        b.pop("wall_s")
        a.pop("sim_output_tokens_per_wall_s")
        b.pop("sim_output_tokens_per_wall_s")
    assert first == second
    other = _replay_json(*args, "--seed", "6")
    assert other["policies"][0]["tpot_ms"] != first["policies"][0]["tpot_ms"]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--policy", "static:x"], "static:K"),
        (["--policy", "bogus"], "valid kinds: none"),
        (["--policy", "goodput:nope=1"], "nope"),
        (["--gpu", "h1000"], "h1000"),
        (["--model", "gpt-9"], "gpt-9"),
        (["--drafter", "ngram", "--policy", "sglang-ema"], "EAGLE"),
    ],
)
def test_bad_input_is_one_clear_line(args: list[str], needle: str) -> None:
    result = CliRunner().invoke(main, ["replay", SMALL_SYNTH, *args])
    assert result.exit_code == 2  # the README's code for bad usage or configuration
    assert needle in result.output
    assert "Traceback" not in result.output


def test_malformed_trace_names_file_and_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\nnope,1,x\n"
    )
    result = CliRunner().invoke(main, ["replay", str(bad), "--format", "azure"])
    assert result.exit_code == 2
    assert "bad.csv" in result.output and ":3" in result.output
    assert "Traceback" not in result.output


def test_model_that_does_not_fit_fails_before_simulating() -> None:
    result = CliRunner().invoke(
        main, ["replay", SMALL_SYNTH, "--gpu", "l40s", "--model", "llama-3.1-70b"]
    )
    assert result.exit_code == 2
    assert "GiB" in result.output


def test_table_output_and_plots(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        main,
        [
            "replay",
            SMALL_SYNTH,
            "--policy",
            "none",
            "--policy",
            "sglang-ema",
            "--plot",
            str(tmp_path / "plots"),
        ],
    )
    assert result.exit_code == 0, result.output
    assert "sglang-ema" in result.output and "TPOT" in result.output
    # The table says what goodput and "vs ema" mean, and nothing is overloaded here.
    flat = " ".join(result.output.split())
    assert "goodput: output tokens per second (simulated) of the requests that met" in flat
    assert "vs ema: goodput / sglang-ema's goodput on the same trace" in flat
    assert "OVERLOADED" not in result.output and "None" not in result.output
    assert "plots:" in result.output
    pngs = sorted(p.name for p in (tmp_path / "plots").glob("*.png"))
    assert pngs == ["comparison.png", "none.png", "sglang-ema.png"]
    for name in pngs:
        assert (tmp_path / "plots" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["code", "conv"])
def test_azure_traces_replay_side_by_side(azure_trace_dir: Path, kind: str) -> None:
    path = azure_trace_dir / f"AzureLLMInferenceTrace_{kind}.csv"
    data = _replay_json(
        str(path),
        "--max-requests",
        "3000",
        "--rate-scale",
        "2",
        "--policy",
        "none",
        "--policy",
        "static:1",
        "--policy",
        "static:3",
        "--policy",
        "static:5",
        "--policy",
        "sglang-ema",
    )
    by_name = {p["name"]: p for p in data["policies"]}
    assert data["trace"]["requests"] == 3000
    for p in by_name.values():
        assert p["completed_requests"] == 3000
    # 2x the recorded rate is moderate load for an H100: speculation still lowers TPOT.
    assert by_name["static:3"]["tpot_ms"]["p50"] < by_name["none"]["tpot_ms"]["p50"]
    assert by_name["sglang-ema"]["tpot_ms"]["p50"] < by_name["none"]["tpot_ms"]["p50"]


def test_acceptance_trace_replay_follows_the_recorded_acceptance(tmp_path: Path) -> None:
    path = tmp_path / "acc.jsonl"
    lines = []
    for i in range(20):
        # From every position the drafter would get 3 drafts + the bonus accepted.
        rec = {"arrival_s": 0.5 * i, "input_tokens": 200, "output_tokens": 41, "acc_len": [4] * 41}
        lines.append(json.dumps(rec))
    path.write_text("\n".join(lines) + "\n")
    data = _replay_json(
        str(path), "--format", "acceptance", "--policy", "static:1", "--policy", "static:3"
    )
    by_name = {p["name"]: p for p in data["policies"]}
    # static:1 can take at most 1 draft + bonus; static:3 takes all 3 + bonus
    # (the last verify of each request is cut short by its end).
    assert by_name["static:1"]["mean_accept_length"] == pytest.approx(2.0)
    assert by_name["static:3"]["mean_accept_length"] == pytest.approx(4.0)
    assert by_name["static:3"]["output_tokens"] == 20 * 41


def test_missing_trace_file_exits_2(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["replay", str(tmp_path / "nope.csv")])
    assert result.exit_code == 2, result.output
    assert "nope.csv" in result.output and "Traceback" not in result.output


def test_every_replay_option_has_help_text() -> None:
    from specgov.controller.cli.main import replay

    missing = [
        p.name
        for p in replay.params
        if isinstance(p, click.Option) and not (p.help and p.help.strip())
    ]
    assert missing == []


def test_an_overloaded_replay_says_so_before_the_goodput_ratios() -> None:
    result = CliRunner().invoke(
        main,
        ["replay", "synthetic:duration=30,rate=60,seed=3", "--policy", "none", "--policy",
         "sglang-ema"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    out = result.output
    assert out.startswith("OVERLOADED: fewer than 50% of requests met the SLO"), out
    assert "(overloaded)" in out
    assert out.index("OVERLOADED") < out.index("vs ema")


def test_progress_is_shown_on_a_terminal_and_not_when_piped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from specgov.controller.cli import main as cli

    args = ["replay", SMALL_SYNTH, "--policy", "none", "--policy", "static:3", "--output", "json"]
    piped = CliRunner().invoke(main, args)
    assert piped.exit_code == 0 and "requests" not in piped.stderr
    monkeypatch.setattr(cli, "_stderr_is_terminal", lambda: True)
    shown = CliRunner().invoke(main, args)
    assert shown.exit_code == 0, shown.output
    # JSON stays clean on stdout; the bars went to stderr, one per policy.
    assert [p["name"] for p in json.loads(shown.stdout)["policies"]] == ["none", "static:3"]
    assert "replaying none" in shown.stderr and "replaying static:3" in shown.stderr
    assert "requests" in shown.stderr


def test_skip_zero_step_draft_extend_reaches_the_simulated_server() -> None:
    # A load where the EMA's high slots sit at 0: skipping their draft-extend pass
    # changes the run (and the report says the server ran with the flag).
    trace = "synthetic:duration=40,rate=60,in=256,out=128,seed=2"
    plain = _replay_json(trace, "--policy", "sglang-ema", "--acceptance-profile", "ngram")
    skip = _replay_json(
        trace,
        "--policy",
        "sglang-ema",
        "--acceptance-profile",
        "ngram",
        "--skip-zero-step-draft-extend",
    )
    assert skip["server"]["skip_zero_step_draft_extend"] is True
    assert plain["server"]["skip_zero_step_draft_extend"] is False
    assert skip["policies"][0]["throughput_tok_s"] != plain["policies"][0]["throughput_tok_s"]


# ------------------------------------------ options shared with plan sweep / fleet


def _command_params() -> dict[str, dict[str, click.Parameter]]:
    # The subcommands are registered when specgov.controller.cli.main is imported.
    plan = main.commands["plan"]
    assert isinstance(plan, click.Group)
    commands = {
        "replay": main.commands["replay"],
        "plan sweep": plan.commands["sweep"],
        "plan fleet": plan.commands["fleet"],
    }
    return {name: {p.name or "": p for p in cmd.params} for name, cmd in commands.items()}


SHARED = (
    "fmt",
    "window_start_s",
    "window_end_s",
    "sample",
    "max_requests",
    "slo_tpot_ms",
    "max_running_requests",
    "mem_fraction_static",
    "catalog",
    "seed",
    "output",
)


def _spec(param: click.Parameter) -> str:
    assert isinstance(param, click.Option)
    return repr(
        (
            param.opts,
            sorted(param.type.to_info_dict().items()),
            param.default,
            param.multiple,
            param.required,
            param.help,
        )
    )


def test_replay_and_the_plans_share_one_declaration_of_each_common_option() -> None:
    params = _command_params()
    for name in SHARED:
        specs = {command: _spec(p[name]) for command, p in params.items()}
        assert len(set(specs.values())) == 1, (name, specs)
        assert params["replay"][name].help, f"--{name} has no help text"
    # The plans' trace, prices and TTFT SLO options: the same in both plans.
    sweep, fleet = params["plan sweep"], params["plan fleet"]
    for name in ("trace_source", "prices", "slo_ttft_ms"):
        assert _spec(sweep[name]) == _spec(fleet[name]), name
    # Only the TTFT SLO's default differs: replay judges TPOT alone unless asked.
    assert params["replay"]["slo_ttft_ms"].default is None
    assert sweep["slo_ttft_ms"].default == 2000.0


def test_a_negative_seed_is_bad_usage_in_every_command() -> None:
    for args in (
        ["replay", SMALL_SYNTH, "--seed", "-1"],
        ["plan", "sweep", "--trace", SMALL_SYNTH, "--seed", "-1"],
        ["plan", "fleet", "--trace", SMALL_SYNTH, "--seed", "-1"],
    ):
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 2, (args, result.output)
        assert "--seed" in result.output and "Traceback" not in result.output


def test_no_prefix_cache_turns_prefix_reuse_off_end_to_end() -> None:
    # A multi-turn synthetic trace carries hash_ids, so later turns reuse their prefix.
    spec = "synthetic:duration=60,rate=2,turns=4,think=5,phases=chat@60,seed=1"
    on = _replay_json(spec, "--policy", "none")
    off = _replay_json(spec, "--policy", "none", "--no-prefix-cache")
    assert on["server"]["prefix_cache"] is True
    assert on["policies"][0]["prefix_cache_hit_rate"] > 0.0
    assert off["server"]["prefix_cache"] is False
    assert off["policies"][0]["prefix_cache_hit_rate"] == 0.0
    assert off["policies"][0]["prefill_tokens"] > on["policies"][0]["prefill_tokens"]
