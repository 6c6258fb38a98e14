"""The device's eviction policies (SPEC §5), by ``CacheConfig.policy``: which live sequence an
operation that does not fit evicts. A policy only chooses among the candidates the oracle gives
it; when to evict, and what an eviction releases, are the oracle's (``Oracle._make_room``).
tier_policies.py holds a lower tier's policies.
"""
from __future__ import annotations

from fractions import Fraction


def lru(oracle, candidates) -> int:
    """The least recently used sequence (ties: the lowest id)."""
    return min(candidates, key=lambda s: (oracle.seqs[s].last_access, s))


def lfu(oracle, candidates) -> int:
    """The least often used sequence, then the least recently used."""
    return min(candidates, key=lambda s: (oracle.seqs[s].use_count, oracle.seqs[s].last_access, s))


def weights(oracle) -> dict:
    """Each tenant's weight (1 unless configured), over the live tenants and the configured ones."""
    tenants = {st.tenant for st in oracle.seqs.values()} | set(oracle.config.tenant_weights)
    # Decimal text, not binary: weight 0.1 is exactly 1/10.
    return {t: Fraction(str(oracle.config.tenant_weights.get(t, 1))) for t in tenants}


def fair(oracle, candidates) -> int:
    """The least recently used sequence of the tenant furthest over its quota (w_t / W of the
    budget; equal excess: the larger tenant id), else the least recently used of all."""
    w = weights(oracle)
    total_w = sum(w.values())
    budget = oracle.config.num_blocks if oracle.layout == "paged" else oracle.config.arena_slots
    usage = oracle.tenant_usage()
    # quota_t = w_t / W * B_total, compared exactly.
    excess = {t: Fraction(u) - w[t] / total_w * budget for t, u in usage.items()}
    over = [t for t in usage if usage[t] * total_w > w[t] * budget]
    for t in sorted(over, key=lambda t: (excess[t], t), reverse=True):
        mine = [s for s in candidates if oracle.seqs[s].tenant == t]
        if mine:
            return lru(oracle, mine)
    return lru(oracle, candidates)


POLICIES = {"lru": lru, "lfu": lfu, "fair": fair}


def pick_victim(oracle, candidates) -> int:
    """The victim ``oracle.config.policy`` picks among ``candidates``."""
    policy = oracle.config.policy
    if policy not in POLICIES:
        raise ValueError(f"unknown eviction policy {policy!r} ({', '.join(POLICIES)})")
    return POLICIES[policy](oracle, candidates)
