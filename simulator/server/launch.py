"""What one launch of the simulated server is, and how each (re)start of it is built.

:class:`Launch` fixes what a real ``python -m sglang.launch_server`` command line would:
the deployment (:class:`~specgov.simulator.replay.runner.ServerSpec`, catalog names resolved),
the adaptive config file, and the in-engine policy. Each start or restart of the server
gets a fresh :class:`~specgov.simulator.server.driver.Generation` from
:meth:`Launch.new_generation` (engine, plugin, statistics writer, metrics) and the
``/server_info`` facts of that start from :meth:`Launch.launch_info`.

In-engine policy. With a ``spool_dir`` the engine runs specgov's SGLang plugin class,
:class:`~specgov.adapters.sglang_plugin.SpecgovAdaptiveParams`, exactly as SGLang would
construct it (``initial_steps``, ``cfg_path`` of an adaptive config written into the
spool, ``sglang_adaptive_config.json``, as a real launch with
``--speculative-adaptive-config`` would have one), on the spool protocol: it follows
``step_table.json`` and falls back to SGLang's EMA; it writes tier statistics with the
spool's :class:`~specgov.adapters.spool_stats.BackgroundStatsWriter` about once per wall
second (``stats_interval_s``, the plugin's flush interval, on the wall-mapped clock: a
daemon polls in wall time, and one window per simulated second at speed 100 would flood
the spool). The adaptive config defaults to
:func:`~specgov.simulator.replay.runner.specgov_adaptive_config`. Without a spool the engine
runs SGLang's own controller (:class:`~specgov.policies.engine.ema.EmaPolicy`, no plugin) on
SGLang's default config unless ``adaptive_config`` is given: the baseline. Drafters
SGLang cannot adapt (not EAGLE/EAGLE3, or topk > 1) run the static ``spec_steps``, and a
spool is then unused.

Plain. ``speculative=False`` is SGLang launched without ``--speculative-algorithm``: no
drafter in memory (a larger KV pool), no draft-extend or verify, the replay's ``none``
policy; ``/server_info`` reports ``speculative_algorithm`` null and a spool is unused. A
fleet restarts a replica this way "in the other mode" (``specgov fleet sim-restart``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Final

from specgov.adapters.sglang_plugin import SpecgovAdaptiveParams
from specgov.adapters.spool import SpoolError, SpoolSettings, atomic_write_bytes
from specgov.adapters.spool_stats import BackgroundStatsWriter, default_writer_id
from specgov.adapters.tp_sync import LocalChannel
from specgov.policies.common.types import TierStatsSnapshot
from specgov.policies.engine.adaptive_config import (
    DEFAULT_ADAPTIVE_CONFIG,
    AdaptiveConfig,
    parse_adaptive_config,
)
from specgov.policies.engine.ema import EmaPolicy
from specgov.simulator.engine.interface import VirtualClock
from specgov.simulator.replay.runner import (
    ADAPTIVE_ALGORITHMS,
    InEnginePolicy,
    ServerSpec,
    parse_policy,
    prepare_run,
    resolve,
    specgov_adaptive_config,
)
from specgov.simulator.server import endpoints as ep
from specgov.simulator.server.controls import SimServerError
from specgov.simulator.server.driver import Generation, RealTime
from specgov.simulator.server.served_metrics import ServedMetrics

logger = logging.getLogger(__name__)

ADAPTIVE_CONFIG_FILENAME: Final = "sglang_adaptive_config.json"
SKIP_ZERO_STEP_ENV: Final = "SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND"
# sglang 0.5.23 srt/environ.py EnvBool.parse (case-insensitive).
_ENV_TRUE = ("true", "1", "yes", "y")
_ENV_FALSE = ("false", "0", "no", "n")


def skip_zero_step_from_env(environ: Mapping[str, str]) -> bool | None:
    """``SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND`` as SGLang 0.5.23 parses it; None: unset."""
    raw = environ.get(SKIP_ZERO_STEP_ENV)
    if raw is None:
        return None
    value = raw.lower()
    if value in _ENV_TRUE:
        return True
    if value in _ENV_FALSE:
        return False
    raise SimServerError(
        f"{SKIP_ZERO_STEP_ENV}={raw!r}: expected one of {', '.join(_ENV_TRUE + _ENV_FALSE)} "
        "(SGLang's boolean environment values)"
    )


def apply_launch_env(server: ServerSpec, environ: Mapping[str, str]) -> ServerSpec:
    """*server* as a SGLang process launched with *environ* runs it: a set
    ``SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND`` decides the skip flag."""
    skip = skip_zero_step_from_env(environ)
    if skip is None or skip == server.skip_zero_step_draft_extend:
        return server
    return dataclasses.replace(server, skip_zero_step_draft_extend=skip)


class Launch:
    """One launch's fixed settings (module docstring). ``policy_name`` is
    ``specgov-plugin``, ``sglang-ema``, ``static:K`` or ``none`` (plain)."""

    def __init__(
        self,
        server: ServerSpec,
        *,
        spool_dir: Path | None,
        adaptive_config: Mapping[str, Any] | None,
        seed: int,
        speed: float,
        stats_interval_s: float,
        environ: Mapping[str, str] | None = None,
        speculative: bool = True,
    ) -> None:
        # The simulated SGLang process reads its environment like SGLang does.
        env = os.environ if environ is None else environ
        server = apply_launch_env(server, env)
        self.server = server
        self.spool_dir = spool_dir
        # The plugin's spool rules (SPECGOV_SPOOL_GROUP, SPECGOV_DAEMON_UID,
        # SPECGOV_MAX_TABLE_TTL_S) for the plugin and the statistics writer alike, so a
        # daemon running as another user reads what this server writes (the two-user
        # rehearsal in docs/spool-security.md).
        try:
            self.spool_settings = SpoolSettings.from_env(env)
        except SpoolError as exc:
            raise SimServerError(str(exc)) from None
        self.seed = seed
        self.speed = speed
        self.stats_interval_s = stats_interval_s
        self._built = resolve(server)
        algorithm = self._built.drafter.algorithm.upper()
        self.speculative = speculative
        self.algorithm = algorithm if speculative else None
        self.adaptive = speculative and algorithm in ADAPTIVE_ALGORITHMS and server.topk == 1
        self._adaptive_cfg: AdaptiveConfig | None = None
        self._adaptive_raw: dict[str, Any] | None = None
        if self.adaptive:
            if adaptive_config is None and spool_dir is not None:
                adaptive_config = specgov_adaptive_config()
            if adaptive_config is not None:
                self._adaptive_cfg = parse_adaptive_config(
                    adaptive_config, source="SimServer adaptive_config"
                )
                # A private copy, written as the launch's --speculative-adaptive-config.
                self._adaptive_raw = json.loads(json.dumps(adaptive_config))
            else:
                self._adaptive_cfg = parse_adaptive_config(
                    DEFAULT_ADAPTIVE_CONFIG, source="SGLang's default adaptive config"
                )
        elif spool_dir is not None and not speculative:
            logger.warning(
                "specgov sim-server: a plain server (no --speculative-algorithm) has no "
                "speculation to steer; the spool %s is not used",
                spool_dir,
            )
        elif spool_dir is not None:
            logger.warning(
                "specgov sim-server: %s with topk=%d has no adaptive speculation in SGLang; "
                "the engine runs %d static steps and the spool %s is not used",
                algorithm,
                server.topk,
                server.spec_steps,
                spool_dir,
            )
        if spool_dir is not None and self.adaptive:
            self.policy_name = "specgov-plugin"
        elif self.adaptive:
            self.policy_name = "sglang-ema"
        elif not speculative:
            self.policy_name = "none"
        else:
            self.policy_name = f"static:{server.spec_steps}"
        self._tmpdir: tempfile.TemporaryDirectory[str] | None = None
        self.config_path: Path | None = None

    def summary(self) -> dict[str, Any]:
        """The simulated deployment, catalog names resolved (as a replay report has it)."""
        built = self._built
        return {
            "gpu": built.gpu.name,
            "model": built.model.name,
            "drafter": built.drafter.name,
            "algorithm": self.algorithm,
            "speculative": self.speculative,
            "spec_steps": self.server.spec_steps,
            "topk": self.server.topk,
            "acceptance_profile": (
                self.server.acceptance_profile or built.drafter.acceptance_profile
            ),
            "prefix_cache": self.server.prefix_cache,
            "hierarchical_cache": self.server.hierarchical_cache,
        }

    def write_adaptive_config(self) -> None:
        """Write the ``--speculative-adaptive-config`` file (into the spool, else a
        temporary folder that :meth:`cleanup` removes). A spool of another user's (the
        daemon's, ``SPECGOV_DAEMON_UID``) is not this server's to write: the temporary
        folder then, readable by others as an /etc file would be (doctor reads it)."""
        if not self.adaptive or self._adaptive_raw is None:
            return  # SGLang's default config: no file, speculative_adaptive_config null
        shared = self.spool_dir is not None and self.spool_settings.daemon_uid is not None
        if self.spool_dir is not None and not shared:
            folder = self.spool_dir
            folder.mkdir(parents=True, exist_ok=True)
        else:
            self._tmpdir = tempfile.TemporaryDirectory(prefix="specgov-sim-")
            folder = Path(self._tmpdir.name)
            if shared:
                folder.chmod(0o755)
        path = folder.resolve() / ADAPTIVE_CONFIG_FILENAME
        data = json.dumps(self._adaptive_raw, indent=2, sort_keys=True).encode() + b"\n"
        atomic_write_bytes(path, data, mode=0o644 if shared else None)
        self.config_path = path

    def cleanup(self) -> None:
        if self._tmpdir is not None:
            self._tmpdir.cleanup()
            self._tmpdir = None

    def new_generation(self, index: int, clock: RealTime) -> Generation:
        """A fresh engine, policy (a new plugin instance re-reading the spool), stats
        writer and metrics: start number ``index`` of this launch."""
        clocks: list[VirtualClock] = []

        def plugin_clock() -> float:
            return clock.wall_of(clocks[0].now_s) if clocks else time.time()

        plugin: SpecgovAdaptiveParams | None = None
        writer: BackgroundStatsWriter | None = None
        policy: InEnginePolicy
        if self.policy_name == "specgov-plugin":
            assert self.spool_dir is not None and self.config_path is not None
            # A restarted server is a new process to the daemon: a new statistics writer.
            writer_id = f"{default_writer_id()[:48]}-g{index}"
            writer = BackgroundStatsWriter(
                self.spool_dir, writer_id=writer_id, settings=self.spool_settings
            )
            plugin = SpecgovAdaptiveParams(
                self.server.spec_steps,
                str(self.config_path),
                spool_dir=self.spool_dir,
                spool_settings=self.spool_settings,
                original=None,
                channel_factory=LocalChannel,
                clock=plugin_clock,
                flush_interval_s=self.stats_interval_s,
                stats_writer=self._scaled_sink(writer),
            )
            if plugin.disabled_reason is not None:
                raise SimServerError(
                    f"the specgov plugin disabled itself: {plugin.disabled_reason}"
                )
            built_plugin = plugin
            policy = InEnginePolicy(
                "specgov-plugin",
                True,
                tuple(plugin.candidate_steps),
                lambda _initial: built_plugin,
                adaptive=True,
            )
        elif self.policy_name == "sglang-ema":
            cfg = self._adaptive_cfg
            assert cfg is not None
            policy = InEnginePolicy(
                "sglang-ema",
                True,
                tuple(cfg.candidate_steps),
                lambda initial: EmaPolicy(initial, cfg),
                adaptive=True,
            )
        else:
            policy = parse_policy(self.policy_name)
        prepared = prepare_run(self.server, policy, seed=self.seed, built=self._built)
        clocks.append(prepared.engine.clock)
        ndt = self._num_draft_tokens()
        metrics = ServedMetrics(
            model_name=f"{ep.SIM_MODEL_PREFIX}{self._built.model.name}",
            kv_capacity_tokens=prepared.memory.kv_token_capacity,
            wall_of=clock.wall_of,
            draft_per_round=(ndt - 1) if ndt else self.server.spec_steps,
        )
        return Generation(index, prepared, metrics, plugin, writer)

    def launch_info(
        self, gen: Generation, *, host: str, port: int, api_key_set: bool
    ) -> ep.LaunchInfo:
        """What ``/server_info`` and ``/model_info`` report for ``gen``."""
        mem = gen.prepared.memory
        cfg = gen.engine.config
        graph_bs = gen.engine.cuda_graph_bs
        spool = "" if self.spool_dir is None else f" --spool-dir {self.spool_dir}"
        spec = self.speculative
        return ep.LaunchInfo(
            model=self._built.model.name,
            gpu=self._built.gpu.name,
            host=host,
            port=port,
            kv_capacity_tokens=mem.kv_token_capacity,
            effective_max_running_requests=cfg.running_cap,
            chunked_prefill_size=cfg.chunked_prefill_size,
            mem_fraction_static=mem.mem_fraction_static,
            weight_gib=mem.target_weights_gib,
            kv_cache_gib=mem.kv_pool_gib,
            graph_gib=mem.cuda_graph_total_gib,
            total_gib=mem.total_gib,
            drafter=self._built.drafter.name if spec else None,
            speculative_algorithm=self.algorithm,
            speculative_num_steps=self.server.spec_steps if spec else None,
            disable_radix_cache=not self.server.prefix_cache,
            enable_hierarchical_cache=self.server.hierarchical_cache,
            hicache_ratio=self.server.hicache_ratio,
            hicache_size=self.server.hicache_size_gb,
            speculative_eagle_topk=self.server.topk if spec else None,
            speculative_num_draft_tokens=self._num_draft_tokens() if spec else None,
            speculative_adaptive=self.adaptive,
            speculative_adaptive_config=(
                None if self.config_path is None else str(self.config_path)
            ),
            max_running_requests=self.server.max_running_requests,
            cuda_graph_max_bs=cfg.cuda_graph_max_bs,
            decode_cuda_graph_bs=None if graph_bs is None else tuple(graph_bs),
            launch_command=(
                f"specgov sim-server --port {port} --speed {self.speed:g}{spool}"
                + ("" if spec else " --speculative-algorithm NONE")
                + ("" if self.server.prefix_cache else " --disable-radix-cache")
                + self._hicache_flags()
            ),
            api_key_set=api_key_set,
            startup_time={"load_weight": 0.0, "kv_cache_allocation": 0.0},
        )

    def _hicache_flags(self) -> str:
        s = self.server
        if not s.hierarchical_cache:
            return ""
        out = " --enable-hierarchical-cache"
        if s.hicache_ratio is not None:
            out += f" --hicache-ratio {s.hicache_ratio:g}"
        if s.hicache_size_gb:
            out += f" --hicache-size {s.hicache_size_gb}"
        return out

    def _num_draft_tokens(self) -> int:
        if self.server.topk == 1 or self.server.num_draft_tokens is None:
            return self.server.spec_steps + 1
        return self.server.num_draft_tokens

    def _scaled_sink(self, writer: BackgroundStatsWriter) -> Callable[[TierStatsSnapshot], object]:
        speed = self.speed

        def submit(snapshot: TierStatsSnapshot) -> bool:
            # The plugin timed each step on the wall-mapped clock (sim_dt / speed).
            tiers = tuple(
                dataclasses.replace(t, step_time_sum_s=t.step_time_sum_s * speed)
                for t in snapshot.tiers
            )
            return writer.submit(dataclasses.replace(snapshot, tiers=tiers))

        return submit
