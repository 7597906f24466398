"""Contract: every metric, label, endpoint and JSON key the telemetry adapters read
exists in the sglang 0.5.23 wheel, with the meaning the adapters assume.

A rename or a semantic change in a future SGLang fails here, loudly, instead of
silently turning a series into "unknown" in production. The files are read as text
(importing sglang needs torch): grep-level checks plus ``ast`` where structure matters.
"""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import prometheus_client.metrics
import prometheus_client.multiprocess
import pytest

from specgov.adapters import sglang_http, telemetry
from specgov.adapters.observation_builder import LOADS_KEYS_READ, SERVER_INFO_KEYS_READ
from specgov.adapters.prometheus_text import DP_LABEL, PRIORITY_LABEL, REPLICA_LABELS

COLLECTOR = "sglang/srt/observability/metrics_collector.py"
HTTP_SERVER = "sglang/srt/entrypoints/http_server.py"
V1_LOADS = "sglang/srt/entrypoints/v1_loads.py"
COMMON = "sglang/srt/utils/common.py"
AUTH = "sglang/srt/utils/auth.py"
LOAD_SNAPSHOT = "sglang/srt/managers/load_snapshot.py"
BATCH_RESULT = "sglang/srt/managers/scheduler_components/batch_result_processor.py"
INTERNAL_STATE = "sglang/srt/managers/scheduler_components/internal_state.py"
MEMORY_USAGE = "sglang/srt/managers/scheduler_components/memory_usage.py"
SCHEDULER = "sglang/srt/managers/scheduler.py"
FIELDS = "sglang/srt/arg_groups/fields"

COUNTERS = {
    telemetry.GENERATION_TOKENS,
    telemetry.PROMPT_TOKENS,
    telemetry.VERIFY_CALLS,
    telemetry.NUM_REQUESTS,
    telemetry.RETRACTIONS,
    telemetry.REALTIME_TOKENS,
    telemetry.SCHEDULER_CPU_SECONDS,
}
HISTOGRAMS = {telemetry.TTFT, telemetry.ITL, telemetry.TPOT, telemetry.E2E}
GAUGES = set(telemetry.LOG_STATS_GAUGES) | {telemetry.MAX_TOTAL_NUM_TOKENS}


def read(src: Path, rel: str) -> str:
    return (src / rel).read_text()


def squash(text: str) -> str:
    """Whitespace-insensitive source, so formatting changes do not break the checks."""
    return re.sub(r"\s+", "", text)


def test_every_metric_read_is_declared_with_its_type(sglang_src: Path) -> None:
    assert telemetry.METRICS_READ == COUNTERS | HISTOGRAMS | GAUGES
    source = read(sglang_src, COLLECTOR)
    declared: dict[str, str] = {}
    # A comment may sit between the call and name= (num_retracted_requests_total has one).
    call = r'\b(Counter|Gauge|Histogram)\(\s*(?:#[^\n]*\n\s*)*name="([^"]+)"'
    for m in re.finditer(call, source):
        declared[m.group(2)] = m.group(1)
    expected = (
        {n: "Counter" for n in COUNTERS}
        | {n: "Histogram" for n in HISTOGRAMS}
        | {n: "Gauge" for n in GAUGES}
    )
    missing = sorted(n for n in expected if n not in declared)
    assert not missing, f"metrics the adapters read are gone from {COLLECTOR}: {missing}"
    wrong = {n: declared[n] for n, kind in expected.items() if declared[n] != kind}
    assert not wrong, f"metric types changed: {wrong}"


def _collector_method(source: str, cls: str, method: str) -> ast.FunctionDef:
    tree = ast.parse(source)
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == method:
                    return item
    raise AssertionError(f"{cls}.{method} not found")


