"""The daemon-level policy contract: ``decide(observation, state, budget) -> (plan, state)``.

A daemon policy turns one :class:`Observation` into a :class:`Plan` (the steps it wants
per slot, or none: it stands by its last; always with a reason). The guard
(``policies.guardrails``) alone turns plans into the published :class:`StepTable`: its
version, TTL and keep-alives are the guard's, never a policy's. It is a pure step (DESIGN.md):
time arrives inside the observation, randomness from a generator whose state
lives in the policy state, and the learned state is a typed, serialisable value
returned alongside the decision. The same object runs in closed-loop replay
(virtual time) and in the daemon.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, TypeVar, runtime_checkable

from specgov.policies.common.decisions import Plan
from specgov.policies.common.observation import Observation
from specgov.policies.common.types import Budget

StateT = TypeVar("StateT")


@runtime_checkable
class PolicyState(Protocol):
    """Learned state: serialisable so the daemon can persist and restore it."""

    def to_dict(self) -> dict[str, Any]: ...


@runtime_checkable
class DaemonPolicy(Protocol[StateT]):
    """One decision step. Implementations are immutable; state travels explicitly."""

    @property
    def name(self) -> str:
        """The policy spec string that builds this policy (e.g. ``goodput:slo_tpot_ms=40``)."""
        ...

    def initial_state(self) -> StateT: ...

    def decide(
        self, observation: Observation, state: StateT, budget: Budget
    ) -> tuple[Plan, StateT]: ...

    def state_from_dict(self, data: Mapping[str, Any]) -> StateT:
        """Restore a state written by ``state.to_dict()``; raises ValueError naming bad keys."""
        ...
