"""Acceptance model: how many drafts the target accepts per verify, per request.

Data (REFERENCE.md §3). Each profile maps a content domain to per-position
*conditional* acceptance rates α_1..α_7, α_j = P(draft j accepted | drafts < j
accepted), measured for Llama-3.1-8B-Instruct on H100:

* ``eagle3-llama3.1-8b``: EAGLE-3 head; cnn, gsm8k, instructcoder, sharegpt as
  measured, plus ``mtbench`` derived from vLLM issue 20780's acceptance lengths
  E[L(K)] for K = 2..7 (2.36, 2.79, 3.08, 3.32, 3.46, 3.54). With
  E[L(K)] = 1 + Σ_{i≤K} Π_{j≤i} α_j, the differences give Π_{j≤i} α_j exactly for
  i = 3..7, hence α_3..α_7. Only α_1 + α_1·α_2 = 1.36 is fixed for the first two;
  we take α_1 = α_2 (= 0.7689, close to every measured α_1, α_2). The derived
  α_5 = 0.83, α_6 = 0.58 zig-zag: that is the noise of six separate benchmark runs,
  kept so the published lengths are reproduced exactly.
* ``ngram``: SGLang's n-gram drafter, as measured (no mtbench), sampled as runs.
* ``standalone-llama3.2-1b``: no published per-position data; EAGLE-3's rates
  scaled by 0.9 (a general 1B model drafting for an 8B one accepts less than a
  head trained on the target's hidden states). An estimate.

Positions beyond the last listed rate reuse it. Domain aliases: code ->
instructcoder, chat/conv -> sharegpt, rag -> cnn, math -> gsm8k, mt-bench ->
mtbench; ``None`` -> sharegpt (general chat traffic is the commonest default).

Trees (topk > 1): ``steps`` is the tree depth and ``num_draft_tokens - 1`` the node
budget. The approximation: one node per depth forms the main path (depth is cut to
the budget); the remaining nodes widen the shallowest depths first, up to ``topk``
siblings per depth (SGLang keeps the highest cumulative-score nodes, which are the
shallow ones). With ``w`` siblings at a depth whose chain rate is α the depth passes
with 1 - (1-α)(1-γα)^(w-1), γ = 0.35: later siblings are much less likely to be the
target's token than the top-1 draft (1-(1-α)^w would make a 4-wide EAGLE-3 depth
pass 99 % of the time; with γ it is 87 %, in line with top-4 vs top-1 accuracy of
draft heads).

Burstiness. Accepted runs cluster (copying, boilerplate), so consecutive verifies
of one request are positively correlated. Each request carries a hidden
"predictability" state z_t, a stationary Gaussian AR(1) process,
z_t = ρ z_{t-1} + sqrt(1-ρ²) ε_t with ρ = ``burstiness``; each verify maps
u_t = Φ(z_t) through the profile's survival function (accepted = number of
positions i ≤ steps with u_t < Π_{j≤i} α_j). Because u_t is exactly uniform at
every verify, the per-position conditional rates of the profile are reproduced
exactly on average for any ρ, while low-u stretches (long accepted runs) and
high-u stretches persist for about 1/(1-ρ) verifies. This is a continuous
version of a sticky hot/cold regime that needs no fitted regime rates to keep the
mixture calibrated. ρ = 0 gives i.i.d. draws. The default 0.6 is an estimate (no
public per-request series): it gives a lag-1 autocorrelation of accepted counts
of about 0.5 (0.44 at ρ = 0.5, 0.69 at ρ = 0.75).

Acceptance as a verify sees it (issue 11). The measured per-position rates above
are averages over every output position; a verify starts right after the previous
one ended, i.e. right after a rejection, and rejections cluster at hard tokens, so
replaying real per-token traces gives lower accept lengths than sampling the
all-position rates per verify (REFERENCE §3, chat data: trace replay 1.66 / 2.25 /
2.48 at k = 1 / 3 / 5 where the per-verify sampler gives 1.69 / 2.46 / 2.86). Domains
whose rates are all-position averages are therefore sampled per *token*
(``TokenAcceptanceSampler``): each output position t carries a latent
z_t = ρ z_{t-1} + sqrt(1-ρ²) ε_t (a stationary Gaussian AR(1) over positions,
ρ = ``token_correlation``) and a verify starting at t accepts the number of positions
i with Φ(z_t) < Π_{j≤i} α_j. Every position then has exactly the profile's all-position
rates (what the per-position measurements average over), while the positions a verify
visits over-sample hard stretches (a hard stretch takes more verifies per token), which
is the visited-position effect. It is a Markov model over per-token acceptance: the
acceptance at t depends on the past only through z_{t-1}.

Requests differ (issue 22): request r draws b_r ~ N(0, 1) and each latent above becomes
√h·b_r + √(1-h)·z_t (h = ``request_correlation``; built-in ``BUILTIN_REQUEST_CORRELATION``
assumed, ``fit-acceptance`` fits it): still N(0, 1), so the rates hold on average, while
some requests accept more all through (the TPOT tail). ``ngram`` domains are sampled as
exact-match runs (``acceptance_runs``): the same rates, the accepted positions in runs.

ρ for the built-in all-position profiles is ``BUILTIN_TOKEN_CORRELATION`` = 0.38,
*fitted* (with h = 0.1) to REFERENCE §3's chat replay (1.66 / 2.25 / 2.48): the model
gives 1.64 / 2.23 / 2.50 (max error 1.3 %; ``tests/test_acceptance.py`` checks it;
0.45 with h = 0 before issue 22). Other EAGLE-3 domains and standalone use the same ρ:
an *assumption* (no public per-token traces for them); issue 11's reported gaps for
the four EAGLE-3 domains (6-12 % at k=3, 8-21 % at k=5, 10-28 % at k=7 below the
per-verify sampler) are checked as sources not used in the fit. ``mtbench``
(derived from vLLM's measured accept lengths, which are what verifies saw) and rates
measured from live telemetry are per-verify rates and keep the per-verify sampler.
``specgov fit-acceptance`` fits ρ, h (and the rates) to a user's own per-token trace
(``specgov.simulator.engine.acceptance_fit``).

Common random numbers: each request's sampler owns a ``random.Random`` seeded from
(seed, request_index) only, so different policies replaying the same trace see the
same random stream for the same request whatever the batching order.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

import numpy as np
from scipy.signal import lfilter
from scipy.special import ndtr

from specgov.policies.common.errors import SpecgovError
from specgov.policies.common.validation import is_int, is_real
from specgov.simulator.engine.acceptance_cold import ColdDrafter
from specgov.simulator.engine.acceptance_runs import RunProcess, run_acc_len, run_process

__all__ = [
    "BUILTIN_REQUEST_CORRELATION",
    "BUILTIN_RUN_REQUEST_CORRELATION",
    "BUILTIN_TOKEN_CORRELATION",
    "DEFAULT_BURSTINESS",
    "DEFAULT_DOMAIN",
    "DEFAULT_SIBLING_DISCOUNT",
    "DOMAIN_ALIASES",
    "MAX_STEPS",
    "PROFILES",
    "AcceptanceError",
    "AcceptanceModel",
    "AcceptanceSampler",
    "DomainAcceptance",
    "TokenAcceptanceSampler",
    "expected_accept_length_from_rates",
    "tree_depth_rates",
]

MAX_STEPS = 64
DEFAULT_BURSTINESS = 0.6
DEFAULT_SIBLING_DISCOUNT = 0.35
DEFAULT_DOMAIN = "sharegpt"
# Fitted to REFERENCE §3's chat trace replay (see module doc); assumed for other domains.
BUILTIN_TOKEN_CORRELATION = 0.38
# Per-request heterogeneity of the built-in profiles: assumed (module doc).
BUILTIN_REQUEST_CORRELATION = 0.1
BUILTIN_RUN_REQUEST_CORRELATION = 0.3
_INV_SQRT2 = 1.0 / math.sqrt(2.0)


class AcceptanceError(SpecgovError, ValueError):
    """Unknown profile or domain, or an invalid acceptance setting."""


# vLLM issue 20780 (EAGLE-3, Llama-3.1-8B, H100, batch 1, MT-bench): E[L(K)].
VLLM_20780_ACCEPT_LENGTHS: Mapping[int, float] = MappingProxyType(
    {2: 2.36, 3: 2.79, 4: 3.08, 5: 3.32, 6: 3.46, 7: 3.54}
)


def _rates_from_accept_lengths(lengths: Mapping[int, float]) -> tuple[float, ...]:
    """α_1..α_7 from E[L(K)], K = 2..7, with α_1 = α_2 (see module doc)."""
    first_two = lengths[2] - 1.0  # α1 + α1·α2 = α + α²
    a = (-1.0 + math.sqrt(1.0 + 4.0 * first_two)) / 2.0
    rates = [a, a]
    prev = a * a
    for k in range(3, 8):
        reach = lengths[k] - lengths[k - 1]  # Π_{j≤k} α_j
        rates.append(reach / prev)
        prev = reach
    return tuple(rates)


_EAGLE3: dict[str, tuple[float, ...]] = {
    "cnn": (0.69, 0.67, 0.66, 0.68, 0.71, 0.74, 0.75),
    "gsm8k": (0.72, 0.67, 0.65, 0.65, 0.65, 0.68, 0.67),
    "instructcoder": (0.72, 0.73, 0.75, 0.78, 0.80, 0.82, 0.82),
    "sharegpt": (0.69, 0.66, 0.69, 0.73, 0.76, 0.79, 0.80),
    "mtbench": _rates_from_accept_lengths(VLLM_20780_ACCEPT_LENGTHS),
}
_NGRAM: dict[str, tuple[float, ...]] = {
    "cnn": (0.30, 0.77, 0.80, 0.81, 0.82, 0.83, 0.84),
    "gsm8k": (0.16, 0.61, 0.65, 0.68, 0.71, 0.70, 0.70),
    "instructcoder": (0.65, 0.93, 0.94, 0.95, 0.95, 0.96, 0.96),
    "sharegpt": (0.35, 0.84, 0.87, 0.90, 0.91, 0.92, 0.92),
}
STANDALONE_SCALE = 0.9
_STANDALONE = {d: tuple(STANDALONE_SCALE * a for a in r) for d, r in _EAGLE3.items()}

PROFILES: Mapping[str, Mapping[str, tuple[float, ...]]] = MappingProxyType(
    {
        "eagle3-llama3.1-8b": MappingProxyType(_EAGLE3),
        "ngram": MappingProxyType(_NGRAM),
        "standalone-llama3.2-1b": MappingProxyType(_STANDALONE),
    }
)

DOMAIN_ALIASES: Mapping[str, str] = MappingProxyType(
    {
        "code": "instructcoder",
        "chat": "sharegpt",
        "conv": "sharegpt",
        "rag": "cnn",
        "math": "gsm8k",
        "mt-bench": "mtbench",
    }
)


@dataclass(frozen=True)
class DomainAcceptance:
    """One domain of a profile: its rates and how to sample them.

    ``rates`` are per-position conditional rates α_1..; ``token_correlation`` is None
    when they are per-verify rates (what verifies saw: the per-verify sampler with the
    model's burstiness) and ρ in [0, 1) when they are all-position averages (the
    per-token sampler, see module doc); ``request_correlation`` is h, the share of the
    latent's variance that is the request's own; ``runs``: exact-match runs
    (``specgov.simulator.engine.acceptance_runs``) instead of the latent.
    """

    rates: tuple[float, ...]
    token_correlation: float | None = None
    request_correlation: float = 0.0
    runs: bool = False


# Built-in domains whose rates are per-verify; built-in profiles sampled as runs.
_PER_VERIFY_DOMAINS = frozenset({"mtbench"})
_RUN_PROFILES = frozenset({"ngram"})

ProfileEntry = Sequence[float] | DomainAcceptance


def builtin_domain(profile: str, domain: str) -> DomainAcceptance:
    """How the built-in *profile*'s *domain* is sampled (rates, correlations, runs)."""
    rates = tuple(PROFILES[profile][domain])
    if profile in _RUN_PROFILES:
        return DomainAcceptance(rates, None, BUILTIN_RUN_REQUEST_CORRELATION, runs=True)
    rho = None if domain in _PER_VERIFY_DOMAINS else BUILTIN_TOKEN_CORRELATION
    return DomainAcceptance(rates, rho, BUILTIN_REQUEST_CORRELATION)


