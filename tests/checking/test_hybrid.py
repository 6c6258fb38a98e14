"""Hybrid models (SPEC §8), prefix-cache isolation (SPEC §9), figures that agree (SPEC §10).

Expected values come from the formulas, with the arithmetic inline. The model is ``tiny-hybrid``:
4 layers, sliding(32) on layers 0 and 2 (group 0), full attention on 1 and 3 (group 1), 2 KV
heads of 8, fp16: one slot of one group is 2 * 2 * 2 * 8 * 2 = 128 bytes.
"""
from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
from conftest import backends

from impls.contiguous import Contiguous
from impls.numpy_paged import NumpyPaged
from kvbench.checking.checker import check
from kvbench.checking.identities import ledger_identities, structure_identities
from kvbench.contract import formulas as F
from kvbench.contract import registry
from kvbench.contract.protocol import BlockState, CacheConfig, Ledger, OutOfMemory, Prompt
from kvbench.model.oracle import ModelOOM, Oracle
from kvbench.traces.format import (
    Append,
    Fork,
    Free,
    Header,
    Prefill,
    Trace,
    TraceError,
    loads,
    validate,
)

HYBRID = F.get_model("tiny-hybrid")
B, W = 16, 32
PAGED = backends("paged", where=lambda caps: caps.groups)  # every pool that runs KV cache groups


def config(num_blocks=64, **kw) -> CacheConfig:
    return CacheConfig(model=HYBRID, block_size=B, num_blocks=num_blocks, **kw)


def trace(*ops, groups=()) -> Trace:
    """Ops as (kind, ...) tuples numbered 0, 1, 2, ...: ("p", seq, tokens, extra-dict),
    ("a", {seq: tokens}), ("k", seq, src), ("x", seq)."""
    out = []
    for step, op in enumerate(ops):
        if op[0] == "p":
            out.append(Prefill(step, op[1], "t", op[2], **(op[3] if len(op) > 3 else {})))
        elif op[0] == "a":
            out.append(Append(step, tuple(op[1]), tuple(op[1].values())))
        elif op[0] == "k":
            out.append(Fork(step, op[1], op[2]))
        else:
            out.append(Free(step, op[1]))
    return validate(Trace(Header("test", groups=tuple(groups)), out, name="hand"))


def passes(t: Trace, cfg: CacheConfig, names=PAGED + ["contiguous-oracle"]):
    for name in names:
        v = check(t, registry.create(name, cfg), gather="all")
        assert v.valid is True, f"{name}: {v.divergence}"


# --- formulas and presets -------------------------------------------------------------------

def test_presets_from_public_configs():
    g2, g3, m = (F.get_model(n) for n in ("gemma-2-9b", "gemma-3-12b", "mistral-7b-v0.1"))
    assert [(g.kind, len(g.layers)) for g in g2.kv_groups] == [("sliding(4096)", 21), ("full", 21)]
    assert g2.kv_groups[0].layers[:3] == (0, 2, 4)  # Gemma 2: even layers slide
    assert [g.kind for g in g3.kv_groups] == ["sliding(1024)"] * 5 + ["full"]
    assert all(len(g.layers) == 8 for g in g3.kv_groups)  # 48 = 6 groups of 8
    assert g3.kv_groups[-1].layers == (5, 11, 17, 23, 29, 35, 41, 47)  # every 6th layer is full
    assert [g.kind for g in m.kv_groups] == ["sliding(4096)"]
    # One block holds one group's layers: B * 2 * L_group * H_kv * d_head * s.
    assert F.block_bytes(16, g2) == 16 * 2 * 21 * 8 * 256 * 2 == 2_752_512
    assert F.block_bytes(16, g3) == 16 * 2 * 8 * 8 * 256 * 2 == 1_048_576
    assert F.block_bytes(16, HYBRID) == 16 * 128 == 2048
    # A model of one group keeps its numbers.
    assert F.block_bytes(16, F.get_model("llama-3-8b")) == 16 * 2 * 32 * 8 * 128 * 2


