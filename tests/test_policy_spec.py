"""Policy spec strings: one syntax, canonical form, errors that name the bad part."""

from __future__ import annotations

import copy
import importlib.util
import pickle
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specgov.policies.daemon.bandit import BanditConfig, BanditPolicy
from specgov.policies.daemon.protocol import DaemonPolicy
from specgov.policies.daemon.schedules import BatchTablePolicy, NonePolicy, StaticPolicy
from specgov.policies.daemon.spec import (
    KNOWN_KINDS,
    PolicySpec,
    PolicySpecError,
    build_daemon_policy,
    format_policy_spec,
    parse_policy_spec,
    static_steps,
)

HAVE_GOODPUT = importlib.util.find_spec("specgov.policies.daemon.goodput") is not None


@pytest.mark.parametrize(
    ("text", "kind", "params", "canonical"),
    [
        ("none", "none", {}, "none"),
        ("static:3", "static", {"steps": 3}, "static:3"),
        (" static : 3 ", "static", {"steps": 3}, "static:3"),
        ("static:steps=0", "static", {"steps": 0}, "static:0"),
        ("sglang-ema", "sglang-ema", {}, "sglang-ema"),
        (
            "batch-table:1=5,8=3,32=1,64=0",
            "batch-table",
            {"1": 5, "8": 3, "32": 1, "64": 0},
            "batch-table:1=5,8=3,32=1,64=0",
        ),
        (
            "batch-table: 1=2 , 16=0",
            "batch-table",
            {"1": 2, "16": 0},
            "batch-table:1=2,16=0",
        ),
        ("goodput", "goodput", {}, "goodput"),
        ("bandit", "bandit", {}, "bandit"),
        (
            "bandit:algo=thompson,seed=1,window_s=60",
            "bandit",
            {"algo": "thompson", "seed": 1, "window_s": 60.0},
            "bandit:algo=thompson,seed=1,window_s=60",
        ),
        ("bandit:window_s=1e2,explore=.5", "bandit", {"window_s": 100.0, "explore": 0.5}, None),
    ],
)
def test_parses_the_documented_forms(
    text: str, kind: str, params: dict[str, Any], canonical: str | None
) -> None:
    spec = parse_policy_spec(text)
    assert spec.kind == kind
    assert dict(spec.params) == params
    assert spec.text == text.strip()
    formatted = format_policy_spec(spec)
    if canonical is not None:
        assert formatted == canonical
    assert parse_policy_spec(formatted) == spec
    assert hash(parse_policy_spec(formatted)) == hash(spec)


