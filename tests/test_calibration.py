"""End-to-end calibration of the simulated server against published measurements.

Each test runs whole requests through the engine (prefill, decode, acceptance
draws, the in-engine policy) rather than calling the cost model directly, so it
checks the assembled simulator. Tolerances are ±15 % unless stated.

Two kinds of test (issue 11 §5):

*Fit checks* (``test_fit_check_*``) compare the simulator with the very numbers its
catalog was fitted to; they catch a regression, not a wrong model:
* vLLM issue 20780 (EAGLE-3, Llama-3.1-8B, H100, batch 1, MT-bench): TPOT without
  speculation 7.07 ms (fits the fixed per-forward overhead); best static K = 4 with
  TPOT 4.05 ms (fits the EAGLE-3 draft overheads; its accept lengths are the mtbench
  rates).
* EAGLE-3 paper: 1.38x throughput at batch 64 in SGLang on H100 (fits the
  per-verified-token overhead).

*Independent checks* (``test_independent_*``) compare with sources not used in fitting
(REFERENCE.md §3, §4):
* Vidur H100 profile: a forward is nearly flat up to ~64 batched tokens, then ~20 µs
  per token (the roofline is built from datasheet figures, not fitted to the profile).
* Physics (DESIGN.md): at saturation every rejected draft is wasted compute, so with
  an n-gram drafter's low first-position acceptance speculation loses.
* SGLang AutoSpec experiments: the best static step count falls with load (4 at batch
  1, 2 at batch 64).
* vLLM #52362 (adaptive verification, ROCm): fixed K = 7 at 256 concurrent requests is
  below no speculation (adaptive +50 % over none and +69.7 % over K = 7 there).
* Chat trace replay of other kinds of content: in tests/test_acceptance.py.
"""

from __future__ import annotations

import statistics

import pytest

from specgov.simulator.catalog import Catalog
from specgov.simulator.engine.cost import CostModel
from specgov.simulator.engine.interface import EngineResult
from specgov.simulator.replay.runner import ServerSpec, build_engine, parse_policy
from specgov.simulator.workload.traces import Request

H100_8B = ServerSpec(gpu="h100", model="llama-3.1-8b", drafter="eagle3")


def _run(policy: str, requests: list[Request], server: ServerSpec = H100_8B) -> EngineResult:
    engine, _ = build_engine(server, parse_policy(policy), seed=7)
    return engine.run(requests)


def _batch1_requests(n: int = 40, domain: str = "mtbench") -> list[Request]:
    # Far enough apart that each request runs alone (batch 1), MT-bench-like lengths.
    return [Request(60.0 * i, 512, 256, domain) for i in range(n)]


def _mean_tpot_ms(result: EngineResult) -> float:
    return 1e3 * statistics.fmean(result.tpot_s)


def test_fit_check_batch1_no_speculation_tpot_matches_vllm_20780() -> None:
    result = _run("none", _batch1_requests())
    assert max(result.batch_size_hist) == 1
    assert _mean_tpot_ms(result) == pytest.approx(7.07, rel=0.15)


def test_fit_check_batch1_best_static_is_four_steps_at_4_05_ms() -> None:
    tpot = {k: _mean_tpot_ms(_run(f"static:{k}", _batch1_requests())) for k in range(1, 8)}
    best = min(tpot, key=lambda k: tpot[k])
    assert best in (3, 4, 5), tpot  # the optimum is flat around K = 4
    assert tpot[4] == pytest.approx(4.05, rel=0.15)
    assert tpot[best] == pytest.approx(4.05, rel=0.15)
    speedup = _mean_tpot_ms(_run("none", _batch1_requests())) / tpot[4]
    assert speedup == pytest.approx(1.75, rel=0.15)


def test_independent_verification_is_nearly_free_until_the_knee_then_about_20us_per_token() -> None:
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


def test_fit_check_batch64_static_speculation_gain_is_small() -> None:
    # A steady batch of 64 with 1-2k tokens of context each.
    reqs = _closed_batch(64, "mtbench", output_tokens=1024)
    base = _run("none", reqs)
    assert max(base.batch_size_hist) == 64
    gains = {k: _decode_tok_s(_run(f"static:{k}", reqs)) / _decode_tok_s(base) for k in range(1, 6)}
    best = max(gains.values())
    # EAGLE-3 paper: 1.38x at batch 64 in SGLang (vs ~1.75x at batch 1).
    assert best == pytest.approx(1.38, rel=0.15), gains
    assert max(gains, key=lambda k: gains[k]) <= 4


def test_independent_saturated_ngram_like_acceptance_makes_static_speculation_lose() -> None:
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


def _best_static(requests: list[Request], measure: str) -> tuple[int, dict[int, float]]:
    score: dict[int, float] = {}
    for k in range(1, 8):
        result = _run(f"static:{k}", requests)
        # batch 1: lowest TPOT; a full batch: highest decode throughput.
        score[k] = -_mean_tpot_ms(result) if measure == "tpot" else _decode_tok_s(result)
    return max(score, key=lambda k: score[k]), score


@pytest.mark.parametrize("domain", ["sharegpt", "mtbench"])
def test_independent_best_static_steps_fall_with_load_as_in_autospec(domain: str) -> None:
    # SGLang AutoSpec experiments (REFERENCE §4): best steps 4 at batch 1 vs 2 at 64.
    at_1, tpot = _best_static(_batch1_requests(domain=domain), "tpot")
    at_64, tok_s = _best_static(_closed_batch(64, domain, output_tokens=1024), "tok_s")
    assert at_1 in (3, 4, 5), tpot
    assert at_64 in (1, 2, 3), tok_s
    assert at_64 < at_1


def test_independent_fixed_k7_loses_to_no_speculation_at_256_concurrent() -> None:
    # vLLM #52362: adaptive +50 % over no speculation and +69.7 % over fixed K=7 at 256
    # concurrent, so K=7 there ran at ~0.88x of no speculation.
    reqs = _closed_batch(256, "sharegpt")
    base = _decode_tok_s(_run("none", reqs))
    k7 = _decode_tok_s(_run("static:7", reqs)) / base
    assert 0.5 < k7 < 1.0, k7
