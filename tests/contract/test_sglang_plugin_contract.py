"""Contract tests: specgov's SGLang plugin against sglang 0.5.23's real plugin machinery.

(a) SGLang's real ``AdaptiveController`` (``adaptive_runtime_state.py``) drives
    ``SpecgovAdaptiveParams`` with a fake worker: ``register`` + ``init_states``, then per
    decode batch ``activate_step_by_batch`` and ``on_verify_complete``.
(b) SGLang's real ``load_plugins()`` (``srt/plugins/__init__.py``), its real ``envs``
    (``srt/environ.py``) and its real ``HookRegistry`` (``srt/plugins/hook_registry.py``)
    discover specgov's entry point, honour ``SGLANG_PLUGINS`` and apply the REPLACE onto
    stand-in modules, including a stale ``from ... import`` binding like
    ``eagle_worker_v2``'s.
(c) The installed distribution exposes the entry point.

What is real and what stands in, and why that is safe: ``environ.py``,
``hook_registry.py`` and ``plugins/__init__.py`` import only the standard library and
each other, so they run unmodified under their real module names. The packages
``sglang``, ``sglang.srt`` and ``sglang.srt.speculative`` are empty module shells (their
real ``__init__`` imports torch); the loader code only needs them to exist in
``sys.modules`` for ``pkgutil.resolve_name``. The module
``sglang.srt.speculative.adaptive_spec_params`` is a shell holding SGLang's real
``AdaptiveSpeculativeParams`` class (loaded by ``sglang_loader`` with the light stubs it
documents), since the REPLACE only swaps that attribute; ``eagle_worker_v2`` is a shell
holding the same stale binding and one function doing what ``EAGLEWorkerV2.__init__``
does with it. Every stand-in is removed from ``sys.modules`` after each test. The
REPLACE also rebinds any module global anywhere in ``sys.modules`` that *is* the original
class; the real class otherwise lives only in ``sglang_loader``'s private cache (a
module kept out of ``sys.modules``), so nothing outside the stand-ins is touched (the
first loader test checks it).
"""

from __future__ import annotations

import importlib.util
import random
import sys
from importlib.metadata import entry_points
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
from verify_stubs import Clock, draw_accepted

import specgov.adapters.sglang_plugin as plugin_mod
from specgov.adapters.sglang_plugin import HOOK_TARGET, SpecgovAdaptiveParams
from specgov.adapters.spool_table import write_step_table
from specgov.adapters.tp_sync import LocalChannel
from specgov.policies.common.step_table import StepTable

from .sglang_loader import load_adaptive_runtime_state, load_adaptive_spec_params

GRAPHS_256 = (
    list(range(1, 9)) + list(range(10, 33, 2)) + list(range(40, 65, 4)) + list(range(72, 257, 8))
)
DEFAULT_CANDIDATES = [0, 1, 3, 5, 7]
POLL = 8


@pytest.fixture(scope="module")
def asp(sglang_src: Path) -> ModuleType:
    return load_adaptive_spec_params(sglang_src)


@pytest.fixture(scope="module")
def ars(sglang_src: Path) -> ModuleType:
    return load_adaptive_runtime_state(sglang_src)


def pad(batch_size: int, graphs: list[int] | None) -> int:
    bigger = [g for g in graphs or [] if g >= batch_size]
    return bigger[0] if bigger else batch_size


# --------------------------------------------------- (a) through AdaptiveController


class FakeWorker:
    """SGLang's ``AdaptiveSpecWorker`` protocol without GPU resources."""

    def __init__(self, ars: ModuleType, initial_steps: int) -> None:
        self._ars = ars
        self.speculative_num_steps = initial_steps
        self.built: dict[int, list[int] | None] = {}
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
        self.built[speculative_num_steps] = cuda_graph_bs
        return self.state(speculative_num_steps)

    def apply_runtime_state(self, state: Any) -> None:
        if state.speculative_num_steps != self.speculative_num_steps:
            self.speculative_num_steps = state.speculative_num_steps
            self.applied.append(state.speculative_num_steps)


