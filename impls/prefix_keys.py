"""Host-side prefix caching shared by the paged backends: block keys and the hybrid prefix hit.

Keys are the backends' own (SHA-256, stable across processes), derived from what a prefill names:
the checker derives which blocks may be shared independently (kvbench.model.oracle).
"""
from __future__ import annotations

import hashlib

import numpy as np

from kvbench.contract import formulas as F


def tagged_extra(salt=None, adapter=None) -> bytes:
    """A prefill's extra keys, each tagged with its kind (a salt "x" is no adapter "x")."""
    return repr(tuple((k, v) for k, v in (("salt", salt), ("adapter", adapter)) if v is not None)).encode()


NO_EXTRA = tagged_extra()


def block_keys(tokens: int, block_size: int, block_hashes=None, token_ids=None,
               extra: bytes = NO_EXTRA) -> list:
    """The keys of a prompt's full blocks.

    From token ids: ``H(parent, block_tokens)`` chained from ``H(extra keys)``. From the trace's
    block hashes (each already names its prefix): the hash itself, or ``H(extra keys, hash)``.
    """
    n = tokens // block_size
    if token_ids is not None:
        keys, parent = [], hashlib.sha256(extra).digest()
        ids = np.asarray(token_ids, dtype="<i8")
        for i in range(min(n, len(ids) // block_size)):
            parent = hashlib.sha256(parent + ids[i * block_size:(i + 1) * block_size].tobytes()).digest()
            keys.append(parent)
        return keys
    hashes = list(block_hashes or ())[:n]
    if extra == NO_EXTRA:
        return hashes
    return [hashlib.sha256(extra + b"|" + repr(h).encode()).digest() for h in hashes]


def prompt_keys(prompt, block_size: int, extra: bytes | None = None) -> list:
    """The keys of a Prompt's full prompt blocks (a chunked prompt's whole prompt), keyed by
    its salt and adapter unless ``extra`` says otherwise."""
    if extra is None:
        extra = tagged_extra(prompt.salt, prompt.adapter)
    return block_keys(prompt.prompt_length, block_size, prompt.block_hashes, prompt.token_ids,
                      extra)


def hit_plan(keys, by_hash: dict, groups, block_size: int) -> tuple[int, list]:
    """The longest prefix of L blocks whose full groups have every block below L cached and
    whose releasing groups have the blocks they would hold at LB tokens cached (SPEC §8, §12:
    sliding, the blocks covering [max(0, LB - W + 1), LB); chunked, the current chunk's; sinks,
    the sinks' and the window's); per group the cached blocks of that hit, by position.
    ``by_hash`` maps (group, key) to a block."""
    top = len(keys)
    for g, group in enumerate(groups):
        if not group.releases:
            run = 0
            while run < top and (g, keys[run]) in by_hash:
                run += 1
            top = run
    for L in range(top, 0, -1):
        need = [F.held_blocks(L * block_size, group, block_size) for group in groups]
        if all((g, keys[i]) in by_hash for g, group in enumerate(groups) if group.releases
               for i in need[g]):
            return L, [[by_hash[(g, keys[i])] for i in need[g]] for g in range(len(groups))]
    return 0, [[] for _ in groups]


def cache_completed_chunk(chunking: dict, seq, full_blocks: int, rows, by_hash: dict,
                          hash_of: dict) -> None:
    """Cache the blocks of ``seq``'s chunked prompt (``chunking[seq]``: its keys, and how many
    are cached) that are complete now that it holds ``full_blocks`` full blocks (SPEC §13); a key
    already cached keeps its block. ``rows(lo, hi)``: per group, the block ids at positions
    lo .. hi-1 (-1 where none)."""
    keys, done = chunking[seq]
    upto = min(len(keys), full_blocks)
    for g, row in enumerate(rows(done, upto)):
        for key, b in zip(keys[done:upto], row):
            if (g, key) not in by_hash and b >= 0:
                by_hash[(g, key)] = b
                hash_of[b] = (g, key)
    if upto == len(keys):
        del chunking[seq]
    else:
        chunking[seq] = (keys, upto)
