"""SGLang 0.5.23-shaped JSON bodies for the simulated server (pure functions, no IO).

The simulated server's routes (:mod:`specgov.simulator.server.routes`) answer the
endpoints a specgov daemon reads from SGLang with the bodies built here, from two value
objects: :class:`LaunchInfo` (what a launch fixes: server args, memory plan, CUDA-graph
sizes) and :class:`LiveState` (what the scheduler publishes while it runs). Shapes follow the
released wheel (``sglang/srt/...``):

* ``/server_info`` (and the deprecated ``/get_server_info``): ``build_server_info`` — the
  resolved server args, ``launch_command``, the scheduler's init info (``status``,
  ``max_total_num_tokens``, ``max_req_input_len``), ``kv_events`` — plus ``startup_time``,
  ``internal_states`` (one per DP rank: the resolved args *with* ``/set_internal_state``
  overrides, ``world_size``, ``effective_max_running_requests_per_dp``,
  ``last_gen_throughput``, ``memory_usage``, ``disaggregation_mode``,
  ``decode_cuda_graph_bs``, ``decode_cuda_graph_memory_gb``, ``avg_spec_accept_length``
  once a speculative decode was logged), ``version`` and ``frontend``
  (``entrypoints/http_server.py``, ``scheduler_components/internal_state.py``). Only the
  subset of the several hundred server args that a daemon reads, plus neighbours, is
  reported; a real server reports more keys, never fewer of these. One key is the
  simulator's own: ``specgov_sim_speed`` (:data:`SIM_SPEED_KEY`), simulated seconds per
  wall second, so a client that measures rates over its wall clock can give them in the
  server's (simulated) time; a real SGLang has no such key (its rates are real).
* ``/v1/loads``: ``{"timestamp", "version", "accelerator", "num_accelerators", "loads"}``
  with one ``LoadSnapshot.to_dict(include)`` per DP rank (``entrypoints/v1_loads.py``,
  ``managers/load_snapshot.py``): core keys always; ``memory``, ``speculative``,
  ``disaggregation`` and ``queues`` sections by ``include``; ``format=prometheus`` as a
  text body. An invalid ``include`` section makes ``LoadSnapshot.to_dict`` raise outside
  the endpoint's ``try``, so SGLang answers 500: :class:`InvalidIncludeError` lets the
  server do the same. Before the scheduler's first publish, the snapshot is the seeded
  default (``timestamp`` 0.0, zeros, no sections).
* ``/model_info``: the same keys as SGLang's. ``model_path`` is
  ``specgov-sim:<catalog model>`` (:data:`SIM_MODEL_PREFIX`): that is how a client tells
  the simulator from a real SGLang (the prefix); every other body has
  SGLang's shape.
* ``/set_internal_state``: the body is SGLang's ``SetInternalStateReq``
  (``{"server_args": {key: number}}``; a malformed body is a 400 ``ErrorResponse``, as
  SGLang's ``RequestValidationError`` handler answers); the answer is one boolean per DP
  rank. SGLang's update handlers decide (``SchedulerInternalStateController``): unknown
  keys are refused (``[false]``, nothing applied), ``pp_max_micro_batch_size`` must lie
  in ``[1, max_running_requests // pp_size]``, ``speculative_accept_threshold_single`` /
  ``_acc`` are accepted for any number (only DFlash restricts them), recorded as
  overrides, and restart the lifetime acceptance statistics
  (``avg_spec_accept_length``); ``dspark_*`` need a DSpark worker, which the simulator
  never has. The simulator records the thresholds but its acceptance model stays
  lossless: a threshold below 1 makes a real SGLang accept more (lossy) drafts, the
  simulator does not model that.
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Final

from specgov.policies.common.errors import SpecgovError
from specgov.policies.common.validation import is_real

SGLANG_VERSION: Final = "0.5.23"
# model_path prefix of the simulator: the one place where it says what it is.
SIM_MODEL_PREFIX: Final = "specgov-sim:"
# /server_info key of the simulator's speed (simulated seconds per wall second).
SIM_SPEED_KEY: Final = "specgov_sim_speed"
# LoadSnapshot.VALID_SECTIONS (managers/load_snapshot.py).
VALID_LOAD_SECTIONS: Final = frozenset(
    {"core", "memory", "spec", "lora", "disagg", "queues", "all"}
)
# SchedulerInternalStateController._update_handlers keys (0.5.23).
SET_INTERNAL_STATE_KEYS: Final = (
    "pp_max_micro_batch_size",
    "speculative_accept_threshold_single",
    "speculative_accept_threshold_acc",
    "dspark_force_budget_frac",
    "dspark_clear_info_records",
)
ACCEPT_THRESHOLD_KEYS: Final = frozenset(
    {"speculative_accept_threshold_single", "speculative_accept_threshold_acc"}
)
# CUDA-graph phases SGLang attributes to decode (internal_state._DECODE_GRAPH_PHASES).
_GRAPH_PHASES: Final = (
    "prefill",
    "decode",
    "target_verify",
    "draft_prefill",
    "draft_decode",
    "draft_extend",
)
_DECODE_GRAPH_PHASES: Final = ("decode", "target_verify", "draft_decode", "draft_extend")
PROMETHEUS_CONTENT_TYPE: Final = "text/plain; version=0.0.4; charset=utf-8"


class InvalidIncludeError(SpecgovError, ValueError):
    """``/v1/loads?include=`` named a section SGLang does not know (it answers 500)."""


class RequestBodyError(SpecgovError, ValueError):
    """A request body does not have the form SGLang's endpoint validates (it answers 400)."""


