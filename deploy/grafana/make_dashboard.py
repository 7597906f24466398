"""Writes specgov-dashboard.json beside this file: `python deploy/grafana/make_dashboard.py`.

The dashboard is generated so that its panels stay uniform (one datasource variable,
units, legends); tests/test_dashboards.py fails when the committed JSON differs from what
this script writes, and when a panel names a metric that neither specgov nor SGLang 0.5.23
exports.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

DS = {"type": "prometheus", "uid": "${datasource}"}
# Accept length over a window, the way the daemon computes it (adapters/telemetry.py):
# the sglang:spec_accept_rate gauge divides by the start-up draft-token count and is
# wrong under adaptive steps.
ACCEPT_LENGTH = (
    "sum(rate(sglang:generation_tokens_total[5m])) / sum(rate(sglang:spec_verify_calls_total[5m]))"
)


def _quantile(q: float, family: str) -> str:
    return f"histogram_quantile({q}, sum by (le) (rate({family}_bucket[5m])))"


class Layout:
    """Places panels left to right, 24 grid units a row."""

    def __init__(self) -> None:
        self.panels: list[dict[str, Any]] = []
        self.x = 0
        self.y = 0
        self.next_id = 1

    def row(self, title: str) -> None:
        if self.x:
            self.x, self.y = 0, self.y + 8
        self.panels.append(
            {
                "type": "row",
                "id": self._id(),
                "title": title,
                "collapsed": False,
                "gridPos": {"h": 1, "w": 24, "x": 0, "y": self.y},
                "panels": [],
            }
        )
        self.y += 1

    def _id(self) -> int:
        self.next_id += 1
        return self.next_id - 1

    def panel(
        self,
        title: str,
        description: str,
        targets: list[tuple[str, str]],
        *,
        unit: str = "short",
        width: int = 8,
        kind: str = "timeseries",
        thresholds: list[tuple[float, str]] | None = None,
        draw_style: str = "line",
    ) -> None:
        if self.x + width > 24:
            self.x, self.y = 0, self.y + 8
        steps: list[dict[str, Any]] = [{"color": "green", "value": None}]
        steps += [{"color": color, "value": value} for value, color in thresholds or []]
        custom: dict[str, Any] = {"drawStyle": draw_style, "lineInterpolation": "stepAfter"}
        if thresholds:
            custom["thresholdsStyle"] = {"mode": "line"}
        self.panels.append(
            {
                "type": kind,
                "id": self._id(),
                "title": title,
                "description": description,
                "datasource": DS,
                "gridPos": {"h": 8, "w": width, "x": self.x, "y": self.y},
                "fieldConfig": {
                    "defaults": {
                        "unit": unit,
                        "thresholds": {"mode": "absolute", "steps": steps},
                        **({"custom": custom} if kind == "timeseries" else {}),
                    },
                    "overrides": [],
                },
                "options": {"legend": {"displayMode": "list", "placement": "bottom"}}
                if kind == "timeseries"
                else {"reduceOptions": {"calcs": ["lastNotNull"]}},
                "targets": [
                    {
                        "refId": chr(ord("A") + i),
                        "datasource": DS,
                        "expr": expr,
                        "legendFormat": legend,
                    }
                    for i, (expr, legend) in enumerate(targets)
                ],
            }
        )
        self.x += width


def dashboard() -> dict[str, Any]:
    d = Layout()
    load_row(d)
    speculation_row(d)
    decisions_row(d)
    latency_row(d)
    errors_row(d)
    fleet_row(d)
    return {
        "title": "specgov: speculation governor",
        "uid": "specgov-overview",
        "description": "specgov's decisions beside SGLang's own metrics (deploy/grafana).",
        "tags": ["specgov", "sglang"],
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "time": {"from": "now-3h", "to": "now"},
        "refresh": "30s",
        "timezone": "",
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "label": "Prometheus",
                    "type": "datasource",
                    "query": "prometheus",
                    "current": {},
                    "hide": 0,
                }
            ]
        },
        "annotations": {"list": []},
        "panels": d.panels,
    }


def load_row(d: Layout) -> None:
    """SGLang's load: requests, KV usage, generated tokens."""
    d.row("Load (SGLang)")
    d.panel(
        "Requests running and queued",
        "sglang:num_running_reqs and sglang:num_queue_reqs summed over ranks (gauges refreshed "
        "every decode_log_interval = 40 decode iterations).",
        [("sum(sglang:num_running_reqs)", "running"), ("sum(sglang:num_queue_reqs)", "queued")],
    )
    d.panel(
        "KV token usage",
        "Fraction of the KV pool in use (sglang:token_usage, the highest rank).",
        [("max(sglang:token_usage)", "token usage")],
        unit="percentunit",
        thresholds=[(0.9, "orange"), (0.98, "red")],
    )
    d.panel(
        "Generated tokens per second",
        "Output tokens per second from sglang:generation_tokens_total (counted as requests "
        'finish) and the decode-time sglang:realtime_tokens_total{mode="decode"}.',
        [
            ("sum(rate(sglang:generation_tokens_total[1m]))", "finished requests"),
            ('sum(rate(sglang:realtime_tokens_total{mode="decode"}[1m]))', "decode (realtime)"),
        ],
        unit="short",
    )


