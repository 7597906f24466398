"""Acceptance as the verifies of one fixed step see it: the informed oracle's E[tokens | k].

A profile's rates describe every output position alike, but a verify at step k does not
visit every position: it starts right after the previous verify ended. Under the
per-token latent (``TokenAcceptanceSampler``) the visited positions over-sample hard
stretches, and under exact-match runs (``acceptance_runs``) a verify either rides a run
or spends one token per verify in the gaps between runs; a request's own level (h) adds
to both, and to the per-verify sampler too (a hard request takes more verifies for the
same tokens). So the mean tokens per verify at step k is below
``1 + Σ_{i<=k} Π_{j<=i} α_j`` (n-gram sharegpt at k=7: 1.42 against 2.71; EAGLE-3
sharegpt: 2.64 against 3.11; computed here and matched by the samplers' own draws in
``tests/test_acceptance_verify.py``), and by how much depends on k.

``verify_survival`` is ``P(A >= j)`` at each step k over the verifies of requests that
each emit ``VERIFY_TOKENS`` tokens from a fresh sampler, verified at k throughout (equal
tokens per request, so a hard request takes more verifies and counts more, as in a
running batch where hard requests stay longer). It is computed, not sampled: the
expected number of verifies starting at each output position, per state of the
sampler's own process there, propagated position by position (a verify accepting n
moves n + 1 positions):

* latent samplers (per token: AR(1) over positions; per verify: AR(1) over verifies,
  ``burstiness``): the state is the latent z on a grid of ``_GRID`` cells (mass per
  cell, the cell's share below each acceptance threshold taken as uniform within it),
  the AR(1) transition over m positions is N(ρ^m z, 1 - ρ^(2m));
* runs: the state is the position's acc_len (1 in a gap; L + 1 .. 2 along a run of
  length L), a free position starting a run with the request's q_r;

and a request's level b ~ N(0, 1) integrated by ``_LEVELS``-node Gauss-Hermite
quadrature. Deterministic (no draws at all), about 10 ms per (domain, k), cached per
model parameters, so runs of one scenario share it.
"""

from __future__ import annotations

import math

import numpy as np
from scipy.special import ndtri

from specgov.simulator.engine.acceptance import AcceptanceModel
from specgov.simulator.engine.acceptance_runs import RunProcess, run_process

__all__ = ["VERIFY_TOKENS", "VerifyRates", "verify_survival"]

# Output tokens per request whose verifies are pooled (each from a fresh sampler).
VERIFY_TOKENS = 64
# Latent cells on [-_Z, _Z] and Gauss-Hermite nodes over a request's level b: against
# 241 cells on [-7, 7] and 32 nodes, accept lengths differ by at most 1.5e-4 (relative).
_GRID = 121
_Z = 6.0
_LEVELS = 16
_RUN_TAIL = 1e-13  # run lengths past the survival's last value above this are dropped
_CACHE_MAX = 4096
_cache: dict[tuple[object, ...], tuple[float, ...]] = {}


def _key(model: AcceptanceModel, domain: str, steps: int) -> tuple[object, ...]:
    """Everything a sampler of *model*'s *domain* depends on (so equal keys, equal rates)."""
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
        steps,
        VERIFY_TOKENS,
    )


def _levels(h: float) -> tuple[np.ndarray, np.ndarray]:
    """Quadrature nodes and weights of a request's level b ~ N(0, 1) (one node at h = 0)."""
    if h <= 0.0:
        return np.zeros(1), np.ones(1)
    nodes, weights = np.polynomial.hermite_e.hermegauss(_LEVELS)
    return nodes, weights / weights.sum()


def _pooled(counts: np.ndarray, weights: np.ndarray) -> tuple[float, ...]:
    """P(A >= j), j = 1..steps, from counts[n, b] (expected verifies accepting n)."""
    per_n = counts @ weights
    total = float(per_n.sum())
    if total <= 0.0:
        return tuple(0.0 for _ in range(len(per_n) - 1))
    tail = np.cumsum(per_n[::-1])[::-1]  # tail[j] = sum_{n >= j}
    return tuple(float(v) / total for v in tail[1:])


