"""Per-slot, per-draft-position conditional acceptance, learned from tier histograms.

What the engine reports (:class:`~specgov.policies.common.types.TierStat`): for one
(slot, steps) tier, ``accepted_hist[j]`` requests accepted exactly ``j`` of ``steps``
drafts. Draft position ``i`` (1-based) is *reached* by a request that accepted at
least ``i - 1`` drafts and *passed* by one that accepted at least ``i``; a request that
accepted all ``steps`` drafts says nothing about positions beyond ``steps``, and one
rejected at position ``j`` says nothing about positions after ``j`` (censoring). So
each position is estimated only from the requests that reached it:
``alpha_i = passed_i / reached_i`` (the conditional rate P(draft i accepted | drafts
< i accepted), the quantity REFERENCE.md §3 tabulates).

Memory and change detection
    Counts decay exponentially with time (``half_life_s``, the *slow* estimate the
    policy uses). A second copy decays fast (``fast_half_life_s``). Time comes only
    from snapshot window bounds, never a clock. After each window the detector
    compares, per position, the recent evidence (the fast counts) with the older
    evidence (slow minus fast: a non-negative weighted sum that puts its weight on
    older windows, nearly independent of the fast counts) with a two-proportion
    z-test; the squared z over positions with enough data on both sides is compared
    with a chi-square quantile (Wilson-Hilferty). On a detected shift the slot keeps
    only the window in which it was detected: old evidence is dropped and the estimate
    follows a content shift (code -> chat) within a few windows instead of a few
    half-lives. The test runs per slot and on counts pooled over slots (a content
    shift moves every slot; pooling gives the test more power), and the variance is
    inflated by ``change_overdispersion`` because acceptance is bursty (accepted runs
    cluster), which would otherwise make binomial tests raise false alarms.

Uncertainty and sharing
    Each position has a Beta posterior. The pooled posterior (all slots) starts from
    the global prior ``Beta(prior_mean * prior_strength, (1 - prior_mean) *
    prior_strength)``; a slot's posterior starts from the pooled mean with strength
    ``min(pool_strength, pooled pseudo-count)``, so a slot with little data shrinks to
    the pooled estimate (acceptance depends on content far more than on batch size).
    ``lower`` is a one-sided normal-approximation credible bound, ``mean - lower_z *
    sd``, clipped to [0, mean].

Positions never observed
    A position is *observed* when its pooled (decayed) trials reach ``min_trials``;
    trials can only fall with the position, so the observed positions are a prefix
    ``1..m``. Beyond ``m`` the estimate is extrapolated conservatively, on a falling
    trend: position ``m + j`` gets a Beta prior centred on ``cap * ratio ** j``
    (strength ``prior_strength``), updated with the few pooled trials it has, its mean
    capped at that centre. ``cap`` is the lower bound of position ``m`` (of the lower
    of positions ``m - 1`` and ``m`` once ``m >= 3``), never above the last observed
    bound; ``ratio`` is ``extrapolation_decay`` (0.95) or the observed trend when
    that falls faster. Measured rates fall by up to ~5 % a position (gsm8k .72 .67
    .65) and then flatten or rise (REFERENCE.md §3): extrapolating flat overstated
    gsm8k's E[L(7)] by 10 % after k = 1, the trend keeps E[L(k)] within 1 % above the
    truth on every catalog profile (tests/test_acceptance_estimator.py) at the price
    of under-stating rising profiles (up to 17 % at k = 7 after k = 1), which the
    policy corrects by probing longer chains. The lower bound there keeps the flat
    prior centred on position ``m``'s bound (as wide as before: it sets how far a
    probe may jump), clipped to the mean. With nothing observed at all, the global
    prior (flat).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Final

from specgov.policies.common.codec import from_data
from specgov.policies.common.types import PolicyTypeError, TierStatsSnapshot
from specgov.policies.common.validation import all_real, check_fields, check_int, check_real
from specgov.policies.daemon.estimators._common import is_int, is_real

__all__ = [
    "ACCEPTANCE_STATE_VERSION",
    "AcceptanceConfig",
    "AcceptanceEstimate",
    "AcceptanceState",
    "SlotAcceptance",
    "acceptance_estimate",
    "initial_acceptance_state",
    "update_acceptance",
]

ACCEPTANCE_STATE_VERSION: Final = 1

# What an optional time is, in the states' messages.
_OPT_REAL: Final = "None or a finite number"


# --------------------------------------------------------------------------- helpers


def _check_version(owner: str, data: Mapping[str, Any], supported: int) -> None:
    version = data.get("version")
    if not is_int(version) or version != supported:
        raise PolicyTypeError(
            f"{owner}.from_dict: key 'version': unsupported state version {version!r}; "
            f"this build reads version {supported}"
        )


# --------------------------------------------------------------------------- config


@dataclass(frozen=True, slots=True)
class AcceptanceConfig:
    """Knobs of the acceptance estimator (documented defaults)."""

    # Positions estimated (SGLang's adaptive candidates go up to 7 by default).
    max_steps: int = 7
    # Memory of the estimate the policy uses; a minute of traffic is thousands of
    # requests at any batch size, plenty for a tight posterior.
    half_life_s: float = 60.0
    # Memory of the change detector's "recent" side: a few windows.
    fast_half_life_s: float = 3.0
    # Global prior per position (EAGLE-3 measures 0.65-0.82, n-gram 0.16-0.96).
    prior_mean: float = 0.6
    prior_strength: float = 2.0
    # Pseudo-trials a slot borrows from the pooled (all slots) estimate.
    pool_strength: float = 20.0
    # One-sided normal quantile of the conservative bound (1.2816: 90 %).
    lower_z: float = 1.2816
    # Pooled decayed trials below which a position counts as unobserved.
    min_trials: float = 20.0
    # Detector threshold as a normal quantile of the false-alarm level (4: ~3e-5).
    change_z: float = 4.0
    # Trials a position needs on both the recent and the old side to be tested.
    change_min_trials: float = 30.0
    # Variance inflation for bursty (over-dispersed) acceptance.
    change_overdispersion: float = 2.0
    # Unobserved positions: each one's rate is at most this times the previous one's
    # (the observed trend when that falls faster). 0.95 is the measured profiles'
    # steepest sustained fall (gsm8k .72 -> .65 over two positions, REFERENCE.md §3);
    # 1.0 would extrapolate flat, which overstated gsm8k's E[L(7)] by 10 % after k = 1.
    extrapolation_decay: float = 0.95

    def __post_init__(self) -> None:
        if not is_int(self.max_steps) or not 1 <= self.max_steps <= 64:
            raise PolicyTypeError(
                f"AcceptanceConfig.max_steps: expected an int in 1..64, got {self.max_steps!r}"
            )
        positive = ("half_life_s", "fast_half_life_s", "prior_strength", "change_overdispersion")
        check_fields(
            "AcceptanceConfig", self, positive, check_real, error=PolicyTypeError, positive=True
        )
        non_negative = ("pool_strength", "lower_z", "min_trials", "change_min_trials", "change_z")
        check_fields(
            "AcceptanceConfig", self, non_negative, check_real, error=PolicyTypeError, minimum=0.0
        )
        if not is_real(self.prior_mean) or not 0.0 < self.prior_mean < 1.0:
            raise PolicyTypeError(
                f"AcceptanceConfig.prior_mean: expected a number in (0, 1), got {self.prior_mean!r}"
            )
        if not is_real(self.extrapolation_decay) or not 0.0 < self.extrapolation_decay <= 1.0:
            raise PolicyTypeError(
                f"AcceptanceConfig.extrapolation_decay: expected a number in (0, 1], "
                f"got {self.extrapolation_decay!r}"
            )
        if self.fast_half_life_s >= self.half_life_s:
            raise PolicyTypeError(
                f"AcceptanceConfig.fast_half_life_s: expected < half_life_s={self.half_life_s}, "
                f"got {self.fast_half_life_s!r}"
            )


# ---------------------------------------------------------------------------- state


@dataclass(frozen=True, slots=True)
class SlotAcceptance:
    """Decayed counts of one slot; index ``i - 1`` holds draft position ``i``."""

    slot: int
    reached: tuple[float, ...]
    passed: tuple[float, ...]
    fast_reached: tuple[float, ...]
    fast_passed: tuple[float, ...]
    changes: int = 0
    last_change_s: float | None = None

    def __post_init__(self) -> None:
        check_int("SlotAcceptance.slot", self.slot, error=PolicyTypeError, minimum=0)
        n = len(self.reached)
        for name in ("reached", "passed", "fast_reached", "fast_passed"):
            value = getattr(self, name)
            if not isinstance(value, tuple) or len(value) != n or not all_real(value, minimum=0.0):
                raise PolicyTypeError(
                    f"SlotAcceptance.{name} (slot {self.slot}): expected a tuple of {n} "
                    f"finite numbers >= 0, got {value!r}"
                )
        where = f"(slot {self.slot})"
        check_int(f"SlotAcceptance.changes {where}", self.changes, error=PolicyTypeError, minimum=0)
        if self.last_change_s is not None:
            check_real(
                f"SlotAcceptance.last_change_s {where}",
                self.last_change_s,
                error=PolicyTypeError,
                form=_OPT_REAL,
            )


def _empty_slot(slot: int, max_steps: int) -> SlotAcceptance:
    zeros = (0.0,) * max_steps
    return SlotAcceptance(slot, zeros, zeros, zeros, zeros)


@dataclass(frozen=True, slots=True)
class AcceptanceState:
    """Everything the acceptance estimator learned; serialisable (``to_dict``)."""

    max_steps: int
    slots: tuple[SlotAcceptance, ...]
    # Window end of the newest snapshot absorbed (None before the first).
    last_time_s: float | None = None
    # Shifts detected on the counts pooled over slots.
    pooled_changes: int = 0
    version: int = ACCEPTANCE_STATE_VERSION
    _index: dict[int, int] = field(default_factory=dict, init=False, repr=False, compare=False)
    # (reached, passed) per position summed over slots, built on first use (``pooled``).
    _pooled: tuple[tuple[float, ...], tuple[float, ...]] | None = field(
        default=None, init=False, repr=False, compare=False
    )
    # (config, per position the slots' Beta prior), see ``_slot_priors``.
    _slot_priors: tuple[AcceptanceConfig, tuple[tuple[float, float], ...]] | None = field(
        default=None, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        check_int("AcceptanceState.max_steps", self.max_steps, error=PolicyTypeError, minimum=1)
        if not isinstance(self.slots, tuple) or not all(
            isinstance(s, SlotAcceptance) and len(s.reached) == self.max_steps for s in self.slots
        ):
            raise PolicyTypeError(
                f"AcceptanceState.slots: expected a tuple of SlotAcceptance with "
                f"{self.max_steps} positions each, got {self.slots!r}"
            )
        bounds = [s.slot for s in self.slots]
        if bounds != sorted(set(bounds)):
            raise PolicyTypeError(
                f"AcceptanceState.slots: expected strictly increasing slot bounds, got {bounds}"
            )
        if self.last_time_s is not None:
            check_real(
                "AcceptanceState.last_time_s",
                self.last_time_s,
                error=PolicyTypeError,
                form=_OPT_REAL,
            )
        check_int(
            "AcceptanceState.pooled_changes", self.pooled_changes, error=PolicyTypeError, minimum=0
        )
        if self.version != ACCEPTANCE_STATE_VERSION:
            raise PolicyTypeError(
                f"AcceptanceState.version: expected {ACCEPTANCE_STATE_VERSION}, "
                f"got {self.version!r}"
            )
        object.__setattr__(self, "_index", {s.slot: i for i, s in enumerate(self.slots)})

    def slot_state(self, slot: int) -> SlotAcceptance | None:
        i = self._index.get(slot)
        return None if i is None else self.slots[i]

    def pooled(self) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """Decayed (reached, passed) per position, summed over the slots in slot order."""
        pooled = getattr(self, "_pooled", None)  # absent in a state pickled by an older build
        if pooled is None:
            n = self.max_steps
            reached = [0.0] * n
            passed = [0.0] * n
            for s in self.slots:
                for i in range(n):
                    reached[i] += s.reached[i]
                    passed[i] += s.passed[i]
            pooled = (tuple(reached), tuple(passed))
            object.__setattr__(self, "_pooled", pooled)
        return pooled

    @property
    def total_changes(self) -> int:
        """Shifts detected so far (per slot plus pooled), for diagnostics."""
        return self.pooled_changes + sum(s.changes for s in self.slots)

    # The codec's from_data after a version check that names the version this build reads;
    # the other way is the codec's to_data.
    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> AcceptanceState:
        if isinstance(data, Mapping):
            _check_version("AcceptanceState", data, ACCEPTANCE_STATE_VERSION)
        return from_data(cls, data, where="AcceptanceState.from_dict", error=PolicyTypeError)


def initial_acceptance_state(
    slots: Sequence[int], config: AcceptanceConfig | None = None
) -> AcceptanceState:
    """An empty state for ``slots`` (more slots are added as tiers name them)."""
    cfg = config or AcceptanceConfig()
    bounds = sorted(set(slots))
    return AcceptanceState(
        max_steps=cfg.max_steps,
        slots=tuple(_empty_slot(b, cfg.max_steps) for b in bounds),
    )


# --------------------------------------------------------------------------- update


def _resize(values: tuple[float, ...], n: int) -> tuple[float, ...]:
    return values[:n] if len(values) >= n else values + (0.0,) * (n - len(values))


def _chi2_quantile(dof: int, z: float) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile at normal quantile z."""
    c = 2.0 / (9.0 * dof)
    return dof * (1.0 - c + z * math.sqrt(c)) ** 3


