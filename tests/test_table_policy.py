"""TablePolicy: follows the daemon's table, falls back to SGLang's EMA, never raises."""

from __future__ import annotations

import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specgov.policies.common.step_table import StepTable
from specgov.policies.common.types import PolicyTypeError, TierStatsSnapshot
from specgov.policies.engine.ema import EmaPolicy
from specgov.policies.engine.table import TablePolicy

GRAPHS = [1, 2, 4, 8, 16, 32, 64]


class Clock:
    def __init__(self, now_s: float = 100.0) -> None:
        self.now_s = now_s

    def __call__(self) -> float:
        return self.now_s


class Source:
    """A scripted table source that counts its calls."""

    def __init__(self, value: Any = None) -> None:
        self.value = value
        self.calls = 0

    def __call__(self) -> StepTable | None:
        self.calls += 1
        if isinstance(self.value, BaseException):
            raise self.value
        return self.value  # type: ignore[no-any-return]


def table(
    *slots: tuple[int, int], version: int = 1, at: float = 100.0, ttl: float = 60.0
) -> StepTable:
    return StepTable(tuple(slots), version=version, produced_at_s=at, ttl_s=ttl)


def make(
    source: Source,
    clock: Clock | None = None,
    sink: list[TierStatsSnapshot] | None = None,
    *,
    poll: int = 1,
    flush_s: float = 1.0,
    graphs: list[int] | None = None,
) -> TablePolicy:
    snapshots: list[TierStatsSnapshot] = [] if sink is None else sink
    policy = TablePolicy(
        table_source=source,
        stats_sink=snapshots.append,
        clock=clock or Clock(),
        fallback=EmaPolicy(3),
        flush_interval_s=flush_s,
        poll_every_batches=poll,
    )
    policy.set_cuda_graph_bs(graphs)
    return policy


# ------------------------------------------------------------------ following


def test_follows_a_valid_table() -> None:
    policy = make(Source(table((1, 5), (8, 1), (32, 0))))
    assert [policy.get_steps_for_batch(b) for b in (1, 7, 8, 31, 32, 300)] == [5, 5, 1, 1, 0, 0]
    assert policy.table is not None and policy.fallback_reason is None
    assert policy.fallback_reasons == {}
    assert policy.candidate_steps == [0, 1, 3, 5, 7]


def test_pads_to_cuda_graph_batch_sizes_like_sglang() -> None:
    src = Source(table((1, 3), (8, 1), (64, 0)))
    assert make(src).get_steps_for_batch(5) == 3
    # 5 pads to the captured 8, which the table maps to 1.
    with_graphs = make(src, graphs=GRAPHS)
    assert with_graphs.get_steps_for_batch(5) == 1
    assert with_graphs.fallback_reasons == {}


def test_candidate_steps_are_the_fallbacks() -> None:
    fallback = EmaPolicy(2, {"1": {"candidate_steps": [2, 4]}})
    policy = TablePolicy(
        table_source=lambda: None, stats_sink=lambda _s: None, clock=lambda: 0.0, fallback=fallback
    )
    assert policy.candidate_steps == [2, 4]
    assert policy.fallback is fallback


# ---------------------------------------------------------------- falling back


def run_twin(policy: TablePolicy, rng: random.Random, batches: int) -> None:
    """Drive ``policy`` and a bare EmaPolicy with the same calls: identical answers."""
    twin = EmaPolicy(3)
    twin.set_cuda_graph_bs(policy.fallback.cuda_graph_bs)
    for _ in range(batches):
        bs = rng.randint(1, 80)
        steps = policy.get_steps_for_batch(bs)
        assert steps == twin.get_steps_for_batch(bs)
        accepted = [rng.randint(0, steps) for _ in range(bs)]
        assert policy.on_verify_complete(accepted, bs) == twin.on_verify_complete(accepted, bs)


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        (None, "no_table"),
        (table((1, 5), at=0.0, ttl=10.0), "expired"),
        (table((1, 2)), "invalid_step"),  # 2 is not a prebuilt candidate
        ("not a table", "invalid_type"),
        (OSError("spool gone"), "source_error"),
    ],
)
def test_falls_back_to_ema_exactly(value: Any, reason: str) -> None:
    policy = make(Source(value), graphs=GRAPHS)
    run_twin(policy, random.Random(3), 300)
    assert policy.fallback_reasons == {reason: 300}
    assert policy.fallback_reason == reason
    assert policy.errors == (300 if reason == "source_error" else 0)


