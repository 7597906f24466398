"""Contract tests: the plugin under SGLang's next adaptive interface (issue 11, section 4).

Upstream work after 0.5.23 (REFERENCE.md section 1; not in the wheel) changes how the
engine calls the adaptive policy:

* ``AdaptiveController.on_verify_complete(reqs, batch_size, num_steps=None)`` hands
  ``num_steps`` on to ``params.on_verify_complete(reqs, batch_size, num_steps)`` as a
  third positional argument;
* ``AdaptiveController._activate`` calls ``params.on_state_activated(steps)`` after
  every state switch (unconditionally: a policy without the method raises);
* context-length buckets add a ``ctx_repr=`` keyword to ``get_steps_for_batch`` and
  ``on_verify_complete``;
* the adaptive config may carry a ``"strategy"`` key (and ``ctx_buckets``), which
  0.5.23 already tolerates (non-digit keys are defaults merged into every slot).

``NextController`` below is SGLang 0.5.23's real ``AdaptiveController`` (loaded from the
wheel like the other contract tests) with exactly those call shapes added, as upstream's
``adaptive_runtime_state.py`` has them. ``NextParams`` is 0.5.23's real
``AdaptiveSpeculativeParams`` extended with the new parameters, recording what it is
given: a stand-in for the next SGLang's own class, so passthrough can be checked to hand
it exactly what SGLang would.
"""

from __future__ import annotations

import inspect
import json
import logging
import random
import traceback
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
from click.testing import CliRunner

from specgov.adapters.sglang_plugin import SpecgovAdaptiveParams
from specgov.adapters.spool_table import write_step_table
from specgov.adapters.tp_sync import LocalChannel
from specgov.policies.common.step_table import StepTable

from .sglang_loader import load_adaptive_runtime_state, load_adaptive_spec_params
from .test_sglang_plugin_contract import GRAPHS_256, Clock, FakeWorker, draw_accepted

CANDIDATES = [0, 1, 3, 5, 7]
# Context lengths the engine would bucket requests by (PR #31716's ctx_repr).
CTX = (512, 2048, 8192)


@pytest.fixture(scope="module")
def asp(sglang_src: Path) -> ModuleType:
    return load_adaptive_spec_params(sglang_src)


@pytest.fixture(scope="module")
def ars(sglang_src: Path) -> ModuleType:
    return load_adaptive_runtime_state(sglang_src)


@pytest.fixture(scope="module")
def next_controller(ars: ModuleType) -> type:
    class NextController(ars.AdaptiveController):  # type: ignore[misc, name-defined]
        """0.5.23's controller with upstream's later call shapes."""

        def activate_step_by_batch(self, batch_size: int, ctx_repr: int | None = None) -> None:
            target = self.params.get_steps_for_batch(batch_size, ctx_repr=ctx_repr)
            if target != self.worker.speculative_num_steps:
                self._activate(target)

        def on_verify_complete(
            self,
            num_correct_drafts_per_req: list[int],
            batch_size: int,
            num_steps: int | None = None,
            ctx_repr: int | None = None,
        ) -> None:
            new_step = self.params.on_verify_complete(
                num_correct_drafts_per_req, batch_size, num_steps, ctx_repr=ctx_repr
            )
            if new_step is not None:
                self._activate(new_step)

        def _activate(self, speculative_num_steps: int) -> None:
            super()._activate(speculative_num_steps)
            self.params.on_state_activated(speculative_num_steps)

    return NextController


@pytest.fixture(scope="module")
def next_params(asp: ModuleType) -> type:
    class NextParams(asp.AdaptiveSpeculativeParams):  # type: ignore[misc, name-defined]
        """0.5.23's class taking the next interface's arguments, recording them."""

        def __init__(
            self, initial_steps: int, cfg_path: str | None = None, ctx_buckets: Any = None
        ) -> None:
            super().__init__(initial_steps, cfg_path)
            self.ctx_buckets = ctx_buckets
            self.seen_get_ctx: list[int | None] = []
            self.seen_verify: list[tuple[int | None, int | None]] = []
            self.seen_activated: list[int] = []

        def get_steps_for_batch(self, batch_size: int, ctx_repr: int | None = None) -> int:
            self.seen_get_ctx.append(ctx_repr)
            return int(super().get_steps_for_batch(batch_size))

        def on_verify_complete(
            self,
            num_correct_drafts_per_req: list[int],
            batch_size: int,
            num_steps: int | None = None,
            ctx_repr: int | None = None,
        ) -> int | None:
            self.seen_verify.append((num_steps, ctx_repr))
            answer: int | None = super().on_verify_complete(num_correct_drafts_per_req, batch_size)
            return answer

        def on_state_activated(self, steps: int) -> None:
            self.seen_activated.append(steps)

    return NextParams


def engine(controller_cls: type, ars: ModuleType, policy: Any, graphs: list[int] | None) -> Any:
    worker = FakeWorker(ars, 3)
    controller = controller_cls(worker, policy)
    controller.register(worker.state(3))
    controller.init_states(cuda_graph_bs=graphs)
    return SimpleNamespace(worker=worker, controller=controller)


