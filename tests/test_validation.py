"""The shared value checks: bools are never ints, non-finite numbers are never reals."""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from specgov.policies.common.validation import (
    all_real,
    check_bool,
    check_int,
    check_opt_int,
    check_opt_real,
    check_real,
    is_int,
    is_real,
)


class _Err(ValueError):
    """Stands in for a module's own typed error."""


_NON_FINITE = [math.nan, math.inf, -math.inf, 10**400]
_NOT_NUMBERS = [None, "1", b"1", [1], (1,), {"a": 1}, 1j, object()]


@given(st.booleans())
def test_bools_are_never_ints_or_reals(value: bool) -> None:
    assert not is_int(value)
    assert not is_real(value)
    with pytest.raises(_Err, match=r"^k: expected an int, got (True|False)$"):
        check_int("k", value, error=_Err)
    with pytest.raises(_Err, match=r"^k: expected a finite number, got (True|False)$"):
        check_real("k", value, error=_Err)


@given(st.integers())
def test_every_int_is_an_int(value: int) -> None:
    assert is_int(value)
    assert check_int("k", value, error=_Err) == value


@given(st.floats() | st.integers() | st.integers(2**1023, 2**1025).map(lambda i: i * (-1) ** i))
def test_is_real_means_float_of_it_is_finite(value: float) -> None:
    try:
        finite = math.isfinite(float(value))
    except OverflowError:  # an int beyond float range
        finite = False
    assert is_real(value) == finite
    if is_real(value):
        assert math.isfinite(float(value))
        assert check_real("k", value, error=_Err) == float(value)


@given(st.floats(allow_nan=False, allow_infinity=False))
def test_floats_are_never_ints(value: float) -> None:
    assert not is_int(value)


@pytest.mark.parametrize("value", _NON_FINITE, ids=repr)
def test_non_finite_is_refused_with_the_key_and_value(value: object) -> None:
    assert not is_real(value)
    with pytest.raises(_Err, match=r"^a\.b: expected a finite number >= 0, got "):
        check_real("a.b", value, error=_Err, minimum=0.0)
    # NaN compares false with every bound: the check must not rely on the comparison.
    with pytest.raises(_Err):
        check_opt_real("a.b", value, error=_Err, maximum=1.0)


@pytest.mark.parametrize("value", _NOT_NUMBERS, ids=repr)
def test_non_numbers_are_neither(value: object) -> None:
    assert not is_int(value)
    assert not is_real(value)


@given(st.integers(), st.integers(-5, 5), st.integers(-5, 5))
def test_check_int_bounds(value: int, lo: int, hi: int) -> None:
    inside = value >= lo and value <= hi
    if inside:
        assert check_int("n", value, error=_Err, minimum=lo, maximum=hi) == value
    else:
        with pytest.raises(_Err, match=rf"^n: expected an int in \[{lo}, {hi}\], got "):
            check_int("n", value, error=_Err, minimum=lo, maximum=hi)


@pytest.mark.parametrize(
    ("kwargs", "bad", "message"),
    [
        ({"minimum": 1}, 0, "n: expected an int >= 1, got 0"),
        ({"maximum": 3}, 4, "n: expected an int <= 3, got 4"),
        ({"minimum": 1, "form": "a count >= 1"}, 0, "n: expected a count >= 1, got 0"),
        ({}, 1.0, "n: expected an int, got 1.0"),
    ],
)
def test_check_int_messages(kwargs: dict[str, int | str], bad: object, message: str) -> None:
    with pytest.raises(_Err) as caught:
        check_int("n", bad, error=_Err, **kwargs)  # type: ignore[arg-type]
    assert str(caught.value) == message


@pytest.mark.parametrize(
    ("kwargs", "bad", "message"),
    [
        ({"positive": True}, 0, "x: expected a finite number > 0, got 0"),
        ({"positive": True, "maximum": 1.0}, 1.5, "x: expected a finite number in (0, 1], got 1.5"),
        ({"minimum": 0.0}, -0.5, "x: expected a finite number >= 0, got -0.5"),
        ({"minimum": 0.0, "maximum": 1.0}, 2, "x: expected a finite number in [0, 1], got 2"),
        ({"maximum": 0.5}, math.nan, "x: expected a finite number <= 0.5, got nan"),
        ({"form": "a weight"}, "w", "x: expected a weight, got 'w'"),
    ],
)
def test_check_real_messages(kwargs: dict[str, object], bad: object, message: str) -> None:
    with pytest.raises(_Err) as caught:
        check_real("x", bad, error=_Err, **kwargs)  # type: ignore[arg-type]
    assert str(caught.value) == message


