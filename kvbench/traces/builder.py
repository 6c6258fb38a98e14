"""Building a trace operation by operation (consecutive steps, fresh sequence ids), and what a
built trace demands of a cache: the shared machinery of the generator families."""
from __future__ import annotations

import json

from kvbench.contract.formulas import blocks_needed
from kvbench.traces.format import (Accept, Append, Fork, Free, Header, Preempt, Prefill, Resume, Trace,
                                   validate)
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
                salt=None, adapter=None, token_ids=None, prompt_tokens=None) -> int:
        seq, self.next_seq = self.next_seq, self.next_seq + 1
        self.ops.append(Prefill(len(self.ops), seq, tenant, int(tokens),
                                tuple(block_hashes) if block_hashes else None, salt, adapter,
                                None if token_ids is None else tuple(int(t) for t in token_ids),
                                None if prompt_tokens is None else int(prompt_tokens)))
        self.length[seq] = int(tokens)
        return seq

    def append(self, seqs, tokens, draft=None) -> None:
        seqs = [int(s) for s in seqs]
        tokens = [int(t) for t in tokens]
        if min(tokens) < 0:  # 0: a member writing nothing this step (SPEC §13)
            raise AssertionError(f"generator bug: append of {tokens} tokens at step {len(self.ops)}")
        self.ops.append(Append(len(self.ops), tuple(seqs), tuple(tokens),
                               None if draft is None else tuple(int(d) for d in draft)))
        for s, t in zip(seqs, tokens):
            self.length[s] += t

    def accept(self, seq: int, drafted: int, n: int) -> None:
        """Keep ``n`` of the ``drafted`` draft tokens of ``seq``'s last append."""
        self.ops.append(Accept(len(self.ops), int(seq), int(n)))
        self.length[seq] -= drafted - n

    def preempt(self, seq: int, mode: str = "recompute") -> None:
        self.ops.append(Preempt(len(self.ops), int(seq), mode))

    def resume(self, seq: int) -> None:
        self.ops.append(Resume(len(self.ops), int(seq)))

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
    """Yield (op, lengths of the live sequences after it, the sequences it wrote or created); a
    preempted sequence holds nothing until its resume."""
    length, drafted, off = {}, {}, {}
    for op in ops:
        touched = ()
        if op.kind in ("store", "done", "lookup"):  # transfers (SPEC §11) change no sequence's length
            pass
        elif op.kind == "accept":
            length[op.seq] -= drafted.pop(op.seq) - op.n
            touched = (op.seq,)
        elif op.kind == "preempt":
            off[op.seq] = length.pop(op.seq)
        elif op.kind == "resume":
            length[op.seq] = off.pop(op.seq)
            touched = (op.seq,)
        elif isinstance(op, Free) and op.seq in off:
            del off[op.seq]
        elif isinstance(op, Prefill):
            length[op.seq] = op.tokens
            touched = (op.seq,)
        elif isinstance(op, Append):
            for i, (s, t) in enumerate(zip(op.seqs, op.tokens)):
                length[s] += t
                if op.draft:
                    drafted[s] = op.draft[i]
            touched = op.seqs
        elif isinstance(op, Fork):
            length[op.seq] = length[op.src]
            touched = (op.seq,)
        else:  # a free or abort (of a request only looked up: nothing held)
            length.pop(op.seq, None)
            touched = ()
        yield op, length, touched


def peak_blocks(ops, block_size: int) -> int:
    """max over time of sum over live sequences of ceil(T / B): an upper bound (sharing ignored)."""
    blocks, total, peak = {}, 0, 0
    for op, length, touched in _walk(ops):
        if op.kind in ("free", "abort", "preempt"):
            total -= blocks.pop(op.seq, 0)
        for s in touched:
            new = blocks_needed(length[s], block_size)
            total += new - blocks.get(s, 0)
            blocks[s] = new
        peak = max(peak, total)
    return peak


def tier_blocks(ops, block_size: int, first: str | None = None) -> dict:
    """Per tier, the most blocks the trace's stores and swaps (SPEC §11, §13) can put into it: the
    blocks each names (a store's positions, else its sequence's full blocks then; a swap's every
    block, into ``first`` where it names no tier), summed, as if none were skipped, refused,
    evicted or taken back."""
    out: dict = {}
    last: dict = {}  # each sequence's length after its last write (a swap takes it off)
    for op, length, touched in _walk(ops):
        for s in touched:
            last[s] = length[s]
        if op.kind == "store":
            n = len(op.blocks) if op.blocks is not None else length.get(op.seq, 0) // block_size
        elif op.kind == "preempt" and op.mode == "swap":
            n = blocks_needed(last.get(op.seq, 0), block_size)
        else:
            continue
        tier = op.tier or first
        out[tier] = out.get(tier, 0) + n
    return out


def op_demand(ops, block_size: int) -> int:
    """max over operations of the blocks held by the sequences one operation writes, after it.

    Under eviction these must fit in the budget at once (a served sequence is never a victim).
    """
    return max((sum(blocks_needed(length[s], block_size) for s in touched)
                for _, length, touched in _walk(ops)), default=0)