def test_groups_must_hold_equal_layers_and_every_layer_once():
    with pytest.raises(ValueError, match="same number of layers"):
        F.ModelSpec("bad", 3, 1, 4, groups=(F.KVGroup((0, 1)), F.KVGroup((2,), 8)))
    with pytest.raises(ValueError, match="every layer"):
        F.ModelSpec("bad", 4, 1, 4, groups=(F.KVGroup((0, 1)), F.KVGroup((1, 2), 8)))


def test_capacity_formulas_by_hand():
    assert F.group_blocks(100, None, 16) == 7  # ceil(100/16)
    assert F.group_blocks(100, 32, 16) == 3  # min(7, ceil(31/16) + 1) = min(7, 3)
    assert F.group_blocks(20, 32, 16) == 2  # min(ceil(20/16), 3)
    assert F.request_blocks(100, HYBRID, 16) == 10  # 7 + 3
    assert F.max_concurrency(64, 100, HYBRID, 16) == 6  # floor(64 / 10)
    # 3 = floor(64 / (ceil(256/16) + ceil((32-1)/16) + 1)) = floor(64 / 19)
    assert F.max_concurrency(64, 256, HYBRID, 16) == 3
    # Gemma 3 at 32k tokens, blocks of 16: five sliding groups of min(2048, 64 + 1) blocks and
    # one full group of 2048: 2048 + 5 * 65 = 2373 blocks per request.
    assert F.request_blocks(32768, F.get_model("gemma-3-12b"), 16) == 2048 + 5 * 65


# --- the oracle: windows, release, out of memory --------------------------------------------

def test_long_prompt_over_a_small_window():
    o = Oracle(config())
    o.prefill(0, 100, "t", 120, step=0)
    led = o.expected_ledger()
    # Full group: ceil(100/16) = 7 blocks. Sliding: the blocks that intersect
    # [100 - 32 + 1, 100) = [69, 100): 69 // 16 = 4, so blocks 4, 5, 6.
    assert led.group_blocks == (3, 7) and led.blocks_used == 10
    assert led.seq_blocks == {0: 10}
    assert o.released_spans(0) == ((0, 4 * 16), (0, 0))
    assert led.bytes_in_use == 10 * 2048
    # Both tails (fill 100 - 96 = 4) are private: 2 * min(12, 120 - 100) reserved.
    assert led.reservation == 2 * 12


def test_out_of_memory_is_decided_before_the_window_releases():
    # The prefill writes every position in both groups first: 2 * 7 = 14 blocks, although
    # only 10 stay. 12 blocks refuse it, and nothing changes; 14 take it.
    o = Oracle(config(num_blocks=12))
    with pytest.raises(ModelOOM):
        o.prefill(0, 100, "t", 100, step=0)
    assert o.blocks_used == 0 and o.free_list().tolist() == list(range(12))  # 0 taken first
    o = Oracle(config(num_blocks=14))
    o.prefill(0, 100, "t", 100, step=0)
    assert o.blocks_used == 10


def test_decode_past_the_window_releases_one_block_at_a_time():
    o = Oracle(config())
    o.prefill(0, 100, "t", 200, step=0)
    for step in range(1, 11):  # up to 110 tokens: (110 - 31) // 16 = 79 // 16 = 4
        o.append([0], [1], step)
    assert o.expected_ledger().group_blocks == (3, 7)
    o.append([0], [1], 11)  # 111 tokens: (111 - 31) // 16 = 80 // 16 = 5, block 4 goes
    assert o.expected_ledger().group_blocks == (2, 7)
    o.append([0], [1], 12)  # 112 tokens: still 7 blocks, the window from 81 // 16 = 5
    assert o.expected_ledger().group_blocks == (2, 7)
    o.append([0], [1], 13)  # 113 tokens: a new block 7 in both groups, the window from 82 // 16 = 5
    assert o.expected_ledger().group_blocks == (3, 8)


