"""What each policy kind is, for `specgov policy list` and the `--policy` help texts.

Offline: nothing here talks to a daemon, so an operator can read the kinds before one
runs. Every kind of ``specgov.policies.daemon.spec.KNOWN_KINDS`` has an entry (a test checks).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Final

# kind -> (example spec, one-line description)
DAEMON_KINDS: Final[dict[str, tuple[str, str]]] = {
    "none": ("none", "no speculation in any slot"),
    "static": ("static:3", "the same number of draft steps in every slot"),
    "sglang-ema": (
        "sglang-ema",
        "SGLang's built-in adaptive controller decides; specgov publishes nothing",
    ),
    "batch-table": (
        "batch-table:1=5,8=3,32=1,64=0",
        "a fixed schedule: batch size N and up uses K steps (TensorRT-LLM style)",
    ),
    "goodput": (
        "goodput[:slo_tpot_ms=40,...]",
        "model-based: per slot, the steps with the most expected goodput under the SLO, "
        "from online acceptance and step-cost estimates",
    ),
    "bandit": (
        "bandit[:algo=thompson,...]",
        "per-slot UCB/Thompson sampling on measured goodput, no cost model",
    ),
}

# Replay also runs the in-engine policies directly, and a clairvoyant yardstick.
REPLAY_ONLY_KINDS: Final[dict[str, tuple[str, str]]] = {
    "oracle": (
        "oracle",
        "clairvoyant yardstick (replay only): per batch, the best step given the true "
        "upcoming acceptance",
    ),
}


def spec_keys(kind: str) -> dict[str, Any]:
    """The keys a spec of ``kind`` takes, with their defaults (empty for fixed kinds)."""
    config: type | None = None
    if kind == "goodput":
        from specgov.policies.daemon.goodput import GoodputConfig

        config = GoodputConfig
    elif kind == "bandit":
        from specgov.policies.daemon.bandit import BanditConfig

        config = BanditConfig
    if config is None:
        return {}
    return {
        f.name: f.default
        for f in dataclasses.fields(config)
        if f.init and not f.name.startswith("_")
    }


def kinds_help(*, replay: bool) -> str:
    """ "none, static:K, ..." for a --policy help text."""
    kinds = dict(DAEMON_KINDS)
    if replay:
        kinds.update(REPLAY_ONLY_KINDS)
    return ", ".join(example for example, _ in kinds.values())


def kinds_rows() -> list[dict[str, Any]]:
    """One row per daemon policy kind: kind, example, description, keys with defaults."""
    return [
        {"kind": kind, "example": example, "description": text, "keys": spec_keys(kind)}
        for kind, (example, text) in DAEMON_KINDS.items()
    ]


__all__ = ["DAEMON_KINDS", "REPLAY_ONLY_KINDS", "kinds_help", "kinds_rows", "spec_keys"]