@dataclass(frozen=True)
class LaunchInfo:
    """What one launch of the simulated server fixes (SGLang server-arg names where
    they exist). Memory figures are GiB, reported where SGLang reports "GB" (it divides
    bytes by 2**30 there too)."""

    model: str  # catalog model name
    gpu: str  # catalog GPU name
    host: str
    port: int
    kv_capacity_tokens: int
    effective_max_running_requests: int
    chunked_prefill_size: int
    mem_fraction_static: float
    weight_gib: float
    kv_cache_gib: float
    graph_gib: float
    total_gib: float
    drafter: str | None = None
    speculative_algorithm: str | None = None  # None: no speculation
    speculative_num_steps: int | None = None
    speculative_eagle_topk: int | None = None
    speculative_num_draft_tokens: int | None = None
    speculative_adaptive: bool = False
    speculative_adaptive_config: str | None = None  # path of the JSON file
    max_running_requests: int | None = None  # the launch flag (None: SGLang's default)
    cuda_graph_max_bs: int | None = None
    decode_cuda_graph_bs: tuple[int, ...] | None = None
    disable_radix_cache: bool = False  # --disable-radix-cache (no prefix reuse)
    enable_hierarchical_cache: bool = False  # HiCache host tier, sized as below
    hicache_ratio: float | None = None
    hicache_size: int = 0  # GB per rank; > 0 wins over the ratio
    launch_command: str = "specgov sim-server"
    api_key_set: bool = False
    decode_log_interval: int = 40
    load_snapshot_publish_interval: int = 15
    startup_time: Mapping[str, float] = field(default_factory=dict)

    @property
    def model_path(self) -> str:
        return f"{SIM_MODEL_PREFIX}{self.model}"

    @property
    def speculative(self) -> bool:
        return self.speculative_algorithm is not None


@dataclass(frozen=True)
class LiveState:
    """The scheduler's published state at one moment (one DP rank).

    ``published_at_s``: epoch seconds of the last load-snapshot publish (0.0: never,
    SGLang's seeded default). Lifetime speculative totals count emitted tokens and
    verified requests (``spec_total_num_accept_tokens`` / ``spec_total_num_forward_ct``);
    ``decode_moments`` are SGLang's six sums (n, Σb, Σt_us, Σb², Σb·t_us, Σgenerated).
    """

    published_at_s: float = 0.0
    running_requests: int = 0
    waiting_requests: int = 0
    used_tokens: int = 0
    gen_throughput_tok_s: float = 0.0
    last_gen_throughput_tok_s: float = 0.0
    retracted_requests: int = 0
    spec_accept_tokens_total: int = 0
    spec_forward_ct_total: int = 0
    spec_accept_rate: float = 0.0
    prefill_uncached_tokens_total: int = 0
    prefill_busy_us_total: int = 0
    decode_moments: tuple[float, ...] = (0.0,) * 6
    overrides: Mapping[str, int | float] = field(default_factory=dict)

    @property
    def avg_spec_accept_length(self) -> float | None:
        if self.spec_forward_ct_total <= 0:
            return None
        return self.spec_accept_tokens_total / self.spec_forward_ct_total