def test_fork_straddling_the_window_edge():
    o = Oracle(config())
    o.prefill(0, 40, "t", 40, step=0)  # 3 blocks per group, tail fill 8; (40 - 31) // 16 = 0
    o.fork(1, 0, 70, step=1)
    assert o.blocks_used == 6 and o.expected_ledger().shared_blocks == 6
    o.append([1], [30], step=2)
    # Per group: a copy of the shared tail + ceil((30 - 8) / 16) = 2 new blocks: 6 + 2 * 3.
    # The child's window now starts at (70 - 31) // 16 = 2: it drops its references to the
    # sliding blocks 0 and 1, which its parent still holds.
    assert o.blocks_used == 12
    assert o.expected_ledger().group_blocks == (6, 6)
    assert o.seqs[1].tables[0][:2] == [None, None] and None not in o.seqs[0].tables[0]
    o.free(0)
    # The parent's sliding blocks 0..2 and its full tail go back: 12 - 4 = 8, the child's
    # 5 full blocks (ceil(70/16)) and 3 sliding ones (2, 3, 4).
    assert o.expected_ledger().group_blocks == (3, 5)
    passes(trace(("p", 0, 40), ("k", 1, 0), ("a", {1: 30}), ("x", 0)), config())


def test_a_window_of_one_releases_a_full_tail():
    # sliding(1): the next token attends to itself only; at 32 tokens (two full blocks) the
    # sliding group holds nothing, and the next token takes a new block in both groups.
    model = dataclasses.replace(HYBRID, groups=F.hybrid_groups(4, (1, None)))
    cfg = dataclasses.replace(config(), model=model)
    o = Oracle(cfg)
    o.prefill(0, 32, "t", 33, step=0)
    assert o.expected_ledger().group_blocks == (0, 2)
    o.append([0], [1], 1)
    assert o.expected_ledger().group_blocks == (1, 3)
    passes(trace(("p", 0, 32), ("a", {0: 1}), ("a", {0: 15}), ("a", {0: 1})), cfg)


@pytest.mark.parametrize("name", PAGED + backends("contiguous"))
def test_backends_replay_windows_forks_and_eviction(name):
    t = trace(("p", 0, 100), ("a", {0: 12}), ("p", 1, 40), ("k", 2, 1), ("a", {1: 30, 2: 5}),
              ("a", {0: 1, 1: 1, 2: 1}), ("x", 1), ("a", {0: 40, 2: 3}), ("x", 0), ("x", 2))
    for policy in (None, "lru"):
        v = check(t, registry.create(name, config(num_blocks=24, policy=policy)), gather="all")
        assert v.valid is True, f"{name} {policy}: {v.divergence}"


def test_contiguous_reserves_a_ring_per_sliding_group():
    c = Contiguous(config(reservation="oracle"))
    c.prefill(0, Prompt(100, final_tokens=120), np.zeros((100, 2, 4, 2, 8), np.float16))
    led = c.ledger()
    # Full group: a slab of the final length, 120; sliding: min(120, W) = 32 slots, holding
    # the last 32 positions.
    assert led.seq_blocks == {0: 120 + 32} and led.capacity_slots == 152
    assert led.token_states == 100 + 32
    assert led.reservation == (120 - 100) + 0  # the ring is full: min(32, 120) - 32
    assert led.bytes_in_use == 152 * 128


# --- hybrid prefix hits (SPEC §8) ----------------------------------------------------------

PROMPT = tuple(range(24))  # 6 blocks of 4
HB, HW = 4, 6  # windows of 6 positions over blocks of 4: a window covers 2 blocks


def hit_config(num_blocks) -> CacheConfig:
    model = dataclasses.replace(HYBRID, groups=F.hybrid_groups(4, (HW, None)))
    return CacheConfig(model=model, block_size=HB, num_blocks=num_blocks, prefix_caching=True)


