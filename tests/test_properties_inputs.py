"""Property tests (issue 9, section 3): every parser and reader of outside input gives a
valid object or its own typed error naming where — never another exception.

Covered: the ``/metrics`` text parser (full and fast paths), the trace readers, the
config loader (files and ``SPECGOV_*`` variables), policy specs. Inputs mix text built
from each format's grammar (so most examples get deep into the parser) with arbitrary
characters, huge numbers, NaN/inf, control characters and broken structure.

Examples run: each test sets ``max_examples`` (the constants below) and prints
``property <name>: N examples`` (shown with ``pytest -s`` or ``-rP``); it asserts that
at least half ran, so a strategy that filters everything away cannot pass quietly.
Hypothesis draws from its own seeded engine; ``derandomize=True`` makes every run draw
the same examples, so CI is reproducible.
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specgov.adapters.errors import ResponseFormatError, escape_upstream
from specgov.adapters.prometheus_text import MetricsSnapshot, parse_metrics, restrict
from specgov.controller.daemon.config import SpecgovConfig, load_config
from specgov.controller.daemon.config_layers import DEFAULTS_LABEL
from specgov.controller.daemon.config_schema import SCHEMA
from specgov.controller.daemon.config_values import ConfigError
from specgov.policies.daemon.spec import (
    KNOWN_KINDS,
    PolicySpec,
    PolicySpecError,
    format_policy_spec,
    parse_policy_spec,
    policy_schema,
)
from specgov.simulator.workload.trace_files import TraceFormatError, load_trace
from specgov.simulator.workload.traces import Trace, TraceError

METRICS_EXAMPLES = 400
TRACE_EXAMPLES = 300
CONFIG_EXAMPLES = 300
SPEC_EXAMPLES = 400
ESCAPE_EXAMPLES = 300

_SETTINGS = settings(
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def _record(name: str, runs: int, wanted: int) -> None:
    print(f"property {name}: {runs} examples")
    assert runs >= wanted // 2, f"{name}: only {runs} of {wanted} examples ran"


def _run(name: str, wanted: int, strategy: st.SearchStrategy[Any], check: Callable[[Any], None]):
    runs = [0]

    @settings(_SETTINGS, max_examples=wanted)
    @given(strategy)
    def prop(value: Any) -> None:
        runs[0] += 1
        check(value)

    prop()
    _record(name, runs[0], wanted)


# Arbitrary text with the characters that break parsers and logs.
_nasty_chars = st.sampled_from(list('\x00\x1b\r\n\t "\\{}=,#:[]&*!|>-') + ["\u202e", "\u2028"])
_text = st.text(st.one_of(st.characters(), _nasty_chars), max_size=80)
_numbers = st.one_of(
    st.integers(min_value=-(10**30), max_value=10**30).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from(
        ["NaN", "+Inf", "-Inf", "1e308", "1e309", "-0", "0x10", "1_000", "", "9" * 400]
    ),
)


# ------------------------------------------------------------------ /metrics text

_metric_names = st.sampled_from(["g", "a", "a_total", "h", "x", "h_bucket", "a_created", "9bad"])
_label_values = st.one_of(
    st.sampled_from(["0", "1", "", "+Inf", "0.5", "decode"]), _text.map(lambda t: t[:10])
)
_labels = st.dictionaries(
    st.sampled_from(["tp_rank", "dp_rank", "le", "priority", "mode", "__name__", "x y"]),
    _label_values,
    max_size=3,
)


def _sample_line(name: str, labels: dict[str, str], value: str, suffix: str) -> str:
    inner = ",".join(f'{k}="{v}"' for k, v in labels.items())
    return f"{name}{suffix}{{{inner}}} {value}" if labels else f"{name}{suffix} {value}"


_metric_line = st.one_of(
    st.builds(
        lambda n, t: f"# TYPE {n} {t}",
        _metric_names,
        st.sampled_from(["counter", "gauge", "histogram", "summary", "untyped", "bogus"]),
    ),
    st.builds(lambda n, h: f"# HELP {n} {h}", _metric_names, _text),
    st.builds(
        _sample_line,
        _metric_names,
        _labels,
        _numbers,
        st.sampled_from(["", "_bucket", "_sum", "_count", "_total", "_created"]),
    ),
    _text,
)
_metrics_text = st.lists(_metric_line, max_size=25).map("\n".join)
_WANTED = frozenset({"a_total", "g", "h"})


def _check_metrics(text: str) -> None:
    full: MetricsSnapshot | None = None
    try:
        full = parse_metrics(text, source="<prop>")
    except ResponseFormatError as exc:
        assert str(exc).startswith("<prop>") and str(exc).isprintable()
    try:
        fast = parse_metrics(text, source="<prop>", families=_WANTED)
    except ResponseFormatError as exc:
        assert str(exc).startswith("<prop>") and str(exc).isprintable()
        # The fast path errs only where the reference does.
        assert full is None
        return
    assert isinstance(fast, MetricsSnapshot)
    if full is not None:
        assert fast == restrict(full, _WANTED)


def test_metrics_text_parser_gives_a_snapshot_or_a_format_error() -> None:
    _run("metrics-text (full and fast)", METRICS_EXAMPLES, _metrics_text, _check_metrics)


# --------------------------------------------------------------------------- traces

_csv_cell = st.one_of(_numbers, _text.map(lambda t: t[:20]), st.sampled_from(["code", '"q"']))
_csv_header = st.sampled_from(
    [
        "arrival_s,input_tokens,output_tokens",
        "arrival_s,input_tokens,output_tokens,domain",
        "timestamp_s,input_tokens,output_tokens",
        "TIMESTAMP,ContextTokens,GeneratedTokens",
        "a,b",
    ]
)
_csv_text = st.builds(
    lambda header, rows: header + "\n" + "\n".join(",".join(r) for r in rows),
    _csv_header,
    st.lists(st.lists(_csv_cell, min_size=1, max_size=4), max_size=8),
)
_timestamps = st.builds(
    lambda d, h, frac: f"2023-11-{d:02d} {h:02d}:00:00{frac}",
    st.integers(0, 40),
    st.integers(0, 30),
    st.sampled_from(["", ".5", ".6805900", ".", "Z", "+01:00"]),
)
_azure_text = st.builds(
    lambda rows: (
        "TIMESTAMP,ContextTokens,GeneratedTokens\n" + "\n".join(f"{t},{a},{b}" for t, a, b in rows)
    ),
    st.lists(st.tuples(_timestamps, _numbers, _numbers), max_size=8),
)
_json_scalar = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**30), max_value=10**30),
    st.floats(allow_nan=False, allow_infinity=False),
    _text.map(lambda t: t[:10]),
)
_json_value = st.recursive(_json_scalar, lambda inner: st.lists(inner, max_size=4), max_leaves=10)
_record_keys = st.sampled_from(
    [
        "arrival_s",
        "timestamp_s",
        "input_tokens",
        "output_tokens",
        "domain",
        "acc_len",
        "timestamp",
        "input_length",
        "output_length",
        "zzz",
    ]
)


def _json_line(record: dict[str, Any]) -> str:
    import json

    return json.dumps(record)


_jsonl_text = st.lists(
    st.one_of(
        st.dictionaries(_record_keys, _json_value, max_size=6).map(_json_line),
        st.fixed_dictionaries(
            {
                "arrival_s": st.floats(0, 1e12),
                "input_tokens": st.integers(-1, 2**21),
                "output_tokens": st.integers(0, 4),
                "acc_len": st.lists(st.integers(-1, 5), max_size=5),
            }
        ).map(_json_line),
        _text,
    ),
    max_size=8,
).map("\n".join)
_trace_case = st.tuples(
    st.one_of(_csv_text, _azure_text, _jsonl_text, _text),
    st.sampled_from([None, "azure", "mooncake", "generic", "acceptance"]),
    st.sampled_from([".csv", ".jsonl", ""]),
)


def test_trace_readers_give_a_trace_or_a_trace_error_naming_file_and_line() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        counter = [0]

        def check(case: tuple[str, str | None, str]) -> None:
            text, fmt, suffix = case
            counter[0] += 1
            path = Path(tmp) / f"t{counter[0]}{suffix}"
            path.write_text(text, encoding="utf-8", errors="surrogatepass")
            try:
                trace = load_trace(path, fmt)
            except TraceFormatError as exc:
                assert str(exc).startswith(f"{path}:{exc.line}: ") and exc.line >= 1
                assert str(exc).isprintable()
            except TraceError as exc:
                assert str(path) in str(exc)
            else:
                assert isinstance(trace, Trace) and trace.requests
                assert all(math.isfinite(r.arrival_s) for r in trace.requests)
            finally:
                path.unlink()

        _run("trace readers", TRACE_EXAMPLES, _trace_case, check)


# --------------------------------------------------------------------------- config

_KEYS = {group: tuple(keys) for group, keys in SCHEMA.items()}
_yaml_scalar = st.one_of(
    _numbers,
    st.sampled_from(
        ["null", "true", "observe", "plugin", "5s", "250ms", "[0, 1, 3]", "127.0.0.1:9465"]
    ),
    st.sampled_from(["http://127.0.0.1:30000", "goodput", "static:3", "~/x", "&a [1]", "*a"]),
    _text.map(lambda t: t[:20]),
)
_group_block = st.builds(
    lambda group, items: f"{group}:\n" + "".join(f"  {k}: {v}\n" for k, v in items),
    st.sampled_from([*_KEYS, "bogus"]),
    st.lists(
        st.tuples(st.sampled_from([k for keys in _KEYS.values() for k in keys]), _yaml_scalar),
        max_size=4,
    ),
)
_config_text = st.one_of(st.lists(_group_block, max_size=4).map("".join), _text)
_env = st.dictionaries(
    st.builds(
        lambda g, k: f"SPECGOV_{g.upper()}__{k.upper()}",
        st.sampled_from(list(_KEYS)),
        st.sampled_from([k for keys in _KEYS.values() for k in keys]),
    ),
    _yaml_scalar,
    max_size=3,
)


def test_config_loader_gives_a_config_or_a_config_error_naming_where() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "cfg.yaml"

        def check(case: tuple[str, dict[str, str]]) -> None:
            text, env = case
            path.write_text(text, encoding="utf-8", errors="surrogatepass")
            try:
                config = load_config(path, env=env)
            except ConfigError as exc:
                # One printable line per error found, each naming where; the message is
                # that line, or "N errors:" and the lines indented.
                problems = exc.problems
                assert problems, str(exc)
                for line in problems:
                    assert line.isprintable() and len(line) < 2200, line
                    assert line.startswith(
                        (str(path), "env SPECGOV_", DEFAULTS_LABEL, "... and ")
                    ), line
                lines = str(exc).split("\n")
                assert lines == [problems[0]] or lines[1:] == [f"  {p}" for p in problems]
            else:
                assert isinstance(config, SpecgovConfig)

        _run("config loader (file and env)", CONFIG_EXAMPLES, st.tuples(_config_text, _env), check)


# ----------------------------------------------------------------------- policy specs

_spec_keys = st.sampled_from(
    sorted(
        {k for kind in KNOWN_KINDS for k in policy_schema(kind)} | {"1", "8", "32", "0", "ttl_s"}
    )
)
_spec_value = st.one_of(
    _numbers,
    st.sampled_from(["true", "false", "none", "thompson", "ucb", "3", "0.05", "-1"]),
    _text.map(lambda t: t[:12]),
)
_spec_item = st.one_of(
    st.builds(lambda k, v: f"{k}={v}", _spec_keys, _spec_value), _spec_value, st.just("")
)
_spec_text = st.one_of(
    st.builds(
        lambda kind, items: kind + (":" + ",".join(items) if items else ""),
        st.sampled_from([*KNOWN_KINDS, "Goodput", "bogus", ""]),
        st.lists(_spec_item, max_size=5),
    ),
    _text,
)


def _check_spec(text: str) -> None:
    try:
        spec = parse_policy_spec(text)
    except PolicySpecError as exc:
        assert str(exc).isprintable() and len(str(exc)) < 1200
        return
    assert isinstance(spec, PolicySpec)
    assert parse_policy_spec(format_policy_spec(spec)) == spec


def test_policy_specs_give_a_spec_or_a_policy_spec_error() -> None:
    _run("policy specs", SPEC_EXAMPLES, _spec_text, _check_spec)


# ------------------------------------------------------------------- escape helper


@pytest.mark.parametrize("limit", [8, 64, 512])
def test_escape_upstream_is_always_one_printable_bounded_line(limit: int) -> None:
    def check(text: str) -> None:
        out = escape_upstream(text, limit)
        assert out.isprintable()
        marker = f"... [cut: {len(text)} characters in all]"
        assert len(out) <= limit + len(marker)
        if text.isprintable() and len(text) <= limit:
            assert out == text

    _run(f"escape_upstream limit={limit}", ESCAPE_EXAMPLES, st.text(max_size=2 * limit), check)
