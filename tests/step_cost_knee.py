"""The verify knee of a step-cost state: a test helper (no source code needs it)."""

from __future__ import annotations

from specgov.policies.daemon.estimators.step_cost import StepCostState, predict_step_s


def verify_knee_tokens(
    state: StepCostState,
    *,
    kv_tokens: float = 0.0,
    tolerance: float = 0.25,
    max_tokens: int = 16384,
) -> int:
    """Batched tokens at which verification stops being free.

    The smallest number of tokens ``n`` verified in one step (``n`` requests without
    drafts, ``kv_tokens`` total cached tokens) whose predicted step time exceeds that
    of one token by more than ``tolerance``; ``max_tokens`` if none does.
    """
    base = predict_step_s(state, 1.0, 0, kv_tokens) * (1.0 + tolerance)
    if predict_step_s(state, float(max_tokens), 0, kv_tokens) <= base:
        return max_tokens
    lo, hi = 1, max_tokens  # predict(lo) <= base < predict(hi); monotone in between
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if predict_step_s(state, float(mid), 0, kv_tokens) > base:
            hi = mid
        else:
            lo = mid
    return hi
