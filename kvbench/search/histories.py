"""Random histories over random settings, for `kvbench fuzz`: a pure function of (seed, index)
and the capabilities a backend declares.

:func:`draw_settings` picks the settings of one history: a block size (1 to 32, now and then
256), a model (``tiny``, ``tiny-hybrid`` or a random mix of full and sliding(W) groups over
tiny-hybrid's four layers, W at and around block edges), prefix caching, salts and adapters,
an eviction policy, tenants with integer or fractional Fair weights, and how the budget is set
against the history's peak demand (exact fit, one block short, one over, tight, roomy). Only what
the capabilities declare is drawn: no sliding window for a backend without groups, no fork for
one that cannot fork, no salt for one that takes none.

:func:`random_ops` builds the history from :data:`OP_KINDS`, each a weighted choice gated by a
capability: plain, shared-prefix and keyed prefills (lengths at, one under and one over block
multiples), batched appends up to and across block edges, a one-token decode over every live
sequence (the wide decode path), forks, a fork and a write into the tail it shares, wide forks
(now and then 128+ sharers), bursts of prompts, frees, and draining every sequence (its cached
blocks left for later prompts); for a backend that declares them, SPEC §13's lifecycles
(chunked prompts and their next chunks, appends with drafts and accepts, preempt and resume)
and SPEC §11's transfers (stores, loads, completions that may fail, aborts, offload-and-reload
round trips, half of them followed by two or three overlapping reloads of a prompt sized to
its tier, flushes of the device's cache). A new operation is one more :class:`OpKind` in the
list, with its ``needs`` predicate. Unless ``model_shapes`` is off, the model may also be a
preset's pattern of group kinds or a random mix of the kinds declared (:func:`draw_shape`),
scaled down to tiny-hybrid's and tiny-mla's layers; a KV format is drawn among those the backend
declares. Now and then an operation writes zero tokens (an empty prompt, an append member of
none: SPEC §13's edge), a reload is aborted while it reads the tier or comes under another
salt, and a token-id prompt opens with another prefix's block. One history in five comes instead
from one of kvbench's own families (:data:`FAMILY_SOURCES`: beam search and parallel sampling,
continuous batching, shared prefixes, salted prompts, window edges, eviction and decode edges,
chunked prefill, speculative forks, preemption, tiered turns)
with random parameters, under the drawn policy and budget, or the budget it was built for.

For a backend that takes SPEC §11's ``lookup``, lookups are added around the loads after the
history is drawn (:func:`_with_lookups`), and a tier the backend runs on one that evicts nothing
is made as large as what the history may store there.

Every draw comes from ``numpy.random.default_rng([seed, index])`` in a fixed order (the KV
format, what a tier does with a failed load and the lookups from generators of their own,
``[seed, index, 1]`` to ``[seed, index, 3]``), so the same (seed, index, capabilities) gives
the same trace, byte for byte, and the other operations are the same with lookups or without.

Over 500 lines: the operation kinds share one history's state (live sequences, drafts, tiers'
contents) and one generator's draw order, which is what makes a history reproducible by index.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Callable

import numpy as np

from kvbench.contract.formulas import PRESETS, get_model, next_pow2, with_group_kinds
from kvbench.contract.protocol import CacheConfig, Capabilities
from kvbench.model.tiers import failed_load_modes
from kvbench.traces.builder import DEFAULT_TENANT, _Builder, peak_blocks, tier_blocks
from kvbench.traces.format import Free, Header, Prefill, Preempt, Trace, validate
from kvbench.traces.tier_ops import Abort, Done, Load, Lookup, Store, TierSpec
from kvbench.traces.generators import generate
from kvbench.traces.hybrid import VOCAB

# The generator's name and version in the headers of the traces it draws: its old path, kept when
# the module moved (kvbench/traces/ to kvbench/search/) so that a history is the same bytes as before.
GENERATOR = "kvbench.traces.random_histories v1"
BLOCK_SIZES = (1, 2, 3, 4, 8, 16, 32)
LARGE_BLOCK = 256  # a full block of 256 tokens: a one-byte fill counter wraps to 0
LARGE_BLOCK_RATE = 0.03
BUDGETS = ("exact", "one short", "one over", "tight", "roomy")  # and "as generated" (a family's)
PREFIXES = 3  # shared prefixes a cached prompt opens with
# (salt, adapter) of a keyed prompt: "s0" names a salt and an adapter, so that a hash that does
# not tag which is which mixes them up.
KEYS = ((None, None), ("s0", None), (None, "s0"), ("s1", "a1"), ("s0", "a1"))
BURST = (2, 12)  # prompts arriving at once: enough live sequences for the wide decode path
WIDE_FORK = 130  # the wide fork now and then: 128+ sharers of one block, 65+ live sequences
WIDE_FORK_RATE = 0.1
HYBRID_LAYERS = 4  # tiny-hybrid's layers: 1, 2 or 4 groups
TIER_RATE = 0.2  # histories with lower tiers, for a backend that runs them
LIFECYCLES = ("chunked", "speculative", "preempt")
LIFECYCLE_RATE = 0.35  # each lifecycle the backend takes, drawn into a history
SWAP_PREEMPT_RATE = 0.7  # the preempt lifecycle in a tiered history, for a backend that swaps
MAX_DRAFT = 5  # draft tokens of one speculative append
FAIL_RATE = 0.2  # transfers that complete with ok false
OVERLAP_RATE = 0.5  # round trips followed by overlapping reloads of another stored prompt
SHAPE_RATE = 0.6  # histories whose model is a drawn shape (unless base_model_only)
# SPEC §4 and §12's KV formats, one drawn per history among those the backend declares
# (:func:`declared_formats`).
KV_FORMATS = ("fp8-tensor", "fp8-token-head", "nvfp4", "int8", "int4")
ABORT_RELOAD_RATE = 0.25  # reloads of a stored prompt aborted in flight, while they read the tier
OTHER_KEYS_RATE = 0.25  # keyed reloads under another salt or adapter: the tier must not serve them
UNCHAINED_RATE = 0.3  # token-id prompts whose first block is another prefix's, the rest their own
ZERO_RATE = 0.08  # prefills and append members of zero tokens (SPEC §13's operation of zero tokens)
MLA_BASE = "tiny-mla"  # the base of MLA shapes (kv_heads 1, head_dim = the latent)
# SPEC §11's lookups, for a backend that takes them (:func:`_with_lookups`), each drawn per load
CANCEL_RATE = 0.3  # another request of its prompt looked up, then aborted or freed unloaded
LOOKUP_RATE = 0.8  # the load looked up first (salted where its prompt is)
LOOKUP_GAPS = (0, 0, 1, 2)  # operations between a lookup and its load, abort or free


@dataclass(frozen=True)
class Settings:
    """One history's settings. ``groups``: the model's group kinds (empty: the model's own)."""

    block_size: int
    model: str
    groups: tuple = ()
    prefix_caching: bool = False
    keyed: bool = False  # salts, adapters and token ids on prompts
    policy: str | None = None
    tenants: dict = field(default_factory=dict)
    budget: str = "roomy"
    tight: float = 0.5  # where a "tight" budget lies between one block and the peak, in [0, 1)
    own_blocks: int | None = None  # the budget a family's trace was built for ("as generated")
    max_len: int = 64  # longest a sequence grows
    ops: int = 32
    tiers: tuple = ()  # TierSpecs of the lower tiers (SPEC §11); empty: none
    lifecycles: tuple = ()  # of "chunked", "speculative", "preempt" (SPEC §13)
    shape: str = ""  # the preset whose kinds the model has, or "random mix" (draw_shape)
    kv_format: str | None = None  # of those the backend declares; None: its own

    def kinds(self) -> tuple:
        """The group kinds of the model these settings run."""
        return tuple(g.kind for g in self.spec().kv_groups)

    def spec(self):
        model = get_model(self.model)
        return with_group_kinds(model, self.groups) if self.groups else model

    def config(self, num_blocks: int) -> CacheConfig:
        return CacheConfig(model=self.spec(), block_size=self.block_size, num_blocks=num_blocks,
                           policy=self.policy, prefix_caching=self.prefix_caching,
                           tenant_weights=dict(self.tenants), max_context=next_pow2(self.max_len),
                           kv_format=self.kv_format)


def _window(rng, B: int) -> int:
    """A window at or one off a block edge, or anywhere up to four blocks."""
    k = int(rng.integers(1, 4))
    return max(1, int(rng.choice([1, k * B - 1, k * B, k * B + 1, int(rng.integers(1, 4 * B + 1))])))


def _scaled_kind(rng, family: str, B: int) -> str:
    """A group kind of ``family`` at this campaign's scale: windows, chunks and sinks at and
    around block edges; an MLA latent as wide as tiny-mla's head (its K/V arrays need that)."""
    if family in ("sliding", "chunked"):
        return f"{family}({_window(rng, B)})"
    if family == "sinks":
        sinks = max(1, int(rng.choice([1, B, B + 1, int(rng.integers(1, 2 * B + 1))])))
        return f"sinks({sinks},{_window(rng, B)})"
    if family == "mla":
        return f"mla({get_model(MLA_BASE).head_dim})"
    if family == "state":
        return f"state({_state_size(rng, B)})"
    return "full"


def _state_size(rng, B: int) -> int:
    """A state's bytes per layer at, one under or anywhere up to one block's bytes per layer of
    tiny-hybrid (a pool keeps a state in the block of its last token, SPEC §12)."""
    base = get_model("tiny-hybrid")
    top = B * base.bytes_per_token // base.layers
    return max(1, int(rng.choice([top, top - 1, 1, int(rng.integers(1, top + 1))])))


def _with_token_group(pattern: list, families: list) -> list:
    """``pattern`` with its last group a per-token kind of ``families`` (else full) when every
    group of it is a state: such a model has no token blocks to size its pages by."""
    if all(f == "state" for f in pattern):
        pattern = pattern[:-1] + [next((f for f in families if f != "state"), "full")]
    return pattern


def _pattern(families: list, G: int) -> list:
    """``families`` (a preset's group kinds, in order) cut down to ``G`` groups: every kind at
    least once while there is room, the rest the commonest kind, in the preset's order."""
    distinct = list(dict.fromkeys(families))[:G]
    common = max(distinct, key=families.count)
    return sorted(distinct + [common] * (G - len(distinct)), key=families.index)


def shape_presets(caps: Capabilities) -> list:
    """The presets whose group kinds the backend runs (without ``groups``, those of one full
    group), in name order."""
    out = []
    for name, m in sorted(PRESETS.items()):
        families = {g.family for g in m.kv_groups}
        if families <= set(caps.kinds) and (caps.groups or not m.hybrid) \
                and not ("mla" in families and len(families) > 1):
            out.append(name)
    return out


def draw_shape(rng, caps: Capabilities, B: int) -> tuple[str, tuple, str]:
    """A model for --model-shapes: (base preset, group kinds, where the shape comes from).
    Half the time a preset's pattern of kinds scaled down to at most 4 groups of tiny-hybrid's
    layers (MLA presets: tiny-mla's); otherwise a random mix of the kinds the backend declares
    (full, sliding, SPEC §12's chunked, sinks and state, a state never alone; MLA alone, its K/V
    arrays hold no other kind)."""
    mixable = [f for f in ("full", "sliding", "chunked", "sinks", "state") if f in caps.kinds]
    if rng.random() < 0.5:
        patterns: dict = {}  # a pattern of kinds drawn as often as any other, then a preset of it
        for name in shape_presets(caps):
            patterns.setdefault(tuple(g.family for g in get_model(name).kv_groups), []).append(name)
        families, names = list(patterns.items())[int(rng.integers(len(patterns)))]
        source, families = names[int(rng.integers(len(names)))], list(families)
    elif "mla" in caps.kinds and caps.groups and rng.random() < 0.2:
        source, families = "random mix", ["mla"] * int(rng.choice([1, 2]))
    else:
        source = "random mix"
        G = int(rng.choice([1, 2, 4])) if caps.groups else 1
        families = [str(rng.choice(mixable)) if caps.groups else "full" for _ in range(G)]
    if families[0] == "mla":
        base = MLA_BASE
    elif len(families) == 1 and families[0] == "full":
        return "tiny", (), source
    else:
        base = "tiny-hybrid"
    layers = get_model(base).layers
    G = max(g for g in (1, 2, 4) if g <= min(len(families), layers))
    groups = tuple(_scaled_kind(rng, f, B) for f in _with_token_group(_pattern(families, G), families))
    return base, groups, source


def _draw_tiers(rng, caps: Capabilities) -> tuple:
    """A host tier (now and then of no room or of one block) and, half the time, a disk below it,
    each under a policy the backend runs."""
    def tier(name, top):
        some = int(rng.integers(2, top + 1))
        capacity = int(rng.choice([0, 1, some, some, some, some]))
        return TierSpec(name, capacity, str(rng.choice(list(caps.tiers))))
    host = tier("host", 16)
    return (host, tier("disk", 32)) if rng.random() < 0.5 else (host,)


def draw_settings(rng, caps: Capabilities, lifecycles: tuple = (), model_shapes: bool = True) -> Settings:
    """``lifecycles``: those of SPEC §13 the backend takes (kvbench.contract.protocol.takes_lifecycle;
    "preempt" is a free and a prefill, which every backend takes); ``model_shapes``: models
    drawn from the presets and random mixes of kinds too (:func:`draw_shape`; False: tiny and
    tiny-hybrid's full / sliding mixes only). The KV format is drawn apart (:func:`random_history`)."""
    B = int(rng.choice(BLOCK_SIZES))
    if rng.random() < LARGE_BLOCK_RATE:
        B = LARGE_BLOCK
    model, groups, shape = "tiny", (), ""
    if model_shapes and rng.random() < SHAPE_RATE:
        model, groups, shape = draw_shape(rng, caps, B)
    elif caps.groups and rng.random() < 0.5:
        model = "tiny-hybrid"
        if rng.random() < 0.7:  # a random mix; otherwise the preset's own groups
            G = int(rng.choice([1, 2, 4]))
            groups = tuple("full" if rng.random() < 0.4 else f"sliding({_window(rng, B)})"
                           for _ in range(G))
    caching = bool(caps.prefix_caching and caps.layout == "paged" and rng.random() < 0.5)
    keyed = bool(caching and caps.cache_salt and rng.random() < 0.6)
    policy = None
    if caps.eviction and rng.random() < 0.6:
        policy = str(rng.choice(list(caps.eviction)))
    n_tenants = int(rng.integers(1, 4))
    fractional = rng.random() < 0.3  # 0.1 + 0.2 + 0.3 is not 0.6 in floating point
    tenants = {f"t{i}": (round(0.1 * (i + 1), 1) if fractional else int(rng.integers(1, 4)))
               for i in range(n_tenants)}
    budget, tight = str(rng.choice(BUDGETS)), float(rng.random())
    max_blocks = int(rng.integers(2, 21 if B <= 4 else 9))
    max_len = B * max_blocks if B < LARGE_BLOCK else 3 * B
    ops = int(rng.integers(8, 61))
    tiers = ()
    if caps.tiers and caps.prefix_caching and caps.layout == "paged" and rng.random() < TIER_RATE:
        tiers = _draw_tiers(rng, caps)
        # A tier replay runs one full group, prefix caching on, no eviction policy (SPEC §11).
        model, groups, shape, caching, policy = "tiny", (), "", True, None
        keyed = bool(caps.cache_salt and rng.random() < 0.6)
    spec = get_model(model)
    releasing = any(g.releases for g in (with_group_kinds(spec, groups) if groups else spec).kv_groups)
    swaps = bool(tiers and caps.swap)  # preemption is then what the tiers serve most (SPEC §13)
    drawn = tuple(name for name in LIFECYCLES if name in lifecycles
                  and rng.random() < (SWAP_PREEMPT_RATE if swaps and name == "preempt" else LIFECYCLE_RATE)
                  and not (name == "speculative" and releasing))  # a rollback there: n/a
    return Settings(B, model, groups, caching, keyed, policy, tenants, budget, tight,
                    max_len=max_len, ops=ops, tiers=tiers, lifecycles=drawn, shape=shape)


# --- the operations ----------------------------------------------------------------------------

class History(_Builder):
    """The builder of one history: its settings, its random source and the ids it hands out;
    what each live sequence may take next (SPEC §11, §13: a chunked prompt takes only its next
    chunks, drafts wait for an accept, a preempted sequence for its resume, a loading one for
    its completion or abort)."""

    def __init__(self, settings: Settings, rng, caps: Capabilities):
        super().__init__()
        self.s, self.rng, self.caps = settings, rng, caps
        self.own_ids = VOCAB  # token ids no shared prefix uses
        self.chunk_left: dict = {}  # sequence -> tokens of its chunked prompt not yet written
        self.drafted: dict = {}  # sequence -> draft tokens waiting for an accept
        self.preempted: dict = {}  # sequence -> None, in the order they were preempted
        self.loading: dict = {}  # sequence -> its load in flight
        self.in_flight: dict = {}  # transfer id -> (kind, sequence)
        self.next_id = 0
        self.hashed: set = set()  # sequences whose prompt names block hashes or token ids
        self.flush_at: list = []  # where flushes go, once the budget is known

    def tenant(self) -> str:
        return str(self.rng.choice(sorted(self.s.tenants)))

    def draw_length(self, hi: int | None = None) -> int:
        """Tokens at, one under or one over a block multiple, or anywhere up to ``hi``."""
        hi = hi or self.s.max_len
        B, rng = self.s.block_size, self.rng
        k = int(rng.integers(1, max(1, hi // B) + 1))
        n = int(rng.choice([k * B, k * B - 1, k * B + 1, int(rng.integers(1, hi + 1))]))
        return min(max(1, n), hi)

    def room(self, seq) -> int:
        return self.s.max_len - self.length[seq]

    def ready(self) -> list:
        """The sequences an append may write."""
        return [s for s in sorted(self.length)
                if s not in self.preempted and s not in self.drafted and s not in self.loading]

    def forkable(self) -> list:
        return [s for s in self.ready() if s not in self.chunk_left]

    def freeable(self) -> list:
        return [s for s in sorted(self.length) if s not in self.loading]

    def pick(self, among=None) -> int:
        """One of ``among`` (default: the sequences an append may write)."""
        return int(self.rng.choice(self.ready() if among is None else among))

    def prompt_blocks(self):
        """A shared prefix's first m blocks and some tokens of the prompt's own: (tokens, prefix
        number, m)."""
        B, rng = self.s.block_size, self.rng
        m = int(rng.integers(1, max(1, self.s.max_len // B // 2) + 1))
        own = 0 if rng.random() < 0.4 else int(rng.integers(1, min(2 * B, self.s.max_len - m * B) + 1))
        return m * B + max(0, own), int(rng.integers(PREFIXES)), m

    def prefill(self, tokens, tenant=DEFAULT_TENANT, block_hashes=None, **kw) -> int:
        seq = super().prefill(tokens, tenant, block_hashes, **kw)
        if block_hashes or kw.get("token_ids"):
            self.hashed.add(seq)
        if (kw.get("prompt_tokens") or 0) > tokens:
            self.chunk_left[seq] = kw["prompt_tokens"] - tokens
        return seq

    def append(self, seqs, tokens, draft=None) -> None:
        super().append(seqs, tokens, draft)
        for i, (s, t) in enumerate(zip(seqs, tokens)):
            if s in self.chunk_left:
                self.chunk_left[s] -= t
                if not self.chunk_left[s]:
                    del self.chunk_left[s]
            if draft is not None and draft[i]:
                self.drafted[s] = draft[i]

    def accept(self, seq, drafted, n) -> None:
        super().accept(seq, drafted, n)
        del self.drafted[seq]

    def free(self, seq) -> None:
        super().free(seq)
        self._forget(seq)

    def _forget(self, seq) -> None:
        self.chunk_left.pop(seq, None)
        self.drafted.pop(seq, None)
        self.preempted.pop(seq, None)

    # transfers (SPEC §11)
    def transfer_id(self, kind: str, seq: int) -> int:
        self.next_id += 1
        self.in_flight[self.next_id - 1] = (kind, seq)
        return self.next_id - 1

    def store(self, seq, tier, blocks=None) -> None:
        self.ops.append(Store(len(self.ops), self.transfer_id("store", seq), seq, tier, blocks))

    def load(self, tokens, tenant, block_hashes=None, *, salt=None, adapter=None, token_ids=None) -> int:
        seq, self.next_seq = self.next_seq, self.next_seq + 1
        tid = self.transfer_id("load", seq)
        self.ops.append(Load(len(self.ops), seq, tenant, int(tokens),
                             tuple(block_hashes) if block_hashes else None, salt, adapter,
                             None if token_ids is None else tuple(token_ids), id=tid))
        self.length[seq], self.loading[seq] = int(tokens), tid
        self.hashed.add(seq)
        return seq

    def done(self, tid, ok=True) -> None:
        self.ops.append(Done(len(self.ops), tid, bool(ok)))
        kind, seq = self.in_flight.pop(tid)
        if kind == "load":
            del self.loading[seq]

    def abort(self, seq) -> None:
        """Free ``seq``, cancelling its load in flight (its stores still complete)."""
        self.ops.append(Abort(len(self.ops), seq))
        del self.length[seq]
        self._forget(seq)
        tid = self.loading.pop(seq, None)
        if tid is not None:
            del self.in_flight[tid]


def _prefill(h: History) -> None:
    """A prompt of a drawn length, now and then of none (an empty prompt: SPEC §13's operation
    of zero tokens)."""
    h.prefill(0 if h.rng.random() < ZERO_RATE else h.draw_length(), h.tenant())


def _burst(h: History) -> None:
    """Several short prompts at once (a burst of arrivals)."""
    for _ in range(int(h.rng.integers(*BURST, endpoint=True))):
        h.prefill(h.draw_length(2 * h.s.block_size), h.tenant())


def _shared_prompt(h: History, keyed: bool) -> tuple[int, dict]:
    """A prompt opening with a shared prefix: its tokens, and its block hashes (or token ids),
    salt and adapter as prefill keywords; ``keyed``: under one of :data:`KEYS`, half the time
    named by token ids."""
    tokens, k, m = h.prompt_blocks()
    B, rng, seq = h.s.block_size, h.rng, h.next_seq
    keys = {}
    if keyed:
        salt, adapter = KEYS[int(rng.integers(len(KEYS)))]
        keys = dict(salt=salt, adapter=adapter)
        if rng.random() >= 0.5:
            ids = [k * VOCAB // PREFIXES + j for j in range(m * B)]
            if m > 1 and rng.random() < UNCHAINED_RATE:  # its later blocks' ids are prefix k's,
                other = (k + 1) % PREFIXES  # but not their prefix: no hit past a chained key
                ids[:B] = [other * VOCAB // PREFIXES + j for j in range(B)]
            ids += list(range(h.own_ids, h.own_ids + tokens - m * B))
            h.own_ids += tokens - m * B
            return tokens, dict(token_ids=ids, **keys)
    hashes = [f"p{k}.{j}" for j in range(m)] + [f"r{seq}.{j}" for j in range(m, tokens // B)]
    return tokens, dict(block_hashes=hashes, **keys)


def _prefill_shared(h: History) -> None:
    tokens, kw = _shared_prompt(h, False)
    h.prefill(tokens, h.tenant(), **kw)


def _prefill_keyed(h: History) -> None:
    tokens, kw = _shared_prompt(h, True)
    h.prefill(tokens, h.tenant(), **kw)


def _append(h: History) -> None:
    rng, B = h.rng, h.s.block_size
    room = [s for s in h.ready() if h.room(s) > 0]
    if not room:
        return _prefill(h)
    k = int(rng.integers(1, len(room) + 1))
    seqs = sorted(int(s) for s in rng.choice(room, size=k, replace=False))
    tokens = []
    for s in seqs:
        edge = B - h.length[s] % B  # up to the tail block's end
        t = int(rng.choice([1, edge, edge + 1, int(rng.integers(1, 2 * B + 1))]))
        zero = rng.random() < ZERO_RATE  # a member of the batch that writes nothing this step
        tokens.append(0 if zero else min(max(1, t), h.room(s), h.chunk_left.get(s, t)))
    h.append(seqs, tokens)


def _decode_all(h: History) -> None:
    """One token for every live sequence that has room: 9+ of them take the wide decode path."""
    seqs = [s for s in h.ready() if h.room(s) > 0]
    if not seqs:
        return _prefill(h)
    h.append(seqs, [1] * len(seqs))


def _fork(h: History) -> None:
    if not h.forkable():
        return _prefill(h)
    h.fork(h.pick(h.forkable()))


def _fork_write(h: History) -> None:
    """A fork and at once a write into the tail the two share (a beam step): a copy on write,
    the fresh child the one LFU evicts first."""
    if not h.forkable():
        return _prefill(h)
    src = h.pick(h.forkable())
    child = h.fork(src)
    writer = src if h.rng.random() < 0.5 else child
    if h.room(writer) > 0:
        h.append([writer], [1])


def _fork_wide(h: History) -> None:
    if not h.forkable():
        return _prefill(h)
    width = WIDE_FORK if h.rng.random() < WIDE_FORK_RATE else int(h.rng.integers(2, 9))
    src = h.pick(h.forkable())
    for _ in range(width):
        h.fork(src)


def _free(h: History) -> None:
    if not h.freeable():
        return _prefill(h)
    h.free(h.pick(h.freeable()))


def _drain(h: History) -> None:
    """Every sequence freed, in a random order: cached blocks stay for the prompts after (a
    sequence whose load is in flight stays)."""
    live = h.freeable()
    for i in h.rng.permutation(len(live)).tolist():
        h.free(live[i])


# --- the lifecycles of SPEC §13 ----------------------------------------------------------------

def _chunk(h: History, hi: int) -> int:
    """A chunk at, one under or one over a block edge, or anywhere up to ``hi``."""
    B = h.s.block_size
    return min(hi, max(1, int(h.rng.choice([B - 1, B, B + 1, int(h.rng.integers(1, 3 * B + 1))]))))


def _prefill_chunked(h: History) -> None:
    """A prompt written in chunks: its first one now (block hashes or token ids covering the
    whole prompt when caching is on, so a sharer arriving between chunks may hit)."""
    tokens, kw = _shared_prompt(h, h.s.keyed) if h.s.prefix_caching else (h.draw_length(), {})
    if tokens < 2:
        return h.prefill(tokens, h.tenant(), **kw)
    h.prefill(_chunk(h, tokens - 1), h.tenant(), prompt_tokens=tokens, **kw)


def _next_chunks(h: History) -> None:
    """The next chunk of every prompt in progress, in one batch."""
    seqs = sorted(s for s in h.chunk_left if s in h.ready())
    if not seqs:
        return _prefill_chunked(h)
    chunk = _chunk(h, 3 * h.s.block_size)
    h.append(seqs, [min(chunk, h.chunk_left[s]) for s in seqs])


def _append_drafts(h: History) -> None:
    """A speculative step: per sequence one verified token and k draft tokens (now and then
    drafts alone)."""
    room = [s for s in h.forkable() if h.room(s) >= 2]
    if not room:
        return _append(h)
    rng = h.rng
    seqs = sorted(int(s) for s in rng.choice(room, size=int(rng.integers(1, len(room) + 1)), replace=False))
    drafts = [int(rng.integers(1, min(MAX_DRAFT, h.room(s) - 1) + 1)) for s in seqs]
    # drafts alone now and then, always onto an empty sequence: a rollback then leaves it none
    lead = 0 if rng.random() < 0.2 or any(h.length[s] == 0 for s in seqs) else 1
    h.append(seqs, [d + lead for d in drafts], drafts)


def _accept(h: History) -> None:
    """Some sequences' drafts verified: each keeps none, all or some of them."""
    if not h.drafted:
        return _append_drafts(h)
    rng, waiting = h.rng, sorted(h.drafted)
    for s in sorted(int(x) for x in rng.choice(waiting, size=int(rng.integers(1, len(waiting) + 1)),
                                                 replace=False)):
        k = h.drafted[s]
        h.accept(s, k, int(rng.choice([0, k, int(rng.integers(0, k + 1))])))


def _preempt(h: History) -> None:
    if not h.forkable():
        return _prefill(h)
    s = h.pick(h.forkable())
    h.preempt(s)
    h.preempted[s] = None


def _preempt_swap(h: History) -> None:
    """Preempts by swap of one to three sequences to a lower tier (SPEC §11, §13), as a
    scheduler swaps several out at once; their resumes move them back, in any order."""
    if not h.forkable():
        return _prefill(h)
    rng, cands = h.rng, h.forkable()
    for s in rng.choice(cands, size=min(len(cands), int(rng.integers(1, 4))), replace=False):
        tier = h.s.tiers[int(rng.integers(len(h.s.tiers)))].name
        h.ops.append(Preempt(len(h.ops), int(s), "swap", tier))
        h.preempted[int(s)] = None


def _resume(h: History) -> None:
    if not h.preempted:
        return _preempt(h)
    # half the time first come first served, as a scheduler resumes its waiting queue
    s = next(iter(h.preempted)) if h.rng.random() < 0.5 else h.pick(sorted(h.preempted))
    h.resume(s)
    del h.preempted[s]


# --- the transfers of SPEC §11 -----------------------------------------------------------------

def _store(h: History) -> None:
    """A store of a sequence's full blocks (every one, or some positions) to a tier: of a
    prompt with hashed blocks where there is one (a tier holds nothing else)."""
    cands = [s for s in h.ready() if s in h.hashed] or h.ready()
    if not cands:
        return _prefill(h)
    s, rng = h.pick(cands), h.rng
    full = h.length[s] // h.s.block_size
    blocks = None
    if full and rng.random() < 0.4:
        blocks = tuple(sorted(int(p) for p in rng.choice(full, size=int(rng.integers(1, full + 1)),
                                                         replace=False)))
    h.store(s, h.s.tiers[int(rng.integers(len(h.s.tiers)))].name, blocks)


def _load(h: History) -> None:
    """A prompt opening with a shared prefix, served from the tiers after the device's hit."""
    tokens, kw = _shared_prompt(h, h.s.keyed)
    h.load(tokens, h.tenant(), **kw)


def _complete(h: History) -> None:
    """A transfer in flight completes (now and then failing)."""
    if not h.in_flight:
        return _store(h)
    h.done(h.pick(sorted(h.in_flight)), h.rng.random() >= FAIL_RATE)


def _abort(h: History) -> None:
    """An abort: of a sequence whose load is in flight when there is one."""
    cands = sorted(h.loading) or h.freeable()
    if not cands:
        return _prefill(h)
    h.abort(h.pick(cands))


def _flush(h: History) -> None:
    """A place for long unhashed prompts at once, then their frees (:func:`_with_flushes`)."""
    h.flush_at.append(len(h.ops))


def _with_flushes(h: History) -> tuple[list, int | None]:
    """The history with its flushes, and the budget it then runs at (None: no flush). The budget
    is the most blocks the history holds without them (sharing ignored) and one more; each flush
    is prompts of the longest length for every block of it, so the device's cached blocks make
    way (the last prompts are refused) and the prompts after load from the tiers."""
    if not h.flush_at:
        return h.ops, None
    B, n = h.s.block_size, h.s.max_len
    budget = peak_blocks(h.ops, B) + 1
    ops, seq, at = [], h.next_seq, set(h.flush_at)
    for i, op in enumerate(h.ops + [None]):
        if i in at:
            seqs = list(range(seq, seq + -(-budget * B // n)))
            seq += len(seqs)
            ops += [Prefill(0, s, h.tenant(), n) for s in seqs] + [Free(0, s) for s in seqs]
        if op is not None:
            ops.append(op)
    return [replace(op, step=i) for i, op in enumerate(ops)], budget


def _round_trip(h: History) -> None:
    """A prompt with a shared prefix stored down, freed (half the time before its store
    completes), the device's cache pushed out, and the same prompt loaded back: SPEC §11's
    offload and reload, as a multi-turn conversation makes it. Half the time the prompt's
    blocks are its own (no live sharer keeps them on the device)."""
    tokens, kw = _shared_prompt(h, h.s.keyed)
    if h.rng.random() < 0.5:
        kw = {**kw, "token_ids": None,
              "block_hashes": [f"c{h.next_seq}.{j}" for j in range(tokens // h.s.block_size)]}
    seq = h.prefill(tokens, h.tenant(), **kw)
    h.store(seq, h.s.tiers[int(h.rng.integers(len(h.s.tiers)))].name)
    tid, early = h.next_id - 1, h.rng.random() < 0.5
    if early:
        h.done(tid, h.rng.random() >= FAIL_RATE)
    h.free(seq)
    if not early:  # the lease outlives the free
        h.done(tid, h.rng.random() >= FAIL_RATE)
    _flush(h)
    if h.s.keyed and h.rng.random() < OTHER_KEYS_RATE:  # another tenant's salt or adapter
        salt, adapter = KEYS[int(h.rng.integers(len(KEYS)))]
        kw = {**kw, "salt": salt, "adapter": adapter}
    seq = h.load(tokens, h.tenant(), **kw)
    if h.rng.random() < ABORT_RELOAD_RATE:  # cancelled while it reads the tier
        h.abort(seq)
    if h.rng.random() < OVERLAP_RATE:  # drawn last: the round trip as before it
        _overlapping_reloads(h)


def _overlapping_reloads(h: History) -> None:
    """Two or three loads of one stored prompt begun before any completes, completing in a
    random order, with a store of another prompt into the same tier before the last one
    completes: while a load still reads the tier's blocks, that store must not take them. The
    prompt's blocks fill the tier exactly, leave one slot or overflow it by one, so the store
    needs room that only the blocks in use could give."""
    B, rng = h.s.block_size, h.rng
    tier = h.s.tiers[int(rng.integers(len(h.s.tiers)))]
    top = max(1, h.s.max_len // B)
    blocks = min(top, max(1, tier.capacity + int(rng.choice([0, -1, 1]))))
    tokens = blocks * B + (0 if rng.random() < 0.5 else int(rng.integers(0, h.s.max_len - blocks * B + 1)))
    kw = dict(block_hashes=[f"c{h.next_seq}.{j}" for j in range(blocks)])
    seq = h.prefill(tokens, h.tenant(), **kw)
    h.store(seq, tier.name)
    h.done(h.next_id - 1, True)  # stored: the loads below read it
    h.free(seq)
    _flush(h)  # the device's copy gone: every load reads the tier
    loads = []
    for _ in range(int(rng.integers(2, 4))):
        h.load(tokens, h.tenant(), **kw)
        loads.append(h.next_id - 1)
    other_tokens = int(rng.integers(1, top + 1)) * B
    other = h.prefill(other_tokens, h.tenant(),
                      block_hashes=[f"c{h.next_seq}.{j}" for j in range(other_tokens // B)])
    order = [loads[i] for i in rng.permutation(len(loads)).tolist()]
    at = int(rng.integers(1, len(order)))  # after the first completion, before the last
    for i, tid in enumerate(order):
        if i == at:
            h.store(other, tier.name)
        if rng.random() < ABORT_RELOAD_RATE:  # its request cancelled: the tier's blocks read no more
            h.abort(h.in_flight[tid][1])
        else:
            h.done(tid, rng.random() >= FAIL_RATE)


@dataclass(frozen=True)
class OpKind:
    """One weighted choice of :func:`random_ops`: ``make(history)`` adds operations to it;
    ``needs(capabilities, settings)`` says whether the backend and settings can take them."""

    name: str
    weight: float
    make: Callable[[History], None]
    needs: Callable[[Capabilities, Settings], bool] = lambda caps, s: True


def _lifecycle(name: str):
    return lambda c, s: name in s.lifecycles


def _tiered(c, s) -> bool:
    return bool(s.tiers)


OP_KINDS: list[OpKind] = [
    OpKind("prefill", 3, _prefill),
    OpKind("prefill burst", 1, _burst),
    OpKind("prefill shared prefix", 3, _prefill_shared, lambda c, s: s.prefix_caching),
    OpKind("prefill salted", 3, _prefill_keyed, lambda c, s: s.keyed),
    OpKind("append", 4, _append),
    OpKind("decode all", 2, _decode_all),
    OpKind("fork", 2, _fork, lambda c, s: c.fork),
    OpKind("fork then write", 1.5, _fork_write, lambda c, s: c.fork),
    OpKind("fork wide", 0.5, _fork_wide, lambda c, s: c.fork),
    OpKind("free", 2.5, _free),
    OpKind("drain", 0.3, _drain),
    OpKind("prefill chunked", 2, _prefill_chunked, _lifecycle("chunked")),
    OpKind("next chunks", 2.5, _next_chunks, _lifecycle("chunked")),
    OpKind("append with drafts", 3, _append_drafts, _lifecycle("speculative")),
    OpKind("accept", 3, _accept, _lifecycle("speculative")),
    OpKind("preempt", 1.5, _preempt, _lifecycle("preempt")),
    OpKind("resume", 1.5, _resume, _lifecycle("preempt")),
    OpKind("preempt by swap", 3, _preempt_swap, lambda c, s: c.swap and bool(s.tiers) and "preempt" in s.lifecycles),
    OpKind("store", 3, _store, _tiered),
    OpKind("load", 3, _load, _tiered),
    OpKind("complete a transfer", 3, _complete, _tiered),
    OpKind("abort", 0.8, _abort, _tiered),
    OpKind("flush the device", 0.7, _flush, _tiered),
    OpKind("offload and reload", 4, _round_trip, _tiered),
]


def usable_kinds(caps: Capabilities, settings: Settings) -> list[OpKind]:
    return [k for k in OP_KINDS if k.needs(caps, settings)]


def random_ops(rng, settings: Settings, caps: Capabilities) -> tuple[list, list, Settings]:
    """The operations of one history, the op kind each choice drew, in order, and its settings
    (a history with flushes runs at the budget they were made for)."""
    kinds = usable_kinds(caps, settings)
    p = np.array([k.weight for k in kinds], dtype=float)
    h = History(settings, rng, caps)
    drawn = []
    _prefill(h)
    while len(h.ops) < settings.ops:
        kind = kinds[int(rng.choice(len(kinds), p=p / p.sum()))]
        drawn.append(kind.name)
        kind.make(h)
    for seq in list(h.preempted):  # the waiting queue served, first come first served
        h.resume(seq)
        del h.preempted[seq]
    if rng.random() < 0.5:
        _drain(h)
    for tid in sorted(h.in_flight):  # every transfer completes, some after their sequence's free
        h.done(tid, rng.random() >= FAIL_RATE)
    ops, budget = _with_flushes(h)
    if budget is not None:
        settings = replace(settings, budget="as generated", own_blocks=budget)
    return ops, drawn, settings


# --- histories from kvbench's own families, with random parameters ----------------------------

def _family_params(name: str, rng, s: Settings) -> dict:
    B, hi = s.block_size, s.max_len

    def n(lo, top):
        return int(rng.integers(lo, max(lo, top), endpoint=True))

    prompt, output = max(1, hi // 2), max(1, hi // 4)
    law = {"name": "uniform", "prompt": [1, prompt], "output": [1, output]}

    if name == "fork_trees":
        return dict(mode=str(rng.choice(["beam", "parallel"])), num_trees=n(1, 3), width=n(2, 5),
                    law=law, max_prompt=prompt, max_output=output, depth=(0, B),
                    prune_every=n(1, 4), sub_width=n(1, 3))
    if name == "decode_streams":
        return dict(num_requests=n(4, 12), law=law, max_prompt=prompt, max_output=output,
                    max_batch=n(2, 10), arrival_rate=float(rng.random()))
    if name == "prefix_sharing":
        return dict(num_requests=n(6, 16), prefixes=n(1, 3), prefix_blocks=(0, max(0, hi // B // 2)),
                    own_tokens=(1, 2 * B), output=(1, output), fork_rate=float(rng.random()),
                    concurrency=n(2, 6), block_size=B)
    if name == "salted_prefixes":
        return dict(rounds=n(1, 2), prompt_blocks=(1, max(1, hi // B // 2)), own_tokens=(1, B),
                    output=(1, B), block_size=max(2, B))
    if name == "chunked_prefill":
        return dict(num_requests=n(4, 12), prefixes=n(1, 3), prefix_blocks=(1, max(1, hi // B // 2)),
                    own_tokens=(1, 2 * B), chunk=n(1, 3 * B), whole_rate=float(rng.random()),
                    concurrency=n(2, 6), output=(1, output), decode_chunk=n(1, 4), block_size=B)
    if name == "speculative_forks":
        return dict(num_trees=n(1, 3), width=n(2, 4), prompt=(1, prompt), rounds=(1, 6), k=n(1, MAX_DRAFT),
                    acceptance=float(rng.random()), prune_rate=float(rng.random()), block_size=B)
    if name == "preemption":
        p_hi, o_hi = n(1, 4 * B), n(1, 4 * B)
        return dict(num_requests=n(4, 10), prompt=(1, p_hi), output=(1, o_hi), decode_chunk=n(1, B),
                    num_blocks=-(-(p_hi + o_hi) // B) + n(0, 8), block_size=B)
    if name == "swap_preemption":
        p_hi, o_hi = n(1, 4 * B), n(1, 4 * B)
        return dict(num_requests=n(4, 10), prompt=(1, p_hi), output=(1, o_hi), decode_chunk=n(1, B),
                    num_blocks=-(-(p_hi + o_hi) // B) + n(0, 8), block_size=B, host=n(1, 16))
    if name == "tiered_turns":
        return dict(conversations=n(4, 6), turns=n(2, 3), output=(1, max(1, B)),
                    block_size=int(rng.choice([2, 4, 8, 16])), host=n(0, 8), disk=n(0, 32))
    if name in ("eviction_edges", "decode_edges"):
        return dict(block_size=int(rng.choice([4, 8, 16])), num_blocks=n(16, 24), rounds=n(1, 2),
                    tenants={"t0": 1, "t1": 2})
    if name == "window_hits":  # tiny-hybrid's window of 32: hits it cuts short, at an exact fit
        return dict(rounds=n(1, 2), block_size=int(rng.choice([2, 3, 4, 8, 16])))
    if name == "window_decode":
        return dict(rounds=1, block_size=int(rng.choice([4, 8, 16])))  # it takes 3 <= B < W (32 on tiny-hybrid)
    raise ValueError(f"no random parameters for family {name!r}")


# (family, whether the backend and settings can run it)
FAMILY_SOURCES = (
    ("fork_trees", lambda c, s: c.fork),
    ("decode_streams", lambda c, s: True),
    ("prefix_sharing", lambda c, s: c.fork and s.prefix_caching),
    ("salted_prefixes", lambda c, s: s.keyed),
    ("window_decode", lambda c, s: c.fork and c.groups and c.layout == "paged"),
    ("window_hits", lambda c, s: c.groups and c.layout == "paged" and s.prefix_caching),
    ("eviction_edges", lambda c, s: c.fork),
    ("decode_edges", lambda c, s: c.fork),
    ("chunked_prefill", lambda c, s: "chunked" in s.lifecycles),
    ("speculative_forks", lambda c, s: c.fork and "speculative" in s.lifecycles),
    ("preemption", lambda c, s: "preempt" in s.lifecycles),
    ("tiered_turns", lambda c, s: bool(s.tiers)),
    ("swap_preemption", lambda c, s: c.swap and bool(s.tiers) and "preempt" in s.lifecycles),
)
# Built for their own budget: always run at it (tiered_turns's flush takes every block).
OWN_BUDGET = ("eviction_edges", "decode_edges", "tiered_turns", "window_hits")
FAMILY_RATE = 0.2  # histories drawn from a family instead of from OP_KINDS


def _family_history(rng, settings: Settings, caps: Capabilities):
    """A family's trace with random parameters, and the settings it runs under (its block size,
    its longest sequence, its tenants with drawn weights; for a family that sets its own budget,
    its model and, always for the edge families and else half the time, that budget); None when
    no family fits."""
    usable = [name for name, needs in FAMILY_SOURCES if needs(caps, settings)]
    if not usable:
        return None
    name = usable[int(rng.integers(len(usable)))]
    params = _family_params(name, rng, settings)
    t = generate(name, int(rng.integers(1 << 31)), **params)
    s = t.header.settings
    tenants = sorted(set(t.tenant_of().values()))
    weights = list(settings.tenants.values())
    settings = replace(settings, block_size=s.get("block_size", settings.block_size),
                       max_len=max(t.final_lengths().values()),
                       tenants={x: weights[i % len(weights)] for i, x in enumerate(tenants)})
    if "num_blocks" in s:  # its budget is for its own model
        own = name in OWN_BUDGET or rng.random() < 0.5
        settings = replace(settings, model=s.get("model", "tiny"), groups=tuple(t.header.groups),
                           budget="as generated" if own else settings.budget,
                           own_blocks=int(s["num_blocks"]))
    settings = replace(settings, tiers=tuple(t.header.tiers))  # a family's own tiers, if any
    return t.ops, [f"family {name}"], settings, {"family": name, "family_params": t.header.params,
                                                 "family_seed": t.header.seed}


def _prompt_fields(op) -> dict:
    return {f: getattr(op, f) for f in Prefill.FIELDS if f != "seq"}


def _with_lookups(ops: list, rng) -> tuple[list, list]:
    """``ops`` with SPEC §11's lookups added around their loads, and the choices drawn. Per load,
    in this order: another request of the same prompt looked up, then aborted or freed before
    any load, up to two operations later (the request cancelled between lookup and load: LMCache
    issue 3770, SGLang issue 40360); the load itself looked up first, up to two operations
    before it (a salted prompt's lookup pins its salted entries; the load takes the pins over,
    and its completion, failing now and then, releases them, under a tier that keeps or drops a
    failed load's entries). The history's own operations stay as they were, in their order:
    only lookups and the cancelled requests' aborts and frees come in between. (New requests
    loading and failing in between would change what the device and the tiers hold for every
    operation after them: the edges a seed reaches.)"""
    seqs = [s for op in ops for s in (getattr(op, "seq", None), getattr(op, "src", None),
                                      *(getattr(op, "seqs", None) or ())) if s is not None]
    next_seq = max(seqs, default=-1) + 1
    out, later, drawn = [], [], []  # later: [operations to go, the cancel] placed after them
    for op in ops:
        if isinstance(op, Load):
            prompt = _prompt_fields(op)
            if rng.random() < CANCEL_RATE:
                r, next_seq = next_seq, next_seq + 1
                out.append(Lookup(0, r, **prompt))
                end = Abort if rng.random() < 0.5 else Free
                gap = int(rng.choice(LOOKUP_GAPS))
                if gap:
                    later.append([gap, end(0, r)])
                else:
                    out.append(end(0, r))
                drawn.append(f"lookup cancelled by {end.kind}")
            if rng.random() < LOOKUP_RATE:
                gap = min(int(rng.choice(LOOKUP_GAPS)), len(out))
                out.insert(len(out) - gap, Lookup(0, op.seq, **prompt))
                drawn.append("lookup then load" + " (salted)" * bool(op.salt))
        out.append(op)
        for pending in later:
            pending[0] -= 1
        out += [x for n, x in later if n <= 0]
        later = [p for p in later if p[0] > 0]
    out += [x for _, x in later]
    return [replace(op, step=i) for i, op in enumerate(out)], drawn


def random_history(seed: int, index: int, caps: Capabilities, lifecycles: tuple = (),
                   model_shapes: bool = True, formats: tuple = (),
                   lookups: bool = False, evictless: tuple = ()) -> tuple[Trace, Settings, list]:
    """History ``index`` of the campaign of ``seed``: (trace, its settings, the op kinds drawn);
    ``lifecycles``: those of SPEC §13 the backend takes; ``model_shapes``: see
    :func:`draw_settings`; ``formats``: the KV formats the backend declares
    (:func:`declared_formats`), one drawn per history from a generator of its own, so that the
    history is the same whichever formats the backend declares; so is what each tier does with a
    failed load (``failed_load``, of those the backend declares), and, for a backend that takes
    ``lookups`` (kvbench.contract.protocol.takes_lookup), the lookups added around each load
    (:func:`_with_lookups`): the other operations are the same either way. A tier whose
    ``failed_load`` is one of ``evictless`` (the modes the backend runs on a tier that evicts
    nothing: the tier rule ``drop_tiers_evict_nothing``) is made as large as the blocks the history may store
    there (kvbench.traces.builder.tier_blocks, the bound kvbench.checking.applicable holds such a
    tier to). The header's settings leave
    ``num_blocks`` to the caller (it is set against the peak); it names tenant weights only
    under a policy (a header with weights and no policy is replayed under every policy by
    `kvbench check`)."""
    rng = np.random.default_rng([seed, index])
    settings = draw_settings(rng, caps, lifecycles, model_shapes)
    family = _family_history(rng, settings, caps) if rng.random() < FAMILY_RATE else None
    source = {}
    if family is not None:
        ops, drawn, settings, source = family
    else:
        ops, drawn, settings = random_ops(rng, settings, caps)
    if formats:
        fmt = np.random.default_rng([seed, index, 1])
        settings = replace(settings, kv_format=str(fmt.choice(list(formats))))
    if lookups and settings.tiers:
        ops, looked = _with_lookups(ops, np.random.default_rng([seed, index, 3]))
        drawn = drawn + looked
    modes = failed_load_modes(caps.tier_rules)
    if settings.tiers and len(modes) > 1:  # apart too: the same history either way
        kept = np.random.default_rng([seed, index, 2])
        settings = replace(settings, tiers=tuple(
            replace(t, failed_load=str(kept.choice(list(modes)))) for t in settings.tiers))
    if any(t.failed_load in evictless for t in settings.tiers):
        stored = tier_blocks(ops, settings.block_size, settings.tiers[0].name)
        settings = replace(settings, tiers=tuple(
            replace(t, capacity=max(t.capacity, stored.get(t.name, 0))) if t.failed_load in evictless
            else t for t in settings.tiers))
    params = {k: v for k, v in asdict(settings).items() if k not in ("tenants", "groups", "tiers")}
    header = Header(family="fuzz", generator=GENERATOR, params={"index": index, **params, **source},
                    seed=seed, tenants=dict(settings.tenants) if settings.policy else {},
                    settings={"model": settings.model, "block_size": settings.block_size,
                              "prefix_caching": settings.prefix_caching,
                              "max_context": next_pow2(settings.max_len),
                              **({"policy": settings.policy} if settings.policy else {})},
                    groups=tuple(settings.groups), tiers=tuple(settings.tiers))
    return validate(Trace(header, ops, name=f"fuzz-{seed}-{index}")), settings, drawn


__all__ = ["Settings", "OpKind", "OP_KINDS", "History", "draw_settings", "random_ops",
           "random_history", "usable_kinds", "BUDGETS", "GENERATOR", "LIFECYCLES", "draw_shape",
           "shape_presets"]