def _shift_detected(
    reached: Sequence[float],
    passed: Sequence[float],
    fast_reached: Sequence[float],
    fast_passed: Sequence[float],
    config: AcceptanceConfig,
) -> bool:
    stat = 0.0
    dof = 0
    for rs, ps, rf, pf in zip(reached, passed, fast_reached, fast_passed, strict=True):
        ro = rs - rf  # old evidence: slow minus fast (>= 0 up to rounding)
        po = ps - pf
        if rf < config.change_min_trials or ro < config.change_min_trials:
            continue
        po = min(max(po, 0.0), ro)
        p = (pf + po) / (rf + ro)
        var = p * (1.0 - p) * (1.0 / rf + 1.0 / ro) * config.change_overdispersion
        if var <= 0.0:
            continue
        stat += (pf / rf - po / ro) ** 2 / var
        dof += 1
    return dof > 0 and stat > _chi2_quantile(dof, config.change_z)


def _window_counts(
    snapshot: TierStatsSnapshot, n: int
) -> dict[int, tuple[list[float], list[float]]]:
    """This window's counts per slot: (requests that reached position i, those that
    passed it) for positions 1..n."""
    window: dict[int, tuple[list[float], list[float]]] = {}
    for tier in snapshot.tiers:
        reach, passes = window.setdefault(tier.slot, ([0.0] * n, [0.0] * n))
        if tier.steps == 0 or tier.requests == 0:
            continue
        hist = tier.accepted_hist
        # at_least[j] = requests that accepted >= j drafts.
        at_least = [0] * (tier.steps + 2)
        for j in range(tier.steps, -1, -1):
            at_least[j] = at_least[j + 1] + hist[j]
        for i in range(1, min(tier.steps, n) + 1):
            reach[i - 1] += at_least[i - 1]
            passes[i - 1] += at_least[i]
    return window


