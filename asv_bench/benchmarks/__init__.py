"""asv benchmarks: one module per area, fixtures in common.py (kvbench/bench/fixtures.py, append only)."""
