"""Build the policies' :class:`~specgov.policies.common.observation.Observation` from
SGLang telemetry.

:class:`ObservationBuilder` is a pure state machine: feed it, in time order, the client
time of a scrape, the parsed ``/metrics`` snapshot, and the ``/server_info`` and
``/v1/loads`` JSON bodies (any may be None when that request failed) and it answers an
Observation. Nothing is read from a clock, a file or the network here.

Where each field comes from (SGLang 0.5.23):

* running / queued requests, token usage: ``/v1/loads`` (``num_running_reqs``,
  ``num_waiting_reqs``, ``token_usage`` per DP rank; published by the scheduler on every
  prefill, when idle and every ``load_snapshot_publish_interval`` decode iterations), else
  the ``sglang:num_running_reqs`` / ``num_queue_reqs`` / ``token_usage`` gauges, aged
  (:class:`~specgov.adapters.telemetry.GaugeAger`): a gauge older than
  ``max_gauge_age_s`` is unknown. Counts add up over DP ranks; token usage is their mean.
* KV capacity (tokens, all DP ranks): ``/v1/loads`` ``max_total_num_tokens``, else
  ``/server_info`` ``internal_states[*].memory_usage.token_capacity``, else the
  ``sglang:max_total_num_tokens`` gauge (a start-up constant: not aged), else
  ``/server_info`` ``max_total_num_tokens`` × ``dp_size``.
* Throughput, accept length, verify calls, generation tokens, retractions, TTFT / ITL /
  TPOT / e2e quantiles: deltas between this scrape and an earlier one
  (:func:`~specgov.adapters.telemetry.compute_window`); unknown on the first scrape and
  across a restart.
* ``spec_num_steps``: the ``sglang:spec_num_steps`` gauge (the active step count), aged;
  under DP it is known only when every rank reports the same value.
* Shape and slot candidates: the resolved server args in ``/server_info``. With
  ``speculative_adaptive`` the candidate set is the adaptive config's union (SGLang's
  default config when ``speculative_adaptive_config`` is null; otherwise the builder must
  be handed that file's decoded contents, since it does no IO).
* ``staleness_s``: the age of the oldest point-in-time value used (loads snapshot or
  gauge); 0 when all were fresh, None when none was known.

Missing or stale inputs give None ("unknown"), never 0. Malformed bodies raise
:class:`~specgov.adapters.errors.ResponseFormatError` naming the key and the expected form.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Final

from specgov.adapters.errors import ResponseFormatError, bounded_repr
from specgov.adapters.prometheus_text import (
    Aggregation,
    MetricsSnapshot,
    aggregate_dp,
    gauge_by_dp,
)
from specgov.adapters.telemetry import (
    MAX_TOTAL_NUM_TOKENS,
    NUM_QUEUE,
    NUM_RUNNING,
    SPEC_NUM_STEPS,
    TOKEN_USAGE,
    GaugeAger,
    TimedSnapshot,
    WindowStats,
    compute_window,
    quantiles,
)
from specgov.policies.common.observation import LatencyQuantiles, Observation
from specgov.policies.common.types import ALGORITHMS, PolicyTypeError, SlotLayout, SpecShape
from specgov.policies.common.validation import is_int, is_real
from specgov.policies.engine.adaptive_config import (
    DEFAULT_ADAPTIVE_CONFIG,
    AdaptiveConfig,
    parse_adaptive_config,
)

# JSON keys read from /server_info: resolved ServerArgs fields (srt/arg_groups/fields/),
# scheduler info (Scheduler.get_init_info) and internal_states
# (SchedulerInternalStateController.get_internal_state).
SERVER_INFO_KEYS_READ: Final = (
    "speculative_algorithm",
    "speculative_num_steps",
    "speculative_eagle_topk",
    "speculative_num_draft_tokens",
    "speculative_adaptive",
    "speculative_adaptive_config",
    "dp_size",
    "max_total_num_tokens",
    "internal_states",
    "memory_usage",
    "token_capacity",
)
# JSON keys read from /v1/loads (v1_loads.get_loads and LoadSnapshot.to_dict).
LOADS_KEYS_READ: Final = (
    "loads",
    "timestamp",
    "dp_rank",
    "num_running_reqs",
    "num_waiting_reqs",
    "token_usage",
    "max_total_num_tokens",
)

SERVER_INFO_SOURCE: Final = "/server_info"
LOADS_SOURCE: Final = "/v1/loads"


# --------------------------------------------------------------------- JSON helpers


def _fail(source: str, where: str, expected: str, got: object) -> ResponseFormatError:
    # bounded_repr: a huge or deeply nested body is never rendered whole into a message.
    return ResponseFormatError(source, f"{where}: {expected}", f"got {bounded_repr(got)}")


def _opt_int(source: str, where: str, value: object, *, minimum: int = 0) -> int | None:
    if value is None:
        return None
    # JSON numbers may arrive as 3.0 from some encoders; accept integral floats.
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not is_int(value) or value < minimum:
        raise _fail(source, where, f"an int >= {minimum} or null", value)
    return value


def _opt_real(source: str, where: str, value: object) -> float | None:
    if value is None:
        return None
    if not is_real(value) or value < 0:
        raise _fail(source, where, "a finite number >= 0 or null", value)
    return float(value)


def _opt_mapping(source: str, where: str, value: object) -> Mapping[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise _fail(source, where, "a JSON object or null", value)
    return value


# ----------------------------------------------------------------- /server_info


@dataclass(frozen=True, slots=True)
class ServerInfoView:
    """What specgov reads from one ``/server_info`` body."""

    shape: SpecShape | None
    slot_candidates: SlotLayout | None
    dp_size: int | None
    kv_capacity_tokens: int | None
    notes: tuple[str, ...] = ()


def _kv_capacity_from_server_info(body: Mapping[str, Any], dp_size: int | None) -> int | None:
    states = body.get("internal_states")
    if states is not None:
        if not isinstance(states, list):
            raise _fail(SERVER_INFO_SOURCE, "internal_states", "a list (one per DP rank)", states)
        caps: list[int | None] = []
        for i, state in enumerate(states):
            where = f"internal_states[{i}]"
            st = _opt_mapping(SERVER_INFO_SOURCE, where, state)
            mem = _opt_mapping(
                SERVER_INFO_SOURCE, f"{where}.memory_usage", (st or {}).get("memory_usage")
            )
            caps.append(
                _opt_int(
                    SERVER_INFO_SOURCE,
                    f"{where}.memory_usage.token_capacity",
                    (mem or {}).get("token_capacity"),
                    minimum=1,
                )
            )
        if caps and all(c is not None for c in caps):
            return sum(c for c in caps if c is not None)
    per_rank = _opt_int(
        SERVER_INFO_SOURCE, "max_total_num_tokens", body.get("max_total_num_tokens"), minimum=1
    )
    # Scheduler.get_init_info reports one rank's pool; every DP rank has its own.
    if per_rank is None or dp_size is None:
        return None
    return per_rank * dp_size


def parse_server_info(
    body: Mapping[str, Any],
    *,
    adaptive_config: Mapping[str, Any] | AdaptiveConfig | None = None,
) -> ServerInfoView:
    """Read the speculative shape, DP size and KV capacity from a ``/server_info`` body.

    ``adaptive_config``: the decoded ``--speculative-adaptive-config`` file, needed only
    when the server was launched with one (the builder does no file IO).
    """
    src = SERVER_INFO_SOURCE
    if not isinstance(body, Mapping):
        raise _fail(src, "body", "a JSON object", body)
    notes: list[str] = []
    dp_size = _opt_int(src, "dp_size", body.get("dp_size"), minimum=1)
    capacity = _kv_capacity_from_server_info(body, dp_size)

    algo_raw = body.get("speculative_algorithm")
    if algo_raw is not None and not isinstance(algo_raw, str):
        raise _fail(src, "speculative_algorithm", "a string or null", algo_raw)
    adaptive = body.get("speculative_adaptive", False)
    if not isinstance(adaptive, bool):
        raise _fail(src, "speculative_adaptive", "true or false", adaptive)
    cfg_path = body.get("speculative_adaptive_config")
    if cfg_path is not None and not isinstance(cfg_path, str):
        raise _fail(src, "speculative_adaptive_config", "a path string or null", cfg_path)
    steps = _opt_int(src, "speculative_num_steps", body.get("speculative_num_steps"))
    topk = _opt_int(src, "speculative_eagle_topk", body.get("speculative_eagle_topk"))
    drafts = _opt_int(src, "speculative_num_draft_tokens", body.get("speculative_num_draft_tokens"))

    if algo_raw is None:
        return ServerInfoView(SpecShape("NONE", 0, 0, 0, ()), None, dp_size, capacity)
    algorithm = algo_raw.upper()
    if algorithm not in ALGORITHMS:
        notes.append(
            f"shape unknown: speculative_algorithm {bounded_repr(algo_raw, 80)} is not one "
            "specgov models"
        )
        return ServerInfoView(None, None, dp_size, capacity, tuple(notes))
    if steps is None or topk is None or drafts is None:
        notes.append(
            "shape unknown: speculative_num_steps / speculative_eagle_topk / "
            "speculative_num_draft_tokens not all reported"
        )
        return ServerInfoView(None, None, dp_size, capacity, tuple(notes))

    candidates: tuple[int, ...] = ()
    slots: tuple[tuple[int, tuple[int, ...]], ...] | None = None
    if adaptive:
        parsed: AdaptiveConfig | None
        if isinstance(adaptive_config, AdaptiveConfig):
            parsed = adaptive_config
        elif adaptive_config is not None:
            parsed = parse_adaptive_config(adaptive_config, source=cfg_path or "<adaptive config>")
        elif cfg_path is None:
            # No file: SGLang uses its DEFAULT_ADAPTIVE_CONFIG.
            parsed = parse_adaptive_config(
                DEFAULT_ADAPTIVE_CONFIG, source="SGLang's default adaptive config"
            )
        else:
            parsed = None
            notes.append(
                f"shape unknown: the server reads its adaptive config from "
                f"{bounded_repr(cfg_path, 256)}; "
                "pass that file's contents as adaptive_config"
            )
        if parsed is None:
            return ServerInfoView(None, None, dp_size, capacity, tuple(notes))
        candidates = tuple(parsed.candidate_steps)
        slots = tuple((s.bound, s.candidate_steps) for s in parsed.slots)
    try:
        shape = SpecShape(algorithm, steps, topk, drafts, candidates)
    except PolicyTypeError as exc:
        notes.append(f"shape unknown: {exc}")
        return ServerInfoView(None, None, dp_size, capacity, tuple(notes))
    return ServerInfoView(shape, slots, dp_size, capacity, tuple(notes))


# -------------------------------------------------------------------- /v1/loads


@dataclass(frozen=True, slots=True)
class RankLoad:
    """One DP rank's entry of ``/v1/loads``; None fields are unknown."""

    dp_rank: int
    running_requests: int | None
    waiting_requests: int | None
    token_usage: float | None
    capacity_tokens: int | None
    published_at_s: float | None  # scheduler wall clock (epoch seconds)


