"""N simulated SGLang servers behind a router, in lock-step virtual time.

Why lock-step over one event loop: a router decides at each arrival from the
replicas' state at that instant, and that state depends on every earlier
routing decision, so the replicas cannot be replayed one after another on
pre-split traces. Each replica is an unchanged ``Engine`` whose per-run state
(``engine.Run``, the object ``Engine.run`` drives) is stepped here one
scheduler iteration at a time, with exactly the body of ``Engine.run``'s loop
(admit arrivals, tick, idle skip, prefill-first, decode). The fleet loop keeps
one global virtual clock:

* the next event is either the next trace arrival or the replica whose next
  iteration starts earliest (its ``now``: the end of its current forward);
* an arrival at or before every busy replica's ``now`` is routed first, so a
  replica never starts an iteration before every request that arrived by then
  has been routed - the same "admit whatever has arrived at the iteration
  boundary" rule ``Engine.run`` applies to a single server;
* a request routed to a replica mid-forward waits for that forward to end, as
  it does in SGLang's scheduler.

So each replica sees the request stream a real server behind that router would
see, and its run is bit for bit what ``Engine.run`` gives on that stream (a test
checks one replica against ``Engine.run``). The router sees the active requests
it has sent to each replica (``router.ReplicaLoad``), completions counted once
the forward that emitted their last token has ended.

Acceptance draws are keyed by the request's index in the fleet's trace, not its
index on the replica: a request draws the same accepted-draft stream whatever
replica or router serves it (common random numbers across fleets).

The seam: ``engine.Run`` is private to ``simulator/engine/core.py``. Everything that
touches it is in ``ReplicaStepper``; a public stepping hook on ``Engine`` would
replace only that class.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from specgov.policies.common.errors import SpecgovError
from specgov.simulator.engine.core import Engine, Run
from specgov.simulator.engine.interface import EngineResult, Sampler, SamplerFactory
from specgov.simulator.planning.router import ReplicaLoad, Router
from specgov.simulator.workload.traces import Request


class FleetSimulationError(SpecgovError, ValueError):
    """The fleet cannot be simulated as given; the message says why."""


class TraceIndexed:
    """A sampler factory that draws request *i* of a replica as the trace's request."""

    __slots__ = ("_inner", "_trace_index")

    def __init__(self, inner: SamplerFactory, trace_index: list[int]) -> None:
        self._inner = inner
        self._trace_index = trace_index

    def sampler(
        self, request_index: int, domain: str | None, acc_len: Sequence[int] | None = None
    ) -> Sampler:
        return self._inner.sampler(self._trace_index[request_index], domain, acc_len)


