"""Whether a backend can run a trace: '' or why not, decided in one place from what the trace
uses (``trace_uses``) and what the backend declares: its group kinds, its rule set, the
operations it takes (SPEC §13's lifecycles, fork, salts) and its tiers (SPEC §11). Each reason
is a Refusal (kvbench.contract.protocol), one shape: who does not do what (SPEC §N), and what
the trace, the model or the settings need of it.
"""
from __future__ import annotations

from kvbench.contract.protocol import (MODEL, TIER_REPLAY, Backend, Refusal, refuse_model, takes_lifecycle,
                                       takes_lookup)
from kvbench.model.kinds import kind_of
from kvbench.model.rules import rule_set
from kvbench.model.tiers import evictless_modes, failed_load_modes
from kvbench.traces.builder import tier_blocks
from kvbench.traces.columns import OpTable
from kvbench.traces.format import Trace


def lifecycle(trace: Trace) -> set:
    """The scheduler lifecycles (SPEC §13) the trace uses: 'speculative' (an accept), 'chunked'
    (a prefill of a prompt's first chunk), 'preempt', 'swap' (a preempt by swap)."""
    return trace_uses(trace) & {"speculative", "chunked", "preempt", "swap"}


def trace_uses(trace: Trace) -> set:
    """What the trace asks of a backend: its lifecycles (``lifecycle``), 'fork', 'salted' (a
    prefill names a salt, an adapter or token ids), 'transfers' (a store or a load) and 'lookup'
    (a lookup before a load)."""
    ops = trace.ops
    used = set()
    table = isinstance(ops, OpTable)
    if table:  # its forks counted in its columns, its prefills' keys apart
        if ops.count("fork"):
            used.add("fork")
        if ops.keys:
            used.add("salted")
        ops = ops.side.values()  # the operations its columns do not hold: every kind below
    for op in ops:
        kind = op.kind
        if kind == "accept":
            used.add("speculative")
        elif kind == "preempt":
            used.update(("preempt", "swap") if op.mode == "swap" else ("preempt",))
        elif kind == "prefill":
            if op.prompt_tokens is not None:
                used.add("chunked")
            if not table and (op.salt or op.adapter or op.token_ids):
                used.add("salted")
        elif kind == "fork" and not table:
            used.add("fork")
        elif kind in ("store", "load"):
            used.add("transfers")
        elif kind == "lookup":
            used.update(("transfers", "lookup"))
    return used


def applicable(trace: Trace, backend: Backend) -> str:
    """'' when the backend can run the trace, else why not (a Refusal's one shape)."""
    refusal = refuse(trace, backend)
    return str(refusal) if refusal else ""


def refuse(trace: Trace, backend: Backend) -> Refusal | None:
    """None when the backend can run the trace, else why not."""
    caps, cfg = backend.capabilities, backend.config
    model, name = cfg.model, backend.name
    uses = trace_uses(trace)
    refused = refuse_model(name, caps, model)
    if refused:
        return refused
    try:
        rules = rule_set(caps)
    except ValueError as e:  # the backend's declaration, named as its
        raise ValueError(f"{name}'s Capabilities: {e}") from None
    if rules.hit_drops_last_block and any(g.releases for g in model.kv_groups):
        return Refusal(MODEL, "drop an EAGLE hit's last block beside windows", "SPEC §8",
                       f"{name} declares hit_drops_last_block and model {model.name} has "
                       f"{', '.join(g.kind for g in model.kv_groups)}")
    if not caps.fork and "fork" in uses:
        return Refusal(name, "support fork", "SPEC §2", "the trace forks")
    if cfg.policy and cfg.policy not in caps.eviction:
        return Refusal(name, f"implement eviction policy {cfg.policy!r}", "SPEC §5",
                       "the run evicts under it")
    if cfg.prefix_caching and caps.prefix_caching and not caps.cache_salt and "salted" in uses:
        # Its cache would share blocks across the salts and adapters it is never told.
        return Refusal(name, "declare cache_salt", "SPEC §9", "the trace's prompts carry salts, "
                       "adapters or token ids, which it cannot take")
    return _lifecycles(uses, backend) or _tiers(trace, uses, backend)


