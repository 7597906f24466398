"""Prefix caching (SGLang's radix cache) in the simulator: the block trie, the engine's
use of it, replay's hit rate and switch, and the sim-server's cache_hit_rate gauge."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from click.testing import CliRunner

from specgov.adapters.prometheus_text import gauge_by_dp, parse_metrics
from specgov.simulator.engine.core import Engine
from specgov.simulator.engine.interface import EngineConfig, EngineResult
from specgov.simulator.engine.prefix_cache import PrefixCache, block_tokens
from specgov.simulator.engine.sglang_metrics import SimMetrics
from specgov.simulator.replay.runner import ServerSpec, replay
from specgov.simulator.server import cli as sim_cli
from specgov.simulator.server.core import SimServer
from specgov.simulator.workload.synthetic import generate_trace
from specgov.simulator.workload.synthetic_text import parse_synthetic_spec
from specgov.simulator.workload.trace_files import TraceFormatError, load_trace
from specgov.simulator.workload.traces import PREFIX_BLOCK_TOKENS, Request, Trace

B = PREFIX_BLOCK_TOKENS
MULTI_TURN = (
    "synthetic:duration=120,rate=3,turns=5,think=8,turn_in=200,phases=chat@120,"
    "chat.in=1500,chat.out=200,seed=4"
)
# Wall-clock keys of a replay summary (they differ between any two runs).
WALL_KEYS = {"wall_s", "sim_output_tokens_per_wall_s", "mean_decide_ms"}


class LinearCost:
    """Prefill cost proportional to the tokens computed (the cached prefix is free)."""

    def decode_step_s(self, batch_size: int, steps: int, kv_tokens: int) -> float:
        return 0.005 + 0.0001 * batch_size

    def prefill_s(self, new_tokens: int, prefix_kv_tokens: int) -> float:
        return 0.002 + 1e-5 * new_tokens


def _run(
    requests: list[Request] | tuple[Request, ...], *, capacity: int, cache: bool = True
) -> tuple[Engine, EngineResult]:
    engine = Engine(
        config=EngineConfig(kv_token_capacity=capacity, prefix_cache=cache, record_events=True),
        cost=LinearCost(),
        policy=None,
        acceptance=None,
    )
    return engine, engine.run(list(requests))


def _strip_ids(trace: Trace) -> Trace:
    return dataclasses.replace(
        trace, requests=tuple(dataclasses.replace(r, hash_ids=None) for r in trace.requests)
    )


# ------------------------------------------------------------------- the block trie


def test_block_tokens_splits_a_prompt_into_512_token_blocks() -> None:
    assert [block_tokens(1100, j) for j in range(4)] == [512, 512, 76, 0]


def test_match_insert_reuse_and_partial_blocks() -> None:
    cache = PrefixCache()
    path, new, dup = cache.insert((1, 2, 3), 1100, [], 0.0)
    assert [n.hash_id for n in path] == [1, 2, 3] and (new, dup) == (1100, 0)
    assert cache.total_tokens == cache.pinned_tokens == 1100
    # A longer prompt with the same first two blocks reuses 1024 tokens; block 3 was a
    # partial block of the first prompt (76 tokens), so it cannot match a full block.
    assert cache.path_tokens(cache.match((1, 2, 3, 4), 2000, 1.0)) == 1024
    # The same prompt again matches in full, partial block included.
    assert cache.path_tokens(cache.match((1, 2, 3), 1100, 1.0)) == 1100
    # A different first block: nothing.
    assert cache.match((9, 2, 3), 1100, 1.0) == []
    # Inserting what is already cached adds nothing and reports the duplicate.
    again, new, dup = cache.insert((1, 2), 1024, [], 2.0)
    assert len(again) == 2 and (new, dup) == (0, 1024)
    assert cache.total_tokens == 1100


def test_lru_eviction_frees_the_least_recently_used_leaves_first() -> None:
    cache = PrefixCache()
    a, _, _ = cache.insert((1, 2), 2 * B, [], 0.0)
    b, _, _ = cache.insert((5, 6), 2 * B, [], 1.0)
    c, _, _ = cache.insert((1, 7), 2 * B, a[:1], 2.0)  # shares block 1 with a
    cache.pin(a[:1])  # c's insert pinned only block 7; the matched block 1 is pinned too
    for path, t in ((a, 3.0), (b, 4.0), (c + a[:1], 5.0)):
        cache.unpin(path, t)
    assert cache.pinned_tokens == 0 and cache.total_tokens == 5 * B
    # Touch b: now a's leaf (block 2, last used at 3.0) is the oldest.
    cache.match((5, 6), 2 * B, 6.0)
    assert cache.evict(1) == B
    assert cache.path_tokens(cache.match((1, 2), 2 * B, 7.0)) == B  # block 2 is gone
    assert cache.path_tokens(cache.match((5, 6), 2 * B, 7.0)) == 2 * B
    # Everything else goes, children before their parent.
    assert cache.evict(10 * B) == 4 * B and cache.total_tokens == 0 and cache.blocks == 0


def test_pinned_blocks_are_never_evicted() -> None:
    cache = PrefixCache()
    held, _, _ = cache.insert((1, 2, 3), 3 * B, [], 0.0)
    loose, _, _ = cache.insert((8, 9), 2 * B, [], 1.0)
    cache.unpin(loose, 2.0)
    assert cache.evict(100 * B) == 2 * B  # only the unpinned blocks
    assert cache.total_tokens == cache.pinned_tokens == 3 * B
    assert cache.path_tokens(cache.match((1, 2, 3), 3 * B, 3.0)) == 3 * B
    cache.unpin(held, 4.0)
    assert cache.evict(100 * B) == 3 * B


# ------------------------------------------------------------------------ the engine


def _conversation(turns: int, *, start_s: float = 0.0, gap_s: float = 5.0) -> list[Request]:
    """One conversation whose prompts grow by whole blocks (ids shared turn to turn)."""
    reqs = []
    for j in range(turns):
        blocks = 2 * (j + 1)
        reqs.append(
            Request(
                start_s + j * gap_s,
                blocks * B,
                16,
                hash_ids=tuple(range(1000 * int(start_s), 1000 * int(start_s) + blocks)),
            )
        )
    return reqs


def test_later_turns_prefill_only_the_uncached_suffix() -> None:
    reqs = _conversation(3)
    _, on = _run(reqs, capacity=100_000)
    _, off = _run(reqs, capacity=100_000, cache=False)
    # Turn 2 reuses turn 1's 2 blocks, turn 3 turn 2's 4: 6 of 12 blocks.
    assert on.cache_hit_tokens == 6 * B and on.cache_lookup_tokens == 12 * B
    assert on.prefix_cache_hit_rate == pytest.approx(0.5)
    assert on.prefill_tokens == off.prefill_tokens - 6 * B
    assert max(on.ttft_s[1:]) < min(off.ttft_s[1:])
    assert off.prefix_cache_hit_rate == 0.0 and off.cache_lookup_tokens == 0


def test_the_last_prompt_token_is_always_computed() -> None:
    same = [Request(0.0, 2 * B, 4, hash_ids=(1, 2)), Request(1.0, 2 * B, 4, hash_ids=(1, 2))]
    _, result = _run(same, capacity=100_000)
    assert result.cache_hit_tokens == 2 * B - 1
    assert result.prefill_tokens == 2 * B + 1


def test_requests_without_ids_reuse_nothing_and_run_as_without_a_cache() -> None:
    reqs = [dataclasses.replace(r, hash_ids=None) for r in _conversation(4)]
    _, on = _run(reqs, capacity=100_000)
    _, off = _run(reqs, capacity=100_000, cache=False)
    assert on.cache_hit_tokens == 0 and on.events == off.events
    assert on.ttft_s == off.ttft_s and on.end_s == off.end_s


def test_cached_blocks_are_evicted_lru_under_kv_pressure_and_running_ones_stay() -> None:
    # Ten conversations, one after another, each 3 turns of up to 6 blocks; the pool
    # holds about two conversations, so the oldest cached prompts must make room.
    reqs: list[Request] = []
    for c in range(10):
        reqs += _conversation(3, start_s=float(20 * c), gap_s=2.0)
    engine, result = _run(reqs, capacity=14 * B)
    cache = engine.prefix_cache
    assert cache is not None
    assert result.completed == len(reqs) and result.retractions == 0
    assert result.cache_evicted_tokens > 0
    assert cache.total_tokens <= 14 * B and cache.pinned_tokens == 0  # all finished
    # Every conversation still hits on its own earlier turns: eviction took the old ones.
    assert result.cache_hit_tokens == 10 * 6 * B
    # The newest conversation's prompts are still cached, the first one's are gone.
    assert cache.path_tokens(cache.match(reqs[-1].hash_ids or (), reqs[-1].input_tokens, 1e9))
    assert cache.match(reqs[0].hash_ids or (), reqs[0].input_tokens, 1e9) == []


def test_the_pool_is_never_overcommitted_with_the_cache() -> None:
    # Concurrent conversations on a small pool: retractions and evictions both happen,
    # and the requests' own KV plus every cached block never exceed the pool.
    trace = generate_trace(parse_synthetic_spec(MULTI_TURN))
    engine = Engine(
        config=EngineConfig(kv_token_capacity=12_000),
        cost=LinearCost(),
        policy=None,
        acceptance=None,
    )
    cache = engine.prefix_cache
    assert cache is not None
    worst = [0]

    def check(_now_s: float) -> None:
        # A tick at every forward boundary (tick_interval_s below one step).
        assert cache.pinned_tokens <= cache.total_tokens
        worst[0] = max(worst[0], cache.total_tokens)

    result = engine.run(list(trace.requests), on_tick=check, tick_interval_s=1e-4)
    assert result.completed + result.aborted == len(trace.requests)
    assert result.cache_evicted_tokens > 0 and worst[0] <= 12_000
    assert result.kv_peak_tokens <= 12_000 + 64  # a step's verified tokens may overshoot


def test_same_seed_same_event_log() -> None:
    trace = generate_trace(parse_synthetic_spec(MULTI_TURN))
    _, first = _run(trace.requests, capacity=20_000)
    _, second = _run(generate_trace(parse_synthetic_spec(MULTI_TURN)).requests, capacity=20_000)
    assert first.events and first.events == second.events
    assert first.cache_hit_tokens == second.cache_hit_tokens > 0


# ------------------------------------------------------------------------- replay


def _policies(report: Any) -> list[dict[str, Any]]:
    return [{k: v for k, v in p.items() if k not in WALL_KEYS} for p in report["policies"]]


def test_replay_reports_the_hit_rate_and_no_prefix_cache_equals_a_trace_without_ids() -> None:
    trace = generate_trace(parse_synthetic_spec(MULTI_TURN))
    policies = ["none", "static:3"]
    on = replay(trace, ServerSpec(), policies, seed=2).to_json()
    off = replay(trace, ServerSpec(prefix_cache=False), policies, seed=2).to_json()
    bare = replay(_strip_ids(trace), ServerSpec(), policies, seed=2).to_json()
    for p_on, p_off in zip(on["policies"], off["policies"], strict=True):
        assert p_on["prefix_cache_hit_rate"] > 0.3
        assert p_on["prefill_tokens"] < 0.7 * p_off["prefill_tokens"]
        assert p_on["ttft_ms"]["p50"] < p_off["ttft_ms"]["p50"]
        assert p_off["prefix_cache_hit_rate"] == 0.0
    assert on["server"]["prefix_cache"] is True and off["server"]["prefix_cache"] is False
    # --no-prefix-cache: the same results as the trace without ids, number for number.
    assert json.dumps(_policies(off), sort_keys=True) == json.dumps(_policies(bare), sort_keys=True)


# ------------------------------------------------------------------- trace errors


@pytest.mark.parametrize(
    ("record", "problem"),
    [
        ({"hash_ids": 3}, "hash_ids is not a list"),
        ({"hash_ids": [1, -2]}, "hash_ids[1] = -2 is not an integer in [0, 2^63)"),
        ({"hash_ids": [1, True]}, "hash_ids[1] = True"),
        ({"hash_ids": [1.5]}, "hash_ids[0] = 1.5"),
        ({"hash_ids": [1 << 63]}, "hash_ids[0]"),
        ({"hash_ids": [1, 2, 3]}, "hash_ids has 3 ids but 600 input tokens make at most 2"),
        ({"hash_ids": [1], "prefix_hash_ids": [1]}, "both hash_ids and prefix_hash_ids"),
        ({"prefix_hash_ids": ["a"]}, "prefix_hash_ids[0] = 'a'"),
    ],
)
def test_bad_hash_ids_name_file_and_line(
    tmp_path: Path, record: dict[str, Any], problem: str
) -> None:
    path = tmp_path / "t.jsonl"
    good = {"arrival_s": 0.0, "input_tokens": 600, "output_tokens": 2}
    path.write_text(json.dumps(good) + "\n" + json.dumps({**good, **record}) + "\n")
    with pytest.raises(TraceFormatError) as err:
        load_trace(path)
    assert str(err.value).startswith(f"{path}:2: ") and problem in str(err.value)


def test_mooncake_hash_ids_are_read_and_checked(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    rows = [
        {"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [0, 1, 2]},
        {"timestamp": 500, "input_length": 1100, "output_length": 5, "hash_ids": [0, 1, 3]},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    trace = load_trace(path)
    assert [r.hash_ids for r in trace.requests] == [(0, 1, 2), (0, 1, 3)]
    rows.append({"timestamp": 900, "input_length": 100, "output_length": 5, "hash_ids": [0, 1]})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(TraceFormatError, match=r"m\.jsonl:3: hash_ids has 2 ids but 100 input"):
        load_trace(path)


# -------------------------------------------------------------------- sim-server


def test_sim_metrics_cache_hit_rate_follows_each_prefill_batch() -> None:
    reqs = _conversation(3)
    metrics = SimMetrics(model_name="m")
    engine = Engine(
        config=EngineConfig(kv_token_capacity=100_000),
        cost=LinearCost(),
        policy=None,
        acceptance=None,
    )
    seen: list[float] = []
    engine.run(
        reqs,
        metrics=metrics,
        on_tick=lambda _t: seen.append(metrics.g_cache_hit_rate.value),
        tick_interval_s=1e-4,
    )
    # Turn 1 misses (0), turn 2 reuses 2 of 4 blocks, turn 3 4 of 6.
    assert seen[0] == 0.0 and metrics.g_cache_hit_rate.value == pytest.approx(4 / 6)
    assert pytest.approx(2 / 4) in seen
    text = metrics.render().decode()
    assert "# TYPE sglang:cache_hit_rate gauge" in text
    assert "# HELP sglang:cache_hit_rate The prefix cache hit rate." in text


def _hit_rate(client: httpx.Client) -> float:
    rv = gauge_by_dp(parse_metrics(client.get("/metrics").text), "sglang:cache_hit_rate")
    value = rv.get(None)
    return 0.0 if value is None else value.value


def test_sim_server_exports_a_moving_cache_hit_rate() -> None:
    trace = generate_trace(parse_synthetic_spec(MULTI_TURN))
    sim = SimServer(trace, ServerSpec(), speed=20.0)
    sim.start()
    try:
        sim.wait_ready()
        values: set[float] = set()
        deadline = time.monotonic() + 60.0
        with httpx.Client(base_url=sim.url, timeout=5.0) as client:
            values.add(_hit_rate(client))
            while len(values) < 3 or max(values) <= 0.0:
                if time.monotonic() > deadline:
                    raise AssertionError(f"cache_hit_rate did not move: {sorted(values)}")
                values.add(_hit_rate(client))
                time.sleep(0.05)
        assert 0.0 < max(values) <= 1.0
        # /server_info says the cache is on, as SGLang's server args do.
        assert httpx.get(f"{sim.url}/server_info").json()["disable_radix_cache"] is False
    finally:
        sim.stop()


def test_server_info_says_when_the_radix_cache_is_disabled() -> None:
    trace = generate_trace(parse_synthetic_spec("synthetic:duration=5,rate=1"))
    sim = SimServer(trace, ServerSpec(prefix_cache=False), speed=20.0)
    sim.start()
    try:
        sim.wait_ready()
        info = httpx.get(f"{sim.url}/server_info", timeout=5.0).json()
        assert info["disable_radix_cache"] is True
        assert "--disable-radix-cache" in info["launch_command"]
    finally:
        sim.stop()


def test_sim_server_disable_radix_cache_flag_turns_the_cache_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    built: list[ServerSpec] = []

    class FakeSim:
        def __init__(self, _trace: object, server: ServerSpec, **_kw: object) -> None:
            built.append(server)

    monkeypatch.setattr("specgov.simulator.server.core.SimServer", FakeSim)
    monkeypatch.setattr(sim_cli, "serve", lambda *_a, **_k: 0)
    trace = "synthetic:duration=5,rate=1"
    for args, expected in (([], True), (["--disable-radix-cache"], False)):
        result = CliRunner().invoke(sim_cli.sim_server_cmd, ["--trace", trace, *args])
        assert result.exit_code == 0, result.output
        assert built[-1].prefix_cache is expected


def test_a_mooncake_file_replays_with_prefix_reuse(tmp_path: Path) -> None:
    # Mooncake's own sample rows (FAST25-release/README.md): 12 shared leading blocks.
    path = tmp_path / "mooncake.jsonl"
    shared = list(range(46, 58))
    rows = [
        {"timestamp": 27482, "input_length": 6955, "output_length": 52,
         "hash_ids": [*shared, 2353, 2354]},
        {"timestamp": 30535, "input_length": 6472, "output_length": 26,
         "hash_ids": [*shared, 2366]},
    ]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    trace = load_trace(path)
    on = replay(trace, ServerSpec(), ["none"], seed=0).to_json()["policies"][0]
    off = replay(trace, ServerSpec(prefix_cache=False), ["none"], seed=0).to_json()["policies"][0]
    assert on["prefix_cache_hit_tokens"] == 12 * B
    assert on["prefix_cache_hit_rate"] == pytest.approx(12 * B / (6955 + 6472))
    assert on["prefill_tokens"] == off["prefill_tokens"] - 12 * B
