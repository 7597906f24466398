"""Synthetic request traces: arrival processes, load shapes, content phases, lengths.

``generate_trace(spec)`` turns a ``SyntheticSpec`` into a ``Trace``; every random draw
comes from ``numpy.random.default_rng(spec.seed)``, so the same spec gives the same trace.

Arrivals. The request rate at time t is
``rate_rps * diurnal(t) * ramp(t) * gate(t)`` where ``diurnal(t) = 1 + A*sin(2*pi*t/P)``,
``ramp`` interpolates the ``(time_s, multiplier)`` points linearly (constant outside them)
and, for ``arrival="onoff"``, ``gate`` is ``(on_s + off_s) / on_s`` in the first ``on_s`` of
every ``on_s + off_s`` cycle and 0 in the rest, so ``rate_rps`` stays the long-run mean.
Arrivals are a renewal process with unit-mean gaps (exponential for ``poisson`` and
``onoff``, gamma with coefficient of variation ``burstiness_cv`` for ``gamma``) in
"operational time" ``Lambda(t) = integral of the rate``, mapped back to wall time. For a
Poisson process this is equivalent to thinning (an exact non-homogeneous Poisson process);
unlike thinning it keeps the gamma gaps' burstiness instead of pulling their CV towards 1.
As every ``Trace`` does, the first request arrives at t = 0.

Content. ``phases`` split the timeline into consecutive phases, each with domain mix
weights; a request's domain is drawn from the mix of the phase it arrives in. Phases shorter
in total than ``duration_s`` repeat cyclically. Default: code, chat, rag in equal thirds.

Lengths. Input and output token counts are lognormal with the given mean (not median) and
log-space sigma, rounded and clipped to ``[1, max_*_tokens]``; ``domain_lengths`` overrides
mean or sigma per domain (e.g. code: shorter outputs; rag: long inputs).

Conversations (``turns`` > 1; multi-turn chat or agent loops, for the prefix cache).
Arrivals then start conversations, at ``rate_rps / turns`` so that ``rate_rps`` stays
the long-run request rate; a conversation keeps its first turn's domain. Turn 1's prompt
is drawn as above; turn ``j + 1``'s prompt is turn ``j``'s prompt + its answer + new user
text (lognormal, mean ``mean_turn_input_tokens``, sigma ``input_sigma``), and it arrives
``think_time_s`` (exponential mean) after turn ``j`` arrived: an open-loop trace cannot
know when the answer came, so keep the think time above the expected latency. A
conversation ends after ``turns`` turns, at ``duration_s``, or before a prompt would
exceed ``max_input_tokens``. Such requests carry prefix block ids (``hash_ids``, one per
512 tokens, see ``simulator/workload/traces.py``): a block wholly inside the previous turn's
prompt + answer keeps its id, every other block gets a new one, so each turn's ids share
the previous turn's full blocks. With ``turns=1`` (the default) requests have no ids and
the trace is the same as before conversations existed.

A spec's CLI text: ``format_synthetic_spec`` here (it names a generated trace); the syntax,
``parse_synthetic_spec`` and ``open_trace`` in ``specgov.simulator.workload.synthetic_text``.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import numpy as np
from numpy.typing import ArrayLike, NDArray

from specgov.policies.common.errors import SpecgovError
from specgov.policies.common.validation import is_int, is_real
from specgov.simulator.workload.traces import MAX_SPAN_S, PREFIX_BLOCK_TOKENS, Request, Trace

__all__ = [
    "ARRIVAL_PROCESSES",
    "DEFAULT_DEMO_SPEC",
    "DOMAIN_LABEL_RE",
    "DOMAIN_SPEC_KEYS",
    "SPEC_KEYS",
    "DomainLengths",
    "Phase",
    "SyntheticSpec",
    "SyntheticSpecError",
    "expected_rate_rps",
    "expected_requests",
    "format_synthetic_spec",
    "generate_trace",
]

ARRIVAL_PROCESSES: tuple[str, ...] = ("poisson", "gamma", "onoff")
MAX_TURNS = 1000  # turns per conversation: each costs a draw per conversation
# Bounded like trace files (simulator/workload/traces.py): a trace spans at most MAX_SPAN_S (30
# days), and a spec may expect at most MAX_EXPECTED_REQUESTS requests, so a typo such as
# rate=1e6 is an error, not an exhausted memory. Measured: generating 2.0 M requests
# peaks at 0.47 GB RSS and takes 30 s on this project's CI machine.
MAX_EXPECTED_REQUESTS = 2_000_000
DOMAIN_LABEL_RE = re.compile(r"[A-Za-z0-9_-]+")
_DEFAULT_DOMAINS = ("code", "chat", "rag")


class SyntheticSpecError(SpecgovError, ValueError):
    """An invalid synthetic spec; ``field`` names the offending field (or CLI key)."""

    def __init__(self, field_name: str, message: str) -> None:
        self.field = field_name
        super().__init__(message)


def _fail(field_name: str, expected: str, value: object) -> SyntheticSpecError:
    return SyntheticSpecError(field_name, f"{field_name} must be {expected}, got {value!r}")


def _real(field_name: str, value: object) -> float:
    if not is_real(value):
        raise _fail(field_name, "a finite number", value)
    return float(value)


def _positive(field_name: str, value: object) -> float:
    number = _real(field_name, value)
    if number <= 0:
        raise _fail(field_name, "> 0", value)
    return number


def _non_negative(field_name: str, value: object) -> float:
    number = _real(field_name, value)
    if number < 0:
        raise _fail(field_name, ">= 0", value)
    return number


def _check_int(field_name: str, value: object, minimum: int) -> None:
    if not is_int(value) or value < minimum:
        raise _fail(field_name, f"an integer >= {minimum}", value)


def _check_domain(field_name: str, name: object) -> str:
    if not isinstance(name, str) or DOMAIN_LABEL_RE.fullmatch(name) is None:
        raise _fail(field_name, "a domain label of letters, digits, '_' or '-'", name)
    return name


@dataclass(frozen=True)
class Phase:
    """A stretch of ``duration_s`` seconds whose requests draw their domain from ``domains``
    (label -> non-negative mix weight; weights need not sum to 1)."""

    duration_s: float
    domains: Mapping[str, float]

    def __post_init__(self) -> None:
        _positive("Phase.duration_s", self.duration_s)
        if not isinstance(self.domains, Mapping) or not self.domains:
            raise _fail("Phase.domains", "a non-empty mapping of domain -> weight", self.domains)
        for name, weight in self.domains.items():
            _check_domain("Phase.domains", name)
            _non_negative(f"Phase.domains[{name!r}]", weight)
        if sum(self.domains.values()) <= 0:
            raise _fail("Phase.domains", "weights with a positive sum", dict(self.domains))
        # Frozen means frozen: a caller's dict mutated later must not change the spec.
        object.__setattr__(self, "domains", MappingProxyType(dict(self.domains)))


@dataclass(frozen=True)
class DomainLengths:
    """Per-domain overrides of the length distributions; ``None`` keeps the global value."""

    mean_input_tokens: float | None = None
    input_sigma: float | None = None
    mean_output_tokens: float | None = None
    output_sigma: float | None = None

    def __post_init__(self) -> None:
        for name in ("mean_input_tokens", "mean_output_tokens"):
            value = getattr(self, name)
            if value is not None and _real(f"DomainLengths.{name}", value) < 1:
                raise _fail(f"DomainLengths.{name}", ">= 1", value)
        for name in ("input_sigma", "output_sigma"):
            value = getattr(self, name)
            if value is not None:
                _non_negative(f"DomainLengths.{name}", value)


@dataclass(frozen=True)
class SyntheticSpec:
    """Everything that defines a synthetic trace (module docstring: the model).

    Fields:
        duration_s: length of the generated timeline.
        rate_rps: long-run mean request rate before the diurnal and ramp multipliers.
        arrival: "poisson", "gamma" (gaps with CV ``burstiness_cv``) or "onoff" (Poisson
            bursts of ``on_s`` separated by ``off_s`` of silence).
        burstiness_cv: coefficient of variation of gamma inter-arrival gaps (1 = Poisson).
        on_s, off_s: on-off cycle; only used with ``arrival="onoff"``.
        diurnal_amplitude: A in ``1 + A*sin(2*pi*t/period)``; 0 turns it off, 1 reaches 0.
        diurnal_period_s: the period; ``None`` = one full period over ``duration_s``.
        ramp: ``(time_s, multiplier)`` points, time increasing, for load ramps up and down;
            linear between points, constant outside; ``None`` = no ramp.
        mean_input_tokens, input_sigma, max_input_tokens: input lognormal, clip [1, max].
        mean_output_tokens, output_sigma, max_output_tokens: output lognormal, clip [1, max].
        domain_lengths: domain -> ``DomainLengths`` overrides (each domain must occur in a
            phase).
        phases: content phases; ``None`` = code, chat, rag in equal thirds of duration_s.
        turns: turns per conversation (module docstring); 1 = independent requests.
        think_time_s: mean gap between a conversation's turn arrivals (exponential).
        mean_turn_input_tokens: mean new user tokens a later turn adds to its prompt.
        seed: seed for ``numpy.random.default_rng``.
    """

    duration_s: float = 600.0
    rate_rps: float = 4.0
    arrival: str = "poisson"
    burstiness_cv: float = 2.0
    on_s: float = 30.0
    off_s: float = 30.0
    diurnal_amplitude: float = 0.0
    diurnal_period_s: float | None = None
    ramp: tuple[tuple[float, float], ...] | None = None
    mean_input_tokens: float = 1024.0
    input_sigma: float = 1.0
    max_input_tokens: int = 32768
    mean_output_tokens: float = 256.0
    output_sigma: float = 0.8
    max_output_tokens: int = 4096
    domain_lengths: Mapping[str, DomainLengths] = field(default_factory=dict)
    phases: tuple[Phase, ...] | None = None
    turns: int = 1
    think_time_s: float = 30.0
    mean_turn_input_tokens: float = 128.0
    seed: int = 0

    def __post_init__(self) -> None:
        if _positive("duration_s", self.duration_s) > MAX_SPAN_S:
            raise _fail("duration_s", f"at most {MAX_SPAN_S:g} s (30 days)", self.duration_s)
        _positive("rate_rps", self.rate_rps)
        if self.arrival not in ARRIVAL_PROCESSES:
            raise _fail("arrival", f"one of {', '.join(ARRIVAL_PROCESSES)}", self.arrival)
        _positive("burstiness_cv", self.burstiness_cv)
        _positive("on_s", self.on_s)
        _non_negative("off_s", self.off_s)
        if not 0 <= _real("diurnal_amplitude", self.diurnal_amplitude) <= 1:
            raise _fail("diurnal_amplitude", "in [0, 1]", self.diurnal_amplitude)
        if self.diurnal_period_s is not None:
            _positive("diurnal_period_s", self.diurnal_period_s)
        self._check_ramp()
        for prefix in ("input", "output"):
            mean = getattr(self, f"mean_{prefix}_tokens")
            top = getattr(self, f"max_{prefix}_tokens")
            _check_int(f"max_{prefix}_tokens", top, 1)
            if not 1 <= _real(f"mean_{prefix}_tokens", mean) <= top:
                raise _fail(f"mean_{prefix}_tokens", f"in [1, max_{prefix}_tokens={top}]", mean)
            _non_negative(f"{prefix}_sigma", getattr(self, f"{prefix}_sigma"))
        self._check_phases()
        self._check_domain_lengths()
        _check_int("turns", self.turns, 1)
        if self.turns > MAX_TURNS:
            raise _fail("turns", f"at most {MAX_TURNS}", self.turns)
        _non_negative("think_time_s", self.think_time_s)
        top_in = self.max_input_tokens
        if not 1 <= _real("mean_turn_input_tokens", self.mean_turn_input_tokens) <= top_in:
            raise _fail(
                "mean_turn_input_tokens",
                f"in [1, max_input_tokens={top_in}]",
                self.mean_turn_input_tokens,
            )
        _check_int("seed", self.seed, 0)
        self._check_expected_requests()

    def _check_expected_requests(self) -> None:
        # A cheap upper bound first (peak rate x duration); the exact expected count (the
        # integral of the rate, as the arrivals draw it) only when the bound is over.
        peak = self.rate_rps * (1.0 + self.diurnal_amplitude)
        if self.ramp is not None:
            peak *= max(m for _, m in self.ramp)
        if self.arrival == "onoff":
            peak *= (self.on_s + self.off_s) / self.on_s
        if peak * self.duration_s <= MAX_EXPECTED_REQUESTS:
            return
        expected = expected_requests(self)
        if expected > MAX_EXPECTED_REQUESTS:
            raise SyntheticSpecError(
                "rate_rps",
                f"the spec must expect at most {MAX_EXPECTED_REQUESTS:,} requests (the "
                f"rate with its ramp, diurnal and on-off shape over duration_s), got "
                f"{expected:,.0f} (rate_rps={self.rate_rps:g}, duration_s="
                f"{self.duration_s:g}); lower the rate or the duration",
            )

    def _check_ramp(self) -> None:
        if self.ramp is None:
            return
        try:
            points = tuple((float(t), float(m)) for t, m in self.ramp)
        except (TypeError, ValueError, OverflowError):  # OverflowError: an int beyond float
            raise _fail("ramp", "a sequence of (time_s, multiplier) pairs", self.ramp) from None
        if not points:
            raise _fail("ramp", "at least one (time_s, multiplier) point or None", self.ramp)
        for i, (t, m) in enumerate(points):
            if not (math.isfinite(t) and math.isfinite(m)) or t < 0 or m < 0:
                raise _fail(f"ramp[{i}]", "(time_s >= 0, multiplier >= 0)", (t, m))
            if t > self.duration_s:
                raise _fail(f"ramp[{i}]", f"at a time <= duration_s ({self.duration_s})", (t, m))
            if i and t <= points[i - 1][0]:
                raise _fail(f"ramp[{i}]", "later than the point before it", (t, m))
        if not any(m > 0 for _, m in points):
            raise _fail("ramp", "at least one positive multiplier", self.ramp)
        object.__setattr__(self, "ramp", points)

    def _check_phases(self) -> None:
        if self.phases is None:
            return
        if not isinstance(self.phases, tuple | list):
            raise _fail("phases", "a non-empty sequence of Phase or None", self.phases)
        phases = tuple(self.phases)
        if not phases or not all(isinstance(p, Phase) for p in phases):
            raise _fail("phases", "a non-empty sequence of Phase or None", self.phases)
        total = sum(p.duration_s for p in phases)
        if total > self.duration_s * (1 + 1e-9):
            raise SyntheticSpecError(
                "phases",
                f"phases last {total:g} s in total but duration_s is {self.duration_s:g} s, so "
                "the later ones would never occur; shorten them (shorter phases repeat)",
            )
        object.__setattr__(self, "phases", phases)

    def _check_domain_lengths(self) -> None:
        if not isinstance(self.domain_lengths, Mapping):
            raise _fail(
                "domain_lengths", "a mapping of domain -> DomainLengths", self.domain_lengths
            )
        used = {name for p in self.resolved_phases() for name in p.domains}
        for name, lengths in self.domain_lengths.items():
            _check_domain("domain_lengths", name)
            if not isinstance(lengths, DomainLengths):
                raise _fail(f"domain_lengths[{name!r}]", "a DomainLengths", lengths)
            if name not in used:
                raise SyntheticSpecError(
                    f"domain_lengths[{name!r}]",
                    f"domain_lengths names {name!r}, which no phase uses "
                    f"(phases use: {', '.join(sorted(used))})",
                )
            for prefix in ("input", "output"):
                mean = getattr(lengths, f"mean_{prefix}_tokens")
                top = getattr(self, f"max_{prefix}_tokens")
                if mean is not None and mean > top:
                    raise _fail(
                        f"domain_lengths[{name!r}].mean_{prefix}_tokens",
                        f"<= max_{prefix}_tokens ({top})",
                        mean,
                    )
        object.__setattr__(self, "domain_lengths", MappingProxyType(dict(self.domain_lengths)))

    def resolved_phases(self) -> tuple[Phase, ...]:
        """The phases in effect: ``phases``, or code/chat/rag in equal thirds."""
        if self.phases is not None:
            return self.phases
        third = self.duration_s / len(_DEFAULT_DOMAINS)
        return tuple(Phase(third, {name: 1.0}) for name in _DEFAULT_DOMAINS)


# ------------------------------------------------------------------------------ generation


def expected_rate_rps(spec: SyntheticSpec, t_s: ArrayLike) -> NDArray[np.float64]:
    """The request rate the spec asks for at times ``t_s`` (requests per second)."""
    t = np.asarray(t_s, dtype=np.float64)
    rate = np.full(t.shape, spec.rate_rps, dtype=np.float64)
    if spec.diurnal_amplitude > 0:
        period = spec.diurnal_period_s if spec.diurnal_period_s is not None else spec.duration_s
        rate *= 1.0 + spec.diurnal_amplitude * np.sin(2.0 * np.pi * t / period)
    if spec.ramp is not None:
        times = np.array([p[0] for p in spec.ramp])
        mults = np.array([p[1] for p in spec.ramp])
        rate *= np.interp(t, times, mults)  # np.interp holds the end values outside
    if spec.arrival == "onoff":
        cycle = spec.on_s + spec.off_s
        rate *= np.where(np.mod(t, cycle) < spec.on_s, cycle / spec.on_s, 0.0)
    return np.maximum(rate, 0.0)  # sin rounding at A = 1 must not give a negative rate


def expected_requests(spec: SyntheticSpec) -> float:
    """How many requests the spec asks for (the integral of its rate over duration_s)."""
    return float(_operational_time(spec)[1][-1])


def _operational_time(spec: SyntheticSpec) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """Grid times and the cumulative expected request count Lambda at them."""
    # ~5 ms resolution (on-off edges blur by at most one cell), capped for long traces.
    cells = int(min(max(math.ceil(spec.duration_s / 0.005), 1000), 400_000))
    grid = np.linspace(0.0, spec.duration_s, cells + 1)
    rate = expected_rate_rps(spec, grid)
    dt = spec.duration_s / cells
    cum = np.concatenate(([0.0], np.cumsum((rate[1:] + rate[:-1]) * (0.5 * dt))))
    return grid, cum


def _arrivals(spec: SyntheticSpec, rng: np.random.Generator) -> NDArray[np.float64]:
    grid, cum = _operational_time(spec)
    total = float(cum[-1])
    if total <= 0:
        raise SyntheticSpecError("rate_rps", "the spec asks for no requests at all")
    cv = spec.burstiness_cv if spec.arrival == "gamma" else 1.0
    chunks: list[NDArray[np.float64]] = [np.zeros(1)]  # a request at t = 0 (Trace convention)
    reached = 0.0
    while reached < total:
        need = total - reached
        size = int(need + 6.0 * cv * math.sqrt(need) + 64)
        if spec.arrival == "gamma":
            gaps = rng.gamma(shape=1.0 / cv**2, scale=cv**2, size=size)
        else:
            gaps = rng.exponential(1.0, size=size)
        tau = reached + np.cumsum(gaps)
        chunks.append(tau)
        reached = float(tau[-1])
    tau = np.concatenate(chunks)
    tau = tau[tau < total]
    # Invert Lambda: the first grid cell whose cumulative count reaches tau, then linear
    # within it ("left" skips cells of zero rate, so no request lands in an off period).
    idx = np.searchsorted(cum, tau, side="left")
    idx = np.clip(idx, 1, len(cum) - 1)
    lo, hi = cum[idx - 1], cum[idx]
    frac = np.clip((tau - lo) / np.where(hi > lo, hi - lo, 1.0), 0.0, 1.0)
    t = grid[idx - 1] + frac * (grid[idx] - grid[idx - 1])
    t[0] = 0.0
    return np.maximum.accumulate(t)  # guards float noise; the mapping is monotone already


def _domains(spec: SyntheticSpec, t: NDArray[np.float64], rng: np.random.Generator) -> list[str]:
    phases = spec.resolved_phases()
    ends = np.cumsum([p.duration_s for p in phases])
    cycle = float(ends[-1])
    # Phases repeat only when they are meant to: float sums a hair short of duration_s
    # (e.g. 7 x 600/7) must not wrap the last instant back to the first phase.
    local = np.mod(t, cycle) if cycle < spec.duration_s * (1 - 1e-9) else t
    which = np.minimum(np.searchsorted(ends, local, side="right"), len(phases) - 1)
    labels = np.empty(len(t), dtype=object)
    for i, phase in enumerate(phases):
        members = np.flatnonzero(which == i)
        names = list(phase.domains)
        weights = np.array([phase.domains[n] for n in names], dtype=np.float64)
        picks = rng.choice(len(names), size=len(members), p=weights / weights.sum())
        labels[members] = np.array(names, dtype=object)[picks]
    return [str(x) for x in labels]


def _lengths(
    spec: SyntheticSpec, domains: list[str], rng: np.random.Generator, prefix: str
) -> NDArray[np.int64]:
    mean_by_domain: dict[str, tuple[float, float]] = {}
    for name in set(domains):
        override = spec.domain_lengths.get(name, DomainLengths())
        mean = getattr(override, f"mean_{prefix}_tokens")
        sigma = getattr(override, f"{prefix}_sigma")
        mean_by_domain[name] = (
            float(mean if mean is not None else getattr(spec, f"mean_{prefix}_tokens")),
            float(sigma if sigma is not None else getattr(spec, f"{prefix}_sigma")),
        )
    means = np.array([mean_by_domain[d][0] for d in domains])
    sigmas = np.array([mean_by_domain[d][1] for d in domains])
    # E[lognormal(mu, s)] = exp(mu + s^2/2): pick mu so the mean, not the median, is as asked.
    draws = rng.lognormal(mean=np.log(means) - sigmas**2 / 2.0, sigma=sigmas)
    top = getattr(spec, f"max_{prefix}_tokens")
    return np.clip(np.rint(draws), 1, top).astype(np.int64)


def _conversations(spec: SyntheticSpec, rng: np.random.Generator) -> tuple[Request, ...]:
    """Multi-turn requests (module docstring), sorted by arrival."""
    turns = spec.turns
    starts = _arrivals(dataclasses.replace(spec, rate_rps=spec.rate_rps / turns), rng)
    domains = _domains(spec, starts, rng)
    n = len(starts)
    first_in = _lengths(spec, domains, rng, "input")
    # Every draw has a fixed shape (conversations x turns): a conversation cut short
    # leaves the draws of the others where they were.
    outputs = np.stack([_lengths(spec, domains, rng, "output") for _ in range(turns)], axis=1)
    sigma = spec.input_sigma
    mu = math.log(spec.mean_turn_input_tokens) - sigma**2 / 2.0
    user = np.clip(np.rint(rng.lognormal(mu, sigma, size=(n, turns))), 1, None).astype(np.int64)
    think = rng.exponential(spec.think_time_s, size=(n, turns)) if spec.think_time_s else None
    block = PREFIX_BLOCK_TOKENS
    next_id = 0
    rows: list[tuple[float, int, int, Request]] = []
    for c in range(n):
        t = float(starts[c])
        history = 0  # tokens of the previous prompt + answer
        full_ids: list[int] = []  # ids of the history's full blocks (their content is fixed)
        for j in range(turns):
            prompt = int(first_in[c]) if j == 0 else history + int(user[c, j])
            if prompt > spec.max_input_tokens or t >= spec.duration_s:
                break
            # Blocks wholly inside the history keep their ids; new text, new ids.
            shared = min(len(full_ids), history // block)
            del full_ids[shared:]
            n_blocks = -(-prompt // block)
            while len(full_ids) < n_blocks:
                full_ids.append(next_id)
                next_id += 1
            ids = tuple(full_ids)
            if prompt % block:
                del full_ids[-1]  # a partial block's content changes next turn
            out = int(outputs[c, j])
            rows.append((t, c, j, Request(t, prompt, out, domains[c], hash_ids=ids)))
            history = prompt + out
            if think is not None:
                t += float(think[c, j])
    rows.sort(key=lambda row: (row[0], row[1], row[2]))
    return tuple(row[3] for row in rows)


def generate_trace(spec: SyntheticSpec) -> Trace:
    """Draw a trace from ``spec`` (deterministic in ``spec.seed``); every request has a
    domain label (and, with ``turns`` > 1, prefix block ids)."""
    rng = np.random.default_rng(spec.seed)
    requests: tuple[Request, ...]
    if spec.turns > 1:
        requests = _conversations(spec, rng)
    else:
        t = _arrivals(spec, rng)
        domains = _domains(spec, t, rng)
        inputs = _lengths(spec, domains, rng, "input")
        outputs = _lengths(spec, domains, rng, "output")
        requests = tuple(
            Request(arrival_s=a, input_tokens=i, output_tokens=o, domain=d)
            for a, i, o, d in zip(
                t.tolist(), inputs.tolist(), outputs.tolist(), domains, strict=True
            )
        )
    text = format_synthetic_spec(spec)
    name = "synthetic" + (f":{text}" if text else "")
    return Trace(name=name, requests=requests, source=f"generated by specgov ({name})")


# ------------------------------------------------------------------------------- CLI text

SPEC_KEYS: dict[str, tuple[str, str]] = {
    # CLI key -> (SyntheticSpec field, expected form)
    "duration": ("duration_s", "seconds in (0, 2592000] (30 days), e.g. duration=600"),
    "rate": (
        "rate_rps",
        f"requests per second > 0, at most {MAX_EXPECTED_REQUESTS:,} requests over the "
        "duration, e.g. rate=8",
    ),
    "arrival": ("arrival", "poisson, gamma or onoff"),
    "cv": ("burstiness_cv", "a number > 0, e.g. cv=2"),
    "on": ("on_s", "seconds > 0, e.g. on=30"),
    "off": ("off_s", "seconds >= 0, e.g. off=30"),
    "diurnal": ("diurnal_amplitude", "a number in [0, 1], e.g. diurnal=0.5"),
    "period": ("diurnal_period_s", "seconds > 0 or none, e.g. period=300"),
    "ramp": ("ramp", "TIME:MULT points joined by '+', e.g. ramp=0:1+300:4+600:1, or none"),
    "in": ("mean_input_tokens", "a mean token count >= 1, e.g. in=1024"),
    "in_sigma": ("input_sigma", "a log-space sigma >= 0, e.g. in_sigma=1"),
    "max_in": ("max_input_tokens", "an integer >= 1, e.g. max_in=32768"),
    "out": ("mean_output_tokens", "a mean token count >= 1, e.g. out=256"),
    "out_sigma": ("output_sigma", "a log-space sigma >= 0, e.g. out_sigma=0.8"),
    "max_out": ("max_output_tokens", "an integer >= 1, e.g. max_out=4096"),
    "phases": (
        "phases",
        "MIX@SECONDS joined by '+', MIX = DOMAIN[:WEIGHT][|...], e.g. "
        "phases=code@200+chat:3|rag:1@200+rag@200",
    ),
    "turns": ("turns", f"an integer in [1, {MAX_TURNS}], e.g. turns=6"),
    "think": ("think_time_s", "seconds >= 0, e.g. think=30"),
    "turn_in": ("mean_turn_input_tokens", "a mean token count >= 1, e.g. turn_in=128"),
    "seed": ("seed", "an integer >= 0, e.g. seed=3"),
}
DOMAIN_SPEC_KEYS: dict[str, tuple[str, str]] = {
    "in": ("mean_input_tokens", "a mean token count >= 1, e.g. rag.in=4096"),
    "out": ("mean_output_tokens", "a mean token count >= 1, e.g. code.out=128"),
    "in_sigma": ("input_sigma", "a log-space sigma >= 0, e.g. rag.in_sigma=0.5"),
    "out_sigma": ("output_sigma", "a log-space sigma >= 0, e.g. code.out_sigma=0.6"),
}


def _num(value: float) -> str:
    value = float(value)  # ints are valid field values too (int.is_integer is 3.12+)
    return str(int(value)) if value.is_integer() and abs(value) < 1e15 else repr(value)


def format_synthetic_spec(spec: SyntheticSpec) -> str:
    """The CLI text (without the ``synthetic:`` prefix) of the fields that differ from
    ``SyntheticSpec()``; ``parse_synthetic_spec("synthetic:" + text)`` gives ``spec`` back."""
    default = SyntheticSpec()
    parts: list[str] = []
    for key, (fname, _) in SPEC_KEYS.items():
        value = getattr(spec, fname)
        if value == getattr(default, fname):
            continue
        if value is None:
            parts.append(f"{key}=none")
        elif fname == "ramp":
            parts.append(f"{key}=" + "+".join(f"{_num(t)}:{_num(m)}" for t, m in value))
        elif fname == "phases":
            parts.append(
                f"{key}="
                + "+".join(
                    "|".join(n if w == 1.0 else f"{n}:{_num(w)}" for n, w in p.domains.items())
                    + f"@{_num(p.duration_s)}"
                    for p in value
                )
            )
        elif isinstance(value, str | int):
            parts.append(f"{key}={value}")
        else:
            parts.append(f"{key}={_num(value)}")
    for domain, lengths in spec.domain_lengths.items():
        for sub, (fname, _) in DOMAIN_SPEC_KEYS.items():
            value = getattr(lengths, fname)
            if value is not None:
                parts.append(f"{domain}.{sub}={_num(value)}")
    return ",".join(parts)


# The demo's embedded trace: ten minutes whose content moves code -> chat -> rag (switching
# at 200 s and 400 s, both while the load is ramping) and whose load ramps from 3 req/s up to
# 18 req/s (210-360 s) and back. Peak demand is ~5,000 output tokens/s: with the REFERENCE.md
# step model (~6 ms + ~64 us per running request) and prefill taking ~30% of the GPU,
# Little's law puts an H100 serving Llama-3.1-8B without speculation at batch ~100, and at
# batch ~5 at the base rate, so step policies that ignore load diverge.
DEFAULT_DEMO_SPEC = SyntheticSpec(
    duration_s=600.0,
    rate_rps=3.0,
    arrival="gamma",
    burstiness_cv=1.5,
    ramp=((0.0, 1.0), (120.0, 1.0), (210.0, 6.0), (360.0, 6.0), (450.0, 1.0), (600.0, 1.0)),
    domain_lengths={
        "code": DomainLengths(mean_input_tokens=1024.0, mean_output_tokens=192.0),
        "chat": DomainLengths(mean_input_tokens=768.0, mean_output_tokens=288.0),
        "rag": DomainLengths(mean_input_tokens=3072.0, input_sigma=0.6, mean_output_tokens=224.0),
    },
    phases=(
        Phase(200.0, {"code": 1.0}),
        Phase(200.0, {"chat": 1.0}),
        Phase(200.0, {"rag": 1.0}),
    ),
    seed=0,
)
