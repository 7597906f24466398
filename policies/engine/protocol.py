"""The in-engine policy protocol, mirroring SGLang's exactly.

Copy of ``AdaptiveSpecPolicy`` from sglang 0.5.23
(``sglang/srt/speculative/adaptive_runtime_state.py``); a contract test checks the
member names, parameter names and annotations against the real one. SGLang's
``AdaptiveController`` calls, in this order: ``set_cuda_graph_bs`` and
``cuda_graph_bs_for_step`` (for each of ``candidate_steps``) once at start-up, then
per decode batch ``get_steps_for_batch`` before the forward and
``on_verify_complete`` after the verify (accepted drafts exclude the bonus token).
Every step returned must be one of ``candidate_steps``, or the controller raises.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class AdaptiveSpecPolicy(Protocol):
    """Policy interface used by SGLang's AdaptiveController to select runtime states."""

    @property
    def candidate_steps(self) -> list[int]: ...

    def set_cuda_graph_bs(self, cuda_graph_bs: list[int] | None) -> None: ...

    def get_steps_for_batch(self, batch_size: int) -> int: ...

    def on_verify_complete(
        self, num_correct_drafts_per_req: list[int], batch_size: int
    ) -> int | None: ...

    def cuda_graph_bs_for_step(self, step: int) -> list[int] | None: ...
