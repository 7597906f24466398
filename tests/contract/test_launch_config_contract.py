"""Contract tests: specgov's launch configurations against SGLang 0.5.23's own code.

What runs from the wheel, byte for byte:

* the argparse definitions: ``arg_utils.add_cli_args_from_dataclass`` over the real
  ``Spec`` (``arg_groups/fields/spec.py``), ``Schedule`` (``fields/schedule.py``) and
  ``ExecGraph`` (``fields/exec_.py``) namespaces, the ones holding every flag specgov
  writes. Our argv is parsed by that parser with abbreviations off, so each flag
  name, its type and its store_true-ness are SGLang's;
* ``_load_adaptive_config``, ``resolve_candidate_steps_from_config``,
  ``AdaptiveSpeculativeParams`` and ``adaptive_unsupported_reason``
  (``speculative/adaptive_spec_params.py``) on the JSON file specgov writes;
* ``_resolve_speculative_algorithm_alias`` and ``_init_adaptive_speculative_params``
  from ``arg_groups/speculative_hook.py``, compiled on their own from the file's AST.

Why not the whole ``ServerArgs`` validation: ``ServerArgs.resolve_once`` runs the
resolution pipeline, which loads the model's Hugging Face config, probes the CUDA
platform and imports torch (``_handle_eagle_family`` reads
``model_config_of(server_args).hf_config.architectures``). The functions above are the
parts of it that decide speculation; they run with light stand-ins for what they
only read through: ``resolving_view``/``resolved_view`` (identity over the parsed
arguments), ``declare_resolution`` (writes the declared value, as resolution would),
``attn_dp_enabled_of`` (False: no attention DP, a deployment choice specgov does not
make) and ``SpeculativeAlgorithm.from_string(...).get_platform_worker_cls()`` (None:
the built-in CUDA worker). The argparse files import ``msgspec`` (not a specgov
dependency): when it is not installed a stand-in turns its ``Struct`` into a
dataclass, which is all ``add_cli_args_from_dataclass`` reads (fields, defaults,
annotations). Two more names they import, ``human_readable_int`` and
``cuda_graph_config``, are only type parsers and choices of flags specgov never
writes.

Rules SGLang enforces only deep inside ``_handle_eagle_family`` (the all-or-none
assert, the topk = 1 draft-token rewrite) are checked as source facts, so a change
in a future SGLang fails here.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib.util
import inspect
import json
import logging
import shlex
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

from specgov.adapters.launch_config import (
    SGLANG_TOPK1_DRAFT_TOKENS,
    LaunchConfig,
    LaunchConfigError,
    SlotCandidates,
    build_launch_config,
    default_slots,
    parse_shape,
    parse_slots,
    sglang_adaptive_unsupported_reason,
    sglang_bad_candidate_steps,
    sglang_no_slot_key,
    sglang_num_steps_not_candidate,
    shape_from_flags,
)
from specgov.policies.common.types import SpecShape

from .sglang_loader import load_adaptive_spec_params

SRT = "sglang/srt"

# ----------------------------------------------------------- SGLang's argparse


def _msgspec_standin() -> dict[str, ModuleType]:
    """``msgspec.Struct`` as a keyword-only dataclass (what arg_utils reads)."""

    class Struct:
        def __init_subclass__(cls, frozen: bool = False, **_kw: Any) -> None:
            super().__init_subclass__()
            annotations = inspect.get_annotations(cls)
            for name, value in list(vars(cls).items()):
                # msgspec copies mutable defaults; a dataclass needs a factory.
                if name in annotations and isinstance(value, list | dict | set):
                    setattr(
                        cls,
                        name,
                        dataclasses.field(default_factory=lambda v=value: type(v)(v)),
                    )
            dataclasses.dataclass(frozen=frozen, kw_only=True)(cls)

    msgspec = ModuleType("msgspec")
    structs = ModuleType("msgspec.structs")
    structs.fields = dataclasses.fields  # type: ignore[attr-defined]
    msgspec.Struct = Struct  # type: ignore[attr-defined]
    msgspec.NODEFAULT = dataclasses.MISSING  # type: ignore[attr-defined]
    msgspec.structs = structs  # type: ignore[attr-defined]
    return {"msgspec": msgspec, "msgspec.structs": structs}


def _argparse_standins() -> dict[str, ModuleType]:
    common = ModuleType("sglang.srt.utils.common")

    def human_readable_int(text: str) -> int:
        """Stand-in: type parser of flags specgov does not write."""
        return int(text)

    common.human_readable_int = human_readable_int  # type: ignore[attr-defined]
    common.json_list_type = json.loads  # type: ignore[attr-defined]
    graph = ModuleType("sglang.srt.model_executor.cuda_graph_config")

    class Backend:
        ALL = ("full", "breakable", "disabled")

    class CudaGraphConfig:
        pass

    graph.Backend = Backend  # type: ignore[attr-defined]
    graph.CudaGraphConfig = CudaGraphConfig  # type: ignore[attr-defined]
    graph.parse_cuda_graph_backend_arg = str  # type: ignore[attr-defined]
    graph.parse_cuda_graph_config_arg = str  # type: ignore[attr-defined]
    out = {common.__name__: common, graph.__name__: graph}
    if importlib.util.find_spec("msgspec") is None:
        out.update(_msgspec_standin())
    return out


@contextmanager
def _sys_modules(extra: dict[str, ModuleType]) -> Iterator[list[str]]:
    """Install ``extra``; the caller appends the names it loads. All are restored after."""
    names = list(extra)
    saved = {name: sys.modules.get(name) for name in names}
    sys.modules.update(extra)
    try:
        yield names
    finally:
        for name in names:
            previous = saved.get(name)
            if previous is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = previous


def _exec_file(sglang_src: Path, name: str, relpath: str, names: list[str]) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, sglang_src / relpath)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    names.append(name)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def build_sglang_parser(sglang_src: Path, *, allow_abbrev: bool) -> argparse.ArgumentParser:
    """SGLang's own flag definitions for the spec, schedule and exec.graph namespaces."""
    with _sys_modules(_argparse_standins()) as names:
        base, src = "sglang.srt.arg_groups", f"{SRT}/arg_groups"
        _exec_file(sglang_src, f"{base}.choices", f"{src}/choices.py", names)
        arg_utils = _exec_file(sglang_src, f"{base}.arg_utils", f"{src}/arg_utils.py", names)
        spec = _exec_file(sglang_src, f"{base}.fields.spec", f"{src}/fields/spec.py", names)
        schedule = _exec_file(
            sglang_src, f"{base}.fields.schedule", f"{src}/fields/schedule.py", names
        )
        exec_ = _exec_file(sglang_src, f"{base}.fields.exec_", f"{src}/fields/exec_.py", names)
        parser = argparse.ArgumentParser(prog="sglang serve", allow_abbrev=allow_abbrev)
        # get_type_hints resolves the annotations in the modules registered above.
        for cls in (spec.Spec, schedule.Schedule, exec_.ExecGraph):
            arg_utils.add_cli_args_from_dataclass(parser, cls)
    return parser


