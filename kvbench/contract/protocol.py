"""The backend protocol: what every KV-cache backend implements, and what it reports.

A backend is built from a :class:`CacheConfig` and driven by the replay one trace operation at a
time. After every operation the checker reads :meth:`Backend.ledger` and compares it with the
oracle; :meth:`Backend.gather` returns a sequence's K/V so the checker can verify its content.

Backends from other packages implement this class and register themselves (see registry.py).

Over 500 lines: the protocol's values and calls, and (until the next release) the wrappers that
read backends of its older forms, are one contract.
"""
from __future__ import annotations

import functools
import inspect
import warnings
import zlib
from abc import ABC, abstractmethod
from dataclasses import dataclass, field, replace

import numpy as np

from kvbench.contract.formulas import ModelSpec, get_model
from kvbench.contract.ledger import LEDGER_FIELDS, REPORTED_FIELDS, Ledger


class OutOfMemory(RuntimeError):
    """Raised by an operation that cannot get every block it needs.

    The backend must leave its state exactly as it was before the operation.
    """


@dataclass(frozen=True, slots=True)
class Prompt:
    """What one prefill asks for: the prompt and what the trace says about it (SPEC §1, §9, §13).

    ``tokens``: the tokens this call writes (a chunked prefill's first chunk). ``final_tokens``:
    the length the trace says the sequence reaches (reservation policies and the ledger's
    reservation category). ``block_hashes``: the prompt's full blocks' hashes, or ``token_ids``
    (the prompt's ids) instead; with ``salt`` and ``adapter`` they key its blocks.
    ``prompt_tokens``: a chunked prompt's whole length (None: not chunked).

    The checker fills ``salt``, ``adapter`` and ``token_ids`` only for a backend declaring
    ``cache_salt``, and ``prompt_tokens`` only for one declaring ``chunked_prefill``.
    """

    tokens: int
    tenant: str = "default"
    final_tokens: int | None = None
    block_hashes: tuple | None = None
    token_ids: tuple | None = None
    salt: str | None = None
    adapter: str | None = None
    prompt_tokens: int | None = None

    @property
    def prompt_length(self) -> int:
        """The whole prompt's tokens: ``prompt_tokens`` when chunked, else ``tokens``."""
        return self.prompt_tokens or self.tokens


@dataclass(frozen=True)
class CacheConfig:
    """System settings for one backend instance (the workload is the trace, apart)."""

    model: ModelSpec = field(default_factory=lambda: get_model("tiny"))
    block_size: int = 16
    num_blocks: int = 256
    store_kv: bool = True  # False: ledger only, no K/V arrays (for large real-model budgets)
    device: str = "cpu"
    reservation: str = "max"  # contiguous baseline: max | pow2 | oracle
    max_context: int = 2048  # contiguous baseline's `max` reservation
    policy: str | None = None  # eviction policy under the block budget: lru | lfu | fair
    prefix_caching: bool = False  # reuse full blocks by the prefill's block hashes
    kv_format: str | None = None  # a quantized pool's format (kvbench.quant.pool): int8, int4
    tenant_weights: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {self.num_blocks}")

    @property
    def kv_dtype(self):
        return {2: np.float16, 4: np.float32}.get(self.model.dtype_bytes, np.float32)

    @property
    def arena_slots(self) -> int:
        """Token slots of the byte budget: the contiguous arena gets the same memory."""
        return self.num_blocks * self.block_size


