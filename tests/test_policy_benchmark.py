"""The policy benchmark (benchmarks/policies) on a tiny synthetic scenario.

Checks the files it writes and that every derived number (ratios, oracle rows, per-phase
accounting, target values) follows from the raw per-run numbers; not that targets pass.
"""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.policies import report, run, scenarios  # noqa: E402

# 48 s of arrivals, two content phases, a burst in the second so policies differ.
TINY = scenarios.Workload(
    name="tiny",
    description="tiny two-phase synthetic trace",
    source="synthetic:duration=48,rate=3,ramp=0:1+24:1+30:5+48:5,in=512,out=96,"
    "phases=code@24+chat@24,seed=3",
    tags=frozenset({"phase_shift", "steady"}),
)
USERS = scenarios.Workload(
    name="tiny-users",
    description="one closed-loop user",
    source="synthetic:duration=30,rate=1,out=64,seed=4",
    concurrency=1,
    max_requests=12,
    tags=frozenset({"one_user"}),
)
SCENARIOS = [scenarios.Scenario(TINY, "h100", "eagle3"), scenarios.Scenario(USERS, "h100", "ngram")]


def _read_csv(path: Path) -> list[dict[str, str]]:
    with path.open(newline="", encoding="utf-8") as fh:
        return list(csv.DictReader(fh))


def _f(text: str) -> float:
    return float(text)


@pytest.fixture(scope="module")
def suite(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, run.SuiteOutput]:
    out = tmp_path_factory.mktemp("policies")
    result = run.run_suite(SCENARIOS, out_dir=out, jobs=1, progress=False)
    return out, result


def test_files_and_columns(suite: tuple[Path, run.SuiteOutput]) -> None:
    out, _ = suite
    for name in ("results.csv", "results.md", "results.json", "phases.csv"):
        assert (out / name).is_file(), name
    assert (out / "plots" / "goodput_vs_ema.png").stat().st_size > 0
    series = out / "plots" / "timeseries" / "tiny_h100_eagle3"
    assert (series / "comparison.png").is_file()
    assert (series / "goodput.png").is_file()
    with (out / "results.csv").open(encoding="utf-8") as fh:
        header = next(csv.reader(fh))
    assert tuple(header) == report.CSV_COLUMNS
    rows = _read_csv(out / "results.csv")
    expected = [
        *scenarios.POLICY_LABELS[:8],
        report.ORACLE,
        report.PHASE_ORACLE,
        *scenarios.POLICY_LABELS[8:],
    ]
    for sc in SCENARIOS:
        assert [r["policy"] for r in rows if r["scenario"] == sc.id] == expected


def test_ratios_and_oracles_follow_from_the_numbers(suite: tuple[Path, run.SuiteOutput]) -> None:
    out, _ = suite
    rows = _read_csv(out / "results.csv")
    for sc in SCENARIOS:
        table = {r["policy"]: r for r in rows if r["scenario"] == sc.id}
        ema = table[scenarios.EMA]
        assert _f(ema["goodput_vs_ema"]) == pytest.approx(1.0)
        for r in table.values():
            assert _f(r["goodput_vs_ema"]) == pytest.approx(
                _f(r["goodput_tok_s"]) / _f(ema["goodput_tok_s"]), rel=1e-12
            )
            if r["throughput_tok_s"]:
                assert _f(r["throughput_vs_ema"]) == pytest.approx(
                    _f(r["throughput_tok_s"]) / _f(ema["throughput_tok_s"]), rel=1e-12
                )
        statics = {p: _f(table[p]["goodput_tok_s"]) for p in scenarios.STATIC_POLICIES}
        best = max(statics, key=lambda p: statics[p])
        assert table[report.ORACLE]["resolved"] == best
        assert _f(table[report.ORACLE]["goodput_tok_s"]) == statics[best]
        for p, r in table.items():
            if r["table_changes"]:
                expected = _f(r["table_changes"]) / (_f(r["duration_s"]) / 60)
                assert _f(r["table_changes_per_min"]) == pytest.approx(expected)
            assert bool(r["decisions"]) == (p in scenarios.DAEMON_POLICIES)


