"""Acceptance model: profile data, E[L], sampler calibration, burstiness, determinism."""

from __future__ import annotations

import random
import statistics

import pytest

from specgov.simulator.engine.acceptance import (
    BUILTIN_REQUEST_CORRELATION,
    BUILTIN_RUN_REQUEST_CORRELATION,
    BUILTIN_TOKEN_CORRELATION,
    DEFAULT_BURSTINESS,
    MAX_STEPS,
    PROFILES,
    AcceptanceError,
    AcceptanceModel,
    AcceptanceSampler,
    DomainAcceptance,
    TokenAcceptanceSampler,
    expected_accept_length_from_rates,
)

EAGLE = "eagle3-llama3.1-8b"
# vLLM issue 20780 (EAGLE-3, Llama-3.1-8B, H100, MT-bench): E[L(K)] for K = 2..7.
VLLM_20780 = {2: 2.36, 3: 2.79, 4: 3.08, 5: 3.32, 6: 3.46, 7: 3.54}
# REFERENCE.md §3, EAGLE-3 sharegpt and n-gram instructcoder.
SHAREGPT = (0.69, 0.66, 0.69, 0.73, 0.76, 0.79, 0.80)
NGRAM_CODE = (0.65, 0.93, 0.94, 0.95, 0.95, 0.96, 0.96)


def test_profiles_hold_the_reference_rates() -> None:
    assert PROFILES[EAGLE]["sharegpt"] == SHAREGPT
    assert PROFILES["ngram"]["instructcoder"] == NGRAM_CODE
    assert set(PROFILES[EAGLE]) == {"cnn", "gsm8k", "instructcoder", "sharegpt", "mtbench"}
    assert set(PROFILES["ngram"]) == {"cnn", "gsm8k", "instructcoder", "sharegpt"}
    # Standalone draft model: EAGLE-3's rates scaled by 0.9 (documented estimate).
    for domain, rates in PROFILES[EAGLE].items():
        scaled = PROFILES["standalone-llama3.2-1b"][domain]
        assert scaled == pytest.approx([0.9 * a for a in rates])


@pytest.mark.parametrize("k", sorted(VLLM_20780))
def test_mtbench_reproduces_vllm_20780_exactly(k: int) -> None:
    model = AcceptanceModel(EAGLE, seed=0)
    assert model.expected_accept_length("mtbench", k) == pytest.approx(VLLM_20780[k], abs=1e-9)


def test_mtbench_first_two_rates_are_equal_and_plausible() -> None:
    a1, a2, *_ = AcceptanceModel(EAGLE, seed=0).conditional_rates("mtbench")
    assert a1 == pytest.approx(a2)
    assert 0.65 < a1 < 0.85


def test_expected_length_formula_and_positions_past_7() -> None:
    model = AcceptanceModel(EAGLE, seed=0)
    # E[L] = 1 + Σ Π α, by hand for sharegpt at k=3.
    by_hand = 1 + 0.69 + 0.69 * 0.66 + 0.69 * 0.66 * 0.69
    assert model.expected_accept_length(None, 3) == pytest.approx(by_hand)
    assert model.expected_accept_length("chat", 0) == 1.0
    # Position 8 reuses α_7.
    reach7 = 1.0
    for a in SHAREGPT:
        reach7 *= a
    gain8 = model.expected_accept_length(None, 8) - model.expected_accept_length(None, 7)
    assert gain8 == pytest.approx(reach7 * SHAREGPT[-1])
    # The i.i.d. special case matches the closed form (1 - α^(k+1)) / (1 - α).
    assert expected_accept_length_from_rates([0.7], 5) == pytest.approx((1 - 0.7**6) / 0.3)


def test_domain_aliases_and_default() -> None:
    model = AcceptanceModel(EAGLE, seed=0)
    assert model.resolve_domain(None) == "sharegpt"
    assert model.resolve_domain("Code") == "instructcoder"
    assert model.resolve_domain("chat") == "sharegpt"
    assert model.resolve_domain("rag") == "cnn"
    assert model.resolve_domain("math") == "gsm8k"
    assert model.resolve_domain("MT-Bench") == "mtbench"


