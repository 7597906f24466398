"""Acceptance as exact-match runs: a match continues or the run ends (issue 22 §1).

An n-gram drafter proposes the tokens that followed the current suffix somewhere
earlier in the context. While the output copies that earlier text, every draft is
accepted and the match moves on; when the copy ends nothing matches until a new one
starts. So its per-token acceptance trace is made of *runs*: a run of length L starting
at position p has acc_len L+1, L, ..., 2 at p..p+L-1 (acc_len: tokens a verify starting
there emits, bonus included), and positions between runs have acc_len 1.

The model is a renewal process per request. A position outside a run starts one with
probability q (else its acc_len is 1); a run's length L has survival T_j = P(L >= j).
Both follow from a profile's all-position conditional rates α_1..α_J alone: with
S_j = Π_{i<=j} α_i = P(acc_len >= j+1), a run of length L holds (L-j+1)^+ positions
with acc_len >= j+1, so S_j - S_{j+1} = T_j / E[cycle], hence
T_j = (S_j - S_{j+1}) / (S_1 - S_2); beyond J the tail is geometric with ratio α_J (so
α_j = α_J there, as the profile says), and q makes the share of positions inside runs
S_1 = E[L] / (E[L] + (1-q)/q). The rates are therefore reproduced exactly; what the
model adds is where those accepted positions sit: in runs, which a verify either rides
(many tokens) or misses (one token per verify in the gaps). That is why sampling the
rates per verify or per token with a short correlation overstates n-gram accept length.

Per-request heterogeneity (``request_correlation`` h): request r starts runs with its
own q_r = Φ((Φ⁻¹(q) - √h·b_r) / √(1-h)), b_r ~ N(0, 1), the same latent construction
as the per-token model (``specgov.simulator.engine.acceptance``); q is solved so that the mean
over requests of their run share is still S_1 (Gauss-Hermite quadrature over b).

Pure: NumPy and SciPy only, generators passed in, no state between calls.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import brentq
from scipy.special import ndtr, ndtri

from specgov.policies.common.errors import SpecgovError

__all__ = [
    "RUN_LENGTH_CAP",
    "RunProcess",
    "RunsError",
    "run_acc_len",
    "run_process",
]

# Longest run generated (a run past it is cut: acc_len never matters beyond MAX_STEPS+1,
# and a 0.96 tail has a 4096-long run with probability 1e-73).
RUN_LENGTH_CAP = 4096
# Largest rate used for the run tail and for α_2 (a rate of 1 would make runs endless).
_MAX_RATE = 0.999
_HERMITE_NODES = 48


class RunsError(SpecgovError, ValueError):
    """Rates or a heterogeneity the run model cannot use; the message says why."""


@dataclass(frozen=True)
class RunProcess:
    """The run model of one domain: run-length survival and the run-start probability."""

    survival: np.ndarray  # T_j = P(L >= j), j = 1..RUN_LENGTH_CAP (index j - 1)
    mean_run: float  # E[L], positions
    start: float  # q: P(a position outside a run starts one), before heterogeneity
    request_correlation: float  # h in [0, 1)

    def request_start(self, offset: float) -> float:
        """q_r of a request whose latent offset is *offset* (b_r, standard normal)."""
        h = self.request_correlation
        if h <= 0.0 or self.start <= 0.0 or self.start >= 1.0:
            return self.start
        return float(ndtr((ndtri(self.start) - math.sqrt(h) * offset) / math.sqrt(1.0 - h)))


def _run_share(q: float, mean_run: float) -> float:
    """Share of positions inside runs when a free position starts one with prob. q."""
    if q <= 0.0:
        return 0.0
    return mean_run / (mean_run + (1.0 - q) / q)


def run_process(rates: Sequence[float], request_correlation: float = 0.0) -> RunProcess:
    """The run model whose all-position conditional rates are *rates* (module doc)."""
    if not rates or any(not 0.0 <= a <= 1.0 for a in rates):
        raise RunsError(f"rates must be a non-empty list in [0, 1], got {list(rates)!r}")
    h = float(request_correlation)
    if not 0.0 <= h < 1.0:
        raise RunsError(f"request_correlation must be in [0, 1), got {request_correlation!r}")
    a = [min(float(x), _MAX_RATE) for x in rates]
    if len(a) == 1:
        a.append(a[0])  # one rate: a geometric run length with that ratio
    s = np.cumprod(a)  # S_1..S_J
    s_next = np.append(s[1:], s[-1] * a[-1])  # S_2..S_{J+1}
    s1 = float(s[0])
    surv = np.zeros(RUN_LENGTH_CAP)
    if s1 <= 0.0:
        return RunProcess(surv, 0.0, 0.0, h)
    head = (s - s_next) / (s[0] - s[1]) if s[0] > s[1] else np.ones_like(s)
    # A run model needs T non-increasing; rates that say otherwise (α_{j+1} well above
    # α_j) are held at the previous value.
    head = np.minimum.accumulate(np.clip(head, 0.0, 1.0))
    j_last = len(head)
    surv[:j_last] = head
    tail = np.arange(1, RUN_LENGTH_CAP - j_last + 1)
    surv[j_last:] = head[-1] * a[-1] ** tail
    mean_run = float(surv.sum())
    if s1 >= 1.0:
        return RunProcess(surv, mean_run, 1.0, h)
    q0 = 1.0 / (1.0 + mean_run * (1.0 - s1) / s1)
    if h <= 0.0:
        return RunProcess(surv, mean_run, q0, h)
    nodes, weights = np.polynomial.hermite_e.hermegauss(_HERMITE_NODES)
    weights = weights / weights.sum()

    def share_gap(x: float) -> float:
        q_r = ndtr((x - math.sqrt(h) * nodes) / math.sqrt(1.0 - h))
        shares = [_run_share(float(v), mean_run) for v in q_r]
        return float(np.dot(weights, shares)) - s1

    x = brentq(share_gap, -12.0, 12.0, xtol=1e-10)
    return RunProcess(surv, mean_run, float(ndtr(x)), h)


def run_acc_len(
    proc: RunProcess, start: float, rng: np.random.Generator, positions: int
) -> list[int]:
    """acc_len of at least *positions* positions (whole cycles: gap then run), with
    run-start probability *start* (one request's q_r)."""
    if start <= 0.0 or proc.mean_run <= 0.0:
        return [1] * positions
    cycle = (1.0 - start) / start + proc.mean_run
    m = max(1, math.ceil(positions / cycle) + 1)
    out: list[int] = []
    while len(out) < positions:
        gaps = rng.geometric(start, m) - 1
        v = rng.random(m)
        # L = #{j: T_j > v}: the survival is decreasing, so search it negated.
        runs = np.maximum(1, np.searchsorted(-proc.survival, -v, side="left"))
        long_gap = np.flatnonzero(gaps >= positions)
        if long_gap.size:
            # A very hard request: emit that gap's first positions and stop; a geometric
            # gap is memoryless, so the next chunk's fresh gap continues it exactly.
            cut = int(long_gap[0])
            gaps, runs = gaps[: cut + 1], runs[: cut + 1]
            gaps[cut] = positions
            runs[cut] = 0
            m_used = cut + 1
        else:
            m_used = m
        sizes = gaps + runs
        total = int(sizes.sum())
        first = np.cumsum(sizes) - sizes
        cyc = np.repeat(np.arange(m_used), sizes)
        offset = np.arange(total) - first[cyc]
        in_run = offset >= gaps[cyc]
        acc = np.where(in_run, runs[cyc] + 1 - (offset - gaps[cyc]), 1)
        out.extend(acc.tolist())
    return out
