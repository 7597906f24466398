"""End-to-end calibration of the simulated server against published measurements.

Each test runs whole requests through the engine (prefill, decode, acceptance
draws, the in-engine policy) rather than calling the cost model directly, so it
checks the assembled simulator. Tolerances are ±15 % unless stated.

Sources (REFERENCE.md §3, §4):
* vLLM issue 20780 (EAGLE-3, Llama-3.1-8B, H100, batch 1, MT-bench): TPOT without
  speculation 7.07 ms; best static K = 4 with TPOT 4.05 ms (1.75x).
* Vidur H100 profile / SpecDecode-Bench fit: a forward is nearly flat up to ~64
  batched tokens, then ~20 µs per token.
* EAGLE-3 paper: 1.38x throughput at batch 64 in SGLang on H100 (small gain).
* Physics (DESIGN.md): at saturation every rejected draft is wasted compute, so
  with an n-gram drafter's low first-position acceptance speculation loses.
"""

from __future__ import annotations

import statistics

import pytest

from specgov.simulator.catalog import Catalog
from specgov.simulator.cost import CostModel
from specgov.simulator.engine import EngineResult
from specgov.simulator.replay import ServerSpec, build_engine, parse_policy
from specgov.simulator.traces import Request

H100_8B = ServerSpec(gpu="h100", model="llama-3.1-8b", drafter="eagle3")


def _run(policy: str, requests: list[Request], server: ServerSpec = H100_8B) -> EngineResult:
    engine, _ = build_engine(server, parse_policy(policy), seed=7)
    return engine.run(requests)


def _batch1_requests(n: int = 40, domain: str = "mtbench") -> list[Request]:
    # Far enough apart that each request runs alone (batch 1), MT-bench-like lengths.
    return [Request(60.0 * i, 512, 256, domain) for i in range(n)]


def _mean_tpot_ms(result: EngineResult) -> float:
    return 1e3 * statistics.fmean(result.tpot_s)


def test_batch1_no_speculation_tpot_matches_vllm_20780() -> None:
    result = _run("none", _batch1_requests())
    assert max(result.batch_size_hist) == 1
    assert _mean_tpot_ms(result) == pytest.approx(7.07, rel=0.15)


def test_batch1_best_static_is_four_steps_at_4_05_ms() -> None:
    tpot = {k: _mean_tpot_ms(_run(f"static:{k}", _batch1_requests())) for k in range(1, 8)}
    best = min(tpot, key=lambda k: tpot[k])
    assert best in (3, 4, 5), tpot  # the optimum is flat around K = 4
    assert tpot[4] == pytest.approx(4.05, rel=0.15)
    assert tpot[best] == pytest.approx(4.05, rel=0.15)
    speedup = _mean_tpot_ms(_run("none", _batch1_requests())) / tpot[4]
    assert speedup == pytest.approx(1.75, rel=0.15)


def test_verification_is_nearly_free_until_the_knee_then_about_20us_per_token() -> None:
    catalog = Catalog.load()
    cost = CostModel.from_catalog(
        catalog.gpu("h100"), catalog.model("llama-3.1-8b"), catalog.drafter("eagle3")
    )
    flat = [cost.target_forward_s(n, 0) for n in (1, 8, 16, 32, 64)]
    assert max(flat) / min(flat) < 1.15
    slope_s = (cost.target_forward_s(4096, 0) - cost.target_forward_s(1024, 0)) / 3072
    assert 15e-6 <= slope_s <= 25e-6


def _closed_batch(
    n: int, domain: str, input_tokens: int = 1024, output_tokens: int = 512
) -> list[Request]:
    # n requests start together with equal lengths: the decode batch stays at n.
    return [Request(0.0, input_tokens, output_tokens, domain) for _ in range(n)]


def _decode_tok_s(result: EngineResult) -> float:
    # Tokens produced by decode forwards per second of decode GPU time: the
    # prefill (identical for every policy) and the drain at the end are left out.
    return (result.output_tokens - result.completed) / result.decode_time_s


def test_batch64_static_speculation_gain_is_small() -> None:
    # A steady batch of 64 with 1-2k tokens of context each.
    reqs = _closed_batch(64, "mtbench", output_tokens=1024)
    base = _run("none", reqs)
    assert max(base.batch_size_hist) == 64
    gains = {k: _decode_tok_s(_run(f"static:{k}", reqs)) / _decode_tok_s(base) for k in range(1, 6)}
    best = max(gains.values())
    # EAGLE-3 paper: 1.38x at batch 64 in SGLang (vs ~1.75x at batch 1).
    assert best == pytest.approx(1.38, rel=0.15), gains
    assert max(gains, key=lambda k: gains[k]) <= 4


def test_saturated_ngram_like_acceptance_makes_static_speculation_lose() -> None:
    server = ServerSpec(
        gpu="h100", model="llama-3.1-8b", drafter="eagle3", acceptance_profile="ngram"
    )
    reqs = _closed_batch(256, "gsm8k")  # n-gram on gsm8k: α1 = 0.16
    base = _run("none", reqs, server)
    base_tps = base.output_tokens / base.end_s
    for k in (1, 3, 5, 7):
        result = _run(f"static:{k}", reqs, server)
        assert result.output_tokens / result.end_s < base_tps, k


def test_low_load_speculation_helps_and_sglang_ema_tracks_the_good_static() -> None:
    reqs = _batch1_requests(domain="instructcoder")
    none = _mean_tpot_ms(_run("none", reqs))
    ema = _mean_tpot_ms(_run("sglang-ema", reqs))
    assert ema < none / 1.4