def test_a_hit_needs_only_the_window_of_a_sliding_group():
    ids = {"token_ids": PROMPT}
    other = {"token_ids": tuple(range(100, 108))}
    t = trace(("p", 0, 24, ids), ("x", 0), ("p", 1, 8, other), ("p", 2, 24, ids))
    o = Oracle(hit_config(14))
    o.prefill(0, 24, "t", 24, 0, token_ids=PROMPT)
    # 12 blocks: sliding 0..5 are ids 0..5, full 0..5 are ids 6..11. At the end of the prefill
    # the sliding group keeps the blocks of [24 - 6 + 1, 24) = [19, 24): 4 and 5; blocks 0..3
    # go to the cached queue, tail first.
    assert o.block_state().cached == [3, 2, 1, 0]
    o.free(0)
    assert o.block_state().cached == [3, 2, 1, 0, 5, 4, 11, 10, 9, 8, 7, 6]
    # 2 blocks per group for an unrelated prompt: the 2 uncached ones (12, 13), then the two
    # oldest cached ones, the sliding blocks of positions 3 and 2.
    o.prefill(1, 8, "t", 8, 2, token_ids=other["token_ids"])
    assert o.block_state().tables[1] == [[12, 13], [3, 2]]
    # The prompt again: the full group has all 6 blocks cached, the sliding group only 0, 1,
    # 4, 5. L = 6 needs the sliding blocks of [24 - 5, 24) = 4, 5: cached. A hit of 6 + 2.
    o.prefill(2, 24, "t", 24, 3, token_ids=PROMPT)
    assert o.hit_blocks == 8
    assert o.seqs[2].tables == [[None] * 4 + [4, 5], [6, 7, 8, 9, 10, 11]]
    passes(t, hit_config(14), PAGED)


def test_a_sliding_group_without_its_window_takes_the_hit_to_zero():
    ids = {"token_ids": PROMPT}
    other = {"token_ids": tuple(range(100, 120))}
    o = Oracle(hit_config(14))
    o.prefill(0, 24, "t", 24, 0, token_ids=PROMPT)
    o.free(0)
    # 5 blocks per group: 12, 13, then the 8 oldest cached: every sliding block and the full
    # blocks of positions 5 and 4 (ids 11, 10). Its own window, [20 - 5, 20), then releases
    # its sliding positions 2, 1, 0 (ids 3, 13, 12) into the cached queue. The prompt's full
    # blocks 0..3 (ids 6..9) are cached, but no L > 0 has its sliding window cached: L = 4
    # would need sliding blocks 2, 3 ([11, 16)).
    o.prefill(1, 20, "t", 20, 2, token_ids=other["token_ids"])
    assert o.block_state().cached == [9, 8, 7, 6, 3, 13, 12]
    o.free(1)
    o.prefill(2, 24, "t", 24, 4, token_ids=PROMPT)
    assert o.hit_blocks == 0
    passes(trace(("p", 0, 24, ids), ("x", 0), ("p", 1, 20, other), ("x", 1), ("p", 2, 24, ids)),
           hit_config(14), PAGED)


@pytest.mark.parametrize("tokens", [4, 7, 8, 12, 15, 16, 23, 24])
def test_a_hit_returns_the_prefix_kv_at_every_length(tokens):
    # Every prefix length of the prompt, exact multiples of the block size included: the
    # gathered K/V after the hit are what the prompt's first prefill wrote.
    ids = {"token_ids": PROMPT}
    t = trace(("p", 0, 24, ids), ("p", 1, tokens, {"token_ids": PROMPT[:tokens]}), ("x", 0),
              ("p", 2, tokens, {"token_ids": PROMPT[:tokens]}))
    passes(t, hit_config(32), PAGED)
    o = Oracle(hit_config(32))
    for op in t.ops[:2]:
        o.prefill(op.seq, op.tokens, "t", op.tokens, op.step, token_ids=op.token_ids)
    full_blocks = tokens // 4
    window_blocks = full_blocks - F.first_held_block(full_blocks * 4, HW, 4) if full_blocks else 0
    assert o.hit_blocks == full_blocks + window_blocks


# --- isolation (SPEC §9) ---------------------------------------------------------------------

def test_extra_keys_are_tagged_and_salts_isolate():
    o = Oracle(hit_config(64))
    plain = o.prompt_keys(24, token_ids=PROMPT)
    salted = o.prompt_keys(24, token_ids=PROMPT, salt="x")
    adapter = o.prompt_keys(24, token_ids=PROMPT, adapter="x")
    assert len({plain[0], salted[0], adapter[0]}) == 3  # a salt "x" is no adapter "x"
    assert o.prompt_keys(24, token_ids=PROMPT, salt="x") == salted  # same salt, same keys
    hashed = o.prompt_keys(8, hashes=[11, 12])
    assert hashed == (11, 12)  # no extra keys: the trace's own hashes, as before
    assert o.prompt_keys(8, hashes=[11, 12], salt="x") == (((("salt", "x"),), 11), ((("salt", "x"),), 12))


