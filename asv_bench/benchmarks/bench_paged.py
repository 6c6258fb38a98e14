"""Timings of the paged cache's calls: prefill, one decode step over a batch, fork, free, gather.

Each timed call sees a freshly built backend (``number = 1``: setup runs before every call), so a
decode step always extends the same batch and a prefill always finds the same free pool.
"""
import numpy as np

from . import common
from .common import (
    BLOCK_SIZE,
    DECODE_BATCHES,
    GATHER_TOKENS,
    LONG_SEQUENCE,
    PAGED,
    PREFILL_TOKENS,
)


class _Call:
    version = "1"
    number = 1
    repeat = (3, 20, 10.0)  # (min samples, max samples, max seconds)
    def teardown(self, *params):
        common.close(self)


class Prefill(_Call):
    """One prefill of a new sequence into an empty pool (its K/V written)."""
    params = [PAGED, PREFILL_TOKENS]
    param_names = ["backend", "tokens"]

    def setup(self, name, tokens):
        self.backend = common.make_backend(name, num_blocks=-(-tokens // BLOCK_SIZE))
        self.kv = common.zeros_kv(tokens)
        self.prompt, self.keywords = common.prompt_call(tokens, final_tokens=tokens)

    def time_prefill(self, name, tokens):
        self.backend.prefill(0, self.prompt, self.kv, **self.keywords)
        common.sync(self.backend)


class DecodeStep(_Call):
    """One decode step: every sequence of the batch gains one token (K/V written)."""
    params = [PAGED, DECODE_BATCHES]
    param_names = ["backend", "batch"]
    store_kv = True

    def setup(self, name, batch):
        self.backend, self.seqs = common.decode_batch(name, batch, store_kv=self.store_kv)
        self.ones = [1] * batch
        self.kv = common.zeros_kv(batch) if self.store_kv else None

    def time_decode_step(self, name, batch):
        self.backend.append(self.seqs, self.ones, self.kv, step=1)
        common.sync(self.backend)


class DecodeStepLedger(DecodeStep):
    """The same decode step with store_kv=False: block bookkeeping only (the object model too)."""
    store_kv = False


class _LongSequence(_Call):
    """A pool holding one sequence of LONG_SEQUENCE tokens (64 blocks), ledger only."""
    params = [PAGED]
    param_names = ["backend"]

    def setup(self, name):
        self.backend = common.make_backend(name, num_blocks=LONG_SEQUENCE // BLOCK_SIZE,
                                           store_kv=False)
        common.prefill(self.backend, 0, LONG_SEQUENCE, None, final_tokens=LONG_SEQUENCE)


class Fork(_LongSequence):
    """Fork of the long sequence: shares its 64 blocks, copies the table."""

    def time_fork(self, name):
        self.backend.fork(1, 0, final_tokens=LONG_SEQUENCE)
        common.sync(self.backend)


class Free(_LongSequence):
    """Free of the long sequence: 64 blocks back to the pool."""

    def time_free(self, name):
        self.backend.free(0)
        common.sync(self.backend)


class Gather(_Call):
    """Gather of one sequence's K/V (``tokens`` tokens, 1 KiB each) into a NumPy array."""
    params = [PAGED, GATHER_TOKENS]
    param_names = ["backend", "tokens"]
    number = 0  # gather changes nothing: no fresh state needed between calls

    def setup(self, name, tokens):
        self.backend = common.interleaved_pair(name, tokens)

    def time_gather(self, name, tokens):
        np.asarray(self.backend.gather(0))


class CopySameBytes:
    """The floor for Gather: np.copy of the same bytes (a contiguous array of ``tokens`` tokens)."""
    version = "1"
    params = [GATHER_TOKENS]
    param_names = ["tokens"]

    def setup(self, tokens):
        self.src = common.zeros_kv(tokens) + np.float16(1)

    def time_copy(self, tokens):
        np.copy(self.src)
