"""SpecgovAdaptiveParams: exactly SGLang's controller without a spool, the daemon's table
with one, SGLang's answers again when the table expires; never an exception."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from contract.sglang_loader import load_adaptive_spec_params

import specgov.adapters.sglang_plugin as plugin_mod
from specgov.adapters.sglang_plugin import SpecgovAdaptiveParams, load_adaptive_config
from specgov.adapters.spool_stats import read_tier_stats
from specgov.adapters.spool_table import write_step_table
from specgov.adapters.tp_sync import LocalChannel, encode_payload
from specgov.policies.common.step_table import StepTable
from specgov.policies.common.types import TierStatsSnapshot
from specgov.policies.engine.adaptive_config import AdaptiveConfigError
from specgov.policies.engine.ema import EmaPolicy
from specgov.policies.engine.protocol import AdaptiveSpecPolicy

GRAPHS = [1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 24, 32, 48, 64, 96, 128, 256]
DEFAULT_CANDIDATES = [0, 1, 3, 5, 7]
POLL = 8


@pytest.fixture(scope="module")
def asp(sglang_src: Path) -> ModuleType:
    return load_adaptive_spec_params(sglang_src)


class Clock:
    def __init__(self, now_s: float = 1_700_000_000.0) -> None:
        self.now_s = now_s

    def __call__(self) -> float:
        return self.now_s


def draw_accepted(rng: random.Random, steps: int, n: int, p: float) -> list[int]:
    if steps == 0:
        return [0] * n
    out = []
    for _ in range(n):
        k = 0
        while k < steps and rng.random() < p:
            k += 1
        out.append(k)
    return out


def pad(batch_size: int, graphs: list[int] | None) -> int:
    bigger = [g for g in graphs or [] if g >= batch_size]
    return bigger[0] if bigger else batch_size


def make(
    tmp_path: Path | None,
    *,
    initial: int = 3,
    cfg: str | None = None,
    original: Any = None,
    clock: Clock | None = None,
    stats: list[TierStatsSnapshot] | None = None,
    **kwargs: Any,
) -> SpecgovAdaptiveParams:
    return SpecgovAdaptiveParams(
        initial,
        cfg,
        spool_dir=tmp_path,
        original=original,
        channel_factory=kwargs.pop("channel_factory", LocalChannel),
        clock=clock or Clock(),
        poll_every_batches=kwargs.pop("poll_every_batches", POLL),
        stats_writer=kwargs.pop("stats_writer", None if stats is None else stats.append),
        **kwargs,
    )


def lockstep(
    ours: Any, theirs: Any, rng: random.Random, calls: int, clock: Clock | None = None
) -> int:
    """Drive both with the same calls; assert identical answers; return switches seen."""
    switches = 0
    p = 0.8
    for i in range(calls):
        if i % 200 == 0:
            p = rng.choice([0.1, 0.5, 0.8, 0.95])
        batch_size = rng.randint(1, 300) if rng.random() < 0.3 else rng.randint(1, 12)
        steps = theirs.get_steps_for_batch(batch_size)
        assert ours.get_steps_for_batch(batch_size) == steps, f"call {i}"
        accepted = draw_accepted(rng, steps, batch_size, p)
        expected = theirs.on_verify_complete(accepted, batch_size)
        assert ours.on_verify_complete(accepted, batch_size) == expected, f"call {i}"
        switches += expected is not None
        if clock is not None:
            clock.now_s += 0.01
    return switches


# ------------------------------------------------------------------------- import


def test_importing_the_plugin_imports_neither_torch_nor_sglang() -> None:
    code = (
        "import sys\n"
        "import specgov.adapters.sglang_plugin, specgov.adapters.tp_sync, "
        "specgov.adapters.spool\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'sglang'))\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_register_outside_sglang_fails_loudly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(plugin_mod, "_captured", {})
    with pytest.raises(ModuleNotFoundError, match="sglang"):
        plugin_mod.register()


# --------------------------------------------------------- exactly SGLang without a spool


@pytest.mark.parametrize("graphs", [None, GRAPHS])
@pytest.mark.parametrize("use_original", [True, False])
def test_unset_spool_answers_exactly_like_sglang(
    asp: ModuleType, monkeypatch: pytest.MonkeyPatch, graphs: list[int] | None, use_original: bool
) -> None:
    monkeypatch.delenv("SPECGOV_SPOOL_DIR", raising=False)
    original = asp.AdaptiveSpeculativeParams if use_original else None
    ours = SpecgovAdaptiveParams(
        3, None, original=original, channel_factory=LocalChannel, stats_writer=None
    )
    theirs = asp.AdaptiveSpeculativeParams(3)
    assert isinstance(ours, AdaptiveSpecPolicy)
    assert ours.candidate_steps == theirs.candidate_steps == DEFAULT_CANDIDATES
    ours.set_cuda_graph_bs(graphs)
    theirs.set_cuda_graph_bs(graphs)
    for step in DEFAULT_CANDIDATES:
        assert ours.cuda_graph_bs_for_step(step) == theirs.cuda_graph_bs_for_step(step)
    assert ours.mode == "undecided"
    switches = lockstep(ours, theirs, random.Random(7), 1500)
    assert switches > 10
    assert ours.mode == "passthrough"
    assert ours.spool_dir is None and ours.reader is None
    if use_original:
        assert isinstance(ours.passthrough, asp.AdaptiveSpeculativeParams)
    else:
        assert isinstance(ours.passthrough, EmaPolicy)


def test_empty_spool_answers_exactly_like_sglang(asp: ModuleType, tmp_path: Path) -> None:
    cfg = tmp_path / "adaptive.json"
    cfg.write_text(
        json.dumps(
            {
                "warmup_batches": 4,
                "1": {"candidate_steps": [1, 2, 4, 6], "update_interval": 3},
                "16": {"candidate_steps": [0, 1, 2], "ema_alpha": 0.5},
            }
        )
    )
    spool_dir = tmp_path / "spool"
    spool_dir.mkdir()
    stats: list[TierStatsSnapshot] = []
    clock = Clock()
    ours = make(
        spool_dir, cfg=str(cfg), original=asp.AdaptiveSpeculativeParams, clock=clock, stats=stats
    )
    theirs = asp.AdaptiveSpeculativeParams(3, str(cfg))
    ours.set_cuda_graph_bs(GRAPHS)
    theirs.set_cuda_graph_bs(GRAPHS)
    calls = 1000
    assert lockstep(ours, theirs, random.Random(3), calls, clock) > 10
    assert ours.mode == "table" and ours.table is None
    reader = ours.reader
    assert reader is not None
    # One stat per poll, never IO on the batches in between.
    assert reader.ignored == {"missing": math.ceil(calls / POLL)}
    assert reader.stats == math.ceil(calls / POLL) and reader.reads == 0
    policy = ours.policy
    assert policy is not None and policy.fallback_reasons == {"no_table": calls}
    assert len(stats) >= 9  # 10 s of fake time, flushed about every second
    assert sum(t.verify_calls for s in stats for t in s.tiers) <= calls


# ------------------------------------------------------------------ with a table


def test_follows_the_table_then_falls_back_when_it_expires(asp: ModuleType, tmp_path: Path) -> None:
    clock = Clock()
    batch_s = 0.01
    table = StepTable(
        ((1, 5), (8, 1), (32, 0)), version=7, produced_at_s=clock(), ttl_s=300 * batch_s
    )
    write_step_table(tmp_path, table, DEFAULT_CANDIDATES)
    ours = make(tmp_path, original=asp.AdaptiveSpeculativeParams, clock=clock, stats=[])
    twin = asp.AdaptiveSpeculativeParams(3)  # SGLang's EMA, fed the same verifies
    ours.set_cuda_graph_bs(GRAPHS)
    twin.set_cuda_graph_bs(GRAPHS)
    rng = random.Random(5)
    followed = fell_back = 0
    expired_at: int | None = None
    for i in range(900):
        if i % POLL == 0:
            in_force = not table.is_expired(clock())
            if not in_force and expired_at is None:
                expired_at = i
        batch_size = rng.randint(1, 64)
        steps = ours.get_steps_for_batch(batch_size)
        twin_steps = twin.get_steps_for_batch(batch_size)
        if in_force:
            assert steps == table.steps_for(pad(batch_size, GRAPHS)), f"call {i}"
            followed += 1
        else:
            assert steps == twin_steps, f"call {i}"
            fell_back += 1
        accepted = draw_accepted(rng, steps, batch_size, 0.7)
        twin.on_verify_complete(accepted, batch_size)
        ours.on_verify_complete(accepted, batch_size)
        clock.now_s += batch_s
    assert expired_at is not None and 280 <= expired_at <= 310
    assert followed > 250 and fell_back > 550
    assert ours.reader is not None and ours.reader.ignored.get("expired", 0) > 0
    # The reader judged the expiry; TablePolicy just saw no table from then on.
    assert ours.policy is not None and ours.policy.fallback_reasons.get("no_table", 0) > 0


def test_new_table_is_picked_up_at_the_next_poll(tmp_path: Path) -> None:
    clock = Clock()
    ours = make(tmp_path, clock=clock, stats=[])
    ours.set_cuda_graph_bs(GRAPHS)
    # Captured CUDA graphs: 5 exists only for batch sizes < 8 (SGLang's default slots).
    first = StepTable(((1, 5), (8, 1), (32, 0)), version=1, produced_at_s=clock(), ttl_s=60)
    second = StepTable(((1, 1), (8, 0)), version=2, produced_at_s=clock(), ttl_s=60)
    write_step_table(tmp_path, first, DEFAULT_CANDIDATES)
    assert ours.get_steps_for_batch(1) == 5  # call 0 polls
    write_step_table(tmp_path, second, DEFAULT_CANDIDATES)
    # Still 5 until the next poll boundary (no IO in between), then 1.
    assert [ours.get_steps_for_batch(1) for _ in range(POLL - 1)] == [5] * (POLL - 1)
    assert ours.reader is not None and (ours.reader.stats, ours.reader.reads) == (1, 1)
    assert ours.get_steps_for_batch(1) == 1
    assert (ours.reader.stats, ours.reader.reads) == (2, 2)
    assert ours.table == second


# ------------------------------------------------------------------ config handling

BAD_CONFIGS = [
    {},
    {"ema_alpha": 0.3},
    {"1": {}},
    {"1": {"candidate_steps": []}},
    {"1": {"candidate_steps": [1, -1]}},
    {"8": {"candidate_steps": [1]}, "16": {"candidate_steps": None}},
]


@pytest.mark.parametrize("cfg", BAD_CONFIGS)
def test_bad_config_raises_what_sglang_raises(
    asp: ModuleType, tmp_path: Path, cfg: dict[str, Any]
) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(cfg))
    with pytest.raises(ValueError) as theirs:
        asp.AdaptiveSpeculativeParams(3, str(path))
    with pytest.raises(ValueError) as ours:
        make(None, cfg=str(path), original=asp.AdaptiveSpeculativeParams)
    assert type(ours.value) is type(theirs.value)
    assert str(ours.value) == str(theirs.value)
    # Without SGLang's class: specgov's own error, a ValueError naming the file.
    with pytest.raises(AdaptiveConfigError) as alone:
        make(None, cfg=str(path), original=None)
    assert str(path) in str(alone.value)


def test_unreadable_config_raises_like_sglang(asp: ModuleType, tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.json")
    for original in (asp.AdaptiveSpeculativeParams, None):
        with pytest.raises(FileNotFoundError):
            make(None, cfg=missing, original=original)
    broken = tmp_path / "broken.json"
    broken.write_text('{"1": {"candidate_steps": [1,')
    for original in (asp.AdaptiveSpeculativeParams, None):
        with pytest.raises(json.JSONDecodeError):
            make(None, cfg=str(broken), original=original)


def test_config_only_specgov_rejects_leaves_sglang_in_charge(
    asp: ModuleType, tmp_path: Path
) -> None:
    path = tmp_path / "odd.json"
    path.write_text(json.dumps({"1": {"candidate_steps": [True, 3]}}))  # SGLang accepts
    spool_dir = tmp_path / "spool"
    write_step_table(
        spool_dir, StepTable(((1, 3),), version=1, produced_at_s=Clock()(), ttl_s=60), [1, 3]
    )
    ours = make(spool_dir, cfg=str(path), original=asp.AdaptiveSpeculativeParams, stats=[])
    assert ours.mode == "passthrough" and ours.policy is None
    assert ours.disabled_reason is not None and "candidate_steps" in ours.disabled_reason
    theirs = asp.AdaptiveSpeculativeParams(3, str(path))
    lockstep(ours, theirs, random.Random(1), 300)


def test_load_adaptive_config_default_matches_sglang(asp: ModuleType) -> None:
    assert load_adaptive_config(None).candidate_steps == asp.resolve_candidate_steps_from_config()


# ------------------------------------------------------------- never raise, stats


def test_specgov_failures_degrade_to_the_fallback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = Clock()
    write_step_table(
        tmp_path,
        StepTable(((1, 7),), version=1, produced_at_s=clock(), ttl_s=60),
        DEFAULT_CANDIDATES,
    )
    ours = make(tmp_path, clock=clock, stats=[])
    assert ours.get_steps_for_batch(1) == 7
    policy = ours.policy
    assert policy is not None

    def boom(*_a: object, **_k: object) -> Any:
        raise RuntimeError("bug in specgov")

    monkeypatch.setattr(policy, "get_steps_for_batch", boom)
    monkeypatch.setattr(policy, "on_verify_complete", boom)
    expected = EmaPolicy(3).get_steps_for_batch(1)
    assert ours.get_steps_for_batch(1) == expected
    assert ours.on_verify_complete([1], 1) is None
    assert ours.errors == 2 and ours.last_error is not None and "bug" in ours.last_error


def test_channel_failure_at_start_means_passthrough(tmp_path: Path) -> None:
    def no_group() -> Any:
        raise RuntimeError("TP group not initialised")

    write_step_table(
        tmp_path,
        StepTable(((1, 7),), version=1, produced_at_s=Clock()(), ttl_s=60),
        DEFAULT_CANDIDATES,
    )
    ours = make(tmp_path, channel_factory=no_group, stats=[])
    theirs = EmaPolicy(3)
    lockstep(ours, theirs, random.Random(2), 200)
    assert ours.mode == "passthrough"
    assert ours.sync is not None and ours.sync.errors == 1


def test_stats_sink_failures_do_not_break_the_policy(tmp_path: Path) -> None:
    clock = Clock()

    def failing_sink(_snapshot: TierStatsSnapshot) -> None:
        raise OSError("read-only file system")

    ours = make(tmp_path, clock=clock, stats_writer=failing_sink)
    theirs = EmaPolicy(3)
    lockstep(ours, theirs, random.Random(4), 400, clock)  # 4 s: several flushes, all failing
    assert ours.policy is not None and ours.policy.errors >= 3
    assert ours.errors == 0


def test_rank0_writes_statistics_to_the_spool(tmp_path: Path) -> None:
    clock = Clock()
    ours = SpecgovAdaptiveParams(
        3,
        None,
        spool_dir=tmp_path,
        original=None,
        channel_factory=LocalChannel,
        clock=clock,
        poll_every_batches=POLL,
    )
    lockstep(ours, EmaPolicy(3), random.Random(6), 500, clock)  # 5 s of fake time
    writer = ours.stats_writer
    assert writer is not None and writer.close(timeout_s=10.0)  # type: ignore[attr-defined]
    batch = read_tier_stats(tmp_path)
    assert len(batch.records) >= 4
    assert sum(t.verify_calls for r in batch.records for t in r.snapshot.tiers) > 350
    # The unwritable-spool case: statistics fail off-thread, answers are unaffected.
    blocker = tmp_path / "file"
    blocker.write_text("x")
    clock2 = Clock()
    bad = SpecgovAdaptiveParams(
        3, None, spool_dir=blocker, original=None, channel_factory=LocalChannel, clock=clock2
    )
    lockstep(bad, EmaPolicy(3), random.Random(6), 300, clock2)
    assert bad.stats_writer is not None and bad.stats_writer.close(10.0)  # type: ignore[attr-defined]
    assert bad.stats_writer.errors >= 2  # type: ignore[attr-defined]


class FollowerChannel:
    """TP rank 1 of 2: receives what a rank 0 with a spool would send."""

    rank = 1
    world_size = 2

    def __init__(self, table: StepTable | None) -> None:
        self.table = table
        self.calls = 0

    def broadcast_from_rank0(self, payload: bytes) -> bytes:
        assert payload == b""
        self.calls += 1
        return encode_payload(True, Clock()(), self.table)


def test_other_ranks_never_read_the_spool_nor_write_statistics(tmp_path: Path) -> None:
    clock = Clock()
    local = StepTable(((1, 7),), version=1, produced_at_s=clock(), ttl_s=60)
    broadcast = StepTable(((1, 1),), version=2, produced_at_s=clock(), ttl_s=60)
    write_step_table(tmp_path, local, DEFAULT_CANDIDATES)
    stats: list[TierStatsSnapshot] = []
    channel = FollowerChannel(broadcast)
    ours = make(tmp_path, clock=clock, stats=stats, channel_factory=lambda: channel)
    for _ in range(300):
        assert ours.get_steps_for_batch(1) == 1  # rank 0's table, not its own file
        ours.on_verify_complete([1], 1)
        clock.now_s += 0.02
    assert channel.calls == math.ceil(300 / POLL)
    assert ours.reader is not None and ours.reader.stats == 0
    assert stats == []


def test_spool_dir_comes_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SPECGOV_SPOOL_DIR", str(tmp_path))
    ours = SpecgovAdaptiveParams(3, None, original=None, channel_factory=LocalChannel)
    assert ours.spool_dir == tmp_path
    monkeypatch.setenv("SPECGOV_SPOOL_DIR", "")
    assert SpecgovAdaptiveParams(3, original=None).spool_dir is None


def test_next_interface_without_sglangs_class(tmp_path: Path) -> None:
    # Outside SGLang (EmaPolicy is the passthrough): the next interface's arguments are
    # accepted in both modes, dropped (EmaPolicy takes none) and the answers unchanged.
    for spool_dir in (None, tmp_path):
        ours = make(spool_dir)
        theirs = EmaPolicy(3)
        rng = random.Random(12)
        for i in range(300):
            batch_size = rng.randint(1, 40)
            steps = theirs.get_steps_for_batch(batch_size)
            assert ours.get_steps_for_batch(batch_size, ctx_repr=4096) == steps, i
            accepted = draw_accepted(rng, steps, batch_size, 0.7)
            expected = theirs.on_verify_complete(accepted, batch_size)
            assert ours.on_verify_complete(accepted, batch_size, steps, ctx_repr=4096) == expected
            ours.on_state_activated(steps, reason="switch")
        assert ours.activated_steps is not None
        assert ours.ignored_keywords == {"ctx_repr", "num_steps", "reason"}
        assert ours.errors == 0
