"""Edits that keep a trace legal: the moves a shrinker makes (kvbench/search/shrink.py).

Every edit takes a list of operations and returns a new one; none changes an operation in place.
They are generic over the operation dataclasses' fields, so a field added to the format later
(a salt, token ids) is carried along untouched, and dropped or cut together with what it
describes:

- a sequence is named by the fields ``seq``, ``src`` (ints) and ``seqs`` (an append's batch);
- in an append, every tuple field as long as ``seqs`` holds one entry per batch member;
- a per-token field (a tuple as long as the operation's token count: token ids) is cut with the
  count; a per-block field (``block_hashes``, the prompt's full blocks) keeps ``tokens // B``.

An edit keeps the history consistent by construction (a dropped sequence takes its forks and
every operation on them along), and the caller still validates the result with
:func:`kvbench.traces.format.validate`.
"""
from __future__ import annotations

import dataclasses

from kvbench.traces.format import Append, Fork, Free, Prefill, final_lengths
from kvbench.traces.ops import Accept, Done, Load, Lookup, Store

SEQ_FIELDS = ("seq", "src", "seqs")
PER_BLOCK_FIELDS = ("block_hashes",)


def sequences_of(op) -> tuple:
    """Every sequence id an operation names."""
    out = []
    for name in SEQ_FIELDS:
        v = getattr(op, name, None)
        if isinstance(v, tuple):
            out.extend(v)
        elif v is not None:
            out.append(v)
    return tuple(out)


def sequences(ops) -> list:
    """Sequence ids in order of first appearance (a lookup, a prefill or a fork)."""
    return list(dict.fromkeys(op.seq for op in ops if isinstance(op, (Lookup, Prefill, Fork))))


def with_forks(ops, seqs) -> set:
    """``seqs`` and every sequence forked from them, directly or through other forks."""
    closed = set(seqs)
    for op in ops:
        if isinstance(op, Fork) and op.src in closed:
            closed.add(op.seq)
    return closed


def ancestors(ops, seqs) -> set:
    """``seqs`` and the sequences they were forked from, up to their roots."""
    parent = {op.seq: op.src for op in ops if isinstance(op, Fork)}
    out = set()
    for s in seqs:
        while s is not None and s not in out:
            out.add(s)
            s = parent.get(s)
    return out


def _batch_fields(op) -> list:
    """An append's per-member fields: tuples as long as its batch."""
    n = len(op.seqs)
    return [f.name for f in dataclasses.fields(op)
            if isinstance(getattr(op, f.name), tuple) and len(getattr(op, f.name)) == n]


def _keep_members(op, keep: list):
    """The append restricted to the batch positions ``keep`` (None when none is left)."""
    if not keep:
        return None
    if len(keep) == len(op.seqs):
        return op
    return dataclasses.replace(op, **{name: tuple(getattr(op, name)[i] for i in keep)
                                      for name in _batch_fields(op)})


def drop_sequences(ops, drop) -> list:
    """Without the sequences ``drop``, their forks, and every operation on any of them."""
    gone = with_forks(ops, drop)
    owner = _transfer_owners(ops)
    out = []
    for op in ops:
        if isinstance(op, Append):
            op = _keep_members(op, [i for i, s in enumerate(op.seqs) if s not in gone])
        elif isinstance(op, Done):
            op = None if owner.get(op.id) in gone else op
        elif op.seq in gone:
            op = None
        if op is not None:
            out.append(op)
    return out


def _transfer_owners(ops) -> dict:
    """Transfer id -> the sequence its store or load names (SPEC §11)."""
    return {op.id: op.seq for op in ops if isinstance(op, (Store, Load))}


def members(ops) -> list:
    """The droppable units below whole sequences: each append member, each free, each store
    (with its completion), each completion and each lookup, named ``(step, seq)`` (a
    completion's seq is None; steps are unique, so a name survives other units being dropped)."""
    out = []
    for op in ops:
        if isinstance(op, Append):
            out.extend((op.step, s) for s in op.seqs)
        elif isinstance(op, (Free, Store, Lookup)):
            out.append((op.step, op.seq))
        elif isinstance(op, Done):
            out.append((op.step, None))
    return out


