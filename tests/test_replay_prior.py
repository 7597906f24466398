"""Wrong priors on purpose: `specgov replay --prior-scale F` and `--prior-gpu NAME`.

The simulated truth stays the catalog's cost model; only the step-cost prior the
daemon policy starts from changes. Checked in the prior builder, in what a replayed
goodput policy predicts, in the JSON report and at the CLI (exit 2 for bad values).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from click.testing import CliRunner
from step_cost_knee import verify_knee_tokens

from specgov.controller.cli.main import main
from specgov.policies.daemon.estimators.step_cost import (
    StepCostPrior,
    initial_step_cost_state,
    predict_step_s,
)
from specgov.policies.daemon.goodput import GoodputPolicy
from specgov.simulator.catalog import Catalog
from specgov.simulator.engine.cost import CostModel
from specgov.simulator.priors import (
    PriorOptionError,
    check_prior_options,
    replay_step_cost_prior,
    step_cost_prior,
)
from specgov.simulator.replay import runner as replay_mod
from specgov.simulator.replay.runner import ServerSpec, parse_policy, prepare_run

CATALOG = Catalog.load()
LLAMA8 = CATALOG.model("llama-3.1-8b")
EAGLE3 = CATALOG.drafter("eagle3")
TRUTH = CostModel.from_catalog(CATALOG.gpu("h100"), LLAMA8, EAGLE3)
POINTS = [(b, k, b * 1000) for b in (1, 4, 16, 64, 256) for k in (0, 1, 3, 5)]
SMALL_SYNTH = "synthetic:duration=60,rate=6,seed=3"


def _replay_prior(**kwargs: Any) -> StepCostPrior:
    return replay_step_cost_prior(TRUTH, model="llama-3.1-8b", drafter="eagle3", **kwargs)


def test_defaults_are_the_exact_prior() -> None:
    prior = _replay_prior()
    assert prior.coefficients is TRUTH.coefficients
    assert prior == step_cost_prior(TRUTH)
    assert _replay_prior(prior_gpu="h100") == prior  # the simulated GPU itself: exact


@pytest.mark.parametrize("scale", [0.7, 1.4])
def test_prior_scale_believes_every_step_costs_f_times_the_truth(scale: float) -> None:
    prior = _replay_prior(prior_scale=scale)
    for b, k, kv in POINTS:
        assert prior.predict_s(b, k, kv) == pytest.approx(
            scale * TRUTH.decode_step_s(b, k, kv), rel=1e-12
        )
    # A scale alone keeps the knee where it is.
    exact = initial_step_cost_state(step_cost_prior(TRUTH))
    assert verify_knee_tokens(initial_step_cost_state(prior)) == verify_knee_tokens(exact)


def test_prior_gpu_moves_the_knee_not_only_the_scale() -> None:
    prior = _replay_prior(prior_gpu="l40s")
    l40s = CostModel.from_catalog(CATALOG.gpu("l40s"), LLAMA8, EAGLE3)
    for b, k, kv in POINTS:
        assert prior.predict_s(b, k, kv) == l40s.decode_step_s(b, k, kv)
    ratios = [prior.predict_s(b, k, kv) / TRUTH.decode_step_s(b, k, kv) for b, k, kv in POINTS]
    assert max(ratios) / min(ratios) > 1.2  # not one scale factor
    exact = initial_step_cost_state(step_cost_prior(TRUTH))
    assert verify_knee_tokens(initial_step_cost_state(prior)) != verify_knee_tokens(exact)
    # Both together: the other GPU's prior, scaled.
    both = _replay_prior(prior_gpu="l40s", prior_scale=1.4)
    assert both.predict_s(8, 3, 8000) == pytest.approx(1.4 * l40s.decode_step_s(8, 3, 8000))


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"prior_scale": 0.0}, "prior_scale (--prior-scale): expected a finite number > 0"),
        ({"prior_scale": -1.0}, "--prior-scale"),
        ({"prior_scale": float("nan")}, "--prior-scale"),
        ({"prior_scale": float("inf")}, "--prior-scale"),
        ({"prior_scale": "2"}, "--prior-scale"),
        ({"prior_gpu": "h1000"}, "prior_gpu (--prior-gpu): unknown GPU 'h1000'; valid: "),
        ({"prior_gpu": ""}, "--prior-gpu"),
    ],
)
def test_server_spec_rejects_bad_prior_options(kwargs: dict[str, Any], needle: str) -> None:
    with pytest.raises(PriorOptionError) as info:
        ServerSpec(**kwargs)
    assert needle in str(info.value)
    if "prior_gpu" in kwargs:
        for name in CATALOG.gpu_names():
            assert name in str(info.value)
    with pytest.raises(PriorOptionError):
        check_prior_options(kwargs.get("prior_scale", 1.0), kwargs.get("prior_gpu"))


def _prior_handed_to_the_policy(monkeypatch: pytest.MonkeyPatch, server: ServerSpec) -> Any:
    """Build the replay of goodput on *server*; return the prior its closed loop got."""
    seen: list[StepCostPrior] = []

    def spy(*args: Any, **kwargs: Any) -> StepCostPrior:
        prior = replay_step_cost_prior(*args, **kwargs)
        seen.append(prior)
        return prior

    monkeypatch.setattr(replay_mod, "replay_step_cost_prior", spy)
    prepared = prepare_run(server, parse_policy("goodput"), seed=0)
    assert prepared.loop is not None and len(seen) == 1
    return seen[0]


def test_replay_hands_the_wrong_prior_to_the_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    exact = _prior_handed_to_the_policy(monkeypatch, ServerSpec())
    scaled = _prior_handed_to_the_policy(monkeypatch, ServerSpec(prior_scale=1.4))
    other = _prior_handed_to_the_policy(monkeypatch, ServerSpec(prior_gpu="l40s"))
    assert exact == step_cost_prior(TRUTH)
    b, k, kv = 16, 3, 16_000
    truth_s = TRUTH.decode_step_s(b, k, kv)
    # What the goodput policy predicts before it has seen any data.
    predicted = {
        name: predict_step_s(GoodputPolicy(prior=p).initial_state().step_cost, b, k, kv)
        for name, p in (("exact", exact), ("scaled", scaled), ("l40s", other))
    }
    assert predicted["exact"] == pytest.approx(truth_s, rel=1e-12)
    assert predicted["scaled"] == pytest.approx(1.4 * truth_s, rel=1e-12)
    assert predicted["l40s"] > 1.3 * truth_s  # the L40S reads weights ~2.6x slower


def _replay(*args: str) -> Any:
    return CliRunner().invoke(main, ["replay", SMALL_SYNTH, "--policy", "goodput", *args])


def test_cli_reports_the_prior_and_runs_with_another_gpus_prior() -> None:
    result = _replay("--prior-gpu", "l40s", "--prior-scale", "1.4", "--output", "json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["server"]["gpu"] == "h100"
    assert data["server"]["prior"] == {"gpu": "l40s", "scale": 1.4}
    (run,) = data["policies"]
    assert run["name"] == "goodput" and run["completed_requests"] == data["trace"]["requests"]
    assert run["decisions"] > 0


def test_cli_default_prior_is_reported_as_exact() -> None:
    result = CliRunner().invoke(
        main, ["replay", SMALL_SYNTH, "--policy", "none", "--output", "json"]
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["server"]["prior"] == {"gpu": "h100", "scale": 1.0}


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--prior-scale", "0"], "--prior-scale"),
        (["--prior-scale", "-2"], "--prior-scale"),
        (["--prior-scale", "nan"], "--prior-scale"),
        (["--prior-scale", "x"], "--prior-scale"),
        (["--prior-gpu", "h1000"], "--prior-gpu"),
    ],
)
def test_cli_bad_prior_values_exit_2_naming_the_option(args: list[str], needle: str) -> None:
    result = _replay(*args)
    assert result.exit_code == 2, result.output
    assert needle in result.output
    assert "Traceback" not in result.output
    if "--prior-gpu" in args:
        assert "valid: " in result.output and "l40s" in result.output


def test_prior_gpu_takes_the_catalog_aliases_gpu_takes() -> None:
    # `--gpu a100` works, so `--prior-gpu a100` must (issue 22 §4): same lookup.
    assert _replay_prior(prior_gpu="a100") == _replay_prior(prior_gpu="a100-80g")
    assert _replay_prior(prior_gpu="H100-SXM") == _replay_prior(prior_gpu="h100")
    ServerSpec(prior_gpu="a100")  # accepted
    result = CliRunner().invoke(
        main, ["replay", SMALL_SYNTH, "--policy", "goodput", "--prior-gpu", "a100",
               "--output", "json"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["server"]["prior"]["gpu"] == "a100-80g"
