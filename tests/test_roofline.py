"""One roofline: the simulator's CostModel and the estimator's StepCostPrior share it.

The decode-step formula lives once, in ``specgov.policies.common.roofline``; the simulator's
cost model *is* a ``Roofline`` and the prior holds the cost model's coefficients
object, so a prior built from a cost model predicts bit for bit what it charges.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specgov.policies.common.roofline import (
    MAX_STEPS,
    Roofline,
    RooflineCoefficients,
    RooflineError,
    scaled_coefficients,
)
from specgov.policies.common.types import PolicyTypeError
from specgov.policies.daemon.estimators.step_cost import (
    StepCostPrior,
    default_step_cost_prior,
    initial_step_cost_state,
    predict_step_s,
)
from specgov.simulator.catalog import Catalog
from specgov.simulator.engine.cost import CostCoefficients, CostModel, CostModelError
from specgov.simulator.priors import step_cost_prior

CATALOG = Catalog.load()
H100 = CATALOG.gpu("h100")
LLAMA8 = CATALOG.model("llama-3.1-8b")
LLAMA70 = CATALOG.model("llama-3.1-70b")
EAGLE3 = CATALOG.drafter("eagle3")


def _models() -> list[tuple[str, CostModel]]:
    out = []
    for gpu in CATALOG.gpu_names():
        g = CATALOG.gpu(gpu)
        out += [
            (f"{gpu} eagle3 chain", CostModel.from_catalog(g, LLAMA8, EAGLE3)),
            (f"{gpu} ngram", CostModel.from_catalog(g, LLAMA8, CATALOG.drafter("ngram"))),
            (f"{gpu} no drafter", CostModel.from_catalog(g, LLAMA8, None)),
            (f"{gpu} tree", CostModel.from_catalog(g, LLAMA8, EAGLE3, topk=4, num_draft_tokens=8)),
            (f"{gpu} 70b tp4", CostModel.from_catalog(g, LLAMA70, EAGLE3, tp_size=4)),
        ]
    return out


MODELS = _models()
GRID = list(
    itertools.product(
        (1, 2, 3.5, 8, 17, 64, 128, 256, 512),  # fractional: a mean batch size
        range(0, 9),
        (0, 1000, 250_000),
    )
)


@pytest.mark.parametrize(("name", "model"), MODELS, ids=[n for n, _ in MODELS])
def test_prior_predicts_exactly_what_the_cost_model_charges(name: str, model: CostModel) -> None:
    prior = step_cost_prior(model)
    state = initial_step_cost_state(prior)
    for b, k, kv in GRID:
        charged = model.decode_step_s(b, k, kv)
        assert prior.predict_s(b, k, kv) == charged, (name, b, k, kv)
        # The fitted estimator starts at the prior (its linear basis, to rounding).
        assert predict_step_s(state, b, k, kv) == pytest.approx(charged, rel=1e-12)


def test_there_is_no_second_implementation() -> None:
    model = CostModel.from_catalog(H100, LLAMA8, EAGLE3, topk=4, num_draft_tokens=8)
    prior = step_cost_prior(model)
    # The prior holds the cost model's coefficients object itself, not a copy...
    assert prior.coefficients is model.coefficients
    assert CostCoefficients is RooflineCoefficients and CostModelError is RooflineError
    # ...and both run the one step-time function.
    assert isinstance(model, Roofline)
    assert CostModel.decode_step_s is Roofline.decode_step_s
    assert CostModel.target_forward_s is Roofline.target_forward_s
    assert type(prior.roofline).decode_step_s is Roofline.decode_step_s
    assert (prior.topk, prior.num_draft_tokens, prior.speculative) == (4, 8, True)
    # The prior keeps no coefficient fields of its own.
    names = {f.name for f in dataclasses.fields(StepCostPrior)}
    assert names == {"coefficients", "speculative", "topk", "num_draft_tokens", "_roofline"}


@settings(max_examples=300, deadline=None)
@given(
    which=st.integers(0, len(MODELS) - 1),
    batch=st.floats(0.5, 600.0),
    steps=st.integers(0, MAX_STEPS),
    kv=st.integers(0, 3_000_000),
)
def test_terms_weighted_sum_is_the_step_time(which: int, batch: float, steps: int, kv: int) -> None:
    model = MODELS[which][1]
    terms = model.decode_step_terms(batch, steps, kv)
    total = math.fsum(w * t for w, t in zip(model.term_weights, terms, strict=True))
    assert total == pytest.approx(model.decode_step_s(batch, steps, kv), rel=1e-12)


@pytest.mark.parametrize("scale", [0.7, 1.4, 3.0])
def test_scaled_coefficients_scale_every_step_exactly(scale: float) -> None:
    for _, model in MODELS[:5]:
        scaled = Roofline(
            scaled_coefficients(model.coefficients, scale),
            speculative=model.speculative,
            topk=model.topk,
            num_draft_tokens=model.num_draft_tokens,
        )
        for b, k, kv in GRID:
            want = scale * model.decode_step_s(b, k, kv)
            assert scaled.decode_step_s(b, k, kv) == pytest.approx(want, rel=1e-12)
    assert scaled_coefficients(model.coefficients, 1.0) is model.coefficients
    for bad in (0.0, -1.0, float("nan"), float("inf"), True):
        with pytest.raises(RooflineError, match="scale"):
            scaled_coefficients(model.coefficients, bad)


def test_prior_round_trips_and_reads_states_saved_before_the_shared_roofline() -> None:
    model = CostModel.from_catalog(H100, LLAMA70, EAGLE3, tp_size=4)
    prior = step_cost_prior(model)
    restored = StepCostPrior.from_dict(prior.to_dict())
    assert restored == prior
    # Saved by the previous layout: flat, no tp_comm_fixed_s (folded into the fixed
    # overhead) and no attention_per_token_pair_s.
    legacy = prior.to_dict()
    legacy["fixed_overhead_s"] += legacy.pop("tp_comm_fixed_s")
    legacy.pop("attention_per_token_pair_s")
    old = StepCostPrior.from_dict(legacy)
    for b, k, kv in GRID[::7]:
        assert old.predict_s(b, k, kv) == pytest.approx(prior.predict_s(b, k, kv), rel=1e-12)
    with pytest.raises(PolicyTypeError, match="draft_step_overhead_s"):
        StepCostPrior.from_dict({**prior.to_dict(), "draft_step_overhead_s": "x"})


def test_default_prior_is_the_catalog_h100_prior_to_rounding() -> None:
    built = step_cost_prior(CostModel.from_catalog(H100, LLAMA8, EAGLE3))
    default = default_step_cost_prior()
    for name in RooflineCoefficients.field_names():
        if name == "attention_per_token_pair_s":
            continue  # prefill only: the decode prior leaves it 0
        assert getattr(default.coefficients, name) == pytest.approx(
            getattr(built.coefficients, name), rel=1e-12, abs=1e-18
        ), name


def test_bad_shapes_and_steps_name_the_argument() -> None:
    coef = CostModel.from_catalog(H100, LLAMA8, EAGLE3).coefficients
    with pytest.raises(RooflineError, match="topk must be an integer >= 1"):
        Roofline(coef, speculative=True, topk=0)
    with pytest.raises(RooflineError, match="needs a drafter"):
        Roofline(coef, speculative=False, topk=2, num_draft_tokens=4)
    with pytest.raises(RooflineError, match="coefficients: expected RooflineCoefficients"):
        Roofline(object(), speculative=True)  # type: ignore[arg-type]
    with pytest.raises(RooflineError, match=f"steps must be in 0..{MAX_STEPS}"):
        step_cost_prior(CostModel.from_catalog(H100, LLAMA8, EAGLE3)).predict_s(1, MAX_STEPS + 1, 0)
