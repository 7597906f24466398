"""SGLang's ``/metrics`` body (Prometheus text format 0.0.4) as a typed snapshot.

Pure functions, no IO. :func:`parse_metrics` turns the text into a
:class:`MetricsSnapshot` whose series are keyed by metric name plus label set; the
``*_by_dp`` selectors then read one value per data-parallel (DP) group, the way SGLang
0.5.23 exports them (``srt/observability/metrics_collector.py``):

* Scheduler series carry ``model_name``, ``engine_type``, ``tp_rank``, ``pp_rank``,
  ``moe_ep_rank``, plus ``dp_rank`` under data parallelism and ``priority`` when priority
  scheduling is on. Only the stats-logging rank of each DP group (``attn_tp_rank == 0``)
  refreshes the scheduler gauges, unless ``--enable-metrics-for-all-schedulers``, in which
  case every TP rank reports the same values under its own ``tp_rank``; constants
  (``sglang:max_total_num_tokens``) and pre-seeded counters are exported by every rank.
  Under DP attention ``tp_rank`` is global, so DP group 1's logging rank is not
  ``tp_rank="0"``. Therefore: group by ``dp_rank``, and inside a group read the replica
  with the lowest (``tp_rank``, ``pp_rank``, ``moe_ep_rank``, ``pid``) that has the
  series — never sum TP ranks.
* Gauges without a ``multiprocess_mode`` (``sglang:num_retracted_reqs``) are merged by
  prometheus_client's multiprocess collector in mode "all", which adds a ``pid`` label.
* With priority scheduling, a gauge's total is the ``priority=""`` series and the
  ``priority="<int>"`` series are a breakdown of it; gauges read the total only.
* Tokenizer series (``generation_tokens_total``, the latency histograms) have no rank
  labels; their label sets (``is_streaming``, per-request ``priority``, custom labels)
  partition the requests, so they are summed.

Values that are not legal for their type (a NaN or infinite gauge or counter, a negative
counter, a NaN bucket) are not kept: they are listed in :attr:`MetricsSnapshot.unknown`
and read as missing, i.e. unknown — never as 0.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from functools import lru_cache
from typing import Any, Final, TypeVar

from specgov.adapters.errors import ResponseFormatError
from specgov.policies.common.errors import SpecgovError

DP_LABEL: Final = "dp_rank"
# Labels naming the process that exported a series inside one DP group (its replica).
REPLICA_LABELS: Final = ("tp_rank", "pp_rank", "moe_ep_rank", "pid")
PRIORITY_LABEL: Final = "priority"
EXPECTED_FORMAT: Final = "Prometheus text exposition format 0.0.4 (SGLang /metrics)"

DPRank = str | None  # the dp_rank label value; None when the server exports none (DP=1)
Labels = tuple[tuple[str, str], ...]  # sorted (name, value) pairs
_T = TypeVar("_T")


@dataclass(frozen=True, slots=True, order=True)
class SeriesKey:
    """A series: metric (sample) name and its sorted label pairs."""

    name: str
    labels: tuple[tuple[str, str], ...] = ()

    @classmethod
    def of(cls, name: str, labels: Mapping[str, str] | None = None) -> SeriesKey:
        return cls(name, tuple(sorted((labels or {}).items())))

    def get(self, label: str) -> str | None:
        for key, value in self.labels:
            if key == label:
                return value
        return None

    def without(self, *names: str) -> tuple[tuple[str, str], ...]:
        return tuple((k, v) for k, v in self.labels if k not in names)

    def __str__(self) -> str:
        inner = ",".join(f'{k}="{v}"' for k, v in self.labels)
        return f"{self.name}{{{inner}}}"


@dataclass(frozen=True, slots=True)
class HistogramSeries:
    """One histogram series: ascending bucket upper bounds (``le``) and cumulative counts.

    The last bound is ``inf`` when the ``+Inf`` bucket was exported (it always is by
    prometheus_client). ``sum``/``count`` are None when absent or not finite.
    """

    bounds: tuple[float, ...]
    cumulative: tuple[float, ...]
    sum: float | None = None
    count: float | None = None

    def __post_init__(self) -> None:
        if len(self.bounds) != len(self.cumulative):
            raise ValueError(
                f"HistogramSeries: {len(self.bounds)} bounds but "
                f"{len(self.cumulative)} cumulative counts"
            )
        if any(a >= b for a, b in zip(self.bounds, self.bounds[1:], strict=False)):
            raise ValueError(
                f"HistogramSeries.bounds: expected strictly increasing, got {self.bounds}"
            )

    @property
    def total(self) -> float | None:
        """Observations counted: the ``+Inf`` bucket, else ``count``."""
        if self.bounds and math.isinf(self.bounds[-1]):
            return self.cumulative[-1]
        return self.count


@dataclass(frozen=True, slots=True)
class UnknownValue:
    """A sample dropped because its value is not legal for its type."""

    key: SeriesKey
    kind: str  # "counter" | "gauge" | "histogram"
    reason: str


@dataclass(frozen=True, slots=True)
class MetricsSnapshot:
    """Every counter, gauge and histogram series of one scrape.

    Counters are keyed by their sample name (``sglang:generation_tokens_total``), gauges
    by the gauge name, histograms by the base name (``sglang:time_to_first_token_seconds``)
    with the ``le`` label removed. ``types`` maps each declared name to its type.
    """

    counters: Mapping[SeriesKey, float] = field(default_factory=dict)
    gauges: Mapping[SeriesKey, float] = field(default_factory=dict)
    histograms: Mapping[SeriesKey, HistogramSeries] = field(default_factory=dict)
    types: Mapping[str, str] = field(default_factory=dict)
    unknown: tuple[UnknownValue, ...] = ()
    # DP groups of scheduler series in families a filtered parse left out (so that
    # dp_groups() does not depend on which families were kept).
    other_dp_groups: frozenset[DPRank] = frozenset()
    # Answers of the *_by_dp selectors and a by-name index of the series, filled on first
    # use: the builder asks the same questions of a scrape twice (as the end of one
    # window, then as the start of the next). Not part of the value.
    _memo: dict[tuple[str, str, Labels], Any] = field(
        default_factory=dict, init=False, repr=False, compare=False, hash=False
    )

    def has_metric(self, name: str) -> bool:
        """True if any series (or an unknown value) of ``name`` was exported."""
        return (
            any(k.name == name for k in self.counters)
            or any(k.name == name for k in self.gauges)
            or any(k.name == name for k in self.histograms)
            or any(u.key.name == name for u in self.unknown)
        )

    def dp_groups(self) -> frozenset[DPRank]:
        """DP groups that export scheduler series (those carrying ``tp_rank``)."""
        keys: Iterable[SeriesKey] = (
            *self.counters,
            *self.gauges,
            *self.histograms,
            *(u.key for u in self.unknown),
        )
        seen = frozenset(k.get(DP_LABEL) for k in keys if k.get("tp_rank") is not None)
        return seen | self.other_dp_groups


# ------------------------------------------------------------------------ parsing

# The metric-family selection a caller passes (``families=``) names series the way a
# snapshot keys them: counters by sample name (``..._total``), gauges by name,
# histograms by base name.
Families = Collection[str]

# One sample as the assembler sees it: sample name, sorted label pairs, value (``le``
# stays a label with its text, as exported).
MetricSample = tuple[str, Labels, float]
# One metric family: declared name, prometheus_client type, samples.
MetricFamily = tuple[str, str, list[MetricSample]]


def _parse_le(raw: str, key: SeriesKey, source: str) -> float:
    try:
        return float(raw)  # float() reads "+Inf" as inf
    except ValueError:
        raise ResponseFormatError(
            source, EXPECTED_FORMAT, f"{key}: bucket bound le={raw!r} is not a number"
        ) from None


@lru_cache(maxsize=4096)
def _split_le(labels: Labels) -> tuple[Labels, str | None]:
    """A bucket's labels without ``le``, and the raw ``le`` value (None if absent)."""
    raw: str | None = None
    rest: list[tuple[str, str]] = []
    for pair in labels:
        if pair[0] == "le":
            raw = pair[1]
        else:
            rest.append(pair)
    return tuple(rest), raw


