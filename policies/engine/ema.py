"""SGLang's built-in adaptive-steps controller, re-implemented faithfully.

Same sequence of calls -> same returned steps as ``AdaptiveSpeculativeParams`` (with its
``AdaptiveStepSlot`` per batch-size slot) of sglang 0.5.23
(``sglang/srt/speculative/adaptive_spec_params.py``); a contract test drives both with
random call sequences and compares every answer and every slot's EMA bit for bit.
It is the incumbent every specgov policy is measured against, and the fallback of the
in-engine :class:`~specgov.policies.engine.table.TablePolicy`.

Per slot: ``ema = (1-a)*ema + a*mean(accepted drafts)`` (skipped while steps == 0, but
the batch count still advances); after ``warmup_batches``, every ``update_interval``
batches walk down while ``ema <= prev - 0.5 + down_hysteresis`` (``0.5 + down_hys``
when prev is 0), else up while ``ema > cur - 0.5 + up_hysteresis``; from 0 always probe
the next candidate; ``ceiling_coeff > 0`` caps non-increasing moves at
``max(1, ceil(ema * coeff))``.

The simulator calls this every decode batch (hundreds of thousands of times per
replay), so the hot path only does what SGLang does, plus a memo of batch-size
routing (pure function of the batch size and the CUDA-graph list).
"""

from __future__ import annotations

import bisect
import logging
import math
from collections.abc import Mapping
from typing import Any

from specgov.policies.engine.adaptive_config import (
    DEFAULT_ADAPTIVE_CONFIG,
    AdaptiveConfig,
    SlotConfig,
    parse_adaptive_config,
)

logger = logging.getLogger(__name__)

# Routing memo bound: batch sizes are bounded by max running requests in practice; the
# bound only guards against pathological callers.
_ROUTE_CACHE_MAX = 8192


