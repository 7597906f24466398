"""The spool belongs to its owner (issue 9, section 2; docs/spool-security.md).

Each failure the issue reproduced has a test here that fails on the code before it:

* a table written by another user (``nobody``) was followed: now ``wrong_owner``;
* a table with a 31-year TTL pinned the engine: now followed for at most the TTL cap;
* the default ``/tmp/specgov-spool`` could be pre-created by another local user: the
  default is no longer world-writable ground, and a spool another user owns or can
  write is refused by the daemon's writer, the plugin and the daemon's reader;
* a daemon running as another user could not read the 0600 statistics and said
  nothing: with a spool group they are 0640 in that group, and an unreadable file is
  logged with its path and the fix.

The decisions are pure functions of ``os.stat`` results (``spool_dir_problem``,
``table_owner_problem``, ``default_spool_dir`` with an injected ``stat``), tested with
fake stat results for every uid/gid case. Real files check the modes specgov creates.
Where the tests run as root (real uid changes are possible), the two-user deployment
runs for real: a daemon process and a server process with different uids sharing a
group; elsewhere those tests are skipped and the seams cover the decisions.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from specgov.adapters.sglang_plugin import SpecgovAdaptiveParams
from specgov.adapters.spool import (
    DEFAULT_MAX_TABLE_TTL_S,
    SpoolError,
    SpoolSecurityError,
    SpoolSettings,
    check_spool_dir,
    default_spool_dir,
    ensure_spool_dir,
    spool_dir_problem,
    table_owner_problem,
)
from specgov.adapters.spool_stats import read_tier_stats, write_tier_stats
from specgov.adapters.spool_table import SpoolTableReader, write_step_table
from specgov.adapters.tp_sync import LocalChannel
from specgov.policies.common.step_table import StepTable
from specgov.policies.common.types import TierStat, TierStatsSnapshot
from specgov.policies.engine.ema import EmaPolicy

CANDIDATES = [0, 1, 3, 5, 7]
ME = os.geteuid()
OTHER = 65534 if ME != 65534 else 65533  # "nobody"
IS_ROOT = ME == 0
NOW = 1_700_000_000.0
THIRTY_ONE_YEARS_S = 31 * 365 * 86_400.0
# A group for the two-user cases: any gid works for root; otherwise one of ours.
SHARED_GID = 40100 if IS_ROOT else os.getgid()
needs_root = pytest.mark.skipif(
    not IS_ROOT, reason="changing file owners and running as other users needs root"
)


class Clock:
    def __init__(self, now_s: float = NOW) -> None:
        self.now_s = now_s

    def __call__(self) -> float:
        return self.now_s


@dataclass(frozen=True)
class FakeStat:
    """The three fields the decisions read, for uids and gids a test cannot create."""

    st_mode: int
    st_uid: int
    st_gid: int = 0


def dir_stat(mode: int, uid: int = ME, gid: int = 0) -> FakeStat:
    return FakeStat(stat.S_IFDIR | mode, uid, gid)


def table(*, steps: int = 0, ttl: float = 30.0, at: float = NOW, version: int = 1) -> StepTable:
    return StepTable(((1, steps),), version=version, produced_at_s=at, ttl_s=ttl)


def snapshot(start: float = NOW) -> TierStatsSnapshot:
    return TierStatsSnapshot(
        window_start_s=start,
        window_end_s=start + 1.0,
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


def mode_of(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


# --------------------------------------------------- the directory decision (seam)

TRUSTED = frozenset({ME, 0})


@pytest.mark.parametrize(
    ("st", "group", "fragment"),
    [
        # /tmp-like: everyone may create entries, sticky or not.
        (dir_stat(0o777), None, "writable by every user"),
        (dir_stat(0o1777), None, "writable by every user"),
        (dir_stat(0o757), None, "chmod o-w"),
        # Group-writable without a configured group, or with another group.
        (dir_stat(0o770, gid=123), None, "writable by its group (gid 123"),
        (dir_stat(0o770, gid=123), 456, "chgrp 456"),
        # Pre-created by another local user: whatever its mode, that user controls it.
        (dir_stat(0o700, uid=OTHER), None, f"owned by uid {OTHER}"),
        (dir_stat(0o755, uid=OTHER), None, "not by a trusted user"),
        (FakeStat(stat.S_IFREG | 0o600, ME), None, "not a directory"),
    ],
)
def test_refused_spool_directories(st: FakeStat, group: int | None, fragment: str) -> None:
    path = Path("/srv/spool")
    problem = spool_dir_problem(path, st, group_gid=group, trusted_uids=TRUSTED)
    assert problem is not None and fragment in problem
    assert str(path) in problem


@pytest.mark.parametrize(
    ("st", "group"),
    [
        (dir_stat(0o700), None),
        (dir_stat(0o755), None),  # readable by others, writable only by its owner
        (dir_stat(0o750, uid=0), None),  # root's (e.g. /run/specgov made by systemd)
        (dir_stat(0o2770, gid=SHARED_GID), SHARED_GID),  # the two-user layout
        (dir_stat(0o2750, gid=SHARED_GID), SHARED_GID),
        (dir_stat(0o750, gid=99), SHARED_GID),  # group may read, not write: fine
    ],
)
def test_accepted_spool_directories(st: FakeStat, group: int | None) -> None:
    assert spool_dir_problem(Path("/srv/spool"), st, group_gid=group, trusted_uids=TRUSTED) is None


def test_owner_check_can_be_skipped_for_subdirectories_only() -> None:
    # stats/ is checked for its mode only: whoever made it could write into the spool,
    # which the spool's own check vouched for.
    st = dir_stat(0o2770, uid=OTHER, gid=SHARED_GID)
    assert spool_dir_problem(Path("s"), st, group_gid=SHARED_GID, trusted_uids=None) is None
    assert spool_dir_problem(Path("s"), st, group_gid=None, trusted_uids=None) is not None


def test_check_spool_dir_uses_the_stat_seam_for_the_daemon_and_the_plugin() -> None:
    stats = {
        Path("/srv/spool"): dir_stat(0o2750, uid=4001, gid=SHARED_GID),
        Path("/srv/spool/stats"): dir_stat(0o2770, uid=4001, gid=SHARED_GID),
    }

    def fake_stat(path: Path) -> FakeStat:
        return stats[Path(path)]

    # The daemon (uid 4001) trusts itself; the server (another uid) trusts uid 4001
    # only when told it is the daemon's.
    check_spool_dir("/srv/spool", group_gid=SHARED_GID, trusted_uids={4001, 0}, stat=fake_stat)
    with pytest.raises(SpoolSecurityError, match="owned by uid 4001"):
        check_spool_dir("/srv/spool", group_gid=SHARED_GID, trusted_uids={4002, 0}, stat=fake_stat)
    server = SpoolSettings(group_gid=SHARED_GID, daemon_uid=4001)
    check_spool_dir(
        "/srv/spool", group_gid=SHARED_GID, trusted_uids=server.trusted_uids, stat=fake_stat
    )
    # A group-writable stats/ without the group configured is refused too.
    with pytest.raises(SpoolSecurityError, match="stats is writable by its group"):
        check_spool_dir("/srv/spool", trusted_uids={4001, 0}, stat=fake_stat)


def test_table_owner_decision() -> None:
    assert table_owner_problem(Path("t.json"), 4001, 4001) is None
    problem = table_owner_problem(Path("t.json"), OTHER, 4001)
    assert problem is not None
    assert f"uid {OTHER}" in problem and "SPECGOV_DAEMON_UID" in problem


# ---------------------------------------------------------------- the default spool


def _fake_fs(entries: dict[str, FakeStat]) -> Any:
    def fake_stat(path: str) -> FakeStat:
        try:
            return entries[str(path)]
        except KeyError:
            raise FileNotFoundError(path) from None

    return fake_stat


def test_default_spool_is_the_private_runtime_directory() -> None:
    fs = _fake_fs({"/run/user/1000": dir_stat(0o700, uid=1000)})
    env = {"XDG_RUNTIME_DIR": "/run/user/1000", "HOME": "/home/u"}
    assert default_spool_dir(env, uid=1000, stat=fs) == Path("/run/user/1000/specgov")


def test_default_spool_skips_a_runtime_directory_that_is_not_private() -> None:
    env = {"XDG_RUNTIME_DIR": "/tmp", "HOME": "/home/u"}
    fs = _fake_fs({"/tmp": dir_stat(0o1777, uid=0)})
    assert default_spool_dir(env, uid=1000, stat=fs) == Path("/home/u/.local/state/specgov/spool")
    # Someone else's runtime directory, or a relative path: not used either.
    fs = _fake_fs({"/run/user/1001": dir_stat(0o700, uid=1001)})
    env = {"XDG_RUNTIME_DIR": "/run/user/1001", "XDG_STATE_HOME": "/var/lib/u"}
    assert default_spool_dir(env, uid=1000, stat=fs) == Path("/var/lib/u/specgov/spool")
    env = {"XDG_RUNTIME_DIR": "run/user/1000", "HOME": "/home/u"}
    fs = _fake_fs({"run/user/1000": dir_stat(0o700, uid=1000)})
    assert default_spool_dir(env, uid=1000, stat=fs) == Path("/home/u/.local/state/specgov/spool")


def test_default_spool_for_a_service_user_and_for_root() -> None:
    # systemd's RuntimeDirectory=specgov makes /run/specgov owned by the service user.
    fs = _fake_fs({"/run/specgov": dir_stat(0o750, uid=990)})
    assert default_spool_dir({"HOME": "/var/lib/sg"}, uid=990, stat=fs) == Path("/run/specgov")
    # Owned by another user: not ours to use.
    assert default_spool_dir({"HOME": "/var/lib/x"}, uid=991, stat=fs) == Path(
        "/var/lib/x/.local/state/specgov/spool"
    )
    # Root may create /run/specgov (/run is root's, 0755).
    assert default_spool_dir({}, uid=0, stat=_fake_fs({})) == Path("/run/specgov")


def test_default_spool_is_never_in_a_world_writable_directory() -> None:
    # The old default, /tmp/specgov-spool, lived in /tmp, where any local user can
    # create it first. Whatever the environment, the default is not under /tmp now.
    envs: list[dict[str, str]] = [
        {},
        {"HOME": "/home/u"},
        {"XDG_RUNTIME_DIR": "/tmp", "HOME": "/home/u"},
        {"XDG_RUNTIME_DIR": "/tmp/x", "XDG_STATE_HOME": "/var/lib/u"},
    ]
    fs = _fake_fs({"/tmp": dir_stat(0o1777, uid=0), "/tmp/x": dir_stat(0o777, uid=1000)})
    for env in envs:
        for uid in (0, 1000):
            path = default_spool_dir(env, uid=uid, stat=fs)
            assert not str(path).startswith("/tmp"), (env, uid, path)
    assert not str(default_spool_dir()).startswith("/tmp")


# ------------------------------------------------------ real files: modes specgov makes


@pytest.fixture
def zero_umask() -> Iterator[None]:
    # The modes must not depend on the process's umask.
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


def test_single_user_spool_is_created_private(tmp_path: Path, zero_umask: None) -> None:
    spool = tmp_path / "spool"
    path = write_step_table(spool, table(), CANDIDATES)
    assert mode_of(spool) == 0o700
    assert mode_of(spool / "stats") == 0o700
    assert mode_of(path) == 0o600
    stats = write_tier_stats(spool, snapshot(), writer_id="w")
    assert mode_of(stats) == 0o600


def test_group_spool_is_created_for_two_users(tmp_path: Path, zero_umask: None) -> None:
    spool = tmp_path / "spool"
    path = write_step_table(spool, table(), CANDIDATES, group_gid=SHARED_GID)
    # The spool: the daemon writes, the group reads; stats/: the server (a group member)
    # writes there too. setgid, so every file inside is in the group.
    assert mode_of(spool) == 0o2750 and spool.stat().st_gid == SHARED_GID
    assert mode_of(spool / "stats") == 0o2770 and (spool / "stats").stat().st_gid == SHARED_GID
    assert mode_of(path) == 0o640 and path.stat().st_gid == SHARED_GID
    settings = SpoolSettings(group_gid=SHARED_GID)
    stats = write_tier_stats(spool, snapshot(), writer_id="w", settings=settings)
    # Readable by a daemon running as another user of the group (issue 9: they were 0600).
    assert mode_of(stats) == 0o640 and stats.stat().st_gid == SHARED_GID
    assert read_tier_stats(spool, group_gid=SHARED_GID).records[0].writer_id == "w"


def test_existing_directories_keep_the_operators_modes(tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    spool.mkdir(mode=0o755)
    spool.chmod(0o755)
    ensure_spool_dir(spool)
    assert mode_of(spool) == 0o755  # not ours to change; safe as it is
    assert mode_of(spool / "stats") == 0o700  # made by us


def test_world_writable_spool_is_refused_everywhere(tmp_path: Path) -> None:
    # The old default's failure: a spool anyone may write, e.g. one another user made
    # in /tmp. The daemon's writer, its reader and the plugin refuse it, saying how.
    spool = tmp_path / "spool"
    spool.mkdir()
    spool.chmod(0o777)
    with pytest.raises(SpoolSecurityError, match=r"writable by every user.*chmod o-w"):
        write_step_table(spool, table(), CANDIDATES)
    assert not (spool / "step_table.json").exists()
    with pytest.raises(SpoolSecurityError, match=str(spool)):
        read_tier_stats(spool)
    with pytest.raises(SpoolSecurityError):
        write_tier_stats(spool, snapshot(), writer_id="w")
    plugin = SpecgovAdaptiveParams(
        3, None, spool_dir=spool, original=None, channel_factory=LocalChannel, clock=Clock()
    )
    assert plugin.mode == "passthrough"
    assert plugin.disabled_reason is not None
    assert str(spool) in plugin.disabled_reason and "chmod o-w" in plugin.disabled_reason


def test_reader_stops_following_when_the_spool_turns_insecure(tmp_path: Path) -> None:
    clock = Clock()
    write_step_table(tmp_path, table(steps=5), CANDIDATES)
    reader = SpoolTableReader(tmp_path, CANDIDATES, clock)
    assert reader() == table(steps=5)
    tmp_path.chmod(0o777)
    try:
        (tmp_path / "step_table.json").write_bytes((tmp_path / "step_table.json").read_bytes())
        assert reader() is None
        assert reader.last_reason == "insecure_dir"
    finally:
        tmp_path.chmod(0o700)


@needs_root
def test_spool_pre_created_by_another_user_is_refused(tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    spool.mkdir(mode=0o755)
    os.chown(spool, OTHER, OTHER)
    with pytest.raises(SpoolSecurityError, match=f"owned by uid {OTHER}"):
        write_step_table(spool, table(), CANDIDATES)


# ------------------------------------------------------------------ table owners


@needs_root
def test_table_written_by_nobody_is_not_followed(tmp_path: Path) -> None:
    # Issue 9's demonstration: a table written by uid nobody forced 0 draft steps with a
    # 31-year TTL. The plugin now answers as SGLang would, and says why once.
    path = write_step_table(tmp_path, table(steps=0, ttl=THIRTY_ONE_YEARS_S), CANDIDATES)
    os.chown(path, OTHER, OTHER)
    clock = Clock()
    plugin = SpecgovAdaptiveParams(
        3,
        None,
        spool_dir=tmp_path,
        original=None,
        channel_factory=LocalChannel,
        clock=clock,
        poll_every_batches=1,
        stats_writer=None,
    )
    ema = EmaPolicy(3)
    for _ in range(50):
        assert plugin.get_steps_for_batch(1) == ema.get_steps_for_batch(1) != 0
        plugin.on_verify_complete([3], 1)
        ema.on_verify_complete([3], 1)
    assert plugin.table is None
    reader = plugin.reader
    assert reader is not None and reader.last_reason == "wrong_owner"


def test_table_not_owned_by_the_configured_daemon_uid_is_ignored(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # The uid seam: the file is ours, the daemon is configured as another user.
    write_step_table(tmp_path, table(steps=5), CANDIDATES)
    clock = Clock()
    settings = SpoolSettings(daemon_uid=OTHER)
    reader = SpoolTableReader(tmp_path, CANDIDATES, clock, settings=settings)
    caplog.set_level(logging.WARNING, logger="specgov.adapters.spool")
    for _ in range(20):
        assert reader() is None
        clock.now_s += 1.0
    assert reader.ignored == {"wrong_owner": 20}
    lines = [r.getMessage() for r in caplog.records if "wrong_owner" in r.getMessage()]
    assert len(lines) == 1  # rate-limited: one line, not one per poll
    assert f"not by the daemon's uid {OTHER}" in lines[0]
    # Configured as this uid: followed.
    mine = SpoolTableReader(tmp_path, CANDIDATES, clock, settings=SpoolSettings(daemon_uid=ME))
    assert mine() == table(steps=5)


def test_plugin_reads_the_daemon_uid_from_its_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_step_table(tmp_path, table(steps=5), CANDIDATES)
    monkeypatch.setenv("SPECGOV_DAEMON_UID", str(OTHER))
    plugin = SpecgovAdaptiveParams(
        3,
        None,
        spool_dir=tmp_path,
        original=None,
        channel_factory=LocalChannel,
        clock=Clock(),
        poll_every_batches=1,
        stats_writer=None,
    )
    plugin.get_steps_for_batch(1)
    assert plugin.reader is not None and plugin.reader.last_reason == "wrong_owner"
    monkeypatch.setenv("SPECGOV_DAEMON_UID", "no-such-user-here")
    bad = SpecgovAdaptiveParams(
        3, None, spool_dir=tmp_path, original=None, channel_factory=LocalChannel, clock=Clock()
    )
    assert bad.mode == "passthrough"
    assert bad.disabled_reason is not None and "SPECGOV_DAEMON_UID" in bad.disabled_reason


# ------------------------------------------------------------------------ TTL cap


def test_a_31_year_ttl_is_not_followed_past_the_cap(tmp_path: Path) -> None:
    clock = Clock()
    write_step_table(tmp_path, table(steps=0, ttl=THIRTY_ONE_YEARS_S), CANDIDATES)
    reader = SpoolTableReader(tmp_path, CANDIDATES, clock)
    followed = reader()
    assert followed is not None and followed.ttl_s == DEFAULT_MAX_TABLE_TTL_S
    assert reader.capped == 1
    clock.now_s += DEFAULT_MAX_TABLE_TTL_S - 0.5
    assert reader() is not None
    clock.now_s += 1.0
    assert reader() is None and reader.last_reason == "expired"
    assert reader.capped == 1  # judged once per file version


def test_ttl_cap_from_the_environment_and_future_dated_tables(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("SPECGOV_MAX_TABLE_TTL_S", "60")
    settings = SpoolSettings.from_env()
    assert settings.max_table_ttl_s == 60.0
    clock = Clock()
    caplog.set_level(logging.WARNING, logger="specgov.adapters.spool")
    write_step_table(tmp_path, table(ttl=3600.0), CANDIDATES)
    reader = SpoolTableReader(tmp_path, CANDIDATES, clock, settings=settings)
    assert reader() is not None
    assert any("following it for at most 60 s" in r.getMessage() for r in caplog.records)
    clock.now_s += 60.0
    assert reader() is None
    # A table produced in the far future cannot outlive the cap either: refused.
    write_step_table(
        tmp_path, table(ttl=10.0, at=clock.now_s + 10 * 86_400.0, version=2), CANDIDATES
    )
    assert reader() is None and reader.last_reason == "future_dated"
    # Slightly ahead (clock skew), with a normal TTL: followed, unchanged.
    ahead = table(ttl=30.0, at=clock.now_s + 5.0, version=3)
    write_step_table(tmp_path, ahead, CANDIDATES)
    assert reader() == ahead


def test_a_ttl_within_the_cap_is_untouched(tmp_path: Path) -> None:
    write_step_table(tmp_path, table(ttl=30.0), CANDIDATES)
    reader = SpoolTableReader(tmp_path, CANDIDATES, Clock())
    assert reader() == table(ttl=30.0) and reader.capped == 0


@pytest.mark.parametrize(
    ("name", "value", "fragment"),
    [
        ("SPECGOV_MAX_TABLE_TTL_S", "soon", "expected a number of seconds"),
        ("SPECGOV_MAX_TABLE_TTL_S", "0", "(0, 86400]"),
        ("SPECGOV_MAX_TABLE_TTL_S", "inf", "(0, 86400]"),
        ("SPECGOV_SPOOL_GROUP", "no-such-group-here", "no group named"),
        ("SPECGOV_DAEMON_UID", "-3", "no user named"),
    ],
)
def test_bad_settings_name_the_variable(name: str, value: str, fragment: str) -> None:
    with pytest.raises(SpoolError) as caught:
        SpoolSettings.from_env({name: value})
    assert f"env {name}" in str(caught.value) and fragment in str(caught.value)


def test_settings_from_names_and_numbers() -> None:
    got = SpoolSettings.from_env(
        {"SPECGOV_SPOOL_GROUP": "0", "SPECGOV_DAEMON_UID": "root", "SPECGOV_MAX_TABLE_TTL_S": ""}
    )
    assert got == SpoolSettings(group_gid=0, daemon_uid=0, max_table_ttl_s=DEFAULT_MAX_TABLE_TTL_S)
    assert got.table_owner_uid == 0 and got.trusted_uids == {ME, 0}
    assert SpoolSettings.from_env({}).table_owner_uid == ME


# ------------------------------------------------ statistics a daemon cannot read


def test_unreadable_statistics_are_logged_once_with_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # The read side of the two-user failure, through a seam (root reads every file):
    # the daemon used to drop the error without a word.
    for seq in range(3):
        write_tier_stats(tmp_path, snapshot(NOW + seq), writer_id="w", seq=seq)
    real_open = os.open

    def denied(path: Any, *args: Any, **kwargs: Any) -> Any:
        if Path(path).name.startswith("tier_stats."):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr("specgov.adapters.spool.os.open", denied)
    monkeypatch.setattr("specgov.adapters.spool_stats._read_log._kinds", {})
    caplog.set_level(logging.ERROR, logger="specgov.adapters.spool")
    batch = read_tier_stats(tmp_path)
    assert batch.records == () and batch.unreadable == 3 and batch.skipped == 3
    lines = [r.getMessage() for r in caplog.records if "cannot read" in r.getMessage()]
    assert len(lines) == 1
    assert str(tmp_path / "stats") in lines[0]
    assert "SPECGOV_SPOOL_GROUP" in lines[0] and "spool.group" in lines[0]


def test_a_symlinked_statistics_window_is_refused_with_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    spool = tmp_path / "spool"
    first = write_tier_stats(spool, snapshot(NOW), writer_id="w", seq=0)
    second = write_tier_stats(spool, snapshot(NOW + 1), writer_id="w", seq=1)
    # A valid window, moved out of the spool and linked back: without O_NOFOLLOW the
    # daemon would follow a link anyone who can write stats/ planted to any file.
    elsewhere = tmp_path / "elsewhere.json"
    os.replace(second, elsewhere)
    second.symlink_to(elsewhere)
    monkeypatch.setattr("specgov.adapters.spool_stats._read_log._kinds", {})
    caplog.set_level(logging.ERROR, logger="specgov.adapters.spool")
    batch = read_tier_stats(spool)
    assert [(r.writer_id, r.seq) for r in batch.records] == [("w", 0)]
    assert batch.skipped == 1 and batch.unreadable == 0
    (error,) = batch.errors
    assert f"refusing {second}: it is a symbolic link" in error and "remove the link" in error
    assert [r.getMessage() for r in caplog.records] == [error]
    assert first.exists()


def test_a_fifo_in_place_of_a_window_is_refused_without_blocking(tmp_path: Path) -> None:
    import threading

    spool = tmp_path / "spool"
    path = write_tier_stats(spool, snapshot(NOW), writer_id="w", seq=0)
    path.unlink()
    os.mkfifo(path)
    done: list[Any] = []
    reader = threading.Thread(target=lambda: done.append(read_tier_stats(spool)), daemon=True)
    reader.start()
    reader.join(timeout=60.0)  # a deadline, not a wait: it returns at once
    assert done, "read_tier_stats blocked on a FIFO"
    assert done[0].skipped == 1 and "not a regular file" in done[0].errors[0]


def test_a_symlinked_step_table_is_not_followed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from specgov.adapters.spool_table import read_published_table

    spool = tmp_path / "spool"
    path = write_step_table(spool, table(steps=5), CANDIDATES)
    elsewhere = tmp_path / "elsewhere.json"
    os.replace(path, elsewhere)
    path.symlink_to(elsewhere)
    caplog.set_level(logging.INFO, logger="specgov.adapters.spool")
    reader = SpoolTableReader(spool, CANDIDATES, Clock())
    assert reader() is None and reader.last_reason == "unreadable"
    assert read_published_table(spool) is None  # the daemon's restart side
    lines = [r.getMessage() for r in caplog.records]
    assert sum("it is a symbolic link" in line for line in lines) == 2


# ------------------------------------------ the two-user deployment, for real (root)

DAEMON_UID, SERVER_UID = 40001, 40002

_DAEMON_PUBLISH = """
import json, sys
from specgov.adapters.spool_table import write_step_table
from specgov.policies.common.step_table import StepTable
spool, gid = sys.argv[1], int(sys.argv[2])
t = StepTable(((1, 5),), version=7, produced_at_s=float(sys.argv[3]), ttl_s=30.0)
write_step_table(spool, t, [0, 1, 3, 5, 7], group_gid=gid)
"""

_SERVER_ROUND = """
import json, sys
from specgov.adapters.spool import SpoolSettings
from specgov.adapters.spool_table import SpoolTableReader
from specgov.adapters.spool_stats import write_tier_stats
from specgov.policies.common.types import TierStat, TierStatsSnapshot
spool, now = sys.argv[1], float(sys.argv[2])
settings = SpoolSettings.from_env()
reader = SpoolTableReader(spool, [0, 1, 3, 5, 7], lambda: now, settings=settings)
table = reader()
snap = TierStatsSnapshot(window_start_s=now, window_end_s=now + 1.0, tiers=(TierStat(
    slot=1, steps=5, verify_calls=1, requests=1, accepted_hist=(0, 0, 0, 0, 0, 1),
    step_time_sum_s=0.01, step_time_count=1, batch_size_sum=1),))