@pytest.mark.skipif(not HAVE_GOODPUT, reason="policies/goodput.py not written yet")
def test_goodput_keys_come_from_its_config() -> None:
    spec = parse_policy_spec("goodput:slo_tpot_ms=40,explore=0.05")
    assert dict(spec.params) == {"slo_tpot_ms": 40.0, "explore": 0.05}
    assert format_policy_spec(spec) == "goodput:explore=0.05,slo_tpot_ms=40"
    assert dict(parse_policy_spec("goodput:slo_tpot_ms=none").params) == {"slo_tpot_ms": None}


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "batch-table:1=5,x=3",
            "batch-table:1=5,x=3: key 'x' is not a batch size "
            "(expected N=K pairs with N >= 1 ascending, first N = 1)",
        ),
        ("batch-table:1=5,8=3,4=1", "batch size 4 after 8 is not ascending"),
        ("batch-table:1=5,8=3,8=1", "duplicate key '8'"),
        ("batch-table:1=5,01=3", "duplicate batch size 1"),
        ("batch-table:4=5,8=3", "the first batch size must be 1, got 4"),
        ("batch-table:0=5", "the first batch size must be 1, got 0"),
        ("batch-table:1=-1", "steps for batch size 1 must be an int >= 0, got '-1'"),
        ("batch-table:1=two", "steps for batch size 1 must be an int >= 0, got 'two'"),
        ("batch-table:1=5,junk", "item 'junk' is not N=K"),
        ("batch-table", "batch-table needs a schedule"),
        ("batch-table:1=2,ttl_s=3", "key 'ttl_s' is not a batch size"),
        ("turbo", "unknown policy kind 'turbo'; valid kinds: " + ", ".join(KNOWN_KINDS)),
        ("Static:3", "unknown policy kind 'Static'"),
        ("", "empty policy spec; expected one of none, static"),
        ("static", "static needs a step count, e.g. static:3"),
        ("static:-2", "static steps must be an int >= 0, got -2"),
        ("static:3.5", "parameter 'steps' of static: expected an int, got '3.5'"),
        ("static:3,4", "item '4' is not key=value"),
        ("static:3,steps=4", "duplicate key 'steps'"),
        ("static:", "nothing after ':'"),
        # No kind takes a TTL: the guardrails' table_ttl_s stamps every published table.
        ("none:ttl_s=5", "unknown parameter 'ttl_s' for none; valid keys: (none"),
        ("static:3,ttl_s=12", "unknown parameter 'ttl_s' for static; valid keys: steps"),
        ("goodput:ttl_s=12", "unknown parameter 'ttl_s' for goodput"),
        ("bandit:ttl_s=12", "unknown parameter 'ttl_s' for bandit"),
        ("sglang-ema:alpha=1", "unknown parameter 'alpha' for sglang-ema; valid keys: (none"),
        ("bandit:algo=exp3", "BanditConfig.algo: expected one of ucb, thompson, thompson-beta"),
        ("bandit:seed=1,seed=2", "duplicate key 'seed'"),
        ("bandit:seed=x", "parameter 'seed' of bandit: expected an int, got 'x'"),
        ("bandit:window_s=nan", "parameter 'window_s' of bandit: expected a finite number"),
        ("bandit:window_s=1e999", "expected a finite number, got '1e999'"),
        ("bandit:gamma=0.9", "unknown parameter 'gamma' for bandit; valid keys: algo, seed"),
        ("bandit:algo=a b", "parameter 'algo' of bandit: expected a word"),
        ("bandit:=3", "item '=3' has no key before '='"),
        ("bandit:seed=1,", "empty item at position 2 (stray ',')"),
        # Longer than MAX_SPEC_CHARS: refused for its length before any int() is tried.
        ("bandit:seed=" + "9" * 5000, "a policy spec holds at most 4096"),
    ],
)
def test_errors_name_the_bad_part(text: str, expected: str) -> None:
    with pytest.raises(PolicySpecError) as err:
        parse_policy_spec(text)
    assert expected in str(err.value)
    assert isinstance(err.value, ValueError)


@pytest.mark.skipif(not HAVE_GOODPUT, reason="policies/goodput.py not written yet")
def test_goodput_errors_name_the_key() -> None:
    with pytest.raises(PolicySpecError, match=r"unknown parameter 'slo' for goodput; valid keys"):
        parse_policy_spec("goodput:slo=40")
    with pytest.raises(PolicySpecError, match=r"'explore'"):
        parse_policy_spec("goodput:explore=2")
    with pytest.raises(PolicySpecError, match=r"'seed' of goodput: expected an int"):
        parse_policy_spec("goodput:seed=1.5")


def test_builds_the_fixed_policies() -> None:
    none = build_daemon_policy(parse_policy_spec("none"))
    assert isinstance(none, NonePolicy)
    static = build_daemon_policy(parse_policy_spec("static:3"))
    assert isinstance(static, StaticPolicy)
    assert (static.steps, static.name) == (3, "static:3")
    table = build_daemon_policy("batch-table:1=5,8=3,32=1,64=0")
    assert isinstance(table, BatchTablePolicy)
    assert table.schedule == ((1, 5), (8, 3), (32, 1), (64, 0))
    assert build_daemon_policy(parse_policy_spec("sglang-ema")) is None


