"""Load SGLang's adaptive-speculation modules straight from the unpacked 0.5.23 wheel.

Importing the ``sglang`` package pulls in torch and CUDA, so the contract tests load
single files with ``importlib.util.spec_from_file_location``, bypassing the package
``__init__``:

* ``sglang/srt/speculative/adaptive_runtime_state.py`` (``SpecRuntimeState``,
  ``AdaptiveSpecPolicy``, ``AdaptiveController``) imports sglang names only under
  ``TYPE_CHECKING``: it loads as is.
* ``sglang/srt/speculative/adaptive_spec_params.py`` (``DEFAULT_ADAPTIVE_CONFIG``,
  ``_load_adaptive_config``, ``AdaptiveStepSlot``, ``AdaptiveSpeculativeParams``)
  imports five names at module level. Light stub modules stand in for them while the
  file executes, and ``sys.modules`` is restored afterwards.

Why the stubs are safe: in that file ``resolved_view``, ``resolving_view``
(``sglang.srt.arg_groups.overrides``), ``attn_dp_enabled_of``
(``sglang.srt.runtime_context``) and ``SpeculativeAlgorithm``
(``sglang.srt.speculative.spec_info``) are used only inside
``adaptive_unsupported_reason`` (a server-args check the tests never call; the stubs
raise if it is called, so nothing could pass by accident), and ``log_info_on_rank0``
(``sglang.srt.utils``) only logs. The config loader, the EMA slots and the routing
the tests compare against use none of them, so the code under test is SGLang's own,
byte for byte.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

SPEC_PARAMS = "sglang/srt/speculative/adaptive_spec_params.py"
RUNTIME_STATE = "sglang/srt/speculative/adaptive_runtime_state.py"

_cache: dict[tuple[str, str], ModuleType] = {}


def _unavailable(name: str) -> Any:
    def fail(*_args: object, **_kwargs: object) -> Any:
        raise RuntimeError(f"{name} is a contract-test stub; SGLang's real one is not loaded")

    return fail


class _StubSpeculativeAlgorithm:
    from_string = staticmethod(_unavailable("SpeculativeAlgorithm.from_string"))


def _log_info_on_rank0(logger: logging.Logger, msg: str) -> None:
    # The real one logs on TP rank 0 only; a test process is "rank 0".
    logger.info(msg)


def _stub_modules() -> dict[str, ModuleType]:
    overrides = ModuleType("sglang.srt.arg_groups.overrides")
    overrides.resolved_view = _unavailable("resolved_view")  # type: ignore[attr-defined]
    overrides.resolving_view = _unavailable("resolving_view")  # type: ignore[attr-defined]
    runtime_context = ModuleType("sglang.srt.runtime_context")
    runtime_context.attn_dp_enabled_of = _unavailable("attn_dp_enabled_of")  # type: ignore[attr-defined]
    spec_info = ModuleType("sglang.srt.speculative.spec_info")
    spec_info.SpeculativeAlgorithm = _StubSpeculativeAlgorithm  # type: ignore[attr-defined]
    utils = ModuleType("sglang.srt.utils")
    utils.log_info_on_rank0 = _log_info_on_rank0  # type: ignore[attr-defined]
    return {m.__name__: m for m in (overrides, runtime_context, spec_info, utils)}


@contextmanager
def stubbed_sglang_imports() -> Iterator[None]:
    """Put the stub modules in ``sys.modules``; restore whatever was there afterwards.

    ``from a.b.c import x`` finds ``a.b.c`` in ``sys.modules`` without importing the
    parent packages, so the real ``sglang/__init__.py`` (torch) never runs.
    """
    stubs = _stub_modules()
    saved = {name: sys.modules.get(name) for name in stubs}
    sys.modules.update(stubs)
    try:
        yield
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def load_sglang_file(sglang_src: Path, relpath: str) -> ModuleType:
    """Execute one file of the wheel as a private module (cached per path)."""
    path = Path(sglang_src) / relpath
    key = (str(path.resolve()), relpath)
    if key in _cache:
        return _cache[key]
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found; is the sglang 0.5.23 wheel unpacked there?")
    # A private name: never shadows a real sglang module, and the loaded module's
    # logger has a recognisable name.
    name = "_specgov_contract_" + relpath.removesuffix(".py").replace("/", "_")
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # dataclasses look their class's module up in sys.modules while decorating.
    previous = sys.modules.get(name)
    sys.modules[name] = module
    try:
        with stubbed_sglang_imports():
            spec.loader.exec_module(module)
    finally:
        if previous is None:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = previous
    _cache[key] = module
    return module


def load_adaptive_spec_params(sglang_src: Path) -> ModuleType:
    """SGLang's ``adaptive_spec_params`` module (AdaptiveSpeculativeParams & co)."""
    return load_sglang_file(sglang_src, SPEC_PARAMS)


def load_adaptive_runtime_state(sglang_src: Path) -> ModuleType:
    """SGLang's ``adaptive_runtime_state`` module (AdaptiveController & co)."""
    return load_sglang_file(sglang_src, RUNTIME_STATE)
