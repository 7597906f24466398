"""Memory planner: SGLang's mem_fraction_static default, KV capacity, failures, TP."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from specgov.simulator.catalog import Catalog
from specgov.simulator.engine.memory import (
    GIB,
    DoesNotFitError,
    MemoryPlan,
    MemoryPlanError,
    budget_memory,
    sglang_default_chunked_prefill_size,
    sglang_default_mem_fraction_static,
)

CATALOG = Catalog.load()
H100 = CATALOG.gpu("h100")
L40S = CATALOG.gpu("l40s")
LLAMA8 = CATALOG.model("llama-3.1-8b")
LLAMA70 = CATALOG.model("llama-3.1-70b")
EAGLE3 = CATALOG.drafter("eagle3")
SGLANG_DEFAULT_STEPS = [0, 1, 3, 5, 7]  # union of SGLang's default adaptive slots


def test_default_mem_fraction_follows_sglang_formula() -> None:
    # H100 (81920 MiB): chunk 8192, max_bs 256, 58 prefill graph buckets up to 8192:
    # 512 + 8192*1.5 + 1/8*1024 + 256*2 + 58*8 = 13904 MiB (above the 10 GiB floor).
    assert sglang_default_chunked_prefill_size(80) == 8192
    expected = round((81920 - 13904) / 81920, 3)
    got = sglang_default_mem_fraction_static(80, chunked_prefill_size=8192, cuda_graph_max_bs=256)
    assert got == expected == 0.83
    # L40S (49152 MiB, no floor): chunk 4096, max_bs 32, 50 buckets up to 4096.
    assert sglang_default_chunked_prefill_size(48) == 4096
    reserved = 512 + 4096 * 1.5 + 128 + 32 * 2 + 50 * 8
    got = sglang_default_mem_fraction_static(48, chunked_prefill_size=4096, cuda_graph_max_bs=32)
    assert got == round((49152 - reserved) / 49152, 3) == 0.853
    # The 10 GiB floor on large GPUs: a tiny chunk does not shrink the reserve below it.
    small = sglang_default_mem_fraction_static(80, chunked_prefill_size=1, cuda_graph_max_bs=1)
    assert small == round((81920 - 10240) / 81920, 3)


def test_formula_constants_are_sglangs(sglang_src: Path) -> None:
    # Contract check against the released wheel: the heuristic we copy is still there.
    text = (sglang_src / "sglang/srt/arg_groups/memory_hook.py").read_text()
    for fragment in (
        "reserved_mem = 512",
        "reserved_mem += activation_tokens * 1.5",
        "reserved_mem += cfg.tp_size * cfg.pp_size / 8 * 1024",
        "reserved_mem = max(reserved_mem, 10 * 1024)",
        "reserved_mem += decode_cuda_graph_config.max_bs * 2",
        "reserved_mem += len(prefill_cuda_graph_config.bs) * 8",
        "activation_tokens = max(cfg.chunked_prefill_size, 2048)",
        "round((gpu_mem - reserved_mem) / gpu_mem, 3)",
    ):
        assert fragment in text, fragment


def _plan(**kwargs: object) -> MemoryPlan:
    args: dict[str, object] = {
        "candidate_steps": SGLANG_DEFAULT_STEPS,
        "cuda_graph_max_bs": 256,
    }
    args.update(kwargs)
    gpu = args.pop("gpu", H100)
    model = args.pop("model", LLAMA8)
    drafter = args.pop("drafter", EAGLE3)
    return budget_memory(gpu, model, drafter, **args).require_fit()  # type: ignore[arg-type]


def test_8b_on_h100_has_hundreds_of_thousands_of_tokens() -> None:
    plan = _plan()
    assert 250_000 < plan.kv_token_capacity < 600_000
    assert plan.target_weights_gib == pytest.approx(8.03e9 * 2 / GIB)
    assert plan.draft_weights_gib == pytest.approx(0.42e9 * 2 / GIB)
    assert plan.static_reserve_gib == 2.0
    assert plan.kv_bytes_per_token == 131072 + 4096
    assert plan.candidate_steps == (0, 1, 3, 5, 7)
    # Accounting identity of the static budget.
    assert plan.usable_gib == pytest.approx(
        plan.target_weights_gib
        + plan.draft_weights_gib
        + plan.static_reserve_gib
        + plan.cuda_graph_in_static_gib
        + plan.kv_pool_gib
    )
    assert plan.usable_gib + plan.runtime_reserve_gib == pytest.approx(80)
    assert plan.kv_token_capacity == int(plan.kv_pool_gib * GIB // plan.kv_bytes_per_token)
    # Without a drafter there is more room for KV.
    bare = _plan(drafter=None, candidate_steps=[])
    assert bare.kv_token_capacity > plan.kv_token_capacity
    assert bare.draft_weights_gib == 0 and bare.kv_bytes_per_token == 131072


def test_more_candidates_cost_kv() -> None:
    capacities = [
        _plan(candidate_steps=steps).kv_token_capacity
        for steps in ([3], [1, 3], [1, 3, 5, 7], [0, 1, 2, 3, 4, 5, 6, 7])
    ]
    assert capacities == sorted(capacities, reverse=True)
    assert capacities[0] > capacities[-1]
    assert len(set(capacities[1:])) == 3  # each extra tier costs tokens once slack is used
    # Deeper tiers and trees need bigger graphs.
    tiers = dict(_plan(candidate_steps=[1, 7]).cuda_graph_reserve_gib)
    assert tiers[7] > tiers[1] > 0
    tree = _plan(candidate_steps=[5], topk=4, num_draft_tokens=8).cuda_graph_reserve_gib[0][1]
    chain = _plan(candidate_steps=[5]).cuda_graph_reserve_gib[0][1]
    assert tree > chain


def test_70b_on_one_l40s_does_not_fit_and_shows_the_arithmetic() -> None:
    with pytest.raises(DoesNotFitError) as info:
        _plan(gpu=L40S, model=LLAMA70, candidate_steps=[1, 3], cuda_graph_max_bs=32)
    message = str(info.value)
    assert isinstance(info.value, ValueError)
    assert message.startswith("llama-3.1-70b on l40s: weights 131.5 GiB + draft 2.6 GiB")
    assert "reserves 2.0 GiB > usable 40.9 GiB (48 GiB x mem_fraction_static 0.853)" in message


def test_tensor_parallel_splits_weights_and_kv() -> None:
    one = _plan()
    two = _plan(tp_size=2)
    assert two.target_weights_gib == pytest.approx(one.target_weights_gib / 2)
    assert two.draft_weights_gib == pytest.approx(one.draft_weights_gib / 2)
    assert two.kv_bytes_per_token == pytest.approx(one.kv_bytes_per_token / 2)
    assert two.kv_token_capacity > 2 * one.kv_token_capacity  # per GPU: half the weights
    # 70B fits on four L40S (per GPU 32.9 GiB of weights).
    four = _plan(gpu=L40S, model=LLAMA70, candidate_steps=[1, 3], cuda_graph_max_bs=32, tp_size=4)
    assert four.target_weights_gib == pytest.approx(70.6e9 * 2 / 4 / GIB)
    assert four.kv_token_capacity > 10_000


def test_explicit_mem_fraction() -> None:
    low = _plan(mem_fraction_static=0.7)
    high = _plan(mem_fraction_static=0.9)
    assert not low.mem_fraction_is_default and low.mem_fraction_static == 0.7
    assert high.kv_token_capacity > low.kv_token_capacity
    with pytest.raises(DoesNotFitError, match=r"mem_fraction_static 0\.2"):
        _plan(mem_fraction_static=0.2)


def test_ngram_has_no_draft_weights_or_kv() -> None:
    plan = _plan(drafter=CATALOG.drafter("ngram"))
    assert plan.draft_weights_gib == 0 and plan.draft_kv_bytes_per_token == 0
    assert plan.kv_bytes_per_token == 131072


def test_describe() -> None:
    text = _plan().describe()
    assert text.splitlines()[0] == "llama-3.1-8b + eagle3 on h100"
    for fragment in (
        "mem_fraction_static",
        "SGLang default heuristic",
        "target weights",
        "draft weights",
        "drafter static reserve",
        "KV pool",
        "tokens",
        "activations",
        "CUDA graphs, 5 tier(s)",
        "steps 7:",
    ):
        assert fragment in text, fragment
    assert f"{_plan().kv_token_capacity:,} tokens" in text


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"drafter": None, "candidate_steps": [0, 3]}, "need a drafter"),
        ({"candidate_steps": []}, "must not be empty"),
        ({"candidate_steps": [1, -1]}, "candidate_steps entry must be an integer >= 0"),
        ({"candidate_steps": "13"}, "candidate_steps must be a sequence of integers"),
        ({"mem_fraction_static": 1.2}, r"mem_fraction_static must be a number in \(0, 1\)"),
        ({"topk": 4}, "num_draft_tokens"),
        ({"tp_size": 0}, "tp_size must be an integer >= 1"),
        ({"cuda_graph_max_bs": 0}, "cuda_graph_max_bs must be an integer >= 1"),
        ({"model": CATALOG.model("llama-3.2-1b")}, r"cannot draft for 'llama-3\.2-1b'"),
    ],
)
def test_bad_arguments(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(MemoryPlanError, match=match):
        _plan(**kwargs)


# ----------------------------------------------------------- budget_memory (plan vram)


def test_budget_memory_reports_a_plan_that_does_not_fit_instead_of_raising() -> None:
    plan = budget_memory(L40S, LLAMA70, EAGLE3, candidate_steps=[1, 3], cuda_graph_max_bs=32)
    assert not plan.fits and plan.kv_token_capacity == 0
    assert plan.first_overflow == "target weights"
    assert plan.overflow_message().startswith("llama-3.1-70b on l40s: weights 131.5 GiB")
    assert "first item over the budget: target weights" in plan.overflow_message()
    # require_fit raises the same arithmetic.
    with pytest.raises(DoesNotFitError, match="first item over the budget: target weights"):
        budget_memory(
            L40S, LLAMA70, EAGLE3, candidate_steps=[1, 3], cuda_graph_max_bs=32
        ).require_fit()


def test_first_overflow_names_the_item_that_crosses_the_static_budget() -> None:
    # Static budget 16.5 GiB: 8B weights (14.96) and the EAGLE-3 head (0.78) fit, the
    # 2 GiB drafter reserve does not.
    plan = budget_memory(
        H100,
        LLAMA8,
        EAGLE3,
        mem_fraction_static=16.5 / 80,
        candidate_steps=[3],
        cuda_graph_max_bs=256,
    )
    assert plan.first_overflow == "drafter static reserve"
    fits = _plan()
    assert fits.fits and fits.first_overflow is None


def test_items_add_up_to_the_gpu_and_list_every_tier() -> None:
    plan = _plan()
    items = dict(plan.items())
    assert sum(items.values()) == pytest.approx(plan.total_gib, abs=1e-9)
    for steps in SGLANG_DEFAULT_STEPS:
        assert items[f"CUDA graphs + runtime state, steps {steps}"] > 0
    assert items["target KV pool"] == pytest.approx(plan.kv_token_capacity * 131072 / GIB)
    assert items["draft KV pool"] == pytest.approx(plan.kv_token_capacity * 4096 / GIB)
    assert items["drafter static reserve"] == 2.0
    assert items["left"] >= 0


def test_eagle_and_standalone_reserves_match_reference(sglang_src: Path) -> None:
    # REFERENCE.md section 1: "EAGLE reserves ~2 GB extra static memory for draft model
    # and graphs; STANDALONE ~6 GB". The planner charges them in full, besides the draft
    # weights, so the KV pool shrinks by at least that much against a plain server.
    bare = _plan(drafter=None, candidate_steps=[])
    eagle = _plan(candidate_steps=[3])
    standalone = _plan(drafter=CATALOG.drafter("standalone"), candidate_steps=[3])
    assert eagle.static_reserve_gib == pytest.approx(2.0)
    assert standalone.static_reserve_gib == pytest.approx(6.0)
    assert bare.kv_pool_gib - eagle.kv_pool_gib >= 2.0 + eagle.draft_weights_gib
    assert bare.kv_pool_gib - standalone.kv_pool_gib >= 6.0 + standalone.draft_weights_gib
    # /v1/loads `memory`: the same four fields SGLang's MemoryMetrics has, in GiB
    # (memory_pool.py's GB is 1024**3), kv_cache_gb being the target pool only.
    loads = eagle.sglang_loads_memory()
    snapshot = (sglang_src / "sglang/srt/managers/load_snapshot.py").read_text()
    start = snapshot.index("class MemoryMetrics")
    block = snapshot[start : snapshot.index("\nclass ", start)]
    assert re.findall(r"^    (\w+): ", block, flags=re.MULTILINE) == list(loads)
    pool = (sglang_src / "sglang/srt/mem_cache/memory_pool.py").read_text()
    assert "GB = 1024 * 1024 * 1024" in pool
    assert loads["token_capacity"] == eagle.kv_token_capacity
    assert loads["kv_cache_gb"] == round(eagle.kv_token_capacity * 131072 / GIB, 3)
    assert loads["weight_gb"] == round(8.03e9 * 2 / GIB, 3)  # target only: 14.957
    assert loads["graph_gb"] == round(eagle.cuda_graph_total_gib, 3)


def test_activation_shortfall_shows_as_negative_runtime_left() -> None:
    # mem_fraction_static 0.9 leaves 8 GiB of slack on H100, less than SGLang's own
    # activation reserve for an 8192-token chunk (12.6 GiB): the plan says so.
    plan = _plan(mem_fraction_static=0.9)
    assert plan.fits
    assert plan.runtime_left_gib == pytest.approx(8.0 - plan.activations_reserve_gib)
    assert plan.runtime_left_gib < 0
