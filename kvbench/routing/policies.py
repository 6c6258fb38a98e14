"""The routing policies of SPEC §14, one small class each, picked from :data:`POLICIES` by name.

A policy ranks the replicas by a cost (lower is better) from what a router sees: each replica's
cached prefix of the request (from its index, in blocks) and its load (live requests, blocks in
use). The router takes the first replica of least cost; the reference checks a decision by the
same policy over the reference index's overlaps: the choice must be one of least cost there
(ties are the policy's own freedom).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Load:
    """What a replica publishes of its load."""

    requests: int = 0  # live requests
    blocks: int = 0  # blocks in use (held by live requests)


class RoundRobin:
    """Replica 0, 1, ..., N - 1, 0, ...: the cache is not looked at."""

    name = "round-robin"

    def __init__(self, replicas: int, **_):
        self.replicas, self.turn = replicas, 0

    def costs(self, overlaps, loads, prompt_blocks: int) -> list:
        return [0 if r == self.turn else 1 for r in range(self.replicas)]

    def chosen(self, replica: int) -> None:
        self.turn = (self.turn + 1) % self.replicas


class LongestPrefix:
    """The replica holding the longest prefix; ties go to the least loaded (blocks in use, then
    live requests)."""

    name = "longest-prefix"

    def __init__(self, replicas: int, **_):
        self.replicas = replicas

    def costs(self, overlaps, loads, prompt_blocks: int) -> list:
        return [(-o, load.blocks, load.requests) for o, load in zip(overlaps, loads)]

    def chosen(self, replica: int) -> None:
        pass


class DynamoCost:
    """NVIDIA Dynamo's KV router cost, lowest wins (its docs, docs/components/router/README.md,
    "Cost Function"): ``logit = kv_overlap_score_weight * potential_prefill_blocks +
    potential_active_blocks``, where prefill blocks = (input tokens - overlap blocks * B) / B and
    active blocks = the worker's active blocks plus the request's own; weight 1 by default
    (``--kv-overlap-score-weight``); temperature 0 (deterministic; ties: the first replica)."""

    name = "dynamo"

    def __init__(self, replicas: int, overlap_weight: float = 1.0, **_):
        self.replicas, self.weight = replicas, overlap_weight

    def costs(self, overlaps, loads, prompt_blocks: int) -> list:
        return [self.weight * (prompt_blocks - o) + load.blocks + prompt_blocks
                for o, load in zip(overlaps, loads)]

    def chosen(self, replica: int) -> None:
        pass


POLICIES = {p.name: p for p in (RoundRobin, LongestPrefix, DynamoCost)}


def make(name: str, replicas: int, **params):
    try:
        return POLICIES[name](replicas, **params)
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}; known: {', '.join(POLICIES)}") from None


def best(costs) -> list:
    """The replicas of least cost, first one first."""
    low = min(costs)
    return [r for r, c in enumerate(costs) if c == low]
