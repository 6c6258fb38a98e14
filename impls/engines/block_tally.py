"""A tally of the blocks an engine adapter's operations touched, for its ledger's pool-wide
figures without a scan of the pool. The vLLM adapters count vLLM's own blocks; SGLang's counts its
pages (``impls.engines.sglang_radix``, whose pages hold no count of their own).
"""
from __future__ import annotations


class Uncounted:
    """A block of an engine that counts no holders per block (SGLang's pages: its tree locks
    nodes): its ``ref_cnt`` is its entries in the tables a tally keeps; it is never cached by
    hash (the engine's own figure counts those)."""

    __slots__ = ("block_id", "refs")
    is_null, block_hash = False, None

    def __init__(self, block_id: int, refs: dict):
        self.block_id, self.refs = block_id, refs

    @property
    def ref_cnt(self) -> int:
        return self.refs.get(self.block_id, 0)


class BlockTally:
    """The pool-wide figures of an engine adapter's ledger, kept from the blocks operations
    touched: never a scan of the pool.

    The operations mark the sequences they touched (``touch``); the next ``sync`` (the ledger's)
    compares each one's tables with the copy taken at its previous sync, and recounts the blocks
    in either, reading each block's ``block_id``, ``is_null``, own ``ref_cnt`` and ``block_hash``
    (vLLM's ``KVCacheBlock``, or SGLang's page as the SGLang adapter wraps it):
    in use, shared, cached (free and hashed), and its fill. Every block whose ``ref_cnt`` or hash
    can change is in such a table before or after: a hit, a new block (an evicted cached one
    included), a release, a free, a copy-on-write. Syncing at the ledger, not in the operation,
    counts whatever the operation did to those tables, a subclass's extra calls included.
    Tokens past the length (lookahead slots) fill nothing."""

    def __init__(self, block_size: int, groups: int, tables, reservation):
        """``tables(seq)``: the sequence's tables, one list of blocks per group, and its tokens
        (None once it is gone); ``reservation(seq)``: its tail reservation (SPEC §10) and the ids
        of the blocks whose ``ref_cnt`` it read."""
        self.B, self.tables, self.reservation_of = block_size, tables, reservation
        self.counted: dict = {}  # block id -> (in use, shared, cached, fill) as last counted
        self.used = self.shared = self.cached = self.token_states = self.reservation = 0
        self.group_refs = [{} for _ in range(groups)]  # per group: block id -> table entries
        self.copy: dict = {}  # seq -> (its tables at its last sync, tokens)
        self.reserved: dict = {}  # seq -> its reservation at its last sync
        self.tails: dict = {}  # seq -> the blocks its reservation read
        self.tail_of: dict = {}  # block id -> the sequences whose reservation read it
        self.dirty: set = set()
        self.pending: dict = {}  # block id -> block: in a table before an operation, not copied
        self.moved: set = set()  # block ids recounted since the last take_moved (block_state's)

    def touch(self, *seqs) -> None:
        """Before an operation on ``seqs``: where a sequence's tables may differ from its copy
        (changed since its last sync, or never synced), their blocks now are counted again too."""
        for s in seqs:
            if s in self.dirty or s not in self.copy:
                now = self.tables(s)
                for table in now[0] if now is not None else ():
                    for b in table:
                        if not b.is_null:
                            self.pending.setdefault(b.block_id, b)
        self.dirty.update(seqs)

    def held_within(self, tables) -> None:
        """Blocks an operation held in these tables part way through, which it may release
        before it ends (a prefill in chunks releases its earlier state blocks): counted again at
        the next sync, as the blocks of a table before the operation are."""
        for table in tables:
            for b in table:
                if not b.is_null:
                    self.pending.setdefault(b.block_id, b)

    def uncounted(self, block_ids) -> list:
        """``block_ids`` as blocks whose ``ref_cnt`` is this tally's count of their entries."""
        return [Uncounted(b, self.group_refs[0]) for b in block_ids]

    def seq_blocks(self, seq) -> int:
        return sum(len(t) for t in self.copy[seq][0])

    def tokens(self, seq) -> int:
        return self.copy[seq][1]

    def sync(self) -> None:
        touched = {bid: (b, None) for bid, b in self.pending.items()}  # block id -> (block, fill or None: as counted)
        dirty, self.dirty, self.pending = self.dirty, set(), {}
        for s in dirty:
            old = self.copy.pop(s, None)
            if old is not None:
                for refs, table in zip(self.group_refs, old[0]):
                    for b in table:
                        if refs[b.block_id] == 1:
                            del refs[b.block_id]
                        else:
                            refs[b.block_id] -= 1
                        touched.setdefault(b.block_id, (b, None))
            now = self.tables(s)
            if now is None:
                continue
            tables, n = now
            held = tuple([b for b in table if not b.is_null] for table in tables)
            for refs, table in zip(self.group_refs, tables):
                for i, b in enumerate(table):
                    if not b.is_null:
                        refs[b.block_id] = refs.get(b.block_id, 0) + 1
                        touched[b.block_id] = (b, max(0, min(self.B, n - i * self.B)))
            self.copy[s] = (held, n)
        for b, fill in touched.values():
            self._recount(b, fill)
        self.moved.update(touched)
        # A sequence's reservation follows its tail's ref_cnt, which another's operation moves.
        again = set(dirty)
        for bid in touched:
            again.update(self.tail_of.get(bid, ()))
        for s in again:
            for bid in self.tails.pop(s, ()):
                holders = self.tail_of[bid]
                holders.discard(s)
                if not holders:
                    del self.tail_of[bid]
            r, tails = self.reservation_of(s) if s in self.copy else (0, ())
            self.reservation += r - self.reserved.pop(s, 0)
            if s in self.copy:
                self.reserved[s], self.tails[s] = r, tails
                for bid in tails:
                    self.tail_of.setdefault(bid, set()).add(s)

    def take_moved(self) -> set:
        """The ids of the blocks the syncs since the last call recounted: every block whose
        reference count, hash or place in the engine's free structure an operation changed
        (``block_state(changed_since=)`` reports these alone)."""
        self.sync()
        moved, self.moved = self.moved, set()
        return moved

    def _recount(self, b, fill) -> None:
        used0, shared0, cached0, fill0 = self.counted.get(b.block_id, (False, False, False, 0))
        fill = fill0 if fill is None else fill
        used, shared = b.ref_cnt > 0, b.ref_cnt > 1
        cached = b.ref_cnt == 0 and b.block_hash is not None
        self.used += used - used0
        self.shared += shared - shared0
        self.cached += cached - cached0
        self.token_states += fill * used - fill0 * used0
        self.counted[b.block_id] = (used, shared, cached, fill)