def test_rejects_a_table_whose_step_has_no_cuda_graph_at_that_size() -> None:
    # SGLang's default slots build step 5 only for batch sizes 1..7; a table asking
    # for 5 at 8+ would run eagerly. Without CUDA graphs it is fine.
    uncaptured = table((1, 5), (8, 5), (32, 0))
    with_graphs = make(Source(uncaptured), graphs=GRAPHS)
    assert with_graphs.get_steps_for_batch(10) == 3  # fallback (slot 8 starts at 3)
    assert with_graphs.fallback_reasons == {"uncaptured_step": 1}
    assert make(Source(uncaptured)).get_steps_for_batch(10) == 5


def test_cuda_graph_change_revalidates_the_table() -> None:
    policy = make(Source(table((1, 5), (8, 5), (32, 0))), poll=1000)
    assert policy.get_steps_for_batch(10) == 5
    policy.set_cuda_graph_bs(GRAPHS)
    assert policy.table is None and policy.fallback_reason == "uncaptured_step"
    assert policy.get_steps_for_batch(10) == 3


def test_expiry_is_judged_at_poll_boundaries() -> None:
    clock = Clock(100.0)
    src = Source(table((1, 7), at=100.0, ttl=1.0))
    policy = make(src, clock, poll=4)
    answers = []
    for _ in range(8):
        answers.append(policy.get_steps_for_batch(1))
        clock.now_s += 0.5  # expires at 101.0, during the 3rd batch
    # Polls at calls 1 and 5: the table holds until the poll at call 5 finds it expired.
    assert answers == [7, 7, 7, 7, 3, 3, 3, 3]
    assert policy.fallback_reasons == {"expired": 4}


def test_poll_cadence() -> None:
    src = Source(table((1, 3)))
    policy = make(src, poll=4)
    for i in range(9):
        policy.get_steps_for_batch(1)
        policy.on_verify_complete([1], 1)  # verifies never poll
        assert src.calls == 1 + i // 4
    assert src.calls == 3  # calls 1, 5 and 9


def test_switches_tables_and_back() -> None:
    src = Source(table((1, 5)))
    policy = make(src, poll=2)
    assert policy.get_steps_for_batch(1) == 5
    src.value = table((1, 1), version=2)
    assert policy.get_steps_for_batch(1) == 5  # not polled yet
    assert policy.get_steps_for_batch(1) == 1
    src.value = None
    policy.get_steps_for_batch(1)
    assert policy.get_steps_for_batch(1) == 3  # the fallback's slot 1 state
    assert policy.fallback_reasons == {"no_table": 1}


# ----------------------------------------------------------- on_verify_complete


def test_fallback_is_fed_while_a_table_rules() -> None:
    policy = make(Source(table((1, 7))))
    twin = EmaPolicy(3)
    for _ in range(40):
        assert policy.get_steps_for_batch(2) == 7
        # The fallback's own step changes are not returned while the table rules.
        assert policy.on_verify_complete([0, 0], 2) is None
        twin.on_verify_complete([0, 0], 2)
    assert policy.fallback.slot_state(1) == twin.slot_state(1)
    assert twin.slot_state(1)[0] == 1  # the EMA did walk down meanwhile


def test_new_table_between_lookup_and_verify_switches_now() -> None:
    # SGLang's overlap scheduler: batch B's lookup comes before batch A's verify.
    src = Source(None)
    policy = make(src)
    assert policy.get_steps_for_batch(4) == 3  # A, fallback
    src.value = table((1, 7))
    assert policy.get_steps_for_batch(4) == 7  # B, new table
    assert policy.on_verify_complete([1, 1, 1, 1], 4) == 7  # A ran 3; the table says 7
    assert policy.on_verify_complete([7, 7, 7, 7], 4) is None  # B already ran 7


def test_fallback_change_is_returned_when_fallback_rules() -> None:
    policy = make(Source(None))
    returned = []
    for _ in range(20):
        policy.get_steps_for_batch(1)
        returned.append(policy.on_verify_complete([7], 1))
    # SGLang's slot 1: warm-up 10, interval 5. At batch 15 the EMA, 7 - 5 * 0.8**15 =
    # 6.8, is above every rise threshold: 3 -> 7, returned so SGLang switches at once.
    assert returned == [None] * 14 + [7] + [None] * 5
    assert policy.fallback.slot_state(1)[0] == 7


