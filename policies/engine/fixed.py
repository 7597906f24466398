"""A fixed step count: what SGLang does without ``--speculative-adaptive``."""

from __future__ import annotations

from specgov.policies.common.types import PolicyTypeError
from specgov.policies.common.validation import is_int


class FixedStepPolicy:
    """Always ``steps`` draft steps, for every batch size.

    Implements :class:`~specgov.policies.engine.protocol.AdaptiveSpecPolicy` with a single
    candidate, so an engine (or the simulator) builds exactly one runtime state.
    """

    __slots__ = ("_cuda_graph_bs", "_steps")

    def __init__(self, steps: int) -> None:
        if not is_int(steps) or steps < 0:
            raise PolicyTypeError(f"FixedStepPolicy.steps: expected an int >= 0, got {steps!r}")
        self._steps = steps
        self._cuda_graph_bs: list[int] | None = None

    @property
    def steps(self) -> int:
        return self._steps

    @property
    def candidate_steps(self) -> list[int]:
        return [self._steps]

    def set_cuda_graph_bs(self, cuda_graph_bs: list[int] | None) -> None:
        self._cuda_graph_bs = sorted(cuda_graph_bs) if cuda_graph_bs else None

    def get_steps_for_batch(self, batch_size: int) -> int:
        return self._steps

    def on_verify_complete(
        self, num_correct_drafts_per_req: list[int], batch_size: int
    ) -> int | None:
        return None

    def cuda_graph_bs_for_step(self, step: int) -> list[int] | None:
        """Every CUDA-graph batch size runs the one step; no other step is reachable."""
        if self._cuda_graph_bs is None:
            return None
        return list(self._cuda_graph_bs) if step == self._steps else []
