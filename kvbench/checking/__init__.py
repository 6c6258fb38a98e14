"""Checking: the checker that replays a trace on a backend beside the model (kvbench.model) and
says where they part, the replay rules, the expectations cache and the verdicts. Nothing here
imports a backend, or the search (kvbench.search) that drives it."""
