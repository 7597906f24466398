"""The policy benchmark (benchmarks/policies) on a tiny synthetic scenario.

Checks the files it writes and that every derived number (ratios, oracle rows, per-phase
accounting, oracle shares, worst-prior target values, misses) follows from the raw per-run
numbers; not that targets pass.
"""

from __future__ import annotations

import csv
import json
import statistics
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.policies import report, run, scenarios  # noqa: E402
from specgov.simulator.replay.metrics import Slo  # noqa: E402
from specgov.simulator.replay.oracle import MIN_ORACLE_GAIN  # noqa: E402

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
    labels = [r.label for r in scenarios.suite_runs()]
    expected = [*labels[:8], report.ORACLE, report.PHASE_ORACLE, *labels[8:]]
    # Every daemon policy under every prior, goodput under each acceptance prior, the oracle.
    variants = [f"{p}@{v}" for v in ("x0.7", "x1.4", "gpu") for p in scenarios.DAEMON_POLICIES]
    assert set(labels) == {
        *scenarios.POLICY_LABELS,
        scenarios.CLAIRVOYANT,
        scenarios.INFORMED,
        *variants,
        "goodput@accept0.3",
        "goodput@accept0.9",
    }
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
        for r in table.values():
            if r["table_changes"]:
                expected = _f(r["table_changes"]) / (_f(r["duration_s"]) / 60)
                assert _f(r["table_changes_per_min"]) == pytest.approx(expected)
            assert bool(r["decisions"]) == (r["family"] in scenarios.DAEMON_POLICIES)


def test_prior_columns_and_what_each_variant_was_told(suite: tuple[Path, run.SuiteOutput]) -> None:
    out, _ = suite
    rows = _read_csv(out / "results.csv")
    table = {r["policy"]: r for r in rows if r["scenario"] == SCENARIOS[0].id}  # on h100
    assert table["goodput"]["prior"] == "exact" and table["goodput"]["family"] == "goodput"
    assert table["bandit@x0.7"]["prior"] == "x0.7" and table["bandit@x0.7"]["family"] == "bandit"
    assert table["goodput@x1.4"]["prior"] == "x1.4"
    assert table["batch-table@gpu"]["prior"] == f"gpu={scenarios.PRIOR_GPU['h100']}"
    assert table["goodput@accept0.3"]["prior"] == "prior_mean=0.3"
    assert table["goodput@accept0.3"]["resolved"] == "goodput:prior_mean=0.3"
    # The variants change only what the policy believes, never the simulated server.
    server = SCENARIOS[0].server()
    told = scenarios.PRIORS_BY_NAME["gpu"].apply(server)
    assert (told.gpu, told.prior_gpu, told.prior_scale) == ("h100", "l40s", 1.0)
    assert scenarios.EXACT_PRIOR.apply(server) is server
    assert scenarios.PRIORS_BY_NAME["x0.7"].apply(server).prior_scale == 0.7
    for r in table.values():
        if r["kv_token_capacity"] and r["family"] in scenarios.DAEMON_POLICIES:
            assert r["kv_token_capacity"] == table["goodput"]["kv_token_capacity"]


