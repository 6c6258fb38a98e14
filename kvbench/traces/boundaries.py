"""Boundary workloads of the default run, generated from each rule's parameters (SPEC §13
"Boundaries"): a rule declares its parameters and their edge values, relative to the block size
(``Edge(a, c)`` is ``a * B + c``); a covering design picks a few cases in which every edge value
of every parameter, and every combination of values of the parameters it names as interacting,
occurs; the rule builds its traces from those cases. A rule added later gets its edges by
declaring them.

The rules, and the edges each covers:

- ``windows`` (§8, §12): a model of four groups, sinks(S, W_s), sliding(W), chunked(C) and full,
  with S, W_s, W and C each in {1, B - 1, B, B + 1, 2B + 1} (or 2B), at B in {4, 8}: one-token
  steps over every length up to 3B + 2, a fork, multi-token steps, prefix hits at and past
  multiples of B.
- ``rollback`` (§13): a speculative append of k drafts, k in {1, B - 1, B, B + 1, 2B + 1}, and an
  accept keeping 0, some or all of them, ending mid-block, on a block edge, inside block 0 or on
  its edge, on a block the sequence holds alone, shares with a fork, or shares through the prefix
  cache; then a write after it.
- ``chunks`` (§13): a prompt of P in {3B, 3B + 1} tokens written in chunks cut at B - 1, B, B + 1
  and at 2B - 1, 2B, 2B + 1 (the second cut by an append), and a request for the same prompt
  after the first chunk, after the second, or once the prompt is complete.
- ``chains`` (§9): prompts by token ids whose block at position p in {1, 2} repeats the ids of
  another prompt's block after a different prefix, whole or with a partial block after it.
- ``hybrid-eviction`` (§5, §8): a tenant mix on a sliding-window model (every policy runs it):
  a decode step of w in {1, 2, 9} sequences, of 1 or B tokens each, right before a prefill that
  must evict, so the victim depends on what that step recorded.
- ``tiers`` (§11, §13): a load in flight while another prompt is stored into the full tier it
  reads (the tier's eviction must skip the blocks being read), while a second load reads the same
  blocks, until its abort, or until it fails, in a tier that keeps or drops what a failed load
  read (then the same prompt loaded again, and a store that fails); a store of no full block into
  a tier of no room; a swap into a tier with exactly, and one less than, the room it needs; the
  load looked up first (its pins, SPEC §11's failure paths), salted or not, or a lookup aborted
  before any load.
- ``encodings`` (§12): the fp8 (per tensor), fp8 per token-head and NVFP4 tiny models.
- ``returns`` (§12): a prompt A on a Mamba hybrid (tiny-mamba: three state groups and a full
  one), then a prompt that extends A by e in {1, B, B + 1} tokens (all of A, or A less its last
  token), then A again: A of P in {3B - 1, 3B, 3B + 1} tokens, so A's return ends on, before and
  past the extension's junction (vLLM issue 50630: the state cached at the junction is one
  block above A's own, and a lookup that looks one block too far takes it).
- ``zero`` (§13): an operation of zero tokens: an empty prompt, an append of 0 tokens (alone or
  as one member of a batch), a fork of the empty sequence, and the first append filling a block
  of it, with and without prefix caching.
- ``compressed`` (§12): tiny-compressed (full beside compressed(4), S = B * r = 16 tokens a
  compressed block): prompts of T in {S - 1, S, S + 1, 2S - 1, 2S, 2S + 1}, a fork, appends
  across an entry's first token and a block's last, drafts rolled back, requests sharing S - 1,
  S or S + B tokens, and every cached block evicted by a prompt of the whole pool.

Every trace is a pure function of the rules (no seed is drawn), named ``boundary-<rule>-<i>``; the
default run generates them at run time (:func:`boundary_traces`), after the committed workloads.
Over 500 lines: one builder per rule beside the covering design they share; each is read against
the rule's paragraph above.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Callable

from kvbench.traces.builder import _Builder
from kvbench.traces.format import Header, Trace, validate
from kvbench.traces.ops import Preempt
from kvbench.traces.tier_ops import Abort, Done, Load, Lookup, Store, TierSpec

GENERATOR = "kvbench.traces.boundaries v1"


@dataclass(frozen=True)
class Edge:
    """The value ``a * B + c`` of a parameter at block size B."""

    a: int
    c: int = 0

    def __call__(self, B: int) -> int:
        return self.a * B + self.c

    def __str__(self) -> str:
        if not self.a:
            return str(self.c)
        lead = "B" if self.a == 1 else f"{self.a}B"
        return lead + (f"{self.c:+d}" if self.c else "")


@dataclass(frozen=True)
class Rule:
    """A rule's parameters (name -> its edge values), the tuples of them whose values interact
    (every combination of their values occurs in some case), which cases can be built
    (``valid``), and ``build``: the rule's traces from its cases."""

    name: str
    spec: str
    params: dict
    build: Callable
    interactions: tuple = ()
    valid: Callable = field(default=lambda case: True)

    def cases(self) -> list[dict]:
        return cover(self.params, self.interactions, self.valid)


