"""Trace files: the readers of each format, format detection, ``load_trace`` and the writer.

Formats (``load_trace(path, fmt)``; ``fmt=None`` detects it from the extension, the CSV
header or the first JSON record):

``azure``
    Azure LLM inference trace CSV (Patel et al., "Splitwise", ISCA 2024), header
    ``TIMESTAMP,ContextTokens,GeneratedTokens``; timestamps like
    ``2023-11-16 18:15:46.6805900`` (any number of fractional digits, optional ``Z`` or
    ``+HH:MM`` suffix; naive times are read as UTC). Extra columns are ignored.
``mooncake``
    Mooncake-style JSONL, one object per line:
    ``{"timestamp": <ms>, "input_length": N, "output_length": M, "hash_ids": [...]}``;
    ``hash_ids`` is optional (prefix block ids, below); other keys are ignored.
``generic``
    specgov's interchange format, CSV or JSONL: ``arrival_s`` (or ``timestamp_s``),
    ``input_tokens``, ``output_tokens``, optional ``domain`` and (JSONL only) optional
    ``acc_len`` and ``hash_ids`` (or its alias ``prefix_hash_ids``). Unknown columns or
    keys are an error, so a misspelt ``domain`` is never dropped silently.
``acceptance``
    Per-token acceptance traces, JSONL: ``{"arrival_s": t, "input_tokens": N,
    "output_tokens": M, "acc_len": [M ints >= 1], "domain": "..."}``; ``arrival_s`` and
    ``domain`` are optional (without ``arrival_s`` every request arrives at 0, i.e. back to
    back), but ``arrival_s`` must then be missing from every record.

Prefix block ids (``hash_ids``): see ``specgov.simulator.workload.traces``.

Zero-token policy (all formats): a request needs at least one input and one output token.
Rows with ``0`` input or output tokens are skipped and counted in ``Trace.skipped_rows``
(reported by ``Trace.summary()``); a negative or non-integer count is a format error. The
public Azure 2023 traces hold no such rows.


``"<file>:<line>: <what is wrong>; expected <form>"`` (quoted file text escaped and cut).

Bounds (all formats; a row beyond one is a format error naming its line, found quickly
and in bounded memory, since the file is read line by line):

* a line holds at most :data:`MAX_LINE_BYTES` (4 MiB: room for an acceptance trace of a
  million tokens), a CSV field or a JSON string at most :data:`MAX_FIELD_CHARS`;
* a token count is at most :data:`MAX_TOKENS` (2^20, about the largest context served
  today) and, with ``max_context_tokens`` (the model's context, when the caller knows
  it), input + output tokens are at most that;
* a time value is finite and at most :data:`MAX_TIMESTAMP_S` in magnitude (POSIX seconds
  to the year 5138), and a trace spans at most :data:`MAX_SPAN_S` (30 days) from its first
  request to its last, after ``rate_scale`` too: every simulated second costs work.
"""

from __future__ import annotations

import csv
import json
import math
import os
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final

from specgov.adapters.errors import escape_upstream
from specgov.policies.common.validation import is_int, is_real
from specgov.simulator.workload.traces import (
    MAX_HASH_ID,
    MAX_SPAN_S,
    PREFIX_BLOCK_TOKENS,
    Request,
    Trace,
    TraceError,
    check_trace_options,
    max_prefix_blocks,
    transform_trace,
)

__all__ = [
    "MAX_FIELD_CHARS",
    "MAX_LINE_BYTES",
    "MAX_TIMESTAMP_S",
    "MAX_TOKENS",
    "TRACE_FORMATS",
    "TraceFormatError",
    "load_trace",
]

TRACE_FORMATS: tuple[str, ...] = ("azure", "mooncake", "generic", "acceptance")

MAX_LINE_BYTES: Final = 4 * 1024 * 1024
MAX_FIELD_CHARS: Final = 4096
MAX_TOKENS: Final = 1 << 20
MAX_TIMESTAMP_S: Final = 1e11
_PROBLEM_MAX_CHARS: Final = 600

_AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
_AZURE_FORM = "CSV header TIMESTAMP,ContextTokens,GeneratedTokens and rows like " + (
    "'2023-11-16 18:15:46.6805900,374,44' (non-negative integer token counts)"
)
_MOONCAKE_FORM = (
    'one JSON object per line like {"timestamp": <ms>, "input_length": N, "output_length": M}'
    ' (optional "hash_ids": at most ceil(N / 512) integers in [0, 2^63))'
)
_GENERIC_KEYS = frozenset({"arrival_s", "timestamp_s", "input_tokens", "output_tokens", "domain"})
_HASH_KEYS = ("hash_ids", "prefix_hash_ids")
_GENERIC_JSON_KEYS = _GENERIC_KEYS | {"acc_len", *_HASH_KEYS}
_GENERIC_CSV_FORM = "CSV header arrival_s,input_tokens,output_tokens[,domain] (or timestamp_s)"
_GENERIC_JSON_FORM = (
    'one JSON object per line like {"arrival_s": t, "input_tokens": N, "output_tokens": M, '
    '"domain": "code"} (optional domain, acc_len, hash_ids: at most ceil(N / 512) integers '
    "in [0, 2^63), one per 512-token prompt block)"
)
_ACCEPTANCE_FORM = (
    'one JSON object per line like {"arrival_s": t, "input_tokens": N, "output_tokens": M, '
    '"acc_len": [M ints >= 1], "domain": "code"} (arrival_s and domain optional)'
)
_ANY_FORM = (
    f"azure ({_AZURE_FORM}), mooncake ({_MOONCAKE_FORM}), generic ({_GENERIC_CSV_FORM} or "
    f"{_GENERIC_JSON_FORM}) or acceptance ({_ACCEPTANCE_FORM}); or pass fmt= explicitly"
)

# Seconds with any number of fractional digits: datetime.fromisoformat in 3.11 handles
# the 7-digit Azure fractions only by accident of its parser, so the fraction is split off
# and added back at full precision.
_TIMESTAMP_RE = re.compile(
    r"(\d{4}-\d{2}-\d{2}[ T]\d{2}:\d{2}:\d{2})(?:\.(\d+))?(Z|[+-]\d{2}:?\d{2})?"
)


class TraceFormatError(TraceError):
    """A trace file does not match its format; the message names file and line."""

    def __init__(self, file: str | os.PathLike[str], line: int, problem: str, form: str):
        self.file = escape_upstream(str(file), 400)
        self.line = line
        self.problem = escape_upstream(problem, _PROBLEM_MAX_CHARS)  # quotes file text
        self.form = form
        super().__init__(f"{self.file}:{line}: {self.problem}; expected {form}")


# --------------------------------------------------------------------------- parsing helpers


class _Row:
    """One parsed row before the zero-token policy and re-zeroing."""

    __slots__ = (
        "acc_len",
        "arrival_s",
        "domain",
        "hash_ids",
        "input_tokens",
        "line",
        "output_tokens",
    )

    def __init__(
        self,
        line: int,
        arrival_s: float,
        input_tokens: int,
        output_tokens: int,
        domain: str | None = None,
        acc_len: tuple[int, ...] | None = None,
        hash_ids: tuple[int, ...] | None = None,
    ) -> None:
        self.line = line
        self.arrival_s = arrival_s
        self.input_tokens = input_tokens
        self.output_tokens = output_tokens
        self.domain = domain
        self.acc_len = acc_len
        self.hash_ids = hash_ids


def _parse_timestamp(text: str, file: Path, line: int) -> tuple[int, float]:
    """Whole POSIX seconds and the fraction, kept apart so that differences between
    timestamps keep sub-microsecond precision (a float epoch has only ~0.2 us)."""
    m = _TIMESTAMP_RE.fullmatch(text.strip())
    if m is None:
        raise TraceFormatError(file, line, f"TIMESTAMP {text!r} is not a timestamp", _AZURE_FORM)
    base, frac, tz = m.groups()
    try:
        dt = datetime.fromisoformat(base + (tz or ""))
    except ValueError as exc:
        raise TraceFormatError(file, line, f"TIMESTAMP {text!r}: {exc}", _AZURE_FORM) from None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=UTC)  # naive times as UTC: local time would shift across DST
    whole = int(dt.timestamp())
    return whole, (int(frac) / 10 ** len(frac) if frac else 0.0)