@dataclass(frozen=True)
class Capabilities:
    """What a backend declares; the checker checks all of it and says what it skipped."""

    layout: str = "paged"  # paged | contiguous
    holds_kv: bool = True  # False: ledger only (gather is not available)
    fork: bool = True
    copy_on_write: bool = True
    prefix_caching: bool = False
    quantized: bool = False
    eviction: tuple = ()  # policy names it implements
    # The engine rules it follows where they differ from SPEC's: a rule set's name
    # (kvbench.model.rules.RULE_SETS: "spec", "vllm", "sglang") and that set's parameters, each
    # over the set's default (kvbench/model/rules/base.py names every rule). An unknown set or
    # parameter is an error when the backend is checked.
    rules: str = "spec"
    rule_params: dict = field(default_factory=dict, hash=False)
    # SPEC §8: runs models of several KV cache groups and sliding windows.
    groups: bool = False
    # SPEC §12: the group kinds (KVGroup.family) it runs besides what ``groups`` covers.
    kinds: tuple = ("full", "sliding")
    # SPEC §13: a prefill's Prompt may be the first chunk of a longer prompt (``prompt_tokens``);
    # the appends that follow write the rest. Otherwise a chunked trace is not applicable.
    chunked_prefill: bool = False
    # SPEC §9: takes a prefill's ``salt``, ``adapter`` and ``token_ids`` into its block hashes.
    # A backend with prefix caching that does not declare it replays salted traces without.
    cache_salt: bool = False
    # block_state() hands out and releases blocks in kvbench's order (docs/writing-a-backend.md), so the checker compares its block ids with the oracle's, one by one.
    block_ids: bool = False
    # SPEC §11: the policies of the lower tiers it runs ("lru", "arc"); empty: no tiers. Such a
    # backend also implements attach_tiers, store, load, complete, abort, tier_ledgers and
    # read_stored (kvbench.checking.tier_replay names them). It moves a transfer's bytes when
    # it chooses between the begin and the completion; the checker puts frees, evictions,
    # loads and aborts in between, and a store's lease must make the moment not matter.
    tiers: tuple = ()
    # SPEC §11 rules of those tiers that differ from SPEC's, by name: kvbench.model.tiers.TIER_RULES
    # (its docstring says what each one is; docs/tiers-and-lifecycles.md, who declares it and why).
    tier_rules: tuple = ()
    # SPEC §13: preempts by swap through those tiers (swap_out and swap_in, or its own preempt
    # and resume where it has them: tier_replay names them).
    swap: bool = False

    def __post_init__(self):
        if not isinstance(self.rules, str):
            raise ValueError(f"Capabilities.rules is a rule set's name, got {self.rules!r}")


# The engine-rule flags Capabilities had before its rule sets (each now a parameter of
# kvbench.model.rules'), and ``devices`` (never read): an old-form plug-in that sets one is read
# for one release, the flags as parameters of the rule set it declares, with a DeprecationWarning.
OLD_RULE_FLAGS = ("fork_via", "hit_leaves_last_token", "caches_every_full_block",
                  "keeps_duplicate_blocks", "window_release", "lookahead_slots",
                  "hit_drops_last_block", "kept_drafts_cached_at_next_append",
                  "sparse_window_retention", "chunk_start_hit", "evicts_whole_leaves",
                  "leaf_order", "eviction_demand", "capped_hit_recomputed")
_capabilities_init = Capabilities.__init__


@functools.wraps(_capabilities_init)
def _capabilities_old_form(self, *args, **kwargs):
    if kwargs.pop("devices", None) is not None:
        warnings.warn("Capabilities(devices=...) is unread and will be removed: the device a "
                      "backend runs on is CacheConfig.device (its available() says whether it "
                      "can)", DeprecationWarning, stacklevel=3)
    old = {k: kwargs.pop(k) for k in OLD_RULE_FLAGS if k in kwargs}
    if old:
        warnings.warn(f"Capabilities({', '.join(f'{k}=...' for k in old)}) is the old form, read "
                      "until the next release: declare rules=<rule set> and rule_params={...} "
                      "(docs/writing-a-backend.md)", DeprecationWarning, stacklevel=3)
        kwargs["rule_params"] = {**dict(kwargs.get("rule_params") or {}), **old}
    _capabilities_init(self, *args, **kwargs)


Capabilities.__init__ = _capabilities_old_form


@dataclass(frozen=True)
class Refusal:
    """Why a run is n/a, in the one shape every such reason has: "<who> does not <lacks> (SPEC
    §N), and <needs>". ``who``: the backend, or the part of kvbench that cannot follow it
    (``MODEL``, ``TIER_REPLAY``); ``needs``: what the trace, the model or the settings ask."""

    who: str
    lacks: str
    spec: str  # "SPEC §N"
    needs: str

    def __str__(self) -> str:
        return f"{self.who} does not {self.lacks} ({self.spec}), and {self.needs}"


MODEL, TIER_REPLAY = "kvbench's model", "kvbench's tier replay"


