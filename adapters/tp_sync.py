"""Keep every tensor-parallel rank on the same step table (DESIGN.md, "spool").

Under tensor parallelism each TP rank runs its own copy of the in-engine policy, and
all ranks must pick the same step for the same batch or the collectives of the next
forward hang. So ranks never read the spool on their own: at fixed batch-count
boundaries (every ``every_batches`` calls to ``get_steps_for_batch``, the same number
on all ranks, so the collective lines up) rank 0 reads the table and broadcasts it,
together with its clock reading, to the other ranks over the TP group's CPU (gloo)
process group, as SGLang itself broadcasts start-up data from rank 0
(``broadcast_pyobj`` in ``tp_worker.py``, which uses the TP group's ``cpu_group`` and
``ranks[0]`` exactly so). Every rank, rank 0 included, then decodes the same bytes with
the same code, so what they follow is identical by construction. Table expiry is judged
at those boundaries against rank 0's clock reading, never a rank's own clock.

The first boundary is also a handshake: rank 0 says whether it has a spool at all.
If not, no rank ever makes another collective. With TP=1 no collective is ever made.

The channel is injected (:class:`TpChannel`), so this is testable without SGLang; the
default, :func:`default_channel`, finds SGLang's TP group lazily
(:func:`sglang_tp_channel`, at the first boundary: inside a decode forward, outside the
draft model's TP-group patch that wraps ``init_states``), or :class:`LocalChannel` where
there is no ``sglang`` at all. Nothing here imports torch or sglang at module import time.

Failure model: a collective that raises, or a channel that cannot be found, stops the
synchronisation on that rank for good (it follows SGLang's own controller from then
on). Ranks still synchronising then block in their next broadcast until the process
group's timeout, fail the same way and fall back too. A failure at the first boundary
therefore leaves every rank on SGLang's controller; one that strikes some ranks only
in mid-run can leave them disagreeing until the next boundary (a broken TP CPU group
breaks SGLang's own collectives as well).
"""

from __future__ import annotations

import importlib
import json
import logging
import time
from collections.abc import Callable
from typing import Any, Final, Protocol

from specgov.policies.common.errors import SpecgovError
from specgov.policies.common.step_table import StepTable
from specgov.policies.common.types import PolicyTypeError
from specgov.policies.common.validation import check_int, is_real

logger = logging.getLogger(__name__)

PAYLOAD_VERSION: Final = 1
# A broadcast table larger than this is refused by rank 0 (a table is ~100 bytes/slot).
MAX_PAYLOAD_BYTES: Final = 1 << 16


class TpSyncError(SpecgovError, ValueError):
    """A TP-sync setting or payload is malformed; the message names it."""


class TpChannel(Protocol):
    """A rank's view of its TP group, enough to broadcast bytes from rank 0."""

    @property
    def rank(self) -> int:
        """This process's rank within the TP group (0 is the source)."""
        ...

    @property
    def world_size(self) -> int: ...

    def broadcast_from_rank0(self, payload: bytes) -> bytes:
        """Collective: every rank calls it; all return rank 0's ``payload``."""
        ...


class LocalChannel:
    """TP=1: nothing to synchronise; broadcasting is the identity."""

    rank: int = 0
    world_size: int = 1

    def broadcast_from_rank0(self, payload: bytes) -> bytes:
        return payload


class TorchCpuGroupChannel:
    """Broadcast over a torch.distributed (gloo) CPU process group.

    Two collectives per broadcast, like SGLang's ``broadcast_pyobj``: the length as an
    int64 tensor, then the bytes as a uint8 tensor (skipped when empty). JSON, not
    pickle, travels: a peer can never be made to run code. ``src_global_rank`` is rank
    0's rank in the default (world) group, as torch.distributed wants it.
    """

    def __init__(self, group: Any, *, rank: int, world_size: int, src_global_rank: int) -> None:
        for name, value, minimum in (
            ("rank", rank, 0),
            ("world_size", world_size, 1),
            ("src_global_rank", src_global_rank, 0),
        ):
            check_int(f"TorchCpuGroupChannel.{name}", value, error=TpSyncError, minimum=minimum)
        if rank >= world_size:
            raise TpSyncError(
                f"TorchCpuGroupChannel.rank: expected < world_size={world_size}, got {rank}"
            )
        self._group = group
        self._src = src_global_rank
        self.rank = rank
        self.world_size = world_size
        self._torch: Any = importlib.import_module("torch")
        self._dist: Any = importlib.import_module("torch.distributed")

    def broadcast_from_rank0(self, payload: bytes) -> bytes:
        torch, dist = self._torch, self._dist
        if self.rank == 0:
            size = torch.tensor([len(payload)], dtype=torch.int64)
            dist.broadcast(size, src=self._src, group=self._group)
            if payload:
                data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
                dist.broadcast(data, src=self._src, group=self._group)
            return payload
        size = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(size, src=self._src, group=self._group)
        n = int(size.item())
        if n <= 0:
            return b""
        # Always join the second collective, whatever the size: leaving it would hang
        # rank 0. A bad payload is rejected after decoding, on every rank alike.
        data = torch.empty(n, dtype=torch.uint8)
        dist.broadcast(data, src=self._src, group=self._group)
        return bytes(data.numpy().tobytes())


