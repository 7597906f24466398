"""Contract tests against SGLang 0.5.23's real adaptive-speculation code.

(a) EmaPolicy vs SGLang's AdaptiveSpeculativeParams: identical answers, call for call,
    and the same per-slot EMA bit for bit, over many seeded random call sequences;
    the same rejections for invalid configs.
(b) EmaPolicy, FixedStepPolicy and TablePolicy driven through SGLang's real
    AdaptiveController with a fake worker, in SGLang's call order.
(c) specgov's protocol has SGLang's member names, parameter names and annotations.
"""

from __future__ import annotations

import inspect
import json
import math
import random
import typing
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from specgov.policies.common.step_table import StepTable
from specgov.policies.common.types import TierStatsSnapshot
from specgov.policies.engine.adaptive_config import (
    DEFAULT_ADAPTIVE_CONFIG,
    DEFAULT_CEILING_COEFF,
    DEFAULT_DOWN_HYSTERESIS,
    DEFAULT_EMA_ALPHA,
    DEFAULT_UP_HYSTERESIS,
    DEFAULT_UPDATE_INTERVAL,
    DEFAULT_WARMUP_BATCHES,
    AdaptiveConfigError,
    parse_adaptive_config,
)
from specgov.policies.engine.ema import EmaPolicy
from specgov.policies.engine.fixed import FixedStepPolicy
from specgov.policies.engine.protocol import AdaptiveSpecPolicy
from specgov.policies.engine.table import TablePolicy

from .sglang_loader import load_adaptive_runtime_state, load_adaptive_spec_params


@pytest.fixture(scope="module")
def asp(sglang_src: Path) -> ModuleType:
    return load_adaptive_spec_params(sglang_src)


@pytest.fixture(scope="module")
def ars(sglang_src: Path) -> ModuleType:
    return load_adaptive_runtime_state(sglang_src)


def spec_decode_cuda_graph_bs(max_bs: int) -> list[int]:
    """SGLang's default decode CUDA-graph batch sizes under speculative decoding
    (``generate_decode_cuda_graph_batch_sizes``, arg_groups/cuda_graph_hook.py, 0.5.23)."""
    capture_bs = (
        list(range(1, 9, 1))
        + list(range(10, 33, 2))
        + list(range(40, 65, 4))
        + list(range(72, 257, 8))
        + list(range(272, max_bs + 1, 16))
    )
    capture_bs = [bs for bs in capture_bs if bs <= max_bs]
    if max_bs not in capture_bs:
        capture_bs.append(max_bs)
    return capture_bs


def pad(batch_size: int, cuda_graph_bs: list[int] | None) -> int:
    if not cuda_graph_bs:
        return batch_size
    bigger = [v for v in sorted(cuda_graph_bs) if v >= batch_size]
    return bigger[0] if bigger else batch_size


def draw_accepted(rng: random.Random, steps: int, n: int, p: float) -> list[int]:
    """Accepted drafts per request for ``steps`` drafts: a run of successes with rate p."""
    if steps == 0 or p <= 0.0:
        return [0] * n
    if p >= 1.0:
        return [steps] * n
    log_p = math.log(p)
    return [min(steps, int(math.log(1.0 - rng.random()) / log_p)) for _ in range(n)]


# ----------------------------------------------------------------- (a) differential


def random_config(rng: random.Random) -> dict[str, Any]:
    knob_values: dict[str, Callable[[], Any]] = {
        "ema_alpha": lambda: rng.choice([rng.random(), 1, 0.5, 0.05]),
        "update_interval": lambda: rng.randint(1, 8),
        "warmup_batches": lambda: rng.randint(0, 15),
        # Exactly representable values put the EMA exactly on a threshold now and
        # then (alpha 1, small batches), which pins <= versus <.
        "down_hysteresis": lambda: rng.choice([rng.uniform(-1.0, 0.5), 0, -0.25, -0.5, 0.5]),
        "up_hysteresis": lambda: rng.choice([rng.uniform(-0.5, 0.5), 0.0, 0.5, -0.5]),
        "ceiling_coeff": lambda: rng.choice([0, rng.uniform(0.1, 2.0), 1]),
    }
    cfg: dict[str, Any] = {}
    for knob, value in knob_values.items():
        if rng.random() < 0.3:
            cfg[knob] = value()  # a default merged into every slot
    bounds = sorted(rng.sample(range(0 if rng.random() < 0.1 else 1, 129), rng.randint(1, 4)))
    for bound in bounds:
        steps = rng.sample(range(9), rng.randint(1, 4))
        if rng.random() < 0.5:
            steps.append(0)  # zero-step candidates (drafting off) are common
        if rng.random() < 0.2:
            steps.append(steps[0])  # duplicates: SGLang dedups them
        rng.shuffle(steps)
        entry: dict[str, Any] = {"candidate_steps": steps}
        for knob, value in knob_values.items():
            if rng.random() < 0.4:
                entry[knob] = value()
        cfg[str(bound)] = entry
    return cfg


