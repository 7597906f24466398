"""The highest trace rate multiplier one replica sustains under an SLO.

Bracketing, then bisection, over the multiplier ``m`` (``transform_trace``'s
``rate_scale``: inter-arrival times divided by ``m``):

1. evaluate ``m = start`` (1.0: the trace as recorded);
2. bracket: while it passes, double ``m`` (up to ``max_multiplier``); while it fails,
   halve ``m`` (down to ``min_multiplier``), until one passing and one failing
   multiplier are known;
3. bisect the bracket ``[lo (passes), hi (fails)]`` at its midpoint until
   ``(hi - lo) / lo <= rel_tol`` (default 0.05: the answer is within 5 % of the true
   boundary, from below) or ``max_evals`` evaluations were spent.

The answer is ``lo``, the highest multiplier seen to pass. The search assumes the SLO
check is monotone in the rate (more load never helps); with a deterministic simulator
and common random numbers that is near enough, and where it is not the answer is still
a multiplier that was seen to pass. A configuration that passes even at
``max_multiplier`` reports that cap (``capped``); one that fails at
``min_multiplier`` reports no sustainable rate.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from specgov.policies.common.errors import SpecgovError
from specgov.policies.common.validation import is_int, is_real

__all__ = ["SearchError", "SearchResult", "SearchSettings", "find_max_multiplier"]


class SearchError(SpecgovError, ValueError):
    """Invalid search settings; the message names the setting and the valid range."""


@dataclass(frozen=True)
class SearchSettings:
    start: float = 1.0
    min_multiplier: float = 1.0 / 64
    max_multiplier: float = 256.0
    rel_tol: float = 0.05
    max_evals: int = 30

    def __post_init__(self) -> None:
        for name in ("start", "min_multiplier", "max_multiplier", "rel_tol"):
            value = getattr(self, name)
            if not is_real(value) or not value > 0:
                raise SearchError(f"search {name} must be a positive number, got {value!r}")
        if not self.min_multiplier <= self.start <= self.max_multiplier:
            raise SearchError(
                f"search start {self.start} must lie in [min_multiplier {self.min_multiplier}, "
                f"max_multiplier {self.max_multiplier}]"
            )
        if self.rel_tol >= 1:
            raise SearchError(f"search rel_tol must be < 1, got {self.rel_tol}")
        if not is_int(self.max_evals):
            raise SearchError(f"search max_evals must be an integer, got {self.max_evals!r}")
        if self.max_evals < 2:
            raise SearchError(f"search max_evals must be >= 2, got {self.max_evals}")

    def to_json(self) -> dict[str, Any]:
        """Every setting by its field name, in field order."""
        return asdict(self)


@dataclass
class SearchResult:
    best: float | None  # highest multiplier that passed; None: none did
    points: list[tuple[float, bool, dict[str, Any]]] = field(default_factory=list)
    capped: bool = False  # passed at max_multiplier: the true limit is higher
    converged: bool = False  # the bracket closed to rel_tol

    @property
    def evals(self) -> int:
        return len(self.points)


def find_max_multiplier(
    evaluate: Callable[[float], tuple[bool, dict[str, Any]]],
    settings: SearchSettings | None = None,
) -> SearchResult:
    """Search as the module docstring says; ``evaluate(m)`` -> (passes, metrics)."""
    s = settings or SearchSettings()
    result = SearchResult(best=None)

    def probe(m: float) -> bool:
        ok, metrics = evaluate(m)
        result.points.append((m, ok, metrics))
        return ok

    m = s.start
    lo: float | None = None
    hi: float | None = None
    if probe(m):
        lo = m
        while hi is None and result.evals < s.max_evals:
            if m >= s.max_multiplier:
                result.capped = True
                break
            m = min(m * 2, s.max_multiplier)
            if probe(m):
                lo = m
            else:
                hi = m
    else:
        hi = m
        while lo is None and result.evals < s.max_evals:
            if m <= s.min_multiplier:
                break
            m = max(m / 2, s.min_multiplier)
            if probe(m):
                lo = m
            else:
                hi = m
    if lo is not None and hi is not None:
        while (hi - lo) / lo > s.rel_tol and result.evals < s.max_evals:
            mid = (lo + hi) / 2
            if probe(mid):
                lo = mid
            else:
                hi = mid
        result.converged = (hi - lo) / lo <= s.rel_tol
    result.best = lo
    result.points.sort(key=lambda p: p[0])
    return result