@pytest.mark.parametrize("name", PAGED)
def test_same_salt_shares_other_salts_and_adapters_do_not(name):
    x_salt, x_adapter, y_salt = ({"token_ids": PROMPT, k: v} for k, v in
                                 (("salt", "x"), ("adapter", "x"), ("salt", "y")))
    t = trace(("p", 0, 24, x_salt), ("p", 1, 24, x_adapter), ("p", 2, 24, y_salt),
              ("p", 3, 24, {"token_ids": PROMPT}), ("p", 4, 24, x_salt))
    b = registry.create(name, hit_config(128))
    v = check(t, b, gather="all")
    assert v.valid is True, str(v.divergence)
    # Only sequence 4 shares: with 0 (salt "x"), all 6 full blocks and the 2 sliding ones.
    assert b.ledger().prefix_hit_blocks == 6 + 2


class UntaggedKeys(NumpyPaged):
    """vLLM 44701: the salt and the adapter name enter the block hash untagged."""

    def prefill(self, seq, prompt, kv=None, **kw):
        prompt = dataclasses.replace(prompt, salt=prompt.salt or prompt.adapter, adapter=None)
        return super().prefill(seq, prompt, kv, **kw)


def test_a_hit_across_salts_fails_naming_both_requests():
    t = trace(("p", 0, 24, {"token_ids": PROMPT, "adapter": "x"}),
              ("p", 1, 24, {"token_ids": PROMPT, "salt": "x"}))
    v = check(t, UntaggedKeys(hit_config(64)), gather="all")
    assert v.valid is False
    d = v.divergence
    # Sequence 0 holds 6 full + 2 sliding blocks; sequence 1 must take as many of its own
    # (16), not find them in the cache (8).
    assert (d.step, d.quantity, d.expected, d.actual) == (1, "blocks_used", 16, 8)
    assert ("a hit across salts: sequence 1 (salt 'x') may share no block with sequence 0 "
            "(adapter 'x'), which wrote the same prompt blocks") in d.detail


# --- a window released later, declared ---------------------------------------------------------

class NextAllocation(NumpyPaged):
    """vLLM's rule: a request's out-of-window blocks go at its next allocation, judged on its
    length before that operation."""

    capabilities = dataclasses.replace(NumpyPaged.capabilities,
                                       rule_params={"window_release": "next_allocation"})

    def _slide(self, rows, lengths):  # nothing at the end of an operation
        pass

    def append(self, seqs, tokens, kv=None, *, step=0):
        saved = copy.deepcopy(self.__dict__)
        rows = self._rows(seqs)
        NumpyPaged._slide(self, rows, self.tokens[rows])
        try:
            return super().append(seqs, tokens, kv, step=step)
        except OutOfMemory:
            self.__dict__.update(saved)  # the whole operation or nothing
            raise


class NextAllocationUndeclared(NextAllocation):
    capabilities = NumpyPaged.capabilities


class NeverReleases(NextAllocation):
    def append(self, seqs, tokens, kv=None, *, step=0):
        return NumpyPaged.append(self, seqs, tokens, kv, step=step)


WINDOW_TRACE = trace(("p", 0, 100), ("a", {0: 12}), ("a", {0: 1}), ("a", {0: 20}), ("x", 0))


def test_a_declared_later_release_is_held_to_its_rule():
    v = check(WINDOW_TRACE, NextAllocation(config()), gather="all")
    assert v.valid is True, str(v.divergence)
    o = Oracle(config(), capabilities=NextAllocation.capabilities)
    o.prefill(0, 100, "t", 100, 0)
    assert o.expected_ledger().group_blocks == (7, 7)  # nothing released until it allocates
    o.append([0], [12], 1)  # releases what lay below 100 - 31 = 69: blocks 0..3
    assert o.expected_ledger().group_blocks == (3, 7)


