"""Two yardsticks for per-batch step choice: the clairvoyant and the informed oracle.

Both are benchmark yardsticks, not policies to deploy, and both pick, per decode batch,
``argmax tokens(k) / time(k)`` over the candidate steps (ties: the smaller ``k``), with
``time(k) = decode_step_s(batch, k, kv_used)`` from the engine's own cost model. Steps
whose verified tokens would not fit in the free KV pool are skipped while one fits
(choosing them would force a retraction, whose recompute the ratio does not see); when
none fits the smallest step is taken. They differ in what they know of ``tokens(k)``:

* ``ClairvoyantOracle`` (``--policy oracle``) knows every running request's true
  upcoming acceptance (``AcceptanceSampler.peek``: the draw the engine is about to make,
  looked at without consuming the random stream), so

      tokens(k) = sum over running requests of min(accepted_i(k) + 1, remaining_i).

  No realisable policy can know the draws; this is an upper bound on per-batch choice.
* ``InformedOracle`` (``--policy oracle:informed``) knows each running request's true
  acceptance *distribution* (its domain's per-depth pass rates under the server's draft
  shape as the verifies of each step see them, ``acceptance_verify``, and the output
  tokens it has left) but not the draws, so

      tokens(k) = sum over running requests of E[min(A_i(k) + 1, remaining_i)]
                = sum of 1 + sum_{j <= min(k, remaining_i - 1)} P(A_i >= j),

  what any per-batch policy that learned each domain's rates perfectly could reach.
  It ignores the short-term state the draws carry (burstiness, the AR(1) latent, a
  stale drafter's penalty): that is information only the draws reveal.

Both are myopic (each batch on its own; no look-ahead over future batches or arrivals),
deterministic (no randomness of their own) and change nothing another policy sees:
peeking leaves each request's stream as it is, and every run builds its own samplers.

Shares of an oracle's gain (``oracle_share``) are computed here once for the replay JSON
and the policy suite: ``(policy - none) / (oracle - none)``, reported only where the
oracle gains at least ``MIN_ORACLE_GAIN`` over ``none``. Where ``none`` beats an oracle
(saturation: even step 0 pays the drafter), no step table reaches ``none`` and the
ceiling is the fleet's, ``max(oracle, none)``: restart without speculation.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from specgov.policies.common.errors import SpecgovError
from specgov.policies.common.validation import is_int
from specgov.simulator.engine.acceptance import AcceptanceModel
from specgov.simulator.engine.acceptance_verify import VerifyRates

if TYPE_CHECKING:
    from specgov.simulator.engine.interface import EngineConfig, StepCost

__all__ = [
    "CLAIRVOYANT",
    "INFORMED",
    "MIN_ORACLE_GAIN",
    "ORACLE_NAMES",
    "ClairvoyantOracle",
    "InformedOracle",
    "OracleError",
    "ceiling",
    "oracle_share",
]

# The replay policy names of the two oracles (``specgov replay --policy NAME``).
CLAIRVOYANT = "oracle"
INFORMED = "oracle:informed"
ORACLE_NAMES = (CLAIRVOYANT, INFORMED)
# Below this relative gain of an oracle over none, shares of it are not reported: there
# is no gain to share (an unsaturated server serves every arrival whatever the steps).
MIN_ORACLE_GAIN = 0.01


class OracleError(SpecgovError, ValueError):
    """The oracle was set up wrongly (bad candidates, used outside an engine)."""


def oracle_share(value: Any, none: Any, oracle: Any) -> float | None:
    """(value - none) / (oracle - none); None without a gain of MIN_ORACLE_GAIN to share."""
    if value is None or none is None or oracle is None or not none:
        return None
    gain = float(oracle) - float(none)
    if gain < MIN_ORACLE_GAIN * float(none):
        return None
    return (float(value) - float(none)) / gain


def ceiling(none: float, oracle: float) -> tuple[float, str]:
    """The fleet-level ceiling ``max(oracle, none)`` and which one it is: where ``none``
    beats the oracle no step table gets there; a restart without speculation does."""
    return (oracle, "oracle") if oracle >= none else (none, "none")


@runtime_checkable
class DomainRates(Protocol):
    """What the informed oracle reads of the acceptance model (``AcceptanceModel``)."""

    def depth_rates(self, domain: str | None, steps: int) -> tuple[float, ...]: ...


@dataclass(frozen=True, slots=True)
class OracleBatch:
    """What an oracle sees of one decode batch: the steps it may pick, each request's
    peek at its next draw, its remaining output tokens and its domain."""

    steps: Sequence[int]
    peeks: Sequence[Callable[[int], int]]
    remaining: Sequence[int]
    domains: Sequence[str | None]
    chain: bool


class _PerBatchOracle(ABC):
    """In-engine policy (``AdaptiveSpecPolicy`` + the engine's ``BatchOracle`` hook):
    the argmax of ``tokens(k) / time(k)`` per batch; subclasses say what ``tokens`` is."""

    name = ""

    def __init__(self, candidate_steps: Sequence[int], initial_steps: int | None = None) -> None:
        steps = sorted(set(candidate_steps))
        if not steps or any(not is_int(k) or k < 0 for k in steps):
            raise OracleError(
                f"oracle candidate_steps: expected non-negative ints, got {list(candidate_steps)!r}"
            )
        if initial_steps is not None and initial_steps not in steps:
            raise OracleError(f"oracle initial_steps {initial_steps!r} is not in {steps}")
        self._steps = steps
        self._choice = initial_steps if initial_steps is not None else steps[0]
        self._cuda_graph_bs: list[int] | None = None
        self._cost: StepCost | None = None
        self._config: EngineConfig | None = None
        self._batch_size = -1  # the batch the last observe_batch described
        self.decisions = 0

    # ----------------------------------------------------------- AdaptiveSpecPolicy

    @property
    def candidate_steps(self) -> list[int]:
        return list(self._steps)

    def set_cuda_graph_bs(self, cuda_graph_bs: list[int] | None) -> None:
        self._cuda_graph_bs = sorted(cuda_graph_bs) if cuda_graph_bs else None

    def cuda_graph_bs_for_step(self, step: int) -> list[int] | None:
        """Every captured batch size for every step: the oracle may pick any anywhere."""
        if self._cuda_graph_bs is None:
            return None
        return list(self._cuda_graph_bs) if step in self._steps else []

    def get_steps_for_batch(self, batch_size: int) -> int:
        if self._batch_size >= 0 and batch_size != self._batch_size:
            # The engine describes each decode batch first; a mismatch means a caller
            # other than the engine, which would get a stale answer.
            raise OracleError(
                f"oracle asked for batch {batch_size} but shown a batch of {self._batch_size}"
            )
        return self._choice

    def on_verify_complete(
        self, num_correct_drafts_per_req: list[int], batch_size: int
    ) -> int | None:
        self._batch_size = -1
        return None

    # --------------------------------------------------------------- BatchOracle hook

    def bind_engine(self, cost: StepCost, config: EngineConfig, acceptance: object = None) -> None:
        self._cost = cost
        self._config = config

    def observe_batch(
        self,
        peeks: Sequence[Callable[[int], int]],
        remaining_tokens: Sequence[int],
        kv_used_tokens: int,
        domains: Sequence[str | None] = (),
    ) -> None:
        cost, cfg = self._cost, self._config
        if cost is None or cfg is None:
            raise OracleError("oracle: observe_batch before bind_engine (run it in an Engine)")
        bsz = len(peeks)
        self._batch_size = bsz
        if bsz == 0:
            return
        free = cfg.kv_token_capacity - kv_used_tokens
        steps = [
            k for k in self._steps if bsz == 1 or bsz * cfg.verify_tokens_per_request(k) <= free
        ]
        if not steps:
            self._choice = self._steps[0]
            self.decisions += 1
            return
        tokens = self._tokens(
            OracleBatch(steps, peeks, remaining_tokens, domains, chain=cfg.topk == 1)
        )
        best_k = steps[0]
        best = -1.0
        for k in steps:
            rate = tokens[k] / cost.decode_step_s(bsz, k, kv_used_tokens)
            if rate > best:  # strict: ties keep the smaller step
                best, best_k = rate, k
        self._choice = best_k
        self.decisions += 1

    @abstractmethod
    def _tokens(self, batch: OracleBatch) -> dict[int, float]:
        """Tokens the batch emits at each of ``batch.steps`` (bonus token included)."""


class ClairvoyantOracle(_PerBatchOracle):
    """Per batch, the best step given each running request's true next draw."""

    name = CLAIRVOYANT

    def _tokens(self, batch: OracleBatch) -> dict[int, float]:
        """Tokens the batch emits at each step (bonus token included, capped by output)."""
        steps, peeks, remaining = batch.steps, batch.peeks, batch.remaining
        bsz = len(peeks)
        out: dict[int, float] = {}
        if not batch.chain:
            # Trees: per-depth pass rates depend on the shape at each step; peek each.
            for k in steps:
                total = 0
                for peek, rem in zip(peeks, remaining, strict=True):
                    a = peek(k) + 1
                    total += a if a < rem else rem
                out[k] = total
            return out
        # Chains: accepted(k) = min(accepted(k_max), k), one peek per request.
        k_max = steps[-1]
        hist = [0] * (k_max + 1)  # requests by extra tokens they can take, capped at k_max
        for peek, rem in zip(peeks, remaining, strict=True):
            c = peek(k_max) if k_max > 0 else 0
            if c > rem - 1:
                c = max(rem - 1, 0)
            hist[c] += 1
        for k in steps:
            # sum_i min(c_i, k) = sum over c of hist[c] * min(c, k)
            out[k] = bsz + sum(n * (c if c < k else k) for c, n in enumerate(hist))
        return out


class InformedOracle(_PerBatchOracle):
    """Per batch, the best step given each running request's acceptance distribution."""

    name = INFORMED

    def __init__(self, candidate_steps: Sequence[int], initial_steps: int | None = None) -> None:
        super().__init__(candidate_steps, initial_steps)
        self._rates: DomainRates | None = None
        # (domain, k) -> prefix[c] = 1 + sum_{j <= c} P(A >= j), c = 0..k (expected tokens
        # of a request that can take at most c extra tokens).
        self._prefix: dict[tuple[str | None, int], list[float]] = {}

    def bind_engine(self, cost: StepCost, config: EngineConfig, acceptance: object = None) -> None:
        if isinstance(acceptance, AcceptanceModel):
            # The rates verifies at each step see, not the all-position profile rates
            # (visited positions, runs, per-request levels: ``acceptance_verify``).
            acceptance = VerifyRates(acceptance)
        if not isinstance(acceptance, DomainRates):
            raise OracleError(
                "oracle:informed needs the engine's acceptance model (per-domain depth_rates)"
            )
        super().bind_engine(cost, config)
        self._rates = acceptance
        self._prefix = {}

    def _prefix_for(self, domain: str | None, k: int) -> list[float]:
        key = (domain, k)
        hit = self._prefix.get(key)
        if hit is not None:
            return hit
        assert self._rates is not None  # bound in bind_engine
        out = [1.0]
        reach = 1.0
        for a in self._rates.depth_rates(domain, k) if k > 0 else ():
            reach *= a
            out.append(out[-1] + reach)
        out.extend([out[-1]] * (k + 1 - len(out)))  # a tree's depth cut by its node budget
        self._prefix[key] = out
        return out

    def _tokens(self, batch: OracleBatch) -> dict[int, float]:
        """Expected tokens the batch emits at each step (bonus included, capped)."""
        steps, remaining, domains = batch.steps, batch.remaining, batch.domains
        if len(domains) != len(remaining):
            raise OracleError(
                f"oracle:informed: {len(domains)} domains for a batch of {len(remaining)}"
            )
        k_max = steps[-1]
        # Requests by (domain, extra tokens they can take, capped at k_max): a batch has
        # few domains, and most requests have more than k_max tokens left.
        groups: dict[tuple[str | None, int], int] = {}
        for domain, rem in zip(domains, remaining, strict=True):
            c = rem - 1 if rem - 1 < k_max else k_max
            key = (domain, c if c > 0 else 0)
            groups[key] = groups.get(key, 0) + 1
        out: dict[int, float] = {}
        for k in steps:
            total = 0.0
            for (domain, c), n in groups.items():
                total += n * self._prefix_for(domain, k)[c if c < k else k]
            out[k] = total
        return out


def oracle_report(summaries: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """Each oracle's share and the fleet ceiling, from one replay's policy summaries.

    Sets ``oracle_share`` (one entry per oracle that ran: the share of its goodput gain
    over ``none``, None where there is no gain to share or no ``none`` run) on every
    summary, and returns the report's ``ceiling`` object: per oracle its goodput, its gain
    over ``none`` and the fleet-level ceiling ``max(oracle, none)``, naming ``none``
    wherever it beats the oracle. None when no oracle ran.
    """
    by_name = {s["name"]: s for s in summaries}
    oracles = [name for name in ORACLE_NAMES if name in by_name]
    if not oracles:
        return None
    none = by_name.get("none")
    base = None if none is None else float(none["goodput_tok_s"])
    for s in summaries:
        s["oracle_share"] = {
            name: oracle_share(s["goodput_tok_s"], base, by_name[name]["goodput_tok_s"])
            for name in oracles
        }
    entries: dict[str, Any] = {}
    for name in oracles:
        value = float(by_name[name]["goodput_tok_s"])
        entry: dict[str, Any] = {"goodput_tok_s": value}
        if base is not None:
            top, which = ceiling(base, value)
            entry.update(
                gain_over_none=value / base - 1.0 if base > 0 else None,
                fleet_ceiling_tok_s=top,
                fleet_ceiling=name if which == "oracle" else "none",
            )
            if which == "none":
                entry["note"] = (
                    "none beats this oracle: no step table reaches it (step 0 still pays the "
                    "drafter); the ceiling is a server restarted without speculation"
                )
        entries[name] = entry
    return {
        "metric": "goodput_tok_s",
        "none_goodput_tok_s": base,
        "oracles": entries,
        "note": None if base is not None else "shares need a 'none' run beside the oracle",
    }
