"""VRAM planner: how many KV tokens fit beside the weights, drafter and CUDA graphs.

SGLang's accounting (0.5.23; ``arg_groups/memory_hook.py`` and
``mem_cache/kv_cache_configurator.py::_profile_available_bytes``), per GPU:

* ``mem_fraction_static`` is the fraction of GPU memory for the *static* part:
  weights (target and draft, "draft weights are now counted") plus the KV pool.
  The rest, ``total x (1 - mem_fraction_static)``, is runtime slack for
  activations and CUDA graphs, which are captured after the KV pool is allocated.
* Its default (``handle_gpu_memory_settings``), in MiB of GPU memory::

      reserved = 512                                   # attention metadata etc.
               + max(chunked_prefill_size, 2048) * 1.5 # activations
               + tp_size * pp_size / 8 * 1024          # large-parallel slack
               + cuda_graph_max_bs * 2                 # decode CUDA graphs
               + len(prefill graph buckets) * 8        # breakable prefill graphs
      reserved = max(reserved, 10 GiB) on GPUs above 60 GiB
      mem_fraction_static = round((total - reserved) / total, 3)

  with chunked_prefill_size defaulting by GPU memory: < 20 GiB 2048, < 60 GiB
  4096, < 160 GiB 8192, else 16384. We take this formula as is (post-capture KV
  sizing, off by default, DP attention, DeepEP and VLM terms are not modelled; the
  prefill-graph term is counted on every GPU, although ROCm leaves it off).

What the planner adds, with its own estimates:

* The drafter's ``static_reserve_gib`` (REFERENCE §1: EAGLE ~2 GB, STANDALONE
  ~6 GB) is taken out of the static budget in full, besides the draft weights.
* CUDA graphs per candidate tier. SGLang builds one runtime state (CUDA graphs +
  attention backends) per candidate step count. Per tier we estimate
  ``cuda_graph_max_bs x (1.0 MiB + 0.25 MiB x verified tokens per request +
  0.125 MiB x draft and draft-extend tokens per request)``; without a drafter that
  is 1.25 MiB per batch size, inside SGLang's own 2 MiB heuristic. Graph memory
  that the slack left after activations cannot hold is charged to the static
  budget, so every extra candidate costs KV tokens.
* Tensor parallelism splits weights (target and draft) and KV evenly across ranks
  (exact while tp_size <= the KV head count, 8 for every built-in model).

KV token capacity = KV pool bytes / (target + draft KV bytes per token per rank).

The prefix (radix) cache has no memory of its own: SGLang keeps cached prefixes in the
same KV pool, so the capacity here is shared by running requests and cached blocks
(``simulator/engine/prefix_cache.py``; the engine evicts unpinned cached blocks, LRU, when
requests need the room).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from specgov.policies.common.errors import SpecgovError
from specgov.policies.common.validation import is_int, is_real
from specgov.simulator.catalog import DrafterSpec, GpuSpec, ModelSpec

__all__ = [
    "VRAM_ASSUMPTIONS",
    "DoesNotFitError",
    "MemoryPlan",
    "MemoryPlanError",
    "budget_memory",
    "sglang_default_chunked_prefill_size",
    "sglang_default_mem_fraction_static",
]

GIB = float(1 << 30)
MIB_PER_GIB = 1024.0
MAX_STEPS = 64

# SGLang memory_hook.py (0.5.23), MiB.
_BASE_RESERVE_MIB = 512.0
_ACTIVATION_MIB_PER_TOKEN = 1.5
_DECODE_GRAPH_MIB_PER_BS = 2.0
_PREFILL_GRAPH_MIB_PER_BUCKET = 8.0
_LARGE_GPU_FLOOR_MIB = 10 * 1024.0
# Our per-tier CUDA graph estimate (MiB per captured batch size); see module doc.
GRAPH_BASE_MIB = 1.0
GRAPH_PER_VERIFY_TOKEN_MIB = 0.25
GRAPH_PER_DRAFT_TOKEN_MIB = 0.125

# Every assumption behind the numbers, as `specgov plan vram` states them.
VRAM_ASSUMPTIONS: tuple[str, ...] = (
    "mem_fraction_static: SGLang 0.5.23's default heuristic (memory_hook.py) when not "
    "given; the static budget (total x mem_fraction_static) holds target and draft "
    "weights, the drafter's static reserve and the KV pool",
    "weights: parameters x bytes per parameter from the catalog, split evenly over "
    "tp_size ranks; no quantisation beyond the catalog's bytes_per_param",
    "drafter static reserve: the catalog's static_reserve_gib taken in full (REFERENCE "
    "section 1: EAGLE ~2 GB, STANDALONE ~6 GB; n-gram 0.5 GiB is an estimate)",
    "CUDA graphs + runtime state per candidate tier: cuda_graph_max_bs x (1.0 MiB + "
    "0.25 MiB x verified tokens + 0.125 MiB x draft tokens) per request, an estimate; "
    "graphs the runtime slack cannot hold are charged to the static budget",
    "activation headroom: SGLang's own reserve, 512 MiB + 1.5 MiB x max(chunk, 2048) + "
    "tp_size/8 GiB",
    "KV pool: what the static budget leaves, divided by target + draft KV bytes per "
    "token (the drafter keeps one KV entry per target token); bf16 KV, page size 1",
    "prefix (radix) cache: inside the KV pool, no memory of its own; cached prompt blocks "
    "no running request holds are evicted least recently used when requests need room",
    "not modelled: the request-to-token map (max_running_requests x context length x "
    "4 B), DP attention, DeepEP, multimodal reservations, post-capture KV sizing, "
    "PyTorch allocator fragmentation",
)


class MemoryPlanError(SpecgovError, ValueError):
    """An invalid planner argument; the message names it and the valid form."""


class DoesNotFitError(MemoryPlanError):
    """The weights and reserves leave no room for a KV pool; the message shows the sum."""


def sglang_default_chunked_prefill_size(memory_gib: float) -> int:
    """SGLang's chunked_prefill_size default by GPU memory (handle_gpu_memory_settings)."""
    mib = memory_gib * MIB_PER_GIB
    if mib < 20 * 1024:
        return 2048
    if mib < 60 * 1024:
        return 4096
    if mib < 160 * 1024:
        return 8192
    return 16384