def _rate_at(rates: Sequence[float], position: int) -> float:
    """α at 1-based *position*; positions past the data reuse the last rate."""
    return rates[position - 1] if position <= len(rates) else rates[-1]


def tree_depth_rates(
    rates: Sequence[float],
    steps: int,
    topk: int,
    num_draft_tokens: int | None,
    sibling_discount: float = DEFAULT_SIBLING_DISCOUNT,
) -> tuple[float, ...]:
    """Per-depth pass rates of a draft shape (a chain when topk == 1); see module doc."""
    if topk == 1 or num_draft_tokens is None:
        return tuple(_rate_at(rates, i) for i in range(1, steps + 1))
    budget = num_draft_tokens - 1
    depth = min(steps, budget)
    extra = budget - depth
    out = []
    for d in range(1, depth + 1):
        add = min(topk - 1, extra)
        extra -= add
        a = _rate_at(rates, d)
        out.append(1.0 - (1.0 - a) * (1.0 - sibling_discount * a) ** add)
    return tuple(out)


def expected_accept_length_from_rates(rates: Sequence[float], steps: int) -> float:
    """E[L] = 1 + Σ_{i≤steps} Π_{j≤i} α_j (tokens per verify, bonus included)."""
    total = 1.0
    reach = 1.0
    for i in range(1, steps + 1):
        reach *= _rate_at(rates, i) if rates else 0.0
        total += reach
    return total


