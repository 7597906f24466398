"""SGLang's hierarchical cache (HiCache) in the simulator: the host tier of the prefix
trie, its sizing from SGLang's flags, the PCIe load-back, the per-tier hit rate against
an independent LRU over the trace's block ids, and the flags of replay and sim-server."""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner

from specgov.controller.cli.main import main
from specgov.simulator.engine.core import Engine
from specgov.simulator.engine.interface import EngineConfig, EngineConfigError, EngineResult
from specgov.simulator.engine.prefix_cache import (
    CacheNode,
    HicacheError,
    PrefixCache,
    block_tokens,
    hicache_token_capacity,
)
from specgov.simulator.replay.runner import ServerSpec, parse_policy, prepare_run, replay
from specgov.simulator.server import cli as sim_cli
from specgov.simulator.server.core import SimServer
from specgov.simulator.workload.synthetic import generate_trace
from specgov.simulator.workload.synthetic_text import parse_synthetic_spec
from specgov.simulator.workload.traces import PREFIX_BLOCK_TOKENS, Request

B = PREFIX_BLOCK_TOKENS
# A multi-turn chat whose conversations outgrow a small KV pool: ~400k tokens live at once.
MULTI_TURN = (
    "synthetic:duration=1200,rate=4,turns=8,think=20,turn_in=200,phases=chat@1200,"
    "chat.in=1500,chat.out=250,seed=1"
)
SMALL_MULTI_TURN = (
    "synthetic:duration=240,rate=3,turns=6,think=10,turn_in=200,phases=chat@240,"
    "chat.in=1500,chat.out=150,seed=5"
)


class LinearCost:
    """Prefill cost proportional to the tokens computed (the cached prefix is free)."""

    def decode_step_s(self, batch_size: int, steps: int, kv_tokens: int) -> float:
        return 0.005 + 0.0001 * batch_size

    def prefill_s(self, new_tokens: int, prefix_kv_tokens: int) -> float:
        return 0.002 + 1e-5 * new_tokens


def _run(
    requests: Sequence[Request], *, capacity: int, host: int, load_s: float = 1e-7
) -> EngineResult:
    engine = Engine(
        config=EngineConfig(
            kv_token_capacity=capacity,
            hicache_token_capacity=host,
            hicache_load_s_per_token=load_s,
        ),
        cost=LinearCost(),
        policy=None,
        acceptance=None,
    )
    return engine.run(list(requests))


# ------------------------------------------------------------------- sizing


def test_host_tier_size_follows_sglangs_flags() -> None:
    # --hicache-ratio x the device pool; SGLang's default ratio is 2.0; +1 padding page.
    assert hicache_token_capacity(100_000, 131072.0) == 200_001
    assert hicache_token_capacity(100_000, 131072.0, hicache_ratio=3.5) == 350_001
    # --hicache-size GB (1e9 bytes) per rank wins over the ratio.
    assert hicache_token_capacity(100_000, 131072.0, hicache_ratio=3.5, hicache_size_gb=20) == (
        20 * 10**9 // 131072 + 1
    )


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"hicache_ratio": 0.0}, "--hicache-ratio must be a number > 0"),
        ({"hicache_ratio": float("nan")}, "--hicache-ratio"),
        ({"hicache_size_gb": -1}, "--hicache-size must be >= 0 GB"),
        ({"hicache_size_gb": 1.5}, "--hicache-size must be a whole number of GB"),
    ],
)
def test_bad_host_tier_flags_are_named(kwargs: dict[str, float], needle: str) -> None:
    with pytest.raises(HicacheError, match=needle):
        ServerSpec(hierarchical_cache=True, **kwargs)  # type: ignore[arg-type]


def test_sizing_flags_without_the_cache_and_a_cache_without_the_radix_cache_are_refused() -> None:
    with pytest.raises(HicacheError, match="add --enable-hierarchical-cache"):
        ServerSpec(hicache_size_gb=10)
    with pytest.raises(HicacheError, match="drop --disable-radix-cache"):
        ServerSpec(hierarchical_cache=True, prefix_cache=False)
    with pytest.raises(EngineConfigError, match="needs the radix cache"):
        EngineConfig(kv_token_capacity=1000, prefix_cache=False, hicache_token_capacity=10)


