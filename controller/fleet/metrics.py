"""The fleet governor's Prometheus metrics (``specgov_fleet_*``), on their own registry.

``specgov fleet run --metrics-addr HOST:PORT`` serves them (loopback by default):

* ``specgov_fleet_replicas{mode}``: replicas per mode (``spec``, ``plain``);
* ``specgov_fleet_replica_serving{replica}``: 1 while the replica is in the gateway and
  healthy, else 0;
* ``specgov_fleet_target_spec_replicas``: the replicas the last decision wants speculative;
* ``specgov_fleet_load_requests``: the load the decision read (``fleet run --load``:
  requests in flight across the fleet, or their arrival rate per second; NaN: unknown);
* ``specgov_fleet_decisions_total{reason}``: decisions by reason code;
* ``specgov_fleet_moves_total{outcome}``: moves by outcome (``move_done``,
  ``rolled_back``, ``replica_lost``, ``drain_failed``, ``drain_timeout``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from specgov.policies.control.fleet_mix import MODES, MixDecision, ReplicaView


class FleetMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.replicas = Gauge("specgov_fleet_replicas", "Replicas per mode", ["mode"], registry=r)
        self.serving = Gauge(
            "specgov_fleet_replica_serving",
            "1 while the replica serves through the gateway",
            ["replica"],
            registry=r,
        )
        self.target = Gauge(
            "specgov_fleet_target_spec_replicas",
            "Replicas the last decision wants speculative",
            registry=r,
        )
        self.load = Gauge(
            "specgov_fleet_load_requests",
            "The fleet load the decision read: requests in flight, or arrivals per second (--load)",
            registry=r,
        )
        self.decisions = Counter(
            "specgov_fleet_decisions", "Fleet decisions by reason", ["reason"], registry=r
        )
        self.moves = Counter("specgov_fleet_moves", "Moves by outcome", ["outcome"], registry=r)

    def serve(self, host: str, port: int) -> None:
        start_http_server(port, addr=host, registry=self.registry)

    def observe(
        self, views: Sequence[ReplicaView], load: float | None, decision: MixDecision | None
    ) -> None:
        for mode in MODES:
            self.replicas.labels(mode=mode).set(sum(1 for v in views if v.mode == mode))
        for v in views:
            self.serving.labels(replica=v.name).set(1 if v.serving else 0)
        self.load.set(math.nan if load is None else load)
        if decision is not None:
            self.target.set(decision.target_spec)
            self.decisions.labels(reason=decision.reason).inc()

    def held(self, reason: str) -> None:
        self.decisions.labels(reason=reason).inc()

    def moved(self, outcome: str) -> None:
        self.moves.labels(outcome=outcome).inc()