def _check_rates(profile: str, domain: str, rates: object) -> tuple[float, ...]:
    form = "a non-empty list of conditional acceptance rates in [0, 1]"
    if not isinstance(rates, Sequence) or isinstance(rates, str) or not rates:
        raise AcceptanceError(f"profile '{profile}' domain '{domain}': expected {form}")
    out = []
    for i, a in enumerate(rates):
        if not is_real(a) or not 0.0 <= a <= 1.0:
            raise AcceptanceError(
                f"profile '{profile}' domain '{domain}' position {i + 1}: expected {form}, "
                f"got {a!r}"
            )
        out.append(float(a))
    return tuple(out)


class _RecordedSampler:
    """What both samplers share: ``acc_len`` replay, the position, the cold drafter."""

    __slots__ = ("_acc", "_cold", "_n_acc", "_pos")

    _acc: list[int] | None
    _cold: ColdDrafter
    _n_acc: int
    _pos: int

    @property
    def position(self) -> int:
        """Output tokens accounted for so far: by ``acc_len`` replay (``AcceptanceSampler``),
        replayed or sampled (``TokenAcceptanceSampler``)."""
        return self._pos

    def go_stale(self, penalty: float, verifies: int) -> None:
        """The drafter's state went stale (step-0 draft-extend skipped): see ``ColdDrafter``."""
        _check_stale(penalty, verifies)
        self._cold.start(float(penalty), verifies)

    def _recorded(self, steps: int, advance: bool) -> int:
        """HOT. The recorded draw at the current position, moved past when *advance*
        (the verify emits it plus one); -1 past the end of ``acc_len``."""
        if steps < 0 or steps > MAX_STEPS:
            raise AcceptanceError(f"steps must be in 0..{MAX_STEPS}, got {steps!r}")
        pos = self._pos
        if pos < self._n_acc:
            n: int = self._acc[pos] - 1  # type: ignore[index]
            if n > steps:
                n = steps
            if advance:
                self._pos = pos + n + 1
            return n
        return -1