def _prefill_graph_buckets(max_tokens: int) -> int:
    """len(generate_prefill_cuda_graph_batch_sizes(max_tokens)) of SGLang 0.5.23."""
    sizes = (
        list(range(4, 33, 4))
        + list(range(48, 257, 16))
        + list(range(288, 513, 32))
        + list(range(576, 1024 + 1, 64))
        + list(range(1280, 4096 + 1, 256))
        + list(range(4608, max_tokens + 1, 512))
    )
    return sum(1 for s in sizes if s <= max_tokens)


def _activation_mib(chunked_prefill_size: int, tp_size: int) -> float:
    tokens = max(chunked_prefill_size, 2048)
    return _BASE_RESERVE_MIB + tokens * _ACTIVATION_MIB_PER_TOKEN + tp_size / 8 * 1024


def sglang_default_mem_fraction_static(
    memory_gib: float, *, chunked_prefill_size: int, cuda_graph_max_bs: int, tp_size: int = 1
) -> float:
    """SGLang 0.5.23's default mem_fraction_static (see module doc)."""
    total_mib = memory_gib * MIB_PER_GIB
    reserved = (
        _activation_mib(chunked_prefill_size, tp_size)
        + cuda_graph_max_bs * _DECODE_GRAPH_MIB_PER_BS
        + _prefill_graph_buckets(chunked_prefill_size) * _PREFILL_GRAPH_MIB_PER_BUCKET
    )
    if total_mib > 60 * 1024:
        reserved = max(reserved, _LARGE_GPU_FLOOR_MIB)
    return round((total_mib - reserved) / total_mib, 3)


