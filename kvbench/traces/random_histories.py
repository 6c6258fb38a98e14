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
blocks left for later prompts). A new operation (a tier move, a lifecycle step) is one more
:class:`OpKind` in the list, with its ``needs`` predicate. One history in five comes instead
from one of kvbench's own families (:data:`FAMILY_SOURCES`: beam search and parallel sampling,
continuous batching, shared prefixes, salted prompts, window edges, eviction and decode edges)
with random parameters, under the drawn policy and budget, or the budget it was built for.

Every draw comes from ``numpy.random.default_rng([seed, index])`` in a fixed order, so the same
(seed, index, capabilities) gives the same trace, byte for byte.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Callable

import numpy as np

from kvbench.contract.formulas import get_model, next_pow2, with_group_kinds
from kvbench.contract.protocol import CacheConfig, Capabilities
from kvbench.traces.builder import _Builder
from kvbench.traces.format import Header, Trace, validate
from kvbench.traces.generators import generate
from kvbench.traces.hybrid import VOCAB

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

    def kinds(self) -> tuple:
        """The group kinds of the model these settings run."""
        return tuple(g.kind for g in self.spec().kv_groups)

    def spec(self):
        model = get_model(self.model)
        return with_group_kinds(model, self.groups) if self.groups else model

    def config(self, num_blocks: int) -> CacheConfig:
        return CacheConfig(model=self.spec(), block_size=self.block_size, num_blocks=num_blocks,
                           policy=self.policy, prefix_caching=self.prefix_caching,
                           tenant_weights=dict(self.tenants), max_context=next_pow2(self.max_len))


def _window(rng, B: int) -> int:
    """A window at or one off a block edge, or anywhere up to four blocks."""
    k = int(rng.integers(1, 4))
    return max(1, int(rng.choice([1, k * B - 1, k * B, k * B + 1, int(rng.integers(1, 4 * B + 1))])))


def draw_settings(rng, caps: Capabilities) -> Settings:
    B = int(rng.choice(BLOCK_SIZES))
    if rng.random() < LARGE_BLOCK_RATE:
        B = LARGE_BLOCK
    model, groups = "tiny", ()
    if caps.groups and rng.random() < 0.5:
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
    return Settings(B, model, groups, caching, keyed, policy, tenants, budget, tight,
                    max_len=max_len, ops=ops)


# --- the operations ----------------------------------------------------------------------------

