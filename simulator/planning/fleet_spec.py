"""What a fleet plan simulates: fleet shapes (n speculative + m plain), options, rates."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from specgov.policies.common.errors import SpecgovError
from specgov.simulator.planning.prices import Prices
from specgov.simulator.planning.router import RouterSpec
from specgov.simulator.replay.metrics import Slo
from specgov.simulator.workload.traces import Trace, transform_trace

PLAIN = "none"
MIX_FORM = "n+m (n speculative and m plain replicas, integers >= 0, n + m >= 1), or 'all'"
REPLICAS_FORM = "a comma-separated list of replica counts or ranges, e.g. 4 or 2,4 or 1-6"
MAX_REPLICAS = 64  # a guard against typos (1-400); raise it when a plan needs more


class FleetSpecError(SpecgovError, ValueError):
    """A fleet option could not be understood; the message gives the expected form."""


@dataclass(frozen=True, order=True)
class FleetShape:
    """``speculative`` speculative replicas plus ``plain`` plain ones."""

    speculative: int
    plain: int

    def __post_init__(self) -> None:
        if self.speculative < 0 or self.plain < 0 or self.speculative + self.plain < 1:
            raise FleetSpecError(f"fleet {self.speculative}+{self.plain}: expected {MIX_FORM}")
        if self.speculative + self.plain > MAX_REPLICAS:
            raise FleetSpecError(
                f"fleet {self.speculative}+{self.plain}: more than {MAX_REPLICAS} replicas"
            )

    @property
    def replicas(self) -> int:
        return self.speculative + self.plain

    @property
    def name(self) -> str:
        return f"{self.speculative}+{self.plain}"

    @property
    def kind(self) -> str:
        if self.plain == 0:
            return "speculative"
        if self.speculative == 0:
            return "plain"
        return "mixed"


def parse_replicas(text: str) -> tuple[int, ...]:
    """``4``, ``2,4,8`` or ``1-6`` -> sorted replica counts."""
    out: set[int] = set()
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        lo_text, sep, hi_text = part.partition("-")
        try:
            lo = int(lo_text)
            hi = int(hi_text) if sep else lo
        except ValueError:
            raise FleetSpecError(f"replicas {text!r}: {part!r} is not {REPLICAS_FORM}") from None
        if lo < 1 or hi < lo:
            raise FleetSpecError(
                f"replicas {text!r}: {part!r} must be >= 1 (ranges low-high); "
                f"expected {REPLICAS_FORM}"
            )
        if hi > MAX_REPLICAS:
            raise FleetSpecError(f"replicas {text!r}: at most {MAX_REPLICAS} replicas")
        out.update(range(lo, hi + 1))
    if not out:
        raise FleetSpecError(f"replicas {text!r}: expected {REPLICAS_FORM}")
    return tuple(sorted(out))


def parse_mix(text: str) -> FleetShape:
    """``2+2`` -> FleetShape(2, 2)."""
    n_text, sep, m_text = text.strip().partition("+")
    try:
        if not sep:
            raise ValueError
        n, m = int(n_text), int(m_text)
    except ValueError:
        raise FleetSpecError(f"mix {text!r}: expected {MIX_FORM}") from None
    if n < 0 or m < 0 or n + m < 1:
        raise FleetSpecError(f"mix {text!r}: expected {MIX_FORM}")
    return FleetShape(n, m)


def enumerate_fleets(replicas: Sequence[int], mixes: Sequence[str]) -> tuple[FleetShape, ...]:
    """The fleets to simulate.

    Every count in *replicas* gives its two homogeneous fleets (all speculative, all
    plain); *mixes* adds explicit ``n+m`` fleets, and ``all`` every split ``n+m``
    (n, m >= 1) of each count in *replicas*. Sorted by size, speculative-heavy first.
    """
    fleets: set[FleetShape] = set()
    every_split = False
    for size in replicas:
        fleets.add(FleetShape(size, 0))
        fleets.add(FleetShape(0, size))
    for text in mixes:
        if text.strip().lower() == "all":
            every_split = True
        else:
            fleets.add(parse_mix(text))
    if every_split:
        if not replicas:
            raise FleetSpecError("--mix all splits the --replicas counts: give --replicas too")
        for size in replicas:
            fleets.update(FleetShape(n, size - n) for n in range(1, size))
    if not fleets:
        raise FleetSpecError(f"no fleet: give --replicas ({REPLICAS_FORM}) and/or --mix")
    return tuple(sorted(fleets, key=lambda f: (f.replicas, -f.speculative)))


@dataclass(frozen=True)
class FleetPlanConfig:
    """What to simulate and how to judge it."""

    fleets: tuple[FleetShape, ...]
    routers: tuple[RouterSpec, ...]
    policies: tuple[str, ...] = ("sglang-ema",)  # the speculative replicas' policies
    slo: Slo = field(default_factory=lambda: Slo(tpot_ms=50.0, ttft_ms=2000.0))
    slo_percentile: float = 99.0
    seed: int = 0
    prices: Prices | None = None  # price per GPU-hour (planning.prices)

    def __post_init__(self) -> None:
        if not self.fleets:
            raise FleetSpecError("no fleet to simulate")
        if not self.routers:
            raise FleetSpecError("no router given")
        if not 0.0 < self.slo_percentile <= 100.0:
            raise FleetSpecError(f"slo_percentile must be in (0, 100], got {self.slo_percentile!r}")
        if not self.policies and any(f.speculative for f in self.fleets):
            raise FleetSpecError("speculative replicas need a policy (e.g. sglang-ema)")


def scale_to_rps(trace: Trace, target_rps: float) -> tuple[Trace, float]:
    """*trace* with arrivals scaled so its mean request rate is *target_rps*.

    Returns the scaled trace and the scale factor (``rate_scale`` of ``load_trace``).
    """
    if not (target_rps > 0 and math.isfinite(target_rps)):
        raise FleetSpecError(f"target rps must be a positive number, got {target_rps!r}")
    n = len(trace.requests)
    duration = trace.duration_s
    if n < 2 or duration <= 0:
        raise FleetSpecError(
            f"trace {trace.name!r} has {n} request(s) over {duration:g} s: a target rate "
            "needs at least two requests at different times"
        )
    scale = target_rps * duration / (n - 1)
    return transform_trace(trace, rate_scale=scale), scale


def offered_rps(trace: Trace) -> float | None:
    """Mean arrival rate: (n - 1) requests over the first-to-last arrival span."""
    n = len(trace.requests)
    if n < 2 or trace.duration_s <= 0:
        return None
    return (n - 1) / trace.duration_s
