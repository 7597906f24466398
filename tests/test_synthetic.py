"""Synthetic traces: determinism, arrival statistics, load shapes, phases, lengths, CLI text."""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path

import numpy as np
import pytest
from numpy.typing import NDArray
from trace_jsonl import write_trace_jsonl

from specgov.simulator.workload.synthetic import (
    DEFAULT_DEMO_SPEC,
    DomainLengths,
    Phase,
    SyntheticSpec,
    SyntheticSpecError,
    expected_rate_rps,
    format_synthetic_spec,
    generate_trace,
)
from specgov.simulator.workload.synthetic_text import parse_synthetic_spec
from specgov.simulator.workload.trace_files import load_trace
from specgov.simulator.workload.traces import Trace


def _arrivals(trace: Trace) -> NDArray[np.float64]:
    return np.array([r.arrival_s for r in trace.requests])


def _expected_counts(spec: SyntheticSpec, edges: NDArray[np.float64]) -> NDArray[np.float64]:
    """Integral of the requested rate over each bin (fine trapezoid, independent grid)."""
    out = []
    for lo, hi in itertools.pairwise(edges):
        t = np.linspace(lo, hi, 2001)
        r = expected_rate_rps(spec, t)
        out.append(float(np.sum((r[1:] + r[:-1]) / 2 * np.diff(t))))
    return np.array(out)


def _assert_counts_follow_rate(spec: SyntheticSpec, trace: Trace, bins: int) -> None:
    edges = np.linspace(0.0, spec.duration_s, bins + 1)
    observed, _ = np.histogram(_arrivals(trace), bins=edges)
    expected = _expected_counts(spec, edges)
    # Poisson counts: within 5 standard deviations per bin.
    assert np.all(np.abs(observed - expected) <= 5 * np.sqrt(expected) + 3), (observed, expected)


# ----------------------------------------------------------------------------- determinism


def test_same_seed_same_trace_different_seed_different() -> None:
    spec = SyntheticSpec(duration_s=120.0, rate_rps=5.0, arrival="gamma", seed=7)
    a, b = generate_trace(spec), generate_trace(spec)
    assert a == b
    c = generate_trace(dataclasses.replace(spec, seed=8))
    assert c.requests != a.requests
    assert a.requests[0].arrival_s == 0.0
    assert all(r.domain is not None for r in a.requests)
    assert a.name.startswith("synthetic:")


# ------------------------------------------------------------------------------- arrivals


def test_poisson_mean_rate_and_exponential_gaps() -> None:
    spec = SyntheticSpec(duration_s=20000.0, rate_rps=2.0, seed=1)
    t = _arrivals(generate_trace(spec))
    assert len(t) == pytest.approx(40000, rel=0.03)  # sd is 0.5%
    gaps = np.diff(t)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.05)
    _assert_counts_follow_rate(spec, generate_trace(spec), bins=20)


@pytest.mark.parametrize("cv", [0.5, 2.0, 3.0])
def test_gamma_gaps_have_requested_cv(cv: float) -> None:
    spec = SyntheticSpec(duration_s=10000.0, rate_rps=3.0, arrival="gamma", burstiness_cv=cv)
    gaps = np.diff(_arrivals(generate_trace(spec)))
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.1)
    assert 1 / gaps.mean() == pytest.approx(3.0, rel=0.1)


def test_onoff_has_silent_gaps_and_keeps_mean_rate() -> None:
    spec = SyntheticSpec(duration_s=3000.0, rate_rps=3.0, arrival="onoff", on_s=10.0, off_s=20.0)
    t = _arrivals(generate_trace(spec))
    phase = np.mod(t, 30.0)
    # Nothing inside an off period (beyond the 5 ms resolution of the rate grid).
    assert not np.any((phase > 10.0 + 0.01) & (phase < 30.0 - 0.01))
    assert len(t) / spec.duration_s == pytest.approx(3.0, rel=0.05)
    on_rate = len(t) / (spec.duration_s / 3.0)
    assert on_rate == pytest.approx(9.0, rel=0.05)
    # The largest gaps are the 20 s off periods.
    assert np.diff(t).max() >= 20.0


