"""Online estimators the model-based policies learn with (pure: numpy + SciPy).

* :mod:`.acceptance` — per slot, per draft position conditional acceptance from the engine's
accepted-draft histograms (censoring, decay, change detection, Beta posteriors, pooling across
slots). * :mod:`.step_cost` — decode step wall time versus batch size, steps and KV tokens: a
roofline prior plus a robust, monotone correction fitted by non-negative least squares (SciPy);
the API, with :mod:`.step_cost_prior`, :mod:`.step_cost_samples` and :mod:`.step_cost_fit`
behind it. Queries read a :class:`StepCostModel` (one per state, ``step_cost_model``).

Both keep a versioned, serialisable state (``to_dict`` / ``from_dict``).
"""

from specgov.policies.daemon.estimators.acceptance import (
    ACCEPTANCE_STATE_VERSION,
    AcceptanceConfig,
    AcceptanceEstimate,
    AcceptanceState,
    SlotAcceptance,
    acceptance_estimate,
    initial_acceptance_state,
    update_acceptance,
)
from specgov.policies.daemon.estimators.step_cost import (
    FEATURE_NAMES,
    STEP_COST_STATE_VERSION,
    StepCostConfig,
    StepCostModel,
    StepCostPrior,
    StepCostState,
    StepSample,
    cost_evidence,
    default_step_cost_prior,
    initial_step_cost_state,
    local_step_s,
    predict_step_s,
    step_cost_bounds,
    step_cost_model,
    update_step_cost,
)

__all__ = [
    "ACCEPTANCE_STATE_VERSION",
    "FEATURE_NAMES",
    "STEP_COST_STATE_VERSION",
    "AcceptanceConfig",
    "AcceptanceEstimate",
    "AcceptanceState",
    "SlotAcceptance",
    "StepCostConfig",
    "StepCostModel",
    "StepCostPrior",
    "StepCostState",
    "StepSample",
    "acceptance_estimate",
    "cost_evidence",
    "default_step_cost_prior",
    "initial_acceptance_state",
    "initial_step_cost_state",
    "local_step_s",
    "predict_step_s",
    "step_cost_bounds",
    "step_cost_model",
    "update_acceptance",
    "update_step_cost",
]
