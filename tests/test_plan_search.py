"""Rate-multiplier search: bracketing + bisection to the stated tolerance."""

from __future__ import annotations

from typing import Any

import pytest

from specgov.simulator.planning.search import SearchError, SearchSettings, find_max_multiplier


def _threshold(limit: float, seen: list[float]) -> Any:
    def evaluate(m: float) -> tuple[bool, dict[str, Any]]:
        seen.append(m)
        return m <= limit, {"m": m}

    return evaluate


@pytest.mark.parametrize("limit", [0.3, 1.0, 7.3, 100.0])
def test_finds_the_boundary_within_the_tolerance_from_below(limit: float) -> None:
    seen: list[float] = []
    result = find_max_multiplier(_threshold(limit, seen), SearchSettings(rel_tol=0.05))
    assert result.best is not None
    assert result.best <= limit < result.best * 1.05 + 1e-12
    assert result.converged and not result.capped
    assert result.evals == len(seen) <= 30
    # Points come back sorted, each with its own metrics.
    assert [p[0] for p in result.points] == sorted(seen)
    assert all(p[2] == {"m": p[0]} and p[1] == (p[0] <= limit) for p in result.points)


def test_tolerance_decides_the_number_of_bisections() -> None:
    coarse: list[float] = []
    fine: list[float] = []
    find_max_multiplier(_threshold(7.3, coarse), SearchSettings(rel_tol=0.25))
    find_max_multiplier(_threshold(7.3, fine), SearchSettings(rel_tol=0.01))
    assert len(fine) > len(coarse)


def test_passing_at_the_cap_is_reported_as_capped() -> None:
    result = find_max_multiplier(lambda m: (True, {}), SearchSettings(max_multiplier=16))
    assert result.best == 16 and result.capped and not result.converged
    assert [p[0] for p in result.points] == [1, 2, 4, 8, 16]


def test_failing_at_the_floor_has_no_answer() -> None:
    result = find_max_multiplier(lambda m: (False, {}), SearchSettings(min_multiplier=0.25))
    assert result.best is None
    assert [p[0] for p in result.points] == [0.25, 0.5, 1.0]


def test_max_evals_bounds_the_work() -> None:
    seen: list[float] = []
    result = find_max_multiplier(_threshold(7.3, seen), SearchSettings(rel_tol=1e-9, max_evals=6))
    assert len(seen) == 6 and not result.converged
    assert result.best is not None and result.best <= 7.3


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"rel_tol": 0}, "rel_tol must be a positive number"),
        ({"rel_tol": 1.5}, "rel_tol must be < 1"),
        ({"start": 1000}, "must lie in"),
        ({"max_evals": 1}, "max_evals must be >= 2"),
        ({"min_multiplier": True}, "min_multiplier must be a positive number"),
    ],
)
def test_bad_settings(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(SearchError, match=match):
        SearchSettings(**kwargs)