def test_a_later_release_undeclared_or_never_done_fails():
    v = check(WINDOW_TRACE, NextAllocationUndeclared(config()), gather="all")
    # The SPEC's rule: at the end of the prefill, 3 sliding + 7 full blocks; it holds 7 + 7.
    assert (v.divergence.step, v.divergence.quantity) == (0, "blocks_used")
    assert (v.divergence.expected, v.divergence.actual) == (10, 14)
    v = check(WINDOW_TRACE, NeverReleases(config()), gather="all")
    # Declared next_allocation: the append of step 1 must drop blocks 0..3 of the sliding group.
    assert (v.divergence.step, v.divergence.quantity) == (1, "blocks_used")
    assert (v.divergence.expected, v.divergence.actual) == (10, 14)


# --- SPEC §10: figures that agree --------------------------------------------------------------

def ledger(**kw) -> Ledger:
    base = dict(blocks_used=3, blocks_free=5, tokens={0: 40}, seq_blocks={0: 3}, capacity_slots=48,
                free_slots=8, fragmentation=8 / 48, bytes_in_use=0, shared_blocks=0, token_states=40,
                reservation=0, internal_fragmentation=8, external_fragmentation=0, free=80,
                token_capacity=128, block_usage=3 / 8, slot_usage=40 / 128)
    return Ledger(**{**base, **kw})


SMALL = CacheConfig(model=F.get_model("tiny"), block_size=16, num_blocks=8)


def test_ledger_identities():
    assert ledger_identities(ledger(), SMALL, paged=True) is None
    # used + free = total: 3 + 6 is not 8.
    assert ledger_identities(ledger(blocks_free=6), SMALL, True)[:3] == ("blocks_used + blocks_free", 8, 9)
    assert ledger_identities(ledger(blocks_used=-1, blocks_free=9), SMALL, True)[:3] == ("blocks_used", ">= 0", -1)
    # 6 evictable blocks cannot sit among 5 free ones (SGLang 35270).
    assert ledger_identities(ledger(cached_blocks=6), SMALL, True)[0] == "cached_blocks"
    # vLLM 51163: token capacity is num_blocks * block_size = 8 * 16 = 128.
    assert ledger_identities(ledger(token_capacity=64), SMALL, True)[:3] == ("token_capacity", 128, 64)
    # vLLM PR 57336: usage by slots is 40 / 128, not the 3 / 8 of blocks.
    assert ledger_identities(ledger(slot_usage=3 / 8), SMALL, True)[:3] == ("slot_usage", 40 / 128, 3 / 8)
    assert ledger_identities(ledger(group_blocks=(1, 1)), SMALL, True)[:3] == ("sum of group_blocks", 3, 2)


def state(**kw) -> BlockState:
    base = dict(free=[3, 4, 5, 6, 7], cached=[], tables={0: [[0, 1, 2]]}, refcount=[1, 1, 1, 0, 0, 0, 0, 0])
    return BlockState(**{**base, **kw})


def test_structure_identities():
    assert structure_identities(state(), ledger(), SMALL) is None
    # vLLM 42571: one block twice in the free structure.
    why = structure_identities(state(free=[3, 4, 5, 6, 7, 7]), ledger(blocks_free=6, blocks_used=2), SMALL)
    assert why[:3] == ("free blocks", "each block once", "block 7 2 times")
    why = structure_identities(state(free=[2, 4, 5, 6, 7]), ledger(), SMALL)
    assert why[:3] == ("block 2", "free or in use", "both")
    # A shared block: one reference per table that holds it.
    two = {0: [[0, 1, 2]], 1: [[0, 1, 2]]}
    assert structure_identities(state(tables=two, refcount=[2, 2, 1, 0, 0, 0, 0, 0]), ledger(), SMALL)[:3] == (
        "reference count of block 2", 2, 1)
    # ... checked only when every table is given: the tables of the sequences an operation
    # changed are held to a reference each.
    assert structure_identities(state(tables=two, refcount=[2, 2, 1, 0, 0, 0, 0, 0]), ledger(), SMALL,
                                whole=False) is None
    # evictable + protected + free = pool: block 3 is neither free nor in use.
    assert structure_identities(state(free=[4, 5, 6, 7]), ledger(blocks_free=4), SMALL)[:3] == (
        "evictable + protected + free", 8, 7)


# --- the trace format ---------------------------------------------------------------------------