def random_cuda_graph_bs(rng: random.Random) -> list[int] | None:
    kind = rng.randrange(5)
    if kind == 0:
        return None
    if kind == 1:
        return []
    if kind == 2:
        return spec_decode_cuda_graph_bs(rng.choice([8, 32, 48, 160, 256, 512]))
    values = rng.sample(range(1, 320), rng.randint(1, 30))
    if kind == 3:
        return sorted(values)
    return values + values[: rng.randint(0, 3)]  # unsorted, with duplicates


def assert_same_state(sg: Any, ours: EmaPolicy, where: str) -> None:
    assert ours.slot_bounds() == sg._bs_list, where
    for bound in sg._bs_list:
        slot = sg._slots[bound]
        assert ours.slot_state(bound) == (slot.current_steps, slot.ema_accept_len), (
            f"{where}: slot {bound}"
        )


def test_ema_policy_matches_sglang_call_for_call(asp: ModuleType, tmp_path: Path) -> None:
    events = {"changes": 0, "to_zero": 0, "probes_from_zero": 0, "negative_ema_resets": 0}
    for seq in range(60):
        rng = random.Random(seq)
        if seq % 6 == 0:
            cfg_text, cfg_path = None, None
        else:
            cfg_text = json.dumps(random_config(rng))
            cfg_path = tmp_path / f"adaptive_{seq}.json"
            cfg_path.write_text(cfg_text)
        initial_steps = rng.randint(0, 8)
        sg = asp.AdaptiveSpeculativeParams(
            initial_steps=initial_steps, cfg_path=None if cfg_path is None else str(cfg_path)
        )
        ours = EmaPolicy(initial_steps, None if cfg_text is None else json.loads(cfg_text))
        assert ours.candidate_steps == sg.candidate_steps
        cuda_graph_bs = random_cuda_graph_bs(rng)
        sg.set_cuda_graph_bs(cuda_graph_bs)
        ours.set_cuda_graph_bs(cuda_graph_bs)
        p = rng.random()
        for call in range(250):
            where = f"sequence {seq} call {call} (config {cfg_text})"
            if call % 60 == 59:
                p = rng.choice([0.0, 0.2, 0.5, 0.8, 0.95, 1.0])  # the content shifts
            if rng.random() < 0.02:
                cuda_graph_bs = random_cuda_graph_bs(rng)
                sg.set_cuda_graph_bs(cuda_graph_bs)
                ours.set_cuda_graph_bs(cuda_graph_bs)
            if rng.random() < 0.05:
                for step in [*sg.candidate_steps, rng.randint(0, 9)]:
                    assert ours.cuda_graph_bs_for_step(step) == sg.cuda_graph_bs_for_step(step)
            batch_size = rng.randint(1, 300) if rng.random() < 0.5 else rng.randint(1, 40)
            steps = sg.get_steps_for_batch(batch_size)
            assert ours.get_steps_for_batch(batch_size) == steps, where
            accepted = draw_accepted(rng, steps, batch_size, p)
            if rng.random() < 0.02:
                accepted = []  # an empty verify does not count as a batch
            verify_bs = batch_size if rng.random() < 0.9 else rng.randint(1, 300)
            slot = sg._route(verify_bs)
            before = (slot.current_steps, slot.ema_accept_len)
            expected = sg.on_verify_complete(accepted, verify_bs)
            assert ours.on_verify_complete(accepted, verify_bs) == expected, where
            assert_same_state(sg, ours, where)
            if expected is not None:
                events["changes"] += 1
                events["to_zero"] += expected == 0
                events["probes_from_zero"] += before[0] == 0
                events["negative_ema_resets"] += before[0] == 0 and before[1] < 0
        assert ours.candidate_steps == sg.candidate_steps
    # The sequences must have exercised every branch worth comparing.
    assert events["changes"] > 200, events
    assert min(events.values()) > 0, events