def drive(
    engines: list[Any], calls: int, clock: Clock, seed: int, *, next_shape: list[bool]
) -> list[tuple[int, ...]]:
    """The same batches into every engine; the steps each ran, per call."""
    rng = random.Random(seed)
    trace = []
    p = 0.8
    for i in range(calls):
        if i % 150 == 0:
            p = rng.choice([0.2, 0.6, 0.9])
        batch_size = rng.randint(1, 300) if rng.random() < 0.3 else rng.randint(1, 12)
        ctx = rng.choice(CTX)
        accepted = draw_accepted(rng, 7, batch_size, p)
        ran = []
        for e, new in zip(engines, next_shape, strict=True):
            if new:
                e.controller.activate_step_by_batch(batch_size, ctx_repr=ctx)
            else:
                e.controller.activate_step_by_batch(batch_size)
            steps = e.worker.speculative_num_steps
            ran.append(steps)
            clipped = [min(a, steps) for a in accepted]
            if new:
                e.controller.on_verify_complete(clipped, batch_size, steps, ctx_repr=ctx)
            else:
                e.controller.on_verify_complete(clipped, batch_size)
        trace.append(tuple(ran))
        clock.now_s += 0.01
    return trace


def plugin(original: Any, spool_dir: Path | None, clock: Clock, **kwargs: Any) -> Any:
    return SpecgovAdaptiveParams(
        3,
        kwargs.pop("cfg_path", None),
        spool_dir=spool_dir,
        original=original,
        channel_factory=LocalChannel,
        clock=clock,
        poll_every_batches=8,
        stats_writer=None,
        **kwargs,
    )


# ---------------------------------------------------------------------- the shapes


def test_every_next_call_shape_binds(asp: ModuleType) -> None:
    ours = plugin(asp.AdaptiveSpeculativeParams, None, Clock())
    shapes: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = [
        ("get_steps_for_batch", (4,), {"ctx_repr": 2048}),
        ("on_verify_complete", ([1, 2], 2, 3), {}),  # num_steps positional (upstream)
        ("on_verify_complete", ([1, 2], 2), {"num_steps": 3, "ctx_repr": 512}),
        ("on_state_activated", (3,), {}),
        ("set_cuda_graph_bs", ([1, 2, 4],), {"something_new": True}),
        ("cuda_graph_bs_for_step", (3,), {"something_new": True}),
    ]
    for name, args, kwargs in shapes:
        inspect.signature(getattr(ours, name)).bind(*args, **kwargs)
        getattr(ours, name)(*args, **kwargs)  # and runs, against 0.5.23's class
    assert ours.errors == 0
    # The constructor takes a later SGLang's keywords too.
    SpecgovAdaptiveParams(3, None, original=asp.AdaptiveSpeculativeParams, ctx_buckets=[4096])


# --------------------------------------------- 0.5.23's class behind the next engine


@pytest.mark.parametrize("graphs", [None, GRAPHS_256])
def test_next_engine_with_the_0_5_23_class_is_still_sglang(
    asp: ModuleType, ars: ModuleType, next_controller: type, graphs: list[int] | None
) -> None:
    # A newer engine passes num_steps, ctx_repr and on_state_activated; behind it is
    # 0.5.23's class, which takes none of them: they are dropped, the answers are its.
    clock = Clock()
    ours = engine(next_controller, ars, plugin(asp.AdaptiveSpeculativeParams, None, clock), graphs)
    theirs = engine(ars.AdaptiveController, ars, asp.AdaptiveSpeculativeParams(3), graphs)
    trace = drive([ours, theirs], 1200, clock, seed=3, next_shape=[True, False])
    assert all(o == t for o, t in trace)
    assert ours.worker.applied == theirs.worker.applied and len(ours.worker.applied) > 10
    params = ours.controller.params
    assert params.errors == 0
    assert params.activated_steps == ours.worker.speculative_num_steps
    assert params.ignored_keywords == {"ctx_repr", "num_steps"}


def test_unknown_keywords_are_logged_once(
    asp: ModuleType, ars: ModuleType, next_controller: type, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="specgov.adapters.sglang_plugin")
    clock = Clock()
    ours = engine(next_controller, ars, plugin(asp.AdaptiveSpeculativeParams, None, clock), None)
    drive([ours], 300, clock, seed=4, next_shape=[True])
    lines = [r.getMessage() for r in caplog.records if "does not use" in r.getMessage()]
    assert sorted(lines) == sorted(
        f"specgov: SGLang passes the keyword argument {name!r}, which this specgov version "
        "does not use; ignored"
        for name in ("ctx_repr", "num_steps")
    )


# ------------------------------------------------- the next SGLang's own class behind