class AcceptanceSampler(_RecordedSampler):
    """One request's accepted-draft stream. The engine calls ``draw`` once per verify.

    Replay contract: with ``acc_len`` (the acceptance length, bonus included, that a
    verify starting at each output position would reach) ``draw(steps)`` returns
    ``min(acc_len[pos] - 1, steps)`` and advances ``pos`` by the tokens that verify
    emits (return value + 1). A verify at steps 0 must also call ``draw(0)`` to keep
    the position aligned (it returns 0 and advances by 1). Past the end of
    ``acc_len`` (the request generated more than was recorded) draws come from the
    profile. ``draw(0)`` never consumes randomness.
    """

    __slots__ = (
        "_innov",
        "_next_u",
        "_next_z",
        "_rho",
        "_rng",
        "_scale",
        "_shift",
        "_tables",
        "_z",
    )

    def __init__(
        self,
        tables: list[list[float]],
        rng: random.Random,
        burstiness: float,
        acc_len: list[int] | None,
        cold_key: str = "",
        request_correlation: float = 0.0,
    ) -> None:
        self._cold = ColdDrafter(cold_key)
        self._tables = tables
        self._rng = rng
        self._rho = burstiness
        self._innov = math.sqrt(1.0 - burstiness * burstiness)
        # Stationary start, so the first verify already has the right marginal.
        self._z = rng.gauss(0.0, 1.0) if burstiness > 0.0 else 0.0
        h = request_correlation  # the request's level, drawn only when used (h = 0: as before)
        self._shift = math.sqrt(h) * rng.gauss(0.0, 1.0) if h > 0.0 else 0.0
        self._scale = math.sqrt(1.0 - h)
        self._acc = acc_len
        self._n_acc = len(acc_len) if acc_len is not None else 0
        self._pos = 0
        # The next verify's uniform (and AR state), drawn early by ``peek``; -1: none yet.
        self._next_u = -1.0
        self._next_z = 0.0

    def _uniform(self) -> tuple[float, float]:
        """The next verify's uniform and AR state (the request's level applied)."""
        rho = self._rho
        if rho > 0.0:
            z = rho * self._z + self._innov * self._rng.gauss(0.0, 1.0)
            return 0.5 * (1.0 + math.erf((self._shift + self._scale * z) * _INV_SQRT2)), z
        if self._shift != 0.0:
            x = self._shift + self._scale * self._rng.gauss(0.0, 1.0)
            return 0.5 * (1.0 + math.erf(x * _INV_SQRT2)), self._z
        return self._rng.random(), self._z

    def draw(self, steps: int) -> int:
        """HOT. Accepted drafts (bonus excluded), 0..steps, for this request's next verify."""
        n = self._recorded(steps, advance=True)
        if n >= 0:
            return n
        if steps == 0:
            if self._next_u >= 0.0:
                # A peeked uniform belongs to this verify (see peek): spend it.
                self._next_u = -1.0
                self._z = self._next_z
            return 0
        u = self._next_u
        if u >= 0.0:
            # peek() already drew this verify's uniform: consume that one.
            self._next_u = -1.0
            self._z = self._next_z
        else:
            u, self._z = self._uniform()
        surv = self._tables[steps]
        n = 0
        while n < steps and u < surv[n]:
            n += 1
        if self._cold.left > 0 and self._cold.rejects_first(consume=True):
            return 0
        return n

    def peek(self, steps: int) -> int:
        """What the next ``draw(steps)`` will return, without consuming anything.

        For the clairvoyant oracle (``specgov.simulator.replay.oracle``). The verify's uniform
        does not depend on ``steps``, so it is drawn once, kept, and used by the next
        ``draw``: ``draw(k)`` returns what ``peek(k)`` said, and a peeked sampler draws
        the same uniforms in the same order as one never peeked.

        One difference, only for a sampler that is peeked: a verify at steps 0 spends
        the peeked uniform (each verify is one step of the predictability process),
        where an unpeeked ``draw(0)`` consumes nothing. Without it a clairvoyant chooser
        that saw a bad draw and verified without drafts would face that same draw at
        every later verify and never draft again. Samplers that are never peeked (every
        policy but the oracle) behave exactly as before.
        """
        n = self._recorded(steps, advance=False)
        if n >= 0:
            return n
        if steps == 0:
            return 0
        u = self._next_u
        if u < 0.0:
            u, self._next_z = self._uniform()
            self._next_u = u
        if self._cold.left > 0 and self._cold.rejects_first(consume=False):
            return 0
        surv = self._tables[steps]
        n = 0
        while n < steps and u < surv[n]:
            n += 1
        return n