def _secret(is_set: bool) -> str | None:
    # A real SGLang echoes the key here; the simulator never prints a secret.
    return "<redacted>" if is_set else None


def server_args_dict(launch: LaunchInfo) -> dict[str, Any]:
    """The resolved server args the simulated launch reports (ServerArgs field names)."""
    return {
        "model_path": launch.model_path,
        "tokenizer_path": launch.model_path,
        "served_model_name": launch.model_path,
        "host": launch.host,
        "port": launch.port,
        "dtype": "auto",
        "mem_fraction_static": launch.mem_fraction_static,
        "max_running_requests": launch.max_running_requests,
        "chunked_prefill_size": launch.chunked_prefill_size,
        "cuda_graph_max_bs_decode": launch.cuda_graph_max_bs,
        "disable_cuda_graph": launch.cuda_graph_max_bs is None,
        "disable_radix_cache": launch.disable_radix_cache,
        "enable_hierarchical_cache": launch.enable_hierarchical_cache,
        "hicache_ratio": launch.hicache_ratio,
        "hicache_size": launch.hicache_size,
        "tp_size": 1,
        "pp_size": 1,
        "dp_size": 1,
        "pp_max_micro_batch_size": None,
        "speculative_algorithm": launch.speculative_algorithm,
        "speculative_draft_model_path": (
            None if launch.drafter is None else f"{SIM_MODEL_PREFIX}{launch.drafter}"
        ),
        "speculative_num_steps": launch.speculative_num_steps,
        "speculative_eagle_topk": launch.speculative_eagle_topk,
        "speculative_num_draft_tokens": launch.speculative_num_draft_tokens,
        "speculative_accept_threshold_single": 1.0,
        "speculative_accept_threshold_acc": 1.0,
        "speculative_adaptive": launch.speculative_adaptive,
        "speculative_adaptive_config": launch.speculative_adaptive_config,
        "enable_metrics": True,
        "enable_metrics_for_all_schedulers": False,
        "decode_log_interval": launch.decode_log_interval,
        "load_snapshot_publish_interval": launch.load_snapshot_publish_interval,
        "api_key": _secret(launch.api_key_set),
        "admin_api_key": None,
    }


def memory_usage_dict(launch: LaunchInfo) -> dict[str, Any]:
    """``build_memory_usage``'s keys. The memory plan does not split CUDA-graph memory
    by phase, so all of it is reported under ``decode``."""
    graph = dict.fromkeys(_GRAPH_PHASES, 0.0)
    graph["decode"] = round(launch.graph_gib, 3)
    return {
        "weight": round(launch.weight_gib, 3),
        "kvcache": round(launch.kv_cache_gib, 3),
        "startup_available": round(launch.total_gib, 3),
        "token_capacity": launch.kv_capacity_tokens,
        "token_capacity_swa": None,
        "graph": graph,
    }


def internal_state_dict(launch: LaunchInfo, live: LiveState) -> dict[str, Any]:
    """One DP rank's ``get_internal_state`` answer (resolved args incl. overrides)."""
    state = server_args_dict(launch)
    state.update(live.overrides)
    memory = memory_usage_dict(launch)
    state["world_size"] = 1
    state["startup_time"] = dict(launch.startup_time)
    state["effective_max_running_requests_per_dp"] = launch.effective_max_running_requests
    state["last_gen_throughput"] = live.last_gen_throughput_tok_s
    state["memory_usage"] = memory
    state["disaggregation_mode"] = "null"
    state["decode_cuda_graph_bs"] = (
        None if launch.decode_cuda_graph_bs is None else list(launch.decode_cuda_graph_bs)
    )
    state["decode_cuda_graph_memory_gb"] = round(
        sum(memory["graph"][phase] for phase in _DECODE_GRAPH_PHASES), 3
    )
    if launch.speculative:
        accept_length = live.avg_spec_accept_length
        if accept_length is not None:
            state["avg_spec_accept_length"] = accept_length
    return state