@pytest.fixture(scope="module")
def sglang_parser(sglang_src: Path) -> argparse.ArgumentParser:
    return build_sglang_parser(sglang_src, allow_abbrev=False)


def test_the_namespaces_parsed_here_are_server_args_namespaces(sglang_src: Path) -> None:
    # ServerArgs collects its fields from these classes (server_args.py imports).
    tree = ast.parse((sglang_src / SRT / "server_args.py").read_text())
    imported = {
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
        and (node.module or "").startswith("sglang.srt.arg_groups.fields")
        for alias in node.names
    }
    assert {"Spec", "Schedule", "ExecGraph"} <= imported


def parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    try:
        return parser.parse_args(argv)
    except SystemExit as exc:  # argparse reports on stderr and exits
        raise AssertionError(f"SGLang's parser rejected {argv}") from exc


# ---------------------------------------------------------- configs under test


def valid_configs(tmp_path: Path) -> dict[str, LaunchConfig]:
    path = str(tmp_path / "adaptive config.json")  # a space: quoting must hold
    slots, defaults = parse_slots(
        "ema_alpha=0.3;1=1,3,5,7/warmup_batches=4/up_hysteresis=0.1;8=0,1,3/"
        "down_hysteresis=0;32=0,1/ceiling_coeff=1.5;64=0/update_interval=3"
    )
    return {
        "eagle3-default-slots": build_launch_config(
            parse_shape("EAGLE3:3"),
            default_slots(),
            draft_model_path="/models/eagle3 head",
            adaptive_config_path=path,
        ),
        "eagle3-custom-slots": build_launch_config(
            shape_from_flags("EAGLE3", None, None, None, adaptive_candidates=[0, 1, 3, 5, 7]),
            slots,
            defaults=defaults,
            adaptive_config_path=path,
            mem_fraction_static=0.82,
            max_running_requests=64,
            cuda_graph_max_bs_decode=96,
        ),
        "nextn-adaptive": build_launch_config(
            parse_shape("NEXTN:1"), parse_slots("1=1,2;16=0,1")[0], adaptive_config_path=path
        ),
        "eagle-tree-static": build_launch_config(
            parse_shape("EAGLE:5,4,8"), draft_model_path="/m/eagle", cuda_graph_max_bs_decode=32
        ),
        "standalone-static": build_launch_config(parse_shape("STANDALONE:3")),
        "ngram-static": build_launch_config(parse_shape("NGRAM:4,2,8")),
        "none": build_launch_config(SpecShape("NONE", 0, 0, 0, ()), mem_fraction_static=0.9),
    }


