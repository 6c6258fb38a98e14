"""Traces as columns: a trace's operations held in NumPy arrays, a few dozen bytes per operation
instead of an object (and a tuple per batch) each, read back as the ops of
:mod:`kvbench.traces.format` one at a time, when asked for.

Columns: ``kind`` (prefill, append, fork, free), ``step``, ``seq`` (-1 for an append), ``src``
(-1 but for a fork), ``tokens`` (a prefill's), ``tenant`` (an index into ``tenants``, -1 but for a
prefill); a batched append's sequences and token counts in two flat arrays, ``batch[i]`` ..
``batch[i+1]`` being operation i's slice (empty for the other kinds); block hashes, rare and of
any JSON type, in a dict by operation index, and so a prefill's salt, adapter and token ids.
An operation the columns do not hold (a scheduler lifecycle's, SPEC §13: accept, preempt,
resume, an append with drafts, a chunked prefill) is kept whole in ``side``, by operation index,
its kind in ``kind``; a trace with any of them is checked and measured op by op (such traces are
small), the columnar fast paths being for the four plain operations.

:func:`first_invalid` checks a history with array operations: the same rules as the scalar
``_Validator`` of format.py (which names the error, and which a test holds this one to).
"""
from __future__ import annotations

import numpy as np

from kvbench.traces.ops import OPS, Append, Fork, Free, Prefill, final_lengths

KINDS = tuple(OPS)  # the kind column's codes: prefill, append, fork, free, then the rest
PREFILL, APPEND, FORK, FREE = range(4)
_CHUNK = 1 << 16  # operations converted from Python lists to arrays (or back) at a time
_CHUNK_MEMBERS = 1 << 16  # and batch members: the lists of a chunk stay a few MB
# The builder's columns: kind, step, seq, src, tokens, tenant, batch sizes, members' seqs and
# tokens. They start as int32 (half of int64's bytes) and a column is widened to WIDE by the first
# chunk holding a value beyond int32's range, so that any id, step or count the format allows loads.
COLUMN_DTYPES = (np.int8, np.int32, np.int32, np.int32, np.int32, np.int32, np.int32, np.int32, np.int32)
WIDE = np.int64