def server_info_body(
    launch: LaunchInfo, live: LiveState, *, sim_speed: float | None = None
) -> dict[str, Any]:
    """The ``/server_info`` body (``build_server_info`` + live ``internal_states``), with
    the simulator's *sim_speed* under :data:`SIM_SPEED_KEY` when given."""
    body = server_args_dict(launch)
    body["launch_command"] = launch.launch_command
    body["status"] = "ready"
    body["max_total_num_tokens"] = launch.kv_capacity_tokens
    body["max_req_input_len"] = max(1, launch.kv_capacity_tokens - 1)
    body["kv_events"] = None
    body["startup_time"] = dict(launch.startup_time)
    body["internal_states"] = [internal_state_dict(launch, live)]
    body["version"] = SGLANG_VERSION
    body["frontend"] = "python"
    if sim_speed is not None:
        body[SIM_SPEED_KEY] = sim_speed
    return body


def model_info_body(launch: LaunchInfo) -> dict[str, Any]:
    """The ``/model_info`` body; ``model_path`` says "specgov simulator"."""
    return {
        "model_path": launch.model_path,
        "served_model_name": launch.model_path,
        "tokenizer_path": launch.model_path,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": "default",
        "load_format": "auto",
        "reasoning_parser": None,
        "tool_call_parser": None,
        "disaggregation_mode": "null",
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": "specgov-sim",
        "architectures": ["SpecgovSimulatedForCausalLM"],
    }


# ------------------------------------------------------------------------ /v1/loads


def parse_include(raw: str | None) -> frozenset[str] | None:
    """``include`` as SGLang splits it; None means every section. Raises
    :class:`InvalidIncludeError` for unknown sections (SGLang's ``to_dict`` message)."""
    if not raw:
        return None
    sections = frozenset(s.strip() for s in raw.split(","))
    if not sections <= VALID_LOAD_SECTIONS:
        raise InvalidIncludeError(
            f"Invalid include sections: {set(sections - VALID_LOAD_SECTIONS)}. "
            f"Valid options: {sorted(VALID_LOAD_SECTIONS)}"
        )
    return sections


def load_snapshot_dict(
    launch: LaunchInfo, live: LiveState, include: frozenset[str] | None
) -> dict[str, Any]:
    """``LoadSnapshot.to_dict(include)`` for DP rank 0."""
    if live.published_at_s <= 0.0:
        return _seeded_load()
    load = _core_load(launch, live)
    if include is not None and include == frozenset({"core"}):
        return load
    load.update(_load_sections(launch, live, include))
    return load


def _seeded_load() -> dict[str, Any]:
    """ShmLoadSnapshotWriter's seeded slot: LoadSnapshot(dp_rank=0), all defaults."""
    return {
        "timestamp": 0.0,
        "dp_rank": 0,
        "num_running_reqs": 0,
        "num_waiting_reqs": 0,
        "num_waiting_uncached_tokens": 0,
        "num_used_tokens": 0,
        "num_total_tokens": 0,
        "num_active_tokens": 0,
        "num_prealloc_ready_tokens": 0,
        "max_total_num_tokens": 0,
        "max_running_requests": 0,
        "token_usage": 0.0,
        "gen_throughput": 0.0,
        "cache_hit_rate": 0.0,
        "utilization": 0.0,
        "total_prefill_uncached_tokens": 0,
        "total_prefill_busy_us": 0,
        "decode_moments": None,
    }