def test_unknown_profile_and_domain_list_valid_names() -> None:
    with pytest.raises(AcceptanceError) as info:
        AcceptanceModel("medusa", seed=0)
    assert "unknown acceptance profile 'medusa'; valid: eagle3-llama3.1-8b, ngram" in str(
        info.value
    )
    ngram = AcceptanceModel("ngram", seed=0)
    with pytest.raises(AcceptanceError) as info:
        ngram.expected_accept_length("mtbench", 3)
    assert "valid: cnn, gsm8k, instructcoder, sharegpt" in str(info.value)
    with pytest.raises(AcceptanceError, match="unknown domain 'poetry'"):
        ngram.sampler(0, "poetry")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"burstiness": 1.0}, r"burstiness must be in \[0, 1\)"),
        ({"burstiness": -0.1}, r"burstiness must be in \[0, 1\)"),
        ({"topk": 4}, "needs num_draft_tokens"),
        ({"topk": 0}, "topk must be an integer >= 1"),
        ({"seed": "x"}, "seed must be an integer"),
    ],
)
def test_bad_settings(kwargs: dict[str, object], match: str) -> None:
    args: dict[str, object] = {"seed": 0, **kwargs}
    with pytest.raises(AcceptanceError, match=match):
        AcceptanceModel(EAGLE, **args)  # type: ignore[arg-type]


def test_bad_steps() -> None:
    sampler = AcceptanceModel(EAGLE, seed=0).sampler(0, None)
    with pytest.raises(AcceptanceError, match=f"steps must be in 0..{MAX_STEPS}"):
        sampler.draw(MAX_STEPS + 1)
    with pytest.raises(AcceptanceError, match="steps must be in"):
        sampler.draw(-1)


def _censored_rates(
    model: AcceptanceModel, domain: str, requests: int, draws: int, seed: int
) -> tuple[list[float], list[int]]:
    """Estimate α_j from draws that reached position j (and could go past it)."""
    rng = random.Random(seed)
    reached = [0] * 8
    passed = [0] * 8
    for r in range(requests):
        sampler = model.sampler(r, domain)
        for _ in range(draws):
            steps = rng.randint(1, 7)
            n = sampler.draw(steps)
            assert 0 <= n <= steps
            # Position j was drafted and reached iff j <= steps and n >= j - 1.
            for j in range(1, min(n + 1, steps) + 1):
                reached[j] += 1
                if n >= j:
                    passed[j] += 1
    return [passed[j] / reached[j] for j in range(1, 8)], reached[1:]


@pytest.mark.parametrize("burstiness", [0.0, DEFAULT_BURSTINESS])
@pytest.mark.parametrize(("profile", "domain"), [(EAGLE, "gsm8k"), ("ngram", "sharegpt")])
def test_sampled_conditional_rates_match_profile(
    burstiness: float, profile: str, domain: str
) -> None:
    # The per-verify sampler reproduces the profile's rates at every verify; the per-token
    # one (the default for these domains) reproduces them at every position instead.
    model = AcceptanceModel(profile, burstiness=burstiness, seed=11, token_model=False)
    estimates, reached = _censored_rates(model, domain, requests=6000, draws=40, seed=5)
    expected = PROFILES[profile][domain]
    for j, (est, exp, n) in enumerate(zip(estimates, expected, reached, strict=True), start=1):
        assert n > 1500, (j, n)
        assert est == pytest.approx(exp, abs=0.035), (j, est, exp)


@pytest.mark.parametrize("burstiness", [0.0, DEFAULT_BURSTINESS])
def test_sample_mean_matches_expected_length(burstiness: float) -> None:
    model = AcceptanceModel(EAGLE, burstiness=burstiness, seed=3)
    draws = [model.sampler(r, "mtbench").draw(4) for r in range(20000)]
    mean_len = 1 + statistics.fmean(draws)
    assert mean_len == pytest.approx(VLLM_20780[4], abs=0.04)


def _lag1_autocorrelation(burstiness: float, request_correlation: float = 0.0) -> float:
    rates = PROFILES[EAGLE]["sharegpt"]
    profiles = {"p": {"sharegpt": DomainAcceptance(rates, None, request_correlation)}}
    model = AcceptanceModel("p", burstiness=burstiness, seed=7, profiles=profiles)
    series = []
    for r in range(600):
        sampler = model.sampler(r, "sharegpt")
        series.append([sampler.draw(5) for _ in range(30)])
    values = [v for s in series for v in s]
    mean = statistics.fmean(values)
    var = statistics.pvariance(values)
    pairs = [(s[i] - mean) * (s[i + 1] - mean) for s in series for i in range(len(s) - 1)]
    return statistics.fmean(pairs) / var


def test_burstiness_correlates_consecutive_verifies() -> None:
    assert _lag1_autocorrelation(DEFAULT_BURSTINESS) > 0.3
    assert abs(_lag1_autocorrelation(0.0)) < 0.05
    assert _lag1_autocorrelation(0.9) > _lag1_autocorrelation(DEFAULT_BURSTINESS)
    # A request's own level (issue 22) correlates its verifies even without bursts.
    assert _lag1_autocorrelation(0.0, 0.3) > 0.15


