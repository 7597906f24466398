"""The stale-drafter penalty of one request (``SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND``).

Used by the acceptance samplers (``specgov.simulator.engine.acceptance``); its own random
stream, so a request that never goes stale draws exactly what it drew without it.
"""

from __future__ import annotations

import random

__all__ = ["ColdDrafter"]


class ColdDrafter:
    """Stale-drafter penalty of one request (SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND).

    With the flag, SGLang 0.5.23 replaces the step-0 draft-extend pass by zeroed stubs
    (``EAGLEWorkerV2._stub_skipped_draft_extend``): an upshift then drafts from zeroed
    hidden states and top-k ids, so the first drafted verify after it accepts nothing,
    and the drafter's KV lacks every token generated at step 0. So after a request went
    through such verifies, its next drafted verify rejects its first draft, and the
    ``verifies`` after that reject it with probability ``penalty * (verifies - i) /
    verifies`` for the i-th (0-based): accepted drafts fall by ``penalty`` at first,
    recovering linearly. Its own random stream, so a request that never goes stale draws
    exactly what it drew before.
    """

    __slots__ = ("_key", "_rng", "forced", "left", "penalty", "pending", "total")

    def __init__(self, key: str) -> None:
        self._key = key
        self._rng: random.Random | None = None
        self.forced = False
        self.left = 0
        self.total = 0
        self.penalty = 0.0
        self.pending = -1.0  # the next cold verify's uniform, drawn early by peek

    def start(self, penalty: float, verifies: int) -> None:
        self.forced = True
        self.left = verifies + 1  # the forced verify, then the recovery
        self.total = verifies
        self.penalty = penalty

    def rejects_first(self, consume: bool) -> bool:
        """Whether the next drafted verify loses its first draft (``left`` > 0 only)."""
        if self.forced:
            if consume:
                self.forced = False
                self.left -= 1
            return True
        u = self.pending
        if u < 0.0:
            if self._rng is None:
                self._rng = random.Random(self._key)
            u = self._rng.random()
        p = self.penalty * self.left / self.total
        if consume:
            self.pending = -1.0
            self.left -= 1
        else:
            self.pending = u
        return u < p