# ------------------------------------------------------------------- statistics


def test_tier_statistics_with_a_fake_clock() -> None:
    clock = Clock(10.0)
    sink: list[TierStatsSnapshot] = []
    policy = make(Source(table((1, 3), (8, 1))), clock, sink, flush_s=1.0)
    policy.get_steps_for_batch(3)  # t=10.0
    clock.now_s = 10.25
    policy.on_verify_complete([0, 3, 2], 3)
    policy.get_steps_for_batch(2)  # t=10.25
    clock.now_s = 10.75
    policy.on_verify_complete([3, 9], 2)  # 9 > steps: clamped into the top bucket
    policy.get_steps_for_batch(9)  # t=10.75, a tier change (3 -> 1): timed apart
    clock.now_s = 10.875
    policy.on_verify_complete([1] * 9, 9)
    policy.get_steps_for_batch(9)  # t=10.875, the same tier: timed
    clock.now_s = 11.0
    policy.on_verify_complete([1] * 9, 9)  # window [10.0, 11.0] complete -> flush
    assert len(sink) == 1
    snap = sink[0]
    assert (snap.window_start_s, snap.window_end_s) == (10.0, 11.0)
    low = snap.tier(1, 3)
    high = snap.tier(8, 1)
    assert low is not None and high is not None
    assert (low.verify_calls, low.requests, low.batch_size_sum) == (2, 5, 5)
    assert low.accepted_hist == (1, 0, 1, 3)
    assert low.step_time_sum_s == pytest.approx(0.25 + 0.5)
    assert low.step_time_count == 2
    # The first batch at the new tier counts its verifies, not its time (a switch's
    # one-off cost is not the tier's per-batch cost; the tier has a timed batch here).
    assert (high.verify_calls, high.requests, high.accepted_hist) == (2, 18, (0, 18))
    assert high.step_time_sum_s == pytest.approx(0.125)
    assert high.step_time_count == 1
    assert [t.key for t in snap.tiers] == [(1, 3), (8, 1)]


def test_a_tier_timed_only_across_switches_reports_those_times() -> None:
    # Batches alternate between slot 1 (3 steps) and slot 8 (1 step): every batch is the
    # first after a tier change, so the switch is paid every time and is each tier's
    # cost; a window with no other timed batch of a tier reports those times.
    clock = Clock(0.0)
    sink: list[TierStatsSnapshot] = []
    policy = make(Source(table((1, 3), (8, 1))), clock, sink, flush_s=100.0)
    t = 0.0
    for batch, step_s in ((3, 0.5), (9, 0.25), (3, 0.5), (9, 0.25)):
        policy.get_steps_for_batch(batch)
        t += step_s
        clock.now_s = t
        policy.on_verify_complete([0] * batch, batch)
    policy.flush()
    low, high = sink[0].tier(1, 3), sink[0].tier(8, 1)
    assert low is not None and high is not None
    # slot 1's first batch is the first ever (timed); its second came after a switch.
    assert (low.step_time_count, low.step_time_sum_s) == (1, pytest.approx(0.5))
    assert (high.step_time_count, high.step_time_sum_s) == (2, pytest.approx(0.5))
    assert (low.verify_calls, high.verify_calls) == (2, 2)


def test_fallback_tiers_use_the_fallbacks_slot() -> None:
    clock = Clock(0.0)
    sink: list[TierStatsSnapshot] = []
    policy = make(Source(None), clock, sink, graphs=GRAPHS)
    policy.get_steps_for_batch(20)  # pads to 32 -> fallback slot 32, steps 1
    clock.now_s = 2.0
    policy.on_verify_complete([1] * 20, 20)
    (tier,) = sink[0].tiers
    assert (tier.slot, tier.steps, tier.accepted_hist) == (32, 1, (0, 20))


