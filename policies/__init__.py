"""specgov.policies."""
