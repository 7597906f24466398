"""Fitting the per-token acceptance model (``specgov fit-acceptance``, issue 11 §1).

Synthetic per-token traces with known structure (seeded): drawn from the model itself
(the fit must recover its rates and correlation) and from a different structure
(hidden easy/hard regimes with per-depth drafting accuracy, which the model does not
contain: the fit must still reproduce the trace replay within 3 % at every k = 1..7).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml
from click.testing import CliRunner

from specgov.controller.cli.main import main
from specgov.simulator.catalog import Catalog, CatalogError
from specgov.simulator.engine.acceptance import PROFILES
from specgov.simulator.engine.acceptance_fit import (
    FIT_STEPS,
    AcceptanceFitError,
    DomainFit,
    fit_domain,
    model_accept_length,
    profile_document,
    replay_accept_lengths,
    synthetic_acc_len,
    trace_rates,
)
from specgov.simulator.replay.runner import ServerSpec, parse_policy, prepare_run
from specgov.simulator.workload.traces import Request

CHAT = PROFILES["eagle3-llama3.1-8b"]["sharegpt"]


def _regime_request(
    rng: np.random.Generator,
    n: int,
    switch: tuple[float, float],
    q: dict[int, tuple[float, ...]],
    p_hard: float,
) -> list[int]:
    """One request's per-token trace from hidden easy/hard regimes (sticky Markov, per
    token, leaving easy with switch[0] and hard with switch[1]); the draft of token s at
    depth j is accepted iff w_s < q[regime_s][j], so a hard token fails every verify that
    reaches it, and deeper drafts are worse."""
    state = np.empty(n, dtype=np.int64)
    s = int(rng.random() < p_hard)
    for t in range(n):
        if rng.random() < switch[s]:
            s = 1 - s
        state[t] = s
    w = rng.random(n)
    acc = []
    for p in range(n):
        j = 0
        while j < 7 and p + j < n - 1 and w[p + j] < q[int(state[p + j])][j]:
            j += 1
        acc.append(j + 1)
    return acc


def _regime_trace(
    lengths: list[int], seed: int, switch: tuple[float, float] = (0.05, 0.15)
) -> list[list[int]]:
    """Per-token traces of requests that share one easy/hard regime structure."""
    q = {0: (0.92, 0.88, 0.86, 0.85, 0.85, 0.85, 0.85), 1: (0.35, 0.3, 0.3, 0.3, 0.3, 0.3, 0.3)}
    rng = np.random.default_rng(seed)
    return [_regime_request(rng, n, switch, q, 0.3) for n in lengths]


def test_replay_walks_the_positions_a_verify_visits() -> None:
    seq = [3, 1, 5, 2, 4, 1, 1, 2]
    # k=2: pos0 acc3 -> 3 tokens; pos3 acc2 -> 2; pos5 acc1 -> 1; pos6 acc1 -> 1; pos7 -> 1.
    # k=0: every verify emits one token.
    assert replay_accept_lengths([seq], (2, 0)) == pytest.approx({2: 8 / 5, 0: 1.0})
    with pytest.raises(AcceptanceFitError, match="empty trace"):
        replay_accept_lengths([[]], (3,))


def test_trace_rates_count_every_position_and_censor_the_deepest_value() -> None:
    # acc_len 1..3 where 3 is the cap: α_1 = P(>=2), α_2 = P(>=3 | >=2); no α_3.
    seqs = [[1, 2, 3, 3, 1, 2, 1, 3, 1, 1] * 20]
    rates = trace_rates(seqs)
    assert len(rates) == 2
    flat = np.asarray(seqs[0])
    assert rates[0] == pytest.approx((flat[:-1] >= 2).mean(), abs=0.02)
    with pytest.raises(AcceptanceFitError, match=r"request 0 acc_len\[1\] = 0"):
        trace_rates([[1, 0, 2]])


def test_fit_recovers_a_known_token_correlation_and_rates() -> None:
    for rho in (0.2, 0.6):
        seqs = synthetic_acc_len(CHAT, rho, [300] * 60, seed=11)
        fit = fit_domain("chat", seqs)
        assert fit.token_correlation == pytest.approx(rho, abs=0.06)
        for got, want in zip(fit.rates, CHAT, strict=True):
            assert got == pytest.approx(want, abs=0.025)
        assert fit.max_rel_error < 0.03


def test_fit_reproduces_replay_of_a_structure_outside_the_model() -> None:
    seqs = _regime_trace([400] * 50, seed=3)
    fit = fit_domain("x", seqs)
    assert set(fit.trace_accept_length) == set(FIT_STEPS)
    for k in FIT_STEPS:
        assert fit.model_accept_length[k] == pytest.approx(fit.trace_accept_length[k], rel=0.03)
    # The per-verify model (the pre-issue-11 sampler) is far off at large k there.
    assert fit.per_verify_accept_length[7] > 1.1 * fit.trace_accept_length[7]


def test_synthetic_traces_are_seeded_and_validated() -> None:
    a = synthetic_acc_len(CHAT, 0.4, [50, 80], seed=1)
    assert a == synthetic_acc_len(CHAT, 0.4, [50, 80], seed=1)
    assert a != synthetic_acc_len(CHAT, 0.4, [50, 80], seed=2)
    assert [len(s) for s in a] == [50, 80]
    # Never more tokens than are left, never past the cap.
    assert all(1 <= v <= min(8, len(s) - p) for s in a for p, v in enumerate(s))
    with pytest.raises(AcceptanceFitError, match="token_correlation must be in"):
        synthetic_acc_len(CHAT, 1.0, [10], seed=0)


def _write_trace(path: Path, seqs: list[list[int]], domain: str | None) -> None:
    with path.open("w", encoding="utf-8") as f:
        for i, s in enumerate(seqs):
            rec: dict[str, object] = {
                "arrival_s": 0.5 * i,
                "input_tokens": 128,
                "output_tokens": len(s),
                "acc_len": s,
            }
            if domain is not None:
                rec["domain"] = domain
            f.write(json.dumps(rec) + "\n")


def test_cli_fits_a_profile_that_replay_loads(tmp_path: Path) -> None:
    trace = tmp_path / "mine.jsonl"
    seqs = _regime_trace([300] * 40, seed=5)
    _write_trace(trace, seqs, "chat")
    out = tmp_path / "mine.yaml"
    result = CliRunner().invoke(main, ["fit-acceptance", str(trace), "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert "domain chat: 40 requests" in result.output
    doc = yaml.safe_load(out.read_text())
    entry = doc["acceptance_profiles"]["mine"]
    assert entry["default_domain"] == "chat"
    assert entry["domains"]["chat"]["fit"]["max_rel_error"] < 0.03
    # Issue 22: the per-request level and the model kind are written and reported.
    assert 0.0 <= entry["domains"]["chat"]["request_correlation"] < 1.0
    assert isinstance(entry["domains"]["chat"]["runs"], bool)
    assert "request_correlation" in result.output
    spec = Catalog.load([out]).acceptance_profile("mine")
    assert spec is not None and spec.default_domain == "chat"
    # Replay a trace without acc_len: the sampled model (the fitted profile) decides.
    server = ServerSpec(catalog_files=(out,), acceptance_profile="mine")
    requests = [Request(0.05 * i, 256, 400, "chat") for i in range(24)]
    run = prepare_run(server, parse_policy("static:3"), seed=1)
    res = run.run(requests)
    tokens_per_verify = (res.accepted_drafts + res.verified_requests) / res.verified_requests
    want = replay_accept_lengths(seqs, (3,))[3]
    assert tokens_per_verify == pytest.approx(want, rel=0.04)
    builtin = prepare_run(ServerSpec(), parse_policy("static:3"), seed=1).run(requests)
    builtin_tpv = (builtin.accepted_drafts + builtin.verified_requests) / builtin.verified_requests
    assert builtin_tpv != pytest.approx(tokens_per_verify, rel=0.02)


def test_cli_names_requests_without_domain_default(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    _write_trace(trace, synthetic_acc_len(CHAT, 0.3, [200] * 20, seed=4), None)
    result = CliRunner().invoke(main, ["fit-acceptance", str(trace), "--name", "Team A"])
    assert result.exit_code == 0, result.output
    doc = yaml.safe_load((tmp_path / "t.acceptance.yaml").read_text())
    assert list(doc["acceptance_profiles"]["team-a"]["domains"]) == ["default"]


def test_cli_errors_are_one_clean_line(tmp_path: Path) -> None:
    missing = CliRunner().invoke(main, ["fit-acceptance", str(tmp_path / "nope.jsonl")])
    assert missing.exit_code == 2 and "does not exist" in missing.output
    no_acc = tmp_path / "plain.jsonl"
    no_acc.write_text('{"arrival_s": 0, "input_tokens": 3, "output_tokens": 2}\n')
    result = CliRunner().invoke(main, ["fit-acceptance", str(no_acc)])
    assert result.exit_code == 2
    assert "plain.jsonl:1: key 'acc_len' is missing" in result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize(
    ("body", "match"),
    [
        ("p: {domains: {chat: {rates: [1.2]}}}", r"domains.chat.rates\[0\]: expected an acc"),
        ("p: {domains: {chat: {rates: [0.5], token_correlation: 1}}}", r"\[0, 1\) or null"),
        ("p: {domains: {}}", "expected a non-empty mapping of domain"),
        ("p: {domains: {chat: {rates: [0.5]}}, default_domain: code}", "'code' is not one of"),
        ("p: {domains: {chat: {rate: [0.5]}}}", "unknown key; valid keys: rates"),
    ],
)
def test_catalog_acceptance_profiles_are_validated(tmp_path: Path, body: str, match: str) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("acceptance_profiles:\n  " + body + "\n")
    with pytest.raises(CatalogError, match=match):
        Catalog.load([f])


# ------------------------------------------- requests that differ (issue 22 §1)


def _mixed_trace(seed: int, requests: int = 240) -> list[list[int]]:
    """A code-like per-token trace whose requests differ (generated, seeded): each
    request has its own easy/hard regime switching rates, and a few very long, highly
    repetitive outputs carry much of the tokens. Not the fitted model's structure."""
    q = {0: (0.93, 0.9, 0.88, 0.87, 0.87, 0.87, 0.87), 1: (0.3, 0.25, 0.25, 0.25, 0.25, 0.25, 0.25)}
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(requests):
        if rng.random() < 0.04:
            n, to_hard, to_easy = int(rng.integers(2500, 4000)), 0.01, 0.4
        else:
            n = int(rng.integers(60, 400))
            to_hard = float(np.clip(rng.lognormal(np.log(0.1), 0.8), 0.01, 0.8))
            to_easy = float(np.clip(rng.lognormal(np.log(0.15), 0.6), 0.02, 0.8))
        p_hard = to_hard / (to_hard + to_easy)
        out.append(_regime_request(rng, n, (to_hard, to_easy), q, p_hard))
    return out


