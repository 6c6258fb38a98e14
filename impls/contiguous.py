"""The naive contiguous baseline (SPEC §3): one slab of token slots per sequence in a linear arena.

Reservation policies, as in the PagedAttention paper's comparison with Orca: ``max`` reserves the
model's maximum context, ``pow2`` the next power of two of the sequence's final length, ``oracle``
exactly the final length. Slabs are placed first-fit; fork copies the whole slab.
"""
from __future__ import annotations

import bisect
from fractions import Fraction

import numpy as np

from kvbench.contract.protocol import (
    Backend,
    CacheConfig,
    Capabilities,
    Ledger,
    OutOfMemory,
)

POLICIES = ("lru", "lfu", "fair")


class Contiguous(Backend):
    name = "contiguous"
    capabilities = Capabilities(layout="contiguous", holds_kv=True, fork=True, copy_on_write=False,
                                eviction=POLICIES, devices=("cpu",))

    def __init__(self, config: CacheConfig):
        super().__init__(config)
        if config.reservation not in ("max", "pow2", "oracle"):
            raise ValueError(f"unknown reservation policy {config.reservation!r} (max, pow2, oracle)")
        if config.policy is not None and config.policy not in POLICIES:
            raise ValueError(f"unknown eviction policy {config.policy!r} (known: {', '.join(POLICIES)})")
        m = config.model
        self.token_shape = (2, m.layers, m.kv_heads, m.head_dim)
        self.capacity = config.arena_slots
        self.arena = (np.zeros((self.capacity,) + self.token_shape, dtype=config.kv_dtype)
                      if config.store_kv else None)
        self.starts: list[tuple] = []  # (start, seq) of every slab, sorted (a slab may be empty)
        self.seqs: dict[int, dict] = {}  # seq -> {start, size, tokens, final, tenant, last, uses}

    def reserve_size(self, final: int) -> int:
        policy = self.config.reservation
        if policy == "max":
            if final > self.config.max_context:
                raise ValueError(f"{self.name}: sequence reaches {final} tokens, beyond max_context "
                                 f"{self.config.max_context}")
            return self.config.max_context
        if policy == "pow2":
            return 1 if final <= 1 else 1 << (final - 1).bit_length()
        return final

    def _hole(self, size: int, skip=frozenset()) -> int | None:
        pos = 0
        for start, seq in self.starts:
            if seq in skip:
                continue
            if start - pos >= size:
                return pos
            pos = max(pos, start + self.seqs[seq]["size"])
        return pos if self.capacity - pos >= size else None

    def _remove(self, seq: int) -> dict:
        st = self.seqs.pop(seq)
        self.starts.remove((st["start"], seq))
        return st

    # --- eviction --------------------------------------------------------------------------

    def _victim(self, candidates: list) -> int:
        policy = self.config.policy
        lru = lambda s: (self.seqs[s]["last"], s)  # noqa: E731
        if policy == "lfu":
            return min(candidates, key=lambda s: (self.seqs[s]["uses"], self.seqs[s]["last"], s))
        if policy == "fair":
            usage: dict[str, int] = {}
            for st in self.seqs.values():
                usage[st["tenant"]] = usage.get(st["tenant"], 0) + st["size"]
            w = {t: Fraction(str(self.config.tenant_weights.get(t, 1)))
                 for t in set(usage) | set(self.config.tenant_weights)}
            total = sum(w.values())
            over = sorted(((u - w[t] / total * self.capacity, t) for t, u in usage.items()
                           if u * total > w[t] * self.capacity), reverse=True)
            for _, t in over:
                mine = [s for s in candidates if self.seqs[s]["tenant"] == t]
                if mine:
                    return min(mine, key=lru)
        return min(candidates, key=lru)

    def _make_room(self, size: int, protect) -> tuple[list, int]:
        start = self._hole(size)
        if start is not None:
            return [], start
        candidates = [s for s in self.seqs if s not in protect]
        if self.config.policy is None or not candidates or self._hole(size, set(candidates)) is None:
            raise OutOfMemory(f"{self.name}: no free run of {size} slots in the arena")
        victims = []
        while start is None:
            v = self._victim([s for s in self.seqs if s not in protect])
            self._remove(v)
            victims.append(v)
            start = self._hole(size)
        return victims, start

    # --- the protocol ----------------------------------------------------------------------

    def prefill(self, seq, tokens, kv=None, *, tenant="default", final_tokens=None, step=0,
                protect=(), block_hashes=None):
        if seq in self.seqs:
            raise ValueError(f"{self.name}: sequence {seq} already exists")
        final = final_tokens if final_tokens is not None else tokens
        size = self.reserve_size(final)
        victims, start = self._make_room(size, set(protect) | {seq})
        bisect.insort(self.starts, (start, seq))
        self.seqs[seq] = dict(start=start, size=size, tokens=tokens, final=final, tenant=tenant,
                              last=step, uses=1)
        if self.arena is not None:
            self.arena[start:start + tokens] = kv
        return tuple(victims)

    def append(self, seqs, tokens, kv=None, *, step=0):
        for s, dt in zip(seqs, tokens):
            if s not in self.seqs:
                raise KeyError(f"{self.name}: unknown sequence {s}")
            st = self.seqs[s]
            if st["tokens"] + dt > st["size"]:
                raise ValueError(f"{self.name}: sequence {s} grows to {st['tokens'] + dt} tokens, "
                                 f"beyond its {st['size']}-slot slab")
        offset = 0
        for s, dt in zip(seqs, tokens):
            st = self.seqs[s]
            if self.arena is not None:
                at = st["start"] + st["tokens"]
                self.arena[at:at + dt] = kv[offset:offset + dt]
            offset += dt
            st["tokens"] += dt
            st["last"] = step
            st["uses"] += 1
        return ()

    def fork(self, seq, src, *, final_tokens=None, step=0):
        if seq in self.seqs:
            raise ValueError(f"{self.name}: sequence {seq} already exists")
        parent = self.seqs[src]
        final = final_tokens if final_tokens is not None else parent["tokens"]
        size = self.reserve_size(final)
        victims, start = self._make_room(size, {seq, src})
        bisect.insort(self.starts, (start, seq))
        self.seqs[seq] = dict(start=start, size=size, tokens=parent["tokens"], final=final,
                              tenant=parent["tenant"], last=step, uses=1)
        if self.arena is not None:
            n = parent["tokens"]
            self.arena[start:start + n] = self.arena[parent["start"]:parent["start"] + n]
        return tuple(victims)

    def free(self, seq, *, step=0):
        if seq not in self.seqs:
            raise KeyError(f"{self.name}: unknown sequence {seq}")
        self._remove(seq)

    def ledger(self) -> Ledger:
        sizes = [st["size"] for st in self.seqs.values()]
        cap = sum(sizes)
        tokens = {s: st["tokens"] for s, st in self.seqs.items()}
        held = sum(tokens.values())
        reservation = sum(min(st["size"], st["final"]) - st["tokens"] for st in self.seqs.values())
        high = max((st["start"] + st["size"] for st in self.seqs.values()), default=0)
        bpt = self.config.model.bytes_per_token
        return Ledger(
            blocks_used=None, blocks_free=None, tokens=tokens,
            seq_blocks={s: st["size"] for s, st in self.seqs.items()},
            capacity_slots=cap, free_slots=cap - held,
            fragmentation=(cap - held) / cap if cap else 0.0,
            bytes_in_use=cap * bpt, shared_blocks=None,
            token_states=held, reservation=reservation,
            internal_fragmentation=cap - held - reservation,
            external_fragmentation=high - cap, free=self.capacity - high)

    def gather(self, seq) -> np.ndarray:
        if self.arena is None:
            raise NotImplementedError(f"{self.name} was built with store_kv=False")
        st = self.seqs[seq]
        return self.arena[st["start"]:st["start"] + st["tokens"]]