@dataclass(frozen=True, slots=True)
class LoadsView:
    """A ``/v1/loads`` body: the ranks and the server's clock when it answered."""

    ranks: tuple[RankLoad, ...]
    server_time_s: float | None

    def age_s(self, rank: RankLoad) -> float | None:
        """How old the rank's snapshot was when the server answered (server clock only,
        so client/server clock skew does not enter)."""
        if self.server_time_s is None or rank.published_at_s is None:
            return None
        return max(self.server_time_s - rank.published_at_s, 0.0)


def parse_loads(body: Mapping[str, Any]) -> LoadsView:
    """Read a ``/v1/loads`` JSON body (``include=core,...``)."""
    src = LOADS_SOURCE
    if not isinstance(body, Mapping):
        raise _fail(src, "body", "a JSON object", body)
    loads = body.get("loads")
    if not isinstance(loads, list):
        raise _fail(src, "loads", "a list of per-DP-rank objects", loads)
    server_time: float | None = None
    raw_ts = body.get("timestamp")
    if raw_ts is not None:
        if not isinstance(raw_ts, str):
            raise _fail(src, "timestamp", "an ISO 8601 string", raw_ts)
        try:
            server_time = datetime.fromisoformat(raw_ts).timestamp()
        except ValueError:
            raise _fail(src, "timestamp", "an ISO 8601 string", raw_ts) from None
    ranks: list[RankLoad] = []
    seen: set[int] = set()
    for i, entry in enumerate(loads):
        where = f"loads[{i}]"
        if not isinstance(entry, Mapping):
            raise _fail(src, where, "an object", entry)
        dp_rank = _opt_int(src, f"{where}.dp_rank", entry.get("dp_rank"))
        if dp_rank is None:
            raise _fail(src, f"{where}.dp_rank", "an int >= 0", None)
        if dp_rank in seen:
            raise _fail(src, f"{where}.dp_rank", "each DP rank once", dp_rank)
        seen.add(dp_rank)
        published = _opt_real(src, f"{where}.timestamp", entry.get("timestamp"))
        if published is not None and published == 0.0:
            # ShmLoadSnapshotWriter seeds each slot with LoadSnapshot(dp_rank=...) (all
            # defaults, timestamp 0.0) before the scheduler's first publish.
            ranks.append(RankLoad(dp_rank, None, None, None, None, None))
            continue
        ranks.append(
            RankLoad(
                dp_rank=dp_rank,
                running_requests=_opt_int(
                    src, f"{where}.num_running_reqs", entry.get("num_running_reqs")
                ),
                waiting_requests=_opt_int(
                    src, f"{where}.num_waiting_reqs", entry.get("num_waiting_reqs")
                ),
                token_usage=_opt_real(src, f"{where}.token_usage", entry.get("token_usage")),
                capacity_tokens=_opt_int(
                    src,
                    f"{where}.max_total_num_tokens",
                    entry.get("max_total_num_tokens"),
                    minimum=1,
                ),
                published_at_s=published,
            )
        )
    return LoadsView(tuple(sorted(ranks, key=lambda r: r.dp_rank)), server_time)