def test_diurnal_shape_visible_in_binned_counts() -> None:
    spec = SyntheticSpec(duration_s=4000.0, rate_rps=5.0, diurnal_amplitude=0.8)
    trace = generate_trace(spec)
    t = _arrivals(trace)
    first, second = np.sum(t < 2000.0), np.sum(t >= 2000.0)
    # One period over the trace: sin > 0 in the first half. Expected ratio (1+2A/pi)/(1-2A/pi).
    ratio = (1 + 1.6 / np.pi) / (1 - 1.6 / np.pi)
    assert first / second == pytest.approx(ratio, rel=0.1)
    _assert_counts_follow_rate(spec, trace, bins=16)


def test_ramp_shape_visible_in_binned_counts() -> None:
    spec = SyntheticSpec(
        duration_s=2000.0, rate_rps=2.0, ramp=((0.0, 1.0), (1000.0, 6.0), (2000.0, 1.0))
    )
    trace = generate_trace(spec)
    t = _arrivals(trace)
    peak = np.sum((t >= 900) & (t < 1100)) / 200.0
    base = np.sum(t < 200) / 200.0
    assert peak / base == pytest.approx(5.75 / 1.5, rel=0.15)
    _assert_counts_follow_rate(spec, trace, bins=20)


def test_gamma_follows_ramp() -> None:
    spec = SyntheticSpec(
        duration_s=2000.0,
        rate_rps=3.0,
        arrival="gamma",
        burstiness_cv=1.5,
        ramp=((0.0, 0.5), (1000.0, 4.0), (2000.0, 0.5)),
    )
    t = _arrivals(generate_trace(spec))
    expected = _expected_counts(spec, np.array([0.0, 500.0, 1000.0, 1500.0, 2000.0]))
    observed, _ = np.histogram(t, bins=[0.0, 500.0, 1000.0, 1500.0, 2000.0])
    assert observed == pytest.approx(expected, rel=0.15)


# -------------------------------------------------------------------------------- content


def test_default_phases_label_requests_by_time() -> None:
    trace = generate_trace(SyntheticSpec(duration_s=600.0, rate_rps=5.0))
    for r in trace.requests:
        want = "code" if r.arrival_s < 200 else "chat" if r.arrival_s < 400 else "rag"
        assert r.domain == want, r
    assert set(trace.summary()["domains"]) == {"code", "chat", "rag"}


def test_phase_mix_weights_and_cycling() -> None:
    spec = SyntheticSpec(
        duration_s=4000.0,
        rate_rps=5.0,
        phases=(Phase(100.0, {"chat": 3.0, "rag": 1.0}), Phase(100.0, {"code": 1.0})),
    )
    trace = generate_trace(spec)
    first = [r.domain for r in trace.requests if (r.arrival_s % 200.0) < 100.0]
    second = [r.domain for r in trace.requests if (r.arrival_s % 200.0) >= 100.0]
    assert set(second) == {"code"}
    assert first.count("chat") / len(first) == pytest.approx(0.75, abs=0.03)
    assert set(first) == {"chat", "rag"}


# -------------------------------------------------------------------------------- lengths


def test_length_means_and_clipping() -> None:
    trace = generate_trace(SyntheticSpec(duration_s=5000.0, rate_rps=4.0, seed=5))
    inputs = np.array([r.input_tokens for r in trace.requests])
    outputs = np.array([r.output_tokens for r in trace.requests])
    assert inputs.mean() == pytest.approx(1024, rel=0.05)
    assert outputs.mean() == pytest.approx(256, rel=0.05)
    # sigma is the log-space spread.
    assert np.log(outputs).std() == pytest.approx(0.8, rel=0.05)

    clipped = generate_trace(
        SyntheticSpec(duration_s=500.0, mean_output_tokens=200.0, max_output_tokens=210)
    )
    outs = [r.output_tokens for r in clipped.requests]
    assert max(outs) == 210
    assert min(outs) >= 1


def test_per_domain_length_overrides() -> None:
    spec = SyntheticSpec(
        duration_s=3000.0,
        rate_rps=6.0,
        domain_lengths={
            "code": DomainLengths(mean_output_tokens=64.0, output_sigma=0.3),
            "rag": DomainLengths(mean_input_tokens=4096.0),
        },
    )
    trace = generate_trace(spec)

    def mean(domain: str, attr: str) -> float:
        return float(np.mean([getattr(r, attr) for r in trace.requests if r.domain == domain]))

    assert mean("code", "output_tokens") == pytest.approx(64, rel=0.05)
    assert mean("rag", "input_tokens") == pytest.approx(4096, rel=0.07)
    assert mean("chat", "input_tokens") == pytest.approx(1024, rel=0.07)
    assert mean("chat", "output_tokens") == pytest.approx(256, rel=0.07)