def refuse_model(backend_name: str, caps: Capabilities, model: ModelSpec) -> Refusal | None:
    """None when the backend declares the model's KV cache groups (SPEC §8) and every kind of
    them (SPEC §12), else why not."""
    kinds = ", ".join(g.kind for g in model.kv_groups)
    if model.hybrid and not caps.groups:
        return Refusal(backend_name, "run KV cache groups or sliding windows", "SPEC §8",
                       f"model {model.name} has {kinds}")
    missing = sorted({g.family for g in model.kv_groups} - set(caps.kinds))
    if missing and caps.groups:
        return Refusal(backend_name, f"run {' or '.join(missing)} groups", "SPEC §12",
                       f"model {model.name} has {kinds}")
    return None


@dataclass
class BlockState:
    """A paged backend's own block structures, for SPEC §10's checks (``Backend.block_state``).

    ``free``: uncached free blocks, next taken first. ``cached``: free blocks that hold a cached
    prefix, next evicted first. ``refcount``: references of every block of the pool, by id (0
    for a free one). ``tables``: sequence -> one list of block ids per group, by position (``-1``
    where a sliding group released the block or never took it), for the sequences asked for
    (every live one when ``seqs`` is None). Lists or 1-D arrays.
    """

    free: object
    cached: object
    refcount: object
    tables: dict
    # Give ``mark`` back as ``block_state(changed_since=mark)`` to get only what changed after this
    # state (None: the backend reports whole states only).
    mark: object = None
    # Set in a state of changes, and then ``free`` and ``cached`` are None (see BlockChanges).
    changes: BlockChanges | None = None


@dataclass
class BlockChanges:
    """What changed in the free structures since a mark (``block_state(changed_since=mark)``),
    read from the structures themselves, so the checker need not copy the pool per operation.

    ``free_head``: the first entries of the free list (next taken first) that may have changed;
    the other ``free_size - len(free_head)`` entries are those the list ended with at the mark.
    ``cached``: the cached queue's changes in order, ``(block, True)`` for a block appended at its
    end, ``(block, False)`` for one taken out. In such a state ``refcount`` need only answer for
    the blocks that changed: indexed by an array of block ids, it gives their counts.
    """

    free_head: object
    free_size: int
    cached: list


