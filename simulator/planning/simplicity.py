"""Plans never recommend what saves nothing: ties go to the simpler configuration.

Both plans (``plan sweep``, ``plan fleet``) rank by cost (or replicas / GPUs) first;
between configurations that cost the same, the simpler one wins, in this order:

0. the plain server (no speculation);
1. static speculation (one step, ``static:K``);
2. SGLang's in-engine adaptive speculation (``sglang-ema``: a launch flag, no process);
3. a daemon policy (``goodput``, ...: specgov's daemon beside every server).

A speculative configuration is recommended only when it *pays* against the plain
server on the same GPU, and the plan says which way (``speculation_verdict``):

* ``replicas``: it needs fewer replicas than the plain server would even at the top of
  the plain server's search bracket (the sweep's resolution: the true limit lies
  between the highest rate seen to pass and the lowest seen to fail), so the saving is
  not an artefact of the search tolerance; on one GPU the cost follows the replicas;
* ``slo``: the plain server meets the SLO at no swept rate and the speculative one does.

A speculative row that does not pay is ranked at the plain server's cost, so the plain
server (simpler) wins the tie.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from specgov.simulator.replay.runner import PolicySpecError, parse_policy

__all__ = [
    "PAYS_TPOT_SLOS_MS",
    "PLAIN",
    "complexity",
    "pays_curve",
    "policy_complexity",
    "speculation_crossing_ms",
    "speculation_verdict",
    "upper_rps",
]

# The TPOT SLOs of the "when speculation pays" curve (ms).
PAYS_TPOT_SLOS_MS = tuple(float(x) for x in range(10, 101, 5))

PLAIN = 0
_STATIC = 1
_IN_ENGINE_ADAPTIVE = 2
_DAEMON = 3
LEVEL_NAMES = {
    PLAIN: "plain",
    _STATIC: "static speculation",
    _IN_ENGINE_ADAPTIVE: "SGLang's adaptive speculation",
    _DAEMON: "a daemon policy",
}


def policy_complexity(policy: str) -> int:
    """How much a speculative *policy* asks of the operator (module docstring order)."""
    try:
        parsed = parse_policy(policy)
    except PolicySpecError:
        return _DAEMON  # unknown here: rank it as the most demanding
    if not parsed.speculative:
        return PLAIN
    if parsed.daemon_spec is not None:
        return _DAEMON
    return _IN_ENGINE_ADAPTIVE if parsed.adaptive else _STATIC


def complexity(row: Mapping[str, Any]) -> int:
    """A sweep row's or a fleet row's complexity: plain rows (drafter ``none``, or a
    fleet without speculative replicas) are 0, others their policy's."""
    if row.get("drafter") == "none" or row.get("speculative_replicas") == 0:
        return PLAIN
    return policy_complexity(str(row.get("policy", "")))


def upper_rps(row: Mapping[str, Any]) -> float:
    """The top of a row's search bracket: the lowest rate seen to fail above its
    highest passing rate (inf when it passed at the search cap)."""
    best = float(row["max_rps"])
    failing = [
        float(p["rps"]) for p in row.get("curve") or () if not p["passed"] and p["rps"] > best
    ]
    return min(failing) if failing else math.inf


def speculation_verdict(
    row: Mapping[str, Any], plain: Mapping[str, Any] | None, *, target_rps: float
) -> dict[str, Any]:
    """Whether a speculative sweep row pays against the plain row of its GPU, and why
    (``{"pays": bool, "because": "replicas" | "slo" | None, "detail": str}``)."""
    if plain is None or plain.get("status") != "ok":
        if plain is not None and plain.get("status") == "slo-unmet":
            return {
                "pays": True,
                "because": "slo",
                "detail": "meets the SLO, which the plain server meets at no swept rate",
            }
        return {
            "pays": True,
            "because": "slo",
            "detail": "the plain server cannot run here",
        }
    replicas = int(row["replicas"])
    plain_replicas = int(plain["replicas"])
    top = upper_rps(plain)
    plain_best_case = math.ceil(target_rps / top - 1e-9) if math.isfinite(top) else 1
    if replicas < plain_best_case:
        saved = plain_replicas - replicas
        return {
            "pays": True,
            "because": "replicas",
            "detail": f"saves {saved} replica(s): {replicas} instead of {plain_replicas} plain",
        }
    if replicas < plain_replicas:
        why = (
            f"{replicas} replica(s) against the plain server's {plain_replicas}, but the plain "
            f"server's limit lies up to {top:.3g} req/s (the search bracket), where it would "
            f"need {plain_best_case}: within the sweep's resolution (narrow it with --rel-tol)"
        )
    else:
        why = f"{replicas} replica(s), as many as the plain server"
    return {"pays": False, "because": None, "detail": f"saves nothing: {why}"}


def pays_curve(
    row: Mapping[str, Any],
    tpot_slos_ms: tuple[float, ...] = PAYS_TPOT_SLOS_MS,
    *,
    ttft_ms: float | None = None,
) -> list[float]:
    """Per TPOT SLO, the highest request rate one replica of *row* was seen to sustain:
    the highest evaluated rate (the sweep's curve) whose TPOT percentile is within that
    SLO, with no abort and the TTFT percentile within *ttft_ms* (when given); 0 when no
    evaluated rate qualifies. Read from the search's evaluated rates, so a step curve
    whose resolution is the search's, not a new simulation."""
    out: list[float] = []
    points = [p for p in row.get("curve") or () if isinstance(p, Mapping)]
    for slo in tpot_slos_ms:
        best = 0.0
        for p in points:
            tpot, ttft, rps = p.get("tpot_ms"), p.get("ttft_ms"), p.get("rps")
            if not isinstance(rps, int | float) or p.get("aborted"):
                continue
            if tpot is not None and tpot > slo:
                continue
            if ttft_ms is not None and (ttft is None or ttft > ttft_ms):
                continue
            best = max(best, float(rps))
        out.append(best)
    return out


def speculation_crossing_ms(
    plain: Sequence[float], spec: Sequence[float], tpot_slos_ms: Sequence[float]
) -> float | None:
    """The loosest TPOT SLO at which the speculative curve still sustains more than the
    plain one (speculation pays at this SLO and tighter); None if it never does."""
    crossing = None
    for slo, p, s in zip(tpot_slos_ms, plain, spec, strict=True):
        if s > p:
            crossing = slo
    return crossing