def drop_members(ops, units) -> list:
    """Without the append members, frees, stores, completions and lookups ``units`` (``(step, seq)``);
    an append left with no member goes, a store takes its completion along and a member that
    wrote drafts its accept. A sequence whose
    free is dropped lives to the end of the trace; a transfer whose completion is dropped stays
    in flight."""
    units = set(units)
    stores = {op.id for op in ops if isinstance(op, Store) and (op.step, op.seq) in units}
    undrafted = set()  # sequences whose dropped member wrote drafts: their accept goes too
    out = []
    for op in ops:
        if isinstance(op, Append):
            undrafted.update(s for i, s in enumerate(op.seqs)
                             if (op.step, s) in units and op.draft and op.draft[i])
            op = _keep_members(op, [i for i, s in enumerate(op.seqs) if (op.step, s) not in units])
        elif isinstance(op, Accept) and op.seq in undrafted:
            undrafted.discard(op.seq)
            op = None
        elif isinstance(op, Done) and ((op.step, None) in units or op.id in stores):
            op = None
        elif isinstance(op, (Free, Store, Lookup)) and (op.step, op.seq) in units:
            op = None
        if op is not None:
            out.append(op)
    return out


def live_lengths(ops) -> dict:
    """The length of every sequence still live after the last operation."""
    freed = {op.seq for op in ops if isinstance(op, Free)}
    return {s: n for s, n in final_lengths(ops).items() if s not in freed}


def token_counts(ops) -> list:
    """Every token count of the trace as ``((step, seq), tokens)``: prefills and append members."""
    out = []
    for op in ops:
        if isinstance(op, Prefill):
            out.append(((op.step, op.seq), op.tokens))
        elif isinstance(op, Append):
            out.extend(((op.step, s), t) for s, t in zip(op.seqs, op.tokens))
    return out


def _cut(value, old: int, new: int):
    """A per-token value (a sequence as long as the old count) cut to the new count."""
    if isinstance(value, (tuple, list)) and len(value) == old:
        return type(value)(value[:new])
    return value


def set_tokens(ops, unit, tokens: int, block_size: int) -> list:
    """The trace with the token count of ``unit`` (``(step, seq)``) set to ``tokens`` (>= 1),
    its per-token fields cut and its per-block fields kept to the full blocks left."""
    step, seq = unit
    out = []
    for op in ops:
        if op.step == step and isinstance(op, Prefill) and op.seq == seq:
            changes = {"tokens": tokens}
            for f in dataclasses.fields(op):
                v = getattr(op, f.name)
                if f.name in PER_BLOCK_FIELDS and v is not None:
                    changes[f.name] = tuple(v[:tokens // block_size])
                elif f.name not in changes:
                    cut = _cut(v, op.tokens, tokens)
                    if cut is not v:
                        changes[f.name] = cut
            op = dataclasses.replace(op, **changes)
        elif op.step == step and isinstance(op, Append) and seq in op.seqs:
            i = op.seqs.index(seq)
            old = op.tokens[i]
            changes = {}
            for name in _batch_fields(op):
                if name in ("seqs", "tokens"):
                    continue
                v = list(getattr(op, name))
                v[i] = _cut(v[i], old, tokens)
                changes[name] = tuple(v)
            changes["tokens"] = op.tokens[:i] + (tokens,) + op.tokens[i + 1:]
            op = dataclasses.replace(op, **changes)
        out.append(op)
    return out


def _join(a, b, tokens_a: int, tokens_b: int):
    """Two values of one field for the same sequence, joined: per-token ones concatenated, equal
    ones kept; None when they cannot be joined."""
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)) \
            and len(a) == tokens_a and len(b) == tokens_b:
        return type(a)(a) + type(a)(b)
    return a if a == b else None