class Backend(ABC):
    """One KV-cache manager under test.

    ``kv`` arguments are arrays of shape ``[tokens, 2, layers, kv_heads, head_dim]`` (K then V),
    the new tokens of the operation in order (for a batched append, seqs[0]'s first). They are
    ``None`` for a backend configured with ``store_kv=False``.
    """

    name: str = "?"
    capabilities: Capabilities = Capabilities()

    def __init__(self, config: CacheConfig):
        self.config = config
        # A pool of KV cache groups refuses a kind it does not declare (the checker says n/a to
        # it) for direct use too: a replay or a sweep would read it as full attention.
        refused = self.capabilities.groups and refuse_model(self.name, self.capabilities, config.model)
        if refused:
            raise NotImplementedError(refused)

    @classmethod
    def available(cls) -> tuple[bool, str]:
        """(can run here, why not)."""
        return True, ""

    # Mutating calls take the trace step (the eviction clock) and return the sequences they
    # evicted, in eviction order. A call that raises OutOfMemory has changed nothing.

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        adopt_old_forms(cls, Backend)

    @abstractmethod
    def prefill(self, seq: int, prompt: Prompt, kv=None, *, step: int = 0,
                protect=()) -> tuple:
        """A new sequence serving ``prompt`` (its ``tokens`` written, with ``kv``).
        ``protect``: sequences it may not evict."""

    @abstractmethod
    def append(self, seqs, tokens, kv=None, *, step: int = 0) -> tuple:
        """One decode step over a batch: ``seqs[i]`` gains ``tokens[i]`` tokens."""

    @abstractmethod
    def fork(self, seq: int, src: int, *, final_tokens: int | None = None, step: int = 0) -> tuple:
        """``seq`` shares every block of ``src``."""

    @abstractmethod
    def free(self, seq: int, *, step: int = 0) -> None: ...

    def accept(self, seq: int, n: int, *, drafted: int, step: int = 0) -> tuple:
        """Speculative decoding (SPEC §13): of the ``drafted`` draft tokens that ``seq``'s last
        append wrote (its last ones), keep the first ``n``; the length drops by drafted - n, the
        blocks wholly past it are released as a free releases them, the tail's fill shrinks.
        Optional: a backend without it runs no trace that speculates (reported not applicable).
        A backend whose ``append`` takes ``draft`` is told there, per sequence, how many of the
        tokens it appends are drafts (an engine keeps them out of its block hashes).

        Chunked prefill (SPEC §13) is a Prompt with ``prompt_tokens=P``: ``tokens`` is the first
        chunk, ``block_hashes`` / ``token_ids`` cover the whole prompt of ``P`` tokens, the
        appends that follow write the rest, and a block is cached once its last token is written.
        A backend runs chunked traces when it declares ``chunked_prefill``."""
        raise NotImplementedError(f"{self.name} does not roll back draft tokens")

    def preempt(self, seq: int, mode: str, *, tier: str | None = None, step: int = 0) -> None:
        """Preemption (SPEC §13), optional: ``seq`` gives up its device blocks as a free gives
        them up ("recompute"), or first copies every block to lower tier ``tier`` ("swap", for a
        backend declaring ``swap``; None: the first tier), but the backend keeps the request, its
        length and its block hashes, for :meth:`resume`. A backend implementing it implements
        both; the checker then calls them for a trace's preempt and resume (and for a free of a
        preempted sequence, ``free``). A backend without them is told a free, and the resume is
        a prefill of all the sequence's tokens (its prompt's hashes given again)."""
        raise NotImplementedError(f"{self.name} is told a preemption as a free")

    def resume(self, seq: int, kv=None, *, step: int = 0, protect=()) -> tuple:
        """A preempted ``seq`` back on the device at the length it had, from what the backend
        kept: its block hashes looked up first (device hits), after a swap the rest copied up
        from the tier. ``kv``: the K/V of all its tokens, to write where it neither hits nor
        copies. Returns its victims; OutOfMemory leaves it preempted, changing nothing."""
        raise NotImplementedError(f"{self.name} is told a preemption as a free")

    @abstractmethod
    def ledger(self, seqs=None) -> Ledger:
        """The backend's own account. ``seqs``: the checker reads ``tokens`` and ``seq_blocks``
        only for these sequences, so a backend may leave the others out (it need not build
        per-sequence dicts on every operation); ``None``: every live sequence."""

    def gather(self, seq: int, start: int = 0, stop: int | None = None, *, out=None) -> np.ndarray:
        """The K/V of positions ``start .. stop-1`` of the sequence (``stop`` None: its length),
        ``[stop - start, 2, layers, kv_heads, head_dim]``, as a NumPy array; written into
        ``out`` (an array of that shape and the pool's dtype) when given.

        Positions a sliding group no longer holds read as zeros in that group's layers.
        """
        raise NotImplementedError(f"{self.name} holds no K/V data")

    def gather_ranges(self, seqs, starts, stops) -> np.ndarray:
        """Positions ``starts[i] .. stops[i]-1`` of ``seqs[i]`` for every i, concatenated in
        order: what the checker reads back after an operation, in one call. The default is one
        gather per range."""
        parts = [np.asarray(self.gather(s, a, b)) for s, a, b in zip(seqs, starts, stops)]
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def block_state(self, seqs=None) -> BlockState:
        """The backend's block structures (optional; SPEC §10's structural checks need it).
        ``seqs``: the sequences whose tables the checker reads (None: every live one); the
        free structure and the reference counts cover the whole pool. A backend may also take
        ``changed_since`` (a ``mark`` of its last state) and answer with ``BlockChanges``: the
        checker then checks after each operation only the blocks it changed, and the whole
        pool at sweeps (a backend without it is checked whole at the sweeps only)."""
        raise NotImplementedError(f"{self.name} does not expose its block structures")

    def read_state(self, seq: int) -> np.ndarray:
        """SPEC §12: the state each state group of the model holds for the sequence now,
        ``[state groups, *ModelSpec.slot_shape]`` in group order (:func:`advance_state` says
        what it must be). A backend that declares the ``state`` kind implements it."""
        raise NotImplementedError(f"{self.name} holds no state groups")

    def events(self) -> list:
        """SPEC §14: the KV events (kvbench.contract.events.KVEvent) it emitted since the last
        call, in order: ``stored`` for each block that became a prefix-cache entry, ``removed``
        for each that stopped being one, ``cleared`` for a reset; per group and tier. Optional:
        a backend that defines it has its events checked after every operation
        (:func:`publishes_events`); one that does not is reported "not checked: events"."""
        raise NotImplementedError(f"{self.name} publishes no KV events")

    def close(self) -> None:
        """Release device memory (optional)."""