def _histograms(
    buckets: Mapping[tuple[str, Labels], dict[float, float]],
    sums: Mapping[tuple[str, Labels], float],
    counts: Mapping[tuple[str, Labels], float],
    unknown: list[UnknownValue],
) -> dict[SeriesKey, HistogramSeries]:
    """Each histogram base's series; one with an illegal bucket count goes to ``unknown``."""
    isfinite = math.isfinite
    histograms: dict[SeriesKey, HistogramSeries] = {}
    for base in sorted(set(buckets) | set(sums) | set(counts)):
        by_le = buckets.get(base, {})
        bounds = tuple(sorted(by_le))
        cumulative = tuple(by_le[b] for b in bounds)
        if any(not isfinite(c) or c < 0 for c in cumulative):
            unknown.append(
                UnknownValue(SeriesKey(*base), "histogram", f"illegal bucket count in {cumulative}")
            )
            continue
        total_sum = sums.get(base)
        total_count = counts.get(base)
        histograms[SeriesKey(*base)] = HistogramSeries(
            bounds=bounds,
            cumulative=cumulative,
            sum=total_sum if total_sum is not None and isfinite(total_sum) else None,
            count=total_count if total_count is not None and isfinite(total_count) else None,
        )
    return histograms


def assemble_snapshot(
    families: Iterable[MetricFamily], source: str, other_dp_groups: frozenset[DPRank] = frozenset()
) -> MetricsSnapshot:
    """Typed snapshot from parsed families (shared by the lexer, the tests' oracle and
    the simulated server's direct snapshot, so all apply the same rules: duplicates,
    illegal values, histogram assembly)."""
    # Plain (name, labels) keys while assembling: SeriesKey hashes in Python code.
    counters: dict[tuple[str, Labels], float] = {}
    gauges: dict[tuple[str, Labels], float] = {}
    types: dict[str, str] = {}
    unknown: list[UnknownValue] = []
    # histogram base (name, labels) -> (le -> cumulative), sums, counts
    buckets: dict[tuple[str, Labels], dict[float, float]] = defaultdict(dict)
    sums: dict[tuple[str, Labels], float] = {}
    counts: dict[tuple[str, Labels], float] = {}
    seen: set[tuple[str, Labels]] = set()
    isfinite = math.isfinite

    def once(key: tuple[str, Labels]) -> None:
        # The format forbids a series twice; a repeat means a broken exporter or proxy.
        if key in seen:
            raise ResponseFormatError(
                source, EXPECTED_FORMAT, f"series {SeriesKey(*key)} appears twice"
            )
        seen.add(key)

    for name, typ, samples in families:
        if typ == "counter":
            for sample_name, labels, value in samples:
                if sample_name.endswith("_created"):
                    continue
                once(key := (sample_name, labels))
                types[sample_name] = "counter"
                if not isfinite(value) or value < 0:
                    unknown.append(
                        UnknownValue(SeriesKey(*key), "counter", f"illegal counter value {value}")
                    )
                else:
                    counters[key] = value
        elif typ == "gauge":
            types[name] = "gauge"
            for sample_name, labels, value in samples:
                once(key := (sample_name, labels))
                if not isfinite(value):
                    unknown.append(UnknownValue(SeriesKey(*key), "gauge", f"gauge value {value}"))
                else:
                    gauges[key] = value
        elif typ == "histogram":
            types[name] = "histogram"
            n = len(name)
            for sample_name, labels, value in samples:
                suffix = sample_name[n:]
                if suffix == "_bucket":
                    rest, raw_le = _split_le(labels)
                    base = (name, rest)
                    if raw_le is None:
                        raise ResponseFormatError(
                            source,
                            EXPECTED_FORMAT,
                            f"{SeriesKey(*base)}: _bucket sample without 'le'",
                        )
                    le = _parse_le(raw_le, SeriesKey(*base), source)
                    once((sample_name, labels))
                    buckets[base][le] = value
                elif suffix == "_sum" or suffix == "_count":
                    once((sample_name, labels))
                    (sums if suffix == "_sum" else counts)[(name, labels)] = value
                # _created and anything else: not used.
        else:  # summary, info, stateset, unknown: SGLang's series read are none of these
            types.setdefault(name, typ)

    histograms = _histograms(buckets, sums, counts, unknown)
    return MetricsSnapshot(
        counters={SeriesKey(*k): v for k, v in counters.items()},
        gauges={SeriesKey(*k): v for k, v in gauges.items()},
        histograms=histograms,
        types=types,
        unknown=tuple(unknown),
        other_dp_groups=other_dp_groups,
    )


