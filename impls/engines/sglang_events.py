"""SGLang's KV events (``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``, from any of its
tree caches' ``take_events``) as SPEC §14's events: what the radix adapters' ``events()`` return,
and what any other adapter over an SGLang tree (impls/engines/sglang_components.py's) can return.

A ``BlockStored`` of n page hashes is n stored, the first's parent its ``parent_block_hash``,
each next one's the hash before it (SGLang coalesces a chain of pages into one event,
events.py:140-170); a ``BlockRemoved`` is one removed per hash; ``AllBlocksCleared`` a cleared.
SGLang announces no group: its full-attention pages are group 0, on the device (tier 0).
"""
from __future__ import annotations

from kvbench.contract.events import CLEARED, REMOVED, STORED, KVEvent


def kv_events(tree) -> list:
    """The events ``tree`` (an SGLang prefix cache built with ``enable_kv_cache_events``) emitted
    since the last call, in order."""
    out = []
    for e in tree.take_events():
        kind = type(e).__name__
        if kind == "BlockStored":
            parent = e.parent_block_hash
            for h in e.block_hashes:
                out.append(KVEvent(STORED, h, parent))
                parent = h
        elif kind == "BlockRemoved":
            out += [KVEvent(REMOVED, h) for h in e.block_hashes]
        elif kind == "AllBlocksCleared":
            out.append(KVEvent(CLEARED))
    return out
