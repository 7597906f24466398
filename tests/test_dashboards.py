"""The Grafana dashboard and the Prometheus alert rules (deploy/grafana, deploy/prometheus).

Every metric they name must be one that specgov's daemon exports (its own registry, built
the way ``specgov run`` builds it) or that SGLang 0.5.23 declares (the wheel's
``name="sglang:..."`` metric definitions, with the series names prometheus_client derives
from each type). The rules' syntax is checked by ``promtool check rules`` where the Debian
``prometheus`` package is installed (CI installs it and sets SPECGOV_REQUIRE_DEPLOY_TOOLS).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry

from specgov.controller.daemon.config import load_config
from specgov.controller.daemon.runtime import Daemon
from specgov.controller.fleet.metrics import FleetMetrics

REPO = Path(__file__).resolve().parent.parent
DASHBOARD = REPO / "deploy/grafana/specgov-dashboard.json"
GENERATOR = REPO / "deploy/grafana/make_dashboard.py"
RULES = REPO / "deploy/prometheus/specgov-alerts.yaml"
SGLANG_METRIC_FILES = "sglang/srt"

# Series Prometheus itself makes for every target; not exported by anyone.
PROMETHEUS_SYNTHETIC = frozenset({"up", "scrape_duration_seconds", "scrape_samples_scraped"})

# PromQL words that look like identifiers but are not metric names.
PROMQL_WORDS = frozenset(
    [
        "sum",
        "min",
        "max",
        "avg",
        "group",
        "stddev",
        "stdvar",
        "count",
        "count_values",
        "bottomk",
        "topk",
        "quantile",
        "limitk",
        "by",
        "without",
        "on",
        "ignoring",
        "group_left",
        "group_right",
        "bool",
        "and",
        "or",
        "unless",
        "offset",
        "rate",
        "irate",
        "increase",
        "delta",
        "idelta",
        "deriv",
        "predict_linear",
        "resets",
        "changes",
        "histogram_quantile",
        "histogram_count",
        "histogram_sum",
        "histogram_fraction",
        "absent",
        "absent_over_time",
        "present_over_time",
        "avg_over_time",
        "min_over_time",
        "max_over_time",
        "sum_over_time",
        "count_over_time",
        "last_over_time",
        "quantile_over_time",
        "stddev_over_time",
        "abs",
        "ceil",
        "floor",
        "round",
        "clamp",
        "clamp_min",
        "clamp_max",
        "exp",
        "ln",
        "log2",
        "log10",
        "sqrt",
        "sgn",
        "label_replace",
        "label_join",
        "vector",
        "scalar",
        "time",
        "timestamp",
        "sort",
        "sort_desc",
        "inf",
        "nan",
    ]
)


# ------------------------------------------------------------------ name extraction


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads.

    Strips what cannot be a metric name (string literals, label matchers, ranges,
    Grafana's ``$variables``, grouping clauses, numbers, function calls), and keeps the
    identifiers that remain. Not a PromQL parser: tested below on the forms used here.
    """
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    text = re.sub(r"\{[^{}]*\}", " ", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", " ", text)  # ranges and subqueries
    text = re.sub(r"\$\{?\w+\}?", " ", text)
    text = re.sub(r"\boffset\s+-?[0-9a-z]+", " ", text)
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    text = re.sub(r"\b[a-zA-Z_][a-zA-Z0-9_]*\s*\(", "(", text)  # function names
    names = set(re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", text))
    return {n for n in names if n not in PROMQL_WORDS and not re.fullmatch(r"[0-9eE]+", n)}


def test_metric_names_extraction() -> None:
    expr = (
        'sum by (le, slot) (rate(sglang:x_bucket{le="0.04", mode=~"a|b"}[5m])) '
        "/ on (instance) group_left(pod) max(specgov_y) > 14.4 * 0.01 "
        "and absent_over_time(specgov_info[$__rate_interval]) unless z_total offset 5m"
    )
    assert metric_names(expr) == {"sglang:x_bucket", "specgov_y", "specgov_info", "z_total"}
    assert metric_names("histogram_quantile(0.99, sum by (le) (rate(a_bucket[1m])))") == {
        "a_bucket"
    }


# ---------------------------------------------------------------- exported names


def _series_names(name: str, kind: str) -> set[str]:
    """Series names prometheus_client exposes for a family of this type."""
    if kind == "counter":
        base = name.removesuffix("_total")
        return {f"{base}_total", f"{base}_created"}
    if kind == "histogram":
        return {f"{name}_bucket", f"{name}_sum", f"{name}_count", f"{name}_created"}
    if kind == "summary":
        return {name, f"{name}_sum", f"{name}_count", f"{name}_created"}
    if kind == "info":
        return {f"{name}_info"}
    return {name}


def specgov_exported() -> set[str]:
    """Every series name the daemon's registry serves (derived families included)."""
    registry = CollectorRegistry()
    Daemon(load_config(None, env={}), store=None, registry=registry)
    # The fleet governor's (specgov fleet run --metrics-addr), on its own registry.
    fleet = FleetMetrics().registry
    names: set[str] = set()
    for family in [*registry.collect(), *fleet.collect()]:
        names |= _series_names(family.name, family.type)
    return names


def sglang_exported(sglang_src: Path) -> set[str]:
    """Every series name SGLang 0.5.23 declares: ``Counter|Gauge|Histogram|Summary(...
    name="sglang:..."``, in every file of the wheel that declares one."""
    names: set[str] = set()
    decl = re.compile(r'\b(Counter|Gauge|Histogram|Summary)\b[^"]{0,400}?name="(sglang:[^"]+)"')
    for path in (sglang_src / SGLANG_METRIC_FILES).rglob("*.py"):
        source = path.read_text(errors="replace")
        if 'name="sglang:' not in source:
            continue
        for m in decl.finditer(source):
            names |= _series_names(m.group(2), m.group(1).lower())
    return names


@pytest.fixture(scope="module")
def exported(sglang_src: Path) -> set[str]:
    return specgov_exported() | sglang_exported(sglang_src) | PROMETHEUS_SYNTHETIC


def test_exported_sets_are_what_they_claim(sglang_src: Path) -> None:
    """The two sources hold the families the adapters and the daemon are known to use
    (so a broken extraction cannot make every name look unknown, or every name known)."""
    own = specgov_exported()
    assert {
        "specgov_decisions_total",
        "specgov_table_steps",
        "specgov_table_age_seconds",
        "specgov_info",
        "specgov_decide_duration_seconds_bucket",
    } <= own
    sglang = sglang_exported(sglang_src)
    assert {
        "sglang:generation_tokens_total",
        "sglang:spec_verify_calls_total",
        "sglang:num_running_reqs",
        "sglang:request_time_per_output_token_seconds_bucket",
    } <= sglang
    assert "sglang:generation_tokens_total_total" not in sglang
    assert not any(n.startswith("specgov") for n in sglang)


# ------------------------------------------------------------------ the dashboard


def _dashboard() -> dict[str, Any]:
    data = json.loads(DASHBOARD.read_text())
    assert isinstance(data, dict)
    return data


def _panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


def dashboard_exprs() -> list[tuple[str, str]]:
    return [
        (panel["title"], target["expr"])
        for panel in _panels(_dashboard())
        for target in panel.get("targets", [])
    ]


def test_dashboard_is_what_its_generator_writes(tmp_path: Path) -> None:
    copy = tmp_path / GENERATOR.name
    shutil.copy(GENERATOR, copy)
    subprocess.run([sys.executable, str(copy)], check=True, timeout=60)
    assert (tmp_path / DASHBOARD.name).read_text() == DASHBOARD.read_text(), (
        "deploy/grafana/specgov-dashboard.json is stale: run "
        "`python deploy/grafana/make_dashboard.py`"
    )


def test_dashboard_metrics_are_exported(exported: set[str]) -> None:
    unknown = {
        (title, name)
        for title, expr in dashboard_exprs()
        for name in metric_names(expr)
        if name not in exported
    }
    assert not unknown, f"dashboard panels name metrics nobody exports: {sorted(unknown)}"


def test_dashboard_shows_what_an_operator_watches() -> None:
    """The issue's list: load, accept length, steps per slot, predicted vs observed
    goodput, decisions by reason, overrides, table age, scrape errors."""
    names = set().union(*(metric_names(e) for _, e in dashboard_exprs()))
    for needed in (
        "sglang:num_running_reqs",
        "sglang:spec_verify_calls_total",
        "specgov_accept_length_estimate",
        "specgov_table_steps",
        "specgov_goodput_predicted_tokens_per_second",
        "specgov_goodput_observed_tokens_per_second",
        "specgov_decisions_total",
        "specgov_override_active",
        "specgov_table_age_seconds",
        "specgov_scrape_errors_total",
        "specgov_store_failures_total",
        "specgov_spool_failures_total",
        "specgov_fleet_replicas",
        "specgov_fleet_target_spec_replicas",
        "specgov_fleet_replica_serving",
        "specgov_fleet_load_requests",
        "specgov_fleet_decisions_total",
        "specgov_fleet_moves_total",
    ):
        assert needed in names, needed
    dashboard = _dashboard()
    panels = [p for p in _panels(dashboard) if p["type"] != "row"]
    assert all(p["datasource"]["uid"] == "${datasource}" for p in panels)
    assert all(p.get("description") for p in panels), "every panel says what it shows"
    ids = [p["id"] for p in _panels(dashboard)]
    assert len(ids) == len(set(ids))


# -------------------------------------------------------------------- alert rules


def _rules() -> list[dict[str, Any]]:
    data = yaml.safe_load(RULES.read_text())
    return [rule for group in data["groups"] for rule in group["rules"]]


def rule_exprs() -> list[str]:
    return [rule["expr"] for rule in _rules()]


def test_rule_metrics_are_exported(exported: set[str]) -> None:
    unknown = {
        (rule["alert"], name)
        for rule in _rules()
        for name in metric_names(rule["expr"])
        if name not in exported
    }
    assert not unknown, f"alert rules name metrics nobody exports: {sorted(unknown)}"


def test_rules_cover_the_failures_an_operator_must_hear_about() -> None:
    alerts = {rule["alert"] for rule in _rules()}
    assert {
        "SpecgovDaemonDown",
        "SpecgovTelemetryStale",
        "SpecgovBlindOrClockSkew",
        "SpecgovTableExpired",
        "SpecgovStoreUnavailable",
        "SpecgovSpoolWriteFailures",
        "SpecgovRepeatedRollbacks",
        "SpecgovSpeculationCostsMoreThanItReturns",
        "SglangTpotSloBurn",
    } <= alerts
    for rule in _rules():
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]
        assert rule["labels"]["severity"] in {"info", "warning", "critical"}


def test_rule_reason_codes_are_real() -> None:
    from specgov.policies.common.decisions import ReasonCode

    codes = {c.value for c in ReasonCode}
    for rule in _rules():
        for group in re.findall(r'reason=~?"([^"]+)"', rule["expr"]):
            for code in group.split("|"):
                assert code in codes, f"{rule['alert']}: unknown reason code {code!r}"


def test_slo_bucket_bound_exists_in_sglang(sglang_src: Path) -> None:
    """The burn-rate rule reads le="0.04": it must be a bucket bound of SGLang's TPOT
    histogram, or the ratio is empty and the alert can never fire."""
    source = (sglang_src / "sglang/srt/observability/metrics_collector.py").read_text()
    m = re.search(r"bucket_inter_token_latency = \[([^\]]*)\]", source)
    assert m is not None
    bounds = {float(x) for x in re.findall(r"[0-9.]+", m.group(1))}
    for le in re.findall(r'le="([^"]+)"', RULES.read_text()):
        assert float(le) in bounds, le


def _require_tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        if os.environ.get("SPECGOV_REQUIRE_DEPLOY_TOOLS"):
            pytest.fail(f"{name} not installed (SPECGOV_REQUIRE_DEPLOY_TOOLS is set)")
        pytest.skip(f"{name} not installed (Debian: apt-get install prometheus)")
    return path


def test_promtool_accepts_the_rules(tmp_path: Path) -> None:
    promtool = _require_tool("promtool")
    done = subprocess.run(
        [promtool, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr
    # And the check can fail: a rule with a broken expression is refused.
    broken = tmp_path / "broken.yaml"
    broken.write_text(RULES.read_text().replace("absent_over_time(", "absent_over_time((", 1))
    bad = subprocess.run(
        [promtool, "check", "rules", str(broken)], capture_output=True, text=True, timeout=60
    )
    assert bad.returncode != 0


# ------------------------------------------------ goodput below prediction (issue 23)

GOODPUT_SERIES = REPO / "tests/fixtures/goodput-series.json"
BELOW_PREDICTION = "SpecgovGoodputBelowPrediction"
INSTANCE = "specgov-0"


def _below_prediction_rule() -> tuple[dict[str, Any], float, int]:
    """The rule, its factor and its ``for`` in minutes. The Python evaluation below knows
    this one form of expression: a changed rule must be changed there too."""
    rules = [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]
    rule = next(r for r in rules if r.get("alert") == BELOW_PREDICTION)
    form = (
        r"max by \(instance\) \(specgov_goodput_observed_tokens_per_second\)\s+"
        r"< ([0-9.]+) \* max by \(instance\) \(specgov_goodput_predicted_tokens_per_second\)"
    )
    match = re.fullmatch(form, rule["expr"].strip())
    assert match is not None, f"update the evaluation below for: {rule['expr']}"
    minutes = re.fullmatch(r"([0-9]+)m", rule["for"])
    assert minutes is not None, rule["for"]
    return rule, float(match[1]), int(minutes[1])


def _firing(
    observed: list[float | None], predicted: list[float | None], factor: float, for_min: int
) -> list[bool]:
    """Whether the alert fires at each one-minute evaluation (Prometheus' rule: pending
    from the first evaluation the condition holds, firing once it has held for ``for``;
    an absent gauge is a stale series, so the condition does not hold)."""
    out, since = [], None
    for i, (o, p) in enumerate(zip(observed, predicted, strict=True)):
        holds = o is not None and p is not None and o < factor * p
        since = (i if since is None else since) if holds else None
        out.append(since is not None and i - since >= for_min)
    return out


def _values(series: list[float | None]) -> str:
    """promtool's input notation: a value a minute, ``stale`` where the gauge was absent
    (``_``: no sample yet)."""
    seen = False
    words = []
    for v in series:
        seen = seen or v is not None
        words.append(repr(v) if v is not None else ("stale" if seen else "_"))
    return " ".join(words)


def _recorded(scale: float) -> tuple[list[float | None], list[float | None]]:
    rows = json.loads(GOODPUT_SERIES.read_text())["rows"]
    observed = [None if r["observed"] is None else r["observed"] * scale for r in rows]
    return observed, [r["predicted"] for r in rows]


@pytest.mark.parametrize("scale", [1.0, 0.4])
def test_goodput_below_prediction_against_a_recorded_series(scale: float, tmp_path: Path) -> None:
    """The alert's expression over the recorded series (one decision per minute of rule
    time), as recorded and with the observed goodput cut to 40 %: evaluated here, and by
    promtool's rule tests where promtool is installed (they must agree)."""
    rule, factor, for_min = _below_prediction_rule()
    observed, predicted = _recorded(scale)
    firing = _firing(observed, predicted, factor, for_min)
    # The recorded series tracks its prediction (the ratio swings with the load but never
    # stays under the factor for the whole window); cut to 40 % it fires after `for`.
    if scale == 1.0:
        assert not any(firing)
    else:
        first = next(i for i, p in enumerate(predicted) if p is not None)
        assert firing.index(True) == first + for_min, firing
    if shutil.which("promtool") is None and not os.environ.get("SPECGOV_REQUIRE_DEPLOY_TOOLS"):
        return  # the Python evaluation above stands alone
    promtool = _require_tool("promtool")
    labels = {**rule["labels"], "instance": INSTANCE}
    selector = f'instance="{INSTANCE}"'
    checks = [
        {
            "eval_time": f"{minute}m",
            "alertname": BELOW_PREDICTION,
            "exp_alerts": (
                [{"exp_labels": labels, "exp_annotations": rule["annotations"]}]
                if firing[minute]
                else []
            ),
        }
        for minute in range(0, len(firing), 3)
    ]
    test = {
        "rule_files": [str(RULES)],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [
                    {
                        "series": f"specgov_goodput_{kind}_tokens_per_second{{{selector}}}",
                        "values": _values(values),
                    }
                    for kind, values in (("observed", observed), ("predicted", predicted))
                ],
                "alert_rule_test": checks,
            }
        ],
    }
    path = tmp_path / "goodput-test.yaml"
    path.write_text(yaml.safe_dump(test, sort_keys=False))
    done = subprocess.run(
        [promtool, "test", "rules", str(path)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr
