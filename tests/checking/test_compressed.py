"""SPEC §12's compressed(r) groups in the oracle, the NumPy pool that runs them
(impls/numpy_compressed.py) and the checker: the boundary workloads pass, an entry reads back
the K/V of its first token, and vLLM-Ascend #10296 (lookup keyed by B, store by B * r) FAILs
where a hit of B * r tokens is due."""
from __future__ import annotations

import numpy as np
import pytest

from impls.faults import CompressedKeysAtBlockSize
from impls.numpy_compressed import NumpyCompressed
from kvbench.analyses import suite
from kvbench.checking.checker import check
from kvbench.contract import formulas as F
from kvbench.contract.protocol import CacheConfig, Prompt, kv_tokens
from kvbench.traces import boundaries as bd

MODEL = F.get_model("tiny-compressed")  # layer 0 full, layer 1 compressed(4)
TRACES = {t.name: t for t in bd.COMPRESSED.build(bd.COMPRESSED.cases())}


def config(trace) -> CacheConfig:
    s = trace.header.settings
    return CacheConfig(model=F.get_model(s["model"]), block_size=s["block_size"],
                       num_blocks=s["num_blocks"], prefix_caching=s["prefix_caching"])


@pytest.mark.parametrize("name", sorted(TRACES))
def test_the_pool_passes_the_compressed_boundaries_with_every_check(name):
    v = check(TRACES[name], NumpyCompressed(config(TRACES[name])), gather="all")
    assert v.valid is True, v.divergence
    assert v.skipped == {}  # block ids, content and events all checked


def test_an_entry_reads_back_its_first_tokens_kv_at_each_of_its_positions():
    b = NumpyCompressed(CacheConfig(model=MODEL, block_size=4, num_blocks=16))
    kv = kv_tokens(np.full(6, 7), np.arange(6), MODEL)
    b.prefill(0, Prompt(6), kv)
    got = b.gather(0)
    assert np.array_equal(got[:, :, [0]], kv[:, :, [0]])  # the full layer: each token's own
    # the compressed layer: positions 0..3 entry 0 (token 0's), 4..5 entry 1 (token 4's)
    assert np.array_equal(got[:, :, [1]], kv[[0, 0, 0, 0, 4, 4]][:, :, [1]])


class EntryOfLastToken(NumpyCompressed):
    """Writes each appended token into its entry: the entry keeps its last token's K/V."""

    def _append(self, seqs, tokens, kv, step):
        starts = [int(self.tokens[self.row_of[s]]) for s in seqs]
        victims = super()._append(seqs, tokens, kv, step)
        row = 0
        for s, T, dt in zip(seqs, starts, tokens):
            r = self.row_of[s]
            for q in range(T, T + dt):
                e = q // 4
                slot = self.tables[1][r, e // self.B] * self.B + e % self.B
                self._write_group(1, np.array([slot]), kv[row:row + 1])
                row += 1
        return victims


def test_an_entry_holding_its_last_token_fails_the_content_check():
    t = TRACES["boundary-compressed-1"]  # the first case: 15 tokens, then an append of 1
    d = check(t, EntryOfLastToken(config(t)), gather="all").divergence
    # step 2 appends token 15 to A: entry 3 (tokens 12..15) was written with token 12
    assert d.step == 2 and "written with token 12" in d.detail


def test_a_lookup_keyed_by_b_misses_the_compressed_block_a_hit_of_b_times_r_needs():
    t = TRACES["boundary-compressed-0"]
    assert str(t.header.params["cases"][1]["T"]) == "S" and t.ops[14].kind == "prefill"
    assert check(t, NumpyCompressed(config(t))).valid is True
    d = check(t, CompressedKeysAtBlockSize(config(t))).divergence
    # step 14: a request of 17 tokens sharing A's first 16 = B * r. Held before it: A's 17
    # tokens, 5 full + 2 compressed blocks, and its fork's own 1 full + 1 compressed: 9. Its
    # hit of 16 tokens takes 4 full + 1 compressed cached blocks and 1 + 1 new: 9 + 2 = 11.
    # Looked up by B-block 0's key, the compressed block is missed: no hit, 5 + 2 new: 16.
    assert (d.step, d.quantity, d.expected, d.actual) == (14, "blocks_used", 11, 16)


def test_the_default_run_checks_the_compressed_boundaries_on_the_pool_alone():
    names = {t.name for t in suite.default_traces()}
    assert set(TRACES) <= names
    row = suite.run_one(TRACES["boundary-compressed-0"], "numpy", config(TRACES["boundary-compressed-0"]))
    assert row["status"] == "n/a" and "does not run compressed groups" in row["not_applicable"]
    row = suite.run_one(TRACES["boundary-compressed-0"], "numpy-compressed",
                        config(TRACES["boundary-compressed-0"]))
    assert row["status"] == "pass"
