"""Trace readers: the real Azure traces, every format, malformed input, transformations."""

from __future__ import annotations

import csv
import json
import math
import re
from pathlib import Path

import pytest
from trace_jsonl import write_trace_jsonl

from specgov.simulator.workload.trace_files import (
    TRACE_FORMATS,
    TraceFormatError,
    load_trace,
)
from specgov.simulator.workload.traces import Request, Trace, TraceError, transform_trace

AZURE_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"


def _write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def _jsonl(path: Path, records: list[dict[str, object]]) -> Path:
    return _write(path, "".join(json.dumps(r) + "\n" for r in records))


def _csv_stats(path: Path) -> tuple[int, float, float]:
    """Independent count and means with the csv module (no specgov code)."""
    with path.open(newline="") as f:
        rows = [r for r in csv.DictReader(f) if r]
    n = len(rows)
    return (
        n,
        sum(int(r["ContextTokens"]) for r in rows) / n,
        sum(int(r["GeneratedTokens"]) for r in rows) / n,
    )


# ------------------------------------------------------------------------------ real data


@pytest.mark.parametrize(
    ("name", "count", "mean_in", "mean_out", "minutes"),
    [("code", 8819, 2047.8, 27.9, 57), ("conv", 19366, 1154.7, 211.1, 58)],
)
def test_azure_real_traces_load_with_exact_counts(
    azure_trace_dir: Path, name: str, count: int, mean_in: float, mean_out: float, minutes: int
) -> None:
    path = azure_trace_dir / f"AzureLLMInferenceTrace_{name}.csv"
    trace = load_trace(path)  # auto-detected from the header
    n, ref_in, ref_out = _csv_stats(path)
    assert n == count  # REFERENCE.md §5; the header row is not a request
    summary = trace.summary()
    assert summary["requests"] == count
    assert summary["skipped_rows"] == 0
    assert trace.source.startswith("azure:")
    assert summary["mean_input_tokens"] == pytest.approx(ref_in, rel=1e-12)
    assert summary["mean_output_tokens"] == pytest.approx(ref_out, rel=1e-12)
    assert summary["mean_input_tokens"] == pytest.approx(mean_in, abs=0.1)
    assert summary["mean_output_tokens"] == pytest.approx(mean_out, abs=0.1)
    assert summary["duration_s"] / 60 == pytest.approx(minutes, abs=1)
    arrivals = [r.arrival_s for r in trace.requests]
    assert arrivals[0] == 0.0
    assert arrivals == sorted(arrivals)
    json.dumps(summary)  # JSON-friendly


def test_azure_conv_throughput_matches_reference(azure_trace_dir: Path) -> None:
    trace = load_trace(azure_trace_dir / "AzureLLMInferenceTrace_conv.csv", "azure")
    assert trace.summary()["output_tokens_per_s"] == pytest.approx(1170, rel=0.02)
    # The first two rows are 4.3145790 s apart (7 fractional digits in the file).
    assert trace.requests[1].arrival_s == pytest.approx(4.314579, abs=1e-9)


# --------------------------------------------------------------------------------- azure


def test_azure_timestamps_keep_all_fractional_digits_and_cross_midnight(tmp_path: Path) -> None:
    path = _write(
        tmp_path / "a.csv",
        AZURE_HEADER + "2023-11-16 23:59:59.9999999,10,5\n"
        "2023-11-17 00:00:00.0000001,20,6\n"
        "2023-11-17 00:00:01.5,30,7\n"
        "2023-11-17 00:00:02.25+00:00,40,8\n",
    )
    trace = load_trace(path)
    got = [r.arrival_s for r in trace.requests]
    assert got == pytest.approx([0.0, 2e-7, 1.5000001, 2.2500001], abs=1e-9)
    assert [r.input_tokens for r in trace.requests] == [10, 20, 30, 40]


