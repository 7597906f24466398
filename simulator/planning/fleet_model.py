"""Predicted seconds per output token by batch size, speculative against plain.

What the ``spec-aware`` router scores replicas with and where the plan says
speculation stops paying: the cost model's decode step and the acceptance
profile's expected accept length, per candidate step the policy has at each
batch size.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from specgov.adapters.launch_config import default_slots
from specgov.simulator.engine.acceptance import AcceptanceModel
from specgov.simulator.engine.cost import CostModel
from specgov.simulator.replay.runner import SPECGOV_SLOT_CANDIDATES, InEnginePolicy


@dataclass(frozen=True)
class PerTokenTables:
    """Predicted decode seconds per output token at 1..B active requests, per kind.

    ``speculative[b-1]``: the best step among the candidates the policy has at batch
    ``b`` (its slot, after CUDA-graph padding), ``T_spec(b, k) / E[L(k)]``;
    ``plain[b-1]``: ``T_plain(b)``. KV read ``b x`` the trace's mean context. Each
    table runs to its kind's runnable batch (running cap, and the KV pool over the
    mean request footprint). ``pays_up_to``: the largest b with the speculative
    step faster per token at every batch up to b (0: never). Estimates: E[L] from
    the acceptance profile's rates weighted over the trace's domains (realised
    acceptance under burstiness is lower, REFERENCE §3), prefill interference not
    counted.
    """

    speculative: tuple[float, ...]
    plain: tuple[float, ...]
    pays_up_to: int


def slot_candidates(
    policy: InEnginePolicy, graph_bs: Sequence[int] | None
) -> Callable[[int], tuple[int, ...]]:
    """Batch size -> the candidate steps *policy*'s server has at that batch size."""
    if policy.daemon_spec is not None:
        table = dict(SPECGOV_SLOT_CANDIDATES)
    elif policy.name == "sglang-ema":
        table = {s.bound: s.candidate_steps for s in default_slots()}
    else:
        fixed = tuple(policy.candidate_steps)
        return lambda _b: fixed
    bounds = sorted(table)
    graphs = sorted(graph_bs) if graph_bs else []

    def at(batch: int) -> tuple[int, ...]:
        # SGLang pads to the next CUDA-graph batch size, then takes the largest slot <= it.
        j = bisect.bisect_left(graphs, batch)
        padded = graphs[j] if j < len(graphs) else batch
        k = bisect.bisect_right(bounds, padded) - 1
        return table[bounds[max(0, k)]]

    return at


def per_token_tables(
    spec_cost: CostModel,
    plain_cost: CostModel,
    acceptance: AcceptanceModel,
    candidates_at: Callable[[int], Sequence[int]],
    *,
    context_tokens: float,
    domain_weights: Mapping[str | None, float],
    spec_max_batch: int,
    plain_max_batch: int,
) -> PerTokenTables:
    total_w = sum(domain_weights.values())
    accept: dict[int, float] = {0: 1.0}

    def mean_accept(k: int) -> float:
        if k not in accept:
            accept[k] = (
                sum(w * acceptance.expected_accept_length(d, k) for d, w in domain_weights.items())
                / total_w
            )
        return accept[k]

    spec = tuple(
        min(
            spec_cost.decode_step_s(b, k, b * context_tokens) / mean_accept(k)
            for k in candidates_at(b)
        )
        for b in range(1, spec_max_batch + 1)
    )
    plain = tuple(
        plain_cost.decode_step_s(b, 0, b * context_tokens) for b in range(1, plain_max_batch + 1)
    )
    pays = 0
    for b in range(1, min(spec_max_batch, plain_max_batch) + 1):
        if spec[b - 1] >= plain[b - 1]:
            break
        pays = b
    return PerTokenTables(spec, plain, pays)