# ---------------------------------------------------------------------- builder


@dataclass(frozen=True, slots=True)
class BuildReport:
    """The last Observation with how it was made: window, sources, ages, notes."""

    observation: Observation
    window: WindowStats | None
    restart_detected: bool
    sources: Mapping[str, str] = field(default_factory=dict)  # field -> input it came from
    ages_s: Mapping[str, float] = field(default_factory=dict)  # field -> age of its value
    notes: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class _Value:
    value: float | None
    source: str | None = None
    age_s: float | None = None
    note: str | None = None


def _latency(hist_q: tuple[float | None, ...] | None) -> LatencyQuantiles | None:
    if hist_q is None:
        return None
    ms: list[float | None] = []
    floor = 0.0
    for v in hist_q:
        # Quantiles of one histogram are ordered; max() only absorbs float rounding.
        ms.append(None if v is None else max(v * 1000.0, floor))
        floor = ms[-1] if ms[-1] is not None else floor
    return LatencyQuantiles(p50_ms=ms[0], p90_ms=ms[1], p99_ms=ms[2])


def _as_count(value: float | None) -> int | None:
    return None if value is None else round(value)


@dataclass
class _Provenance:
    """Where one round's values came from: notes, sources and ages by field."""

    notes: list[str]
    sources: dict[str, str]
    ages: dict[str, float]

    def take(self, name: str, v: _Value) -> float | None:
        if v.note:
            self.notes.append(f"{name}: {v.note}")
        if v.value is not None and v.source is not None:
            self.sources[name] = v.source
            if v.age_s is not None:
                self.ages[name] = v.age_s
        return v.value