def test_azure_unsorted_rows_are_sorted(tmp_path: Path) -> None:
    path = _write(
        tmp_path / "a.csv",
        AZURE_HEADER + "2023-11-16 10:00:05.0,1,1\n2023-11-16 10:00:02.0,2,2\n",
    )
    trace = load_trace(path)
    assert [(r.arrival_s, r.input_tokens) for r in trace.requests] == [(0.0, 2), (3.0, 1)]


def test_azure_zero_token_rows_are_skipped_and_counted(tmp_path: Path) -> None:
    path = _write(
        tmp_path / "a.csv",
        AZURE_HEADER + "2023-11-16 10:00:00.0,100,0\n"  # skipped: no output
        "2023-11-16 10:00:01.0,100,10\n"
        "2023-11-16 10:00:02.0,0,10\n"  # skipped: no input
        "2023-11-16 10:00:03.0,50,5\n",
    )
    trace = load_trace(path)
    assert trace.skipped_rows == 2
    assert trace.summary()["skipped_rows"] == 2
    # Re-based on the first kept request.
    assert [(r.arrival_s, r.input_tokens) for r in trace.requests] == [(0.0, 100), (2.0, 50)]


@pytest.mark.parametrize(
    ("row", "line", "problem"),
    [
        ("2023-11-16 10:00:01.0,abc,5", 3, "ContextTokens 'abc' is not an integer"),
        ("2023-11-16 10:00:01.0,10", 3, "2 column(s) where the header has 3"),
        ("2023-11-16 10:00:01.0,10,-4", 3, "GeneratedTokens -4 is negative"),
        ("yesterday,10,4", 3, "TIMESTAMP 'yesterday' is not a timestamp"),
        ("2023-13-16 10:00:01.0,10,4", 3, "TIMESTAMP '2023-13-16 10:00:01.0'"),
    ],
)
def test_azure_malformed_rows_name_file_and_line(
    tmp_path: Path, row: str, line: int, problem: str
) -> None:
    path = _write(tmp_path / "bad.csv", AZURE_HEADER + "2023-11-16 10:00:00.0,1,1\n" + row + "\n")
    with pytest.raises(TraceFormatError) as err:
        load_trace(path, "azure")
    assert err.value.line == line
    assert str(err.value).startswith(f"{path}:{line}: ")
    assert problem in str(err.value)
    assert "; expected " in str(err.value)


def test_azure_header_missing_column(tmp_path: Path) -> None:
    path = _write(tmp_path / "a.csv", "TIMESTAMP,ContextTokens\n2023-11-16 10:00:00,1\n")
    with pytest.raises(TraceFormatError, match=r"a\.csv:1: .*GeneratedTokens"):
        load_trace(path, "azure")


def test_header_only_file_is_an_error(tmp_path: Path) -> None:
    path = _write(tmp_path / "a.csv", AZURE_HEADER)
    with pytest.raises(TraceFormatError, match="holds no requests"):
        load_trace(path)


# ------------------------------------------------------------------------------ mooncake


def test_mooncake_reads_ms_timestamps_and_ignores_extra_keys(tmp_path: Path) -> None:
    path = _jsonl(
        tmp_path / "mc.jsonl",
        [
            {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [1, 2]},
            {"timestamp": 30535, "input_length": 6472, "output_length": 26, "hash_ids": [3]},
            {"timestamp": 30535, "input_length": 100, "output_length": 0, "hash_ids": []},
        ],
    )
    trace = load_trace(path)
    assert trace.source.startswith("mooncake:")
    assert [(r.input_tokens, r.output_tokens) for r in trace.requests] == [(6955, 52), (6472, 26)]
    assert [r.arrival_s for r in trace.requests] == pytest.approx([0.0, 3.053], abs=1e-12)
    assert trace.skipped_rows == 1