def test_check_real_returns_a_float() -> None:
    out = check_real("x", 3, error=_Err, positive=True)
    assert out == 3.0 and type(out) is float


def test_optional_checks_pass_none_and_check_the_rest() -> None:
    assert check_opt_int("n", None, error=_Err, minimum=1) is None
    assert check_opt_real("x", None, error=_Err, positive=True) is None
    assert check_opt_int("n", 2, error=_Err, minimum=1) == 2
    with pytest.raises(_Err, match=r"^n: expected an int >= 1, got 0$"):
        check_opt_int("n", 0, error=_Err, minimum=1)
    with pytest.raises(_Err, match=r"^x: expected a finite number > 0, got -1$"):
        check_opt_real("x", -1, error=_Err, positive=True)


def test_check_bool_refuses_ints_and_strings() -> None:
    assert check_bool("b", False, error=_Err) is False
    for bad in (0, 1, "true", None):
        with pytest.raises(_Err, match=r"^b: expected a bool, got "):
            check_bool("b", bad, error=_Err)
    with pytest.raises(_Err, match=r"^disable: expected true or false, got 1$"):
        check_bool("disable", 1, error=_Err, form="true or false")


def test_error_factory_may_be_a_function() -> None:
    # An error that takes more than the message (like SyntheticSpecError) gets a lambda.
    class _Two(ValueError):
        def __init__(self, key: str, message: str) -> None:
            super().__init__(message)
            self.key = key

    with pytest.raises(_Two) as caught:
        check_int("k", "x", error=lambda m: _Two("k", m))
    assert caught.value.key == "k"


# ------------------------------------------------------------------- the modules using them

_BAD_REALS = [math.nan, math.inf, -math.inf, 10**400, True]


def _callers() -> list[tuple[str, Callable[[object], object], type[Exception], str]]:
    # Imported here: the helpers above are tested without the rest of specgov.
    from specgov.adapters.sglang_http import SGLangClient
    from specgov.controller.daemon.config_values import ConfigError, parse_duration
    from specgov.policies.common.roofline import RooflineCoefficients, RooflineError
    from specgov.policies.common.types import PolicyTypeError
    from specgov.policies.daemon.bandit import BanditConfig
    from specgov.policies.daemon.goodput import GoodputConfig, GoodputConfigError
    from specgov.policies.engine.adaptive_config import AdaptiveConfigError, parse_adaptive_config
    from specgov.policies.guardrails import GuardrailConfig, GuardrailError
    from specgov.simulator.planning.search import SearchError, SearchSettings
    from specgov.simulator.workload.traces import Request, TraceError

    steps = {"1": {"candidate_steps": [0, 1]}}
    return [
        (
            "bandit",
            lambda v: BanditConfig(window_s=v),  # type: ignore[arg-type]
            PolicyTypeError,
            "BanditConfig.window_s: expected a finite number > 0, got ",
        ),
        (
            "guardrails",
            lambda v: GuardrailConfig.from_dict({"min_dwell_s": v}),
            GuardrailError,
            "guardrails.min_dwell_s: expected a finite number >= 0, got ",
        ),
        (
            "goodput",
            lambda v: GoodputConfig(explore=v),  # type: ignore[arg-type]
            GoodputConfigError,
            "goodput: parameter 'explore': expected a number in [0, 1], got ",
        ),
        (
            "adaptive_config",
            lambda v: parse_adaptive_config({"ema_alpha": v, **steps}),
            AdaptiveConfigError,
            "<default>: key 'ema_alpha': expected a number in [0, 1], got ",
        ),
        (
            "controller.config",
            lambda v: parse_duration(v, where="loop.interval_s"),
            ConfigError,
            "loop.interval_s: expected a duration like",
        ),
        (
            "traces",
            lambda v: Request(arrival_s=v, input_tokens=1, output_tokens=1),  # type: ignore[arg-type]
            TraceError,
            "Request.arrival_s must be finite and >= 0, got ",
        ),
        # These three let NaN and True through (and inf, which is no backoff or bound)
        # before their checks went through is_real.
        (
            "sglang_http.backoff_base_s",
            lambda v: SGLangClient("http://x", rng=random.Random(0), backoff_base_s=v),  # type: ignore[arg-type]
            ValueError,
            "SGLangClient: backoff_base_s must be a number >= 0, got ",
        ),
        (
            "sglang_http.backoff_max_s",
            lambda v: SGLangClient("http://x", rng=random.Random(0), backoff_max_s=v),  # type: ignore[arg-type]
            ValueError,
            "SGLangClient: backoff_max_s must be a number >= backoff_base_s",
        ),
        (
            "roofline",
            lambda v: RooflineCoefficients(v, 1e-3, 1e-6, 1e-7),  # type: ignore[arg-type]
            RooflineError,
            "cost coefficient fixed_overhead_s must be ",
        ),
        (
            "plan.search",
            lambda v: SearchSettings(start=v),  # type: ignore[arg-type]
            SearchError,
            "search start must be a positive number, got ",
        ),
    ]


