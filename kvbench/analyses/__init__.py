"""Analyses that replay traces to answer a question: the serving simulation and its memory
breakdown, prefix-cache hit rates, per-tenant eviction metrics."""