def test_flush_timing_and_windows() -> None:
    clock = Clock(0.0)
    sink: list[TierStatsSnapshot] = []
    policy = make(Source(table((1, 1))), clock, sink, flush_s=1.0)
    flushed_at = []
    for t in (0.2, 0.5, 0.99, 1.0, 1.5, 1.99, 2.0, 2.5):
        policy.get_steps_for_batch(1)
        clock.now_s = t
        policy.on_verify_complete([1], 1)
        if len(sink) > len(flushed_at):
            flushed_at.append(t)
    assert flushed_at == [1.0, 2.0]
    assert [(s.window_start_s, s.window_end_s) for s in sink] == [(0.0, 1.0), (1.0, 2.0)]
    assert [sum(t.verify_calls for t in s.tiers) for s in sink] == [4, 3]
    policy.flush()  # e.g. at shutdown: the partial window
    assert (sink[-1].window_start_s, sink[-1].window_end_s) == (2.0, 2.5)
    assert sum(t.verify_calls for t in sink[-1].tiers) == 1


def test_lookups_match_verifies_first_in_first_out() -> None:
    clock = Clock(0.0)
    sink: list[TierStatsSnapshot] = []
    policy = make(Source(table((1, 3))), clock, sink, flush_s=100.0)
    policy.get_steps_for_batch(4)  # t=0  (batch A)
    clock.now_s = 1.0
    policy.get_steps_for_batch(6)  # t=1  (batch B, launched before A's verify)
    clock.now_s = 3.0
    policy.on_verify_complete([0] * 4, 4)  # A: 3 s
    clock.now_s = 7.0
    policy.on_verify_complete([0] * 6, 6)  # B: 6 s
    policy.on_verify_complete([0] * 5, 5)  # no lookup: counted, untimed
    policy.flush()
    (tier,) = sink[0].tiers
    assert tier.step_time_sum_s == pytest.approx(9.0)
    assert (tier.step_time_count, tier.verify_calls, tier.requests) == (2, 3, 15)


def test_a_lookup_without_verify_is_skipped_not_misattributed() -> None:
    clock = Clock(0.0)
    sink: list[TierStatsSnapshot] = []
    policy = make(Source(table((1, 3), (8, 1))), clock, sink, flush_s=100.0)
    # t=0, a batch of the same tier whose verify never comes (a tier change would leave
    # the next batch untimed anyway)
    policy.get_steps_for_batch(2)
    clock.now_s = 5.0
    policy.get_steps_for_batch(4)  # t=5
    clock.now_s = 6.0
    policy.on_verify_complete([2] * 4, 4)
    policy.flush()
    (tier,) = sink[0].tiers
    assert (tier.key, tier.step_time_sum_s, tier.accepted_hist) == ((1, 3), 1.0, (0, 0, 4, 0))


def test_sink_errors_are_counted_and_the_window_restarts() -> None:
    clock = Clock(0.0)

    def sink(_snapshot: TierStatsSnapshot) -> None:
        raise RuntimeError("disk full")

    policy = TablePolicy(
        table_source=lambda: None,
        stats_sink=sink,
        clock=clock,
        fallback=EmaPolicy(3),
        flush_interval_s=1.0,
    )
    for i in range(30):
        policy.get_steps_for_batch(1)
        clock.now_s = i * 0.25
        assert policy.on_verify_complete([1], 1) in (None, 1, 3, 5, 7)
    assert policy.errors == policy.flushes > 0
    assert policy.last_error == "RuntimeError: disk full"


# ----------------------------------------------------------------- robustness


def test_constructor_validation_names_the_argument() -> None:
    kwargs: dict[str, Any] = dict(
        table_source=lambda: None, stats_sink=lambda _s: None, clock=lambda: 0.0
    )
    with pytest.raises(PolicyTypeError, match="flush_interval_s"):
        TablePolicy(**kwargs, fallback=EmaPolicy(3), flush_interval_s=0)
    with pytest.raises(PolicyTypeError, match="poll_every_batches"):
        TablePolicy(**kwargs, fallback=EmaPolicy(3), poll_every_batches=0)
    with pytest.raises(PolicyTypeError, match="fallback"):
        TablePolicy(**kwargs, fallback=object())  # type: ignore[arg-type]


def test_a_raising_clock_falls_back() -> None:
    def clock() -> float:
        raise RuntimeError("no clock")

    policy = TablePolicy(
        table_source=lambda: table((1, 7)),
        stats_sink=lambda _s: None,
        clock=clock,
        fallback=EmaPolicy(3),
    )
    assert policy.get_steps_for_batch(1) == 3
    assert policy.on_verify_complete([1], 1) is None
    assert policy.errors == 2


