"""Property tests of the spool readers (issue 9, section 3): whatever bytes or JSON sit in
a step-table or statistics file, the plugin's reader gives a valid table or a typed,
logged rejection, and the daemon's reader gives valid records or a counted, described
skip; nothing escapes to SGLang's hot path or the daemon's loop.

"Typed" is checked strictly: the reader's catch-all reason ``internal_error`` (an
exception it did not expect) fails the property, so an escaping exception cannot hide
behind the catch-all. Each test labels its outcomes with ``hypothesis.event``; run with
``--hypothesis-show-statistics`` to see how many examples gave a table, and which
rejections the rest got (the closing note of issue 9 quotes such a run).
"""

from __future__ import annotations

import json
import logging
import math
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from specgov.adapters import spool, spool_table
from specgov.adapters.spool import DEFAULT_MAX_TABLE_TTL_S
from specgov.adapters.spool_stats import TierStatsRecord, read_tier_stats, write_tier_stats
from specgov.adapters.spool_table import SpoolTableReader
from specgov.policies.common.step_table import StepTable
from specgov.policies.common.types import TierStat, TierStatsSnapshot

CANDIDATES = [0, 1, 3, 5, 7]
NOW = 1_700_000_000.0
EXAMPLES = 200
TYPED_REASONS = {
    spool_table.MISSING,
    spool_table.UNREADABLE,
    spool_table.TOO_LARGE,
    spool_table.TORN,
    spool_table.WRONG_KIND,
    spool_table.FUTURE_VERSION,
    spool_table.INVALID,
    spool_table.CANDIDATE_MISMATCH,
    spool_table.EXPIRED,
    spool_table.WRONG_OWNER,
    spool_table.INSECURE_DIR,
    spool_table.FUTURE_DATED,
}
assert spool_table.INTERNAL_ERROR not in TYPED_REASONS

JSON_LEAVES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**30), max_value=10**30),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=12),
)
JSON = st.recursive(
    JSON_LEAVES,
    lambda inner: (
        st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=5)
    ),
    max_leaves=25,
)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture(scope="module")
def spool_dir() -> Iterator[Path]:
    # One directory for every example (hypothesis runs many per test function).
    with tempfile.TemporaryDirectory(prefix="specgov-prop-") as folder:
        yield Path(folder)


@pytest.fixture
def spool_log() -> Iterator[_Records]:
    handler = _Records()
    log = logging.getLogger("specgov.adapters.spool")
    log.addHandler(handler)
    old = log.level
    log.setLevel(logging.INFO)
    try:
        yield handler
    finally:
        log.removeHandler(handler)
        log.setLevel(old)


def valid_table() -> dict[str, Any]:
    return StepTable(((1, 5), (8, 3), (32, 0)), version=3, produced_at_s=NOW, ttl_s=30.0).to_dict()


def envelope(**overrides: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "schema": 1,
        "kind": "specgov.step_table",
        "table": valid_table(),
        "candidate_steps": CANDIDATES,
        "written_at_s": NOW,
    }
    doc.update(overrides)
    return doc


@st.composite
def near_valid_documents(draw: st.DrawFn) -> Any:
    """A valid envelope with one or two things changed: where parsers break."""
    doc = envelope()
    for _ in range(draw(st.integers(1, 2))):
        where = draw(
            st.sampled_from(["benign", "benign", "top", "table", "slots", "drop", "extra"])
        )
        if where == "benign" and isinstance(doc.get("table"), dict):
            # Values a daemon could write: the table must be followed, TTL capped.
            doc["table"]["ttl_s"] = draw(st.floats(1e-3, 1e12))
            doc["table"]["produced_at_s"] = NOW + draw(st.floats(-1e4, 1e4))
            doc["table"]["version"] = draw(st.integers(0, 2**62))
            doc["table"]["slots"] = [
                [1, draw(st.sampled_from(CANDIDATES))],
                [draw(st.integers(2, 512)), draw(st.sampled_from(CANDIDATES))],
            ]
        elif where == "top":
            doc[draw(st.sampled_from(sorted(doc)))] = draw(JSON)
        elif where == "table" and isinstance(doc.get("table"), dict):
            key = draw(st.sampled_from(["schema", "version", "produced_at_s", "ttl_s", "reason"]))
            doc["table"][key] = draw(JSON | st.floats())
        elif where == "slots" and isinstance(doc.get("table"), dict):
            doc["table"]["slots"] = draw(st.lists(st.lists(JSON_LEAVES, max_size=3), max_size=4))
        elif where == "drop" and doc:
            del doc[draw(st.sampled_from(sorted(doc)))]
        else:
            doc[draw(st.text(max_size=6))] = draw(JSON)
    return doc


def _encode(doc: Any) -> bytes:
    # allow_nan: NaN/Infinity are not JSON, but a file may hold them anyway.
    return json.dumps(doc, allow_nan=True).encode()