def _csv_int(text: str, column: str, file: Path, line: int, form: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise TraceFormatError(file, line, f"{column} {text!r} is not an integer", form) from None
    if value < 0:
        raise TraceFormatError(file, line, f"{column} {value} is negative", form)
    return _check_tokens(column, value, file, line, form)


def _check_tokens(name: str, value: int, file: Path, line: int, form: str) -> int:
    if value > MAX_TOKENS:
        raise TraceFormatError(
            file,
            line,
            f"{name} {value} is above the maximum of {MAX_TOKENS} tokens per request",
            form,
        )
    return value


def _check_time(name: str, seconds: float, file: Path, line: int, form: str) -> float:
    if not abs(seconds) <= MAX_TIMESTAMP_S:
        raise TraceFormatError(
            file,
            line,
            f"{name} {seconds:g} s is beyond the bound of {MAX_TIMESTAMP_S:g} s in magnitude",
            form,
        )
    return seconds


def _csv_float(text: str, column: str, file: Path, line: int, form: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise TraceFormatError(file, line, f"{column} {text!r} is not a number", form) from None
    if not math.isfinite(value):
        raise TraceFormatError(file, line, f"{column} {text!r} is not finite", form)
    return value


def _json_int(obj: Mapping[str, Any], key: str, file: Path, line: int, form: str) -> int:
    if key not in obj:
        raise TraceFormatError(file, line, f"key {key!r} is missing", form)
    value = obj[key]
    if not is_int(value):
        raise TraceFormatError(file, line, f"{key} {value!r} is not an integer", form)
    if value < 0:
        raise TraceFormatError(file, line, f"{key} {value} is negative", form)
    return _check_tokens(key, value, file, line, form)


def _json_float(obj: Mapping[str, Any], key: str, file: Path, line: int, form: str) -> float:
    value = obj[key]
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TraceFormatError(file, line, f"{key} {value!r} is not a number", form)
    if not is_real(value):  # also an int beyond float range
        raise TraceFormatError(file, line, f"{key} {value!r} is not finite", form)
    return float(value)


def _json_domain(obj: Mapping[str, Any], file: Path, line: int, form: str) -> str | None:
    value = obj.get("domain")
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise TraceFormatError(file, line, f"domain {value!r} is not a non-empty string", form)
    if len(value) > MAX_FIELD_CHARS:
        raise TraceFormatError(
            file, line, f"domain has {len(value)} characters, more than {MAX_FIELD_CHARS}", form
        )
    return value


def _json_records(
    file: Path, lines: Iterable[str], form: str
) -> Iterator[tuple[int, dict[str, Any]]]:
    for index, raw in enumerate(lines):
        text = raw.strip()
        if not text:
            continue
        line = index + 1
        obj = _json_value(text, file, line, form)
        if not isinstance(obj, dict):
            raise TraceFormatError(file, line, f"a JSON {type(obj).__name__}, not an object", form)
        yield line, obj


def _json_value(text: str, file: Path, line: int, form: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise TraceFormatError(file, line, f"invalid JSON ({exc.msg})", form) from None
    except ValueError as exc:  # an integer of more digits than int() reads
        raise TraceFormatError(file, line, f"invalid JSON number ({exc})", form) from None
    except RecursionError:
        raise TraceFormatError(file, line, "JSON nested too deeply", form) from None


def _no_requests(file: Path, lines: _Lines, form: str) -> None:
    raise TraceFormatError(file, lines.count or 1, "the file holds no requests", form)


class _Lines:
    """The file's lines, read one at a time: at most MAX_LINE_BYTES each, UTF-8, split on
    ``\\n`` only (as ``str.split("\\n")``: a final newline gives a last empty line).

    ``str.splitlines`` would also break at \\x0c, \\u2028, ..., shifting the line numbers
    in error messages away from what an editor shows. ``count``: lines read so far.
    """

    def __init__(self, file: Path) -> None:
        self.file = file
        self.count = 0

    def __iter__(self) -> Iterator[str]:
        self.count = 0
        with self.file.open("rb") as stream:
            ended_with_newline = True
            while True:
                raw = stream.readline(MAX_LINE_BYTES + 1)
                if not raw:
                    break
                self.count += 1
                ended_with_newline = raw.endswith(b"\n")
                if ended_with_newline:
                    raw = raw[:-1]
                elif len(raw) > MAX_LINE_BYTES:
                    raise TraceFormatError(
                        self.file,
                        self.count,
                        f"the line is longer than {MAX_LINE_BYTES} bytes (4 MiB)",
                        "one request per line of at most 4 MiB",
                    )
                try:
                    yield raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise TraceFormatError(
                        self.file, self.count, f"not UTF-8 text ({exc.reason})", "UTF-8 text"
                    ) from None
            if ended_with_newline:
                self.count += 1
                yield ""


def _csv_rows(file: Path, lines: Iterable[str], form: str) -> Iterator[tuple[int, list[str]]]:
    """CSV rows and their (last) line numbers; each field at most MAX_FIELD_CHARS."""
    reader = csv.reader(lines)
    while True:
        try:
            fields = next(reader)
        except StopIteration:
            return
        except csv.Error as exc:
            raise TraceFormatError(
                file,
                reader.line_num,
                f"malformed CSV ({exc}); a field holds at most {MAX_FIELD_CHARS} characters",
                form,
            ) from None
        for col, text in enumerate(fields):
            if len(text) > MAX_FIELD_CHARS:
                raise TraceFormatError(
                    file,
                    reader.line_num,
                    f"field {col + 1} has {len(text)} characters, more than {MAX_FIELD_CHARS}",
                    form,
                )
        yield reader.line_num, fields


# --------------------------------------------------------------------------------- readers


def _read_azure(file: Path, lines: _Lines) -> list[_Row]:
    reader = _csv_rows(file, lines, _AZURE_FORM)
    first = next(reader, None)
    if first is None:
        raise TraceFormatError(file, 1, "the file is empty", _AZURE_FORM)
    header = first[1]
    names = [h.strip().lstrip("\ufeff") for h in header]
    missing = [c for c in _AZURE_COLUMNS if c not in names]
    if missing:
        raise TraceFormatError(
            file, 1, f"header {','.join(names)!r} lacks column(s) {', '.join(missing)}", _AZURE_FORM
        )
    i_ts, i_in, i_out = (names.index(c) for c in _AZURE_COLUMNS)
    width = len(names)
    rows: list[_Row] = []
    ref_s: int | None = None  # whole seconds of the first row; arrivals are relative to it
    for line, fields in reader:
        if not fields or (len(fields) == 1 and not fields[0].strip()):
            continue
        if len(fields) != width:
            raise TraceFormatError(
                file, line, f"{len(fields)} column(s) where the header has {width}", _AZURE_FORM
            )
        whole, frac = _parse_timestamp(fields[i_ts], file, line)
        if ref_s is None:
            ref_s = whole
        rows.append(
            _Row(
                line,
                float(whole - ref_s) + frac,
                _csv_int(fields[i_in].strip(), "ContextTokens", file, line, _AZURE_FORM),
                _csv_int(fields[i_out].strip(), "GeneratedTokens", file, line, _AZURE_FORM),
            )
        )
    if not rows:
        _no_requests(file, lines, _AZURE_FORM)
    return rows


def _read_mooncake(file: Path, lines: _Lines) -> list[_Row]:
    rows: list[_Row] = []
    for line, obj in _json_records(file, lines, _MOONCAKE_FORM):
        if "timestamp" not in obj:
            raise TraceFormatError(file, line, "key 'timestamp' is missing", _MOONCAKE_FORM)
        ts_ms = _json_float(obj, "timestamp", file, line, _MOONCAKE_FORM)
        n_in = _json_int(obj, "input_length", file, line, _MOONCAKE_FORM)
        rows.append(
            _Row(
                line,
                _check_time("timestamp", ts_ms / 1000.0, file, line, _MOONCAKE_FORM),
                n_in,
                _json_int(obj, "output_length", file, line, _MOONCAKE_FORM),
                hash_ids=_json_hash_ids(obj, ("hash_ids",), n_in, file, line, _MOONCAKE_FORM),
            )
        )
    if not rows:
        _no_requests(file, lines, _MOONCAKE_FORM)
    return rows


def _read_generic_csv(file: Path, lines: _Lines) -> list[_Row]:
    form = _GENERIC_CSV_FORM
    reader = _csv_rows(file, lines, form)
    first = next(reader, None)
    if first is None:
        raise TraceFormatError(file, 1, "the file is empty", form)
    header = first[1]
    names = [h.strip().lstrip("\ufeff") for h in header]
    unknown = [n for n in names if n not in _GENERIC_KEYS]
    if unknown:
        raise TraceFormatError(file, 1, f"unknown column(s) {', '.join(unknown)}", form)
    if len(set(names)) != len(names):
        raise TraceFormatError(file, 1, "a column name appears twice", form)
    if "arrival_s" in names and "timestamp_s" in names:
        raise TraceFormatError(file, 1, "both arrival_s and timestamp_s columns", form)
    time_col = "arrival_s" if "arrival_s" in names else "timestamp_s"
    missing = [c for c in (time_col, "input_tokens", "output_tokens") if c not in names]
    if missing:
        raise TraceFormatError(file, 1, f"missing column(s) {', '.join(missing)}", form)
    i_t, i_in, i_out = (
        names.index(time_col),
        names.index("input_tokens"),
        names.index("output_tokens"),
    )
    i_dom = names.index("domain") if "domain" in names else None
    rows: list[_Row] = []
    for line, fields in reader:
        if not fields or (len(fields) == 1 and not fields[0].strip()):
            continue
        if len(fields) != len(names):
            raise TraceFormatError(
                file, line, f"{len(fields)} column(s) where the header has {len(names)}", form
            )
        domain = (fields[i_dom].strip() or None) if i_dom is not None else None
        rows.append(
            _Row(
                line,
                _check_time(
                    time_col,
                    _csv_float(fields[i_t].strip(), time_col, file, line, form),
                    file,
                    line,
                    form,
                ),
                _csv_int(fields[i_in].strip(), "input_tokens", file, line, form),
                _csv_int(fields[i_out].strip(), "output_tokens", file, line, form),
                domain,
            )
        )
    if not rows:
        _no_requests(file, lines, form)
    return rows


def _read_generic_jsonl(file: Path, lines: _Lines, *, acceptance: bool) -> list[_Row]:
    form = _ACCEPTANCE_FORM if acceptance else _GENERIC_JSON_FORM
    rows: list[_Row] = []
    with_arrival: bool | None = None
    for line, obj in _json_records(file, lines, form):
        unknown = sorted(set(obj) - _GENERIC_JSON_KEYS)
        if unknown:
            raise TraceFormatError(file, line, f"unknown key(s) {', '.join(unknown)}", form)
        if "arrival_s" in obj and "timestamp_s" in obj:
            raise TraceFormatError(file, line, "both arrival_s and timestamp_s", form)
        time_key = "timestamp_s" if "timestamp_s" in obj else "arrival_s"
        has_arrival = time_key in obj
        if not acceptance and not has_arrival:
            raise TraceFormatError(file, line, "key 'arrival_s' is missing", form)
        if with_arrival is not None and has_arrival != with_arrival:
            raise TraceFormatError(
                file,
                line,
                "arrival_s is given for some records but not others",
                form + ", arrival_s on every record or on none",
            )
        with_arrival = has_arrival
        arrival = 0.0
        if has_arrival:
            arrival = _check_time(
                time_key, _json_float(obj, time_key, file, line, form), file, line, form
            )
        n_in = _json_int(obj, "input_tokens", file, line, form)
        n_out = _json_int(obj, "output_tokens", file, line, form)
        acc: tuple[int, ...] | None = None
        if "acc_len" in obj:
            acc = _json_acc_len(obj["acc_len"], n_out, file, line, form)
        elif acceptance:
            raise TraceFormatError(file, line, "key 'acc_len' is missing", form)
        ids = _json_hash_ids(obj, _HASH_KEYS, n_in, file, line, form)
        rows.append(_Row(line, arrival, n_in, n_out, _json_domain(obj, file, line, form), acc, ids))
    if not rows:
        _no_requests(file, lines, form)
    return rows


def _json_acc_len(value: Any, n_out: int, file: Path, line: int, form: str) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise TraceFormatError(file, line, "acc_len is not a list", form)
    if len(value) != n_out:
        raise TraceFormatError(
            file, line, f"acc_len has {len(value)} values but output_tokens is {n_out}", form
        )
    for pos, v in enumerate(value):
        if not is_int(v) or v < 1:
            raise TraceFormatError(
                file, line, f"acc_len[{pos}] = {v!r} is not an integer >= 1", form
            )
    return tuple(value)


def _json_hash_ids(
    obj: Mapping[str, Any],
    keys: Sequence[str],
    n_in: int,
    file: Path,
    line: int,
    form: str,
) -> tuple[int, ...] | None:
    """The prefix block ids under one of ``keys`` (aliases; at most one may be given)."""
    given = [k for k in keys if k in obj]
    if not given:
        return None
    if len(given) > 1:
        raise TraceFormatError(file, line, f"both {' and '.join(given)} (aliases)", form)
    key = given[0]
    value = obj[key]
    if not isinstance(value, list):
        raise TraceFormatError(file, line, f"{key} is not a list", form)
    top = max_prefix_blocks(n_in)
    if len(value) > top:
        raise TraceFormatError(
            file,
            line,
            f"{key} has {len(value)} ids but {n_in} input tokens make at most {top} blocks "
            f"of {PREFIX_BLOCK_TOKENS} tokens",
            form,
        )
    for pos, v in enumerate(value):
        if not is_int(v) or not 0 <= v <= MAX_HASH_ID:
            raise TraceFormatError(
                file, line, f"{key}[{pos}] = {v!r} is not an integer in [0, 2^63)", form
            )
    return tuple(value)


# ----------------------------------------------------------------------------- detection


def _first_nonblank(lines: Iterable[str]) -> tuple[int, str] | None:
    for index, raw in enumerate(lines):
        if raw.strip():
            return index + 1, raw.strip()
    return None


def _detect(file: Path, first: tuple[int, str] | None) -> str:
    if first is None:
        raise TraceFormatError(file, 1, "the file is empty", _ANY_FORM)
    line, text = first
    if text.startswith("["):
        raise TraceFormatError(file, line, "a JSON array, not JSON lines", _ANY_FORM)
    suffix = file.suffix.lower()
    looks_json = text.startswith("{")
    if suffix == ".csv" and looks_json:
        raise TraceFormatError(file, line, "a .csv file whose first line is JSON", _ANY_FORM)
    if looks_json:
        obj = _json_value(text, file, line, _ANY_FORM)
        if not isinstance(obj, dict):
            raise TraceFormatError(file, line, "the first record is not a JSON object", _ANY_FORM)
        keys = set(obj)
        candidates = []
        if "acc_len" in keys:
            candidates.append("acceptance")
        elif keys & {"arrival_s", "timestamp_s", "input_tokens", "output_tokens"}:
            candidates.append("generic")
        if keys & {"input_length", "output_length"}:
            candidates.append("mooncake")
        if len(candidates) == 1:
            return candidates[0]
        what = "both " + " and ".join(candidates) if candidates else "neither"
        raise TraceFormatError(
            file,
            line,
            f"cannot tell the format from keys {sorted(keys)} (they match {what})",
            _ANY_FORM,
        )
    names = {h.strip().lstrip("\ufeff") for h in next(_csv_rows(file, [text], _ANY_FORM))[1]}
    if set(_AZURE_COLUMNS) <= names:
        return "azure"
    if names & {"arrival_s", "timestamp_s", "input_tokens", "output_tokens"}:
        return "generic"
    raise TraceFormatError(file, line, f"cannot tell the format from header {text!r}", _ANY_FORM)


# ----------------------------------------------------------------------------- load_trace


def load_trace(
    path: str | os.PathLike[str],
    fmt: str | None = None,
    *,
    window_start_s: float | None = None,
    window_end_s: float | None = None,
    rate_scale: float = 1.0,
    sample_fraction: float | None = None,
    max_requests: int | None = None,
    seed: int = 0,
    default_domain: str | None = None,
    max_context_tokens: int | None = None,
) -> Trace:
    """Read a trace file (formats: module docstring) and apply, in this order:

    1. the window ``[window_start_s, window_end_s)`` on the original timeline (seconds from
       the file's first request);
    2. ``rate_scale``: inter-arrival times divided by it (4 -> four times the request rate);
    3. ``sample_fraction``: a random subset of ``round(fraction * n)`` requests (at least
       one), drawn with ``numpy.random.default_rng(seed)``;
    4. ``max_requests``: the first that many requests.

    Arrivals are re-based so the first kept request arrives at 0. ``default_domain`` labels
    requests whose file gives no domain. ``max_context_tokens``: the model's context, when
    known; a row whose input + output tokens exceed it is a format error. Raises
    ``TraceError`` for bad options, a missing file or an empty result,
    ``TraceFormatError`` (a ``TraceError``) for file contents (bounds: module docstring).
    """
    check_trace_options(
        window_start_s, window_end_s, rate_scale, sample_fraction, max_requests, seed
    )
    _check_file_options(fmt, default_domain, max_context_tokens)
    file = Path(path)
    if not file.is_file():
        what = "is a directory, not a file" if file.is_dir() else "does not exist"
        raise TraceError(f"trace file {str(file)!r} {what}")
    lines = _Lines(file)
    first = _first_nonblank(lines)
    detected = fmt if fmt is not None else _detect(file, first)
    rows = _read_rows(file, lines, detected, first)
    _check_rows(file, rows, detected, first, max_context_tokens)
    return transform_trace(
        _trace_of(file, rows, detected, default_domain),
        window_start_s=window_start_s,
        window_end_s=window_end_s,
        rate_scale=rate_scale,
        sample_fraction=sample_fraction,
        max_requests=max_requests,
        seed=seed,
    )


def _check_file_options(
    fmt: str | None, default_domain: str | None, max_context_tokens: int | None
) -> None:
    if fmt is not None and fmt not in TRACE_FORMATS:
        raise TraceError(f"unknown trace format {fmt!r}; valid formats: {', '.join(TRACE_FORMATS)}")
    if default_domain is not None and (not isinstance(default_domain, str) or not default_domain):
        raise TraceError(f"default_domain must be a non-empty string, got {default_domain!r}")
    if max_context_tokens is not None and (
        not is_int(max_context_tokens) or max_context_tokens < 2
    ):
        raise TraceError(f"max_context_tokens must be an int >= 2, got {max_context_tokens!r}")


def _read_rows(file: Path, lines: _Lines, fmt: str, first: tuple[int, str] | None) -> list[_Row]:
    if fmt == "azure":
        return _read_azure(file, lines)
    if fmt == "mooncake":
        return _read_mooncake(file, lines)
    if fmt == "acceptance":
        return _read_generic_jsonl(file, lines, acceptance=True)
    if first is not None and first[1].startswith("{"):
        return _read_generic_jsonl(file, lines, acceptance=False)
    return _read_generic_csv(file, lines)


def _trace_of(file: Path, rows: list[_Row], fmt: str, default_domain: str | None) -> Trace:
    """The rows as a trace: zero-token rows skipped, sorted, re-based to arrive from 0."""
    kept = [r for r in rows if r.input_tokens >= 1 and r.output_tokens >= 1]
    if not kept:
        raise TraceError(
            f"trace file {str(file)!r}: all {len(rows)} requests have 0 input or output tokens"
        )
    kept.sort(key=lambda r: r.arrival_s)  # stable: equal timestamps keep file order
    t0 = kept[0].arrival_s
    return Trace(
        name=file.stem,
        requests=tuple(
            Request(
                arrival_s=r.arrival_s - t0,
                input_tokens=r.input_tokens,
                output_tokens=r.output_tokens,
                domain=r.domain if r.domain is not None else default_domain,
                acc_len=r.acc_len,
                hash_ids=r.hash_ids,
            )
            for r in kept
        ),
        source=f"{fmt}:{file}",
        skipped_rows=len(rows) - len(kept),
    )


def _check_rows(
    file: Path,
    rows: Sequence[_Row],
    fmt: str,
    first: tuple[int, str] | None,
    max_context_tokens: int | None,
) -> None:
    """Bounds across rows (module docstring): the span and the model's context."""
    if fmt == "azure":
        form = _AZURE_FORM
    elif fmt == "mooncake":
        form = _MOONCAKE_FORM
    elif fmt == "acceptance":
        form = _ACCEPTANCE_FORM
    else:
        is_json = first is not None and first[1].startswith("{")
        form = _GENERIC_JSON_FORM if is_json else _GENERIC_CSV_FORM
    if max_context_tokens is not None:
        for r in rows:
            if r.input_tokens + r.output_tokens > max_context_tokens:
                raise TraceFormatError(
                    file,
                    r.line,
                    f"{r.input_tokens} input + {r.output_tokens} output tokens exceed the "
                    f"model's context of {max_context_tokens} tokens",
                    form,
                )
    if not rows:
        return
    earliest = min(rows, key=lambda r: r.arrival_s)
    for r in rows:
        span = r.arrival_s - earliest.arrival_s
        if span > MAX_SPAN_S:
            raise TraceFormatError(
                file,
                r.line,
                f"this request arrives {span:g} s after the earliest one (line "
                f"{earliest.line}); a trace spans at most {MAX_SPAN_S:g} s (30 days)",
                form,
            )