@dataclass(frozen=True)
class MemoryPlan:
    """Per-GPU memory breakdown (GiB) and the resulting KV token capacity."""

    gpu: str
    model: str
    drafter: str | None
    tp_size: int
    total_gib: float
    mem_fraction_static: float
    mem_fraction_is_default: bool
    chunked_prefill_size: int
    cuda_graph_max_bs: int
    usable_gib: float  # total x mem_fraction_static: weights + drafter reserves + KV
    target_weights_gib: float
    draft_weights_gib: float
    static_reserve_gib: float  # the drafter's extra static reservation
    cuda_graph_reserve_gib: tuple[tuple[int, float], ...]  # (steps, GiB) per candidate tier
    cuda_graph_in_static_gib: float  # graph memory the runtime slack cannot hold
    activations_reserve_gib: float
    runtime_reserve_gib: float  # total - usable: activations + CUDA graphs
    kv_pool_gib: float
    target_kv_bytes_per_token: float  # per rank
    draft_kv_bytes_per_token: float  # per rank
    kv_token_capacity: int

    @property
    def kv_bytes_per_token(self) -> float:
        return self.target_kv_bytes_per_token + self.draft_kv_bytes_per_token

    @property
    def fits(self) -> bool:
        """At least one KV token fits beside the weights and reserves."""
        return self.kv_token_capacity >= 1

    @property
    def target_kv_gib(self) -> float:
        """The target model's share of the KV pool (what SGLang's kv_cache_gb reports)."""
        return self.kv_token_capacity * self.target_kv_bytes_per_token / GIB

    @property
    def draft_kv_gib(self) -> float:
        """The drafter's KV pool: as many tokens as the target's, its own bytes per token."""
        return self.kv_token_capacity * self.draft_kv_bytes_per_token / GIB

    @property
    def runtime_left_gib(self) -> float:
        """Runtime slack left after activations and the CUDA graphs it holds (< 0: short)."""
        in_slack = self.cuda_graph_total_gib - self.cuda_graph_in_static_gib
        return self.runtime_reserve_gib - self.activations_reserve_gib - in_slack

    def static_items(self) -> list[tuple[str, float]]:
        """What the static budget holds before the KV pool, in SGLang's allocation order."""
        return [
            ("target weights", self.target_weights_gib),
            ("draft weights", self.draft_weights_gib),
            ("drafter static reserve", self.static_reserve_gib),
            ("CUDA graphs beyond the runtime slack", self.cuda_graph_in_static_gib),
        ]

    @property
    def first_overflow(self) -> str | None:
        """The first static item whose running sum exceeds the static budget.

        ``"KV pool"`` when everything else fits but not one KV token does; None when
        the plan fits.
        """
        if self.fits:
            return None
        running = 0.0
        for name, gib in self.static_items():
            running += gib
            if running > self.usable_gib:
                return name
        return "KV pool"

    def items(self) -> list[tuple[str, float]]:
        """Every GiB of the GPU, one line each; for a plan that fits they sum to the total.

        The CUDA graphs are listed per candidate tier in full (wherever they live: the
        runtime slack, or the static budget when the slack is short), so the static
        budget's "CUDA graphs beyond the runtime slack" is not listed again.
        """
        rows = [
            ("target weights", self.target_weights_gib),
            ("draft weights", self.draft_weights_gib),
            ("drafter static reserve", self.static_reserve_gib),
        ]
        rows += [
            (f"CUDA graphs + runtime state, steps {steps}", gib)
            for steps, gib in self.cuda_graph_reserve_gib
        ]
        rows += [
            (
                f"activation headroom (chunk {self.chunked_prefill_size})",
                self.activations_reserve_gib,
            ),
            ("target KV pool", self.target_kv_gib),
            ("draft KV pool", self.draft_kv_gib),
            # Rounding the pool down to whole tokens leaves a few bytes; they are shown
            # with the runtime slack's remainder so the lines add up to the GPU.
            ("left", self.left_gib),
        ]
        return rows

    @property
    def left_gib(self) -> float:
        """Memory no item uses: the runtime slack's remainder and the KV pool's rounding."""
        rounding = max(0.0, self.kv_pool_gib) - self.target_kv_gib - self.draft_kv_gib
        return self.runtime_left_gib + rounding

    def sglang_loads_memory(self) -> dict[str, float | int]:
        """What SGLang's ``/v1/loads`` ``memory`` object would report for this plan.

        ``weight_gb`` is the target model runner's load delta (the drafter loads in its
        own runner), ``kv_cache_gb`` the target KV pool's size, ``graph_gb`` the sum of
        captured graph memory, ``token_capacity`` max_total_num_tokens; SGLang rounds the
        GiB figures to 3 decimals (``scheduler_components/load_inquirer.py``).
        """
        return {
            "weight_gb": round(self.target_weights_gib, 3),
            "kv_cache_gb": round(self.target_kv_gib, 3),
            "graph_gb": round(self.cuda_graph_total_gib, 3),
            "token_capacity": self.kv_token_capacity,
        }

    def require_fit(self) -> MemoryPlan:
        """This plan; ``DoesNotFitError`` (with the arithmetic) when no KV pool is left."""
        if not self.fits:
            raise DoesNotFitError(self.overflow_message())
        return self

    def overflow_message(self) -> str:
        """The arithmetic of a plan that does not fit (DoesNotFitError's message)."""
        reserves = self.static_reserve_gib + self.cuda_graph_in_static_gib
        on = self.gpu + (f" (tp_size {self.tp_size}, per GPU)" if self.tp_size > 1 else "")
        return (
            f"{self.model} on {on}: weights {self.target_weights_gib:.1f} GiB + draft "
            f"{self.draft_weights_gib:.1f} GiB + reserves {reserves:.1f} GiB > usable "
            f"{self.usable_gib:.1f} GiB ({self.total_gib:g} GiB x mem_fraction_static "
            f"{self.mem_fraction_static:g}); reserves = drafter static "
            f"{self.static_reserve_gib:.1f} GiB + CUDA graphs beyond the runtime slack "
            f"{self.cuda_graph_in_static_gib:.1f} GiB; first item over the budget: "
            f"{self.first_overflow}. Use a larger GPU, more tensor parallelism, "
            f"fewer candidate steps or a higher mem_fraction_static."
        )

    @property
    def cuda_graph_total_gib(self) -> float:
        return sum(g for _, g in self.cuda_graph_reserve_gib)

    @property
    def candidate_steps(self) -> tuple[int, ...]:
        return tuple(s for s, _ in self.cuda_graph_reserve_gib)

    def describe(self) -> str:
        """A human-readable breakdown."""
        who = self.model + (f" + {self.drafter}" if self.drafter else "")
        tp = f", tp_size {self.tp_size} (per GPU)" if self.tp_size > 1 else ""
        how = "SGLang default heuristic" if self.mem_fraction_is_default else "given"
        tiers = ", ".join(f"steps {s}: {g:.2f}" for s, g in self.cuda_graph_reserve_gib)
        kv_detail = f"target {self.target_kv_bytes_per_token:,.0f}"
        if self.draft_kv_bytes_per_token:
            kv_detail += f" + draft {self.draft_kv_bytes_per_token:,.0f}"
        rows = [
            f"{who} on {self.gpu}{tp}",
            f"  GPU memory                      {self.total_gib:8.2f} GiB",
            f"  mem_fraction_static             {self.mem_fraction_static:8.3f}     ({how})",
            f"  static budget                   {self.usable_gib:8.2f} GiB",
            f"    target weights                {self.target_weights_gib:8.2f} GiB",
            f"    draft weights                 {self.draft_weights_gib:8.2f} GiB",
            f"    drafter static reserve        {self.static_reserve_gib:8.2f} GiB",
            f"    CUDA graphs beyond the slack  {self.cuda_graph_in_static_gib:8.2f} GiB",
            f"    KV pool                       {self.kv_pool_gib:8.2f} GiB"
            f"  -> {self.kv_token_capacity:,} tokens "
            f"({self.kv_bytes_per_token:,.0f} B/token: {kv_detail})",
            f"  runtime slack                   {self.runtime_reserve_gib:8.2f} GiB",
            f"    activations (chunk {self.chunked_prefill_size})"
            f"{'':{max(0, 9 - len(str(self.chunked_prefill_size)))}}"
            f"{self.activations_reserve_gib:8.2f} GiB",
            f"    CUDA graphs, {len(self.cuda_graph_reserve_gib)} tier(s), max bs "
            f"{self.cuda_graph_max_bs}: {self.cuda_graph_total_gib:.2f} GiB ({tiers})",
        ]
        return "\n".join(rows)


