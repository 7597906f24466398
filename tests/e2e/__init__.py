"""End-to-end tests: real `specgov run` and `specgov sim-server` processes (issue 5, §7)."""
