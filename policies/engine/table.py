"""The in-engine policy: follow the daemon's step table, fall back to SGLang's EMA.

:class:`TablePolicy` is the object specgov's SGLang plugin installs in place of
``AdaptiveSpeculativeParams`` (DESIGN.md, "Fast loop"). It implements SGLang's
:class:`~specgov.policies.engine.protocol.AdaptiveSpecPolicy` and:

* answers each decode batch from the :class:`StepTable` the daemon published,
  looked up by the batch size padded to the next CUDA-graph batch size (as SGLang's
  own policy pads);
* ignores a table that is missing, expired, malformed, names a step the engine has
  not built, or would run a step at a CUDA-graph batch size for which that step's
  graph was not captured (SGLang captures a step's graphs only for the batch sizes
  whose EMA slot lists it; an uncaptured size would silently run eagerly, slower
  than not installing specgov). Then the fallback :class:`EmaPolicy` answers, and the
  reason is counted in ``fallback_reasons`` (per decode batch);
* follows a slot's live-acceptance rule (table formats 2-4, :class:`SlotRule`) where the
  table has one: the slot's signal is its recent first-draft acceptance rate, fed by
  every verify of the slot at steps >= 1, and the rule maps it to steps with hysteresis
  (a change needs the signal ``RULE_HYSTERESIS`` past a threshold, under a format-4 rule
  at most as far as moves the slot's goodput by ``RULE_MOVE_GAIN``, for ``RULE_CONFIRM_S``
  on end) and a dwell (at most one change per slot per ``RULE_DWELL_S``), both judged on
  the poll clock; see "Live rules";
* keeps the engine's tier when a batch's slot would switch it for a near-tie: a slot
  whose rule gives the running step within ``STICKY_BAND`` of its signal (under a
  format-4 rule, also losing at most ``STICKY_GAIN`` of goodput) runs it, so batches
  alternating between neighbouring slots do not flip the tier each time; a slot
  without a rule (a fixed step) owns the tier it runs, as a rule's own choice does;
* keeps a slot at 0 steps learnable: every ``PROBE_EVERY_BATCHES`` of its batches it runs
  ``PROBE_BATCHES`` at the rule's ``probe_step`` (under 1 % of the slot's batches; the
  daemon charges that cost when it chooses 0), so the signal sees a rise in acceptance;
  under a format-4 rule (``SlotRule.slopes``) as often as costs ``PROBE_COST`` of its
  goodput at its signal (``probe_every``: down to every ``PROBE_MIN_EVERY`` batches near
  the cut out of 0, where a probe costs next to nothing and its evidence is what brings
  the slot back within seconds at light load);
* always feeds the fallback every verify, so it is warm when it takes over;
* records per-tier statistics keyed by (slot lower bound, steps used) and hands a
  :class:`TierStatsSnapshot` to ``stats_sink`` about every ``flush_interval_s``;
* never raises into SGLang: every exception is caught and counted in ``errors``, and
  every step returned is one of ``candidate_steps``.

Determinism under tensor parallelism: every rank runs its own copy and all must pick
the same step. The answers depend only on the calls SGLang makes (identical on all
ranks), on what ``table_source`` returns and on ``clock()`` read at poll boundaries
(every ``poll_every_batches`` calls to ``get_steps_for_batch``): table expiry is judged
only there. The adapter makes those identical across ranks (rank 0 reads the spool and
broadcasts the table and its clock reading). ``clock()`` read elsewhere feeds only the
statistics.

Live rules: the signal is ``(succ + prior * PRIOR_TRIALS) / (trials + PRIOR_TRIALS)``
over decayed sums of first-draft successes and trials (one trial per request verified
at steps >= 1), each verify decaying the sums by ``exp(-trials / memory)``: a memory of
``SIGNAL_MEMORY_TRIALS`` while the slot speculates, ``PROBE_MEMORY_TRIALS`` while it sits
at 0 steps (there the old evidence describes the poor phase that put it there, and a
false rise costs one dwell at the probe step, where every batch is evidence). The state
of a slot survives new tables (it is keyed by the slot bound), so a table refresh is no
tier change unless its thresholds move the slot.

Step wall time of a batch is ``clock()`` at its ``on_verify_complete`` minus ``clock()``
at its ``get_steps_for_batch``. The first batch after a tier change is timed apart: a
switch's one-off cost (another graph, the drafter's state) is paid once, not per batch of
the new tier, and charged to that tier's mean it moved the daemon's cuts (measured with a
1 ms switch cost on users-1/h100/eagle3: the fallback's flips before the first table put
slot 1's 3 -> 4 cut at 0.62 against 0.68, and the slot ran 4 steps on 36 % of its
batches, -1.4 % throughput). A window reports those times only for a tier it timed no
other batch of: where batches alternate between tiers at every batch, the switch is paid
every time and is that tier's cost. With SGLang's
overlap scheduler the next batch's ``get_steps_for_batch`` comes before this batch's
``on_verify_complete``, so pending lookups are matched to verifies first-in first-out by
batch size, not "the last one".
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable
from typing import Final

from specgov.policies.common.step_table import SlotRule, StepTable
from specgov.policies.common.types import PolicyTypeError, TierStat, TierStatsSnapshot
from specgov.policies.common.validation import check_int, check_real
from specgov.policies.engine.ema import EmaPolicy

logger = logging.getLogger(__name__)

# Fallback reasons (keys of TablePolicy.fallback_reasons).
NO_TABLE: Final = "no_table"
EXPIRED: Final = "expired"
INVALID_TYPE: Final = "invalid_type"
INVALID_STEP: Final = "invalid_step"
UNCAPTURED_STEP: Final = "uncaptured_step"
SOURCE_ERROR: Final = "source_error"
INTERNAL_ERROR: Final = "internal_error"

# The plugin's cadences, defined once (the plugin, replay and the simulated server use
# them): per-tier statistics flushed about once a second, the spool polled (and the table
# broadcast to every TP rank) every 64 decode batches, identical on every rank.
DEFAULT_FLUSH_INTERVAL_S: Final = 1.0
DEFAULT_POLL_EVERY_BATCHES: Final = 64

# Lookups awaiting their verify: one per batch in flight (two with the overlap
# scheduler); the bound only drops lookups whose verify never came (e.g. idle batches).
_PENDING_MAX: Final = 8
_ANSWER_CACHE_MAX: Final = 8192

# Live rules (module docstring). Not operator knobs: the daemon's rule is computed for
# exactly this estimator and probe schedule (GoodputPolicy charges PROBE_SHARE).
SIGNAL_MEMORY_TRIALS: Final = 200.0  # ~0.035 sd at a 0.5 rate
PROBE_MEMORY_TRIALS: Final = 30.0
PRIOR_TRIALS: Final = 4.0
# A slot at 0 steps leaves only on this much (decayed) evidence: a lucky first probe
# would otherwise buy a dwell's worth of batches at the wrong steps.
LEAVE_ZERO_TRIALS: Final = 12.0
RULE_HYSTERESIS: Final = 0.06  # signal units (acceptance rate)
# Format 4: a cut's hysteresis is at most what moves the slot's goodput by this share
# across it (RULE_MOVE_GAIN / slope, in signal units): the daemon's default tolerance for
# a change (GuardrailConfig.min_gain's default, 2 %). A fixed 0.06 was wider than a steep
# rule's whole bands (a poor drafter's cuts lie 0.02-0.04 apart): users-16/a100-80g/ngram held
# 3 steps for 100 s at a signal of 0.10-0.15 under cuts (0.12, 0.16, 0.18) -> (0, 1, 3, 4).
RULE_MOVE_GAIN: Final = 0.02
# A slot runs the engine's current tier instead of its own step while its rule would
# give that tier within this of its signal: near a cut the two steps are near-tied (a
# cut is where they tie), and batches alternating between neighbouring slots would
# otherwise switch the engine's tier at every crossing for no measurable gain.
STICKY_BAND: Final = 2 * RULE_HYSTERESIS
# Format 4: nor where that loses more than this share of the slot's goodput (at the
# cut out of 0 a signal 0.12 above it gains about 10 %). Measured on the Azure
# conversation trace at 1x: 0.03 gave 171 tier switches (sglang-ema 44), 0.05 81.
STICKY_GAIN: Final = 0.05
RULE_DWELL_S: Final = 10.0
# A move is made only once the signal has asked for it this long without a break (on
# the poll clock): a dip shorter than that is the batch's current mix of requests (a
# request lives about a second at light load), gone before a dwell at the new step
# could pay. Measured on the Azure conversation trace at 1x: such dips made most of
# the rule's changes (each held a dwell at the worse step).
RULE_CONFIRM_S: Final = 3.0
PROBE_EVERY_BATCHES: Final = 512
PROBE_BATCHES: Final = 4
PROBE_SHARE: Final = PROBE_BATCHES / (PROBE_EVERY_BATCHES + PROBE_BATCHES)  # the least
# Format 4: a slot at 0 probes as often as costs it PROBE_COST of its goodput, given what
# a probe batch is expected to lose at its signal, from every PROBE_EVERY_BATCHES down to
# every PROBE_MIN_EVERY batches: near the cut a probe costs next to nothing and the
# evidence it buys is what brings the slot back; far below, it costs and says little.
PROBE_COST: Final = 0.002
PROBE_MIN_EVERY: Final = 64


def probe_every(cost: float) -> int:
    """Batches at 0 steps between probe bursts where one probe batch is expected to lose
    ``cost`` (a fraction of the goodput of a batch at 0; <= 0: none): the probes' share
    times ``cost`` is ``PROBE_COST``, within [PROBE_MIN_EVERY, PROBE_EVERY_BATCHES]."""
    if cost <= 0.0:
        return PROBE_MIN_EVERY
    every = PROBE_BATCHES * (cost / PROBE_COST - 1.0)
    return round(min(max(every, PROBE_MIN_EVERY), PROBE_EVERY_BATCHES))


def probe_share(cost: float) -> float:
    """The share of a slot's batches at 0 steps that are probes (``probe_every``)."""
    return PROBE_BATCHES / (probe_every(cost) + PROBE_BATCHES)


