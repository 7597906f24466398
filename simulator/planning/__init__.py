"""Capacity planning: VRAM budgets, sustainable load under an SLO, fleets and reports.

Built on the simulator: every number comes from replaying a trace through the
same engine model and the same policies the daemon runs (issue 10).
"""