def parse_metrics(
    text: str, *, source: str = "<metrics text>", families: Families | None = None
) -> MetricsSnapshot:
    """Parse a ``/metrics`` body. Raises :class:`ResponseFormatError` naming ``source``.

    One parser: a line lexer built for the text prometheus_client and SGLang write
    (an order of magnitude faster than prometheus_client's parser, whose semantics it
    reproduces; tests/test_prometheus_fast.py holds that parser as the oracle it agrees
    with). ``families=None`` keeps every family; given a set of names (snapshot names:
    see :data:`Families`) only those are kept, and the result equals :func:`restrict`
    of the full parse to them: lines of the other families are only scanned for their
    family boundaries and DP groups, not validated. A line the lexer does not model
    (quoted UTF-8 names, ``__name__`` labels, a malformed kept line ...) is an error
    naming its line number.
    """
    wanted = (
        None
        if families is None
        else families
        if isinstance(families, frozenset)
        else frozenset(families)
    )
    fams, other_dp = _lex_families(text, wanted, source)
    snapshot = assemble_snapshot(fams, source, other_dp)
    return snapshot if wanted is None else restrict(snapshot, wanted)


def restrict(snapshot: MetricsSnapshot, families: Families) -> MetricsSnapshot:
    """The part of ``snapshot`` that ``parse_metrics(text, families=...)`` keeps."""
    keep = families if isinstance(families, frozenset) else frozenset(families)
    left_out: Iterable[SeriesKey] = (
        *(k for k in snapshot.counters if k.name not in keep),
        *(k for k in snapshot.gauges if k.name not in keep),
        *(k for k in snapshot.histograms if k.name not in keep),
        *(u.key for u in snapshot.unknown if u.key.name not in keep),
    )
    other = frozenset(k.get(DP_LABEL) for k in left_out if k.get("tp_rank") is not None)
    return MetricsSnapshot(
        counters={k: v for k, v in snapshot.counters.items() if k.name in keep},
        gauges={k: v for k, v in snapshot.gauges.items() if k.name in keep},
        histograms={k: v for k, v in snapshot.histograms.items() if k.name in keep},
        types={k: v for k, v in snapshot.types.items() if k in keep},
        unknown=tuple(u for u in snapshot.unknown if u.key.name in keep),
        other_dp_groups=other | snapshot.other_dp_groups,
    )