def test_same_seed_same_draws_independent_of_interleaving() -> None:
    steps = [random.Random(1).randint(0, 7) for _ in range(50)]
    a = AcceptanceModel(EAGLE, seed=42)
    b = AcceptanceModel(EAGLE, seed=42)
    # Request 3 drawn alone vs interleaved with other requests: same stream.
    s3 = a.sampler(3, "code")
    alone = [s3.draw(k) for k in steps]
    s3b, s9 = b.sampler(3, "code"), b.sampler(9, "code")
    interleaved = []
    for k in steps:
        s9.draw(7)
        interleaved.append(s3b.draw(k))
    assert alone == interleaved
    other_seed = AcceptanceModel(EAGLE, seed=43).sampler(3, "code")
    assert [other_seed.draw(k) for k in steps] != alone
    other_request = AcceptanceModel(EAGLE, seed=42).sampler(4, "code")
    assert [other_request.draw(k) for k in steps] != alone


def test_draw_zero_consumes_no_randomness() -> None:
    model = AcceptanceModel(EAGLE, seed=5, token_model=False)
    plain = model.sampler(0, None)
    with_zeros = model.sampler(0, None)
    seq = []
    for _ in range(20):
        assert with_zeros.draw(0) == 0
        seq.append(with_zeros.draw(5))
    assert seq == [plain.draw(5) for _ in range(20)]


@pytest.mark.parametrize("token_model", [False, True])
def test_acc_len_replay_contract(token_model: bool) -> None:
    model = AcceptanceModel(EAGLE, seed=0, token_model=token_model)
    acc = [3, 1, 5, 2, 4, 1, 1, 8]
    sampler = model.sampler(0, None, acc)
    assert isinstance(sampler, TokenAcceptanceSampler if token_model else AcceptanceSampler)
    # pos 0: acc 3 -> 2 accepted, emits 3 tokens -> pos 3.
    assert sampler.draw(4) == 2 and sampler.position == 3
    # pos 3: acc 2 -> 1 accepted -> pos 5.
    assert sampler.draw(4) == 1 and sampler.position == 5
    # A verify at steps 0 emits one token -> pos 6.
    assert sampler.draw(0) == 0 and sampler.position == 6
    # pos 6: acc 1 -> 0 accepted -> pos 7.
    assert sampler.draw(3) == 0 and sampler.position == 7
    # pos 7: acc 8 -> min(7, steps=2) -> pos 10, past the end.
    assert sampler.draw(2) == 2 and sampler.position == 10
    # Past the recorded tokens the profile takes over (still within 0..steps).
    tail = [sampler.draw(3) for _ in range(200)]
    assert all(0 <= n <= 3 for n in tail) and len(set(tail)) > 1
    # The per-token sampler keeps counting positions (its latent moves per token).
    assert sampler.position == (10 + sum(tail) + len(tail) if token_model else 10)


def test_acc_len_is_validated() -> None:
    model = AcceptanceModel(EAGLE, seed=0)
    with pytest.raises(AcceptanceError, match=r"acc_len\[1\] of request 4 must be an integer >= 1"):
        model.sampler(4, None, [2, 0, 3])


def test_trees_beat_chains_and_grow_with_node_budget() -> None:
    chain = AcceptanceModel(EAGLE, seed=0)
    for steps in (2, 3, 5):
        lengths = [
            AcceptanceModel(EAGLE, topk=4, num_draft_tokens=n, seed=0).expected_accept_length(
                None, steps
            )
            for n in (steps + 2, steps + 4, steps + 8)
        ]
        assert lengths[0] > chain.expected_accept_length(None, steps)
        assert lengths[0] < lengths[1] < lengths[2]
    # A node budget below the depth cuts the tree: depth 5 with 4 tokens is depth 3.
    cut = AcceptanceModel(EAGLE, topk=2, num_draft_tokens=4, seed=0)
    assert cut.expected_accept_length(None, 5) == pytest.approx(
        chain.expected_accept_length(None, 3)
    )
    # Wider branching at a depth never exceeds certainty, and the boost is discounted:
    # a 4-wide first depth at α = 0.69 passes well below 1 - 0.31^4.
    wide = AcceptanceModel(EAGLE, topk=4, num_draft_tokens=9, seed=0).depth_rates(None, 2)
    assert SHAREGPT[0] < wide[0] < 1 - (1 - SHAREGPT[0]) ** 4