def _check_int(name: str, value: object, minimum: int) -> int:
    if not is_int(value) or value < minimum:
        raise MemoryPlanError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def budget_memory(
    gpu: GpuSpec,
    model: ModelSpec,
    drafter: DrafterSpec | None,
    *,
    mem_fraction_static: float | None = None,
    candidate_steps: Sequence[int],
    cuda_graph_max_bs: int,
    topk: int = 1,
    num_draft_tokens: int | None = None,
    tp_size: int = 1,
    chunked_prefill_size: int | None = None,
) -> MemoryPlan:
    """Plan one GPU's memory, fitting or not (``MemoryPlan.fits`` says which).

    Raises ``MemoryPlanError`` for invalid arguments only; the plan's ``require_fit()``
    raises ``DoesNotFitError`` when no KV pool is left.

    ``candidate_steps`` are the step counts with a prebuilt runtime state (the
    union over SGLang's adaptive slots); without a drafter it must be empty or (0,).
    ``chunked_prefill_size`` defaults like SGLang's, by GPU memory.
    """
    tp = _check_int("tp_size", tp_size, 1)
    max_bs = _check_int("cuda_graph_max_bs", cuda_graph_max_bs, 1)
    _check_int("topk", topk, 1)
    if topk > 1:
        if drafter is None:
            raise MemoryPlanError("a tree shape (topk > 1) needs a drafter")
        _check_int("num_draft_tokens (required when topk > 1)", num_draft_tokens, 2)
    chunk = (
        sglang_default_chunked_prefill_size(gpu.memory_gib)
        if chunked_prefill_size is None
        else _check_int("chunked_prefill_size", chunked_prefill_size, 1)
    )
    steps = _checked_steps(candidate_steps, drafter, model)
    total = gpu.memory_gib
    mf, is_default = _mem_fraction(mem_fraction_static, total, chunk, max_bs, tp)

    usable = total * mf
    slack = total - usable
    activations = _activation_mib(chunk, tp) / MIB_PER_GIB
    weights = model.weight_bytes / tp / GIB
    # kv_pool_reduction_scale: the share of the drafter's memory (weights, static
    # reserve, its KV per token) charged to the pool; 1 as SGLang sizes it.
    pool_scale = drafter.kv_pool_reduction_scale if drafter else 0.0
    draft_weights = pool_scale * drafter.weight_bytes_for(model.name) / tp / GIB if drafter else 0.0
    static_reserve = pool_scale * drafter.static_reserve_gib if drafter else 0.0
    tiers = _graph_tiers(steps, drafter, topk, num_draft_tokens, max_bs)
    graphs_total = sum(g for _, g in tiers)
    graph_room = max(0.0, slack - activations)
    graphs_in_static = max(0.0, graphs_total - graph_room)

    kv_pool = usable - weights - draft_weights - static_reserve - graphs_in_static
    target_kv = model.kv_bytes_per_token / tp
    draft_kv = pool_scale * drafter.kv_bytes_per_token / tp if drafter else 0.0
    capacity = int(kv_pool * GIB // (target_kv + draft_kv)) if kv_pool > 0 else 0
    return MemoryPlan(
        gpu=gpu.name,
        model=model.name,
        drafter=drafter.name if drafter else None,
        tp_size=tp,
        total_gib=total,
        mem_fraction_static=mf,
        mem_fraction_is_default=is_default,
        chunked_prefill_size=chunk,
        cuda_graph_max_bs=max_bs,
        usable_gib=usable,
        target_weights_gib=weights,
        draft_weights_gib=draft_weights,
        static_reserve_gib=static_reserve,
        cuda_graph_reserve_gib=tuple(tiers),
        cuda_graph_in_static_gib=graphs_in_static,
        activations_reserve_gib=activations,
        runtime_reserve_gib=slack,
        kv_pool_gib=kv_pool,
        target_kv_bytes_per_token=target_kv,
        draft_kv_bytes_per_token=draft_kv,
        kv_token_capacity=capacity,
    )


def _checked_steps(
    candidate_steps: Sequence[int], drafter: DrafterSpec | None, model: ModelSpec
) -> list[int]:
    """The candidate steps, sorted and checked against the drafter ([0] without one)."""
    if isinstance(candidate_steps, str | bytes) or not isinstance(candidate_steps, Sequence):
        raise MemoryPlanError(
            f"candidate_steps must be a sequence of integers, got {candidate_steps!r}"
        )
    steps = sorted({_check_int("candidate_steps entry", s, 0) for s in candidate_steps})
    if any(s > MAX_STEPS for s in steps):
        raise MemoryPlanError(f"candidate_steps entries must be <= {MAX_STEPS}, got {steps}")
    if drafter is None:
        if any(s > 0 for s in steps):
            raise MemoryPlanError(
                f"candidate_steps {steps} need a drafter; without one use [] or [0]"
            )
        steps = [0]
    elif not steps:
        raise MemoryPlanError("candidate_steps must not be empty when a drafter is configured")
    if drafter is not None and not drafter.supports(model.name):
        raise MemoryPlanError(
            f"drafter '{drafter.name}' cannot draft for '{model.name}'; "
            f"it supports: {', '.join(drafter.targets)}"
        )
    return steps


def _mem_fraction(
    mem_fraction_static: float | None, total_gib: float, chunk: int, max_bs: int, tp: int
) -> tuple[float, bool]:
    """(mem_fraction_static, whether it is SGLang's default heuristic)."""
    if mem_fraction_static is None:
        mf = sglang_default_mem_fraction_static(
            total_gib, chunked_prefill_size=chunk, cuda_graph_max_bs=max_bs, tp_size=tp
        )
        return mf, True
    if not is_real(mem_fraction_static) or not 0.0 < mem_fraction_static < 1.0:
        raise MemoryPlanError(
            f"mem_fraction_static must be a number in (0, 1), got {mem_fraction_static!r}"
        )
    return float(mem_fraction_static), False


def _graph_tiers(
    steps: Sequence[int],
    drafter: DrafterSpec | None,
    topk: int,
    num_draft_tokens: int | None,
    max_bs: int,
) -> list[tuple[int, float]]:
    """(steps, GiB) of the CUDA graphs each candidate step count captures."""
    has_draft_model = drafter is not None and drafter.has_model
    tiers: list[tuple[int, float]] = []
    for k in steps:
        if drafter is None or k == 0:
            verify = 1
        elif topk == 1 or num_draft_tokens is None:
            verify = k + 1
        else:
            verify = min(num_draft_tokens, 1 + k * topk)
        draft_tokens = 0
        if has_draft_model:
            draft_tokens = verify  # draft-extend graph
            if k > 0:
                draft_tokens += 1 + (k - 1) * topk
        mib = max_bs * (
            GRAPH_BASE_MIB
            + GRAPH_PER_VERIFY_TOKEN_MIB * verify
            + GRAPH_PER_DRAFT_TOKEN_MIB * draft_tokens
        )
        tiers.append((k, mib / MIB_PER_GIB))
    return tiers