def update_acceptance(
    state: AcceptanceState, snapshot: TierStatsSnapshot, config: AcceptanceConfig | None = None
) -> AcceptanceState:
    """Absorb one window of tier statistics.

    A snapshot whose window ends at or before the newest one absorbed is ignored: the
    same snapshot seen twice (telemetry not refreshed between decisions) must not be
    counted twice.
    """
    cfg = config or AcceptanceConfig()
    if not isinstance(snapshot, TierStatsSnapshot):
        raise PolicyTypeError(
            f"update_acceptance: snapshot: expected a TierStatsSnapshot, got {snapshot!r}"
        )
    end = snapshot.window_end_s
    if state.last_time_s is not None and end <= state.last_time_s:
        return state
    n = cfg.max_steps
    dt = 0.0 if state.last_time_s is None else end - state.last_time_s
    slow_decay = 0.5 ** (dt / cfg.half_life_s)
    fast_decay = 0.5 ** (dt / cfg.fast_half_life_s)

    window = _window_counts(snapshot, n)
    bounds = sorted({s.slot for s in state.slots} | set(window))
    updated: list[SlotAcceptance] = []
    zeros = [0.0] * n
    for bound in bounds:
        old = state.slot_state(bound) or _empty_slot(bound, n)
        wr, wp = window.get(bound, (zeros, zeros))
        reached = tuple(
            r * slow_decay + w for r, w in zip(_resize(old.reached, n), wr, strict=True)
        )
        passed = tuple(p * slow_decay + w for p, w in zip(_resize(old.passed, n), wp, strict=True))
        fast_r = tuple(
            r * fast_decay + w for r, w in zip(_resize(old.fast_reached, n), wr, strict=True)
        )
        fast_p = tuple(
            p * fast_decay + w for p, w in zip(_resize(old.fast_passed, n), wp, strict=True)
        )
        slot = SlotAcceptance(
            bound, reached, passed, fast_r, fast_p, old.changes, old.last_change_s
        )
        if _shift_detected(reached, passed, fast_r, fast_p, cfg):
            slot = _reset(slot, (wr, wp), end)
        updated.append(slot)

    pooled_changes = state.pooled_changes
    if updated:

        def pooled(name: str) -> list[float]:
            rows = [getattr(s, name) for s in updated]
            return [sum(col) for col in zip(*rows, strict=True)]

        if _shift_detected(
            pooled("reached"), pooled("passed"), pooled("fast_reached"), pooled("fast_passed"), cfg
        ):
            pooled_changes += 1
            updated = [
                s if s.last_change_s == end else _reset(s, window.get(s.slot, (zeros, zeros)), end)
                for s in updated
            ]

    return AcceptanceState(
        max_steps=n,
        slots=tuple(updated),
        last_time_s=end,
        pooled_changes=pooled_changes,
    )


