"""Stand-ins the plugin tests share: a settable clock and accepted-draft counts per verify."""

from __future__ import annotations

import random


class Clock:
    def __init__(self, now_s: float = 1_700_000_000.0) -> None:
        self.now_s = now_s

    def __call__(self) -> float:
        return self.now_s


def draw_accepted(rng: random.Random, steps: int, n: int, p: float) -> list[int]:
    """Accepted drafts per request: each position accepted with probability ``p``."""
    out = []
    for _ in range(n):
        k = 0
        while k < steps and rng.random() < p:
            k += 1
        out.append(k)
    return out
