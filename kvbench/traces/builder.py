"""Building a trace operation by operation (consecutive steps, fresh sequence ids), and what a
built trace demands of a cache: the shared machinery of the generator families."""
from __future__ import annotations

import json

from kvbench.contract.formulas import blocks_needed
from kvbench.traces.format import Append, Fork, Free, Header, Prefill, Trace, validate
from kvbench.traces.laws import normalize_law

GENERATOR_VERSION = 1
DEFAULT_TENANT = "default"


def _recorded(args: dict) -> dict:
    """A generator's arguments as its header records them (JSON types, laws expanded)."""
    params = {k: (normalize_law(v) if k == "law" else v) for k, v in args.items() if k != "seed"}
    return json.loads(json.dumps(params))


class _Builder:
    """Emits ops with consecutive steps and fresh sequence ids; tracks live lengths."""

    def __init__(self):
        self.ops: list = []
        self.length: dict = {}
        self.next_seq = 0

    def prefill(self, tokens: int, tenant: str = DEFAULT_TENANT, block_hashes=None, *,
                salt=None, adapter=None, token_ids=None) -> int:
        seq, self.next_seq = self.next_seq, self.next_seq + 1
        self.ops.append(Prefill(len(self.ops), seq, tenant, int(tokens),
                                tuple(block_hashes) if block_hashes else None, salt, adapter,
                                None if token_ids is None else tuple(int(t) for t in token_ids)))
        self.length[seq] = int(tokens)
        return seq

    def append(self, seqs, tokens) -> None:
        seqs = [int(s) for s in seqs]
        tokens = [int(t) for t in tokens]
        if min(tokens) < 1:
            raise AssertionError(f"generator bug: append of {tokens} tokens at step {len(self.ops)}")
        self.ops.append(Append(len(self.ops), tuple(seqs), tuple(tokens)))
        for s, t in zip(seqs, tokens):
            self.length[s] += t

    def fork(self, src: int) -> int:
        seq, self.next_seq = self.next_seq, self.next_seq + 1
        self.ops.append(Fork(len(self.ops), seq, int(src)))
        self.length[seq] = self.length[src]
        return seq

    def free(self, seq: int) -> None:
        self.ops.append(Free(len(self.ops), int(seq)))
        del self.length[seq]

    def trace(self, family: str, params: dict, seed: int, name: str, **header) -> Trace:
        h = Header(family=family, generator=f"kvbench.generators.{family} v{GENERATOR_VERSION}",
                   params=params, seed=seed, **header)
        return validate(Trace(h, self.ops, name=name))


def _walk(ops):
    """Yield (op, lengths of the live sequences after it, the sequences it wrote or created)."""
    length = {}
    for op in ops:
        if isinstance(op, Prefill):
            length[op.seq] = op.tokens
            touched = (op.seq,)
        elif isinstance(op, Append):
            for s, t in zip(op.seqs, op.tokens):
                length[s] += t
            touched = op.seqs
        elif isinstance(op, Fork):
            length[op.seq] = length[op.src]
            touched = (op.seq,)
        else:
            del length[op.seq]
            touched = ()
        yield op, length, touched


def peak_blocks(ops, block_size: int) -> int:
    """max over time of sum over live sequences of ceil(T / B): an upper bound (sharing ignored)."""
    blocks, total, peak = {}, 0, 0
    for op, length, touched in _walk(ops):
        if isinstance(op, Free):
            total -= blocks.pop(op.seq)
        for s in touched:
            new = blocks_needed(length[s], block_size)
            total += new - blocks.get(s, 0)
            blocks[s] = new
        peak = max(peak, total)
    return peak


def op_demand(ops, block_size: int) -> int:
    """max over operations of the blocks held by the sequences one operation writes, after it.

    Under eviction these must fit in the budget at once (a served sequence is never a victim).
    """
    return max((sum(blocks_needed(length[s], block_size) for s in touched)
                for _, length, touched in _walk(ops)), default=0)