@pytest.mark.parametrize(
    ("record", "problem"),
    [
        ('{"timestamp": 5, "input_length": 1.5, "output_length": 3}', "input_length 1.5"),
        ('{"timestamp": 5, "input_length": 4}', "key 'output_length' is missing"),
        ('{"input_length": 4, "output_length": 3}', "key 'timestamp' is missing"),
        ('{"timestamp": 5, "input_length": 4, "output_length": 3', "invalid JSON"),
        ("[1, 2]", "not an object"),
    ],
)
def test_mooncake_malformed_records(tmp_path: Path, record: str, problem: str) -> None:
    good = '{"timestamp": 1, "input_length": 4, "output_length": 3}\n'
    path = _write(tmp_path / "mc.jsonl", good + "\n" + record + "\n")
    with pytest.raises(TraceFormatError) as err:
        load_trace(path, "mooncake")
    assert str(err.value).startswith(f"{path}:3: ")  # the blank line 2 still counts
    assert problem in str(err.value)


# ------------------------------------------------------------------------------- generic


def test_generic_csv_with_domain_and_timestamp_alias(tmp_path: Path) -> None:
    path = _write(
        tmp_path / "g.csv",
        "timestamp_s,input_tokens,output_tokens,domain\n100.5,10,3,code\n101,20,4,\n",
    )
    trace = load_trace(path, default_domain="chat")
    assert trace.requests == (Request(0.0, 10, 3, "code"), Request(0.5, 20, 4, "chat"))
    assert trace.summary()["domains"] == {"chat": 1, "code": 1}


@pytest.mark.parametrize(
    ("text", "line", "problem"),
    [
        ("arrival_s,input_tokens,output_tokens,domian\n0,1,1,x\n", 1, "unknown column(s) domian"),
        ("arrival_s,input_tokens\n0,1\n", 1, "missing column(s) output_tokens"),
        ("arrival_s,input_tokens,output_tokens\n0,1,1\nnan,1,1\n", 3, "not finite"),
        ("arrival_s,input_tokens,output_tokens\n0,1,1\nsoon,1,1\n", 3, "'soon' is not a number"),
    ],
)
def test_generic_csv_malformed(tmp_path: Path, text: str, line: int, problem: str) -> None:
    path = _write(tmp_path / "g.csv", text)
    with pytest.raises(TraceFormatError) as err:
        load_trace(path, "generic")
    assert str(err.value).startswith(f"{path}:{line}: ")
    assert problem in str(err.value)


def test_generic_jsonl_rejects_unknown_keys(tmp_path: Path) -> None:
    path = _jsonl(
        tmp_path / "g.jsonl",
        [{"arrival_s": 0, "input_tokens": 1, "output_tokens": 1, "domian": "code"}],
    )
    with pytest.raises(TraceFormatError, match=r"g\.jsonl:1: unknown key\(s\) domian"):
        load_trace(path)


# ---------------------------------------------------------------------------- acceptance


def test_acceptance_trace_back_to_back_and_validated(tmp_path: Path) -> None:
    path = _jsonl(
        tmp_path / "acc.jsonl",
        [
            {"input_tokens": 5, "output_tokens": 3, "acc_len": [3, 2, 1], "domain": "code"},
            {"input_tokens": 7, "output_tokens": 2, "acc_len": [1, 1]},
        ],
    )
    trace = load_trace(path)
    assert trace.source.startswith("acceptance:")
    assert trace.requests == (
        Request(0.0, 5, 3, "code", (3, 2, 1)),
        Request(0.0, 7, 2, None, (1, 1)),
    )
    assert trace.summary()["with_acceptance_trace"] == 2


@pytest.mark.parametrize(
    ("record", "problem"),
    [
        ({"input_tokens": 5, "output_tokens": 3, "acc_len": [3, 2]}, "acc_len has 2 values"),
        ({"input_tokens": 5, "output_tokens": 2, "acc_len": [3, 0]}, "acc_len[1] = 0"),
        ({"input_tokens": 5, "output_tokens": 2, "acc_len": [3, True]}, "acc_len[1] = True"),
        ({"input_tokens": 5, "output_tokens": 2}, "key 'acc_len' is missing"),
        ({"arrival_s": 1.0, "input_tokens": 5, "output_tokens": 1, "acc_len": [1]}, "some"),
    ],
)
def test_acceptance_trace_malformed(
    tmp_path: Path, record: dict[str, object], problem: str
) -> None:
    good = {"input_tokens": 5, "output_tokens": 1, "acc_len": [2]}
    path = _jsonl(tmp_path / "acc.jsonl", [good, record])
    with pytest.raises(TraceFormatError) as err:
        load_trace(path, "acceptance")
    assert str(err.value).startswith(f"{path}:2: ")
    assert problem in str(err.value)


