"""Engine behaviour with injected fakes (cost, acceptance, policy): exact arithmetic."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import pytest

from specgov.simulator.engine import core as engine_module
from specgov.simulator.engine.core import Engine
from specgov.simulator.engine.interface import (
    EngineConfig,
    EngineConfigError,
    sglang_decode_cuda_graph_bs,
)
from specgov.simulator.engine.requests import RequestLedger, RequestState
from specgov.simulator.engine.series import IntervalSampler, TimeSeries, report_slot
from specgov.simulator.workload.traces import Request


class LinearCost:
    """decode = 10 ms + 1 ms per draft step; prefill = 1 ms + 1 µs per token."""

    def decode_step_s(self, batch_size: int, steps: int, kv_tokens: int) -> float:
        return 0.010 + 0.001 * steps

    def prefill_s(self, new_tokens: int, prefix_kv_tokens: int) -> float:
        return 0.001 + 1e-6 * new_tokens


class ConstSampler:
    def __init__(self, accepted: int) -> None:
        self.accepted = accepted

    def draw(self, steps: int) -> int:
        return min(self.accepted, steps)


class ConstAcceptance:
    def __init__(self, accepted: int) -> None:
        self.accepted = accepted

    def sampler(
        self, request_index: int, domain: str | None, acc_len: Sequence[int] | None = None
    ) -> ConstSampler:
        return ConstSampler(self.accepted)


class RandomAcceptance:
    def __init__(self, seed: int) -> None:
        self.seed = seed

    def sampler(
        self, request_index: int, domain: str | None, acc_len: Sequence[int] | None = None
    ) -> ConstSampler:
        rng = random.Random(self.seed * 1_000_003 + request_index)

        class S(ConstSampler):
            def draw(self, steps: int) -> int:
                return rng.randint(0, steps)

        return S(0)


class RecordingPolicy:
    """Fixed-step policy that records the protocol calls in order."""

    def __init__(self, steps: int, candidates: list[int] | None = None) -> None:
        self.steps = steps
        self._candidates = candidates or [steps]
        self.calls: list[tuple[str, object]] = []
        self.graph_bs: list[int] | None = None

    @property
    def candidate_steps(self) -> list[int]:
        return list(self._candidates)

    def set_cuda_graph_bs(self, cuda_graph_bs: list[int] | None) -> None:
        self.graph_bs = cuda_graph_bs
        self.calls.append(("set_cuda_graph_bs", None))

    def get_steps_for_batch(self, batch_size: int) -> int:
        self.calls.append(("get", batch_size))
        return self.steps

    def on_verify_complete(self, num_correct_drafts_per_req: list[int], batch_size: int) -> None:
        self.calls.append(("verify", (list(num_correct_drafts_per_req), batch_size)))
        return None

    def cuda_graph_bs_for_step(self, step: int) -> list[int] | None:
        return self.graph_bs


def _engine(policy: RecordingPolicy | None = None, accepted: int = 0, **cfg: object) -> Engine:
    config = EngineConfig(kv_token_capacity=int(cfg.pop("kv", 1_000_000)), **cfg)  # type: ignore[arg-type]
    acceptance = ConstAcceptance(accepted) if policy is not None else None
    return Engine(config=config, cost=LinearCost(), policy=policy, acceptance=acceptance)


def test_single_request_without_speculation_has_exact_latencies() -> None:
    result = _engine().run([Request(0.0, 1000, 11)])
    assert result.completed == 1
    assert result.output_tokens == 11
    assert result.prefill_batches == 1
    assert result.decode_batches == 10  # first token comes from prefill
    assert result.ttft_s[0] == pytest.approx(0.001 + 1e-6 * 1000)
    assert result.tpot_s[0] == pytest.approx(0.010)
    assert result.kv_peak_tokens == 1000 + 10  # prompt + tokens decoded while running


def test_speculation_emits_accepted_plus_bonus_and_truncates_at_the_end() -> None:
    policy = RecordingPolicy(steps=3)
    result = _engine(policy, accepted=3).run([Request(0.0, 100, 10)])
    # 1 token from prefill, then 4 per verify: 4 + 4 + 1 (truncated).
    assert result.output_tokens == 10
    assert result.decode_batches == 3
    assert result.verify_calls == 3
    assert result.tpot_s[0] == pytest.approx(3 * 0.013 / 9)


def test_protocol_calls_follow_sglang_order() -> None:
    policy = RecordingPolicy(steps=2)
    reqs = [Request(0.0, 50, 6), Request(0.0, 50, 9)]
    _engine(policy, accepted=1).run(reqs)
    assert policy.calls[0] == ("set_cuda_graph_bs", None)
    assert policy.graph_bs == sglang_decode_cuda_graph_bs(256, speculative=True)
    body = policy.calls[1:]
    # The engine asks for the initial step once at start-up (init_states), then
    # every decode batch is get -> verify with the same batch size.
    assert body[0] == ("get", 1)
    pairs = body[1:]
    assert len(pairs) % 2 == 0
    for get, verify in zip(pairs[0::2], pairs[1::2], strict=True):
        assert get[0] == "get" and verify[0] == "verify"
        accepted, bs = verify[1]  # type: ignore[misc]
        assert bs == get[1] == len(accepted)
        assert all(a == 1 for a in accepted)


def test_non_candidate_step_raises_like_adaptive_controller() -> None:
    class Liar(RecordingPolicy):
        def get_steps_for_batch(self, batch_size: int) -> int:
            return 5

    policy = Liar(steps=3, candidates=[1, 3])
    with pytest.raises(ValueError, match="steps=5"):
        _engine(policy, accepted=1).run([Request(0.0, 10, 5)])


def test_chunked_prefill_splits_long_prompts() -> None:
    result = _engine(chunked_prefill_size=1000).run([Request(0.0, 3500, 2)])
    assert result.prefill_batches == 4
    assert result.completed == 1


def test_running_cap_bounds_the_batch() -> None:
    reqs = [Request(0.0, 10, 50) for _ in range(20)]
    result = _engine(max_running_requests=4).run(reqs)
    assert max(result.batch_size_hist) == 4
    assert result.completed == 20


def test_kv_pressure_retracts_and_still_completes_everything() -> None:
    reqs = [Request(0.0, 100, 400) for _ in range(8)]
    result = _engine(RecordingPolicy(steps=1), accepted=0, kv=1500).run(reqs)
    assert result.retractions > 0
    assert result.completed == 8
    assert result.output_tokens == 8 * 400
    assert result.kv_peak_tokens <= 1500


def test_request_that_can_never_fit_is_aborted_not_looped_on() -> None:
    result = _engine(kv=500).run([Request(0.0, 1000, 10), Request(1.0, 10, 5)])
    assert result.aborted == 1
    assert result.completed == 1


def test_same_inputs_same_event_log_and_different_seed_differs() -> None:
    reqs = [Request(0.01 * i, 200 + 7 * i, 30 + (i % 17)) for i in range(60)]

    def run(seed: int) -> list[tuple[float, str, int, int]]:
        engine = Engine(
            config=EngineConfig(kv_token_capacity=100_000, record_events=True),
            cost=LinearCost(),
            policy=RecordingPolicy(steps=3),
            acceptance=RandomAcceptance(seed),
        )
        return engine.run(reqs).events

    assert run(1) == run(1)
    assert run(1) != run(2)


def test_unsorted_requests_are_rejected_with_the_index() -> None:
    with pytest.raises(ValueError, match="request 1"):
        _engine().run([Request(1.0, 10, 2), Request(0.5, 10, 2)])


@pytest.mark.parametrize(
    ("field", "value"),
    [("kv_token_capacity", 0), ("chunked_prefill_size", 0), ("max_running_requests", 0)],
)
def test_config_validation_names_the_field(field: str, value: int) -> None:
    kwargs: dict[str, int] = {"kv_token_capacity": 10, field: value}
    with pytest.raises(EngineConfigError, match=field):
        EngineConfig(**kwargs)  # type: ignore[arg-type]


def test_time_series_cover_the_run() -> None:
    reqs = [Request(0.5 * i, 100, 40) for i in range(20)]
    result = _engine(RecordingPolicy(steps=2), accepted=1).run(reqs)
    series = result.series
    assert len(series.time_s) >= int(result.end_s - result.first_arrival_s)
    assert sum(series.output_tok_s) * 1.0 == pytest.approx(result.output_tokens, rel=0.01)
    assert any(not math.isnan(v) for v in series.steps_by_slot[1])


def test_cuda_graph_bs_matches_sglang_lists() -> None:
    spec = sglang_decode_cuda_graph_bs(256, speculative=True)
    assert spec[:10] == [1, 2, 3, 4, 5, 6, 7, 8, 10, 12]
    assert spec[-1] == 256
    plain = sglang_decode_cuda_graph_bs(100, speculative=False)
    assert plain[:6] == [1, 2, 4, 8, 12, 16] and plain[-1] == 100


def test_closed_loop_users_keep_concurrency_constant() -> None:
    reqs = [Request(123.0 * i, 50, 20) for i in range(40)]  # arrival times are ignored
    result = _engine(max_running_requests=64).run(reqs, concurrency=4)
    assert result.completed == 40
    assert max(result.batch_size_hist) == 4
    # Four users, ten requests each, back to back: the run is short, not 40 x 123 s.
    assert result.end_s < 40.0
    # A user's next request arrives exactly when its previous one finishes.
    arrivals = sorted(result.req_arrival_s)
    assert arrivals[:4] == [0.0, 0.0, 0.0, 0.0]
    assert all(a > 0 for a in arrivals[4:])


def test_interval_sampler_closes_each_elapsed_interval_and_resets() -> None:
    sampler = IntervalSampler(origin_s=10.0, interval_s=1.0)
    sampler.bs_time, sampler.busy_s, sampler.tokens = 8.0, 0.5, 30
    sampler.tpot_sum_s, sampler.tpot_n = 0.04, 2
    sampler.steps_sum[8], sampler.steps_n[8] = 9, 3
    # An idle jump over three intervals: three samples, only the first has activity.
    sampler.flush(13.2, queued=5, running=2, kv_used=25, kv_capacity=100)
    series = sampler.series
    assert series.time_s == [1.0, 2.0, 3.0]
    assert series.mean_batch_size == [16.0, 0.0, 0.0]
    assert series.output_tok_s == [30.0, 0.0, 0.0]
    assert series.mean_tpot_ms[0] == pytest.approx(20.0)
    assert all(math.isnan(v) for v in series.mean_tpot_ms[1:])
    assert series.steps_by_slot[8][0] == 3.0 and math.isnan(series.steps_by_slot[8][1])
    assert series.queued_requests == [5, 5, 5] and series.kv_used_fraction == [0.25] * 3
    assert sampler.next_sample_s == 14.0 and sampler.tokens == 0
    sampler.flush(13.9, queued=0, running=0, kv_used=0, kv_capacity=100)  # not due yet
    assert len(series.time_s) == 3


def test_report_slot_uses_the_cuda_graph_padded_size() -> None:
    assert [report_slot(b, None) for b in (1, 7, 8, 33, 500)] == [1, 1, 8, 32, 64]
    # Batch 7 runs in the size-8 graph, so it is reported in slot 8.
    assert report_slot(7, [1, 2, 4, 8, 16]) == 8
    assert report_slot(20, [1, 2, 4, 8, 16]) == 8  # beyond the largest graph: unpadded


def test_ledger_records_a_single_token_request_without_tpot() -> None:
    ledger = RequestLedger()
    one = RequestState(0, Request(1.0, 10, 1), None)
    one.generated, one.first_token_s = 1, 1.5
    assert ledger.finish(one, 1.5) is None
    many = RequestState(1, Request(2.0, 10, 5), None)
    many.generated, many.first_token_s = 5, 2.5
    assert ledger.finish(many, 4.5) == pytest.approx(0.5)
    assert ledger.completed == 2 and ledger.output_tokens == 6
    assert math.isnan(ledger.tpot_s[0]) and ledger.tpot_s[1] == pytest.approx(0.5)
    assert ledger.ttft_s == [0.5, 0.5] and ledger.e2e_s == [0.5, 2.5]


def test_split_out_names_are_still_importable_from_the_engine() -> None:
    assert engine_module.TimeSeries is TimeSeries
    assert engine_module.REPORT_SLOTS == (1, 8, 32, 64)
    assert engine_module.itl_bin_value(0) == pytest.approx(1e-6 * math.sqrt(1.01))


def test_prefix_cache_switch_and_cache_free_path_without_ids() -> None:
    # SGLang's radix cache is on by default; prefix_cache=False is --disable-radix-cache.
    on = Engine(
        config=EngineConfig(kv_token_capacity=10_000),
        cost=LinearCost(),
        policy=None,
        acceptance=None,
    )
    off = Engine(
        config=EngineConfig(kv_token_capacity=10_000, prefix_cache=False),
        cost=LinearCost(),
        policy=None,
        acceptance=None,
    )
    assert on.prefix_cache is not None and off.prefix_cache is None
    with_ids = [Request(0.1 * i, 600, 5, hash_ids=(7, 8)) for i in range(5)]
    hit = on.run(with_ids)
    miss = off.run(with_ids)
    assert hit.cache_hit_tokens == 4 * 599 and hit.prefix_cache_hit_rate == 4 * 599 / 3000
    assert miss.cache_hit_tokens == miss.cache_lookup_tokens == 0
    assert hit.prefill_tokens == miss.prefill_tokens - 4 * 599


def test_series_and_histogram_use_the_slots_the_policy_decides_for() -> None:
    from specgov.policies.engine.ema import EmaPolicy

    layout = (1, 4, 16)
    policy = EmaPolicy(1, {str(b): {"candidate_steps": [1, 2]} for b in layout})
    config = EngineConfig(kv_token_capacity=1_000_000)
    engine = Engine(config=config, cost=LinearCost(), policy=policy, acceptance=ConstAcceptance(1))
    reqs = [Request(0.05 * i, 50, 30) for i in range(40)]
    result = engine.run(reqs)
    assert list(result.series.steps_by_slot) == list(layout)
    seen = {slot for slot, _ in result.steps_hist}
    assert seen <= set(layout) and len(seen) > 1
    # Without speculation there is one slot (one answer for every batch size).
    assert list(_engine().run(reqs).series.steps_by_slot) == [1]


class AlternatingPolicy(RecordingPolicy):
    """Switches between steps 1 and 2 at every decode batch."""

    def get_steps_for_batch(self, batch_size: int) -> int:
        self.steps = 3 - self.steps
        return self.steps


@pytest.mark.parametrize("switch_s", [0.0, 0.004])
def test_each_tier_switch_stalls_the_next_forward_by_the_switch_cost(switch_s: float) -> None:
    policy = AlternatingPolicy(steps=1, candidates=[1, 2])
    result = _engine(policy, accepted=2, tier_switch_s=switch_s).run([Request(0.0, 100, 41)])
    # 40 tokens after prefill at alternating 2 / 3 tokens per verify: 16 verifies, all
    # switches (the engine starts with no step set: the first batch switches too).
    assert result.decode_batches == 16 and result.tier_switches == 16
    forwards = 8 * 0.012 + 8 * 0.011
    assert result.decode_time_s == pytest.approx(forwards + 16 * switch_s)
    assert result.tpot_s[0] == pytest.approx((forwards + 16 * switch_s) / 40)


def test_tier_switch_cost_is_validated() -> None:
    with pytest.raises(
        EngineConfigError, match=r"EngineConfig\.tier_switch_s: expected a finite number >= 0"
    ):
        EngineConfig(kv_token_capacity=10, tier_switch_s=-1e-3)
