"""One class per KV cache group kind (SPEC §8, §12), picked from :data:`KINDS` by the group's
family, as vLLM's ``spec_manager_map`` picks a manager per KV cache spec.

Each kind owns its rules of what a sequence holds, what it gives back and what a prefix hit
needs cached; the oracle asks the kind instead of branching on it. The block arithmetic itself
is SPEC's, in kvbench.contract.formulas. A new kind is one class here (or anywhere) and one entry
in :data:`KINDS` (tests/model/test_kinds_table.py adds a toy one).
"""
from __future__ import annotations

from kvbench.contract import formulas as F


class Kind:
    """Full attention (SPEC §8): every block of the sequence, for as long as it lives."""

    releases = False  # gives blocks back while its sequence lives
    ring = False  # the contiguous layout's slab is a ring capped at the window
    copied_at_fork = False  # a fork sharing the blocks copies the last one (a state)
    # What an accept's rollback of drafts (SPEC §13) would need that the model does not keep
    # (None: the group rolls back; the checker says n/a to a trace that accepts otherwise).
    rollback_needs: str | None = None

    def __init__(self, group: F.KVGroup, block_size: int):
        self.group = group
        self.B = block_size

    def released(self, tokens: int) -> range:
        """Positions of the blocks the group no longer holds at ``tokens`` tokens."""
        return F.released_blocks(tokens, self.group, self.B)

    def releasing(self, table: list, tokens: int) -> list:
        """Positions of ``table`` still holding a block the group gives back at ``tokens`` tokens,
        highest first (the order the oracle releases them in)."""
        gone = self.released(tokens)
        return [i for i in range(min(gone.stop, len(table)) - 1, gone.start - 1, -1) if table[i] is not None]

    def held(self, tokens: int) -> list:
        """Positions of the blocks the group holds at ``tokens`` tokens: those a prefix hit of
        ``tokens`` tokens needs cached."""
        return F.held_blocks(tokens, self.group, self.B)

    def held_count(self, table: list) -> int:
        """Blocks of a table the sequence holds (a full group's holds every position's)."""
        return sum(1 for b in table if b is not None) if self.releases else len(table)

    def released_span(self, table: list, tokens: int) -> tuple:
        """Positions ``(lo, hi)`` whose K/V the sequence no longer holds, which read 0: the run of
        released blocks from the first one (``(0, 0)``: none)."""
        lo = next((i for i, b in enumerate(table) if b is None), len(table))
        hi = next((i for i in range(lo, len(table)) if table[i] is not None), len(table))
        lo, hi = min(lo * self.B, tokens), min(hi * self.B, tokens)
        return (lo, hi) if hi > lo else (0, 0)

    def slab(self, size: int) -> int:
        """The contiguous layout's slab for a reservation of ``size`` slots."""
        return size

    def slab_held(self, tokens: int, size: int) -> int:
        """Slots of a slab of ``size`` holding a token (the slab keeps every token)."""
        return tokens


class FullKind(Kind):
    pass


class MLAKind(Kind):
    """mla(d): full attention over one latent per token (its bytes are formulas')."""


class SlidingKind(Kind):
    """sliding(W): the blocks covering the last W tokens; the contiguous slab is a ring of at most
    W slots, holding the last ones written."""

    releases = True
    ring = True
    rollback_needs = "blocks the group already released"

    def slab(self, size: int) -> int:
        return min(size, self.group.window)

    def slab_held(self, tokens: int, size: int) -> int:
        return min(tokens, size)


class ChunkedKind(Kind):
    """chunked(C): the blocks of the current chunk, from floor(T/C)*C."""

    releases = True
    rollback_needs = "blocks the group already released"


class SinksKind(Kind):
    """sinks(S, W): the first S tokens' blocks for good, and a window of W."""

    releases = True
    rollback_needs = "blocks the group already released"


class StateKind(Kind):
    """state(bytes): one state per sequence, in the block of its last token; it holds no K/V a
    sequence reads back, and a fork that shares blocks copies it (the branches diverge)."""

    releases = True
    copied_at_fork = True
    rollback_needs = "the state before the drafts (SPEC §12)"

    def released_span(self, table: list, tokens: int) -> tuple:
        return (0, tokens)


KINDS: dict[str, type[Kind]] = {
    "full": FullKind, "mla": MLAKind, "sliding": SlidingKind, "chunked": ChunkedKind,
    "sinks": SinksKind, "state": StateKind,
}


def kind_of(group: F.KVGroup, block_size: int) -> Kind:
    """The kind of a group, from :data:`KINDS` by its family."""
    try:
        cls = KINDS[group.family]
    except KeyError:
        raise ValueError(f"no model of {group.family!r} groups (kvbench.model.kinds.KINDS has "
                         f"{', '.join(KINDS)})") from None
    return cls(group, block_size)