# ------------------------------------------------------------- the fast line lexer
#
# It reproduces prometheus_client 0.26's text parser (parser.py:
# text_fd_to_metric_families) for the lines it keeps: a family starts at a HELP or TYPE
# line naming a new metric, or at a sample whose name the current family does not allow
# (that sample is an untyped family of its own); counters declared without ``_total``
# get it appended to their samples; label values unescape ``\\``, ``\"`` and ``\n``;
# a value is int() else float() of the first token, "_" refused; a second token is a
# timestamp (validated, ignored). tests/test_prometheus_fast.py checks it against
# prometheus_client with generated exposition text. What it does not model is refused
# with the line (SGLang writes none of it).


class _Unmodelled(SpecgovError):
    """The lexer met something it does not model (or that is malformed): an error."""


_METRIC_TYPES: Final = frozenset(
    {"counter", "gauge", "summary", "histogram", "gaugehistogram", "unknown", "info", "stateset"}
)
_ALLOWED_SUFFIXES: Final = {
    "counter": ("",),
    "gauge": ("",),
    "summary": ("_count", "_sum", ""),
    "histogram": ("_count", "_sum", "_bucket"),
}
_NAME_RE: Final = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
# prometheus_client splits comment lines on string.whitespace.
_META_SPLIT_RE: Final = re.compile(r"[ \t\n\r\x0b\x0c]+")
_LABEL: Final = r'[ \t]*[a-zA-Z_][a-zA-Z0-9_]*[ \t]*=[ \t]*"(?:[^"\\]|\\.)*"[ \t]*'
_SERIES_RE: Final = re.compile(
    r"[a-zA-Z_:][a-zA-Z0-9_:]*\{(?:" + _LABEL + r",)*(?:" + _LABEL + r")?[ \t]*\}"
)
_LABEL_PAIR_RE: Final = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)[ \t]*=[ \t]*"((?:[^"\\]|\\.)*)"')
_ESCAPE_RE: Final = re.compile(r'\\[\\n"]')
_ESCAPES: Final = {"\\\\": "\\", "\\n": "\n", '\\"': '"'}
_SERIES_CACHE_MAX: Final = 65_536