@pytest.mark.parametrize("graphs", [None, GRAPHS_256])
def test_passthrough_hands_the_next_class_what_sglang_would(
    ars: ModuleType, next_controller: type, next_params: type, graphs: list[int] | None
) -> None:
    clock = Clock()
    ours_params = plugin(next_params, None, clock, ctx_buckets=[1024, 4096])
    ours = engine(next_controller, ars, ours_params, graphs)
    theirs = engine(next_controller, ars, next_params(3, None, ctx_buckets=[1024, 4096]), graphs)
    trace = drive([ours, theirs], 1200, clock, seed=5, next_shape=[True, True])
    assert all(o == t for o, t in trace)
    assert ours.worker.applied == theirs.worker.applied
    inner = ours_params.passthrough
    mirror = theirs.controller.params
    # Every argument arrived, unchanged: constructor keyword, ctx_repr, num_steps and
    # the activation calls.
    assert inner.ctx_buckets == [1024, 4096]
    # (The plugin asks SGLang's instance once at construction, for its last-resort step.)
    assert inner.seen_get_ctx == [None, *mirror.seen_get_ctx]
    assert set(mirror.seen_get_ctx) == set(CTX)
    assert inner.seen_verify == mirror.seen_verify
    assert all(n is not None for n, _ in inner.seen_verify)
    assert inner.seen_activated == mirror.seen_activated and len(inner.seen_activated) > 10
    assert ours_params.ignored_keywords == frozenset()


def test_table_mode_under_the_next_engine(
    asp: ModuleType, ars: ModuleType, next_controller: type, next_params: type, tmp_path: Path
) -> None:
    clock = Clock()
    table = StepTable(
        ((1, 7), (4, 3), (8, 1), (32, 0)), version=1, produced_at_s=clock(), ttl_s=200.0
    )
    write_step_table(tmp_path, table, CANDIDATES)
    params = plugin(next_params, tmp_path, clock)
    ours = engine(next_controller, ars, params, GRAPHS_256)
    rng = random.Random(6)
    for _ in range(400):
        batch_size = rng.randint(1, 64)
        ours.controller.activate_step_by_batch(batch_size, ctx_repr=rng.choice(CTX))
        ran = ours.worker.speculative_num_steps
        accepted = draw_accepted(rng, ran, batch_size, 0.7)
        ours.controller.on_verify_complete(accepted, batch_size, ran, ctx_repr=8192)
        clock.now_s += 0.01
    assert params.mode == "table" and params.table == table
    assert set(ours.worker.applied) >= {0, 1, 3, 7}  # the table's steps, switched to
    assert params.activated_steps == ours.worker.speculative_num_steps
    # SGLang's own instance saw the start-up activation (before the first decode batch
    # decided the mode), and nothing while the table answers.
    assert params.passthrough.seen_activated == [3]
    assert params.errors == 0 and params.policy is not None and params.policy.errors == 0


# ------------------------------------------------------- the "strategy" config key


def test_config_with_a_strategy_key(asp: ModuleType, ars: ModuleType, tmp_path: Path) -> None:
    cfg = {
        "strategy": "ema",
        "ctx_buckets": [1024, 4096],
        "1": {"candidate_steps": [1, 3, 5]},
        "8": {"candidate_steps": [0, 1], "ema_alpha": 0.3},
    }
    path = tmp_path / "adaptive.json"
    path.write_text(json.dumps(cfg))
    # 0.5.23 takes it (the key is a default merged into every slot, unused) ...
    theirs = asp.AdaptiveSpeculativeParams(3, str(path))
    # ... and so does the plugin: not disabled, same candidates, same answers.
    clock = Clock()
    ours = plugin(asp.AdaptiveSpeculativeParams, tmp_path / "spool", clock, cfg_path=str(path))
    assert ours.disabled_reason is None and ours.mode == "undecided"
    assert ours.candidate_steps == theirs.candidate_steps == [0, 1, 3, 5]
    a = engine(ars.AdaptiveController, ars, ours, GRAPHS_256)
    b = engine(ars.AdaptiveController, ars, theirs, GRAPHS_256)
    trace = drive([a, b], 600, clock, seed=7, next_shape=[False, False])
    assert all(o == t for o, t in trace)


def test_sglang_args_does_not_break_on_a_strategy_key() -> None:
    # sglang-args targets 0.5.23, which would silently ignore "strategy": it refuses
    # the key with a usage error naming it (no traceback), never crashes.
    from specgov.controller.cli.main import main

    runner = CliRunner()
    for slots in ("strategy=throughput_aware;1=1,3;8=0,1", "1=1,3/strategy=ema;8=0,1"):
        result = runner.invoke(
            main, ["sglang-args", "--algorithm", "EAGLE3", "--num-steps", "3", "--slots", slots]
        )
        text = result.output
        if result.exception is not None and not isinstance(result.exception, SystemExit):
            pytest.fail("".join(traceback.format_exception(result.exception)))
        assert result.exit_code in (0, 1, 2), text
        assert "Traceback" not in text
        if result.exit_code != 0:
            assert "'strategy'" in text, text
        else:
            assert "strategy" in text, text
