"""asv benchmarks: one module per area, fixtures in common.py (append only)."""
