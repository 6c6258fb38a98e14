"""What a run sets over every trace it checks, typed and resolved once: :class:`RunSettings`.

The command line (`kvbench run`, `check`, `shrink`, `gates`), a sweep's grid cell and the asv
suite's replays give the same few settings; each trace's header suggests its own, and the
defaults fill the rest. :meth:`RunSettings.config` is that resolution, the one place a
``CacheConfig`` is made from settings and a trace. Sizes have one grammar: a budget in blocks is
a plain integer (``1024``, ``"1024"``, ``"1024 blocks"``), in bytes it needs a unit (``"12GiB"``).
"""
from __future__ import annotations

import dataclasses
import os

from kvbench.contract import formulas as F
from kvbench.contract.protocol import CacheConfig
from kvbench.model import eviction
from kvbench.traces.format import INT64_MAX, Trace, TraceError

POLICIES = tuple(eviction.POLICIES)  # the device eviction policies kvbench/model/eviction.py has
INDEX_BYTES_PER_BLOCK = 64  # a pool's arrays per block without K/V: ids, counts, tables (generous)


def _count(most: int):
    def check(v) -> str:
        ok = isinstance(v, int) and not isinstance(v, bool) and 0 < v <= most
        return "" if ok else f"must be a positive integer{f' (at most {most:,})' if most < INT64_MAX else ''}"
    return check


def one_of(*names):
    """The check of a setting whose value is one of ``names``."""
    return lambda v: "" if v in names else f"must be one of {', '.join(names)}"


def flag(v) -> str:
    """The check of a true-or-false setting."""
    return "" if isinstance(v, bool) else "must be true or false"


def _text(v) -> str:
    return "" if isinstance(v, str) and v else "must be a non-empty string"


def _budget(v) -> str:
    ok = (isinstance(v, int) and not isinstance(v, bool) and v > 0) or (isinstance(v, str) and v)
    return "" if ok else "must be blocks (1024, '1024') or bytes ('12GiB')"


def _setting(default, check):
    return dataclasses.field(default=default, metadata={"check": check})


