"""``bandit``: per-slot multi-armed bandit over the candidate steps, reward = measured goodput.

For deployments where the cost model is not trusted: no estimator, no prior. Each engine
slot is an independent bandit whose arms are that slot's candidate steps (narrowed by the
Budget's ``allowed_steps``). It only ever plays candidates and changes a slot's step at
most once per decision (one table per decision).

Reward
    For every tier (slot, steps) that ran in the window of ``observation.tier_stats``:
    ``tokens / (verify_calls * mean_step_time_s)`` with ``tokens = requests * (mean
    accepted + 1)``, i.e. tokens per second of that slot's decode time (equal to
    ``requests * (mean_accepted + 1) / step_time_sum_s`` when every verify was timed).
    ``reward="per-request"`` divides it by the window's mean batch size, which cancels
    load swings inside a slot (a slot spans e.g. batch sizes 8..31) at the price of
    favouring per-request speed. A tier counts as one pull weighted
    ``min(1, step_time_count / full_weight_calls)``, so a window with a handful of batches
    moves the estimate little. A tier is attributed to what actually ran (the fallback's
    steps included), so stale tables and fallback periods are measured correctly. A
    snapshot seen before (the ``window_end_s`` consumed last) is not counted twice.

Forgetting
    Discounted statistics (discounted UCB, Garivier & Moulines 2011, in continuous time):
    before new data is added every arm's weight and sums decay by
    ``exp(-dt / window_s)`` with ``dt`` the observation time since the last update. An
    observation ``window_s`` old weighs ``1/e``; an arm not played for long loses its
    weight, its exploration bonus grows and it is tried again, which is how a shift that
    makes an unplayed arm the best is found.

Shift detection
    Discounting alone follows a change of the arm being played only as fast as its old
    windows fade (``window_s``), and normalising by the best arm makes every stale arm
    look worse when the incumbent improves. So each measured arm also runs a two-sided
    CUSUM on its normalised deviation from its own mean (slack 2 % or one sigma, alarm
    at 15 % or 5 sigma: a 30 % jump alarms in one window, 10 % in two, 2 % noise almost
    never). On an alarm the slot's other arms are forgotten (each is unknown again and
    is measured once more, first) and the shifted arm restarts from its latest window.

Normalisation and noise
    Rewards are kept raw (tokens/s) and normalised at decision time by the best arm's
    current mean in the slot ("the best seen", forgetting included), so the best arm
    scores 1. The reward noise ``sigma`` is the pooled within-arm standard deviation of
    the normalised rewards (a weak prior of 0.1 weighing one pull, floored at 0.01).

Algorithms
    * ``ucb`` (default): discounted UCB1 whose bonus is scaled by the measured noise
      (in the spirit of UCB1-Normal, Auer et al. 2002): ``index = mean + explore *
      sigma * sqrt(2 ln N / n)``, ``n`` the arm's discounted pulls, ``N`` the slot's. Plain UCB1
      assumes rewards spread over [0, 1]; goodput windows are far less noisy than that,
      and the unscaled bonus would keep every slot exploring for ever.
    * ``thompson``: Gaussian Thompson sampling, ``theta ~ N(mean, (explore * sigma)^2 / n)``.
    * ``thompson-beta``: Beta Thompson sampling on the normalised reward in [0, 1]
      (``Beta(1 + explore^-2 * sum r, 1 + explore^-2 * sum (1 - r))``); broader than the
      Gaussian form, so it explores more.

    An arm never pulled (or forgotten entirely) scores +inf and is tried first, lowest
    steps first. The incumbent step of a slot is kept unless a challenger's score beats
    it by ``switch_margin`` (normalised goodput), which stops two near-equal arms from
    trading places every decision. An incumbent not yet measured is kept until it is.
    Draws come from a numpy PCG64 generator seeded with ``seed`` whose state travels in
    :class:`BanditState`, so a run is reproducible and survives a restart.

Settling (measured with the simulated bandits of tests/test_bandit_policy.py: one slot
with arms 1/3/5/7 at 800/950/1000/960 tok/s, a decision every 2 s, defaults, 10 seeds):
after the first round of exploration the slot plays the best arm 97 % of the time and
makes about 1 table change per minute with ``ucb`` or ``thompson`` at 2 % reward noise
(1.4-1.6 at 5 %; each exploration is two changes, out and back), ``thompson-beta`` about
2 (2.7 at 5 %). Larger gaps explore less. With SGLang's default slots (4, 3, 2 and 1
candidates) expect at most 2-3 changes per minute over the table when all slots carry
traffic; a slot without traffic in a window never changes. A detected shift costs one
burst (each other arm of that slot is measured once more). Longer ``window_s``, smaller
``explore`` or a larger ``switch_margin`` explore less and find an arm that became best
while unplayed more slowly (about 1-2 minutes with the defaults). The guardrails' dwell
time and rate limit bound it further.

``expected_gain`` of a change is the predicted relative goodput gain from the arms'
current means, weighted by how much each changed slot ran. It is None for an
exploration move (the means predict a loss; the bandit plays it for information) and
when a changed slot's new arm has never been measured: a prediction-gated tolerance
band must not veto exploration, which the dwell time and rate limit still bound.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np

from specgov.policies.common.decisions import Plan, ReasonCode
from specgov.policies.common.observation import Observation
from specgov.policies.common.rng import RngState, generator, rng_state_of, seeded_rng_state
from specgov.policies.common.types import Budget, PolicyTypeError, TierStat, TierStatsSnapshot
from specgov.policies.common.validation import check_int, check_real, is_int, is_real
from specgov.policies.daemon.schedules import (
    PolicyStateError,
    Slots,
    check_state_keys,
    engine_slots,
    format_slots,
)

ALGOS: Final = ("ucb", "thompson", "thompson-beta")
REWARDS: Final = ("goodput", "per-request")
# Tuned on simulated stationary and shifting bandits (module docstring): half the textbook
# bonus finds a 5 % better arm as reliably with half the exploratory switches.
DEFAULT_EXPLORE: Final = {"ucb": 0.5, "thompson": 0.5, "thompson-beta": 1.0}
STATE_VERSION: Final = 1

# Weak prior on the normalised reward noise: one pull's worth of 10 % noise, so the first
# few windows explore broadly and the measured spread takes over within a few pulls.
_PRIOR_SIGMA: Final = 0.1
_PRIOR_WEIGHT: Final = 1.0
# Below 1 % the windows' own measurement noise dominates; a smaller sigma would make an
# arm that was unlucky once look certainly worse for many minutes.
_SIGMA_MIN: Final = 0.01
# An arm whose discounted weight fell below this is forgotten (dropped from the state).
_FORGET_WEIGHT: Final = 1e-6
# Shift detector (two-sided CUSUM on normalised reward, per arm): deviations within the
# slack (2 % or one sigma) are noise; alarm when the sum passes 15 % (or 5 sigma), so a
# 30 % jump alarms on its first window, a 10 % one in two, and 2 % noise almost never.
# Only arms with a settled mean (>= 2 pulls) are watched.
_CUSUM_SLACK: Final = 0.02
_CUSUM_LIMIT: Final = 0.15
_CUSUM_LIMIT_SIGMAS: Final = 5.0
_CUSUM_MIN_WEIGHT: Final = 2.0

# ------------------------------------------------------------------------- config


def _check_pos(owner: str, value: object, *, zero_ok: bool = False) -> None:
    minimum = 0.0 if zero_ok else None
    check_real(owner, value, error=PolicyTypeError, minimum=minimum, positive=not zero_ok)


@dataclass(frozen=True, slots=True)
class BanditConfig:
    """Knobs of :class:`BanditPolicy` (defaults documented in the module docstring).

    algo: ``ucb`` | ``thompson`` | ``thompson-beta``.
    seed: seed of the policy's PCG64 generator (int >= 0).
    window_s: forgetting time constant of the discounted statistics, seconds.
    explore: scale of the exploration bonus / posterior width; None = the algorithm's
      default (``DEFAULT_EXPLORE``: 0.5 for ucb and thompson, 1 = the textbook posterior
      for thompson-beta).
    switch_margin: normalised score advantage a challenger needs to replace a slot's step.
    full_weight_calls: timed verify calls for a window to count as one full pull.
    reward: ``goodput`` (tokens/s of the slot's decode time) | ``per-request`` (that over
      the mean batch size).
    """

    algo: str = "ucb"
    seed: int = 0
    window_s: float = 120.0
    explore: float | None = None
    switch_margin: float = 0.02
    full_weight_calls: int = 32
    reward: str = "goodput"

    def __post_init__(self) -> None:
        if self.algo not in ALGOS:
            raise PolicyTypeError(
                f"BanditConfig.algo: expected one of {', '.join(ALGOS)}, got {self.algo!r}"
            )
        if self.reward not in REWARDS:
            raise PolicyTypeError(
                f"BanditConfig.reward: expected one of {', '.join(REWARDS)}, got {self.reward!r}"
            )
        check_int("BanditConfig.seed", self.seed, error=PolicyTypeError, minimum=0)
        check_int(
            "BanditConfig.full_weight_calls",
            self.full_weight_calls,
            error=PolicyTypeError,
            minimum=1,
        )
        _check_pos("BanditConfig.window_s", self.window_s)
        if self.explore is not None:
            _check_pos("BanditConfig.explore", self.explore, zero_ok=True)
        _check_pos("BanditConfig.switch_margin", self.switch_margin, zero_ok=True)

    @property
    def explore_scale(self) -> float:
        return DEFAULT_EXPLORE[self.algo] if self.explore is None else self.explore


# -------------------------------------------------------------------------- state


@dataclass(frozen=True, slots=True)
class ArmStat:
    """Discounted statistics of one (slot, steps) arm; rewards in raw tokens/s.

    ``cusum_up``/``cusum_down``: the shift detector's one-sided sums (normalised reward).
    """

    slot: int
    steps: int
    weight: float
    reward_sum: float
    reward_sq_sum: float
    cusum_up: float = 0.0
    cusum_down: float = 0.0

    @property
    def mean(self) -> float:
        return self.reward_sum / self.weight

    def decayed(self, factor: float) -> ArmStat:
        return ArmStat(
            self.slot,
            self.steps,
            self.weight * factor,
            self.reward_sum * factor,
            self.reward_sq_sum * factor,
            self.cusum_up,
            self.cusum_down,
        )

    def to_list(self) -> list[float | int]:
        return [
            self.slot,
            self.steps,
            self.weight,
            self.reward_sum,
            self.reward_sq_sum,
            self.cusum_up,
            self.cusum_down,
        ]


@dataclass(frozen=True, slots=True)
class BanditState:
    """Everything the bandit learned, serialisable (``to_dict``/``from_dict``, versioned).

    arms: discounted statistics, sorted by (slot, steps).
    choice: per slot bound, the step the bandit plays there.
    time_s: observation time of the last statistics update (the decay clock).
    window_end_s: end of the last tier-statistics window consumed (dedupe).
    rng: PCG64 (state, inc, has_uint32, uinteger).

    A state saved before the guard owned the table versions also held the last table the
    bandit issued (key ``table``); it is read and dropped (the guard keeps the table).
    """

    rng: RngState
    arms: tuple[ArmStat, ...] = ()
    choice: tuple[tuple[int, int], ...] = ()
    time_s: float | None = None
    window_end_s: float | None = None

    # Its own encoding (codec docstring): arms as rows, 128-bit RNG words as strings.
    def to_dict(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "arms": [a.to_list() for a in self.arms],
            "choice": [[b, s] for b, s in self.choice],
            "time_s": self.time_s,
            "window_end_s": self.window_end_s,
            # 128-bit ints as decimal strings: not every JSON reader keeps big ints exact.
            "rng": [str(v) for v in self.rng],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> BanditState:
        keys = ("version", "arms", "choice", "time_s", "window_end_s", "rng")
        check_state_keys("BanditState", data, keys, dropped=("table",))
        where = "BanditState.from_dict"
        arms: list[ArmStat] = []
        raw_arms = data["arms"]
        if not isinstance(raw_arms, list | tuple):
            raise PolicyStateError(f"{where}: key 'arms': expected a list, got {raw_arms!r}")
        for i, item in enumerate(raw_arms):
            ok = isinstance(item, list | tuple) and len(item) == 7
            ok = ok and all(is_int(v) and v >= 0 for v in item[:2])
            ok = ok and all(is_real(v) and v >= 0 for v in item[2:])
            if not ok:
                raise PolicyStateError(
                    f"{where}: key 'arms'[{i}]: expected [slot, steps, weight, reward_sum, "
                    f"reward_sq_sum, cusum_up, cusum_down] (ints >= 0, finite numbers >= 0), "
                    f"got {item!r}"
                )
            arms.append(ArmStat(item[0], item[1], *(float(v) for v in item[2:])))
        choice = data["choice"]
        if not isinstance(choice, list | tuple) or not all(
            isinstance(p, list | tuple) and len(p) == 2 and all(is_int(v) for v in p)
            for p in choice
        ):
            raise PolicyStateError(
                f"{where}: key 'choice': expected a list of [slot, steps] ints, got {choice!r}"
            )
        times: dict[str, float | None] = {}
        for key in ("time_s", "window_end_s"):
            value = data[key]
            if value is not None and not is_real(value):
                raise PolicyStateError(
                    f"{where}: key {key!r}: expected null or a finite number, got {value!r}"
                )
            times[key] = None if value is None else float(value)
        rng = data["rng"]
        try:
            if not isinstance(rng, list | tuple) or len(rng) != 4:
                raise ValueError("expected 4 decimal strings")
            packed: RngState = (int(rng[0]), int(rng[1]), int(rng[2]), int(rng[3]))
            generator(packed)  # numpy validates the values
        except (ValueError, TypeError, OverflowError) as exc:
            raise PolicyStateError(
                f"{where}: key 'rng': expected PCG64 [state, inc, has_uint32, uinteger] as "
                f"decimal strings, got {rng!r} ({exc})"
            ) from exc
        return cls(
            rng=packed,
            arms=tuple(sorted(arms, key=lambda a: (a.slot, a.steps))),
            choice=tuple((int(b), int(s)) for b, s in choice),
            time_s=times["time_s"],
            window_end_s=times["window_end_s"],
        )


# ------------------------------------------------------------------------- policy


def tier_reward(tier: TierStat, reward: str = "goodput") -> float | None:
    """Goodput of one tier in its window (see the module docstring), None when unmeasured."""
    if tier.requests == 0 or tier.verify_calls == 0 or tier.step_time_count == 0:
        return None
    if tier.step_time_sum_s <= 0:
        return None
    tokens = tier.requests + sum(j * n for j, n in enumerate(tier.accepted_hist))
    mean_step_s = tier.step_time_sum_s / tier.step_time_count
    rate = tokens / (tier.verify_calls * mean_step_s)
    if reward == "per-request":
        if tier.batch_size_sum <= 0:
            return None
        rate /= tier.batch_size_sum / tier.verify_calls
    return rate


@dataclass(frozen=True, slots=True)
class _SlotView:
    """Normalised scores of one slot's candidate arms at one decision."""

    cands: tuple[int, ...]
    means: dict[int, float]  # normalised (best arm = 1); only measured arms
    scores: dict[int, float]  # UCB index or Thompson draw; +inf for unmeasured arms
    weight: float  # discounted pulls of the slot (how much it ran)