def test_default_config_and_knob_defaults_match_sglang(asp: ModuleType) -> None:
    assert DEFAULT_ADAPTIVE_CONFIG == asp.DEFAULT_ADAPTIVE_CONFIG
    assert parse_adaptive_config(DEFAULT_ADAPTIVE_CONFIG).candidate_steps == (
        asp.resolve_candidate_steps_from_config(None)
    )
    slot = asp.AdaptiveStepSlot(initial_steps=1, cfg={"candidate_steps": [1]})
    ours = parse_adaptive_config({"1": {"candidate_steps": [1]}}).slots[0]
    assert (
        slot.ema_alpha,
        slot.update_interval,
        slot.warmup_batches,
        slot.down_hysteresis,
        slot.up_hysteresis,
        slot.ceiling_coeff,
    ) == (
        ours.ema_alpha,
        ours.update_interval,
        ours.warmup_batches,
        ours.down_hysteresis,
        ours.up_hysteresis,
        ours.ceiling_coeff,
    )
    assert (ours.ema_alpha, ours.update_interval, ours.warmup_batches) == (
        DEFAULT_EMA_ALPHA,
        DEFAULT_UPDATE_INTERVAL,
        DEFAULT_WARMUP_BATCHES,
    )
    assert (ours.down_hysteresis, ours.up_hysteresis, ours.ceiling_coeff) == (
        DEFAULT_DOWN_HYSTERESIS,
        DEFAULT_UP_HYSTERESIS,
        DEFAULT_CEILING_COEFF,
    )


# (config, words both error messages must contain)
INVALID_CONFIGS: list[tuple[dict[str, Any], tuple[str, ...]]] = [
    ({}, ("at least one",)),
    ({"ema_alpha": 0.3}, ("at least one", "ema_alpha")),
    ({"1": {}}, ("1", "candidate_steps")),
    ({"1": {"candidate_steps": []}}, ("1", "candidate_steps")),
    ({"1": {"candidate_steps": [1, -1]}}, ("1", "candidate_steps", "-1")),
    ({"1": {"candidate_steps": [1, 2.0]}}, ("1", "candidate_steps", "2.0")),
    ({"1": {"candidate_steps": ["3"]}}, ("1", "candidate_steps", "'3'")),
    ({"1": {"candidate_steps": 3}}, ("1", "candidate_steps", "3")),
    ({"8": {"candidate_steps": [1]}, "16": {"candidate_steps": None}}, ("16", "candidate_steps")),
    # A top-level default does not stand in for a slot's own candidate_steps.
    ({"candidate_steps": [1], "4": {"ema_alpha": 0.1}}, ("4", "candidate_steps")),
]


@pytest.mark.parametrize(("cfg", "words"), INVALID_CONFIGS)
def test_invalid_configs_rejected_like_sglang(
    asp: ModuleType, tmp_path: Path, cfg: dict[str, Any], words: tuple[str, ...]
) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(cfg))
    with pytest.raises(ValueError) as theirs:
        asp.AdaptiveSpeculativeParams(initial_steps=3, cfg_path=str(path))
    with pytest.raises(AdaptiveConfigError) as ours:
        EmaPolicy(3, json.loads(path.read_text()))
    with pytest.raises(AdaptiveConfigError) as parsed:
        parse_adaptive_config(json.loads(path.read_text()), source=str(path))
    assert isinstance(ours.value, ValueError)
    for word in words:
        assert word in str(theirs.value), (word, str(theirs.value))
        assert word in str(ours.value), (word, str(ours.value))
    assert str(path) in str(parsed.value)


def test_documented_deviations_are_stricter_than_sglang(asp: ModuleType, tmp_path: Path) -> None:
    """Configs SGLang accepts or crashes on oddly, which specgov rejects up front."""
    path = tmp_path / "odd.json"
    # JSON `true` is an int to SGLang's isinstance check; it is not a step.
    path.write_text(json.dumps({"1": {"candidate_steps": [True, 3]}}))
    assert asp.AdaptiveSpeculativeParams(3, str(path)).candidate_steps == [True, 3]
    with pytest.raises(AdaptiveConfigError, match="candidate_steps"):
        parse_adaptive_config(json.loads(path.read_text()), source=str(path))
    # A non-object slot: SGLang fails with an AttributeError, specgov names the key.
    path.write_text(json.dumps({"1": [1, 3]}))
    with pytest.raises(AttributeError):
        asp.AdaptiveSpeculativeParams(3, str(path))
    with pytest.raises(AdaptiveConfigError, match="'1'"):
        parse_adaptive_config(json.loads(path.read_text()), source=str(path))
    # update_interval 0: SGLang divides by it after warm-up (ZeroDivisionError).
    path.write_text(json.dumps({"1": {"candidate_steps": [1, 3], "update_interval": 0}}))
    sg = asp.AdaptiveSpeculativeParams(3, str(path))
    with pytest.raises(ZeroDivisionError):
        for _ in range(20):
            sg.on_verify_complete([1], 1)
    with pytest.raises(AdaptiveConfigError, match="update_interval"):
        parse_adaptive_config(json.loads(path.read_text()), source=str(path))