def test_tree_sampler_matches_tree_expectation() -> None:
    model = AcceptanceModel(EAGLE, topk=4, num_draft_tokens=8, seed=2)
    draws = [model.sampler(r, None).draw(5) for r in range(20000)]
    assert all(0 <= n <= 5 for n in draws)
    assert 1 + statistics.fmean(draws) == pytest.approx(
        model.expected_accept_length(None, 5), abs=0.04
    )
    cut = AcceptanceModel(EAGLE, topk=2, num_draft_tokens=3, seed=2)
    assert max(cut.sampler(r, None).draw(6) for r in range(2000)) == 2


def test_custom_profiles_are_validated() -> None:
    custom = {"mine": {"sharegpt": [0.5, 0.6]}}
    model = AcceptanceModel("MINE", profiles=custom, seed=0)
    assert model.expected_accept_length(None, 3) == pytest.approx(1 + 0.5 + 0.3 + 0.18)
    with pytest.raises(AcceptanceError, match="position 2: expected"):
        AcceptanceModel("bad", profiles={"bad": {"x": [0.5, 1.2]}}, seed=0)


def test_every_builtin_drafter_has_a_profile() -> None:
    from specgov.simulator.catalog import Catalog

    for drafter in Catalog.load().drafters():
        model = AcceptanceModel(drafter.acceptance_profile, seed=0)
        assert 1.0 < model.expected_accept_length(None, 3) < 4.0


# ------------------------------------------------- acceptance as a verify sees it (issue 11)

# REFERENCE §3: replaying real per-token EAGLE-3 traces of chat data (one user).
CHAT_TRACE_REPLAY = {1: 1.66, 3: 2.25, 5: 2.48}
# Issue 11: trace replay below the per-verify sampler by 6-12 % at k=3, 8-21 % at k=5,
# 10-28 % at k=7 over four kinds of content.
REPORTED_GAP = {3: (0.06, 0.12), 5: (0.08, 0.21), 7: (0.10, 0.28)}


def _sampled_accept_length(
    model: AcceptanceModel, domain: str, steps: int, requests: int = 400, length: int = 150
) -> float:
    """Tokens per verify over requests of *length* output tokens each, as a trace replay
    counts them (pooled; the last verify emits at most the tokens left): a fixed length,
    not a fixed verify count, so a hard request weighs by the verifies it takes."""
    tokens = 0
    verifies = 0
    for r in range(requests):
        sampler = model.sampler(r, domain)
        left = length
        while left > 0:
            e = min(sampler.draw(steps) + 1, left)
            left -= e
            tokens += e
            verifies += 1
    return tokens / verifies


@pytest.mark.parametrize("steps", sorted(CHAT_TRACE_REPLAY))
def test_fit_check_sampled_chat_matches_reference_trace_replay(steps: int) -> None:
    # A fit check: BUILTIN_TOKEN_CORRELATION was fitted to these three figures.
    model = AcceptanceModel(EAGLE, seed=3)
    got = _sampled_accept_length(model, "chat", steps)
    assert got == pytest.approx(CHAT_TRACE_REPLAY[steps], rel=0.03)
    old = AcceptanceModel(EAGLE, seed=3, token_model=False)
    # The per-verify sampler misses at k >= 3 (REFERENCE: 2.46 and 2.86 at k=3, 5).
    if steps >= 3:
        assert _sampled_accept_length(old, "chat", steps) > CHAT_TRACE_REPLAY[steps] * 1.05


@pytest.mark.parametrize("domain", ["cnn", "gsm8k", "instructcoder"])
def test_gap_to_the_per_verify_model_is_in_the_reported_range(domain: str) -> None:
    # Not fitted to: the chat fit's ρ applied to the other three kinds of content.
    new = AcceptanceModel(EAGLE, seed=5)
    old = AcceptanceModel(EAGLE, seed=5, token_model=False)
    for steps, (low, high) in REPORTED_GAP.items():
        gap = 1.0 - _sampled_accept_length(new, domain, steps) / _sampled_accept_length(
            old, domain, steps
        )
        assert low - 0.01 <= gap <= high + 0.01, (domain, steps, gap)


def test_token_sampler_agrees_with_replaying_model_traces() -> None:
    # Two implementations of the same model: the engine's sampler and the fit's
    # vectorised trace generator (specgov.simulator.engine.acceptance_fit).
    from specgov.simulator.engine.acceptance_fit import model_accept_length

    model = AcceptanceModel("standalone-llama3.2-1b", seed=2)
    rates = PROFILES["standalone-llama3.2-1b"]["sharegpt"]
    h = BUILTIN_REQUEST_CORRELATION
    replayed = model_accept_length(
        rates, BUILTIN_TOKEN_CORRELATION, (1, 4, 7), lengths=(150,), request_correlation=h
    )
    for steps, want in replayed.items():
        got = _sampled_accept_length(model, "sharegpt", steps, requests=1000)
        assert got == pytest.approx(want, rel=0.02)