class BanditPolicy:
    """Per-slot UCB / Thompson bandit over candidate steps (see the module docstring)."""

    __slots__ = ("_config",)

    def __init__(self, config: BanditConfig | None = None) -> None:
        config = BanditConfig() if config is None else config
        if not isinstance(config, BanditConfig):
            raise PolicyTypeError(f"BanditPolicy.config: expected a BanditConfig, got {config!r}")
        self._config = config

    @property
    def config(self) -> BanditConfig:
        return self._config

    @property
    def name(self) -> str:
        default = BanditConfig()
        parts = []
        for key in sorted(BanditConfig.__dataclass_fields__):
            value = getattr(self._config, key)
            if value != getattr(default, key):
                text = repr(value) if isinstance(value, float) else str(value)
                parts.append(f"{key}={text[:-2] if text.endswith('.0') else text}")
        return "bandit:" + ",".join(parts) if parts else "bandit"

    def initial_state(self) -> BanditState:
        return BanditState(rng=seeded_rng_state(self._config.seed))

    def state_from_dict(self, data: Mapping[str, Any]) -> BanditState:
        return BanditState.from_dict(data)

    # ------------------------------------------------------------------ decide

    def decide(
        self, observation: Observation, state: BanditState, budget: Budget
    ) -> tuple[Plan, BanditState]:
        slots, why = engine_slots(observation, budget)
        snapshot = observation.tier_stats
        if slots is None or snapshot is None:
            why = why or "tier statistics unknown"
            held = f"{self.name}: {why}; holding"
            return Plan(None, ReasonCode.HELD_UNKNOWN_TELEMETRY, held, None), state
        # Only the very window consumed last is a duplicate: one ending earlier means the
        # engine (and its stats clock) restarted, and it carries new evidence.
        if state.window_end_s is not None and snapshot.window_end_s == state.window_end_s:
            # The same window again (the plugin flushes about once a second): no new
            # evidence, so no new choice.
            why = (
                f"{self.name}: no new tier statistics since the window ending at "
                f"{state.window_end_s} (got one ending at {snapshot.window_end_s}); holding"
            )
            return Plan(None, ReasonCode.HELD_STALE_TELEMETRY, why, None), state

        arms, active, shift_notes = self._update(state, snapshot, slots, observation.time_s)
        index = {(a.slot, a.steps): a for a in arms}
        rng = generator(state.rng)
        prior_choice = dict(state.choice)
        views = [self._view(bound, cands, index, rng) for bound, cands in slots]

        wanted: list[tuple[int, int]] = []
        notes: list[str] = list(shift_notes)
        moves: list[tuple[_SlotView, int, int]] = []
        for (bound, _), view in zip(slots, views, strict=True):
            old = prior_choice.get(bound)
            if bound not in active and old in view.cands:
                # No traffic in this slot: nothing new was learned there, and a change
                # would only churn the table (its scores move by decay alone).
                wanted.append((bound, old))
                continue
            new, note = self._choose(view, old)
            wanted.append((bound, new))
            if note:
                notes.append(f"slot {bound}: {note}")
            if old is not None and new != old:
                moves.append((view, old, new))

        message = f"{self.name}: " + ("; ".join(notes) if notes else "no slot changes")
        time_s = observation.time_s
        if state.time_s is not None:
            time_s = max(time_s, state.time_s)
        # The whole choice every time, changed or not: the guard drops a plan made under
        # telemetry it does not trust, and takes this one at its next fresh decision.
        choice = tuple(wanted)
        changed = choice != state.choice
        plan = Plan(
            choice,
            ReasonCode.CHANGED_PREDICTED_GAIN if changed else ReasonCode.HELD_NO_CHANGE,
            f"{message}; plan {format_slots(choice)}" + ("" if changed else " (unchanged)"),
            _expected_gain(moves, views) if changed else None,
        )
        new_state = BanditState(
            rng=rng_state_of(rng),
            arms=arms,
            choice=choice,
            time_s=time_s,
            window_end_s=snapshot.window_end_s,
        )
        return plan, new_state

    def _update(
        self, state: BanditState, snapshot: TierStatsSnapshot, slots: Slots, now_s: float
    ) -> tuple[tuple[ArmStat, ...], set[int], list[str]]:
        """Decay, run the shift detector, add this window's rewards.

        Returns the arms, the slots that ran in the window and notes on detected shifts.
        """
        cfg = self._config
        factor = 1.0
        if state.time_s is not None and now_s > state.time_s:
            factor = math.exp(-(now_s - state.time_s) / cfg.window_s)
        arms = {(a.slot, a.steps): a.decayed(factor) for a in state.arms}
        bounds = [b for b, _ in slots]
        pulls: dict[int, list[tuple[int, float, float]]] = {}
        for tier in snapshot.tiers:
            reward = tier_reward(tier, cfg.reward)
            if reward is None or not math.isfinite(reward):
                continue
            # The tier's slot as the engine recorded it -> the slot of our table holding it.
            bound = bounds[max(bisect.bisect_right(bounds, tier.slot) - 1, 0)]
            weight = min(1.0, tier.step_time_count / cfg.full_weight_calls)
            pulls.setdefault(bound, []).append((tier.steps, reward, weight))
        notes: list[str] = []
        for bound, items in pulls.items():
            in_slot = [a for a in arms.values() if a.slot == bound]
            scale, sigma = _scale_sigma(in_slot)
            shifted: tuple[int, float, float] | None = None
            for steps, reward, weight in items:
                old = arms.get((bound, steps)) or ArmStat(bound, steps, 0.0, 0.0, 0.0)
                up, down = old.cusum_up, old.cusum_down
                if old.weight >= _CUSUM_MIN_WEIGHT and scale > 0:
                    # Two-sided CUSUM on the normalised deviation from the arm's mean.
                    dev = (reward - old.mean) / scale
                    slack = max(_CUSUM_SLACK, sigma)
                    up = max(0.0, up + weight * (dev - slack))
                    down = max(0.0, down + weight * (-dev - slack))
                    if max(up, down) > max(_CUSUM_LIMIT, _CUSUM_LIMIT_SIGMAS * sigma):
                        shifted = (steps, old.mean, reward)
                arms[(bound, steps)] = ArmStat(
                    bound,
                    steps,
                    old.weight + weight,
                    old.reward_sum + weight * reward,
                    old.reward_sq_sum + weight * reward * reward,
                    up,
                    down,
                )
            if shifted is not None:
                # The world changed under this slot: its other arms' means are from the old
                # regime, so they are forgotten (each is measured again, first), and the
                # shifted arm restarts from its latest window.
                steps, before, now = shifted
                for key in [k for k in arms if k[0] == bound]:
                    del arms[key]
                weight = next(w for k, _, w in items if k == steps)
                arms[(bound, steps)] = ArmStat(bound, steps, weight, weight * now, weight * now**2)
                notes.append(
                    f"slot {bound}: shift detected on steps {steps} "
                    f"({before:.0f} -> {now:.0f} tok/s), other arms forgotten"
                )
        kept = (a for a in arms.values() if a.weight >= _FORGET_WEIGHT)
        return tuple(sorted(kept, key=lambda a: (a.slot, a.steps))), set(pulls), notes

    def _view(
        self,
        bound: int,
        cands: tuple[int, ...],
        index: Mapping[tuple[int, int], ArmStat],
        rng: np.random.Generator,
    ) -> _SlotView:
        cfg = self._config
        measured = [a for k in cands if (a := index.get((bound, k))) is not None]
        total = sum(a.weight for a in measured)
        scale, sigma = _scale_sigma(measured)
        if scale <= 0:
            # Nothing measured (or only zero rewards): every arm is as good as unknown.
            measured = []
        means = {a.steps: a.mean / scale for a in measured}
        log_n = math.log(max(total, 2.0))
        explore = cfg.explore_scale
        weights = {a.steps: a.weight for a in measured}
        scores: dict[int, float] = {}
        # Draw for every candidate, in a fixed order, so the stream does not depend on
        # which arms happen to be measured (reproducible across restarts and replays).
        normals = rng.standard_normal(len(cands)) if cfg.algo == "thompson" else None
        for i, k in enumerate(cands):
            if k not in means:
                if cfg.algo == "thompson-beta":
                    rng.beta(1.0, 1.0)  # keep the stream aligned with the measured case
                scores[k] = math.inf
                continue
            n, m = weights[k], means[k]
            if cfg.algo == "ucb":
                scores[k] = m + explore * sigma * math.sqrt(2.0 * log_n / n)
            elif normals is not None:
                scores[k] = m + explore * sigma / math.sqrt(n) * float(normals[i])
            else:
                sharp = 1.0 / max(explore, 1e-6) ** 2
                good = min(m, 1.0) * n
                scores[k] = float(rng.beta(1.0 + sharp * good, 1.0 + sharp * (n - good)))
        return _SlotView(cands=cands, means=means, scores=scores, weight=total)

    def _choose(self, view: _SlotView, old: int | None) -> tuple[int, str]:
        """The slot's step after this decision and, when it changes, why."""
        # Highest score; ties go to the lowest steps (cheapest) by max()'s first-wins rule.
        best = max(view.cands, key=lambda k: view.scores[k])
        best_score = view.scores[best]
        if old is None or old not in view.cands:
            what = "unmeasured" if math.isinf(best_score) else f"score {best_score:.3f}"
            return best, f"start at {best} ({what})"
        old_score = view.scores[old]
        if best == old or not best_score > old_score + self._config.switch_margin:
            return old, ""
        if math.isinf(best_score):
            return best, f"{old} -> {best} (explore: never measured)"
        kind = "exploit" if view.means[best] > view.means[old] else "explore"
        return best, (
            f"{old} -> {best} ({kind}: score {best_score:.3f} > {old_score:.3f} + margin, "
            f"mean {view.means[best]:.3f} vs {view.means[old]:.3f})"
        )


def _scale_sigma(arms: Sequence[ArmStat]) -> tuple[float, float]:
    """The slot's best mean (raw) and pooled normalised reward noise (prior included)."""
    measured = [a for a in arms if a.weight > 0]
    scale = max((a.mean for a in measured), default=0.0)
    spread = 0.0
    if scale > 0:
        spread = sum(max(a.reward_sq_sum - a.reward_sum**2 / a.weight, 0.0) for a in measured)
        spread /= scale**2
    var = (_PRIOR_WEIGHT * _PRIOR_SIGMA**2 + spread) / (
        _PRIOR_WEIGHT + sum(a.weight for a in measured)
    )
    return scale, max(math.sqrt(var), _SIGMA_MIN)


def _expected_gain(
    moves: Sequence[tuple[_SlotView, int, int]], views: Sequence[_SlotView]
) -> float | None:
    if not moves:
        return None
    total = sum(v.weight for v in views)
    gain = 0.0
    for view, old, new in moves:
        if new not in view.means or old not in view.means or view.means[old] <= 0:
            return None
        share = view.weight / total if total > 0 else 0.0
        gain += share * (view.means[new] / view.means[old] - 1.0)
    return gain if gain >= 0.0 else None