def _reset(
    slot: SlotAcceptance, window: tuple[list[float], list[float]], now_s: float
) -> SlotAcceptance:
    """Drop old evidence: keep only the window in which the shift was detected.

    (The fast counts are no substitute: with a few windows of memory they still hold
    mostly pre-shift data when the detector fires.)
    """
    reached = tuple(window[0])
    passed = tuple(window[1])
    return replace(
        slot,
        reached=reached,
        passed=passed,
        fast_reached=reached,
        fast_passed=passed,
        changes=slot.changes + 1,
        last_change_s=now_s,
    )


# ------------------------------------------------------------------------- estimate


@dataclass(frozen=True, slots=True)
class AcceptanceEstimate:
    """Conditional acceptance per draft position of one slot (index ``j - 1``: position j).

    ``trials`` are the slot's own decayed trials per position, ``pooled_trials`` those
    of all slots; ``observed`` is the number of leading positions with enough pooled
    trials, beyond which ``mean`` and ``lower`` are conservative extrapolations.
    """

    slot: int
    mean: tuple[float, ...]
    lower: tuple[float, ...]
    trials: tuple[float, ...]
    pooled_trials: tuple[float, ...] = ()
    observed: int = 0

    def expected_accept_length(self, steps: int, conservative: bool = False) -> float:
        """Expected tokens per verify with ``steps`` drafts, bonus token included.

        ``1 + sum_{i<=steps} prod_{j<=i} alpha_j``; positions past ``max_steps`` repeat
        the last (already extrapolated, conservative) rate.
        """
        if not is_int(steps) or steps < 0:
            raise PolicyTypeError(
                f"AcceptanceEstimate.expected_accept_length: steps: expected an int >= 0, "
                f"got {steps!r}"
            )
        rates = self.lower if conservative else self.mean
        total = 1.0
        prod = 1.0
        for i in range(steps):
            prod *= rates[i] if i < len(rates) else rates[-1]
            total += prod
        return total

    def uncertain_from(self, min_trials: float) -> int:
        """First position (1-based) whose slot trials are below ``min_trials``, else len+1."""
        for i, t in enumerate(self.trials):
            if t < min_trials:
                return i + 1
        return len(self.trials) + 1