def _check_table_outcome(reader: SpoolTableReader, got: StepTable | None, log: _Records) -> None:
    if got is not None:
        event("valid table")
        assert isinstance(got, StepTable)
        got.validate_against(CANDIDATES)
        assert math.isfinite(got.expires_at_s)
        assert got.ttl_s <= DEFAULT_MAX_TABLE_TTL_S
        assert reader.last_reason is None
        return
    reason = reader.last_reason
    event(f"rejected: {reason}")
    assert reason in TYPED_REASONS, (reason, reader.ignored)
    assert sum(reader.ignored.values()) == 1
    # Logged, naming the file and the reason.
    assert any(str(reader.path) in m and f"({reason}:" in m for m in log.messages), log.messages


def _read_table(spool_dir: Path, raw: bytes, log: _Records) -> None:
    (spool_dir / spool_table.TABLE_FILENAME).write_bytes(raw)
    log.messages.clear()
    reader = SpoolTableReader(spool_dir, CANDIDATES, lambda: NOW)
    got = reader()
    _check_table_outcome(reader, got, log)


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(raw=st.binary(max_size=512))
@example(raw=b"")
@example(raw=b"\xff\xfe")
@example(raw=b"[" * 5000 + b"]" * 5000)  # deeper than json's decoder recurses
@example(raw=b'{"kind": "specgov.step_table", "schema": 1e999}')
def test_arbitrary_bytes_in_a_table_file(spool_dir: Path, spool_log: _Records, raw: bytes) -> None:
    _read_table(spool_dir, raw, spool_log)


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(doc=JSON)
def test_arbitrary_json_in_a_table_file(spool_dir: Path, spool_log: _Records, doc: Any) -> None:
    _read_table(spool_dir, _encode(doc), spool_log)


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(doc=near_valid_documents())
@example(doc=envelope())
@example(doc=envelope(table=dict(valid_table(), ttl_s=31 * 365 * 86_400.0)))
@example(doc=envelope(table=dict(valid_table(), produced_at_s=1e300)))
@example(doc=envelope(table=dict(valid_table(), ttl_s=float("nan"))))
@example(doc=envelope(written_at_s=10**400))
@example(doc=envelope(table={"slots": [[1, 5]] * 3}))
def test_near_valid_table_documents(spool_dir: Path, spool_log: _Records, doc: Any) -> None:
    _read_table(spool_dir, _encode(doc), spool_log)


# ---------------------------------------------------------------------- statistics


def valid_stats_document(seq: int) -> dict[str, Any]:
    snap = TierStatsSnapshot(
        window_start_s=NOW,
        window_end_s=NOW + 1.0,
        tiers=(
            TierStat(
                slot=1,
                steps=3,
                verify_calls=2,
                requests=4,
                accepted_hist=(1, 1, 1, 1),
                step_time_sum_s=0.02,
                step_time_count=2,
                batch_size_sum=4,
            ),
        ),
    )
    return {
        "schema": 1,
        "kind": "specgov.tier_stats",
        "writer_id": "w",
        "seq": seq,
        "written_at_s": NOW,
        "snapshot": snap.to_dict(),
    }


@st.composite
def stats_contents(draw: st.DrawFn) -> bytes:
    kind = draw(st.sampled_from(["bytes", "json", "near"]))
    if kind == "bytes":
        return draw(st.binary(max_size=512))
    if kind == "json":
        return _encode(draw(JSON))
    doc = valid_stats_document(1)
    key = draw(st.sampled_from(sorted(doc)))
    if draw(st.integers(0, 3)) == 0:
        doc["written_at_s"] = draw(st.floats(0.0, 1e10))  # any time a writer could stamp
    elif draw(st.booleans()):
        doc[key] = draw(JSON)
    elif isinstance(doc["snapshot"], dict):
        inner = draw(st.sampled_from(sorted(doc["snapshot"])))
        doc["snapshot"][inner] = draw(JSON)
    return _encode(doc)


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(raw=stats_contents())
@example(raw=b"{" * 5000)
@example(raw=b"[" * 5000 + b"]" * 5000)
@example(raw=_encode(valid_stats_document(1)))
def test_arbitrary_statistics_files(spool_dir: Path, raw: bytes) -> None:
    stats_dir = spool_dir / spool.STATS_DIRNAME
    for old in stats_dir.glob("tier_stats.*"):
        old.unlink()
    # A good window before and after the one under test: neither may be lost to it.
    write_tier_stats(
        spool_dir,
        TierStatsSnapshot.from_dict(valid_stats_document(0)["snapshot"]),
        writer_id="w",
        seq=0,
    )
    (stats_dir / "tier_stats.w.000000000001.json").write_bytes(raw)
    write_tier_stats(
        spool_dir,
        TierStatsSnapshot.from_dict(valid_stats_document(2)["snapshot"]),
        writer_id="w",
        seq=2,
    )
    batch = read_tier_stats(spool_dir)
    seqs = sorted(r.seq for r in batch.records)
    assert all(isinstance(r, TierStatsRecord) for r in batch.records)
    assert batch.cursor == {"w": 2}
    if 1 in seqs:
        event("valid statistics window")
        assert seqs == [0, 1, 2] and batch.skipped == 0
    else:
        event("skipped, described")
        assert seqs == [0, 2] and batch.skipped == 1
        assert len(batch.errors) == 1 and "tier_stats.w.000000000001.json" in batch.errors[0]