def test_oracle_shares_follow_from_the_numbers(suite: tuple[Path, run.SuiteOutput]) -> None:
    out, result = suite
    rows = _read_csv(out / "results.csv")
    for sc in SCENARIOS:
        table = {r["policy"]: r for r in rows if r["scenario"] == sc.id}
        for metric, col, name in (
            ("goodput_tok_s", "oracle_share", scenarios.CLAIRVOYANT),
            ("goodput_tok_s", "informed_share", scenarios.INFORMED),
            ("throughput_tok_s", "oracle_share_throughput", scenarios.CLAIRVOYANT),
        ):
            none, oracle = _f(table["none"][metric]), _f(table[name][metric])
            for r in table.values():
                if not r[metric]:
                    continue
                if oracle - none < MIN_ORACLE_GAIN * none:
                    assert r[col] == ""
                else:
                    expected = (_f(r[metric]) - none) / (oracle - none)
                    assert _f(r[col]) == pytest.approx(expected, rel=1e-12)
        if table[scenarios.CLAIRVOYANT]["oracle_share"]:
            assert _f(table[scenarios.CLAIRVOYANT]["oracle_share"]) == pytest.approx(1.0)
            assert _f(table["none"]["oracle_share"]) == 0.0
        # The fleet ceiling: max(clairvoyant, none), named, and every policy's ratio to it.
        none_g = _f(table["none"]["goodput_tok_s"])
        clair_g = _f(table[scenarios.CLAIRVOYANT]["goodput_tok_s"])
        for r in table.values():
            assert r["fleet_ceiling"] == ("oracle" if clair_g >= none_g else "none")
            assert _f(r["vs_fleet_ceiling"]) == pytest.approx(
                _f(r["goodput_tok_s"]) / max(clair_g, none_g), rel=1e-12
            )
    assert "## Share of the oracles' gain over none (goodput)" in result.markdown
    data = json.loads((out / "results.json").read_text(encoding="utf-8"))
    medians = data["median_oracle_shares"]
    for label in ("goodput", scenarios.EMA):
        for col, name in (
            ("oracle_share", scenarios.CLAIRVOYANT),
            ("informed_share", scenarios.INFORMED),
        ):
            vals = [_f(r[col]) for r in rows if r["policy"] == label and r[col]]
            if vals:
                assert medians[label][name] == pytest.approx(statistics.median(vals))
            else:
                assert medians[label][name] is None
    assert report.oracle_share(110.0, 100.0, 100.5) is None  # under 1 %: nothing to share
    assert report.oracle_share(110.0, 100.0, 120.0) == pytest.approx(0.5)


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
    ema = {r["scenario"]: r for r in rows if r["policy"] == scenarios.EMA}
    goodput = {r["scenario"]: r for r in rows if r["policy"] == "goodput"}
    # Worst prior: per scenario the lowest ratio over every goodput variant.
    worst: dict[str, tuple[float, str]] = {}
    for r in rows:
        if r["family"] != "goodput":
            continue
        v = _f(r["goodput_tok_s"]) / _f(ema[r["scenario"]]["goodput_tok_s"])
        if r["scenario"] not in worst or v < worst[r["scenario"]][0]:
            worst[r["scenario"]] = (v, r["policy"])
    t = targets["vs_ema_all"]
    assert t.total == 2
    assert dict(t.values) == pytest.approx({s: v for s, (v, _) in worst.items()})
    assert dict(t.priors) == {s: label for s, (_, label) in worst.items()}
    assert t.measured == pytest.approx(min(v for v, _ in worst.values()))
    assert t.worst_prior == worst[t.worst][1]
    assert t.status == ("PASS" if min(v for v, _ in worst.values()) >= 0.99 else "MISS")
    # Per prior: the exact column uses the plain goodput runs only.
    exact = {str(x["key"]): x for x in result_per_prior(out)["exact"]}
    ratios = {s: _f(goodput[s]["goodput_tok_s"]) / _f(ema[s]["goodput_tok_s"]) for s in goodput}
    assert exact["vs_ema_all"]["measured"] == pytest.approx(min(ratios.values()))
    assert set(result_per_prior(out)) == {"exact", "x0.7", "x1.4", "gpu", "accept0.3", "accept0.9"}
    # Scoped by tags: only the tiny phase scenario is phase_shift, only users is one_user.
    assert [s for s, _ in targets["vs_ema_phase_high_load"].values] == [SCENARIOS[0].id]
    assert [s for s, _ in targets["vs_best_static_one_user"].values] == [SCENARIOS[1].id]
    assert targets["vs_none_saturation"].status == "N/A"
    steady = targets["changes_per_min_steady_goodput"]
    churn = [
        _f(r["table_changes_per_min"])
        for r in rows
        if r["family"] == "goodput" and r["scenario"] == SCENARIOS[0].id
    ]
    assert steady.measured == pytest.approx(max(churn))  # worst prior: the most changes
    md = (out / "results.md").read_text(encoding="utf-8")
    assert md == result.markdown
    assert "## Targets (worst prior)" in md and "## Targets per prior" in md
    for target in result.targets:
        assert target.description in md
    for sc in SCENARIOS:
        assert f"### {sc.id}" in md