def _extrapolation_start(
    mean: Sequence[float], lower: Sequence[float], cfg: AcceptanceConfig
) -> tuple[float, float]:
    """(cap, ratio) of the extrapolation past ``len(mean)`` observed positions.

    ``cap`` is the last observed lower bound, or the lower of the last two once three
    positions are observed (a last-position bump need not carry on; position 1 is left
    out, n-gram drafters accept far less there than after it, REFERENCE.md §3).
    ``ratio`` is the per-position decay: ``cfg.extrapolation_decay``, or the observed
    trend (geometric, first to last observed mean) when that falls faster.
    """
    m = len(mean)
    cap = lower[m - 1] if m < 3 else min(lower[m - 1], lower[m - 2])
    ratio = cfg.extrapolation_decay
    if m >= 2 and mean[0] > 0.0:
        ratio = min(ratio, (mean[m - 1] / mean[0]) ** (1.0 / (m - 1)))
    return cap, ratio


def _slot_priors(state: AcceptanceState, cfg: AcceptanceConfig) -> tuple[tuple[float, float], ...]:
    """Per position, the Beta(a, b) prior every slot's posterior starts from.

    The pooled posterior's mean with strength ``kappa``: the same for every slot of one
    state, so it is computed once per state and config (kept on the state).
    """
    # (getattr: absent in a state pickled by an older build)
    cached: tuple[AcceptanceConfig, tuple[tuple[float, float], ...]] | None = getattr(
        state, "_slot_priors", None
    )
    if cached is not None and cached[0] is cfg:
        return cached[1]
    pooled_r, pooled_p = state.pooled()
    priors: list[tuple[float, float]] = []
    for pr, pooled in zip(pooled_r, pooled_p, strict=True):
        pp = min(pooled, pr)
        a_pool = cfg.prior_mean * cfg.prior_strength + pp
        b_pool = (1.0 - cfg.prior_mean) * cfg.prior_strength + (pr - pp)
        m_pool = a_pool / (a_pool + b_pool)
        # The slot's prior is never more confident than the pooled posterior itself.
        kappa = min(cfg.pool_strength, a_pool + b_pool)
        priors.append((kappa * m_pool, kappa * (1.0 - m_pool)))
    result = tuple(priors)
    object.__setattr__(state, "_slot_priors", (cfg, result))
    return result


