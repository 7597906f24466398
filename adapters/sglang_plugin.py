"""specgov's SGLang general plugin: the in-engine step policy (DESIGN.md, "Fast loop").

Setup is: install specgov in SGLang's environment, launch with
``--speculative-adaptive`` (optionally ``--speculative-adaptive-config``), and point
``SPECGOV_SPOOL_DIR`` at the daemon's spool directory. SGLang discovers the entry point
``specgov = "specgov.adapters.sglang_plugin:register"`` in group ``sglang.srt.plugins``
(honouring the ``SGLANG_PLUGINS`` allow-list) in every process and calls
:func:`register`, which captures SGLang's own ``AdaptiveSpeculativeParams`` and asks
SGLang's ``HookRegistry`` to REPLACE it with :class:`SpecgovAdaptiveParams`
everywhere it was imported (``EAGLEWorkerV2`` builds it as
``AdaptiveSpeculativeParams(initial_steps=..., cfg_path=...)``).

:class:`SpecgovAdaptiveParams` implements SGLang's ``AdaptiveSpecPolicy`` protocol:

* It constructs SGLang's original class first, with the same arguments: a bad adaptive
  config fails exactly as SGLang would (same exception, same message), because SGLang
  would refuse to start. It then reads the same JSON again with
  :func:`~specgov.policies.engine.adaptive_config.parse_adaptive_config` (same schema and
  meaning; stricter only where SGLang would crash later). If that stricter check
  fails, specgov steps aside and SGLang's class answers alone.
* Passthrough mode, the answer to "SPECGOV_SPOOL_DIR unset" (on TP rank 0): every call
  goes straight to SGLang's original instance, so the engine behaves exactly as without
  specgov. Outside SGLang (no original class to capture) the passthrough is
  :class:`~specgov.policies.engine.ema.EmaPolicy`, contract-tested to answer call for call
  like SGLang's class.
* Table mode (rank 0 has a spool): :class:`~specgov.policies.engine.table.TablePolicy`
  answers from the daemon's step table and falls back to its ``EmaPolicy`` (which it
  feeds every verify, so it is warm) whenever the table is missing, stale or invalid.
  ``TablePolicy`` needs ``EmaPolicy``'s routing introspection (padding, slot bounds,
  captured graph sizes) that SGLang's class exposes only as private members, so the
  fallback inside table mode is ``EmaPolicy``, not the original instance; both give the
  same answers (tests/contract/test_sglang_adaptive.py). With no table in force the
  engine therefore still chooses exactly what SGLang's controller would.
* The table arrives through :class:`~specgov.adapters.tp_sync.TableSync`: every
  ``poll_every_batches`` decode batches rank 0 ``stat``\\ s the spool (one syscall; the
  file is re-read only when it changed) and broadcasts the table and its clock to the
  other TP ranks; no IO on the other batches. ``TablePolicy`` polls at the very same
  calls and judges expiry against rank 0's broadcast clock, so ranks never diverge.
* Statistics: ``TablePolicy`` hands a per-tier snapshot about once a second to the
  spool's :class:`~specgov.adapters.spool_stats.BackgroundStatsWriter` (TP rank 0 only), which
  writes it on a background thread; a full queue drops, never blocks.
* Nothing specgov does raises into SGLang: any failure in specgov's parts degrades to
  the fallback and is counted in ``errors``. (Exceptions raised by SGLang's own class in
  passthrough mode propagate unchanged: that is SGLang behaving as SGLang.)
* Times are wall-clock epoch seconds (``time.time()``) throughout, like the daemon's
  ``StepTable.produced_at_s``, so expiry compares like with like.
* The spool belongs to its owner (docs/spool-security.md): a spool directory others
  could write disables specgov at start (and stops tables being followed if it turns
  so later); only tables owned by the daemon's uid (``SPECGOV_DAEMON_UID``, default
  the server's own) are followed, never past the TTL cap (``SPECGOV_MAX_TABLE_TTL_S``);
  statistics are written 0640 in ``SPECGOV_SPOOL_GROUP`` when one is set.
* SGLang's next interface (REFERENCE.md section 1, upstream after 0.5.23): every method
  accepts keyword arguments it does not know and ignores them; ``num_steps`` (also
  positional, as upstream's ``AdaptiveController`` passes it) and ``ctx_repr`` are
  handed on to SGLang's own instance when its method takes them, so passthrough stays
  exactly SGLang; ``on_state_activated(steps)`` exists (upstream calls it after every
  state switch) and is handed on the same way. specgov's tables have no context-length
  dimension, so in table mode ``ctx_repr`` is not used for the choice.

Importing this module imports neither torch nor sglang; :func:`register` imports
SGLang's hook registry, and the TP channel imports torch at the first poll.
"""

