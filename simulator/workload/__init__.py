"""Request traces: file readers and synthetic workloads."""