def engine(ars: ModuleType, policy: Any, graphs: list[int] | None) -> Any:
    worker = FakeWorker(ars, 3)
    controller = ars.AdaptiveController(worker, policy)
    controller.register(worker.state(3))
    controller.init_states(cuda_graph_bs=graphs)
    return SimpleNamespace(worker=worker, controller=controller)


def run_engines(
    ours: Any, theirs: Any, calls: int, clock: Clock, seed: int
) -> list[tuple[int, int, int]]:
    """Drive two controllers with the same batches; (batch size, ours, theirs) per call."""
    rng = random.Random(seed)
    trace = []
    p = 0.8
    for i in range(calls):
        if i % 150 == 0:
            p = rng.choice([0.2, 0.6, 0.9])
        batch_size = rng.randint(1, 300) if rng.random() < 0.3 else rng.randint(1, 12)
        ours.controller.activate_step_by_batch(batch_size)
        theirs.controller.activate_step_by_batch(batch_size)
        ran = ours.worker.speculative_num_steps
        trace.append((batch_size, ran, theirs.worker.speculative_num_steps))
        # Accepted drafts depend only on the batch, not on the step that ran, so both
        # engines see identical verifies whatever each chose.
        accepted = draw_accepted(rng, 7, batch_size, p)
        ours.controller.on_verify_complete([min(a, ran) for a in accepted], batch_size)
        their_ran = theirs.worker.speculative_num_steps
        theirs.controller.on_verify_complete([min(a, their_ran) for a in accepted], batch_size)
        clock.now_s += 0.01
    return trace


@pytest.mark.parametrize("graphs", [None, GRAPHS_256])
def test_controller_without_spool_is_sglang(
    asp: ModuleType, ars: ModuleType, graphs: list[int] | None
) -> None:
    clock = Clock()
    ours = engine(
        ars,
        SpecgovAdaptiveParams(
            3,
            None,
            spool_dir=None,
            original=asp.AdaptiveSpeculativeParams,
            channel_factory=LocalChannel,
            clock=clock,
        ),
        graphs,
    )
    theirs = engine(ars, asp.AdaptiveSpeculativeParams(3), graphs)
    assert ours.worker.built == theirs.worker.built  # identical CUDA-graph capture
    trace = run_engines(ours, theirs, 1200, clock, seed=1)
    assert all(o == t for _, o, t in trace)
    assert ours.worker.applied == theirs.worker.applied and len(ours.worker.applied) > 10


@pytest.mark.parametrize("graphs", [None, GRAPHS_256])
def test_controller_follows_table_then_sglang_after_expiry(
    asp: ModuleType, ars: ModuleType, tmp_path: Path, graphs: list[int] | None
) -> None:
    clock = Clock()
    batch_s = 1 / 128  # exact in binary: the expiry lands exactly on poll 400
    table = StepTable(
        ((1, 7), (4, 3), (8, 1), (32, 0)), version=1, produced_at_s=clock(), ttl_s=400 * batch_s
    )
    write_step_table(tmp_path, table, DEFAULT_CANDIDATES)
    params = SpecgovAdaptiveParams(
        3,
        None,
        spool_dir=tmp_path,
        original=asp.AdaptiveSpeculativeParams,
        channel_factory=LocalChannel,
        clock=clock,
        poll_every_batches=POLL,
        stats_writer=None,
    )
    ours = engine(ars, params, graphs)
    theirs = engine(ars, asp.AdaptiveSpeculativeParams(3), graphs)
    assert ours.worker.built == theirs.worker.built
    # A twin of SGLang's class fed exactly our verifies: what the fallback must answer.
    twin = asp.AdaptiveSpeculativeParams(3)
    twin.set_cuda_graph_bs(graphs)
    rng = random.Random(9)
    for i in range(900):
        batch_size = rng.randint(1, 300) if rng.random() < 0.3 else rng.randint(1, 12)
        # AdaptiveController raises on a step it did not build: none may come back.
        ours.controller.activate_step_by_batch(batch_size)
        ran = ours.worker.speculative_num_steps
        if i < 400:
            assert params.table == table
            assert ran == table.steps_for(pad(batch_size, graphs)), f"call {i}"
        else:
            assert params.table is None
            assert ran == twin.get_steps_for_batch(batch_size), f"call {i}"
        accepted = draw_accepted(rng, ran, batch_size, 0.7)
        twin.on_verify_complete(accepted, batch_size)
        ours.controller.on_verify_complete(accepted, batch_size)
        clock.now_s += batch_s
    assert set(ours.worker.applied) >= {0, 1, 3, 7}
    assert params.errors == 0 and params.policy is not None and params.policy.errors == 0


