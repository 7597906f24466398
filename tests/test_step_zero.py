"""The cost of step 0 and SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND (issue 11 §3).

Sources (REFERENCE.md §3): vLLM measured its K=0 draft-state sync forward at +4.1 % of
a step at one request and +11.3 % at two (#53420); after resuming with stale drafter
state new requests accepted 14.6 % less (#53426); SGLang 0.5.23 stubs the skipped pass
with zeros (eagle_worker_v2.py), so an upshift drafts from zeroed state.
"""

from __future__ import annotations

import statistics

import pytest

from specgov.simulator.catalog import Catalog
from specgov.simulator.engine.acceptance import AcceptanceError, AcceptanceModel
from specgov.simulator.engine.cost import CostModel
from specgov.simulator.engine.interface import EngineConfig, EngineConfigError, EngineResult
from specgov.simulator.replay.runner import ServerSpec, build_engine, parse_policy, prepare_run
from specgov.simulator.server.controls import SimServerError
from specgov.simulator.server.launch import (
    SKIP_ZERO_STEP_ENV,
    Launch,
    apply_launch_env,
    skip_zero_step_from_env,
)
from specgov.simulator.workload.traces import Request

SKIP = ServerSpec(skip_zero_step_draft_extend=True)


@pytest.fixture(scope="module")
def cost() -> CostModel:
    c = Catalog.load()
    return CostModel.from_catalog(c.gpu("h100"), c.model("llama-3.1-8b"), c.drafter("eagle3"))


@pytest.fixture(scope="module")
def plain() -> CostModel:
    c = Catalog.load()
    return CostModel.from_catalog(c.gpu("h100"), c.model("llama-3.1-8b"), None)


@pytest.mark.parametrize("batch", [1, 2])
def test_independent_step0_draft_extend_is_within_vllm_53420(
    cost: CostModel, plain: CostModel, batch: int
) -> None:
    # vLLM #53420: the K=0 sync forward costs 4.1 % (1 request) to 11.3 % (2) of a step.
    kv = batch * 1024
    share = cost.draft_extend_pass_s(batch, 0, kv) / plain.decode_step_s(batch, 0, kv)
    assert 0.041 <= share <= 0.113, share


def test_draft_extend_pass_is_part_of_the_step(cost: CostModel, plain: CostModel) -> None:
    for batch, steps in [(1, 0), (8, 0), (64, 3)]:
        kv = 1024 * batch
        assert 0 < cost.draft_extend_pass_s(batch, steps, kv) < cost.decode_step_s(batch, steps, kv)
    assert plain.draft_extend_pass_s(8, 0, 8192) == 0.0


def _closed(n: int, out: int = 256, domain: str = "sharegpt") -> list[Request]:
    return [Request(0.0, 512, out, domain) for _ in range(n)]


def _run(server: ServerSpec, policy: str, requests: list[Request]) -> EngineResult:
    engine, _ = build_engine(server, parse_policy(policy), seed=3)
    return engine.run(requests)


def test_skip_saves_the_draft_extend_pass_at_step_zero_only(cost: CostModel) -> None:
    reqs = _closed(8)
    base, skip = _run(ServerSpec(), "static:0", reqs), _run(SKIP, "static:0", reqs)
    assert skip.output_tokens == base.output_tokens
    saved = base.decode_time_s - skip.decode_time_s
    # One pass per decode step; every step here has batch 8 until the batch drains.
    assert saved > 0.05 * base.decode_time_s
    assert saved < cost.draft_extend_pass_s(8, 0, 8 * 1024) * base.decode_batches
    # At k > 0 nothing changes: same draws, same times, bit for bit.
    a, b = _run(ServerSpec(), "static:3", reqs), _run(SKIP, "static:3", reqs)
    same = (a.decode_time_s, a.accepted_drafts, a.end_s)
    assert same == (b.decode_time_s, b.accepted_drafts, b.end_s)


def test_independent_k0_engine_throughput_vs_plain_at_8_requests(
    cost: CostModel, plain: CostModel
) -> None:
    # vLLM PR #53426: a speculative engine resolved to K=0 served 232 tok/s where a plain
    # engine served 331 (0.70x) at 8 concurrent; without the sync forward it is dearer
    # than plain still (verify bookkeeping), but less.
    kv = 8 * 1024
    with_pass = plain.decode_step_s(8, 0, kv) / cost.decode_step_s(8, 0, kv)
    skipped = plain.decode_step_s(8, 0, kv) / (
        cost.decode_step_s(8, 0, kv) - cost.draft_extend_pass_s(8, 0, kv)
    )
    assert 0.70 <= with_pass < skipped < 1.0, (with_pass, skipped)


# ------------------------------------------------------------------- cold recovery