def _check_stale(penalty: float, verifies: int) -> None:
    if not is_real(penalty) or not 0 <= penalty <= 1:
        raise AcceptanceError(f"cold penalty must be a fraction in [0, 1], got {penalty!r}")
    if not is_int(verifies) or verifies < 1:
        raise AcceptanceError(f"cold recovery verifies must be an integer >= 1, got {verifies!r}")


# Latent positions generated at a time by TokenAcceptanceSampler (vectorised: cheaper
# than one Python-level Gaussian per token on the engine's hot path).
_TOKEN_CHUNK = 256


class TokenAcceptanceSampler(_RecordedSampler):
    """One request's acceptance as a verify sees it: a latent per output position.

    Same contract as :class:`AcceptanceSampler` (``draw``, ``peek``, ``position``,
    ``acc_len`` replay). Position t's latent z_t follows the AR(1) of the module doc, so
    a request's acceptance at each output position is fixed whatever steps visit it
    (common random numbers by position, like a trace). ``draw(steps)`` reads Φ(z_t) at the
    current position against the survival table and moves on by the tokens the verify
    emits (accepted + 1); ``draw(0)`` emits one token and so moves by one position;
    ``peek`` consumes nothing. The latents are generated ``_TOKEN_CHUNK`` positions at a
    time with NumPy, from a generator seeded by the request's own ``random.Random``.
    """

    __slots__ = (
        "_base",
        "_c",
        "_caps",
        "_np",
        "_rho",
        "_run_start",
        "_runs",
        "_scale",
        "_shift",
        "_tables",
        "_u",
        "_z_last",
    )

    def __init__(
        self,
        tables: list[list[float]],
        rng: random.Random,
        token_correlation: float,
        acc_len: list[int] | None,
        cold_key: str = "",
        request_correlation: float = 0.0,
        runs: tuple[RunProcess, list[int]] | None = None,
    ) -> None:
        """*runs*: the run model and the deepest draft each steps can reach (tree
        depth cut): positions then hold acc_len values, not uniforms."""
        self._tables = tables
        self._np = np.random.default_rng(rng.getrandbits(64))
        self._rho = token_correlation
        self._c = math.sqrt(1.0 - token_correlation * token_correlation)
        self._acc = acc_len
        self._n_acc = len(acc_len) if acc_len is not None else 0
        self._pos = 0
        self._base = -1  # position of self._u[0]; -1: no latent generated yet
        self._u: list[float] = []
        self._z_last = 0.0
        self._cold = ColdDrafter(cold_key)
        h = runs[0].request_correlation if runs is not None else request_correlation
        offset = float(self._np.standard_normal()) if h > 0.0 or runs is not None else 0.0
        self._shift = math.sqrt(h) * offset
        self._scale = math.sqrt(1.0 - h)
        self._runs = runs[0] if runs is not None else None
        self._caps = runs[1] if runs is not None else []
        self._run_start = self._runs.request_start(offset) if self._runs is not None else 0.0

    def _extend(self) -> None:
        """The latents of the next ``_TOKEN_CHUNK`` positions (the first chunk starts
        where ``acc_len`` replay ends, stationary; later ones continue the AR(1))."""
        if self._runs is not None:
            # Whole cycles: a run never continues across chunks.
            self._base = self._n_acc if self._base < 0 else self._base + len(self._u)
            # acc_len values (ints) stand where the latent's uniforms would.
            self._u = [
                float(v) for v in run_acc_len(self._runs, self._run_start, self._np, _TOKEN_CHUNK)
            ]
            return
        eps = self._np.standard_normal(_TOKEN_CHUNK)
        x = self._c * eps
        a = [1.0, -self._rho]
        if self._base < 0:
            x[0] = eps[0]  # z_0 ~ N(0, 1)
            z = lfilter([1.0], a, x)
            self._base = self._n_acc
        else:
            z = lfilter([1.0], a, x, zi=[self._rho * self._z_last])[0]
            self._base += len(self._u)
        self._z_last = float(z[-1])
        self._u = ndtr(self._shift + self._scale * z if self._shift else z).tolist()

    def _u_at(self, pos: int) -> float:
        # Steps-0 verifies move on without reading: several chunks may be due.
        while self._base < 0 or pos - self._base >= len(self._u):
            self._extend()
        return self._u[pos - self._base]

    def _count(self, steps: int, u: float) -> int:
        if self._runs is not None:  # u is the position's acc_len
            n = int(u) - 1
            cap = self._caps[steps]
            return n if n < cap else cap
        surv = self._tables[steps]
        n = 0
        while n < steps and u < surv[n]:
            n += 1
        return n

    def draw(self, steps: int) -> int:
        """HOT. Accepted drafts (bonus excluded), 0..steps, for this request's next verify."""
        n = self._recorded(steps, advance=True)
        if n >= 0:
            return n
        pos = self._pos
        n = self._count(steps, self._u_at(pos)) if steps > 0 else 0
        if steps > 0 and self._cold.left > 0 and self._cold.rejects_first(consume=True):
            n = 0
        self._pos = pos + n + 1
        return n

    def peek(self, steps: int) -> int:
        """What the next ``draw(steps)`` will return, without consuming anything."""
        n = self._recorded(steps, advance=False)
        if n >= 0:
            return n
        if steps == 0:
            return 0
        if self._cold.left > 0 and self._cold.rejects_first(consume=False):
            return 0
        return self._count(steps, self._u_at(self._pos))


