"""Benchmarking and results: result records, regression gates (exact and ratio), comparisons of
records, the GPU benchmark."""