def merge_appends(ops, i: int) -> list | None:
    """Appends ``i`` and ``i + 1`` (adjacent) as one, at the first one's step: the batch of both,
    a sequence in both gaining the tokens of both. None when they are not two appends or a
    per-member field cannot be joined."""
    if i + 1 >= len(ops) or not (isinstance(ops[i], Append) and isinstance(ops[i + 1], Append)):
        return None
    a, b = ops[i], ops[i + 1]
    names = [n for n in _batch_fields(a) if n in _batch_fields(b)]
    if set(names) != set(_batch_fields(a)) or set(names) != set(_batch_fields(b)):
        return None
    merged = {n: list(getattr(a, n)) for n in names}
    for j, s in enumerate(b.seqs):
        if s not in a.seqs:
            for n in names:
                merged[n].append(getattr(b, n)[j])
            continue
        k = a.seqs.index(s)
        for n in names:
            if n == "seqs":
                continue
            if n == "tokens":
                merged[n][k] = a.tokens[k] + b.tokens[j]
                continue
            joined = _join(getattr(a, n)[k], getattr(b, n)[j], a.tokens[k], b.tokens[j])
            if joined is None:
                return None
            merged[n][k] = joined
    op = dataclasses.replace(a, **{n: tuple(v) for n, v in merged.items()})
    return list(ops[:i]) + [op] + list(ops[i + 2:])


def fold_into_prefill(ops, seq) -> list | None:
    """The first operation on ``seq`` after its prefill, when it is an append, folded into the
    prefill (its tokens written with the prompt). Per-token fields are joined; per-block fields
    keep the blocks they named. None when the next operation on ``seq`` is not an append."""
    start = next((i for i, op in enumerate(ops) if isinstance(op, Prefill) and op.seq == seq), None)
    if start is None:
        return None
    nxt = next((i for i in range(start + 1, len(ops)) if seq in sequences_of(ops[i])), None)
    if nxt is None or not isinstance(ops[nxt], Append):
        return None
    pre, app = ops[start], ops[nxt]
    j = app.seqs.index(seq)
    extra = app.tokens[j]
    changes = {"tokens": pre.tokens + extra}
    per_member = {n: getattr(app, n)[j] for n in _batch_fields(app) if n not in ("seqs", "tokens")}
    for f in dataclasses.fields(pre):
        v = getattr(pre, f.name)
        if f.name in changes or f.name in PER_BLOCK_FIELDS:
            continue
        if f.name in per_member:
            joined = _join(v, per_member.pop(f.name), pre.tokens, extra)
            if joined is None:
                return None
            changes[f.name] = joined
        elif isinstance(v, (tuple, list)) and len(v) == pre.tokens:
            return None  # a per-token field the append does not carry
    if per_member:
        return None  # the append carries something the prefill has no field for
    out = list(ops)
    out[start] = dataclasses.replace(pre, **changes)
    out[nxt] = _keep_members(app, [i for i in range(len(app.seqs)) if i != j])
    return [op for op in out if op is not None]


def renumber(ops, *, steps: bool = True, seqs: bool = True) -> list:
    """Steps 0, 1, 2, ... and sequence ids 0, 1, 2, ... in order of first appearance."""
    ids = {s: i for i, s in enumerate(sequences(ops))}
    out = []
    for step, op in enumerate(ops):
        changes = {"step": step} if steps else {}
        for name in SEQ_FIELDS if seqs else ():
            v = getattr(op, name, None)
            if isinstance(v, tuple):
                changes[name] = tuple(ids[s] for s in v)
            elif v is not None:
                changes[name] = ids[v]
        out.append(dataclasses.replace(op, **changes))
    return out


def tenants_used(ops) -> list:
    return sorted({op.tenant for op in ops if isinstance(op, Prefill)})


def dense_tenant_names(names) -> dict:
    """Short names that sort as ``names`` do (so ties broken on the tenant id still break the
    same way): a, b, c, ... then t00, t01, ..."""
    names = sorted(names)
    if len(names) <= 26:
        short = [chr(ord("a") + i) for i in range(len(names))]
    else:
        width = len(str(len(names) - 1))
        short = [f"t{i:0{width}d}" for i in range(len(names))]
    return dict(zip(names, short))


def rename_tenants(ops, names: dict) -> list:
    return [dataclasses.replace(op, tenant=names[op.tenant]) if isinstance(op, Prefill) else op
            for op in ops]


__all__ = ["sequences_of", "sequences", "with_forks", "ancestors", "drop_sequences", "members",
           "drop_members", "live_lengths", "token_counts", "set_tokens", "merge_appends",
           "fold_into_prefill", "renumber", "tenants_used",
           "dense_tenant_names", "rename_tenants"]
