"""The lossy acceptance-threshold knob exists only behind Budget.allow_lossy."""

from __future__ import annotations

import math
from typing import Any

import pytest

from specgov.adapters.lossy_guard import (
    SET_INTERNAL_STATE_PATH,
    LossyGuardError,
    LossyNotAllowedError,
    build_lossless_restore_request,
    build_lossy_threshold_request,
)
from specgov.policies.types import Budget


def budget(allow_lossy: bool) -> Budget:
    return Budget(
        vram_gib=None,
        slo_tpot_ms=50.0,
        slo_itl_p99_ms=None,
        slo_ttft_p99_ms=None,
        allowed_steps=None,
        allow_lossy=allow_lossy,
    )


@pytest.mark.parametrize(("single", "acc"), [(0.9, 0.8), (1.0, 0.5), (1.0, 1.0)])
def test_refused_without_allow_lossy(single: float, acc: float) -> None:
    with pytest.raises(LossyNotAllowedError) as err:
        build_lossy_threshold_request(budget(False), single, acc)
    message = str(err.value)
    assert "output distribution" in message
    assert "allow_lossy" in message
    assert f"speculative_accept_threshold_single={single}" in message
    assert isinstance(err.value, ValueError)


def test_default_budget_refuses() -> None:
    default = Budget(None, None, None, None, None)
    assert default.allow_lossy is False
    with pytest.raises(LossyNotAllowedError):
        build_lossy_threshold_request(default, 0.7, 0.7)


def test_built_with_allow_lossy() -> None:
    path, body = build_lossy_threshold_request(budget(True), 0.9, 0.75)
    assert path == SET_INTERNAL_STATE_PATH == "/set_internal_state"
    assert body == {
        "server_args": {
            "speculative_accept_threshold_single": 0.9,
            "speculative_accept_threshold_acc": 0.75,
        }
    }
    _, ints = build_lossy_threshold_request(budget(True), 1, 1)
    assert all(type(v) is float for v in ints["server_args"].values())


@pytest.mark.parametrize(
    "bad", [0, 0.0, -0.1, 1.0000001, 2, math.nan, math.inf, -math.inf, True, "0.9", None]
)
@pytest.mark.parametrize("allow", [True, False])
def test_bad_values_are_refused_first(bad: Any, allow: bool) -> None:
    for single, acc, name in ((bad, 1.0, "single"), (1.0, bad, "acc")):
        with pytest.raises(LossyGuardError) as err:
            build_lossy_threshold_request(budget(allow), single, acc)
        assert not isinstance(err.value, LossyNotAllowedError)
        assert f"speculative_accept_threshold_{name}: expected a number in (0, 1]" in str(err.value)


def test_budget_must_be_a_budget() -> None:
    with pytest.raises(LossyGuardError, match="expected a Budget"):
        build_lossy_threshold_request({"allow_lossy": True}, 0.9, 0.9)  # type: ignore[arg-type]


def test_restore_needs_no_opt_in() -> None:
    path, body = build_lossless_restore_request()
    assert path == "/set_internal_state"
    assert body["server_args"] == {
        "speculative_accept_threshold_single": 1.0,
        "speculative_accept_threshold_acc": 1.0,
    }
