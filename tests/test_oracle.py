"""The clairvoyant oracle: honest peeks, argmax tokens/s per batch, and a real upper bound."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pytest

from specgov.simulator.engine.acceptance import AcceptanceModel
from specgov.simulator.engine.interface import EngineConfig, EngineResult
from specgov.simulator.engine.sglang_metrics import DecodeStep, SimMetrics
from specgov.simulator.replay.oracle import (
    ClairvoyantOracle,
    InformedOracle,
    OracleError,
    oracle_report,
    oracle_share,
)
from specgov.simulator.replay.runner import (
    PolicySpecError,
    ServerSpec,
    parse_policy,
    prepare_run,
    replay,
)
from specgov.simulator.workload.synthetic import generate_trace
from specgov.simulator.workload.synthetic_text import parse_synthetic_spec
from specgov.simulator.workload.traces import Request, Trace

EAGLE = "eagle3-llama3.1-8b"


# ------------------------------------------------------------------- peek


def _schedule(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(1, 7) for _ in range(n)]


@pytest.mark.parametrize(
    ("burstiness", "topk", "ndt", "acc_len"),
    [
        (0.6, 1, None, None),
        (0.0, 1, None, None),
        (0.6, 2, 8, None),
        (0.6, 1, None, [3, 1, 5, 2, 8]),  # recorded lengths first, then the profile
    ],
)
def test_peeking_does_not_alter_the_acceptance_sequence(
    burstiness: float, topk: int, ndt: int | None, acc_len: list[int] | None
) -> None:
    model = AcceptanceModel(EAGLE, seed=7, burstiness=burstiness, topk=topk, num_draft_tokens=ndt)
    plain = model.sampler(3, "code", acc_len)
    peeked = model.sampler(3, "code", acc_len)
    for k in _schedule(11, 400):
        seen = {j: peeked.peek(j) for j in range(8)}
        assert peeked.peek(k) == seen[k]  # peeking twice changes nothing
        got = peeked.draw(k)
        assert got == seen[k]  # the peek is the draw the engine then makes
        assert got == plain.draw(k)  # and the same draw an unpeeked stream makes
    assert peeked.position == plain.position


def test_unpeeked_draw0_consumes_nothing_a_peeked_one_spends_its_uniform() -> None:
    # The per-verify sampler's rule (the per-token one moves one position per draw(0)).
    model = AcceptanceModel(EAGLE, seed=1, token_model=False)
    ref = model.sampler(0, None)
    ref_draws = [ref.draw(7) for _ in range(3)]
    unpeeked = model.sampler(0, None)
    assert [unpeeked.draw(7), unpeeked.draw(0), unpeeked.draw(7)] == [ref_draws[0], 0, ref_draws[1]]
    peeked = model.sampler(0, None)
    first = peeked.draw(7)
    peeked.peek(5)  # sees ref's second uniform...
    assert peeked.draw(0) == 0  # ...which a verify without drafts spends
    assert [first, peeked.draw(7)] == [ref_draws[0], ref_draws[2]]


def test_peek_validates_steps() -> None:
    sampler = AcceptanceModel(EAGLE, seed=0).sampler(0, None)
    with pytest.raises(ValueError, match=r"steps must be in 0\.\.64"):
        sampler.peek(65)


# ---------------------------------------------------------- the choice


@dataclass
class _LinearCost:
    """Step time = base + per_step * k (batch and KV ignored): easy to check by hand."""

    base_s: float
    per_step_s: float

    def decode_step_s(self, batch_size: int, steps: int, kv_tokens: int) -> float:
        return self.base_s + self.per_step_s * steps

    def prefill_s(self, new_tokens: int, prefix_kv_tokens: int) -> float:
        return 0.0


def _peeks(accepted: Sequence[int]) -> list[Any]:
    return [lambda k, a=a: min(a, k) for a in accepted]


def _brute_force(
    steps: Sequence[int], accepted: Sequence[int], remaining: Sequence[int], cost: _LinearCost
) -> int:
    def rate(k: int) -> float:
        tokens = sum(min(min(a, k) + 1, r) for a, r in zip(accepted, remaining, strict=True))
        return tokens / cost.decode_step_s(len(accepted), k, 0)

    return max(steps, key=lambda k: (rate(k), -k))


@pytest.mark.parametrize("seed", range(20))
def test_choice_is_the_argmax_of_tokens_per_second(seed: int) -> None:
    rng = random.Random(seed)
    steps = sorted(rng.sample(range(8), rng.randint(1, 8)))
    cost = _LinearCost(base_s=rng.uniform(5e-3, 10e-3), per_step_s=rng.uniform(1e-4, 3e-3))
    oracle = ClairvoyantOracle(steps)
    oracle.bind_engine(cost, EngineConfig(kv_token_capacity=10**6))
    n = rng.randint(1, 40)
    accepted = [rng.randint(0, 7) for _ in range(n)]
    remaining = [rng.randint(1, 9) for _ in range(n)]
    oracle.observe_batch(_peeks(accepted), remaining, 0)
    assert oracle.get_steps_for_batch(n) == _brute_force(steps, accepted, remaining, cost)


def test_choice_skips_steps_that_do_not_fit_the_kv_pool_and_by_hand() -> None:
    cost = _LinearCost(base_s=10e-3, per_step_s=1e-3)
    oracle = ClairvoyantOracle([0, 1, 2, 3])
    # 4 requests, all would accept 3: k=3 gives 16 tokens in 13 ms, the best rate.
    oracle.bind_engine(cost, EngineConfig(kv_token_capacity=1000))
    oracle.observe_batch(_peeks([3, 3, 3, 3]), [100] * 4, 0)
    assert oracle.get_steps_for_batch(4) == 3
    # Only 10 KV tokens free: k=1 (8 tokens) fits, k=2 (12) does not.
    oracle.observe_batch(_peeks([3, 3, 3, 3]), [100] * 4, 990)
    assert oracle.get_steps_for_batch(4) == 1
    # Nothing fits: the smallest step (the engine then retracts and asks again).
    oracle.observe_batch(_peeks([3, 3, 3, 3]), [100] * 4, 998)
    assert oracle.get_steps_for_batch(4) == 0
    # Nobody accepts anything: drafting only costs time.
    oracle.observe_batch(_peeks([0, 0, 0, 0]), [100] * 4, 0)
    assert oracle.get_steps_for_batch(4) == 0


def test_oracle_refuses_misuse() -> None:
    with pytest.raises(OracleError, match="non-negative ints"):
        ClairvoyantOracle([])
    with pytest.raises(OracleError, match="initial_steps 9"):
        ClairvoyantOracle([0, 1], initial_steps=9)
    oracle = ClairvoyantOracle([0, 1])
    with pytest.raises(OracleError, match="before bind_engine"):
        oracle.observe_batch(_peeks([1]), [5], 0)
    oracle.bind_engine(_LinearCost(1e-2, 1e-3), EngineConfig(kv_token_capacity=100))
    oracle.observe_batch(_peeks([1, 1]), [5, 5], 0)
    with pytest.raises(OracleError, match="asked for batch 3 but shown a batch of 2"):
        oracle.get_steps_for_batch(3)


def test_parse_policy_oracle() -> None:
    policy = parse_policy(" Oracle ")
    assert policy.name == "oracle" and policy.speculative
    assert policy.candidate_steps == tuple(range(8))  # the daemon policies' step set
    assert isinstance(policy.build(3), ClairvoyantOracle)
    informed = parse_policy("oracle:Informed")
    assert informed.name == "oracle:informed" and informed.candidate_steps == tuple(range(8))
    assert isinstance(informed.build(3), InformedOracle)
    with pytest.raises(PolicySpecError, match="expected 'oracle' \\(clairvoyant\\) or"):
        parse_policy("oracle:3")


# ------------------------------------------------------- the informed choice


@dataclass
class _Rates:
    """Per-domain chain rates (the informed oracle's view of the acceptance model)."""

    by_domain: dict[str | None, tuple[float, ...]]

    def depth_rates(self, domain: str | None, steps: int) -> tuple[float, ...]:
        rates = self.by_domain[domain]
        return tuple(rates[min(i, len(rates) - 1)] for i in range(steps))


def _expected_brute_force(
    steps: Sequence[int],
    domains: Sequence[str | None],
    remaining: Sequence[int],
    rates: _Rates,
    cost: _LinearCost,
) -> int:
    def tokens(k: int) -> float:
        total = 0.0
        for d, rem in zip(domains, remaining, strict=True):
            # E[min(A + 1, rem)] by summing over the distribution of A at k drafts.
            surv = [1.0]
            for a in rates.depth_rates(d, k):
                surv.append(surv[-1] * a)
            surv.append(0.0)
            total += sum((surv[a] - surv[a + 1]) * min(a + 1, rem) for a in range(k + 1))
        return total

    return max(steps, key=lambda k: (tokens(k) / cost.decode_step_s(len(domains), k, 0), -k))


@pytest.mark.parametrize("seed", range(20))
def test_informed_choice_is_the_argmax_of_expected_tokens_per_second(seed: int) -> None:
    rng = random.Random(seed)
    steps = sorted(rng.sample(range(8), rng.randint(1, 8)))
    cost = _LinearCost(base_s=rng.uniform(5e-3, 10e-3), per_step_s=rng.uniform(1e-4, 3e-3))
    rates = _Rates(
        {d: tuple(rng.uniform(0.1, 0.95) for _ in range(rng.randint(1, 7))) for d in ("a", None)}
    )
    oracle = InformedOracle(steps)
    oracle.bind_engine(cost, EngineConfig(kv_token_capacity=10**6), rates)
    n = rng.randint(1, 40)
    domains = [rng.choice(["a", None]) for _ in range(n)]
    remaining = [rng.randint(1, 9) for _ in range(n)]
    # The draws are hidden from it: peeks that would mislead a clairvoyant change nothing.
    oracle.observe_batch(_peeks([0] * n), remaining, 0, domains)
    assert oracle.get_steps_for_batch(n) == _expected_brute_force(
        steps, domains, remaining, rates, cost
    )


def test_informed_oracle_needs_the_acceptance_model_and_the_domains() -> None:
    oracle = InformedOracle([0, 1, 2])
    with pytest.raises(OracleError, match="needs the engine's acceptance model"):
        oracle.bind_engine(_LinearCost(1e-2, 1e-3), EngineConfig(kv_token_capacity=100))
    oracle.bind_engine(_LinearCost(1e-2, 1e-3), EngineConfig(kv_token_capacity=100), _Rates({}))
    with pytest.raises(OracleError, match="0 domains for a batch of 2"):
        oracle.observe_batch(_peeks([1, 1]), [5, 5], 0, [])


# ------------------------------------------------------- shares and ceiling


def _summary(name: str, goodput: float) -> dict[str, Any]:
    return {"name": name, "goodput_tok_s": goodput}


def test_oracle_report_shares_and_the_fleet_ceiling_where_none_beats_the_oracle() -> None:
    runs = [
        _summary("none", 100.0),
        _summary("goodput", 95.0),
        _summary("oracle", 90.0),  # saturation: no step table reaches none
        _summary("oracle:informed", 120.0),
    ]
    ceiling = oracle_report(runs)
    assert ceiling is not None
    clair, informed = ceiling["oracles"]["oracle"], ceiling["oracles"]["oracle:informed"]
    assert (clair["fleet_ceiling"], clair["fleet_ceiling_tok_s"]) == ("none", 100.0)
    assert "restarted without speculation" in clair["note"]
    assert (informed["fleet_ceiling"], informed["fleet_ceiling_tok_s"]) == (
        "oracle:informed",
        120.0,
    )
    assert informed["gain_over_none"] == pytest.approx(0.2)
    by = {r["name"]: r["oracle_share"] for r in runs}
    assert by["goodput"] == {"oracle": None, "oracle:informed": pytest.approx(-0.25)}
    assert by["oracle:informed"]["oracle:informed"] == pytest.approx(1.0)
    # Under MIN_ORACLE_GAIN (1 %) there is no gain to share.
    assert oracle_share(100.5, 100.0, 100.9) is None
    assert oracle_share(100.5, 100.0, 101.0) == pytest.approx(0.5)


def test_oracle_report_without_none_or_oracle() -> None:
    assert oracle_report([_summary("none", 1.0), _summary("static:3", 2.0)]) is None
    runs = [_summary("static:3", 2.0), _summary("oracle", 3.0)]
    ceiling = oracle_report(runs)
    assert ceiling is not None and ceiling["note"] == "shares need a 'none' run beside the oracle"
    assert runs[0]["oracle_share"] == {"oracle": None}


# ------------------------------------------------------------- in the engine


class _DecodeTally(SimMetrics):
    """Counts decode tokens and decode GPU time from the engine's metric hooks."""

    def __init__(self) -> None:
        super().__init__(model_name="m", kv_capacity_tokens=1)
        self.tokens = 0
        self.time_s = 0.0

    def on_decode(self, step: DecodeStep) -> None:
        self.tokens += step.emitted_tokens
        self.time_s += step.step_s


def _requests(spec: str, n: int) -> list[Request]:
    return list(generate_trace(parse_synthetic_spec(spec)).requests[:n])


def _run(
    server: ServerSpec,
    policy: str,
    requests: Sequence[Request],
    users: int | None,
    seeds: Sequence[int] = (5,),
) -> tuple[EngineResult, float]:
    """The last seed's result and the decode rate pooled over *seeds* (tokens / time)."""
    tokens = time_s = 0.0
    for seed in seeds:
        prepared = prepare_run(server, parse_policy(policy), seed=seed)
        tally = _DecodeTally()
        result = prepared.engine.run(requests, metrics=tally, concurrency=users)
        tokens += tally.tokens
        time_s += tally.time_s
    return result, tokens / time_s


SCENARIOS = [
    # (server, trace, requests, closed-loop users)
    (ServerSpec(), "synthetic:duration=60,rate=4,in=512,out=128,seed=1", 160, None),
    (ServerSpec(acceptance_profile="ngram"), "synthetic:duration=60,rate=1,out=96,seed=2", 40, 1),
    (ServerSpec(gpu="a100-80g"), "synthetic:duration=60,rate=1,out=96,seed=2", 160, 48),
    (ServerSpec(topk=2, num_draft_tokens=8), "synthetic:duration=60,rate=1,out=64,seed=3", 60, 8),
]


@pytest.mark.parametrize(("server", "spec", "n", "users"), SCENARIOS)
def test_oracle_is_at_least_as_good_as_every_static(
    server: ServerSpec, spec: str, n: int, users: int | None
) -> None:
    requests = _requests(spec, n)
    _, oracle_rate = _run(server, "oracle", requests, users)
    statics = {k: _run(server, f"static:{k}", requests, users)[1] for k in range(8)}
    best = max(statics, key=lambda k: statics[k])
    assert oracle_rate >= statics[best], (oracle_rate, statics)


def test_oracle_is_deterministic_and_changes_nothing_others_see() -> None:
    requests = _requests("synthetic:duration=40,rate=3,out=96,seed=9", 80)
    server = ServerSpec()

    def fingerprint(result: EngineResult) -> tuple[Any, ...]:
        return (result.output_tokens, result.end_s, result.accepted_drafts, result.steps_hist)

    others = ("static:3", "sglang-ema")
    before = {p: fingerprint(_run(server, p, requests, None)[0]) for p in others}
    first = fingerprint(_run(server, "oracle", requests, None)[0])
    again = fingerprint(_run(server, "oracle", requests, None)[0])
    after = {p: fingerprint(_run(server, p, requests, None)[0]) for p in others}
    assert first == again
    assert before == after


def test_replay_runs_the_oracle_by_name() -> None:
    trace = Trace(
        name="t", requests=tuple(_requests("synthetic:duration=30,rate=2,seed=4", 30)), source="t"
    )
    report = replay(trace, ServerSpec(), ["static:3", "oracle"], seed=0)
    by_name = {run.policy.name: run.summary for run in report.runs}
    assert by_name["oracle"]["completed_requests"] == by_name["static:3"]["completed_requests"]
    assert by_name["oracle"]["throughput_tok_s"] > 0


@pytest.mark.parametrize(("server", "spec", "n", "users"), SCENARIOS)
def test_informed_oracle_sits_between_the_best_static_and_the_clairvoyant(
    server: ServerSpec, spec: str, n: int, users: int | None
) -> None:
    # The informed oracle knows each request's acceptance distribution (the rates its
    # verifies see: acceptance_verify), not the draws, so one seed's draws can favour a
    # static: the tree scenario's seed 5 alone gives 0.987x static:4 (measured; seeds 1
    # and 2 on a longer trace 1.005x and 1.001x). Pooled over three seeds' draws, 1 %
    # under the best static is what is left to noise; knowing the draws can only help.
    seeds = (5, 6, 7)
    requests = _requests(spec, n)
    _, clairvoyant = _run(server, "oracle", requests, users, seeds)
    _, informed = _run(server, "oracle:informed", requests, users, seeds)
    statics = {k: _run(server, f"static:{k}", requests, users, seeds)[1] for k in range(8)}
    best = max(statics.values())
    assert best * 0.99 <= informed <= clairvoyant, (informed, clairvoyant, statics)


def test_replay_json_has_both_shares_and_the_ceiling() -> None:
    trace = Trace(
        name="t", requests=tuple(_requests("synthetic:duration=30,rate=6,seed=4", 120)), source="t"
    )
    report = replay(trace, ServerSpec(), ["none", "static:3", "oracle", "oracle:informed"], seed=0)
    doc = report.to_json()
    by = {p["name"]: p for p in doc["policies"]}
    none = by["none"]["goodput_tok_s"]
    for name in ("oracle", "oracle:informed"):
        top = by[name]["goodput_tok_s"]
        entry = doc["ceiling"]["oracles"][name]
        assert entry["fleet_ceiling_tok_s"] == max(top, none)
        assert entry["fleet_ceiling"] == (name if top >= none else "none")
        for p in by.values():
            assert p["oracle_share"][name] == oracle_share(p["goodput_tok_s"], none, top)