def write_config(cfg: LaunchConfig) -> str:
    data = cfg.adaptive_config_json()
    assert data is not None
    Path(cfg.adaptive_config_path).write_text(json.dumps(data))
    return cfg.adaptive_config_path


def test_sglang_parser_reads_back_every_flag_we_write(
    sglang_parser: argparse.ArgumentParser, tmp_path: Path
) -> None:
    for name, cfg in valid_configs(tmp_path).items():
        ns = parse(sglang_parser, cfg.to_argv())
        shape = cfg.shape
        if shape.algorithm == "NONE":
            assert ns.speculative_algorithm is None, name
        else:
            assert ns.speculative_algorithm == shape.algorithm, name
            assert ns.speculative_num_steps == shape.num_steps, name
            assert ns.speculative_num_draft_tokens == shape.num_draft_tokens, name
            if shape.algorithm == "NGRAM":
                # SGLang's _handle_ngram copies this into speculative_eagle_topk.
                assert ns.speculative_ngram_max_bfs_breadth == shape.topk, name
                assert ns.speculative_eagle_topk is None, name
            else:
                assert ns.speculative_eagle_topk == shape.topk, name
        assert ns.speculative_draft_model_path == cfg.draft_model_path, name
        assert ns.speculative_adaptive is cfg.adaptive, name
        assert ns.speculative_adaptive_config == (
            cfg.adaptive_config_path if cfg.adaptive else None
        ), name
        assert ns.mem_fraction_static == cfg.mem_fraction_static, name
        assert ns.max_running_requests == cfg.max_running_requests, name
        assert ns.cuda_graph_max_bs_decode == cfg.cuda_graph_max_bs_decode, name
        # The one-line shell form splits back into the same argv.
        assert parse(sglang_parser, shlex.split(cfg.to_shell())) == ns, name


