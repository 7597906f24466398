"""The spool channel: atomic step tables, a reader that never sees a torn file and never
raises, per-tier statistics with a cursor, and a writer that never blocks the engine."""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path
from typing import Any

import pytest

import specgov.adapters.spool as spool
from specgov.adapters.spool import SpoolError
from specgov.adapters.spool_stats import BackgroundStatsWriter, read_tier_stats, write_tier_stats
from specgov.adapters.spool_table import SpoolTableReader, write_step_table
from specgov.policies.common.step_table import TABLE_SCHEMA, StepTable
from specgov.policies.common.types import TierStat, TierStatsSnapshot

CANDIDATES = [0, 1, 3, 5, 7]


class Clock:
    def __init__(self, now_s: float = 1_000_000.0) -> None:
        self.now_s = now_s

    def __call__(self) -> float:
        return self.now_s


def table(version: int = 1, *, at: float = 1_000_000.0, ttl: float = 30.0) -> StepTable:
    return StepTable(((1, 5), (8, 3), (32, 0)), version=version, produced_at_s=at, ttl_s=ttl)


def snapshot(start: float, n: int = 3) -> TierStatsSnapshot:
    return TierStatsSnapshot(
        window_start_s=start,
        window_end_s=start + 1.0,
        tiers=(
            TierStat(
                slot=1,
                steps=3,
                verify_calls=n,
                requests=2 * n,
                accepted_hist=(n, 0, n, 0),
                step_time_sum_s=0.01 * n,
                step_time_count=n,
                batch_size_sum=2 * n,
            ),
        ),
    )


def envelope(**overrides: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "schema": 1,
        "kind": "specgov.step_table",
        "table": table().to_dict(),
        "candidate_steps": CANDIDATES,
        "written_at_s": 1_000_000.0,
    }
    doc.update(overrides)
    return doc


# ----------------------------------------------------------------- step table files


def test_round_trip_and_document_shape(tmp_path: Path) -> None:
    path = write_step_table(tmp_path, table(), [7, 0, 3, 1, 5, 3], written_at_s=5.0)
    doc = json.loads(path.read_text())
    assert doc == {
        "schema": 1,
        "kind": "specgov.step_table",
        "table": table().to_dict(),
        "candidate_steps": CANDIDATES,  # sorted, deduplicated
        "written_at_s": 5.0,
    }
    reader = SpoolTableReader(tmp_path, CANDIDATES, Clock())
    assert reader() == table()
    assert reader.ignored == {} and reader.last_reason is None
    # No temp file is left behind (stats/ is made for the plugin's statistics).
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stats", "step_table.json"]


def test_writer_rejects_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(SpoolError, match="StepTable"):
        write_step_table(tmp_path, {"slots": []}, CANDIDATES)  # type: ignore[arg-type]
    with pytest.raises(SpoolError, match="candidate_steps"):
        write_step_table(tmp_path, table(), [])
    with pytest.raises(SpoolError, match="candidate_steps"):
        write_step_table(tmp_path, table(), [1, -3])
    # A table naming a step outside the candidates is a daemon bug: refuse to publish it.
    with pytest.raises(ValueError, match="candidate steps"):
        write_step_table(tmp_path, table(), [0, 1, 3])
    with pytest.raises(SpoolError, match="written_at_s"):
        write_step_table(tmp_path, table(), CANDIDATES, written_at_s=float("nan"))
    assert not (tmp_path / "step_table.json").exists()