# ------------------------------------------------------ (b) through AdaptiveController


class FakeWorker:
    """Implements SGLang's AdaptiveSpecWorker protocol with no GPU resources.

    Records which CUDA-graph batch sizes each step's runtime state was built for, so
    a test can check that a step never runs at a captured batch size it lacks.
    """

    def __init__(self, ars: ModuleType, initial_steps: int) -> None:
        self._ars = ars
        self.speculative_num_steps = initial_steps
        self.speculative_num_draft_tokens = initial_steps + 1
        self.graph_bs: dict[int, list[int] | None] = {}
        self.applied: list[int] = []

    def state(self, steps: int) -> Any:
        return self._ars.SpecRuntimeState(
            speculative_num_steps=steps,
            speculative_num_draft_tokens=steps + 1,
            draft_attn_backend=None,
            cuda_graph_runner=None,
            target_attn_backend=None,
            target_graph_runner=None,
            draft_extend_attn_backend=None,
            cuda_graph_runner_for_draft_extend=None,
        )

    def build_adaptive_runtime_state(
        self,
        speculative_num_steps: int,
        speculative_num_draft_tokens: int,
        cuda_graph_bs: list[int] | None = None,
    ) -> Any:
        assert speculative_num_draft_tokens == speculative_num_steps + 1
        assert speculative_num_steps not in self.graph_bs, "a state is built once"
        self.graph_bs[speculative_num_steps] = cuda_graph_bs
        return self.state(speculative_num_steps)

    def apply_runtime_state(self, state: Any) -> None:
        # As EAGLEWorkerV2.apply_runtime_state: a no-op when the step is unchanged.
        if self.speculative_num_steps == state.speculative_num_steps:
            return
        self.speculative_num_steps = state.speculative_num_steps
        self.speculative_num_draft_tokens = state.speculative_num_draft_tokens
        self.applied.append(state.speculative_num_steps)


class Engine:
    """SGLang's adaptive call order: register the launch state, init_states, then per
    decode batch activate_step_by_batch -> forward -> on_verify_complete."""

    def __init__(
        self,
        ars: ModuleType,
        policy: Any,
        initial_steps: int,
        cuda_graph_bs: list[int] | None,
    ) -> None:
        self.worker = FakeWorker(ars, initial_steps)
        self.policy = policy
        self.cuda_graph_bs = cuda_graph_bs
        self.controller = ars.AdaptiveController(self.worker, policy)
        self.controller.register(self.worker.state(initial_steps))
        self.controller.init_states(cuda_graph_bs=cuda_graph_bs)
        self.candidates = list(policy.candidate_steps)
        assert set(self.worker.graph_bs) == set(self.candidates) - {initial_steps}

    def activate(self, batch_size: int) -> int:
        self.controller.activate_step_by_batch(batch_size)
        steps = self.worker.speculative_num_steps
        assert steps in self.candidates
        padded = pad(batch_size, self.cuda_graph_bs)
        built = self.worker.graph_bs.get(steps)
        if self.cuda_graph_bs and built is not None and padded <= max(self.cuda_graph_bs):
            assert padded in built, f"step {steps} has no CUDA graph for batch size {padded}"
        return steps

    def verify(self, accepted: list[int], batch_size: int) -> None:
        self.controller.on_verify_complete(accepted, batch_size)
        assert all(s in self.candidates for s in self.worker.applied)


CUDA_GRAPH_CHOICES = [None, spec_decode_cuda_graph_bs(256), [1, 2, 4, 8, 16, 32, 64, 128]]


