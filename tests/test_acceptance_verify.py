"""Acceptance as verifies at a fixed step see it: the informed oracle's expected tokens.

``verify_survival`` is computed from the samplers' processes, not sampled; these tests
hold it to the samplers' own draws (seeded, request indices the engine never uses) and
to the cases where the answer is known exactly.
"""

from __future__ import annotations

import pytest

from specgov.simulator.engine.acceptance import (
    AcceptanceModel,
    DomainAcceptance,
    expected_accept_length_from_rates,
)
from specgov.simulator.engine.acceptance_verify import VERIFY_TOKENS, VerifyRates, verify_survival

_EAGLE_SHAREGPT = (0.69, 0.66, 0.69, 0.73, 0.76, 0.79, 0.80)
_NGRAM_SHAREGPT = (0.35, 0.84, 0.87, 0.90, 0.91, 0.92, 0.92)


def _sampled_accept_length(model: AcceptanceModel, domain: str, steps: int, requests: int) -> float:
    """Mean tokens per verify (bonus included) over the samplers' draws: requests of
    ``VERIFY_TOKENS`` tokens each, verified at *steps* throughout (tokens counted here:
    a per-verify sampler's ``position`` only follows a replayed acc_len)."""
    emitted = verifies = 0
    for r in range(requests):
        sampler = model.sampler(-(10**7) - r, domain)
        done = 0
        while done < VERIFY_TOKENS:
            done += sampler.draw(steps) + 1
            verifies += 1
        emitted += done
    return emitted / verifies


def _computed_accept_length(model: AcceptanceModel, domain: str, steps: int) -> float:
    """E[tokens | steps] of a request with tokens to spare, as the informed oracle sees it
    (``InformedOracle.bind_engine`` wraps the engine's model in ``VerifyRates``)."""
    return expected_accept_length_from_rates(VerifyRates(model).depth_rates(domain, steps), steps)


def _one_domain(entry: DomainAcceptance, **shape: int) -> AcceptanceModel:
    return AcceptanceModel("p", seed=3, profiles={"p": {"d": entry}}, **shape)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "entry",
    [
        DomainAcceptance(_EAGLE_SHAREGPT, 0.0, 0.0),  # every position independent
        _EAGLE_SHAREGPT,  # per verify, i.i.d. at burstiness 0 (below)
    ],
    ids=["per-token-iid", "per-verify-iid"],
)
def test_independent_draws_see_the_profile_rates_exactly(entry: object) -> None:
    # With independent draws every verify sees the profile's rates (Wald's identity):
    # the computation must give them back, up to its grid (1e-3).
    model = AcceptanceModel("p", seed=3, profiles={"p": {"d": entry}}, burstiness=0.0)  # type: ignore[dict-item]
    for steps in (1, 3, 7):
        want = model.expected_accept_length("d", steps)
        assert _computed_accept_length(model, "d", steps) == pytest.approx(want, rel=1e-3)


@pytest.mark.parametrize(
    ("entry", "shape"),
    [
        (DomainAcceptance(_EAGLE_SHAREGPT, 0.38, 0.0), {}),  # latent over positions
        (DomainAcceptance(_NGRAM_SHAREGPT, None, 0.0, runs=True), {}),  # exact-match runs
        (
            DomainAcceptance(_NGRAM_SHAREGPT, None, 0.0, runs=True),
            {"topk": 2, "num_draft_tokens": 4},
        ),
        (DomainAcceptance(_EAGLE_SHAREGPT, 0.38, 0.0), {"topk": 2, "num_draft_tokens": 8}),
    ],
    ids=["latent", "runs", "runs-depth-cut", "latent-tree"],
)
def test_visited_positions_match_the_samplers_draws(
    entry: DomainAcceptance, shape: dict[str, int]
) -> None:
    # No per-request level: 1000 requests' draws scatter 0.3 % (latent) to 0.5 % (runs)
    # (standard deviation over 8 seeds, measured), so 2 % is 4 sigma; the all-position
    # formula is higher by more than 2 %.
    model = _one_domain(entry, **shape)
    for steps in (2, 6):
        sampled = _sampled_accept_length(model, "d", steps, requests=1000)
        computed = _computed_accept_length(model, "d", steps)
        assert computed == pytest.approx(sampled, rel=0.02), (steps, computed, sampled)
        assert model.expected_accept_length("d", steps) > sampled * 1.02


@pytest.mark.parametrize(
    ("profile", "domain"),
    [
        ("ngram", "sharegpt"),  # runs, h = 0.3
        ("eagle3-llama3.1-8b", "sharegpt"),  # per-token latent, h = 0.1
        ("eagle3-llama3.1-8b", "mtbench"),  # per verify with burstiness, h = 0.1
    ],
)
def test_builtin_profiles_with_request_levels_match_the_samplers_draws(
    profile: str, domain: str
) -> None:
    # A request's level dominates the draws' error: 1500 requests' draws scatter 0.9 %
    # (EAGLE-3) to 1.2 % (n-gram) (standard deviation over 6 seeds, measured), so 3.5 %
    # is about 3 sigma.
    model = AcceptanceModel(profile, seed=5)
    sampled = _sampled_accept_length(model, domain, 5, requests=1500)
    assert _computed_accept_length(model, domain, 5) == pytest.approx(sampled, rel=0.035)


def test_runs_are_far_below_the_all_position_formula() -> None:
    model = AcceptanceModel("ngram", seed=5)
    # n-gram sharegpt at k = 7: a verify rides a run or crawls a gap (computed 1.43 vs 2.71).
    computed = _computed_accept_length(model, "sharegpt", 7)
    assert computed < 0.6 * model.expected_accept_length("sharegpt", 7)


def test_verify_rates_are_deterministic_cached_and_per_step() -> None:
    a = VerifyRates(AcceptanceModel("ngram", seed=5)).depth_rates("cnn", 3)
    b = verify_survival(AcceptanceModel("ngram", seed=9), "rag", 3)  # no draws: seed-free
    reach = 1.0
    for rate, surv in zip(a, b, strict=True):
        reach *= rate
        assert reach == pytest.approx(surv, rel=1e-12)
    model = AcceptanceModel("eagle3-llama3.1-8b", seed=5, topk=4, num_draft_tokens=16)
    rates = VerifyRates(model)
    first = {(d, k): rates.depth_rates(d, k) for d in model.domains for k in range(8)}
    assert first == {(d, k): rates.depth_rates(d, k) for d in model.domains for k in range(8)}
    assert all(len(r) == k for (_, k), r in first.items())
    assert all(0.0 <= a <= 1.0 for r in first.values() for a in r)