def result_per_prior(out: Path) -> dict[str, list[dict[str, object]]]:
    data = json.loads((out / "results.json").read_text(encoding="utf-8"))
    per_prior: dict[str, list[dict[str, object]]] = data["targets_per_prior"]
    return per_prior


def test_misses_list_every_failing_value_with_a_cause(suite: tuple[Path, run.SuiteOutput]) -> None:
    out, result = suite
    data = json.loads((out / "results.json").read_text(encoding="utf-8"))
    failing = set()
    for t in result.targets:
        threshold = float(t.threshold.split()[1])
        for sc_id, v in t.values:
            ok = v <= threshold if t.threshold.startswith("<=") else v >= threshold
            if not ok:
                failing.add((t.key, sc_id))
    assert {(m["target"], m["scenario"]) for m in data["misses"]} == failing
    priors = {(t.key, s): p for t in result.targets for s, p in t.priors}
    for m in data["misses"]:
        assert m["cause"]
        assert m["worst_prior"] == priors[(m["target"], m["scenario"])]
    assert "## Misses (worst prior) and their causes" in result.markdown


def test_suite_runs_and_bad_prior_names() -> None:
    runs = scenarios.suite_runs(["none", "goodput"], priors=["exact", "x1.4"], accept_priors=[])
    assert [r.label for r in runs] == [
        "none",
        "goodput",
        "oracle",
        "oracle:informed",
        "goodput@x1.4",
    ]
    with pytest.raises(scenarios.ScenarioError, match="unknown prior variant"):
        scenarios.suite_runs(priors=["x9"])
    only = scenarios.suite_runs(priors=["exact", "gpu"], prior_families=["goodput"])
    assert [r.label for r in only if "@" in r.label] == [
        "goodput@gpu",
        "goodput@accept0.3",
        "goodput@accept0.9",
    ]
    with pytest.raises(scenarios.ScenarioError, match="unknown prior family"):
        scenarios.suite_runs(prior_families=["none"])


def test_prior_sensitivity_counts_identical_variants(suite: tuple[Path, run.SuiteOutput]) -> None:
    _, result = suite
    sens = report.prior_sensitivity(result.rows)
    # A fixed schedule never reads a step-cost prior: identical under every variant.
    assert sens["batch-table"] == (len(SCENARIOS), len(SCENARIOS))
    assert set(sens) == set(scenarios.DAEMON_POLICIES)
    assert "Runs identical to the exact prior under every prior variant" in result.markdown


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
    assert run.main(["--out", str(tmp_path), "--priors", "x9"]) == 2
    assert "unknown prior variant" in capsys.readouterr().err
    assert run.main(["--out", str(tmp_path), "--accept-priors", "1.5"]) == 2
    assert "prior_mean must be in (0, 1)" in capsys.readouterr().err


def test_tier_switches_are_reported_and_a_switch_cost_is_charged(
    suite: tuple[Path, run.SuiteOutput],
) -> None:
    out, result = suite
    rows = _read_csv(out / "results.csv")
    data = json.loads((out / "results.json").read_text(encoding="utf-8"))
    runs = {(r["scenario"], r["policy"]): r for r in data["runs"]}
    for r in rows:
        if (r["scenario"], r["policy"]) in runs:
            summary = runs[(r["scenario"], r["policy"])]["summary"]
            assert int(r["tier_switches"]) == summary["tier_switches"]
    assert "## Tier switches" in result.markdown
    assert data["meta"]["tier-switch cost"] == "the drafter catalog's (0 ms built in)"
    # --tier-switch-ms: the same run, every switch charged 5 ms of GPU time.
    sc = SCENARIOS[1]
    ema = next(r for r in scenarios.suite_runs() if r.label == scenarios.EMA)

    def job(ms: float | None) -> report.RunResult:
        return run.run_job(
            run.Job(sc, ema, scenarios.default_data_dir(), 0, Slo(), False, tier_switch_ms=ms)
        )

    free, paid = job(None), job(5.0)
    switches = free.summary["tier_switches"]
    assert switches > 0
    assert paid.summary["duration_s"] > free.summary["duration_s"]