def test_builds_the_bandit_from_its_config() -> None:
    policy = build_daemon_policy(parse_policy_spec("bandit:algo=thompson,seed=1,window_s=60"))
    assert isinstance(policy, BanditPolicy)
    assert policy.config == BanditConfig(algo="thompson", seed=1, window_s=60.0)
    assert isinstance(policy, DaemonPolicy)
    assert parse_policy_spec(policy.name) == parse_policy_spec(
        "bandit:window_s=60,seed=1,algo=thompson"
    )


def test_goodput_builds_through_its_module() -> None:
    goodput = pytest.importorskip("specgov.policies.daemon.goodput")
    policy = build_daemon_policy(parse_policy_spec("goodput:slo_tpot_ms=40"), prior=None)
    assert isinstance(policy, goodput.GoodputPolicy)
    assert policy.config == goodput.GoodputConfig(slo_tpot_ms=40.0)
    assert isinstance(policy, DaemonPolicy)
    estimators = pytest.importorskip("specgov.policies.daemon.estimators.step_cost")
    prior = estimators.default_step_cost_prior()
    assert isinstance(build_daemon_policy("goodput", prior=prior), goodput.GoodputPolicy)
    # The prior is for goodput; the others accept and ignore it.
    assert isinstance(build_daemon_policy("static:1", prior=prior), StaticPolicy)


def test_every_built_policy_names_an_equivalent_spec() -> None:
    for text in ("none", "static:2", "batch-table:1=3,32=0", "bandit:explore=0.3", "goodput"):
        if text == "goodput" and not HAVE_GOODPUT:
            continue
        policy = build_daemon_policy(text)
        assert policy is not None
        rebuilt = build_daemon_policy(policy.name)
        assert rebuilt is not None and rebuilt.name == policy.name


def test_direct_construction_validates_and_normalises() -> None:
    spec = PolicySpec("bandit", {"window_s": 60, "seed": 2})
    assert spec.params["window_s"] == 60.0 and isinstance(spec.params["window_s"], float)
    assert spec.text == "bandit:seed=2,window_s=60"
    assert spec == parse_policy_spec("bandit:window_s=60.0,seed=2")
    with pytest.raises(PolicySpecError, match=r"expected an int, got True"):
        PolicySpec("static", {"steps": True})
    with pytest.raises(PolicySpecError, match=r"unknown policy kind 'fast'"):
        PolicySpec("fast")
    with pytest.raises(TypeError):
        spec.params["seed"] = 3  # type: ignore[index]
    with pytest.raises(PolicySpecError, match=r"a PolicySpec or a spec string"):
        build_daemon_policy(3)  # type: ignore[arg-type]


def test_specs_pickle_and_copy() -> None:
    spec = parse_policy_spec(" bandit:seed=3,algo=thompson ")
    for clone in (pickle.loads(pickle.dumps(spec)), copy.deepcopy(spec)):
        assert clone == spec
        assert clone.text == spec.text
        assert dict(clone.params) == {"seed": 3, "algo": "thompson"}


# ------------------------------------------------------------------- properties

_bandit_params = st.fixed_dictionaries(
    {},
    optional={
        "algo": st.sampled_from(["ucb", "thompson", "thompson-beta"]),
        "seed": st.integers(min_value=0, max_value=2**63),
        "window_s": st.floats(min_value=1e-3, max_value=1e6),
        "explore": st.one_of(st.none(), st.floats(min_value=0.0, max_value=10.0)),
        "switch_margin": st.floats(min_value=0.0, max_value=1.0),
        "full_weight_calls": st.integers(min_value=1, max_value=10_000),
        "reward": st.sampled_from(["goodput", "per-request"]),
    },
)
_ttl = st.just({})  # no kind takes a TTL any more


