"""Replay figures read at a glance: steps per slot for every slot (a heatmap, idle slots
grey), titles, units, the SLO on latency panels, identical runs labelled, y axes from 0."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from matplotlib.collections import QuadMesh

from specgov.simulator.engine import TimeSeries
from specgov.simulator.plots import comparison_figure, series_figure, write_plots

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
