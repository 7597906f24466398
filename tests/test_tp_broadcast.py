"""Tensor parallelism: rank 0 reads the spool and broadcasts; all ranks answer alike.

In-process tests drive TableSync / SpecgovAdaptiveParams through fake channels (no
torch). The last test runs two real CPU processes over torch.distributed's gloo backend
(FileStore rendezvous, loopback only): both ranks must return identical steps for an
identical call sequence while rank 0's spool changes mid-run, even though rank 1's own
clock is hours off and it has no spool at all.
"""

from __future__ import annotations

import importlib.util
import json
import math
import multiprocessing
import os
import random
import sys
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from specgov.adapters.sglang_plugin import SpecgovAdaptiveParams
from specgov.adapters.spool_table import write_step_table
from specgov.adapters.tp_sync import (
    LocalChannel,
    TableSync,
    TorchCpuGroupChannel,
    TpSyncError,
    decode_payload,
    encode_payload,
    encode_table,
)
from specgov.policies.common.step_table import SlotRule, StepTable

GRAPHS = [1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 24, 32, 48, 64]
CANDIDATES = [0, 1, 3, 5, 7]
POLL = 8
T0 = 1_700_000_000.0
BATCH_S = 1 / 128  # exact in binary: clock sums carry no rounding
CALLS = 480


class Clock:
    def __init__(self, now_s: float) -> None:
        self.now_s = now_s

    def __call__(self) -> float:
        return self.now_s


def draw_accepted(rng: random.Random, steps: int, n: int) -> list[int]:
    return [min(steps, int(rng.expovariate(0.6))) for _ in range(n)]


def scripted_tables(now_s: float) -> dict[int, StepTable]:
    """Rank 0's spool over the run: call index -> table written just before it.

    Steps stay within what SGLang's default slots capture CUDA graphs for, so every
    table is followed; the third expires after 60 batches of rank 0's clock.
    """
    return {
        0: StepTable(((1, 5), (8, 1), (32, 0)), version=1, produced_at_s=now_s, ttl_s=3600),
        150: StepTable(
            ((1, 1), (8, 0)), version=2, produced_at_s=now_s + 150 * BATCH_S, ttl_s=3600
        ),
        300: StepTable(
            ((1, 7), (4, 3), (8, 1), (32, 0)),
            version=3,
            produced_at_s=now_s + 300 * BATCH_S,
            ttl_s=60 * BATCH_S,
        ),
    }


def run_rank(
    rank: int, params: SpecgovAdaptiveParams, clock: Clock, spool_dir: Path | None
) -> list[list[Any]]:
    """The same call sequence on every rank; rank 0 also rewrites its spool mid-run."""
    params.set_cuda_graph_bs(GRAPHS)
    tables = scripted_tables(T0)
    rng = random.Random(1234)
    out: list[list[Any]] = []
    for i in range(CALLS):
        if rank == 0 and spool_dir is not None and i in tables:
            write_step_table(spool_dir, tables[i], CANDIDATES, fsync=False)
        batch_size = rng.randint(1, 40)
        steps = params.get_steps_for_batch(batch_size)
        switch = params.on_verify_complete(draw_accepted(rng, steps, batch_size), batch_size)
        table = params.table
        out.append([steps, switch, None if table is None else table.version, batch_size])
        clock.now_s += BATCH_S
    # TablePolicy polled exactly at the synchronised boundaries, never in between.
    assert params.misaligned_polls == 0 and params.errors == 0
    return out


def make_params(
    rank: int, spool_dir: Path | None, channel: Any, clock: Clock
) -> SpecgovAdaptiveParams:
    return SpecgovAdaptiveParams(
        3,
        None,
        spool_dir=spool_dir if rank == 0 else None,
        original=None,
        channel_factory=lambda: channel,
        clock=clock,
        poll_every_batches=POLL,
        stats_writer=None,
    )


def check_phases(results: list[list[Any]]) -> None:
    """Which table was in force, per call: each scripted table from the first poll
    boundary after it was written, then none from the first boundary after it expired."""
    versions = [r[2] for r in results]
    expiry_s = scripted_tables(T0)[300].expires_at_s
    expired = next(b for b in range(0, CALLS, POLL) if T0 + b * BATCH_S >= expiry_s)
    assert expired == 360
    expected = [1] * 152 + [2] * (304 - 152) + [3] * (expired - 304)
    expected += [None] * (CALLS - expired)
    assert versions == expected
    tables = {t.version: t for t in scripted_tables(T0).values()}
    for steps, _switch, version, batch_size in results:
        if version is not None:
            padded = next((g for g in GRAPHS if g >= batch_size), batch_size)
            assert steps == tables[version].steps_for(padded)


