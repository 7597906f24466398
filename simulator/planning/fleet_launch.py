"""SGLang launch flags for a fleet's replica kinds (through adapters.launch_config)."""

from __future__ import annotations

from typing import Any

from specgov.adapters.launch_config import (
    LaunchConfigError,
    SlotCandidates,
    build_launch_config,
    default_slots,
    make_shape,
)
from specgov.policies.common.types import SpecShape
from specgov.simulator.replay.runner import (
    SPECGOV_EMA_KNOBS,
    SPECGOV_SLOT_CANDIDATES,
    InEnginePolicy,
    ServerSpec,
)


def launch_args(
    policy: InEnginePolicy | None, *, algorithm: str, server: ServerSpec
) -> dict[str, Any]:
    """SGLang launch flags for one replica kind (``None``: a plain replica).

    Built through ``adapters.launch_config`` (the project's one launch-flag writer):
    ``static:K`` is a static shape, ``sglang-ema`` SGLang's default adaptive table,
    a daemon policy specgov's adaptive table (``replay.SPECGOV_SLOT_CANDIDATES``)
    plus the daemon running that policy.
    """
    daemon = None
    try:
        if policy is None or not policy.speculative:
            shape = SpecShape("NONE", 0, 0, 0, ())
            launch = build_launch_config(
                shape,
                mem_fraction_static=server.mem_fraction_static,
                max_running_requests=server.max_running_requests,
                rationale="plain replica: no speculation",
            )
        elif policy.daemon_spec is not None or policy.name == "sglang-ema":
            steps = server.spec_steps
            shape = make_shape(algorithm, steps, 1, steps + 1, f"policy {policy.name}")
            if policy.daemon_spec is not None:
                slots = tuple(
                    SlotCandidates.of(bound, ks, **SPECGOV_EMA_KNOBS)
                    for bound, ks in SPECGOV_SLOT_CANDIDATES
                )
                daemon = policy.name
            else:
                slots = default_slots()
            launch = build_launch_config(
                shape,
                slots,
                mem_fraction_static=server.mem_fraction_static,
                max_running_requests=server.max_running_requests,
                rationale=f"speculative replica, policy {policy.name}",
            )
        else:
            (k,) = policy.candidate_steps
            if k < 1:
                return {
                    "argv": [],
                    "adaptive_config": None,
                    "daemon_policy": None,
                    "error": f"{policy.name}: SGLang needs --speculative-num-steps >= 1; "
                    "step 0 only exists as an adaptive candidate",
                }
            shape = make_shape(algorithm, k, 1, k + 1, f"policy {policy.name}")
            launch = build_launch_config(
                shape,
                mem_fraction_static=server.mem_fraction_static,
                max_running_requests=server.max_running_requests,
                rationale=f"speculative replica, policy {policy.name}",
            )
    except LaunchConfigError as exc:
        return {"argv": [], "adaptive_config": None, "daemon_policy": None, "error": str(exc)}
    return {
        "argv": launch.to_argv(),
        "adaptive_config": launch.adaptive_config_json(),
        "daemon_policy": daemon,
        "error": None,
    }
