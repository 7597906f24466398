"""specgov.controller."""