def sglang_tp_channel() -> TpChannel:
    """This process's TP group in a running SGLang (``get_tp_group()``).

    Mirrors ``TpModelWorker``'s seed broadcast (``tp_worker.py``, 0.5.23): the group's
    ``cpu_group``, ``rank_in_group``, ``world_size`` and ``ranks[0]`` as the source.
    With adaptive speculation the policy exists only on ranks that host the draft model
    (the last pipeline stage), which is exactly this stage's TP group.
    """
    parallel_state = importlib.import_module("sglang.srt.distributed.parallel_state")
    group = parallel_state.get_tp_group()
    world_size = int(group.world_size)
    if world_size == 1:
        return LocalChannel()
    return TorchCpuGroupChannel(
        group.cpu_group,
        rank=int(group.rank_in_group),
        world_size=world_size,
        src_global_rank=int(group.ranks[0]),
    )


def default_channel() -> TpChannel:
    """SGLang's TP group inside SGLang; outside it (no ``sglang`` to import: the
    simulator, a test) this process is alone, so :class:`LocalChannel`."""
    try:
        importlib.import_module("sglang.srt.distributed.parallel_state")
    except ModuleNotFoundError as exc:
        # Only "no sglang at all" means "alone": an SGLang lacking this module may
        # still run several TP ranks, which must then not each read the spool.
        if exc.name == "sglang":
            return LocalChannel()
        raise
    return sglang_tp_channel()


def encode_table(table: StepTable) -> str:
    """The table's JSON as it travels in a payload (``StepTable.to_dict``)."""
    return json.dumps(table.to_dict(), allow_nan=False, separators=(",", ":"))


def encode_payload(
    enabled: bool, now_s: float, table: StepTable | None, *, table_json: str | None = None
) -> bytes:
    """Rank 0's broadcast: whether it reads a spool, its clock, and the table (or null).

    ``table_json``: ``encode_table(table)`` done already (rank 0 encodes a table once,
    when its spool reader hands it a new one, and forwards that text at every boundary).
    """
    head = json.dumps(
        {"v": PAYLOAD_VERSION, "enabled": enabled, "now_s": now_s},
        allow_nan=False,
        separators=(",", ":"),
    )
    text = "null" if table is None else (table_json or encode_table(table))
    return f'{head[:-1]},"table":{text}}}'.encode()