def _lifecycles(uses: set, backend: Backend) -> Refusal | None:
    caps, cfg, name = backend.capabilities, backend.config, backend.name
    if "speculative" in uses:
        if not takes_lifecycle(backend, "speculative"):
            return Refusal(name, "roll back draft tokens with accept", "SPEC §13",
                           "the trace accepts drafts (speculative decoding)")
        # Each kind says whether the model rolls its drafts back.
        kinds = [kind_of(g, cfg.block_size) for g in cfg.model.kv_groups]
        unmodelled = [(g, k) for g, k in zip(cfg.model.kv_groups, kinds) if k.rollback_needs]
        if unmodelled:
            needs = " and ".join(dict.fromkeys(k.rollback_needs for _, k in unmodelled))
            return Refusal(MODEL, f"roll back drafts over {', '.join(g.kind for g, _ in unmodelled)} "
                           f"groups", "SPEC §13", f"the trace accepts drafts on model "
                           f"{cfg.model.name}, which would need {needs}")
    if "swap" in uses and caps.tiers and not caps.swap:  # without tiers: _tiers says so
        return Refusal(name, "preempt by swap over its tiers", "SPEC §13",
                       "the trace swaps sequences out (swap_out, swap_in)")
    if "chunked" in uses and not takes_lifecycle(backend, "chunked"):
        return Refusal(name, "take a prompt in chunks with chunked_prefill", "SPEC §13",
                       "the trace prefills prompts in chunks")
    return None


def _tiers(trace: Trace, uses: set, backend: Backend) -> Refusal | None:
    """The tier replay's part (SPEC §11; kvbench.checking.tier_replay replays them)."""
    tiers = trace.header.tiers
    if not tiers:
        return None
    caps, cfg, name = backend.capabilities, backend.config, backend.name
    names = ", ".join(t.name for t in tiers)
    if not caps.tiers:
        moves = "stores to and loads from" if "transfers" in uses else "swaps sequences out to"
        return Refusal(name, "declare tiers", "SPEC §11", f"the trace {moves} {names}")
    missing = sorted({t.policy for t in tiers} - set(caps.tiers))
    if missing:
        return Refusal(name, f"run tier policy {missing[0]!r}, only {', '.join(caps.tiers)}",
                       "SPEC §11", f"the trace's tiers {names} use it")
    modes = failed_load_modes(caps.tier_rules)
    drops = [t.name for t in tiers if t.failed_load not in modes]
    if drops:
        failed = next(t.failed_load for t in tiers if t.name == drops[0])
        return Refusal(name, f"{failed} a failed load's tier entries, only "
                       f"{', '.join(modes)}", "SPEC §11",
                       f"the trace's tier {drops[0]} declares failed_load {failed!r}")
    over = evictless_overflow(trace, backend)
    if over:
        tier, stored = over
        return Refusal(name, f"evict from its tiers of failed_load {tier.failed_load!r}", "SPEC §11",
                       f"the trace may store {stored} blocks into tier {tier.name}, of capacity "
                       f"{tier.capacity}")
    if "lookup" in uses and not takes_lookup(backend):
        return Refusal(name, "look a prompt up in its tiers before its load (lookup)", "SPEC §11",
                       "the trace looks prompts up, pinning what they find until their load or abort")
    if cfg.model.hybrid:
        return Refusal(TIER_REPLAY, "run models of more than one full-attention group", "SPEC §11",
                       f"model {cfg.model.name} has {', '.join(g.kind for g in cfg.model.kv_groups)}")
    if not (cfg.prefix_caching and caps.prefix_caching) and "transfers" in uses:  # a swap needs no hash
        return Refusal(name, "cache prefixes in this run", "SPEC §11", "the trace stores and "
                       "loads blocks a tier holds by their hashes")
    if cfg.policy:
        return Refusal(TIER_REPLAY, "run with an eviction policy", "SPEC §11",
                       f"the run evicts under {cfg.policy!r} (a load in flight is never a victim yet)")
    return None


def evictless_overflow(trace: Trace, backend) -> tuple | None:
    """(the first tier, the blocks the trace may store into it) of the trace's tiers the backend
    runs on a tier that evicts nothing (tier rule ``drop_tiers_evict_nothing``) and that the trace may
    fill past its capacity (:func:`kvbench.traces.builder.tier_blocks`); None if none."""
    modes = evictless_modes(backend.capabilities.tier_rules)
    tiers = [t for t in trace.header.tiers if t.failed_load in modes]
    if not tiers:
        return None
    stored = tier_blocks(trace.ops, backend.config.block_size, trace.header.tiers[0].name)
    return next(((t, stored[t.name]) for t in tiers if stored.get(t.name, 0) > t.capacity), None)


__all__ = ["applicable", "evictless_overflow", "lifecycle", "refuse", "trace_uses"]