@st.composite
def _schedule(draw: st.DrawFn) -> dict[str, Any]:
    sizes = draw(st.lists(st.integers(min_value=2, max_value=4096), max_size=6, unique=True))
    keys = [1, *sorted(sizes)]
    params: dict[str, Any] = {str(n): draw(st.integers(min_value=0, max_value=16)) for n in keys}
    params.update(draw(_ttl))
    return params


specs = st.one_of(
    st.builds(PolicySpec, st.just("none"), _ttl),
    st.builds(
        PolicySpec,
        st.just("static"),
        st.builds(lambda k, ttl: {"steps": k, **ttl}, st.integers(0, 64), _ttl),
    ),
    st.just(PolicySpec("sglang-ema")),
    st.builds(PolicySpec, st.just("batch-table"), _schedule()),
    st.builds(PolicySpec, st.just("bandit"), _bandit_params),
)


@settings(max_examples=300, deadline=None)
@given(specs)
def test_format_parse_round_trip(spec: PolicySpec) -> None:
    text = format_policy_spec(spec)
    again = parse_policy_spec(text)
    assert again == spec
    assert format_policy_spec(again) == text
    assert dict(again.params) == dict(spec.params)


_alphabet = st.sampled_from(list("abcdeghilmnoprstuwy019-_:=,. ") + ["\x00", "é", "٣", "²"])
_pieces = st.sampled_from(
    [*KNOWN_KINDS, "static:", "batch-table:", "bandit:", "goodput:", "ttl_s=", "seed=",
     "algo=", "window_s=", "explore=", "slo_tpot_ms=", "1=", "8=", ",", ":", "=", "none",
     "thompson", "-1", "0", "3", "1e9", "nan", "inf", "1e999", "true", " "]
)  # fmt: skip


@settings(max_examples=400, deadline=None)
@given(
    st.one_of(
        st.text(max_size=60),
        st.text(_alphabet, max_size=40),
        st.lists(_pieces, max_size=12).map("".join),
    )
)
def test_any_string_parses_or_raises_policy_spec_error(text: str) -> None:
    try:
        spec = parse_policy_spec(text)
    except PolicySpecError as exc:
        assert str(exc)
        return
    # What parses is canonical-stable and builds.
    assert parse_policy_spec(format_policy_spec(spec)) == spec
    build_daemon_policy(spec)


# ------------------------------------------------------------- static:K, read once


@pytest.mark.parametrize(
    ("text", "steps"),
    [("static:3", 3), (" static:0 ", 0), ("static:steps=5", 5), ("none", None),
     ("goodput", None), ("oracle", None), ("oracle:informed", None), ("batch-table:1=3", None)],
)  # fmt: skip
def test_static_steps_reads_k_or_says_not_static(text: str, steps: int | None) -> None:
    assert static_steps(text) == steps
    if steps is not None:
        assert static_steps(parse_policy_spec(text)) == steps


@pytest.mark.parametrize("text", ["static:x", "static:-1", "static:", "static", "static:3,k=1"])
def test_static_k_has_one_parser_and_one_message_everywhere(text: str, tmp_path: Any) -> None:
    """The spec parser, replay's policy names and the replay report reader of
    ``specgov sglang-args --from-replay`` refuse a bad static:K with the same words."""
    import json

    from specgov.controller.daemon.recommend_replay import recommend_from_replay
    from specgov.simulator.replay.runner import parse_policy

    with pytest.raises(PolicySpecError) as spec_err:
        parse_policy_spec(text)
    words = str(spec_err.value)
    with pytest.raises(PolicySpecError) as err:
        static_steps(text)
    assert str(err.value) == words
    with pytest.raises(ValueError) as replay_err:
        parse_policy(text)
    assert words in str(replay_err.value)
    report = {"policies": [{"name": text, "goodput_tok_s": 1.0, "steps_per_slot": {}}]}
    with pytest.raises(ValueError) as report_err:
        recommend_from_replay(json.loads(json.dumps(report)))
    assert words in str(report_err.value) and "policies[0].name" in str(report_err.value)