def test_salt_adapter_token_ids_and_groups_round_trip():
    t = trace(("p", 0, 4, {"token_ids": (1, 2, 3, 4), "salt": "x", "adapter": "y"}),
              groups=("sliding(32)", "full"))
    again = loads(t.to_jsonl())
    assert again.ops == t.ops and again.header.groups == ("sliding(32)", "full")
    assert '"salt": "x", "adapter": "y"' in t.to_jsonl()


@pytest.mark.parametrize("line,reason", [
    ('{"step": 0, "op": "prefill", "seq": 0, "tenant": "a", "tokens": 2, "token_ids": [1]}',
     "'token_ids' must be a list of 2 ids"),
    ('{"step": 0, "op": "prefill", "seq": 0, "tenant": "a", "tokens": 1, "token_ids": [1], '
     '"block_hashes": [1]}', "either 'block_hashes' or 'token_ids'"),
    ('{"step": 0, "op": "prefill", "seq": 0, "tenant": "a", "tokens": 1, "salt": ""}',
     "'salt' must be a non-empty string"),
])
def test_bad_new_fields_are_refused_with_the_line(line, reason):
    with pytest.raises(TraceError, match=reason) as e:
        loads('{"kvbench_trace": 1, "family": "x"}\n' + line, "t.jsonl")
    assert e.value.line == 2


def test_bad_group_kind_in_the_header():
    with pytest.raises(TraceError, match="not a KV cache group kind: 'sliding'"):
        loads('{"kvbench_trace": 1, "family": "x", "groups": ["sliding"]}', "t.jsonl")


def test_header_groups_reshape_the_model():
    from kvbench.analyses.suite import config_for
    t = trace(("p", 0, 4), groups=("sliding(8)", "full"))
    cfg = config_for(t, model="tiny")
    assert [g.kind for g in cfg.model.kv_groups] == ["sliding(8)", "full"]
    assert cfg.model.kv_groups[0].layers == (0,)  # tiny: 2 layers, layer i in group i mod 2


# --- the capacity report (SPEC §8) ----------------------------------------------------------------

def test_capacity_against_hand_arithmetic():
    # Gemma 3 in 16 GiB, blocks of 16: a block of one group (8 layers) is
    # 16 * 2 * 8 * 8 * 256 * 2 = 1 MiB, so 16384 blocks; as full attention (48 layers) 6 MiB,
    # so 16384 // 6 = 2730 blocks.
    g3 = F.get_model("gemma-3-12b")
    blocks = F.budget_blocks("16GiB", 16, g3)
    assert blocks == 16384
    rows = {r["length"]: r for r in F.capacity(g3, blocks, 16, [4096, 32768])}
    # 4096 tokens: the full group 256 blocks, each of 5 sliding groups min(256, ceil(1023/16) + 1).
    assert rows[4096]["blocks_per_request"] == 256 + 5 * 65
    assert rows[4096]["max_concurrency"] == 28  # 28 = floor(16384 / 581)
    assert rows[4096]["full_max_concurrency"] == 10  # 10 = floor(2730 / 256)
    # 32768 tokens: 2048 + 5 * 65 = 2373 blocks.
    assert rows[32768]["max_concurrency"] == 6  # 6 = floor(16384 / 2373)
    assert rows[32768]["tokens_fit"] == 6 * 32768
    assert rows[32768]["full_max_concurrency"] == 1  # 1 = floor(2730 / 2048)
    # Gemma 2 in 16 GiB: blocks of 16 * 2 * 21 * 8 * 256 * 2 = 2,752,512 bytes: 6241 of them.
    g2 = F.get_model("gemma-2-9b")
    blocks = F.budget_blocks("16GiB", 16, g2)
    assert blocks == 6241  # floor(17179869184 / 2752512)
    row = F.capacity(g2, blocks, 16, [8192])[0]
    # 8 = floor(6241 / (ceil(8192/16) + ceil((4096-1)/16) + 1)) = floor(6241 / (512 + 257))
    assert row["max_concurrency"] == 8
    # 6 = floor((6241 // 2) / ceil(8192/16)) = floor(3120 / 512)
    assert row["full_max_concurrency"] == 6