def _core_load(launch: LaunchInfo, live: LiveState) -> dict[str, Any]:
    """The core keys of a published snapshot (every ``include`` has them)."""
    capacity = launch.kv_capacity_tokens
    moments = list(live.decode_moments) if live.decode_moments[0] > 0 else None
    return {
        "timestamp": live.published_at_s,
        "dp_rank": 0,
        "num_running_reqs": live.running_requests,
        "num_waiting_reqs": live.waiting_requests,
        # The engine does not expose its queue's contents; the simulator has no
        # prefix cache either, so this stays 0 (not modelled).
        "num_waiting_uncached_tokens": 0,
        "num_used_tokens": live.used_tokens,
        "num_total_tokens": live.used_tokens,
        "num_active_tokens": live.used_tokens,
        "num_prealloc_ready_tokens": 0,
        "max_total_num_tokens": capacity,
        "max_running_requests": launch.effective_max_running_requests,
        "token_usage": round(live.used_tokens / capacity, 4) if capacity else 0.0,
        "gen_throughput": round(live.gen_throughput_tok_s, 2),
        "cache_hit_rate": 0.0,
        "utilization": 0.0,
        "total_prefill_uncached_tokens": live.prefill_uncached_tokens_total,
        "total_prefill_busy_us": live.prefill_busy_us_total,
        "decode_moments": moments,
    }


def _load_sections(
    launch: LaunchInfo, live: LiveState, include: frozenset[str] | None
) -> dict[str, Any]:
    """The optional sections *include* asks for (None or ``all``: every one), in
    ``LoadSnapshot.to_dict``'s order; ``speculative`` only once a verify was logged."""
    everything = include is None or "all" in include

    def wanted(name: str) -> bool:
        return everything or (include is not None and name in include)

    sections: dict[str, Any] = {}
    if wanted("memory"):
        sections["memory"] = {
            "weight_gb": round(launch.weight_gib, 3),
            "kv_cache_gb": round(launch.kv_cache_gib, 3),
            "graph_gb": round(launch.graph_gib, 3),
            "token_capacity": launch.kv_capacity_tokens,
        }
    accept_length = live.avg_spec_accept_length
    if launch.speculative and accept_length is not None and wanted("spec"):
        sections["speculative"] = {
            "accept_length": accept_length,
            "accept_rate": live.spec_accept_rate,
        }
    if wanted("disagg"):
        sections["disaggregation"] = {
            "mode": "null",
            "prefill_bootstrap_queue_reqs": 0,
            "prefill_inflight_queue_reqs": 0,
            "decode_prealloc_queue_reqs": 0,
            "decode_transfer_queue_reqs": 0,
            "decode_retracted_queue_reqs": 0,
            "kv_transfer_speed_gb_s": 0.0,
            "kv_transfer_latency_ms": 0.0,
        }
    if wanted("queues"):
        sections["queues"] = {
            "waiting": live.waiting_requests,
            "grammar": 0,
            "paused": 0,
            "retracted": live.retracted_requests,
            "prealloc_ready": 0,
        }
    return sections


def iso_timestamp(epoch_s: float) -> str:
    """``datetime.now(timezone.utc).isoformat()`` for a given epoch time."""
    return datetime.fromtimestamp(epoch_s, UTC).isoformat()


def loads_body(
    launch: LaunchInfo,
    live: LiveState,
    *,
    include: str | None,
    dp_rank: int | None,
    now_s: float,
) -> dict[str, Any]:
    """The ``/v1/loads`` JSON body at server time ``now_s`` (epoch seconds)."""
    sections = parse_include(include)
    ranks = [] if dp_rank is not None and dp_rank != 0 else [0]
    return {
        "timestamp": iso_timestamp(now_s),
        "version": SGLANG_VERSION,
        "accelerator": f"{SIM_MODEL_PREFIX}{launch.gpu}",
        "num_accelerators": 1,
        "loads": [load_snapshot_dict(launch, live, sections) for _ in ranks],
    }


def loads_prometheus_text(
    launch: LaunchInfo, live: LiveState, *, include: str | None, dp_rank: int | None
) -> str:
    """``/v1/loads?format=prometheus`` (``_format_loads_prometheus``)."""
    sections = parse_include(include)
    prefixes = {"speculative": "spec", "disaggregation": "disagg"}
    samples: dict[str, list[tuple[int, float]]] = {}
    ranks = [] if dp_rank is not None and dp_rank != 0 else [0]
    for _ in ranks:
        load = load_snapshot_dict(launch, live, sections)
        rank = load.pop("dp_rank")
        for key, value in load.items():
            if isinstance(value, dict):
                prefix = prefixes.get(key, key)
                for sub_key, sub_value in value.items():
                    if isinstance(sub_value, int | float):
                        samples.setdefault(f"sglang_{prefix}_{sub_key}", []).append(
                            (rank, sub_value)
                        )
            elif isinstance(value, int | float):
                samples.setdefault(f"sglang_{key}", []).append((rank, value))
    lines: list[str] = []
    for name, values in samples.items():
        lines.append(f"# TYPE {name} gauge")
        lines.extend(f'{name}{{dp_rank="{rank}"}} {value}' for rank, value in values)
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- /set_internal_state