@pytest.mark.parametrize("token_model", [True, False])
def test_stale_sampler_rejects_the_first_upshift_then_recovers(token_model: bool) -> None:
    model = AcceptanceModel("eagle3-llama3.1-8b", seed=1, token_model=token_model)
    # The twins go through the same forced rejection without the recovery penalty, so
    # both streams stand at the same positions with the same draws.
    twins = [model.sampler(r, "code") for r in range(3000)]
    stale = [model.sampler(r, "code") for r in range(3000)]
    for t, s in zip(twins, stale, strict=True):
        t.go_stale(0.0, 16)
        s.go_stale(0.146, 16)
    assert all(s.peek(5) == 0 for s in stale)  # zeroed stubs: nothing accepted
    assert all(s.draw(5) == 0 and t.draw(5) == 0 for t, s in zip(twins, stale, strict=True))
    first_twin = statistics.fmean(t.draw(5) for t in twins)
    first_cold = statistics.fmean(s.draw(5) for s in stale)
    assert first_cold / first_twin == pytest.approx(1 - 0.146, abs=0.04)
    for _ in range(16):
        for s in (*twins, *stale):
            s.draw(5)
    later_twin = statistics.fmean(t.draw(5) for t in twins)
    later_cold = statistics.fmean(s.draw(5) for s in stale)
    assert later_cold == pytest.approx(later_twin, rel=0.05)  # recovered


def test_go_stale_is_validated() -> None:
    sampler = AcceptanceModel("eagle3-llama3.1-8b", seed=0).sampler(0, None)
    with pytest.raises(AcceptanceError, match="cold penalty must be a fraction"):
        sampler.go_stale(1.5, 4)
    with pytest.raises(AcceptanceError, match="cold recovery verifies must be an integer >= 1"):
        sampler.go_stale(0.1, 0)
    with pytest.raises(
        EngineConfigError, match=r"EngineConfig\.cold_penalty: expected a finite number in \[0, 1\]"
    ):
        EngineConfig(kv_token_capacity=100, cold_penalty=-0.1)


class _Flip:
    """Adaptive-like policy: steps 0 for 20 batches, then 3 for 20, and so on."""

    def __init__(self) -> None:
        self.n = 0

    @property
    def candidate_steps(self) -> list[int]:
        return [0, 3]

    def set_cuda_graph_bs(self, bs: list[int] | None) -> None:
        pass

    def get_steps_for_batch(self, batch_size: int) -> int:
        return 0 if (self.n // 20) % 2 == 0 else 3

    def on_verify_complete(self, accepted: list[int], batch_size: int) -> int | None:
        self.n += 1
        return None

    def cuda_graph_bs_for_step(self, step: int) -> list[int] | None:
        return None


def test_upshifts_after_skipped_step_zero_accept_less_in_the_engine() -> None:
    reqs = _closed(16, out=400)

    def run(server: ServerSpec) -> EngineResult:
        # The static engine's collaborators, with the flipping policy swapped in.
        prepared = prepare_run(server, parse_policy("static:3"), seed=5)
        prepared.engine.policy = _Flip()  # type: ignore[assignment]
        prepared.engine.candidates = frozenset({0, 3})
        return prepared.engine.run(reqs)

    base, skip = run(ServerSpec()), run(SKIP)
    # Each upshift: one verify accepts nothing, then 16 recover from -14.6 %.
    assert skip.accepted_drafts < 0.95 * base.accepted_drafts
    # Fewer accepted drafts: the same tokens take more decode batches.
    assert skip.decode_batches > base.decode_batches


# ------------------------------------------------------------ the sim-server's env


def test_environment_flag_is_parsed_like_sglang() -> None:
    assert skip_zero_step_from_env({}) is None
    assert skip_zero_step_from_env({SKIP_ZERO_STEP_ENV: "Yes"}) is True
    assert skip_zero_step_from_env({SKIP_ZERO_STEP_ENV: "0"}) is False
    with pytest.raises(SimServerError, match=r"=\'maybe\': expected one of true, 1, yes"):
        skip_zero_step_from_env({SKIP_ZERO_STEP_ENV: "maybe"})
    assert apply_launch_env(ServerSpec(), {SKIP_ZERO_STEP_ENV: "1"}).skip_zero_step_draft_extend
    assert not apply_launch_env(SKIP, {SKIP_ZERO_STEP_ENV: "false"}).skip_zero_step_draft_extend
    assert apply_launch_env(SKIP, {}) is SKIP


def test_sim_server_launch_honours_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SKIP_ZERO_STEP_ENV, "true")
    launch = Launch(
        ServerSpec(), spool_dir=None, adaptive_config=None, seed=0, speed=1.0, stats_interval_s=1.0
    )
    assert launch.server.skip_zero_step_draft_extend
    monkeypatch.delenv(SKIP_ZERO_STEP_ENV)
    launch = Launch(
        ServerSpec(), spool_dir=None, adaptive_config=None, seed=0, speed=1.0, stats_interval_s=1.0
    )
    assert not launch.server.skip_zero_step_draft_extend