# ------------------------------------------------------------------------------ validation


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"duration_s": 0.0}, "duration_s"),
        ({"rate_rps": -1.0}, "rate_rps"),
        ({"arrival": "weibull"}, "arrival"),
        ({"burstiness_cv": 0.0}, "burstiness_cv"),
        ({"diurnal_amplitude": 1.5}, "diurnal_amplitude"),
        ({"diurnal_period_s": 0.0}, "diurnal_period_s"),
        ({"ramp": ()}, "ramp"),
        ({"ramp": ((0.0, 1.0), (0.0, 2.0))}, "ramp[1]"),
        ({"ramp": ((0.0, 0.0),)}, "ramp"),
        ({"ramp": ((700.0, 1.0),)}, "ramp[0]"),
        ({"mean_input_tokens": 0.5}, "mean_input_tokens"),
        ({"max_output_tokens": 100}, "mean_output_tokens"),
        ({"output_sigma": -0.1}, "output_sigma"),
        ({"phases": (Phase(400.0, {"code": 1}), Phase(400.0, {"rag": 1}))}, "phases"),
        ({"domain_lengths": {"nope": DomainLengths(mean_input_tokens=5.0)}}, "domain_lengths"),
        ({"seed": -3}, "seed"),
        ({"seed": 1.5}, "seed"),
    ],
)
def test_spec_validation_names_the_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(SyntheticSpecError) as err:
        SyntheticSpec(**kwargs)  # type: ignore[arg-type]
    assert err.value.field.startswith(field)
    assert field.split("[")[0] in str(err.value)


def test_phase_and_domain_lengths_validation() -> None:
    with pytest.raises(SyntheticSpecError, match=r"Phase\.duration_s"):
        Phase(0.0, {"code": 1.0})
    with pytest.raises(SyntheticSpecError, match="positive sum"):
        Phase(10.0, {"code": 0.0})
    with pytest.raises(SyntheticSpecError, match="domain label"):
        Phase(10.0, {"co de": 1.0})
    with pytest.raises(SyntheticSpecError, match=r"DomainLengths\.output_sigma"):
        DomainLengths(output_sigma=-1.0)


def test_spec_is_immune_to_caller_mutation() -> None:
    weights = {"code": 1.0}
    phase = Phase(10.0, weights)
    weights["rag"] = 5.0
    assert dict(phase.domains) == {"code": 1.0}


# ------------------------------------------------------------------------------ CLI syntax


def test_parse_brief_example() -> None:
    spec = parse_synthetic_spec(
        "synthetic:duration=600,rate=8,arrival=gamma,cv=2,seed=3,phases=code@200+chat@200+rag@200"
    )
    assert spec == SyntheticSpec(
        duration_s=600.0,
        rate_rps=8.0,
        arrival="gamma",
        burstiness_cv=2.0,
        seed=3,
        phases=(Phase(200, {"code": 1}), Phase(200, {"chat": 1}), Phase(200, {"rag": 1})),
    )


def test_parse_defaults_demo_and_all_keys() -> None:
    assert parse_synthetic_spec("synthetic") == SyntheticSpec()
    assert parse_synthetic_spec("  synthetic  ") == SyntheticSpec()
    assert parse_synthetic_spec("synthetic:demo") == DEFAULT_DEMO_SPEC
    assert parse_synthetic_spec("synthetic:demo,seed=4") == dataclasses.replace(
        DEFAULT_DEMO_SPEC, seed=4
    )
    spec = parse_synthetic_spec(
        "synthetic:duration=900,rate=2.5,arrival=onoff,on=5,off=15,diurnal=0.3,period=300,"
        "ramp=0:1+450:3+900:1,in=512,in_sigma=0.5,max_in=8192,out=128,out_sigma=0.4,"
        "max_out=1024,phases=code:3|chat@450+rag@450,rag.in=2048,code.out_sigma=0.2,seed=9"
    )
    assert spec.on_s == 5.0 and spec.off_s == 15.0 and spec.diurnal_period_s == 300.0
    assert spec.ramp == ((0.0, 1.0), (450.0, 3.0), (900.0, 1.0))
    assert spec.max_input_tokens == 8192 and spec.max_output_tokens == 1024
    assert spec.phases is not None and dict(spec.phases[0].domains) == {"code": 3.0, "chat": 1.0}
    assert spec.domain_lengths["rag"] == DomainLengths(mean_input_tokens=2048.0)
    assert spec.domain_lengths["code"] == DomainLengths(output_sigma=0.2)
    # Formatting and re-parsing gives the same spec.
    assert parse_synthetic_spec("synthetic:" + format_synthetic_spec(spec)) == spec