def _accepts(method, name: str) -> bool:
    try:
        return name in inspect.signature(method).parameters
    except (TypeError, ValueError):
        return False


@functools.lru_cache(maxsize=None)
def _takes(cls: type, method: str, name: str) -> bool:
    return _accepts(getattr(cls, method), name)


def gathered_range(kv, start: int = 0, stop: int | None = None, out=None) -> np.ndarray:
    """Positions ``start .. stop-1`` of a sequence's K/V ``kv`` (all of them, or ``start`` on
    when ``kv`` already begins there: pass ``start=0``), as :meth:`Backend.gather` returns them,
    written into ``out`` when given."""
    kv = np.asarray(kv)[start:stop]
    if out is None:
        return kv
    out[...] = kv
    return out


# --- old forms: backends written against an older protocol, read for one release ------------
# prefill(seq, tokens, kv, *, tenant, final_tokens, ...) before the Prompt, gather(seq) before
# ranges, gather(seq, start, stop) before ``out``, ledger() before ``seqs``: a class defining one
# is given today's signature when it is defined, and a DeprecationWarning names the method and
# what to write instead. Delete this section, and its call in __init_subclass__, at the next
# release.

# The keywords a prefill took before the Prompt (they are its fields, and step and protect).
_LEGACY_PREFILL_ALWAYS = ("tenant", "final_tokens", "block_hashes")
_LEGACY_PREFILL_GIVEN = ("salt", "adapter", "token_ids", "prompt_tokens")


def _legacy(cls, method: str, was: str, now: str) -> None:
    warnings.warn(f"{cls.__module__}.{cls.__qualname__}.{method}{was} is the old form, read "
                  f"until the next release: define {method}{now} "
                  "(docs/writing-a-backend.md)", DeprecationWarning, stacklevel=5)


def _passes(fn, name: str) -> bool:
    """``fn`` takes ``name``: by that name, or through ``*args`` / ``**kwargs`` to its base."""
    params = inspect.signature(fn).parameters.values()
    return _accepts(fn, name) or any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params)


def _old_prefill(fn) -> bool:
    """A prefill of the old form: its second argument is ``tokens``, or it names a keyword that
    is now a Prompt field."""
    params = list(inspect.signature(fn).parameters.values())
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return positional[2:3] == ["tokens"] or any(
        p.name in _LEGACY_PREFILL_ALWAYS + _LEGACY_PREFILL_GIVEN for p in params)


def _inherited(cls, method: str) -> type:
    return next(c for c in cls.__mro__[1:] if method in c.__dict__)


def adopt_old_forms(cls, base: type) -> None:
    """A backend written before the Prompt (``prefill(seq, tokens, kv, *, tenant, ...)``),
    before ranges (``gather(seq)``) or before ``ledger(seqs)``: wrapped into today's signatures,
    with a DeprecationWarning naming the change."""
    own = cls.__dict__
    prefill = own.get("prefill")
    if prefill is not None and _old_prefill(prefill):
        if _inherited(cls, "prefill") is not base:
            raise TypeError(f"{cls.__qualname__}.prefill takes the old keyword form but overrides "
                            f"{_inherited(cls, 'prefill').__qualname__}.prefill, which takes a "
                            "Prompt: define prefill(self, seq, prompt, kv=None, *, step=0, "
                            "protect=())")
        _legacy(cls, "prefill", "(seq, tokens, kv, *, tenant, final_tokens, ...)",
                "(self, seq, prompt, kv=None, *, step=0, protect=()) taking a kvbench Prompt")
        cls.prefill = _prompt_prefill(prefill)
        if "prompt_tokens" in _prompt_prefill_given(prefill) and not cls.capabilities.chunked_prefill:
            cls.capabilities = replace(cls.capabilities, chunked_prefill=True)
    gather = own.get("gather")
    if gather is not None and not _passes(gather, "out"):
        ranged = _accepts(gather, "start")
        _legacy(cls, "gather", "(seq, start, stop)" if ranged else "(seq)",
                "(self, seq, start=0, stop=None, *, out=None)")
        cls.gather = _ranged_gather(gather, ranged)
    ledger = own.get("ledger")
    if ledger is not None and not getattr(ledger, "__isabstractmethod__", False) \
            and not _passes(ledger, "seqs"):
        _legacy(cls, "ledger", "()", "(self, seqs=None)")
        cls.ledger = _any_seqs_ledger(ledger)


