"""specgov's one /metrics parser (a line lexer) against prometheus_client's, the oracle.

prometheus_client's text parser is not used at run time; here it is the reference:
``parse_metrics(text)`` must equal the snapshot assembled from its families, and
``parse_metrics(text, families=F)`` that snapshot restricted to F, and the Observation
the builder makes must be the same: on the recorded SGLang fixtures, on the simulated
server's /metrics during a replay, and on generated exposition text (where the lexer
may refuse, naming the line, what it does not model, but never answers differently).
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from specgov.adapters import prometheus_text
from specgov.adapters.errors import ResponseFormatError
from specgov.adapters.observation_builder import ObservationBuilder
from specgov.adapters.prometheus_text import MetricsSnapshot, parse_metrics, restrict
from specgov.adapters.telemetry import METRICS_READ, parse_read_metrics
from specgov.simulator.engine.sglang_metrics import SimMetrics
from specgov.simulator.replay.runner import ServerSpec, build_engine, parse_policy
from specgov.simulator.workload.synthetic import generate_trace
from specgov.simulator.workload.synthetic_text import parse_synthetic_spec

FIXTURES = Path(__file__).parent / "fixtures" / "sglang"
INDEX = json.loads((FIXTURES / "scrapes.json").read_text())
PROM_FIXTURES = sorted(p.name for p in FIXTURES.glob("*.prom"))


def every_name(snapshot: MetricsSnapshot) -> frozenset[str]:
    return frozenset(
        {*snapshot.types, *(k.name for k in snapshot.counters), *(k.name for k in snapshot.gauges)}
    )


def _sorted(labels: dict[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted(labels.items()))


def _full(text: str) -> MetricsSnapshot:
    """The oracle: prometheus_client's parser, through specgov's snapshot assembly."""
    try:
        families = [
            (
                f.name,
                f.type,
                [(s.name, tuple(sorted(s.labels.items())), float(s.value)) for s in f.samples],
            )
            for f in text_string_to_metric_families(text)
        ]
    except (ValueError, IndexError, KeyError, TypeError, OverflowError) as exc:
        raise ResponseFormatError("<full>", "oracle", f"unparseable: {exc}") from None
    return prometheus_text.assemble_snapshot(families, "<full>")


# ------------------------------------------------------------- recorded fixtures


@pytest.mark.parametrize("name", PROM_FIXTURES)
def test_fast_parse_equals_the_full_parse_on_every_fixture(name: str) -> None:
    text = (FIXTURES / name).read_text()
    full = _full(text)
    everything = every_name(full)
    fast = parse_read_metrics(text, source=name)
    assert fast == restrict(full, METRICS_READ)
    assert fast.dp_groups() == full.dp_groups()
    assert parse_metrics(text, source=name, families=everything) == restrict(full, everything)
    assert parse_metrics(text, source=name) == full
    assert (fast.counters and fast.histograms) or name == "starting_metrics.prom"


def _fixture_run(scenario: str, parse: Any, *, with_loads: bool) -> list[Any]:
    sc = INDEX[scenario]
    cfg = sc["adaptive_config"]
    builder = ObservationBuilder(
        adaptive_config=json.loads((FIXTURES / cfg).read_text()) if cfg else None
    )
    info = json.loads((FIXTURES / sc["server_info"]).read_text())
    out = []
    for s in sc["scrapes"]:
        loads = (
            json.loads((FIXTURES / s["loads"]).read_text()) if with_loads and s["loads"] else None
        )
        text = (FIXTURES / s["metrics"]).read_text()
        obs = builder.feed(s["time_s"], parse(text), info, loads)
        report = builder.last_report
        assert report is not None
        out.append((obs, report.notes, dict(report.sources), dict(report.ages_s)))
    return out


@pytest.mark.parametrize("scenario", sorted(INDEX))
@pytest.mark.parametrize("with_loads", [True, False])
def test_fixture_observations_are_the_same_from_the_fast_parse(
    scenario: str, with_loads: bool
) -> None:
    fast = _fixture_run(scenario, parse_read_metrics, with_loads=with_loads)
    full = _fixture_run(scenario, _full, with_loads=with_loads)
    assert fast == full
    assert any(obs.running_requests is not None for obs, *_ in fast)


# ---------------------------------------------------- simulated /metrics in replay


def test_replay_observations_are_the_same_from_the_fast_path() -> None:
    """SimMetrics fed by the engine; every 5 s the full render + full parse and the
    family render + fast parse each feed a builder: identical Observations."""
    trace = generate_trace(parse_synthetic_spec("synthetic:duration=120,rate=6,seed=3"))
    engine, memory = build_engine(ServerSpec(), parse_policy("sglang-ema"), seed=3)
    metrics = SimMetrics(model_name="llama-3.1-8b", kv_capacity_tokens=memory.kv_token_capacity)
    full_builder, fast_builder = ObservationBuilder(), ObservationBuilder()
    pairs: list[tuple[Any, Any]] = []

    def tick(now_s: float) -> None:
        full_obs = full_builder.feed(now_s, _full(metrics.render().decode()))
        text = metrics.render_families(METRICS_READ).decode()
        fast_obs = fast_builder.feed(now_s, parse_read_metrics(text))
        pairs.append((full_obs, fast_obs))
        assert fast_builder.last_report is not None and full_builder.last_report is not None
        assert fast_builder.last_report.notes == full_builder.last_report.notes

    engine.run(trace.requests, metrics=metrics, on_tick=tick, tick_interval_s=5.0)
    assert len(pairs) >= 20
    for full_obs, fast_obs in pairs:
        assert fast_obs == full_obs
    moving = [o for _, o in pairs if o.gen_throughput_tok_s and o.tpot_ms is not None]
    assert len(moving) >= 10  # the comparison covered windows with traffic
    assert {o.spec_num_steps for _, o in pairs} - {None}


# ------------------------------------------------------------ generated exposition

_PLAIN = st.characters(codec="utf-8", exclude_categories=("Cs",), exclude_characters='"\\\n')
# A label value as written on the wire: plain characters, the three escapes, and
# backslash sequences prometheus_client keeps as they are.
_VALUE_TOKEN = st.one_of(
    st.text(_PLAIN, min_size=1, max_size=4),
    st.sampled_from(["\\\\", '\\"', "\\n", "\\t", "\\x", "}", ",", "=", "{", " ", "\\\\n"]),
)
_LABEL_VALUE = st.lists(_VALUE_TOKEN, max_size=4).map("".join)
_LABEL_NAMES = ["tp_rank", "dp_rank", "pp_rank", "model_name", "priority", "mode", "x"]
_NUMBER = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.integers(min_value=-(10**20), max_value=10**20).map(str),
    st.sampled_from(
        ["NaN", "+Inf", "-Inf", "nan", "inf", "1e3", "-0", "0.5", "1.7e+09", "+3", "1e400"]
    ),
)
_BAD_NUMBER = st.sampled_from(["1_000", "abc", "", "0x10", "1.2.3", "--1", "1" + "0" * 400])
_FAMILY_NAMES = [
    "a",
    "b_total",
    "c:d",
    "h",
    "sglang:num_running_reqs",
    "sglang:time_to_first_token_seconds",
    "g_created",
]
_TYPES = ["counter", "gauge", "histogram", "summary", "untyped", "info", None]


@st.composite
def _labels(draw: st.DrawFn, extra: dict[str, str] | None = None) -> str:
    names = draw(st.lists(st.sampled_from(_LABEL_NAMES), max_size=3, unique=True))
    pairs = [(n, draw(_LABEL_VALUE)) for n in names]
    pairs += list((extra or {}).items())
    if not pairs and draw(st.booleans()):
        return ""
    order = draw(st.permutations(pairs)) if pairs else []
    sp = draw(st.sampled_from(["", " ", "\t"]))
    inner = ("," + sp).join(f'{k}{sp}={sp}"{v}"' for k, v in order)
    if order and draw(st.integers(0, 9)) == 0:
        inner += ","  # a trailing comma is accepted
    return "{" + sp + inner + "}"


@st.composite
def _sample_line(draw: st.DrawFn, name: str, extra: dict[str, str] | None = None) -> str:
    labels = draw(_labels(extra))
    bad = draw(st.integers(0, 29)) == 0
    value = draw(_BAD_NUMBER if bad else _NUMBER)
    sep = draw(st.sampled_from([" ", "  ", "\t"]))
    line = f"{name}{labels}{sep}{value}"
    if draw(st.integers(0, 5)) == 0:
        line += draw(st.sampled_from([" 1700000000000", " -5", "\t12", " x"]))
    return draw(st.sampled_from(["", " "])) + line


@st.composite
def _family(draw: st.DrawFn) -> tuple[str, list[str]]:
    name = draw(st.sampled_from(_FAMILY_NAMES))
    typ = draw(st.sampled_from(_TYPES))
    lines: list[str] = []
    header = draw(st.sampled_from(["both", "type", "help", "none"]))
    if typ is not None and header in ("both", "help"):
        lines.append(f'# HELP {name} Some help with "quotes" and \\\\ text.')
    if typ is not None and header in ("both", "type"):
        lines.append(f"# TYPE {name} {typ}")
    names = [name]
    for _ in range(draw(st.integers(0, 3))):
        if typ == "histogram":
            les = draw(st.lists(st.sampled_from(["0.1", "1.0", "1", "+Inf", "10"]), max_size=4))
            if draw(st.integers(0, 19)) == 0:
                les.append("fast")
            base = draw(_labels())
            for le in les:
                lines.append(_bucket_line(name, base, le, draw(_NUMBER)))
            for suffix in ("_count", "_sum"):
                if draw(st.integers(0, 4)):
                    lines.append(f"{name}{suffix}{base} {draw(_NUMBER)}")
            names += [f"{name}_bucket", f"{name}_count", f"{name}_sum"]
        elif typ == "summary":
            lines.append(draw(_sample_line(name, {"quantile": "0.5"})))
            lines.append(draw(_sample_line(f"{name}_sum")))
            names.append(f"{name}_sum")
        else:
            sample = name if draw(st.integers(0, 9)) else draw(st.sampled_from(_FAMILY_NAMES))
            lines.append(draw(_sample_line(sample)))
            names.append(sample)
    if draw(st.integers(0, 9)) == 0:
        lines.append(draw(st.sampled_from(["", "#", "# a comment", "#x TYPE y", "   "])))
    return "\n".join(lines), names


def _bucket_line(name: str, base: str, le: str, value: str) -> str:
    labels = base[1:-1].rstrip(",") if base else ""
    inner = f'{labels},le="{le}"' if labels.strip() else f'le="{le}"'
    return f"{name}_bucket{{{inner}}} {value}"


@st.composite
def _exposition(draw: st.DrawFn) -> tuple[str, frozenset[str]]:
    families = draw(st.lists(_family(), max_size=6))
    text = "\n".join(t for t, _ in families) + draw(st.sampled_from(["", "\n", "\r\n"]))
    names: set[str] = set()
    for _, ns in families:
        for n in ns:
            names.update({n, n + "_total"})
    return text, frozenset(names)


def _outcome(fn: Any) -> tuple[str, MetricsSnapshot | None]:
    try:
        return ("ok", fn())
    except ResponseFormatError:
        return ("error", None)


def parse_metrics_refuses(text: str) -> bool:
    """Does the full parse refuse ``text``, naming a line?"""
    try:
        parse_metrics(text)
    except ResponseFormatError as exc:
        return "line " in str(exc)
    return False


def _same(a: MetricsSnapshot, b: MetricsSnapshot) -> bool:
    # NaN != NaN: compare reprs of the values that may hold one (histogram sums, unknowns).
    return a == b or repr(a) == repr(b)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_exposition())
def test_lexer_agrees_with_prometheus_client_on_generated_text(
    case: tuple[str, frozenset[str]],
) -> None:
    text, names = case
    reference = _outcome(lambda: _full(text))
    for fast, expected in (
        (_outcome(lambda: parse_metrics(text)), reference),
        (
            _outcome(lambda: parse_metrics(text, families=names)),
            reference if reference[1] is None else ("ok", restrict(reference[1], names)),
        ),
    ):
        # The same snapshot, or an error where the oracle errs; or a refusal (naming
        # the line) of what the lexer does not model.
        if expected[0] == "error":
            assert fast[0] == "error", text
        elif fast[1] is not None and expected[1] is not None:
            assert _same(fast[1], expected[1]), text
        else:
            assert fast[0] == "error", text


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_exposition(), st.data())
def test_lexer_keeps_exactly_the_asked_families(
    case: tuple[str, frozenset[str]], data: st.DataObject
) -> None:
    text, names = case
    keep = frozenset(data.draw(st.sets(st.sampled_from(sorted(names)))) if names else set())
    reference = _outcome(lambda: _full(text))
    fast = _outcome(lambda: parse_metrics(text, families=keep))
    if fast[0] == "error":
        # A kept family is malformed (the full parse fails on it too) or not modelled.
        assert reference[0] == "error" or parse_metrics_refuses(text), text
    elif reference[1] is not None:
        assert fast[1] is not None
        assert _same(fast[1], restrict(reference[1], keep)), text
        assert fast[1].dp_groups() == reference[1].dp_groups(), text


# -------------------------------------------------------------- chosen edge cases

SCHED = 'model_name="m",tp_rank="0",pp_rank="0",moe_ep_rank="0"'


@pytest.mark.parametrize(
    "text",
    [
        # escapes in label values, NaN / Inf, histograms, TP and DP labels
        '# TYPE g gauge\ng{model_name="a\\"b\\\\c\\nd\\te",tp_rank="0"} NaN\n',
        '# TYPE g gauge\ng{tp_rank="0",dp_rank="1"} +Inf\ng{tp_rank="1",dp_rank="1"} -Inf\n',
        "# TYPE h histogram\n"
        f'h_bucket{{{SCHED},le="0.1"}} 1\nh_bucket{{{SCHED},le="+Inf"}} 3\n'
        f"h_count{{{SCHED}}} 3\nh_sum{{{SCHED}}} 0.25\n",
        # a counter declared without _total gets it appended to its samples
        "# TYPE c counter\nc 4\n",
        # a sample the family does not allow starts an untyped family of its own
        "# TYPE g gauge\ng 1\nother 2\ng 3\n",
        # the same TYPE twice: the second wins for the whole family
        "# TYPE g gauge\ng 1\n# TYPE g counter\n",
        # constructs the lexer may refuse (prometheus_client reads some of them)
        '# TYPE g gauge\ng{,tp_rank="0"} 1\n',
        '# TYPE g gauge\ng{a:b="0"} 1\n',
        "# HELP\ng 1\n",
        "# TYPE g gauge\ninf\n",
        "# TYPE g gauge\ng 1 2 3\n",
        "# TYPE g gauge\ng\t5\t6\n",
    ],
)
def test_edge_cases_match_the_reference(text: str) -> None:
    names = frozenset({"g", "g_total", "c_total", "h", "other"})
    reference = _outcome(lambda: restrict(_full(text), names))
    fast = _outcome(lambda: parse_metrics(text, families=names))
    if reference[0] == "error":
        assert fast[0] == "error"
    elif fast[1] is not None and reference[1] is not None:
        assert _same(fast[1], reference[1])
    else:
        assert parse_metrics_refuses(text)


@pytest.mark.parametrize(
    ("text", "line"),
    [
        ('{__name__="g"} 1\n', 1),  # prometheus_client reads it as g
        ('# TYPE g gauge\ng 1\n# TYPE "h" gauge\nh 1\n', 3),  # a quoted name
        ('# TYPE g gauge\ng{tp_rank="0",tp_rank="1"} 1\n', 2),  # a duplicate label
    ],
)
def test_what_the_lexer_does_not_model_is_refused_naming_the_line(text: str, line: int) -> None:
    with pytest.raises(ResponseFormatError, match=rf"http://x/metrics.*line {line}: "):
        parse_metrics(text, source="http://x/metrics")


def test_escaped_label_values_and_special_values_read_like_prometheus_client() -> None:
    text = '# TYPE g gauge\ng{model_name="a\\"b\\\\c\\nd\\te",tp_rank="0"} 2.5\n'
    (key,) = parse_metrics(text, families={"g"}).gauges
    assert key.get("model_name") == 'a"b\\c\nd\\te'
    snap = parse_metrics(
        "# TYPE g gauge\ng NaN\n# TYPE c_total counter\nc_total -1\n", families={"g", "c_total"}
    )
    assert not snap.gauges and not snap.counters
    assert {u.kind for u in snap.unknown} == {"gauge", "counter"}


def test_malformed_kept_line_raises_naming_the_source_unread_lines_are_not_checked() -> None:
    bad_kept = '# TYPE sglang:num_running_reqs gauge\nsglang:num_running_reqs{tp_rank="0} 1\n'
    with pytest.raises(ResponseFormatError, match="http://x/metrics"):
        parse_read_metrics(bad_kept, source="http://x/metrics")
    bad_unread = (
        '# TYPE sglang:other gauge\nsglang:other{x="0"} not-a-number\n'
        '# TYPE sglang:num_running_reqs gauge\nsglang:num_running_reqs{tp_rank="0"} 4\n'
    )
    with pytest.raises(ResponseFormatError):
        parse_metrics(bad_unread)
    snap = parse_read_metrics(bad_unread)
    assert list(snap.gauges.values()) == [4.0]


def test_dp_groups_count_the_families_left_out() -> None:
    text = (
        "# TYPE sglang:queue_time_seconds histogram\n"
        'sglang:queue_time_seconds_count{dp_rank="1",tp_rank="2"} 1\n'
        "# TYPE sglang:num_running_reqs gauge\n"
        'sglang:num_running_reqs{dp_rank="0",tp_rank="0"} 4\n'
    )
    fast = parse_read_metrics(text)
    assert fast.dp_groups() == _full(text).dp_groups() == frozenset({"0", "1"})
    assert replace(fast, other_dp_groups=frozenset()).dp_groups() == frozenset({"0"})


def test_selectors_are_memoised_but_callers_get_their_own_dicts() -> None:
    text = (FIXTURES / "eagle3_adaptive_A.prom").read_text()
    snap = parse_read_metrics(text)
    first = prometheus_text.gauge_by_dp(snap, "sglang:num_running_reqs")
    first.clear()
    again = prometheus_text.gauge_by_dp(snap, "sglang:num_running_reqs")
    assert again and again == prometheus_text.gauge_by_dp(
        parse_metrics(text), "sglang:num_running_reqs"
    )
    assert math.isfinite(again[None].value)