def test_sglang_0_5_23_has_no_cuda_graph_max_bs_flag(sglang_src: Path) -> None:
    # Why specgov writes --cuda-graph-max-bs-decode: with SGLang's default argparse
    # (abbreviations on) the short name is an ambiguous prefix, i.e. an error.
    parser = build_sglang_parser(sglang_src, allow_abbrev=True)
    with pytest.raises(SystemExit):
        parser.parse_args(["--cuda-graph-max-bs", "64"])
    assert parser.parse_args(["--cuda-graph-max-bs-decode", "64"]).cuda_graph_max_bs_decode == 64


# ------------------------------------------------------------ the adaptive JSON


def test_sglang_loads_the_adaptive_config_we_write(sglang_src: Path, tmp_path: Path) -> None:
    asp = load_adaptive_spec_params(sglang_src)
    checked = 0
    for name, cfg in valid_configs(tmp_path).items():
        if not cfg.adaptive:
            assert cfg.adaptive_config_json() is None, name
            continue
        path = write_config(cfg)
        _raw, bs_entries = asp._load_adaptive_config(path)
        assert sorted(bs_entries) == [s.bound for s in cfg.slots], name
        assert tuple(asp.resolve_candidate_steps_from_config(path)) == cfg.shape.candidate_steps
        params = asp.AdaptiveSpeculativeParams(initial_steps=cfg.shape.num_steps, cfg_path=path)
        assert tuple(params.candidate_steps) == cfg.shape.candidate_steps, name
        defaults = dict(cfg.defaults)
        for slot in cfg.slots:
            real = params._slots[slot.bound]
            assert tuple(real.candidate_steps) == slot.candidate_steps, name
            knobs = {**defaults, **dict(slot.knobs)}
            for knob, value in knobs.items():
                assert getattr(real, knob) == value, (name, slot.bound, knob)
            # SGLang starts each slot at --speculative-num-steps when it is a candidate.
            if cfg.shape.num_steps in slot.candidate_steps:
                assert real.current_steps == cfg.shape.num_steps, (name, slot.bound)
        checked += 1
    assert checked == 3


def test_default_slots_are_sglangs_default_config(sglang_src: Path) -> None:
    asp = load_adaptive_spec_params(sglang_src)
    cfg = build_launch_config(parse_shape("EAGLE3:3"), default_slots())
    assert cfg.adaptive_config_json() == asp.DEFAULT_ADAPTIVE_CONFIG


@pytest.mark.parametrize(
    "raw",
    [
        {"1": {"candidate_steps": []}},
        {"1": {"candidate_steps": [-1, 3]}},
        {"1": {"candidate_steps": [1, 2.5]}},
        {"8": {"candidate_steps": "1,3"}},
    ],
)
def test_candidate_step_errors_quote_sglang(
    sglang_src: Path, tmp_path: Path, raw: dict[str, Any]
) -> None:
    asp = load_adaptive_spec_params(sglang_src)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(ValueError) as real:
        asp._load_adaptive_config(str(path))
    ((key, entry),) = raw.items()
    assert str(real.value) == sglang_bad_candidate_steps(key, entry["candidate_steps"])
    # specgov refuses the same table, quoting that text.
    steps = entry["candidate_steps"]
    text = f"{key}=" + (",".join(str(s) for s in steps) if isinstance(steps, list) else steps)
    if isinstance(steps, list) and all(isinstance(s, int) for s in steps):
        with pytest.raises(LaunchConfigError) as ours:
            parse_slots(text)
        assert str(real.value) in str(ours.value)


def test_no_slot_key_error_quotes_sglang(sglang_src: Path, tmp_path: Path) -> None:
    asp = load_adaptive_spec_params(sglang_src)
    path = tmp_path / "no-slot.json"
    path.write_text(json.dumps({"ema_alpha": 0.3}))
    with pytest.raises(ValueError) as real:
        asp._load_adaptive_config(str(path))
    assert str(real.value) == sglang_no_slot_key(["ema_alpha"])
    with pytest.raises(LaunchConfigError) as ours:
        parse_slots("ema_alpha=0.3")
    assert str(real.value) in str(ours.value)