def _today(old, new):
    """``new`` (today's signature) in place of ``old``: named as it, ``old_form`` pointing to it."""
    functools.update_wrapper(new, old)
    del new.__wrapped__  # inspect.signature must read today's signature, not the old one
    new.old_form = old
    return new


def _any_seqs_ledger(old):
    def ledger(self, seqs=None):
        return old(self)
    return _today(old, ledger)


def _prompt_prefill_given(old) -> list:
    """The Prompt fields an old prefill takes when given: those it names, all for ``**kw``."""
    params = inspect.signature(old).parameters
    anything = any(p.kind is p.VAR_KEYWORD for p in params.values())
    return [k for k in _LEGACY_PREFILL_GIVEN if anything or k in params]


def _prompt_prefill(old):
    given = _prompt_prefill_given(old)

    def prefill(self, seq, prompt, kv=None, *, step=0, protect=()):
        keys = {k: getattr(prompt, k) for k in given if getattr(prompt, k) is not None}
        return old(self, seq, prompt.tokens, kv, step=step, protect=protect,
                   **{k: getattr(prompt, k) for k in _LEGACY_PREFILL_ALWAYS}, **keys)
    return _today(old, prefill)


def _ranged_gather(old, ranged: bool):
    def gather(self, seq, start=0, stop=None, *, out=None):
        if ranged:
            return gathered_range(old(self, seq, start, stop), out=out)
        return gathered_range(old(self, seq), start, stop, out)
    return _today(old, gather)


def takes_lifecycle(backend: Backend, lifecycle: str) -> bool:
    """Whether ``backend`` implements a scheduler lifecycle of SPEC §13: 'speculative' (its own
    accept), 'chunked' (it declares ``chunked_prefill``), 'preempt' (its own preempt and
    resume: otherwise a preemption is a free, a resume a prefill)."""
    if lifecycle == "speculative":
        return type(backend).accept is not Backend.accept
    if lifecycle == "chunked":
        return backend.capabilities.chunked_prefill
    if lifecycle == "preempt":  # told as a preemption: its own preempt and resume
        return type(backend).preempt is not Backend.preempt
    raise ValueError(f"unknown lifecycle {lifecycle!r}")


def takes_lookup(backend: Backend) -> bool:
    """Whether ``backend`` takes SPEC §11's ``lookup`` (pinning what a load of a prompt would read
    until the load, an abort or a free): it defines ``lookup``."""
    return callable(getattr(backend, "lookup", None))


def publishes_events(backend: Backend) -> bool:
    """Whether ``backend`` publishes KV events (SPEC §14): it defines its own ``events()``."""
    return getattr(type(backend), "events", Backend.events) is not Backend.events


# K/V values of writer w at position p: ((w * 7919 + p * 131 + 3) + 17 e) mod 2003 - 1001 for
# element e. As 17 is invertible mod the prime 2003, the row of base b is row 0 shifted by
# c = b / 17 (mod 2003): a window of one periodic 1-D array. Every row is a slice of it, so
# building n rows is one gather, with no arithmetic per element.
_KV_MOD = 2003
_INV17 = pow(17, -1, _KV_MOD)


@functools.lru_cache(maxsize=16)
def _kv_windows(elems: int, dtype: np.dtype) -> np.ndarray:
    ext = (np.arange(elems + _KV_MOD, dtype=np.int64) * 17 % _KV_MOD - 1001).astype(dtype)
    windows = np.lib.stride_tricks.sliding_window_view(ext, elems)
    windows.flags.writeable = False
    return windows


def kv_tokens(writers, positions, model: ModelSpec, dtype=np.float16) -> np.ndarray:
    """The K/V that ``writers[i]`` writes at ``positions[i]``: ``[n, 2, layers, kv_heads, head_dim]``.

    Small integers, exact in float16, that differ by writer, position, K/V, layer, head and
    channel: a gathered value read from the wrong slot or written by the wrong sequence shows.
    Element ``e`` (row-major over ``[2, layers, kv_heads, head_dim]``) of writer ``w`` at
    position ``p`` is ``(w * 7919 + p * 131 + e * 17 + 3) mod 2003 - 1001``.
    """
    shape = model.kv_shape
    w = np.asarray(writers, dtype=np.int64).reshape(-1)
    p = np.asarray(positions, dtype=np.int64).reshape(-1)
    shift = (w * 7919 + p * 131 + 3) % _KV_MOD * _INV17 % _KV_MOD
    return _kv_windows(int(np.prod(shape)), np.dtype(dtype))[shift].reshape((-1,) + shape)


