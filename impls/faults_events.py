"""Planted faults of KV events (SPEC §14): each a small subclass of the NumPy pool whose cache is
right and whose events are not, reproducing an upstream event bug in kvbench's terms. The
catalogue (impls/faults.py) lists those the default run catches (each on hybrid-cut-hits, the first
committed workload with a prefix cache: docs/faults.md); the draft one needs drafts under a prefix
cache, which no committed workload has, and the index one is an event consumer's
(tests/checking/test_events.py plants both).
"""
from __future__ import annotations

from impls.numpy_paged import NumpyPaged
from kvbench.contract.events import CLEARED, REMOVED, STORED, KVEvent, Residency


class AnnouncedAgainEveryStep(NumpyPaged):
    """At every decode step the last cached block of each sequence's prompt is registered again:
    a removed, then a stored of the same key, though the entry never left the cache."""

    def append(self, seqs, tokens, kv=None, *, step=0):
        victims = super().append(seqs, tokens, kv, step=step)
        self._again = []
        for s in seqs:
            r = self.row_of[s]
            held = [int(b) for b in self.tables[0][r, :self.nblocks[r]] if b >= 0 and int(b) in self.hash_of]
            if held:
                self._again.append(self.hash_of[held[-1]])
        return victims

    def events(self):
        out = super().events()
        for g, key in getattr(self, "_again", ()):
            out += [KVEvent(REMOVED, key, None, g), KVEvent(STORED, key, None, g)]
        self._again = []
        return out


class ParentNeverStored(NumpyPaged):
    """The first block a prefill stores names, as its parent, a key that was never stored (the
    hash of a block the request did not compute)."""

    def events(self):
        return [KVEvent(STORED, e.key, ("never stored", e.key), e.group, e.tier)
                if e.kind == STORED and e.parent is None else e for e in super().events()]


class EvictsSilently(NumpyPaged):
    """Announces nothing when it evicts a cached block: the index keeps a key the cache lost."""

    def events(self):
        return [e for e in super().events() if e.kind != REMOVED]


class PartialBlockAnnounced(NumpyPaged):
    """A prefill announces its prompt's last, partial block as stored."""

    def prefill(self, seq, prompt, kv=None, *, step=0, protect=()):
        victims = super().prefill(seq, prompt, kv, step=step, protect=protect)
        if self.config.prefix_caching and prompt.tokens % self.B and prompt.block_hashes:
            self._partial = getattr(self, "_partial", []) + [("partial", seq, prompt.tokens)]
        return victims

    def events(self):
        out = super().events()
        for key in getattr(self, "_partial", ()):
            out.append(KVEvent(STORED, key, None, 0))
        self._partial = []
        return out


class DraftBlockAnnounced(NumpyPaged):
    """An append whose draft tokens fill a block announces that block as stored (a draft token
    never enters the prefix cache, SPEC §13)."""

    def append(self, seqs, tokens, kv=None, *, step=0, draft=None):
        before = {s: int(self.tokens[self.row_of[s]]) for s in seqs}
        victims = super().append(seqs, tokens, kv, step=step)
        if self.config.prefix_caching and draft:
            for s, d in zip(seqs, draft):
                now = int(self.tokens[self.row_of[s]])
                for i in range(max(before[s], now - d) // self.B, now // self.B):
                    self._drafted = getattr(self, "_drafted", []) + [("draft", s, i)]
        return victims

    def events(self):
        out = super().events()
        out += [KVEvent(STORED, key, None, 0) for key in getattr(self, "_drafted", ())]
        self._drafted = []
        return out


class IndexMissesCleared(Residency):
    """An index that misses a ``cleared``: the keys present before it stay present."""

    def apply(self, event):
        if event.kind == CLEARED:
            self.count += 1
            return
        super().apply(event)


# (name, upstream, fault): each caught by the default run
EVENT_BUGS = [
    ("a cached block registered again at every step: a stored follows its removed",
     "vLLM #49125", AnnouncedAgainEveryStep),
    ("a stored names a parent that was never stored", "vLLM PR #58121", ParentNeverStored),
]

# (name, fault): kvbench's own, caught by the default run too
EVENT_SLIPS = [
    ("an eviction announced by no removed", EvictsSilently),
    ("a prompt's partial last block announced as stored", PartialBlockAnnounced),
]
