"""One class per KV cache group kind (SPEC §8, §12), picked from :data:`KINDS` by the group's
family, as vLLM's ``spec_manager_map`` picks a manager per KV cache spec.

Each kind owns its rules of what a sequence holds, what it gives back and what a prefix hit
needs cached, and its group's table operations (an append's need and writes, a release, an
accept's rollback, a fork's copy); the oracle asks the kind instead of branching on it. The
block arithmetic itself is SPEC's, in kvbench.contract.formulas. A new kind is one class here
(or anywhere) and one entry in :data:`KINDS` (tests/model/test_kinds_table.py adds a toy one).
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
        self.r = group.ratio  # tokens per entry: a table position covers B * r tokens

    @property
    def key_tokens(self) -> int:
        """Tokens a table position (a block of B entries) covers, so the granularity of its
        prefix-cache keys: B * r (B but for compressed(r))."""
        return self.B * self.r

    def key_index(self, i: int) -> int:
        """The prompt's B-block whose key names table position ``i``: the last it covers,
        (i + 1) * r - 1 (i but for compressed(r))."""
        return (i + 1) * self.r - 1

    def entries(self, tokens: int) -> int:
        """Slots the group writes for ``tokens`` tokens: ceil(T / r) (formulas.entries)."""
        return F.entries(tokens, self.group)

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

    # The group's block table operations on the paged model ``m`` (kvbench.model.oracle.Oracle),
    # as vLLM's SingleTypeKVCacheManager owns a group's: the oracle calls them group by group.

    def admitted(self, m, st, g: int, hits: dict, L: int, n: int) -> list:
        """A new request's table: the hit's cached blocks (``hits`` by position) below L * B
        tokens, then new blocks up to its n * B tokens' positions (ceil(n / r) of them: the
        nested ceilings of ceil(ceil(T/B) / r) = ceil(T / (B * r))), each filled with the
        entries of its tokens."""
        E, top = self.entries(st.tokens), -(-n // self.r)
        return ([hits.get(i) for i in range(L // self.r)]
                + [m._new_block(min(self.B, E - i * self.B), g) if m._allocates(st, g, i, top) else None
                   for i in range(L // self.r, top)])

    def append_need(self, m, g: int, seqs, tokens, refs: dict) -> int:
        """Blocks a batched append takes in the group, the copies of shared tails included
        (``refs``: per block, the references already counted away)."""
        need = 0
        for s, dt in zip(seqs, tokens):
            st, room = m.seqs[s], 0
            de = self.entries(st.tokens + dt) - self.entries(st.tokens) if self.r > 1 else dt
            tail = st.tables[g][-1] if st.tables[g] else None
            if tail is not None:
                ref, fill = m.blocks[tail]
                room = self.B - fill
                if room > 0 and de > 0 and ref + refs.get(tail, 0) > 1:
                    need += 1  # the writer gets its own copy of the shared tail
                    refs[tail] = refs.get(tail, 0) - 1
            new = m._appended_blocks(g, F.append_new_blocks(de, room, self.B))
            need += max(0, new - (len(st.ahead[g]) if st.ahead else 0))
        return need

    def write(self, m, g: int, seqs, tokens) -> None:
        """An append's writes: the copies of shared tails it writes entries into (writers in
        batch order), then the entries, filling each tail before new blocks (positions in
        order). A block is complete (cached, where its key is) once its B * r tokens are
        written, whether or not the append wrote one of its entries."""
        span = self.B * self.r
        for s, dt in zip(seqs, tokens):
            st = m.seqs[s]
            table = st.tables[g]
            if table and table[-1] is not None and self.entries(st.tokens + dt) > self.entries(st.tokens):
                ref, fill = m.blocks[table[-1]]
                if fill < self.B and ref > 1:  # the writer gets a private copy of the tail
                    m._drop_ref(table[-1])
                    table[-1] = m._new_block(fill, g)
        for s, dt in zip(seqs, tokens):
            T, table = m.seqs[s].tokens, m.seqs[s].tables[g]
            de = self.entries(T + dt) - self.entries(T) if self.r > 1 else dt
            if table and table[-1] is not None:
                fill = m.blocks[table[-1]][1]
                take = min(de, self.B - fill)
                m.blocks[table[-1]][1] += take
                m.filled += take
                de -= take
                if T < len(table) * span <= T + dt:
                    m._completed(table[-1], g, s, len(table) - 1)
            while de > 0:
                take = min(de, self.B)
                de -= take
                if m._skips_block(g, last=de <= 0):  # align mode: a state's null position
                    table.append(None)
                    continue
                table.append(m._next_block(s, take, g))
                if len(table) * span <= T + dt:
                    m._completed(table[-1], g, s, len(table) - 1)

    def release(self, m, st, g: int) -> None:
        """Every reference of the sequence's table, the tail first (its kept lookahead slots
        before it)."""
        for b in reversed(st.tables[g] + st.ahead[g] if st.ahead else st.tables[g]):
            if b is not None:
                m._drop_ref(b)

    def drop(self, m, st, g: int, positions) -> None:
        """Release the table's blocks at ``positions``, in that order (a fork through the prefix
        cache still names a cached one by its key)."""
        for i in positions:
            b = st.tables[g][i]
            if b in m.hash_of:
                st.released_keys[i] = m.hash_of[b][1]
            m._drop_ref(b)
            st.tables[g][i] = None

    def rollback(self, m, st, g: int, seq, first_draft: int, new: int) -> None:
        """An accept's rollback to ``new`` tokens (SPEC §13): blocks wholly past it released or
        kept for the next drafts, the tail's fill cut, and the blocks the kept drafts filled
        (from ``first_draft``) cached now or later."""
        span = self.B * self.r
        table, keep = st.tables[g], F.blocks_needed(new, span)
        m._drop_drafts(st, g, table[keep:])
        del table[keep:]
        if keep and table[-1] is not None:
            fill = self.entries(new) - (keep - 1) * self.B
            m.filled += fill - m.blocks[table[-1]][1]
            m.blocks[table[-1]][1] = fill
        for i in range(first_draft // span, new // span):
            if table[i] is not None:
                m._drafts_filled(st, g, seq, i)

    def forked(self, m, g: int, table: list) -> None:
        """A fork's table, sharing the parent's blocks (SPEC §2): nothing of its own."""

    def reservation(self, m, table: list, st) -> int:
        """Slots the sequence's unshared tail block keeps for its remaining tokens (SPEC §2)."""
        if not table or table[-1] is None or m.blocks[table[-1]][0] != 1:
            return 0
        return F.tail_reservation(self.B - m.blocks[table[-1]][1],
                                  self.entries(st.final) - self.entries(st.tokens))

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

    def forked(self, m, g: int, table: list) -> None:
        """The state's block copied: the branches diverge at the next token (SPEC §12)."""
        b = table[-1]
        m._drop_ref(b)
        table[-1] = m._new_block(m.blocks[b][1], g)