def test_restart_checks_follow_from_the_runs(suite: tuple[Path, run.SuiteOutput]) -> None:
    out, _ = suite
    rows = _read_csv(out / "results.csv")
    data = json.loads((out / "results.json").read_text(encoding="utf-8"))
    checks = {c["scenario"]: c for c in data["restart_checks"]}
    assert set(checks) == {sc.id for sc in SCENARIOS}  # goodput's exact run, every scenario
    for sc in SCENARIOS:
        table = {r["policy"]: r for r in rows if r["scenario"] == sc.id}
        # Only goodput's exact-prior run carries a check; both tiny traces are bursts
        # (under SUSTAINED_S), so it stays silent there.
        assert table["goodput"]["restart_recommended"] == "-"
        assert all(r["restart_recommended"] == "" for p, r in table.items() if p != "goodput")
        c = checks[sc.id]
        # On the metric the check predicted on: throughput for a saturated window (the
        # one-user closed population), TPOT p50 (less is better) for a tie-break.
        none, own = table["none"][c["metric"]], table["goodput"][c["metric"]]
        ratio = _f(own) / _f(none) if c["metric"] == "tpot_p50_ms" else _f(none) / _f(own)
        measured = ratio - 1
        assert c["measured_plain_gain"] == pytest.approx(measured)
        assert c["right"] == (c["should_fire"] is False)


def test_a_restart_check_is_judged_on_the_metric_it_predicted_on() -> None:
    def rows(metric: str, rec: str, pred: float | None) -> list[dict[str, object]]:
        goodput = {
            "scenario": metric,
            "policy": "goodput",
            "restart_recommended": rec,
            "restart_predicted_gain": pred,
            "restart_metric": metric,
            "goodput_tok_s": 100.0,
            "throughput_tok_s": 1000.0,
            "tpot_p50_ms": 50.0,
        }
        none = {"scenario": metric, "policy": "none", "goodput_tok_s": 300.0}
        none |= {"throughput_tok_s": 1150.0, "tpot_p50_ms": 49.5}
        return [goodput, none]

    checks = report.restart_checks(
        rows("throughput_tok_s", "no speculation", 0.14)
        + rows("goodput_tok_s", "no speculation", 1.4)
        + rows("tpot_p50_ms", "-", None)
    )
    by = {c["scenario"]: c for c in checks}
    saturated = by["throughput_tok_s"]  # +15 % throughput, not +200 % goodput
    assert saturated["measured_plain_gain"] == pytest.approx(0.15)
    assert saturated["right"] and saturated["within_tolerance"] is True
    assert by["goodput_tok_s"]["measured_plain_gain"] == pytest.approx(2.0)
    assert by["goodput_tok_s"]["within_tolerance"] is False  # 1.4 vs 2.0: 30 % off
    tie = by["tpot_p50_ms"]  # TPOT p50, less is better: 50 / 49.5 - 1 = +1 %
    assert tie["measured_plain_gain"] == pytest.approx(50.0 / 49.5 - 1.0)
    assert tie["right"] and not tie["should_fire"]
    # A run shorter than the sustained window is a burst: silence is right there.
    short = rows("throughput_tok_s", "-", None)
    short[0]["duration_s"] = 97.0
    (burst,) = report.restart_checks(short)
    assert burst["measured_plain_gain"] == pytest.approx(0.15)
    assert burst["burst"] and not burst["should_fire"] and burst["right"]


