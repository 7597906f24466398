"""Routers of a simulated fleet: which replica gets each arriving request.

A router sees what a real gateway sees: the requests it has sent to each replica
and not yet seen finish (SGLang's model gateway, smg, tracks exactly this per
worker: ``smg_worker_requests_active``), and whether a replica speculates (its
labels). It does not see inside a forward: ``ReplicaLoad.in_flight`` counts a
request as active until the forward that emits its last token has ended.

* ``round-robin`` - replicas in turn, whatever their load (smg ``round_robin``).
* ``least-loaded`` - the replica with the fewest active requests, ties to the
  lowest index (the full-information version of smg's ``power_of_two``).
* ``spec-aware`` - least *predicted time per token* instead of least requests:
  each replica is scored by the seconds per output token its kind's decode step
  would take with one more active request (for a speculative replica, its best
  step among the candidates its policy has at that batch size, divided by the
  expected accept length; for a plain replica, the plain step), from tables the
  fleet planner computes with the cost and acceptance models
  (``fleet.per_token_tables``). So work goes to speculative replicas while their
  batch stays where speculation pays, and to plain ones once it no longer does.
  Past a kind's runnable batch (running cap, KV pool) a request only queues: the
  score grows with the queue. On a homogeneous fleet it routes as least-loaded.
* ``spec-aware:B`` - the rule a gateway can apply without a model: speculative
  replicas first while the least-loaded one would hold at most B active
  requests, then least-loaded over all replicas with ties to plain ones.

Every router is deterministic: same loads in, same choice out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from specgov.policies.common.errors import SpecgovError
from specgov.policies.common.validation import is_int

ROUTER_NAMES = ("round-robin", "least-loaded", "spec-aware")
ROUTER_FORMS = "round-robin, least-loaded, spec-aware or spec-aware:B (B an integer >= 1)"


class RouterSpecError(SpecgovError, ValueError):
    """A router name could not be understood; the message gives the valid forms."""


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    """One replica as the router sees it at an arrival."""

    index: int
    speculative: bool
    in_flight: int  # sent and not yet finished (queued + running)


class Router(Protocol):
    name: str

    def choose(self, loads: Sequence[ReplicaLoad]) -> int:
        """The index (into *loads*) of the replica that gets the next request."""
        ...


class RoundRobin:
    def __init__(self) -> None:
        self.name = "round-robin"
        self._next = 0

    def choose(self, loads: Sequence[ReplicaLoad]) -> int:
        i = self._next % len(loads)
        self._next = i + 1
        return i


def _least_loaded(loads: Sequence[ReplicaLoad], *, prefer_plain: bool = False) -> int:
    # Key: (active requests, speculative-first-or-last, index): deterministic ties.
    best = min(
        range(len(loads)),
        key=lambda i: (loads[i].in_flight, loads[i].speculative if prefer_plain else False, i),
    )
    return best


class LeastLoaded:
    def __init__(self) -> None:
        self.name = "least-loaded"

    def choose(self, loads: Sequence[ReplicaLoad]) -> int:
        return _least_loaded(loads)


class SpecAwareBound:
    """``spec-aware:B``: fill speculative replicas up to B active requests each."""

    def __init__(self, max_batch: int) -> None:
        if not is_int(max_batch) or max_batch < 1:
            raise RouterSpecError(f"spec-aware: the batch bound must be >= 1, got {max_batch!r}")
        self.max_batch = max_batch
        self.name = f"spec-aware:{max_batch}"

    def choose(self, loads: Sequence[ReplicaLoad]) -> int:
        spec = [load for load in loads if load.speculative]
        if spec and len(spec) < len(loads):
            best = min(spec, key=lambda load: (load.in_flight, load.index))
            if best.in_flight + 1 <= self.max_batch:
                return loads.index(best)
            return _least_loaded(loads, prefer_plain=True)
        return _least_loaded(loads)


def _score(table: Sequence[float], active: int) -> float:
    """Seconds per token at *active* requests; past the table a request only queues."""
    n = len(table)
    if active <= n:
        return table[active - 1]
    return table[-1] * active / n


class SpecAware:
    """Least predicted seconds per token with one more request (module docstring)."""

    def __init__(self, spec_s_per_token: Sequence[float], plain_s_per_token: Sequence[float]):
        for label, table in (("speculative", spec_s_per_token), ("plain", plain_s_per_token)):
            if not table or not all(t > 0 for t in table):
                raise RouterSpecError(
                    f"spec-aware: the {label} per-token table must be non-empty and positive"
                )
        self.name = "spec-aware"
        self._spec = tuple(spec_s_per_token)
        self._plain = tuple(plain_s_per_token)

    def score(self, load: ReplicaLoad) -> float:
        return _score(self._spec if load.speculative else self._plain, load.in_flight + 1)

    def choose(self, loads: Sequence[ReplicaLoad]) -> int:
        return min(
            range(len(loads)),
            key=lambda i: (self.score(loads[i]), loads[i].in_flight, loads[i].index),
        )


@dataclass(frozen=True)
class RouterSpec:
    """A parsed router name; ``build`` makes a fresh (stateful) router per simulation."""

    kind: str
    max_batch: int | None = None  # spec-aware:B only; None: the model-based router

    @property
    def name(self) -> str:
        if self.kind == "spec-aware" and self.max_batch is not None:
            return f"spec-aware:{self.max_batch}"
        return self.kind

    def build(
        self,
        tables: tuple[Sequence[float], Sequence[float]] | None = None,
    ) -> Router:
        """A fresh router; model-based ``spec-aware`` needs the (speculative, plain)
        seconds-per-token tables."""
        if self.kind == "round-robin":
            return RoundRobin()
        if self.kind == "least-loaded":
            return LeastLoaded()
        if self.max_batch is not None:
            return SpecAwareBound(self.max_batch)
        if tables is None:
            raise RouterSpecError("spec-aware needs per-token tables for both replica kinds")
        return SpecAware(*tables)


def parse_router(text: str) -> RouterSpec:
    raw = text.strip()
    kind, sep, arg = raw.partition(":")
    kind = kind.strip().lower()
    if kind not in ROUTER_NAMES:
        raise RouterSpecError(f"unknown router {raw!r}; expected {ROUTER_FORMS}")
    if kind != "spec-aware":
        if sep:
            raise RouterSpecError(f"router {raw!r}: {kind} takes no argument")
        return RouterSpec(kind)
    if not sep:
        return RouterSpec(kind)
    try:
        bound = int(arg.strip())
    except ValueError:
        raise RouterSpecError(
            f"router {raw!r}: expected spec-aware:B with B an integer >= 1, got {arg!r}"
        ) from None
    if bound < 1:
        raise RouterSpecError(f"router {raw!r}: B must be >= 1, got {bound}")
    return RouterSpec(kind, bound)


def parse_routers(text: str) -> tuple[RouterSpec, ...]:
    """A comma-separated router list, e.g. ``round-robin,least-loaded,spec-aware``."""
    parts = [p for p in (s.strip() for s in text.split(",")) if p]
    if not parts:
        raise RouterSpecError(f"no router given; expected a comma-separated list of {ROUTER_FORMS}")
    specs = tuple(parse_router(p) for p in parts)
    names = [s.name for s in specs]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise RouterSpecError(f"router given twice: {', '.join(dupes)}")
    return specs