# ---------------------------------------------------------------- fake channels


class CountingChannel:
    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size
        self.sent: list[bytes] = []

    def broadcast_from_rank0(self, payload: bytes) -> bytes:
        self.sent.append(payload)
        return payload


class ReplayChannel:
    """Rank 1: returns, in order, what rank 0 broadcast (recorded by CountingChannel)."""

    rank = 1
    world_size = 2

    def __init__(self, payloads: list[bytes]) -> None:
        self.payloads = list(payloads)

    def broadcast_from_rank0(self, payload: bytes) -> bytes:
        assert payload == b""
        return self.payloads.pop(0)


def test_tp1_makes_no_collective(tmp_path: Path) -> None:
    channel = CountingChannel(0, 1)
    clock = Clock(T0)
    params = make_params(0, tmp_path, channel, clock)
    results = run_rank(0, params, clock, tmp_path)
    assert channel.sent == []
    check_phases(results)
    assert params.sync is not None and params.sync.syncs == math.ceil(CALLS / POLL)


def test_rank0_without_spool_makes_one_handshake_only() -> None:
    channel = CountingChannel(0, 2)
    clock = Clock(T0)
    params = make_params(0, None, channel, clock)
    run_rank(0, params, clock, None)
    assert len(channel.sent) == 1
    assert decode_payload(channel.sent[0]) == (False, T0, None)
    assert params.mode == "passthrough"


def test_replayed_broadcasts_give_identical_answers(tmp_path: Path) -> None:
    leader = CountingChannel(0, 2)
    clock0 = Clock(T0)
    results0 = run_rank(0, make_params(0, tmp_path, leader, clock0), clock0, tmp_path)
    assert len(leader.sent) == math.ceil(CALLS / POLL)
    clock1 = Clock(T0 + 7200.0)  # rank 1's clock is two hours off
    follower = ReplayChannel(leader.sent)
    results1 = run_rank(1, make_params(1, tmp_path, follower, clock1), clock1, None)
    assert results1 == results0
    check_phases(results0)


def test_rank0_encodes_each_table_once_and_forwards_it(tmp_path: Path) -> None:
    leader = CountingChannel(0, 2)
    clock = Clock(T0)
    params = make_params(0, tmp_path, leader, clock)
    run_rank(0, params, clock, tmp_path)
    sync = params.sync
    assert sync is not None
    # Three scripted tables over 60 boundaries: three encodings, not one per boundary.
    assert sync.table_encodings == 3 < len(leader.sent) == math.ceil(CALLS / POLL)
    # What travels is the table as parsed from the spool, with live rules too.
    rule_table = StepTable(
        ((1, 3),),
        version=9,
        produced_at_s=T0,
        ttl_s=5.0,
        rules=((1, SlotRule((0.4,), (1, 5), prior=0.5)),),
    )
    text = encode_table(rule_table)
    assert decode_payload(encode_payload(True, T0, rule_table, table_json=text)) == (
        True,
        T0,
        rule_table,
    )


def test_collective_failure_stops_sync_and_falls_back(tmp_path: Path) -> None:
    class Flaky(CountingChannel):
        def broadcast_from_rank0(self, payload: bytes) -> bytes:
            if len(self.sent) == 3:
                raise RuntimeError("gloo: connection reset")
            return super().broadcast_from_rank0(payload)

    channel = Flaky(0, 2)
    clock = Clock(T0)
    params = make_params(0, tmp_path, channel, clock)
    write_step_table(
        tmp_path,
        StepTable(((1, 7),), version=1, produced_at_s=T0, ttl_s=3600),
        CANDIDATES,
    )
    steps = [params.get_steps_for_batch(1) for _ in range(10 * POLL)]
    assert steps[: 3 * POLL] == [7] * (3 * POLL)
    assert 7 not in steps[3 * POLL :]  # SGLang's EMA from the 4th boundary on
    sync = params.sync
    assert sync is not None and not sync.active and sync.errors == 1
    assert len(channel.sent) == 3  # no collective after the failure