@pytest.mark.parametrize("cuda_graph_bs", CUDA_GRAPH_CHOICES)
@pytest.mark.parametrize("initial_steps", [3, 2, 0])
def test_ema_policy_through_controller_matches_sglang(
    asp: ModuleType, ars: ModuleType, cuda_graph_bs: list[int] | None, initial_steps: int
) -> None:
    rng = random.Random(initial_steps * 31 + len(cuda_graph_bs or []))
    theirs = Engine(ars, asp.AdaptiveSpeculativeParams(initial_steps), initial_steps, cuda_graph_bs)
    ours = Engine(ars, EmaPolicy(initial_steps), initial_steps, cuda_graph_bs)
    assert ours.worker.graph_bs == theirs.worker.graph_bs
    p = 0.8
    for i in range(1500):
        if i % 250 == 0:
            p = rng.choice([0.1, 0.5, 0.8, 0.95])
        batch_size = rng.randint(1, 300) if rng.random() < 0.3 else rng.randint(1, 12)
        steps = theirs.activate(batch_size)
        assert ours.activate(batch_size) == steps, f"batch {i}"
        accepted = draw_accepted(rng, steps, batch_size, p)
        theirs.verify(accepted, batch_size)
        ours.verify(accepted, batch_size)
        assert ours.worker.speculative_num_steps == theirs.worker.speculative_num_steps
    assert ours.worker.applied == theirs.worker.applied
    assert len(set(ours.worker.applied)) >= 3


@pytest.mark.parametrize("cuda_graph_bs", CUDA_GRAPH_CHOICES)
def test_fixed_policy_through_controller(ars: ModuleType, cuda_graph_bs: list[int] | None) -> None:
    engine = Engine(ars, FixedStepPolicy(3), 5, cuda_graph_bs)
    assert engine.worker.graph_bs == {3: None if not cuda_graph_bs else sorted(cuda_graph_bs)}
    rng = random.Random(5)
    for _ in range(200):
        batch_size = rng.randint(1, 300)
        assert engine.activate(batch_size) == 3
        engine.verify(draw_accepted(rng, 3, batch_size, 0.9), batch_size)
    assert engine.worker.applied == [3]


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