def test_failed_write_keeps_old_file_and_leaves_no_temp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_step_table(tmp_path, table(1), CANDIDATES)

    def crash(*_a: object, **_k: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(spool.os, "replace", crash)
    with pytest.raises(OSError, match="disk full"):
        write_step_table(tmp_path, table(2), CANDIDATES)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stats", "step_table.json"]
    assert SpoolTableReader(tmp_path, CANDIDATES, Clock())() == table(1)


def _bad_files() -> list[tuple[str, bytes]]:
    good = json.dumps(envelope()).encode()
    future = dict(envelope(), schema=TABLE_SCHEMA + 1, extra_field_of_future=True)
    bad_table = envelope(table=dict(table().to_dict(), slots=[[2, 3]]))  # must start at 1
    cases = [
        ("torn", good[: len(good) // 2]),
        ("torn", good[:1]),
        ("torn", b""),
        ("torn", b"\xff\xfe garbage \x00"),
        ("torn", b"{not json"),
        ("invalid", b"[1, 2, 3]"),
        ("wrong_kind", json.dumps(envelope(kind="specgov.tier_stats")).encode()),
        ("wrong_kind", json.dumps({"hello": "world"}).encode()),
        ("future_version", json.dumps(future).encode()),
        ("invalid", json.dumps(envelope(schema=0)).encode()),
        ("invalid", json.dumps(envelope(schema="1")).encode()),
        ("invalid", json.dumps(dict(envelope(), surprise=1)).encode()),
        ("invalid", json.dumps(envelope(written_at_s="now")).encode()),
        ("invalid", json.dumps(envelope(candidate_steps="0,1")).encode()),
        ("invalid", json.dumps(bad_table).encode()),
        ("invalid", json.dumps(envelope(table={"slots": [[1, 3]]})).encode()),
        ("candidate_mismatch", json.dumps(envelope(candidate_steps=[0, 1, 3])).encode()),
        ("candidate_mismatch", json.dumps(envelope(candidate_steps=[*CANDIDATES, 9])).encode()),
    ]
    # Every strict prefix of a valid document is torn, never accepted.
    cases += [("torn", good[:cut]) for cut in range(0, len(good), 7)]
    return cases


@pytest.mark.parametrize(("reason", "raw"), _bad_files())
def test_reader_ignores_bad_files(tmp_path: Path, reason: str, raw: bytes) -> None:
    (tmp_path / "step_table.json").write_bytes(raw)
    reader = SpoolTableReader(tmp_path, CANDIDATES, Clock())
    assert reader() is None
    assert reader() is None
    assert reader.ignored == {reason: 2}
    assert reader.last_reason == reason
    assert reader.reads == 1  # unchanged file: parsed once, rejected twice


def test_reader_missing_too_large_and_unreadable(tmp_path: Path) -> None:
    reader = SpoolTableReader(tmp_path, CANDIDATES, Clock(), max_bytes=64)
    assert reader() is None
    assert reader.ignored == {"missing": 1}
    write_step_table(tmp_path, table(), CANDIDATES)  # ~200 bytes
    assert reader() is None
    assert reader.ignored["too_large"] == 1
    (tmp_path / "step_table.json").unlink()
    (tmp_path / "step_table.json").mkdir()  # a directory where the file should be
    big = SpoolTableReader(tmp_path, CANDIDATES, Clock())
    assert big() is None
    assert set(big.ignored) == {"unreadable"}


def test_expiry_judged_on_every_poll_without_rereading(tmp_path: Path) -> None:
    clock = Clock(1_000_000.0)
    write_step_table(tmp_path, table(ttl=10.0), CANDIDATES)
    reader = SpoolTableReader(tmp_path, CANDIDATES, clock)
    assert reader() == table(ttl=10.0)
    clock.now_s += 9.99
    assert reader() is not None
    clock.now_s += 0.01  # produced_at_s + ttl_s: expired
    assert reader() is None
    assert reader.ignored == {"expired": 1}
    assert reader.reads == 1
    # A fresh table replaces it (new inode): read once more and followed.
    write_step_table(tmp_path, table(2, at=clock.now_s, ttl=10.0), CANDIDATES)
    assert reader() == table(2, at=clock.now_s, ttl=10.0)
    assert reader.reads == 2


def test_one_stat_per_poll_and_reread_only_on_change(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_step_table(tmp_path, table(1), CANDIDATES)
    reader = SpoolTableReader(tmp_path, CANDIDATES, Clock())
    calls = {"stat": 0, "open": 0}
    real_stat, real_open = os.stat, os.open

    def counting_stat(*args: Any, **kwargs: Any) -> Any:
        calls["stat"] += 1
        return real_stat(*args, **kwargs)

    def counting_open(*args: Any, **kwargs: Any) -> Any:
        calls["open"] += 1
        return real_open(*args, **kwargs)

    monkeypatch.setattr(spool.os, "stat", counting_stat)
    monkeypatch.setattr(spool.os, "open", counting_open)
    for _ in range(50):
        assert reader() == table(1)
    # One stat per poll, plus one of the spool directory when the file is (re)read.
    assert calls == {"stat": 51, "open": 1}
    assert reader.stats == 50 and reader.reads == 1
    monkeypatch.undo()
    write_step_table(tmp_path, table(2), CANDIDATES)
    assert reader() == table(2)
    assert reader.reads == 2


def test_concurrent_writer_never_shows_a_torn_table(tmp_path: Path) -> None:
    """A reader polling while the daemon republishes sees whole tables only."""
    write_step_table(tmp_path, table(0), CANDIDATES, fsync=False)
    reader = SpoolTableReader(tmp_path, CANDIDATES, Clock())
    stop = threading.Event()
    versions: list[int] = []

    def publish() -> None:
        version = 1
        while not stop.is_set() and version < 400:
            # Different lengths, so a mix of two files could not parse by luck.
            slots = ((1, 5), (8, 3), (32, 0)) if version % 2 else ((1, 7),)
            t = StepTable(slots, version=version, produced_at_s=1_000_000.0, ttl_s=30.0)
            write_step_table(tmp_path, t, CANDIDATES, fsync=False)
            version += 1

    thread = threading.Thread(target=publish)
    thread.start()
    try:
        while thread.is_alive():
            got = reader()
            assert got is not None, reader.ignored
            versions.append(got.version)
    finally:
        stop.set()
        thread.join()
    assert reader.ignored == {}
    assert versions == sorted(versions)
    assert reader.reads > 5


def test_rejections_are_logged_at_most_once_per_interval(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    clock = Clock()
    (tmp_path / "step_table.json").write_bytes(b"{torn")
    reader = SpoolTableReader(tmp_path, CANDIDATES, clock, log_interval_s=60.0)
    caplog.set_level(logging.INFO, logger="specgov.adapters.spool")
    for _ in range(30):  # 30 polls over 29 s
        assert reader() is None
        clock.now_s += 1.0
    torn_lines = [r for r in caplog.records if "torn" in r.getMessage()]
    assert len(torn_lines) == 1
    assert torn_lines[0].levelno == logging.WARNING
    assert str(tmp_path / "step_table.json") in torn_lines[0].getMessage()
    clock.now_s += 31.0  # past the interval: one more line, saying what it held back
    assert reader() is None
    torn_lines = [r for r in caplog.records if "torn" in r.getMessage()]
    assert len(torn_lines) == 2
    assert "29 similar message(s) suppressed" in torn_lines[1].getMessage()
    assert reader.ignored == {"torn": 31}
    # Another reason has its own budget.
    (tmp_path / "step_table.json").unlink()
    assert reader() is None
    assert any("missing" in r.getMessage() for r in caplog.records)


def test_reader_never_raises(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_step_table(tmp_path, table(), CANDIDATES)

    def broken_clock() -> float:
        raise RuntimeError("clock broke")

    reader = SpoolTableReader(tmp_path, CANDIDATES, broken_clock)
    assert reader() is None
    assert reader.ignored == {"internal_error": 1}


def test_reader_rejects_bad_construction(tmp_path: Path) -> None:
    with pytest.raises(SpoolError, match="candidate_steps"):
        SpoolTableReader(tmp_path, [], Clock())
    with pytest.raises(SpoolError, match="log_interval_s"):
        SpoolTableReader(tmp_path, CANDIDATES, Clock(), log_interval_s=-1.0)


# ---------------------------------------------------------------------- statistics


def test_stats_round_trip_with_cursor(tmp_path: Path) -> None:
    for i in range(5):
        write_tier_stats(tmp_path, snapshot(100.0 + i), writer_id="w0", written_at_s=200.0 + i)
    batch = read_tier_stats(tmp_path)
    assert [r.seq for r in batch.records] == [0, 1, 2, 3, 4]
    assert [r.snapshot for r in batch.records] == [snapshot(100.0 + i) for i in range(5)]
    assert dict(batch.cursor) == {"w0": 4}
    assert (batch.skipped, batch.gaps) == (0, 0)
    # Nothing new: nothing returned, cursor unchanged.
    again = read_tier_stats(tmp_path, batch.cursor)
    assert again.records == () and dict(again.cursor) == {"w0": 4}
    write_tier_stats(tmp_path, snapshot(105.0), writer_id="w0", written_at_s=205.0)
    newer = read_tier_stats(tmp_path, again.cursor)
    assert [r.seq for r in newer.records] == [5]


def test_stats_keep_last_n_and_count_gaps(tmp_path: Path) -> None:
    for i in range(3):
        write_tier_stats(tmp_path, snapshot(float(i)), writer_id="w0", keep=4)
    cursor = read_tier_stats(tmp_path).cursor
    for i in range(3, 12):
        write_tier_stats(tmp_path, snapshot(float(i)), writer_id="w0", keep=4)
    files = sorted(p.name for p in (tmp_path / "stats").iterdir())
    assert len(files) == 4 and files[-1] == "tier_stats.w0.000000000011.json"
    batch = read_tier_stats(tmp_path, cursor)
    assert [r.seq for r in batch.records] == [8, 9, 10, 11]
    assert batch.gaps == 5  # windows 3..7 were pruned before the daemon read them


def test_stats_several_writers_corrupt_files_and_restarts(tmp_path: Path) -> None:
    write_tier_stats(tmp_path, snapshot(1.0), writer_id="a", written_at_s=2.0)
    write_tier_stats(tmp_path, snapshot(0.0), writer_id="b", written_at_s=1.0)
    write_tier_stats(tmp_path, snapshot(2.0), writer_id="a", written_at_s=3.0)
    (tmp_path / "stats" / "tier_stats.b.000000000001.json").write_text("{torn")
    (tmp_path / "stats" / "unrelated.txt").write_text("ignored")
    batch = read_tier_stats(tmp_path)
    assert [(r.writer_id, r.seq) for r in batch.records] == [("b", 0), ("a", 0), ("a", 1)]
    assert batch.skipped == 1 and len(batch.errors) == 1
    assert dict(batch.cursor) == {"a": 1, "b": 1}  # moved past the corrupt file
    # Writer "a" restarts its sequence (its files were wiped): all of it is new again.
    for p in (tmp_path / "stats").glob("tier_stats.a.*"):
        p.unlink()
    write_tier_stats(tmp_path, snapshot(9.0), writer_id="a", written_at_s=10.0)
    batch = read_tier_stats(tmp_path, batch.cursor)
    assert [(r.writer_id, r.seq) for r in batch.records] == [("a", 0)]
    # No statistics directory yet: nothing, no error.
    assert read_tier_stats(tmp_path / "elsewhere").records == ()


def test_stats_writer_rejects_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(SpoolError, match="writer_id"):
        write_tier_stats(tmp_path, snapshot(0.0), writer_id="has.dot")
    with pytest.raises(SpoolError, match="TierStatsSnapshot"):
        write_tier_stats(tmp_path, {"tiers": []}, writer_id="w")  # type: ignore[arg-type]
    with pytest.raises(SpoolError, match="keep"):
        write_tier_stats(tmp_path, snapshot(0.0), writer_id="w", keep=0)


def test_background_writer_writes_in_order(tmp_path: Path) -> None:
    writer = BackgroundStatsWriter(tmp_path, writer_id="bg", max_queue=64)
    for i in range(10):
        assert writer.submit(snapshot(float(i)))
    assert writer.close(timeout_s=10.0)
    assert (writer.written, writer.dropped, writer.errors) == (10, 0, 0)
    batch = read_tier_stats(tmp_path)
    assert [r.snapshot.window_start_s for r in batch.records] == [float(i) for i in range(10)]


def test_background_writer_never_blocks_when_the_disk_stalls(tmp_path: Path) -> None:
    release = threading.Event()
    entered = threading.Event()

    def stalled_write(*_a: Any, **_k: Any) -> Path:
        entered.set()
        release.wait(10.0)
        return tmp_path

    writer = BackgroundStatsWriter(tmp_path, writer_id="bg", max_queue=2, write=stalled_write)
    assert writer.submit(snapshot(0.0))
    assert entered.wait(10.0)  # the thread is stuck inside the first write
    results = [writer.submit(snapshot(float(i))) for i in range(1, 20)]
    # Two fit the queue; the rest are dropped at once, never waited for.
    assert results == [True, True] + [False] * 17
    assert writer.dropped == 17
    release.set()
    assert writer.close(timeout_s=10.0)
    assert writer.written == 3


def test_background_writer_survives_unwritable_spool(tmp_path: Path) -> None:
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("a file where the spool directory should be")
    writer = BackgroundStatsWriter(blocker, writer_id="bg")
    for i in range(3):
        assert writer.submit(snapshot(float(i)))  # accepted; failure happens off-thread
    assert writer.close(timeout_s=10.0)
    assert writer.errors == 3 and writer.written == 0
    assert writer.last_error is not None