# ------------------------------------------------------------------- the two tiers


def test_a_device_eviction_keeps_the_block_in_host_memory_and_a_match_loads_it_back() -> None:
    cache = PrefixCache(host_token_capacity=4 * B)
    added, _, _ = cache.insert([1, 2], 2 * B, [], 0.0)
    assert cache.host_tokens == 2 * B  # write_through: backed up on insert
    cache.unpin(added, 1.0)
    assert cache.evict(2 * B) == 2 * B
    assert cache.total_tokens == 0 and cache.host_tokens == 2 * B  # host-only now
    path = cache.match([1, 2, 3], 3 * B, 2.0)
    assert [n.hash_id for n in path] == [1, 2]
    assert cache.host_only_tokens(path) == 2 * B
    assert cache.unpinned_tokens(path) == 2 * B  # loading back takes device room
    cache.pin(path)
    assert cache.total_tokens == 2 * B and cache.pinned_tokens == 2 * B
    assert cache.host_only_tokens(path) == 0


def test_without_a_host_tier_an_eviction_drops_the_block() -> None:
    cache = PrefixCache()
    added, _, _ = cache.insert([1, 2], 2 * B, [], 0.0)
    cache.unpin(added, 1.0)
    cache.evict(2 * B)
    assert cache.match([1, 2], 2 * B, 2.0) == [] and cache.blocks == 0


def test_the_host_tier_evicts_host_only_blocks_lru_and_keeps_device_blocks_backups() -> None:
    cache = PrefixCache(host_token_capacity=3 * B)
    old, _, _ = cache.insert([1], B, [], 0.0)
    cache.unpin(old, 0.5)
    cache.evict(B)  # block 1: host-only
    live, _, _ = cache.insert([2, 3], 2 * B, [], 1.0)  # device blocks, backed up
    assert cache.host_tokens == 3 * B
    newer, _, _ = cache.insert([4], B, [], 2.0)  # the host tier is full: 1 goes
    assert cache.host_evicted_tokens == B
    assert cache.match([1], B, 3.0) == []
    assert all(n.on_host for n in live + newer)
    # A full host tier of device blocks' backups: a new block stays unbacked.
    extra, _, _ = cache.insert([5], B, [], 4.0)
    assert not extra[0].on_host and cache.host_tokens == 3 * B


# ------------------------------------------------------------------- the independent check


def _lru_hit_rate(requests: Sequence[Request], capacity_tokens: int) -> float:
    """Hit rate of a plain LRU over the trace's block ids, in arrival order: a request
    reuses its longest prefix of cached blocks (at most its prompt - 1 tokens)."""
    lru: OrderedDict[int, int] = OrderedDict()
    used = hit = looked = 0
    for r in sorted(requests, key=lambda q: q.arrival_s):
        ids = r.hash_ids or ()
        looked += r.input_tokens
        prefix = 0
        for j, hid in enumerate(ids):
            if hid not in lru:
                break
            prefix += block_tokens(r.input_tokens, j)
        hit += min(prefix, r.input_tokens - 1)
        for j, hid in enumerate(ids):
            if hid in lru:
                lru.move_to_end(hid)
                continue
            lru[hid] = block_tokens(r.input_tokens, j)
            used += lru[hid]
            while used > capacity_tokens:
                used -= lru.popitem(last=False)[1]
    return hit / looked


