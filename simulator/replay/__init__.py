"""Replay of traces through the engine: open and closed loop, the oracle, run summaries, figures."""
