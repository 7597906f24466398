"""The simulated server's /metrics move like SGLang's: same names, same moments."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from specgov.simulator.engine.sglang_metrics import DecodeStep, SimMetrics
from specgov.simulator.replay.runner import ServerSpec, build_engine, parse_policy
from specgov.simulator.workload.traces import Request


def _samples(text: bytes) -> dict[str, float]:
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text.decode()):
        for sample in family.samples:
            if sample.name.endswith("_bucket"):
                continue
            out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def test_counters_histograms_and_gauges_track_the_run() -> None:
    reqs = [Request(0.05 * i, 300, 50 + i % 7, "chat") for i in range(120)]
    engine, _ = build_engine(ServerSpec(), parse_policy("static:3"), seed=1)
    metrics = SimMetrics(model_name="llama-3.1-8b")
    ticks: list[float] = []
    result = engine.run(reqs, metrics=metrics, on_tick=ticks.append, tick_interval_s=0.5)
    s = _samples(metrics.render())
    assert s["sglang:generation_tokens_total"] == result.output_tokens
    assert s["sglang:prompt_tokens_total"] == 300 * 120
    assert s["sglang:num_requests_total"] == 120
    assert s["sglang:spec_verify_calls_total"] == result.verified_requests
    assert s["sglang:time_to_first_token_seconds_count"] == 120
    assert s["sglang:e2e_request_latency_seconds_count"] == 120
    # ITL counts one observation per token after the first, like SGLang.
    assert s["sglang:inter_token_latency_seconds_count"] == result.output_tokens - 120
    assert s["sglang:spec_num_steps"] == 3
    assert 0.0 <= s["sglang:token_usage"] <= 1.0
    # Ticks cover the run at the requested spacing.
    assert ticks == sorted(ticks)
    assert len(ticks) >= int((result.end_s - result.first_arrival_s) / 0.5) - 1


def test_gauges_refresh_only_every_40_decode_iterations() -> None:
    metrics = SimMetrics(model_name="m")
    for i in range(39):
        metrics.on_decode(
            DecodeStep(
                now_s=0.01 * i,
                running=5,
                queued=1,
                used_tokens=100,
                capacity_tokens=1000,
                steps=3,
                emitted_tokens=10,
                verified_requests=5,
            )
        )
    assert _samples(metrics.render())["sglang:num_running_reqs"] == 0.0
    metrics.on_decode(
        DecodeStep(
            now_s=0.4,
            running=7,
            queued=1,
            used_tokens=100,
            capacity_tokens=1000,
            steps=3,
            emitted_tokens=10,
            verified_requests=5,
        )
    )
    s = _samples(metrics.render())
    assert s["sglang:num_running_reqs"] == 7
    assert s["sglang:spec_accept_length"] == 2.0


def _blocks(text: str, families: frozenset[str]) -> str:
    """The HELP/TYPE/sample blocks of ``text`` whose TYPE name is in ``families``."""
    out: list[str] = []
    keep = False
    for line in text.splitlines(keepends=True):
        if line.startswith("# HELP "):
            keep = line.split()[2] in families
        if keep:
            out.append(line)
    return "".join(out)


def test_family_render_is_the_matching_part_of_the_full_render() -> None:
    from specgov.adapters.telemetry import METRICS_READ

    reqs = [Request(0.05 * i, 300, 50 + i % 7, "chat") for i in range(60)]
    engine, memory = build_engine(ServerSpec(), parse_policy("sglang-ema"), seed=2)
    # A model name that needs escaping in label values.
    metrics = SimMetrics(model_name='org/m"x\\y', kv_capacity_tokens=memory.kv_token_capacity)
    renders: list[tuple[bytes, bytes]] = []

    def tick(now_s: float) -> None:
        renders.append((metrics.render(), metrics.render_families(METRICS_READ)))

    engine.run(reqs, metrics=metrics, on_tick=tick, tick_interval_s=0.5)
    tick(0.0)
    assert len(renders) > 5
    for full, part in renders:
        assert part.decode() == _blocks(full.decode(), METRICS_READ)
    full, part = renders[-1]
    # The full render keeps what telemetry does not read; the family render does not.
    assert b"sglang:queue_time_seconds_bucket" in full and b"_created" in full
    assert b"sglang:queue_time_seconds" not in part and b"_created" not in part
    assert _samples(part)["sglang:generation_tokens_total"] > 0
    assert metrics.render_families(["sglang:num_requests_total"]).count(b"\n") == 3


def test_cache_hit_rate_gauge_is_the_last_prefill_batchs_and_renders_alike() -> None:
    # Requests whose prompts repeat (same block ids): the second and later hit the cache.
    reqs = [Request(0.5 * i, 1024, 20, "chat", hash_ids=(1, 2)) for i in range(8)]
    engine, _ = build_engine(ServerSpec(), parse_policy("none"), seed=1)
    metrics = SimMetrics(model_name="llama-3.1-8b")
    values: list[float] = []
    renders: list[tuple[bytes, bytes]] = []
    families = ["sglang:cache_hit_rate"]

    def tick(_now_s: float) -> None:
        values.append(_samples(metrics.render())["sglang:cache_hit_rate"])
        renders.append((metrics.render(), metrics.render_families(families)))

    engine.run(reqs, metrics=metrics, on_tick=tick, tick_interval_s=0.05)
    assert values[0] == 0.0
    assert values[-1] == 1023 / 1024  # a full match; the last prompt token is computed
    for full, part in renders:
        assert part.decode() == _blocks(full.decode(), families)
    # Decode refreshes do not reset it (SGLang: cache_hit_rate is prefill-owned).
    metrics.on_decode(
        DecodeStep(
            now_s=100.0,
            running=1,
            queued=0,
            used_tokens=1,
            capacity_tokens=10,
            steps=0,
            emitted_tokens=1,
            verified_requests=0,
        )
    )
    assert _samples(metrics.render())["sglang:cache_hit_rate"] == 1023 / 1024
    metrics.on_prefix_cache(0, 0)  # an all-reprocessed batch: SGLang sets 0
    assert _samples(metrics.render())["sglang:cache_hit_rate"] == 0.0


def test_replays_snapshot_gives_the_observations_the_parsed_text_gives() -> None:
    # Replay hands the daemon's observation builder SimMetrics.read_snapshot; the daemon
    # parses the rendered text. Over a run (counters, histograms, refreshed gauges,
    # retractions), both paths must give equal snapshots and equal observations.
    from specgov.adapters.observation_builder import ObservationBuilder
    from specgov.adapters.telemetry import METRICS_READ, parse_read_metrics
    from specgov.simulator.replay.runner import specgov_adaptive_config, specgov_server_info

    reqs = [Request(0.02 * i, 400 + 37 * (i % 5), 60 + i % 11, "chat") for i in range(300)]
    server = ServerSpec(max_running_requests=16)
    engine, memory = build_engine(server, parse_policy("sglang-ema"), seed=3)
    metrics = SimMetrics(model_name='org/m"x', kv_capacity_tokens=memory.kv_token_capacity)
    info = specgov_server_info(
        algorithm="EAGLE3", spec_steps=3, kv_capacity=memory.kv_token_capacity
    )
    by_text = ObservationBuilder(adaptive_config=specgov_adaptive_config())
    by_snapshot = ObservationBuilder(adaptive_config=specgov_adaptive_config())
    pairs = []

    def tick(now_s: float) -> None:
        text = metrics.render_families(METRICS_READ).decode()
        parsed = parse_read_metrics(text, source="simulated /metrics")
        direct = metrics.read_snapshot(METRICS_READ)
        assert direct == parsed
        first = not pairs
        pairs.append(
            (
                by_text.feed(now_s, parsed, dict(info) if first else None),
                by_snapshot.feed(now_s, direct, dict(info) if first else None),
            )
        )

    engine.run(reqs, metrics=metrics, on_tick=tick, tick_interval_s=0.5)
    assert len(pairs) > 5
    assert all(a == b for a, b in pairs)
    # The run moved what the observations read.
    last = pairs[-1][0]
    assert last.running_requests is not None and last.tpot_ms is not None