def speculation_row(d: Layout) -> None:
    """Acceptance and the steps in force."""
    d.row("Speculation")
    d.panel(
        "Accept length",
        "Tokens per verify step, bonus token included: the server's windowed value "
        "(Δ generated tokens / Δ verify calls) beside specgov's per-slot estimate.",
        [
            (ACCEPT_LENGTH, "server (5m window)"),
            ("specgov_accept_length_estimate", "specgov estimate, slot {{slot}}"),
        ],
    )
    d.panel(
        "Draft steps per slot (published table)",
        "specgov_table_steps: the step table in force, one line per batch-size slot (slot = "
        "the slot's lower bound); sglang:spec_num_steps is the step the engine ran last.",
        [
            ("specgov_table_steps", "slot {{slot}}"),
            ("max(sglang:spec_num_steps)", "engine (last batch)"),
        ],
    )
    d.panel(
        "Predicted vs observed goodput",
        "Goodput = output tokens per second of requests served (tokens per real second on a "
        "real server). Predicted: what the policy expects of its table; observed: measured.",
        [
            ("specgov_goodput_predicted_tokens_per_second", "predicted"),
            ("specgov_goodput_observed_tokens_per_second", "observed"),
        ],
    )


def decisions_row(d: Layout) -> None:
    """The daemon's decisions and table changes."""
    d.row("Decisions")
    d.panel(
        "Decisions by reason",
        "specgov_decisions_total by reason code (docs/operations.md lists every code and "
        "what to do about it).",
        [("sum by (reason) (increase(specgov_decisions_total[$__rate_interval]))", "{{reason}}")],
        width=12,
        draw_style="bars",
    )
    d.panel(
        "Operator overrides in force",
        "specgov_override_active: overrides set with `specgov override set` and not expired.",
        [("max(specgov_override_active)", "overrides")],
        width=6,
        kind="stat",
    )
    d.panel(
        "Table age",
        "Seconds since the table in force was produced. Past guardrails.table_ttl_s (30 s by "
        "default) the plugin ignores it and falls back to SGLang's own controller.",
        [("max(specgov_table_age_seconds)", "age")],
        unit="s",
        width=6,
        thresholds=[(30, "red")],
    )
    d.panel(
        "Decision time p99",
        "CPU time of one decision (specgov_decide_duration_seconds).",
        [(_quantile(0.99, "specgov_decide_duration_seconds"), "p99")],
        unit="s",
    )
    d.panel(
        "Restart recommendation",
        "Predicted relative gain of the restart check's recommendation in force, on its "
        "metric (`specgov recommend` has the launch flags).",
        [
            (
                "specgov_restart_recommended_gain_ratio",
                "{{source}}: {{algorithm}} {{num_steps}} steps, on {{metric}}",
            )
        ],
        unit="percentunit",
    )
    d.panel(
        "Daemon",
        "specgov_info: version, policy in force and mode (observe or plugin).",
        [("specgov_info", "{{version}} {{policy}} {{mode}}")],
        kind="stat",
    )


def latency_row(d: Layout) -> None:
    """SGLang's latency quantiles."""
    d.row("Latency (SGLang)")
    d.panel(
        "TPOT p50 / p99",
        "Per-request time per output token. The red line is 40 ms, the example SLO of "
        "deploy/prometheus/specgov-alerts.yaml; set it to your budget.slo_tpot_ms.",
        [
            (_quantile(0.5, "sglang:request_time_per_output_token_seconds"), "p50"),
            (_quantile(0.99, "sglang:request_time_per_output_token_seconds"), "p99"),
        ],
        unit="s",
        thresholds=[(0.04, "red")],
    )
    d.panel(
        "Inter-token latency p99",
        "sglang:inter_token_latency_seconds.",
        [(_quantile(0.99, "sglang:inter_token_latency_seconds"), "p99")],
        unit="s",
    )
    d.panel(
        "Time to first token p99",
        "sglang:time_to_first_token_seconds.",
        [(_quantile(0.99, "sglang:time_to_first_token_seconds"), "p99")],
        unit="s",
    )