class _Slot:
    """Mutable state of one batch-size slot (SGLang's AdaptiveStepSlot)."""

    __slots__ = (
        "batch_count",
        "bound",
        "candidate_set",
        "candidates",
        "ceiling_coeff",
        "current_steps",
        "down_hysteresis",
        "ema",
        "ema_alpha",
        "one_minus_alpha",
        "up_hysteresis",
        "update_interval",
        "warmup_batches",
    )

    def __init__(self, initial_steps: int, cfg: SlotConfig) -> None:
        self.bound = cfg.bound
        self.candidates: list[int] = list(cfg.candidate_steps)  # sorted, unique
        self.candidate_set = frozenset(cfg.candidate_steps)
        self.ema_alpha = cfg.ema_alpha
        # SGLang evaluates (1 - ema_alpha) every update; the value is the same every time.
        self.one_minus_alpha = 1 - cfg.ema_alpha
        self.update_interval = cfg.update_interval
        self.warmup_batches = cfg.warmup_batches
        self.down_hysteresis = cfg.down_hysteresis
        self.up_hysteresis = cfg.up_hysteresis
        self.ceiling_coeff = cfg.ceiling_coeff
        if initial_steps in self.candidate_set:
            self.current_steps = initial_steps
        else:
            self.current_steps = self.candidates[len(self.candidates) // 2]
        # Neutral starting point, as SGLang: the EMA starts at current steps - 1.
        self.ema = float(self.current_steps - 1)
        self.batch_count = 0

    def update(self, num_correct_drafts_per_req: list[int]) -> bool:
        """Feed one verify; True if the slot's steps changed."""
        if not num_correct_drafts_per_req:
            return False
        if self.current_steps > 0:
            batch_avg = sum(num_correct_drafts_per_req) / len(num_correct_drafts_per_req)
            self.ema = self.one_minus_alpha * self.ema + self.ema_alpha * batch_avg
        self.batch_count += 1
        if self.batch_count <= self.warmup_batches:
            return False
        if (self.batch_count - self.warmup_batches) % self.update_interval != 0:
            return False
        return self._recompute()

    def _recompute(self) -> bool:
        candidates = self.candidates
        old_steps = self.current_steps
        idx = candidates.index(old_steps)
        last = len(candidates) - 1
        ema = self.ema

        if old_steps == 0:
            # Probe the smallest positive step after a zero-step (no-spec) interval.
            idx = min(idx + 1, last)
            target = candidates[idx]
            if target > 0 and ema < 0:
                # A slot that started at 0 has no acceptance history: start the probe
                # from that step's neutral EMA (SGLang does the same).
                self.ema = float(target - 1)
            return self._apply(old_steps, target)

        old_idx = idx
        down = self.down_hysteresis
        while idx > 0:
            prev_step = candidates[idx - 1]
            # A zero-step floor is reached when close to zero drafts are accepted.
            drop_threshold = 0.5 if prev_step == 0 else prev_step - 0.5
            drop_threshold += down
            if ema <= drop_threshold:
                idx -= 1
            else:
                break

        if idx >= old_idx:  # not moved down: try to move up
            up = self.up_hysteresis
            while idx < last:
                if ema > candidates[idx] - 0.5 + up:
                    idx += 1
                else:
                    break

        target = candidates[idx]
        # The ceiling only caps non-increasing moves, so step-ups can still explore.
        if self.ceiling_coeff > 0:
            ceiling = max(1, math.ceil(ema * self.ceiling_coeff))
            if ceiling < target <= old_steps:
                while idx > 0 and candidates[idx] > ceiling:
                    idx -= 1
                target = candidates[idx]

        return self._apply(old_steps, target)

    def _apply(self, old_steps: int, target: int) -> bool:
        if target != old_steps:
            self.current_steps = target
            logger.debug(
                "slot %d: adaptive steps %d -> %d (ema_accept_len=%.2f)",
                self.bound,
                old_steps,
                target,
                self.ema,
            )
            return True
        return False


class EmaPolicy:
    """SGLang's ``AdaptiveSpeculativeParams``: per-batch-size-slot EMA step controller.

    ``config`` is a decoded ``--speculative-adaptive-config`` mapping (validated with
    :func:`~specgov.policies.engine.adaptive_config.parse_adaptive_config`), an already parsed
    :class:`AdaptiveConfig`, or None for SGLang's default config. Implements
    :class:`~specgov.policies.engine.protocol.AdaptiveSpecPolicy`.
    """

    __slots__ = ("_bs_list", "_candidate_steps", "_config", "_cuda_graph_bs", "_route", "_slots")

    def __init__(
        self,
        initial_steps: int,
        config: Mapping[str, Any] | AdaptiveConfig | None = None,
    ) -> None:
        if config is None:
            parsed = parse_adaptive_config(DEFAULT_ADAPTIVE_CONFIG)
        elif isinstance(config, AdaptiveConfig):
            parsed = config
        else:
            parsed = parse_adaptive_config(config, source="<EmaPolicy config>")
        self._config = parsed
        self._slots: dict[int, _Slot] = {s.bound: _Slot(initial_steps, s) for s in parsed.slots}
        self._bs_list: list[int] = sorted(self._slots)
        self._candidate_steps: list[int] = parsed.candidate_steps
        self._cuda_graph_bs: list[int] | None = None
        # batch size -> slot; a pure function of the batch size and the CUDA-graph list.
        self._route: dict[int, _Slot] = {}

    # ------------------------------------------------------------ SGLang protocol

    @property
    def candidate_steps(self) -> list[int]:
        """Union of all slots' candidate steps (the runtime states SGLang prebuilds)."""
        return list(self._candidate_steps)

    def set_cuda_graph_bs(self, cuda_graph_bs: list[int] | None) -> None:
        self._cuda_graph_bs = sorted(cuda_graph_bs) if cuda_graph_bs else None
        self._route.clear()

    def get_steps_for_batch(self, batch_size: int) -> int:
        slot = self._route.get(batch_size)
        if slot is None:
            slot = self._route_slow(batch_size)
        return slot.current_steps

    def on_verify_complete(
        self, num_correct_drafts_per_req: list[int], batch_size: int
    ) -> int | None:
        """Feed verify results to the batch's slot; the new step if it changed, else None."""
        slot = self._route.get(batch_size)
        if slot is None:
            slot = self._route_slow(batch_size)
        if slot.update(num_correct_drafts_per_req):
            return slot.current_steps
        return None

    def cuda_graph_bs_for_step(self, step: int) -> list[int] | None:
        """CUDA-graph batch sizes that can run ``step`` (None: CUDA graphs disabled)."""
        if self._cuda_graph_bs is None:
            return None
        return [
            v
            for v in self._cuda_graph_bs
            if step in self._slots[self._closest_bound(v)].candidate_set
        ]

    # ---------------------------------------------------------- introspection

    @property
    def config(self) -> AdaptiveConfig:
        return self._config

    def slot_bounds(self) -> list[int]:
        """Slot lower bounds, sorted."""
        return list(self._bs_list)

    def slot_state(self, bound: int) -> tuple[int, float]:
        """(current steps, EMA of accepted drafts) of the slot with lower bound ``bound``."""
        slot = self._slots.get(bound)
        if slot is None:
            raise KeyError(
                f"EmaPolicy.slot_state: no slot with lower bound {bound!r}; "
                f"slots are {self._bs_list}"
            )
        return slot.current_steps, slot.ema

    def slot_candidates(self, bound: int) -> list[int]:
        """Candidate steps of the slot with lower bound ``bound``."""
        slot = self._slots.get(bound)
        if slot is None:
            raise KeyError(
                f"EmaPolicy.slot_candidates: no slot with lower bound {bound!r}; "
                f"slots are {self._bs_list}"
            )
        return list(slot.candidates)

    def pad_batch_size(self, batch_size: int) -> int:
        """``batch_size`` padded up to the next CUDA-graph batch size (SGLang's padding)."""
        cg = self._cuda_graph_bs
        if cg is None:
            return batch_size
        idx = bisect.bisect_left(cg, batch_size)
        return cg[idx] if idx < len(cg) else batch_size

    def slot_bound_for(self, batch_size: int) -> int:
        """Lower bound of the slot a batch of ``batch_size`` is routed to (after padding)."""
        slot = self._route.get(batch_size)
        if slot is None:
            slot = self._route_slow(batch_size)
        return slot.bound

    @property
    def cuda_graph_bs(self) -> list[int] | None:
        """The sorted CUDA-graph batch sizes last set (None: graphs disabled)."""
        return None if self._cuda_graph_bs is None else list(self._cuda_graph_bs)

    # -------------------------------------------------------------- internals

    def _closest_bound(self, target: int) -> int:
        # Largest slot bound <= target; below the first bound, the first slot (SGLang).
        idx = bisect.bisect_right(self._bs_list, target) - 1
        return self._bs_list[max(0, idx)]

    def _route_slow(self, batch_size: int) -> _Slot:
        slot = self._slots[self._closest_bound(self.pad_batch_size(batch_size))]
        if len(self._route) >= _ROUTE_CACHE_MAX:
            self._route.clear()
        self._route[batch_size] = slot
        return slot