path = write_tier_stats(spool, snap, writer_id=sys.argv[3], settings=settings)
print(json.dumps({"version": None if table is None else table.version,
                  "reason": reader.last_reason, "stats": str(path)}))
"""

_DAEMON_READ = """
import json, logging, sys
logging.basicConfig(level=logging.ERROR, format="%(message)s")
from specgov.adapters.spool_stats import read_tier_stats
batch = read_tier_stats(sys.argv[1], group_gid=int(sys.argv[2]))
print(json.dumps({"writers": sorted(r.writer_id for r in batch.records),
                  "unreadable": batch.unreadable}))
"""


@pytest.fixture
def shared_spool_parent() -> Iterator[Path]:
    # Outside pytest's 0700 tmp_path, which the other users could not enter.
    # The daemon's own directory (like /var/lib/specgov), where it creates the spool.
    parent = Path(tempfile.mkdtemp(prefix="specgov-two-user-"))
    parent.chmod(0o755)
    os.chown(parent, DAEMON_UID, DAEMON_UID)
    try:
        yield parent
    finally:
        shutil.rmtree(parent, ignore_errors=True)


def _as_user(uid: int, groups: list[int]) -> list[str]:
    # util-linux's setpriv, not subprocess's user=/extra_groups=: in some sandboxes
    # (this one) only the former can exec the interpreter after dropping root.
    setpriv = shutil.which("setpriv")
    assert setpriv is not None
    return [
        setpriv,
        f"--reuid={uid}",
        f"--regid={uid}",
        "--groups=" + ",".join(str(g) for g in groups),
        sys.executable,
    ]


def _spawn(uid: int, code: str, *args: str, env: dict[str, str] | None = None) -> Any:
    return subprocess.run(
        [*_as_user(uid, [SHARED_GID]), "-c", code, *args],
        env={"PATH": os.environ.get("PATH", ""), **(env or {})},
        cwd="/",
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _run_as(uid: int, code: str, *args: str, env: dict[str, str] | None = None) -> Any:
    done = _spawn(uid, code, *args, env=env)
    assert done.returncode == 0, done.stderr
    return done


@pytest.fixture
def other_users() -> None:
    """Skip unless this process can run the interpreter as other users."""
    if not IS_ROOT or shutil.which("setpriv") is None:
        pytest.skip("running as other users needs root and util-linux setpriv")
    probe = subprocess.run(
        [*_as_user(DAEMON_UID, [SHARED_GID]), "-c", "import specgov.adapters.spool"],
        cwd="/",
        capture_output=True,
        timeout=120,
        check=False,
    )
    if probe.returncode != 0:
        pytest.skip(f"cannot run specgov as uid {DAEMON_UID}: {probe.stderr[-300:]!r}")


def test_two_user_deployment_server_and_daemon_share_a_group(
    other_users: None, shared_spool_parent: Path
) -> None:
    spool = shared_spool_parent / "spool"
    gid = str(SHARED_GID)
    _run_as(DAEMON_UID, _DAEMON_PUBLISH, str(spool), gid, str(NOW))
    assert spool.stat().st_uid == DAEMON_UID and mode_of(spool) == 0o2750
    server_env = {"SPECGOV_DAEMON_UID": str(DAEMON_UID), "SPECGOV_SPOOL_GROUP": gid}
    out = json.loads(
        _run_as(SERVER_UID, _SERVER_ROUND, str(spool), str(NOW), "srv", env=server_env).stdout
    )
    # The server follows the daemon's table and writes statistics the daemon can read.
    assert out["version"] == 7 and out["reason"] is None
    stats_path = Path(out["stats"])
    assert stats_path.stat().st_uid == SERVER_UID and mode_of(stats_path) == 0o640
    got = json.loads(_run_as(DAEMON_UID, _DAEMON_READ, str(spool), gid).stdout)
    assert got == {"writers": ["srv"], "unreadable": 0}


def test_two_user_deployment_misconfigurations_are_reported(
    other_users: None, shared_spool_parent: Path, tmp_path: Path
) -> None:
    spool = shared_spool_parent / "spool"
    gid = str(SHARED_GID)
    _run_as(DAEMON_UID, _DAEMON_PUBLISH, str(spool), gid, str(NOW))
    # A server without SPECGOV_SPOOL_GROUP refuses the group-writable stats/ (saying
    # which variable to set) rather than write statistics the daemon cannot read.
    no_group = _spawn(
        SERVER_UID, _SERVER_ROUND, str(spool), str(NOW), "a", env={"SPECGOV_DAEMON_UID": "40001"}
    )
    assert no_group.returncode != 0
    assert "stats is writable by its group" in no_group.stderr
    assert "SPECGOV_SPOOL_GROUP" in no_group.stderr
    # Without SPECGOV_DAEMON_UID it refuses the daemon's spool: not a user it trusts.
    no_uid = _spawn(
        SERVER_UID, _SERVER_ROUND, str(spool), str(NOW), "b", env={"SPECGOV_SPOOL_GROUP": gid}
    )
    assert no_uid.returncode != 0 and "SpoolSecurityError" in no_uid.stderr
    assert f"owned by uid {DAEMON_UID}" in no_uid.stderr
    # A 0600 statistics file of the server's (what every server wrote before): the
    # daemon cannot read it and says so, once, with the path and the fix; it used to
    # drop the error and sit in held_unknown_telemetry without a word.
    made = write_tier_stats(tmp_path, snapshot(), writer_id="old", seq=0)
    leftover = spool / "stats" / made.name
    shutil.copyfile(made, leftover)
    os.chown(leftover, SERVER_UID, SERVER_UID)
    leftover.chmod(0o600)
    done = _run_as(DAEMON_UID, _DAEMON_READ, str(spool), gid)
    assert json.loads(done.stdout) == {"writers": [], "unreadable": 1}
    assert str(leftover) in done.stderr and "SPECGOV_SPOOL_GROUP" in done.stderr
    assert done.stderr.count("cannot read") == 1


def test_a_group_that_cannot_be_given_leaves_nothing_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A non-member cannot chgrp: the half-made private directory would pass the checks
    # and lock the other user out silently, so it is removed and the error says why.
    def refuse(*_a: object, **_k: object) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr("specgov.adapters.spool.os.chown", refuse)
    spool = tmp_path / "spool"
    with pytest.raises(SpoolSecurityError, match=r"cannot give .* the group 4242.*member"):
        ensure_spool_dir(spool, group_gid=4242)
    assert not spool.exists()


def test_the_plugin_of_a_two_user_deployment_leaves_creating_the_spool_to_the_daemon(
    tmp_path: Path,
) -> None:
    spool = tmp_path / "spool"
    settings = SpoolSettings(daemon_uid=OTHER)
    with pytest.raises(FileNotFoundError, match="the daemon creates it"):
        write_tier_stats(spool, snapshot(), writer_id="w", settings=settings)
    assert not spool.exists()


def test_the_sim_server_rehearses_the_two_user_deployment(
    other_users: None, shared_spool_parent: Path
) -> None:
    """Issue 23: the sim-server's statistics writer ignored SPECGOV_DAEMON_UID and
    SPECGOV_SPOOL_GROUP (only its plugin read them), so it refused the daemon's spool and
    the rehearsal of docs/spool-security.md could not run. Now `specgov sim-server`, as
    the server's user with the plugin's variables, writes statistics the daemon's user
    reads: 0640 in the shared group."""
    import socket
    import time

    spool = shared_spool_parent / "spool"
    gid = str(SHARED_GID)
    _run_as(DAEMON_UID, _DAEMON_PUBLISH, str(spool), gid, str(NOW))  # the daemon's spool
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [*_as_user(SERVER_UID, [SHARED_GID]), "-m", "specgov.controller.cli.main", "sim-server"]
    argv += ["--port", str(port), "--spool-dir", str(spool), "--speed", "10", "--loop"]
    argv += ["--trace", "synthetic:duration=60,rate=5,seed=1"]
    env = {
        "PATH": os.environ.get("PATH", ""),
        "SPECGOV_DAEMON_UID": str(DAEMON_UID),
        "SPECGOV_SPOOL_GROUP": gid,
    }
    server = subprocess.Popen(
        argv, env=env, cwd="/", stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        deadline = time.monotonic() + 90.0  # a deadline for a broken build, not a wait
        files: list[Path] = []
        while not files:
            assert server.poll() is None, server.communicate()[0][-3000:]
            assert time.monotonic() < deadline, "no statistics from the sim-server"
            files = sorted((spool / "stats").glob("tier_stats.*.json"))
            time.sleep(0.2)  # the poll period of the statistics directory
        made = files[0].stat()
        assert (made.st_uid, made.st_gid, stat.S_IMODE(made.st_mode)) == (
            SERVER_UID,
            SHARED_GID,
            0o640,
        )
        got = json.loads(_run_as(DAEMON_UID, _DAEMON_READ, str(spool), gid).stdout)
        assert got["writers"] and got["unreadable"] == 0, got
    finally:
        server.terminate()
        server.communicate(timeout=30)
