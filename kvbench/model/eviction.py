"""Eviction on the device (SPEC §5): when an operation that does not fit evicts (``Eviction``,
a mixin of kvbench.model.oracle.Oracle) and which live sequence, by ``CacheConfig.policy``. An
eviction preempts its victim (``Oracle.preempt``). tier_policies.py holds a lower tier's policies.
"""
from __future__ import annotations

from dataclasses import dataclass
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


@dataclass
class TenantStats:
    evictions: int = 0
    recomputed_tokens: int = 0


class ModelOOM(Exception):
    """The model cannot serve the call even after evicting every candidate."""


class Eviction:
    """Room for a call: ``call`` is (name, need, sizes), ``need(drop)`` the blocks it takes were
    the references in ``drop`` gone, ``sizes`` its slabs (contiguous)."""

    def _fits(self, call, exclude=()) -> bool:
        """Would the call fit if the sequences in ``exclude`` were gone?"""
        if self.layout == "contiguous":
            return self._place(call[-1], exclude) is not None
        drop: dict[int, int] = {}
        for v in exclude:
            for b in self.seqs[v].held():
                drop[b] = drop.get(b, 0) + 1
        freed = sum(1 for b, d in drop.items() if self.blocks[b][0] == d)
        return call[1](drop) <= self.blocks_free + freed

    def _candidates(self, protect) -> list:
        return [s for s in self.seqs if s not in protect]

    def _pick_victim(self, candidates) -> int:
        return pick_victim(self, candidates)

    def _make_room(self, call, protect) -> list:
        """Evict until the call fits; raise ModelOOM (changing nothing) when it cannot."""
        if self._fits(call):
            return []
        candidates = self._candidates(protect) if self.config.policy else []
        if not candidates or not self._fits(call, exclude=candidates):
            raise ModelOOM()
        victims = []
        while not self._fits(call):
            victims.append(self._pick_victim(self._candidates(protect)))
            tenant = self.seqs[victims[-1]].tenant
            self.preempt(victims[-1])
            self.tenant_stats.setdefault(tenant, TenantStats()).evictions += 1
        return victims

    def preempt(self, seq) -> None:
        """Preemption by recompute (SPEC §13): the sequence's blocks are released as a free
        releases them, its content kept for its resume (a prefill of all its tokens)."""
        self._dirty.add(seq)
        self._tree_checkpoint(seq, release=True)
        self._lives[seq] = self._lives.get(seq, 0) + 1
        st = self.seqs.pop(seq)
        self._release(st)
        st.tables, st.slabs = [], []
        self.preempted[seq] = st

    def recompute(self, seq, step, protect=()) -> list:
        """Re-prefill an evicted sequence to its current length, with the content it had."""
        victims = self.reprefill(seq, step, protect)
        self.tenant_stats[self.seqs[seq].tenant].recomputed_tokens += self.seqs[seq].tokens
        return victims

    def reprefill(self, seq, step, protect=()) -> list:
        """A preempted sequence back on the device: a prefill of its tokens (its prompt's hits
        first) with the content it had."""
        st = self.preempted[seq]
        p = st.prompt
        victims = self.prefill(seq, st.tokens, st.tenant, st.final, step, protect, p.get("hashes"),
                               salt=p.get("salt"), adapter=p.get("adapter"), token_ids=p.get("token_ids"),
                               **({"prompt_tokens": p["prompt_tokens"]} if "prompt_tokens" in p else {}))
        self.seqs[seq].segments = list(st.segments)
        del self.preempted[seq]
        return victims
