"""Step-cost priors for the policies' estimators, from a simulator cost model.

``policies/`` may not import the simulator (layering, DESIGN.md), so the roofline
formula and its coefficients live in ``specgov.policies.common.roofline``; the simulator's
:class:`~specgov.simulator.engine.cost.CostModel` is a ``Roofline`` and the estimator's
:class:`~specgov.policies.daemon.estimators.step_cost.StepCostPrior` holds the same
coefficients object, so before any data arrives the estimator predicts exactly what
the simulated GPU charges for a decode step.

Replays can also hand the policy a *wrong* prior on purpose (honest evaluation: a real
deployment's prior is never exact) while the simulated truth stays the catalog's:
:func:`replay_step_cost_prior` scales it (``--prior-scale``) or builds it for another
GPU of the catalog (``--prior-gpu``: a wrong knee, not only a wrong scale).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from specgov.policies.common.errors import SpecgovError
from specgov.policies.common.roofline import scaled_coefficients
from specgov.policies.common.validation import is_real
from specgov.policies.daemon.estimators.step_cost import StepCostPrior
from specgov.simulator.catalog import Catalog, CatalogError
from specgov.simulator.engine.cost import CostModel, CostModelError

__all__ = [
    "PriorOptionError",
    "check_prior_options",
    "replay_step_cost_prior",
    "step_cost_prior",
]


class PriorOptionError(SpecgovError, ValueError):
    """A wrong-prior option (``prior_scale`` / ``prior_gpu``) is invalid; names the option."""


def step_cost_prior(cost_model: CostModel) -> StepCostPrior:
    """The decode-step part of ``cost_model`` as a :class:`StepCostPrior`.

    The prior holds ``cost_model.coefficients`` itself and the same step shape, so
    ``prior.predict_s`` runs the code ``cost_model.decode_step_s`` runs. Prefill is
    not modelled (decode steps are what the step table governs).
    """
    if not isinstance(cost_model, CostModel):
        raise CostModelError(
            f"step_cost_prior: expected a simulator CostModel, got {type(cost_model).__name__}"
        )
    return StepCostPrior(
        coefficients=cost_model.coefficients,
        speculative=cost_model.speculative,
        topk=cost_model.topk,
        num_draft_tokens=cost_model.num_draft_tokens,
    )


def check_prior_options(
    prior_scale: object, prior_gpu: object, catalog_files: Sequence[Path] = ()
) -> None:
    """Raise :class:`PriorOptionError` naming the option unless both are valid.

    ``prior_scale`` must be a finite number > 0; ``prior_gpu`` None or a GPU name of
    the catalog (with ``catalog_files``), the message lists the valid names.
    """
    if not is_real(prior_scale) or prior_scale <= 0:
        raise PriorOptionError(
            f"prior_scale (--prior-scale): expected a finite number > 0, got {prior_scale!r}"
        )
    if prior_gpu is None:
        return
    catalog = Catalog.load(tuple(catalog_files))
    try:
        # The lookup --gpu uses: names and aliases, case-insensitive.
        catalog.gpu(prior_gpu)  # type: ignore[arg-type]
    except CatalogError:
        raise PriorOptionError(
            f"prior_gpu (--prior-gpu): unknown GPU {prior_gpu!r}; valid: "
            f"{', '.join(catalog.gpu_names())} (or an alias, see `specgov catalog show`)"
        ) from None


def replay_step_cost_prior(
    cost: CostModel,
    *,
    model: str,
    drafter: str | None,
    prior_scale: float = 1.0,
    prior_gpu: str | None = None,
    catalog_files: Sequence[Path] = (),
) -> StepCostPrior:
    """The prior a replayed policy starts from, exact or wrong on purpose.

    ``cost`` is the simulated truth. ``prior_gpu`` (not None) builds the prior from the
    catalog's cost model of that GPU for the same ``model`` and ``drafter`` (None when
    the server runs without one) and the same step shape; ``prior_scale`` then
    multiplies every coefficient, so the prior believes every step costs
    ``prior_scale`` times what it would otherwise predict. With the defaults this is
    :func:`step_cost_prior` of ``cost`` (the same coefficients object).
    """
    check_prior_options(prior_scale, prior_gpu, catalog_files)
    if not isinstance(cost, CostModel):
        raise CostModelError(
            f"replay_step_cost_prior: expected a simulator CostModel, got {type(cost).__name__}"
        )
    base = cost
    if prior_gpu is not None:
        catalog = Catalog.load(tuple(catalog_files))
        base = CostModel.from_catalog(
            catalog.gpu(prior_gpu),
            catalog.model(model),
            catalog.drafter(drafter) if cost.speculative and drafter is not None else None,
            topk=cost.topk,
            num_draft_tokens=cost.num_draft_tokens,
        )
    prior = step_cost_prior(base)
    if prior_scale == 1.0:
        return prior
    return StepCostPrior(
        coefficients=scaled_coefficients(prior.coefficients, float(prior_scale)),
        speculative=prior.speculative,
        topk=prior.topk,
        num_draft_tokens=prior.num_draft_tokens,
    )