class History(_Builder):
    """The builder of one history: its settings, its random source and the ids it hands out."""

    def __init__(self, settings: Settings, rng, caps: Capabilities):
        super().__init__()
        self.s, self.rng, self.caps = settings, rng, caps
        self.own_ids = VOCAB  # token ids no shared prefix uses

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
        return self.s.max_len - self.length_of(seq)

    def length_of(self, seq) -> int:
        return self.length[seq]

    def live(self) -> list:
        return sorted(self.length)

    def pick(self) -> int:
        return int(self.rng.choice(self.live()))

    def prompt_blocks(self):
        """A shared prefix's first m blocks and some tokens of the prompt's own: (tokens, prefix
        number, m)."""
        B, rng = self.s.block_size, self.rng
        m = int(rng.integers(1, max(1, self.s.max_len // B // 2) + 1))
        own = 0 if rng.random() < 0.4 else int(rng.integers(1, min(2 * B, self.s.max_len - m * B) + 1))
        return m * B + max(0, own), int(rng.integers(PREFIXES)), m


def _prefill(h: History) -> None:
    h.prefill(h.draw_length(), h.tenant())


def _burst(h: History) -> None:
    """Several short prompts at once (a burst of arrivals)."""
    for _ in range(int(h.rng.integers(*BURST, endpoint=True))):
        h.prefill(h.draw_length(2 * h.s.block_size), h.tenant())


def _prefill_shared(h: History) -> None:
    tokens, k, m = h.prompt_blocks()
    B, seq = h.s.block_size, h.next_seq
    hashes = [f"p{k}.{j}" for j in range(m)] + [f"r{seq}.{j}" for j in range(m, tokens // B)]
    h.prefill(tokens, h.tenant(), hashes)


def _prefill_keyed(h: History) -> None:
    tokens, k, m = h.prompt_blocks()
    B, rng, seq = h.s.block_size, h.rng, h.next_seq
    salt, adapter = KEYS[int(rng.integers(len(KEYS)))]
    keys = dict(salt=salt, adapter=adapter)
    if rng.random() < 0.5:
        hashes = [f"p{k}.{j}" for j in range(m)] + [f"r{seq}.{j}" for j in range(m, tokens // B)]
        h.prefill(tokens, h.tenant(), hashes, **keys)
        return
    ids = [k * VOCAB // PREFIXES + j for j in range(m * B)]
    ids += list(range(h.own_ids, h.own_ids + tokens - m * B))
    h.own_ids += tokens - m * B
    h.prefill(tokens, h.tenant(), token_ids=ids, **keys)


def _append(h: History) -> None:
    rng, B = h.rng, h.s.block_size
    room = [s for s in h.live() if h.room(s) > 0]
    if not room:
        return _prefill(h)
    k = int(rng.integers(1, len(room) + 1))
    seqs = sorted(int(s) for s in rng.choice(room, size=k, replace=False))
    tokens = []
    for s in seqs:
        edge = B - h.length_of(s) % B  # up to the tail block's end
        t = int(rng.choice([1, edge, edge + 1, int(rng.integers(1, 2 * B + 1))]))
        tokens.append(min(max(1, t), h.room(s)))
    h.append(seqs, tokens)


def _decode_all(h: History) -> None:
    """One token for every live sequence that has room: 9+ of them take the wide decode path."""
    seqs = [s for s in h.live() if h.room(s) > 0]
    if not seqs:
        return _prefill(h)
    h.append(seqs, [1] * len(seqs))


def _fork(h: History) -> None:
    if not h.length:
        return _prefill(h)
    h.fork(h.pick())


def _fork_write(h: History) -> None:
    """A fork and at once a write into the tail the two share (a beam step): a copy on write,
    the fresh child the one LFU evicts first."""
    if not h.length:
        return _prefill(h)
    src = h.pick()
    child = h.fork(src)
    writer = src if h.rng.random() < 0.5 else child
    if h.room(writer) > 0:
        h.append([writer], [1])


def _fork_wide(h: History) -> None:
    if not h.length:
        return _prefill(h)
    width = WIDE_FORK if h.rng.random() < WIDE_FORK_RATE else int(h.rng.integers(2, 9))
    src = h.pick()
    for _ in range(width):
        h.fork(src)


def _free(h: History) -> None:
    if not h.length:
        return _prefill(h)
    h.free(h.pick())


def _drain(h: History) -> None:
    """Every sequence freed, in a random order: cached blocks stay for the prompts after."""
    live = h.live()
    for i in h.rng.permutation(len(live)).tolist():
        h.free(live[i])


@dataclass(frozen=True)
class OpKind:
    """One weighted choice of :func:`random_ops`: ``make(history)`` adds operations to it;
    ``needs(capabilities, settings)`` says whether the backend and settings can take them."""

    name: str
    weight: float
    make: Callable[[History], None]
    needs: Callable[[Capabilities, Settings], bool] = lambda caps, s: True


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
]


def usable_kinds(caps: Capabilities, settings: Settings) -> list[OpKind]:
    return [k for k in OP_KINDS if k.needs(caps, settings)]


def random_ops(rng, settings: Settings, caps: Capabilities) -> tuple[list, list]:
    """The operations of one history and the op kind each choice drew, in order."""
    kinds = usable_kinds(caps, settings)
    p = np.array([k.weight for k in kinds], dtype=float)
    h = History(settings, rng, caps)
    drawn = []
    _prefill(h)
    while len(h.ops) < settings.ops:
        kind = kinds[int(rng.choice(len(kinds), p=p / p.sum()))]
        drawn.append(kind.name)
        kind.make(h)
    if rng.random() < 0.5:
        _drain(h)
    return h.ops, drawn


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
    if name in OWN_BUDGET:
        return dict(block_size=int(rng.choice([4, 8, 16])), num_blocks=n(16, 24), rounds=n(1, 2),
                    tenants={"t0": 1, "t1": 2})
    if name == "window_decode":
        return dict(rounds=1, block_size=int(rng.choice([4, 8, 16])))  # block_size=2: low > high
    raise ValueError(f"no random parameters for family {name!r}")


# (family, whether the backend and settings can run it)
FAMILY_SOURCES = (
    ("fork_trees", lambda c, s: c.fork),
    ("decode_streams", lambda c, s: True),
    ("prefix_sharing", lambda c, s: c.fork and s.prefix_caching),
    ("salted_prefixes", lambda c, s: s.keyed),
    ("window_decode", lambda c, s: c.fork and c.groups and c.layout == "paged"),
    ("eviction_edges", lambda c, s: c.fork),
    ("decode_edges", lambda c, s: c.fork),
)
OWN_BUDGET = ("eviction_edges", "decode_edges")  # built for their own budget: always run at it
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
    return t.ops, [f"family {name}"], settings, {"family": name, "family_params": t.header.params,
                                                 "family_seed": t.header.seed}


def random_history(seed: int, index: int, caps: Capabilities) -> tuple[Trace, Settings, list]:
    """History ``index`` of the campaign of ``seed``: (trace, its settings, the op kinds drawn).
    The header's settings leave ``num_blocks`` to the caller (it is set against the peak); it
    names tenant weights only under a policy (a header with weights and no policy is replayed
    under every policy by `kvbench check`)."""
    rng = np.random.default_rng([seed, index])
    settings = draw_settings(rng, caps)
    family = _family_history(rng, settings, caps) if rng.random() < FAMILY_RATE else None
    source = {}
    if family is not None:
        ops, drawn, settings, source = family
    else:
        ops, drawn = random_ops(rng, settings, caps)
    params = {k: v for k, v in asdict(settings).items() if k not in ("tenants", "groups")}
    header = Header(family="fuzz", generator=GENERATOR, params={"index": index, **params, **source},
                    seed=seed, tenants=dict(settings.tenants) if settings.policy else {},
                    settings={"model": settings.model, "block_size": settings.block_size,
                              "prefix_caching": settings.prefix_caching,
                              "max_context": next_pow2(settings.max_len),
                              **({"policy": settings.policy} if settings.policy else {})},
                    groups=tuple(settings.groups))
    return validate(Trace(header, ops, name=f"fuzz-{seed}-{index}")), settings, drawn


__all__ = ["Settings", "OpKind", "OP_KINDS", "History", "draw_settings", "random_ops",
           "random_history", "usable_kinds", "BUDGETS", "GENERATOR"]