@pytest.mark.parametrize("cuda_graph_bs", [None, spec_decode_cuda_graph_bs(256)])
def test_table_policy_through_controller(
    asp: ModuleType, ars: ModuleType, cuda_graph_bs: list[int] | None
) -> None:
    clock = FakeClock()
    poll_every = 8
    batch_s = 0.02
    good = StepTable(((1, 5), (4, 3), (8, 1), (32, 0)), version=1, produced_at_s=clock(), ttl_s=1e6)
    other = StepTable(((1, 1), (16, 0)), version=2, produced_at_s=clock(), ttl_s=1e6)
    # Captured only where SGLang's default slots list the step: 5 is not built for
    # batch sizes >= 8, so with CUDA graphs this table is refused.
    uncaptured = StepTable(((1, 7), (8, 5)), version=3, produced_at_s=clock(), ttl_s=1e6)
    not_candidate = StepTable(((1, 2),), version=4, produced_at_s=clock(), ttl_s=1e6)

    phase: dict[str, Any] = {"name": "none", "t0": clock()}
    tables: dict[str, Any] = {
        "none": None,
        "good": good,
        "other": other,
        "uncaptured": uncaptured,
        "not_candidate": not_candidate,
        "garbage": "not a table",
    }

    def source() -> StepTable | None:
        name = phase["name"]
        if name == "raise":
            raise OSError("spool unreadable")
        if name == "expiring":  # valid for 40 batches from when the phase starts
            return StepTable(
                ((1, 3), (32, 0)), version=5, produced_at_s=phase["t0"], ttl_s=40 * batch_s
            )
        return tables[name]  # type: ignore[no-any-return]

    snapshots: list[TierStatsSnapshot] = []
    policy = TablePolicy(
        table_source=source,
        stats_sink=snapshots.append,
        clock=clock,
        fallback=EmaPolicy(3),
        flush_interval_s=1.0,
        poll_every_batches=poll_every,
    )
    assert isinstance(policy, AdaptiveSpecPolicy)
    engine = Engine(ars, policy, 3, cuda_graph_bs)
    # The engine builds exactly what SGLang's own policy would have it build.
    reference = Engine(ars, asp.AdaptiveSpeculativeParams(3), 3, cuda_graph_bs)
    assert engine.worker.graph_bs == reference.worker.graph_bs
    twin = asp.AdaptiveSpeculativeParams(3)  # SGLang's EMA, fed the same verifies
    twin.set_cuda_graph_bs(cuda_graph_bs)

    phases = [
        "none",
        "good",
        "raise",
        "other",
        "garbage",
        "uncaptured",
        "expiring",
        "not_candidate",
        "good",
    ]
    rng = random.Random(11)
    in_force: StepTable | None = None
    table_batches = 0
    for i in range(len(phases) * 120):
        if i % 120 == 0:
            phase["name"] = phases[i // 120]
            phase["t0"] = clock()
        batch_size = rng.randint(1, 300) if rng.random() < 0.3 else rng.randint(1, 12)
        if i % poll_every == 0:  # the policy polls here; model what it must accept
            candidate: Any
            try:
                candidate = source()
            except OSError:
                candidate = None
            valid = isinstance(candidate, StepTable) and not candidate.is_expired(clock())
            if valid and phase["name"] == "not_candidate":
                valid = False
            if valid and phase["name"] == "uncaptured" and cuda_graph_bs:
                valid = False
            in_force = candidate if valid else None
        steps = engine.activate(batch_size)
        expected_fallback = twin.get_steps_for_batch(batch_size)
        if in_force is None:
            assert steps == expected_fallback, f"batch {i}, phase {phase['name']}"
        else:
            assert steps == in_force.steps_for(pad(batch_size, cuda_graph_bs)), f"batch {i}"
            table_batches += 1
        accepted = draw_accepted(rng, steps, batch_size, 0.7)
        clock.now_s += batch_s
        twin.on_verify_complete(accepted, batch_size)
        engine.verify(accepted, batch_size)
    assert policy.errors == 120 // poll_every  # one per poll of the raising source
    assert policy.last_error is not None and "spool unreadable" in policy.last_error
    reasons = policy.fallback_reasons
    assert {"no_table", "source_error", "invalid_type", "expired", "invalid_step"} <= set(reasons)
    assert ("uncaptured_step" in reasons) == bool(cuda_graph_bs)
    assert table_batches > 3 * 120
    # Statistics flowed: one snapshot about every second of fake time, every verify counted.
    assert len(snapshots) >= int(len(phases) * 120 * batch_s) - 1
    assert sum(t.verify_calls for s in snapshots for t in s.tiers) <= len(phases) * 120
    assert all(t.steps in engine.candidates for s in snapshots for t in s.tiers)


# ------------------------------------------------------------------------ (c) protocol


def _protocol_members(cls: type) -> dict[str, Any]:
    return {
        name: value
        for name, value in vars(cls).items()
        if not name.startswith("_") and (callable(value) or isinstance(value, property))
    }


def test_protocol_mirrors_sglang(ars: ModuleType) -> None:
    theirs = _protocol_members(ars.AdaptiveSpecPolicy)
    ours = _protocol_members(AdaptiveSpecPolicy)
    assert (
        sorted(ours)
        == sorted(theirs)
        == sorted(
            [
                "candidate_steps",
                "set_cuda_graph_bs",
                "get_steps_for_batch",
                "on_verify_complete",
                "cuda_graph_bs_for_step",
            ]
        )
    )
    for name, their in theirs.items():
        our = ours[name]
        assert isinstance(our, property) == isinstance(their, property), name
        their_fn = their.fget if isinstance(their, property) else their
        our_fn = our.fget if isinstance(our, property) else our
        assert list(inspect.signature(our_fn).parameters) == list(
            inspect.signature(their_fn).parameters
        ), name
        assert typing.get_type_hints(our_fn) == typing.get_type_hints(their_fn), name


@pytest.mark.parametrize(
    "make",
    [
        lambda: EmaPolicy(3),
        lambda: FixedStepPolicy(2),
        lambda: TablePolicy(
            table_source=lambda: None,
            stats_sink=lambda _s: None,
            clock=lambda: 0.0,
            fallback=EmaPolicy(3),
        ),
    ],
)
def test_policies_have_sglang_method_signatures(ars: ModuleType, make: Callable[[], Any]) -> None:
    policy = make()
    assert isinstance(policy, AdaptiveSpecPolicy)
    for name, their in _protocol_members(ars.AdaptiveSpecPolicy).items():
        if isinstance(their, property):
            assert isinstance(getattr(type(policy), name), property), name
            continue
        ours = getattr(policy, name)
        assert (
            list(inspect.signature(ours).parameters)
            == list(inspect.signature(their).parameters)[1:]
        ), name