def cover(params: dict, interactions=(), valid=lambda case: True) -> list[dict]:
    """A covering design: cases (one value per parameter) in which every value of every parameter
    occurs, and every combination of values of each named tuple of parameters (a pair: pairwise),
    among the valid cases (what no valid case holds is not asked for). Greedy: each case the
    valid one that covers the most not yet covered, the first in product order on ties."""
    names = list(params)
    everything = [dict(zip(names, values)) for values in itertools.product(*params.values())]
    candidates = [c for c in everything if valid(c)]

    def covers(case) -> set:
        got = {((p, case[p]),) for p in names}
        return got | {tuple((p, case[p]) for p in together) for together in interactions}

    wanted = set().union(*(covers(c) for c in candidates)) if candidates else set()
    chosen = []
    while wanted:
        best = max(candidates, key=lambda c: len(covers(c) & wanted))
        chosen.append(best)
        wanted -= covers(best)
    return chosen


class _Ops(_Builder):
    """The builder with transfers (SPEC §11): loads, stores, completions, aborts."""

    next_id = 0

    def _tid(self) -> int:
        self.next_id += 1
        return self.next_id - 1

    def lookup(self, tokens: int, token_ids, tenant: str = "default", salt=None) -> int:
        """A lookup for a request not made yet: its sequence id, for its load or abort."""
        seq = self.next_seq
        self.next_seq += 1
        self.ops.append(Lookup(len(self.ops), seq, tenant, int(tokens), None, salt, None,
                               tuple(int(t) for t in token_ids), None))
        return seq

    def load(self, tokens: int, token_ids, tenant: str = "default", *, salt=None,
             seq=None) -> tuple[int, int]:
        """A load (``seq``: of a looked-up request; None: a new one)."""
        tid = self._tid()
        if seq is None:
            seq, self.next_seq = self.next_seq, self.next_seq + 1
        self.ops.append(Load(len(self.ops), seq, tenant, int(tokens), None, salt, None,
                             tuple(int(t) for t in token_ids), None, id=tid))
        self.length[seq] = int(tokens)
        return seq, tid

    def store(self, seq: int, tier: str, blocks=None) -> int:
        tid = self._tid()
        self.ops.append(Store(len(self.ops), tid, seq, tier, None if blocks is None else tuple(blocks)))
        return tid

    def done(self, tid: int, ok: bool = True) -> None:
        self.ops.append(Done(len(self.ops), tid, ok))

    def abort(self, seq: int) -> None:
        self.ops.append(Abort(len(self.ops), seq))
        self.length.pop(seq, None)  # a looked-up request has none

    def free_all(self) -> None:
        for s in sorted(self.length):
            self.free(s)


def _ids(case_index: int, n: int, start: int = 0) -> list:
    """Token ids of a case's prompt: distinct between cases (no hit across them)."""
    base = 1000 * (case_index + 1)
    return list(range(base + start, base + start + n))


def _trace(rule: str, index: int, b: _Builder, cases: list, settings: dict, **header) -> Trace:
    params = {"rule": rule, "cases": [{k: str(v) for k, v in c.items()} for c in cases]}
    h = Header(family="boundary", generator=GENERATOR, params=params, seed=0,
               settings=settings, **header)
    return validate(Trace(h, b.ops, name=f"boundary-{rule}-{index}"))


