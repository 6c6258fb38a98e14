"""vLLM's own v1 ``BlockPool`` behind the kvbench protocol: a ledger-only paged backend.

Opt-in: vLLM is not a dependency of kvbench (docs/engines.md has the recipe for a separate venv). The
module imports without vLLM; :meth:`VllmBlockPool.available` says why it cannot run.

What comes from vLLM and what from this adapter:

- vLLM: the blocks (``KVCacheBlock``, their ``ref_cnt`` and hash), the free queue and its order,
  ``get_new_blocks`` / ``free_blocks`` / ``touch`` / ``get_num_free_blocks``, and the prefix cache
  (``cache_full_blocks`` / ``get_cached_block``, freed hashed blocks kept as eviction candidates).
- The adapter: per-sequence block tables and token counts (vLLM's ``KVCacheManager`` keeps those
  per request; it is not used here because it needs a scheduler, requests and token ids), fork,
  copy-on-write of a shared partial tail, and the atomic out-of-memory check.

vLLM reserves block 0 as the *null block* (a placeholder whose ref_cnt is never maintained): a
pool built with n blocks has n - 1 usable ones. A CacheConfig of ``num_blocks = N`` builds a pool
of N + 1, so N blocks are usable, and the null block is left out of every figure.

Fork: vLLM's v1 pool has no fork (parallel sampling shares a prompt through the prefix cache).
The child's table is a copy of the parent's, and ``BlockPool.touch(table)`` gives every block one
more reference: for a block in use touch is exactly ``ref_cnt += 1``.

Copy-on-write: a write into a partial tail block with ``ref_cnt > 1`` takes a fresh block
(``get_new_blocks(1)``; no data is copied, the backend holds none), puts it in the writer's table
and drops the writer's reference to the shared one with ``free_blocks([old])`` (its ref_cnt stays
>= 1: the other sharers still hold it). vLLM's own copy-on-write (``_apply_cow``, for partial
prefix-cache hits) is the same exchange, done later on the worker.
"""
from __future__ import annotations

import functools
import types

import numpy as np

from impls.engines.block_tally import BlockTally
from impls.prefix_keys import prompt_keys
from kvbench.contract import formulas as F
from kvbench.contract.events import CLEARED, REMOVED, STORED, KVEvent
from kvbench.contract.protocol import (
    Backend,
    BlockChanges,
    BlockState,
    CacheConfig,
    Capabilities,
    Ledger,
    OutOfMemory,
)

NOT_INSTALLED = "vllm is not installed: its opt-in recipe is in docs/engines.md"


def importable(load) -> tuple[bool, str]:
    """(True, "") when ``load()`` imports what an adapter needs of vLLM, else why not."""
    try:
        load()
    except ImportError as e:
        if e.name == "vllm":
            return False, NOT_INSTALLED
        return False, f"vllm cannot be imported ({type(e).__name__}: {e}): its opt-in recipe is in docs/engines.md"
    except Exception as e:  # a broken vLLM install fails in odd ways (a TypeError, ...)
        return False, f"vllm cannot be imported ({type(e).__name__}: {e}): its opt-in recipe is in docs/engines.md"
    return True, ""


@functools.lru_cache(maxsize=1)
def _vllm():
    """vLLM's block pool module, imported once (importing vLLM takes seconds)."""
    from vllm.v1.core import block_pool, kv_cache_utils

    return types.SimpleNamespace(BlockPool=block_pool.BlockPool, BlockHash=kv_cache_utils.BlockHash,
                                 event_hash=kv_cache_utils.maybe_convert_block_hash)


def _block_hash(h) -> bytes:
    """A trace's block hash (int or str) as vLLM's ``BlockHash`` (bytes; a group id is appended)."""
    if isinstance(h, bytes):
        return h
    return repr(h).encode()  # repr keeps 1 and "1" apart


