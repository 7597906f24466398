"""The SGLang launch configuration of a sweep row (``plan sweep``'s ``launch_*`` keys)."""

from __future__ import annotations

import shlex
from typing import TYPE_CHECKING, Any

from specgov.simulator.catalog import Catalog
from specgov.simulator.replay.runner import parse_policy

if TYPE_CHECKING:
    from specgov.simulator.planning.sweep import SweepSettings

__all__ = ["fill_launch", "hicache_flags"]


def hicache_flags(size_gb: int) -> list[str]:
    """SGLang's flags for a host cache tier of *size_gb* GB per GPU (none for 0)."""
    return ["--enable-hierarchical-cache", "--hicache-size", str(size_gb)] if size_gb else []


def fill_launch(row: dict[str, Any], settings: SweepSettings, catalog: Catalog) -> None:
    """Fill the row's SGLang launch configuration (adapters.launch_config): its flags,
    shell line, adaptive config and daemon policy, or why it cannot be launched. A row
    with a host cache tier gets SGLang's HiCache flags too."""
    from specgov.adapters.launch_config import (
        LaunchConfigError,
        SlotCandidates,
        build_launch_config,
        default_slots,
        make_shape,
        shape_from_flags,
    )
    from specgov.policies.common.types import SpecShape
    from specgov.simulator.replay.runner import SPECGOV_EMA_KNOBS, SPECGOV_SLOT_CANDIDATES

    policy = parse_policy(row["policy"])
    knobs: dict[str, Any] = {
        "mem_fraction_static": settings.mem_fraction_static,
        "max_running_requests": settings.max_running_requests,
    }
    try:
        if not policy.speculative:
            launch = build_launch_config(SpecShape("NONE", 0, 0, 0, ()), **knobs)
        else:
            algo = catalog.drafter(row["drafter"]).algorithm.upper()
            shape = row["shape"]
            if policy.adaptive:
                if policy.daemon_spec is not None:
                    slots = tuple(
                        SlotCandidates.of(bound, steps, **SPECGOV_EMA_KNOBS)
                        for bound, steps in SPECGOV_SLOT_CANDIDATES
                    )
                    row["daemon_policy"] = policy.name
                else:
                    slots = default_slots()
                union = sorted({k for slot in slots for k in slot.candidate_steps})
                spec_shape = shape_from_flags(
                    algo, settings.spec_steps, 1, None, adaptive_candidates=union
                )
                launch = build_launch_config(spec_shape, slots, **knobs)
            else:
                spec_shape = make_shape(
                    algo,
                    shape["steps"],
                    shape["topk"],
                    shape["num_draft_tokens"],
                    f"configuration {row['id']}",
                )
                launch = build_launch_config(spec_shape, **knobs)
    except LaunchConfigError as exc:
        row["launch_error"] = str(exc)
        return
    argv = launch.to_argv() + hicache_flags(int(row.get("hicache_size_gb") or 0))
    row["launch_args"] = argv
    row["launch_shell"] = shlex.join(argv)
    row["adaptive_config"] = launch.adaptive_config_json()