class TableBuilder:
    """Collects operations column by column (from op objects or from parsed JSON fields)."""

    def __init__(self):
        self.columns = [np.empty(0, dtype) for dtype in COLUMN_DTYPES]
        self.tenants: list = []
        self.tenant_index: dict = {}
        self.hashes: dict = {}
        self.keys: dict = {}  # operation index -> (salt, adapter, token_ids) of a prefill
        self.side: dict = {}  # operation index -> an operation the columns do not hold
        self.n = 0
        self._reset()

    def _reset(self):
        self.kind, self.step, self.seq, self.src, self.tokens, self.tenant = [], [], [], [], [], []
        self.nbatch, self.flat_seq, self.flat_tok = [], [], []

    def _tenant(self, name: str) -> int:
        i = self.tenant_index.get(name)
        if i is None:
            i = self.tenant_index[name] = len(self.tenants)
            self.tenants.append(name)
        return i

    def row(self, kind: int, step: int, seq: int = -1, src: int = -1, tokens: int = 0,
            tenant: str | None = None, seqs=(), toks=(), hashes=None) -> None:
        self.kind.append(kind)
        self.step.append(step)
        self.seq.append(seq)
        self.src.append(src)
        self.tokens.append(tokens)
        self.tenant.append(-1 if tenant is None else self._tenant(tenant))
        self.nbatch.append(len(seqs))
        if seqs:
            self.flat_seq.extend(seqs)
            self.flat_tok.extend(toks)
        if hashes is not None:
            self.hashes[self.n] = tuple(hashes)
        self.n += 1
        if len(self.kind) >= _CHUNK or len(self.flat_seq) >= _CHUNK_MEMBERS:
            self._flush()

    def add(self, op) -> None:
        if op.kind not in KINDS[:4]:
            self.side[self.n] = op
            if not isinstance(op, (Prefill, Free)):  # a load and an abort: a prefill's and a free's row
                self.row(KINDS.index(op.kind), op.step, getattr(op, "seq", -1))
                return
        if getattr(op, "draft", None) is not None or getattr(op, "prompt_tokens", None) is not None:
            self.side[self.n] = op  # and its plain columns below, for the counts and tenants
        if isinstance(op, Prefill):
            if op.salt is not None or op.adapter is not None or op.token_ids is not None:
                self.keys[self.n] = (op.salt, op.adapter, op.token_ids)
            self.row(PREFILL, op.step, op.seq, tokens=op.tokens, tenant=op.tenant, hashes=op.block_hashes)
        elif isinstance(op, Append):
            if len(op.seqs) != len(op.tokens):
                raise ValueError(f"append at step {op.step} has {len(op.seqs)} seqs but "
                                 f"{len(op.tokens)} token counts")
            self.row(APPEND, op.step, seqs=op.seqs, toks=op.tokens)
        elif isinstance(op, Fork):
            self.row(FORK, op.step, op.seq, src=op.src)
        else:
            self.row(FREE, op.step, op.seq)

    def _flush(self):
        """Append the rows collected in lists to the columns, each grown in place (realloc: a
        large array's pages are remapped, not copied), so that loading holds the columns and
        one chunk of lists. Chunks copied into place at the end held the columns twice: the
        freed chunks stayed in the C heap, and the load's peak RSS was 2.1x the columns."""
        if not self.kind:
            return
        for k, values in enumerate((self.kind, self.step, self.seq, self.src, self.tokens,
                                    self.tenant, self.nbatch, self.flat_seq, self.flat_tok)):
            col = self.columns[k]
            at = len(col)
            col.resize(at + len(values), refcheck=False)  # the builder holds the only reference
            try:
                col[at:] = values
            except OverflowError:  # a value beyond int32: this column is WIDE from now on
                if col.dtype == WIDE:
                    raise
                col = self.columns[k] = col.astype(WIDE)
                col[at:] = values
        self._reset()

    def table(self) -> OpTable:
        self._flush()
        kind, step, seq, src, tokens, tenant, nbatch, flat_seq, flat_tok = self.columns
        self.columns = [np.empty(0, dtype) for dtype in COLUMN_DTYPES]  # the table's own now
        batch = np.zeros(len(kind) + 1, np.int64)
        np.cumsum(nbatch, out=batch[1:])
        return OpTable(kind, step, seq, src, tokens, tenant, list(self.tenants), batch, flat_seq,
                       flat_tok, dict(self.hashes), dict(self.keys), dict(self.side))