# ------------------------------------------------------ (b) the real plugin loader


def _load_as(
    monkeypatch: pytest.MonkeyPatch, name: str, path: Path, *, package: bool = False
) -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        name, path, submodule_search_locations=[str(path.parent)] if package else None
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def fake_sglang(
    sglang_src: Path, asp: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> SimpleNamespace:
    srt = sglang_src / "sglang" / "srt"
    for name in ("sglang", "sglang.srt", "sglang.srt.speculative"):
        shell = ModuleType(name)
        shell.__path__ = []  # a package: resolve_name imports below it
        monkeypatch.setitem(sys.modules, name, shell)
    _load_as(monkeypatch, "sglang.srt.environ", srt / "environ.py")
    hooks = _load_as(
        monkeypatch, "sglang.srt.plugins.hook_registry", srt / "plugins" / "hook_registry.py"
    )
    plugins = _load_as(
        monkeypatch, "sglang.srt.plugins", srt / "plugins" / "__init__.py", package=True
    )
    params_mod = ModuleType("sglang.srt.speculative.adaptive_spec_params")
    params_mod.AdaptiveSpeculativeParams = asp.AdaptiveSpeculativeParams  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, params_mod.__name__, params_mod)
    worker_mod = ModuleType("sglang.srt.speculative.eagle_worker_v2")
    # What eagle_worker_v2.py does: a module-level from-import, used in __init__.
    exec(
        "from sglang.srt.speculative.adaptive_spec_params import AdaptiveSpeculativeParams\n"
        "def build(initial_steps, cfg_path):\n"
        "    return AdaptiveSpeculativeParams(initial_steps=initial_steps, cfg_path=cfg_path)\n",
        worker_mod.__dict__,
    )
    monkeypatch.setitem(sys.modules, worker_mod.__name__, worker_mod)
    monkeypatch.setattr(plugin_mod, "_captured", {})
    monkeypatch.delenv("SPECGOV_SPOOL_DIR", raising=False)
    monkeypatch.delenv("SGLANG_PLATFORM", raising=False)
    return SimpleNamespace(
        hooks=hooks,
        plugins=plugins,
        params_mod=params_mod,
        worker_mod=worker_mod,
        original=asp.AdaptiveSpeculativeParams,
    )