def _move_cuts(rule: SlotRule) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per cut, the signal at which a slot crosses it upwards and downwards: the cut
    plus or minus its hysteresis, ``RULE_HYSTERESIS``, and under a format-4 rule at most
    ``RULE_MOVE_GAIN / slope`` (module docstring, "Live rules")."""
    slopes = rule.slopes
    if slopes is None:
        widths = [RULE_HYSTERESIS] * len(rule.thresholds)
    else:
        widths = [min(RULE_HYSTERESIS, RULE_MOVE_GAIN / g) for g in slopes]
    up = tuple(t + h for t, h in zip(rule.thresholds, widths, strict=True))
    down = tuple(t - h for t, h in zip(rule.thresholds, widths, strict=True))
    return up, down


class _RuleSlot:
    """Live state of one slot that follows a SlotRule."""

    __slots__ = (
        "band",
        "changed_at_s",
        "down_cuts",
        "pending_since_s",
        "pending_up",
        "probe_every",
        "probe_left",
        "probe_step",
        "rule",
        "signal",
        "steps",
        "succ",
        "trials",
        "up_cuts",
        "zero_batches",
    )

    def __init__(self, rule: SlotRule) -> None:
        self.succ = 0.0
        self.trials = 0.0
        self.signal = rule.prior
        self.rule = rule
        self.up_cuts, self.down_cuts = _move_cuts(rule)
        self.band = rule.band_for(rule.prior)
        self.steps = rule.steps[self.band]
        self.probe_step = rule.probe_step
        self.changed_at_s: float | None = None
        self.pending_since_s: float | None = None  # when the signal first asked this move
        self.pending_up = False
        self.zero_batches = 0
        self.probe_left = 0
        self.probe_every = PROBE_EVERY_BATCHES

    def adopt(self, rule: SlotRule) -> None:
        """A new table's rule for this slot: same evidence, new thresholds and prior.

        The slot keeps running its steps where the new rule has them (in the band
        nearest the signal); from there hysteresis and dwell judge any move, as for a
        change of the signal. Only a rule without those steps moves the slot at once.
        """
        self.rule = rule
        self.up_cuts, self.down_cuts = _move_cuts(rule)
        self.probe_step = rule.probe_step
        self.signal = (self.succ + rule.prior * PRIOR_TRIALS) / (self.trials + PRIOR_TRIALS)
        band = rule.band_for(self.signal)
        keep = [i for i, k in enumerate(rule.steps) if k == self.steps]
        if keep:
            band = min(keep, key=lambda i: abs(i - band))
        self.band = band
        self.steps = rule.steps[band]

    def observe(self, successes: int, trials: int, now_s: float) -> bool:
        """Feed one verify at steps >= 1; True when the slot's steps changed."""
        memory = SIGNAL_MEMORY_TRIALS if self.steps > 0 else PROBE_MEMORY_TRIALS
        decay = math.exp(-trials / memory)
        self.succ = self.succ * decay + successes
        self.trials = self.trials * decay + trials
        rule = self.rule
        signal = self.signal = (self.succ + rule.prior * PRIOR_TRIALS) / (
            self.trials + PRIOR_TRIALS
        )
        cur = self.band
        slopes = rule.slopes
        if slopes is not None and rule.steps[0] == 0:
            # What a probe batch would lose at this signal, linearised at the cut out of 0.
            self.probe_every = probe_every((rule.thresholds[0] - signal) * slopes[0])
        if self.steps == 0 and self.trials < LEAVE_ZERO_TRIALS:
            return False
        # The band the signal asks for, each cut crossed only beyond its hysteresis.
        new = cur
        up_cuts = self.up_cuts
        while new < len(up_cuts) and signal >= up_cuts[new]:
            new += 1
        if new == cur:
            down_cuts = self.down_cuts
            while new > 0 and signal < down_cuts[new - 1]:
                new -= 1
            if new == cur:
                self.pending_since_s = None
                return False
        since = self.pending_since_s
        if since is None or self.pending_up != (new > cur):
            self.pending_since_s, self.pending_up = now_s, new > cur
            return False
        if now_s - since < RULE_CONFIRM_S:
            return False
        changed = self.changed_at_s
        if changed is not None and now_s - changed < RULE_DWELL_S:
            return False
        self.changed_at_s = now_s
        self.pending_since_s = None
        self.band = new
        steps = rule.steps[new]
        if steps == self.steps:
            return False
        self.steps = steps
        return True

    def accepts(self, steps: int) -> bool:
        """Whether the rule gives ``steps`` within ``STICKY_BAND`` of the signal; under a
        format-4 rule, also only across cuts where that loses at most ``STICKY_GAIN``."""
        rule, signal = self.rule, self.signal
        slopes = rule.slopes
        if slopes is None:
            lo = rule.band_for(signal - STICKY_BAND)
            hi = rule.band_for(signal + STICKY_BAND)
            return steps in rule.steps[lo : hi + 1]
        th = rule.thresholds
        lo = hi = rule.band_for(signal)
        while lo > 0 and signal - th[lo - 1] <= min(STICKY_BAND, STICKY_GAIN / slopes[lo - 1]):
            lo -= 1
        while hi < len(th) and th[hi] - signal <= min(STICKY_BAND, STICKY_GAIN / slopes[hi]):
            hi += 1
        return steps in rule.steps[lo : hi + 1]

    def next_steps(self) -> int:
        """The steps of the slot's next batch: its rule's, or a probe's at 0 steps."""
        steps = self.steps
        if steps != 0 or self.probe_step is None:
            return steps
        if self.probe_left > 0:
            self.probe_left -= 1
            return self.probe_step
        self.zero_batches += 1
        if self.zero_batches >= self.probe_every:
            self.zero_batches = 0
            self.probe_left = PROBE_BATCHES - 1
            return self.probe_step
        return 0