class ReplicaStepper:
    """One replica: an ``Engine`` stepped one scheduler iteration at a time."""

    __slots__ = (
        "_done_ptr",
        "_ledger_arrival",
        "_ledger_e2e",
        "_requests",
        "_run",
        "assigned",
        "engine",
        "speculative",
        "trace_index",
    )

    def __init__(
        self,
        engine: Engine,
        *,
        speculative: bool,
        on_tick: Callable[[float], None] | None = None,
        tick_interval_s: float = 1.0,
        metrics: object | None = None,
    ) -> None:
        self.engine = engine
        self.speculative = speculative
        self.trace_index: list[int] = []
        self._requests: list[Request] = []
        if engine.acceptance is not None:
            engine.acceptance = TraceIndexed(engine.acceptance, self.trace_index)
        # An empty run: the trace's first arrival is at 0.0, the origin Run takes
        # for an empty request list, so every replica's series starts at the fleet's.
        self._run = Run(
            engine,
            self._requests,
            metrics=metrics,  # type: ignore[arg-type]
            on_tick=on_tick,
            tick_interval_s=tick_interval_s,
            concurrency=None,
        )
        self.assigned = 0
        self._done_ptr = 0
        self._ledger_e2e = self._run.ledger.e2e_s
        self._ledger_arrival = self._run.ledger.req_arrival_s

    # ---- what the fleet loop reads

    @property
    def now_s(self) -> float:
        return self._run.now

    def next_event_s(self) -> float:
        """When this replica's next iteration starts (inf: nothing to do)."""
        st = self._run
        if st.running or st.waiting or st.chunked is not None:
            return st.now
        if st.next_arrival < st.n_total:
            a = st.arrivals[st.next_arrival]
            return a if a > st.now else st.now
        return math.inf

    def in_flight(self, at_s: float) -> int:
        """Requests sent here and not finished by *at_s* (aborts count as finished)."""
        e2e = self._ledger_e2e
        arr = self._ledger_arrival
        n = len(e2e)
        p = self._done_ptr
        # Finish times are non-decreasing per replica and routing times only grow.
        while p < n and arr[p] + e2e[p] <= at_s:
            p += 1
        self._done_ptr = p
        return self.assigned - p - self._run.ledger.aborted

    # ---- what the fleet loop does

    def add(self, request: Request, trace_index: int) -> None:
        st = self._run
        if st.arrivals and request.arrival_s < st.arrivals[-1]:
            raise FleetSimulationError(
                f"request {trace_index} arrives at {request.arrival_s} s, before the last "
                f"one routed here ({st.arrivals[-1]} s): route in arrival order"
            )
        self._requests.append(request)
        self.trace_index.append(trace_index)
        st.arrivals.append(request.arrival_s)
        st.n_total += 1
        self.assigned += 1

    def step(self) -> None:
        """One iteration of ``Engine.run``'s loop."""
        st = self._run
        st.admit_arrivals()
        st.tick()
        if not st.running and not st.waiting and st.chunked is None:
            st.skip_idle()
            return
        st.schedule()

    def finish(self) -> EngineResult:
        self._run.close_series()
        return self._run.result()


@dataclass
class FleetRun:
    """What one fleet simulation measured: per replica, and where each request went."""

    results: list[EngineResult]
    assignment: list[int]  # trace request index -> replica index
    end_s: float


def simulate_fleet(
    requests: Sequence[Request],
    replicas: Sequence[ReplicaStepper],
    router: Router,
    *,
    progress: Callable[[int, int], None] | None = None,
) -> FleetRun:
    """Route *requests* (sorted by arrival) over *replicas* and run every replica to the end."""
    if not replicas:
        raise FleetSimulationError("a fleet needs at least one replica")
    n = len(requests)
    for i in range(1, n):
        if requests[i].arrival_s < requests[i - 1].arrival_s:
            raise FleetSimulationError(
                f"requests must be sorted by arrival_s (request {i} at "
                f"{requests[i].arrival_s} s comes after one at {requests[i - 1].arrival_s} s)"
            )
    assignment: list[int] = []
    nxt = 0
    steps = 0
    inf = math.inf
    while True:
        t_rep = inf
        r_idx = -1
        for j, rep in enumerate(replicas):
            t = rep.next_event_s()
            if t < t_rep:
                t_rep = t
                r_idx = j
        t_arr = requests[nxt].arrival_s if nxt < n else inf
        if t_arr == inf and t_rep == inf:
            break
        if t_arr <= t_rep:
            loads = [
                ReplicaLoad(j, rep.speculative, rep.in_flight(t_arr))
                for j, rep in enumerate(replicas)
            ]
            choice = router.choose(loads)
            if not 0 <= choice < len(replicas):
                raise FleetSimulationError(
                    f"router {router.name!r} chose replica {choice} of {len(replicas)}"
                )
            replicas[choice].add(requests[nxt], nxt)
            assignment.append(choice)
            nxt += 1
            continue
        replicas[r_idx].step()
        steps += 1
        if progress is not None and steps % 8192 == 0:
            progress(nxt, n)
    if progress is not None:
        progress(n, n)
    results = [rep.finish() for rep in replicas]
    end_s = max(rep.now_s for rep in replicas)
    return FleetRun(results=results, assignment=assignment, end_s=end_s)