def test_log_stats_gauges_are_written_together(sglang_src: Path) -> None:
    """GaugeAger's group refresh assumes log_stats() writes all of them in one call."""
    source = read(sglang_src, COLLECTOR)
    attr_of = {
        m.group(2): m.group(1)
        for m in re.finditer(r'self\.(\w+)\s*=\s*Gauge\(\s*name="([^"]+)"', source)
    }
    log_stats = ast.get_source_segment(
        source, _collector_method(source, "SchedulerMetricsCollector", "log_stats")
    )
    assert log_stats is not None
    not_written = sorted(
        name for name in telemetry.LOG_STATS_GAUGES if f"self.{attr_of[name]}," not in log_stats
    )
    assert not not_written, f"no longer refreshed by log_stats(): {not_written}"
    constants = ast.get_source_segment(
        source, _collector_method(source, "SchedulerMetricsCollector", "emit_constants")
    )
    assert constants is not None and "self.max_total_num_tokens," in constants


def test_label_names_and_values(sglang_src: Path) -> None:
    source = read(sglang_src, COLLECTOR)
    for label in telemetry.LABELS_READ - {"le"}:
        assert f'"{label}"' in source, f"label {label!r} not in {COLLECTOR}"
    # le is prometheus_client's own bucket label.
    client_source = inspect.getsource(prometheus_client.metrics)
    assert "'le'" in client_source or '"le"' in client_source
    # pid: added by prometheus_client's multiprocess collector to "all"-mode gauges.
    assert "('pid', pid)" in inspect.getsource(prometheus_client.multiprocess)
    selectors = {DP_LABEL, PRIORITY_LABEL, *REPLICA_LABELS}
    assert selectors <= telemetry.LABELS_READ | {"pid"}
    flat = squash(source)
    # Scheduler labels (init_new) and the optional dp_rank / priority.
    for key in (
        '"tp_rank":parallel.tp_rank',
        '"pp_rank":parallel.pp_rank',
        '"moe_ep_rank":parallel.moe_ep_rank',
        'labels["dp_rank"]=parallel.dp_rank',
        'labels["priority"]=""',
    ):
        assert key in flat, key
    # Only the stats-logging rank (attn_tp_rank 0) of each DP group refreshes the gauges.
    assert "is_stats_logging_rank=(parallel.attn_tp_rank==0" in flat
    # The restart witness exists on every rank from start-up (pre-seeded child).
    assert "self.scheduler_process_cpu_seconds_total.labels(**labels)" in flat
    # realtime_tokens_total{mode="decode"} is what the throughput reads.
    assert '("decode",decode_tokens)' in flat
    assert "self.realtime_tokens_total.labels(**self.labels,mode=mode).inc(delta)" in flat


def test_accept_length_formula_rests_on_these_lines(sglang_src: Path) -> None:
    """telemetry.ACCEPT_LENGTH_FORMULA: both counters advance per finished request, and
    spec_verify_ct counts one per request per verify pass."""
    flat = squash(read(sglang_src, COLLECTOR))
    assert "self.generation_tokens_total.labels(**stream_labels).inc(generation_tokens)" in flat
    assert "self.spec_verify_calls_total.labels(**labels).inc(spec_verify_ct)" in flat
    batch = squash(read(sglang_src, BATCH_RESULT))
    assert "req.spec_verify_ct+=1" in batch
    tok = squash(read(sglang_src, "sglang/srt/managers/tokenizer_manager.py"))
    assert "recv_obj.completion_tokens[i]/recv_obj.spec_verify_ct[i]" in tok
    # The misleading gauge: divides by the start-up draft-token count.
    reporter = squash(
        read(sglang_src, "sglang/srt/managers/scheduler_components/metrics_reporter.py")
    )
    assert "draft_per_round=get_spec().speculative_num_draft_tokens-1" in reporter


def test_decode_log_interval_default_is_40(sglang_src: Path) -> None:
    flat = squash(read(sglang_src, f"{FIELDS}/observability.py"))
    assert re.search(r"decode_log_interval:A\[int,.*?\]=40", flat)