class _TierAcc:
    """Running totals of one (slot, steps) tier in the current window."""

    __slots__ = (
        "batch_size_sum",
        "hist",
        "requests",
        "step_time_count",
        "step_time_sum_s",
        "switch_time_count",
        "switch_time_sum_s",
        "verify_calls",
    )

    def __init__(self, steps: int) -> None:
        self.verify_calls = 0
        self.requests = 0
        self.hist = [0] * (steps + 1)
        self.step_time_sum_s = 0.0
        self.step_time_count = 0
        # The tier's first batches after a tier change: reported only where the window
        # timed no other batch of the tier (module docstring, "Step wall time").
        self.switch_time_sum_s = 0.0
        self.switch_time_count = 0
        self.batch_size_sum = 0


# (batch size, slot bound, steps, clock at lookup, table epoch, first batch at a new tier)
_Pending = tuple[int, int, int, float, int, bool]


class TablePolicy:
    """Step-table policy with an EMA fallback; see the module docstring."""

    def __init__(
        self,
        *,
        table_source: Callable[[], StepTable | None],
        stats_sink: Callable[[TierStatsSnapshot], None],
        clock: Callable[[], float],
        fallback: EmaPolicy,
        flush_interval_s: float = DEFAULT_FLUSH_INTERVAL_S,
        poll_every_batches: int = DEFAULT_POLL_EVERY_BATCHES,
    ) -> None:
        if not isinstance(fallback, EmaPolicy):
            raise PolicyTypeError(
                f"TablePolicy.fallback: expected an EmaPolicy, got {type(fallback).__name__}"
            )
        check_real(
            "TablePolicy.flush_interval_s", flush_interval_s, error=PolicyTypeError, positive=True
        )
        check_int(
            "TablePolicy.poll_every_batches", poll_every_batches, error=PolicyTypeError, minimum=1
        )
        self._source = table_source
        self._sink = stats_sink
        self._clock = clock
        self._fallback = fallback
        self._flush_interval_s = float(flush_interval_s)
        self._poll_every = poll_every_batches
        self._candidates: list[int] = fallback.candidate_steps
        self._candidate_set = frozenset(self._candidates)
        # Returned if even the fallback fails: a step the engine built.
        self._last_resort = fallback.get_steps_for_batch(1)

        self._table: StepTable | None = None
        self._epoch = 0  # bumped whenever the answer source changes
        self._fallback_reason = NO_TABLE
        # batch size -> (slot, steps, the slot's live rule or None)
        self._answers: dict[int, tuple[int, int, _RuleSlot | None]] = {}
        self._rule_slots: dict[int, _RuleSlot] = {}  # slot bound -> live rule state
        self._poll_now_s = 0.0  # the clock at the last poll (identical on TP ranks)
        self._last_steps = -1  # the step of the last answer: the engine's tier
        self._tier_owner = -1  # the slot whose own choice that tier is
        self.rule_changes = 0  # tier changes made by live rules
        # step -> CUDA-graph batch sizes captured for it; None: CUDA graphs disabled.
        self._captured: dict[int, frozenset[int]] | None = None
        self._gets = 0
        self._pending: deque[_Pending] = deque(maxlen=_PENDING_MAX)
        self._tiers: dict[tuple[int, int], _TierAcc] = {}
        self._window_start_s: float | None = None

        self.fallback_reasons: dict[str, int] = {}
        self.errors = 0
        self.last_error: str | None = None
        self.flushes = 0

    # ---------------------------------------------------------- SGLang protocol

    @property
    def candidate_steps(self) -> list[int]:
        """The fallback's (the engine's prebuilt) candidate steps."""
        return list(self._candidates)

    def set_cuda_graph_bs(self, cuda_graph_bs: list[int] | None) -> None:
        try:
            self._fallback.set_cuda_graph_bs(cuda_graph_bs)
            graph_bs = self._fallback.cuda_graph_bs
            if graph_bs is None:
                self._captured = None
            else:
                self._captured = {
                    step: frozenset(self._fallback.cuda_graph_bs_for_step(step) or ())
                    for step in self._candidates
                }
            self._answers.clear()
            if self._table is not None:
                reason = self._rejection(self._table)
                if reason is not None:
                    self._set_table(None, reason)
        except Exception as exc:
            self._note_error(exc)

    def get_steps_for_batch(self, batch_size: int) -> int:
        try:
            now = self._clock()
            if self._window_start_s is None:
                self._window_start_s = now
            if self._gets % self._poll_every == 0:
                self._poll(now)
            self._gets += 1
            if self._table is not None:
                answer = self._answers.get(batch_size)
                if answer is None:
                    answer = self._answer_slow(self._table, batch_size)
                slot, steps, live = answer
                if live is None:
                    self._tier_owner = slot  # a slot without a rule runs its own step
                else:
                    steps = live.next_steps()
                    last = self._last_steps
                    if steps == last or live.steps != steps:
                        self._tier_owner = slot  # its own choice (or a probe)
                    elif slot != self._tier_owner and live.accepts(last):
                        steps = last  # another slot's choice, as good here
                    else:
                        self._tier_owner = slot
            else:
                fallback = self._fallback
                steps = fallback.get_steps_for_batch(batch_size)
                slot = fallback.slot_bound_for(batch_size)
                reasons = self.fallback_reasons
                reasons[self._fallback_reason] = reasons.get(self._fallback_reason, 0) + 1
            # The first batch at a new tier is timed apart (module docstring, "Step wall time").
            last = self._last_steps
            switched = steps != last and last >= 0
            self._pending.append((batch_size, slot, steps, now, self._epoch, switched))
            self._last_steps = steps
            return steps
        except Exception as exc:
            self._note_error(exc)
            return self._safe_fallback_steps(batch_size)

    def on_verify_complete(
        self, num_correct_drafts_per_req: list[int], batch_size: int
    ) -> int | None:
        fallback_step: int | None = None
        try:
            # Always feed the fallback, so it is warm whenever it takes over.
            fallback_step = self._fallback.on_verify_complete(
                num_correct_drafts_per_req, batch_size
            )
        except Exception as exc:
            self._note_error(exc)
        try:
            now = self._clock()
            entry = self._match_pending(batch_size)
            slot, ran = self._record(entry, num_correct_drafts_per_req, batch_size, now)
            self._maybe_flush(now)
            table = self._table
            if table is None:
                return fallback_step
            live = self._rule_slots.get(slot) if ran > 0 else None
            if live is not None and num_correct_drafts_per_req:
                n = len(num_correct_drafts_per_req)
                if live.observe(n - num_correct_drafts_per_req.count(0), n, self._poll_now_s):
                    self.rule_changes += 1
                    return live.steps
            if entry is not None and entry[4] != self._epoch:
                # A new table arrived since this batch's step was chosen: switch now if
                # its answer for this batch size differs from the step that ran.
                answer = self._answers.get(batch_size)
                if answer is None:
                    answer = self._answer_slow(table, batch_size)
                steps = answer[1] if answer[2] is None else answer[2].steps
                if steps != entry[2]:
                    return steps
            return None
        except Exception as exc:
            self._note_error(exc)
            return fallback_step if self._table is None else None

    def cuda_graph_bs_for_step(self, step: int) -> list[int] | None:
        """The fallback's answer, so the engine captures exactly what SGLang would."""
        try:
            return self._fallback.cuda_graph_bs_for_step(step)
        except Exception as exc:
            self._note_error(exc)
            return None

    # ----------------------------------------------------------- introspection

    @property
    def fallback(self) -> EmaPolicy:
        return self._fallback

    @property
    def table(self) -> StepTable | None:
        """The table in force, or None when the fallback answers."""
        return self._table

    @property
    def fallback_reason(self) -> str | None:
        """Why the fallback answers now, or None when a table is in force."""
        return None if self._table is not None else self._fallback_reason

    def flush(self) -> None:
        """Hand the current window to ``stats_sink`` now (e.g. at shutdown). Never raises."""
        try:
            now = self._clock()
            if self._window_start_s is None:
                self._window_start_s = now
            self._flush(now)
        except Exception as exc:
            self._note_error(exc)

    # ---------------------------------------------------------------- internals

    def _note_error(self, exc: BaseException) -> None:
        self.errors += 1
        self.last_error = f"{type(exc).__name__}: {exc}"
        logger.debug("TablePolicy error (%d so far): %s", self.errors, self.last_error)

    def _safe_fallback_steps(self, batch_size: int) -> int:
        try:
            steps = self._fallback.get_steps_for_batch(batch_size)
            if steps in self._candidate_set:
                return steps
        except Exception as exc:
            self._note_error(exc)
        return self._last_resort

    def _poll(self, now: float) -> None:
        self._poll_now_s = now
        try:
            table = self._source()
        except Exception as exc:
            self._note_error(exc)
            self._set_table(None, SOURCE_ERROR)
            return
        if table is None:
            self._set_table(None, NO_TABLE)
        elif not isinstance(table, StepTable):
            self._set_table(None, INVALID_TYPE)
        elif table.is_expired(now):
            self._set_table(None, EXPIRED)
        elif table == self._table:
            return  # same table, already validated
        else:
            self._set_table(table, self._rejection(table))

    def _rejection(self, table: StepTable) -> str | None:
        """Why ``table`` cannot be followed, or None if it can."""
        try:
            table.validate_against(self._candidate_set)
        except PolicyTypeError:
            return INVALID_STEP
        captured = self._captured
        graph_bs = self._fallback.cuda_graph_bs
        if captured is not None and graph_bs is not None:
            for bs in graph_bs:
                for step in table.slot_steps(bs):
                    if bs not in captured[step]:
                        return UNCAPTURED_STEP
        return None

    def _set_table(self, table: StepTable | None, rejection: str | None) -> None:
        new = table if rejection is None else None
        if new is None:
            self._fallback_reason = rejection or NO_TABLE
            if rejection is not None and table is not None:
                logger.debug("ignoring step table version %d: %s", table.version, rejection)
        if new is not self._table:
            self._table = new
            self._epoch += 1
            self._answers.clear()
            if new is not None:
                self._adopt_rules(new)

    def _adopt_rules(self, table: StepTable) -> None:
        """Live state for the new table's rules; a slot keeps its evidence."""
        kept: dict[int, _RuleSlot] = {}
        for bound, rule in table.rules:
            live = self._rule_slots.get(bound)
            if live is None:
                live = _RuleSlot(rule)
            else:
                live.adopt(rule)
            kept[bound] = live
        self._rule_slots = kept

    @property
    def live_rules(self) -> dict[int, tuple[float, int]]:
        """Per slot bound with a rule in force: (live signal, steps it runs)."""
        return {b: (r.signal, r.steps) for b, r in self._rule_slots.items()}

    def _answer_slow(self, table: StepTable, batch_size: int) -> tuple[int, int, _RuleSlot | None]:
        padded = self._fallback.pad_batch_size(batch_size)
        slot = table.slot_for(padded)
        answer = (slot, table.steps_for(padded), self._rule_slots.get(slot))
        if len(self._answers) >= _ANSWER_CACHE_MAX:
            self._answers.clear()
        self._answers[batch_size] = answer
        return answer

    def _match_pending(self, batch_size: int) -> _Pending | None:
        pending = self._pending
        for i, entry in enumerate(pending):
            if entry[0] == batch_size:
                # Older lookups never got their verify: drop them.
                for _ in range(i + 1):
                    pending.popleft()
                return entry
        return None

    def _record(
        self,
        entry: _Pending | None,
        accepted: list[int],
        batch_size: int,
        now: float,
    ) -> tuple[int, int]:
        """Record one verify in its tier; returns the tier (slot, steps)."""
        switched = False
        if entry is not None:
            slot, steps, switched = entry[1], entry[2], entry[5]
            elapsed = now - entry[3]
        else:
            # A verify without a lookup: attribute it to the current answer, untimed.
            table = self._table
            if table is not None:
                slot, steps, live = self._answer_slow(table, batch_size)
                if live is not None:
                    steps = live.steps
            else:
                slot = self._fallback.slot_bound_for(batch_size)
                steps = self._fallback.get_steps_for_batch(batch_size)
            elapsed = -1.0
        key = (slot, steps)
        acc = self._tiers.get(key)
        if acc is None:
            acc = self._tiers[key] = _TierAcc(steps)
        acc.verify_calls += 1
        acc.requests += len(accepted)
        acc.batch_size_sum += batch_size
        if elapsed >= 0.0 and switched:
            acc.switch_time_sum_s += elapsed
            acc.switch_time_count += 1
        elif elapsed >= 0.0:
            acc.step_time_sum_s += elapsed
            acc.step_time_count += 1
        hist = acc.hist
        for j in accepted:
            # Accepted drafts lie in [0, steps]; clamp rather than fail on a bad value.
            if 0 <= j <= steps:
                hist[j] += 1
            else:
                hist[0 if j < 0 else steps] += 1
        return key

    def _maybe_flush(self, now: float) -> None:
        start = self._window_start_s
        if start is None:
            self._window_start_s = now
        elif now - start >= self._flush_interval_s:
            self._flush(now)

    def _flush(self, now: float) -> None:
        start = self._window_start_s if self._window_start_s is not None else now
        tiers = self._tiers
        # Start a new window first: a failing sink must not let the window grow forever.
        self._tiers = {}
        self._window_start_s = now
        snapshot = TierStatsSnapshot(
            window_start_s=start,
            window_end_s=max(now, start),
            tiers=tuple(
                TierStat(
                    slot=slot,
                    steps=steps,
                    verify_calls=acc.verify_calls,
                    requests=acc.requests,
                    accepted_hist=tuple(acc.hist),
                    # A tier the window timed only across switches (its batches
                    # alternate with another tier's) reports those: they are its cost.
                    step_time_sum_s=acc.step_time_sum_s
                    if acc.step_time_count
                    else acc.switch_time_sum_s,
                    step_time_count=acc.step_time_count or acc.switch_time_count,
                    batch_size_sum=acc.batch_size_sum,
                )
                for (slot, steps), acc in sorted(tiers.items())
            ),
        )
        self.flushes += 1
        try:
            self._sink(snapshot)
        except Exception as exc:
            self._note_error(exc)
