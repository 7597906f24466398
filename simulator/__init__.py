"""specgov.simulator."""
