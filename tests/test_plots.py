"""Replay figures read at a glance: steps per slot for every slot of the policy's layout
(a heatmap, idle slots grey), titles, units, the SLO on latency panels, identical runs
labelled, y axes from 0; and the series records the slots each policy decides for."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from matplotlib.collections import QuadMesh

from specgov.policies.engine.ema import EmaPolicy
from specgov.policies.engine.table import TablePolicy
from specgov.simulator.engine.core import TimeSeries
from specgov.simulator.engine.interface import sglang_decode_cuda_graph_bs
from specgov.simulator.engine.series import (
    REPORT_SLOTS,
    IntervalSampler,
    report_slot,
    slot_layout,
)
from specgov.simulator.replay.plots import comparison_figure, series_figure, write_plots
from specgov.simulator.replay.runner import (
    SPECGOV_SLOT_CANDIDATES,
    parse_policy,
    specgov_adaptive_config,
)

NAN = math.nan


def _series(steps: dict[int, list[float]], tok_s: float = 3.0) -> TimeSeries:
    n = len(next(iter(steps.values())))
    return TimeSeries(
        time_s=[5.0 * (i + 1) for i in range(n)],
        mean_batch_size=[4.0] * n,
        queued_requests=[0] * n,
        running_requests=[4] * n,
        output_tok_s=[tok_s] * n,  # a constant: the axis must not zoom into 2.85-3.15
        mean_tpot_ms=[12.0, NAN, *([12.0] * (n - 2))],
        kv_used_fraction=[0.1] * n,
        steps_by_slot=steps,
    )


EIGHT = {b: [3.0, 3.0, NAN, 3.0] for b in (1, 4, 8, 16, 32, 64, 128, 256)}


def test_steps_heatmap_has_a_row_per_slot_and_idle_cells_masked() -> None:
    fig = series_figure("goodput", _series(EIGHT), slo_tpot_ms=50.0, context="h100 test")
    try:
        load, steps, tput, tpot = fig.axes[:4]
        labels = [t.get_text() for t in steps.get_yticklabels()]
        assert labels == [f"bs>={b}" for b in EIGHT]  # every slot, none hidden
        mesh = next(c for c in steps.collections if isinstance(c, QuadMesh))
        values = mesh.get_array()
        assert values.shape == (8, 4)
        assert np.ma.getmaskarray(values)[:, 2].all()  # no batch: masked (grey), not a gap
        assert not np.ma.getmaskarray(values)[:, [0, 1, 3]].any()
        legend = [t.get_text() for t in steps.get_legend().get_texts()]
        assert legend == ["no decode batch in this slot"]
        # Titles and units.
        assert fig.texts[0].get_text() == "goodput | h100 test"
        assert "(ms)" in tpot.get_ylabel() and "tok/s" in tput.get_ylabel()
        assert "simulated" in tpot.get_xlabel() and "(s)" in tpot.get_xlabel()
        # The SLO on the latency panel; rate and latency axes start at 0.
        slo_lines = [ln for ln in tpot.get_lines() if ln.get_label() == "SLO 50 ms"]
        assert len(slo_lines) == 1 and slo_lines[0].get_ydata()[0] == 50.0
        assert tput.get_ylim()[0] == 0.0 and tput.get_ylim()[1] > 3.0
        assert tpot.get_ylim() == pytest.approx((0.0, 55.0))
        assert load.get_ylim()[0] == 0.0
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)


def test_comparison_has_a_title_the_slo_and_labels_identical_runs() -> None:
    same = _series(EIGHT)
    other = _series(EIGHT, tok_s=5.0)
    fig = comparison_figure(
        [("none", same), ("static:0", _series(EIGHT)), ("goodput", other)],
        slo_tpot_ms=40.0,
        context="h100 test",
    )
    try:
        assert fig.texts[0].get_text() == "policies compared | h100 test"
        tput, tpot, queue = fig.axes[:3]
        labels = [ln.get_label() for ln in tput.get_lines()]
        assert labels == ["none", "static:0 (identical to none)", "goodput"]
        twin = tput.get_lines()[1]
        assert twin.get_linestyle() != "-"  # drawn dashed on top: both stay visible
        assert "SLO 40 ms" in [ln.get_label() for ln in tpot.get_lines()]
        assert "(ms)" in tpot.get_ylabel() and "requests" in queue.get_ylabel()
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)


def test_write_plots_writes_pngs_per_policy_and_a_comparison(tmp_path: Path) -> None:
    written = write_plots(
        [("static:3", _series(EIGHT)), ("a/b", _series(EIGHT))], tmp_path, slo_tpot_ms=50.0
    )
    assert [p.name for p in written] == ["static_3.png", "a_b.png", "comparison.png"]
    for path in written:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_one_slot_policy_gets_one_labelled_row() -> None:
    fig = series_figure("static:3", _series({1: [3.0, 3.0, 3.0]}))
    try:
        steps = fig.axes[1]
        assert [t.get_text() for t in steps.get_yticklabels()] == ["every batch size"]
        assert "one slot" in steps.get_title(loc="left")
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)


def test_steps_panel_names_the_slot_count_and_the_interval() -> None:
    fig = series_figure("goodput", _series(EIGHT))
    try:
        steps = fig.axes[1]
        assert "the 8 slots the policy decides for" in steps.get_title(loc="left")
        bar = fig.axes[-1]  # the heatmap's colour bar
        assert bar.get_ylabel() == "draft steps (mean per 5 s)"
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)


# ------------------------------------------------ the slots the series records


def _table_policy() -> TablePolicy:
    fallback = EmaPolicy(initial_steps=3, config=specgov_adaptive_config())
    return TablePolicy(
        table_source=lambda: None,
        stats_sink=lambda _snapshot: None,
        clock=lambda: 0.0,
        fallback=fallback,
    )


def test_slot_layout_is_the_slots_each_replay_policy_decides_for() -> None:
    specgov_bounds = tuple(bound for bound, _ in SPECGOV_SLOT_CANDIDATES)
    assert len(specgov_bounds) == 8
    # A daemon policy drives a TablePolicy over specgov's adaptive config: its 8 slots.
    assert slot_layout(_table_policy()) == specgov_bounds
    # SGLang's EMA: its default config's 4 slots.
    assert slot_layout(parse_policy("sglang-ema").build(3)) == (1, 8, 32, 64)
    # One answer for every batch size: one slot.
    assert slot_layout(parse_policy("static:3").build(3)) == (1,)
    assert slot_layout(None) == (1,)
    # Per batch, no table of its own (the oracle): SGLang's default slots.
    assert slot_layout(parse_policy("oracle").build(3)) == REPORT_SLOTS


def test_report_slot_routes_every_batch_like_the_policy() -> None:
    policy = _table_policy()
    graphs = sglang_decode_cuda_graph_bs(256, speculative=True)
    policy.set_cuda_graph_bs(graphs)
    layout = slot_layout(policy)
    for batch_size in range(1, 400):
        assert report_slot(batch_size, graphs, layout) == policy.fallback.slot_bound_for(
            batch_size
        ), batch_size


def test_interval_sampler_records_each_slot_of_its_layout() -> None:
    layout = tuple(bound for bound, _ in SPECGOV_SLOT_CANDIDATES)
    sampler = IntervalSampler(origin_s=0.0, interval_s=1.0, slots=layout)
    sampler.steps_sum[4], sampler.steps_n[4] = 10, 2
    sampler.steps_sum[256], sampler.steps_n[256] = 1, 1
    sampler.flush(1.0, queued=0, running=0, kv_used=0, kv_capacity=1)
    series = sampler.series
    assert list(series.steps_by_slot) == list(layout)
    assert series.steps_by_slot[4] == [5.0] and series.steps_by_slot[256] == [1.0]
    assert math.isnan(series.steps_by_slot[16][0])
    with pytest.raises(ValueError, match="increasing bounds"):
        IntervalSampler(origin_s=0.0, interval_s=1.0, slots=(8, 1))
