"""A seeded generator's state as four plain ints, so a policy's state can carry it.

Daemon policies that draw at random (the bandit, goodput's probes) keep numpy's PCG64
state in their saved state and rebuild the generator from it at each decision: the same
inputs give the same draws, across restarts. :data:`RngState` is PCG64's
``(state, inc, has_uint32, uinteger)``; how a state file writes the two 128-bit words
(decimal or hex strings) is each state's own, versioned format.
"""

from __future__ import annotations

from typing import TypeAlias

import numpy as np

__all__ = ["RngState", "generator", "rng_state_of", "seeded_rng_state"]

RngState: TypeAlias = tuple[int, int, int, int]  # PCG64 (state, inc, has_uint32, uinteger)


def rng_state_of(gen: np.random.Generator) -> RngState:
    """The PCG64 state of ``gen``."""
    st = gen.bit_generator.state
    return (
        int(st["state"]["state"]),
        int(st["state"]["inc"]),
        int(st["has_uint32"]),
        int(st["uinteger"]),
    )


def seeded_rng_state(seed: int) -> RngState:
    """The state of a fresh PCG64 generator seeded with ``seed``."""
    return rng_state_of(np.random.default_rng(seed))


def generator(state: RngState) -> np.random.Generator:
    """A PCG64 generator at ``state`` (numpy refuses a malformed one: ValueError)."""
    bit = np.random.PCG64(0)
    bit.state = {
        "bit_generator": "PCG64",
        "state": {"state": state[0], "inc": state[1]},
        "has_uint32": state[2],
        "uinteger": state[3],
    }
    return np.random.Generator(bit)