class CompressedKind(Kind):
    """compressed(r): one entry per r tokens (DeepSeek-V4's compressed KV, compress_ratio = r),
    kept as long as the sequence lives. A block holds B entries covering B * r tokens, so a
    sequence of T tokens holds ceil(ceil(T / r) / B) blocks of the group (formulas.kind_blocks),
    a table position per B * r tokens (``key_tokens``).

    Entry k is written when token k * r is (an append that writes no entry's first token writes
    nothing in the group: no copy of a shared tail), and reads back that token's K/V at each of
    its r positions (docs/cache-kinds.md). Its prefix-cache keys are taken at every B * r
    tokens (SPEC §12): block j is keyed by the prompt's key at token (j + 1) * B * r, cached,
    and can be hit, only once those tokens are written, and lookup keys it as store does, or
    another session's block is served (vLLM-Ascend issue 10296). A hit on the model is the
    longest prefix every group hits: a multiple of B * r tokens."""

    def slab(self, size: int) -> int:
        raise ValueError(f"the contiguous layout has no slabs of {self.group.kind} groups (SPEC §12: "
                         f"paged only)")


KINDS: dict[str, type[Kind]] = {
    "full": FullKind, "mla": MLAKind, "sliding": SlidingKind, "chunked": ChunkedKind,
    "sinks": SinksKind, "state": StateKind, "compressed": CompressedKind,
}


def kind_of(group: F.KVGroup, block_size: int) -> Kind:
    """The kind of a group, from :data:`KINDS` by its family."""
    try:
        cls = KINDS[group.family]
    except KeyError:
        raise ValueError(f"no model of {group.family!r} groups (kvbench.model.kinds.KINDS has "
                         f"{', '.join(KINDS)})") from None
    return cls(group, block_size)


def oracle_kinds(model: F.ModelSpec, block_size: int, rules=None) -> list:
    """The kinds of a model's groups for the oracle. Compressed groups run under SPEC's rules
    as they are (``rules``: the rule set); an engine rule that moves a hit or a cache entry
    (a capped hit, a fork through the prefix cache, every full block cached) is not modelled
    at B * r tokens a position, and such a model is refused, naming what."""
    out = [kind_of(g, block_size) for g in model.kv_groups]
    compressed = [k.group.kind for k in out if k.r > 1]
    changed = [] if rules is None else [k for k, v in rules.PARAMS.items() if getattr(rules, k) != v]
    if compressed and rules is not None and (rules.name != "spec" or changed):
        raise ValueError(f"model {model.name}: the oracle runs {', '.join(compressed)} groups under "
                         f"SPEC's rules only, not rule set {rules.name!r}"
                         + (f" with {', '.join(changed)}" if changed else ""))
    return out