# ----------------------------------------------------------------------------- round trip


def _sample_files(tmp_path: Path) -> dict[str, Path]:
    return {
        "azure": _write(
            tmp_path / "az.csv",
            AZURE_HEADER + "2023-11-16 18:15:46.6805900,374,44\n2023-11-16 18:15:50.995169,396,9\n",
        ),
        "mooncake": _jsonl(
            tmp_path / "mc.jsonl",
            [
                {"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [7]},
                {"timestamp": 1234, "input_length": 11, "output_length": 3, "hash_ids": [8]},
            ],
        ),
        "generic": _write(
            tmp_path / "g.csv",
            "arrival_s,input_tokens,output_tokens,domain\n0.1,5,6,rag\n0.4,7,8,\n",
        ),
        "acceptance": _jsonl(
            tmp_path / "acc.jsonl",
            [
                {"arrival_s": 0.0, "input_tokens": 3, "output_tokens": 2, "acc_len": [2, 1]},
                {"arrival_s": 0.7, "input_tokens": 4, "output_tokens": 1, "acc_len": [1]},
            ],
        ),
    }


@pytest.mark.parametrize("fmt", TRACE_FORMATS)
def test_every_format_round_trips_through_generic_jsonl(tmp_path: Path, fmt: str) -> None:
    original = load_trace(_sample_files(tmp_path)[fmt], fmt)
    assert original.source.startswith(f"{fmt}:")
    out = tmp_path / "saved.jsonl"
    write_trace_jsonl(original, out)
    again = load_trace(out)
    assert again.requests == original.requests
    assert again.name == "saved"
    # A second write of the re-read trace is byte-identical.
    out2 = tmp_path / "saved2.jsonl"
    write_trace_jsonl(again, out2)
    assert out2.read_bytes() == out.read_bytes()


def test_real_azure_round_trips(azure_trace_dir: Path, tmp_path: Path) -> None:
    original = load_trace(azure_trace_dir / "AzureLLMInferenceTrace_code.csv")
    write_trace_jsonl(original, tmp_path / "code.jsonl")
    assert load_trace(tmp_path / "code.jsonl", "generic").requests == original.requests


# -------------------------------------------------------------------------- transformations


@pytest.fixture()
def ten_requests(tmp_path: Path) -> Path:
    lines = "".join(f"{t},{100 + t},{1 + t}\n" for t in range(0, 20, 2))  # arrivals 0,2,..,18
    return _write(tmp_path / "ten.csv", "arrival_s,input_tokens,output_tokens\n" + lines)


def test_window_on_original_timeline_then_rebased(ten_requests: Path) -> None:
    trace = load_trace(ten_requests, window_start_s=5.0, window_end_s=12.0)
    # Arrivals 6, 8, 10 are in [5, 12); the first becomes 0.
    assert [r.input_tokens for r in trace.requests] == [106, 108, 110]
    assert [r.arrival_s for r in trace.requests] == [0.0, 2.0, 4.0]
    assert "window=[5,12)s" in trace.source


def test_rate_scale_divides_inter_arrivals_after_window(ten_requests: Path) -> None:
    trace = load_trace(ten_requests, window_start_s=4.0, rate_scale=4.0)
    assert [r.arrival_s for r in trace.requests] == [0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5]
    assert trace.requests[0].input_tokens == 104


def test_sample_fraction_is_seeded(ten_requests: Path) -> None:
    a = load_trace(ten_requests, sample_fraction=0.5, seed=1)
    b = load_trace(ten_requests, sample_fraction=0.5, seed=1)
    assert a == b
    assert len(a.requests) == 5
    assert {r.input_tokens for r in a.requests} <= {100 + t for t in range(0, 20, 2)}
    assert a.requests[0].arrival_s == 0.0
    # Some seed picks a different subset (10 choose 5 = 252 subsets).
    assert any(
        load_trace(ten_requests, sample_fraction=0.5, seed=s).requests != a.requests
        for s in range(2, 6)
    )


def test_max_requests_truncates_last(ten_requests: Path) -> None:
    trace = load_trace(ten_requests, window_start_s=2.0, rate_scale=2.0, max_requests=3)
    assert [(r.arrival_s, r.input_tokens) for r in trace.requests] == [
        (0.0, 102),
        (1.0, 104),
        (2.0, 106),
    ]


def test_transform_trace_in_memory_matches_load_options(ten_requests: Path) -> None:
    options = {"window_start_s": 3.0, "rate_scale": 2.0, "sample_fraction": 0.8, "seed": 4}
    loaded = load_trace(ten_requests, **options)  # type: ignore[arg-type]
    plain = load_trace(ten_requests)
    assert transform_trace(plain) is plain  # no options, no copy
    transformed = transform_trace(plain, **options)  # type: ignore[arg-type]
    assert transformed == loaded
    assert "rate_scale=2" in transformed.source and "seed=4" in transformed.source


@pytest.mark.parametrize(
    ("kwargs", "problem"),
    [
        ({"rate_scale": 0.0}, "rate_scale must be > 0"),
        ({"rate_scale": math.inf}, "rate_scale must be finite"),
        ({"sample_fraction": 1.5}, "sample_fraction must be in (0, 1]"),
        ({"max_requests": 0}, "max_requests must be an integer >= 1"),
        ({"window_start_s": 10.0, "window_end_s": 5.0}, "window_end_s (5.0) must be greater"),
        ({"window_start_s": -1.0}, "window_start_s must be >= 0"),
        ({"window_start_s": 100.0}, "holds no requests (the trace spans 0 to 18.000 s)"),
        ({"seed": -1}, "seed must be an integer >= 0"),
    ],
)
def test_bad_options(ten_requests: Path, kwargs: dict[str, object], problem: str) -> None:
    with pytest.raises(TraceError) as err:
        load_trace(ten_requests, **kwargs)  # type: ignore[arg-type]
    assert problem in str(err.value)


# ---------------------------------------------------------------------- detection, errors


def test_unknown_format_lists_valid_ones(ten_requests: Path) -> None:
    with pytest.raises(TraceError, match="valid formats: azure, mooncake, generic, acceptance"):
        load_trace(ten_requests, "parquet")


def test_missing_file_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "nope.csv"
    with pytest.raises(TraceError, match=re.escape(str(missing)) + ".*does not exist"):
        load_trace(missing)


def test_ambiguous_record_asks_for_fmt(tmp_path: Path) -> None:
    path = _jsonl(
        tmp_path / "x.jsonl",
        [{"arrival_s": 0, "input_tokens": 1, "output_tokens": 1, "input_length": 1}],
    )
    with pytest.raises(TraceFormatError, match=r"x\.jsonl:1: .*both generic and mooncake"):
        load_trace(path)


def test_unrecognised_header(tmp_path: Path) -> None:
    path = _write(tmp_path / "x.txt", "a,b,c\n1,2,3\n")
    with pytest.raises(TraceFormatError, match=r"x\.txt:1: cannot tell the format.*pass fmt="):
        load_trace(path)


def test_detection_without_extension(tmp_path: Path) -> None:
    az = _write(tmp_path / "trace", AZURE_HEADER + "2023-11-16 10:00:00,3,4\n")
    assert load_trace(az).source.startswith("azure:")
    mc = _write(tmp_path / "trace2", '{"timestamp": 0, "input_length": 1, "output_length": 1}\n')
    assert load_trace(mc).source.startswith("mooncake:")


def test_empty_file(tmp_path: Path) -> None:
    with pytest.raises(TraceFormatError, match=r"e\.csv:1: the file is empty"):
        load_trace(_write(tmp_path / "e.csv", "\n\n"))


# ------------------------------------------------------------------------------ value types


def test_request_validation() -> None:
    with pytest.raises(TraceError, match="input_tokens"):
        Request(0.0, 0, 1)
    with pytest.raises(TraceError, match="acc_len has 1 values but output_tokens is 2"):
        Request(0.0, 1, 2, acc_len=(1,))
    with pytest.raises(TraceError, match="acc_len values"):
        Request(0.0, 1, 2, acc_len=(1, 0))
    with pytest.raises(TraceError, match="arrival_s"):
        Request(math.nan, 1, 1)
    with pytest.raises(TraceError, match="arrival_s"):
        Request("0", 1, 1)  # type: ignore[arg-type]


def test_trace_validation_and_empty_summary() -> None:
    with pytest.raises(TraceError, match=r"first request must arrive at 0\.0"):
        Trace("t", (Request(1.0, 1, 1),), "test")
    with pytest.raises(TraceError, match="sorted by arrival_s"):
        Trace("t", (Request(0.0, 1, 1), Request(2.0, 1, 1), Request(1.0, 1, 1)), "test")
    summary = Trace("t", (), "test").summary()
    assert summary["requests"] == 0
    assert summary["mean_input_tokens"] is None
    assert summary["output_tokens_per_s"] is None
    json.dumps(summary)


def test_crlf_files_and_line_numbers(tmp_path: Path) -> None:
    path = tmp_path / "crlf.csv"
    path.write_bytes(
        b"TIMESTAMP,ContextTokens,GeneratedTokens\r\n"
        b"2023-11-16 10:00:00.5,3,4\r\n2023-11-16 10:00:01.5,5,6\r\n"
    )
    assert [r.arrival_s for r in load_trace(path).requests] == [0.0, 1.0]
    path.write_bytes(path.read_bytes() + b"2023-11-16 10:00:02,x,6\r\n")
    with pytest.raises(TraceFormatError, match=r"crlf\.csv:4: ContextTokens 'x'"):
        load_trace(path)


def test_prefix_hash_ids_alias_round_trip_and_summary(tmp_path: Path) -> None:
    path = _jsonl(
        tmp_path / "ids.jsonl",
        [
            {"arrival_s": 0.0, "input_tokens": 1100, "output_tokens": 2, "hash_ids": [4, 5, 6]},
            {"arrival_s": 0.5, "input_tokens": 600, "output_tokens": 2, "prefix_hash_ids": [4]},
            {"arrival_s": 0.9, "input_tokens": 600, "output_tokens": 2},
        ],
    )
    trace = load_trace(path)
    assert [r.hash_ids for r in trace.requests] == [(4, 5, 6), (4,), None]
    assert trace.summary()["with_hash_ids"] == 2
    # Written back under the canonical key; transforms keep the ids.
    out = tmp_path / "out.jsonl"
    write_trace_jsonl(transform_trace(trace, rate_scale=2.0), out)
    assert '"hash_ids":[4]' in out.read_text() and "prefix_hash_ids" not in out.read_text()
    assert [r.hash_ids for r in load_trace(out).requests] == [(4, 5, 6), (4,), None]
    # A trace without ids has no such summary key (summaries stay as they were).
    assert "with_hash_ids" not in load_trace(_sample_files(tmp_path)["generic"]).summary()


def test_request_hash_ids_validation() -> None:
    assert Request(0.0, 513, 1, hash_ids=(1, 2)).hash_ids == (1, 2)
    with pytest.raises(TraceError, match="hash_ids has 3 ids but 513 input tokens"):
        Request(0.0, 513, 1, hash_ids=(1, 2, 3))
    with pytest.raises(TraceError, match=r"hash_ids values must be integers in \[0, 2\^63\)"):
        Request(0.0, 513, 1, hash_ids=(1, -1))
