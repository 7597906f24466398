"""One error root: every exception class in specgov's source derives from SpecgovError,
the root's docstring names each one, and the retry typing holds where the IO seams use it."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import click
import pytest

import specgov.policies.common.errors as errors_module
from specgov.adapters.errors import (
    PermanentScrapeError,
    ResponseFormatError,
    TemporaryScrapeError,
)
from specgov.controller.cli.control_client import (
    ControlAuthError,
    DaemonUnreachableError,
)
from specgov.controller.cli.format import BadInput
from specgov.controller.daemon.store_errors import StoreRefused, StoreUnavailable
from specgov.policies.common.errors import PermanentError, SpecgovError, TemporaryError
from specgov.policies.daemon.spec import PolicySpecError, parse_policy_spec
from specgov.simulator.replay.runner import parse_policy

REPO = Path(__file__).resolve().parents[1]
SOURCE_ROOTS = ("policies", "controller", "adapters", "simulator")


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(("specgov", *parts))


def _exception_classes() -> list[tuple[str, type[BaseException]]]:
    """Every class defined at module level in the source that is an exception."""
    found = []
    for root in SOURCE_ROOTS:
        for path in sorted((REPO / root).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            names = [node.name for node in tree.body if isinstance(node, ast.ClassDef)]
            if not names:
                continue
            module = importlib.import_module(_module_name(path))
            for name in names:
                cls = getattr(module, name)
                if isinstance(cls, type) and issubclass(cls, BaseException):
                    found.append((f"{_module_name(path)}.{name}", cls))
    return found


def test_every_exception_class_derives_from_the_root_and_is_in_its_tree() -> None:
    classes = _exception_classes()
    # The walk finds the known ones (a walk that found nothing would pass vacuously).
    assert len(classes) > 60
    outside = [name for name, cls in classes if not issubclass(cls, SpecgovError)]
    assert outside == [], f"not under SpecgovError: {outside}"
    doc = errors_module.__doc__ or ""
    unnamed = [name for name, _ in classes if name.rsplit(".", 1)[1] not in doc]
    assert unnamed == [], f"missing from the tree in errors.py's docstring: {unnamed}"


def test_one_class_per_name() -> None:
    by_name: dict[str, list[str]] = {}
    for qualified, _ in _exception_classes():
        by_name.setdefault(qualified.rsplit(".", 1)[1], []).append(qualified)
    twice = {name: where for name, where in by_name.items() if len(where) > 1}
    assert twice == {}


def test_retry_typing_at_the_io_seams() -> None:
    assert issubclass(TemporaryScrapeError, TemporaryError)
    assert issubclass(ResponseFormatError, TemporaryError)
    assert issubclass(PermanentScrapeError, PermanentError)
    assert issubclass(StoreUnavailable, TemporaryError)
    assert issubclass(StoreRefused, PermanentError)
    assert issubclass(DaemonUnreachableError, TemporaryError)
    assert issubclass(ControlAuthError, PermanentError)
    assert not issubclass(TemporaryError, PermanentError)
    assert not issubclass(PermanentError, TemporaryError)


def test_builtin_bases_are_kept_for_the_callers_that_catch_them() -> None:
    # click turns a ClickException into its one-line message and exit code 2.
    assert issubclass(BadInput, click.ClickException) and BadInput("x").exit_code == 2
    assert issubclass(DaemonUnreachableError, ConnectionError)
    with pytest.raises(ValueError, match="unknown policy kind 'fast'"):
        parse_policy_spec("fast")


def test_replay_and_daemon_raise_the_same_policy_spec_error() -> None:
    with pytest.raises(PolicySpecError) as daemon:
        parse_policy_spec("fast")
    with pytest.raises(PolicySpecError) as replay:
        parse_policy("fast")
    assert type(daemon.value) is type(replay.value) is PolicySpecError
    assert "replay policies" in str(replay.value)