def decode_payload(payload: bytes) -> tuple[bool, float, StepTable | None]:
    """Inverse of :func:`encode_payload`; raises :class:`TpSyncError` naming the problem."""
    try:
        document = json.loads(payload.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise TpSyncError(f"TP sync payload: not JSON ({exc})") from None
    if not isinstance(document, dict) or set(document) != {"v", "enabled", "now_s", "table"}:
        raise TpSyncError(
            "TP sync payload: expected an object with keys ['enabled', 'now_s', 'table', 'v']"
        )
    if document["v"] != PAYLOAD_VERSION:
        raise TpSyncError(f"TP sync payload: version {document['v']!r}, expected 1")
    enabled, now_s, raw_table = document["enabled"], document["now_s"], document["table"]
    if not isinstance(enabled, bool):
        raise TpSyncError(f"TP sync payload: 'enabled' must be a bool, got {enabled!r}")
    if not is_real(now_s):
        raise TpSyncError(f"TP sync payload: 'now_s' must be a finite number, got {now_s!r}")
    if raw_table is None:
        return enabled, float(now_s), None
    try:
        return enabled, float(now_s), StepTable.from_dict(raw_table)
    except PolicyTypeError as exc:
        raise TpSyncError(f"TP sync payload: 'table': {exc}") from None


class TableSync:
    """Decides, identically on every TP rank, which table is in force.

    Call :meth:`tick` exactly once per ``get_steps_for_batch`` on every rank. At call
    0, ``every_batches``, 2 * ``every_batches``, ... it returns True and, while
    ``active``, synchronises: then ``table`` (None: none to follow) and ``now_s``
    (rank 0's ``clock()`` at this boundary; judge expiry against it) are what all ranks
    agree on (``now_s`` is None at a boundary where nothing was synchronised). Between
    boundaries it returns False and does nothing else.

    ``read_table`` (rank 0's spool reader; None when this process has no spool) is
    called on rank 0 only. ``channel_factory`` is called once, at the first boundary.
    Never raises: a channel that cannot be found, or a collective that fails, stops the
    synchronisation on this rank for good (``table`` stays None, so the engine's own
    controller answers) and is counted in ``errors``.
    """

    def __init__(
        self,
        *,
        read_table: Callable[[], StepTable | None] | None,
        channel_factory: Callable[[], TpChannel],
        every_batches: int,
        clock: Callable[[], float] = time.time,
    ) -> None:
        check_int("TableSync.every_batches", every_batches, error=TpSyncError, minimum=1)
        self._read_table = read_table
        self._factory = channel_factory
        self._every = every_batches
        self._clock = clock
        self._channel: TpChannel | None = None
        # Rank 0: the last table its reader returned and its payload text (the reader
        # returns the same object until the file changes, so it is encoded once).
        self._encoded: tuple[StepTable, str] | None = None
        self.table_encodings = 0
        self._calls = 0
        self.active = True  # False once rank 0 said "no spool", or after a failure
        self.decided = False  # True after the first boundary
        self.enabled = False  # rank 0 reads a spool (known after the first boundary)
        self.table: StepTable | None = None
        self.now_s: float | None = None
        self.rank: int | None = None
        self.world_size: int | None = None
        self.syncs = 0
        self.collectives = 0
        self.errors = 0
        self.last_error: str | None = None

    @property
    def every_batches(self) -> int:
        return self._every

    def tick(self) -> bool:
        """Count one ``get_steps_for_batch``; True at a boundary (synchronised if active)."""
        calls = self._calls
        self._calls = calls + 1
        if calls % self._every:
            return False
        if not self.active:
            self.now_s = None  # nothing agreed at this boundary
            return True
        try:
            self._sync()
        except Exception as exc:
            self._fail(exc)
        return True

    def _sync(self) -> None:
        channel = self._channel
        if channel is None:
            channel = self._channel = self._factory()
            self.rank = int(channel.rank)
            self.world_size = int(channel.world_size)
            logger.info(
                "specgov: TP rank %d of %d; %s",
                self.rank,
                self.world_size,
                "rank 0 reads the spool and broadcasts the table"
                if self.world_size > 1
                else "no TP synchronisation needed",
            )
        self.syncs += 1
        self.decided = True
        if self.world_size == 1:
            # Alone: no one to agree with, so skip the JSON round trip.
            self._adopt(*self._rank0_read())
            return
        payload = self._rank0_payload() if self.rank == 0 else b""
        self.collectives += 1
        payload = channel.broadcast_from_rank0(payload)
        # Every rank, rank 0 included, derives its state from these same bytes.
        try:
            decoded = decode_payload(payload)
        except TpSyncError as exc:
            self.errors += 1
            self.last_error = str(exc)
            logger.warning("specgov: ignoring a TP sync payload: %s", exc)
            self.table = None
            return
        self._adopt(*decoded)

    def _adopt(self, enabled: bool, now_s: float, table: StepTable | None) -> None:
        self.enabled = enabled
        self.now_s = now_s
        if not enabled:
            # Rank 0 has no spool: nothing will ever arrive; stop making collectives.
            self.active = False
            self.table = None
            return
        if table is not None and table == self.table:
            table = self.table  # keep the same object: cheap equality downstream
        self.table = table

    def _rank0_read(self) -> tuple[bool, float, StepTable | None]:
        enabled = self._read_table is not None
        try:
            table = self._read_table() if self._read_table is not None else None
            return enabled, float(self._clock()), table
        except Exception as exc:
            self._note(exc)
            return enabled, self.now_s if self.now_s is not None else 0.0, None

    def _rank0_payload(self) -> bytes:
        # Rank 0 must reach the collective whatever happens here, or the others hang.
        enabled, now_s, table = self._rank0_read()
        try:
            text = None
            if table is not None:
                cached = self._encoded
                if cached is not None and cached[0] is table:
                    text = cached[1]
                else:
                    text = encode_table(table)
                    self._encoded = (table, text)
                    self.table_encodings += 1
            payload = encode_payload(enabled, now_s, table, table_json=text)
            if len(payload) <= MAX_PAYLOAD_BYTES:
                return payload
            raise TpSyncError(f"table payload of {len(payload)} bytes exceeds {MAX_PAYLOAD_BYTES}")
        except Exception as exc:
            self._note(exc)
            return encode_payload(enabled, now_s, None)

    def _note(self, exc: BaseException) -> None:
        self.errors += 1
        self.last_error = f"{type(exc).__name__}: {exc}"
        logger.warning("specgov: rank 0 synchronises no table: %s", self.last_error)

    def _fail(self, exc: BaseException) -> None:
        self.errors += 1
        self.last_error = f"{type(exc).__name__}: {exc}"
        self.active = False
        self.decided = True
        self.table = None
        self.now_s = None
        logger.error(
            "specgov: TP table synchronisation failed on this rank (%s); following SGLang's "
            "own adaptive controller from now on",
            self.last_error,
        )