def _latent_counts(model: AcceptanceModel, domain: str, steps: int) -> np.ndarray:
    """Expected verifies accepting n (rows) per request level (columns): latent samplers."""
    rho_token = model.token_correlation(domain)
    per_token = rho_token is not None
    rho = float(rho_token) if rho_token is not None else model.burstiness
    h = model.request_correlation(domain)
    surv = np.cumprod(np.asarray(model.depth_rates(domain, steps), dtype=float))
    surv = np.concatenate([surv, np.zeros(steps - len(surv))])  # a tree's depth cut
    levels, _ = _levels(h)
    z = np.linspace(-_Z, _Z, _GRID)
    dz = float(z[1] - z[0])
    # u = Φ(√h b + √(1-h) z) < S_i  <=>  z < (Φ⁻¹(S_i) - √h b) / √(1-h)
    with np.errstate(divide="ignore"):
        cut = (ndtri(surv)[:, None] - math.sqrt(h) * levels[None, :]) / math.sqrt(1.0 - h)
    below = np.clip((cut[:, None, :] - (z[None, :, None] - dz / 2)) / dz, 0.0, 1.0)
    ge = np.concatenate([np.ones((1, *below.shape[1:])), below, np.zeros_like(below[:1])])
    masks = ge[:-1] - ge[1:]  # masks[n, g, b]: share of cell g accepting exactly n
    kernels = {}
    for m in range(1, steps + 2) if per_token else (1,):
        r = rho**m
        s = math.sqrt(max(1.0 - r * r, 1e-12))
        k = np.exp(-0.5 * ((z[None, :] - r * z[:, None]) / s) ** 2)
        kernels[m] = (k / k.sum(axis=1, keepdims=True)).T  # [to, from]
    start = np.exp(-0.5 * z * z)
    mass = np.zeros((VERIFY_TOKENS, _GRID, len(levels)))
    mass[0] = (start / start.sum())[:, None]
    counts = np.zeros((steps + 1, len(levels)))
    for t in range(VERIFY_TOKENS):
        m_t = mass[t]
        for n in range(steps + 1):
            part = m_t * masks[n]
            counts[n] += part.sum(axis=0)
            if t + n + 1 < VERIFY_TOKENS:
                mass[t + n + 1] += kernels[n + 1 if per_token else 1] @ part
    return counts


def _run_counts(proc: RunProcess, cap: int, steps: int) -> np.ndarray:
    """Expected verifies accepting n per request level: the run model (module doc)."""
    levels, _ = _levels(proc.request_correlation)
    counts = np.zeros((steps + 1, len(levels)))
    alive = np.flatnonzero(proc.survival > _RUN_TAIL)
    if proc.mean_run <= 0.0 or proc.start <= 0.0 or alive.size == 0:
        counts[0] = VERIFY_TOKENS  # every position has acc_len 1
        return counts
    tail = proc.survival[: int(alive[-1]) + 1]
    p_len = tail - np.append(tail[1:], 0.0)  # P(L = l), l = 1..len(tail)
    top = len(tail) + 1  # the largest acc_len
    q = np.array([proc.request_start(float(b)) for b in levels])
    # A free position resolved: a gap (acc_len 1) or a run's first position (acc_len L+1).
    free = np.zeros((top + 1, len(levels)))
    free[1] = 1.0 - q
    free[2 : top + 1] = q[None, :] * p_len[:, None]
    # The position after a free one: free again, or a run's second position (acc_len L).
    after_free = free * (1.0 - q + q * p_len[0])[None, :]
    after_free[2:top] += q[None, :] * p_len[1:, None]
    mass = np.zeros((VERIFY_TOKENS, top + 1, len(levels)))
    mass[0] = free
    for t in range(VERIFY_TOKENS):
        m_t = mass[t]
        counts[:cap] += m_t[1 : cap + 1]
        counts[cap] += m_t[cap + 1 :].sum(axis=0)
        if t + 1 < VERIFY_TOKENS:  # a gap: one token, then a free position
            mass[t + 1] += m_t[1][None, :] * free
        for a in range(2, min(cap + 1, top) + 1):  # the rest of the run, then past a free one
            if t + a < VERIFY_TOKENS:
                mass[t + a] += m_t[a][None, :] * after_free
        land = t + cap + 1  # a run longer than the cap: cap + 1 tokens, still in it
        if land < VERIFY_TOKENS and cap + 2 <= top:
            mass[land] += m_t[cap + 2][None, :] * free
            mass[land][2 : top - cap] += m_t[cap + 3 :]
    return counts


def verify_survival(model: AcceptanceModel, domain: str | None, steps: int) -> tuple[float, ...]:
    """P(A >= j), j = 1..steps, over the verifies at *steps* drafts of requests of
    ``VERIFY_TOKENS`` tokens each, computed from *model*'s samplers' processes (module doc)."""
    key = model.resolve_domain(domain)
    if steps <= 0:
        return ()
    h = model.request_correlation(key)
    if model.runs(key):
        # The sampler's run model, built as AcceptanceModel builds it (deterministic).
        proc = run_process(model.conditional_rates(key), h)
        cap = min(steps, (model.num_draft_tokens or steps + 1) - 1)
        counts = _run_counts(proc, cap, steps)
    else:
        counts = _latent_counts(model, key, steps)
    return _pooled(counts, _levels(h)[1])


class VerifyRates:
    """The informed oracle's view of an ``AcceptanceModel``: per-depth conditional pass
    rates as the verifies of each step see them (``depth_rates``, module doc)."""

    def __init__(self, model: AcceptanceModel) -> None:
        self._model = model

    def depth_rates(self, domain: str | None, steps: int) -> tuple[float, ...]:
        """a_j = P(A >= j) / P(A >= j-1) at *steps* drafts, so Π_{i<=j} a_i = P(A >= j)."""
        model = self._model
        key_domain = model.resolve_domain(domain)
        key = _key(model, key_domain, steps)
        hit = _cache.get(key)
        if hit is not None:
            return hit
        rates = []
        prev = 1.0
        for s in verify_survival(model, key_domain, steps):
            rates.append(s / prev if prev > 0.0 else 0.0)
            prev = s
        out = tuple(rates)
        if len(_cache) >= _CACHE_MAX:
            _cache.clear()
        _cache[key] = out
        return out