class OpTable:
    """A trace's operations as columns; a read-only sequence of op objects made on access."""

    def __init__(self, kind, step, seq, src, tokens, tenant, tenants, batch, flat_seq, flat_tok, hashes,
                 keys=None, side=None):
        self.kind, self.step, self.seq, self.src = kind, step, seq, src
        self.tokens, self.tenant, self.tenants = tokens, tenant, tenants
        self.batch, self.flat_seq, self.flat_tok, self.hashes = batch, flat_seq, flat_tok, hashes
        self.keys = keys or {}  # a prefill's salt, adapter and token ids, by operation index
        self.side = side or {}  # operations the columns do not hold, whole, by operation index

    @classmethod
    def from_ops(cls, ops) -> OpTable:
        b = TableBuilder()
        for op in ops:
            b.add(op)
        return b.table()

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.kind, self.step, self.seq, self.src, self.tokens,
                                      self.tenant, self.batch, self.flat_seq, self.flat_tok))

    def __len__(self) -> int:
        return len(self.kind)

    def _op(self, i, kind, step, seq, src, tokens, tenant, b0, b1, fs, ft):
        if self.side and i in self.side:
            return self.side[i]
        if kind == APPEND:
            return Append(step, tuple(fs[b0:b1]), tuple(ft[b0:b1]))
        if kind == PREFILL:
            return Prefill(step, seq, self.tenants[tenant], tokens, self.hashes.get(i),
                           *self.keys.get(i, ()))
        if kind == FORK:
            return Fork(step, seq, src)
        return Free(step, seq)

    def __iter__(self):
        for lo, hi in op_chunks(self, _CHUNK_MEMBERS, _CHUNK):
            cols = [a[lo:hi].tolist() for a in (self.kind, self.step, self.seq, self.src, self.tokens,
                                                self.tenant)]
            b = self.batch[lo:hi + 1]
            fs = self.flat_seq[b[0]:b[-1]].tolist()
            ft = self.flat_tok[b[0]:b[-1]].tolist()
            b = (b - b[0]).tolist()
            for j, (kind, step, seq, src, tokens, tenant) in enumerate(zip(*cols)):
                yield self._op(lo + j, kind, step, seq, src, tokens, tenant, b[j], b[j + 1], fs, ft)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"operation {i} of {len(self)}")
        b0, b1 = int(self.batch[i]), int(self.batch[i + 1])
        return self._op(i, int(self.kind[i]), int(self.step[i]), int(self.seq[i]), int(self.src[i]),
                        int(self.tokens[i]), int(self.tenant[i]), 0, b1 - b0,
                        self.flat_seq[b0:b1].tolist(), self.flat_tok[b0:b1].tolist())

    def __eq__(self, other) -> bool:
        if isinstance(other, (OpTable, list, tuple)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    def __repr__(self) -> str:
        return f"OpTable({len(self)} operations, {self.nbytes} bytes)"

    def count(self, kind: str) -> int:
        return int(np.count_nonzero(self.kind == KINDS.index(kind)))

    # --- what the trace knows, from the columns ---------------------------------------------

    def creators(self):
        """(sequence ids, the operation creating each) for prefills and forks, in op order."""
        made = np.flatnonzero((self.kind == PREFILL) | (self.kind == FORK))
        return self.seq[made], made

    def final_lengths(self) -> dict:
        """Each sequence's length when it is freed or the trace ends (valid histories only)."""
        if self.side:
            return final_lengths(self)
        ids, made = self.creators()
        order = np.argsort(ids, kind="stable")
        sid = ids[order]
        length = np.where(self.kind[made] == PREFILL, self.tokens[made], 0)[order].astype(np.int64)

        def add(lo, hi):  # the appends of members lo..hi, a chunk at a time
            for a in range(lo, hi, VALIDATE_CHUNK_MEMBERS):
                b = min(hi, a + VALIDATE_CHUNK_MEMBERS)
                np.add.at(length, np.searchsorted(sid, self.flat_seq[a:b]), self.flat_tok[a:b])

        done = 0  # members added so far, in op order: a child starts at its source's length
        forks = np.flatnonzero(self.kind == FORK)
        for f, s, c in zip(self.batch[forks].tolist(), np.searchsorted(sid, self.src[forks]).tolist(),
                           np.searchsorted(sid, self.seq[forks]).tolist()):
            add(done, f)
            done = f
            length[c] = length[s]
        add(done, len(self.flat_seq))
        return dict(zip(sid.tolist(), length.tolist()))

    def tenant_of(self) -> dict:
        ids, made = self.creators()
        tenant = {}
        for s, i in zip(ids.tolist(), made.tolist()):
            tenant[s] = (self.tenants[self.tenant[i]] if self.kind[i] == PREFILL
                         else tenant[int(self.src[i])])
        return tenant


def first_invalid(t: OpTable) -> int | None:
    """The first operation that breaks the history rules (format's parse_op field ranges and
    _Validator's), or None: steps strictly increase; ids >= 0, lengths >= 0, a non-empty
    tenant; an append batch naming a sequence twice; a sequence created twice; append, fork
    (from) or free of a sequence that is not live (unknown, or freed).

    Arrays of one entry per sequence are made whole (each one's creation and first free); the
    operations and their batch members are checked a chunk at a time (VALIDATE_CHUNK_OPS,
    VALIDATE_CHUNK_MEMBERS), in order, up to the first chunk with an error: validating costs a
    few MB of temporaries whatever the trace's length."""
    n = len(t)
    if n == 0:
        return None
    if t.side:  # lifecycle operations: only the scalar rules (format._Validator) know them
        return 0
    ids, made = t.creators()
    order = np.argsort(ids, kind="stable")
    sid, smade = ids[order], made[order]
    again = sid[1:] == sid[:-1]
    created_twice = int(smade[1:][again].min()) if again.any() else n
    first = np.ones(len(sid), bool)
    first[1:] = ~again
    uniq, born = sid[first], smade[first]
    frees = np.flatnonzero(t.kind == FREE)
    freed_at = np.full(len(uniq), n, np.int64)  # the first free of each sequence
    fi = np.searchsorted(uniq, t.seq[frees])
    ok = fi < len(uniq)
    ok[ok] = uniq[fi[ok]] == t.seq[frees][ok]
    np.minimum.at(freed_at, fi[ok], frees[ok])
    lives = (uniq, born, freed_at)
    empty = [i for i, name in enumerate(t.tenants) if not isinstance(name, str) or not name]
    for a, b in op_chunks(t, VALIDATE_CHUNK_MEMBERS, VALIDATE_CHUNK_OPS):
        if a >= created_twice:
            break
        bad = _first_bad_in(t, a, b, lives, empty)
        if bad is not None:
            return min(bad, created_twice)
    return created_twice if created_twice < n else None


def _first_bad_in(t: OpTable, a: int, b: int, lives, empty: list) -> int | None:
    """The first of operations a..b that breaks a rule (a field, the step order, a batch, a
    sequence not live), given each sequence's creation and first free (``lives``)."""
    kind, step, seq, src = t.kind[a:b], t.step[a:b], t.seq[a:b], t.src[a:b]
    nb = np.diff(t.batch[a:b + 1])
    fields = ((step < 0) | ((kind != APPEND) & (seq < 0)) | ((kind == PREFILL) & (t.tokens[a:b] < 0))
              | ((kind == FORK) & (src < 0)) | ((kind == APPEND) & (nb == 0)))
    fields[1:] |= step[1:] <= step[:-1]  # steps strictly increase, from the chunk before too
    if a:
        fields[0] |= step[0] <= t.step[a - 1]
    if empty:
        fields |= (kind == PREFILL) & np.isin(t.tenant[a:b], empty)
    lo, hi = int(t.batch[a]), int(t.batch[b])
    seqs, toks = t.flat_seq[lo:hi], t.flat_tok[lo:hi]
    op_of = np.repeat(np.arange(b - a), nb)  # each member's operation, from a
    fields[op_of[(seqs < 0) | (toks < 0)]] = True
    order = np.lexsort((seqs, op_of))
    twice = (op_of[order][1:] == op_of[order][:-1]) & (seqs[order][1:] == seqs[order][:-1])
    fields[op_of[order][1:][twice]] = True
    # every (operation, sequence) that needs a live sequence: append members, fork sources, frees
    forks, frees = np.flatnonzero(kind == FORK), np.flatnonzero(kind == FREE)
    dead = _first_dead(lives, a + np.concatenate([op_of, forks, frees]),
                       np.concatenate([seqs, src[forks], seq[frees]]),
                       np.arange(len(op_of) + len(forks) + len(frees)) >= len(op_of) + len(forks))
    bad = [d for d in (dead, a + int(np.argmax(fields)) if fields.any() else None) if d is not None]
    return min(bad) if bad else None


def _first_dead(lives, use_op, use_seq, is_free) -> int | None:
    """The first (operation, sequence) whose sequence is not live there (a free: the operation
    that ends it may be its first free)."""
    uniq, born, freed_at = lives
    k = np.searchsorted(uniq, use_seq)
    known = k < len(uniq)
    known[known] = uniq[k[known]] == use_seq[known]
    k = np.where(known, k, 0)
    live = known
    if len(uniq):
        live &= (born[k] < use_op) & ((freed_at[k] > use_op) | (is_free & (freed_at[k] == use_op)))
    return int(use_op[~live].min()) if not live.all() else None


VALIDATE_CHUNK_MEMBERS = 1 << 18  # batch members validated at a time (about 10 MB of temporaries)
VALIDATE_CHUNK_OPS = 1 << 18  # and operations


def op_chunks(t: OpTable, members: int, ops: int | None = None):
    """(first op, end op) of consecutive chunks of whole operations holding at most ``members``
    batch members (and ``ops`` operations) each, but at least one operation, however wide."""
    n = len(t)
    a = 0
    while a < n:
        b = int(np.searchsorted(t.batch, t.batch[a] + members, side="right")) - 1
        b = min(max(b, a + 1), n, a + ops if ops else n)
        yield a, b
        a = b
