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
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Final, TypeVar

from prometheus_client.parser import text_string_to_metric_families

from specgov.adapters.errors import ResponseFormatError

DP_LABEL: Final = "dp_rank"
# Labels naming the process that exported a series inside one DP group (its replica).
REPLICA_LABELS: Final = ("tp_rank", "pp_rank", "moe_ep_rank", "pid")
PRIORITY_LABEL: Final = "priority"
EXPECTED_FORMAT: Final = "Prometheus text exposition format 0.0.4 (SGLang /metrics)"

DPRank = str | None  # the dp_rank label value; None when the server exports none (DP=1)
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
        return frozenset(k.get(DP_LABEL) for k in keys if k.get("tp_rank") is not None)


# ------------------------------------------------------------------------ parsing


def _finite(value: float) -> bool:
    return not (math.isnan(value) or math.isinf(value))


def _parse_le(raw: str, key: SeriesKey, source: str) -> float:
    try:
        return float(raw)  # float() reads "+Inf" as inf
    except ValueError:
        raise ResponseFormatError(
            source, EXPECTED_FORMAT, f"{key}: bucket bound le={raw!r} is not a number"
        ) from None


def parse_metrics(text: str, *, source: str = "<metrics text>") -> MetricsSnapshot:
    """Parse a ``/metrics`` body. Raises :class:`ResponseFormatError` naming ``source``."""
    try:
        families = list(text_string_to_metric_families(text))
    except (ValueError, IndexError, KeyError, TypeError) as exc:
        raise ResponseFormatError(source, EXPECTED_FORMAT, f"unparseable: {exc}") from None

    counters: dict[SeriesKey, float] = {}
    gauges: dict[SeriesKey, float] = {}
    types: dict[str, str] = {}
    unknown: list[UnknownValue] = []
    # histogram base key -> (le -> cumulative), sums, counts
    buckets: dict[SeriesKey, dict[float, float]] = defaultdict(dict)
    sums: dict[SeriesKey, float] = {}
    counts: dict[SeriesKey, float] = {}
    seen: set[SeriesKey] = set()

    def once(key: SeriesKey) -> None:
        # The format forbids a series twice; a repeat means a broken exporter or proxy.
        if key in seen:
            raise ResponseFormatError(source, EXPECTED_FORMAT, f"series {key} appears twice")
        seen.add(key)

    for family in families:
        if family.type == "counter":
            for sample in family.samples:
                if sample.name.endswith("_created"):
                    continue
                key = SeriesKey.of(sample.name, sample.labels)
                once(key)
                types[sample.name] = "counter"
                value = float(sample.value)
                if not _finite(value) or value < 0:
                    unknown.append(UnknownValue(key, "counter", f"illegal counter value {value}"))
                else:
                    counters[key] = value
        elif family.type == "gauge":
            types[family.name] = "gauge"
            for sample in family.samples:
                key = SeriesKey.of(sample.name, sample.labels)
                once(key)
                value = float(sample.value)
                if not _finite(value):
                    unknown.append(UnknownValue(key, "gauge", f"gauge value {value}"))
                else:
                    gauges[key] = value
        elif family.type == "histogram":
            types[family.name] = "histogram"
            for sample in family.samples:
                labels = dict(sample.labels)
                suffix = sample.name[len(family.name) :]
                if suffix == "_bucket":
                    raw_le = labels.pop("le", None)
                    base = SeriesKey.of(family.name, labels)
                    if raw_le is None:
                        raise ResponseFormatError(
                            source, EXPECTED_FORMAT, f"{base}: _bucket sample without 'le'"
                        )
                    le = _parse_le(raw_le, base, source)
                    once(SeriesKey.of(sample.name, sample.labels))
                    buckets[base][le] = float(sample.value)
                elif suffix == "_sum":
                    base = SeriesKey.of(family.name, labels)
                    once(SeriesKey.of(sample.name, labels))
                    sums[base] = float(sample.value)
                elif suffix == "_count":
                    base = SeriesKey.of(family.name, labels)
                    once(SeriesKey.of(sample.name, labels))
                    counts[base] = float(sample.value)
                # _created and anything else: not used.
        else:
            # summary, info, stateset, untyped: SGLang's series of interest are none of these.
            types.setdefault(family.name, family.type)

    histograms: dict[SeriesKey, HistogramSeries] = {}
    for base in sorted(set(buckets) | set(sums) | set(counts)):
        by_le = buckets.get(base, {})
        bounds = tuple(sorted(by_le))
        cumulative = tuple(by_le[b] for b in bounds)
        if any(not _finite(c) or c < 0 for c in cumulative):
            unknown.append(UnknownValue(base, "histogram", f"illegal bucket count in {cumulative}"))
            continue
        total_sum = sums.get(base)
        total_count = counts.get(base)
        histograms[base] = HistogramSeries(
            bounds=bounds,
            cumulative=cumulative,
            sum=total_sum if total_sum is not None and _finite(total_sum) else None,
            count=total_count if total_count is not None and _finite(total_count) else None,
        )

    return MetricsSnapshot(
        counters=counters,
        gauges=gauges,
        histograms=histograms,
        types=types,
        unknown=tuple(unknown),
    )


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


def counter_by_dp(
    snapshot: MetricsSnapshot, name: str, *, match: Mapping[str, str] | None = None
) -> dict[DPRank, RankValue]:
    """Per DP group, the sum of the counter's series (matching ``match``) of one replica."""
    return {
        dp: RankValue(dp, math.fsum(v for _, v in kvs), tuple(k for k, _ in kvs))
        for dp, kvs in _pick_replicas(snapshot.counters, name, match).items()
    }


def gauge_by_dp(
    snapshot: MetricsSnapshot, name: str, *, match: Mapping[str, str] | None = None
) -> dict[DPRank, RankValue]:
    """Per DP group, the gauge's total series of one replica.

    A group whose replica exports several candidate series (labels ``match`` does not
    pin down) is left out: which one is meant cannot be told, so it is unknown.
    """
    totals = {k: v for k, v in snapshot.gauges.items() if (k.get(PRIORITY_LABEL) or "") == ""}
    out: dict[DPRank, RankValue] = {}
    for dp, kvs in _pick_replicas(totals, name, match).items():
        if len(kvs) == 1:
            key, value = kvs[0]
            out[dp] = RankValue(dp, value, (key,))
    return out


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


def histogram_by_dp(
    snapshot: MetricsSnapshot, name: str, *, match: Mapping[str, str] | None = None
) -> dict[DPRank, RankHistogram]:
    """Per DP group, the bucket-wise sum of the histogram's series of one replica."""
    out: dict[DPRank, RankHistogram] = {}
    for dp, kvs in _pick_replicas(snapshot.histograms, name, match).items():
        summed = sum_histograms((h for _, h in kvs), what=name)
        if summed is not None:
            out[dp] = RankHistogram(dp, summed, tuple(k for k, _ in kvs))
    return out


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
