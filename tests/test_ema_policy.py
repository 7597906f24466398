"""EmaPolicy (SGLang's EMA controller), FixedStepPolicy and the adaptive config parser.

Call-for-call equality with SGLang's own class is checked in
tests/contract/test_sglang_adaptive.py; these tests pin the behaviour itself, with
hand-computed expectations.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specgov.policies.common.types import PolicyTypeError
from specgov.policies.engine.adaptive_config import (
    DEFAULT_ADAPTIVE_CONFIG,
    AdaptiveConfig,
    AdaptiveConfigError,
    parse_adaptive_config,
)
from specgov.policies.engine.ema import EmaPolicy
from specgov.policies.engine.fixed import FixedStepPolicy
from specgov.policies.engine.protocol import AdaptiveSpecPolicy


def one_slot(steps: list[int], **knobs: Any) -> dict[str, Any]:
    """A one-slot config; alpha 1 makes the EMA equal the last batch mean."""
    base = {"ema_alpha": 1.0, "warmup_batches": 0, "update_interval": 1}
    return {"1": {"candidate_steps": steps, **base, **knobs}}


# ----------------------------------------------------------------- initial state


def test_initial_steps_per_slot_of_default_config() -> None:
    policy = EmaPolicy(3)
    assert policy.candidate_steps == [0, 1, 3, 5, 7]
    assert policy.slot_bounds() == [1, 8, 32, 64]
    # 3 is a candidate of slots 1 and 8; slot 32 ([0, 1]) takes candidates[2 // 2] = 1;
    # slot 64 ([0]) takes 0. The EMA starts at steps - 1.
    assert [policy.slot_state(b) for b in (1, 8, 32, 64)] == [
        (3, 2.0),
        (3, 2.0),
        (1, 0.0),
        (0, -1.0),
    ]


def test_initial_step_not_a_candidate_takes_the_middle_one() -> None:
    policy = EmaPolicy(4, one_slot([7, 1, 5, 3, 3]))
    assert policy.slot_state(1) == (5, 4.0)  # sorted unique [1, 3, 5, 7], index 2
    assert policy.get_steps_for_batch(1) == 5


def test_slot_state_of_unknown_bound_names_it() -> None:
    with pytest.raises(KeyError, match="lower bound 2"):
        EmaPolicy(3).slot_state(2)


# ------------------------------------------------------- warm-up and update interval


def test_warmup_then_interval() -> None:
    policy = EmaPolicy(1, one_slot([1, 3, 5, 7], warmup_batches=4, update_interval=3))
    changes = [policy.on_verify_complete([7, 7], 2) for _ in range(10)]
    # Batches 1..4 are warm-up; then a recompute every 3rd batch: batch 7 and batch 10.
    # With alpha 1 and mean 7 the walk climbs 1 -> 7 in one recompute.
    assert changes == [None] * 6 + [7, None, None, None]
    assert policy.slot_state(1) == (7, 7.0)


def test_empty_verify_does_not_count_as_a_batch() -> None:
    policy = EmaPolicy(1, one_slot([1, 3], warmup_batches=2))
    assert policy.on_verify_complete([3], 1) is None
    assert policy.on_verify_complete([], 1) is None  # no-op
    assert policy.on_verify_complete([3], 1) is None
    assert policy.on_verify_complete([3], 1) == 3  # third real batch


def test_ema_update_rule() -> None:
    policy = EmaPolicy(3, one_slot([3], ema_alpha=0.25))
    policy.on_verify_complete([0, 2, 4], 3)  # mean 2
    assert policy.slot_state(1)[1] == pytest.approx(0.75 * 2.0 + 0.25 * 2.0)
    policy.on_verify_complete([3], 1)
    assert policy.slot_state(1)[1] == pytest.approx(0.75 * 2.0 + 0.25 * 3.0)


# ----------------------------------------------------------------------- hysteresis


def batch_with_mean(mean: float, n: int = 20) -> list[int]:
    """n accepted-draft counts whose mean is exactly ``mean`` (mean * n integral)."""
    total = round(mean * n)
    assert total == mean * n
    batch = [total // n] * n
    for i in range(total - sum(batch)):
        batch[i] += 1
    assert sum(batch) / n == mean
    return batch


@pytest.mark.parametrize(
    ("start", "mean", "down", "up", "expected"),
    [
        (7, 2.0, -0.25, 0.0, 3),  # drops past 5 (4.25) and 3 (2.25), not to 1 (0.25)
        (7, 2.3, -0.25, 0.0, 5),  # 2.3 > 2.25: stops at 5
        (7, 2.25, -0.25, 0.0, 3),  # exactly on the drop threshold drops (<=)
        (3, 4.6, -0.25, 0.0, 7),  # climbs past 2.5 and 4.5 in one recompute
        (3, 4.5, -0.25, 0.0, 5),  # exactly on the rise threshold does not climb (>)
        (3, 2.6, -0.25, 0.5, 3),  # up hysteresis: 2.6 <= 3.0, holds
        (3, 3.1, -0.25, 0.5, 5),
        (5, 3.5, 0.0, 0.0, 5),  # 3.5 > 2.5 (no drop) and 3.5 <= 4.5 (no rise)
    ],
)
def test_hysteresis_walk(start: int, mean: float, down: float, up: float, expected: int) -> None:
    policy = EmaPolicy(start, one_slot([1, 3, 5, 7], down_hysteresis=down, up_hysteresis=up))
    result = policy.on_verify_complete(batch_with_mean(mean), 20)
    assert policy.slot_state(1) == (expected, mean)
    assert result == (expected if expected != start else None)


def test_moving_down_never_moves_up_in_the_same_recompute() -> None:
    # Negative up hysteresis makes "up" true right after a drop; SGLang skips the up
    # walk once it moved down.
    policy = EmaPolicy(7, one_slot([1, 3, 5, 7], down_hysteresis=0.0, up_hysteresis=-1.0))
    assert policy.on_verify_complete([4], 1) == 5  # 4 <= 4.5 drops; 4 > 3.5 would rise
    assert policy.slot_state(1) == (5, 4.0)


def test_zero_floor_threshold_is_half_plus_down_hysteresis() -> None:
    policy = EmaPolicy(1, one_slot([0, 1], down_hysteresis=-0.25))
    # 0.3 > 0.25: stays at 1. 0.25: drops to 0.
    assert policy.on_verify_complete([0, 0, 1, 0, 0, 0, 1, 0, 0, 1], 10) is None
    assert policy.on_verify_complete([1, 0, 0, 0], 4) == 0


# ---------------------------------------------------------------------- zero probe


def test_zero_steps_skip_ema_but_count_batches_then_probe() -> None:
    policy = EmaPolicy(0, one_slot([0, 2, 4], ema_alpha=0.5, warmup_batches=1, update_interval=2))
    assert policy.slot_state(1) == (0, -1.0)
    assert policy.on_verify_complete([9, 9], 2) is None  # warm-up; EMA untouched at 0 steps
    assert policy.on_verify_complete([9], 1) is None
    assert policy.slot_state(1) == (0, -1.0)
    # Third batch: recompute. From 0 the slot always probes the next candidate, and a
    # negative EMA (no history) restarts at the probed step's neutral value 2 - 1.
    assert policy.on_verify_complete([9], 1) == 2
    assert policy.slot_state(1) == (2, 1.0)
    # Now the EMA moves again: 0.5 * 1 + 0.5 * 0 = 0.5.
    policy.on_verify_complete([0], 1)
    assert policy.slot_state(1)[1] == 0.5


def test_zero_probe_keeps_a_non_negative_ema() -> None:
    policy = EmaPolicy(1, one_slot([0, 1, 3], ema_alpha=1.0))
    assert policy.on_verify_complete([0], 1) == 0  # ema 0 <= 0.5 - 0.25
    assert policy.slot_state(1) == (0, 0.0)
    assert policy.on_verify_complete([5], 1) == 1  # probe; EMA (0.0) not reset
    assert policy.slot_state(1) == (1, 0.0)


def test_zero_only_slot_stays_at_zero() -> None:
    policy = EmaPolicy(3, one_slot([0]))
    for _ in range(5):
        assert policy.on_verify_complete([0], 1) is None
    assert policy.slot_state(1) == (0, -1.0)


# --------------------------------------------------------------------- ceiling_coeff


def test_ceiling_caps_a_hold_but_not_a_rise() -> None:
    cfg = one_slot([1, 3, 5, 7], ceiling_coeff=1.0)
    policy = EmaPolicy(7, cfg)
    # ema 5: no drop from 7 (5 > 4.25); the ceiling ceil(5 * 1) = 5 caps the hold.
    assert policy.on_verify_complete([5], 1) == 5
    without = EmaPolicy(7, one_slot([1, 3, 5, 7]))
    assert without.on_verify_complete([5], 1) is None
    # A rise is never capped: from 3 with ema 6.6 (ceiling 7 anyway) and with coeff 0.5
    # (ceiling 4) the walk still climbs to 7.
    rising = EmaPolicy(3, one_slot([1, 3, 5, 7], ceiling_coeff=0.5))
    assert rising.on_verify_complete([7], 1) == 7


def test_ceiling_is_at_least_one() -> None:
    # ema 0 with a very low drop threshold keeps step 1; ceil(0) = 0 but the ceiling
    # is max(1, .) so step 1 stays (a ceiling of 0 would force step 0).
    policy = EmaPolicy(1, one_slot([0, 1, 3], ceiling_coeff=1.0, down_hysteresis=-1.0))
    assert policy.on_verify_complete([0], 1) is None
    assert policy.slot_state(1) == (1, 0.0)


# ------------------------------------------------------------- routing and padding


def test_routing_without_cuda_graphs() -> None:
    policy = EmaPolicy(3)
    assert [policy.slot_bound_for(b) for b in (0, 1, 7, 8, 31, 32, 63, 64, 500)] == [
        1,
        1,
        1,
        8,
        8,
        32,
        32,
        64,
        64,
    ]
    assert policy.cuda_graph_bs is None
    assert policy.cuda_graph_bs_for_step(3) is None


def test_padding_to_cuda_graph_batch_sizes() -> None:
    policy = EmaPolicy(3)
    assert policy.slot_bound_for(5) == 1
    policy.set_cuda_graph_bs([64, 1, 2, 4, 8, 16, 32])  # sorted internally
    assert policy.cuda_graph_bs == [1, 2, 4, 8, 16, 32, 64]
    # 5 pads to 8 -> slot 8 (the routing memo was reset by set_cuda_graph_bs).
    assert policy.pad_batch_size(5) == 8
    assert policy.slot_bound_for(5) == 8
    assert policy.get_steps_for_batch(5) == 3
    assert policy.pad_batch_size(17) == 32
    assert policy.get_steps_for_batch(17) == 1  # slot 32's initial step
    # Past the largest graph the batch runs eagerly at its own size.
    assert policy.pad_batch_size(65) == 65
    assert policy.pad_batch_size(0) == 1
    policy.set_cuda_graph_bs([])
    assert policy.cuda_graph_bs is None


def test_cuda_graph_bs_for_step() -> None:
    policy = EmaPolicy(3)
    policy.set_cuda_graph_bs([1, 2, 4, 8, 16, 32, 48, 64, 128])
    assert policy.cuda_graph_bs_for_step(7) == [1, 2, 4]
    assert policy.cuda_graph_bs_for_step(3) == [1, 2, 4, 8, 16]
    assert policy.cuda_graph_bs_for_step(1) == [1, 2, 4, 8, 16, 32, 48]
    assert policy.cuda_graph_bs_for_step(0) == [8, 16, 32, 48, 64, 128]
    assert policy.cuda_graph_bs_for_step(2) == []


def test_verify_feeds_only_the_routed_slot() -> None:
    policy = EmaPolicy(3, {"1": {"candidate_steps": [1, 3]}, "8": {"candidate_steps": [1, 3]}})
    before = policy.slot_state(1)
    policy.on_verify_complete([0] * 10, 10)
    assert policy.slot_state(1) == before
    assert policy.slot_state(8) == (3, pytest.approx(0.8 * 2.0))


def test_slot_zero_bound_is_allowed_like_sglang() -> None:
    policy = EmaPolicy(1, {"0": {"candidate_steps": [1]}, "4": {"candidate_steps": [3]}})
    assert policy.slot_bounds() == [0, 4]
    assert [policy.get_steps_for_batch(b) for b in (0, 3, 4)] == [1, 1, 3]


@settings(max_examples=60, deadline=None)
@given(
    bounds=st.lists(st.integers(1, 200), min_size=1, max_size=5, unique=True),
    graphs=st.none() | st.lists(st.integers(1, 300), min_size=1, max_size=20),
    batch_size=st.integers(0, 400),
)
def test_routing_is_largest_bound_at_or_below_the_padded_size(
    bounds: list[int], graphs: list[int] | None, batch_size: int
) -> None:
    policy = EmaPolicy(1, {str(b): {"candidate_steps": [1]} for b in bounds})
    policy.set_cuda_graph_bs(graphs)
    padded = batch_size
    if graphs:
        bigger = [g for g in sorted(graphs) if g >= batch_size]
        padded = bigger[0] if bigger else batch_size
    assert policy.pad_batch_size(batch_size) == padded
    below = [b for b in bounds if b <= padded]
    assert policy.slot_bound_for(batch_size) == (max(below) if below else min(bounds))


def test_is_an_adaptive_spec_policy() -> None:
    assert isinstance(EmaPolicy(3), AdaptiveSpecPolicy)
    assert isinstance(FixedStepPolicy(3), AdaptiveSpecPolicy)


def test_candidate_steps_is_a_copy() -> None:
    policy = EmaPolicy(3)
    policy.candidate_steps.append(99)
    assert policy.candidate_steps == [0, 1, 3, 5, 7]


# ---------------------------------------------------------------- FixedStepPolicy


def test_fixed_step_policy() -> None:
    policy = FixedStepPolicy(4)
    assert policy.candidate_steps == [4]
    assert [policy.get_steps_for_batch(b) for b in (1, 64, 300)] == [4, 4, 4]
    assert policy.on_verify_complete([4, 0], 2) is None
    assert policy.cuda_graph_bs_for_step(4) is None
    policy.set_cuda_graph_bs([8, 1, 2])
    assert policy.cuda_graph_bs_for_step(4) == [1, 2, 8]
    assert policy.cuda_graph_bs_for_step(3) == []


@pytest.mark.parametrize("bad", [-1, 1.5, True, "3"])
def test_fixed_step_policy_rejects_bad_steps(bad: Any) -> None:
    with pytest.raises(PolicyTypeError, match=r"FixedStepPolicy\.steps"):
        FixedStepPolicy(bad)


# --------------------------------------------------------------- config parsing


def test_default_config_parses_to_sglang_slots() -> None:
    cfg = parse_adaptive_config(DEFAULT_ADAPTIVE_CONFIG)
    assert isinstance(cfg, AdaptiveConfig)
    assert cfg.bounds == (1, 8, 32, 64)
    assert [s.candidate_steps for s in cfg.slots] == [(1, 3, 5, 7), (0, 1, 3), (0, 1), (0,)]
    assert [s.down_hysteresis for s in cfg.slots] == [-0.25, 0.0, 0.0, 0.0]
    assert cfg.slots[0].ema_alpha == 0.2 and cfg.slots[0].update_interval == 5
    assert cfg.slots[0].warmup_batches == 10 and cfg.slots[0].ceiling_coeff == 0.0
    assert cfg.candidate_steps == [0, 1, 3, 5, 7]
    assert parse_adaptive_config(DEFAULT_ADAPTIVE_CONFIG).candidate_steps == [0, 1, 3, 5, 7]


def test_non_digit_keys_are_defaults_and_slots_win() -> None:
    cfg = parse_adaptive_config(
        {
            "ema_alpha": 0.5,
            "warmup_batches": 2,
            "comment": "ignored, as in SGLang",
            "1": {"candidate_steps": [3, 1], "warmup_batches": 7},
            "16": {"candidate_steps": [0]},
        }
    )
    one, sixteen = cfg.slots
    assert (one.ema_alpha, one.warmup_batches, one.candidate_steps) == (0.5, 7, (1, 3))
    assert (sixteen.ema_alpha, sixteen.warmup_batches) == (0.5, 2)


def test_errors_name_source_and_key() -> None:
    with pytest.raises(AdaptiveConfigError, match=r"cfg\.json: key '8' \(BS 8\): candidate_steps"):
        parse_adaptive_config({"8": {"candidate_steps": [1, -2]}}, source="cfg.json")
    with pytest.raises(AdaptiveConfigError, match=r"cfg\.json: .*at least one integer-string"):
        parse_adaptive_config({"default": {}}, source="cfg.json")
    with pytest.raises(AdaptiveConfigError, match=r"cfg\.json: key '4'\.ema_alpha: .*\[0, 1\]"):
        parse_adaptive_config({"4": {"candidate_steps": [1], "ema_alpha": 2}}, source="cfg.json")
    with pytest.raises(AdaptiveConfigError, match=r"cfg\.json: key 'update_interval': .*>= 1"):
        parse_adaptive_config(
            {"update_interval": 0, "4": {"candidate_steps": [1]}}, source="cfg.json"
        )
    with pytest.raises(AdaptiveConfigError, match=r"must be a JSON object"):
        parse_adaptive_config([1, 2], source="cfg.json")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("knob", "bad"),
    [
        ("ema_alpha", -0.1),
        ("ema_alpha", "0.2"),
        ("ema_alpha", float("nan")),
        ("update_interval", 2.5),
        ("update_interval", True),
        ("warmup_batches", -1),
        ("down_hysteresis", float("inf")),
        ("up_hysteresis", None),
        ("ceiling_coeff", -1),
    ],
)
def test_bad_knobs_rejected(knob: str, bad: Any) -> None:
    with pytest.raises(AdaptiveConfigError, match=knob):
        parse_adaptive_config({"1": {"candidate_steps": [1], knob: bad}}, source="x")


def test_bool_steps_rejected() -> None:
    with pytest.raises(AdaptiveConfigError, match="candidate_steps"):
        parse_adaptive_config({"1": {"candidate_steps": [True]}})


def test_ema_policy_accepts_parsed_config() -> None:
    cfg = parse_adaptive_config({"1": {"candidate_steps": [2, 4]}}, source="mine.json")
    policy = EmaPolicy(4, cfg)
    assert policy.config is cfg
    assert policy.candidate_steps == [2, 4]