def test_launch_code_recommends_the_skip_when_sglangs_high_slots_stay_at_zero() -> None:
    from specgov.adapters.launch_config import default_slots, recommend_skip_zero_step

    busy = _run(ServerSpec(), "sglang-ema", _closed(128, out=300))
    assert recommend_skip_zero_step(busy.steps_hist, default_slots()) is not None
    quiet = _run(ServerSpec(), "sglang-ema", [Request(30.0 * i, 512, 300) for i in range(4)])
    assert recommend_skip_zero_step(quiet.steps_hist, default_slots()) is None


# ------------------------------------------------- step-0 terms as catalog figures (issue 22)


def _drafter(**scales: float) -> object:
    import dataclasses

    return dataclasses.replace(Catalog.load().drafter("eagle3"), **scales)


def _cost(drafter: object) -> CostModel:
    c = Catalog.load()
    return CostModel.from_catalog(c.gpu("h100"), c.model("llama-3.1-8b"), drafter)  # type: ignore[arg-type]


def test_step0_terms_add_up_to_the_step0_price(cost: CostModel, plain: CostModel) -> None:
    for batch in (1, 64, 256):
        kv = 1024 * batch
        terms = cost.zero_step_terms_s(batch, kv)
        extra = cost.decode_step_s(batch, 0, kv) - plain.decode_step_s(batch, 0, kv)
        assert sum(terms.values()) == pytest.approx(extra, rel=1e-9)
        assert terms["draft_extend"] == pytest.approx(cost.draft_extend_pass_s(batch, 0, kv))
    assert plain.zero_step_terms_s(8, 8192) == {
        "draft_extend": 0.0,
        "verify_bookkeeping": 0.0,
        "other": 0.0,
    }


@pytest.mark.parametrize("scale", [0.0, 2.0])
def test_step0_scales_move_only_their_term_and_only_at_step0(
    cost: CostModel, plain: CostModel, scale: float
) -> None:
    kv = 64 * 1024
    base = cost.zero_step_terms_s(64, kv)
    for field, term in (
        ("zero_step_extend_scale", "draft_extend"),
        ("zero_step_verify_scale", "verify_bookkeeping"),
    ):
        scaled = _cost(_drafter(**{field: scale}))
        got = scaled.decode_step_s(64, 0, kv) - cost.decode_step_s(64, 0, kv)
        assert got == pytest.approx((scale - 1.0) * base[term], rel=1e-9), field
        assert scaled.zero_step_terms_s(64, kv)[term] == pytest.approx(scale * base[term])
        for steps in (1, 3):
            assert scaled.decode_step_s(64, steps, kv) == cost.decode_step_s(64, steps, kv)
    free = _cost(_drafter(zero_step_extend_scale=0.0, zero_step_verify_scale=0.0))
    assert free.decode_step_s(64, 0, kv) == pytest.approx(plain.decode_step_s(64, 0, kv))
    assert type(cost) is CostModel  # the default keeps the plain hot path


def test_kv_pool_reduction_scale_sizes_the_pool() -> None:
    from specgov.simulator.engine.memory import budget_memory

    c = Catalog.load()

    def pool(scale: float | None) -> int:
        d = None if scale is None else _drafter(kv_pool_reduction_scale=scale)
        return (
            budget_memory(
                c.gpu("h100"),
                c.model("llama-3.1-8b"),
                d,  # type: ignore[arg-type]
                candidate_steps=() if d is None else (0, 3),
                cuda_graph_max_bs=256,
            )
            .require_fit()
            .kv_token_capacity
        )

    plain_pool, none, today, double = pool(None), pool(0.0), pool(1.0), pool(2.0)
    # At 0 only the extra CUDA graphs of the speculative tiers remain.
    assert double < today < none < plain_pool
    assert none > 0.99 * plain_pool


def test_step0_scale_is_live_end_to_end_in_replay(tmp_path: object) -> None:
    from pathlib import Path

    override = Path(str(tmp_path)) / "free-verify.yaml"
    base = Catalog.load().drafter("eagle3")
    override.write_text(
        "drafters:\n  eagle3:\n"
        f"    algorithm: EAGLE3\n    params_b: 0.42\n    kv_bytes_per_token: 4096\n"
        f"    static_reserve_gib: 2.0\n    acceptance_profile: {base.acceptance_profile}\n"
        f"    step_overhead_ms: {base.step_overhead_ms}\n"
        f"    extend_overhead_ms: {base.extend_overhead_ms}\n"
        f"    verify_overhead_ms: {base.verify_overhead_ms}\n"
        f"    verify_token_overhead_us: {base.verify_token_overhead_us}\n"
        "    zero_step_verify_scale: 0.0\n",
        encoding="utf-8",
    )
    requests = [Request(0.02 * i, 256, 64, "chat") for i in range(32)]

    def tpot_ms(server: ServerSpec) -> float:
        res = prepare_run(server, parse_policy("static:0"), seed=1).run(requests)
        return 1e3 * statistics.fmean(t for t in res.tpot_s if t == t)

    today = tpot_ms(ServerSpec())
    free = tpot_ms(ServerSpec(catalog_files=(override,)))
    assert free < 0.97 * today