# Series text (``name{...}``) -> its sorted label pairs. The same series come back in
# every scrape, so label parsing runs once per series, not once per line.
_series_cache: dict[str, tuple[tuple[str, str], ...]] = {}


def _unescape(match: re.Match[str]) -> str:
    return _ESCAPES[match.group(0)]


def _series_labels(series: str, name_end: int) -> tuple[tuple[str, str], ...]:
    cached = _series_cache.get(series)
    if cached is not None:
        return cached
    if _SERIES_RE.fullmatch(series) is None:
        raise _Unmodelled
    pairs: dict[str, str] = {}
    for m in _LABEL_PAIR_RE.finditer(series, name_end + 1):
        label, value = m.group(1), m.group(2)
        if label.startswith("__") or label in pairs:
            raise _Unmodelled  # reserved / __name__ / duplicate: the reference decides
        pairs[label] = _ESCAPE_RE.sub(_unescape, value) if "\\" in value else value
    labels = tuple(sorted(pairs.items()))
    if len(_series_cache) >= _SERIES_CACHE_MAX:
        _series_cache.clear()
    _series_cache[series] = labels
    return labels


def _number(token: str) -> float:
    # prometheus_client: int(token), else float(token); "_" refused (float() takes it).
    if "_" in token:
        raise _Unmodelled
    try:
        value = float(token)
    except ValueError:
        raise _Unmodelled from None
    if math.isinf(value) or (value == 0.0 and math.copysign(1.0, value) < 0.0):
        try:
            as_int = int(token)
        except ValueError:
            return value
        if as_int == 0:
            return 0.0  # int("-0") is 0: the reference reads +0.0
        raise _Unmodelled  # an integer too large for a float: the reference errs
    return value


def _value(rest: str) -> float:
    s = rest.lstrip()
    if " " not in s and "\t" not in s:
        if not s:
            raise _Unmodelled
        return _number(s)
    sep = " " if " " in s else "\t"
    tokens = [t.strip() for t in s.split(sep) if t.strip()]
    if not tokens:
        raise _Unmodelled
    if len(tokens) > 1:
        _number(tokens[-1])  # the timestamp must parse too
    return _number(tokens[0])


# Every name a family's samples can be keyed by: its own, its histogram / summary
# sample names, each with the _total a counter declared without it appends.
_SAMPLE_SUFFIXES: Final = tuple(
    a + b for a in ("", "_bucket", "_sum", "_count") for b in ("", "_total")
)


def _may_keep(family: str, wanted: frozenset[str] | None) -> bool:
    return wanted is None or any(family + suffix in wanted for suffix in _SAMPLE_SUFFIXES)


def _refused(source: str, lineno: int, raw: str) -> ResponseFormatError:
    # The line last: the error escapes and cuts its detail (a huge line costs nothing).
    return ResponseFormatError(
        source,
        EXPECTED_FORMAT,
        f"unparseable: line {lineno}: not Prometheus text as SGLang writes it (malformed, or a "
        f"construct specgov does not read: quoted names, __name__ or duplicate labels): {raw}",
    )


