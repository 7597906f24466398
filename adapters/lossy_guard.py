"""The one live speculation knob that changes outputs, behind an explicit opt-in.

SGLang 0.5.23 lets ``POST /set_internal_state`` (``entrypoints/http_server.py``) change
``speculative_accept_threshold_single`` and ``speculative_accept_threshold_acc`` on a
running server (``managers/scheduler_components/internal_state.py``, the only
speculation keys its update handlers accept). Both are sampling-acceptance thresholds:
``single`` accepts a draft token whose target probability exceeds it, ``acc`` raises a
draft token's acceptance probability from p to min(1, p / acc). At 1.0 (SGLang's
default) verification samples exactly from the target model; below 1.0 more drafts are
accepted and the output distribution is no longer the target model's: acceptance
becomes LOSSY. So specgov builds this request only when the operator's
:class:`~specgov.policies.types.Budget` says ``allow_lossy=True``.

Notes from SGLang's code: the request body is ``{"server_args": {key: number}}``; the
server validates nothing but DFlash sampling-mask conflicts, so the range check lives
here; ``--speculative-use-rejection-sampling`` ignores both thresholds (SGLang refuses
the combination at launch, not at run time); a change resets SGLang's cumulative
accept-length counters. The endpoint needs the admin API key when one is configured.

No HTTP here: the daemon sends what these builders return.
"""

from __future__ import annotations

import math
from typing import Any, Final

from specgov.policies.types import Budget

SET_INTERNAL_STATE_PATH: Final = "/set_internal_state"
SET_INTERNAL_STATE_METHOD: Final = "POST"
THRESHOLD_KEYS: Final = (
    "speculative_accept_threshold_single",
    "speculative_accept_threshold_acc",
)
LOSSLESS_THRESHOLD: Final = 1.0


class LossyGuardError(ValueError):
    """A threshold request is malformed (bad value or budget)."""


class LossyNotAllowedError(LossyGuardError):
    """A lossy threshold change was asked for without ``Budget.allow_lossy``."""


def _check_threshold(name: str, value: object) -> float:
    if (
        not isinstance(value, int | float)
        or isinstance(value, bool)
        or not math.isfinite(value)
        or not 0.0 < value <= 1.0
    ):
        raise LossyGuardError(
            f"{name}: expected a number in (0, 1] (1.0 = lossless, SGLang's default), got {value!r}"
        )
    return float(value)


def _body(single: float, acc: float) -> dict[str, Any]:
    return {"server_args": {THRESHOLD_KEYS[0]: single, THRESHOLD_KEYS[1]: acc}}


def build_lossy_threshold_request(
    budget: Budget, single: float, acc: float
) -> tuple[str, dict[str, Any]]:
    """``(path, json_body)`` for ``POST /set_internal_state`` setting both thresholds.

    Raises :class:`LossyNotAllowedError` unless ``budget.allow_lossy`` is True (for any
    values: this is the lossy knob, and restoring losslessness has its own builder,
    :func:`build_lossless_restore_request`), and :class:`LossyGuardError` for a value
    outside (0, 1].
    """
    if not isinstance(budget, Budget):
        raise LossyGuardError(f"budget: expected a Budget, got {budget!r}")
    single_v = _check_threshold(THRESHOLD_KEYS[0], single)
    acc_v = _check_threshold(THRESHOLD_KEYS[1], acc)
    if budget.allow_lossy is not True:
        raise LossyNotAllowedError(
            f"refusing to set {THRESHOLD_KEYS[0]}={single_v}, {THRESHOLD_KEYS[1]}={acc_v} "
            f"via {SET_INTERNAL_STATE_METHOD} {SET_INTERNAL_STATE_PATH}: acceptance thresholds "
            "below 1.0 accept drafts the target model would not have sampled, which changes "
            "the output distribution (lossy speculation). Set allow_lossy: true in the "
            "budget to permit it."
        )
    return SET_INTERNAL_STATE_PATH, _body(single_v, acc_v)


def build_lossless_restore_request() -> tuple[str, dict[str, Any]]:
    """``(path, json_body)`` putting both thresholds back to 1.0 (lossless).

    Needs no opt-in: it can only undo a lossy setting, e.g. after an operator
    withdrew ``allow_lossy``.
    """
    return SET_INTERNAL_STATE_PATH, _body(LOSSLESS_THRESHOLD, LOSSLESS_THRESHOLD)