@pytest.mark.parametrize("allow", [None, "specgov", "other, specgov"])
def test_load_plugins_replaces_the_class_everywhere(
    fake_sglang: SimpleNamespace,
    asp: ModuleType,
    monkeypatch: pytest.MonkeyPatch,
    allow: str | None,
) -> None:
    if allow is None:
        monkeypatch.delenv("SGLANG_PLUGINS", raising=False)
    else:
        monkeypatch.setenv("SGLANG_PLUGINS", allow)
    fake_sglang.plugins.load_plugins()
    original = fake_sglang.original
    assert fake_sglang.params_mod.AdaptiveSpeculativeParams is SpecgovAdaptiveParams
    # The stale from-import binding was rebound too (HookRegistry._propagate_patch).
    assert fake_sglang.worker_mod.AdaptiveSpeculativeParams is SpecgovAdaptiveParams
    # ... but not specgov's own reference to SGLang's class, nor the loader's module.
    assert plugin_mod.original_class() is original
    assert asp.AdaptiveSpeculativeParams is original
    hooks = fake_sglang.hooks.HookRegistry
    assert HOOK_TARGET in hooks._patched
    [(hook_type, hook, source)] = hooks._hooks[HOOK_TARGET]
    assert hook_type is fake_sglang.hooks.HookType.REPLACE and hook is SpecgovAdaptiveParams
    assert source.plugin_name == "specgov" and source.dist_name == "specgov"

    # Built as EAGLEWorkerV2 builds it: SGLang's class inside, answering call for call.
    built = fake_sglang.worker_mod.build(3, None)
    assert isinstance(built, SpecgovAdaptiveParams)
    assert isinstance(built.passthrough, original)
    theirs = original(initial_steps=3, cfg_path=None)
    rng = random.Random(4)
    for _ in range(600):
        batch_size = rng.randint(1, 40)
        steps = theirs.get_steps_for_batch(batch_size)
        assert built.get_steps_for_batch(batch_size) == steps
        accepted = draw_accepted(rng, steps, batch_size, 0.85)
        assert built.on_verify_complete(accepted, batch_size) == theirs.on_verify_complete(
            accepted, batch_size
        )
    assert built.mode == "passthrough"


def test_bad_config_through_the_replaced_name_fails_like_sglang(
    fake_sglang: SimpleNamespace, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("SGLANG_PLUGINS", "specgov")
    fake_sglang.plugins.load_plugins()
    bad = tmp_path / "bad.json"
    bad.write_text('{"1": {"candidate_steps": [1, -2]}}')
    with pytest.raises(ValueError) as theirs:
        fake_sglang.original(initial_steps=3, cfg_path=str(bad))
    with pytest.raises(ValueError) as ours:
        fake_sglang.worker_mod.build(3, str(bad))
    assert type(ours.value) is type(theirs.value) and str(ours.value) == str(theirs.value)


def test_sglang_plugins_allow_list_can_exclude_specgov(
    fake_sglang: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SGLANG_PLUGINS", "some_other_plugin")
    fake_sglang.plugins.load_plugins()
    assert fake_sglang.params_mod.AdaptiveSpeculativeParams is fake_sglang.original
    assert fake_sglang.worker_mod.AdaptiveSpeculativeParams is fake_sglang.original
    assert HOOK_TARGET not in fake_sglang.hooks.HookRegistry._hooks
    assert plugin_mod.original_class() is None


def test_register_then_apply_hooks_directly(fake_sglang: SimpleNamespace) -> None:
    """The documented plugin API, without the loader: register, then apply_hooks."""
    plugin_mod.register()
    assert fake_sglang.params_mod.AdaptiveSpeculativeParams is fake_sglang.original  # not yet
    fake_sglang.hooks.HookRegistry.apply_hooks()
    assert fake_sglang.params_mod.AdaptiveSpeculativeParams is SpecgovAdaptiveParams
    assert plugin_mod.original_class() is fake_sglang.original
    # Registering twice (every SGLang process calls load_plugins) stays harmless.
    plugin_mod.register()
    fake_sglang.hooks.HookRegistry.apply_hooks()
    assert plugin_mod.original_class() is fake_sglang.original


# ----------------------------------------------------------- (c) the entry point


def test_installed_distribution_exposes_the_entry_point() -> None:
    eps = {ep.name: ep for ep in entry_points(group="sglang.srt.plugins")}
    assert "specgov" in eps, "run `.venv/bin/pip install -q --no-deps -e .` to refresh the metadata"
    ep = eps["specgov"]
    assert ep.value == "specgov.adapters.sglang_plugin:register"
    assert ep.dist is not None and ep.dist.name == "specgov"
    assert ep.load() is plugin_mod.register
