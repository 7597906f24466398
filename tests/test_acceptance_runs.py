"""N-gram acceptance as exact-match runs (``specgov.simulator.engine.acceptance_runs``, issue 22
§1).

The check against per-token n-gram traces uses traces this test generates: a chain
n-gram drafter (the longest suffix of up to 10 tokens seen before, drafting what followed
its latest occurrence; an approximation of SGLang's trie) run over real text that ships
with Python, its standard library's source (code) and its documentation topics (prose),
regex-tokenised. acc_len at each position is 1 + the drafts that match the text.
"""

from __future__ import annotations

import itertools
import re
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from specgov.simulator.engine.acceptance import (
    BUILTIN_REQUEST_CORRELATION,
    BUILTIN_RUN_REQUEST_CORRELATION,
    BUILTIN_TOKEN_CORRELATION,
    PROFILES,
    AcceptanceModel,
)
from specgov.simulator.engine.acceptance_fit import (
    FIT_STEPS,
    fit_domain,
    model_accept_length,
    replay_accept_lengths,
    trace_rates,
)
from specgov.simulator.engine.acceptance_runs import RunsError, run_acc_len, run_process

_TOKEN = re.compile(r"\w+|[^\w\s]|\n")


def _ngram_acc_len(tokens: list[str], prompt: int, drafts: int = 7, window: int = 10) -> list[int]:
    """acc_len at each output position (after *prompt* tokens) of a suffix-match drafter."""
    index: list[dict[tuple[str, ...], int]] = [{} for _ in range(window + 1)]

    def add(end: int) -> None:
        for n in range(1, min(window, end) + 1):
            index[n][tuple(tokens[end - n : end])] = end

    for end in range(1, prompt):
        add(end)
    acc = []
    for p in range(prompt, len(tokens)):
        cont = -1
        for n in range(min(window, p), 0, -1):
            e = index[n].get(tuple(tokens[p - n : p]))
            if e is not None and e < p:
                cont = e
                break
        j = 0
        if cont >= 0:
            while j < drafts and p + j < len(tokens) and tokens[cont + j] == tokens[p + j]:
                j += 1
        acc.append(j + 1)
        add(p)
    return [min(v, len(acc) - i) for i, v in enumerate(acc)]


def _code_traces() -> list[list[int]]:
    lib = Path(sysconfig.get_paths()["stdlib"])
    files = [f for pkg in ("email", "json", "http") for f in sorted(lib.glob(f"{pkg}/*.py"))]
    files += sorted(lib.glob("asyncio/*.py"))[:20]
    out = []
    for f in files:
        tokens = _TOKEN.findall(f.read_text(encoding="utf-8"))
        if len(tokens) >= 600:
            half = len(tokens) // 2  # the file's first half is the prompt
            out.append(_ngram_acc_len(tokens[: half + 500], half))
    return out


def _prose_traces() -> list[list[int]]:
    topics = pytest.importorskip("pydoc_data.topics")
    tokens = _TOKEN.findall("\n".join(topics.topics.values()))
    chunk = 1500
    return [_ngram_acc_len(tokens[s : s + chunk], 1000) for s in range(0, 60 * chunk, chunk)]


@pytest.fixture(scope="module", params=["code", "prose"])
def ngram_traces(request: pytest.FixtureRequest) -> list[list[int]]:
    traces = _code_traces() if request.param == "code" else _prose_traces()
    assert len(traces) >= 30 and sum(map(len, traces)) > 15_000
    return traces


def test_run_model_reproduces_ngram_traces_from_their_rates_alone(
    ngram_traces: list[list[int]],
) -> None:
    rates = trace_rates(ngram_traces)
    trace = replay_accept_lengths(ngram_traces)
    lengths = [len(s) for s in ngram_traces]
    h = BUILTIN_RUN_REQUEST_CORRELATION
    runs = model_accept_length(rates, 0.0, lengths=lengths, request_correlation=h, runs=True)
    for k in FIT_STEPS:
        assert runs[k] == pytest.approx(trace[k], rel=0.10), k
    # The per-token latent with the built-in correlation (how the n-gram profile was
    # sampled before issue 22) overstates it, more with every draft.
    latent = model_accept_length(
        rates, BUILTIN_TOKEN_CORRELATION, request_correlation=BUILTIN_REQUEST_CORRELATION
    )
    assert latent[7] > 1.12 * trace[7]
    assert latent[7] / trace[7] > latent[2] / trace[2]


def test_fit_reproduces_an_ngram_trace_with_either_model() -> None:
    seqs = _code_traces()
    fit = fit_domain("code", seqs)
    assert fit.max_rel_error < 0.03
    assert fit.other_max_rel_error < 0.10  # the model not chosen is within 10 % too
    entry = fit.entry()
    assert entry.runs == fit.runs
    assert (entry.token_correlation is None) == fit.runs


@pytest.mark.parametrize("domain", sorted(PROFILES["ngram"]))
@pytest.mark.parametrize("h", [0.0, 0.5])
def test_runs_keep_the_profile_rates(domain: str, h: float) -> None:
    rates = PROFILES["ngram"][domain]
    proc = run_process(rates, h)
    rng = np.random.default_rng(7)
    seqs = []
    for _ in range(400):
        acc = run_acc_len(proc, proc.request_start(float(rng.standard_normal())), rng, 600)
        seqs.append([min(v, 8, 600 - i) for i, v in enumerate(acc[:600])])
    for got, want in zip(trace_rates(seqs), rates, strict=False):
        assert got == pytest.approx(want, abs=0.025)
    # A run is an exact match: inside one, acc_len falls by one per position.
    flat = run_acc_len(proc, proc.start, np.random.default_rng(1), 5000)
    for a, b in itertools.pairwise(flat):
        assert b == a - 1 or a <= 2


def test_request_correlation_spreads_requests_without_moving_the_rates() -> None:
    rates = PROFILES["ngram"]["sharegpt"]
    flat, spread = run_process(rates, 0.0), run_process(rates, 0.4)
    assert flat.request_start(2.0) == flat.start
    assert spread.request_start(-2.0) > 4 * spread.request_start(2.0)


def test_builtin_ngram_profile_is_sampled_as_runs() -> None:
    model = AcceptanceModel("ngram", seed=4)
    assert model.runs("chat") and model.request_correlation("chat") == pytest.approx(0.3)
    sampler = model.sampler(0, "code")
    draws = [sampler.draw(7) for _ in range(4000)]
    # In runs: after a verify that took all 7 drafts the next one usually does too.
    after_full = [b for a, b in itertools.pairwise(draws) if a == 7]
    assert len(after_full) > 50 and np.mean(after_full) > 4.0
    assert not AcceptanceModel("ngram", seed=4, token_model=False).runs("code")


@pytest.mark.parametrize(
    ("rates", "h", "match"),
    [((), 0.0, "non-empty list"), ((0.5, 1.2), 0.0, "non-empty list"), ((0.5,), 1.0, r"\[0, 1\)")],
)
def test_run_process_errors_are_clear(rates: tuple[float, ...], h: float, match: str) -> None:
    with pytest.raises(RunsError, match=match):
        run_process(rates, h)