def _lex_families(
    text: str, wanted: frozenset[str] | None, source: str
) -> tuple[list[MetricFamily], frozenset[DPRank]]:
    """The kept families of ``text`` (``None``: all) and the DP groups of the others'
    scheduler series."""
    where: list[Any] = [0, ""]  # the line being read (number, text), for the error
    try:
        return _lex(text, wanted, where)
    except _Unmodelled:
        raise _refused(source, where[0], where[1]) from None


# Over 80 lines on purpose: one pass of the hot parser's state machine (family state in
# locals, shared with close()), read whole against prometheus_client's; split, it pays calls.
def _lex(
    text: str, wanted: frozenset[str] | None, where: list[Any]
) -> tuple[list[MetricFamily], frozenset[DPRank]]:
    out: list[MetricFamily] = []
    other_dp: set[DPRank] = set()
    # The family being read: its name, type, allowed sample names, buffered samples
    # (name, labels, value) if it may be kept, DP groups seen if not.
    name = ""
    typ = "untyped"
    allowed: tuple[str, ...] = ()
    maybe_kept = False
    buffered: list[tuple[str, tuple[tuple[str, str], ...], float]] = []
    dps: list[tuple[str, DPRank]] = []  # (sample name, dp_rank) of tp_rank series

    def close() -> None:
        if name == "":
            return
        kind = "unknown" if typ == "untyped" else typ
        if kind not in _METRIC_TYPES:
            raise _Unmodelled  # the reference refuses the type when it builds the family
        if maybe_kept:
            # restrict() drops the series outside ``wanted`` afterwards: a family's
            # samples need not carry its name (a second TYPE line can retype them).
            rename = kind == "counter" and not name.endswith("_total")
            samples = [(s + "_total" if rename else s, labels, v) for s, labels, v in buffered]
            out.append((name, kind, samples))
        elif kind in ("counter", "gauge", "histogram"):
            # The series the assembler would key (a histogram's other samples are not).
            for sample, dp in dps:
                if kind != "histogram" or sample[len(name) :] in ("_bucket", "_sum", "_count"):
                    other_dp.add(dp)

    for lineno, raw in enumerate(text.split("\n"), 1):
        where[0], where[1] = lineno, raw
        line = raw.strip()
        if not line:
            continue
        if line[0] == "#":
            parts = _META_SPLIT_RE.split(line, 3)
            if '"' in line and any('"' in p for p in parts[:3]):
                raise _Unmodelled  # quotes change where prometheus_client splits
            if len(parts) < 3:
                if len(parts) == 2 and parts[1] in ("HELP", "TYPE"):
                    raise _Unmodelled
                continue
            if parts[1] != "HELP" and parts[1] != "TYPE":
                continue
            candidate = parts[2]
            if _NAME_RE.fullmatch(candidate) is None:
                raise _Unmodelled
            if parts[1] == "HELP":
                if candidate != name:
                    close()
                    name, typ, allowed = candidate, "untyped", (candidate,)
                    buffered, dps = [], []
                    maybe_kept = _may_keep(candidate, wanted)
                continue
            if len(parts) < 4:
                raise _Unmodelled
            if candidate != name:
                close()
                name = candidate
                buffered, dps = [], []
                maybe_kept = _may_keep(candidate, wanted)
            typ = parts[3]
            allowed = tuple(name + s for s in _ALLOWED_SUFFIXES.get(typ, ("",)))
            continue
        m = _NAME_RE.match(line)
        if m is None:
            raise _Unmodelled
        end = m.end()
        if end == len(line):
            raise _Unmodelled
        sample = m.group()
        if line[end] == "{":
            close_at = line.rfind("}")
            series = line[: close_at + 1]
            rest = line[close_at + 1 :]
            has_labels = True
        elif line[end] in " \t" and "{" not in line and '"' not in line:
            series, rest, has_labels = sample, line[end:], False
        else:
            raise _Unmodelled
        if sample not in allowed:
            # prometheus_client: the family ends; this sample is an untyped family.
            close()
            name, typ, allowed, maybe_kept = "", "untyped", (), False
            buffered, dps = [], []
            if wanted is None or sample in wanted:
                labels = _series_labels(series, end) if has_labels else ()
                out.append((sample, "unknown", [(sample, labels, _value(rest))]))
            continue
        if maybe_kept:
            labels = _series_labels(series, end) if has_labels else ()
            buffered.append((sample, labels, _value(rest)))
        elif has_labels and "tp_rank" in series:
            labels = _series_labels(series, end)
            pairs = dict(labels)
            if "tp_rank" in pairs:
                dps.append((sample, pairs.get(DP_LABEL)))
    close()
    return out, frozenset(other_dp)