from __future__ import annotations

import enum
import importlib
import inspect
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

from specgov.adapters.spool import SpoolSettings, check_spool_dir
from specgov.adapters.spool_stats import BackgroundStatsWriter
from specgov.adapters.spool_table import SpoolTableReader
from specgov.adapters.tp_sync import TableSync, TpChannel, default_channel
from specgov.policies.common.step_table import StepTable
from specgov.policies.common.types import TierStatsSnapshot
from specgov.policies.engine.adaptive_config import (
    DEFAULT_ADAPTIVE_CONFIG,
    AdaptiveConfig,
    parse_adaptive_config,
)
from specgov.policies.engine.ema import EmaPolicy
from specgov.policies.engine.protocol import AdaptiveSpecPolicy
from specgov.policies.engine.table import (
    DEFAULT_FLUSH_INTERVAL_S,
    DEFAULT_POLL_EVERY_BATCHES,
    TablePolicy,
)

logger = logging.getLogger(__name__)

SPEC_PARAMS_MODULE: Final = "sglang.srt.speculative.adaptive_spec_params"
HOOK_TARGET: Final = f"{SPEC_PARAMS_MODULE}.AdaptiveSpeculativeParams"
HOOK_REGISTRY_MODULE: Final = "sglang.srt.plugins.hook_registry"
SPOOL_DIR_ENV: Final = "SPECGOV_SPOOL_DIR"

PASSTHROUGH: Final = "passthrough"
TABLE: Final = "table"
UNDECIDED: Final = "undecided"

# SGLang's own class, captured by register() before the REPLACE is applied. Held inside
# a dict on purpose: HookRegistry's _propagate_patch rebinds every module attribute that
# *is* the original class to the replacement, which would turn a plain module global
# into SpecgovAdaptiveParams itself (and its constructor into infinite recursion).
_captured: dict[str, type] = {}


class _Default(enum.Enum):
    TOKEN = 0


_DEFAULT: Final = _Default.TOKEN


def _keywords_taken(fn: object) -> frozenset[str] | None:
    """The names ``fn`` takes by keyword; None when it takes ``**kwargs`` (any name)."""
    try:
        signature = inspect.signature(fn)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return frozenset()
    names = set()
    for param in signature.parameters.values():
        if param.kind is inspect.Parameter.VAR_KEYWORD:
            return None
        if param.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY):
            names.add(param.name)
    return frozenset(names)


def _only_taken(kwargs: dict[str, Any], taken: frozenset[str] | None) -> dict[str, Any]:
    if taken is None:
        return kwargs
    return {k: v for k, v in kwargs.items() if k in taken}


def original_class() -> type | None:
    """SGLang's ``AdaptiveSpeculativeParams`` as :func:`register` found it, or None."""
    return _captured.get("original")


def register() -> None:
    """SGLang general-plugin entry point: REPLACE SGLang's adaptive-steps policy class.

    Called by SGLang's ``load_plugins()`` in every process, before its
    ``HookRegistry.apply_hooks()``.
    """
    registry = importlib.import_module(HOOK_REGISTRY_MODULE)
    if "original" not in _captured:
        try:
            # Same import apply_hooks() is about to do (pkgutil.resolve_name), so
            # capturing the class here costs nothing extra.
            current = importlib.import_module(SPEC_PARAMS_MODULE).AdaptiveSpeculativeParams
            if isinstance(current, type) and not issubclass(current, SpecgovAdaptiveParams):
                _captured["original"] = current
        except Exception as exc:
            logger.warning(
                "specgov: could not capture SGLang's AdaptiveSpeculativeParams (%s: %s); "
                "its faithful re-implementation EmaPolicy will be the fallback",
                type(exc).__name__,
                exc,
            )
    registry.HookRegistry.register(HOOK_TARGET, SpecgovAdaptiveParams, registry.HookType.REPLACE)
    logger.info(
        "specgov: registered %s as REPLACE for %s", SpecgovAdaptiveParams.__name__, HOOK_TARGET
    )