@dataclasses.dataclass(frozen=True)
class RunSettings:
    """A run's settings over every trace (None: the trace header's suggestion, then the default).

    Each field carries the check of its values (``metadata["check"]``): a grid is typed against
    these before its first cell runs, and a RunSettings made with a wrong value says which.
    """

    model: str | None = _setting(None, _text)  # a preset (default: the header's, else tiny)
    block_size: int | None = _setting(None, _count(F.MAX_BLOCK_SIZE))  # default 16
    budget: str | int | None = _setting(None, _budget)  # blocks ('1024') or bytes ('12GiB')
    max_context: int | None = _setting(None, _count(INT64_MAX))  # contiguous `max`: pow2 of longest
    device: str = _setting("cpu", _text)  # the torch backend's
    store_kv: bool | None = _setting(None, flag)  # default: the header's, else yes
    prefix_caching: bool | None = _setting(None, flag)  # default: on for a hashed trace

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            why = "" if v is None else f.metadata["check"](v)
            if why:
                raise ValueError(f"--{f.name.replace('_', '-')}: {why}, got {v!r}")

    @classmethod
    def names(cls) -> tuple:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def problem(cls, name: str, value) -> str:
        """Why ``value`` is not a value of setting ``name`` ('' when it is)."""
        return {f.name: f for f in dataclasses.fields(cls)}[name].metadata["check"](value)

    def config(self, trace: Trace, policy: str | None = None) -> CacheConfig:
        """The CacheConfig of ``trace`` under ``policy``: these settings first, then the trace
        header's suggestions, then defaults.

        A header whose settings say ``store_kv: false`` (a long history, whose point is the
        bookkeeping) is checked ledger-only unless the settings say otherwise. Prefix caching is
        on by default for a trace whose prefills carry block hashes or token ids. A header that
        names KV cache groups re-shapes the model's layers into them. The default ``max_context``
        of the contiguous baseline is the next power of two of the trace's longest sequence, so
        that `max` reservation can run every trace.
        """
        groups, where = trace.header.groups, trace.path or trace.name
        try:
            return self.resolve(trace.header.settings, longest=max(trace.final_lengths().values(),
                                                                    default=1),
                                hashed=trace.names_prompt_blocks(), tenants=trace.header.tenants,
                                groups=groups, policy=policy, name=trace.name)
        except _GroupsError as e:  # the header's groups, for the model of this run
            raise TraceError(f"'groups': {e}", where, 1) from None

    def resolve(self, suggested: dict, *, longest: int, hashed: bool, tenants=None, groups=None,
                policy: str | None = None, name: str = "") -> CacheConfig:
        """The CacheConfig of these settings over ``suggested`` (a trace header's settings, or a
        command's own defaults: model, block_size, budget or num_blocks, max_context, store_kv,
        prefix_caching), for sequences of at most ``longest`` tokens whose prompts name their
        blocks (``hashed``) or not."""
        s = suggested
        spec = F.get_model(self.model or s.get("model", "tiny"))
        if groups:  # the trace names the model's KV cache groups (SPEC §8)
            try:
                spec = F.with_group_kinds(spec, groups)
            except ValueError as e:
                raise _GroupsError(str(e)) from None
        bs = int(self.block_size or s.get("block_size", 16))
        if bs <= 0:
            raise ValueError(f"--block-size: must be a positive integer, got {bs}")
        budget = self.budget if self.budget is not None else s.get("budget")
        blocks = blocks_of_budget(budget, bs, spec) if budget is not None \
            else int(s.get("num_blocks", 256))
        mc = self.max_context or s.get("max_context") or F.next_pow2(longest)
        if int(mc) <= 0:
            raise ValueError(f"--max-context: must be a positive integer, got {mc}")
        prefix_caching = self.prefix_caching
        if prefix_caching is None:
            prefix_caching = bool(s.get("prefix_caching", hashed))
        if prefix_caching and hashed and s.get("block_size", bs) != bs:
            raise ValueError(f"{name}: block hashes are for block size {s['block_size']}, "
                             f"not {bs}")
        if blocks * INDEX_BYTES_PER_BLOCK > machine_memory() // 4:
            raise ValueError(f"--budget {budget}: {blocks:,} blocks of {bs} tokens of "
                             f"{spec.name}: even a ledger-only pool's own bookkeeping (about "
                             f"{INDEX_BYTES_PER_BLOCK} B a block) would not fit this machine's "
                             f"{machine_memory() / 2**30:,.1f} GiB")
        store_kv = self.store_kv
        if store_kv is None:
            store_kv = bool(s.get("store_kv", True))
        if store_kv and blocks * F.block_bytes(bs, spec) > machine_memory():
            store_kv = False  # ledger only: memory_note() says so
        return CacheConfig(model=spec, block_size=bs, num_blocks=blocks, store_kv=store_kv,
                           device=self.device, max_context=int(mc), policy=policy,
                           tenant_weights=dict(tenants or {}), prefix_caching=prefix_caching,
                           kv_format=s.get("kv_format"))


class _GroupsError(ValueError):
    """A header's KV cache groups do not fit the run's model."""


def blocks_of_budget(budget, block_size: int, spec) -> int:
    """The blocks a ``--budget`` holds; a ValueError naming the option for a budget that does not
    parse or holds less than one block."""
    try:
        blocks = F.budget_blocks(budget, block_size, spec)
    except ValueError as e:
        raise ValueError(f"--budget: {e}") from None
    if blocks < 1:
        raise ValueError(f"--budget {budget}: less than one block (a block of {block_size} tokens of "
                         f"{spec.name} is {F.block_bytes(block_size, spec):,} bytes)")
    return blocks


def machine_memory() -> int:
    """Bytes of memory this machine has (the most K/V a pool here can hold)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # not POSIX: no limit known
        return 1 << 62


__all__ = ["RunSettings", "POLICIES", "blocks_of_budget", "flag", "machine_memory", "one_of"]
