"""The naive contiguous baseline (SPEC §3): one slab of token slots per sequence in a linear arena.

Reservation policies, as in the PagedAttention paper's comparison with Orca: ``max`` reserves the
model's maximum context, ``pow2`` the next power of two of the sequence's final length, ``oracle``
exactly the final length. Slabs are placed first-fit; fork copies the whole slab.

A model of several KV cache groups (SPEC §8) gets one slab per group, placed first-fit in group
order; a sliding group's slab is capped at its window and written as a ring (position p in slot
p mod size), so it holds the last ``size`` positions.
"""
from __future__ import annotations

import bisect
from fractions import Fraction

import numpy as np

from kvbench.contract import formulas as F
from kvbench.contract.protocol import (
    Backend,
    CacheConfig,
    Capabilities,
    Ledger,
    OutOfMemory,
    gathered_range,
    group_view,
)

POLICIES = ("lru", "lfu", "fair")


class Contiguous(Backend):
    name = "contiguous"
    capabilities = Capabilities(layout="contiguous", holds_kv=True, fork=True, copy_on_write=False,
                                eviction=POLICIES, groups=True, chunked_prefill=True,
                                kinds=("full", "sliding", "mla"))  # chunks and sinks: no ring yet

    def __init__(self, config: CacheConfig):
        super().__init__(config)
        if config.reservation not in ("max", "pow2", "oracle"):
            raise ValueError(f"unknown reservation policy {config.reservation!r} (max, pow2, oracle)")
        if config.policy is not None and config.policy not in POLICIES:
            raise ValueError(f"unknown eviction policy {config.policy!r} (known: {', '.join(POLICIES)})")
        m = config.model
        self.groups = m.kv_groups
        self.windows = [g.window for g in self.groups]
        self.kv_shape = m.kv_shape
        self.token_shape = m.slot_shape  # a slot of one group
        self.capacity = config.arena_slots
        self.arena = (np.zeros((self.capacity,) + self.token_shape, dtype=config.kv_dtype)
                      if config.store_kv else None)
        self.starts: list[tuple] = []  # (start, size, seq) of every slab, sorted
        self.seqs: dict[int, dict] = {}  # seq -> {slabs, tokens, final, tenant, last, uses}

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

    def slab_sizes(self, final: int) -> list:
        """One slab per group; a sliding group's ring holds at most its window."""
        size = self.reserve_size(final)
        return [size if w is None else min(size, w) for w in self.windows]

    def _hole(self, size: int, skip=frozenset(), placed=()) -> int | None:
        pos = 0
        for start, slab_size, seq in sorted(self.starts + [(a, n, -1) for a, n in placed]):
            if seq in skip:
                continue
            if start - pos >= size:
                return pos
            pos = max(pos, start + slab_size)
        return pos if self.capacity - pos >= size else None

    def _holes(self, sizes, skip=frozenset()) -> list | None:
        """First-fit starts for a sequence's slabs, in group order; None if one does not fit."""
        placed = []
        for size in sizes:
            start = self._hole(size, skip, placed)
            if start is None:
                return None
            placed.append((start, size))
        return [a for a, _ in placed]

    def _place(self, seq: int, sizes, starts) -> list:
        for start, size in zip(starts, sizes):
            bisect.insort(self.starts, (start, size, seq))
        return list(zip(starts, sizes))

    def _remove(self, seq: int) -> dict:
        st = self.seqs.pop(seq)
        for start, size in st["slabs"]:
            self.starts.remove((start, size, seq))
        return st

    def _slots(self, slab, window, positions: np.ndarray) -> np.ndarray:
        start, size = slab
        return start + (positions if window is None else positions % size)

    def _write(self, st, first: int, kv) -> None:
        """Write ``kv`` (every layer) at positions first.. of every group's slab."""
        for group, slab, w in zip(self.groups, st["slabs"], self.windows):
            data = group_view(kv, group.layers, self.config.model)
            skip = len(kv) - slab[1] if w is not None and len(kv) > slab[1] else 0
            # a ring keeps only the last `size` positions
            self.arena[self._slots(slab, w, np.arange(first + skip, first + len(kv)))] = data[skip:]

    # --- eviction --------------------------------------------------------------------------

    def _victim(self, candidates: list) -> int:
        policy = self.config.policy
        lru = lambda s: (self.seqs[s]["last"], s)  # noqa: E731
        if policy == "lfu":
            return min(candidates, key=lambda s: (self.seqs[s]["uses"], self.seqs[s]["last"], s))
        if policy == "fair":
            usage: dict[str, int] = {}
            for st in self.seqs.values():
                usage[st["tenant"]] = usage.get(st["tenant"], 0) + sum(n for _, n in st["slabs"])
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

    def _make_room(self, sizes, protect) -> tuple[list, list]:
        starts = self._holes(sizes)
        if starts is not None:
            return [], starts
        candidates = [s for s in self.seqs if s not in protect]
        if self.config.policy is None or not candidates or self._holes(sizes, set(candidates)) is None:
            raise OutOfMemory(f"{self.name}: no free run of {sizes} slots in the arena")
        victims = []
        while starts is None:
            v = self._victim([s for s in self.seqs if s not in protect])
            self._remove(v)
            victims.append(v)
            starts = self._holes(sizes)
        return victims, starts

    # --- the protocol ----------------------------------------------------------------------

    def prefill(self, seq, prompt, kv=None, *, step=0, protect=()):
        """A chunked prompt's whole length changes nothing: no prefix cache."""
        if seq in self.seqs:
            raise ValueError(f"{self.name}: sequence {seq} already exists")
        tokens, tenant = prompt.tokens, prompt.tenant
        final = prompt.final_tokens if prompt.final_tokens is not None else tokens
        sizes = self.slab_sizes(final)
        victims, starts = self._make_room(sizes, set(protect) | {seq})
        st = self.seqs[seq] = dict(slabs=self._place(seq, sizes, starts), tokens=tokens, final=final,
                                   tenant=tenant, last=step, uses=1)
        if self.arena is not None:
            self._write(st, 0, kv)
        return tuple(victims)

    def append(self, seqs, tokens, kv=None, *, step=0):
        for s, dt in zip(seqs, tokens):
            if s not in self.seqs:
                raise KeyError(f"{self.name}: unknown sequence {s}")
            st = self.seqs[s]
            for (_, size), w in zip(st["slabs"], self.windows):
                if w is None and st["tokens"] + dt > size:
                    raise ValueError(f"{self.name}: sequence {s} grows to {st['tokens'] + dt} "
                                     f"tokens, beyond its {size}-slot slab")
        offset = 0
        for s, dt in zip(seqs, tokens):
            st = self.seqs[s]
            if self.arena is not None:
                self._write(st, st["tokens"], kv[offset:offset + dt])
            offset += dt
            st["tokens"] += dt
            st["last"] = step
            st["uses"] += 1
        return ()

    def accept(self, seq, n, *, drafted, step=0):
        """Roll back drafted - n draft tokens: the slab stays, its tail slots free again."""
        self.seqs[seq]["tokens"] -= drafted - n
        return ()

    def fork(self, seq, src, *, final_tokens=None, step=0):
        if seq in self.seqs:
            raise ValueError(f"{self.name}: sequence {seq} already exists")
        parent = self.seqs[src]
        final = final_tokens if final_tokens is not None else parent["tokens"]
        sizes = self.slab_sizes(final)
        victims, starts = self._make_room(sizes, {seq, src})
        st = self.seqs[seq] = dict(slabs=self._place(seq, sizes, starts), tokens=parent["tokens"],
                                   final=final, tenant=parent["tenant"], last=step, uses=1)
        if self.arena is not None and parent["tokens"]:
            self._write(st, 0, self.gather(src))
        return tuple(victims)

    def free(self, seq, *, step=0):
        if seq not in self.seqs:
            raise KeyError(f"{self.name}: unknown sequence {seq}")
        self._remove(seq)

    def ledger(self, seqs=None) -> Ledger:
        cap = held = reservation = 0
        for st in self.seqs.values():
            for (_, size), w in zip(st["slabs"], self.windows):
                tokens = st["tokens"] if w is None else min(st["tokens"], size)
                cap += size
                held += tokens
                reservation += F.slab_reservation(size, st["final"], tokens)
        return Ledger.contiguous(
            arena_slots=self.capacity, slot_bytes=self.config.model.slot_bytes,
            tokens={s: st["tokens"] for s, st in self.seqs.items()},
            seq_blocks={s: sum(n for _, n in st["slabs"]) for s, st in self.seqs.items()},
            capacity_slots=cap, token_states=held, reservation=reservation,
            high_water=max((start + size for start, size, _ in self.starts), default=0))

    def gather(self, seq, start=0, stop=None, *, out=None) -> np.ndarray:
        if self.arena is None:
            raise NotImplementedError(f"{self.name} was built with store_kv=False")
        st = self.seqs[seq]
        T = st["tokens"]
        if len(self.groups) == 1 and self.windows[0] is None:
            first = st["slabs"][0][0]
            return gathered_range(self.arena[first:first + T], start, stop, out)
        whole = np.zeros((T,) + self.kv_shape, dtype=self.config.kv_dtype)
        for group, slab, w in zip(self.groups, st["slabs"], self.windows):
            lo = 0 if w is None else T - min(T, slab[1])
            whole[lo:, :, list(group.layers)] = self.arena[self._slots(slab, w, np.arange(lo, T))]
        return gathered_range(whole, start, stop, out)