def load_adaptive_config(cfg_path: str | os.PathLike[str] | None) -> AdaptiveConfig:
    """The adaptive config SGLang would load for ``cfg_path``, validated.

    Reads the file as SGLang's ``_load_adaptive_config`` does (``open`` + ``json.load``,
    so a missing file or bad JSON raises the same exception types); raises
    :class:`~specgov.policies.engine.adaptive_config.AdaptiveConfigError` (a ValueError) for a
    bad config, naming the file and key.
    """
    if cfg_path is None:
        return parse_adaptive_config(DEFAULT_ADAPTIVE_CONFIG, source="<SGLang default config>")
    with open(cfg_path) as fh:
        cfg = json.load(fh)
    return parse_adaptive_config(cfg, source=str(cfg_path))


class SpecgovAdaptiveParams:
    """Drop-in replacement for SGLang's ``AdaptiveSpeculativeParams``; see the module doc.

    SGLang 0.5.23 calls it with ``(initial_steps, cfg_path=None)`` only; any other
    keyword argument (a later SGLang's) is handed to SGLang's own class when its
    constructor takes it, and otherwise ignored. The keyword-only parameters exist for
    tests, benchmarks and the simulator:

    * ``spool_dir``: default ``$SPECGOV_SPOOL_DIR`` (unset or empty: no spool);
    * ``original``: SGLang's class (default: as captured by :func:`register`; None:
      use ``EmaPolicy`` as the passthrough);
    * ``channel_factory``: the TP group (default: SGLang's, found at the first poll);
    * ``clock``: epoch seconds (default ``time.time``);
    * ``stats_writer``: where rank 0's statistics go (default: a
      :class:`BackgroundStatsWriter` on the spool; None: nowhere);
    * ``spool_settings``: group, daemon uid and TTL cap (default:
      :meth:`SpoolSettings.from_env`).
    """

    def __init__(
        self,
        initial_steps: int,
        cfg_path: str | None = None,
        *,
        spool_dir: str | os.PathLike[str] | _Default | None = _DEFAULT,
        original: type | _Default | None = _DEFAULT,
        channel_factory: Callable[[], TpChannel] = default_channel,
        clock: Callable[[], float] = time.time,
        poll_every_batches: int = DEFAULT_POLL_EVERY_BATCHES,
        flush_interval_s: float = DEFAULT_FLUSH_INTERVAL_S,
        stats_writer: Callable[[TierStatsSnapshot], object] | _Default | None = _DEFAULT,
        spool_settings: SpoolSettings | _Default = _DEFAULT,
        **sglang_kwargs: Any,
    ) -> None:
        original_cls: Any = original_class() if original is _DEFAULT else original
        if original_cls is not None and issubclass(original_cls, SpecgovAdaptiveParams):
            original_cls = None  # never wrap ourselves
        # SGLang's own constructor first: its validation, its exceptions, its messages;
        # with the keyword arguments of a later SGLang that it takes.
        self._ignored_keywords: set[str] = set()
        self._original: Any = None
        if original_cls is not None:
            taken = _only_taken(sglang_kwargs, _keywords_taken(original_cls))
            self._note_ignored(sglang_kwargs, taken)
            self._original = original_cls(initial_steps, cfg_path, **taken)
        else:
            self._note_ignored(sglang_kwargs, {})
        self._clock = clock
        self._policy: TablePolicy | None = None
        self._sync: TableSync | None = None
        self._reader: SpoolTableReader | None = None
        self._writer: Callable[[TierStatsSnapshot], object] | None = None
        self._spool_dir: Path | None = None
        self._clock_override: float | None = None
        self._boundary = False
        self._undecided = True
        self.disabled_reason: str | None = None
        self.errors = 0
        self.last_error: str | None = None
        self.misaligned_polls = 0

        config: AdaptiveConfig | None = None
        try:
            config = load_adaptive_config(cfg_path)
        except Exception as exc:
            if self._original is None:
                raise  # what SGLang would raise (same type, same meaning): it won't start
            self._disable(f"the adaptive config failed specgov's stricter check: {exc}")
        self._passthrough: Any = (
            self._original if self._original is not None else EmaPolicy(initial_steps, config)
        )
        self._candidates: list[int] = list(self._passthrough.candidate_steps)
        self._candidate_set = frozenset(self._candidates)
        self._last_resort: int = self._passthrough.get_steps_for_batch(1)
        # Which keywords of a later SGLang each of the passthrough's methods takes.
        self._takes_get = _keywords_taken(self._passthrough.get_steps_for_batch)
        self._takes_verify = _keywords_taken(self._passthrough.on_verify_complete)
        activated = getattr(self._passthrough, "on_state_activated", None)
        self._passthrough_activated: Callable[..., object] | None = (
            activated if callable(activated) else None
        )
        self._takes_activated = _keywords_taken(activated) if callable(activated) else None
        self.activated_steps: int | None = None
        if config is not None:
            try:
                self._build(
                    initial_steps,
                    config,
                    spool_dir=spool_dir,
                    channel_factory=channel_factory,
                    poll_every_batches=poll_every_batches,
                    flush_interval_s=flush_interval_s,
                    stats_writer=stats_writer,
                    spool_settings=spool_settings,
                )
            except Exception as exc:
                self._policy = None
                self._sync = None
                self._disable(f"{type(exc).__name__}: {exc}")

    def _build(
        self,
        initial_steps: int,
        config: AdaptiveConfig,
        *,
        spool_dir: str | os.PathLike[str] | _Default | None,
        channel_factory: Callable[[], TpChannel],
        poll_every_batches: int,
        flush_interval_s: float,
        stats_writer: Callable[[TierStatsSnapshot], object] | _Default | None,
        spool_settings: SpoolSettings | _Default,
    ) -> None:
        raw_dir = os.environ.get(SPOOL_DIR_ENV) if spool_dir is _DEFAULT else spool_dir
        self._spool_dir = Path(raw_dir) if raw_dir else None
        fallback = EmaPolicy(initial_steps, config)
        if fallback.candidate_steps != self._candidates:
            raise RuntimeError(
                f"specgov read candidate steps {fallback.candidate_steps} from the adaptive "
                f"config, SGLang {self._candidates}"
            )
        if self._spool_dir is not None:
            settings = SpoolSettings.from_env() if spool_settings is _DEFAULT else spool_settings
            if self._spool_dir.is_dir():
                # Refuse a spool others could write before following anything from it
                # (raises SpoolSecurityError: specgov disables itself, saying why).
                check_spool_dir(
                    self._spool_dir,
                    group_gid=settings.group_gid,
                    trusted_uids=settings.trusted_uids,
                )
            self._reader = SpoolTableReader(
                self._spool_dir, self._candidates, self._clock, settings=settings
            )
            self._writer = (
                BackgroundStatsWriter(self._spool_dir, settings=settings)
                if stats_writer is _DEFAULT
                else stats_writer
            )
        elif stats_writer is not _DEFAULT:
            self._writer = stats_writer
        self._sync = TableSync(
            read_table=self._reader,
            channel_factory=channel_factory,
            every_batches=poll_every_batches,
            clock=self._clock,
        )
        self._policy = TablePolicy(
            table_source=self._synced_table,
            stats_sink=self._stats_sink,
            clock=self._policy_clock,
            fallback=fallback,
            flush_interval_s=flush_interval_s,
            poll_every_batches=poll_every_batches,
        )

    # ---------------------------------------------------------- SGLang protocol

    @property
    def candidate_steps(self) -> list[int]:
        """Union of the slots' candidate steps: the runtime states SGLang prebuilds."""
        return list(self._candidates)

    def set_cuda_graph_bs(self, cuda_graph_bs: list[int] | None, **kwargs: Any) -> None:
        self._note_ignored(kwargs, {})
        self._passthrough.set_cuda_graph_bs(cuda_graph_bs)
        policy = self._policy
        if policy is not None:
            try:
                policy.set_cuda_graph_bs(cuda_graph_bs)
            except Exception as exc:
                self._note_error(exc)

    def get_steps_for_batch(self, batch_size: int, **kwargs: Any) -> int:
        policy = self._policy
        if policy is None and not kwargs:  # passthrough under 0.5.23: as cheap as can be
            return self._passthrough.get_steps_for_batch(batch_size)  # type: ignore[no-any-return]
        if kwargs:
            # ctx_repr (upstream's context-length buckets) and whatever comes next:
            # SGLang's own instance gets what it takes; specgov's tables have no use for it.
            kwargs = self._for_passthrough(kwargs, self._takes_get)
        if policy is None:
            return self._passthrough.get_steps_for_batch(batch_size, **kwargs)  # type: ignore[no-any-return]
        try:
            sync = self._sync
            assert sync is not None
            if sync.tick():
                # TablePolicy polls at this very call: hand it rank 0's clock reading.
                self._clock_override = sync.now_s
                self._boundary = True
            if self._undecided:
                self._undecided = False
                if not sync.enabled:
                    self._boundary = False
                    self._clock_override = None
                    self._enter_passthrough(sync)
                    return self._passthrough.get_steps_for_batch(batch_size, **kwargs)  # type: ignore[no-any-return]
                self._log_table_mode(sync)
            steps = policy.get_steps_for_batch(batch_size)
            self._boundary = False
            self._clock_override = None
            return steps
        except Exception as exc:
            self._boundary = False
            self._clock_override = None
            self._note_error(exc)
            return self._safe_steps(batch_size)

    def on_verify_complete(
        self,
        num_correct_drafts_per_req: list[int],
        batch_size: int,
        num_steps: int | None = None,
        **kwargs: Any,
    ) -> int | None:
        """``num_steps`` (upstream after 0.5.23: the steps the verified batch ran with,
        passed third) and any other keyword go to SGLang's own instance when it takes
        them; the table decides from its own record of the steps it chose."""
        policy = self._policy
        if policy is None and num_steps is None and not kwargs:  # passthrough under 0.5.23
            return self._passthrough.on_verify_complete(  # type: ignore[no-any-return]
                num_correct_drafts_per_req, batch_size
            )
        if num_steps is not None:
            kwargs["num_steps"] = num_steps
        if kwargs:
            kwargs = self._for_passthrough(kwargs, self._takes_verify)
        if policy is None:
            return self._passthrough.on_verify_complete(  # type: ignore[no-any-return]
                num_correct_drafts_per_req, batch_size, **kwargs
            )
        if self._undecided:
            # A verify before the first decode lookup: feed both, answer as SGLang.
            try:
                policy.on_verify_complete(num_correct_drafts_per_req, batch_size)
            except Exception as exc:
                self._note_error(exc)
            return self._passthrough.on_verify_complete(  # type: ignore[no-any-return]
                num_correct_drafts_per_req, batch_size, **kwargs
            )
        try:
            return policy.on_verify_complete(num_correct_drafts_per_req, batch_size)
        except Exception as exc:
            self._note_error(exc)
            return None

    def cuda_graph_bs_for_step(self, step: int, **kwargs: Any) -> list[int] | None:
        """SGLang's own answer, so the engine captures exactly what it would without us."""
        self._note_ignored(kwargs, {})
        return self._passthrough.cuda_graph_bs_for_step(step)  # type: ignore[no-any-return]

    def on_state_activated(self, steps: int, **kwargs: Any) -> None:
        """Upstream after 0.5.23 calls this after every runtime-state switch. Recorded in
        ``activated_steps``; handed to SGLang's own instance when it has the method and
        specgov is not answering from a table (then SGLang's instance sees exactly the
        calls it would see without specgov)."""
        self.activated_steps = steps
        activated = self._passthrough_activated
        if activated is None:
            self._note_ignored(kwargs, {})
            return
        if kwargs:
            kwargs = self._for_passthrough(kwargs, self._takes_activated)
        if self._policy is None or self._undecided:
            activated(steps, **kwargs)

    # ----------------------------------------------------------- introspection

    @property
    def mode(self) -> str:
        """``passthrough`` (SGLang's controller answers), ``table`` or ``undecided``
        (before the first decode batch)."""
        if self._policy is None:
            return PASSTHROUGH
        return UNDECIDED if self._undecided else TABLE

    @property
    def policy(self) -> TablePolicy | None:
        return self._policy

    @property
    def passthrough(self) -> AdaptiveSpecPolicy:
        """SGLang's original instance (or its EmaPolicy stand-in)."""
        return self._passthrough  # type: ignore[no-any-return]

    @property
    def sync(self) -> TableSync | None:
        return self._sync

    @property
    def reader(self) -> SpoolTableReader | None:
        return self._reader

    @property
    def stats_writer(self) -> Callable[[TierStatsSnapshot], object] | None:
        return self._writer

    @property
    def spool_dir(self) -> Path | None:
        return self._spool_dir

    @property
    def table(self) -> StepTable | None:
        """The table in force, or None when the fallback answers."""
        return None if self._policy is None else self._policy.table

    # ---------------------------------------------------------------- internals

    def _policy_clock(self) -> float:
        override = self._clock_override
        if override is not None:
            self._clock_override = None
            return override
        return self._clock()

    def _synced_table(self) -> StepTable | None:
        sync = self._sync
        if not self._boundary:
            # TablePolicy polled off the synchronised cadence (only after an internal
            # error of its own): the answer may be judged against a local clock.
            self.misaligned_polls += 1
            if self.misaligned_polls == 1:
                logger.warning("specgov: TablePolicy polled off the TP sync cadence")
        return None if sync is None else sync.table

    def _stats_sink(self, snapshot: TierStatsSnapshot) -> None:
        writer = self._writer
        sync = self._sync
        if writer is not None and sync is not None and sync.rank == 0:
            writer(snapshot)

    def _enter_passthrough(self, sync: TableSync) -> None:
        self._policy = None
        if sync.errors:
            why = f"the TP table synchronisation failed ({sync.last_error})"
        elif sync.world_size is not None and sync.world_size > 1:
            why = f"TP rank 0 has no spool ({SPOOL_DIR_ENV} unset there)"
        else:
            why = f"{SPOOL_DIR_ENV} is unset"
        logger.info(
            "specgov: installed; %s, so SGLang's own adaptive controller answers, unchanged",
            why,
        )

    def _log_table_mode(self, sync: TableSync) -> None:
        where = f"the spool {self._spool_dir}" if sync.rank == 0 else "TP rank 0's broadcasts"
        logger.info(
            "specgov: following step tables from %s every %d decode batches (TP rank %s of "
            "%s); SGLang's controller (EmaPolicy) answers whenever no valid table is in force",
            where,
            sync.every_batches,
            sync.rank,
            sync.world_size,
        )

    def _disable(self, why: str) -> None:
        self.disabled_reason = why
        logger.warning(
            "specgov: disabled (%s); SGLang's own adaptive controller answers, unchanged", why
        )

    @property
    def ignored_keywords(self) -> frozenset[str]:
        """Keyword arguments SGLang passed that neither specgov nor SGLang's own instance
        takes (each logged once)."""
        return frozenset(self._ignored_keywords)

    def _for_passthrough(
        self, kwargs: dict[str, Any], taken: frozenset[str] | None
    ) -> dict[str, Any]:
        passed = _only_taken(kwargs, taken)
        if len(passed) != len(kwargs):
            self._note_ignored(kwargs, passed)
        return passed

    def _note_ignored(self, kwargs: dict[str, Any], passed: dict[str, Any]) -> None:
        for name in kwargs:
            if name not in passed and name not in self._ignored_keywords:
                self._ignored_keywords.add(name)
                logger.info(
                    "specgov: SGLang passes the keyword argument %r, which this specgov "
                    "version does not use; ignored",
                    name,
                )

    def _note_error(self, exc: BaseException) -> None:
        self.errors += 1
        self.last_error = f"{type(exc).__name__}: {exc}"
        if self.errors == 1:
            logger.error("specgov: internal error, using the fallback: %s", self.last_error)

    def _safe_steps(self, batch_size: int) -> int:
        try:
            policy = self._policy
            source: Any = policy.fallback if policy is not None else self._passthrough
            steps = source.get_steps_for_batch(batch_size)
            if steps in self._candidate_set:
                return int(steps)
        except Exception as exc:
            self._note_error(exc)
        return self._last_resort
