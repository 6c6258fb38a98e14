"""Traces: the one format every backend reads, the generators of the workload families, and the
loaders of real public traces."""
