"""The trace operations (SPEC sections 6 and 13), as immutable values, and the one registry of
them: ``OPS`` maps each operation's name (its ``"op"`` in a trace) to its class. kvbench.traces.format
re-exports them; they live apart so that the columnar form (columns.py) can make them too.

A new operation is a class here with ``kind`` and ``FIELDS`` (its trace fields, in the order a
trace writes them), added to ``OPS``; format.py parses it with ``parse_<kind>`` and checks its
history with ``_Validator.<kind>``; a replay drives it with ``Driver.<kind>``
(kvbench/checking/driver.py; transfers: kvbench.checking.tier_replay).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Union


@dataclass(frozen=True)
class PromptOp:
    """A prompt's fields: a prefill's, and a lookup's of the prompt it will load."""

    step: int
    seq: int
    tenant: str
    tokens: int
    block_hashes: tuple | None = None
    salt: str | None = None  # the tenant's cache salt (SPEC §9)
    adapter: str | None = None  # the LoRA adapter the prompt runs under
    token_ids: tuple | None = None  # the prompt's token ids (instead of block_hashes)
    # Chunked prefill (SPEC §13): the whole prompt's length, when this writes only its first
    # chunk of ``tokens``; block_hashes / token_ids then cover the whole prompt.
    prompt_tokens: int | None = None
    FIELDS = ("seq", "tenant", "tokens", "block_hashes", "token_ids", "salt", "adapter",
              "prompt_tokens")


@dataclass(frozen=True)
class Prefill(PromptOp):
    kind = "prefill"


@dataclass(frozen=True)
class Append:
    """One decode step over a batch: seqs[i] gains tokens[i] tokens; of them the last
    draft[i] are speculative (SPEC §13), kept or rolled back by a later accept."""

    step: int
    seqs: tuple
    tokens: tuple
    draft: tuple | None = None
    kind = "append"
    FIELDS = ("seqs", "tokens", "draft")


@dataclass(frozen=True)
class Fork:
    step: int
    seq: int
    src: int
    kind = "fork"
    FIELDS = ("seq", "src")


@dataclass(frozen=True)
class Free:
    step: int
    seq: int
    kind = "free"
    FIELDS = ("seq",)


@dataclass(frozen=True)
class Accept:
    """Keep the first ``n`` of the draft tokens the sequence's last append wrote; the rest are
    rolled back (SPEC §13)."""

    step: int
    seq: int
    n: int
    kind = "accept"
    FIELDS = ("seq", "n")


PREEMPT_MODES = ("recompute", "swap")


@dataclass(frozen=True)
class Preempt:
    """Take a sequence off the cache until its resume: ``recompute`` frees it (its resume
    prefills every token again), ``swap`` moves every block of it to lower tier ``tier`` (None:
    tier 1) and frees them, its resume moving them back (SPEC §11, §13)."""

    step: int
    seq: int
    mode: str = "recompute"
    tier: str | None = None
    kind = "preempt"
    FIELDS = ("seq", "mode", "tier")


@dataclass(frozen=True)
class Resume:
    step: int
    seq: int
    kind = "resume"
    FIELDS = ("seq",)


# SPEC §11: transfers between the device and the lower tiers the header names. Each begins
# (``store``, ``load``) and completes (``done``); ``abort`` frees a sequence whose load is in flight.


@dataclass(frozen=True)
class Store:
    """Begin copying full blocks of a sequence down to ``tier`` (``blocks``: their positions;
    None: every full block)."""

    step: int
    id: int
    seq: int
    tier: str
    blocks: tuple | None = None
    kind = "store"
    FIELDS = ("id", "seq", "tier", "blocks")


@dataclass(frozen=True)
class Load(Prefill):
    """A prefill served from the lower tiers after the device's own hit; complete at ``done``."""

    id: int = -1
    kind = "load"
    FIELDS = Prefill.FIELDS + ("id",)


@dataclass(frozen=True)
class Lookup(PromptOp):
    """A request's lookup of the lower tiers before its load (LMCache's ``lookup``, SGLang's
    match): the tiers pin each stored entry of the run a load of this prompt would read, until
    the load of ``seq`` completes or ``seq`` is aborted before its load. A prefill's fields; not
    a prefill (it makes no sequence: the load does)."""

    kind = "lookup"


@dataclass(frozen=True)
class Done:
    """The completion of transfer ``id``: ``ok`` false for a failure."""

    step: int
    id: int
    ok: bool = True
    kind = "done"
    FIELDS = ("id", "ok")


@dataclass(frozen=True)
class Abort(Free):
    """A free that cancels the sequence's loads in flight (its stores still complete)."""

    kind = "abort"


TIER_OPS = (Store, Load, Done, Abort, Lookup)
Op = Union[Prefill, Append, Fork, Free, Accept, Preempt, Resume, Store, Load, Done, Abort, Lookup]
OPS = {cls.kind: cls for cls in (Prefill, Append, Fork, Free, Accept, Preempt, Resume, *TIER_OPS)}


def op_to_dict(op) -> dict:
    """An operation as its trace line: step, op, then its fields (tuples as lists, an unset
    optional field left out)."""
    d = {"step": op.step, "op": op.kind}
    for name in op.FIELDS:
        v = getattr(op, name)
        if v is not None:
            d[name] = list(v) if isinstance(v, tuple) else v
    return d


def final_lengths(ops: Iterable) -> dict:
    """Each sequence's length when it is freed or the trace ends; for one whose drafts were
    rolled back, the longest it was (what a slab must hold, what its tail's slots served)."""
    length, final, drafted, peak = {}, {}, {}, {}
    for op in ops:
        kind = op.kind
        if kind in ("prefill", "load"):
            length[op.seq] = op.tokens
        elif kind == "append":
            for i, (s, t) in enumerate(zip(op.seqs, op.tokens)):
                length[s] += t
                if op.draft is not None:
                    drafted[s] = op.draft[i]
        elif kind == "fork":
            length[op.seq] = length[op.src]
        elif kind == "accept":
            peak[op.seq] = max(peak.get(op.seq, 0), length[op.seq])
            length[op.seq] -= drafted.pop(op.seq) - op.n
        elif kind in ("free", "abort") and op.seq in length:  # else a looked-up request's
            final[op.seq] = length.pop(op.seq)
    final.update(length)
    for s, longest in peak.items():
        final[s] = max(final[s], longest)
    return final