class VllmBlockPool(Backend):
    name = "vllm-blockpool"
    capabilities = Capabilities(layout="paged", holds_kv=False, fork=True, copy_on_write=True,
                                prefix_caching=True, eviction=(), cache_salt=True)
    # No eviction policy: vLLM preempts requests in its scheduler, not in the block pool, so a
    # config with a policy is reported not applicable by the checker.

    @classmethod
    def available(cls) -> tuple[bool, str]:
        return importable(_vllm)

    def __init__(self, config: CacheConfig):
        super().__init__(config)
        ok, why = self.available()
        if not ok:
            raise RuntimeError(f"{self.name}: {why}")
        vllm = _vllm()
        self.block_size = config.block_size
        self.caching = bool(config.prefix_caching)
        # + 1: vLLM takes block 0 as its null block.
        self.pool = vllm.BlockPool(num_gpu_blocks=config.num_blocks + 1, enable_caching=self.caching,
                                   hash_block_size=config.block_size,
                                   enable_kv_cache_events=self.caching)
        self._BlockHash = vllm.BlockHash
        # vLLM's events carry its hashes as it converts them (maybe_convert_block_hash: an int
        # of the hash's bytes by default): each read back as the trace's key it stands for, or
        # the checker's pairing would take the int 48 (b"0") for the trace's key 48.
        self._event_hash = vllm.event_hash
        self._trace_key: dict = {}
        self.tables: dict[int, list] = {}  # seq -> [KVCacheBlock]
        self.tokens: dict[int, int] = {}
        self.final: dict[int, int] = {}
        self.hit_blocks = 0
        self.tally = BlockTally(config.block_size, 1, self._tables_of, self._reservation_of)
        self.structures = FreeQueueState(self.pool, self.tally)

    # --- helpers ---------------------------------------------------------------------------

    def _check_free(self, need: int, what: str) -> None:
        free = self.pool.get_num_free_blocks()
        if need > free:
            raise OutOfMemory(f"{self.name}: {what} needs {need} blocks, {free} free")

    def _tables_of(self, seq):
        return ((self.tables[seq],), self.tokens[seq]) if seq in self.tables else None

    def _reservation_of(self, seq):
        """A private tail's free slots the sequence's later tokens will use (SPEC §10)."""
        table = self.tables[seq]
        if not table:
            return 0, ()
        n = self.tokens[seq]
        r = F.tail_reservation((-n) % self.block_size, self.final[seq] - n) if table[-1].ref_cnt == 1 else 0
        return r, (table[-1].block_id,)

    def _table(self, seq: int) -> list:
        try:
            return self.tables[seq]
        except KeyError:
            raise KeyError(f"{self.name}: unknown sequence {seq}") from None

    def _hits(self, hashes) -> list:
        """Cached blocks for the leading run of ``hashes`` (a prefix hit stops at the first miss)."""
        hits = []
        for h in hashes:
            found = self.pool.get_cached_block(self._BlockHash(h), [0])
            if found is None:
                break
            hits.append(found[0])
        return hits

    # --- the protocol ----------------------------------------------------------------------

    def prefill(self, seq, prompt, kv=None, *, step=0, protect=()):
        tokens = prompt.tokens
        if seq in self.tables:
            raise ValueError(f"{self.name}: sequence {seq} already exists")
        if tokens < 0:
            raise ValueError(f"{self.name}: prefill of sequence {seq} with {tokens} tokens")
        B = self.block_size
        n = -(-tokens // B)
        self.tally.touch(seq)
        # Only full blocks carry a hash. vLLM's BlockPool takes the hashes its caller computed (the
        # KVCacheManager chains the salt and the LoRA name into them): so do the same here.
        keys = prompt_keys(prompt, B) if self.caching else []
        hashes = [_block_hash(h) for h in keys]
        self._trace_key.update((self._event_hash(h), k) for h, k in zip(hashes, keys))
        hits = self._hits(hashes)
        # A hit on a freed cached block takes it back out of the free queue: it counts too.
        self._check_free(n - len(hits) + sum(1 for b in hits if b.ref_cnt == 0),
                         f"prefill of sequence {seq} ({tokens} tokens, {len(hits)} cached)")
        self.pool.touch(hits)  # before get_new_blocks, which would evict a free hit
        table = hits + self.pool.get_new_blocks(n - len(hits))
        if len(hashes) > len(hits):
            # vLLM's cache_full_blocks reads the request's block_hashes, and for its KV events
            # the token ids, LoRA, salt, multimodal features and session (none of them here:
            # the salt and adapter are in the hashes already).
            request = types.SimpleNamespace(block_hashes=hashes, all_token_ids=[0] * (n * B),
                                            num_tokens=tokens, lora_request=None, cache_salt=None,
                                            mm_features=[], session_id=None, prompt_embeds=None)
            self.pool.cache_full_blocks(request, table, num_cached_blocks=len(hits),
                                        num_full_blocks=len(hashes), block_size=B,
                                        kv_cache_group_id=0)
        self.hit_blocks += len(hits)
        self.tables[seq] = table
        self.tokens[seq] = tokens
        self.final[seq] = prompt.final_tokens if prompt.final_tokens is not None else tokens
        return ()

    def append(self, seqs, tokens, kv=None, *, step=0):
        B = self.block_size
        seqs, tokens = list(seqs), list(tokens)
        tables = [self._table(s) for s in seqs]
        self.tally.touch(*seqs)
        # What the whole batch needs, copies of shared tails included, writers in batch order.
        need = 0
        refs_dropped: dict[int, int] = {}
        for s, dt, table in zip(seqs, tokens, tables):
            room = (-self.tokens[s]) % B if table else 0
            if room and dt > 0:
                tail = table[-1]
                if tail.ref_cnt - refs_dropped.get(tail.block_id, 0) > 1:
                    need += 1
                    refs_dropped[tail.block_id] = refs_dropped.get(tail.block_id, 0) + 1
            need += -(-max(0, dt - room) // B)
        self._check_free(need, f"append of {tokens} tokens to sequences {seqs}")
        for s, dt, table in zip(seqs, tokens, tables):
            room = (-self.tokens[s]) % B if table else 0
            if room and dt > 0 and table[-1].ref_cnt > 1:
                shared = table[-1]
                table[-1] = self.pool.get_new_blocks(1)[0]  # the writer's private copy
                self.pool.free_blocks([shared])  # drops this writer's reference only
            table.extend(self.pool.get_new_blocks(-(-max(0, dt - room) // B)))
            self.tokens[s] += dt
        return ()

    def fork(self, seq, src, *, final_tokens=None, step=0):
        if seq in self.tables:
            raise ValueError(f"{self.name}: sequence {seq} already exists")
        parent = self._table(src)
        self.tally.touch(seq, src)
        self.pool.touch(parent)  # every block in use: ref_cnt += 1
        self.tables[seq] = list(parent)
        self.tokens[seq] = self.tokens[src]
        self.final[seq] = final_tokens if final_tokens is not None else self.tokens[src]
        return ()

    def free(self, seq, *, step=0):
        table = self._table(seq)
        self.tally.touch(seq)
        # As vLLM's KVCacheManager does: reversed, so a freed prefix's tail is evicted first.
        self.pool.free_blocks(reversed(table))
        del self.tables[seq], self.tokens[seq], self.final[seq]

    def events(self) -> list:
        """SPEC §14, from vLLM's own KV events (``BlockPool.take_events``): a ``BlockStored`` of n
        hashes is n stored (the first's parent its ``parent_block_hash``, each next one's the hash
        before it), a ``BlockRemoved`` one removed per hash, ``AllBlocksCleared`` a cleared."""
        out, key = [], lambda h: self._trace_key.get(h, h)
        for e in self.pool.take_events():
            kind = type(e).__name__
            group = getattr(e, "group_idx", None) or 0
            if kind == "BlockStored":
                parent = None if e.parent_block_hash is None else key(e.parent_block_hash)
                for h in e.block_hashes:
                    out.append(KVEvent(STORED, key(h), parent, group))
                    parent = key(h)
            elif kind == "BlockRemoved":
                out += [KVEvent(REMOVED, key(h), None, group) for h in e.block_hashes]
            elif kind == "AllBlocksCleared":
                out.append(KVEvent(CLEARED))
        return out

    def ledger(self, seqs=None) -> Ledger:
        """From the tally (the blocks operations touched) and vLLM's free count: no pool scan."""
        tally = self.tally
        tally.sync()
        live = self.tables if seqs is None else [s for s in seqs if s in self.tables]
        return Ledger.paged(
            num_blocks=self.config.num_blocks, block_size=self.block_size,
            block_bytes=self.block_size * self.config.model.bytes_per_token,
            # BlockPool.get_num_free_blocks: the free queue's own count (block_pool.py:912-919).
            blocks_used=tally.used, blocks_free=self.pool.get_num_free_blocks(),
            tokens={s: self.tokens[s] for s in live},
            seq_blocks={s: len(self.tables[s]) for s in live},
            token_states=tally.token_states, reservation=tally.reservation,
            shared_blocks=tally.shared, cached_blocks=tally.cached,
            prefix_hit_blocks=self.hit_blocks, self_report={})

    # --- block_state: vLLM's own structures ---------------------------------------------------

    def block_state(self, seqs=None, *, changed_since=None) -> BlockState:
        """vLLM's free block queue and reference counts (:class:`FreeQueueState`), and the tables."""
        live = self.tables if seqs is None else [s for s in seqs if s in self.tables]
        return self.structures.state({s: (self.tables[s],) for s in live}, changed_since)


# --- block_state over one vLLM BlockPool (both adapters) ----------------------------------------

class FreeQueueState:
    """SPEC §10's block structures read from a vLLM ``BlockPool``: its ``FreeKVCacheBlockQueue``
    from the head (the next block ``get_new_blocks`` hands out) and each block's ``ref_cnt``.

    vLLM's queue is one list: ``free_blocks`` prepends the blocks without a hash (LIFO) and
    appends the hashed ones (an LRU of cached blocks; a request's blocks come in reversed, so its
    tail is evicted first: ``FreeKVCacheBlockQueue``'s docstring), and ``get_new_blocks`` pops the
    head. So its uncached blocks lie before its cached ones, and the two lists kvbench reads are
    the queue cut in two: ``free`` (no hash), ``cached`` (hashed, next evicted first).

    Ids are vLLM's less one (its block 0 is the null block, never free, its ref_cnt unkept), -1
    for the null block in a table. Between sweeps (``changed_since``) only the blocks the
    adapter's tally recounted are read: the uncached ones among them are at most the queue's
    changed head (the uncached part is pushed and popped at the head alone), and the hashed
    ones freed since are the queue's tail, in order (an append goes to the tail; a hit or an
    eviction only takes out).

    A whole state (a sweep) reads the blocks some operation took, not the pool: vLLM builds
    its queue 1 .. n and hands blocks out from the head, so the blocks no operation ever took
    are one run of the queue, ``top + 1 .. n`` ascending (``top``: the highest id the tally ever
    recounted), between the freed uncached blocks and the cached ones. The read walks the head
    up to the run and the cached tail, checks that the run starts and ends where it must and
    that the three parts add up to the queue's count, and reads the ``ref_cnt`` of the blocks
    ever taken (the run's are 0: never handed out). Where any of that does not hold, it walks
    the whole queue and reads every ``ref_cnt``, as it always did."""

    def __init__(self, pool, tally):
        self.pool, self.tally = pool, tally
        self.mark = None
        self.taken: set = set()  # vLLM ids of every block the tally recounted: all others never left the queue
        self.top = 0  # the highest of them

    def state(self, tables: dict, changed_since=None) -> BlockState:
        """``tables``: sequence -> its tables (vLLM's blocks), one per group."""
        moved = self.tally.take_moved()
        if moved:
            self.taken.update(moved)
            self.top = max(self.top, max(moved))
        ids = {s: [[-1 if b.is_null else b.block_id - 1 for b in t] for t in per]
               for s, per in tables.items()}
        fresh = changed_since is not None and changed_since is self.mark
        self.mark = object()
        if fresh:
            return BlockState(None, None, _RefCounts(self.pool.blocks), ids, self.mark,
                              self._changes(moved))
        split = self._split_at_untaken()
        if split is not None:
            free, cached = split
            refs = np.zeros(len(self.pool.blocks) - 1, dtype=np.int64)
            taken = np.fromiter(self.taken, dtype=np.int64, count=len(self.taken))
            refs[taken - 1] = np.fromiter((self.pool.blocks[i].ref_cnt for i in taken.tolist()),
                                          dtype=np.int64, count=len(taken))
            return BlockState(free, cached, refs, ids, self.mark)
        free, cached = [], []
        for b in self._queue():
            (free if b.block_hash is None else cached).append(b.block_id - 1)
        refs = np.fromiter((b.ref_cnt for b in self.pool.blocks[1:]), dtype=np.int64,
                           count=len(self.pool.blocks) - 1)
        return BlockState(free, cached, refs, ids, self.mark)

    def _split_at_untaken(self):
        """The queue's free and cached ids, walking only past the blocks some operation took
        (the class's docstring); None where the queue is not laid out so."""
        q, blocks = self.pool.free_block_queue, self.pool.blocks
        n, top, cached = len(blocks) - 1, self.top, self.tally.cached
        head_count = q.num_free_blocks - cached - (n - top)
        if head_count < 0:
            return None
        head, b = [], q.fake_free_list_head.next_free_block
        for _ in range(head_count):
            if b is q.fake_free_list_tail or b.block_hash is not None:
                return None
            head.append(b.block_id - 1)
            b = b.next_free_block
        tail, t = [], q.fake_free_list_tail.prev_free_block
        for _ in range(cached):
            if t is q.fake_free_list_head or t.block_hash is None:
                return None
            tail.append(t.block_id - 1)
            t = t.prev_free_block
        after = t.next_free_block  # the first cached block, or the queue's end
        if top < n:  # the untaken run: top + 1 .. n, right after the head, right before the cached
            if b is not blocks[top + 1] or blocks[n].next_free_block is not after \
                    or blocks[n].block_hash is not None:
                return None
            free = np.concatenate([np.asarray(head, dtype=np.int64), np.arange(top, n)])
        elif b is not after:
            return None
        else:
            free = head
        return free, tail[::-1]

    def _queue(self):
        q = self.pool.free_block_queue
        b = q.fake_free_list_head.next_free_block
        while b is not q.fake_free_list_tail:
            yield b
            b = b.next_free_block

    def _changes(self, moved: set) -> BlockChanges:
        q, blocks = self.pool.free_block_queue, self.pool.blocks
        free_now = [i for i in moved if blocks[i].ref_cnt == 0]
        k = sum(1 for i in free_now if blocks[i].block_hash is None)
        head, b = [], q.fake_free_list_head.next_free_block
        for _ in range(k):
            head.append(b.block_id - 1)
            b = b.next_free_block
        cached_now = {i for i in free_now if blocks[i].block_hash is not None}
        log = [(i - 1, False) for i in moved if i not in cached_now]
        tail, b = [], q.fake_free_list_tail.prev_free_block
        while b is not q.fake_free_list_head and b.block_id in cached_now:
            tail.append(b.block_id - 1)
            b = b.prev_free_block
        for i in reversed(tail):  # out first: the block may have been in the queue before
            log += [(i, False), (i, True)]
        return BlockChanges(head, q.num_free_blocks - self.tally.cached, log)


class _RefCounts:
    """vLLM's ``ref_cnt`` of the blocks of an array of kvbench ids (vLLM's less one)."""

    def __init__(self, blocks):
        self.blocks = blocks

    def __getitem__(self, ids) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        return np.fromiter((self.blocks[i + 1].ref_cnt for i in ids.tolist()), dtype=np.int64,
                           count=len(ids))