def test_per_phase_oracle_accounting(suite: tuple[Path, run.SuiteOutput]) -> None:
    out, _ = suite
    rows = _read_csv(out / "results.csv")
    phases = _read_csv(out / "phases.csv")
    tiny = SCENARIOS[0]
    assert {r["phase"] for r in phases} == {"code", "chat"}
    assert {r["scenario"] for r in phases} == {tiny.id}  # no phases: no per-phase rows
    table = {r["policy"]: r for r in rows if r["scenario"] == tiny.id}
    data = json.loads((out / "results.json").read_text(encoding="utf-8"))
    runs = {(r["scenario"], r["policy"]): r for r in data["runs"]}
    # Every SLO-meeting output token is counted in exactly one arrival phase.
    for p in scenarios.POLICY_LABELS:
        per_phase = [int(r["good_tokens"]) for r in phases if r["policy"] == p]
        summary = runs[(tiny.id, p)]["summary"]
        assert sum(per_phase) == pytest.approx(summary["goodput_tok_s"] * summary["duration_s"])
    best_per_phase = {
        ph: max(
            int(r["good_tokens"])
            for r in phases
            if r["phase"] == ph and r["policy"] in scenarios.STATIC_POLICIES
        )
        for ph in ("code", "chat")
    }
    oracle = table[report.ORACLE]
    expected = sum(best_per_phase.values()) / _f(oracle["duration_s"])
    assert _f(table[report.PHASE_ORACLE]["goodput_tok_s"]) == pytest.approx(expected)
    assert _f(table[report.PHASE_ORACLE]["goodput_tok_s"]) >= _f(oracle["goodput_tok_s"]) - 1e-9
    # Without phases the per-phase oracle is the overall one.
    users = {r["policy"]: r for r in rows if r["scenario"] == SCENARIOS[1].id}
    assert users[report.PHASE_ORACLE]["goodput_tok_s"] == users[report.ORACLE]["goodput_tok_s"]


def test_targets_are_computed_from_rows(suite: tuple[Path, run.SuiteOutput]) -> None:
    out, result = suite
    rows = _read_csv(out / "results.csv")
    targets = {t.key: t for t in result.targets}
    goodput = {r["scenario"]: r for r in rows if r["policy"] == "goodput"}
    ema = {r["scenario"]: r for r in rows if r["policy"] == scenarios.EMA}
    ratios = {s: _f(goodput[s]["goodput_tok_s"]) / _f(ema[s]["goodput_tok_s"]) for s in goodput}
    t = targets["vs_ema_all"]
    assert t.total == 2
    assert t.measured == pytest.approx(min(ratios.values()))
    assert t.status == ("PASS" if min(ratios.values()) >= 0.99 else "MISS")
    # Scoped by tags: only the tiny phase scenario is phase_shift, only users is one_user.
    assert [s for s, _ in targets["vs_ema_phase_high_load"].values] == [SCENARIOS[0].id]
    assert [s for s, _ in targets["vs_best_static_one_user"].values] == [SCENARIOS[1].id]
    assert targets["vs_none_saturation"].status == "N/A"
    steady = targets["changes_per_min_steady_goodput"]
    assert steady.measured == pytest.approx(_f(goodput[SCENARIOS[0].id]["table_changes_per_min"]))
    md = (out / "results.md").read_text(encoding="utf-8")
    assert md == result.markdown
    assert "## Targets" in md
    for target in result.targets:
        assert target.description in md
    for sc in SCENARIOS:
        assert f"### {sc.id}" in md


def test_select_and_bad_pattern() -> None:
    chosen = scenarios.select(["conv-16x"])
    assert {s.id for s in chosen} == {
        f"conv-16x/{g}/{p}" for g in scenarios.GPUS for p in scenarios.PROFILES
    }
    assert {s.workload.name for s in scenarios.select(["users-*/h100/ngram"])} == {
        f"users-{n}" for n in scenarios.USER_LEVELS
    }
    with pytest.raises(scenarios.ScenarioError, match="no scenario matches"):
        scenarios.select(["nope"])
    quick = scenarios.select(None, quick=True)
    assert {s.gpu for s in quick} == {"h100"} and {s.profile for s in quick} == {"eagle3"}


def test_main_rejects_bad_arguments(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert run.main(["--out", str(tmp_path), "--scenarios", "nope"]) == 2
    assert "no scenario matches" in capsys.readouterr().err
    assert run.main(["--out", str(tmp_path), "--slo-tpot-ms", "-1"]) == 2
    assert "tpot_ms" in capsys.readouterr().err