def test_run_sampler_agrees_with_replaying_run_traces() -> None:
    # The n-gram profile's runs (issue 22): the engine's sampler and the fit's generator.
    from specgov.simulator.engine.acceptance_fit import model_accept_length

    model = AcceptanceModel("ngram", seed=2)
    assert model.runs("code") and model.token_correlation("code") is None
    rates = PROFILES["ngram"]["instructcoder"]
    h = BUILTIN_RUN_REQUEST_CORRELATION
    replayed = model_accept_length(
        rates, 0.0, (1, 4, 7), lengths=(150,), request_correlation=h, runs=True, min_tokens=600_000
    )
    for steps, want in replayed.items():
        # Monte-Carlo noise: requests differ a lot (h), about 1 % here.
        got = _sampled_accept_length(model, "instructcoder", steps, requests=4000)
        assert got == pytest.approx(want, rel=0.04)


def test_token_sampler_acceptance_is_fixed_per_position() -> None:
    # Common random numbers by position: whatever steps visit position p, the verify
    # starting there sees the same acc_len (a long-k visit reveals min(acc-1, 7)).
    model = AcceptanceModel(EAGLE, seed=9)
    deep = model.sampler(4, "code")
    seen: dict[int, int] = {}
    for _ in range(300):
        pos = deep.position
        seen[pos] = deep.draw(7)
    shallow = model.sampler(4, "code")
    checked = 0
    for _ in range(300):
        pos = shallow.position
        n = shallow.draw(1)
        if pos in seen:
            assert n == min(seen[pos], 1)
            checked += 1
    assert checked > 50


def test_token_sampler_peek_is_the_next_draw() -> None:
    sampler = AcceptanceModel(EAGLE, seed=4).sampler(1, "sharegpt")
    schedule = [random.Random(2).randint(0, 7) for _ in range(300)]
    for k in schedule:
        peeked = sampler.peek(k)
        assert sampler.peek(k) == peeked  # peeking twice changes nothing
        assert sampler.draw(k) == peeked
    twin = AcceptanceModel(EAGLE, seed=4).sampler(1, "sharegpt")
    other = AcceptanceModel(EAGLE, seed=4).sampler(1, "sharegpt")
    for k in schedule:
        want = twin.peek(k)
        assert other.draw(k) == want
        twin.draw(k)


def test_per_verify_domains_keep_the_per_verify_sampler() -> None:
    model = AcceptanceModel(EAGLE, seed=0)
    assert model.token_correlation("mtbench") is None
    assert model.token_correlation("chat") == BUILTIN_TOKEN_CORRELATION
    assert AcceptanceModel(EAGLE, seed=0, token_model=False).token_correlation("chat") is None
    assert isinstance(model.sampler(0, "mtbench"), AcceptanceSampler)


def test_profile_entries_and_default_domain_are_validated() -> None:
    entry = DomainAcceptance((0.7, 0.6), 1.0)
    with pytest.raises(AcceptanceError, match=r"token_correlation must be a number in \[0, 1\)"):
        AcceptanceModel("p", seed=0, profiles={"p": {"chat": entry}})
    ok = {"p": {"chat": DomainAcceptance((0.7,), 0.3), "code": (0.8,)}}
    with pytest.raises(AcceptanceError, match="default_domain 'math' is not a domain"):
        AcceptanceModel("p", seed=0, profiles=ok, default_domain="math")
    model = AcceptanceModel("p", seed=0, profiles=ok, default_domain="code")
    assert model.resolve_domain(None) == "code"
    assert model.token_correlation("chat") == 0.3
    single = AcceptanceModel("q", seed=0, profiles={"q": {"default": (0.5,)}})
    assert single.resolve_domain(None) == "default"


def test_token_sampler_positions_survive_long_step_zero_stretches() -> None:
    # 1000 steps-0 verifies (four latent chunks) between two drafted ones: the request's
    # acceptance at a position does not depend on how it got there.
    model = AcceptanceModel(EAGLE, seed=6)
    a, b = model.sampler(2, "chat"), model.sampler(2, "chat")
    for _ in range(1000):
        a.draw(0)
    first = a.draw(7)
    while b.position < 1000:
        b.draw(1 if b.position < 998 else 0)
    assert b.position == 1000 and b.draw(7) == first
