"""The contiguous layout (SPEC §3): one slab per sequence and group in a first-fit arena.

A sequence's slabs are placed in group order, each at the lowest offset with room for it among
the live sequences' slabs; a slab's size is the reservation policy's (``max``, ``pow2``,
``oracle``), capped by the group's kind (a sliding group's is a ring of at most W slots).
"""
from __future__ import annotations

from kvbench.contract import formulas as F
from kvbench.contract.protocol import Ledger


class Arena:
    """The arena's placement and ledger, over the oracle's ``seqs`` (each with its ``slabs``)."""

    def _slab_size(self, final: int) -> int:
        policy = self.config.reservation
        if policy == "max":
            if final > self.config.max_context:
                raise ValueError(f"sequence reaches {final} tokens, beyond max_context "
                                 f"{self.config.max_context} of the `max` reservation")
            return self.config.max_context
        if policy == "pow2":
            return F.next_pow2(final)
        if policy == "oracle":
            return final
        raise ValueError(f"unknown reservation policy {policy!r} (max, pow2, oracle)")

    def _slab_sizes(self, final: int) -> list:
        """One slab per group, as its kind caps it."""
        size = self._slab_size(final)
        return [kind.slab(size) for kind in self.kinds]

    def _first_fit(self, size: int, exclude=(), placed=()) -> int | None:
        """Lowest arena offset with ``size`` free slots, ignoring ``exclude``, counting ``placed``."""
        slabs = sorted([slab for s, st in self.seqs.items() if s not in exclude for slab in st.slabs]
                       + list(placed))
        pos = 0
        for start, sz in slabs:
            if start - pos >= size:
                return pos
            pos = max(pos, start + sz)
        return pos if self.config.arena_slots - pos >= size else None

    def _place(self, sizes, exclude=()) -> list | None:
        """First-fit offsets for a sequence's slabs, in group order; None if one does not fit."""
        placed = []
        for size in sizes:
            pos = self._first_fit(size, exclude, placed)
            if pos is None:
                return None
            placed.append((pos, size))
        return placed

    def _arena_ledger(self, live) -> Ledger:
        slabs = sorted(slab for st in self.seqs.values() for slab in st.slabs)
        token_states = reservation = 0
        for st in self.seqs.values():
            for (_, size), kind in zip(st.slabs, self.kinds):
                held = kind.slab_held(st.tokens, size)
                token_states += held
                reservation += F.slab_reservation(size, st.final, held)
        return Ledger.contiguous(
            arena_slots=self.config.arena_slots, slot_bytes=self.config.model.slot_bytes,
            tokens={s: self.seqs[s].tokens for s in live},
            seq_blocks={s: sum(size for _, size in self.seqs[s].slabs) for s in live},
            capacity_slots=sum(size for _, size in slabs), token_states=token_states,
            reservation=reservation,
            high_water=max((start + size for start, size in slabs), default=0))