def test_kvbench_run_prints_the_capacity_of_a_hybrid_model(tmp_path, capsys):
    from kvbench.analyses import suite
    from kvbench.cli import main
    path = suite.WORKLOADS_DIR / "hybrid-windows.jsonl"
    assert main(["run", "--quiet", "--backend", "numpy", "--output", str(tmp_path / "r.json"),
                 str(path)]) == 0
    out = capsys.readouterr().out
    blocks = suite.config_for(suite.load_traces([path])[0]).num_blocks
    assert f"Capacity of tiny-hybrid (sliding(32), full) in {blocks} blocks of 8" in out
    rows = out.split("Capacity of tiny-hybrid")[1].splitlines()[2:6]
    length, need, conc, fit, *full = map(int, rows[1].split())
    # 64 tokens in blocks of 8: the full group 8 blocks, the sliding one min(8, ceil(31/8) + 1).
    assert (length, need) == (64, 8 + 5)
    assert conc == blocks // 13 and fit == conc * 64
    # As full attention: blocks of both groups' layers, half as many; 8 per request.
    assert full == [8, blocks // 2 // 8, blocks // 2 // 8 * 64]


def test_a_fork_served_through_the_prefix_cache_on_a_hybrid_model():
    # An engine that serves a fork as a new request (vLLM): the child finds the parent's full
    # blocks, cached under keys every group shares at a position, in both groups.
    from kvbench.contract.protocol import Capabilities
    o = Oracle(config(prefix_caching=True), capabilities=Capabilities(
        rule_params={"fork_via": "prefix", "caches_every_full_block": True}, groups=True))
    o.prefill(0, 40, "t", 64, step=0)  # per group 3 blocks, 2 of them full; (40 - 31) // 16 = 0
    o.fork(1, 0, 64, step=1)
    led = o.expected_ledger()
    # The hit: L = 2 full blocks; the sliding group needs [32 - 31, 32) = blocks 0 and 1: cached.
    # Each group computes its tail (40 - 32 = 8 tokens) again: 6 + 2 blocks, 2 * 2 shared.
    assert (led.blocks_used, led.shared_blocks, led.prefix_hit_blocks) == (8, 4, 0)
    o.append([1], [24], step=2)
    # 64 tokens: the tail fills, one new block per group; the child's window starts at
    # (64 - 31) // 16 = 2: it drops blocks 0 and 1 of its sliding group, which the parent holds.
    assert o.expected_ledger().group_blocks == (3 + 2, 3 + 2)
    assert o.seqs[1].tables[0][:2] == [None, None]


def test_a_fork_through_the_prefix_cache_names_the_blocks_a_window_released():
    # A model of sliding groups only (Mistral-7B v0.1's kind): the parent's blocks below its
    # window are no longer held by any group, yet still cached; the child's hit needs only the
    # blocks of the window below it, so it must look them up by the keys they had.
    from kvbench.contract.protocol import Capabilities
    model = F.ModelSpec("sliding-only", layers=2, kv_heads=2, head_dim=8,
                        groups=F.hybrid_groups(2, (5,)))
    o = Oracle(CacheConfig(model=model, block_size=4, num_blocks=16, prefix_caching=True),
               capabilities=Capabilities(rule_params={
                   "fork_via": "prefix", "caches_every_full_block": True,
                   "window_release": "next_allocation"}, groups=True))
    o.prefill(0, 8, "t", 32, step=0)
    o.append([0], [8], step=1)  # 16 tokens; released on 8: (8 - 5 + 1) // 4 = 1 block
    o.append([0], [1], step=2)  # 17 tokens; released on 16: (16 - 4) // 4 = 3 blocks
    assert o.seqs[0].tables[0][:3] == [None, None, None]
    o.fork(1, 0, 32, step=3)
    led = o.expected_ledger()
    # The child's hit: 17 // 4 = 4 blocks, of which the window [16 - 5 + 1, 16) needs block
    # 12 // 4 = 3 only (held by the parent); it computes its 1-token tail: 2 + 1 blocks in use.
    assert (led.blocks_used, led.shared_blocks) == (2 + 1, 1)
    assert o.seqs[1].tables[0][3] == o.seqs[0].tables[0][3]
