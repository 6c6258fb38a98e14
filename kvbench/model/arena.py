"""The contiguous layout (SPEC §3): one slab per sequence and group, placed in group order at the
lowest offset with room among the live slabs; its size the reservation policy's (``max``,
``pow2``, ``oracle``) as the group's kind caps it (a sliding group's ring holds at most W slots).
"""
from __future__ import annotations

from kvbench.contract import formulas as F
from kvbench.contract.protocol import Ledger


class Arena:
    """The arena's placement and ledger, over the oracle's ``seqs`` (each with its ``slabs``)."""

    def _slab_sizes(self, final: int) -> list:
        """One slab per group, the reservation policy's size as its kind caps it."""
        policy, cfg = self.config.reservation, self.config
        if policy == "max" and final > cfg.max_context:
            raise ValueError(f"sequence reaches {final} tokens, beyond max_context "
                             f"{cfg.max_context} of the `max` reservation")
        sizes = {"max": cfg.max_context, "pow2": F.next_pow2(final), "oracle": final}
        if policy not in sizes:
            raise ValueError(f"unknown reservation policy {policy!r} (max, pow2, oracle)")
        return [kind.slab(sizes[policy]) for kind in self.kinds]

    def _check_growth(self, seqs, tokens) -> None:
        """An append may not grow a sequence past its slabs (a ring's aside)."""
        for s, dt in zip(seqs, tokens):
            st = self.seqs[s]
            if any(st.tokens + dt > size for (_, size), kind in zip(st.slabs, self.kinds) if not kind.ring):
                raise ValueError(f"sequence {s} grows to {st.tokens + dt} tokens, beyond its "
                                 f"{st.slabs[0][1]}-slot reservation")

    def _place(self, sizes, exclude=()) -> list | None:
        """First-fit offsets for a sequence's slabs, in group order, ignoring the sequences in
        ``exclude``; None if one does not fit."""
        taken = [slab for s, st in self.seqs.items() if s not in exclude for slab in st.slabs]
        placed = []
        for size in sizes:
            pos = 0
            for start, sz in sorted(taken + placed):
                if start - pos >= size:
                    break
                pos = max(pos, start + sz)
            else:
                if self.config.arena_slots - pos < size:
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
            reservation=reservation, high_water=max((start + size for start, size in slabs), default=0))
