"""The clairvoyant oracle: per decode batch, the steps that maximise tokens per second.

A benchmark yardstick, not a policy anyone could run: the simulator knows every running
request's true upcoming acceptance (``AcceptanceSampler.peek``: the draw the engine is
about to make, looked at without consuming the random stream), so for each candidate
step ``k`` the oracle knows exactly how many tokens the batch would emit,

    tokens(k) = sum over running requests of min(accepted_i(k) + 1, remaining_i),

and, from the engine's own cost model, what the step would cost, ``time(k) =
decode_step_s(batch, k, kv_used)``. It picks ``argmax tokens(k) / time(k)`` (ties: the
smaller ``k``). Steps whose verified tokens would not fit in the free KV pool are
skipped while one fits (choosing them would force a retraction, whose recompute the
ratio does not see); when none fits the smallest step is taken.

It is myopic (each batch on its own; no look-ahead over future batches or arrivals),
deterministic (no randomness of its own; the acceptance draws are the common random
numbers every policy sees) and changes nothing another policy sees: peeking leaves each
request's stream as it is, and every run builds its own samplers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from specgov.simulator.engine import EngineConfig, StepCost

__all__ = ["ClairvoyantOracle", "OracleError"]


class OracleError(ValueError):
    """The oracle was set up wrongly (bad candidates, used outside an engine)."""


class ClairvoyantOracle:
    """In-engine policy (``AdaptiveSpecPolicy`` + the engine's ``BatchOracle`` hook)."""

    def __init__(self, candidate_steps: Sequence[int], initial_steps: int | None = None) -> None:
        steps = sorted(set(candidate_steps))
        if not steps or any(isinstance(k, bool) or not isinstance(k, int) or k < 0 for k in steps):
            raise OracleError(
                f"oracle candidate_steps: expected non-negative ints, got {list(candidate_steps)!r}"
            )
        if initial_steps is not None and initial_steps not in steps:
            raise OracleError(f"oracle initial_steps {initial_steps!r} is not in {steps}")
        self._steps = steps
        self._choice = initial_steps if initial_steps is not None else steps[0]
        self._cuda_graph_bs: list[int] | None = None
        self._cost: StepCost | None = None
        self._config: EngineConfig | None = None
        self._batch_size = -1  # the batch the last observe_batch described
        self.decisions = 0

    # ----------------------------------------------------------- AdaptiveSpecPolicy

    @property
    def candidate_steps(self) -> list[int]:
        return list(self._steps)

    def set_cuda_graph_bs(self, cuda_graph_bs: list[int] | None) -> None:
        self._cuda_graph_bs = sorted(cuda_graph_bs) if cuda_graph_bs else None

    def cuda_graph_bs_for_step(self, step: int) -> list[int] | None:
        """Every captured batch size for every step: the oracle may pick any anywhere."""
        if self._cuda_graph_bs is None:
            return None
        return list(self._cuda_graph_bs) if step in self._steps else []

    def get_steps_for_batch(self, batch_size: int) -> int:
        if self._batch_size >= 0 and batch_size != self._batch_size:
            # The engine describes each decode batch first; a mismatch means a caller
            # other than the engine, which would get a stale answer.
            raise OracleError(
                f"oracle asked for batch {batch_size} but shown a batch of {self._batch_size}"
            )
        return self._choice

    def on_verify_complete(
        self, num_correct_drafts_per_req: list[int], batch_size: int
    ) -> int | None:
        self._batch_size = -1
        return None

    # --------------------------------------------------------------- BatchOracle hook

    def bind_engine(self, cost: StepCost, config: EngineConfig) -> None:
        self._cost = cost
        self._config = config

    def observe_batch(
        self,
        peeks: Sequence[Callable[[int], int]],
        remaining_tokens: Sequence[int],
        kv_used_tokens: int,
    ) -> None:
        cost, cfg = self._cost, self._config
        if cost is None or cfg is None:
            raise OracleError("oracle: observe_batch before bind_engine (run it in an Engine)")
        bsz = len(peeks)
        self._batch_size = bsz
        if bsz == 0:
            return
        free = cfg.kv_token_capacity - kv_used_tokens
        steps = [
            k for k in self._steps if bsz == 1 or bsz * cfg.verify_tokens_per_request(k) <= free
        ]
        if not steps:
            self._choice = self._steps[0]
            self.decisions += 1
            return
        tokens = self._tokens(steps, peeks, remaining_tokens, chain=cfg.topk == 1)
        best_k = steps[0]
        best = -1.0
        for k in steps:
            rate = tokens[k] / cost.decode_step_s(bsz, k, kv_used_tokens)
            if rate > best:  # strict: ties keep the smaller step
                best, best_k = rate, k
        self._choice = best_k
        self.decisions += 1

    @staticmethod
    def _tokens(
        steps: Sequence[int],
        peeks: Sequence[Callable[[int], int]],
        remaining: Sequence[int],
        *,
        chain: bool,
    ) -> dict[int, int]:
        """Tokens the batch emits at each step (bonus token included, capped by output)."""
        bsz = len(peeks)
        if not chain:
            # Trees: per-depth pass rates depend on the shape at each step; peek each.
            out: dict[int, int] = {}
            for k in steps:
                total = 0
                for peek, rem in zip(peeks, remaining, strict=True):
                    a = peek(k) + 1
                    total += a if a < rem else rem
                out[k] = total
            return out
        # Chains: accepted(k) = min(accepted(k_max), k), one peek per request.
        k_max = steps[-1]
        hist = [0] * (k_max + 1)  # requests by extra tokens they can take, capped at k_max
        for peek, rem in zip(peeks, remaining, strict=True):
            c = peek(k_max) if k_max > 0 else 0
            if c > rem - 1:
                c = max(rem - 1, 0)
            hist[c] += 1
        out = {}
        for k in steps:
            # sum_i min(c_i, k) = sum over c of hist[c] * min(c, k)
            out[k] = bsz + sum(n * (c if c < k else k) for c, n in enumerate(hist))
        return out