def errors_row(d: Layout) -> None:
    """Fallbacks, errors and dropped input."""
    d.row("Errors")
    d.panel(
        "Telemetry scrape errors",
        "Failed scrapes of the server by kind: temporary (retried), permanent (the daemon "
        "stops acting), format (a malformed answer).",
        [("sum by (kind) (rate(specgov_scrape_errors_total[5m]))", "{{kind}}")],
        unit="reqps",
        width=12,
    )
    d.panel(
        "Metrics snapshot errors",
        "Scrapes of the daemon's own /metrics during which reading its state failed.",
        [("sum(rate(specgov_metrics_snapshot_errors_total[5m]))", "errors")],
        unit="reqps",
        width=12,
    )
    d.panel(
        "State store failures",
        "Failed state-database operations by kind (unavailable: full or read-only disk; "
        "corrupt; deleted or replaced under the daemon), and the rows waiting in the "
        "in-memory journal until the store returns.",
        [
            (
                "sum by (kind) (increase(specgov_store_failures_total[$__rate_interval]))",
                "{{kind}}",
            ),
            ("max(specgov_store_journal_entries)", "journal entries"),
            (
                "sum by (kind) (increase(specgov_store_journal_dropped_total[$__rate_interval]))",
                "journal dropped: {{kind}}",
            ),
        ],
    )
    d.panel(
        "Spool failures",
        "Failed spool operations: write (publishing a step table) and read (the plugin's "
        "statistics). docs/spool-security.md says what each refusal means.",
        [("sum by (operation) (rate(specgov_spool_failures_total[5m]))", "{{operation}}")],
        unit="reqps",
    )
    d.panel(
        "Dropped telemetry values",
        "NaN or infinite samples in the server's /metrics, read as unknown (never 0), and "
        "repeated warnings the daemon did not log (rate-limited per kind).",
        [
            ("sum(rate(specgov_telemetry_nonfinite_values_dropped_total[5m]))", "non-finite"),
            (
                "sum by (kind) (rate(specgov_log_lines_suppressed_total[5m]))",
                "suppressed: {{kind}}",
            ),
        ],
        unit="reqps",
    )


def fleet_row(d: Layout) -> None:
    """The fleet governor (``specgov fleet run --metrics-addr``, controller/fleet/metrics.py):
    the mode mix against its target, who serves, the load it decides on, its decisions
    and moves."""
    d.row("Fleet (specgov fleet)")
    d.panel(
        "Replicas by mode",
        "Replicas running speculative and plain, and how many the last decision wants "
        "speculative: the two meet after the governor's moves (one replica at a time, "
        "after the dwell time).",
        [
            ("max by (mode) (specgov_fleet_replicas)", "{{mode}}"),
            ("max(specgov_fleet_target_spec_replicas)", "target spec"),
        ],
        width=6,
    )
    d.panel(
        "Replicas serving",
        "1 while a replica is in the gateway and healthy; 0 while it drains, restarts, or "
        "did not come back (the mix then holds).",
        [("min by (replica) (specgov_fleet_replica_serving)", "{{replica}}")],
        width=6,
    )
    d.panel(
        "Fleet load",
        "Requests in flight across the fleet (running + waiting of each replica's "
        "/v1/loads): what the mix is decided on; a gap is load unknown.",
        [("sum(specgov_fleet_load_requests)", "requests in flight")],
        width=4,
    )
    d.panel(
        "Fleet decisions and moves",
        "Decisions by reason (move_to_spec, move_to_plain, held_*) and moves by outcome "
        "(move_done, rolled_back, replica_lost, drain_failed, drain_timeout); "
        "docs/operations.md section 11 says what each means.",
        [
            (
                "sum by (reason) (increase(specgov_fleet_decisions_total[$__rate_interval]))",
                "decision: {{reason}}",
            ),
            (
                "sum by (outcome) (increase(specgov_fleet_moves_total[$__rate_interval]))",
                "move: {{outcome}}",
            ),
        ],
        width=8,
        draw_style="bars",
    )


def main() -> None:
    out = Path(__file__).with_name("specgov-dashboard.json")
    out.write_text(json.dumps(dashboard(), indent=2) + "\n")


if __name__ == "__main__":
    main()