@dataclass(frozen=True)
class _Gauges:
    """One round's load and shape gauges (None: unknown)."""

    running: float | None
    queued: float | None
    usage: float | None
    capacity: float | None
    steps: float | None


def _observation(
    time_s: float,
    g: _Gauges,
    w: WindowStats | None,
    si: ServerInfoView | None,
    ages: Mapping[str, float],
) -> Observation:
    """The Observation of one round: its gauges, its window (None: unknown), the shape."""
    return Observation(
        time_s=float(time_s),
        running_requests=_as_count(g.running),
        queued_requests=_as_count(g.queued),
        token_usage=g.usage,
        kv_capacity_tokens=_as_count(g.capacity),
        gen_throughput_tok_s=None if w is None else w.gen_throughput_tok_s,
        accept_length=None if w is None else w.accept_length,
        ttft_ms=None if w is None else _latency(quantiles(w.ttft)),
        itl_ms=None if w is None else _latency(quantiles(w.itl)),
        tpot_ms=None if w is None else _latency(quantiles(w.tpot)),
        shape=None if si is None else si.shape,
        staleness_s=max(ages.values()) if ages else None,
        window_s=None if w is None else w.window_s,
        generation_tokens=None if w is None else _as_count(w.generation_tokens),
        verify_calls=None if w is None else _as_count(w.verify_calls),
        retractions=None if w is None else _as_count(w.retractions),
        finished_requests=None if w is None else _as_count(w.requests),
        e2e_ms=None if w is None else _latency(quantiles(w.e2e)),
        spec_num_steps=_as_count(g.steps),
        slot_candidates=None if si is None else si.slot_candidates,
    )