# ---------------------------------------------------------------------- selection


def _label_order(value: str | None) -> tuple[int, int, str]:
    if value is None:
        return (0, 0, "")
    if value.isdigit():
        return (1, int(value), "")
    return (2, 0, value)


def _replica_order(replica: tuple[str | None, ...]) -> tuple[tuple[int, int, str], ...]:
    return tuple(_label_order(v) for v in replica)


def _matches(key: SeriesKey, match: Mapping[str, str] | None) -> bool:
    return match is None or all(key.get(k) == v for k, v in match.items())


def _pick_replicas(
    series: Mapping[SeriesKey, _T], name: str, match: Mapping[str, str] | None
) -> dict[DPRank, list[tuple[SeriesKey, _T]]]:
    """Per DP group, the series of its lowest-ranked replica exporting ``name``."""
    groups: dict[DPRank, dict[tuple[str | None, ...], list[tuple[SeriesKey, _T]]]] = defaultdict(
        lambda: defaultdict(list)
    )
    for key, value in series.items():
        if key.name != name or not _matches(key, match):
            continue
        replica = tuple(key.get(label) for label in REPLICA_LABELS)
        groups[key.get(DP_LABEL)][replica].append((key, value))
    picked: dict[DPRank, list[tuple[SeriesKey, _T]]] = {}
    for dp, replicas in groups.items():
        best = min(replicas, key=_replica_order)
        picked[dp] = sorted(replicas[best], key=lambda kv: kv[0])
    return picked


@dataclass(frozen=True, slots=True)
class RankValue:
    """One DP group's value of a metric and the series it was read from."""

    dp_rank: DPRank
    value: float
    keys: tuple[SeriesKey, ...]


def _named(snapshot: MetricsSnapshot, kind: str, name: str) -> Mapping[SeriesKey, Any]:
    """The ``kind`` ("counters" | "gauges" | "histograms") series named ``name``."""
    memo = snapshot._memo
    index: dict[str, dict[SeriesKey, Any]] | None = memo.get(("index", kind, ()))
    if index is None:
        index = defaultdict(dict)
        series: Mapping[SeriesKey, Any] = getattr(snapshot, kind)
        for key, value in series.items():
            index[key.name][key] = value
        memo[("index", kind, ())] = index
    return index.get(name, {})


def _memo_key(selector: str, name: str, match: Mapping[str, str] | None) -> tuple[str, str, Labels]:
    return (selector, name, tuple(sorted(match.items())) if match else ())


def _by_dp_memoised(
    snapshot: MetricsSnapshot,
    selector: str,
    name: str,
    match: Mapping[str, str] | None,
    groups: Callable[[MetricsSnapshot, str, Mapping[str, str] | None], dict[DPRank, _T]],
) -> dict[DPRank, _T]:
    """``groups(snapshot, name, match)``, memoised on the snapshot; each caller gets a copy."""
    key = _memo_key(selector, name, match)
    cached: dict[DPRank, _T] | None = snapshot._memo.get(key)
    if cached is None:
        cached = groups(snapshot, name, match)
        snapshot._memo[key] = cached
    return dict(cached)


def _counter_groups(
    snapshot: MetricsSnapshot, name: str, match: Mapping[str, str] | None
) -> dict[DPRank, RankValue]:
    return {
        dp: RankValue(dp, math.fsum(v for _, v in kvs), tuple(k for k, _ in kvs))
        for dp, kvs in _pick_replicas(_named(snapshot, "counters", name), name, match).items()
    }