def test_trace_name_parses_back_to_its_spec() -> None:
    for spec in (DEFAULT_DEMO_SPEC, SyntheticSpec(rate_rps=1.25, diurnal_amplitude=0.5)):
        assert parse_synthetic_spec(generate_trace(spec).name) == spec
    assert format_synthetic_spec(SyntheticSpec()) == ""


@pytest.mark.parametrize(
    ("text", "key", "fragment"),
    [
        ("synthetic:foo=1", "foo", "valid keys: duration, rate, arrival"),
        ("synthetic:rate=fast", "rate", "expected requests per second > 0"),
        ("synthetic:rate=-2", "rate", "rate_rps must be > 0"),
        ("synthetic:seed=1.5", "seed", "expected an integer >= 0"),
        ("synthetic:arrival=weibull", "arrival", "one of poisson, gamma, onoff"),
        ("synthetic:ramp=0-1", "ramp", "TIME:MULT points joined by '+'"),
        ("synthetic:phases=code200", "phases", "MIX@SECONDS"),
        ("synthetic:phases=code@0", "phases", "Phase.duration_s must be > 0"),
        ("synthetic:phases=code@700", "phases", "phases last 700 s"),
        ("synthetic:rag.in=0", "rag.in", "must be >= 1"),
        ("synthetic:rag.size=3", "rag.size", "unknown key"),
        ("synthetic:cod.out=3", "cod.out", "no phase uses"),
        ("synthetic:rate=1,rate=2", "rate", "given twice"),
        ("synthetic:rate", "spec", "is not KEY=VALUE"),
        ("synthetic:", "spec", "expected 'synthetic'"),
        ("synth:rate=1", "spec", "expected 'synthetic'"),
    ],
)
def test_parse_errors_name_key_and_form(text: str, key: str, fragment: str) -> None:
    with pytest.raises(SyntheticSpecError) as err:
        parse_synthetic_spec(text)
    assert err.value.field == key
    assert fragment in str(err.value)


# ----------------------------------------------------------------------------------- demo


def test_default_demo_spec_shape() -> None:
    trace = generate_trace(DEFAULT_DEMO_SPEC)
    summary = trace.summary()
    assert 590 <= summary["duration_s"] <= 600
    assert summary["mean_output_tokens"] == pytest.approx(256, rel=0.15)
    peak = float(np.max(expected_rate_rps(DEFAULT_DEMO_SPEC, np.linspace(0, 600, 601))))
    base = float(expected_rate_rps(DEFAULT_DEMO_SPEC, [0.0])[0])
    assert 10 <= peak <= 30  # req/s that pushes an H100 + Llama-3.1-8B past batch ~64
    assert base <= peak / 4
    t = _arrivals(trace)
    counts, _ = np.histogram(t, bins=6, range=(0, 600))
    assert counts[2:4].min() > 3 * max(counts[0], counts[5])  # ramps up and back down
    labels = [r.domain for r in trace.requests]
    assert labels[0] == "code" and labels[-1] == "rag"
    assert [labels[i] for i in np.searchsorted(t, [100, 300, 500])] == ["code", "chat", "rag"]


def test_synthetic_trace_saves_and_reloads(tmp_path: Path) -> None:
    trace = generate_trace(SyntheticSpec(duration_s=60.0, rate_rps=3.0, seed=2))
    write_trace_jsonl(trace, tmp_path / "syn.jsonl")
    assert load_trace(tmp_path / "syn.jsonl").requests == trace.requests