def test_payload_round_trip_and_rejections() -> None:
    table = StepTable(((1, 3), (8, 0)), version=4, produced_at_s=T0, ttl_s=5.0)
    assert decode_payload(encode_payload(True, T0, table)) == (True, T0, table)
    assert decode_payload(encode_payload(False, 1.5, None)) == (False, 1.5, None)
    for bad in (
        b"",
        b"\xff",
        b"[]",
        b'{"v": 2, "enabled": true, "now_s": 1.0, "table": null}',
        b'{"v": 1, "enabled": 1, "now_s": 1.0, "table": null}',
        b'{"v": 1, "enabled": true, "now_s": "x", "table": null}',
        b'{"v": 1, "enabled": true, "now_s": 1.0, "table": {"slots": []}}',
    ):
        with pytest.raises(TpSyncError):
            decode_payload(bad)


def test_undecodable_broadcast_means_no_table_on_every_rank() -> None:
    class Garbage(CountingChannel):
        def broadcast_from_rank0(self, payload: bytes) -> bytes:
            return b"garbage"

    sync = TableSync(
        read_table=lambda: None, channel_factory=lambda: Garbage(1, 2), every_batches=2
    )
    assert sync.tick() and sync.table is None and sync.errors == 1 and sync.active
    assert not sync.tick()
    with pytest.raises(TpSyncError, match="every_batches"):
        TableSync(read_table=None, channel_factory=LocalChannel, every_batches=0)


# ------------------------------------------------------------ two gloo processes


def _gloo_rank_main(rank: int, store: str, spool_dir: str, out_path: str) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # loopback only
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=2,
        timeout=timedelta(seconds=60),
    )
    try:
        channel = TorchCpuGroupChannel(dist.group.WORLD, rank=rank, world_size=2, src_global_rank=0)
        clock = Clock(T0 if rank == 0 else T0 + 7200.0)
        params = make_params(rank, Path(spool_dir), channel, clock)
        results = run_rank(rank, params, clock, Path(spool_dir) if rank == 0 else None)
        sync = params.sync
        assert sync is not None
        summary = {
            "results": results,
            "collectives": sync.collectives,
            "errors": sync.errors,
            "reader_stats": None if params.reader is None else params.reader.stats,
        }
        Path(out_path).write_text(json.dumps(summary))
        # Both ranks leave together: tearing gloo down while the peer still talks to
        # it can abort the process ("terminate called without an active exception").
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _gloo_rank_entry(rank: int, store: str, spool_dir: str, out_path: str) -> None:
    try:
        _gloo_rank_main(rank, store, spool_dir, out_path)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    # Leave without running C++ static destructors: torch's gloo backend now and then
    # aborts at interpreter exit ("terminate called without an active exception"),
    # after all the work is done and the results are written. Not a specgov code path:
    # inside SGLang the process group belongs to SGLang.
    os._exit(0)


def test_two_gloo_ranks_follow_rank0_identically(tmp_path: Path) -> None:
    if importlib.util.find_spec("torch") is None:
        reason = (
            "torch is not installed: the two-process gloo broadcast test needs CPU torch "
            "(pip install torch==2.13.0)"
        )
        if os.environ.get("SPECGOV_REQUIRE_TORCH"):
            pytest.fail(f"{reason} (SPECGOV_REQUIRE_TORCH is set, so this is an error)")
        pytest.skip(reason)
    ctx = multiprocessing.get_context("spawn")
    spool_dir = tmp_path / "spool"
    spool_dir.mkdir()
    store = tmp_path / "store"
    outs = [tmp_path / f"rank{r}.json" for r in range(2)]
    procs = [
        ctx.Process(target=_gloo_rank_entry, args=(r, str(store), str(spool_dir), str(outs[r])))
        for r in range(2)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    hung = [p for p in procs if p.is_alive()]
    for p in hung:
        p.kill()
        p.join(10)
    assert not hung, "a rank hung: the broadcasts did not line up"
    assert [p.exitcode for p in procs] == [0, 0]
    rank0, rank1 = (json.loads(o.read_text()) for o in outs)
    assert rank1["results"] == rank0["results"]
    check_phases(rank0["results"])
    boundaries = math.ceil(CALLS / POLL)
    assert rank0["collectives"] == rank1["collectives"] == boundaries
    assert rank0["errors"] == rank1["errors"] == 0
    assert rank0["reader_stats"] == boundaries  # one stat per boundary, rank 0 only
    assert rank1["reader_stats"] is None