@pytest.mark.parametrize(("device", "host"), [(100_000, 250_000), (60_000, 150_000)])
def test_hit_rate_per_tier_is_within_10_percent_of_an_lru_over_the_block_ids(
    device: int, host: int
) -> None:
    trace = generate_trace(parse_synthetic_spec(MULTI_TURN))
    result = _run(trace.requests, capacity=device, host=host)
    assert result.completed == len(trace.requests)
    device_lru = _lru_hit_rate(trace.requests, device)
    # The host tier is inclusive (write_through): together the tiers hold `host` tokens.
    both_lru = _lru_hit_rate(trace.requests, host)
    sim_device = result.prefix_cache_hit_rate - result.prefix_cache_hit_rate_host
    assert sim_device == pytest.approx(device_lru, rel=0.10)
    assert result.prefix_cache_hit_rate_host == pytest.approx(both_lru - device_lru, rel=0.10)
    assert result.prefix_cache_hit_rate == pytest.approx(both_lru, rel=0.10)
    # The host tier is what lifts the hit rate (several-fold over the device alone here).
    assert result.prefix_cache_hit_rate > 1.8 * sim_device
    assert result.hicache_token_capacity == host


def test_a_host_hit_costs_its_pcie_copy() -> None:
    trace = generate_trace(parse_synthetic_spec(SMALL_MULTI_TURN))
    fast = _run(trace.requests, capacity=30_000, host=200_000, load_s=1e-8)
    slow = _run(trace.requests, capacity=30_000, host=200_000, load_s=1e-5)
    assert fast.cache_hit_host_tokens > 0
    assert slow.hicache_load_s == pytest.approx(fast.hicache_load_s * 1000, rel=0.2)
    assert slow.prefill_time_s > fast.prefill_time_s + 0.5 * slow.hicache_load_s


# ------------------------------------------------------------------- replay and sim-server


def test_replay_reports_the_hit_rate_per_tier_and_the_host_capacity() -> None:
    trace = generate_trace(parse_synthetic_spec(SMALL_MULTI_TURN))
    plain = replay(trace, ServerSpec(mem_fraction_static=0.25), ["none"], seed=0).to_json()
    hier = replay(
        trace,
        ServerSpec(hierarchical_cache=True, hicache_size_gb=20, mem_fraction_static=0.25),
        ["none"],
        seed=0,
    ).to_json()
    p, h = plain["policies"][0], hier["policies"][0]
    assert "prefix_cache_hit_rate_host" not in p
    assert h["hicache_token_capacity"] == 20 * 10**9 // 131072 + 1  # llama-3.1-8b: 128 KiB
    assert h["prefix_cache_hit_rate_host"] > 0
    assert h["prefix_cache_hit_rate"] == pytest.approx(
        h["prefix_cache_hit_rate_device"] + h["prefix_cache_hit_rate_host"]
    )
    assert h["prefix_cache_hit_rate"] > p["prefix_cache_hit_rate"]
    assert h["prefill_tokens"] < p["prefill_tokens"]
    assert hier["server"]["hierarchical_cache"] is True
    assert hier["server"]["hicache_size_gb"] == 20


def test_the_load_back_is_priced_at_the_catalogs_pcie_bandwidth() -> None:
    server = ServerSpec(hierarchical_cache=True, gpu="a100")
    run = prepare_run(server, parse_policy("none"), seed=0)
    cfg = run.engine.config
    assert cfg.hicache_token_capacity == 2 * run.memory.kv_token_capacity + 1
    assert cfg.hicache_load_s_per_token == pytest.approx(
        run.memory.kv_bytes_per_token / 25.6e9  # a100-80g: pcie_gb_s 25.6
    )


def test_replay_cli_takes_sglangs_flag_names() -> None:
    args = ["replay", SMALL_MULTI_TURN, "--policy", "none", "--output", "json"]
    runner = CliRunner()
    ok = runner.invoke(
        main,
        [*args, "--mem-fraction-static", "0.25", "--enable-hierarchical-cache",
         "--hicache-ratio", "3"],
    )  # fmt: skip
    assert ok.exit_code == 0, ok.output
    summary = json.loads(ok.stdout)["policies"][0]
    assert summary["hicache_token_capacity"] == 3 * summary["kv_token_capacity"] + 1
    bad = runner.invoke(main, [*args, "--hicache-size", "10"])
    assert bad.exit_code == 2
    assert "add --enable-hierarchical-cache" in bad.output
    assert "Traceback" not in bad.output


