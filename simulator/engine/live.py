"""Requests that arrive while the engine runs: what a live source gives the engine.

``Engine.run(..., live=source)`` serves, next to the trace it was given, the requests a
:class:`LiveSource` hands it as they arrive (the sim-server's HTTP clients,
:mod:`~specgov.simulator.server.live`). Every call is made on the engine's own thread, at
forward boundaries, so the source needs no lock on the engine's state:

* :meth:`LiveSource.take` at each scheduler iteration: the requests that have arrived by
  the current simulated time (their ``arrival_s`` is simulated time, at or before it);
* :meth:`LiveSource.cancelled`: keys of requests whose client went away; the engine frees
  them (queue slot, KV, pinned cache blocks) and counts them aborted;
* :meth:`LiveSource.emitted` after each forward: the live requests that took part, with
  their token counts (``generated``; finished when it reaches ``output_tokens``);
* :meth:`LiveSource.rejected`: a request that can never fit the KV pool;
* :meth:`LiveSource.idle` when nothing is queued or running: block until a request
  arrives or simulated time ``until_s``, return the simulated time reached.

A live request's :attr:`~specgov.simulator.engine.requests.RequestState.index` is
``LIVE_INDEX_BASE + key``: it never collides with a trace request's index, and its
acceptance stream (seeded per index) is its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Final, Protocol

if TYPE_CHECKING:
    from specgov.simulator.engine.requests import RequestState
    from specgov.simulator.workload.traces import Request

LIVE_INDEX_BASE: Final = 1 << 40


class LiveSource(Protocol):
    """Requests arriving during a run (module docstring)."""

    @property
    def hold_open(self) -> bool:
        """True: the run waits for live requests after the trace is served; False: it
        ends once the trace is served and nothing is in flight."""
        ...

    def take(self, now_s: float) -> Sequence[tuple[int, Request]]:
        """(key, request) of every live request arrived by ``now_s``, in arrival order."""
        ...

    def cancelled(self) -> Sequence[int]:
        """Keys of requests to drop (their client disconnected)."""
        ...

    def emitted(self, now_s: float, states: Sequence[RequestState]) -> None:
        """``states`` (live or not) took part in the forward that ended at ``now_s``."""
        ...

    def rejected(self, key: int, reason: str) -> None:
        """The request ``key`` was dropped by the engine (``reason`` says why)."""
        ...

    def idle(self, now_s: float, until_s: float) -> float:
        """Nothing to run: wait until a live request arrives or ``until_s``; return the
        simulated time reached, in ``[now_s, until_s]``."""
        ...