@pytest.mark.parametrize("value", _BAD_REALS, ids=["nan", "inf", "-inf", "10**400", "True"])
@pytest.mark.parametrize("caller", range(len(_callers())), ids=[c[0] for c in _callers()])
def test_callers_refuse_non_finite_with_their_own_error_and_message(
    caller: int, value: object
) -> None:
    # An int beyond float range used to escape as OverflowError from math.isfinite/float.
    _, build, error, message = _callers()[caller]
    with pytest.raises(error) as caught:
        build(value)
    assert str(caught.value).startswith(message), str(caught.value)


def test_spool_reader_rejects_a_timestamp_beyond_float_range(tmp_path: Path) -> None:
    # A JSON integer of 400 digits is a well-formed but invalid document; it used to
    # escape parse_step_table_document as an OverflowError (counted as internal_error).
    from specgov.adapters.spool_table import SpoolTableReader, write_step_table
    from specgov.policies.common.step_table import StepTable

    steps = [0, 1, 3, 5]
    table = StepTable(((1, 5), (8, 3)), version=1, produced_at_s=10.0, ttl_s=30.0)
    path = write_step_table(tmp_path, table, steps, written_at_s=10.0)
    document = json.loads(path.read_bytes())
    document["written_at_s"] = 10**400
    path.write_text(json.dumps(document))
    reader = SpoolTableReader(tmp_path, steps, lambda: 10.0)
    assert reader() is None
    assert reader.ignored == {"invalid": 1}


@pytest.mark.parametrize(
    ("values", "minimum", "ok"),
    [
        ((), None, True),
        ((0.5, 2.0), None, True),
        ((0.5, math.nan), None, False),
        ((math.inf, 1.0), None, False),
        ((1e308, 1e308), None, True),  # finite values whose sum overflows: the exact check
        ((1e308, 1e308, -math.inf), None, False),
        ((0.0, 3.0), 0.0, True),
        ((-1e-9, 3.0), 0.0, False),
        ((1, 2.5), 0.0, True),  # an int among floats: the exact check
        ((True, 1.0), None, False),  # a bool is not a number here
        ((10**400,), None, False),  # beyond float range
        (("1.0",), None, False),
    ],
)
def test_all_real_agrees_with_is_real_per_value(
    values: tuple[object, ...], minimum: float | None, ok: bool
) -> None:
    assert all_real(values, minimum=minimum) is ok
    exact = all(is_real(v) and (minimum is None or v >= minimum) for v in values)
    assert exact is ok


@given(st.lists(st.floats(allow_nan=True, allow_infinity=True), max_size=8))
def test_all_real_on_any_floats_is_the_per_value_check(values: list[float]) -> None:
    assert all_real(tuple(values)) == all(math.isfinite(v) for v in values)
    assert all_real(tuple(values), minimum=0.0) == all(math.isfinite(v) and v >= 0 for v in values)


def test_is_step_list_wants_one_or_more_non_negative_ints() -> None:
    from specgov.policies.common.validation import is_step_list

    assert is_step_list([0]) and is_step_list((1, 3, 5))
    assert not is_step_list([])
    assert not is_step_list([1, -1])
    assert not is_step_list([True])  # a bool is no step
    assert not is_step_list([1.0])