def test_sim_server_takes_the_flags_and_reports_them_in_server_info(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    built: list[ServerSpec] = []

    class FakeSim:
        def __init__(self, _trace: object, server: ServerSpec, **_kw: object) -> None:
            built.append(server)

    monkeypatch.setattr("specgov.simulator.server.core.SimServer", FakeSim)
    monkeypatch.setattr(sim_cli, "serve", lambda *_a, **_k: 0)
    result = CliRunner().invoke(
        sim_cli.sim_server_cmd,
        ["--trace", "synthetic:duration=5,rate=1", "--enable-hierarchical-cache",
         "--hicache-size", "40"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert (built[-1].hierarchical_cache, built[-1].hicache_size_gb) == (True, 40)
    monkeypatch.undo()
    trace = generate_trace(parse_synthetic_spec("synthetic:duration=5,rate=1"))
    sim = SimServer(trace, ServerSpec(hierarchical_cache=True, hicache_ratio=3.0), speed=20.0)
    sim.start()
    try:
        sim.wait_ready()
        info = httpx.get(f"{sim.url}/server_info", timeout=5.0).json()
        assert info["enable_hierarchical_cache"] is True
        assert info["hicache_ratio"] == 3.0 and info["hicache_size"] == 0
        assert "--enable-hierarchical-cache --hicache-ratio 3" in info["launch_command"]
    finally:
        sim.stop()


def _walk(cache: PrefixCache) -> list[CacheNode]:
    out = []
    stack = list(cache.root.children.values())
    while stack:
        node = stack.pop()
        out.append(node)
        stack.extend(node.children.values())
    return out


def test_random_operations_keep_both_tiers_consistent() -> None:
    import random

    rng = random.Random(7)  # seeded: the same sequence every run
    cache = PrefixCache(host_token_capacity=12 * B)
    held: list[list[CacheNode]] = []
    for step in range(3000):
        now = float(step)
        op = rng.random()
        if op < 0.45:
            conv = rng.randrange(6)
            blocks = rng.randrange(1, 6)
            ids = [conv * 100 + j for j in range(blocks)]
            path = cache.match(ids, blocks * B, now)
            cache.pin(path)
            added, _, _ = cache.insert(ids, blocks * B, path, now)
            held.append(path + added)
        elif op < 0.8 and held:
            cache.unpin(held.pop(rng.randrange(len(held))), now)
        else:
            cache.evict(rng.randrange(1, 6) * B)
        nodes = _walk(cache)
        dev = [n for n in nodes if n.on_device]
        assert cache.total_tokens == sum(n.tokens for n in dev)
        host = sum(n.tokens for n in nodes if n.on_host)
        assert cache.host_tokens == host <= cache.host_token_capacity
        assert cache.blocks == len(nodes)
        for n in nodes:
            parent = n.parent
            assert parent is not None  # a block in the trie has one
            # Prefix-closed tiers; a block is somewhere; pinned blocks are on the device.
            assert n.on_device or n.on_host
            assert not n.on_device or parent.on_device
            assert not n.on_host or parent.on_host
            assert n.pins == 0 or n.on_device
            kids = sum(1 for c in n.children.values() if c.on_device)
            assert n.dev_kids == kids


def test_a_catalog_gpu_without_a_pcie_figure_is_named(tmp_path: Path) -> None:
    extra = tmp_path / "gpus.yaml"
    extra.write_text(
        "gpus:\n  my-gpu: {memory_gib: 96, hbm_bandwidth_tb_s: 4.0, bf16_tflops: 900}\n"
    )
    server = ServerSpec(gpu="my-gpu", hierarchical_cache=True, catalog_files=(extra,))
    with pytest.raises(HicacheError, match="GPU 'my-gpu' has no pcie_gb_s in the catalog"):
        prepare_run(server, parse_policy("none"), seed=0)
    result = CliRunner().invoke(
        main,
        ["replay", SMALL_MULTI_TURN, "--policy", "none", "--gpu", "my-gpu", "--catalog",
         str(extra), "--enable-hierarchical-cache"],
    )  # fmt: skip
    assert result.exit_code != 0 and "has no pcie_gb_s" in result.output
    assert "Traceback" not in result.output