# --- the rules ------------------------------------------------------------------------------

EDGES = (Edge(0, 1), Edge(1, -1), Edge(1), Edge(1, 1), Edge(2, 1))


def _windows(cases) -> list[Trace]:
    """One trace a case: tiny-hybrid's 4 layers as [sinks(S, W_s), sliding(W), chunked(C), full]."""
    out = []
    for i, c in enumerate(cases):
        B = c["B"]
        S, Ws, W, C = (c[k](B) for k in ("S", "W_s", "W", "C"))
        groups = (f"sinks({S},{Ws})", f"sliding({W})", f"chunked({C})", "full")
        b = _Ops()
        top = 3 * B + 2  # past 2B + 1, the largest edge, by more than a block
        prompt = _ids(i, top)
        a = b.prefill(1, token_ids=prompt[:1])
        for _ in range(top - 1):  # every length 2 .. 3B + 2, one token at a time
            b.append([a], [1])
        a2 = b.fork(a)
        b.append([a2, a], [B + 1, 2 * B])  # multi-token steps across blocks, from a shared tail
        for n in (B, B + 1, 2 * B, 2 * B + 1, 3 * B):  # hits at and past multiples of B
            s = b.prefill(n, token_ids=prompt[:n])
            b.append([s], [1])
        b.free_all()
        again = b.prefill(3 * B + 1, token_ids=prompt[:3 * B + 1])  # hits what was cached at the frees
        b.append([again], [B])
        b.free_all()
        out.append(_trace("windows", i, b, [c], {"model": "tiny-hybrid", "block_size": B,
                                                  "num_blocks": 64, "prefix_caching": True},
                          groups=groups))
    return out


WINDOWS = Rule("windows", "§8, §12", {
    "B": (4, 8), "S": EDGES, "W_s": EDGES[:4] + (Edge(2),), "W": EDGES, "C": EDGES}, _windows)


ENDS = {"mid": Edge(2, 1), "edge": Edge(2), "block0": Edge(0, 1), "edge0": Edge(1)}
ROLLBACK_B = 4


