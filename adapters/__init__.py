"""specgov.adapters."""