@dataclass(frozen=True)
class SetStateOutcome:
    """What SGLang's scheduler does with one ``/set_internal_state`` request.

    ``updated``: the answer (one per DP rank). ``overrides``: the config keys that now
    land in the context override. ``reset_spec_stats``: an accept threshold changed, so
    the lifetime acceptance statistics start over. ``rejection``: SGLang's log message.
    """

    updated: bool
    overrides: Mapping[str, int | float] = field(default_factory=dict)
    reset_spec_stats: bool = False
    rejection: str | None = None


def error_response(message: str, code: int = 400) -> dict[str, Any]:
    """SGLang's legacy ``ErrorResponse`` body (validation errors are 400 with it)."""
    phrase = {400: "Bad Request", 404: "Not Found", 401: "Unauthorized"}.get(code, str(code))
    return {"object": "error", "message": message, "type": phrase, "param": None, "code": code}


def parse_set_internal_state(body: object) -> dict[str, int | float]:
    """Validate a ``SetInternalStateReq`` JSON body; returns its ``server_args``.

    Raises :class:`RequestBodyError` naming the field and the expected form.
    """
    if not isinstance(body, Mapping):
        raise RequestBodyError(
            f"body: expected a JSON object {{'server_args': {{key: number}}}}, got {body!r}"
        )
    if "server_args" not in body:
        raise RequestBodyError("body.server_args: field required (an object of key: number)")
    raw = body["server_args"]
    if not isinstance(raw, Mapping):
        raise RequestBodyError(f"body.server_args: expected an object of key: number, got {raw!r}")
    out: dict[str, int | float] = {}
    for key, value in raw.items():
        if not is_real(value):
            raise RequestBodyError(
                f"body.server_args.{key}: expected a finite number (int or float), got {value!r}"
            )
        out[str(key)] = value
    return out


def decide_set_internal_state(
    requested: Mapping[str, int | float], launch: LaunchInfo
) -> SetStateOutcome:
    """SGLang's ``SchedulerInternalStateController.set_internal_state`` for the simulator:
    validate every key first (any refusal applies nothing), then apply all."""
    for key, value in requested.items():
        if key not in SET_INTERNAL_STATE_KEYS:
            return SetStateOutcome(False, rejection=f"Updating {key} is not supported.")
        if key == "pp_max_micro_batch_size":
            upper = launch.effective_max_running_requests // 1  # pp_size is 1
            if value < 1 or value > upper:
                return SetStateOutcome(
                    False,
                    rejection=(
                        f"Updating {key} to {value} is rejected because it is out of "
                        f"the valid range [1, {upper}]."
                    ),
                )
        elif key.startswith("dspark_"):
            return SetStateOutcome(False, rejection=f"{key} requires a DSpark draft worker.")
        # Accept thresholds: only a DFlash worker with sampling-mask requests refuses.
    overrides = dict(requested)
    return SetStateOutcome(
        True,
        overrides=overrides,
        reset_spec_stats=any(k in ACCEPT_THRESHOLD_KEYS for k in requested),
    )


# ----------------------------------------------------------------------------- auth


def auth_allowed(*, method: str, path: str, authorization: str | None, api_key: str | None) -> bool:
    """SGLang's ``decide_request_auth`` with only ``--api-key`` configured: health,
    readiness and metrics are always open; every other route, NORMAL or ADMIN_OPTIONAL
    (``/set_internal_state``), needs ``Authorization: Bearer <api_key>``."""
    if method == "OPTIONS" or api_key is None:
        return True
    if path.startswith(("/health", "/ready", "/metrics")):
        return True
    if not authorization:
        return False
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token:
        return False
    return hmac.compare_digest(token.encode(), api_key.encode())