def test_endpoint_paths_exist(sglang_src: Path) -> None:
    http = read(sglang_src, HTTP_SERVER)
    for path in (
        sglang_http.HEALTH_PATH,
        sglang_http.SERVER_INFO_PATH,
        sglang_http.MODEL_INFO_PATH,
    ):
        assert f'@app.get("{path}")' in http, path
    assert f'@router.get("{sglang_http.LOADS_PATH}")' in read(sglang_src, V1_LOADS)
    assert f'Mount("{sglang_http.METRICS_PATH}", make_asgi_app(' in read(sglang_src, COMMON)
    assert set(sglang_http.ENDPOINT_PATHS) == {
        "/metrics",
        "/health",
        "/server_info",
        "/v1/loads",
        "/model_info",
    }


def test_health_answers_503_while_starting(sglang_src: Path) -> None:
    flat = squash(read(sglang_src, HTTP_SERVER))
    assert "server_status==ServerStatus.Starting:returnResponse(status_code=503)" in flat
    assert 'HEALTH_CHECK_TIMEOUT=int(os.getenv("SGLANG_HEALTH_CHECK_TIMEOUT",20))' in flat


def test_auth_is_bearer_and_metrics_health_are_open(sglang_src: Path) -> None:
    flat = squash(read(sglang_src, AUTH))
    assert 'request.headers.get("Authorization")' in flat
    assert 'parts[0].lower()!="bearer"' in flat
    for path in ("/health", "/metrics"):
        assert f'path.startswith("{path}")' in flat
    assert "admin_api_key" in flat


def test_loads_include_sections_and_keys(sglang_src: Path) -> None:
    source = read(sglang_src, LOAD_SNAPSHOT)
    m = re.search(r"VALID_SECTIONS\s*=\s*frozenset\(\s*(\{[^}]*\})", source)
    assert m is not None
    valid = ast.literal_eval(m.group(1))
    assert set(sglang_http.LOADS_INCLUDE) <= valid
    tree = ast.parse(source)
    fields = {
        s.target.id
        for node in tree.body
        if isinstance(node, ast.ClassDef) and node.name == "LoadSnapshot"
        for s in node.body
        if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
    }
    endpoint = read(sglang_src, V1_LOADS)
    for key in LOADS_KEYS_READ:
        assert key in fields or f'"{key}":' in endpoint, key
    # The seed snapshot the builder treats as "not published yet".
    assert "self._write_payload(LoadSnapshot(dp_rank=dp_rank))" in source
    assert "timestamp: float = 0.0" in source


def test_server_info_keys(sglang_src: Path) -> None:
    arg_fields: set[str] = set()
    for path in sorted((sglang_src / FIELDS).glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                arg_fields.add(node.target.id)
    http = read(sglang_src, HTTP_SERVER)
    elsewhere = {
        "max_total_num_tokens": read(sglang_src, SCHEDULER),
        "internal_states": http,
        "memory_usage": read(sglang_src, INTERNAL_STATE),
        "token_capacity": read(sglang_src, MEMORY_USAGE),
    }
    for key in SERVER_INFO_KEYS_READ:
        if key in elsewhere:
            assert f'"{key}"' in elsewhere[key], key
        else:
            assert key in arg_fields, f"{key} is no longer a server arg"
    # /server_info spreads the resolved server args at the top level.
    assert "**build_server_info(server_args, _global_state.scheduler_info)" in http
    common = squash(read(sglang_src, COMMON))
    assert "result=server_args.resolved_dict()" in common


@pytest.mark.parametrize("name", sorted(telemetry.METRICS_READ))
def test_fixtures_cover_every_metric_read(name: str) -> None:
    # The committed fixtures were generated from the wheel: every metric the adapters
    # read appears in at least one of them (so the golden tests exercise it).
    fixtures = Path(__file__).parent.parent / "fixtures" / "sglang"
    text = "".join(p.read_text() for p in sorted(fixtures.glob("*.prom")))
    assert f"# TYPE {name} " in text, name