def decision_window_s(decide_interval_s: float, scrape_interval_s: float) -> float:
    """``min_window_s`` for a loop that scrapes every ``scrape_interval_s`` and decides
    every ``decide_interval_s`` on the newest scrape: each decision's rates and
    quantiles reach back to the newest scrape at least ``decide - 1.5 x scrape`` old
    (4 s of traffic at the defaults, 1 s scrapes and 5 s decisions), not only to the
    last scrape. The windows do not tile: the scrape interval just after each decision
    falls in none. Tiling them (``decide - 0.5 x scrape``) would leave the first decision
    without a window, and a scrape a little late would push a window one scrape further
    back; half a scrape interval of slack absorbs that jitter. The daemon and the
    closed-loop replay both use it, so a replay validates the windows the daemon decides
    on."""
    return max(0.0, decide_interval_s - 1.5 * scrape_interval_s)


class ObservationBuilder:
    """Turns scrapes into Observations; keeps the scrape history and gauge ages.

    ``min_window_s``: the window for rates and quantiles reaches back to the newest
    earlier scrape at least this old (0: the previous scrape). ``max_gauge_age_s``: a
    scheduler gauge not seen refreshed for longer is unknown. ``loads_max_age_s``: the
    same for ``/v1/loads`` rank snapshots (None: any age is used, and reported in
    ``staleness_s``; the scheduler republishes on every change of load, so an old snapshot
    usually means nothing happened). ``adaptive_config``: the decoded
    ``--speculative-adaptive-config`` file, when the server was launched with one.
    """

    def __init__(
        self,
        *,
        max_gauge_age_s: float = 60.0,
        loads_max_age_s: float | None = None,
        min_window_s: float = 0.0,
        max_history: int = 64,
        adaptive_config: Mapping[str, Any] | None = None,
    ) -> None:
        if not max_gauge_age_s > 0:
            raise ValueError(
                f"ObservationBuilder: max_gauge_age_s must be > 0, got {max_gauge_age_s!r}"
            )
        if loads_max_age_s is not None and not loads_max_age_s > 0:
            raise ValueError(
                f"ObservationBuilder: loads_max_age_s must be None or > 0, got {loads_max_age_s!r}"
            )
        if not min_window_s >= 0:
            raise ValueError(f"ObservationBuilder: min_window_s must be >= 0, got {min_window_s!r}")
        if not is_int(max_history) or max_history < 2:
            raise ValueError(
                f"ObservationBuilder: max_history must be an int >= 2, got {max_history!r}"
            )
        self.max_gauge_age_s = float(max_gauge_age_s)
        self.loads_max_age_s = loads_max_age_s
        self.min_window_s = float(min_window_s)
        # Parse once, so a bad file fails at construction, naming itself.
        self._adaptive_config = (
            None
            if adaptive_config is None
            else parse_adaptive_config(adaptive_config, source="adaptive_config")
        )
        self._history: deque[TimedSnapshot] = deque(maxlen=max_history)
        self._ager = GaugeAger()
        self._server_info: ServerInfoView | None = None
        self._last_time_s: float | None = None
        self._last_report: BuildReport | None = None

    @property
    def last_report(self) -> BuildReport | None:
        return self._last_report

    def reset(self) -> None:
        """Forget all history (e.g. when pointed at another server)."""
        self._history.clear()
        self._ager.reset()
        self._server_info = None
        self._last_time_s = None
        self._last_report = None

    # ------------------------------------------------------------------ feeding

    def feed(
        self,
        time_s: float,
        metrics: MetricsSnapshot | None,
        server_info: Mapping[str, Any] | None = None,
        loads: Mapping[str, Any] | None = None,
    ) -> Observation:
        """One scrape round at client time ``time_s`` (seconds, non-decreasing)."""
        self._check_time(time_s)
        # Parse first: a malformed body raises before any state changes.
        si_now = (
            None
            if server_info is None
            else parse_server_info(server_info, adaptive_config=self._adaptive_config)
        )
        loads_view = None if loads is None else parse_loads(loads)
        self._last_time_s = float(time_s)
        notes: list[str] = []
        window = self._absorb(time_s, metrics, notes)
        if si_now is not None:
            self._server_info = si_now
        si = self._server_info
        if si is not None:
            notes.extend(si.notes)
        prov = _Provenance(notes, {}, {})
        gauges = self._gauges(time_s, metrics, si, loads_view, prov)
        restarted = window is not None and window.restart_detected
        w = window if window is not None and not restarted else None
        if w is not None:
            for name in ("generation_tokens", "verify_calls", "retractions"):
                if getattr(w, name) is not None:
                    prov.sources[name] = "window"
            if w.verify_calls is None:
                notes.append(
                    "accept_length: no sglang:spec_verify_calls_total delta (not speculating, "
                    "or no speculative request finished before both scrapes)"
                )
        elif metrics is not None and not restarted:
            notes.append("window values unknown: first scrape (no earlier one to diff)")
        observation = _observation(time_s, gauges, w, si, prov.ages)
        self._last_report = BuildReport(
            observation=observation,
            window=window,
            restart_detected=restarted,
            sources=prov.sources,
            ages_s=prov.ages,
            notes=tuple(notes),
        )
        return observation

    def _check_time(self, time_s: float) -> None:
        if not is_real(time_s):
            raise ValueError(
                f"ObservationBuilder.feed: time_s must be a finite number, got {time_s!r}"
            )
        if self._last_time_s is not None and time_s < self._last_time_s:
            raise ValueError(
                "ObservationBuilder.feed: time went backwards "
                f"({self._last_time_s!r} -> {time_s!r})"
            )

    def _absorb(
        self, time_s: float, metrics: MetricsSnapshot | None, notes: list[str]
    ) -> WindowStats | None:
        """The scrape into the gauge ages and the history; the window since its base
        (a server restart clears the history and the server info, said in *notes*)."""
        window: WindowStats | None = None
        if metrics is not None:
            self._ager.observe(metrics, time_s)
            current = TimedSnapshot(float(time_s), metrics)
            base = self._window_base(time_s)
            if base is not None:
                window = compute_window(base, current)
                if window.restart_detected:
                    notes.append(
                        "server restart detected (counters went down: "
                        f"{', '.join(window.reset_metrics)}); window values unknown"
                    )
                    self._history.clear()
                    self._server_info = None  # the restart may have changed the shape
            self._history.append(current)
        return window

    def _gauges(
        self,
        time_s: float,
        metrics: MetricsSnapshot | None,
        si: ServerInfoView | None,
        loads_view: LoadsView | None,
        prov: _Provenance,
    ) -> _Gauges:
        """The load and shape gauges of this round, each with its provenance in *prov*."""
        expected_dp = metrics.dp_groups() if metrics is not None else None

        def load(key: str, metric: str, how: Aggregation) -> _Value:
            return self._load_field(loads_view, si, key, metrics, metric, how, time_s, expected_dp)

        take = prov.take
        return _Gauges(
            running=take(
                "running_requests", load("running_requests", NUM_RUNNING, Aggregation.SUM)
            ),
            queued=take("queued_requests", load("waiting_requests", NUM_QUEUE, Aggregation.SUM)),
            usage=take("token_usage", load("token_usage", TOKEN_USAGE, Aggregation.MEAN)),
            capacity=take(
                "kv_capacity_tokens", self._capacity(loads_view, si, metrics, expected_dp)
            ),
            steps=take(
                "spec_num_steps",
                self._aged_gauge(metrics, SPEC_NUM_STEPS, Aggregation.AGREE, time_s, expected_dp),
            ),
        )

    # ---------------------------------------------------------------- internals

    def _window_base(self, time_s: float) -> TimedSnapshot | None:
        for snap in reversed(self._history):
            if snap.time_s < time_s and time_s - snap.time_s >= self.min_window_s:
                return snap
        return None

    def _aged_gauge(
        self,
        metrics: MetricsSnapshot | None,
        name: str,
        how: Aggregation,
        now_s: float,
        expected: frozenset[str | None] | None,
    ) -> _Value:
        if metrics is None:
            return _Value(None, note="no /metrics scrape")
        per_dp = gauge_by_dp(metrics, name)
        if not per_dp:
            return _Value(None, note=f"{name} has no (finite) series")
        values: dict[str | None, float] = {}
        worst = 0.0
        for dp, rv in per_dp.items():
            age = self._ager.age_s(rv.keys[0], now_s)
            if age is None or age > self.max_gauge_age_s:
                return _Value(
                    None,
                    note=f"{name} (dp_rank={dp}) unchanged for {age} s > {self.max_gauge_age_s} s",
                )
            values[dp] = rv.value
            worst = max(worst, age)
        agg = aggregate_dp(values, how, expected=expected)
        if agg is None:
            why = "DP ranks disagree" if how is Aggregation.AGREE else "missing for some DP rank"
            return _Value(None, note=f"{name}: {why} ({values})")
        if agg < 0:
            return _Value(None, note=f"{name} is negative ({agg})")
        return _Value(agg, "metrics", worst)

    def _loads_ranks(self, view: LoadsView, si: ServerInfoView | None) -> list[RankLoad] | None:
        if not view.ranks:
            return None
        if si is not None and si.dp_size is not None and len(view.ranks) != si.dp_size:
            return None
        return list(view.ranks)

    def _load_field(
        self,
        view: LoadsView | None,
        si: ServerInfoView | None,
        attr: str,
        metrics: MetricsSnapshot | None,
        gauge: str,
        how: Aggregation,
        now_s: float,
        expected: frozenset[str | None] | None,
    ) -> _Value:
        if view is not None:
            ranks = self._loads_ranks(view, si)
            if ranks is not None:
                values: list[float] = []
                worst = 0.0
                for rank in ranks:
                    value = getattr(rank, attr)
                    age = view.age_s(rank)
                    if value is None:
                        break
                    if self.loads_max_age_s is not None and (
                        age is None or age > self.loads_max_age_s
                    ):
                        break
                    values.append(float(value))
                    worst = max(worst, age or 0.0)
                else:
                    total = math.fsum(values)
                    agg = total if how is Aggregation.SUM else total / len(values)
                    return _Value(agg, "loads", worst)
        return self._aged_gauge(metrics, gauge, how, now_s, expected)

    def _capacity(
        self,
        view: LoadsView | None,
        si: ServerInfoView | None,
        metrics: MetricsSnapshot | None,
        expected: frozenset[str | None] | None,
    ) -> _Value:
        if view is not None:
            ranks = self._loads_ranks(view, si)
            if ranks is not None and all(r.capacity_tokens is not None for r in ranks):
                return _Value(float(sum(r.capacity_tokens or 0 for r in ranks)), "loads")
        if si is not None and si.kv_capacity_tokens is not None:
            return _Value(float(si.kv_capacity_tokens), "server_info")
        if metrics is not None:
            # A start-up constant (emit_constants): never refreshed, so never aged.
            per_dp = {dp: rv.value for dp, rv in gauge_by_dp(metrics, MAX_TOTAL_NUM_TOKENS).items()}
            total = aggregate_dp(per_dp, Aggregation.SUM, expected=expected)
            if total is not None and total > 0:
                return _Value(total, "metrics")
        return _Value(None, note="no /v1/loads, /server_info or max_total_num_tokens value")