def test_a_recommendation_of_another_shape_is_judged_on_its_own_replay() -> None:
    # users-1/a100-80g/eagle3 (measured): the check recommends a 5x4 tree (+10.2 %
    # predicted) where plain loses 32 %; the tree's replay measured +11.4 %, so the fire
    # is right and within 25 %. A tree that gains under 10 % when replayed is a wrong fire.
    def rows(scenario: str, measured: float | None) -> list[dict[str, object]]:
        goodput = {
            "scenario": scenario,
            "policy": "goodput",
            "restart_recommended": "tree 5x4, 8 draft tokens",
            "restart_predicted_gain": 0.102,
            "restart_metric": "throughput_tok_s",
            "restart_measured_gain": measured,
            "throughput_tok_s": 131.9,
        }
        return [goodput, {"scenario": scenario, "policy": "none", "throughput_tok_s": 89.3}]

    checks = report.restart_checks(rows("gains", 0.114) + rows("loses", 0.05) + rows("unrun", None))
    by = {c["scenario"]: c for c in checks}
    assert by["gains"]["measured_plain_gain"] < 0 and not by["gains"]["should_fire"]
    assert by["gains"]["measured_recommended_gain"] == pytest.approx(0.114)
    assert by["gains"]["right"] and by["gains"]["within_tolerance"] is True
    assert not by["loses"]["right"] and by["loses"]["within_tolerance"] is False
    # Not replayed: judged neither right nor within the tolerance.
    assert by["unrun"]["within_tolerance"] is None and by["unrun"]["right"] is None


@pytest.mark.parametrize(
    ("configuration", "server_change"),
    [
        # A 5x4 tree with 8 draft tokens: replayed as a tree, not as a chain static:5.
        (
            {"policy": "static:5", "topk": 4, "num_draft_tokens": 8},
            {"topk": 4, "num_draft_tokens": 8},
        ),
        # SGLang's EMA with the step-0 draft-extend pass skipped: the flag is replayed too.
        (
            {
                "policy": "sglang-ema",
                "topk": 1,
                "num_draft_tokens": 4,
                "environment": {"SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND": "1"},
            },
            {"skip_zero_step_draft_extend": True},
        ),
    ],
)
def test_a_fired_recommendation_is_measured_on_what_it_recommends(
    configuration: dict[str, object], server_change: dict[str, object]
) -> None:
    from dataclasses import replace

    from specgov.controller.daemon.recommend import CANDIDATE_SPEC_STEPS
    from specgov.controller.daemon.replay_check import measured_gain
    from specgov.simulator.replay.metrics import summarise
    from specgov.simulator.replay.runner import parse_policy, prepare_run

    sc = SCENARIOS[0]
    requests = scenarios.build_requests(sc.workload, scenarios.default_data_dir())
    job = run.Job(sc, scenarios.PolicyRun("goodput"), scenarios.default_data_dir(), 0, Slo(), False)
    server = sc.server()
    current = {"throughput_tok_s": 100.0, "goodput_tok_s": 100.0, "tpot_ms": {"p50": 10.0}}
    rec = {"configuration": configuration, "metric": "throughput_tok_s"}
    summary = {**current, "restart_recommendation": rec}
    run._measure_recommendation(summary, server, requests, job)
    # The same configuration replayed here: shape, initial steps, environment.
    shaped = replace(server, spec_steps=CANDIDATE_SPEC_STEPS, **server_change)  # type: ignore[arg-type]
    policy = parse_policy(str(configuration["policy"]))
    result = prepare_run(shaped, policy, seed=0, slo=Slo()).run(requests)
    expected = measured_gain(summarise(policy.name, result, Slo()), current, "throughput_tok_s")
    assert rec["measured_gain"] == pytest.approx(expected)
    if "topk" in server_change:  # ...and a tree is not what the chain server gives
        chain = prepare_run(server, policy, seed=0, slo=Slo()).run(requests)
        assert measured_gain(summarise(policy.name, chain, Slo()), current, "throughput_tok_s") != (
            pytest.approx(expected, rel=1e-9)
        )
    # No speculation is the suite's own `none` run: nothing is replayed for it.
    plain_rec = {"configuration": {"policy": "none"}, "metric": "throughput_tok_s"}
    run._measure_recommendation({"restart_recommendation": plain_rec}, server, requests, job)
    assert "measured_gain" not in plain_rec
