"""Step-cost priors for the policies' estimators, from a simulator cost model.

``policies/`` may not import the simulator (layering, DESIGN.md), so the online
step-cost estimator starts from :class:`~specgov.policies.estimators.step_cost.StepCostPrior`,
plain floats; this module fills one from a :class:`~specgov.simulator.cost.CostModel`
(built from the catalog), so that before any data arrives the estimator predicts
exactly what the simulator's cost model charges for a decode step.
"""

from __future__ import annotations

from specgov.policies.estimators.step_cost import StepCostPrior
from specgov.simulator.cost import CostModel, CostModelError

__all__ = ["step_cost_prior"]


def step_cost_prior(cost_model: CostModel) -> StepCostPrior:
    """The decode-step part of ``cost_model`` as a :class:`StepCostPrior`.

    Tensor-parallel all-reduce costs fold into the fixed and per-token terms exactly
    as ``CostModel.decode_step_s`` adds them; prefill is not modelled (decode steps
    are what the step table governs).
    """
    if not isinstance(cost_model, CostModel):
        raise CostModelError(
            f"step_cost_prior: expected a simulator CostModel, got {type(cost_model).__name__}"
        )
    c = cost_model.coefficients
    return StepCostPrior(
        fixed_overhead_s=c.fixed_overhead_s + c.tp_comm_fixed_s,
        weight_read_s=c.weight_read_s,
        compute_per_token_s=c.compute_per_token_s,
        kv_read_per_token_s=c.kv_read_per_token_s,
        tp_comm_per_token_s=c.tp_comm_per_token_s,
        speculative=cost_model.speculative,
        draft_weight_read_s=c.draft_weight_read_s,
        draft_compute_per_token_s=c.draft_compute_per_token_s,
        draft_kv_read_per_token_s=c.draft_kv_read_per_token_s,
        draft_step_overhead_s=c.draft_step_overhead_s,
        draft_extend_overhead_s=c.draft_extend_overhead_s,
        spec_verify_overhead_s=c.spec_verify_overhead_s,
        spec_verify_per_token_s=c.spec_verify_per_token_s,
        draft_per_request_s=c.draft_per_request_s,
        roofline_exponent=c.roofline_exponent,
        topk=cost_model.topk,
        num_draft_tokens=cost_model.num_draft_tokens,
    )