def acceptance_estimate(
    state: AcceptanceState, slot: int, config: AcceptanceConfig | None = None
) -> AcceptanceEstimate:
    """The posterior of ``slot`` (a slot never seen gets the pooled estimate)."""
    cfg = config or AcceptanceConfig()
    n = state.max_steps
    pooled_r, pooled_p = state.pooled()  # the same for every slot of this state
    own = state.slot_state(slot)
    own_r = own.reached if own is not None else (0.0,) * n
    own_p = own.passed if own is not None else (0.0,) * n

    mean: list[float] = []
    lower: list[float] = []
    for i, (a_prior, b_prior) in enumerate(_slot_priors(state, cfg)):
        r = own_r[i]
        p = min(own_p[i], r)
        a = a_prior + p
        b = b_prior + (r - p)
        m = a / (a + b)
        sd = math.sqrt(a * b / ((a + b) ** 2 * (a + b + 1.0)))
        mean.append(m)
        lower.append(min(m, max(0.0, m - cfg.lower_z * sd)))

    observed = 0
    while observed < n and pooled_r[observed] >= cfg.min_trials:
        observed += 1
    if observed > 0:
        # Past the evidence: position i gets a Beta prior centred on a falling trend
        # (strength prior_strength), updated with the few pooled trials there are, and
        # never above the trend: cap * ratio ** (i - observed + 1).
        cap, ratio = _extrapolation_start(mean[:observed], lower[:observed], cfg)
        last_lower = lower[observed - 1]
        for i in range(observed, n):
            centre = cap * ratio ** (i - observed + 1)
            pr = pooled_r[i]
            pp = min(pooled_p[i], pr)
            a = centre * cfg.prior_strength + pp
            b = (1.0 - centre) * cfg.prior_strength + (pr - pp)
            m = min(a / (a + b), centre)
            mean[i] = m
            # The bound keeps the flat prior centred on the last observed bound (with
            # prior_strength pseudo-trials it is far wider than the trend's fall; one
            # falling with the trend would forbid every probe past the evidence), and
            # never exceeds the mean.
            a0 = last_lower * cfg.prior_strength + pp
            b0 = (1.0 - last_lower) * cfg.prior_strength + (pr - pp)
            m0 = min(a0 / (a0 + b0), last_lower)
            sd0 = math.sqrt(a0 * b0 / ((a0 + b0) ** 2 * (a0 + b0 + 1.0)))
            lower[i] = min(m, max(0.0, m0 - cfg.lower_z * sd0))
    else:
        for i in range(n):
            mean[i] = min(mean[i], cfg.prior_mean)
            lower[i] = min(lower[i], mean[i])

    return AcceptanceEstimate(
        slot=slot,
        mean=tuple(mean),
        lower=tuple(lower),
        trials=tuple(own_r),
        pooled_trials=pooled_r,
        observed=observed,
    )