def test_sglang_silently_ignores_non_digit_keys_so_specgov_refuses_them(
    sglang_src: Path, tmp_path: Path
) -> None:
    asp = load_adaptive_spec_params(sglang_src)
    path = tmp_path / "typo.json"
    path.write_text(json.dumps({"l6": {"candidate_steps": [9]}, "1": {"candidate_steps": [1]}}))
    assert asp.resolve_candidate_steps_from_config(str(path)) == [1]  # "l6" vanished
    with pytest.raises(LaunchConfigError, match="'l6' is not a batch size"):
        parse_slots("l6=9;1=1")


# ------------------------------------------- adaptive support and num_steps rules


def _function_from_source(path: Path, name: str, namespace: dict[str, Any]) -> Callable[..., Any]:
    """Compile one top-level function of a wheel file on its own, into ``namespace``."""
    tree = ast.parse(path.read_text())
    node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)
    module = ast.Module(body=[node], type_ignores=[])
    code = compile(module, str(path), "exec")
    exec(code, namespace)  # SGLang's own function body, nothing else
    fn: Callable[..., Any] = namespace[name]
    return fn


@pytest.fixture
def sglang_hooks(sglang_src: Path, monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    """SGLang's speculation-resolution functions over a plain namespace of arguments."""
    asp = load_adaptive_spec_params(sglang_src)

    def view(server_args: Any) -> Any:
        return server_args

    def declare_resolution(server_args: Any, _source: str, **fields: Any) -> None:
        for key, value in fields.items():
            setattr(server_args, key, value)

    class _Algo:
        def get_platform_worker_cls(self) -> None:
            return None

    class _SpeculativeAlgorithm:
        @staticmethod
        def from_string(_name: str) -> _Algo:
            return _Algo()

    monkeypatch.setattr(asp, "resolving_view", view)
    monkeypatch.setattr(asp, "resolved_view", view)
    monkeypatch.setattr(asp, "attn_dp_enabled_of", lambda _v: False)
    monkeypatch.setattr(asp, "SpeculativeAlgorithm", _SpeculativeAlgorithm)
    # _init_adaptive_speculative_params imports resolve_candidate_steps_from_config.
    monkeypatch.setitem(sys.modules, "sglang.srt.speculative.adaptive_spec_params", asp)
    hook_path = sglang_src / SRT / "arg_groups/speculative_hook.py"
    namespace: dict[str, Any] = {
        "resolving_view": view,
        "resolved_view": view,
        "declare_resolution": declare_resolution,
        "logger": logging.getLogger("sglang-contract"),
        "Optional": None,
    }
    return SimpleNamespace(
        asp=asp,
        alias=_function_from_source(hook_path, "_resolve_speculative_algorithm_alias", namespace),
        init_adaptive=_function_from_source(
            hook_path, "_init_adaptive_speculative_params", namespace
        ),
    )


def server_args_from(
    parser: argparse.ArgumentParser, argv: list[str], hooks: SimpleNamespace
) -> SimpleNamespace:
    ns = SimpleNamespace(**vars(parse(parser, argv)))
    # Flags of other namespaces adaptive_unsupported_reason reads, at their defaults.
    ns.enable_two_batch_overlap = False
    ns.enable_pdmux = False
    if ns.speculative_algorithm is not None:
        # No draft path: with one, SGLang reads its Hugging Face config (Gemma4 drafts).
        ns.speculative_algorithm = hooks.alias(ns.speculative_algorithm.upper(), None)
    return ns


def test_sglang_accepts_our_adaptive_configs_as_is(
    sglang_parser: argparse.ArgumentParser, sglang_hooks: SimpleNamespace, tmp_path: Path
) -> None:
    for name, cfg in valid_configs(tmp_path).items():
        if not cfg.adaptive:
            continue
        write_config(cfg)
        ns = server_args_from(sglang_parser, cfg.to_argv(), sglang_hooks)
        assert sglang_hooks.asp.adaptive_unsupported_reason(ns) is None, name
        sglang_hooks.init_adaptive(ns)  # raises on a bad --speculative-num-steps
        # Resolution leaves our explicit values as they are.
        assert ns.speculative_num_steps == cfg.shape.num_steps, name
        assert ns.speculative_eagle_topk == 1, name
        assert ns.speculative_num_draft_tokens == cfg.shape.num_draft_tokens, name


def test_nextn_is_eagle_to_sglang(sglang_hooks: SimpleNamespace) -> None:
    assert sglang_hooks.alias("NEXTN", None) == "EAGLE"
    assert sglang_hooks.alias("EAGLE3", None) == "EAGLE3"
    assert sglang_hooks.alias("NGRAM", None) == "NGRAM"


@pytest.mark.parametrize("algorithm", ["EAGLE", "EAGLE3", "NEXTN", "STANDALONE", "NGRAM"])
@pytest.mark.parametrize("topk", [1, 2, 4])
def test_adaptive_support_matches_sglang(
    sglang_hooks: SimpleNamespace, algorithm: str, topk: int
) -> None:
    ns = SimpleNamespace(
        speculative_algorithm=sglang_hooks.alias(algorithm, None),
        speculative_eagle_topk=topk,
        enable_multi_layer_eagle=False,
        enable_two_batch_overlap=False,
        enable_pdmux=False,
    )
    real = sglang_hooks.asp.adaptive_unsupported_reason(ns)
    assert sglang_adaptive_unsupported_reason(algorithm, topk) == real
    steps = 3
    draft = steps + 1 if topk == 1 or algorithm == "NGRAM" else 8
    shape = SpecShape(algorithm, steps, topk, draft, ())
    if real is None:
        cfg = build_launch_config(shape, parse_slots("1=1,3;8=0,1")[0])
        assert cfg.adaptive
    else:
        with pytest.raises(LaunchConfigError) as ours:
            build_launch_config(shape, parse_slots("1=1,3;8=0,1")[0])
        assert f"speculative_adaptive disabled: {real}." in str(ours.value)


@pytest.mark.parametrize(("steps", "table"), [(4, "1=1,3,5"), (2, "1=1;8=0,3"), (7, "1=0")])
def test_num_steps_outside_candidates_quotes_sglang(
    sglang_parser: argparse.ArgumentParser,
    sglang_hooks: SimpleNamespace,
    tmp_path: Path,
    steps: int,
    table: str,
) -> None:
    slots, _ = parse_slots(table)
    union = sorted({s for slot in slots for s in slot.candidate_steps})
    path = tmp_path / "a.json"
    path.write_text(json.dumps({str(s.bound): s.to_json() for s in slots}))
    argv = [
        "--speculative-algorithm", "EAGLE3",
        "--speculative-num-steps", str(steps),
        "--speculative-eagle-topk", "1",
        "--speculative-num-draft-tokens", str(steps + 1),
        "--speculative-adaptive",
        "--speculative-adaptive-config", str(path),
    ]  # fmt: skip
    ns = server_args_from(sglang_parser, argv, sglang_hooks)
    with pytest.raises(ValueError) as real:
        sglang_hooks.init_adaptive(ns)
    assert str(real.value) == sglang_num_steps_not_candidate(steps, union)
    with pytest.raises(LaunchConfigError) as ours:
        build_launch_config(SpecShape("EAGLE3", steps, 1, steps + 1, ()), slots)
    assert str(real.value) in str(ours.value)


def test_sglang_picks_the_middle_candidate_as_we_do(
    sglang_parser: argparse.ArgumentParser, sglang_hooks: SimpleNamespace, tmp_path: Path
) -> None:
    # With --speculative-num-steps unset SGLang picks union[len // 2]; specgov writes
    # the same value explicitly.
    for table in ("1=1,3,5,7;8=0,1,3", "1=2,4", "1=1;8=0,5;16=0,2"):
        slots, _ = parse_slots(table)
        path = tmp_path / "m.json"
        path.write_text(json.dumps({str(s.bound): s.to_json() for s in slots}))
        argv = [
            "--speculative-algorithm", "EAGLE3",
            "--speculative-adaptive",
            "--speculative-adaptive-config", str(path),
        ]  # fmt: skip
        ns = server_args_from(sglang_parser, argv, sglang_hooks)
        sglang_hooks.init_adaptive(ns)
        union = sorted({s for slot in slots for s in slot.candidate_steps})
        ours = shape_from_flags("EAGLE3", None, None, None, adaptive_candidates=union)
        assert (ns.speculative_num_steps, ns.speculative_eagle_topk) == (ours.num_steps, 1)
        assert ns.speculative_num_draft_tokens == ours.num_draft_tokens


# --------------------------------------------------------------- source facts


def _hook_source(sglang_src: Path) -> str:
    return (sglang_src / SRT / "arg_groups/speculative_hook.py").read_text()


def test_all_or_none_rule_is_still_sglangs(sglang_src: Path) -> None:
    tree = ast.parse(_hook_source(sglang_src))
    fn = next(
        n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "_handle_eagle_family"
    )
    asserts = [ast.unparse(n.test) for n in ast.walk(fn) if isinstance(n, ast.Assert)]
    assert (
        "cfg.speculative_eagle_topk is None and cfg.speculative_num_draft_tokens is None" in asserts
    )


def test_topk1_draft_token_rewrite_is_still_sglangs(sglang_src: Path) -> None:
    source = _hook_source(sglang_src)
    assert SGLANG_TOPK1_DRAFT_TOKENS in source
    assert "speculative_num_draft_tokens=cfg.speculative_num_steps + 1" in source
    with pytest.raises(LaunchConfigError) as ours:
        parse_shape("EAGLE3:3,1,5")
    assert SGLANG_TOPK1_DRAFT_TOKENS in str(ours.value)


def test_ngram_topk_comes_from_max_bfs_breadth(sglang_src: Path) -> None:
    assert "speculative_eagle_topk=cfg.speculative_ngram_max_bfs_breadth" in _hook_source(
        sglang_src
    )


def test_slot_candidates_json_shape_is_sglangs(sglang_src: Path, tmp_path: Path) -> None:
    # One slot through SGLang's AdaptiveStepSlot: the knob names we write are read.
    asp = load_adaptive_spec_params(sglang_src)
    slot = SlotCandidates.of(
        1,
        [1, 3],
        ema_alpha=0.5,
        update_interval=2,
        warmup_batches=1,
        down_hysteresis=-0.1,
        up_hysteresis=0.2,
        ceiling_coeff=2.0,
    )
    real = asp.AdaptiveStepSlot(initial_steps=3, cfg=slot.to_json())
    for knob, value in slot.knobs:
        assert getattr(real, knob) == value


def test_skip_zero_step_env_is_sglangs_step_zero_switch(sglang_src: Path) -> None:
    """SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND is a boolean environment field, default
    false, and eagle_worker_v2 skips the draft-extend pass with it only at steps 0 (what
    LaunchConfig.environment and the simulator's skip flag assume)."""
    from specgov.adapters.launch_config import SKIP_ZERO_STEP_ENV

    environ = (sglang_src / "sglang/srt/environ.py").read_text(encoding="utf-8")
    assert f"    {SKIP_ZERO_STEP_ENV} = EnvBool(False)\n" in environ
    worker = (sglang_src / "sglang/srt/speculative/eagle_worker_v2.py").read_text(encoding="utf-8")
    tree = ast.parse(worker)
    guards = [
        ast.unparse(node.test)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and SKIP_ZERO_STEP_ENV in ast.unparse(node.test)
    ]
    assert guards == [f"self.speculative_num_steps == 0 and envs.{SKIP_ZERO_STEP_ENV}.get()"], (
        guards
    )
    assert "_stub_skipped_draft_extend" in worker