def _kept(c) -> int:
    k = c["k"](ROLLBACK_B)
    return {"none": 0, "some": k // 2, "all": k}[c["n"]]


def _rollback_valid(c) -> bool:
    """The sequence holds at least one token before its drafts: end - n >= 1."""
    return ENDS[c["end"]](ROLLBACK_B) - _kept(c) >= 1 and (c["n"] != "some" or c["k"](ROLLBACK_B) > 1)


def _rollback(cases) -> list[Trace]:
    """One trace: per case, a sequence of ``end - n`` tokens (shared with a fork or, by the same
    token ids, with a request that hit it), k drafts, an accept of n; then one token by each."""
    B = ROLLBACK_B
    b = _Ops()
    for i, c in enumerate(cases):
        k, n = c["k"](B), _kept(c)
        before = ENDS[c["end"]](B) - n
        ids = _ids(i, before)
        s = b.prefill(before, token_ids=ids)
        other = None
        if c["shared"] == "fork":
            other = b.fork(s)
        elif c["shared"] == "cache":
            other, s = s, b.prefill(before, token_ids=ids)  # hits s's full blocks
        b.append([s], [k], [k])
        b.accept(s, k, n)
        b.append([s], [1])
        if other is not None:
            b.append([other], [1])
        b.free_all()
    return [_trace("rollback", 0, b, cases, {"block_size": B, "num_blocks": 64, "prefix_caching": True})]


ROLLBACK = Rule("rollback", "§13", {
    "end": tuple(ENDS), "shared": ("none", "fork", "cache"), "k": EDGES, "n": ("none", "some", "all")},
    _rollback, interactions=(("end", "shared", "n"), ("end", "k"), ("shared", "k")),
    valid=_rollback_valid)


CHUNKS_B = 4


def _chunks(cases) -> list[Trace]:
    """One trace: per case, a prompt of P tokens written as a prefill of c1 tokens, an append up
    to c2, then the rest; a request for the whole prompt arrives after one of the three parts (the
    first to ask for it besides the writer), and may hit only the blocks complete by then."""
    B = CHUNKS_B
    b = _Ops()
    for i, c in enumerate(cases):
        P, c1, c2 = c["P"](B), c["cut1"](B), c["cut2"](B)
        ids = _ids(i, P)
        a = b.prefill(c1, token_ids=ids, prompt_tokens=P)
        for part, more in (("prefill", c2 - c1), ("append", P - c2), ("complete", 1)):
            if c["hit"] == part:
                b.append([b.prefill(P, token_ids=ids)], [1])
            b.append([a], [more])
        b.free_all()
    return [_trace("chunks", 0, b, cases, {"block_size": B, "num_blocks": 96, "prefix_caching": True})]


CHUNKS = Rule("chunks", "§13", {
    "P": (Edge(3), Edge(3, 1)), "cut1": (Edge(1, -1), Edge(1), Edge(1, 1)),
    "cut2": (Edge(2, -1), Edge(2), Edge(2, 1)), "hit": ("prefill", "append", "complete")},
    _chunks, interactions=(("cut1", "cut2"), ("cut1", "hit"), ("cut2", "hit")))


CHAINS_B = 4


def _chains(cases) -> list[Trace]:
    """One trace: per case, a prompt X, then a prompt whose block p repeats X's block p after a
    different prefix (no hit but on blocks before p that match: none), then X again (every block)."""
    B = CHAINS_B
    b = _Ops()
    for i, c in enumerate(cases):
        p, tail = c["p"], c["tail"](B)
        n = (p + 1) * B + tail
        x = _ids(i, n)
        y = _ids(i, p * B, start=500) + x[p * B:]  # another prefix, then X's blocks from p on
        first = b.prefill(n, token_ids=x)
        b.free(first)  # cached, free: a wrong hit would take them back
        b.prefill(n, token_ids=y)
        b.prefill(n, token_ids=x)
        b.free_all()
    return [_trace("chains", 0, b, cases, {"block_size": B, "num_blocks": 64, "prefix_caching": True})]


CHAINS = Rule("chains", "§9", {"p": (1, 2), "tail": (Edge(0), Edge(0, 1))}, _chains,
              interactions=(("p", "tail"),))


HYBRID_B = 8


def _hybrid_eviction(cases) -> list[Trace]:
    """One trace a case, on tiny-hybrid (sliding(32), full) under two tenants: w sequences of one
    block, then z; a decode step of the w (d tokens each); a prefill of every free block plus
    one: the victim is the least recent, z, unless the step's access went unrecorded."""
    B = HYBRID_B
    out = []
    for i, c in enumerate(cases):
        w, d = c["w"], c["d"](B)
        b = _Ops()
        tenants = ("fg", "bg")
        wide = [b.prefill(B - d if d < B else 1, tenants[j % 2]) for j in range(w)]
        z = b.prefill(1, "bg")
        b.append([z], [1])
        b.append(wide, [d] * w)
        # ceil(T / B) blocks in each of the 2 groups (the window of 32 holds all of them); z, 2
        # tokens, holds 1 a group. 4 blocks left free; r takes 3 a group (2B + 1 tokens), 6:
        # evicting z, the least recent, gives exactly the 2 missing.
        held = sum(2 * -(-b.length[s] // B) for s in wide) + 2 * 1
        N = held + 4
        r = b.prefill(2 * B + 1, "fg")
        b.append([r], [1])
        b.free_all()
        out.append(_trace("hybrid-eviction", i, b, [c], {"model": "tiny-hybrid", "block_size": B,
                                                          "num_blocks": N},
                          tenants={"fg": 2, "bg": 1}))
    return out


HYBRID_EVICTION = Rule("hybrid-eviction", "§5, §8", {"w": (1, 2, 9), "d": (Edge(0, 1), Edge(1))},
                       _hybrid_eviction)


TIERS_B = 4


def _tiers(cases, rule: str = "tiers") -> list[Trace]:
    """One trace a case. A prompt of 2 blocks is stored to host (capacity 2: full) and freed; an
    unhashed prefill takes the device; a load of the prompt begins (it reads both host blocks);
    then, before its completion, ``during``: a store of another 2-block prompt to host (LRU would
    evict what the load reads: it must skip them, refusing the store), a second load of the same
    blocks, the abort of the load, or nothing; then the completions (``fail``: the load's fails,
    host declaring ``failed_load``; the device is flushed again and the prompt loaded again, a hit
    of host's 2 blocks if it keeps them, none if it dropped them; then a store of another prompt
    fails), and a swap of a sequence into a tier of ``room`` (none: a store of no full block there
    first; exact; one short; None: no swap, no swap tier). ``lookup`` (SPEC §11's pins): the load is looked up first
    (``plain``; ``salted``: the prompt stored and loaded under a salt), or a lookup of the prompt
    is aborted before any load (``aborted``), or none."""
    B = TIERS_B
    out = []
    for i, c in enumerate(cases):
        b = _Ops()
        ids = _ids(i, 2 * B + 1)
        other = _ids(i, 2 * B, start=500)
        salt = "s" if c["lookup"] == "salted" else None
        a = b.prefill(2 * B, token_ids=ids[:2 * B], salt=salt)
        sid = b.store(a, "host")
        b.done(sid)
        b.free(a)
        flush = b.prefill(8 * B)  # the device forgets the prompt: the loads read host
        b.free(flush)
        looked = None
        if c["lookup"] != "none":  # pins host's 2 blocks until the load's end (or the abort)
            looked = b.lookup(2 * B + 1, ids, salt=salt)
        if c["lookup"] == "aborted":
            b.abort(looked)
            looked = None
        seq, lid = b.load(2 * B + 1, ids, salt=salt, seq=looked)
        if c["during"] == "store":
            o = b.prefill(2 * B, token_ids=other)
            oid = b.store(o, "host")
            b.done(oid)
            b.free(o)
        elif c["during"] in ("load", "shared-fail"):  # a second load of the same blocks
            seq2, lid2 = b.load(2 * B + 1, ids)
            if c["during"] == "load":
                b.done(lid2)
                b.free(seq2)
        if c["during"] == "abort":
            b.abort(seq)
        else:
            b.done(lid, ok=c["during"] not in ("fail", "shared-fail"))
            b.free(seq)
        if c["during"] == "shared-fail":  # the other reader ends after the failure, having read
            b.done(lid2)
            b.free(seq2)
        if c["during"] in ("fail", "shared-fail"):
            b.free(b.prefill(8 * B))  # the device forgets the recomputed prompt again
            again, aid = b.load(2 * B + 1, ids)
            b.done(aid)
            b.free(again)
            o = b.prefill(2 * B, token_ids=other)
            b.done(b.store(o, "host"), ok=False)
            b.free(o)
        tiers = (TierSpec("host", c.get("host", 2), failed_load=c["failed_load"]),)
        if c["room"] is not None:
            need = 3  # the swapped sequence's blocks: ceil((2B + 2) / B)
            room = {"none": 0, "exact": need, "short": need - 1}[c["room"]]
            s = b.prefill(2 * B + 2)
            if room == 0:  # a store of no full block (B - 1 tokens) to a tier of no room
                short = b.prefill(B - 1)
                b.done(b.store(short, "swap"))
                b.free(short)
            b.ops.append(Preempt(len(b.ops), s, "swap", "swap"))
            b.resume(s)
            b.append([s], [1])
            tiers += (TierSpec("swap", room),)
        b.free_all()
        out.append(_trace(rule, i, b, [c], {"block_size": B, "num_blocks": 8,
                                                "prefix_caching": True}, tiers=tiers))
    return out


TIERS = Rule("tiers", "§11, §13", {"during": ("store", "load", "abort", "nothing", "fail"),
                                    "room": ("none", "exact", "short"),
                                    "failed_load": ("keep", "drop"),
                                    "lookup": ("none", "plain", "salted", "aborted")}, _tiers,
             interactions=(("during", "failed_load"),),
             # what host does with a failed load's blocks matters where a load fails
             valid=lambda c: c["failed_load"] == "keep" or c["during"] == "fail")


def _lookups(cases) -> list[Trace]:
    """The tiers rule's failing load (room exact), looked up first: the pins the lookup took pass
    to the load and go at its failed completion, whether host keeps what it read or drops it."""
    return _tiers([{"during": "fail", "room": "exact", **c} for c in cases], "lookups")


LOOKUPS = Rule("lookups", "§11", {"lookup": ("plain", "salted"), "failed_load": ("keep", "drop")},
               _lookups, interactions=(("lookup", "failed_load"),))


def _shared_reads(cases) -> list[Trace]:
    """The tiers rule's failing load while a second load reads the same host blocks, which
    completes after the failure: a tier that drops what a failed load read removes it once no
    load reads it (SPEC §11), so the second load is served whole, and the load after it finds
    host's blocks only if host keeps them. No swap after it, and a host of 4 with room for every
    store, so that a tier evicting nothing (vLLM's file tier) runs it too."""
    return _tiers([{"during": "shared-fail", "room": None, "lookup": "none", "host": 4, **c}
                   for c in cases], "shared-reads")


SHARED_READS = Rule("shared-reads", "§11", {"failed_load": ("keep", "drop")}, _shared_reads)


ENCODINGS_B = 8


def _encodings(cases) -> list[Trace]:
    """One trace a model: a prefill over a block edge, a fork, appends that copy the shared tail
    and cross the next edge, a hit of the prompt's full blocks, the frees."""
    out = []
    for i, c in enumerate(cases):
        B = ENCODINGS_B
        b = _Ops()
        ids = _ids(i, 2 * B + 3)
        a = b.prefill(2 * B + 3, token_ids=ids)
        a2 = b.fork(a)
        b.append([a, a2], [1, B])
        h = b.prefill(2 * B, token_ids=ids[:2 * B])
        b.append([h], [1])
        b.free_all()
        out.append(_trace("encodings", i, b, [c], {"model": c["model"], "block_size": B,
                                                    "num_blocks": 32, "prefix_caching": True}))
    return out


ENCODINGS = Rule("encodings", "§12", {"model": ("tiny-fp8", "tiny-fp8-token-head", "tiny-nvfp4")},
                 _encodings)


RETURNS_B = 8


def _returns(cases) -> list[Trace]:
    """One trace: per case, prompt A (freed: cached), a prompt of A's first s tokens and e new
    ones (freed), then A again (the A->B->A order)."""
    B = RETURNS_B
    b = _Ops()
    for i, c in enumerate(cases):
        p, e = c["p"](B), c["extra"](B)
        a = _ids(i, p)
        s = p if c["shares"] == "all" else p - 1
        b.free(b.prefill(p, token_ids=a))
        b.free(b.prefill(s + e, token_ids=a[:s] + _ids(i, e, start=500)))
        b.free(b.prefill(p, token_ids=a))
    return [_trace("returns", 0, b, cases, {"model": "tiny-mamba", "block_size": B,
                                            "num_blocks": 96, "prefix_caching": True})]


RETURNS = Rule("returns", "§12", {"p": (Edge(3, -1), Edge(3), Edge(3, 1)),
                                  "extra": (Edge(0, 1), Edge(1), Edge(1, 1)),
                                  "shares": ("all", "all but the last token")}, _returns,
               interactions=(("p", "extra"),))


ZERO_B = 4


def _zero(cases) -> list[Trace]:
    """One trace a prefix-caching setting: per case an empty prompt (0 tokens), then the
    operation of the case on it, alone or beside a sequence that writes: an append of 0 tokens,
    a fork of the empty sequence (beside: and of the other, whose shared partial tail a 0-token
    append must not copy), or (``prefill``) the first append that fills a block from nothing;
    then a write after it."""
    B = ZERO_B
    out = []
    for cache in (False, True):
        b = _Ops()
        mine = [c for c in cases if c["cache"] is cache]
        for i, c in enumerate(mine):
            other = b.prefill(B + 1, token_ids=_ids(i, B + 1)) if c["beside"] == "batched" else None
            e = b.prefill(0, token_ids=[])
            both = [e] + ([other] if other is not None else [])
            if c["op"] == "append":
                b.append(both, [0] + [1] * (other is not None))
            elif c["op"] == "fork":  # of the empty sequence, and of one whose tail it shares
                child = b.fork(e)
                forks = [child] + ([b.fork(other)] if other is not None else [])
                b.append(forks, [0] * len(forks))  # nothing written: no tail copied
                b.append([child], [B])
            b.append(both, [B] + [0] * (other is not None))  # a block filled from nothing
            b.free_all()
        out.append(_trace("zero", int(cache), b, mine, {"block_size": B, "num_blocks": 32,
                                                        "prefix_caching": cache}))
    return out


ZERO = Rule("zero", "§13", {"op": ("prefill", "append", "fork"), "beside": ("alone", "batched"),
                            "cache": (False, True)}, _zero,
            interactions=(("op", "beside", "cache"),))


COMPRESSED_B, COMPRESSED_R = 4, 4  # tiny-compressed: full beside compressed(4); a block of it covers 16


@dataclass(frozen=True)
class SpanEdge(Edge):
    """``a * S + c``, S = B * r: the tokens one block of a compressed(r) group covers."""

    def __str__(self) -> str:
        return super().__str__().replace("B", "S")


def _compressed(cases) -> list[Trace]:
    """Two traces, with and without prefix caching: per case a prompt A of T tokens, a fork of
    it, an append of 1 to A and of d to the fork (d = 1, r - 1, r, S: across an entry's first
    token, a block's last, or neither), r + 1 drafts by the fork of which the accept keeps 1, a
    request sharing A's first ``hit`` tokens and one more of its own, freed or preempted and
    resumed; then the frees. With caching, last: a prompt as large as the pool (every cached
    block evicted, the compressed ones with the full) and the first case's prompt again."""
    B, r = COMPRESSED_B, COMPRESSED_R
    S = B * r
    out = []
    for cache in (True, False):
        b = _Ops()
        for i, c in enumerate(cases):
            T, hit, d = c["T"](S), c["hit"](S), c["d"](B)
            ids = _ids(i, T)
            a = b.prefill(T, token_ids=ids)
            f = b.fork(a)
            b.append([a, f], [1, d])
            b.append([f], [r + 1], [r + 1])
            b.accept(f, r + 1, 1)
            h = b.prefill(hit + 1, token_ids=ids[:hit] + _ids(i, 1, start=500))
            if c["then"] == "preempt":
                b.preempt(h)
                b.resume(h)
            b.free_all()
        if cache:  # ceil(204 / 4) + ceil(204 / 16) = 51 + 13 = 64: the whole pool
            b.free(b.prefill(204, token_ids=_ids(len(cases), 204)))
            b.free(b.prefill(cases[0]["T"](S), token_ids=_ids(0, cases[0]["T"](S))))
        out.append(_trace("compressed", len(out), b, cases, {
            "model": "tiny-compressed", "block_size": B, "num_blocks": 64, "prefix_caching": cache}))
    return out


def _compressed_valid(c) -> bool:
    """The request shares no more of A than A has."""
    return c["hit"](COMPRESSED_B * COMPRESSED_R) <= c["T"](COMPRESSED_B * COMPRESSED_R)


R_EDGES = (Edge(0, 1), Edge(0, COMPRESSED_R - 1), Edge(0, COMPRESSED_R), Edge(COMPRESSED_R))
COMPRESSED = Rule("compressed", "§12", {
    "T": tuple(SpanEdge(k, c) for k in (1, 2) for c in (-1, 0, 1)),
    "hit": (SpanEdge(1, -1), SpanEdge(1), SpanEdge(1, COMPRESSED_B)),
    "d": R_EDGES, "then": ("free", "preempt")},
    _compressed, interactions=(("T", "d"), ("T", "hit")), valid=_compressed_valid)


RULES = [WINDOWS, ROLLBACK, CHUNKS, CHAINS, HYBRID_EVICTION, TIERS, LOOKUPS, ENCODINGS, RETURNS, ZERO,
         COMPRESSED, SHARED_READS]


def boundary_traces(rules=None) -> list[Trace]:
    """Every rule's traces, from its covering cases, in rule order."""
    return [t for r in (rules or RULES) for t in r.build(r.cases())]


__all__ = ["Edge", "Rule", "RULES", "cover", "boundary_traces"]