def test_integer_field_values_name_the_trace() -> None:
    # SyntheticSpec accepts ints; naming the trace must not assume floats.
    from specgov.simulator.workload.synthetic import SyntheticSpec, generate_trace

    trace = generate_trace(SyntheticSpec(duration_s=30, rate_rps=2, seed=1))
    assert "rate=2" in trace.name


MULTI = SyntheticSpec(
    duration_s=200.0,
    rate_rps=3.0,
    turns=4,
    think_time_s=10.0,
    mean_turn_input_tokens=300.0,
    mean_input_tokens=1200.0,
    max_input_tokens=20000,
    seed=7,
)


def _conversations(trace: Trace) -> list[list[int]]:
    """Requests grouped by conversation: a turn's ids start with its first block's id."""
    groups: dict[int, list[int]] = {}
    for i, r in enumerate(trace.requests):
        assert r.hash_ids is not None
        groups.setdefault(r.hash_ids[0], []).append(i)
    return list(groups.values())


def test_multi_turn_prompts_grow_by_the_answer_and_share_block_ids() -> None:
    trace = generate_trace(MULTI)
    reqs = trace.requests
    convs = _conversations(trace)
    assert len(convs) < len(reqs) and max(len(c) for c in convs) == 4
    shared_blocks = 0
    for conv in convs:
        for prev_i, cur_i in itertools.pairwise(conv):
            prev, cur = reqs[prev_i], reqs[cur_i]
            assert prev.hash_ids is not None and cur.hash_ids is not None
            assert cur.domain == prev.domain
            assert cur.arrival_s > prev.arrival_s
            history = prev.input_tokens + prev.output_tokens
            assert cur.input_tokens > history  # + new user text
            # Every block wholly inside the previous prompt + answer keeps its id (as far
            # as the previous prompt had ids for it); the rest are new.
            keep = min(history // 512, prev.input_tokens // 512)
            assert cur.hash_ids[:keep] == prev.hash_ids[:keep]
            assert not set(cur.hash_ids[keep:]) & set(prev.hash_ids)
            shared_blocks += keep
        for i in conv:
            ids = reqs[i].hash_ids
            assert ids is not None and len(ids) == -(-reqs[i].input_tokens // 512)
    assert shared_blocks > 0
    # Different conversations share no block.
    firsts = [set(reqs[c[0]].hash_ids or ()) for c in convs]
    assert sum(len(s) for s in firsts) == len(set().union(*firsts))
    assert generate_trace(MULTI) == trace  # seeded
    assert generate_trace(dataclasses.replace(MULTI, seed=8)) != trace


def test_multi_turn_keeps_the_request_rate_and_the_limits() -> None:
    trace = generate_trace(dataclasses.replace(MULTI, duration_s=600.0, think_time_s=2.0))
    # Conversations start at rate / turns; nearly all of their turns fit in 600 s.
    assert 0.8 * 3.0 * 600 < len(trace.requests) < 1.15 * 3.0 * 600
    assert all(r.arrival_s < 600.0 for r in trace.requests)
    capped = generate_trace(dataclasses.replace(MULTI, max_input_tokens=2500, turns=20))
    assert max(r.input_tokens for r in capped.requests) <= 2500


def test_one_turn_is_the_trace_without_conversations() -> None:
    plain = generate_trace(SyntheticSpec(duration_s=60.0, seed=3))
    assert all(r.hash_ids is None for r in plain.requests)
    same = generate_trace(SyntheticSpec(duration_s=60.0, seed=3, think_time_s=5.0))
    assert same.requests == plain.requests


def test_multi_turn_keys_parse_format_and_validate() -> None:
    spec = parse_synthetic_spec("synthetic:turns=6,think=12.5,turn_in=64,seed=2")
    assert (spec.turns, spec.think_time_s, spec.mean_turn_input_tokens) == (6, 12.5, 64.0)
    assert parse_synthetic_spec("synthetic:" + format_synthetic_spec(spec)) == spec
    for text, key in (
        ("synthetic:turns=0", "turns"),
        ("synthetic:turns=1.5", "turns"),
        ("synthetic:turns=1001", "turns"),
        ("synthetic:think=-1", "think"),
        ("synthetic:turn_in=0", "turn_in"),
        ("synthetic:turn_in=99999", "turn_in"),
    ):
        with pytest.raises(SyntheticSpecError) as err:
            parse_synthetic_spec(text)
        assert err.value.field == key, text
