"""tokenbatch benchmarks: run ``python -m benchmarks --quick`` (see RESULTS.md)."""
