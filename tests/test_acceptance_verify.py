"""Acceptance as verifies at a fixed step see it: the informed oracle's expected tokens."""

from __future__ import annotations

import pytest

from specgov.simulator.engine.acceptance import AcceptanceModel, expected_accept_length_from_rates
from specgov.simulator.engine.acceptance_verify import VERIFY_SAMPLES, VerifyRates, verify_survival


def _empirical_accept_length(model: AcceptanceModel, domain: str, steps: int) -> float:
    """Mean tokens per verify (bonus included) over draws the estimate never saw: requests
    of equal output, as a running batch holds them (hard ones take more verifies)."""
    requests, tokens = VERIFY_SAMPLES
    emitted = verifies = 0
    for r in range(requests):
        sampler = model.sampler(-(10**7) - r, domain)
        while sampler.position < tokens:
            emitted += sampler.draw(steps) + 1
            verifies += 1
    return emitted / verifies


def _oracle_accept_length(model: AcceptanceModel, domain: str, steps: int) -> float:
    """E[tokens | steps] of a request with tokens to spare, as the informed oracle sees it
    (``InformedOracle.bind_engine`` wraps the engine's model in ``VerifyRates``)."""
    return expected_accept_length_from_rates(VerifyRates(model).depth_rates(domain, steps), steps)


@pytest.mark.parametrize(
    ("profile", "domain", "topk", "ndt"),
    [
        ("ngram", "sharegpt", 1, None),  # exact-match runs, h = 0.3
        ("ngram", "gsm8k", 1, None),
        ("eagle3-llama3.1-8b", "sharegpt", 1, None),  # per-token latent, h = 0.1
        ("eagle3-llama3.1-8b", "mtbench", 1, None),  # per verify: the rates, exactly
        ("eagle3-llama3.1-8b", "cnn", 2, 8),  # a tree
    ],
)
@pytest.mark.parametrize("steps", [1, 3, 7])
def test_oracle_expected_accept_length_is_the_samplers_mean(
    profile: str, domain: str, topk: int, ndt: int | None, steps: int
) -> None:
    model = AcceptanceModel(profile, seed=5, topk=topk, num_draft_tokens=ndt)
    oracle = _oracle_accept_length(model, domain, steps)
    empirical = _empirical_accept_length(model, domain, steps)
    # Two independent estimates of VERIFY_SAMPLES draws each: measured spread of one is
    # up to 0.8 % (n-gram sharegpt at k = 7, h = 0.3), so 3.5 % is about 3 sigma of the gap.
    assert oracle == pytest.approx(empirical, rel=0.035), (oracle, empirical)
    if model.runs(domain) or model.token_correlation(domain) is not None:
        # And it is not the all-position formula the oracle used before (too high).
        margin = 1.02 if steps == 1 else 1.05
        assert model.expected_accept_length(domain, steps) > empirical * margin


def test_run_domains_are_far_below_the_all_position_formula() -> None:
    model = AcceptanceModel("ngram", seed=5)
    # Measured with the samplers: n-gram sharegpt at k = 7 rides runs or crawls gaps.
    assert _oracle_accept_length(model, "sharegpt", 7) < 0.7 * model.expected_accept_length(
        "sharegpt", 7
    )


def test_verify_rates_are_deterministic_and_per_verify_domains_exact() -> None:
    a = VerifyRates(AcceptanceModel("ngram", seed=5)).depth_rates("cnn", 3)
    b = verify_survival(AcceptanceModel("ngram", seed=5), "cnn", 3)
    reach = 1.0
    for rate, surv in zip(a, b, strict=True):
        reach *= rate
        assert reach == pytest.approx(surv)
    model = AcceptanceModel("eagle3-llama3.1-8b", seed=5)
    assert VerifyRates(model).depth_rates("mtbench", 5) == model.depth_rates("mtbench", 5)
    assert VERIFY_SAMPLES[0] * VERIFY_SAMPLES[1] >= 10_000
