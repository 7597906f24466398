"""Launch configurations: shapes, slot tables, SGLang's rules, replay recommendations, CLI."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from specgov.adapters.launch_config import (
    DEFAULT_ADAPTIVE_CONFIG_PATH,
    LaunchConfig,
    LaunchConfigError,
    SlotCandidates,
    build_launch_config,
    default_slots,
    format_slots,
    parse_shape,
    parse_slots,
    shape_from_flags,
)
from specgov.controller.cli.sglang_args_cmd import sglang_args
from specgov.controller.daemon.recommend_replay import recommend_from_replay
from specgov.policies.common.types import SpecShape
from specgov.policies.engine.adaptive_config import DEFAULT_ADAPTIVE_CONFIG, parse_adaptive_config

NONE = SpecShape("NONE", 0, 0, 0, ())


# ----------------------------------------------------------------------- shapes


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("EAGLE3:3,1,4", ("EAGLE3", 3, 1, 4)),
        ("eagle3:3", ("EAGLE3", 3, 1, 4)),
        (" EAGLE : 5 , 4 , 8 ", ("EAGLE", 5, 4, 8)),
        ("NGRAM:4,2,8", ("NGRAM", 4, 2, 8)),
        ("STANDALONE:2", ("STANDALONE", 2, 1, 3)),
        ("none", ("NONE", 0, 0, 0)),
    ],
)
def test_parse_shape(text: str, expected: tuple[Any, ...]) -> None:
    shape = parse_shape(text)
    assert (shape.algorithm, shape.num_steps, shape.topk, shape.num_draft_tokens) == expected
    assert shape.candidate_steps == ()


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("EAGLE3", "expected ALGO:STEPS"),
        ("EAGLE3:", "expected ALGO:STEPS"),
        ("EAGLE3:3,1", "got 2 numbers"),
        ("EAGLE3:3,1,4,5", "got 4 numbers"),
        ("EAGLE3:x", "STEPS 'x' is not an integer"),
        ("EAGLE3:3,1,y", "DRAFT_TOKENS 'y' is not an integer"),
        ("MEDUSA:3", "unknown algorithm 'MEDUSA'"),
        ("NONE:3", "NONE takes no numbers"),
        ("EAGLE3:-1", "num_steps must be an int >= 1, got -1"),
        ("EAGLE3:0", "num_steps must be an int >= 1, got 0"),
        ("EAGLE:3,0,4", "topk must be an int >= 1"),
        ("EAGLE3:3,1,5", "num_steps \\+ 1 = 4, got 5.*adjusted to speculative_num_steps \\+ 1"),
    ],
)
def test_parse_shape_errors_name_the_part(text: str, match: str) -> None:
    with pytest.raises(LaunchConfigError, match=match) as err:
        parse_shape(text)
    assert "--shape" in str(err.value)


@pytest.mark.parametrize(
    ("steps", "topk", "draft", "missing"),
    [
        (3, None, None, "--topk, --num-draft-tokens"),
        (None, 1, None, "--num-steps, --num-draft-tokens"),
        (None, None, 4, "--num-steps, --topk"),
        (3, 1, None, "--num-draft-tokens"),
        (None, 1, 4, "--num-steps"),
    ],
)
def test_partial_shape_flags_are_refused(
    steps: int | None, topk: int | None, draft: int | None, missing: str
) -> None:
    with pytest.raises(LaunchConfigError, match="all together or not at all") as err:
        shape_from_flags("EAGLE3", steps, topk, draft)
    assert f"without {missing}" in str(err.value)
    assert "_handle_eagle_family" in str(err.value)


def test_shape_flags() -> None:
    assert shape_from_flags("eagle", 5, 4, 8) == SpecShape("EAGLE", 5, 4, 8, ())
    assert shape_from_flags("NONE", None, None, None) == NONE
    with pytest.raises(LaunchConfigError, match="picks them from the model architecture"):
        shape_from_flags("EAGLE3", None, None, None)
    with pytest.raises(LaunchConfigError, match=r"NONE .* takes no --num-steps"):
        shape_from_flags("NONE", 3, None, None)
    with pytest.raises(LaunchConfigError, match="num_steps must be an int >= 1, got -2"):
        shape_from_flags("EAGLE3", -2, 1, -1)
    with pytest.raises(LaunchConfigError, match="--algorithm: unknown algorithm"):
        shape_from_flags("DFLASH", 3, 1, 4)
    with pytest.raises(LaunchConfigError, match="--algorithm: expected an algorithm"):
        shape_from_flags(None, 3, 1, 4)


@pytest.mark.parametrize(
    ("union", "steps", "topk", "draft", "expected_steps"),
    [
        ([0, 1, 3, 5, 7], None, None, None, 3),  # SGLang: union[len // 2]
        ([1, 3], None, None, None, 3),
        ([2, 4, 6], None, None, None, 4),
        ([0, 1, 3], 1, None, None, 1),
        ([1, 3], 3, 1, 4, 3),
    ],
)
def test_adaptive_flags_resolve_like_sglang(
    union: list[int],
    steps: int | None,
    topk: int | None,
    draft: int | None,
    expected_steps: int,
) -> None:
    shape = shape_from_flags("EAGLE3", steps, topk, draft, adaptive_candidates=union)
    assert (shape.num_steps, shape.topk, shape.num_draft_tokens) == (
        expected_steps,
        1,
        expected_steps + 1,
    )


def test_adaptive_flags_refuse_a_silent_rewrite() -> None:
    with pytest.raises(LaunchConfigError, match="adjusted to speculative_num_steps \\+ 1"):
        shape_from_flags("EAGLE3", 3, None, 9, adaptive_candidates=[1, 3])
    with pytest.raises(LaunchConfigError, match="middle candidate"):
        shape_from_flags("EAGLE3", None, None, None, adaptive_candidates=[0])


# ----------------------------------------------------------------------- slots


def test_parse_slots_with_knobs_and_defaults() -> None:
    slots, defaults = parse_slots(
        " ema_alpha=0.3 ; 8=3,0,1,1/down_hysteresis=0 ; "
        "1=1,3,5,7/warmup_batches=4/up_hysteresis=-1e-1;"
    )
    assert defaults == {"ema_alpha": 0.3}
    assert slots == (
        SlotCandidates(1, (1, 3, 5, 7), (("up_hysteresis", -0.1), ("warmup_batches", 4))),
        SlotCandidates(8, (0, 1, 3), (("down_hysteresis", 0),)),
    )
    assert isinstance(dict(slots[0].knobs)["warmup_batches"], int)


def test_default_slots_equal_sglangs_table() -> None:
    slots, defaults = parse_slots("default")
    assert slots == default_slots() and defaults == {}
    cfg = build_launch_config(parse_shape("EAGLE3:3"), slots)
    assert cfg.adaptive_config_json() == DEFAULT_ADAPTIVE_CONFIG
    assert cfg.shape.candidate_steps == (0, 1, 3, 5, 7)


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("x=1,3", "entry 1 \\('x=1,3'\\): slot key 'x' is not a batch size"),
        ("1=1;bs8=0,1", "entry 2 .*slot key 'bs8' is not a batch size"),
        ("-1=1,3", "slot key '-1' is not a batch size"),
        ("1=", "BS 1: candidate_steps must be a list of non-negative ints, got \\[\\]"),
        ("1=-1,3", "BS 1: candidate_steps must be a list of non-negative ints, got \\[-1, 3\\]"),
        ("1=1,a", "step 'a' is not an integer"),
        ("1=1.5", "step '1.5' is not an integer"),
        ("1=1;1=3", "slot 1 given more than once"),
        ("1=1;01=3", "slot 1 given more than once"),
        ("1=1;;8=0", "entry 2 .*empty entry"),
        ("1", "expected BOUND=STEPS"),
        ("1=1/emaalpha=0.2", "unknown knob 'emaalpha'"),
        ("1=1/ema_alpha", "expected NAME=VALUE"),
        ("1=1/ema_alpha=fast", "'fast' is not a number"),
        ("1=1/ema_alpha=nan", "'nan' is not a number"),
        ("1=1/ema_alpha=1/ema_alpha=2", "knob 'ema_alpha' given twice"),
        ("ema_alpha=0.1;ema_alpha=0.2;1=1", "default knob 'ema_alpha' given twice"),
        ("ema_alpha=0.3", "at least one integer-string BS key"),
        ("", "at least one integer-string BS key"),
    ],
)
def test_parse_slots_errors(text: str, match: str) -> None:
    with pytest.raises(LaunchConfigError, match=match):
        parse_slots(text)


knob_values = st.fixed_dictionaries(
    {},
    optional={
        "ema_alpha": st.floats(0, 1),
        "update_interval": st.integers(1, 50),
        "warmup_batches": st.integers(0, 50),
        "down_hysteresis": st.floats(-2, 2),
        "up_hysteresis": st.floats(-2, 2),
        "ceiling_coeff": st.one_of(st.integers(0, 4), st.floats(0, 4)),
    },
)
slot_tables = st.dictionaries(
    st.integers(0, 512),
    st.tuples(st.lists(st.integers(0, 12), min_size=1, max_size=6), knob_values),
    min_size=1,
    max_size=6,
)


@settings(max_examples=60, deadline=None)
@given(slot_tables)
def test_format_slots_round_trips(table: dict[int, Any]) -> None:
    slots = tuple(
        SlotCandidates.of(bound, steps, **knobs) for bound, (steps, knobs) in sorted(table.items())
    )
    parsed, defaults = parse_slots(format_slots(slots))
    assert parsed == slots and defaults == {}


def test_slot_candidates_validation() -> None:
    assert SlotCandidates.of(4, [3, 1, 3]).candidate_steps == (1, 3)
    with pytest.raises(LaunchConfigError, match="strictly increasing"):
        SlotCandidates(1, (3, 1))
    with pytest.raises(LaunchConfigError, match="BS 1: candidate_steps must be"):
        SlotCandidates(1, ())
    with pytest.raises(LaunchConfigError, match="BS 2: candidate_steps must be"):
        SlotCandidates.of(2, [True, 1])  # a JSON true is not a step
    with pytest.raises(LaunchConfigError, match="non-negative int"):
        SlotCandidates(-1, (1,))
    with pytest.raises(LaunchConfigError, match="unknown knob 'alpha'"):
        SlotCandidates(1, (1,), (("alpha", 0.2),))
    with pytest.raises(LaunchConfigError, match="'update_interval' must be an int"):
        SlotCandidates.of(1, [1], update_interval=2.5)
    with pytest.raises(LaunchConfigError, match="sorted by name"):
        SlotCandidates(1, (1,), (("warmup_batches", 1), ("ema_alpha", 0.2)))


# ----------------------------------------------------------------- LaunchConfig


def test_adaptive_argv_and_json() -> None:
    slots, defaults = parse_slots("ema_alpha=0.25;1=1,3,5/warmup_batches=3;16=0,1")
    cfg = build_launch_config(
        parse_shape("EAGLE3:3"),
        slots,
        defaults=defaults,
        draft_model_path="/models/my eagle",
        adaptive_config_path="/etc/specgov/adaptive.json",
        mem_fraction_static=0.8,
        max_running_requests=64,
        cuda_graph_max_bs_decode=128,
    )
    assert cfg.adaptive
    assert cfg.shape.candidate_steps == (0, 1, 3, 5)
    assert cfg.to_argv() == [
        "--speculative-algorithm", "EAGLE3",
        "--speculative-draft-model-path", "/models/my eagle",
        "--speculative-num-steps", "3",
        "--speculative-eagle-topk", "1",
        "--speculative-num-draft-tokens", "4",
        "--speculative-adaptive",
        "--speculative-adaptive-config", "/etc/specgov/adaptive.json",
        "--mem-fraction-static", "0.8",
        "--max-running-requests", "64",
        "--cuda-graph-max-bs-decode", "128",
    ]  # fmt: skip
    assert shlex.split(cfg.to_shell()) == cfg.to_argv()
    assert "'/models/my eagle'" in cfg.to_shell()
    data = cfg.adaptive_config_json()
    assert data == {
        "ema_alpha": 0.25,
        "1": {"candidate_steps": [1, 3, 5], "warmup_batches": 3},
        "16": {"candidate_steps": [0, 1]},
    }
    # Our own mirror of SGLang's loader agrees (the contract test runs SGLang's).
    parsed = parse_adaptive_config(data)
    assert parsed.candidate_steps == [0, 1, 3, 5]
    assert [s.ema_alpha for s in parsed.slots] == [0.25, 0.25]
    as_json = cfg.to_json()
    assert as_json["argv"] == cfg.to_argv() and as_json["adaptive_config"] == data
    assert as_json["shape"]["candidate_steps"] == [0, 1, 3, 5]


def test_static_and_none_argv() -> None:
    static = build_launch_config(parse_shape("EAGLE:5,4,8"))
    assert not static.adaptive and static.adaptive_config_json() is None
    assert "--speculative-adaptive" not in static.to_argv()
    assert static.to_argv()[-2:] == ["--speculative-num-draft-tokens", "8"]
    ngram = build_launch_config(parse_shape("NGRAM:4,3,8"))
    assert ngram.to_argv() == [
        "--speculative-algorithm", "NGRAM",
        "--speculative-num-steps", "4",
        "--speculative-ngram-max-bfs-breadth", "3",
        "--speculative-num-draft-tokens", "8",
    ]  # fmt: skip
    assert build_launch_config(NONE).to_argv() == []
    assert build_launch_config(NONE, max_running_requests=8).to_argv() == [
        "--max-running-requests",
        "8",
    ]
    # A static shape may name its one step as its candidate set.
    one = SpecShape("EAGLE3", 3, 1, 4, (3,))
    assert build_launch_config(one).shape is one


@pytest.mark.parametrize(
    ("shape", "table", "match"),
    [
        (
            SpecShape("EAGLE3", 3, 4, 8, ()),
            "1=1,3",
            "speculative_adaptive disabled: "
            "speculative_eagle_topk=4 \\(only topk=1 is supported\\)",
        ),
        (
            SpecShape("NGRAM", 3, 1, 4, ()),
            "1=1,3",
            "speculative_algorithm=NGRAM \\(only EAGLE/EAGLE3 are supported\\)",
        ),
        (
            SpecShape("STANDALONE", 3, 1, 4, ()),
            "1=1,3",
            "speculative_algorithm=STANDALONE \\(only EAGLE/EAGLE3 are supported\\)",
        ),
        (
            SpecShape("EAGLE3", 4, 1, 5, ()),
            "1=1,3;8=0,5",
            "--speculative-num-steps=4 is not in the adaptive config candidate_steps "
            "\\[0, 1, 3, 5\\]. Pass one of those values.",
        ),
        (NONE, "1=1,3", "algorithm NONE launches without --speculative-adaptive"),
        (
            SpecShape("EAGLE3", 3, 1, 4, (1, 3, 7)),
            "1=1,3",
            "differ from the union of the slots' candidate steps \\[1, 3\\]",
        ),
    ],
)
def test_bad_adaptive_combinations(shape: SpecShape, table: str, match: str) -> None:
    with pytest.raises(LaunchConfigError, match=match):
        build_launch_config(shape, parse_slots(table)[0])


def test_nextn_is_allowed_adaptive() -> None:
    cfg = build_launch_config(parse_shape("NEXTN:1"), parse_slots("1=1,3")[0])
    assert cfg.to_argv()[:2] == ["--speculative-algorithm", "NEXTN"]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"defaults": {"ema_alpha": 0.3}}, "knobs were given without a slot table"),
        ({"mem_fraction_static": 1.0}, "--mem-fraction-static: expected a fraction in \\(0, 1\\)"),
        ({"mem_fraction_static": 0}, "--mem-fraction-static"),
        ({"max_running_requests": 0}, "--max-running-requests: expected an int >= 1"),
        ({"cuda_graph_max_bs_decode": 1.5}, "--cuda-graph-max-bs-decode: expected an int"),
        ({"draft_model_path": ""}, "--speculative-draft-model-path: expected a non-empty path"),
        ({"adaptive_config_path": " "}, "adaptive_config_path: expected a non-empty path"),
    ],
)
def test_bad_static_options(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(LaunchConfigError, match=match):
        build_launch_config(parse_shape("EAGLE3:3"), **kwargs)


def test_draft_model_with_ngram_or_none_is_refused() -> None:
    for shape in (parse_shape("NGRAM:3,1,4"), NONE):
        with pytest.raises(LaunchConfigError, match="has no draft model"):
            build_launch_config(shape, draft_model_path="/m/d")


@pytest.mark.parametrize(
    ("table", "match"),
    [
        ("1=1,3/ema_alpha=1.5", "ema_alpha: expected a number in \\[0, 1\\]"),
        ("1=1,3/update_interval=0", "update_interval: expected an int >= 1"),
        ("1=1,3/warmup_batches=-1", "warmup_batches: expected an int >= 0"),
        ("1=1,3/ceiling_coeff=-1", "ceiling_coeff: expected a finite number >= 0"),
        ("warmup_batches=2.5;1=1,3", "'warmup_batches' must be an int"),
    ],
)
def test_bad_knob_values(table: str, match: str) -> None:
    with pytest.raises(LaunchConfigError, match=match):
        slots, defaults = parse_slots(table)
        build_launch_config(parse_shape("EAGLE3:3"), slots, defaults=defaults)


def test_launch_config_direct_construction_is_validated() -> None:
    slots = parse_slots("1=1,3")[0]
    with pytest.raises(LaunchConfigError, match="must equal the union"):
        LaunchConfig(SpecShape("EAGLE3", 3, 1, 4, ()), slots)
    with pytest.raises(LaunchConfigError, match="unique and increasing"):
        LaunchConfig(SpecShape("EAGLE3", 1, 1, 2, (1,)), (slots[0], slots[0]))
    with pytest.raises(LaunchConfigError, match="a static launch builds only"):
        LaunchConfig(SpecShape("EAGLE3", 3, 1, 4, (1, 3)))
    with pytest.raises(LaunchConfigError, match="expected a SpecShape"):
        LaunchConfig("EAGLE3:3")  # type: ignore[arg-type]
    with pytest.raises(LaunchConfigError, match="given more than once"):
        build_launch_config(parse_shape("EAGLE3:3"), [*slots, *slots])


# ----------------------------------------------------------- from a replay


def policy(name: str, goodput: float, hist: dict[int, dict[int, int]] | None = None) -> Any:
    return {
        "name": name,
        "goodput_tok_s": goodput,
        "steps_per_slot": {
            str(b): {str(s): n for s, n in per.items()} for b, per in (hist or {}).items()
        },
    }


def report(*policies: Any, drafter: str = "eagle3", topk: int = 1, **server: Any) -> Any:
    return {
        "policies": list(policies),
        "trace": {"name": "t"},
        "server": {"gpu": "h100", "model": "m", "drafter": drafter, "topk": topk, **server},
        "seed": 7,
        "slo": {"tpot_ms": 50.0},
    }


def test_recommend_best_static() -> None:
    rep = report(
        policy("none", 500.0),
        policy("static:1", 700.0, {1: {1: 10}}),
        policy("static:3", 760.0, {1: {3: 10}}),
        policy("static:5", 740.0, {1: {5: 10}}),
    )
    cfg = recommend_from_replay(rep)
    assert cfg.shape == SpecShape("EAGLE3", 3, 1, 4, ())
    assert not cfg.adaptive
    assert "static:3 at 760.0" in cfg.rationale and "static:5 740.0" in cfg.rationale


def test_recommend_ties_prefer_fewer_steps() -> None:
    rep = report(policy("static:5", 700.0), policy("static:2", 700.0))
    assert recommend_from_replay(rep).shape.num_steps == 2


def test_recommend_adaptive_from_histogram() -> None:
    hist = {
        1: {1: 60, 3: 570, 5: 370},  # all three above 5 %
        8: {0: 2, 1: 300, 3: 98},  # 0 below 5 %
        32: {0: 0},  # never ran: no slot
        64: {0: 50},
    }
    rep = report(
        policy("static:3", 700.0), policy("static:1", 650.0), policy("sglang-ema", 720.0, hist)
    )
    cfg = recommend_from_replay(rep, draft_model_path="/m/head")
    assert cfg.adaptive
    assert cfg.slots == (
        SlotCandidates(1, (1, 3, 5)),
        SlotCandidates(8, (1, 3)),
        SlotCandidates(64, (0,)),
    )
    assert cfg.shape == SpecShape("EAGLE3", 3, 1, 4, (0, 1, 3, 5))
    assert cfg.draft_model_path == "/m/head"
    assert "--slots '1=1,3,5;8=1,3;64=0'" in cfg.rationale


def test_recommend_adds_best_static_step_to_busiest_slot() -> None:
    hist = {1: {1: 100, 5: 900}, 8: {0: 4000, 1: 1000}}
    rep = report(policy("static:3", 700.0), policy("my-adaptive", 701.0, hist))
    cfg = recommend_from_replay(rep)
    assert cfg.slots == (SlotCandidates(1, (1, 5)), SlotCandidates(8, (0, 1, 3)))
    assert cfg.shape.num_steps == 3
    assert "busiest slot 8" in cfg.rationale


def test_recommend_static_when_adaptive_settles_or_loses() -> None:
    settles = report(
        policy("static:3", 700.0), policy("sglang-ema", 700.0, {1: {3: 990, 5: 10}, 8: {3: 50}})
    )
    cfg = recommend_from_replay(settles)
    assert not cfg.adaptive and cfg.shape.num_steps == 3
    assert "settles on step 3" in cfg.rationale
    loses = report(policy("static:3", 700.0), policy("sglang-ema", 650.0, {1: {1: 5, 3: 5}}))
    assert not recommend_from_replay(loses).adaptive


def test_recommend_no_speculation() -> None:
    cfg = recommend_from_replay(report(policy("none", 800.0), policy("static:3", 700.0)))
    assert cfg.shape == NONE and cfg.to_argv() == []
    assert "beats every speculative run" in cfg.rationale
    zero = recommend_from_replay(report(policy("static:0", 800.0), policy("static:3", 700.0)))
    assert zero.shape == NONE and "never drafts" in zero.rationale


def test_recommend_only_adaptive_run() -> None:
    rep = report(policy("sglang-ema", 700.0, {1: {1: 10, 3: 80}, 8: {0: 50, 1: 50}}))
    cfg = recommend_from_replay(rep)
    assert cfg.adaptive and cfg.shape.num_steps == 3  # the most used positive step
    assert "most used positive step" in cfg.rationale


def test_recommend_algorithm_sources() -> None:
    rep = report(policy("static:2", 1.0), drafter="llama-3.2-1b")
    with pytest.raises(LaunchConfigError, match="pass the algorithm explicitly"):
        recommend_from_replay(rep)
    assert recommend_from_replay(rep, algorithm="standalone").shape.algorithm == "STANDALONE"
    rep = report(policy("static:2", 1.0), drafter="whatever", algorithm="EAGLE")
    assert recommend_from_replay(rep).shape.algorithm == "EAGLE"
    rep = report(policy("static:2", 1.0), drafter="eagle-3")
    assert recommend_from_replay(rep).shape.algorithm == "EAGLE3"


def test_recommend_adaptive_not_available_falls_back() -> None:
    rep = report(
        policy("static:3", 700.0),
        policy("sglang-ema", 720.0, {1: {1: 50, 3: 50}}),
        drafter="ngram",
    )
    cfg = recommend_from_replay(rep)
    assert not cfg.adaptive and cfg.shape.algorithm == "NGRAM"
    assert "not available for NGRAM" in cfg.rationale


def test_recommend_tree_shape_uses_server_draft_tokens() -> None:
    rep = report(policy("static:5", 700.0), drafter="eagle", topk=4, num_draft_tokens=8)
    assert recommend_from_replay(rep).shape == SpecShape("EAGLE", 5, 4, 8, ())
    with pytest.raises(LaunchConfigError, match=r"server\.num_draft_tokens"):
        recommend_from_replay(report(policy("static:5", 700.0), drafter="eagle", topk=4))


@pytest.mark.parametrize(
    ("rep", "match"),
    [
        ([], "top level: expected a JSON object"),
        ({"policies": []}, "key 'policies': expected a non-empty list"),
        ({"policies": [{"goodput_tok_s": 1.0}]}, "policies\\[0\\].name"),
        ({"policies": [{"name": "static:1", "goodput_tok_s": "fast"}]}, "goodput_tok_s"),
        (
            {"policies": [{"name": "x", "goodput_tok_s": 1.0, "steps_per_slot": {"a": {}}}]},
            "steps_per_slot: expected digit keys",
        ),
        (
            {"policies": [{"name": "x", "goodput_tok_s": 1.0, "steps_per_slot": {"1": {"3": -2}}}]},
            "steps_per_slot\\['1'\\]\\['3'\\]: expected a batch count",
        ),
        ({"policies": [{"name": "none", "goodput_tok_s": 1.0}]}, "no static:K and no adaptive"),
    ],
)
def test_recommend_bad_reports(rep: Any, match: str) -> None:
    with pytest.raises(LaunchConfigError, match=match):
        recommend_from_replay(rep)


def test_recommend_from_a_real_replay(tmp_path: Path) -> None:
    from specgov.controller.cli.main import main

    runner = CliRunner()
    res = runner.invoke(
        main,
        [
            "replay", "synthetic:duration=20", "--policy", "static:1", "--policy", "static:3",
            "--policy", "sglang-ema", "--output", "json",
        ],
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    cfg = recommend_from_replay(data)
    best = max(
        (p for p in data["policies"] if p["name"].startswith("static:")),
        key=lambda p: (p["goodput_tok_s"], -int(p["name"][7:])),
    )
    assert cfg.shape.algorithm == "EAGLE3"
    assert cfg.shape.num_steps == int(best["name"][7:])
    assert best["name"] in cfg.rationale


# ------------------------------------------------------------------------ CLI


def invoke(*args: str) -> Any:
    return CliRunner().invoke(sglang_args, list(args))


def test_cli_static_text() -> None:
    res = invoke("--shape", "EAGLE3:3", "--cuda-graph-max-bs-decode", "48")
    assert res.exit_code == 0, res.output
    assert res.stdout.splitlines() == [
        "--speculative-algorithm EAGLE3 --speculative-num-steps 3 --speculative-eagle-topk 1 "
        "--speculative-num-draft-tokens 4 --cuda-graph-max-bs-decode 48"
    ]


def test_cli_adaptive_prints_flags_then_json() -> None:
    res = invoke("--algorithm", "EAGLE3", "--slots", "1=1,3,5;8=0,1")
    assert res.exit_code == 0, res.output
    first, rest = res.stdout.split("\n", 1)
    argv = shlex.split(first)
    assert argv[argv.index("--speculative-num-steps") + 1] == "3"  # middle of [0, 1, 3, 5]
    assert argv[-1] == DEFAULT_ADAPTIVE_CONFIG_PATH
    assert json.loads(rest) == {
        "1": {"candidate_steps": [1, 3, 5]},
        "8": {"candidate_steps": [0, 1]},
    }
    assert f"save the JSON below as {DEFAULT_ADAPTIVE_CONFIG_PATH}" in res.stderr


def test_cli_config_out_writes_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    res = invoke(
        "--algorithm", "eagle3", "--num-steps", "1", "--slots", "default",
        "--config-out", "cfg.json", "--output", "json",
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    written = tmp_path / "cfg.json"
    assert data["adaptive_config_written"] is True
    assert data["adaptive_config_path"] == str(written)  # absolute: launch from anywhere
    assert json.loads(written.read_text()) == data["adaptive_config"] == DEFAULT_ADAPTIVE_CONFIG
    assert data["argv"][data["argv"].index("--speculative-adaptive-config") + 1] == str(written)
    assert shlex.split(data["shell"]) == data["argv"]


def test_cli_from_replay(tmp_path: Path) -> None:
    path = tmp_path / "report.json"
    hist = {1: {1: 100, 3: 500}, 8: {0: 300, 1: 200}}
    path.write_text(
        json.dumps(report(policy("static:3", 700.0), policy("sglang-ema", 720.0, hist)))
    )
    out = tmp_path / "a.json"
    res = invoke(
        "--from-replay", str(path), "--config-out", str(out), "--max-running-requests", "32"
    )
    assert res.exit_code == 0, res.output
    argv = shlex.split(res.stdout.strip())
    assert "--speculative-adaptive" in argv and argv[-2:] == ["--max-running-requests", "32"]
    assert json.loads(out.read_text()) == {
        "1": {"candidate_steps": [1, 3]},
        "8": {"candidate_steps": [0, 1]},
    }
    assert "best adaptive run sglang-ema" in res.stderr


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((), "nothing to configure"),
        (("--shape", "EAGLE3:3", "--num-steps", "3"), "--shape already gives .* drop --num-steps"),
        (("--shape", "EAGLE3:3", "--algorithm", "EAGLE"), "drop --algorithm"),
        (("--from-replay", "r.json", "--slots", "1=1"), "--from-replay chooses .* drop --slots"),
        (("--from-replay", "missing.json"), "--from-replay missing.json: cannot read"),
        (("--algorithm", "EAGLE3", "--num-steps", "3"), "all together or not at all"),
        (("--algorithm", "EAGLE3", "--slots", "x=1"), "slot key 'x' is not a batch size"),
        (("--shape", "EAGLE3:4,4,8", "--slots", "1=1,4"), "only topk=1 is supported"),
        (("--shape", "EAGLE3:-3"), "num_steps must be an int >= 1, got -3"),
        (("--shape", "EAGLE3:3", "--mem-fraction-static", "1.5"), "--mem-fraction-static"),
    ],
)
def test_cli_errors_are_one_clean_line(
    args: tuple[str, ...], match: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    res = invoke(*args)
    assert res.exit_code == 2  # bad input is a usage error (issue 12 §4)
    assert "Traceback" not in res.output
    assert res.exception is None or isinstance(res.exception, SystemExit)
    assert res.stderr.startswith("Error: ")
    assert re.search(match, res.stderr), res.stderr


def test_cli_bad_report_json(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    path.write_text('{"policies": [\n oops]}')
    res = invoke("--from-replay", str(path))
    assert res.exit_code == 2
    assert "not JSON (line 2, column 2" in res.stderr


def test_cli_none_and_static_config_out(tmp_path: Path) -> None:
    out = tmp_path / "never.json"
    res = invoke("--shape", "NONE", "--config-out", str(out))
    assert res.exit_code == 0 and res.stdout == ""
    assert "no speculation" in res.stderr and not out.exists()


# ------------------------------------------- SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND


def _eagle(candidates: tuple[int, ...] = (0, 1, 3)) -> SpecShape:
    return SpecShape("EAGLE3", 3, 1, 4, candidates)


def test_skip_zero_step_goes_into_the_environment_only() -> None:
    from specgov.adapters.launch_config import SKIP_ZERO_STEP_ENV, SlotCandidates
    from specgov.adapters.launch_config import build_launch_config as build

    slots = [SlotCandidates.of(1, [1, 3]), SlotCandidates.of(32, [0, 1])]
    plain = build(SpecShape("EAGLE3", 3, 1, 4, ()), slots)
    skip = build(SpecShape("EAGLE3", 3, 1, 4, ()), slots, skip_zero_step_draft_extend=True)
    assert skip.to_argv() == plain.to_argv()  # not a server flag in 0.5.23
    assert plain.environment() == {} and plain.to_json()["environment"] == {}
    assert skip.environment() == {SKIP_ZERO_STEP_ENV: "1"}
    assert skip.to_json()["environment"] == {SKIP_ZERO_STEP_ENV: "1"}


def test_skip_zero_step_without_a_zero_candidate_is_refused() -> None:
    from specgov.adapters.launch_config import LaunchConfigError, SlotCandidates
    from specgov.adapters.launch_config import build_launch_config as build

    with pytest.raises(LaunchConfigError, match="no slot can choose 0: SGLang would ignore it"):
        build(
            SpecShape("EAGLE3", 3, 1, 4, ()),
            [SlotCandidates.of(1, [1, 3])],
            skip_zero_step_draft_extend=True,
        )
    with pytest.raises(LaunchConfigError, match="no slot can choose 0"):
        build(SpecShape("EAGLE3", 3, 1, 4, (3,)), skip_zero_step_draft_extend=True)


def test_recommend_skip_zero_step_when_the_high_slots_stay_at_zero() -> None:
    from specgov.adapters.launch_config import (
        SKIP_ZERO_STEP_ENV,
        LaunchConfigError,
        SlotCandidates,
        recommend_skip_zero_step,
    )

    slots = [SlotCandidates.of(1, [1, 3, 5]), SlotCandidates.of(8, [0, 1, 3])]
    slots.append(SlotCandidates.of(32, [0, 1]))
    idle_high = {(1, 3): 500, (8, 0): 950, (8, 1): 50, (32, 0): 400}
    why = recommend_skip_zero_step(idle_high, slots)
    assert why is not None and SKIP_ZERO_STEP_ENV in why and "slot 8: 95 % of 1000" in why
    # A slot that still drafts often: no.
    assert recommend_skip_zero_step({(8, 0): 700, (8, 1): 300, (32, 0): 400}, slots) is None
    # Too few batches to judge anywhere: no.
    assert recommend_skip_zero_step({(8, 0): 50, (32, 0): 40}, slots) is None
    # A slot too small to judge does not block the others.
    assert recommend_skip_zero_step({(8, 0): 5, (8, 3): 5, (32, 0): 400}, slots) is not None
    assert recommend_skip_zero_step({(1, 0): 999}, [SlotCandidates.of(1, [1, 3])]) is None
    with pytest.raises(LaunchConfigError, match="min_share: expected a fraction"):
        recommend_skip_zero_step(idle_high, slots, min_share=0.0)