def hash_writer(block_hash) -> int:
    """The pseudo-writer of a hashed block's K/V: equal hashes mean equal prefixes, equal K/V."""
    if isinstance(block_hash, int) and not isinstance(block_hash, bool):
        key = block_hash
    else:
        key = zlib.crc32(repr(block_hash).encode() if isinstance(block_hash, tuple)
                         else str(block_hash).encode())
    return -1 - (key % (1 << 31))


def content_segments(seq: int, tokens: int, keys, block_size: int, start: int = 0) -> list:
    """[(writer, start, count)]: who wrote positions ``start .. tokens-1`` of a prompt. A keyed
    block (``keys`` by position) holds what its key determines, the same for every sequence with
    that key, written whole or in chunks; the rest is the sequence's own."""
    B, segments = block_size, []
    for i in range(start // B, min(len(keys), -(-tokens // B))):
        lo, hi = max(start, i * B), min(tokens, (i + 1) * B)
        segments.append((hash_writer(keys[i]), lo, hi - lo))
    done = max(start, len(keys) * B)
    if tokens > done:
        segments.append((seq, done, tokens - done))
    return segments


def appended_segments(seq: int, start: int, count: int, chunk_keys, block_size: int, draft: int = 0,
                      step: int = 0) -> list:
    """Who writes positions ``start .. start+count-1`` of ``seq``: a block of its chunked prompt
    (``chunk_keys``) holds its key's K/V; of the rest, the last ``draft`` are a draft's (a writer
    per step, so a rolled-back position written again reads differently), the others its own."""
    stop = start + count
    segments = content_segments(seq, stop - draft, chunk_keys, block_size, start) if chunk_keys else \
        [(seq, start, count - draft)] if count > draft else []
    if draft:
        segments.append((draft_writer(seq, step), stop - draft, draft))
    return segments


def draft_writer(seq: int, step: int) -> int:
    """The pseudo-writer of the draft tokens ``seq`` wrote at ``step`` (SPEC §13)."""
    return hash_writer(("draft", seq, step))


def cut_segments(segments, length: int) -> list:
    """[(writer, start, count)] cut to the positions below ``length``."""
    return [(w, start, min(count, length - start)) for w, start, count in segments if start < length]


def group_view(kv, layers: tuple, model: ModelSpec):
    """The part of ``kv`` (``[tokens, 2, layers, ...]``) a group's blocks hold: its layers."""
    if len(layers) == model.layers:
        return kv
    return kv[:, :, list(layers)]


def advance_state(state, kv) -> np.ndarray:
    """A state group's state after the tokens ``kv`` (``[tokens, *slot shape]``, the group's
    layers), from ``state`` (None: a fresh state, zeros): the sum of every token's K/V mod 2003,
    as a NumPy int64 array. kvbench's stand-in for a Mamba or linear-attention recurrence: a state
    that started from another's values, or sits at another length, holds other numbers; in
    0 .. 2002 it is exact in float16."""
    x = np.asarray(kv).astype(np.int64).sum(axis=0)
    return (x if state is None else np.asarray(state).astype(np.int64) + x) % _KV_MOD


def kv_values(writer: int, start: int, count: int, model: ModelSpec, dtype=np.float16) -> np.ndarray:
    """The K/V that sequence ``writer`` writes at positions ``start .. start+count-1``."""
    return kv_tokens(np.full(count, writer), np.arange(start, start + count), model, dtype)


__all__ = ["OutOfMemory", "Prompt", "CacheConfig", "Capabilities", "Ledger", "LEDGER_FIELDS",
           "REPORTED_FIELDS", "BlockState", "BlockChanges", "Backend",
           "kv_tokens", "Refusal",
           "kv_values", "advance_state", "hash_writer", "content_segments", "appended_segments",
           "draft_writer", "cut_segments", "group_view", "gathered_range", "takes_lifecycle",
           "takes_lookup", "publishes_events"]