def counter_by_dp(
    snapshot: MetricsSnapshot, name: str, *, match: Mapping[str, str] | None = None
) -> dict[DPRank, RankValue]:
    """Per DP group, the sum of the counter's series (matching ``match``) of one replica."""
    return _by_dp_memoised(snapshot, "counter", name, match, _counter_groups)


def _gauge_groups(
    snapshot: MetricsSnapshot, name: str, match: Mapping[str, str] | None
) -> dict[DPRank, RankValue]:
    totals = {
        k: v
        for k, v in _named(snapshot, "gauges", name).items()
        if (k.get(PRIORITY_LABEL) or "") == ""
    }
    groups: dict[DPRank, RankValue] = {}
    for dp, kvs in _pick_replicas(totals, name, match).items():
        if len(kvs) == 1:
            key, value = kvs[0]
            groups[dp] = RankValue(dp, value, (key,))
    return groups


def gauge_by_dp(
    snapshot: MetricsSnapshot, name: str, *, match: Mapping[str, str] | None = None
) -> dict[DPRank, RankValue]:
    """Per DP group, the gauge's total series of one replica.

    A group whose replica exports several candidate series (labels ``match`` does not
    pin down) is left out: which one is meant cannot be told, so it is unknown.
    """
    return _by_dp_memoised(snapshot, "gauge", name, match, _gauge_groups)


def sum_histograms(hists: Iterable[HistogramSeries], *, what: str) -> HistogramSeries | None:
    """Bucket-wise sum of histograms with identical bounds (None for no histogram)."""
    items = list(hists)
    if not items:
        return None
    bounds = items[0].bounds
    for h in items[1:]:
        if h.bounds != bounds:
            raise ResponseFormatError(
                what, "one bucket layout per histogram", f"bounds {h.bounds} vs {bounds}"
            )
    cumulative = tuple(math.fsum(col) for col in zip(*(h.cumulative for h in items), strict=True))
    sums = [h.sum for h in items]
    counts = [h.count for h in items]
    return HistogramSeries(
        bounds=bounds,
        cumulative=cumulative,
        sum=None if any(s is None for s in sums) else math.fsum(s for s in sums if s is not None),
        count=None
        if any(c is None for c in counts)
        else math.fsum(c for c in counts if c is not None),
    )


@dataclass(frozen=True, slots=True)
class RankHistogram:
    """One DP group's histogram (summed over its label sets) and its source series."""

    dp_rank: DPRank
    histogram: HistogramSeries
    keys: tuple[SeriesKey, ...]


def _histogram_groups(
    snapshot: MetricsSnapshot, name: str, match: Mapping[str, str] | None
) -> dict[DPRank, RankHistogram]:
    groups: dict[DPRank, RankHistogram] = {}
    for dp, kvs in _pick_replicas(_named(snapshot, "histograms", name), name, match).items():
        summed = sum_histograms((h for _, h in kvs), what=name)
        if summed is not None:
            groups[dp] = RankHistogram(dp, summed, tuple(k for k, _ in kvs))
    return groups


def histogram_by_dp(
    snapshot: MetricsSnapshot, name: str, *, match: Mapping[str, str] | None = None
) -> dict[DPRank, RankHistogram]:
    """Per DP group, the bucket-wise sum of the histogram's series of one replica."""
    return _by_dp_memoised(snapshot, "histogram", name, match, _histogram_groups)


class Aggregation(StrEnum):
    """How DP groups combine: counts add up, ratios average, settings must agree."""

    SUM = "sum"
    MEAN = "mean"
    AGREE = "agree"


def aggregate_dp(
    values: Mapping[DPRank, float],
    how: Aggregation,
    *,
    expected: Iterable[DPRank] | None = None,
) -> float | None:
    """Combine per-DP values; None if empty, if a group in ``expected`` is missing, or
    (AGREE) if the groups disagree."""
    if not values:
        return None
    if expected is not None and not set(expected) <= set(values):
        return None
    items = [values[k] for k in sorted(values, key=_label_order)]
    if how is Aggregation.SUM:
        return math.fsum(items)
    if how is Aggregation.MEAN:
        return math.fsum(items) / len(items)
    first = items[0]
    return first if all(v == first for v in items) else None
