"""Request traces: the value types the simulator replays and the transformations on them.

A :class:`Trace` holds :class:`Request` values sorted by arrival; trace files are read
into one by ``specgov.simulator.workload.trace_files`` (formats, bounds and error messages
there). ``transform_trace`` applies ``load_trace``'s window / rate_scale / sample / max
options to an in-memory trace (e.g. a synthetic one).

Prefix block ids (``hash_ids``, Mooncake's field; the prefix cache's input): one
non-negative integer per :data:`PREFIX_BLOCK_TOKENS` (512) tokens of the prompt, block
``j`` covering tokens ``[512 j, 512 (j + 1))`` (the last block may be partial). Equal ids
at the same position mean an equal prompt prefix up to the end of that block (the
Mooncake FAST'25 trace README: remapped hashes of 512-token prefix blocks), so a cached
prefix is reused. At most ``ceil(input_tokens / 512)`` ids (fewer: only the first blocks
are known), each below 2^63; a request without ids reuses nothing.

Bound (in memory as in files): a trace spans at most :data:`MAX_SPAN_S` (30 days) from its
first request to its last, after ``rate_scale`` too: every simulated second costs work.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Final

import numpy as np

from specgov.policies.common.errors import SpecgovError
from specgov.policies.common.validation import is_int, is_real

__all__ = [
    "MAX_HASH_ID",
    "MAX_SPAN_S",
    "PREFIX_BLOCK_TOKENS",
    "Request",
    "Trace",
    "TraceError",
    "check_trace_options",
    "max_prefix_blocks",
    "transform_trace",
]

MAX_SPAN_S: Final = 30 * 86400.0
# Tokens per prefix block of a trace's hash_ids: Mooncake's block size (its trace README).
PREFIX_BLOCK_TOKENS: Final = 512
MAX_HASH_ID: Final = (1 << 63) - 1


class TraceError(SpecgovError, ValueError):
    """A trace could not be loaded or built (bad option, missing file, empty result)."""


@dataclass(frozen=True, slots=True)
class Request:
    """One request of a trace.

    ``arrival_s`` is relative to the trace's first request. ``acc_len`` is an optional
    per-token acceptance trace: at output position ``p``, the number of tokens the drafter
    would get accepted from there, bonus token included (so each value is >= 1); its length
    equals ``output_tokens``. ``hash_ids`` are the prompt's prefix block ids (module
    docstring), None when the trace has none (no prefix reuse).
    """

    arrival_s: float
    input_tokens: int
    output_tokens: int
    domain: str | None = None
    acc_len: tuple[int, ...] | None = None
    hash_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        a = self.arrival_s
        if not is_real(a) or a < 0:
            raise TraceError(f"Request.arrival_s must be finite and >= 0, got {self.arrival_s}")
        for name, value in (
            ("input_tokens", self.input_tokens),
            ("output_tokens", self.output_tokens),
        ):
            if not is_int(value) or value < 1:
                raise TraceError(f"Request.{name} must be an integer >= 1, got {value!r}")
        if self.domain is not None and (not isinstance(self.domain, str) or not self.domain):
            raise TraceError(
                f"Request.domain must be a non-empty string or None, got {self.domain!r}"
            )
        if self.acc_len is not None:
            if len(self.acc_len) != self.output_tokens:
                raise TraceError(
                    f"Request.acc_len has {len(self.acc_len)} values but output_tokens is "
                    f"{self.output_tokens}; expected one value per output token"
                )
            if any(not is_int(v) or v < 1 for v in self.acc_len):
                raise TraceError("Request.acc_len values must be integers >= 1")
        if self.hash_ids is not None:
            top = max_prefix_blocks(self.input_tokens)
            if len(self.hash_ids) > top:
                raise TraceError(
                    f"Request.hash_ids has {len(self.hash_ids)} ids but {self.input_tokens} "
                    f"input tokens make at most {top} blocks of {PREFIX_BLOCK_TOKENS}"
                )
            if any(not is_int(v) or not 0 <= v <= MAX_HASH_ID for v in self.hash_ids):
                raise TraceError("Request.hash_ids values must be integers in [0, 2^63)")


def max_prefix_blocks(input_tokens: int) -> int:
    """How many prefix blocks (hash ids) a prompt of ``input_tokens`` tokens has."""
    return -(-input_tokens // PREFIX_BLOCK_TOKENS)


@dataclass(frozen=True)
class Trace:
    """Requests sorted by arrival, the first at ``arrival_s == 0``.

    ``source`` says where the requests came from (format, file, transformations);
    ``skipped_rows`` counts file rows dropped by the zero-token policy (module docstring).
    """

    name: str
    requests: tuple[Request, ...]
    source: str
    skipped_rows: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.requests, tuple):
            object.__setattr__(self, "requests", tuple(self.requests))
        reqs = self.requests
        if reqs and reqs[0].arrival_s != 0.0:
            raise TraceError(
                f"Trace {self.name!r}: the first request must arrive at 0.0, "
                f"got {reqs[0].arrival_s}"
            )
        for i in range(1, len(reqs)):
            if reqs[i].arrival_s < reqs[i - 1].arrival_s:
                raise TraceError(
                    f"Trace {self.name!r}: requests must be sorted by arrival_s (request {i} "
                    f"at {reqs[i].arrival_s} s comes after one at {reqs[i - 1].arrival_s} s)"
                )
        if self.skipped_rows < 0:
            raise TraceError(f"Trace.skipped_rows must be >= 0, got {self.skipped_rows}")

    @property
    def duration_s(self) -> float:
        """Time from the first to the last arrival."""
        return self.requests[-1].arrival_s if self.requests else 0.0

    def summary(self) -> dict[str, Any]:
        """JSON-friendly overview. Rates and means are ``None`` when undefined."""
        n = len(self.requests)
        total_in = sum(r.input_tokens for r in self.requests)
        total_out = sum(r.output_tokens for r in self.requests)
        domains: dict[str, int] = {}
        for r in self.requests:
            if r.domain is not None:
                domains[r.domain] = domains.get(r.domain, 0) + 1
        duration = self.duration_s
        out: dict[str, Any] = {
            "name": self.name,
            "source": self.source,
            "requests": n,
            "skipped_rows": self.skipped_rows,
            "duration_s": duration,
            "mean_input_tokens": total_in / n if n else None,
            "mean_output_tokens": total_out / n if n else None,
            "total_output_tokens": total_out,
            "output_tokens_per_s": total_out / duration if duration > 0 else None,
            "domains": dict(sorted(domains.items())),
            "with_acceptance_trace": sum(1 for r in self.requests if r.acc_len is not None),
        }
        with_ids = sum(1 for r in self.requests if r.hash_ids is not None)
        if with_ids:  # only then: summaries of traces without ids stay as they were
            out["with_hash_ids"] = with_ids
        return out


def transform_trace(
    trace: Trace,
    *,
    window_start_s: float | None = None,
    window_end_s: float | None = None,
    rate_scale: float = 1.0,
    sample_fraction: float | None = None,
    max_requests: int | None = None,
    seed: int = 0,
) -> Trace:
    """Apply ``load_trace``'s window / rate_scale / sample_fraction / max_requests options
    (same order and meaning) to a trace already in memory, e.g. a synthetic one.

    The result's ``source`` lists the options applied; without options ``trace`` itself is
    returned.
    """
    check_trace_options(
        window_start_s, window_end_s, rate_scale, sample_fraction, max_requests, seed
    )
    if not trace.requests:
        raise TraceError(f"trace {trace.name!r} holds no requests")
    arrivals = np.array([r.arrival_s for r in trace.requests], dtype=np.float64)
    idx = np.arange(len(arrivals))
    notes: list[str] = []

    if window_start_s is not None or window_end_s is not None:
        lo = window_start_s if window_start_s is not None else 0.0
        hi = window_end_s if window_end_s is not None else math.inf
        mask = (arrivals >= lo) & (arrivals < hi)
        if not mask.any():
            raise TraceError(
                f"trace {trace.name!r} ({trace.source}): the window [{lo}, {hi}) s holds no "
                f"requests (the trace spans 0 to {arrivals[-1]:.3f} s)"
            )
        idx = idx[mask]
        notes.append(f"window=[{lo:g},{hi:g})s")
    if rate_scale != 1.0:
        notes.append(f"rate_scale={rate_scale:g}")
    if sample_fraction is not None:
        n_keep = max(1, round(sample_fraction * len(idx)))
        rng = np.random.default_rng(seed)
        idx = np.sort(rng.choice(idx, size=n_keep, replace=False))
        notes.append(f"sample_fraction={sample_fraction:g},seed={seed}")
    if max_requests is not None and len(idx) > max_requests:
        idx = idx[:max_requests]
        notes.append(f"max_requests={max_requests}")
    if not notes:
        return trace

    base = arrivals[idx[0]]
    span_s = float((arrivals[idx[-1]] - base) / rate_scale)
    if not span_s <= MAX_SPAN_S:
        raise TraceError(
            f"trace {trace.name!r}: rate_scale={rate_scale:g} stretches it to {span_s:g} s; "
            f"a trace spans at most {MAX_SPAN_S:g} s (30 days)"
        )
    requests = tuple(
        Request(
            arrival_s=float((arrivals[i] - base) / rate_scale),
            input_tokens=trace.requests[i].input_tokens,
            output_tokens=trace.requests[i].output_tokens,
            domain=trace.requests[i].domain,
            acc_len=trace.requests[i].acc_len,
            hash_ids=trace.requests[i].hash_ids,
        )
        for i in idx.tolist()
    )
    return Trace(
        name=trace.name,
        requests=requests,
        source=f"{trace.source} ({', '.join(notes)})",
        skipped_rows=trace.skipped_rows,
    )


def check_trace_options(
    window_start_s: float | None,
    window_end_s: float | None,
    rate_scale: float,
    sample_fraction: float | None,
    max_requests: int | None,
    seed: int,
) -> None:
    """Raise ``TraceError`` for a bad window / rate_scale / sample / max / seed option
    (``load_trace`` checks them before it reads the file)."""

    def number(name: str, value: object) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise TraceError(f"{name} must be a number, got {value!r}")
        if not is_real(value):  # also an int beyond float range
            raise TraceError(f"{name} must be finite, got {value!r}")
        return float(value)

    if window_start_s is not None and number("window_start_s", window_start_s) < 0:
        raise TraceError(f"window_start_s must be >= 0, got {window_start_s}")
    if window_end_s is not None:
        end = number("window_end_s", window_end_s)
        start = window_start_s if window_start_s is not None else 0.0
        if end <= start:
            raise TraceError(
                f"window_end_s ({window_end_s}) must be greater than window_start_s ({start})"
            )
    if number("rate_scale", rate_scale) <= 0:
        raise TraceError(f"rate_scale must be > 0, got {rate_scale}")
    if sample_fraction is not None and not 0 < number("sample_fraction", sample_fraction) <= 1:
        raise TraceError(f"sample_fraction must be in (0, 1], got {sample_fraction}")
    if max_requests is not None and (not is_int(max_requests) or max_requests < 1):
        raise TraceError(f"max_requests must be an integer >= 1, got {max_requests!r}")
    if not is_int(seed) or seed < 0:
        raise TraceError(f"seed must be an integer >= 0, got {seed!r}")