SOURCES = st.sampled_from(
    [
        "none",
        "good",
        "good2",
        "expired",
        "not_candidate",
        "uncaptured",
        "garbage",
        "raise",
        "raise_base",
    ]
)

OPS = st.one_of(
    st.tuples(st.just("get"), st.integers(-3, 600)),
    st.tuples(
        st.just("verify"),
        st.integers(-3, 600),
        st.lists(st.integers(-5, 20), max_size=12),
    ),
    st.tuples(st.just("tick"), st.floats(-1.0, 30.0, allow_nan=False)),
    st.tuples(st.just("source"), SOURCES),
    st.tuples(st.just("sink_raises"), st.booleans()),
    st.tuples(st.just("graphs"), st.none() | st.lists(st.integers(1, 300), max_size=10)),
    st.tuples(st.just("graph_steps"), st.integers(-1, 9)),
)


@settings(max_examples=150, deadline=None)
@given(ops=st.lists(OPS, max_size=80), poll=st.integers(1, 5))
def test_never_raises_and_always_answers_a_candidate(ops: list[Any], poll: int) -> None:
    clock = Clock(100.0)
    state: dict[str, Any] = {"source": "none", "sink_raises": False}
    tables = {
        "good": table((1, 5), (8, 1), (32, 0), at=100.0, ttl=50.0),
        "good2": table((1, 1), version=2, at=100.0, ttl=1e9),
        "expired": table((1, 3), at=0.0, ttl=1.0),
        "not_candidate": table((1, 4)),
        "uncaptured": table((1, 7), (2, 7), at=100.0, ttl=1e9),
    }

    def source() -> StepTable | None:
        name = state["source"]
        if name == "raise":
            raise ValueError("bad spool")
        if name == "raise_base":
            raise KeyError("x")
        if name == "garbage":
            return {"slots": []}  # type: ignore[return-value]
        return tables.get(name)

    def sink(_snapshot: TierStatsSnapshot) -> None:
        if state["sink_raises"]:
            raise OSError("sink")

    policy = TablePolicy(
        table_source=source,
        stats_sink=sink,
        clock=clock,
        fallback=EmaPolicy(3),
        flush_interval_s=1.0,
        poll_every_batches=poll,
    )
    candidates = set(policy.candidate_steps)
    for op in ops:
        kind = op[0]
        if kind == "get":
            assert policy.get_steps_for_batch(op[1]) in candidates
        elif kind == "verify":
            result = policy.on_verify_complete(op[2], op[1])
            assert result is None or result in candidates
        elif kind == "tick":
            clock.now_s += op[1]
        elif kind == "graphs":
            policy.set_cuda_graph_bs(op[1])
        elif kind == "graph_steps":
            graph_bs = policy.cuda_graph_bs_for_step(op[1])
            assert graph_bs is None or isinstance(graph_bs, list)
        else:
            state[kind] = op[1]
    policy.flush()
    assert policy.errors >= 0


def test_fallback_under_specgov_launch_config_holds_its_tier_near_a_midpoint() -> None:
    # specgov's slots step by 1; with SGLang's default hysteresis the one-request EMA at
    # light load crossed the 0.25 overlap of adjacent steps every few batches (issue 20:
    # 11 switches in the 10 s before the daemon's first table).
    from specgov.simulator.replay.runner import specgov_adaptive_config

    config = specgov_adaptive_config()
    policy = TablePolicy(
        table_source=Source(None),
        stats_sink=lambda _s: None,
        clock=Clock(),
        fallback=EmaPolicy(3, config),
    )
    bare = EmaPolicy(3, config)  # SGLang's controller on the same launch config
    changes = 0
    last = policy.get_steps_for_batch(1)
    for i in range(600):
        accepted = [1 + i % 2]  # mean 1.5: the EMA hovers at the 2/3 midpoint
        assert policy.get_steps_for_batch(1) == bare.get_steps_for_batch(1)
        policy.on_verify_complete(accepted, 1)
        bare.on_verify_complete(accepted, 1)
        steps = policy.get_steps_for_batch(1)
        changes += steps != last
        last = steps
    assert changes <= 1
    for _ in range(200):  # a sustained fall in acceptance still moves it down
        policy.get_steps_for_batch(1)
        policy.on_verify_complete([0], 1)
    assert policy.get_steps_for_batch(1) < 2