def _tpot_p99_ms(seqs: list[list[int]], tmp_path: Path, profile: str | None, replay: bool) -> float:
    """TPOT p99 of serving *seqs* (static 5 drafts, H100, 4 req/s): the trace itself
    (replay) or the requests' lengths only, acceptance sampled from *profile*."""
    files = tuple(tmp_path.glob("*.yaml")) if profile else ()
    server = ServerSpec(catalog_files=files, acceptance_profile=profile)
    requests = [
        Request(0.25 * i, 512, len(s), "code", tuple(s) if replay else None)
        for i, s in enumerate(seqs)
    ]
    res = prepare_run(server, parse_policy("static:5"), seed=3).run(requests)
    tpot = np.asarray(res.tpot_s)
    return float(np.percentile(tpot[~np.isnan(tpot)], 99)) * 1e3


def _write_profile(tmp_path: Path, name: str, fit: DomainFit) -> None:
    doc = profile_document(name, [fit], source="test", default_domain=fit.domain)
    (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(doc), encoding="utf-8")


def test_split_half_check_of_a_trace_whose_requests_differ(tmp_path: Path) -> None:
    """Issue 22 §1's honest check: fit on a random half, replay the other half's lengths
    with the fitted profile, compare with that half's own trace replay."""
    seqs = _mixed_trace(seed=21)
    order = np.random.default_rng(5).permutation(len(seqs))
    half_a = [seqs[i] for i in order[: len(seqs) // 2]]
    half_b = [seqs[i] for i in order[len(seqs) // 2 :]]
    fit = fit_domain("code", half_a)
    assert fit.request_correlation > 0.05  # the requests differ, and the fit sees it
    al_a = replay_accept_lengths(half_a)
    al_b = replay_accept_lengths(half_b)
    model_b = model_accept_length(
        fit.rates,
        fit.token_correlation,
        lengths=[len(s) for s in half_b],
        request_correlation=fit.request_correlation,
        runs=fit.runs,
        seed=1,
    )
    for k in FIT_STEPS:
        halves = abs(al_a[k] / al_b[k] - 1.0)
        assert abs(model_b[k] / al_b[k] - 1.0) <= halves + 0.03, (k, model_b[k], al_b[k], halves)
    _write_profile(tmp_path, "half-a", fit)
    trace_p99 = _tpot_p99_ms(half_b, tmp_path, None, replay=True)
    model_p99 = _tpot_p99_ms(half_b, tmp_path, "half-a", replay=False)
    assert model_p99 == pytest.approx(trace_p99, rel=0.10)
    # The fit before issue 22 (no per-request level, ρ alone) makes the tail too short.
    before = fit_domain("code", half_a, requests_differ=False)
    assert before.request_correlation == 0.0 and not before.runs
    _write_profile(tmp_path, "half-a", before)
    assert _tpot_p99_ms(half_b, tmp_path, "half-a", replay=False) < 0.9 * trace_p99
