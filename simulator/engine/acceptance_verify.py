"""Acceptance as the verifies of one fixed step see it: the informed oracle's E[tokens | k].

A profile's rates describe every output position alike, but a verify at step k does not
visit every position: it starts right after the previous verify ended. Under the
per-token latent (``TokenAcceptanceSampler``) the visited positions over-sample hard
stretches, and under exact-match runs (``acceptance_runs``) a verify either rides a run
or spends one token per verify in the gaps between runs; a request's own level (h) adds
to both. So the mean tokens per verify at step k is below
``1 + Σ_{i<=k} Π_{j<=i} α_j`` (measured with the samplers below, n-gram sharegpt at k=7:
1.59 against 2.71; EAGLE-3 sharegpt: 2.81 against 3.11), and by how much depends on k.

``verify_survival`` measures ``P(A >= j)`` at each step k the way the engine draws it:
fresh samplers of the model itself (request indices below zero, which no trace uses, so
the streams are the model's own and never a replayed request's), each verified at
step k until it has emitted ``VERIFY_SAMPLES[1]`` tokens. Every request emits the same
tokens, so a hard request takes more verifies and counts more, as in a running batch,
where hard requests stay longer (a request's level, h, makes that matter). Then
``1 + Σ_j P(A >= j)`` is the sampler's mean accept length at k, up to the Monte Carlo
error of ``VERIFY_SAMPLES`` (``tests/test_acceptance_verify.py`` checks it against
draws the estimate never saw).
Domains sampled per verify (``mtbench``, rates from live telemetry) draw a uniform
afresh at every verify, so the profile's rates are what verifies see, exactly, with no
sampling.

Deterministic (the model's seed and fixed request indices) and cached per model
parameters, so runs of one scenario share the estimate.
"""

from __future__ import annotations

from specgov.simulator.engine.acceptance import AcceptanceModel

__all__ = ["VERIFY_SAMPLES", "VerifyRates", "verify_survival"]

# (requests, output tokens per request) per estimate: 128k tokens, about 1 s per
# (domain, k); a request's level (h) dominates the error, so requests count most.
VERIFY_SAMPLES = (2000, 64)
_CACHE_MAX = 4096
_cache: dict[tuple[object, ...], tuple[float, ...]] = {}


def _key(model: AcceptanceModel, domain: str, steps: int) -> tuple[object, ...]:
    """Everything a sampler of *model*'s *domain* depends on (so equal keys, equal draws)."""
    return (
        model.profile_name,
        domain,
        model.conditional_rates(domain),
        model.token_correlation(domain),
        model.request_correlation(domain),
        model.runs(domain),
        model.topk,
        model.num_draft_tokens,
        model.sibling_discount,
        model.burstiness,
        model.seed,
        steps,
        VERIFY_SAMPLES,
    )


def verify_survival(
    model: AcceptanceModel, domain: str | None, steps: int, *, first_index: int = -1
) -> tuple[float, ...]:
    """P(A >= j), j = 1..steps, of a verify at *steps* drafts, measured with the model's
    samplers for request indices first_index, first_index - 1, ... (module doc)."""
    requests, tokens = VERIFY_SAMPLES
    counts = [0] * (steps + 1)  # counts[a]: verifies that accepted a drafts
    for r in range(requests):
        sampler = model.sampler(first_index - r, domain)
        while sampler.position < tokens:
            counts[sampler.draw(steps)] += 1
    total = sum(counts)
    out = []
    at_least = total
    for a in range(steps):
        at_least -= counts[a]
        out.append(at_least / total)
    return tuple(out)


class VerifyRates:
    """The informed oracle's view of an ``AcceptanceModel``: per-depth conditional pass
    rates as the verifies of each step see them (``depth_rates``, module doc)."""

    def __init__(self, model: AcceptanceModel) -> None:
        self._model = model

    def depth_rates(self, domain: str | None, steps: int) -> tuple[float, ...]:
        """a_j = P(A >= j) / P(A >= j-1) at *steps* drafts, so Π_{i<=j} a_i = P(A >= j)."""
        model = self._model
        key_domain = model.resolve_domain(domain)
        if model.token_correlation(key_domain) is None and not model.runs(key_domain):
            return model.depth_rates(key_domain, steps)  # per verify: exact
        key = _key(model, key_domain, steps)
        hit = _cache.get(key)
        if hit is not None:
            return hit
        surv = verify_survival(model, key_domain, steps)
        rates = []
        prev = 1.0
        for s in surv:
            rates.append(s / prev if prev > 0.0 else 0.0)
            prev = s
        out = tuple(rates)
        if len(_cache) >= _CACHE_MAX:
            _cache.clear()
        _cache[key] = out
        return out