class AcceptanceModel:
    """Per-domain acceptance for one drafter profile and draft shape."""

    def __init__(
        self,
        profile_name: str,
        *,
        topk: int = 1,
        num_draft_tokens: int | None = None,
        burstiness: float = DEFAULT_BURSTINESS,
        seed: int,
        profiles: Mapping[str, Mapping[str, ProfileEntry]] | None = None,
        sibling_discount: float = DEFAULT_SIBLING_DISCOUNT,
        token_model: bool = True,
        default_domain: str | None = None,
    ) -> None:
        """*profiles* maps profile -> domain -> rates (per-verify rates) or a
        :class:`DomainAcceptance`; None: the built-in ``PROFILES``, whose all-position
        domains use the per-token sampler. ``token_model=False`` samples every domain per
        verify, with no per-request level and no runs (the pre-issue-11 model, for
        comparisons). *default_domain* is the domain
        a request without one uses (None: ``DEFAULT_DOMAIN``, or the profile's only
        domain)."""
        builtin = profiles is None
        source: Mapping[str, Mapping[str, ProfileEntry]]
        source = PROFILES if profiles is None else profiles
        by_name = {str(k).lower(): k for k in source}
        if not isinstance(profile_name, str) or profile_name.strip().lower() not in by_name:
            raise AcceptanceError(
                f"unknown acceptance profile {profile_name!r}; valid: {', '.join(sorted(source))}"
            )
        key = by_name[profile_name.strip().lower()]
        domains = source[key]
        if not isinstance(domains, Mapping) or not domains:
            raise AcceptanceError(f"profile '{key}': expected a mapping of domain -> rates")
        self._rates: dict[str, tuple[float, ...]] = {}
        self._rho: dict[str, float | None] = {}
        self._spread: dict[str, float] = {}
        self._runs: dict[str, RunProcess] = {}
        for d, entry in domains.items():
            got = builtin_domain(str(key), str(d)) if builtin else entry
            self._load_domain(str(key), str(d), got, token_model)
        if default_domain is None:
            self._default = DEFAULT_DOMAIN if len(self._rates) > 1 else next(iter(self._rates))
        elif isinstance(default_domain, str) and default_domain.strip().lower() in self._rates:
            self._default = default_domain.strip().lower()
        else:
            raise AcceptanceError(
                f"default_domain {default_domain!r} is not a domain of profile '{key}'; "
                f"valid: {', '.join(sorted(self._rates))}"
            )
        if not is_int(topk) or topk < 1:
            raise AcceptanceError(f"topk must be an integer >= 1, got {topk!r}")
        if topk > 1 and (not is_int(num_draft_tokens) or num_draft_tokens < 2):
            raise AcceptanceError(
                f"a tree (topk={topk}) needs num_draft_tokens, an integer >= 2; "
                f"got {num_draft_tokens!r}"
            )
        if isinstance(burstiness, bool) or not isinstance(burstiness, int | float):
            raise AcceptanceError(f"burstiness must be a number in [0, 1), got {burstiness!r}")
        if not 0.0 <= burstiness < 1.0:
            raise AcceptanceError(f"burstiness must be in [0, 1), got {burstiness!r}")
        if not is_int(seed):
            raise AcceptanceError(f"seed must be an integer, got {seed!r}")
        if not 0.0 <= sibling_discount <= 1.0:
            raise AcceptanceError(f"sibling_discount must be in [0, 1], got {sibling_discount!r}")
        self.profile_name: str = str(key)
        self.topk = topk
        self.num_draft_tokens = num_draft_tokens if topk > 1 else None
        self.burstiness = float(burstiness)
        self.seed = seed
        self.sibling_discount = float(sibling_discount)
        self._tables: dict[str, list[list[float]]] = {}

    def _load_domain(self, key: str, d: str, entry: ProfileEntry, token_model: bool) -> None:
        """Validate one domain's entry and keep its rates, ρ, h and run model."""
        name = d.lower()
        if not isinstance(entry, DomainAcceptance):
            self._rates[name] = _check_rates(key, d, entry)
            self._rho[name] = None
            self._spread[name] = 0.0
            return
        self._rates[name] = _check_rates(key, d, entry.rates)
        rho, h = entry.token_correlation, entry.request_correlation
        for what, v in (("token_correlation", rho), ("request_correlation", h)):
            if v is not None and (not is_real(v) or not 0 <= v < 1):
                raise AcceptanceError(
                    f"profile '{key}' domain '{d}': {what} must be a number "
                    f"in [0, 1){' or None' if what[0] == 't' else ''}, got {v!r}"
                )
        self._rho[name] = None if rho is None or not token_model else float(rho)
        self._spread[name] = float(h) if token_model else 0.0
        if entry.runs and token_model:
            self._runs[name] = run_process(self._rates[name], float(h))

    @property
    def domains(self) -> tuple[str, ...]:
        return tuple(sorted(self._rates))

    def resolve_domain(self, domain: str | None) -> str:
        """The profile domain used for *domain* (aliases and the None default applied)."""
        if domain is None:
            key = self._default
        elif isinstance(domain, str):
            key = domain.strip().lower()
            if key not in self._rates:
                key = DOMAIN_ALIASES.get(key, key)
        else:
            raise AcceptanceError(f"domain must be a string or None, got {domain!r}")
        if key not in self._rates:
            aliases = ", ".join(f"{a}->{t}" for a, t in sorted(DOMAIN_ALIASES.items()))
            raise AcceptanceError(
                f"unknown domain {domain!r} for acceptance profile '{self.profile_name}'; "
                f"valid: {', '.join(self.domains)} (aliases: {aliases}; None -> {self._default})"
            )
        return key

    def conditional_rates(self, domain: str | None) -> tuple[float, ...]:
        """The profile's per-position conditional rates α_1.. for *domain* (chain)."""
        return self._rates[self.resolve_domain(domain)]

    def token_correlation(self, domain: str | None) -> float | None:
        """ρ of *domain*'s per-token sampler; None: sampled per verify or in runs."""
        return self._rho[self.resolve_domain(domain)]

    def request_correlation(self, domain: str | None) -> float:
        """h of *domain*: the share of acceptance variance that is per request."""
        return self._spread[self.resolve_domain(domain)]

    def runs(self, domain: str | None) -> bool:
        """Whether *domain* is sampled as exact-match runs (``acceptance_runs``)."""
        return self.resolve_domain(domain) in self._runs

    def depth_rates(self, domain: str | None, steps: int) -> tuple[float, ...]:
        """Per-depth pass rates for this shape at *steps* (tree widening applied)."""
        self._check_steps(steps)
        return tree_depth_rates(
            self.conditional_rates(domain),
            steps,
            self.topk,
            self.num_draft_tokens,
            self.sibling_discount,
        )

    def expected_accept_length(self, domain: str | None, steps: int) -> float:
        """E[L]: tokens per verify with *steps* drafts (tree depth), bonus included."""
        rates = self.depth_rates(domain, steps)
        return expected_accept_length_from_rates(rates, len(rates))

    def sampler(
        self, request_index: int, domain: str | None, acc_len: Sequence[int] | None = None
    ) -> AcceptanceSampler | TokenAcceptanceSampler:
        """The deterministic accepted-draft stream of request *request_index*."""
        if not is_int(request_index):
            raise AcceptanceError(f"request_index must be an integer, got {request_index!r}")
        key = self.resolve_domain(domain)
        tables = self._tables_for(key)
        replay: list[int] | None = None
        if acc_len is not None:
            replay = list(acc_len)
            for i, v in enumerate(replay):
                if not is_int(v) or v < 1:
                    raise AcceptanceError(
                        f"acc_len[{i}] of request {request_index} must be an integer >= 1 "
                        f"(tokens per verify, bonus included), got {v!r}"
                    )
        # A string seed goes through SHA-512 in random.seed: independent streams per
        # request, stable across processes and Python hash seeds.
        rng = random.Random(f"specgov-acceptance:{self.seed}:{request_index}")
        cold_key = f"specgov-acceptance-cold:{self.seed}:{request_index}"
        rho = self._rho[key]
        h = self._spread[key]
        runs = self._runs.get(key)
        if runs is not None:  # runs reach the tree's depth cut; widening is not modelled
            depth = [min(s, (self.num_draft_tokens or s + 1) - 1) for s in range(MAX_STEPS + 1)]
            return TokenAcceptanceSampler(tables, rng, 0.0, replay, cold_key, h, (runs, depth))
        if rho is not None:
            return TokenAcceptanceSampler(tables, rng, rho, replay, cold_key, h)
        return AcceptanceSampler(tables, rng, self.burstiness, replay, cold_key, h)

    # ------------------------------------------------------------------ internals

    @staticmethod
    def _check_steps(steps: int) -> None:
        if not is_int(steps) or not 0 <= steps <= MAX_STEPS:
            raise AcceptanceError(f"steps must be an integer in 0..{MAX_STEPS}, got {steps!r}")

    def _tables_for(self, domain: str) -> list[list[float]]:
        """Survival lists indexed by steps: table[s][i] = P(accepted >= i+1), length s."""
        tables = self._tables.get(domain)
        if tables is not None:
            return tables
        rates = self._rates[domain]
        if self.topk == 1:
            # One shared list: chain rates do not depend on the step count.
            surv = []
            reach = 1.0
            for i in range(1, MAX_STEPS + 1):
                reach *= _rate_at(rates, i)
                surv.append(reach)
            tables = [surv] * (MAX_STEPS + 1)
        else:
            tables = []
            for s in range(MAX_STEPS + 1):
                depth = tree_depth_rates(
                    rates, s, self.topk, self.num_draft_tokens, self.sibling_discount
                )
                surv = []
                reach = 1.0
                for a in depth:
                    reach *= a
                    surv.append(reach)
                # Depth cut by the node budget: deeper positions are never reached.
                surv.extend([0.0] * (s - len(surv)))
                tables.append(surv)
        self._tables[domain] = tables
        return tables
